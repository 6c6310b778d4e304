"""Every torch entry point takes a transition matrix shared by the positions, as
smt.sequence does, and differentiates it as the expanded per-position form."""
import numpy as np
import pytest

import torch

import sparsemap as sm  # noqa: E402
import sparsemap.torch as smt  # noqa: E402

B, N, M = 3, 6, 4


def scores(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    eta_u = scale * torch.randn(B, N, M, generator=g, dtype=torch.float64)
    T = scale * torch.randn(M, M, generator=g, dtype=torch.float64)
    tags = torch.randint(0, M, (B, N), generator=g)
    return eta_u, T, tags


LOSSES = {"sparsemap": lambda *a, **k: smt.sparsemap_loss(*a, **k),
          "margin": lambda *a, **k: smt.sparsemap_loss(*a, margin=1.0, **k),
          "svm": lambda *a, **k: smt.structured_svm_loss(*a, **k),
          "perceptron": lambda *a, **k: smt.perceptron_loss(*a, **k)}


def grads(fn, eta_u, eta_v):
    eta_u = eta_u.clone().requires_grad_(True)
    eta_v = eta_v.clone().requires_grad_(True)
    out = fn(eta_u, eta_v)
    out.backward(torch.ones_like(out))
    return out.detach(), eta_u.grad, eta_v.grad


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("ragged", [False, True])
def test_losses_shared_equals_expanded(name, ragged):
    eta_u, T, tags = scores(1)
    f = [sm.SequenceFactor(n, M) for n in (N, N - 2, 2)] if ragged else sm.SequenceFactor(N, M)
    loss = LOSSES[name]
    shared = grads(lambda u, v: loss(f, u, tags, v, reduction="none"), eta_u, T)
    # the reference: the matrix copied to every position, and the copies' gradients
    # summed by hand
    full = T.expand(B, N - 1, M, M).clone()
    expanded = grads(lambda u, v: loss(f, u, tags, v, reduction="none"), eta_u, full)
    assert torch.equal(shared[0], expanded[0])
    assert torch.equal(shared[1], expanded[1])
    torch.testing.assert_close(shared[2], expanded[2].sum(dim=(0, 1)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["sparsemap", "margin", "svm"])
def test_loss_gradient_of_a_shared_matrix_by_finite_differences(name):
    # at random scores (no ties) the losses are differentiable in the shared matrix
    eta_u, T, tags = scores(2)
    f = sm.SequenceFactor(N, M)
    T = T.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda v: LOSSES[name](f, eta_u, tags, v, reduction="sum"), (T,), eps=1e-6,
        atol=1e-6)


def test_layer_shared_matrix_per_element_and_bad_shapes():
    eta_u, T, _ = scores(3)
    f = sm.SequenceFactor(N, M)
    g = torch.Generator().manual_seed(4)
    per_element = torch.randn(B, M, M, generator=g, dtype=torch.float64)   # one per sentence
    for v in (T, per_element):
        full = v.unsqueeze(-3).expand(B, N - 1, M, M).clone()
        assert torch.equal(smt.sparsemap(f, eta_u, v), smt.sparsemap(f, eta_u, full))
        assert torch.equal(smt.sparsemap(f, eta_u, v), smt.sequence(eta_u, v))
    # the layer's gradient in the shared matrix, by finite differences
    T = T.clone().requires_grad_(True)
    w = torch.randn(B, N, M, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda v: (smt.sparsemap(f, eta_u, v) * w).sum(), (T,),
                                    eps=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"eta_v: expected transitions of shape \(\.\.\., 4, 4\)"):
        smt.sparsemap_loss(f, eta_u, torch.zeros(B, N, dtype=torch.long), torch.zeros(M, M + 1))
    with pytest.raises(ValueError, match="eta_v: shape .* does not broadcast"):
        smt.sparsemap(f, eta_u, torch.zeros(B + 1, M, M, dtype=torch.float64))


def test_distribution_and_budgeted_sequences_take_a_shared_matrix():
    eta_u, T, _ = scores(5)
    f = sm.SequenceFactor(N, M)
    full = T.expand(N - 1, M, M).clone()
    S1, w1 = smt.distribution(f, eta_u[0], T)
    S2, w2 = smt.distribution(f, eta_u[0], full)
    assert torch.equal(S1, S2) and torch.equal(w1, w2)
    fb = sm.SequenceBudgetFactor(N, 2)
    u2 = eta_u[:, :, 0]
    T2 = T[:2, :2]
    assert torch.equal(smt.sparsemap(fb, u2, T2),
                       smt.sparsemap(fb, u2, T2.expand(B, N - 1, 2, 2).clone()))
