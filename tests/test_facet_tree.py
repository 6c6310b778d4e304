"""The facet side for non-projective trees (sparsemap._facet_tree) against independent
references: brute force over all trees, the vertex side, NetworkX's minimum cuts, KKT
conditions and the duality gap checked here from u alone, finite differences."""
import itertools
import pickle
import threading
import warnings

import networkx as nx
import numpy as np
import pytest

import sparsemap as sm
from sparsemap._facet import FacetSolution
from sparsemap._facet_tree import TreeFacetSolver, _min_root_cut
from sparsemap.testing import finite_difference_jvp

from _reference import all_trees, arc_matrix, simplex_qp

ROOTS = [False, True]


def solver(n, single_root=False, decline_peaked=False):
    return TreeFacetSolver(sm.TreeFactor(n, single_root=single_root),
                           decline_peaked=decline_peaked)


def allowed_arcs(eta):
    N = eta.shape[0]
    ok = np.isfinite(eta) | np.isnan(eta)
    ok[:, 0] = False
    ok[np.arange(N), np.arange(N)] = False
    return ok


# -- independent references -------------------------------------------------------
def brute_force_u(eta, single_root):
    """The projection as a QP over every enumerated tree that avoids the -inf arcs."""
    n = eta.shape[0] - 1
    ok = allowed_arcs(eta)
    trees = [t for t in all_trees(n, False, single_root)
             if all(ok[t[m], m] for m in range(1, n + 1))]
    M = np.array([arc_matrix(t).ravel() for t in trees]).T
    scores = np.where(ok, eta, 0.0).ravel()
    u, _, _, _ = simplex_qp(M, M.T @ scores)
    return u.reshape(n + 1, n + 1)


def brute_min_cut(x):
    N = x.shape[0]
    best = np.inf
    for r in range(1, N):
        for S in itertools.combinations(range(1, N), r):
            inside = np.zeros(N, bool)
            inside[list(S)] = True
            best = min(best, x[np.ix_(~inside, inside)].sum())
    return best


def networkx_min_cut(x):
    N = x.shape[0]
    G = nx.DiGraph()
    G.add_nodes_from(range(N))
    for h in range(N):
        for m in range(1, N):
            if h != m and x[h, m] > 0:
                G.add_edge(h, m, capacity=float(x[h, m]))
    return min(nx.minimum_cut(G, 0, t)[0] for t in range(1, N))


def check_kkt(f, eta, u, min_cut):
    """u is the projection: feasible (all cuts by min_cut, an independent routine) and
    optimal (the Wolfe duality gap by the factor's MAP)."""
    ok = allowed_arcs(eta)
    assert np.all(u[~ok] == 0)
    assert u.min() >= 0
    np.testing.assert_allclose(u[:, 1:].sum(axis=0), 1.0, rtol=0, atol=1e-13)
    if f.single_root:
        assert abs(u[0].sum() - 1.0) <= 1e-13
    assert min_cut(u) >= 1.0 - 1e-12
    adj = np.where(ok, eta - u, -np.inf)
    best = (adj[ok] * f.vertex(f.map(adj))[0][ok]).sum()
    gap = best - (adj[ok] * u[ok]).sum()
    scale = 1.0 + np.abs(eta[ok]).max()
    assert -1e-12 * scale <= gap <= 1e-11 * scale


# -- the minimum root cut -----------------------------------------------------------
def test_min_root_cut_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(150):
        N = int(rng.integers(2, 8))
        x = rng.random((N, N)) * (rng.random((N, N)) < rng.random())
        value, words = _min_root_cut(x)
        assert not words[0] and words.any()
        inside = words.astype(bool)
        x0 = x.copy()
        x0[:, 0] = 0
        x0[np.arange(N), np.arange(N)] = 0
        assert x0[np.ix_(~inside, inside)].sum() == pytest.approx(value, abs=1e-12)
        assert value == pytest.approx(brute_min_cut(x0), abs=1e-12)


def test_min_root_cut_networkx():
    rng = np.random.default_rng(1)
    for N in (12, 30):
        for power in (1, 4):
            x = rng.random((N, N)) ** power
            x[:, 0] = 0
            x[np.arange(N), np.arange(N)] = 0
            assert _min_root_cut(x)[0] == pytest.approx(networkx_min_cut(x), abs=1e-11)


# -- the projection -----------------------------------------------------------------
@pytest.mark.parametrize("single_root", ROOTS)
def test_brute_force(single_root):
    rng = np.random.default_rng(2)
    for n in (1, 2, 3, 4):
        s = solver(n, single_root)
        cases = [scale * rng.standard_normal((n + 1, n + 1)) for scale in (0.01, 0.3, 1.0, 5.0)]
        cases.append(np.full((n + 1, n + 1), 0.7))                                # all tied
        cases.append(rng.integers(-1, 2, size=(n + 1, n + 1)).astype(float))      # many ties
        for eta in cases[:4] if n >= 2 else []:
            masked = eta.copy()
            masked[int(rng.integers(0, n + 1)), int(rng.integers(1, n + 1))] = -np.inf
            masked[:, 0] = np.nan                                                 # ignored
            cases.append(masked)
        for i, eta in enumerate(cases):
            sol = s.solve(eta)
            assert sol.status == 0, (n, eta)
            if n == 4 and (not single_root or i not in (0, 6)):
                # 64 or 125 trees: each reference QP takes a second or more; the
                # vertex side instead, except for one flat and one masked case
                ref = sm.solve(s.factor, eta).u
            else:
                ref = brute_force_u(eta, single_root)
            np.testing.assert_allclose(sol.u, ref, atol=1e-9)
            assert max(sol.residuals) <= 1e-12
            check_kkt(s.factor, eta, sol.u, brute_min_cut)


def solver_min_cut(x):
    """The solver's own minimum root cut (checked against NetworkX and brute force
    above): NetworkX takes seconds per answer from 40 words on."""
    return _min_root_cut(x)[0]


@pytest.mark.parametrize("single_root", ROOTS)
@pytest.mark.parametrize("n,scale", [(10, 0.1), (10, 1.0), (20, 0.3), (20, 3.0), (30, 1.0)])
def test_vertex_side(single_root, n, scale):
    rng = np.random.default_rng(n)
    f = sm.TreeFactor(n, single_root=single_root)
    eta = scale * rng.standard_normal((n + 1, n + 1))
    sol = TreeFacetSolver(f, decline_peaked=False).solve(eta)
    assert sol.status == 0
    r = sm.solve(f, eta, method="vertex")
    np.testing.assert_allclose(sol.u, r.u, atol=1e-9)
    check_kkt(f, eta, sol.u, brute_min_cut if n <= 10 else solver_min_cut)


@pytest.mark.parametrize("single_root", ROOTS)
@pytest.mark.parametrize("n,scale", [(30, 0.01), (60, 0.03), (120, 0.1), (50, 1.0)])
def test_kkt_larger(single_root, n, scale):
    rng = np.random.default_rng(3)
    f = sm.TreeFactor(n, single_root=single_root)
    eta = scale * rng.standard_normal((n + 1, n + 1))
    sol = TreeFacetSolver(f).solve(eta)
    assert sol.status == 0
    # every cut by NetworkX (one maximum flow per word) at 30 words, then the
    # solver's own routine
    check_kkt(f, eta, sol.u, networkx_min_cut if n <= 30 else solver_min_cut)


def test_masks():
    rng = np.random.default_rng(4)
    n = 12
    for single_root in ROOTS:
        s = solver(n, single_root)
        eta = 0.1 * rng.standard_normal((n + 1, n + 1))
        eta[rng.random((n + 1, n + 1)) < 0.4] = -np.inf
        eta[0, 1:] = 0.1              # keep a tree avoiding the forbidden arcs
        sol = s.solve(eta)
        assert sol.status == 0
        check_kkt(s.factor, eta, sol.u, networkx_min_cut)
        np.testing.assert_allclose(sol.u, sm.solve(s.factor, eta).u, atol=1e-9)
        # the Jacobian is zero on forbidden arcs
        g = sol.vjp(rng.standard_normal((n + 1, n + 1)))[0]
        assert np.all(g[~allowed_arcs(eta)] == 0)


def test_declines():
    rng = np.random.default_rng(5)
    n = 5
    s = solver(n)
    eta = rng.standard_normal((n + 1, n + 1))
    no_head = eta.copy()
    no_head[:, 3] = -np.inf                      # word 3 has no allowed head
    no_tree = eta.copy()
    no_tree[0, 1:] = -np.inf                     # nothing leaves the root
    bad = eta.copy()
    bad[2, 4] = np.nan
    for e in (no_head, no_tree, bad):
        assert s.solve(e).status == 1
    # single root: every root arc allowed, but two word groups only reachable from it
    sr = solver(4, single_root=True)
    eta = np.zeros((5, 5))
    eta[1, 3] = eta[3, 1] = eta[2, 4] = eta[4, 2] = 0.0
    eta[1, 2] = eta[2, 1] = eta[1, 4] = eta[4, 1] = -np.inf
    eta[3, 2] = eta[2, 3] = eta[3, 4] = eta[4, 3] = -np.inf
    assert sr.solve(eta).status == 1
    with pytest.raises(ValueError):
        sm.solve(sr.factor, eta)                  # the vertex side raises
    # peaked scores: declined at once (before any projection) unless asked
    eta = 10.0 * rng.standard_normal((n + 1, n + 1))
    peaked = TreeFacetSolver(sm.TreeFactor(n)).solve(eta)
    assert peaked.status == 1 and peaked.n_iter == 0
    assert solver(n).solve(eta).status == 0
    # heads forced by masks do not make flat scores look peaked
    n = 12
    eta = 0.01 * rng.standard_normal((n + 1, n + 1))
    for m in range(1, 9):
        eta[:, m] = -np.inf
        eta[m - 1, m] = 0.0                      # the chain 0 -> 1 -> ... -> 8
    sol = TreeFacetSolver(sm.TreeFactor(n)).solve(eta)
    assert sol.status == 0
    np.testing.assert_allclose(sol.u, sm.solve(sm.TreeFactor(n), eta).u, atol=1e-9)


def test_refuses_projective_and_other_factors():
    with pytest.raises(ValueError, match="projective"):
        TreeFacetSolver(sm.TreeFactor(4, projective=True))
    with pytest.raises(ValueError, match="TreeFactor"):
        TreeFacetSolver(sm.SequenceFactor(3, 2))


def test_column_shift_and_scale_invariance():
    """u does not change when a column is shifted by a constant (its equality) or when
    the scores move by huge amounts in that way."""
    rng = np.random.default_rng(6)
    n = 15
    s = solver(n)
    eta = 0.05 * rng.standard_normal((n + 1, n + 1))
    u = s.solve(eta).u
    shifted = eta + 1e8 * rng.standard_normal(n + 1)[None, :]
    np.testing.assert_allclose(s.solve(shifted).u, u, atol=1e-7)


# -- the backward pass -----------------------------------------------------------------
def fd_check(s, eta, rng, n_dirs=3, eps=1e-7):
    """Central differences of the solver's own forward at steps eps and eps/10 (small:
    at 120 words and flat scores some arcs are within 1e-6 of 0): where
    they agree u is linear along d (no kink within the steps) and jvp must match.
    Returns the number of directions checked."""
    sol = s.solve(eta)
    assert sol.status == 0
    checked = 0
    for _ in range(n_dirs):
        d = rng.standard_normal(eta.shape)
        fds = [(s.solve(eta + h * d).u - s.solve(eta - h * d).u) / (2 * h) for h in (eps, eps / 10)]
        if np.abs(fds[0] - fds[1]).max() > 1e-5 * (1 + np.abs(fds[0]).max()):
            continue       # a kink within the steps
        jd = sol.jvp(d)
        np.testing.assert_allclose(jd, fds[0], atol=1e-6 * (1 + np.abs(jd).max()))
        g = rng.standard_normal(eta.shape)
        vg = sol.vjp(g)[0]
        assert (vg * d).sum() == pytest.approx((g * jd).sum(), abs=1e-11 * np.abs(g).sum())
        checked += 1
    return checked


@pytest.mark.parametrize("single_root", ROOTS)
@pytest.mark.parametrize("n,scale", [(80, 0.01), (80, 0.03), (80, 0.1), (120, 0.01),
                                     (120, 0.03), (120, 0.1), (8, 1.0), (30, 3.0)])
def test_jacobian_finite_differences(single_root, n, scale):
    rng = np.random.default_rng(7)
    s = solver(n, single_root)
    eta = scale * rng.standard_normal((n + 1, n + 1))
    assert fd_check(s, eta, rng) >= 2


@pytest.mark.parametrize("single_root", ROOTS)
@pytest.mark.parametrize("scale", [0.03, 1.0])
def test_jacobian_against_vertex_side_differences(single_root, scale):
    """Finite differences of the vertex side's u (sm.solve), at two steps."""
    rng = np.random.default_rng(8)
    n = 10
    f = sm.TreeFactor(n, single_root=single_root)
    eta = scale * rng.standard_normal((n + 1, n + 1))
    sol = TreeFacetSolver(f, decline_peaked=False).solve(eta)
    for _ in range(2):
        d = rng.standard_normal((n + 1, n + 1))
        fd1 = finite_difference_jvp(f, eta, d_eta_u=d, eps=1e-5)
        fd2 = finite_difference_jvp(f, eta, d_eta_u=d, eps=1e-6)
        np.testing.assert_allclose(fd1, fd2, atol=1e-6)
        np.testing.assert_allclose(sol.jvp(d), fd2, atol=1e-6)


def test_jacobian_structure():
    """J is a projection: symmetric, idempotent, zero off the support, blind to column
    shifts (the columns' equalities) and, with single_root, to shifts of the root row."""
    rng = np.random.default_rng(9)
    n = 25
    for single_root in ROOTS:
        s = solver(n, single_root)
        eta = 0.1 * rng.standard_normal((n + 1, n + 1))
        sol = s.solve(eta)
        a = rng.standard_normal((n + 1, n + 1))
        ja = sol.jvp(a)
        np.testing.assert_allclose(sol.jvp(ja), ja, atol=1e-12)
        np.testing.assert_array_equal(sol.vjp(a)[0], ja)
        assert np.all(ja[sol.u == 0] == 0)
        col = np.tile(rng.standard_normal(n + 1), (n + 1, 1))
        assert np.abs(sol.jvp(col)).max() <= 1e-12
        if single_root:
            row = np.zeros((n + 1, n + 1))
            row[0] = 1.0
            assert np.abs(sol.jvp(row)).max() <= 1e-12


# -- decompose, threads ---------------------------------------------------------------
# -- head-biased scores ----------------------------------------------------------------
# A parser's arc scores at initialisation share a per-head offset: every word wants the
# same few heads, and many cut constraints around them are tight at once.
def head_biased(n, head_sd, noise_sd, seed):
    rng = np.random.default_rng(seed)
    return (head_sd * rng.standard_normal((n + 1, 1))
            + noise_sd * rng.standard_normal((n + 1, n + 1)))


@pytest.mark.parametrize("single_root", ROOTS)
def test_head_biased_brute_force(single_root):
    rng = np.random.default_rng(11)
    for n in (2, 3, 4):
        s = solver(n, single_root)
        cases = [head_biased(n, hs, ns, seed) for hs, ns, seed in
                 ((0.3, 0.01, 1), (1.0, 0.03, 2), (0.08, 0.01, 3))]
        # ties: integer head offsets, two heads equal, no noise; and equal offsets
        # with tied arcs
        cases.append(np.repeat(rng.integers(-1, 2, size=(n + 1, 1)), n + 1, axis=1) * 0.5)
        cases.append(np.repeat(np.array([[1.0], [1.0]] + [[0.0]] * (n - 1)), n + 1, axis=1))
        if n == 4:
            # each reference QP over 64 or 125 trees takes seconds: two cases
            cases = [cases[0], cases[3]] if single_root else [cases[3]]
        for eta in cases:
            sol = s.solve(eta)
            assert sol.status == 0, (n, eta)
            np.testing.assert_allclose(sol.u, brute_force_u(eta, single_root), atol=1e-9)
            assert max(sol.residuals) <= 1e-12
            check_kkt(s.factor, eta, sol.u, brute_min_cut)


@pytest.mark.parametrize("single_root", ROOTS)
@pytest.mark.parametrize("n,head_sd,noise_sd", [(60, 0.08, 0.01), (60, 0.3, 0.03), (100, 0.3, 0.01),
                                                (150, 0.02, 0.01), (150, 0.08, 0.03)])
def test_head_biased_kkt(single_root, n, head_sd, noise_sd):
    """Past the 64 cuts and 30 separation rounds the solver once stopped at: certified
    by minimum cuts (NetworkX's up to 100 words; at 150, where 150 maximum flows take
    seconds, the solver's Hao-Orlin routine, checked against NetworkX above) and the
    duality gap."""
    s = solver(n, single_root)
    for seed in range(2):
        eta = head_biased(n, head_sd, noise_sd, seed)
        sol = s.solve(eta)
        assert sol.status == 0
        check_kkt(s.factor, eta, sol.u, networkx_min_cut if n <= 100 else solver_min_cut)


@pytest.mark.parametrize("single_root,seed", [(False, 2), (True, 1)])
def test_head_biased_60_words_on_the_facet_side(single_root, seed):
    """A 60-word tree with a head offset (sd 0.08) over arc noise (sd 0.01): solved and
    certified on the facet side within the default budget, with no warning (the
    solver used to give up on these, and the vertex side took over)."""
    f = sm.TreeFactor(60, single_root=single_root)
    eta = head_biased(60, 0.08, 0.01, seed)
    assert TreeFacetSolver(f, decline_peaked=False).solve(eta, budget=1000).status == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for method in ("facet", "auto"):
            r = sm.solve(f, eta, method=method)
            assert r.side == "facet" and r.converged
            r.vjp(np.ones_like(eta))


@pytest.mark.parametrize("single_root", ROOTS)
@pytest.mark.parametrize("n,head_sd,noise_sd", [(100, 0.3, 0.03), (150, 0.08, 0.01)])
def test_head_biased_jacobian_finite_differences(single_root, n, head_sd, noise_sd):
    rng = np.random.default_rng(13)
    s = solver(n, single_root)
    assert fd_check(s, head_biased(n, head_sd, noise_sd, 0), rng) >= 1


def test_decompose():
    rng = np.random.default_rng(10)
    n = 6
    for single_root in ROOTS:
        f = sm.TreeFactor(n, single_root=single_root)
        s = TreeFacetSolver(f)
        u = s.solve(0.3 * rng.standard_normal((n + 1, n + 1))).u
        structures, weights = s.decompose(u)
        assert np.all(weights > 0) and weights.sum() == pytest.approx(1.0, abs=1e-12)
        assert len(weights) <= n * n + 1
        rebuilt = sum(w * f.vertex(t)[0] for t, w in zip(structures, weights))
        np.testing.assert_allclose(rebuilt, u, atol=1e-9)


def test_threads_agree():
    rng = np.random.default_rng(11)
    s = solver(40)
    etas = [0.05 * rng.standard_normal((41, 41)) for _ in range(8)]
    serial = [s.solve(e).u for e in etas]
    out = [None] * len(etas)

    def work(i):
        out[i] = s.solve(etas[i]).u

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(etas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(serial, out):
        np.testing.assert_array_equal(a, b)


def test_a_state_that_does_not_fit_its_layout_raises():
    """The Jacobian reads the state through its header's layout, checked first: a
    state that is empty, cut short, padded, with a head past the tree, or from a tree
    of another size raises instead of reading past its arrays or past u; a state
    that fits gives the same Jacobian after a pickle round trip."""
    rng = np.random.default_rng(5)
    f = sm.TreeFactor(6)
    solver = TreeFacetSolver(f, decline_peaked=False)
    sol = solver.solve(0.01 * rng.standard_normal((7, 7)))
    ints, reals = pickle.loads(pickle.dumps(sol.state_arrays()))
    g = rng.standard_normal((7, 7))
    copy = FacetSolution.__new__(FacetSolution)
    copy.solver = solver
    copy.set_state(ints, reals)
    np.testing.assert_array_equal(copy.vjp(g)[0], sol.vjp(g)[0])
    head = ints.copy()
    head[-1 - 2 * 7 * int(ints[3])] = 7                # the last head: past the 7 nodes
    other = TreeFacetSolver(sm.TreeFactor(7), decline_peaked=False)
    for state, s, match in [((ints[:0], reals), solver, "empty"),
                            ((ints[:-1], reals), solver, "layout"),
                            ((ints, np.append(reals, 0.0)), solver, "layout"),
                            ((head, reals), solver, "belong"),
                            ((ints, reals), other, "belong")]:
        copy = FacetSolution.__new__(FacetSolution)
        copy.solver = s
        copy.set_state(*state)
        with pytest.raises(ValueError, match=match):
            copy.vjp(g if s is solver else np.zeros((8, 8)))


@pytest.mark.parametrize("single_root", ROOTS)
@pytest.mark.parametrize("n,kind,scale", [(5, "iid", 1.0), (30, "iid", 1.0), (60, "iid", 3.0),
                                          (60, "head", 0.3), (100, "head", 0.08)])
def test_warm_start_gives_the_cold_solution(single_root, n, kind, scale):
    """Started from an earlier solution's tight cuts (nearby scores, far ones, the same
    ones), the solve ends at the cold solve's point and piece: certified by the minimum
    cuts and the duality gap, and with the same Jacobian."""
    s = solver(n, single_root)
    rng = np.random.default_rng(4)
    base = (head_biased(n, scale, 0.01, 5) if kind == "head"
            else scale * rng.standard_normal((n + 1, n + 1)))
    prev = s.solve(base)
    assert prev.status == 0
    d = rng.standard_normal((n + 1, n + 1))
    for eta in (base, base + 0.02 * scale * rng.standard_normal(base.shape),
                scale * rng.standard_normal(base.shape)):
        cold, warm = s.solve(eta), s.solve(eta, warm=prev)
        assert cold.status == warm.status == 0
        np.testing.assert_allclose(warm.u, cold.u, rtol=0, atol=1e-12)
        check_kkt(s.factor, eta, warm.u, networkx_min_cut)
        np.testing.assert_allclose(warm.jvp(d)[0], cold.jvp(d)[0], rtol=0, atol=1e-9)
        if eta is base:
            # at the same scores every cut the solve needs is held from the start: no
            # separation round adds one, and no more passes than cold
            assert warm.state_arrays()[0][4] == 0       # TreeHeader.rounds
            assert warm.n_iter <= cold.n_iter


def test_warm_start_from_a_declined_or_foreign_solution():
    """A declined solve's empty state seeds nothing; another solver's solution is refused."""
    s = solver(8)
    eta = np.random.default_rng(0).standard_normal((9, 9))
    empty = s.solve(eta, budget=0)
    assert empty.status == 1
    np.testing.assert_allclose(s.solve(eta, warm=empty).u, s.solve(eta).u, atol=1e-12)
    with pytest.raises(ValueError, match="warm"):
        s.solve(eta, warm=solver(8).solve(eta))
