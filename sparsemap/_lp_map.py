"""LP-MAP decoding of a factor graph, with a certified duality gap.

The problem is AD3's LP-MAP: the LP relaxation of MAP over the local polytope,

    max_{u, p}  eta_u . u + sum_f eta_v[f] . N_f p_f
    s.t.        M_f p_f = l_f(u),  p_f in the simplex      (every factor f)
                0 <= u_i <= 1                              (variables in no factor)

(``l_f(u)``: the literals of factor ``f``, ``u_i`` or ``1 - u_i``).

How it is solved. Adding ``-1/(2t) ||u||^2`` to an LP does not change its
solution once ``t`` is large enough ("exact regularization": the perturbed
problem then picks the least-norm point of the LP's optimal face). The
perturbed problem, scaled by ``t``, is LP-SparseMAP with scores ``t eta``, which
:meth:`FactorGraph.solve` solves exactly: ADMM in which each factor step is
the warm-started active set on the factor's quadratic subproblem (AD3's QP
step), then a polish on the final faces certified by its KKT conditions. ``t``
starts at ``10 / max |eta|`` and grows tenfold until the gap below certifies
the answer; the ADMM penalty grows with it.

The certificate. For multipliers ``nu`` (one per link, literal space) with
``sum_{j in i} sigma_j nu_j = eta_i`` for every variable in a factor, LP
duality gives the upper bound

    D(nu) = sum_f max_s (nu_f . m_s + eta_v[f] . n_s) - sum_j nu_j s_j
            + sum_{i in no factor} max(0, eta_i)

(one MAP call per factor), and any feasible point gives a lower bound; the
gap is their difference. The perturbed problem's multipliers, divided by
``t`` and corrected so that they sum to ``eta`` (the correction ``u_i / t``
spread over the links of ``i``), give a bound that is tight (zero gap, up to
round-off) whenever the answer is integral and ``t`` large enough. When growing
``t`` stops paying (``u`` no longer moves, ADMM slows down or fails, or six
solves ran), the last good point's bound is improved: first by moving the
multipliers to the nearest ones that keep every support structure optimal (a
sparse least squares), then by column generation (Dantzig-Wolfe; Kelley's
cutting planes on the dual) from the supports: the LP restricted to a working
set of structures per factor (HiGHS), grown by MAP calls at its multipliers.
The restricted LP's solution is a point of the local polytope too, kept when
it certifies a smaller gap.

A graph in which no variable is in two factors needs none of this: the LP
splits into one MAP per factor, solved exactly.
"""
import warnings

import numpy as np

from sparsemap import _variables
from sparsemap._exceptions import ConvergenceWarning, warn
from sparsemap._factors._base import _as_float_array, check_positive_int, check_real

DEFAULT_TOL = 1e-9
INTEGRAL_TOL = 1e-9
PRIMAL_TOL = 1e-8  # largest primal residual of an accepted point
_T0 = 10.0         # the first t, times max |eta|
_GROWTH = 10.0
_SOLVES = 6
_STABLE = 1e-7     # u moved less than this between two solves: it looks LP-optimal
_SLOW = 2000       # ADMM iterations of a solve beyond which t stops growing


class MAPAssignment:
    """An integral point of the local polytope: a joint configuration.

    Attributes
    ----------
    u : ndarray of int, shape ``(n_variables,)``
        The 0/1 value of each variable.
    structures : list
        Per factor, its structure (compact form) consistent with ``u``.
    score : float
        ``eta_u . u + sum_f eta_v[f] . n_s``.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> fg = sm.FactorGraph(3)
    >>> _ = fg.add(sm.XorFactor(2), [0, 1])
    >>> _ = fg.add(sm.ImplyFactor(2), [1, 2])
    >>> a = fg.solve_map(np.array([0.2, 0.5, -0.2])).map
    >>> a.u, a.structures, round(a.score, 9)
    (array([0, 1, 1]), [array([0, 1]), array([1, 1])], 0.3)
    """

    def __init__(self, u, structures, score):
        self.u = u
        self.structures = structures
        self.score = float(score)

    def __repr__(self):
        return f"MAPAssignment(u={self.u!r}, score={self.score:.10g})"

    def value(self, x):
        """The 0/1 values of a VariableArray (``1 - u`` where negated), shaped like it."""
        return _variables.read(self.u, x)


class LPMAPResult:
    """Outcome of :meth:`FactorGraph.solve_map`: the LP-MAP solution and its certificate.

    Attributes
    ----------
    u : ndarray, shape ``(n_variables,)``
        The variables' values at the LP optimum: as a rule the least-norm
        point of the optimal face; the factors' MAP structures when the graph
        splits into single factors; a vertex of the optimal face when column
        generation had to finish the certificate.
    v : list of ndarray
        Per factor, its additional marginals ``N_f p_f`` (shape ``factor.shape_v``).
    structures, weights : list of list, list of ndarray
        Per factor, the structures the LP solution mixes and their weights.
    lp_value : float
        ``eta_u . u + sum_f eta_v[f] . v[f]``, the LP objective (a maximisation).
    dual_bound : float
        An upper bound on the LP optimum, from LP duality (see Notes).
    gap : float
        ``dual_bound - lp_value``: an upper bound on how far ``lp_value`` is
        below the LP optimum (``>= 0`` up to round-off).
    primal_residual : float
        ``max_{f, j} |l_fj(u) - (M_f p_f)_j|``: how far the factors' marginals
        are from ``u`` (round-off when the point was polished); ``gap``
        certifies ``lp_value`` for a point this close to the local polytope.
    converged : bool
        Whether ``gap <= tol * max(max |eta|, |lp_value|)`` (``tol`` itself when
        both are 0) and ``primal_residual <= 1e-8``.
    integral : bool
        Whether ``u`` is 0/1 (up to 1e-9; it is then rounded).
    map : MAPAssignment or None
        When ``integral``: the joint configuration ``u`` and the factors'
        structures. It is an exact MAP of the graph when ``exact``.
    exact : bool
        ``integral and converged``: the relaxation is tight here, and ``map``
        is a MAP assignment (no configuration scores more than
        ``dual_bound``).
    n_iter : int
        ADMM iterations run, over all solves.
    n_solves : int
        LP-SparseMAP solves run (0 when the graph splits into single factors).
    message : str

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> fg = sm.FactorGraph(4)
    >>> _ = fg.add(sm.BudgetFactor(3, 1), [0, 1, 2])
    >>> _ = fg.add(sm.OrFactor(2), [2, 3])
    >>> r = fg.solve_map(np.array([0.4, 0.9, 0.2, -0.5]))
    >>> r.exact, r.map.u, round(r.lp_value, 9), r.gap < 1e-9
    (True, array([0, 1, 0, 1]), 0.4, True)
    """

    def value(self, x):
        """The LP solution on a VariableArray (``1 - u`` where negated), shaped like it."""
        return _variables.read(self.u, x)

    def __repr__(self):
        return (f"LPMAPResult(converged={self.converged}, integral={self.integral}, "
                f"lp_value={self.lp_value:.10g}, gap={self.gap:.3g}, "
                f"primal_residual={self.primal_residual:.3g})")


class _Links:
    """The graph's links, flat: variable, sign and shift of each factor part."""

    def __init__(self, graph):
        self.factors = list(graph.factors)
        self.var = np.concatenate([np.asarray(v).reshape(-1) for v in graph.variables]
                                  + [np.zeros(0, np.intc)]).astype(np.intp)
        neg = np.concatenate([np.asarray(n).reshape(-1) for n in graph.negated]
                             + [np.zeros(0, bool)])
        self.sig = np.where(neg, -1.0, 1.0)
        self.sh = np.where(neg, 1.0, 0.0)
        self.tied = self.var >= 0
        self.deg = np.bincount(self.var[self.tied], minlength=graph.n_variables)
        self.off = np.cumsum([0] + [f.n_u for f in self.factors])

    def literal_scores(self, eta):
        """Per link, sigma_j eta_i (0 where untied): the factor's view of unary scores."""
        out = np.zeros(self.var.shape[0])
        out[self.tied] = self.sig[self.tied] * eta[self.var[self.tied]]
        return out

    def repair(self, nu, eta):
        """nu corrected so that sum_{j in i} sigma_j nu_j = eta_i, the residual spread evenly."""
        nu = np.where(self.tied, nu, 0.0)
        V = eta.shape[0]
        got = np.bincount(self.var[self.tied], self.sig[self.tied] * nu[self.tied], minlength=V)
        res = np.where(self.deg > 0, eta - got, 0.0) / np.maximum(self.deg, 1)
        nu[self.tied] += self.sig[self.tied] * res[self.var[self.tied]]
        return nu

    def dual_bound(self, nu, eta, eta_v):
        """D(nu): one MAP call per factor (nu must sum to eta on each variable)."""
        total = float(np.maximum(eta[self.deg == 0], 0.0).sum()) - float(nu @ self.sh)
        nu = np.ascontiguousarray(nu, dtype=np.float64)
        for f, factor in enumerate(self.factors):     # scores already checked: no validation
            total += factor._map_score(nu[self.off[f]:self.off[f + 1]], eta_v[f])[1]
        return total


def solve_map(graph, eta_u, eta_v=None, max_iter=None, tol=DEFAULT_TOL):
    """:meth:`FactorGraph.solve_map` (see there)."""
    from sparsemap._factor_graph import _check_per_factor

    V = graph.n_variables
    eu = _as_float_array(eta_u, "eta_u", (V,))
    ev = _check_per_factor(graph.factors, eta_v, "eta_v", zeros=True)
    if max_iter is not None:
        max_iter = check_positive_int(max_iter, "max_iter")
    tol = check_real(tol, "tol")
    links = _Links(graph)
    scale = max([float(np.abs(eu).max(initial=0.0))]
                + [float(np.abs(e).max(initial=0.0)) for e in ev])
    if np.all(links.deg <= 1):
        return _separable(graph, links, eu, ev, scale, tol)
    s = scale if scale > 0 else 1.0
    t = _T0 / s
    best, n_iter, last, prev_u = None, 0, None, None
    for k in range(_SOLVES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            r = graph._solve_quiet(t * eu, [t * e.reshape(f.shape_v) if f.n_v else None
                                            for e, f in zip(ev, graph.factors)],
                                   max_iter=max_iter, whole=False)    # reads the engine
        n_iter += r.n_iter
        out, nu = _from_solve(graph, links, r, t, eu, ev, scale, tol)
        if r.primal_residual <= PRIMAL_TOL:
            last = (r, out, nu)
        if best is None or _rank(out) < _rank(best):
            best = out
        best.n_solves = k + 1
        if best.converged:
            break
        # A larger t is the cheap way on (it certifies integral answers); stop when u no
        # longer moves (it looks LP-optimal), when ADMM slows down or fails at this scale,
        # or after the last solve, and certify the last good point by column generation.
        stable = prev_u is not None and np.abs(out.u - prev_u).max(initial=0.0) <= _STABLE
        if (stable or k == _SOLVES - 1 or r.n_iter > _SLOW
                or r.primal_residual > PRIMAL_TOL):
            if last is not None:
                out = _tighten(graph, links, *last, eu, ev, scale, tol)
                if _rank(out) < _rank(best):
                    best = out
                    best.n_solves = k + 1
            break
        prev_u = out.u
        t *= _GROWTH
    best.n_iter = n_iter
    if not best.converged:
        best.message = (f"the duality gap {best.gap:.3g} is above tol * scale after "
                        f"{best.n_solves} solves")
        warn(f"FactorGraph.solve_map: {best.message}; the answer is the best point "
             f"found (primal residual {best.primal_residual:.3g})")
    return best


def _rank(r):
    """Order of preference among candidates: accepted, then near-feasible, then small gaps."""
    return (not r.converged, r.primal_residual > PRIMAL_TOL, r.gap)


def _finish(graph, links, eu, ev, u, v, structures, weights, dual, residual, scale, tol):
    r = LPMAPResult()
    r.integral = bool(np.all(np.abs(u - np.round(u)) <= INTEGRAL_TOL))
    if r.integral:
        u = np.round(u) + 0.0           # the round-off of an integral optimum, and -0.0, go
    r.u, r.v = u, [x.reshape(f.shape_v) for x, f in zip(v, graph.factors)]
    r.structures, r.weights = structures, weights
    r.lp_value = float(eu @ u + sum(float(e @ x) for e, x in zip(ev, v)))
    r.dual_bound = float(dual)
    r.gap = r.dual_bound - r.lp_value
    r.primal_residual = float(residual)
    atol = tol * (max(scale, abs(r.lp_value)) or 1.0)      # all-zero scores: absolute tol
    r.converged = bool(r.gap <= atol and residual <= PRIMAL_TOL)
    r.map = _assignment(graph, links, eu, ev, u, structures) if r.integral else None
    r.exact = bool(r.integral and r.converged and r.map is not None
                   and r.map.score >= r.dual_bound - atol)
    r.n_iter, r.n_solves = 0, 0
    r.message = "converged" if r.converged else "duality gap above tolerance"
    return r


def _separable(graph, links, eu, ev, scale, tol):
    """No variable in two factors: the LP is one MAP per factor, solved exactly."""
    u = (eu > 0).astype(np.float64)        # variables in no factor
    theta = links.literal_scores(eu)
    v, structures = [], []
    for f, factor in enumerate(graph.factors):
        a, b = links.off[f], links.off[f + 1]
        ef = ev[f].reshape(factor.shape_v) if factor.n_v else None
        s = factor.map(theta[a:b].reshape(factor.shape_u), ef)
        m, n = factor.vertex(s)
        m = m.reshape(-1)
        tied = links.tied[a:b]
        u[links.var[a:b][tied]] = links.sig[a:b][tied] * (m[tied] - links.sh[a:b][tied])
        v.append(n.reshape(-1))
        structures.append([s])
    r = _finish(graph, links, eu, ev, u, v, structures, [np.ones(1) for _ in structures],
                0.0, 0.0, scale, tol)
    r.dual_bound, r.gap, r.converged = r.lp_value, 0.0, True
    r.exact = bool(r.integral and r.map is not None)
    r.message = "converged (one MAP per factor: no variable is in two factors)"
    return r


def _from_solve(graph, links, r, t, eu, ev, scale, tol):
    """The LP-MAP candidate of one LP-SparseMAP solve at scores t eta, with its bound."""
    u = np.array(r.u)
    free = links.deg == 0
    u[free] = (eu[free] > 0).astype(np.float64)
    v = [x.reshape(-1) for x in r.v]
    nu = links.repair(r._engine.multipliers() / t, eu)
    dual = links.dual_bound(nu, eu, ev)
    return _finish(graph, links, eu, ev, u, v, r.structures, r.weights, dual, r.primal_residual,
                   scale, tol), nu


def _tighten(graph, links, r, out, nu, eu, ev, scale, tol):
    """A better certificate for the candidate out (from the LP-SparseMAP result r, with
    multipliers nu): refined multipliers; then column generation, whose restricted LP
    also gives a point (kept when its gap is smaller)."""
    if out.converged or out.primal_residual > PRIMAL_TOL:
        return out
    u, v = out.u, [x.reshape(-1) for x in out.v]
    atol = tol * (max(scale, abs(out.lp_value)) or 1.0)
    nu2 = _refine(graph, links, nu, eu, ev, r.structures, out.lp_value, atol)
    if nu2 is not None:
        dual2 = links.dual_bound(links.repair(nu2, eu), eu, ev)
        if dual2 < out.dual_bound:
            nu = nu2
            out = _finish(graph, links, eu, ev, u, v, r.structures, r.weights, dual2,
                          r.primal_residual, scale, tol)
    if out.converged:
        return out
    nu2, primal = _cutting_planes(graph, links, nu, eu, ev, r.structures, out.lp_value, atol)
    if nu2 is None:
        return out
    dual = min(out.dual_bound, links.dual_bound(links.repair(nu2, eu), eu, ev))
    if _value(eu, ev, primal) > out.lp_value:
        pu, pv, S, W, res = primal
        return _finish(graph, links, eu, ev, pu, pv, S, W, dual, res, scale, tol)
    return _finish(graph, links, eu, ev, u, v, r.structures, r.weights, dual,
                   r.primal_residual, scale, tol)


def _refine(graph, links, nu, eu, ev, structures, value, atol):
    """The multipliers nearest nu that sum to eta on each variable and score every support
    structure of a factor alike: a sparse least-squares problem (scipy's LSQR)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.linalg import lsqr

    rows, cols, vals, rhs = [], [], [], []
    tied = np.flatnonzero(links.tied)
    # sum_j sigma_j nu_j = eta_i, for every variable in a factor
    order = np.flatnonzero(links.deg > 0)
    row_of = np.full(links.deg.shape[0], -1)
    row_of[order] = np.arange(order.size)
    rows.append(row_of[links.var[tied]])
    cols.append(tied)
    vals.append(links.sig[tied])
    rhs.append(eu[order])
    n_rows = order.size
    for f, factor in enumerate(graph.factors):
        S = structures[f]
        if len(S) < 2:
            continue
        a, b = links.off[f], links.off[f + 1]
        cols_f = np.flatnonzero(links.tied[a:b])
        m0, n0 = factor.vertex(S[0])
        for s in S[1:]:
            m, n = factor.vertex(s)
            dm = (m - m0).reshape(-1)[cols_f]
            keep = dm != 0
            rows.append(np.full(int(keep.sum()), n_rows))
            cols.append(a + cols_f[keep])
            vals.append(dm[keep])
            dn = (n - n0).reshape(-1)
            rhs.append(np.array([-(ev[f] @ dn) if factor.n_v else 0.0]))
            n_rows += 1
    A = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                   shape=(n_rows, links.var.shape[0])).tocsr()
    b = np.concatenate(rhs) - A @ nu
    delta = lsqr(A, b, atol=1e-15, btol=1e-15, iter_lim=20 * A.shape[1] + 100)[0]
    out = nu + delta
    return out if np.all(np.isfinite(out)) else None


def _assignment(graph, links, eu, ev, u, structures):
    """The joint configuration of an integral u: each factor's support structure that
    agrees with it (None if some factor has none, e.g. columns outside [0, 1])."""
    ui = np.round(u).astype(np.intp)
    lit = links.sh + links.sig * np.where(links.tied, ui[np.maximum(links.var, 0)], 0)
    chosen, score = [], float(eu @ ui)
    for f, factor in enumerate(graph.factors):
        a, b = links.off[f], links.off[f + 1]
        tied = links.tied[a:b]
        for s in structures[f]:
            m, n = factor.vertex(s)
            if np.array_equal(m.reshape(-1)[tied], lit[a:b][tied]):
                chosen.append(s)
                if factor.n_v:
                    score += float(ev[f] @ n.reshape(-1))
                break
        else:
            return None
    return MAPAssignment(ui, chosen, score)


def _cutting_planes(graph, links, nu, eu, ev, structures, value, atol, rounds=60):
    """The LP by column generation from the supports (Dantzig-Wolfe; on the dual side,
    Kelley's cutting planes): the LP restricted to a working set of structures per factor
    (HiGHS), grown by MAP calls at its multipliers until no structure is violated.

    Returns ``(nu, primal)``: the last multipliers (any give a valid bound), and the last
    restricted solution, a point of the local polytope, as ``(u, v, structures, weights,
    residual)`` (None if HiGHS failed). The multipliers stay within a box around ``nu``; a
    box that binds shows in the point's residual.
    """
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    L, F = links.var.shape[0], len(graph.factors)
    tied = np.flatnonzero(links.tied)
    order = np.flatnonzero(links.deg > 0)
    row_of = np.full(links.deg.shape[0], -1)
    row_of[order] = np.arange(order.size)
    A_eq = coo_matrix((links.sig[tied], (row_of[links.var[tied]], tied)),
                      shape=(order.size, L + F)).tocsr()
    b_eq = eu[order]
    width = 10.0 * (1.0 + float(np.abs(nu).max(initial=0.0)))
    bounds = [(x - width, x + width) if t else (0.0, 0.0) for x, t in zip(nu, links.tied)]
    bounds += [(None, None)] * F
    c = np.r_[-links.sh, np.ones(F)]
    work = []
    for f, factor in enumerate(graph.factors):
        work.append([])
        for s in structures[f]:
            m, n = factor.vertex(s)
            work[f].append((s, m.reshape(-1), n.reshape(-1)))
    best, primal = None, None
    for _ in range(rounds):
        rows, cols, vals, b_ub = [], [], [], []
        k = 0
        for f, cuts in enumerate(work):
            a = links.off[f]
            for _, m, n in cuts:
                nz = np.flatnonzero(m)
                rows += [k] * (nz.size + 1)
                cols += list(a + nz) + [L + f]
                vals += list(m[nz]) + [-1.0]
                b_ub.append(-(ev[f] @ n) if n.size else 0.0)
                k += 1
        A_ub = coo_matrix((vals, (rows, cols)), shape=(k, L + F)).tocsr()
        res = linprog(c, A_ub=A_ub, b_ub=np.array(b_ub), A_eq=A_eq, b_eq=b_eq, bounds=bounds,
                      method="highs", options={"primal_feasibility_tolerance": 1e-10,
                                               "dual_feasibility_tolerance": 1e-10})
        if res.status != 0:
            return best, primal
        best = res.x[:L]
        primal = _master_point(graph, links, eu, work, -res.ineqlin.marginals)
        bound = links.dual_bound(links.repair(best, eu), eu, ev)
        if bound - max(value, _value(eu, ev, primal)) <= atol:
            return best, primal
        added = False
        for f, factor in enumerate(graph.factors):       # the most violated structure
            nf = best[links.off[f]:links.off[f + 1]].reshape(factor.shape_u)
            ef = ev[f].reshape(factor.shape_v) if factor.n_v else None
            s = factor.map(nf, ef)
            m, n = factor.vertex(s)
            m, n = m.reshape(-1), n.reshape(-1)
            if not any(np.array_equal(m, m2) and np.array_equal(n, n2) for _, m2, n2 in work[f]):
                work[f].append((s, m, n))
                added = True
        if not added:
            return best, primal
    return best, primal


def _master_point(graph, links, eu, work, weights):
    """The restricted LP's solution as a point (u, v, structures, weights, residual)."""
    u = (eu > 0).astype(np.float64)
    lit = np.zeros(links.var.shape[0])
    v, S, W = [], [], []
    k = 0
    for f, cuts in enumerate(work):
        w = np.maximum(weights[k:k + len(cuts)], 0.0)
        k += len(cuts)
        w = w / w.sum() if w.sum() > 0 else np.full(len(cuts), 1.0 / len(cuts))
        keep = np.flatnonzero(w > 1e-14)
        a, b = links.off[f], links.off[f + 1]
        lit[a:b] = sum(w[i] * cuts[i][1] for i in keep)
        v.append(sum(w[i] * cuts[i][2] for i in keep) if cuts[0][2].size else cuts[0][2] * 0)
        S.append([cuts[i][0] for i in keep])
        W.append(w[keep] / w[keep].sum())
    t = links.tied
    y = links.sig[t] * (lit[t] - links.sh[t])          # each link's view of its variable
    deg = np.maximum(links.deg, 1)
    mean = np.bincount(links.var[t], y, minlength=u.shape[0]) / deg
    u[links.deg > 0] = mean[links.deg > 0]
    residual = float(np.abs(y - u[links.var[t]]).max(initial=0.0))
    return u, v, S, W, residual


def _value(eu, ev, primal):
    if primal is None or primal[4] > PRIMAL_TOL:
        return -np.inf
    return float(eu @ primal[0] + sum(float(e @ x) for e, x in zip(ev, primal[1])))
