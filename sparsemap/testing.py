"""Tools to property-test SparseMAP factors, your own included.

The checks here rely on nothing but the public interface (``solve``,
``factor.vertex``, ``factor.check_structure``) and on the mathematics of the
SparseMAP QP (eq. 6), so they are usable for a factor you wrote yourself:

- :func:`enumerate_structures` lists every structure of a small factor by
  brute force, and :func:`dense_columns` stacks their columns ``a_s``;
- :func:`check_kkt` checks a result against the optimality (KKT) conditions
  over all structures;
- :func:`check_jacobian` compares ``result.jvp`` with central finite
  differences wherever ``u`` is locally linear (decided by one-sided
  differences at two step sizes) and checks ``result.vjp`` against it
  (adjoint identity);
- :func:`tie_direction` is the direction along which the backward pass
  breaks exact ties in ``eta_v`` (where ``u`` has a kink in ``eta_v``, its
  ``jvp`` and ``vjp`` are the derivative along it), to check that against;
  for a :class:`~sparsemap.SequenceFactor` it is one matrix repeated at every
  transition, :func:`shared_tie_direction`;
- :func:`factors`, :func:`scores` and :func:`problems` are
  `hypothesis <https://hypothesis.readthedocs.io>`_ strategies drawing small
  factors of every built-in family and scores at many scales.

Hypothesis is needed only by the strategies and is imported when one of them
is called; it is part of the ``test`` extra (``pip install -e ".[test]"`` in
the repository's clone).

Examples
--------
>>> import numpy as np, sparsemap as sm
>>> from sparsemap.testing import check_kkt, check_jacobian
>>> f = sm.SequenceFactor(4, 3)
>>> rng = np.random.default_rng(0)
>>> eta_u, eta_v = rng.normal(size=f.shape_u), rng.normal(size=f.shape_v)
>>> r = sm.solve(f, eta_u, eta_v)
>>> report = check_kkt(f, r, eta_u, eta_v)           # or AssertionError
>>> report = check_jacobian(f, eta_u, eta_v, rng=0)  # or AssertionError
"""
import itertools
from dataclasses import dataclass, field

import numpy as np

import sparsemap
from sparsemap._factors._base import _as_float_array
from sparsemap._factors._logic import _BinaryFactor

__all__ = ["enumerate_structures", "dense_columns", "support_key", "check_kkt",
           "KKTReport", "finite_difference_jvp", "check_jacobian", "JacobianReport",
           "tie_direction", "shared_tie_direction",
           "factors", "scores", "problems", "FAMILIES"]

#: Family names understood by :func:`factors`.
FAMILIES = ("sequence", "tree", "matching", "generic", "logic")


# -- brute force over structures ----------------------------------------------------

def _candidate_values(factor):
    """Per position of the compact form, the integers it may take (a superset)."""
    if isinstance(factor, sparsemap.GenericFactor):
        return [range(factor.n_structures)]
    if isinstance(factor, sparsemap.SequenceFactor):
        return [range(factor.n_states)] * factor.n_positions
    if isinstance(factor, sparsemap.TreeFactor):
        n = factor.n_words
        return [[-1]] + [[h for h in range(n + 1) if h != m] for m in range(1, n + 1)]
    if isinstance(factor, sparsemap.MatchingFactor):
        low = -1 if factor.n_rows > factor.n_cols else 0
        return [range(low, factor.n_cols)] * factor.n_rows
    if isinstance(factor, sparsemap.KnapsackFactor):   # codes: 2 is the fractional entry
        return [(0, 1, 2)] * factor.struct_size
    if isinstance(factor, _BinaryFactor):   # the logic factors: 0/1 vectors
        return [(0, 1)] * factor.struct_size
    return None


def enumerate_structures(factor, values=None, max_candidates=1_000_000):
    """Every structure of a small factor, by brute force.

    Candidates are all integer arrays of length ``factor.struct_size`` whose
    entries are drawn from ``values``; those that ``factor.check_structure``
    rejects (with ``ValueError``) are dropped.

    Parameters
    ----------
    factor : Factor
        A built-in factor (the candidate values are known), or any factor
        together with ``values``.
    values : sequence of iterables of int, optional
        ``values[i]``: the integers entry ``i`` of a compact structure may take.
        Required for factors other than the built-in families.
    max_candidates : int, default 1_000_000
        Refuse (``ValueError``) when the number of candidates exceeds this.

    Returns
    -------
    list
        The structures in the factor's compact form, in lexicographic order of
        their integer entries.

    Raises
    ------
    ValueError
        ``values`` is needed but missing or has the wrong length, or there are
        too many candidates.

    Examples
    --------
    >>> import sparsemap as sm
    >>> from sparsemap.testing import enumerate_structures
    >>> len(enumerate_structures(sm.SequenceFactor(3, 2)))
    8
    """
    if values is None:
        values = _candidate_values(factor)
        if values is None:
            raise ValueError(f"values: cannot infer the compact form of "
                             f"{type(factor).__name__}; pass values, one iterable of ints "
                             f"per entry of a structure ({factor.struct_size} entries)")
    values = [list(v) for v in values]
    if len(values) != factor.struct_size:
        raise ValueError(f"values: expected {factor.struct_size} iterables (one per entry of "
                         f"a structure), got {len(values)}")
    n_candidates = int(np.prod([len(v) for v in values], dtype=float))
    if n_candidates > max_candidates:
        raise ValueError(f"max_candidates: the factor has {n_candidates} candidate structures, "
                         f"more than max_candidates={max_candidates}")
    out = []
    for cand in itertools.product(*values):
        try:
            arr = factor.check_structure(np.array(cand, dtype=np.intc), "s")
        except ValueError:
            continue
        out.append(factor._to_public(arr))
    return out


def dense_columns(factor, structures):
    """Stack the dense columns of structures.

    Parameters
    ----------
    factor : Factor
    structures : sequence of structures in compact form

    Returns
    -------
    M : ndarray, shape ``(factor.n_u, len(structures))``
        Column ``j`` is ``m_s`` of ``structures[j]``, flattened.
    N : ndarray, shape ``(factor.n_v, len(structures))``
        Column ``j`` is ``n_s``, flattened.

    Examples
    --------
    >>> import sparsemap as sm
    >>> from sparsemap.testing import dense_columns
    >>> M, N = dense_columns(sm.SequenceFactor(2, 2), [[0, 1], [1, 1]])
    >>> M                                # one column per structure
    array([[1., 0.],
           [0., 1.],
           [0., 0.],
           [1., 1.]])
    >>> N                                # the transitions 0 -> 1 and 1 -> 1
    array([[0., 0.],
           [1., 0.],
           [0., 0.],
           [0., 1.]])
    """
    M = np.zeros((factor.n_u, len(structures)))
    N = np.zeros((factor.n_v, len(structures)))
    for j, s in enumerate(structures):
        m, n = factor.vertex(s)
        M[:, j] = m.reshape(-1)
        N[:, j] = n.reshape(-1)
    return M, N


def support_key(structures):
    """A hashable, order-free key of a set of structures.

    Parameters
    ----------
    structures : sequence of structures in compact form

    Returns
    -------
    frozenset of bytes
        The int64 bytes of each structure; two supports are the same set of
        structures exactly when their keys are equal.

    Examples
    --------
    >>> from sparsemap.testing import support_key
    >>> support_key([[0, 1], [1, 1]]) == support_key([[1, 1], [0, 1]])
    True
    >>> support_key([[0, 1]]) == support_key([[0, 1], [1, 1]])
    False
    """
    return frozenset(np.asarray(s, dtype=np.int64).reshape(-1).tobytes() for s in structures)


# -- optimality -----------------------------------------------------------------------

@dataclass
class KKTReport:
    """Outcome of :func:`check_kkt`.

    Attributes
    ----------
    tau : float
        The multiplier of ``1^T y = 1``: the weighted mean adjusted score on the support.
    max_violation : float
        ``max_s (adjusted score of s) - tau`` over all structures (<= tol when optimal).
    support_spread : float
        ``max |adjusted score - tau|`` over the support (0 when optimal).
    u_error, v_error : float
        ``max |u - sum_s w_s m_s|`` and the same for ``v``.
    gap : float
        The Wolfe duality gap of the result computed by enumeration,
        ``max_s adj_s - (eta_u . u + eta_v . v - ||u||^2)``.
    tol : float
        The tolerance used for the score conditions (``atol + rtol * scale``).
    n_structures : int
        Number of structures compared.

    Examples
    --------
    Sparsemax of ``[1, 0.5, -1]`` is ``[0.75, 0.25, 0]``, with threshold 0.25:

    >>> import numpy as np, sparsemap as sm
    >>> from sparsemap.testing import check_kkt
    >>> eta = np.array([1.0, 0.5, -1.0])
    >>> f = sm.XorFactor(3)
    >>> report = check_kkt(f, sm.solve(f, eta), eta)
    >>> print(round(report.tau, 12), report.n_structures)
    0.25 3
    >>> report.support_spread < 1e-12, report.gap < 1e-12
    (True, True)
    """
    tau: float
    max_violation: float
    support_spread: float
    u_error: float
    v_error: float
    gap: float
    tol: float
    n_structures: int


def check_kkt(factor, result, eta_u, eta_v=None, structures=None, atol=1e-9, rtol=1e-9):
    """Check a SparseMAP solution against the KKT conditions over all structures.

    With ``theta_s = eta_u . m_s + eta_v . n_s``, ``y`` solves eq. 6 exactly when
    there is a ``tau`` such that every structure's adjusted score
    ``(eta_u - u) . m_s + eta_v . n_s = theta_s - m_s . u`` is at most ``tau``,
    with equality on the support (``y_s > 0``), and ``u = sum_s y_s m_s``.
    With masks (``-inf`` scores), "every structure" means every allowed one,
    and the support must use no forbidden part.

    Parameters
    ----------
    factor : Factor
    result : SparseMAPResult
        Or any object with ``u``, ``v``, ``structures`` and ``weights``.
    eta_u : array_like, shape ``factor.shape_u``
        The scores ``result`` was solved for.
    eta_v : array_like, shape ``factor.shape_v``, optional
        Zeros when omitted, as in :func:`sparsemap.solve`.
    structures : sequence of structures, optional
        All structures of the factor (default: :func:`enumerate_structures`).
    atol, rtol : float
        The score conditions hold up to ``atol + rtol * scale``, where
        ``scale = max(1, max_s |eta| . |a_s| + max_s ||m_s||_1)`` is the size of
        the terms that make up an adjusted score; ``u`` and ``v`` must match the
        weighted columns to ``atol + rtol * max(1, max_s ||m_s||_1)``.

    Returns
    -------
    KKTReport

    Raises
    ------
    AssertionError
        When a condition fails; the message says which and by how much.
    ValueError
        ``structures`` is empty, or omitted for a factor this function cannot
        enumerate (not a built-in family, or too many structures).

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> from sparsemap.testing import check_kkt
    >>> f = sm.TreeFactor(3)
    >>> eta = np.random.default_rng(0).standard_normal((4, 4))
    >>> r = sm.solve(f, eta)
    >>> report = check_kkt(f, r, eta)
    >>> report.n_structures, report.max_violation <= report.tol
    (16, True)

    The same result is not optimal for other scores:

    >>> check_kkt(f, r, 2 * eta)
    Traceback (most recent call last):
        ...
    AssertionError: KKT conditions fail for TreeFactor(3, ...
    """
    if not all(hasattr(result, a) for a in ("u", "v", "structures", "weights")):
        raise ValueError(f"result: expected a SparseMAPResult (or an object with u, v, "
                         f"structures and weights), got {type(result).__name__}; the "
                         f"arguments are check_kkt(factor, result, eta_u, eta_v=None)")
    eu, ev = factor.check_scores(eta_u, eta_v)
    if structures is None:
        try:
            structures = enumerate_structures(factor)
        except ValueError as exc:
            if str(exc).startswith("values:"):   # not a family it knows
                raise ValueError(f"structures: check_kkt cannot list the structures of "
                                 f"{factor!r} by itself; pass them, e.g. structures="
                                 f"enumerate_structures(factor, values=...) with the integers "
                                 f"each entry may take") from None
            raise ValueError(f"structures: {factor!r} has too many structures to enumerate "
                             f"here; pass the structures to compare with, or use a smaller "
                             f"factor") from None
    if len(structures) == 0:   # nothing to compare with: the check could not fail
        raise ValueError("structures: expected at least one structure")
    M, N = dense_columns(factor, structures)
    forbid_u, forbid_v = np.isneginf(eu), np.isneginf(ev)
    masked = bool(forbid_u.any() or forbid_v.any())
    if masked:
        # masks: the problem is the one over the allowed structures, whose
        # columns are 0 on the forbidden parts (scored 0 there, not -inf)
        allowed = ~((M[forbid_u] != 0).any(axis=0) | (N[forbid_v] != 0).any(axis=0))
        if not allowed.any():
            raise ValueError("eta_u, eta_v: every structure uses a forbidden part (-inf)")
        structures = [s for s, a in zip(structures, allowed) if a]
        M, N = M[:, allowed], N[:, allowed]
        eu, ev = np.where(forbid_u, 0.0, eu), np.where(forbid_v, 0.0, ev)
    S = list(result.structures)
    w = np.asarray(result.weights, dtype=np.float64)
    u = np.asarray(result.u, dtype=np.float64).reshape(-1)
    v = np.asarray(result.v, dtype=np.float64).reshape(-1)
    if len(S) == 0 or len(S) != w.shape[0]:
        raise AssertionError(f"support: {len(S)} structures but {w.shape[0]} weights")
    if not np.all(w > 0) or abs(w.sum() - 1) > 1e-12 * len(w) + atol:
        raise AssertionError(f"weights: expected positive weights summing to 1, got {w!r} "
                             f"(sum {w.sum()!r})")
    MS, NS = dense_columns(factor, S)
    if masked and ((MS[forbid_u] != 0).any() or (NS[forbid_v] != 0).any()):
        raise AssertionError("support: a structure uses a forbidden part (-inf score)")
    col_scale = max(1.0, float(np.abs(M).sum(axis=0).max(initial=0.0)))
    u_error = float(np.abs(MS @ w - u).max(initial=0.0))
    v_error = float(np.abs(NS @ w - v).max(initial=0.0))
    adj_all = M.T @ (eu - u) + N.T @ ev
    adj_sup = MS.T @ (eu - u) + NS.T @ ev
    tau = float(w @ adj_sup)
    scale = max(1.0, float((np.abs(M).T @ np.abs(eu) + np.abs(N).T @ np.abs(ev)).max(initial=0.0))
                + col_scale)
    tol = atol + rtol * scale
    report = KKTReport(
        tau=tau,
        max_violation=float(adj_all.max() - tau),
        support_spread=float(np.abs(adj_sup - tau).max()),
        u_error=u_error, v_error=v_error,
        gap=float(adj_all.max() - (eu @ u + ev @ v - u @ u)),
        tol=tol, n_structures=len(structures))
    problems = []
    if u_error > atol + rtol * col_scale:
        problems.append(f"u != sum_s w_s m_s (max error {u_error:.3g})")
    if v_error > atol + rtol * col_scale:
        problems.append(f"v != sum_s w_s n_s (max error {v_error:.3g})")
    if report.support_spread > tol:
        i = int(np.argmax(np.abs(adj_sup - tau)))
        problems.append(f"adjusted scores differ on the support by up to "
                        f"{report.support_spread:.3g} (structure {S[i]!r}: {adj_sup[i]!r}, "
                        f"tau {tau!r})")
    if report.max_violation > tol:
        i = int(np.argmax(adj_all))
        problems.append(f"structure {structures[i]!r} has adjusted score {adj_all[i]!r} > "
                        f"tau {tau!r} by {report.max_violation:.3g}")
    if problems:
        raise AssertionError(f"KKT conditions fail for {factor!r} (tolerance {tol:.3g}): "
                             + "; ".join(problems))
    return report


# -- Jacobian -------------------------------------------------------------------------

def tie_direction(factor):
    """The direction ``r`` along which the backward pass breaks ties in ``eta_v``.

    Where ``u`` is not differentiable in ``eta_v`` because the optimal face
    holds structures whose ``n_s`` is not an affine function of ``m_s`` (for
    example a :class:`~sparsemap.SequenceFactor` at transition scores that
    tie exactly, such as a zero-initialised transition matrix), ``jvp`` and
    ``vjp`` are the Jacobian of the affine piece that ``u`` follows from
    ``eta`` along ``(0, r)``: the limit of the Jacobians at
    ``(eta_u, eta_v + t r)`` as ``t`` decreases to 0. It is one fixed
    pseudo-random direction per factor size (the same every call).

    Parameters
    ----------
    factor : Factor

    Returns
    -------
    r : ndarray, shape ``factor.shape_v``
        Entries uniform in ``[-1, 1)``.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> from sparsemap.testing import tie_direction
    >>> f = sm.SequenceFactor(4, 2)
    >>> r = tie_direction(f)
    >>> r.shape, bool(np.abs(r).max() < 1)
    ((3, 2, 2), True)
    >>> eta_u = np.array([[0.3, 0.2], [0.1, 0.4], [0.5, 0.6], [0.0, 0.2]])
    >>> res = sm.solve(f, eta_u)           # eta_v = 0: every transition ties
    >>> h = 1e-7                           # the jvp along (0, r) is the
    >>> du = (sm.solve(f, eta_u, h * r).u - res.u) / h   # one-sided derivative
    >>> bool(np.allclose(res.jvp(np.zeros(f.shape_u), r), du, atol=1e-6))
    True
    """
    if not isinstance(factor, sparsemap.Factor):
        raise ValueError(f"factor: expected a sparsemap Factor, got {type(factor).__name__}")
    return sparsemap._active_set.tie_direction(factor).reshape(factor.shape_v)


def shared_tie_direction(factor):
    """The tie direction of a sequence, as the one (S, S) matrix ``R0`` it repeats.

    :func:`tie_direction` of a :class:`~sparsemap.SequenceFactor` is ``R0`` at
    every transition, so that a transition matrix ``T`` shared by the positions
    (an ``(S, S)`` ``eta_v``: :func:`sparsemap.solve`, or a broadcast one in
    :mod:`sparsemap.torch`) breaks its ties along a shared direction too: at
    exact ties (``T = 0``, a zero-initialised matrix) the gradient is the
    limit of the gradients at ``T = t R0`` as ``t`` decreases to 0, the
    derivative one step of training meets (it moves every position's
    transitions alike), and ``<g, R0>`` is the one-sided derivative along
    ``R0``. ``R0`` depends on ``S`` only.

    Parameters
    ----------
    factor : SequenceFactor

    Returns
    -------
    R0 : ndarray, shape ``(S, S)``
        Entries uniform in ``[-1, 1)``.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> from sparsemap.testing import shared_tie_direction, tie_direction
    >>> f = sm.SequenceFactor(6, 3)
    >>> R0 = shared_tie_direction(f)
    >>> bool(np.all(tie_direction(f) == R0))   # at every transition
    True
    >>> eta_u = np.array([[0.3, 0.2, 0.0]] * 6)
    >>> res = sm.solve(f, eta_u, np.zeros((3, 3)))    # one shared matrix, at 0
    >>> du = np.eye(6, 3)
    >>> g = res.vjp(du)[1]                             # its gradient, (3, 3)
    >>> t = 1e-7
    >>> diff = (sm.solve(f, eta_u, t * R0).u - res.u) / t
    >>> bool(np.isclose((g * R0).sum(), (du * diff).sum(), atol=1e-6))
    True
    """
    if type(factor) is not sparsemap.SequenceFactor:
        raise ValueError(f"factor: expected a SequenceFactor, got {type(factor).__name__}")
    S = factor.n_states
    return sparsemap._active_set.tie_direction(sparsemap.SequenceFactor(2, S)).reshape(S, S)


def _direction(d, name, shape):
    """A flat float64 copy of a direction of the given shape (zeros for None)."""
    if d is None:
        return np.zeros(int(np.prod(shape, dtype=np.int64)))
    return _as_float_array(d, name, tuple(shape)).reshape(-1).copy()


def finite_difference_jvp(factor, eta_u, eta_v=None, d_eta_u=None, d_eta_v=None, eps=1e-6,
                          method="auto", return_results=False, **solve_kwargs):
    """Central finite difference of ``u`` along a direction of the scores.

    ``(u(eta + eps d) - u(eta - eps d)) / (2 eps)``. On a region where the
    support does not change, ``u`` is affine in ``eta``, so the difference is
    exact up to round-off; across a change of support it is not a derivative.

    Parameters
    ----------
    factor : Factor
    eta_u, eta_v : array_like
        The scores (``eta_v`` None means zeros).
    d_eta_u, d_eta_v : array_like, optional
        The direction (None means zeros).
    eps : float, default 1e-6
        The absolute step.
    method : str, default "auto"
        Passed to :func:`sparsemap.solve`, with ``solve_kwargs``.
    return_results : bool, default False
        Also return the two results (to compare their supports).

    Returns
    -------
    du : ndarray, shape ``factor.shape_u``
    r_minus, r_plus : SparseMAPResult
        Only with ``return_results=True``.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> from sparsemap.testing import finite_difference_jvp
    >>> f = sm.XorFactor(3)
    >>> eta = np.array([1.0, 0.5, -1.0])
    >>> d = np.array([1.0, 0.0, 0.0])
    >>> print(np.round(finite_difference_jvp(f, eta, d_eta_u=d), 6))
    [ 0.5 -0.5  0. ]
    >>> print(sm.solve(f, eta).jvp(d))   # the exact Jacobian agrees
    [ 0.5 -0.5  0. ]
    """
    eu, ev = factor.check_scores(eta_u, eta_v)
    du_dir = _direction(d_eta_u, "d_eta_u", factor.shape_u)
    dv_dir = _direction(d_eta_v, "d_eta_v", factor.shape_v)
    if not (np.isfinite(eps) and eps > 0):
        raise ValueError(f"eps: expected a positive finite float, got {eps!r}")
    shp_u, shp_v = factor.shape_u, factor.shape_v
    r_plus = sparsemap.solve(factor, (eu + eps * du_dir).reshape(shp_u),
                             (ev + eps * dv_dir).reshape(shp_v), method=method, **solve_kwargs)
    r_minus = sparsemap.solve(factor, (eu - eps * du_dir).reshape(shp_u),
                              (ev - eps * dv_dir).reshape(shp_v), method=method, **solve_kwargs)
    du = (r_plus.u - r_minus.u) / (2 * eps)
    if return_results:
        return du, r_minus, r_plus
    return du


@dataclass
class JacobianReport:
    """Outcome of :func:`check_jacobian`.

    Attributes
    ----------
    n_directions : int
        Directions drawn.
    n_checked : int
        Directions compared against finite differences.
    skipped : list of bool
        Per direction, whether it was skipped: ``u`` is not linear along it
        within the steps (its one-sided differences at two step sizes
        disagree: a kink, where no derivative exists to compare with).
    max_error : float
        Largest ``max |fd - jvp|`` over checked directions.
    max_adjoint_error : float
        Largest ``|<vjp(g), d> - <g, jvp(d)>|`` over all directions.
    max_symmetry_error : float
        Largest ``max |vjp(g)_u - jvp(g, 0)|``: the Jacobian of ``u`` with
        respect to ``eta_u`` is symmetric (a Hessian of a convex function).
    step : float
        The smaller absolute finite-difference step ``h`` (the other is ``10 h``).
    max_nonlinearity : list of float
        Per direction, the largest disagreement between its one-sided
        differences (what decided whether it was skipped).

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> from sparsemap.testing import check_jacobian
    >>> eta = np.array([1.0, 0.5, -1.0])
    >>> report = check_jacobian(sm.XorFactor(3), eta, rng=0)
    >>> report.n_checked, report.skipped
    (3, [False, False, False])
    >>> report.max_adjoint_error < 1e-12, report.max_symmetry_error < 1e-12
    (True, True)
    """
    n_directions: int
    n_checked: int
    skipped: list = field(default_factory=list)
    max_error: float = 0.0
    max_adjoint_error: float = 0.0
    max_symmetry_error: float = 0.0
    step: float = 0.0
    max_nonlinearity: list = field(default_factory=list)

    @property
    def n_skipped(self):
        """Directions skipped because ``u`` is not linear along them within the steps."""
        return int(sum(self.skipped))

    def __str__(self):
        return (f"checked {self.n_checked} of {self.n_directions} directions against finite "
                f"differences (max error {self.max_error:.3g}); {self.n_skipped} skipped "
                f"(u not locally linear along them)")


def check_jacobian(factor, eta_u, eta_v=None, eps=1e-6, rtol=1e-5, atol=1e-6, n_directions=3,
                   rng=None, method="auto", min_checked=1, **solve_kwargs):
    """Check ``result.jvp`` and ``result.vjp`` of a factor at given scores.

    For each of ``n_directions`` random directions ``d = (d_eta_u, d_eta_v)``
    (standard normal, scaled to unit max-norm):

    1. solve at ``eta`` and at ``eta +/- h d`` and ``eta +/- 10 h d`` with
       ``h = eps * max(1, max |eta|)``, giving four one-sided differences
       (forward and backward, at both steps). ``u`` is piecewise affine in
       ``eta``: it is linear along ``d`` within the steps exactly when they
       agree, up to ``atol + rtol * max |fd|``. Otherwise ``d`` crosses a kink
       (a change of the optimal face) within ``10 h``, no derivative exists
       to compare with, and the direction is *skipped*. This decides by ``u``
       alone, never by comparing supports (which need not be unique). At
       scores exactly on a kink, ``u`` may still be linear along some
       directions while the products are one element of the generalized
       Jacobian, which need not match them: check at generic scores;
    2. otherwise require ``max |fd - jvp(d)| <= atol + rtol * max |jvp(d)|``,
       with ``fd`` the central difference at step ``h``;
    3. for a random ``g``, require the adjoint identity
       ``<vjp(g), d> == <g, jvp(d)>`` and the symmetry
       ``vjp(g)_u == jvp(g, 0)`` (the Jacobian of ``u`` in ``eta_u`` is the
       Hessian of a convex function), up to ``atol + rtol * scale``.

    Parameters
    ----------
    factor : Factor
    eta_u : array_like, shape ``factor.shape_u``
    eta_v : array_like, shape ``factor.shape_v``, optional (zeros)
    eps : float, default 1e-6
        Relative finite-difference step.
    rtol, atol : float
        Tolerances of the comparisons.
    n_directions : int, default 3
    rng : None, int or numpy.random.Generator
        Source of the random directions.
    method : str, default "auto"
        Passed to :func:`sparsemap.solve`, with ``solve_kwargs``.
    min_checked : int, default 1
        Fewest directions that must be checked against finite differences:
        fewer (every direction on a kink) raise AssertionError saying so,
        rather than report a check that did not happen. Pass 0 at scores
        chosen on kinks.

    Returns
    -------
    JacobianReport
        ``str(report)`` says how many directions were checked and skipped.

    Raises
    ------
    AssertionError
        On a mismatch, with the direction and both values in the message; or
        when fewer than ``min_checked`` directions could be checked.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> from sparsemap.testing import check_jacobian
    >>> f = sm.TreeFactor(6)
    >>> eta = 0.1 * np.random.default_rng(0).standard_normal(f.shape_u)
    >>> report = check_jacobian(f, eta, rng=0)
    >>> report.n_checked, report.skipped
    (3, [False, False, False])
    >>> bool(report.max_error < 1e-6)
    True
    """
    if isinstance(n_directions, bool) or not isinstance(n_directions, (int, np.integer)) \
            or n_directions < 1:
        raise ValueError(f"n_directions: expected a positive integer, got {n_directions!r}")
    if isinstance(min_checked, bool) or not isinstance(min_checked, (int, np.integer)) \
            or not 0 <= min_checked <= n_directions:
        raise ValueError(f"min_checked: expected an integer in [0, n_directions], "
                         f"got {min_checked!r}")
    if not (np.isfinite(eps) and eps > 0):
        raise ValueError(f"eps: expected a positive finite float, got {eps!r}")
    rng = np.random.default_rng(rng)
    eu, ev = factor.check_scores(eta_u, eta_v)
    shp_u, shp_v = factor.shape_u, factor.shape_v

    def u_at(t, du_dir, dv_dir):
        return sparsemap.solve(factor, (eu + t * du_dir).reshape(shp_u),
                               (ev + t * dv_dir).reshape(shp_v), method=method,
                               **solve_kwargs).u.reshape(-1)

    r0 = sparsemap.solve(factor, eu.reshape(shp_u), ev.reshape(shp_v), method=method,
                         **solve_kwargs)
    u0 = r0.u.reshape(-1)
    eta_max = max(float(np.abs(eu).max(initial=0.0)), float(np.abs(ev).max(initial=0.0)))
    h = eps * max(1.0, eta_max)
    report = JacobianReport(n_directions=int(n_directions), n_checked=0, step=h)
    for _ in range(int(n_directions)):
        du_dir = rng.standard_normal(factor.n_u)
        dv_dir = rng.standard_normal(factor.n_v)
        norm = max(float(np.abs(du_dir).max(initial=0.0)), float(np.abs(dv_dir).max(initial=0.0)))
        du_dir /= norm
        dv_dir /= norm
        jvp = np.asarray(r0.jvp(du_dir.reshape(shp_u), dv_dir.reshape(shp_v))).reshape(-1)
        u_p, u_m = u_at(h, du_dir, dv_dir), u_at(-h, du_dir, dv_dir)
        u_P, u_M = u_at(10 * h, du_dir, dv_dir), u_at(-10 * h, du_dir, dv_dir)
        sides = [(u_p - u0) / h, (u0 - u_m) / h, (u_P - u0) / (10 * h), (u0 - u_M) / (10 * h)]
        fd = (u_p - u_m) / (2 * h)
        spread = max(float(np.abs(a - fd).max(initial=0.0)) for a in sides)
        report.max_nonlinearity.append(spread)
        skipped = spread > atol + rtol * float(np.abs(fd).max(initial=0.0))
        report.skipped.append(bool(skipped))
        if not skipped:
            report.n_checked += 1
            err = float(np.abs(fd - jvp).max(initial=0.0))
            report.max_error = max(report.max_error, err)
            if err > atol + rtol * float(np.abs(jvp).max(initial=0.0)):
                raise AssertionError(
                    f"jvp does not match central finite differences for {factor!r} "
                    f"(step {h:.3g}, max error {err:.3g}):\n d_eta_u={du_dir!r}\n "
                    f"d_eta_v={dv_dir!r}\n jvp={jvp!r}\n fd={fd!r}")
        g = rng.standard_normal(factor.n_u)
        gu, gv = r0.vjp(g.reshape(shp_u))
        gu = np.asarray(gu).reshape(-1)
        gv = np.asarray(gv).reshape(-1)
        lhs = float(gu @ du_dir + gv @ dv_dir)
        rhs = float(g @ jvp)
        scale = max(1.0, float(np.linalg.norm(g)) * float(np.linalg.norm(np.r_[du_dir, dv_dir])))
        err = abs(lhs - rhs)
        report.max_adjoint_error = max(report.max_adjoint_error, err)
        if err > atol + rtol * scale:
            raise AssertionError(f"adjoint identity <vjp(g), d> == <g, jvp(d)> fails for "
                                 f"{factor!r}: {lhs!r} != {rhs!r} (g={g!r})")
        jg = np.asarray(r0.jvp(g.reshape(shp_u), np.zeros(shp_v))).reshape(-1)
        err = float(np.abs(jg - gu).max(initial=0.0))
        report.max_symmetry_error = max(report.max_symmetry_error, err)
        if err > atol + rtol * max(1.0, float(np.abs(g).max(initial=0.0))):
            raise AssertionError(f"the Jacobian of u in eta_u is not symmetric for {factor!r}: "
                                 f"jvp(g)={jg!r} != vjp(g)_u={gu!r} (g={g!r})")
    if report.n_checked < min_checked:
        raise AssertionError(
            f"check_jacobian checked {report.n_checked} of {report.n_directions} directions "
            f"against finite differences (min_checked={min_checked}) for {factor!r}: u is not "
            f"linear along the others within the steps (a kink; largest disagreement of "
            f"one-sided differences {max(report.max_nonlinearity):.3g}). Nothing was checked "
            f"there; pass min_checked=0 to allow it, or other scores.")
    return report


# -- hypothesis strategies --------------------------------------------------------------

def _hypothesis():
    try:
        import hypothesis.strategies as st
        from hypothesis.extra import numpy as hnp
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("sparsemap.testing strategies need hypothesis "
                          "(pip install hypothesis, or pip install -e '.[test]' in the "
                          "repository's clone)") from exc
    return st, hnp


def _check_families(families):
    if families is None:
        return list(FAMILIES)
    if isinstance(families, str):
        families = [families]
    out = list(families)
    for fam in out:
        if fam not in FAMILIES:
            raise ValueError(f"families: expected names among {FAMILIES}, got {fam!r}")
    if not out:
        raise ValueError("families: expected at least one family")
    return out


def factors(families=None, max_size=None):
    """Hypothesis strategy drawing small factors of the built-in families.

    Sizes are small enough for :func:`enumerate_structures` (at most a few
    hundred structures).

    Parameters
    ----------
    families : str or sequence of str, optional
        Among :data:`FAMILIES`: ``"sequence"`` (up to 5 positions, 3 states),
        ``"tree"`` (up to 4 words; projective or not, single root or not),
        ``"matching"`` (up to 4 x 4), ``"generic"`` (random 0/1 columns with
        zero columns, exact duplicates and columns equal in ``M`` but different
        in ``N``), ``"logic"`` (the logic factors with 0/1 vertices,
        :class:`~sparsemap.XorFactor` to :class:`~sparsemap.SequenceBudgetFactor`
        and :class:`~sparsemap.ImplyFactor`, up to 6 variables, budgets at most
        and exactly). Default: every family.
    max_size : int, optional
        Cap on the size parameters above (positions, words, rows, columns).

    Returns
    -------
    hypothesis.strategies.SearchStrategy of Factor

    Notes
    -----
    Needs hypothesis (the ``test`` extra), imported when called.

    Examples
    --------
    A property test: MAP at zero scores returns a valid structure.

    >>> import numpy as np
    >>> from hypothesis import given, settings
    >>> from sparsemap.testing import factors
    >>> @settings(max_examples=20, database=None, derandomize=True)
    ... @given(factors(["tree", "matching"], max_size=3))
    ... def test_map_is_valid(f):
    ...     f.check_structure(f.map(np.zeros(f.shape_u), np.zeros(f.shape_v)))
    >>> test_map_is_valid()              # raises if a drawn factor fails
    """
    st, hnp = _hypothesis()
    fams = _check_families(families)
    cap = (lambda k: k) if max_size is None else (lambda k: max(1, min(k, int(max_size))))

    @st.composite
    def generic(draw):
        n_u = draw(st.integers(1, cap(4)))
        k = draw(st.integers(1, cap(6)))
        M = draw(hnp.arrays(np.float64, (n_u, k), elements=st.sampled_from([0.0, 1.0])))
        if draw(st.booleans()):   # a structure whose m_s is zero
            M = np.insert(M, draw(st.integers(0, M.shape[1])), 0.0, axis=1)
        n_v = draw(st.integers(0, 2))
        if n_v == 0:
            return sparsemap.GenericFactor(M)
        N = draw(hnp.arrays(np.float64, (n_v, M.shape[1]),
                            elements=st.sampled_from([0.0, 1.0])))
        if draw(st.booleans()):   # same m_s, different n_s
            j = draw(st.integers(0, M.shape[1] - 1))
            M = np.c_[M, M[:, j]]
            N = np.c_[N, 1.0 - N[:, j]]
        return sparsemap.GenericFactor(M, N)

    @st.composite
    def logic(draw):
        kind = draw(st.sampled_from(["xor", "at_most_one", "or", "budget", "pair", "or_out",
                                     "and_out", "xor_out", "sequence_budget", "imply"]))
        if kind == "pair":
            return sparsemap.PairFactor()
        low = {"or_out": 3, "and_out": 3, "xor_out": 2, "imply": 2}.get(kind, 1)
        n = draw(st.integers(low, max(low, cap(6))))
        if kind in ("budget", "sequence_budget"):
            exact = draw(st.booleans())
            budget = draw(st.integers(0, n if exact else n + 1))
            cls = sparsemap.BudgetFactor if kind == "budget" else sparsemap.SequenceBudgetFactor
            return cls(n, budget, exact=exact)
        return {"xor": sparsemap.XorFactor, "at_most_one": sparsemap.AtMostOneFactor,
                "or": sparsemap.OrFactor, "or_out": sparsemap.OrOutFactor,
                "and_out": sparsemap.AndOutFactor, "xor_out": sparsemap.XorOutFactor,
                "imply": sparsemap.ImplyFactor}[kind](n)

    strategies = {
        "sequence": st.builds(sparsemap.SequenceFactor,
                              st.integers(1, cap(5)), st.integers(1, min(cap(5), 3))),
        "tree": st.builds(sparsemap.TreeFactor, st.integers(1, cap(4)),
                          projective=st.booleans(), single_root=st.booleans()),
        "matching": st.builds(sparsemap.MatchingFactor,
                              st.integers(1, cap(4)), st.integers(1, cap(4))),
        "generic": generic(),
        "logic": logic(),
    }
    return st.one_of(*[strategies[f] for f in fams])


_SCALES = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3)
_KINDS = ("gaussian", "ties", "floats")


def scores(factor, scale=None, kinds=_KINDS):
    """Hypothesis strategy drawing scores ``(eta_u, eta_v)`` for a factor.

    Parameters
    ----------
    factor : Factor
    scale : float or sequence of float, optional
        Magnitude of the scores; default: one of 1e-3, 1e-2, ..., 1e3.
    kinds : sequence of str, default ("gaussian", "ties", "floats")
        ``"gaussian"``: standard normal entries (generic position: ties have
        probability zero); ``"ties"``: entries from ``{-1, 0, 0.5, 1}`` (many
        ties); ``"floats"``: hypothesis floats in ``[-1, 1]`` (shrinkable,
        includes boundary values). Each is multiplied by the scale.

    Returns
    -------
    hypothesis.strategies.SearchStrategy of (ndarray, ndarray)
        ``eta_u`` of shape ``factor.shape_u`` and ``eta_v`` of shape
        ``factor.shape_v`` (possibly empty).

    Notes
    -----
    Needs hypothesis (the ``test`` extra), imported when called.

    Examples
    --------
    A property test: the active set meets the KKT conditions at any scale.

    >>> import sparsemap as sm
    >>> from hypothesis import given, settings
    >>> from sparsemap.testing import scores, check_kkt
    >>> f = sm.SequenceFactor(3, 2)
    >>> @settings(max_examples=20, database=None, derandomize=True)
    ... @given(scores(f, scale=[0.1, 10.0]))
    ... def test_kkt(eta):
    ...     eta_u, eta_v = eta
    ...     check_kkt(f, sm.solve(f, eta_u, eta_v), eta_u, eta_v)
    >>> test_kkt()                       # raises if a drawn problem fails
    """
    st, hnp = _hypothesis()
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    for k in kinds:
        if k not in _KINDS:
            raise ValueError(f"kinds: expected names among {_KINDS}, got {k!r}")
    if scale is None:
        scale_st = st.sampled_from(_SCALES)
    else:
        try:
            values = [float(s) for s in np.atleast_1d(np.asarray(scale, dtype=np.float64))]
        except (TypeError, ValueError):
            values = []
        if not values or not all(np.isfinite(v) and v > 0 for v in values):
            raise ValueError(f"scale: expected a positive finite float or a non-empty "
                             f"sequence of them, got {scale!r}")
        scale_st = st.sampled_from(values)
    shp_u, shp_v = factor.shape_u, factor.shape_v

    def gaussian(seed):
        rng = np.random.default_rng(seed)
        return rng.standard_normal(shp_u), rng.standard_normal(shp_v)

    by_kind = {
        "gaussian": st.integers(0, 2 ** 32 - 1).map(gaussian),
        "ties": st.tuples(
            hnp.arrays(np.float64, shp_u, elements=st.sampled_from([-1.0, 0.0, 0.5, 1.0])),
            hnp.arrays(np.float64, shp_v, elements=st.sampled_from([-1.0, 0.0, 0.5, 1.0]))),
        "floats": st.tuples(
            hnp.arrays(np.float64, shp_u, elements=st.floats(-1, 1, allow_subnormal=False)),
            hnp.arrays(np.float64, shp_v, elements=st.floats(-1, 1, allow_subnormal=False))),
    }
    base = st.one_of(*[by_kind[k] for k in kinds])
    return st.tuples(base, scale_st).map(lambda t: (t[0][0] * t[1], t[0][1] * t[1]))


def problems(families=None, scale=None, kinds=_KINDS, max_size=None):
    """Hypothesis strategy drawing ``(factor, eta_u, eta_v)``.

    Combines :func:`factors` and :func:`scores`; parameters as there.

    Returns
    -------
    hypothesis.strategies.SearchStrategy of (Factor, ndarray, ndarray)

    Examples
    --------
    >>> import sparsemap as sm
    >>> from hypothesis import given, settings
    >>> from sparsemap.testing import problems, check_kkt
    >>> @settings(max_examples=20, database=None, derandomize=True)
    ... @given(problems(["logic", "generic"], max_size=4))
    ... def test_kkt(problem):
    ...     f, eta_u, eta_v = problem
    ...     check_kkt(f, sm.solve(f, eta_u, eta_v), eta_u, eta_v)
    >>> test_kkt()                       # raises if a drawn problem fails
    """
    fac = factors(families, max_size=max_size)
    return fac.flatmap(lambda f: scores(f, scale=scale, kinds=kinds).map(
        lambda e: (f, e[0], e[1])))
