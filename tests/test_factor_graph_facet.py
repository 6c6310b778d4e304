"""Facet-side factor steps inside a factor graph (a tree, a matching, a sequence, each with
another factor).

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


def sequence_at_most_one(n, k):
    """A sequence of n positions over k tags, tag 0 at most once (an AtMostOne)."""
    var = np.arange(n * k).reshape(n, k)
    fg = sm.FactorGraph(n * k)
    fg.add(sm.SequenceFactor(n, k), var)
    fg.add(sm.AtMostOneFactor(n), var[:, 0])
    return fg


GRAPHS = {"tree": lambda: tree_budget(7), "matching": lambda: matching_budget(6),
          "sequence": lambda: sequence_at_most_one(6, 4)}
FLAT, PEAKED = (0.01, 0.05, 0.1), (4.0,)


def scores(fg, scale, seed, fill=None):
    """eta_u and eta_v at scale times standard normal; a sixth of eta_u at ``fill`` (a
    mask, or a padding fill that the solve tries as one) unless None."""
    rng = np.random.default_rng(seed)
    eta = scale * rng.standard_normal(fg.n_variables)
    if fill is not None:
        eta[rng.choice(fg.n_variables, size=fg.n_variables // 6, replace=False)] = fill
    return eta, [scale * rng.standard_normal(f.shape_v) if f.n_v else None for f in fg.factors]


def vertex_solve(fg, eta, eta_v, monkeypatch):
    """The graph's solve with every factor step on the vertex side."""
    with monkeypatch.context() as m:
        m.setattr(fg_admm, "FACET_FAMILIES", ())
        r = fg.solve(eta, eta_v)
    assert not r._engine.factor_sides().any()
    return r


def incidence(factor, s):
    """The 0/1 vector of a public structure's unary parts (the score of each unit eta_u)."""
    E = np.eye(factor.n_u)
    ev = np.zeros(factor.shape_v)
    return np.array([factor.score(s, E[j].reshape(factor.shape_u), ev)
                     for j in range(factor.n_u)])


def incidence_v(factor, s):
    """The same for its additional parts."""
    E = np.eye(factor.n_v)
    eu = np.zeros(factor.shape_u)
    return np.array([factor.score(s, eu, E[j].reshape(factor.shape_v))
                     for j in range(factor.n_v)])


@pytest.mark.parametrize("fill", [None, -np.inf, -1e30])
@pytest.mark.parametrize("scale", FLAT + PEAKED)
@pytest.mark.parametrize("name", list(GRAPHS))
def test_agrees_with_the_vertex_side(name, scale, fill, monkeypatch):
    fg = GRAPHS[name]()
    for seed in range(3):
        eta, eta_v = scores(fg, scale, seed, fill)
        r = fg.solve(eta, eta_v)
        assert r.polished
        ref = vertex_solve(fg, eta, eta_v, monkeypatch)
        assert ref.polished
        np.testing.assert_allclose(r.u, ref.u, rtol=0, atol=1e-9)
        for v, w in zip(r.v, ref.v):
            np.testing.assert_allclose(v, w, rtol=0, atol=1e-8)
        if scale in FLAT and fill is None and (name != "sequence" or scale < 0.1):
            # at flat scores the facet side is the cheaper one and takes the steps (a
            # sequence's solver declines transitions as spread as its unary scores, as
            # for the sequence alone)
            assert r._engine.factor_sides()[0]
        # the facet side's distribution (a decomposition of its point) is one of it
        factor, var = fg.factors[0], np.asarray(fg.variables[0]).reshape(-1)
        w = r.weights[0]
        assert (w > 0).all() and abs(w.sum() - 1.0) < 1e-9
        point = sum(wi * incidence(factor, s) for wi, s in zip(w, r.structures[0]))
        if factor.n_v:
            v = sum(wi * incidence_v(factor, s) for wi, s in zip(w, r.structures[0]))
            np.testing.assert_allclose(v, r.v[0].reshape(-1), rtol=0, atol=1e-8)
        tied = var >= 0
        np.testing.assert_allclose(point[tied], r.u[var[tied]], rtol=0, atol=1e-8)


@pytest.mark.parametrize("scale", FLAT + (1.0,))
@pytest.mark.parametrize("name", list(GRAPHS))
def test_jvp_and_vjp_are_the_derivative(name, scale):
    fg = GRAPHS[name]()
    rng = np.random.default_rng(7)
    eta, eta_v = scores(fg, scale, 1)
    r = fg.solve(eta, eta_v)
    if scale in FLAT and (name != "sequence" or scale < 0.1):
        assert r._engine.factor_sides()[0]     # the products below are c_apply's
    d, g = rng.standard_normal(fg.n_variables), rng.standard_normal(fg.n_variables)
    dv = [rng.standard_normal(f.shape_v) if f.n_v else None for f in fg.factors]
    h = 1e-6 * max(1.0, scale)
    shifted = (lambda t: [None if e is None else e + t * x for e, x in zip(eta_v, dv)])
    fd = (fg.solve(eta + h * d, shifted(h)).u - fg.solve(eta - h * d, shifted(-h)).u) / (2 * h)
    np.testing.assert_allclose(r.jvp(d, dv), fd, rtol=0, atol=1e-6)
    # vjp is jvp's transpose, in eta_u and in eta_v
    gu, gv = r.vjp(g)
    lhs = g @ r.jvp(d, dv)
    rhs = gu @ d + sum(float(a.ravel() @ b.ravel()) for a, b in zip(gv, dv) if b is not None)
    assert abs(lhs - rhs) < 1e-10 * max(1.0, abs(lhs)) * fg.n_variables


@pytest.mark.parametrize("name", list(GRAPHS))
def test_facet_side_result_pickles_with_its_backward_pass(name):
    fg = GRAPHS[name]()
    eta, eta_v = scores(fg, 0.05, 2)
    r = fg.solve(eta, eta_v)
    assert r._engine.factor_sides()[0]
    s = pickle.loads(pickle.dumps(r))
    np.testing.assert_array_equal(s.u, r.u)
    np.testing.assert_array_equal(s._engine.factor_sides(), r._engine.factor_sides())
    d = np.random.default_rng(3).standard_normal(fg.n_variables)
    np.testing.assert_array_equal(s.jvp(d), r.jvp(d))
    np.testing.assert_array_equal(s.vjp(d)[0], r.vjp(d)[0])
