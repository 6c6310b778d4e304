"""The facet side for sequences (sparsemap._facet_sequence.SequenceFacetSolver).

Every expected value comes from outside the solver: sparsemax in closed form at
eta_v = 0, a brute-force QP over all enumerated tag sequences, the KKT conditions and
the Wolfe gap computed here from (u, v) with a NumPy Viterbi, the vertex side
(sm.solve), and finite differences of certified solutions.
"""
import concurrent.futures
import pickle

import numpy as np
import pytest

import sparsemap as sm
from sparsemap._facet_sequence import SequenceFacetSolver
from sparsemap.testing import finite_difference_jvp, tie_direction

from _reference import all_sequences, sequence_column, simplex_qp, sparsemax, sparsemax_jacobian, viterbi

SOLVED, DECLINED = 0, 1


def facet(n, S, eta_u, eta_v=None, **kw):
    f = sm.SequenceFactor(n, S)
    sol = SequenceFacetSolver(f, decline_peaked=False).solve(eta_u, eta_v, **kw)
    return f, sol


def check_kkt(eta_u, eta_v, u, v, tol=1e-12):
    """Feasibility of (u, v) in the chain's local polytope, and its Wolfe gap (an upper
    bound on suboptimality) by an independent Viterbi. Returns the gap."""
    n, S = eta_u.shape
    assert np.all(u >= 0) and np.all(v >= 0)
    np.testing.assert_allclose(u.sum(1), 1.0, atol=1e-13)
    np.testing.assert_allclose(v.sum(2), u[:-1], atol=1e-13)
    np.testing.assert_allclose(v.sum(1), u[1:], atol=1e-13)
    live, flow = u > 0, v > 0
    adj = np.where(live, eta_u - u, eta_u)       # -inf stays where u = 0
    best = viterbi(adj, eta_v)[1] if n > 1 else adj.max()
    gap = best - ((eta_u - u)[live] * u[live]).sum() - (eta_v[flow] * v[flow]).sum()
    scale = max(1.0, (np.abs(eta_u[live]) * u[live]).sum() + (np.abs(eta_v[flow]) * v[flow]).sum()
                + (u * u).sum())
    assert gap <= tol * scale, gap
    return gap


def brute_force(eta_u, eta_v):
    """u of the SparseMAP QP over every tag sequence (SciPy, KKT-certified).

    Below scores of 1e-5 SciPy cannot certify the QP (every structure ties to 1e-11).
    There u = u(0) + w: u is piecewise affine in the scores and u(0) is uniform, so
    along the ray through the scores u is affine from 0 to its first kink; w is taken
    from the scores scaled up to a max of c and c / 2 (c = 0.1, 0.01, 0.001: the first
    where SciPy certifies both and they agree, the kink lying beyond them)."""
    n, S = eta_u.shape
    big = max(np.abs(eta_u).max(), np.abs(eta_v).max() if eta_v.size else 0.0)
    if 0 < big < 1e-5:
        u0 = np.full((n, S), 1.0 / S)
        for c in (0.1, 0.01, 0.001):
            w = [_qp(k * eta_u, k * eta_v) for k in (c / big, 0.5 * c / big)]
            if w[0] is not None and w[1] is not None:
                w = [(x - u0) / k for x, k in zip(w, (c / big, 0.5 * c / big))]
                if np.allclose(w[0], w[1], rtol=0, atol=1e-8 * np.abs(w[0]).max()):
                    return u0 + w[0]
        raise AssertionError("no certified reference")
    u = _qp(eta_u, eta_v)
    assert u is not None
    return u


def _qp(eta_u, eta_v):
    n, S = eta_u.shape
    cols = [sequence_column(s, S) for s in all_sequences(n, S)]
    M = np.array([m.ravel() for m, _ in cols]).T
    N = np.array([nn.ravel() for _, nn in cols]).T
    res = simplex_qp(M, M.T @ eta_u.ravel() + N.T @ eta_v.ravel())
    return None if res is None else res[0].reshape(n, S)


def fd_facet(n, S, eta_u, eta_v, d_u, d_v, h):
    """Central difference of u along (d_u, d_v), each solve certified by its gap."""
    out = []
    for sign in (1, -1):
        eu, ev = eta_u + sign * h * d_u, eta_v + sign * h * d_v
        f, sol = facet(n, S, eu, ev)
        assert sol.status == SOLVED
        check_kkt(eu, ev, sol.u, sol.v)
        out.append(sol.u)
    return (out[0] - out[1]) / (2 * h)


# -- the solution ------------------------------------------------------------------------

@pytest.mark.parametrize("n, S", [(1, 1), (1, 4), (2, 1), (5, 3), (30, 17)])
@pytest.mark.parametrize("scale", [0.01, 0.3, 3.0])
def test_zero_transitions_is_sparsemax_per_position(n, S, scale):
    rng = np.random.default_rng(n * 100 + S)
    eta_u = scale * rng.standard_normal((n, S))
    f, sol = facet(n, S, eta_u, np.zeros((n - 1, S, S)))
    assert sol.status == SOLVED
    expected = np.array([sparsemax(z) for z in eta_u])
    np.testing.assert_allclose(sol.u, expected, atol=1e-14)
    check_kkt(eta_u, np.zeros((n - 1, S, S)), sol.u, sol.v)
    # the eta_u part of the Jacobian is sparsemax's, position by position
    d = rng.standard_normal((n, S))
    jd = np.array([sparsemax_jacobian(z) @ di for z, di in zip(eta_u, d)])
    np.testing.assert_allclose(sol.jvp(d), jd, atol=1e-13)
    np.testing.assert_allclose(sol.vjp(d)[0], jd, atol=1e-13)


@pytest.mark.parametrize("n, S", [(2, 2), (3, 2), (2, 3), (4, 2), (2, 4)])
@pytest.mark.parametrize("scale", [1e-8, 1e-3, 0.1, 1.0, 5.0])
@pytest.mark.parametrize("rel", [1e-4, 0.1, 1.0])
def test_against_brute_force(n, S, scale, rel):
    rng = np.random.default_rng([n, S, int(np.log10(scale) * 10 + 100), int(rel * 1e4)])
    eta_u = scale * rng.standard_normal((n, S))
    eta_v = rel * scale * rng.standard_normal((n - 1, S, S))
    f, sol = facet(n, S, eta_u, eta_v)
    assert sol.status == SOLVED
    check_kkt(eta_u, eta_v, sol.u, sol.v)
    # the QP's optimum is unique in u
    np.testing.assert_allclose(sol.u, brute_force(eta_u, eta_v), atol=1e-6 * scale)


@pytest.mark.parametrize("kind", ["zeros", "small", "forbidden"])
def test_transport_start_with_many_pivots(kind):
    """Wide supports (9 tags of similar scores), where the start's transport bases take
    many network-simplex pivots, each re-rooting a subtree: u against the vertex side,
    and at eta_v = 0 (bases for the tie direction alone) the Jacobian along (0, r)
    against one-sided differences of the vertex side."""
    n, S = 4, 9
    rng = np.random.default_rng(["zeros", "small", "forbidden"].index(kind))
    f = sm.SequenceFactor(n, S)
    eta_u = 0.02 * rng.standard_normal((n, S))
    eta_v = np.zeros((n - 1, S, S))
    if kind != "zeros":
        eta_v = 1e-3 * rng.standard_normal((n - 1, S, S))
    if kind == "forbidden":
        eta_v[:, np.arange(S), (np.arange(S) + 1) % S] = -np.inf
    sol = SequenceFacetSolver(f, decline_peaked=False).solve(eta_u, eta_v)
    assert sol.status == SOLVED
    check_kkt(eta_u, eta_v, sol.u, sol.v)
    np.testing.assert_allclose(sol.u, sm.solve(f, eta_u, eta_v, method="vertex").u, atol=1e-10)
    if kind == "zeros":
        t = 1e-7
        r = tie_direction(f)
        one_sided = (sm.solve(f, eta_u, t * r, method="vertex").u - sol.u) / t
        np.testing.assert_allclose(sol.jvp(np.zeros((n, S)), r), one_sided, atol=1e-5)


KINDS = ["flat", "tiny_v", "binned_v", "tied_u", "zeros", "peaked", "masked_u"]


def scores(kind, n, S, rng):
    """Scores of a kind; "zeros" (every transport plan degenerate: hundreds of pieces at
    the start, 1.5 s at 60 positions) at most 30 positions."""
    if kind == "zeros":
        n = min(n, 30)
    eu = 0.1 * rng.standard_normal((n, S))
    ev = 1e-3 * rng.standard_normal((n - 1, S, S))
    if kind == "tiny_v":
        ev = 1e-8 * rng.standard_normal((n - 1, S, S))
    elif kind == "binned_v":
        ev = 0.05 * rng.integers(-2, 3, (n - 1, S, S))
    elif kind == "tied_u":
        eu = 0.1 * rng.integers(-2, 3, (n, S)) * 1.0
    elif kind == "zeros":
        eu, ev = np.zeros((n, S)), np.zeros((n - 1, S, S))
    elif kind == "peaked":
        eu, ev = rng.standard_normal((n, S)), 0.5 * rng.standard_normal((n - 1, S, S))
    elif kind == "masked_u":
        eu[rng.random((n, S)) < 0.3] = -np.inf
        eu[np.arange(n), rng.integers(0, S, n)] = 0.1
    return eu, ev


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, S", [(4, 3), (12, 5), (60, 17)])
def test_kkt_certified(kind, n, S):
    rng = np.random.default_rng(len(kind) + n)
    eta_u, eta_v = scores(kind, n, S, rng)
    n = eta_u.shape[0]
    f, sol = facet(n, S, eta_u, eta_v, budget=100000)
    assert sol.status == SOLVED
    check_kkt(eta_u, eta_v, sol.u, sol.v)
    assert sol.residuals[0] <= 1e-12 and sol.residuals[1] <= 1e-12
    assert np.all(sol.u[eta_u == -np.inf] == 0)


@pytest.mark.parametrize("seed", range(4))
def test_agrees_with_vertex_side(seed):
    rng = np.random.default_rng(seed)
    n, S = 8, 4
    eta_u = rng.standard_normal((n, S))
    eta_v = 0.3 * rng.standard_normal((n - 1, S, S))
    f, sol = facet(n, S, eta_u, eta_v)
    assert sol.status == SOLVED
    r = sm.solve(f, eta_u, eta_v)
    np.testing.assert_allclose(sol.u, r.u, atol=1e-9)
    d_u, d_v = rng.standard_normal((n, S)), rng.standard_normal((n - 1, S, S))
    np.testing.assert_allclose(sol.jvp(d_u, d_v), r.jvp(d_u, d_v), atol=1e-9)


def test_small_scores_instance_of_the_vertex_side():
    """The 12 x 5 instance at scale 1e-9 on which the active set stops at a true gap of
    1.9e-12 (its tolerance scales with ||u||^2 = 2.4): the facet side is exact."""
    rng = np.random.default_rng(1)
    eta_u, eta_v = 1e-9 * rng.standard_normal((12, 5)), 1e-9 * rng.standard_normal((11, 5, 5))
    f, sol = facet(12, 5, eta_u, eta_v)
    assert sol.status == SOLVED
    gap = check_kkt(eta_u, eta_v, sol.u, sol.v)
    assert gap <= 1e-14
    r = sm.solve(f, eta_u, eta_v, tol=1e-14)
    np.testing.assert_allclose(sol.u, r.u, rtol=0, atol=1e-14)


def bio_scores(n, n_types, scale, v_scale, rng):
    """BIO tagging: tags B-x, I-x (x < n_types), O; I-x only after B-x or I-x, and not
    first."""
    S = 2 * n_types + 1
    eta_u = scale * rng.standard_normal((n, S))
    eta_v = v_scale * rng.standard_normal((n - 1, S, S))
    eta_u[0, n_types:2 * n_types] = -np.inf
    for x in range(n_types):
        allowed = np.zeros(S, bool)
        allowed[[x, n_types + x]] = True
        eta_v[:, ~allowed, n_types + x] = -np.inf
    return eta_u, eta_v


@pytest.mark.parametrize("n, n_types, v_scale", [(8, 2, 0.0), (8, 2, 1e-3), (30, 8, 1e-3)])
def test_forbidden_transitions(n, n_types, v_scale):
    """-inf in eta_v (flat scores, where per-position sparsemax has couplings that avoid
    them): certified, nothing flows through a forbidden transition, and the Jacobian
    is the vertex side's finite differences'."""
    rng = np.random.default_rng(n)
    eta_u, eta_v = bio_scores(n, n_types, 0.01, v_scale, rng)
    S = eta_u.shape[1]
    f, sol = facet(n, S, eta_u, eta_v)
    assert sol.status == SOLVED
    check_kkt(eta_u, eta_v, sol.u, sol.v)
    forbidden = eta_v == -np.inf
    assert np.all(sol.v[forbidden] == 0)
    g = rng.standard_normal((n, S))
    g_u, g_v = sol.vjp(g)
    assert np.all(g_v[forbidden] == 0) and np.all(g_u[eta_u == -np.inf] == 0)
    structures, weights = sol.solver.decompose(sol.u, sol.v)
    assert not any(np.isneginf(eta_v[np.arange(n - 1), s[:-1], s[1:]]).any() for s in structures)
    if n <= 8:
        np.testing.assert_allclose(sol.u, sm.solve(f, eta_u, eta_v).u, atol=1e-10)
        if v_scale > 0:
            d_u = rng.standard_normal((n, S))
            d_v = np.where(forbidden, 0.0, rng.standard_normal((n - 1, S, S)))
            fd = finite_difference_jvp(f, eta_u, eta_v, d_u, d_v, eps=1e-8)
            np.testing.assert_allclose(sol.jvp(d_u, d_v), fd, atol=1e-5)


def test_declines():
    rng = np.random.default_rng(0)
    n, S = 10, 4
    eta_u = rng.standard_normal((n, S))
    eta_v = rng.standard_normal((n - 1, S, S))
    # forbidden transitions that per-position sparsemax cannot avoid
    peaked = np.array([[1.0, 0.0], [0.0, 1.0]])
    masked = np.zeros((1, 2, 2))
    masked[0, 0, 1] = -np.inf
    assert facet(2, 2, peaked, masked)[1].status == DECLINED
    # a budget too small for the pieces u crosses
    f, sol = facet(n, S, eta_u, 5 * eta_v, budget=3)
    assert sol.status == DECLINED and sol.n_iter <= 3
    # an all-forbidden position
    eta_u[3] = -np.inf
    assert facet(n, S, eta_u, 0 * eta_v)[1].status == DECLINED


def test_bad_input():
    with pytest.raises(ValueError, match="SequenceFactor"):
        SequenceFacetSolver(sm.TreeFactor(3))
    solver = SequenceFacetSolver(sm.SequenceFactor(3, 2), decline_peaked=False)
    with pytest.raises(ValueError, match="eta_u"):
        solver.solve(np.zeros((3, 3)))
    with pytest.raises(ValueError, match="v"):
        solver.decompose(np.full((3, 2), 0.5))


# -- the Jacobian --------------------------------------------------------------------------

@pytest.mark.parametrize("n, S, scale, v_scale", [(5, 3, 1.0, 0.3), (6, 4, 0.1, 0.01),
                                                  (8, 5, 0.3, 0.3)])
def test_jacobian_against_finite_differences_of_the_vertex_side(n, S, scale, v_scale):
    rng = np.random.default_rng(n)
    f = sm.SequenceFactor(n, S)
    eta_u = scale * rng.standard_normal((n, S))
    eta_v = v_scale * rng.standard_normal((n - 1, S, S))
    sol = SequenceFacetSolver(f, decline_peaked=False).solve(eta_u, eta_v)
    assert sol.status == SOLVED
    for _ in range(3):
        d_u, d_v = rng.standard_normal((n, S)), rng.standard_normal((n - 1, S, S))
        fds = [finite_difference_jvp(f, eta_u, eta_v, d_u, d_v, eps=h) for h in (1e-6, 1e-7)]
        np.testing.assert_allclose(fds[0], fds[1], atol=1e-6)     # linear there
        np.testing.assert_allclose(sol.jvp(d_u, d_v), fds[0], atol=1e-6)


@pytest.mark.parametrize("v_scale", [1e-3, 1e-6])
def test_jacobian_long_sentence(v_scale):
    """60 positions, 17 tags, flat unary scores: jvp against central differences of
    certified solves at two steps, and vjp as its adjoint."""
    n, S = 60, 17
    rng = np.random.default_rng(7)
    eta_u = 0.1 * rng.standard_normal((n, S))
    eta_v = v_scale * rng.standard_normal((n - 1, S, S))
    f, sol = facet(n, S, eta_u, eta_v)
    assert sol.status == SOLVED
    d_u, d_v = rng.standard_normal((n, S)), rng.standard_normal((n - 1, S, S))
    jd = sol.jvp(d_u, d_v)
    # u has kinks within 1e-3 v_scale of these scores (tiny flows)
    for h in (1e-4 * v_scale, 3e-5 * v_scale):
        np.testing.assert_allclose(fd_facet(n, S, eta_u, eta_v, d_u, d_v, h), jd,
                                   atol=1e-5 * np.abs(jd).max())
    g = rng.standard_normal((n, S))
    g_u, g_v = sol.vjp(g)
    assert np.isclose((g * jd).sum(), (g_u * d_u).sum() + (g_v * d_v).sum(), rtol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_adjoint_and_symmetry(kind):
    n, S = 12, 5
    rng = np.random.default_rng(3)
    eta_u, eta_v = scores(kind, n, S, rng)
    f, sol = facet(n, S, eta_u, eta_v, budget=100000)
    assert sol.status == SOLVED
    a_u, a_v, b = rng.standard_normal((n, S)), rng.standard_normal((n - 1, S, S)), rng.standard_normal((n, S))
    g_u, g_v = sol.vjp(b)
    lhs = (b * sol.jvp(a_u, a_v)).sum()
    assert np.isclose(lhs, (g_u * a_u).sum() + (g_v * a_v).sum(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(g_u, sol.jvp(b), atol=1e-13)    # J_u is symmetric
    # nothing flows through a forbidden tag
    masked = eta_u == -np.inf
    assert np.all(sol.jvp(a_u, a_v)[masked] == 0) and np.all(g_u[masked] == 0)


@pytest.mark.parametrize("kind", ["zeros_v", "binned_v"])
def test_ties_take_the_piece_along_the_tie_direction(kind):
    """At tied transitions the Jacobian is the one at eta_v + t r, t -> 0+: equal to the
    Jacobian of a solve there, and to one-sided differences along (0, r)."""
    n, S = 7, 4
    rng = np.random.default_rng(11)
    f = sm.SequenceFactor(n, S)
    r = tie_direction(f)
    eta_u = 0.2 * rng.standard_normal((n, S))
    eta_v = np.zeros((n - 1, S, S)) if kind == "zeros_v" else 0.1 * rng.integers(-1, 2, (n - 1, S, S))
    solver = SequenceFacetSolver(f, decline_peaked=False)
    sol = solver.solve(eta_u, eta_v)
    t = 1e-7
    near = solver.solve(eta_u, eta_v + t * r)
    assert sol.status == near.status == SOLVED
    g = rng.standard_normal((n, S))
    for a, b in zip(sol.vjp(g), near.vjp(g)):
        np.testing.assert_allclose(a, b, atol=1e-12)
    one_sided = (near.u - sol.u) / t
    np.testing.assert_allclose(sol.jvp(np.zeros((n, S)), r), one_sided, atol=1e-6)


@pytest.mark.parametrize("scale", [0.1, 0.01])
def test_zero_transitions_gradient_is_bounded(scale):
    """Issue 24: at eta_v = 0 (a zero-initialised transition matrix, 60 x 17, flat unary
    scores) the eta_v gradient is that of nearby generic points: within 10x of one-sided
    differences over a sample of coordinates, and close to the gradient at 1e-8 randn."""
    n, S = 60, 17
    rng = np.random.default_rng(5)
    eta_u = scale * rng.standard_normal((n, S))
    zero = np.zeros((n - 1, S, S))
    f, sol = facet(n, S, eta_u, zero)
    du = rng.standard_normal((n, S)) / np.sqrt(n * S)
    g_v = sol.vjp(du)[1]
    eps = 1e-7
    sample = rng.choice(zero.size, 60, replace=False)
    one_sided = []
    for j in sample:
        e = np.zeros(zero.size)
        e[j] = eps
        s2 = facet(n, S, eta_u, e.reshape(zero.shape))[1]
        assert s2.status == SOLVED
        one_sided.append(((s2.u - sol.u) * du).sum() / eps)
    fd_norm = np.sqrt(np.mean(np.square(one_sided)) * zero.size)
    ratio = np.linalg.norm(g_v) / fd_norm
    assert 0.1 < ratio < 10, ratio
    near = facet(n, S, eta_u, 1e-8 * rng.standard_normal(zero.shape))[1]
    ratio = np.linalg.norm(g_v) / np.linalg.norm(near.vjp(du)[1])
    assert 0.5 < ratio < 2, ratio


# -- decompose, state, threads ---------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, S", [(1, 3), (6, 4), (60, 17)])
def test_decompose_reproduces_u_and_v(kind, n, S):
    rng = np.random.default_rng(2)
    eta_u, eta_v = scores(kind, n, S, rng)
    n = eta_u.shape[0]
    f, sol = facet(n, S, eta_u, eta_v, budget=100000)
    assert sol.status == SOLVED
    structures, weights = sol.solver.decompose(sol.u, sol.v if n > 1 else None)
    assert structures.dtype == np.intc and structures.shape == (len(weights), n)
    assert np.all(weights > 0) and np.isclose(weights.sum(), 1.0, atol=1e-14)
    u, v = np.zeros((n, S)), np.zeros((n - 1, S, S))
    for s, w in zip(structures, weights):
        m, nn = sequence_column(s, S)
        u += w * m
        v += w * nn
    np.testing.assert_allclose(u, sol.u, atol=1e-13)
    np.testing.assert_allclose(v, sol.v, atol=1e-13)
    assert len(weights) <= max(np.count_nonzero(sol.v), np.count_nonzero(sol.u))


def test_state_round_trip():
    n, S = 9, 4
    rng = np.random.default_rng(4)
    eta_u, eta_v = rng.standard_normal((n, S)), 0.3 * rng.standard_normal((n - 1, S, S))
    f, sol = facet(n, S, eta_u, eta_v)
    ints, reals = pickle.loads(pickle.dumps(sol.state_arrays()))
    f2, other = facet(n, S, np.zeros((n, S)))
    other.set_state(ints, reals)
    g = rng.standard_normal((n, S))
    for a, b in zip(sol.vjp(g), other.vjp(g)):
        np.testing.assert_array_equal(a, b)
    # a state cut short or padded does not fit its layout; one of another shape does
    # not belong to the solver
    for bad in (ints[:5], np.append(ints, 0)):
        other.set_state(bad, reals)
        with pytest.raises(ValueError, match="valid structure"):
            other.vjp(g)
    other.set_state(ints[:0], reals)
    with pytest.raises(ValueError, match="empty"):
        other.vjp(g)
    f3, third = facet(n + 1, S, np.zeros((n + 1, S)))
    third.set_state(ints, reals)
    with pytest.raises(ValueError, match="belong"):
        third.vjp(np.zeros((n + 1, S)))


def test_threads_give_serial_results():
    n, S = 20, 6
    rng = np.random.default_rng(8)
    problems = [(0.1 * rng.standard_normal((n, S)), 1e-2 * rng.standard_normal((n - 1, S, S)))
                for _ in range(8)]
    solver = SequenceFacetSolver(sm.SequenceFactor(n, S), decline_peaked=False)
    serial = [solver.solve(eu, ev) for eu, ev in problems]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        threaded = list(ex.map(lambda p: solver.solve(*p), problems))
    for a, b in zip(serial, threaded):
        np.testing.assert_array_equal(a.u, b.u)
        np.testing.assert_array_equal(a.v, b.v)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, S", [(4, 3), (12, 5)])
def test_warm_and_cold_paths_agree(kind, n, S):
    """The warm path (a guessed structure, then the path from scores at which it is
    optimal) and the path from t = 0 end at the same u and the same Jacobian, ties
    included (both resolved along the tie direction), each certified here."""
    rng = np.random.default_rng([len(kind), n, 7])
    eta_u, eta_v = scores(kind, n, S, rng)
    n = eta_u.shape[0]
    f = sm.SequenceFactor(n, S)
    sols = [SequenceFacetSolver(f, decline_peaked=False, warm=warm).solve(eta_u, eta_v, budget=100000)
            for warm in (True, False)]
    d_u, d_v = rng.standard_normal((n, S)), rng.standard_normal((n - 1, S, S))
    for sol in sols:
        assert sol.status == SOLVED
        check_kkt(eta_u, eta_v, sol.u, sol.v)
    np.testing.assert_allclose(sols[0].u, sols[1].u, atol=1e-12)
    np.testing.assert_allclose(sols[0].jvp(d_u, d_v), sols[1].jvp(d_u, d_v), atol=1e-9)
    for a, b in zip(sols[0].vjp(d_u), sols[1].vjp(d_u)):
        np.testing.assert_allclose(a, b, atol=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_warm_path_at_a_taggers_initialisation(seed):
    """Unary scores of spread 0.05 and one uniform(-0.1, 0.1) transition matrix shared
    by 30 positions x 17 tags: the path from t = 0 crosses hundreds of structures; the
    warm path ends at the same certified solution (checked against the vertex side) in
    at most half the pieces and rounds."""
    rng = np.random.default_rng(seed)
    n, S = 30, 17
    eta_u = 0.05 * rng.standard_normal((n, S))
    eta_v = np.broadcast_to(rng.uniform(-0.1, 0.1, (S, S)), (n - 1, S, S)).copy()
    f = sm.SequenceFactor(n, S)
    warm, cold = [SequenceFacetSolver(f, decline_peaked=False, warm=w).solve(eta_u, eta_v, budget=100000)
                  for w in (True, False)]
    assert warm.status == cold.status == SOLVED
    check_kkt(eta_u, eta_v, warm.u, warm.v)
    assert warm.n_iter <= cold.n_iter / 2
    r = sm.solve(f, eta_u, eta_v, method="vertex", max_iter=100000)
    np.testing.assert_allclose(warm.u, r.u, atol=1e-9)
    np.testing.assert_allclose(warm.u, cold.u, atol=1e-12)
