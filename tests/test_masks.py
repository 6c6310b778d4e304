"""Masks: -inf forbids a part, for every family.

Each masked problem is checked against two independent answers: the same
problem with the forbidden parts at a very low finite score (same support,
same u and Jacobian), and brute force over the allowed structures only (the
SciPy QP of tests/_reference.py on their columns, built without the package).
"""
import warnings
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

import sparsemap as sm
from sparsemap.testing import check_kkt, enumerate_structures
from _reference import (all_matchings, all_sequences, all_trees, arc_matrix, matching_matrix,
                        sequence_column, simplex_qp)

LOW = -1e4   # "very low" for scores of order one and at most 16 parts


def _columns(factor):
    """Every structure of a small factor and its dense column, without the package."""
    if isinstance(factor, sm.SequenceFactor):
        S = all_sequences(factor.n_positions, factor.n_states)
        return S, [sequence_column(s, factor.n_states) for s in S]
    if isinstance(factor, sm.TreeFactor):
        S = all_trees(factor.n_words, factor.projective, factor.single_root)
        return S, [(arc_matrix(s), np.zeros(0)) for s in S]
    if isinstance(factor, sm.MatchingFactor):
        S = all_matchings(factor.n_rows, factor.n_cols)
        return S, [(matching_matrix(s, factor.n_cols), np.zeros(0)) for s in S]
    M, N = _GENERIC_COLUMNS[factor.n_u]
    return list(range(M.shape[1])), [(M[:, j], N[:, j]) for j in range(M.shape[1])]


rng0 = np.random.default_rng(12345)
_M = rng0.integers(-1, 2, size=(6, 9)).astype(float)     # negative entries and zeros
_N = rng0.integers(-1, 2, size=(2, 9)).astype(float)
_M01 = (rng0.random((5, 8)) < 0.5).astype(float)
_M01[:, 0] = [1, 0, 0, 0, 0]
_GENERIC_COLUMNS = {6: (_M, _N), 5: (_M01, np.zeros((0, 8)))}


def _oracle_factor():
    """A user's oracle over the 0/1 columns _M01: its MAP ignores parts a column does not use."""
    def map_fn(eu, ev):
        return int(np.argmax([eu[_M01[:, j] != 0].sum() for j in range(_M01.shape[1])]))
    return sm.OracleFactor(map_fn, lambda s: _M01[:, s], shape_u=5)


FACTORS = {
    "sequence": lambda: sm.SequenceFactor(4, 3),
    "tree": lambda: sm.TreeFactor(4),
    "tree-projective": lambda: sm.TreeFactor(4, projective=True),
    "tree-single-root": lambda: sm.TreeFactor(4, single_root=True),
    "tree-projective-single-root": lambda: sm.TreeFactor(4, projective=True, single_root=True),
    "matching-square": lambda: sm.MatchingFactor(3, 3),
    "matching-wide": lambda: sm.MatchingFactor(3, 4),
    "matching-tall": lambda: sm.MatchingFactor(4, 3),
    "generic": lambda: sm.GenericFactor(_M, _N),
    "oracle": _oracle_factor,
}   # the logic factors' masks are tested in tests/test_logic.py, the losses' in test_losses.py


def _random_mask(factor, rng, p):
    mu = rng.random(factor.shape_u) < p
    mv = rng.random(factor.shape_v) < p
    if isinstance(factor, sm.TreeFactor):   # keep masks off the ignored entries here
        mu[:, 0] = False
        np.fill_diagonal(mu, False)
    return mu, mv


def _allowed(columns, mu, mv):
    return [k for k, (m, n) in enumerate(columns)
            if not np.any(m.reshape(mu.shape)[mu] != 0) and not np.any(n.reshape(mv.shape)[mv] != 0)]


def masked_problems(name, n_draws=8, p=0.3):
    """Feasible masked problems: (factor, eta_u, eta_v, mask_u, mask_v, allowed indices)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    factor = FACTORS[name]()
    S, cols = _columns(factor)
    out = []
    while len(out) < n_draws:
        mu, mv = _random_mask(factor, rng, p)
        allowed = _allowed(cols, mu, mv)
        if not allowed:
            continue
        eu = rng.standard_normal(factor.shape_u)
        ev = rng.standard_normal(factor.shape_v)
        out.append((factor, np.where(mu, -np.inf, eu), np.where(mv, -np.inf, ev), mu, mv,
                    (S, cols, allowed)))
    return out


def _low_score_solve(factor, eu, ev, mu, mv, allowed):
    """The problem with a very low finite score on the forbidden parts.

    With negative entries in M, a low score would favour the columns that use
    a forbidden part with a negative coefficient: there, the equivalent
    finite problem keeps the allowed columns only.
    """
    if isinstance(factor, sm.GenericFactor) and np.any(factor.M < 0):
        f = sm.GenericFactor(factor.M[:, allowed], factor.N[:, allowed])
        return sm.solve(f, np.where(mu, 0.0, eu), np.where(mv, 0.0, ev))
    return sm.solve(factor, np.where(mu, LOW, eu), np.where(mv, LOW, ev) if factor.n_v else None)


@pytest.mark.parametrize("name", FACTORS)
def test_masked_solve_matches_low_scores_and_brute_force(name):
    for factor, eu, ev, mu, mv, (S, cols, allowed) in masked_problems(name):
        r = sm.solve(factor, eu, ev if factor.n_v else None)
        assert r.converged
        # 1. MAP and the support avoid every forbidden part; u, v are exactly 0 there
        assert np.all(r.u[mu] == 0.0) and np.all(r.v[mv] == 0.0)
        for s in r.structures + [factor.map(eu, ev if factor.n_v else None)]:
            m, n = factor.vertex(s)
            assert not np.any(m[mu] != 0) and not np.any(n[mv] != 0)
        # 2. the same problem with very low finite scores instead of -inf
        low = _low_score_solve(factor, eu, ev, mu, mv, allowed)
        np.testing.assert_allclose(r.u, low.u, rtol=0, atol=1e-9)
        if not isinstance(factor, sm.GenericFactor):
            assert sorted(map(repr, r.structures)) == sorted(map(repr, low.structures))
        # 3. brute force over the allowed structures only
        eu0, ev0 = np.where(mu, 0.0, eu), np.where(mv, 0.0, ev)
        M = np.stack([cols[k][0].reshape(-1) for k in allowed], axis=1)
        theta = np.array([(cols[k][0].reshape(-1) @ eu0.reshape(-1))
                          + (cols[k][1].reshape(-1) @ ev0.reshape(-1)) for k in allowed])
        u_ref, _, value, _ = simplex_qp(M, theta)
        np.testing.assert_allclose(r.u.reshape(-1), u_ref, rtol=0, atol=1e-8)
        assert abs(-r.objective - value) <= 1e-9 * (1 + abs(value))
        if not isinstance(factor, sm.OracleFactor):
            check_kkt(factor, r, eu, ev if factor.n_v else None)
            fake = forbidden_result(factor, mu, mv)
            if fake is not None:   # (a mask may forbid parts no structure uses)
                with pytest.raises(AssertionError, match="forbidden"):
                    check_kkt(factor, fake, eu, ev if factor.n_v else None)
        # MAP is the best allowed structure
        best = max(theta)
        m, n = factor.vertex(factor.map(eu, ev if factor.n_v else None))
        assert abs(m.reshape(-1) @ eu0.reshape(-1) + n.reshape(-1) @ ev0.reshape(-1) - best) <= 1e-12


def forbidden_result(factor, mu, mv):
    """A fake result putting all its weight on a structure that uses a forbidden part."""
    for s in enumerate_structures(factor):
        m, n = factor.vertex(s)
        if np.any(m[mu] != 0) or np.any(n[mv] != 0):
            return SimpleNamespace(structures=[s], weights=np.ones(1), u=m, v=n)
    return None


@pytest.mark.parametrize("name", FACTORS)
def test_jacobian_vanishes_on_forbidden_parts(name):
    rng = np.random.default_rng(7)
    for factor, eu, ev, mu, mv, (_, _, allowed) in masked_problems(name, n_draws=4):
        ev_arg = ev if factor.n_v else None
        r = sm.solve(factor, eu, ev_arg)
        low = _low_score_solve(factor, eu, ev, mu, mv, allowed)
        for _ in range(3):
            d_u, d_v = rng.standard_normal(factor.shape_u), rng.standard_normal(factor.shape_v)
            du = r.jvp(d_u, d_v if factor.n_v else None)
            assert np.all(du[mu] == 0.0)                      # rows
            np.testing.assert_allclose(du, low.jvp(d_u, d_v if factor.n_v else None), atol=1e-9)
            # columns: a direction on the forbidden parts only moves nothing
            assert np.all(r.jvp(np.where(mu, d_u, 0.0), np.where(mv, d_v, 0.0) if factor.n_v
                                else None) == 0.0)
            g_u, g_v = r.vjp(d_u)
            assert np.all(g_u[mu] == 0.0) and np.all(g_v[mv] == 0.0)
            np.testing.assert_allclose(g_u, low.vjp(d_u)[0], atol=1e-9)
            g_u, g_v = r.vjp(np.where(mu, d_u, 0.0))
            assert np.all(g_u == 0.0) and np.all(g_v == 0.0)


@pytest.mark.parametrize("name", ["sequence", "tree", "matching-tall", "generic"])
def test_conditional_gradient_with_masks(name):
    for factor, eu, ev, mu, mv, _ in masked_problems(name, n_draws=3):
        ev_arg = ev if factor.n_v else None
        ref = sm.solve(factor, eu, ev_arg)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sm.ConvergenceWarning)
            r = sm.solve(factor, eu, ev_arg, method="bpcg", max_iter=3000, tol=1e-10)
        assert np.all(r.u[mu] == 0.0) and np.all(r.v[mv] == 0.0)
        np.testing.assert_allclose(r.u, ref.u, atol=1e-4)
        assert np.isfinite(r.objective) and np.isfinite(r.gap)


def test_bio_constraints():
    """Tags O=0, B=1, I=2: I never starts a sequence nor follows O."""
    rng = np.random.default_rng(3)
    n, f = 6, sm.SequenceFactor(6, 3)
    ev = rng.standard_normal((n - 1, 3, 3))
    ev[:, 0, 2] = -np.inf
    for _ in range(20):
        eu = 2 * rng.standard_normal((n, 3))
        eu[0, 2] = -np.inf
        r = sm.solve(f, eu, ev)
        for tags in r.structures + [f.map(eu, ev)]:
            assert tags[0] != 2 and not any(a == 0 and b == 2 for a, b in zip(tags[:-1], tags[1:]))
        assert r.u[0, 2] == 0.0 and np.all(r.v[:, 0, 2] == 0.0)


def infeasible_cases():
    seq = sm.SequenceFactor(3, 2)
    eu = np.zeros((3, 2))
    eu[1] = -np.inf                                   # no tag allowed at position 1
    ev = np.zeros((2, 2, 2))
    ev[0] = -np.inf                                   # no transition allowed after position 0
    tree = np.zeros((4, 4))
    tree[:, 2] = -np.inf                              # word 2 has no allowed head
    crossing = np.full((4, 4), -np.inf)               # only the arcs of a non-projective tree
    for m, h in enumerate([-1, 3, 0, 2]):
        if m:
            crossing[h, m] = 0.0
    roots = np.zeros((4, 4))
    roots[1:, 1] = roots[1:, 2] = -np.inf             # words 1 and 2 can only attach to the root
    hall = np.zeros((3, 3))
    hall[0, 1:] = hall[1, 1:] = -np.inf               # rows 0 and 1 both need column 0
    tall = np.zeros((4, 3))
    tall[:, 2] = -np.inf                              # column 2 cannot be matched
    return [
        (seq, eu, None), (seq, np.zeros((3, 2)), ev),
        (sm.TreeFactor(3), tree, None), (sm.TreeFactor(3, projective=True), tree, None),
        (sm.TreeFactor(3, projective=True), crossing, None),
        (sm.TreeFactor(3, single_root=True), roots, None),
        (sm.TreeFactor(3, projective=True, single_root=True), roots, None),
        (sm.MatchingFactor(3, 3), hall, None), (sm.MatchingFactor(4, 3), tall, None),
        (sm.GenericFactor(_M, _N), np.full(6, -np.inf), None),
        (_oracle_factor(), np.full(5, -np.inf), None),
    ]


@pytest.mark.parametrize("case", range(len(infeasible_cases())))
def test_infeasible_masks_raise(case):
    factor, eu, ev = infeasible_cases()[case]
    msg = "every structure of .* uses a forbidden part"
    with pytest.raises(ValueError, match=msg):
        factor.map(eu, ev)
    for method in ("auto", "pairwise_cg"):
        with pytest.raises(ValueError, match="eta_u.*" + msg):
            sm.solve(factor, eu, ev, method=method)
    etas_v = None if ev is None else [None, ev]
    with pytest.raises(ValueError, match=r"etas_u\[1\].*" + msg):
        sm.solve_batch([factor, factor], [np.zeros(factor.shape_u), eu], etas_v, n_jobs=2)


def test_feasible_corner_cases():
    # the crossing tree is the only allowed tree: non-projective MAP finds it
    crossing = np.full((4, 4), -np.inf)
    for m, h in enumerate([-1, 3, 0, 2]):
        if m:
            crossing[h, m] = 0.0
    r = sm.solve(sm.TreeFactor(3), crossing)
    assert [list(s) for s in r.structures] == [[-1, 3, 0, 2]] and r.weights[0] == 1.0
    # a tall matching leaves a fully forbidden row unmatched
    tall = np.random.default_rng(0).standard_normal((4, 3))
    tall[2] = -np.inf
    r = sm.solve(sm.MatchingFactor(4, 3), tall)
    assert all(s[2] == -1 for s in r.structures) and np.all(r.u[2] == 0.0)
    # single root: one word forced to the root, the others below it
    eta = np.random.default_rng(1).standard_normal((5, 5))
    eta[1:, 1] = -np.inf
    eta[0, 2:] = -np.inf
    for projective in (False, True):
        f = sm.TreeFactor(4, projective=projective, single_root=True)
        r = sm.solve(f, eta)
        assert all(s[1] == 0 and list(s).count(0) == 1 for s in r.structures)


@pytest.mark.parametrize("bad", [-np.inf, np.nan, np.inf])
def test_tree_ignored_entries_accept_anything(bad):
    rng = np.random.default_rng(5)
    for projective, single_root in ((False, False), (True, False), (False, True), (True, True)):
        f = sm.TreeFactor(5, projective, single_root)
        eta = rng.standard_normal((6, 6))
        eta[rng.random((6, 6)) < 0.2] = -np.inf      # masks elsewhere too
        for h in range(6):
            eta[h, 1 + h % 5] = 0.0                   # the chain 0->1->...->5 stays allowed:
                                                      # every problem is feasible
        clean = eta.copy()
        clean[:, 0] = 0.0
        np.fill_diagonal(clean, 0.0)
        dirty = clean.copy()
        dirty[:, 0] = bad
        np.fill_diagonal(dirty, bad)
        ref = sm.solve(f, clean)
        r = sm.solve(f, dirty)
        assert np.array_equal(r.u, ref.u) and np.array_equal(f.map(dirty), f.map(clean))
        stacked = sm.solve_batch(f, np.stack([dirty, clean]))
        assert np.array_equal(stacked[0].u, ref.u)
        assert np.array_equal(sm.solve_batch([f, f], np.stack([dirty, clean]))[0].u, ref.u)
        # directions and gradients may hold anything there too
        d = rng.standard_normal((6, 6))
        d_dirty = d.copy()
        d_dirty[:, 0] = bad
        assert np.array_equal(r.jvp(d_dirty), r.jvp(np.where(np.arange(6) == 0, 0.0, d)))
        assert np.array_equal(r.vjp(d_dirty)[0], r.vjp(np.where(np.arange(6) == 0, 0.0, d))[0])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_plus_inf_stay_errors(bad):
    seq = sm.SequenceFactor(3, 2)
    eu, ev = np.zeros((3, 2)), np.zeros((2, 2, 2))
    eu_bad, ev_bad = eu.copy(), ev.copy()
    eu_bad[1, 1] = bad
    ev_bad[1, 0, 1] = bad
    tree_bad = np.zeros((4, 4))
    tree_bad[1, 2] = bad
    for call, name in [
        (lambda: seq.map(eu_bad), "eta_u"), (lambda: seq.map(eu, ev_bad), "eta_v"),
        (lambda: sm.solve(seq, eu_bad), "eta_u"), (lambda: sm.solve(seq, eu, ev_bad), "eta_v"),
        (lambda: sm.solve(sm.TreeFactor(3), tree_bad), "eta_u"),
        (lambda: sm.solve_batch(seq, np.stack([eu, eu_bad])), r"etas_u\[1\]"),
        (lambda: sm.solve_batch(seq, [eu, eu], np.stack([ev, ev_bad])), r"etas_v\[1\]"),
        (lambda: sm.solve_batch(sm.TreeFactor(3), np.stack([tree_bad, tree_bad])), r"etas_u\[0\]"),
        (lambda: sm.solve(seq, eu).jvp(eu_bad), "d_eta_u"),
        (lambda: sm.solve(seq, eu).jvp(eu, ev_bad), "d_eta_v"),
        (lambda: sm.solve(seq, eu).vjp(eu_bad), "du"),
    ]:
        with pytest.raises(ValueError, match=name + ".*non-finite"):
            call()


def test_directions_refuse_minus_inf():
    f = sm.SequenceFactor(3, 2)
    r = sm.solve(f, np.zeros((3, 2)))
    d = np.zeros((3, 2))
    d[0, 0] = -np.inf
    for call, name in ((lambda: r.jvp(d), "d_eta_u"), (lambda: r.vjp(d), "du"),
                       (lambda: sm.vjp_batch([r], [d]), r"dus\[0\]")):
        with pytest.raises(ValueError, match=name + r".*\(-inf\)"):
            call()


def test_masked_batches_and_warm_starts():
    rng = np.random.default_rng(11)
    f = sm.TreeFactor(6)
    etas = rng.standard_normal((10, 7, 7))
    etas[rng.random(etas.shape) < 0.25] = -np.inf
    etas[:, 0, 1:] = 0.0                               # root arcs keep every problem feasible
    rs = sm.solve_batch(f, etas, n_jobs=2)
    for r, e in zip(rs, etas):
        ref = sm.solve(f, e)
        assert np.array_equal(r.u, ref.u) and np.array_equal(r.weights, ref.weights)
        assert np.all(r.u[np.isneginf(e) & ~np.eye(7, dtype=bool)] == 0.0)
    # a warm start from the unmasked problem skips the structures now forbidden
    plain = rng.standard_normal((7, 7))
    masked = plain.copy()
    masked[rng.random((7, 7)) < 0.3] = -np.inf
    masked[0, 1:] = 0.0
    cold = sm.solve(f, masked)
    warm = sm.solve(f, masked, init=sm.solve(f, plain))
    np.testing.assert_allclose(warm.u, cold.u, atol=1e-10)
    forbidden = np.isneginf(masked) & ~np.eye(7, dtype=bool)
    forbidden[:, 0] = False
    assert all(not np.any(arc_matrix(s)[forbidden]) for s in warm.structures)
    all_forbidden = [np.array([-1, 0, 1, 2, 3, 4, 5])]
    masked[0, 1] = -np.inf
    masked[1, 2] = -np.inf
    masked[0, 2] = 0.0
    np.testing.assert_allclose(sm.solve(f, masked, init=all_forbidden).u, sm.solve(f, masked).u,
                               atol=1e-10)


def test_generic_score_ignores_unused_forbidden_parts():
    f = sm.GenericFactor(_M, _N)
    eu = np.arange(6.0)
    eu[_M[:, 3] == 0] = -np.inf                        # forbid what column 3 does not use
    assert np.isfinite(f.score(3, eu, np.zeros(2)))
    used = np.flatnonzero(_M[:, 4] != 0)
    eu2 = np.zeros(6)
    eu2[used[_M[used, 4] < 0][:1] if np.any(_M[used, 4] < 0) else used[:1]] = -np.inf
    assert f.score(4, eu2, np.zeros(2)) == -np.inf     # -1 * -inf still forbids
