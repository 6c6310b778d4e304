"""The facet side for sequences against the vertex side and a CRF.

For tag sequences of ``n`` positions and 17 tags (a BiLSTM tagger's output layer),
unary scores ``eta_u = s_u * randn`` and transition scores ``eta_v = s_v * randn``
(``s_v = 0``: a zero-initialised transition matrix), the script times

* ``facet``: ``SequenceFacetSolver.solve`` + ``vjp`` (``sparsemap._facet_sequence``),
  with its number of pieces and whether it declined (then the time is what the
  attempt cost before the caller would run the vertex side);
* ``vertex``: ``sm.solve`` + ``r.vjp`` (the active set), on the first seed only, at the
  sizes of ``--vertex-sizes`` (20; at 60 it takes seconds to minutes per row),
  at most ``--vertex-iter`` iterations (``conv`` says whether it converged);
* ``crf``: a forward-algorithm CRF in torch float64 for the same scores: ``loss`` is
  the log-partition and its gradient (the marginals) by autograd, ``layer`` the
  marginals as a layer: their forward (log-partition, then its gradient with
  ``create_graph``) and a backward of a random cotangent through them (what
  ``solve`` + ``vjp`` computes for SparseMAP).

Times are CPU seconds of the calling thread (``time.thread_time``), the fastest of
``--repeats`` runs per seed, then the median over ``--seeds`` seeds. Ratios:
``facet / crf loss``, and ``vertex / facet`` where the facet side solved (where it
declined: ``+x%``, what the attempt adds to the vertex side's time). With ``--fd``, rows at ``n = 60`` and
``s_v <= 1e-3`` also print ``|g_v| / |fd|``: the norm of the ``eta_v`` part of ``vjp``
(of a cotangent of norm 1) against the norm of one-sided finite differences
``(u(eta_v + eps e_j) - u(eta_v)) / eps`` (``eps > 0``, certified facet solves) over a
random sample of coordinates ``j``, scaled up to all of them (the facet side's acceptance check: at
``s_v = 0`` the vertex side's untied gradient has norm ~3.5e5, the differences 10-200).

Usage::

    python benchmarks/bench_facet_sequence.py                 # 20, 60, 100 positions
    python benchmarks/bench_facet_sequence.py --sizes 60 --vertex-sizes 60 --fd
    python benchmarks/bench_facet_sequence.py --no-vertex     # skip the vertex side

The second is the facet side's acceptance bar (several minutes: the vertex side takes up to 20 s a
row there). The facet side's budget of pieces is ``--budget`` (default ``2 n + 40``):
it declines at once when the scores' estimate of its pieces exceeds twice the budget,
after a few pieces when their rate projects past that, and at the budget.
"""
import argparse
import time
import warnings

import numpy as np

import sparsemap as sm
from _timing import best_time
from sparsemap._facet_sequence import SequenceFacetSolver

S = 17
U_SCALES = (0.01, 0.1, 1.0)
V_SCALES = (0.0, 1e-6, 1e-3, 0.1, 1.0)


def scores(n, s_u, s_v, seed):
    rng = np.random.default_rng(seed)
    eta_u = s_u * rng.standard_normal((n, S))
    eta_v = s_v * rng.standard_normal((n - 1, S, S))
    g = rng.standard_normal((n, S))
    return eta_u, eta_v, g / np.linalg.norm(g)


def time_facet(solver, eta_u, eta_v, g, budget, repeats):
    def run():
        sol = solver.solve(eta_u, eta_v, budget=budget)
        if sol.status == 0:
            sol.vjp(g)
        return sol
    return best_time(run, repeats, clock=time.thread_time)


def time_vertex(f, eta_u, eta_v, g, max_iter):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.thread_time()
        r = sm.solve(f, eta_u, eta_v, method="vertex", max_iter=max_iter)
        r.vjp(g)
        return time.thread_time() - t0, r.converged


def crf_functions():
    """(loss, layer) timers for the torch CRF, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)

    def log_partition(eu, ev):
        alpha = eu[0]
        for i in range(1, eu.shape[0]):
            alpha = torch.logsumexp(alpha[:, None] + ev[i - 1], dim=0) + eu[i]
        return torch.logsumexp(alpha, dim=0)

    def loss(eta_u, eta_v, g):
        eu = torch.tensor(eta_u, requires_grad=True)
        ev = torch.tensor(eta_v, requires_grad=True)
        log_partition(eu, ev).backward()
        return eu.grad

    def layer(eta_u, eta_v, g):
        eu = torch.tensor(eta_u, requires_grad=True)
        ev = torch.tensor(eta_v, requires_grad=True)
        marg = torch.autograd.grad(log_partition(eu, ev), eu, create_graph=True)[0]
        (marg * torch.tensor(g)).sum().backward()
        return eu.grad, ev.grad

    return loss, layer


def fd_ratio(solver, eta_u, eta_v, g, n_sample, rng):
    """|g_v| over the one-sided differences' norm estimated from a sample of coordinates."""
    sol = solver.solve(eta_u, eta_v, budget=10**6)
    g_v = sol.vjp(g)[1]
    eps = 1e-3 * np.abs(eta_v).max() if np.any(eta_v) else 1e-8
    diffs = []
    for j in rng.choice(eta_v.size, n_sample, replace=False):
        e = np.zeros(eta_v.size)
        e[j] = eps
        s2 = solver.solve(eta_u, eta_v + e.reshape(eta_v.shape), budget=10**6)
        assert s2.status == 0
        diffs.append(((s2.u - sol.u) * g).sum() / eps)
    fd = np.sqrt(np.mean(np.square(diffs)) * eta_v.size)
    return np.linalg.norm(g_v) / fd


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 60, 100])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=None, help="pieces (default 2 n + 40)")
    ap.add_argument("--no-vertex", action="store_true")
    ap.add_argument("--vertex-iter", type=int, default=20000)
    ap.add_argument("--vertex-sizes", type=int, nargs="+", default=[20])
    ap.add_argument("--fd", action="store_true", help="the gradient-norm check (slow)")
    ap.add_argument("--fd-sample", type=int, default=40)
    args = ap.parse_args()
    crf = crf_functions()
    if crf is None:
        print("torch is not installed: no CRF column")
    head = (f"{'n':>4} {'s_u':>5} {'s_v':>6} | {'facet ms':>9} {'pieces':>6} {'status':>8} | "
            f"{'vertex ms':>10} {'conv':>5} | {'crf loss':>8} {'layer':>7} | "
            f"{'facet/crf':>9} {'vertex/facet':>12}" + (f" | {'|g_v|/|fd|':>10}" if args.fd else ""))
    print(head)
    print("-" * len(head))
    for n in args.sizes:
        f = sm.SequenceFactor(n, S)
        solver = SequenceFacetSolver(f)
        budget = args.budget if args.budget is not None else 2 * n + 40
        for s_u in U_SCALES:
            for s_v in V_SCALES:
                t_facet, pieces, declined = [], [], 0
                t_loss, t_layer = [], []
                for seed in range(args.seeds):
                    eta_u, eta_v, g = scores(n, s_u, s_v, seed)
                    t, sol = time_facet(solver, eta_u, eta_v, g, budget, args.repeats)
                    t_facet.append(t)
                    pieces.append(sol.n_iter)
                    declined += sol.status != 0
                    if crf is not None:
                        t_loss.append(best_time(lambda: crf[0](eta_u, eta_v, g), args.repeats, clock=time.thread_time)[0])
                        t_layer.append(best_time(lambda: crf[1](eta_u, eta_v, g), args.repeats, clock=time.thread_time)[0])
                tf = 1e3 * np.median(t_facet)
                status = "ok" if declined == 0 else f"{declined}/{args.seeds} dec"
                vertex, conv = "", ""
                if not args.no_vertex and n in args.vertex_sizes:
                    eta_u, eta_v, g = scores(n, s_u, s_v, 0)
                    tv, c = time_vertex(f, eta_u, eta_v, g, args.vertex_iter)
                    vertex, conv = f"{1e3 * tv:10.1f}", f"{str(c):>5}"
                    ratio_v = f"{1e3 * tv / tf:12.1f}" if declined == 0 else f"{f'+{tf / (10 * tv):.1f}%':>12}"
                else:
                    vertex, conv, ratio_v = f"{'-':>10}", f"{'-':>5}", f"{'-':>12}"
                if crf is not None:
                    tl, tly = 1e3 * np.median(t_loss), 1e3 * np.median(t_layer)
                    crf_cols = f"{tl:8.2f} {tly:7.2f} | {tf / tl:9.2f}"
                else:
                    crf_cols = f"{'-':>8} {'-':>7} | {'-':>9}"
                line = (f"{n:4d} {s_u:5g} {s_v:6g} | {tf:9.2f} {int(np.median(pieces)):6d} "
                        f"{status:>8} | {vertex} {conv} | {crf_cols} {ratio_v}")
                if args.fd:
                    if n == 60 and s_v <= 1e-3 and s_u <= 0.1:
                        eta_u, eta_v, g = scores(n, s_u, s_v, 0)
                        rng = np.random.default_rng(1)
                        line += f" | {fd_ratio(solver, eta_u, eta_v, g, args.fd_sample, rng):10.2f}"
                    else:
                        line += f" | {'':>10}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
