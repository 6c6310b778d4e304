"""Projective trees at flat scores: the vertex side against a CRF and an extended formulation.

Projective trees have no facet side (docs/solvers.rst, "Projective trees at flat
scores"): their polytope has no compact description by constraints. For each root
setting, number of words ``n`` and score scale, on ``eta = scale * randn`` (seed
``--seed``), the script prints

* **vertex**: ``sm.solve(f, eta)`` (the active set) and one ``r.vjp``, CPU seconds
  of each (the median of ``--repeats`` runs of both), the support and backward-set sizes against ``dim + 1 = n^2 - n + 1``
  (the polytope's dimension plus one; one less with ``single_root``), ``conv``
  (``r.converged``) and ``cap`` (whether the solve warned that the backward set
  reached its cap, so that the products are not the Jacobian);
* **CRF**: the projective CRF, Eisner's inside algorithm over log-sum-exp in torch
  float64 (vectorised over the spans of one width) for the log-partition, and its
  gradient (the arc marginals) by autograd, median of 3 runs, and the ratio
  vertex / CRF;
* with ``--fd N``: at the sizes given there, the largest relative error
  ``|jvp(d) - fd| / |fd|`` over ``--fd-dirs`` random directions, for central
  differences of ``u`` at the steps ``1e-7`` and ``1e-6``;
* with ``--ef N``: at the sizes given there, the extended formulation solved by
  Clarabel (an interior-point method for sparse conic programs; ``pip install
  clarabel``, not a dependency): the QP over the flows ``y >= 0`` of Eisner's
  hypergraph (Martin, Rardin and Campbell 1990), ``min 1/2 |x|^2 - eta.x`` with
  ``x = A y`` the arcs the hyperedges build, flow conservation ``M y = b`` at every
  span; CPU seconds (one thread), the number of hyperedges, ``|x - u|`` against the
  vertex side and Clarabel's status (``--ef-limit`` seconds at most; an exact
  finish and a Jacobian would come on top);
* with ``--cap K``: the vertex side with its backward set's cap raised to ``K``
  (8192 by default): what spanning the whole optimal face costs.

Usage (sparsemap importable, e.g. ``PYTHONPATH=.`` from the repository root; the
figures of the solvers page came from these runs, one after the other)::

    python benchmarks/bench_projective.py --sizes 60 --scales 0.01 0.03 0.1 --fd 60 --repeats 3
    python benchmarks/bench_projective.py --sizes 80 100 120 --scales 0.01 0.1
    python benchmarks/bench_projective.py --sizes 120 --scales 0.03 0.1 --fd 120
    python benchmarks/bench_projective.py --sizes 100 --scales 0.01 --roots 0 --fd 100 --fd-dirs 1
    python benchmarks/bench_projective.py --sizes 100 --scales 0.01 --roots 0 --fd 100 \
        --fd-dirs 1 --cap 8192
    python benchmarks/bench_projective.py --sizes 120 --scales 0.01 --roots 0 --fd 120 \
        --fd-dirs 1 --cap 8192
    python benchmarks/bench_projective.py --sizes 20 40 60 --scales 0.01 --roots 0 --ef 20 40 60

The default (n up to 120, three scales, both root settings) takes about ten minutes of CPU;
the 120-word solves at scale 0.01 take 80 s each.
"""
import argparse
import time
import warnings

import numpy as np

import sparsemap as sm


def crf_logz(torch, eta, single_root):
    """log Z of the projective trees: Eisner's inside algorithm in the log semiring."""
    N = eta.shape[0]
    n, big = N - 1, -1e100     # finite "-inf": log-sum-exp of all -inf has no gradient
    sc = eta
    if single_root:
        sc = eta.clone()
        sc[0, :] = big         # the words' chart alone; the root attaches one word after
    full = lambda: torch.full((N, N), big, dtype=eta.dtype)   # noqa: E731  [i, j], i <= j
    ar = torch.arange(N)
    CR = full().index_put((ar, ar), torch.zeros(N, dtype=eta.dtype))   # complete, head i
    CL = full().index_put((ar, ar), torch.zeros(N, dtype=eta.dtype))   # complete, head j
    IR, IL = full(), full()                                            # incomplete
    for w in range(1, N):
        i = torch.arange(N - w)
        j = i + w
        k = i[:, None] + torch.arange(w)[None, :]
        base = torch.logsumexp(CR[i[:, None], k] + CL[k + 1, j[:, None]], dim=1)
        IR = IR.index_put((i, j), base + sc[i, j])
        IL = IL.index_put((i, j), torch.where(i == 0, big, base + sc[j, i]))   # no arc into 0
        k1 = k + 1
        CR = CR.index_put((i, j), torch.logsumexp(IR[i[:, None], k1] + CR[k1, j[:, None]], 1))
        CL = CL.index_put((i, j), torch.logsumexp(CL[i[:, None], k] + IL[k, j[:, None]], 1))
    if not single_root:
        return CR[0, n]
    m = torch.arange(1, N)
    return torch.logsumexp(eta[0, m] + CL[1, m] + CR[m, n], dim=0)


def crf_time(torch, eta, single_root, repeats=3):
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        e = torch.tensor(eta).requires_grad_(True)
        crf_logz(torch, e, single_root).backward()
        times.append(time.process_time() - t0)
    return float(np.median(times)), e.grad.numpy()


def quiet_u(f, eta):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sm.ConvergenceWarning)
        return sm.solve(f, eta).u


def fd_error(f, r, eta, eps, n_dirs):
    worst = 0.0
    for k in range(n_dirs):
        d = np.random.default_rng(100 + k).standard_normal(f.shape_u)
        fd = (quiet_u(f, eta + eps * d) - quiet_u(f, eta - eps * d)) / (2 * eps)
        worst = max(worst, np.linalg.norm(r.jvp(d) - fd) / np.linalg.norm(fd))
    return worst


def hypergraph(n, single_root):
    """Eisner's hypergraph as a flow polytope: (M, b, A) with M y = b, y >= 0 and arcs
    A y ((n+1)^2, row-major). Nodes: complete spans CR (head left) and CL (head right),
    incomplete IR (arc i->j) and IL (arc j->i), and T[i, j] = sum_k CR[i,k] CL[k+1,j],
    shared by IR[i, j] and IL[i, j]; complete spans of one word are leaves."""
    import scipy.sparse as sp
    N = n + 1
    ids = {}

    def node(kind, i, j):
        return None if (i == j and kind in ("CR", "CL")) else ids.setdefault((kind, i, j), len(ids))

    rows, cols, arcs = [], [], []

    def edge(head, tails, arc=-1):
        e = len(arcs)
        arcs.append(arc)
        rows.append(head)
        cols.append(e)
        for t in tails:
            if t is not None:
                rows.append(~t)     # a tail: coefficient -1 (decoded below)
                cols.append(e)

    lo = 1 if single_root else 0
    for w in range(1, N):
        for i in range(lo, N - w):
            j = i + w
            for k in range(i, j):
                edge(node("T", i, j), (node("CR", i, k), node("CL", k + 1, j)))
            edge(node("IR", i, j), (node("T", i, j),), i * N + j)
            if i >= 1:
                edge(node("IL", i, j), (node("T", i, j),), j * N + i)
                for k in range(i, j):
                    edge(node("CL", i, j), (node("CL", i, k), node("IL", k, j)))
            for k in range(i + 1, j + 1):
                edge(node("CR", i, j), (node("IR", i, k), node("CR", k, j)))
    if single_root:
        goal = node("G", 0, 0)
        for m in range(1, N):
            edge(goal, (node("CL", 1, m), node("CR", m, n)), m)
    else:
        goal = node("CR", 0, n)
    rows = np.array(rows)
    vals = np.where(rows >= 0, 1.0, -1.0)
    M = sp.csc_matrix((vals, (np.where(rows >= 0, rows, ~rows), cols)), shape=(len(ids), len(arcs)))
    b = np.zeros(len(ids))
    b[goal] = 1.0
    arcs = np.array(arcs)
    on = np.nonzero(arcs >= 0)[0]
    A = sp.csr_matrix((np.ones(len(on)), (arcs[on], on)), shape=(N * N, len(arcs)))
    return M, b, A


def ef_solve(n, single_root, eta, limit):
    """The extended formulation's QP by Clarabel: (x as (n+1, n+1), seconds, hyperedges, status)."""
    import clarabel
    import scipy.sparse as sp
    M, b, A = hypergraph(n, single_root)
    V, E = M.shape
    valid = np.asarray(A.sum(1)).ravel() > 0
    Av = A[valid]
    K = Av.shape[0]
    P = sp.block_diag([sp.csc_matrix((E, E)), sp.identity(K)], format="csc")
    q = np.concatenate([np.zeros(E), -eta.ravel()[valid]])
    G = sp.vstack([sp.hstack([M, sp.csc_matrix((V, K))]), sp.hstack([-Av, sp.identity(K)]),
                   sp.hstack([-sp.identity(E), sp.csc_matrix((E, K))])]).tocsc()
    h = np.concatenate([b, np.zeros(K + E)])
    s = clarabel.DefaultSettings()
    s.verbose = False
    s.time_limit = float(limit)
    s.tol_gap_abs = s.tol_gap_rel = s.tol_feas = 1e-10
    t0 = time.process_time()
    sol = clarabel.DefaultSolver(P, q, G, h, [clarabel.ZeroConeT(V + K),
                                              clarabel.NonnegativeConeT(E)], s).solve()
    t = time.process_time() - t0
    x = np.zeros((n + 1) ** 2)
    x[valid] = np.array(sol.x)[E:]
    return x.reshape(n + 1, n + 1), t, E, str(sol.status)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[20, 40, 60, 80, 100, 120])
    p.add_argument("--scales", type=float, nargs="+", default=[0.01, 0.03, 0.1])
    p.add_argument("--roots", type=int, nargs="+", default=[0, 1], help="single_root: 0, 1")
    p.add_argument("--fd", type=int, nargs="*", default=[], help="sizes to check by FD")
    p.add_argument("--fd-dirs", type=int, default=2)
    p.add_argument("--ef", type=int, nargs="*", default=[], help="sizes to solve by Clarabel")
    p.add_argument("--ef-limit", type=float, default=600.0)
    p.add_argument("--cap", type=int, default=None, help="the backward set's cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="vertex-side runs (median)")
    a = p.parse_args()
    import torch
    torch.set_num_threads(1)
    if a.cap is not None:
        from sparsemap._backward import _set_max_backward_rows
        _set_max_backward_rows(a.cap)
    head = (f"{'root':>4} {'n':>4} {'scale':>5} | {'solve s':>8} {'vjp s':>6} {'supp':>5} "
            f"{'bwd':>5} {'dim+1':>6} {'conv':>5} {'cap':>5} | {'CRF ms':>7} {'ratio':>6} | "
            f"{'fd 1e-7':>8} {'fd 1e-6':>8} | {'EF s':>7} {'edges':>7} {'|x-u|':>8} status")
    print(head)
    print("-" * len(head), flush=True)
    for sr in a.roots:
        for scale in a.scales:
            for n in a.sizes:
                f = sm.TreeFactor(n, projective=True, single_root=bool(sr))
                rng = np.random.default_rng(a.seed)
                eta = scale * rng.standard_normal(f.shape_u)
                g = rng.standard_normal(f.shape_u)
                times = []
                for _ in range(a.repeats):
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always", sm.ConvergenceWarning)
                        t0 = time.process_time()
                        r = sm.solve(f, eta)
                        t1 = time.process_time()
                        r.vjp(g)
                        t2 = time.process_time()
                    times.append((t2 - t0, t1 - t0, t2 - t1))
                t_all, t_solve, t_vjp = sorted(times)[len(times) // 2]    # the median run
                cap = any("cap of" in str(w.message) for w in caught)
                crf, _ = crf_time(torch, eta, bool(sr))
                fd = "".join(f"{fd_error(f, r, eta, eps, a.fd_dirs):8.1e} " for eps in (1e-7, 1e-6)) \
                    if n in a.fd else f"{'':8} {'':8} "
                ef = ""
                if n in a.ef:
                    x, t, E, status = ef_solve(n, bool(sr), eta, a.ef_limit)
                    ef = f"{t:7.2f} {E:7d} {np.abs(x - r.u).max():8.1e} {status}"
                print(f"{sr:>4} {n:>4} {scale:>5} | {t_solve:8.3f} {t_vjp:6.3f} "
                      f"{r._sol.n_support:>5} {r._sol.n_backward:>5} {n * n - n + 1 - sr:>6} "
                      f"{str(r.converged):>5} {str(cap):>5} | {crf * 1e3:7.1f} "
                      f"{t_all / crf:6.1f} | {fd}| {ef}", flush=True)


if __name__ == "__main__":
    main()
