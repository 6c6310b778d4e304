"""Structured Fenchel-Young losses (Section 4): SparseMAP, margin SparseMAP, and the
MAP-based baselines of Table 1 (structured perceptron, structured SVM).

Notation. A structure ``s`` is a column ``a_s = [m_s; n_s]`` of ``A = [M; N]``;
scores are ``eta = [eta_u; eta_v]`` and ``theta = A^T eta``. A target ``y_t`` is
a distribution over structures (a single structure is a point mass); it enters
every loss only through ``m_t = M y_t``, ``n_t = N y_t``. Every loss here is

    l(eta, y_t) = Omega*_simplex(A^T eta) + Omega(y_t) - eta . A y_t      (eq. 7)

for a convex ``Omega``, hence non-negative and convex in ``eta`` with (sub)gradient
``A (y* - y_t)`` where ``y*`` attains the max in ``Omega*`` (Proposition 2).

Hamming cost. For factors whose columns are 0/1 (sequences, trees, matchings,
``GenericFactor(np.eye(d))``), the cost of predicting ``s`` when the target is
the 0/1 structure ``t`` is ``cost(s) = (1 - m_t) . m_s``: the number of parts of
``s`` that are not in ``t``, i.e. wrong tags for a sequence, wrong heads for a
tree, wrong pairs for a matching, and the 0/1 cost for sparsemax. It is linear
in ``m_s``, so cost-augmented inference only adds ``margin * (1 - m_t)`` to
``eta_u``, and it vanishes at ``t``. For a soft target the same formula is the
expected Hamming cost ``sum_k w_k (1 - m_k) . m_s``.
"""
import numbers
import re

import numpy as np

from sparsemap import _batch
from sparsemap._factors._base import Factor, _first_invalid
from sparsemap._solve import (DEFAULT_TOL, SparseMAPResult, _check_n_jobs, _check_options,
                              _broadcast_shared, _is_shared, _run_batch, _solve_problem)

__all__ = ["sparsemap_loss", "perceptron_loss", "structured_svm_loss", "batch_loss"]

# Soft-target weights must sum to one within this (then they are renormalised).
_WEIGHT_SUM_TOL = 1e-6

_REDUCTIONS = ("mean", "sum", "none")


# -- validation ---------------------------------------------------------------------
def _check_factor(factor):
    if not isinstance(factor, Factor):
        raise ValueError(f"factor: expected a sparsemap Factor, got {type(factor).__name__}")


def _check_reduction(reduction):
    """Refuse a ``reduction`` other than those of :func:`batch_loss` (and the torch losses)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected one of {_REDUCTIONS}, got {reduction!r}")


def _check_nonneg(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not np.isfinite(value) or value < 0:
        raise ValueError(f"{name}: expected a finite non-negative float, got {value!r}")
    return float(value)


def _is_structure_list(factor, first):
    """Whether ``first`` (the head of a 2-tuple) is a list of structures."""
    if not isinstance(first, (list, tuple, np.ndarray)):
        return False
    if factor.struct_size == 1:
        return True
    if isinstance(first, np.ndarray):
        return first.ndim >= 2
    return len(first) == 0 or isinstance(first[0], (list, tuple, np.ndarray))


def _is_dense(factor, s):
    """Whether ``s`` is a dense column (shaped like ``eta_u``) rather than a compact
    structure; when the two shapes coincide (logic factors, a GenericFactor with one
    row) it is read as compact."""
    if factor.shape_u == (factor.struct_size,) or isinstance(s, (numbers.Number, dict)):
        return False
    try:
        return np.shape(s) == factor.shape_u
    except ValueError:   # ragged nested lists
        return False


def _split_target(factor, target):
    """Return ``(structures, weights)`` for any accepted target form (unvalidated)."""
    if _is_dense(factor, target):
        return [target], [1.0]
    if isinstance(target, SparseMAPResult):
        return target.structures, target.weights
    if isinstance(target, dict):
        return list(target.keys()), list(target.values())
    if isinstance(target, (tuple, list)) and len(target) == 2 and \
            _is_structure_list(factor, target[0]):
        return target[0], target[1]
    return [target], [1.0]


def _target_columns(factor, target):
    """Validate ``target`` and return flat ``(m_t, n_t)``.

    Raises ValueError naming ``target`` on a malformed structure or weights
    that are not a distribution.
    """
    if target is None:
        raise ValueError("target: expected a structure or (structures, weights), got None")
    structures, weights = _split_target(factor, target)
    try:
        k = len(structures)
    except TypeError:
        raise ValueError(f"target: expected a list of structures, got {structures!r}")
    if k == 0:
        raise ValueError("target: expected at least one structure, got none")
    S = np.empty((k, factor.struct_size), dtype=np.intc)
    for i, s in enumerate(structures):
        name = "target" if structures[0] is target else f"target structure {i}"
        if _is_dense(factor, s):
            s = factor.from_vertex(s, names=(name, name))
        S[i] = factor.check_structure(s, name)
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"target: weights must be floats ({exc})")
    if w.shape != (k,):
        raise ValueError(f"target: expected {k} weights (one per structure), got shape {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"target: weights must be finite and non-negative, got {w!r}")
    total = w.sum()
    if abs(total - 1.0) > _WEIGHT_SUM_TOL:
        raise ValueError(f"target: weights must sum to 1 (a distribution), got sum {total!r}")
    w = w / total
    m = np.zeros(factor.shape_u)
    n = np.zeros(factor.shape_v)
    for s, ws in zip(S, w):
        if ws > 0:
            factor.add_column(s, float(ws), m, n)
    return m.reshape(-1), n.reshape(-1)


def _setup(factor, eta_u, eta_v, target):
    """Validated flat scores and target columns, and a function that shapes the
    ``eta_v`` gradient as ``eta_v`` was given (summed over the positions for a
    :class:`SequenceFactor`'s shared ``(S, S)`` transition matrix)."""
    _check_factor(factor)
    shared = _is_shared(factor, eta_v)
    if shared:
        eta_v = _broadcast_shared(factor, eta_v, "eta_v")
    eu, ev = factor.check_scores(eta_u, eta_v)
    mt, nt = _target_columns(factor, target)
    for eta, col, name in ((eu, mt, "eta_u"), (ev, nt, "eta_v")):
        if np.any(np.isneginf(eta) & (col != 0)):
            raise ValueError(f"target: uses a part that {name} forbids (-inf there); the "
                             f"loss of an impossible target is infinite")

    def shape_v(g):
        g = g.reshape(factor.shape_v)
        return g.sum(0) if shared else g
    return eu, ev, mt, nt, shape_v


def _flat(x):
    """A flat C-contiguous float64 view (or copy) of ``x``, as the kernels read it."""
    return np.ascontiguousarray(x, dtype=np.float64).reshape(-1)


def _map_columns(factor, eu, ev):
    """Flat dense column ``(m_s, n_s)`` of the MAP structure for validated flat scores."""
    m, n = factor.vertex(factor._map_flat(eu, ev))
    return m.reshape(-1), n.reshape(-1)


# -- losses -----------------------------------------------------------------------
def sparsemap_loss(factor, eta_u, target, eta_v=None, margin=0.0, **solve_kwargs):
    r"""SparseMAP loss and margin SparseMAP loss (Section 4), with their gradient.

    The Fenchel-Young loss (eq. 7) with ``Omega(y) = 1/2 ||M y||^2 - rho(y)`` on
    the simplex, where ``rho(y) = margin * (1 - m_t) . (M y)`` is the Hamming
    cost of ``y`` against the target (see the module notes; ``rho = 0`` when
    ``margin == 0``). With ``u*, v*`` the SparseMAP solution at the
    cost-augmented scores ``eta_u' = eta_u + margin * (1 - m_t)`` and ``eta_v``:

    .. math::

        \ell &= [\eta_u'\cdot u^* + \eta_v\cdot v^* - \tfrac12\|u^*\|^2]
               - [\eta_u'\cdot m_t + \eta_v\cdot n_t - \tfrac12\|m_t\|^2] \\
             &= \eta\cdot(a^* - a_t) + \mathrm{margin}\,(1-m_t)\cdot(u^*-m_t)
               + \tfrac12\|m_t\|^2 - \tfrac12\|u^*\|^2 .

    Each bracket is the cost-augmented SparseMAP objective, at its maximiser and
    at the target, so ``loss >= 0`` and ``loss == 0`` exactly when the target is a
    SparseMAP solution of the cost-augmented problem: the target *wins by the
    margin*. (For sparsemax, ``GenericFactor(np.eye(d))`` and a one-hot target
    ``t``: exactly when ``eta_t - max_{j != t} eta_j >= 1 + margin``.) For a 0/1
    target the cost is zero at the target and non-negative elsewhere, so the
    margin loss is at least the plain loss (``margin = 0``) and increases with
    ``margin``. (The paper writes ``+ rho``; the sign here is the one that makes
    the loss cost-augmented, as for the structured SVM.)

    Parameters
    ----------
    factor : Factor
    eta_u : array_like, shape ``factor.shape_u``
    target : structure, or (structures, weights), dict, or SparseMAPResult
        The gold output: one structure, in the factor's compact form or dense
        (a 0/1 array shaped like ``eta_u``, as :meth:`Factor.vertex` returns
        it; read by :meth:`Factor.from_vertex`), or a distribution over
        structures (``y_t``) given as a pair ``(structures, weights)``, a dict
        ``{structure: weight}`` (structures as ints or tuples), or a
        :class:`SparseMAPResult` (its support and weights). Where the compact
        form has the shape of ``eta_u`` (``shape_u == (struct_size,)``: the
        logic factors, whose compact form is their 0/1 column anyway, and a
        :class:`GenericFactor` with one row, whose compact form is an index),
        an array of that shape is read as compact; convert a dense target with
        :meth:`Factor.from_vertex` first. Weights must be
        non-negative and sum to one. A soft target enters only through
        ``m_t = sum_k w_k m_k`` and ``n_t = sum_k w_k n_k``, with
        ``Omega(y_t) = 1/2 ||m_t||^2`` (and ``rho`` its expected Hamming cost;
        for soft targets ``loss >= plain loss`` is not guaranteed).
    eta_v : array_like, shape ``factor.shape_v``, optional
        Additional scores; zeros when omitted. For a :class:`SequenceFactor`
        (or :class:`SequenceBudgetFactor`), an ``(S, S)`` matrix is one
        transition matrix shared by the positions (as in a CRF), and
        ``grad_eta_v`` is then its ``(S, S)`` gradient.
    margin : float, default 0
        Scale of the Hamming cost; 0 gives the plain SparseMAP loss.
    **solve_kwargs
        Passed to :func:`sparsemap.solve` (``method``, ``max_iter``, ``tol``,
        ``init``).

    Returns
    -------
    loss : float
        Clipped at 0 from below, to absorb round-off of the solver.
    grad_eta_u : ndarray, shape ``factor.shape_u``
        ``u* - m_t``.
    grad_eta_v : ndarray, shape ``factor.shape_v`` (or ``(S, S)``, as ``eta_v``)
        ``v* - n_t``.

    Notes
    -----
    The gradient is ``A (y* - y_t)`` (Proposition 2, property 2). The loss is
    differentiable because ``u*`` is unique, even when ``y*`` is not; with
    ``eta_v`` present, ``v*`` is unique whenever the maximiser is (ties among
    structures with equal ``m_s`` but different ``n_s`` are a measure-zero
    event). The value is evaluated as
    ``1/2 ||u* - m_t||^2 + (eta'.(a* - a_t) - u*.(u* - m_t))`` (equal to the
    formula above), whose two terms are non-negative at an exact solution and
    cancel exactly when ``u* = m_t`` and ``v* = n_t``.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> f = sm.GenericFactor(np.eye(3))
    >>> loss, gu, gv = sm.sparsemap_loss(f, np.array([1.0, 0.5, -1.0]), 1)
    >>> round(loss, 6), gu
    (0.5625, array([ 0.75, -0.75,  0.  ]))
    """
    eu, ev, mt, nt, shape_v = _setup(factor, eta_u, eta_v, target)
    margin = _check_nonneg(margin, "margin")
    if margin > 0:
        eu = eu + margin * (1.0 - mt)
    # the gradient is u - m_t: no backward set is needed (a flat projective tree's would
    # cost more than the solve, and could warn about a Jacobian nobody asked for)
    r = _solve_problem(factor, eu.reshape(factor.shape_u), ev.reshape(factor.shape_v),
                       backward=False, **solve_kwargs)
    u = r.u.reshape(-1)
    v = r.v.reshape(-1)
    gu = u - mt
    gv = v - nt
    # the batch runner's kernel for the value: a batch's losses are these bits
    loss = _batch.loss_value(_flat(eu), _flat(ev), u, gu, gv)
    return loss, gu.reshape(factor.shape_u), shape_v(gv)


def perceptron_loss(factor, eta_u, target, eta_v=None):
    """Structured perceptron loss (Table 1, ``Omega = 0``) and a subgradient.

    ``loss = max_s a_s . eta - a_t . eta``, with subgradient ``a_s - a_t`` at
    the MAP structure ``s`` (``a_t = A y_t`` for a soft target).

    Parameters
    ----------
    factor : Factor
    eta_u : array_like, shape ``factor.shape_u``
    target : structure, or (structures, weights), dict, or SparseMAPResult
        As in :func:`sparsemap_loss` (compact or dense structures).
    eta_v : array_like, shape ``factor.shape_v``, optional
        Additional scores; zeros when omitted. For a :class:`SequenceFactor`
        (or :class:`SequenceBudgetFactor`), an ``(S, S)`` matrix is one
        transition matrix shared by the positions (as in a CRF), and
        ``grad_eta_v`` is then its ``(S, S)`` gradient.

    Returns
    -------
    loss : float
        Non-negative; exactly 0 when the MAP structure is the target.
    grad_eta_u : ndarray, shape ``factor.shape_u``
        ``m_s - m_t``.
    grad_eta_v : ndarray, shape ``factor.shape_v`` (or ``(S, S)``, as ``eta_v``)
        ``n_s - n_t``.

    Notes
    -----
    The loss is not differentiable where MAP has ties; the subgradient then
    uses the factor's deterministic tie-breaking.

    Examples
    --------
    The target scores 2, the best sequence 2.5:

    >>> import numpy as np, sparsemap as sm
    >>> f = sm.SequenceFactor(3, 2)
    >>> eta_u = np.array([[1.0, 0.0], [0.0, 0.5], [1.0, 0.0]])
    >>> loss, g_u, g_v = sm.perceptron_loss(f, eta_u, np.array([0, 0, 0]))
    >>> loss
    0.5
    >>> g_u                              # MAP's column minus the target's
    array([[ 0.,  0.],
           [-1.,  1.],
           [ 0.,  0.]])
    """
    # The structured SVM without its cost term.
    return structured_svm_loss(factor, eta_u, target, eta_v, margin=0.0)


def structured_svm_loss(factor, eta_u, target, eta_v=None, margin=1.0):
    """Structured SVM loss with the Hamming cost (Table 1) and a subgradient.

    Cost-augmented MAP ``s = MAP(eta_u + margin * (1 - m_t), eta_v)``, then

    ``loss = a_s . eta + cost(s) - a_t . eta - cost(y_t)`` with
    ``cost(s) = margin * (1 - m_t) . m_s``,

    the Hamming cost of the module notes (wrong heads for trees, wrong tags for
    sequences, wrong pairs for matchings); for a 0/1 target ``cost(y_t) = 0``,
    giving the usual ``max_s [a_s . eta + cost(s)] - a_t . eta``. For a soft
    target ``cost(y_t) = margin * (1 - m_t) . m_t`` (the Fenchel-Young form
    with ``Omega(y) = -cost . y``, which keeps the loss non-negative). The
    subgradient is ``a_s - a_t``.

    Parameters
    ----------
    factor : Factor
    eta_u : array_like, shape ``factor.shape_u``
    target : structure, or (structures, weights), dict, or SparseMAPResult
        As in :func:`sparsemap_loss` (compact or dense structures).
    eta_v : array_like, shape ``factor.shape_v``, optional
        Additional scores; zeros when omitted. For a :class:`SequenceFactor`
        (or :class:`SequenceBudgetFactor`), an ``(S, S)`` matrix is one
        transition matrix shared by the positions (as in a CRF), and
        ``grad_eta_v`` is then its ``(S, S)`` gradient.
    margin : float, default 1
        Scale of the Hamming cost (non-negative), as in :func:`sparsemap_loss`;
        0 gives the perceptron.

    Returns
    -------
    loss : float
        Non-negative; 0 when the target beats every other structure ``s`` by
        at least ``cost(s)``.
    grad_eta_u : ndarray, shape ``factor.shape_u``
        ``m_s - m_t``.
    grad_eta_v : ndarray, shape ``factor.shape_v`` (or ``(S, S)``, as ``eta_v``)
        ``n_s - n_t``.

    Examples
    --------
    The target is the best sequence, but another one is within the margin:

    >>> import numpy as np, sparsemap as sm
    >>> f = sm.SequenceFactor(3, 2)
    >>> eta_u = np.array([[1.0, 0.0], [0.0, 0.5], [1.0, 0.0]])
    >>> loss, g_u, g_v = sm.structured_svm_loss(f, eta_u, np.array([0, 1, 0]))
    >>> loss
    0.5
    >>> g_u
    array([[ 0.,  0.],
           [ 1., -1.],
           [ 0.,  0.]])
    """
    eu, ev, mt, nt, shape_v = _setup(factor, eta_u, eta_v, target)
    margin = _check_nonneg(margin, "margin")
    eu_aug = eu + margin * (1.0 - mt) if margin > 0 else eu
    ms, ns = _map_columns(factor, eu_aug, ev)
    gu, gv = ms - mt, ns - nt
    # the batch runner's kernel for the value (u None: MAP's), as in sparsemap_loss
    loss = _batch.loss_value(_flat(eu_aug), _flat(ev), None, _flat(gu), _flat(gv))
    return loss, gu.reshape(factor.shape_u), shape_v(gv)


# -- batches ----------------------------------------------------------------------
def batch_loss(loss_fn, factor, etas_u, targets, etas_v=None, reduction="mean", **kwargs):
    """Apply a loss to a batch of examples, one after the other.

    Parameters
    ----------
    loss_fn : callable
        :func:`sparsemap_loss`, :func:`perceptron_loss`,
        :func:`structured_svm_loss`, or any callable with their signature, called
        as ``loss_fn(factor, eta_u, target, eta_v=eta_v, **kwargs)`` (without
        ``eta_v`` when ``etas_v`` is None) and returning ``(loss, g_u, g_v)``.
    factor : Factor or sequence of Factor
        One factor shared by all examples, or one per example (e.g. sentences of
        different lengths).
    etas_u : sequence of array_like, or ndarray of shape ``(B,) + shape_u``
        Unary scores, one entry per example.
    targets : sequence
        One target per example, in any form the loss accepts.
    etas_v : sequence of (array_like or None), ndarray, or None
        Additional scores per example; ``None`` means zeros for every example.
        For a :class:`SequenceFactor` (or :class:`SequenceBudgetFactor`) an
        entry may be one ``(S, S)`` transition matrix shared by the positions
        (a stacked array is then ``(B, S, S)``), as in ``loss_fn``.
    reduction : {"mean", "sum", "none"}, default "mean"
        What to return as the loss: the mean over the batch, the sum, or the
        per-example losses. The gradients are those *of the returned value*:
        per-example gradients divided by ``B`` for ``"mean"``, unscaled for
        ``"sum"`` and ``"none"``.
    **kwargs
        Passed to ``loss_fn`` (e.g. ``margin``, ``method``).

    Returns
    -------
    loss : float, or ndarray of shape (B,) with ``reduction="none"``
    grads_u : ndarray of shape ``(B,) + shape_u``, or list
        Gradient with respect to each example's ``eta_u``; a list when each
        example has its own factor.
    grads_v : ndarray of shape ``(B,) + shape_v``, or list
        Likewise for ``eta_v``: each entry shaped as its ``eta_v`` (``(B, S, S)``
        for shared transition matrices; a list when the shapes differ).

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> f = sm.GenericFactor(np.eye(3))
    >>> loss, gu, gv = sm.batch_loss(sm.sparsemap_loss, f, np.eye(3) * 2,
    ...                              [0, 1, 0])
    >>> round(loss, 6), gu.shape
    (0.666667, (3, 3))
    """
    if not callable(loss_fn):
        raise ValueError(f"loss_fn: expected a callable, got {loss_fn!r}")
    _check_reduction(reduction)
    try:
        B = len(etas_u)
    except TypeError:
        raise ValueError(f"etas_u: expected a sequence of score arrays, got {type(etas_u).__name__}")
    if B == 0:
        raise ValueError("etas_u: expected at least one example, got an empty batch")
    shared = isinstance(factor, Factor)
    factors = [factor] * B if shared else _as_list(factor, "factor", B)
    for i, f in enumerate(factors):
        if not isinstance(f, Factor):
            raise ValueError(f"factor[{i}]: expected a sparsemap Factor, got {type(f).__name__}")
    evs = [None] * B if etas_v is None else _as_list(etas_v, "etas_v", B)
    tgts = _as_list(targets, "targets", B)
    losses = np.empty(B)
    gus, gvs = [], []
    for i in range(B):
        kw = kwargs if evs[i] is None else dict(kwargs, eta_v=evs[i])
        try:
            losses[i], gu, gv = loss_fn(factors[i], etas_u[i], tgts[i], **kw)
        except ValueError as exc:
            raise ValueError(_name_example(str(exc), i, kwargs)) from exc
        gus.append(gu)
        gvs.append(gv)
    if reduction == "mean":
        gus = [g / B for g in gus]
        gvs = [g / B for g in gvs]
    if shared:
        gus = np.stack(gus).reshape((B,) + factor.shape_u)
        # each g_v has the shape of its eta_v: shape_v, or a shared matrix's (S, S)
        if len({g.shape for g in gvs}) == 1:
            gvs = np.stack(gvs)
    if reduction == "none":
        return losses, gus, gvs
    return float(losses.mean() if reduction == "mean" else losses.sum()), gus, gvs


# -- padded batches: the PyTorch losses' path ------------------------------------------
def _target_rows(factors, targets, B):
    """Compact targets as a C-contiguous ``(B, k)`` intc array, each row's leading
    ``struct_size`` entries validated by its factor (the threads read them unchecked).

    ``targets`` is an integer array ``(B, k)`` (``(B,)`` when structures are one
    int); a ValueError names ``targets[i]`` and says what is wrong.
    """
    arr = np.asarray(targets)
    if arr.ndim == 1:
        arr = arr[:, None]
    if arr.dtype.kind not in "iu" or arr.ndim != 2 or arr.shape[0] != B:
        raise ValueError(f"targets: expected integers of shape ({B}, structure size), got "
                         f"{arr.dtype} {arr.shape}")
    rows = np.ascontiguousarray(arr, dtype=np.intc)
    if arr.size and (arr.min() < np.iinfo(np.intc).min or arr.max() > np.iinfo(np.intc).max):
        raise ValueError("targets: values out of range for a structure")
    i = _first_invalid(factors, rows)
    if i < 0:
        return rows
    # the rejected row, through the checks that say what is wrong
    f = factors if isinstance(factors, Factor) else factors[i]
    k = rows.shape[1]
    if f.struct_size > k:
        raise ValueError(f"targets[{i}]: expected at least {f.struct_size} entries "
                         f"(the structure size), got {k}")
    if f.struct_size != k and isinstance(factors, Factor):
        raise ValueError(f"targets[{i}]: expected {f.struct_size} entries "
                         f"(the structure size), got {k}")
    f._validate_structure(rows[i, :f.struct_size], f"targets[{i}]")
    raise ValueError(f"targets[{i}]: not a valid structure of {f!r}")


def _loss_padded(factors, etas_u, etas_v, targets, margin, sparse, n_jobs, solve_kw,
                 out_u, out_v, values, fallback):
    """The losses of a padded batch in the batch runner's threads (private).

    Problem ``i`` reads the leading blocks of ``etas_u[i]`` and ``etas_v[i]``
    (as :func:`sparsemap._solve._solve_padded` does) and its target, row ``i``
    of the intc array ``targets`` from :func:`_target_rows`; its loss
    (:func:`sparsemap_loss` with ``margin`` when ``sparse``, else
    :func:`structured_svm_loss`) goes to ``values[i]`` and its gradient into
    its slots of ``out_u`` and ``out_v`` (None: not wanted), zero-padded. No
    Python object is made per problem, except for the few the run reports
    (scores with nan or +inf, an impossible target, no allowed structure, a
    solve that did not converge): ``fallback(i)`` returns their ``(loss, g_u,
    g_v)`` through the NumPy loss, which raises or warns as it does.
    """
    method, max_iter, tol = _check_options(solve_kw.get("method", "auto"),
                                           solve_kw.get("max_iter"),
                                           solve_kw.get("tol", DEFAULT_TOL))
    B = etas_u.shape[0]
    n_threads = max(1, min(_check_n_jobs(n_jobs, factors), B))
    batch = _batch.prepare_loss(factors, etas_u, etas_v, targets, float(margin),
                                     bool(sparse), max_iter, tol, n_threads, out_u, out_v,
                                     values)
    _run_batch(batch, n_threads)
    shared = isinstance(factors, Factor)
    for i, _ in batch.report():
        f = factors if shared else factors[i]
        values[i], g_u, g_v = fallback(i)
        block = (i,) + tuple(slice(0, d) for d in f.shape_u)
        out_u[block] = g_u
        if out_v is not None and f.n_v:
            out_v[(i,) + tuple(slice(0, d) for d in f.shape_v)] = g_v


def _name_example(message, i, kwargs):
    """An error message of one example's loss, naming batch_loss's own arguments."""
    head = re.match(r"(\w+):", message)
    if head and head.group(1) in kwargs:   # a shared option such as margin
        return message
    for arg, batch_arg in (("eta_u", "etas_u"), ("eta_v", "etas_v"), ("target", "targets"),
                           ("factor", "factor")):
        if re.match(rf"{arg}\b", message):
            return f"{batch_arg}[{i}]{message[len(arg):]}"
    return f"example {i}: {message}"


def _as_list(x, name, B):
    try:
        out = list(x)
    except TypeError:
        raise ValueError(f"{name}: expected a sequence of length {B}, got {type(x).__name__}")
    if len(out) != B:
        raise ValueError(f"{name}: expected {B} entries (one per example), got {len(out)}")
    return out
