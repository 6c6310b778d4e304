"""SparseMAP, margin SparseMAP, perceptron and structured SVM losses.

References are independent of ``sparsemap.solve`` and of the factors' columns:
structures are enumerated and their columns built by tests/_reference.py, the QP
over the simplex is solved with SciPy (SLSQP, certified by the KKT conditions),
Hamming costs are counted from the compact forms, gradients are checked by finite
differences.
"""
import itertools
import zlib

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

import sparsemap as sm
from sparsemap._factors._base import _first_invalid
from sparsemap.losses import batch_loss, perceptron_loss, sparsemap_loss, structured_svm_loss

from _reference import (all_matchings, all_sequences, all_trees, arc_matrix, matching_matrix,
                        sequence_column, simplex_qp)


# -- brute force ------------------------------------------------------------------
class Case:
    """A factor with all its structures enumerated and their columns built without it.

    ``M`` is (D, n_u), ``N`` is (D, n_v) (rows are columns a_s, flattened C-order),
    ``H[s, t]`` is the Hamming cost of predicting structure s for target t.
    """

    def __init__(self, factor, structures, M, N, H):
        self.f = factor
        self.S = structures
        self.M = np.asarray(M, dtype=float).reshape(len(structures), -1)
        self.N = np.asarray(N, dtype=float).reshape(len(structures), -1)
        self.H = np.asarray(H, dtype=float)
        self.D = len(structures)

    def theta(self, eu, ev):
        th = self.M @ eu.ravel()
        return th + self.N @ ev.ravel() if ev is not None and ev.size else th

    def __repr__(self):
        return repr(self.f)


def sequence_case(n, m):
    S = all_sequences(n, m)
    cols = [sequence_column(t, m) for t in S]
    M, N = np.array([c[0] for c in cols]), np.array([c[1] for c in cols])
    H = np.array([[np.sum(s != t) for t in S] for s in S])
    return Case(sm.SequenceFactor(n, m), S, M, N, H)


def generic_case(M, N=None):
    M = np.asarray(M, float)
    D = M.shape[1]
    Nm = np.zeros((0, D)) if N is None else np.asarray(N, float)
    # Hamming cost of 0/1 columns: parts of s absent from t
    H = np.array([[np.sum((M[:, s] == 1) & (M[:, t] == 0)) for t in range(D)] for s in range(D)])
    return Case(sm.GenericFactor(M, N), list(range(D)), M.T, Nm.T, H)


def tree_case(n, projective=False, single_root=False):
    S = all_trees(n, projective, single_root)
    M = np.array([arc_matrix(h) for h in S])
    H = np.array([[np.sum(s[1:] != t[1:]) for t in S] for s in S])  # wrong heads
    f = sm.TreeFactor(n, projective=projective, single_root=single_root)
    return Case(f, S, M, np.zeros((len(S), 0)), H)


def matching_case(r, c):
    S = all_matchings(r, c)
    M = np.array([matching_matrix(s, c) for s in S])
    H = np.array([[np.sum((s >= 0) & (s != t)) for t in S] for s in S])  # wrong pairs
    return Case(sm.MatchingFactor(r, c), S, M, np.zeros((len(S), 0)), H)


def _rng_generic(seed):
    rng = np.random.default_rng(seed)
    M = rng.integers(0, 2, (4, 6))
    return generic_case(M, rng.standard_normal((2, 6)))


CASE_BUILDERS = {
    "seq3x2": lambda: sequence_case(3, 2),
    "seq3x3": lambda: sequence_case(3, 3),
    "seq1x3": lambda: sequence_case(1, 3),
    "sparsemax4": lambda: generic_case(np.eye(4)),
    "generic01": lambda: _rng_generic(7),
    "tree3": lambda: tree_case(3),
    "tree3_proj": lambda: tree_case(3, projective=True),
    "tree3_single": lambda: tree_case(3, single_root=True),
    "tree3_proj_single": lambda: tree_case(3, projective=True, single_root=True),
    "match3x3": lambda: matching_case(3, 3),
    "match3x2": lambda: matching_case(3, 2),
    "match2x3": lambda: matching_case(2, 3),
}
_CACHE = {}


def get_case(name):
    if name not in _CACHE:
        _CACHE[name] = CASE_BUILDERS[name]()
    return _CACHE[name]


def reference_loss(case, eu, ev, y_t, margin=0.0, t=1.0):
    """Fenchel-Young loss with Omega = t/2||My||^2 - margin * cost.y, from its definition."""
    theta = case.theta(eu, ev) + margin * case.H @ y_t   # expected Hamming cost of each s
    ref = simplex_qp(case.M.T, theta, t)
    assert ref is not None, "the SciPy reference found no certified solution"
    u, y, value, _ = ref
    m_t = case.M.T @ y_t
    loss = value - (theta @ y_t - 0.5 * t * m_t @ m_t)
    return loss, u, case.N.T @ y


def random_target(case, rng, soft):
    """Return (target argument, y_t as a length-D distribution)."""
    if not soft:
        k = int(rng.integers(case.D))
        return case.S[k], np.eye(case.D)[k]
    K = min(3, case.D)
    idx = rng.choice(case.D, K, replace=False)
    w = rng.dirichlet(np.ones(K))
    y = np.zeros(case.D)
    y[idx] = w
    return ([case.S[i] for i in idx], w), y


def random_scores(case, rng, scale=1.0):
    f = case.f
    eu = scale * rng.standard_normal(f.shape_u)
    ev = scale * rng.standard_normal(f.shape_v) if f.n_v else None
    return eu, ev


# -- values against brute force ----------------------------------------------------
@pytest.mark.parametrize("name", CASE_BUILDERS)
@pytest.mark.parametrize("margin", [0.0, 0.7])
@pytest.mark.parametrize("soft", [False, True])
def test_sparsemap_loss_matches_brute_force(name, margin, soft):
    case = get_case(name)
    rng = np.random.default_rng(zlib.crc32(f'{name}{margin}{soft}'.encode()))
    for _ in range(3):
        eu, ev = random_scores(case, rng, scale=1.5)
        target, y_t = random_target(case, rng, soft)
        loss, gu, gv = sparsemap_loss(case.f, eu, target, ev, margin=margin)
        ref, u_ref, v_ref = reference_loss(case, eu, ev, y_t, margin)
        assert loss == pytest.approx(ref, abs=1e-9)
        assert gu.shape == case.f.shape_u and gv.shape == case.f.shape_v
        # gradient u* - m_t: u* is unique, compare with the SciPy solution
        np.testing.assert_allclose(gu.ravel(), u_ref - case.M.T @ y_t, atol=1e-9)


@pytest.mark.parametrize("name", CASE_BUILDERS)
@pytest.mark.parametrize("soft", [False, True])
def test_perceptron_and_svm_match_brute_force(name, soft):
    case = get_case(name)
    rng = np.random.default_rng(zlib.crc32(f'{name}{soft}map'.encode()))
    for _ in range(4):
        eu, ev = random_scores(case, rng)
        target, y_t = random_target(case, rng, soft)
        theta = case.theta(eu, ev)
        a_t = np.concatenate([case.M.T @ y_t, case.N.T @ y_t])
        eta = np.concatenate([eu.ravel(), ev.ravel() if ev is not None else []])

        loss, gu, gv = perceptron_loss(case.f, eu, target, ev)
        assert loss == pytest.approx(theta.max() - theta @ y_t, abs=1e-9)
        g = np.concatenate([gu.ravel(), gv.ravel()])
        # the subgradient is a_s - a_t for a maximiser s
        assert eta @ (g + a_t) == pytest.approx(theta.max(), abs=1e-9)
        assert np.any(np.all(np.isclose(np.hstack([case.M, case.N]), g + a_t), axis=1))

        for scale in (1.0, 2.5):
            cost = scale * case.H @ y_t
            loss, gu, gv = structured_svm_loss(case.f, eu, target, ev, margin=scale)
            aug = theta + cost
            assert loss == pytest.approx(aug.max() - aug @ y_t, abs=1e-9)
            g = np.concatenate([gu.ravel(), gv.ravel()])
            rows = np.flatnonzero(np.all(np.isclose(np.hstack([case.M, case.N]), g + a_t),
                                         axis=1))
            assert rows.size and aug[rows].max() == pytest.approx(aug.max(), abs=1e-9)
        if not soft:
            # 0/1 target: the cost of the target is zero, svm >= perceptron
            assert structured_svm_loss(case.f, eu, target, ev)[0] >= \
                perceptron_loss(case.f, eu, target, ev)[0] - 1e-12


# -- Proposition 2 ---------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.floats(-2.0, 2.0), st.floats(0.0, 2.0), st.integers(0, 3), st.integers(0, 2**32 - 1))
def test_zero_exactly_when_target_wins_by_the_margin(delta, margin, t, seed):
    """Sparsemax, one-hot target t: with eta_t - max_j eta_j = 1 + margin - delta and the
    third-best far below, the loss is 0 for delta <= 0 and delta^2/4 for 0 < delta <= 2
    (closed form of sparsemax on two active coordinates)."""
    assume(not 0 < delta < 1e-3)  # keep delta resolvable after rounding eta
    rng = np.random.default_rng(seed)
    f = sm.GenericFactor(np.eye(4))
    others = [j for j in range(4) if j != t]
    j = others[int(rng.integers(3))]
    eta = np.full(4, -10.0)
    eta[j] = rng.uniform(-1, 1)
    eta[t] = eta[j] + 1 + margin - delta
    loss, gu, gv = sparsemap_loss(f, eta, t, margin=margin)
    if delta <= 0:
        assert loss == pytest.approx(0.0, abs=1e-10)
        np.testing.assert_allclose(gu, 0, atol=1e-10)
    else:
        assert loss == pytest.approx(delta ** 2 / 4, rel=1e-7, abs=1e-12)
        assert loss > 0
        assert gu[t] == pytest.approx(-delta / 2) and gu[j] == pytest.approx(delta / 2)


@pytest.mark.parametrize("gap,wins", [(1.0 + 1e-9, True), (2.0, True), (1.0 - 1e-3, False)])
def test_sparsemax_threshold(gap, wins):
    f = sm.GenericFactor(np.eye(3))
    eta = np.array([0.3, 0.3 + gap, -0.2])
    loss = sparsemap_loss(f, eta, 1)[0]
    if wins:
        assert loss <= 1e-10
    else:
        assert loss > 1e-8
    # margin: the target must win by 1 + margin
    assert (sparsemap_loss(f, eta + [0, 0.5, 0], 1, margin=0.5)[0] <= 1e-10) == wins


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["seq3x3", "generic01", "tree3", "match3x3"]), st.booleans(),
       st.floats(0.0, 2.0), st.integers(0, 2**32 - 1))
def test_nonnegative_and_convex_along_lines(name, soft, margin, seed):
    case = get_case(name)
    rng = np.random.default_rng(seed)
    target, _ = random_target(case, rng, soft)
    (eu0, ev0), (eu1, ev1) = random_scores(case, rng, 2.0), random_scores(case, rng, 2.0)
    mid_u = (eu0 + eu1) / 2
    mid_v = None if ev0 is None else (ev0 + ev1) / 2
    l0, gu0, gv0 = sparsemap_loss(case.f, eu0, target, ev0, margin=margin)
    l1, _, _ = sparsemap_loss(case.f, eu1, target, ev1, margin=margin)
    lm, _, _ = sparsemap_loss(case.f, mid_u, target, mid_v, margin=margin)
    assert min(l0, l1, lm) >= 0
    assert lm <= (l0 + l1) / 2 + 1e-9
    # first-order condition of convexity: the gradient is a subgradient
    lin = l0 + np.sum(gu0 * (eu1 - eu0)) + (0 if ev0 is None else np.sum(gv0 * (ev1 - ev0)))
    assert l1 >= lin - 1e-9
    # margin loss >= plain loss for a 0/1 target, increasing in the margin
    if not soft:
        plain = sparsemap_loss(case.f, eu0, target, ev0)[0]
        more = sparsemap_loss(case.f, eu0, target, ev0, margin=margin + 0.5)[0]
        assert plain - 1e-10 <= l0 <= more + 1e-10


@pytest.mark.parametrize("name", ["seq3x2", "sparsemax4", "generic01", "match3x2"])
@pytest.mark.parametrize("t", [0.25, 3.0])
def test_scaling_property(name, t):
    """l_{t Omega}(eta, y) = t l_Omega(eta / t, y), with the left side by brute force."""
    case = get_case(name)
    rng = np.random.default_rng(int(t * 100) + len(name))
    for soft in (False, True):
        eu, ev = random_scores(case, rng, 1.5)
        target, y_t = random_target(case, rng, soft)
        ref, _, _ = reference_loss(case, eu, ev, y_t, t=t)
        got = t * sparsemap_loss(case.f, eu / t, target, None if ev is None else ev / t)[0]
        assert got == pytest.approx(ref, abs=1e-9)


def test_loss_is_zero_at_the_sparsemap_solution():
    """Property 1: equality when y_t itself is a SparseMAP solution (a soft target)."""
    case = get_case("seq3x3")
    rng = np.random.default_rng(3)
    for _ in range(5):
        eu, ev = random_scores(case, rng)
        r = sm.solve(case.f, eu, ev)
        for target in (r, (r.structures, r.weights),
                       {tuple(s): w for s, w in zip(r.structures, r.weights)}):
            loss, gu, gv = sparsemap_loss(case.f, eu, target, ev)
            assert loss == pytest.approx(0.0, abs=1e-10)
            np.testing.assert_allclose(gu, 0, atol=1e-10)


# -- gradients --------------------------------------------------------------------
def _central_differences(fun, x, eps=1e-5):
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        g[i] = (fun(xp) - fun(xm)) / (2 * eps)
    return g


@pytest.mark.parametrize("name", ["seq3x3", "generic01", "tree3", "match3x2"])
@pytest.mark.parametrize("margin,soft", [(0.0, False), (0.0, True), (0.6, False), (0.6, True)])
def test_gradient_matches_finite_differences(name, margin, soft):
    case = get_case(name)
    rng = np.random.default_rng(len(name) * 31 + int(10 * margin) + soft)
    eu, ev = random_scores(case, rng, 1.5)
    target, _ = random_target(case, rng, soft)
    _, gu, gv = sparsemap_loss(case.f, eu, target, ev, margin=margin)
    fd_u = _central_differences(lambda x: sparsemap_loss(case.f, x, target, ev, margin=margin)[0],
                                eu)
    np.testing.assert_allclose(gu, fd_u, atol=1e-5)
    if ev is not None:
        fd_v = _central_differences(
            lambda x: sparsemap_loss(case.f, eu, target, x, margin=margin)[0], ev)
        np.testing.assert_allclose(gv, fd_v, atol=1e-5)


def test_map_losses_gradients_match_finite_differences_away_from_ties():
    case = get_case("seq3x3")
    rng = np.random.default_rng(11)
    eu, ev = random_scores(case, rng)
    target, _ = random_target(case, rng, False)
    for fn in (perceptron_loss, structured_svm_loss):
        _, gu, gv = fn(case.f, eu, target, ev)
        fd_u = _central_differences(lambda x: fn(case.f, x, target, ev)[0], eu, 1e-7)
        fd_v = _central_differences(lambda x: fn(case.f, eu, target, x)[0], ev, 1e-7)
        np.testing.assert_allclose(gu, fd_u, atol=1e-6)
        np.testing.assert_allclose(gv, fd_v, atol=1e-6)


def test_eta_v_none_means_zeros():
    case = get_case("seq3x2")
    rng = np.random.default_rng(0)
    eu = rng.standard_normal((3, 2))
    target = np.array([1, 0, 1])
    for fn in (sparsemap_loss, perceptron_loss, structured_svm_loss):
        a = fn(case.f, eu, target)
        b = fn(case.f, eu, target, np.zeros((2, 2, 2)))
        assert a[0] == pytest.approx(b[0], abs=1e-12)
        np.testing.assert_allclose(a[1], b[1], atol=1e-12)
        np.testing.assert_allclose(a[2], b[2], atol=1e-12)
        assert a[2].shape == (2, 2, 2)


def test_solve_kwargs_are_passed_through():
    f = sm.GenericFactor(np.eye(3))
    with pytest.raises(ValueError, match="method"):
        sparsemap_loss(f, np.zeros(3), 0, method="nope")
    with pytest.raises(ValueError, match="max_iter"):
        sparsemap_loss(f, np.zeros(3), 0, max_iter=0)


# -- batches ----------------------------------------------------------------------
def test_batch_loss_matches_loop():
    case = get_case("seq3x3")
    rng = np.random.default_rng(5)
    B = 4
    EU = rng.standard_normal((B, 3, 3))
    EV = rng.standard_normal((B, 2, 3, 3))
    T = [case.S[int(i)] for i in rng.integers(case.D, size=B)]
    for fn, kw in ((sparsemap_loss, {"margin": 0.3}), (perceptron_loss, {}),
                   (structured_svm_loss, {"margin": 2.0})):
        per = [fn(case.f, EU[i], T[i], EV[i], **kw) for i in range(B)]
        mean, GU, GV = batch_loss(fn, case.f, EU, T, EV, **kw)
        assert mean == pytest.approx(np.mean([p[0] for p in per]), abs=1e-12)
        assert GU.shape == (B, 3, 3) and GV.shape == (B, 2, 3, 3)
        np.testing.assert_allclose(GU, np.stack([p[1] for p in per]) / B, atol=1e-12)
        total, GU, GV = batch_loss(fn, case.f, list(EU), T, list(EV), reduction="sum", **kw)
        assert total == pytest.approx(sum(p[0] for p in per), abs=1e-12)
        np.testing.assert_allclose(GV, np.stack([p[2] for p in per]), atol=1e-12)
        losses, _, _ = batch_loss(fn, case.f, EU, T, EV, reduction="none", **kw)
        np.testing.assert_allclose(losses, [p[0] for p in per], atol=1e-12)
    # one factor per example (different lengths), eta_v None
    fs = [sm.SequenceFactor(n, 2) for n in (1, 2, 4)]
    eus = [rng.standard_normal((n, 2)) for n in (1, 2, 4)]
    ts = [np.zeros(n, dtype=int) for n in (1, 2, 4)]
    val, gus, gvs = batch_loss(sparsemap_loss, fs, eus, ts, reduction="sum")
    assert isinstance(gus, list) and [g.shape for g in gus] == [(1, 2), (2, 2), (4, 2)]
    assert val == pytest.approx(sum(sparsemap_loss(f, e, t)[0]
                                    for f, e, t in zip(fs, eus, ts)), abs=1e-12)


def test_batch_loss_validation():
    f = sm.GenericFactor(np.eye(3))
    E = np.zeros((2, 3))
    with pytest.raises(ValueError, match="loss_fn"):
        batch_loss("sparsemap", f, E, [0, 1])
    with pytest.raises(ValueError, match="reduction"):
        batch_loss(sparsemap_loss, f, E, [0, 1], reduction="max")
    with pytest.raises(ValueError, match="targets"):
        batch_loss(sparsemap_loss, f, E, [0])
    with pytest.raises(ValueError, match="etas_v"):
        batch_loss(sparsemap_loss, f, E, [0, 1], [None])
    with pytest.raises(ValueError, match="etas_u"):
        batch_loss(sparsemap_loss, f, [], [])
    with pytest.raises(ValueError, match="factor"):
        batch_loss(sparsemap_loss, [f, "f"], E, [0, 1])


# -- validation -------------------------------------------------------------------
@pytest.mark.parametrize("fn", [sparsemap_loss, perceptron_loss, structured_svm_loss])
def test_input_validation(fn):
    f = sm.SequenceFactor(3, 2)
    eu = np.zeros((3, 2))
    with pytest.raises(ValueError, match="factor"):
        fn("not a factor", eu, [0, 0, 0])
    with pytest.raises(ValueError, match="eta_u"):
        fn(f, np.zeros((2, 3)), [0, 0, 0])
    with pytest.raises(ValueError, match="eta_v"):
        fn(f, eu, [0, 0, 0], np.zeros(3))
    with pytest.raises(ValueError, match="eta_u"):
        fn(f, eu + np.nan, [0, 0, 0])
    bad_targets = [None, [0, 0], [0, 0, 2], [0.5, 0, 0], "abc", ([], []),
                   ([[0, 0, 0], [1, 1, 1]], [0.5, 0.6]),      # not a distribution
                   ([[0, 0, 0], [1, 1, 1]], [1.5, -0.5]),     # negative weight
                   ([[0, 0, 0], [1, 1, 1]], [1.0]),           # length mismatch
                   ([[0, 0, 0], [1, 1, 1]], [np.nan, 1.0]),
                   ([[0, 0, 0], [1, 1, 3]], [0.5, 0.5]),      # bad structure inside
                   {(0, 0, 0): 0.2}]
    for target in bad_targets:
        with pytest.raises(ValueError, match="target"):
            fn(f, eu, target)


def test_margin_validation():
    f = sm.GenericFactor(np.eye(3))
    for bad in (-0.1, np.nan, np.inf, "1", True, None):
        for fn in (sparsemap_loss, structured_svm_loss):
            with pytest.raises(ValueError, match="^margin"):
                fn(f, np.zeros(3), 0, margin=bad)


def test_target_forms_agree():
    f = sm.SequenceFactor(3, 2)
    rng = np.random.default_rng(1)
    eu, ev = rng.standard_normal((3, 2)), rng.standard_normal((2, 2, 2))
    ref = sparsemap_loss(f, eu, [1, 0, 1], ev)
    for target in (np.array([1, 0, 1]), (1, 0, 1), ([[1, 0, 1]], [1.0]),
                   (np.array([[1, 0, 1], [0, 0, 0]]), np.array([1.0, 0.0])),
                   {(1, 0, 1): 1.0}):
        got = sparsemap_loss(f, eu, target, ev)
        assert got[0] == pytest.approx(ref[0], abs=1e-12)
        np.testing.assert_allclose(got[1], ref[1], atol=1e-12)
    g = sm.GenericFactor(np.eye(3))
    a = sparsemap_loss(g, np.array([1.0, 0.2, 0.0]), ([0, 2], [0.25, 0.75]))
    b = sparsemap_loss(g, np.array([1.0, 0.2, 0.0]), {0: 0.25, 2: 0.75})
    assert a[0] == pytest.approx(b[0], abs=1e-12)
    np.testing.assert_allclose(a[1], np.array([0.9, 0.1, 0.0]) - [0.25, 0, 0.75], atol=1e-12)


# -- dense targets ------------------------------------------------------------------
@pytest.mark.parametrize("name", CASE_BUILDERS)
def test_dense_targets_agree_with_compact(name):
    """A 0/1 array shaped like eta_u (the column built here, not by the factor) is the
    same target as the compact structure, alone or inside a soft target."""
    case = get_case(name)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    eu, ev = random_scores(case, rng)
    dense = [case.M[k].reshape(case.f.shape_u) for k in range(case.D)]
    # GenericFactor columns with equal m but different n cannot be told apart from m
    ambiguous = [any(not np.array_equal(case.N[j], case.N[k])
                     for j in np.flatnonzero(np.all(case.M == case.M[k], axis=1)))
                 for k in range(case.D)]
    for fn in (sparsemap_loss, perceptron_loss, structured_svm_loss):
        for k in range(case.D):
            if ambiguous[k]:
                with pytest.raises(ValueError, match="^target: .*differ in N"):
                    fn(case.f, eu, dense[k], ev)
                continue
            want = fn(case.f, eu, case.S[k], ev)
            got = fn(case.f, eu, dense[k].tolist(), ev)   # nested lists too
            assert got[0] == pytest.approx(want[0], abs=1e-12)
            np.testing.assert_allclose(got[1], want[1], atol=1e-12)
            np.testing.assert_allclose(got[2], want[2], atol=1e-12)
    ok = [k for k in range(case.D) if not ambiguous[k]][:2]
    if len(ok) == 2:
        soft_dense = sparsemap_loss(case.f, eu, ([dense[k] for k in ok], [0.3, 0.7]), ev)
        soft = sparsemap_loss(case.f, eu, ([case.S[k] for k in ok], [0.3, 0.7]), ev)
        assert soft_dense[0] == pytest.approx(soft[0], abs=1e-12)
        np.testing.assert_allclose(soft_dense[1], soft[1], atol=1e-12)


@pytest.mark.parametrize("name", ["seq3x2", "sparsemax4", "generic01", "tree3_proj_single",
                                  "match3x2", "match2x3"])
def test_invalid_dense_targets_are_refused(name):
    case = get_case(name)
    eu, ev = random_scores(case, np.random.default_rng(0))
    # a structure whose column no other structure shares
    k = next(k for k in range(case.D) if np.sum(np.all(case.M == case.M[k], axis=1)) == 1)
    m = case.M[k].reshape(case.f.shape_u)
    bad = [0.5 * m, m + 1.0, np.full(case.f.shape_u, np.nan)]
    zero = np.flatnonzero(case.M[k] == 0)
    if zero.size:   # one part too many: no structure has this column
        extra = m.copy().reshape(-1)
        extra[zero[0]] = 1.0
        if not np.any(np.all(case.M == extra, axis=1)):
            bad.append(extra.reshape(m.shape))
    for target in bad:
        for fn in (sparsemap_loss, perceptron_loss, structured_svm_loss):
            with pytest.raises(ValueError, match="^target: "):
                fn(case.f, eu, target, ev)
        with pytest.raises(ValueError, match=r"^target structure 1: "):
            sparsemap_loss(case.f, eu, ([m, target], [0.5, 0.5]), ev)


def test_dense_target_of_a_factor_without_a_reader():
    f = sm.OracleFactor(lambda eu, ev: int(np.argmax(eu)), lambda s: np.eye(3)[s], shape_u=3,
                        structure_size=2)
    with pytest.raises(ValueError, match="^target: OracleFactor .*compact form"):
        sparsemap_loss(f, np.zeros(3), np.array([1.0, 0.0, 0.0]))


def test_one_row_generic_factor_reads_an_array_target_as_compact():
    """GenericFactor([[1, 0]]): shape_u == (struct_size,), so [1.0] could be structure 1
    (compact) or the column m = 1 of structure 0 (dense); it is read as compact, and
    from_vertex gives the dense reading. Closed form: u* = clip(eta, 0, 1), loss
    (eta u* - u*^2 / 2) - (eta m_t - m_t^2 / 2)."""
    f = sm.GenericFactor(np.array([[1.0, 0.0]]))
    eu = np.array([0.2])
    for target, mt in ((np.array([1.0]), 0.0), ([1], 0.0), (1, 0.0),
                       (f.from_vertex(np.array([1.0])), 1.0), (0, 1.0)):
        loss, gu, _ = sparsemap_loss(f, eu, target)
        assert loss == pytest.approx(0.02 - (0.2 * mt - mt * mt / 2), abs=1e-12)
        np.testing.assert_allclose(gu, [0.2 - mt], atol=1e-12)


def test_old_argument_order_is_refused():
    """(factor, eta_u, eta_v, target), the order before eta_v became optional, fails loudly."""
    f = sm.SequenceFactor(3, 2)
    eu, ev = np.zeros((3, 2)), np.zeros((2, 2, 2))
    for fn in (sparsemap_loss, perceptron_loss, structured_svm_loss):
        with pytest.raises(ValueError, match="^(target|eta_v): "):
            fn(f, eu, ev, [0, 1, 0])


def test_batch_loss_names_the_example():
    f = sm.SequenceFactor(3, 2)
    E = np.zeros((2, 3, 2))
    with pytest.raises(ValueError, match=r"^targets\[1\]: tags"):
        batch_loss(sparsemap_loss, f, E, [[0, 0, 0], [0, 0, 5]])
    with pytest.raises(ValueError, match=r"^etas_u\[1\]: expected shape"):
        batch_loss(sparsemap_loss, f, [E[0], np.zeros(3)], [[0, 0, 0]] * 2)
    with pytest.raises(ValueError, match=r"^etas_v\[0\]: expected shape"):
        batch_loss(sparsemap_loss, f, E, [[0, 0, 0]] * 2, [np.zeros(2), None])
    with pytest.raises(ValueError, match="^margin: "):
        batch_loss(sparsemap_loss, f, E, [[0, 0, 0]] * 2, margin=-1)


# -- masks ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["seq3x3", "tree3", "tree3_proj", "tree3_single",
                                  "tree3_proj_single", "match3x3", "match3x2", "match2x3",
                                  "generic01"])
def test_masked_scores_give_the_loss_of_very_low_scores(name):
    """-inf forbids a part. Every loss then equals its value with the forbidden parts at a
    very low finite score (which no solution uses), its gradient is exactly 0 there, and the
    SparseMAP loss equals the brute-force reference; no nan from -inf * 0. A target using a
    forbidden part is refused."""
    case = get_case(name)
    rng = np.random.default_rng(zlib.crc32(f"mask{name}".encode()))
    for draw in range(3):
        eu, ev = random_scores(case, rng)
        k = int(rng.integers(case.D))
        target, y_t = case.S[k], np.eye(case.D)[k]
        # forbid unary parts (two, then a third and a half of them) and a transition the
        # target does not use (for the tree, maybe some it ignores: the diagonal, column 0)
        free = np.flatnonzero(case.M[k] == 0)
        n_forbid = min(free.size, max(2, [0, free.size // 3, free.size // 2][draw]))
        forbid = rng.choice(free, size=n_forbid, replace=False)
        masked_u, low_u = eu.copy().reshape(-1), eu.copy().reshape(-1)
        masked_u[forbid], low_u[forbid] = -np.inf, -1e3
        masked_v, low_v, j = ev, ev, None
        free_v = np.flatnonzero(case.N[k] == 0)
        if ev is not None and free_v.size:
            j = int(rng.choice(free_v))
            masked_v, low_v = ev.copy().reshape(-1), ev.copy().reshape(-1)
            masked_v[j], low_v[j] = -np.inf, -1e3
            masked_v, low_v = masked_v.reshape(ev.shape), low_v.reshape(ev.shape)
        masked_u, low_u = masked_u.reshape(eu.shape), low_u.reshape(eu.shape)
        for fn, kw in ((sparsemap_loss, {}), (sparsemap_loss, {"margin": 0.5}),
                       (perceptron_loss, {}), (structured_svm_loss, {})):
            got = fn(case.f, masked_u, target, masked_v, **kw)
            want = fn(case.f, low_u, target, low_v, **kw)
            assert np.isfinite(got[0])
            assert got[0] == pytest.approx(want[0], abs=1e-9)
            np.testing.assert_allclose(got[1], want[1], atol=1e-9)
            np.testing.assert_allclose(got[2], want[2], atol=1e-9)
            assert np.all(got[1][np.isneginf(masked_u)] == 0.0)
            if masked_v is not None:
                assert np.all(got[2][np.isneginf(masked_v)] == 0.0)
        ref, _, _ = reference_loss(case, low_u, low_v, y_t)
        assert sparsemap_loss(case.f, masked_u, target, masked_v)[0] == pytest.approx(ref, abs=1e-8)
        # a target on a forbidden unary part; on a forbidden transition only
        on_u = [s for s, m in zip(case.S, case.M) if m[forbid].any()]
        on_v = [s for s, m, n in zip(case.S, case.M, case.N)
                if j is not None and n[j] != 0 and not m[forbid].any()]
        for bad, part in ((on_u[:1], "eta_u"), (on_v[:1], "eta_v")):
            for fn in (sparsemap_loss, perceptron_loss, structured_svm_loss):
                for s in bad:
                    with pytest.raises(ValueError, match=f"^target: uses a part that {part} "):
                        fn(case.f, masked_u, s, masked_v)


def test_a_target_on_a_forbidden_part_is_refused():
    f = sm.SequenceFactor(3, 2)
    eu, ev = np.zeros((3, 2)), np.zeros((2, 2, 2))
    eu[1, 0] = -np.inf
    for fn in (sparsemap_loss, perceptron_loss, structured_svm_loss):
        with pytest.raises(ValueError, match="^target: uses a part that eta_u forbids"):
            fn(f, eu, [1, 0, 1])
    ev[0, 1, 1] = -np.inf
    with pytest.raises(ValueError, match="^target: uses a part that eta_v forbids"):
        sparsemap_loss(f, np.zeros((3, 2)), [1, 1, 0], ev)
    with pytest.raises(ValueError, match=r"^targets\[1\]: uses a part"):
        batch_loss(sparsemap_loss, f, np.stack([np.zeros((3, 2)), eu]), [[0, 0, 0], [1, 0, 1]])
    # parts a factor ignores accept -inf: the tree's diagonal and column 0
    t = sm.TreeFactor(2)
    eta = np.zeros((3, 3))
    eta[:, 0] = -np.inf
    np.fill_diagonal(eta, -np.inf)
    assert np.isfinite(sparsemap_loss(t, eta, [-1, 0, 1])[0])


def _rows(values, k):
    """Every int array of length k over values, as a (len(values) ** k, k) intc array."""
    return np.array(list(itertools.product(values, repeat=k)), dtype=np.intc).reshape(-1, k)


@pytest.mark.parametrize("factor, valid", [
    *[(sm.TreeFactor(4, projective=p, single_root=r),
       {tuple(t) for t in all_trees(4, projective=p, single_root=r)})
      for p in (False, True) for r in (False, True)],
    (sm.SequenceFactor(3, 2), {tuple(t) for t in all_sequences(3, 2)}),
    (sm.MatchingFactor(3, 2), {tuple(t) for t in all_matchings(3, 2)}),
    (sm.MatchingFactor(2, 3), {tuple(t) for t in all_matchings(2, 3)}),
    (sm.GenericFactor(np.eye(3)), {(0,), (1,), (2,)}),
    (sm.XorFactor(3), {(1, 0, 0), (0, 1, 0), (0, 0, 1)}),
])
def test_targets_are_checked_in_c_as_the_references_say(factor, valid):
    """The batch losses check targets in one C pass (_first_invalid, each family's
    c_valid; the logic factors through the Python hook): every candidate array over a
    range wider than the valid values is accepted exactly when the brute-force
    enumeration of the family lists it, and a rejected one raises naming its row."""
    k = factor.struct_size
    values = range(-2, max(factor.shape_u) + 2)
    rows = _rows(values, k)
    if len(rows) > 20000:      # trees of 4 words: the root entry is -1 or wrong
        rows = rows[(rows[:, 0] == -1) | (rows[:, 1] == 0)]
    got = [_first_invalid(factor, np.ascontiguousarray(r[None])) < 0 for r in rows]
    assert got == [tuple(r) in valid for r in rows]
    assert sum(got) == len(valid)
    bad = rows[np.flatnonzero(~np.array(got))[0]]
    batch = np.stack([next(iter(sorted(valid)))] * 3 + [bad]).astype(np.intc)
    assert _first_invalid([factor] * 4, batch) == 3
    with pytest.raises(ValueError, match=r"targets\[3\]"):
        sm.losses._target_rows([factor] * 4, batch, 4)
