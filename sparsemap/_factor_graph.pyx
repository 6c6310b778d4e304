"""LP-SparseMAP (Niculae and Martins, ICML 2020): SparseMAP over a factor graph.

This module holds the public API: :class:`FactorGraph` (building a graph, checking the
user's scores, masks and forced groups, padding, the errors that name conflicting
factors) and :class:`FactorGraphResult` (the solution, and the backward pass's Python
side: checking the completed faces, untying ties in ``eta_v``, the conjugate gradient
over the engine's projectors). The engine is below it:
``sparsemap._fg_admm`` (the problem and ADMM: its docstring states the steps,
docs/lp_sparsemap.rst derives them), ``sparsemap._fg_certificate`` (the polish, the
KKT check, infeasibility), ``sparsemap._fg_backward`` (the backward pass's products
and face completion; ``_Engine``, the class the results keep), ``sparsemap._fg_structure``
(what every solve of a graph shares); graphs that are exactly one factor's
polytope are recognised and solved as that factor in ``sparsemap._fg_whole``.

The whole-factor path calls :func:`sparsemap.solve`, so this module sits on the layer
of ``sparsemap._solve``, above the engine.
"""

import numpy as np

from sparsemap._active_set import tie_direction
from sparsemap._backward cimport FACE_CERTIFIED
from sparsemap._backward import FACE_STATUS_FIBERED, reduce_support
from sparsemap import _variables
from sparsemap import _fg_whole
from sparsemap._checks import check_per_factor
from sparsemap._factors._logic import AtMostOneFactor, PairFactor
from sparsemap._exceptions import ConvergenceError, warn
from sparsemap._factors._base cimport Factor
from sparsemap._factors._base import (SCAN_BAD, _as_float_array, _real_array, _typed_array,
                                     check_bool, check_positive_int, check_real, scan_values)
from sparsemap._fg_admm import ENGINE_CONVERGED, ENGINE_INFEASIBLE, _MESSAGES
from sparsemap._fg_backward import _Engine
from sparsemap._fg_structure import _Structure, _count_conflict
# Pickles of results written while it lived in this module name it here.
from sparsemap._fg_backward import _engine_from_state

DEFAULT_MAX_ITER = 10_000
# Untying ties in eta_v (FactorGraphResult._untie): the first delta, relative to the
# scores' scale (small: the check that the piece is the one adjacent to eta is weaker
# than a single factor's), and the most solves.
UNTIE_DELTA = 1e-6
UNTIE_TRIES = 6
DEFAULT_TOL = 1e-10


def _describe(f, factor):
    return f"factor {f} ({factor!r})"


# The zeros of a factor without additional scores (shape_v (0,)): empty, so one array
# serves them all.
_NO_V = np.zeros(0)


cdef _zeros_v(factor):
    """Flat zeros of the factor's additional scores (a C call: it runs per factor on
    every solve and every backward pass)."""
    return np.zeros(factor.n_v) if factor.n_v else _NO_V


def _check_per_factor(factors, values, name, bint zeros):
    """``eta_v`` (or a direction on it): one flat float64 array per factor.

    ``values`` is None or a list with one entry per factor, each shaped like
    the factor's ``shape_v`` or None. Where it (or an entry) is None, and for
    factors without additional scores: zeros if ``zeros``, else None.
    """
    F = len(factors)
    if values is None:
        return [_zeros_v(factor) if zeros else None for factor in factors]
    values = check_per_factor(values, F, name)
    out = []
    for f, (factor, e) in enumerate(zip(factors, values)):
        if e is not None and factor.n_v == 0 and np.size(e) != 0:
            raise ValueError(f"{name}[{f}]: {_describe(f, factor)} has no additional "
                             f"scores; pass None")
        if e is None or factor.n_v == 0:
            out.append(_zeros_v(factor) if zeros else None)
        else:
            out.append(_as_float_array(e, f"{name}[{f}]", factor.shape_v).reshape(-1))
    return out




class FactorGraph:
    """Binary variables tied together by factors: LP-SparseMAP (Niculae and Martins, 2020).

    Each added factor's unary parts are attached to binary variables
    ``0 .. n_variables - 1`` (the same variable may appear in several factors);
    :meth:`solve` then computes the marginals ``u`` of the variables in the
    local polytope of the graph, the LP-SparseMAP relaxation: the quadratic
    program

    .. math::

        \\max_{u, p}\\; \\eta_u^\\top u - \\tfrac12 \\|u\\|^2
        + \\sum_f \\eta_{v,f}^\\top N_f p_f
        \\quad \\text{s.t.}\\quad M_f p_f = \\ell_f(u),\\; p_f \\in \\triangle_f,

    where ``l_f(u)`` lists, for every part of factor ``f``, the variable it
    stands for (or ``1 -`` that variable when the part is negated), and
    variables in no factor lie in ``[0, 1]``. A graph of one factor whose
    parts are attached to distinct variables is plain SparseMAP.

    Parameters
    ----------
    n_variables : int, optional
        Number of binary variables (>= 1), numbered ``0 .. n_variables - 1``.
        Omit it to declare them as arrays with :meth:`add_variables` (which
        also adds to a given number).

    Attributes
    ----------
    n_variables : int
    factors : list of Factor
        The added factors, in order.
    variables : list of ndarray of int
        For each factor, the variable of each unary part (shape ``factor.shape_u``).
    negated : list of ndarray of bool
        For each factor, which parts stand for ``1 - u``.

    Notes
    -----
    The algorithm is ADMM in which every step on a factor is a warm-started
    SparseMAP call on the exact active set (see :doc:`/factor_graphs`); the
    backward pass (:meth:`FactorGraphResult.jvp`, :meth:`FactorGraphResult.vjp`)
    is exact.

    Examples
    --------
    Three variables, exactly one of the first two on and at most one of the
    last two on:

    >>> import numpy as np, sparsemap as sm
    >>> fg = sm.FactorGraph(3)
    >>> fg.add(sm.XorFactor(2), [0, 1])
    0
    >>> fg.add(sm.AtMostOneFactor(2), [1, 2])
    1
    >>> r = fg.solve(np.array([0.2, 0.5, 0.9]))
    >>> r.converged, r.polished, np.round(r.u, 6)
    (True, True, array([0.533333, 0.466667, 0.533333]))

    The projection of the scores onto ``{u0 + u1 = 1, u1 + u2 <= 1}``; see
    :doc:`/factor_graphs` for a parser with valency constraints.
    """

    def __init__(self, n_variables=None):
        self.n_variables = 0 if n_variables is None else check_positive_int(n_variables,
                                                                           "n_variables")
        self.factors = []
        self.variables = []
        self.negated = []

    def __repr__(self):
        return f"FactorGraph(n_variables={self.n_variables}, n_factors={len(self.factors)})"

    def add(self, factor, variables, negated=None):
        """Attach a factor's unary parts to variables.

        Parameters
        ----------
        factor : Factor
            Any factor: logic, tree, sequence, matching, generic or oracle.
        variables : VariableArray or array_like of int, shape ``factor.shape_u``
            The variable each unary part stands for: a slice of the arrays of
            :meth:`add_variables` (``x[2:, 1]``, ``~x[0]`` for negated
            literals), or the low-level form, variable indices in
            ``[0, n_variables)`` with ``-1`` only where the factor ignores the
            part (the diagonal and column 0 of a :class:`TreeFactor`).
        negated : array_like of bool, shape ``factor.shape_u``, optional
            Where True, the part stands for ``1 - u[i]`` instead of ``u[i]``
            (default: no negation; with a VariableArray, it flips the
            array's own negation). Only on attached parts, and only where the
            factor's parts lie in ``[0, 1]`` (a :class:`GenericFactor` row with
            other values is refused: ``1 - u`` would not be its complement).

        Returns
        -------
        int
            The index of the factor in the graph (its place in ``eta_v`` lists
            and in the result's per-factor lists).

        Raises
        ------
        ValueError
            When ``factor`` is not a Factor, ``variables`` has the wrong shape,
            non-integer values, an index out of range, or -1 on a part the
            factor uses, or ``negated`` is malformed or refused.
        """
        if not isinstance(factor, Factor):
            raise ValueError(f"factor: expected a sparsemap Factor, got {type(factor).__name__}")
        variables, negated = _variables.unpack(self, variables, negated)
        shape = factor.shape_u
        where = lambda: f" (factor.shape_u of {factor!r})"
        var = _typed_array(variables, "variables", shape, "iu", "integers", where)
        bad = (var < -1) | (var >= self.n_variables)
        if np.any(bad):
            raise ValueError(f"variables: expected indices in [0, {self.n_variables}) (or -1 where "
                             f"the factor ignores the part), got {var[bad].reshape(-1)[0]}")
        var = var.astype(np.intc)
        ignored = np.zeros(factor.n_u, bool)
        idx = factor._ignored_entries(False)
        if idx is not None:
            ignored[np.asarray(idx, dtype=np.intp)] = True
        ignored = ignored.reshape(shape)
        loose = (var == -1) & ~ignored
        if np.any(loose):
            idx = tuple(int(x) for x in np.argwhere(loose)[0])
            raise ValueError(f"variables: -1 at {idx}, a part that {factor!r} uses; every used "
                             f"part must stand for a variable (-1 only where the factor ignores "
                             f"the part)")
        if negated is None:
            neg = np.zeros(shape, bool)
        else:
            neg = _typed_array(negated, "negated", shape, "biu", "booleans", where)
            if neg.dtype.kind != "b":
                if np.any((neg != 0) & (neg != 1)):
                    raise ValueError(f"negated: expected booleans (or 0/1), got {neg!r}")
            neg = neg.astype(bool)
            if np.any(neg & (var < 0)):
                raise ValueError("negated: True on a part attached to no variable (-1)")
            nonbinary = factor._non_binary_parts() if np.any(neg) else None
            if nonbinary is not None and len(nonbinary):
                refused = np.zeros(factor.n_u, bool)
                refused[np.asarray(nonbinary, dtype=np.intp)] = True
                refused = refused.reshape(shape) & neg
                if np.any(refused):
                    idx = tuple(int(x) for x in np.argwhere(refused)[0])
                    raise ValueError(f"negated: part {idx} of {factor!r} takes values outside "
                                     f"[0, 1], so 1 - u is not its complement; negation needs "
                                     f"parts that are binary-variable literals")
        var.setflags(write=False)
        neg.setflags(write=False)
        self.factors.append(factor)
        self.variables.append(var)
        self.negated.append(neg)
        return len(self.factors) - 1

    def _structure(self):
        """The graph's _Structure, rebuilt when factors or variables were added."""
        key = (len(self.factors), self.n_variables)
        st = self.__dict__.get("_st")
        if st is None or st[0] != key:
            structure = _Structure(self.factors, self.variables, self.negated,
                                   self.n_variables)
            # None, or the one factor the graph is (recognised here, not in the engine's
            # _Structure: the engine is below the layer that solves a single factor)
            structure.whole = _fg_whole.recognise(structure)
            st = self._st = (key, structure)
        return st[1]

    def solve(self, eta_u, eta_v=None, max_iter=None, tol=DEFAULT_TOL, rho=None,
              polish=True):
        """LP-SparseMAP marginals of the graph's variables: the certified optimum, or an error.

        Parameters
        ----------
        eta_u : array_like, shape ``(n_variables,)``, or dict
            Unary scores of the variables (each counted once, whatever the
            number of factors the variable is in), or a dict
            ``{VariableArray: scores}`` (see :meth:`scores`). Any finite
            magnitude; ``-inf`` fixes the variable at 0 (a mask). A finite
            score far below all others (below ``-1e6`` times the largest other
            magnitude, as a padding fill with the dtype's minimum) is tried as
            a mask first, and kept as one when the certificate shows the
            variable is 0 at the solution of the given scores; a group of
            variables that a factor forces to a constant sum (a row of a
            :class:`XorFactor`) and whose scores are all that low has the
            largest of them taken off, which does not change the answer.
        eta_v : list, optional
            One entry per added factor, in order: its additional scores
            (shape ``factor.shape_v``, finite), or None (zeros). Must be None
            for a factor without additional scores.
        max_iter : int, optional
            ADMM iteration limit (default 10000); reaching it without a
            certified point raises :class:`~sparsemap.ConvergenceError`.
        tol : float, default 1e-10
            With ``polish=False``, ADMM stops when every factor agrees with
            ``u`` up to ``tol`` (primal residual ``max |l_f(u) - M_f p_f|``)
            and ``rho max |u - u_prev| <= tol`` (dual residual, relative to the
            scale of the scores). With ``polish=True`` this also ends a solve
            whose polish was not certified first.
        rho : float, optional
            ADMM penalty, relative to the scale of the scores (which are
            divided by ``max(1, max |scores|)``); by default
            ``max(0.1, scale ** -0.5)``.
        polish : bool, default True
            Once the factors' supports settle, solve the problem exactly on
            them and keep the result if its KKT conditions hold (then
            ``polished=True`` and ``u`` is exact up to round-off). False runs
            plain ADMM to ``tol``.

        Returns
        -------
        FactorGraphResult

        Raises
        ------
        ValueError
            Wrong shapes or lengths, nan or ``+inf`` scores, ``eta_v`` for a
            factor without additional scores, bad ``max_iter``, ``tol``,
            ``rho`` or ``polish``; or a graph that no point satisfies (with the
            masked variables at 0): the message names the factors in conflict
            (found by counting, by a factor whose every structure is masked,
            or by a Farkas certificate from ADMM's multipliers, within a few
            iterations).
        ConvergenceError
            When ``max_iter`` iterations ran out before a certified point: the
            last iterate is not returned, since it need not satisfy the
            constraints.
        """
        if isinstance(eta_u, dict):
            eta_u = self.scores(eta_u)
        return _raise_unless_solved(self._solve_quiet(eta_u, eta_v, max_iter, tol, rho, polish),
                                    "")

    def _solve_quiet(self, eta_u, eta_v=None, max_iter=None, tol=DEFAULT_TOL, rho=None,
                     polish=True, whole=True):
        """:meth:`solve` without raising on an infeasible graph or a solve that stopped
        uncertified: the result says which (``_status``). Callers that solve in threads
        (the torch layer) raise from their own thread, naming the problem; LP-MAP
        decoding reads uncertified results. ``whole=False``: the graph's own engine even
        when the graph is one factor's polytope (callers that read the engine)."""
        eu = _eta_u_array(eta_u, self.n_variables)
        ev = _check_per_factor(self.factors, eta_v, "eta_v", zeros=True)
        # an explicit ADMM iteration limit asks for ADMM: no single-factor shortcut
        whole = whole and max_iter is None
        max_iter = DEFAULT_MAX_ITER if max_iter is None else check_positive_int(max_iter, "max_iter")
        tol = check_real(tol, "tol")
        rho = None if rho is None else check_real(rho, "rho", positive=True)
        polish = check_bool(polish, "polish")
        lo = float(eu.min(initial=0.0))
        whole = self._structure().whole if whole and polish else None
        if whole is not None and lo >= -MASK_GAP:
            result = _solve_whole(self, whole, eu, ev)
            if result is not None:
                return result
        flat = np.concatenate(ev + [np.zeros(1)])
        if lo >= -MASK_GAP:           # the common case: no mask, no huge negative score
            engine = self._engine(eu, flat, max_iter, tol, rho, polish, None)
            soft = None
        else:
            hard = np.isneginf(eu)
            soft = _mask_candidates(eu, flat, hard)
            border = np.zeros(self.n_variables, bool)
            if soft.any():
                st = self._structure()
                pad = soft | hard
                eu, soft, done = _cancel_forced(st, eu, soft)
                border = _padding_border(st, pad, done)
            if whole is not None:
                result = _solve_whole(self, whole, eu, ev, hard | soft | border, soft)
                if result is not None:
                    return result
            engine = self._engine(eu, flat, max_iter, tol, rho, polish, hard | soft | border)
            if border.any() and engine.status == ENGINE_INFEASIBLE:
                apart = self._engine(eu, flat, max_iter, tol, rho, polish, hard | soft)
                if apart.status != ENGINE_INFEASIBLE:
                    # the padding needs the real part's room: solve (P) with the fill
                    # cancelled, as documented, and say that the real block moves
                    warn(_padding_message(self, engine, border), UserWarning)
                    engine, border = apart, np.zeros(self.n_variables, bool)
        if soft is not None and soft.any() and (engine.status == ENGINE_INFEASIBLE
                                                or not _masks_hold(engine, eu, soft)):
            # a huge negative score that cannot be read as a mask: solve (P) as it is
            # (the padding kept apart from the real part)
            engine = self._engine(eu, flat, max_iter, tol, rho, polish, hard | border)
        result = FactorGraphResult(self, engine, eu, ev)
        result._tol = tol
        result._solve_args = (max_iter, tol, rho, polish)
        return result

    def _engine(self, eu, ev, max_iter, tol, rho, polish, fixed):
        st = self._structure()
        if fixed is not None and not fixed.any():
            fixed = None
        engine = _Engine(st, eu, ev, rho, polish, fixed)
        clash = _count_conflict(st, fixed)
        if clash is None:
            engine.run(max_iter, tol)
        else:                           # infeasible by counting: no iteration needed
            engine.status = ENGINE_INFEASIBLE
            engine.counted = clash
        return engine

    # -- LP-MAP decoding: the method; the algorithm is in sparsemap/_lp_map.py ------
    def solve_map(self, eta_u, eta_v=None, max_iter=None, tol=1e-9):
        """LP-MAP decoding: the LP relaxation of MAP over the local polytope, with a certificate.

        Solves AD3's LP-MAP problem,

            max  eta_u . u + sum_f eta_v[f] . v[f]
            s.t. every factor's (literals of u, v[f]) in its marginal polytope,

        exactly, and certifies the answer by a duality gap. Each factor step is
        the factor's active set on a quadratic subproblem (AD3's QP step); see
        :doc:`/factor_graphs`.

        Parameters
        ----------
        eta_u : array_like, shape ``(n_variables,)``
            Unary scores (each variable counted once).
        eta_v : list, optional
            One entry per factor, as for :meth:`solve`.
        max_iter : int, optional
            ADMM iteration limit of each inner LP-SparseMAP solve.
        tol : float, default 1e-9
            The answer is accepted when its duality gap is at most
            ``tol * max(max |scores|, |lp_value|)``.

        Returns
        -------
        LPMAPResult
            ``u``, ``v``, ``lp_value``, ``dual_bound``, ``gap``,
            ``primal_residual``, ``integral``, ``map`` (the joint
            configuration when integral), ``exact`` (integral and certified:
            an exact MAP).

        Raises
        ------
        ValueError
            Wrong shapes, non-finite scores, bad ``max_iter`` or ``tol``.

        Warns
        -----
        ConvergenceWarning
            When the gap stays above the tolerance; the best point is returned
            with ``converged=False``.

        Notes
        -----
        The relaxation is exact (``exact=True``) when no variable is in two
        factors (the LP splits into one MAP per factor, solved directly) and
        whenever its optimum is integral. When it is fractional, ``u`` is a
        point of the optimal face (as a rule its least-norm point) and ``map``
        is None.

        Examples
        --------
        A frustrated cycle of three "at most one" constraints over three
        variables with equal scores: the relaxation is fractional.

        >>> import numpy as np, sparsemap as sm
        >>> fg = sm.FactorGraph(3)
        >>> for pair in ([0, 1], [1, 2], [0, 2]):
        ...     _ = fg.add(sm.AtMostOneFactor(2), pair)
        >>> r = fg.solve_map(np.ones(3))
        >>> r.integral, round(r.lp_value, 9), r.gap < 1e-9
        (False, 1.5, True)
        >>> r.u
        array([0.5, 0.5, 0.5])
        >>> r = fg.solve_map(np.array([1.0, -0.2, 0.9]))  # tight: exact
        >>> r.exact, r.map.u, round(r.map.score, 9)
        (True, array([1, 0, 0]), 1.0)
        """
        from sparsemap._lp_map import solve_map
        if isinstance(eta_u, dict):
            eta_u = self.scores(eta_u)
        return solve_map(self, eta_u, eta_v, max_iter=max_iter, tol=tol)

    # -- variables and slices: arrays of variables, scores per array ----------------
    def add_variables(self, shape):
        """Declare new binary variables, as an array of the given shape.

        Parameters
        ----------
        shape : int or tuple of int

        Returns
        -------
        VariableArray
            Their ids, ``n_variables .. n_variables + prod(shape) - 1`` in C
            order (``n_variables`` grows by their number). Index it like a
            NumPy array to attach factors to slices: ``fg.add(factor, x[2:, 1])``.

        Raises
        ------
        ValueError
            ``shape`` is not a tuple of non-negative integers.

        Examples
        --------
        A 2 x 3 grid: exactly one on per row, at most one per column.

        >>> import numpy as np, sparsemap as sm
        >>> fg = sm.FactorGraph()
        >>> x = fg.add_variables((2, 3))
        >>> for i in range(2):
        ...     _ = fg.add(sm.XorFactor(3), x[i])
        >>> for j in range(3):
        ...     _ = fg.add(sm.AtMostOneFactor(2), x[:, j])
        >>> r = fg.solve_map({x: [[1.0, 0.5, 0.0], [0.9, 0.2, 0.1]]})
        >>> r.exact, r.lp_value
        (True, 1.4)
        >>> r.map.value(x)
        array([[0, 1, 0],
               [1, 0, 0]])
        """
        return _variables.add_variables(self, shape)

    def scores(self, assignments):
        """The graph's ``eta_u`` from scores given per variable array.

        The structure of a graph is separate from its scores: build it once,
        then score it for every problem of a batch.

        Parameters
        ----------
        assignments : dict or sequence of pairs
            ``{x: scores_x, ...}`` (or ``[(x, scores_x), ...]``), each
            ``scores_x`` shaped like the VariableArray ``x``, or with the same
            leading batch dimensions for every entry. A variable given scores
            by several entries gets their sum; variables given none get 0.

        Returns
        -------
        ndarray, shape ``batch + (n_variables,)``

        Raises
        ------
        ValueError
            A key that is not a VariableArray of this graph (or is negated),
            scores of the wrong shape or non-finite.

        Examples
        --------
        >>> import numpy as np, sparsemap as sm
        >>> fg = sm.FactorGraph()
        >>> x, y = fg.add_variables(2), fg.add_variables(1)
        >>> fg.scores({x: [0.5, -1.0], y: [2.0]})
        array([ 0.5, -1. ,  2. ])
        >>> fg.scores({x: np.ones((4, 2))}).shape           # a batch of 4
        (4, 3)
        """
        return _variables.scores(self, assignments)



# A finite score below -MASK_GAP times every other score's magnitude (and 1) is tried as a
# mask first: such a variable is 0 at the solution whenever that is feasible and the
# certificate below holds (its multipliers absorb the score); otherwise (P) is solved
# as given, at the scale of that score.
MASK_GAP = 1e6


def _eta_u_array(x, Py_ssize_t V):
    """eta_u as float64 (V,), -inf allowed (a mask: the variable is fixed at 0)."""
    arr = _real_array(x, "eta_u")
    if arr.shape != (V,):
        raise ValueError(f"eta_u: expected shape {(V,)}, got {arr.shape}")
    arr = np.ascontiguousarray(arr)
    if scan_values(arr) & SCAN_BAD:
        raise ValueError("eta_u: contains non-finite values other than -inf (nan or +inf); "
                         "only -inf is accepted, to fix a variable at 0 (a mask)")
    return arr


def _mask_candidates(eu, ev, hard):
    """Finite scores that dwarf all others from below (the dtype's minimum as a padding
    fill): below -MASK_GAP times the largest other magnitude, eta_v's and 1 included."""
    neg = np.flatnonzero(~hard & (eu < 0))
    out = np.zeros(eu.shape[0], bool)
    if neg.size == 0:
        return out
    # ev: the eta_v list, or their concatenation (one reduction instead of one per factor)
    evmax = float(np.abs(ev).max(initial=0.0)) if isinstance(ev, np.ndarray) else \
        max([0.0] + [float(np.abs(e).max(initial=0.0)) for e in ev])
    rest = max(1.0, float(eu[~hard & (eu >= 0)].max(initial=0.0)), evmax)
    # in order of magnitude, the first score that dwarfs (by MASK_GAP) every smaller one
    # and rest starts the masks; none of those within MASK_GAP of rest can, so only the
    # others are sorted, and not at all when the smallest of them already does (the
    # padding fill, one value) or they are all equal
    mags = -eu[neg]
    big = mags / MASK_GAP > rest
    if not big.any():
        return out
    cand, b = neg[big], mags[big]
    base = max(rest, float(mags[~big].max(initial=0.0)))
    lo = float(b.min())
    if lo / MASK_GAP > base:
        out[cand] = True
        return out
    if lo == float(b.max()):
        return out
    order = np.argsort(b)                         # smallest magnitude first
    b = b[order]
    below = np.empty(b.size)
    below[0] = base
    below[1:] = b[:b.size - 1]
    np.maximum.accumulate(below, out=below)
    gap = np.flatnonzero(b / MASK_GAP > below)
    if gap.size:
        out[cand[order[gap[0]:]]] = True
    return out



# MAP calls per factor that a face completion may spend (the backward pass's, once).
FACE_BUDGET_CALLS = 2000
# Two candidate Jacobians that differ by more than this (relative) on a random direction
# are told apart by central differences (FactorGraphResult._check_faces).
FACE_CHECK_TOL = 1e-9



def _cancel_forced(st, eu, soft):
    """Scores with the huge negative scores of forced groups taken off.

    A group of a factor's parts whose literals sum to a constant (a row of a XorFactor:
    exactly one on, whatever the scores) keeps that sum at every point of the local
    polytope, so adding the same number to the scores of its variables changes (P)'s
    objective by a constant and its solution not at all. A group whose variables all
    carry huge negative scores (a padded row) cannot be masked: the factor needs one of
    them on; the largest of those scores is taken off the whole group, which leaves the
    rest of the problem at its own scale. Groups that share a variable are taken one
    at a time (a variable is shifted once per round)."""
    if st.n_groups == 0:
        return eu, soft, np.zeros(0, bool)
    eu = eu.copy()
    done = np.zeros(st.n_groups, bool)
    g, v, size, first = _forced_links(st)
    while True:
        cand = np.bincount(g, weights=soft[v], minlength=st.n_groups)
        full = (cand == size) & (cand > 0)
        if not full.any():
            break
        sel = full[g]
        # groups whose variables no other full group has: all at once; else the first
        uses = np.bincount(v[sel], minlength=st.V)
        shared = np.zeros(st.n_groups, bool)
        shared[g[sel & (uses[v] > 1)]] = True
        take = full & ~shared
        if not take.any():
            take = np.zeros(st.n_groups, bool)
            take[np.flatnonzero(full)[0]] = True
        top = np.maximum.reduceat(eu[v], first)       # per group: its links are contiguous
        sel = take[g]
        np.subtract.at(eu, v[sel], top[g[sel]])
        done |= take
        soft = soft & (eu < 0) & _mask_candidates(eu, [], np.isneginf(eu))
    return eu, soft, done


def _forced_links(st):
    """The links of the forced groups, ordered by group: ``(group, variable)`` per link,
    each group's size and its first link; once per structure."""
    out = st.__dict__.get("_forced_links")
    if out is None:
        links = np.flatnonzero(st.group >= 0)
        links = links[np.argsort(st.group[links], kind="stable")]
        g = st.group[links]
        size = np.bincount(g, minlength=st.n_groups)       # every group has a link
        out = st._forced_links = (g, st.var[links].astype(np.intp), size,
                                  np.cumsum(size) - size)
    return out


def _padding_border(st, padding, done):
    """The variables of the forced groups _cancel_forced took the fill off (``done``)
    that another factor shares with real variables (not ``padding``): a padded row's
    variables in a real column. Held at 0, they keep the padding apart from the real
    part, whose answer is then the unpadded one (with them free, the padded rows,
    forced on with tied scores, would take mass from the real columns' slack)."""
    border = np.zeros(st.V, bool)
    if not done.any():
        return border
    L = st.L
    var, tied = st.var[:L], st.tied[:L]
    real = np.zeros(st.F, bool)
    links = np.flatnonzero(tied)
    real[np.unique(st.factor_of[links[~padding[var[links]]]])] = True
    own = np.zeros(L, bool)
    own[st.group >= 0] = done[st.group[st.group >= 0]]
    mine = np.zeros(st.V, bool)
    mine[var[own]] = True                  # variables of the cancelled groups
    cand = tied & ~own & real[st.factor_of] & mine[np.maximum(var, 0)]
    border[var[cand]] = True
    return border


def _masks_hold(engine, eu, soft):
    """Whether variables fixed at 0 for a huge negative (finite) score are 0 at the solution
    of (P) with that score: the certified multipliers, changed on the variable's links so
    that they sum to eta_i (plain links share it; a variable with negated links only
    moves those), still make every factor's support optimal. The links of a fixed
    variable have no stationarity condition, so any sum certifies the masked problem;
    this checks the one the score asks for. Polished results only."""
    if not engine.polished:
        return False
    st = engine.structure
    a = engine._arrays
    L, V = st.L, st.V
    var, tied, lmask = st.var[:L], st.tied[:L], a["lmask"][:L] != 0
    nu = np.array(a["cmu"][:L])                     # normalised units
    sel = tied & soft[np.maximum(var, 0)]
    plain, negd = sel & lmask, sel & ~lmask
    target = np.where(soft, eu, 0.0)[:V] / engine.scale
    sneg = np.bincount(var[negd], weights=nu[negd], minlength=V)
    n_plain = np.bincount(var[plain], minlength=V)
    n_neg = np.bincount(var[negd], minlength=V)
    # sum_j sigma_j nu_j = target: sigma = 1 on plain links, -1 on negated ones
    vp = var[plain]
    nu[plain] = (target[vp] + sneg[vp]) / n_plain[vp]
    only = negd & (n_plain[np.maximum(var, 0)] == 0)
    vn = var[only]
    nu[only] += (-target[vn] - sneg[vn]) / n_neg[vn]
    touched = np.zeros(st.F, dtype=np.int8)
    touched[np.unique(st.factor_of[sel])] = 1
    return engine.verify(np.ascontiguousarray(nu), touched) < 0


def _conflicting(engine):
    """The factors an infeasibility involves: the one with no allowed structure, or those
    the Farkas certificate puts weight on."""
    if engine.infeasible_factor >= 0:
        return [int(engine.infeasible_factor)]
    if engine.counted is not None:
        return sorted(int(f) for f in np.concatenate(engine.counted[:2]))
    cert = engine.certificate()
    off = engine._arrays["uoff"]
    size = [float(np.abs(np.where(np.isfinite(cert[off[g]:off[g + 1]]),
                                  cert[off[g]:off[g + 1]], 0.0)).max(initial=0.0))
            for g in range(engine.F)]
    top = max(size + [0.0])
    return [g for g in range(engine.F) if size[g] > 1e-6 * top]


def _conflict_message(graph, engine, where):
    """The ValueError message of an infeasible graph, naming the factors in conflict."""
    masked = bool(np.any(engine._arrays["fix"]))
    f = engine.infeasible_factor
    if f >= 0:
        factor = graph.factors[f]
        var = graph.variables[f].reshape(-1)
        fixed = np.flatnonzero(engine._arrays["fix"][:graph.n_variables])
        hit = np.intersect1d(var[var >= 0], fixed)
        return (f"{where}FactorGraph.solve: infeasible: every structure of factor {f} "
                f"({factor!r}) uses a masked part: variables {_short_list(hit)} are fixed "
                f"at 0 by their -inf scores, and the factor needs one of them on")
    how = " (with the variables whose score is -inf fixed at 0)" if masked else ""
    if engine.counted is not None:
        X, Y, need, room = engine.counted
        why = (f"factors {_factor_groups(graph, X)} need at least {need:g} of their "
               f"variables on, and factors {_factor_groups(graph, Y)}, over the same "
               f"variables, allow at most {room:g}")
    else:
        why = (f"factors {_factor_groups(graph, _conflicting(engine))} conflict (an LP "
               f"certificate: multipliers on their parts under which every point of their "
               f"constraints would score below zero)")
    return (f"{where}FactorGraph.solve: infeasible: no assignment of the variables satisfies "
            f"every factor{how}; {why}")


def _padding_message(graph, engine, border):
    """Why the padding could not be kept apart from the real part (engine: the solve
    with the border held at 0, infeasible)."""
    return (f"FactorGraph.solve: the padding could not be solved apart from the real "
            f"scores: factors whose variables all carry a padding fill (scores below -1e6 "
            f"times the others) force some of them on, and with the padded variables that "
            f"they share with factors over real scores (variables "
            f"{_short_list(np.flatnonzero(border))}) held at 0, no point satisfies factors "
            f"{_factor_groups(graph, _conflicting(engine))}. The padding uses those "
            f"variables, so the answer on the real scores is not the unpadded one. Pad so "
            f"that the padding can satisfy its own factors (a padded Xor row needs a padded "
            f"column it can use), or leave the padded factors out of the graph")


def _short_list(xs, k=8):
    xs = [int(x) for x in xs]
    return ", ".join(map(str, xs[:k])) + (f", ... ({len(xs)} in all)" if len(xs) > k else "")


def _factor_groups(graph, idx):
    """'0-4 (XorFactor(3)) and 5-7 (AtMostOneFactor(5))': runs of factors by repr."""
    groups = []             # [first, last, repr]
    for f in idx:
        r = repr(graph.factors[f])
        if groups and groups[len(groups) - 1][2] == r and groups[len(groups) - 1][1] == f - 1:
            groups[len(groups) - 1][1] = f
        else:
            groups.append([f, f, r])
    parts = [(f"{a}" if a == b else f"{a}-{b}") + f" ({r})" for a, b, r in groups]
    if len(parts) > 6:
        parts = parts[:6] + [f"... ({len(idx)} factors in all)"]
    n = len(parts)
    return ", ".join(parts[:n - 1]) + (" and " if n > 1 else "") + parts[n - 1]


def _raise_unless_solved(result, where, element=None):
    """The result of a solve, or the error that says why there is none: ValueError for an
    infeasible graph, ConvergenceError for a solve that stopped without a certified
    point (``where`` names the batch element ``element``). The ValueError carries
    ``factors`` (the conflicting factors' indices), ``masked`` (whether masks took part)
    and ``batch_element``."""
    if result._status == ENGINE_INFEASIBLE:
        exc = ValueError(_conflict_message(result._graph, result._engine, where))
        exc.factors = _conflicting(result._engine)
        exc.masked = bool(np.any(result._engine._arrays["fix"]))
        exc.batch_element = element
        raise exc
    if not result.converged:
        raise ConvergenceError(
            f"{where}FactorGraph.solve: no certified solution after {result.n_iter} ADMM "
            f"iterations (primal residual {result.primal_residual:.3g}, dual residual "
            f"{result.dual_residual:.3g}); the last iterate is not returned because it "
            f"may violate the constraints. Raise max_iter (it was {result._solve_args[0]}).")
    return result


class FactorGraphResult:
    """Outcome of :meth:`FactorGraph.solve`.

    Attributes
    ----------
    u : ndarray, shape ``(n_variables,)``
        Marginals of the variables, in ``[0, 1]`` exactly (round-off outside
        is clipped).
    v : list of ndarray
        Per factor, its additional marginals ``N_f p_f`` (shape ``factor.shape_v``).
    structures : list of list
        Per factor, its distribution's support: structures in the factor's
        compact form.
    weights : list of ndarray
        Per factor, their weights (positive, summing to one).
    converged : bool
        Whether a polished point was certified optimal, or both residuals
        reached ``tol`` (always True for a result that :meth:`FactorGraph.solve`
        returns: it raises otherwise).
    polished : bool
        Whether the returned point is the exact solution on the final
        supports, certified by the KKT conditions of the problem (every
        factor's weights nonnegative, and no structure of any factor better
        than its support at the multipliers): ``u`` is then exact up to
        round-off.
    n_iter : int
        ADMM iterations run.
    primal_residual : float
        ``max_{f, j} |l_fj(u) - (M_f p_f)_j|``: how far the factors' marginals
        are from the variables' (round-off when polished).
    dual_residual : float
        ``rho * max_i |u_i - u_i^{prev}|`` over the last ADMM iteration,
        relative to the scale of the scores (0 when polished: the certificate
        replaces it).
    objective : float
        ``1/2 ||u||^2 - eta_u . u - sum_f eta_v[f] . v[f]`` (a minimisation,
        as for :func:`solve`).
    rho : float
        The ADMM penalty used, relative to the scale of the scores.
    n_map : int
        MAP oracle calls, over all factors.
    scale : float
        ``max(1, max |scores|)`` over the variables in factors (masked ones
        excepted) and the additional scores: the engine solves the problem
        divided by it, and residuals are relative to it.
    n_inner_unconverged : int
        Factor steps whose SparseMAP solve stopped before its gap tolerance
        (0 in normal use).
    backward_info : dict or None
        After :meth:`jvp` or :meth:`vjp`: ``cg_iterations`` and
        ``relative_residual`` of the last backward solve.
    message : str

    Notes
    -----
    A result pickles with what its backward pass needs (each factor's final
    support and Cholesky factor), so one solved on a process pool or a Dask
    worker comes back with :meth:`jvp` and :meth:`vjp` exact, without a new
    solve.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> fg = sm.FactorGraph(3)
    >>> fg.add(sm.XorFactor(2), [0, 1])
    0
    >>> fg.add(sm.PairFactor(), [1, 2])
    1
    >>> r = fg.solve(np.array([0.2, 0.5, 0.9]), [None, np.array([0.5])])
    >>> r.converged, r.polished
    (True, True)
    >>> print(np.round(r.u, 6))
    [0.1 0.9 0.9]
    >>> print(r.v[1], [s.tolist() for s in r.structures[1]], r.weights[1])
    [0.9] [[1, 1], [0, 0]] [0.9 0.1]
    >>> g_eta_u, g_eta_v = r.vjp(np.array([0.0, 0.0, 1.0]))
    >>> print(np.round(g_eta_u, 6), np.round(g_eta_v[1], 6))
    [-0.333333  0.333333  0.333333] [0.333333]
    """

    def __init__(self, graph, engine, eta_u, eta_v):
        self._engine = engine
        self.factors = tuple(graph.factors)
        self.n_variables = graph.n_variables
        self.u = engine.u_array()
        self.converged = engine.status == ENGINE_CONVERGED
        self.n_iter = int(engine.n_iter)
        self.primal_residual = float(engine.res_primal)
        self.dual_residual = float(engine.res_dual)
        self.rho = float(engine.rho)
        self.scale = float(engine.scale)
        self.n_map = int(engine.n_map())
        self.n_inner_unconverged = int(engine.n_inner_fail)
        self.polished = bool(engine.polished)
        self.message = _MESSAGES[engine.status]
        self._status = engine.status
        self._parts = None
        self.backward_info = None
        # what untying ties in eta_v needs (_backward_engine)
        self._graph, self._eta, self._solve_args, self._bengine = graph, (eta_u, eta_v), None, None

    # v, structures, weights and objective are read off the engine on first use (a layer
    # that only wants u does not pay for them)
    def _read_parts(self):
        if self._parts is None:
            v, structures, weights = [], [], []
            for f, factor in enumerate(self.factors):
                vf, S, y = self._engine.factor_result(f)
                S, y = S[y > 0], y[y > 0]     # not the backward pass's weight-0 rows
                v.append(vf.reshape(factor.shape_v))
                structures.append([factor._to_public(x) for x in S])
                weights.append(y)
            self._parts = (v, structures, weights)
        return self._parts

    @property
    def v(self):
        return self._read_parts()[0]

    @property
    def structures(self):
        return self._read_parts()[1]

    @property
    def weights(self):
        return self._read_parts()[2]

    @property
    def objective(self):
        eta_u, eta_v = self._eta
        on = self.u != 0              # a masked (-inf) variable is 0 and adds nothing
        with np.errstate(over="ignore"):  # scores near the dtype's maximum
            return float(0.5 * self.u @ self.u - eta_u[on] @ self.u[on]
                         - sum(float(e @ v.reshape(-1)) for e, v in zip(eta_v, self.v)))

    def __repr__(self):
        return (f"FactorGraphResult(converged={self.converged}, n_iter={self.n_iter}, "
                f"primal_residual={self.primal_residual:.3g}, "
                f"dual_residual={self.dual_residual:.3g}, objective={self.objective:.10g})")

    # -- ties in eta_v: as for a single factor (docs/solvers.rst, "Ties in eta_v") -----------
    def _backward_engine(self):
        """The engine whose faces the backward pass uses: the solve's, unless a factor's
        final face is fibered (n not affine in m on it: a sequence at tied transition
        scores); then a solve's at eta_v + delta r (r: each factor's tie_direction), the
        Jacobian of the piece u follows from eta along (0, r). Polished results only:
        the check needs certified multipliers."""
        if self._bengine is None:
            engine = self._engine
            if self.polished and self._solve_args is not None and self._fibered():
                engine = self._untie()
            if engine.polished:
                self._check_faces(engine)
            self._bengine = engine
        return self._bengine

    def _check_faces(self, engine):
        """Complete every factor's support on engine to span the smallest face of its
        polytope that holds the factor's point (_Engine.complete_faces): the faces the
        Jacobian keeps. For a factor whose family's description is not known completely
        (_linear_rows) the completed face may be larger than the smallest one; where
        completing such factors changes the Jacobian (on one random direction), central
        differences along that direction choose between the completed faces and the
        supports alone, and a warning says when neither agrees."""
        faces = engine.structure.faces()
        partial = not faces.complete.all()
        rows = [engine.face_rows(f) for f in range(len(self.factors))] if partial else None
        probe = np.random.default_rng(0).standard_normal(self.n_variables)
        before = engine.project(probe)[0] if partial and self._solve_args is not None \
            else None
        added, status = engine.complete_faces(faces, FACE_BUDGET_CALLS)
        unsure = [int(f) for f in np.flatnonzero((status != FACE_CERTIFIED)
                                                 | ((added > 0) & ~faces.complete))]
        if not unsure or before is None:
            return
        after = engine.project(probe)[0]
        atol = FACE_CHECK_TOL * max(1.0, float(np.abs(after).max()), float(np.abs(before).max()))
        if np.abs(after - before).max() <= atol:
            return
        eu, ev = self._eta
        max_iter, tol, rho, polish = self._solve_args
        scale = max([1.0, float(np.abs(eu[np.isfinite(eu)]).max(initial=0.0))]
                    + [float(np.abs(e).max(initial=0.0)) for e in ev])
        evs = [None if not f.n_v else e.reshape(f.shape_v) for f, e in zip(self.factors, ev)]
        for h in (1e-5 * scale, 1e-7 * scale):
            try:
                up = self._graph._solve_quiet(eu + h * probe, evs, max_iter, tol, rho, polish,
                                              whole=False)
                dn = self._graph._solve_quiet(eu - h * probe, evs, max_iter, tol, rho, polish,
                                              whole=False)
            except ValueError:
                break
            if not (up.polished and dn.polished):
                continue
            fd = (up._engine.u_raw() - dn._engine.u_raw()) / (2 * h)
            deg = np.asarray(engine._arrays["deg"][:self.n_variables]) > 0
            if np.abs(after - fd)[deg].max(initial=0.0) <= 1e3 * atol:
                return
            if np.abs(before - fd)[deg].max(initial=0.0) <= 1e3 * atol:
                for f in unsure:
                    engine.truncate_face(f, rows[f])
                return
        warn("FactorGraphResult: the backward pass could not be checked at this point: "
             f"factors {_short_list(unsure)} lie on a degenerate face of their polytopes "
             f"whose smallest face their family does not describe, and central differences "
             f"agree with neither candidate Jacobian; jvp/vjp may not be the derivative")

    def _fibered(self):
        """Whether some factor's final face is fibered: its face completed and checked as
        a single factor's (two MAP calls, see sparsemap._active_set._fibered)."""
        for f, factor in enumerate(self.factors):
            if factor.n_v == 0:
                continue
            nu, ev = self._engine.factor_face(f)
            _, S, y = self._engine.factor_result(f)
            # as SparseMAP scores of the factor alone, eta_u - M y = nu
            face = reduce_support(factor, S, y, nu + self._engine.factor_u(f), ev, 0.0,
                                  DEFAULT_MAX_ITER, untie=False)[4]
            if face == FACE_STATUS_FIBERED:
                return True
        return False

    def _untie(self):
        """The engine of a solve at eta_v + delta r whose faces are the piece along (0, r).

        delta starts at UNTIE_DELTA of the scores' scale and shrinks by 8 until two
        successive solves (delta and delta / 8) are both polished, agree on the Jacobian
        (jvp of two random directions) and on the slope (u(t) - u) / t = J (0, r), and
        every factor's final face at delta / 8 ties at eta (lies in the solve's face).
        Unlike a single factor's (_active_set._untie) this is not a proof that the piece
        is the one adjacent to eta; it is a check, done after at most UNTIE_TRIES solves
        (else the solve's faces are kept, with a warning).
        """
        max_iter, tol, rho, polish = self._solve_args
        eu, ev = self._eta
        rs = [tie_direction(f) if f.n_v else np.zeros(0) for f in self.factors]
        scale = max([1.0, float(np.abs(eu).max(initial=0.0))]
                    + [float(np.abs(e).max(initial=0.0)) for e in ev])
        rng = np.random.default_rng(0)
        probes = [(rng.standard_normal(self.n_variables),
                   [rng.standard_normal(f.n_v) if f.n_v else None for f in self.factors])
                  for _ in range(2)]
        faces = [self._engine.factor_face(f) if factor.n_v else None
                 for f, factor in enumerate(self.factors)]
        u0 = self._engine.u_raw()
        delta = UNTIE_DELTA * scale
        prev = None
        for _ in range(UNTIE_TRIES):
            res = self._graph._solve_quiet(
                eu, [(e + delta * r).reshape(f.shape_v) if f.n_v else None
                     for e, r, f in zip(ev, rs, self.factors)], max_iter, tol, rho, polish,
                whole=False)
            if not res.polished:
                break
            jac = [res._engine.project(res._direction(res._engine, du, dv))[0]
                   for du, dv in probes]
            slope = (res._engine.u_raw() - u0) / delta
            along = res._direction(res._engine, np.zeros(self.n_variables), rs)
            ok = np.allclose(res._engine.project(along)[0], slope,
                             rtol=0, atol=1e-6 * max(1.0, float(np.abs(slope).max())))
            ok = ok and prev is not None and all(
                np.allclose(a, b, rtol=0, atol=1e-9 * max(1.0, float(np.abs(b).max())))
                for a, b in zip(jac, prev))
            for f, factor in enumerate(self.factors):
                if not ok or faces[f] is None:
                    continue
                nu, fv = faces[f]
                top = max(factor.score(s, nu.reshape(factor.shape_u), fv.reshape(factor.shape_v))
                          for s in self.structures[f])
                ok = all(factor.score(s, nu.reshape(factor.shape_u), fv.reshape(factor.shape_v))
                         >= top - 1e-9 * scale for s in res.structures[f])
            if ok:
                return res._engine
            prev = jac
            delta /= 8
        warn("FactorGraphResult: ties in eta_v could not be broken (a solve at "
             "eta_v + delta r was not polished, or did not settle on one piece); jvp/vjp "
             "use the solve's faces, whose eta_v part may not be a derivative")
        return self._engine

    def _direction(self, engine, d, dv):
        """``d + sum_f C~_f^T M_S D N_S^T dv[f]`` on engine's faces: what jvp projects."""
        w = np.array(d, dtype=np.float64)
        for f, e in enumerate(dv):
            if e is not None and self.factors[f].n_v:
                engine.add_eta_v_direction(f, np.ascontiguousarray(e, dtype=np.float64).ravel(),
                                           w)
        return w

    def _project(self, g):
        y, n_cg, res = self._backward_engine().project(g)
        self.backward_info = {"cg_iterations": int(n_cg), "relative_residual": float(res)}
        if res > 1e-10:
            warn(f"FactorGraphResult: the backward conjugate gradient stopped at a "
                 f"relative residual of {res:.3g} after {n_cg} iterations")
        return y

    def value(self, x):
        """The marginals of a VariableArray (``1 - u`` where negated), shaped like it.

        Examples
        --------
        >>> import numpy as np, sparsemap as sm
        >>> fg = sm.FactorGraph()
        >>> x = fg.add_variables(3)
        >>> _ = fg.add(sm.XorFactor(3), x)
        >>> fg.solve({x: [1.0, 0.5, -1.0]}).value(x[:2])
        array([0.75, 0.25])
        """
        return _variables.read(self.u, x)

    def jvp(self, d_eta_u, d_eta_v=None):
        """Jacobian of ``u`` with respect to ``(eta_u, eta_v)`` applied to a direction.

        Parameters
        ----------
        d_eta_u : array_like, shape ``(n_variables,)``
        d_eta_v : list, optional
            One entry per factor (shape ``factor.shape_v``) or None (zeros).

        Returns
        -------
        du : ndarray, shape ``(n_variables,)``

        Notes
        -----
        ``du = Proj_S(d_eta_u + sum_f sigma_f C_f^T J_f^v d_eta_v[f])``, where
        ``Proj_S`` projects onto the directions that keep every factor on its
        final face and ``J_f^v`` is the single-factor Jacobian with respect to
        the additional scores (see :doc:`/lp_sparsemap`). Variables in
        no factor get ``d_eta_u[i] * 1[0 < eta_u[i] < 1]``.
        """
        d = _as_float_array(d_eta_u, "d_eta_u", (self.n_variables,))
        dv = _check_per_factor(self.factors, d_eta_v, "d_eta_v", zeros=False)
        return self._project(self._direction(self._backward_engine(), d, dv))

    def vjp(self, du):
        """Transpose Jacobian product, for backpropagation.

        Parameters
        ----------
        du : array_like, shape ``(n_variables,)``
            Gradient of a downstream loss with respect to ``u``.

        Returns
        -------
        g_eta_u : ndarray, shape ``(n_variables,)``
        g_eta_v : list of ndarray
            Per factor, the gradient with respect to its ``eta_v``
            (shape ``factor.shape_v``; empty for factors without).

        Notes
        -----
        ``g_eta_u = y = Proj_S(du)``, computed exactly by conjugate gradient
        (stopped when ``y``'s distance from ``S`` is ``1e-13 ||du||``; see
        ``backward_info``), and ``g_eta_v[f] = N_S delta_f`` with
        ``delta_f`` the single-factor backward of ``sigma_f C_f y`` at the final
        support (see :doc:`/lp_sparsemap`).
        """
        g = _as_float_array(du, "du", (self.n_variables,))
        y = self._project(g)
        gv = []
        for f, factor in enumerate(self.factors):
            if factor.n_v:
                gv.append(self._backward_engine().eta_v_gradient(f, y).reshape(factor.shape_v))
            else:
                gv.append(np.zeros(factor.shape_v))
        return y, gv


# -- known polytopes solved whole ----------------------------------------------------------
# A graph that is exactly one factor's polytope is solved as that factor (recognised once
# per graph structure, _Structure.whole; see sparsemap._fg_whole). _WholeResult maps u, v,
# the support and the Jacobian products back.

def _solve_whole(graph, whole, eu, ev, fixed=None, soft=None):
    """The graph's result from its single factor's solve, or None when that solve did not
    certify an answer (the graph's own path then runs, and gives its own errors).
    ``fixed``, ``soft``: as in :func:`sparsemap._fg_whole.solve_whole`."""
    solved = _fg_whole.solve_whole(whole, eu, ev, DEFAULT_MAX_ITER, fixed, soft)
    if solved is None:
        return None
    single, eta_u = solved
    return _WholeResult(graph, whole, single, eta_u, ev)


class _WholeResult(FactorGraphResult):
    """A FactorGraphResult from the single factor the graph is (see sparsemap._fg_whole)."""

    # the same for every such result (a certified answer, no ADMM): class attributes, so
    # that a solve sets only what it found
    converged = polished = True
    primal_residual = dual_residual = 0.0
    rho = float("nan")
    n_inner_unconverged = 0
    _status = ENGINE_CONVERGED
    _engine = _parts = backward_info = _solve_args = _bengine = None

    def __init__(self, graph, whole, single, eta_u, eta_v):
        self._whole, self._single = whole, single
        self.factors = tuple(graph.factors)
        self.n_variables = graph.n_variables
        # round-off outside [0, 1] clipped, in a new array (single.u stays the factor's)
        u = whole.to_graph(np.maximum(single.u, 0.0), graph.n_variables)
        np.minimum(u, 1.0, out=u)
        self.u = u
        self.n_iter = int(single.n_iter)
        self.n_map = int(getattr(single, "n_map", 0) or 0)
        self._graph, self._eta = graph, (eta_u, eta_v)

    @property
    def message(self):
        return (f"converged: solved as {self._whole.factor!r} (the graph is exactly its "
                f"polytope), certified by its duality gap {float(self._single.gap):.2g}")

    @property
    def scale(self):
        eta_u, eta_v = self._eta
        return max([1.0, float(np.abs(eta_u[np.isfinite(eta_u)]).max(initial=0.0))]
                   + [float(np.abs(e).max(initial=0.0)) for e in eta_v])

    def _read_parts(self):
        if self._parts is None:
            w, r = self._whole, self._single
            if w.kind == "itself":
                f = self.factors[0]
                self._parts = ([np.asarray(r.v).reshape(f.shape_v)], [list(r.structures)],
                               [np.asarray(r.weights)])
            else:
                self._parts = self._logic_parts()
        return self._parts

    def _logic_parts(self):
        """Per Xor / AtMostOne / Pair factor, its distribution: unique given its marginals
        (their polytopes are simplices)."""
        v, S, W = [], [], []
        for f, factor in enumerate(self.factors):
            x = self.u[np.asarray(self._graph.variables[f]).reshape(-1)]
            if type(factor) is PairFactor:
                both = float(np.asarray(self._single.v)[self._whole.links[f], 1, 1])
                cand = [((1, 1), both), ((1, 0), x[0] - both), ((0, 1), x[1] - both),
                        ((0, 0), 1.0 - x[0] - x[1] + both)]
                v.append(np.array([both]))
                S.append([np.array(s, dtype=np.intc) for s, p in cand if p > 0])
                W.append(np.array([p for s, p in cand if p > 0]))
                continue
            on = np.flatnonzero(x > 0)
            structs = [np.eye(x.size, dtype=np.intc)[j] for j in on]
            weights = list(x[on])
            rest = 1.0 - float(x.sum())
            if type(factor) is AtMostOneFactor and rest > 0:
                structs.append(np.zeros(x.size, dtype=np.intc))
                weights.append(rest)
            v.append(np.zeros(factor.shape_v))
            S.append(structs)
            W.append(np.array(weights) / sum(weights))
        return v, S, W

    def _backward_engine(self):
        """What the backward pass uses: the single factor's result (which completes its
        face and unties ties in eta_v itself), not an engine of the graph."""
        return self._single

    def jvp(self, d_eta_u, d_eta_v=None):
        d = _as_float_array(d_eta_u, "d_eta_u", (self.n_variables,))
        dv = _check_per_factor(self.factors, d_eta_v, "d_eta_v", zeros=True)
        du, dvs = self._whole.scores(d, dv)
        self.backward_info = {"cg_iterations": 0, "relative_residual": 0.0}
        return self._whole.to_graph(self._single.jvp(du, dvs), self.n_variables)

    def vjp(self, du):
        g = _as_float_array(du, "du", (self.n_variables,))
        out_u, out_v = self._single.vjp(self._whole.scores_u(g))
        self.backward_info = {"cg_iterations": 0, "relative_residual": 0.0}
        gv = self._whole.eta_v_list(out_v, self.factors) if out_v is not None and \
            np.size(out_v) else [_zeros_v(f) for f in self.factors]
        return self._whole.to_graph(out_u, self.n_variables), gv
