"""The active-set solver, each result checked against an independent reference.

References: the KKT conditions over every structure found by brute force, a
QP over the simplex of enumerated structures solved by SciPy (SLSQP), closed
forms (sparsemax, the two-variable pairwise factor, the product of sparsemax
that a chain with no transition scores reduces to, min-norm points of
symmetric polytopes) and recomputation of the reported quantities.
"""
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sparsemap as sm
from sparsemap.testing import (check_kkt, dense_columns, enumerate_structures, problems,
                               scores, support_key)

from _reference import (PAIRWISE_M, PAIRWISE_N, all_matchings, all_sequences, all_trees,
                        pairwise_closed_form, simplex_qp, sparsemax, sparsemax_jacobian, viterbi)


# -- helpers ------------------------------------------------------------------------------

def affinely_independent(M_S):
    """Columns affinely independent iff [M_S; 1^T] has full column rank."""
    A = np.r_[M_S, np.ones((1, M_S.shape[1]))]
    return np.linalg.matrix_rank(A, tol=1e-9) == M_S.shape[1]


def small_factors():
    """One or two small instances of every family (enumerable)."""
    out = [("sequence", sm.SequenceFactor(3, 3)), ("sequence", sm.SequenceFactor(5, 2)),
           ("sequence", sm.SequenceFactor(1, 4)),
           ("generic", sm.GenericFactor(np.eye(4))),
           ("generic", sm.GenericFactor(np.array([[1, 1, 0, 0, 1], [0, 1, 1, 0, 1],
                                                  [1, 0, 1, 0, 1]], float),
                                        np.array([[1, 0, 0, 1, 0]], float))),
           ("tree", sm.TreeFactor(3)), ("tree", sm.TreeFactor(3, projective=True)),
           ("tree", sm.TreeFactor(4, single_root=True)),
           ("tree", sm.TreeFactor(3, projective=True, single_root=True)),
           ("matching", sm.MatchingFactor(3, 3)), ("matching", sm.MatchingFactor(2, 4)),
           ("matching", sm.MatchingFactor(4, 3))]
    return out


SMALL = small_factors()
SMALL_IDS = [repr(f) for _, f in SMALL]


def solve_quiet(*args, **kwargs):
    """solve() turning a ConvergenceWarning into a test failure."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", sm.ConvergenceWarning)
        return sm.solve(*args, **kwargs)


# -- optimality on small instances of every factor --------------------------------------

@pytest.mark.parametrize("family, factor", SMALL, ids=SMALL_IDS)
def test_optimal_against_kkt_and_scipy_qp(family, factor):
    rng = np.random.default_rng(0)
    structures = enumerate_structures(factor)
    M, N = dense_columns(factor, structures)
    for trial in range(6):
        scale = [0.3, 1.0, 3.0][trial % 3]
        eta_u = scale * rng.standard_normal(factor.shape_u)
        eta_v = scale * rng.standard_normal(factor.shape_v)
        r = solve_quiet(factor, eta_u, eta_v)
        assert r.converged
        check_kkt(factor, r, eta_u, eta_v, structures=structures)
        ref = simplex_qp(M, M.T @ eta_u.reshape(-1) + N.T @ eta_v.reshape(-1))
        assert ref is not None, "the SciPy reference found no certified solution"
        np.testing.assert_allclose(r.u.reshape(-1), ref[0], atol=1e-8, rtol=0)


@settings(max_examples=150, deadline=None)
@given(problems(kinds=("gaussian", "ties", "floats")))
def test_optimal_kkt_hypothesis(problem):
    factor, eta_u, eta_v = problem
    r = solve_quiet(factor, eta_u, eta_v)
    rep = check_kkt(factor, r, eta_u, eta_v)
    # the reported gap is the Wolfe gap of the returned point
    assert abs(r.gap - rep.gap) <= 1e-9 * max(1.0, np.abs(eta_u).sum() + np.abs(eta_v).sum())


# -- closed forms -----------------------------------------------------------------------

@pytest.mark.parametrize("d", [1, 2, 5, 12])
def test_generic_identity_is_sparsemax(d):
    f = sm.GenericFactor(np.eye(d))
    rng = np.random.default_rng(d)
    for scale in [0.01, 0.3, 1.0, 10.0]:
        z = scale * rng.standard_normal(d)
        r = solve_quiet(f, z)
        np.testing.assert_allclose(r.u, sparsemax(z), atol=1e-12)
        J = np.array([r.jvp(e) for e in np.eye(d)]).T      # column j = J e_j
        np.testing.assert_allclose(J, sparsemax_jacobian(z), atol=1e-12)
        Jt = np.array([r.vjp(e)[0] for e in np.eye(d)])    # row j = e_j^T J
        np.testing.assert_allclose(Jt, sparsemax_jacobian(z), atol=1e-12)


def test_sparsemax_closed_form_is_right():
    """Sanity of the reference itself against SciPy's QP."""
    rng = np.random.default_rng(1)
    for _ in range(5):
        z = rng.standard_normal(5)
        np.testing.assert_allclose(sparsemax(z), simplex_qp(np.eye(5), z)[0], atol=1e-8)


def pairwise_cases():
    rng = np.random.default_rng(2)
    cases = [rng.uniform(-1.5, 2.5, size=3) for _ in range(40)]
    # every branch of the closed form, by construction
    cases += [np.array(c, float) for c in [
        (0.9, 0.1, 0.3), (0.1, 0.9, 0.3), (0.4, 0.5, 0.6), (2.0, 2.0, 1.0), (-1, -1, 0.5),
        (0.3, 0.4, -0.5), (1.5, 1.2, -0.3), (0.9, 0.8, -0.5), (2.0, -1.0, -0.3),
        (0.5, 0.5, 0.0), (0.2, 0.3, 0.0)]]
    return cases


def test_pairwise_closed_form_matches_scipy():
    """The derivation in pairwise_closed_form, verified by a brute-force QP."""
    for c in pairwise_cases():
        u1, u2, v = pairwise_closed_form(*c)
        ref = simplex_qp(PAIRWISE_M, PAIRWISE_M.T @ c[:2] + PAIRWISE_N.T @ c[2:])
        assert ref is not None
        np.testing.assert_allclose([u1, u2], ref[0], atol=1e-8)


@pytest.mark.parametrize("c", pairwise_cases(), ids=lambda c: np.array2string(c, precision=2))
def test_pairwise_factor_closed_form(c):
    f = sm.GenericFactor(PAIRWISE_M, PAIRWISE_N)
    r = solve_quiet(f, c[:2], c[2:])
    u1, u2, v = pairwise_closed_form(*c)
    np.testing.assert_allclose(r.u, [u1, u2], atol=1e-12)
    if c[2] != 0:   # v is unique unless the pairwise score is zero
        np.testing.assert_allclose(r.v, [v], atol=1e-12)
    check_kkt(f, r, c[:2], c[2:])
    # Jacobian: the closed form is piecewise linear; central differences of it
    h = 1e-7
    J_ref = np.empty((2, 3))
    for j in range(3):
        e = np.zeros(3)
        e[j] = h
        J_ref[:, j] = (np.array(pairwise_closed_form(*(c + e))[:2])
                       - np.array(pairwise_closed_form(*(c - e))[:2])) / (2 * h)
    J = np.array([r.jvp(e[:2], e[2:]) for e in np.eye(3)]).T
    kink = any(support_key(solve_quiet(f, (c + s * h * e)[:2], (c + s * h * e)[2:]).structures)
               != support_key(r.structures) for e in np.eye(3) for s in (-1, 1))
    if not kink:
        np.testing.assert_allclose(J, J_ref, atol=1e-6)


@pytest.mark.parametrize("n, m", [(2, 2), (4, 3), (6, 3), (5, 4)])
def test_sequence_without_transitions_is_product_of_sparsemax(n, m):
    """eta_v = 0: the marginal polytope is a product of simplices, so u[i] = sparsemax(eta_u[i]).

    The optimal face holds many affinely dependent structures (tail swaps), which the
    solver meets on the way. The u-Jacobian is block-diagonal with sparsemax blocks
    (for generic eta_u).
    """
    f = sm.SequenceFactor(n, m)
    rng = np.random.default_rng(n * 10 + m)
    for _ in range(5):
        eta_u = rng.standard_normal((n, m)) * 0.5
        r = solve_quiet(f, eta_u)
        ref = np.array([sparsemax(row) for row in eta_u])
        np.testing.assert_allclose(r.u, ref, atol=1e-10)
        MS, _ = dense_columns(f, r.structures)
        assert affinely_independent(MS)
        for _ in range(3):
            d = rng.standard_normal((n, m))
            du_ref = np.array([sparsemax_jacobian(row) @ di for row, di in zip(eta_u, d)])
            np.testing.assert_allclose(r.jvp(d), du_ref, atol=1e-9)


# -- degenerate cases ---------------------------------------------------------------------

def test_sequence_affine_dependence_5x3():
    """(5, 3) chains: dependent columns appear; check optimality by enumeration."""
    f = sm.SequenceFactor(5, 3)
    structures = enumerate_structures(f)
    M, N = dense_columns(f, structures)
    rng = np.random.default_rng(5)
    for trial in range(15):
        # small transition scores leave a large optimal face: dependence is routine
        eta_u = rng.standard_normal((5, 3)) * 0.5
        eta_v = rng.standard_normal((4, 3, 3)) * [0.0, 0.01, 0.3][trial % 3]
        r = solve_quiet(f, eta_u, eta_v)
        MS, NS = dense_columns(f, r.structures)
        assert affinely_independent(MS)
        adj_S = MS.T @ (eta_u - r.u).ravel() + NS.T @ eta_v.ravel()
        adj = M.T @ (eta_u - r.u).ravel() + N.T @ eta_v.ravel()
        assert np.ptp(adj_S) <= 1e-12
        assert adj.max() <= adj_S.max() + r.gap + 1e-12
        check_kkt(f, r, eta_u, eta_v, structures=structures)


def test_tail_swaps_in_warm_start():
    """m_a + m_b = m_c + m_d for tail swaps: a warm start holding all four must not break."""
    f = sm.SequenceFactor(5, 3)
    a, b = [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]
    c, d = [0, 0, 1, 1, 1], [1, 1, 0, 0, 0]
    ma, mb, mc, md = (f.vertex(s)[0] for s in (a, b, c, d))
    assert np.array_equal(ma + mb, mc + md)
    eta_u = np.zeros((5, 3))
    eta_u[:, 2] = -1.0        # tag 2 never used
    eta_u[:, 0] = [0.1, -0.05, 0.2, 0.0, 0.05]
    for init in ([a, b, c, d], [c, d, a, b], [a, b, c, d, a, c]):
        r = solve_quiet(f, eta_u, init=init)
        np.testing.assert_allclose(r.u, [sparsemax(row) for row in eta_u], atol=1e-12)
        assert affinely_independent(dense_columns(f, r.structures)[0])


def test_generic_same_m_different_n():
    """Two structures with the same m_s and different n_s: the better n_s wins."""
    M = np.array([[1, 1, 0], [0, 0, 1]], float)
    N = np.array([[1, 0, 0]], float)
    f = sm.GenericFactor(M, N)
    rng = np.random.default_rng(6)
    for _ in range(20):
        eta_u = rng.standard_normal(2)
        eta_v = rng.standard_normal(1)
        r = solve_quiet(f, eta_u, eta_v)
        z = np.array([eta_u[0] + max(eta_v[0], 0.0), eta_u[1]])
        np.testing.assert_allclose(r.u, sparsemax(z), atol=1e-12)
        np.testing.assert_allclose(r.v, [r.u[0] if eta_v[0] > 0 else 0.0], atol=1e-12)
        # Jacobian: chain rule through z
        Jz = sparsemax_jacobian(z)
        dz = np.array([[1, 0, float(eta_v[0] > 0)], [0, 1, 0]])
        J = np.array([r.jvp(e[:2], e[2:]) for e in np.eye(3)]).T
        np.testing.assert_allclose(J, Jz @ dz, atol=1e-12)
    # eta_v = 0: the two columns tie and are identical in M (affinely dependent)
    for init in (None, [0, 1, 2], [1, 0, 2, 0]):
        r = solve_quiet(f, [0.3, 0.1], [0.0], init=init)
        np.testing.assert_allclose(r.u, sparsemax([0.3, 0.1]), atol=1e-12)
        assert len(r.structures) == 2


def test_generic_zero_column():
    """Columns e_1..e_d and 0: u is the projection onto {u >= 0, sum u <= 1}."""
    d = 4
    f = sm.GenericFactor(np.c_[np.eye(d), np.zeros(d)])
    rng = np.random.default_rng(7)
    for scale in [0.05, 0.2, 0.5, 1.0, 3.0]:
        for _ in range(4):
            z = scale * rng.standard_normal(d)
            r = solve_quiet(f, z)
            p = np.maximum(z, 0)
            ref = p if p.sum() <= 1 else sparsemax(z)
            np.testing.assert_allclose(r.u, ref, atol=1e-12)
            check_kkt(f, r, z)
            J = np.array([r.jvp(e) for e in np.eye(d)]).T
            if p.sum() <= 1:
                J_ref = np.diag((z > 0).astype(float))
            else:
                J_ref = sparsemax_jacobian(z)
            np.testing.assert_allclose(J, J_ref, atol=1e-10)
    # all scores negative: the zero column alone
    r = solve_quiet(f, -np.ones(d))
    assert r.structures == [d] and np.all(r.u == 0)


def min_norm_cases():
    cases = [(sm.SequenceFactor(4, 3), 1 / 3), (sm.SequenceFactor(6, 2), 1 / 2),
             (sm.GenericFactor(np.eye(7)), 1 / 7),
             # by symmetry the min-norm point is constant; each row (column) sums to 1
             (sm.MatchingFactor(4, 4), 1 / 4), (sm.MatchingFactor(3, 5), 1 / 5),
             (sm.MatchingFactor(5, 2), 1 / 5),
             # non-projective trees: the symmetric point 1/n on every arc is feasible and
             # has the least norm among symmetric points (single root or not)
             (sm.TreeFactor(4), 1 / 4), (sm.TreeFactor(4, single_root=True), 1 / 4)]
    return cases


@pytest.mark.parametrize("factor, value", min_norm_cases(), ids=lambda x: repr(x))
def test_all_zero_scores_min_norm_point(factor, value):
    r = solve_quiet(factor, np.zeros(factor.shape_u))
    expected = np.full(factor.shape_u, value)
    if isinstance(factor, sm.TreeFactor):
        expected[:, 0] = 0
        np.fill_diagonal(expected, 0)
    np.testing.assert_allclose(r.u, expected, atol=1e-10)
    assert len(r.structures) >= 2
    MS, _ = dense_columns(factor, r.structures)
    assert affinely_independent(MS)


@pytest.mark.parametrize("family, factor", SMALL, ids=SMALL_IDS)
def test_tied_scores(family, factor):
    structures = enumerate_structures(factor)
    rng = np.random.default_rng(8)
    cases = [np.ones(factor.shape_u), np.zeros(factor.shape_u)]
    cases += [rng.choice([-1.0, 0.0, 1.0], size=factor.shape_u) for _ in range(4)]
    for eta_u in cases:
        for eta_v in (np.zeros(factor.shape_v), rng.choice([0.0, 1.0], size=factor.shape_v)):
            r = solve_quiet(factor, eta_u, eta_v)
            check_kkt(factor, r, eta_u, eta_v, structures=structures)


@pytest.mark.parametrize("scale", [1e-12, 1e-8, 1e-4, 1.0, 1e4, 1e8, 1e12])
def test_extreme_scales(scale):
    rng = np.random.default_rng(9)
    f = sm.SequenceFactor(4, 3)
    structures = enumerate_structures(f)
    M, N = dense_columns(f, structures)
    g = sm.GenericFactor(np.eye(6))
    for _ in range(3):
        eta_u = scale * rng.standard_normal((4, 3))
        eta_v = scale * rng.standard_normal((3, 3, 3))
        r = solve_quiet(f, eta_u, eta_v)
        check_kkt(f, r, eta_u, eta_v, structures=structures)
        if scale <= 1e-8:     # the scores barely move u off the min-norm point
            np.testing.assert_allclose(r.u, 1 / 3, atol=1e-6)
        if scale >= 1e8:      # the best structure by brute force, alone
            best = structures[int(np.argmax(M.T @ eta_u.ravel() + N.T @ eta_v.ravel()))]
            assert support_key(r.structures) == support_key([best])
            np.testing.assert_array_equal(r.u, f.vertex(best)[0])
        z = scale * rng.standard_normal(6)
        rs = solve_quiet(g, z)
        np.testing.assert_allclose(rs.u, sparsemax(z), atol=1e-12 * max(1, scale))


def test_large_cancelling_scores_converge():
    """Scores of 1e8 whose sum over a structure cancels to O(1): eta_u . u is small, but the
    round-off in the gap is that of the 1e8 terms. The solve must count as converged (the
    answer is exact up to that round-off), not stall with a ConvergenceWarning."""
    f = sm.GenericFactor(np.array([[1, 1], [1, 0], [0, 1]], float))
    B = 1e8
    eta_u = np.array([B, -B + 0.3, -B + 0.5])
    # theta = (0.3, 0.5), Gram [[2, 1], [1, 2]]: y1 - y2 = theta1 - theta2 = -0.2, so
    # y = (0.4, 0.6) and u = (1, 0.4, 0.6)
    r = solve_quiet(f, eta_u)
    assert r.converged, r.message
    np.testing.assert_allclose(r.u, [1.0, 0.4, 0.6], atol=1e-7)


def test_map_already_optimal():
    """A dominant structure: the first MAP answer is the solution and stays in the set."""
    f = sm.SequenceFactor(4, 3)
    tags = [2, 0, 1, 1]
    eta_u = np.full((4, 3), -1.0)
    eta_u[np.arange(4), tags] = 2.0
    r = solve_quiet(f, eta_u)
    assert support_key(r.structures) == support_key([tags])
    np.testing.assert_array_equal(r.weights, [1.0])
    np.testing.assert_array_equal(r.u, f.vertex(tags)[0])
    assert r.n_iter == 1
    # the same with the solution already in a warm start, among others
    r2 = solve_quiet(f, eta_u, init=[[0, 0, 0, 0], tags, [1, 1, 1, 1]])
    np.testing.assert_allclose(r2.u, r.u, atol=1e-14)


def tol_zero_cases():
    rng = np.random.default_rng(10)
    cases = [(sm.SequenceFactor(5, 3), rng.standard_normal((5, 3)), rng.standard_normal((4, 3, 3)))
             for _ in range(5)]
    # Degenerate: eta_u[1] - u[1] = 0 at the solution, so every structure ties at tau
    # (the whole polytope is optimal in the KKT sense) and round-off decides MAP.
    cases.append((sm.SequenceFactor(3, 2), np.array([[0.4, 1.3], [0.0, 1.0], [1.4, 1.2]]),
                  np.zeros((2, 2, 2))))
    return cases


@pytest.mark.parametrize("factor, eta_u, eta_v", tol_zero_cases(),
                         ids=[f"random-{i}" for i in range(5)] + ["degenerate-ties"])
def test_tol_zero_terminates(factor, eta_u, eta_v):
    """tol=0: at the round-off floor MAP keeps returning structures that tie with the
    support (active ones, or weakly active ones that enter and leave again). The solver
    must stop there (converged, or a ConvergenceWarning saying it stalled), not spin
    until max_iter."""
    structures = enumerate_structures(factor)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        r = sm.solve(factor, eta_u, eta_v, tol=0.0, max_iter=1000)
    check_kkt(factor, r, eta_u, eta_v, structures=structures)
    assert r.n_iter < 100, (r.n_iter, r.message)
    if not r.converged:
        assert any(issubclass(x.category, sm.ConvergenceWarning) for x in w)
        assert "stall" in r.message


@pytest.mark.parametrize("family, factor", SMALL, ids=SMALL_IDS)
def test_warm_start_same_u(family, factor):
    rng = np.random.default_rng(11)
    structures = enumerate_structures(factor)
    for _ in range(3):
        eta_u = rng.standard_normal(factor.shape_u)
        eta_v = rng.standard_normal(factor.shape_v)
        r = solve_quiet(factor, eta_u, eta_v)
        r_prev = solve_quiet(factor, eta_u, eta_v, init=r)
        np.testing.assert_allclose(r_prev.u, r.u, atol=1e-12)
        # from a perturbed problem's result
        r_other = solve_quiet(factor, eta_u + 0.3 * rng.standard_normal(factor.shape_u), eta_v)
        np.testing.assert_allclose(solve_quiet(factor, eta_u, eta_v, init=r_other).u, r.u,
                                   atol=1e-12)
        # from lists: everything (dependent and repeated), a random subset
        idx = rng.choice(len(structures), size=min(5, len(structures)), replace=True)
        for init in (structures, [structures[i] for i in idx]):
            np.testing.assert_allclose(solve_quiet(factor, eta_u, eta_v, init=init).u, r.u,
                                       atol=1e-12)


def test_max_iter_reached():
    f = sm.SequenceFactor(5, 3)
    structures = enumerate_structures(f)
    M, N = dense_columns(f, structures)
    rng = np.random.default_rng(12)
    n_warned = 0
    for _ in range(5):
        eta_u, eta_v = rng.standard_normal((5, 3)), 0.2 * rng.standard_normal((4, 3, 3))
        # the vertex side's loop (the facet side solves these in one piece)
        best = solve_quiet(f, eta_u, eta_v, method="vertex")
        assert best.n_iter > 2
        for max_iter in (1, 2):
            with pytest.warns(sm.ConvergenceWarning):
                r = sm.solve(f, eta_u, eta_v, max_iter=max_iter, method="vertex")
            n_warned += 1
            assert not r.converged and r.n_iter == max_iter
            # reported quantities are those of the returned point
            u, v = r.u.ravel(), r.v.ravel()
            assert r.objective == pytest.approx(0.5 * u @ u - eta_u.ravel() @ u
                                                - eta_v.ravel() @ v, abs=1e-12)
            adj = M.T @ (eta_u.ravel() - u) + N.T @ eta_v.ravel()
            wolfe = adj.max() - (eta_u.ravel() @ u + eta_v.ravel() @ v - u @ u)
            assert r.gap == pytest.approx(wolfe, abs=1e-12)
            subopt = r.objective - best.objective
            assert subopt > 0
            assert r.gap >= subopt - 1e-12
    assert n_warned == 10


# -- result invariants ----------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(problems(), st.booleans())
def test_result_invariants(problem, return_history):
    factor, eta_u, eta_v = problem
    r = solve_quiet(factor, eta_u, eta_v, return_history=return_history)
    w = r.weights
    assert len(r.structures) == w.shape[0] >= 1
    assert np.all(w > 0) and abs(w.sum() - 1) <= 1e-12
    assert len(support_key(r.structures)) == len(r.structures)   # no repeats
    for s in r.structures:
        factor.check_structure(s)
    MS, NS = dense_columns(factor, r.structures)
    assert r.u.shape == factor.shape_u and r.v.shape == factor.shape_v
    assert r.u.dtype == np.float64 and r.v.dtype == np.float64
    np.testing.assert_allclose(r.u.ravel(), MS @ w, atol=1e-12)
    np.testing.assert_allclose(r.v.ravel(), NS @ w, atol=1e-12)
    # the support (on the facet side, the decomposition of (u, v) it gives on request)
    assert affinely_independent(MS if r.side == "vertex" else np.vstack([MS, NS]))
    size = max(1.0, np.abs(eta_u).sum() + np.abs(eta_v).sum())
    assert r.gap >= -1e-12 * size
    u, v = r.u.ravel(), r.v.ravel()
    assert r.objective == pytest.approx(0.5 * u @ u - eta_u.ravel() @ u - eta_v.ravel() @ v,
                                        abs=1e-12 * size)
    assert r.n_iter >= 1 and r.n_map >= 1
    if not return_history:
        assert r.history is None
        return
    h = r.history
    # the facet side records one row, its solution, holding no structures
    rows, least = (r.n_iter, 1) if r.side == "vertex" else (1, 0)
    for key in ("objective", "gap", "support_size", "seconds"):
        assert h[key].shape == (rows,)
    assert np.all(h["support_size"] >= least)
    assert np.all(np.diff(h["seconds"]) >= 0)
    assert np.all(np.diff(h["objective"]) <= 1e-12 * size)
    assert h["objective"][-1] == pytest.approx(r.objective, abs=1e-12 * size)
    assert np.all(h["gap"] >= -1e-12 * size)


def test_history_support_counts_positive_weights():
    """Sparsemax of (0.5, 0) is (0.75, 0.25): iteration 1 sits at the MAP vertex (one
    structure; the second enters at weight 0), iteration 2 at the solution (two)."""
    r = sm.solve(sm.GenericFactor(np.eye(2)), np.array([0.5, 0.0]), return_history=True)
    np.testing.assert_allclose(r.u, [0.75, 0.25])
    assert r.history["support_size"].tolist() == [1, 2]
    np.testing.assert_allclose(r.history["objective"], [0.5 * 1 - 0.5, 0.5 * (0.75**2 + 0.25**2) - 0.5 * 0.75])


# -- threads --------------------------------------------------------------------------------

def test_shared_factor_across_threads():
    rng = np.random.default_rng(13)
    cases = [sm.SequenceFactor(8, 4), sm.GenericFactor(rng.integers(0, 2, (6, 30)).astype(float)),
             sm.MatchingFactor(5, 6)]
    for f in cases:
        probs = [(rng.standard_normal(f.shape_u), rng.standard_normal(f.shape_v))
                 for _ in range(60)]
        d = rng.standard_normal(f.shape_u)

        def run(p):
            r = sm.solve(f, *p)
            return r.u, r.weights, support_key(r.structures), r.jvp(d)

        sequential = [run(p) for p in probs]
        with ThreadPoolExecutor(max_workers=4) as ex:
            parallel = list(ex.map(run, probs))
        for a, b in zip(sequential, parallel):
            np.testing.assert_array_equal(a[0], b[0])
            np.testing.assert_array_equal(a[1], b[1])
            assert a[2] == b[2]
            np.testing.assert_array_equal(a[3], b[3])


# -- bad input ------------------------------------------------------------------------------

F = sm.SequenceFactor(3, 2)
EU = np.zeros((3, 2))


@pytest.mark.parametrize("kwargs, name", [
    (dict(eta_u=np.zeros((2, 3))), "eta_u"),
    (dict(eta_u=np.zeros(6)), "eta_u"),
    (dict(eta_u=np.array([[0, 1], [np.nan, 0], [0, 0]])), "eta_u"),
    (dict(eta_u=np.array([[0, 1], [np.inf, 0], [0, 0]])), "eta_u"),
    (dict(eta_u="abc"), "eta_u"),
    (dict(eta_u=None), "eta_u"),
    (dict(eta_v=np.zeros((2, 3))), "eta_v"),     # (2, 2) is a shared transition matrix
    (dict(eta_v=np.zeros((2, 2, 3))), "eta_v"),
    (dict(eta_v=np.full((2, 2, 2), -np.inf)), "eta_v"),
    (dict(method="newton"), "method"),
    (dict(method=None), "method"),
    (dict(max_iter=0), "max_iter"),
    (dict(max_iter=-3), "max_iter"),
    (dict(max_iter=2.5), "max_iter"),
    (dict(max_iter=True), "max_iter"),
    (dict(max_iter="10"), "max_iter"),
    (dict(tol=-1e-3), "tol"),
    (dict(tol=np.nan), "tol"),
    (dict(tol=np.inf), "tol"),
    (dict(tol="small"), "tol"),
    (dict(init=5), "init"),
    (dict(init=[[0, 0, 5]]), "init"),
    (dict(init=[[0, 0]]), "init"),
    (dict(init=[[0, -1, 0]]), "init"),
    (dict(init=[[0.5, 0, 0]]), "init"),
    (dict(init=[[0, 0, 0]], method="cg"), "init"),
])
def test_bad_input(kwargs, name):
    args = dict(eta_u=EU)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        sm.solve(F, **args)


def test_bad_factor_and_foreign_init():
    with pytest.raises(ValueError, match="factor"):
        sm.solve("not a factor", EU)
    other = sm.solve(sm.SequenceFactor(3, 3), np.zeros((3, 3)))
    with pytest.raises(ValueError, match="init"):
        sm.solve(F, EU, init=other)


# -- the testing tools themselves -----------------------------------------------------------

def test_enumerate_structures():
    assert len(enumerate_structures(sm.SequenceFactor(4, 3))) == 3 ** 4
    assert len(enumerate_structures(sm.GenericFactor(np.ones((2, 5))))) == 5
    assert len(enumerate_structures(sm.MatchingFactor(3, 4))) == 4 * 3 * 2
    assert len(enumerate_structures(sm.MatchingFactor(4, 2))) == 4 * 3
    # Cayley: rooted trees on n + 1 labelled nodes with root 0: (n + 1)^(n - 1);
    # with a single root child: n^(n - 1)
    assert len(enumerate_structures(sm.TreeFactor(4))) == 5 ** 3
    assert len(enumerate_structures(sm.TreeFactor(4, single_root=True))) == 4 ** 3
    # projective: 1, 3, 12, 55 (Catalan-like counts of Eisner's trees)
    assert [len(enumerate_structures(sm.TreeFactor(n, projective=True)))
            for n in (1, 2, 3, 4)] == [1, 3, 12, 55]
    # the very structures of an enumeration that does not use the factor (lexicographic order)
    for f, ref in [(sm.SequenceFactor(3, 2), all_sequences(3, 2)),
                   (sm.MatchingFactor(3, 2), all_matchings(3, 2)),
                   (sm.MatchingFactor(2, 3), all_matchings(2, 3))] + \
            [(sm.TreeFactor(n, projective=p, single_root=r), all_trees(n, p, r))
             for n in (1, 3, 4) for p in (False, True) for r in (False, True)]:
        got = enumerate_structures(f)
        assert [tuple(s) for s in got] == sorted(tuple(s) for s in ref), f
    o = sm.OracleFactor(lambda eu, ev: int(np.argmax(eu)), lambda s: np.eye(3)[s], shape_u=3)
    with pytest.raises(ValueError, match="values"):
        enumerate_structures(o)
    assert enumerate_structures(o, values=[range(3)]) == [0, 1, 2]


def test_testing_errors_name_the_arguments_of_the_function_called():
    o = sm.OracleFactor(lambda eu, ev: int(np.argmax(eu)), lambda s: np.eye(3)[s], shape_u=3)
    eta = np.array([1.0, 0.5, -1.0])
    r = sm.solve(o, eta)
    with pytest.raises(ValueError, match=r"^structures: check_kkt cannot list .*pass them"):
        check_kkt(o, r, eta)
    check_kkt(o, r, eta, structures=enumerate_structures(o, values=[range(3)]))
    big = sm.SequenceFactor(20, 3)      # 3**20 candidates
    eu = np.zeros((20, 3))
    with pytest.raises(ValueError, match=r"^structures: .*too many structures"):
        check_kkt(big, sm.solve(big, eu), eu)
    for bad in ("x", -1.0, [], [1.0, np.inf]):
        with pytest.raises(ValueError, match="^scale: "):
            scores(sm.SequenceFactor(2, 2), scale=bad)


def test_check_kkt_rejects_wrong_solutions():
    f = sm.SequenceFactor(3, 3)
    rng = np.random.default_rng(14)
    eta_u, eta_v = 0.2 * rng.standard_normal((3, 3)), 0.2 * rng.standard_normal((2, 3, 3))
    r = sm.solve(f, eta_u, eta_v)
    check_kkt(f, r, eta_u, eta_v)

    class Fake:
        pass

    # the MAP structure alone is not optimal for these scores
    fake = Fake()
    fake.structures = [f.map(eta_u, eta_v)]
    fake.weights = np.ones(1)
    fake.u, fake.v = f.vertex(fake.structures[0])
    assert len(r.structures) > 1
    with pytest.raises(AssertionError, match="adjusted score"):
        check_kkt(f, fake, eta_u, eta_v)
    # u that does not match the weights
    fake = Fake()
    fake.structures, fake.weights, fake.v = r.structures, r.weights, r.v
    fake.u = r.u + 1e-3
    with pytest.raises(AssertionError, match="u != sum"):
        check_kkt(f, fake, eta_u, eta_v)
    # nothing to compare with is an error, not a pass
    with pytest.raises(ValueError, match="structures"):
        check_kkt(f, r, eta_u, eta_v, structures=[])


# -- degenerate pivoting: small scores, sequences ----------------------------------------

@pytest.mark.parametrize("scale", [1e-6, 1e-9])
def test_small_scores_sequence_converges_with_a_true_gap(scale):
    """Small scores put u near the min-norm point and make the transitions an LP over
    many tied structures: the active set pivots for a long time (dependent columns,
    gaps that rise before they fall) and must still get there, not stop early. The gap
    it reports is recomputed here with an independent Viterbi."""
    rng = np.random.default_rng(1)
    f = sm.SequenceFactor(12, 5)
    eta_u, eta_v = scale * rng.standard_normal((12, 5)), scale * rng.standard_normal((11, 5, 5))
    r = sm.solve(f, eta_u, eta_v)
    assert r.converged, r
    u, v = np.zeros((12, 5)), np.zeros((11, 5, 5))
    for s, w in zip(r.structures, r.weights):
        m, n = f.vertex(s)
        u += w * m
        v += w * n
    np.testing.assert_allclose(r.u, u, atol=1e-14)
    wolfe = viterbi(eta_u - u, eta_v)[1] - ((eta_u - u) * u).sum() - (eta_v * v).sum()
    assert abs(wolfe - r.gap) <= 1e-13
    # the documented rule: gap <= tol * gap_scale (||u||^2 = 2.4 here, so the
    # bound is relative, not 1e-12 absolute: round-off differs between CPUs)
    scale = max(1.0, np.abs(eta_u * u).sum() + np.abs(eta_v * v).sum() + (u * u).sum())
    assert wolfe <= 1e-12 * scale
