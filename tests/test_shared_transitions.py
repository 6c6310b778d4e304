"""A transition matrix shared by the positions (an (S, S) eta_v; a broadcast in torch).

At exact ties (T = 0) the derivative is the one-sided limit along the shared tie
direction R0 (sparsemap.testing.shared_tie_direction): checked here against solves at
T = t R0, t > 0 small, where u is differentiable, and against one-sided differences of
u along R0 (u is affine on [0, t R0]: the gradient's <g, R0> is that difference).
"""
import numpy as np
import pytest

import sparsemap as sm
from sparsemap.testing import shared_tie_direction, tie_direction


def problem(n, S=17, seed=0, scale=0.1):
    rng = np.random.default_rng([n, S, seed])
    return sm.SequenceFactor(n, S), scale * rng.standard_normal((n, S)), rng


def test_tie_direction_is_shared():
    for n, S in [(2, 3), (7, 4), (30, 17)]:
        f = sm.SequenceFactor(n, S)
        R0 = shared_tie_direction(f)
        assert R0.shape == (S, S) and np.all(np.abs(R0) < 1) and np.std(R0) > 0.3
        assert np.all(tie_direction(f) == R0)
    # R0 depends on the number of tags only
    assert np.all(shared_tie_direction(sm.SequenceFactor(1, 5))
                  == shared_tie_direction(sm.SequenceFactor(9, 5)))
    with pytest.raises(ValueError, match="SequenceFactor"):
        shared_tie_direction(sm.TreeFactor(3))


def test_shared_matrix_equals_its_broadcast():
    f, eu, rng = problem(6, 4, scale=0.5)
    T = 0.3 * rng.standard_normal((4, 4))
    r = sm.solve(f, eu, T)
    rb = sm.solve(f, eu, np.broadcast_to(T, f.shape_v).copy())
    np.testing.assert_array_equal(r.u, rb.u)
    g = rng.standard_normal(f.shape_u)
    np.testing.assert_allclose(r.vjp(g)[1], rb.vjp(g)[1].sum(0), atol=1e-13)
    D = rng.standard_normal((4, 4))
    np.testing.assert_allclose(r.jvp(np.zeros(f.shape_u), D),
                               rb.jvp(np.zeros(f.shape_u), np.broadcast_to(D, f.shape_v)),
                               atol=1e-13)
    with pytest.raises(ValueError, match=r"\(4, 4\) \(shared"):
        sm.solve(f, eu, np.zeros((3, 4)))


@pytest.mark.parametrize("n", [20, 80])
@pytest.mark.parametrize("method", ["auto", "facet"])
def test_gradient_at_zero_is_the_limit_along_R0(n, method):
    f, eu, rng = problem(n)
    R0 = shared_tie_direction(f)
    du = rng.standard_normal(f.shape_u)
    r0 = sm.solve(f, eu, np.zeros((17, 17)), method=method)
    g_u, g_v = r0.vjp(du)
    assert g_v.shape == (17, 17)
    t = 1e-6
    rt = sm.solve(f, eu, t * R0, method=method)
    h_u, h_v = rt.vjp(du)
    np.testing.assert_allclose(g_v, h_v, rtol=1e-6, atol=1e-6 * np.abs(h_v).max())
    np.testing.assert_allclose(g_u, h_u, rtol=1e-6, atol=1e-6 * np.abs(h_u).max())
    # <g, R0> is the one-sided derivative of <du, u> along R0
    one_sided = (du * (rt.u - r0.u)).sum() / t
    assert np.isclose((g_v * R0).sum(), one_sided, rtol=1e-6, atol=1e-9)
    # and jvp along R0 is the one-sided difference itself
    np.testing.assert_allclose(r0.jvp(np.zeros(f.shape_u), R0), (rt.u - r0.u) / t, atol=1e-6)


@pytest.mark.parametrize("n", [20, 80])
def test_torch_layer_and_loss_with_a_broadcast_matrix(n):
    import torch
    import sparsemap.torch as smt
    f, eu, rng = problem(n)
    S = 17
    R0 = torch.tensor(shared_tie_direction(f))
    du = torch.tensor(rng.standard_normal((2, n, S)))
    x = torch.tensor(np.stack([eu, eu[::-1].copy()]))
    target = torch.tensor(rng.integers(0, S, (2, n)))

    def grads(T0):
        T = T0.clone().requires_grad_()
        (smt.sequence(x, T) * du).sum().backward()                      # the layer
        T2 = T0.clone().requires_grad_()
        smt.sparsemap_loss(f, x, target, T2.expand(2, n - 1, S, S)).backward()   # the loss
        return T.grad, T2.grad

    zero = torch.zeros(S, S, dtype=torch.float64)
    g_layer, g_loss = grads(zero)
    t = 1e-6
    h_layer = grads(t * R0)[0]
    # the loss's gradient is v - n_target, and v moves by O(t) along R0: a smaller t
    h_loss = grads(1e-11 * R0)[1]
    np.testing.assert_allclose(g_layer.numpy(), h_layer.numpy(), rtol=1e-6,
                               atol=1e-6 * h_layer.abs().max().item())
    np.testing.assert_allclose(g_loss.numpy(), h_loss.numpy(), rtol=1e-6,
                               atol=1e-6 * h_loss.abs().max().item())
    # (the loss at 0 is not the loss at any other shared matrix's limit: v is the
    # limit along R0, one of many optimal couplings at T = 0)
    g_other = grads(1e-11 * torch.tensor(np.random.default_rng(5).uniform(-1, 1, (S, S))))[1]
    assert np.abs(g_other.numpy() - g_loss.numpy()).max() > 1e-3
    # <g, R0> against the one-sided difference of the layer's output along R0
    with torch.no_grad():
        diff = ((smt.sequence(x, t * R0) - smt.sequence(x, zero)) * du).sum().item() / t
    assert np.isclose((g_layer * R0).sum().item(), diff, rtol=1e-6, atol=1e-9)


def test_numpy_batches_take_a_shared_matrix():
    """solve_batch, jvp_batch and vjp_batch take shared (S, S) matrices as solve does:
    stacked (B, S, S) or entries of a list (mixed with per-transition ones and None)."""
    f, eu, rng = problem(6, 4, scale=0.5)
    eus = np.stack([eu, eu[::-1], 2 * eu])
    Ts = 0.3 * rng.standard_normal((3, 4, 4))
    singles = [sm.solve(f, e, T) for e, T in zip(eus, Ts)]
    for etas_v in (Ts, list(Ts)):
        rs = sm.solve_batch(f, eus, etas_v, n_jobs=2)
        for r, s in zip(rs, singles):
            np.testing.assert_array_equal(r.u, s.u)
    du = rng.standard_normal((3,) + f.shape_u)
    for (g_u, g_v), s, d in zip(sm.vjp_batch(rs, du), singles, du):
        assert g_v.shape == (4, 4)
        np.testing.assert_array_equal(g_v, s.vjp(d)[1])
    D = rng.standard_normal((3, 4, 4))
    for out, s, d in zip(sm.jvp_batch(rs, du, D), singles, zip(du, D)):
        np.testing.assert_array_equal(out, s.jvp(*d))
    # mixed: a shared matrix, a per-transition array, None
    mixed = [Ts[0], np.broadcast_to(Ts[1], f.shape_v), None]
    rs = sm.solve_batch(f, eus, mixed)
    assert [g.shape for _, g in sm.vjp_batch(rs, du)] == [(4, 4), f.shape_v, f.shape_v]
    with pytest.raises(ValueError, match=r"etas_v\[1\]: expected shape"):
        sm.solve_batch(f, eus, [Ts[0], np.zeros((3, 4)), None])


@pytest.mark.parametrize("loss", [sm.sparsemap_loss, sm.structured_svm_loss,
                                  sm.perceptron_loss])
def test_numpy_losses_take_a_shared_matrix(loss):
    """The loss of a shared matrix equals the loss of its broadcast, and its gradient is
    the broadcast's summed over the transitions, which central differences confirm."""
    f, eu, rng = problem(7, 4, scale=0.5)
    T = 0.3 * rng.standard_normal((4, 4))
    y = rng.integers(0, 4, size=7)
    val, g_u, g_v = loss(f, eu, y, eta_v=T)
    val_b, g_ub, g_vb = loss(f, eu, y, eta_v=np.broadcast_to(T, f.shape_v))
    assert val == val_b and g_v.shape == (4, 4)
    np.testing.assert_array_equal(g_u, g_ub)
    np.testing.assert_allclose(g_v, g_vb.sum(0), atol=1e-14)
    D = rng.standard_normal((4, 4))
    h = 1e-6
    fd = (loss(f, eu, y, eta_v=T + h * D)[0] - loss(f, eu, y, eta_v=T - h * D)[0]) / (2 * h)
    assert abs(np.sum(g_v * D) - fd) <= 1e-6 * max(1.0, abs(fd))
    # batch_loss: stacked (B, S, S) matrices give (B, S, S) gradients
    tot, G_u, G_v = sm.batch_loss(loss, f, np.stack([eu, -eu]), [y, y],
                                  etas_v=np.stack([T, -T]), reduction="sum")
    assert G_v.shape == (2, 4, 4)
    np.testing.assert_array_equal(G_v[0], g_v)
    assert tot == val + loss(f, -eu, y, eta_v=-T)[0]


def test_a_budgeted_sequence_takes_a_shared_matrix_in_numpy_as_in_torch():
    """SequenceBudgetFactor's eta_v is one block per transition too: NumPy's solve, losses
    and batches take one shared matrix for it, as sparsemap.torch does."""
    rng = np.random.default_rng(3)
    fb = sm.SequenceBudgetFactor(6, 2)
    eu, T = rng.standard_normal(6), rng.standard_normal((2, 2))
    full = np.broadcast_to(T, fb.shape_v).copy()
    r, rb = sm.solve(fb, eu, T), sm.solve(fb, eu, full)
    np.testing.assert_array_equal(r.u, rb.u)
    g = rng.standard_normal(6)
    np.testing.assert_allclose(r.vjp(g)[1], rb.vjp(g)[1].sum(0), atol=1e-13)
    (q,) = sm.solve_batch(fb, eu[None], T[None])
    np.testing.assert_array_equal(q.u, r.u)
    with pytest.raises(ValueError, match=r"\(2, 2\) \(shared"):
        sm.solve(fb, eu, np.zeros((2, 3)))
