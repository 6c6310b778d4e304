"""Independent references shared by the tests: closed forms, a NumPy Viterbi, a SciPy QP,
brute-force enumeration of structures, their dense columns, the logic factors'
configurations.

Nothing here imports sparsemap. Each function is a textbook formula or algorithm
written separately from the package, so a test comparing against it compares the
package with something that cannot share its bugs.
"""
import itertools

import numpy as np
from scipy.optimize import minimize, nnls


def sparsemax(z):
    """Euclidean projection onto the simplex (Martins & Astudillo, 2016), by sorting."""
    z = np.asarray(z, dtype=float)
    zs = np.sort(z)[::-1]
    cs = np.cumsum(zs)
    k = np.arange(1, z.size + 1)
    kz = k[1 + k * zs > cs][-1]
    return np.maximum(z - (cs[kz - 1] - 1) / kz, 0.0)


def sparsemax_jacobian(z):
    """diag(s) - s s^T / |S|, s the indicator of the support."""
    s = (sparsemax(z) > 0).astype(float)
    return np.diag(s) - np.outer(s, s) / s.sum()


def pairwise_closed_form(c1, c2, c12):
    """SparseMAP of two binary variables with a pairwise score (cf. Martins' thesis, Prop. 6.5).

    Structures (z1, z2) in {0, 1}^2 with m_s = (z1, z2) and n_s = z1 z2, so the
    QP over the marginal polytope {(u1, u2, v): max(0, u1 + u2 - 1) <= v <= min(u1, u2)}
    is

        max  c1 u1 + c2 u2 + c12 v - (u1^2 + u2^2) / 2.

    For fixed (u1, u2) the objective is linear in v, so v sits at an end of its range:
    v = min(u1, u2) if c12 >= 0, v = max(0, u1 + u2 - 1) if c12 < 0. What is left is
    a concave function of (u1, u2) on [0, 1]^2, piecewise quadratic across one line.

    c12 >= 0: maximise c1 u1 + c2 u2 + c12 min(u1, u2) - ...
      * on u1 >= u2 it is c1 u1 + (c2 + c12) u2 - ..., maximised over the box at
        (clip(c1), clip(c2 + c12)); this lies in u1 >= u2 iff c1 >= c2 + c12 (clip is
        monotone), and then, by concavity, it is the global maximum;
      * symmetrically (clip(c1 + c12), clip(c2)) if c2 >= c1 + c12;
      * otherwise |c1 - c2| < c12 and the maximum is on the line u1 = u2 = w, where
        the objective is (c1 + c2 + c12) w - w^2: w = clip((c1 + c2 + c12) / 2).
    c12 < 0: maximise c1 u1 + c2 u2 + c12 max(0, u1 + u2 - 1) - ...
      * on u1 + u2 <= 1 the objective separates: (clip(c1), clip(c2)), valid iff the
        sum is <= 1;
      * on u1 + u2 >= 1 it is (c1 + c12) u1 + (c2 + c12) u2 - ...:
        (clip(c1 + c12), clip(c2 + c12)), valid iff the sum is >= 1;
      * otherwise the maximum is on the line u1 + u2 = 1, u1 = w:
        c1 w + c2 (1 - w) - (w^2 + (1 - w)^2) / 2 has derivative c1 - c2 + 1 - 2 w,
        so w = clip((c1 - c2 + 1) / 2).
    Returns (u1, u2, v) (v is not unique when c12 == 0; min(u1, u2) is returned).
    """
    clip = lambda x: min(max(x, 0.0), 1.0)  # noqa: E731
    if c12 >= 0:
        if c1 >= c2 + c12:
            u1, u2 = clip(c1), clip(c2 + c12)
        elif c2 >= c1 + c12:
            u1, u2 = clip(c1 + c12), clip(c2)
        else:
            u1 = u2 = clip((c1 + c2 + c12) / 2)
        return u1, u2, min(u1, u2)
    if clip(c1) + clip(c2) <= 1:
        u1, u2 = clip(c1), clip(c2)
    elif clip(c1 + c12) + clip(c2 + c12) >= 1:
        u1, u2 = clip(c1 + c12), clip(c2 + c12)
    else:
        u1 = clip((c1 - c2 + 1) / 2)
        u2 = 1 - u1
    return u1, u2, max(0.0, u1 + u2 - 1)


def box_sum_projection(a, lo=-np.inf, hi=np.inf):
    """Euclidean projection of a onto {z in [0, 1]^n : lo <= sum(z) <= hi}.

    If clip(a, 0, 1) is feasible it is the answer; otherwise the violated bound
    holds with equality and the answer is clip(a - tau, 0, 1) with the scalar tau
    making the sum equal to that bound (Pardalos and Kovoor). The sum is
    piecewise linear and non-increasing in tau with breakpoints a_i - 1 and a_i,
    so tau is found by evaluating it at every breakpoint and interpolating
    linearly (O(n^2), for tests). Covers the simplex (lo = hi = 1), at most one
    (hi = 1), at least one (lo = 1) and the budget polytopes.
    """
    a = np.asarray(a, dtype=float)
    z = np.clip(a, 0.0, 1.0)
    if lo <= z.sum() <= hi:
        return z
    target = hi if z.sum() > hi else lo
    assert 0 <= target <= a.size
    # breakpoints, and two points beyond them where the sum is exactly n and 0
    bps = np.unique(np.r_[a.min() - 2.0, a - 1.0, a, a.max() + 1.0])
    g = np.array([np.clip(a - t, 0.0, 1.0).sum() for t in bps])    # non-increasing
    j = np.flatnonzero(g >= target).max()
    if g[j] == target or j == bps.size - 1:
        tau = bps[j]
    else:
        tau = bps[j] + (g[j] - target) * (bps[j + 1] - bps[j]) / (g[j] - g[j + 1])
    return np.clip(a - tau, 0.0, 1.0)


def xor_out_projection(a):
    """Projection onto conv{z : z[-1] = sum(z[:-1]) <= 1}: sparsemax in the literals
    (z[:-1], 1 - z[-1]), which sum to one at every vertex."""
    a = np.asarray(a, dtype=float)
    p = sparsemax(np.r_[a[:-1], 1.0 - a[-1]])
    return np.r_[p[:-1], 1.0 - p[-1]]


def or_out_projection(a):
    """Projection onto the OR-out polytope {z in [0, 1]^n : z_i <= z_K <= sum_{i<K} z_i},
    K = n - 1 the output (AD3's closed form).

    1. Drop z_K <= sum z_i and project onto {z_i <= z_K} (a star-shaped order):
       the output pools with the inputs above it, z_K = t = (a_K + sum of the j
       largest inputs) / (j + 1) for the first j after which the next input is
       at most t, and z_i = min(a_i, t); then clip to [0, 1] (clipping an
       isotonic projection gives the box-constrained one).
    2. If that breaks z_K <= sum z_i, the constraint is active at the projection
       (one half-space added to a convex set), and on z_K = sum z_i the polytope
       is the XOR-out one: project onto it instead.
    """
    a = np.asarray(a, dtype=float)
    x, out = a[:-1], a[-1]
    xs = np.sort(x)[::-1]
    j, t = 0, out
    while j < xs.size and xs[j] > t:
        j += 1
        t = (out + xs[:j].sum()) / (j + 1)
    z = np.clip(np.r_[np.minimum(x, t), t], 0.0, 1.0)
    if z[-1] > z[:-1].sum():
        return xor_out_projection(a)
    return z


def and_out_projection(a):
    """Projection onto the AND-out polytope: the OR-out one on negated variables."""
    return 1.0 - or_out_projection(1.0 - np.asarray(a, dtype=float))


def budget_viterbi(eta_u, eta_v, budget, exact=False):
    """Best score of a binary sequence with at most (exactly) ``budget`` ones, by a
    forward NumPy dynamic program over (count, state).

    eta_u (n,) scores a position being 1; eta_v (n - 1, 2, 2) scores transitions
    as eta_v[i, a, b] (state a at i, b at i + 1).
    """
    n = eta_u.shape[0]
    V = np.full((n + 2, 2), -np.inf)      # V[c, x]: best prefix score with c ones, last state x
    V[0, 0], V[1, 1] = 0.0, eta_u[0]
    for i in range(1, n):
        new = np.full_like(V, -np.inf)
        new[:, 0] = np.max(V + eta_v[i - 1][:, 0], axis=1)
        new[1:, 1] = np.max(V[:-1] + eta_v[i - 1][:, 1], axis=1) + eta_u[i]
        V = new
    counts = [budget] if exact else range(min(budget, n) + 1)
    return max(V[c].max() for c in counts)


#: (z1, z2) of the structures 00, 01, 10, 11 of the pairwise factor, and z1 z2.
PAIRWISE_M = np.array([[0, 0, 1, 1], [0, 1, 0, 1]], float)
PAIRWISE_N = np.array([[0, 0, 0, 1]], float)


def viterbi(eta_u, eta_v):
    """Best tag sequence and its score, by a textbook NumPy Viterbi.

    eta_u (n, m), eta_v (n - 1, m, m) with eta_v[i, a, b] scoring tag a at i then b
    at i + 1. Returns (tags, value).
    """
    n, m = eta_u.shape
    delta = eta_u[0].copy()
    back = np.zeros((n, m), dtype=int)
    for i in range(1, n):
        cand = delta[:, None] + eta_v[i - 1]          # (prev, cur)
        back[i] = np.argmax(cand, axis=0)
        delta = cand.max(axis=0) + eta_u[i]
    tags = [int(np.argmax(delta))]
    for i in range(n - 1, 0, -1):
        tags.append(int(back[i, tags[-1]]))
    return np.array(tags[::-1]), float(delta.max())


def simplex_qp(M, theta, t=1.0):
    """``max_{y in simplex} theta . y - t/2 ||M y||^2`` by SciPy, with a KKT certificate.

    SLSQP finds the support (from the barycentre, then from the best vertex if
    needed); a polish solves the equality-constrained KKT system on it (numpy
    least squares, so affinely dependent columns are fine: every solution gives
    the same ``u = M y``) and NNLS recovers weights ``y >= 0`` summing to one
    from ``u``. The point is accepted only if it satisfies the KKT conditions
    over *all* columns: every column with positive weight has the largest
    adjusted score ``theta_s - t m_s . u``, up to ``1e-11 * scale``.

    Parameters
    ----------
    M : ndarray, shape (n, D)
        The columns ``m_s``, one per structure.
    theta : ndarray, shape (D,)
        The score of each structure (``eta . a_s`` plus any cost).
    t : float
        Weight of the quadratic term.

    Returns
    -------
    (u, y, value, gap) or None
        ``u = M y``, the weights, the objective value and its Wolfe gap (an
        upper bound on ``value* - value``); None when no certified point was found.
    """
    M = np.asarray(M, dtype=float)
    theta = np.asarray(theta, dtype=float)
    D = theta.shape[0]
    G = t * (M.T @ M)
    scale = 1.0 + np.abs(theta).max() + np.diag(G).max()
    tol = 1e-11 * scale

    def fun(y):
        return 0.5 * y @ G @ y - theta @ y

    for y0 in (np.full(D, 1.0 / D), np.eye(D)[int(np.argmax(theta))]):
        res = minimize(fun, y0, jac=lambda y: G @ y - theta, method="SLSQP",
                       bounds=[(0, None)] * D,
                       constraints=[{"type": "eq", "fun": lambda y: y.sum() - 1,
                                     "jac": lambda y: np.ones(D)}],
                       options={"ftol": 1e-15, "maxiter": 1000})
        y_qp = np.clip(res.x, 0.0, None)
        for thresh in (1e-6, 1e-9, 1e-4):
            S = np.flatnonzero(y_qp > thresh * y_qp.max())
            K = np.block([[G[np.ix_(S, S)], np.ones((S.size, 1))],
                          [np.ones((1, S.size)), np.zeros((1, 1))]])
            sol = np.linalg.lstsq(K, np.r_[theta[S], 1.0], rcond=None)[0]
            u_S = M[:, S] @ sol[:-1]
            big = 1e3   # weight of the sum-to-one row
            w, _ = nnls(np.r_[M[:, S], big * np.ones((1, S.size))], np.r_[u_S, big])
            if w.sum() <= 0:
                continue
            y = np.zeros(D)
            y[S] = w / w.sum()
            u = M @ y
            adj = theta - t * (M.T @ u)
            if adj.max() - adj[y > 0].min() <= tol:
                return u, y, float(theta @ y - 0.5 * t * u @ u), float(adj.max() - adj @ y)
    return None


# -- structures, enumerated without the package ---------------------------------------

def binary_configurations(n, allowed):
    """Every 0/1 vector of length n (int arrays, lexicographic order) for which allowed(z)."""
    return [np.array(z) for z in itertools.product((0, 1), repeat=n) if allowed(np.array(z))]


def all_sequences(n, m):
    """Every tag sequence of n positions over m states, as int arrays, in lexicographic order."""
    return [np.array(t) for t in itertools.product(range(m), repeat=n)]


def is_tree(heads):
    """heads[0] == -1 and every word has a head in [0, n], not itself, and reaches 0."""
    n = len(heads) - 1
    if heads[0] != -1:
        return False
    for m in range(1, n + 1):
        if not 0 <= heads[m] <= n or heads[m] == m:
            return False
        seen, z = set(), m
        while z != 0:
            if z in seen:
                return False
            seen.add(z)
            z = heads[z]
    return True


def is_projective(heads):
    """No two arcs cross (the root sits at position 0)."""
    spans = [tuple(sorted((heads[m], m))) for m in range(1, len(heads))]
    return not any(a < c < b < d or c < a < d < b
                   for (a, b), (c, d) in itertools.combinations(spans, 2))


def is_valid_tree(heads, projective=False, single_root=False):
    """A tree, projective if asked, with exactly one root child if asked."""
    return (is_tree(heads)
            and (not projective or is_projective(heads))
            and (not single_root or sum(1 for h in heads[1:] if h == 0) == 1))


def all_trees(n, projective=False, single_root=False):
    """Every dependency tree over n words, as head arrays (heads[0] == -1, 0 is the root),
    in lexicographic order of the heads."""
    candidates = itertools.product(*[[h for h in range(n + 1) if h != m] for m in range(1, n + 1)])
    return [np.array((-1,) + hs) for hs in candidates
            if is_valid_tree((-1,) + hs, projective, single_root)]


def all_matchings(n_rows, n_cols):
    """Every matching of min(n_rows, n_cols) pairs, as the column of each row (-1 unmatched)."""
    k = min(n_rows, n_cols)
    out = []
    for rows in itertools.combinations(range(n_rows), k):
        for cols in itertools.permutations(range(n_cols), k):
            s = np.full(n_rows, -1)
            s[list(rows)] = cols
            out.append(s)
    return out


# -- dense columns of structures, built without the package ----------------------------

def sequence_column(tags, n_states):
    """(m_s, n_s) of a tag sequence: m_s[i, t] = [tags[i] == t] (n, m) and
    n_s[i, a, b] = [tags[i] == a and tags[i + 1] == b] (n - 1, m, m)."""
    n = len(tags)
    m_s = np.zeros((n, n_states))
    m_s[np.arange(n), tags] = 1.0
    n_s = np.zeros((max(n - 1, 0), n_states, n_states))
    for i in range(n - 1):
        n_s[i, tags[i], tags[i + 1]] = 1.0
    return m_s, n_s


def arc_matrix(heads):
    """The 0/1 arc matrix m[h, m] = [heads[m] == h] of a head array."""
    m = np.zeros((len(heads), len(heads)))
    for w in range(1, len(heads)):
        m[heads[w], w] = 1
    return m


def matching_matrix(s, n_cols):
    """The 0/1 matrix with ones at (i, s[i]) for the matched rows (s[i] != -1)."""
    m = np.zeros((len(s), n_cols))
    for i, c in enumerate(s):
        if c != -1:
            m[i, c] = 1.0
    return m


# -- logic factors: their configurations, from the definitions in docs/factors.rst -----

def _family(f):
    """The logic family of factor f, by class name (no import of the package)."""
    names = {c.__name__ for c in type(f).__mro__}
    for family in ("XorFactor", "AtMostOneFactor", "OrFactor", "BudgetFactor",
                   "SequenceBudgetFactor", "PairFactor", "OrOutFactor", "AndOutFactor",
                   "XorOutFactor", "ImplyFactor"):
        if family in names:
            return family
    raise AssertionError(f"not a logic factor: {f!r}")


def logic_allowed(f):
    """Predicate on a 0/1 vector: is it a configuration of the logic factor f?
    (Reads only f's construction parameters ``budget`` and ``exact``.)"""
    family = _family(f)
    if family == "XorFactor":
        return lambda z: z.sum() == 1
    if family == "AtMostOneFactor":
        return lambda z: z.sum() <= 1
    if family == "OrFactor":
        return lambda z: z.sum() >= 1
    if family in ("BudgetFactor", "SequenceBudgetFactor"):
        if f.exact:
            return lambda z: z.sum() == f.budget
        return lambda z: z.sum() <= f.budget
    if family == "PairFactor":
        return lambda z: True
    if family == "OrOutFactor":
        return lambda z: z[-1] == int(any(z[:-1]))
    if family == "AndOutFactor":
        return lambda z: z[-1] == int(all(z[:-1]))
    if family == "ImplyFactor":      # AD3's IMPLY: z[0] and ... and z[-2] => z[-1]
        return lambda z: z[-1] >= int(all(z[:-1]))
    return lambda z: z[:-1].sum() <= 1 and z[-1] == z[:-1].sum()     # XorOutFactor


def logic_extra(f, z):
    """The additional part n_s of configuration z of the logic factor f, flattened:
    z1 z2 for the pair, the transitions of z for the sequence budget."""
    family = _family(f)
    if family == "PairFactor":
        return np.array([float(z[0] * z[1])])
    if family == "SequenceBudgetFactor":
        return sequence_column(z, 2)[1].ravel()
    return np.zeros(0)


def logic_configurations(f):
    """Every configuration of the logic factor f (0/1 int arrays, lexicographic order)."""
    return binary_configurations(f.shape_u[0], logic_allowed(f))


def logic_columns(f):
    """(configurations, M, N) of the logic factor f, its columns built from the definitions."""
    Z = logic_configurations(f)
    M = np.array(Z, dtype=float).T
    N = np.array([logic_extra(f, z) for z in Z]).T.reshape(-1, len(Z))
    return Z, M, N


# -- LP-SparseMAP: problem (P) of docs/lp_sparsemap.rst, over enumerated columns ---------------

def factor_graph_qp(n_variables, factors, eta_u, eta_v=None, support=None, tol=1e-11):
    """Problem (P) of docs/lp_sparsemap.rst by SciPy, certified by its KKT conditions.

        max_{u, p}  eta_u . u - 1/2 ||u||^2 + sum_f eta_v[f] . N_f p_f
        s.t.        M_f p_f = s_f + sigma_f * (C_f u),  p_f in the simplex   (every f)
                    0 <= u_i <= 1                       (variables in no factor)

    where row j of factor f stands for variable ``variables[j]`` (-1: tied to
    nothing), as the literal ``1 - u`` when ``negated[j]`` (``s = 1, sigma = -1``).

    SLSQP on the dual of (P) finds the supports (skipped when ``support`` is
    given, e.g. the supports of a nearby solve, for finite differences); then a polish
    solves the equality-constrained KKT system on the supports (least squares),
    recovers ``p >= 0`` by NNLS, and a few primal-dual active-set corrections fix
    a wrong support. The point is returned only if it satisfies every KKT
    condition of (P) up to ``tol * scale``: ``M_f p_f = l_f(u)``, ``p >= 0`` on the
    simplex, ``u = eta_u + sum_f C~_f^T mu_f`` and reduced costs
    ``m_y . mu_f - n_y . eta_v[f] - tau_f`` that are ``>= 0``, and 0 on the support.

    Parameters
    ----------
    n_variables : int
    factors : list of (M, N, variables, negated)
        ``M`` (n_f, K_f) the columns in literals, ``N`` (k_f, K_f) or None,
        ``variables`` (n_f,) ints, ``negated`` (n_f,) bools or None.
    eta_u : (n_variables,)
    eta_v : list (one entry per factor, None for none) or None
    support : list of index arrays, optional

    Returns
    -------
    dict with u, v (list), p (list), support (list), kkt (max residual).
    Raises RuntimeError when no certified point is found.
    """
    eta_u = np.asarray(eta_u, dtype=float)
    V = n_variables
    F = len(factors)
    Ms, Ns, ev, rows, cvars, sig, off = [], [], [], [], [], [], []
    deg = np.zeros(V, int)
    for f, (M, N, var, neg) in enumerate(factors):
        M = np.asarray(M, float)
        N = np.zeros((0, M.shape[1])) if N is None else np.asarray(N, float)
        var = np.asarray(var).reshape(-1)
        neg = np.zeros(var.shape, bool) if neg is None else np.asarray(neg, bool).reshape(-1)
        r = np.flatnonzero(var >= 0)
        Ms.append(M); Ns.append(N)
        e = np.zeros(N.shape[0]) if eta_v is None or eta_v[f] is None else np.asarray(eta_v[f], float).reshape(-1)
        ev.append(e)
        rows.append(r); cvars.append(var[r]); sig.append(np.where(neg[r], -1.0, 1.0))
        off.append(np.where(neg[r], 1.0, 0.0))
        np.add.at(deg, var[r], 1)
    free = np.flatnonzero(deg > 0)         # variables in some factor
    pos = -np.ones(V, int)
    pos[free] = np.arange(free.size)
    V1 = free.size
    K = [M.shape[1] for M in Ms]
    theta = [Ns[f].T @ ev[f] for f in range(F)]     # linear score of each column
    # C~_f as dense matrices over the free variables
    Ct = []
    for f in range(F):
        C = np.zeros((rows[f].size, V1))
        C[np.arange(rows[f].size), pos[cvars[f]]] = sig[f]
        Ct.append(C)
    scale = 1.0 + np.abs(eta_u).max(initial=0) + max([np.abs(t).max(initial=0) for t in theta] + [0])
    atol = tol * scale

    def solve_on(S):
        """KKT system of (P) restricted to the supports S, by least squares."""
        nS = [s.size for s in S]
        nmu = [r.size for r in rows]
        n_unk = V1 + sum(nS) + sum(nmu) + F
        n_eq = V1 + sum(nS) + sum(nmu) + F
        A = np.zeros((n_eq, n_unk))
        b = np.zeros(n_eq)
        ip = V1                                  # p unknowns
        im = V1 + sum(nS)                        # mu unknowns
        it = im + sum(nmu)                       # tau unknowns
        A[:V1, :V1] = np.eye(V1)
        b[:V1] = eta_u[free]
        e = V1
        P_at, M_at = [], []
        for f in range(F):
            Mr = Ms[f][rows[f]]                  # tied rows
            MS = Mr[:, S[f]]
            P_at.append(ip); M_at.append(im)
            A[:V1, im:im + nmu[f]] = -Ct[f].T                   # u - sum C~^T mu = eta
            A[e:e + nS[f], im:im + nmu[f]] = MS.T               # m_y . mu - tau = theta_y
            A[e:e + nS[f], it + f] = -1.0
            b[e:e + nS[f]] = theta[f][S[f]]
            e += nS[f]
            A[e:e + nmu[f], ip:ip + nS[f]] = MS                 # M_S p - C~ u = s
            A[e:e + nmu[f], :V1] = -Ct[f]
            b[e:e + nmu[f]] = off[f]
            e += nmu[f]
            A[e, ip:ip + nS[f]] = 1.0                            # 1^T p = 1
            b[e] = 1.0
            e += 1
            ip += nS[f]
            im += nmu[f]
        x = np.linalg.lstsq(A, b, rcond=None)[0]
        u = x[:V1]
        out_p, red, worst = [], [], 0.0
        for f in range(F):
            mu = x[M_at[f]:M_at[f] + nmu[f]]
            tau = x[it + f]
            Mr = Ms[f][rows[f]]
            r = Mr.T @ mu - theta[f] - tau
            red.append(r)
            lit = off[f] + Ct[f] @ u
            big = 1e3
            w, _ = nnls(np.r_[Mr[:, S[f]], big * np.ones((1, nS[f]))], np.r_[lit, big])
            p = np.zeros(K[f])
            p[S[f]] = w
            out_p.append(p)
            worst = max(worst, np.abs(Mr @ p - lit).max(initial=0), abs(p.sum() - 1),
                        -r.min(), np.abs(r[p > 0]).max(initial=0))
        stat = np.abs(A[:V1] @ x - b[:V1]).max(initial=0)
        p_ls = [x[P_at[f]:P_at[f] + nS[f]] for f in range(F)]
        return u, out_p, red, p_ls, max(worst, stat)

    def certify(S):
        for _ in range(60):
            u, p, red, p_ls, worst = solve_on(S)
            if worst <= atol:
                return u, p, worst
            # one primal-dual active-set correction per factor: drop the most
            # negative least-squares weight, else add the most negative reduced cost
            changed = False
            for f in range(F):
                if S[f].size > 1 and p_ls[f].min() < -atol:
                    S[f] = np.delete(S[f], int(np.argmin(p_ls[f])))
                    changed = True
                    continue
                j = int(np.argmin(red[f]))
                if red[f][j] < -atol and j not in S[f]:
                    S[f] = np.sort(np.r_[S[f], j])
                    changed = True
            if not changed:
                return None
        return None

    tries = []
    if support is not None:
        tries.append([np.array(s, int) for s in support])
    else:
        # The supports come from the dual of (P), which is small (one multiplier per
        # link, one epigraph variable per factor) where the primal is not:
        #   min_{mu, t}  1/2 ||eta + sum_f C~_f^T mu_f||^2 + sum_f s_f . mu_f + sum_f t_f
        #   s.t.         t_f >= theta_y - m_y . mu_f     (every configuration y of f)
        # A configuration can carry weight only where its constraint is active.
        nl = [r.size for r in rows]
        lo = np.r_[0, np.cumsum(nl)]
        Lt = int(lo[-1])
        Cs = np.vstack(Ct + [np.zeros((0, V1))])
        s_all = np.concatenate(off + [np.zeros(0)])
        e0 = eta_u[free]

        def fun(x):
            w = e0 + Cs.T @ x[:Lt]
            return 0.5 * w @ w + s_all @ x[:Lt] + x[Lt:].sum()

        def jac(x):
            return np.r_[Cs @ (e0 + Cs.T @ x[:Lt]) + s_all, np.ones(F)]

        cons = []
        for f in range(F):
            A = np.zeros((K[f], Lt + F))
            A[:, lo[f]:lo[f + 1]] = Ms[f][rows[f]].T
            A[:, Lt + f] = 1.0
            cons.append({"type": "ineq", "fun": (lambda x, A=A, b=theta[f]: A @ x - b),
                         "jac": (lambda x, A=A: A)})
        x0 = np.r_[np.zeros(Lt), [th.max() for th in theta]]
        res = minimize(fun, x0, jac=jac, method="SLSQP", constraints=cons,
                       options={"ftol": 1e-15, "maxiter": 1000})
        for thresh in (1e-7, 1e-9, 1e-5, 1e-3):
            S = []
            for f in range(F):
                slack = res.x[Lt + f] - (theta[f] - Ms[f][rows[f]].T @ res.x[lo[f]:lo[f + 1]])
                S.append(np.flatnonzero(slack <= thresh * scale))
            tries.append(S)
    for S in tries:
        out = certify([s.copy() for s in S])
        if out is not None:
            u1, p, worst = out
            u = np.clip(eta_u, 0.0, 1.0)
            u[free] = u1
            return dict(u=u, p=p, v=[Ns[f] @ p[f] for f in range(F)],
                        support=[np.flatnonzero(pf > 0) for pf in p], kkt=worst)
    raise RuntimeError("factor_graph_qp: no KKT-certified solution found")



def tree_tight_rows(u, single_root, tol=1e-9, clear=None):
    """Every constraint of the arborescence polytope tight at u, as rows over the
    (n + 1)^2 arcs (flattened ``[h, m]``): each word's incoming arcs, the root's arcs
    with single_root, and every set S of two or more words whose cut
    ``x(delta^-(S))`` is within tol of 1, found by enumerating all 2^n word sets
    (vectorised: fine to 18 words). With clear, None when a cut is within clear of
    1 but not within tol (neither clearly tight nor clearly slack)."""
    N = u.shape[0]
    n = N - 1
    x = u.copy()
    x[:, 0] = 0.0
    x[np.arange(N), np.arange(N)] = 0.0
    codes = np.arange(1, 2 ** n, dtype=np.int64)
    B = np.zeros((codes.size, N), dtype=bool)
    B[:, 1:] = (codes[:, None] >> np.arange(n)) & 1
    Bf = B.astype(float)
    cut = Bf @ x.sum(axis=0) - (Bf * (Bf @ x)).sum(axis=1)
    dev = np.abs(cut - 1.0)
    if clear is not None and np.any((dev > tol) & (dev <= clear)):
        return None
    tight = B[(dev <= tol) & (B.sum(axis=1) >= 2)]
    rows = []
    for m in range(1, N):
        r = np.zeros((N, N))
        r[:, m] = 1
        r[m, m] = 0
        rows.append(r.ravel())
    if single_root:
        r = np.zeros((N, N))
        r[0, 1:] = 1
        rows.append(r.ravel())
    for S in tight:
        rows.append((~S[:, None] & S[None, :]).astype(float).ravel())
    return np.array(rows)


def null_space_projection(A, keep):
    """Orthogonal projection onto {d : A d = 0, d = 0 off keep}, dense (NumPy)."""
    n = A.shape[1]
    B = np.vstack([A, np.eye(n)[~keep]])
    return np.eye(n) - np.linalg.pinv(B) @ B
