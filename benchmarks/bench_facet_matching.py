"""Matchings: the facet side against the vertex side and entropic optimal transport.

For each shape and scale the script draws scores ``scale * randn`` (seeds 0, 1, ...)
and a cotangent ``g = randn``, and times the forward and backward pass of

- **facet**: ``MatchingFacetSolver(f, decline_peaked=False).solve(eta)`` then ``sol.vjp(g)`` (the facet
  side: semismooth Newton on the Birkhoff polytope's dual);
- **vertex**: ``sm.solve(f, eta, method="vertex")`` then ``r.vjp(g)`` (today's active set), on the
  first seed only where that one takes over ``--vertex-budget`` seconds;
- **sinkhorn**: entropic optimal transport in torch float64 (log domain, temperature
  1: ``P = exp(eta + a_i + b_j)``), the shorter side's marginals 1 and the longer
  side's ``k / K`` (balanced), iterated until every marginal is within 1e-9 (at
  most 20000 iterations: ``>20000`` in the table), then ``(P * g).sum().backward()``
  through the iterations (autograd).

It prints, per case, the median over seeds of each method's CPU time (for each seed
the fastest of a few runs), the facet side's median Newton iterations and how many
seeds it declined, the active set's support size, Sinkhorn's iterations, and the
ratios vertex / facet and sinkhorn / facet (above 1: the facet side is faster). A
second table follows the 40 x 40 case to larger scales, to find where the vertex side
takes over.

Usage::

    python benchmarks/bench_facet_matching.py            # the full tables (~3 minutes)
    python benchmarks/bench_facet_matching.py --quick    # fewer seeds and runs

Timings are CPU seconds of the process (``time.process_time``); torch runs on one
thread (``torch.set_num_threads(1)``), as the solvers do. Medians over seeds of the
per-seed minimum; ratios within ~10% are noise on a shared machine.
"""
import argparse
import time
import warnings

import numpy as np

import sparsemap as sm
from _timing import best_time

# a case stops repeating once this many CPU seconds are spent
BUDGET = 0.05
from sparsemap._facet_matching import MatchingFacetSolver

SHAPES = [(40, 40), (30, 50), (50, 30)]
SCALES = [0.01, 0.03, 0.1, 0.3, 1.0, 5.0]
CROSSOVER_SCALES = [5.0, 10.0, 20.0, 50.0, 100.0]


def facet_case(f, eta, g):
    S = MatchingFacetSolver(f, decline_peaked=False)

    def run():
        sol = S.solve(eta)
        sol.vjp(g)
        return sol
    return run


def vertex_case(f, eta, g):
    def run():
        r = sm.solve(f, eta, method="vertex")
        r.vjp(g)
        return r
    return run


def sinkhorn_case(eta, g, torch, tol=1e-9, max_iter=20_000):
    n, m = eta.shape
    k, K = min(n, m), max(n, m)
    a = np.ones(n) if n <= m else np.full(n, k / K)
    b = np.ones(m) if m <= n else np.full(m, k / K)

    def run():
        E = torch.tensor(eta, dtype=torch.float64, requires_grad=True)
        la = torch.log(torch.tensor(a, dtype=torch.float64))
        lb = torch.log(torch.tensor(b, dtype=torch.float64))
        ta = torch.tensor(a, dtype=torch.float64)
        fr = torch.zeros(n, dtype=torch.float64)
        gc = torch.zeros(m, dtype=torch.float64)
        it = 0
        while it < max_iter:
            fr = la - torch.logsumexp(E + gc[None, :], dim=1)
            gc = lb - torch.logsumexp(E + fr[:, None], dim=0)
            it += 1
            # columns are exact after their update: check the rows
            with torch.no_grad():
                err = (torch.exp(E + fr[:, None] + gc[None, :]).sum(dim=1) - ta).abs().max()
            if err <= tol:
                break
        P = torch.exp(E + fr[:, None] + gc[None, :])
        (P * torch.tensor(g)).sum().backward()
        return it if err <= tol else -it
    return run


def _iters(its):
    """Median iterations; '>N' when some run stopped at the cap unconverged."""
    its = np.array(its)
    return f">{-its.min()}" if its.min() < 0 else f"{np.median(its):.0f}"


def row(cells, widths):
    return "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))


def run_table(shapes, scales, seeds, runs, vertex_budget, torch):
    header = ["shape", "scale", "facet ms", "iters", "declined", "vertex ms", "support",
              "sinkhorn ms", "sk iters", "vertex/facet", "sinkhorn/facet"]
    widths = [7, 6, 9, 6, 8, 10, 8, 12, 9, 13, 15]
    print(row(header, widths))
    for shape in shapes:
        f = sm.MatchingFactor(*shape)
        for scale in scales:
            tf, tv, ts, iters, supp, sk_iters, declined = [], [], [], [], [], [], 0
            vertex_seeds = seeds
            for seed in range(seeds):
                rng = np.random.default_rng(seed)
                eta = scale * rng.standard_normal(shape)
                g = rng.standard_normal(shape)
                t, sol = best_time(facet_case(f, eta, g), runs, BUDGET)
                tf.append(t)
                iters.append(sol.n_iter)
                declined += sol.status != 0
                if seed < vertex_seeds:
                    t, r = best_time(vertex_case(f, eta, g), runs, BUDGET)
                    tv.append(t)
                    supp.append(len(r.weights))
                    if t > vertex_budget:
                        vertex_seeds = seed + 1      # a slow case: this seed only
                if torch is not None:
                    t, it = best_time(sinkhorn_case(eta, g, torch), runs, BUDGET)
                    ts.append(t)
                    sk_iters.append(it)
            mf, mv = np.median(tf), np.median(tv)
            ms = np.median(ts) if ts else np.nan
            print(row([f"{shape[0]}x{shape[1]}", scale, f"{1e3 * mf:.3f}",
                       f"{np.median(iters):.0f}", declined, f"{1e3 * mv:.3f}",
                       f"{np.median(supp):.0f}", f"{1e3 * ms:.3f}" if ts else "-",
                       _iters(sk_iters) if ts else "-",
                       f"{mv / mf:.1f}", f"{ms / mf:.1f}" if ts else "-"], widths),
                  flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 seeds, 3 runs")
    ap.add_argument("--vertex-budget", type=float, default=0.3,
                    help="one seed only for the vertex side past this many seconds")
    args = ap.parse_args()
    seeds, runs = (3, 3) if args.quick else (7, 5)
    warnings.simplefilter("ignore")
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        torch = None
        print("(torch is not installed: no Sinkhorn column)")
    print(f"CPU ms per forward + backward, median over {seeds} seeds\n")
    run_table(SHAPES, SCALES, seeds, runs, args.vertex_budget, torch)
    print("\nWhere the vertex side takes over (40 x 40, peaked scores; Sinkhorn at "
          "temperature 1 needs over 20000 iterations there):\n")
    run_table([(40, 40)], CROSSOVER_SCALES, seeds, runs, args.vertex_budget, None)


if __name__ == "__main__":
    main()
