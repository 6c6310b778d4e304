"""The facet side as users meet it: chosen by sm.solve, batches, pickles, losses and the
torch layers, at the flat scores of a freshly initialised model.

The solvers themselves are tested against brute force, closed forms and finite
differences in test_facet_tree.py, test_facet_sequence.py and test_facet_matching.py;
here every reference is computed outside the package too: finite differences of the
solver's u, the Wolfe gap from the factor's MAP, the vertex side, per-position sparsemax.
"""
import pickle
import warnings

import numpy as np
import pytest
import torch

import sparsemap as sm
import sparsemap.torch as smt
from sparsemap.testing import (check_jacobian, dense_columns, enumerate_structures,
                               tie_direction)

from _reference import sparsemax, sparsemax_jacobian, viterbi


def quiet(fn, *args, **kwargs):
    """fn(...) turning every warning into a test failure."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args, **kwargs)


def wolfe_gap(f, eta_u, r, eta_v=None):
    """max_s <a_s, [eta_u - u; eta_v]> - <eta_u - u, u> - <eta_v, v>, by the factor's MAP."""
    adj = np.where(r.u > 0, eta_u - r.u, np.where(np.isneginf(eta_u), -np.inf, eta_u - r.u))
    s = f.map(adj, eta_v)
    m, n = f.vertex(s)
    best = np.sum(np.where(m > 0, adj, 0.0))
    lin = np.sum(np.where(r.u > 0, (eta_u - r.u) * r.u, 0.0))
    if eta_v is not None:
        best += np.sum(np.where(n > 0, eta_v, 0.0))
        lin += np.sum(np.where(r.v > 0, eta_v * r.v, 0.0))
    return best - lin


def check_derivative(f, eta_u, rng, n_dirs=3, eta_v=None):
    """jvp against finite differences of the solver's u (testing.check_jacobian: one-sided
    differences at two small steps; a direction whose differences disagree crosses a
    kink within the steps, which at flat scores on long sentences is common, and is
    skipped), vjp as its transpose; two directions at least are checked."""
    check_jacobian(f, eta_u, eta_v, eps=1e-8, rtol=1e-5, atol=1e-6, n_directions=n_dirs,
                   rng=rng, min_checked=2)
    return quiet(sm.solve, f, eta_u, eta_v)


# -- the cap of the vertex side's backward set --------------------------------------------

def test_66_words_at_flat_scores_converge_with_the_true_derivative():
    """The issue's reproduction: from about 65 words the vertex side's backward set (then
    at most 4096 trees) could not span the optimal face, its solve warned and reported
    converged=False, and its Jacobian was wrong. The facet side has no cap."""
    rng = np.random.default_rng(0)
    f = sm.TreeFactor(66)
    eta = 1e-4 * rng.standard_normal((67, 67))
    r = check_derivative(f, eta, rng)
    assert r.side == "facet" and r.converged
    assert r.gap <= 1e-12 and abs(wolfe_gap(f, eta, r) - r.gap) <= 1e-12


@pytest.mark.parametrize("n", [80, 120])
@pytest.mark.parametrize("single_root", [False, True])
@pytest.mark.parametrize("scale", [0.01, 0.1])
def test_long_sentences_at_flat_scores(n, single_root, scale):
    rng = np.random.default_rng(n + int(single_root))
    f = sm.TreeFactor(n, single_root=single_root)
    eta = scale * rng.standard_normal((n + 1, n + 1))
    r = check_derivative(f, eta, rng)
    assert r.side == "facet" and r.converged
    assert wolfe_gap(f, eta, r) <= 1e-12 * max(1.0, np.sum(np.abs(eta * r.u)) + np.sum(r.u ** 2))


# -- the choice ---------------------------------------------------------------------------

@pytest.mark.parametrize("factor, shape_v", [
    (sm.TreeFactor(30), None), (sm.TreeFactor(30, single_root=True), None),
    (sm.SequenceFactor(30, 6), (29, 6, 6)), (sm.MatchingFactor(12, 15), None)])
def test_flat_scores_take_the_facet_side_and_agree_with_the_vertex_side(factor, shape_v):
    rng = np.random.default_rng(1)
    eta_u = 0.05 * rng.standard_normal(factor.shape_u)
    # (small transitions: smaller ones take the vertex side past max_iter)
    eta_v = None if shape_v is None else 3e-3 * rng.standard_normal(shape_v)
    r = quiet(sm.solve, factor, eta_u, eta_v)
    rv = sm.solve(factor, eta_u, eta_v, method="vertex")
    assert r.side == "facet" and rv.side == "vertex" and r.converged
    np.testing.assert_allclose(r.u, rv.u, atol=1e-9)
    assert r.objective <= rv.objective + 1e-12
    # at generic scores u is differentiable: both sides return its Jacobian (the vertex
    # side's is exact where its backward set spans the face, as here at 30 words)
    d = rng.standard_normal(factor.shape_u)
    np.testing.assert_allclose(r.jvp(d), rv.jvp(d), atol=1e-8)


def test_peaked_scores_take_the_vertex_side():
    rng = np.random.default_rng(2)
    f = sm.TreeFactor(20)
    r = quiet(sm.solve, f, 20 * rng.standard_normal(f.shape_u))
    assert r.side == "vertex" and r.converged


def test_forced_sides_and_families_without_a_facet_side():
    rng = np.random.default_rng(3)
    f = sm.TreeFactor(10)
    eta = 5 * rng.standard_normal(f.shape_u)
    rf = quiet(sm.solve, f, eta, method="facet")     # no peaked-score decline when forced
    rv = quiet(sm.solve, f, eta, method="vertex")
    assert rf.side == "facet" and rv.side == "vertex"
    np.testing.assert_allclose(rf.u, rv.u, atol=1e-9)
    for g in (sm.TreeFactor(5, projective=True), sm.XorFactor(4),
              sm.GenericFactor(np.eye(3))):
        with pytest.raises(ValueError, match="method: 'facet' needs a factor with a facet side"):
            sm.solve(g, np.zeros(g.shape_u), method="facet")
        assert sm.solve(g, np.zeros(g.shape_u)).side == "vertex"


def test_warm_start_takes_the_vertex_side():
    rng = np.random.default_rng(4)
    f = sm.TreeFactor(8)
    eta = 0.1 * rng.standard_normal(f.shape_u)
    r = sm.solve(f, eta)
    warm = sm.solve(f, eta, init=r)          # r's structures: its decomposition
    assert r.side == "facet" and warm.side == "vertex"
    np.testing.assert_allclose(warm.u, r.u, atol=1e-10)


# -- structures on request -------------------------------------------------------------------

@pytest.mark.parametrize("factor", [sm.TreeFactor(4), sm.TreeFactor(4, single_root=True),
                                    sm.SequenceFactor(4, 3), sm.MatchingFactor(3, 4)],
                         ids=repr)
def test_structures_decompose_u_within_the_optimal_face(factor):
    """r.structures on the facet side: a distribution over structures of the optimal
    face (every one ties at the adjusted scores) whose mean is (u, v)."""
    rng = np.random.default_rng(5)
    S_all = enumerate_structures(factor)
    M, N = dense_columns(factor, S_all)
    for scale in (0.05, 0.5):
        eta_u = scale * rng.standard_normal(factor.shape_u)
        eta_v = 0.1 * scale * rng.standard_normal(factor.shape_v)
        r = quiet(sm.solve, factor, eta_u, eta_v)
        assert r.side == "facet"
        Ms, Ns = dense_columns(factor, r.structures)
        np.testing.assert_allclose(Ms @ r.weights, r.u.ravel(), atol=1e-12)
        np.testing.assert_allclose(Ns @ r.weights, r.v.ravel(), atol=1e-12)
        assert np.all(r.weights > 0) and abs(r.weights.sum() - 1) <= 1e-12
        adj_all = M.T @ (eta_u - r.u).ravel() + N.T @ eta_v.ravel()
        adj_sup = Ms.T @ (eta_u - r.u).ravel() + Ns.T @ eta_v.ravel()
        assert adj_sup.min() >= adj_all.max() - 1e-10


# -- batches and pickles ---------------------------------------------------------------------

def mixed_problems(rng):
    """Trees, sequences and matchings at flat and peaked scores: both sides in one batch."""
    factors, etas_u, etas_v = [], [], []
    for scale in (0.02, 0.1, 10.0):
        for f in (sm.TreeFactor(12), sm.SequenceFactor(9, 4), sm.MatchingFactor(6, 8)):
            factors.append(f)
            etas_u.append(scale * rng.standard_normal(f.shape_u))
            etas_v.append(0.01 * scale * rng.standard_normal(f.shape_v) if f.n_v else None)
    return factors, etas_u, etas_v


def test_batches_are_bitwise_equal_to_single_solves():
    rng = np.random.default_rng(6)
    factors, etas_u, etas_v = mixed_problems(rng)
    rs = quiet(sm.solve_batch, factors, etas_u, etas_v, n_jobs=2)
    assert {r.side for r in rs} == {"facet", "vertex"}
    dus = [rng.standard_normal(f.shape_u) for f in factors]
    grads = sm.vjp_batch(rs, dus, n_jobs=2)
    jvps = sm.jvp_batch(rs, dus, n_jobs=2)
    for f, eu, ev, r, du, (gu, gv), jv in zip(factors, etas_u, etas_v, rs, dus, grads, jvps):
        s = sm.solve(f, eu, ev)
        assert s.side == r.side and np.array_equal(s.u, r.u) and np.array_equal(s.v, r.v)
        assert s.gap == r.gap and s.n_iter == r.n_iter
        su, sv = s.vjp(du)
        assert np.array_equal(su, gu) and np.array_equal(sv, gv)
        assert np.array_equal(s.jvp(du), jv)


def test_facet_results_pickle():
    rng = np.random.default_rng(7)
    factors, etas_u, etas_v = mixed_problems(rng)
    for f, eu, ev in zip(factors, etas_u, etas_v):
        r = sm.solve(f, eu, ev)
        r2 = pickle.loads(pickle.dumps(r))
        assert r2.side == r.side and np.array_equal(r2.u, r.u)
        d = rng.standard_normal(f.shape_u)
        assert np.array_equal(r2.jvp(d), r.jvp(d))
        assert all(np.array_equal(a, b) for a, b in zip(r2.vjp(d), r.vjp(d)))


# -- sequences at tied transition scores -------------------------------------------------------

@pytest.mark.parametrize("scale_u", [0.01, 0.1])
def test_sequence_at_zero_transitions(scale_u):
    """eta_v = 0 (a zero-initialised transition matrix): u is per-position sparsemax,
    its eta_u Jacobian the sparsemax Jacobian; the eta_v part is the Jacobian of the piece
    u follows along (0, r), r = tie_direction: the derivative at eta_v = t r, t > 0, and
    of the size of the gradients at nearby generic transitions."""
    rng = np.random.default_rng(8)
    n, S = 40, 17
    f = sm.SequenceFactor(n, S)
    eta_u = scale_u * rng.standard_normal((n, S))
    zero = np.zeros(f.shape_v)
    r = quiet(sm.solve, f, eta_u, zero)
    assert r.side == "facet" and r.converged
    np.testing.assert_allclose(r.u, np.array([sparsemax(z) for z in eta_u]), atol=1e-14)
    g = rng.standard_normal((n, S))
    gu, gv = r.vjp(g)
    np.testing.assert_allclose(gu, np.array([sparsemax_jacobian(z) @ gi
                                             for z, gi in zip(eta_u, g)]), atol=1e-12)
    # the piece along r: differences at eta_v = t r, where u is differentiable; pieces
    # there are cones about the ray (u is affine along it up to t ~ 1e-3 here), as wide
    # as 1e-4 t to 1e-6 t (measured over seeds), so the steps are 1e-7 t (one-sided both
    # ways, which agree: no kink within them), and round-off of u (1e-16) keeps t * 1e-7
    # above ~1e-13
    rdir = tie_direction(f)
    t = 1e-5
    d = rng.standard_normal(f.shape_v)
    rt = quiet(sm.solve, f, eta_u, t * rdir)
    eps = 1e-7 * t
    fp = (quiet(sm.solve, f, eta_u, t * rdir + eps * d).u - rt.u) / eps
    fm = (rt.u - quiet(sm.solve, f, eta_u, t * rdir - eps * d).u) / eps
    np.testing.assert_allclose(fp, fm, atol=1e-3)
    jv = r.jvp(np.zeros(f.shape_u), d)
    assert np.abs(jv).max() > 0.1
    np.testing.assert_allclose(jv, fp, atol=1e-3)
    np.testing.assert_allclose(rt.jvp(np.zeros(f.shape_u), d), jv, atol=1e-12)
    # bounded: within 10x of the gradient at small generic transitions
    near = quiet(sm.solve, f, eta_u, 1e-8 * rng.standard_normal(f.shape_v)).vjp(g)[1]
    ratio = np.linalg.norm(gv) / np.linalg.norm(near)
    assert 0.1 <= ratio <= 10
    # and the gap, by an independent Viterbi
    best = viterbi(eta_u - r.u, zero)[1]
    assert best - np.sum((eta_u - r.u) * r.u) <= 1e-12


# -- masks -------------------------------------------------------------------------------------

def test_masks_on_the_facet_side():
    rng = np.random.default_rng(9)
    f = sm.TreeFactor(15)
    eta = 0.1 * rng.standard_normal(f.shape_u)
    eta[3, 1:] = -np.inf                       # word 3 heads nothing
    eta[0, 5] = -np.inf
    r = quiet(sm.solve, f, eta)
    assert r.side == "facet"
    assert np.all(r.u[3, 1:] == 0) and r.u[0, 5] == 0
    g = rng.standard_normal(f.shape_u)
    gu, _ = r.vjp(g)
    assert np.all(gu[3, 1:] == 0) and gu[0, 5] == 0
    assert np.all(r.jvp(g)[3, 1:] == 0)
    # against the vertex side
    np.testing.assert_allclose(r.u, sm.solve(f, eta, method="vertex").u, atol=1e-9)
    # no tree avoids every forbidden arc: a ValueError naming the scores
    bad = eta.copy()
    bad[:, 7] = -np.inf
    with pytest.raises(ValueError, match="eta_u"):
        sm.solve(f, bad)


# -- losses and the torch layers ---------------------------------------------------------------

def test_losses_at_flat_scores():
    rng = np.random.default_rng(10)
    f = sm.TreeFactor(40)
    eta = 0.05 * rng.standard_normal(f.shape_u)
    gold = f.map(rng.standard_normal(f.shape_u))
    for margin in (0.0, 1.0):
        loss, g, _ = quiet(sm.sparsemap_loss, f, eta, gold, margin=margin)
        lv, gvv, _ = sm.sparsemap_loss(f, eta, gold, margin=margin, method="vertex")
        np.testing.assert_allclose(g, gvv, atol=1e-9)
        assert loss == pytest.approx(lv, abs=1e-9)
    # the torch loss's padded path (the C loss batch) agrees
    t = torch.tensor(eta[None], requires_grad=True)
    out = smt.sparsemap_loss(f, t, torch.as_tensor(gold[None]))
    out.backward()
    loss, g, _ = sm.sparsemap_loss(f, eta, gold)
    assert float(out.detach()) == pytest.approx(loss, abs=1e-12)
    np.testing.assert_allclose(t.grad[0].numpy(), g, atol=1e-12)


@pytest.mark.parametrize("layer", ["tree", "sequence", "matching"])
def test_torch_layers_at_flat_scores(layer):
    """The padded layers take the facet side too: equal to sm.solve per element, and
    gradcheck through a random low-dimensional slice of the scores."""
    gen = torch.Generator().manual_seed(11)
    if layer == "tree":
        x0 = 0.05 * torch.randn(3, 21, 21, generator=gen, dtype=torch.float64)
        lengths = torch.tensor([20, 13, 7])

        def fn(x):
            return smt.tree(x, lengths=lengths)
        factors = [sm.TreeFactor(int(n)) for n in lengths]
        blocks = [x0[b, :n + 1, :n + 1].numpy() for b, n in enumerate(lengths.tolist())]
    elif layer == "sequence":
        x0 = 0.05 * torch.randn(3, 15, 6, generator=gen, dtype=torch.float64)
        v = 1e-4 * torch.randn(3, 14, 6, 6, generator=gen, dtype=torch.float64)

        def fn(x):
            return smt.sequence(x, v)
        factors = [sm.SequenceFactor(15, 6)] * 3
        blocks = [x0[b].numpy() for b in range(3)]
    else:
        x0 = 0.05 * torch.randn(3, 9, 11, generator=gen, dtype=torch.float64)

        def fn(x):
            return smt.matching(x)
        factors = [sm.MatchingFactor(9, 11)] * 3
        blocks = [x0[b].numpy() for b in range(3)]
    u = fn(x0)
    for b, (f, e) in enumerate(zip(factors, blocks)):
        ev = None if layer != "sequence" else v[b].numpy()
        r = sm.solve(f, e, ev)
        assert r.side == "facet"
        sub = u[b][tuple(slice(0, s) for s in f.shape_u)].numpy()
        assert np.array_equal(sub, r.u)
    B = torch.randn(x0.numel(), 6, generator=gen, dtype=torch.float64)
    C = torch.randn(6, x0.numel(), generator=gen, dtype=torch.float64)
    z = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: C @ fn(x0 + (B @ z).reshape(x0.shape)).reshape(-1),
                                    (z,), eps=1e-6, atol=1e-6, rtol=1e-5)
