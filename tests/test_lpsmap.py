"""sparsemap.lpsmap, lp-sparsemap's Python API, against independent references.

Every lp-sparsemap factor is rebuilt here from lp-sparsemap's (AD3's) own definition, as
enumerated columns over the lp-sparsemap variable layout (no sparsemap code involved):
the answers must equal the LP-SparseMAP QP over the local polytope, solved by SciPy
(tests/_reference.factor_graph_qp), to 1e-7, and MAP decoding must equal the best
enumerated configuration (and SciPy's HiGHS on the local-polytope LP). Gradients are
checked against central finite differences of that QP. The downstream snippets the
migration guide names run here as their authors wrote them (their import line aside).
"""
import itertools
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy.optimize import linprog

from _helpers import load_script, subprocess_env
from _reference import all_sequences, all_trees, factor_graph_qp

from sparsemap.lpsmap import (AndOut, AtMostOne, Budget, DepTree, FactorGraph, Imply, Or,
                              OrOut, Pair, Sequence, SequenceBudget, TorchFactorGraph, Xor,
                              XorOut)

ROOT = pathlib.Path(__file__).resolve().parents[1]
ATOL = 1e-7


# -- the references: columns of each lp-sparsemap factor, from AD3's definitions ------------
def _logic_ok(kind, z, budget=None, force=False):
    head, last = z[:-1], z[-1]
    return {"xor": lambda: z.sum() == 1,
            "or": lambda: z.sum() >= 1,
            "atmostone": lambda: z.sum() <= 1,
            "imply": lambda: (not head.all()) or last == 1,      # AD3: OR(~x1..~x_{n-1}, x_n)
            "xorout": lambda: head.sum() <= 1 and last == head.sum(),
            "orout": lambda: last == int(head.any()),
            "andout": lambda: last == int(head.all()),
            "budget": lambda: (z.sum() == budget) if force else (z.sum() <= budget),
            }[kind]()


def logic_cols(kind, n, **kw):
    Z = [np.array(z) for z in itertools.product((0, 1), repeat=n)
         if _logic_ok(kind, np.array(z), **kw)]
    return np.array(Z, float).T, None


def pair_cols():
    Z = list(itertools.product((0, 1), repeat=2))
    return np.array(Z, float).T, np.array([[a * b for a, b in Z]], float)


def sequence_cols(L, S):
    M, N = [], []
    for s in all_sequences(L, S):
        m = np.zeros((L, S))
        m[np.arange(L), s] = 1
        n = np.zeros((max(L - 1, 0), S, S))
        for i in range(L - 1):
            n[i, s[i], s[i + 1]] = 1
        M.append(m.ravel())
        N.append(n.ravel())
    return np.array(M).T, np.array(N).T.reshape(-1, len(M))


def seqbudget_cols(L, S, budget, force):
    """AD3's FactorSequenceBudget: additionals = start (S), transitions ((L-1) S S), end (S);
    at most (force: exactly) ``budget`` positions in state 0."""
    M, N = [], []
    for s in all_sequences(L, S):
        c = int((s == 0).sum())
        if c > budget or (force and c != budget):
            continue
        m = np.zeros((L, S))
        m[np.arange(L), s] = 1
        n = np.zeros(2 * S + (L - 1) * S * S)
        n[s[0]] = 1
        for i in range(L - 1):
            n[S + i * S * S + s[i] * S + s[i + 1]] = 1
        n[S + (L - 1) * S * S + s[-1]] = 1
        M.append(m.ravel())
        N.append(n)
    return np.array(M).T, np.array(N).T


def tree_cols(n, packed, projective):
    """lp-sparsemap's DepTree: packed u[m, h] (words from 0, root arc on the diagonal);
    unpacked row m lists heads 0..n (root first) without m itself. projective=True is
    single-root (Eisner), False any arborescence."""
    M = []
    for heads in all_trees(n, projective=projective, single_root=projective):
        u = np.zeros((n, n))
        for m in range(1, n + 1):
            h = heads[m]
            if packed:
                u[m - 1, m - 1 if h == 0 else h - 1] = 1
            else:
                u[m - 1, h if h < m else h - 1] = 1
        M.append(u.ravel())
    return np.array(M).T, None


def reference(V, factors, eta_u, support=None):
    """factors: list of (M, N, variable ids, eta_v)."""
    out = factor_graph_qp(V, [(M, N, np.asarray(ids).ravel(), None) for M, N, ids, _ in factors],
                          np.asarray(eta_u, float).ravel(),
                          [None if e is None else np.asarray(e, float).ravel()
                           for _, _, _, e in factors], support=support)
    return out


def lp_reference(V, factors, eta_u):
    """max eta.u + sum eta_v . N p over the local polytope, by HiGHS: the LP-MAP optimum."""
    eta_u = np.asarray(eta_u, float).ravel()
    K = [M.shape[1] for M, _, _, _ in factors]
    n = V + sum(K)
    c = np.zeros(n)
    c[:V] = -eta_u
    A, b = [], []
    at = V
    for (M, N, ids, ev), k in zip(factors, K):
        if N is not None and ev is not None:
            c[at:at + k] = -(np.asarray(ev, float).ravel() @ N)
        ids = np.asarray(ids).ravel()
        for r in range(M.shape[0]):
            row = np.zeros(n)
            row[at:at + k] = M[r]
            row[ids[r]] -= 1
            A.append(row)
            b.append(0.0)
        row = np.zeros(n)
        row[at:at + k] = 1
        A.append(row)
        b.append(1.0)
        at += k
    res = linprog(c, A_eq=np.array(A), b_eq=np.array(b), bounds=[(0, 1)] * n, method="highs")
    assert res.status == 0
    return -res.fun


def value_of(u, factors, eta_u):
    """The LP objective at an integral u: eta.u + sum of each factor's additional score at
    the (unique) configuration matching u."""
    u = np.asarray(u, float).ravel()
    total = float(np.asarray(eta_u, float).ravel() @ u)
    for M, N, ids, ev in factors:
        col = np.flatnonzero(np.all(np.abs(M - u[np.asarray(ids).ravel()][:, None]) < 1e-12, 0))
        assert col.size == 1, "MAP value is not a configuration of the factor"
        if N is not None and ev is not None:
            total += float(np.asarray(ev, float).ravel() @ N[:, col[0]])
    return total


# -- each factor, alone and inside a graph ------------------------------------------------
def _cases(rng):
    """(name, variable shape, build(u, extra) -> factor, columns, additionals)."""
    L, S = 4, 2
    tr = rng.normal(size=(L - 1, S, S))
    sb = rng.normal(size=2 * S + (L - 1) * S * S)
    sb3 = rng.normal(size=2 * 3 + 2 * 9)
    tr3 = rng.normal(size=(2, 3, 3))
    return [
        ("xor", (5,), lambda u: Xor(u), logic_cols("xor", 5), None),
        ("or", (4,), lambda u: Or(u), logic_cols("or", 4), None),
        ("atmostone", (4,), lambda u: AtMostOne(u), logic_cols("atmostone", 4), None),
        ("imply", (4,), lambda u: Imply(u), logic_cols("imply", 4), None),
        ("xorout", (4,), lambda u: XorOut(u), logic_cols("xorout", 4), None),
        ("orout", (4,), lambda u: OrOut(u), logic_cols("orout", 4), None),
        ("andout", (4,), lambda u: AndOut(u), logic_cols("andout", 4), None),
        ("budget", (2, 3), lambda u: Budget(u, 2), logic_cols("budget", 6, budget=2), None),
        ("budget_forced", (5,), lambda u: Budget(u, np.int64(2), force_budget=True),
         logic_cols("budget", 5, budget=2, force=True), None),
        ("pair", (2,), lambda u: Pair(u[0], u[1], np.array([0.7])), pair_cols(), [0.7]),
        ("sequence", (L, S), lambda u: Sequence(u, tr), sequence_cols(L, S), tr),
        ("sequence3", (3, 3), lambda u: Sequence(u, tr3), sequence_cols(3, 3), tr3),
        ("seqbudget", (L, S), lambda u: SequenceBudget(u, sb, 2), seqbudget_cols(L, S, 2, False),
         sb),
        ("seqbudget_forced", (L, S), lambda u: SequenceBudget(u, sb, 1, force_budget=True),
         seqbudget_cols(L, S, 1, True), sb),
        ("seqbudget_S3", (3, 3), lambda u: SequenceBudget(u, sb3, 1),
         seqbudget_cols(3, 3, 1, False), sb3),
        ("tree_packed_proj", (3, 3), lambda u: DepTree(u, packed=True, projective=True),
         tree_cols(3, True, True), None),
        ("tree_packed", (3, 3), lambda u: DepTree(u, packed=True), tree_cols(3, True, False),
         None),
        ("tree_unpacked_proj", (3, 3), lambda u: DepTree(u, projective=True),
         tree_cols(3, False, True), None),
        ("tree_unpacked", (3, 3), lambda u: DepTree(u), tree_cols(3, False, False), None),
    ]


CASE_NAMES = [c[0] for c in _cases(np.random.default_rng(0))]


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("coupled", [False, True])
def test_factor_equals_enumeration_qp(name, coupled):
    """Each factor alone (no shared variable: plain SparseMAP) and coupled with an
    AtMostOne over its first two variables (the factor-graph path), numpy and torch."""
    rng = np.random.default_rng(CASE_NAMES.index(name) + 10 * coupled)
    _, shape, build, (M, N), ev = _cases(rng)[CASE_NAMES.index(name)]
    for trial in range(3):
        x = rng.normal(size=shape) * (1 + trial)
        factors = [(M, N, np.arange(x.size), ev)]
        if coupled:
            factors.append((*logic_cols("atmostone", 2), [0, 1], None))
        ref = reference(x.size, factors, x)["u"]
        for cls, arr in ((FactorGraph, x), (TorchFactorGraph, torch.tensor(x))):
            fg = cls()
            u = fg.variable_from(arr)
            fg.add(build(u))
            if coupled:
                fg.add(AtMostOne(u.__getitem__(np.unravel_index([0, 1], shape))))
            fg.solve()
            got = u.value.detach().numpy() if cls is TorchFactorGraph else u.value
            np.testing.assert_allclose(got.ravel(), ref, atol=ATOL, err_msg=f"{cls.__name__}")


@pytest.mark.parametrize("name", CASE_NAMES)
def test_solve_map_alone_equals_enumeration(name):
    """solve_map of a factor alone: the best configuration (unique with random scores),
    and its value equals the local-polytope LP optimum (HiGHS)."""
    rng = np.random.default_rng(100 + CASE_NAMES.index(name))
    _, shape, build, (M, N), ev = _cases(rng)[CASE_NAMES.index(name)]
    x = rng.normal(size=shape)
    score = x.ravel() @ M + (0 if N is None else np.asarray(ev, float).ravel() @ N)
    best = M[:, int(np.argmax(score))]
    for cls, arr in ((FactorGraph, x), (TorchFactorGraph, torch.tensor(x))):
        fg = cls()
        u = fg.variable_from(arr)
        fg.add(build(u))
        fg.solve_map(autodetect_acyclic=False)
        got = u.value.numpy() if cls is TorchFactorGraph else u.value
        np.testing.assert_array_equal(got.ravel(), best)
    factors = [(M, N, np.arange(x.size), ev)]
    assert abs(value_of(best, factors, x) - lp_reference(x.size, factors, x)) < 1e-7


NO_ADDITIONALS = [c[0] for c in _cases(np.random.default_rng(0)) if c[4] is None]


@pytest.mark.parametrize("name", NO_ADDITIONALS)
def test_solve_map_coupled_equals_highs(name):
    """solve_map with variables shared (the factor coupled with an AtMostOne over its first
    two variables and an Or over its last two): the LP optimum over the local polytope,
    as HiGHS finds it, at a point of the local polytope."""
    rng = np.random.default_rng(200 + CASE_NAMES.index(name))
    _, shape, build, (M, N), ev = _cases(rng)[CASE_NAMES.index(name)]
    x = rng.normal(size=shape)
    k = x.size
    factors = [(M, N, np.arange(k), None), (*logic_cols("atmostone", 2), [0, 1], None),
               (*logic_cols("or", 2), [k - 2, k - 1], None)]
    best = lp_reference(k, factors, x)
    for cls, arr in ((FactorGraph, x), (TorchFactorGraph, torch.tensor(x))):
        fg = cls()
        u = fg.variable_from(arr)
        fg.add(build(u))
        fg.add(AtMostOne(u.__getitem__(np.unravel_index([0, 1], shape))))
        fg.add(Or(u.__getitem__(np.unravel_index([k - 2, k - 1], shape))))
        fg.solve_map()
        got = (u.value.numpy() if cls is TorchFactorGraph else u.value).ravel()
        assert abs(x.ravel() @ got - best) < 1e-7
        assert got.min() >= -1e-9 and got.max() <= 1 + 1e-9
        assert got[0] + got[1] <= 1 + 1e-9 and got[k - 2] + got[k - 1] >= 1 - 1e-9


@pytest.mark.parametrize("coupled", [False, True])
def test_one_position(coupled):
    """Sequences of length 1 (no transitions) and a one-word tree, alone and in a graph."""
    x = np.array([[0.3, 0.1]])
    for cls, conv in ((FactorGraph, np.asarray), (TorchFactorGraph, torch.tensor)):
        for build, M in ((lambda u: Sequence(u, conv(np.zeros(0))), np.eye(2)),
                         (lambda u: SequenceBudget(u, conv(np.zeros(4)), 0),
                          np.array([[0.0], [1.0]]))):
            fg = cls()
            u = fg.variable_from(conv(x))
            fg.add(build(u))
            fac = [(M, None, [0, 1], None)]
            if coupled:
                fg.add(Or(u[0]))
                fac.append((*logic_cols("or", 2), [0, 1], None))
            fg.solve()
            got = u.value.numpy() if cls is TorchFactorGraph else u.value
            np.testing.assert_allclose(got.ravel(), reference(2, fac, x)["u"], atol=ATOL)
    fg = FactorGraph()
    u = fg.variable_from(np.array([[-0.5]]))
    fg.add(DepTree(u, packed=True))
    fg.solve()
    assert u.value.tolist() == [[1.0]]


def brute_force_map(V, factors, eta_u):
    """The best joint 0/1 assignment allowed by every factor, and its score."""
    best, arg = -np.inf, None
    for z in itertools.product((0.0, 1.0), repeat=V):
        z = np.array(z)
        total = float(np.asarray(eta_u, float).ravel() @ z)
        for M, N, ids, ev in factors:
            col = np.flatnonzero(np.all(M == z[np.asarray(ids).ravel()][:, None], 0))
            if col.size == 0:
                break
            if N is not None and ev is not None:
                total += float(np.asarray(ev, float).ravel() @ N[:, col[0]])
        else:
            if total > best:
                best, arg = total, z
    return arg, best


@pytest.mark.parametrize("name", CASE_NAMES)
def test_solve_map_coupled_tight_equals_brute_force(name):
    """solve_map with shared variables, additional scores included: where the local
    polytope is tight (HiGHS' LP optimum equals the brute-force MAP), the answer is that
    MAP assignment."""
    rng = np.random.default_rng(300 + CASE_NAMES.index(name))
    _, shape, build, (M, N), ev = _cases(rng)[CASE_NAMES.index(name)]
    k = int(np.prod(shape))
    checked = 0
    for trial in range(4):
        x = rng.normal(size=shape)
        factors = [(M, N, np.arange(k), ev), (*logic_cols("atmostone", 2), [0, 1], None)]
        z, score = brute_force_map(k, factors, x)
        if abs(lp_reference(k, factors, x) - score) > 1e-9:
            continue                       # fractional LP optimum: not a MAP question
        checked += 1
        for cls, arr in ((FactorGraph, x), (TorchFactorGraph, torch.tensor(x))):
            fg = cls()
            u = fg.variable_from(arr)
            fg.add(build(u))
            fg.add(AtMostOne(u.__getitem__(np.unravel_index([0, 1], shape))))
            fg.solve_map()
            got = (u.value.numpy() if cls is TorchFactorGraph else u.value).ravel()
            np.testing.assert_allclose(got, z, atol=1e-7)
    assert checked >= 1


def test_free_variables_and_several_variables():
    """Variables in no factor are clipped (MAP: on iff positive); a factor over two
    variables' slices; variables solved jointly in one graph."""
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=(2, 3)), rng.normal(size=4)
    fg = FactorGraph()
    ua, ub = fg.variable_from(a), fg.variable_from(b)
    fg.add(Xor(ua[0]))
    fg.add(Pair(ua[1, :2], ub[:2], np.array([0.5, -0.3])))
    fg.solve()
    # reference: variables 0..5 (a), 6..9 (b)
    fac = [(*logic_cols("xor", 3), [0, 1, 2], None),
           (*pair_cols(), [3, 6], [0.5]), (*pair_cols(), [4, 7], [-0.3])]
    ref = reference(10, fac, np.r_[a.ravel(), b])["u"]
    np.testing.assert_allclose(np.r_[ua.value.ravel(), ub.value], ref, atol=ATOL)
    assert ua.value.shape == (2, 3) and ub.value.shape == (4,)
    np.testing.assert_allclose(ub.value[2:], np.clip(b[2:], 0, 1))
    fg.solve_map()
    np.testing.assert_array_equal(ub.value[2:], (b[2:] > 0).astype(float))


def test_multistate_variables_last_axis():
    """A (B, L, S) variable with one Sequence per b over u[b] (states on the last axis) and
    an AtMostOne across the batch on state 1 at position 0: all in one graph."""
    rng = np.random.default_rng(4)
    B, L, S = 2, 3, 2
    x = rng.normal(size=(B, L, S))
    tr = rng.normal(size=(B, L - 1, S, S))
    fg = FactorGraph()
    u = fg.variable_from(x)
    for b in range(B):
        fg.add(Sequence(u[b], tr[b]))
    fg.add(AtMostOne(u[:, 0, 1]))
    fg.solve()
    ids = np.arange(x.size).reshape(B, L, S)
    Ms, Ns = sequence_cols(L, S)
    fac = [(Ms, Ns, ids[b], tr[b]) for b in range(B)]
    fac.append((*logic_cols("atmostone", 2), ids[:, 0, 1], None))
    np.testing.assert_allclose(u.value.ravel(), reference(x.size, fac, x)["u"], atol=ATOL)
    np.testing.assert_allclose(u[1, :, 0].value, u.value[1, :, 0])
    np.testing.assert_allclose(u[[0, 1], 2][:, 1].value, u.value[[0, 1], 2][:, 1])
    np.testing.assert_allclose(u[u.value.shape[0] - 1].value, u.value[-1])


# -- gradients ------------------------------------------------------------------------------
def _fd_check(run, x, adds, ref_fn, seed, eps=1e-6, atol=1e-5):
    """d/dt w . u(x + t dx, adds + t da) at 0: autograd against central differences of the
    reference QP (on the supports found at x, so both sides stay on the same face)."""
    rng = np.random.default_rng(seed)
    xt = torch.tensor(x, requires_grad=True)
    at = [torch.tensor(a, requires_grad=True) for a in adds]
    u = run(xt, *at)
    w = rng.normal(size=u.shape)
    (u * torch.tensor(w)).sum().backward()
    dx = rng.normal(size=x.shape)
    da = [rng.normal(size=a.shape) for a in adds]
    auto = float((xt.grad.numpy() * dx).sum()
                 + sum((t.grad.numpy() * d).sum() for t, d in zip(at, da)))
    base = ref_fn(x, *adds)
    np.testing.assert_allclose(u.detach().numpy().ravel(), base["u"], atol=ATOL)
    sup = base["support"]
    plus = ref_fn(x + eps * dx, *[a + eps * d for a, d in zip(adds, da)], support=sup)["u"]
    minus = ref_fn(x - eps * dx, *[a - eps * d for a, d in zip(adds, da)], support=sup)["u"]
    fd = float(w.ravel() @ (plus - minus) / (2 * eps))
    assert abs(auto - fd) < atol * (1 + abs(fd)), (auto, fd)


@pytest.mark.parametrize("coupled", [False, True])
def test_sequence_budget_gradient_scores_and_additionals(coupled):
    rng = np.random.default_rng(5 + coupled)
    L, S = 5, 2
    x = rng.normal(size=(L, S))
    adds = rng.normal(size=(L + 1, S, S))   # longer than needed, as downstream code passes
    M, N = seqbudget_cols(L, S, 2, False)

    def run(xt, at):
        fg = TorchFactorGraph()
        u = fg.variable_from(xt)
        fg.add(SequenceBudget(u, at, torch.tensor(2.0)))
        if coupled:
            fg.add(Or(u[1:3, 1]))
        fg.solve()
        return u.value

    def ref(x, a, support=None):
        fac = [(M, N, np.arange(L * S), a.ravel()[:N.shape[0]])]
        if coupled:
            fac.append((*logic_cols("or", 2), [3, 5], None))
        return reference(L * S, fac, x, support=support)

    _fd_check(run, x, [adds], ref, seed=7)


def test_pair_and_sequence_gradients():
    rng = np.random.default_rng(8)
    L, S = 3, 3
    x = rng.normal(size=(L, S))
    tr = rng.normal(size=(L - 1, S, S))
    pa = rng.normal(size=2)
    Ms, Ns = sequence_cols(L, S)

    def run(xt, tt, pt):
        fg = TorchFactorGraph()
        u = fg.variable_from(xt)
        fg.add(Sequence(u, tt))
        fg.add(Pair(u[0, :2], u[2, 1:], pt))
        fg.solve()
        return u.value

    def ref(x, t, p, support=None):
        Mp, Np = pair_cols()
        fac = [(Ms, Ns, np.arange(9), t), (Mp, Np, [0, 7], p[:1]), (Mp, Np, [1, 8], p[1:])]
        return reference(9, fac, x, support=support)

    _fd_check(run, x, [tr, pa], ref, seed=9)


# -- downstream snippets, as their authors wrote them ------------------------------------------
# deep-spin/spectra-rationalization and deep-spin/crest, rationalizers/modules/sparsemap.py
def seq_budget_smap(unary_scores, transition_scores, max_iter=1, step_size=0, init=True,
                    budget=5, temperature=0.01):
    fg = TorchFactorGraph()
    u = fg.variable_from(unary_scores)
    fg.add(SequenceBudget(u, transition_scores, budget))
    fg.solve(max_iter=max_iter, step_size=step_size)
    return u.value[:, 0]


def matching_smap_atmostone_budget(scores, max_iter=5, temperature=1, init=True, budget=None):
    m, n = scores.shape
    fg = TorchFactorGraph()
    z = fg.variable_from(scores / temperature)
    fg.add(Budget(z, budget=budget))
    for i in range(m):
        fg.add(AtMostOne(z[i, :]))
    for j in range(n):
        fg.add(AtMostOne(z[:, j]))
    fg.solve(max_iter=max_iter)
    return z.value


def matching_smap_xor(scores, max_iter=5, temperature=1):
    m, n = scores.shape
    fg = TorchFactorGraph()
    z = fg.variable_from(scores / temperature)
    for i in range(m):
        fg.add(Xor(z[i, :]))
    for j in range(n):
        fg.add(AtMostOne(z[:, j]))
    fg.solve_map(max_iter=max_iter)
    return z.value


# princeton-nlp/rationale-robustness, rrtl/models/eraser_models.py (sample_z's loop)
def matching_smap_budget(scores, max_iter=100, temperature=1.0, init=True, budget=None):
    m, n = scores.shape
    fg = TorchFactorGraph()
    z = fg.variable_from(scores / temperature)
    fg.add(Budget(z, budget=budget))
    fg.solve(max_iter=max_iter)
    return z.value


# deep-spin/SSHN and deep-spin/HFYN
def SparseMAP_exactly_k(scores, k=2):
    marginals = torch.zeros_like(scores)
    for j in range(scores.shape[1]):
        fg = TorchFactorGraph()
        u = fg.variable_from(scores[j, :])
        fg.add(Budget(u, k, force_budget=True))
        fg.solve(verbose=0)
        marginals[j, :] = u.value[:]
    return marginals


def SparseMAP_sequence_exactly_k(scores, edge_score, k=2):
    n = scores.shape[0]
    transition = torch.zeros((n + 1, 2, 2), requires_grad=True)
    transition.data[1:n, 0, 0] = edge_score
    transition = transition.reshape(-1)[2:-2]
    marginals = torch.zeros_like(scores)
    for j in range(scores.shape[1]):
        s = torch.zeros((n, 2))
        s[:, 0] = scores[:, j]
        fg = TorchFactorGraph()
        u = fg.variable_from(s)
        fg.add(SequenceBudget(u, transition, k, force_budget=True))
        fg.solve(verbose=0)
        marginals[:, j] = u.value[:, 0]
    return marginals


def test_snippet_seq_budget_smap():
    """An (L+1, 2, 2) transition tensor (leading 4L entries read), a 0-d float budget from
    torch.round, max_iter=1 and step_size=0: the exact SequenceBudget answer, gradients
    to the scores and the transitions."""
    rng = np.random.default_rng(11)
    L = 5
    x = rng.normal(size=(L, 2))
    tr = rng.normal(size=(L + 1, 2, 2))
    budget = torch.round(torch.tensor(0.45 * L))      # tensor(2.)
    M, N = seqbudget_cols(L, 2, 2, False)

    def run(xt, tt):
        return seq_budget_smap(xt, tt, budget=budget)

    def ref(x, t, support=None):
        out = reference(2 * L, [(M, N, np.arange(2 * L), t.ravel()[:N.shape[0]])], x,
                        support=support)
        return dict(out, u=out["u"].reshape(L, 2)[:, 0])

    _fd_check(run, x, [tr], ref, seed=12)


def test_snippet_matching_budget_and_xor_map():
    rng = np.random.default_rng(13)
    m, n = 3, 4
    x = rng.normal(size=(m, n))
    ids = np.arange(m * n).reshape(m, n)
    fac = [(*logic_cols("budget", m * n, budget=2), ids, None)]
    fac += [(*logic_cols("atmostone", n), ids[i], None) for i in range(m)]
    fac += [(*logic_cols("atmostone", m), ids[:, j], None) for j in range(n)]

    def run(xt):
        return matching_smap_atmostone_budget(xt, budget=torch.tensor(2.0))

    _fd_check(run, x, [], lambda x, support=None: reference(m * n, fac, x, support=support),
              seed=14)


def test_snippet_matching_xor_solve_map():
    """Xor rows, AtMostOne columns: LP-MAP over the local polytope, equal to HiGHS' LP
    optimum."""
    rng = np.random.default_rng(15)
    m, n = 3, 4
    x = rng.normal(size=(m, n))
    ids = np.arange(m * n).reshape(m, n)
    fac = [(*logic_cols("xor", n), ids[i], None) for i in range(m)]
    fac += [(*logic_cols("atmostone", m), ids[:, j], None) for j in range(n)]
    z = matching_smap_xor(torch.tensor(x))
    zn = z.numpy().ravel()
    lp = lp_reference(m * n, fac, x)
    assert abs(x.ravel() @ zn - lp) < 1e-7


def test_snippet_per_sentence_budget_loop():
    """rationale-robustness: one graph per sentence, masked scores -1000, a torch.round
    budget; the whole batch backpropagates."""
    rng = np.random.default_rng(16)
    lengths = [5, 3, 6]
    T = max(lengths)
    logits = torch.tensor(rng.normal(size=(3, T)), requires_grad=True)
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    z = []
    for i in range(3):
        budget = torch.round(0.4 * mask[i].sum())
        scores = logits[i].unsqueeze(0).clone()
        scores[0, ~mask[i]] = -1000.0
        z.append(matching_smap_budget(scores, budget=budget, temperature=0.5))
    z = torch.cat(z, 0)
    w = torch.tensor(rng.normal(size=(3, T)))
    (z * w).sum().backward()
    for i in range(3):
        k = int(round(0.4 * lengths[i]))
        s = np.where(mask[i].numpy(), logits[i].detach().numpy(), -1000.0) / 0.5
        fac = [(*logic_cols("budget", T, budget=k), np.arange(T), None)]
        ref = reference(T, fac, s)
        np.testing.assert_allclose(z[i].detach().numpy(), ref["u"], atol=ATOL)
        eps = 1e-6
        d = rng.normal(size=T)
        up = reference(T, fac, s + eps * d / 0.5, support=ref["support"])["u"]
        dn = reference(T, fac, s - eps * d / 0.5, support=ref["support"])["u"]
        fd = w[i].numpy() @ (up - dn) / (2 * eps)
        assert abs(logits.grad[i].numpy() @ d - fd) < 1e-5


def test_snippet_sshn_exactly_k():
    rng = np.random.default_rng(17)
    scores = torch.tensor(rng.normal(size=(4, 4)))
    got = SparseMAP_exactly_k(scores, k=2)
    for j in range(4):
        fac = [(*logic_cols("budget", 4, budget=2, force=True), np.arange(4), None)]
        np.testing.assert_allclose(got[j].numpy(), reference(4, fac, scores[j].numpy())["u"],
                                   atol=ATOL)
    n = 5
    scores = torch.tensor(rng.normal(size=(n, 3)), dtype=torch.float32)
    got = SparseMAP_sequence_exactly_k(scores, 0.3, k=2)
    assert got.dtype == torch.float32
    M, N = seqbudget_cols(n, 2, 2, True)
    tr = np.zeros((n + 1, 2, 2))
    tr[1:n, 0, 0] = 0.3
    tr = tr.reshape(-1)[2:-2]
    for j in range(3):
        s = np.zeros((n, 2))
        s[:, 0] = scores[:, j].numpy()
        ref = reference(2 * n, [(M, N, np.arange(2 * n), tr)], s)["u"].reshape(n, 2)[:, 0]
        np.testing.assert_allclose(got[:, j].detach().numpy(), ref, atol=1e-6)   # float32 out


def test_snippet_spigot_deptree():
    """understanding-spigot: packed projective DepTree, solve_map then solve(max_iter=1,
    max_inner_iter=50, step_size=0), a variable added to a graph already solved."""
    rng = np.random.default_rng(18)
    n = 4
    arc = torch.tensor(rng.normal(size=(n, n)))
    M, _ = tree_cols(n, True, True)
    fg = TorchFactorGraph()
    v = fg.variable_from(arc)
    fg.add(DepTree(v, packed=True, projective=True))
    fg.solve_map()
    best = M[:, int(np.argmax(arc.numpy().ravel() @ M))]
    np.testing.assert_array_equal(v.value.numpy().ravel(), best)
    assert (v.value.diagonal().sum() == 1)          # single root
    fg = TorchFactorGraph()
    v = fg.variable_from(arc * 100)
    fg.add(DepTree(v, packed=True, projective=True))
    fg.solve(max_iter=1, max_inner_iter=50, step_size=0)
    u = fg.variable_from(arc)
    fg.add(DepTree(u, packed=True, projective=True))
    fg.solve(max_iter=1, max_inner_iter=50, step_size=0)
    fac = [(M, None, np.arange(n * n), None)]
    np.testing.assert_allclose(u.value.numpy().ravel(),
                               reference(n * n, fac, arc.numpy())["u"], atol=ATOL)
    np.testing.assert_allclose(v.value.numpy().ravel(),
                               reference(n * n, fac, 100 * arc.numpy())["u"], atol=ATOL)


def test_constrained_tree_example_gradient():
    """lp-sparsemap's examples/constrained_tree.py (n=4): a packed projective tree with at
    most 2 modifiers per head, sharing variables; u.value[1, -1].backward()."""
    n = 4
    torch.manual_seed(4)
    x = torch.randn(n, n, dtype=torch.float64)
    M, _ = tree_cols(n, True, True)
    ids = np.arange(n * n).reshape(n, n)
    fac = [(M, None, ids, None)]
    for k in range(n):
        ix = [i for i in range(n) if i != k]
        fac.append((*logic_cols("budget", n - 1, budget=2), ids[ix, k], None))

    # the snippet as the migration example keeps it (lp-sparsemap's example, import changed)
    run = load_script("examples/lpsmap_migration.py", "lpsmap_migration_example").constrained_tree
    _fd_check(run, x.numpy(), [], lambda x, support=None: reference(n * n, fac, x,
                                                                    support=support), seed=19)


# -- dtypes, devices, budgets, errors, imports -------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_value_dtype_and_grad(dtype):
    x = torch.tensor([[0.3, 0.9], [0.1, 0.2]], dtype=dtype, requires_grad=True)
    tr = torch.zeros(1, 2, 2, dtype=dtype, requires_grad=True)
    fg = TorchFactorGraph()
    u = fg.variable_from(x)
    fg.add(Sequence(u, tr))
    fg.add(Xor(u[:, 0]))
    fg.solve()
    assert u.value.dtype == dtype and u[:, 1].value.dtype == dtype
    assert u.value.device == x.device
    u[:, 1].value.sum().backward()
    assert x.grad.dtype == dtype and tr.grad.dtype == dtype and tr.grad.shape == (1, 2, 2)
    for extra in (False, True):      # one factor over the whole variable; and a slice
        y = torch.tensor([0.9, 0.8, 0.1], dtype=dtype, requires_grad=True)
        fg = TorchFactorGraph()
        u = fg.variable_from(y)
        fg.add(Budget(u if not extra else u[:2], 1))
        fg.solve()
        assert u.value.dtype == dtype
        u.value[0].backward()
        assert y.grad.dtype == dtype
        np.testing.assert_allclose(y.grad.double().numpy(), [0.5, -0.5, 0.0], atol=1e-2)


def test_second_derivative_raises():
    """With create_graph the first derivative is still exact, and differentiating it again
    raises instead of being silently zero. Budget(1) on (0.9, 0.8, 0.1): u = (0.55, 0.45,
    0), and on the two free variables with the budget binding J = I - 1 1^T / 2 (0
    elsewhere), so the gradient of |u|^2 / 2, J u, is (0.05, -0.05, 0)."""
    y = torch.tensor([0.9, 0.8, 0.1], dtype=torch.float64, requires_grad=True)
    fg = TorchFactorGraph()
    u = fg.variable_from(y)
    fg.add(Budget(u, 1))
    fg.solve()
    (g,) = torch.autograd.grad((u.value ** 2).sum() / 2, y, create_graph=True)
    np.testing.assert_allclose(g.detach().numpy(), [0.05, -0.05, 0.0], rtol=0, atol=1e-12)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


@pytest.mark.parametrize("budget", [2, 2.0, np.int32(2), np.float32(2.0), np.array(2),
                                    torch.tensor(2), torch.tensor(2.0), torch.tensor([2.0])])
def test_budget_types(budget):
    x = np.array([0.9, 0.8, 0.7, -0.1])
    fg = FactorGraph()
    u = fg.variable_from(x)
    fg.add(Budget(u, budget))
    fg.solve()
    ref = reference(4, [(*logic_cols("budget", 4, budget=2), np.arange(4), None)], x)["u"]
    np.testing.assert_allclose(u.value, ref, atol=ATOL)


@pytest.mark.parametrize("budget", [2.5, -1, True, "2", torch.tensor([1.0, 2.0]),
                                    float("nan"), None])
def test_budget_refused(budget):
    fg = FactorGraph()
    u = fg.variable_from(np.zeros(3))
    with pytest.raises(ValueError, match="budget"):
        Budget(u, budget)
    with pytest.raises(ValueError, match="budget"):
        SequenceBudget(fg.variable_from(np.zeros((3, 2))), np.zeros(12), budget)


def test_errors():
    fg = FactorGraph()
    u = fg.variable_from(np.zeros((3, 2)))
    other = FactorGraph().variable_from(np.zeros(3))
    with pytest.raises(ValueError, match="another factor graph"):
        fg.add(Xor(other))
    with pytest.raises(ValueError, match="factor"):
        fg.add("Xor")
    with pytest.raises(ValueError, match="variables"):
        Xor(np.zeros(3))
    with pytest.raises(ValueError, match=r"shape \(n, n\)"):
        DepTree(u)
    with pytest.raises(ValueError, match="seq_length, n_states"):
        Sequence(u[0], np.zeros(0))
    with pytest.raises(ValueError, match="vars_j"):
        Pair(u[0], u[:, 0], np.zeros(2))
    with pytest.raises(ValueError, match="infeasible"):
        Budget(u, 7, force_budget=True)
    with pytest.raises(ValueError, match="infeasible"):
        SequenceBudget(u, np.zeros(12), 4, force_budget=True)
    with pytest.raises(ValueError, match="OrOut needs at least 3"):
        OrOut(u[0])
    fg.add(SequenceBudget(u, np.zeros(11), 1))          # 12 needed: 2 + 2*4 + 2
    with pytest.raises(ValueError, match="additionals: expected at least 12"):
        fg.solve()
    fg = FactorGraph()
    u = fg.variable_from(np.zeros((3, 2)))
    fg.add(Sequence(u, np.zeros((3, 2, 2))))            # 8 needed, exactly
    with pytest.raises(ValueError, match="additionals: expected 8"):
        fg.solve()
    for kw in ({"max_iter": 0}, {"tol": -1.0}, {"step_size": "a"}, {"adapt": 2},
               {"verbose": None}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            FactorGraph().solve(**kw)
    with pytest.raises(ValueError, match="scores"):
        FactorGraph().variable_from(np.array([np.nan]))
    with pytest.raises(ValueError, match="scores"):
        TorchFactorGraph().variable_from(np.zeros(2))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for shared in (False, True):       # the one-factor path and the graph path
            fg = TorchFactorGraph()
            u = fg.variable_from(torch.tensor([0.5, bad, 0.1]))
            fg.add(Budget(u, 1))
            if shared:
                fg.add(Xor(u[:2]))
            if bad == -float("inf"):       # a mask: the variable is 0
                fg.solve()
                assert u.value[1] == 0
                continue
            with pytest.raises(ValueError, match=r"scores: contains nan or \+inf"):
                fg.solve()


def test_verbose_prints_what_happened(capsys):
    fg = FactorGraph()
    u = fg.variable_from(np.zeros(3))
    fg.add(Xor(u))
    fg.solve(verbose=1)
    assert "plain SparseMAP" in capsys.readouterr().out
    v = fg.variable_from(np.zeros(2))
    fg.add(AtMostOne(v))
    fg.solve(verbose=1)
    assert "2 independent factors" in capsys.readouterr().out
    fg.add(AtMostOne(u[:2]))
    fg.solve(verbose=True)
    out = capsys.readouterr().out
    assert "ADMM" in out and "certified" in out and "constraint violation" in out
    fg.solve_map(verbose=True)
    assert "duality gap" in capsys.readouterr().out


def test_imports_stay_layered():
    """`import sparsemap` does not import sparsemap.lpsmap; the NumPy FactorGraph does not
    import torch; nothing in the package imports lp-sparsemap."""
    code = ("import sys, numpy as np, sparsemap\n"
            "assert 'sparsemap.lpsmap' not in sys.modules\n"
            "from sparsemap.lpsmap import FactorGraph, Xor, SequenceBudget\n"
            "fg = FactorGraph(); u = fg.variable_from(np.zeros((3, 2)))\n"
            "fg.add(SequenceBudget(u, np.zeros(12), 1)); fg.add(Xor(u[:2, 0])); fg.solve()\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert 'lpsmap' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=subprocess_env())
    for path in list((ROOT / "sparsemap").rglob("*.py")) + list((ROOT / "examples").rglob("*.py")):
        for line in path.read_text().splitlines():
            s = line.strip()
            assert not (s.startswith("import lpsmap") or s.startswith("from lpsmap")), path


def test_migration_example_runs_and_agrees():
    """examples/lpsmap_migration.py: each snippet through the drop-in equals its native,
    batched form."""
    mod = load_script("examples/lpsmap_migration.py", "lpsmap_migration_example")
    diff = mod.main(verbose=False)
    assert len(diff) == 6
    assert max(diff.values()) < 1e-9, diff


# -- issue 25: padded batches, masks, infeasible graphs, true messages -------------------

def alignment_batch(sizes, P, fill, graph_cls=TorchFactorGraph, seed=0):
    """A padded batch of square documents in one graph: Xor on every row and AtMostOne on
    every column of each document's P x P block, padding filled with ``fill``."""
    rng = np.random.default_rng(seed)
    x = np.full((len(sizes), P, P), fill)
    for b, n in enumerate(sizes):
        x[b, :n, :n] = rng.standard_normal((n, n))
    fg = graph_cls()
    u = fg.variable_from(torch.tensor(x) if graph_cls is TorchFactorGraph else x)
    for b in range(len(sizes)):
        for i in range(P):
            fg.add(Xor(u[b, i, :]))
        for j in range(P):
            fg.add(AtMostOne(u[b, :, j]))
    return fg, u, x


@pytest.mark.parametrize("fill", [float(np.finfo(np.float32).min), -1e30])
def test_padded_batch_is_each_document_alone(fill):
    """On main: row sums up to 4 and column sums up to 1.95 on a padded row, seconds per
    batch. A padded document's rows are forced (Xor) and its fill is one common score on
    each, which cancels; the real block is the unpadded document's answer, and the
    gradient flows."""
    sizes, P = [3, 5, 4], 5
    fg, u, x = alignment_batch(sizes, P, fill)
    fg.solve()
    val = u.value.detach().numpy()
    for b, n in enumerate(sizes):
        g = TorchFactorGraph()
        z = g.variable_from(torch.tensor(x[b, :n, :n]))
        for i in range(n):
            g.add(Xor(z[i, :]))
        for j in range(n):
            g.add(AtMostOne(z[:, j]))
        g.solve()
        np.testing.assert_allclose(val[b, :n, :n], z.value.detach().numpy(), atol=1e-9)
        np.testing.assert_allclose(val[b].sum(1), 1, atol=1e-12)
        assert val[b].sum(0).max() <= 1 + 1e-12
    assert (val[:, :, :][x == fill] >= 0).all()


def test_infeasible_graph_raises_naming_factors_and_batch_element():
    """On main: 10000 iterations, a ConvergenceWarning advising max_iter or tol (neither
    helps), and a point that breaks the constraints."""
    x = torch.tensor(np.random.default_rng(0).standard_normal((3, 4, 3)))
    for graph_cls, scores in ((TorchFactorGraph, x), (FactorGraph, x.numpy())):
        fg = graph_cls()
        u = fg.variable_from(scores)
        for b in range(3):
            for i in range(4 if b == 1 else 3):   # element 1: 4 rows on 3 columns
                fg.add(Xor(u[b, i, :]))
            for j in range(3):
                fg.add(AtMostOne(u[b, :, j]))
        with pytest.raises(ValueError, match=r"infeasible.*batch element 1") as info:
            fg.solve(max_iter=100000, tol=1e-3)
        msg = str(info.value)
        assert "Xor(variable 0[1, 0, :])" in msg and "AtMostOne(variable 0[1, :, 1])" in msg
        assert "(7 factors in all)" in msg
        assert "max_iter" not in msg and "tol" not in msg


def test_masks_in_the_drop_in():
    """-inf fixes a variable at 0 (on main: refused with 'expected finite values')."""
    x = np.random.default_rng(2).standard_normal((3, 4))
    x[0, 1] = x[2, 3] = -np.inf
    fg = FactorGraph()
    u = fg.variable_from(x)
    for i in range(3):
        fg.add(Xor(u[i, :]))
    for j in range(4):
        fg.add(AtMostOne(u[:, j]))
    fg.solve()
    assert u.value[0, 1] == 0 and u.value[2, 3] == 0
    np.testing.assert_allclose(u.value.sum(1), 1, atol=1e-12)
    ref = factor_graph_qp(12, [(np.eye(4)[:, [0, 2, 3]], None, [0, 1, 2, 3], None),
                               (np.eye(4), None, [4, 5, 6, 7], None),
                               (np.eye(4)[:, :3], None, [8, 9, 10, 11], None)]
                          + [(np.c_[np.zeros(3), np.eye(3)], None, [j, 4 + j, 8 + j], None)
                             for j in range(4)], np.where(np.isinf(x), 0, x).ravel())
    np.testing.assert_allclose(u.value.ravel(), ref["u"], atol=1e-9)


def test_value_before_solve_raises_attribute_error_as_lpsmap():
    fg = FactorGraph()
    u = fg.variable_from(np.zeros(3))
    fg.add(Xor(u))
    assert not hasattr(u, "value")
    with pytest.raises(AttributeError, match="not been solved"):
        u[1:].value
    fg.solve()
    assert u.value.shape == (3,)


@pytest.mark.parametrize("graph_cls", [FactorGraph, TorchFactorGraph])
def test_convergence_error_advice_can_be_followed_in_the_drop_in(graph_cls, monkeypatch):
    """The native error says 'Raise max_iter'; the drop-in's max_iter is ignored, so its
    message points to the native solve instead, and following it gives the answer."""
    import sparsemap as sm
    import sparsemap._factor_graph as fgm
    x = np.random.default_rng(5).standard_normal((3, 4))
    monkeypatch.setattr(fgm, "DEFAULT_MAX_ITER", 1)    # an iteration limit that binds
    fg = graph_cls()
    u = fg.variable_from(torch.tensor(x) if graph_cls is TorchFactorGraph else x)
    for i in range(3):
        fg.add(Xor(u[i, :]))
    for j in range(4):
        fg.add(AtMostOne(u[:, j]))
    with pytest.raises(sm.ConvergenceError) as info:
        fg.solve(max_iter=100000)
    msg = str(info.value)
    assert "Raise max_iter" not in msg and "ignores max_iter" in msg
    assert "sparsemap.FactorGraph" in msg and "solve(max_iter=" in msg
    g = sm.FactorGraph()
    z = g.add_variables((3, 4))
    for i in range(3):
        g.add(sm.XorFactor(4), z[i])
    for j in range(4):
        g.add(sm.AtMostOneFactor(3), z[:, j])
    r = g.solve({z: x}, max_iter=10000)
    ref = factor_graph_qp(12, [(np.eye(4), None, list(range(4 * i, 4 * i + 4)), None)
                               for i in range(3)]
                          + [(np.c_[np.zeros(3), np.eye(3)], None, [j, 4 + j, 8 + j], None)
                             for j in range(4)], x.ravel())
    np.testing.assert_allclose(r.u, ref["u"], atol=1e-8)
