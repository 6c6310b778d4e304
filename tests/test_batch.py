"""solve_batch, vjp_batch and jvp_batch: bitwise equal to the serial calls, errors naming the problem."""
import pickle
import re
import sys
import warnings
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
import pytest

import sparsemap as sm


def same_result(r, s):
    """Bitwise equality of everything a result reports."""
    assert np.array_equal(r.u, s.u) and np.array_equal(r.v, s.v)
    assert np.array_equal(r.weights, s.weights)
    assert all(np.array_equal(a, b) for a, b in zip(r.structures, s.structures))
    assert len(r.structures) == len(s.structures)
    assert (r.n_iter, r.n_map, r.converged, r.message) == (s.n_iter, s.n_map, s.converged, s.message)
    assert r.gap == s.gap or (np.isnan(r.gap) and np.isnan(s.gap))
    assert r.objective == s.objective


def batch_notes(exc):
    """The problem indices the notes of a failed batch's error name.

    Python >= 3.11 has exception notes and the batch must add one; older
    Pythons have none to check.
    """
    notes = getattr(exc, "__notes__", [])
    if sys.version_info >= (3, 11):
        assert notes, "the batch's error carries no note naming the problem"
    return [int(m.group(1)) for n in notes
            for m in [re.search(r"\(while solving batch element (\d+)\)", n)] if m]


def ragged_trees(rng, B, scale=1.0, lo=2, hi=12):
    fs = [sm.TreeFactor(int(n)) for n in rng.integers(lo, hi, size=B)]
    return fs, [scale * rng.standard_normal(f.shape_u) for f in fs]


def problem_sets(rng):
    """(factors, etas_u, etas_v) for each family, shared and per-problem factors."""
    seq = sm.SequenceFactor(6, 4)
    mat = sm.MatchingFactor(4, 5)
    gen = sm.GenericFactor(rng.standard_normal((5, 7)), rng.standard_normal((2, 7)))
    trees, tree_etas = ragged_trees(rng, 13)
    return {
        "tree-ragged": (trees, tree_etas, None),
        "tree-shared-stacked": (sm.TreeFactor(7, projective=True),
                                3 * rng.standard_normal((9, 8, 8)), None),
        "sequence-stacked": (seq, rng.standard_normal((11,) + seq.shape_u),
                             rng.standard_normal((11,) + seq.shape_v)),
        "sequence-list-vNone": (seq, list(rng.standard_normal((5,) + seq.shape_u)),
                                [None, rng.standard_normal(seq.shape_v), None,
                                 rng.standard_normal(seq.shape_v), None]),
        "matching": (mat, list(rng.standard_normal((7, 4, 5))), None),
        "generic": (gen, rng.standard_normal((6, 5)), rng.standard_normal((6, 2))),
        "mixed": ([seq, mat, gen, trees[0]],
                  [rng.standard_normal(seq.shape_u), rng.standard_normal(mat.shape_u),
                   rng.standard_normal(gen.shape_u), tree_etas[0]],
                  [rng.standard_normal(seq.shape_v), None, rng.standard_normal(2), None]),
    }


def serial(factors, etas_u, etas_v, **kw):
    B = len(etas_u)
    fs = factors if isinstance(factors, list) else [factors] * B
    evs = [None] * B if etas_v is None else list(etas_v)
    return [sm.solve(f, eu, ev, **kw) for f, eu, ev in zip(fs, etas_u, evs)]


@pytest.mark.parametrize("n_jobs", [1, 2, 3])
def test_solve_batch_bitwise_equals_serial(n_jobs):
    rng = np.random.default_rng(0)
    for name, (factors, etas_u, etas_v) in problem_sets(rng).items():
        rs = sm.solve_batch(factors, etas_u, etas_v, n_jobs=n_jobs)
        ref = serial(factors, etas_u, etas_v)
        assert len(rs) == len(ref), name
        for r, s in zip(rs, ref):
            same_result(r, s)
            assert r.factor is s.factor


def test_solve_batch_repeated_and_reordered_problems():
    """A problem's result does not depend on its neighbours (workspaces are reused)."""
    rng = np.random.default_rng(1)
    f = sm.TreeFactor(9)
    etas = 2 * rng.standard_normal((12, 10, 10))
    a = sm.solve_batch(f, etas, n_jobs=2)
    b = sm.solve_batch(f, etas[::-1].copy(), n_jobs=1)[::-1]
    for r, s in zip(a, b):
        same_result(r, s)


def test_solve_kw_apply_to_every_problem():
    rng = np.random.default_rng(2)
    f = sm.SequenceFactor(5, 3)
    etas = rng.standard_normal((4, 5, 3))
    for kw in (dict(method="pairwise_cg", max_iter=50), dict(tol=1e-6),
               dict(return_history=True)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sm.ConvergenceWarning)
            rs = sm.solve_batch(f, etas, n_jobs=2, **kw)
            ref = serial(f, etas, None, **kw)
        for r, s in zip(rs, ref):
            same_result(r, s)
            if kw.get("return_history"):
                assert all(np.array_equal(r.history[k], s.history[k])
                           for k in ("objective", "gap", "support_size"))


def test_warm_starts_per_problem():
    rng = np.random.default_rng(3)
    f = sm.TreeFactor(8)
    etas = rng.standard_normal((5, 9, 9))
    cold = sm.solve_batch(f, etas)
    new = etas + 1e-3 * rng.standard_normal(etas.shape)
    init = [cold[0], None, cold[2].structures, cold[3], None]
    warm = sm.solve_batch(f, new, init=init, n_jobs=2)
    for r, e, i in zip(warm, new, init):
        same_result(r, sm.solve(f, e, init=i))
    with pytest.raises(ValueError, match="init"):
        sm.solve_batch(f, new, init=cold[:2])          # not one per problem
    with pytest.raises(ValueError, match=r"init\[1\]"):
        sm.solve_batch(f, new, init=[None, [[0] * 9], None, None, None])


def test_backward_batches_bitwise_equal_single_products():
    rng = np.random.default_rng(4)
    for name, (factors, etas_u, etas_v) in problem_sets(rng).items():
        rs = sm.solve_batch(factors, etas_u, etas_v, n_jobs=2)
        dus = [rng.standard_normal(r.factor.shape_u) for r in rs]
        d_v = [rng.standard_normal(r.factor.shape_v) if r.factor.n_v and i % 2 else None
               for i, r in enumerate(rs)]
        for n_jobs in (1, 2):
            g = sm.vjp_batch(rs, dus, n_jobs=n_jobs)
            d = sm.jvp_batch(rs, dus, d_v, n_jobs=n_jobs)
            for r, du, dv, (gu, gv), dd in zip(rs, dus, d_v, g, d):
                gu1, gv1 = r.vjp(du)
                assert np.array_equal(gu, gu1) and np.array_equal(gv, gv1), name
                assert gu.shape == r.factor.shape_u and gv.shape == r.factor.shape_v
                assert np.array_equal(dd, r.jvp(du, dv)), name
        if not isinstance(factors, list) and isinstance(etas_u, np.ndarray):
            # stacked directions
            G = rng.standard_normal(etas_u.shape)
            for (gu, _), r, gi in zip(sm.vjp_batch(rs, G), rs, G):
                assert np.array_equal(gu, r.vjp(gi)[0])


def test_backward_batch_of_cg_results():
    rng = np.random.default_rng(5)
    f = sm.SequenceFactor(4, 3)
    etas = rng.standard_normal((3, 4, 3))
    rs = sm.solve_batch(f, etas, method="bpcg")
    dus = rng.standard_normal((3, 4, 3))
    for r, du, (gu, gv) in zip(rs, dus, sm.vjp_batch(rs, dus, n_jobs=2)):
        assert np.array_equal(gu, r.vjp(du)[0]) and np.array_equal(gv, r.vjp(du)[1])


def test_empty_batch():
    f = sm.SequenceFactor(3, 2)
    assert sm.solve_batch(f, []) == []
    assert sm.solve_batch(f, np.zeros((0, 3, 2))) == []
    assert sm.vjp_batch([], []) == [] and sm.jvp_batch([], []) == []


@pytest.mark.parametrize("call, match", [
    (lambda f: sm.solve_batch(f, [np.zeros((4, 3)), np.zeros((3, 3))]),
     r"etas_u\[1\]: expected shape \(4, 3\), got \(3, 3\)"),
    (lambda f: sm.solve_batch(f, np.zeros((5, 3, 3))), r"etas_u: expected shape \(5, 4, 3\)"),
    (lambda f: sm.solve_batch(f, [np.zeros((4, 3))] * 3 + [np.full((4, 3), np.nan)]),
     r"etas_u\[3\]: contains non-finite"),
    (lambda f: sm.solve_batch(f, np.where(np.arange(60).reshape(5, 4, 3) == 40, np.inf, 0.0)),
     r"etas_u\[3\]: contains non-finite"),
    (lambda f: sm.solve_batch(f, np.zeros((2, 4, 3)), np.zeros((3, 3, 3, 3))), r"etas_v"),
    (lambda f: sm.solve_batch(f, np.zeros((2, 4, 3)), [None, np.zeros((2, 3))]),
     r"etas_v\[1\]: expected shape \(3, 3, 3\) \(per transition\) or \(3, 3\) \(shared"),
    (lambda f: sm.solve_batch([f, f], np.zeros((3, 4, 3))), r"factors: expected one factor"),
    (lambda f: sm.solve_batch([f, "tree"], np.zeros((2, 4, 3))), r"factors\[1\]"),
    (lambda f: sm.solve_batch([f, sm.SequenceFactor(3, 3)], np.zeros((2, 4, 3))),
     r"etas_u: a stacked array needs factors of one shape"),
    (lambda f: sm.solve_batch(f, 5), r"etas_u"),
    (lambda f: sm.solve_batch(f, np.zeros((2, 4, 3)), n_jobs=0), r"n_jobs"),
    (lambda f: sm.solve_batch(f, np.zeros((2, 4, 3)), n_jobs=1.5), r"n_jobs"),
    (lambda f: sm.solve_batch(f, np.zeros((2, 4, 3)), executor=5), r"executor"),
    (lambda f: sm.solve_batch(f, np.zeros((2, 4, 3)), method="newton"), r"method"),
    (lambda f: sm.solve_batch(f, np.zeros((2, 4, 3)) + 0j), r"etas_u: expected real values"),
    (lambda f: sm.vjp_batch(sm.solve_batch(f, np.zeros((2, 4, 3))), [np.zeros((4, 3))]), r"dus"),
    (lambda f: sm.vjp_batch(sm.solve_batch(f, np.zeros((2, 4, 3))),
                            [np.zeros((4, 3)), np.zeros((4, 2))]), r"dus\[1\]"),
    (lambda f: sm.vjp_batch(sm.solve_batch(f, np.zeros((2, 4, 3))),
                            [np.zeros((4, 3)), np.full((4, 3), -np.inf)]), r"dus\[1\]"),
    (lambda f: sm.vjp_batch([sm.solve(f, np.zeros((4, 3))), None], np.zeros((2, 4, 3))),
     r"results\[1\]"),
    (lambda f: sm.jvp_batch(sm.solve_batch(f, np.zeros((2, 4, 3))), np.zeros((2, 4, 3)),
                            [None, np.full((3, 3, 3), np.nan)]), r"d_etas_v\[1\]"),
])
def test_errors_name_the_problem(call, match):
    with pytest.raises(ValueError, match=match):
        call(sm.SequenceFactor(4, 3))


def test_unknown_keyword():
    with pytest.raises(TypeError, match="eta"):
        sm.solve_batch(sm.SequenceFactor(2, 2), np.zeros((1, 2, 2)), eta=1)


def test_convergence_warnings_name_the_problem():
    rng = np.random.default_rng(6)
    f = sm.TreeFactor(20)
    etas = rng.standard_normal((3, 21, 21))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rs = sm.solve_batch(f, etas, method="vertex", max_iter=2, n_jobs=2)
    assert all(w.category is sm.ConvergenceWarning for w in caught)
    assert sorted(str(w.message).split(":")[0] for w in caught) == \
        ["batch element 0", "batch element 1", "batch element 2"]
    assert not any(r.converged for r in rs)
    assert all(w.filename == __file__ for w in caught)


def test_oracle_factor_errors_propagate_with_the_problem():
    calls = []

    def oracle(eu, ev):
        calls.append(1)
        if eu[0] > 10:
            raise ZeroDivisionError("boom")
        return int(np.argmax(eu))

    f = sm.OracleFactor(oracle, lambda s: np.eye(3)[s], shape_u=3)
    etas = np.zeros((6, 3))
    etas[:, 1] = 1.0
    rs = sm.solve_batch(f, etas, n_jobs=2)        # callbacks take the GIL: still correct
    assert all(np.array_equal(r.u, [0, 1, 0]) for r in rs)
    etas[4, 0] = 11.0
    for n_jobs in (1, 2, 3):
        with pytest.raises(ZeroDivisionError, match="boom") as info:
            sm.solve_batch(f, np.repeat(etas, 20, axis=0)[::-1].copy() if n_jobs > 1 else etas,
                           n_jobs=n_jobs)
        # problem 4 fails; repeated 20 times and reversed, it is problems 20..39
        named = batch_notes(info.value)
        if sys.version_info >= (3, 11):
            assert len(named) == 1 and named[0] in (range(20, 40) if n_jobs > 1 else [4])
    with pytest.raises(ZeroDivisionError) as info:
        sm.solve_batch(f, etas, n_jobs=1)
    if sys.version_info >= (3, 11):
        assert batch_notes(info.value) == [4]
    # the pool is still usable after a failed batch
    assert all(np.array_equal(r.u, [0, 1, 0]) for r in sm.solve_batch(f, etas[:4], n_jobs=2))


def test_results_pickle_and_keep_their_backward_pass():
    rng = np.random.default_rng(7)
    for f, kw in ((sm.TreeFactor(6), {}), (sm.SequenceFactor(4, 3), dict(method="away_cg"))):
        eu = rng.standard_normal(f.shape_u)
        r = sm.solve(f, eu, **kw)
        r.u  # a field already converted travels too
        s = pickle.loads(pickle.dumps(r))
        same_result(r, s)
        du = rng.standard_normal(f.shape_u)
        assert np.array_equal(r.vjp(du)[0], s.vjp(du)[0])
        assert np.array_equal(r.jvp(du), s.jvp(du))


def test_process_pool_executor():
    rng = np.random.default_rng(8)
    fs, etas = ragged_trees(rng, 10, scale=2.0)
    with ProcessPoolExecutor(max_workers=2) as ex:
        rs = sm.solve_batch(fs, etas, executor=ex, n_jobs=2)
    ref = serial(fs, etas, None)
    for r, s, f in zip(rs, ref, fs):
        same_result(r, s)
        assert r.factor is f                       # the caller's objects, not copies
        du = rng.standard_normal(f.shape_u)
        assert np.array_equal(r.vjp(du)[0], s.vjp(du)[0])


def test_thread_pool_executor_and_infeasible_problem_in_executor():
    f = sm.SequenceFactor(3, 2)
    etas = np.zeros((4, 3, 2))
    with ThreadPoolExecutor(2) as ex:
        rs = sm.solve_batch(f, etas, executor=ex)
        for r, s in zip(rs, serial(f, etas, None)):
            same_result(r, s)
        etas[2, 1] = -np.inf
        with pytest.raises(ValueError, match=r"etas_u\[2\], etas_v\[2\]: every structure"):
            sm.solve_batch(f, etas, executor=ex)


def test_results_are_ordered_by_decreasing_weight():
    rng = np.random.default_rng(9)
    f = sm.TreeFactor(8)
    for _ in range(5):
        r = sm.solve(f, rng.standard_normal(f.shape_u))
        assert np.all(np.diff(r.weights) <= 1e-12)
        # a permutation of the solver's support (on the facet side, of its
        # decomposition): the same distribution
        S, y = r._support()
        assert sorted(map(tuple, S)) == sorted(tuple(s) for s in r.structures)
        for s, w in zip(r.structures, r.weights):
            assert w == y[[tuple(t) for t in S].index(tuple(s))]
        u = sum(wk * f.vertex(s)[0] for wk, s in zip(r.weights, r.structures))
        np.testing.assert_allclose(u, r.u, atol=1e-12)


def test_ties_keep_the_solver_order():
    # symmetric problems: equal weights up to round-off, MAP (lowest index) first
    for eta in ([0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [-1.0, 0.3, 0.3, -1.0]):
        r = sm.solve(sm.GenericFactor(np.eye(len(eta))), eta)
        assert r.structures == sorted(r.structures)
        np.testing.assert_allclose(r.weights, 1 / len(r.weights), rtol=1e-14)


def test_concurrent_batches_from_several_threads():
    """Callers share the process's helper threads (one batch at a time; a caller that
    finds them busy works alone); each gets its own, correct results."""
    rng = np.random.default_rng(10)
    jobs = []
    for k in range(6):
        fs, etas = ragged_trees(rng, 9, scale=1 + k)
        jobs.append((fs, etas, serial(fs, etas, None)))

    def work(job):
        fs, etas, ref = job
        for _ in range(3):
            rs = sm.solve_batch(fs, etas, n_jobs=3)
            dus = [np.ones(f.shape_u) for f in fs]
            gs = sm.vjp_batch(rs, dus, n_jobs=3)
            for r, s, g, du in zip(rs, ref, gs, dus):
                same_result(r, s)
                assert np.array_equal(g[0], s.vjp(du)[0])
        return True

    with ThreadPoolExecutor(4) as ex:
        assert all(ex.map(work, jobs))


def test_helpers_are_free_again_after_a_failing_batch():
    from sparsemap._solve import _helpers

    def oracle(eu, ev):
        if eu[0] > 50:
            raise KeyError("oracle failed")
        return int(np.argmax(eu))

    f = sm.OracleFactor(oracle, lambda s: np.eye(3)[s], shape_u=3)
    etas = np.random.default_rng(12).standard_normal((40, 3))
    etas[25, 0] = 100.0
    with pytest.raises(KeyError, match="oracle failed"):
        sm.solve_batch(f, etas, n_jobs=2)
    assert not _helpers().busy.locked()
    etas[25, 0] = 0.0
    for r, e in zip(sm.solve_batch(f, etas, n_jobs=2), etas):
        same_result(r, sm.solve(f, e))
    assert not _helpers().busy.locked()


@pytest.mark.parametrize("n_jobs", [2, 3])
def test_every_problem_solved_exactly_once(n_jobs):
    """Claims from both ends of the order never overlap nor skip a problem."""
    calls = []

    def oracle(eu, ev):
        calls.append(1)                  # callbacks hold the GIL: a safe count
        return int(np.argmax(eu))

    f = sm.OracleFactor(oracle, lambda s: np.eye(4)[s], shape_u=4)
    etas = np.random.default_rng(11).standard_normal((57, 4))
    for _ in range(3):
        calls.clear()
        rs = sm.solve_batch(f, etas, n_jobs=n_jobs)
        assert len(calls) == sum(r.n_map for r in rs)
        for r, e in zip(rs, etas):
            same_result(r, sm.solve(f, e))


# -- padded batches (the PyTorch layer's path: one padded array in, one out) ------------
from sparsemap._solve import _backward_padded, _solve_padded  # noqa: E402


def padded_batch(rng, factors, on_v=False, fill=np.nan, scale=1.0):
    """Random padded scores: each factor's leading block, ``fill`` everywhere else."""
    shapes = [f.shape_v if on_v else f.shape_u for f in factors]
    pad = tuple(max(d) for d in zip(*shapes))
    arr = np.full((len(factors),) + pad, fill)
    for b, s in enumerate(shapes):
        arr[(b,) + tuple(slice(0, d) for d in s)] = scale * rng.standard_normal(s)
    return arr


def block(arr, b, shape):
    return arr[(b,) + tuple(slice(0, d) for d in shape)]


def outside_is_zero(arr, b, shape):
    rest = arr[b].copy()
    rest[tuple(slice(0, d) for d in shape)] = 0
    return not rest.any()


PADDED_FAMILIES = {
    "tree": lambda: [sm.TreeFactor(n) for n in (3, 7, 1, 5, 7, 2)],
    "sequence": lambda: [sm.SequenceFactor(n, 3) for n in (4, 1, 6, 2, 6)],
    "matching": lambda: [sm.MatchingFactor(r, c) for r, c in ((3, 4), (2, 2), (4, 1), (1, 3))],
    "shared": lambda: sm.SequenceFactor(4, 3),
}


@pytest.mark.parametrize("name", PADDED_FAMILIES)
@pytest.mark.parametrize("n_jobs", [1, 2])
def test_padded_solve_and_backward_bitwise_equal_per_element(name, n_jobs):
    rng = np.random.default_rng(40)
    factors = PADDED_FAMILIES[name]()
    fs = factors if isinstance(factors, list) else [factors] * 5
    has_v = fs[0].n_v > 0
    eu = padded_batch(rng, fs, scale=2.0)      # NaN in the padding: never read
    ev = padded_batch(rng, fs, True) if has_v else None
    u = np.full(eu.shape, 7.0)
    handles = _solve_padded(factors, eu, ev, u, n_jobs, {})
    du = padded_batch(rng, fs)
    g_u, g_v = np.full(eu.shape, 7.0), (np.full(ev.shape, 7.0) if has_v else None)
    _backward_padded(handles, du, None, True, n_jobs, g_u, g_v)
    d_eu, d_ev = padded_batch(rng, fs), (padded_batch(rng, fs, True) if has_v else None)
    jv = np.full(eu.shape, 7.0)
    _backward_padded(handles, d_eu, d_ev, False, n_jobs, jv)
    for b, f in enumerate(fs):
        r = sm.solve(f, block(eu, b, f.shape_u), None if ev is None else block(ev, b, f.shape_v))
        assert np.array_equal(block(u, b, f.shape_u), r.u) and outside_is_zero(u, b, f.shape_u)
        gu, gv = r.vjp(block(du, b, f.shape_u))
        assert np.array_equal(block(g_u, b, f.shape_u), gu) and outside_is_zero(g_u, b, f.shape_u)
        if has_v:
            assert np.array_equal(block(g_v, b, f.shape_v), gv)
            assert outside_is_zero(g_v, b, f.shape_v)
        want = r.jvp(block(d_eu, b, f.shape_u),
                     None if d_ev is None else block(d_ev, b, f.shape_v))
        assert np.array_equal(block(jv, b, f.shape_u), want) and outside_is_zero(jv, b, f.shape_u)


def test_padded_float32_in_and_out():
    # the threads convert: float32 scores read exactly, u rounded as NumPy rounds it
    rng = np.random.default_rng(41)
    fs = [sm.TreeFactor(n) for n in (4, 2, 6)]
    eu = padded_batch(rng, fs, fill=np.inf, scale=3.0).astype(np.float32)
    u = np.empty(eu.shape, dtype=np.float32)
    handles = _solve_padded(fs, eu, None, u, 2, {})
    du = padded_batch(rng, fs).astype(np.float32)
    g = np.empty(eu.shape, dtype=np.float32)
    _backward_padded(handles, du, None, True, 2, g)
    for b, f in enumerate(fs):
        r = sm.solve(f, block(eu, b, f.shape_u).astype(np.float64))
        assert np.array_equal(block(u, b, f.shape_u), r.u.astype(np.float32))
        want = r.vjp(block(du, b, f.shape_u).astype(np.float64))[0].astype(np.float32)
        assert np.array_equal(block(g, b, f.shape_u), want)
        assert outside_is_zero(u, b, f.shape_u) and outside_is_zero(g, b, f.shape_u)


def test_padded_masks_and_ignored_entries():
    rng = np.random.default_rng(42)
    fs = [sm.TreeFactor(n) for n in (5, 3, 6, 4)]
    eu = padded_batch(rng, fs, fill=np.nan)
    eu[0, 1:4, 2] = -np.inf                     # forbidden arcs
    eu[1, 2, 2] = np.nan                        # the diagonal and column 0 are ignored:
    eu[2, :, 0] = np.inf                        # any value, the solve sets them to 0
    eu[3, 3, 3] = -np.inf
    u = np.empty(eu.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _solve_padded(fs, eu, None, u, 2, {})
    for b, f in enumerate(fs):
        r = sm.solve(f, block(eu, b, f.shape_u))
        assert np.array_equal(block(u, b, f.shape_u), r.u)
    assert (u[0, 1:4, 2] == 0).all()


def test_padded_errors_name_the_element():
    rng = np.random.default_rng(43)
    fs = [sm.TreeFactor(n) for n in (3, 4, 2, 4)]

    def run(eu, factors=fs):
        return _solve_padded(factors, eu, None, np.empty(eu.shape), 2, {})

    eu = padded_batch(rng, fs)
    eu[2, 1, 2] = np.nan
    with pytest.raises(ValueError, match=r"etas_u\[2\]: .*non-finite"):
        run(eu)
    eu = padded_batch(rng, fs)
    eu[1, :, 3] = -np.inf                       # word 3 of element 1 has no allowed head
    with pytest.raises(ValueError, match=r"etas_u\[1\]: .*forbidden"):
        run(eu)
    eu[3, 2, 1] = np.inf                        # validation first, as in solve_batch
    with pytest.raises(ValueError, match=r"etas_u\[3\]"):
        run(eu)
    with pytest.raises(ValueError, match=r"etas_u\[1\]: .*does not fit"):
        run(padded_batch(rng, fs), [fs[0], sm.TreeFactor(6), fs[2], fs[3]])
    eu = padded_batch(rng, fs)
    handles = run(eu)
    du = padded_batch(rng, fs)
    du[3, 0, 1] = np.inf
    with pytest.raises(ValueError, match=r"dus\[3\]: .*non-finite"):
        _backward_padded(handles, du, None, True, 1, np.empty(eu.shape))


def test_padded_general_path_and_convergence_warning():
    # other solvers go through solve_batch on the blocks; results match it
    rng = np.random.default_rng(44)
    fs = [sm.TreeFactor(n) for n in (3, 5)]
    eu = padded_batch(rng, fs)
    u = np.empty(eu.shape)
    handles = _solve_padded(fs, eu, None, u, 1, dict(method="pairwise_cg", tol=1e-9))
    want = sm.solve_batch(fs, [block(eu, b, f.shape_u) for b, f in enumerate(fs)],
                          method="pairwise_cg", tol=1e-9)
    for b, (f, r) in enumerate(zip(fs, want)):
        assert np.array_equal(block(u, b, f.shape_u), r.u)
    g = np.empty(eu.shape)
    _backward_padded(handles, eu * 0 + 1, None, True, 1, g)
    assert np.array_equal(block(g, 1, fs[1].shape_u), want[1].vjp(np.ones(fs[1].shape_u))[0])
    with pytest.warns(sm.ConvergenceWarning) as record:
        _solve_padded(fs, eu, None, u, 1, dict(method="vertex", max_iter=1))
    assert [str(w.message).split(":")[0] for w in record] == ["batch element 0",
                                                              "batch element 1"]


@pytest.mark.parametrize("method, max_iter", [("auto", None), ("pairwise_cg", None),
                                              ("cg", 200)])
def test_stacked_ignored_entries_per_problem_factors(method, max_iter):
    # nan in entries a tree ignores (its diagonal): a stacked array with one factor per
    # problem is cleaned as with a shared factor and as solve does, the input untouched
    rng = np.random.default_rng(45)
    f = sm.TreeFactor(4)
    x = rng.standard_normal((3, 5, 5))
    x[:, 0, 0] = np.nan
    x[1, 2, 2] = np.nan
    before = x.copy()
    with warnings.catch_warnings():
        # vanilla CG stops at max_iter (a warning); the others converge
        warnings.simplefilter("ignore" if max_iter else "error", sm.ConvergenceWarning)
        per_problem = sm.solve_batch([f, f, f], x, method=method, max_iter=max_iter)
        shared = sm.solve_batch(f, x, method=method, max_iter=max_iter)
        single = [sm.solve(f, e, method=method, max_iter=max_iter) for e in x]
    for r, s, t in zip(per_problem, shared, single):
        assert np.isfinite(r.objective)
        same_result(r, s)
        same_result(r, t)
    assert np.array_equal(x, before, equal_nan=True)


def test_jvp_batch_empty_v_directions_of_factors_without_v():
    # a factor without eta_v takes an empty d_eta_v entry (or None): bitwise r.jvp
    rng = np.random.default_rng(46)
    seq, gen = sm.SequenceFactor(5, 3), sm.GenericFactor(rng.standard_normal((4, 6)))
    fs = [seq, gen, seq, gen]
    rs = sm.solve_batch(fs, [rng.standard_normal(f.shape_u) for f in fs],
                        [rng.standard_normal(f.shape_v) if f.n_v else None for f in fs])
    dus = [rng.standard_normal(f.shape_u) for f in fs]
    dvs = [rng.standard_normal(f.shape_v) for f in fs]       # shape (0,) for gen
    assert gen.n_v == 0 and dvs[1].shape == (0,)
    for n_jobs in (1, 2):
        for d, r, du, dv in zip(sm.jvp_batch(rs, dus, dvs, n_jobs=n_jobs), rs, dus, dvs):
            assert np.array_equal(d, r.jvp(du, dv))


def _thread_recording_oracle(d, seen):
    """Sparsemax over d items as an OracleFactor whose callbacks record their thread."""
    import threading

    def map_fn(eu, ev):
        seen.add(threading.get_ident())
        return int(np.argmax(eu))

    def vertex_fn(s):
        seen.add(threading.get_ident())
        return np.eye(d)[s]

    return sm.OracleFactor(map_fn, vertex_fn, shape_u=d)


def test_default_n_jobs_is_chosen_from_what_the_factors_are(monkeypatch):
    """n_jobs=None: every core for factors whose MAP runs without the GIL, 1 when a
    factor is an OracleFactor (its Python callbacks hold the GIL, so threads could only
    slow the batch); an explicit n_jobs is kept."""
    import threading

    from sparsemap import _solve
    monkeypatch.setattr(_solve, "_default_jobs", lambda: 4)   # as on a 4-core machine
    seen = set()
    oracle = _thread_recording_oracle(5, seen)
    tree = sm.TreeFactor(3)
    assert _solve._check_n_jobs(None, tree) == 4
    assert _solve._check_n_jobs(None, [tree, sm.SequenceFactor(3, 2)]) == 4
    assert _solve._check_n_jobs(None, oracle) == 1
    assert _solve._check_n_jobs(None, [tree, oracle, tree]) == 1
    assert _solve._check_n_jobs(3, oracle) == 3
    # what a batch does: with the default, every callback runs in the calling thread,
    # forward and backward
    etas = np.random.default_rng(0).standard_normal((48, 5))
    rs = sm.solve_batch(oracle, etas)
    sm.vjp_batch(rs, etas)
    sm.jvp_batch(rs, etas)
    assert seen == {threading.get_ident()}
    for r, eta in zip(rs, etas):
        np.testing.assert_array_equal(r.u, sm.solve(oracle, eta).u)

