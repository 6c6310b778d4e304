"""Active-set solver for SparseMAP (Appendix A.2, Algorithm 2) and its backward pass.

The solver keeps the support ``I`` as compact structures and the Cholesky factor
``L`` of ``G_c = M_I^T M_I + c 1 1^T`` (``c > 0``). On the simplex ``1^T y = 1``
the shift changes neither the solution nor the Jacobian, and ``G_c`` is positive
definite exactly when the active columns are *affinely* independent, which is
the condition under which the KKT system (eq. 12) is nonsingular
(docs/solvers.rst, "The relaxed problem").

A structure entering appends a row to ``L`` (one triangular solve); one leaving
deletes a row and restores triangular form with Givens rotations. A structure
whose column is affinely dependent on the active ones gives its dependence
coefficients from the same triangular solve; the weights then move along that
null direction (``u`` unchanged) until one reaches zero, which leaves, and the
new structure enters in its place.

The loop never builds a dense column: Gram entries come from the factor's
``c_overlap``, scores from ``c_score`` and ``u`` from ``c_add``. It holds no
Python objects and runs without the GIL; the workspace grows geometrically.

Problems are solved in batches (one problem for ``solve``): ``prepare_solve``
makes every Python object and takes every pointer with the GIL, then threads
call ``_Batch.run`` and claim problems from an atomic counter without it; each
outcome stays in C buffers (a ``_Sol``, owned by a ``_Solution``) until a field
is asked for. ``prepare_backward`` runs Jacobian products (Prop. 1) the same
way. A padded batch (the PyTorch layer's path) reads every problem from its
block of one padded array and writes into one padded output, the threads
copying, converting and scanning the blocks; its outcomes stay in one C array
(``_Solutions``), with no Python object per problem.
"""
import numpy as np

cimport numpy as cnp
from cpython.pythread cimport (PyThread_type_lock, PyThread_allocate_lock, PyThread_free_lock,
                               PyThread_acquire_lock, PyThread_release_lock, WAIT_LOCK)
from cpython.ref cimport PyObject
from libc.math cimport fabs, sqrt, hypot, INFINITY
from libc.stdlib cimport calloc, malloc, realloc, free, qsort
from libc.string cimport memcpy, memmove, memset
from scipy.linalg.cython_blas cimport dtrsv

from sparsemap._factors._base cimport HAS_BAD, HAS_NEGINF, Factor, _scan

cnp.import_array()

# A new column is affinely dependent on the active ones when its squared
# distance to their affine hull is below DEP_TOL times its squared norm in G_c.
cdef double DEP_TOL = 1e-9

cdef enum:
    RING = 64     # supports remembered from the last MAP calls, to detect cycles

# Near convergence (last gap below this, relative), each relaxed KKT solution
# gets one step of iterative refinement, unless its KKT residual (the spread of
# the active structures' adjusted scores, which adds at most itself to the gap)
# is below REFINE_SKIP times the last gap: then the correction (two triangular
# solves) cannot be what the gap waits for.
cdef double REFINE_BELOW = 1e-6
cdef double REFINE_SKIP = 1e-3

# Termination codes, shared with the conditional-gradient solvers and solve().
cdef enum:
    RUNNING = 0
    CONVERGED = 1
    MAX_ITER = 2
    STALLED = 3   # no further progress possible in double precision
    INFEASIBLE = 4  # every structure uses a forbidden (-inf) part: nothing was solved
    STOPPED = 5   # the callback asked to stop
    FACE_INCOMPLETE = 6   # converged, but max_iter MAP calls did not certify the face

STATUS_CONVERGED, STATUS_MAX_ITER, STATUS_STALLED = CONVERGED, MAX_ITER, STALLED
STATUS_INFEASIBLE = INFEASIBLE
STATUS_STOPPED = STOPPED
STATUS_FACE_INCOMPLETE = FACE_INCOMPLETE


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


def gap_scale(double abs_linear, double u_sq):
    """Scale the convergence tolerance is relative to.

    A solve has converged when ``gap <= tol * gap_scale`` with
    ``gap_scale = max(1, sum_i |eta_u[i] u[i]| + sum_j |eta_v[j] v[j]| + ||u||^2)``
    (``abs_linear`` is the sum of the first two terms). The rule is absolute for
    scores of order one and relative for large scores; summing magnitudes rather
    than taking ``|eta . u|`` keeps it honest when large scores cancel, since
    round-off in the gap grows with the terms, not with their sum.
    """
    return _gap_scale(abs_linear, u_sq)


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


cdef object _copy_out(const double* p, Py_ssize_t n):
    out = np.empty(n)
    cdef double[::1] ov = out
    if n > 0:
        memcpy(&ov[0], p, n * sizeof(double))
    return out


cdef int _grow_vec(double** p, Py_ssize_t n) except -1 nogil:
    cdef void* q = realloc(p[0], n * sizeof(double))
    if q == NULL:
        with gil:
            raise MemoryError()
    p[0] = <double*> q
    return 0


# Triangular solves with a row-major lower factor L (row stride lda). Below
# SMALL_SOLVE rows a plain loop beats the BLAS call, whose fixed cost (argument
# checks, a work buffer from a locked pool) is most of a small solve.
cdef Py_ssize_t SMALL_SOLVE = 32


cdef void _trsv_lower(const double* L, Py_ssize_t lda, Py_ssize_t n, double* x) noexcept nogil:
    """x <- L^{-1} x (L row-major lower = column-major upper L^T)."""
    cdef Py_ssize_t i, j
    cdef double acc
    cdef const double* row
    cdef int ni = <int> n, la = <int> lda, inc = 1
    if n > SMALL_SOLVE:
        dtrsv(b"U", b"T", b"N", &ni, <double*> L, &la, x, &inc)
        return
    for i in range(n):
        row = L + i * lda
        acc = x[i]
        for j in range(i):
            acc -= row[j] * x[j]
        x[i] = acc / row[i]


cdef void _trsv_upper(const double* L, Py_ssize_t lda, Py_ssize_t n, double* x) noexcept nogil:
    """x <- L^{-T} x."""
    cdef Py_ssize_t i, j
    cdef double xi
    cdef const double* row
    cdef int ni = <int> n, la = <int> lda, inc = 1
    if n > SMALL_SOLVE:
        dtrsv(b"U", b"N", b"N", &ni, <double*> L, &la, x, &inc)
        return
    i = n - 1
    while i >= 0:
        row = L + i * lda
        xi = x[i] / row[i]
        x[i] = xi
        for j in range(i):
            x[j] -= row[j] * xi
        i -= 1


cdef class _Workspace:
    """Support, weights and Cholesky factor of one solve (not thread-shared).

    Declared in ``_active_set.pxd``, so that other Cython solvers (the factor
    graph) drive it at C level.
    """

    def __cinit__(self, Factor f, Py_ssize_t cap):
        self.f = f
        self.k = f.struct_size
        self.n_u = f.n_u
        self.n_v = f.n_v
        self.cap = 0
        self.nI = 0
        self.n_map = 0
        self.hash = 0
        self.callback = NULL
        self.S = NULL
        self.dvec = self.pert = self.pv = NULL
        self.log = NULL
        self.n_log = self.cap_log = 0
        self.log_on = False
        self.y = self.yhat = self.theta = self.theta_abs = self.L = self.x1 = self.w1 = self.w2 = NULL
        self.rot = NULL
        self.u = <double*> malloc((self.n_u + 1) * sizeof(double))
        self.adj = <double*> malloc((self.n_u + 1) * sizeof(double))
        self.dvec = <double*> malloc((self.n_u + 1) * sizeof(double))
        self.pert = <double*> malloc((self.n_u + 1) * sizeof(double))
        self.v = <double*> malloc((self.n_v + 1) * sizeof(double))
        # pv and qv: one block; rv and rc: the shared directions (drawing them costs more
        # than a solve at scale 5)
        self.pv = <double*> malloc((2 * self.n_v + 1) * sizeof(double))
        self.qv = self.pv + self.n_v
        self.rv = self.rc = NULL
        if self.n_v:
            self.tie_keep = (_tie_array(TIE_SEED, self.n_v),
                             _tie_array(TIE_CHECK_SEED, self.n_v))
            self.rv = <const double*> cnp.PyArray_DATA(<cnp.ndarray> self.tie_keep[0])
            self.rc = <const double*> cnp.PyArray_DATA(<cnp.ndarray> self.tie_keep[1])
        self.abs_eu = <double*> malloc((self.n_u + self.n_v + 1) * sizeof(double))
        self.abs_ev = (self.abs_eu + self.n_u) if self.n_v else NULL
        self.snew = <int*> malloc(self.k * sizeof(int))
        # 16-byte aligned scratch for c_map
        self.work = <char*> malloc(f.work_bytes + 16)
        if (self.u == NULL or self.adj == NULL or self.v == NULL or self.snew == NULL
                or self.dvec == NULL or self.pert == NULL or self.pv == NULL
                or self.work == NULL or self.abs_eu == NULL):
            raise MemoryError()
        self._grow(cap if cap > 4 else 4)

    def __dealloc__(self):
        free(self.S); free(self.y); free(self.yhat); free(self.theta); free(self.theta_abs); free(self.L)
        free(self.x1); free(self.w1); free(self.w2); free(self.rot); free(self.u)
        free(self.adj); free(self.v)
        free(self.snew); free(self.work); free(self.abs_eu); free(self.dvec); free(self.pert)
        free(self.pv)
        free(self.log)

    cdef void _set_eta(self, const double* eu, const double* ev) noexcept nogil:
        """Point at the scores (the caller keeps them alive; either may be NULL when
        its size is 0) and fill |eta|."""
        cdef Py_ssize_t j
        self.eta_u = eu if self.n_u else NULL
        self.eta_v = ev if self.n_v else NULL
        for j in range(self.n_u):
            self.abs_eu[j] = fabs(eu[j])
        for j in range(self.n_v):
            self.abs_ev[j] = fabs(ev[j])

    cdef int _grow(self, Py_ssize_t new_cap) except -1 nogil:
        cdef Py_ssize_t i, old = self.cap
        cdef double* newL
        cdef void* p
        if new_cap <= old:
            return 0
        if new_cap >= 128 and new_cap % 64 == 0:
            # L's row stride (cap doubles): off a multiple of 512 bytes, so that the
            # triangular solves' row-strided reads do not alias in the caches
            new_cap += 8
        p = realloc(self.S, new_cap * self.k * sizeof(int))
        if p == NULL:
            with gil:
                raise MemoryError()
        self.S = <int*> p
        _grow_vec(&self.y, new_cap)
        _grow_vec(&self.yhat, new_cap)
        _grow_vec(&self.theta, new_cap)
        _grow_vec(&self.theta_abs, new_cap)
        _grow_vec(&self.x1, new_cap)
        _grow_vec(&self.w1, new_cap)
        _grow_vec(&self.w2, new_cap)
        _grow_vec(&self.rot, 2 * new_cap)
        newL = <double*> malloc(new_cap * new_cap * sizeof(double))
        if newL == NULL:
            with gil:
                raise MemoryError()
        memset(newL, 0, new_cap * new_cap * sizeof(double))
        for i in range(self.nI):
            memcpy(newL + i * new_cap, self.L + i * old, (i + 1) * sizeof(double))
        free(self.L)
        self.L = newL
        self.cap = new_cap
        return 0

    # -- triangular solves with the kept factor ----------------------------------
    cdef void _solve_lower(self, double* x) noexcept nogil:
        """x <- L^{-1} x (L row-major lower = column-major upper L^T)."""
        _trsv_lower(self.L, self.cap, self.nI, x)

    cdef void _solve_upper(self, double* x) noexcept nogil:
        """x <- L^{-T} x."""
        _trsv_upper(self.L, self.cap, self.nI, x)

    cdef void _relaxed_kkt(self) noexcept nogil:
        """Solve eq. 12 on the active set for yhat, with one triangular solve.

        With w1 = L^{-1} theta and w2 = L^{-1} 1 kept up to date,
        tau' = (1^T G^{-1} theta - 1) / 1^T G^{-1} 1 = (w2.w1 - 1) / w2.w2 and
        yhat = L^{-T} (w1 - tau' w2).
        """
        cdef Py_ssize_t t, n = self.nI
        cdef double taup = (_dot(self.w2, self.w1, n) - 1.0) / _dot(self.w2, self.w2, n)
        for t in range(n):
            self.yhat[t] = self.w1[t] - taup * self.w2[t]
        self._solve_upper(self.yhat)

    # -- support bookkeeping -------------------------------------------------------
    cdef Py_ssize_t _find(self, const int* s) noexcept nogil:
        cdef Py_ssize_t t, j
        for t in range(self.nI):
            for j in range(self.k):
                if self.S[t * self.k + j] != s[j]:
                    break
            else:
                return t
        return -1

    cdef int _append(self, const int* s, const double* lrow, double diag, double w) except -1 nogil:
        cdef Py_ssize_t n = self.nI
        cdef double th
        if n == self.cap:
            self._grow(2 * self.cap)
        memcpy(self.S + n * self.k, s, self.k * sizeof(int))
        self.hash += _hash_structure(s, self.k)
        memcpy(self.L + n * self.cap, lrow, n * sizeof(double))
        self.L[n * self.cap + n] = diag
        self.f.c_score(s, self.eta_u, self.eta_v, &th)
        self.theta[n] = th - self.theta0
        self.f.c_score(s, self.abs_eu, self.abs_ev, &self.theta_abs[n])
        self.w1[n] = (self.theta[n] - _dot(lrow, self.w1, n)) / diag
        self.w2[n] = (1.0 - _dot(lrow, self.w2, n)) / diag
        self.y[n] = w
        self.nI = n + 1
        return 0

    cdef void _remove(self, Py_ssize_t r) noexcept nogil:
        """Drop structure r: delete its row of L, then Givens on columns (j, j+1).

        Rotation j acts on rows j..n-2; it is applied row by row (each row takes
        rotations r..i in order, the same operations as column pair by column pair,
        so the same bits) to read L along its rows.
        """
        cdef Py_ssize_t n = self.nI, cap = self.cap, i, j
        cdef double a, b, rho, cs, sn, xa, xb
        cdef double* L = self.L
        cdef double* rc = self.rot
        cdef double* rs = self.rot + cap
        cdef double* row
        self.hash -= _hash_structure(self.S + r * self.k, self.k)
        # rows r..n-2, shifted up, have one entry right of the diagonal: rotate it away
        for i in range(r, n - 1):
            row = L + i * cap
            memcpy(row, L + (i + 1) * cap, (i + 2) * sizeof(double))
            for j in range(r, i):
                if rc[j] == 2.0:
                    continue
                xa = row[j]
                xb = row[j + 1]
                row[j] = rc[j] * xa + rs[j] * xb
                row[j + 1] = -rs[j] * xa + rc[j] * xb
            # rotation i, from row i's diagonal pair (after rotations r..i-1)
            a = row[i]
            b = row[i + 1]
            if b == 0.0:
                rc[i] = 2.0      # no rotation (a cosine is never 2)
                continue
            rho = hypot(a, b)
            rc[i] = a / rho
            rs[i] = b / rho
            row[i] = rc[i] * a + rs[i] * b
            row[i + 1] = -rs[i] * a + rc[i] * b
        for j in range(r, n - 1):
            if rc[j] == 2.0:
                continue
            cs = rc[j]
            sn = rs[j]
            # L_del w = b and L_del <- L_del Q give w <- Q^T w
            xa = self.w1[j]
            xb = self.w1[j + 1]
            self.w1[j] = cs * xa + sn * xb
            self.w1[j + 1] = -sn * xa + cs * xb
            xa = self.w2[j]
            xb = self.w2[j + 1]
            self.w2[j] = cs * xa + sn * xb
            self.w2[j + 1] = -sn * xa + cs * xb
        for i in range(n - 1):
            L[i * cap + i + 1] = 0.0
        if r < n - 1:
            memmove(self.S + r * self.k, self.S + (r + 1) * self.k,
                    (n - 1 - r) * self.k * sizeof(int))
            memmove(self.y + r, self.y + r + 1, (n - 1 - r) * sizeof(double))
            memmove(self.theta + r, self.theta + r + 1, (n - 1 - r) * sizeof(double))
            memmove(self.theta_abs + r, self.theta_abs + r + 1, (n - 1 - r) * sizeof(double))
        self.nI = n - 1

    cdef int _insert(self, const int* s, double w) except -1 nogil:
        """Add s with weight w; handle affine dependence (u is kept fixed)."""
        cdef Py_ssize_t t, n, r, tries
        cdef double g, d, delta, alpha, ratio
        cdef double* l
        for tries in range(self.nI + 1):
            n = self.nI
            if n + 1 >= self.cap:
                self._grow(2 * self.cap)
            l = self.x1
            for t in range(n):
                self.f.c_overlap(s, self.S + t * self.k, &g)
                l[t] = g + self.c
            self.f.c_overlap(s, s, &d)
            d += self.c
            self._solve_lower(l)
            delta = d - _dot(l, l, n)
            if delta > DEP_TOL * d:
                self._append(s, l, sqrt(delta), w)
                return 0
            # [m_s; sqrt c] = sum_t z_t [m_t; sqrt c], with z = L^{-T} l and sum z = 1.
            self._solve_upper(l)
            r = -1
            alpha = INFINITY
            for t in range(n):
                if l[t] > 1e-12:
                    ratio = self.y[t] / l[t]
                    if ratio < alpha:
                        alpha = ratio
                        r = t
            if r < 0:   # cannot happen in exact arithmetic (sum z = 1)
                return 0
            for t in range(n):
                self.y[t] -= alpha * l[t]
            self.y[r] = 0.0
            w += alpha
            self._remove(r)
        return 0

    cdef int _rebuild(self) except -1 nogil:
        """Refactorise G_c from scratch (only after round-off trouble)."""
        cdef Py_ssize_t n = self.nI, t, i, j
        cdef double g, acc
        cdef double* L = self.L
        cdef Py_ssize_t cap = self.cap
        for i in range(n):
            for j in range(i + 1):
                self.f.c_overlap(self.S + i * self.k, self.S + j * self.k, &g)
                acc = g + self.c
                for t in range(j):
                    acc -= L[i * cap + t] * L[j * cap + t]
                if i == j:
                    L[i * cap + i] = sqrt(acc) if acc > 0 else 1e-300
                else:
                    L[i * cap + j] = acc / L[j * cap + j]
        for t in range(n):
            self.w1[t] = self.theta[t]
            self.w2[t] = 1.0
        self._solve_lower(self.w1)
        self._solve_lower(self.w2)
        return 0

    # -- u, v, gap -------------------------------------------------------------------
    cdef int _compute_u(self, const double* w, bint with_v) except -1 nogil:
        """u = sum_t w_t m_t (and v likewise when with_v)."""
        cdef Py_ssize_t t
        memset(self.u, 0, self.n_u * sizeof(double))
        if with_v:
            memset(self.v, 0, self.n_v * sizeof(double))
        for t in range(self.nI):
            self.f.c_add(self.S + t * self.k, w[t], self.u,
                         self.v if (with_v and self.n_v) else NULL)
        return 0

    cdef int _refine(self, double below) except -1 nogil:
        """One step of iterative refinement of the relaxed KKT solution yhat.

        At the relaxed optimum every active structure has the same adjusted
        score theta_t - m_t.u; their spread is the KKT residual left by
        round-off, which an ill-conditioned G_c amplifies. Solving
        G_c d = r - rho 1 with 1^T d = 0 (one forward and one backward solve
        with the kept factor) removes it; yhat stays on the affine hull.
        A spread of at most ``below`` is left alone: then yhat is unchanged
        and u = M yhat, and 1 is returned (else 0).
        """
        cdef Py_ssize_t t, n = self.nI
        cdef double g, lo = INFINITY, hi = -INFINITY
        if n < 2:
            return 0
        self._compute_u(self.yhat, False)
        for t in range(n):
            self.f.c_score(self.S + t * self.k, self.u, NULL, &g)
            self.x1[t] = self.theta[t] - g
            lo = min(lo, self.x1[t])
            hi = max(hi, self.x1[t])
        if hi - lo <= below:
            return 1
        # that d is D r with D = Z - Z 1 1^T Z / 1^T Z 1, Z = G_c^{-1} (Prop. 1)
        self._jacobian(self.x1)
        for t in range(n):
            self.yhat[t] += self.x1[t]
        return 0

    cdef double _linear(self) noexcept nogil:
        """eta_u . u + eta_v . v = sum_t y_t theta_t, without touching a dense v."""
        cdef Py_ssize_t t
        cdef double acc = 0
        for t in range(self.nI):
            acc += self.y[t] * (self.theta[t] + self.theta0)
        return acc

    cdef double _linear_abs(self) noexcept nogil:
        """sum_t y_t |a_t|.|eta| (= |eta_u|.|u| + |eta_v|.|v| for 0/1 columns)."""
        cdef Py_ssize_t t
        cdef double acc = 0
        for t in range(self.nI):
            acc += self.y[t] * self.theta_abs[t]
        return acc

    cdef int _gap(self, double* gap, double* scale, double* obj, bint have_u=False) except -1 nogil:
        """MAP at the adjusted scores eta_u - u; Wolfe gap into gap, MAP into snew.

        With have_u, ws.u already holds M y (no recomputation).
        """
        cdef Py_ssize_t j
        cdef double best, lin, usq
        if not have_u:
            self._compute_u(self.y, False)
        for j in range(self.n_u):
            self.adj[j] = self.eta_u[j] - self.u[j]
        usq = _dot(self.u, self.u, self.n_u)
        self.f.c_map(self.adj, self.eta_v, self.snew, self.work)
        self.n_map += 1
        self.f.c_score(self.snew, self.adj, self.eta_v, &best)
        lin = self._linear()
        # gap = max_s <a_s - x, -grad f(x)>, an upper bound on suboptimality
        gap[0] = best - (lin - usq)
        scale[0] = _gap_scale(self._linear_abs(), usq)
        obj[0] = 0.5 * usq - lin
        return 0

    cdef int _start(self, const int* S, Py_ssize_t n, const double* weights) except -1 nogil:
        """Insert the n rows of S (n x k) in turn, as one solve's first support.

        For an empty workspace pointed at its scores (``_point``). Repeats are
        skipped, as are rows that use a forbidden part (a -inf or nan score: a
        support from a solve with other masks is still a valid start) and, with
        weights, rows of weight <= 0. The shift c and the score offset theta0
        come from the first row kept; none kept leaves the workspace empty.
        With weights == NULL every structure starts at weight 0 and the support
        is then given uniform weights (a cold or warm start); otherwise the
        given weights are kept, moved along null directions where a structure
        is dependent (a support reduction that keeps u).
        """
        cdef Py_ssize_t i
        cdef const int* s
        cdef double th, g0
        for i in range(n):
            if weights != NULL and not (weights[i] > 0):
                continue
            s = S + i * self.k
            self.f.c_score(s, self.eta_u, self.eta_v, &th)
            if not (th > -INFINITY):
                continue
            if self.nI == 0:
                self.f.c_overlap(s, s, &g0)
                # a shift of the order of the Gram entries keeps G_c well conditioned
                self.c = g0 if g0 > 1.0 else 1.0
                self.theta0 = th
            if self._find(s) < 0:
                self._insert(s, 0.0 if weights == NULL else weights[i])
        if weights == NULL:
            for i in range(self.nI):
                self.y[i] = 1.0 / self.nI
        return 0

    cdef void _drop_below(self, double threshold) noexcept nogil:
        """Remove structures whose weight is at most threshold (keeping one)."""
        cdef Py_ssize_t t = self.nI - 1
        while t >= 0 and self.nI > 1:
            if self.y[t] <= threshold:
                self._remove(t)
            t -= 1

    cdef int _rescore(self, const double* eta_u, const double* eta_v) except -1 nogil:
        """New scores for the kept support: a warm start (the factor graph's ADMM steps).

        The support, its weights, the Cholesky factor and ``w2 = L^{-1} 1``
        depend on the columns only and are kept; the weights stay feasible.
        Points at the new scores (the caller keeps them alive; ``eta_v`` may be
        NULL when ``n_v == 0``) and recomputes ``|eta|``, the offset ``theta0``,
        ``theta``, ``theta_abs`` and ``w1 = L^{-1} theta``. Then ``_run``.
        """
        cdef Py_ssize_t t
        cdef double th
        self._set_eta(eta_u, eta_v)
        if self.nI == 0:
            return 0
        self.f.c_score(self.S, eta_u, eta_v, &self.theta0)
        for t in range(self.nI):
            self.f.c_score(self.S + t * self.k, eta_u, eta_v, &th)
            self.theta[t] = th - self.theta0
            self.f.c_score(self.S + t * self.k, self.abs_eu, self.abs_ev, &self.theta_abs[t])
            self.w1[t] = self.theta[t]
        self._solve_lower(self.w1)
        return 0

    cdef void _jacobian(self, double* x) noexcept nogil:
        """x <- (Z - Z 1 1^T Z / 1^T Z 1) x with Z = G_c^{-1} on the kept support (Prop. 1).

        With x' = L^{-1} x and the kept w2 = L^{-1} 1 this is
        L^{-T} (x' - w2 (w2.x') / (w2.w2)): two triangular solves.
        """
        cdef Py_ssize_t t, n = self.nI
        cdef double a
        if n == 0:
            return
        self._solve_lower(x)
        a = _dot(self.w2, x, n) / _dot(self.w2, self.w2, n)
        for t in range(n):
            x[t] -= a * self.w2[t]
        self._solve_upper(x)

    cdef int _append_face(self, const int* s) except -1 nogil:
        """Append s at weight 0 if its column is affinely independent of the rows'.

        Returns 1 if appended, 0 if dependent (nothing changes: unlike
        ``_insert``, no weight moves, since s is to join the backward set only).
        """
        cdef Py_ssize_t t, n = self.nI
        cdef double g, d, delta
        if n + 1 >= self.cap:
            self._grow(2 * self.cap)
        for t in range(n):
            self.f.c_overlap(s, self.S + t * self.k, &g)
            self.x1[t] = g + self.c
        self.f.c_overlap(s, s, &d)
        d += self.c
        self._solve_lower(self.x1)
        delta = d - _dot(self.x1, self.x1, n)
        if not (delta > DEP_TOL * d):
            return 0
        self._append(s, self.x1, sqrt(delta), 0.0)
        return 1

    cdef object _export(self):
        """Support, weights and Cholesky factor as NumPy arrays."""
        cdef Py_ssize_t n = self.nI, i
        S = np.empty((n, self.k), dtype=np.intc)
        y = np.empty(n)
        L = np.zeros((n, n))
        cdef int[:, ::1] Sv = S
        cdef double[::1] yv = y
        cdef double[:, ::1] Lv = L
        if n > 0:
            memcpy(&Sv[0, 0], self.S, n * self.k * sizeof(int))
            memcpy(&yv[0], self.y, n * sizeof(double))
            for i in range(n):
                memcpy(&Lv[i, 0], self.L + i * self.cap, (i + 1) * sizeof(double))
        return S, y, L


def notify(callback, n_iter, objective, gap, support_size, seconds, u):
    """Call a solve's callback with an iterate's figures; True if it asks to stop.

    ``info`` is a ``scipy.optimize.OptimizeResult`` of the arguments; ``u``
    is a copy the callback may keep, shaped like ``eta_u``. The callback stops
    the solve by returning True or raising StopIteration, as SciPy's do. Shared
    by the active set and the conditional-gradient solvers.
    """
    from scipy.optimize import OptimizeResult    # only when a callback is given: a heavy import
    info = OptimizeResult(n_iter=n_iter, objective=objective, gap=gap,
                          support_size=support_size, seconds=seconds, u=u)
    try:
        return callback(info) is True
    except StopIteration:
        return True


cdef int _run(_Workspace ws, Py_ssize_t max_iter, double tol, double* hist,
              Py_ssize_t* n_iter_out, double* gap_out, double* obj_out) except -1 nogil:
    """The active-set loop. hist (if not NULL) gets 4 doubles per iteration."""
    cdef Py_ssize_t it = 0, t, r, n_cycle = 0, n_ring = 0, n_nan = 0, n_pos
    cdef double last_gap = INFINITY, last_scale = 1.0   # of the last MAP call
    cdef unsigned long long ring[RING]
    memset(ring, 0, RING * sizeof(unsigned long long))
    cdef int status = RUNNING
    cdef double gap = INFINITY, scale = 1.0, obj = 0.0, gamma, ratio, ymin
    cdef double t0 = _now()
    cdef bint fresh_gap, has_nan, stop, u_yhat
    while True:
        # -- one iteration: relaxed KKT, then either a MAP call or a step -----------
        ws._relaxed_kkt()
        u_yhat = False
        if last_gap <= REFINE_BELOW * last_scale:
            # a KKT residual far below the gap cannot be what keeps the gap open
            u_yhat = ws._refine(REFINE_SKIP * last_gap)
        ymin = INFINITY
        has_nan = False
        for t in range(ws.nI):
            if ws.yhat[t] < ymin:
                ymin = ws.yhat[t]
            elif ws.yhat[t] != ws.yhat[t]:
                has_nan = True
        if has_nan:
            # A breakdown of the factorisation (never seen; a guard against nan):
            # refactorise once, then stop with the last feasible iterate.
            n_nan += 1
            if n_nan >= 2:
                status = STALLED
                break
            ws._rebuild()
            continue
        fresh_gap = False
        if ymin >= 0.0:
            memcpy(ws.y, ws.yhat, ws.nI * sizeof(double))
            ws._gap(&gap, &scale, &obj, u_yhat)
            last_gap = gap
            last_scale = scale
            fresh_gap = True
            if gap <= tol * scale:
                status = CONVERGED
            else:
                # At a MAP call y is the relaxed optimum on the support, so the
                # support alone fixes the state: seeing one again is a cycle, which
                # only round-off can cause (ties at the optimum, tol below what
                # double precision certifies). Refactorise once, then stop.
                for t in range(RING):
                    if ring[t] == ws.hash:
                        n_cycle += 1
                        if n_cycle >= 2:
                            status = STALLED
                        else:
                            ws._rebuild()
                        break
                ring[n_ring % RING] = ws.hash
                n_ring += 1
                # MAP cannot return an active structure unless the gap is zero (or
                # round-off); then nothing enters and the next call is a repeat.
                if status == RUNNING and ws._find(ws.snew) < 0:
                    if ws.log_on:
                        _log(ws, ws.snew)
                    ws._insert(ws.snew, 0.0)
        else:
            # Move towards yhat until the first weight hits zero (eq. 31) and drop
            # it. The blocking index is chosen among the negative entries of yhat,
            # so one always leaves, even when round-off puts the ratio at 1.
            gamma = INFINITY
            r = -1
            for t in range(ws.nI):
                if ws.yhat[t] < 0.0:
                    ratio = ws.y[t] / (ws.y[t] - ws.yhat[t])
                    if ratio < gamma:
                        gamma = ratio
                        r = t
            for t in range(ws.nI):
                ws.y[t] = (1.0 - gamma) * ws.y[t] + gamma * ws.yhat[t]
                if ws.y[t] < 0.0:
                    ws.y[t] = 0.0
            ws.y[r] = 0.0
            ws._remove(r)
        it += 1
        if hist != NULL or ws.callback != NULL:
            if not fresh_gap:
                ws._gap(&gap, &scale, &obj)
            # the support of y: not a structure that has just entered at weight 0
            n_pos = 0
            for t in range(ws.nI):
                if ws.y[t] > 0.0:
                    n_pos += 1
            if hist != NULL:
                hist[4 * (it - 1)] = obj
                hist[4 * (it - 1) + 1] = gap
                hist[4 * (it - 1) + 2] = n_pos
                hist[4 * (it - 1) + 3] = _now() - t0
            if ws.callback != NULL:
                with gil:
                    # ws.u is the iterate's u (the last _gap call computed it)
                    stop = notify(<object> ws.callback, it, obj, gap, n_pos, _now() - t0,
                                  _copy_out(ws.u, ws.n_u).reshape(ws.f.shape_u))
                if stop and status == RUNNING:
                    status = STOPPED
        if status != RUNNING:
            break
        if it >= max_iter:
            status = MAX_ITER
            break
    # Zero weights are not part of the support (their Jacobian rows vanish);
    # dropping them changes neither u nor the objective.
    ws._drop_below(0.0)
    if status != CONVERGED:
        # the reported gap is always that of the returned iterate
        ws._gap(&gap, &scale, &obj)
        if gap <= tol * scale:
            status = CONVERGED
    n_iter_out[0] = it
    gap_out[0] = gap
    obj_out[0] = obj
    return status


# -- face completion --------------------------------------------------------------
# The Jacobian of u is the projection onto the directions of the optimal face: the
# face of the marginal polytope whose vertices all score the maximum at the adjusted
# scores eta - [u; 0]. A converged support lies in that face but may span only part
# of it (flat scores), so after a solve the backward set is completed: weight-0 rows
# are appended until their affine hull spans the face, certified by MAP calls along
# random directions orthogonal to the rows' span (see _complete).

cdef enum:
    FACE_CERTIFIED = 0    # a round of random directions found nothing new
    FACE_BUDGET = 1       # the MAP budget ran out first
    FACE_UNRESOLVED = 2   # near-ties below what double precision separates: stopped
    FACE_FIBERED = 3      # certified, but n is not affine in m on the face: to untie

FACE_STATUS_CERTIFIED, FACE_STATUS_BUDGET, FACE_STATUS_UNRESOLVED, FACE_STATUS_FIBERED = (
    FACE_CERTIFIED, FACE_BUDGET, FACE_UNRESOLVED, FACE_FIBERED)

# Scores within FACE_TIE * max(1, |score|) (plus the solve's gap) of the maximum tie.
cdef double FACE_TIE = 1e-10
# First perturbation size, relative to max(1, |score|); shrunk when a probe leaves the face.
cdef double FACE_EPS = 1e-6
# A probe must move a score by more than FACE_SEE tie tolerances to count; the
# perturbation is never shrunk below FACE_MIN tie tolerances (then FACE_UNRESOLVED).
cdef double FACE_SEE = 4.0
cdef double FACE_MIN = 64.0
# Most rows of a completed backward set: its Cholesky factor (cap x cap doubles, the
# capacity doubling) then stays within 128 MiB. Reaching it ends the completion
# uncertified (FACE_BUDGET): very flat scores on large factors, whose face is nearly
# the whole polytope (a 100-word tree at scale 0.01).
cdef Py_ssize_t FACE_MAX_ROWS = 4096
# Fixed seed: completion is deterministic, and batches stay bitwise equal to solves.
cdef unsigned long long FACE_SEED = 0x5eed5eed2018ULL


cdef inline unsigned long long _bits(unsigned long long* state) noexcept nogil:
    """64 random bits (splitmix64)."""
    cdef unsigned long long z
    state[0] += 0x9e3779b97f4a7c15ULL
    z = state[0]
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL
    return z ^ (z >> 31)


cdef inline double _uniform(unsigned long long* state) noexcept nogil:
    """A uniform draw in [-1, 1)."""
    return <double> (_bits(state) >> 11) * (2.0 / 9007199254740992.0) - 1.0


cdef void _perturb(const double* x, double eps, double* out, Py_ssize_t n,
                   unsigned long long* state) noexcept nogil:
    """out = x + eps g (x NULL: out = eps g), g uniform in [-1, 1)^n at 32-bit
    resolution (two entries per draw: a probe direction needs no more, and the
    draws cost as much as a MAP)."""
    cdef Py_ssize_t j
    cdef unsigned long long z
    cdef double h = eps * (2.0 / 4294967296.0)
    for j in range(0, n - 1, 2):
        z = _bits(state)
        out[j] = h * <double> (z >> 32) - eps
        out[j + 1] = h * <double> (z & 0xffffffffULL) - eps
    if n % 2:
        out[n - 1] = eps * _uniform(state)
    if x != NULL:
        for j in range(n):
            out[j] += x[j]


cdef int _log(_Workspace ws, const int* s) except -1 nogil:
    """Remember s (a structure _run inserts) as a candidate for the face completion."""
    cdef Py_ssize_t c
    cdef void* q
    if ws.n_log == ws.cap_log:
        c = 2 * ws.cap_log if ws.cap_log > 0 else 64
        q = realloc(ws.log, c * ws.k * sizeof(int))
        if q == NULL:
            with gil:
                raise MemoryError()
        ws.log = <int*> q
        ws.cap_log = c
    memcpy(ws.log + ws.n_log * ws.k, s, ws.k * sizeof(int))
    ws.n_log += 1
    return 0


cdef struct _Seen:
    # Hashes (| 1, so that 0 marks an empty slot) of structures already in the rows or
    # already tried, in an open-addressing table of size m (a power of 2) kept at most
    # half full. A false match (two structures, one hash) only skips a candidate.
    unsigned long long* table
    Py_ssize_t m, count


cdef int _seen_init(_Seen* seen, Py_ssize_t expected) except -1 nogil:
    seen.m = 16
    seen.count = 0
    while seen.m < 2 * expected:
        seen.m *= 2
    seen.table = <unsigned long long*> calloc(seen.m, sizeof(unsigned long long))
    if seen.table == NULL:
        with gil:
            raise MemoryError()
    return 0


cdef inline Py_ssize_t _seen_slot(const unsigned long long* table, Py_ssize_t m,
                                  unsigned long long h) noexcept nogil:
    """The slot of h in a table of size m (a power of 2): h's own, or the empty one
    where it goes (linear probing)."""
    cdef Py_ssize_t i = <Py_ssize_t> (h & <unsigned long long> (m - 1))
    while table[i] != 0 and table[i] != h:
        i = (i + 1) & (m - 1)
    return i


cdef int _seen_add(_Seen* seen, const int* s, Py_ssize_t k) except -1 nogil:
    """Add s; 1 if it is new, 0 if it was there."""
    cdef unsigned long long h = _hash_structure(s, k) | 1
    cdef unsigned long long* old = seen.table
    cdef Py_ssize_t j, m = seen.m
    cdef Py_ssize_t i = _seen_slot(old, m, h)
    if old[i] == h:
        return 0
    old[i] = h
    seen.count += 1
    if 2 * seen.count > m:
        seen.table = <unsigned long long*> calloc(2 * m, sizeof(unsigned long long))
        if seen.table == NULL:
            seen.table = old
            with gil:
                raise MemoryError()
        seen.m = 2 * m
        for j in range(m):
            if old[j] != 0:
                seen.table[_seen_slot(seen.table, 2 * m, old[j])] = old[j]
        free(old)
    return 1


cdef int _from_log(_Workspace ws, _Seen* seen, double s_ref, double tau) except -1 nogil:
    """Append the logged structures that tie at the adjusted scores (face vertices the
    solve met and dropped), skipping those seen (the rows, hashed into seen)."""
    cdef Py_ssize_t t, k = ws.k
    cdef double st
    for t in range(ws.n_log):
        if not _seen_add(seen, ws.log + t * k, k):
            continue
        ws.f.c_score(ws.log + t * k, ws.adj, ws.eta_v, &st)
        if st - s_ref >= -tau:
            if ws.nI + 1 >= FACE_MAX_ROWS:
                break
            ws._append_face(ws.log + t * k)
    return 0


cdef int _probe_random(_Workspace ws, _Seen* seen, Py_ssize_t budget,
                       Py_ssize_t* n_calls, double s_ref, double tau, double* eps,
                       unsigned long long* rng) except -1 nogil:
    """Append face vertices found by MAP at theta + eps g for random g, not projected.

    Until the rows span most of the face, the maximiser of a random direction over
    the face is almost always a new, affinely independent vertex (measured on
    trees: every probe but the last), so this finds the bulk of the face for one
    MAP call and one Cholesky row each, without the projections that _complete's
    certifying directions cost. Stops at the first probe that brings nothing new
    (a row, or a vertex in the rows' hull). Returns FACE_CERTIFIED to go on (the
    certification is _complete's), else FACE_BUDGET or FACE_UNRESOLVED.
    """
    cdef double st
    while True:
        if n_calls[0] >= budget or ws.nI + 1 >= FACE_MAX_ROWS:
            return FACE_BUDGET
        _perturb(ws.adj, eps[0], ws.pert, ws.n_u, rng)
        ws.f.c_map(ws.pert, ws.eta_v, ws.snew, ws.work)
        ws.n_map += 1
        n_calls[0] += 1
        ws.f.c_score(ws.snew, ws.adj, ws.eta_v, &st)
        if st - s_ref < -tau:
            # past the face's margin: a smaller step (the certifying loop shrinks it
            # the same way, and gives up at the same floor)
            eps[0] /= 4
            if eps[0] < FACE_MIN * tau:
                return FACE_UNRESOLVED
            continue
        if not _seen_add(seen, ws.snew, ws.k) or ws._append_face(ws.snew) == 0:
            return FACE_CERTIFIED


cdef int _fresh_direction(_Workspace ws, double* d, unsigned long long* rng) except -1 nogil:
    """d = g - J g for a random g: orthogonal to the rows' span. Its entries on
    forbidden parts (no row uses them, so J ignores them) are _complete's to zero."""
    cdef Py_ssize_t t, k = ws.k
    _perturb(NULL, 1.0, d, ws.n_u, rng)
    if ws.nI + 1 >= ws.cap:
        ws._grow(2 * ws.cap)
    for t in range(ws.nI):
        ws.f.c_score(ws.S + t * k, d, NULL, &ws.x1[t])
    ws._jacobian(ws.x1)
    for t in range(ws.nI):
        ws.f.c_add(ws.S + t * k, -ws.x1[t], d, NULL)
    return 0


cdef int _complete(_Workspace ws, Py_ssize_t budget, double gap, _FaceScale* fs,
                   const double* u=NULL) except -1 nogil:
    """Append weight-0 rows to a solved workspace until they span the optimal face.

    With theta = eta_u - u (eta_v unchanged), every face vertex scores the
    maximum s*, which the rows (the support) attain. One random g is projected
    to d = g - J g (J: Prop. 1 on the rows, the orthogonal projector onto the
    span of their differences; so d . m_t is one constant c over the rows'
    affine hull) and MAP is called at theta + eps d. A returned vertex t that
    still ties at theta and scores d . m_t > c beyond the tie tolerance lies in
    the face outside the rows' affine hull: it is appended (weight 0), and d is
    updated to stay orthogonal to the new span,
    d -= (d . m_t - c) / (w . m_t - w . m_0) w with w the part of m_t
    orthogonal to the rows' hull (one triangular solve with the factor before
    the append). The first time a direction finds such a vertex, the rows miss
    part of the face: the structures the solve met (ws.log) that tie are
    appended (much of the face, without MAP calls), then MAP at theta + eps g
    for random g, not projected, appends the bulk of the rest at one MAP call
    and one Cholesky row each, until a call brings nothing new
    (_probe_random), and a fresh d is drawn. A support that spans the face
    costs one projection and one MAP call. When MAP returns nothing new for an
    updated d, a fresh one is drawn; when it returns nothing new for a fresh
    one, the span is certified: where u is differentiable it lies in the
    face's relative interior, so face vertices outside the rows' hull lie on
    both sides of it, and a random d orthogonal to the rows' span sees one
    unless the spans coincide. At a kink the rows then span the face left tied
    at theta + delta d (a one-sided derivative). A vertex that does not tie at
    theta means eps was too large: it shrinks (and stays shrunk); below
    FACE_MIN tie tolerances, FACE_UNRESOLVED. At most ``budget`` MAP calls
    (ws.n_map counts them) and FACE_MAX_ROWS rows, else FACE_BUDGET. fs (if
    not NULL) gets s*, the tie tolerance and the last eps (s_ref = -inf: no
    completion ran). u (if not NULL) is the solution's u, for rows that are a
    face's vertices without weights that give it (_untie).
    """
    cdef Py_ssize_t j, t, n_u = ws.n_u, k = ws.k, n_calls = 0, n
    cdef unsigned long long rng = FACE_SEED
    cdef double s, s_ref = -INFINITY, big = 0.0, tau, eps, dmax, c_d, st, dt, wt, w0, alpha
    cdef double* p = ws.pert
    cdef double* d = ws.dvec
    cdef double* w = NULL
    cdef bint fresh = True, probed = False
    cdef _Seen seen
    cdef int status
    if fs != NULL:
        fs.s_ref = -INFINITY
    if ws.nI == 0 or n_u == 0:
        return FACE_CERTIFIED
    if u == NULL:
        ws._compute_u(ws.y, False)
    else:
        memcpy(ws.u, u, n_u * sizeof(double))
    for j in range(n_u):
        ws.adj[j] = ws.eta_u[j] - ws.u[j]
    # the score scale: |a_t| . |eta| (kept as theta_abs), at least 1
    for t in range(ws.nI):
        ws.f.c_score(ws.S + t * k, ws.adj, ws.eta_v, &s)
        if s > s_ref:
            s_ref = s
        if ws.theta_abs[t] > big:
            big = ws.theta_abs[t]
    big = big if big > 1.0 else 1.0
    tau = FACE_TIE * big + (gap if gap > 0 else 0.0)
    eps = FACE_EPS * big
    if eps < FACE_MIN * tau:
        eps = FACE_MIN * tau
    seen.table = NULL
    try:
        _fresh_direction(ws, d, &rng)
        while True:
            # zero on forbidden parts; then scaled to max |d_j| = 1 (a loop without
            # branches), so that the perturbation below needs none either
            dmax = 0.0
            for j in range(n_u):
                if ws.adj[j] > -INFINITY:
                    dmax = max(dmax, fabs(d[j]))
                else:
                    d[j] = 0.0
            if dmax == 0.0:
                return FACE_CERTIFIED      # the rows span every direction
            dmax = 1.0 / dmax
            for j in range(n_u):
                d[j] *= dmax
            ws.f.c_score(ws.S, d, NULL, &c_d)
            while True:
                if n_calls >= budget:
                    return FACE_BUDGET
                for j in range(n_u):
                    p[j] = ws.adj[j] + eps * d[j]
                ws.f.c_map(p, ws.eta_v, ws.snew, ws.work)
                ws.n_map += 1
                n_calls += 1
                ws.f.c_score(ws.snew, ws.adj, ws.eta_v, &st)
                st -= s_ref
                ws.f.c_score(ws.snew, d, NULL, &dt)
                dt -= c_d
                if st >= -tau:
                    break
                # not in the face: the perturbation reached past the face's margin
                eps = eps / 4 if dt <= 0 else min(eps / 4, 0.5 * (-st) / dt)
                if eps < FACE_MIN * tau:
                    return FACE_UNRESOLVED
            if not (eps * dt > FACE_SEE * tau) or ws._find(ws.snew) >= 0:
                if fresh:
                    return FACE_CERTIFIED
                # an updated d has certified nothing (its entries can shrink where the
                # face's remaining vertices differ): confirm with a fresh one
                _fresh_direction(ws, d, &rng)
                fresh = True
                continue
            if ws.nI + 1 >= FACE_MAX_ROWS:
                return FACE_BUDGET
            n = ws.nI
            if ws._append_face(ws.snew) == 0:
                return FACE_CERTIFIED      # dependent after all: nothing beyond the hull
            if not probed:
                # the rows miss part of the face: the structures the solve met and
                # random probes append the bulk of it (no MAP calls, then no
                # projections), then certification starts over from a fresh d
                probed = True
                _seen_init(&seen, ws.nI + ws.n_log)
                for t in range(ws.nI):
                    _seen_add(&seen, ws.S + t * k, k)
                _from_log(ws, &seen, s_ref, tau)
                status = _probe_random(ws, &seen, budget, &n_calls, s_ref, tau, &eps, &rng)
                if status != FACE_CERTIFIED:
                    return status
                _fresh_direction(ws, d, &rng)
                fresh = True
                continue
            if w == NULL:
                w = <double*> malloc((n_u + 1) * sizeof(double))
                if w == NULL:
                    with gil:
                        raise MemoryError()
            # w = m_t - M z, z = L^{-T} l (x1 still holds l = L^{-1} G_c[rows, t]): the
            # part of m_t orthogonal to the old rows' hull, so w . m_s is one constant
            _trsv_upper(ws.L, ws.cap, n, ws.x1)
            memset(w, 0, n_u * sizeof(double))
            ws.f.c_add(ws.snew, 1.0, w, NULL)
            for t in range(n):
                ws.f.c_add(ws.S + t * k, -ws.x1[t], w, NULL)
            ws.f.c_score(ws.snew, w, NULL, &wt)
            ws.f.c_score(ws.S, w, NULL, &w0)
            if not (wt - w0 > 0.0):
                return FACE_CERTIFIED
            alpha = dt / (wt - w0)
            for j in range(n_u):
                d[j] -= alpha * w[j]
            fresh = False
    finally:
        free(w)
        free(seen.table)
        if fs != NULL:
            fs.s_ref = s_ref
            fs.tau = tau
            fs.eps = eps


# -- untying: the eta_v part where n is not a function of m on the face -------------
# The completion spans the optimal face in u-space, which fixes du/deta_u. The eta_v
# part, M_I D N_I^T, is the derivative only where n is an affine function of m on the
# face's vertices. Where it is not, the face has "fibers" (at tied transition scores,
# the crossovers of two optimal sequences have the unary columns of the pair they
# cross and other transitions): the eta_v part then depends on which vertices I holds,
# and u has a kink in eta_v. There the backward set is that of a solve at
# eta_v + delta r, for a fixed pseudo-random direction r (tie_direction): the
# Jacobian of the affine piece u follows from eta along r, a one-sided derivative and
# an element of the B-subdifferential.

# The direction r, and the one that certifies the untied face (any other draw).
cdef unsigned long long TIE_SEED = 0x71e5eed2018ULL
cdef unsigned long long TIE_CHECK_SEED = 0xc4ec75eed2018ULL
# The first delta, relative to the score scale: large, since a solve at eta_v + delta r
# takes fewer iterations the larger delta is (about 1800 at 1e-6, 1200 at 1e-3 for a
# sequence of 15 x 5 at scale 0.1), and shrunk by 8 while u is not affine on
# [0, delta] along r (past the piece: breakpoints were at 1e-3 to 1e-2 there). Median
# untying times over 4 seeds, 1e-4 / 1e-3 / 1e-2 / 1e-1: 15 x 5 at scale 0.1: 7.0 /
# 3.2 / 1.6 / 1.5 ms; 30 x 8 at scale 1: 1.1 / 0.7 / 0.9 / 1.1 ms.
cdef double UNTIE_DELTA = 1e-2
# Attempts at delta (each shrinking it by 8) before FACE_UNRESOLVED.
cdef Py_ssize_t UNTIE_TRIES = 8
# Check (a) of _untie: weights down to -UNTIE_YTOL, and M y0 = u0 to UNTIE_YTOL max(1, |u0|).
cdef double UNTIE_YTOL = 1e-9


# Drawn directions by (seed, size), read-only and kept: workspaces point into them.
_TIE_ARRAYS = {}


cdef object _tie_array(unsigned long long seed, Py_ssize_t n):
    """n draws uniform in [-1, 1) from a fixed seed, as a read-only array (cached)."""
    cdef unsigned long long state = seed
    cdef double[::1] o
    a = _TIE_ARRAYS.get((seed, n))
    if a is None:
        a = np.zeros(max(n, 1))
        o = a
        if n:
            _perturb(NULL, 1.0, &o[0], n, &state)
        a.flags.writeable = False
        _TIE_ARRAYS[(seed, n)] = a
    return a


def tie_direction(Factor factor):
    """The direction ``r`` that breaks ties in ``eta_v`` (see ``_untie``), flat."""
    return np.array(_tie_array(TIE_SEED, factor.n_v)[:factor.n_v])


cdef int _v_weights(_Workspace ws, const double* r, Py_ssize_t n) except -1 nogil:
    """x1[:n] <- D N^T r, Prop. 1 on the first n rows (the leading block of the factor
    and of w2 is theirs): the weights' derivative along (0, r). Leaves dvec zero."""
    cdef Py_ssize_t t, nI = ws.nI
    if ws.nI + 1 >= ws.cap:
        ws._grow(2 * ws.cap)
    memset(ws.dvec, 0, ws.n_u * sizeof(double))
    for t in range(n):
        ws.f.c_score(ws.S + t * ws.k, ws.dvec, r, &ws.x1[t])
    ws.nI = n
    ws._jacobian(ws.x1)
    ws.nI = nI
    return 0


cdef double _v_direction(_Workspace ws, const double* r) except? -1.0 nogil:
    """dvec <- -J_v r = -M_I D N_I^T r on the rows (as a jvp along (0, r)); returns c,
    the rows' common value of phi_s = r . n_s - (J_v r) . m_s (Prop. 1 ties it)."""
    cdef Py_ssize_t t
    cdef double c
    _v_weights(ws, r, ws.nI)
    for t in range(ws.nI):
        ws.f.c_add(ws.S + t * ws.k, -ws.x1[t], ws.dvec, NULL)
    ws.f.c_score(ws.S, ws.dvec, r, &c)
    return c


cdef int _fibered(_Workspace ws, const double* r, _FaceScale* fs) except -1 nogil:
    """Whether the face holds a vertex off the affine map m -> n that the rows fix.

    For a completed workspace (adj = eta_u - u, rows spanning the face in u-space)
    and its scales fs. phi_s = r . n_s - (J_v r) . m_s is one constant c on the
    rows, hence on the whole face if n is affine in m there; MAP at
    theta + eps [-J_v r; r] and at theta - eps [-J_v r; r] returns the face's
    maximiser and minimiser of phi. Returns 1 if one of them is off c beyond the
    tie tolerance, 0 if neither is (two MAP calls; for a random r, a fiber is seen
    with probability 1), 2 if eps shrank below FACE_MIN tie tolerances first.
    """
    cdef Py_ssize_t j
    cdef double c = _v_direction(ws, r), st, ph, sign, eps = fs.eps
    cdef int side
    for side in range(2):
        sign = 1.0 if side == 0 else -1.0
        while True:
            for j in range(ws.n_u):
                ws.pert[j] = ws.adj[j] + (sign * eps) * ws.dvec[j]
            for j in range(ws.n_v):
                ws.qv[j] = ws.eta_v[j] + (sign * eps) * r[j]
            ws.f.c_map(ws.pert, ws.qv, ws.snew, ws.work)
            ws.n_map += 1
            ws.f.c_score(ws.snew, ws.adj, ws.eta_v, &st)
            if st - fs.s_ref >= -fs.tau:
                break
            eps /= 4          # past the face's margin (J_v r can be large)
            if eps < FACE_MIN * fs.tau:
                return 2
        ws.f.c_score(ws.snew, ws.dvec, r, &ph)
        if sign * (ph - c) * eps > FACE_SEE * fs.tau:
            return 1
    return 0


cdef void _drop_completion(_Workspace ws) noexcept nogil:
    """Drop the trailing weight-0 rows (a face completion's): the leading block of the
    Cholesky factor, and of w2, is that of the rows kept."""
    while ws.nI > 1 and not (ws.y[ws.nI - 1] > 0.0):
        ws.nI -= 1
        ws.hash -= _hash_structure(ws.S + ws.nI * ws.k, ws.k)


cdef int _untie(_Workspace ws, const double* u0, Py_ssize_t max_iter, double tol,
                const _FaceScale* fs) except -1 nogil:
    """Make the rows a backward set for eta_v + 0+ r (r: TIE_SEED's direction).

    For a completed workspace whose face F is fibered (_fibered), u0 the
    solve's u and fs its completion's scales. Warm-started from the support,
    solve at eta_v + delta r and complete that face F'; certified when

    (a) the support's weights, moved back along their own derivative
        (Prop. 1 on the support: dy = D N^T r), y0 = y - delta dy, are
        nonnegative and give u0 (M y0 = u0): then (u(t), y(t)) =
        (M y(t), y + (t - delta) dy) satisfies the KKT conditions for every
        t in [0, delta] (every score is affine in t along it, and at most the
        maximum at both ends), so u is affine on the segment;
    (b) every row of F' ties at eta (F' lies in F): then the face at
        eta + t r is F' for every t in (0, delta), and J (Prop. 1 on F') is
        the limit of the Jacobians there, an element of the B-subdifferential.
        Ties here, and M y0 = u0 in (a), are up to FACE_MIN tie tolerances,
        the completion's floor: a structure that close to the face is a kink
        no finite difference resolves (binned transition scores gave ones 4
        tolerances below F, which kept every delta down to 1e-7 from
        passing; in the support at delta, they moved y0's u by 1e-9).

    Else delta was past the piece u follows from eta along r: it shrinks by 8.
    (a) is needed: on a sequence, u(delta) - u0 = delta J r held past a
    breakpoint where J changed. The first delta is UNTIE_DELTA of the score
    scale. (c) F' must not be fibered itself, along another random direction
    (_fibered; inconclusive when the pieces along r are thin cones). The
    workspace's u, y and v are then the perturbed solve's: the caller keeps
    the solve's support. Returns FACE_CERTIFIED, or FACE_BUDGET /
    FACE_UNRESOLVED.
    """
    cdef const double* ev = ws.eta_v
    cdef void* callback = ws.callback
    cdef int face
    ws.callback = NULL          # the user's callback sees the solve's iterations only
    try:
        face = _untie_tries(ws, ev, u0, max_iter, tol, fs)
    finally:
        ws.callback = callback
        ws._set_eta(ws.eta_u, ev)
    return face


cdef bint _extends_back(_Workspace ws, const double* u0, double delta,
                        double tie) except -1 nogil:
    """_untie's check (a): y - delta dy >= 0 and M (y - delta dy) = u0 on the support
    (the leading rows of weight > 0; dy = D N^T r with r in ws.rv), up to round-off
    and, for the second, the tie tolerance tie. Uses x1, dvec."""
    cdef Py_ssize_t t, j, n = 0
    cdef double y0, lo = 0.0, err = 0.0, ref = 1.0
    while n < ws.nI and ws.y[n] > 0.0:
        n += 1
    _v_weights(ws, ws.rv, n)           # Prop. 1 on the support alone
    for t in range(n):
        y0 = ws.y[t] - delta * ws.x1[t]
        lo = min(lo, y0)
        ws.f.c_add(ws.S + t * ws.k, y0, ws.dvec, NULL)
    for j in range(ws.n_u):
        err = max(err, fabs(ws.dvec[j] - u0[j]))
        ref = max(ref, fabs(u0[j]))
    return lo >= -UNTIE_YTOL and err <= UNTIE_YTOL * ref + tie


cdef int _untie_tries(_Workspace ws, const double* ev, const double* u0, Py_ssize_t max_iter,
                      double tol, const _FaceScale* fs) except -1 nogil:
    """_untie's attempts at delta."""
    cdef double delta = UNTIE_DELTA * (fs.eps / FACE_EPS), gap, obj, st
    cdef Py_ssize_t j, t, tries, n_iter
    cdef int status
    cdef bint ok
    cdef _FaceScale fs2
    for tries in range(UNTIE_TRIES):
        for j in range(ws.n_v):
            ws.pv[j] = ev[j] + delta * ws.rv[j]
        _drop_completion(ws)
        ws._rescore(ws.eta_u, ws.pv)
        status = _run(ws, max_iter, tol, NULL, &n_iter, &gap, &obj)
        if status != CONVERGED and status != STALLED:
            return FACE_UNRESOLVED
        status = _complete(ws, max_iter, gap, &fs2)
        if status != FACE_CERTIFIED:
            return status
        ok = _extends_back(ws, u0, delta, FACE_MIN * fs.tau)
        for j in range(ws.n_u):
            ws.pert[j] = ws.eta_u[j] - u0[j]
        t = 0
        while ok and t < ws.nI:
            ws.f.c_score(ws.S + t * ws.k, ws.pert, ev, &st)
            ok = st - fs.s_ref >= -FACE_MIN * fs.tau
            t += 1
        if ok:
            status = _fibered(ws, ws.rc, &fs2)
            return FACE_UNRESOLVED if status == 1 else FACE_CERTIFIED
        delta /= 8
        if delta < FACE_MIN * fs.tau:
            break
    return FACE_UNRESOLVED


# ---------------------------------------------------------------------------
# Solving problems: setup with the GIL, then every problem a thread claims in
# one block without it, the outcome left in C buffers until asked for.
# ---------------------------------------------------------------------------

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


cdef int _sol_alloc(_Sol* sol, Factor f, Py_ssize_t n, Py_ssize_t b0,
                    bint with_L) except -1 nogil:
    """(Re)allocate sol's block for n rows of factor f, the backward set from row b0."""
    cdef Py_ssize_t nL = (n - b0) * (n - b0) if with_L else 0
    free(sol.buf)
    sol.buf = malloc((n + nL + f.n_u + f.n_v) * sizeof(double)
                     + n * f.struct_size * sizeof(int) + sizeof(double))
    if sol.buf == NULL:
        with gil:
            raise MemoryError()
    sol.y = <double*> sol.buf
    sol.L = sol.y + n
    sol.u = sol.L + nL
    sol.v = sol.u + f.n_u
    sol.S = <int*> (sol.v + f.n_v)
    sol.n_support = n
    sol.n_pos = n
    sol.b0 = b0
    sol.has_cholesky = with_L
    return 0


cdef int _sol_copy(_Sol* dst, const _Sol* src, Factor f) except -1 nogil:
    """dst <- a copy of src (same factor f)."""
    cdef void* buf = dst.buf
    dst[0] = src[0]
    dst.buf = buf
    if src.buf == NULL:
        free(dst.buf)
        dst.buf = NULL
        return 0
    _sol_alloc(dst, f, src.n_support, src.b0, src.has_cholesky)
    dst.n_pos = src.n_pos
    memcpy(dst.buf, src.buf, (<char*> (src.S + src.n_support * f.struct_size))
                             - <char*> src.buf)
    return 0


cdef class _Solution:
    """Outcome of one solve, in C buffers (a ``_Sol``); NumPy copies are made on request."""
    cdef public Factor factor
    cdef _Sol s
    cdef public object history

    def __dealloc__(self):
        free(self.s.buf)

    @property
    def n_support(self):
        """The support's size (weights > 0)."""
        return self.s.n_pos

    @property
    def n_backward(self):
        """The backward set's size: the support and its completion to the optimal face
        (or, where ties in eta_v were broken, the face at eta_v + delta r)."""
        return self.s.n_support - self.s.b0

    @property
    def untied(self):
        """Whether the backward set is that of a solve at eta_v + delta r (_untie)."""
        return self.s.b0 > 0

    @property
    def face_status(self):
        """``FACE_STATUS_CERTIFIED``, ``FACE_STATUS_BUDGET`` or ``FACE_STATUS_UNRESOLVED``."""
        return self.s.face

    @property
    def n_iter(self):
        return self.s.n_iter

    @property
    def n_map(self):
        return self.s.n_map

    @property
    def status(self):
        return self.s.status

    @property
    def gap(self):
        return self.s.gap

    @property
    def objective(self):
        return self.s.objective

    @property
    def seconds(self):
        """Spent in the solve without the GIL (benchmarks)."""
        return self.s.seconds

    @property
    def has_cholesky(self):
        return self.s.has_cholesky

    def structures_array(self, bint backward=False, bint rows=False):
        """The support (or with ``backward`` the backward set; with ``rows`` every
        row kept), ``(n, struct_size)`` intc, solver's order."""
        cdef Py_ssize_t k = self.factor.struct_size
        cdef Py_ssize_t a = self.s.b0 if (backward and not rows) else 0
        cdef Py_ssize_t n = self.s.n_support if (backward or rows) else self.s.n_pos
        out = np.empty((n - a, k), dtype=np.intc)
        cdef int[:, ::1] o = out
        if n > a:
            memcpy(&o[0, 0], self.s.S + a * k, (n - a) * k * sizeof(int))
        return out

    def weights_array(self, bint rows=False):
        """The support's weights (with ``rows``, every row's)."""
        return _copy_out(self.s.y, self.s.n_support if rows else self.s.n_pos)

    def u_array(self):
        return _copy_out(self.s.u, self.factor.n_u)

    def v_array(self):
        return _copy_out(self.s.v, self.factor.n_v)

    def cholesky_array(self):
        """``L`` as an ``(n, n)`` array, or None."""
        if not self.s.has_cholesky:
            return None
        cdef Py_ssize_t n = self.s.n_support - self.s.b0
        return _copy_out(self.s.L, n * n).reshape(n, n)

    def __reduce__(self):
        return (solution_from_arrays,
                (self.factor, self.structures_array(rows=True), self.weights_array(True),
                 self.cholesky_array(), self.u_array(), self.v_array(), self.s.n_iter,
                 self.s.n_map, self.s.status, self.s.gap, self.s.objective, self.history,
                 self.s.n_pos, self.s.face, self.s.b0))


cdef class _Solutions:
    """The outcomes of a padded batch, one ``_Sol`` per problem in one C array.

    What the backward pass of a padded batch needs, without a Python object per
    problem; :meth:`solution` copies one out as a :class:`_Solution`.
    """
    cdef _Sol* items
    cdef PyObject** factors      # per problem (borrowed from self.keep)
    cdef Py_ssize_t n
    cdef object keep

    def __cinit__(self, factors, Py_ssize_t n):
        cdef Py_ssize_t i
        self.n = n
        self.items = <_Sol*> calloc(n if n > 0 else 1, sizeof(_Sol))
        self.factors = <PyObject**> malloc((n if n > 0 else 1) * sizeof(PyObject*))
        if self.items == NULL or self.factors == NULL:
            raise MemoryError()
        if isinstance(factors, Factor):
            self.keep = factors
            for i in range(n):
                self.factors[i] = <PyObject*> factors
        else:
            self.keep = tuple(factors)
            for i in range(n):
                self.factors[i] = <PyObject*> self.keep[i]

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.items != NULL:
            for i in range(self.n):
                free(self.items[i].buf)
        free(self.items)
        free(self.factors)

    def __len__(self):
        return self.n

    def solution(self, Py_ssize_t i):
        """A :class:`_Solution` copy of problem i's outcome."""
        cdef _Solution sol = _Solution.__new__(_Solution)
        sol.factor = <Factor> self.factors[i]
        _sol_copy(&sol.s, &self.items[i], sol.factor)
        return sol

    def put(self, Py_ssize_t i, _Solution sol):
        """Problem i's outcome <- a copy of sol's (of the same factor)."""
        if sol.factor is not <object> self.factors[i]:
            raise ValueError(f"put: problem {i} has another factor")
        _sol_copy(&self.items[i], &sol.s, sol.factor)


def solution_from_arrays(Factor factor, S, y, L, u, v, Py_ssize_t n_iter, Py_ssize_t n_map,
                         int status, double gap, double objective, history=None,
                         n_pos=None, int face=FACE_CERTIFIED, Py_ssize_t b0=0):
    """A :class:`_Solution` from NumPy arrays (CG solvers, the backward support, unpickling).

    ``S`` and ``y`` are every row kept: the first ``n_pos`` (None: all) are the
    support, rows ``b0``.. the backward set, whose Cholesky factor is ``L``.
    """
    cdef _Solution sol = _Solution.__new__(_Solution)
    cdef const int[:, ::1] Sv = np.ascontiguousarray(S, dtype=np.intc).reshape(
        -1, factor.struct_size)
    cdef const double[::1] yv = np.ascontiguousarray(y, dtype=np.float64).reshape(-1)
    cdef const double[::1] uv = np.ascontiguousarray(u, dtype=np.float64).reshape(-1)
    cdef const double[::1] vv = np.ascontiguousarray(v, dtype=np.float64).reshape(-1)
    cdef const double[::1] Lv
    cdef Py_ssize_t n = Sv.shape[0]
    if not 0 <= b0 <= n or yv.shape[0] != n:
        raise ValueError(f"b0, y: expected b0 in [0, {n}] and {n} weights, got {b0}, "
                         f"{yv.shape[0]}")
    sol.factor = factor
    _sol_alloc(&sol.s, factor, n, b0, L is not None)
    if n:
        memcpy(sol.s.S, &Sv[0, 0], n * factor.struct_size * sizeof(int))
        memcpy(sol.s.y, &yv[0], n * sizeof(double))
        if L is not None and n > b0:
            Lv = np.ascontiguousarray(L, dtype=np.float64).reshape(-1)
            if Lv.shape[0] != (n - b0) * (n - b0):
                raise ValueError(f"L: expected {(n - b0) * (n - b0)} entries, "
                                 f"got {Lv.shape[0]}")
            memcpy(sol.s.L, &Lv[0], (n - b0) * (n - b0) * sizeof(double))
    memcpy(sol.s.u, &uv[0], factor.n_u * sizeof(double))
    if factor.n_v:
        memcpy(sol.s.v, &vv[0], factor.n_v * sizeof(double))
    if b0 > 0 and n_pos is None:
        n_pos = b0
    if n_pos is not None:
        if not 0 <= n_pos <= n or (b0 > 0 and n_pos != b0):
            raise ValueError(f"n_pos: expected an int in [0, {n}]"
                             + (f" equal to b0 = {b0}" if b0 > 0 else "")
                             + f", got {n_pos!r}")
        sol.s.n_pos = n_pos
    sol.s.face = face
    sol.s.n_iter = n_iter
    sol.s.n_map = n_map
    sol.s.status = status
    sol.s.gap = gap
    sol.s.objective = objective
    sol.history = history
    return sol


cdef void _copy_factor(double* L, _Workspace ws) noexcept nogil:
    """L <- the workspace's Cholesky factor, nI x nI, row-major, zeros above."""
    cdef Py_ssize_t n = ws.nI, i
    for i in range(n):
        memcpy(L + i * n, ws.L + i * ws.cap, (i + 1) * sizeof(double))
        memset(L + i * n + i + 1, 0, (n - 1 - i) * sizeof(double))


cdef int _export_backward(_Sol* sol, _Workspace ws) except -1 nogil:
    """Make the workspace's rows sol's backward set (b0 = n_pos), after _untie; sol
    (from _export_to) keeps its support, weights, u and v."""
    cdef _Sol old = sol[0]
    cdef Py_ssize_t p = old.n_pos, n = ws.nI, k = ws.k
    sol.buf = NULL
    try:
        _sol_alloc(sol, ws.f, p + n, p, True)
        memcpy(sol.S, old.S, p * k * sizeof(int))
        memcpy(sol.S + p * k, ws.S, n * k * sizeof(int))
        memcpy(sol.y, old.y, p * sizeof(double))
        memset(sol.y + p, 0, n * sizeof(double))
        _copy_factor(sol.L, ws)
        memcpy(sol.u, old.u, ws.n_u * sizeof(double))
        memcpy(sol.v, old.v, ws.n_v * sizeof(double))
        sol.n_pos = p
    finally:
        free(old.buf)
    return 0


cdef enum:
    # what _finish prepares for the backward pass
    BACKWARD_LAZY = 0  # the completed face, checked for fibers (FACE_FIBERED: untie later)
    BACKWARD_NOW = 1   # the completed face, a fibered one untied now
    BACKWARD_NONE = 2  # nothing: no derivative will be taken (losses; u and v as ever)


cdef int _finish(_Workspace ws, _Sol* sol, Py_ssize_t budget, Py_ssize_t max_iter,
                 double tol, Py_ssize_t n_iter, int status, double gap, double obj,
                 int backward) except -1 nogil:
    """A finished active-set loop into sol: unless BACKWARD_NONE, its face
    completed (at most budget MAP calls) where it converged or stalled, and
    checked for fibers (n not affine in m on it). A fibered face is untied (the
    backward set is then _untie's) with BACKWARD_NOW, else marked FACE_FIBERED:
    its backward set is right for eta_u only, and the caller unties it when a
    derivative is asked for (reduce_support). Untying that fails keeps the
    completed face: FACE_FIBERED, or FACE_BUDGET (which makes a converged solve
    FACE_INCOMPLETE, as the completion's does)."""
    cdef Py_ssize_t n_pos = ws.nI
    cdef int face = FACE_CERTIFIED, fib
    cdef _FaceScale fs
    if (status == CONVERGED or status == STALLED) and backward != BACKWARD_NONE:
        face = _complete(ws, budget, gap, &fs)
        if face == FACE_BUDGET and status == CONVERGED:
            status = FACE_INCOMPLETE
        elif face == FACE_CERTIFIED and ws.n_v > 0 and fs.s_ref > -INFINITY:
            fib = _fibered(ws, ws.rv, &fs)
            if fib == 2:
                face = FACE_UNRESOLVED
            elif fib == 1 and backward == BACKWARD_LAZY:
                face = FACE_FIBERED
            elif fib == 1:
                # the support and the completed face first: the backward set kept if
                # untying fails (with its status, which the callers report)
                _export_to(sol, ws, n_iter, status, gap, obj, n_pos, face)
                face = _untie(ws, sol.u, max_iter, tol, &fs)
                if face == FACE_CERTIFIED:
                    _export_backward(sol, ws)
                elif face == FACE_BUDGET and status == CONVERGED:
                    sol.status = FACE_INCOMPLETE
                sol.face = face if face != FACE_UNRESOLVED else FACE_FIBERED
                return 0
    _export_to(sol, ws, n_iter, status, gap, obj, n_pos, face)
    return 0


cdef int _export_to(_Sol* sol, _Workspace ws, Py_ssize_t n_iter, int status, double gap,
                    double obj, Py_ssize_t n_pos, int face) except -1 nogil:
    """Copy a finished solve out of the workspace (which the next problem reuses); its
    first n_pos rows are the support, the rest (weight 0) the face completion."""
    cdef Py_ssize_t n = ws.nI
    ws._compute_u(ws.y, True)
    _sol_alloc(sol, ws.f, n, 0, True)
    sol.n_pos = n_pos
    sol.face = face
    memcpy(sol.S, ws.S, n * ws.k * sizeof(int))
    memcpy(sol.y, ws.y, n * sizeof(double))
    _copy_factor(sol.L, ws)
    memcpy(sol.u, ws.u, ws.n_u * sizeof(double))
    memcpy(sol.v, ws.v, ws.n_v * sizeof(double))
    sol.n_iter = n_iter
    sol.n_map = ws.n_map
    sol.status = status
    sol.gap = gap
    sol.objective = obj
    return 0


cdef void _point(_Workspace ws, const double* eta_u, const double* eta_v) noexcept nogil:
    """Point an empty workspace at new scores (the caller keeps them alive), fill |eta|."""
    ws._set_eta(eta_u, eta_v)
    ws.nI = 0
    ws.n_map = 0
    ws.hash = 0
    ws.n_log = 0


cdef int _solve_one(_Workspace ws, _Sol* sol, const double* eta_u, const double* eta_v,
                    const int* init, Py_ssize_t n_init, double* hist, Py_ssize_t max_iter,
                    double tol, int backward) except -1 nogil:
    """One active-set solve into sol, its support completed to span the optimal face
    (as backward says, see _finish); status INFEASIBLE when every
    structure is forbidden."""
    cdef Py_ssize_t n_iter = 0
    cdef double gap = 0, obj = 0, t0 = _now()
    cdef int status
    _point(ws, eta_u, eta_v)
    ws.log_on = True
    if n_init > 0:
        ws._start(init, n_init, NULL)
    if ws.nI == 0:
        # cold start from the MAP structure (weight 1), unless it is forbidden too
        status = ws.f.c_map(ws.eta_u, ws.eta_v, ws.snew, ws.work)
        ws.n_map += 1
        if status == 0:
            ws._start(ws.snew, 1, NULL)
        if ws.nI == 0:
            sol.status = INFEASIBLE
            sol.n_map = ws.n_map
            sol.seconds = _now() - t0
            return 0
    status = _run(ws, max_iter, tol, hist, &n_iter, &gap, &obj)
    # max_iter bounds the loop's iterations and the completion's MAP calls together
    _finish(ws, sol, max_iter - n_iter, max_iter, tol, n_iter, status, gap, obj, backward)
    sol.seconds = _now() - t0
    return 0


cdef extern from *:
    """
    /* The few atomics the batch runner needs, shared by threads without the GIL:
       claiming a problem from either end of the order (front and back counts
       packed in one 64-bit word, updated by compare-and-swap), counting
       finished ones, and a stop flag. */
    #if defined(_MSC_VER)
    #include <intrin.h>
    static CYTHON_INLINE Py_ssize_t sm_fetch_add(Py_ssize_t* p, Py_ssize_t v) {
        return (Py_ssize_t) _InterlockedExchangeAdd64((volatile __int64*) p, (__int64) v);
    }
    static CYTHON_INLINE Py_ssize_t sm_load(Py_ssize_t* p) {
        return (Py_ssize_t) _InterlockedOr64((volatile __int64*) p, 0);
    }
    static CYTHON_INLINE int sm_cas(long long* p, long long* expected, long long desired) {
        long long seen = (long long) _InterlockedCompareExchange64(
            (volatile __int64*) p, (__int64) desired, (__int64) *expected);
        if (seen == *expected) return 1;
        *expected = seen;
        return 0;
    }
    static CYTHON_INLINE long long sm_load64(long long* p) {
        return (long long) _InterlockedOr64((volatile __int64*) p, 0);
    }
    #else
    static CYTHON_INLINE Py_ssize_t sm_fetch_add(Py_ssize_t* p, Py_ssize_t v) {
        return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
    }
    static CYTHON_INLINE Py_ssize_t sm_load(Py_ssize_t* p) {
        return __atomic_load_n(p, __ATOMIC_SEQ_CST);
    }
    static CYTHON_INLINE int sm_cas(long long* p, long long* expected, long long desired) {
        return __atomic_compare_exchange_n(p, expected, desired, 0, __ATOMIC_SEQ_CST,
                                           __ATOMIC_SEQ_CST);
    }
    static CYTHON_INLINE long long sm_load64(long long* p) {
        return __atomic_load_n(p, __ATOMIC_SEQ_CST);
    }
    #endif
    /* Claim the next problem from the front (from_back 0) or the back of 0..n-1;
       -1 when none is left. */
    static CYTHON_INLINE Py_ssize_t sm_claim(long long* packed, Py_ssize_t n, int from_back) {
        long long old = sm_load64(packed), f, b;
        for (;;) {
            f = old >> 32;
            b = old & 0xffffffffLL;
            if (f + b >= (long long) n) return -1;
            if (sm_cas(packed, &old, from_back ? old + 1 : old + (1LL << 32)))
                return (Py_ssize_t) (from_back ? n - 1 - b : f);
        }
    }
    """
    Py_ssize_t sm_claim(long long* packed, Py_ssize_t n, int from_back) nogil
    long long sm_load64(long long* p) nogil
    Py_ssize_t sm_fetch_add(Py_ssize_t* p, Py_ssize_t v) nogil
    Py_ssize_t sm_load(Py_ssize_t* p) nogil


cdef enum:
    MAX_DIMS = 8     # dims of a padded array beyond the batch axis


cdef extern from *:
    """
    /* CPU seconds of the calling thread (benchmarks: the time batches spend without the GIL). */
    #if defined(_WIN32)
    static double sm_thread_cpu(void) {
        FILETIME c, e, k, u;
        ULARGE_INTEGER kk, uu;
        GetThreadTimes(GetCurrentThread(), &c, &e, &k, &u);
        kk.LowPart = k.dwLowDateTime; kk.HighPart = k.dwHighDateTime;
        uu.LowPart = u.dwLowDateTime; uu.HighPart = u.dwHighDateTime;
        return 1e-7 * (double) (kk.QuadPart + uu.QuadPart);
    }
    #else
    static double sm_thread_cpu(void) {
        struct timespec ts;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
        return ts.tv_sec + 1e-9 * ts.tv_nsec;
    }
    #endif
    """
    double sm_thread_cpu() noexcept nogil


# Benchmarks only: when on, batches add the CPU time their threads spend in their
# claim loops without the GIL (in nanoseconds) to _no_gil_ns.
cdef bint _timing = False
cdef Py_ssize_t _no_gil_ns = 0


def no_gil_seconds(on=None):
    """CPU seconds batches have spent on problems without the GIL (benchmarks only).

    Counted only while switched on: ``no_gil_seconds(True)`` switches it on
    (and ``False`` off); every call returns the total so far. Each thread's
    claim loop counts up to its last problem (one clock read per problem),
    except the time it holds the GIL in it (creating a workspace).
    """
    global _timing
    if on is not None:
        _timing = bool(on)
    return sm_load(&_no_gil_ns) * 1e-9


cdef struct _Problem:
    _Sol* sol                # the outcome solved, or differentiated
    PyObject* factor         # its factor (borrowed: the batch keeps it alive)
    # In a padded batch, in_u, out_u (and in_v, out_v where padded) are the problem's
    # slots of padded arrays, float64 or float32, read and written by _gather / _scatter.
    const double* in_u       # eta_u, or the direction / gradient of a backward product
    const double* in_v       # eta_v or d_eta_v (NULL: none or zeros)
    double* out_u            # backward outputs; padded batches: the solve's u too
    double* out_v
    const int* init          # warm start rows, or NULL
    Py_ssize_t n_init
    double* hist             # history rows, or NULL
    Py_ssize_t slot          # which distinct factor (workspaces are per thread and factor)
    Py_ssize_t index         # the problem's index in the batch
    const int* target        # a loss batch: the target structure
    double* value            # a loss batch: where the loss goes


cdef inline const double* _data(object arrays, Py_ssize_t i) except NULL:
    """Row i of a 2-d float64 C-contiguous array, or item i of a list of flat arrays."""
    cdef cnp.ndarray a
    if type(arrays) is list:
        a = <cnp.ndarray> arrays[i]
        return <const double*> cnp.PyArray_DATA(a)
    a = <cnp.ndarray> arrays
    return (<const double*> cnp.PyArray_DATA(a)) + i * a.shape[1]


# -- padded batches: each problem's block of one padded array -------------------------
# A padded array is C-contiguous, float64 or float32 (itemsize 8 or 4), shaped
# (n, *pad); problem i's data is the leading block (its factor's shape) of its slot,
# element i. The threads convert to and from float64 as they copy.

cdef void _block_copy(char* padded, Py_ssize_t isz, const Py_ssize_t* pad,
                      const Py_ssize_t* shape, int ndim, double* flat,
                      bint into_padded) noexcept nogil:
    """Copy between the leading block ``shape`` of a padded slot and a flat float64 C-ordered
    array of that block (into the slot if into_padded), row by row."""
    cdef Py_ssize_t idx[MAX_DIMS]
    cdef Py_ssize_t stride[MAX_DIMS]
    cdef Py_ssize_t rows = 1, width = shape[ndim - 1], r, k, off = 0
    cdef int d
    cdef char* q
    cdef double* x
    stride[ndim - 1] = 1
    for d in range(ndim - 2, -1, -1):
        stride[d] = stride[d + 1] * pad[d + 1]
    for d in range(ndim - 1):
        rows *= shape[d]
        idx[d] = 0
    if width == 0:
        return
    for r in range(rows):
        q = padded + off * isz
        x = flat + r * width
        if isz == 8:
            if into_padded:
                memcpy(q, x, width * sizeof(double))
            else:
                memcpy(x, q, width * sizeof(double))
        elif into_padded:
            for k in range(width):
                (<float*> q)[k] = <float> x[k]
        else:
            for k in range(width):
                x[k] = (<const float*> q)[k]
        d = ndim - 2          # the next row: an odometer over the leading dims
        while d >= 0:
            idx[d] += 1
            off += stride[d]
            if idx[d] < shape[d]:
                break
            off -= idx[d] * stride[d]
            idx[d] = 0
            d -= 1


cdef inline Py_ssize_t _prod(const Py_ssize_t* shape, int ndim) noexcept nogil:
    cdef Py_ssize_t n = 1
    cdef int d
    for d in range(ndim):
        n *= shape[d]
    return n


cdef int _gather(const char* slot, Py_ssize_t isz, const Py_ssize_t* pad,
                 const Py_ssize_t* shape, int ndim, double* flat) noexcept nogil:
    """A problem's block of a padded array into flat (float64); its HAS_NEGINF | HAS_BAD flags.

    Only the block is read (the padding may hold anything, NaN included)."""
    _block_copy(<char*> slot, isz, pad, shape, ndim, flat, False)
    return _scan(flat, _prod(shape, ndim))


cdef void _scatter(const double* flat, char* slot, Py_ssize_t isz, const Py_ssize_t* pad,
                   const Py_ssize_t* shape, int ndim) noexcept nogil:
    """flat (NULL: zeros) into the block of a problem's slot, zeros in the rest of the slot."""
    memset(slot, 0, _prod(pad, ndim) * isz)
    if flat != NULL:
        _block_copy(slot, isz, pad, shape, ndim, <double*> flat, True)


cdef bint _fits(tuple shape, const Py_ssize_t* pad, int ndim, Py_ssize_t* out):
    """Whether a block shape fits in a padded shape (then copied to out)."""
    cdef int d
    if len(shape) != ndim:
        return False
    for d in range(ndim):
        out[d] = shape[d]
        if out[d] > pad[d]:
            return False
    return True


cdef Py_ssize_t _check_padded(object arr, str name, Py_ssize_t n, object like=None) except -1:
    """The itemsize of a padded array; a ValueError unless it is one (shaped like ``like``)."""
    if (type(arr) is not np.ndarray or arr.dtype.kind != "f" or arr.itemsize not in (4, 8)
            or not arr.flags.c_contiguous or not 2 <= arr.ndim <= MAX_DIMS + 1
            or arr.shape[0] != n or (like is not None and arr.shape != like.shape)):
        raise ValueError(f"{name}: expected a C-contiguous float32 or float64 array of shape "
                         f"({n}, ...) with 1 to {MAX_DIMS} padded dims"
                         + ("" if like is None else f", shaped {like.shape}")
                         + f", got {arr!r:.60}")
    return arr.itemsize


cdef inline char* _base(object arr, Py_ssize_t* stride):
    """The data of a padded array (NULL for None) and, in stride, the bytes per slot."""
    if arr is None:
        stride[0] = 0
        return NULL
    stride[0] = (<cnp.ndarray> arr).strides[0]
    return <char*> cnp.PyArray_DATA(<cnp.ndarray> arr)


cdef enum:
    SOLVE = 0
    JVP = 1
    VJP = 2
    LOSS = 3

# A loss batch's flags beside HAS_NEGINF and HAS_BAD, and what report() says of them
cdef enum:
    _MAP_INFEASIBLE = 4
    _TARGET_FORBIDDEN = 8
TARGET_FORBIDDEN = -2    # the target uses a part its scores forbid: infinite loss

# A problem of a padded batch whose input block the run refused (nan or +inf in scores; any
# non-finite value in a gradient or direction): not solved, zeros in its outputs.
REFUSED = -1
# A solve that was to untie a fibered face now (BACKWARD_NOW) and could not: converged,
# its backward set the tied face's (see _finish).
UNTIE_FAILED = -3


cdef class _Batch:
    """Problems prepared with the GIL, then run by any number of threads without it.

    Built by :func:`prepare_solve` or :func:`prepare_backward`, which make
    every Python object the run needs (solutions, outputs) and take every
    pointer in one pass. Each thread calls :meth:`run` with its own number;
    threads claim problems one at a time from an atomic counter, largest
    first, so they balance problems of unequal cost and touch the GIL only
    to create a workspace the first time they meet a factor. A thread that
    joins late finds nothing left and returns.

    A padded batch reads every problem's input from its block of one padded
    array and writes its outputs into its slot of one padded array (zeros
    outside the block), copying through per-thread buffers without the GIL;
    :meth:`report` then says which problems need a look from Python.
    """
    cdef _Problem* P
    cdef Py_ssize_t n, n_threads, n_slots
    cdef int kind
    cdef Py_ssize_t max_iter
    cdef double tol
    cdef int backward            # BACKWARD_NOW or BACKWARD_LAZY for solves (see _finish)
    cdef void* callback          # Python callable called per iteration (borrowed), or NULL;
                                 # the same for every problem, set in each new workspace
    cdef long long claimed       # problems claimed from the front (high 32 bits) and back
    cdef Py_ssize_t n_done, stop
    cdef Py_ssize_t signalled    # whether `finished` was released (once)
    cdef PyThread_type_lock finished   # held until every problem is done, or one failed
    cdef PyObject** ws           # n_threads x n_slots workspaces (NULL until needed)
    cdef double* scratch         # per thread: padded blocks, then 2 * max support doubles
    cdef Py_ssize_t scratch_stride
    cdef list keep               # the objects behind the pointers
    cdef list slot_factors
    cdef object error            # (problem, exception) of the first failure
    cdef public object outputs   # list in problem order (_Solution, du, or (g_u, g_v)),
                                 # a padded solve's _Solutions, or None (padded backward)
    cdef list hists              # return_history buffers, in problem order
    # padded batches
    cdef bint padded             # u data (in and out) are slots of padded arrays
    cdef bint v_in_padded        # in_v too (else flat, zeros or NULL)
    cdef Py_ssize_t isz_in_u, isz_in_v, isz_out_u, isz_out_v   # their itemsizes
    cdef int ndim_u, ndim_v
    cdef Py_ssize_t pad_u[MAX_DIMS]
    cdef Py_ssize_t pad_v[MAX_DIMS]
    cdef Py_ssize_t* shapes      # per slot: its factor's shape_u, then shape_v (MAX_DIMS each)
    cdef Py_ssize_t max_nu, max_nv
    cdef unsigned char* flags    # per problem (claim order): flags of its input blocks
    # loss batches
    cdef double margin           # scale of the Hamming cost added to eta_u
    cdef bint sparse             # SparseMAP (else MAP) at the cost-augmented scores

    def __cinit__(self):
        self.P = NULL
        self.ws = NULL
        self.scratch = NULL
        self.finished = NULL
        self.shapes = NULL
        self.flags = NULL
        self.callback = NULL

    def __dealloc__(self):
        free(self.P)
        free(self.ws)
        free(self.scratch)
        free(self.shapes)
        free(self.flags)
        if self.finished != NULL:
            if self.signalled == 0:     # still held: release before freeing, as CPython does
                PyThread_release_lock(self.finished)
            PyThread_free_lock(self.finished)

    cdef int _setup(self, Py_ssize_t n, Py_ssize_t n_threads, int kind) except -1:
        self.n = n
        self.n_threads = n_threads if n_threads > 0 else 1
        self.kind = kind
        self.claimed = 0
        self.n_done = 0
        self.stop = 0
        self.signalled = 0
        self.finished = PyThread_allocate_lock()
        if self.finished == NULL:
            raise MemoryError()
        PyThread_acquire_lock(self.finished, WAIT_LOCK)
        self.P = <_Problem*> calloc(n if n > 0 else 1, sizeof(_Problem))
        if self.P == NULL:
            raise MemoryError()
        self.keep = []
        self.slot_factors = []
        self.error = None
        return 0

    cdef Py_ssize_t _slot(self, dict slots, Factor f) except -1:
        """The slot of factor f (one per distinct factor object), added on first sight."""
        s = slots.get(id(f))
        if s is None:
            s = slots[id(f)] = len(self.slot_factors)
            self.slot_factors.append(f)
        return s

    cdef int _set_pads(self, arr_u, arr_v) except -1:
        """Padded shapes from the arrays (n, *pad_u) and (n, *pad_v) (None: no v), checked."""
        cdef int d
        self.padded = True
        self.ndim_u = arr_u.ndim - 1
        for d in range(self.ndim_u):
            self.pad_u[d] = arr_u.shape[d + 1]
        self.ndim_v = 0 if arr_v is None else arr_v.ndim - 1
        for d in range(self.ndim_v):
            self.pad_v[d] = arr_v.shape[d + 1]
        return 0

    cdef int _set_shapes(self, names) except -1:
        """Each slot's block shapes, checked against the padded shapes (after the slots)."""
        cdef Py_ssize_t s
        cdef Py_ssize_t* sh
        cdef Factor f
        self.shapes = <Py_ssize_t*> calloc(max(self.n_slots, 1) * 2 * MAX_DIMS,
                                           sizeof(Py_ssize_t))
        self.flags = <unsigned char*> calloc(self.n if self.n > 0 else 1, 1)
        if self.shapes == NULL or self.flags == NULL:
            raise MemoryError()
        self.max_nu = self.max_nv = 0
        for s in range(self.n_slots):
            f = self.slot_factors[s]
            sh = self.shapes + s * 2 * MAX_DIMS
            self.max_nu = max(self.max_nu, f.n_u)
            self.max_nv = max(self.max_nv, f.n_v)
            if not _fits(f.shape_u, self.pad_u, self.ndim_u, sh):
                self._misfit(s, names[0], "u", f.shape_u, self.pad_u, self.ndim_u)
            # no padded v, or an empty block: zeros
            if self.ndim_v and f.n_v and not _fits(f.shape_v, self.pad_v, self.ndim_v,
                                                   sh + MAX_DIMS):
                self._misfit(s, names[1], "v", f.shape_v, self.pad_v, self.ndim_v)
        return 0

    cdef int _misfit(self, Py_ssize_t s, name, which, tuple shape, const Py_ssize_t* pad,
                     int ndim) except -1:
        cdef Py_ssize_t i = min(self._problems_of(s))
        raise ValueError(f"{name}[{i}]: the factor's shape_{which} {shape} does not fit in "
                         f"the padded shape {tuple(pad[d] for d in range(ndim))}")

    def _problems_of(self, Py_ssize_t s):
        return [self.P[j].index for j in range(self.n) if self.P[j].slot == s]

    cdef int _alloc_workspaces(self) except -1:
        self.ws = <PyObject**> calloc(self.n_threads * max(len(self.slot_factors), 1),
                                      sizeof(PyObject*))
        if self.ws == NULL:
            raise MemoryError()
        self.n_slots = len(self.slot_factors)
        return 0

    cdef int _alloc_scratch(self, Py_ssize_t per_thread) except -1:
        self.scratch_stride = per_thread if per_thread > 0 else 1
        self.scratch = <double*> malloc(self.n_threads * self.scratch_stride * sizeof(double))
        if self.scratch == NULL:
            raise MemoryError()
        return 0

    cdef int _new_workspace(self, Py_ssize_t t, Py_ssize_t slot) except -1:
        cdef _Workspace ws = _Workspace(self.slot_factors[slot], 16)
        ws.callback = self.callback     # workspaces are per batch
        self.keep.append(ws)
        self.ws[t * self.n_slots + slot] = <PyObject*> ws
        return 0

    cdef int _work(self, Py_ssize_t t, Py_ssize_t j) except -1 nogil:
        """Problem j (claim order) as thread t."""
        cdef _Problem* p = &self.P[j]
        cdef PyObject** ws = self.ws + t * self.n_slots
        cdef double* buf = self.scratch + t * self.scratch_stride if self.scratch != NULL else NULL
        cdef const double* in_u = p.in_u
        cdef const double* in_v = p.in_v
        cdef double* out_u = p.out_u
        cdef double* out_v = p.out_v
        cdef const Py_ssize_t* shape_u = NULL
        cdef const Py_ssize_t* shape_v = NULL
        cdef int flags = 0
        cdef bint ok
        cdef Py_ssize_t n_v = (<Factor> p.factor).n_v
        cdef double t0
        if (self.kind == SOLVE or self.kind == LOSS) and ws[p.slot] == NULL:
            t0 = sm_thread_cpu() if _timing else 0.0
            with gil:
                self._new_workspace(t, p.slot)
            if _timing:     # held the GIL: not counted by run
                sm_fetch_add(&_no_gil_ns, -<Py_ssize_t> (1e9 * (sm_thread_cpu() - t0)))
        if self.padded:
            # the blocks go through this thread's buffers: in_u, in_v, out_u, out_v, then x
            shape_u = self.shapes + p.slot * 2 * MAX_DIMS
            shape_v = shape_u + MAX_DIMS
            flags = _gather(<const char*> p.in_u, self.isz_in_u, self.pad_u, shape_u,
                            self.ndim_u, buf)
            in_u = buf
            if self.v_in_padded and n_v:
                flags |= _gather(<const char*> p.in_v, self.isz_in_v, self.pad_v, shape_v,
                                 self.ndim_v, buf + self.max_nu)
                in_v = buf + self.max_nu
            self.flags[j] = flags
            buf += self.max_nu + self.max_nv
            out_u = buf
            out_v = buf + self.max_nu if (p.out_v != NULL and n_v) else NULL
            buf += self.max_nu + self.max_nv
        if self.kind == LOSS:
            # in_u is this thread's copy of the block: the cost is added there
            if not (flags & HAS_BAD):
                flags |= self._loss(<_Workspace> ws[p.slot], p, <double*> in_u, in_v,
                                    out_u, out_u + self.max_nu)
                self.flags[j] = flags
            ok = flags == 0 or flags == HAS_NEGINF
            _scatter(out_u if ok else NULL, <char*> p.out_u, self.isz_out_u, self.pad_u,
                     shape_u, self.ndim_u)
            if p.out_v != NULL:
                _scatter(out_u + self.max_nu if ok and n_v else NULL, <char*> p.out_v,
                         self.isz_out_v, self.pad_v, shape_v, self.ndim_v)
        elif self.kind == SOLVE:
            if not (flags & HAS_BAD):
                _solve_one(<_Workspace> ws[p.slot], p.sol, in_u, in_v, p.init, p.n_init, p.hist,
                           self.max_iter, self.tol, self.backward)
            if self.padded:
                _scatter(p.sol.u if p.sol.buf != NULL else NULL, <char*> p.out_u, self.isz_out_u,
                         self.pad_u, shape_u, self.ndim_u)
        else:
            # a backward product: gradients and directions must be finite (masks are scores)
            if flags == 0:
                _jacobian_apply(p.sol, <Factor> p.factor, in_u, in_v, out_u, out_v, buf)
            if self.padded:
                _scatter(out_u if flags == 0 else NULL, <char*> p.out_u, self.isz_out_u,
                         self.pad_u, shape_u, self.ndim_u)
                if p.out_v != NULL:
                    _scatter(out_v if flags == 0 else NULL, <char*> p.out_v, self.isz_out_v,
                             self.pad_v, shape_v, self.ndim_v)
        return 0

    cdef int _loss(self, _Workspace ws, _Problem* p, double* eu, const double* ev,
                   double* gu, double* gv) except -1 nogil:
        """One loss of a loss batch: ``p.value`` and its gradient ``(gu, gv)`` at the
        scores ``eu`` (a scratch copy, cost-augmented in place) and ``ev``; 0, or the
        flag _MAP_INFEASIBLE or _TARGET_FORBIDDEN (outputs unset).

        As :mod:`sparsemap.losses` computes them for a 0/1 target ``t`` (the same
        operations, so the same bits, except for the value's sums): with
        ``eu' = eu + margin (1 - m_t)``, SparseMAP (``sparse``) or MAP at
        ``(eu', ev)`` gives ``(u, v)``; the gradient is ``(u - m_t, v - n_t)`` and
        the value ``1/2 |g_u|^2 + eu'.g_u + ev.g_v - u.g_u`` (for a vertex ``u``:
        ``a_s . eta' - a_t . eta'``), products skipping the parts where the gradient
        is 0 (forbidden parts are -inf there), clipped at 0.
        """
        cdef Py_ssize_t n_u = ws.f.n_u, n_v = ws.f.n_v, j
        cdef double[1] score
        cdef double value = 0.0, g
        cdef const double* u = NULL
        ws.f.c_score(p.target, eu, ev, score)
        if score[0] == -INFINITY:
            return _TARGET_FORBIDDEN
        memset(gu, 0, n_u * sizeof(double))
        if n_v:
            memset(gv, 0, n_v * sizeof(double))
        ws.f.c_add(p.target, 1.0, gu, gv if n_v else NULL)      # (m_t, n_t)
        if self.margin > 0:
            for j in range(n_u):
                eu[j] += self.margin * (1.0 - gu[j])            # -inf stays -inf
        if self.sparse:
            # the loss's gradient is u - m_t: no derivative of u is taken
            _solve_one(ws, p.sol, eu, ev, NULL, 0, NULL, self.max_iter, self.tol, BACKWARD_NONE)
            if p.sol.status == INFEASIBLE:
                return _MAP_INFEASIBLE
            u = p.sol.u
            for j in range(n_u):
                gu[j] = u[j] - gu[j]
            for j in range(n_v):
                gv[j] = p.sol.v[j] - gv[j]
        else:
            if ws.f.c_map(eu, ev, ws.snew, ws.work) != 0:
                return _MAP_INFEASIBLE
            for j in range(n_u):
                gu[j] = -gu[j]
            for j in range(n_v):
                gv[j] = -gv[j]
            ws.f.c_add(ws.snew, 1.0, gu, gv if n_v else NULL)   # m_s - m_t, n_s - n_t
        for j in range(n_u):
            g = gu[j]
            if g != 0:
                value += eu[j] * g
                if u != NULL:
                    value += 0.5 * g * g - u[j] * g
        if ev != NULL:
            for j in range(n_v):
                if gv[j] != 0:
                    value += ev[j] * gv[j]
        p.value[0] = value if value > 0 else 0.0
        return 0

    def run(self, Py_ssize_t t, bint from_back=False, double budget=-1.0):
        """Work as thread number t (0 <= t < n_threads) until no problem is left.

        Problems are claimed from the front of the order (the largest first),
        or from its back with ``from_back``; with ``budget > 0``, return once
        that many seconds have passed (checked between problems).
        """
        cdef Py_ssize_t j = -1
        cdef double t0 = _now(), cpu0 = 0.0, cpu1
        if t < 0 or t >= self.n_threads:
            raise ValueError(f"t: expected a thread number in [0, {self.n_threads}), got {t}")
        try:
            with nogil:
                if _timing:
                    cpu0 = sm_thread_cpu()
                while sm_load(&self.stop) == 0:
                    if budget > 0 and _now() - t0 > budget:
                        break
                    j = sm_claim(&self.claimed, self.n, from_back)
                    if j < 0:
                        break
                    self._work(t, j)
                    if _timing:     # counted before the problem counts as done
                        cpu1 = sm_thread_cpu()
                        sm_fetch_add(&_no_gil_ns, <Py_ssize_t> (1e9 * (cpu1 - cpu0)))
                        cpu0 = cpu1
                    if sm_fetch_add(&self.n_done, 1) == self.n - 1:
                        self._signal()
        except BaseException as exc:
            # stop every thread; the caller raises the first failure (by position)
            if self.error is None or self.error[0] > j:
                self.error = (j, exc)
            sm_fetch_add(&self.stop, 1)
            sm_fetch_add(&self.n_done, 1)
            self._signal()

    cdef void _signal(self) noexcept nogil:
        """Release the caller waiting in wait(), once."""
        if sm_fetch_add(&self.signalled, 1) == 0:
            PyThread_release_lock(self.finished)

    def remaining(self):
        """Problems not claimed yet."""
        cdef long long c = sm_load64(&self.claimed)
        return self.n - (c >> 32) - (c & 0xffffffff)

    def wait(self):
        """Block (without the GIL) until every problem is done or one failed; raise its error."""
        if self.n > 0 and sm_load(&self.n_done) < self.n and sm_load(&self.stop) == 0:
            # Block, not spin: on a virtual machine whose CPUs share a core, a
            # spinning caller starves the thread it waits for.
            with nogil:
                PyThread_acquire_lock(self.finished, WAIT_LOCK)
                PyThread_release_lock(self.finished)
        if self.error is not None:
            j, exc = self.error
            _add_note(exc, self.P[j].index)
            raise exc
        if self.hists is not None:
            for i, sol in enumerate(self.outputs):
                h = self.hists[i]
                (<_Solution> sol).history = h[:4 * sol.n_iter].reshape(sol.n_iter, 4).copy()


    def report(self):
        """After :meth:`wait`: the problems to look at, as ``(index, code)`` by index.

        ``code`` is ``REFUSED`` for a problem of a padded batch whose input
        block held a value the run does not accept (nan or +inf in scores; any
        non-finite value in a backward input), else, for solves, the status of
        a problem that did not converge, or ``UNTIE_FAILED``. Usually empty.
        """
        cdef Py_ssize_t j
        cdef int status
        out = []
        for j in range(self.n):
            if self.kind == LOSS:
                if self.flags[j] & HAS_BAD:
                    out.append((self.P[j].index, REFUSED))
                elif self.flags[j] & _TARGET_FORBIDDEN:
                    out.append((self.P[j].index, TARGET_FORBIDDEN))
                elif self.flags[j] & _MAP_INFEASIBLE:
                    out.append((self.P[j].index, INFEASIBLE))
                elif self.sparse and self.P[j].sol.status != CONVERGED:
                    out.append((self.P[j].index, self.P[j].sol.status))
            elif self.flags != NULL and (self.flags[j] & HAS_BAD if self.kind == SOLVE
                                         else self.flags[j]):
                out.append((self.P[j].index, REFUSED))
            elif self.kind == SOLVE:
                status = self.P[j].sol.status
                if status != CONVERGED:
                    out.append((self.P[j].index, status))
                elif self.backward == BACKWARD_NOW and self.P[j].sol.face == FACE_FIBERED:
                    out.append((self.P[j].index, UNTIE_FAILED))
        out.sort()
        return out


cdef struct _Key:
    Py_ssize_t cost
    Py_ssize_t index


cdef int _by_cost(const void* a, const void* b) noexcept nogil:
    """Decreasing cost, then increasing index (a stable order)."""
    cdef const _Key* x = <const _Key*> a
    cdef const _Key* y = <const _Key*> b
    if x.cost != y.cost:
        return -1 if x.cost > y.cost else 1
    return -1 if x.index < y.index else (1 if x.index > y.index else 0)


cdef class _Order:
    """Problems 0..n-1 in the order threads claim them: most expensive first (ties in
    index order), from the costs set in ``keys``."""
    cdef _Key* keys
    cdef Py_ssize_t n

    def __cinit__(self, Py_ssize_t n):
        cdef Py_ssize_t i
        self.n = n
        self.keys = <_Key*> malloc((n if n > 0 else 1) * sizeof(_Key))
        if self.keys == NULL:
            raise MemoryError()
        for i in range(n):
            self.keys[i].cost = 0
            self.keys[i].index = i

    def __dealloc__(self):
        free(self.keys)

    cdef object indices(self, bint sort):
        """An intp array (input order unless sort)."""
        cdef Py_ssize_t j
        out = np.empty(self.n, dtype=np.intp)
        cdef Py_ssize_t[::1] o = out
        if sort and self.n > 1:
            qsort(self.keys, self.n, sizeof(_Key), _by_cost)
        for j in range(self.n):
            o[j] = self.keys[j].index
        return out


def _add_note(exc, Py_ssize_t i):
    if hasattr(exc, "add_note"):   # Python >= 3.11
        exc.add_note(f"(while solving problem {i} of the batch)")


def prepare_solve(factors, etas_u, etas_v, inits,
                  Py_ssize_t max_iter, double tol, bint return_history, Py_ssize_t n_threads,
                  callback=None, out_u=None, bint untie=False):
    """A :class:`_Batch` of active-set solves; its ``outputs`` are the ``_Solution`` objects.

    Inputs must be validated: their pointers are read without checks (except
    in a padded batch, whose blocks the threads scan).

    Parameters
    ----------
    factors : Factor or list of Factor
        Shared by every problem, or one per problem.
    etas_u : ndarray or list of ndarray
        A 2-d float64 C-contiguous array (row ``i``: problem ``i``) or a list
        of flat float64 C-contiguous arrays. With ``out_u``: a padded
        C-contiguous float64 or float32 array ``(n, *pad_u)``, problem ``i``
        reading the leading block of shape ``factor.shape_u`` of ``etas_u[i]``.
    etas_v : None, ndarray or list
        As ``etas_u`` (padded with ``out_u``, leading blocks of shape
        ``factor.shape_v``); None (or None entries of a list): zeros.
    inits : None or list
        Warm starts: None entries, or ``(k, struct_size)`` intc arrays.
    max_iter, tol, return_history
        As for :func:`sparsemap.solve`.
    n_threads : int
        How many threads will call :meth:`_Batch.run`. They claim problems by
        decreasing ``n_u + n_v`` (ties, and one thread, in input order).
    callback : callable, optional
        Called with the GIL after every iteration of every problem (see
        :func:`sparsemap.solve`); a problem it stops gets ``STATUS_STOPPED``.
    out_u : ndarray, optional
        Makes the batch padded: a C-contiguous float64 or float32 array
        shaped like ``etas_u``, into which each problem writes its ``u``
        (zeros outside its block). The threads copy each block out in float64,
        scan it (a problem whose block holds nan or +inf is refused, see
        :meth:`_Batch.report`) and solve it: the padding is never read.
    untie : bool
        Untie fibered faces in the solve (the padded layers' backward pass
        has no scores to do it later); else they are left ``FACE_FIBERED``.

    Notes
    -----
    A thread keeps one workspace per factor object and reuses it from one
    problem to the next; a solve's arithmetic does not depend on the
    workspace's history (tests check results bitwise against fresh solves).
    A problem whose structures all use a forbidden part gets status
    ``STATUS_INFEASIBLE``.
    """
    cdef _Batch b = _Batch.__new__(_Batch)
    cdef Py_ssize_t n = len(etas_u), j, i, max_nv = 0
    cdef Factor f
    cdef _Solution sol
    cdef _Solutions sols
    cdef _Order by_cost
    cdef const Py_ssize_t[::1] claim
    cdef cnp.ndarray a
    cdef bint shared = isinstance(factors, Factor)
    cdef bint padded = out_u is not None
    cdef const double* zeros = NULL
    cdef char* in_u = NULL
    cdef char* in_v = NULL
    cdef char* o_u = NULL
    cdef Py_ssize_t st_u = 0, st_v = 0, st_o = 0
    cdef _Problem* p
    b._setup(n, n_threads, SOLVE)
    b.max_iter = max_iter
    b.tol = tol
    b.backward = BACKWARD_NOW if untie else BACKWARD_LAZY
    b.callback = NULL if callback is None else <void*> callback
    b.hists = [None] * n if return_history else None
    slots = {}
    if shared:
        b.slot_factors.append(factors)
        max_nv = (<Factor> factors).n_v
    else:
        for f in factors:
            b._slot(slots, f)
            if f.n_v > max_nv:
                max_nv = f.n_v
    if max_nv and (etas_v is None or type(etas_v) is list):
        zero_buf = np.zeros(max_nv)
        b.keep.append(zero_buf)
        zeros = <const double*> cnp.PyArray_DATA(<cnp.ndarray> zero_buf)
    if padded:
        b.isz_in_u = _check_padded(etas_u, "etas_u", n)
        b.isz_out_u = _check_padded(out_u, "out_u", n, etas_u)
        b.v_in_padded = etas_v is not None
        if b.v_in_padded:
            b.isz_in_v = _check_padded(etas_v, "etas_v", n)
        b._set_pads(etas_u, etas_v)
        in_u = _base(etas_u, &st_u)
        in_v = _base(etas_v, &st_v)
        o_u = _base(out_u, &st_o)
        sols = _Solutions(factors, n)
        b.outputs = sols
    else:
        b.outputs = [None] * n
    b.keep.extend((etas_u, etas_v, inits, callback, out_u))
    by_cost = _Order(n)
    if n_threads > 1 and not shared:
        for i in range(n):
            f = factors[i]
            by_cost.keys[i].cost = f.n_u + f.n_v
    claim = by_cost.indices(n_threads > 1 and not shared)
    for j in range(n):
        i = claim[j]
        p = &b.P[j]
        p.index = i
        f = factors if shared else factors[i]
        p.factor = <PyObject*> f
        p.slot = 0 if shared else slots[id(f)]
        if padded:
            p.sol = &sols.items[i]
            p.in_u = <const double*> (in_u + i * st_u)
            p.out_u = <double*> (o_u + i * st_o)
        else:
            sol = _Solution.__new__(_Solution)
            sol.factor = f
            b.outputs[i] = sol
            p.sol = &sol.s
            p.in_u = _data(etas_u, i)
        if f.n_v == 0:
            p.in_v = NULL
        elif etas_v is None or (type(etas_v) is list and etas_v[i] is None):
            p.in_v = zeros
        elif padded:
            p.in_v = <const double*> (in_v + i * st_v)
        else:
            p.in_v = _data(etas_v, i)
        if inits is not None and inits[i] is not None:
            a = <cnp.ndarray> inits[i]
            p.init = <const int*> cnp.PyArray_DATA(a)
            p.n_init = a.shape[0]
        if return_history:
            h = np.zeros(4 * max_iter + 4)
            b.hists[i] = h
            p.hist = <double*> cnp.PyArray_DATA(<cnp.ndarray> h)
    b._alloc_workspaces()
    if padded:
        b._set_shapes(("etas_u", "etas_v"))
        b._alloc_scratch(2 * (b.max_nu + b.max_nv))
    return b


def prepare_backward(sols, ins_u, ins_v, bint transpose,
                     Py_ssize_t n_threads, out_u=None, out_v=None):
    """A :class:`_Batch` of Jacobian products; its ``outputs`` are the products.

    Parameters
    ----------
    sols : list of _Solution, or _Solutions
        Each with its Cholesky factor.
    ins_u : list of flat float64 arrays, or a 2-d float64 array (row i for sols[i])
        ``d_eta_u`` (jvp) or ``du`` (vjp), validated. With ``out_u``: a padded
        C-contiguous float64 or float32 array ``(n, *pad_u)`` (leading blocks read).
    ins_v : None, or (jvp only) as ins_u, entries None meaning zeros
    transpose : bool
        False: ``du = M_I D A_I^T d_eta`` (jvp); True: ``(g_u, g_v) = A_I D M_I^T du`` (vjp).
    n_threads
        As for :func:`prepare_solve`; problems are claimed by decreasing cost
        of the product, ``|I| (n_u + struct_size)``.
    out_u, out_v : ndarray, optional
        Make the batch padded, as in :func:`prepare_solve`: ``out_u`` shaped
        like ``ins_u`` receives ``du`` (jvp) or ``g_u`` (vjp) of each problem,
        zero-padded; ``out_v`` (vjp only, optional) a C-contiguous float64
        or float32 array ``(n, *pad_v)`` receives ``g_v``. Inputs are scanned in the
        threads: a block holding a non-finite value is refused (see
        :meth:`_Batch.report`).

    Returns
    -------
    _Batch whose ``outputs`` are ``du`` arrays (jvp) or ``(g_u, g_v)`` pairs
    (vjp), shaped like the factors' scores (None when padded).
    """
    cdef _Batch b = _Batch.__new__(_Batch)
    cdef Py_ssize_t n = len(sols), j, i, max_support = 0
    cdef _Solution sol
    cdef _Solutions many = sols if isinstance(sols, _Solutions) else None
    cdef _Order by_cost
    cdef const Py_ssize_t[::1] claim
    cdef Factor f
    cdef _Problem* p
    cdef bint padded = out_u is not None
    cdef char* in_u = NULL
    cdef char* in_v = NULL
    cdef char* o_u = NULL
    cdef char* o_v = NULL
    cdef Py_ssize_t st_u = 0, st_v = 0, st_ou = 0, st_ov = 0
    if many is not None and many.n != n:
        raise ValueError(f"sols: expected {n} solutions, got {many.n}")
    b._setup(n, n_threads, VJP if transpose else JVP)
    b.outputs = None if padded else [None] * n
    b.hists = None
    b.keep.extend((sols, ins_u, ins_v, out_u, out_v))
    slots = {}
    if padded:
        if (ins_v if transpose else out_v) is not None:
            raise ValueError("a vjp takes no ins_v, a jvp gives no out_v")
        b.isz_in_u = _check_padded(ins_u, "ins_u", n)
        b.isz_out_u = _check_padded(out_u, "out_u", n, ins_u)
        b.v_in_padded = ins_v is not None
        if b.v_in_padded:
            b.isz_in_v = _check_padded(ins_v, "ins_v", n)
        if out_v is not None:
            b.isz_out_v = _check_padded(out_v, "out_v", n)
        b._set_pads(ins_u, out_v if transpose else ins_v)
        in_u = _base(ins_u, &st_u)
        in_v = _base(ins_v, &st_v)
        o_u = _base(out_u, &st_ou)
        o_v = _base(out_v, &st_ov)
    by_cost = _Order(n)
    if n_threads > 1:
        for i in range(n):
            if many is not None:
                f = <Factor> many.factors[i]
                by_cost.keys[i].cost = many.items[i].n_support * (f.n_u + f.struct_size)
            else:
                sol = sols[i]
                by_cost.keys[i].cost = sol.s.n_support * (sol.factor.n_u
                                                          + sol.factor.struct_size)
    claim = by_cost.indices(n_threads > 1)
    for j in range(n):
        i = claim[j]
        p = &b.P[j]
        p.index = i
        if many is not None:
            p.sol = &many.items[i]
            p.factor = many.factors[i]
        else:
            sol = sols[i]
            p.sol = &sol.s
            p.factor = <PyObject*> sol.factor
        f = <Factor> p.factor
        if p.sol.n_support > max_support:
            max_support = p.sol.n_support
        if padded:
            p.slot = b._slot(slots, f)
            p.in_u = <const double*> (in_u + i * st_u)
            p.out_u = <double*> (o_u + i * st_ou)
            if in_v != NULL:
                p.in_v = <const double*> (in_v + i * st_v)
            if o_v != NULL:
                p.out_v = <double*> (o_v + i * st_ov)
            continue
        p.in_u = _data(ins_u, i)
        if f.n_v and ins_v is not None and (type(ins_v) is not list or ins_v[i] is not None):
            p.in_v = _data(ins_v, i)
        gu = np.empty(f.shape_u)
        p.out_u = <double*> cnp.PyArray_DATA(<cnp.ndarray> gu)
        if transpose:
            gv = np.empty(f.shape_v)
            if f.n_v:
                p.out_v = <double*> cnp.PyArray_DATA(<cnp.ndarray> gv)
            b.outputs[i] = (gu, gv)
        else:
            b.outputs[i] = gu
    b._alloc_workspaces()
    if padded:
        b._set_shapes(("ins_u", "ins_v" if not transpose else "out_v"))
    b._alloc_scratch(2 * (b.max_nu + b.max_nv) + 2 * max_support + 2)
    return b


def reduce_support(Factor factor, const int[:, ::1] structures, const double[::1] weights,
                   const double[::1] eta_u, const double[::1] eta_v, double gap=0.0,
                   Py_ssize_t budget=0, double tol=1e-12, bint untie=True):
    """Affinely independent support with the same ``u``, and its Cholesky factor.

    Used for the backward pass of solvers (conditional gradient) whose final
    support may be affinely dependent. Structures are inserted one at a time
    with their weights; a dependent one shifts weight along the null direction
    (Caratheodory), exactly as when the active set meets one. With
    ``budget > 0`` the support is then completed to span the optimal face
    (weight-0 rows, as after an active-set solve; ``gap``: the solve's), and
    untied where ``n`` is not affine in ``m`` on the face (``tol``: the tolerance
    of that solve at ``eta_v + delta r``; without ``untie``, such a face is only
    reported, ``FACE_STATUS_FIBERED``: the factor graph's check).

    Returns
    -------
    structures, weights, L, n_pos, face_status, b0
        Every row kept (its first ``n_pos`` rows are the support, rows ``b0``..
        the backward set, whose Cholesky factor is ``L``).
    """
    cdef _Workspace ws = _Workspace(factor, structures.shape[0] + 4)
    cdef Py_ssize_t t
    cdef double wmax = 0.0
    cdef Py_ssize_t n_pos
    _point(ws, &eta_u[0] if factor.n_u else NULL, &eta_v[0] if factor.n_v else NULL)
    ws._start(&structures[0, 0], structures.shape[0], &weights[0])
    # exact ties in the ratio tests leave round-off weights behind
    for t in range(ws.nI):
        wmax = max(wmax, ws.y[t])
    ws._drop_below(1e-14 * wmax)
    n_pos = ws.nI
    if budget == 0:
        S, y, L = ws._export()
        return S, y / y.sum(), L, n_pos, FACE_CERTIFIED, 0
    cdef _Solution sol = _Solution.__new__(_Solution)
    sol.factor = factor
    with nogil:
        _finish(ws, &sol.s, budget, budget, tol, 0, CONVERGED, gap, 0.0,
                BACKWARD_NOW if untie else BACKWARD_LAZY)
    y = sol.weights_array(True)
    return (sol.structures_array(rows=True), y / y.sum(), sol.cholesky_array(),
            sol.s.n_pos, sol.s.face, sol.s.b0)


cdef void _jacobian_transform(const double* L, int n, double* x, double* w2) noexcept nogil:
    """x <- (Z - Z 1 1^T Z / 1^T Z 1) x with Z = (L L^T)^{-1} (Prop. 1), L n x n.

    As ``_Workspace._jacobian``: with w2 = L^{-1} 1 (w2 is scratch for n
    doubles) and x' = L^{-1} x, x <- L^{-T} (x' - w2 (w2.x') / (w2.w2)).
    """
    cdef Py_ssize_t t
    cdef double a
    if n == 0:
        return
    for t in range(n):
        w2[t] = 1.0
    _trsv_lower(L, n, n, w2)
    _trsv_lower(L, n, n, x)
    a = _dot(w2, x, n) / _dot(w2, w2, n)
    for t in range(n):
        x[t] -= a * w2[t]
    _trsv_upper(L, n, n, x)


cdef int _jacobian_apply(const _Sol* sol, Factor f, const double* in_u, const double* in_v,
                         double* out_u, double* out_v, double* x) except -1 nogil:
    """``M_I D A_I^T`` or ``A_I D M_I^T`` applied to a vector, D of Prop. 1.

    x_t = a_t . [in_u; in_v] (in_v NULL: only the m_t part), x <- D x, and
    out_u = sum_t x_t m_t, plus out_v = sum_t x_t n_t when out_v is not NULL.
    x is scratch for 2 |I| doubles. O(|I| n + |I|^2).
    """
    cdef Py_ssize_t n = sol.n_support - sol.b0, k = f.struct_size, t
    cdef const int* S = sol.S + sol.b0 * k
    memset(out_u, 0, f.n_u * sizeof(double))
    if out_v != NULL:
        memset(out_v, 0, f.n_v * sizeof(double))
    for t in range(n):
        f.c_score(S + t * k, in_u, in_v, &x[t])
    _jacobian_transform(sol.L, <int> n, x, x + n)
    for t in range(n):
        f.c_add(S + t * k, x[t], out_u, out_v)
    return 0


def _time_map(Factor factor, double[:, ::1] etas_u, double[:, ::1] etas_v, Py_ssize_t repeats):
    """Median seconds of one C-level MAP call (benchmarks only).

    Cycles through the rows of ``etas_u`` / ``etas_v`` (different score arrays),
    so that branch predictors do not learn one instance.
    """
    cdef _Workspace ws = _Workspace(factor, 4)
    cdef Py_ssize_t K = etas_u.shape[0], i
    cdef double[::1] times = np.empty(repeats)
    cdef double t0
    with nogil:
        for i in range(repeats):
            t0 = _now()
            factor.c_map(&etas_u[i % K, 0], &etas_v[i % K, 0] if factor.n_v else NULL,
                         ws.snew, ws.work)
            times[i] = _now() - t0
    return float(np.median(times))


def prepare_loss(factors, etas_u, etas_v, targets, double margin, bint sparse,
                 Py_ssize_t max_iter, double tol, Py_ssize_t n_threads, out_u, out_v, values):
    """A padded :class:`_Batch` of losses (the PyTorch losses' path; private).

    Problem ``i`` reads its blocks of ``etas_u`` / ``etas_v`` as
    :func:`prepare_solve` does with ``out_u``, adds ``margin`` times the
    Hamming cost of its target to the unary scores, and solves SparseMAP
    (``sparse``; its outcome is kept in the batch's ``outputs``, a
    ``_Solutions``) or MAP there. It writes the loss of :mod:`sparsemap.losses`
    into ``values[i]`` and its gradient into its slots of ``out_u`` and (if
    given) ``out_v``, zero-padded; see :meth:`_Batch._loss`.

    Parameters
    ----------
    factors : Factor or list of Factor
    etas_u, etas_v : padded arrays, as for :func:`prepare_solve` (etas_v may be None)
    targets : ndarray of intc, shape ``(n, k)``, C-contiguous
        Row ``i`` starts with problem ``i``'s target structure (``k`` at least
        its ``struct_size``), validated by the caller: the threads read it
        without checks.
    margin : float
        The cost's scale, >= 0.
    sparse : bool
    max_iter, tol, n_threads
        As for :func:`prepare_solve`.
    out_u : padded array shaped like ``etas_u``
    out_v : padded array ``(n, *pad_v)``, or None
    values : float64 array of shape ``(n,)``, C-contiguous

    :meth:`_Batch.report` then lists problems refused (nan or +inf in a
    block), whose target uses a forbidden part (``TARGET_FORBIDDEN``), whose
    structures all do (``STATUS_INFEASIBLE``), or whose SparseMAP solve did
    not converge; their outputs are zeros (the last: the best iterate's).
    """
    cdef Py_ssize_t n = len(etas_u), j, i, max_k = 0
    cdef const int[:, ::1] tg = targets
    cdef double[::1] vals = values
    cdef char* o_v
    cdef Py_ssize_t st_ov = 0
    cdef _Problem* p
    if tg.shape[0] != n or vals.shape[0] != n:
        raise ValueError(f"targets, values: expected {n} rows")
    for f in ([factors] if isinstance(factors, Factor) else factors):
        max_k = max(max_k, (<Factor> f).struct_size)
    if max_k > tg.shape[1]:
        raise ValueError(f"targets: expected rows of at least {max_k} ints, got {tg.shape[1]}")
    # a padded solve's batch, each problem then given its target, value and out_v
    cdef _Batch b = prepare_solve(factors, etas_u, etas_v, None, max_iter, tol, False,
                                  n_threads, None, out_u)
    b.kind = LOSS
    b.margin = margin
    b.sparse = sparse
    if out_v is not None:
        b.isz_out_v = _check_padded(out_v, "out_v", n, etas_v)
    o_v = _base(out_v, &st_ov)
    b.keep.extend((targets, out_v, values))
    for j in range(n):
        p = &b.P[j]
        i = p.index
        if o_v != NULL:
            p.out_v = <double*> (o_v + i * st_ov)
        p.target = &tg[i, 0]
        p.value = &vals[i]
        vals[i] = 0.0
    return b

