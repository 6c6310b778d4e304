"""The peaked-score tests that choose between the two sides (decline_peaked).

The counts the compiled tests use (single_head_count, single_row_count) are checked
against a NumPy reimplementation from their definition (a block's sparsemax has a single
nonzero exactly when its best allowed score beats the second by at least 1); the
choice must never change the answer: the default, the forced vertex side and the forced
facet side agree at peaked, flat and masked scores.
"""
import warnings

import numpy as np
import pytest

import sparsemap as sm
from sparsemap._facet_matching import single_row_count
from sparsemap._facet_tree import single_head_count

from _reference import sparsemax


def reference_single(blocks):
    """(single, forced) over a list of 1-d arrays of allowed and forbidden (-inf) scores,
    by sparsemax itself."""
    single = forced = 0
    for x in blocks:
        allowed = x[np.isfinite(x)]
        if allowed.size == 0:
            continue
        p = sparsemax(allowed)
        single += np.count_nonzero(p > 0) == 1
        forced += allowed.size == 1
    return single, forced


def tree_columns(eta):
    n1 = eta.shape[0]
    return [np.delete(eta[:, m], m) for m in range(1, n1)]


def random_scores(rng, shape, scale, p_mask):
    eta = scale * rng.standard_normal(shape)
    eta[rng.random(shape) < p_mask] = -np.inf
    return eta


@pytest.mark.parametrize("scale", [0.1, 0.7, 2.0, 10.0])
@pytest.mark.parametrize("p_mask", [0.0, 0.3, 0.9])
def test_single_head_count_against_sparsemax(scale, p_mask):
    rng = np.random.default_rng(int(10 * scale) + int(100 * p_mask))
    for n in (1, 2, 7, 30):
        eta = random_scores(rng, (n + 1, n + 1), scale, p_mask)
        eta[np.arange(n + 1), np.arange(n + 1)] = rng.standard_normal(n + 1) * 100  # ignored
        eta[:, 0] = 100.0                                                            # ignored
        assert single_head_count(eta) == reference_single(tree_columns(eta))


def test_single_head_count_exact_gap_and_masks():
    eta = np.zeros((4, 4))
    eta[0, 1], eta[2, 1] = 1.0, 0.0           # word 1: gap exactly 1 -> single
    eta[0, 2], eta[1, 2] = 0.5, 0.0           # word 2: gap 0.5 -> not
    eta[:, 3] = -np.inf                        # word 3: no allowed head -> neither
    eta[3, 1] = eta[3, 2] = -np.inf
    assert single_head_count(eta) == (1, 0)
    eta[1, 2] = -np.inf
    eta[3, 2] = -np.inf
    assert single_head_count(eta) == (2, 1)   # word 2: one allowed head (forced)
    with pytest.raises(ValueError, match="eta"):
        single_head_count(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="eta"):
        single_head_count(np.zeros((1, 1)))


@pytest.mark.parametrize("shape", [(1, 1), (5, 5), (4, 9), (9, 4), (30, 50)])
@pytest.mark.parametrize("p_mask", [0.0, 0.4, 0.95])
def test_single_row_count_against_sparsemax(shape, p_mask):
    rng = np.random.default_rng(sum(shape) + int(100 * p_mask))
    for scale in (0.1, 1.0, 5.0):
        eta = random_scores(rng, shape, scale, p_mask)
        rows = eta if shape[0] <= shape[1] else eta.T    # the shorter side's rows
        assert single_row_count(eta) == reference_single(list(rows))
    with pytest.raises(ValueError, match="eta"):
        single_row_count(np.zeros((0, 3)))


def solve_all(f, eta_u, eta_v=None):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return [sm.solve(f, eta_u, eta_v, method=m) for m in ("auto", "vertex", "facet")]


def agree(rs, rng):
    d, v, fv = rs
    for r in rs:
        assert r.converged
        np.testing.assert_allclose(r.u, v.u, atol=1e-9)
    # at generic scores u is differentiable: one Jacobian, whichever side gives it
    g = rng.standard_normal(v.u.shape)
    for r in (d, fv):
        np.testing.assert_allclose(r.vjp(g)[0], v.vjp(g)[0], atol=1e-7)


@pytest.mark.parametrize("single_root", [False, True])
@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])
def test_trees_the_choice_does_not_change_the_answer(single_root, scale):
    rng = np.random.default_rng(int(scale * 100) + single_root)
    f = sm.TreeFactor(12, single_root=single_root)
    eta = scale * rng.standard_normal(f.shape_u)
    rs = solve_all(f, eta)
    agree(rs, rng)
    # the default takes the side the compiled rule names: facet when flat, vertex when
    # nearly every word has a single head
    single, forced = single_head_count(eta)
    if single == 0:
        assert rs[0].side == "facet"
    if single == f.n_words:
        assert rs[0].side == "vertex"


@pytest.mark.parametrize("scale", [0.05, 8.0])
def test_trees_with_masks_forced_heads_do_not_count(scale):
    """Words whose head the masks force have a single head at any scale; they count
    neither way, so flat scores with many forced words still take the facet side."""
    rng = np.random.default_rng(5)
    f = sm.TreeFactor(14)
    eta = scale * rng.standard_normal(f.shape_u)
    for m in range(1, 11):                 # words 1..10: only the root may head them
        eta[1:, m] = -np.inf
    single, forced = single_head_count(eta)
    assert forced == 10 and single >= 10
    rs = solve_all(f, eta)
    agree(rs, rng)
    for r in rs:
        np.testing.assert_allclose(r.u[0, 1:11], 1.0, atol=1e-12)
    if scale < 0.1:
        assert single == forced and rs[0].side == "facet"


@pytest.mark.parametrize("shape", [(8, 8), (6, 10), (10, 6)])
@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])
def test_matchings_the_choice_does_not_change_the_answer(shape, scale):
    rng = np.random.default_rng(sum(shape) + int(10 * scale))
    f = sm.MatchingFactor(*shape)
    eta = scale * rng.standard_normal(shape)
    rs = solve_all(f, eta)
    agree(rs, rng)
    if single_row_count(eta)[0] == 0:
        assert rs[0].side == "facet"
    if single_row_count(eta)[0] == min(shape):
        assert rs[0].side == "vertex"


def test_matchings_with_masks():
    rng = np.random.default_rng(11)
    f = sm.MatchingFactor(6, 9)
    eta = 0.05 * rng.standard_normal((6, 9))
    eta[:3, 1:] = -np.inf                  # row 0: column 0 only
    eta[1:3, 0] = -np.inf
    eta[1, 1] = eta[2, 2] = 0.0            # rows 1, 2: columns 1, 2 only
    single, forced = single_row_count(eta)
    assert forced == 3 and single == 3
    rs = solve_all(f, eta)
    agree(rs, rng)
    assert rs[0].side == "facet"
    assert rs[0].u[0, 0] == 1.0 and rs[0].u[1, 1] == 1.0 and rs[0].u[2, 2] == 1.0


@pytest.mark.parametrize("scale", [0.05, 1.0, 5.0])
def test_sequences_the_choice_does_not_change_the_answer(scale):
    rng = np.random.default_rng(int(100 * scale))
    f = sm.SequenceFactor(8, 4)
    eta_u = scale * rng.standard_normal(f.shape_u)
    eta_v = scale * rng.standard_normal(f.shape_v)
    d, v, fv = solve_all(f, eta_u, eta_v)
    for r in (d, fv):
        assert r.converged
        np.testing.assert_allclose(r.u, v.u, atol=1e-9)


def reference_spread(eta_u, eta_v):
    """Pooled standard deviations over finite entries: eta_v about each transition's
    mean (every k-th transition, k = 1 + (n - 1) S^2 // 2048, as documented), eta_u
    about each position's."""
    k = 1 + eta_v.size // 2048
    eta_v = eta_v[::k]
    def pooled(x, axes):
        x = np.where(np.isfinite(x), x, np.nan)
        dev = x - np.nanmean(x, axis=axes, keepdims=True)
        return np.sqrt(np.nanmean(dev ** 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # all-masked groups
        return pooled(eta_v, (1, 2)), pooled(eta_u, 1)


@pytest.mark.parametrize("p_mask", [0.0, 0.3])
def test_transition_spread_against_numpy(p_mask):
    from sparsemap._facet_sequence import transition_spread
    rng = np.random.default_rng(int(10 * p_mask))
    for n, S, su, sv in [(2, 1, 1.0, 1.0), (5, 3, 0.1, 0.0), (9, 4, 1.0, 0.3),
                          (30, 17, 0.01, 5.0), (8, 40, 1.0, 0.1)]:
        eta_u = su * rng.standard_normal((n, S)) + rng.standard_normal((n, 1))
        eta_v = sv * rng.standard_normal((n - 1, S, S)) + rng.standard_normal((n - 1, 1, 1))
        eta_u[rng.random(eta_u.shape) < p_mask] = -np.inf
        eta_v[rng.random(eta_v.shape) < p_mask] = -np.inf
        got_v, got_u, _ = transition_spread(eta_u, eta_v)
        ref_v, ref_u = reference_spread(eta_u, eta_v)
        # a group with a single finite entry has no spread; per-group shifts do not count
        np.testing.assert_allclose([got_v, got_u], [np.nan_to_num(ref_v), np.nan_to_num(ref_u)],
                                   rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="eta_v"):
        transition_spread(np.zeros((3, 2)), np.zeros((3, 2, 2)))


def test_sequences_choose_by_the_spread_of_the_transitions():
    from sparsemap._facet_sequence import transition_spread
    rng = np.random.default_rng(3)
    f = sm.SequenceFactor(20, 5)
    flat_u = 0.05 * rng.standard_normal(f.shape_u)
    for eta_u, eta_v in [(flat_u, np.zeros(f.shape_v)),
                         (flat_u, 1e-3 * rng.standard_normal(f.shape_v)),
                         (5 * rng.standard_normal(f.shape_u), 5 * rng.standard_normal(f.shape_v)),
                         (0.05 * rng.standard_normal(f.shape_u), rng.standard_normal(f.shape_v))]:
        declines = transition_spread(eta_u, eta_v)[2]
        d, v, fv = solve_all(f, eta_u, eta_v)
        assert d.side == ("vertex" if declines else "facet")
        assert fv.side == "facet" and v.side == "vertex"
        for r in (d, fv):
            np.testing.assert_allclose(r.u, v.u, atol=1e-9)
    assert not transition_spread(flat_u, np.zeros(f.shape_v))[2]
    assert transition_spread(5 * flat_u, 5 * rng.standard_normal(f.shape_v))[2]


def test_sequences_with_masks():
    rng = np.random.default_rng(4)
    f = sm.SequenceFactor(10, 4)
    for scale in (0.05, 5.0):
        eta_u = scale * rng.standard_normal(f.shape_u)
        eta_v = scale * rng.standard_normal(f.shape_v)
        eta_u[2, 1:] = -np.inf                 # position 2: tag 0 forced
        eta_v[4, 0, :] = -np.inf               # no transition out of tag 0 at 4 but to 3
        eta_v[4, 0, 3] = 0.0
        d, v, fv = solve_all(f, eta_u, eta_v)
        for r in (d, fv):
            np.testing.assert_allclose(r.u, v.u, atol=1e-9)
        np.testing.assert_allclose(d.u[2], [1, 0, 0, 0], atol=1e-12)


def test_every_block_forced_is_not_peaked():
    """When the masks force every head (every row), nothing is left to choose: the test
    must not decline (it used to, as 0 >= 0)."""
    from sparsemap._facet import facet_solver
    f = sm.MatchingFactor(1, 1)
    assert single_row_count(np.zeros((1, 1))) == (1, 1)
    assert facet_solver(f).solve(np.zeros((1, 1))).status == 0
    f = sm.MatchingFactor(2, 3)
    eta = np.array([[0.0, -np.inf, -np.inf], [-np.inf, 5.0, -np.inf]])
    assert facet_solver(f).solve(eta).status == 0
    f = sm.TreeFactor(3)
    eta = np.full((4, 4), -np.inf)
    eta[0, 1] = eta[1, 2] = eta[2, 3] = 1.0       # the chain 0 -> 1 -> 2 -> 3, forced
    assert single_head_count(eta) == (3, 3)
    sol = facet_solver(f).solve(eta)
    assert sol.status == 0
    np.testing.assert_allclose(sol.u[[0, 1, 2], [1, 2, 3]], 1.0, atol=1e-12)
