# The active-set workspace at C level, for solvers built on top of it (the
# factor graph runs one warm-started workspace per factor, without the GIL; the
# batch runner, sparsemap._batch, one per thread and factor), and the small
# helpers they share.
from cpython.ref cimport PyObject

from sparsemap._factors._base cimport Factor


cdef extern from *:
    """
    /* A monotonic clock in seconds, without the GIL, on POSIX and Windows. */
    #if defined(_WIN32)
    #include <windows.h>
    static double sm_now(void) {
        LARGE_INTEGER f, c;
        QueryPerformanceFrequency(&f);
        QueryPerformanceCounter(&c);
        return (double) c.QuadPart / (double) f.QuadPart;
    }
    #else
    #include <time.h>
    static double sm_now(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return ts.tv_sec + 1e-9 * ts.tv_nsec;
    }
    #endif
    """
    double sm_now() noexcept nogil


cdef inline double _now() noexcept nogil:
    return sm_now()


# Termination codes, shared with the conditional-gradient solvers and solve().
cdef enum:
    RUNNING = 0
    CONVERGED = 1
    MAX_ITER = 2
    STALLED = 3   # no further progress possible in double precision
    INFEASIBLE = 4  # every structure uses a forbidden (-inf) part: nothing was solved
    STOPPED = 5   # the callback asked to stop
    FACE_INCOMPLETE = 6   # converged, but max_iter MAP calls did not certify the face


# Shared by the active set and the factor graph. Four partial sums: one running
# sum is a chain of dependent additions, four times slower on long vectors.
cdef inline double _dot(const double* a, const double* b, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i, m = n - n % 4
    cdef double a0 = 0, a1 = 0, a2 = 0, a3 = 0
    for i in range(0, m, 4):
        a0 += a[i] * b[i]
        a1 += a[i + 1] * b[i + 1]
        a2 += a[i + 2] * b[i + 2]
        a3 += a[i + 3] * b[i + 3]
    for i in range(m, n):
        a0 += a[i] * b[i]
    return (a0 + a1) + (a2 + a3)


cdef inline unsigned long long _hash_structure(const int* s, Py_ssize_t k) noexcept nogil:
    """64-bit hash of a compact structure (FNV-1a over its ints, splitmix finish)."""
    cdef unsigned long long h = 14695981039346656037ULL
    cdef Py_ssize_t j
    for j in range(k):
        h = (h ^ <unsigned int> s[j]) * 1099511628211ULL
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL
    return h ^ (h >> 31)


cdef class _Workspace:
    cdef Factor f
    cdef Py_ssize_t k, n_u, n_v
    cdef Py_ssize_t cap, nI
    cdef double c              # the shift in G_c
    cdef int* S                # cap x k structures
    cdef double* y             # weights
    cdef double* yhat          # relaxed KKT solution
    cdef double* theta         # scores a_t . eta, shifted by theta0
    cdef double* theta_abs     # |a_t| . |eta|, for the tolerance scale
    cdef double* L             # cap x cap, row-major lower triangular
    cdef double* x1            # scratch
    cdef double* w1            # L^{-1} theta, kept up to date with L
    cdef double* w2            # L^{-1} 1
    cdef double* rot           # _remove's Givens rotations (2 x cap: cosines, sines)
    cdef double theta0
    cdef double* u
    cdef double* v
    cdef double* adj           # eta_u - u
    cdef double* dvec          # face completion: the probing direction (n_u)
    cdef double* pert          # face completion: perturbed scores (n_u)
    cdef const double* rv      # untying: the tie-breaking direction r (n_v, shared)
    cdef const double* rc      # untying: the direction that checks an untied face (shared)
    cdef object tie_keep       # the arrays behind rv and rc
    cdef double* pv            # untying: perturbed eta_v (n_v)
    cdef double* qv            # untying: eta_v perturbed again, to probe (n_v)
    cdef int* log              # with log_on, every structure _run inserted (n_log x k):
    cdef Py_ssize_t n_log, cap_log   # the first candidates of the face completion
    cdef bint log_on
    cdef int* snew
    cdef char* work
    cdef const double* eta_u
    cdef const double* eta_v
    cdef double* abs_eu        # |eta_u|, |eta_v| (n_u + n_v doubles, one block)
    cdef double* abs_ev
    cdef Py_ssize_t n_map
    cdef unsigned long long hash   # order-independent hash of the support
    cdef void* callback            # a Python callable (borrowed) called per iteration, or NULL

    cdef void _set_eta(self, const double* eu, const double* ev) noexcept nogil
    cdef int _grow(self, Py_ssize_t new_cap) except -1 nogil
    cdef void _solve_lower(self, double* x) noexcept nogil
    cdef void _solve_upper(self, double* x) noexcept nogil
    cdef void _relaxed_kkt(self) noexcept nogil
    cdef Py_ssize_t _find(self, const int* s) noexcept nogil
    cdef int _append(self, const int* s, const double* lrow, double diag, double w) except -1 nogil
    cdef void _remove(self, Py_ssize_t r) noexcept nogil
    cdef int _insert(self, const int* s, double w) except -1 nogil
    cdef int _rebuild(self) except -1 nogil
    cdef int _compute_u(self, const double* w, bint with_v) except -1 nogil
    cdef int _refine(self, double below) except -1 nogil
    cdef double _linear(self) noexcept nogil
    cdef double _linear_abs(self) noexcept nogil
    cdef int _gap(self, double* gap, double* scale, double* obj, bint have_u=*) except -1 nogil
    cdef int _start(self, const int* S, Py_ssize_t n, const double* weights) except -1 nogil
    cdef void _drop_below(self, double threshold) noexcept nogil
    cdef int _rescore(self, const double* eta_u, const double* eta_v) except -1 nogil
    cdef void _jacobian(self, double* x) noexcept nogil
    cdef int _append_face(self, const int* s) except -1 nogil
    cdef object _export(self)


# The scales of a face completion: the maximum adjusted score, the tie tolerance
# and the last perturbation size that stayed in the face.
cdef struct _FaceScale:
    double s_ref, tau, eps


# Face completion after a converged solve (weight-0 rows appended): returns
# FACE_CERTIFIED, FACE_BUDGET or FACE_UNRESOLVED; its scales into fs (or NULL);
# u: the solution's u (NULL: the rows' M y).
cdef int _complete(_Workspace ws, Py_ssize_t budget, double gap, _FaceScale* fs,
                   const double* u=*) except -1 nogil


# The loop: runs until converged, stalled or max_iter; hist (or NULL) gets
# 4 doubles per iteration. Returns the status code.
cdef int _run(_Workspace ws, Py_ssize_t max_iter, double tol, double* hist,
              Py_ssize_t* n_iter_out, double* gap_out, double* obj_out) except -1 nogil


cdef enum:
    FACE_CERTIFIED = 0    # a round of random directions found nothing new
    FACE_BUDGET = 1       # the MAP budget ran out first
    FACE_UNRESOLVED = 2   # near-ties below what double precision separates: stopped
    FACE_FIBERED = 3      # certified, but n is not affine in m on the face: to untie


cdef enum:
    # what _finish prepares for the backward pass
    BACKWARD_LAZY = 0  # the completed face, checked for fibers (FACE_FIBERED: untie later)
    BACKWARD_NOW = 1   # the completed face, a fibered one untied now
    BACKWARD_NONE = 2  # nothing: no derivative will be taken (losses; u and v as ever)


cdef struct _Sol:
    # Outcome of one solve: n_support rows S with weights y, in the solver's order,
    # which the backward pass uses as it is; u and v are flat. The first n_pos rows are
    # the support (weights > 0). Rows b0.. are the backward set, with its Cholesky
    # factor L ((n_support - b0)^2, row-major lower triangular). b0 = 0: the support,
    # then weight-0 rows completing it to span the optimal face. b0 = n_pos: the
    # backward set is another solve's (_untie), its rows weight 0 here. A solution of
    # a solver that keeps no factor (CG) has no L. One malloc'ed block, buf, holds
    # them all (NULL: nothing solved).
    void* buf
    int* S
    double* y
    double* L
    double* u
    double* v
    Py_ssize_t n_support, n_pos, b0, n_iter, n_map
    int status
    int face            # FACE_CERTIFIED, FACE_BUDGET, FACE_UNRESOLVED or FACE_FIBERED
    double gap, objective
    double seconds       # spent in the solve without the GIL (benchmarks)
    bint has_cholesky


cdef class _Solution:
    cdef public Factor factor
    cdef _Sol s
    cdef public object history


cdef class _Solutions:
    cdef _Sol* items
    cdef PyObject** factors      # per problem (borrowed from self.keep)
    cdef Py_ssize_t n
    cdef object keep


# One active-set solve into sol, its backward set prepared as backward says
# (BACKWARD_*); status INFEASIBLE when every structure is forbidden.
cdef int _solve_one(_Workspace ws, _Sol* sol, const double* eta_u, const double* eta_v,
                    const int* init, Py_ssize_t n_init, double* hist, Py_ssize_t max_iter,
                    double tol, int backward) except -1 nogil


# The Jacobian of a solution applied to a vector (Prop. 1): jvp (in_v may be NULL) or
# vjp (out_v may be NULL); x is scratch for 2 * (rows of the backward set) doubles.
cdef int _jacobian_apply(const _Sol* sol, Factor f, const double* in_u, const double* in_v,
                         double* out_u, double* out_v, double* x) except -1 nogil
