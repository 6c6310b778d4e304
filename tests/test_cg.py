"""Conditional-gradient solvers (Appendix A.1) against independent references.

References: the SciPy QP over the enumerated structures (KKT-certified), the
sparsemax closed form, Wolfe gaps recomputed by brute-force enumeration, the
strong-convexity bound ``||u - u*||^2 <= 2 (f - f*) <= 2 gap``, and the active
set (a separately tested solver sharing no code with CG but the factor) for the
objective and the backward pass.
"""
import functools
import itertools
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sparsemap as sm
from sparsemap._cg import VARIANTS, conditional_gradient
from sparsemap.testing import dense_columns, enumerate_structures

from _reference import all_sequences, simplex_qp, sparsemax

# Away-step, pairwise and blended pairwise CG converge linearly and drop
# structures, so they reach the active set's support; vanilla CG is sublinear
# (Wolfe's zig-zag) and keeps every structure it ever added.
LINEAR = ("away_cg", "pairwise_cg", "bpcg")


def k_subsets_oracle(d, k):
    """OracleFactor over the k-subsets of d items (a MAP is the top k)."""
    def map_fn(eu, ev):
        return np.sort(np.argsort(-eu, kind="stable")[:k])

    def vertex_fn(s):
        m = np.zeros(d)
        m[np.asarray(s)] = 1.0
        return m

    cols = [vertex_fn(c) for c in itertools.combinations(range(d), k)]
    return sm.OracleFactor(map_fn, vertex_fn, shape_u=d, structure_size=k), np.array(cols).T


def instances():
    """Small instances of every factor (name, factor, eta_u, eta_v)."""
    rng = np.random.default_rng(0)
    oracle, oracle_cols = k_subsets_oracle(6, 2)
    out = [("sequence", sm.SequenceFactor(4, 3), rng.standard_normal((4, 3)),
            rng.standard_normal((3, 3, 3)))]
    M = rng.integers(0, 2, (6, 10)).astype(float)
    N = rng.integers(0, 2, (3, 10)).astype(float)
    out.append(("generic", sm.GenericFactor(M, N), rng.standard_normal(6),
                rng.standard_normal(3)))
    out.append(("sparsemax", sm.GenericFactor(np.eye(6)), rng.standard_normal(6), None))
    out.append(("oracle", oracle, rng.standard_normal(6), None))
    out.append(("tree", sm.TreeFactor(4), rng.standard_normal((5, 5)), None))
    out.append(("matching", sm.MatchingFactor(3, 4), rng.standard_normal((3, 4)), None))
    ORACLE_COLUMNS[id(oracle)] = oracle_cols
    return out


ORACLE_COLUMNS = {}
INSTANCES = instances()
IDS = [name for name, *_ in INSTANCES]


@functools.lru_cache(maxsize=None)
def u_star(name):
    """u* of an instance: the certified SciPy QP over all its structures."""
    _, f, eu, ev = INSTANCES[IDS.index(name)]
    eu, ev = f.check_scores(eu, ev)
    if id(f) in ORACLE_COLUMNS:
        M, N = ORACLE_COLUMNS[id(f)], np.zeros((0, ORACLE_COLUMNS[id(f)].shape[1]))
    else:
        M, N = dense_columns(f, enumerate_structures(f))
    ref = simplex_qp(M, M.T @ eu + N.T @ ev)
    assert ref is not None, "the SciPy reference found no certified solution"
    return ref[0].reshape(f.shape_u)


def check_history(r, ref_obj):
    h = r.history
    assert h is not None and len(h["objective"]) == r.n_iter
    obj, gap = h["objective"], h["gap"]
    scale = 1 + np.abs(obj).max()
    # exact line search: the objective never increases
    assert np.all(np.diff(obj) <= 1e-13 * scale)
    # the Wolfe gap bounds the true suboptimality at every recorded iterate
    assert np.all(gap >= obj - ref_obj - 1e-12 * scale)
    assert np.all(np.diff(h["seconds"]) >= 0)
    assert np.all(h["support_size"] >= 1)
    assert h["support_size"][-1] == len(r.structures)
    assert obj[-1] == pytest.approx(r.objective, abs=1e-12 * scale)
    assert gap[-1] == pytest.approx(r.gap, abs=1e-12 * scale)


def check_point(f, r, eta_u, eta_v):
    """Weights form a distribution whose columns give u and v."""
    w = r.weights
    assert np.all(w > 0) and w.sum() == pytest.approx(1, abs=1e-12)
    u = np.zeros(f.shape_u)
    v = np.zeros(f.shape_v)
    for s, ws in zip(r.structures, w):
        m, n = f.vertex(s)
        u += ws * m
        v += ws * n
    np.testing.assert_allclose(r.u, u, atol=1e-12)
    np.testing.assert_allclose(r.v, v, atol=1e-12)
    eu, ev = f.check_scores(eta_u, eta_v)
    obj = 0.5 * u.ravel() @ u.ravel() - eu @ u.ravel() - ev @ v.ravel()
    assert r.objective == pytest.approx(obj, abs=1e-12)
    # no repeated structure in the support
    keys = {np.asarray(s).tobytes() for s in r.structures}
    assert len(keys) == len(r.structures)


@pytest.mark.parametrize("variant", LINEAR)
@pytest.mark.parametrize("name,f,eu,ev", INSTANCES, ids=IDS)
def test_linear_variants_reach_active_set(name, f, eu, ev, variant):
    ref = sm.solve(f, eu, ev, tol=1e-14)
    r = sm.solve(f, eu, ev, method=variant, tol=1e-12, max_iter=20_000, return_history=True)
    assert r.converged
    np.testing.assert_allclose(r.u, u_star(name), atol=1e-6)
    np.testing.assert_allclose(r.u, ref.u, atol=1e-6)
    np.testing.assert_allclose(r.v, ref.v, atol=1e-6)
    assert abs(r.objective - ref.objective) <= 1e-9
    check_point(f, r, eu, ev)
    check_history(r, ref.objective)
    if name == "sparsemax":
        np.testing.assert_allclose(r.u, sparsemax(eu), atol=1e-6)


@pytest.mark.parametrize("name,f,eu,ev", INSTANCES, ids=IDS)
def test_vanilla_cg_bounds(name, f, eu, ev):
    """Vanilla CG is sublinear: check its certificates rather than a fixed accuracy."""
    ref = sm.solve(f, eu, ev, tol=1e-14)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sm.ConvergenceWarning)
        r = sm.solve(f, eu, ev, method="cg", tol=1e-9, max_iter=3000, return_history=True)
    check_point(f, r, eu, ev)
    check_history(r, ref.objective)
    # strong convexity in u: ||u - u*||^2 <= 2 (f - f*) <= 2 gap
    err = np.sum((r.u - u_star(name)) ** 2)
    assert err <= 2 * max(r.gap, 0) + 1e-12
    assert r.objective - ref.objective <= max(r.gap, 0) + 1e-12


def test_vanilla_cg_sparsemax_closed_form():
    z = np.array([1.2, 0.9, 0.1, -0.5, 0.85, 0.3])
    r = sm.solve(sm.GenericFactor(np.eye(6)), z, None, method="cg", tol=1e-12, max_iter=20_000)
    assert r.converged
    np.testing.assert_allclose(r.u, sparsemax(z), atol=1e-6)


def test_oracle_matches_enumerated_generic():
    """The same polytope given as an oracle and as enumerated columns."""
    f, cols = k_subsets_oracle(5, 2)
    g = sm.GenericFactor(cols)
    eu = np.array([0.3, -0.2, 0.5, 0.45, 0.1])
    ref = sm.solve(g, eu)
    for variant in LINEAR:
        r = sm.solve(f, eu, None, method=variant, tol=1e-12, max_iter=5000)
        np.testing.assert_allclose(r.u, ref.u, atol=1e-6)


def brute_force_gap(f, structures, u, v, eu, ev):
    """Wolfe gap at (u, v) by enumerating every structure."""
    gu = (eu - u).ravel()
    best = max(f.score(s, gu.reshape(f.shape_u), ev) for s in structures)
    return best - gu @ u.ravel() - ev.ravel() @ v.ravel()


@pytest.mark.parametrize("variant", VARIANTS)
def test_reported_gap_is_the_wolfe_gap(variant):
    n, m = 4, 3
    f = sm.SequenceFactor(n, m)
    rng = np.random.default_rng(3)
    eu, ev = rng.standard_normal((n, m)), rng.standard_normal((n - 1, m, m))
    seqs = all_sequences(n, m)
    for max_iter in (1, 3, 10):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sm.ConvergenceWarning)
            r = sm.solve(f, eu, ev, method=variant, tol=0.0, max_iter=max_iter)
        check_point(f, r, eu, ev)
        assert r.gap == pytest.approx(brute_force_gap(f, seqs, r.u, r.v, eu, ev), abs=1e-12)


@pytest.mark.parametrize("variant", LINEAR)
@pytest.mark.parametrize("name,f,eu,ev", INSTANCES, ids=IDS)
def test_backward_matches_active_set(name, f, eu, ev, variant):
    """The Jacobian depends only on the optimal face: once CG's support is reduced to an
    affinely independent one it matches the active set's to round-off."""
    ref = sm.solve(f, eu, ev, tol=1e-14)
    r = sm.solve(f, eu, ev, method=variant, tol=1e-12, max_iter=20_000)
    rng = np.random.default_rng(1)
    du = rng.standard_normal(f.shape_u)
    dv = rng.standard_normal(f.shape_v)
    np.testing.assert_allclose(r.jvp(du, dv), ref.jvp(du, dv), atol=1e-10)
    gu, gv = r.vjp(du)
    gu_ref, gv_ref = ref.vjp(du)
    np.testing.assert_allclose(gu, gu_ref, atol=1e-10)
    np.testing.assert_allclose(gv, gv_ref, atol=1e-10)


@pytest.mark.parametrize("variant", VARIANTS)
def test_non_convergence_warns(variant):
    f = sm.SequenceFactor(5, 3)
    rng = np.random.default_rng(2)
    eu, ev = rng.standard_normal((5, 3)), rng.standard_normal((4, 3, 3))
    with pytest.warns(sm.ConvergenceWarning):
        r = sm.solve(f, eu, ev, method=variant, max_iter=2, tol=0.0, return_history=True)
    assert not r.converged
    assert r.n_iter == 2 and len(r.history["gap"]) == 2
    assert r.gap > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_optimal_start_converges_at_once(variant):
    """A vertex solution: the first MAP structure is optimal, one iteration, one structure."""
    f = sm.GenericFactor(np.eye(4))
    r = sm.solve(f, np.array([5.0, 0.0, -1.0, 0.5]), None, method=variant, return_history=True)
    assert r.converged and r.n_iter == 1 and r.structures == [0]
    np.testing.assert_array_equal(r.u, [1.0, 0, 0, 0])


def test_zero_columns_and_ties():
    """All-zero and duplicate columns (||d_u|| = 0 directions) do not break the line search."""
    M = np.array([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    N = np.array([[1.0, 0.0, 0.0, 0.0]])
    f = sm.GenericFactor(M, N)
    for eu, ev in [([0.2, 0.1], [0.4]), ([0.0, 0.0], [0.0]), ([1.0, 1.0], [-3.0])]:
        ref = sm.solve(f, eu, ev)
        for variant in VARIANTS:
            r = sm.solve(f, eu, ev, method=variant, tol=1e-12, max_iter=5000)
            assert r.converged
            assert r.objective == pytest.approx(ref.objective, abs=1e-9)
            check_point(f, r, eu, ev)


def test_unknown_variant():
    f = sm.GenericFactor(np.eye(3))
    with pytest.raises(ValueError, match="variant"):
        conditional_gradient(f, np.zeros(3), np.zeros(0), variant="frank")


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(0, 2**32 - 1),
       st.sampled_from(LINEAR), st.floats(0.1, 10))
def test_sequence_property(n, m, seed, variant, scale):
    f = sm.SequenceFactor(n, m)
    rng = np.random.default_rng(seed)
    eu = scale * rng.standard_normal((n, m))
    ev = scale * rng.standard_normal((n - 1, m, m))
    ref = sm.solve(f, eu, ev, tol=1e-14)
    r = sm.solve(f, eu, ev, method=variant, tol=1e-12, max_iter=20_000, return_history=True)
    assert r.converged
    np.testing.assert_allclose(r.u, ref.u, atol=1e-6)
    check_point(f, r, eu, ev)
    check_history(r, ref.objective)
