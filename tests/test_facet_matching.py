"""The facet-side solver of matchings against independent references.

References: brute-force QPs over every enumerated matching (``simplex_qp``), the
KKT conditions over every structure (``check_kkt``), a SciPy QP on the Birkhoff
constraints certified by its own KKT conditions, the vertex side (``sm.solve``),
the duality gap through the factor's MAP, and finite differences.
"""
import pickle
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from scipy.optimize import linprog, minimize

import sparsemap as sm
from sparsemap._facet import FacetSolution
from sparsemap._facet_matching import MatchingFacetSolver
from sparsemap.testing import check_kkt, finite_difference_jvp

from _reference import all_matchings, matching_matrix, simplex_qp

SOLVED, DECLINED = 0, 1
SHAPES = [(1, 1), (1, 3), (3, 1), (2, 2), (2, 3), (3, 2), (3, 3), (2, 4), (4, 2), (3, 4),
          (4, 3), (4, 4)]
SCALES = [0.01, 0.1, 1.0, 5.0]


def solve(eta, **kw):
    f = sm.MatchingFactor(*eta.shape)
    return f, MatchingFacetSolver(f, decline_peaked=False).solve(eta, **kw)


def score_cases(shape, rng):
    """Gaussian scores at flat to peaked scales, constant scores, integer ties, masks."""
    out = [(f"gauss{s}", s * rng.standard_normal(shape)) for s in SCALES]
    out.append(("const", np.full(shape, 0.7)))
    out.append(("int", rng.integers(-1, 2, shape).astype(float)))
    masked = rng.standard_normal(shape)
    masked[rng.random(shape) < 0.3] = -np.inf
    out.append(("mask", masked))
    return out


def allowed(eta, s):
    return all(np.isfinite(eta[i, c]) for i, c in enumerate(s) if c != -1)


def brute_force_u(eta):
    """u from a QP over the simplex of every allowed matching (SciPy, KKT-certified)."""
    ss = [s for s in all_matchings(*eta.shape) if allowed(eta, s)]
    if not ss:
        return None
    M = np.array([matching_matrix(s, eta.shape[1]).ravel() for s in ss]).T
    theta = np.array([sum(eta[i, c] for i, c in enumerate(s) if c != -1) for s in ss])
    ref = simplex_qp(M, theta)
    assert ref is not None, "the SciPy reference found no certified solution"
    return ref[0].reshape(eta.shape)


def birkhoff_qp(eta):
    """min 1/2 |x - eta|^2 on the rectangular Birkhoff polytope by SLSQP, polished and
    certified by its KKT conditions. On the support S and the tight longer-side lines
    T, x_S solves the equalities with x_S - eta_S = a_i + b_j (least squares); then
    x >= 0 and the lines' sums must hold, and multipliers must exist (HiGHS, a
    feasibility LP) with a_i + b_j = x - eta on S, a_i + b_j <= -eta off S, and
    b_j <= 0 on T, 0 off T (an inequality's multiplier), all to 1e-9. Returns x, or
    None if no threshold certifies."""
    n, m = eta.shape
    tall = n > m
    E = eta.T if tall else eta                       # short side first: rows sum to 1
    k, K = E.shape
    A_rows = np.kron(np.eye(k), np.ones((1, K)))
    A_cols = np.kron(np.ones((1, k)), np.eye(K))
    cons = [{"type": "eq", "fun": lambda x: A_rows @ x - 1, "jac": lambda x: A_rows}]
    if k < K:
        cons.append({"type": "ineq", "fun": lambda x: 1 - A_cols @ x, "jac": lambda x: -A_cols})
    else:   # one column's equality is implied by the others (SLSQP needs them independent)
        cons.append({"type": "eq", "fun": lambda x: A_cols[1:] @ x - 1,
                     "jac": lambda x: A_cols[1:]})
    e = E.ravel()
    res = minimize(lambda x: 0.5 * (x - e) @ (x - e), np.full(k * K, 1.0 / K),
                   jac=lambda x: x - e, bounds=[(0, None)] * (k * K), constraints=cons,
                   method="SLSQP", options={"ftol": 1e-16, "maxiter": 1000})
    Bt_all = np.hstack([A_rows.T, A_cols.T])         # (a, b) -> a_i + b_j
    for thresh in (1e-6, 1e-8, 1e-4):
        S = res.x > thresh
        tight = (k == K) | (A_cols @ res.x > 1 - thresh)
        T = np.flatnonzero(tight)
        B = np.vstack([A_rows * S, A_cols[T] * S])
        Bt = np.hstack([A_rows.T, A_cols[T].T]) * S[:, None]
        y = np.linalg.lstsq(B @ Bt, 1 - B @ (e * S), rcond=None)[0]
        x = np.where(S, e + Bt @ y, 0.0)
        if not (np.abs(A_rows @ x - 1).max() < 1e-9 and (A_cols @ x).max() < 1 + 1e-9
                and np.abs(A_cols[T] @ x - 1).max(initial=0) < 1e-9
                and x.min() > -1e-9):
            continue
        bounds = [(None, None)] * k + [((None, None) if k == K else
                                        (None, 0.0) if tight[j] else (0.0, 0.0))
                                       for j in range(K)]
        lp = linprog(np.zeros(k + K), A_ub=Bt_all[~S], b_ub=-e[~S], A_eq=Bt_all[S],
                     b_eq=(x - e)[S], bounds=bounds, method="highs")
        if lp.status != 0:
            continue
        z = Bt_all @ lp.x
        if (np.abs(z - (x - e))[S].max(initial=0) < 1e-9 and (z + e)[~S].max(initial=-1) < 1e-9
                and (k == K or lp.x[k:].max() < 1e-9)):
            X = x.reshape(k, K)
            return X.T if tall else X
    return None


def gap(f, eta, u):
    """The duality gap of u (one MAP call): max_s <eta - u, m_s> - <eta - u, u>."""
    fin = np.isfinite(eta)
    theta = np.where(fin, eta - u, -np.inf)
    m = f.vertex(f.map(theta))[0]
    return np.where(m > 0, theta, 0.0).sum() - np.where(fin, eta - u, 0.0).ravel() @ u.ravel()


# -- optimality ------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_brute_force_qp_and_kkt_over_all_structures(shape):
    rng = np.random.default_rng(sum(shape))
    f = sm.MatchingFactor(*shape)
    for name, eta in score_cases(shape, rng):
        sol = MatchingFacetSolver(f, decline_peaked=False).solve(eta)
        ref = brute_force_u(eta)
        if ref is None:                 # every matching uses a forbidden pair
            assert sol.status == DECLINED
            continue
        assert sol.status == SOLVED, name
        np.testing.assert_allclose(sol.u, ref, atol=1e-8, err_msg=name)
        assert max(sol.residuals) < 1e-12
        # with decompose's weights, u satisfies the KKT conditions over every structure
        structures, weights = sol.solver.decompose(sol.u)
        res = types.SimpleNamespace(u=sol.u, v=np.zeros(0), structures=list(structures),
                                    weights=weights)
        check_kkt(f, res, np.where(np.isfinite(eta), eta, -np.inf),
                  structures=[s for s in all_matchings(*shape) if allowed(eta, s)])
        assert np.all(sol.u[~np.isfinite(eta)] == 0)


@pytest.mark.parametrize("shape", [(5, 5), (4, 7), (7, 4)], ids=str)
def test_certified_scipy_qp(shape):
    rng = np.random.default_rng(3)
    for scale in SCALES:
        eta = scale * rng.standard_normal(shape)
        ref = birkhoff_qp(eta)
        assert ref is not None, "SLSQP found no certified solution"
        f, sol = solve(eta)
        assert sol.status == SOLVED
        np.testing.assert_allclose(sol.u, ref, atol=1e-9)


@pytest.mark.parametrize("shape", [(12, 12), (8, 15), (15, 8)], ids=str)
@pytest.mark.parametrize("scale", [0.1, 1.0, 5.0])
def test_vertex_side_agrees(shape, scale):
    rng = np.random.default_rng(7)
    eta = scale * rng.standard_normal(shape)
    g = rng.standard_normal(shape)
    f, sol = solve(eta)
    assert sol.status == SOLVED
    r = sm.solve(f, eta)
    np.testing.assert_allclose(sol.u, r.u, atol=1e-10)
    np.testing.assert_allclose(sol.jvp(g), r.jvp(g), atol=1e-9)


@pytest.mark.parametrize("shape", [(40, 40), (30, 50), (50, 30), (1, 7), (7, 1)], ids=str)
@pytest.mark.parametrize("scale", [1e-9, 0.01, 0.1, 1.0, 5.0, 100.0])
def test_duality_gap_and_feasibility(shape, scale):
    rng = np.random.default_rng(11)
    eta = scale * rng.standard_normal(shape)
    f, sol = solve(eta)
    assert sol.status == SOLVED
    u = sol.u
    assert u.min() >= 0
    short, long = (u.sum(axis=1), u.sum(axis=0)) if shape[0] <= shape[1] else \
        (u.sum(axis=0), u.sum(axis=1))
    assert np.abs(short - 1).max() < 1e-13
    assert long.max() < 1 + 1e-13
    assert 0 <= sol.residuals[0] < 1e-12 * (1 + scale)
    assert 0 <= sol.residuals[1] < 1e-12 * (1 + scale)
    assert gap(f, eta, u) < 1e-12 * (1 + scale) * u.size


def test_ties_are_exact():
    """Constant scores: u is uniform (every matching is optimal)."""
    for shape in [(4, 4), (3, 6), (6, 3), (10, 10)]:
        f, sol = solve(np.full(shape, 2.5))
        assert sol.status == SOLVED
        np.testing.assert_allclose(sol.u, np.full(shape, 1.0 / max(shape)), atol=1e-15)
        # the Jacobian projects out each row's and column's mean
        d = np.random.default_rng(0).standard_normal(shape)
        jd = sol.jvp(d)
        if shape[0] == shape[1]:
            ref = d - d.mean(axis=1, keepdims=True) - d.mean(axis=0) + d.mean()
        else:    # the longer side is loose: only the shorter side's sums are held
            ax = 1 if shape[0] < shape[1] else 0
            ref = d - d.mean(axis=ax, keepdims=True)
        np.testing.assert_allclose(jd, ref, atol=1e-13)


# -- masks and bad input -------------------------------------------------------------------

def test_masks():
    rng = np.random.default_rng(5)
    for shape in [(6, 6), (4, 7), (7, 4)]:
        for trial in range(5):
            eta = rng.standard_normal(shape)
            eta[rng.random(shape) < 0.5] = -np.inf
            f = sm.MatchingFactor(*shape)
            try:
                r = sm.solve(f, eta)
            except ValueError:          # no matching avoids the masks
                assert MatchingFacetSolver(f, decline_peaked=False).solve(eta).status == DECLINED
                continue
            sol = MatchingFacetSolver(f, decline_peaked=False).solve(eta)
            assert sol.status == SOLVED
            assert not np.isnan(sol.u).any()
            np.testing.assert_allclose(sol.u, r.u, atol=1e-10)
            d = rng.standard_normal(shape)
            assert np.all(sol.jvp(d)[~np.isfinite(eta)] == 0)
            np.testing.assert_allclose(sol.jvp(d), r.jvp(d), atol=1e-9)


def test_infeasible_masks_decline():
    eta = np.zeros((3, 3))
    eta[:, 0] = -np.inf             # column 0 can't be matched
    f, sol = solve(eta)
    assert sol.status == DECLINED
    with pytest.raises(ValueError):
        sol.jvp(np.zeros((3, 3)))
    eta = np.zeros((2, 4))
    eta[:, 1:] = -np.inf            # both rows need column 0
    assert solve(eta)[1].status == DECLINED
    # a row with its only allowed pair is fine
    eta = np.zeros((3, 3))
    eta[0, 1:] = -np.inf
    f, sol = solve(eta)
    assert sol.status == SOLVED
    np.testing.assert_allclose(sol.u, [[1, 0, 0], [0, .5, .5], [0, .5, .5]], atol=1e-15)


def test_bad_scores_and_budget_decline():
    eta = np.random.default_rng(0).standard_normal((5, 5))
    for bad in (np.nan, np.inf):
        e = eta.copy()
        e[1, 2] = bad
        assert solve(e)[1].status == DECLINED
    # spreads past 1e-9 / eps: z can't resolve u to 1e-9; declined at once, no hang
    for scale in (1e8, 1e300):
        f, sol = solve(scale * eta)
        assert sol.status == DECLINED and sol.n_iter == 0
    f, sol = solve(1e5 * eta)
    assert sol.status == SOLVED and max(sol.residuals) <= 1e-9
    np.testing.assert_allclose(sol.u, sm.solve(f, 1e5 * eta).u, atol=1e-9)
    # peaked scores need several iterations; a budget of one is spent
    f, sol = solve(10 * eta, budget=1)
    assert sol.status == DECLINED and sol.n_iter == 1
    assert solve(10 * eta)[1].status == SOLVED


def test_bad_arguments():
    with pytest.raises(ValueError, match="factor"):
        MatchingFacetSolver(sm.SequenceFactor(3, 2))
    S = MatchingFacetSolver(sm.MatchingFactor(2, 3), decline_peaked=False)
    with pytest.raises(ValueError, match="u: expected shape"):
        S.decompose(np.zeros((3, 2)))
    with pytest.raises(ValueError, match="u: expected a point"):
        S.decompose(np.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="u: expected finite"):
        S.decompose(np.array([[1.0, np.nan, 0], [0, 1, 0]]))
    with pytest.raises(ValueError, match="v: "):
        S.decompose(np.array([[1.0, 0, 0], [0, 1, 0]]), np.ones(2))


# -- the backward pass ---------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(6, 6), (4, 7), (7, 4)], ids=str)
@pytest.mark.parametrize("scale", [0.01, 0.1, 1.0, 5.0])
def test_jacobian_against_finite_differences(shape, scale):
    rng = np.random.default_rng(int(10 * scale) + shape[0])
    eta = scale * rng.standard_normal(shape)
    f, sol = solve(eta)
    for _ in range(3):
        d = rng.standard_normal(shape)
        # the vertex side's u, differentiated numerically: independent of this solver
        fd = finite_difference_jvp(f, eta, d_eta_u=d, eps=1e-7 * scale)
        np.testing.assert_allclose(sol.jvp(d), fd, atol=1e-6)
        # u's Jacobian is symmetric (a Hessian), so vjp along d is fd too
        np.testing.assert_allclose(sol.vjp(d)[0], fd, atol=1e-6)


@pytest.mark.parametrize("shape", [(30, 30), (20, 35), (35, 20)], ids=str)
@pytest.mark.parametrize("scale", [0.01, 0.1, 5.0])
def test_jacobian_larger_sizes(shape, scale):
    """Finite differences of this solver itself, and the adjoint and projection
    identities, where the vertex side would be slow."""
    rng = np.random.default_rng(1)
    eta = scale * rng.standard_normal(shape)
    f, sol = solve(eta)
    S = sol.solver
    h = 1e-7 * scale
    for _ in range(2):
        a, b = rng.standard_normal(shape), rng.standard_normal(shape)
        fd = (S.solve(eta + h * a).u - S.solve(eta - h * a).u) / (2 * h)
        ja = sol.jvp(a)
        np.testing.assert_allclose(ja, fd, atol=1e-6)
        jb = sol.vjp(b)[0]
        assert abs((ja * b).sum() - (a * jb).sum()) < 1e-11
        np.testing.assert_allclose(sol.jvp(ja), ja, atol=1e-12)     # a projection


def test_jacobian_at_a_kink_is_a_projection():
    """Integer scores put coordinates at 0 with zero slack: the returned element is a
    symmetric projection that vanishes off the positive coordinates."""
    rng = np.random.default_rng(2)
    for _ in range(10):
        eta = rng.integers(-1, 2, (5, 5)).astype(float)
        f, sol = solve(eta)
        J = np.array([sol.jvp(e.reshape(5, 5)).ravel() for e in np.eye(25)]).T
        np.testing.assert_allclose(J, J.T, atol=1e-13)
        np.testing.assert_allclose(J @ J, J, atol=1e-12)
        off = sol.u.ravel() == 0
        assert np.all(J[off] == 0) and np.all(J[:, off] == 0)


def test_state_round_trip_and_threads():
    rng = np.random.default_rng(4)
    f = sm.MatchingFactor(9, 12)
    S = MatchingFacetSolver(f, decline_peaked=False)
    etas = [s * rng.standard_normal((9, 12)) for s in (0.01, 0.3, 1, 5) for _ in range(4)]
    serial = [S.solve(e) for e in etas]
    with ThreadPoolExecutor(4) as ex:
        threaded = list(ex.map(S.solve, etas))
    g = rng.standard_normal((9, 12))
    for a, b in zip(serial, threaded):
        np.testing.assert_array_equal(a.u, b.u)
        np.testing.assert_array_equal(a.jvp(g), b.jvp(g))
    sol = serial[5]
    copy = FacetSolution.__new__(FacetSolution)
    copy.solver = S
    copy.set_state(*pickle.loads(pickle.dumps(sol.state_arrays())))
    np.testing.assert_array_equal(copy.jvp(g), sol.jvp(g))


def test_a_state_that_does_not_fit_its_layout_raises():
    """The Jacobian reads the state through its header's layout, checked first: a
    state cut short, padded, or from another factor raises instead of reading past
    its arrays or past u."""
    rng = np.random.default_rng(5)
    f, sol = solve(0.01 * rng.standard_normal((4, 7)))
    ints, reals = sol.state_arrays()
    g = rng.standard_normal((4, 7))
    pair = ints.copy()
    pair[5] = 4                                       # a row past the factor's 4
    other = MatchingFacetSolver(sm.MatchingFactor(7, 4), decline_peaked=False)
    for state, solver, match in [((ints[:0], reals), sol.solver, "empty"),
                                 ((ints[:-1], reals), sol.solver, "layout"),
                                 ((ints, np.append(reals, 0.0)), sol.solver, "layout"),
                                 ((pair, reals), sol.solver, "belong"),
                                 ((ints, reals), other, "belong")]:
        copy = FacetSolution.__new__(FacetSolution)
        copy.solver = solver
        copy.set_state(*state)
        with pytest.raises(ValueError, match=match):
            copy.vjp(g if solver is sol.solver else g.T)


# -- decompose -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 1), (3, 3), (4, 6), (6, 4), (12, 12), (10, 25), (25, 10)],
                         ids=str)
@pytest.mark.parametrize("scale", [0.01, 1.0, 5.0])
def test_decompose_reproduces_u(shape, scale):
    rng = np.random.default_rng(6)
    eta = scale * rng.standard_normal(shape)
    f, sol = solve(eta)
    structures, weights = sol.solver.decompose(sol.u)
    assert structures.dtype == np.intc and structures.shape == (len(weights), shape[0])
    assert np.all(weights > 0) and abs(weights.sum() - 1) < 1e-14
    assert len({s.tobytes() for s in structures}) == len(weights)
    U = np.zeros(shape)
    for s, w in zip(structures, weights):
        assert sorted(c for c in s if c != -1) == sorted(set(c for c in s if c != -1))
        assert sum(c != -1 for c in s) == min(shape)
        U += w * matching_matrix(s, shape[1])
    np.testing.assert_allclose(U, sol.u, atol=1e-12)
    # the documented bounds: at most tau - K + 1 terms, tau <= nnz(u) + 2K - k - 1;
    # square: at most dim + 1, dim = nnz(u) - rank of the line sums on the support
    k, K = min(shape), max(shape)
    assert len(weights) <= np.count_nonzero(sol.u) + K - k
    if k == K:
        P = sol.u.ravel() > 0
        lines = np.vstack([np.kron(np.eye(k), np.ones((1, k))),
                           np.kron(np.ones((1, k)), np.eye(k))])[:, P]
        assert len(weights) <= P.sum() - np.linalg.matrix_rank(lines) + 1
