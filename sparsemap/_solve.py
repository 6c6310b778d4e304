"""``solve``: the single entry point to every SparseMAP solver, and its result type."""
import math
import numbers
import warnings

import numpy as np

from sparsemap import _active_set
from sparsemap._active_set import STATUS_CONVERGED, STATUS_MAX_ITER, STATUS_STALLED
from sparsemap._cg import conditional_gradient
from sparsemap._factors._base import Factor, _as_float_array

METHODS = ("active_set", "cg", "away_cg", "pairwise_cg", "bpcg")
DEFAULT_TOL = 1e-12
DEFAULT_MAX_ITER = 10_000

_MESSAGES = {
    STATUS_CONVERGED: "converged",
    STATUS_MAX_ITER: "maximum number of iterations reached",
    STATUS_STALLED: "stalled: no further progress in double precision "
                    "(round-off floor or degenerate cycling)",
}


class ConvergenceWarning(UserWarning):
    """A solver stopped before its duality gap reached the tolerance."""


class SparseMAPResult:
    """Outcome of :func:`solve`.

    Attributes
    ----------
    u : ndarray, shape ``factor.shape_u``
        SparseMAP posterior ``M y*``.
    v : ndarray, shape ``factor.shape_v``
        ``N y*`` (empty when the factor has no ``eta_v``).
    structures : list
        The support: structures in the factor's compact form.
    weights : ndarray
        Their weights ``y*`` (positive, summing to one).
    n_iter : int
        Iterations run.
    n_map : int
        Calls to the MAP oracle.
    converged : bool
        Whether ``gap <= tol * gap_scale`` (see :func:`solve`).
    gap : float
        Wolfe duality gap of the returned point, an upper bound on
        ``objective - min objective``. Always computed at return.
    objective : float
        ``1/2 ||u||^2 - eta_u . u - eta_v . v`` (eq. 6 as a minimisation).
    history : dict of ndarray or None
        With ``return_history=True``: per iteration ``"objective"``, ``"gap"``,
        ``"support_size"`` and ``"seconds"`` (elapsed since the start).
    method : str
    message : str
    """

    def __init__(self, factor, raw, method, eta_u, eta_v):
        self.factor = factor
        self.method = method
        self._S = np.ascontiguousarray(raw["structures"], dtype=np.intc)
        self.weights = np.asarray(raw["weights"], dtype=np.float64)
        self._structures = None
        self.u = np.asarray(raw["u"]).reshape(factor.shape_u)
        self.v = np.asarray(raw["v"]).reshape(factor.shape_v)
        self.n_iter = int(raw["n_iter"])
        self.n_map = int(raw["n_map"])
        self.converged = raw["status"] == STATUS_CONVERGED
        self.gap = float(raw["gap"])
        self.objective = float(raw["objective"])
        self.message = _MESSAGES[raw["status"]]
        h = raw.get("history")
        self.history = None if h is None else {
            "objective": h[:, 0].copy(), "gap": h[:, 1].copy(),
            "support_size": h[:, 2].astype(int), "seconds": h[:, 3].copy()}
        # The support and Cholesky factor the backward pass uses; a solver that
        # returns no factor (CG) gets a reduced support on first use.
        self._backward = None if raw["L"] is None else (self._S, raw["L"])
        self._eta = (eta_u, eta_v) if self._backward is None else None  # for the reduction

    @property
    def structures(self):
        """The support, as a list of structures in the factor's compact form."""
        if self._structures is None:  # built on first use: solves in a loop rarely need it
            self._structures = [self.factor._to_public(s) for s in self._S]
        return self._structures

    def __repr__(self):
        return (f"SparseMAPResult(method={self.method!r}, converged={self.converged}, "
                f"n_iter={self.n_iter}, support={len(self._S)}, "
                f"gap={self.gap:.3g}, objective={self.objective:.10g})")

    def _backward_state(self):
        if self._backward is None:
            # CG may end on an affinely dependent support: reduce it (same u).
            S, _, L = _active_set.reduce_support(self.factor, self._S, self.weights, *self._eta)
            self._backward = (S, L)
        return self._backward

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
        Proposition 1: ``du = M_I D A_I^T d_eta`` with
        ``D = Z - Z 1 1^T Z / (1^T Z 1)`` and ``Z = (M_I^T M_I)^{-1}`` on the
        support, from the kept Cholesky factor in ``O(|I| n + |I|^2)``.
        """
        du, dv = self.factor.check_scores(d_eta_u, d_eta_v, names=("d_eta_u", "d_eta_v"))
        S, L = self._backward_state()
        return _active_set.jvp(self.factor, S, L, du, dv).reshape(self.factor.shape_u)

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
        """
        g = _as_float_array(du, "du", self.factor.shape_u).reshape(-1)
        S, L = self._backward_state()
        gu, gv = _active_set.vjp(self.factor, S, L, g)
        return gu.reshape(self.factor.shape_u), gv.reshape(self.factor.shape_v)


def _check_init(factor, init):
    if init is None:
        return None
    if isinstance(init, SparseMAPResult):
        # Any valid structures make a correct warm start; validate them for this factor.
        init = init.structures
    try:
        seq = list(init)
    except TypeError:
        raise ValueError(f"init: expected a SparseMAPResult or a list of structures, got {init!r}")
    if len(seq) == 0:
        return None
    return factor.check_structures(seq, "init")


def solve(factor, eta_u, eta_v=None, method="active_set", max_iter=None, tol=DEFAULT_TOL,
          init=None, return_history=False):
    """Solve SparseMAP: ``argmax_{y in simplex} eta^T A y - 1/2 ||M y||^2`` (eq. 6).

    Parameters
    ----------
    factor : Factor
        Any factor (:class:`SequenceFactor`, :class:`TreeFactor`,
        :class:`MatchingFactor`, :class:`GenericFactor`, :class:`OracleFactor`, ...).
    eta_u : array_like, shape ``factor.shape_u``
        Unary scores.
    eta_v : array_like, shape ``factor.shape_v``, optional
        Additional scores (zeros when omitted).
    method : {"active_set", "cg", "away_cg", "pairwise_cg", "bpcg"}
        The active set (Cython, exact; Appendix A.2) or a conditional-gradient
        variant (pure Python; Appendix A.1): vanilla, away-step, pairwise, or
        blended pairwise (Tsuji, Tanaka and Pokutta, 2022).
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
        weights; repeated ones are skipped and one affinely dependent on those
        before it replaces one of them (as in the solver's own insertions).
        Any valid structures of the factor will do. Active set only.
    return_history : bool, default False
        Record objective, gap, support size and seconds at every iteration
        (this costs one extra MAP call on iterations that make none).

    Returns
    -------
    SparseMAPResult

    Warns
    -----
    ConvergenceWarning
        When the gap is above tolerance at return (``converged=False``); the
        best iterate is still returned, with its gap.
    """
    if not isinstance(factor, Factor):
        raise ValueError(f"factor: expected a sparsemap Factor, got {type(factor).__name__}")
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    if max_iter is None:
        max_iter = DEFAULT_MAX_ITER
    if type(max_iter) is not int:
        if isinstance(max_iter, bool) or not isinstance(max_iter, numbers.Integral):
            raise ValueError(f"max_iter: expected a positive integer, got {max_iter!r}")
        max_iter = int(max_iter)
    if max_iter < 1:
        raise ValueError(f"max_iter: expected a positive integer, got {max_iter!r}")
    if type(tol) is not float:
        if isinstance(tol, bool) or not isinstance(tol, numbers.Real):
            raise ValueError(f"tol: expected a finite non-negative float, got {tol!r}")
        tol = float(tol)
    if not math.isfinite(tol) or tol < 0:
        raise ValueError(f"tol: expected a finite non-negative float, got {tol!r}")
    eu, ev = factor.check_scores(eta_u, eta_v)
    S0 = _check_init(factor, init)
    if method == "active_set":
        raw = _active_set.active_set(factor, eu, ev, int(max_iter), float(tol), S0,
                                     bool(return_history))
    else:
        if S0 is not None:
            raise ValueError("init: warm starts are supported by method='active_set' only")
        raw = conditional_gradient(factor, eu, ev, variant=method, max_iter=int(max_iter),
                                   tol=float(tol), return_history=bool(return_history))
    result = SparseMAPResult(factor, raw, method, eu, ev)
    if not result.converged:
        warnings.warn(f"SparseMAP ({method}) stopped after {result.n_iter} iterations with "
                      f"gap {result.gap:.3g} ({result.message}); raise max_iter or tol.",
                      ConvergenceWarning, stacklevel=2)
    return result
