# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The facet side for matchings: projection onto the (rectangular) Birkhoff polytope.

SparseMAP for :class:`~sparsemap.MatchingFactor` is the Euclidean projection of
``eta`` onto ``{x >= 0 : x's shorter side sums to 1, its longer side at most 1}``
(both sides equal to 1 when the matrix is square). This module solves it by its
constraints, with no structure in sight, and applies the Jacobian from the
constraints tight at the solution.

The solver works on the *logical* orientation: ``k = min(n_rows, n_cols)`` rows
whose sums are equalities (multipliers ``alpha``, free) and ``K`` columns whose
sums are at most one (multipliers ``beta <= 0``; equalities, ``beta`` free, when
``k == K``). A tall matrix is read as its transpose, by strides.

Algorithm
---------
``x(alpha, beta) = max(0, z)``, ``z_ij = eta_ij + alpha_i + beta_j``. For fixed
``alpha`` each column's best ``beta_j`` is a one-dimensional root, ``sum_i x_ij
= 1``, clipped at 0 for an inequality column (Newton's method on the
piecewise-linear column sum, from its previous value). Eliminating ``beta``
leaves a convex dual in ``alpha`` alone (k unknowns rather than k + K), ``psi =
||x||^2 / 2 - sum alpha - sum beta``, with gradient ``g = row sums - 1`` and
generalised Hessian the Schur complement

    H = diag(|P_i|) - sum_{active j} p_j p_j^T / |P_j|,

``P`` the positive coordinates (the piece), ``p_j`` the indicator of column j's,
an active column one with ``beta_j < 0`` (every column when square). ``H`` is
positive semidefinite; its null space is spanned by the indicators of the
*closed* components (rows linked through active columns, none of them with a
coordinate in an inactive column), and fixing one row of each closed component
makes it definite.

Each iteration is one of:

- if a closed component has as many rows as columns, as it must at the optimum,
  the semismooth Newton step on the current piece, with those rows pinned. On a
  piece ``x`` is affine in ``alpha``, so when the piece is the optimal one the
  step lands on the optimum exactly: the KKT conditions (row sums 1, active
  columns' sums 1, ``x >= 0`` on ``P``, ``z <= 0`` off ``P``, ``beta <= 0``,
  inactive columns' sums at most 1) are checked at it, after up to two steps of
  iterative refinement with the same factor, and the solve ends there. Otherwise
  the step is taken if it decreases ``psi`` enough (Armijo), else the
  regularised step ``(H + mu I) d = -g``, ``mu = min(1, |g|) / 10``, with a
  backtracking Armijo line search (Li, Sun and Toh, Math. Program. 2020), and an
  exact block step in ``alpha`` (each row's own threshold) if that fails;
- otherwise ``psi`` decreases linearly along the closed components' null
  directions (raising the multipliers of a component with more rows than
  columns, lowering those of one with fewer, the columns' following), with ``x``
  unchanged, up to the first coordinate that turns positive or multiplier that
  reaches 0: a ratio test, and an exact step to it, as in the Hungarian method's
  dual updates. Newton's direction would have no component there.

Pieces are read with a round-off margin: a coordinate is in the piece when
``z > -tol`` and a column active when ``beta < -tol``, ``tol = 64 eps (k + K)
(1 + spread of the scores + max |alpha| + max |beta|)``; the KKT residuals must
be within ``tol`` and within ``1e-9`` (u is then that close to the projection).
The solver declines (``FACET_DECLINED``) when the budget is spent, when the
scores hold nan or ``+inf``, when ``-inf`` masks leave no matching (MAP is asked
once, when the scores hold ``-inf``), when the residuals miss that bar, and at
once when a row's spread of scores exceeds ``1e-9 / eps`` (about ``4.5e6``):
``z`` no longer resolves ``u`` to ``1e-9`` there, and such peaked scores are the
vertex side's.

*Peaked scores.* With ``decline_peaked`` (the default choice of side) the
solver first counts, in one read of the scores and without allocating, the rows
of the shorter side whose sparsemax has a single nonzero (the best allowed
entry beats the second by at least 1), leaving out rows with a single allowed
entry, and declines at once when they are at least ``PEAKED_A + PEAKED_B k``
of the ``k`` rows (the forced left out): there the vertex side (a few
matchings) is faster. The constants are fitted to the measured crossover
(``benchmarks/bench_facet.py --fit matching``: ``sm.solve`` + ``vjp`` on each
side, square and ``k x 5k/3`` matchings, k = 10 to 60, ``eta = scale * randn``
with scale 0.01 to 10): scale 1-5 at k = 10-20, about 10 from k = 30 on.

Scores are shifted per row by their maximum first (absorbed exactly by
``alpha``), so that only their spread enters round-off. ``-inf`` entries have
``z = -inf``: they are fixed at 0 and never enter a piece.

Costs: per iteration, one ``k x k`` Cholesky factorisation (LAPACK ``dpotf2``;
two when the Newton step fails its test), forming ``H`` in ``k^2 + sum_active
min(|P_j|, k - |P_j|)^2`` and an ``O(k K)`` evaluation of the dual per trial point.

Backward pass
-------------
The Jacobian of ``u`` (symmetric: jvp and vjp are the same map) is the
orthogonal projection, within the positive coordinates ``P = {x > tol}``, onto
the null space of every constraint tight at ``u``, restricted to ``P``: every
row, and every column whose sum is 1 within ``tol``, its multiplier zero or
not; 0 outside ``P``. That is the derivative wherever ``u`` is differentiable,
and at a kink the Jacobian of the piece of the smallest face holding ``u``, an
element of the generalised Jacobian (docs/solvers.rst, "Derivatives at ties
and kinks"). A column at sum 1 with a zero multiplier must be held: it can
stay at 1 on both sides of the point, as in ``MatchingFactor(3, 2)`` at
``[[0, 0], [0, 0], [-1, -1]]``. Tight rows and columns may be linearly
dependent (a closed component's rows and columns have the same total); the
pinned rows of the Schur complement drop the dependence. Applying ``J`` solves
the same Schur-complement system with the stored factor: ``O(|P| + k^2)``.
"""
import numpy as np

from libc.math cimport INFINITY, fabs, sqrt
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset
from scipy.linalg.cython_lapack cimport dpotf2, dpotrs

from sparsemap._active_set cimport _dot, _maxabs
from sparsemap._facet cimport (FACET_DECLINED, FACET_SOLVED, FacetSolver, FacetState,
                               state_check_header, state_check_sizes, state_clear,
                               state_resize, top2)
from sparsemap._factors._base cimport HAS_BAD, HAS_NEGINF, _scan

from sparsemap._factors._matching import MatchingFactor

cdef double EPS = 2.220446049250313e-16
cdef double ARMIJO = 1e-4
cdef int N_REFINE = 2
cdef int N_HALVINGS = 50
# the largest residual accepted, in the units of u (in [0, 1]) and of the scores
cdef double CAP = 1e-9


# Peaked scores (see the module docstring): decline when at least
# PEAKED_A + PEAKED_B k of the k rows of the shorter side (those with a single
# allowed entry left out) have a single nonzero in their sparsemax. Fitted to the
# measured crossover with the vertex side (benchmarks/bench_facet.py --fit
# matching): 0.38 at k = 10, 0.46 at 20, 0.62 at 40, 0.78 at 60.
cdef double PEAKED_A = 0.30
cdef double PEAKED_B = 0.008


cdef Py_ssize_t _single_rows(const double* eta, Py_ssize_t k, Py_ssize_t K, Py_ssize_t rs,
                             Py_ssize_t cs, Py_ssize_t* forced) noexcept nogil:
    """The logical rows (k of them, K entries each, strides rs and cs into eta)
    whose sparsemax has a single nonzero: the best allowed entry beats the second
    by at least 1, or is the only one (those are counted also into forced[0]).
    One read of each score, no allocation."""
    cdef Py_ssize_t i, c = 0, f = 0
    cdef double b1, b2
    for i in range(k):
        b1 = -INFINITY
        b2 = -INFINITY
        top2(eta + i * rs, K, cs, &b1, &b2)
        # b1 - b2: +inf when forced, nan when every entry is forbidden (not counted)
        c += b1 - b2 >= 1.0
        f += b2 == -INFINITY and b1 > -INFINITY
    forced[0] = f
    return c


def single_row_count(eta):
    """The number of rows of the shorter side (of ``eta``'s transpose when it is
    tall) whose sparsemax has a single nonzero, and how many of them have a single
    allowed entry (tests: the peaked-score test's count).

    Parameters
    ----------
    eta : array_like, shape (n_rows, n_cols)
        Scores (``-inf``: forbidden pairs).

    Returns
    -------
    single, forced : int
    """
    cdef const double[:, ::1] e = np.ascontiguousarray(eta, dtype=np.float64)
    cdef Py_ssize_t forced = 0, c, nr = e.shape[0], nc = e.shape[1]
    if nr == 0 or nc == 0:
        raise ValueError(f"eta: expected a nonempty 2-d array, got shape {tuple(np.shape(eta))}")
    if nr > nc:
        c = _single_rows(&e[0, 0], nc, nr, 1, nc, &forced)
    else:
        c = _single_rows(&e[0, 0], nr, nc, nc, 1, &forced)
    return int(c), int(forced)


cdef struct Point:
    double* alpha    # k: the rows' multipliers
    double* beta     # K: the columns' (each column's best for alpha)
    double* Z        # k * K, column-major: z = E + alpha + beta (x = max(0, z))
    double* g        # k: row sums - 1, the dual's gradient
    double psi       # the dual objective (to minimise)


cdef struct Work:
    Py_ssize_t k, K
    bint square
    double* E        # k * K, column-major: eta shifted per row, -inf where forbidden
    Point* cur       # the iterate
    Point* trial     # a trial point
    double* d        # k: the step
    double* defect   # k: per component root, its sum of g (columns - rows)
    double* q        # K: the columns' rates in a component step; scratch
    double* H        # k * k, lower triangle (column-major)
    double* F        # its Cholesky factor (pinned or regularised)
    int* idx         # k
    int* rowcnt      # k
    int* colcnt      # K
    char* active     # K
    int* parent      # k, union-find over rows
    char* pinned     # k
    char* closed     # k: per component root, 1 closed, 2 closed and pinned
    double tol       # round-off margin of pieces and certificates


cdef inline double _threshold(const double* c, Py_ssize_t n, double warm,
                              bint clip) noexcept nogil:
    """The root b of ``sum_t max(0, c[t] + b) = 1``, by Newton's method from ``warm``;
    with ``clip``, ``min(0, root)`` (0 when the sum at 0 is at most 1). The sum is
    convex and piecewise linear in b, so from any point with a positive slope one
    Newton step lands right of the root and later steps decrease to it, stopping
    when the support no longer changes. No finite entry: returns 0."""
    cdef Py_ssize_t t, cnt, it = 0
    cdef double b, bn, s, cmax, ct
    if clip and warm >= 0:
        warm = 0.0
    b = warm
    while True:
        s = 0.0
        cnt = 0
        for t in range(n):
            ct = c[t]
            if ct + b > 0:
                s += ct
                cnt += 1
        if clip and b == 0.0 and s <= 1.0:
            return 0.0          # the column's sum at 0 is at most 1: free
        if cnt == 0:
            if it > n + 2:
                break
            cmax = -INFINITY
            for t in range(n):
                if c[t] > cmax:
                    cmax = c[t]
            if cmax == -INFINITY:
                return 0.0
            b = 1.0 - cmax
            it += 1
            continue
        bn = (1.0 - s) / cnt
        if (it > 0 and bn >= b) or it > n + 2:
            b = bn
            break
        b = bn
        it += 1
    if clip and b > 0:
        return 0.0
    return b


cdef void _evaluate(Work* w, Point* p, const double* warm) noexcept nogil:
    """Complete p from p.alpha: each column's best beta (warm started from ``warm``),
    z, g and the dual objective."""
    cdef Py_ssize_t i, j, k = w.k, K = w.K
    cdef double psi = 0.0, b, z
    cdef const double* col
    cdef const double* alpha = p.alpha
    cdef double* zc
    cdef double* g = p.g
    for i in range(k):
        g[i] = -1.0
    for j in range(K):
        col = w.E + j * k
        zc = p.Z + j * k
        for i in range(k):
            zc[i] = col[i] + alpha[i]
        b = _threshold(zc, k, warm[j], not w.square)
        p.beta[j] = b
        for i in range(k):
            z = zc[i] + b
            zc[i] = z
            if z > 0:
                g[i] += z
                psi += 0.5 * z * z
        psi -= b
    for i in range(k):
        psi -= alpha[i]
    p.psi = psi


cdef void _row_step(Work* w) noexcept nogil:
    """Exact block step: each row's alpha_i from its own threshold, beta fixed; then
    the columns' beta for the new alpha."""
    cdef Py_ssize_t i, j
    cdef Point* p = w.cur
    cdef double* c = w.trial.beta     # scratch, K entries
    for i in range(w.k):
        for j in range(w.K):
            c[j] = w.E[j * w.k + i] + p.beta[j]
        p.alpha[i] = _threshold(c, w.K, p.alpha[i], False)
    _evaluate(w, p, p.beta)


cdef void _step(Work* w, double t) noexcept nogil:
    """trial <- the point cur + t d."""
    cdef Py_ssize_t i
    for i in range(w.k):
        w.trial.alpha[i] = w.cur.alpha[i] + t * w.d[i]
    _evaluate(w, w.trial, w.cur.beta)


cdef inline void _accept(Work* w) noexcept nogil:
    cdef Point* t = w.cur
    w.cur = w.trial
    w.trial = t


cdef inline int _find(int* parent, int i) noexcept nogil:
    while parent[i] != i:
        parent[i] = parent[parent[i]]
        i = parent[i]
    return i


cdef inline bint _col_active(Work* w, double b) noexcept nogil:
    return w.square or b < -w.tol


cdef void _piece(Work* w) noexcept nogil:
    """The current point's piece: the counts, the active columns, the components
    (rows linked through active columns), the closed ones' pinned rows and each
    component's defect (its sum of g)."""
    cdef Py_ssize_t i, j, n, k = w.k, K = w.K
    cdef int r, s, first
    cdef const double* zc
    for i in range(k):
        w.rowcnt[i] = 0
        w.parent[i] = <int> i
        w.closed[i] = 1
        w.pinned[i] = 0
        w.defect[i] = 0.0
    for j in range(K):
        zc = w.cur.Z + j * k
        w.active[j] = _col_active(w, w.cur.beta[j])
        n = 0
        first = -1
        for i in range(k):
            if zc[i] > -w.tol:
                n += 1
                w.rowcnt[i] += 1
                if not w.active[j]:
                    # a row with a coordinate in a free column anchors its component
                    w.closed[i] = 0
                elif first < 0:
                    first = <int> i
                    r = _find(w.parent, first)
                else:
                    s = _find(w.parent, <int> i)
                    if s != r:
                        w.parent[s] = r
        w.colcnt[j] = <int> n
        if n == 0:
            w.active[j] = False
    for i in range(k):
        if not w.closed[i]:
            w.closed[_find(w.parent, <int> i)] = 0
    for i in range(k):
        r = _find(w.parent, <int> i)
        w.defect[r] += w.cur.g[i]
        if w.closed[r] == 1:
            w.pinned[i] = 1
            w.closed[r] = 2


cdef void _hessian(Work* w) noexcept nogil:
    """H = diag(|P_i|) - sum_{active j} p_j p_j^T / |P_j| (lower triangle) on the
    current piece (_piece first). A column with more coordinates in P than out
    contributes through its complement q_j = 1 - p_j, ``p p^T = 1 1^T - 1 q^T -
    q 1^T + q q^T``: the constant and rank-one parts gather into one O(k^2) pass,
    so each column costs min(|P_j|, k - |P_j|)^2 (flat scores: O(k^2) in all)."""
    cdef Py_ssize_t i, j, a, b, n, m, k = w.k, K = w.K
    cdef int ia
    cdef bint dense
    cdef double wj, ones = 0.0
    cdef double* H = w.H
    cdef double* v = w.q      # K >= k entries: the rank-one parts' weights
    cdef const double* zc
    memset(H, 0, k * k * sizeof(double))
    for i in range(k):
        H[i + i * k] = w.rowcnt[i]
        v[i] = 0.0
    for j in range(K):
        if not w.active[j]:
            continue
        zc = w.cur.Z + j * k
        n = w.colcnt[j]
        wj = 1.0 / n
        dense = 2 * n > k
        m = 0
        for i in range(k):
            if (zc[i] > -w.tol) != dense:
                w.idx[m] = <int> i
                m += 1
        if dense:
            ones += wj
            for a in range(m):
                v[w.idx[a]] += wj
        for a in range(m):
            ia = w.idx[a]
            for b in range(a + 1):
                H[ia + w.idx[b] * k] -= wj
    if ones != 0:
        for b in range(k):
            for a in range(b, k):
                H[a + b * k] += v[a] + v[b] - ones


cdef bint _consistent(Work* w) noexcept nogil:
    """Whether every closed component has as many rows as columns: its g then sums
    to 0 and the pinned system's right-hand side is in the range of H. (Its columns
    each sum to 1, so its g sums to the integer columns - rows, up to round-off.)"""
    cdef Py_ssize_t i
    for i in range(w.k):
        if w.closed[i] == 2 and fabs(w.defect[i]) > 0.5:
            return False
    return True


cdef bint _component_step(Work* w) noexcept nogil:
    """The exact step along the unbalanced closed components' null directions, up to
    the first change of piece (see the module's notes); False if nothing stops it
    (the dual is unbounded: no matching)."""
    cdef Py_ssize_t i, j, k = w.k, K = w.K
    cdef int r
    cdef double rate, z, step = INFINITY
    cdef const double* zc
    cdef double* rr = w.d
    cdef Point* p = w.cur
    for i in range(k):
        r = _find(w.parent, <int> i)
        rr[i] = 0.0
        if w.closed[r] == 2 and fabs(w.defect[r]) > 0.5:
            # psi changes by defect * c when the component's alpha rises by c
            rr[i] = -1.0 if w.defect[r] > 0 else 1.0
    for j in range(K):
        zc = p.Z + j * k
        w.q[j] = 0.0
        if w.active[j]:
            for i in range(k):
                if zc[i] > -w.tol:
                    w.q[j] = -rr[i]
                    break
        if not w.square and w.q[j] > 0 and -p.beta[j] / w.q[j] < step:
            step = -p.beta[j] / w.q[j]
        for i in range(k):
            z = zc[i]
            rate = rr[i] + w.q[j]
            if rate > 0 and z <= -w.tol and z != -INFINITY and -z / rate < step:
                step = -z / rate
    if step == INFINITY:
        return False
    for i in range(k):
        w.trial.alpha[i] = p.alpha[i] + step * rr[i]
    _evaluate(w, w.trial, p.beta)
    _accept(w)
    return True


cdef int _factor(Work* w, double mu, bint pin) noexcept nogil:
    """F = chol(H + mu I), with the pinned rows and columns replaced by the identity
    when ``pin``. Returns LAPACK's info (0: success)."""
    cdef Py_ssize_t i, j, k = w.k
    cdef int n = <int> k, info = 0
    memcpy(w.F, w.H, k * k * sizeof(double))
    for i in range(k):
        w.F[i + i * k] += mu
    if pin:
        for i in range(k):
            if w.pinned[i]:
                for j in range(i):
                    w.F[i + j * k] = 0.0
                for j in range(i + 1, k):
                    w.F[j + i * k] = 0.0
                w.F[i + i * k] = 1.0
    # unblocked: OpenBLAS's blocked dpotrf spawns threads from k ~ 128 (12x the CPU
    # time on a shared 2-core machine at k = 200, and batches already run in threads)
    dpotf2(b"L", &n, w.F, &n, &info)
    return info


cdef void _solve_with(Work* w, double* d, bint pin) noexcept nogil:
    """d <- F^{-1} d (pinned entries zeroed first when ``pin``)."""
    cdef Py_ssize_t i
    cdef int n = <int> w.k, one = 1, info = 0
    if pin:
        for i in range(w.k):
            if w.pinned[i]:
                d[i] = 0.0
    dpotrs(b"L", &n, &one, w.F, &n, d, &n, &info)


cdef int _certify(Work* w, double* primal, double* dual) noexcept nogil:
    """The KKT point of the current piece at alpha = trial.alpha: trial.beta from the
    active columns' equalities, trial.g = row sums - 1 (trial.Z not written). Returns
    0 when it is optimal up to w.tol, 1 when a sign condition fails (the piece is
    wrong), 2 when only the equalities miss (refine)."""
    cdef Py_ssize_t i, j, k = w.k, K = w.K
    cdef double s, b, z, cs, sign_res = 0.0, eq_res = 0.0
    cdef const double* col
    cdef const double* zc
    cdef const double* at = w.trial.alpha
    cdef double* bt = w.trial.beta
    cdef double* gt = w.trial.g
    for i in range(k):
        gt[i] = -1.0
    for j in range(K):
        col = w.E + j * k
        zc = w.cur.Z + j * k
        b = 0.0
        if w.active[j]:
            s = 0.0
            for i in range(k):
                if zc[i] > -w.tol:
                    s += col[i] + at[i]
            b = (1.0 - s) / w.colcnt[j]
            if not w.square and b > sign_res:
                sign_res = b
        bt[j] = b
        cs = 0.0
        for i in range(k):
            z = col[i] + at[i] + b
            if zc[i] > -w.tol:
                gt[i] += z
                cs += z
                if -z > sign_res:
                    sign_res = -z
            elif z > sign_res:
                sign_res = z
        if w.active[j]:
            if fabs(cs - 1.0) > eq_res:
                eq_res = fabs(cs - 1.0)
        elif cs - 1.0 > sign_res:
            sign_res = cs - 1.0
    for i in range(k):
        if fabs(gt[i]) > eq_res:
            eq_res = fabs(gt[i])
    primal[0] = eq_res
    dual[0] = sign_res
    if sign_res > w.tol:
        return 1
    if eq_res > w.tol:
        return 2
    return 0


# -- the state -------------------------------------------------------------------------
# The backward state: this header at the start of the ints, then the pairs (i, j) of
# P, the active columns (K), the pinned rows (k); the doubles: the factor F (k k),
# then 1/|P_j| (K). _layout is the one place that knows the offsets.

cdef struct MatchingHeader:
    int k, K, rs, cs, nP

cdef struct MatchingLayout:
    Py_ssize_t pairs, active, pinned, n_ints      # into the ints
    Py_ssize_t F, invn, n_reals                   # into the doubles

cdef Py_ssize_t HEADER = sizeof(MatchingHeader) // sizeof(int)


cdef inline MatchingLayout _layout(const MatchingHeader* h) noexcept nogil:
    cdef MatchingLayout l
    l.pairs = HEADER
    l.active = l.pairs + 2 * <Py_ssize_t> h.nP
    l.pinned = l.active + h.K
    l.n_ints = l.pinned + h.k
    l.F = 0
    l.invn = l.F + <Py_ssize_t> h.k * h.k
    l.n_reals = l.invn + h.K
    return l


cdef int _view(const FacetState* st, int nr, int nc, MatchingHeader* h,
               MatchingLayout* l) except -1 nogil:
    """The header and layout of a state, checked against its sizes and against an
    nr x nc factor, so that the Jacobian indexes neither past the state nor past u
    (a state may come from a pickle)."""
    cdef Py_ssize_t p
    cdef const int* pairs
    state_check_header(st, HEADER)
    memcpy(h, st.ints, sizeof(MatchingHeader))
    if not ((h.k == nr and h.K == nc and h.rs == nc and h.cs == 1)
            or (h.k == nc and h.K == nr and h.rs == 1 and h.cs == nc)) \
            or h.nP < 0 or h.nP > <Py_ssize_t> h.k * h.K:
        with gil:
            raise ValueError("the state does not belong to this solver's factor")
    l[0] = _layout(h)
    state_check_sizes(st, l.n_ints, l.n_reals)
    pairs = st.ints + l.pairs
    for p in range(h.nP):
        if <unsigned int> pairs[2 * p] >= <unsigned int> h.k \
                or <unsigned int> pairs[2 * p + 1] >= <unsigned int> h.K:
            with gil:
                raise ValueError("the state does not belong to this solver's factor")
    return 0


cdef int _finish(Work* w, double* u, FacetState* st, Py_ssize_t rs, Py_ssize_t cs,
                 double* residuals) except -1 nogil:
    """Write u, the residuals and the backward state from the certified point
    (trial.alpha, trial.beta). The Jacobian's piece is that point's own (P = z > tol,
    active = beta < -tol); it is refactored when it differs from the piece the point
    was solved on (a kink). Residuals of inf: that factorisation failed."""
    cdef Py_ssize_t i, j, p, k = w.k, K = w.K, nP = 0
    cdef double z, b, s, tol, primal = 0.0, dual = 0.0
    cdef bint changed = False, act
    cdef const double* col
    cdef double* zc
    cdef int* pairs
    cdef int* active
    cdef int* pinned
    cdef double* invn
    cdef MatchingHeader h
    cdef MatchingLayout l
    for i in range(k):
        w.trial.g[i] = -1.0
    for j in range(K):
        col = w.E + j * k
        zc = w.cur.Z + j * k
        b = w.trial.beta[j]
        s = 0.0
        for i in range(k):
            z = col[i] + w.trial.alpha[i] + b
            if z > w.tol:
                s += z
                w.trial.g[i] += z
                nP += 1
            elif z > dual:
                dual = z
            if (z > w.tol) != (zc[i] > -w.tol):
                changed = True
            # from here on cur.Z holds the final x
            zc[i] = z if z > w.tol else 0.0
        # Every tight column is held, its multiplier zero or not: where u is
        # differentiable the Jacobian is the projection onto the null space of all
        # the tight constraints (docs/solvers.rst), and a tight column with a zero
        # multiplier dropped from it would let the Jacobian move a sum that stays 1
        # on both sides of the point.
        act = _col_active(w, b) or (s > 0.0 and fabs(s - 1.0) <= w.tol)
        if act != w.active[j]:
            changed = True
        # the sign the Jacobian's piece reads (_piece at tol 0): held or free
        w.cur.beta[j] = -1.0 if act else 0.0
        if not w.square and b > dual:
            dual = b
        if act:
            if fabs(s - 1.0) > primal:
                primal = fabs(s - 1.0)
        elif s - 1.0 > primal:
            primal = s - 1.0
    for i in range(k):
        if fabs(w.trial.g[i]) > primal:
            primal = fabs(w.trial.g[i])
    residuals[0] = primal
    residuals[1] = dual
    if changed:
        # the final piece: x > 0, active columns beta < 0 (free ones hold 0 now)
        tol = w.tol
        w.tol = 0.0
        _piece(w)
        _hessian(w)
        w.tol = tol
        if _factor(w, 0.0, True) != 0:
            residuals[0] = residuals[1] = INFINITY
            return 0
    memset(u, 0, k * K * sizeof(double))
    h.k, h.K, h.rs, h.cs, h.nP = <int> k, <int> K, <int> rs, <int> cs, <int> nP
    l = _layout(&h)
    state_resize(st, l.n_ints, l.n_reals)
    memcpy(st.ints, &h, sizeof(MatchingHeader))
    pairs = st.ints + l.pairs
    active = st.ints + l.active
    pinned = st.ints + l.pinned
    invn = st.reals + l.invn
    p = 0
    for j in range(K):
        zc = w.cur.Z + j * k
        active[j] = w.active[j]
        invn[j] = 1.0 / w.colcnt[j] if w.active[j] else 0.0
        for i in range(k):
            if zc[i] > 0:
                u[i * rs + j * cs] = zc[i]
                pairs[2 * p] = <int> i
                pairs[2 * p + 1] = <int> j
                p += 1
    for i in range(k):
        pinned[i] = w.pinned[i]
    memcpy(st.reals + l.F, w.F, k * k * sizeof(double))
    return 0


cdef class MatchingFacetSolver(FacetSolver):
    """MatchingFacetSolver(factor)

    The facet-side solver of a :class:`~sparsemap.MatchingFactor`: SparseMAP as the
    projection onto the (rectangular) Birkhoff polytope, by semismooth Newton on its
    dual, finished and certified on the optimal piece (see the module's notes).

    Parameters
    ----------
    factor : MatchingFactor
        The factor whose polytope the solver projects onto.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> from sparsemap._facet_matching import MatchingFacetSolver
    >>> f = sm.MatchingFactor(2, 2)
    >>> sol = MatchingFacetSolver(f).solve(np.array([[0.5, 0.0], [0.0, 0.0]]))
    >>> sol.status, sol.u.round(3).tolist()
    (0, [[0.625, 0.375], [0.375, 0.625]])
    """
    cdef int nr, nc

    def __init__(self, factor, decline_peaked=True):
        if not isinstance(factor, MatchingFactor):
            raise ValueError(f"factor: expected a MatchingFactor, got {type(factor).__name__}")
        super().__init__(factor, decline_peaked)
        self.nr = factor.n_rows
        self.nc = factor.n_cols

    cdef int c_solve(self, const double* eta_u, const double* eta_v, double* u, double* v,
                     FacetState* st, Py_ssize_t budget, Py_ssize_t* n_iter,
                     double* residuals) except -1 nogil:
        cdef Py_ssize_t k, K, rs, cs, i, j, it, ls, n_u = <Py_ssize_t> self.nr * self.nc
        cdef Py_ssize_t single, forced = 0
        cdef bint tall = self.nr > self.nc, ok
        cdef int flags, code, rep
        cdef double gd, t, mu, m, z, spread, tol_psi, primal = 0.0, dual = 0.0
        cdef double* dp
        cdef char* buf = NULL
        cdef int* mapped = NULL
        cdef Point pts[2]
        cdef Point* cur
        cdef Work w
        n_iter[0] = 0
        residuals[0] = residuals[1] = INFINITY
        state_clear(st)
        if tall:
            k, K, rs, cs = self.nc, self.nr, 1, self.nc
        else:
            k, K, rs, cs = self.nr, self.nc, self.nc, 1
        if self.decline_peaked:
            # peaked scores: the vertex side is cheaper (see the module docstring)
            single = _single_rows(eta_u, k, K, rs, cs, &forced)
            # (every row forced: nothing to choose, the facet side is immediate)
            if k > forced and single - forced >= (PEAKED_A + PEAKED_B * k) * (k - forced):
                return FACET_DECLINED

        flags = _scan(eta_u, n_u)
        if flags & HAS_BAD:
            return FACET_DECLINED
        if flags & HAS_NEGINF:
            # a matching must avoid the forbidden pairs (MAP finds one if any does)
            buf = <char*> malloc(self.factor.work_bytes + 16)
            mapped = <int*> malloc(self.nr * sizeof(int))
            if buf == NULL or mapped == NULL:
                free(buf)
                free(mapped)
                with gil:
                    raise MemoryError()
            try:
                code = self.factor.c_map(eta_u, NULL, mapped, buf)
            finally:
                free(buf)
                free(mapped)
            if code != 0:
                return FACET_DECLINED

        w.k = k
        w.K = K
        w.square = k == K
        # one block: doubles E (k K); two points (alpha, g: k, beta: K, Z: k K);
        # H, F (k k); d, defect (k); q (K); ints idx, rowcnt, parent (k), colcnt (K);
        # chars active (K), pinned, closed (k)
        buf = <char*> malloc((3 * k * K + 2 * k * k + 6 * k + 3 * K) * sizeof(double)
                             + (3 * k + K) * sizeof(int) + 2 * k + K)
        if buf == NULL:
            with gil:
                raise MemoryError()
        try:
            dp = <double*> buf
            w.E = dp
            dp += k * K
            for i in range(2):
                pts[i].alpha = dp
                pts[i].g = dp + k
                pts[i].beta = dp + 2 * k
                pts[i].Z = dp + 2 * k + K
                dp += 2 * k + K + k * K
            w.cur = &pts[0]
            w.trial = &pts[1]
            w.H = dp
            w.F = dp + k * k
            w.d = dp + 2 * k * k
            w.defect = w.d + k
            w.q = w.defect + k
            w.idx = <int*> (w.q + K)
            w.rowcnt = w.idx + k
            w.parent = w.rowcnt + k
            w.colcnt = w.parent + k
            w.active = <char*> (w.colcnt + K)
            w.pinned = w.active + K
            w.closed = w.pinned + k

            # E: scores shifted by their row's maximum (alpha absorbs the shift),
            # column-major in the logical orientation
            spread = 0.0
            for i in range(k):
                m = -INFINITY
                for j in range(K):
                    z = eta_u[i * rs + j * cs]
                    if z > m:
                        m = z
                for j in range(K):
                    z = eta_u[i * rs + j * cs] - m     # -inf stays -inf
                    w.E[j * k + i] = z
                    if z != -INFINITY and -z > spread:
                        spread = -z

            if spread * EPS > CAP:
                # z = eta + alpha + beta can no longer resolve u to CAP
                return FACET_DECLINED

            # start: each row's threshold with beta = 0, then the columns'
            for i in range(k):
                w.cur.alpha[i] = 0.0
            for j in range(K):
                w.cur.beta[j] = 0.0
            _row_step(&w)

            for it in range(budget):
                n_iter[0] = it + 1
                cur = w.cur
                w.tol = 64.0 * EPS * (k + K) * (
                    1.0 + spread + _maxabs(cur.alpha, k) + _maxabs(cur.beta, K))
                tol_psi = w.tol * (k + K)
                _piece(&w)
                if not _consistent(&w):
                    if not _component_step(&w):
                        return FACET_DECLINED
                    continue
                _hessian(&w)

                # Newton's step on the current piece: the optimum when the piece is
                if _factor(&w, 0.0, True) == 0:
                    for i in range(k):
                        w.d[i] = -cur.g[i]
                    _solve_with(&w, w.d, True)
                    for i in range(k):
                        w.trial.alpha[i] = cur.alpha[i] + w.d[i]
                    code = _certify(&w, &primal, &dual)
                    rep = 0
                    while code == 2 and rep < N_REFINE:
                        for i in range(k):
                            w.d[i] = -w.trial.g[i]
                        _solve_with(&w, w.d, True)
                        for i in range(k):
                            w.trial.alpha[i] += w.d[i]
                        code = _certify(&w, &primal, &dual)
                        rep += 1
                    if code == 0:
                        _finish(&w, u, st, rs, cs, residuals)
                        if max(residuals[0], residuals[1]) <= min(w.tol, CAP):
                            return FACET_SOLVED
                        state_clear(st)
                        return FACET_DECLINED
                    # not the optimum: still a step, if it decreases psi enough
                    gd = 0.0
                    for i in range(k):
                        w.d[i] = w.trial.alpha[i] - cur.alpha[i]
                        gd += cur.g[i] * w.d[i]
                    _evaluate(&w, w.trial, cur.beta)
                    if gd < 0 and w.trial.psi <= cur.psi + ARMIJO * gd:
                        _accept(&w)
                        continue

                # the regularised Newton step, with backtracking
                mu = 0.1 * min(1.0, sqrt(_dot(cur.g, cur.g, k)))
                ok = False
                if _factor(&w, mu, False) == 0:
                    for i in range(k):
                        w.d[i] = -cur.g[i]
                    _solve_with(&w, w.d, False)
                    gd = _dot(cur.g, w.d, k)
                    t = 1.0
                    for ls in range(N_HALVINGS):
                        _step(&w, t)
                        if w.trial.psi <= cur.psi + ARMIJO * t * gd + tol_psi:
                            ok = gd < 0
                            break
                        t *= 0.5
                if ok:
                    _accept(&w)
                else:
                    _row_step(&w)
            return FACET_DECLINED
        finally:
            free(buf)

    cdef int c_apply(self, const FacetState* st, const double* in_u, const double* in_v,
                     double* out_u, double* out_v, bint transpose) except -1 nogil:
        # J is symmetric: jvp and vjp are the same map (no eta_v, so in_v, out_v unused)
        cdef Py_ssize_t k, K, rs, cs, nP, p, i, j, n_u = <Py_ssize_t> self.nr * self.nc
        cdef const int* pairs
        cdef const int* active
        cdef const int* pinned
        cdef const double* F
        cdef const double* invn
        cdef double* r
        cdef double* c
        cdef double val
        cdef int n, one = 1, info = 0
        cdef MatchingHeader h
        cdef MatchingLayout l
        memset(out_u, 0, n_u * sizeof(double))
        _view(st, self.nr, self.nc, &h, &l)
        k, K, rs, cs, nP = h.k, h.K, h.rs, h.cs, h.nP
        pairs = st.ints + l.pairs
        active = st.ints + l.active
        pinned = st.ints + l.pinned
        F = st.reals + l.F
        invn = st.reals + l.invn
        r = <double*> malloc((k + K) * sizeof(double))
        if r == NULL:
            with gil:
                raise MemoryError()
        c = r + k
        memset(r, 0, (k + K) * sizeof(double))
        for p in range(nP):
            i = pairs[2 * p]
            j = pairs[2 * p + 1]
            val = in_u[i * rs + j * cs]
            r[i] += val
            if active[j]:
                c[j] += val
        # Schur complement right-hand side: r - C D^-1 c
        for p in range(nP):
            i = pairs[2 * p]
            j = pairs[2 * p + 1]
            if active[j]:
                r[i] -= c[j] * invn[j]
        for i in range(k):
            if pinned[i]:
                r[i] = 0.0
        n = <int> k
        dpotrs(b"L", &n, &one, <double*> F, &n, r, &n, &info)
        # the columns' multipliers: (c_j - sum_{i in P_j} y_i) / |P_j|
        for p in range(nP):
            i = pairs[2 * p]
            j = pairs[2 * p + 1]
            if active[j]:
                c[j] -= r[i]
        for p in range(nP):
            i = pairs[2 * p]
            j = pairs[2 * p + 1]
            val = in_u[i * rs + j * cs] - r[i]
            if active[j]:
                val -= c[j] * invn[j]
            out_u[i * rs + j * cs] = val
        free(r)
        return 0

    def decompose(self, u, v=None):
        """A convex combination of matchings equal to ``u`` (Birkhoff-von Neumann).

        Parameters
        ----------
        u : array_like, shape ``(n_rows, n_cols)``
            A point of the polytope (for instance a solve's ``u``): nonnegative, the
            shorter side's sums 1, the longer side's at most 1, up to ``1e-9``.
        v : None
            Matchings have no ``v``.

        Returns
        -------
        structures : ndarray of intc, shape (n_terms, n_rows)
            Distinct matchings in the compact form (the column of each row, -1
            where unmatched), by decreasing weight.
        weights : ndarray of float64, shape (n_terms,)
            Positive, summing to one, with ``sum_s w_s m_s = u`` up to round-off.

        Notes
        -----
        A rectangular ``u`` is first padded to a square doubly stochastic matrix
        of side ``K = max(n_rows, n_cols)``: the longer side's deficits
        ``1 - sums`` fill ``K - k`` dummy lines, in the north-west corner order
        (at most ``2K - k - 1`` nonzeros). Then, while weight remains, a perfect
        matching on the support of the remainder is chosen (the one maximising
        the product of its entries, by ``scipy.optimize.linear_sum_assignment``
        on ``-log``), its smallest entry ``w`` is its weight, and ``w`` is
        subtracted along it (that entry set to exactly 0). Each step zeroes at
        least one entry and the last step ``K``, so there are at most
        ``tau - K + 1`` terms, ``tau`` the padded matrix's nonzeros; each costs
        one assignment, ``O(K^3)``. Each permutation holds the entry it zeroed,
        which the later ones avoid, so they are linearly independent: for a
        square ``u``, at most ``dim + 1`` of them, ``dim`` the dimension of the
        smallest face holding ``u`` (a rectangular ``u`` merges permutations
        that differ on the dummy lines only). Entries below ``1e-13`` are
        dropped as round-off and the weights are normalised at the end, so
        ``u`` is reproduced to about ``1e-13`` per entry (to the solve's own
        accuracy, ``1e-9`` per sum, when ``u`` comes from scores near the
        solver's limit of ``4.5e6``).
        """
        if v is not None and np.size(v) != 0:
            raise ValueError(f"v: matchings have no v; expected None, got an array of "
                             f"{np.size(v)} entries")
        return _bvn(self.nr, self.nc, u)



def _bvn(int nr, int nc, u):
    """Birkhoff-von Neumann decomposition (MatchingFacetSolver.decompose)."""
    from scipy.optimize import linear_sum_assignment
    a = np.array(u, dtype=np.float64)
    if a.shape != (nr, nc):
        raise ValueError(f"u: expected shape {(nr, nc)}, got {a.shape}")
    if not np.all(np.isfinite(a)) or a.min() < -1e-9:
        raise ValueError("u: expected finite, nonnegative entries")
    tall = nr > nc
    L = a.T if tall else a              # k x K, rows sum to 1
    k, K = L.shape
    rows, cols = L.sum(axis=1), L.sum(axis=0)
    if np.abs(rows - 1).max() > 1e-9 or cols.max() > 1 + 1e-9:
        raise ValueError(f"u: expected a point of the matching polytope (the "
                         f"{'columns' if tall else 'rows'} summing to 1, the "
                         f"{'rows' if tall else 'columns'} at most 1), got sums "
                         f"{L.sum(axis=1)} and {L.sum(axis=0)}")
    S = np.zeros((K, K))
    S[:k] = np.clip(L, 0.0, None)
    # the longer side's deficits fill K - k dummy rows, north-west corner order
    deficit = np.clip(1.0 - S[:k].sum(axis=0), 0.0, None)
    if k < K:
        deficit *= (K - k) / deficit.sum()
        r, room = k, 1.0
        for j in range(K):
            left = deficit[j]
            while left > 1e-15 and r < K:
                take = min(left, room)
                S[r, j] += take
                left -= take
                room -= take
                if room <= 1e-15:
                    r, room = r + 1, 1.0
    tiny = 1e-13
    S[S <= tiny] = 0.0
    out, weights = {}, {}
    remaining = 1.0
    with np.errstate(divide="ignore"):
        while remaining > tiny and S.any():
            cost = -np.log(S)
            try:
                ri, ci = linear_sum_assignment(cost)
            except ValueError:      # no perfect matching left on the support
                break
            vals = S[ri, ci]
            if not np.all(vals > 0):
                break
            p = int(np.argmin(vals))
            wgt = vals[p]
            S[ri, ci] -= wgt
            S[ri[p], ci[p]] = 0.0
            S[S <= tiny] = 0.0
            remaining -= wgt
            perm = ci[:k]
            if tall:
                s = np.full(nr, -1, dtype=np.intc)
                s[perm] = np.arange(k)
            else:
                s = perm.astype(np.intc)
            key = s.tobytes()
            out[key] = s
            weights[key] = weights.get(key, 0.0) + wgt
    # a solve's u meets each sum to 1e-9 (CAP): at large scores the shortfalls of
    # the K lines add up, and what they leave behind is round-off, not a missing term
    if remaining > max(1e-8, 2e-9 * K):
        raise ValueError("u: not a point of the matching polytope (its decomposition "
                         f"stopped with weight {remaining:.3g} left)")
    keys = sorted(weights, key=lambda key: -weights[key])
    w = np.array([weights[key] for key in keys])
    return np.array([out[key] for key in keys], dtype=np.intc).reshape(-1, nr), w / w.sum()
