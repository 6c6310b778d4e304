"""Graphs that are exactly one factor's polytope, solved as that factor.

Each recognised shape is checked against the same graph solved by the graph's own
path (ADMM, the polish and its KKT certificate; ``_solve_quiet(..., whole=False)``),
which is independent of the single-factor solvers, at flat, peaked, masked and padded
scores: u, v, the per-factor supports, and jvp / vjp (eta_u and eta_v).
"""
import numpy as np
import pytest

import sparsemap as sm
from sparsemap._factor_graph import _WholeResult

FILL = float(np.finfo(np.float32).min)


def matching_graph(P, H, cols="AtMostOne", transpose=False):
    fg = sm.FactorGraph(P * H)
    ix = np.arange(P * H).reshape(P, H)
    col = sm.AtMostOneFactor if cols == "AtMostOne" else sm.XorFactor
    rows = [(sm.XorFactor(H), ix[i]) for i in range(P)]
    colf = [(col(P), ix[:, j]) for j in range(H)]
    for f, v in (colf + rows if transpose else rows + colf):
        fg.add(f, v)
    return fg


def chain_graph(n, rng):
    """Pair factors along a path through the variables, in a shuffled order."""
    order = rng.permutation(n)
    fg = sm.FactorGraph(n)
    for i in range(n - 1):
        a, b = order[i], order[i + 1]
        fg.add(sm.PairFactor(), [a, b] if rng.random() < 0.5 else [b, a])
    return fg


def tree_graph(n):
    fg = sm.FactorGraph(n * n)
    var = np.full((n + 1, n + 1), -1)
    k = 0
    for h in range(n + 1):
        for m in range(1, n + 1):
            if h != m:
                var[h, m] = k
                k += 1
    fg = sm.FactorGraph(k)
    fg.add(sm.TreeFactor(n), var)
    return fg


def scores(rng, n, scale, mask=0.0):
    x = rng.standard_normal(n) * scale
    if mask:
        x[rng.random(n) < mask] = -np.inf
    return x


def compare(fg, eu, ev, rng, whole=True):
    r = fg.solve(eu, ev)
    ref = fg._solve_quiet(eu, ev, whole=False)
    assert isinstance(r, _WholeResult) == whole and not isinstance(ref, _WholeResult)
    assert ref.polished
    np.testing.assert_allclose(r.u, ref.u, atol=1e-9)
    for a, b in zip(r.v, ref.v):
        np.testing.assert_allclose(a, b, atol=1e-9)
    # each factor's support reproduces its marginals
    for f, factor in enumerate(fg.factors):
        m = sum(w * factor.vertex(s)[0].reshape(-1) for s, w in zip(r.structures[f], r.weights[f]))
        var = np.asarray(fg.variables[f]).reshape(-1)
        np.testing.assert_allclose(m[var >= 0], r.u[var[var >= 0]], atol=1e-9)
        assert (r.weights[f] > 0).all() and abs(r.weights[f].sum() - 1) < 1e-12
    d = rng.standard_normal(fg.n_variables)
    dv = [rng.standard_normal(f.shape_v) if f.n_v else None for f in fg.factors]
    np.testing.assert_allclose(r.jvp(d, dv), ref.jvp(d, dv), atol=1e-8)
    gu, gv = r.vjp(d)
    hu, hv = ref.vjp(d)
    np.testing.assert_allclose(gu, hu, atol=1e-8)
    for a, b in zip(gv, hv):
        np.testing.assert_allclose(a, b, atol=1e-8)
    return r


@pytest.mark.parametrize("scale", [0.01, 1.0, 100.0])
@pytest.mark.parametrize("mask", [0.0, 0.2])
@pytest.mark.parametrize("shape", [(4, 4, "AtMostOne"), (3, 6, "AtMostOne"), (5, 5, "Xor")])
def test_matching_alignment_is_a_matching_factor(shape, scale, mask):
    P, H, cols = shape
    rng = np.random.default_rng(P * H)
    for transpose in (False, True):
        fg = matching_graph(P, H, cols, transpose)
        eu = scores(rng, P * H, scale, mask)
        # masks scattered inside the block: the graph's path (a mask can make a column
        # full by counting, a constraint the matching's solver does not see)
        try:
            r = compare(fg, eu, None, rng, whole=not mask)
        except ValueError:            # masks that leave a row nothing: the graph's error
            with pytest.raises(ValueError, match="infeasible"):
                fg.solve(eu)
            continue
        assert ("MatchingFactor" in r.message) == (not mask)


@pytest.mark.parametrize("real, padded", [((3, 5), (6, 8)), ((5, 5), (8, 8)), ((4, 7), (5, 9))])
def test_padded_matching_is_solved_whole(real, padded):
    (P, H), (Pp, Hp) = real, padded
    rng = np.random.default_rng(P + H)
    X = np.full((Pp, Hp), FILL)
    X[:P, :H] = rng.standard_normal((P, H))
    r = compare(matching_graph(Pp, Hp), X.ravel(), None, rng)
    ref = matching_graph(P, H).solve(X[:P, :H].ravel())
    np.testing.assert_allclose(r.u.reshape(Pp, Hp)[:P, :H], ref.u.reshape(P, H), atol=1e-12)


@pytest.mark.parametrize("scale", [0.01, 0.1, 1.0, 100.0])
def test_pair_chain_is_a_binary_sequence(scale):
    rng = np.random.default_rng(int(scale * 100))
    for n in (2, 3, 6, 9):
        fg = chain_graph(n, rng)
        eu = scores(rng, n, scale)
        ev = [rng.standard_normal(1) * scale for _ in fg.factors]
        r = compare(fg, eu, ev, rng)
        # one pair is itself
        assert ("SequenceBudgetFactor" if n > 2 else "PairFactor") in r.message


def test_pair_chain_with_a_mask():
    rng = np.random.default_rng(3)
    fg = chain_graph(6, rng)
    eu = scores(rng, 6, 1.0)
    eu[2] = -np.inf
    r = compare(fg, eu, [rng.standard_normal(1) for _ in fg.factors], rng)
    assert r.u[2] == 0.0


@pytest.mark.parametrize("scale", [0.01, 1.0])
def test_one_factor_is_itself(scale):
    rng = np.random.default_rng(0)
    fg = tree_graph(4)
    compare(fg, scores(rng, fg.n_variables, scale), None, rng)
    fg = sm.FactorGraph(12)
    fg.add(sm.SequenceFactor(4, 3), rng.permutation(12).reshape(4, 3))
    compare(fg, scores(rng, 12, scale), [rng.standard_normal((3, 3, 3)) * scale], rng)


def test_shapes_that_are_not_one_factor_take_the_graph_path():
    rng = np.random.default_rng(0)
    graphs = []
    fg = matching_graph(3, 4)
    fg.add(sm.BudgetFactor(2, 1), [0, 5])            # a constraint across
    graphs.append(fg)
    fg = sm.FactorGraph(12)                           # AtMostOne on both sides
    ix = np.arange(12).reshape(3, 4)
    for i in range(3):
        fg.add(sm.AtMostOneFactor(4), ix[i])
    for j in range(4):
        fg.add(sm.AtMostOneFactor(3), ix[:, j])
    graphs.append(fg)
    fg = sm.FactorGraph(3)                            # a cycle of pairs
    for a, b in ((0, 1), (1, 2), (2, 0)):
        fg.add(sm.PairFactor(), [a, b])
    graphs.append(fg)
    fg = sm.FactorGraph(4)                            # a negated part
    fg.add(sm.XorFactor(4), np.arange(4), [True, False, False, False])
    graphs.append(fg)
    for fg in graphs:
        assert fg._structure().whole is None
        r = fg.solve(rng.standard_normal(fg.n_variables),
                     [np.zeros(f.shape_v) if f.n_v else None for f in fg.factors])
        assert not isinstance(r, _WholeResult)


def test_an_explicit_max_iter_runs_admm():
    fg = matching_graph(4, 5)
    eu = np.random.default_rng(0).standard_normal(20)
    assert isinstance(fg.solve(eu), _WholeResult)
    assert not isinstance(fg.solve(eu, max_iter=1000), _WholeResult)


@pytest.mark.parametrize("seed", range(40))
def test_soft_mask_bound_never_passes_what_enumeration_refuses(seed):
    """The bound that replaces the two MAP calls of the padded-matching check: whenever
    it says no matching through a soft entry beats the best one that avoids them, the
    enumeration of every matching agrees, when some matching avoids the soft entries
    (as in the solve that calls it; the bound may refuse more: then the MAP calls
    decide)."""
    import itertools
    from sparsemap._fg_whole import _rows_bound
    rng = np.random.default_rng(seed)
    nc = int(rng.integers(3, 5))
    nr = int(rng.integers(1, nc + 1))
    adj = rng.normal(size=(nr, nc)) * rng.choice([0.1, 1.0, 10.0])
    soft = rng.random((nr, nc)) < 0.3
    given = adj.copy()
    # soft entries: from barely below the others to the padding fill
    given[soft] = -10.0 ** rng.uniform(-1, 38, size=soft.sum())
    adj = np.where(soft, -np.inf, adj)
    tol = 1e-9
    said = _rows_bound(adj, given, tol)

    def best(x):
        return max(sum(x[i, p[i]] for i in range(nr))
                   for p in itertools.permutations(range(nc), nr))
    if said and np.isfinite(best(adj)):       # the bound's premise: a matching avoids them
        assert best(given) <= best(adj) + tol


@pytest.mark.parametrize("seed", range(30))
def test_mask_candidates_are_the_scores_beyond_the_first_gap(seed):
    """The finite scores tried as masks: those at or beyond the first magnitude that
    dwarfs (by MASK_GAP) every smaller negative score's and the largest other magnitude
    (1, the positive scores, eta_v's), by their definition, one score at a time."""
    from sparsemap._factor_graph import MASK_GAP, _mask_candidates
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    # magnitudes in clusters a few gaps apart (padding fills, several of them, ties)
    eu = -10.0 ** rng.choice([-1.0, 0.5, 3.0, 7.0, 13.0, 20.0, 38.0], size=n)
    eu[rng.random(n) < 0.3] = rng.normal(size=n)[:1]
    hard = rng.random(n) < 0.1
    eu[hard] = -np.inf
    ev = [rng.normal(size=2) * rng.choice([1.0, 1e4])]
    rest = max([1.0] + [x for x, h in zip(eu, hard) if not h and x >= 0]
               + [float(np.abs(ev[0]).max())])
    mags = [-x for x, h in zip(eu, hard) if not h and x < 0]
    starts = [m for m in mags if m / MASK_GAP > max([rest] + [x for x in mags if x < m])]
    want = np.array([not h and x < 0 and bool(starts) and -x >= min(starts)
                     for x, h in zip(eu, hard)])
    np.testing.assert_array_equal(_mask_candidates(eu, ev, hard), want)
