"""TreeFactor: MAP against brute force and NetworkX, the column interface against dense arrays."""
import functools
import itertools
import pickle

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sparsemap as sm

from _reference import all_trees as reference_trees, arc_matrix, is_projective, is_tree
from _reference import is_valid_tree as is_valid


MODES = [(False, False), (False, True), (True, False), (True, True)]


# -- brute force over the independent enumeration of tests/_reference.py ---------
@functools.lru_cache(maxsize=None)
def all_trees(n, projective, single_root):
    """Every valid tree, as a (k, n) array of the heads of words 1..n (cached)."""
    trees = reference_trees(n, projective, single_root)
    return np.array([heads[1:] for heads in trees], dtype=int).reshape(len(trees), n)


def brute_force_best(eta, projective, single_root):
    n = eta.shape[0] - 1
    trees = all_trees(n, projective, single_root)
    return eta[trees, np.arange(1, n + 1)].sum(axis=1).max()


def tree_weight(eta, heads):
    return sum(eta[heads[m], m] for m in range(1, len(heads)))


# -- strategies ------------------------------------------------------------------
@st.composite
def scores(draw, n_min=1, n_max=5):
    n = draw(st.integers(n_min, n_max))
    kind = draw(st.sampled_from(["float", "int", "zero"]))
    shape = (n + 1, n + 1)
    if kind == "zero":
        return np.zeros(shape)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if kind == "int":  # many ties
        return rng.integers(-2, 3, size=shape).astype(float)
    return rng.normal(scale=draw(st.sampled_from([1e-3, 1.0, 100.0])), size=shape)


# -- MAP -------------------------------------------------------------------------
@pytest.mark.parametrize("projective,single_root", MODES)
@settings(max_examples=60, deadline=None)
@given(eta=scores())
def test_map_matches_brute_force(projective, single_root, eta):
    n = eta.shape[0] - 1
    f = sm.TreeFactor(n, projective=projective, single_root=single_root)
    heads = f.map(eta)
    assert heads.shape == (n + 1,)
    assert is_valid(list(heads), projective, single_root)
    best = brute_force_best(eta, projective, single_root)
    assert tree_weight(eta, heads) == pytest.approx(best, rel=1e-12, abs=1e-12)
    np.testing.assert_array_equal(f.map(eta), heads)  # deterministic


@pytest.mark.parametrize("projective,single_root", MODES)
def test_map_n6_brute_force(projective, single_root):
    rng = np.random.default_rng(6)
    f = sm.TreeFactor(6, projective, single_root)
    for eta in [rng.normal(size=(7, 7)), rng.integers(-1, 2, size=(7, 7)).astype(float)]:
        heads = f.map(eta)
        assert is_valid(list(heads), projective, single_root)
        assert tree_weight(eta, heads) == pytest.approx(
            brute_force_best(eta, projective, single_root), abs=1e-12)


@pytest.mark.parametrize("projective,single_root", MODES)
def test_single_word(projective, single_root):
    f = sm.TreeFactor(1, projective=projective, single_root=single_root)
    np.testing.assert_array_equal(f.map(np.array([[5.0, -3.0], [7.0, 1.0]])), [-1, 0])


@functools.lru_cache(maxsize=None)
def _spans(i, j):
    """All projective subtrees covering exactly words i..j: (head, arcs) pairs."""
    return [(h, left + right)
            for h in range(i, j + 1)
            for left in _attached(i, h - 1, h)
            for right in _attached(h + 1, j, h)]


@functools.lru_cache(maxsize=None)
def _attached(i, j, h):
    """All ways to cover words i..j by consecutive subtrees whose heads attach to h."""
    if i > j:
        return [()]
    return [arcs + ((h, hd),) + rest
            for k in range(i, j + 1)
            for hd, arcs in _spans(i, k)
            for rest in _attached(k + 1, j, h)]


def projective_trees(n, single_root):
    """Head arrays of words 1..n, generated directly (not by filtering)."""
    if single_root:
        forests = [arcs + ((0, h),) for h, arcs in _spans(1, n)]
    else:
        forests = _attached(1, n, 0)
    out = np.empty((len(forests), n), dtype=int)
    for row, arcs in zip(out, forests):
        for h, m in arcs:
            row[m - 1] = h
    return out


@pytest.mark.parametrize("single_root", [False, True])
def test_projective_generator_agrees_with_filter(single_root):
    for n in range(1, 6):
        got = {tuple(r) for r in projective_trees(n, single_root)}
        assert len(got) == len(projective_trees(n, single_root))
        assert got == {tuple(r) for r in all_trees(n, True, single_root)}


@pytest.mark.parametrize("single_root", [False, True])
def test_projective_n8_against_enumeration(single_root):
    n = 8
    trees = projective_trees(n, single_root)
    f = sm.TreeFactor(n, projective=True, single_root=single_root)
    rng = np.random.default_rng(8)
    for eta in [rng.normal(size=(n + 1, n + 1)),
                rng.integers(-2, 3, size=(n + 1, n + 1)).astype(float)]:
        heads = f.map(eta)
        assert is_valid(list(heads), True, single_root)
        best = eta[trees, np.arange(1, n + 1)].sum(axis=1).max()
        assert tree_weight(eta, heads) == pytest.approx(best, abs=1e-12)


def networkx_best(eta, root_children=None):
    """Weight of the maximum spanning arborescence rooted at 0 (NetworkX)."""
    n = eta.shape[0] - 1
    g = nx.DiGraph()
    for h in range(n + 1):
        for m in range(1, n + 1):
            if h != m and (h != 0 or root_children is None or m in root_children):
                g.add_edge(h, m, weight=eta[h, m])
    t = nx.maximum_spanning_arborescence(g, attr="weight", preserve_attrs=True)
    assert set(t.nodes) == set(range(n + 1))
    assert t.in_degree(0) == 0
    return sum(d["weight"] for _, _, d in t.edges(data=True))


@pytest.mark.parametrize("n", [10, 17, 33, 60])
@pytest.mark.parametrize("kind", ["float", "int"])
def test_nonprojective_matches_networkx(n, kind):
    rng = np.random.default_rng(n)
    f = sm.TreeFactor(n)
    for _ in range(3):
        if kind == "int":
            eta = rng.integers(-3, 4, size=(n + 1, n + 1)).astype(float)
        else:
            eta = rng.normal(size=(n + 1, n + 1))
        heads = f.map(eta)
        assert is_tree(list(heads))
        assert tree_weight(eta, heads) == pytest.approx(networkx_best(eta), abs=1e-9)


@pytest.mark.parametrize("n", [9, 14])
def test_single_root_nonprojective_matches_networkx(n):
    # Independent reference: best over the n choices of the root's only child.
    rng = np.random.default_rng(100 + n)
    f = sm.TreeFactor(n, single_root=True)
    for eta in [rng.normal(size=(n + 1, n + 1)),
                rng.integers(-2, 3, size=(n + 1, n + 1)).astype(float)]:
        eta[0, 1:] += 2.0  # the unconstrained optimum then uses several root arcs
        heads = f.map(eta)
        assert is_valid(list(heads), False, True)
        best = max(networkx_best(eta, root_children={m}) for m in range(1, n + 1))
        assert tree_weight(eta, heads) == pytest.approx(best, abs=1e-9)


@pytest.mark.parametrize("tied", [(3, 5), (2, 9), (4, 8), (1, 6, 7), (5, 9)])
def test_nonprojective_ties_go_to_the_lowest_head(tied):
    """The documented rule, derived by hand: word 10 has equal best in-arcs from
    the words in ``tied`` (every other arc scores 0, arcs from the root 0 too, so no
    cycle forms and every other word takes the root, which wins its ties); the
    lowest of ``tied`` is its head, wherever the argmax's interleaved chains put
    the tied words (positions 1..4 and 5..8 are the chains' blocks, 9 the tail)."""
    n = 10
    f = sm.TreeFactor(n)
    eta = np.zeros((n + 1, n + 1))
    eta[list(tied), 10] = 1.0
    expected = np.zeros(n + 1, dtype=int)
    expected[0] = -1
    expected[10] = min(tied)
    np.testing.assert_array_equal(f.map(eta), expected)
    # with every arc tied, each word takes the root (index 0 before any word)
    np.testing.assert_array_equal(f.map(np.zeros((n + 1, n + 1)))[1:], np.zeros(n, dtype=int))


def test_single_root_with_huge_score_range():
    # A big-constant penalty on root arcs would swamp these scores.
    n = 5
    rng = np.random.default_rng(3)
    eta = rng.normal(scale=1e12, size=(n + 1, n + 1))
    eta[0, 1:] = 1e15
    for projective in (False, True):
        heads = sm.TreeFactor(n, projective, True).map(eta)
        best = brute_force_best(eta, projective, True)
        assert tree_weight(eta, heads) == pytest.approx(best, rel=1e-12)


def test_projective_differs_from_nonprojective():
    # The only tree using all three favoured arcs (0 -> 2, 2 -> 3, 3 -> 1) crosses.
    crossing = [-1, 3, 0, 2]
    eta = np.zeros((4, 4))
    for m in range(1, 4):
        eta[crossing[m], m] = 1.0
    np.testing.assert_array_equal(sm.TreeFactor(3).map(eta), crossing)
    heads_p = sm.TreeFactor(3, projective=True).map(eta)
    assert is_valid(list(heads_p), True, False)
    assert tree_weight(eta, heads_p) == brute_force_best(eta, True, False) == 2.0


def test_ignored_entries():
    # Column 0 and the diagonal never influence MAP.
    rng = np.random.default_rng(0)
    n = 8
    eta = rng.normal(size=(n + 1, n + 1))
    eta2 = eta.copy()
    eta2[:, 0] = 1e6
    eta2[np.diag_indices(n + 1)] = 1e6
    for projective, single_root in MODES:
        f = sm.TreeFactor(n, projective, single_root)
        np.testing.assert_array_equal(f.map(eta), f.map(eta2))


# -- column interface --------------------------------------------------------------
@st.composite
def two_trees(draw):
    n = draw(st.integers(1, 5))
    projective, single_root = draw(st.sampled_from(MODES))
    trees = all_trees(n, projective, single_root)
    i = draw(st.integers(0, len(trees) - 1))
    j = draw(st.integers(0, len(trees) - 1))
    s = np.concatenate([[-1], trees[i]])
    t = np.concatenate([[-1], trees[j]])
    eta = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).normal(size=(n + 1, n + 1))
    return sm.TreeFactor(n, projective, single_root), s, t, eta


@settings(max_examples=100, deadline=None)
@given(two_trees())
def test_vertex_score_overlap_add(args):
    f, s, t, eta = args
    n = f.n_words
    dense_s, dense_t = arc_matrix(s), arc_matrix(t)
    ms, ns = f.vertex(s)
    np.testing.assert_array_equal(ms, dense_s)
    assert ns.shape == (0,)
    assert f.score(s, eta) == pytest.approx((dense_s * eta).sum(), abs=1e-12)
    assert f.overlap(s, t) == (dense_s * dense_t).sum()
    u = np.ones((n + 1, n + 1))
    f.add_column(s, 0.25, u)
    np.testing.assert_allclose(u, 1 + 0.25 * dense_s)


@pytest.mark.parametrize("projective,single_root", MODES)
def test_pickle_and_attributes(projective, single_root):
    f = sm.TreeFactor(7, projective=projective, single_root=single_root)
    g = pickle.loads(pickle.dumps(f))
    assert isinstance(g, sm.TreeFactor)
    assert (g.n_words, g.projective, g.single_root) == (7, projective, single_root)
    assert g.shape_u == (8, 8) and g.shape_v == (0,) and g.struct_size == 8
    eta = np.random.default_rng(1).normal(size=(8, 8))
    np.testing.assert_array_equal(f.map(eta), g.map(eta))
    assert "TreeFactor(7" in repr(f)


# -- validation ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -3, 2.0, "4", None, True, 46340])
def test_bad_n_words(bad):
    with pytest.raises(ValueError, match="n_words"):
        sm.TreeFactor(bad)


@pytest.mark.parametrize("name", ["projective", "single_root"])
def test_bad_flags(name):
    with pytest.raises(ValueError, match=name):
        sm.TreeFactor(3, **{name: "yes"})


def test_bad_scores():
    f = sm.TreeFactor(3)
    with pytest.raises(ValueError, match="eta_u"):
        f.map(np.zeros((3, 3)))
    with pytest.raises(ValueError, match="eta_u"):
        f.map(np.zeros((4, 5)))
    for bad in (np.nan, np.inf):    # -inf is a mask (tests/test_masks.py)
        eta = np.zeros((4, 4))
        eta[1, 2] = bad
        with pytest.raises(ValueError, match="eta_u"):
            f.map(eta)


@pytest.mark.parametrize("heads", [
    [0, 0, 1, 2],        # heads[0] != -1
    [-1, 0, 1],          # wrong length
    [-1, 0, 4, 1],       # out of range
    [-1, 0, -1, 1],      # out of range
    [-1, 0, 2, 1],       # self-loop
    [-1, 2, 3, 1],       # cycle 1 -> 3 -> 2 -> 1 (arcs head -> word)
    [-1, 0, 3, 2],       # cycle 2 <-> 3
    [-1, 0.5, 0, 1],     # not integral
])
def test_invalid_heads(heads):
    f = sm.TreeFactor(3)
    with pytest.raises(ValueError, match="^s: "):
        f.vertex(heads)
    with pytest.raises(ValueError, match="^t: "):
        f.overlap([-1, 0, 1, 2], heads)


def test_mode_specific_heads():
    crossing = [-1, 3, 0, 2]  # arcs 2 -> 3 and 3 -> 1 ... 0 -> 2 crosses 3 -> 1
    assert is_tree(crossing) and not is_projective(crossing)
    sm.TreeFactor(3).vertex(crossing)
    with pytest.raises(ValueError, match="projective"):
        sm.TreeFactor(3, projective=True).vertex(crossing)
    two_roots = [-1, 0, 0, 2]
    sm.TreeFactor(3, projective=True).vertex(two_roots)
    with pytest.raises(ValueError, match="root"):
        sm.TreeFactor(3, single_root=True).score(two_roots, np.zeros((4, 4)))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("projective,single_root", MODES)
def test_validation_agrees_with_naive_checker(n, projective, single_root):
    # Every head array with entries in [-1, n] (heads[0] = -1) is accepted
    # exactly when the naive checker calls it valid.
    f = sm.TreeFactor(n, projective, single_root)
    for hs in itertools.product(range(-1, n + 1), repeat=n):
        heads = (-1,) + hs
        try:
            f.vertex(heads)
            ok = True
        except ValueError:
            ok = False
        assert ok == is_valid(heads, projective, single_root), heads


@pytest.mark.parametrize("heads", [
    [0, 0, 1, 2], [-1, 0, 4, 1], [-1, 0, 2, 1], [-1, 2, 3, 1], [-1, 0, 0, 1]])
def test_invalid_heads_message_says_got_once(heads):
    """The reason, then the heads: "got" once (it said "got 4, got heads [...]")."""
    f = sm.TreeFactor(3, single_root=True)
    with pytest.raises(ValueError) as exc:
        f.vertex(heads)
    message = str(exc.value)
    assert message.count("got") <= 1
    assert message.endswith(f"; heads = {heads!r}")
