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

Problems are solved in batches (one problem for ``solve``) by
:mod:`sparsemap._batch`; each outcome stays in C buffers (a ``_Sol``, owned by a
``_Solution``) until a field is asked for.
"""
import numpy as np

cimport numpy as cnp
from cpython.ref cimport PyObject
from libc.math cimport fabs, sqrt, hypot, INFINITY
from libc.stdlib cimport calloc, malloc, realloc, free
from libc.string cimport memcpy, memmove, memset
from scipy.linalg.cython_blas cimport dtrsv

from sparsemap._factors._base cimport Factor

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

# The termination codes (declared in _active_set.pxd), shared with the
# conditional-gradient solvers and solve().
STATUS_CONVERGED, STATUS_MAX_ITER, STATUS_STALLED = CONVERGED, MAX_ITER, STALLED
STATUS_INFEASIBLE = INFEASIBLE
STATUS_STOPPED = STOPPED
STATUS_FACE_INCOMPLETE = FACE_INCOMPLETE


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
