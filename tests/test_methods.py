"""Method names say what runs: "auto" (the default), "vertex", "facet", and the old
spelling "active_set" (the vertex side now, with a FutureWarning); why a forced facet
side fell back."""
import pickle
import warnings

import numpy as np
import pytest

import sparsemap as sm


def flat_tree(n=30, seed=0):
    return sm.TreeFactor(n), 0.01 * np.random.default_rng(seed).standard_normal((n + 1, n + 1))


def test_default_is_auto_and_reports_the_side():
    f, eta = flat_tree()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = sm.solve(f, eta)
        explicit = sm.solve(f, eta, method="auto")
    assert r.method == "auto" and r.side == "facet"
    assert repr(r).startswith("SparseMAPResult(method='auto', side='facet', converged=True")
    assert np.array_equal(r.u, explicit.u)


def test_active_set_runs_the_vertex_side_and_warns_at_the_caller():
    f, eta = flat_tree()
    with pytest.warns(FutureWarning, match="method='auto'") as record:
        r = sm.solve(f, eta, method="active_set")
    assert [w.filename for w in record] == [__file__]
    v = sm.solve(f, eta, method="vertex")
    assert r.method == "active_set" and r.side == "vertex"
    assert "support=" in repr(r)
    # the same solver: bitwise the same answer and support
    assert np.array_equal(r.u, v.u) and r.n_iter == v.n_iter
    # the old behaviour, for those who pass "auto"
    assert sm.solve(f, eta, method="auto").side == "facet"


def test_active_set_in_batches_and_losses():
    f, eta = flat_tree()
    with pytest.warns(FutureWarning):
        rs = sm.solve_batch(f, np.stack([eta, eta]), method="active_set", n_jobs=1)
    assert [r.side for r in rs] == ["vertex", "vertex"]
    target = f.map(eta)
    with pytest.warns(FutureWarning):
        old = sm.sparsemap_loss(f, eta, target, method="active_set")
    vertex = sm.sparsemap_loss(f, eta, target, method="vertex")
    auto = sm.sparsemap_loss(f, eta, target, method="auto")
    # "active_set" runs the vertex side itself (the same bits); u is unique, so the
    # other side, which "auto" takes at these flat scores, agrees up to round-off
    assert old[0] == vertex[0]
    np.testing.assert_array_equal(old[1], vertex[1])
    assert old[0] == pytest.approx(auto[0], abs=1e-12)
    np.testing.assert_allclose(old[1], auto[1], atol=1e-12)


def test_unknown_method_names_the_choices():
    f, eta = flat_tree(5)
    with pytest.raises(ValueError, match=r"method: expected one of \('auto', 'vertex'"):
        sm.solve(f, eta, method="exact")
    with pytest.raises(ValueError, match="init: warm starts are supported by the exact"):
        sm.solve(f, eta, method="cg", init=[f.map(eta)])


def peaked_tree():
    return sm.TreeFactor(20), 5 * np.random.default_rng(0).standard_normal((21, 21))


def test_forced_facet_says_why_it_fell_back_budget():
    # peaked scores need tens of projection passes; 10 are not enough
    f, eta = peaked_tree()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = sm.solve(f, eta, method="facet", max_iter=10)
    assert r.side == "vertex" and r.converged
    assert r.message.startswith("converged; the facet solver spent its budget of")
    assert "so the vertex side solved it" in r.message
    # the reason travels with the result
    assert pickle.loads(pickle.dumps(r)).message == r.message
    # with a budget large enough, the same problem stays on the facet side
    assert sm.solve(f, eta, method="facet").side == "facet"


def test_forced_facet_says_why_it_fell_back_decline():
    # spread transitions on a long sequence: the homotopy's pieces, estimated from the
    # scores, exceed twice the budget, and the solver declines before any piece
    rng = np.random.default_rng(0)
    f = sm.SequenceFactor(60, 17)
    eu, ev = rng.standard_normal((60, 17)), rng.standard_normal((59, 17, 17))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sm.ConvergenceWarning)
        r = sm.solve(f, eu, ev, method="facet", max_iter=100)
    assert r.side == "vertex"
    assert "; the facet solver declined after 0 iterations" in r.message


def test_auto_does_not_call_its_choice_a_fallback():
    f, eta = peaked_tree()
    r = sm.solve(f, eta)
    assert r.side == "vertex" and r.message == "converged"


def test_torch_info_names_the_fallback():
    import torch
    import sparsemap.torch as smt
    f, eta = peaked_tree()
    flat = flat_tree(20)[1]
    scores = torch.tensor(np.stack([eta, flat]))
    _, info = smt.tree(scores, return_info=True, method="facet", max_iter=10)
    assert info.facet.tolist() == [False, True]
    assert [info.FALLBACKS[k] for k in info.fallback] == ["budget", "none"]
    with pytest.warns(FutureWarning):
        _, info = smt.tree(scores, return_info=True, method="active_set")
    assert info.facet.tolist() == [False, False]
