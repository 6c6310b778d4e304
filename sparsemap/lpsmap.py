"""lp-sparsemap's Python API over sparsemap, with exact answers.

Code written for `lp-sparsemap <https://github.com/deep-spin/lp-sparsemap>`_
runs unchanged after ``from lpsmap import ...`` becomes
``from sparsemap.lpsmap import ...``: the same classes, arguments, variable
layouts and ``.value`` attributes. The answers are the exact optimum of the
same problem (LP-SparseMAP over the factor graph's local polytope, or its
LP-MAP for ``solve_map``), where lp-sparsemap stops its
ADMM iterations at a tolerance; see :doc:`/migration`.

:class:`FactorGraph` takes and returns NumPy arrays; :class:`TorchFactorGraph`
takes tensors (any device and float dtype) and returns ``.value`` on the
scores' device and dtype, differentiable with respect to the scores and to the
factors' additional scores. This module is not imported by ``import sparsemap``
and imports PyTorch only when a :class:`TorchFactorGraph` is used.

How a call runs: each factor is translated to native factors attached to
variable indices (``sparsemap.FactorGraph.add``). When no variable is shared
between factors, every factor is its own SparseMAP problem, solved directly
(variables in no factor are clipped to ``[0, 1]``); otherwise the native
:class:`sparsemap.FactorGraph` solves the whole graph. Native factors and
graphs are cached by structure, so repeated graph shapes cost little to set up.
"""
import math
import numbers

import numpy as np

import sparsemap as sm

__all__ = ["FactorGraph", "TorchFactorGraph", "Xor", "Or", "AtMostOne", "Imply", "XorOut",
           "OrOut", "AndOut", "Budget", "Pair", "Sequence", "SequenceBudget", "DepTree"]

_SOLVE_DOC_PARAMS = """
        Parameters
        ----------
        max_iter : int, default 1000
            Accepted for compatibility and ignored. In lp-sparsemap it stops
            AD3's ADMM early, and code written for it sets it low as a speed
            setting (``max_iter=10``), getting a point that may break the
            constraints. Here the answer is always the certified optimum (or
            an error that says why there is none): see "Speed" in
            :doc:`/migration` for what that costs on such graphs.
        max_inner_iter : int, default 10
            Accepted for compatibility and ignored (each factor's SparseMAP
            step is solved exactly).
        tol : float, default 1e-6
            Accepted for compatibility and ignored (the answer is certified to
            round-off, far below any ``tol``).
        step_size : float, default 0.1
            Accepted for compatibility and ignored (AD3's penalty; sparsemap
            sets its own from the scale of the scores). ``step_size=0`` is
            accepted too.
        adapt : bool, default True
            Accepted for compatibility and ignored.
        verbose : int or bool, default False
            When true, print one line saying how the graph was solved: as
            plain SparseMAP, as independent factors, or as factor graphs (one
            per connected part), with ADMM's iterations, how the answer was
            certified and the largest constraint violation."""


# -- small helpers ---------------------------------------------------------------------
_NONFINITE = ("scores: contains nan or +inf (-inf is accepted: it fixes a variable at 0, a "
              "mask)")

_FACTORS = {}


def _factor(cls, *args, **kwargs):
    """One shared native factor per construction arguments."""
    key = (cls, args, tuple(kwargs.items()))
    f = _FACTORS.get(key)
    if f is None:
        if len(_FACTORS) > 4096:
            _FACTORS.clear()
        f = _FACTORS[key] = cls(*args, **kwargs)
    return f


_GRAPHS = {}


class _Part:
    """One connected part of a drop-in graph as a native FactorGraph: its variables
    (global indices, in the part's order) and its pieces (indices into the list)."""
    __slots__ = ("graph", "var", "pieces")

    def __init__(self, graph, var, pieces):
        self.graph, self.var, self.pieces = graph, var, pieces


def _native_parts(n_variables, pieces):
    """The native FactorGraphs of a structure, one per connected part (factors that share
    no variable, directly or through others, are separate problems: a padded batch of
    documents in one graph is one problem per document); cached by the factors and
    index arrays."""
    key = (n_variables,) + tuple((id(p.factor), p.idx.tobytes(), p.idx.shape) for p in pieces)
    hit = _GRAPHS.get(key)
    if hit is not None:
        return hit[0]
    # union-find over variables, joined through each piece's variables
    parent = np.arange(n_variables)

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    flat = [p.idx.reshape(-1)[p.idx.reshape(-1) >= 0] for p in pieces]
    for ids in flat:
        if ids.size > 1:
            r0 = root(ids[0])
            for i in ids[1:]:
                r = root(i)
                if r != r0:
                    parent[r] = r0
    comp = {}
    for k, ids in enumerate(flat):
        comp.setdefault(root(ids[0]) if ids.size else -1, []).append(k)
    parts = []
    for ks in comp.values():
        var = np.unique(np.concatenate([flat[k] for k in ks]))
        local = np.full(n_variables, -1, dtype=np.intp)
        local[var] = np.arange(var.size)
        g = sm.FactorGraph(max(var.size, 1))
        for k in ks:
            idx = pieces[k].idx
            g.add(pieces[k].factor, np.where(idx >= 0, local[np.maximum(idx, 0)], -1))
        parts.append(_Part(g, var, ks))
    if len(_GRAPHS) > 256:
        _GRAPHS.clear()
    _GRAPHS[key] = (parts, [p.factor for p in pieces])   # keep the factors alive with the key
    return parts


def _is_tensor(x):
    mod = type(x).__module__
    return mod.startswith("torch") and hasattr(x, "detach")


def _check_budget(budget, name="budget"):
    """An integer budget from an int, an integral float, a NumPy scalar or a 0-d tensor."""
    b = budget
    if type(b) is int and b >= 0:
        return b
    if _is_tensor(b):
        if b.numel() != 1:
            raise ValueError(f"{name}: expected a non-negative integer (a tensor with one "
                             f"element), got a tensor of shape {tuple(b.shape)}")
        b = b.item()
    elif isinstance(b, np.ndarray):
        if b.size != 1:
            raise ValueError(f"{name}: expected a non-negative integer, got an array of "
                             f"shape {b.shape}")
        b = b.reshape(()).item()
    elif isinstance(b, np.generic):
        b = b.item()
    if type(b) is float and b >= 0 and b.is_integer():
        return int(b)
    if isinstance(b, bool) or not isinstance(b, numbers.Real):
        raise ValueError(f"{name}: expected a non-negative integer, got {budget!r}")
    if isinstance(b, numbers.Integral):
        b = int(b)
    else:
        b = float(b)
        if not np.isfinite(b) or b != int(b):
            raise ValueError(f"{name}: expected a non-negative integer, got {budget!r} (a "
                             f"non-integral value; round it first, e.g. torch.round)")
        b = int(b)
    if b < 0:
        raise ValueError(f"{name}: expected a non-negative integer, got {budget!r}")
    return b


def _check_flag(x, name):
    if isinstance(x, (bool, np.bool_)) or (isinstance(x, numbers.Integral) and x in (0, 1)):
        return bool(x)
    raise ValueError(f"{name}: expected a bool, got {x!r}")


def _check_solver_args(max_iter, max_inner_iter, tol, step_size, adapt, verbose):
    if (type(max_iter) is int and type(max_inner_iter) is int and type(tol) is float
            and type(step_size) in (float, int) and type(adapt) is bool
            and type(verbose) in (bool, int) and max_iter >= 1 and max_inner_iter >= 1
            and 0 <= tol < math.inf and 0 <= step_size < math.inf):
        return int(verbose)      # the common case, checked quickly
    for v, name in ((max_iter, "max_iter"), (max_inner_iter, "max_inner_iter")):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{name}: expected a positive integer, got {v!r}")
    for v, name in ((tol, "tol"), (step_size, "step_size")):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not v >= 0 \
                or not np.isfinite(v):
            raise ValueError(f"{name}: expected a non-negative number, got {v!r}")
    _check_flag(adapt, "adapt")
    if isinstance(verbose, bool) or isinstance(verbose, numbers.Integral):
        return int(verbose)
    raise ValueError(f"verbose: expected an int or bool, got {verbose!r}")


def _index_key(key):
    """A NumPy index from one that may hold tensors."""
    if isinstance(key, tuple):
        return tuple(_index_key(k) for k in key)
    if _is_tensor(key):
        return key.detach().cpu().numpy()
    if isinstance(key, list):
        return [_index_key(k) for k in key]
    return key


# -- variables and slices --------------------------------------------------------------
class Variable:
    """A tensor of binary variables of a factor graph (lp-sparsemap's ``Variable``).

    Made by :meth:`FactorGraph.variable_from` or :meth:`FactorGraph.variable`.
    Indexing it (basic, fancy, boolean or nested NumPy indexing) gives a
    :class:`Slice` that factors accept.

    Attributes
    ----------
    shape : tuple of int
    value : ndarray or Tensor
        The variables' marginals after a solve, shaped like the scores; on a
        :class:`TorchFactorGraph`, on the scores' device and dtype. Before the
        graph is solved, reading it raises ``AttributeError``, as in
        lp-sparsemap (``hasattr(u, "value")`` is False).

    Examples
    --------
    >>> import numpy as np
    >>> from sparsemap.lpsmap import FactorGraph, Xor
    >>> fg = FactorGraph()
    >>> u = fg.variable_from(np.array([[0.5, 0.2], [0.1, 0.9]]))
    >>> u[0].shape, u[:, 1].shape
    ((2,), (2,))
    """

    def __init__(self, graph, scores):
        self._graph = graph
        self._scores = scores
        self.shape = tuple(scores.shape)
        self._ix = np.arange(math.prod(self.shape)).reshape(self.shape)
        self._value = None

    @property
    def value(self):
        if self._value is None:
            raise AttributeError("value: the graph has not been solved yet (call "
                                 "fg.solve() or fg.solve_map() first)")
        return self._value

    @value.setter
    def value(self, val):
        self._value = val

    def __getitem__(self, key):
        return Slice(self, self._ix[_index_key(key)])

    def __repr__(self):
        return f"Variable(shape={self.shape})"


class Slice:
    """Some of a :class:`Variable`'s entries, picked by NumPy indexing.

    Attributes
    ----------
    shape : tuple of int
    value : ndarray or Tensor
        The marginals of these entries (indexed out of the variable's
        ``value``; differentiable on a :class:`TorchFactorGraph`);
        ``AttributeError`` before a solve.

    Examples
    --------
    >>> import numpy as np
    >>> from sparsemap.lpsmap import FactorGraph, Xor
    >>> fg = FactorGraph()
    >>> u = fg.variable_from(np.array([[0.5, 0.2], [0.1, 0.9]]))
    >>> fg.add(Xor(u[:, 0]))
    >>> fg.solve()
    >>> u[:, 0].value
    array([0.7, 0.3])
    """

    def __init__(self, var, ix):
        self._base_var = var
        self._ix = np.asarray(ix)

    def __getitem__(self, key):
        return Slice(self._base_var, self._ix[_index_key(key)])

    @property
    def shape(self):
        return self._ix.shape

    @property
    def value(self):
        val = self._base_var.value
        if _is_tensor(val):
            import torch
            ix = torch.as_tensor(self._ix, dtype=torch.long, device=val.device)
            return val.reshape(-1)[ix]
        return val.reshape(-1)[self._ix]

    def __repr__(self):
        return f"Slice(shape={self.shape})"


def _check_vars(v, name):
    if not isinstance(v, (Variable, Slice)):
        raise ValueError(f"{name}: expected a Variable or a Slice of one (from "
                         f"fg.variable_from / fg.variable), got {type(v).__name__}")
    return v


def _variable_of(v):
    """The :class:`Variable` that ``v`` (a variable or a slice of one) indexes."""
    return v if isinstance(v, Variable) else v._base_var


# -- native pieces -----------------------------------------------------------------------
class _Piece:
    """A native factor attached to variable indices, with its additional scores."""
    __slots__ = ("factor", "idx", "eta_v")

    def __init__(self, factor, idx, eta_v=None):
        self.factor, self.idx, self.eta_v = factor, idx, eta_v


class _Ops:
    """NumPy (``torch=None``) or PyTorch arithmetic on scores, float64."""

    def __init__(self, torch=None, device=None):
        self.torch, self.device = torch, device

    def array(self, x, name):
        if self.torch is None:
            if _is_tensor(x):
                x = x.detach().cpu().numpy()
            a = np.asarray(x, dtype=np.float64)
        else:
            t = self.torch
            a = (x if _is_tensor(x) else t.as_tensor(np.asarray(x, dtype=np.float64)))
            a = a.to(dtype=t.float64, device=self.device)
        return a

    def flat(self, x, name, size, at_least=False):
        a = self.array(x, name).reshape(-1)
        n = a.shape[0]
        if n < size or (n > size and not at_least):
            need = f"at least {size}" if at_least else f"{size}"
            raise ValueError(f"{name}: expected {need} entries, got {n}")
        return a[:size] if n > size else a

    def gather(self, eta, idx):
        """``eta[idx]``, zeros where ``idx == -1``."""
        if self.torch is None:
            out = eta[np.maximum(idx, 0)]
            if idx.min(initial=0) < 0:
                out = np.where(idx >= 0, out, 0.0)
            return out
        t = self.torch
        out = eta[t.as_tensor(np.maximum(idx, 0), device=eta.device)]
        if idx.min(initial=0) < 0:
            out = out * t.as_tensor(idx >= 0, dtype=out.dtype, device=eta.device)
        return out

    def clip(self, eta):
        if self.torch is None:
            return np.clip(eta, 0.0, 1.0)
        return eta.clamp(0.0, 1.0)

    def positive(self, eta):
        if self.torch is None:
            return (eta > 0).astype(np.float64)
        return (eta.detach() > 0).to(eta.dtype)

    def add_at(self, eta, ids, vals):
        if self.torch is None:
            eta = eta.copy()
            np.add.at(eta, ids, vals)
            return eta
        t = self.torch
        return eta.index_add(0, t.as_tensor(ids, device=eta.device), t.stack(list(vals)))

    def assemble(self, n, parts):
        """A length-n vector from ``[(ids, values)]`` covering every index once."""
        if self.torch is None:
            out = np.empty(n)
            for ids, vals in parts:
                out[ids] = vals
            return out
        t = self.torch
        if len(parts) == 1 and parts[0][0].shape[0] == n and \
                (parts[0][0] == np.arange(n)).all():
            return parts[0][1].reshape(-1)       # one part, in order: no copy, no index
        ids = np.concatenate([p[0] for p in parts])
        vals = t.cat([p[1].reshape(-1) for p in parts])
        inv = np.empty(n, dtype=np.int64)
        inv[ids] = np.arange(n)
        return vals[t.as_tensor(inv, device=vals.device)]

    def solve(self, factor, eta_u, eta_v):
        if self.torch is None:
            return sm.solve(factor, eta_u, eta_v).u
        return _solo_function().apply(factor, eta_u, eta_v)

    def map(self, factor, eta_u, eta_v):
        if self.torch is None:
            return factor.vertex(factor.map(eta_u, eta_v))[0]
        t = self.torch
        hu = eta_u.detach().cpu().numpy()
        hv = None if eta_v is None else eta_v.detach().cpu().numpy()
        m = factor.vertex(factor.map(hu, hv))[0]
        return t.as_tensor(m, dtype=eta_u.dtype, device=eta_u.device)

    def graph(self, parts, eta_u, eta_v, report):
        """Each part's LP-SparseMAP marginals ``[(variables, u)]``; the native results are
        appended to ``report``."""
        if self.torch is None:
            out = []
            for k, p in enumerate(parts):
                ev = None if eta_v is None else [eta_v[i] for i in p.pieces]
                try:
                    r = p.graph.solve(eta_u[p.var], ev)
                except ValueError as exc:
                    exc.part = k
                    raise
                report.append(r)
                out.append((p.var, r.u))
            return out
        import sparsemap.torch as smt
        t = self.torch
        if len(parts) == 1:
            p = parts[0]
            ev = None if eta_v is None else [eta_v[i] for i in p.pieces]
            eu = eta_u if p.var.size == eta_u.shape[0] else eta_u[t.as_tensor(p.var,
                                                                             device=eta_u.device)]
            tensors = [] if ev is None else [e for e in ev if e is not None]
            slots = [] if ev is None else [f for f, e in enumerate(ev) if e is not None]
            try:
                u = _solo_function(graph=True).apply(p.graph, slots, report, eu, *tensors)
            except ValueError as exc:
                exc.part = 0
                raise
            return [(p.var, u)]
        # several parts: one ragged batch of graphs, solved in the layer's threads
        width = max(p.var.size for p in parts)
        pad = np.full((len(parts), width), eta_u.shape[0], dtype=np.int64)
        for k, p in enumerate(parts):
            pad[k, :p.var.size] = p.var
        ext = t.cat([eta_u, eta_u.new_zeros(1)])
        eu = ext[t.as_tensor(pad, device=eta_u.device)]
        ev = None if eta_v is None else [[eta_v[i] for i in p.pieces] for p in parts]
        try:
            u = smt.factor_graph([p.graph for p in parts], eu, ev, _report=report)
        except ValueError as exc:
            exc.part = getattr(exc, "batch_element", 0)
            raise
        return [(p.var, u[k, :p.var.size]) for k, p in enumerate(parts)]

    def graph_map(self, parts, eta_u, eta_v, report):
        out = []
        for k, p in enumerate(parts):
            ev = None if eta_v is None else [eta_v[i] for i in p.pieces]
            if self.torch is None:
                hu, hv = eta_u[p.var], ev
            else:
                hu = eta_u.detach().cpu().numpy()[p.var]
                hv = None if ev is None else [None if e is None else e.detach().cpu().numpy()
                                              for e in ev]
            try:
                r = p.graph.solve_map(hu, hv)
            except ValueError as exc:
                exc.part = k
                raise
            report.append(r)
            u = r.u if self.torch is None else self.torch.as_tensor(
                r.u, dtype=eta_u.dtype, device=eta_u.device)
            out.append((p.var, u))
        return out


_SOLO = []


def _solo_function(graph=False):
    """The autograd Function of one SparseMAP problem (``graph``: of one native factor
    graph), made on first use (imports torch).

    :func:`sparsemap.torch.sparsemap` and :func:`sparsemap.torch.factor_graph` handle
    batches, padding, threads and double backward; one small problem per call (the
    drop-in's common case: a budget per sentence, one document's alignment) only needs
    :func:`sparsemap.solve` or :meth:`sparsemap.FactorGraph.solve` and their exact
    ``vjp``, at a fraction of the per-call overhead."""
    if _SOLO:
        return _SOLO[1 if graph else 0]
    import torch

    def host(x):
        t = x.detach()
        if t.device.type == "cpu" and t.dtype in (torch.float64, torch.float32):
            return np.array(t.numpy(), dtype=np.float64)
        return t.to(device="cpu", dtype=torch.float64).numpy()

    numpy_dtypes = {torch.float64: np.float64, torch.float32: np.float32,
                    torch.float16: np.float16}

    def like(a, t):
        if t.dtype in numpy_dtypes:
            out = torch.from_numpy(np.asarray(a, dtype=numpy_dtypes[t.dtype]))
            return out if t.device.type == "cpu" else out.to(t.device)
        return torch.from_numpy(np.asarray(a, dtype=np.float64)).to(dtype=t.dtype,
                                                                     device=t.device)

    class _SoloSparseMAP(torch.autograd.Function):
        @staticmethod
        def forward(ctx, factor, eta_u, eta_v):
            eu = host(eta_u)          # -inf is a mask; sm.solve refuses nan and +inf
            r = sm.solve(factor, eu, None if eta_v is None else host(eta_v))
            ctx.r, ctx.eta_u, ctx.eta_v = r, eta_u.detach(), (
                None if eta_v is None else eta_v.detach())
            return like(r.u, eta_u)

        @staticmethod
        def backward(ctx, g):
            gu, gv = ctx.r.vjp(host(g))
            return (None, like(gu, ctx.eta_u),
                    None if ctx.eta_v is None else like(gv, ctx.eta_v))

    class _SoloGraph(torch.autograd.Function):
        @staticmethod
        def forward(ctx, native, slots, report, eta_u, *eta_v):
            ev = None
            if slots:
                ev = [None] * len(native.factors)
                for f, e in zip(slots, eta_v):
                    ev[f] = host(e).reshape(native.factors[f].shape_v)
            r = native.solve(host(eta_u), ev)
            report.append(r)
            ctx.r, ctx.slots = r, slots
            ctx.eta_u, ctx.eta_v = eta_u.detach(), [e.detach() for e in eta_v]
            return like(r.u, eta_u)

        @staticmethod
        def backward(ctx, g):
            gu, gv = ctx.r.vjp(host(g))
            return (None, None, None, like(gu, ctx.eta_u),
                    *[like(gv[f].reshape(e.shape), e) for f, e in zip(ctx.slots, ctx.eta_v)])

    class _SoloIndexed(torch.autograd.Function):
        """One factor whose parts cover every variable of the graph once (a DepTree over
        its whole variable): the gather of its scores, the solve and the scatter of its
        marginals in one node, in NumPy, instead of a chain of small tensor operations
        (each one costs more than the 5-word tree's solve)."""

        @staticmethod
        def forward(ctx, factor, idx, eta, eta_v):
            sel = idx >= 0
            e = host(eta)
            eu = np.where(sel, e[np.maximum(idx, 0)], 0.0)
            r = sm.solve(factor, eu, None if eta_v is None else host(eta_v))
            out = np.empty(e.shape[0])
            out[idx[sel]] = np.asarray(r.u)[sel]
            ctx.r, ctx.idx, ctx.eta, ctx.eta_v = r, idx, eta.detach(), (
                None if eta_v is None else eta_v.detach())
            return like(out, eta)

        @staticmethod
        def backward(ctx, g):
            idx = ctx.idx
            sel = idx >= 0
            gu, gv = ctx.r.vjp(np.where(sel, host(g)[np.maximum(idx, 0)], 0.0))
            out = np.zeros(ctx.eta.shape[0])
            out[idx[sel]] = np.asarray(gu)[sel]
            return (None, None, like(out, ctx.eta),
                    None if ctx.eta_v is None else like(gv, ctx.eta_v))

    _SOLO.extend([_SoloSparseMAP, _SoloGraph, _SoloIndexed])
    return _SOLO[1 if graph else 0]


# -- factors -------------------------------------------------------------------------------
class _LPFactor:
    """Base of the factors: ``_variables`` (a Variable, Slice or tuple of them)."""

    def _ids(self, offsets):
        """Global variable indices of the factor's variables (one array per argument)."""
        vs = self._variables if isinstance(self._variables, tuple) else (self._variables,)
        return tuple(v._ix + offsets[id(_variable_of(v))] for v in vs)

    def _pieces(self, ids, ops):
        """Native pieces and extra unary scores ``[(variable, score)]`` for the graph."""
        raise NotImplementedError

    def _plain(self):
        """The native factor whose parts are this factor's variables in C order (no
        additional scores, negation or ignored parts), or None."""
        return None

    def _alone(self, ids, eta, ops, decode):
        """Marginals (MAP when ``decode``) of this factor's variables, in the order of
        ``np.concatenate([i.ravel() for i in ids])``, when no other factor shares them and
        each appears once here."""
        pieces, extra = self._pieces(ids, ops)
        assert not extra
        out_ids, out_vals = [], []
        for p in pieces:
            sel = p.idx >= 0
            u = (ops.map if decode else ops.solve)(p.factor, ops.gather(eta, p.idx), p.eta_v)
            out_ids.append(p.idx[sel])
            out_vals.append(u[ops.torch.as_tensor(sel, device=u.device)]
                            if ops.torch is not None else u[sel])
        return out_ids, out_vals

    def __repr__(self):
        return f"{type(self).__name__}(shape={getattr(self._variables, 'shape', None)})"


def _logic_doc(what, cls_name, native):
    return f"""{what}

    lp-sparsemap's ``{cls_name}``: a logic factor over binary variables.

    Parameters
    ----------
    variables : Variable or Slice
        The variables, of any shape (flattened in C order).

    Notes
    -----
    Native form: ``fg.add({native}, variable_indices)`` on a
    :class:`sparsemap.FactorGraph`.

    Examples
    --------
    >>> import numpy as np
    >>> from sparsemap.lpsmap import FactorGraph, {cls_name}
    >>> fg = FactorGraph()
    >>> u = fg.variable_from(np.array([0.9, 0.4, 0.1]))
    >>> fg.add({cls_name}(u))
    >>> fg.solve()
    >>> u.value.shape
    (3,)
    """


class _Logic(_LPFactor):
    _native = None
    _min = 1

    def __init__(self, variables):
        self._variables = _check_vars(variables, "variables")
        n = math.prod(self._variables.shape)
        if n < self._min:
            raise ValueError(f"variables: {type(self).__name__} needs at least {self._min} "
                             f"variables, got {n}")

    def _pieces(self, ids, ops):
        idx = ids[0].reshape(-1)
        return [_Piece(self._plain(), idx)], []

    def _plain(self):
        return _factor(self._native, math.prod(self._variables.shape))


class Xor(_Logic):
    __doc__ = _logic_doc("Exactly one of the variables on.", "Xor", "sparsemap.XorFactor(n)")
    _native = sm.XorFactor


class Or(_Logic):
    __doc__ = _logic_doc("At least one of the variables on.", "Or", "sparsemap.OrFactor(n)")
    _native = sm.OrFactor


class AtMostOne(_Logic):
    __doc__ = _logic_doc("At most one of the variables on.", "AtMostOne",
                         "sparsemap.AtMostOneFactor(n)")
    _native = sm.AtMostOneFactor


class XorOut(_Logic):
    __doc__ = _logic_doc("At most one of the first n-1 on; the last is on iff one of them is.",
                         "XorOut", "sparsemap.XorOutFactor(n)")
    _native = sm.XorOutFactor
    _min = 3


class OrOut(_Logic):
    __doc__ = _logic_doc("The last variable is the OR of the others.", "OrOut",
                         "sparsemap.OrOutFactor(n)")
    _native = sm.OrOutFactor
    _min = 3


class AndOut(_Logic):
    __doc__ = _logic_doc("The last variable is the AND of the others.", "AndOut",
                         "sparsemap.AndOutFactor(n)")
    _native = sm.AndOutFactor
    _min = 3


class Imply(_Logic):
    __doc__ = _logic_doc("The first n-1 variables (all on) imply the last.", "Imply",
                         "sparsemap.ImplyFactor(n)")
    _native = sm.ImplyFactor
    _min = 2


class Budget(_LPFactor):
    """At most (``force_budget=True``: exactly) ``budget`` of the variables on.

    lp-sparsemap's ``Budget`` (``force_budget`` as in its fork with
    ``SequenceBudget``).

    Parameters
    ----------
    variables : Variable or Slice
        The variables, of any shape (flattened in C order).
    budget : int
        An int, an integral float, a NumPy scalar or a one-element tensor
        (e.g. ``torch.round(0.3 * length)``), ``>= 0``.
    force_budget : bool, default False
        Exactly ``budget`` on (then ``budget`` must not exceed the number of
        variables).

    Raises
    ------
    ValueError
        On a non-integral or negative budget, or an infeasible forced budget.

    Notes
    -----
    Native form: ``fg.add(sparsemap.BudgetFactor(n, budget, exact=force_budget), idx)``.

    Examples
    --------
    >>> import numpy as np
    >>> from sparsemap.lpsmap import FactorGraph, Budget
    >>> fg = FactorGraph()
    >>> u = fg.variable_from(np.array([0.9, 0.8, 0.1]))
    >>> fg.add(Budget(u, budget=1.0))
    >>> fg.solve()
    >>> u.value
    array([0.55, 0.45, 0.  ])
    """

    def __init__(self, variables, budget, force_budget=False):
        self._variables = _check_vars(variables, "variables")
        self.budget = _check_budget(budget)
        self.force_budget = _check_flag(force_budget, "force_budget")
        n = math.prod(self._variables.shape)
        if self.force_budget and self.budget > n:
            raise ValueError(f"budget: exactly {self.budget} of {n} variables on is infeasible "
                             f"(force_budget=True needs budget <= the number of variables)")
        if n < 1:
            raise ValueError("variables: Budget needs at least one variable")

    def _pieces(self, ids, ops):
        return [_Piece(self._plain(), ids[0].reshape(-1))], []

    def _plain(self):
        return _factor(sm.BudgetFactor, math.prod(self._variables.shape), self.budget,
                       exact=self.force_budget)


class Pair(_LPFactor):
    """Pairwise factors: ``vars_i[k]`` and ``vars_j[k]`` with score ``additionals[k]``
    when both are on.

    lp-sparsemap's ``Pair``: one pair factor per ``k`` (all four
    configurations allowed).

    Parameters
    ----------
    vars_i, vars_j : Variable or Slice
        The same number ``n`` of variables each (flattened in C order).
    additionals : array_like or Tensor, ``n`` entries
        The score of "both on" of each pair.

    Notes
    -----
    Native form: ``fg.add(sparsemap.PairFactor(), [i, j])`` per pair, with
    ``eta_v`` of shape ``(1,)``.

    Examples
    --------
    >>> import numpy as np
    >>> from sparsemap.lpsmap import FactorGraph, Pair
    >>> fg = FactorGraph()
    >>> u = fg.variable_from(np.array([0.5, 0.5]))
    >>> fg.add(Pair(u[0], u[1], np.array([1.0])))
    >>> fg.solve()
    >>> u.value
    array([1., 1.])
    """

    def __init__(self, vars_i, vars_j, additionals):
        _check_vars(vars_i, "vars_i")
        _check_vars(vars_j, "vars_j")
        ni = math.prod(vars_i.shape)
        nj = math.prod(vars_j.shape)
        if ni != nj:
            raise ValueError(f"vars_j: expected as many variables as vars_i ({ni}), got {nj}")
        self._variables = (vars_i, vars_j)
        self._additionals = additionals
        self._n = ni

    def _pieces(self, ids, ops):
        a = ops.flat(self._additionals, "additionals", self._n)
        ii, jj = ids[0].reshape(-1), ids[1].reshape(-1)
        f = _factor(sm.PairFactor)
        return [_Piece(f, np.array([ii[k], jj[k]]), a[k:k + 1])
                for k in range(self._n)], []


class Sequence(_LPFactor):
    """A chain over states: one state per position (lp-sparsemap's ``Sequence``).

    Parameters
    ----------
    variables : Variable or Slice, shape ``(L, S)``
        ``variables[i, s]``: position ``i`` in state ``s``.
    additionals : array_like or Tensor, ``(L - 1) * S * S`` entries
        Transition scores, shaped (or flattened from) ``(L - 1, S, S)``:
        ``additionals[i, a, b]`` scores state ``a`` at ``i`` then ``b`` at
        ``i + 1``. No start or end transitions.

    Notes
    -----
    Native form: ``fg.add(sparsemap.SequenceFactor(L, S), idx)`` with ``idx``
    of shape ``(L, S)`` and ``eta_v = additionals`` reshaped to
    ``(L - 1, S, S)``.

    Examples
    --------
    >>> import numpy as np
    >>> from sparsemap.lpsmap import FactorGraph, Sequence
    >>> fg = FactorGraph()
    >>> u = fg.variable_from(np.array([[1.0, 0.0], [0.0, 0.5], [0.2, 0.2]]))
    >>> fg.add(Sequence(u, np.zeros((2, 2, 2))))
    >>> fg.solve()
    >>> u.value.sum(axis=1)
    array([1., 1., 1.])
    """

    def __init__(self, variables, additionals):
        self._variables = _check_vars(variables, "variables")
        if len(self._variables.shape) != 2 or min(self._variables.shape) < 1:
            raise ValueError(f"variables: expected shape (seq_length, n_states), got "
                             f"{self._variables.shape}")
        self._additionals = additionals

    def _pieces(self, ids, ops):
        L, S = self._variables.shape
        a = ops.flat(self._additionals, "additionals", (L - 1) * S * S).reshape(L - 1, S, S)
        return [_Piece(_factor(sm.SequenceFactor, L, S), ids[0], a)], []


class SequenceBudget(_LPFactor):
    """A chain over states with at most (or exactly) ``budget`` positions in state 0.

    AD3's ``FactorSequenceBudget`` (lp-sparsemap's fork with ``SequenceBudget``).

    Parameters
    ----------
    variables : Variable or Slice, shape ``(L, S)``
        ``variables[i, s]``: position ``i`` in state ``s``. State 0 counts
        against the budget.
    additionals : array_like or Tensor
        Transition scores in AD3's flat order: ``S`` start scores (start ->
        state ``s`` at position 0), then ``(L - 1) * S * S`` transitions
        (``[i, a, b]``: state ``a`` at ``i``, ``b`` at ``i + 1``), then ``S``
        end scores (state ``s`` at position ``L - 1`` -> end); ``2 S + (L - 1)
        S^2`` entries in all, of any shape. A longer array is accepted and only
        its leading entries are read, as AD3 does (downstream code passes an
        ``(L + 1, 2, 2)`` tensor).
    budget : int
        As for :class:`Budget` (int, integral float, NumPy scalar, 0-d tensor).
    force_budget : bool, default False
        Exactly ``budget`` positions in state 0.

    Raises
    ------
    ValueError
        Bad budget, too few additionals, or an infeasible forced budget.

    Notes
    -----
    With ``S = 2`` the factor maps exactly onto
    :class:`sparsemap.SequenceBudgetFactor`, whose "on" state is AD3's state 0:
    on its own, SparseMAP of ``(u[:, 0], u[:, 1] = 1 - u[:, 0])`` is SparseMAP
    of the native factor with ``eta_u = (a0 - a1 + 1) / 2`` (the start and end
    scores folded into the first and last positions, halved too) and
    ``eta_v`` the transitions with both states flipped, halved; inside a larger
    graph it is the native factor on ``u[:, 0]`` plus an
    :class:`sparsemap.XorFactor` per position tying ``u[i, 1]`` to
    ``1 - u[i, 0]``. Other ``S`` use an exact Viterbi oracle with a count
    dimension (:class:`sparsemap.OracleFactor`). See :doc:`/migration`.

    Examples
    --------
    >>> import numpy as np
    >>> from sparsemap.lpsmap import FactorGraph, SequenceBudget
    >>> fg = FactorGraph()
    >>> u = fg.variable_from(np.array([[0.9, 0.0], [0.8, 0.0], [0.7, 0.0]]))
    >>> fg.add(SequenceBudget(u, np.zeros(2 + 2 * 4 + 2), budget=1))
    >>> fg.solve()
    >>> float(u.value[:, 0].sum())
    1.0
    """

    def __init__(self, variables, additionals, budget, force_budget=False):
        self._variables = _check_vars(variables, "variables")
        if len(self._variables.shape) != 2 or min(self._variables.shape) < 1:
            raise ValueError(f"variables: expected shape (seq_length, n_states), got "
                             f"{self._variables.shape}")
        self._additionals = additionals
        self._budget = _check_budget(budget)
        self._force_budget = _check_flag(force_budget, "force_budget")
        L, S = self._variables.shape
        if self._force_budget and (self._budget > L or (S == 1 and self._budget != L)):
            raise ValueError(f"budget: exactly {self._budget} of {L} positions in state 0 is "
                             f"infeasible with {S} state(s)")
        if not self._force_budget and S == 1 and self._budget < L:
            raise ValueError(f"budget: with one state every position is in state 0, so at "
                             f"most {self._budget} of {L} is infeasible")

    def _split(self, ops):
        L, S = self._variables.shape
        a = ops.flat(self._additionals, "additionals", 2 * S + (L - 1) * S * S, at_least=True)
        return a[:S], a[S:S + (L - 1) * S * S].reshape(L - 1, S, S), a[S + (L - 1) * S * S:]

    def _binary(self, ops, eta0, eta1, scale):
        """Native scores on "position in state 0" for S = 2: (eta_u, eta_v)."""
        start, trans, end = self._split(ops)
        L = self._variables.shape[0]
        if ops.torch is None:
            fold = np.zeros(L)
            fold[0] += start[0] - start[1]
            fold[-1] += end[0] - end[1]
            ev = trans[:, ::-1, ::-1]
        else:
            t = ops.torch
            fold = t.zeros(L, dtype=t.float64, device=start.device)
            fold = fold.index_add(0, t.tensor([0, L - 1], device=start.device),
                                  t.stack([start[0] - start[1], end[0] - end[1]]))
            ev = trans.flip(1, 2)
        return (eta0 - eta1 + fold) * scale, ev * scale

    def _native(self, L):
        return _factor(sm.SequenceBudgetFactor, L, min(self._budget, L), exact=self._force_budget)

    def _pieces(self, ids, ops):
        L, S = self._variables.shape
        ix = ids[0]
        if S != 2:
            f = _oracle_sequence_budget(L, S, self._budget, self._force_budget)
            ev = ops.flat(self._additionals, "additionals", f.shape_v[0], at_least=True)
            return [_Piece(f, ix, ev)], []
        start, trans, end = self._split(ops)
        pieces = [_Piece(self._native(L), ix[:, 0].copy(), trans.flip(1, 2)
                         if ops.torch is not None else trans[:, ::-1, ::-1].copy())]
        xor = _factor(sm.XorFactor, 2)
        pieces += [_Piece(xor, ix[i].copy()) for i in range(L)]
        extra = [(ix[0, 0], start[0] - start[1]), (ix[L - 1, 0], end[0] - end[1])]
        return pieces, extra

    def _alone(self, ids, eta, ops, decode):
        L, S = self._variables.shape
        if S != 2:
            return _LPFactor._alone(self, ids, eta, ops, decode)
        ix = ids[0]
        e0, e1 = ops.gather(eta, ix[:, 0]), ops.gather(eta, ix[:, 1])
        if decode:
            eu, ev = self._binary(ops, e0, e1, 1.0)
            u0 = ops.map(self._native(L), eu, ev)
        else:
            eu, ev = self._binary(ops, e0 + 0.5, e1 - 0.5, 0.5)
            u0 = ops.solve(self._native(L), eu, ev)
        return [ix[:, 0], ix[:, 1]], [u0, 1.0 - u0]


def _oracle_sequence_budget(L, S, budget, exact):
    key = ("seqbudget", L, S, budget, exact)
    f = _FACTORS.get(key)
    if f is None:
        f = _FACTORS[key] = _SequenceBudgetOracle(L, S, budget, exact)
    return f


class _SequenceBudgetOracle(sm.OracleFactor):
    """AD3's FactorSequenceBudget for any number of states: Viterbi with a count of
    state-0 positions; eta_v in AD3's flat order (start, transitions, end)."""

    def __init__(self, L, S, budget, exact):
        self.L, self.S, self.B, self.exact = L, S, min(budget, L), exact
        super().__init__(shape_u=(L, S), shape_v=(2 * S + (L - 1) * S * S,), structure_size=L)

    def oracle_map(self, eta_u, eta_v):
        L, S, B = self.L, self.S, self.B
        start, end = eta_v[:S], eta_v[S + (L - 1) * S * S:]
        trans = eta_v[S:S + (L - 1) * S * S].reshape(L - 1, S, S)
        # val[c, s]: best score of positions 0..i ending in state s with c state-0 positions
        val = np.full((B + 1, S), -np.inf)
        first = eta_u[0] + start
        val[0, 1:] = first[1:]
        if B >= 1:
            val[1, 0] = first[0]
        back = np.zeros((L, B + 1, S, 2), dtype=np.int64)
        for i in range(1, L):
            cand = val[:, :, None] + trans[i - 1][None]            # (c, prev, s)
            arg = np.argmax(cand, axis=1)                          # (c, s)
            best = np.take_along_axis(cand, arg[:, None, :], 1)[:, 0, :]
            new = np.full((B + 1, S), -np.inf)
            new[:, 1:] = best[:, 1:] + eta_u[i, 1:]
            back[i, :, 1:, 0] = arg[:, 1:]
            back[i, :, 1:, 1] = np.arange(B + 1)[:, None]
            new[1:, 0] = best[:-1, 0] + eta_u[i, 0]
            back[i, 1:, 0, 0] = arg[:-1, 0]
            back[i, 1:, 0, 1] = np.arange(B)
            val = new
        val = val + end[None, :]
        if self.exact:
            val[:B] = -np.inf
        c, s = np.unravel_index(int(np.argmax(val)), val.shape)
        out = np.empty(L, dtype=np.int64)
        for i in range(L - 1, -1, -1):
            out[i] = s
            if i:
                s, c = back[i, c, s]
        return out

    def oracle_vertex(self, s):
        L, S = self.L, self.S
        m = np.zeros((L, S))
        m[np.arange(L), s] = 1.0
        n = np.zeros(2 * S + (L - 1) * S * S)
        n[s[0]] = 1.0
        if L > 1:
            n[S + np.arange(L - 1) * S * S + s[:-1] * S + s[1:]] = 1.0
        n[S + (L - 1) * S * S + s[-1]] = 1.0
        return m, n


def _tree_index(ids, packed):
    """``(n+1, n+1)`` head-by-modifier indices of a TreeFactor from lp-sparsemap's layout."""
    n = ids.shape[0]
    idx = np.full((n + 1, n + 1), -1, dtype=np.int64)
    if packed:       # ids[m, h]: head h -> modifier m, the root arc on the diagonal
        idx[1:, 1:] = ids.T
        idx[0, 1:] = np.diagonal(ids)
        idx[np.arange(1, n + 1), np.arange(1, n + 1)] = -1
    else:            # ids[m, j]: modifier m, heads 0..n without m itself (root first)
        m, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
        heads = j + (j > m)
        idx[heads, m + 1] = ids
    return idx


class DepTree(_LPFactor):
    """Dependency trees over the arcs of a sentence (lp-sparsemap's ``DepTree``).

    Parameters
    ----------
    variables : Variable or Slice, shape ``(n, n)``
        The arcs of an ``n``-word sentence. ``packed=True``: ``variables[m,
        h]`` is the arc from head ``h`` to modifier ``m`` (words numbered from
        0), and the diagonal ``variables[m, m]`` the arc from the root to
        ``m``. ``packed=False``: row ``m`` lists the heads of modifier ``m`` in
        order, root first and ``m`` itself skipped.
    packed : bool, default False
    projective : bool, default False
        Projective trees with a single root child (Eisner's algorithm, as in
        lp-sparsemap). ``False``: any arborescence, with any number of root
        children.

    Notes
    -----
    Native form: :class:`sparsemap.TreeFactor` ``(n, projective=projective,
    single_root=projective)``, whose scores are head-by-modifier ``(n + 1, n +
    1)`` with the root as row 0: ``packed=True`` is the transpose, with the
    diagonal moved to row 0.

    Examples
    --------
    >>> import numpy as np
    >>> from sparsemap.lpsmap import FactorGraph, DepTree
    >>> fg = FactorGraph()
    >>> u = fg.variable_from(np.array([[5.0, 0.0], [3.0, 0.0]]))
    >>> fg.add(DepTree(u, packed=True, projective=True))
    >>> fg.solve_map()
    >>> u.value        # the root -> word 0 -> word 1
    array([[1., 0.],
           [1., 0.]])
    """

    def __init__(self, variables, packed=False, projective=False):
        self._variables = _check_vars(variables, "variables")
        shape = self._variables.shape
        if len(shape) != 2 or shape[0] != shape[1] or shape[0] < 1:
            raise ValueError(f"variables: expected shape (n, n) for an n-word sentence, got "
                             f"{shape}")
        self.packed = _check_flag(packed, "packed")
        self.projective = _check_flag(projective, "projective")

    def _pieces(self, ids, ops):
        n = self._variables.shape[0]
        f = _factor(sm.TreeFactor, n, projective=self.projective, single_root=self.projective)
        return [_Piece(f, _tree_index(ids[0], self.packed))], []


# -- graphs -----------------------------------------------------------------------------------
def _how_solved(parts, report, decode):
    """What ``verbose`` prints for a graph: how many connected parts, and how each solve
    went (iterations, certified or not, the largest constraint violation)."""
    n = len(parts)
    head = (f"{n} connected parts, each" if n > 1 else "one connected graph,")
    if decode:
        exact = sum(bool(r.exact) for r in report)
        gap = max(float(r.gap) for r in report)
        return (f"{head} LP-MAP certified by a duality gap (largest {gap:.2g}); "
                f"{exact} of {n} integral and exact MAP")
    its = [r.n_iter for r in report]
    pol = sum(bool(r.polished) for r in report)
    viol = max(float(r.primal_residual) for r in report)
    rng = f"{min(its)}-{max(its)}" if n > 1 and min(its) != max(its) else f"{its[0]}"
    return (f"{head} an LP-SparseMAP factor graph: ADMM, {rng} iterations, certified "
            f"optimal ({pol} of {n} by the KKT conditions on the final faces, the rest by "
            f"residuals below 1e-10); largest constraint violation {viol:.1e}")


def _describe_factor(factor, names):
    """``Xor(variable 0[2, 3, :])``: the factor's class and the variables it is on."""
    vs = factor._variables if isinstance(factor._variables, tuple) else (factor._variables,)
    return f"{type(factor).__name__}({', '.join(_describe_vars(v, names) for v in vs)})"


def _describe_vars(v, names):
    base = _variable_of(v)
    label = f"variable {names.get(id(base), '?')}"
    if isinstance(v, Variable):
        return label
    idx = np.unravel_index(v._ix.reshape(-1), base.shape)
    axes = []
    for d, ix in enumerate(idx):
        u = np.unique(ix)
        if u.size == 1:
            axes.append(str(int(u[0])))
        elif u.size == base.shape[d]:
            axes.append(":")
        elif u.size == int(u[u.size - 1]) - int(u[0]) + 1:
            axes.append(f"{int(u[0])}:{int(u[u.size - 1]) + 1}")
        else:
            axes.append("...")
    return f"{label}[{', '.join(axes)}]"


def _leading(factor):
    """{(id of base variable, index along its first axis)} that the factor's variables use,
    or None when one of them is a vector (no batch axis)."""
    out = set()
    vs = factor._variables if isinstance(factor._variables, tuple) else (factor._variables,)
    for v in vs:
        base = _variable_of(v)
        if len(base.shape) < 2:
            return None
        lead = np.unique(np.unravel_index(v._ix.reshape(-1), base.shape)[0])
        out.update((id(base), int(x)) for x in lead)
    return out


def _common_prefix(factors, names, graph_factors=None):
    """' (all on variable 0[2]: batch element 2)' when every factor's variables lie in one
    slice along the first axis of one variable, and that axis is a batch: every factor of
    the graph on that variable (``graph_factors``) lies in one such slice, so the slices
    are separate problems. '' otherwise (a row of one alignment is no batch element)."""
    first = set()
    for f in factors:
        vs = f._variables if isinstance(f._variables, tuple) else (f._variables,)
        for v in vs:
            base = _variable_of(v)
            if len(base.shape) < 2:
                return ""
            lead = np.unique(np.unravel_index(v._ix.reshape(-1), base.shape)[0])
            first.update((id(base), int(x)) for x in lead)
    if len(first) != 1:
        return ""
    (b, i), = first
    for f in graph_factors or ():
        lead = _leading(f)
        if lead is None:
            continue
        mine = {x for x in lead if x[0] == b}
        if len(mine) > 1:
            return ""            # a factor across slices: the first axis is no batch
    return f" (all on variable {names.get(b, '?')}[{i}]: batch element {i})"


class FactorGraph:
    """A factor graph with lp-sparsemap's interface; NumPy in and out.

    Declare variables with :meth:`variable_from` (scores) or :meth:`variable`
    (zero scores), add factors on them or on slices of them with :meth:`add`,
    then :meth:`solve` (LP-SparseMAP) or :meth:`solve_map` (LP-MAP); each
    variable's marginals are then in its ``value``.

    Attributes
    ----------
    variables : list of Variable
    factors : list
        The added factors, in order.

    Notes
    -----
    The answer is exact: the optimum of lp-sparsemap's problem, where
    lp-sparsemap stops at a tolerance. Native equivalent: a
    :class:`sparsemap.FactorGraph` over index arrays; see :doc:`/migration`.

    Examples
    --------
    >>> import numpy as np
    >>> from sparsemap.lpsmap import FactorGraph, Xor, AtMostOne
    >>> x = np.array([[0.5, 0.2, -0.1], [0.3, 0.4, 0.0]])
    >>> fg = FactorGraph()
    >>> u = fg.variable_from(x)
    >>> for i in range(2):
    ...     fg.add(Xor(u[i, :]))
    >>> for j in range(3):
    ...     fg.add(AtMostOne(u[:, j]))
    >>> fg.solve()
    >>> u.value.round(4)
    array([[0.6167, 0.3417, 0.0417],
           [0.3833, 0.5083, 0.1083]])
    """

    _torch = False

    def __init__(self):
        self.variables = []
        self.factors = []

    def __repr__(self):
        return (f"{type(self).__name__}(n_variables={len(self.variables)}, "
                f"n_factors={len(self.factors)})")

    def variable_from(self, scores):
        """A tensor of binary variables with the given scores.

        Parameters
        ----------
        scores : array_like
            One score per variable, any shape.

        Returns
        -------
        Variable

        Examples
        --------
        >>> import numpy as np
        >>> from sparsemap.lpsmap import FactorGraph
        >>> FactorGraph().variable_from(np.zeros((2, 3)))
        Variable(shape=(2, 3))
        """
        scores = self._check_scores(scores)
        var = Variable(self, scores)
        self.variables.append(var)
        return var

    def variable(self, shape):
        """A tensor of binary variables with zero scores.

        Parameters
        ----------
        shape : int or tuple of int

        Returns
        -------
        Variable
            Its scores are zeros: float64 NumPy on a :class:`FactorGraph`, a
            float32 tensor on a :class:`TorchFactorGraph` (as lp-sparsemap).

        Examples
        --------
        >>> from sparsemap.lpsmap import FactorGraph
        >>> FactorGraph().variable((2, 2))
        Variable(shape=(2, 2))
        """
        return self.variable_from(self._zeros(shape))

    def _zeros(self, shape):
        return np.zeros(shape)

    def _check_scores(self, scores):
        if _is_tensor(scores):
            scores = scores.detach().cpu().numpy()
        a = np.asarray(scores, dtype=np.float64)
        if np.any(np.isnan(a) | np.isposinf(a)):
            raise ValueError(_NONFINITE)
        return a

    def add(self, factor):
        """Connect a factor to the graph.

        Parameters
        ----------
        factor : Xor, Or, AtMostOne, Imply, XorOut, OrOut, AndOut, Budget, Pair, Sequence, SequenceBudget or DepTree
            On variables (or slices) of this graph.

        Raises
        ------
        ValueError
            On anything else, or variables of another graph.

        Examples
        --------
        >>> import numpy as np
        >>> from sparsemap.lpsmap import FactorGraph, Xor
        >>> fg = FactorGraph()
        >>> u = fg.variable_from(np.zeros(3))
        >>> fg.add(Xor(u))
        >>> fg
        FactorGraph(n_variables=1, n_factors=1)
        """
        if not isinstance(factor, _LPFactor):
            raise ValueError(f"factor: expected one of {', '.join(__all__[2:])}, got "
                             f"{type(factor).__name__}")
        vs = factor._variables if isinstance(factor._variables, tuple) else (factor._variables,)
        for v in vs:
            if _variable_of(v)._graph is not self:
                raise ValueError("factor: its variables belong to another factor graph")
        self.factors.append(factor)

    # -- solving ------------------------------------------------------------------
    def _ops(self):
        return _Ops()

    def _layout(self):
        offsets, n = {}, 0
        for v in self.variables:
            offsets[id(v)] = n
            n += v._ix.size
        return offsets, n

    def _solve_graph(self, decode, verbose):
        ops = self._ops()
        offsets, V = self._layout()
        what = "LP-MAP" if decode else "LP-SparseMAP"
        if V == 0:
            if verbose:
                print(f"sparsemap.lpsmap: {what}: no variables, nothing to solve")
            return
        if len(self.factors) == 1 and not decode and self.factors[0]._variables is \
                self.variables[0] and len(self.variables) == 1:
            # one factor over a whole variable, in order: plain SparseMAP on the raw scores
            native = self.factors[0]._plain()
            if native is not None:
                var = self.variables[0]
                self._scores(ops)           # the checks (nan, +inf) of every path
                u = ops.solve(native, var._scores.reshape(native.shape_u), None)
                var.value = u.reshape(var.shape)
                if verbose:
                    print(f"sparsemap.lpsmap: {what} of {V} variables and 1 factor: plain "
                          f"SparseMAP of {native!r} (the active set, certified by its "
                          f"duality gap)")
                return
        ids = [f._ids(offsets) for f in self.factors]
        eta = self._scores(ops)
        flat = [np.concatenate([i.reshape(-1) for i in fid]) for fid in ids]
        count = np.bincount(np.concatenate(flat), minlength=V) if flat else np.zeros(V, int)
        free = np.flatnonzero(count == 0)
        parts = []
        if free.size:
            e = ops.gather(eta, free)
            parts.append((free, ops.positive(e) if decode else ops.clip(e)))
        report = []
        if count.max(initial=0) <= 1 and not decode and ops.torch is not None and \
                len(self.factors) == 1 and not free.size:
            # one factor on every variable: a single autograd node (see _SoloIndexed)
            pieces, extra = self.factors[0]._pieces(ids[0], ops)
            if len(pieces) == 1 and not extra:
                p = pieces[0]
                _solo_function()                 # makes the three Functions
                self._set_values(_SOLO[2].apply(p.factor, p.idx, eta, p.eta_v), offsets)
                if verbose:
                    print(f"sparsemap.lpsmap: {what} of {V} variables and 1 factor: "
                          f"SparseMAP of {p.factor!r}")
                return
        if count.max(initial=0) <= 1:
            how = (f"{len(self.factors)} independent factors (no variable is shared), each "
                   f"by its own {'MAP oracle' if decode else 'SparseMAP solve'}")
            for f, fid in zip(self.factors, ids):
                out_ids, out_vals = f._alone(fid, eta, ops, decode)
                parts += list(zip(out_ids, out_vals))
        else:
            pieces, extra, owner = [], [], []
            for k, (f, fid) in enumerate(zip(self.factors, ids)):
                p, e = f._pieces(fid, ops)
                pieces += p
                extra += e
                owner += [k] * len(p)
            native = _native_parts(V, pieces)
            eu = ops.add_at(eta, [e[0] for e in extra], [e[1] for e in extra]) if extra else eta
            ev = [p.eta_v if p.factor.n_v else None for p in pieces]
            if all(e is None for e in ev):
                ev = None
            try:
                parts += (ops.graph_map if decode else ops.graph)(native, eu, ev, report)
            except ValueError as exc:
                if getattr(exc, "factors", None) is None:
                    raise
                raise ValueError(self._conflict(exc, native, owner)) from None
            except sm.ConvergenceError as exc:
                # the native advice (raise max_iter) cannot be followed here: this
                # max_iter is lp-sparsemap's, accepted and ignored
                raise sm.ConvergenceError(
                    f"{str(exc).split('. Raise max_iter')[0]}. This solve() ignores "
                    f"max_iter (lp-sparsemap's setting); to allow more iterations, build "
                    f"the graph as a sparsemap.FactorGraph and call its solve(max_iter=...) "
                    f"(see the migration guide, 'The low-level API').") from None
            how = "" if not verbose else _how_solved(native, report, decode)
        if verbose:
            print(f"sparsemap.lpsmap: {what} of {V} variables and {len(self.factors)} "
                  f"factors: {how}")
        self._set_values(ops.assemble(V, parts), offsets)

    def _conflict(self, exc, native, owner):
        """The native solver's infeasibility error in this graph's terms: which of its
        factors (and on which variables) conflict."""
        part = native[getattr(exc, "part", 0)]
        mine = sorted({owner[part.pieces[f]] for f in exc.factors})
        names = {id(v): k for k, v in enumerate(self.variables)}
        shown = [f"{k}: {_describe_factor(self.factors[k], names)}" for k in mine[:6]]
        more = f", ... ({len(mine)} factors in all)" if len(mine) > 6 else ""
        masked = " (with the variables whose score is -inf fixed at 0)" if exc.masked else ""
        where = _common_prefix([self.factors[k] for k in mine], names, self.factors)
        return (f"FactorGraph.solve: infeasible: no assignment of the variables satisfies "
                f"these factors together{masked}: {'; '.join(shown)}{more}{where}. "
                f"lp-sparsemap returns a point that breaks them instead (see the migration "
                f"guide, 'Infeasible graphs').")

    def _scores(self, ops):
        return np.concatenate([v._scores.reshape(-1) for v in self.variables])

    def _set_values(self, u, offsets):
        for v in self.variables:
            k = offsets[id(v)]
            v.value = u[k:k + v._ix.size].reshape(v.shape)

    def solve(self, max_iter=1000, max_inner_iter=10, tol=1e-6, step_size=0.1, adapt=True,
              verbose=False):
        """LP-SparseMAP: set ``value`` on every variable of the graph.

        The marginals maximise ``scores . u - 1/2 ||u||^2`` plus the factors'
        additional scores over the local polytope of the graph, exactly.
        """
        verbose = _check_solver_args(max_iter, max_inner_iter, tol, step_size, adapt, verbose)
        self._solve_graph(False, verbose)

    def solve_map(self, max_iter=1000, max_inner_iter=10, tol=1e-6, step_size=0.1, adapt=True,
                  verbose=False, autodetect_acyclic=True):
        """LP-MAP decoding: set ``value`` on every variable of the graph.

        The maximiser of the scores (and additional scores) over the local
        polytope of the graph, exact: the MAP when no variable is shared
        between factors (then each factor's own MAP oracle is used, as
        lp-sparsemap's ``autodetect_acyclic`` does) or when the relaxation is
        tight; otherwise a fractional point of the optimal face
        (:meth:`sparsemap.FactorGraph.solve_map`).
        """
        verbose = _check_solver_args(max_iter, max_inner_iter, tol, step_size, adapt, verbose)
        _check_flag(autodetect_acyclic, "autodetect_acyclic")
        self._solve_graph(True, verbose)

    solve.__doc__ += _SOLVE_DOC_PARAMS + """

        Raises
        ------
        ValueError
            On bad arguments, additional scores of the wrong size, nan or
            ``+inf`` scores, or constraints that no assignment satisfies (the
            message names the factors in conflict, by their place in
            ``fg.factors`` and the variables they are on, and the batch element
            when they all lie in one slice of a variable's first axis).
            lp-sparsemap returns a point that breaks the constraints instead.
        sparsemap.ConvergenceError
            If no certified optimum was found within the native solver's
            iteration limit (not seen on any graph we measured); the message
            says how to allow more iterations (natively: this ``max_iter`` is
            ignored).

        Examples
        --------
        >>> import numpy as np
        >>> from sparsemap.lpsmap import FactorGraph, Budget
        >>> fg = FactorGraph()
        >>> u = fg.variable_from(np.array([0.9, 0.8, 0.1]))
        >>> fg.add(Budget(u, 1))
        >>> fg.solve(max_iter=1, step_size=0)
        >>> u.value
        array([0.55, 0.45, 0.  ])
        """
    solve_map.__doc__ += _SOLVE_DOC_PARAMS + """
        autodetect_acyclic : bool, default True
            Accepted for compatibility; ignored (factors that share no
            variable are always decoded by their own MAP oracles).

        Raises
        ------
        ValueError
            On bad arguments.

        Examples
        --------
        >>> import numpy as np
        >>> from sparsemap.lpsmap import FactorGraph, Budget
        >>> fg = FactorGraph()
        >>> u = fg.variable_from(np.array([0.9, 0.8, 0.1]))
        >>> fg.add(Budget(u, 1))
        >>> fg.solve_map()
        >>> u.value
        array([1., 0., 0.])
        """


class TorchFactorGraph(FactorGraph):
    """lp-sparsemap's ``TorchFactorGraph``: tensors in, differentiable ``.value`` out.

    As :class:`FactorGraph`, with scores and additional scores given as
    tensors of any float dtype and device. After :meth:`FactorGraph.solve`, each
    variable's ``value`` is on its scores' device and dtype and backpropagates
    to the scores and to the factors' additionals with the exact Jacobian.
    After :meth:`FactorGraph.solve_map` it is a constant (no gradient), as in
    lp-sparsemap. Imports PyTorch.

    Examples
    --------
    >>> import torch
    >>> from sparsemap.lpsmap import TorchFactorGraph, Budget
    >>> x = torch.tensor([0.9, 0.8, 0.1], requires_grad=True)
    >>> fg = TorchFactorGraph()
    >>> u = fg.variable_from(x)
    >>> fg.add(Budget(u, budget=torch.tensor(1.0)))
    >>> fg.solve()
    >>> u.value.detach()
    tensor([0.5500, 0.4500, 0.0000])
    >>> u.value[0].backward()
    >>> x.grad
    tensor([ 0.5000, -0.5000,  0.0000])
    """

    _torch = True

    def _zeros(self, shape):
        import torch
        return torch.zeros(shape)     # float32, as lp-sparsemap

    def _check_scores(self, scores):
        from sparsemap.torch import _check_tensor    # the torch layers' check and message
        return _check_tensor(scores, "scores")

    def _ops(self):
        import torch
        dev = self.variables[0]._scores.device if self.variables else None
        return _Ops(torch, dev)

    def _scores(self, ops):
        t = ops.torch
        parts = [v._scores.reshape(-1).to(dtype=t.float64, device=ops.device)
                 for v in self.variables]
        eta = parts[0] if len(parts) == 1 else t.cat(parts)
        d = eta.detach()
        if bool((t.isnan(d) | t.isposinf(d)).any()):
            raise ValueError(_NONFINITE)
        return eta

    def _set_values(self, u, offsets):
        for v in self.variables:
            k = offsets[id(v)]
            s = v._scores
            v.value = u[k:k + v._ix.size].reshape(v.shape).to(dtype=s.dtype, device=s.device)
