"""Tensor-shaped binary variables of a factor graph, and NumPy-style slices of them.

A :class:`VariableArray` is an integer array of variable ids (plus a negation
mask) with NumPy's indexing: basic, fancy and nested indexing all return
another :class:`VariableArray` over the same variables. It carries no scores:
the graph's structure stays separate from the scores, so one graph serves a
whole batch of problems. :meth:`FactorGraph.add` accepts one wherever it takes
an index array; :meth:`FactorGraph.scores` turns per-array scores into the
graph's ``eta_u``; ``r.value(x)`` reads a result per array.
"""
import numpy as np

from sparsemap._factors._base import _real_array


class VariableArray:
    """VariableArray(ids, negated=None, graph=None)

    Binary variables of a :class:`FactorGraph` arranged as an array.

    Made by :meth:`FactorGraph.add_variables`; indexing one (``x[2:, 1]``,
    ``x[[0, 2]]``, ``x[mask]``, ``x[idx][::2]``) gives another over the same
    variables, and ``~x`` stands for the negated literals ``1 - x``.

    Parameters
    ----------
    ids : array_like of int
        The variable of each entry.
    negated : array_like of bool, optional
        Where True, the entry stands for ``1 - u`` (default: nowhere).
    graph : FactorGraph, optional
        The graph the variables belong to (checked when the array is used).

    Attributes
    ----------
    ids : ndarray of intp
        Read-only.
    negated : ndarray of bool
        Read-only, shaped like ``ids``.
    shape : tuple of int
    ndim, size : int

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> fg = sm.FactorGraph()
    >>> x = fg.add_variables((3, 4))
    >>> x
    VariableArray(shape=(3, 4))
    >>> x[1:, 2].ids
    array([ 6, 10])
    >>> x[[0, 2], ::3].ids
    array([[ 0,  3],
           [ 8, 11]])
    >>> (~x[0, :2]).negated
    array([ True,  True])
    """

    __array_ufunc__ = None      # keep NumPy from treating it as an array of objects

    def __init__(self, ids, negated=None, graph=None):
        ids = np.array(ids, dtype=np.intp)
        neg = np.zeros(ids.shape, bool) if negated is None else \
            np.broadcast_to(np.asarray(negated, dtype=bool), ids.shape).copy()
        ids.setflags(write=False)
        neg.setflags(write=False)
        self._ids, self._neg, self._graph = ids, neg, graph

    @property
    def ids(self):
        return self._ids

    @property
    def negated(self):
        return self._neg

    @property
    def shape(self):
        return self._ids.shape

    @property
    def ndim(self):
        return self._ids.ndim

    @property
    def size(self):
        return self._ids.size

    def __len__(self):
        return len(self._ids)

    def __getitem__(self, key):
        if isinstance(key, VariableArray):
            raise ValueError("key: index with integers, slices or boolean arrays, "
                             "not with a VariableArray")
        return VariableArray(self._ids[key], self._neg[key], self._graph)

    def __invert__(self):
        return VariableArray(self._ids, ~self._neg, self._graph)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def reshape(self, *shape):
        """The same entries in another shape (as ``numpy.ndarray.reshape``)."""
        return VariableArray(self._ids.reshape(*shape), self._neg.reshape(*shape), self._graph)

    def transpose(self, *axes):
        """The same entries with axes permuted (as ``numpy.ndarray.transpose``)."""
        return VariableArray(self._ids.transpose(*axes), self._neg.transpose(*axes),
                             self._graph)

    @property
    def T(self):
        return self.transpose()

    def ravel(self):
        return self.reshape(-1)

    @staticmethod
    def concatenate(arrays, axis=0):
        """Join variable arrays along an axis (as ``numpy.concatenate``).

        Examples
        --------
        >>> import sparsemap as sm
        >>> fg = sm.FactorGraph()
        >>> x, y = fg.add_variables(3), fg.add_variables(2)
        >>> sm.VariableArray.concatenate([x[:2], ~y[1:]]).ids
        array([0, 1, 4])
        """
        arrays = _same_graph(arrays, "arrays")
        return VariableArray(np.concatenate([a.ids for a in arrays], axis),
                             np.concatenate([a.negated for a in arrays], axis), arrays[0]._graph)

    @staticmethod
    def stack(arrays, axis=0):
        """Stack variable arrays along a new axis (as ``numpy.stack``).

        Examples
        --------
        >>> import sparsemap as sm
        >>> fg = sm.FactorGraph()
        >>> x = fg.add_variables((2, 3))
        >>> sm.VariableArray.stack([x[0, 0], x[1, 2]]).ids   # a pair
        array([0, 5])
        """
        arrays = _same_graph(arrays, "arrays")
        return VariableArray(np.stack([a.ids for a in arrays], axis),
                             np.stack([a.negated for a in arrays], axis), arrays[0]._graph)

    def __repr__(self):
        neg = ", some negated" if self._neg.any() else ""
        return f"VariableArray(shape={self.shape}{neg})"

    def __reduce__(self):
        return (VariableArray, (np.array(self._ids), np.array(self._neg), self._graph))


def _same_graph(arrays, name):
    arrays = list(arrays)
    if not arrays or not all(isinstance(a, VariableArray) for a in arrays):
        raise ValueError(f"{name}: expected a non-empty sequence of VariableArray")
    if any(a._graph is not arrays[0]._graph for a in arrays):
        raise ValueError(f"{name}: the arrays belong to different factor graphs")
    return arrays


def _check_mine(graph, x, name):
    if x._graph is not None and x._graph is not graph:
        raise ValueError(f"{name}: the VariableArray belongs to another factor graph")
    if x.size and (x.ids.min() < 0 or x.ids.max() >= graph.n_variables):
        raise ValueError(f"{name}: variable ids out of range [0, {graph.n_variables})")


def unpack(graph, variables, negated):
    """``(variables, negated)`` for :meth:`FactorGraph.add`: a VariableArray becomes its
    ids, and its negation mask combines (exclusive or) with ``negated``."""
    if not isinstance(variables, VariableArray):
        return variables, negated
    _check_mine(graph, variables, "variables")
    if negated is None:
        return variables.ids, (variables.negated if variables.negated.any() else None)
    neg = np.asarray(negated)
    if neg.shape != variables.shape or neg.dtype.kind not in "biu":
        return variables.ids, negated        # add() explains what is wrong
    return variables.ids, variables.negated ^ neg.astype(bool)


def add_variables(graph, shape):
    """:meth:`FactorGraph.add_variables`."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, (bool, np.bool_)):
        shape = (int(shape),)
    try:
        shape = tuple(shape)
    except TypeError:
        raise ValueError(f"shape: expected a tuple of non-negative integers, got {shape!r}") \
            from None
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_))
               and d >= 0 for d in shape):
        raise ValueError(f"shape: expected a tuple of non-negative integers, got {shape!r}")
    n = int(np.prod(shape, dtype=np.int64))
    first = graph.n_variables
    graph.n_variables = first + n
    return VariableArray(np.arange(first, first + n).reshape(shape), None, graph)


def scores(graph, assignments, batch=True):
    """:meth:`FactorGraph.scores`."""
    if isinstance(assignments, dict):
        items = list(assignments.items())
    else:
        try:
            items = [tuple(p) for p in assignments]
        except TypeError:
            items = None
        if items is None or any(len(p) != 2 for p in items):
            raise ValueError("assignments: expected a dict {VariableArray: scores} or a "
                             "sequence of (VariableArray, scores) pairs")
    lead = None
    parts = []
    for k, (x, s) in enumerate(items):
        name = f"assignments[{k}]"
        if not isinstance(x, VariableArray):
            raise ValueError(f"{name}: expected a VariableArray key, got {type(x).__name__}")
        _check_mine(graph, x, name)
        if x.negated.any():
            raise ValueError(f"{name}: scores go on variables, not on negated literals (~x)")
        arr = _real_array(s, f"{name} scores")
        nb = arr.ndim - x.ndim
        if nb < 0 or arr.shape[nb:] != x.shape:
            raise ValueError(f"{name} scores: expected shape {x.shape} (with any leading batch "
                             f"dimensions), got {arr.shape}")
        if np.any(np.isnan(arr) | np.isposinf(arr)):
            raise ValueError(f"{name} scores: contains nan or +inf (-inf is accepted: it fixes "
                             f"a variable at 0, a mask)")
        if lead is None:
            lead = arr.shape[:nb]
        elif arr.shape[:nb] != lead:
            raise ValueError(f"{name} scores: batch dimensions {arr.shape[:nb]} differ from "
                             f"{lead} of the first entry")
        parts.append((x.ids.reshape(-1), arr.reshape(lead + (-1,))))
    lead = () if lead is None else lead
    out = np.zeros(lead + (graph.n_variables,))
    flat = out.reshape(-1, graph.n_variables)
    for ids, arr in parts:
        np.add.at(flat.T, ids, arr.reshape(-1, ids.size).T)
    return out


def read(u, x, name="x"):
    """Values of a VariableArray in a vector of the graph's variables: ``u[ids]``, and
    ``1 - u`` where negated; shaped like ``x``."""
    if not isinstance(x, VariableArray):
        raise ValueError(f"{name}: expected a VariableArray, got {type(x).__name__}")
    if x.size and (x.ids.min() < 0 or x.ids.max() >= u.shape[-1]):
        raise ValueError(f"{name}: variable ids out of range [0, {u.shape[-1]}) (a variable "
                         f"array declared after this solve?)")
    val = u[..., x.ids]
    return np.where(x.negated, 1 - val, val)
