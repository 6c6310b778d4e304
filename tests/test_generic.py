"""GenericFactor and OracleFactor: explicit columns and user oracles."""
import pickle

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sparsemap as sm

from _helpers import ArgmaxOracle
from _reference import (PAIRWISE_M, PAIRWISE_N, pairwise_closed_form, sparsemax,
                        sparsemax_jacobian)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(0, 3), st.integers(1, 8), st.integers(0, 2**32 - 1),
       st.booleans())
def test_generic_map_is_argmax_of_column_scores(n_u, n_v, d, seed, ties):
    rng = np.random.default_rng(seed)
    M = rng.integers(0, 2, (n_u, d)).astype(float)
    N = rng.integers(0, 2, (n_v, d)).astype(float) if n_v else None
    f = sm.GenericFactor(M, N)
    eu = rng.integers(-1, 2, n_u) * 1.0 if ties else rng.standard_normal(n_u)
    ev = (rng.integers(-1, 2, n_v) * 1.0 if ties else rng.standard_normal(n_v)) if n_v else None
    theta = M.T @ eu + (N.T @ ev if n_v else 0)
    s = f.map(eu, ev)
    assert isinstance(s, int)
    assert s == int(np.flatnonzero(theta == theta.max())[0])  # lowest index on ties
    assert f.score(s, eu, ev) == pytest.approx(theta[s])
    t = int(rng.integers(d))
    assert f.overlap(s, t) == pytest.approx(M[:, s] @ M[:, t])
    m, n = f.vertex(t)
    np.testing.assert_array_equal(m, M[:, t])
    np.testing.assert_array_equal(n, N[:, t] if n_v else np.zeros(0))
    u, v = np.zeros(n_u), np.zeros(n_v)
    f.add_column(t, 0.25, u, v)
    np.testing.assert_array_equal(u, 0.25 * M[:, t])
    np.testing.assert_array_equal(v, 0.25 * N[:, t] if n_v else np.zeros(0))


def test_generic_validation():
    with pytest.raises(ValueError, match=r"^M: expected a 2-d array \(n_u, n_structures\)"):
        sm.GenericFactor(np.zeros(3))
    with pytest.raises(ValueError, match=r"^N: expected a 2-d array \(n_v, n_structures\)"):
        sm.GenericFactor(np.eye(3), np.zeros(3))
    with pytest.raises(ValueError, match=r"^M: expected at least one row and one column"):
        sm.GenericFactor(np.zeros((3, 0)))
    with pytest.raises(ValueError, match="M.*non-finite"):
        sm.GenericFactor(np.array([[np.nan, 1.0]]))
    with pytest.raises(ValueError, match=r"^N: expected shape \(2, 3\) .*got \(2, 4\)"):
        sm.GenericFactor(np.eye(3), np.ones((2, 4)))
    f = sm.GenericFactor(np.eye(3))
    with pytest.raises(ValueError, match=r"^s: expected a column index in \[0, 3\), got 3"):
        f.vertex(3)
    with pytest.raises(ValueError, match=r"^s: expected a column index in \[0, 3\), got -1"):
        f.vertex(-1)
    with pytest.raises(ValueError, match=r"eta_u.*\(3,\)"):
        f.map(np.zeros(4))


def test_generic_is_immutable_and_picklable():
    M = np.eye(3)
    f = sm.GenericFactor(M)
    M[0, 0] = 5.0  # the factor keeps its own copy
    assert f.vertex(0)[0][0] == 1.0
    with pytest.raises(ValueError, match="read-only"):
        f.M[0, 0] = 2.0
    g = pickle.loads(pickle.dumps(f))
    assert g.map([0.0, 2.0, 1.0]) == 1


def test_oracle_factor_callables_and_subclass_are_sparsemax():
    rng = np.random.default_rng(3)
    d = 5
    via_callables = sm.OracleFactor(lambda eu, ev: int(np.argmax(eu)),
                                    lambda s: np.eye(d)[s], shape_u=d)
    for f in (via_callables, ArgmaxOracle(d)):
        for _ in range(5):
            z = rng.standard_normal(d)
            assert f.map(z) == int(np.argmax(z))
            r = sm.solve(f, z)
            np.testing.assert_allclose(r.u, sparsemax(z), atol=1e-12)
            g = rng.standard_normal(d)
            np.testing.assert_allclose(r.vjp(g)[0], sparsemax_jacobian(z) @ g, atol=1e-12)


def test_oracle_factor_with_array_structures_and_eta_v():
    # Two binary variables as a 2-int structure; v scores the product z1*z2.
    def vertex(s):
        z1, z2 = s
        return np.array([z1, z2], float), np.array([z1 * z2], float)

    def best(eu, ev):
        cands = [(a, b) for a in (0, 1) for b in (0, 1)]
        vals = [eu @ vertex(c)[0] + ev @ vertex(c)[1] for c in cands]
        return np.array(cands[int(np.argmax(vals))])

    f = sm.OracleFactor(best, vertex, shape_u=2, shape_v=1, structure_size=2)
    for j, s in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        m, n = f.vertex(s)
        np.testing.assert_array_equal(m, PAIRWISE_M[:, j])
        np.testing.assert_array_equal(n, PAIRWISE_N[:, j])
    rng = np.random.default_rng(0)
    for _ in range(10):
        eu, ev = rng.standard_normal(2), rng.standard_normal(1)
        r = sm.solve(f, eu, ev)
        u1, u2, v = pairwise_closed_form(eu[0], eu[1], ev[0])
        np.testing.assert_allclose(r.u, [u1, u2], atol=1e-12)
        np.testing.assert_allclose(r.v, [v], atol=1e-12)


def test_oracle_errors_propagate_and_are_validated():
    def boom(eu, ev):
        raise RuntimeError("oracle failed")

    f = sm.OracleFactor(boom, lambda s: np.eye(2)[s], shape_u=2)
    with pytest.raises(RuntimeError, match="oracle failed"):
        sm.solve(f, np.zeros(2))
    bad = sm.OracleFactor(lambda eu, ev: 7, lambda s: np.eye(2)[s], shape_u=2)
    # 7 is a valid int: the vertex callable is what rejects it
    with pytest.raises(IndexError, match="index 7 is out of bounds"):   # np.eye(2)[7]
        sm.solve(bad, np.zeros(2))
    wrong = sm.OracleFactor(lambda eu, ev: [0, 1], lambda s: np.eye(2)[s], shape_u=2)
    with pytest.raises(ValueError, match=r"^map_fn result: "):   # the name the user gave it
        sm.solve(wrong, np.zeros(2))

    class WrongSubclass(sm.OracleFactor):
        def oracle_map(self, eta_u, eta_v):
            return [0, 1]

        def oracle_vertex(self, s):
            return np.eye(3)[s]

    with pytest.raises(ValueError, match=r"^oracle_map\(\) result: "):
        sm.solve(WrongSubclass(shape_u=2), np.zeros(2))
    short = sm.OracleFactor(lambda eu, ev: 0, lambda s: np.ones(3), shape_u=2)
    with pytest.raises(ValueError, match=r"^vertex_fn result: expected m of size 2"):
        short.vertex(0)
    with pytest.raises(ValueError, match=r"^oracle_vertex\(\) result: expected m of size 2"):
        WrongSubclass(shape_u=2).vertex(0)
    with pytest.raises(ValueError, match=r"^shape_u: expected a non-empty shape"):
        sm.OracleFactor(lambda eu, ev: 0, lambda s: 0, shape_u=0)
    with pytest.raises(ValueError, match=r"^map_fn: expected a callable"):
        sm.OracleFactor(3, lambda s: 0, shape_u=2)
