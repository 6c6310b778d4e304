# The active-set solver at C level: the workspace and the loop, for the modules
# built on it (sparsemap._backward: the backward set and the solution record;
# sparsemap._batch: the batch runner, one workspace per thread and factor; the
# factor graph: one warm-started workspace per factor), and the small helpers
# they share. Layers: _batch -> _backward -> _active_set -> the factors.
from libc.math cimport fabs
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


# Four partial sums: one running sum is a chain of dependent additions, four
# times slower on long vectors.
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


cdef inline double _maxabs(const double* x, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    cdef double m = 0.0
    for i in range(n):
        if fabs(x[i]) > m:
            m = fabs(x[i])
    return m


# The scale the convergence tolerance is relative to (gap_scale in Python):
# max(1, sum |eta . a| y + ||u||^2).
cdef inline double _gap_scale(double abs_linear, double usq) noexcept nogil:
    cdef double s = abs_linear + usq
    return s if s > 1.0 else 1.0


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
    cdef int* log              # with log_on, every structure _iterate inserted (n_log x k):
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


# Triangular solves with a row-major lower factor L (row stride lda):
# x <- L^{-1} x, and x <- L^{-T} x (with L transposed, hence _t).
cdef void _trsv_lower(const double* L, Py_ssize_t lda, Py_ssize_t n, double* x) noexcept nogil
cdef void _trsv_lower_t(const double* L, Py_ssize_t lda, Py_ssize_t n, double* x) noexcept nogil
# A NumPy copy of n doubles.
cdef object _copy_out(const double* p, Py_ssize_t n)
# out = x + eps g (x NULL: out = eps g), g uniform in [-1, 1)^n from the generator state.
cdef void _perturb(const double* x, double eps, double* out, Py_ssize_t n,
                   unsigned long long* state) noexcept nogil


# Point an empty workspace at new scores (the caller keeps them alive), fill |eta|.
cdef void _point(_Workspace ws, const double* eta_u, const double* eta_v) noexcept nogil


# The loop: runs until converged, stalled or max_iter; hist (or NULL) gets
# 4 doubles per iteration. Returns the status code.
cdef int _iterate(_Workspace ws, Py_ssize_t max_iter, double tol, double* hist,
                  Py_ssize_t* n_iter_out, double* gap_out, double* obj_out) except -1 nogil

