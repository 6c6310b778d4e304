"""Non-projective trees: the facet side against the vertex side and a CRF.

For each root setting, number of words ``n`` and score scale, on scores
``eta = scale * randn`` (seeds 0, 1, ...), the script times

* **facet**: ``TreeFacetSolver(f, decline_peaked=False).solve(eta)`` followed
  by one ``vjp`` (the facet-side solver of ``sparsemap._facet_tree``, made to
  solve peaked problems too), with the number of active cuts and of projection
  passes; and how many seeds the default solver (``decline_peaked=True``)
  declines at once as peaked, with the cost of that failed attempt;
* **vertex**: ``sm.solve(f, eta, method="vertex")`` (the active set) followed by one
  ``r.vjp``, where it finishes in reasonable time (a case is skipped, with every
  larger one at that scale and root setting, once a solve took longer than
  ``--vertex-limit`` seconds);
* **CRF**: the matrix-tree theorem in torch float64 (Koo et al. 2007; single
  root: the first row of the words' Laplacian replaced by the root scores),
  forward (log-determinant) and backward (its gradient) on the same scores,
  in the same process;

and prints CPU times (``time.process_time``, torch on one thread): for each
seed the fastest of ``--repeats`` runs, then the median over seeds, with the
ratios facet / CRF and vertex / CRF. The facet side's acceptance bar: at scales 0.01-0.1
and up to 120 words, facet / CRF at most 10.

Usage::

    python benchmarks/bench_facet_tree.py               # the full table (~10 min)
    python benchmarks/bench_facet_tree.py --quick       # fewer sizes, seeds, repeats
    python benchmarks/bench_facet_tree.py --sizes 40 120 --scales 0.01 1
"""
import argparse
import time
import warnings

import numpy as np

import sparsemap as sm
from _timing import best_time
from sparsemap._facet_tree import TreeFacetSolver


def crf_timer(torch):
    def crf(eta, single_root):
        """log Z of the arborescences (matrix-tree theorem) and its gradient."""
        eta = eta.detach().requires_grad_(True)
        n = eta.shape[0] - 1
        w = torch.exp(eta - eta.detach().max())
        A = w[1:, 1:] * (1.0 - torch.eye(n, dtype=eta.dtype))
        L = torch.diag(A.sum(0)) - A
        if single_root:
            L = torch.cat([w[0, 1:].unsqueeze(0), L[1:]], 0)
        else:
            L = L + torch.diag(w[0, 1:])
        logz = torch.logdet(L)
        logz.backward()
        return eta.grad
    return crf


def run(args):
    import torch
    torch.set_num_threads(1)
    crf = crf_timer(torch)
    header = (f"{'root':>6} {'n':>4} {'scale':>6} | {'facet ms':>9} {'cuts':>5} {'passes':>6} "
              f"{'declined':>8} {'decline ms':>10} | {'vertex ms':>10} | {'CRF ms':>7} | "
              f"{'facet/CRF':>9} {'vertex/CRF':>10} {'facet/vertex':>12}")
    print(header)
    print("-" * len(header))
    for single_root in args.single_root:
        for scale in args.scales:
            vertex_off = False
            for n in args.sizes:
                f = sm.TreeFactor(n, single_root=single_root)
                solver = TreeFacetSolver(f, decline_peaked=False)
                default = TreeFacetSolver(f)
                tf, tv, tc, td, cuts, passes, failed = [], [], [], [], [], [], 0
                for seed in range(args.seeds):
                    rng = np.random.default_rng(seed)
                    eta = scale * rng.standard_normal((n + 1, n + 1))
                    g = rng.standard_normal((n + 1, n + 1))

                    def facet():
                        sol = solver.solve(eta)
                        if sol.status == 0:
                            sol.vjp(g)
                        return sol
                    t, sol = best_time(facet, args.repeats)
                    tf.append(t)
                    failed += sol.status != 0
                    if sol.status == 0:
                        cuts.append(sol.state_arrays()[0][2])
                    passes.append(sol.n_iter)
                    t, sol = best_time(lambda: default.solve(eta), args.repeats)
                    if sol.status != 0:
                        td.append(t)

                    et = torch.tensor(eta)
                    t, _ = best_time(lambda: crf(et, single_root), args.repeats)
                    tc.append(t)

                    if not vertex_off:
                        def vertex():
                            with warnings.catch_warnings():
                                warnings.simplefilter("ignore")
                                r = sm.solve(f, eta, method="vertex")
                                r.vjp(g)
                        t, _ = best_time(vertex, 1)
                        if t < args.vertex_limit / 10:
                            t = min(t, best_time(vertex, args.repeats - 1)[0])
                        tv.append(t)
                        if t > args.vertex_limit:
                            vertex_off = True
                mf, mc = 1e3 * np.median(tf), 1e3 * np.median(tc)
                mv = 1e3 * np.median(tv) if tv else np.nan
                vs = f"{mv:10.3f}" if tv else f"{'-':>10}"
                vr = f"{mv / mc:10.2f}" if tv else f"{'-':>10}"
                fv = f"{mf / mv:12.3f}" if tv else f"{'-':>12}"
                ncut = f"{np.median(cuts):5.0f}" if cuts else f"{'-':>5}"
                tds = f"{1e3 * np.median(td):10.3f}" if td else f"{'-':>10}"
                note = f"  ({failed} not solved)" if failed else ""
                print(f"{'single' if single_root else 'multi':>6} {n:4d} {scale:6g} | {mf:9.3f} "
                      f"{ncut} {np.median(passes):6.0f} {len(td):>4d}/{args.seeds:<3d} {tds} | "
                      f"{vs} | {mc:7.3f} | {mf / mc:9.2f} {vr} {fv}{note}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[20, 40, 60, 80, 100, 120])
    p.add_argument("--scales", type=float, nargs="+", default=[0.01, 0.03, 0.1, 0.3, 1.0, 5.0])
    p.add_argument("--single-root", type=int, nargs="+", default=[0, 1], dest="single_root")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--vertex-limit", type=float, default=2.0,
                   help="seconds: skip the vertex side from a slower case on (per scale)")
    p.add_argument("--quick", action="store_true", help="sizes 20 60 120, 3 seeds, 3 repeats")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.seeds, args.repeats = [20, 60, 120], 3, 3
    run(args)


if __name__ == "__main__":
    main()
