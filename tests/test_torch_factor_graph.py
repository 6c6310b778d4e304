"""sparsemap.torch.factor_graph: the LP-SparseMAP layer.

Derivatives are checked by finite differences (torch.autograd.gradcheck, float64; the
solves are polished, so exact up to round-off), values and Jacobian products against
FactorGraph.solve / FactorGraphResult.vjp / .jvp element by element. The graphs are
those of test_factor_graph.py (checked there against an independent QP): budgets and
xors with a degree-0 variable, pair cycles with eta_v, a tree with budgets, a
sequence with a budget, negations, or-out / and-out, a matching, a sequence budget.
"""
import warnings

import numpy as np
import pytest
import torch

import sparsemap as sm
import sparsemap.torch as smt
from test_factor_graph import GRAPHS, make

# Central differences of a piecewise-linear map are exact up to the solver's round-off.
GC = dict(eps=1e-6, atol=1e-7, rtol=1e-6)
NAMES = sorted(GRAPHS)


def graph(name, seed=0):
    """(FactorGraph, eta_u tensor, eta_v list of tensors / None), float64, requiring grad."""
    fg, _, eta_u, eta_v, _ = make(name, seed)
    eu = torch.tensor(eta_u, dtype=torch.float64, requires_grad=True)
    ev = None if eta_v is None else [
        None if e is None else torch.tensor(np.asarray(e), dtype=torch.float64,
                                            requires_grad=True) for e in eta_v]
    return fg, eu, ev


def as_numpy(ev):
    return None if ev is None else [None if e is None else e.detach().numpy() for e in ev]


def v_tensors(ev):
    return [] if ev is None else [e for e in ev if e is not None]


def rebuild(ev, ts):
    """The eta_v list of ``ev`` with its tensors replaced, in order, by ``ts``."""
    if ev is None:
        return None
    it = iter(ts)
    return [None if e is None else next(it) for e in ev]


def test_graphs_cover_the_brief():
    kinds = {type(f).__name__ for name in NAMES for f in make(name, 0)[0].factors}
    assert {"BudgetFactor", "XorFactor", "AtMostOneFactor", "PairFactor", "OrOutFactor",
            "TreeFactor", "SequenceFactor", "SequenceBudgetFactor"} <= kinds
    assert any(np.any(n) for name in NAMES for n in make(name, 0)[0].negated)
    fg = make("budgets_xors", 0)[0]
    assert 7 not in np.concatenate([v.ravel() for v in fg.variables])   # degree 0


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_plain(name):
    fg, eu, ev = graph(name)
    r = fg.solve(eu.detach().numpy(), as_numpy(ev))
    assert r.converged and r.polished

    def fn(eu, *vs):
        return smt.factor_graph(fg, eu, rebuild(ev, vs))

    assert torch.autograd.gradcheck(fn, (eu, *v_tensors(ev)), **GC)


@pytest.mark.parametrize("name", ["budgets_xors", "pair_cycle", "sequence_budget",
                                  "negations"])
def test_gradcheck_batched_with_per_element_and_shared_eta_v(name):
    fg, eu, ev = graph(name)
    g = torch.Generator().manual_seed(1)
    eub = (eu.detach() + 0.3 * torch.randn(2, 3, eu.shape[0], generator=g,
                                            dtype=torch.float64)).requires_grad_()
    # per element (batch dims) for the first eta_v tensor, shared (factor.shape_v) after
    vs = [(e.detach() + 0.3 * torch.randn((2, 3) + e.shape, generator=g,
                                          dtype=torch.float64)) if k == 0 else e.detach()
          for k, e in enumerate(v_tensors(ev))]
    vs = [v.requires_grad_() for v in vs]

    def fn(eu, *vs):
        return smt.factor_graph(fg, eu, rebuild(ev, vs))

    assert torch.autograd.gradcheck(fn, (eub, *vs), **GC)


def test_one_parameter_shared_by_factors_and_batch():
    """The same eta_v tensor for every pair factor and every batch element: its gradient
    is the sum of the per-factor, per-element gradients of FactorGraphResult.vjp."""
    fg, eu, ev = graph("pair_cycle")
    eub = torch.stack([eu.detach(), eu.detach().flip(0)]).requires_grad_()
    c = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda eu, c: smt.factor_graph(fg, eu, [c] * len(ev)),
                                    (eub, c), **GC)
    gu = torch.linspace(-1, 1, eub.numel(), dtype=torch.float64).reshape(eub.shape)
    smt.factor_graph(fg, eub, [c] * len(ev)).backward(gu)
    want = 0.0
    for b in range(2):
        r = fg.solve(eub.detach()[b].numpy(), [np.array([0.3])] * len(ev))
        want += sum(g.sum() for g in r.vjp(gu[b].numpy())[1])
    assert c.grad.item() == pytest.approx(want, abs=1e-12)


def ragged_batch():
    names = ["tree_budgets", "budgets_xors", "pair_cycle", "sequence_budget"]
    parts = [graph(n) for n in names]
    graphs = [p[0] for p in parts]
    V = max(g.n_variables for g in graphs)
    eu = torch.full((len(parts), V), float("nan"), dtype=torch.float64)  # padding: never read
    for b, (g, e, _) in enumerate(parts):
        eu[b, :g.n_variables] = e.detach()
    evs = [p[2] for p in parts]
    return graphs, eu.requires_grad_(), evs


def test_gradcheck_ragged():
    graphs, eu, evs = ragged_batch()
    flat = [t for ev in evs for t in v_tensors(ev)]
    sizes = [len(v_tensors(ev)) for ev in evs]

    def fn(eu, *ts):
        ts, out = list(ts), []
        for ev, k in zip(evs, sizes):
            out.append(rebuild(ev, ts[:k]))
            ts = ts[k:]
        u = smt.factor_graph(graphs, eu, out)
        return u.nan_to_num(0.0)    # (nothing to replace: checked below)

    eu0 = eu.detach().nan_to_num(0.25).requires_grad_()
    assert torch.autograd.gradcheck(fn, (eu0, *flat), **GC)
    u = smt.factor_graph(graphs, eu, evs)
    assert not torch.isnan(u).any()
    u.sum().backward()
    for b, g in enumerate(graphs):
        assert (u[b, g.n_variables:] == 0).all()
        assert (eu.grad[b, g.n_variables:] == 0).all()


def test_elements_equal_factor_graph_solve_vjp_and_jvp():
    graphs, eu, evs = ragged_batch()
    g = torch.Generator().manual_seed(2)
    gu = torch.randn(eu.shape, generator=g, dtype=torch.float64)
    for n_jobs in (1, 2):
        for e in [eu] + [t for ev in evs for t in v_tensors(ev)]:
            e.grad = None
        u = smt.factor_graph(graphs, eu, evs, n_jobs=n_jobs)
        u.backward(gu)
        for b, fg in enumerate(graphs):
            V = fg.n_variables
            r = fg.solve(eu.detach()[b, :V].numpy(), as_numpy(evs[b]))
            np.testing.assert_array_equal(u.detach()[b, :V].numpy(), r.u)
            g_u, g_v = r.vjp(gu[b, :V].numpy())
            np.testing.assert_array_equal(eu.grad[b, :V].numpy(), g_u)
            for f, e in enumerate(evs[b] or []):
                if e is not None:
                    np.testing.assert_array_equal(e.grad.numpy(), g_v[f])
    # forward mode: tangents of eta_u and of every eta_v tensor
    import torch.autograd.forward_ad as fwAD
    tangents = [torch.randn(t.shape, generator=g, dtype=torch.float64)
                for ev in evs for t in v_tensors(ev)]
    d_u = torch.randn(eu.shape, generator=g, dtype=torch.float64)
    with fwAD.dual_level():
        duals = iter([fwAD.make_dual(t.detach(), d) for t, d in
                      zip([t for ev in evs for t in v_tensors(ev)], tangents)])
        dual_evs = [None if ev is None else [None if e is None else next(duals) for e in ev]
                    for ev in evs]
        out = smt.factor_graph(graphs, fwAD.make_dual(eu.detach(), d_u), dual_evs)
        du = fwAD.unpack_dual(out).tangent
    it = iter(tangents)
    for b, fg in enumerate(graphs):
        V = fg.n_variables
        r = fg.solve(eu.detach()[b, :V].numpy(), as_numpy(evs[b]))
        d_v = None if evs[b] is None else [None if e is None else next(it).numpy()
                                           for e in evs[b]]
        np.testing.assert_array_equal(du[b, :V].numpy(), r.jvp(d_u[b, :V].numpy(), d_v))
        assert (du[b, V:] == 0).all()


@pytest.mark.parametrize("name", ["pair_cycle", "tree_budgets"])
def test_double_backward_and_forward_mode(name):
    """The backward pass is the fixed linear map J^T: its own derivative is J (double
    backward, checked by gradgradcheck), and forward mode applies J."""
    fg, eu, ev = graph(name)

    def fn(eu, *vs):
        return smt.factor_graph(fg, eu, rebuild(ev, vs))

    inputs = (eu, *v_tensors(ev))
    assert torch.autograd.gradgradcheck(fn, inputs, **GC)
    assert torch.autograd.gradcheck(fn, inputs, check_forward_ad=True, **GC)
    # the gradient of a linear function of u is J^T w, constant in the scores
    u = fn(*inputs)
    g = torch.autograd.grad(u @ torch.linspace(-1, 1, u.shape[0], dtype=torch.float64), eu,
                            create_graph=True)[0]
    assert not g.requires_grad
    # and of a quadratic one, J^T u: its derivative J^T J = J (a projector) applied
    u = fn(*inputs)
    g = torch.autograd.grad((u ** 2).sum() / 2, eu, create_graph=True)[0]
    w = torch.linspace(-1, 1, u.shape[0], dtype=torch.float64)
    (h,) = torch.autograd.grad(g @ w, eu)
    r = fg.solve(eu.detach().numpy(), as_numpy(ev))
    np.testing.assert_allclose(h.numpy(), r.vjp(w.numpy())[0], rtol=0, atol=1e-12)


def test_degree_zero_variable():
    """Variables in no factor: u = clip(eta, 0, 1), gradient 1 inside (0, 1), 0 outside."""
    fg = sm.FactorGraph(5)
    fg.add(sm.XorFactor(2), [0, 1])
    eu = torch.tensor([0.3, 0.1, -0.5, 0.4, 1.7], dtype=torch.float64, requires_grad=True)
    u = smt.factor_graph(fg, eu)
    assert u.detach().tolist()[2:] == [0.0, 0.4, 1.0]
    u[2:].sum().backward()
    assert eu.grad.tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]


def test_dtypes_and_empty_batch():
    fg, eu, ev = graph("pair_cycle")
    u64 = smt.factor_graph(fg, eu, ev)
    e32 = eu.detach().float().requires_grad_()
    v32 = [e.detach().float().requires_grad_() for e in ev]
    u32 = smt.factor_graph(fg, e32, v32)
    assert u32.dtype == torch.float32
    torch.testing.assert_close(u32.double(), u64, rtol=0, atol=1e-6)
    u32.sum().backward()
    assert e32.grad.dtype == torch.float32 and all(v.grad.dtype == torch.float32 for v in v32)
    e16 = eu.detach().to(torch.bfloat16)
    assert smt.factor_graph(fg, e16).dtype == torch.bfloat16
    empty = torch.zeros(0, fg.n_variables, requires_grad=True)
    out = smt.factor_graph(fg, empty, [torch.zeros(0, 1)] * len(ev))
    assert out.shape == (0, fg.n_variables)
    out.sum().backward()
    assert empty.grad.shape == empty.shape


def test_convergence_error_names_the_batch_element():
    fg, eu, _ = graph("tree_budgets")
    with pytest.raises(sm.ConvergenceError, match="^batch element 0: "):
        smt.factor_graph(fg, torch.stack([eu.detach()] * 2), max_iter=1, polish=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        smt.factor_graph(fg, eu)


def test_the_graph_is_read_at_call_time():
    """Factors added after the forward pass change neither u nor its gradient."""
    fg = sm.FactorGraph(3)
    fg.add(sm.XorFactor(2), [0, 1])
    eu = torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64, requires_grad=True)
    u = smt.factor_graph(fg, eu)
    fg.add(sm.AtMostOneFactor(2), [1, 2])
    u[2].backward()
    assert eu.grad.tolist() == [0.0, 0.0, 1.0]


def test_bad_input_raises_value_error_naming_the_argument():
    fg, eu, ev = graph("pair_cycle")       # 5 variables, 6 pair factors with eta_v (1,)
    x = eu.detach()
    cases = [
        (lambda: smt.factor_graph("fg", x), r"^graph: expected a sparsemap.FactorGraph"),
        (lambda: smt.factor_graph([], x), r"^graph: expected at least one"),
        (lambda: smt.factor_graph([fg, 3], x[None].repeat(2, 1)), r"^graph\[1\]"),
        (lambda: smt.factor_graph(fg, x.numpy()), r"^eta_u: expected a torch.Tensor"),
        (lambda: smt.factor_graph(fg, x.long()), r"^eta_u: expected a floating-point"),
        (lambda: smt.factor_graph(fg, x[:4]), r"^eta_u: expected shape \(\*batch, 5\)"),
        (lambda: smt.factor_graph([fg, fg], x), r"^eta_u: with a list of 2 graphs"),
        (lambda: smt.factor_graph([fg], torch.zeros(1, 4)), r"^eta_u: graph\[0\] has 5"),
        # the message of the NumPy path (sparsemap._checks), word for word
        (lambda: smt.factor_graph(fg, x, ev[:3]), r"^eta_v: expected a list with one entry "
                                                  r"per factor \(6\), got length 3$"),
        (lambda: smt.factor_graph(fg, x, torch.zeros(6, 1)), r"^eta_v: expected a list"),
        (lambda: smt.factor_graph(fg, x, [torch.zeros(2)] + [None] * 5),
         r"^eta_v\[0\]: expected shape \(1,\)"),
        (lambda: smt.factor_graph(fg, x[None].repeat(2, 1), [torch.zeros(3, 1)] + [None] * 5),
         r"^eta_v\[0\]: expected shape \(2, 1\) .* or \(1,\) \(shared by the batch\)"),
        (lambda: smt.factor_graph(fg, x, [np.zeros(1)] + [None] * 5),
         r"^eta_v\[0\]: expected a torch.Tensor"),
        (lambda: smt.factor_graph([fg], x[None], [[None] * 5]), r"^eta_v\[0\]: expected a list"),
        (lambda: smt.factor_graph([fg], x[None], [None, None]), r"^eta_v: with a list of 1"),
        (lambda: smt.factor_graph(fg, x.clone().index_fill_(0, torch.tensor([2]), float("nan"))),
         r"^eta_u"),
        (lambda: smt.factor_graph(fg, torch.stack([x, x.clone().fill_(float("inf"))])),
         r"^eta_u.*\(batch element 1\)"),
        (lambda: smt.factor_graph(fg, x, n_jobs=0), r"^n_jobs"),
        (lambda: smt.factor_graph(fg, x, method="cg"), r"^method: not an option of "
                                                       r"FactorGraph.solve"),
        (lambda: smt.factor_graph(fg, x, rho=-1.0), r"^rho"),
    ]
    xor = sm.FactorGraph(2)
    xor.add(sm.XorFactor(2), [0, 1])
    cases.append((lambda: smt.factor_graph(xor, x[:2], [torch.zeros(0)]),
                  r"^eta_v\[0\]: factor 0 \(XorFactor\(2\)\) has no additional scores"))
    for call, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            call()


def test_default_n_jobs_of_the_graph_layer_for_oracles(monkeypatch):
    """A graph holding an OracleFactor runs its batch in the calling thread by default
    (the oracle's callbacks hold the GIL, so threads could only slow it), forward and
    backward; an explicit n_jobs is kept."""
    import threading

    from sparsemap import _solve
    from test_batch import _thread_recording_oracle
    monkeypatch.setattr(_solve, "_default_jobs", lambda: 4)   # as on a 4-core machine
    seen = set()
    fg = sm.FactorGraph(6)
    fg.add(_thread_recording_oracle(4, seen), [0, 1, 2, 3])
    fg.add(_thread_recording_oracle(4, seen), [2, 3, 4, 5])
    x = torch.randn(16, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)
    smt.factor_graph(fg, x).sum().backward()
    assert seen == {threading.get_ident()}
    seen.clear()
    smt.factor_graph(fg, x.detach(), n_jobs=4)
    assert len(seen) > 1


def test_infeasible_element_is_named():
    """A ragged batch whose element 1 has more Xor rows than AtMostOne columns."""
    graphs = []
    for m in (2, 3, 2):
        g = sm.FactorGraph()
        x = g.add_variables((m, 2))
        for i in range(m):
            g.add(sm.XorFactor(2), x[i])
        for j in range(2):
            g.add(sm.AtMostOneFactor(m), x[:, j])
        graphs.append(g)
    eta = torch.randn(3, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^batch element 1: FactorGraph.solve: infeasible") \
            as info:
        smt.factor_graph(graphs, eta)
    assert info.value.batch_element == 1 and info.value.factors == [0, 1, 2, 3, 4]
