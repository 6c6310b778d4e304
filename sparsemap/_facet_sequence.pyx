"""The facet side for sequences: SparseMAP on a chain's local polytope.

For a :class:`~sparsemap.SequenceFactor` the marginal polytope is the chain's
local polytope: ``u_i`` in the simplex, ``v_i >= 0`` with row sums ``u_i`` and
column sums ``u_{i+1}``. Only ``u`` is regularised, so eliminating ``v`` leaves

    min over u   1/2 |u|^2 - eta_u . u - sum_i OT_i(u_i, u_{i+1}),

``OT_i`` the best transport plan's score under the cost ``eta_v[i]``. Its dual
potentials ``f_i`` (rows) and ``g_{i+1}`` (columns) give
``u_i = sparsemax(eta_u[i] + f_i + g_i)``.

The solution is held by its *structure*: the supports ``P_i`` of the ``u_i`` and,
per transition, a spanning forest of ``P_i x P_{i+1}`` that carries ``v_i``. On a
fixed structure the potentials are linear in ``eta_v`` (one free constant, a
*gauge*, per tree of the forest), and ``u`` is the projection of
``z = eta_u + f + g`` onto ``{sum u_i = 1, and per tree: its row mass = its
column mass}``: a block-tridiagonal linear system in the simplex thresholds and
the gauges (one block per position, as large as the forest has trees). Where
every forest is a single tree the system is diagonal and ``u_i`` is sparsemax
of ``z_i``; a forest of several trees is a kink of ``OT`` where ``u`` is held.

The solver follows ``u`` along ``eta_v(t) = t eta_v`` from ``t = 0`` (where
``u_i = sparsemax(eta_u[i])`` and the forests are the optimal transport bases
for ``eta_v``, ties broken by the tie direction ``r``: a greedy basis, then
network-simplex pivots, each of which moves the flows around its cycle and re-roots
only the subtree the leaving arc cuts off) to ``t = 1``. On a fixed
structure ``u`` is affine in ``t``; the structure changes at events:

* an arc's flow reaches 0: it leaves (its tree splits in two, a balance
  constraint and a gauge more; a node left without arcs leaves its support);
* an arc of ``P_i x P_{i+1}`` outside the forest becomes tight (reduced cost
  ``f_i[a] + g_{i+1}[b] - eta_v[i, a, b]`` reaches 0): it enters, joining two
  trees (or, within a tree, by a network-simplex pivot);
* a path of nodes outside the supports becomes tight (its score at the adjusted
  scores reaches the solution's): its nodes and arcs enter. Found by a
  Viterbi-like pass over the nodes outside the supports and Newton's method on
  the piecewise-linear convex maximum of the paths' affine scores in ``t``.

That path from ``t = 0`` (the *cold* path) crosses about one structure per position
and tag where the transitions are as spread as the unary scores (a tagger at
initialisation), each piece a solve of the coupled positions. The solver first tries a
*warm* path, which starts near the end's structure instead:

* from the start's structure, rounds of a primal-dual active-set method on the
  structure at the scores themselves: per transition the arc of the most negative flow
  leaves and the (at most two) arcs of most negative reduced cost that join two trees
  enter, and the best positive path enters; until a round changes nothing or the
  changes stop decreasing. Each round is one solve of the structure, and about as many
  rounds as a transition needs changes bring it close (more changes per round
  oscillate);
* scores ``eta_hat`` at which that structure is optimal with a margin: on the supports
  ``eta_hat_u = eta_u + lam (p - u)``, ``u`` the structure's piece at ``eta`` and ``p``
  a point of it whose flows are all positive (the forward-backward marginals of the
  paths through the forests), ``lam`` the least that lifts every ``u`` and flow to a
  tenth of ``p``'s; the
  structure's potentials and gauges are then those at ``eta``, so lowering the arcs
  with negative reduced costs (``eta_hat_v``) and the nodes outside the supports
  (each node's score plus its best ways in and out) makes it optimal;
* the path from ``eta_hat`` to ``eta`` (``eta_u`` and ``eta_v`` both moving; ``u`` is
  still affine in ``t`` on a fixed structure), with the same events. Where the guess
  is the end's structure the path has one piece, since every inequality is affine in
  ``t`` and holds at both ends.

Its end is kept when it is optimal at ``eta`` (checked as for the shifted start below);
otherwise (a support emptied in the rounds, a check failed, forbidden transitions) the
cold path runs (as it does alone with ``SequenceFacetSolver(..., warm=False)``, and by
default where the transitions' spread is below a twentieth of the unary scores': the
cold path is short there, and the warm path's rounds cost more than it saves).
Measured at 20 to 100 positions x 17 tags, ``eta_u = 0.05 randn`` and a shared
``uniform(-0.1, 0.1)`` transition matrix: 28 to 145 rounds and pieces where the cold
path takes 300 to 1,900 pieces.

A degenerate start (a transport basis with a zero flow: positions whose
sparsemax marginals tie, as at ``eta_u = 0``) puts the path's first events all at
``t = 0``, where pivoting on ties can cycle. The path then runs from
``eta_u + delta rho`` instead (``rho`` a fixed pseudo-random direction, ``delta``
1e-6, then 1e-9, of the scores' largest magnitude), and its last structure is kept
if it is optimal at ``eta_u`` itself (the piece's ``u``, flows, reduced costs and
paths are recomputed and checked there); otherwise the path from ``eta_u`` runs as
before.

Where the result ties (zero flows, tight arcs or paths that neither enter nor
leave), the structure is then moved along ``eta_v + s r`` for ``s -> 0+`` (the
events at ``s = 0`` only), so that the Jacobian is the one of the piece ``u``
follows along ``(0, r)``, ``r = sparsemap.testing.tie_direction(factor)`` (one
matrix repeated at every transition, so that a shared transition matrix breaks its
ties along a shared direction).

Masks: ``-inf`` in ``eta_u`` keeps a tag out of its support for good; ``-inf`` in
``eta_v`` (a forbidden transition) keeps the arc out of every forest, which needs
the start (per-position sparsemax) to have couplings that avoid the forbidden
arcs: the first level of the start's lexicographic transport costs minimises the
mass they carry, and the solver declines where it is positive.

The solution is certified independently by the Wolfe duality gap (one Viterbi
call at the adjusted scores) and the marginalisation residuals. With
``decline_peaked`` (the default choice of side), the solver declines at once when
the transition scores are spread enough that the vertex side is measured to be
faster: the structure is then far from per-position sparsemax's, while the active
set needs few iterations. It also
declines (the caller then takes the vertex side) when the pieces estimated from
the scores' spreads, or projected from the first pieces, exceed twice its budget,
when the budget runs out, at forbidden transitions its start cannot avoid, and
whenever a check fails.
"""
import numpy as np

from libc.math cimport INFINITY, fabs, pow, sqrt
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy, memset

from sparsemap._facet cimport (FACET_DECLINED, FACET_SOLVED, FacetSolver, FacetState,
                               state_check_header, state_resize)
from sparsemap._factors._base cimport Factor


# Tolerances, relative to the scales named. Values within them of zero are ties.
cdef double TOL_X = 1e-13     # flows and u (their scale is 1)
cdef double TOL_D = 1e-13     # reduced costs and paths' scores, times max |eta|, plus
cdef double TOL_D0 = 1e-15    # (their terms in the units of u: thresholds ~ 1 / |P|)
cdef double TOL_S = 1e-11     # slopes in t, times max |direction|
cdef double GAP_TOL = 1e-12   # the certificate: Wolfe gap <= GAP_TOL * gap scale
cdef double LOOSE = 1e-9      # consistency checks (a state this far off is declined)
# Projected declines: after EARLY pieces past the start, decline when the pieces
# projected for t = 1 (at the rate so far) exceed twice the budget.
cdef Py_ssize_t EARLY = 12
# ... counting from the last piece that ended before t = START_ROUNDOFF / max |eta_v|
# (or 1e-9): the start's degenerate events, at t = 0 but for round-off, which sits at
# t ~ 1e-16 / max |eta_v| (flows of scale 1 against slopes of the scale of eta_v).
# Measured: at eta_u = 0, eta_v = 1e-9 randn (30 x 8) the start's ~700 events reach
# t ~ 1e-7, and the projection from them declined a solve that needs no more pieces.
cdef double START_ROUNDOFF = 1e-12
# ... and only from t = PROJECT_FROM: where eta_u's spread is far below eta_v's, the
# pieces crowd at small t, and a projection from there declined (eta_u = 1e-12 randn,
# eta_v = 1e-9 randn, 30 x 8: declined after 54 pieces; solved in 254).
cdef double PROJECT_FROM = 1e-2
# A degenerate start is moved to eta_u + delta rho, delta = SHIFT_FIRST times the
# scores' largest magnitude, then SHIFT_NEXT (the end's structure must be the one at
# eta_u: far enough from round-off to break the start's ties, close enough to keep it).
cdef double SHIFT_FIRST = 1e-6
cdef double SHIFT_NEXT = 1e-9
# Before anything, decline when the pieces estimated from the scores exceed twice the
# budget. Measured (n x 17 tags, n = 20, 60, 100, randn scores): the pieces grow like
# n S min(1, rho), rho = std(eta_v) / std(eta_u) (each centred per transition and per
# position): 0.03 n S at rho = 0.01, 0.07 n S at 0.1, 0.2 to 1.2 n S at 1 and above.
cdef double EST_FACTOR = 2.0
# Spread transitions (decline_peaked): decline when sv >= SPREAD_A max(su, SU_FLOOR) **
# SPREAD_B, sv and su the pooled standard deviations of eta_v (about each transition's
# mean; every k-th transition, see SPREAD_SAMPLE) and eta_u (about each position's).
# u moves from per-position sparsemax (the cold path's start) as eta_v grows against u's
# scale 1, and the structure the facet side has to find gets further from that start
# (warm or cold), while the vertex side gets cheaper as eta_u gets peaked. Fitted to the
# measured crossover with the vertex side (benchmarks/bench_facet.py --fit sequence;
# n x 17 tags, n = 20 to 80, eta_u = s randn, eta_v = rho s randn, rho = 1, 0.3, 0.1,
# s = 0.01 to 10): at su = 0.1, 1 and 5 the facet side declines from sv = 0.141, 0.159
# and 0.171 (the exponent fitted nearly 0: with the warm start the crossover is at
# about the same transition spread for any unary spread).
cdef double SPREAD_A = 0.1585
cdef double SPREAD_B = 0.05
cdef double SU_FLOOR = 0.01
# The spread of eta_v is read from about this many entries (whole transitions, evenly
# spaced): a choice of side, not an answer, and it runs before every vertex-side solve.
cdef Py_ssize_t SPREAD_SAMPLE = 2048
# The warm start (_warm): active-set rounds on the structure, each entering at most
# GUESS_ENTER arcs per transition, until a round changes nothing, GUESS_STALL rounds pass
# without fewer changes than before, or GUESS_ROUNDS; then the path from scores at which
# the structure is optimal with slack WARM_MARGIN times the scores' scale. The changes
# per round are noisy on their way down (at 20 x 17: 20, 48, 38, 39, ... 24, 20, 22,
# 19, 15, ...): a stall of 10 rounds stopped the 100 x 17 guesses early and doubled the
# pieces; 50 was as fast as none.
cdef int GUESS_ENTER = 2
cdef int GUESS_STALL = 50
cdef int GUESS_ROUNDS = 200
cdef double WARM_MARGIN = 1e-6
# ... tried where sv / su >= WARM_RHO (the spreads of the switching rule above). Measured
# (warm / cold time, 20 and 60 x 17, su = 0.05 and 1, 3 seeds): 1.1 to 1.9 at
# sv / su = 0.01 to 0.03, where the cold path takes few pieces and the warm path's
# fixed cost (its rounds and scores) dominates; 0.96 to 1.19 at 0.05; 0.8 to 0.98 at
# 0.1; at a tagger's initialisation (about 1) 0.1 to 0.3.
cdef double WARM_RHO = 0.05


cdef inline double _tol_d(double scale) noexcept nogil:
    """The tie tolerance of reduced costs and paths' scores, for scores of that scale."""
    return TOL_D * scale + TOL_D0


cdef enum:
    EV_NONE = 0
    EV_LEAVE = 1    # a forest arc's flow reaches 0
    EV_ENTER = 2    # an arc of P_i x P_{i+1} becomes tight
    EV_PATH = 3     # a path outside the supports becomes tight

cdef enum:
    RUN_OK = 0
    RUN_DECLINE = 1


cdef struct _Cell:
    double f, c, r
    int a, b


cdef inline bint _above(const _Cell* p, const _Cell* q) noexcept nogil:
    return p.f > q.f or (p.f == q.f and (p.c > q.c or (p.c == q.c and p.r > q.r)))


cdef void _sift(_Cell* h, int j, int size) noexcept nogil:
    """Restore the max-heap (by (c, r)) below h[j]."""
    cdef int c
    cdef _Cell x = h[j]
    while True:
        c = 2 * j + 1
        if c >= size:
            break
        if c + 1 < size and _above(&h[c + 1], &h[c]):
            c += 1
        if not _above(&h[c], &x):
            break
        h[j] = h[c]
        j = c
    h[j] = x


cdef inline bint _all_zero(const double* x, int k) noexcept nogil:
    cdef int j
    for j in range(k):
        if x[j] > 0.0:
            return False
    return True


cdef inline int _uf_find(int* uf, int x) noexcept nogil:
    while uf[x] != x:
        uf[x] = uf[uf[x]]
        x = uf[x]
    return x


cdef struct _W:
    int n, S, T, cap, L
    # the structure
    char* inP          # n*S: tag a in the support of u_i
    int* arc_a         # T*cap: rows of transition i's arcs
    int* arc_b         # T*cap: columns
    int* na            # T: arcs per transition
    char* inF          # T*S*S: arc in the forest
    int* deg_r         # T*S: arcs of transition i at row a
    int* deg_c         # T*S: at column b
    char* dirty        # T: forest changed since its tree data were built
    # tree data per transition (local nodes: rows 0..S-1, columns S..2S-1)
    int* order         # T*L: BFS order (parents first)
    int* nord          # T
    int* par           # T*L: arc to the parent, -1 at a root
    int* comp          # T*L: tree (component) index
    int* depth         # T*L
    int* ncomp         # T
    int* cR            # T*S: rows per component
    int* cC            # T*S: columns per component
    int* adj_off       # L+1 scratch
    int* adj           # 2*cap scratch
    int* cur           # L scratch
    int* rows          # 2*S scratch (the transport's rows and columns)
    int* uf            # 2*S scratch (union-find)
    _Cell* cells       # S*S scratch
    double* lcost      # 2*S*S scratch (the transport's costs with forbidden cells)
    double* pot        # L scratch
    double* pot2       # L scratch
    # root-gauged potentials of the base cost C0 and the direction D
    double* F0
    double* G0
    double* F1
    double* G1
    # the block-tridiagonal system: block i = (tau_i, gauges of transition i but its last tree)
    char* touched      # n: positions whose group is to be solved again
    double* Kd         # n*S*S: diagonal blocks, then their Cholesky factors
    double* Ks         # n*S*S: sub-diagonal blocks, then L_{i,i-1}
    double* lamA
    double* lamB
    # the piece: u = uA + t uB etc.
    double* zA
    double* zB
    double* uA
    double* uB
    double* fA
    double* fB
    double* gA
    double* gB
    double* flA
    double* flB
    # events
    double* cmax0      # T*S: per transition, the largest entry of C0 per column (0 without C0)
    double* dmax       # T*S: of D
    double* e1t        # T: earliest time an arc's flow reaches 0 (cached)
    int* e1k           # T: its arc
    char* e1dirty      # T
    double* e2t        # T: earliest entering time of an arc (cached)
    int* e2k           # T: its a*S+b
    char* e2dirty      # T
    double* alpha      # n*S: best path scores into nodes outside the supports
    int* back          # n*S
    int* seg           # n: the tags of a path event
    int seg_i0, seg_i1, seg_start, seg_end
    # the certificate
    double* adjs       # n*S
    int* tags          # n
    char* work         # the factor's MAP scratch
    # scales
    double tol_d, stol_x, stol_d
    # pieces that end before t_start are the start's: its degenerate events, at t = 0 up
    # to round-off (a flow's round-off over its slope, which scales with eta_v)
    double t_start
    # eta_u's slope in t (NULL: eta_u is constant), for paths that move both scores
    const double* eub


cdef inline double _eu(const _W* w, const double* eta_u, Py_ssize_t q, double t) noexcept nogil:
    """eta_u at t, on a path that moves it (w.eub) or not."""
    if w.eub != NULL:
        return eta_u[q] + t * w.eub[q]
    return eta_u[q]


cdef inline double _cost(const double* C0, const double* D, Py_ssize_t k, double t) noexcept nogil:
    if C0 != NULL:
        return C0[k] + t * D[k]
    return t * D[k]


cdef int _alloc(_W* w, int n, int S, Py_ssize_t work_bytes) except -1 nogil:
    """One malloc'ed block carved into the workspace's arrays."""
    cdef int T = n - 1 if n > 1 else 0
    cdef int cap = 2 * S, L = 2 * S
    cdef Py_ssize_t nS = n * S, TS = T * S, TSS = T * S * S, nSS = n * S * S
    cdef Py_ssize_t nd = 0, ni = 0, nc = 0
    w.n = n
    w.S = S
    w.T = T
    w.cap = cap
    w.L = L
    w.eub = NULL
    # doubles
    nd = (2 * L + 4 * nS + 2 * nSS + 2 * nS + 10 * nS + 2 * T * cap + 2 * T + 2 * TS + nS + nS + 2 * S * S)
    # ints
    ni = (2 * T * cap + T + 2 * TS + 5 * T * L + 2 * T + 2 * TS + (L + 1) + 2 * cap + L
          + 2 * n + T + 2 * nS + 2 * n + n + 4 * S)
    nc = nS + TSS + 3 * T + n
    cdef size_t n_cells = S * S * sizeof(_Cell)
    cdef size_t size = n_cells + nd * sizeof(double) + ni * sizeof(int) + nc + work_bytes + 64
    cdef char* block = <char*> malloc(size)
    if block == NULL:
        with gil:
            raise MemoryError()
    memset(block, 0, size)
    w.cells = <_Cell*> block
    cdef double* d = <double*> (block + n_cells)
    w.pot = d; d += L
    w.pot2 = d; d += L
    w.F0 = d; d += nS
    w.G0 = d; d += nS
    w.F1 = d; d += nS
    w.G1 = d; d += nS
    w.Kd = d; d += nSS
    w.Ks = d; d += nSS
    w.lamA = d; d += nS
    w.lamB = d; d += nS
    w.zA = d; d += nS
    w.zB = d; d += nS
    w.uA = d; d += nS
    w.uB = d; d += nS
    w.fA = d; d += nS
    w.fB = d; d += nS
    w.gA = d; d += nS
    w.gB = d; d += nS
    w.alpha = d; d += nS
    w.lcost = d; d += 2 * S * S
    w.adjs = d; d += nS
    w.flA = d; d += T * cap
    w.flB = d; d += T * cap
    w.e2t = d; d += T
    w.e1t = d; d += T
    w.cmax0 = d; d += T * S
    w.dmax = d; d += T * S
    d += 2 * nS
    cdef int* p = <int*> d
    w.arc_a = p; p += T * cap
    w.arc_b = p; p += T * cap
    w.na = p; p += T
    w.deg_r = p; p += TS
    w.deg_c = p; p += TS
    w.order = p; p += T * L
    w.par = p; p += T * L
    w.comp = p; p += T * L
    w.depth = p; p += T * L
    p += T * L
    w.nord = p; p += T
    w.ncomp = p; p += T
    w.cR = p; p += TS
    w.cC = p; p += TS
    w.adj_off = p; p += L + 1
    w.adj = p; p += 2 * cap
    w.cur = p; p += L
    w.rows = p; p += 2 * S
    w.uf = p; p += 2 * S
    w.e1k = p; p += T
    p += n
    w.e2k = p; p += T
    w.back = p; p += 2 * nS
    w.seg = p; p += 2 * n
    w.tags = p; p += n
    cdef char* c = <char*> p
    w.inP = c; c += nS
    w.inF = c; c += TSS
    w.dirty = c; c += T
    w.e2dirty = c; c += T
    w.e1dirty = c; c += T
    w.touched = c; c += n
    # 16-byte aligned scratch for c_map
    w.work = <char*> ((<size_t> c + 15) & ~(<size_t> 15))
    return 0


cdef inline void _free(_W* w) noexcept nogil:
    free(w.cells)    # the block's start
    w.cells = NULL


# -- the structure ---------------------------------------------------------------------

cdef inline void _add_arc(_W* w, int i, int a, int b) noexcept nogil:
    cdef int k = w.na[i]
    w.arc_a[i * w.cap + k] = a
    w.arc_b[i * w.cap + k] = b
    w.na[i] = k + 1
    w.inF[(i * w.S + a) * w.S + b] = 1
    w.deg_r[i * w.S + a] += 1
    w.deg_c[i * w.S + b] += 1
    w.dirty[i] = 1


cdef inline void _del_arc(_W* w, int i, int k) noexcept nogil:
    cdef int a = w.arc_a[i * w.cap + k], b = w.arc_b[i * w.cap + k]
    cdef int last = w.na[i] - 1
    w.arc_a[i * w.cap + k] = w.arc_a[i * w.cap + last]
    w.arc_b[i * w.cap + k] = w.arc_b[i * w.cap + last]
    w.na[i] = last
    w.inF[(i * w.S + a) * w.S + b] = 0
    w.deg_r[i * w.S + a] -= 1
    w.deg_c[i * w.S + b] -= 1
    w.dirty[i] = 1


cdef int _cascade(_W* w, int p0, int x0, int* stack) noexcept nogil:
    """Remove from the supports every node left without arcs on a side (with its
    other arcs), starting from node (p0, x0). Returns 1 if a support empties."""
    cdef int top = 0, p, x, k, y, S = w.S, n = w.n
    cdef bint ok
    stack[0] = p0 * S + x0
    top = 1
    while top > 0:
        top -= 1
        p = stack[top] // S
        x = stack[top] % S
        if not w.inP[p * S + x]:
            continue
        ok = (p == 0 or w.deg_c[(p - 1) * S + x] > 0) and (p == n - 1 or w.deg_r[p * S + x] > 0)
        if ok:
            continue
        w.inP[p * S + x] = 0
        if p > 0:
            k = 0
            while k < w.na[p - 1]:
                if w.arc_b[(p - 1) * w.cap + k] == x:
                    y = w.arc_a[(p - 1) * w.cap + k]
                    _del_arc(w, p - 1, k)
                    stack[top] = (p - 1) * S + y
                    top += 1
                else:
                    k += 1
        if p < n - 1:
            k = 0
            while k < w.na[p]:
                if w.arc_a[p * w.cap + k] == x:
                    y = w.arc_b[p * w.cap + k]
                    _del_arc(w, p, k)
                    stack[top] = (p + 1) * S + y
                    top += 1
                else:
                    k += 1
    for p in range(n):
        ok = False
        for x in range(S):
            if w.inP[p * S + x]:
                ok = True
                break
        if not ok:
            return 1
    return 0


cdef int _bfs(_W* w, int i) noexcept nogil:
    """Tree data of transition i from its arcs: 0, or 1 when a node of the supports has
    no arc there or the arcs hold a cycle."""
    cdef int S = w.S, L = w.L, cap = w.cap
    cdef int* cp = w.comp + i * L
    cdef int* pr = w.par + i * L
    cdef int* dp = w.depth + i * L
    cdef int* od = w.order + i * L
    cdef int k, a, b, x, y, e, j, head, nord = 0, nc = 0
    memset(w.adj_off, 0, (L + 1) * sizeof(int))
    for k in range(w.na[i]):
        w.adj_off[w.arc_a[i * cap + k] + 1] += 1
        w.adj_off[S + w.arc_b[i * cap + k] + 1] += 1
    for x in range(L):
        w.adj_off[x + 1] += w.adj_off[x]
        w.cur[x] = w.adj_off[x]
        cp[x] = -1
    for k in range(w.na[i]):
        a = w.arc_a[i * cap + k]
        b = S + w.arc_b[i * cap + k]
        w.adj[w.cur[a]] = k
        w.cur[a] += 1
        w.adj[w.cur[b]] = k
        w.cur[b] += 1
    for a in range(S):
        if not w.inP[i * S + a] or cp[a] >= 0:
            continue
        if w.adj_off[a + 1] == w.adj_off[a]:
            return 1
        w.cR[i * S + nc] = 0
        w.cC[i * S + nc] = 0
        cp[a] = nc
        pr[a] = -1
        dp[a] = 0
        od[nord] = a
        head = nord
        nord += 1
        while head < nord:
            x = od[head]
            head += 1
            if x < S:
                w.cR[i * S + nc] += 1
            else:
                w.cC[i * S + nc] += 1
            for j in range(w.adj_off[x], w.adj_off[x + 1]):
                e = w.adj[j]
                if e == pr[x]:
                    continue
                y = (S + w.arc_b[i * cap + e]) if x < S else w.arc_a[i * cap + e]
                if cp[y] >= 0:
                    return 1
                cp[y] = nc
                pr[y] = e
                dp[y] = dp[x] + 1
                od[nord] = y
                nord += 1
        nc += 1
    for b in range(S):
        if w.inP[(i + 1) * S + b] and cp[S + b] < 0:
            return 1
    # node x is row x (position i) or column x - S (position i + 1): inP at i S + x
    for x in range(L):
        if cp[x] >= 0 and not w.inP[i * S + x]:
            return 1
    w.nord[i] = nord
    w.ncomp[i] = nc
    return 0


cdef void _pots(_W* w, int i, const double* X, double* F, double* G) noexcept nogil:
    """Root-gauged potentials of cost X (S x S, NULL: zeros) on transition i's forest:
    F at its rows (position i), G at its columns (position i + 1)."""
    cdef int S = w.S, L = w.L, j, x, e, y
    cdef const int* od = w.order + i * L
    cdef const int* pr = w.par + i * L
    cdef double p
    for j in range(w.nord[i]):
        x = od[j]
        e = pr[x]
        if e < 0:
            p = 0.0
        else:
            y = (S + w.arc_b[i * w.cap + e]) if x < S else w.arc_a[i * w.cap + e]
            p = (X[w.arc_a[i * w.cap + e] * S + w.arc_b[i * w.cap + e]] if X != NULL else 0.0) - w.pot[y]
        w.pot[x] = p
        if x < S:
            F[i * S + x] = p
        else:
            G[(i + 1) * S + x - S] = p


cdef void _flows(_W* w, int i, const double* u, double* fl) noexcept nogil:
    """Flows on transition i's forest with row sums u_i and column sums u_{i+1}."""
    cdef int S = w.S, L = w.L, j, x, e, y
    cdef const int* od = w.order + i * L
    cdef const int* pr = w.par + i * L
    cdef double* s = w.pot2
    for j in range(w.nord[i]):
        x = od[j]
        s[x] = u[i * S + x] if x < S else -u[(i + 1) * S + x - S]
    for j in range(w.nord[i] - 1, -1, -1):
        x = od[j]
        e = pr[x]
        if e < 0:
            continue
        fl[i * w.cap + e] = s[x] if x < S else -s[x]
        y = (S + w.arc_b[i * w.cap + e]) if x < S else w.arc_a[i * w.cap + e]
        s[y] += s[x]


# -- the linear system -----------------------------------------------------------------
# Unknowns of position i (block i, at lam[i S ...]): the threshold tau_i, then the
# gauges of transition i's trees but the last (fixed at 0). B^T B is block tridiagonal;
# a transition of one tree couples nothing, so the chain splits into independent
# groups of positions joined by transitions of several trees.

cdef inline int _m(_W* w, int i) noexcept nogil:
    """Unknowns of block i."""
    return w.ncomp[i] if i < w.T else 1


# The blocks are as small as a transition's forest has trees (a few to 2 S): inline
# loops, column-major as LAPACK's, instead of BLAS and LAPACK calls whose per-call cost
# (OpenBLAS takes a lock in each) dominated the pieces.

cdef int _chol(double* A, int m) noexcept nogil:
    """A's lower Cholesky factor in place (column-major, lower part read): 0, or 1 if
    A is not definite."""
    cdef int j, k, r
    cdef double d
    for j in range(m):
        d = A[j + j * m]
        for k in range(j):
            d -= A[j + k * m] * A[j + k * m]
        if not d > 0.0:
            return 1
        d = sqrt(d)
        A[j + j * m] = d
        for r in range(j + 1, m):
            for k in range(j):
                A[r + j * m] -= A[r + k * m] * A[j + k * m]
            A[r + j * m] /= d
    return 0


cdef void _lower_solve(const double* Lf, int m, double* x, int inc, bint transpose) noexcept nogil:
    """x <- L^{-1} x (or L^{-T} x), L lower triangular m x m column-major; x strided."""
    cdef int j, k
    cdef double d
    if not transpose:
        for j in range(m):
            d = x[j * inc]
            for k in range(j):
                d -= Lf[j + k * m] * x[k * inc]
            x[j * inc] = d / Lf[j + j * m]
    else:
        for j in range(m - 1, -1, -1):
            d = x[j * inc]
            for k in range(j + 1, m):
                d -= Lf[k + j * m] * x[k * inc]
            x[j * inc] = d / Lf[j + j * m]


cdef int _factor_range(_W* w, int lo, int hi) noexcept nogil:
    """Assemble and factorise the blocks lo..hi of B^T B (a group: no coupling to
    lo - 1 or hi + 1). 0, or 1 if not definite."""
    cdef int S = w.S, T = w.T, L = w.L, i, k, m, mp, a, kr, kc, r, c
    cdef int SS = S * S
    cdef double* A
    cdef double* Bk
    cdef double d
    for i in range(lo, hi + 1):
        m = _m(w, i)
        A = w.Kd + i * SS
        memset(A, 0, m * m * sizeof(double))
        for a in range(S):
            if w.inP[i * S + a]:
                A[0] += 1.0
        for k in range(m - 1):
            A[(1 + k) * m] = -w.cR[i * S + k]
            A[1 + k] = -w.cR[i * S + k]
            A[(1 + k) * (m + 1)] = w.cR[i * S + k] + w.cC[i * S + k]
        if i > lo:
            mp = _m(w, i - 1)
            Bk = w.Ks + i * SS
            memset(Bk, 0, m * mp * sizeof(double))
            for k in range(mp - 1):
                Bk[(1 + k) * m] = w.cC[(i - 1) * S + k]
            if m > 1 and mp > 1:
                for a in range(S):
                    if w.inP[i * S + a]:
                        kr = w.comp[i * L + a]
                        kc = w.comp[(i - 1) * L + S + a]
                        if kr < m - 1 and kc < mp - 1:
                            Bk[(1 + kr) + (1 + kc) * m] -= 1.0
            if m > 1 or mp > 1:
                # L_{i,i-1} = B_{i,i-1} L_{i-1}^{-T} (row by row); the Schur complement
                for r in range(m):
                    _lower_solve(w.Kd + (i - 1) * SS, mp, Bk + r, m, False)
                for c in range(m):
                    for r in range(c, m):
                        d = 0.0
                        for k in range(mp):
                            d += Bk[r + k * m] * Bk[c + k * m]
                        A[r + c * m] -= d
        if _chol(A, m):
            return 1
    return 0


cdef void _solve_range(_W* w, double* x, int lo, int hi) noexcept nogil:
    """x <- (B^T B)^{-1} x on the blocks lo..hi, with the factor of _factor_range."""
    cdef int S = w.S, SS = w.S * w.S, i, m, mp, r, c
    cdef double* xi
    cdef const double* K
    cdef double d
    for i in range(lo, hi + 1):
        m = _m(w, i)
        xi = x + i * S
        if i > lo:
            mp = _m(w, i - 1)
            if m > 1 or mp > 1:
                K = w.Ks + i * SS
                for c in range(mp):
                    d = x[(i - 1) * S + c]
                    for r in range(m):
                        xi[r] -= K[r + c * m] * d
        _lower_solve(w.Kd + i * SS, m, xi, 1, False)
    for i in range(hi, lo - 1, -1):
        m = _m(w, i)
        xi = x + i * S
        if i < hi:
            mp = _m(w, i + 1)
            if m > 1 or mp > 1:
                K = w.Ks + (i + 1) * SS
                for c in range(m):
                    d = 0.0
                    for r in range(mp):
                        d += K[r + c * mp] * x[(i + 1) * S + r]
                    xi[c] -= d
        _lower_solve(w.Kd + i * SS, m, xi, 1, True)


cdef inline double _gauge(_W* w, const double* lam, int i, int k) noexcept nogil:
    return lam[i * w.S + 1 + k] if k < w.ncomp[i] - 1 else 0.0


cdef void _project_range(_W* w, const double* z, double b0, double* lam, double* out,
                         int lo, int hi) noexcept nogil:
    """out = z + B lam on the supports of positions lo..hi (0 elsewhere there), with
    B^T out = (b0 per position, 0 per balance): the projection of z onto the
    structure's affine set (b0 = -1) or onto its linear part (b0 = 0). lo..hi is a
    group (or the whole chain)."""
    cdef int S = w.S, T = w.T, L = w.L, i, a, k
    for i in range(lo, hi + 1):
        memset(lam + i * S, 0, _m(w, i) * sizeof(double))
        lam[i * S] = b0
    for i in range(lo, hi + 1):
        for a in range(S):
            if w.inP[i * S + a]:
                lam[i * S] += z[i * S + a]
                if i < T:
                    k = w.comp[i * L + a]
                    if k < w.ncomp[i] - 1:
                        lam[i * S + 1 + k] -= z[i * S + a]
                if i > 0:
                    k = w.comp[(i - 1) * L + S + a]
                    if k < w.ncomp[i - 1] - 1:
                        lam[(i - 1) * S + 1 + k] += z[i * S + a]
    _solve_range(w, lam, lo, hi)
    for i in range(lo, hi + 1):
        for a in range(S):
            if w.inP[i * S + a]:
                out[i * S + a] = z[i * S + a] - lam[i * S]
                if i < T:
                    out[i * S + a] += _gauge(w, lam, i, w.comp[i * L + a])
                if i > 0:
                    out[i * S + a] -= _gauge(w, lam, i - 1, w.comp[(i - 1) * L + S + a])
            else:
                out[i * S + a] = 0.0


cdef int _update(_W* w, const double* eta_u, const double* C0, const double* D,
                 bint all_dirty, bint slopes=True) noexcept nogil:
    """Bring the piece (u, potentials with gauges, flows, all affine in t) up to date
    with the structure: the changed transitions' trees and potentials, then the groups
    of positions they touch (slopes False: the parts at t = 0 only). 0, or 1 if the
    structure is not a valid one."""
    cdef int n = w.n, S = w.S, T = w.T, L = w.L, i, a, k, p, lo, hi
    memset(w.touched, 0, n)
    for i in range(T):
        if w.dirty[i] or all_dirty:
            if _bfs(w, i):
                return 1
            _pots(w, i, C0 + i * S * S if C0 != NULL else NULL, w.F0, w.G0)
            if slopes:
                _pots(w, i, D + i * S * S, w.F1, w.G1)
            w.dirty[i] = 0
            w.e2dirty[i] = 1
            w.touched[i] = 1
            w.touched[i + 1] = 1
    if T == 0 and all_dirty:
        w.touched[0] = 1
    p = 0
    while p < n:
        if not w.touched[p]:
            p += 1
            continue
        lo = p
        while lo > 0 and w.ncomp[lo - 1] > 1:
            lo -= 1
        hi = p
        while hi < T and w.ncomp[hi] > 1:
            hi += 1
        for i in range(lo, hi + 1):
            for a in range(S):
                k = i * S + a
                if w.inP[k]:
                    w.zA[k] = eta_u[k] + (w.F0[k] if i < T else 0.0) + (w.G0[k] if i > 0 else 0.0)
                    if slopes:
                        w.zB[k] = ((w.F1[k] if i < T else 0.0) + (w.G1[k] if i > 0 else 0.0)
                                   + (w.eub[k] if w.eub != NULL else 0.0))
        if _factor_range(w, lo, hi):
            return 1
        _project_range(w, w.zA, -1.0, w.lamA, w.uA, lo, hi)
        if slopes:
            _project_range(w, w.zB, 0.0, w.lamB, w.uB, lo, hi)
        # transitions lo - 1 .. hi: flows (their marginals moved) and, inside, gauges
        for i in range(lo - 1 if lo > 0 else 0, hi + 1 if hi < T else T):
            if w.ncomp[i] > 1:
                w.e2dirty[i] = 1
            for a in range(S):
                if w.inP[i * S + a]:
                    k = w.comp[i * L + a]
                    w.fA[i * S + a] = w.F0[i * S + a] + _gauge(w, w.lamA, i, k)
                    if slopes:
                        w.fB[i * S + a] = w.F1[i * S + a] + _gauge(w, w.lamB, i, k)
                if w.inP[(i + 1) * S + a]:
                    k = w.comp[i * L + S + a]
                    w.gA[(i + 1) * S + a] = w.G0[(i + 1) * S + a] - _gauge(w, w.lamA, i, k)
                    if slopes:
                        w.gB[(i + 1) * S + a] = w.G1[(i + 1) * S + a] - _gauge(w, w.lamB, i, k)
            _flows(w, i, w.uA, w.flA)
            if slopes:
                _flows(w, i, w.uB, w.flB)
            w.e1dirty[i] = 1
        p = hi + 1
    return 0


cdef int _factor_all(_W* w) noexcept nogil:
    """The whole chain's factor (transitions of one tree couple nothing)."""
    return _factor_range(w, 0, w.n - 1)


# -- events ----------------------------------------------------------------------------

cdef int _leave_times(_W* w, int i, double t, bint zero_only) noexcept nogil:
    """The earliest time at which an arc of transition i's forest gets a zero flow
    (cached per transition; zero_only: only arcs whose flow is 0 at t). 1 if a flow is
    negative at t (an inconsistent state)."""
    cdef int k, arg = -1
    cdef double fa, fb, root, best = INFINITY
    for k in range(w.na[i]):
        fa = w.flA[i * w.cap + k]
        fb = w.flB[i * w.cap + k]
        if fa + t * fb < -LOOSE:
            return 1
        if fb < -w.stol_x:
            if zero_only and fa + t * fb > TOL_X:
                continue
            root = -fa / fb
            if root < best:
                best = root
                arg = k
    w.e1t[i] = best
    w.e1k[i] = arg
    w.e1dirty[i] = 0
    return 0


cdef void _enter_times(_W* w, int i, const double* C0, const double* D) noexcept nogil:
    """The earliest t at which an arc of P_i x P_{i+1} outside the forest gets a zero
    reduced cost (cached per transition)."""
    cdef int S = w.S, a, b
    cdef double ra, rb, root, best = INFINITY, fa, fb, stol = w.stol_d
    cdef int arg = -1
    # local pointers: the loop below is the pieces' largest cost, and reads through w
    # would be reloaded at every store
    cdef const char* pin = w.inP + (i + 1) * S
    cdef const char* fin
    cdef const double* gA = w.gA + (i + 1) * S
    cdef const double* gB = w.gB + (i + 1) * S
    cdef const double* Da
    cdef const double* Ca
    for a in range(S):
        if not w.inP[i * S + a]:
            continue
        fa = w.fA[i * S + a]
        fb = w.fB[i * S + a]
        fin = w.inF + (i * S + a) * S
        Da = D + (i * S + a) * S
        Ca = C0 + (i * S + a) * S if C0 != NULL else NULL
        for b in range(S):
            rb = fb + gB[b] - Da[b]
            if rb < -stol and pin[b] and not fin[b]:
                ra = fa + gA[b] - (Ca[b] if Ca != NULL else 0.0)
                root = -ra / rb
                if root < best:
                    best = root
                    arg = a * S + b
    w.e2t[i] = best
    w.e2k[i] = arg
    w.e2dirty[i] = 0


cdef double _path_max(_W* w, const double* eta_u, const double* C0, const double* D,
                      double t, int* end_i, int* end_x, int* end_b) noexcept nogil:
    """The best score at t of a path segment through nodes outside the supports: it
    enters from a support node (row potential subtracted) or the chain's start, and
    leaves to a support node (column potential subtracted) or the chain's end. 0 at
    the optimum; the segment's last node and exit into end_*. Entries from nodes
    outside the supports are skipped where a bound (their best score plus the
    column's largest cost) cannot beat the best entry from the support."""
    cdef int n = w.n, S = w.S, i, x, a, b, bk, eb, j
    cdef int* plist = w.back + n * S     # the supports as lists (scratch)
    cdef int* pcnt = w.seg + n
    cdef Py_ssize_t q
    cdef double best = -INFINITY, tau, ent, val, ex, c, amax_prev = -INFINITY, amax
    end_i[0] = -1
    for i in range(n):
        pcnt[i] = 0
        for x in range(S):
            if w.inP[i * S + x]:
                plist[i * S + pcnt[i]] = x
                pcnt[i] += 1
    for i in range(n):
        tau = w.lamA[i * S] + t * w.lamB[i * S]
        amax = -INFINITY
        for x in range(S):
            q = i * S + x
            w.alpha[q] = -INFINITY
            if w.inP[q] or eta_u[q] == -INFINITY:
                continue
            if i == 0:
                ent = 0.0
                bk = -1
            else:
                ent = -INFINITY
                bk = -1
                for j in range(pcnt[i - 1]):
                    a = plist[(i - 1) * S + j]
                    val = (_cost(C0, D, ((i - 1) * S + a) * S + x, t)
                           - (w.fA[(i - 1) * S + a] + t * w.fB[(i - 1) * S + a]))
                    if val > ent:
                        ent = val
                        bk = a
                if amax_prev + w.cmax0[q - S] + t * w.dmax[q - S] > ent:
                    for a in range(S):
                        if w.alpha[(i - 1) * S + a] > -INFINITY:
                            val = w.alpha[(i - 1) * S + a] + _cost(C0, D, ((i - 1) * S + a) * S + x, t)
                            if val > ent:
                                ent = val
                                bk = S + a
                if ent == -INFINITY:
                    continue
            w.alpha[q] = _eu(w, eta_u, q, t) - tau + ent
            w.back[q] = bk
            if w.alpha[q] > amax:
                amax = w.alpha[q]
            if i == n - 1:
                ex = 0.0
                eb = -1
            else:
                ex = -INFINITY
                eb = -1
                for j in range(pcnt[i + 1]):
                    b = plist[(i + 1) * S + j]
                    val = (_cost(C0, D, (i * S + x) * S + b, t)
                           - (w.gA[(i + 1) * S + b] + t * w.gB[(i + 1) * S + b]))
                    if val > ex:
                        ex = val
                        eb = b
            if w.alpha[q] + ex > best:
                best = w.alpha[q] + ex
                end_i[0] = i
                end_x[0] = x
                end_b[0] = eb
        amax_prev = amax
    return best


cdef void _path_trace(_W* w, int i1, int x1, int eb) noexcept nogil:
    """The segment ending at (i1, x1) into seg[i0..i1], seg_start, seg_end."""
    cdef int S = w.S, i = i1, x = x1, bk
    w.seg_i1 = i1
    w.seg_end = eb
    w.seg_start = -1
    while True:
        w.seg[i] = x
        bk = w.back[i * S + x]
        if bk < 0:
            break
        if bk < S:
            w.seg_start = bk
            break
        x = bk - S
        i -= 1
    w.seg_i0 = i


cdef double _path_value(_W* w, const double* eta_u, const double* C0, const double* D,
                        double t) noexcept nogil:
    """The score at t of the segment in seg (as in _path_max)."""
    cdef int S = w.S, i, i0 = w.seg_i0, i1 = w.seg_i1
    cdef double val = 0.0
    if w.seg_start >= 0:
        val += (_cost(C0, D, ((i0 - 1) * S + w.seg_start) * S + w.seg[i0], t)
                - (w.fA[(i0 - 1) * S + w.seg_start] + t * w.fB[(i0 - 1) * S + w.seg_start]))
    for i in range(i0, i1 + 1):
        val += _eu(w, eta_u, i * S + w.seg[i], t) - (w.lamA[i * S] + t * w.lamB[i * S])
        if i < i1:
            val += _cost(C0, D, (i * S + w.seg[i]) * S + w.seg[i + 1], t)
    if w.seg_end >= 0:
        val += (_cost(C0, D, (i1 * S + w.seg[i1]) * S + w.seg_end, t)
                - (w.gA[(i1 + 1) * S + w.seg_end] + t * w.gB[(i1 + 1) * S + w.seg_end]))
    return val


cdef void _add_path(_W* w) noexcept nogil:
    """The segment in seg enters: its nodes join the supports, its arcs the forests."""
    cdef int S = w.S, i
    for i in range(w.seg_i0, w.seg_i1 + 1):
        w.inP[i * S + w.seg[i]] = 1
    if w.seg_start >= 0:
        _add_arc(w, w.seg_i0 - 1, w.seg_start, w.seg[w.seg_i0])
    for i in range(w.seg_i0, w.seg_i1):
        _add_arc(w, i, w.seg[i], w.seg[i + 1])
    if w.seg_end >= 0:
        _add_arc(w, w.seg_i1, w.seg[w.seg_i1], w.seg_end)


cdef int _leaving_arc(_W* w, int i, int a, int b, double t, bint lowest_on_ties) noexcept nogil:
    """For arc (a, b) entering transition i's tree: the arc of the cycle it closes whose
    flow (flA + t flB) decreases and is least (on ties the first met on the walk, or the
    lowest index), or -1 when a and b are not connected. Both ends walk up to their
    common ancestor; the first arc from each end decreases, then they alternate."""
    cdef int cap = w.cap, x = a, y = w.S + b, e, leave = -1, sx = 0, sy = 0, parity
    cdef int* pr = w.par + i * w.L
    cdef int* dp = w.depth + i * w.L
    cdef double fl, best = INFINITY
    while x != y:
        e = _cycle_step(w, i, pr, dp, &x, &y, &sx, &sy, &parity)
        if e < 0:
            return -1
        if parity == 0:
            fl = w.flA[i * cap + e]
            if t != 0.0:
                fl += t * w.flB[i * cap + e]
            if fl < best or (lowest_on_ties and fl == best and e < leave):
                best = fl
                leave = e
    return leave


cdef inline int _cycle_step(_W* w, int i, const int* pr, const int* dp, int* x, int* y,
                            int* sx, int* sy, int* parity) noexcept nogil:
    """One step of the walk around the cycle that an arc between nodes x and y closes
    in transition i's tree (parents pr, depths dp): the deeper end moves up to its
    parent. Returns the arc crossed, with its parity along the walk in parity (0 for
    the first arc from each end, then alternating), or -1 past a root (nothing moves)."""
    cdef int* end = x
    cdef int* par = sx
    cdef int e
    if dp[x[0]] < dp[y[0]]:
        end, par = y, sy
    e = pr[end[0]]
    if e < 0:
        return -1
    parity[0] = par[0]
    par[0] ^= 1
    end[0] = _other(w, i, e, end[0])
    return e


cdef inline int _cycle_min(_W* w, int i, int a, int b) noexcept nogil:
    """The leaving arc at the current flows (lowest index on ties), or -1."""
    return _leaving_arc(w, i, a, b, 0.0, True)


cdef int _pivot(_W* w, int i, int a, int b, double t) noexcept nogil:
    """Arc (a, b) enters transition i's tree that already connects a and b: push flow
    around the cycle until an arc of it empties, and that arc leaves (a network-simplex
    pivot; u is unchanged since the cycle's cost is zero at t)."""
    cdef int leave = _leaving_arc(w, i, a, b, t, False)
    if leave < 0:
        return 1
    _del_arc(w, i, leave)
    _add_arc(w, i, a, b)
    return 0


cdef void _column_maxima(_W* w, const double* C0, const double* D) noexcept nogil:
    """cmax0 and dmax: per transition and column, the largest entry of C0 (0 without
    C0) and of D, for _path_max's bound."""
    cdef int S = w.S, i, a, b
    cdef Py_ssize_t q
    for i in range(w.T):
        for b in range(S):
            w.cmax0[i * S + b] = 0.0 if C0 == NULL else -INFINITY
            w.dmax[i * S + b] = -INFINITY
            for a in range(S):
                q = (i * S + a) * S + b
                if C0 != NULL and C0[q] > w.cmax0[i * S + b]:
                    w.cmax0[i * S + b] = C0[q]
                if D[q] > w.dmax[i * S + b]:
                    w.dmax[i * S + b] = D[q]


cdef int _follow_costs(_W* w, const double* eta_u, const double* C0, const double* D,
                       double t_end, bint zero_only, Py_ssize_t budget, Py_ssize_t* n_iter,
                       int* stack) noexcept nogil:
    """Follow u along the costs C0 + t D from t = 0 to t_end (zero_only: apply only the
    events at t = 0, the structure of the piece at 0+). RUN_OK or RUN_DECLINE."""
    cdef int n = w.n, S = w.S, T = w.T, i, k, a, b, kind, ev_i = -1, ev_k = -1, ei, ex, eb
    cdef int it_newton
    cdef double t = 0.0, ev_t, root, fa, fb, val, v0, v1, slope, th, start_val
    cdef Py_ssize_t pieces = 0, p0 = 0, q
    cdef bint first = True
    _column_maxima(w, C0, D)
    while True:
        if n_iter[0] >= budget:
            return RUN_DECLINE
        if _update(w, eta_u, C0, D, first):
            return RUN_DECLINE
        first = False
        n_iter[0] += 1
        pieces += 1
        kind = EV_NONE
        ev_t = INFINITY if zero_only else t_end
        # an arc's flow reaches 0
        for i in range(T):
            if w.e1dirty[i] and _leave_times(w, i, t, zero_only):
                return RUN_DECLINE
            if w.e1k[i] < 0:
                continue
            root = w.e1t[i] if w.e1t[i] > t else t
            if root < ev_t or (root == ev_t and kind != EV_LEAVE):
                ev_t = root
                kind = EV_LEAVE
                ev_i = i
                ev_k = w.e1k[i]
        # an arc enters
        for i in range(T):
            if w.e2dirty[i]:
                _enter_times(w, i, C0, D)
            if w.e2k[i] < 0:
                continue
            root = w.e2t[i]
            if zero_only:
                a = w.e2k[i] // S
                b = w.e2k[i] % S
                val = (w.fA[i * S + a] + w.gA[(i + 1) * S + b]
                       - (C0[(i * S + a) * S + b] if C0 != NULL else 0.0))
                if val > w.tol_d:
                    continue
            if root < t:
                root = t
            if root < ev_t:
                ev_t = root
                kind = EV_ENTER
                ev_i = i
                ev_k = w.e2k[i]
        # a path through nodes outside the supports becomes tight: Newton on the convex
        # maximum of the paths' affine scores, from the right
        th = t + 1.0 if zero_only else ev_t
        if ev_t < th:
            th = ev_t
        start_val = -INFINITY
        for it_newton in range(64):
            val = _path_max(w, eta_u, C0, D, th, &ei, &ex, &eb)
            if ei < 0 or val <= w.tol_d:
                break
            _path_trace(w, ei, ex, eb)
            v0 = _path_value(w, eta_u, C0, D, t)
            start_val = v0
            if th <= t:
                root = t
            else:
                slope = (val - v0) / (th - t)
                root = th - val / slope if slope > 0 else t
                if root < t:
                    root = t
            kind = EV_PATH
            ev_t = root
            if root >= th or root <= t:
                th = root
                break
            th = root
        if kind == EV_PATH and zero_only and start_val < -w.tol_d:
            kind = EV_NONE
        if kind == EV_NONE:
            return RUN_OK
        if t <= w.t_start:
            p0 = pieces     # pieces of the start (zero-length where it is degenerate)
        elif (not zero_only and pieces - p0 >= EARLY and ev_t >= PROJECT_FROM
                and p0 + <double> (pieces - p0) / ev_t > EST_FACTOR * budget):
            return RUN_DECLINE
        t = ev_t
        if kind == EV_LEAVE:
            a = w.arc_a[ev_i * w.cap + ev_k]
            b = w.arc_b[ev_i * w.cap + ev_k]
            _del_arc(w, ev_i, ev_k)
            if _cascade(w, ev_i, a, stack):
                return RUN_DECLINE
            if _cascade(w, ev_i + 1, b, stack):
                return RUN_DECLINE
        elif kind == EV_ENTER:
            a = ev_k // S
            b = ev_k % S
            if w.comp[ev_i * w.L + a] == w.comp[ev_i * w.L + S + b]:
                if _pivot(w, ev_i, a, b, t):
                    return RUN_DECLINE
            else:
                _add_arc(w, ev_i, a, b)
        else:
            _add_path(w)


cdef bint _slack_below(_W* w, const double* eta_u, const double* C0, const double* D,
                       double t, double flow_bar, double cost_bar, bint with_u) noexcept nogil:
    """Whether, at t, a flow of the forest is at most flow_bar (with_u: or an entry of
    u on its support), or a reduced cost outside the forest (an allowed arc), or minus
    the best path score outside the supports, is at most cost_bar. With positive bars
    (the tie tolerances) the piece's structure is ambiguous at t (_has_ties); with
    negative ones it is not optimal there (_violated)."""
    cdef int S = w.S, i, k, a, b, ei, ex, eb
    cdef Py_ssize_t q
    if with_u:
        for q in range(w.n * S):
            if w.inP[q] and w.uA[q] + t * w.uB[q] <= flow_bar:
                return True
    for i in range(w.T):
        for k in range(w.na[i]):
            if w.flA[i * w.cap + k] + t * w.flB[i * w.cap + k] <= flow_bar:
                return True
        for a in range(S):
            if not w.inP[i * S + a]:
                continue
            for b in range(S):
                q = (i * S + a) * S + b
                if w.inP[(i + 1) * S + b] and not w.inF[q] and D[q] > -INFINITY:
                    if (w.fA[i * S + a] + w.gA[(i + 1) * S + b] - (C0[q] if C0 != NULL else 0.0)
                            + t * (w.fB[i * S + a] + w.gB[(i + 1) * S + b] - D[q])) <= cost_bar:
                        return True
    return _path_max(w, eta_u, C0, D, t, &ei, &ex, &eb) >= -cost_bar


cdef inline bint _has_ties(_W* w, const double* eta_u, const double* C0, const double* D,
                           double t) noexcept nogil:
    """Whether the piece's structure at t is ambiguous: a zero flow, a tight arc outside
    the forest or a tight path outside the supports."""
    return _slack_below(w, eta_u, C0, D, t, TOL_X, w.tol_d, False)


# -- the start: sparsemax per position, optimal transport per transition ----------------

cdef int _sparsemax(const double* z, int S, double* u, char* inP, double* tmp) noexcept nogil:
    """u = sparsemax(z) (entries -inf excluded) by sorting; 1 if every entry is -inf."""
    cdef int a, j, m = 0, k
    cdef double x, cs = 0.0, tau = 0.0
    for a in range(S):
        if z[a] > -INFINITY:
            # insertion sort, descending (S is small)
            x = z[a]
            j = m
            while j > 0 and tmp[j - 1] < x:
                tmp[j] = tmp[j - 1]
                j -= 1
            tmp[j] = x
            m += 1
    if m == 0:
        return 1
    k = 0
    for j in range(m):
        cs += tmp[j]
        if 1.0 + (j + 1) * tmp[j] > cs:
            k = j + 1
            tau = (cs - 1.0) / (j + 1)
    for a in range(S):
        if z[a] > -INFINITY and z[a] - tau > 0.0:
            u[a] = z[a] - tau
            inP[a] = 1
        else:
            u[a] = 0.0
            inP[a] = 0
    return 0


cdef bint _any_forbidden(const double* x, Py_ssize_t k) noexcept nogil:
    """Whether one of x's k entries is -inf (a forbidden transition)."""
    cdef Py_ssize_t j
    for j in range(k):
        if x[j] == -INFINITY:
            return True
    return False


cdef inline bint _same(const double* x, const double* y, int k) noexcept nogil:
    return memcmp(x, y, k * sizeof(double)) == 0


cdef int _start(_W* w, const double* eta_u, const double* eta_v, const double* r,
                double scale_v) noexcept nogil:
    """The path's start into a fresh workspace: u_i = sparsemax(eta_u[i]), the optimal
    transport bases for eta_v (ties broken by r). 0, or 1 (the solver declines)."""
    cdef int i, SS = w.S * w.S, status = 0
    cdef int* order = NULL
    cdef int* tr = NULL
    cdef bint valid = False
    for i in range(w.n):
        if _sparsemax(eta_u + i * w.S, w.S, w.uA + i * w.S, w.inP + i * w.S, w.pot):
            return 1      # no allowed tag at a position
    # transitions that share their costs (a shared transition matrix, and the tie
    # direction, which is one matrix repeated) share the greedy start's order of cells
    for i in range(w.T):
        if valid and not (_same(eta_v + i * SS, eta_v + (i - 1) * SS, SS)
                          and _same(r + i * SS, r + (i - 1) * SS, SS)):
            valid = False
        if (not valid and i + 1 < w.T and _same(eta_v + i * SS, eta_v + (i + 1) * SS, SS)
                and _same(r + i * SS, r + (i + 1) * SS, SS)
                and not _any_forbidden(eta_v + i * SS, SS)):
            if order == NULL:
                order = <int*> malloc(SS * sizeof(int))
            if order != NULL:
                _sort_cells(w, eta_v + i * SS, r + i * SS, order)
                valid = True
        if tr == NULL:
            tr = <int*> malloc(7 * w.L * sizeof(int))
            if tr == NULL:
                status = 1
                break
        if _transport(w, i, w.uA, eta_v, r, 1e-12 * scale_v, tr, order if valid else NULL):
            status = 1
            break
    free(order)
    free(tr)
    return status


cdef bint _degenerate(_W* w) noexcept nogil:
    """Whether a start's transport bases hold an arc of zero flow (flows as _transport
    leaves them)."""
    cdef int i, k
    for i in range(w.T):
        for k in range(w.na[i]):
            if w.flA[i * w.cap + k] <= TOL_X:
                return True
    return False


cdef bint _phase1(_W* w, const double* eta_u, const double* eta_v, double scale_v,
                  Py_ssize_t budget, Py_ssize_t* n_iter, int* stack) noexcept nogil:
    """Follow u along t eta_v from the start to t = 1: True when it got there."""
    w.stol_x = TOL_S * scale_v
    w.stol_d = TOL_S * scale_v
    w.t_start = max(1e-9, START_ROUNDOFF / scale_v)
    return _follow_costs(w, eta_u, NULL, eta_v, 1.0, False, budget, n_iter, stack) == RUN_OK


cdef inline bint _violated(_W* w, const double* eta_u, const double* C0, const double* D,
                           double t) noexcept nogil:
    """Whether the piece's structure is not optimal at t (beyond the tie tolerances): a
    negative u or flow, an arc outside the forest with a negative reduced cost, or a
    path outside the supports with a positive score."""
    return _slack_below(w, eta_u, C0, D, t, -TOL_X, -w.tol_d, True)


cdef inline bint _greedy_cell(_W* w, int i, int ia, int ib, int it, int nr, const int* rows,
                              const int* cols, double* pr, double* pc, int* ra) noexcept nogil:
    """One cell of _transport's greedy start (pass it: 0 allocates, 1 joins the trees
    with zero flows): True when pass 0 has allocated everything."""
    cdef int a, b
    if it == 0 and (pr[ia] <= 0.0 or pc[ib] <= 0.0):
        return pr[ia] <= 0.0 and pc[ib] <= 0.0 and _all_zero(pr, nr)
    a = _uf_find(w.uf, ia)
    b = _uf_find(w.uf, nr + ib)
    if a == b:
        return False
    w.uf[a] = b
    _add_arc(w, i, rows[ia], cols[ib])
    ra[0] += 1
    if it == 0:
        if pr[ia] <= pc[ib]:
            pc[ib] -= pr[ia]
            pr[ia] = 0.0
        else:
            pr[ia] -= pc[ib]
            pc[ib] = 0.0
    return False


cdef void _greedy_heap(_W* w, int i, int nr, int nc, const int* rows, const int* cols,
                       const double* u, const double* Ci, const double* Ri, const double* lf,
                       bint forbidden, double* pr, double* pc, int* ra) noexcept nogil:
    """_transport's greedy start, the cells of the supports popped from a heap."""
    cdef int S = w.S, k = 0, ia, ib, j, it, heap
    cdef _Cell cell
    for ia in range(nr):
        pr[ia] = u[i * S + rows[ia]]
        for ib in range(nc):
            j = rows[ia] * S + cols[ib]
            w.cells[k].f = lf[j] if forbidden else 0.0
            w.cells[k].c = Ci[j]
            w.cells[k].r = Ri[j]
            w.cells[k].a = ia
            w.cells[k].b = ib
            k += 1
    for ib in range(nc):
        pc[ib] = u[(i + 1) * S + cols[ib]]
    for j in range(k // 2 - 1, -1, -1):
        _sift(w.cells, j, k)
    heap = k
    for it in range(2):
        j = k - 1
        while j >= 0 and ra[0] < nr + nc - 1:
            if j < heap:
                # the next cell in decreasing order: pop it to the heap's end
                heap -= 1
                cell = w.cells[0]
                w.cells[0] = w.cells[heap]
                w.cells[heap] = cell
                _sift(w.cells, 0, heap)
            ia = w.cells[j].a
            ib = w.cells[j].b
            j -= 1
            if _greedy_cell(w, i, ia, ib, it, nr, rows, cols, pr, pc, ra):
                break


cdef inline int _other(_W* w, int i, int e, int x) noexcept nogil:
    """The node at the other end of transition i's arc e from node x."""
    return (w.S + w.arc_b[i * w.cap + e]) if x < w.S else w.arc_a[i * w.cap + e]


cdef void _shift_pots(_W* w, int i, int x, double d, double* F, double* G) noexcept nogil:
    """Node x's potential += d (F at rows, G at columns, as _pots stores them)."""
    if x < w.S:
        F[i * w.S + x] += d
    else:
        G[(i + 1) * w.S + x - w.S] += d


cdef int _tree_init(_W* w, int i, const double* C, const double* R, const double* lf,
                    const double* u, int* tr) noexcept nogil:
    """Transition i's spanning tree for _tree_pivot: its tree data (par, depth), the
    potentials of C, R and (lf non-NULL) lf, the flows with marginals u, and in tr
    (7 L ints) each node's parent node, a preorder and each node's position in it and
    subtree size. 0, or 1 when the arcs are not a spanning tree of the supports."""
    cdef int L = w.L, j, x, y, e, top, cnt = 0
    cdef int* pnode = tr
    cdef int* pre = tr + L
    cdef int* pos = tr + 2 * L
    cdef int* size = tr + 3 * L
    cdef int* stack = tr + 6 * L
    cdef int* pr = w.par + i * L
    if _bfs(w, i) or w.ncomp[i] != 1:
        return 1
    _pots(w, i, C, w.F0, w.G0)
    _pots(w, i, R, w.F1, w.G1)
    if lf != NULL:
        _pots(w, i, lf, w.fA, w.gA)
    _flows(w, i, u, w.flA)
    # a preorder (each subtree contiguous) from _bfs's adjacency, still in w.adj
    stack[0] = w.order[i * L]
    top = 1
    pnode[stack[0]] = -1
    while top > 0:
        top -= 1
        x = stack[top]
        pos[x] = cnt
        pre[cnt] = x
        size[x] = 1
        cnt += 1
        for j in range(w.adj_off[x], w.adj_off[x + 1]):
            e = w.adj[j]
            if e != pr[x]:
                y = _other(w, i, e, x)
                pnode[y] = x
                stack[top] = y
                top += 1
    for j in range(cnt - 1, 0, -1):
        size[pnode[pre[j]]] += size[pre[j]]
    return 0


cdef void _tree_pivot(_W* w, int i, int a, int b, int k, const double* C, const double* R,
                      const double* lf, int* tr) noexcept nogil:
    """Arc (a, b) enters transition i's spanning tree (as _tree_init leaves it) and its
    arc k, on the cycle (a, b) closes, leaves: the flows move around the cycle by k's,
    and only the subtree k cut off changes its parents, depths and potentials (by one
    constant per cost), so a pivot costs the cycle and that subtree, not a rebuild."""
    cdef int S = w.S, L = w.L, cap = w.cap, x, y, e, q, xin, yout, j, m, cnt, prev
    cdef int sx = 0, sy = 0, par_e = 0, prev_arc, nxt, new_size, seg, n_path
    cdef int* pnode = tr
    cdef int* pre = tr + L
    cdef int* pos = tr + 2 * L
    cdef int* size = tr + 3 * L
    cdef int* buf = tr + 4 * L        # the cut subtree's new preorder
    cdef int* out = tr + 5 * L        # the whole new preorder
    cdef int* path = tr + 6 * L       # the path from xin up to q
    cdef int* pr = w.par + i * L
    cdef int* dp = w.depth + i * L
    cdef double theta = w.flA[i * cap + k], d, sgn
    # flows: around the cycle, decreasing from both ends of (a, b) first, alternating
    x = a
    y = S + b
    while x != y:
        e = _cycle_step(w, i, pr, dp, &x, &y, &sx, &sy, &par_e)
        w.flA[i * cap + e] += -theta if par_e == 0 else theta
    # the subtree k cuts off hangs from q, and holds one end of (a, b): xin
    q = w.arc_a[i * cap + k]
    if pr[q] != k:
        q = S + w.arc_b[i * cap + k]
    if pos[q] <= pos[a] < pos[q] + size[q]:
        xin, yout = a, S + b
    else:
        xin, yout = S + b, a
    seg = size[q]
    # its new preorder, rooted at xin: for each node p_j of the path xin = p_0 .. p_m
    # = q, p_j and its old subtree less p_{j-1}'s
    cnt = 0
    prev = -1
    x = xin
    n_path = 0
    while True:
        path[n_path] = x
        n_path += 1
        if prev < 0:
            for j in range(pos[x], pos[x] + size[x]):
                buf[cnt] = pre[j]
                cnt += 1
        else:
            for j in range(pos[x], pos[prev]):
                buf[cnt] = pre[j]
                cnt += 1
            for j in range(pos[prev] + size[prev], pos[x] + size[x]):
                buf[cnt] = pre[j]
                cnt += 1
        if x == q:
            break
        prev = x
        x = pnode[x]
    # sizes: the old ancestors of q lose the subtree
    y = pnode[q]
    while y >= 0:
        size[y] -= seg
        y = pnode[y]
    # along the path, p_j now holds p_{j+1}'s new subtree and its old one less p_{j-1}'s
    new_size = 0
    for j in range(n_path - 1, 0, -1):
        new_size += size[path[j]] - size[path[j - 1]]
        size[path[j]] = new_size
    size[xin] = seg
    # the path's parents reverse (xin hangs from yout by the new arc, which _add_arc
    # puts last once k is gone)
    _del_arc(w, i, k)
    m = w.na[i]
    if m != k:
        # the arc that was last moved into k's slot
        x = w.arc_a[i * cap + k]
        if pr[x] != m:
            x = S + w.arc_b[i * cap + k]
        pr[x] = k
        w.flA[i * cap + k] = w.flA[i * cap + m]
    _add_arc(w, i, a, b)
    w.flA[i * cap + m] = theta
    x = xin
    y = yout
    prev_arc = m
    while True:
        nxt = pnode[x]
        e = pr[x]
        pnode[x] = y
        pr[x] = prev_arc
        if x == q:
            break
        prev_arc = e
        y = x
        x = nxt
    y = yout
    while y >= 0:
        size[y] += seg
        y = pnode[y]
    # the whole preorder: the old one without the subtree, which follows yout
    cnt = 0
    for j in range(w.nord[i]):
        x = pre[j]
        if pos[q] <= j < pos[q] + seg:
            continue
        out[cnt] = x
        cnt += 1
        if x == yout:
            memcpy(out + cnt, buf, seg * sizeof(int))
            cnt += seg
    memcpy(pre, out, cnt * sizeof(int))
    for j in range(cnt):
        pos[pre[j]] = j
    # depths and potentials over the subtree (parents first): the new arc's reduced
    # cost is made 0 by shifting its side's rows by d and columns by -d
    sgn = 1.0 if xin < S else -1.0
    d = C[a * S + b] - w.F0[i * S + a] - w.G0[(i + 1) * S + b]
    for j in range(seg):
        x = buf[j]
        dp[x] = dp[pnode[x]] + 1
        _shift_pots(w, i, x, d * sgn if x < S else -d * sgn, w.F0, w.G0)
    d = R[a * S + b] - w.F1[i * S + a] - w.G1[(i + 1) * S + b]
    for j in range(seg):
        x = buf[j]
        _shift_pots(w, i, x, d * sgn if x < S else -d * sgn, w.F1, w.G1)
    if lf != NULL:
        d = lf[a * S + b] - w.fA[i * S + a] - w.gA[(i + 1) * S + b]
        for j in range(seg):
            x = buf[j]
            _shift_pots(w, i, x, d * sgn if x < S else -d * sgn, w.fA, w.gA)


cdef void _sort_cells(_W* w, const double* C, const double* R, int* order) noexcept nogil:
    """order <- the S^2 cells (a S + b) of one transition's costs by decreasing (C, R)."""
    cdef int S = w.S, k, heap
    cdef _Cell cell
    for k in range(S * S):
        w.cells[k].f = 0.0
        w.cells[k].c = C[k]
        w.cells[k].r = R[k]
        w.cells[k].a = k
        w.cells[k].b = 0
    for k in range(S * S // 2 - 1, -1, -1):
        _sift(w.cells, k, S * S)
    for heap in range(S * S - 1, -1, -1):
        order[S * S - 1 - heap] = w.cells[0].a
        cell = w.cells[0]
        w.cells[0] = w.cells[heap]
        w.cells[heap] = cell
        _sift(w.cells, 0, heap)


cdef int _transport(_W* w, int i, const double* u, const double* C, const double* R,
                    double tolC, int* tr, const int* order=NULL) noexcept nogil:
    """Transition i's forest <- an optimal basis of the transport problem max <C, V>
    over couplings of u_i and u_{i+1} that avoid the forbidden cells (C = -inf), ties
    in C broken by R: lexicographic costs (-[forbidden], C, R), a greedy start, then
    network-simplex pivots (Dantzig's rule; Bland's after repeated degenerate pivots).
    The forest is the basis (a spanning tree) less its forbidden arcs. 0; 2 when every
    coupling uses a forbidden cell; 1 on a failure. order: NULL, or all S^2 cells
    (a S + b) by decreasing (C, R), for a transition without forbidden cells (_start
    sorts them once for transitions that share their costs). tr: 7 L ints of scratch
    (the tree's preorder; see _tree_init)."""
    cdef int S = w.S, cap = w.cap, a, b, ia, ib, k, j, ra, best_a, best_b, tier, n_degen = 0
    cdef int nr = 0, nc = 0, it
    cdef int* rows = w.rows
    cdef int* cols = w.rows + S
    cdef double* pr = w.pot2        # residuals (2 S doubles)
    cdef double* pc = w.pot2 + S
    cdef double rc, best, x
    cdef const double* Ci = C + i * S * S
    cdef const double* Ri = R + i * S * S
    cdef double* lf = w.lcost       # with forbidden cells: -[forbidden] and C there 0
    cdef double* lc = w.lcost + S * S
    cdef bint bland, forbidden = False
    for a in range(S):
        if w.inP[i * S + a]:
            rows[nr] = a
            nr += 1
        if w.inP[(i + 1) * S + a]:
            cols[nc] = a
            nc += 1
    for ia in range(nr):
        for ib in range(nc):
            if Ci[rows[ia] * S + cols[ib]] == -INFINITY:
                forbidden = True
    if forbidden:
        for k in range(S * S):
            lf[k] = -1.0 if Ci[k] == -INFINITY else 0.0
            lc[k] = 0.0 if Ci[k] == -INFINITY else Ci[k]
        Ci = lc
    # a greedy start: cells by decreasing (-[forbidden], C, R) (popped from a heap, or
    # read from order), each given all it can take; then zero-flow cells join the trees
    # into a spanning tree
    for ia in range(nr + nc):
        w.uf[ia] = ia
    ra = 0
    if order != NULL and not forbidden:
        for ia in range(nr):
            pr[ia] = u[i * S + rows[ia]]
        for ib in range(nc):
            pc[ib] = u[(i + 1) * S + cols[ib]]
        # positions of the support's tags among rows and cols (-1: outside)
        for a in range(2 * S):
            w.cur[a] = -1
        for ia in range(nr):
            w.cur[rows[ia]] = ia
        for ib in range(nc):
            w.cur[S + cols[ib]] = ib
        for it in range(2):
            for j in range(S * S):
                if ra >= nr + nc - 1:
                    break
                ia = w.cur[order[j] // S]
                ib = w.cur[S + order[j] % S]
                if ia < 0 or ib < 0:
                    continue
                if _greedy_cell(w, i, ia, ib, it, nr, rows, cols, pr, pc, &ra):
                    break
    else:
        _greedy_heap(w, i, nr, nc, rows, cols, u, Ci, Ri, lf, forbidden, pr, pc, &ra)
    if _tree_init(w, i, Ci, Ri, lf if forbidden else NULL, u, tr):
        return 1
    for it in range(100000):
        bland = n_degen > 2 * S
        tier = 3
        best = 0.0
        best_a = best_b = -1
        for ia in range(nr):
            a = rows[ia]
            for ib in range(nc):
                b = cols[ib]
                if w.inF[(i * S + a) * S + b]:
                    continue
                if forbidden:
                    # integer-valued: -1, 0 or +1 and more
                    rc = w.fA[i * S + a] + w.gA[(i + 1) * S + b] - lf[a * S + b]
                    if rc < -0.5:
                        if tier > 0 or rc < best:
                            tier = 0
                            best = rc
                            best_a = a
                            best_b = b
                        continue
                    if rc > 0.5 or tier == 0:
                        continue
                rc = w.F0[i * S + a] + w.G0[(i + 1) * S + b] - Ci[a * S + b]
                if rc < -tolC:
                    if tier > 1 or rc < best:
                        tier = 1
                        best = rc
                        best_a = a
                        best_b = b
                elif tier > 1 and rc <= tolC:
                    rc = w.F1[i * S + a] + w.G1[(i + 1) * S + b] - Ri[a * S + b]
                    if rc < -1e-12 and (tier == 3 or rc < best):
                        tier = 2
                        best = rc
                        best_a = a
                        best_b = b
                if bland and tier < 3:
                    break
            if bland and tier < 3:
                break
        if tier == 3:
            break
        k = _cycle_min(w, i, best_a, best_b)
        if k < 0:
            return 1
        if w.flA[i * cap + k] <= TOL_X:
            n_degen += 1
        else:
            n_degen = 0
        _tree_pivot(w, i, best_a, best_b, k, Ci, Ri, lf if forbidden else NULL, tr)
    else:
        return 1
    if forbidden:
        k = 0
        while k < w.na[i]:
            j = w.arc_a[i * cap + k] * S + w.arc_b[i * cap + k]
            if lf[j] < 0.0:
                if w.flA[i * cap + k] > TOL_X:
                    return 2
                _del_arc(w, i, k)
                w.flA[i * cap + k] = w.flA[i * cap + w.na[i]]
            else:
                k += 1
    return 0


# -- a warm start: a guessed structure, made optimal at nearby scores -------------------

cdef int _guess(_W* w, const double* eta_u, const double* eta_v, int rounds,
                Py_ssize_t* n_iter, int* stack) noexcept nogil:
    """Move the structure toward the one optimal at (eta_u, eta_v) by primal-dual
    active-set rounds on its state at the scores themselves (t = 0 of C0 = eta_v): per
    transition, the arc of the most negative flow leaves (nodes left without arcs on a
    side with it) and the arcs of the most negative reduced costs enter (at most
    GUESS_ENTER, those that join two trees); the best positive path enters. Measured:
    more changes per round oscillate (at 40 x 17 the arcs swung between 500 and 1,000
    for 20 rounds), while these converge in about as many rounds as a transition needs
    changes. It stops at the first round without a change. 0, or 1 when the structure
    broke down (a support emptied, or an invalid one)."""
    cdef int S = w.S, T = w.T, n = w.n, i, k, a, b, r, nc, ei, ex, eb, changes, kb, added
    cdef int fewest = -1, since = 0
    cdef Py_ssize_t q
    cdef double rc, fa, x, best
    cdef const double* Ci
    cdef const double* gi
    cdef _Cell cell
    # D only enters at t = 0, times 0: eta_v itself keeps _path_max's bound finite
    _column_maxima(w, eta_v, eta_v)
    for r in range(rounds):
        if _update(w, eta_u, eta_v, eta_v, r == 0, False):
            return 1
        n_iter[0] += 1
        changes = 0
        for i in range(T):
            kb = -1
            best = -TOL_X
            for k in range(w.na[i]):
                x = w.flA[i * w.cap + k]
                if x < best:
                    best = x
                    kb = k
            if kb >= 0:
                _del_arc(w, i, kb)
                changes += 1
        for i in range(n):
            for a in range(S):
                q = i * S + a
                if (w.inP[q] and ((i > 0 and w.deg_c[q - S] == 0) or (i < T and w.deg_r[q] == 0))
                        and _cascade(w, i, a, stack)):
                    return 1
        for i in range(T):
            # the candidates, popped from a max-heap by minus their reduced cost
            nc = 0
            gi = w.gA + (i + 1) * S
            for a in range(S):
                if not w.inP[i * S + a]:
                    continue
                fa = w.fA[i * S + a]
                Ci = eta_v + (i * S + a) * S
                for b in range(S):
                    rc = fa + gi[b] - Ci[b]
                    if rc < -w.tol_d and w.inP[(i + 1) * S + b] and not w.inF[(i * S + a) * S + b]:
                        w.cells[nc].f = -rc
                        w.cells[nc].c = 0.0
                        w.cells[nc].r = 0.0
                        w.cells[nc].a = a
                        w.cells[nc].b = b
                        nc += 1
            if nc == 0:
                continue
            for k in range(2 * S):
                w.uf[k] = k
            for k in range(w.na[i]):
                a = _uf_find(w.uf, w.arc_a[i * w.cap + k])
                b = _uf_find(w.uf, S + w.arc_b[i * w.cap + k])
                w.uf[a] = b
            for k in range(nc // 2 - 1, -1, -1):
                _sift(w.cells, k, nc)
            added = 0
            while nc > 0 and added < GUESS_ENTER:
                cell = w.cells[0]
                nc -= 1
                w.cells[0] = w.cells[nc]
                _sift(w.cells, 0, nc)
                a = _uf_find(w.uf, cell.a)
                b = _uf_find(w.uf, S + cell.b)
                if a == b:
                    continue
                w.uf[a] = b
                _add_arc(w, i, cell.a, cell.b)
                changes += 1
                added += 1
        if _path_max(w, eta_u, eta_v, eta_v, 0.0, &ei, &ex, &eb) > w.tol_d:
            _path_trace(w, ei, ex, eb)
            _add_path(w)
            changes += 1
        if changes == 0:
            break
        # oscillating: hand the structure to the path as it is
        if fewest < 0 or changes < fewest:
            fewest = changes
            since = 0
        else:
            since += 1
            if since >= GUESS_STALL:
                break
    return 0


cdef void _warm_scores(_W* w, const double* eta_u, const double* eta_v, double margin,
                       double* euh, double* eub, double* vh, double* dv,
                       double* scratch) noexcept nogil:
    """Scores (euh, vh) at which w's structure (its state _update'd at C0 = eta_v, read
    at t = 0) is optimal with every inequality slack by margin, with the slopes
    eub = eta_u - euh, dv = eta_v - vh of the path from them to (eta_u, eta_v).

    On the supports, euh = eta_u + lam (p - u), p a point of the structure whose flows
    are all positive (the forward-backward marginals of the paths through the forests'
    arcs) and lam the least (at most 1) that lifts every u and flow to a tenth of p's:
    u - euh lies in the structure's linear part, so the piece at euh is u + lam (p - u)
    with the same potentials and gauges. Outside the forests, vh lowers the arcs whose
    reduced cost is below margin; outside the supports, euh lowers the nodes so that no
    path scores above -margin (each node's score, plus its best way in and its best way
    out, below -margin)."""
    cdef int n = w.n, S = w.S, T = w.T, i, a, b, k
    cdef Py_ssize_t q
    cdef double* al = scratch
    cdef double* be = scratch + n * S
    cdef double* pn = scratch + 2 * n * S
    cdef double* pf = scratch + 3 * n * S
    cdef double s, x, xp, lam = 0.0, tau, into, out, rc
    for q in range(n * S):
        al[q] = 1.0 if (q < S and w.inP[q]) else 0.0
        be[q] = 1.0 if (q >= (n - 1) * S and w.inP[q]) else 0.0
    for i in range(T):
        for k in range(w.na[i]):
            al[(i + 1) * S + w.arc_b[i * w.cap + k]] += al[i * S + w.arc_a[i * w.cap + k]]
        s = 0.0
        for b in range(S):
            s += al[(i + 1) * S + b]
        for b in range(S):
            al[(i + 1) * S + b] /= s
    for i in range(T - 1, -1, -1):
        for k in range(w.na[i]):
            be[i * S + w.arc_a[i * w.cap + k]] += be[(i + 1) * S + w.arc_b[i * w.cap + k]]
        s = 0.0
        for a in range(S):
            s += be[i * S + a]
        for a in range(S):
            be[i * S + a] /= s
    for i in range(n):
        s = 0.0
        for a in range(S):
            s += al[i * S + a] * be[i * S + a]
        for a in range(S):
            pn[i * S + a] = al[i * S + a] * be[i * S + a] / s
    for i in range(T):
        _flows(w, i, pn, pf)
    # lam: every u and flow at least a tenth of p's
    for q in range(n * S):
        if w.inP[q]:
            x = w.uA[q]
            if x < 0.1 * pn[q]:
                lam = max(lam, (0.1 * pn[q] - x) / (pn[q] - x))
    for i in range(T):
        for k in range(w.na[i]):
            x = w.flA[i * w.cap + k]
            xp = pf[i * w.cap + k]
            if x < 0.1 * xp:
                lam = max(lam, (0.1 * xp - x) / (xp - x))
    for q in range(n * S):
        if w.inP[q]:
            euh[q] = eta_u[q] + lam * (pn[q] - (w.uA[q]))
    for i in range(T):
        for a in range(S):
            for b in range(S):
                q = (i * S + a) * S + b
                vh[q] = eta_v[q]
                if w.inP[i * S + a] and w.inP[(i + 1) * S + b] and not w.inF[q]:
                    rc = w.fA[i * S + a] + w.gA[(i + 1) * S + b] - eta_v[q]
                    if rc < margin:
                        vh[q] = eta_v[q] + rc - margin
                dv[q] = eta_v[q] - vh[q]
    for i in range(n):
        tau = w.lamA[i * S]
        for a in range(S):
            q = i * S + a
            if w.inP[q]:
                continue
            if eta_u[q] == -INFINITY:
                euh[q] = -INFINITY
                continue
            into = 0.0 if i == 0 else -INFINITY
            if i > 0:
                for b in range(S):
                    x = vh[((i - 1) * S + b) * S + a]
                    if w.inP[(i - 1) * S + b]:
                        x -= w.fA[(i - 1) * S + b]
                    elif eta_u[(i - 1) * S + b] == -INFINITY:
                        continue
                    into = max(into, x)
            out = 0.0
            if i < T:
                for b in range(S):
                    if w.inP[(i + 1) * S + b]:
                        out = max(out, vh[q * S + b] - w.gA[(i + 1) * S + b])
            euh[q] = min(eta_u[q], tau - into - out - margin)
    for q in range(n * S):
        eub[q] = eta_u[q] - euh[q] if euh[q] > -INFINITY else 0.0


cdef bint _warm(_W* w, const double* eta_u, const double* eta_v, double scale,
                Py_ssize_t budget, Py_ssize_t* n_iter, int* stack) noexcept nogil:
    """The path from scores near (eta_u, eta_v) at which a guessed structure is optimal
    (_guess from the start's, _warm_scores), both scores moving: True when it got to
    (eta_u, eta_v) and its structure is optimal there (w then holds it, _update'd at
    C0 = 0, D = eta_v)."""
    cdef int n = w.n, S = w.S, T = w.T
    cdef Py_ssize_t q, nS = <Py_ssize_t> n * S, TSS = <Py_ssize_t> T * S * S
    cdef double dmax = 0.0
    cdef bint ok = False
    if _guess(w, eta_u, eta_v, <int> min(GUESS_ROUNDS, budget - n_iter[0]), n_iter, stack):
        return False
    if _update(w, eta_u, eta_v, eta_v, False, False):
        return False
    cdef double* buf = <double*> malloc((5 * nS + 2 * TSS + T * w.cap) * sizeof(double))
    if buf == NULL:
        return False
    cdef double* euh = buf
    cdef double* eub = buf + nS
    cdef double* vh = buf + 2 * nS
    cdef double* dv = buf + 2 * nS + TSS
    _warm_scores(w, eta_u, eta_v, WARM_MARGIN * scale, euh, eub, vh, dv, buf + 2 * nS + 2 * TSS)
    for q in range(nS):
        dmax = max(dmax, fabs(eub[q]))
    for q in range(TSS):
        dmax = max(dmax, fabs(dv[q]))
    w.eub = eub
    w.stol_x = TOL_S * dmax
    w.stol_d = TOL_S * dmax
    w.t_start = max(1e-9, START_ROUNDOFF / dmax) if dmax > 0.0 else 1e-9
    if _follow_costs(w, euh, vh, dv, 1.0, False, budget, n_iter, stack) == RUN_OK:
        w.eub = NULL
        ok = _optimal_at(w, eta_u, eta_v)
    w.eub = NULL
    free(buf)
    return ok


cdef bint _optimal_at(_W* w, const double* eta_u, const double* eta_v) noexcept nogil:
    """Whether w's structure, reached on a path to other scores, is the solution's at
    (eta_u, eta_v): its u, flows and potentials recomputed there (_update) hold, and no
    arc, flow or path violates optimality."""
    return _update(w, eta_u, NULL, eta_v, True) == 0 and not _violated(w, eta_u, NULL, eta_v, 1.0)


cdef double _pooled_std(const double* x, Py_ssize_t n_groups, Py_ssize_t size,
                        Py_ssize_t step) noexcept nogil:
    """The standard deviation of x's finite entries about their group's mean, over the
    groups 0, step, 2 step, ... of n_groups consecutive groups of size entries (0 when
    none is finite). It runs before every solve of the default choice of side, so it
    reads each entry once: sums of the entries and of their squares (shifted by the
    group's first entry, so that round-off stays at the spread's scale), in four
    accumulators whose adds overlap."""
    cdef Py_ssize_t g, j, k, cnt, tot = 0, end = size - size % 4
    cdef double c, d, s1, s2, acc = 0.0
    cdef double a1[4]
    cdef double a2[4]
    cdef Py_ssize_t an[4]
    cdef bint ok
    cdef const double* xg
    g = -step
    while g + step < n_groups:
        g += step
        xg = x + g * size
        c = xg[0] if xg[0] > -INFINITY else 0.0
        for k in range(4):
            a1[k] = 0.0
            a2[k] = 0.0
            an[k] = 0
        for j in range(0, end, 4):
            for k in range(4):
                ok = xg[j + k] > -INFINITY          # finite (nan: False)
                d = xg[j + k] - c if ok else 0.0
                a1[k] += d
                a2[k] += d * d
                an[k] += ok
        for j in range(end, size):
            ok = xg[j] > -INFINITY
            d = xg[j] - c if ok else 0.0
            a1[0] += d
            a2[0] += d * d
            an[0] += ok
        cnt = an[0] + an[1] + an[2] + an[3]
        if cnt == 0:
            continue
        s1 = (a1[0] + a1[1]) + (a1[2] + a1[3])
        s2 = (a2[0] + a2[1]) + (a2[2] + a2[3])
        acc += max(s2 - s1 * s1 / cnt, 0.0)
        tot += cnt
    return (acc / tot) ** 0.5 if tot > 0 else 0.0


cdef inline Py_ssize_t _spread_step(Py_ssize_t T, Py_ssize_t S) noexcept nogil:
    """Every how many transitions the spread of eta_v is read: about SPREAD_SAMPLE
    entries (whole transitions, evenly spaced; all of them for short sequences)."""
    return 1 + T * S * S // SPREAD_SAMPLE


cdef double _spread_ratio(double su, double sv) noexcept nogil:
    """sv / su, the pooled standard deviations of eta_v (centred per transition) and
    eta_u (per position): how far u moves from per-position sparsemax, relative to the
    unary scores' spread (0 when eta_v is constant per transition, inf when eta_u is)."""
    if sv == 0.0:
        return 0.0
    return sv / su if su > 0.0 else INFINITY


def transition_spread(eta_u, eta_v):
    """The spreads the choice of side reads: the pooled standard deviations of
    ``eta_v`` (about each transition's mean) and of ``eta_u`` (about each
    position's), over finite entries (tests: the spread test's figures).

    Parameters
    ----------
    eta_u : array_like, shape (n, S)
    eta_v : array_like, shape (n - 1, S, S)

    Returns
    -------
    sv, su : float
        ``sv`` over every ``k``-th transition, ``k = 1 + (n - 1) S^2 // 2048``
        (whole transitions, about 2048 entries; all of them for short sequences).
    declines : bool
        Whether the default solver declines for them (``sv >= SPREAD_A *
        max(su, SU_FLOOR) ** SPREAD_B``).
    """
    cdef const double[:, ::1] u = np.ascontiguousarray(eta_u, dtype=np.float64)
    cdef const double[:, :, ::1] v = np.ascontiguousarray(eta_v, dtype=np.float64)
    cdef Py_ssize_t n = u.shape[0], S = u.shape[1]
    if n < 2 or S < 1 or v.shape[0] != n - 1 or v.shape[1] != S or v.shape[2] != S:
        raise ValueError(f"eta_v: expected shape ({n - 1}, {S}, {S}) for eta_u of shape "
                         f"{(n, S)} (n >= 2), got {tuple(np.shape(eta_v))}")
    cdef double su = _pooled_std(&u[0, 0], n, S, 1)
    cdef double sv = _pooled_std(&v[0, 0, 0], n - 1, S * S, _spread_step(n - 1, S))
    return sv, su, bool(sv >= SPREAD_A * pow(max(su, SU_FLOOR), SPREAD_B))


# -- the state -------------------------------------------------------------------------
# The backward state, ints only: this header, the flags of P (n S), then per
# transition its arc count and its arcs (a, b). _layout is the one place that knows
# the offsets, _arcs_size the size of a transition's block; the whole size depends on
# the arc counts, so the reader checks it as it walks them.

cdef struct SequenceHeader:
    int n, S

cdef struct SequenceLayout:
    Py_ssize_t inP, arcs      # into the ints: the flags of P, the first transition

cdef Py_ssize_t HEADER = sizeof(SequenceHeader) // sizeof(int)


cdef inline SequenceLayout _layout(const SequenceHeader* h) noexcept nogil:
    cdef SequenceLayout l
    l.inP = HEADER
    l.arcs = l.inP + <Py_ssize_t> h.n * h.S
    return l


cdef inline Py_ssize_t _arcs_size(int n_arcs) noexcept nogil:
    return 1 + 2 * <Py_ssize_t> n_arcs


cdef int _save(_W* w, FacetState* st) except -1 nogil:
    cdef SequenceHeader h
    cdef SequenceLayout l
    cdef Py_ssize_t size, j
    cdef int i, k
    h.n, h.S = w.n, w.S
    l = _layout(&h)
    size = l.arcs
    for i in range(w.T):
        size += _arcs_size(w.na[i])
    state_resize(st, size, 0)
    memcpy(st.ints, &h, sizeof(SequenceHeader))
    for j in range(w.n * w.S):
        st.ints[l.inP + j] = w.inP[j]
    j = l.arcs
    for i in range(w.T):
        st.ints[j] = w.na[i]
        j += 1
        for k in range(w.na[i]):
            st.ints[j] = w.arc_a[i * w.cap + k]
            st.ints[j + 1] = w.arc_b[i * w.cap + k]
            j += 2
    return 0


cdef int _load(_W* w, const FacetState* st) noexcept nogil:
    """The structure of a state into a fresh workspace, its trees and factor built:
    0, or 1 if the state does not describe a valid structure (its header is the
    workspace's, checked by the caller)."""
    cdef SequenceHeader h
    cdef SequenceLayout l
    cdef Py_ssize_t j
    cdef int i, k, a, b, S = w.S
    h.n, h.S = w.n, w.S
    l = _layout(&h)
    if st.n_ints < l.arcs or st.n_reals != 0:
        return 1
    for j in range(w.n * S):
        w.inP[j] = 1 if st.ints[l.inP + j] else 0
    j = l.arcs
    for i in range(w.T):
        if j >= st.n_ints or st.ints[j] < 0 or st.ints[j] > w.cap:
            return 1
        k = st.ints[j]
        if j + _arcs_size(k) > st.n_ints:
            return 1
        j += 1
        while k > 0:
            a = st.ints[j]
            b = st.ints[j + 1]
            if a < 0 or a >= S or b < 0 or b >= S:
                return 1
            _add_arc(w, i, a, b)
            j += 2
            k -= 1
    if j != st.n_ints:
        return 1
    for i in range(w.T):
        if _bfs(w, i):
            return 1
    return _factor_all(w)


_TIE_DIRECTIONS = {}     # n_v: sparsemap.testing.tie_direction of that size, read-only


cdef class SequenceFacetSolver(FacetSolver):
    """The facet-side solver of a :class:`~sparsemap.SequenceFactor`.

    SparseMAP over the chain's local polytope (marginalisation constraints), by
    following ``u`` through the events where its structure (the supports of ``u`` and
    the spanning forests of the transport plans ``v``) changes: from scores near
    ``(eta_u, eta_v)`` at which a guessed structure is optimal, or else along
    ``t eta_v`` from ``t = 0`` (per-position sparsemax) to ``t = 1``; each piece is
    solved exactly as a block-tridiagonal linear system. The result is certified by the
    duality gap (one Viterbi call). See the module's docstring.

    Parameters
    ----------
    factor : SequenceFactor
    decline_peaked : bool, default True
        Decline at once where the vertex side is measured to be faster (the
        default choice of side; see the module docstring).
    warm : bool or None, default None
        Whether to try the warm path first (a guessed structure, then the path from
        scores at which it is optimal): ``None`` where the transitions' spread is at
        least a twentieth of the unary scores' (below, the path from ``t = 0`` is
        short and cheaper), ``True`` always, ``False`` never. The solution and the
        Jacobian are the same (``True`` and ``False`` are for tests and
        measurements).

    Notes
    -----
    ``v`` is the basic optimal plan on the identified forests (a vertex of each
    transport polytope); ``v`` is not unique when transitions tie (for example at
    ``eta_v = 0``, where every coupling of the marginals is optimal).

    Where ``u`` is not differentiable in ``eta_v`` (exact ties in ``eta_v``, such
    as a zero-initialised transition matrix), the Jacobian is the one of the piece
    that ``u`` follows along ``(0, r)``, ``r =``
    :func:`sparsemap.testing.tie_direction`: the limit of the Jacobians at
    ``eta_v + t r`` as ``t`` decreases to 0, as on the vertex side.

    ``-inf`` entries forbid tags (``eta_u``) and transitions (``eta_v``); u, v and
    both Jacobian products are 0 on them.

    The solve declines (``FACET_DECLINED``) when its budget of pieces runs out, or
    is estimated or projected to be exceeded twice over (transition scores as
    spread as the unary ones, where ``u`` crosses many structures: the vertex side
    is fast there), when forbidden transitions cannot be avoided by couplings of
    per-position sparsemax (its start), and when a consistency check or the
    certificate fails.

    Examples
    --------
    Three positions, two tags; the transition from tag 0 to tag 1 costs 1:

    >>> import numpy as np, sparsemap as sm
    >>> from sparsemap._facet_sequence import SequenceFacetSolver
    >>> f = sm.SequenceFactor(3, 2)
    >>> eta_u = np.array([[1.0, 0.0], [0.0, 0.5], [1.0, 0.0]])
    >>> eta_v = np.zeros(f.shape_v)
    >>> eta_v[:, 0, 1] = -1.0
    >>> solver = SequenceFacetSolver(f)
    >>> sol = solver.solve(eta_u, eta_v)
    >>> sol.status                       # FACET_SOLVED
    0
    >>> print(np.round(sol.u, 3))
    [[0.625 0.375]
     [0.625 0.375]
     [1.    0.   ]]
    >>> structures, weights = solver.decompose(sol.u, sol.v)
    >>> for s, w in zip(structures, weights):
    ...     print(s.tolist(), round(float(w), 3))
    [0, 0, 0] 0.625
    [1, 1, 0] 0.375
    """
    cdef int n, S
    cdef int warm        # -1: by the spreads (WARM_RHO), 0: never, 1: always
    cdef object r_array
    cdef const double* r

    def __init__(self, Factor factor, decline_peaked=True, warm=None):
        from sparsemap._factors._sequence import SequenceFactor
        from sparsemap._active_set import tie_direction
        if not isinstance(factor, SequenceFactor):
            raise ValueError(f"factor: expected a SequenceFactor, got {type(factor).__name__}")
        super().__init__(factor, decline_peaked)
        self.warm = -1 if warm is None else int(bool(warm))
        self.n = factor.n_positions
        self.S = factor.n_states
        # one read-only copy per size: a solver is built for every solve of the default
        # choice, and copying r cost more than the peaked-score test
        r = _TIE_DIRECTIONS.get(factor.n_v)
        if r is None:
            r = np.ascontiguousarray(tie_direction(factor), dtype=np.float64).reshape(-1)
            r.flags.writeable = False
            _TIE_DIRECTIONS[factor.n_v] = r
        self.r_array = r
        cdef const double[::1] rv = self.r_array
        self.r = &rv[0] if rv.shape[0] else NULL

    def __reduce__(self):
        return (type(self), (self.factor, bool(self.decline_peaked),
                             None if self.warm < 0 else bool(self.warm)))

    cdef int c_solve(self, const double* eta_u, const double* eta_v, double* u, double* v,
                     FacetState* st, Py_ssize_t budget, Py_ssize_t* n_iter,
                     double* residuals) except -1 nogil:
        cdef int n = self.n, S = self.S, T = n - 1, status
        cdef Py_ssize_t j
        cdef double scale_u = 0.0, scale_v = 0.0, x
        cdef _W w
        cdef int* stack = NULL
        cdef double su, sv
        cdef bint warm = self.warm == 1
        n_iter[0] = 0
        residuals[0] = residuals[1] = INFINITY
        if T > 0:
            su = _pooled_std(eta_u, n, S, 1)
            sv = _pooled_std(eta_v, T, <Py_ssize_t> S * S, _spread_step(T, S))
            if self.warm < 0:
                warm = _spread_ratio(su, sv) >= WARM_RHO
            # spread transitions: the vertex side is cheaper (see the module docstring)
            if self.decline_peaked and sv >= SPREAD_A * pow(max(su, SU_FLOOR), SPREAD_B):
                return FACET_DECLINED
            if EST_FACTOR * budget < n * S * min(1.0, _spread_ratio(su, sv)):
                return FACET_DECLINED
        for j in range(n * S):
            x = eta_u[j]
            if x != x or x == INFINITY:
                return FACET_DECLINED
            if x > -INFINITY and fabs(x) > scale_u:
                scale_u = fabs(x)
        if T > 0:
            for j in range(T * S * S):
                x = eta_v[j]
                if x != x or x == INFINITY:
                    return FACET_DECLINED
                if x > -INFINITY and fabs(x) > scale_v:
                    scale_v = fabs(x)
        _alloc(&w, n, S, self.factor.work_bytes)
        # the cascade's stack: at most one entry per arc removed, plus one
        stack = <int*> malloc((2 * n * S + 2) * sizeof(int))
        if stack == NULL:
            _free(&w)
            with gil:
                raise MemoryError()
        try:
            status = self._solve(&w, eta_u, eta_v, u, v, st, budget, n_iter, residuals,
                                 scale_u, scale_v, stack, warm)
        finally:
            free(stack)
            _free(&w)
        return status

    cdef int _restart(self, _W* w, double scale) except -1 nogil:
        """w emptied for another path from a start (its structure and events dropped),
        at the tolerances of scores of that scale."""
        _free(w)
        _alloc(w, self.n, self.S, self.factor.work_bytes)
        w.tol_d = _tol_d(scale)
        return 0

    cdef int _solve(self, _W* w, const double* eta_u, const double* eta_v, double* u,
                    double* v, FacetState* st, Py_ssize_t budget, Py_ssize_t* n_iter,
                    double* residuals, double scale_u, double scale_v,
                    int* stack, bint warm) except -1 nogil:
        cdef int n = self.n, S = self.S, T = n - 1, i, a, b, k
        cdef Py_ssize_t j
        cdef double x, best, lin, usq, lin_abs, gap, res_p, t_end
        cdef bint phase2 = False, solved = False
        cdef int attempt
        cdef double* shifted = NULL
        w.tol_d = _tol_d(scale_u + scale_v)
        # phase 1: eta_v(t) = t eta_v
        if warm and scale_v > 0.0 and not _any_forbidden(eta_v, T * S * S):
            solved = (_start(w, eta_u, eta_v, self.r, scale_v) == 0
                      and _warm(w, eta_u, eta_v, scale_u + scale_v, budget, n_iter, stack))
            if not solved:
                self._restart(w, scale_u + scale_v)
        if not solved and _start(w, eta_u, eta_v, self.r, scale_v):
            return FACET_DECLINED
        if scale_v > 0.0:
            if not solved and _degenerate(w):
                # a degenerate start (tied marginals: rows of eta_u that tie, eta_u = 0)
                # puts the path's first events all at t = 0, where pivots on ties can
                # cycle (measured: eta_u = 0, 100 x 17, at every scale of eta_v). The
                # path then runs from eta_u + delta rho (rho: the tie direction's first
                # n S entries), whose start is not degenerate, and its last structure is
                # taken at eta_u if it is optimal there (u and v follow from the
                # structure and the scores; ties are resolved below as at any end).
                shifted = <double*> malloc(n * S * sizeof(double))
                if shifted == NULL:
                    with gil:
                        raise MemoryError()
                try:
                    for attempt in range(2):
                        x = (SHIFT_FIRST if attempt == 0 else SHIFT_NEXT) * max(scale_u, scale_v)
                        for j in range(n * S):
                            shifted[j] = eta_u[j] + x * self.r[j]
                        self._restart(w, scale_u + scale_v)
                        if _start(w, shifted, eta_v, self.r, scale_v):
                            break
                        if not _phase1(w, shifted, eta_v, scale_v, budget, n_iter, stack):
                            continue
                        if _optimal_at(w, eta_u, eta_v):
                            solved = True
                            break
                finally:
                    free(shifted)
                if not solved:
                    # the path from eta_u itself
                    self._restart(w, scale_u + scale_v)
                    if _start(w, eta_u, eta_v, self.r, scale_v):
                        return FACET_DECLINED
            if not solved and not _phase1(w, eta_u, eta_v, scale_v, budget, n_iter, stack):
                return FACET_DECLINED
            phase2 = _has_ties(w, eta_u, NULL, eta_v, 1.0)
        else:
            phase2 = T > 0
        # phase 2: at ties, the piece along eta_v + s r, s -> 0+
        if phase2:
            w.stol_x = TOL_S
            w.stol_d = TOL_S
            if _follow_costs(w, eta_u, eta_v, self.r, 0.0, True, budget, n_iter, stack) != RUN_OK:
                return FACET_DECLINED
        elif T == 0:
            if _factor_all(w):
                return FACET_DECLINED
            memcpy(w.zA, eta_u, S * sizeof(double))
            _project_range(w, w.zA, -1.0, w.lamA, w.uA, 0, 0)
        # the solution: the piece at t = 1 (phase 1) or s = 0 (phase 2)
        t_end = 0.0 if (phase2 or T == 0) else 1.0
        for j in range(n * S):
            x = w.uA[j] + t_end * w.uB[j] if w.inP[j] else 0.0
            if x < -LOOSE:
                return FACET_DECLINED
            u[j] = x if x > 0.0 else 0.0
        if T > 0:
            memset(v, 0, T * S * S * sizeof(double))
            for i in range(T):
                for k in range(w.na[i]):
                    x = w.flA[i * w.cap + k] + t_end * w.flB[i * w.cap + k]
                    if x < -LOOSE:
                        return FACET_DECLINED
                    v[(i * S + w.arc_a[i * w.cap + k]) * S + w.arc_b[i * w.cap + k]] = (
                        x if x > 0.0 else 0.0)
        # the certificate: the marginalisation residuals (residuals[0]) and the Wolfe
        # gap (residuals[1]; one Viterbi call), independent of the structure
        res_p = 0.0
        for i in range(n):
            x = -1.0
            for a in range(S):
                x += u[i * S + a]
            res_p = max(res_p, fabs(x))
        for i in range(T):
            for a in range(S):
                x = -u[i * S + a]
                lin = -u[(i + 1) * S + a]
                for b in range(S):
                    x += v[(i * S + a) * S + b]
                    lin += v[(i * S + b) * S + a]
                res_p = max(res_p, max(fabs(x), fabs(lin)))
        usq = lin = lin_abs = 0.0
        for j in range(n * S):
            w.adjs[j] = eta_u[j] - u[j]
            if u[j] > 0.0:
                usq += u[j] * u[j]
                lin += w.adjs[j] * u[j]
                lin_abs += fabs(eta_u[j]) * u[j]
        for j in range(T * S * S):
            if v[j] > 0.0:
                lin += eta_v[j] * v[j]
                lin_abs += fabs(eta_v[j]) * v[j]
        if self.factor.c_map(w.adjs, eta_v if T > 0 else NULL, w.tags, w.work):
            return FACET_DECLINED
        self.factor.c_score(w.tags, w.adjs, eta_v if T > 0 else NULL, &best)
        gap = best - lin
        residuals[0] = res_p
        residuals[1] = gap if gap > 0.0 else 0.0
        if res_p > 1e-12 or gap > GAP_TOL * max(1.0, lin_abs + usq):
            return FACET_DECLINED
        _save(w, st)
        return FACET_SOLVED

    cdef int c_apply(self, const FacetState* st, const double* in_u, const double* in_v,
                     double* out_u, double* out_v, bint transpose) except -1 nogil:
        cdef int n = self.n, S = self.S, T = n - 1, i, j, x, e, y, L
        cdef _W w
        cdef double* tv
        cdef SequenceHeader h
        state_check_header(st, HEADER)
        memcpy(&h, st.ints, sizeof(SequenceHeader))
        if h.n != n or h.S != S:
            with gil:
                raise ValueError("the state does not belong to this solver's factor")
        _alloc(&w, n, S, 0)
        try:
            if _load(&w, st):
                with gil:
                    raise ValueError("the state does not describe a valid structure")
            L = w.L
            # y = d_u + L d_v on the supports (jvp), or d_u (vjp)
            memset(w.zA, 0, n * S * sizeof(double))
            if not transpose and in_v != NULL:
                for i in range(T):
                    _pots(&w, i, in_v + i * S * S, w.F0, w.G0)
            for j in range(n * S):
                if w.inP[j]:
                    w.zA[j] = in_u[j]
                    if not transpose and in_v != NULL:
                        i = j // S
                        w.zA[j] += (w.F0[j] if i < T else 0.0) + (w.G0[j] if i > 0 else 0.0)
            _project_range(&w, w.zA, 0.0, w.lamA, out_u, 0, n - 1)
            if transpose and out_v != NULL and T > 0:
                # J_v^T g = L^T (J g): per arc, the alternating sum of J g over the
                # subtree below it
                memset(out_v, 0, T * S * S * sizeof(double))
                tv = w.pot2
                for i in range(T):
                    for j in range(w.nord[i]):
                        x = w.order[i * L + j]
                        tv[x] = out_u[i * S + x] if x < S else out_u[(i + 1) * S + x - S]
                    for j in range(w.nord[i] - 1, -1, -1):
                        x = w.order[i * L + j]
                        e = w.par[i * L + x]
                        if e < 0:
                            continue
                        out_v[(i * S + w.arc_a[i * w.cap + e]) * S + w.arc_b[i * w.cap + e]] = tv[x]
                        y = (S + w.arc_b[i * w.cap + e]) if x < S else w.arc_a[i * w.cap + e]
                        tv[y] -= tv[x]
        finally:
            _free(&w)
        return 0

    def decompose(self, u, v=None):
        """A convex combination of tag sequences equal to ``(u, v)``.

        ``v`` is a unit flow through the trellis (position by position, tag to
        tag), so a path decomposition of it gives the sequences: repeatedly the
        path of largest bottleneck through the positive entries (a max-min
        Viterbi), with that bottleneck as its weight, subtracted until nothing is
        left. Each path empties at least one entry, so there are at most as many
        sequences as positive entries of ``v`` (of ``u`` when ``n == 1``).

        Parameters
        ----------
        u : array_like, shape (n, S)
        v : array_like, shape (n - 1, S, S)
            A point of the chain's local polytope (a solution's ``u`` and ``v``).

        Returns
        -------
        structures : ndarray of intc, shape (k, n)
        weights : ndarray of float64, shape (k,)
            Positive, summing to one, with ``sum_s w_s m_s = u`` and
            ``sum_s w_s n_s = v`` up to round-off.
        """
        cdef int n = self.n, S = self.S, T = n - 1
        uu = np.ascontiguousarray(u, dtype=np.float64).reshape(-1)
        if uu.shape[0] != n * S:
            raise ValueError(f"u: expected shape {(n, S)}, got {np.shape(u)}")
        if T > 0:
            if v is None:
                raise ValueError("v: expected shape "
                                 f"{(n - 1, S, S)}, got None (u alone does not fix the sequences)")
            vv = np.array(v, dtype=np.float64).reshape(-1)
            if vv.shape[0] != T * S * S:
                raise ValueError(f"v: expected shape {(n - 1, S, S)}, got {np.shape(v)}")
        else:
            vv = np.zeros(0)
        if not (np.all(np.isfinite(uu)) and np.all(np.isfinite(vv))):
            raise ValueError("u, v: expected finite values")
        res_u = np.where(uu > 0.0, uu, 0.0)
        res_v = np.where(vv > 0.0, vv, 0.0)
        cdef double[::1] ru = res_u, rv = res_v
        cdef double[::1] width = np.zeros(n * S)
        cdef int[::1] bk = np.zeros(n * S, dtype=np.intc)
        cdef int[::1] path = np.zeros(n, dtype=np.intc)
        cdef int i, a, b, arg, k
        cdef Py_ssize_t q
        cdef double wb, x, total = 0.0
        structures, weights = [], []
        cdef int limit = n * S + T * S * S + 1
        for k in range(limit):
            # widest path: width[i, b] = max_a min(width[i-1, a], v[i-1, a, b])
            for a in range(S):
                width[a] = ru[a] if T == 0 else 0.0
                if T > 0:
                    x = 0.0
                    for b in range(S):
                        x += rv[a * S + b]
                    width[a] = x
            for i in range(1, n):
                for b in range(S):
                    wb = 0.0
                    arg = -1
                    for a in range(S):
                        x = min(width[(i - 1) * S + a], rv[((i - 1) * S + a) * S + b])
                        if x > wb:
                            wb = x
                            arg = a
                    width[i * S + b] = wb
                    bk[i * S + b] = arg
            arg = -1
            wb = 0.0
            for b in range(S):
                if width[(n - 1) * S + b] > wb:
                    wb = width[(n - 1) * S + b]
                    arg = b
            if arg < 0 or wb <= 1e-15 * max(1.0, total):
                break
            path[n - 1] = arg
            for i in range(n - 1, 0, -1):
                path[i - 1] = bk[i * S + path[i]]
            for i in range(T):
                q = (i * S + path[i]) * S + path[i + 1]
                rv[q] = rv[q] - wb if rv[q] - wb > 0.0 else 0.0
            if T == 0:
                ru[path[0]] = 0.0
            structures.append(np.array(path, dtype=np.intc))
            weights.append(wb)
            total += wb
        if not structures:
            raise ValueError("u, v: no positive flow to decompose")
        weights = np.array(weights)
        return np.array(structures, dtype=np.intc).reshape(-1, n), weights / weights.sum()
