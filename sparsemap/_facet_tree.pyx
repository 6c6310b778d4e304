"""The facet side for non-projective dependency trees: SparseMAP as a projection
onto the arborescence polytope, held by its tight constraints.

The problem
-----------
For a :class:`~sparsemap.TreeFactor` with ``projective=False``, ``u`` is the
Euclidean projection of the arc scores ``eta[h, m]`` (``h`` in ``0..n``, ``h != m``,
``m`` in ``1..n``) onto the arborescence polytope::

    x >= 0,   sum_h x[h, m] = 1 for every word m,
    C_S x = sum_{h not in S, m in S} x[h, m] >= 1   for every nonempty set S of words,

plus ``sum_m x[0, m] = 1`` with ``single_root=True`` (the row of the set of all
words, as an equality). Arcs scored ``-inf`` are fixed at 0 (left out of every
coordinate and every sum).

Algorithm
---------
*Dual.* With multipliers ``mu_S >= 0`` on a set of cuts (and a free one on the
root equality), ``x(mu)`` is the column-wise sparsemax of ``z = eta + C^T mu``:
each word's incoming arcs are an independent simplex projection. The dual
``D(mu) = sum_S mu_S - sum_m (tau_m + |x_m|^2 / 2)`` (``tau_m`` the column's
threshold) is concave and piecewise quadratic, with gradient ``g = 1 - C x`` and
generalised Hessian ``-H``, ``H = C J C^T`` (``J`` centres each column on its
support). It is maximised by a projected semismooth Newton method on the few
cut multipliers: the bound set holds the cuts at ``mu = 0`` whose gradient
points outwards, the step solves ``(H_FF + rho I) d = g_F`` with ``rho``
proportional to ``|g|`` (so the last steps are exact Newton steps), and an
Armijo search on ``D`` globalises it. Each evaluation is ``n`` simplex
projections, each a Newton iteration on the column's threshold warm-started
from the previous one (two or three passes over the column); all cut sums and
``H`` come out of the same pass, from each node's bit mask of the cuts that
hold it (``W`` 64-bit words per node for ``64 W`` cuts: the masks and the
cut arrays double in place when a cut finds them full, so there is no cap on
the number of cuts). Arcs from a node that no cut holds enter exactly the
cuts of their modifier and are summed once per column. When the cuts with
``mu != 0`` are nested (a chain, as at head-biased scores), ``z`` comes from
node potentials instead: with ``P[v]`` the sum of their ``mu`` over those
that hold ``v`` and ``d[v]`` their number, ``z[h, m] = eta[h, m] + P[m] - P[h]``
when ``d[h] < d[m]``, else ``eta[h, m]`` (``O(1)`` per arc whatever the number
of cuts; ``_chain_potentials``).

*Exact finish.* On the pieces where the supports and the active cuts do not
change, ``D`` is quadratic and the Newton step lands on its maximum: the point
where ``|g_F|`` falls to round-off (``n`` units in the last place, or a full
step on an unchanged piece no longer halves it) is the solution of the linear
KKT system of its supports and active cuts. The iteration stops there, never
at a looser tolerance.

*Cutting planes.* The cut set starts with the root cut (the set of all words,
the one that is tight at flat scores). After each dual solve, the most
violated cuts are separated exactly by a minimum root cut (the minimum over
nonempty word sets ``S`` of ``x(delta^-(S))``) in the digraph weighted by ``x``,
computed by Hao and Orlin's (1994) algorithm: one push-relabel run over all
sinks, whose sink-side sets give the cut of every sink at once (``O(n^3)``
in the worst case; on these dense graphs each node's admissible arcs are
found through per-label lists of nodes, see ``_hao_orlin``). Up to eight
violated sets found by the run are added, each first

- replaced by its core, without the words that head no arc of positive
  ``x``, when another set of the run has the same core (leaving such words
  out does not raise the cut's value; at head-biased scores, where every
  word wants the same few heads, one run returns many sets that differ in
  them only, and they were most of the cuts held), and
- uncrossed with the tight cuts held (``_uncross``: replaced by its
  intersection or union with a crossing one, whichever is more violated;
  the cut function is submodular, so that one is violated at least as much),
  which keeps the tight family laminar, as in Edmonds' algorithm.

Then the violated sets along a chain are added (``_chain_cuts``): from a
start set, words are added one at a time, each time the one that lowers the
cut the most, up to all words, and removed the same way down to one word
(``O(n^2)`` for the chain, the cut updated in ``O(1)`` per step), and the
chain's local minima of the cut that are violated are offered as above. When
the cuts with ``mu != 0`` are nested, the chain starts at the deepest one
and grows ring by ring (the words of each held set before those outside it),
so that each set it adds lies between two consecutive held cuts; otherwise,
or when that adds nothing, it runs through the run's most violated set. At
head-biased scores the optimum's tight cuts are such a chain (tens of
nested sets, nearly every prefix of the words ordered by how much they head
past the first twenty or so) and each new cut fills a gap between two held
ones: a separation that added the run's one or two most violated sets took
one round per cut, the chain fills several gaps per round.

Cuts with ``mu = 0`` are dropped after an exact dual solve, and the dual is
solved again, warm-started. After two rounds the dual is solved loosely
between separations (to ``|g|`` at most 0.2 times the violation just found);
the solve before the separation that certifies ``x`` is exact.

*Termination.* There is no cap on rounds or cuts. Between two exact dual
solves cuts are only added, each a set not held, so those runs are finite;
from one exact solve to the next the held cuts' dual optimum strictly rises
(the new family holds a cut the previous optimum violates, and the cuts
dropped had ``mu = 0``), so no family of held cuts comes back and there are
finitely many exact solves. Only the budget of projection passes (the
caller's ``max_iter``) ends a solve early. The chain separation keeps this:
it adds only violated sets not held. Each cut held costs, per projection
pass, ``O(1)`` per arc it enters in ``H`` and, unless the cuts in use are
nested, in ``z`` (a row of ``n + 1`` per word it holds, for words in more
than four cuts), and a row and column of the dense ``H`` (``O(k^3)`` per
Newton step for ``k`` cuts); at head-biased scores (a per-head offset, like a
parser's at initialisation: ``head_sd`` 0.08 or 0.3) 100 to 150 words took
10 to 48 rounds, 57 to 72 projection passes (median over seeds) and held 20
to 48 cuts at the end; before the chain separation, 25 to 116 rounds and 84
to 180 passes (``benchmarks/bench_tree_headbias.py``, docs/benchmarks.rst).

*Certificate.* At return, the residuals are recomputed from the final ``x``
and ``mu`` with fresh sums: the primal one is the largest of
``|sum_h x[h, m] - 1|``, ``|C_S x - 1|`` over the cuts with ``mu_S > 0`` (and the
root equality) and ``1 - min_S C_S x`` (the final minimum root cut); the dual
one is the largest of the threshold conditions (``|x - (z - tau)|`` on each
support with ``tau`` recomputed from it, ``(z - tau)_+`` off it). The solver
declines (``FACET_DECLINED``; the caller takes the vertex side) when either
exceeds ``1e-12 (1 + max |mu|)`` (on the supports, ``z`` is of the size of
the multipliers once each column is shifted to its maximum 0; the held cuts'
rows may reach the dual solve's own round-off floor, ``1e3 (n + 1)`` units in
the last place, which tens of nearly dependent tight cuts can put above
``1e-12``), when the budget of projection passes (``n_iter``) is spent, when
a word has no allowed head or no tree avoids the forbidden arcs (the vertex
side raises the ``ValueError``), or when scores are not finite where they are
read.

*Peaked scores.* At peaked scores many cuts are tight and the vertex side
(a few trees) is cheaper. Before anything else (one read of the scores, no
allocation), the solver counts the words whose column sparsemax has a single
head (the best allowed head beats the second by at least 1), leaving out those
whose head the masks force, and declines at once when they are at least
``PEAKED_A + PEAKED_B n`` of the ``n`` words (also leaving the forced out):
0.34 at 20 words, 0.44 at 60, 0.59 at 120. The constants are fitted to the
measured crossover with the vertex side (``benchmarks/bench_facet.py --fit
tree``: ``sm.solve`` + ``vjp`` on each side, 20 to 120 words, both root
settings, ``eta = scale * randn`` with scale 0.01 to 10): about scale 2-3 at 20
words, 3-5 from 40 on. Below it the facet side is faster (at scale 1, 2x at
20 words to 15x at 120; at flat scores 100-5000x).
``decline_peaked=False`` solves every problem.

Backward pass
-------------
Where ``u`` is differentiable its Jacobian (in ``eta``, on the allowed arcs)
is the orthogonal projection, within the positive coordinates ``P``, onto the
null space of every constraint tight at ``u``, restricted to ``P``: the word
rows (one per column: centring on the column's support), with
``single_root`` the root equality, and every tight cut, its multiplier zero or
not (docs/solvers.rst, "Derivatives at ties and kinks", proves that this is
the derivative wherever ``u`` is differentiable and an element of the
generalised Jacobian everywhere else). With ``B`` those cut rows and ``Pc``
the per-column centring on ``P``::

    J = Pc - Pc B^T (B Pc B^T)^{-1} B Pc,     0 outside P.

The tight cuts: those the dual holds with ``mu > 0``; the set of all words
(the root's arcs) whenever its arcs sum to 1 within the solver's tolerance,
which at zero and tied scores it does with ``mu = 0``; and every other tight
cut whose row the rows held do not span, found by a search (``_search_rows``).
The tight sets form an intersecting family (two tight sets that meet have a
tight intersection and union, and on ``P`` their rows add up as those do), so
a tight cut outside the held rows' span moves along a random direction ``d``
of their null space, and the minimum root cut of ``x + t d`` or ``x - t d``
(the separation's Hao-Orlin run) returns it; it is added when its row is
independent of those held (Gram-Schmidt on ``P``), ``d`` is drawn again in the
smaller null space, and the search stops when neither sign returns a cut (two
Hao-Orlin runs when nothing is missing). The search runs for trees of at most
10 words (where it costs what the enumeration of all word sets it replaces
did), at ties (two arcs into one word with equal positive ``x``, as zero,
integer or repeated scores give; found in the pass that cleans the support)
and when the set of all words is tight with ``mu = 0``. Elsewhere it would
double the backward's share of a flat solve (its two runs cost as much as the
rest of the solve at 60 to 120 words), and a tight cut with ``mu = 0``
outside the held span needs the scores on one of finitely many hyperplanes
without a tie (docs/solvers.rst says what the matrix is there).

``B Pc B^T`` is summed from the supports (the dual's ``H`` on the active cuts
when no cut was added); its Cholesky factor is kept (rows whose pivot
vanishes are dependent on earlier ones and are dropped: they do not change
the null space). ``J`` is symmetric, so the jvp and the vjp are the same
map: ``O(|P| + |P| c)`` with ``c`` the number of active cuts an arc enters, no
cap on size.

Costs
-----
At flat scores (scale 0.01-0.3) one dual solve with the root cut (three to
five projection passes, each ``O(n^2)``) and one Hao-Orlin run certify the
answer; the backward pass is ``O(n^2)``. Measured (solve + vjp, one thread):
0.05 ms at 20 words, 0.5 ms at 60, 1.5-2.5 ms at 120, between 0.1 and 2 times
a CRF's forward and backward pass (the matrix-tree theorem in torch float64);
peaked scores need more cuts and rounds (5-15 cuts and 20-80 passes at scale
3-10). At ties the tight-cut search adds two or more Hao-Orlin runs (at zero
scores, solve + vjp took 1.5 times as long as without it at 20 words and about
2 times at 60 and 120; ``benchmarks/bench_tree_ties.py``, docs/benchmarks.rst).
``decompose`` is the vertex side's cost (see its docstring).
"""
import numpy as np

from libc.math cimport INFINITY, fabs, isfinite, sqrt
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcmp, memcpy, memset

from sparsemap._facet cimport (FACET_DECLINED, FACET_SOLVED, FacetSolver, FacetState,
                               state_check_header, state_check_sizes, state_resize, top2)
from sparsemap._factors._base cimport Factor

ctypedef unsigned long long u64

cdef extern from *:
    """
    /* Index of the lowest set bit of a nonzero 64-bit mask. */
    static int sm_ctz64(unsigned long long b) {
    #if defined(__GNUC__) || defined(__clang__)
        return __builtin_ctzll(b);
    #else
        int i = 0;
        while (!(b & 1ULL)) { b >>= 1; i++; }
        return i;
    #endif
    }

    /* v when a is 1, +0 when a is 0, by a bit mask (no branch, and -inf * 0 would be
       nan). */
    static inline double sm_keep(double v, int a) {
        unsigned long long bits;
        memcpy(&bits, &v, 8);
        bits &= -(unsigned long long) a;
        memcpy(&v, &bits, 8);
        return v;
    }

    /* Sum and count of the entries of z[:n] above t, without branches (at flat
       scores each comparison is a coin flip, and a mispredicted jump per entry
       was most of a projection's time); -inf entries add +0. */
    static double sm_sum_above(const double* z, int n, double t, int* count) {
        double s0 = 0.0, s1 = 0.0, v;
        int h, c = 0, a;
        for (h = 0; h < n; h++) {
            v = z[h];
            a = v > t;
            c += a;
            if (h & 1) s1 += sm_keep(v, a); else s0 += sm_keep(v, a);
        }
        *count = c;
        return s0 + s1;
    }

    /* Sum, count and maximum of the finite entries of z[:n] (-inf add +0). */
    static double sm_sum_max(const double* z, int n, int* count, double* zmax) {
        double s0 = 0.0, s1 = 0.0, v, mx = -INFINITY;
        int h, c = 0, a;
        for (h = 0; h < n; h++) {
            v = z[h];
            mx = v > mx ? v : mx;
            a = v > -INFINITY;
            c += a;
            if (h & 1) s1 += sm_keep(v, a); else s0 += sm_keep(v, a);
        }
        *count = c;
        *zmax = mx;
        return s0 + s1;
    }

    /* x = (z - t)_+ with its support flags sp (counting the flags that change
       into *changes), |x|^2 into *sq; returns the support's size. */
    static int sm_clip(const double* z, int n, double t, double* x, char* sp,
                       long long* changes, double* sq) {
        double xs, q = 0.0;
        int h, c = 0, a;
        long long ch = 0;
        for (h = 0; h < n; h++) {
            xs = z[h] - t;
            a = xs > 0.0;
            ch += a != sp[h];
            sp[h] = (char) a;
            xs = sm_keep(xs, a);
            x[h] = xs;
            q += xs * xs;
            c += a;
        }
        *changes += ch;
        *sq = q;
        return c;
    }
    """
    int sm_ctz64(u64 b) noexcept nogil
    double sm_keep(double v, int a) noexcept nogil
    double sm_sum_above(const double* z, int n, double t, int* count) noexcept nogil
    int sm_clip(const double* z, int n, double t, double* x, char* sp, long long* changes,
                double* sq) noexcept nogil
    double sm_sum_max(const double* z, int n, int* count, double* zmax) noexcept nogil


cdef enum:
    CUTS0 = 16             # room for cuts at first (it doubles when full, with no cap;
                           # small, so that the block stays below malloc's mmap threshold)
    MAX_FOUND = 8          # violated sets taken from one separation run
    MAX_BACKTRACK = 40     # Armijo halvings before declining
    # c_solve's return codes besides FACET_SOLVED / FACET_DECLINED (internal)
    SEP_FAILED = -2


# The dual solves between separation rounds, from round LOOSE_AFTER + 1 on, stop at
# |g| <= LOOSE times the violation the last separation found (see _solve). On
# head-biased scores, which take tens of rounds, that saves passes; the first rounds
# are solved exactly, since a loose solve that separates nothing costs an exact solve
# and one more separation, and most i.i.d. problems need at most three rounds.
# (Head-biased scores at 100 and 150 words: 0.2 took a quarter fewer passes than
# 0.5, and 0.02 to 0.1 or 0.9 no fewer than 0.2; loose solves from round 1 cost
# i.i.d. problems at scale 1 up to 20% more, from round 3 within noise.)
cdef double LOOSE = 0.2
cdef int LOOSE_AFTER = 2
# A column whose word is in more than AXPY_FROM cuts gets z row by row over its
# cuts (see _project); below, by a bit loop per arc.
cdef int AXPY_FROM = 4

# Peaked scores (see the module docstring): decline when at least
# PEAKED_A + PEAKED_B n of the n words (those whose head the masks force left
# out) have a single head in the column-wise sparsemax of the scores. Fitted to the
# measured crossover with the vertex side (benchmarks/bench_facet.py --fit tree):
# 0.34 at 20 words, 0.44 at 60, 0.59 at 120.
cdef double PEAKED_A = 0.29
cdef double PEAKED_B = 0.0025


cdef int _single_heads(const double* eta, int N, int* forced) noexcept nogil:
    """The words (columns m = 1..N-1 of the row-major N x N eta) whose column
    sparsemax has a single head: the best allowed head beats the second by at
    least 1 (or is the only one). Those with one allowed head (the masks force
    it) are counted in both, and also into forced[0]. One read of each score,
    no allocation: the peaked-score test runs before anything else."""
    cdef int m, c = 0, f = 0
    cdef double b1, b2
    for m in range(1, N):
        b1 = -INFINITY
        b2 = -INFINITY
        top2(eta + m, m, N, &b1, &b2)                           # heads 0..m-1
        top2(eta + (m + 1) * N + m, N - m - 1, N, &b1, &b2)     # heads m+1..N-1
        # b1 - b2: +inf when forced, nan when no head is allowed (not counted)
        c += b1 - b2 >= 1.0
        f += b2 == -INFINITY and b1 > -INFINITY
    forced[0] = f
    return c


def single_head_count(eta):
    """The number of words whose column sparsemax has a single head, and how many
    of them have one allowed head only (tests: the peaked-score test's count).

    Parameters
    ----------
    eta : array_like, shape (n + 1, n + 1)
        Arc scores ``eta[h, m]`` (``-inf``: not allowed; the diagonal and column
        0 are ignored).

    Returns
    -------
    single, forced : int
    """
    cdef const double[:, ::1] e = np.ascontiguousarray(eta, dtype=np.float64)
    cdef int forced = 0, c
    if e.shape[0] != e.shape[1] or e.shape[0] < 2:
        raise ValueError(f"eta: expected a square array of side at least 2, got shape "
                         f"{tuple(np.shape(eta))}")
    c = _single_heads(&e[0, 0], <int> e.shape[0], &forced)
    return c, forced


cdef struct Flow:
    # Hao-Orlin's scratch (see _hao_orlin); carved by _flow_carve
    int N
    double* R                    # N x N residual capacities, R[i*N + j] for arc i -> j
    double* e                    # excesses
    double* found_val            # MAX_FOUND
    int* where                   # -1: source side, 0: awake, > 0: dormant set id
    int* lab                     # distance labels
    int* cnt                     # awake nodes per label (2N + 2)
    int* lhead                   # awake nodes by label: doubly linked lists (2N + 2 heads)
    int* lnext
    int* lprev
    int* bhead                   # active awake nodes by label: singly linked (2N + 2 heads)
    int* bnext
    char* inb                    # in an active list (possibly stale: checked when popped)
    char* found                  # (MAX_FOUND + 1) x N: violated sink-side sets, then the best set
    int n_found


cdef struct Work:
    int N, n, k                  # nodes (words + root), words, cuts held
    int cap, W                   # room for cuts, u64 words per mask (cap / 64 rounded up)
    bint single_root
    double* ET                   # N x N: ET[m*N + h] = eta[h, m] - max of column m; -inf when not allowed
    double* XT                   # N x N: XT[m*N + h] = x[h, m]
    double* tau                  # N: column thresholds
    double* zb                   # N: one column of z
    char* supp                   # N x N: x > 0
    # The cuts, in a block of their own that _grow_cuts doubles when full:
    u64* inmask                  # N x W: bit i of node m's W words set iff word m is in cut i (root: 0)
    u64* freebits                # W: cuts without a sign constraint (the root equality)
    double* mu                   # cap
    double* g                    # cap: 1 - C x
    double* cx                   # cap: C x
    double* H                    # k x k (room for cap x cap), row-major
    # scratch of the projection and the Newton step (cap each, HF cap x cap)
    double* HF
    double* diag0
    double* dstep
    double* mu0
    double* acol
    int* fidx
    int* lst
    int* lcol                    # the cuts of one column's word
    double* arow                 # cap x N: arow[i*N + v] = 1.0 if node v is in cut i, else 0.0
    char* kept
    char* cutmem                 # the block above (freed by the caller)
    double dual                  # D(mu) (without its constant)
    Py_ssize_t changes           # support entries that changed in the last projection
    int rounds                   # separation rounds run
    bint exact                   # the last dual solve reached its round-off floor
    Flow F                       # the separation's scratch
    int* iscratch                # 2N ints
    char* cscratch               # N chars
    char* nocut                  # N: no cut holds the node
    char* cores                  # MAX_FOUND x N
    bint is_chain
    char* chain                  # 4 N: the chain separation's set, a copy, two starts (_chain_cuts)


cdef inline int _cuts_of(const u64* bm, const u64* bh, int W, int* lst) noexcept nogil:
    """The cuts an arc h -> m enters (m in the cut, h not), bm and bh the two nodes'
    masks, into lst in increasing order; returns their number."""
    cdef int q, c = 0
    cdef u64 b
    for q in range(W):
        b = bm[q] & ~bh[q]
        while b:
            lst[c] = (q << 6) + sm_ctz64(b)
            c += 1
            b &= b - 1
    return c


cdef inline double _mu_sum(const u64* bm, const u64* bh, int W, const double* mu) noexcept nogil:
    """The sum of mu over the cuts an arc h -> m enters."""
    cdef int q
    cdef u64 b
    cdef double s = 0.0
    for q in range(W):
        b = bm[q] & ~bh[q]
        while b:
            s += mu[(q << 6) + sm_ctz64(b)]
            b &= b - 1
    return s


cdef inline void _axpy(double a, const double* xv, double* y, int n) noexcept nogil:
    cdef int j
    for j in range(n):
        y[j] += a * xv[j]


cdef inline bint _any(const u64* bm, int W) noexcept nogil:
    cdef int q
    for q in range(W):
        if bm[q]:
            return True
    return False


cdef inline bint _bit(const u64* bm, int i) noexcept nogil:
    return (bm[i >> 6] >> (i & 63)) & 1


cdef int _grow_cuts(Work* w, int cap) except -1 nogil:
    """Room for cap cuts: a new block, the masks, freebits and mu
    copied over (H and the scratch are rewritten before they are read)."""
    cdef int N = w.N, W = (cap + 63) >> 6, m, q
    cdef Py_ssize_t cc = <Py_ssize_t> cap * cap
    cdef Py_ssize_t nbytes = ((8 * cap + 2 * cc + <Py_ssize_t> cap * N) * sizeof(double)
                              + (N + 1) * W * sizeof(u64)
                              + 3 * cap * sizeof(int) + cap + 64)
    cdef char* mem = <char*> malloc(nbytes)
    cdef double* d
    cdef u64* im
    if mem == NULL:
        with gil:
            raise MemoryError()
    im = <u64*> mem
    for m in range(N + 1):
        for q in range(W):
            im[m * W + q] = 0
    d = <double*> (im + (N + 1) * W)
    if w.cutmem != NULL:
        for m in range(N + 1):
            for q in range(w.W):
                im[m * W + q] = w.inmask[m * w.W + q]   # freebits are row N
        memcpy(d, w.mu, w.k * sizeof(double))
        memcpy(d + 8 * cap + 2 * cc, w.arow, <Py_ssize_t> w.k * N * sizeof(double))
        free(w.cutmem)
    w.cutmem = mem
    w.inmask = im
    w.freebits = im + N * W
    w.mu = d
    w.g = d + cap
    w.cx = d + 2 * cap
    w.diag0 = d + 3 * cap
    w.dstep = d + 4 * cap
    w.mu0 = d + 5 * cap
    w.acol = d + 6 * cap
    w.H = d + 8 * cap
    w.HF = w.H + cc
    w.arow = w.HF + cc
    w.fidx = <int*> (w.arow + <Py_ssize_t> cap * N)
    w.lst = w.fidx + cap
    w.lcol = w.lst + cap
    w.kept = <char*> (w.lcol + cap)
    w.cap = cap
    w.W = W
    return 0


# ---------------------------------------------------------------------------
# Column projections
# ---------------------------------------------------------------------------
cdef inline double _threshold(const double* z, int N, double tau0) noexcept nogil:
    """The sparsemax threshold of z[:N] (entries -inf are left out): the root of
    f(t) = sum (z - t)_+ - 1 by Newton's method from tau0, or (tau0 = -inf) from
    the larger of two points below the root: the mean of all entries less 1/count
    (Michelot's start) and max - 1. f is convex and decreasing, so after the first
    step every iterate is below the root and the support shrinks monotonically;
    the iteration stops when it no longer changes, and the last threshold is then
    computed from the exact support."""
    cdef double s, t = tau0, zmax
    cdef int c, c_prev = -1, it
    if t == -INFINITY:
        s = sm_sum_max(z, N, &c, &zmax)
        t = (s - 1.0) / c
        if zmax - 1.0 > t:
            t = zmax - 1.0
    for it in range(N + 3):
        s = sm_sum_above(z, N, t, &c)
        if c == 0:
            # started above every entry: max - 1 is below the root
            sm_sum_max(z, N, &c, &zmax)
            t = zmax - 1.0
            c_prev = -1
            continue
        if c == c_prev:
            return (s - 1.0) / c
        c_prev = c
        t = (s - 1.0) / c
    return t


cdef bint _chain_potentials(Work* w, double* P, int* d) noexcept nogil:
    """When the cuts with mu != 0 form a chain (each holds the next), the
    potentials P[v] (the sum of their mu over those that hold node v) and depths
    d[v] (how many hold v), and True: then the cuts an arc h -> m enters are the
    ones that hold m but not the deeper of the two, and its z is
    eta[h, m] + P[m] - P[h] when d[h] < d[m], eta[h, m] otherwise, O(1) per arc
    instead of O(1) per cut held by m. At head-biased scores the tight cuts are a
    chain of tens of sets, most words are in most of them, and the sum over the
    cuts was most of a pass. False (P, d undefined) otherwise."""
    cdef int N = w.N, k = w.k, i, j, m, nc = 0, t, s0
    cdef int* order = w.lst       # (_project's per-arc scratch, free before its loop)
    cdef int* size = w.lcol
    cdef const double* a
    cdef const double* b
    for i in range(k):
        if w.mu[i] != 0.0:
            s0 = 0
            a = w.arow + <Py_ssize_t> i * N
            for m in range(1, N):
                s0 += a[m] != 0.0
            # insertion by size, largest first
            j = nc
            while j > 0 and size[j - 1] < s0:
                order[j] = order[j - 1]
                size[j] = size[j - 1]
                j -= 1
            order[j] = i
            size[j] = s0
            nc += 1
    for m in range(N):
        P[m] = 0.0
        d[m] = 0
    for j in range(nc):
        a = w.arow + <Py_ssize_t> order[j] * N
        if j > 0:
            b = w.arow + <Py_ssize_t> order[j - 1] * N
            for m in range(1, N):
                if a[m] > b[m]:
                    return False
        for m in range(1, N):
            t = a[m] != 0.0
            d[m] += t
            P[m] += sm_keep(w.mu[order[j]], t)
    return True


cdef void _project(Work* w) noexcept nogil:
    """x = column-wise sparsemax of eta + C^T mu; also tau, the support, C x,
    g = 1 - C x, H = C J C^T (all k cuts) and the dual value.

    An arc from a node in no cut (the root, and every word that no cut holds)
    enters exactly the cuts of its modifier m: those arcs share one sum of mu
    and one block of H per column, computed once (the tight cuts hold the few
    words that heads favour, so most nodes are in no cut)."""
    cdef int N = w.N, k = w.k, W = w.W, m, h, i, ii, jj, cm, nl, na, n0
    cdef double* z = w.zb
    cdef const double* e
    cdef double* x
    cdef char* sp
    cdef double* a = w.acol
    cdef double* H = w.H
    cdef int* lst = w.lst
    cdef int* lm = w.lcol
    cdef char* free_node = w.nocut
    cdef double t, sq, dual = 0.0, xh, mm, x0
    cdef const u64* bm
    cdef u64 b, b0
    cdef bint has
    cdef long long changes = 0
    cdef double* P = w.zb + 2 * N
    cdef int* d = w.iscratch
    cdef bint chain = k > 0 and _chain_potentials(w, P, d)
    cdef double pm
    cdef int dm
    w.is_chain = chain
    for i in range(k * k):
        H[i] = 0.0
    for i in range(k):
        w.cx[i] = 0.0
        a[i] = 0.0
    for h in range(N):
        free_node[h] = not _any(w.inmask + h * W, W)
    for m in range(1, N):
        e = w.ET + m * N
        x = w.XT + m * N
        sp = w.supp + m * N
        bm = w.inmask + m * W
        has = not free_node[m]
        if not has:
            memcpy(z, e, N * sizeof(double))
        else:
            na = 0
            for i in range(k):
                if _bit(bm, i):
                    lm[na] = i
                    na += 1
            # z[h] = e[h] + the mu of the cuts holding m but not h: all of m's
            # cuts, less those holding h too, row by row (contiguous and
            # branch-free; a bit loop per arc was most of a pass's time)
            if chain:
                pm = P[m]
                dm = d[m]
                for h in range(N):
                    z[h] = e[h] + sm_keep(pm - P[h], d[h] < dm)
            elif na <= AXPY_FROM and W == 1:
                # one word per mask (at most 64 cuts, the usual case): main's loop
                b0 = bm[0]
                for h in range(N):
                    b = b0 & ~w.inmask[h]
                    xh = e[h]
                    while b:
                        xh += w.mu[sm_ctz64(b)]
                        b &= b - 1
                    z[h] = xh
            elif na <= AXPY_FROM:
                for h in range(N):
                    z[h] = e[h] + _mu_sum(bm, w.inmask + h * W, W, w.mu)
            else:
                mm = 0.0
                for ii in range(na):
                    mm += w.mu[lm[ii]]
                for h in range(N):
                    z[h] = e[h] + mm
                for ii in range(na):
                    _axpy(-w.mu[lm[ii]], w.arow + <Py_ssize_t> lm[ii] * N, z, N)
        t = _threshold(z, N, w.tau[m])
        w.tau[m] = t
        cm = sm_clip(z, N, t, x, sp, &changes, &sq)
        dual -= t + 0.5 * sq
        if not has or k == 0:
            continue
        n0 = 0
        x0 = 0.0
        for h in range(N):
            # the arcs that enter no cut first: at flat scores every word is in
            # the root cut, and that test is predictable where the support's is
            # a coin flip
            if W == 1 and (bm[0] & ~w.inmask[h]) == 0:
                continue
            if not sp[h]:
                continue
            if free_node[h]:
                n0 += 1
                x0 += x[h]
                continue
            if W == 1:
                nl = 0
                b = bm[0] & ~w.inmask[h]
                while b:
                    lst[nl] = sm_ctz64(b)
                    nl += 1
                    b &= b - 1
            else:
                nl = _cuts_of(bm, w.inmask + h * W, W, lst)
            xh = x[h]
            for ii in range(nl):
                i = lst[ii]
                w.cx[i] += xh
                a[i] += 1.0
                for jj in range(ii, nl):
                    H[i * k + lst[jj]] += 1.0
        # the arcs from free nodes, together: each enters every cut of m
        if n0 > 0:
            for ii in range(na):
                i = lm[ii]
                w.cx[i] += x0
                a[i] += n0
                for jj in range(ii, na):
                    H[i * k + lm[jj]] += n0
        # the column's centring: - a a^T / |P_m| (upper triangle, i <= j), over the
        # cuts that hold m; a is zeroed again for the next column
        for ii in range(na):
            i = lm[ii]
            if a[i] != 0.0:
                for jj in range(ii, na):
                    H[i * k + lm[jj]] -= a[i] * a[lm[jj]] / cm
        for ii in range(na):
            a[lm[ii]] = 0.0
    for i in range(k):
        w.g[i] = 1.0 - w.cx[i]
        dual += w.mu[i]
        for jj in range(i):
            H[i * k + jj] = H[jj * k + i]
    w.dual = dual
    w.changes = changes


cdef int _cholesky(double* A, int k, const double* diag0, char* kept) noexcept nogil:
    """In-place lower Cholesky factor of the k x k row-major A (its lower triangle
    is read). A row whose pivot falls to round-off of its diagonal diag0 depends
    on the earlier rows: it is dropped (its row of the factor zeroed, kept[i] = 0),
    which leaves their span, and so the null space, unchanged. Returns the number
    of rows kept."""
    cdef int i, j, l, nk = 0
    cdef double s
    for i in range(k):
        for j in range(i):
            if not kept[j]:
                A[i * k + j] = 0.0
                continue
            s = A[i * k + j]
            for l in range(j):
                s -= A[i * k + l] * A[j * k + l]
            A[i * k + j] = s / A[j * k + j]
        s = A[i * k + i]
        for l in range(i):
            s -= A[i * k + l] * A[i * k + l]
        if s <= 1e-10 * diag0[i] or s <= 0.0:
            kept[i] = 0
            for l in range(i + 1):
                A[i * k + l] = 0.0
        else:
            kept[i] = 1
            A[i * k + i] = sqrt(s)
            nk += 1
        for j in range(i + 1, k):
            A[i * k + j] = 0.0
    return nk


cdef void _chol_solve(const double* L, int k, const char* kept, double* b) noexcept nogil:
    """b <- A^{-1} b on the kept rows (0 on the dropped ones), L from _cholesky."""
    cdef int i, l
    cdef double s
    for i in range(k):
        if not kept[i]:
            b[i] = 0.0
            continue
        s = b[i]
        for l in range(i):
            s -= L[i * k + l] * b[l]
        b[i] = s / L[i * k + i]
    for i in range(k - 1, -1, -1):
        if not kept[i]:
            continue
        s = b[i]
        for l in range(i + 1, k):
            s -= L[l * k + i] * b[l]
        b[i] = s / L[i * k + i]


# ---------------------------------------------------------------------------
# The dual: projected semismooth Newton on the cut multipliers
# ---------------------------------------------------------------------------
cdef int _dual_solve(Work* w, Py_ssize_t budget, Py_ssize_t* n_iter, double tol_g,
                     double loose) noexcept nogil:
    """Maximise D over mu (mu_i >= 0 unless free) for the cuts held, from the
    current mu (w's projection must be current). Returns 0 when the gradient is
    at round-off, 1 when the budget is spent or the search fails."""
    cdef int k = w.k, i, j, nf, it, bt
    cdef int* F = w.fidx
    cdef double* HF = w.HF
    cdef double* diag0 = w.diag0
    cdef double* d = w.dstep
    cdef double* mu0 = w.mu0
    cdef char* kept = w.kept
    cdef double viol, gnorm, rho, hs, t = 0.0, d0, pred, slack, viol_prev = INFINITY
    cdef bint bound
    w.exact = True
    if k == 0:
        return 0
    while True:
        # free set: the equality, positive multipliers, violated cuts
        viol = 0.0
        nf = 0
        for i in range(k):
            bound = not _bit(w.freebits, i) and w.mu[i] <= 0.0 and w.g[i] <= 0.0
            if bound:
                continue
            F[nf] = i
            nf += 1
            if fabs(w.g[i]) > viol:
                viol = fabs(w.g[i])
        if viol <= tol_g:
            return 0
        if viol <= loose:
            w.exact = False
            return 0
        # a full Newton step on an unchanged piece that no longer halves the
        # gradient: it is at its round-off floor
        if t == 1.0 and w.changes == 0 and viol > 0.5 * viol_prev and viol <= 1e3 * tol_g:
            return 0
        if n_iter[0] >= budget:
            return 1
        viol_prev = viol
        gnorm = viol
        hs = 0.0
        for i in range(nf):
            for j in range(nf):
                HF[i * nf + j] = w.H[F[i] * k + F[j]]
            if HF[i * nf + i] > hs:
                hs = HF[i * nf + i]
        if hs <= 0.0:
            hs = 1.0
        # regularised like Li, Sun and Toh's semismooth Newton: rho -> 0 with |g|,
        # so the steps near the solution are exact Newton steps
        rho = hs * (1e-3 * (gnorm if gnorm < 1.0 else 1.0) + 1e-14)
        for i in range(nf):
            HF[i * nf + i] += rho
            diag0[i] = HF[i * nf + i]
            d[i] = w.g[F[i]]
        _cholesky(HF, nf, diag0, kept)
        _chol_solve(HF, nf, kept, d)
        for i in range(k):
            mu0[i] = w.mu[i]
        d0 = w.dual
        t = 1.0
        for bt in range(MAX_BACKTRACK):
            for i in range(nf):
                j = F[i]
                w.mu[j] = mu0[j] + t * d[i]
                if not _bit(w.freebits, j) and w.mu[j] < 0.0:
                    w.mu[j] = 0.0
            pred = 0.0
            for i in range(nf):
                j = F[i]
                pred += w.g[j] * (w.mu[j] - mu0[j])
            # _project overwrites g: pred is taken first
            _project(w)
            n_iter[0] += 1
            slack = 1e-13 * (1.0 + fabs(d0))
            if w.dual >= d0 + 1e-4 * pred - slack:
                break
            t *= 0.5
        else:
            return 1


# ---------------------------------------------------------------------------
# Separation: minimum root cut by Hao and Orlin's algorithm
# ---------------------------------------------------------------------------
cdef Py_ssize_t _flow_bytes(int N) noexcept nogil:
    cdef Py_ssize_t NN = <Py_ssize_t> N * N
    return ((NN + N + MAX_FOUND) * sizeof(double) + (9 * N + 6 * N + 8) * sizeof(int)
            + (MAX_FOUND + 2) * N + 32)


cdef void _flow_carve(Flow* F, int N, char* mem) noexcept nogil:
    cdef Py_ssize_t NN = <Py_ssize_t> N * N
    F.N = N
    F.R = <double*> mem
    F.e = F.R + NN
    F.found_val = F.e + N
    F.where = <int*> (F.found_val + MAX_FOUND)
    F.lab = F.where + N
    F.cnt = F.lab + N
    F.lhead = F.cnt + 2 * N + 2
    F.lnext = F.lhead + 2 * N + 2
    F.lprev = F.lnext + N
    F.bhead = F.lprev + N
    F.bnext = F.bhead + 2 * N + 2
    F.inb = <char*> (F.bnext + N)
    F.found = F.inb + N


cdef inline void _active_add(Flow* F, int j, int* bmax) noexcept nogil:
    cdef int L = F.lab[j]
    F.bnext[j] = F.bhead[L]
    F.bhead[L] = j
    F.inb[j] = 1
    if L > bmax[0]:
        bmax[0] = L


cdef inline void _label_add(Flow* F, int j) noexcept nogil:
    """Put the awake node j in the list of its label."""
    cdef int L = F.lab[j], h = F.lhead[L]
    F.lnext[j] = h
    F.lprev[j] = -1
    if h >= 0:
        F.lprev[h] = j
    F.lhead[L] = j
    F.cnt[L] += 1


cdef inline void _label_remove(Flow* F, int j) noexcept nogil:
    cdef int L = F.lab[j]
    if F.lprev[j] >= 0:
        F.lnext[F.lprev[j]] = F.lnext[j]
    else:
        F.lhead[L] = F.lnext[j]
    if F.lnext[j] >= 0:
        F.lprev[F.lnext[j]] = F.lprev[j]
    F.cnt[L] -= 1


cdef int _hao_orlin(Flow* F, const double* XT, double threshold, double* best_out) noexcept nogil:
    """Minimum over nonempty word sets S of x(delta^-(S)) (x[h, m] = XT[m*N + h]):
    one push-relabel run that takes every word as the sink in turn (Hao and
    Orlin, J. Algorithms 1994), highest label first. Source side: the root and
    the finished sinks; awake nodes: the current sink's side; dormant sets:
    nodes cut off from the sink by a gap (a stack). When the awake nodes other
    than the sink t hold no excess, every arc into the awake set is saturated
    and none leaves it with flow, so the cut of t is the awake set and its value
    e(t). The best set goes to F.found + MAX_FOUND * N (1 for the words in S),
    its value to best_out; the sink-side sets of value below threshold (the most
    violated MAX_FOUND) to F.found.

    The graph is dense (every pair of words may carry an arc either way), so a
    node of label L looks for admissible arcs among the awake nodes of label
    L - 1 (a list per label, through the residual matrix) instead of along its
    N arcs, and relabels by walking the labels up from L to the first one that
    holds a residual neighbour: at flat scores most labels hold one node or
    most of them, and both walks end after a few steps. Awake labels stay
    contiguous (a label left empty by a relabel is a gap, and all above it
    sleep), so the walk stops at the first empty label. Returns 0, or
    SEP_FAILED when a label outgrows its table (never seen; the caller
    declines)."""
    cdef int N = F.N, i, j, l, t, L, top = 0, n_awake, newl, bmax = -1, worst
    cdef int maxlab = 2 * N
    cdef double* R = F.R
    cdef double* e = F.e
    cdef double* Ri
    cdef double best = INFINITY, delta, r, ei
    cdef int* where = F.where
    cdef int* lab = F.lab
    cdef char* best_set = F.found + MAX_FOUND * N
    F.n_found = 0
    for i in range(N):
        Ri = R + i * N
        for j in range(N):
            Ri[j] = XT[j * N + i] if (j > 0 and j != i) else 0.0
    for i in range(2 * N + 2):
        F.cnt[i] = 0
        F.lhead[i] = -1
        F.bhead[i] = -1
    for i in range(N):
        e[i] = 0.0
        lab[i] = 0
        where[i] = 0
        F.inb[i] = 0
    where[0] = -1
    for j in range(N - 1, 0, -1):
        _label_add(F, j)
    n_awake = N - 1
    for j in range(1, N):
        delta = R[j]
        if delta > 0.0:
            R[j] = 0.0
            R[j * N] += delta
            e[j] += delta
    t = 1
    for j in range(2, N):
        if e[j] > 0.0:
            _active_add(F, j, &bmax)
    while True:
        while True:
            while bmax >= 0 and F.bhead[bmax] < 0:
                bmax -= 1
            if bmax < 0:
                break
            i = F.bhead[bmax]
            F.bhead[bmax] = F.bnext[i]
            F.inb[i] = 0
            if where[i] != 0 or i == t or e[i] <= 0.0:
                continue
            Ri = R + i * N
            while True:
                # push to the awake nodes one label below
                L = lab[i]
                j = F.lhead[L - 1] if L > 0 else -1
                while j >= 0:
                    r = Ri[j]
                    if r > 0.0:
                        ei = e[i]
                        delta = r if r < ei else ei
                        Ri[j] = r - delta
                        R[j * N + i] += delta
                        e[i] = ei - delta
                        e[j] += delta
                        if j != t and not F.inb[j]:
                            _active_add(F, j, &bmax)
                        if e[i] <= 0.0:
                            break
                    j = F.lnext[j]
                if e[i] <= 0.0:
                    break
                # relabel. A label left empty is a gap: everything above it
                # cannot reach the sink and goes to sleep.
                if F.cnt[L] == 1:
                    top += 1
                    l = L
                    while l < maxlab and F.lhead[l] >= 0:
                        j = F.lhead[l]
                        while j >= 0:
                            where[j] = top
                            n_awake -= 1
                            j = F.lnext[j]
                        F.lhead[l] = -1
                        F.cnt[l] = 0
                        l += 1
                    break
                newl = -1
                l = L
                while l < maxlab and F.lhead[l] >= 0 and newl < 0:
                    j = F.lhead[l]
                    while j >= 0:
                        if Ri[j] > 0.0 and j != i:
                            newl = l + 1
                            break
                        j = F.lnext[j]
                    l += 1
                _label_remove(F, i)
                if newl < 0:
                    top += 1
                    where[i] = top
                    n_awake -= 1
                    break
                if newl >= maxlab:
                    return SEP_FAILED
                lab[i] = newl
                _label_add(F, i)
        # the cut of sink t: the awake set
        if e[t] < best:
            best = e[t]
            for j in range(N):
                best_set[j] = where[j] == 0
        if e[t] < threshold:
            if F.n_found < MAX_FOUND:
                worst = F.n_found
                F.n_found += 1
            else:
                worst = 0
                for j in range(1, MAX_FOUND):
                    if F.found_val[j] > F.found_val[worst]:
                        worst = j
                if F.found_val[worst] <= e[t]:
                    worst = -1
            if worst >= 0:
                F.found_val[worst] = e[t]
                for j in range(N):
                    F.found[worst * N + j] = where[j] == 0
        # the sink joins the source side: saturate its arcs into the rest
        _label_remove(F, t)
        where[t] = -1
        n_awake -= 1
        Ri = R + t * N
        for j in range(1, N):
            if where[j] != -1 and Ri[j] > 0.0:
                delta = Ri[j]
                Ri[j] = 0.0
                R[j * N + t] += delta
                e[j] += delta
                if where[j] == 0 and not F.inb[j]:
                    _active_add(F, j, &bmax)
        if n_awake == 0:
            if top == 0:
                break
            for j in range(N - 1, 0, -1):
                if where[j] == top:
                    where[j] = 0
                    _label_add(F, j)
                    n_awake += 1
                    if e[j] > 0.0 and not F.inb[j]:
                        _active_add(F, j, &bmax)
            top -= 1
        # the next sink: an awake node of the lowest label
        l = 0
        while F.lhead[l] < 0:
            l += 1
        t = F.lhead[l]
    best_out[0] = best
    return 0


cdef void _heads(const Work* w, char* hd) noexcept nogil:
    """hd[h] = 1 for the nodes that head an arc of positive x, 0 otherwise."""
    cdef int N = w.N, m, h
    for h in range(N):
        hd[h] = 0
    for m in range(1, N):
        for h in range(N):
            if w.supp[m * N + h]:
                hd[h] = 1


cdef int _size(const char* S, int N) noexcept nogil:
    """The number of nodes in S."""
    cdef int m, c = 0
    for m in range(N):
        c += S[m]
    return c


cdef bint _shared(const char* cores, int nf, int j, int N) noexcept nogil:
    """Whether another of the nf cores (rows of N chars) equals core j."""
    cdef int i
    for i in range(nf):
        if i != j and memcmp(cores + i * N, cores + j * N, N) == 0:
            return True
    return False


cdef int _heads_only(char* S, const char* hd, int N) noexcept nogil:
    """Remove from the word set S the words that head no arc of positive x (its
    core); returns the size left. Such a word sends nothing into S, so leaving
    it out takes its incoming arcs from outside S out of the cut and adds none:
    the cut's value at x does not rise. At head-biased scores one separation
    returns many sets that differ only in such words (their rows restricted to
    the positive arcs equal or dependent), and each came back in a round of its
    own; the solver adds the core instead of a set whenever another set of the
    same run has the same core. Where no two share one (i.i.d. peaked scores)
    the sets themselves did better: their leaves are the ones the optimum's
    tight cuts hold."""
    cdef int m, c = 0
    for m in range(1, N):
        if not hd[m]:
            S[m] = 0
        c += S[m]
    return c


cdef bint _crosses_tight(const Work* w, const char* T, int i) noexcept nogil:
    """Whether the word set T crosses the held cut i (they meet and neither holds
    the other) and cut i is tight (mu > 0, or the root equality)."""
    cdef int N = w.N, W = w.W, m, c_in = 0, c_t = 0, c_s = 0
    cdef bint b
    if not (_bit(w.freebits, i) or w.mu[i] > 0.0):
        return False
    for m in range(1, N):
        b = _bit(w.inmask + m * W, i)
        if T[m]:
            if b:
                c_in += 1
            else:
                c_t += 1
        elif b:
            c_s += 1
        if c_in and c_t and c_s:
            return True
    return False


cdef void _uncross(Work* w, char* T, char* tmp) noexcept nogil:
    """Make the violated word set T laminar with the held cuts that are tight
    (mu > 0, or the root equality): while T crosses such a cut S (they meet
    and neither holds the other), T becomes the smaller-valued of T & S and
    T | S. The cut function is submodular, x(T & S) + x(T | S) <= x(T) + x(S)
    with x(S) = 1 and x(T) < 1, so the new T is violated at least as much as
    the old, and at most k replacements are made. Tight cuts that cross are
    what Edmonds' uncrossing removes: a laminar family has independent rows
    far more often, and the dual's Newton steps and the rounds that add one
    nearly dependent cut after another were most of the cost at head-biased
    scores. tmp: N chars of scratch (the Hao-Orlin best set's, read before)."""
    cdef int N = w.N, W = w.W, i, m, it
    cdef bint changed = True
    cdef double v_and, v_or
    it = 0
    while changed and it < w.k:
        changed = False
        it += 1
        for i in range(w.k):
            if not _crosses_tight(w, T, i):
                continue
            for m in range(N):
                tmp[m] = T[m] and _bit(w.inmask + m * W, i)
            v_and = _cut_value(w, tmp)
            for m in range(N):
                tmp[m] = T[m] or (m > 0 and _bit(w.inmask + m * W, i))
            v_or = _cut_value(w, tmp)
            if v_and <= v_or:
                for m in range(N):
                    T[m] = T[m] and _bit(w.inmask + m * W, i)
            else:
                memcpy(T, tmp, N)
            changed = True
            break


cdef double _cut_value(const Work* w, const char* S) noexcept nogil:
    """x(delta^-(S)) for the word set S (S[j] = 1), summed afresh."""
    cdef int N = w.N, m, h
    cdef double s = 0.0
    for m in range(1, N):
        if not S[m]:
            continue
        for h in range(N):
            if not S[h] or h == 0:
                s += w.XT[m * N + h]
    return s


cdef int _offer(Work* w, char* S, double val, double tol, char* tmp) except -1 nogil:
    """Add the word set S as a cut when it is violated (val: its cut value
    summed along the way, or a negative number to have it summed afresh), after
    uncrossing it with the held tight cuts (_uncross), unless it is held
    already. Returns 1 when it was added. tmp: N chars of scratch."""
    cdef int N = w.N, i
    if _size(S, N) == 0 or val >= 1.0 - tol:
        return 0
    for i in range(w.k):
        if _crosses_tight(w, S, i):
            _uncross(w, S, tmp)
            val = -1.0
            break
    # a value near the bar, or one changed by the uncrossing, is summed afresh
    if val < 0.0 or val > 1.0 - tol - 1e-9:
        val = _cut_value(w, S)
    if val >= 1.0 - tol or _has_cut(w, S):
        return 0
    _add_cut(w, S, False)
    return 1


cdef int _chain_cuts(Work* w, const char* S0, const int* ring, double tol) except -1 nogil:
    """Add the violated sets at the local minima of the cut along a chain of word
    sets through S0: grown from S0 one word at a time, each time the word that
    lowers the cut the most, up to all words; and shrunk from S0 the same way,
    down to one word. With s(v, j) = x[v, j] + x[j, v] and A[v] the sum of s(v, j)
    over j in the set, adding v changes the cut by 1 - A[v] and removing v by
    A[v] - 1. With ring (the depth of each word in a chain of held cuts, S0 its
    deepest set), the growing takes the words of depth d - 1 before those of
    depth d - 2 and so on, so that every set of the chain lies between two
    consecutive held cuts: the sets added are nested with them.

    At head-biased scores the optimum's tight cuts are a chain of tens of sets
    (nearly every prefix of the words ordered by how much they head, past the
    first twenty or so), and each new one fills a gap between two held ones; a
    separation that added the one or two most violated sets per round took one
    round per cut. Only the local minima are offered: the sets of a plateau
    differ in words whose heads are all inside, and their rows on the support
    are equal or dependent. Returns the number of cuts added."""
    cdef int N = w.N, m, v, j, nk = 0, dirn, level = 0
    cdef double* A = w.zb + N
    cdef char* T = w.chain
    cdef char* C = w.chain + N
    cdef double cut, cut0, best, s, pcut
    cdef bint pend
    cdef const double* XT = w.XT
    cut0 = _cut_value(w, S0)
    for dirn in range(2):
        memcpy(T, S0, N)
        T[0] = 0
        cut = cut0
        pcut = cut0
        pend = False
        # A for S0 (each direction moves it)
        for m in range(N):
            A[m] = 0.0
        for j in range(1, N):
            if S0[j]:
                for m in range(1, N):
                    A[m] += XT[j * N + m] + XT[m * N + j]
        if ring != NULL:
            level = -1
            for m in range(1, N):
                if S0[m]:
                    level = ring[m] - 1
                    break
        while True:
            v = -1
            best = INFINITY
            for m in range(1, N):
                if (T[m] != 0) != (dirn == 1):
                    continue
                if ring != NULL and dirn == 0 and ring[m] != level:
                    continue
                s = -A[m] if dirn == 0 else A[m]
                if s < best:
                    best = s
                    v = m
            if v < 0:
                if ring != NULL and dirn == 0 and level > 0:
                    level -= 1
                    continue
                break
            if dirn == 0:
                T[v] = 1
                cut += 1.0 - A[v]
                for m in range(1, N):
                    A[m] += XT[v * N + m] + XT[m * N + v]
            else:
                T[v] = 0
                cut += A[v] - 1.0
                for m in range(1, N):
                    A[m] -= XT[v * N + m] + XT[m * N + v]
                if _size(T, N) == 0:
                    break
            # a local minimum: the set before this step, when this step raised the cut
            if pend and cut > pcut + 1e-12:
                nk += _offer(w, C, pcut, tol, w.F.found + MAX_FOUND * N)
            pend = cut < 1.0 - tol and cut < pcut - 1e-12
            if pend:
                memcpy(C, T, N)
            pcut = cut
        if pend:
            nk += _offer(w, C, pcut, tol, w.F.found + MAX_FOUND * N)
    return nk


# ---------------------------------------------------------------------------
# Cut bookkeeping
# ---------------------------------------------------------------------------
cdef inline void _move_bit(u64* bm, int src, int dst) noexcept nogil:
    """Bit dst of the mask bm set to bit src; bit src cleared."""
    cdef u64 one = 1
    if _bit(bm, src):
        bm[dst >> 6] |= one << (dst & 63)
    else:
        bm[dst >> 6] &= ~(one << (dst & 63))
    bm[src >> 6] &= ~(one << (src & 63))


cdef void _drop_cut(Work* w, int i) noexcept nogil:
    """Remove cut i: the last cut takes its place (its bits and multiplier)."""
    cdef int h, last = w.k - 1, W = w.W
    if i != last:
        for h in range(w.N + 1):          # row N: freebits
            _move_bit(w.inmask + h * W, last, i)
        w.mu[i] = w.mu[last]
        memcpy(w.arow + <Py_ssize_t> i * w.N, w.arow + <Py_ssize_t> last * w.N,
               w.N * sizeof(double))
    else:
        for h in range(w.N + 1):
            w.inmask[h * W + (last >> 6)] &= ~((<u64> 1) << (last & 63))
    w.k = last


cdef bint _has_cut(const Work* w, const char* S) noexcept nogil:
    cdef int i, m, W = w.W
    cdef bint same
    for i in range(w.k):
        same = True
        for m in range(1, w.N):
            if _bit(w.inmask + m * W, i) != (S[m] != 0):
                same = False
                break
        if same:
            return True
    return False


cdef int _add_cut(Work* w, const char* S, bint is_free) except -1 nogil:
    cdef int m, i = w.k, W
    cdef u64 one = 1
    if i == w.cap:
        _grow_cuts(w, 2 * w.cap)
    W = w.W
    for m in range(w.N):
        w.arow[<Py_ssize_t> i * w.N + m] = 1.0 if (m > 0 and S[m]) else 0.0
        if m > 0 and S[m]:
            w.inmask[m * W + (i >> 6)] |= one << (i & 63)
    if is_free:
        w.freebits[i >> 6] |= one << (i & 63)
    w.mu[i] = 0.0
    w.k = i + 1
    return 0


# ---------------------------------------------------------------------------
# Feasibility with forbidden arcs
# ---------------------------------------------------------------------------
cdef bint _reach_all(const Work* w, int start, int* stack, char* seen) noexcept nogil:
    """Whether every word is reachable from start along allowed arcs (from a word,
    along word arcs only: the root is never entered)."""
    cdef int N = w.N, top = 0, h, m, count = 0
    memset(seen, 0, N)
    seen[start] = 1
    stack[top] = start
    top += 1
    while top > 0:
        top -= 1
        h = stack[top]
        if h > 0:
            count += 1
        for m in range(1, N):
            if not seen[m] and w.ET[m * N + h] > -INFINITY:
                seen[m] = 1
                stack[top] = m
                top += 1
    return count == N - 1


cdef bint _feasible(const Work* w, int* stack, char* seen) noexcept nogil:
    """Whether some tree avoids every forbidden arc. Without single_root: every
    word reachable from the root. With it: some word with an allowed root arc
    reaches every word along word arcs (such words form the source component
    of the word graph; checking each root child is O(n^3) only when no early
    one succeeds)."""
    cdef int N = w.N, m
    if not w.single_root:
        return _reach_all(w, 0, stack, seen)
    for m in range(1, N):
        if w.ET[m * N] > -INFINITY and _reach_all(w, m, stack, seen):
            return True
    return False


# ---------------------------------------------------------------------------
# The solver
# ---------------------------------------------------------------------------
cdef class TreeFacetSolver(FacetSolver):
    """TreeFacetSolver(factor)

    The facet-side SparseMAP solver of a non-projective :class:`~sparsemap.TreeFactor`:
    the projection onto the arborescence polytope by cutting planes and a
    semismooth Newton method on the cut multipliers, and its Jacobian from the
    tight constraints. See the module docstring for the algorithm, the element
    of the generalised Jacobian returned at kinks, and the costs.

    Parameters
    ----------
    factor : TreeFactor
        With ``projective=False`` (either root setting).
    decline_peaked : bool, default True
        Decline at once at peaked scores, where the vertex side is cheaper (see
        the module docstring). False solves them too (tests, benchmarks).

    Raises
    ------
    ValueError
        If ``factor`` is not a ``TreeFactor`` or is projective.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> from sparsemap._facet_tree import TreeFacetSolver
    >>> f = sm.TreeFactor(3)
    >>> eta = 0.1 * np.random.default_rng(0).standard_normal((4, 4))
    >>> sol = TreeFacetSolver(f).solve(eta)
    >>> sol.status, bool(np.allclose(sol.u, sm.solve(f, eta).u, atol=1e-9))
    (0, True)
    """
    cdef int N, n
    cdef bint single_root

    def __init__(self, factor, decline_peaked=True):
        from sparsemap._factors._tree import TreeFactor
        if not isinstance(factor, TreeFactor):
            raise ValueError(f"factor: expected a TreeFactor, got {type(factor).__name__}")
        if factor.projective:
            raise ValueError("factor: expected a non-projective TreeFactor (projective=False); "
                             "projective trees have no compact constraint description")
        FacetSolver.__init__(self, factor, decline_peaked)
        self.n = factor.n_words
        self.N = self.n + 1
        self.single_root = factor.single_root

    cdef int c_solve(self, const double* eta_u, const double* eta_v, double* u, double* v,
                     FacetState* st, Py_ssize_t budget, Py_ssize_t* n_iter,
                     double* residuals) except -1 nogil:
        return self.c_solve_warm(eta_u, eta_v, u, v, st, NULL, budget, n_iter, residuals)

    cdef int c_solve_warm(self, const double* eta_u, const double* eta_v, double* u,
                          double* v, FacetState* st, const FacetState* prev,
                          Py_ssize_t budget, Py_ssize_t* n_iter,
                          double* residuals) except -1 nogil:
        # prev's tight cuts are held from the start (_seed_cuts)
        cdef int N = self.N, status
        cdef Py_ssize_t NN = <Py_ssize_t> N * N
        cdef Work w
        cdef char* block
        cdef int forced = 0, single
        if self.decline_peaked:
            # peaked scores: the vertex side is cheaper (see the module docstring);
            # words whose head the masks force do not count
            single = _single_heads(eta_u, N, &forced)
            # (every word forced: nothing to choose, the facet side is immediate)
            if self.n > forced and \
                    single - forced >= (PEAKED_A + PEAKED_B * self.n) * (self.n - forced):
                n_iter[0] = 0
                residuals[0] = residuals[1] = 0.0
                return FACET_DECLINED
        cdef Py_ssize_t nbytes = ((2 * NN + 4 * N) * sizeof(double) + 2 * N * sizeof(int)
                                  + NN + 6 * N + MAX_FOUND * N + 32)
        block = <char*> malloc(nbytes + _flow_bytes(N))
        if block == NULL:
            with gil:
                raise MemoryError()
        w.N = N
        w.n = self.n
        w.k = 0
        w.rounds = 0
        w.single_root = self.single_root
        w.ET = <double*> block
        w.XT = w.ET + NN
        w.tau = w.XT + NN
        w.zb = w.tau + N
        w.iscratch = <int*> (w.zb + 3 * N)      # zb: N doubles and 2 N spare
        w.supp = <char*> (w.iscratch + 2 * N)
        w.cscratch = w.supp + NN
        w.nocut = w.cscratch + N
        w.cores = w.nocut + N
        w.chain = w.cores + MAX_FOUND * N
        _flow_carve(&w.F, N, block + nbytes)
        w.cutmem = NULL
        w.k = 0
        try:
            _grow_cuts(&w, CUTS0)
            status = _solve(&w, eta_u, u, st, prev, budget, n_iter, residuals)
        finally:
            free(block)
            free(w.cutmem)
        return status

    cdef int c_apply(self, const FacetState* st, const double* in_u, const double* in_v,
                     double* out_u, double* out_v, bint transpose) except -1 nogil:
        # J is symmetric: jvp and vjp are the same map (no eta_v)
        _apply_J(st, self.N, in_u, out_u)
        return 0

    def decompose(self, u, v=None):
        """A convex combination of trees equal to ``u``.

        Runs the vertex side (the active set) on scores ``eta_u = u``, with
        the arcs where ``u`` is 0 forbidden (``-inf``): the projection of a point
        of the polytope is the point itself, so the support it ends with
        decomposes ``u`` (at most ``n^2 + 1`` trees, Caratheodory), and every
        tree of a decomposition lies in the support of ``u``, so no tree uses
        an arc at 0 (an arc scored ``-inf`` among them), however small its
        weight. Its cost is the vertex side's at ``u``: at flat ``u``
        (nearly uniform arc marginals) the support has O(n^2) trees and the
        solve takes 1.3 s at 20 words (380 trees) and 31 s at 40 (1548 trees);
        at scale 1, 0.01 s and 0.4 s.

        Parameters
        ----------
        u : array_like, shape (n + 1, n + 1)
            A point of the arborescence polytope (a solution's ``u``).
        v : None
            Trees have no ``eta_v``.

        Returns
        -------
        structures : ndarray of intc, shape (k, n + 1)
            Head arrays.
        weights : ndarray of float64, shape (k,)
            Positive, summing to one, with ``sum_s w_s m_s = u`` up to round-off.
        """
        from sparsemap._active_set import decompose_point
        a = np.array(u, dtype=np.float64)
        if a.shape != (self.N, self.N):
            raise ValueError(f"u: expected shape {(self.N, self.N)}, got {a.shape}")
        # Every tree of a decomposition lies in the support of u (u >= w_s m_s), so the
        # arcs at 0 are forbidden: without that, round-off let trees through arcs of
        # weight 0 (arcs scored -inf among them) with weights near 1e-13.
        a[~(a > 0.0)] = -np.inf
        return decompose_point(self.factor, a)


cdef int _solve(Work* w, const double* eta, double* u, FacetState* st,
                const FacetState* prev, Py_ssize_t budget, Py_ssize_t* n_iter,
                double* residuals) except -1 nogil:
    cdef int N = w.N, m, h, i, j, nk, code
    cdef Py_ssize_t NN = <Py_ssize_t> N * N
    cdef double val, cmax, tol, tol_g, cut_min, rp, rd, rc, s, loose
    cdef int nf
    cdef bint forbidden = False
    cdef char* S
    n_iter[0] = 0
    residuals[0] = residuals[1] = 0.0
    # scores: transposed, each column shifted by its max (the column's equality
    # makes the solution invariant to that shift), -inf where not allowed
    for m in range(N):
        w.tau[m] = -INFINITY
    for h in range(N):
        w.ET[h] = -INFINITY
    for m in range(1, N):
        cmax = -INFINITY
        for h in range(N):
            if h == m:
                w.ET[m * N + h] = -INFINITY
                continue
            val = eta[h * N + m]
            if val == -INFINITY:
                forbidden = True
            elif not isfinite(val):
                return FACET_DECLINED     # nan / +inf: the caller's validation raises
            elif val > cmax:
                cmax = val
            w.ET[m * N + h] = val
        if cmax == -INFINITY:
            return FACET_DECLINED         # a word with no allowed head
        for h in range(N):
            w.ET[m * N + h] -= cmax       # -inf stays -inf
    memset(w.supp, 0, NN)
    for i in range(NN):
        w.XT[i] = 0.0
    if forbidden and not _feasible(w, w.iscratch, w.cscratch):
        return FACET_DECLINED
    tol_g = 2.2e-16 * N
    # the root cut (the set of all words): an equality with single_root
    S = w.cscratch
    S[0] = 0
    for m in range(1, N):
        S[m] = 1
    _add_cut(w, S, w.single_root)
    if prev != NULL:
        _seed_cuts(w, prev)
    _project(w)
    n_iter[0] += 1
    # Loose dual solves after the first rounds (see LOOSE); the solve before the
    # separation that certifies x is exact (w.exact).
    loose = 0.0
    while True:
        if _dual_solve(w, budget, n_iter, tol_g, loose):
            return FACET_DECLINED
        # cuts with mu = 0 at an exact solve are not needed (a later round finds
        # them again if violated); after a loose one they are kept (see below)
        i = 0
        while i < w.k and w.exact:
            if not _bit(w.freebits, i) and w.mu[i] <= 0.0:
                _drop_cut(w, i)
            else:
                i += 1
        tol = _tolerance(w)
        code = _hao_orlin(&w.F, w.XT, 1.0 - tol, &cut_min)
        if code == SEP_FAILED:
            return FACET_DECLINED
        cut_min = _cut_value(w, w.F.found + MAX_FOUND * N)
        if cut_min >= 1.0 - tol:
            if not w.exact:
                loose = 0.0           # feasible at a loose solve: solve exactly, separate again
                continue
            break
        # No cap on rounds or cuts, and still finite: between two exact solves cuts
        # are only added, each a set not held, so those runs are finite; and each
        # exact solve's x violates a cut the next exact solve holds (cuts dropped
        # had mu = 0, so the optimum without them is the same), so the held cuts'
        # dual optimum strictly rises from one exact solve to the next and no
        # family of held cuts comes back. Only the budget of projection passes
        # ends it early.
        w.rounds += 1
        loose = LOOSE * (1.0 - cut_min) if w.rounds > LOOSE_AFTER else 0.0
        memcpy(w.chain + 2 * N, w.F.found + MAX_FOUND * N, N)
        _heads(w, w.cscratch)
        nf = w.F.n_found
        for j in range(nf):
            memcpy(w.cores + j * N, w.F.found + j * N, N)
            _heads_only(w.cores + j * N, w.cscratch, N)
        nk = 0
        for j in range(nf):
            S = w.F.found + j * N
            if _shared(w.cores, nf, j, N):
                S = w.cores + j * N   # (see _heads_only)
            nk += _offer(w, S, -1.0, tol, w.F.found + MAX_FOUND * N)
        # A chain of sets through the held cuts when those with mu != 0 are nested
        # (the last projection's depths: grown ring by ring from the deepest),
        # else, or when that adds nothing, through the most violated set
        if w.is_chain:
            S = w.chain + 3 * N
            j = 0
            for m in range(1, N):
                if w.iscratch[m] > j:
                    j = w.iscratch[m]
            S[0] = 0
            for m in range(1, N):
                S[m] = w.iscratch[m] == j
            j = _chain_cuts(w, S, w.iscratch, tol)
            nk += j
            if j == 0:
                nk += _chain_cuts(w, w.chain + 2 * N, NULL, tol)
        else:
            nk += _chain_cuts(w, w.chain + 2 * N, NULL, tol)
        if nk == 0:
            if not w.exact:
                loose = 0.0           # a held cut violated: the loose solve's, solve exactly
                continue
            return FACET_DECLINED     # the violated cut is held already: round-off trouble
        _project(w)
        n_iter[0] += 1
    # the dropped cuts changed the numbering: the final projection's g and H
    # must be on the cuts held now (x does not change: dropped cuts had mu = 0)
    _project(w)
    n_iter[0] += 1
    # residuals from fresh sums
    rp = 1.0 - cut_min if cut_min < 1.0 else 0.0
    rd = 0.0
    for m in range(1, N):
        s = 0.0
        for h in range(N):
            s += w.XT[m * N + h]
        rp = max(rp, fabs(s - 1.0))
    rc = 0.0
    for i in range(w.k):
        rc = max(rc, fabs(w.g[i]) if _bit(w.freebits, i) or w.mu[i] > 0.0
                 else (w.g[i] if w.g[i] > 0.0 else 0.0))
    rd = _threshold_residual(w)
    residuals[0] = max(rp, rc)
    residuals[1] = rd
    tol = _tolerance(w)
    # The held cuts' rows: within the dual solve's own round-off floor (a full
    # Newton step no longer halves |g| below 1e3 tol_g: with many nearly dependent
    # tight cuts, as at head-biased scores, the floor sits above 1e-12)
    if rp > tol or rd > tol or rc > max(tol, 1e3 * tol_g):
        return FACET_DECLINED
    for m in range(N):
        for h in range(N):
            u[h * N + m] = w.XT[m * N + h] if m > 0 else 0.0
    _write_state(w, st)
    return FACET_SOLVED


cdef int _seed_cuts(Work* w, const FacetState* prev) except -1 nogil:
    """Hold the cuts tight at an earlier solution (prev's rows, the root set aside), at
    mu = 0: at nearby scores most of them are tight again, and holding them from the
    start saves the separation rounds that would find them. Those that are not are
    dropped at the first exact dual solve (mu = 0), as any cut is, so the solve and its
    termination argument are unchanged. An empty prev (a declined solve) seeds none."""
    cdef TreeHeader hd
    cdef TreeLayout lay
    cdef int N = w.N, r, m, q, c
    cdef const int* masks
    cdef char* S = w.cscratch
    if prev.n_ints == 0:
        return 0
    _view(prev, N, &hd, &lay)
    masks = prev.ints + lay.masks
    for r in range(hd.na):
        # bit r of node m's mask: word r >> 6, two ints a word (low, then high)
        q = 2 * (r >> 6) + ((r >> 5) & 1)
        S[0] = 0
        c = 0
        for m in range(1, N):
            S[m] = (masks[2 * <Py_ssize_t> m * hd.Wa + q] >> (r & 31)) & 1
            c += S[m]
        if c > 0 and c < N - 1 and not _has_cut(w, S):
            _add_cut(w, S, False)
    return 0


cdef double _tolerance(const Work* w) noexcept nogil:
    """Round-off level of the residuals: x = z - tau on the supports, where z
    (each column shifted to its max 0) is of the size of the multipliers."""
    cdef double big = 0.0
    cdef int i
    for i in range(w.k):
        if fabs(w.mu[i]) > big:
            big = fabs(w.mu[i])
    return 1e-12 * (1.0 + big)


cdef double _threshold_residual(Work* w) noexcept nogil:
    """Largest violation of the columns' threshold conditions at the final x:
    z = eta + C^T mu, tau recomputed from the support, |x - (z - tau)| on it and
    (z - tau)_+ off it."""
    cdef int N = w.N, W = w.W, m, h, c
    cdef double* z = w.zb
    cdef const double* e
    cdef const u64* bm
    cdef u64 b
    cdef double s, t, r = 0.0, dv
    for m in range(1, N):
        e = w.ET + m * N
        bm = w.inmask + m * W
        s = 0.0
        c = 0
        for h in range(N):
            if W == 1:
                b = bm[0] & ~w.inmask[h]
                t = e[h]
                while b:
                    t += w.mu[sm_ctz64(b)]
                    b &= b - 1
                z[h] = t
            else:
                z[h] = e[h] + _mu_sum(bm, w.inmask + h * W, W, w.mu)
            if w.supp[m * N + h]:
                s += z[h]
                c += 1
        t = (s - 1.0) / c
        for h in range(N):
            if w.supp[m * N + h]:
                dv = fabs(w.XT[m * N + h] - (z[h] - t))
            else:
                dv = z[h] - t
            if dv > r:
                r = dv
    return r


cdef int _held_rows(Work* w, int* act) except -1 nogil:
    """The cuts the Jacobian holds at first (their indices into act, in order): the
    root equality and the cuts with mu > 0, tight by complementary slackness; then,
    when it is tight and not among them, the set of all words (the root's arcs: tight
    with mu = 0 at zero and at tied scores), added as a new cut. Returns their count."""
    cdef int N = w.N, k = w.k, W = w.W, i, m, na = 0, root = -1
    cdef double rsum = 0.0
    cdef char* S = w.cscratch
    for i in range(k):
        if _bit(w.freebits, i) or w.mu[i] > 0.0:
            act[na] = i
            na += 1
    # is a held cut the set of all words?
    for i in range(k):
        root = i
        for m in range(1, N):
            if not _bit(w.inmask + m * W, i):
                root = -1
                break
        if root >= 0:
            break
    if root >= 0:
        for i in range(na):
            if act[i] == root:
                return na
    for m in range(1, N):
        rsum += w.XT[m * N]
    if fabs(rsum - 1.0) <= _tolerance(w):
        if root < 0:
            S[0] = 0
            for m in range(1, N):
                S[m] = 1
            _add_cut(w, S, False)
            root = w.k - 1
        act[na] = root
        na += 1
    return na


# The search for the tight cuts the held rows do not span (_search_rows): the step
# along its random direction at first, and the factor it shrinks by when a set it
# finds is near-tight but not tight (see _search_rows for both).
cdef double SEARCH_STEP = 1e-5
cdef double SEARCH_SHRINK = 1e-2
# When the search runs (see _write_state and docs/solvers.rst): always for trees of
# at most SEARCH_ALWAYS words (where it costs about what the enumeration of all word
# sets it replaces did), and for larger ones at ties.
cdef int SEARCH_ALWAYS = 10


cdef bint _zero_held(const Work* w, int na) noexcept nogil:
    """Whether a row held (w.fidx[:na]) is a tight cut with mu = 0 (the set of all words
    at zero and tied scores, added by _held_rows): a degenerate point."""
    cdef int i
    for i in range(na):
        if not _bit(w.freebits, w.fidx[i]) and w.mu[w.fidx[i]] <= 0.0:
            return True
    return False


cdef struct Ties:
    # a hash set of one column's values (open addressing; a slot is in use when its
    # stamp is the column's), to find ties: see _tied
    u64* keys
    int* stamp
    int bits


cdef inline bint _tied(Ties* t, int col, double v) noexcept nogil:
    """Whether column col already holds the value v (bit for bit); v is added."""
    cdef u64 key, i, mask = ((<u64> 1) << t.bits) - 1
    v = v + 0.0                                       # -0.0 as +0.0
    memcpy(&key, &v, sizeof(double))
    i = (key * (<u64> 0x9E3779B97F4A7C15ULL)) >> (64 - t.bits)
    while t.stamp[i] == col:
        if t.keys[i] == key:
            return True
        i = (i + 1) & mask
    t.stamp[i] = col
    t.keys[i] = key
    return False


cdef inline double _uniform(u64* s) noexcept nogil:
    """A pseudo-random double in [-1, 1) (xorshift64*): the search's direction, from a
    fixed seed, so that the Jacobian returned does not depend on the call."""
    s[0] ^= s[0] >> 12
    s[0] ^= s[0] << 25
    s[0] ^= s[0] >> 27
    return <double> ((s[0] * (<u64> 2685821657736338717ULL)) >> 11) * (2.0 / 9007199254740992.0) - 1.0


cdef void _centre(double* d, const int* colp, int N) noexcept nogil:
    """Each column's entries of d (a vector on the support, column m at
    colp[m]:colp[m + 1]) shifted to mean 0: the projection onto the word rows' null
    space."""
    cdef int m, p
    cdef double s
    for m in range(1, N):
        if colp[m + 1] == colp[m]:
            continue
        s = 0.0
        for p in range(colp[m], colp[m + 1]):
            s += d[p]
        s /= colp[m + 1] - colp[m]
        for p in range(colp[m], colp[m + 1]):
            d[p] -= s


cdef int _search_rows(Work* w, int na) except -1 nogil:
    """Every tight cut whose row, on the support and centred per column, is outside
    the span of the rows held (w.fidx[:na], from _held_rows), added as a cut until
    the rows span them all. Returns the new count, the rows' cut indices in
    w.fidx[:count] (the block may have grown: callers re-read w.fidx).

    The tight sets form an intersecting family: when S and T are tight and meet,
    S & T and S | T are tight too (the cut function is submodular and at least 1),
    and the arcs between S - T and T - S carry x = 0, so on the support the rows add
    up: C_S + C_T = C_{S & T} + C_{S | T}. Let d be a random direction in the held
    rows' null space (d = J r for the Jacobian J of the rows held, r pseudo-random:
    centred per column, minus its component on the rows, |d|_max = 1). The rows held
    and the words' rows do not move along d (C d = 0); a tight cut whose row is not
    in their span moves (C_S d != 0, for almost every r), and at x + t d its value is
    1 + t C_S d: below 1 for one sign of t. The minimum root cut of x + t d and of
    x - t d (Hao and Orlin's run of the separation, its sets below 1 - bar) then
    returns such a set when one exists; each set returned that is tight at x (its
    value summed afresh within bar of 1) is added when Gram-Schmidt finds its row
    independent, d is recomputed in the smaller null space, and the search stops
    when neither sign returns a set. Each round adds a row (at most |P| rounds);
    with no cut missing it costs two Hao-Orlin runs and O(|P| (k + 1)).

    The thresholds. bar is the tightness bar: twice the larger of the solver's
    tolerance (1e-12 (1 + max |mu|): the tight cuts' values at x, the singletons'
    included, are 1 within it) and the dual solve's round-off floor on the held
    rows (1e3 (n + 1) units in the last place, which the certificate admits); Hao
    and Orlin's sums of at most n + 1 flows of size at most 1 add n units in the
    last place, below it. The step t starts at SEARCH_STEP = 1e-5 (capped so that
    x + t d stays at least x / 2 on the support, so no capacity is negative): a
    missing cut is found when t |C_S d| > 2 bar, that is |C_S d| above 1e-5 at 120
    words (C_S d is a sum of d over the arcs that enter S, of order 1 for a random
    r), while a cut that is not tight moves by at most t |delta^-(S)| and is
    returned only if its slack is below that (at most 1e-5 n^2). Such a near-tight
    set (returned, not tight at x) makes the search shrink t by SEARCH_SHRINK and
    run again, while t stays above 1e3 bar; a set still returned there is a slack
    of less than 1e-7 n^2 and is left out (docs/solvers.rst)."""
    cdef int N = w.N, m, h, p, i, j, nP = 0, nq = 0, capq, capa, sgn, added, near
    cdef Py_ssize_t NN = <Py_ssize_t> N * N
    cdef double tol = _tolerance(w), bar, step, t, dmax, best
    cdef char* block
    cdef int* pidx
    cdef int* colp
    cdef int* acts
    cdef int* grown_i
    cdef double* r
    cdef double* d
    cdef double* v
    cdef double* YT
    cdef double* Q
    cdef double* grown_d
    cdef char* S
    cdef u64 seed = 0x9E3779B97F4A7C15ULL
    for m in range(1, N):
        for h in range(N):
            nP += w.supp[m * N + h]
    if nP == 0:
        return na
    capq = na + 8
    capa = na + 8
    block = <char*> malloc((3 * <Py_ssize_t> nP + NN) * sizeof(double)
                           + (nP + N + 1) * sizeof(int))
    Q = <double*> malloc(<Py_ssize_t> capq * nP * sizeof(double))
    acts = <int*> malloc(capa * sizeof(int))
    if block == NULL or Q == NULL or acts == NULL:
        free(block)
        free(Q)
        free(acts)
        with gil:
            raise MemoryError()
    r = <double*> block
    d = r + nP
    v = d + nP
    YT = v + nP
    pidx = <int*> (YT + NN)
    colp = pidx + nP
    memcpy(acts, w.fidx, na * sizeof(int))
    p = 0
    colp[0] = 0
    for m in range(1, N):
        colp[m] = p
        for h in range(N):
            if w.supp[m * N + h]:
                pidx[p] = m * N + h
                p += 1
    colp[N] = p
    try:
        for j in range(na):
            nq += _orth_row(w, acts[j], Q, nq, nP, v)  # (capq > na)
        for p in range(nP):
            r[p] = _uniform(&seed)
        bar = 2.0 * max(tol, 1e3 * 2.2e-16 * N)
        while True:
            # d = J r, for J the projection onto the held rows' null space
            memcpy(d, r, nP * sizeof(double))
            _centre(d, colp, N)
            _remove_span(Q, nq, nP, d)
            _centre(d, colp, N)
            dmax = 0.0
            for p in range(nP):
                dmax = max(dmax, fabs(d[p]))
            if dmax <= 1e-9:
                break                                 # the rows held fix x on the support
            step = SEARCH_STEP
            for p in range(nP):
                d[p] /= dmax
                if step * fabs(d[p]) > 0.5 * w.XT[pidx[p]]:
                    step = 0.5 * w.XT[pidx[p]] / fabs(d[p])
            added = 0
            for sgn in range(2):
                t = step if sgn == 0 else -step
                while True:
                    memcpy(YT, w.XT, NN * sizeof(double))
                    for p in range(nP):
                        YT[pidx[p]] += t * d[p]
                    if _hao_orlin(&w.F, YT, 1.0 - bar, &best) != 0:
                        break                         # (never seen: see _hao_orlin)
                    near = 0
                    for j in range(w.F.n_found):
                        S = w.F.found + j * N
                        if _size(S, N) < 2:
                            continue
                        if fabs(_cut_value(w, S) - 1.0) > bar:
                            near += 1
                            continue
                        if nq == capq or na == capa:
                            capq = 2 * capq
                            capa = 2 * capa
                            grown_d = <double*> realloc(Q, <Py_ssize_t> capq * nP * sizeof(double))
                            if grown_d == NULL:
                                with gil:
                                    raise MemoryError()
                            Q = grown_d
                            grown_i = <int*> realloc(acts, capa * sizeof(int))
                            if grown_i == NULL:
                                with gil:
                                    raise MemoryError()
                            acts = grown_i
                        _add_cut(w, S, False)
                        if _orth_row(w, w.k - 1, Q, nq, nP, v):
                            acts[na] = w.k - 1
                            na += 1
                            nq += 1
                            added += 1
                        else:
                            _drop_cut(w, w.k - 1)
                    if added or near == 0 or fabs(t) * SEARCH_SHRINK < 1e3 * bar:
                        break
                    t *= SEARCH_SHRINK
                if added:
                    break
            if not added:
                break
        memcpy(w.fidx, acts, na * sizeof(int))        # w.cap >= w.k >= na
    finally:
        free(block)
        free(Q)
        free(acts)
    return na


cdef void _remove_span(const double* Q, int nq, int nP, double* v) noexcept nogil:
    """v minus its components along Q's nq orthonormal rows (of nP entries)."""
    cdef int i, p
    cdef double dot
    for i in range(nq):
        dot = 0.0
        for p in range(nP):
            dot += Q[<Py_ssize_t> i * nP + p] * v[p]
        for p in range(nP):
            v[p] -= dot * Q[<Py_ssize_t> i * nP + p]


cdef int _orth_row(Work* w, int ci, double* Q, int nq, int nP, double* v) noexcept nogil:
    """The row of cut ci on the support, centred per column, orthogonalised against
    Q's nq rows (twice, for round-off); appended to Q and 1 returned when what is
    left is not round-off, else 0."""
    cdef int N = w.N, m, h, p = 0, p0, c, i
    cdef double s, nrm0 = 0.0, nrm
    cdef bint in_m, in_h
    for m in range(1, N):
        p0 = p
        s = 0.0
        for h in range(N):
            if not w.supp[m * N + h]:
                continue
            in_m = _bit(w.inmask + m * w.W, ci)
            in_h = _bit(w.inmask + h * w.W, ci)
            v[p] = 1.0 if (in_m and not in_h) else 0.0
            s += v[p]
            p += 1
        c = p - p0
        for i in range(p0, p):
            v[i] -= s / c
    for i in range(nP):
        nrm0 += v[i] * v[i]
    if nrm0 <= 0.0:
        return 0
    _remove_span(Q, nq, nP, v)
    _remove_span(Q, nq, nP, v)                       # again, for round-off
    nrm = 0.0
    for i in range(nP):
        nrm += v[i] * v[i]
    if nrm <= 1e-16 * nrm0:
        return 0
    nrm = sqrt(nrm)
    for p in range(nP):
        Q[<Py_ssize_t> nq * nP + p] = v[p] / nrm
    return 1


cdef void _rows_hessian(const Work* w, const int* act, int na, double* L) noexcept nogil:
    """L (na x na, row-major) = B Pc B^T for the cuts act[:na] on the support: the
    dual's Hessian restricted to them, summed afresh (w.acol: na doubles of scratch)."""
    cdef int N = w.N, W = w.W, m, h, i, j, c
    cdef double* a = w.acol
    cdef const u64* bm
    cdef const u64* bh
    for i in range(na * na):
        L[i] = 0.0
    for m in range(1, N):
        c = 0
        for i in range(na):
            a[i] = 0.0
        bm = w.inmask + m * W
        for h in range(N):
            if not w.supp[m * N + h]:
                continue
            c += 1
            bh = w.inmask + h * W
            for i in range(na):
                if _bit(bm, act[i]) and not _bit(bh, act[i]):
                    a[i] += 1.0
                    for j in range(i + 1):
                        if _bit(bm, act[j]) and not _bit(bh, act[j]):
                            L[i * na + j] += 1.0
        if c == 0:
            continue
        for i in range(na):
            if a[i] != 0.0:
                for j in range(i + 1):
                    L[i * na + j] -= a[i] * a[j] / c
    for i in range(na):
        for j in range(i):
            L[j * na + i] = L[i * na + j]


# -- the state -------------------------------------------------------------------------
# The backward state: this header at the start of the ints, then kept[na] (1 where the
# row of L is kept, 0 where it was dependent and dropped), colptr[N + 1], heads[nnz],
# then each node's mask over the kept rows: bit r of its Wa words (two ints each, low
# then high) set iff the node is in the cut of row r; the doubles: L, na x na.
# _layout is the one place that knows the offsets.

cdef struct TreeHeader:
    int N, nnz, na, Wa         # nodes, support entries, cut rows of L, u64 words a mask
    int rounds, k              # diagnostics (the benchmarks read them): separation
                               # rounds run, cuts held at the end

cdef struct TreeLayout:
    Py_ssize_t kept, colptr, heads, masks, n_ints      # into the ints
    Py_ssize_t L, n_reals                              # into the doubles

cdef Py_ssize_t HEADER = sizeof(TreeHeader) // sizeof(int)


cdef inline TreeLayout _layout(const TreeHeader* h) noexcept nogil:
    cdef TreeLayout l
    l.kept = HEADER
    l.colptr = l.kept + h.na
    l.heads = l.colptr + h.N + 1
    l.masks = l.heads + h.nnz
    l.n_ints = l.masks + 2 * <Py_ssize_t> h.N * h.Wa
    l.L = 0
    l.n_reals = <Py_ssize_t> h.na * h.na
    return l


cdef int _view(const FacetState* st, int N, TreeHeader* h, TreeLayout* l) except -1 nogil:
    """The header and layout of a state, checked against its sizes and against a
    factor of N nodes, so that the Jacobian indexes neither past the state nor past u
    (a state may come from a pickle)."""
    cdef Py_ssize_t p
    cdef const int* colptr
    cdef const int* heads
    state_check_header(st, HEADER)
    memcpy(h, st.ints, sizeof(TreeHeader))
    if h.N != N or h.na < 0 or h.Wa != (h.na + 63) >> 6 or h.nnz < 0 \
            or h.nnz > <Py_ssize_t> N * (N - 1):
        with gil:
            raise ValueError("the state does not belong to this solver's factor")
    l[0] = _layout(h)
    state_check_sizes(st, l.n_ints, l.n_reals)
    colptr = st.ints + l.colptr
    heads = st.ints + l.heads
    if colptr[0] != 0 or colptr[1] != 0 or colptr[N] != h.nnz:
        with gil:
            raise ValueError("the state does not belong to this solver's factor")
    for p in range(1, N):
        if colptr[p + 1] < colptr[p]:
            with gil:
                raise ValueError("the state does not belong to this solver's factor")
    for p in range(h.nnz):
        if <unsigned int> heads[p] >= <unsigned int> N:
            with gil:
                raise ValueError("the state does not belong to this solver's factor")
    return 0


cdef int _write_state(Work* w, FacetState* st) except -1 nogil:
    """The backward data: supports, the tight cuts' word masks, the Cholesky factor
    of B Pc B^T on them (see _apply_J for the layout).

    The Jacobian is the projection onto the null space of every constraint tight
    at u (docs/solvers.rst): the cuts with mu > 0, and also the tight ones with
    mu = 0 that the dual left out (_held_rows, _search_rows)."""
    cdef int N = w.N, k, W, m, h, i, j, na = 0, Wa, q
    cdef Py_ssize_t nnz = 0
    cdef int* act = w.fidx
    cdef double* diag0 = w.diag0
    cdef char* kept = w.kept
    cdef double* L
    cdef int* ints
    cdef int* heads
    cdef TreeHeader hd
    cdef TreeLayout lay
    cdef u64 b
    cdef bint fresh
    cdef char* block
    cdef int k0 = w.k
    cdef double tol = _tolerance(w)
    cdef Ties ties
    cdef bint tied = False
    ties.bits = 1
    while (1 << ties.bits) < 2 * N:
        ties.bits += 1
    ties.keys = <u64*> malloc((sizeof(u64) + sizeof(int)) << ties.bits)
    if ties.keys == NULL:
        with gil:
            raise MemoryError()
    ties.stamp = <int*> (ties.keys + (1 << ties.bits))
    memset(ties.stamp, 0, sizeof(int) << ties.bits)
    # An arc whose x is round-off above 0 is at 0 (the constraint x >= 0 tight): in
    # the Jacobian's support it would let J move an arc that stays at 0. The same
    # pass looks for a tie: two arcs into one word with equal x > 0 (equal scores
    # on the support, as zero, integer or repeated scores give), when the search
    # below runs.
    fresh = False
    for m in range(1, N):
        for h in range(N):
            if w.supp[m * N + h]:
                if w.XT[m * N + h] <= tol:
                    w.supp[m * N + h] = 0
                    fresh = True
                elif not tied:
                    tied = _tied(&ties, m, w.XT[m * N + h])
            nnz += w.supp[m * N + h]
    free(ties.keys)
    # Room for the set of all words, made now: growing the block moves the scratch
    # that act points into, and does not keep H
    if w.k + 1 > w.cap:
        _grow_cuts(w, w.k + 1)
        fresh = True
    block = w.cutmem
    na = _held_rows(w, w.fidx)
    if w.n >= 3 and (w.n <= SEARCH_ALWAYS or tied or _zero_held(w, na)):
        na = _search_rows(w, na)
    # (the search may have grown the block, even when it kept no cut)
    fresh = fresh or w.cutmem != block
    act = w.fidx
    diag0 = w.diag0
    kept = w.kept
    k = w.k
    W = w.W
    # rows added since the dual's last projection have no entries in its H, nor has
    # a support cut down
    fresh = fresh or k != k0
    Wa = (na + 63) >> 6
    hd.N = N
    hd.nnz = <int> nnz
    hd.na = na
    hd.Wa = Wa
    hd.rounds = w.rounds
    hd.k = k
    lay = _layout(&hd)
    state_resize(st, lay.n_ints, lay.n_reals)
    L = st.reals + lay.L
    if fresh:
        _rows_hessian(w, act, na, L)
    else:
        for i in range(na):
            for j in range(na):
                L[i * na + j] = w.H[act[i] * k + act[j]]
    for i in range(na):
        diag0[i] = L[i * na + i]
    _cholesky(L, na, diag0, kept)
    memcpy(st.ints, &hd, sizeof(TreeHeader))
    ints = st.ints + lay.kept
    for i in range(na):
        ints[i] = kept[i]
    ints = st.ints + lay.colptr
    heads = st.ints + lay.heads
    ints[0] = 0
    ints[1] = 0
    nnz = 0
    for m in range(1, N):
        for h in range(N):
            if w.supp[m * N + h]:
                heads[nnz] = h
                nnz += 1
        ints[m + 1] = <int> nnz
    # each node's mask over the active cuts, renumbered as the rows of L, as Wa u64
    # words of two ints each (low, high). Rows that L dropped as dependent keep their
    # bits: _chol_solve gives them y = 0, so J does not see them, and a warm start
    # (_seed_cuts) holds every cut the solve held, not only the independent ones
    ints = st.ints + lay.masks
    for m in range(N):
        for q in range(Wa):
            b = 0
            for j in range(q << 6, min(na, (q + 1) << 6)):
                if _bit(w.inmask + m * W, act[j]):
                    b |= (<u64> 1) << (j & 63)
            ints[2 * (m * Wa + q)] = <int> <unsigned int> b
            ints[2 * (m * Wa + q) + 1] = <int> (b >> 32)
    return 0


cdef int _apply_J(const FacetState* st, int n_nodes, const double* a,
                  double* out) except -1 nogil:
    """out = J a (J symmetric): centre each column on its support, then remove
    the active cut rows' component: out = Pc a - Pc B^T (B Pc B^T)^{-1} B Pc a.
    The state's layout is TreeHeader's (checked against n_nodes by _view)."""
    cdef TreeHeader hd
    cdef TreeLayout lay
    cdef int N, na, Wa, m, h, p, p0, p1, c, i, q
    cdef const int* kept_i
    cdef const int* colptr
    cdef const int* heads
    cdef const int* masks
    cdef double s, mean
    cdef double* y
    cdef char* kept
    cdef bint any_kept = False
    cdef u64* mk
    _view(st, n_nodes, &hd, &lay)
    N = hd.N
    na = hd.na
    Wa = hd.Wa
    kept_i = st.ints + lay.kept
    colptr = st.ints + lay.colptr
    heads = st.ints + lay.heads
    masks = st.ints + lay.masks
    memset(out, 0, <Py_ssize_t> N * N * sizeof(double))
    for m in range(1, N):
        p0 = colptr[m]
        p1 = colptr[m + 1]
        c = p1 - p0
        if c == 0:
            continue
        s = 0.0
        for p in range(p0, p1):
            s += a[heads[p] * N + m]
        mean = s / c
        for p in range(p0, p1):
            h = heads[p]
            out[h * N + m] = a[h * N + m] - mean
    for i in range(na):
        if kept_i[i]:
            any_kept = True
    if not any_kept:
        return 0
    y = <double*> malloc(na * sizeof(double) + na + <Py_ssize_t> N * Wa * sizeof(u64))
    if y == NULL:
        with gil:
            raise MemoryError()
    mk = <u64*> (y + na)
    kept = <char*> (mk + <Py_ssize_t> N * Wa)
    for i in range(na):
        y[i] = 0.0
        kept[i] = <char> kept_i[i]
    for i in range(N * Wa):
        mk[i] = (<u64> <unsigned int> masks[2 * i]) | ((<u64> <unsigned int> masks[2 * i + 1]) << 32)
    # y = B Pc a
    for m in range(1, N):
        if not _any(mk + m * Wa, Wa):
            continue
        for p in range(colptr[m], colptr[m + 1]):
            h = heads[p]
            _scatter(mk + m * Wa, mk + h * Wa, Wa, out[h * N + m], y)
    _chol_solve(st.reals, na, kept, y)
    # out -= Pc B^T y
    for m in range(1, N):
        if not _any(mk + m * Wa, Wa):
            continue
        p0 = colptr[m]
        p1 = colptr[m + 1]
        s = 0.0
        for p in range(p0, p1):
            s += _mu_sum(mk + m * Wa, mk + heads[p] * Wa, Wa, y)
        mean = s / (p1 - p0)
        for p in range(p0, p1):
            h = heads[p]
            out[h * N + m] -= _mu_sum(mk + m * Wa, mk + h * Wa, Wa, y) - mean
    free(y)
    return 0


cdef inline void _scatter(const u64* bm, const u64* bh, int W, double v, double* y) noexcept nogil:
    """y[i] += v for each cut i an arc h -> m enters (bm, bh: the nodes' masks)."""
    cdef int q
    cdef u64 b
    for q in range(W):
        b = bm[q] & ~bh[q]
        while b:
            y[(q << 6) + sm_ctz64(b)] += v
            b &= b - 1


def _min_root_cut(x):
    """Minimum over nonempty word sets S of ``sum_{h not in S, m in S} x[h, m]``
    by the solver's Hao-Orlin routine (tests compare it with NetworkX).

    Parameters
    ----------
    x : array_like, shape (n + 1, n + 1)
        Nonnegative arc weights; column 0 and the diagonal are ignored.

    Returns
    -------
    value : float
    words : ndarray of bool, shape (n + 1,)
        The minimising set (``words[0]`` is False).
    """
    a = np.ascontiguousarray(x, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] < 2:
        raise ValueError(f"x: expected a square array of side >= 2, got shape {a.shape}")
    cdef int N = a.shape[0], code
    xt = np.ascontiguousarray(a.T)
    cdef const double[:, ::1] xtv = xt
    mem = np.zeros(_flow_bytes(N) // 8 + 2)
    cdef double[::1] memv = mem
    cdef Flow F
    cdef double best = 0.0
    _flow_carve(&F, N, <char*> &memv[0])
    with nogil:
        code = _hao_orlin(&F, &xtv[0, 0], -INFINITY, &best)
    if code != 0:
        raise RuntimeError("Hao-Orlin: label table overflow")
    words = np.array([F.found[MAX_FOUND * N + j] != 0 for j in range(N)])
    return best, words
