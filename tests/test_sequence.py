"""SequenceFactor: Viterbi against brute force and a plain NumPy Viterbi."""
import pickle

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sparsemap as sm

from _reference import all_sequences, sequence_column, viterbi


def brute_best(eta_u, eta_v):
    n, m = eta_u.shape
    return max(eta_u[np.arange(n), tags].sum() + eta_v[np.arange(n - 1), tags[:-1], tags[1:]].sum()
               for tags in all_sequences(n, m))


def dense_score(f, s, eta_u, eta_v):
    """a_s . eta, with the column of s built without the package."""
    m, n = sequence_column(np.asarray(s), f.n_states)
    return float((m * eta_u).sum() + (n * eta_v).sum())


@st.composite
def instances(draw):
    n = draw(st.integers(1, 5))
    m = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["normal", "ties", "zeros"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if kind == "normal":
        eu, ev = rng.standard_normal((n, m)), rng.standard_normal((n - 1, m, m))
    elif kind == "ties":
        eu, ev = rng.integers(-1, 2, (n, m)) * 1.0, rng.integers(-1, 2, (n - 1, m, m)) * 1.0
    else:
        eu, ev = np.zeros((n, m)), np.zeros((n - 1, m, m))
    return n, m, eu, ev


@settings(max_examples=150, deadline=None)
@given(instances())
def test_map_matches_brute_force(inst):
    n, m, eu, ev = inst
    f = sm.SequenceFactor(n, m)
    s = f.map(eu, ev)
    assert s.shape == (n,) and s.min() >= 0 and s.max() < m
    assert dense_score(f, s, eu, ev) == pytest.approx(brute_best(eu, ev), abs=1e-12)
    assert f.score(s, eu, ev) == pytest.approx(dense_score(f, s, eu, ev), abs=1e-12)


@pytest.mark.parametrize("n,m", [(20, 10), (50, 20), (100, 5), (1, 7)])
def test_map_matches_numpy_viterbi(n, m):
    rng = np.random.default_rng(n * 1000 + m)
    for _ in range(5):
        eu, ev = rng.standard_normal((n, m)), rng.standard_normal((n - 1, m, m))
        s = sm.SequenceFactor(n, m).map(eu, ev)
        _, best = viterbi(eu, ev)
        assert sm.SequenceFactor(n, m).score(s, eu, ev) == pytest.approx(best, rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_score_overlap_add_match_dense_columns(n, m, seed):
    rng = np.random.default_rng(seed)
    f = sm.SequenceFactor(n, m)
    s, t = rng.integers(0, m, n), rng.integers(0, m, n)
    eu, ev = rng.standard_normal((n, m)), rng.standard_normal((n - 1, m, m))
    ms, ns = f.vertex(s)
    mt, _ = f.vertex(t)
    # the columns, built without the package: one-hot tags, one-hot transition pairs
    ms_ref, ns_ref = sequence_column(s, m)
    np.testing.assert_array_equal(ms, ms_ref)
    np.testing.assert_array_equal(ns, ns_ref)
    assert f.score(s, eu, ev) == pytest.approx(dense_score(f, s, eu, ev), abs=1e-12)
    assert f.overlap(s, t) == float((ms * mt).sum())
    u, v = np.zeros((n, m)), np.zeros((n - 1, m, m))
    f.add_column(s, 0.25, u, v)
    np.testing.assert_array_equal(u, 0.25 * ms)
    np.testing.assert_array_equal(v, 0.25 * ns)


def test_eta_v_optional_means_zeros():
    rng = np.random.default_rng(0)
    eu = rng.standard_normal((4, 3))
    f = sm.SequenceFactor(4, 3)
    np.testing.assert_array_equal(f.map(eu), np.argmax(eu, axis=1))


def test_pickle_and_repr():
    f = sm.SequenceFactor(3, 2)
    g = pickle.loads(pickle.dumps(f))
    assert (g.n_positions, g.n_states) == (3, 2) and repr(g) == "SequenceFactor(3, 2)"
    assert g.shape_u == (3, 2) and g.shape_v == (2, 2, 2)


@pytest.mark.parametrize("args,name", [((0, 3), "n_positions"), ((3, 0), "n_states"),
                                       ((2.5, 3), "n_positions"), ((3, "a"), "n_states"),
                                       ((-1, 2), "n_positions"), ((True, 2), "n_positions")])
def test_bad_sizes(args, name):
    with pytest.raises(ValueError, match=name):
        sm.SequenceFactor(*args)


def test_bad_scores_and_structures():
    f = sm.SequenceFactor(3, 2)
    with pytest.raises(ValueError, match=r"eta_u.*\(3, 2\)"):
        f.map(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"eta_v.*\(2, 2, 2\)"):
        f.map(np.zeros((3, 2)), np.zeros((3, 2, 2)))
    with pytest.raises(ValueError, match="eta_u.*non-finite"):
        f.map(np.array([[0, 1], [np.nan, 0], [0, 0]]))
    with pytest.raises(ValueError, match="eta_v.*non-finite"):
        f.map(np.zeros((3, 2)), np.full((2, 2, 2), np.inf))
    with pytest.raises(ValueError, match="eta_u"):
        f.map("not an array")
    for bad in ([0, 1], [0, 1, 2], [0, -1, 0], [[0, 1, 0]], [0.5, 1, 0], ["a", "b", "c"]):
        with pytest.raises(ValueError, match=r"^s: "):
            f.vertex(bad)
