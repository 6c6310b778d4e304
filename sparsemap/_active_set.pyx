"""Active-set solver for SparseMAP (Appendix A.2, Algorithm 2): the workspace and the loop.

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

Result types: none of its own. The loop leaves its state in the workspace,
which ``sparsemap._backward`` copies into a solution record (``_Sol``), and
``_Workspace._export`` gives NumPy arrays (the factor graph's solver and
``reduce_support``).

Built on this module, each behind its own ``.pxd``: ``sparsemap._backward``
(the backward set of a solve: face completion, untying ties in ``eta_v``; the
solution record; Jacobian products) and ``sparsemap._batch`` (the batch runner,
which solves and differentiates many problems in threads without the GIL).
"""
import numpy as np

cimport numpy as cnp
from libc.math cimport fabs, sqrt, hypot, INFINITY
from libc.stdlib cimport malloc, realloc, free
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


cdef void _trsv_lower_t(const double* L, Py_ssize_t lda, Py_ssize_t n, double* x) noexcept nogil:
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


# -- random draws ---------------------------------------------------------------------
# Face completion probes along random directions, and untying (sparsemap._backward)
# breaks ties in eta_v along a fixed pseudo-random direction r. Each workspace keeps r
# and the direction that certifies an untied face (any other draw), drawn once per
# size from fixed seeds: drawing them costs more than a solve at scale 5.

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


# The seeds of r (tie_direction) and of the direction that certifies an untied face.
cdef unsigned long long TIE_SEED = 0x71e5eed2018ULL
cdef unsigned long long TIE_CHECK_SEED = 0xc4ec75eed2018ULL

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


cdef object _tie_for(Factor factor):
    """The tie direction of ``factor``, read-only (cached): draws from TIE_SEED; for a
    SequenceFactor one (S, S) draw repeated at every transition, so that a transition
    matrix shared by the positions breaks its ties along a shared direction too (the
    next step of training moves every position's transitions alike)."""
    from sparsemap._factors._sequence import SequenceFactor
    cdef Py_ssize_t n_v = factor.n_v
    if n_v and type(factor) is SequenceFactor:
        S = factor.n_states
        key = (TIE_SEED, "shared", n_v, S)
        a = _TIE_ARRAYS.get(key)
        if a is None:
            a = np.tile(_tie_array(TIE_SEED, S * S)[:S * S], n_v // (S * S))
            a.flags.writeable = False
            _TIE_ARRAYS[key] = a
        return a
    return _tie_array(TIE_SEED, n_v)


def tie_direction(Factor factor):
    """The direction ``r`` that breaks ties in ``eta_v``, flat (see ``_untie`` in
    ``sparsemap._backward``)."""
    return np.array(_tie_for(factor)[:factor.n_v])


cdef class _Workspace:
    """Support, weights and Cholesky factor of one solve (not thread-shared).

    Declared in ``_active_set.pxd``, so that the modules built on it (the
    backward set, the batch runner, the factor graph) drive it at C level.
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
            self.tie_keep = (_tie_for(f),
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
        _trsv_lower_t(self.L, self.cap, self.nI, x)

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
        ``theta``, ``theta_abs`` and ``w1 = L^{-1} theta``. Then ``_iterate``.
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


def decompose_point(Factor factor, u, Py_ssize_t max_iter=100_000):
    """Structures and weights whose ``sum_s w_s m_s`` is ``u``, a point of the factor's
    polytope of ``m`` (the facet side's ``r.structures`` for families without a
    decomposition of their own).

    The active set at scores ``eta_u = u`` (``eta_v = 0``): the projection of a point
    of the polytope is the point itself, so the support it ends with decomposes ``u``
    into affinely independent structures (at most ``dim + 1``). It runs to tol 0 (to
    the round-off floor, where it stalls): its cost is the vertex side's at ``u``.

    Returns
    -------
    structures : ndarray of intc, shape (k, factor.struct_size)
    weights : ndarray of float64, shape (k,)
    """
    cdef const double[::1] eu = np.ascontiguousarray(u, dtype=np.float64).reshape(-1)
    if eu.shape[0] != factor.n_u:
        raise ValueError(f"u: expected {factor.n_u} entries, got {eu.shape[0]}")
    zeros = np.zeros(factor.n_v + 1)
    cdef const double[::1] ev = zeros
    cdef _Workspace ws = _Workspace(factor, 16)
    cdef Py_ssize_t n_iter = 0
    cdef double gap = 0.0, obj = 0.0
    with nogil:
        _point(ws, &eu[0], &ev[0] if factor.n_v else NULL)
        if factor.c_map(ws.eta_u, ws.eta_v, ws.snew, ws.work) == 0:
            ws._start(ws.snew, 1, NULL)
        if ws.nI > 0:
            _iterate(ws, max_iter, 0.0, NULL, &n_iter, &gap, &obj)
    S = np.empty((ws.nI, ws.k), dtype=np.intc)
    if ws.nI:
        S[...] = np.asarray(<int[:ws.nI * ws.k]> ws.S).reshape(ws.nI, ws.k)
    y = np.asarray(<double[:ws.nI]> ws.y).copy() if ws.nI else np.empty(0)
    return S, y


cdef void _point(_Workspace ws, const double* eta_u, const double* eta_v) noexcept nogil:
    """Point an empty workspace at new scores (the caller keeps them alive), fill |eta|."""
    ws._set_eta(eta_u, eta_v)
    ws.nI = 0
    ws.n_map = 0
    ws.hash = 0
    ws.n_log = 0


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


cdef int _log(_Workspace ws, const int* s) except -1 nogil:
    """Remember s (a structure _iterate inserts) as a candidate for the face completion."""
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


cdef int _iterate(_Workspace ws, Py_ssize_t max_iter, double tol, double* hist,
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
