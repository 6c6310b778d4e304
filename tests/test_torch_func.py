"""torch.func transforms on the layers: jvp agrees with torch.autograd.forward_ad, grad
with backward, vmap with batch dimensions, jacrev and jacfwd with the closed form."""
import numpy as np
import pytest

import torch
import torch.autograd.forward_ad as fwAD  # noqa: E402

import sparsemap as sm  # noqa: E402
import sparsemap.torch as smt  # noqa: E402


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def forward_ad(fn, xs, ts):
    with fwAD.dual_level():
        out = fn(*[fwAD.make_dual(x, t) for x, t in zip(xs, ts)])
        return fwAD.unpack_dual(out).tangent


CASES = {
    "tree": (smt.tree, lambda: (randn(2, 6, 6, seed=1),)),
    "tree_flat": (smt.tree, lambda: (0.01 * randn(2, 6, 6, seed=2),)),
    "sequence": (smt.sequence, lambda: (randn(2, 5, 3, seed=3), randn(2, 4, 3, 3, seed=4))),
    "sequence_shared": (smt.sequence, lambda: (randn(2, 5, 3, seed=5), randn(3, 3, seed=6))),
}


@pytest.mark.parametrize("name", CASES)
def test_func_jvp_agrees_with_forward_ad_and_differences(name):
    fn, make = CASES[name]
    xs = make()
    ts = tuple(randn(*x.shape, seed=10 + i) for i, x in enumerate(xs))
    out, tangent = torch.func.jvp(fn, xs, ts)
    assert torch.equal(out, fn(*xs))
    torch.testing.assert_close(tangent, forward_ad(fn, xs, ts), rtol=0, atol=1e-12)
    # and both are the derivative: central differences (u is piecewise linear; the
    # step stays within one piece at these scores)
    eps = 1e-7
    fd = (fn(*[x + eps * t for x, t in zip(xs, ts)]) -
          fn(*[x - eps * t for x, t in zip(xs, ts)])) / (2 * eps)
    torch.testing.assert_close(tangent, fd, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", CASES)
def test_func_grad_equals_backward(name):
    fn, make = CASES[name]
    xs = make()
    w = randn(*fn(*xs).shape, seed=20)
    grads = torch.func.grad(lambda *a: (fn(*a) * w).sum(), argnums=tuple(range(len(xs))))(*xs)
    leaves = [x.clone().requires_grad_(True) for x in xs]
    (fn(*leaves) * w).sum().backward()
    for g, leaf in zip(grads, leaves):
        assert torch.equal(g, leaf.grad)


def test_func_grad_of_the_losses():
    f = sm.SequenceFactor(5, 3)
    eta_u, T = randn(2, 5, 3, seed=7), randn(3, 3, seed=8)
    tags = torch.tensor([[0, 1, 2, 1, 0], [2, 2, 1, 0, 0]])
    for loss in (smt.sparsemap_loss, smt.structured_svm_loss, smt.perceptron_loss):
        g_u, g_v = torch.func.grad(lambda u, v: loss(f, u, tags, v), argnums=(0, 1))(eta_u, T)
        u, v = eta_u.clone().requires_grad_(True), T.clone().requires_grad_(True)
        loss(f, u, tags, v).backward()
        assert torch.equal(g_u, u.grad) and torch.equal(g_v, v.grad)


def test_vmap_is_a_batch_dimension():
    scores = randn(3, 2, 6, 6, seed=9)
    assert torch.equal(torch.vmap(smt.tree)(scores), smt.tree(scores))
    assert torch.equal(torch.vmap(smt.tree, in_dims=1)(scores),
                       smt.tree(scores.transpose(0, 1)))
    eta_u, T = randn(4, 5, 3, seed=10), randn(3, 3, seed=11)
    assert torch.equal(torch.vmap(lambda e: smt.sequence(e, T))(eta_u), smt.sequence(eta_u, T))
    with pytest.raises(ValueError, match="torch.vmap: a layer over a list of factors"):
        torch.vmap(lambda s: smt.sparsemap([sm.TreeFactor(5), sm.TreeFactor(3)], s))(scores)


def test_jacrev_and_jacfwd_give_the_sparsemax_jacobian():
    x = randn(4, 5, seed=12)
    J_rev = torch.func.jacrev(smt.sparsemax)(x)
    J_fwd = torch.func.jacfwd(smt.sparsemax)(x)
    # closed form (Martins and Astudillo, 2016): diag(s) - s s^T / |s| per row, s the
    # support's indicator
    p = smt.sparsemax(x)
    J = torch.zeros(4, 5, 4, 5, dtype=torch.float64)
    for i in range(4):
        s = (p[i] > 0).double()
        J[i, :, i, :] = torch.diag(s) - torch.outer(s, s) / s.sum()
    torch.testing.assert_close(J_rev, J, rtol=0, atol=1e-12)
    torch.testing.assert_close(J_fwd, J, rtol=0, atol=1e-12)


def test_distribution_weights_jvp_agrees_with_forward_ad_and_backward():
    f = sm.SequenceFactor(4, 3)
    eta_u, d = randn(4, 3, seed=13), randn(4, 3, seed=14)

    def weights(e):
        return smt.distribution(f, e)[1]
    _, tangent = torch.func.jvp(weights, (eta_u,), (d,))
    torch.testing.assert_close(tangent, forward_ad(weights, (eta_u,), (d,)), rtol=0,
                               atol=1e-12)
    # <w-bar, J d> = <J^T w-bar, d>, the backward pass from autograd
    wbar = randn(*tangent.shape, seed=15)
    e = eta_u.clone().requires_grad_(True)
    (weights(e) * wbar).sum().backward()
    torch.testing.assert_close((tangent * wbar).sum(), (e.grad * d).sum(), rtol=1e-12,
                               atol=1e-12)


def test_factor_graph_layer_under_func_grad_and_jvp():
    fg = sm.FactorGraph(4)
    fg.add(sm.XorFactor(3), [0, 1, 2])
    fg.add(sm.OrFactor(2), [2, 3])
    x, d, w = 0.1 * randn(4, seed=16), randn(4, seed=17), randn(4, seed=18)
    g = torch.func.grad(lambda e: (smt.factor_graph(fg, e) * w).sum())(x)
    leaf = x.clone().requires_grad_(True)
    (smt.factor_graph(fg, leaf) * w).sum().backward()
    assert torch.equal(g, leaf.grad) and g.abs().max() > 0
    _, tangent = torch.func.jvp(lambda e: smt.factor_graph(fg, e), (x,), (d,))
    torch.testing.assert_close((tangent * w).sum(), (g * d).sum(), rtol=1e-9, atol=1e-9)
