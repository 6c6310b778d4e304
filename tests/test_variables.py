"""Variables and slices: VariableArray, FactorGraph.add_variables / scores, r.value(x).

References: NumPy's own indexing of an id array (np.arange(...).reshape(...)[key]),
and the low-level index-array form of FactorGraph.add, which the array form must
reproduce exactly.
"""
import pickle

import numpy as np
import pytest

import sparsemap as sm

KEYS = [np.s_[1], np.s_[1:, 2], np.s_[::-1, ::2], np.s_[[0, 2], 1:3], np.s_[[0, 2], [1, 3]],
        np.s_[..., 0], np.s_[np.array([[True, False, True, False]] * 3)], np.s_[None, 0, :2],
        np.s_[-1, [3, 0, 3]]]


@pytest.mark.parametrize("key", KEYS, ids=[repr(k)[:40] for k in KEYS])
def test_indexing_is_numpy_indexing(key):
    fg = sm.FactorGraph()
    x = fg.add_variables((3, 4))
    ref = np.arange(12).reshape(3, 4)[key]
    assert x[key].shape == np.shape(ref)
    np.testing.assert_array_equal(x[key].ids, ref)
    # nested: indexing a slice indexes its ids
    if np.ndim(ref) >= 1 and np.size(ref) >= 2:
        np.testing.assert_array_equal(x[key][::-1].ids, np.asarray(ref)[::-1])


def test_ids_offsets_and_n_variables():
    fg = sm.FactorGraph(2)
    x = fg.add_variables((2, 2))
    y = fg.add_variables(3)
    z = fg.add_variables(())
    assert fg.n_variables == 2 + 4 + 3 + 1
    np.testing.assert_array_equal(x.ids, [[2, 3], [4, 5]])
    np.testing.assert_array_equal(y.ids, [6, 7, 8])
    assert z.shape == () and int(z.ids) == 9
    assert len(y) == 3 and y.ndim == 1 and x.size == 4
    assert [int(v.ids) for v in y] == [6, 7, 8]
    np.testing.assert_array_equal(x.T.ids, [[2, 4], [3, 5]])
    np.testing.assert_array_equal(x.reshape(-1).ids, [2, 3, 4, 5])
    assert repr(x) == "VariableArray(shape=(2, 2))"
    assert repr(~x) == "VariableArray(shape=(2, 2), some negated)"
    with pytest.raises(ValueError, match="ids are read-only|read-only"):
        x.ids[0, 0] = 7


def test_array_form_equals_index_form():
    rng = np.random.default_rng(0)
    fa = sm.FactorGraph()
    x = fa.add_variables((3, 4))
    fi = sm.FactorGraph(12)
    ids = np.arange(12).reshape(3, 4)
    for i in range(3):
        fa.add(sm.XorFactor(4), x[i])
        fi.add(sm.XorFactor(4), ids[i])
    for j in range(4):
        fa.add(sm.AtMostOneFactor(3), x[:, j])
        fi.add(sm.AtMostOneFactor(3), ids[:, j])
    fa.add(sm.ImplyFactor(3), sm.VariableArray.concatenate([~x[0, :1], x[1, 1:3]]))
    fi.add(sm.ImplyFactor(3), [0, 5, 6], negated=[True, False, False])
    fa.add(sm.BudgetFactor(3, 1), x[[0, 1, 2], [3, 2, 1]])
    fi.add(sm.BudgetFactor(3, 1), [3, 6, 9])
    fa.add(sm.PairFactor(), sm.VariableArray.stack([x[2, 0], x[0, 3]]), negated=[False, True])
    fi.add(sm.PairFactor(), [8, 3], negated=[False, True])
    for a, b, na, nb in zip(fa.variables, fi.variables, fa.negated, fi.negated):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(na, nb)
    eta = rng.standard_normal((3, 4))
    ev = [None] * 9 + [np.array([0.7])]
    ra, ri = fa.solve({x: eta}, ev), fi.solve(eta.ravel(), ev)
    np.testing.assert_array_equal(ra.u, ri.u)
    np.testing.assert_array_equal(ra.value(x), ri.u.reshape(3, 4))
    np.testing.assert_array_equal(ra.value(~x[1]), 1 - ri.u[4:8])
    ma, mi = fa.solve_map({x: eta}, ev), fi.solve_map(eta.ravel(), ev)
    np.testing.assert_array_equal(ma.u, mi.u)
    np.testing.assert_array_equal(ma.value(x[:, 1]), mi.u[[1, 5, 9]])
    if ma.map is not None:
        np.testing.assert_array_equal(ma.map.value(x), mi.map.u.reshape(3, 4))


def test_negation_combines_with_negated_argument():
    fg = sm.FactorGraph()
    x = fg.add_variables(3)
    fg.add(sm.OrFactor(3), ~x, negated=[True, False, False])
    np.testing.assert_array_equal(fg.negated[0], [False, True, True])
    fg.add(sm.OrFactor(3), ~x[::-1])
    np.testing.assert_array_equal(fg.variables[1], [2, 1, 0])
    np.testing.assert_array_equal(fg.negated[1], [True, True, True])


def test_scores_sum_batch_and_pairs():
    fg = sm.FactorGraph()
    x = fg.add_variables((2, 2))
    y = fg.add_variables(2)
    np.testing.assert_array_equal(fg.scores({x: [[1, 2], [3, 4]], y: [5, 6]}),
                                  [1, 2, 3, 4, 5, 6])
    # overlapping entries add up; variables with no score get 0
    np.testing.assert_array_equal(fg.scores([(x[0], [1.0, 1.0]), (x[:, 0], [10.0, 10.0])]),
                                  [11, 1, 10, 0, 0, 0])
    batch = np.arange(3 * 2 * 2, dtype=float).reshape(3, 2, 2)
    out = fg.scores({x: batch, y: np.ones((3, 2))})
    assert out.shape == (3, 6)
    np.testing.assert_array_equal(out[:, :4], batch.reshape(3, 4))
    np.testing.assert_array_equal(out[:, 4:], 1.0)
    # one graph, a batch of problems: the same answers as graphs built per problem
    fg.add(sm.XorFactor(2), x[0])
    fg.add(sm.BudgetFactor(3, 1), sm.VariableArray.concatenate([x[1], y[:1]]))
    for b in range(3):
        low = sm.FactorGraph(6)
        low.add(sm.XorFactor(2), [0, 1])
        low.add(sm.BudgetFactor(3, 1), [2, 3, 4])
        np.testing.assert_array_equal(fg.solve(out[b]).u, low.solve(out[b]).u)


def test_bad_input():
    fg = sm.FactorGraph()
    x = fg.add_variables((2, 3))
    other = sm.FactorGraph().add_variables(3)
    with pytest.raises(ValueError, match=r"variables: expected shape \(3,\)"):
        fg.add(sm.XorFactor(3), x[:, 0])
    with pytest.raises(ValueError, match="variables: the VariableArray belongs to another"):
        fg.add(sm.XorFactor(3), other)
    with pytest.raises(ValueError, match="negated: expected shape"):
        fg.add(sm.XorFactor(3), x[0], negated=[True])
    with pytest.raises(ValueError, match="shape: expected a tuple of non-negative integers"):
        fg.add_variables((2, -1))
    with pytest.raises(ValueError, match="shape: expected a tuple of non-negative integers"):
        fg.add_variables(2.5)
    with pytest.raises(ValueError, match=r"assignments\[0\] scores: expected shape \(2, 3\)"):
        fg.scores({x: np.zeros(3)})
    with pytest.raises(ValueError, match=r"assignments\[0\]: scores go on variables"):
        fg.scores({~x: np.zeros((2, 3))})
    with pytest.raises(ValueError, match=r"assignments\[0\]: expected a VariableArray key"):
        fg.scores({0: 1.0})
    with pytest.raises(ValueError, match=r"nan or \+inf"):
        fg.scores({x: np.full((2, 3), np.nan)})
    with pytest.raises(ValueError, match="batch dimensions"):
        fg.scores({x[0]: np.zeros((2, 3)), x[1]: np.zeros((4, 3))})
    with pytest.raises(ValueError, match="assignments: expected a dict"):
        fg.scores(3.0)
    with pytest.raises(ValueError, match="belongs to another"):
        fg.scores({other: np.zeros(3)})
    with pytest.raises(ValueError, match="key: index with integers"):
        x[x]
    with pytest.raises(IndexError):
        x[5]
    with pytest.raises(ValueError, match="^n_variables"):
        sm.FactorGraph(0)                       # unchanged: an explicit count is positive
    r = fg.solve(np.zeros(6))
    late = fg.add_variables(2)                  # declared after the solve
    with pytest.raises(ValueError, match="x: variable ids out of range"):
        r.value(late)
    with pytest.raises(ValueError, match="x: expected a VariableArray"):
        r.value([0, 1])


def test_pickle():
    fg = sm.FactorGraph()
    x = fg.add_variables((2, 2))
    fg.add(sm.XorFactor(2), ~x[0])
    g, y = pickle.loads(pickle.dumps((fg, x)))
    assert y._graph is g and g.n_variables == 4
    np.testing.assert_array_equal(y.ids, x.ids)
    g.add(sm.XorFactor(2), y[1])                # still this graph's variables
    fg.add(sm.XorFactor(2), x[1])
    eta = np.array([[0.3, -0.2], [1.0, 0.1]])
    np.testing.assert_array_equal(g.solve({y: eta}).value(y), fg.solve({x: eta}).value(x))
