"""KnapsackFactor: the relaxed knapsack polytope {u in [0, 1]^n : c . u <= B}.

References, none of which goes through the factor's MAP or solver:
- the vertices of the polytope, enumerated here from their definition (0/1 points
  within the budget, and points with one fractional entry making the budget tight);
- MAP: SciPy's HiGHS (scipy.optimize.linprog) on the linear program over the polytope;
- SparseMAP: the Euclidean projection onto the polytope, clip(eta - tau c, 0, 1) with
  tau found by scipy.optimize.brentq and certified by the KKT conditions, and SciPy's
  SLSQP on the same QP as a second opinion; the certified simplex QP over the
  enumerated vertices (tests/_reference.py);
- central finite differences of the certified projection for the Jacobian.
"""
import itertools
import pickle
import warnings

import numpy as np
import pytest
from scipy.optimize import brentq, linprog, minimize

import sparsemap as sm
from sparsemap.testing import check_jacobian, check_kkt, enumerate_structures

from _reference import simplex_qp


def vertices(costs, budget):
    """Every vertex of {u in [0, 1]^n : costs . u <= budget}, from the definition: n
    tight constraints among the box bounds and the budget."""
    n = len(costs)
    out = []
    eps = 1e-12       # round-off: a fraction this close to 0 or 1 is a 0/1 vertex
    for z in itertools.product((0, 1), repeat=n):
        z = np.array(z, float)
        spent = costs @ z
        if spent <= budget + eps:
            out.append(z)
        # z fixes n - 1 entries; entry j (off in z) then makes the budget tight
        for j in np.flatnonzero(z == 0):
            if eps < budget - spent < costs[j] - eps:
                v = z.copy()
                v[j] = (budget - spent) / costs[j]
                out.append(v)
    return np.unique(np.array(out), axis=0)


def projection(eta, costs, budget):
    """Euclidean projection onto the polytope, certified by its KKT conditions:
    u = clip(eta - tau c, 0, 1), tau >= 0, c . u <= B, tau (B - c . u) = 0."""
    def spent(tau):
        return costs @ np.clip(eta - tau * costs, 0.0, 1.0) - budget
    if spent(0.0) <= 0:
        tau = 0.0
    else:
        hi = 1.0
        while spent(hi) > 0:
            hi *= 2
        tau = brentq(spent, 0.0, hi, xtol=1e-15, rtol=1e-15, maxiter=500)
    u = np.clip(eta - tau * costs, 0.0, 1.0)
    # KKT: the gradient of 1/2 ||u - eta||^2 + tau (c . u - B) is
    # u - eta + tau c, which must be >= 0 where u = 0, <= 0 where u = 1 and 0 between
    g = u - eta + tau * costs
    assert tau >= 0 and costs @ u <= budget + 1e-10
    assert abs(tau * (costs @ u - budget)) <= 1e-10
    inner = (u > 0) & (u < 1)
    assert np.all(np.abs(g[inner]) <= 1e-9)
    assert np.all(g[u == 0] >= -1e-9) and np.all(g[u == 1] <= 1e-9)
    return u


def slsqp_projection(eta, costs, budget):
    res = minimize(lambda u: 0.5 * np.sum((u - eta) ** 2), np.zeros_like(eta),
                   jac=lambda u: u - eta, method="SLSQP", bounds=[(0, 1)] * eta.size,
                   constraints=[{"type": "ineq", "fun": lambda u: budget - costs @ u,
                                 "jac": lambda u: -costs}],
                   options={"ftol": 1e-14, "maxiter": 500})
    return res.x


def lp_value(eta, costs, budget):
    """max eta . u over the polytope by HiGHS; -inf scores pin their variable to 0."""
    allowed = np.isfinite(eta)
    res = linprog(-np.where(allowed, eta, 0.0), A_ub=costs[None, :], b_ub=[budget],
                  bounds=[(0, 1 if a else 0) for a in allowed], method="highs")
    assert res.status == 0
    return -res.fun


def solve_quiet(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", sm.ConvergenceWarning)
        return sm.solve(*args, **kwargs)


CASES = [([1.0, 2.0, 2.0], 2.5), ([1.0, 1.0, 1.0, 1.0], 2.0), ([0.5, 1.5, 0.0, 2.0], 1.7),
         ([3.0], 1.0), ([1.0, 2.0], 5.0), ([2.0, 1.0, 0.7, 1.3, 0.4], 0.0),
         ([0.3, 1.1, 0.8, 2.2, 0.9], 1.9)]
FACTORS = [sm.KnapsackFactor(c, b) for c, b in CASES]
IDS = [repr(f) for f in FACTORS]


@pytest.mark.parametrize("f", FACTORS, ids=IDS)
def test_structures_are_the_vertices(f):
    got = np.array(enumerate_structures(f))
    ref = vertices(f.costs, f.budget)
    np.testing.assert_allclose(np.unique(got, axis=0), ref, atol=1e-15)
    assert len(got) == len(ref)
    for s in got:
        m, n = f.vertex(s)
        np.testing.assert_array_equal(m, s)
        assert n.shape == (0,)
        np.testing.assert_array_equal(f.from_vertex(m), s)


@pytest.mark.parametrize("f", FACTORS, ids=IDS)
def test_score_overlap_add_column(f):
    rng = np.random.default_rng(1)
    V = enumerate_structures(f)
    eta = rng.standard_normal(f.n)
    for s in V:
        assert f.score(s, eta) == pytest.approx(s @ eta, abs=1e-12)
        for t in V:
            assert f.overlap(s, t) == pytest.approx(s @ t, abs=1e-12)
        u = np.zeros(f.n)
        f.add_column(s, 0.25, u)
        np.testing.assert_allclose(u, 0.25 * s, atol=1e-15)


@pytest.mark.parametrize("f", FACTORS, ids=IDS)
def test_map_against_highs(f):
    rng = np.random.default_rng(2)
    for trial in range(40):
        eta = rng.standard_normal(f.n) * [0.3, 1.0, 5.0][trial % 3]
        if trial % 4 == 3:      # masks
            eta[rng.random(f.n) < 0.3] = -np.inf
        s = f.map(eta)
        assert s.dtype == np.float64 and s.shape == (f.n,)
        assert np.all((s >= 0) & (s <= 1)) and f.costs @ s <= f.budget + 1e-12
        assert np.all(s[~np.isfinite(eta)] == 0)
        value = float(np.where(s > 0, eta, 0.0) @ s)
        assert value == pytest.approx(lp_value(eta, f.costs, f.budget), abs=1e-9)
        f.check_structure(s)    # MAP returns a vertex


def test_map_greedy_order_and_ties():
    f = sm.KnapsackFactor([1.0, 1.0, 1.0, 0.0], 1.5)
    # equal ratios: lowest indices first; the free variable whenever its score is > 0
    np.testing.assert_array_equal(f.map(np.array([1.0, 1.0, 1.0, 0.1])), [1, 0.5, 0, 1])
    np.testing.assert_array_equal(f.map(np.array([0.0, 1.0, 1.0, 0.0])), [0, 1, 0.5, 0])
    np.testing.assert_array_equal(f.map(np.zeros(4)), np.zeros(4))
    # a large n against a sort written here
    rng = np.random.default_rng(3)
    costs = rng.random(500) + 0.01
    f = sm.KnapsackFactor(costs, 40.0)
    eta = rng.standard_normal(500)
    ref = np.zeros(500)
    left = 40.0
    for i in sorted(np.flatnonzero(eta > 0), key=lambda i: (-eta[i] / costs[i], i)):
        take = min(1.0, left / costs[i])
        ref[i] = take
        left -= take * costs[i]
        if left <= 0:
            break
    np.testing.assert_allclose(f.map(eta), ref, atol=1e-12)
    assert f.map(eta) @ eta == pytest.approx(lp_value(eta, costs, 40.0), rel=1e-12)


@pytest.mark.parametrize("f", FACTORS, ids=IDS)
def test_sparsemap_is_the_projection(f):
    rng = np.random.default_rng(4)
    V = np.array(enumerate_structures(f))
    for trial in range(9):
        eta = rng.standard_normal(f.n) * [0.5, 1.5, 4.0][trial % 3] + 0.5
        r = solve_quiet(f, eta)
        assert r.converged and r.gap <= 1e-10
        u_ref = projection(eta, f.costs, f.budget)
        np.testing.assert_allclose(r.u, u_ref, atol=1e-10)
        np.testing.assert_allclose(slsqp_projection(eta, f.costs, f.budget), u_ref, atol=1e-6)
        qp = simplex_qp(V.T, V @ eta)
        assert qp is not None
        np.testing.assert_allclose(r.u, qp[0], atol=1e-8)
        check_kkt(f, r, eta)
        for s in r.structures:          # the support is made of vertices
            f.check_structure(s)


def test_sparsemap_large_against_projection():
    rng = np.random.default_rng(5)
    costs = np.r_[rng.random(195) * 3, np.zeros(5)]
    f = sm.KnapsackFactor(costs, 12.0)
    for scale in (0.3, 1.0, 5.0):
        eta = scale * rng.standard_normal(200) + 0.5
        r = solve_quiet(f, eta)
        np.testing.assert_allclose(r.u, projection(eta, costs, 12.0), atol=1e-9)


@pytest.mark.parametrize("method", ["away_cg", "pairwise_cg", "bpcg"])
def test_other_methods(method):
    f = FACTORS[-1]
    eta = np.array([0.9, 1.3, 0.2, 1.1, 0.7])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sm.ConvergenceWarning)
        r = sm.solve(f, eta, method=method, max_iter=5000)
    np.testing.assert_allclose(r.u, projection(eta, f.costs, f.budget), atol=1e-7)


def test_jacobian_against_finite_differences_of_the_projection():
    rng = np.random.default_rng(6)
    f = FACTORS[-1]
    n_checked = 0
    for _ in range(10):
        eta = rng.standard_normal(f.n) + 0.6
        r = solve_quiet(f, eta)
        d = rng.standard_normal(f.n)
        h = 1e-6
        fd = (projection(eta + h * d, f.costs, f.budget)
              - projection(eta - h * d, f.costs, f.budget)) / (2 * h)
        fd2 = (projection(eta + h / 10 * d, f.costs, f.budget)
               - projection(eta - h / 10 * d, f.costs, f.budget)) / (h / 5)
        if not np.allclose(fd, fd2, atol=1e-5):     # a kink within the step
            continue
        n_checked += 1
        np.testing.assert_allclose(r.jvp(d), fd, atol=1e-5)
        g = rng.standard_normal(f.n)
        assert r.vjp(g)[0] @ d == pytest.approx(g @ fd, abs=1e-5)
    assert n_checked >= 5
    assert check_jacobian(f, np.array([0.9, 1.3, 0.2, 1.1, 0.7]), rng=0).n_checked >= 1


def test_masks():
    f = FACTORS[-1]
    rng = np.random.default_rng(7)
    for _ in range(10):
        eta = rng.standard_normal(f.n) + 0.8
        mask = rng.random(f.n) < 0.4
        eta[mask] = -np.inf
        r = solve_quiet(f, eta)
        assert np.all(r.u[mask] == 0.0)
        for s in r.structures:
            assert np.all(s[mask] == 0)
        # the projection with the masked variables pinned to 0
        ref = np.zeros(f.n)
        ref[~mask] = projection(eta[~mask], f.costs[~mask], f.budget)
        np.testing.assert_allclose(r.u, ref, atol=1e-10)
        assert np.all(r.jvp(rng.standard_normal(f.n))[mask] == 0.0)
    # every variable masked: the all-zero vertex is still allowed
    r = solve_quiet(f, np.full(f.n, -np.inf))
    np.testing.assert_array_equal(r.u, np.zeros(f.n))


def test_in_a_factor_graph_with_negation():
    # u0 + 2 u1 <= 1.5 and (1 - u1) + u2 <= 1 (so u2 <= u1), u2 also in a budget
    fg = sm.FactorGraph(3)
    fg.add(sm.KnapsackFactor([1.0, 2.0], 1.5), [0, 1])
    fg.add(sm.KnapsackFactor([1.0, 1.0], 1.0), [1, 2], negated=[True, False])
    eta = np.array([0.8, 0.9, 1.2])
    r = fg.solve(eta)
    assert r.converged
    res = minimize(lambda u: 0.5 * np.sum((u - eta) ** 2), np.zeros(3), jac=lambda u: u - eta,
                   method="SLSQP", bounds=[(0, 1)] * 3,
                   constraints=[{"type": "ineq", "fun": lambda u: 1.5 - u[0] - 2 * u[1]},
                                {"type": "ineq", "fun": lambda u: u[1] - u[2]}],
                   options={"ftol": 1e-15, "maxiter": 500})
    np.testing.assert_allclose(r.u, res.x, atol=1e-6)


def test_pickle_repr_equality():
    for f in FACTORS + [sm.KnapsackFactor(np.arange(20.0), 7)]:
        g = pickle.loads(pickle.dumps(f))
        assert type(g) is sm.KnapsackFactor and g == f and hash(g) == hash(f)
        assert repr(g) == repr(f)
        np.testing.assert_array_equal(g.costs, f.costs)
        assert g.budget == f.budget
    f = sm.KnapsackFactor([1, 2], 3)
    assert repr(f) == "KnapsackFactor([1.0, 2.0], 3.0)"
    assert eval(repr(f), vars(sm)) == f
    assert repr(sm.KnapsackFactor(np.ones(9), 1.0)) == "KnapsackFactor(<9 array>, 1.0)"
    assert sm.KnapsackFactor([1, 2], 3) != sm.KnapsackFactor([1, 2], 2)
    costs = np.array([1.0, 2.0])
    f = sm.KnapsackFactor(costs, 1.0)
    costs[0] = 5.0                           # the factor keeps its own copy
    assert f.costs[0] == 1.0 and not f.costs.flags.writeable


@pytest.mark.parametrize("costs,budget,match", [
    ([1.0, -1.0], 1.0, "costs: expected finite non-negative values"),
    ([1.0, np.nan], 1.0, "costs: expected finite non-negative values"),
    ([1.0, np.inf], 1.0, "costs: expected finite non-negative values"),
    ([], 1.0, r"costs: expected a non-empty 1-d array .* got shape \(0,\)"),
    ([[1.0, 2.0]], 1.0, r"costs: expected a non-empty 1-d array .* got shape \(1, 2\)"),
    (["a", "b"], 1.0, "costs: expected an array of floats"),
    ([1.0, 2.0], -1.0, "budget: expected a finite non-negative float"),
    ([1.0, 2.0], np.nan, "budget: expected a finite non-negative float"),
    ([1.0, 2.0], True, "budget: expected a finite non-negative float"),
    ([1.0, 2.0], "3", "budget: expected a finite non-negative float"),
])
def test_bad_arguments(costs, budget, match):
    with pytest.raises(ValueError, match=match):
        sm.KnapsackFactor(costs, budget)


@pytest.mark.parametrize("s,match", [
    ([1, 1, 0], r"s: costs \. s = 3\.0 exceeds budget=2\.5"),
    ([0.5, 0.5, 0], "s: not a vertex: 2 fractional entries"),
    ([1, 0, 0.5], r"s: not a vertex: entry 2 is 0\.5, where the budget left .* gives 0\.75"),
    ([0, 0, 2], r"s: not a vertex: a fractional entry 2 needs"),     # 2.5 > c = 2: not tight
    ([1.5, 0, 0], r"s: expected entries in \[0, 1\]"),
    ([-1, 0, 0], r"s: expected entries in \[0, 1\]"),
    ([1, 0], r"s: expected shape \(3,\)"),
    ([1, 0, np.nan], "s: contains non-finite values"),
])
def test_bad_structures(s, match):
    with pytest.raises(ValueError, match=match):
        FACTORS[0].vertex(s)


def test_fractional_entry_needs_a_cost():
    f = sm.KnapsackFactor([0.0, 1.0], 0.5)
    with pytest.raises(ValueError, match="a fractional entry 0 needs"):
        f.vertex([2, 0])
    np.testing.assert_array_equal(f.map(np.array([1.0, 1.0])), [1.0, 0.5])


def test_bad_scores():
    f = FACTORS[0]
    with pytest.raises(ValueError, match=r"eta_u: expected shape \(3,\)"):
        f.map(np.zeros(4))
    with pytest.raises(ValueError, match="eta_u: contains non-finite"):
        sm.solve(f, [0.0, np.nan, 1.0])
