"""LP-SparseMAP factor graphs against problem (P) of docs/lp_sparsemap.rst, solved by SciPy.

The reference (``_reference.factor_graph_qp``) enumerates every factor's
configurations as explicit columns, solves (P) with SLSQP and certifies the
answer by its KKT conditions; derivatives are checked against its central
finite differences (on the same supports, where ``u`` is affine in the scores).
"""
import pickle
import warnings
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

import sparsemap as sm
from _reference import (all_matchings, all_sequences, all_trees, arc_matrix, factor_graph_qp,
                        logic_columns, matching_matrix, sequence_column)


# -- graphs: (n_variables, [((factor, M, N), variables, negated)], eta_u, eta_v) -----------------
# M, N: every configuration of the factor as explicit columns, built without the package
# (logic factors: from the definitions in tests/_reference.py).

def logic(factor):
    _, M, N = logic_columns(factor)
    return factor, M, (N if N.shape[0] else None)


def xor(n):
    return logic(sm.XorFactor(n))


def budget(n, b):
    return logic(sm.BudgetFactor(n, b))


def pair():
    return logic(sm.PairFactor())


def tree(n):
    M = np.array([arc_matrix(h).ravel() for h in all_trees(n)]).T
    return sm.TreeFactor(n), M, None


def sequence(n, S):
    cols = [sequence_column(t, S) for t in all_sequences(n, S)]
    return (sm.SequenceFactor(n, S), np.array([m.ravel() for m, _ in cols]).T,
            np.array([v.ravel() for _, v in cols]).T)


def matching(n):
    M = np.array([matching_matrix(s, n).ravel() for s in all_matchings(n, n)]).T
    return sm.MatchingFactor(n, n), M, None


def tree_arcs(n):
    """Variable of each arc h -> m of an n-word tree (-1 on the diagonal and column 0)."""
    N = n + 1
    var = -np.ones((N, N), int)
    mask = ~np.eye(N, dtype=bool)
    mask[:, 0] = False
    var[mask] = np.arange(mask.sum())
    return var


def g_budgets_xors(rng):
    """Overlapping budgets, a xor and an at-most-one; variable 7 is in no factor."""
    spec = [(budget(4, 2), [0, 1, 2, 3], None), (budget(3, 1), [2, 3, 4], None),
            (xor(3), [4, 5, 6], None), (logic(sm.AtMostOneFactor(3)), [0, 5, 6], None)]
    return 8, spec, rng.normal(size=8) * 0.8 + 0.3, None


def g_pair_cycle(rng, repulsive=False, negated=False):
    """Five variables, a cycle of pairs and a chord, mixed or repulsive couplings."""
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 0), (0, 2)]
    flips = [[False, True], [False, False], [True, True], [False, False], [True, False],
             [False, False]] if negated else [None] * len(edges)
    spec = [(pair(), list(e), neg) for e, neg in zip(edges, flips)]
    if repulsive:   # strong unaries: repulsive edges keep u0 + u1 - 1 > 0 on some edges
        return 5, spec, rng.uniform(0.9, 1.6, 5), [-rng.uniform(0.1, 0.4, 1) for _ in edges]
    return 5, spec, rng.normal(0.5, 0.6, 5), [rng.normal(size=1) for _ in edges]


def g_tree_budgets(rng, n=4, b=1):
    """A non-projective tree with a budget on the modifiers of every head (root included)."""
    var = tree_arcs(n)
    spec = [(tree(n), var, None)]
    for h in range(n + 1):
        vs = var[h][var[h] >= 0]
        spec.append((budget(vs.size, b), vs, None))
    return int(var.max()) + 1, spec, rng.normal(size=int(var.max()) + 1), None


def g_sequence_budget(rng, n=4, S=2):
    """A sequence with transitions, and at most one position in state 1."""
    spec = [(sequence(n, S), np.arange(n * S).reshape(n, S), None),
            (budget(n, 1), np.arange(n) * S + 1, None)]
    return n * S, spec, rng.normal(size=n * S), [rng.normal(size=(n - 1, S, S)), None]


def g_negations(rng):
    """Or, an implication (or with negated premises), xor-out, budget, at-most-one, xor."""
    spec = [(logic(sm.OrFactor(3)), [0, 1, 2], None),
            (logic(sm.OrFactor(3)), [2, 3, 4], [True, True, False]),
            (logic(sm.XorOutFactor(4)), [1, 4, 5, 6], None),
            (budget(4, 2), [0, 3, 5, 7], [False, True, False, True]),
            (logic(sm.AtMostOneFactor(3)), [6, 7, 8], [False, False, True]),
            (xor(3), [0, 8, 1], None)]
    return 9, spec, rng.normal(size=9), None


def g_or_and_out(rng):
    spec = [(logic(sm.OrOutFactor(4)), [0, 1, 2, 3], None),
            (logic(sm.AndOutFactor(4)), [1, 2, 4, 5], None),
            (logic(sm.OrFactor(3)), [3, 5, 0], [False, True, False])]
    return 6, spec, rng.normal(size=6), None


def g_matching(rng):
    """A 3 x 3 matching, and at most one of its diagonal cells."""
    spec = [(matching(3), np.arange(9).reshape(3, 3), None),
            (logic(sm.AtMostOneFactor(3)), [0, 4, 8], None)]
    return 9, spec, rng.normal(size=9), None


def g_sequence_budget_factor(rng):
    """A binary sequence with at most 2 positions on, sharing variables with an at-most-one
    and an exact budget, one of them negated."""
    spec = [(logic(sm.SequenceBudgetFactor(5, 2)), [0, 1, 2, 3, 4], None),
            (logic(sm.AtMostOneFactor(3)), [1, 2, 5], None),
            (logic(sm.BudgetFactor(3, 1, exact=True)), [3, 5, 6], [True, False, False])]
    return 7, spec, rng.normal(0.3, 1.0, 7), [rng.normal(size=(4, 2, 2)), None, None]


GRAPHS = {"budgets_xors": g_budgets_xors, "pair_cycle": g_pair_cycle,
          "pair_cycle_repulsive": lambda rng: g_pair_cycle(rng, True),
          "pair_cycle_negated": lambda rng: g_pair_cycle(rng, negated=True),
          "tree_budgets": g_tree_budgets, "sequence_budget": g_sequence_budget,
          "negations": g_negations, "or_and_out": g_or_and_out, "matching": g_matching,
          "sequence_budget_factor": g_sequence_budget_factor}


def make(name, seed):
    V, spec, eta_u, eta_v = GRAPHS[name](np.random.default_rng(seed))
    fg = sm.FactorGraph(V)
    cols = []
    for (factor, M, N), var, neg in spec:
        fg.add(factor, var, neg)
        cols.append((M, N, np.asarray(var).reshape(-1), None if neg is None else np.asarray(neg)))
    ev_flat = None if eta_v is None else [None if e is None else np.asarray(e).reshape(-1)
                                          for e in eta_v]
    return fg, cols, eta_u, eta_v, ev_flat


_REF = {}


def reference(name, seed):
    if (name, seed) not in _REF:
        fg, cols, eta_u, eta_v, ev_flat = make(name, seed)
        _REF[name, seed] = factor_graph_qp(fg.n_variables, cols, eta_u, ev_flat)
    return _REF[name, seed]


CASES = [(name, seed) for name in GRAPHS for seed in (0, 1)]


# -- forward ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,seed", CASES)
def test_solution_matches_reference(name, seed):
    fg, cols, eta_u, eta_v, ev_flat = make(name, seed)
    ref = reference(name, seed)
    assert ref["kkt"] < 1e-10
    r = fg.solve(eta_u, eta_v)
    assert r.converged and r.polished
    assert r.primal_residual <= 1e-13
    np.testing.assert_allclose(r.u, ref["u"], rtol=0, atol=1e-12)
    for f, (M, N, var, neg) in enumerate(cols):
        if N is not None:
            np.testing.assert_allclose(r.v[f].reshape(-1), ref["v"][f], rtol=0, atol=1e-10)
    # each factor's distribution: weights on the simplex, and its marginals agree with u
    for f, factor in enumerate(fg.factors):
        w = r.weights[f]
        assert np.all(w > 0) and abs(w.sum() - 1) < 1e-12
        assert len(r.structures[f]) == w.size
        mu = np.zeros(factor.shape_u)
        for s, wt in zip(r.structures[f], w):
            mu += wt * factor.vertex(s)[0]
        var, neg = fg.variables[f], fg.negated[f]
        lit = np.where(neg, 1 - r.u[np.maximum(var, 0)], r.u[np.maximum(var, 0)])
        np.testing.assert_allclose(mu[var >= 0], lit[var >= 0], rtol=0, atol=1e-12)
    objective = 0.5 * r.u @ r.u - eta_u @ r.u - sum(
        float(np.sum(e * v)) for e, v in zip(eta_v or [], r.v) if e is not None)
    assert r.objective == pytest.approx(objective, abs=1e-12)


def test_plain_admm_default_tolerance_reaches_1e_8():
    """Without polishing, the default tol (1e-10) leaves u within a few 1e-10 of (P)'s solution."""
    worst = 0.0
    for name, seed in CASES:
        fg, cols, eta_u, eta_v, ev_flat = make(name, seed)
        r = fg.solve(eta_u, eta_v, polish=False)
        assert r.converged and not r.polished
        assert r.primal_residual <= 1e-10 and r.dual_residual <= 1e-10
        worst = max(worst, np.abs(r.u - reference(name, seed)["u"]).max())
    assert worst < 2e-9


def test_a_certified_point_is_the_solution():
    """Stopped early, a solve that claims a polished point has the exact solution (and one
    that has none raises)."""
    n_polished = n_raised = 0
    for name, seed in CASES:
        fg, cols, eta_u, eta_v, ev_flat = make(name, seed)
        for k in range(2, 30, 3):
            try:
                r = fg.solve(eta_u, eta_v, max_iter=k)
            except sm.ConvergenceError:
                n_raised += 1
                assert not fg._solve_quiet(eta_u, eta_v, max_iter=k).converged
                continue
            if r.polished:
                n_polished += 1
                np.testing.assert_allclose(r.u, reference(name, seed)["u"], atol=1e-12)
            else:
                assert r.converged
    assert n_polished > 20 and n_raised > 5


def test_the_certificate_rejects_wrong_supports():
    """Polishing after a few ADMM steps, on supports that are not yet the optimal faces: the
    KKT certificate must refuse every point but the solution."""
    n_rejected = n_accepted = 0
    for name, seed in CASES:
        fg, cols, eta_u, eta_v, ev_flat = make(name, seed)
        for k in (1, 2, 4):
            engine = fg._solve_quiet(eta_u, eta_v, max_iter=k, polish=False)._engine
            if engine._try_polish():
                n_accepted += 1
                np.testing.assert_allclose(engine.u_array(), reference(name, seed)["u"],
                                           atol=1e-12)
            else:
                n_rejected += 1
    assert n_rejected > 5 and n_accepted > 20


def test_threads_give_the_same_results():
    """solve releases the GIL; concurrent solves of one graph agree with serial ones."""
    from concurrent.futures import ThreadPoolExecutor
    fg, cols, eta_u, eta_v, _ = make("tree_budgets", 0)
    etas = [eta_u + 0.3 * k for k in range(8)]
    serial = [fg.solve(e).u for e in etas]
    with ThreadPoolExecutor(2) as ex:
        threaded = list(ex.map(lambda e: fg.solve(e).u, etas))
    for a, b in zip(serial, threaded):
        np.testing.assert_array_equal(a, b)


def test_degree_zero_variable_is_clipped():
    fg = sm.FactorGraph(4)
    fg.add(sm.XorFactor(2), [0, 1])
    r = fg.solve([0.3, 0.1, 1.7, -0.4])
    np.testing.assert_allclose(r.u[2:], [1.0, 0.0])
    np.testing.assert_allclose(r.u[:2], [0.6, 0.4], atol=1e-10)



@pytest.mark.parametrize("name", list(GRAPHS))
def test_marginals_lie_in_the_unit_interval_exactly(name):
    """The polish and ADMM's averages leave round-off outside [0, 1] (-1e-15, 1 + 4e-16 on
    these graphs); a downstream log(u) or log(1 - u) would be nan. The same u otherwise."""
    for seed in range(12):
        fg, cols, eta_u, eta_v, _ = make(name, seed)
        for polish in (True, False):
            r = fg.solve(eta_u, eta_v, polish=polish)
            assert np.all(r.u >= 0.0) and np.all(r.u <= 1.0), (seed, r.u.min(), r.u.max())
            if (name, seed) in CASES and polish:
                np.testing.assert_allclose(r.u, reference(name, seed)["u"], rtol=0, atol=1e-12)

def test_negation_is_complement():
    """Negating every occurrence of a variable and scoring it 1 - eta flips it: w = 1 - u."""
    fg, cols, eta_u, eta_v, _ = make("negations", 0)
    r = fg.solve(eta_u, eta_v)
    for i in (0, 3, 7):
        flipped = sm.FactorGraph(fg.n_variables)
        for factor, var, neg in zip(fg.factors, fg.variables, fg.negated):
            flipped.add(factor, var, neg ^ (var == i))
        eta = eta_u.copy()
        eta[i] = 1 - eta[i]
        r2 = flipped.solve(eta, eta_v)
        expect = r.u.copy()
        expect[i] = 1 - expect[i]
        np.testing.assert_allclose(r2.u, expect, atol=1e-8)


def test_one_factor_graph_is_sparsemap():
    """A factor whose parts are distinct variables: u, v, jvp and vjp equal sm.solve's."""
    rng = np.random.default_rng(3)
    f = sm.SequenceFactor(4, 3)
    eu, ev = rng.normal(size=(4, 3)), rng.normal(size=(3, 3, 3))
    fg = sm.FactorGraph(12)
    fg.add(f, np.arange(12).reshape(4, 3))
    r = fg.solve(eu.reshape(-1), [ev], tol=1e-12)
    s = sm.solve(f, eu, ev)
    np.testing.assert_allclose(r.u, s.u.reshape(-1), atol=1e-10)
    np.testing.assert_allclose(r.v[0], s.v, atol=1e-10)
    d_u, d_v, g = rng.normal(size=(4, 3)), rng.normal(size=(3, 3, 3)), rng.normal(size=(4, 3))
    np.testing.assert_allclose(r.jvp(d_u.reshape(-1), [d_v]), s.jvp(d_u, d_v).reshape(-1),
                               atol=1e-9)
    gu, gv = r.vjp(g.reshape(-1))
    su, sv = s.vjp(g)
    np.testing.assert_allclose(gu, su.reshape(-1), atol=1e-9)
    np.testing.assert_allclose(gv[0], sv, atol=1e-9)


def test_tree_with_ignored_parts():
    """A tree leaves its diagonal and column 0 unattached (-1); a graph of it alone is sm.solve."""
    rng = np.random.default_rng(5)
    n = 5
    var = tree_arcs(n)
    eta = rng.normal(size=(n + 1, n + 1))
    fg = sm.FactorGraph(int(var.max()) + 1)
    fg.add(sm.TreeFactor(n), var)
    eu = np.zeros(fg.n_variables)
    eu[var[var >= 0]] = eta[var >= 0]
    r = fg.solve(eu, tol=1e-12)
    s = sm.solve(sm.TreeFactor(n), eta)
    np.testing.assert_allclose(r.u[var[var >= 0]], s.u[var >= 0], atol=1e-9)


def test_oracle_factor_and_repeated_variable():
    """A Python oracle factor works in a graph; a variable may appear twice in one factor."""
    f = sm.OracleFactor(lambda eu, ev: int(np.argmax(eu)), lambda s: np.eye(3)[s], shape_u=3)
    fg = sm.FactorGraph(2)
    fg.add(f, [0, 1, 1])             # u0 + 2 u1 = 1 through a xor over (0, 1, 1)
    r = fg.solve([0.9, 0.4])
    M = np.eye(3)
    ref = factor_graph_qp(2, [(M, None, [0, 1, 1], None)], np.array([0.9, 0.4]))
    np.testing.assert_allclose(r.u, ref["u"], atol=1e-8)
    assert r.u[0] + 2 * r.u[1] == pytest.approx(1, abs=1e-9)


def test_oracle_errors_propagate():
    """An exception in a Python oracle during the nogil loop reaches the caller."""
    calls = []

    def failing_map(eu, ev):      # the first call (the initial support) succeeds
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("oracle failed")
        return int(np.argmax(eu))
    f = sm.OracleFactor(failing_map, lambda s: np.eye(3)[s], shape_u=3)
    fg = sm.FactorGraph(3)
    fg.add(f, [0, 1, 2])
    with pytest.raises(RuntimeError, match="oracle failed"):
        fg.solve([0.5, 0.4, 0.1])
    assert len(calls) == 2


def test_max_iter_raises():
    """An uncertified iterate is never returned: it may lie outside the constraints. The
    error's advice (raise max_iter) works."""
    fg, cols, eta_u, eta_v, _ = make("tree_budgets", 0)
    for polish in (True, False):
        with pytest.raises(sm.ConvergenceError, match="Raise max_iter"):
            fg.solve(eta_u, eta_v, max_iter=2, polish=polish)
        r = fg._solve_quiet(eta_u, eta_v, max_iter=2, polish=polish)
        assert not r.converged and not r.polished and r.n_iter == 2
        assert r.primal_residual > 1e-10 or r.dual_residual > 1e-10
        r = fg.solve(eta_u, eta_v, max_iter=1000, polish=polish)
        assert r.converged
        np.testing.assert_allclose(r.u, reference("tree_budgets", 0)["u"], atol=1e-8)


def test_results_are_independent_of_later_solves():
    fg, cols, eta_u, eta_v, _ = make("budgets_xors", 0)
    r1 = fg.solve(eta_u, eta_v)
    g = np.arange(fg.n_variables, dtype=float)
    before = r1.vjp(g)[0]
    fg.solve(-eta_u, eta_v)
    np.testing.assert_array_equal(r1.vjp(g)[0], before)


# -- backward --------------------------------------------------------------------------------

H = 1e-5


_FD = {}


def fd_jacobian(name, seed):
    """Central differences of the reference u in eta_u, on the reference supports."""
    if (name, seed) not in _FD:
        _FD[name, seed] = _fd_jacobian(name, seed)
    return _FD[name, seed]


def _fd_jacobian(name, seed):
    fg, cols, eta_u, eta_v, ev_flat = make(name, seed)
    sup = reference(name, seed)["support"]
    V = fg.n_variables
    J = np.zeros((V, V))
    for i in range(V):
        e = np.zeros(V)
        e[i] = H
        up = factor_graph_qp(V, cols, eta_u + e, ev_flat, support=sup)["u"]
        um = factor_graph_qp(V, cols, eta_u - e, ev_flat, support=sup)["u"]
        J[:, i] = (up - um) / (2 * H)
    return J


@pytest.mark.parametrize("name", list(GRAPHS))
def test_jacobian_matches_finite_differences(name):
    fg, cols, eta_u, eta_v, ev_flat = make(name, 0)
    J = fd_jacobian(name, 0)
    r = fg.solve(eta_u, eta_v)
    V = fg.n_variables
    J_vjp = np.array([r.vjp(np.eye(V)[i])[0] for i in range(V)])
    J_jvp = np.array([r.jvp(np.eye(V)[i]) for i in range(V)]).T
    np.testing.assert_allclose(J_vjp, J, rtol=0, atol=1e-8)
    np.testing.assert_allclose(J_jvp, J, rtol=0, atol=1e-8)
    # exact: a symmetric projector
    np.testing.assert_allclose(J_vjp, J_vjp.T, atol=1e-12)
    assert r.backward_info["relative_residual"] <= 1e-13



def same_fg_result(r, s):
    for k in ("converged", "polished", "n_iter", "primal_residual", "dual_residual", "objective",
              "rho", "n_map", "n_inner_unconverged", "message", "n_variables", "factors"):
        assert getattr(r, k) == getattr(s, k), k
    np.testing.assert_array_equal(r.u, s.u)
    for a, b in zip(r.v, s.v):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(r.weights, s.weights):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(r.structures, s.structures):
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def same_backward(r, s, rng):
    """jvp and vjp (eta_u and eta_v parts) of s are those of r, bitwise."""
    du = rng.normal(size=r.n_variables)
    dv = [rng.normal(size=f.shape_v) if f.n_v else None for f in r.factors]
    np.testing.assert_array_equal(s.jvp(du), r.jvp(du))
    np.testing.assert_array_equal(s.jvp(du, dv), r.jvp(du, dv))
    (gu_r, gv_r), (gu_s, gv_s) = r.vjp(du), s.vjp(du)
    np.testing.assert_array_equal(gu_s, gu_r)
    for a, b in zip(gv_s, gv_r):
        np.testing.assert_array_equal(a, b)
    assert s.backward_info == r.backward_info


@pytest.mark.parametrize("name", list(GRAPHS))
def test_result_pickles_with_its_backward_pass(name):
    fg, cols, eta_u, eta_v, ev_flat = make(name, 0)
    rng = np.random.default_rng(5)
    for kw in ({}, dict(polish=False), dict(polish=False, max_iter=3)):
        r = fg._solve_quiet(eta_u, eta_v, **kw)
        s = pickle.loads(pickle.dumps(r))
        same_fg_result(r, s)
        same_backward(r, s, rng)
        # and a second trip, of a result whose backward already ran
        same_backward(r, pickle.loads(pickle.dumps(s)), rng)
    # against the independent reference: central differences on the final supports
    r = pickle.loads(pickle.dumps(fg.solve(eta_u, eta_v)))
    V = fg.n_variables
    J = np.array([r.vjp(np.eye(V)[i])[0] for i in range(V)])
    np.testing.assert_allclose(J, fd_jacobian(name, 0), rtol=0, atol=1e-8)


def test_results_come_back_from_a_process_pool():
    """Solved on workers (the graph travels there, the results back), with the backward pass
    working in the caller's process."""
    fg, cols, eta_u, eta_v, _ = make("sequence_budget_factor", 0)
    rng = np.random.default_rng(6)
    etas = [eta_u + rng.normal(scale=0.5, size=eta_u.shape) for _ in range(4)]
    with ProcessPoolExecutor(max_workers=2) as ex:
        remote = list(ex.map(fg.solve, etas, [eta_v] * len(etas)))
    for e, s in zip(etas, remote):
        r = fg.solve(e, eta_v)
        same_fg_result(r, s)
        same_backward(r, s, rng)

@pytest.mark.parametrize("name", ["pair_cycle", "pair_cycle_repulsive", "pair_cycle_negated",
                                  "sequence_budget", "sequence_budget_factor"])
def test_eta_v_gradients_match_finite_differences(name):
    fg, cols, eta_u, eta_v, ev_flat = make(name, 0)
    sup = reference(name, 0)["support"]
    r = fg.solve(eta_u, eta_v)
    g = np.random.default_rng(7).normal(size=fg.n_variables)
    _, gv = r.vjp(g)
    for f, e in enumerate(ev_flat):
        if e is None:
            assert gv[f].size == 0
            continue
        fd = np.zeros(e.size)
        for a in range(e.size):
            evp = [None if x is None else x.copy() for x in ev_flat]
            evm = [None if x is None else x.copy() for x in ev_flat]
            evp[f][a] += H
            evm[f][a] -= H
            up = factor_graph_qp(fg.n_variables, cols, eta_u, evp, support=sup)["u"]
            um = factor_graph_qp(fg.n_variables, cols, eta_u, evm, support=sup)["u"]
            fd[a] = g @ (up - um) / (2 * H)
        np.testing.assert_allclose(gv[f].reshape(-1), fd, rtol=0, atol=1e-8)
        # forward mode along the same factor's eta_v: g . jvp(0, e_f) = gv[f] . e_f
        d = np.random.default_rng(f).normal(size=e.size)
        dv = [None] * len(ev_flat)
        dv[f] = d.reshape(fg.factors[f].shape_v)
        assert g @ r.jvp(np.zeros(fg.n_variables), dv) == pytest.approx(gv[f].reshape(-1) @ d,
                                                                        abs=1e-9)


def test_repulsive_pair_edge_gradient_is_not_zero():
    """lp-sparsemap returns 0 here (pitfall 5.6); the edge marginal u0 + u1 - 1 > 0 moves."""
    fg, cols, eta_u, eta_v, _ = make("pair_cycle_repulsive", 0)
    r = fg.solve(eta_u, eta_v)
    active = [f for f in range(len(fg.factors)) if r.v[f][0] > 1e-6]
    assert active
    _, gv = r.vjp(np.ones(fg.n_variables))
    assert max(abs(gv[f][0]) for f in active) > 0.1


def test_degree_zero_gradient():
    """Variables in no factor: du = d_eta * 1[0 < eta < 1] (lp-sparsemap returns 0, pitfall 5.5)."""
    fg, cols, eta_u, eta_v, _ = make("budgets_xors", 0)
    for val, slope in ((0.4, 1.0), (1.3, 0.0), (-0.2, 0.0)):
        eta = eta_u.copy()
        eta[7] = val
        r = fg.solve(eta, eta_v)
        g = np.zeros(8)
        g[7] = 2.0
        assert r.vjp(g)[0][7] == 2.0 * slope
        assert r.jvp(g)[7] == 2.0 * slope


# -- bad input ---------------------------------------------------------------------------------

def test_add_rejects_bad_input():
    fg = sm.FactorGraph(4)
    xor = sm.XorFactor(3)
    with pytest.raises(ValueError, match="^factor"):
        fg.add("xor", [0, 1, 2])
    with pytest.raises(ValueError, match=r"^variables: expected shape \(3,\)"):
        fg.add(xor, [0, 1])
    with pytest.raises(ValueError, match=r"^variables: expected indices in \[0, 4\)"):
        fg.add(xor, [0, 1, 4])
    with pytest.raises(ValueError, match="^variables: expected indices"):
        fg.add(xor, [0, -2, 1])
    with pytest.raises(ValueError, match="^variables: expected integers"):
        fg.add(xor, [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="^variables: -1 at"):
        fg.add(xor, [0, -1, 2])
    with pytest.raises(ValueError, match="^variables: -1 at"):
        fg.add(sm.TreeFactor(2), np.full((3, 3), -1))
    with pytest.raises(ValueError, match=r"^negated: expected shape \(3,\)"):
        fg.add(xor, [0, 1, 2], [True, False])
    with pytest.raises(ValueError, match="^negated: expected booleans"):
        fg.add(xor, [0, 1, 2], [0.5, 0, 0])
    with pytest.raises(ValueError, match="^negated: part .* outside"):
        fg.add(sm.GenericFactor([[2.0, 0.0], [0.0, 1.0]]), [0, 1], [True, False])
    with pytest.raises(ValueError, match="^negated: True on a part attached to no variable"):
        var = tree_arcs(2)
        fg2 = sm.FactorGraph(int(var.max()) + 1)
        fg2.add(sm.TreeFactor(2), var, var < 0)
    with pytest.raises(ValueError, match="^n_variables"):
        sm.FactorGraph(0)
    assert fg.factors == []      # nothing was added by the failed calls
    # rows of values in [0, 1] may be negated
    fg.add(sm.GenericFactor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.5]]), [0, 1, 2], [True, False, True])


def test_solve_rejects_bad_input():
    fg = sm.FactorGraph(3)
    fg.add(sm.XorFactor(2), [0, 1])
    fg.add(sm.PairFactor(), [1, 2])
    with pytest.raises(ValueError, match=r"^eta_u: expected shape \(3,\)"):
        fg.solve(np.zeros(4))
    with pytest.raises(ValueError, match="^eta_u: contains non-finite"):
        fg.solve([0.0, np.nan, 0.0])
    with pytest.raises(ValueError, match=r"^eta_v: expected a list with one entry per factor \(2\)"):
        fg.solve(np.zeros(3), [None])
    with pytest.raises(ValueError, match="^eta_v: expected a list"):
        fg.solve(np.zeros(3), np.zeros(1))
    with pytest.raises(ValueError, match=r"^eta_v\[0\]: factor 0 .* has no additional scores"):
        fg.solve(np.zeros(3), [np.zeros(1), np.zeros(1)])
    with pytest.raises(ValueError, match=r"^eta_v\[1\]: expected shape \(1,\)"):
        fg.solve(np.zeros(3), [None, np.zeros(2)])
    with pytest.raises(ValueError, match=r"^eta_v\[1\]: contains non-finite"):
        fg.solve(np.zeros(3), [None, [np.inf]])
    for kw, name in ((dict(max_iter=0), "max_iter"), (dict(max_iter=1.5), "max_iter"),
                     (dict(tol=-1.0), "tol"), (dict(tol=np.nan), "tol"), (dict(rho=0.0), "rho"),
                     (dict(polish="yes"), "polish")):
        with pytest.raises(ValueError, match=f"^{name}"):
            fg.solve(np.zeros(3), **kw)
    r = fg.solve(np.zeros(3), [None, [0.5]])
    with pytest.raises(ValueError, match=r"^d_eta_u: expected shape \(3,\)"):
        r.jvp(np.zeros(2))
    with pytest.raises(ValueError, match=r"^d_eta_v\[0\]: factor 0"):
        r.jvp(np.zeros(3), [np.ones(1), None])
    with pytest.raises(ValueError, match=r"^d_eta_v: expected a list"):
        r.jvp(np.zeros(3), [None])
    with pytest.raises(ValueError, match=r"^du: expected shape \(3,\)"):
        r.vjp(np.zeros(2))
    with pytest.raises(ValueError, match="^du: contains non-finite"):
        r.vjp([0.0, np.nan, 0.0])


def test_empty_graph():
    r = sm.FactorGraph(3).solve([-1.0, 0.5, 2.0])
    assert r.converged
    np.testing.assert_array_equal(r.u, [0.0, 0.5, 1.0])
    np.testing.assert_array_equal(r.vjp(np.ones(3))[0], [0.0, 1.0, 0.0])
