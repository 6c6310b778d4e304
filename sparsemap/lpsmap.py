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
:class:`sparsemap.FactorGraph` of each connected part solves it. All of that
is worked out once per graph structure (the variables' shapes, the factors and
the variables they are on) and cached, so a graph rebuilt per call costs a
lookup, the solves and the mapping back; on a :class:`TorchFactorGraph` the
solve is one autograd node whatever the graph, its forward and exact backward
in NumPy.
"""
import math
import numbers
import weakref

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



class _Part:
    """One connected part of a drop-in graph as a native FactorGraph: its variables
    (global indices, in the part's order) and its pieces (indices into the list)."""
    __slots__ = ("graph", "var", "pieces")

    def __init__(self, graph, var, pieces):
        self.graph, self.var, self.pieces = graph, var, pieces


def _native_parts(n_variables, pieces):
    """The native FactorGraphs of a structure, one per connected part (factors that share
    no variable, directly or through others, are separate problems: a padded batch of
    documents in one graph is one problem per document). ``pieces``: ``[(factor, idx)]``."""
    # union-find over variables, joined through each piece's variables
    parent = np.arange(n_variables)

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    flat = [idx.reshape(-1)[idx.reshape(-1) >= 0] for _, idx in pieces]
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
            f, idx = pieces[k]
            g.add(f, np.where(idx >= 0, local[np.maximum(idx, 0)], -1))
        parts.append(_Part(g, var, ks))
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


_PLAIN_INDEX = frozenset((int, slice, type(None), type(Ellipsis)))


def _index_key(key):
    """A NumPy index from one that may hold tensors."""
    if type(key) in _PLAIN_INDEX:
        return key
    if type(key) is tuple:
        for k in key:
            if type(k) not in _PLAIN_INDEX:
                break
        else:
            return key              # the common z[i, :]: nothing to convert
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
        # weak: graph -> variable -> graph would be a cycle, and every graph built per
        # call (the common use) would wait for the garbage collector to be freed
        self._graph = weakref.ref(graph)
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
        if type(key) is not tuple or len(key) != 2 or type(key[0]) not in _PLAIN_INDEX \
                or type(key[1]) not in _PLAIN_INDEX:
            key = _index_key(key)    # the common z[i, :] and z[:, j] need no conversion
        return Slice(self, self._ix[key])

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

    __slots__ = ("_base_var", "_ix")

    def __init__(self, var, ix):
        self._base_var = var
        self._ix = ix if type(ix) is np.ndarray else np.asarray(ix)

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
    if type(v) is not Slice and not isinstance(v, (Variable, Slice)):
        raise ValueError(f"{name}: expected a Variable or a Slice of one (from "
                         f"fg.variable_from / fg.variable), got {type(v).__name__}")
    return v


def _variable_of(v):
    """The :class:`Variable` that ``v`` (a variable or a slice of one) indexes."""
    return v if isinstance(v, Variable) else v._base_var


# -- solving: per structure once, then per call -------------------------------------------
def _host(x):
    """Scores as a NumPy array: a tensor read on the host (as float64 unless NumPy has
    its dtype), anything else as float64."""
    if _is_tensor(x):
        if x.requires_grad:        # detach() costs more than the check
            x = x.detach()
        if not x.is_cpu or x.dtype not in _HOST_DTYPES:
            import torch
            x = x.to(device="cpu", dtype=torch.float64)
        return x.numpy()
    return np.asarray(x, dtype=np.float64)


_HOST_DTYPES = set()      # the torch dtypes NumPy reads directly (filled with torch)


def _padded(parts, n):
    """The arrays ``parts`` (``n`` entries in all; None: zeros of the given size) end to
    end in one float64 array, with a 0 after them: indexed by -1 (a part a factor
    ignores), it reads 0."""
    out = np.empty(n + 1)
    out[n] = 0.0
    k = 0
    for x, size in parts:
        if x is None:
            out[k:k + size] = 0.0
        else:
            out[k:k + size] = x.reshape(-1)
        k += size
    return out


def _kept(idx):
    """``(src, dst)``: the entries of a piece's flat ``idx`` that are variables, and those
    variables (``src`` is every entry when the factor ignores none)."""
    flat = idx.reshape(-1)
    src = np.flatnonzero(flat >= 0)
    return (slice(None) if src.size == flat.size else src), flat[src]


def _flat(x, name, size, at_least=False):
    """The first ``size`` entries of ``x`` as a flat float64 array."""
    a = _host(x).reshape(-1)
    n = a.shape[0]
    if n < size or (n > size and not at_least):
        need = f"at least {size}" if at_least else f"{size}"
        raise ValueError(f"{name}: expected {need} entries, got {n}")
    return a[:size] if n > size else a


_PLANS = {}


class _Plan:
    """What a graph's structure (its variables' shapes, its factors' kinds and arguments
    and the variables each is on) fixes, worked out once per structure: the variables'
    layout, each factor's native pieces, which variables no factor uses, and either the
    independent factors or the native graphs of the connected parts. A call then only
    reads scores, solves and maps back (:class:`_Call`)."""

    def __init__(self, graph):
        offsets, V = graph._layout()
        self.V = V
        self.sizes = [v._ix.size for v in graph.variables]
        self.ids = [f._ids(offsets) for f in graph.factors]
        self.structures = [f._structure(i) for f, i in zip(graph.factors, self.ids)]
        self.add_sizes = [f._additionals_size() for f in graph.factors]
        self.with_adds = [k for k, n in enumerate(self.add_sizes) if n is not None]
        self.spreads = [(type(f), f._dims()) for f in graph.factors]
        flat = [np.concatenate([i.reshape(-1) for i in fid]) for fid in self.ids]
        count = np.bincount(np.concatenate(flat), minlength=V) if flat else np.zeros(V, int)
        self.free = np.flatnonzero(count == 0)
        self.alone = bool(count.max(initial=0) <= 1)
        if self.alone:
            self.kept = [[_kept(idx) for _, idx in pieces] for pieces, _ in self.structures]
            return
        pieces, extra, self.owner = [], [], []
        self.first, self.extra_first = [0], [0]    # each factor's pieces and extra scores
        for k, (p, e) in enumerate(self.structures):
            pieces += p
            extra += e
            self.owner += [k] * len(p)
            self.first.append(len(pieces))
            self.extra_first.append(len(extra))
        self.extra = np.asarray(extra, dtype=np.intp)
        self.parts = _native_parts(V, pieces)


def _plan(graph):
    """The graph's :class:`_Plan`, from the cache when a graph of the same structure was
    solved before (the common case: one graph built per document or per batch)."""
    # the key: the variables' shapes, then per factor its class, its arguments besides
    # the scores, and per argument the variable and the indices it is on (one loop, no
    # call per factor, one entry per factor on one argument, the common case: this runs
    # on every solve)
    names = {id(v): k for k, v in enumerate(graph.variables)} \
        if len(graph.variables) > 1 else None
    key = [tuple(v.shape for v in graph.variables)]
    add = key.append
    for f in graph.factors:
        vs = f._variables
        if type(vs) is not tuple:
            ix = vs._ix
            add((type(f), f._signature,
                 0 if names is None else names[id(getattr(vs, "_base_var", vs))], ix.shape,
                 ix.tobytes()))
            continue
        add((type(f), f._signature, len(vs)))
        for v in vs:
            ix = v._ix
            add((0 if names is None else names[id(getattr(v, "_base_var", v))], ix.shape,
                 ix.tobytes()))
    key = tuple(key)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 256:
            _PLANS.clear()
        plan = _PLANS[key] = _Plan(graph)
    return plan


class _Call:
    """One solve of a graph by its plan, in NumPy: :meth:`forward` from the scores and
    the factors' flat additional scores to every variable's marginals (MAP when
    ``decode``), :meth:`backward` its exact transpose for the torch layer. ``report``:
    the native graphs' results (for ``verbose``). It keeps no factor (the torch layer's
    backward node keeps it, and a factor's variables keep their values, which keep that
    node: a cycle that only the garbage collector would free)."""

    def __init__(self, plan, decode):
        self.plan, self.decode = plan, decode
        self.report = []

    def adds(self, raw):
        """The factors' flat additional scores (None for a factor without), from those
        of the factors that have them, as given (``raw``, in ``plan.with_adds``'s
        order)."""
        out = [None] * len(self.plan.add_sizes)
        for k, x in zip(self.plan.with_adds, raw):
            out[k] = _flat(x, "additionals", *self.plan.add_sizes[k])
        return out

    def forward(self, factors, eta, adds):
        """``eta``: the scores as _scores_array makes them."""
        plan, decode = self.plan, self.decode
        u = np.empty(plan.V)
        if plan.free.size:          # in no factor: the box [0, 1] alone
            e = eta[plan.free]
            if decode:
                u[plan.free] = e > 0
            else:
                u[plan.free] = np.clip(e, 0.0, 1.0)
                self.slope = (e >= 0) & (e <= 1)
        if plan.alone:
            self.vjps = []
            for f, (pieces, _), kept, ids, a in zip(factors, plan.structures, plan.kept,
                                                     plan.ids, adds):
                out, vjp = f._alone(pieces, kept, ids, eta, a, decode)
                for idx, vals in out:
                    u[idx] = vals
                self.vjps.append(vjp)
            return u
        ev, eu = None, eta[:plan.V]
        if plan.with_adds:
            ev = [None] * plan.first[-1]
            ext = np.zeros(plan.extra.shape[0])
            for k, a in enumerate(adds):
                if a is not None:
                    ev[plan.first[k]:plan.first[k + 1]], \
                        ext[plan.extra_first[k]:plan.extra_first[k + 1]] = \
                        plan.spreads[k][0]._spread(plan.spreads[k][1], a)
            if ext.shape[0]:
                eu = eu.copy()
                np.add.at(eu, plan.extra, ext)
        for k, p in enumerate(plan.parts):
            whole = p.var.shape[0] == plan.V       # one part over every variable
            try:
                r = (p.graph.solve_map if decode else p.graph.solve)(
                    eu if whole else eu[p.var],
                    None if ev is None else [ev[i] for i in p.pieces])
            except ValueError as exc:
                exc.part = k
                raise
            self.report.append(r)
            if whole:
                return r.u
            u[p.var] = r.u
        return u

    def backward(self, g):
        """The gradients of the scores and of each factor's flat additional scores
        (None for a factor without) from that of the marginals, ``g`` (as _padded
        makes it)."""
        plan = self.plan
        ge = np.zeros(plan.V)
        if plan.free.size:
            ge[plan.free] = np.where(self.slope, g[plan.free], 0.0)
        gadds = [None] * len(plan.add_sizes)
        if plan.alone:
            for k, vjp in enumerate(self.vjps):
                grads, gadds[k] = vjp(g)
                for idx, vals in grads:
                    ge[idx] = vals
            return ge, gadds
        gv = [None] * plan.first[-1]
        for p, r in zip(plan.parts, self.report):
            whole = p.var.shape[0] == plan.V
            gu, gvp = r.vjp(g[:plan.V] if whole else g[p.var])
            if whole:
                ge = gu
            else:
                ge[p.var] = gu
            if plan.with_adds:
                for i, x in zip(p.pieces, gvp):
                    gv[i] = x
        if not plan.with_adds:
            return ge, gadds
        gext = ge[plan.extra]
        for k in plan.with_adds:
            cls, dims = plan.spreads[k]
            gadds[k] = cls._unspread(
                dims, gv[plan.first[k]:plan.first[k + 1]],
                gext[plan.extra_first[k]:plan.extra_first[k + 1]])
        return ge, gadds


_TORCH = []


def _torch_function():
    """The autograd Function of a drop-in solve, made on first use (imports torch): the
    variables' scores and the factors' additional scores in, as given (any shape, dtype
    and device), every variable's value out, in one node whatever the graph. Its forward
    and backward are :class:`_Call`'s, in NumPy: a chain of small tensor operations
    (gathers, casts, scatters) costs more than a small graph's solve."""
    if _TORCH:
        return _TORCH[0]
    import torch
    _HOST_DTYPES.update((torch.float64, torch.float32, torch.float16))
    numpy_dtypes = {torch.float64: np.float64, torch.float32: np.float32,
                    torch.float16: np.float16}

    def like(a, t):
        """``a`` as a tensor of ``t``'s shape, dtype and device."""
        a = np.asarray(a).reshape(t.shape)
        if t.dtype in numpy_dtypes:
            out = torch.from_numpy(np.asarray(a, dtype=numpy_dtypes[t.dtype]))
            return out if t.is_cpu else out.to(t.device)
        return torch.from_numpy(np.asarray(a, dtype=np.float64)).to(dtype=t.dtype,
                                                                     device=t.device)

    def grads(ctx, *gs):
        """The gradients of _DropInSolve's inputs from its outputs'."""
        sizes = ctx.call.plan.sizes
        g = _padded([(None if x is None else _host(x), n) for x, n in zip(gs, sizes)],
                    ctx.call.plan.V)
        ge, gadds = ctx.call.backward(g)
        out = [None, None, None]
        out += [like(x, t) for x, t in zip(_split(ge, sizes), ctx.inputs[:ctx.n_vars])]
        for k, t in zip(ctx.call.plan.with_adds, ctx.inputs[ctx.n_vars:]):
            a = gadds[k]
            if t is None:
                out.append(None)
                continue
            full = np.zeros(t.numel())
            full[:a.shape[0]] = a       # an "at least" array's tail is not read
            out.append(like(full, t))
        return tuple(out)

    once = torch.autograd.function.once_differentiable(grads)

    class _DropInSolve(torch.autograd.Function):
        @staticmethod
        def forward(ctx, call, factors, n_vars, *inputs):
            scores = [x.detach() for x in inputs[:n_vars]]
            raw = inputs[n_vars:]
            eta = _scores_array(scores, call.plan.sizes, call.plan.V)
            u = call.forward(factors, eta, call.adds(raw))
            ctx.call, ctx.n_vars = call, n_vars
            ctx.inputs = scores + [x.detach() if _is_tensor(x) else None for x in raw]
            return tuple([like(x, t) for x, t in zip(_split(u, call.plan.sizes), scores)])

        @staticmethod
        def backward(ctx, *gs):
            # with grad mode off (a plain backward pass) once_differentiable would only
            # run the body under no_grad, which costs more than the body's bookkeeping;
            # with create_graph it makes a second derivative raise instead of being
            # silently wrong
            if torch.is_grad_enabled():
                return once(ctx, *gs)
            return grads(ctx, *gs)

    _TORCH.append(_DropInSolve)
    return _DropInSolve


def _scores_array(scores, sizes, n):
    """The graph's scores laid end to end (see _padded; ``n`` entries), checked:
    ``-inf`` is a mask."""
    eta = _padded([(_host(x), k) for x, k in zip(scores, sizes)], n)
    top = eta[:-1].max()
    if top != top or top == np.inf:              # nan propagates through max
        raise ValueError(_NONFINITE)
    return eta


def _split(u, sizes):
    """``u`` cut into the variables' pieces."""
    out, k = [], 0
    for n in sizes:
        out.append(u[k:k + n])
        k += n
    return out


# -- factors -------------------------------------------------------------------------------
class _LPFactor:
    """Base of the factors: ``_variables`` (a Variable, Slice or tuple of them).

    What the graph's structure fixes (``_signature``, ``_structure``, ``_dims``) is read
    once per structure (see :class:`_Plan`); per call, only the additional scores are
    read (``_spread``, and its transpose ``_unspread`` for the backward pass: static, on
    ``_dims``, so that the backward pass keeps no factor, whose variables hold the
    values that hold the backward pass)."""

    _additionals = None

    def _vars(self):
        return self._variables if isinstance(self._variables, tuple) else (self._variables,)

    def _ids(self, offsets):
        """Global variable indices of the factor's variables (one array per argument)."""
        return tuple(v._ix + offsets[id(_variable_of(v))] for v in self._vars())

    # The construction arguments other than the variables and additional scores (a
    # property on the factors that have any: the logic factors' key reads no call).
    _signature = ()

    def _structure(self, ids):
        """Native pieces ``[(factor, idx)]`` over the global variable indices ``ids`` (one
        array per argument; ``idx`` shaped like the factor's ``shape_u``, -1 where it
        ignores a part), and the variables that get extra unary scores from ``_spread``."""
        raise NotImplementedError

    def _additionals_size(self):
        """``(size, at_least)`` of the flat additional scores (None: the factor has
        none; ``at_least``: longer arrays are accepted and their tail ignored)."""
        return None

    def _dims(self):
        """The sizes _spread and _unspread need."""
        return ()

    @staticmethod
    def _spread(dims, a):
        """From the flat additional scores ``a``: each piece's ``eta_v`` (None for none)
        and the extra unary scores, in the order of ``_structure``."""
        raise NotImplementedError

    @staticmethod
    def _unspread(dims, gv, ge):
        """The transpose of :meth:`_spread`: the gradient of ``a`` from the pieces'
        ``eta_v`` gradients ``gv`` and the extra unary scores' ``ge``."""
        raise NotImplementedError

    def _alone(self, pieces, kept, ids, eta, a, decode):
        """This factor's marginals (MAP when ``decode``) when no other factor shares its
        variables and each appears once here: ``[(variables, values)]``, and a function
        from the gradient of ``u`` to ``([(variables, gradient of eta)], gradient of
        a)``. Each piece is its own SparseMAP problem. ``kept``: each piece's _kept;
        ``eta`` (and the gradient) as _padded makes them."""
        cls, dims = type(self), self._dims()
        evs = None if a is None else cls._spread(dims, a)[0]
        out, results = [], []
        for k, ((f, idx), (src, dst)) in enumerate(zip(pieces, kept)):
            ev = None if evs is None else evs[k]
            if decode:
                u, r = f.vertex(f.map(eta[idx], ev))[0], None
            else:
                r = sm.solve(f, eta[idx], ev)
                u = r.u
            out.append((dst, u.reshape(-1)[src]))
            results.append(r)

        def vjp(g):
            grads, gvs = [], []
            for (f, idx), (src, dst), r in zip(pieces, kept, results):
                gu, gv = r.vjp(g[idx])
                grads.append((dst, gu.reshape(-1)[src]))
                gvs.append(gv)
            return grads, (None if a is None else cls._unspread(dims, gvs, ()))
        return out, vjp

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
        self._variables = variables if type(variables) is Slice else \
            _check_vars(variables, "variables")
        n = variables._ix.size
        if n < self._min:
            raise ValueError(f"variables: {type(self).__name__} needs at least {self._min} "
                             f"variables, got {n}")

    def _structure(self, ids):
        return [(_factor(self._native, ids[0].size), ids[0].reshape(-1))], []


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

    @property
    def _signature(self):
        return (self.budget, self.force_budget)

    def _structure(self, ids):
        f = _factor(sm.BudgetFactor, ids[0].size, self.budget, exact=self.force_budget)
        return [(f, ids[0].reshape(-1))], []


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

    def _structure(self, ids):
        f = _factor(sm.PairFactor)
        pairs = np.stack([ids[0].reshape(-1), ids[1].reshape(-1)], axis=1)
        return [(f, pairs[k]) for k in range(self._n)], []

    def _additionals_size(self):
        return self._n, False

    def _dims(self):
        return (self._n,)

    @staticmethod
    def _spread(dims, a):
        return [a[k:k + 1] for k in range(dims[0])], ()

    @staticmethod
    def _unspread(dims, gv, ge):
        return np.concatenate([np.asarray(g).reshape(-1) for g in gv])


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

    def _structure(self, ids):
        return [(_factor(sm.SequenceFactor, *self._variables.shape), ids[0])], []

    def _additionals_size(self):
        L, S = self._variables.shape
        return (L - 1) * S * S, False

    def _dims(self):
        return self._variables.shape

    @staticmethod
    def _spread(dims, a):
        L, S = dims
        return [a.reshape(L - 1, S, S)], ()

    @staticmethod
    def _unspread(dims, gv, ge):
        return np.asarray(gv[0]).reshape(-1)


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

    @property
    def _signature(self):
        return (self._budget, self._force_budget)

    def _additionals_size(self):
        L, S = self._variables.shape
        return 2 * S + (L - 1) * S * S, True

    def _native(self, L):
        return _factor(sm.SequenceBudgetFactor, L, min(self._budget, L), exact=self._force_budget)

    def _structure(self, ids):
        L, S = self._variables.shape
        ix = ids[0]
        if S != 2:
            return [(_oracle_sequence_budget(L, S, self._budget, self._force_budget), ix)], []
        xor = _factor(sm.XorFactor, 2)
        return ([(self._native(L), ix[:, 0].copy())] + [(xor, ix[i].copy()) for i in range(L)],
                [ix[0, 0], ix[L - 1, 0]])

    def _dims(self):
        return self._variables.shape

    @staticmethod
    def _spread(dims, a):
        """S = 2: the native factor's "position in state 0" transitions are AD3's with
        both states flipped; the start and end scores become extra unary scores of the
        first and last positions (state 0 against state 1)."""
        L, S = dims
        if S != 2:
            return [a], ()
        n = a.shape[0]
        trans = a[S:n - S].reshape(L - 1, S, S)
        return ([trans[:, ::-1, ::-1].copy()] + [None] * L,
                (a[0] - a[1], a[n - 2] - a[n - 1]))

    @staticmethod
    def _unspread(dims, gv, ge):
        L, S = dims
        if S != 2:
            return np.asarray(gv[0]).reshape(-1)
        g = np.empty(2 * S + (L - 1) * S * S)
        n = g.shape[0]
        g[0], g[1], g[n - 2], g[n - 1] = ge[0], -ge[0], ge[1], -ge[1]
        g[S:n - S] = np.asarray(gv[0])[:, ::-1, ::-1].reshape(-1)
        return g

    def _alone(self, pieces, kept, ids, eta, a, decode):
        L, S = self._variables.shape
        if S != 2:
            return _LPFactor._alone(self, pieces, kept, ids, eta, a, decode)
        # one binary sequence: u[i, 1] = 1 - u[i, 0], so the QP in u[:, 0] has half the
        # curvature (scores halved) and the state-1 scores folded in
        ix = ids[0]
        dims = self._dims()
        evs, (first, last) = SequenceBudget._spread(dims, a)
        ev = evs[0]
        eu = eta[ix[:, 0]] - eta[ix[:, 1]]
        eu[0] += first
        eu[L - 1] += last
        f = self._native(L)
        if decode:
            u0 = f.vertex(f.map(eu, ev))[0]
            return [(ix[:, 0], u0), (ix[:, 1], 1.0 - u0)], None
        r = sm.solve(f, 0.5 * (eu + 1.0), 0.5 * ev)
        u0 = np.asarray(r.u)

        def vjp(g):
            gu, gv = r.vjp(g[ix[:, 0]] - g[ix[:, 1]])
            gu = 0.5 * np.asarray(gu)
            return ([(ix[:, 0], gu), (ix[:, 1], -gu)],
                    SequenceBudget._unspread(dims, [0.5 * np.asarray(gv)] + [None] * L,
                                             (gu[0], gu[L - 1])))
        return [(ix[:, 0], u0), (ix[:, 1], 1.0 - u0)], vjp


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

    @property
    def _signature(self):
        return (self.packed, self.projective)

    def _structure(self, ids):
        n = self._variables.shape[0]
        f = _factor(sm.TreeFactor, n, projective=self.projective, single_root=self.projective)
        return [(f, _tree_index(ids[0], self.packed))], []


# -- graphs -----------------------------------------------------------------------------------
def _how_solved(plan, report, decode):
    """What ``verbose`` prints for a graph: independent factors, each its own problem, or
    how many connected parts and how each solve went (iterations, certified or not, the
    largest constraint violation)."""
    if plan.alone:
        if len(plan.structures) == 1 and len(plan.structures[0][0]) == 1 and \
                not plan.free.size:
            return (f"plain {'MAP' if decode else 'SparseMAP'} of "
                    f"{plan.structures[0][0][0][0]!r} (the active set, certified by its "
                    f"duality gap)")
        return (f"{len(plan.structures)} independent factors (no variable is shared), each "
                f"by its own {'MAP oracle' if decode else 'SparseMAP solve'}")
    n = len(plan.parts)
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
        vs = factor._variables
        for v in vs if type(vs) is tuple else (vs,):
            if (v._base_var if type(v) is Slice else v)._graph() is not self:
                raise ValueError("factor: its variables belong to another factor graph")
        self.factors.append(factor)

    # -- solving ------------------------------------------------------------------
    def _layout(self):
        offsets, n = {}, 0
        for v in self.variables:
            offsets[id(v)] = n
            n += v._ix.size
        return offsets, n

    def _solve_graph(self, decode, verbose):
        what = "LP-MAP" if decode else "LP-SparseMAP"
        plan = _plan(self)
        if plan.V == 0:
            if verbose:
                print(f"sparsemap.lpsmap: {what}: no variables, nothing to solve")
            return
        call = _Call(plan, decode)
        raw = [self.factors[k]._additionals for k in plan.with_adds]
        try:
            if self._torch and not decode:
                values = _torch_function().apply(call, self.factors, len(self.variables),
                                                 *[v._scores for v in self.variables], *raw)
            else:
                eta = _scores_array([v._scores for v in self.variables], plan.sizes, plan.V)
                values = _split(call.forward(self.factors, eta, call.adds(raw)), plan.sizes)
        except ValueError as exc:
            if getattr(exc, "factors", None) is None:
                raise
            raise ValueError(self._conflict(exc, plan.parts, plan.owner)) from None
        except sm.ConvergenceError as exc:
            # the native advice (raise max_iter) cannot be followed here: this
            # max_iter is lp-sparsemap's, accepted and ignored
            raise sm.ConvergenceError(
                f"{str(exc).split('. Raise max_iter')[0]}. This solve() ignores "
                f"max_iter (lp-sparsemap's setting); to allow more iterations, build "
                f"the graph as a sparsemap.FactorGraph and call its solve(max_iter=...) "
                f"(see the migration guide, 'The low-level API').") from None
        for v, x in zip(self.variables, values):
            v.value = self._value(x, v)
        if verbose:
            print(f"sparsemap.lpsmap: {what} of {plan.V} variables and {len(self.factors)} "
                  f"factors: {_how_solved(plan, call.report, decode)}")

    def _value(self, x, var):
        return x.reshape(var.shape)

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

    def _value(self, x, var):
        if _is_tensor(x):
            return x                # from the autograd node, shaped and typed like the scores
        import torch
        s = var._scores
        return torch.as_tensor(x.reshape(var.shape)).to(dtype=s.dtype, device=s.device)
