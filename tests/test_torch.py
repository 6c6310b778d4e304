"""sparsemap.torch: the autograd layer, the family wrappers, the distribution and the losses.

Derivatives are checked by finite differences (torch.autograd.gradcheck) in float64;
values against sm.solve element by element, the NumPy losses, and closed forms.
"""
import re

import numpy as np
import pytest
import torch

import sparsemap as sm
import sparsemap.torch as smt
from _reference import PAIRWISE_M, PAIRWISE_N, all_sequences, all_trees, \
    pairwise_closed_form, sparsemax, sparsemax_jacobian

# Central differences of a piecewise-linear map are exact up to the solver's round-off.
GC = dict(eps=1e-6, atol=1e-7, rtol=1e-6)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen(seed), dtype=torch.float64)).requires_grad_()


def pair_oracle():
    """Two binary variables, eta_v scores 'both on' (structures 0..3 = columns of PAIRWISE_M)."""
    return sm.OracleFactor(
        lambda eu, ev: int(np.argmax(eu @ PAIRWISE_M + ev @ PAIRWISE_N)),
        lambda s: (PAIRWISE_M[:, s], PAIRWISE_N[:, s]), shape_u=2, shape_v=1)


def generic_factor(n_u, n_v, n_s, seed):
    rng = np.random.default_rng(seed)
    return sm.GenericFactor(rng.standard_normal((n_u, n_s)),
                            rng.standard_normal((n_v, n_s)) if n_v else None)


# (name, factors for a ragged batch); the first factor is also used plain and batched.
FAMILIES = {
    "tree": [sm.TreeFactor(3), sm.TreeFactor(4), sm.TreeFactor(2)],
    "tree_projective": [sm.TreeFactor(4, True), sm.TreeFactor(2, True)],
    "tree_single_root": [sm.TreeFactor(3, False, True), sm.TreeFactor(4, False, True)],
    "tree_projective_single_root": [sm.TreeFactor(4, True, True), sm.TreeFactor(3, True, True)],
    "sequence": [sm.SequenceFactor(3, 2), sm.SequenceFactor(5, 2), sm.SequenceFactor(1, 2)],
    "matching": [sm.MatchingFactor(3, 3), sm.MatchingFactor(2, 3), sm.MatchingFactor(3, 1)],
    "generic": [generic_factor(4, 2, 6, 0), generic_factor(3, 1, 5, 1)],
    "oracle": [pair_oracle(), pair_oracle()],
    "xor": [sm.XorFactor(4), sm.XorFactor(2), sm.XorFactor(3)],
    "at_most_one": [sm.AtMostOneFactor(4), sm.AtMostOneFactor(1)],
    "or": [sm.OrFactor(3), sm.OrFactor(4)],
    "budget": [sm.BudgetFactor(5, 2), sm.BudgetFactor(3, 2), sm.BudgetFactor(4, 1)],
    "budget_exact": [sm.BudgetFactor(5, 2, exact=True), sm.BudgetFactor(3, 1, exact=True)],
    "pair": [sm.PairFactor(), sm.PairFactor()],
    "or_out": [sm.OrOutFactor(4), sm.OrOutFactor(3)],
    "and_out": [sm.AndOutFactor(3), sm.AndOutFactor(5)],
    "xor_out": [sm.XorOutFactor(4), sm.XorOutFactor(3)],
    "sequence_budget": [sm.SequenceBudgetFactor(5, 2), sm.SequenceBudgetFactor(3, 1, exact=True),
                        sm.SequenceBudgetFactor(1, 1)],
    "imply": [sm.ImplyFactor(3), sm.ImplyFactor(2)],
    "knapsack": [sm.KnapsackFactor([0.5, 1.0, 2.0, 0.3], 1.2), sm.KnapsackFactor([1.0, 1.0], 1.5)],
}


def padded(factors, which, seed):
    """Random padded scores for a ragged batch (None when no factor has eta_v)."""
    shapes = [f.shape_u if which == "u" else f.shape_v for f in factors
              if which == "u" or f.shape_v != (0,)]
    if not shapes:
        return None
    pad = tuple(max(s) for s in zip(*shapes))
    return randn(len(factors), *pad, seed=seed)


def v_of(f, batch, seed):
    return None if f.shape_v == (0,) else randn(*batch, *f.shape_v, seed=seed)


def block(x, shape):
    return x[tuple(slice(0, n) for n in shape)]


def inputs(eu, ev):
    return (eu,) if ev is None else (eu, ev)


# -- the layer -----------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_gradcheck_plain_batched_ragged(name):
    factors = FAMILIES[name]
    f = factors[0]
    for batch, seed in (((), 1), ((2,), 2)):
        eu, ev = randn(*batch, *f.shape_u, seed=seed), v_of(f, batch, seed + 10)
        assert torch.autograd.gradcheck(lambda *x: smt.sparsemap(f, *x), inputs(eu, ev), **GC)
    eu, ev = padded(factors, "u", 3), padded(factors, "v", 4)
    assert torch.autograd.gradcheck(lambda *x: smt.sparsemap(factors, *x), inputs(eu, ev), **GC)


@pytest.mark.parametrize("name", FAMILIES)
def test_batch_elements_equal_solve(name):
    factors = FAMILIES[name]
    f = factors[0]
    eu, ev = randn(2, 3, *f.shape_u, seed=5), v_of(f, (2, 3), 6)
    u = smt.sparsemap(f, eu, ev)
    assert u.shape == eu.shape and u.dtype == torch.float64
    for i in range(2):
        for j in range(3):
            r = sm.solve(f, eu[i, j].detach().numpy(),
                         None if ev is None else ev[i, j].detach().numpy())
            np.testing.assert_array_equal(u[i, j].detach().numpy(), r.u)
    # ragged: padding is never read (NaN there changes nothing), u is 0 outside each block
    eu, ev = padded(factors, "u", 7), padded(factors, "v", 8)
    u = smt.sparsemap(factors, eu, ev)
    eu_nan = eu.detach().clone().fill_(float("nan"))
    ev_nan = None if ev is None else ev.detach().clone().fill_(float("nan"))
    for b, fb in enumerate(factors):
        block(eu_nan[b], fb.shape_u)[...] = block(eu[b].detach(), fb.shape_u)
        if ev is not None and fb.shape_v != (0,):
            block(ev_nan[b], fb.shape_v)[...] = block(ev[b].detach(), fb.shape_v)
    u_nan = smt.sparsemap(factors, eu_nan, ev_nan)
    np.testing.assert_array_equal(u.detach().numpy(), u_nan.numpy())
    for b, fb in enumerate(factors):
        evb = None if ev is None or fb.shape_v == (0,) else \
            block(ev[b], fb.shape_v).detach().numpy()
        r = sm.solve(fb, block(eu[b], fb.shape_u).detach().numpy(), evb)
        np.testing.assert_array_equal(block(u[b], fb.shape_u).detach().numpy(), r.u)
        assert float(u[b].detach().abs().sum()) == pytest.approx(float(np.abs(r.u).sum()))


def test_backward_equals_numpy_vjp_and_is_zero_in_padding():
    # bitwise; the incoming gradient's padding (NaN here) is never read
    factors = FAMILIES["sequence"]
    eu, ev = padded(factors, "u", 9), padded(factors, "v", 10)
    g = torch.randn(eu.shape, generator=gen(11), dtype=torch.float64)
    g_nan = torch.full_like(g, float("nan"))
    for b, f in enumerate(factors):
        block(g_nan[b], f.shape_u)[...] = block(g[b], f.shape_u)
    gu, gv = torch.autograd.grad(smt.sparsemap(factors, eu, ev), (eu, ev), g_nan)
    for b, f in enumerate(factors):
        evb = None if f.shape_v == (0,) else block(ev[b], f.shape_v).detach().numpy()
        r = sm.solve(f, block(eu[b], f.shape_u).detach().numpy(), evb)
        want_u, want_v = r.vjp(block(g[b], f.shape_u).numpy())
        np.testing.assert_array_equal(block(gu[b], f.shape_u).numpy(), want_u)
        assert gu[b].abs().sum() == pytest.approx(np.abs(want_u).sum(), abs=1e-13)
        if f.shape_v != (0,):
            np.testing.assert_array_equal(block(gv[b], f.shape_v).numpy(), want_v)
        assert gv[b].abs().sum() == pytest.approx(np.abs(want_v).sum(), abs=1e-13)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ragged_tree_layer_reads_only_the_blocks(dtype):
    # each sentence equals sm.solve on its block (rounded like .to(dtype)), its gradient
    # equals r.vjp on its block of the incoming gradient; NaN in the padding of both is
    # never read, and u and the gradient are 0 there
    lengths = torch.tensor([4, 1, 6, 3, 6])
    n1 = int(lengths.max()) + 1
    scores = torch.full((5, n1, n1), float("nan"), dtype=torch.float64)
    g = torch.full((5, n1, n1), float("nan"), dtype=torch.float64)
    for b, n in enumerate(lengths.tolist()):
        scores[b, :n + 1, :n + 1] = 3 * torch.randn(n + 1, n + 1, generator=gen(60 + b),
                                                    dtype=torch.float64)
        g[b, :n + 1, :n + 1] = torch.randn(n + 1, n + 1, generator=gen(70 + b),
                                           dtype=torch.float64)
    scores[2, 3, 3] = float("nan")        # the diagonal and column 0 are ignored
    scores[2, 4, 0] = float("inf")
    scores, g = scores.to(dtype), g.to(dtype)
    x = scores.clone().requires_grad_()
    u = smt.tree(x, lengths, n_jobs=2)
    (gx,) = torch.autograd.grad(u, x, g)
    assert u.dtype == gx.dtype == dtype
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    for b, n in enumerate(lengths.tolist()):
        r = sm.solve(sm.TreeFactor(n), scores[b, :n + 1, :n + 1].double().numpy())
        np.testing.assert_array_equal(u[b, :n + 1, :n + 1].detach().numpy(), r.u.astype(np_dtype))
        want = r.vjp(g[b, :n + 1, :n + 1].double().numpy())[0].astype(np_dtype)
        np.testing.assert_array_equal(gx[b, :n + 1, :n + 1].numpy(), want)
        assert float(u[b].detach().abs().sum()) == pytest.approx(float(np.abs(r.u).sum()),
                                                                 rel=1e-6)
        assert float(gx[b].abs().sum()) == pytest.approx(float(np.abs(want).sum()), rel=1e-6)
    # a NaN the layer reads: a ValueError naming the batch element, forward and backward
    bad = scores.clone()
    bad[3, 1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"eta_u: .*non-finite.*\(batch element 3\)"):
        smt.tree(bad, lengths)
    g[1, 0, 1] = float("inf")
    with pytest.raises(ValueError, match=r"gradient of u: .*non-finite.*\(batch element 1\)"):
        torch.autograd.grad(smt.tree(x, lengths), x, g)


def test_oracle_layer_matches_pairwise_closed_form():
    eu, ev = randn(5, 2, seed=12), randn(5, 1, seed=13)
    u = smt.sparsemap(pair_oracle(), eu, ev).detach().numpy()
    for b in range(5):
        want = pairwise_closed_form(*eu[b].tolist(), ev[b, 0].item())[:2]
        np.testing.assert_allclose(u[b], want, atol=1e-12)


# torch's own gradgradcheck / forward-mode code calls torch.jit.script, deprecated since
# 2.13 (a DeprecationWarning there, a FutureWarning from 2.14 on)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_double_backward_and_forward_mode():
    f = sm.SequenceFactor(4, 3)
    eu, ev = randn(2, 4, 3, seed=14), randn(2, 3, 3, 3, seed=15)
    fn = lambda a, b: smt.sparsemap(f, a, b)  # noqa: E731
    assert torch.autograd.gradgradcheck(fn, (eu, ev), **GC)
    assert torch.autograd.gradcheck(fn, (eu, ev), check_forward_ad=True, **GC)
    # Hessian-vector product of a smooth downstream loss: J^T H J v with J = du/d eta_u.
    t = sm.TreeFactor(3)
    x = randn(4, 4, seed=16)
    w = torch.randn(4, 4, generator=gen(17), dtype=torch.float64)
    loss = lambda z: (smt.sparsemap(t, z) * w).pow(2).sum()  # noqa: E731
    v = torch.randn(4, 4, generator=gen(18), dtype=torch.float64)
    _, hvp = torch.autograd.functional.hvp(loss, x, v)
    r = sm.solve(t, x.detach().numpy())
    jv = r.jvp(v.numpy())
    np.testing.assert_allclose(hvp.numpy(), r.vjp(2 * w.numpy() ** 2 * jv)[0], atol=1e-12)


def test_dtypes_and_n_jobs():
    f = sm.TreeFactor(5)
    x64 = torch.randn(6, 6, 6, generator=gen(19), dtype=torch.float64)
    u64 = smt.sparsemap(f, x64)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = x64.to(dtype).requires_grad_()
        u = smt.sparsemap(f, x)
        assert u.dtype == dtype and u.device == x.device
        u.sum().backward()
        assert x.grad.dtype == dtype
    x32 = x64.float()
    np.testing.assert_array_equal(smt.sparsemap(f, x32).numpy(),
                                  smt.sparsemap(f, x32.double()).float().numpy())
    for n_jobs in (1, 2):
        np.testing.assert_array_equal(smt.sparsemap(f, x64, n_jobs=n_jobs).numpy(), u64.numpy())
    # views the layer reads in place: strided, and with torch's lazy negation bit
    np.testing.assert_array_equal(smt.sparsemap(f, x64.transpose(1, 2)).numpy(),
                                  smt.sparsemap(f, x64.transpose(1, 2).contiguous()).numpy())
    np.testing.assert_array_equal(smt.sparsemap(f, torch._neg_view(x64)).numpy(),
                                  smt.sparsemap(f, -x64).numpy())
    # solve keywords pass through
    u_cg = smt.sparsemap(f, x64, method="pairwise_cg", max_iter=5000, tol=1e-10)
    np.testing.assert_allclose(u_cg.numpy(), u64.numpy(), atol=1e-4)


def test_bad_input_raises_value_error_naming_the_argument():
    f = sm.TreeFactor(3)
    x = torch.zeros(4, 4)
    cases = [
        (lambda: smt.sparsemap(f, np.zeros((4, 4))), "eta_u"),
        (lambda: smt.sparsemap(f, torch.zeros(4, 4, dtype=torch.long)), "eta_u"),
        (lambda: smt.sparsemap(f, torch.zeros(2, 3, 3)), "eta_u"),
        (lambda: smt.sparsemap(f, x, torch.zeros(1)), "eta_v"),
        (lambda: smt.sparsemap(f, torch.full((4, 4), float("nan"))), "eta_u"),
        (lambda: smt.sparsemap(f, torch.full((4, 4), float("inf"))), "eta_u"),
        (lambda: smt.sparsemap("tree", x), "factor"),
        (lambda: smt.sparsemap([f, "tree"], torch.zeros(2, 4, 4)), "factor[1]"),
        (lambda: smt.sparsemap([], torch.zeros(0, 4, 4)), "factor"),
        (lambda: smt.sparsemap([f, f], torch.zeros(3, 4, 4)), "eta_u"),
        (lambda: smt.sparsemap([f, sm.TreeFactor(5)], torch.zeros(2, 4, 4)), "eta_u"),
        (lambda: smt.sparsemap(sm.SequenceFactor(3, 2), torch.zeros(3, 2),
                               torch.zeros(3, 2, 2)), "eta_v"),
        (lambda: smt.tree(torch.zeros(2, 4, 5)), "scores"),
        (lambda: smt.tree(torch.zeros(2, 4, 4), lengths=torch.tensor([1, 4])), "lengths"),
        (lambda: smt.tree(torch.zeros(2, 4, 4), lengths=torch.tensor([1])), "lengths"),
        (lambda: smt.tree(torch.zeros(2, 4, 4), lengths=torch.tensor([1., 2.])), "lengths"),
        (lambda: smt.sequence(torch.zeros(3, 2), torch.zeros(3, 3)), "eta_v"),
        (lambda: smt.matching(torch.zeros(2, 3, 3), n_cols=torch.tensor([0, 3])), "n_cols"),
        (lambda: smt.sparsemax(torch.zeros(3), dim=1), "dim"),
        (lambda: smt.sparsemax(torch.tensor(1.0)), "x"),
        (lambda: smt.sparsemap_loss(f, x, torch.tensor([-1, 0, 1, 2]), reduction="avg"),
         "reduction"),
        (lambda: smt.sparsemap_loss(f, x, torch.tensor([-1., 0, 1, 2])), "target"),
        (lambda: smt.sparsemap_loss(f, x, torch.tensor([[-1, 0, 1, 2]])), "target"),
        (lambda: smt.sparsemap_loss(f, x, torch.tensor([-1, 0, 3, 2])), "target"),
        (lambda: smt.perceptron_loss(f, torch.zeros(2, 4, 4),
                                     torch.tensor([[-1, 0, 1, 2], [-1, 2, 3, 1]])), "target"),
        (lambda: smt.perceptron_loss(f, torch.zeros(2, 4, 4), torch.tensor([[-1, 0, 1, 2]] * 2),
                                     n_jobs=0), "n_jobs"),
    ]
    for call, name in cases:
        with pytest.raises(ValueError, match="^" + re.escape(name) + ":"):
            call()
    with pytest.raises(ValueError, match="batch element 1"):
        smt.perceptron_loss(f, torch.zeros(2, 4, 4), torch.tensor([[-1, 0, 1, 2], [-1, 2, 3, 1]]))


def test_masks_pass_through():
    # -inf forbids an arc: u and the gradient are exactly 0 there, and the rest equals the
    # same problem with a very low finite score instead.
    scores = randn(3, 6, 6, seed=50).detach()
    lengths = torch.tensor([5, 3, 4])
    mask = torch.rand(3, 6, 6, generator=gen(51)) < 0.4
    mask[:, 0, :] = False                      # root arcs stay allowed: always feasible
    x = scores.masked_fill(mask, float("-inf")).requires_grad_()
    u = smt.tree(x, lengths)
    low = smt.tree(scores.masked_fill(mask, -1e4), lengths)
    assert bool((u[mask] == 0).all()) and mask[:, 1:5, 1:5].any()
    np.testing.assert_allclose(u.detach().numpy(), low.numpy(), atol=1e-12)
    (gx,) = torch.autograd.grad(u, x, torch.randn(x.shape, generator=gen(52), dtype=x.dtype))
    assert bool((gx[mask] == 0).all())
    assert torch.autograd.gradcheck(lambda s: smt.tree(s, lengths), (x,), **GC)
    # forbidden transitions of a sequence (BIO-style: tag 0 never followed by tag 1)
    eu, ev = randn(2, 4, 3, seed=53), randn(2, 3, 3, 3, seed=54).detach()
    ev_masked, ev_low = ev.clone(), ev.clone()
    ev_masked[:, :, 0, 1] = float("-inf")
    ev_low[:, :, 0, 1] = -1e4
    ev_masked.requires_grad_()
    u = smt.sequence(eu, ev_masked)
    np.testing.assert_allclose(u.detach().numpy(), smt.sequence(eu, ev_low).detach().numpy(),
                               atol=1e-12)
    structures, weights = smt.distribution(sm.SequenceFactor(4, 3), eu, ev_masked)
    used = (structures[..., :-1] == 0) & (structures[..., 1:] == 1) & (weights[..., None] > 0)
    assert not bool(used.any())
    assert torch.autograd.gradcheck(lambda a, b: smt.sequence(a, b), (eu, ev_masked), **GC)
    # sparsemax: probability 0 at -inf
    p = smt.sparsemax(torch.tensor([[0.0, float("-inf"), 0.5], [float("-inf"), 1.0, 2.0]]))
    np.testing.assert_allclose(p.numpy(), [[0.25, 0, 0.75], [0, 0, 1]], atol=1e-7)
    # losses under masks: -inf parts cost nothing, as in the NumPy losses
    heads = torch.tensor([[-1, 0, 0, 0, 0, 0], [-1, 0, 0, 0, -1, -1], [-1, 0, 0, 0, 0, -1]])
    factors = [sm.TreeFactor(int(n)) for n in lengths]
    x = scores.masked_fill(mask, float("-inf")).requires_grad_()
    for kind, margin in LOSSES:
        loss = torch_loss(kind, factors, x, heads, None, margin, "none")
        (g,) = torch.autograd.grad(loss.sum(), x)
        assert bool(torch.isfinite(loss).all()) and bool((g[mask] == 0).all())
        for b, f in enumerate(factors):
            n = int(lengths[b])
            want = numpy_loss(kind, f, x[b, :n + 1, :n + 1].detach().numpy(),
                              heads[b, :n + 1].numpy(), None, margin)[0]
            assert loss[b].item() == pytest.approx(want, rel=1e-12, abs=1e-12)   # sum order
    # nothing allowed: a ValueError naming the argument and the batch element
    x = scores.clone()
    x[1, :, 2] = float("-inf")
    with pytest.raises(ValueError, match=r"eta_u.*forbidden.*\(batch element 1\)"):
        smt.tree(x, lengths)


def test_empty_batch():
    u = smt.sparsemap(sm.TreeFactor(2), torch.zeros(0, 3, 3, requires_grad=True))
    assert u.shape == (0, 3, 3)
    u.sum().backward()


# -- family wrappers -------------------------------------------------------------
@pytest.mark.parametrize("projective,single_root", [(False, False), (True, False),
                                                    (False, True), (True, True)])
def test_tree_wrapper_with_lengths(projective, single_root):
    scores = randn(2, 3, 6, 6, seed=20)
    lengths = torch.tensor([[5, 1, 3], [2, 5, 4]])
    u = smt.tree(scores, lengths, projective, single_root)
    for i in range(2):
        for j in range(3):
            n = int(lengths[i, j])
            f = sm.TreeFactor(n, projective, single_root)
            r = sm.solve(f, scores[i, j, :n + 1, :n + 1].detach().numpy())
            np.testing.assert_array_equal(u[i, j, :n + 1, :n + 1].detach().numpy(), r.u)
            assert float(u[i, j].detach().sum()) == pytest.approx(n)   # one head per word
    # no lengths = full length; gradcheck through the wrapper
    np.testing.assert_array_equal(smt.tree(scores).detach().numpy(),
                                  smt.sparsemap(sm.TreeFactor(5, False, False),
                                                scores).detach().numpy()
                                  if not (projective or single_root) else
                                  smt.tree(scores, torch.full((2, 3), 5)).detach().numpy())
    x = randn(2, 4, 4, seed=21)
    assert torch.autograd.gradcheck(
        lambda s: smt.tree(s, torch.tensor([3, 2]), projective, single_root), (x,), **GC)


def test_sequence_wrapper_lengths_and_shared_transitions():
    eu = randn(3, 5, 2, seed=22)
    trans = randn(2, 2, seed=23)
    lengths = torch.tensor([5, 2, 1])
    u = smt.sequence(eu, trans, lengths)
    full = trans.detach().expand(3, 4, 2, 2)
    u_full = smt.sequence(eu, full, lengths)
    np.testing.assert_array_equal(u.detach().numpy(), u_full.detach().numpy())
    for b, n in enumerate(lengths.tolist()):
        r = sm.solve(sm.SequenceFactor(n, 2), eu[b, :n].detach().numpy(),
                     full[b, :n - 1].numpy())
        np.testing.assert_array_equal(u[b, :n].detach().numpy(), r.u)
        assert float(u[b, n:].detach().abs().sum()) == 0
    assert torch.autograd.gradcheck(lambda a, t: smt.sequence(a, t, lengths), (eu, trans), **GC)
    # per-sequence transition matrices (*batch, m, m)
    per = randn(3, 2, 2, seed=24)
    assert torch.autograd.gradcheck(lambda a, t: smt.sequence(a, t, lengths), (eu, per), **GC)
    np.testing.assert_array_equal(smt.sequence(eu).detach().numpy(),
                                  smt.sequence(eu, torch.zeros(3, 4, 2, 2)).detach().numpy())


def test_matching_wrapper_rows_and_cols():
    scores = randn(3, 4, 5, seed=25)
    rows, cols = torch.tensor([4, 2, 3]), torch.tensor([5, 5, 1])
    u = smt.matching(scores, rows, cols)
    for b in range(3):
        R, C = int(rows[b]), int(cols[b])
        r = sm.solve(sm.MatchingFactor(R, C), scores[b, :R, :C].detach().numpy())
        np.testing.assert_array_equal(u[b, :R, :C].detach().numpy(), r.u)
        assert float(u[b].detach().sum()) == pytest.approx(min(R, C))
    assert torch.autograd.gradcheck(lambda s: smt.matching(s, rows, cols), (scores,), **GC)
    np.testing.assert_array_equal(smt.matching(scores).detach().numpy(),
                                  smt.sparsemap(sm.MatchingFactor(4, 5), scores).detach().numpy())


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_sparsemax_closed_form(dim):
    x = randn(4, 6, seed=26, scale=2.0)
    p = smt.sparsemax(x, dim=dim)
    xm = x.detach().movedim(dim, -1).numpy()
    want = np.stack([sparsemax(row) for row in xm])
    np.testing.assert_allclose(p.detach().movedim(dim, -1).numpy(), want, atol=1e-12)
    g = torch.randn(x.shape, generator=gen(27), dtype=torch.float64)
    (gx,) = torch.autograd.grad(p, x, g)
    gm = g.movedim(dim, -1).numpy()
    want_g = np.stack([sparsemax_jacobian(row) @ gr for row, gr in zip(xm, gm)])
    np.testing.assert_allclose(gx.movedim(dim, -1).numpy(), want_g, atol=1e-12)
    assert torch.allclose(smt.Sparsemax(dim)(x), p)


def test_sparsemax_is_translation_invariant_and_one_hot_when_peaked():
    x = torch.tensor([[0.3, 5.0, -1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    p = smt.sparsemax(x)
    np.testing.assert_allclose(p.numpy(), [[0, 1, 0], [1 / 3, 1 / 3, 1 / 3]], atol=1e-14)
    np.testing.assert_allclose(smt.sparsemax(x + 7.5).numpy(), p.numpy(), atol=1e-14)


# -- the distribution ------------------------------------------------------------------
def all_structures(f):
    if isinstance(f, sm.TreeFactor):
        return all_trees(f.n_words, f.projective, f.single_root)
    if isinstance(f, sm.SequenceFactor):
        return all_sequences(*f.shape_u)
    return list(range(f.n_structures if isinstance(f, sm.GenericFactor) else 4))


def y_star_is_unique(f, eu, ev):
    """y* is unique iff the structures tied at the optimum (largest theta_s - m_s . u) are
    exactly the support: otherwise tied structures are affine combinations of support ones."""
    r = sm.solve(f, eu, ev)
    structures = all_structures(f)
    adj = np.array([f.score(s, eu, ev) - f.vertex(s)[0].ravel() @ r.u.ravel()
                    for s in structures])
    return int(np.sum(adj >= adj.max() - 1e-9)) == len(r.weights)


def blocks_of(factors, eu, ev):
    for b, f in enumerate(factors):
        evb = None if ev is None or f.shape_v == (0,) else block(ev[b], f.shape_v).detach().numpy()
        yield f, block(eu[b], f.shape_u).detach().numpy(), evb


@pytest.mark.parametrize("name", ["tree", "sequence", "generic", "oracle"])
def test_distribution_matches_solve_and_gradcheck(name):
    factors = FAMILIES[name]
    f = factors[0]
    eu, ev = randn(3, *f.shape_u, seed=30), v_of(f, (3,), 31)
    structures, weights = smt.distribution(f, eu, ev)
    u = smt.sparsemap(f, eu, ev)
    for b, (_, eub, evb) in enumerate(blocks_of([f] * 3, eu, ev)):
        r = sm.solve(f, eub, evb, method="vertex")     # the distribution is the active set's
        k = len(r.weights)
        np.testing.assert_array_equal(weights[b, :k].detach().numpy(), r.weights)
        assert float(weights[b, k:].detach().abs().sum()) == 0
        np.testing.assert_array_equal(structures[b, :k].numpy(), np.asarray(r.structures))
        assert bool((structures[b, k:] == -1).all())
        # sum_k w_k m_k rebuilds u
        rebuilt = sum(w * f.vertex(s)[0] for s, w in zip(r.structures, r.weights))
        np.testing.assert_allclose(u[b].detach().numpy(), rebuilt, atol=1e-12)
    # Finite differences through the solver see Appendix B's derivative only where y* is
    # unique (elsewhere the solver may return another optimal y*): check that first.
    eu, ev = randn(2, *f.shape_u, seed=UNIQUE_SEEDS[name][0]), v_of(f, (2,), 32)
    assert all(y_star_is_unique(*p) for p in blocks_of([f] * 2, eu, ev))
    assert torch.autograd.gradcheck(lambda *x: smt.distribution(f, *x)[1], inputs(eu, ev), **GC)
    eu, ev = padded(factors, "u", UNIQUE_SEEDS[name][1]), padded(factors, "v", 33)
    assert all(y_star_is_unique(*p) for p in blocks_of(factors, eu, ev))
    assert torch.autograd.gradcheck(lambda *x: smt.distribution(factors, *x)[1],
                                    inputs(eu, ev), **GC)


def test_distribution_gradient_when_y_star_is_not_unique():
    # Trees tie often: two trees that swap the heads of two words are affinely dependent on
    # the pair that does not. y* is then one optimal distribution among many, and the
    # gradient is that of y*_I on its support I held fixed (Appendix B), which stays optimal
    # nearby: y*_I(eta) = argmin over span-1 of 1/2 ||M_I y||^2 - theta_I . y, solved here by
    # NumPy least squares and differentiated by central differences.
    f = sm.TreeFactor(4)
    x = randn(5, 5, seed=34)
    assert not y_star_is_unique(f, x.detach().numpy(), None)
    structures, weights = smt.distribution(f, x)
    cols = np.stack([f.vertex(s.numpy())[0].ravel() for s in structures])

    def y_fixed(eta):
        k = len(cols)
        K = np.block([[cols @ cols.T, np.ones((k, 1))], [np.ones((1, k)), np.zeros((1, 1))]])
        return np.linalg.solve(K, np.r_[cols @ eta.ravel(), 1.0])[:k]

    y0 = y_fixed(x.detach().numpy())
    np.testing.assert_allclose(weights.detach().numpy(), y0, atol=1e-12)
    assert y0.min() > 0
    g = torch.randn(len(y0), generator=gen(35), dtype=torch.float64)
    (gx,) = torch.autograd.grad(weights, x, g)
    e = 1e-6
    for idx in np.ndindex(5, 5):
        d = np.zeros((5, 5))
        d[idx] = e
        fd = (y_fixed(x.detach().numpy() + d) - y_fixed(x.detach().numpy() - d)) / (2 * e)
        assert gx[idx].item() == pytest.approx(float(fd @ g.numpy()), abs=1e-8)


def test_distribution_gradient_is_appendix_b():
    # For sparsemax (M = I, no eta_v) D is the sparsemax Jacobian restricted to the support.
    z = np.array([1.0, 0.8, 0.1, -2.0])
    x = torch.tensor(z, requires_grad=True)
    structures, weights = smt.distribution(sm.GenericFactor(np.eye(4)), x)
    J = np.stack([torch.autograd.grad(weights[k], x, retain_graph=True)[0].numpy()
                  for k in range(len(weights))])
    np.testing.assert_allclose(J, sparsemax_jacobian(z)[structures.numpy()], atol=1e-14)


# seeds (batched, ragged) of instances with a unique y* (checked in the test)
UNIQUE_SEEDS = {"tree": (40, 43), "sequence": (40, 41), "generic": (40, 40), "oracle": (40, 40)}


def test_distribution_marginalised_downstream_loss():
    # E_{y*}[cost(s)] with a per-structure cost: its gradient flows only through the weights.
    f = sm.TreeFactor(4)
    x = randn(5, 5, seed=34)
    structures, weights = smt.distribution(f, x)
    gold = torch.tensor([-1, 0, 1, 2, 3])
    cost = (structures != gold).sum(-1).to(weights.dtype)   # wrong heads per tree
    expected = (weights * cost).sum()
    expected.backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


# -- losses ---------------------------------------------------------------------------
def numpy_loss(kind, f, eu, t, ev, margin):
    if kind == "sparsemap":
        return sm.sparsemap_loss(f, eu, t, ev, margin=margin)
    if kind == "perceptron":
        return sm.perceptron_loss(f, eu, t, ev)
    return sm.structured_svm_loss(f, eu, t, ev, margin=margin)


def torch_loss(kind, factor, eu, t, ev, margin, reduction):
    if kind == "sparsemap":
        return smt.sparsemap_loss(factor, eu, t, ev, margin=margin, reduction=reduction)
    if kind == "perceptron":
        return smt.perceptron_loss(factor, eu, t, ev, reduction=reduction)
    return smt.structured_svm_loss(factor, eu, t, ev, margin=margin, reduction=reduction)


LOSSES = [("sparsemap", 0.0), ("sparsemap", 1.0), ("svm", 1.0), ("perceptron", 0.0)]


def padded_targets(factors, structures):
    width = max(np.size(s) for s in structures)
    if width == 1 and all(np.ndim(s) == 0 for s in structures):
        return torch.tensor([int(s) for s in structures])
    out = torch.full((len(structures), width), -1, dtype=torch.long)
    for b, s in enumerate(structures):
        out[b, :np.size(s)] = torch.as_tensor(np.asarray(s))
    return out


@pytest.mark.parametrize("kind,margin", LOSSES)
@pytest.mark.parametrize("name", ["tree", "sequence", "matching", "generic"])
def test_losses_equal_numpy_losses(kind, margin, name):
    factors = FAMILIES[name]
    rng = np.random.default_rng(35)
    eu, ev = padded(factors, "u", 36), padded(factors, "v", 37)
    # targets: MAP of unrelated random scores, so they are valid structures
    gold = [f.map(rng.standard_normal(f.shape_u)) for f in factors]
    targets = padded_targets(factors, gold)
    per = torch_loss(kind, factors, eu, targets, ev, margin, "none")
    g = torch.autograd.grad(per.sum(), inputs(eu, ev))
    for b, f in enumerate(factors):
        evb = None if ev is None or f.shape_v == (0,) else block(ev[b], f.shape_v).detach().numpy()
        want, gu, gv = numpy_loss(kind, f, block(eu[b], f.shape_u).detach().numpy(), gold[b],
                                  evb, margin)
        # one kernel: the same solve, gradient and value, bit for bit
        assert per[b].item() == want
        np.testing.assert_array_equal(block(g[0][b], f.shape_u).numpy(), gu)
        if evb is not None:
            np.testing.assert_array_equal(block(g[1][b], f.shape_v).numpy(), gv)
    for red, value in (("sum", per.sum()), ("mean", per.mean())):
        assert torch_loss(kind, factors, eu, targets, ev, margin, red).item() == \
            pytest.approx(value.item(), rel=1e-15)
    assert torch.autograd.gradcheck(
        lambda *x: torch_loss(kind, factors, x[0], targets, x[1] if len(x) > 1 else None,
                              margin, "mean"), inputs(eu, ev), **GC)
    # shared factor, two batch dims
    f = factors[0]
    eu2, ev2 = randn(2, 2, *f.shape_u, seed=38), v_of(f, (2, 2), 39)
    t2 = torch.stack([padded_targets([f], [f.map(rng.standard_normal(f.shape_u))])[0]
                      for _ in range(4)]).reshape((2, 2) + ((f.struct_size,)
                                                            if np.ndim(gold[0]) else ()))
    per2 = torch_loss(kind, f, eu2, t2, ev2, margin, "none")
    assert per2.shape == (2, 2)
    want = numpy_loss(kind, f, eu2[1, 0].detach().numpy(), t2[1, 0].numpy(),
                      None if ev2 is None else ev2[1, 0].detach().numpy(), margin)[0]
    assert per2[1, 0].item() == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_dense_targets_equal_compact_targets():
    factors = FAMILIES["tree"]
    eu = padded(factors, "u", 60)
    rng = np.random.default_rng(61)
    gold = [f.map(rng.standard_normal(f.shape_u)) for f in factors]
    dense = torch.zeros(eu.shape, dtype=torch.float64)
    for b, f in enumerate(factors):
        block(dense[b], f.shape_u)[...] = torch.from_numpy(f.vertex(gold[b])[0])
    for kind, margin in LOSSES:
        compact = torch_loss(kind, factors, eu, padded_targets(factors, gold), None, margin, "none")
        # the same u; the loss values are sums taken in another order (the dense targets'
        # path is the NumPy loss's), so they agree to round-off
        np.testing.assert_allclose(
            torch_loss(kind, factors, eu, dense, None, margin, "none").detach().numpy(),
            compact.detach().numpy(), rtol=1e-14, atol=1e-14)
    with pytest.raises(ValueError, match="target"):
        smt.sparsemap_loss(factors, eu, dense[:, :3])


def test_dense_target_of_a_one_row_generic_factor_is_dense():
    # GenericFactor([[1, 0]]): one part, structure 0 has m = 1, structure 1 has m = 0, so
    # shape_u == (struct_size,) and a float target [m_t] must not be read as the index m_t.
    # Closed form: eta' = eta + margin (1 - m_t); SparseMAP u* = clip(eta', 0, 1), loss
    # (eta' u* - u*^2 / 2) - (eta' m_t - m_t^2 / 2), gradient u* - m_t; MAP m_s = [eta' > 0],
    # loss eta' (m_s - m_t), subgradient m_s - m_t.
    f = sm.GenericFactor(np.array([[1.0, 0.0]]))
    etas = [0.2, -0.3, 0.7, 1.6]
    eu = torch.tensor(etas, dtype=torch.float64).reshape(4, 1).requires_grad_()
    for kind, margin in LOSSES:
        for mt in (1.0, 0.0):
            want_loss, want_grad = [], []
            for eta in etas:
                e = eta + margin * (1 - mt)
                if kind == "sparsemap":
                    u = min(max(e, 0.0), 1.0)
                    want_loss.append((e * u - u * u / 2) - (e * mt - mt * mt / 2))
                    want_grad.append(u - mt)
                else:
                    ms = float(e > 0)
                    want_loss.append(e * (ms - mt))
                    want_grad.append(ms - mt)
            index = torch.full((4,), 0 if mt else 1)
            for target in (torch.full((4, 1), mt, dtype=torch.float64), index):
                per = torch_loss(kind, f, eu, target, None, margin, "none")
                (g,) = torch.autograd.grad(per.sum(), eu)
                np.testing.assert_allclose(per.detach().numpy(), want_loss, atol=1e-12)
                np.testing.assert_allclose(g.numpy().ravel(), want_grad, atol=1e-12)
    # the example of the bug report, and a ragged batch reads the float target densely too
    x = torch.tensor([[0.2]], dtype=torch.float64)
    assert smt.sparsemap_loss(f, x, torch.tensor([[1.0]], dtype=torch.float64)).item() == \
        pytest.approx(0.32, abs=1e-12)
    assert smt.sparsemap_loss([f, f], x.expand(2, 1), torch.tensor([[1.0], [0.0]]),
                              reduction="none").tolist() == pytest.approx([0.32, 0.02], abs=1e-7)
    with pytest.raises(ValueError, match=r"^target: .*\(batch element 1\)$"):
        smt.sparsemap_loss(f, x.expand(2, 1), torch.tensor([[1.0], [0.5]]))


def test_loss_modules_and_dtype():
    f = sm.TreeFactor(3)
    x = torch.randn(2, 4, 4, generator=gen(40)).requires_grad_()
    t = torch.tensor([[-1, 0, 1, 2], [-1, 3, 0, 2]])
    for module, fn in ((smt.SparseMAPLoss(margin=0.5), lambda *a: smt.sparsemap_loss(
            *a, margin=0.5)), (smt.StructuredSVMLoss(), smt.structured_svm_loss),
                       (smt.PerceptronLoss(reduction="sum"),
                        lambda *a: smt.perceptron_loss(*a, reduction="sum"))):
        value = module(f, x, t)
        assert value.dtype == torch.float32 and value.shape == ()
        assert value.item() == fn(f, x, t).item()
        value.backward()
        assert x.grad.dtype == torch.float32
    assert "margin=0.5" in repr(smt.SparseMAPLoss(margin=0.5))
    with pytest.raises(ValueError, match="reduction"):
        smt.PerceptronLoss(reduction="elementwise")


def test_loss_is_once_differentiable():
    x = randn(4, 4, seed=41)
    loss = smt.sparsemap_loss(sm.TreeFactor(3), x, torch.tensor([-1, 0, 1, 2]))
    # a grad_output that requires grad, so the gradient is a function of it and the
    # double backward reaches the loss's backward pass
    v = torch.ones((), dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(loss, x, v, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


@pytest.mark.parametrize("kind,margin", LOSSES)
def test_training_brings_the_loss_down(kind, margin):
    # A bilinear arc scorer learns trees generated by a hidden one, on ragged sentences.
    torch.manual_seed(0)
    B, N, d = 8, 6, 5
    feats = torch.randn(B, N + 1, d)
    lengths = torch.randint(2, N + 1, (B,))
    lengths[0] = N
    hidden = torch.randn(d, d)
    factors = [sm.TreeFactor(int(n)) for n in lengths]
    with torch.no_grad():
        gold_scores = feats @ hidden @ feats.transpose(1, 2)
    heads = torch.full((B, N + 1), -1, dtype=torch.long)
    for b, f in enumerate(factors):
        n = int(lengths[b])
        heads[b, :n + 1] = torch.as_tensor(f.map(gold_scores[b, :n + 1, :n + 1].numpy()))
    W = (0.1 * torch.randn(d, d)).requires_grad_()
    opt = torch.optim.Adam([W], lr=0.1)
    history = []
    for _ in range(40):
        opt.zero_grad()
        scores = feats @ W @ feats.transpose(1, 2)
        loss = torch_loss(kind, factors, scores, heads, None, margin, "mean")
        loss.backward()
        opt.step()
        history.append(loss.item())
    assert history[-1] < 0.3 * history[0], history


def test_default_n_jobs_of_the_torch_layer_and_losses_for_oracles(monkeypatch):
    import threading

    from sparsemap import _solve
    from test_batch import _thread_recording_oracle
    monkeypatch.setattr(_solve, "_default_jobs", lambda: 4)
    seen = set()
    oracle = _thread_recording_oracle(5, seen)
    x = torch.randn(40, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    smt.sparsemap(oracle, x).sum().backward()
    smt.sparsemap_loss(oracle, x, torch.zeros(40, dtype=torch.long)).backward()
    smt.structured_svm_loss([oracle] * 40, x, torch.zeros(40, dtype=torch.long)).backward()
    assert seen == {threading.get_ident()}


def test_losses_run_in_the_batch_runner_without_the_numpy_loss(monkeypatch):
    """Integer targets and the active set: no per-element call of the NumPy losses (the
    batch runner computes them); a problem the run reports (here an impossible target)
    goes through the NumPy loss, which raises naming the batch element."""
    import sparsemap.losses as losses_module
    calls = []

    def spy(name):
        real = getattr(losses_module, name)

        def wrapped(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return wrapped

    kinds = {}
    for fn, kind in smt._PADDED_LOSSES.items():
        monkeypatch.setattr(smt.sm, fn.__name__, spy(fn.__name__))
        kinds[getattr(smt.sm, fn.__name__)] = kind
    monkeypatch.setattr(smt, "_PADDED_LOSSES", kinds)
    factors = [sm.TreeFactor(n) for n in (3, 2)]
    x = torch.randn(2, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    heads = torch.tensor([[-1, 0, 1, 2], [-1, 2, 0, -1]])
    for fn in (smt.sparsemap_loss, smt.structured_svm_loss, smt.perceptron_loss):
        fn(factors, x, heads)
    assert calls == []
    x[1, 2, 1] = float("-inf")                         # the gold arc 2 -> 1 of element 1
    with pytest.raises(ValueError, match=r"target: uses a part.*\(batch element 1\)"):
        smt.sparsemap_loss(factors, x, heads)
    assert calls == ["sparsemap_loss"]
