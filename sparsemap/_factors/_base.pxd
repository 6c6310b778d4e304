# The C-level vertex/column interface shared by every factor.
#
# A structure is a fixed-length array of C ints (``struct_size`` of them): the
# compact form of docs/factors.rst (tags, heads, a column per row, a column index).
# Scores are flat C-contiguous float64 arrays of length ``n_u`` and ``n_v``.
# Every method returns 0 on success and -1 with a Python exception set on error,
# so factors written in Python (which need the GIL) fit the same interface;
# typed factors never fail and the check costs one comparison.
#
# Masks. A score of -inf forbids a part, and c_map must then return a
# structure using no forbidden part whenever one exists. Max-sum recursions
# and argmax / sort oracles do this unchanged (-inf + x = -inf, and -inf never
# wins a comparison); guard subtractions of two scores (inf - inf is nan) and
# scalings such as max |eta| against infinite entries. When every structure
# uses a forbidden part, c_map returns 1 (or any structure: its -inf score
# tells the solvers); callers then raise a ValueError. c_score of a structure
# that avoids the forbidden parts must stay finite: with explicit columns,
# skip the parts a structure does not use (0 * -inf is nan). Entries c_map
# never reads are listed by the Python hook _ignored_entries and accept any
# value. u, and both Jacobian products, are then exactly 0 on forbidden parts
# without further work, since no structure in a support uses one.

cdef class Factor:
    cdef readonly Py_ssize_t n_u          # length of the flattened eta_u / u
    cdef readonly Py_ssize_t n_v          # length of the flattened eta_v / v
    cdef readonly Py_ssize_t struct_size  # ints in one compact structure
    cdef readonly Py_ssize_t work_bytes   # scratch space c_map needs
    cdef readonly tuple shape_u
    cdef readonly tuple shape_v

    # Called once by each subclass's __init__.
    cdef int _set_shapes(self, tuple shape_u, tuple shape_v, Py_ssize_t struct_size,
                         Py_ssize_t work_bytes) except -1

    # Best structure for scores (eta_u, eta_v), written to out[:struct_size].
    # work points to at least work_bytes bytes, 16-byte aligned, owned by the caller.
    # Returns 1 when every structure uses a forbidden part (see Masks above).
    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil
    # out[0] = a_s . [eta_u; eta_v]  (eta_v may be NULL when n_v == 0)
    cdef int c_score(self, const int* s, const double* eta_u, const double* eta_v,
                     double* out) except -1 nogil
    # out[0] = m_s . m_t
    cdef int c_overlap(self, const int* s, const int* t, double* out) except -1 nogil
    # u += w m_s ; v += w n_s  (v may be NULL when n_v == 0)
    cdef int c_add(self, const int* s, double w, double* u, double* v) except -1 nogil
    # 1 if s[:struct_size] is a valid structure, else 0 (the batch losses check their
    # targets with it). The default asks the Python hook _validate_structure, with the
    # GIL; typed families check in C.
    cdef int c_valid(self, const int* s) except -1 nogil


# Value classes found by _scan (declared here for the batch runner, which scans
# the blocks it copies out of padded score arrays).
cdef enum:
    HAS_NEGINF = 1   # -inf somewhere: a forbidden part
    HAS_BAD = 2      # nan or +inf somewhere

# HAS_NEGINF | HAS_BAD flags of x[:n], in one vectorisable pass.
cdef int _scan(const double* x, Py_ssize_t n) noexcept nogil
