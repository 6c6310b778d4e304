"""Jacobian products (Prop. 1) against central finite differences and dense algebra.

On a region of scores where the support is constant, u is affine in the scores,
so central differences are exact up to round-off there; a draw whose support
changes within the step is skipped, and each test fails if most draws are.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparsemap as sm
from sparsemap.testing import (FAMILIES, check_jacobian, dense_columns, factors,
                               finite_difference_jvp, problems, scores, support_key)

@pytest.mark.parametrize("family", FAMILIES)
def test_jvp_matches_finite_differences(family):
    counts = {"draws": 0, "skipped": 0}

    @settings(max_examples=80, deadline=None, database=None)
    @given(problems(families=family, scale=(0.1, 1.0, 10.0), kinds=("gaussian",)),
           st.integers(0, 2 ** 32 - 1))
    def run(problem, seed):
        factor, eta_u, eta_v = problem
        rep = check_jacobian(factor, eta_u, eta_v, n_directions=2, rng=seed, min_checked=0)
        counts["draws"] += rep.n_directions
        counts["skipped"] += rep.n_skipped
        assert rep.max_adjoint_error <= 1e-10 * max(1.0, factor.n_u)

    run()
    assert counts["draws"] > 0
    assert counts["skipped"] <= counts["draws"] // 2, counts


@settings(max_examples=80, deadline=None)
@given(problems(kinds=("ties", "floats")), st.integers(0, 2 ** 32 - 1))
def test_jacobian_checks_hold_at_ties(problem, seed):
    """Ties put many draws on kinks; the adjoint identity and the symmetry still hold.

    (Finite differences are not compared here: at a kink the products are one element
    of the generalized Jacobian, which need not match u along a direction where u
    happens to be linear through the kink.)"""
    factor, eta_u, eta_v = problem
    r = sm.solve(factor, eta_u, eta_v)
    rng = np.random.default_rng(seed)
    for _ in range(2):
        du, dv = rng.standard_normal(factor.shape_u), rng.standard_normal(factor.shape_v)
        g = rng.standard_normal(factor.shape_u)
        jvp = r.jvp(du, dv)
        gu, gv = r.vjp(g)
        scale = max(1.0, np.linalg.norm(g) * np.linalg.norm(np.r_[du.ravel(), dv.ravel()]))
        assert abs((gu * du).sum() + (gv * dv).sum() - (g * jvp).sum()) <= 1e-9 * scale
        np.testing.assert_allclose(r.jvp(g, np.zeros(factor.shape_v)), gu, atol=1e-9)


def prop1_dense(factor, structures):
    """Prop. 1 with dense matrices: J = M_I (Z - Z 1 1^T Z / 1^T Z 1) A_I^T.

    Z = (M_I^T M_I)^{-1} is replaced by (M_I^T M_I + 1 1^T)^{-1}, which gives the
    same product on the simplex and exists whenever the support is affinely
    independent (even with a zero column). Returns J, shape (n_u, n_u + n_v).
    """
    M, N = dense_columns(factor, structures)
    A = np.r_[M, N]
    k = M.shape[1]
    Z = np.linalg.inv(M.T @ M + np.ones((k, k)))
    one = np.ones(k)
    D = Z - np.outer(Z @ one, one @ Z) / (one @ Z @ one)
    return M @ D @ A.T


@settings(max_examples=100, deadline=None)
@given(problems())
def test_jvp_vjp_match_dense_prop1(problem):
    factor, eta_u, eta_v = problem
    n_u, n = factor.n_u, factor.n_u + factor.n_v
    r = sm.solve(factor, eta_u, eta_v, method="vertex")
    # Prop. 1 on the backward set: the support and its completion to the optimal face
    J_ref = prop1_dense(factor, r._backward_structures())
    # the whole Jacobian, one basis direction at a time, through jvp and through vjp
    J = np.array([r.jvp(e[:n_u].reshape(factor.shape_u), e[n_u:].reshape(factor.shape_v))
                  .ravel() for e in np.eye(n)]).T
    np.testing.assert_allclose(J, J_ref, atol=1e-10)
    rows = [r.vjp(e.reshape(factor.shape_u)) for e in np.eye(n_u)]
    assert all(gu.shape == factor.shape_u and gv.shape == factor.shape_v for gu, gv in rows)
    np.testing.assert_allclose([np.r_[gu.ravel(), gv.ravel()] for gu, gv in rows], J_ref,
                               atol=1e-10)
    # the eta_u block is a Hessian of a convex function: symmetric, positive semidefinite
    Juu = J[:, :n_u]
    np.testing.assert_allclose(Juu, Juu.T, atol=1e-10)
    assert np.linalg.eigvalsh((Juu + Juu.T) / 2).min() >= -1e-10


def test_jvp_eta_v_directions():
    """Transition scores alone move u: compare with differences along eta_v only."""
    f = sm.SequenceFactor(4, 3)
    rng = np.random.default_rng(0)
    n_checked = 0
    for _ in range(10):
        eta_u, eta_v = 0.5 * rng.standard_normal((4, 3)), 0.5 * rng.standard_normal((3, 3, 3))
        r = sm.solve(f, eta_u, eta_v)
        dv = rng.standard_normal((3, 3, 3))
        fd, rm, rp = finite_difference_jvp(f, eta_u, eta_v, None, dv, eps=1e-6,
                                           return_results=True)
        key = support_key(r.structures)
        if support_key(rm.structures) == key == support_key(rp.structures):
            n_checked += 1
            np.testing.assert_allclose(r.jvp(np.zeros((4, 3)), dv), fd, atol=1e-7)
    assert n_checked >= 5


def test_finite_difference_jvp_is_a_difference():
    """The building block on sparsemax, where u is known in closed form."""
    f = sm.GenericFactor(np.eye(3))
    z = np.array([0.5, 0.2, -1.0])
    d = np.array([1.0, -1.0, 0.0])
    # sparsemax(z) = z - tau on the support {0, 1}: du = d - mean(d on support) there
    np.testing.assert_allclose(finite_difference_jvp(f, z, None, d), [1.0, -1.0, 0.0],
                               atol=1e-8)
    np.testing.assert_allclose(finite_difference_jvp(f, z, None, None), 0.0)


def test_check_jacobian_report():
    f = sm.SequenceFactor(3, 2)
    rng = np.random.default_rng(1)
    rep = check_jacobian(f, rng.standard_normal((3, 2)), rng.standard_normal((2, 2, 2)),
                         n_directions=4, rng=0)
    assert rep.n_directions == 4 == len(rep.skipped)
    assert rep.n_checked + rep.n_skipped == 4
    assert rep.max_error <= 1e-6 and rep.step > 0
    # a point on a kink: sparsemax with a tie at the support's edge
    g = sm.GenericFactor(np.eye(3))
    rep = check_jacobian(g, [1.0, 0.0, 0.0], n_directions=6, rng=0, min_checked=0)
    assert rep.n_skipped >= 1


def test_check_jacobian_catches_wrong_products(monkeypatch):
    f = sm.SequenceFactor(3, 3)
    rng = np.random.default_rng(2)
    eta_u, eta_v = 0.3 * rng.standard_normal((3, 3)), 0.3 * rng.standard_normal((2, 3, 3))
    check_jacobian(f, eta_u, eta_v, rng=0)
    jvp, vjp = sm.SparseMAPResult.jvp, sm.SparseMAPResult.vjp
    monkeypatch.setattr(sm.SparseMAPResult, "jvp",
                        lambda self, du, dv=None: 1.01 * jvp(self, du, dv))
    with pytest.raises(AssertionError, match="finite differences"):
        check_jacobian(f, eta_u, eta_v, rng=0)
    monkeypatch.setattr(sm.SparseMAPResult, "jvp", jvp)
    monkeypatch.setattr(sm.SparseMAPResult, "vjp",
                        lambda self, g: (vjp(self, g)[0], 2 * vjp(self, g)[1] + 0.1))
    with pytest.raises(AssertionError, match="adjoint"):
        check_jacobian(f, eta_u, eta_v, rng=0)


@pytest.mark.parametrize("call, name", [
    (lambda r: r.jvp(np.zeros(5)), "d_eta_u"),
    (lambda r: r.jvp(np.full((3, 2), np.nan)), "d_eta_u"),
    (lambda r: r.jvp(np.zeros((3, 2)), np.zeros(3)), "d_eta_v"),
    (lambda r: r.vjp(np.zeros(4)), "du"),
    (lambda r: r.vjp(np.full((3, 2), np.inf)), "du"),
], ids=["jvp-shape", "jvp-nan", "jvp-eta_v-shape", "vjp-shape", "vjp-inf"])
def test_bad_jvp_vjp_input(call, name):
    r = sm.solve(sm.SequenceFactor(3, 2), np.zeros((3, 2)))
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        call(r)


def test_testing_tools_bad_input():
    f = sm.SequenceFactor(3, 2)
    eta = np.zeros((3, 2))
    with pytest.raises(ValueError, match="d_eta_u"):
        finite_difference_jvp(f, eta, None, np.zeros(4))
    with pytest.raises(ValueError, match="d_eta_v"):
        finite_difference_jvp(f, eta, None, eta, np.zeros(3))
    with pytest.raises(ValueError, match="eps"):
        finite_difference_jvp(f, eta, None, eta, eps=0.0)
    with pytest.raises(ValueError, match="n_directions"):
        check_jacobian(f, eta, n_directions=0)
    with pytest.raises(ValueError, match="eps"):
        check_jacobian(f, eta, eps=-1.0)
    with pytest.raises(ValueError, match="families"):
        factors(families=["sequence", "lattice"])
    with pytest.raises(ValueError, match="kinds"):
        scores(f, kinds=("uniform",))


def test_check_jacobian_checks_flat_trees():
    """At flat scores the support changes under any perturbation, yet u is locally linear:
    check_jacobian must compare there (it used to skip every direction and report 0)."""
    f = sm.TreeFactor(20)
    eta = 0.1 * np.random.default_rng(0).standard_normal(f.shape_u)
    rep = check_jacobian(f, eta, rng=0)
    assert rep.n_checked == rep.n_directions == 3 and "checked 3 of 3" in str(rep)
    assert rep.max_error <= 1e-6


def test_check_jacobian_says_when_nothing_was_checked():
    """sparsemax at z = (1, 0): u = (1, 0) sits on a kink along every direction moving z1 - z2."""
    f = sm.GenericFactor(np.eye(2))
    with pytest.raises(AssertionError, match="checked 0 of 2 directions"):
        check_jacobian(f, [1.0, 0.0], n_directions=2, rng=0)
    rep = check_jacobian(f, [1.0, 0.0], n_directions=2, rng=0, min_checked=0)
    assert rep.n_checked == 0 and rep.n_skipped == 2 and "checked 0 of 2" in str(rep)
