"""Conditional-gradient solvers for SparseMAP (Appendix A.1, Algorithm 1).

Pure Python + NumPy over the factor's Python interface: the only access to the
structures is the MAP oracle (``factor._map_flat``) and the dense column of a
structure (``factor.vertex``), which is computed once per structure and cached.

The problem, as a minimisation over the marginal polytope (Appendix A):

    f(u, v) = 1/2 ||u||^2 - eta_u . u - eta_v . v,   [u; v] = A y,  y in the simplex.

Written in the style of FrankWolfe.jl: every variant is a small step function
over shared pieces,

- :func:`_fw_vertex`: the linear minimisation oracle (MAP at the adjusted scores
  ``eta_u - u``) and the Wolfe gap, an upper bound on suboptimality;
- :func:`_line_search`: the exact step of eq. 13 clipped to ``[0, gamma_max]``;
- :class:`_ActiveSet`: the support, its weights and cached dense columns.

Variants: ``"cg"`` (vanilla), ``"away_cg"`` (away steps), ``"pairwise_cg"``
(Lacoste-Julien & Jaggi, 2015) and ``"bpcg"`` (blended pairwise conditional
gradient, Tsuji, Tanaka & Pokutta, 2022: pairwise steps inside the support
while they promise at least as much as a Frank-Wolfe step, else a Frank-Wolfe
step).
"""
import time

import numpy as np

from sparsemap._active_set import (STATUS_CONVERGED, STATUS_MAX_ITER, STATUS_STALLED,
                                   STATUS_STOPPED, gap_scale, notify)

VARIANTS = ("cg", "away_cg", "pairwise_cg", "bpcg")


class _ActiveSet:
    """Support of the iterate: structures, weights, and their dense columns.

    Rows ``0 .. size-1`` of ``M`` and ``N`` hold the columns ``m_s`` and
    ``n_s`` of the active structures; removal swaps the last row in. Columns
    of every structure ever seen are cached by the structure's bytes, so a
    structure that leaves and comes back costs no new ``vertex`` call.
    """

    def __init__(self, factor):
        self.factor = factor
        self.n_u, self.n_v, self.k = factor.n_u, factor.n_v, factor.struct_size
        self._cache = {}
        self.index = {}            # structure bytes -> row
        self.size = 0
        cap = 16
        self.S = np.empty((cap, self.k), dtype=np.intc)
        self.y = np.empty(cap)
        self.M = np.empty((cap, self.n_u))
        self.N = np.empty((cap, self.n_v))

    def column(self, s):
        """Cached flat ``(m_s, n_s)`` of the intc structure ``s``."""
        key = s.tobytes()
        col = self._cache.get(key)
        if col is None:
            m, n = self.factor.vertex(s)
            col = (np.ascontiguousarray(m, dtype=np.float64).reshape(-1),
                   np.ascontiguousarray(n, dtype=np.float64).reshape(-1))
            self._cache[key] = col
        return col

    def find(self, s):
        return self.index.get(s.tobytes(), -1)

    def add(self, s, w):
        """Add weight ``w`` to ``s`` (appending it if new); return its row."""
        r = self.find(s)
        if r >= 0:
            self.y[r] += w
            return r
        if self.size == self.S.shape[0]:
            cap = 2 * self.size
            self.S = np.resize(self.S, (cap, self.k))
            self.y = np.resize(self.y, cap)
            self.M = np.resize(self.M, (cap, self.n_u))
            self.N = np.resize(self.N, (cap, self.n_v))
        r = self.size
        m, n = self.column(s)
        self.S[r] = s
        self.y[r] = w
        self.M[r] = m
        self.N[r] = n
        self.index[s.tobytes()] = r
        self.size += 1
        return r

    def remove(self, r):
        last = self.size - 1
        del self.index[self.S[r].tobytes()]
        if r != last:
            self.S[r] = self.S[last]
            self.y[r] = self.y[last]
            self.M[r] = self.M[last]
            self.N[r] = self.N[last]
            self.index[self.S[r].tobytes()] = r
        self.size = last

    def clean(self):
        """Drop structures whose weight reached zero (or below, by round-off); renormalise."""
        for r in np.flatnonzero(self.y[:self.size] <= 0.0)[::-1]:
            if self.size > 1:
                self.remove(int(r))
        w = self.y[:self.size]
        np.maximum(w, 0.0, out=w)
        w /= w.sum()

    def uv(self):
        """``u = M_I^T y`` and ``v = N_I^T y``, recomputed so they match the weights exactly."""
        y = self.y[:self.size]
        return y @ self.M[:self.size], y @ self.N[:self.size]

    def scores(self, g_u, eta_v):
        """Linearised scores ``g_u . m_s + eta_v . n_s`` of every active structure."""
        sc = self.M[:self.size] @ g_u
        if self.n_v:
            sc += self.N[:self.size] @ eta_v
        return sc


class _Vertex:
    """The Frank-Wolfe vertex at the current iterate and the quantities around it."""
    __slots__ = ("s", "m", "n", "score", "score_x", "gap", "scale", "g_u")


def _fw_vertex(factor, active, eta_u, eta_v, abs_eta_u, abs_eta_v, u, v, masked=None):
    """Linear minimisation oracle: MAP at the adjusted scores ``eta_u - u``.

    Returns the vertex, its linearised score, that of the iterate, and the
    Wolfe gap ``(eta_u - u).(m_s - u) + eta_v.(n_s - v)`` (eq. 14), an upper
    bound on ``f(u, v) - min f`` by convexity. ``masked``: the scores with
    their -inf entries, for MAP (``eta_u``, ``eta_v`` have 0 there).
    """
    fw = _Vertex()
    fw.g_u = eta_u - u
    if masked is None:
        fw.s = factor._map_flat(fw.g_u, eta_v)
    else:
        fw.s = factor._map_flat(masked[0] - u, masked[1])
    fw.m, fw.n = active.column(fw.s)
    eu, ev, usq = float(eta_u @ u), float(eta_v @ v), float(u @ u)
    fw.score = float(fw.g_u @ fw.m + eta_v @ fw.n)
    fw.score_x = eu - usq + ev
    fw.gap = fw.score - fw.score_x
    fw.scale = gap_scale(float(abs_eta_u @ np.abs(u) + abs_eta_v @ np.abs(v)), usq)
    return fw


def _line_search(g_u, eta_v, d_u, d_v, gamma_max):
    """Exact step along ``d`` (eq. 13), clipped to ``[0, gamma_max]``.

    ``f(x + gamma d) = f(x) - gamma g + gamma^2 / 2 ||d_u||^2`` with the
    directional gap ``g = (eta_u - u).d_u + eta_v.d_v``. When ``d_u = 0`` the
    objective is linear along ``d``: go all the way if it decreases.
    """
    g = float(g_u @ d_u + eta_v @ d_v)
    dsq = float(d_u @ d_u)
    if g <= 0.0:
        return 0.0
    if dsq <= 0.0:
        return gamma_max
    return min(gamma_max, g / dsq)


# -- steps: each updates the weights in place and returns the step size taken --------

def _forward_step(active, fw, u, v, eta_v):
    """Frank-Wolfe step towards the MAP vertex: ``d = a_s - x``, ``gamma_max = 1``."""
    gamma = _line_search(fw.g_u, eta_v, fw.m - u, fw.n - v, 1.0)
    if gamma <= 0.0:
        return 0.0
    if gamma >= 1.0:
        active.y[:active.size] = 0.0
        active.add(fw.s, 1.0)
    else:
        active.y[:active.size] *= 1.0 - gamma
        active.add(fw.s, gamma)
    return gamma


def _pairwise_move(active, fw, a, b, eta_v):
    """Move weight from active row ``b`` to structure ``a`` (row or MAP vertex): ``d = a_a - a_b``."""
    m_b, n_b = active.M[b], active.N[b]
    m_a, n_a = (fw.m, fw.n) if a is None else (active.M[a], active.N[a])
    y_b = active.y[b]
    gamma = _line_search(fw.g_u, eta_v, m_a - m_b, n_a - n_b, y_b)
    if gamma <= 0.0:
        return 0.0
    s_b = active.S[b].copy()
    if a is None:
        active.add(fw.s, gamma)
    else:
        active.y[a] += gamma
    b = active.find(s_b)
    # a drop step empties b exactly (no round-off residue)
    active.y[b] = 0.0 if gamma >= y_b else y_b - gamma
    return gamma


def step_cg(active, fw, u, v, eta_v):
    """Vanilla conditional gradient: always the Frank-Wolfe direction."""
    return _forward_step(active, fw, u, v, eta_v)


def step_away_cg(active, fw, u, v, eta_v):
    """Away-step CG: the better of the Frank-Wolfe and the away direction.

    The away vertex ``w`` is the active structure with the lowest linearised
    score; ``d = x - a_w`` with ``gamma_max = y_w / (1 - y_w)`` (a drop step
    when reached).
    """
    if active.size == 1:
        return _forward_step(active, fw, u, v, eta_v)
    sc = active.scores(fw.g_u, eta_v)
    w = int(np.argmin(sc))
    gap_away = fw.score_x - float(sc[w])
    if fw.gap >= gap_away:
        return _forward_step(active, fw, u, v, eta_v)
    y_w = active.y[w]
    gamma_max = y_w / (1.0 - y_w)
    gamma = _line_search(fw.g_u, eta_v, u - active.M[w], v - active.N[w], gamma_max)
    if gamma <= 0.0:
        return 0.0
    active.y[:active.size] *= 1.0 + gamma
    active.y[w] = 0.0 if gamma >= gamma_max else active.y[w] - gamma
    return gamma


def step_pairwise_cg(active, fw, u, v, eta_v):
    """Pairwise CG: move weight from the away vertex to the MAP vertex, ``gamma_max = y_w``."""
    sc = active.scores(fw.g_u, eta_v)
    w = int(np.argmin(sc))
    if active.find(fw.s) == w:   # only when every active score ties: nothing to move
        return _forward_step(active, fw, u, v, eta_v)
    return _pairwise_move(active, fw, None, w, eta_v)


def step_bpcg(active, fw, u, v, eta_v):
    """Blended pairwise CG (Tsuji, Tanaka & Pokutta, 2022).

    A pairwise step between the best and the worst active structure (local,
    no new structure) when its gap is at least the Frank-Wolfe gap, otherwise
    a vanilla Frank-Wolfe step. The support grows only on Frank-Wolfe steps.
    """
    sc = active.scores(fw.g_u, eta_v)
    w = int(np.argmin(sc))
    a = int(np.argmax(sc))
    if a != w and float(sc[a] - sc[w]) >= fw.gap:
        return _pairwise_move(active, fw, a, w, eta_v)
    return _forward_step(active, fw, u, v, eta_v)


_STEPS = {"cg": step_cg, "away_cg": step_away_cg, "pairwise_cg": step_pairwise_cg,
          "bpcg": step_bpcg}


def conditional_gradient(factor, eta_u, eta_v, variant="pairwise_cg", max_iter=10_000,
                         tol=1e-12, return_history=False, callback=None):
    """Run a conditional-gradient variant on validated, flattened float64 scores.

    Parameters
    ----------
    factor : Factor
    eta_u, eta_v : ndarray of float64, 1-d
        Scores of sizes ``factor.n_u`` and ``factor.n_v``.
    variant : {"cg", "away_cg", "pairwise_cg", "bpcg"}
    max_iter : int
        Maximum number of steps.
    tol : float
        Converged when ``gap <= tol * gap_scale(|eta_u|.|u| + |eta_v|.|v|, ||u||^2)``,
        the active set's rule.
    return_history : bool
    callback : callable, optional
        Called after every step with the iterate's figures, as in
        :func:`sparsemap.solve`; returning True or raising StopIteration
        stops the solve (``STATUS_STOPPED``).

    Returns
    -------
    dict
        Keys (``sparsemap._solve`` makes a solution of them with
        ``sparsemap._backward.solution_from_arrays``):
        ``structures`` ((k, struct_size) intc), ``weights`` (> 0, sum 1), ``u``,
        ``v`` (flat), ``L`` (None: the result factorises the support itself for
        the backward pass), ``n_iter``, ``status`` (``STATUS_CONVERGED``,
        ``STATUS_MAX_ITER``, or ``STATUS_STALLED`` when a step could not move
        the iterate),
        ``gap`` (of the returned point), ``objective``, ``n_map`` and
        ``history`` (None or an ``(n_iter, 4)`` array of objective, gap,
        support size and seconds since the start; row ``i`` is the state after
        iteration ``i + 1``).

    Notes
    -----
    Iteration ``t`` makes one MAP call at the current iterate, which gives the
    Wolfe gap there; if that is within tolerance the iteration ends (it still
    counts, as in the active set), otherwise the variant takes one step. The
    gap of a history row is thus filled in by the next iteration's MAP call,
    so recording the history costs no extra oracle call.
    """
    if variant not in _STEPS:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    step = _STEPS[variant]
    t0 = time.perf_counter()
    eta_u = np.asarray(eta_u, dtype=np.float64)
    eta_v = np.asarray(eta_v, dtype=np.float64)
    active = _ActiveSet(factor)
    active.add(factor._map_flat(eta_u, eta_v), 1.0)
    masked = None
    if np.isneginf(eta_u).any() or np.isneginf(eta_v).any():
        # Masks: MAP sees the -inf scores, so no structure of the support uses
        # a forbidden part; the dense products use 0 there (0 * -inf is nan).
        masked = (eta_u, eta_v)
        eta_u = np.where(np.isneginf(eta_u), 0.0, eta_u)
        eta_v = np.where(np.isneginf(eta_v), 0.0, eta_v)
    abs_eta_u, abs_eta_v = np.abs(eta_u), np.abs(eta_v)
    n_map = 1
    hist = np.zeros((max_iter + 1, 4)) if return_history else None
    it = 0
    status = None
    moved = True
    u, v = active.uv()
    while True:
        fw = _fw_vertex(factor, active, eta_u, eta_v, abs_eta_u, abs_eta_v, u, v, masked)
        n_map += 1
        if hist is not None and it > 0:
            hist[it - 1, 1] = fw.gap
        if callback is not None and it > 0 and notify(
                callback, it, _objective(eta_u, eta_v, u, v), fw.gap, active.size,
                time.perf_counter() - t0, u.reshape(factor.shape_u).copy()):
            status = STATUS_STOPPED
            break
        if fw.gap <= tol * fw.scale:
            status = STATUS_CONVERGED
            if it < max_iter:      # the check is an iteration of its own, as in the active set
                it += 1
                if hist is not None:
                    hist[it - 1] = (_objective(eta_u, eta_v, u, v), fw.gap, active.size,
                                    time.perf_counter() - t0)
            break
        if it >= max_iter:
            status = STATUS_MAX_ITER
            break
        if not moved:
            # round-off floor: the last step could not move, neither will the next
            status = STATUS_STALLED
            break
        moved = step(active, fw, u, v, eta_v) > 0.0
        active.clean()
        u, v = active.uv()
        it += 1
        if hist is not None:
            hist[it - 1] = (_objective(eta_u, eta_v, u, v), np.nan, active.size,
                            time.perf_counter() - t0)
    k = active.size
    return dict(structures=active.S[:k].copy(), weights=active.y[:k].copy(), u=u, v=v,
                L=None, n_iter=it, status=status, gap=fw.gap,
                objective=_objective(eta_u, eta_v, u, v), n_map=n_map,
                history=None if hist is None else hist[:it].copy())


def _objective(eta_u, eta_v, u, v):
    return float(0.5 * (u @ u) - eta_u @ u - eta_v @ v)
