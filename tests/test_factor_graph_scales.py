"""Factor graphs at any score scale, with masks, and infeasible (issue 25).

Every answer is checked against references that share nothing with the solver:

* the constraints, from the returned ``u`` alone and from the returned structures and
  weights rebuilt as columns by ``tests/_reference.py`` (not by the factors' code);
* optimality by linear programming (HiGHS, ``scipy.optimize.linprog``): ``u`` solves
  problem (P) iff it lies in the local polytope and no point ``x`` of it has
  ``(eta - u) . x + eta_v . N q > (eta - u) . u + eta_v . v`` (the first-order
  condition of a concave objective over a polytope); the LP is written over every
  factor's enumerated configurations;
* for the grids and random graphs of cardinality factors with negations, the QP over the
  local polytope's vertices, enumerated from its inequalities (``simplex_qp``);
* for trees with budgets, ``factor_graph_qp`` (SLSQP over the factors' configurations,
  certified by the KKT conditions), at the scales where it certifies;
* masked graphs against the same graph with the masked variables removed.
"""
import itertools
import warnings

import numpy as np
import pytest
from scipy.optimize import linprog

import sparsemap as sm
from _reference import (all_trees, arc_matrix, factor_graph_qp, logic_columns, simplex_qp)

SCALES = [1e-6, 1e-3, 1.0, 1e2, 1e4, 1e6, 1e8]
EXTREMES = [("float32", np.finfo(np.float32).max / 10), ("float64", np.finfo(np.float64).max / 10)]


# -- graphs, with their factors' columns built here -------------------------------------------

class Graph:
    """A FactorGraph and, per factor, (M, N, variables, negated) with M's columns built from
    the definitions, and how to turn a returned structure into its column."""

    def __init__(self, n_variables):
        self.fg = sm.FactorGraph(n_variables)
        self.cols, self.column = [], []

    def add(self, factor, var, neg=None, M=None, column=None):
        var = np.asarray(var)
        self.fg.add(factor, var, neg)
        if M is None:
            _, M, _ = logic_columns(factor)
            column = lambda s: np.asarray(s, float).reshape(-1)       # the 0/1 vector
        self.cols.append((M, None, var.reshape(-1), None if neg is None else np.asarray(neg)))
        self.column.append(column)


def grid(m, n):
    g = Graph(m * n)
    ids = np.arange(m * n).reshape(m, n)
    for i in range(m):
        g.add(sm.XorFactor(n), ids[i])
    for j in range(n):
        g.add(sm.AtMostOneFactor(m), ids[:, j])
    # H-representation in u: rows sum to 1, columns at most 1, 0 <= u <= 1
    eq = [(np.isin(np.arange(m * n), ids[i]).astype(float), 1.0) for i in range(m)]
    le = [(np.isin(np.arange(m * n), ids[:, j]).astype(float), 1.0) for j in range(n)]
    return g, eq, le


def cardinality_graph(seed, V=5, n_factors=3):
    """Random Xor / AtMostOne / Or / Budget factors with negated parts over V variables,
    feasible (checked by an LP) and with its H-representation in u."""
    rng = np.random.default_rng(seed)
    while True:
        g = Graph(V)
        eq, le = [], []
        for _ in range(n_factors):
            k = int(rng.integers(2, 4))
            var = rng.choice(V, size=k, replace=False)
            neg = rng.random(k) < 0.3
            kind = rng.integers(4)
            factor, lo, hi = [(sm.XorFactor(k), 1, 1), (sm.AtMostOneFactor(k), 0, 1),
                              (sm.OrFactor(k), 1, k), (sm.BudgetFactor(k, 2), 0, 2)][kind]
            g.add(factor, var, neg)
            # sum_j lit_j = sum_j (neg_j + sigma_j u_var_j) in [lo, hi]
            a = np.zeros(V)
            np.add.at(a, var, np.where(neg, -1.0, 1.0))
            c = float(neg.sum())
            if lo == hi:
                eq.append((a, lo - c))
            else:
                le.append((a, hi - c))
                le.append((-a, -(lo - c)))
        if vertices(V, eq, le).shape[1]:
            return g, eq, le


def tree_budgets(n=3, b=1):
    """A non-projective tree over n words, at most b modifiers per head (root included)."""
    N = n + 1
    var = -np.ones((N, N), int)
    used = ~np.eye(N, dtype=bool)
    used[:, 0] = False
    var[used] = np.arange(used.sum())
    g = Graph(int(used.sum()))
    M = np.array([arc_matrix(h).ravel() for h in all_trees(n)]).T
    g.add(sm.TreeFactor(n), var, M=M, column=lambda s: arc_matrix(np.asarray(s)).ravel())
    for h in range(N):
        vs = var[h][var[h] >= 0]
        g.add(sm.BudgetFactor(vs.size, b), vs)
    return g


def grid_vertices(m, n):
    """Vertices of the grid's local polytope: its constraint matrix (rows and columns of a
    bipartite graph) is totally unimodular, so they are its 0/1 points: one column per
    row, distinct columns."""
    out = []
    for cols in itertools.permutations(range(n), m):
        u = np.zeros((m, n))
        u[np.arange(m), cols] = 1.0
        out.append(u.ravel())
    return np.array(out).T


def vertices(V, eq, le):
    """Vertices of {u : a.u = b (eq), a.u <= b (le), 0 <= u <= 1}, by brute force over the
    active sets (small V only)."""
    rows = le + [(np.eye(V)[i], 1.0) for i in range(V)] + [(-np.eye(V)[i], 0.0) for i in range(V)]
    A_eq = np.array([a for a, _ in eq]).reshape(-1, V)
    b_eq = np.array([b for _, b in eq])
    out = []
    for S in itertools.combinations(range(len(rows)), V - len(eq)):
        A = np.vstack([A_eq] + [rows[k][0] for k in S])
        if abs(np.linalg.det(A)) < 1e-9:
            continue
        u = np.linalg.solve(A, np.r_[b_eq, [rows[k][1] for k in S]])
        if (all(abs(a @ u - b) < 1e-9 for a, b in eq) and all(a @ u <= b + 1e-9 for a, b in rows)
                and not any(np.allclose(u, w) for w in out)):
            out.append(u)
    return np.array(out).T.reshape(V, -1)


# -- the independent checks --------------------------------------------------------------------

def literals(g, f, u):
    M, N, var, neg = g.cols[f]
    x = u[np.maximum(var, 0)]
    if neg is not None:
        x = np.where(neg.reshape(-1), 1.0 - x, x)
    return x, var >= 0


def constraint_residual(g, r):
    """max over factors of |M p - l(u)| with p the returned weights on the returned
    structures as columns built here, and how far the weights are from the simplex."""
    worst = float(np.maximum(-r.u, 0).max() + np.maximum(r.u - 1, 0).max())
    for f in range(len(g.cols)):
        w = r.weights[f]
        worst = max(worst, float(np.maximum(-w, 0).max(initial=0)), abs(float(w.sum()) - 1))
        mp = sum(wt * g.column[f](s) for s, wt in zip(r.structures[f], w))
        x, tied = literals(g, f, r.u)
        worst = max(worst, float(np.abs(mp - x)[tied].max(initial=0)))
    return worst


def lp_gap(g, eta, r, fixed=None):
    """max over the local polytope of (eta - u) . x, minus its value at u, relative to
    max(1, |eta|): 0 at the solution of (P), positive elsewhere (HiGHS)."""
    V = g.fg.n_variables
    fixed = np.zeros(V, bool) if fixed is None else fixed
    scale = max(1.0, float(np.abs(eta[~fixed]).max(initial=0)))
    c_x = np.where(fixed, 0.0, (eta - r.u)) / scale
    Ks = [M.shape[1] for M, _, _, _ in g.cols]
    n = V + sum(Ks)
    A, b = [], []
    off = V
    for (M, N, var, neg), K in zip(g.cols, Ks):
        sig = np.ones(var.size) if neg is None else np.where(neg.reshape(-1), -1.0, 1.0)
        sh = np.zeros(var.size) if neg is None else neg.reshape(-1).astype(float)
        for j in np.flatnonzero(var >= 0):          # M_j q - sigma_j x_var = s_j
            row = np.zeros(n)
            row[off:off + K] = M[j]
            row[var[j]] -= sig[j]
            A.append(row)
            b.append(sh[j])
        row = np.zeros(n)
        row[off:off + K] = 1.0
        A.append(row)
        b.append(1.0)
        off += K
    bounds = [(0.0, 0.0) if fixed[i] else (0.0, 1.0) for i in range(V)] + [(0, None)] * sum(Ks)
    res = linprog(-np.r_[c_x, np.zeros(sum(Ks))], A_eq=np.array(A), b_eq=np.array(b),
                  bounds=bounds, method="highs",
                  options={"primal_feasibility_tolerance": 1e-10,
                           "dual_feasibility_tolerance": 1e-10})
    assert res.status == 0, res.message
    return -res.fun - float(c_x @ r.u)


def vertex_qp(verts, eta):
    """Projection of eta onto the hull of the vertices (simplex_qp, scale-free form)."""
    t = 1.0 / max(1.0, float(np.abs(eta).max()))
    res = simplex_qp(verts, verts.T @ (eta * t), t=t)
    assert res is not None
    return res[0]


def draw(V, scale, seed, dtype=np.float64):
    z = np.random.default_rng(seed).standard_normal(V)
    return (z * scale).astype(dtype).astype(np.float64)


# -- any scale ------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", SCALES)
def test_grid_at_every_scale(scale):
    """Xor rows, AtMostOne columns: feasible, LP-optimal, and the QP over the polytope's
    enumerated vertices, from 1e-6 to 1e8 (on main, 1e4 and above broke the constraints)."""
    g, eq, le = grid(2, 3)
    verts = grid_vertices(2, 3)
    for seed in range(3):
        eta = draw(6, scale, seed)
        r = g.fg.solve(eta)
        assert r.converged
        assert constraint_residual(g, r) <= 1e-9
        assert lp_gap(g, eta, r) <= 1e-9
        np.testing.assert_allclose(r.u, vertex_qp(verts, eta), rtol=0, atol=1e-8)


@pytest.mark.parametrize("dtype,big", EXTREMES)
def test_grid_at_the_dtype_extremes(dtype, big):
    g, eq, le = grid(3, 4)
    verts = grid_vertices(3, 4)
    for seed in range(3):
        eta = draw(12, big, seed, getattr(np, dtype))
        r = g.fg.solve(eta)
        assert constraint_residual(g, r) <= 1e-9
        assert lp_gap(g, eta, r) <= 1e-9
        np.testing.assert_allclose(r.u, vertex_qp(verts, eta), rtol=0, atol=1e-8)


def test_the_issues_3x4_grid_at_1e6():
    """On main: rows [0, 0, .5, 1] and [0, 0, 0, .5]."""
    g, eq, le = grid(3, 4)
    eta = 1e6 * np.random.default_rng(0).standard_normal(12)
    r = g.fg.solve(eta)
    u = r.u.reshape(3, 4)
    np.testing.assert_allclose(u.sum(1), 1, atol=1e-12)
    assert u.sum(0).max() <= 1 + 1e-12
    np.testing.assert_allclose(r.u, vertex_qp(grid_vertices(3, 4), eta), atol=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_random_cardinality_graphs_with_negations(seed):
    g, eq, le = cardinality_graph(seed)
    verts = vertices(5, eq, le)
    for k, scale in enumerate(SCALES + [big for _, big in EXTREMES]):
        dtype = np.float32 if k % 2 else np.float64
        eta = draw(5, scale, 10 * seed + k, dtype)
        r = g.fg.solve(eta)
        assert constraint_residual(g, r) <= 1e-9, scale
        assert lp_gap(g, eta, r) <= 1e-9, scale
        np.testing.assert_allclose(r.u, vertex_qp(verts, eta), rtol=0, atol=1e-8)


@pytest.mark.parametrize("scale", SCALES + [big for _, big in EXTREMES])
def test_tree_with_budgets(scale):
    g = tree_budgets()
    V = g.fg.n_variables
    for seed in range(2):
        eta = draw(V, scale, seed)
        r = g.fg.solve(eta)
        assert constraint_residual(g, r) <= 1e-9
        assert lp_gap(g, eta, r) <= 1e-9
        if scale <= 1e2:        # where SLSQP, and so the reference, certifies
            ref = factor_graph_qp(V, g.cols, eta)
            np.testing.assert_allclose(r.u, ref["u"], rtol=0, atol=1e-9)


def test_iterations_stay_bounded_as_the_scale_grows():
    """ADMM works on the scores divided by their scale, with its penalty set from it: the
    iterations do not grow with the scale (on main: 25 at 1, 10000 at 1e4 and above)."""
    g, _, _ = grid(8, 12)
    its = {}
    for scale in (1.0, 1e4, 1e8, np.finfo(np.float64).max / 10):
        its[scale] = max(g.fg.solve(draw(96, scale, seed)).n_iter for seed in range(3))
    assert max(its.values()) <= 3 * its[1.0] + 50, its


# -- masks ---------------------------------------------------------------------------------------

def removed(g, masked):
    """The reference of g with the masked variables removed: their rows untied, and only the
    structures that leave a masked plain part off (a negated one on)."""
    cols = []
    for M, N, var, neg in g.cols:
        hit = (var >= 0) & masked[np.maximum(var, 0)]
        want = np.zeros(var.size) if neg is None else neg.reshape(-1).astype(float)
        keep = np.all(M[hit] == want[hit, None], axis=0)
        cols.append((M[:, keep], None, np.where(hit, -1, var), neg))
    return cols


@pytest.mark.parametrize("fill", [-np.inf, float(np.finfo(np.float32).min),
                                  float(np.finfo(np.float64).min), -1e30])
def test_masked_graph_is_the_graph_without_the_masked_variables(fill):
    """-inf fixes a variable at 0; a finite huge negative score gives the same answer."""
    for seed in range(4):
        g, eq, le = cardinality_graph(seed)
        V = g.fg.n_variables
        eta = draw(V, 1.0, seed)
        masked = np.zeros(V, bool)
        masked[np.random.default_rng(seed).choice(V, 2, replace=False)] = True
        ref_cols = removed(g, masked)
        if any(M.shape[1] == 0 for M, _, _, _ in ref_cols):
            continue
        e = np.where(masked, fill, eta)
        try:
            ref = factor_graph_qp(V, ref_cols, np.where(masked, 0.0, eta))
        except RuntimeError:          # the masked graph is infeasible
            with pytest.raises(ValueError, match="infeasible"):
                g.fg.solve(e)
            continue
        r = g.fg.solve(e)
        assert np.all(r.u[masked] == 0)
        np.testing.assert_allclose(r.u[~masked], ref["u"][~masked], rtol=0, atol=1e-9)
        assert constraint_residual(g, r) <= 1e-9


def test_masks_on_a_tree():
    """Arcs masked in a tree with budgets: the tree is the same as the one over the rest."""
    g = tree_budgets(3, 2)
    V = g.fg.n_variables
    eta = draw(V, 1.0, 3)
    masked = np.zeros(V, bool)
    masked[[0, 4]] = True
    ref = factor_graph_qp(V, removed(g, masked), np.where(masked, 0.0, eta))
    r = g.fg.solve(np.where(masked, -np.inf, eta))
    assert np.all(r.u[masked] == 0)
    np.testing.assert_allclose(r.u, ref["u"], atol=1e-9)
    # the Jacobian is 0 on masked variables
    gu, _ = r.vjp(np.ones(V))
    assert np.all(gu[masked] == 0)


@pytest.mark.parametrize("fill", [float(np.finfo(np.float32).min), -1e12])
def test_a_padded_row_of_xor_is_forced_and_its_fill_cancels(fill):
    """The issue's 4 x 4 grid with one padded row: on main, row sums [1, 1, 1, 4]. A row of
    a Xor sums to 1 whatever the scores, so a common score on it changes nothing: the
    answer is the one with that row's scores at 0 (the vertex QP)."""
    g, eq, le = grid(4, 4)
    eta = np.random.default_rng(1).standard_normal((4, 4))
    padded = eta.copy()
    padded[3] = fill
    r = g.fg.solve(padded.ravel())
    u = r.u.reshape(4, 4)
    np.testing.assert_allclose(u.sum(1), 1, atol=1e-12)
    assert u.sum(0).max() <= 1 + 1e-12
    eta[3] = 0.0
    np.testing.assert_allclose(r.u, vertex_qp(grid_vertices(4, 4), eta.ravel()), atol=1e-9)


def test_masked_xor_row_is_infeasible():
    g, _, _ = grid(4, 4)
    eta = np.random.default_rng(1).standard_normal((4, 4))
    eta[3] = -np.inf
    with pytest.raises(ValueError, match=r"infeasible: every structure of factor 3 \(XorFactor"):
        g.fg.solve(eta.ravel())


# -- infeasible graphs ------------------------------------------------------------------------

def infeasible_graphs():
    out = {}
    g, _, _ = grid(5, 3)
    out["more Xor rows than AtMostOne columns"] = (g.fg, "factors 0-4 \\(XorFactor")
    g, _, _ = grid(4, 3)
    g.fg.add(sm.BudgetFactor(3, 1), [0, 4, 8])      # the count no longer applies: Farkas
    out["the same with a budget across"] = (g.fg, "conflict")
    fg = sm.FactorGraph(6)
    fg.add(sm.BudgetFactor(6, 3, exact=True), np.arange(6))
    fg.add(sm.BudgetFactor(3, 1, exact=True), [0, 1, 2])
    fg.add(sm.BudgetFactor(3, 1, exact=True), [3, 4, 5])
    out["exact budgets 3 = 1 + 1"] = (fg, "need at least 3")
    fg = sm.FactorGraph(3)
    fg.add(sm.XorFactor(3), [0, 1, 2])
    fg.add(sm.XorFactor(3), [0, 1, 2], [True, True, True])
    out["Xor and Xor of the negations"] = (fg, "factors 0-1")
    g = tree_budgets(3, 3)
    g.fg.add(sm.BudgetFactor(9, 2, exact=True), np.arange(9))   # a tree has 3 arcs
    out["a tree whose arcs number 2"] = (g.fg, "factors 0 \\(TreeFactor.* conflict")
    return out


@pytest.mark.parametrize("name", list(infeasible_graphs()))
def test_infeasible_graphs_raise_naming_factors(name):
    fg, match = infeasible_graphs()[name]
    # the reference: HiGHS finds no point of the local polytope either
    for seed in range(3):
        eta = draw(fg.n_variables, 10.0 ** (3 * seed - 2), seed)
        with pytest.raises(ValueError, match=match) as info:
            fg.solve(eta)
        assert "FactorGraph.solve: infeasible" in str(info.value)
        assert "max_iter" not in str(info.value) and "tol" not in str(info.value)
        r = fg._solve_quiet(eta)
        assert r.n_iter < 200


@pytest.mark.parametrize("name", ["Xor and Xor of the negations",
                                  "the same with a budget across"])
def test_farkas_families_are_infeasible_for_highs_too(name):
    """The families only the Farkas certificate finds are infeasible by an LP over the
    factors' configurations (HiGHS)."""
    fg, _ = infeasible_graphs()[name]
    V = fg.n_variables
    A, b, n_q = [], [], 0
    blocks = []
    for f, var, neg in zip(fg.factors, fg.variables, fg.negated):
        _, M, _ = logic_columns(f)
        blocks.append((M, var.reshape(-1), neg.reshape(-1)))
        n_q += M.shape[1]
    off = V
    for M, var, neg in blocks:
        K = M.shape[1]
        for j in range(var.size):
            row = np.zeros(V + n_q)
            row[off:off + K] = M[j]
            row[var[j]] -= -1.0 if neg[j] else 1.0
            A.append(row)
            b.append(1.0 if neg[j] else 0.0)
        row = np.zeros(V + n_q)
        row[off:off + K] = 1
        A.append(row)
        b.append(1.0)
        off += K
    res = linprog(np.zeros(V + n_q), A_eq=np.array(A), b_eq=np.array(b),
                  bounds=[(0, 1)] * V + [(0, None)] * n_q, method="highs")
    assert res.status == 2          # infeasible


# -- true messages --------------------------------------------------------------------------

def test_the_convergence_error_advice_works():
    """On main the warning said 'raise max_iter or tol' for an infeasible graph, where
    neither helps; now an infeasible graph says so, and a solve stopped by max_iter says
    to raise it, which then succeeds."""
    g, _, _ = grid(8, 12)
    eta = draw(96, 1.0, 0)
    with pytest.raises(sm.ConvergenceError, match="Raise max_iter"):
        g.fg.solve(eta, max_iter=2)
    assert g.fg.solve(eta, max_iter=1000).converged
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # no warning on the way either
        g.fg.solve(eta)
