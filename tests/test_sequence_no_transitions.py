"""Sequences solved without transition scores (``eta_v=None``): per-position sparsemax.

There ``u(eta_u) = sparsemax(eta_u[i])`` per position, so the derivative the user asked
for is per-position sparsemax's Jacobian, on both sides, through every entry point
(``jvp``/``vjp``, the batch products, the torch layer). Expected values come from the
closed form (``_reference.sparsemax_jacobian``) and from central differences of the
closed form; transitions passed explicitly (even zeros) keep the one-sided limit along
``tie_direction`` (tests/test_facet_sequence.py).
"""
import numpy as np
import pytest

import sparsemap as sm
from sparsemap.testing import tie_direction

import torch

import sparsemap.torch as smt
from _reference import sparsemax, sparsemax_jacobian

METHODS = ["auto", "facet", "vertex"]


def closed_form_jacobian(eta_u):
    """Block-diagonal: one sparsemax Jacobian per position."""
    n, S = eta_u.shape
    J = np.zeros((n * S, n * S))
    for i in range(n):
        J[i * S:(i + 1) * S, i * S:(i + 1) * S] = sparsemax_jacobian(eta_u[i])
    return J


def central_differences(eta_u, h=1e-7):
    """Of per-position sparsemax (the closed form), column by column."""
    n, S = eta_u.shape
    J = np.zeros((n * S, n * S))
    for j in range(n * S):
        e = np.zeros(n * S)
        e[j] = h
        up = np.array([sparsemax(z) for z in eta_u + e.reshape(n, S)])
        dn = np.array([sparsemax(z) for z in eta_u - e.reshape(n, S)])
        J[:, j] = (up - dn).ravel() / (2 * h)
    return J


@pytest.mark.parametrize("method", METHODS)
def test_identical_rows_example(method):
    f = sm.SequenceFactor(2, 3)
    eu = np.array([[0, .1, .2], [0, .1, .2]])
    d = np.zeros((2, 3))
    d[0, 0] = 1
    r = sm.solve(f, eu, method=method)
    expected = [[2 / 3, -1 / 3, -1 / 3], [0, 0, 0]]
    np.testing.assert_allclose(r.jvp(d), expected, atol=1e-12)
    np.testing.assert_allclose(r.vjp(d)[0], expected, atol=1e-12)
    # the same scores with transitions passed (zeros): the piece along tie_direction,
    # which couples the positions here
    rz = sm.solve(f, eu, np.zeros(f.shape_v), method=method)
    assert np.abs(rz.jvp(d)[1]).max() > 0.1


def scores(kind, n, S, rng):
    if kind == "randn":
        return rng.standard_normal((n, S))
    if kind == "repeated_rows":          # identical positions: where the tie direction's piece couples them
        return np.tile(0.3 * rng.standard_normal(S), (n, 1))
    if kind == "integers":               # ties inside a position
        return rng.integers(-2, 3, (n, S)).astype(float)
    if kind == "masked":
        eu = rng.standard_normal((n, S))
        eu[rng.random((n, S)) < 0.3] = -np.inf
        eu[:, 0] = np.where(np.isinf(eu).all(1), 0.0, eu[:, 0])
        return eu
    if kind == "tiny":
        return 1e-9 * rng.standard_normal((n, S))
    raise ValueError(kind)


def differentiable(eta_u):
    """Whether per-position sparsemax is differentiable at eta_u (no score at its
    position's threshold), so that central differences are the derivative."""
    for z in eta_u:
        fin = z[np.isfinite(z)]
        u = sparsemax(np.where(np.isfinite(z), z, -1e300))
        tau = (fin[u[np.isfinite(z)] > 0].sum() - 1) / (u > 0).sum()
        if np.any(np.abs(fin - tau) < 1e-6 * max(1.0, np.abs(fin).max())):
            return False
    return True


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["randn", "repeated_rows", "integers", "masked", "tiny"])
@pytest.mark.parametrize("n, S", [(2, 3), (6, 4), (30, 8)])
def test_jacobian_is_per_position_sparsemax(method, kind, n, S):
    rng = np.random.default_rng(n * 100 + S)
    eu = scores(kind, n, S, rng)
    f = sm.SequenceFactor(n, S)
    r = sm.solve(f, eu, method=method)
    J = np.zeros((n * S, n * S))
    JT = np.zeros((n * S, n * S))
    for j in range(n * S):
        e = np.zeros(n * S)
        e[j] = 1.0
        J[:, j] = r.jvp(e.reshape(n, S)).ravel()
        JT[j] = r.vjp(e.reshape(n, S))[0].ravel()
    ref = closed_form_jacobian(np.where(np.isfinite(eu), eu, -1e300))
    if kind == "integers":
        # ties at sparsemax's threshold (kinks): any support between the strict one and
        # the tags at the threshold gives an element of the generalized Jacobian
        strict = np.array([sparsemax(z) > 0 for z in eu])
        tau = np.array([(z[k].sum() - 1) / k.sum() for z, k in zip(eu, strict)])
        on = r.u > 0
        assert np.all(strict <= on) and np.all(on <= (eu >= tau[:, None] - 1e-9))
        ref = np.zeros((n * S, n * S))
        for i in range(n):
            k = on[i].astype(float)
            ref[i * S:(i + 1) * S, i * S:(i + 1) * S] = np.diag(k) - np.outer(k, k) / k.sum()
    np.testing.assert_allclose(J, ref, atol=1e-9)
    np.testing.assert_allclose(JT, ref, atol=1e-9)
    if kind != "integers" and differentiable(eu):
        # not at a kink of sparsemax: the closed form is the derivative
        h = 1e-7 * max(1.0, np.abs(eu[np.isfinite(eu)]).max())  # tiny: the support stays full
        fd = central_differences(np.where(np.isfinite(eu), eu, -1e300), h)
        np.testing.assert_allclose(J, fd, atol=1e-5)


def test_eta_v_part_stays_the_one_sided_limit():
    """Without eta_v, the eta_v part of jvp/vjp is still the piece along tie_direction:
    the one-sided derivative along (0, r), as with transitions passed as zeros."""
    n, S = 7, 4
    rng = np.random.default_rng(11)
    f = sm.SequenceFactor(n, S)
    eu = 0.2 * rng.standard_normal((n, S))
    r = tie_direction(f)
    for method in METHODS:
        res = sm.solve(f, eu, method=method)
        t = 1e-7
        near = sm.solve(f, eu, t * r, method=method)
        one_sided = (near.u - res.u) / t
        np.testing.assert_allclose(res.jvp(np.zeros((n, S)), r), one_sided, atol=1e-6)
        g = rng.standard_normal((n, S))
        gz = sm.solve(f, eu, np.zeros(f.shape_v), method=method).vjp(g)[1]
        np.testing.assert_allclose(res.vjp(g)[1], gz, atol=1e-10)


def test_batches_match_single_solves():
    rng = np.random.default_rng(2)
    f = sm.SequenceFactor(5, 4)
    etas = np.tile(0.3 * rng.standard_normal(4), (3, 5, 1)) + 0.01 * np.arange(3)[:, None, None]
    rs = sm.solve_batch(f, etas)
    gs = rng.standard_normal((3, 5, 4))
    for r, e, g, gv, du in zip(rs, etas, gs, sm.vjp_batch(rs, gs), sm.jvp_batch(rs, gs)):
        ref = closed_form_jacobian(e)
        np.testing.assert_allclose(gv[0].ravel(), ref @ g.ravel(), atol=1e-12)
        np.testing.assert_allclose(du.ravel(), ref @ g.ravel(), atol=1e-12)
        np.testing.assert_array_equal(gv[0], sm.solve(f, e).vjp(g)[0])


@pytest.mark.parametrize("method", METHODS + ["pairwise_cg"])
def test_torch_layer(method):
    rng = np.random.default_rng(4)
    n, S, B = 6, 4, 3
    f = sm.SequenceFactor(n, S)
    etas = np.tile(0.3 * rng.standard_normal(S), (B, n, 1))
    g = rng.standard_normal((B, n, S))
    x = torch.tensor(etas, requires_grad=True)
    u = smt.sparsemap(f, x, method=method)
    (u * torch.tensor(g)).sum().backward()
    for b in range(B):
        ref = closed_form_jacobian(etas[b])
        np.testing.assert_allclose(x.grad[b].numpy().ravel(), ref @ g[b].ravel(), atol=1e-9)
    # forward mode
    from torch.autograd.forward_ad import dual_level, make_dual, unpack_dual
    with dual_level():
        t = unpack_dual(smt.sparsemap(f, make_dual(torch.tensor(etas), torch.tensor(g)),
                                      method=method)).tangent
    for b in range(B):
        np.testing.assert_allclose(t[b].numpy().ravel(), closed_form_jacobian(etas[b]) @ g[b].ravel(),
                                   atol=1e-9)
    # ragged: two factors, the second shorter
    fs = [f, sm.SequenceFactor(n - 2, S)]
    x = torch.tensor(etas[:2], requires_grad=True)
    (smt.sparsemap(fs, x, method=method) * torch.tensor(g[:2])).sum().backward()
    ref = closed_form_jacobian(etas[1, :n - 2]) @ g[1, :n - 2].ravel()
    np.testing.assert_allclose(x.grad[1, :n - 2].numpy().ravel(), ref, atol=1e-9)
    assert np.all(x.grad[1, n - 2:].numpy() == 0)


def test_torch_backward_refuses_a_nonfinite_gradient():
    """Per-position sparsemax in the torch layer checks the incoming gradient as every
    other backward pass does, also when no problem has transitions."""
    x = torch.zeros(2, 4, 3, dtype=torch.float64, requires_grad=True)
    u = smt.sparsemap(sm.SequenceFactor(4, 3), x)
    g = torch.zeros_like(u)
    g[1, 2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"the gradient of u: contains non-finite .*batch element 1"):
        u.backward(g)
