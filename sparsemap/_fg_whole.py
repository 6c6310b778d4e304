"""Factor graphs that are exactly one factor's polytope, solved as that factor.

A graph with the same variables and the same constraints as one factor has the same QP,
so :func:`sparsemap.solve` on that factor gives its answer, picking the cheaper side (a
matching's facet solver, a chain's Viterbi active set) and certifying it by a duality
gap: 50 to 500 times faster than ADMM and its polish on those graphs. This module holds
the recognition (:func:`recognise`, once per graph structure: one factor over distinct
variables, Xor rows and AtMostOne columns covering a block once, a chain of Pair
factors) and the solve (:func:`solve_whole`, with masks and padding split into blocks).
``sparsemap._factor_graph`` dispatches here and wraps the answer as a
``FactorGraphResult`` (``_WholeResult``), which maps ``u``, ``v``, the support and the
Jacobian products back to the graph.

It calls :func:`sparsemap.solve` (in the form that leaves non-convergence to the
caller instead of warning), so it sits on that function's layer, above the
factor graph's engine (``sparsemap._fg_admm`` and the modules that extend it),
which never imports it.
"""

import numpy as np

from sparsemap._factors._logic import (AtMostOneFactor, PairFactor, SequenceBudgetFactor,
                                       XorFactor)
from sparsemap._factors._matching import MatchingFactor
from sparsemap._solve import _solve_unwarned


class _Whole:
    """How a graph is one factor: ``factor``; ``parts`` (factor.n_u,): the graph variable
    of each of its unary parts (-1 where the factor ignores the part; every graph variable
    appears once); ``kind``: "itself" (one factor on distinct variables), "matching"
    (Xor rows and AtMostOne or Xor columns covering a block once), "chain" (Pair factors
    along a path of variables: a SequenceBudgetFactor whose budget never binds, the
    pair scores its "both on" transitions); ``links``: for a chain, per Pair factor its
    position i (transition i -> i + 1)."""

    def __init__(self, factor, parts, kind, links=None):
        self.factor, self.parts, self.kind, self.links = factor, parts, kind, links
        self.tied = parts >= 0
        self.at = np.maximum(parts, 0)
        # the graph's variables in the factor's order (the common layout: a matching over
        # a row-major grid, a factor over its variables in order): no gather, no scatter
        self.in_order = bool(parts.shape[0] == factor.n_u
                             and (parts == np.arange(parts.shape[0])).all())
        self.all_tied = bool(self.tied.all())

    def scores_u(self, eu):
        """The factor's eta_u from the graph's (a view when in order)."""
        if self.in_order:
            return eu.reshape(self.factor.shape_u)
        out = eu[self.at] if self.all_tied else np.where(self.tied, eu[self.at], 0.0)
        return out.reshape(self.factor.shape_u)

    def scores(self, eu, ev):
        """The factor's (eta_u, eta_v) from the graph's."""
        eta_u = self.scores_u(eu)
        if self.kind == "itself":
            return eta_u, (ev[0].reshape(self.factor.shape_v) if self.factor.n_v else None)
        if self.kind == "chain":
            eta_v = np.zeros(self.factor.shape_v)
            eta_v[self.links, 1, 1] = [float(e[0]) for e in ev]
            return eta_u, eta_v
        return eta_u, None

    def to_graph(self, x, n_variables):
        """A vector over the factor's parts, as one over the graph's variables (in order:
        ``x`` itself, flat, which the caller must own)."""
        if self.in_order:
            return np.asarray(x, dtype=np.float64).reshape(-1)
        out = np.zeros(n_variables)
        out[self.parts[self.tied]] = np.asarray(x).reshape(-1)[self.tied]
        return out

    def eta_v_list(self, gv, factors):
        """The factor's eta_v-shaped array as the graph's per-factor list."""
        if self.kind == "itself":
            return [np.asarray(gv).reshape(factors[0].shape_v)] if factors[0].n_v else \
                [np.zeros(factors[0].shape_v)]
        if self.kind == "chain":
            return [np.array([gv[i, 1, 1]]) for i in self.links]
        return [np.zeros(f.shape_v) for f in factors]


def recognise(st):
    """The graph's _Whole, or None. Only plain parts (no negation), every variable in use."""
    F, V = st.F, st.V
    if F == 0 or any(np.any(n) for n in st.negated):
        return None
    var = st.var[:st.L]
    tied = var >= 0
    uses = np.bincount(var[tied], minlength=V)
    factors = st.factors
    if F == 1:
        v = np.asarray(st.variables[0]).reshape(-1).astype(np.intp)
        if (uses == 1).all() and v[v >= 0].size == V:
            return _Whole(factors[0], v, "itself")
        return None
    if all(type(f) is PairFactor for f in factors) and F == V - 1 and (uses <= 2).all():
        return _chain(st, uses)
    if all(type(f) in (XorFactor, AtMostOneFactor) for f in factors) and (uses == 2).all():
        return _matching(st)
    return None


def _chain(st, uses):
    """Pair factors along a path through every variable: SequenceBudgetFactor(V, V)."""
    V = st.V
    pairs = [tuple(int(x) for x in np.asarray(v).reshape(-1)) for v in st.variables]
    if any(a == b for a, b in pairs) or (uses == 0).any():
        return None
    nbr = {}
    for f, (a, b) in enumerate(pairs):
        nbr.setdefault(a, []).append((b, f))
        nbr.setdefault(b, []).append((a, f))
    ends = [i for i in range(V) if len(nbr[i]) == 1]
    if len(ends) != 2:
        return None
    order, links, prev, cur = [ends[0]], np.zeros(st.F, dtype=np.intp), -1, ends[0]
    while len(order) < V:
        nxt = [(b, f) for b, f in nbr[cur] if b != prev]
        if len(nxt) != 1:
            return None
        b, f = nxt[0]
        links[f] = len(order) - 1
        prev, cur = cur, b
        order.append(b)
    if len(set(order)) != V:
        return None
    return _Whole(SequenceBudgetFactor(V, V), np.asarray(order, dtype=np.intp), "chain", links)


def _matching(st):
    """Xor rows over AtMostOne (or Xor) columns, each variable in one row and one column,
    every row meeting every column once: MatchingFactor(rows, columns)."""
    F = st.F
    fac_vars = [np.asarray(v).reshape(-1) for v in st.variables]
    by_var = {}
    for f, v in enumerate(fac_vars):
        if np.unique(v).size != v.size or (v < 0).any():
            return None
        for i in v.tolist():
            by_var.setdefault(i, []).append(f)
    side = np.full(F, -1)
    side[0] = 0
    stack = [0]
    while stack:
        f = stack.pop()
        for i in fac_vars[f].tolist():
            for g in by_var[i]:
                if g == f:
                    continue
                if side[g] < 0:
                    side[g] = 1 - side[f]
                    stack.append(g)
                elif side[g] == side[f]:
                    return None
    if (side < 0).any():
        return None
    A, B = np.flatnonzero(side == 0), np.flatnonzero(side == 1)
    kinds = [{type(st.factors[f]) for f in X} for X in (A, B)]
    if len(kinds[0]) != 1 or len(kinds[1]) != 1:
        return None
    xa, xb = XorFactor in kinds[0], XorFactor in kinds[1]
    if not xa and not xb:
        return None
    if xa and xb and A.size != B.size:
        return None
    if not xa:                        # the Xor side is the rows
        A, B = B, A
    if A.size > B.size or st.V != A.size * B.size:
        return None
    if any(fac_vars[f].size != B.size for f in A) or any(fac_vars[f].size != A.size for f in B):
        return None
    col = {int(f): c for c, f in enumerate(B)}
    parts = np.full((A.size, B.size), -1, dtype=np.intp)
    for r, f in enumerate(A):
        for i in fac_vars[f].tolist():
            g = [h for h in by_var[i] if h != f][0]
            if parts[r, col[g]] >= 0:
                return None
            parts[r, col[g]] = i
    if (parts < 0).any():
        return None
    return _Whole(MatchingFactor(int(A.size), int(B.size)), parts.reshape(-1), "matching")


def _ix(rows, cols):
    """``np.ix_`` for two integer arrays, without its checks (a block is read and
    written several times per solve)."""
    return rows[:, None], cols[None, :]


def _matching_blocks(whole, eu, fixed):
    """A matching whose fixed variables (masks, padding) split it into complete blocks:
    [(rows, cols, kind)] with kind "solve" (a MatchingFactor of the block) or "uniform"
    (every score of the block equal: the padding left after its fill is cancelled, whose
    answer is the uniform point, by symmetry). None when the unfixed variables do not
    form complete blocks, or a block has more Xor rows than columns (the graph's path
    then runs and says why)."""
    nr, nc = whole.factor.n_rows, whole.factor.n_cols
    grid = whole.parts.reshape(nr, nc)
    free = ~fixed[grid]
    # complete blocks <=> rows with the same free columns, and those sets disjoint
    if not free.any(axis=1).all():
        return None                 # a Xor row with nothing free
    groups = {}
    packed = np.packbits(free, axis=1)
    for r in range(nr):
        groups.setdefault(packed[r].tobytes(), []).append(r)
    first = [g[0] for g in groups.values()]
    if free[first].sum(axis=0).max(initial=0) > 1:
        return None                 # blocks that overlap
    blocks = []
    for g in groups.values():
        rows, cols = np.asarray(g), np.flatnonzero(free[g[0]])
        if rows.size > cols.size:
            return None
        vals = eu[grid[_ix(rows, cols)]]
        blocks.append((rows, cols, "uniform" if (vals == vals.flat[0]).all() else "solve"))
    return blocks


class _Blocks:
    """A matching solved block by block (see _matching_blocks): the same interface as a
    single factor's result (u, v, jvp, vjp, n_iter, gap, converged), on the whole
    matching's (n_rows, n_cols) grid. A uniform block of r rows and c columns is 1 / c
    everywhere; its Jacobian keeps the row sums, and the column sums when r == c (then
    the rows fill the columns: they sum to one whatever the scores)."""

    def __init__(self, whole, blocks, results):
        self.whole, self.blocks, self.results = whole, blocks, results
        nr, nc = whole.factor.n_rows, whole.factor.n_cols
        self.u = np.zeros((nr, nc))
        for (rows, cols, kind), r in zip(blocks, results):
            self.u[_ix(rows, cols)] = r.u if kind == "solve" else 1.0 / cols.size
        self.v = np.zeros(0)
        self.n_iter = sum(int(r.n_iter) for r in results if r is not None)
        self.n_map = sum(int(getattr(r, "n_map", 0) or 0) for r in results if r is not None)
        self.gap = max([float(r.gap) for r in results if r is not None] + [0.0])
        self.converged = all(r.converged for r in results if r is not None)

    def jvp(self, d, dv=None):
        d = np.asarray(d).reshape(self.u.shape)
        out = np.zeros(self.u.shape)
        for (rows, cols, kind), r in zip(self.blocks, self.results):
            x = d[_ix(rows, cols)]
            if kind == "solve":
                out[_ix(rows, cols)] = r.jvp(x)
                continue
            y = x - x.mean(axis=1, keepdims=True)
            if rows.size == cols.size:
                y -= y.mean(axis=0, keepdims=True)
            out[_ix(rows, cols)] = y
        return out

    def vjp(self, g):
        return self.jvp(g), np.zeros(0)      # a projector: symmetric


def solve_whole(whole, eu, ev, max_iter, fixed=None, soft=None):
    """``(r, eta_u)``: the single factor's certified result ``r`` (a SparseMAPResult, or a
    _Blocks) and the graph's scores it solved (``fixed`` set to -inf); None when that
    solve did not certify an answer (the graph's own path then runs, and gives its own
    errors). ``max_iter``: the graph's iteration budget, which bounds the factor's
    solver too.

    ``fixed``: variables held at 0 (masks, and padding: -inf in the factor's scores;
    None: ``eu`` has no -inf either);
    ``soft``: those of them held for a huge negative score, which must be 0 at the
    solution of the scores as given too (as _masks_hold checks on the graph's path): no
    structure may beat the support at the given scores minus u, one MAP call."""
    eu_given = eu
    if fixed is not None and fixed.any():
        eu = np.where(fixed, -np.inf, eu)
    eta_u, eta_v = whole.scores(eu, ev)
    blocks = None
    if whole.kind == "matching" and fixed is not None and np.isneginf(eu).any():
        # masks and padding: the free variables' blocks, each an unmasked matching (a
        # mask that makes a column full by counting is not a constraint the matching's
        # own solver sees), or uniform (padding)
        blocks = _matching_blocks(whole, eu, np.isneginf(eu))
        if blocks is None:
            return None
    try:
        if blocks is None:
            r = _solve_unwarned(whole.factor, eta_u, eta_v, max_iter)
        else:
            r = _Blocks(whole, blocks, [
                _solve_unwarned(MatchingFactor(rows.size, cols.size), eta_u[_ix(rows, cols)],
                                None, max_iter) if kind == "solve" else None
                for rows, cols, kind in blocks])
    except ValueError:
        return None
    if not r.converged:
        return None
    if soft is not None and soft.any():
        f = whole.factor
        adj = eta_u - r.u
        given = whole.scores(np.where(soft, eu_given, eu), ev)[0] - r.u
        scale = max(1.0, float(np.abs(adj[np.isfinite(adj)]).max(initial=0.0)))
        if not (whole.kind == "matching" and _rows_bound(adj, given, 1e-9 * scale)):
            top = f.score(f.map(adj, eta_v), adj, eta_v)
            best = f.score(f.map(given, eta_v), given, eta_v)
            if not best <= top + 1e-9 * scale:
                return None
    return r, eu


def _rows_bound(adj, given, tol):
    """Whether no matching that uses a soft entry (finite in ``given``, -inf in ``adj``)
    scores above the best matching at ``adj`` (+ ``tol``), by a bound instead of two MAP
    calls; ``adj`` must admit a matching (the solve that calls this found one). Every
    row is matched (rows <= columns), so a matching's score is a sum of
    one entry per row: the best one's at ``adj`` is at least the sum of the rows'
    smallest finite entries, and one that uses the soft entry (i, j) scores at most
    given[i, j] plus the other rows' largest entries. False when the bound cannot tell
    (the MAP calls then decide)."""
    fin = np.isfinite(adj)
    if not fin.any(axis=1).all():
        return False
    low = np.where(fin, adj, np.inf).min(axis=1).sum()
    top_rows = np.where(np.isfinite(given), given, -np.inf).max(axis=1)
    soft = np.isfinite(given) & ~fin
    if not np.isfinite(top_rows).all():
        return False
    worst = (given - top_rows[:, None])[soft].max(initial=-np.inf)
    return bool(top_rows.sum() + worst <= low + tol)

