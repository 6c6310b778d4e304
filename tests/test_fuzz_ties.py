"""Exact at ties: the derivative where scores tie, masked structures, a fuzz sample.

The fast sample of ``tests/fuzz_ties.py`` (brute-force enumeration, an independent
QP certified by its gap, one-sided finite differences of it deciding where ``u`` is
differentiable), on the default method, ``"facet"`` and ``"vertex"``; and the
closed forms the facet side's rule for the Jacobian at ties must reproduce: the
projection onto the null space of every constraint tight at ``u``.
Long runs: ``python tests/fuzz_ties.py --n 100000``.
"""
import warnings

import numpy as np
import pytest

import sparsemap as sm
from _reference import null_space_projection, tree_tight_rows
from fuzz_ties import METHODS, Reference, check_instance, run, tree_rule_jvp

@pytest.mark.parametrize("family,n,seed", [("tree", 800, 0), ("tree", 800, 1),
                                           ("matching", 800, 0), ("matching", 800, 1)])
def test_fuzz_sample(family, n, seed):
    counts, failures = run(n, seed, (family,), verbose=False)
    assert not failures, [f[:6] for f in failures[:5]]
    for method in METHODS:
        c = counts[(family, method)]
        assert c["instances"] == n
        # the sample must reach differentiable points at ties, not only skip them
        assert c["jacobian checked"] >= n // 3


def test_fuzz_sample_sequences():
    counts, failures = run(800, 0, ("sequence",), verbose=False)
    assert not failures, [f[:6] for f in failures[:5]]
    for method in METHODS:
        assert counts[("sequence", method)]["jacobian checked"] >= 200


def test_matching_row_tight_with_zero_multiplier():
    """The case worked by hand: u(eta + t e00) = [[1/2 + t/4, 1/2 - t/4], [1/2 - t/4,
    1/2 + t/4], [0, 0]] for small |t| (rows 0 and 1 stay at sum 1 with a zero
    multiplier), so the derivative along e00 is [[1, -1], [-1, 1], [0, 0]] / 4."""
    f = sm.MatchingFactor(3, 2)
    eta = np.array([[0., 0.], [0., 0.], [-1., -1.]])
    d = np.zeros((3, 2))
    d[0, 0] = 1
    expected = np.array([[1., -1.], [-1., 1.], [0., 0.]]) / 4
    for method in METHODS:
        r = sm.solve(f, eta, method=method)
        np.testing.assert_allclose(r.u, [[.5, .5], [.5, .5], [0, 0]], atol=1e-12)
        np.testing.assert_allclose(r.jvp(d), expected, atol=1e-12)
        np.testing.assert_allclose(r.vjp(d)[0], expected, atol=1e-12)
    # and the transpose orientation
    r = sm.solve(sm.MatchingFactor(2, 3), eta.T, method="facet")
    np.testing.assert_allclose(r.jvp(d.T), expected.T, atol=1e-12)


@pytest.mark.parametrize("single_root", [False, True])
@pytest.mark.parametrize("n", [2, 3, 4, 6, 9, 12, 16])
def test_tree_zero_scores_closed_form(n, single_root):
    """At eta = 0 every arc is 1/n and the set of all words is tight (the root's arcs
    sum to 1) with a zero multiplier: the Jacobian is the projection onto the null
    space of the words' rows and the root's row."""
    f = sm.TreeFactor(n, single_root=single_root)
    N = n + 1
    eta = np.zeros((N, N))
    allowed = np.ones((N, N), dtype=bool)
    allowed[:, 0] = False
    allowed[np.arange(N), np.arange(N)] = False
    A = []
    for m in range(1, N):
        r = np.zeros((N, N))
        r[:, m] = 1
        A.append((r * allowed).ravel())
    r = np.zeros((N, N))
    r[0, 1:] = 1
    A.append(r.ravel())
    J = null_space_projection(np.array(A), allowed.ravel())
    rng = np.random.default_rng(n)
    for method in ("auto", "facet"):
        r = sm.solve(f, eta, method=method)
        assert r.side == "facet"
        np.testing.assert_allclose(r.u[allowed], 1.0 / n, atol=1e-13)
        for _ in range(3):
            d = rng.standard_normal((N, N))
            np.testing.assert_allclose(r.jvp(d).ravel(), J @ d.ravel(), atol=1e-10)
            np.testing.assert_allclose(r.vjp(d)[0].ravel(), J @ d.ravel(), atol=1e-10)


@pytest.mark.parametrize("single_root", [False, True])
def test_tree_jacobian_is_the_null_space_of_all_tight_constraints(single_root):
    """At tied and masked scores, the facet side's Jacobian is the projection onto
    the null space of every constraint tight at u (each tight cut, enumerated here,
    with a zero multiplier or not; every arc at 0), within the positive arcs."""
    rng = np.random.default_rng(11 + single_root)
    checked = 0
    for _ in range(60):
        n = int(rng.integers(2, 6))
        f = sm.TreeFactor(n, single_root=single_root)
        eta = rng.integers(-1, 2, (n + 1, n + 1)).astype(float)
        if rng.integers(2):
            eta[rng.random(eta.shape) < 0.2] = -np.inf
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                r = sm.solve(f, eta, method="facet")
            except ValueError:          # no tree avoids the masks
                continue
        if r.side != "facet":
            continue
        keep = (r.u > 1e-12).ravel()
        J = null_space_projection(tree_tight_rows(r.u, single_root), keep)
        Jr = np.array([r.jvp(e.reshape(eta.shape)).ravel() for e in np.eye(eta.size)]).T
        np.testing.assert_allclose(Jr, J, atol=1e-10)
        checked += 1
    assert checked >= 30


def test_tree_arcs_at_round_off_stay_out_of_the_jacobian():
    """A case the fuzz harness found: word 2's root arc is 1 and its other allowed
    arcs come out of the projection at round-off above 0; they are at 0 on both
    sides of the point, and the Jacobian (one-sided differences of the brute-force
    reference agree) must not move them."""
    eta = np.array([[-0.01, -np.inf, 0.01, -np.inf],
                    [-0.01, -0.01, 0., -0.01],
                    [-0.01, -0.01, 0.01, 0.01],
                    [0.01, -0.01, 0., 0.]])
    f = sm.TreeFactor(3)
    ref = Reference(f)
    u0 = ref.u(eta)
    h = 1e-6
    for method in ("auto", "facet", "vertex"):
        r = sm.solve(f, eta, method=method)
        for e in np.eye(16)[np.isfinite(eta).ravel()]:
            e = e.reshape(4, 4)
            fwd = (ref.u(eta + h * e) - u0) / h
            bwd = (u0 - ref.u(eta - h * e)) / h
            np.testing.assert_allclose(fwd, bwd, atol=1e-8)
            np.testing.assert_allclose(r.jvp(e), fwd, atol=1e-7)


@pytest.mark.parametrize("single_root", [False, True])
def test_tree_structures_avoid_masked_arcs(single_root):
    """r.structures on the facet side holds no tree through a -inf arc, however small
    its weight, and the weights rebuild u."""
    rng = np.random.default_rng(5 + single_root)
    seen = 0
    for _ in range(150):
        n = int(rng.integers(2, 7))
        f = sm.TreeFactor(n, single_root=single_root)
        eta = rng.integers(-2, 3, (n + 1, n + 1)) * 10.0 ** rng.uniform(-3, 1)
        eta[rng.random(eta.shape) < 0.3] = -np.inf
        for method in ("auto", "facet"):
            try:
                r = sm.solve(f, eta, method=method)
            except ValueError:
                break
            for s in r.structures:
                assert all(eta[s[m], m] > -np.inf for m in range(1, n + 1)), (eta, s)
            rebuilt = sum(w * f.vertex(s)[0] for s, w in zip(r.structures, r.weights))
            np.testing.assert_allclose(rebuilt, r.u, atol=1e-9)
            seen += r.side == "facet"
    assert seen >= 100


def test_tree_structures_avoid_masked_arcs_tiny_scores():
    """A case the fuzz harness found: scores near 1e-12 with two masked arcs, where the
    decomposition of the facet side's u used to hold two trees through -inf arcs
    with weights near 7e-14."""
    eta = np.array([[1.17204913e-13, -4.86976937e-12, 5.51690203e-12, -1.30698053e-11],
                    [8.46787834e-12, 1.13558799e-11, -np.inf, 5.45809067e-12],
                    [-7.49416036e-13, -2.28216339e-12, -4.50850073e-12, 8.85319558e-12],
                    [4.49558542e-12, 2.51557954e-12, -np.inf, 8.79955745e-12]])
    f = sm.TreeFactor(3, single_root=True)
    for method in ("auto", "facet"):
        r = sm.solve(f, eta, method=method)
        assert r.side == "facet"
        for s in r.structures:
            assert all(eta[s[m], m] > -np.inf for m in range(1, 4)), s
        rebuilt = sum(w * f.vertex(s)[0] for s, w in zip(r.structures, r.weights))
        np.testing.assert_allclose(rebuilt, r.u, atol=1e-12)


def test_matching_structures_avoid_masked_pairs():
    rng = np.random.default_rng(6)
    seen = 0
    for _ in range(150):
        nr, nc = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        f = sm.MatchingFactor(nr, nc)
        eta = rng.integers(-1, 2, (nr, nc)).astype(float)
        eta[rng.random(eta.shape) < 0.3] = -np.inf
        try:
            r = sm.solve(f, eta, method="facet")
        except ValueError:
            continue
        for s in r.structures:
            assert all(c < 0 or eta[i, c] > -np.inf for i, c in enumerate(s)), (eta, s)
        seen += r.side == "facet"
    assert seen >= 50


def test_matching_structures_at_large_scores():
    """A case the fuzz harness found: three equal rows of scores near 1e6, where u
    meets its sums to about 3e-10 each and the Birkhoff-von Neumann decomposition
    used to raise on the shortfall. The structures are the three matchings of the
    first three columns (each column at 1/3 in every row, worked by hand)."""
    row = [-1138171.142839575, 301963.77259009134, -185823.8600554408,
           -1974378.5130890587, -2229886.3206652896]
    eta = np.array([row] * 3)
    for f, e in ((sm.MatchingFactor(3, 5), eta), (sm.MatchingFactor(5, 3), eta.T)):
        r = sm.solve(f, e, method="facet")
        expected = np.zeros((3, 5))
        expected[:, :3] = 1 / 3
        np.testing.assert_allclose(r.u, expected if f.n_rows == 3 else expected.T, atol=1e-9)
        assert len(r.structures) == 3
        np.testing.assert_allclose(r.weights, 1 / 3, atol=1e-9)
        rebuilt = sum(w * f.vertex(s)[0] for s, w in zip(r.structures, r.weights))
        np.testing.assert_allclose(rebuilt, r.u, atol=1e-8)


VERTEX_SHORT = [
    # the two of the harness's long run (120,000 instances)
    (sm.MatchingFactor(3, 5), [[0.002, 0.002, -0.002, 0.0, 0.0], [0.002, 0.0, 0.0, 0.002, -0.002],
                               [0.0, -0.001, 0.002, 0.0, 0.0]]),
    (sm.TreeFactor(5, single_root=True),
     [[-np.inf, -np.inf, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, -np.inf, 0.0, 0.0],
      [-np.inf, -np.inf, 0.0, -np.inf, 0.0, -np.inf], [0.0, -np.inf, 0.0, 0.0, 0.0, 0.0],
      [-np.inf, 0.0, 0.0, 0.0, 0.0, 0.0], [-np.inf, 0.0, 0.0, 0.0, 0.0, 0.0]]),
    # from `python tests/fuzz_ties.py --n 3000 --seed 1 --families matching`: the
    # vertex side's Jacobian was off by 0.47 along the harness's random direction
    (sm.MatchingFactor(4, 5), [[0.002, -0.002, 0.001, -0.001, 0.002],
                               [0.002, 0.002, -0.002, -0.002, 0.001],
                               [0.0, 0.002, -0.002, 0.002, 0.0],
                               [0.002, 0.0, 0.001, -0.002, -0.001]]),
    # from a run of the harness's check on integer scores only (x 0.01): off by 0.095
    (sm.MatchingFactor(4, 5), [[0.0, -0.01, 0.01, 0.01, -0.01], [0.0, -0.01, 0.0, 0.0, 0.01],
                               [0.0, -0.01, 0.0, 0.0, 0.0], [0.01, 0.01, 0.01, -0.01, 0.01]]),
    # the same check, integer scores x 0.01 (off by 0.96), and
    # `python tests/fuzz_ties.py --n 15000 --seed 5 --families tree` (zeros under a
    # mask, without single_root: off by 0.63)
    (sm.MatchingFactor(3, 5), [[0.02, -0.02, -0.01, -0.02, 0.0], [0.0, -0.02, -0.01, 0.02, -0.02],
                               [0.0, -0.01, -0.01, 0.02, -0.02]]),
    (sm.TreeFactor(5),
     [[0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [-np.inf, 0.0, 0.0, -np.inf, 0.0, 0.0],
      [0.0, -np.inf, -np.inf, 0.0, 0.0, 0.0], [-np.inf, -np.inf, 0.0, -np.inf, 0.0, 0.0],
      [0.0, 0.0, 0.0, -np.inf, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, -np.inf]]),
]


def _fd_jacobian(f, eta):
    """The Jacobian of the brute-force reference by one-sided differences on the allowed
    entries, and whether forward and backward ones agree (u differentiable)."""
    ref = Reference(f)
    u0 = ref.u(eta)
    h = 1e-6
    cols, agree = [], True
    for e in np.eye(eta.size)[np.isfinite(eta).ravel()]:
        e = e.reshape(eta.shape)
        fwd = (ref.u(eta + h * e) - u0) / h
        bwd = (u0 - ref.u(eta - h * e)) / h
        agree &= bool(np.abs(fwd - bwd).max() < 1e-8)
        cols.append((e, fwd))
    return cols, agree


@pytest.mark.parametrize("case", range(len(VERTEX_SHORT)))
def test_facet_side_where_the_vertex_side_falls_short(case):
    """Points the fuzz harness found where u is differentiable and the vertex side's
    Jacobian was off (by 0.095 to 0.96 along a random direction): the default method
    and the facet side must be right there."""
    f, eta = VERTEX_SHORT[case]
    eta = np.array(eta)
    cols, agree = _fd_jacobian(f, eta)
    assert agree
    for method in ("auto", "facet"):
        r = sm.solve(f, eta, method=method)
        assert r.side == "facet"
        for e, fwd in cols:
            np.testing.assert_allclose(r.jvp(e), fwd, atol=1e-7)


@pytest.mark.parametrize("case", range(len(VERTEX_SHORT)))
def test_vertex_side_spans_the_face_at_these_ties(case):
    """The vertex side at the same points. Its support spans 11 of the face's 12
    dimensions there, and the first random direction of the face completion happens
    to be nearly orthogonal to the missing one: the vertex the completion's MAP call
    returns does tie and lies outside the support's hull, but moves the perturbed
    score very little. It must still be appended: the Jacobian is then the
    reference's one-sided differences."""
    f, eta = VERTEX_SHORT[case]
    eta = np.array(eta)
    cols, agree = _fd_jacobian(f, eta)
    assert agree
    r = sm.solve(f, eta, method="vertex")
    assert r.side == "vertex"
    for e, fwd in cols:
        np.testing.assert_allclose(r.jvp(e), fwd, atol=1e-7)
    # vjp against the transpose of the differences: <vjp(g), e> = <g, fwd_e>
    g = np.random.default_rng(case).standard_normal(eta.shape)
    gu = r.vjp(g)[0]
    for e, fwd in cols:
        np.testing.assert_allclose(np.sum(gu * e), np.sum(g * fwd), atol=1e-6)


# -- tight cuts with zero multipliers in trees of more than 10 words -------------------
# Four-word blocks of tied scores (found by the harness's tie kinds at four words) whose
# solutions have tight cuts with zero multipliers besides the set of all words: words
# 1 and 3, 2 and 3, 1 to 3, 2 to 4 for the first (the rows of the cuts the dual holds
# do not span them). Trees of more than 10 words used to get no search for such cuts.
TIED_BLOCKS = {
    False: [[1.0, -np.inf, -np.inf, -1.0, -1.0], [1.0, -1.0, 0.0, -np.inf, -np.inf],
            [-1.0, -1.0, 0.0, 1.0, -1.0], [1.0, 0.0, 1.0, -1.0, 1.0],
            [-1.0, -np.inf, 1.0, 0.0, -1.0]],
    True: [[0.0, -1.0, 0.0, 1.0, -1.0], [-1.0, 1.0, -1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0, 0.0],
           [0.0, -1.0, -1.0, 1.0, 0.0], [0.0, -1.0, 1.0, 1.0, 0.0]],
}


def chained(block, n, by_masks):
    """The block's scores on its words, and words k + 1 to n attached in a chain (word
    j to word j - 1) that keeps the block's cuts as they were: by masks (the chain arc
    the only one allowed, no arc from the chain into the block), or by scores (every
    other arc 4 below the chain arc, which then carries all of its word's weight)."""
    block = np.asarray(block)
    k = block.shape[0] - 1
    eta = np.full((n + 1, n + 1), -np.inf if by_masks else -4.0)
    eta[:k + 1, :k + 1] = block
    for j in range(k + 1, n + 1):
        eta[j - 1, j] = 0.0
    return eta


@pytest.mark.parametrize("single_root", [False, True])
@pytest.mark.parametrize("by_masks", [True, False])
def test_tree_tight_cuts_with_zero_multipliers_past_ten_words(single_root, by_masks):
    """A tied block in a 12-word tree: the facet side's Jacobian is the projection onto
    the null space of every tight constraint (enumerated here), its tight cuts with
    zero multipliers included (without them it was off by 1/3 in an entry)."""
    n = 12
    f = sm.TreeFactor(n, single_root=single_root)
    eta = chained(TIED_BLOCKS[single_root], n, by_masks)
    r = sm.solve(f, eta, method="facet")
    assert r.side == "facet"
    np.testing.assert_allclose(r.u, sm.solve(f, eta, method="vertex").u, atol=1e-12)
    rows = tree_tight_rows(r.u, single_root)
    # tight cuts of two to four words (the block's) besides the set of all words
    cuts = rows[n + single_root:].reshape(-1, n + 1, n + 1)
    words = [set(np.flatnonzero(c.any(axis=0))) for c in cuts]
    assert any(2 <= len(s) <= 4 for s in words)
    J = null_space_projection(rows, (r.u > 1e-12).ravel())
    E = np.eye(eta.size)
    Jr = np.array([r.jvp(e.reshape(eta.shape)).ravel() for e in E]).T
    np.testing.assert_allclose(Jr, J, atol=1e-10)
    Jt = np.array([r.vjp(e.reshape(eta.shape))[0].ravel() for e in E])
    np.testing.assert_allclose(Jt, J, atol=1e-10)


def tied_scores(rng, n, kind):
    """Scores of n + 1 nodes with ties: zeros, small integers, a repeated row (every
    head alike for a word) or column (every word alike for a head), optionally under
    -inf masks."""
    N = n + 1
    if kind == "zeros":
        eta = np.zeros((N, N))
    elif kind == "integers":
        eta = rng.integers(-1, 2, (N, N)).astype(float)
    elif kind == "rows":
        eta = np.tile(rng.integers(-2, 3, N).astype(float), (N, 1))
    else:
        eta = np.tile(rng.integers(-2, 3, (N, 1)).astype(float), (1, N)) \
            + np.round(rng.standard_normal((1, N)), 1)
    if rng.integers(2):
        eta[rng.random((N, N)) < 0.2] = -np.inf
    return eta


@pytest.mark.parametrize("kind", ["zeros", "integers", "rows", "columns"])
def test_tree_ties_eleven_to_sixteen_words(kind):
    """Tied trees of 11 to 16 words (both root settings): the harness's check with the
    vertex side as reference (u, the rule with every tight constraint enumerated, and
    both sides' jvp against one-sided differences where they agree along a random
    direction, rare at ties); and along a direction of the smallest face holding u
    (the rule's J g), where u moves with the scores on both sides, one-sided
    differences of the vertex side's u and both sides' jvp all return it."""
    rng = np.random.default_rng(["zeros", "integers", "rows", "columns"].index(kind))
    for i, n in enumerate((11, 13, 16)):
        f = sm.TreeFactor(n, single_root=bool(i % 2))
        eta = tied_scores(rng, n, kind)
        records = check_instance(rng, f, eta, None, kind, ("facet", "vertex"))
        bad = [rec for rec in records if rec[1] not in ("ok", "skip")]
        assert not bad, (n, eta.tolist(), bad)
        if records[0][1] == "skip":
            continue
        r = sm.solve(f, eta, method="facet")
        v = sm.solve(f, eta, method="vertex")
        d = tree_rule_jvp(f, r.u, rng.standard_normal(eta.shape) * np.isfinite(eta), 2.0)
        h = 1e-5
        for t in (h, -h):
            np.testing.assert_allclose((sm.solve(f, eta + t * d, method="vertex").u - v.u) / t,
                                       d, atol=1e-6)
        np.testing.assert_allclose(r.jvp(d), d, atol=1e-10)
        np.testing.assert_allclose(v.jvp(d), d, atol=1e-7)
        # d lies in J's range, which a J missing tight cuts contains too: J itself on
        # a direction off the face is what tells them apart
        g = rng.standard_normal(eta.shape) * np.isfinite(eta)
        np.testing.assert_allclose(r.jvp(g), tree_rule_jvp(f, r.u, g, 2.0), atol=1e-10)
