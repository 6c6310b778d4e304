"""MatchingFactor: MAP against brute force and SciPy, the column interface against dense algebra."""
import pickle
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy.optimize import linear_sum_assignment

import sparsemap as sm

from _reference import all_matchings, matching_matrix


# -- independent references ---------------------------------------------------------

def brute_force_best(eta):
    return max(matched_score(eta, s) for s in all_matchings(*eta.shape))


def pairs(s):
    """(row, column) pairs of a compact structure, read without the factor."""
    return [(i, int(c)) for i, c in enumerate(np.asarray(s)) if c != -1]


def matched_score(eta, s):
    return sum(eta[i, c] for i, c in pairs(s))


def assert_valid_matching(s, n_rows, n_cols):
    s = np.asarray(s)
    assert s.shape == (n_rows,)
    assert np.issubdtype(s.dtype, np.integer)
    assert np.all((s == -1) | ((s >= 0) & (s < n_cols)))
    cols = [c for _, c in pairs(s)]
    assert len(cols) == min(n_rows, n_cols)
    assert len(set(cols)) == len(cols)


def close(a, b, rtol=1e-9):
    return abs(a - b) <= rtol * max(1.0, abs(a), abs(b))


# -- strategies ----------------------------------------------------------------------

@st.composite
def score_matrices(draw, max_size=5):
    n_rows = draw(st.integers(1, max_size))
    n_cols = draw(st.integers(1, max_size))
    kind = draw(st.sampled_from(["ties", "floats", "zeros"]))
    if kind == "zeros":
        return np.zeros((n_rows, n_cols))
    if kind == "ties":
        elements = st.integers(-2, 2).map(float)
    else:
        elements = st.floats(-10, 10, allow_nan=False, allow_infinity=False)
    return draw(hnp.arrays(np.float64, (n_rows, n_cols), elements=elements))


@st.composite
def matchings(draw, n_rows, n_cols):
    """A uniformly drawn valid structure, built without the factor."""
    k = min(n_rows, n_cols)
    rows = draw(st.permutations(range(n_rows)))[:k]
    cols = draw(st.permutations(range(n_cols)))[:k]
    s = -np.ones(n_rows, dtype=int)
    s[list(rows)] = cols
    return s


@st.composite
def factor_and_two_structures(draw):
    n_rows = draw(st.integers(1, 6))
    n_cols = draw(st.integers(1, 6))
    return (n_rows, n_cols, draw(matchings(n_rows, n_cols)), draw(matchings(n_rows, n_cols)),
            draw(hnp.arrays(np.float64, (n_rows, n_cols),
                            elements=st.floats(-5, 5, allow_nan=False))))


# -- MAP -----------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(score_matrices())
def test_map_equals_brute_force(eta):
    n_rows, n_cols = eta.shape
    f = sm.MatchingFactor(n_rows, n_cols)
    s = f.map(eta)
    assert_valid_matching(s, n_rows, n_cols)
    assert close(matched_score(eta, s), brute_force_best(eta))
    assert close(f.score(s, eta), matched_score(eta, s))


@pytest.mark.parametrize("n_rows", range(1, 6))
@pytest.mark.parametrize("n_cols", range(1, 6))
def test_map_every_small_shape(n_rows, n_cols):
    rng = np.random.default_rng(100 * n_rows + n_cols)
    f = sm.MatchingFactor(n_rows, n_cols)
    for eta in (rng.integers(-1, 2, (n_rows, n_cols)).astype(float),
                rng.standard_normal((n_rows, n_cols))):
        s = f.map(eta)
        assert_valid_matching(s, n_rows, n_cols)
        assert close(matched_score(eta, s), brute_force_best(eta))


@pytest.mark.parametrize("shape", [(1, 1), (3, 3), (2, 5), (5, 2), (4, 4), (6, 3), (3, 6)])
def test_constant_scores_give_the_diagonal(shape):
    # the documented tie-breaking: row i -> column i while columns last, then -1
    n_rows, n_cols = shape
    f = sm.MatchingFactor(n_rows, n_cols)
    expected = [i if i < n_cols else -1 for i in range(n_rows)]
    for value in (0.0, 1.0, -3.5):
        np.testing.assert_array_equal(f.map(np.full(shape, value)), expected)


@pytest.mark.parametrize("shape", [(10, 10), (37, 37), (80, 80), (10, 60), (60, 10),
                                   (33, 80), (80, 33), (1, 50), (50, 1)])
@pytest.mark.parametrize("kind", ["normal", "ties", "huge", "tiny", "mixed"])
def test_map_matches_scipy(shape, kind):
    rng = np.random.default_rng(zlib.crc32(repr((shape, kind)).encode()))
    f = sm.MatchingFactor(*shape)
    for _ in range(3):
        if kind == "normal":
            eta = rng.standard_normal(shape)
        elif kind == "ties":
            eta = rng.integers(0, 4, shape).astype(float)
        elif kind == "huge":
            eta = 1e12 * rng.standard_normal(shape)
        elif kind == "tiny":
            eta = 1e-12 * rng.standard_normal(shape)
        else:
            eta = rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 7, shape)
        s = f.map(eta)
        assert_valid_matching(s, *shape)
        r, c = linear_sum_assignment(eta, maximize=True)
        expected = eta[r, c].sum()
        got = matched_score(eta, s)
        scale = np.abs(eta).max() * min(shape)
        assert abs(got - expected) <= 1e-9 * scale, (got, expected)


@pytest.mark.parametrize("seed", range(10))
def test_map_extreme_magnitudes_brute_force(seed):
    # near the float64 limit the duals would overflow without the internal scaling
    rng = np.random.default_rng(seed)
    shape = tuple(rng.integers(1, 6, 2))
    eta = rng.uniform(-1, 1, shape) * 1e307
    s = sm.MatchingFactor(*shape).map(eta)
    assert_valid_matching(s, *shape)
    assert close(matched_score(eta, s), brute_force_best(eta))


def test_map_overflowing_magnitudes_scipy():
    # sums of these scores overflow; compare the matching on exactly rescaled scores
    rng = np.random.default_rng(3)
    for shape in [(30, 30), (12, 40), (40, 12)]:
        eta = rng.uniform(-1, 1, shape) * 1.7e308
        s = sm.MatchingFactor(*shape).map(eta)
        assert_valid_matching(s, *shape)
        scaled = eta * 2.0 ** -20
        r, c = linear_sum_assignment(scaled, maximize=True)
        assert close(matched_score(scaled, s), scaled[r, c].sum())


def test_map_is_deterministic_and_layout_independent():
    rng = np.random.default_rng(7)
    eta = rng.integers(0, 3, (9, 6)).astype(float)
    f = sm.MatchingFactor(9, 6)
    s = f.map(eta)
    np.testing.assert_array_equal(f.map(eta), s)
    np.testing.assert_array_equal(f.map(np.asfortranarray(eta)), s)
    np.testing.assert_array_equal(f.map(eta.tolist()), s)
    np.testing.assert_array_equal(f.map(eta.astype(np.float32)), s)


# -- the column interface ---------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(factor_and_two_structures(), st.floats(-3, 3, allow_nan=False))
def test_vertex_score_overlap_add_column(args, w):
    n_rows, n_cols, s, t, eta = args
    f = sm.MatchingFactor(n_rows, n_cols)
    ms, mt = matching_matrix(s, n_cols), matching_matrix(t, n_cols)

    m, n = f.vertex(s)
    np.testing.assert_array_equal(m, ms)
    assert n.shape == (0,)

    assert close(f.score(s, eta), float(np.sum(ms * eta)))
    assert f.overlap(s, t) == np.sum(ms * mt)
    assert f.overlap(s, s) == min(n_rows, n_cols)

    u = eta.copy()
    f.add_column(s, w, u)
    np.testing.assert_allclose(u, eta + w * ms, rtol=0, atol=1e-12)


def test_shapes_and_attributes():
    f = sm.MatchingFactor(3, 5)
    assert (f.n_rows, f.n_cols) == (3, 5)
    assert f.shape_u == (3, 5) and f.shape_v == (0,)
    assert f.n_u == 15 and f.n_v == 0
    assert f.struct_size == 3
    with pytest.raises(AttributeError):
        f.n_rows = 4
    assert repr(f) == "MatchingFactor(3, 5)"


@pytest.mark.parametrize("shape", [(1, 1), (4, 4), (3, 7), (7, 3)])
def test_pickle_round_trip(shape):
    f = sm.MatchingFactor(*shape)
    g = pickle.loads(pickle.dumps(f))
    assert type(g) is sm.MatchingFactor
    assert (g.n_rows, g.n_cols, g.shape_u, g.shape_v) == (f.n_rows, f.n_cols, f.shape_u, f.shape_v)
    eta = np.random.default_rng(0).standard_normal(shape)
    np.testing.assert_array_equal(g.map(eta), f.map(eta))


# -- validation -------------------------------------------------------------------------

@pytest.mark.parametrize("args, name", [
    ((0, 3), "n_rows"), ((-2, 3), "n_rows"), ((2.0, 3), "n_rows"), (("3", 3), "n_rows"),
    ((True, 3), "n_rows"), ((3, 0), "n_cols"), ((3, None), "n_cols"), ((3, 1.5), "n_cols"),
])
def test_bad_sizes(args, name):
    with pytest.raises(ValueError, match=name):
        sm.MatchingFactor(*args)


def test_bad_scores():
    f = sm.MatchingFactor(2, 3)
    for eta in (np.zeros((3, 2)), np.zeros(6), np.zeros((2, 3, 1)), [[1, 2], [3, 4]]):
        with pytest.raises(ValueError, match="eta_u"):
            f.map(eta)
    for bad in (np.nan, np.inf):    # -inf is a mask (tests/test_masks.py)
        eta = np.zeros((2, 3))
        eta[1, 2] = bad
        with pytest.raises(ValueError, match="eta_u"):
            f.map(eta)
        with pytest.raises(ValueError, match="eta_u"):
            f.score([0, 1], eta)
    with pytest.raises(ValueError, match="eta_v"):
        f.map(np.zeros((2, 3)), np.zeros(3))


@pytest.mark.parametrize("shape, s", [
    ((3, 4), [0, 0, 1]),        # a column used twice
    ((4, 2), [1, -1, 1, -1]),   # a column used twice (tall)
    ((3, 4), [0, 1, 4]),        # out of range
    ((3, 4), [0, 1, -2]),       # out of range
    ((3, 4), [0, 1, -1]),       # too few pairs (wide: every row is matched)
    ((4, 2), [0, -1, -1, -1]),  # too few pairs (tall)
    ((4, 2), [0, 1, -1]),       # wrong length
    ((3, 3), [0, 1, 2, -1]),    # wrong length
    ((3, 3), [[0, 1, 2]]),      # wrong shape
    ((3, 3), [0, 1.5, 2]),      # not integers
])
def test_bad_structures(shape, s):
    f = sm.MatchingFactor(*shape)
    eta = np.zeros(shape)
    ok = f.map(eta)
    with pytest.raises(ValueError, match="^s: "):
        f.vertex(s)
    with pytest.raises(ValueError, match="^s: "):
        f.score(s, eta)
    with pytest.raises(ValueError, match="^s: "):
        f.overlap(s, ok)
    with pytest.raises(ValueError, match="^t: "):
        f.overlap(ok, s)
    with pytest.raises(ValueError, match="^s: "):
        f.add_column(s, 1.0, np.zeros(shape))


def test_valid_tall_structure_is_accepted():
    f = sm.MatchingFactor(4, 2)
    m, _ = f.vertex([-1, 1, -1, 0])
    np.testing.assert_array_equal(m, [[0, 0], [0, 1], [0, 0], [1, 0]])
