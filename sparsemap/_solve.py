"""``solve`` and ``solve_batch``: the entry points to every SparseMAP solver, and the result type.

Both run through one path: validated scores go to
``_batch.prepare_solve``, which takes every pointer and makes every
Python object of a batch in one pass; threads (the caller's included) then
claim problems from an atomic counter (largest first when several threads
share a batch of factors of different sizes; the caller starts alone, from
the cheap end, see ``_run_batch``) and solve them without the GIL, leaving
each outcome in C buffers. ``vjp_batch`` and ``jvp_batch`` run
``_batch.prepare_backward`` the same way.

Result types. This module produces :class:`SparseMAPResult`, the one users
see: it wraps a ``_backward._Solution`` (one solve's C record, ``_Sol``, with
its owner) and converts fields to NumPy on first access. The padded path of
the torch layer (``_solve_padded``) returns a ``_backward._Solutions`` instead:
one C array of records for the whole batch, with no Python object per
problem, which is why the two exist. The facet solvers' own
``_facet.FacetSolution`` is for their tests; solves here keep the facet state
inside the record.
"""
import math
import numbers
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from sparsemap import _batch
from sparsemap._active_set import (STATUS_CONVERGED, STATUS_FACE_INCOMPLETE, STATUS_INFEASIBLE,
                                   STATUS_MAX_ITER, STATUS_STALLED, STATUS_STOPPED)
from sparsemap._backward import (FACE_STATUS_BUDGET, FACE_STATUS_FIBERED,
                                 FALLBACK_STATUS_BUDGET, FALLBACK_STATUS_DECLINED,
                                 FALLBACK_STATUS_GAP, FALLBACK_STATUS_NONE, _Solutions,
                                 max_backward_rows, reduce_support, solution_from_arrays)
from sparsemap._cg import conditional_gradient
from sparsemap._exceptions import warn
from sparsemap._facet import facet_solver
from sparsemap._factors._base import (SCAN_BAD, Factor, _NoAllowedStructure, _real_array,
                                     check_real, scan_values)
from sparsemap._factors._generic import OracleFactor
from sparsemap._factors._logic import SequenceBudgetFactor
from sparsemap._factors._sequence import SequenceFactor

METHODS = ("auto", "vertex", "facet", "active_set", "cg", "away_cg", "pairwise_cg", "bpcg")
# The exact solvers, and the side each runs on (docs/solvers.rst, "Two
# representations"): "auto" (the default) chooses per problem; the others force one
# side. "active_set" names the paper's algorithm, the vertex side.
_SIDES = {"auto": "auto", "vertex": "vertex", "facet": "facet", "active_set": "vertex"}
# The exact methods, as error messages name them.
_EXACT = "'auto', 'vertex', 'facet' or 'active_set'"
# Until 0.1.0, method="active_set" was the default and chose the side per problem; it
# now names the vertex side, so code that passed it explicitly runs another solver.
# The warning says so for one release (it goes in 0.2.0), pointing at the caller.
_ACTIVE_SET_CHANGED = (
    "method='active_set' now runs the vertex side (the paper's active set, as "
    "method='vertex'); before sparsemap 0.1.0 it chose the cheaper side per problem, which "
    "is now method='auto', the default. Pass method='auto' for the old behaviour, or "
    "method='vertex' to keep this one without this warning (it goes in 0.2.0).")
DEFAULT_TOL = 1e-12
DEFAULT_MAX_ITER = 10_000

_MESSAGES = {
    STATUS_CONVERGED: "converged",
    STATUS_MAX_ITER: "maximum number of iterations reached",
    STATUS_STALLED: "stalled: no further progress in double precision "
                    "(round-off floor or degenerate cycling)",
    STATUS_STOPPED: "stopped by the callback",
    STATUS_FACE_INCOMPLETE: "u converged, but max_iter ran out before the MAP calls certified "
                            "that the backward set spans the optimal face (jvp/vjp may be "
                            "inexact); raise max_iter",
}
_AT_CAP = ("u converged, but the backward set reached its cap of {} structures "
           "before it spanned the optimal face: jvp/vjp project onto the directions of a "
           "subface (the span of those structures) and are not the Jacobian (u, and the "
           "SparseMAP loss with its gradient, are exact). max_iter and tol "
           "do not change this. The face is this large at nearly flat scores on long inputs "
           "(projective trees at scale 0.01 beyond the 120 words measured); scores of a "
           "larger spread, shorter inputs, or a factor with a facet "
           "side (non-projective trees, sequences, matchings, with method='auto'), "
           "avoid it (solvers page: 'Projective trees at flat scores')")


# Why a problem that method="facet" offered to the facet side was solved on the vertex
# side, from the facet solver's status (_Solution.fallback). The solvers report every
# decline with one status, so a decline is told apart only by whether it had spent
# its iteration budget.
_FALLBACK_NAMES = ("none", "declined", "budget", "gap")   # by FALLBACK_STATUS_* (0 to 3)
_FALLBACK_MESSAGES = {
    FALLBACK_STATUS_DECLINED: "the facet solver declined after {it} iterations (a limit "
                              "of its own, such as pieces projected past max_iter, masks "
                              "it cannot handle, or a failed check: see the solvers page, "
                              "'When the facet side declines')",
    FALLBACK_STATUS_BUDGET: "the facet solver spent its budget of {it} iterations "
                            "(max_iter) and declined",
    FALLBACK_STATUS_GAP: "the facet solver's answer missed the tolerance (duality gap "
                         "{gap:.3g} after {it} iterations)",
}


def _fallback_message(sol):
    """Why the facet side did not return sol's problem, or None where it was not offered
    it or solved it."""
    code, it, gap = sol.fallback
    if code == FALLBACK_STATUS_NONE or sol.side == "facet":
        return None
    return _FALLBACK_MESSAGES[code].format(it=it, gap=gap) + ", so the vertex side solved it"


def _face_message(sol):
    """Why a converged solve's backward set was not certified: the cap or max_iter."""
    cap = max_backward_rows()
    if sol.n_backward + 1 >= cap:
        return _AT_CAP.format(cap)
    return _MESSAGES[STATUS_FACE_INCOMPLETE]

# Tasks per job when a batch goes to an executor: enough to balance problems
# of unequal cost, few enough that pickling stays cheap.
CHUNKS_PER_JOB = 4


class SparseMAPResult:
    """Outcome of :func:`solve` (one per problem for :func:`solve_batch`).

    Fields are converted from the solver's buffers on first access, so a
    result that is only differentiated never builds its list of structures.

    Attributes
    ----------
    u : ndarray, shape ``factor.shape_u``
        SparseMAP posterior ``M y*``.
    v : ndarray, shape ``factor.shape_v``
        ``N y*`` (empty when the factor has no ``eta_v``).
    structures : list
        The support: structures in the factor's compact form, by decreasing
        weight, as one reads a distribution. Weights equal to 12 decimals
        are ties, kept in the solver's order (which starts with the MAP
        structure of a cold start). On the facet side, a decomposition of
        ``(u, v)`` into at most ``dim + 1`` structures, computed on first
        access (see the solvers page for its cost) and kept.
    weights : ndarray
        Their weights ``y*`` (positive, summing to one), in the same order.
    side : str
        Which representation solved the problem: ``"vertex"`` (structures,
        the active set of the paper) or ``"facet"`` (the constraints tight at
        ``u``); see the solvers page, "Two representations". ``method`` says
        what was asked, ``side`` what ran.
    n_iter : int
        Iterations run.
    n_map : int
        Calls to the MAP oracle.
    converged : bool
        Whether ``gap <= tol * gap_scale`` (see :func:`solve`): ``u`` is then
        exact. It stays True when only the backward pass is uncertain (the
        backward set could not be certified to span the optimal face, see the
        solvers page): :func:`solve` then warns and ``message`` says why.
    gap : float
        Wolfe duality gap of the returned point, an upper bound on
        ``objective - min objective``. Always computed at return.
    objective : float
        ``1/2 ||u||^2 - eta_u . u - eta_v . v`` (eq. 6 as a minimisation).
    history : dict of ndarray or None
        With ``return_history=True``: per iteration ``"objective"``, ``"gap"``,
        ``"support_size"`` and ``"seconds"`` (elapsed since the start).
    method : str
        The method asked for (``"auto"`` by default; see :func:`solve`).
    message : str
        Why the solver stopped; with ``method="facet"``, also why the problem
        went to the vertex side when it did.
    factor : Factor

    Notes
    -----
    The backward pass (:meth:`jvp`, :meth:`vjp`) runs on the side that
    solved the problem. On the vertex side it works on the support in the
    solver's own order, completed with weight-0 structures until its affine
    hull spans the optimal face (every structure tied at ``eta - u``), with
    the Cholesky factor the solver kept; the order of ``structures`` does not
    affect it. On the facet side it projects onto the null space of the
    constraints tight at ``u``. Where the face is larger than the support
    (flat scores), ``structures`` and ``weights`` are one of many optimal
    distributions. Results pickle (for process pools).

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> r = sm.solve(sm.GenericFactor(np.eye(3)), [0.2, 1.0, 0.5])
    >>> r.structures, r.weights
    ([1, 2], array([0.75, 0.25]))
    """

    def __init__(self, factor, solution, method, eta=None, per_position=False,
                 shared_v=False):
        self.factor = factor
        self.method = method
        self._sol = solution
        # eta_v was one (S, S) transition matrix shared by the positions: g_eta_v of vjp
        # is its gradient (summed over the positions), and jvp takes an (S, S) d_eta_v
        self._shared_v = bool(shared_v)
        # solved without eta_v (a sequence): the eta_u part of the Jacobian is per-position
        # sparsemax's (see _per_position)
        self._per_position = bool(per_position)
        # CG keeps no Cholesky factor, and a face where n is not affine in m is
        # untied when first differentiated: the backward pass then reduces the
        # support once, which needs the scores.
        lazy = solution.side == "vertex" and (not solution.has_cholesky
                                              or solution.face_status == FACE_STATUS_FIBERED)
        self._eta = eta if lazy else None
        self._backward = None if lazy else solution
        self._u = self._v = self._order = self._weights = self._structures = None
        self._history = self._support_arrays = None

    @property
    def u(self):
        """SparseMAP posterior ``M y*``, shaped like ``eta_u``."""
        if self._u is None:
            self._u = self._sol.u_array().reshape(self.factor.shape_u)
        return self._u

    @property
    def v(self):
        """``N y*``, shaped like ``eta_v``."""
        if self._v is None:
            self._v = self._sol.v_array().reshape(self.factor.shape_v)
        return self._v

    @property
    def side(self):
        """``"vertex"`` or ``"facet"``: the representation that solved the problem."""
        return self._sol.side

    def _support(self):
        """The support as (structures, weights) arrays, solver's order; on the facet
        side a decomposition of (u, v), computed once."""
        if self._support_arrays is None:
            if self._sol.side == "facet":
                S, y = self._sol.facet_solver.decompose(self.u, self.v)
                # round-off weights are not support: their structures need not lie in the
                # optimal face
                keep = y > 1e-14 * y.max()
                self._support_arrays = (S[keep], y[keep] / y[keep].sum())
            else:
                self._support_arrays = (self._sol.structures_array(),
                                        self._sol.weights_array())
        return self._support_arrays

    def _by_weight(self):
        if self._order is None:
            y = self._support()[1]
            # weights equal to 12 decimals are ties (round-off makes exact ties
            # rare), and ties keep the solver's order, which starts at the MAP
            self._order = np.argsort(-np.round(y, 12), kind="stable")
            self._weights = y[self._order]
        return self._order

    @property
    def weights(self):
        """Weights of the support, by decreasing weight."""
        self._by_weight()
        return self._weights

    @property
    def structures(self):
        """The support, in the factor's compact form, by decreasing weight."""
        if self._structures is None:
            S = self._support()[0][self._by_weight()]
            self._structures = [self.factor._to_public(s) for s in S]
        return self._structures

    @property
    def n_iter(self):
        """Iterations run."""
        return self._sol.n_iter

    @property
    def n_map(self):
        """Calls to the MAP oracle."""
        return self._sol.n_map

    @property
    def converged(self):
        """Whether the gap met the tolerance (``u`` exact; see ``message`` for the backward
        set)."""
        return self._sol.status in (STATUS_CONVERGED, STATUS_FACE_INCOMPLETE)

    @property
    def gap(self):
        """Wolfe duality gap of the returned point."""
        return self._sol.gap

    @property
    def objective(self):
        """``1/2 ||u||^2 - eta_u . u - eta_v . v``."""
        return self._sol.objective

    @property
    def message(self):
        """Why the solver stopped; with ``method="facet"``, also why the vertex side
        solved the problem when it did."""
        if self._sol.status == STATUS_FACE_INCOMPLETE:
            text = _face_message(self._sol)
        else:
            text = _MESSAGES[self._sol.status]
        # with "auto", the vertex side is a choice, not a fallback: nothing to explain
        why = _fallback_message(self._sol) if self.method == "facet" else None
        return text if why is None else f"{text}; {why}"

    @property
    def history(self):
        """Per-iteration records (``return_history=True``), or None."""
        h = self._sol.history
        if h is not None and self._history is None:
            self._history = {"objective": h[:, 0].copy(), "gap": h[:, 1].copy(),
                             "support_size": h[:, 2].astype(int), "seconds": h[:, 3].copy()}
        return self._history

    def __repr__(self):
        # the facet side holds no support until asked (a decomposition costs a solve)
        support = f", support={self._sol.n_support}" if self._sol.side == "vertex" else ""
        return (f"SparseMAPResult(method={self.method!r}, side={self.side!r}, "
                f"converged={self.converged}, n_iter={self.n_iter}{support}, "
                f"gap={self.gap:.3g}, objective={self.objective:.10g})")

    def _backward_solution(self):
        if self._backward is None:
            # CG may end on an affinely dependent support: reduce it (same u), and
            # complete and untie its face (as an active-set solve does).
            eu, ev, max_iter = self._eta
            S, y, L, n_pos, face, b0 = reduce_support(
                self.factor, self._sol.structures_array(), self._sol.weights_array(), eu,
                np.zeros(self.factor.n_v) if ev is None else ev, max(self._sol.gap, 0.0),
                max_iter)
            self._backward = solution_from_arrays(self.factor, S, y, L, self._sol.u_array(),
                                                  self._sol.v_array(), 0, 0, 0, 0.0, 0.0,
                                                  None, n_pos, face, b0)
            if face == FACE_STATUS_BUDGET:
                warn(f"SparseMAP ({self.method}): {_face_message(self._backward)}.")
            elif face == FACE_STATUS_FIBERED:
                warn(f"SparseMAP ({self.method}): {_UNTIE_FAILED}")
        return self._backward

    def _backward_structures(self):
        """The backward set in compact public form, solver's order: the support, then
        the weight-0 structures completing it to span the optimal face (tests)."""
        S = self._backward_solution().structures_array(True)
        return [self.factor._to_public(s) for s in S]

    def jvp(self, d_eta_u, d_eta_v=None):
        """Jacobian of ``u`` with respect to ``(eta_u, eta_v)`` applied to a direction.

        Parameters
        ----------
        d_eta_u : array_like, shape ``factor.shape_u``
        d_eta_v : array_like, shape ``factor.shape_v``, optional (zeros)

        Returns
        -------
        du : ndarray, shape ``factor.shape_u``

        Notes
        -----
        The product runs on the side that solved the problem (:attr:`side`).
        On the vertex side, Proposition 1: ``du = M_I D A_I^T d_eta`` with
        ``D = Z - Z 1 1^T Z / (1^T Z 1)`` and ``Z = (M_I^T M_I)^{-1}`` on the
        backward set ``I`` (the support, completed to span the optimal face),
        from the kept Cholesky factor in ``O(|I| n + |I|^2)``. On the facet
        side (the default path for trees, sequences and matchings at flat
        scores), the projection of ``d_eta`` onto the null space of the
        constraints tight at ``u``, restricted to its positive coordinates,
        from the factorisation the facet solver kept. Either is the
        derivative wherever ``u`` is differentiable, at any score scale; at a
        kink, a one-sided derivative (an element of the generalized Jacobian,
        see the solvers page). On the facet side of trees and matchings, the
        null space is that of every constraint tight at ``u``, its multiplier
        zero or not: the derivative wherever ``u`` is differentiable, and at a
        kink the Jacobian at nearby scores where it is (the solvers page,
        "Derivatives at ties and kinks", proves both). At transition scores that tie (a sequence's
        ``eta_v`` passed as zeros) it is the limit of the Jacobians at
        ``eta_v + t r`` as ``t`` decreases to 0, ``r =``
        :func:`sparsemap.testing.tie_direction`. A :class:`SequenceFactor`
        solved with ``eta_v=None`` is per-position sparsemax: the ``eta_u``
        part is then sparsemax's Jacobian, position by position, and the
        ``d_eta_v`` part that one-sided limit.

        Examples
        --------
        >>> import numpy as np, sparsemap as sm
        >>> r = sm.solve(sm.GenericFactor(np.eye(3)), [0.2, 1.0, 0.5])
        >>> r.jvp([1.0, 0.0, 0.0])
        array([0., 0., 0.])
        >>> r.jvp([0.0, 1.0, 0.0])
        array([ 0. ,  0.5, -0.5])
        """
        if getattr(self, "_shared_v", False) and d_eta_v is not None:
            d_eta_v = _broadcast_shared(self.factor, d_eta_v, "d_eta_v")
        du, dv = _check_directions(self.factor, d_eta_u, d_eta_v, "d_eta_u", "d_eta_v")
        return _backward_batch([self], [du], None if dv is None else [dv], False, 1)[0]

    def vjp(self, du):
        """Transpose Jacobian product, for backpropagation.

        Parameters
        ----------
        du : array_like, shape ``factor.shape_u``
            Gradient of a downstream loss with respect to ``u``.

        Returns
        -------
        g_eta_u : ndarray, shape ``factor.shape_u``
        g_eta_v : ndarray, shape ``factor.shape_v``

        Notes
        -----
        The transpose of :meth:`jvp`'s matrix, with the same choices at ties:
        for a :class:`SequenceFactor` solved with ``eta_v=None``, ``g_eta_u``
        is per-position sparsemax's Jacobian applied to ``du``, and ``g_eta_v``
        the one-sided limit along :func:`sparsemap.testing.tie_direction`.
        """
        g = self.factor._check_array(du, "du", False, False)
        return _backward_batch([self], [g], None, True, 1)[0]


_UNTIE_FAILED = ("ties in eta_v could not be broken (no solve at eta_v + delta r was "
                 "certified to follow one piece); the eta_v part of jvp/vjp may not be a "
                 "derivative (u and the eta_u part are exact). A larger max_iter helps only "
                 "where those solves ran out of iterations (near-flat scores need many); "
                 "for a SequenceFactor the default method's facet side breaks these ties "
                 "exactly, with no such search.")


def _check_directions(factor, d_u, d_v, name_u, name_v):
    du = factor._check_array(d_u, name_u, False, False)
    dv = None if d_v is None or factor.n_v == 0 else factor._check_array(d_v, name_v, True, False)
    return du, dv


# -- validation ------------------------------------------------------------------------

def _check_factor(factor, name="factor"):
    if not isinstance(factor, Factor):
        raise ValueError(f"{name}: expected a sparsemap Factor, got {type(factor).__name__}")
    return factor


def _check_options(method, max_iter, tol):
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if method == "active_set":
        warn(_ACTIVE_SET_CHANGED, FutureWarning)
    if max_iter is None:
        max_iter = DEFAULT_MAX_ITER
    if type(max_iter) is not int:
        if isinstance(max_iter, bool) or not isinstance(max_iter, numbers.Integral):
            raise ValueError(f"max_iter: expected a positive integer, got {max_iter!r}")
        max_iter = int(max_iter)
    if max_iter < 1:
        raise ValueError(f"max_iter: expected a positive integer, got {max_iter!r}")
    tol = check_real(tol, "tol")
    return method, max_iter, tol


def _check_side(factor, method, where=""):
    if method == "facet" and facet_solver(factor) is None:
        raise ValueError(f"{where}method: 'facet' needs a factor with a facet side (a "
                         f"non-projective TreeFactor, a SequenceFactor or a MatchingFactor), "
                         f"got {factor!r}")


def _check_init(factor, init, name="init"):
    if init is None:
        return None
    if isinstance(init, SparseMAPResult):
        # Any valid structures make a correct warm start; validate them for this
        # factor. The solver's order, as the solve that found them inserted them.
        init = init._support()[0]
    try:
        seq = list(init)
    except TypeError:
        raise ValueError(f"{name}: expected a SparseMAPResult or a list of structures, got {init!r}")
    if len(seq) == 0:
        return None
    return factor.check_structures(seq, name)


def _names(factor, u, v, suffix=""):
    return f"{u}{suffix}" if factor.n_v == 0 else f"{u}{suffix}, {v}{suffix}"


# -- running problems ------------------------------------------------------------------

def _solve_problems(factors, etas_u, etas_v, inits, method, max_iter, tol, return_history,
                    n_threads=1, callback=None, backward=True):
    """Solutions of every problem (see ``_batch.prepare_solve`` for the arguments).

    The active set runs on ``n_threads`` threads, claiming problems largest
    first; the conditional-gradient solvers are pure Python, and run one
    problem after the other. Also the task an executor runs for a chunk of a
    batch (a module-level function, so it pickles).
    """
    n = len(etas_u)
    if method in _SIDES:
        n_threads = max(1, min(n_threads, n))
        if _SIDES[method] == "vertex":
            inits = _facet_starts(factors, etas_u, etas_v, inits, max_iter, tol, n_threads)
        return _run_batch(_batch.prepare_solve(factors, etas_u, etas_v, inits, max_iter, tol,
                                         return_history, n_threads, callback,
                                         side=_SIDES[method], backward=backward),
                    n_threads)
    out = []
    for i in range(n):
        f = factors if isinstance(factors, Factor) else factors[i]
        ev = None if etas_v is None else etas_v[i]
        try:
            raw = conditional_gradient(f, etas_u[i], np.zeros(f.n_v) if ev is None else ev,
                                       variant=method, max_iter=max_iter, tol=tol,
                                       return_history=return_history, callback=callback)
        except _NoAllowedStructure:
            out.append(solution_from_arrays(f, np.zeros((0, f.struct_size)), [], None,
                                            np.zeros(f.n_u), np.zeros(f.n_v), 0, 1,
                                            STATUS_INFEASIBLE, math.nan, math.nan))
            continue
        out.append(solution_from_arrays(f, raw["structures"], raw["weights"], None, raw["u"],
                                        raw["v"], raw["n_iter"], raw["n_map"], raw["status"],
                                        raw["gap"], raw["objective"], raw["history"]))
    return out


# Scores spread less than this (eta_u's and eta_v's finite entries) are near-flat for
# the forced vertex side of a sequence, which then starts from the facet side's point
# (:func:`_facet_starts`): three orders of magnitude below sparsemax's unit scale, so
# ``u`` is within about 1e-3 of the flat solution.
FLAT_SPREAD = 1e-3


def _spread(eta_u, eta_v):
    """The larger spread (max - min) of a sequence's finite scores in eta_u and in
    eta_v: two reductions each, since the forced vertex side pays it on every solve."""
    def ptp(x):
        lo, hi = x.min(), x.max()
        if not (np.isfinite(lo) and np.isfinite(hi)):    # masks: the finite entries
            x = x[np.isfinite(x)]
            lo, hi = (x.min(), x.max()) if x.size else (0.0, 0.0)
        return float(hi - lo)
    out = ptp(np.asarray(eta_u, dtype=np.float64))
    if eta_v is not None and np.size(eta_v):
        out = max(out, ptp(np.asarray(eta_v, dtype=np.float64)))
    return out


def _facet_starts(factors, etas_u, etas_v, inits, max_iter, tol, n_threads):
    """Warm starts for the vertex side of sequences at near-flat scores.

    There the active set alone stalls on a nearly flat optimal face: a 30 x 8
    sequence at ``eta_v = 1e-9 randn`` stopped at gap 2.4e-7 after 10,000
    iterations. Where the automatic choice takes the facet side (it declines at
    once at peaked scores, which keep their cold start), the facet side's point is
    decomposed into sequences (a path decomposition of its flows, cheap for this
    family, unlike trees and matchings at flat scores) and the active set starts
    from them: it then certifies the optimum in a few iterations, and the result is
    the vertex side's, support, backward set and all. Only at scores whose spread
    (:func:`_spread`) is at most ``FLAT_SPREAD``: above it the cold start converges,
    and the facet solve would cost more than it saves (a 50 x 17 sequence at
    ``0.1 randn``: 25 ms cold, 56 ms with the warm start; at ``0.01 randn``, 345
    against 35). ``inits`` with the starts filled in where none was given.
    """
    n = len(etas_u)
    fs = [factors] * n if isinstance(factors, Factor) else list(factors)
    todo = [i for i in range(n) if type(fs[i]) is SequenceFactor
            and (inits is None or inits[i] is None)
            and _spread(etas_u[i], None if etas_v is None else etas_v[i])
            <= FLAT_SPREAD]
    if not todo:
        return inits
    sols = _run_batch(_batch.prepare_solve(
        factors if isinstance(factors, Factor) else [fs[i] for i in todo],
        [etas_u[i] for i in todo], None if etas_v is None else [etas_v[i] for i in todo],
        None, max_iter, tol, False, n_threads, None, side="auto", backward=False), n_threads)
    out = [None] * n if inits is None else list(inits)
    for i, sol in zip(todo, sols):
        if sol.side == "facet" and sol.status == STATUS_CONVERGED:
            S, y = sol.facet_solver.decompose(
                sol.u_array().reshape(fs[i].shape_u), sol.v_array().reshape(fs[i].shape_v))
            out[i] = S[y > 1e-14 * y.max()]
    return out


def _warn_not_converged(result, where):
    if result._sol.status == STATUS_FACE_INCOMPLETE:
        warn(f"{where}SparseMAP ({result.method}), gap {result.gap:.3g}: {result.message}.")
        return
    hint = ""
    if _SIDES.get(result.method) == "vertex" and facet_solver(result.factor) is not None:
        # the active set can need far more iterations at near-flat scores (a near-zero
        # sequence: 100,000 left a gap of 1e-8 at 30 x 8), where the facet side is exact
        hint = (" (or let the default method solve it: at near-flat scores this factor's "
                "facet side converges where the active set may need many more iterations)")
    warn(f"{where}SparseMAP ({result.method}) stopped after {result.n_iter} iterations "
         f"with gap {result.gap:.3g} ({result.message}); raise max_iter or tol{hint}.")


def solve(factor, eta_u, eta_v=None, method="auto", max_iter=None, tol=DEFAULT_TOL,
          init=None, return_history=False, callback=None, verbose=False):
    r"""Solve SparseMAP, :math:`\max_{y \in \triangle} \eta^\top A y - \tfrac12 \|M y\|^2` (eq. 6).

    Parameters
    ----------
    factor : Factor
        Any factor (:class:`SequenceFactor`, :class:`TreeFactor`,
        :class:`MatchingFactor`, :class:`GenericFactor`, :class:`OracleFactor`, ...).
    eta_u : array_like, shape ``factor.shape_u``
        Unary scores. ``-inf`` forbids a part (a mask): no structure in the
        support uses it, so ``u`` and the Jacobian are 0 there.
    eta_v : array_like, shape ``factor.shape_v``, optional
        Additional scores (zeros when omitted); ``-inf`` forbids a part too.
        For a :class:`SequenceFactor` (or :class:`SequenceBudgetFactor`), an
        ``(S, S)`` matrix is one transition matrix shared by the positions (as
        in a CRF): ``vjp`` then returns its ``(S, S)`` gradient and ``jvp``
        takes an ``(S, S)`` ``d_eta_v``.
    method : {"auto", "vertex", "facet", "active_set", "cg", "away_cg", "pairwise_cg", "bpcg"}
        ``"auto"`` (the default) runs the exact solver on the cheaper of two
        representations of the solution, per problem: the vertex side
        (structures, the active set of Appendix A.2) or, for non-projective
        trees, sequences and matchings, the facet side (the constraints tight
        at ``u``), which is far cheaper at flat scores. Both are exact,
        certified by the duality gap, and give the true derivative;
        ``r.side`` says which ran. ``"vertex"`` and ``"facet"`` force one
        side (``"facet"`` raises for other factors, and takes the vertex side
        where the facet solver declines or cannot certify its answer:
        ``r.side`` and ``r.message`` say so and why). ``"active_set"`` names
        the paper's algorithm, the vertex side; until 0.1.0 it was the default
        and meant ``"auto"``, so it warns (``FutureWarning``) for one release.
        ``"cg"``, ``"away_cg"``, ``"pairwise_cg"`` and ``"bpcg"`` are
        conditional-gradient variants (pure Python; Appendix A.1): vanilla,
        away-step, pairwise, or blended pairwise (Tsuji, Tanaka and Pokutta,
        2022).
    max_iter : int, optional
        Iteration limit (default 10000).
    tol : float, default 1e-12
        The solve has converged when the Wolfe gap satisfies
        ``gap <= tol * max(1, sum |eta_u * u| + sum |eta_v * v| + ||u||^2)``
        (elementwise products): absolute for scores of order one, relative for
        large ones. The active set also stops, as stalled (``converged=False``
        unless the gap meets the tolerance), when round-off makes it cycle: a
        support it has met at one of the last 64 MAP calls comes back a second
        time after a refactorisation.
    init : SparseMAPResult or list of structures, optional
        Warm start: the active set starts from these structures with uniform
        weights; repeated ones are skipped, as are ones that use a forbidden
        part, and one affinely dependent on those before it replaces one of
        them (as in the solver's own insertions). Any valid structures of the
        factor will do. The exact methods only: with ``"auto"`` a warm-started
        problem runs on the vertex side (a warm start is a support of
        structures); ``"facet"`` needs none, and ignores it.
    return_history : bool, default False
        Record objective, gap, support size and seconds at every iteration
        (this costs one extra MAP call on iterations that make none).
    callback : callable, optional
        Called after every iteration as ``callback(info)``, where ``info`` is
        a ``scipy.optimize.OptimizeResult`` with the iterate's
        ``n_iter``, ``objective``, ``gap`` (its Wolfe gap), ``support_size``,
        ``seconds`` (since the start) and ``u`` (a copy). Returning ``True``
        or raising ``StopIteration`` stops the solve, as in SciPy: the
        result is that iterate, with ``converged`` telling whether its gap met
        the tolerance and ``message`` saying the callback stopped it (no
        warning). Other exceptions propagate. Like ``return_history``, it
        costs one extra MAP call on iterations that make none.
    verbose : bool, default False
        Print the iterate's figures to standard error at iterations 1-10, 20,
        30, ..., 100, 200, ... and at least every 2 seconds, then a summary
        line: for long solves (the conditional-gradient variants on large
        structures can take seconds).

    Returns
    -------
    SparseMAPResult

    Raises
    ------
    ValueError
        Invalid arguments (named in the message): scores of the wrong shape,
        complex, or holding nan or ``+inf``; or every structure uses a
        forbidden part.

    Warns
    -----
    ConvergenceWarning
        When the gap is above tolerance at return (``converged=False``); the
        best iterate is still returned, with its gap. Also when ``u`` converged
        but its backward set could not be certified to span the optimal face
        (``converged=True``; ``message`` says why: ``max_iter`` ran out, or the
        backward set reached its cap of 8192 structures), so that ``jvp`` and
        ``vjp`` may be inexact (``max_iter``) or are a projection onto a
        subface, not the Jacobian (the cap; see "Projective trees at flat
        scores" on the solvers page).

    See Also
    --------
    solve_batch : many problems at once, in threads.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> f = sm.SequenceFactor(3, 2)
    >>> eta_u = np.array([[1.0, 0.8], [0.0, 0.1], [0.5, 0.5]])
    >>> r = sm.solve(f, eta_u)
    >>> r.converged, r.side, len(r.structures)
    (True, 'facet', 4)
    >>> for s, w in zip(r.structures, r.weights):
    ...     print(s.tolist(), round(float(w), 3))
    [0, 0, 0] 0.45
    [1, 1, 1] 0.4
    [0, 1, 1] 0.1
    [0, 1, 0] 0.05
    >>> print(np.round(r.u, 3))
    [[0.6  0.4 ]
     [0.45 0.55]
     [0.5  0.5 ]]

    Without transition scores every coupling of neighbouring tags is optimal, so
    the distribution is not unique: the facet side (chosen here) gives one, the
    vertex side another, with the same ``u``:

    >>> rv = sm.solve(f, eta_u, method="vertex")
    >>> [s.tolist() for s in rv.structures], bool(np.allclose(rv.u, r.u))
    ([[0, 1, 0], [1, 0, 1], [0, 0, 1], [1, 1, 1]], True)

    The conditional-gradient variants reach the same ``u``:

    >>> r2 = sm.solve(f, eta_u, method="pairwise_cg")
    >>> bool(np.allclose(r2.u, r.u, atol=1e-6))
    True
    """
    return _solve_problem(factor, eta_u, eta_v, method, max_iter, tol, init, return_history,
                          callback, verbose)


def _solve_problem(factor, eta_u, eta_v=None, method="auto", max_iter=None, tol=DEFAULT_TOL,
           init=None, return_history=False, callback=None, verbose=False, backward=True):
    """:func:`solve`; ``backward=False`` skips the backward set's completion (for callers
    that need ``u`` and ``v`` only, as the losses do: the result's jvp / vjp are then not
    the Jacobian's, so it must not leave the caller)."""
    _check_factor(factor)
    method, max_iter, tol = _check_options(method, max_iter, tol)
    shared = _is_shared(factor, eta_v)
    eu, ev = factor.check_scores(
        eta_u, _broadcast_shared(factor, eta_v, "eta_v") if shared else eta_v)
    S0 = _check_init(factor, init)
    if S0 is not None and method not in _SIDES:
        raise ValueError(f"init: warm starts are supported by the exact methods ({_EXACT}) "
                         f"only, got method={method!r}")
    _check_side(factor, method)
    if callback is not None and not callable(callback):
        raise ValueError(f"callback: expected a callable or None, got {callback!r}")
    if verbose:
        callback = _Printer(method, callback)
    result = _solved(factor, eu, ev, eta_v is None, S0, method, max_iter, tol,
                     bool(return_history), callback, backward, shared)
    if verbose:
        callback.summary(result)
    if result._sol.status not in (STATUS_CONVERGED, STATUS_STOPPED):
        _warn_not_converged(result, "")
    return result


def _solve_unwarned(factor, eta_u, eta_v, max_iter):
    """:func:`solve` at its defaults for a caller that passes a valid factor and options
    and reads ``converged`` itself, so no warning is raised (no filter needed around the
    call): a graph that is one factor solves it this way, and takes its own path when
    the answer is not certified. The scores are checked as by :func:`solve`."""
    eu, ev = factor.check_scores(eta_u, eta_v)
    return _solved(factor, eu, ev, eta_v is None, None, "auto", max_iter, DEFAULT_TOL, False,
                   None, True, False)


def _solved(factor, eu, ev, no_eta_v, S0, method, max_iter, tol, return_history, callback,
            backward, shared):
    """The result of one checked problem (``eu``, ``ev`` as ``factor.check_scores`` gives
    them), or ValueError when every structure uses a forbidden part."""
    sol = _solve_problems(factor, [eu], [ev], None if S0 is None else [S0], method, max_iter,
                          tol, return_history, callback=callback, backward=backward)[0]
    if sol.status == STATUS_INFEASIBLE:
        raise ValueError(factor._infeasible_message(_names(factor, "eta_u", "eta_v")))
    return SparseMAPResult(factor, sol, method, (eu, ev, max_iter),
                           _per_position(factor, no_eta_v), shared)


class _Printer:
    """The ``verbose=True`` callback: iterate lines at log-spaced iterations, then a summary."""

    def __init__(self, method, inner=None, stream=None):
        self.method = method
        self.inner = inner
        self.stream = stream
        self.last = -math.inf

    def _print(self, line):
        print(line, file=sys.stderr if self.stream is None else self.stream, flush=True)

    def __call__(self, info):
        it = info.n_iter
        step = 10 ** int(math.log10(it)) if it >= 10 else 1
        if it % step == 0 or info.seconds - self.last >= 2.0:
            if self.last == -math.inf:
                self._print(f"SparseMAP ({self.method}): {'iter':>7} {'objective':>22} "
                            f"{'gap':>10} {'support':>7} {'seconds':>9}")
            self.last = info.seconds
            self._print(f"SparseMAP ({self.method}): {it:7d} {info.objective:22.15g} "
                        f"{info.gap:10.3g} {info.support_size:7d} {info.seconds:9.3f}")
        return None if self.inner is None else self.inner(info)

    def summary(self, result):
        self._print(f"SparseMAP ({self.method}): {result.message} after {result.n_iter} "
                    f"iterations, gap {result.gap:.3g}, {len(result.weights)} structures in "
                    f"the support")


# -- batches -----------------------------------------------------------------------------

def _default_jobs():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def _holds_gil(factors):
    """Whether solving for ``factors`` (one Factor or an iterable) runs Python with the GIL
    held: an :class:`OracleFactor`'s MAP, scores and columns are Python callbacks, so
    threads would only queue for the GIL (and pay to hand it over)."""
    if isinstance(factors, Factor):
        return isinstance(factors, OracleFactor)
    return any(isinstance(f, OracleFactor) for f in factors)


def _check_n_jobs(n_jobs, factors=None):
    """Threads for a batch: ``n_jobs``, validated; the default (None) is every core this
    process may run on, or 1 when ``factors`` (if given) hold the GIL (:func:`_holds_gil`),
    so that the default is never slower than a serial run."""
    if n_jobs is None:
        return 1 if factors is not None and _holds_gil(factors) else _default_jobs()
    if type(n_jobs) is int and n_jobs >= 1:
        return n_jobs
    if isinstance(n_jobs, bool) or not isinstance(n_jobs, numbers.Integral) or n_jobs < 1:
        raise ValueError(f"n_jobs: expected None (all cores) or a positive integer, got {n_jobs!r}")
    return int(n_jobs)


class _Crew:
    """Persistent helper threads that each run one call per task, the caller joining in.

    A helper sleeps on its own lock; :meth:`start` releases it and :meth:`join`
    waits on another. An executor's futures and work queue cost tens of
    microseconds of interpreter work per batch, which the small batches of a
    training step cannot hide. One task at a time: a caller that finds the
    crew busy (another thread's batch) gets no helpers and works alone.
    """

    def __init__(self):
        self.pid = os.getpid()
        self.busy = threading.Lock()
        self.go, self.done, self.fn = [], [], None

    def _grow(self, n):
        while len(self.go) < n:
            go, done = threading.Lock(), threading.Lock()
            go.acquire()
            done.acquire()
            self.go.append(go)
            self.done.append(done)
            threading.Thread(target=self._helper, args=(len(self.go),), daemon=True,
                             name=f"sparsemap-{len(self.go)}").start()

    def _helper(self, k):
        go, done = self.go[k - 1], self.done[k - 1]
        while True:
            go.acquire()
            try:
                self.fn(k)
            except BaseException:   # the task records its own errors
                pass
            done.release()

    def start(self, fn, n):
        """Have up to n helpers call ``fn(1)``, ..., ``fn(n)``; how many started (0 if busy).

        Every start that returns k > 0 must be followed by ``join(k)``.
        """
        if not self.busy.acquire(False):
            return 0
        try:
            self._grow(n)
        except RuntimeError:    # interpreter shutting down: no new threads
            self.busy.release()
            return 0
        self.fn = fn
        for go in self.go[:n]:
            go.release()
        return n

    def join(self, k):
        """Wait for the k helpers started to return."""
        for done in self.done[:k]:
            done.acquire()
        self.fn = None
        self.busy.release()


_crew_lock = threading.Lock()
_crew = None


def _helpers():
    """The process's crew (a new one after a fork: threads do not survive it)."""
    global _crew
    with _crew_lock:
        if _crew is None or _crew.pid != os.getpid():
            _crew = _Crew()
        return _crew


def _order(n, costs=None):
    """Problem indices, most expensive first (ties in input order)."""
    # must agree with the Cython _Order rule (_batch.pyx): decreasing cost, stable
    if costs is None:
        return np.arange(n, dtype=np.intp)
    return np.argsort(-np.asarray(costs), kind="stable").astype(np.intp)


# The caller works alone this long (seconds) before waking the pool: a batch
# done sooner would pay more for the wake-up than it gains.
SOLO_BUDGET = 50e-6


def _run_batch(batch, n_threads):
    """Run a prepared ``_batch._Batch`` on n_threads threads, the caller's included.

    The caller starts alone, from the cheap end of the order; if problems
    are left after ``SOLO_BUDGET``, it wakes the crew's helpers and, like
    them, carries on from the expensive end, so that the batch ends on the
    cheapest problems left. A thread that finds no problem left returns at
    once, so the caller waits only for problems in progress.
    """
    k = 0
    if n_threads > 1:
        batch.run(0, True, SOLO_BUDGET)
        if batch.remaining() > 0:
            crew = _helpers()
            k = crew.start(batch.run, n_threads - 1)
    try:
        batch.run(0)
        batch.wait()
    finally:
        if k:
            crew.join(k)
    return batch.outputs


def _chunks(order, n_tasks):
    """``order`` cut into n_tasks contiguous chunks (for an executor)."""
    n = len(order)
    n_tasks = max(1, min(n, n_tasks))
    bounds = [c * n // n_tasks for c in range(n_tasks + 1)]
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _batch_size(name, x):
    try:
        return len(x)
    except TypeError:
        raise ValueError(f"{name}: expected a sequence of arrays or a stacked array, got "
                         f"{type(x).__name__}")


def _check_batch_scores(factors, shared, x, name, on_v, B, masks=True):
    """Validated scores of a batch: a 2-d (B, n) float64 array, or a list of flat arrays.

    A stacked array is checked in one pass; only a row holding non-finite values
    goes through the factor's per-entry screening.
    """
    if isinstance(x, np.ndarray):
        f0 = factors if shared else (factors[0] if B else None)
        shape = () if f0 is None else (f0.shape_v if on_v else f0.shape_u)
        if not shared:
            for i, f in enumerate(factors):
                if (f.shape_v if on_v else f.shape_u) != shape:
                    raise ValueError(f"{name}: a stacked array needs factors of one shape "
                                     f"(factors[{i}] differs from factors[0]); pass a list "
                                     f"with one array per problem")
        arr = _real_array(x, name)
        if arr.shape != (B,) + shape:
            raise ValueError(f"{name}: expected shape {(B,) + shape} (one row per problem), "
                             f"got {arr.shape}")
        arr = np.ascontiguousarray(arr).reshape(B, int(np.prod(shape, dtype=np.int64)))
        flags = scan_values(arr.reshape(-1))
        if not flags:
            return arr
        if shared:
            ignored = factors._ignored_entries(on_v)
            if ignored is not None:   # they accept anything: set them to 0, all rows at once
                arr = arr.copy()
                arr[:, ignored] = 0.0
                flags = scan_values(arr.reshape(-1))
            if flags & SCAN_BAD or not masks:
                for i in range(B):    # raise, naming the first bad problem
                    if scan_values(arr[i]):
                        factors._screen(arr[i], f"{name}[{i}]", on_v, masks, scan_values(arr[i]))
            return arr
        out = arr
        for i in range(B):
            row_flags = scan_values(arr[i])
            if row_flags:
                screened = factors[i]._screen(arr[i], f"{name}[{i}]", on_v, masks, row_flags)
                if not np.shares_memory(screened, arr):
                    if out is arr:
                        out = arr.copy()
                    out[i] = screened
        return out
    items = list(x)
    if len(items) != B:
        raise ValueError(f"{name}: expected {B} entries (one per problem), got {len(items)}")
    out = []
    for i, item in enumerate(items):
        f = factors if shared else factors[i]
        if item is None and on_v:
            out.append(None)
        else:
            out.append(f._check_array(item, f"{name}[{i}]", on_v, masks))
    return out


def _check_batch(factors, etas_u, etas_v):
    B = _batch_size("etas_u", etas_u)
    shared = isinstance(factors, Factor)
    if not shared:
        if isinstance(factors, (str, bytes)) or not hasattr(factors, "__len__"):
            raise ValueError(f"factors: expected a Factor or a sequence of factors, got "
                             f"{type(factors).__name__}")
        factors = list(factors)
        if len(factors) != B:
            raise ValueError(f"factors: expected one factor per problem ({B}, the length of "
                             f"etas_u), got {len(factors)}")
        for i, f in enumerate(factors):
            _check_factor(f, f"factors[{i}]")
    eus = _check_batch_scores(factors, shared, etas_u, "etas_u", False, B)
    evs = None
    shared_v = [False] * B
    if etas_v is not None:
        if _batch_size("etas_v", etas_v) != B:
            raise ValueError(f"etas_v: expected {B} entries (one per problem), got {len(etas_v)}")
        etas_v, shared_v = _expand_shared(factors, shared, etas_v, B)
        evs = _check_batch_scores(factors, shared, etas_v, "etas_v", True, B)
    return B, factors, shared, eus, evs, shared_v


def _expand_shared(factors, shared, etas_v, B):
    """``etas_v`` with each shared ``(S, S)`` transition matrix of a
    :class:`SequenceFactor` repeated at every transition (a stacked ``(B, S, S)``
    array for one such factor, or entries of a sequence), and which problems had one."""
    if isinstance(etas_v, np.ndarray):
        if shared and np.ndim(etas_v) == 3 and _is_shared(factors, etas_v[0]):
            return (np.stack([_broadcast_shared(factors, e, f"etas_v[{i}]")
                              for i, e in enumerate(etas_v)]), [True] * B)
        return etas_v, [False] * B
    items = list(etas_v)
    flags = [_is_shared(factors if shared else factors[i], e) for i, e in enumerate(items)]
    if any(flags):
        items = [_broadcast_shared(factors if shared else factors[i], e, f"etas_v[{i}]")
                 if flag else e for i, (e, flag) in enumerate(zip(items, flags))]
    return items, flags


def solve_batch(factors, etas_u, etas_v=None, *, n_jobs=None, executor=None, **solve_kw):
    """Solve many SparseMAP problems, in threads (or any executor).

    Parameters
    ----------
    factors : Factor or sequence of Factor
        One factor shared by every problem, or one per problem (for example
        trees over sentences of different lengths).
    etas_u : sequence of array_like, or ndarray
        The unary scores of each problem: a sequence of arrays, or one stacked
        array whose leading axis is the problem (then every factor has the
        same shape). ``-inf`` forbids a part, as in :func:`solve`.
    etas_v : None, sequence or ndarray, optional
        The additional scores, likewise; entries of a sequence may be None
        (zeros). For a :class:`SequenceFactor` (or
        :class:`SequenceBudgetFactor`) an entry may be one ``(S, S)``
        transition matrix shared by the positions (a stacked array is then
        ``(B, S, S)``), as in :func:`solve`: that result's ``vjp`` returns its
        ``(S, S)`` gradient.
    n_jobs : int, optional
        Threads to use, the calling thread included; 1 runs serially in the
        calling thread. The solves run without the GIL, so threads scale with
        the cores. None (the default) means every core this process may run
        on, except when a factor is an :class:`OracleFactor`: its callbacks
        are Python and hold the GIL, so threads could only wait for each
        other, and the default is then 1 (pass ``n_jobs`` to override, or an
        ``executor`` of processes to run oracles in parallel).
    executor : concurrent.futures.Executor, optional
        Run the problems there instead of in threads: a
        ``ProcessPoolExecutor``, or the executor of a Dask or Ray cluster
        (any object with an Executor's ``submit``). Factors, scores and
        results travel by pickle, so an :class:`OracleFactor` needs picklable
        callables (module-level functions, not lambdas). The batch is cut into
        ``4 * n_jobs`` tasks (``n_jobs=None``: this machine's cores).
    **solve_kw
        ``method``, ``max_iter``, ``tol``, ``return_history`` as for
        :func:`solve`, applied to every problem; ``init``, if given, is a
        sequence with one warm start per problem (None entries: cold).

    Returns
    -------
    list of SparseMAPResult
        In input order, bitwise equal to ``solve`` on each problem.

    Raises
    ------
    ValueError
        Invalid arguments; the message names the problem, as in
        ``etas_u[3]: expected shape (11, 11), got (12, 12)``, or
        ``etas_u[3]: every structure ... uses a forbidden part``.

    Warns
    -----
    ConvergenceWarning
        For each problem that did not converge, naming it.

    See Also
    --------
    vjp_batch, jvp_batch : the backward pass of a batch.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> rng = np.random.default_rng(0)
    >>> f = sm.SequenceFactor(5, 3)
    >>> etas_u = rng.standard_normal((8, 5, 3))         # 8 problems, stacked
    >>> rs = sm.solve_batch(f, etas_u, n_jobs=2)
    >>> len(rs), all(np.array_equal(r.u, sm.solve(f, e).u)
    ...              for r, e in zip(rs, etas_u))
    (8, True)
    """
    return _solve_batch(factors, etas_u, etas_v, n_jobs, executor, solve_kw, _element)


def _element(i):
    """How warnings and errors name problem ``i`` of a batch."""
    return f"batch element {i}"


def _solve_batch(factors, etas_u, etas_v, n_jobs, executor, solve_kw, where):
    """:func:`solve_batch`, whose warnings name problem ``i`` as ``where(i)`` (the torch
    layer's elements have multi-dimensional indices)."""
    unknown = set(solve_kw) - {"method", "max_iter", "tol", "init", "return_history"}
    if unknown:
        raise TypeError(f"solve_batch() got an unexpected keyword argument {sorted(unknown)[0]!r}")
    method, max_iter, tol = _check_options(solve_kw.get("method", "auto"),
                                           solve_kw.get("max_iter"),
                                           solve_kw.get("tol", DEFAULT_TOL))
    return_history = bool(solve_kw.get("return_history", False))
    jobs = _check_n_jobs(n_jobs)
    if executor is not None and not callable(getattr(executor, "submit", None)):
        raise ValueError(f"executor: expected a concurrent.futures.Executor (an object with "
                         f"submit), got {type(executor).__name__}")
    B, factors, shared, eus, evs, shared_v = _check_batch(factors, etas_u, etas_v)
    inits = None
    if solve_kw.get("init") is not None:
        init = solve_kw["init"]
        if isinstance(init, SparseMAPResult) or _batch_size("init", init) != B:
            raise ValueError(f"init: expected one warm start per problem (a sequence of {B} "
                             f"results, lists of structures or None)")
        inits = [_check_init(factors if shared else factors[i], s, f"init[{i}]")
                 for i, s in enumerate(init)]
        if method not in _SIDES and any(s is not None for s in inits):
            raise ValueError(f"init: warm starts are supported by the exact methods ({_EXACT}) "
                             f"only, got method={method!r}")
    for i, f in enumerate([factors] if shared else factors):
        _check_side(f, method, "" if shared else f"factors[{i}]: ")
    if B == 0:
        return []

    fs = [factors] * B if shared else factors
    if executor is None:
        sols = _solve_problems(factors, eus, evs, inits, method, max_iter, tol, return_history,
                               _check_n_jobs(n_jobs, factors))
    else:
        order = _order(B, None if shared else [f.n_u + f.n_v for f in factors])
        chunks = _chunks(order, CHUNKS_PER_JOB * jobs)
        futures = [executor.submit(
            _solve_problems, factors if shared else _take(factors, idx), _take(eus, idx),
            _take(evs, idx), _take(inits, idx), method, max_iter, tol, return_history)
            for idx in chunks]
        sols = _gather(chunks, [fut.result() for fut in futures], B)
        for f, sol in zip(fs, sols):
            sol.factor = f   # the caller's factor objects, not copies
    for i, sol in enumerate(sols):
        if sol.status == STATUS_INFEASIBLE:
            raise _infeasible_error(fs[i], i)
    # the scores are kept for the backward passes that need them (CG's, a fibered face's)
    results = [SparseMAPResult(f, sol, method, (_take(eus, i), _take(evs, i), max_iter),
                               _per_position(f, evs is None or evs[i] is None), shared_v[i])
               for i, (f, sol) in enumerate(zip(fs, sols))]
    for i, r in enumerate(results):
        if r._sol.status != STATUS_CONVERGED:
            _warn_not_converged(r, f"{where(i)}: ")
    return results


def _gather(chunks, parts, n):
    """Outputs per chunk back in problem order."""
    out = [None] * n
    for idx, part in zip(chunks, parts):
        for i, o in zip(idx.tolist(), part):
            out[i] = o
    return out


def _take(xs, idx):
    """Entries idx (an index array, or one index) of None, a stacked array or a list."""
    if xs is None:
        return None
    if isinstance(xs, np.ndarray) or np.ndim(idx) == 0:
        return xs[idx]
    return [xs[i] for i in idx]


def _check_results(results):
    rs = list(results)
    for i, r in enumerate(rs):
        if not isinstance(r, SparseMAPResult):
            raise ValueError(f"results[{i}]: expected a SparseMAPResult, got {type(r).__name__}")
    return rs


def _takes_shared(factor):
    """Whether ``factor`` takes one transition matrix shared by its positions: a chain
    whose ``eta_v`` is one block per transition, a :class:`SequenceFactor` or a
    :class:`SequenceBudgetFactor` (exactly those types: another factor with a 3-d
    ``shape_v`` need not be a chain). NumPy and torch ask this alike."""
    return type(factor) in (SequenceFactor, SequenceBudgetFactor) and factor.n_v > 0


def _is_shared(factor, eta_v):
    """Whether ``eta_v`` is one transition matrix shared by the positions of a chain
    (_takes_shared; its per-position form is ``factor.shape_v``, (n - 1, S, S))."""
    return eta_v is not None and np.ndim(eta_v) == 2 and _takes_shared(factor)


def _broadcast_shared(factor, x, name):
    """A shared (S, S) matrix repeated at every transition (validated as ``name``)."""
    arr = _real_array(x, name)
    block = factor.shape_v[1:]
    if arr.shape != block:
        raise ValueError(f"{name}: expected shape {factor.shape_v} (per transition) or "
                         f"{block} (shared by the positions), got {arr.shape}")
    return np.broadcast_to(arr, factor.shape_v)


def _per_position(factor, no_eta_v):
    """Whether a solve of ``factor`` is per-position sparsemax: a :class:`SequenceFactor`
    (exactly: a subclass may restrict the sequences) solved without ``eta_v``.

    There ``u(eta_u, 0)`` is sparsemax of each position's scores, differentiable in
    ``eta_u`` wherever sparsemax is, so the ``eta_u`` part of the Jacobian is that of
    per-position sparsemax, not the one of the piece along the tie direction (which
    couples positions). The ``eta_v`` part stays the one-sided limit along
    ``tie_direction``: ``u`` has a kink in ``eta_v`` at 0 whatever was passed."""
    return no_eta_v and type(factor) is SequenceFactor and factor.n_v > 0


def _centre(on, d):
    """Per-position sparsemax's Jacobian (symmetric) applied to ``d``: on each position
    (last axis), ``d`` minus its mean over the support ``on``, and 0 off it."""
    d = np.where(on, d, 0.0)
    count = np.maximum(on.sum(-1, keepdims=True), 1)
    return np.where(on, d - d.sum(-1, keepdims=True) / count, 0.0)


def _summed_shared(rs, out):
    """vjp outputs with each shared (S, S) transition matrix's gradient summed over the
    positions."""
    return [(g_u, g_v.sum(0)) if getattr(r, "_shared_v", False) else (g_u, g_v)
            for r, (g_u, g_v) in zip(rs, out)]


def _backward_batch(rs, ins_u, ins_v, transpose, n_jobs):
    pp = [i for i, r in enumerate(rs) if getattr(r, "_per_position", False)]
    if not pp:
        out = _backward_core(rs, ins_u, ins_v, transpose, n_jobs)
        return _summed_shared(rs, out) if transpose else out
    # solved without eta_v: the eta_u part in closed form (_per_position); the backward
    # set runs only for the eta_v part (a jvp without d_eta_v needs none: no untying)
    B = len(rs)
    in_pp = set(pp)
    shape = [r.factor.shape_u for r in rs]
    if transpose:
        out = _summed_shared(rs, _backward_core(rs, ins_u, None, True, n_jobs))
        for i in pp:
            out[i] = (_centre(rs[i].u > 0, np.reshape(ins_u[i], shape[i])), out[i][1])
        return out
    has_v = [ins_v is not None and ins_v[i] is not None for i in range(B)]
    need = [i for i in range(B) if i not in in_pp or has_v[i]]
    part = dict(zip(need, _backward_core(
        [rs[i] for i in need],
        [np.zeros_like(ins_u[i]) if i in in_pp else ins_u[i] for i in need],
        None if ins_v is None else [ins_v[i] for i in need], False, n_jobs))) if need else {}
    out = []
    for i in range(B):
        if i in in_pp:
            du = _centre(rs[i].u > 0, np.reshape(ins_u[i], shape[i]))
            out.append(du + part[i] if i in part else du)
        else:
            out.append(part[i])
    return out


def _backward_core(rs, ins_u, ins_v, transpose, n_jobs):
    n_threads = max(1, min(n_jobs, len(rs)))
    lazy = [r for r in rs if r._backward is None]
    if len(lazy) > 1 and n_threads > 1:
        # reductions and untying release the GIL: run them in threads
        with ThreadPoolExecutor(n_threads) as pool:
            list(pool.map(SparseMAPResult._backward_solution, lazy))
    sols = [r._backward_solution() for r in rs]
    return _run_batch(_batch.prepare_backward(sols, ins_u, ins_v, transpose, n_threads),
                n_threads)


def vjp_batch(results, dus, *, n_jobs=None):
    """:meth:`SparseMAPResult.vjp` of many results, in threads.

    Parameters
    ----------
    results : sequence of SparseMAPResult
        For example from :func:`solve_batch`.
    dus : sequence of array_like, or ndarray
        Gradient with respect to each ``u``; a stacked array when all
        results share one shape.
    n_jobs : int, optional
        Threads, as for :func:`solve_batch`.

    Returns
    -------
    list of (g_eta_u, g_eta_v)
        Bitwise equal to ``r.vjp(du)`` for each pair.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> results = sm.solve_batch(sm.XorFactor(3), np.array([[1.0, 0.5, -1.0],
    ...                                                     [0.0, 0.2, 0.1]]))
    >>> grads = sm.vjp_batch(results, [np.array([1.0, 0.0, 0.0])] * 2)
    >>> for g_eta_u, g_eta_v in grads:
    ...     print(np.round(g_eta_u, 3))
    [ 0.5 -0.5  0. ]
    [ 0.667 -0.333 -0.333]
    """
    rs = _check_results(results)
    factors = [r.factor for r in rs]
    n_jobs = _check_n_jobs(n_jobs, factors)
    B = len(rs)
    if _batch_size("dus", dus) != B:
        raise ValueError(f"dus: expected {B} entries (one per result), got {len(dus)}")
    if B == 0:
        return []
    g = _check_batch_scores(factors, False, dus, "dus", False, B, masks=False)
    return _backward_batch(rs, g, None, True, n_jobs)


def jvp_batch(results, d_etas_u, d_etas_v=None, *, n_jobs=None):
    """:meth:`SparseMAPResult.jvp` of many results, in threads.

    Parameters
    ----------
    results : sequence of SparseMAPResult
    d_etas_u : sequence of array_like, or ndarray
        A direction for each ``eta_u``.
    d_etas_v : None, sequence or ndarray, optional
        A direction for each ``eta_v`` (None, or None entries: zeros), shaped
        as that ``eta_v`` was: ``(S, S)`` for a shared transition matrix.
    n_jobs : int, optional
        Threads, as for :func:`solve_batch`.

    Returns
    -------
    list of ndarray
        ``du`` for each result, bitwise equal to ``r.jvp(d_eta_u, d_eta_v)``.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> results = sm.solve_batch(sm.XorFactor(3), np.array([[1.0, 0.5, -1.0],
    ...                                                     [0.0, 0.2, 0.1]]))
    >>> for du in sm.jvp_batch(results, [np.array([1.0, 0.0, 0.0])] * 2):
    ...     print(np.round(du, 3))
    [ 0.5 -0.5  0. ]
    [ 0.667 -0.333 -0.333]
    """
    rs = _check_results(results)
    factors = [r.factor for r in rs]
    n_jobs = _check_n_jobs(n_jobs, factors)
    B = len(rs)
    for name, x in (("d_etas_u", d_etas_u), ("d_etas_v", d_etas_v)):
        if x is not None and _batch_size(name, x) != B:
            raise ValueError(f"{name}: expected {B} entries (one per result), got {len(x)}")
    if B == 0:
        return []
    du = _check_batch_scores(factors, False, d_etas_u, "d_etas_u", False, B, masks=False)
    dv = None
    if d_etas_v is not None:
        if any(getattr(r, "_shared_v", False) for r in rs):
            d_etas_v = [_broadcast_shared(r.factor, d, f"d_etas_v[{i}]")
                        if d is not None and getattr(r, "_shared_v", False) else d
                        for i, (r, d) in enumerate(zip(rs, d_etas_v))]
        dv = _check_batch_scores(factors, False, d_etas_v, "d_etas_v", True, B, masks=False)
    return _backward_batch(rs, du, dv, False, n_jobs)


# -- padded batches: the PyTorch layer's path -------------------------------------------
#
# One padded float64 array in, one out: problem i reads the leading block of shape
# factors[i].shape_u of etas_u[i] (and of etas_v[i]) and writes u, zero-padded, into its
# slot of one output array. The threads copy and scan each block and write each slot
# without the GIL (_batch.prepare_solve with out_u), so what stays serial is one
# pass over the problems to take pointers, and a look at the few the run reports.

def _blocks(factors, arr, on_v):
    """Each problem's leading block of a padded array (views)."""
    fs = [factors] * len(arr) if isinstance(factors, Factor) else factors
    return [arr[(i,) + tuple(slice(0, d) for d in (f.shape_v if on_v else f.shape_u))]
            for i, f in enumerate(fs)]


def _solve_padded(factors, etas_u, etas_v, out_u, n_jobs, solve_kw, where=_element):
    """Solve a padded batch (the fast path of ``sparsemap.torch``; private).

    Parameters
    ----------
    factors : Factor or list of Factor
        One factor for every problem, or one per problem.
    etas_u : ndarray, shape ``(B, *pad_u)``
        C-contiguous float64 or float32. Problem ``i`` reads the leading block
        of shape ``factors[i].shape_u`` of ``etas_u[i]``; the rest is never
        read, and nothing is written.
    etas_v : ndarray, shape ``(B, *pad_v)``, or None
        Likewise with ``shape_v`` (None: zeros).
    out_u : ndarray, shaped like ``etas_u``
        C-contiguous float64 or float32: receives each ``u`` (bitwise equal
        to :func:`solve`'s, rounded to float32 for a float32 array), zeros
        outside each problem's block.
    n_jobs : int or None
    solve_kw : dict
        As for :func:`solve_batch`.
    where : callable, optional
        ``where(i)`` names problem ``i`` in warnings (default ``batch element i``).

    Returns
    -------
    handles : _Solutions or list of SparseMAPResult
        The outcomes, for :func:`_backward_padded`: in C buffers (the active
        set), or results (the general path: other solvers, warm starts).

    Raises
    ------
    ValueError
        As :func:`solve_batch`, naming ``etas_u[i]`` or ``etas_v[i]``.
    """
    method, max_iter, tol = _check_options(solve_kw.get("method", "auto"),
                                           solve_kw.get("max_iter"),
                                           solve_kw.get("tol", DEFAULT_TOL))
    B = etas_u.shape[0]
    if method not in _SIDES or set(solve_kw) - {"method", "max_iter", "tol"} or \
            _holds_gil(factors):
        # the general path: blocks through solve_batch (CG solvers, warm starts, oracles
        # whose results then tell the backward pass its default n_jobs, ...), from
        # copies (CG's results keep their scores for the backward pass)
        etas_u = np.array(etas_u, dtype=np.float64)
        etas_v = None if etas_v is None else np.array(etas_v, dtype=np.float64)
        results = _solve_batch(factors, _blocks(factors, etas_u, False),
                               None if etas_v is None else _blocks(factors, etas_v, True),
                               n_jobs, None, solve_kw, where)
        out_u[...] = 0.0
        for b, r in zip(_blocks(factors, out_u, False), results):
            b[...] = r.u
        return _mark_per_position(results, factors, etas_v, out_u)
    n_threads = max(1, min(_check_n_jobs(n_jobs), B))
    # the layer's backward pass has no scores to untie a fibered face with: untie it now
    # where eta_v is differentiated (without eta_v, the eta_u part is exact as it is)
    for i, f in enumerate([factors] if isinstance(factors, Factor) else factors):
        _check_side(f, method, f"factors[{i}]: ")
    batch = _batch.prepare_solve(factors, etas_u, etas_v, None, max_iter, tol,
                                 False, n_threads, None, out_u, etas_v is not None,
                                 _SIDES[method])
    sols = _run_batch(batch, n_threads)
    report = batch.report()
    if report:
        _settle(factors, etas_u, etas_v, out_u, sols, report, method, max_iter, tol, where)
    return _mark_per_position(sols, factors, etas_v, out_u)


def _mark_per_position(handles, factors, etas_v, out_u):
    """The handles of a padded batch, wrapped (:class:`_PerPosition`) when it was solved
    without ``eta_v`` and holds sequences (:func:`_per_position`)."""
    if etas_v is not None or (isinstance(factors, Factor)
                              and type(factors) is not SequenceFactor):
        return handles
    pp = np.array([_per_position(f, True) for f in
                   ([factors] * len(out_u) if isinstance(factors, Factor) else factors)],
                  dtype=bool)
    return _PerPosition(handles, pp, out_u) if pp.any() else handles


class _PerPosition:
    """The handles of a padded batch solved without ``eta_v`` where some problems are
    per-position sparsemax (:func:`_per_position`): which ones, and the supports of
    their ``u`` (the eta_u part of their Jacobian, :func:`_centre`)."""

    def __init__(self, handles, pp, u):
        self.handles, self.pp = handles, pp
        self.on = u[pp] > 0


def _settle(factors, etas_u, etas_v, u, sols, report, method, max_iter, tol, where=_element):
    """The problems a padded run reported, as :func:`solve_batch` would treat them.

    A refused block (nan or +inf) goes through the factor's validation, which
    raises unless those values sit in entries the factor ignores; then it is
    solved again with them set to 0. Then the first infeasible problem
    raises, and problems that did not converge warn.
    """
    fs = [factors] * len(sols) if isinstance(factors, Factor) else factors
    for i, code in report:
        if code != _batch.REFUSED:
            continue
        f = fs[i]
        eu = f._check_array(_blocks(f, etas_u[i:i + 1], False)[0], f"etas_u[{i}]", False, True)
        ev = None
        if etas_v is not None and f.n_v:
            ev = f._check_array(_blocks(f, etas_v[i:i + 1], True)[0], f"etas_v[{i}]", True, True)
        sol = _solve_problems(f, [eu], [ev], None, method, max_iter, tol, False)[0]
        sols.put(i, sol)
        _blocks(f, u[i:i + 1], False)[0][...] = sol.u_array().reshape(f.shape_u)
    reported = [(i, sols.solution(i)) for i, _ in report]
    for i, sol in reported:
        if sol.status == STATUS_INFEASIBLE:
            raise _infeasible_error(fs[i], i)
    for i, sol in reported:
        if sol.status != STATUS_CONVERGED:
            _warn_not_converged(SparseMAPResult(fs[i], sol, method), f"{where(i)}: ")
        elif sol.face_status == FACE_STATUS_FIBERED:
            warn(f"{where(i)}: SparseMAP: {_UNTIE_FAILED}")


# The statuses of the torch layer's report, by code (SparseMAPResult.message says more).
_STATUS_NAMES = ("converged", "max_iter", "stalled", "face_incomplete", "stopped")
_STATUS_CODES = {STATUS_CONVERGED: 0, STATUS_MAX_ITER: 1, STATUS_STALLED: 2,
                 STATUS_FACE_INCOMPLETE: 3, STATUS_STOPPED: 4}


def _padded_info(handles):
    """Support sizes, iteration counts, status codes (into ``_STATUS_NAMES``), gaps,
    sides (True: the facet side) and fallback codes (into ``_FALLBACK_NAMES``: why a
    problem offered to the facet side went to the vertex side) of a padded batch's
    problems, from :func:`_solve_padded`'s handles (no solve). A facet-side solution
    holds no structures: its support size is -1 (a decomposition would cost a solve)."""
    if isinstance(handles, _PerPosition):
        handles = handles.handles
    sols = [handles.solution(i) for i in range(len(handles))] \
        if isinstance(handles, _Solutions) else [h._sol for h in handles]
    facet = np.array([s.side == "facet" for s in sols], dtype=bool)
    return (np.array([-1 if f else s.n_support for s, f in zip(sols, facet)], dtype=np.int64),
            np.array([s.n_iter for s in sols], dtype=np.int64),
            np.array([_STATUS_CODES[s.status] for s in sols], dtype=np.int64),
            np.array([s.gap for s in sols], dtype=np.float64), facet,
            np.array([0 if f else s.fallback[0] for s, f in zip(sols, facet)],
                     dtype=np.int64))


def _infeasible_error(f, i):
    return ValueError(f._infeasible_message(_names(f, "etas_u", "etas_v", f"[{i}]")))


def _backward_padded(handles, ins_u, ins_v, transpose, n_jobs, out_u, out_v=None):
    """Jacobian products of a padded batch (the backward of ``sparsemap.torch``; private).

    Parameters
    ----------
    handles : _Solutions or list of SparseMAPResult
        From :func:`_solve_padded`.
    ins_u : ndarray, shape ``(B, *pad_u)``
        C-contiguous float64 or float32: ``du`` (vjp) or ``d_eta_u`` (jvp),
        leading blocks read.
    ins_v : ndarray, shape ``(B, *pad_v)``, or None
        ``d_eta_v`` (jvp only; None: zeros).
    transpose : bool
        True: vjp, ``(g_eta_u, g_eta_v)``; False: jvp, ``du``.
    n_jobs : int or None
    out_u : ndarray, shaped like ``ins_u``
        Receives ``g_eta_u`` (vjp) or ``du`` (jvp), zero-padded.
    out_v : ndarray, shape ``(B, *pad_v)``, optional
        vjp: receives ``g_eta_v``, zero-padded (None: not computed).

    Raises
    ------
    ValueError
        A non-finite value in a block read, naming ``dus[i]`` (vjp) or
        ``d_etas_u[i]`` / ``d_etas_v[i]`` (jvp).
    """
    if isinstance(handles, _PerPosition):
        # solved without eta_v: per-position sparsemax's Jacobian for the eta_u part of
        # those problems (_per_position); the backward sets give the eta_v part
        pp = handles.pp
        bad = ~np.isfinite(np.where(handles.on, ins_u[pp], 0.0)).reshape(pp.sum(), -1).all(1)
        if bad.any():
            i = int(np.flatnonzero(pp)[bad][0])
            raise ValueError(f"{'dus' if transpose else 'd_etas_u'}[{i}]: contains non-finite "
                             f"values (nan or inf)")
        if pp.all() and (out_v is None if transpose else ins_v is None):
            # nothing asks for an eta_v part: no backward set (no untying) at all
            out_u[...] = 0.0
            out_u[pp] = _centre(handles.on, np.where(handles.on, ins_u[pp], 0.0))
            return None
        inner = ins_u
        if not transpose:
            inner = ins_u.copy()
            inner[pp] = 0.0
        _backward_padded(handles.handles, inner, ins_v, transpose, n_jobs, out_u, out_v)
        du = _centre(handles.on, ins_u[pp])
        out_u[pp] = du if transpose else out_u[pp] + du
        return None
    B = ins_u.shape[0]
    # a _Solutions holds no oracle (_solve_padded sends them down the general path)
    n_threads = max(1, min(_check_n_jobs(
        n_jobs, None if isinstance(handles, _Solutions) else [h.factor for h in handles]), B))
    sols = handles if isinstance(handles, _Solutions) else \
        [h._backward_solution() for h in handles]
    batch = _batch.prepare_backward(sols, ins_u, ins_v, transpose, n_threads,
                                         out_u, out_v)
    _run_batch(batch, n_threads)
    report = batch.report()
    if report:
        i = report[0][0]
        f = handles.solution(i).factor if isinstance(handles, _Solutions) else sols[i].factor
        name = "dus" if transpose else "d_etas_u"
        if not transpose and ins_v is not None and f.n_v and \
                np.isfinite(_blocks(f, ins_u[i:i + 1], False)[0]).all():
            name = "d_etas_v"
        raise ValueError(f"{name}[{i}]: contains non-finite values (nan or inf)")
