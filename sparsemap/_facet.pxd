# The facet side: SparseMAP solved as a projection held by its tight constraints
# (docs/solvers.rst, "Two representations"). One FacetSolver subclass per family
# with a compact constraint description (non-projective trees, sequences,
# matchings), each in a module of its own (_facet_tree, _facet_sequence,
# _facet_matching); the solvers' layer picks this side or the active set's per
# problem.
from sparsemap._factors._base cimport Factor


# What a facet-side solution keeps for its backward pass: family-specific ints
# (positive coordinates, active rows, a basis) and doubles (a small factorisation),
# in two malloc'ed arrays that the state owns. An all-zero state is empty.
cdef struct FacetState:
    int* ints
    double* reals
    Py_ssize_t n_ints, n_reals


# Make room for exactly n_ints ints and n_reals doubles (contents not kept).
cdef int state_resize(FacetState* st, Py_ssize_t n_ints, Py_ssize_t n_reals) except -1 nogil
# Free both arrays and zero the state.
cdef void state_clear(FacetState* st) noexcept nogil
# dst <- a copy of src (dst's old arrays freed).
cdef int state_copy(FacetState* dst, const FacetState* src) except -1 nogil

# Each family keeps its state in one typed layout: a header struct of ints at the
# start of `ints` (copied in and out with memcpy, as the ints are not declared as
# that struct), and one function that computes every offset and size from it,
# called by the writer and by the reader alike. The reader checks the state against
# that layout with these two before indexing (a state may come from a pickle or
# from another solver); both raise ValueError.
# st holds at least n_ints ints (the header): a declined solve leaves none.
cdef int state_check_header(const FacetState* st, Py_ssize_t n_ints) except -1 nogil
# st holds exactly the n_ints ints and n_reals doubles its layout computes.
cdef int state_check_sizes(const FacetState* st, Py_ssize_t n_ints,
                           Py_ssize_t n_reals) except -1 nogil


cdef enum:
    FACET_SOLVED = 0     # u, v optimal up to round-off; the KKT residuals are reported
    FACET_DECLINED = 1   # not solved here (budget spent, masks it does not handle,
                         # residuals too large): the caller takes the vertex side


cdef class FacetSolver:
    # The factor this solver projects onto; its shapes are the solver's.
    cdef readonly Factor factor
    # Decline at once at peaked scores, where the vertex side is cheaper (the
    # automatic choice); False when the facet side is asked for by name.
    cdef readonly bint decline_peaked

    # SparseMAP for (eta_u, eta_v) (flat float64, eta_v NULL when factor.n_v == 0):
    # u (n_u) and v (n_v) written, the backward data into st, the iteration count
    # into n_iter[0] and the largest primal and dual residuals of the KKT system
    # (absolute, in the units of the scores) into residuals[0], residuals[1].
    # Returns FACET_SOLVED or FACET_DECLINED; at most `budget` iterations.
    # Thread-safe: all state is in the arguments (scratch is malloc'ed per call).
    cdef int c_solve(self, const double* eta_u, const double* eta_v, double* u, double* v,
                     FacetState* st, Py_ssize_t budget, Py_ssize_t* n_iter,
                     double* residuals) except -1 nogil

    # The Jacobian of u with respect to (eta_u, eta_v) at a solution, from its state:
    # transpose=0 (jvp): out_u = J_u in_u + J_v in_v (in_v NULL: zeros);
    # transpose=1 (vjp): out_u = J_u^T in_u, and out_v = J_v^T in_u unless out_v is NULL.
    # c_solve started from prev, the state of an earlier solve by this solver at nearby
    # scores (the previous step of an iteration, as in a factor graph's ADMM): the same
    # contract, point and exactness as c_solve, in fewer iterations where the family's
    # algorithm can use it. prev may be empty (a declined solve, or none yet) and must not
    # be st. Optional: this default ignores prev; the tree's solver overrides it (it
    # starts from prev's tight cuts).
    cdef int c_solve_warm(self, const double* eta_u, const double* eta_v, double* u,
                          double* v, FacetState* st, const FacetState* prev,
                          Py_ssize_t budget, Py_ssize_t* n_iter,
                          double* residuals) except -1 nogil

    cdef int c_apply(self, const FacetState* st, const double* in_u, const double* in_v,
                     double* out_u, double* out_v, bint transpose) except -1 nogil


# A solve's outcome, for tests and the Python-level solvers' layer.
cdef class FacetSolution:
    cdef FacetState st
    cdef public FacetSolver solver
    cdef public object u, v, residuals
    cdef public int status
    cdef public Py_ssize_t n_iter


# The peaked-score tests (each family's decline_peaked rule) look at the gap between
# the best and the second-best score of a simplex block: a block's sparsemax has a
# single nonzero exactly when that gap is at least 1. Folds x[0], x[stride], ...,
# x[(n - 1) stride] into the two largest values seen, b1 >= b2 (start both at -inf;
# -inf entries leave them unchanged), without branches on the data.
cdef inline void top2(const double* x, Py_ssize_t n, Py_ssize_t stride, double* b1,
                      double* b2) noexcept nogil:
    cdef Py_ssize_t i
    cdef double v, lo, a = b1[0], b = b2[0]
    for i in range(n):
        v = x[i * stride]
        lo = a if a < v else v
        b = b if b > lo else lo
        a = a if a > v else v
    b1[0] = a
    b2[0] = b
