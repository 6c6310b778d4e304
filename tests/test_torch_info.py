"""sparsemap.torch's ``return_info=True``: what the solver did, per batch element, without
a new solve; and how the layer's warnings name a batch element.

The report is checked against sm.solve on each element (the layer's contract is to
equal it), and its support sizes against closed forms that do not run the solver:
sparsemax's support (the projection onto the simplex) and a tree that wins outright.
"""
import warnings

import numpy as np
import pytest
import torch

import sparsemap as sm
import sparsemap._solve
import sparsemap.torch as smt
from _reference import sparsemax


def expected(factors, blocks, **solve_kw):
    """The SolveInfo fields that sm.solve gives on each block."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sm.ConvergenceWarning)
        rs = [sm.solve(f, e, **solve_kw) for f, e in zip(factors, blocks)]
    codes = {"converged": 0, "max_iter": 1, "stalled": 2}
    status = [0 if r.converged else codes["max_iter" if "maximum" in r.message else "stalled"]
              for r in rs]
    # the facet side holds no structures: -1, not the size of a decomposition
    return ([-1 if r.side == "facet" else len(r.structures) for r in rs],
            [r.n_iter for r in rs], status, [r.gap for r in rs],
            [r.side == "facet" for r in rs])


DTYPES = {"gap": torch.float64, "facet": torch.bool}


def assert_info(info, want, shape):
    assert isinstance(info, smt.SolveInfo)
    for field, values in zip(("support_size", "n_iter", "status", "gap", "facet"), want):
        t = getattr(info, field)
        assert t.shape == shape, field
        assert t.dtype == DTYPES.get(field, torch.int64), field
        assert t.reshape(-1).tolist() == values, field     # bitwise: the same solves
    assert torch.equal(info.converged, info.status == 0)


def test_tree_info_per_sentence_equals_solve():
    lengths = torch.tensor([[5, 2, 7], [1, 7, 4]])
    scores = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0),
                         dtype=torch.float64)
    u, info = smt.tree(scores, lengths, single_root=True, return_info=True)
    assert torch.equal(u, smt.tree(scores, lengths, single_root=True))
    flat = lengths.reshape(-1).tolist()
    factors = [sm.TreeFactor(n, single_root=True) for n in flat]
    blocks = [scores.reshape(6, 8, 8)[b, :n + 1, :n + 1].numpy() for b, n in enumerate(flat)]
    assert_info(info, expected(factors, blocks), (2, 3))
    assert torch.equal(info.support_size == -1, info.facet)
    assert (info.support_size[~info.facet] >= 1).all() and info.converged.all()


@pytest.mark.parametrize("layer", ["sparsemap", "sequence", "matching"])
def test_shared_factor_info_has_the_batch_shape(layer):
    rng = np.random.default_rng(1)
    if layer == "sequence":
        f = sm.SequenceFactor(4, 3)
        eta = rng.standard_normal((2, 2, 4, 3))
        u, info = smt.sequence(torch.tensor(eta), return_info=True)
    elif layer == "matching":
        f = sm.MatchingFactor(3, 3)
        eta = rng.standard_normal((2, 2, 3, 3))
        u, info = smt.matching(torch.tensor(eta), return_info=True)
    else:
        f = sm.TreeFactor(4)
        eta = rng.standard_normal((2, 2, 5, 5))
        u, info = smt.sparsemap(f, torch.tensor(eta), return_info=True)
    blocks = list(eta.reshape((4,) + eta.shape[2:]))
    assert_info(info, expected([f] * 4, blocks), (2, 2))


def test_sparsemax_support_size_is_the_closed_forms():
    x = torch.tensor([[1.0, 0.5, -1.0, 0.9], [0.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.1, 0.2]],
                     dtype=torch.float64)
    for dim in (0, 1):
        p, info = smt.sparsemax(x, dim=dim, return_info=True)
        rows = x.movedim(dim, -1).numpy()
        assert info.support_size.tolist() == [int((sparsemax(r) > 0).sum()) for r in rows]
        assert info.support_size.shape == rows.shape[:-1]
    assert info.support_size.tolist() == [3, 4, 1]


def test_a_tree_that_wins_outright_has_support_one():
    scores = torch.zeros(1, 5, 5)
    for m in range(1, 5):
        scores[0, m - 1, m] = 10.0                     # the chain 0 -> 1 -> 2 -> 3 -> 4
    _, info = smt.tree(scores, return_info=True)
    assert info.support_size.tolist() == [1] and info.converged.all()


def test_not_converged_status_and_warnings_name_the_same_batch_elements():
    scores = torch.randn(2, 3, 21, 21, generator=torch.Generator().manual_seed(2),
                         dtype=torch.float64)
    lengths = torch.tensor([[20, 2, 20], [1, 20, 3]])
    with pytest.warns(sm.ConvergenceWarning) as record:
        _, info = smt.tree(scores, lengths, max_iter=2, return_info=True)
    named = sorted(str(w.message).split(":")[0] for w in record)
    stuck = [tuple(i) for i in (~info.converged).nonzero().tolist()]
    assert named == sorted(f"batch element {i}" for i in stuck)
    assert (info.status[~info.converged] == smt.SolveInfo.STATUSES.index("max_iter")).all()
    assert (info.n_iter <= 2).all()
    assert all(smt.SolveInfo.STATUSES[k] in ("converged", "max_iter")
               for k in info.status.reshape(-1).tolist())


def test_general_path_info_equals_solve():
    # a conditional-gradient method goes through solve_batch on the blocks
    rng = np.random.default_rng(3)
    f = sm.TreeFactor(4)
    eta = rng.standard_normal((3, 5, 5))
    kw = dict(method="pairwise_cg", max_iter=500, tol=1e-8)
    _, info = smt.sparsemap(f, torch.tensor(eta), return_info=True, **kw)
    assert_info(info, expected([f] * 3, list(eta), **kw), (3,))


def test_info_is_read_from_the_forward_solve(monkeypatch):
    calls = []
    prepare = sparsemap._solve._batch.prepare_solve

    def counted(*args, **kwargs):
        calls.append(1)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(sparsemap._solve._batch, "prepare_solve", counted)
    monkeypatch.setattr(sparsemap._solve, "_solve_problems", None)   # no NumPy re-solve
    scores = torch.randn(4, 6, 6, generator=torch.Generator().manual_seed(4))
    u, info = smt.tree(scores, torch.tensor([5, 3, 4, 2]), return_info=True)
    assert len(calls) == 1 and info.support_size.shape == (4,)


def test_info_of_an_empty_batch_and_bad_flag():
    u, info = smt.tree(torch.zeros(0, 4, 4), return_info=True)
    assert u.shape == (0, 4, 4) and info.n_iter.shape == (0,)
    with pytest.raises(ValueError, match="return_info"):
        smt.tree(torch.zeros(1, 4, 4), return_info="yes")
    assert isinstance(smt.tree(torch.zeros(1, 4, 4)), torch.Tensor)


def test_warnings_and_errors_use_one_name():
    """Errors and warnings of the layer and of solve_batch say ``batch element i``."""
    f = sm.TreeFactor(20)
    etas = np.random.default_rng(5).standard_normal((2, 21, 21))
    with pytest.warns(sm.ConvergenceWarning) as record:
        sm.solve_batch(f, etas, max_iter=2)
    assert [str(w.message).split(":")[0] for w in record] == ["batch element 0",
                                                              "batch element 1"]
    bad = torch.zeros(2, 3, 21, 21)
    bad[1, 2, 4, 5] = float("nan")
    with pytest.raises(ValueError, match=r"\(batch element \(1, 2\)\)"):
        smt.tree(bad, torch.full((2, 3), 20))


@pytest.mark.parametrize("layer", ["tree", "sequence", "matching"])
def test_facet_side_info(layer):
    """Forced onto the facet side, the report says so, with support size -1 (no
    structures are held), the facet solver's iterations and a certified gap; ``u``
    is the vertex side's (an independent solver)."""
    rng = np.random.default_rng(6)
    if layer == "tree":
        eta, f = rng.standard_normal((3, 7, 7)), sm.TreeFactor(6)
        call = lambda e, **kw: smt.tree(e, **kw)                        # noqa: E731
    elif layer == "sequence":
        eta, f = rng.standard_normal((3, 6, 4)), sm.SequenceFactor(6, 4)
        call = lambda e, **kw: smt.sequence(e, **kw)                    # noqa: E731
    else:
        eta, f = rng.standard_normal((3, 4, 5)), sm.MatchingFactor(4, 5)
        call = lambda e, **kw: smt.matching(e, **kw)                    # noqa: E731
    u, info = call(torch.tensor(eta), method="facet", return_info=True)
    assert_info(info, expected([f] * 3, list(eta), method="facet"), (3,))
    assert info.facet.all() and (info.support_size == -1).all() and info.converged.all()
    assert (info.n_iter >= 1).all()
    rs = [sm.solve(f, e, method="vertex") for e in eta]
    # the gap bounds the objective's excess over the vertex side's certified optimum
    excess = [sm.solve(f, e, method="facet").objective - r.objective for r, e in zip(rs, eta)]
    assert all(-1e-9 < x <= g + 1e-9 for x, g in zip(excess, info.gap.tolist()))
    np.testing.assert_allclose(u.numpy(), np.stack([r.u for r in rs]), atol=1e-9)
    _, vertex = call(torch.tensor(eta), method="vertex", return_info=True)
    assert not vertex.facet.any() and (vertex.support_size >= 1).all()
