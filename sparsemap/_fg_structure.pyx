"""The structure of a factor graph: what every solve of it shares.

``_Structure`` holds the links (each factor's parts, flat), their variables, signs and
shifts, the degrees, the groups of links whose literals sum to a constant, the
counting parts that tell some infeasible graphs without a solve, and (``_Faces``)
the factors' constraints for the backward pass's face completion. Built once per
graph structure by ``sparsemap._factor_graph.FactorGraph``; the engine
(``sparsemap._fg_admm`` and its extensions) only reads it.
"""

import numpy as np

from sparsemap._factors._logic import (AndOutFactor, AtMostOneFactor, BudgetFactor,
                                       ImplyFactor, KnapsackFactor, OrFactor, OrOutFactor,
                                       PairFactor, SequenceBudgetFactor, XorFactor,
                                       XorOutFactor)
from sparsemap._factors._matching import MatchingFactor
from sparsemap._factors._sequence import SequenceFactor
from sparsemap._factors._tree import TreeFactor


class _Structure:
    """What every solve of a graph shares: the links (each factor's parts, flat), their
    variables, signs and shifts, the degrees, and the groups of links whose literals sum
    to a constant (see _constant_sums). Built once per graph structure (FactorGraph
    keeps it until a factor or variable is added); engines only read it."""

    def __init__(self, factors, variables, negated, n_variables):
        F = len(factors)
        self.factors = list(factors)
        self.variables, self.negated = list(variables), list(negated)
        self.F, self.V = F, n_variables
        nu = [f.n_u for f in factors]
        nv = [f.n_v for f in factors]
        self.uoff = np.zeros(F + 1, dtype=np.intp)
        self.voff = np.zeros(F + 1, dtype=np.intp)
        np.cumsum(nu, out=self.uoff[1:])
        np.cumsum(nv, out=self.voff[1:])
        self.L, self.LV = int(self.uoff[F]), int(self.voff[F])
        self.max_nu, self.max_nv = max(nu + [1]), max(nv + [1])
        # every link array gets one spare entry, so that none is empty
        self.var = np.concatenate([np.asarray(v, dtype=np.intc).reshape(-1) for v in variables]
                                  + [np.full(1, -1, np.intc)]).astype(np.intc)
        neg = np.concatenate([np.asarray(v, dtype=bool).reshape(-1) for v in negated]
                             + [np.zeros(1, bool)])
        self.tied = self.var >= 0
        self.sig = np.where(neg, -1.0, 1.0)
        self.sh = np.where(neg, 1.0, 0.0)
        self.deg = np.bincount(self.var[self.tied], minlength=n_variables + 1).astype(np.intc)
        self.nofix = np.zeros(n_variables + 1, dtype=np.int8)
        self.nomask = np.zeros(self.L + 1, dtype=np.int8)
        self.factor_of = np.repeat(np.arange(F), nu)          # per link (no spare)
        # groups of links whose literals sum to a constant (plain parts only): id per link
        gid = np.full(self.L, -1, dtype=np.intp)
        k = 0
        for f, factor in enumerate(factors):
            for g in _constant_sums(factor):
                links = self.uoff[f] + g
                if np.all(self.var[links] >= 0) and not np.any(neg[links]):
                    gid[links] = k
                    k += 1
        self.group, self.n_groups = gid, k
        self.counting = _counting_parts(self, factors, neg)
        self._faces = None

    def faces(self):
        """The factors' constraints for the backward pass's face completion (_Faces)."""
        if self._faces is None:
            self._faces = _Faces(self.factors)
        return self._faces


def _cardinality(factor):
    """(lo, hi): the bounds a factor puts on the sum of its parts, when those are all it
    says (a XorFactor, AtMostOneFactor, OrFactor, BudgetFactor); else None."""
    if isinstance(factor, XorFactor):
        return 1, 1
    if isinstance(factor, AtMostOneFactor):
        return 0, 1
    if isinstance(factor, OrFactor):
        return 1, factor.n_u
    if isinstance(factor, BudgetFactor):
        return (factor.budget if factor.exact else 0), factor.budget
    return None


def _counting_parts(st, factors, neg):
    """Parts of a graph where a count proves infeasibility at once: sets of cardinality
    factors (plain, distinct variables) that split into two sides, each covering every
    variable of the set exactly once (the rows and the columns of an alignment). Then
    every point has sum(lo, side A) <= sum(u) <= sum(hi, side B), and the reverse: more
    Xor rows than AtMostOne columns is infeasible. Returns [(side A, side B, lo, hi)],
    lo and hi per factor of the graph."""
    F = len(factors)
    lo = np.zeros(F)
    hi = np.zeros(F)
    card = np.zeros(F, bool)
    for f, factor in enumerate(factors):
        b = _cardinality(factor)
        links = np.arange(st.uoff[f], st.uoff[f + 1])
        v = st.var[links]
        if b is None or np.any(v < 0) or np.any(neg[links]) or np.unique(v).size != v.size:
            continue
        card[f] = True
        lo[f], hi[f] = b
    if card.sum() < 2:
        return []
    links = np.flatnonzero(card[st.factor_of])
    var, fac = st.var[links], st.factor_of[links]
    uses = np.bincount(var, minlength=st.V)
    # factors joined through variables shared by exactly two cardinality factors
    by_var = {}
    for v, f in zip(var.tolist(), fac.tolist()):
        by_var.setdefault(v, []).append(f)
    adj = {}
    for v, fs in by_var.items():
        if len(fs) == 2:
            a, b = fs
            adj.setdefault(a, set()).add(b)
            adj.setdefault(b, set()).add(a)
    side = {}
    out = []
    for f0 in adj:
        if f0 in side:
            continue
        side[f0] = 0
        comp, stack, ok = [f0], [f0], True
        while stack:
            f = stack.pop()
            for g in adj[f]:
                if g not in side:
                    side[g] = 1 - side[f]
                    comp.append(g)
                    stack.append(g)
                elif side[g] == side[f]:
                    ok = False
        # every variable of the component in one factor of each side
        if ok and all(uses[v] == 2 for f in comp
                      for v in st.var[st.uoff[f]:st.uoff[f + 1]].tolist()):
            A = np.array(sorted(f for f in comp if side[f] == 0))
            B = np.array(sorted(f for f in comp if side[f] == 1))
            out.append((A, B))
    return [(A, B, lo, hi) for A, B in out]


def _count_conflict(st, fixed):
    """(side A, side B, need, room) of a counting part that no point satisfies: one
    side needs more variables on than the other has room for (room shrinks with the
    masked variables), or None."""
    if not st.counting:
        return None
    room_cut = None
    if fixed is None:
        fixed = np.zeros(st.V, bool)
    if fixed is not None and fixed.any():
        links = np.flatnonzero(st.tied[:st.L] & fixed[np.maximum(st.var[:st.L], 0)])
        room_cut = np.bincount(st.factor_of[links], minlength=st.F)
    for A, B, lo, hi in st.counting:
        n = np.diff(st.uoff)
        hi_eff = hi if room_cut is None else np.minimum(hi, n - room_cut)
        for X, Y in ((A, B), (B, A)):
            need, room = lo[X].sum(), hi_eff[Y].sum()
            if need > room:
                return X, Y, float(need), float(room)
    return None



def _constant_sums(factor):
    """Groups of a factor's unary parts (flat indices) whose sum is the same for every
    structure: a row of a XorFactor or an exact budget, a position of a sequence, the
    heads of a tree's word, the rows (or columns) of a matching that match them all."""
    cdef Py_ssize_t n, m
    if isinstance(factor, XorFactor) or (isinstance(factor, (BudgetFactor, SequenceBudgetFactor))
                                         and factor.exact):
        return [np.arange(factor.n_u)]
    if isinstance(factor, SequenceFactor):
        return list(np.arange(factor.n_u).reshape(factor.shape_u))
    if isinstance(factor, TreeFactor):
        n = factor.n_words + 1
        return [np.array([h * n + m for h in range(n) if h != m]) for m in range(1, n)]
    if isinstance(factor, MatchingFactor):
        ix = np.arange(factor.n_u).reshape(factor.shape_u)
        if factor.n_rows <= factor.n_cols:
            return list(ix)
        return list(ix.T)
    return []



def _linear_rows(factor):
    """The factor's polytope's inequalities beyond the box: [(idx, coef, lo, hi)] over
    the concatenated parts (unary, then additional: index n_u + k), and whether they,
    with 0 <= x <= 1 and the family's equalities, describe the polytope completely.
    None for a family whose description this does not know (then only the box)."""
    n = factor.n_u
    ix = np.arange(n)
    one = np.ones(n)
    if isinstance(factor, (XorFactor, XorOutFactor)):
        return [], True                      # an equality: tight everywhere
    if isinstance(factor, AtMostOneFactor):
        return [(ix, one, -np.inf, 1.0)], True
    if isinstance(factor, OrFactor):
        return [(ix, one, 1.0, np.inf)], True
    if isinstance(factor, BudgetFactor):
        return ([] if factor.exact else [(ix, one, -np.inf, float(factor.budget))]), True
    if isinstance(factor, ImplyFactor):
        # OR of the negated first n - 1 and the last: -sum_{i<n} x_i + x_n >= 2 - n
        c = -one
        c[n - 1] = 1.0
        return [(ix, c, 2.0 - n, np.inf)], True
    if isinstance(factor, OrOutFactor):
        rows = [(np.array([i, n - 1]), np.array([1.0, -1.0]), -np.inf, 0.0)
                for i in range(n - 1)]
        c = -one
        c[n - 1] = 1.0
        return rows + [(ix, c, -np.inf, 0.0)], True
    if isinstance(factor, AndOutFactor):
        rows = [(np.array([i, n - 1]), np.array([-1.0, 1.0]), -np.inf, 0.0)
                for i in range(n - 1)]
        c = one.copy()
        c[n - 1] = -1.0
        return rows + [(ix, c, -np.inf, n - 2.0)], True
    if isinstance(factor, PairFactor):
        # v = y0 y1: max(0, y0 + y1 - 1) <= v <= min(y0, y1)
        return [(np.array([0, 1, 2]), np.array([-1.0, -1.0, 1.0]), -1.0, np.inf),
                (np.array([0, 2]), np.array([-1.0, 1.0]), -np.inf, 0.0),
                (np.array([1, 2]), np.array([-1.0, 1.0]), -np.inf, 0.0)], True
    if isinstance(factor, KnapsackFactor):
        return [(ix, np.asarray(factor.costs, dtype=np.float64).reshape(-1), -np.inf,
                 float(factor.budget))], True
    if isinstance(factor, SequenceFactor):
        return [], True                      # the chain's local polytope: equalities, x >= 0
    if isinstance(factor, MatchingFactor):
        g = np.arange(n).reshape(factor.shape_u)
        if factor.n_rows == factor.n_cols:
            return [], True
        longer = g.T if factor.n_rows < factor.n_cols else g   # the side matched at most once
        return [(r, np.ones(r.size), -np.inf, 1.0) for r in longer], True
    return [], False


class _Faces:
    """Per factor of a graph, the constraints of its polytope beyond its equalities, for
    the backward pass's face completion (_Engine.complete_faces), flat over factors:
    ``xbin`` (per part, unary then additional, from ``xoff[f]``) marks the 0/1 parts whose
    bounds 0 <= x <= 1 are listed; rows ``rfac[f]..rfac[f + 1]`` are factor f's
    inequalities ``lo <= coef . x[idx] <= hi`` (entries ``rptr[r]..rptr[r + 1]``);
    ``complete[f]``: these, the bounds and the family's equalities describe the
    polytope (_linear_rows), so the completed face is the smallest one holding the
    factor's point. Built once per graph structure, at its first backward pass."""

    def __init__(self, factors):
        xbin, xoff, rfac, rptr = [], [0], [0], [0]
        ridx, rcoef, rlo, rhi, complete = [], [], [], [], []
        for factor in factors:
            nu, nv = factor.n_u, factor.n_v
            binary = np.ones(nu + nv, np.int8)
            nb = factor._non_binary_parts()
            if nb is not None and len(nb):
                binary[np.asarray(nb, dtype=np.intp)] = 0
            if not isinstance(factor, SequenceFactor):
                binary[nu:] = 0   # a sequence's transitions are 0/1; a pair's v has rows
            rows, full = _linear_rows(factor)
            xbin.append(binary)
            xoff.append(xoff[len(xoff) - 1] + nu + nv)
            for idx, c, lo, hi in rows:
                ridx.append(np.asarray(idx, dtype=np.intp))
                rcoef.append(np.asarray(c, dtype=np.float64))
                rptr.append(rptr[len(rptr) - 1] + len(idx))
                rlo.append(lo)
                rhi.append(hi)
            rfac.append(rfac[len(rfac) - 1] + len(rows))
            complete.append(full)
        self.xbin = np.concatenate(xbin + [np.zeros(1, np.int8)]).astype(np.int8)
        self.xoff = np.asarray(xoff, dtype=np.intp)
        self.rfac = np.asarray(rfac, dtype=np.intp)
        self.rptr = np.asarray(rptr, dtype=np.intp)
        self.ridx = np.concatenate(ridx + [np.zeros(1, np.intp)]).astype(np.intp)
        self.rcoef = np.concatenate(rcoef + [np.zeros(1)]).astype(np.float64)
        self.rlo = np.asarray(rlo + [0.0], dtype=np.float64)
        self.rhi = np.asarray(rhi + [0.0], dtype=np.float64)
        self.complete = np.asarray(complete, dtype=bool)
