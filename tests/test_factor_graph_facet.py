"""Facet-side factor steps inside a factor graph (trees and matchings with another factor).

The reference is the graph's own path with every factor step on the vertex side (the
active set's supports), which shares no code with the facet solvers; the Jacobian is
checked against central differences of the solve.
"""
import pickle

import numpy as np
import pytest

import sparsemap as sm
import sparsemap._fg_admm as fg_admm


def tree_budget(n):
    """A non-projective tree over n words, at most one child of the root (a Budget)."""
    var = -np.ones((n + 1, n + 1), dtype=int)
    on = ~np.eye(n + 1, dtype=bool)
    on[:, 0] = False
    var[on] = np.arange(on.sum())
    fg = sm.FactorGraph(int(on.sum()))
    fg.add(sm.TreeFactor(n), var)
    fg.add(sm.BudgetFactor(n, 1), var[0, 1:])
    return fg


def matching_budget(n):
    """An n x n matching, at most one cell of the diagonal on (a Budget)."""
    var = np.arange(n * n).reshape(n, n)
    fg = sm.FactorGraph(n * n)
    fg.add(sm.MatchingFactor(n, n), var)
    fg.add(sm.BudgetFactor(n, 1), np.diag(var))
    return fg


GRAPHS = {"tree": lambda: tree_budget(7), "matching": lambda: matching_budget(6)}
FLAT, PEAKED = (0.01, 0.05, 0.1), (4.0,)


def scores(fg, scale, seed, masked):
    rng = np.random.default_rng(seed)
    eta = scale * rng.standard_normal(fg.n_variables)
    if masked:
        eta[rng.choice(fg.n_variables, size=fg.n_variables // 6, replace=False)] = -np.inf
    return eta


def vertex_solve(fg, eta, monkeypatch):
    """The graph's solve with every factor step on the vertex side."""
    with monkeypatch.context() as m:
        m.setattr(fg_admm, "FACET_FAMILIES", ())
        r = fg.solve(eta)
    assert not r._engine.factor_sides().any()
    return r


def incidence(factor, s):
    """The 0/1 vector of a public structure (the score of each unit eta_u)."""
    E = np.eye(factor.n_u)
    ev = np.zeros(factor.shape_v)
    return np.array([factor.score(s, E[j].reshape(factor.shape_u), ev)
                     for j in range(factor.n_u)])


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("scale", FLAT + PEAKED)
@pytest.mark.parametrize("name", list(GRAPHS))
def test_agrees_with_the_vertex_side(name, scale, masked, monkeypatch):
    fg = GRAPHS[name]()
    for seed in range(3):
        eta = scores(fg, scale, seed, masked)
        r = fg.solve(eta)
        assert r.polished
        ref = vertex_solve(fg, eta, monkeypatch)
        assert ref.polished
        np.testing.assert_allclose(r.u, ref.u, rtol=0, atol=1e-9)
        if scale in FLAT and not masked:
            # at flat scores the facet side is the cheaper one and takes the steps
            assert r._engine.factor_sides()[0]
        # the facet side's distribution (a decomposition of its point) is one of it
        factor, var = fg.factors[0], np.asarray(fg.variables[0]).reshape(-1)
        w = r.weights[0]
        assert (w > 0).all() and abs(w.sum() - 1.0) < 1e-9
        point = sum(wi * incidence(factor, s) for wi, s in zip(w, r.structures[0]))
        tied = var >= 0
        np.testing.assert_allclose(point[tied], r.u[var[tied]], rtol=0, atol=1e-8)


@pytest.mark.parametrize("scale", FLAT + (1.0,))
@pytest.mark.parametrize("name", list(GRAPHS))
def test_jvp_and_vjp_are_the_derivative(name, scale):
    fg = GRAPHS[name]()
    rng = np.random.default_rng(7)
    eta = scores(fg, scale, 1, False)
    r = fg.solve(eta)
    d, g = rng.standard_normal(fg.n_variables), rng.standard_normal(fg.n_variables)
    h = 1e-6 * max(1.0, scale)
    fd = (fg.solve(eta + h * d).u - fg.solve(eta - h * d).u) / (2 * h)
    np.testing.assert_allclose(r.jvp(d), fd, rtol=0, atol=1e-6)
    # vjp is jvp's transpose
    assert abs(g @ r.jvp(d) - r.vjp(g)[0] @ d) < 1e-10 * np.abs(g).sum() * np.abs(d).sum()


@pytest.mark.parametrize("name", list(GRAPHS))
def test_facet_side_result_pickles_with_its_backward_pass(name):
    fg = GRAPHS[name]()
    eta = scores(fg, 0.05, 2, False)
    r = fg.solve(eta)
    assert r._engine.factor_sides()[0]
    s = pickle.loads(pickle.dumps(r))
    np.testing.assert_array_equal(s.u, r.u)
    np.testing.assert_array_equal(s._engine.factor_sides(), r._engine.factor_sides())
    d = np.random.default_rng(3).standard_normal(fg.n_variables)
    np.testing.assert_array_equal(s.jvp(d), r.jvp(d))
    np.testing.assert_array_equal(s.vjp(d)[0], r.vjp(d)[0])
