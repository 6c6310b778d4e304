"""Every warning sparsemap issues points at the user's line: the file and line of the call
that led to it, whatever lies between (sparsemap's own Python frames, compiled functions,
torch's autograd machinery, whose depth changes between torch versions, worker threads).
"""
import sys
import warnings

import numpy as np
import pytest
import torch

import sparsemap as sm
import sparsemap.torch as smt
from test_factor_graph import make


def next_line():
    """The line after the caller's."""
    return sys._getframe(1).f_lineno + 1


def check(record, line, n=1):
    """n ConvergenceWarnings, all at line `line` of this file."""
    assert [w.category for w in record] == [sm.ConvergenceWarning] * n
    assert [(w.filename, w.lineno) for w in record] == [(__file__, line)] * n


def hard_tree(seed=0, n=12, B=None):
    rng = np.random.default_rng(seed)
    return sm.TreeFactor(n), rng.standard_normal((n + 1, n + 1) if B is None else
                                                (B, n + 1, n + 1))


def test_solve():
    f, eta = hard_tree()
    for method in ("auto", "cg"):
        with pytest.warns(sm.ConvergenceWarning) as record:
            line = next_line()
            sm.solve(f, eta, method=method, max_iter=1)
        check(record, line)


def test_solve_batch_in_threads():
    f, etas = hard_tree(B=3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = next_line()
        sm.solve_batch(f, etas, method="vertex", max_iter=1, n_jobs=2)
    check(record, line, 3)


def test_losses():
    f, eta = hard_tree()
    target = f.map(np.zeros_like(eta))
    with pytest.warns(sm.ConvergenceWarning) as record:
        line = next_line()
        sm.sparsemap_loss(f, eta, target, max_iter=1)
    check(record, line)


class _InexactBackward:
    """A result's engine whose backward conjugate gradient reports a large residual."""

    def __init__(self, engine):
        self.engine = engine

    def project(self, g):
        y, n_cg, _ = self.engine.project(g)
        return y, n_cg, 1e-3

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_factor_graph_backward():
    fg, _, eta_u, eta_v, _ = make("tree_budgets", 0)
    r = fg.solve(eta_u, eta_v)
    r._engine = _InexactBackward(r._engine)
    g = np.ones(fg.n_variables)
    for product in (r.vjp, r.jvp):
        with pytest.warns(sm.ConvergenceWarning, match="backward conjugate gradient") as record:
            line = next_line()
            product(g)
        check(record, line)


# -- through torch's autograd: Function.apply, and the engine running the backward pass ------

def test_torch_sparsemap():
    f, eta = hard_tree(B=2)
    eta = torch.tensor(eta, requires_grad=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = next_line()
        smt.sparsemap(f, eta, method="vertex", max_iter=1)
    check(record, line, 2)


def test_torch_factor_graph_backward():
    fg, _, eta_u, eta_v, _ = make("tree_budgets", 0)
    eta = torch.tensor(eta_u, requires_grad=True)
    u = smt.factor_graph(fg, eta)
    results = u.grad_fn.jac.results
    results[0]._engine = _InexactBackward(results[0]._engine)
    with pytest.warns(sm.ConvergenceWarning, match="backward conjugate gradient") as record:
        line = next_line()
        u.sum().backward()
    check(record, line)


def test_factor_graph_solve_map():
    fg, _, eta_u, eta_v, _ = make("tree_budgets", 0)
    with pytest.warns(sm.ConvergenceWarning) as record:
        line = next_line()
        fg.solve_map(eta_u, eta_v, max_iter=1)
    check(record, line)
