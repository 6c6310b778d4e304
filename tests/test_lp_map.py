"""LP-MAP decoding (FactorGraph.solve_map) against SciPy's HiGHS and brute-force MAP.

References, none of which goes through the package's solvers:
- the LP over the local polytope written with every factor's configurations as
  explicit columns (built from the definitions, tests/test_factor_graph.py), solved
  by scipy.optimize.linprog (HiGHS);
- MAP by enumeration of every 0/1 assignment of the variables, each factor scoring
  its best configuration that agrees with it.
"""
import itertools
import warnings

import numpy as np
import pytest
from scipy.optimize import linprog

import sparsemap as sm
from sparsemap.testing import dense_columns, enumerate_structures

from test_factor_graph import GRAPHS, make


def lp_reference(V, cols, eta_u, eta_v):
    """max eta_u . u + sum_f eta_v[f] . N_f p_f  s.t.  M_f p_f = l_f(u), p_f in the simplex."""
    eta_u = np.asarray(eta_u, float)
    n_p = [M.shape[1] for M, _, _, _ in cols]
    n = V + sum(n_p)
    c = np.zeros(n)
    c[:V] = -eta_u
    A, b = [], []
    deg = np.zeros(V, int)
    at = V
    for f, (M, N, var, neg) in enumerate(cols):
        neg = np.zeros(var.shape, bool) if neg is None else np.asarray(neg).reshape(-1)
        if N is not None and eta_v is not None and eta_v[f] is not None:
            c[at:at + n_p[f]] = -(N.T @ np.asarray(eta_v[f]).reshape(-1))
        for r in np.flatnonzero(var >= 0):
            row = np.zeros(n)
            row[at:at + n_p[f]] = M[r]
            row[var[r]] = 1.0 if neg[r] else -1.0      # M p - l(u) = 0, l = u or 1 - u
            A.append(row)
            b.append(1.0 if neg[r] else 0.0)
            deg[var[r]] += 1
        row = np.zeros(n)
        row[at:at + n_p[f]] = 1.0
        A.append(row)
        b.append(1.0)
        at += n_p[f]
    bounds = [(0, 1) if deg[i] == 0 else (None, None) for i in range(V)] + [(0, None)] * sum(n_p)
    res = linprog(c, A_eq=np.array(A), b_eq=np.array(b), bounds=bounds, method="highs")
    assert res.status == 0
    return -res.fun


def brute_force_map(V, cols, eta_u, eta_v):
    """Best joint 0/1 configuration, by enumeration of the variables' assignments."""
    best = -np.inf
    for z in itertools.product((0, 1), repeat=V):
        z = np.array(z)
        total = float(np.asarray(eta_u) @ z)
        for f, (M, N, var, neg) in enumerate(cols):
            neg = np.zeros(var.shape, bool) if neg is None else np.asarray(neg).reshape(-1)
            tied = np.flatnonzero(var >= 0)
            lit = np.where(neg[tied], 1 - z[var[tied]], z[var[tied]])
            ok = np.all(M[tied] == lit[:, None], axis=0)
            if not ok.any():
                total = -np.inf
                break
            if N is not None and eta_v is not None and eta_v[f] is not None:
                total += (N.T @ np.asarray(eta_v[f]).reshape(-1))[ok].max()
        best = max(best, total)
    return best


CASES = [(name, seed) for name in GRAPHS for seed in (0, 1, 2)]


@pytest.mark.parametrize("name,seed", CASES)
def test_lp_value_matches_highs(name, seed):
    fg, cols, eta_u, eta_v, ev_flat = make(name, seed)
    r = fg.solve_map(eta_u, eta_v)
    ref = lp_reference(fg.n_variables, cols, eta_u, ev_flat)
    scale = max(1.0, abs(ref))
    assert r.converged
    assert abs(r.lp_value - ref) <= 1e-7 * scale
    assert r.dual_bound >= ref - 1e-7 * scale          # a valid upper bound
    assert -1e-9 * scale <= r.gap <= 1e-7 * scale
    assert r.primal_residual <= 1e-8
    # the point is in the local polytope: each factor's marginals are a mixture of structures
    for f, (factor, var, neg) in enumerate(zip(fg.factors, fg.variables, fg.negated)):
        m = sum(w * factor.vertex(s)[0] for s, w in zip(r.structures[f], r.weights[f]))
        tied = var >= 0
        lit = np.where(neg, 1.0 - r.u[np.maximum(var, 0)], r.u[np.maximum(var, 0)])
        np.testing.assert_allclose(m[tied], lit[tied], atol=1e-8)
    if fg.n_variables <= 10:
        best = brute_force_map(fg.n_variables, cols, eta_u, ev_flat)
        assert best <= ref + 1e-9 * scale                # MAP <= LP
        if r.integral:                                  # then the relaxation is tight
            assert r.exact and r.map is not None
            assert r.map.score == pytest.approx(best, abs=1e-7 * scale)
            assert r.map.score == pytest.approx(r.lp_value, abs=1e-7 * scale)
        if best < ref - 1e-6 * scale:                   # a loose relaxation cannot be integral
            assert not r.integral and r.map is None and not r.exact


def test_frustrated_cycle_is_fractional():
    fg = sm.FactorGraph(3)
    for pair in ([0, 1], [1, 2], [0, 2]):
        fg.add(sm.AtMostOneFactor(2), pair)
    r = fg.solve_map(np.ones(3))
    np.testing.assert_allclose(r.u, [0.5, 0.5, 0.5], atol=1e-9)
    assert r.lp_value == pytest.approx(1.5, abs=1e-12) and r.gap <= 1e-9
    assert not r.integral and r.map is None and not r.exact
    r = fg.solve_map(np.array([1.0, -0.2, 0.9]))          # tight: u = (1, 0, 0)
    assert r.exact and r.map.u.tolist() == [1, 0, 0] and r.map.score == pytest.approx(1.0)


@pytest.mark.parametrize("scale", [1e-4, 1e-2, 1.0, 1e2, 1e4])
def test_scale_invariance(scale):
    fg, cols, eta_u, eta_v, ev_flat = make("negations", 3)
    ref = lp_reference(fg.n_variables, cols, scale * eta_u, None)
    r = fg.solve_map(scale * eta_u)
    assert r.converged and abs(r.lp_value - ref) <= 1e-7 * max(scale, abs(ref))


def test_separable_graph_is_exact_map():
    # two independent pairs (lp-sparsemap's test_map_with_additionals), a free variable
    rng = np.random.default_rng(0)
    for _ in range(10):
        eta = rng.standard_normal(5)
        t = rng.standard_normal(2)
        fg = sm.FactorGraph(5)
        fg.add(sm.PairFactor(), [0, 1])
        fg.add(sm.PairFactor(), [2, 3], negated=[True, False])
        r = fg.solve_map(eta, [t[:1], t[1:]])
        assert r.exact and r.n_solves == 0 and r.gap == 0.0
        best = -np.inf
        for z in itertools.product((0, 1), repeat=5):
            z = np.array(z)
            val = eta @ z + t[0] * z[0] * z[1] + t[1] * (1 - z[2]) * z[3]
            best = max(best, val)
        assert r.map.score == pytest.approx(best, abs=1e-12)
        assert r.lp_value == pytest.approx(best, abs=1e-12)
        assert set(np.unique(r.u)) <= {0.0, 1.0}


@pytest.mark.parametrize("projective", [False, True])
def test_single_tree_is_exact_map(projective):
    rng = np.random.default_rng(1)
    n = 4
    f = sm.TreeFactor(n, projective=projective)
    var = -np.ones((n + 1, n + 1), int)
    mask = ~np.eye(n + 1, dtype=bool)
    mask[:, 0] = False
    var[mask] = np.arange(mask.sum())
    fg = sm.FactorGraph(int(mask.sum()))
    fg.add(f, var)
    from _reference import all_trees, arc_matrix
    for _ in range(5):
        eta = rng.standard_normal(fg.n_variables)
        r = fg.solve_map(eta)
        best = max(arc_matrix(h)[mask] @ eta for h in all_trees(n, projective=projective))
        assert r.exact and r.map.score == pytest.approx(best, abs=1e-12)


def test_knapsack_and_imply_in_a_graph():
    """The knapsack polytope is not 0/1: the LP may be fractional even on one factor."""
    rng = np.random.default_rng(2)
    kn = sm.KnapsackFactor([1.0, 2.0, 1.5, 0.5], 2.2)
    K = np.array(enumerate_structures(kn)).T
    im = sm.ImplyFactor(3)
    I = dense_columns(im, enumerate_structures(im))[0]
    for _ in range(6):
        fg = sm.FactorGraph(6)
        fg.add(kn, [0, 1, 2, 3])
        fg.add(im, [2, 4, 5])
        fg.add(sm.XorFactor(2), [3, 5], negated=[True, False])
        X = np.array([[1, 0], [0, 1]], float).T
        eta = rng.standard_normal(6) + 0.3
        r = fg.solve_map(eta)
        cols = [(K, None, np.array([0, 1, 2, 3]), None), (I, None, np.array([2, 4, 5]), None),
                (X, None, np.array([3, 5]), np.array([True, False]))]
        ref = lp_reference(6, cols, eta, None)
        assert r.converged and abs(r.lp_value - ref) <= 1e-7 * max(1, abs(ref))


def test_bad_input():
    fg = sm.FactorGraph(3)
    fg.add(sm.XorFactor(2), [0, 1])
    fg.add(sm.XorFactor(2), [1, 2])
    with pytest.raises(ValueError, match=r"eta_u: expected shape \(3,\)"):
        fg.solve_map(np.zeros(4))
    with pytest.raises(ValueError, match="eta_u: contains non-finite"):
        fg.solve_map(np.array([0.0, np.nan, 1.0]))
    with pytest.raises(ValueError, match="eta_v: expected a list"):
        fg.solve_map(np.zeros(3), np.zeros(2))
    with pytest.raises(ValueError, match="max_iter: expected a positive integer"):
        fg.solve_map(np.zeros(3), max_iter=0)
    with pytest.raises(ValueError, match="tol: expected a finite non-negative float"):
        fg.solve_map(np.zeros(3), tol=-1.0)


def test_zero_scores_and_empty_graph():
    fg = sm.FactorGraph(2)
    r = fg.solve_map(np.array([0.5, -0.5]))             # no factor: u = [eta > 0]
    assert r.exact and r.u.tolist() == [1.0, 0.0] and r.lp_value == 0.5
    fg.add(sm.XorFactor(2), [0, 1])
    fg.add(sm.AtMostOneFactor(2), [0, 1])
    r = fg.solve_map(np.zeros(2))
    assert r.converged and r.lp_value == 0.0


def random_graphs(n_graphs, seed=0):
    """Random graphs of pairs, budgets, ors, implications and knapsacks over 10 variables,
    with negations: many have fractional LP optima; the infeasible ones are skipped."""
    rng = np.random.default_rng(seed)
    for _ in range(n_graphs):
        V = 10
        fg, cols, ev = sm.FactorGraph(V), [], []
        for _ in range(12):
            kind = rng.integers(5)
            f = [sm.PairFactor(), sm.BudgetFactor(3, 1), sm.OrFactor(3), sm.ImplyFactor(3),
                 None][kind] or sm.KnapsackFactor(rng.random(3) + 0.2, 0.8)
            var = rng.choice(V, f.n_u, replace=False)
            neg = rng.random(f.n_u) < 0.3
            fg.add(f, var, neg)
            M, N = dense_columns(f, enumerate_structures(f))
            cols.append((M.reshape(f.n_u, -1), N.reshape(f.n_v, -1) if f.n_v else None, var, neg))
            ev.append(rng.normal(size=f.shape_v) * 2 if f.n_v else None)
        eta = rng.normal(size=V)
        yield fg, cols, eta, ev


def test_random_graphs_against_highs():
    n_checked = n_fractional = 0
    for fg, cols, eta, ev in random_graphs(40):
        ev_flat = [None if e is None else e.ravel() for e in ev]
        try:
            ref = lp_reference(fg.n_variables, cols, eta, ev_flat)
        except AssertionError:      # an empty local polytope
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error", sm.ConvergenceWarning)
            r = fg.solve_map(eta, ev)
        scale = max(1.0, abs(ref))
        assert r.converged and abs(r.lp_value - ref) <= 1e-7 * scale
        assert -1e-9 * scale <= r.gap <= 1e-7 * scale
        n_checked += 1
        n_fractional += not r.integral
    assert n_checked >= 30 and n_fractional >= 10


def test_all_zero_scores_on_a_loopy_graph():
    """Zero scores: every feasible point is optimal; the gap is checked against tol itself."""
    fg = sm.FactorGraph(3)
    for pair in ([0, 1], [1, 2], [0, 2]):
        fg.add(sm.XorFactor(2), pair, negated=[False, True])   # u0 = u1 = u2 (and a cycle)
    fg.add(sm.OrFactor(3), [0, 1, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("error", sm.ConvergenceWarning)
        r = fg.solve_map(np.zeros(3))
    assert r.converged and r.lp_value == 0.0 and abs(r.gap) <= 1e-9
    # feasible: u = (t, t, t) with 3 t >= 1; every point is optimal, the least-norm one returned
    np.testing.assert_allclose(r.u, np.full(3, 1 / 3), atol=1e-9)


def test_loopy_pair_grid_needing_column_generation():
    """A 6 x 6 grid of pairs with strong couplings, where growing t stops paying before the
    cheap bound certifies (ADMM slows down): column generation finishes the certificate."""
    rng = np.random.default_rng(1)
    n = 6
    fg = sm.FactorGraph()
    x = fg.add_variables((n, n))
    ev, cols = [], []
    P = sm.PairFactor()
    M, N = dense_columns(P, enumerate_structures(P))
    for i in range(n):
        for j in range(n):
            for di, dj in ((0, 1), (1, 0)):
                if i + di < n and j + dj < n:
                    pair = sm.VariableArray.stack([x[i, j], x[i + di, j + dj]])
                    fg.add(P, pair)
                    ev.append(3 * rng.standard_normal(1))
                    cols.append((M.reshape(2, -1), N.reshape(1, -1), pair.ids, None))
    eta = rng.standard_normal((n, n))
    with warnings.catch_warnings():
        warnings.simplefilter("error", sm.ConvergenceWarning)
        r = fg.solve_map({x: eta}, ev)
    ref = lp_reference(n * n, cols, eta.ravel(), [e.ravel() for e in ev])
    assert r.converged and abs(r.lp_value - ref) <= 1e-7 * abs(ref)
    assert abs(r.gap) <= 1e-7 * abs(ref) and r.primal_residual <= 1e-8
