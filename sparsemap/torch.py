"""PyTorch layers and losses on top of SparseMAP (optional; imports torch).

Everything here is a thin autograd wrapper around the NumPy package. The layer
hands the batch's padded scores to the solvers' batch runner as one host
array (a float32 or float64 CPU tensor's own memory, else a float64 copy), and
threads (the batch layer's helpers and the caller) solve the problems without
the GIL, each copying its block out in float64, checking it, and writing its
``u`` into one output tensor, on the side each problem's method chose (the
default ``method="auto"``: the cheaper of the vertex and facet sides); the
backward pass, the exact Jacobian product of that side (Proposition 1 on the
vertex side), runs the same way. Results are those of :func:`sparsemap.solve`
on each element (bitwise in float64) and come back on the device and in the
dtype of the input.

Batches. Leading dimensions of ``eta_u`` beyond ``factor.shape_u`` are batch
dimensions. For batches of different sizes (sentences of different lengths)
pass a list of factors, one per batch element, and scores padded to the largest
shape: element ``b`` uses the leading block of shape ``factors[b].shape_u`` of
``eta_u[b]`` (and of ``eta_v[b]``); outputs and gradients are zero outside it,
and padding may hold any value. The family wrappers (:func:`tree`,
:func:`sequence`, :func:`matching`, :func:`sparsemax`) build and cache those
factors from ``lengths``.

Masks. ``-inf`` in the scores forbids a part, as in :func:`sparsemap.solve`.

Factor graphs. :func:`factor_graph` is the layer of an LP-SparseMAP
:class:`sparsemap.FactorGraph`, with the same conventions: leading batch dims of
``eta_u`` for one graph, or a list of graphs with ``eta_u`` padded to the largest
``n_variables``.

Higher derivatives. ``u`` is piecewise linear in the scores (its Jacobian
depends only on the support), so the layer's backward pass is itself a
differentiable linear map: double backward (Hessian-vector products of a
downstream loss, gradient penalties) and forward-mode AD work, with the exact
Jacobian of Proposition 1 in both directions and a zero second derivative. The
losses are differentiable once (their backward raises on double backward):
their Hessian would need the Jacobian of ``v``, which the solver does not
expose.

``torch.func``. The autograd Functions take no ``ctx`` in their forward pass and
keep what the backward pass needs in ``setup_context``, so ``torch.func.jvp``,
``grad`` and ``vjp`` work on every layer and loss; ``torch.vmap`` on the layers of
one shared factor (and on their Jacobian products: ``jacrev``, ``jacfwd``). The
forward passes call NumPy, which reads only plain tensors: the transforms hand
them over unwrapped, and backward and jvp products go through ``_Linear``, an
autograd Function too.
"""
import functools
import math
import numbers
import re
from typing import NamedTuple

import numpy as np
import torch

import sparsemap as sm
from sparsemap import Factor
from sparsemap._checks import check_per_factor
from sparsemap._factors._base import check_bool
from sparsemap._solve import (_FALLBACK_NAMES, _STATUS_NAMES, _backward_padded, _check_n_jobs,
                              _helpers, _order, _padded_info, _solve_batch, _solve_padded,
                              _takes_shared)
from sparsemap._solve import _element as _batch_element
from sparsemap.losses import _check_nonneg, _check_reduction, _loss_padded, _target_rows

__all__ = [
    "sparsemap", "SolveInfo", "distribution", "tree", "sequence", "matching", "sparsemax",
    "Sparsemax",
    "sparsemap_loss", "structured_svm_loss", "perceptron_loss",
    "SparseMAPLoss", "StructuredSVMLoss", "PerceptronLoss",
    "factor_graph",
]


# -- validation and layout ------------------------------------------------------------
def _check_tensor(x, name):
    """``x`` if it is a floating-point ``torch.Tensor``, else ValueError naming ``name``
    (the drop-in's torch graph calls this too: one message for one mistake)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    return x


def _has_v(factor):
    return factor.shape_v != (0,)


def _expand_transitions(factor, eta_u, eta_v, length=None):
    """``eta_v`` with a transition matrix shared by the positions expanded to one per
    position, as a view (autograd then sums its gradient over the positions).

    For :class:`~sparsemap.SequenceFactor` factors (``shape_v`` ``(L, a, b)``, one
    ``(a, b)`` block per transition; the factors that ``sparsemap.solve`` takes a
    shared matrix for, see ``_solve._takes_shared``): ``eta_v`` of shape ``(a, b)``, or with
    leading dims that broadcast to the batch dims but no position axis, is shared; a
    tensor with the position axis (``(*batch, L, a, b)``) is returned as it is, and
    every other shape too (the layout's checks name what is wrong). ``length``: the
    position axis's size (default: the factor's ``L``, the largest for a list).
    """
    if eta_v is None or isinstance(factor, (str, bytes)):
        return eta_v
    _check_tensor(eta_v, "eta_v")
    fs = [factor] if isinstance(factor, Factor) else factor
    try:
        shapes = {f.shape_v for f in fs}
    except (TypeError, AttributeError):
        return eta_v                   # not factors: the layout raises
    blocks = {sv[1:] for sv in shapes}
    if not shapes or len(blocks) != 1 or not all(_takes_shared(f) for f in fs):
        return eta_v
    block = blocks.pop()
    n_batch = (eta_u.dim() - len(fs[0].shape_u)) if isinstance(factor, Factor) else 1
    if eta_v.dim() >= n_batch + 3:
        return eta_v                   # one block per position already
    if eta_v.dim() < 2 or tuple(eta_v.shape[-2:]) != block:
        raise ValueError(f"eta_v: expected transitions of shape (..., {_fmt(block)}) "
                         f"shared by the positions, or one per position, "
                         f"(*batch, L, {_fmt(block)}); got {tuple(eta_v.shape)}")
    batch_shape = tuple(eta_u.shape[:max(n_batch, 0)])
    L = max(sv[0] for sv in shapes) if length is None else length
    try:
        return eta_v.unsqueeze(-3).expand(batch_shape + (L,) + block)
    except RuntimeError:
        raise ValueError(f"eta_v: shape {tuple(eta_v.shape[:-2])} does not broadcast "
                         f"to the batch shape {batch_shape}") from None


# Host-side conversions go through NumPy where it has the dtype: torch would run them as
# intra-op parallel regions, which on a busy machine cost milliseconds each.
_NUMPY_DTYPES = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16}


def _to_host(x):
    """A C-contiguous float64 NumPy copy of a tensor (a copy, so later in-place edits
    cannot leak in)."""
    t = x.detach().resolve_neg()
    if t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES:
        return np.array(t.numpy(), dtype=np.float64, order="C")
    return np.ascontiguousarray(t.to(device="cpu", dtype=torch.float64).numpy())


# dtypes the padded solver reads and writes itself, converting in its threads
_DIRECT = (torch.float32, torch.float64)


def _output(shape, like):
    """``(tensor, array)``: where the padded solver writes a result for ``like = (dtype,
    device)``: a new CPU tensor's memory, or a float64 array (tensor None) to convert."""
    dtype, device = like
    if device.type == "cpu" and dtype in _DIRECT:
        t = torch.empty(shape, dtype=dtype)
        return t, t.numpy()
    return None, np.empty(shape)


def _finish(out, shape, like):
    """The tensor of an :func:`_output` pair, shaped ``shape``."""
    t, arr = out
    return (t if t is not None else _like(arr, like)).reshape(shape)


@functools.lru_cache(maxsize=4096)
def _block(shape):
    return tuple(slice(0, n) for n in shape)


class _Layout:
    """Where the problems of a batch sit in the (padded) score tensors.

    ``factors`` is one shared factor (``ragged=False``) or one factor per batch
    element; ``batch_shape`` are the leading dims; ``pad_u`` / ``pad_v`` the
    trailing ones. Whether each element's block fits in the padded shape is
    checked by the padded solver (the layer's path) or by :meth:`split_u` /
    :meth:`split_v`; ``trusted`` factor lists (built by the family wrappers)
    skip the per-element type check.
    """

    def __init__(self, factor, eta_u, eta_v, trusted=False):
        _check_tensor(eta_u, "eta_u")
        if eta_v is not None:
            _check_tensor(eta_v, "eta_v")
        if isinstance(factor, Factor):
            self.ragged = False
            self.factor = factor
            k = len(factor.shape_u)
            if eta_u.dim() < k or tuple(eta_u.shape[eta_u.dim() - k:]) != factor.shape_u:
                raise ValueError(f"eta_u: expected shape (*batch, {_fmt(factor.shape_u)}) "
                                 f"(batch dims, then factor.shape_u), got {tuple(eta_u.shape)}")
            self.batch_shape = tuple(eta_u.shape[:eta_u.dim() - k])
            self.pad_u, self.pad_v = factor.shape_u, factor.shape_v
            if eta_v is not None:
                if not _has_v(factor):
                    raise ValueError(f"eta_v: {type(factor).__name__} has no eta_v; pass None")
                want = self.batch_shape + factor.shape_v
                if tuple(eta_v.shape) != want:
                    raise ValueError(f"eta_v: expected shape {want} (the batch dims of eta_u, "
                                     f"then factor.shape_v), got {tuple(eta_v.shape)}")
            self.factors = None
        else:
            self.ragged = True
            self.factors = factor if trusted else _factor_list(factor)
            B = len(self.factors)
            k = len(self.factors[0].shape_u)
            if eta_u.dim() != 1 + k or eta_u.shape[0] != B:
                raise ValueError(f"eta_u: with a list of {B} factors, expected shape (B={B}, ...) "
                                 f"with {k} padded dims, got {tuple(eta_u.shape)}")
            self.pad_u = tuple(eta_u.shape[1:])
            self.batch_shape = (B,)
            self.pad_v = (0,)
            if eta_v is not None:
                if not any(_has_v(f) for f in self.factors):
                    raise ValueError("eta_v: the factors have no eta_v; pass None")
                self.pad_v = tuple(eta_v.shape[1:])
                if eta_v.shape[0] != B:
                    raise ValueError(f"eta_v: expected {B} batch elements (one per factor), "
                                     f"got shape {tuple(eta_v.shape)}")
            self._shapes = None
        self.B = math.prod(self.batch_shape)
        self.index_shape = self.batch_shape   # how messages index the problems
        self.handles = None                   # the solve's, for a SolveInfo

    def _blocks(self):
        """Per-element block shapes ``(shapes_u, shapes_v)`` of a ragged batch (None for an
        element without eta_v), checked against the padded shapes on first use."""
        if self._shapes is None:
            shapes_u = [f.shape_u for f in self.factors]
            shapes_v = [f.shape_v if _has_v(f) else None for f in self.factors]
            for which, shapes, pad in (("u", shapes_u, self.pad_u), ("v", shapes_v, self.pad_v)):
                if which == "v" and pad == (0,):
                    continue
                i = _first_misfit(shapes, pad)
                if i >= 0:
                    raise ValueError(f"eta_{which}: the factor's shape_{which} {shapes[i]} does "
                                     f"not fit in the padded shape {pad} (batch element {i})")
            self._shapes = shapes_u, shapes_v
        return self._shapes

    def factor_of(self, b):
        return self.factors[b] if self.ragged else self.factor

    def host(self, x, which):
        """A tensor shaped ``(*batch, *pad)`` as the C-contiguous ``(B, *pad)`` host array
        the padded solver reads: the tensor's own memory when it is a contiguous float32
        or float64 CPU tensor (the solver converts in its threads), else a float64 copy;
        zeros for None."""
        shape = (self.B,) + (self.pad_u if which == "u" else self.pad_v)
        if x is None:
            return np.zeros(shape)
        t = x.detach()
        if t.device.type == "cpu" and t.dtype in _DIRECT:
            return np.ascontiguousarray(t.resolve_neg().numpy().reshape(shape))
        return _to_host(t).reshape(shape)

    # host arrays <-> per-problem arrays
    def split_u(self, arr):
        """(B,) + pad_u float64 array -> stacked array or list of per-problem blocks."""
        arr = arr.reshape((self.B,) + self.pad_u)
        if not self.ragged:
            return arr
        return [arr[(b,) + _block(s)] for b, s in enumerate(self._blocks()[0])]

    def split_v(self, arr):
        if arr is None:
            return None
        arr = arr.reshape((self.B,) + self.pad_v)
        if not self.ragged:
            return arr
        return [None if s is None else arr[(b,) + _block(s)]
                for b, s in enumerate(self._blocks()[1])]

    def join(self, arrays, which):
        """Per-problem arrays -> one zero-padded (*batch, *pad) float64 array."""
        pad = self.pad_u if which == "u" else self.pad_v
        if not self.ragged:
            out = np.stack(arrays) if arrays else np.zeros((0,) + pad)
            return out.reshape(self.batch_shape + pad)
        out = np.zeros((self.B,) + pad)
        for b, (s, a) in enumerate(zip(self._blocks()[which == "v"], arrays)):
            if s is not None:
                out[(b,) + _block(s)] = a.reshape(s)
        return out


def _first_misfit(shapes, pad):
    """Index of the first shape (None: skipped) that does not fit in ``pad``, or -1."""
    live = [s for s in shapes if s is not None]
    if not live or ({len(s) for s in live} == {len(pad)} and
                    bool((np.array(live) <= np.array(pad)).all())):
        return -1
    for i, s in enumerate(shapes):
        if s is not None and (len(s) != len(pad) or any(a > b for a, b in zip(s, pad))):
            return i
    return -1


def _fmt(shape):
    return ", ".join(str(d) for d in shape)


def _factor_list(factor):
    try:
        if isinstance(factor, (str, bytes)):
            raise TypeError   # iterable, but not a list of factors
        factors = list(factor)
    except TypeError:
        raise ValueError(f"factor: expected a sparsemap Factor or a list of them, "
                         f"got {type(factor).__name__}")
    if not factors:
        raise ValueError("factor: expected at least one factor, got an empty list")
    for i, f in enumerate(factors):
        if not isinstance(f, Factor):
            raise ValueError(f"factor[{i}]: expected a sparsemap Factor, got {type(f).__name__}")
    return factors


# What the batch layer calls a problem's arrays, and what they are to the layer's user.
_BATCH_NAMES = {"etas_u": "eta_u", "etas_v": "eta_v", "dus": "the gradient of u",
                "d_etas_u": "the tangent of eta_u", "d_etas_v": "the tangent of eta_v"}


def _batch_error(exc, layout):
    """The batch layer names a problem ``etas_u[i]``; say ``eta_u`` and the batch element."""
    m = re.match(r"(etas_u|etas_v|dus|d_etas_u|d_etas_v)\[(\d+)\]", str(exc))
    if m is None:
        return exc
    return ValueError(f"{_BATCH_NAMES[m[1]]}{str(exc)[m.end():]}{_where(layout, int(m[2]))}")


def _element(layout, b):
    """``batch element i`` for flat problem index b; multi-dim batches get a tuple."""
    shape = layout.index_shape
    return _batch_element(b if len(shape) <= 1 else
                          tuple(int(i) for i in np.unravel_index(b, shape)))


def _where(layout, b):
    """`` (batch element i)``, the end of an error message (nothing without batch dims)."""
    return f" ({_element(layout, b)})" if layout.batch_shape else ""


def _layer_solve(layout, eta_u, eta_v, n_jobs, solve_kw):
    """``u`` (a tensor like ``eta_u``) and the handles of the backward pass."""
    eu = layout.host(eta_u, "u")
    ev = None if eta_v is None else layout.host(eta_v, "v")
    like = _spec(eta_u)
    out = _output(eu.shape, like)
    try:
        handles = _solve_padded(layout.factors if layout.ragged else layout.factor, eu, ev,
                                out[1], n_jobs, solve_kw,
                                functools.partial(_element, layout))
    except ValueError as exc:
        raise _batch_error(exc, layout) from None
    return _finish(out, layout.batch_shape + layout.pad_u, like), handles


def _solve_results(layout, eta_u, eta_v, n_jobs, solve_kw):
    """One SparseMAPResult per problem (for the distribution)."""
    if layout.B == 0:
        return []
    eu = layout.split_u(_to_host(eta_u))
    ev = None if eta_v is None else layout.split_v(_to_host(eta_v))
    factors = layout.factors if layout.ragged else layout.factor
    try:
        return _solve_batch(factors, eu, ev, n_jobs, None, solve_kw,
                            functools.partial(_element, layout))
    except ValueError as exc:
        raise _batch_error(exc, layout) from None


class SolveInfo(NamedTuple):
    """What the solver did for each problem of a layer call (``return_info=True``).

    Each field is a tensor with the batch shape of the call (one entry per
    problem: per sentence for :func:`tree`), on the device of the scores.
    Reading it costs no solve: the numbers are those the forward pass ran.

    Attributes
    ----------
    support_size : int64 Tensor
        Structures with nonzero weight in the solution (for a tree layer,
        trees per sentence): 1 when the MAP structure wins outright. -1 where
        the facet side solved the problem (see :attr:`facet`): it holds ``u``
        and the constraints tight there, no list of structures, and finding
        one (:attr:`sparsemap.SparseMAPResult.structures`) would cost more
        than the solve. Pass ``method="vertex"`` for support sizes
        everywhere.
    n_iter : int64 Tensor
        Iterations of the solver that returned the solution: active-set steps
        on the vertex side, the facet solver's steps on the facet side.
    status : int64 Tensor
        Why the solver stopped, an index into :attr:`STATUSES`: 0
        ``"converged"`` (the duality gap met ``tol``), 1 ``"max_iter"``, 2
        ``"stalled"`` (no further progress in double precision), 3
        ``"face_incomplete"`` (``u`` converged but the backward pass may be
        inexact: raise ``max_iter``), 4 ``"stopped"``. A problem that does not
        converge also raises a :class:`~sparsemap.ConvergenceWarning` naming
        its batch element.
    gap : float64 Tensor
        The Wolfe duality gap of the returned solution (on either side, from
        one MAP call at the returned ``u``).
    facet : bool Tensor
        Whether the facet side solved the problem (``SparseMAPResult.side ==
        "facet"``; the solvers page, "Two representations"), else the vertex
        side. Only trees, sequences and matchings have a facet side, chosen
        per problem by the default ``method="auto"``.

    fallback : int64 Tensor
        Why a problem offered to the facet side was solved on the vertex side,
        an index into :attr:`FALLBACKS`: 0 ``"none"`` (not offered, or solved
        there), 1 ``"declined"`` (the facet solver declined: a limit of its
        own, masks it cannot handle, a failed check, or with the default
        ``method="auto"`` peaked scores, where the vertex side is the cheaper
        one), 2 ``"budget"`` (it declined having spent ``max_iter``
        iterations), 3 ``"gap"`` (its answer missed the tolerance). With
        ``method="facet"`` a nonzero code is the reason the forced side fell
        back; ``SparseMAPResult.message`` says the same in words.

    Examples
    --------
    >>> import torch, sparsemap.torch as smt
    >>> scores = torch.zeros(2, 4, 4)
    >>> scores[0, 0, 1] = scores[0, 1, 2] = scores[0, 2, 3] = 2.0
    >>> u, info = smt.tree(scores, return_info=True)
    >>> info.support_size, info.facet      # flat scores: the facet side
    (tensor([ 1, -1]), tensor([False,  True]))
    >>> smt.tree(scores, return_info=True, method="vertex")[1].support_size
    tensor([1, 3])
    >>> info.converged.all()
    tensor(True)
    >>> [info.STATUSES[k] for k in info.status]
    ['converged', 'converged']
    >>> [info.FALLBACKS[k] for k in info.fallback]   # 0: peaked
    ['declined', 'none']
    """

    support_size: torch.Tensor
    n_iter: torch.Tensor
    status: torch.Tensor
    gap: torch.Tensor
    facet: torch.Tensor
    fallback: torch.Tensor

    #: The meaning of each code of :attr:`status`.
    STATUSES = _STATUS_NAMES
    #: The meaning of each code of :attr:`fallback`.
    FALLBACKS = _FALLBACK_NAMES

    @property
    def converged(self):
        """Bool Tensor: whether each problem converged (``status == 0``)."""
        return self.status == 0


def _solve_info(layout, batch_shape, device):
    """The :class:`SolveInfo` of the layer call that solved ``layout`` (its handles)."""
    return SolveInfo(*(torch.from_numpy(a).reshape(batch_shape).to(device)
                       for a in _padded_info(layout.handles)))


def _like(arr, like):
    """A float64 host array as a tensor with ``like = (dtype, device)``."""
    dtype, device = like
    if dtype in _NUMPY_DTYPES:
        t = torch.from_numpy(arr.astype(_NUMPY_DTYPES[dtype], copy=False))
        return t if device.type == "cpu" else t.to(device)
    return torch.from_numpy(arr).to(device=device, dtype=dtype)


def _spec(t):
    return None if t is None else (t.dtype, t.device)


# -- autograd Functions ----------------------------------------------------------------
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_unwrap_dead = getattr(getattr(getattr(torch, "_functorch", None), "utils", None),
                       "unwrap_dead_wrappers", None)


class _Function(torch.autograd.Function):
    """An autograd Function in the ``setup_context`` form, whose ``apply`` skips torch's
    binding of the arguments to ``forward``'s signature when no ``torch.func``
    transform runs: it calls ``inspect.signature`` (about 30 microseconds, a third of a
    small layer call), and changes nothing here, where ``forward`` takes positional
    arguments without defaults. Under a transform, and on a torch without the private
    hooks used, it is torch's own ``apply``."""

    @classmethod
    def apply(cls, *args):
        if _transforms_active is None or _unwrap_dead is None or _transforms_active():
            return super().apply(*args)
        # as torch's apply does outside transforms, without the binding
        return super(torch.autograd.Function, cls).apply(*_unwrap_dead(args))


# -- linear maps with autograd to any order ----------------------------------------
class _Linear(_Function):
    """``y = J x`` for a fixed linear map ``J`` held by ``op``; backward is ``J^T``.

    ``op.apply(xs, transpose)`` maps a tuple of tensors to a tuple of tensors.
    The backward pass calls this Function again with ``transpose`` flipped, so
    the chain is differentiable to any order (all higher derivatives with
    respect to the scores are zero: ``J`` only depends on the support).
    """

    @staticmethod
    def forward(op, transpose, *xs):
        return tuple(op.apply(xs, transpose))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.op, ctx.transpose = inputs[0], inputs[1]
        ctx.n_in = len(inputs) - 2

    @staticmethod
    def backward(ctx, *gs):
        gx = _Linear.apply(ctx.op, not ctx.transpose, *gs)
        return (None, None) + tuple(gx[:ctx.n_in])

    @staticmethod
    def jvp(ctx, _op, _transpose, *dxs):
        # linear: the tangent goes through the same map
        return _product(ctx.op, dxs, ctx.transpose)

    @staticmethod
    def vmap(info, in_dims, op, transpose, *xs):
        # torch.vmap over the vectors (jacrev, jacfwd, a batch of directions): the map is
        # fixed, so it is applied to each vector in turn
        xs = [None if x is None else (x.movedim(d, 0) if d is not None else
                                      x.expand((info.batch_size,) + x.shape))
              for x, d in zip(xs, in_dims[2:])]
        outs = [_Linear.apply(op, transpose, *[None if x is None else x[i] for x in xs])
                for i in range(info.batch_size)]
        stacked = tuple(torch.stack(parts) for parts in zip(*outs))
        return stacked, (0,) * len(stacked)


class _LayerJacobian:
    """Prop. 1 for a solved batch: ``J = M D A^T`` per problem, padded."""

    def __init__(self, layout, handles, n_jobs, eta_u, eta_v):
        self.layout, self.handles, self.n_jobs = layout, handles, n_jobs
        self.like_u, self.like_v = _spec(eta_u), _spec(eta_v)

    def apply(self, xs, transpose):
        lay = self.layout
        g = lay.host(xs[0], "u")
        out_u = _output(g.shape, self.like_u)
        out_v = None
        try:
            if not transpose:   # (d_eta_u, d_eta_v) -> du
                dv = xs[1] if len(xs) > 1 and self.like_v is not None else None
                _backward_padded(self.handles, g, None if dv is None else lay.host(dv, "v"),
                                 False, self.n_jobs, out_u[1])
            else:               # du -> (g_eta_u, g_eta_v)
                if self.like_v is not None:
                    out_v = _output((lay.B,) + lay.pad_v, self.like_v)
                _backward_padded(self.handles, g, None, True, self.n_jobs, out_u[1],
                                 None if out_v is None else out_v[1])
        except ValueError as exc:
            raise _batch_error(exc, lay) from None
        g_u = _finish(out_u, lay.batch_shape + lay.pad_u, self.like_u)
        if out_v is None:
            return (g_u,)
        return g_u, _finish(out_v, lay.batch_shape + lay.pad_v, self.like_v)


def _wrapped(xs):
    """Whether a ``torch.func`` transform wraps any of the tensors ``xs``: then they hold
    no storage for NumPy to read, and products must go through :class:`_Linear`, whose
    forward receives them unwrapped."""
    return any(x is not None and _is_wrapped(x) for x in xs)


_is_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor",
                      lambda x: False)


def _numpy_of(t):
    """A NumPy array of a tensor's values that no transform differentiates (targets,
    sizes): inside a ``torch.func`` transform every torch operation's result is wrapped
    and holds no storage, so the copy is made with the transforms' dispatch off."""
    while _is_wrapped(t):
        t = torch._C._functorch.get_unwrapped(t)
    with torch._C._DisableFuncTorch():
        return t.detach().cpu().numpy()


def _product(jac, xs, transpose):
    """``J xs`` (or ``J^T xs``) for a Jacobian ``jac``: through :class:`_Linear` when the
    product is itself differentiated or transformed, else directly (an autograd
    Function's dispatch costs more than a small batch's product)."""
    if torch.is_grad_enabled() or _wrapped(xs):
        return _Linear.apply(jac, transpose, *xs)
    return tuple(jac.apply(tuple(xs), transpose))


def _vjp(jac, g):
    """``J^T g`` for a Jacobian ``jac`` (one tensor per score input)."""
    return _product(jac, (g,), True)


def _apply(fn, layout, *args):
    """``fn.apply(*args)`` for a Function whose forward leaves its Jacobian on ``layout``
    for ``setup_context`` (which may run once per transform level): taken off after, as
    the Jacobian refers to the layout (no reference cycle to keep buffers alive)."""
    try:
        return fn.apply(*args)
    finally:
        layout.jac = None


class _JacobianFunction(_Function):
    """A layer ``forward(layout, n_jobs, solve_kw, *scores)`` that solves and leaves in
    ``layout.jac`` the Jacobian of its output ``u`` with respect to the score tensors (an
    ``apply(xs, transpose)`` as :class:`_Linear` reads it): backward applies ``J^T``, jvp
    ``J``. A score input that is None gets no gradient.

    The forward pass takes no ``ctx`` and ``setup_context`` keeps the Jacobian (the form
    ``torch.func`` transforms need): the layout object, made per call, carries it from
    one to the other."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.jac = inputs[0].jac

    @staticmethod
    def backward(ctx, gu):
        gs = tuple(_vjp(ctx.jac, gu))
        n_scores = len(ctx.needs_input_grad) - 3
        return (None, None, None) + gs + (None,) * (n_scores - len(gs))

    @staticmethod
    def jvp(ctx, _layout, _n_jobs, _solve_kw, *d_scores):
        return _product(ctx.jac, d_scores, False)[0]


class _SparseMAPFunction(_JacobianFunction):
    @staticmethod
    def forward(layout, n_jobs, solve_kw, eta_u, eta_v):
        u, handles = _layer_solve(layout, eta_u, eta_v, n_jobs, solve_kw)
        layout.jac = _LayerJacobian(layout, handles, n_jobs, eta_u, eta_v)
        layout.handles = handles
        return u

    @staticmethod
    def vmap(info, in_dims, layout, n_jobs, solve_kw, eta_u, eta_v):
        # torch.vmap: the mapped dimension becomes one more leading batch dimension of a
        # shared factor's layer (a list of factors already fixes its one batch dimension)
        if layout.ragged:
            raise ValueError("torch.vmap: a layer over a list of factors (a ragged batch) "
                             "cannot be mapped; pass the mapped problems as batch "
                             "elements instead")

        def lead(x, d):
            return x.movedim(d, 0) if d is not None else x.expand((info.batch_size,) + x.shape)
        eu = lead(eta_u, in_dims[3])
        ev = None if eta_v is None else lead(eta_v, in_dims[4])
        mapped = _Layout(layout.factor, eu, ev)
        return _apply(_SparseMAPFunction, mapped, mapped, n_jobs, solve_kw, eu, ev), 0


def _with_info(u, layout, return_info, batch_shape):
    """``u``, or ``(u, SolveInfo)`` when asked."""
    if not return_info:
        return u
    return u, _solve_info(layout, batch_shape, u.device)


def sparsemap(factor, eta_u, eta_v=None, *, n_jobs=None, return_info=False, **solve_kw):
    r"""SparseMAP posteriors :math:`u = M y^\star` as a differentiable PyTorch operation.

    Parameters
    ----------
    factor : Factor or list of Factor
        One factor for every problem of the batch, or one per batch element
        (ragged batches; ``eta_u`` then has exactly one batch dimension).
    eta_u : Tensor, shape ``(*batch, *factor.shape_u)``
        Unary scores, any float dtype and device. With a list of factors:
        shape ``(B, *padded)``, element ``b`` using the leading block of shape
        ``factors[b].shape_u``. ``-inf`` forbids a part.
    eta_v : Tensor, shape ``(*batch, *factor.shape_v)``, optional
        Additional scores (zeros when omitted), padded likewise.
    n_jobs : int, optional
        Threads for the solves and the backward products (default: all cores).
    return_info : bool, default False
        Also return a :class:`SolveInfo`: each problem's support size,
        iteration count, status and duality gap.
    **solve_kw
        Passed to :func:`sparsemap.solve` (``method``, ``max_iter``, ``tol``).

    Returns
    -------
    u : Tensor, shaped, typed and placed like ``eta_u``
        Zero outside each element's block.
    info : SolveInfo
        Only with ``return_info=True``; its fields have the batch shape.

    Raises
    ------
    ValueError
        On shapes that do not match the factor(s), non-tensor or integer
        scores, NaN or ``+inf`` where a problem reads them.

    Notes
    -----
    The backward pass is the exact product with the Jacobian of ``u``, for
    ``eta_u`` and ``eta_v``, on the side that solved each problem
    (:attr:`SolveInfo.facet`): Proposition 1's ``M_I D A_I^T`` on the vertex
    side, the projection onto the null space of the tight constraints on the
    facet side. It is exact to round-off, needs no new solve, and runs in the
    thread pool. Double backward, forward-mode AD and the ``torch.func``
    transforms are supported (see the module notes).
    At transition scores that tie (a sequence's ``eta_v`` passed as zeros)
    it is the limit of the Jacobians at ``eta_v + t r``, ``t -> 0+``, ``r =``
    :func:`sparsemap.testing.tie_direction`; a sequence called without
    ``eta_v`` is per-position sparsemax, and its ``eta_u`` gradient is
    sparsemax's, position by position (the solvers page, "Sequences without
    transitions").

    Examples
    --------
    >>> import torch, sparsemap as sm, sparsemap.torch as smt
    >>> f = sm.SequenceFactor(3, 2)
    >>> eta_u = torch.tensor([[1.0, 0.0], [0.2, 0.0], [0.0, 1.0]],
    ...                      requires_grad=True)
    >>> u = smt.sparsemap(f, eta_u)
    >>> u
    tensor([[1.0000, 0.0000],
            [0.6000, 0.4000],
            [0.0000, 1.0000]], grad_fn=<_SparseMAPFunctionBackward>)
    >>> u[1, 0].backward()
    >>> eta_u.grad[1]
    tensor([ 0.5000, -0.5000])
    """
    return_info = check_bool(return_info, "return_info")
    _check_tensor(eta_u, "eta_u")
    eta_v = _expand_transitions(factor, eta_u, eta_v)
    layout = _Layout(factor, eta_u, eta_v)
    u = _apply(_SparseMAPFunction, layout, layout, n_jobs, solve_kw, eta_u, eta_v)
    return _with_info(u, layout, return_info, layout.batch_shape)


# -- the distribution: support and differentiable weights ----------------------------
class _SupportJacobian:
    """Appendix B: on the support I, ``y*_I = D A_I^T eta + Z 1 / (1^T Z 1)`` locally,
    ``D = Z - Z 1 1^T Z / (1^T Z 1)``, ``Z = (M_I^T M_I + c 1 1^T)^{-1}`` (the shift c
    changes neither y* nor D on the simplex, and keeps Z defined when the columns are
    only affinely independent). Dense ``M_I``, ``N_I`` from ``factor.vertex``, built
    on first use: supports are small.
    """

    def __init__(self, layout, results, K, eta_u, eta_v):
        self.layout, self.results, self.K = layout, results, K
        self.like_u, self.like_v = _spec(eta_u), _spec(eta_v)
        self._parts = None

    def parts(self):
        if self._parts is None:
            self._parts = [_support_parts(self.layout.factor_of(b), r)
                           for b, r in enumerate(self.results)]
        return self._parts

    def apply(self, xs, transpose):
        lay, K = self.layout, self.K
        if not transpose:    # (d_eta_u, d_eta_v) -> dy (None: zeros)
            du = None if xs[0] is None else lay.split_u(_to_host(xs[0]))
            dv = xs[1] if len(xs) > 1 else None
            dv = None if dv is None or self.like_v is None else lay.split_v(_to_host(dv))
            out = np.zeros((lay.B, K))
            for b, (Mi, Ni, D) in enumerate(self.parts()):
                theta = np.zeros(len(D)) if du is None else Mi @ np.ravel(du[b])
                if dv is not None and dv[b] is not None and Ni.shape[1]:
                    theta += Ni @ np.ravel(dv[b])
                out[b, :len(D)] = D @ theta
            return (_like(out.reshape(lay.batch_shape + (K,)), self.like_u),)
        gy = _to_host(xs[0]).reshape(lay.B, K)    # dy -> (g_eta_u, g_eta_v)
        gus, gvs = [], []
        for b, (Mi, Ni, D) in enumerate(self.parts()):
            gt = D @ gy[b, :len(D)]
            gus.append(Mi.T @ gt)
            gvs.append(Ni.T @ gt)
        g_u = _like(lay.join(gus, "u"), self.like_u)
        if self.like_v is None:
            return (g_u,)
        return g_u, _like(lay.join(gvs, "v"), self.like_v)


def _support_parts(factor, result):
    cols = [factor.vertex(s) for s in result.structures]
    Mi = np.stack([m.ravel() for m, _ in cols])
    Ni = np.stack([n.ravel() for _, n in cols])
    G = Mi @ Mi.T
    Gc = G + max(1.0, float(G.diagonal().max()))
    try:
        L = np.linalg.cholesky(Gc)
    except np.linalg.LinAlgError:
        raise ValueError("the support is affinely dependent, so y* is not unique; use "
                         "method='vertex', whose support is always independent")
    Z = np.linalg.solve(L.T, np.linalg.solve(L, np.eye(len(G))))
    z1 = Z.sum(axis=1)
    return Mi, Ni, Z - np.outer(z1, z1) / z1.sum()


def _pad_structures(results, batch_shape, K):
    per = [np.asarray(r.structures, dtype=np.int64) for r in results]
    width = max((p.shape[1] for p in per if p.ndim == 2), default=None)
    shape = (len(per), K) if width is None else (len(per), K, width)
    out = np.full(shape, -1, dtype=np.int64)
    for b, p in enumerate(per):
        if p.ndim == 2:
            out[b, :p.shape[0], :p.shape[1]] = p
        else:
            out[b, :p.shape[0]] = p
    return out.reshape(batch_shape + shape[1:])


class _DistributionFunction(_Function):
    @staticmethod
    def forward(eta_u, eta_v, layout, n_jobs, solve_kw):
        results = _solve_results(layout, eta_u, eta_v, n_jobs, solve_kw)
        K = max((len(r.weights) for r in results), default=0)
        w = np.zeros((layout.B, K))
        for b, r in enumerate(results):
            w[b, :len(r.weights)] = r.weights
        structures = torch.from_numpy(_pad_structures(results, layout.batch_shape, K))
        structures = structures.to(eta_u.device)
        layout.jac = _SupportJacobian(layout, results, K, eta_u, eta_v)
        return _like(w.reshape(layout.batch_shape + (K,)), _spec(eta_u)), structures

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.jac = inputs[2].jac
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def jvp(ctx, d_eta_u, d_eta_v, *_):
        # the structures are not differentiable: no tangent
        return _product(ctx.jac, (d_eta_u, d_eta_v), False)[0], None

    @staticmethod
    def backward(ctx, gw, _):
        gs = _vjp(ctx.jac, gw)
        return gs[0], (gs[1] if len(gs) > 1 else None), None, None, None


def distribution(factor, eta_u, eta_v=None, *, n_jobs=None, **solve_kw):
    """SparseMAP's sparse distribution over structures, with differentiable weights.

    For models that marginalise a downstream loss over the support,
    ``sum_k weights[k] * loss(structures[k])``, and need its gradient.

    Parameters
    ----------
    factor, eta_u, eta_v, n_jobs, **solve_kw
        As in :func:`sparsemap` (batches and ragged batches alike).

    Returns
    -------
    structures : LongTensor, shape ``(*batch, K, *structure_shape)``
        The support of each problem, in the factor's compact form (heads for a
        tree, tags for a sequence, ...), ordered as the solver returns them;
        ``K`` is the largest support size in the batch. Padded with ``-1``:
        slots past a problem's support, and structure entries past a shorter
        problem's compact size.
    weights : Tensor, shape ``(*batch, K)``, like ``eta_u``
        ``y*`` on the support (positive, summing to one per problem), 0 in
        padded slots. Differentiable with respect to ``eta_u`` and ``eta_v``.

    Raises
    ------
    ValueError
        As :func:`sparsemap`; and, in the backward pass, when a solver other
        than the active set returned an affinely dependent support (``y*`` is
        then not unique).

    Notes
    -----
    ``u`` is always unique, ``y*`` is unique when the support is affinely
    independent (as the active set guarantees) and spans the optimal face. At
    flat scores the face may be larger: then ``y*`` is one of many optimal
    distributions (the active set's), and the derivative below, support held
    fixed, is that of these weights, not of ``u`` (``sum_k dy_k m_k`` is the
    projection onto the support's directions, not ``du``). On that support ``y*`` is
    locally linear in the structure scores ``theta_I = A_I^T eta`` (Appendix B):
    ``dy*_I = D A_I^T d eta`` with ``D = Z - Z 1 1^T Z / (1^T Z 1)`` and
    ``Z = (M_I^T M_I)^{-1}``; structures outside the support keep weight 0.
    The backward pass applies ``A_I D`` to the incoming gradient. Supports are
    small, so it works on dense columns per problem (no thread pool).

    Examples
    --------
    >>> import torch, sparsemap as sm, sparsemap.torch as smt
    >>> f = sm.SequenceFactor(3, 2)
    >>> eta = torch.tensor([[1.0, 0.0], [0.2, 0.0], [0.0, 1.0]],
    ...                    requires_grad=True)
    >>> structures, weights = smt.distribution(f, eta)
    >>> structures
    tensor([[0, 0, 1],
            [0, 1, 1]])
    >>> weights
    tensor([0.6000, 0.4000], grad_fn=<_DistributionFunctionBackward>)
    >>> weights[0].backward()
    >>> eta.grad[1]
    tensor([ 0.5000, -0.5000])
    """
    _check_tensor(eta_u, "eta_u")
    eta_v = _expand_transitions(factor, eta_u, eta_v)
    layout = _Layout(factor, eta_u, eta_v)
    if solve_kw.get("method", "auto") in ("auto", "active_set"):
        # the distribution is the vertex side's support (the facet side has none); here
        # "active_set" has always meant the vertex side, so it does not warn
        solve_kw = dict(solve_kw, method="vertex")
    return _apply(_DistributionFunction, layout, eta_u, eta_v, layout, n_jobs, solve_kw)[::-1]


# -- family wrappers ----------------------------------------------------------------
@functools.lru_cache(maxsize=1024)
def _cached_factor(cls, *args):
    # Keyed by construction arguments: equal arguments, one shared factor.
    return cls(*args)


def _sizes(values, name, batch_shape, upper):
    """Validate per-element sizes: ints of shape ``batch_shape`` in ``[1, upper]``."""
    if isinstance(values, torch.Tensor):
        values = _numpy_of(values)
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected integers, got dtype {arr.dtype}")
    if arr.shape != batch_shape:
        raise ValueError(f"{name}: expected shape {batch_shape} (the batch dims), "
                         f"got {arr.shape}")
    sizes = arr.reshape(-1).tolist()
    if sizes and (min(sizes) < 1 or max(sizes) > upper):
        raise ValueError(f"{name}: expected values in [1, {upper}], got "
                         f"min {min(sizes)}, max {max(sizes)}")
    return sizes


def _family(factors, eta_u, eta_v, batch_shape, n_jobs, return_info, solve_kw):
    """Apply the layer with a shared factor, or ragged over flattened batch dims."""
    if isinstance(factors, Factor):
        return sparsemap(factors, eta_u, eta_v, n_jobs=n_jobs, return_info=return_info,
                         **solve_kw)
    return_info = check_bool(return_info, "return_info")
    nb = len(batch_shape)
    flat_u = eta_u.reshape((-1,) + tuple(eta_u.shape[nb:]))
    flat_v = None if eta_v is None else eta_v.reshape((-1,) + tuple(eta_v.shape[nb:]))
    layout = _Layout(factors, flat_u, flat_v, trusted=True)
    layout.index_shape = batch_shape   # messages name the caller's batch element
    u = _apply(_SparseMAPFunction, layout, layout, n_jobs, solve_kw, flat_u, flat_v)
    return _with_info(u.reshape(eta_u.shape), layout, return_info, batch_shape)


@functools.lru_cache(maxsize=64)
def _factor_table(cls, rest):
    # size -> factor, for one family and options: a list of them is one lookup each
    return {}


def _ragged_factors(cls, sizes, full, rest):
    """One shared factor when every element has the full size, else a list of cached
    factors (one per element)."""
    if sizes.count(full) == len(sizes):
        return _cached_factor(cls, *full, *rest)
    table = _factor_table(cls, rest)
    try:
        return [table[s] for s in sizes]
    except KeyError:
        if len(table) > 4096:
            table.clear()
        for s in set(sizes) - table.keys():
            table[s] = _cached_factor(cls, *s, *rest)
        return [table[s] for s in sizes]


def _check_scores_tensor(x, name, min_dim, what):
    _check_tensor(x, name)
    if x.dim() < min_dim:
        raise ValueError(f"{name}: expected shape {what}, got {tuple(x.shape)}")


def tree(scores, lengths=None, projective=False, single_root=False, *, n_jobs=None,
         return_info=False, **solve_kw):
    """SparseMAP arc posteriors of dependency trees.

    Parameters
    ----------
    scores : Tensor, shape ``(*batch, N + 1, N + 1)``
        ``scores[..., h, m]`` scores the arc from head ``h`` to modifier ``m``;
        node 0 is the root. Column 0 and the diagonal are ignored (any value,
        ``-inf`` included).
    lengths : int Tensor of shape ``batch``, optional
        Number of words of each sentence (``1 <= lengths <= N``); sentence
        ``b`` uses ``scores[b, :lengths[b] + 1, :lengths[b] + 1]``. Default:
        every sentence has ``N`` words.
    projective, single_root : bool
        As in :class:`sparsemap.TreeFactor`.
    n_jobs, return_info, **solve_kw
        As in :func:`sparsemap`.

    Returns
    -------
    Tensor, shaped like ``scores``
        Arc posteriors: each word's column sums to one within its sentence; 0
        in the padding.
    info : SolveInfo
        Only with ``return_info=True``: per sentence, shaped like ``lengths``.

    Examples
    --------
    >>> import torch, sparsemap.torch as smt
    >>> scores = torch.zeros(2, 4, 4)
    >>> scores[:, 0, 1] = scores[:, 1, 2] = scores[:, 2, 3] = 2.0
    >>> u = smt.tree(scores, lengths=torch.tensor([3, 2]))
    >>> u[0]
    tensor([[0., 1., 0., 0.],
            [0., 0., 1., 0.],
            [0., 0., 0., 1.],
            [0., 0., 0., 0.]])
    >>> u[1]
    tensor([[0., 1., 0., 0.],
            [0., 0., 1., 0.],
            [0., 0., 0., 0.],
            [0., 0., 0., 0.]])
    """
    _check_scores_tensor(scores, "scores", 2, "(*batch, N + 1, N + 1)")
    n1 = scores.shape[-1]
    if scores.shape[-2] != n1 or n1 < 2:
        raise ValueError(f"scores: expected shape (*batch, N + 1, N + 1) with N >= 1, "
                         f"got {tuple(scores.shape)}")
    batch_shape = tuple(scores.shape[:-2])
    sizes = [n1 - 1] * math.prod(batch_shape) if lengths is None else \
        _sizes(lengths, "lengths", batch_shape, n1 - 1)
    factors = _ragged_factors(sm.TreeFactor, [(s,) for s in sizes], (n1 - 1,),
                              (bool(projective), bool(single_root)))
    return _family(factors, scores, None, batch_shape, n_jobs, return_info, solve_kw)


def sequence(eta_u, eta_v=None, lengths=None, *, n_jobs=None, return_info=False, **solve_kw):
    """SparseMAP tag posteriors of sequences (a linear chain).

    Parameters
    ----------
    eta_u : Tensor, shape ``(*batch, N, m)``
        ``eta_u[..., i, t]`` scores tag ``t`` at position ``i``.
    eta_v : Tensor, optional
        Transition scores, ``eta_v[..., i, a, b]`` scoring tag ``a`` at ``i``
        then ``b`` at ``i + 1``: shape ``(*batch, N - 1, m, m)``, or a transition
        matrix ``(m, m)`` (or ``(*batch, m, m)``) shared by every position, as
        in a CRF. Default: zeros.
    lengths : int Tensor of shape ``batch``, optional
        Length of each sequence (``1 <= lengths <= N``); sequence ``b`` uses
        positions ``:lengths[b]`` (and transitions ``:lengths[b] - 1``).
    n_jobs, return_info, **solve_kw
        As in :func:`sparsemap`.

    Returns
    -------
    Tensor, shaped like ``eta_u``
        Tag posteriors (rows sum to one within each sequence, 0 beyond).
    info : SolveInfo
        Only with ``return_info=True``: per sequence, with the batch shape.

    Examples
    --------
    >>> import torch, sparsemap.torch as smt
    >>> eta_u = torch.tensor([[[2.0, 0.0], [0.0, 0.0], [0.0, 0.5]]])
    >>> smt.sequence(eta_u)
    tensor([[[1.0000, 0.0000],
             [0.5000, 0.5000],
             [0.2500, 0.7500]]])
    >>> stay = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # reward keeping the tag
    >>> smt.sequence(eta_u, stay)
    tensor([[[1.0000, 0.0000],
             [0.6250, 0.3750],
             [0.6250, 0.3750]]])
    """
    _check_scores_tensor(eta_u, "eta_u", 2, "(*batch, N, m)")
    n, m = eta_u.shape[-2], eta_u.shape[-1]
    batch_shape = tuple(eta_u.shape[:-2])
    sizes = [n] * math.prod(batch_shape) if lengths is None else \
        _sizes(lengths, "lengths", batch_shape, n)
    factors = _ragged_factors(sm.SequenceFactor, [(s,) for s in sizes], (n,), (m,))
    if eta_v is not None and eta_v.dim() <= eta_u.dim():
        # a transition matrix shared by the positions (and maybe the batch)
        eta_v = _expand_transitions(_cached_factor(sm.SequenceFactor, n, m), eta_u, eta_v)
    return _family(factors, eta_u, eta_v, batch_shape, n_jobs, return_info, solve_kw)


def matching(scores, n_rows=None, n_cols=None, *, n_jobs=None, return_info=False,
             **solve_kw):
    """SparseMAP posteriors of bipartite matchings (alignments).

    Parameters
    ----------
    scores : Tensor, shape ``(*batch, R, C)``
        ``scores[..., i, j]`` scores matching row ``i`` with column ``j``.
    n_rows, n_cols : int Tensor of shape ``batch``, optional
        Sizes of each element's problem (rows ``1..R``, columns ``1..C``;
        default all): element ``b`` matches ``min(n_rows[b], n_cols[b])`` pairs
        within ``scores[b, :n_rows[b], :n_cols[b]]``.
    n_jobs, return_info, **solve_kw
        As in :func:`sparsemap`.

    Returns
    -------
    Tensor, shaped like ``scores``
        Pair posteriors: a doubly substochastic matrix (doubly stochastic when
        square), 0 in the padding.
    info : SolveInfo
        Only with ``return_info=True``: per problem, with the batch shape.

    Examples
    --------
    >>> import torch, sparsemap.torch as smt
    >>> smt.matching(torch.tensor([[1.0, 0.0], [0.0, 0.5]]))
    tensor([[0.8750, 0.1250],
            [0.1250, 0.8750]])
    """
    _check_scores_tensor(scores, "scores", 2, "(*batch, R, C)")
    R, C = scores.shape[-2], scores.shape[-1]
    batch_shape = tuple(scores.shape[:-2])
    B = math.prod(batch_shape)
    rows = [R] * B if n_rows is None else _sizes(n_rows, "n_rows", batch_shape, R)
    cols = [C] * B if n_cols is None else _sizes(n_cols, "n_cols", batch_shape, C)
    factors = _ragged_factors(sm.MatchingFactor, list(zip(rows, cols)), (R, C), ())
    return _family(factors, scores, None, batch_shape, n_jobs, return_info, solve_kw)


def sparsemax(x, dim=-1, *, n_jobs=None, return_info=False, **solve_kw):
    """Sparsemax (Martins and Astudillo, 2016): SparseMAP with one part per structure.

    The Euclidean projection of ``x`` onto the probability simplex along
    ``dim``, with the same semantics as ``entmax.sparsemax(x, dim)``. Entries
    at ``-inf`` get probability 0 (at least one entry per slice must be finite).

    Parameters
    ----------
    x : Tensor
    dim : int, default -1
    n_jobs, return_info, **solve_kw
        As in :func:`sparsemap`.

    Returns
    -------
    Tensor, shaped like ``x``
    info : SolveInfo
        Only with ``return_info=True``: per slice along ``dim``, shaped like
        ``x`` without ``dim``.

    Examples
    --------
    >>> import torch, sparsemap.torch as smt
    >>> smt.sparsemax(torch.tensor([1.0, 0.5, -1.0]))
    tensor([0.7500, 0.2500, 0.0000])
    """
    _check_tensor(x, "x")
    if x.dim() == 0:
        raise ValueError("x: expected at least one dimension, got a scalar")
    if not isinstance(dim, numbers.Integral) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: expected an integer in [{-x.dim()}, {x.dim() - 1}], got {dim!r}")
    xm = x.movedim(dim, -1)
    # SparseMAP of "exactly one on" is sparsemax; its MAP is an O(d) argmax
    out = sparsemap(_cached_factor(sm.XorFactor, xm.shape[-1]), xm, n_jobs=n_jobs,
                    return_info=return_info, **solve_kw)
    if return_info:
        return out[0].movedim(-1, dim), out[1]
    return out.movedim(-1, dim)


class Sparsemax(torch.nn.Module):
    """Module form of :func:`sparsemax`, as ``entmax.Sparsemax``.

    Parameters
    ----------
    dim : int, default -1
    n_jobs, **solve_kw
        As in :func:`sparsemap`.

    Examples
    --------
    >>> import torch, sparsemap.torch as smt
    >>> layer = smt.Sparsemax(dim=-1)
    >>> layer
    Sparsemax(dim=-1)
    >>> layer(torch.tensor([[1.0, 0.5, -1.0], [0.0, 0.0, 0.0]]))
    tensor([[0.7500, 0.2500, 0.0000],
            [0.3333, 0.3333, 0.3333]])
    """

    def __init__(self, dim=-1, *, n_jobs=None, **solve_kw):
        super().__init__()
        self.dim, self.n_jobs, self.solve_kw = dim, n_jobs, solve_kw

    def forward(self, x):
        """Sparsemax of ``x`` along ``self.dim``."""
        return sparsemax(x, self.dim, n_jobs=self.n_jobs, **self.solve_kw)

    def extra_repr(self):
        return f"dim={self.dim}"


# -- losses ---------------------------------------------------------------------------
def _parallel(fn, B, costs, n_jobs, factors=None):
    """``[fn(b) for b in range(B)]`` on n_jobs threads, the batch layer's helpers and the
    caller, each call solving without the GIL; in the batch layer's order: by decreasing
    ``costs[b]`` (ties in input order), or in input order when ``costs`` is None. The
    default ``n_jobs`` is chosen from ``factors`` as by ``_check_n_jobs``."""
    n_threads = min(_check_n_jobs(n_jobs, factors), B)
    if n_threads <= 1:
        return [fn(b) for b in range(B)]
    out = [None] * B
    errors = {}
    pending = iter(_order(B, costs).tolist())   # next() holds the GIL

    def work(_=0):
        for b in pending:
            try:
                out[b] = fn(b)
            except BaseException as exc:  # re-raised by the caller
                errors[b] = exc
                return

    crew = _helpers()
    k = crew.start(work, n_threads - 1)
    try:
        work()
    finally:
        if k:
            crew.join(k)
    if errors:
        raise errors[min(errors)]
    return out


def _targets(target, layout):
    """``(targets, dense)``: compact structures as an integer array ``(B, k)`` (``k``: the
    padded structure size, ``(B,)`` for one-int structures; ``dense=False``), or dense 0/1
    columns from a float tensor shaped like ``eta_u``, as a list of per-problem blocks
    (``dense=True``; the loss converts them with :meth:`Factor.from_vertex`, as the NumPy
    losses cannot always tell the two forms apart by shape)."""
    if isinstance(target, torch.Tensor):
        arr = _numpy_of(target)
        if arr.dtype.kind == "f":
            arr = arr.astype(np.float64)
    else:
        try:
            arr = np.asarray(target)
        except Exception as exc:  # ragged nested lists and other junk
            raise ValueError(f"target: expected an integer tensor ({exc})")
    nb = len(layout.batch_shape)
    if arr.dtype.kind == "f":    # dense columns m_t, each element reads its block
        want = layout.batch_shape + layout.pad_u
        if arr.shape != want:
            raise ValueError(f"target: a float target is dense (0/1 parts shaped like eta_u): "
                             f"expected shape {want}, got {arr.shape}")
        return (layout.split_u(arr) if layout.ragged else
                list(arr.reshape((layout.B,) + layout.pad_u))), True
    if arr.dtype.kind not in "iu":
        raise ValueError(f"target: expected integers (compact structures) or floats (dense "
                         f"0/1 parts), got dtype {arr.dtype}")
    if arr.shape[:nb] != layout.batch_shape or arr.ndim - nb > 1:
        raise ValueError(f"target: expected shape {layout.batch_shape} + (structure size,) "
                         f"(the batch dims, then one compact structure), got {arr.shape}")
    return arr.reshape((layout.B,) + arr.shape[nb:]), False


class _LossFunction(_Function):
    """The per-element losses of a batch, computed by ``run(eta_u, eta_v)`` (a
    :class:`_LossRun`) inside the forward pass, where ``torch.func`` transforms hand the
    score tensors over unwrapped; the gradients it finds are the backward pass's."""

    @staticmethod
    def forward(run, eta_u, eta_v):
        losses, g_u, g_v = run(eta_u, eta_v)
        run.grads = _like(g_u, _spec(eta_u)), None if g_v is None else _like(g_v, _spec(eta_v))
        return _like(losses, _spec(eta_u))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.grads = inputs[0].grads

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        # torch operations only, so that the backward pass runs under torch.func too
        out = [None if G is None else G * g.reshape(g.shape + (1,) * (G.dim() - g.dim()))
               for G in ctx.grads]
        return None, out[0], out[1]


# The losses the batch runner computes itself (a 0/1 target, method "auto"): whether
# each solves SparseMAP (else MAP), and its margin when not given
_PADDED_LOSSES = {sm.sparsemap_loss: (True, 0.0), sm.structured_svm_loss: (False, 1.0),
                  sm.perceptron_loss: (False, 0.0)}


class _LossRun:
    """One loss call's computation, ``(losses, g_u, g_v)`` as host arrays from the score
    tensors: through the batch runner where it computes the loss itself, else through
    the NumPy loss per element in threads. ``grads`` carries the gradients from the
    forward pass to ``setup_context``."""

    def __init__(self, numpy_loss, layout, targets, dense, n_jobs, kw):
        self.numpy_loss, self.layout, self.targets, self.dense = numpy_loss, layout, targets, dense
        self.n_jobs, self.kw = n_jobs, kw
        self.grads = None

    def __call__(self, eta_u, eta_v):
        layout, targets, kw = self.layout, self.targets, self.kw
        factors = layout.factors if layout.ragged else layout.factor
        host = {}

        def one(b):
            """Element b's loss through the NumPy loss, ``(loss, g_u, g_v)``."""
            if not host:
                host["u"] = layout.split_u(_to_host(eta_u))
                host["v"] = None if eta_v is None else layout.split_v(_to_host(eta_v))
            f = layout.factor_of(b)
            try:
                if self.dense:
                    t = f.from_vertex(targets[b], names=("target", "target"))
                else:
                    t = int(targets[b]) if targets.ndim == 1 else targets[b, :f.struct_size]
                return self.numpy_loss(f, host["u"][b], t,
                                       None if host["v"] is None else host["v"][b], **kw)
            except ValueError as exc:
                if not layout.batch_shape:
                    raise
                raise ValueError(f"{exc}{_where(layout, b)}") from None

        sparse, margin = _PADDED_LOSSES[self.numpy_loss]
        solve_kw = {k: v for k, v in kw.items() if k != "margin"}
        if not self.dense and layout.B and kw.get("method", "auto") == "auto" and \
                set(solve_kw) <= {"method", "max_iter", "tol"}:
            g_u, g_v, losses = _padded_losses(layout, factors, eta_u, eta_v, targets,
                                              kw.get("margin", margin), sparse, self.n_jobs,
                                              solve_kw, one)
        else:
            costs = [f.n_u + f.n_v for f in layout.factors] if layout.ragged else None
            out = _parallel(one, layout.B, costs, self.n_jobs, factors)
            losses = np.array([o[0] for o in out], dtype=np.float64)
            g_u = layout.join([o[1] for o in out], "u")
            g_v = None if eta_v is None else layout.join([o[2] for o in out], "v")
        return losses.reshape(layout.batch_shape), g_u, g_v


def _loss(numpy_loss, factor, eta_u, target, eta_v, reduction, n_jobs, kw):
    _check_reduction(reduction)
    _check_tensor(eta_u, "eta_u")
    eta_v = _expand_transitions(factor, eta_u, eta_v)
    layout = _Layout(factor, eta_u, eta_v)
    targets, dense = _targets(target, layout)
    run = _LossRun(numpy_loss, layout, targets, dense, n_jobs, kw)
    try:
        per = _LossFunction.apply(run, eta_u, eta_v)
    finally:
        run.grads = None    # the backward pass holds them (ctx), not the run
    if reduction == "none":
        return per
    return per.mean() if reduction == "mean" else per.sum()


def _padded_losses(layout, factors, eta_u, eta_v, targets, margin, sparse, n_jobs, solve_kw,
                   one):
    """``(g_u, g_v, losses)`` of a batch by :func:`sparsemap.losses._loss_padded`: the
    scores read where they are, one target array, the outputs written in the threads."""
    margin = _check_nonneg(margin, "margin")
    try:
        rows = _target_rows(factors, targets, layout.B)
    except ValueError as exc:
        m = re.match(r"targets\[(\d+)\]", str(exc))
        if m is None:
            raise ValueError(f"target{str(exc)[len('targets'):]}") from None
        raise ValueError(f"target{str(exc)[m.end():]}{_where(layout, int(m[1]))}") from None
    eu = layout.host(eta_u, "u")
    ev = None if eta_v is None else layout.host(eta_v, "v")
    g_u = np.empty(eu.shape)
    g_v = None if eta_v is None else np.empty(ev.shape)
    losses = np.empty(layout.B)
    try:
        _loss_padded(factors, eu, ev, rows, margin, sparse, n_jobs, solve_kw, g_u, g_v,
                     losses, one)
    except ValueError as exc:
        raise _batch_error(exc, layout) from None
    return (g_u.reshape(layout.batch_shape + layout.pad_u),
            None if g_v is None else g_v.reshape(layout.batch_shape + layout.pad_v), losses)


_LOSS_PARAMS = """factor : Factor or list of Factor
        As in :func:`sparsemap`: one shared factor, or one per batch element.
    eta_u : Tensor, shape ``(*batch, *factor.shape_u)``
        Scores (padded for a list of factors), any float dtype and device.
    target : int Tensor, shape ``(*batch, *structure_shape)``, or float Tensor like ``eta_u``
        One gold structure per element, in the factor's compact form: heads
        ``(*batch, N + 1)`` for trees, tags ``(*batch, N)`` for sequences,
        columns ``(*batch, R)`` for matchings, an index ``(*batch,)`` for a
        :class:`~sparsemap.GenericFactor`. With a list of factors, element
        ``b`` reads the leading ``factors[b].struct_size`` entries (so padded
        targets work). A float tensor shaped like ``eta_u`` is the dense form
        (the 0/1 column ``m_t``, e.g. a one-hot arc matrix), read blockwise.
    eta_v : Tensor, shape ``(*batch, *factor.shape_v)``, optional
        Additional scores (zeros when omitted)."""

_LOSS_RETURNS = """Returns
    -------
    Tensor
        The mean (``reduction="mean"``) or sum (``"sum"``) over the batch, or
        the per-element losses of shape ``batch`` (``"none"``), in the dtype and
        on the device of ``eta_u``.

    Raises
    ------
    ValueError
        On shapes that do not match the factor(s), an unknown ``reduction``, a
        target that is not a structure of its factor (the message gives the
        batch element)."""


def sparsemap_loss(factor, eta_u, target, eta_v=None, margin=0.0, reduction="mean", *,
                   n_jobs=None, **solve_kw):
    """SparseMAP loss and margin SparseMAP loss (Section 4), batched.

    Per element, :func:`sparsemap.sparsemap_loss`: the Fenchel-Young loss of
    SparseMAP, cost-augmented by ``margin`` times the Hamming cost. Its gradient
    is Proposition 2's ``(u* - m_t, v* - n_t)``, kept from the forward solve (the
    backward pass solves nothing). With compact targets and the default method, the
    losses run as the layer does: the batch runner's threads read each element's
    block of the scores and its target, add the cost, solve, and write the value
    and the gradient, with no Python object per element (the same solves and
    gradients and values as the NumPy loss, bit for bit: one kernel).

    Parameters
    ----------
    {params}
    margin : float, default 0
        Scale of the Hamming cost; 0 gives the plain SparseMAP loss.
    reduction : {{"mean", "sum", "none"}}, default "mean"
    n_jobs : int, optional
        Threads, as for :func:`sparsemap.solve_batch` (default: all cores, or 1 for
        an :class:`~sparsemap.OracleFactor`).
    **solve_kw
        Passed to :func:`sparsemap.solve`.

    {returns}

    Examples
    --------
    >>> import torch, sparsemap as sm, sparsemap.torch as smt
    >>> scores = torch.zeros(2, 4, 4, requires_grad=True)
    >>> heads = torch.tensor([[-1, 0, 1, 2], [-1, 2, 0, -1]])  # 2nd: 2 words
    >>> factors = [sm.TreeFactor(3), sm.TreeFactor(2)]
    >>> loss = smt.sparsemap_loss(factors, scores, heads, reduction="none")
    >>> loss
    tensor([1.0000, 0.5000], grad_fn=<_LossFunctionBackward>)
    >>> loss.sum().backward()
    >>> scores.grad[1]                  # u* - m_t, zero in the padding
    tensor([[ 0.0000,  0.5000, -0.5000,  0.0000],
            [ 0.0000,  0.0000,  0.5000,  0.0000],
            [ 0.0000, -0.5000,  0.0000,  0.0000],
            [ 0.0000,  0.0000,  0.0000,  0.0000]])
    """
    return _loss(sm.sparsemap_loss, factor, eta_u, target, eta_v, reduction, n_jobs,
                 dict(margin=margin, **solve_kw))


def structured_svm_loss(factor, eta_u, target, eta_v=None, margin=1.0, reduction="mean", *,
                        n_jobs=None):
    """Structured SVM (max-margin) loss with the Hamming cost (Table 1), batched.

    Per element, :func:`sparsemap.structured_svm_loss`: cost-augmented MAP
    ``s``, loss ``a_s . eta + margin * cost(s) - a_t . eta``, subgradient
    ``a_s - a_t``.

    Parameters
    ----------
    {params}
    margin : float, default 1
        Scale of the Hamming cost; 0 gives the perceptron.
    reduction : {{"mean", "sum", "none"}}, default "mean"
    n_jobs : int, optional
        Threads, as for :func:`sparsemap.solve_batch` (default: all cores, or 1 for
        an :class:`~sparsemap.OracleFactor`).

    {returns}

    Examples
    --------
    A batch of one sequence; the target is the best sequence, but another one
    is within the margin:

    >>> import torch, sparsemap as sm, sparsemap.torch as smt
    >>> f = sm.SequenceFactor(3, 2)
    >>> eta_u = torch.tensor([[[1.0, 0.0], [0.0, 0.5], [1.0, 0.0]]],
    ...                      requires_grad=True)
    >>> loss = smt.structured_svm_loss(f, eta_u, torch.tensor([[0, 1, 0]]))
    >>> loss
    tensor(0.5000, grad_fn=<MeanBackward0>)
    >>> loss.backward()
    >>> eta_u.grad
    tensor([[[ 0.,  0.],
             [ 1., -1.],
             [ 0.,  0.]]])
    """
    return _loss(sm.structured_svm_loss, factor, eta_u, target, eta_v, reduction, n_jobs,
                 dict(margin=margin))


def perceptron_loss(factor, eta_u, target, eta_v=None, reduction="mean", *, n_jobs=None):
    """Structured perceptron loss (Table 1), batched.

    Per element, :func:`sparsemap.perceptron_loss`: ``max_s a_s . eta - a_t . eta``
    with subgradient ``a_s - a_t`` at the MAP structure ``s``.

    Parameters
    ----------
    {params}
    reduction : {{"mean", "sum", "none"}}, default "mean"
    n_jobs : int, optional
        Threads, as for :func:`sparsemap.solve_batch` (default: all cores, or 1 for
        an :class:`~sparsemap.OracleFactor`).

    {returns}

    Examples
    --------
    A batch of one sequence; the target scores 2, the best sequence 2.5:

    >>> import torch, sparsemap as sm, sparsemap.torch as smt
    >>> f = sm.SequenceFactor(3, 2)
    >>> eta_u = torch.tensor([[[1.0, 0.0], [0.0, 0.5], [1.0, 0.0]]],
    ...                      requires_grad=True)
    >>> loss = smt.perceptron_loss(f, eta_u, torch.tensor([[0, 0, 0]]))
    >>> loss
    tensor(0.5000, grad_fn=<MeanBackward0>)
    >>> loss.backward()
    >>> eta_u.grad
    tensor([[[ 0.,  0.],
             [-1.,  1.],
             [ 0.,  0.]]])
    """
    return _loss(sm.perceptron_loss, factor, eta_u, target, eta_v, reduction, n_jobs, {})


for _fn in (sparsemap_loss, structured_svm_loss, perceptron_loss):
    _fn.__doc__ = _fn.__doc__.format(params=_LOSS_PARAMS, returns=_LOSS_RETURNS)


class _LossModule(torch.nn.Module):
    _fn = None

    def __init__(self, reduction="mean", *, n_jobs=None, **kw):
        super().__init__()
        _check_reduction(reduction)
        self.reduction, self.n_jobs, self.kw = reduction, n_jobs, kw

    def forward(self, factor, eta_u, target, eta_v=None):
        """The loss of ``eta_u`` (and ``eta_v``) against ``target`` for ``factor``."""
        return type(self)._fn(factor, eta_u, target, eta_v, reduction=self.reduction,
                              n_jobs=self.n_jobs, **self.kw)

    def extra_repr(self):
        items = [f"reduction={self.reduction!r}"] + [f"{k}={v!r}" for k, v in self.kw.items()]
        return ", ".join(items)


class SparseMAPLoss(_LossModule):
    """Module form of :func:`sparsemap_loss` (as ``entmax.SparsemaxLoss``).

    Parameters
    ----------
    margin : float, default 0
    reduction : {"mean", "sum", "none"}, default "mean"
    n_jobs : int, optional
    **solve_kw
        Passed to :func:`sparsemap.solve`.

    Examples
    --------
    >>> import torch, sparsemap as sm, sparsemap.torch as smt
    >>> loss_fn = smt.SparseMAPLoss(margin=1.0)
    >>> heads = torch.tensor([-1, 0, 1, 2])
    >>> loss_fn(sm.TreeFactor(3), torch.zeros(4, 4), heads)
    tensor(3.7500)
    """
    _fn = staticmethod(sparsemap_loss)

    def __init__(self, margin=0.0, reduction="mean", *, n_jobs=None, **solve_kw):
        super().__init__(reduction, n_jobs=n_jobs, margin=margin, **solve_kw)


class StructuredSVMLoss(_LossModule):
    """Module form of :func:`structured_svm_loss`.

    Parameters
    ----------
    margin : float, default 1
    reduction : {"mean", "sum", "none"}, default "mean"
    n_jobs : int, optional

    Examples
    --------
    >>> import torch, sparsemap as sm, sparsemap.torch as smt
    >>> loss_fn = smt.StructuredSVMLoss(margin=1.0, reduction="none")
    >>> targets = torch.tensor([[-1, 0, 1, 2], [-1, 2, 0, 2]])
    >>> loss_fn(sm.TreeFactor(3), torch.zeros(2, 4, 4), targets)
    tensor([3., 3.])
    """
    _fn = staticmethod(structured_svm_loss)

    def __init__(self, margin=1.0, reduction="mean", *, n_jobs=None):
        super().__init__(reduction, n_jobs=n_jobs, margin=margin)


class PerceptronLoss(_LossModule):
    """Module form of :func:`perceptron_loss`.

    Parameters
    ----------
    reduction : {"mean", "sum", "none"}, default "mean"
    n_jobs : int, optional

    Examples
    --------
    >>> import torch, sparsemap as sm, sparsemap.torch as smt
    >>> loss_fn = smt.PerceptronLoss()
    >>> scores = torch.zeros(4, 4)
    >>> scores[0, 2] = scores[2, 1] = scores[2, 3] = 1.0
    >>> loss_fn(sm.TreeFactor(3), scores, torch.tensor([-1, 0, 1, 2]))
    tensor(2.)
    """
    _fn = staticmethod(perceptron_loss)


# -- factor graphs (LP-SparseMAP) -------------------------------------------------------
_GRAPH_SOLVE_KW = ("max_iter", "tol", "rho", "polish")


def _graph_list(graph):
    if not isinstance(graph, (list, tuple)):
        raise ValueError(f"graph: expected a sparsemap.FactorGraph or a list of them, "
                         f"got {type(graph).__name__}")
    graphs = list(graph)
    if not graphs:
        raise ValueError("graph: expected at least one FactorGraph, got an empty list")
    for i, g in enumerate(graphs):
        if not isinstance(g, sm.FactorGraph):
            raise ValueError(f"graph[{i}]: expected a sparsemap.FactorGraph, "
                             f"got {type(g).__name__}")
    return graphs


def _graph_eta_v(entries, factors, name, batch_shape):
    """``[(f, tensor)]`` for the non-None entries of one graph's ``eta_v`` list; a
    shared graph's tensors get the batch dims (a tensor of ``factor.shape_v`` alone is
    expanded: autograd then sums its gradient over the batch)."""
    entries = check_per_factor(entries, len(factors), name)
    out = []
    for f, (factor, e) in enumerate(zip(factors, entries)):
        if e is None:
            continue
        _check_tensor(e, f"{name}[{f}]")
        if factor.n_v == 0:
            raise ValueError(f"{name}[{f}]: factor {f} ({factor!r}) has no additional scores; "
                             f"pass None")
        sv = factor.shape_v
        if batch_shape and tuple(e.shape) == sv:
            e = e.expand(batch_shape + sv)
        elif tuple(e.shape) != batch_shape + sv:
            also = f" or {sv} (shared by the batch)" if batch_shape else ""
            raise ValueError(f"{name}[{f}]: expected shape {batch_shape + sv} (the batch dims "
                             f"of eta_u, then factor.shape_v){also}, got {tuple(e.shape)}")
        out.append((f, e))
    return out


class _GraphLayout:
    """Where the problems of a factor-graph batch sit.

    One shared graph over the batch dims of ``eta_u`` (``ragged=False``), or one
    graph per element of ``eta_u``'s single batch dim, whose variables are the
    leading ``n_variables`` entries of its row (``ragged=True``). Each graph's
    factors are read once, here. ``tensors`` are the ``eta_v`` tensors the
    autograd function takes, ``slots`` their ``(b, f)``: element ``b`` (None: every
    element of a shared graph, the tensor has the batch dims) and factor ``f``.
    """

    def __init__(self, graph, eta_u, eta_v):
        _check_tensor(eta_u, "eta_u")
        self.tensors, self.slots = [], []
        if isinstance(graph, sm.FactorGraph):
            self.ragged = False
            V = graph.n_variables
            if eta_u.dim() < 1 or eta_u.shape[-1] != V:
                raise ValueError(f"eta_u: expected shape (*batch, {V}) (batch dims, then "
                                 f"graph.n_variables), got {tuple(eta_u.shape)}")
            self.batch_shape = tuple(eta_u.shape[:-1])
            self.B = int(np.prod(self.batch_shape, dtype=np.int64))
            self.graphs = [graph]
            self.factors = [tuple(graph.factors)]
            if eta_v is not None:
                for f, t in _graph_eta_v(eta_v, self.factors[0], "eta_v", self.batch_shape):
                    self.tensors.append(t)
                    self.slots.append((None, f))
        else:
            self.ragged = True
            self.graphs = _graph_list(graph)
            B = len(self.graphs)
            if eta_u.dim() != 2 or eta_u.shape[0] != B:
                raise ValueError(f"eta_u: with a list of {B} graphs, expected shape "
                                 f"(B={B}, padded n_variables), got {tuple(eta_u.shape)}")
            for b, g in enumerate(self.graphs):
                if g.n_variables > eta_u.shape[1]:
                    raise ValueError(f"eta_u: graph[{b}] has {g.n_variables} variables, more "
                                     f"than the padded size {eta_u.shape[1]}")
            self.batch_shape, self.B = (B,), B
            self.factors = [tuple(g.factors) for g in self.graphs]
            if eta_v is not None:
                if isinstance(eta_v, torch.Tensor) or not isinstance(eta_v, (list, tuple)) \
                        or len(eta_v) != B:
                    raise ValueError(f"eta_v: with a list of {B} graphs, expected a list of {B} "
                                     f"entries, each None or a list with one entry per factor "
                                     f"of its graph")
                for b, entries in enumerate(eta_v):
                    if entries is None:
                        continue
                    for f, t in _graph_eta_v(entries, self.factors[b], f"eta_v[{b}]", ()):
                        self.tensors.append(t)
                        self.slots.append((b, f))
        self.pad = eta_u.shape[-1]
        self.index_shape = self.batch_shape
        self.sizes = [g.n_variables for g in self.graphs]
        # threads take the largest graphs of a ragged batch first: variables plus factor
        # parts, per problem (None: one shared graph, problems in input order)
        self.costs = [V + sum(f.n_u + f.n_v for f in fs)
                      for V, fs in zip(self.sizes, self.factors)] if self.ragged else None

    def which(self, b):
        """Index of problem b's graph in ``graphs`` / ``factors`` / ``sizes``."""
        return b if self.ragged else 0

    def host_u(self, x):
        """``(B, pad)`` float64 host copy of a tensor shaped like ``eta_u`` (None: zeros)."""
        if x is None:
            return np.zeros((self.B, self.pad))
        return _to_host(x).reshape(self.B, self.pad)

    def host_v(self, xs):
        """Per problem, the ``eta_v`` list for FactorGraph.solve / jvp (None when no slot
        has a value), from one tensor (or None) per slot."""
        out = [None] * self.B
        for (b0, f), x in zip(self.slots, xs):
            if x is None:
                continue
            h = _to_host(x)
            for b in (range(self.B) if b0 is None else (b0,)):
                fs = self.factors[self.which(b)]
                if out[b] is None:
                    out[b] = [None] * len(fs)
                out[b][f] = (h.reshape((self.B,) + fs[f].shape_v)[b] if b0 is None
                             else h.reshape(fs[f].shape_v))
        return out

    def join_u(self, arrays):
        """Per-problem u-shaped arrays -> ``(*batch, pad)``, zero-padded."""
        out = np.zeros((self.B, self.pad))
        for b, a in enumerate(arrays):
            out[b, :len(a)] = a
        return out.reshape(self.batch_shape + (self.pad,))

    def join_v(self, gvs):
        """Per problem, per factor eta_v gradients -> one array per slot."""
        out = []
        for b0, f in self.slots:
            sv = self.factors[0 if b0 is None else b0][f].shape_v
            if b0 is not None:
                out.append(gvs[b0][f].reshape(sv))
            else:
                g = np.zeros((self.B,) + sv)
                for b in range(self.B):
                    g[b] = gvs[b][f]
                out.append(g.reshape(self.batch_shape + sv))
        return out


def _in_threads(fn, layout, n_jobs):
    """``[fn(b) for b in range(B)]`` in the layer's threads (a solve, and the CG of a
    jvp / vjp, run without the GIL), largest graphs first; by default one thread when a
    graph holds an OracleFactor (its callbacks hold the GIL)."""
    return _parallel(fn, layout.B, layout.costs, n_jobs,
                     (f for fs in layout.factors for f in fs))


def _graph_solve(layout, eta_u, tensors, n_jobs, solve_kw):
    from sparsemap._factor_graph import _raise_unless_solved
    eu = layout.host_u(eta_u)
    evs = layout.host_v(tensors)

    def one(b):
        k = layout.which(b)
        try:
            return layout.graphs[k]._solve_quiet(eu[b, :layout.sizes[k]], evs[b], **solve_kw)
        except ValueError as exc:
            if str(exc).startswith("eta_"):
                raise ValueError(f"{exc}{_where(layout, b)}") from None
            raise

    results = _in_threads(one, layout, n_jobs)
    for b, r in enumerate(results):      # an infeasible graph or an uncertified solve
        _raise_unless_solved(r, f"{_element(layout, b)}: " if layout.batch_shape else "", b)
    return results


class _GraphJacobian:
    """The exact Jacobian of ``u`` for a solved factor-graph batch (FactorGraphResult's
    jvp / vjp per problem, in threads), padded; inputs ``(eta_u, *eta_v tensors)``."""

    def __init__(self, layout, results, n_jobs, eta_u, tensors):
        self.layout, self.results, self.n_jobs = layout, results, n_jobs
        self.like_u = _spec(eta_u)
        self.like_v = [_spec(t) for t in tensors]

    def apply(self, xs, transpose):
        lay = self.layout

        def size(b):
            return lay.sizes[lay.which(b)]

        g = lay.host_u(xs[0])
        if not transpose:    # (d_eta_u, *d_eta_v) -> du
            dvs = lay.host_v(list(xs[1:]) + [None] * (len(lay.slots) - len(xs) + 1))
            out = _in_threads(lambda b: self.results[b].jvp(g[b, :size(b)], dvs[b]), lay,
                              self.n_jobs)
            return (_like(lay.join_u(out), self.like_u),)
        out = _in_threads(lambda b: self.results[b].vjp(g[b, :size(b)]), lay,
                          self.n_jobs)     # du -> (g_eta_u, *g_eta_v)
        g_u = _like(lay.join_u([o[0] for o in out]), self.like_u)
        g_v = lay.join_v([o[1] for o in out])
        return (g_u,) + tuple(_like(a, like) for a, like in zip(g_v, self.like_v))


class _FactorGraphFunction(_JacobianFunction):
    @staticmethod
    def forward(layout, n_jobs, solve_kw, eta_u, *tensors):
        results = _graph_solve(layout, eta_u, tensors, n_jobs, solve_kw)
        layout.jac = _GraphJacobian(layout, results, n_jobs, eta_u, tensors)
        return _like(layout.join_u([r.u for r in results]), _spec(eta_u))


def factor_graph(graph, eta_u, eta_v=None, *, n_jobs=None, **solve_kw):
    """LP-SparseMAP marginals of a factor graph's variables, as a differentiable operation.

    The PyTorch form of :meth:`sparsemap.FactorGraph.solve`: ``u`` with the exact
    backward pass of :meth:`sparsemap.FactorGraphResult.vjp`, for ``eta_u`` and
    every factor's ``eta_v``.

    Parameters
    ----------
    graph : FactorGraph or list of FactorGraph
        One graph for every problem of the batch, or one per batch element
        (ragged batches; ``eta_u`` then has exactly one batch dimension). The
        graph's factors are read when the function is called.
    eta_u : Tensor, shape ``(*batch, graph.n_variables)``
        Scores of the variables, any float dtype and device. With a list of
        graphs: shape ``(B, V)``, element ``b`` using the leading
        ``graphs[b].n_variables`` entries of its row (the rest is never read).
    eta_v : list, optional
        Additional scores, as in :meth:`~sparsemap.FactorGraph.solve`: one entry
        per factor of the graph, in the order of ``add``, each None (zeros) or
        a tensor of shape ``(*batch, *factor.shape_v)``, or ``factor.shape_v``
        alone for scores shared by the batch. With a list of graphs: one entry
        per graph, each None or such a list for its graph (tensors of shape
        ``factor.shape_v``).
    n_jobs : int, optional
        Threads for the solves and the backward products (default: all cores).
    **solve_kw
        Passed to :meth:`~sparsemap.FactorGraph.solve`: ``max_iter``, ``tol``,
        ``rho``, ``polish``.

    Returns
    -------
    u : Tensor, shaped, typed and placed like ``eta_u``
        Zero past each graph's variables in a ragged batch.

    Raises
    ------
    ValueError
        On a ``graph`` that is not a FactorGraph (or a list of them), shapes
        that do not match the graphs, a wrong-length ``eta_v`` list, ``eta_v``
        for a factor without additional scores, non-tensor or integer scores,
        NaN or infinite scores (naming the batch element), an unknown keyword.

    Warns
    -----
    ConvergenceWarning
        For each problem that did not converge (naming the batch element).

    Notes
    -----
    ``u`` is piecewise linear in ``(eta_u, eta_v)``: near a solution every
    factor stays on the face of its final support, where ``u`` is an affine
    projection of the scores. The backward pass applies the exact Jacobian (an
    orthogonal projector, by conjugate gradient; see :doc:`/factor_graphs`),
    needs no new solve and runs on the ``n_jobs`` threads. As for
    :func:`sparsemap`, it is itself a differentiable linear map: double backward
    and forward-mode AD work, and the second derivative with respect to the
    scores is zero.

    Examples
    --------
    Exactly one of variables 0 and 1 on, at most one of 1 and 2:

    >>> import torch, sparsemap as sm, sparsemap.torch as smt
    >>> fg = sm.FactorGraph(3)
    >>> fg.add(sm.XorFactor(2), [0, 1])
    0
    >>> fg.add(sm.AtMostOneFactor(2), [1, 2])
    1
    >>> eta_u = torch.tensor([0.2, 0.5, 0.9], requires_grad=True)
    >>> u = smt.factor_graph(fg, eta_u)
    >>> u
    tensor([0.5333, 0.4667, 0.5333], grad_fn=<_FactorGraphFunctionBackward>)
    >>> u[2].backward()
    >>> eta_u.grad
    tensor([ 0.3333, -0.3333,  0.3333])
    """
    for k in solve_kw:
        if k not in _GRAPH_SOLVE_KW:
            raise ValueError(f"{k}: not an option of FactorGraph.solve (expected one of "
                             f"{', '.join(_GRAPH_SOLVE_KW)})")
    layout = _GraphLayout(graph, eta_u, eta_v)
    return _apply(_FactorGraphFunction, layout, layout, n_jobs, solve_kw, eta_u,
                  *layout.tensors)
