"""solve(callback=..., verbose=...): per-iteration figures, stopping, progress lines."""
import warnings

import numpy as np
import pytest

import sparsemap as sm
from sparsemap._solve import METHODS

RNG = np.random.default_rng(3)
TREE = sm.TreeFactor(8)
ETA = RNG.standard_normal((9, 9))


def _collect(method, **kw):
    seen = []
    r = sm.solve(TREE, ETA, method=method, callback=seen.append, return_history=True, **kw)
    return r, seen


@pytest.mark.parametrize("method", METHODS)
def test_callback_sees_every_iteration_and_changes_nothing(method):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sm.ConvergenceWarning)   # vanilla CG at max_iter
        r, seen = _collect(method, max_iter=200)
        plain = sm.solve(TREE, ETA, method=method, max_iter=200)
    assert np.array_equal(plain.u, r.u) and plain.n_iter == r.n_iter
    its = [info.n_iter for info in seen]
    if r.side == "facet":
        # one record: the solution (the facet side's iterates are not feasible points)
        assert its == [r.n_iter] and r.history["objective"].shape == (1,)
    else:
        assert its == list(range(1, len(its) + 1))
    h = r.history
    for k, info in enumerate(seen):
        # the iterate's figures, computed independently from its u
        u = info.u
        assert u.shape == TREE.shape_u
        assert info.objective == pytest.approx(0.5 * np.sum(u * u) - np.sum(ETA * u), abs=1e-12)
        assert info.objective == pytest.approx(h["objective"][k], abs=1e-12)
        assert info.support_size == h["support_size"][k]
        assert info.gap >= -1e-12 and info.seconds >= 0
    if method in ("auto", "vertex", "facet", "active_set"):
        assert len(seen) == (1 if r.side == "facet" else r.n_iter)
        assert np.allclose(seen[-1].u, r.u, atol=1e-14) and seen[-1].gap == r.gap


# (the default method takes the facet side on TREE: it has one record, the solution)
@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("auto", "facet", "active_set")])
@pytest.mark.parametrize("how", ["return", "raise"])
def test_callback_stops_the_solve_without_warning(method, how):
    def stop_at_3(info):
        if info.n_iter == 3:
            if how == "raise":
                raise StopIteration
            return True
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = sm.solve(TREE, ETA, method=method, callback=stop_at_3)
    assert r.n_iter == 3 and not r.converged and r.message == "stopped by the callback"
    # the returned point is the iterate after 3 iterations: a distribution with its own gap
    assert np.isclose(r.weights.sum(), 1.0) and r.gap > 0
    u = sum(w * TREE.vertex(s)[0] for s, w in zip(r.structures, r.weights))
    np.testing.assert_allclose(r.u, u, atol=1e-12)


@pytest.mark.parametrize("how", ["return", "raise"])
def test_callback_on_the_facet_side_sees_the_solution_once(how):
    """A facet-side solve has one record, its solution; asking it to stop changes
    nothing (the solve is done)."""
    seen = []

    def stop(info):
        seen.append(info)
        if how == "raise":
            raise StopIteration
        return True
    r = sm.solve(TREE, ETA, callback=stop)
    assert r.side == "facet" and r.converged and len(seen) == 1
    assert seen[0].n_iter == r.n_iter and seen[0].gap == r.gap
    assert np.array_equal(seen[0].u, r.u)


def test_callback_exceptions_propagate():
    class Boom(Exception):
        pass

    def boom(info):
        raise Boom("from the callback")
    for method in ("auto", "vertex", "pairwise_cg"):
        with pytest.raises(Boom, match="from the callback"):
            sm.solve(TREE, ETA, method=method, callback=boom)


def test_bad_callback():
    with pytest.raises(ValueError, match="callback: expected a callable"):
        sm.solve(TREE, ETA, callback=3)
    with pytest.raises(TypeError, match="callback"):
        sm.solve_batch(TREE, [ETA], callback=print)


def test_verbose_prints_log_spaced_lines_and_a_summary(capsys):
    seen = []
    # the vertex side's iterations (the facet side would print its one record)
    r = sm.solve(sm.SequenceFactor(30, 8), RNG.standard_normal((30, 8)), verbose=True,
                 callback=seen.append, method="vertex")
    err = capsys.readouterr().err.splitlines()
    assert len(seen) == r.n_iter       # the user's callback still runs
    rows = [line.split() for line in err[1:-1]]
    printed = [int(row[2]) for row in rows]
    expected = [k for k in range(1, r.n_iter + 1) if k <= 10 or k % 10 ** int(np.log10(k)) == 0]
    # lines at 1..10, 20, 30, ..., 100, 200, ... (and whenever 2 s pass, which a
    # solve this small never takes)
    assert r.n_iter > 20 and printed == expected
    assert "iter" in err[0] and "gap" in err[0]
    assert err[-1].startswith("SparseMAP (vertex): converged after")
    assert f"{r.n_iter} iterations" in err[-1]
