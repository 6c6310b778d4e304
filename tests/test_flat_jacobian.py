"""Exact derivatives at flat scores (small, nearly equal scores: a freshly initialised model).

There the optimal face (every structure tied at the adjusted scores ``eta - u``) is
large, and a support that spans only part of it gives the right ``u`` with a wrong
Jacobian. The references here know nothing of supports:

- finite differences of ``u``: ``u`` is piecewise affine, so where it is locally
  linear (one-sided differences at two step sizes, forward and backward, agree)
  the central difference is the derivative up to the solve's round-off;
- the permutahedron, whose SparseMAP is the Euclidean projection onto it: isotonic
  regression (SciPy), with the Jacobian ``I - (averaging within pooled blocks)``;
- brute-force enumeration of the tied face of small factors.

The finite differences use default solves (``tol=1e-12``): their ``u`` agrees with
that of ``tol=0`` solves to 1e-13 .. 1.4e-12 (measured on trees of 10 to 25 words at
scales 0.01 to 0.3), i.e. 1e-6 at most in a difference at step 1e-6, while a ``tol=0``
solve at flat scores runs until it stalls (0.06 s for 10 words, 3 s for 20 words at
scale 0.1, 30 s at 0.01): too slow for this suite. Steps ``h`` and ``10 h`` with
``h = 1e-6 max(1, max |eta|)``.
"""
import warnings

import numpy as np
import pytest
import torch

import sparsemap as sm
from sparsemap.testing import dense_columns, enumerate_structures

H = 1e-6


def _u(f, eu, ev, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sm.ConvergenceWarning)
        return sm.solve(f, eu, ev, **kw).u.ravel()


def fd_check(f, eta_u, eta_v=None, n_dirs=3, seed=0, rtol=1e-5, atol=1e-6, **kw):
    """(n_checked, max error of jvp and vjp against finite differences, worst scale).

    A direction is checked when u is linear along it within 10 h (forward and backward
    differences at h and 10 h agree); then jvp(d) must equal the central difference,
    and <vjp(g), d> must equal <g, fd> for a random g.
    """
    rng = np.random.default_rng(seed)
    ev = np.zeros(f.shape_v) if eta_v is None else eta_v
    h = H * max(1.0, float(np.abs(eta_u).max()), float(np.abs(ev).max(initial=0.0)))
    r = sm.solve(f, eta_u, ev, **kw)     # differentiated (kw: another solver)
    u0 = _u(f, eta_u, ev)                # differences of active-set solves
    n_checked = 0
    for _ in range(n_dirs):
        du = rng.standard_normal(f.shape_u)
        dv = rng.standard_normal(f.shape_v) if f.n_v else np.zeros(f.shape_v)
        ups = {t: _u(f, eta_u + t * du, ev + t * dv) for t in (h, -h, 10 * h, -10 * h)}
        fd = (ups[h] - ups[-h]) / (2 * h)
        sides = [(ups[h] - u0) / h, (u0 - ups[-h]) / h, (ups[10 * h] - u0) / (10 * h),
                 (u0 - ups[-10 * h]) / (10 * h)]
        tol = atol + rtol * np.abs(fd).max()
        if max(np.abs(s - fd).max() for s in sides) > tol:
            continue     # a kink within 10 h: no derivative to compare with
        n_checked += 1
        jvp = r.jvp(du, dv if f.n_v else None).ravel()
        np.testing.assert_allclose(jvp, fd, rtol=0, atol=tol, err_msg="jvp vs finite differences")
        g = rng.standard_normal(f.shape_u)
        gu, gv = r.vjp(g)
        lhs = gu.ravel() @ du.ravel() + (gv.ravel() @ dv.ravel() if f.n_v else 0.0)
        assert abs(lhs - g.ravel() @ fd) <= tol * np.abs(g).sum(), "vjp vs finite differences"
    return n_checked


def flat(f, scale, seed, with_v=True):
    rng = np.random.default_rng(seed)
    eu = scale * rng.standard_normal(f.shape_u)
    ev = scale * rng.standard_normal(f.shape_v) if (with_v and f.n_v) else None
    return eu, ev


TREES = [(n, proj, single, scale)
         for scale, ns in [(0.01, (12, 20, 12)), (0.1, (20, 15, 16)), (0.3, (25, 18, 20)),
                           (1.0, (25, 20, 16)), (5.0, (25, 20, 16))]
         for n, proj, single in zip(ns, (False, True, False), (False, False, True))]


@pytest.mark.parametrize("n, projective, single_root, scale", TREES)
def test_tree_jacobian_at_flat_scores(n, projective, single_root, scale):
    f = sm.TreeFactor(n, projective=projective, single_root=single_root)
    eu, _ = flat(f, scale, seed=n)
    assert fd_check(f, eu, n_dirs=2, seed=n) >= 1


@pytest.mark.parametrize("scale", [0.01, 0.1, 0.3, 1.0, 5.0])
@pytest.mark.parametrize("make", [lambda: sm.SequenceFactor(12, 4),
                                  lambda: sm.MatchingFactor(12, 13),
                                  lambda: sm.BudgetFactor(14, 4),
                                  lambda: sm.SequenceBudgetFactor(10, 3)],
                         ids=["sequence", "matching", "budget", "sequence-budget"])
def test_other_families_at_flat_scores(make, scale):
    f = make()
    eu, ev = flat(f, scale, seed=3)
    assert fd_check(f, eu, ev, n_dirs=2, seed=1) >= 1


# -- the permutahedron: a user's OracleFactor with a closed form ---------------------------

class Permutahedron(sm.OracleFactor):
    """Structures are permutations s; the column of s is w[s] with w = (n, ..., 1) / n.
    MAP is a sort; SparseMAP is the Euclidean projection onto the permutahedron."""

    def __init__(self, n):
        super().__init__(shape_u=n, structure_size=n)
        self.w = np.arange(n, 0, -1) / n

    def oracle_map(self, eta_u, eta_v):
        return np.argsort(np.argsort(-eta_u, kind="stable"), kind="stable")

    def oracle_vertex(self, s):
        return self.w[s]

    def oracle_score(self, s, eta_u, eta_v):
        return float(eta_u @ self.w[s])

    def oracle_overlap(self, s, t):
        return float(self.w[s] @ self.w[t])


def permutahedron_projection(eta, w):
    """Projection onto conv{w[s]} by isotonic regression, and its Jacobian.

    In the order sorting eta decreasingly, u = z - v with v the decreasing isotonic
    regression of z - w; v is the mean of z - w over each pooled block, so
    du = dz - (block means of dz).
    """
    from scipy.optimize import isotonic_regression
    order = np.argsort(-eta, kind="stable")
    z = eta[order]
    res = isotonic_regression(z - w, increasing=False)
    u = np.empty_like(eta)
    u[order] = z - res.x
    J = np.eye(len(eta))
    for a, b in zip(res.blocks[:-1], res.blocks[1:]):
        idx = order[a:b]
        J[np.ix_(idx, idx)] -= 1.0 / (b - a)
    return u, J


@pytest.mark.parametrize("n", [30, 50])
@pytest.mark.parametrize("scale", [0.1, 1.0])
def test_permutahedron_oracle(n, scale):
    f = Permutahedron(n)
    eta = scale * np.random.default_rng(n).standard_normal(n)
    r = sm.solve(f, eta)
    u_ref, J_ref = permutahedron_projection(eta, f.w)
    np.testing.assert_allclose(r.u, u_ref, atol=1e-10)
    J = np.array([r.jvp(e) for e in np.eye(n)]).T
    np.testing.assert_allclose(J, J_ref, atol=1e-8)
    np.testing.assert_allclose(np.array([r.vjp(e)[0] for e in np.eye(n)]), J_ref, atol=1e-8)
    assert fd_check(f, eta, n_dirs=1, seed=0) == 1


# -- the face by enumeration -----------------------------------------------------------------

def face_projector(f, eta_u, eta_v, u, structures, tol=1e-9):
    """Orthogonal projector onto the directions of the tied face, by enumeration."""
    M, N = dense_columns(f, structures)
    ev = np.zeros(f.n_v) if eta_v is None else np.ravel(eta_v)
    adj = M.T @ (np.ravel(eta_u) - np.ravel(u)) + N.T @ ev
    F = M[:, adj >= adj.max() - tol * max(1.0, np.abs(adj).max())]
    D = F[:, 1:] - F[:, :1]
    if D.shape[1] == 0:
        return np.zeros((f.n_u, f.n_u))
    U, s, _ = np.linalg.svd(D, full_matrices=False)
    B = U[:, s > 1e-9 * s.max()]
    return B @ B.T


@pytest.mark.parametrize("make, scale", [
    (lambda: sm.TreeFactor(4), 0.01), (lambda: sm.TreeFactor(4, projective=True), 0.1),
    (lambda: sm.SequenceFactor(4, 3), 0.01), (lambda: sm.MatchingFactor(4, 4), 0.01),
    (lambda: sm.BudgetFactor(6, 2), 0.01)])
def test_jacobian_is_the_projection_onto_the_tied_face(make, scale):
    """At flat random scores (differentiable) the eta_u block of the Jacobian is the
    projector onto the tied face's directions. At all-zero scores (a kink: every
    structure ties) it is the projector onto a subspace between the support's directions
    and the face's (documented: the face the last random direction leaves tied), except
    where ties in eta_v are broken too (a sequence): there it is the piece along
    tie_direction's, whose face need not hold the support (tested by enumeration in
    test_backward_at_tied_eta_v_is_the_piece_along_r_by_enumeration)."""
    f = make()
    S = enumerate_structures(f)
    eta_u = scale * np.random.default_rng(0).standard_normal(f.shape_u)
    r = sm.solve(f, eta_u)
    P = face_projector(f, eta_u, None, r.u, S)
    J = np.array([r.jvp(e.reshape(f.shape_u)).ravel() for e in np.eye(f.n_u)]).T
    np.testing.assert_allclose(J, P, atol=1e-8)
    eta_u = np.zeros(f.shape_u)
    r = sm.solve(f, eta_u)
    P = face_projector(f, eta_u, None, r.u, S)
    Ps = face_projector(f, eta_u, None, r.u, r.structures)   # the support's directions
    J = np.array([r.jvp(e.reshape(f.shape_u)).ravel() for e in np.eye(f.n_u)]).T
    np.testing.assert_allclose(J, J.T, atol=1e-8)
    np.testing.assert_allclose(J @ J, J, atol=1e-8)
    np.testing.assert_allclose(P @ J, J, atol=1e-8)
    if not r._backward_solution().untied:
        np.testing.assert_allclose(J @ Ps, Ps, atol=1e-8)
    else:
        assert f.n_v > 0


# -- batches, CG and pickling use the same backward set ------------------------------------

def test_batch_and_cg_backward_match_at_flat_scores():
    import pickle
    f = sm.TreeFactor(12)
    rng = np.random.default_rng(5)
    etas = 0.1 * rng.standard_normal((4,) + f.shape_u)
    gs = rng.standard_normal((4,) + f.shape_u)
    rs = sm.solve_batch(f, etas, n_jobs=2)
    serial = [sm.solve(f, e) for e in etas]
    batch = sm.vjp_batch(rs, gs, n_jobs=2)
    for r, s, (gu, _), g in zip(rs, serial, batch, gs):
        np.testing.assert_array_equal(gu, s.vjp(g)[0])     # bitwise, as the contract says
        np.testing.assert_array_equal(pickle.loads(pickle.dumps(r)).vjp(g)[0], gu)
    np.testing.assert_array_equal(sm.jvp_batch(rs, gs, n_jobs=2)[1], serial[1].jvp(gs[1]))
    assert fd_check(f, etas[0], n_dirs=2, seed=2) >= 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sm.ConvergenceWarning)
        assert fd_check(f, etas[0], n_dirs=1, seed=2, method="pairwise_cg", max_iter=3000) >= 1


def test_face_completion_budget_warns():
    """max_iter bounds the completion's MAP calls; running out says so."""
    f = sm.TreeFactor(12)
    eta = 0.01 * np.random.default_rng(0).standard_normal(f.shape_u)
    r = sm.solve(f, eta, method="vertex")
    assert r.converged and r.n_map >= r.n_iter + 2
    with pytest.warns(sm.ConvergenceWarning, match="optimal face") as rec:
        r2 = sm.solve(f, eta, max_iter=r.n_iter + 1, method="vertex")
    # u converged; only the backward set is uncertified, and raising max_iter helps
    assert r2.converged and r2.gap <= 1e-12 and "optimal face" in r2.message
    assert "raise max_iter" in str(rec[0].message) and "cap" not in str(rec[0].message)
    np.testing.assert_allclose(r2.u, r.u, atol=1e-12)


@pytest.mark.parametrize("n, projective, seed, cap", [(12, False, 0, 125), (12, False, 0, 100),
                                                       (20, True, 3, 200)])
def test_backward_set_cap_is_reported_truthfully(n, projective, seed, cap):
    """At the backward set's cap (8192 structures, lowered here so that a small tree
    reaches it) u is exact and converged; the warning and message name the cap, not
    max_iter or tol; and the products are then not the Jacobian (finite differences
    tell them apart), as they say. 12 words, non-projective (support 118 trees, face
    132), cap 125: the completion stops at the cap; 100: the support alone exceeds it.
    20 words, projective (support 264, face 265; the family that can meet the cap in
    use, having no facet side), cap 200. On main before
    this change the warning said "raise max_iter" and converged was False."""
    from sparsemap._backward import _set_max_backward_rows
    f = sm.TreeFactor(n, projective=projective)
    eta = 0.01 * np.random.default_rng(seed).standard_normal(f.shape_u)
    r = sm.solve(f, eta, method="vertex")
    assert r.converged and r.message == "converged"
    assert fd_check(f, eta, n_dirs=1, seed=1, method="vertex") == 1
    old = _set_max_backward_rows(cap)
    try:
        with pytest.warns(sm.ConvergenceWarning, match=f"cap of {cap} structures") as rec:
            r2 = sm.solve(f, eta, method="vertex")
        message = r2.message     # read under the cap it was solved with
        with pytest.warns(sm.ConvergenceWarning, match=f"batch element 1: .*cap of {cap}"):
            sm.solve_batch(f, np.stack([10 * eta, eta]), method="vertex")
        d = np.random.default_rng(1).standard_normal(f.shape_u)
        fd = (_u(f, eta + H * d, None, method="vertex")
              - _u(f, eta - H * d, None, method="vertex")) / (2 * H)
    finally:
        _set_max_backward_rows(old)
    warning = str(rec[0].message)
    assert "max_iter and tol do not change this" in warning
    assert "raise max_iter" not in warning and warning.endswith(f"{message}.")
    assert r2.converged and r2.gap <= 1e-12
    np.testing.assert_allclose(r2.u, r.u, atol=1e-12)
    np.testing.assert_allclose(r.jvp(d).ravel(), fd, atol=1e-6)
    assert np.abs(r2.jvp(d).ravel() - fd).max() > 1e-3


def test_sparsemap_loss_needs_no_backward_set():
    """The SparseMAP loss's gradient is u - m_t: it completes no backward set, so at the
    cap (lowered so that a 20-word projective tree at flat scores, face 265, meets it)
    it does not warn about a Jacobian it never uses, and its gradient is u - m_t with
    the u of a plain solve (and the loss the closed form of its definition)."""
    from sparsemap._backward import _set_max_backward_rows
    f = sm.TreeFactor(20, projective=True)
    eta = 0.01 * np.random.default_rng(3).standard_normal(f.shape_u)
    target = np.r_[-1, np.arange(20)]          # a chain: projective
    u = sm.solve(f, eta, method="vertex").u
    mt = np.zeros(f.shape_u)
    mt[target[1:], np.arange(1, 21)] = 1.0
    old = _set_max_backward_rows(200)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loss, gu, _ = sm.sparsemap_loss(f, eta, target, method="vertex")
        with pytest.warns(sm.ConvergenceWarning, match="cap of 200"):
            sm.solve(f, eta, method="vertex")     # the same solve with its backward set
    finally:
        _set_max_backward_rows(old)
    np.testing.assert_allclose(gu, u - mt, atol=1e-12)
    g = u - mt
    expected = 0.5 * (g * g).sum() + (eta * g).sum() - (u * g).sum()
    assert loss == pytest.approx(expected, abs=1e-10)


# -- the distribution at flat scores ----------------------------------------------------------

def test_distribution_at_flat_scores():
    """y* is not unique on a large face: the weights are one optimal distribution (the
    active set's, on an affinely independent support), and their derivative holds that
    support fixed, so sum_k dy_k m_k is the projection of d onto the support's directions,
    not du (the projection onto the whole face)."""
    import sparsemap.torch as smt
    f = sm.TreeFactor(10)
    eta = 0.05 * np.random.default_rng(1).standard_normal(f.shape_u)
    r = sm.solve(f, eta, method="vertex")
    M, _ = dense_columns(f, r.structures)
    adj = M.T @ (eta - r.u).ravel()
    np.testing.assert_allclose(adj, adj.max(), atol=1e-10)       # every structure in the face
    np.testing.assert_allclose(M @ r.weights, r.u.ravel(), atol=1e-12)
    et = torch.tensor(eta, requires_grad=True)
    structures, weights = smt.distribution(f, et, method="vertex")
    d = np.random.default_rng(2).standard_normal(f.shape_u)
    J = np.array([torch.autograd.grad(weights[k], et, retain_graph=True)[0].numpy().ravel()
                  for k in range(len(weights))])          # dy / d eta_u, (K, n_u)
    dy = J @ d.ravel()
    assert abs(dy.sum()) < 1e-10
    S = [f._to_public(s) for s in structures.numpy()]
    Ms, _ = dense_columns(f, S)
    # the projection onto the support's directions, by least squares
    D = Ms[:, 1:] - Ms[:, :1]
    proj = D @ np.linalg.lstsq(D, d.ravel(), rcond=None)[0]
    np.testing.assert_allclose(Ms @ dy, proj, atol=1e-8)
    assert r._sol.n_backward > r._sol.n_support       # the face is larger than the support
    assert np.abs(proj - r.jvp(d).ravel()).max() > 1e-3


# -- the torch layers -------------------------------------------------------------------------

@pytest.mark.parametrize("layer", ["tree", "tree-single-root", "matching"])
def test_torch_gradcheck_at_flat_scores(layer):
    """torch.autograd.gradcheck at scale 0.1 in float64, of the layer restricted to a random
    8-dimensional affine subspace of scores and read through 8 random outputs (so that its
    central differences, input by input, and its backward passes, output by output, stay
    few): z -> C u(x0 + B z)."""
    import sparsemap.torch as smt
    gen = torch.Generator().manual_seed(0)
    shape = (2, 16, 16) if layer.startswith("tree") else (2, 12, 13)
    x0 = 0.1 * torch.randn(*shape, generator=gen, dtype=torch.float64)
    n = x0.numel()
    B = torch.randn(n, 8, generator=gen, dtype=torch.float64)
    C = torch.randn(8, n, generator=gen, dtype=torch.float64)

    def fn(z):
        x = x0 + (B @ z).reshape(shape)
        u = smt.tree(x, single_root=layer.endswith("root")) if layer.startswith("tree") \
            else smt.matching(x)
        return C @ u.reshape(-1)

    z = torch.zeros(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fn, (z,), eps=1e-6, atol=1e-5, rtol=1e-4)


# -- a factor graph: a tree with a budget of modifiers per head ------------------------------

def test_factor_graph_tree_with_budgets_at_flat_scores():
    """LP-SparseMAP's backward (per-factor projectors on the factors' final supports)
    against finite differences of the graph's u, at flat scores."""
    n, b = 10, 3
    tree = sm.TreeFactor(n)
    idx = -np.ones(tree.shape_u, dtype=int)
    arcs = [(h, m) for h in range(n + 1) for m in range(1, n + 1) if h != m]
    for k, (h, m) in enumerate(arcs):
        idx[h, m] = k
    fg = sm.FactorGraph(len(arcs))
    fg.add(tree, idx)
    for h in range(n + 1):
        vs = np.array([idx[h, m] for m in range(1, n + 1) if m != h])
        fg.add(sm.BudgetFactor(len(vs), b), vs)
    rng = np.random.default_rng(0)
    n_checked = 0
    for scale in (0.01, 0.1):
        eta = scale * rng.standard_normal(len(arcs))
        r = fg.solve(eta)
        assert r.converged
        for _ in range(2):
            d = rng.standard_normal(len(arcs))
            u = {t: fg.solve(eta + t * d).u for t in (H, -H, 10 * H, -10 * H)}
            fd, fd10 = (u[H] - u[-H]) / (2 * H), (u[10 * H] - u[-10 * H]) / (20 * H)
            if np.abs(fd - fd10).max() > 1e-6:
                continue
            n_checked += 1
            np.testing.assert_allclose(r.jvp(d), fd, atol=1e-6)
            g = rng.standard_normal(len(arcs))
            assert abs(r.vjp(g)[0] @ d - g @ fd) <= 1e-6 * np.abs(g).sum()
    assert n_checked >= 2


# -- exact ties in eta_v: a kink, and the piece along tie_direction ----------------------------
#
# Where the optimal face holds structures whose n_s is not an affine function of m_s (at
# transition scores that tie exactly, the crossovers of two optimal sequences have the unary
# columns of the pair they cross and other transitions), u has a kink in eta_v, and jvp / vjp
# are documented to be the Jacobian of the piece u follows from eta along (0, r), with
# r = sparsemap.testing.tie_direction(factor).

def _sparsemax(z):
    s = np.sort(z)[::-1]
    c = np.cumsum(s)
    k = np.arange(1, len(z) + 1)
    kk = k[1 + k * s > c][-1]
    return np.maximum(z - (c[kk - 1] - 1) / kk, 0.0)


def sequence_piece_jacobian(eta_u, r):
    """u and the Jacobian (a function of (du, dv)) of a sequence at eta_v = 0 on the piece
    along (0, r), in closed form.

    At eta_v = 0 the positions decouple: u_i = sparsemax(eta_u[i]), with support S_i. The
    sequences tied there are all of S_0 x ... x S_{n-1}. Along r, the pairwise marginals v_i
    are the optimal transport plan between u_i and u_{i+1} maximising <r_i, v_i> (a chain's
    pairwise marginals can be chosen edge by edge); for a generic r its support is a spanning
    tree T_i of S_i x S_{i+1}, and the piece's face is the sequences whose transitions all
    lie in the trees. There a change dv of the transition scores acts as the unary change
    f_i(a) + g_i(b) = dv_i(a, b) on T_i (unique up to a constant, which the projection
    removes), and du = P(du + that), P centring each position on its support.
    """
    from scipy.optimize import linprog
    n, m = eta_u.shape
    u = np.array([_sparsemax(z) for z in eta_u])
    S = [np.flatnonzero(x > 0) for x in u]
    trees = []
    for i in range(n - 1):
        a, b = S[i], S[i + 1]
        A = np.zeros((len(a) + len(b), len(a) * len(b)))
        for p in range(len(a)):
            A[p, p * len(b):(p + 1) * len(b)] = 1
        for q in range(len(b)):
            A[len(a) + q, q::len(b)] = 1
        plan = linprog(-r[i][np.ix_(a, b)].ravel(), A_eq=A, b_eq=np.r_[u[i][a], u[i + 1][b]],
                       method="highs").x.reshape(len(a), len(b))
        tree = [(a[p], b[q]) for p in range(len(a)) for q in range(len(b)) if plan[p, q] > 1e-10]
        assert len(tree) == len(a) + len(b) - 1, "a degenerate plan: draw other scores"
        trees.append(tree)

    def jacobian(du, dv):
        w = np.array(du, dtype=float)
        for i, tree in enumerate(trees):
            E = np.zeros((len(tree), 2 * m))
            for e, (p, q) in enumerate(tree):
                E[e, p] = E[e, m + q] = 1
            fg = np.linalg.lstsq(E, [dv[i, p, q] for p, q in tree], rcond=None)[0]
            w[i] += fg[:m]
            w[i + 1] += fg[m:]
        out = np.zeros_like(w)
        for i, s in enumerate(S):
            out[i, s] = w[i, s] - w[i, s].mean()
        return out
    return u, jacobian


@pytest.mark.parametrize("n, m, scale", [(6, 3, 0.1), (12, 4, 0.3), (20, 6, 1.0), (8, 2, 0.01),
                                         (15, 5, 5.0), (30, 8, 0.1)])
def test_sequence_backward_at_tied_transitions_is_the_piece_along_r(n, m, scale):
    """eta_v = 0 (a zero-initialised transition matrix): jvp and vjp against the closed
    form, and jvp along (0, r) against forward differences along r (a one-sided
    derivative). Fails on the backward set of the tied face, which is not a piece's."""
    from sparsemap.testing import tie_direction
    f = sm.SequenceFactor(n, m)
    r = tie_direction(f)
    rng = np.random.default_rng(n)
    eta_u = scale * rng.standard_normal(f.shape_u)
    u, jac = sequence_piece_jacobian(eta_u, r)
    res = sm.solve(f, eta_u)
    np.testing.assert_allclose(res.u, u, atol=1e-12)
    for _ in range(2):
        du, dv = rng.standard_normal(f.shape_u), rng.standard_normal(f.shape_v)
        ref = jac(du, dv)
        tol = 1e-9 * max(1.0, np.abs(ref).max())
        np.testing.assert_allclose(res.jvp(du, dv), ref, atol=tol)
        g = rng.standard_normal(f.shape_u)
        gu, gv = res.vjp(g)
        assert abs(np.sum(gu * du) + np.sum(gv * dv) - np.sum(g * ref)) <= tol * np.abs(g).sum()
    zero = np.zeros(f.shape_u)
    h = 1e-7 * max(1.0, scale)
    ups = [(_u(f, eta_u, t * r, tol=0, max_iter=100000) - u.ravel()) / t for t in (h, 10 * h)]
    np.testing.assert_allclose(ups[0], ups[1], atol=1e-5)
    np.testing.assert_allclose(res.jvp(zero, r).ravel(), ups[0], atol=1e-5)



def test_sequence_fiber_with_a_small_component_along_r():
    """At eta_v = 0, two positions of 17 tags whose supports are two tags each: the tied
    face holds the crossover of the two pairs, a fiber whose component along the tie
    direction r is the smallest of the 17-tag crossovers (8.1e-5 for the fixed r), so
    the probe moves its score by less than the tie tolerance. The vertex side's fiber
    check must still see it (untie) and return the closed form of the piece along r
    (it returned the tied face's backward set, off by up to 2.6)."""
    from sparsemap.testing import tie_direction
    f = sm.SequenceFactor(2, 17)
    r = tie_direction(f)
    R = r[0]
    pairs = [(a, b) for a in range(17) for b in range(a + 1, 17)]
    along = {(p, q): abs(R[p[0], q[0]] + R[p[1], q[1]] - R[p[0], q[1]] - R[p[1], q[0]])
             for p in pairs for q in pairs}
    (a, b), (c, d) = min(along, key=along.get)
    assert along[(a, b), (c, d)] < 4e-4
    rng = np.random.default_rng(17)
    for _ in range(4):
        eta_u = np.full(f.shape_u, -5.0)
        eta_u[0, [a, b]] = 0.0, rng.uniform(-0.3, 0.3)
        eta_u[1, [c, d]] = 0.0, rng.uniform(-0.3, 0.3)
        u, jac = sequence_piece_jacobian(eta_u, r)
        res = sm.solve(f, eta_u, method="vertex")
        np.testing.assert_allclose(res.u, u, atol=1e-12)
        for _ in range(2):
            du, dv = rng.standard_normal(f.shape_u), rng.standard_normal(f.shape_v)
            ref = jac(du, dv)
            np.testing.assert_allclose(res.jvp(du, dv), ref, atol=1e-9)
            g = rng.standard_normal(f.shape_u)
            gu, gv = res.vjp(g)
            assert np.sum(gu * du) + np.sum(gv * dv) == pytest.approx(np.sum(g * ref), abs=1e-9)

def _affine_basis(M):
    """Indices of a maximal affinely independent subset of M's columns (greedy)."""
    keep = []
    for j in range(M.shape[1]):
        B = np.r_[M[:, keep + [j]], np.ones((1, len(keep) + 1))]
        if np.linalg.matrix_rank(B, tol=1e-9) == len(keep) + 1:
            keep.append(j)
    return keep


def _fiber_free(M, N, idx):
    """Whether n is an affine function of m on the columns idx."""
    A = np.r_[M[:, idx], np.ones((1, len(idx)))]
    return np.linalg.matrix_rank(np.r_[A, N[:, idx]], tol=1e-9) == np.linalg.matrix_rank(
        A, tol=1e-9)


FIBERED = [
    ("sequence", lambda: sm.SequenceFactor(4, 3), 0.3),
    ("sequence-all-tied", lambda: sm.SequenceFactor(3, 3), 0.0),
    ("pair", lambda: sm.PairFactor(), 0.2),
    # a user's factor: structures 0 and 2 have one m and two n, so they always tie at
    # eta_v = 0, and the piece along r holds 2 (MAP's ties go to the lowest index)
    ("generic", lambda: sm.GenericFactor([[1, 0, 1, 0], [0, 1, 0, 1], [0, 0, 0, 1]],
                                         [[1, 0, 0, 1], [0, 0, 1, 0]]), 0.5),
]


@pytest.mark.parametrize("name, make, scale", FIBERED, ids=[c[0] for c in FIBERED])
def test_backward_at_tied_eta_v_is_the_piece_along_r_by_enumeration(name, make, scale):
    """Any factor, by enumeration: the one-sided derivative w along (0, r) from forward
    differences of tol=0 solves at two steps; the face F tied at eta, and its sub-face
    F_r maximising r . n_s - w . m_s (the piece's face); then Prop. 1 with dense matrices on
    an affine basis of F_r (where n is affine in m) must be the whole Jacobian (u and v
    parts), and the tied face F must itself be fibered (else this tests nothing)."""
    from sparsemap.testing import tie_direction
    from test_jacobian import prop1_dense
    f = make()
    r = tie_direction(f).ravel()
    eta_u = scale * np.random.default_rng(7).standard_normal(f.shape_u)
    eta_v = np.zeros(f.shape_v)
    res = sm.solve(f, eta_u, eta_v)
    S = enumerate_structures(f)
    M, N = dense_columns(f, S)
    u0 = res.u.ravel()
    h = 1e-7
    ws = [(_u(f, eta_u, t * r.reshape(f.shape_v), tol=0, max_iter=100000) - u0) / t
          for t in (h, 10 * h)]
    np.testing.assert_allclose(ws[0], ws[1], atol=1e-6)
    adj = M.T @ (eta_u.ravel() - u0)
    F = np.flatnonzero(adj >= adj.max() - 1e-9)
    assert not _fiber_free(M, N, F)
    phi = N[:, F].T @ r - M[:, F].T @ ws[0]
    Fr = F[phi >= phi.max() - 1e-5]
    assert _fiber_free(M, N, Fr)
    J_ref = prop1_dense(f, [S[j] for j in Fr[_affine_basis(M[:, Fr])]])
    n_u = f.n_u
    J = np.array([res.jvp(e[:n_u].reshape(f.shape_u), e[n_u:].reshape(f.shape_v)).ravel()
                  for e in np.eye(n_u + f.n_v)]).T
    np.testing.assert_allclose(J, J_ref, atol=1e-9)
    Jt = np.array([np.concatenate([x.ravel() for x in res.vjp(e.reshape(f.shape_u))])
                   for e in np.eye(n_u)])
    np.testing.assert_allclose(Jt, J_ref, atol=1e-9)


def test_tied_eta_v_is_detected_and_untied_on_demand():
    """A solve only detects the fibered face (two MAP calls); the backward pass unties it
    once, for jvp and vjp alike, and the untied solution pickles. Untied transitions are
    left alone, and batches, CG and the torch layer (which unties in its forward pass)
    agree with the single solve."""
    import pickle
    import sparsemap.torch as smt
    from sparsemap._backward import FACE_STATUS_CERTIFIED, FACE_STATUS_FIBERED
    f = sm.SequenceFactor(10, 4)
    rng = np.random.default_rng(3)
    etas = 0.3 * rng.standard_normal((3,) + f.shape_u)
    gs = rng.standard_normal((3,) + f.shape_u)
    generic = sm.solve(f, etas[0], 0.3 * rng.standard_normal(f.shape_v), method="vertex")
    assert generic._sol.face_status == FACE_STATUS_CERTIFIED
    assert not generic._backward_solution().untied
    res = sm.solve(f, etas[0], method="vertex")
    assert res._sol.face_status == FACE_STATUS_FIBERED
    gu, gv = res.vjp(gs[0])
    back = res._backward_solution()
    assert back.untied and back.face_status == FACE_STATUS_CERTIFIED
    assert res._backward_solution() is back
    copy = pickle.loads(pickle.dumps(res))
    np.testing.assert_array_equal(copy.vjp(gs[0])[1], gv)
    copy = pickle.loads(pickle.dumps(res._sol))      # before untying: still untied on demand
    assert copy.face_status == FACE_STATUS_FIBERED
    rs = sm.solve_batch(f, etas, n_jobs=2, method="vertex")
    for r, (bu, bv), e, g in zip(rs, sm.vjp_batch(rs, gs, n_jobs=2), etas, gs):
        su, sv = sm.solve(f, e, method="vertex").vjp(g)
        np.testing.assert_array_equal(bu, su)
        np.testing.assert_array_equal(bv, sv)
    cg = sm.solve(f, etas[0], method="pairwise_cg", max_iter=20000)
    np.testing.assert_allclose(cg.vjp(gs[0])[1], gv, atol=1e-8)
    eu = torch.tensor(etas, requires_grad=True)
    ev = torch.zeros((3,) + f.shape_v, dtype=torch.float64, requires_grad=True)
    u = smt.sequence(eu, ev, method="vertex")
    u.backward(torch.tensor(gs))
    for i in range(3):
        ru, rv = sm.solve(f, etas[i], method="vertex").vjp(gs[i])
        np.testing.assert_allclose(eu.grad[i].numpy(), ru, atol=1e-10)
        np.testing.assert_allclose(ev.grad[i].numpy(), rv, atol=1e-10)


def test_factor_graph_at_tied_transitions():
    """A factor graph unties too, on its first backward call: with one sequence factor it
    is the single factor's problem (the closed form above, exactly); coupled to a budget
    that binds, jvp is the derivative at eta_v + t r for small t (central differences
    with steps far below t) and, along r, the one-sided derivative at eta_v = 0. Untied
    transitions are left alone (no second solve)."""
    from sparsemap.testing import tie_direction
    n, m = 6, 3
    f = sm.SequenceFactor(n, m)
    r = tie_direction(f)
    idx = np.arange(n * m).reshape(n, m)
    rng = np.random.default_rng(11)
    alone = sm.FactorGraph(n * m)
    alone.add(f, idx)
    eta = 0.3 * rng.standard_normal((n, m))
    u, jac = sequence_piece_jacobian(eta, r)
    res = alone.solve(eta.ravel())
    np.testing.assert_allclose(res.u, u.ravel(), atol=1e-12)
    du, dv = rng.standard_normal((n, m)), rng.standard_normal(f.shape_v)
    np.testing.assert_allclose(res.jvp(du.ravel(), [dv]), jac(du, dv).ravel(), atol=1e-10)
    g = rng.standard_normal(n * m)
    gu, (gv,) = res.vjp(g)
    assert abs(gu @ du.ravel() + np.sum(gv * dv) - g @ jac(du, dv).ravel()) < 1e-9
    assert res._backward_engine() is not res._engine
    coupled = sm.FactorGraph(n * m)
    coupled.add(f, idx)
    coupled.add(sm.BudgetFactor(n, 2), idx[:, 0])
    eta = (0.5 * rng.standard_normal((n, m)) + [0.4, 0.0, 0.0]).ravel()
    res = coupled.solve(eta)
    assert res.polished and abs(res.u[idx[:, 0]].sum() - 2) < 1e-9    # the budget binds

    def u_at(e, ev):
        return coupled.solve(e, [ev, None]).u

    t, h = 1e-6, 1e-9
    fd = (u_at(eta + h * du.ravel(), t * r + h * dv) - u_at(eta - h * du.ravel(), t * r - h * dv))
    np.testing.assert_allclose(res.jvp(du.ravel(), [dv, None]), fd / (2 * h), atol=1e-5)
    sides = [(u_at(eta, s * r) - res.u) / s for s in (1e-7, 1e-6)]
    np.testing.assert_allclose(sides[0], sides[1], atol=1e-6)
    np.testing.assert_allclose(res.jvp(np.zeros(n * m), [r, None]), sides[0], atol=1e-6)
    generic = coupled.solve(eta, [0.3 * rng.standard_normal(f.shape_v), None])
    generic.vjp(g)
    assert generic._backward_engine() is generic._engine


def test_untying_that_fails_warns():
    """max_iter bounds the solve at eta_v + delta r too: when it runs out, the backward
    pass says so and keeps the tied face's backward set (its eta_u part stays exact)."""
    f = sm.SequenceFactor(15, 5)
    eta = 0.1 * np.random.default_rng(0).standard_normal(f.shape_u)
    # the solve takes 57; untying about 1000
    r = sm.solve(f, eta, max_iter=200, method="vertex")
    assert r.converged
    g = np.random.default_rng(1).standard_normal(f.shape_u)
    with pytest.warns(sm.ConvergenceWarning, match="ties in eta_v"):
        gu, _ = r.vjp(g)
    assert not r._backward_solution().untied
    np.testing.assert_allclose(gu, sm.solve(f, eta, method="vertex").vjp(g)[0], atol=1e-10)
    import sparsemap.torch as smt            # the layer unties in its forward pass
    ev = torch.zeros((1,) + f.shape_v, dtype=torch.float64, requires_grad=True)
    with pytest.warns(sm.ConvergenceWarning, match="batch element 0: SparseMAP: ties in eta_v"):
        smt.sequence(torch.tensor(eta[None]), ev, max_iter=200, method="vertex")


def test_binned_transition_scores_untie_to_the_piece_along_r():
    """Transitions tied by construction (a score per jump bin, as in the alignment
    example) rather than zero: the backward pass equals that of solves at eta_v + t r for
    small t, which are generic (untied) points, at two t."""
    from sparsemap.testing import tie_direction
    rng = np.random.default_rng(3)
    n_untied = 0
    for _ in range(12):
        n, m = rng.integers(3, 8), rng.integers(3, 9)
        w = rng.choice([-0.003, 0.0, 0.003, 0.01], size=5)
        jump = np.arange(m)[None, :] - np.arange(m)[:, None]
        ev = np.broadcast_to(w[np.clip(jump, -2, 2) + 2], (n - 1, m, m)).copy()
        eu = 0.5 * rng.standard_normal((n, m))
        f = sm.SequenceFactor(n, m)
        res = sm.solve(f, eu, ev, method="vertex")
        g = rng.standard_normal(f.shape_u)
        gu, gv = res.vjp(g)
        for t in (1e-6, 1e-7):
            hu, hv = sm.solve(f, eu, ev + t * tie_direction(f), method="vertex").vjp(g)
            np.testing.assert_allclose(hu, gu, atol=1e-9)
            np.testing.assert_allclose(hv, gv, atol=1e-9)
        n_untied += res._backward_solution().untied
    assert n_untied >= 6
