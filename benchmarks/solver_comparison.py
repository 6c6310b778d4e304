"""Figure 2 of the paper: the active set vs conditional-gradient variants.

SparseMAP on a non-projective tree factor over ``--n-nodes`` words with random
arc scores ``scale * N(0, 1)`` of shape ``(n + 1, n + 1)``, one instance per
seed, solved by every method with ``sm.solve(..., return_history=True)``.

Panels: suboptimality (objective minus the best objective any solver found on
that instance, floored at the round-off level ``eps * max(1, |f*|)`` for the
log scale) against iterations; support size against iterations; suboptimality
against wall-clock seconds. Lines are medians over the seeds, bands the
interquartile range. For the per-iteration statistics a run that stopped early
(converged) is padded with its final value; on the time axis a run holds its
last value after it returned.

Writes ``solver_comparison.png``, ``.pdf`` and ``.csv`` (long format, one row
per recorded iteration, unpadded) to ``--out`` and prints, per solver, the
median iterations and seconds to reach a duality gap <= 1e-8 and the median
final support size.

Usage: python benchmarks/solver_comparison.py [--n-nodes 20] [--seeds 10]
       [--max-iter 1000] [--scale 1.0] [--out figures]
"""
import argparse
import csv
import os
import sys
import time
import warnings

import numpy as np

import sparsemap as sm
from sparsemap._solve import METHODS

SOLVERS = METHODS
LABELS = {"active_set": "active set", "cg": "CG", "away_cg": "away-step CG",
          "pairwise_cg": "pairwise CG", "bpcg": "blended pairwise CG"}
COLORS = {"active_set": "#1f3b99", "cg": "#d62728", "away_cg": "#ff7f0e",
          "pairwise_cg": "#2ca02c", "bpcg": "#9467bd"}
GAP_TARGET = 1e-8
CSV_FIELDS = ("solver", "seed", "iteration", "seconds", "objective", "suboptimality", "gap",
              "support_size")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-nodes", type=int, default=20, help="words in the tree (default 20)")
    p.add_argument("--seeds", type=int, default=10, help="random instances (default 10)")
    p.add_argument("--max-iter", type=int, default=1000,
                   help="iteration limit of every solver (default 1000)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="standard deviation of the arc scores (default 1.0)")
    p.add_argument("--out", default="figures", help="output folder (default figures/)")
    args = p.parse_args(argv)
    for name in ("n_nodes", "seeds", "max_iter"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive integer")
    if not (np.isfinite(args.scale) and args.scale > 0):
        p.error("--scale: expected a positive finite float")
    return args


def run_instance(n_nodes, seed, scale, max_iter):
    """Solve one random instance with every solver; return {solver: history dict}."""
    f = sm.TreeFactor(n_nodes)
    rng = np.random.default_rng(seed)
    eta = scale * rng.standard_normal((n_nodes + 1, n_nodes + 1))
    runs = {}
    for method in SOLVERS:
        with warnings.catch_warnings():
            # CG variants are expected to hit the iteration limit
            warnings.simplefilter("ignore", sm.ConvergenceWarning)
            r = sm.solve(f, eta, method=method, max_iter=max_iter, return_history=True)
        runs[method] = dict(r.history, final_support=len(r.structures))
    best = min(float(h["objective"].min()) for h in runs.values())
    floor = np.finfo(float).eps * max(1.0, abs(best))
    for h in runs.values():
        h["suboptimality"] = h["objective"] - best
        h["floored"] = np.maximum(h["suboptimality"], floor)
    return runs


def pad(curves):
    """Stack runs of unequal length, each padded with its final value."""
    n = max(len(c) for c in curves)
    return np.array([np.concatenate([c, np.full(n - len(c), c[-1])]) for c in curves])


def on_time_grid(runs, key, grid):
    """Value of each run at each time of ``grid``: its last record at or before it (NaN before the first)."""
    out = np.full((len(runs), len(grid)), np.nan)
    for i, h in enumerate(runs):
        idx = np.searchsorted(h["seconds"], grid, side="right") - 1
        ok = idx >= 0
        out[i, ok] = h[key][idx[ok]]
    return out


def first_reaching(h, target):
    """(iterations, seconds) at which the gap first drops to ``target``, or None."""
    hit = np.flatnonzero(h["gap"] <= target)
    if len(hit) == 0:
        return None
    return hit[0] + 1, h["seconds"][hit[0]]


def median_or_none(values, n_total):
    """Median over all runs counting the misses as infinite; None when that is infinite."""
    vals = sorted(values) + [np.inf] * (n_total - len(values))
    med = float(np.median(vals))
    return med if np.isfinite(med) else None


def summarise(results):
    rows = []
    n = len(results)
    for method in SOLVERS:
        hits = [first_reaching(runs[method], GAP_TARGET) for runs in results]
        its = [h[0] for h in hits if h is not None]
        secs = [h[1] for h in hits if h is not None]
        rows.append(dict(solver=method, reached=len(its), runs=n,
                         iterations=median_or_none(its, n), seconds=median_or_none(secs, n),
                         support=float(np.median([runs[method]["final_support"]
                                                  for runs in results])),
                         final_gap=float(np.median([runs[method]["gap"][-1] for runs in results]))))
    return rows


def print_table(rows, args):
    print(f"Tree factor, {args.n_nodes} words, scale {args.scale}, {args.seeds} instances, "
          f"max_iter {args.max_iter}; medians over instances (a run that never reaches the "
          f"gap counts as infinite; 'reached': runs that did)")
    head = f"{'solver':<22}{'iters to gap<=1e-8':>20}{'seconds to gap<=1e-8':>22}" \
           f"{'reached':>9}{'final support':>15}{'final gap':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        it = "not reached" if r["iterations"] is None else f"{r['iterations']:.0f}"
        sec = "not reached" if r["seconds"] is None else f"{r['seconds']:.2e}"
        print(f"{LABELS[r['solver']]:<22}{it:>20}{sec:>22}{r['reached']:>5}/{r['runs']:<3}"
              f"{r['support']:>15.0f}{r['final_gap']:>11.1e}")


def write_csv(path, results, seeds):
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_FIELDS)
        for seed, runs in zip(seeds, results):
            for method in SOLVERS:
                h = runs[method]
                for i in range(len(h["objective"])):
                    w.writerow((method, seed, i + 1, repr(float(h["seconds"][i])),
                                repr(float(h["objective"][i])),
                                repr(float(h["suboptimality"][i])), repr(float(h["gap"][i])),
                                int(h["support_size"][i])))


def band(ax, x, Y, method, log_stats):
    """Median line and interquartile band over the rows of Y (NaN-aware)."""
    Z = np.log10(Y) if log_stats else Y
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # all-NaN columns before any run started
        q1, med, q3 = np.nanpercentile(Z, [25, 50, 75], axis=0)
    if log_stats:
        q1, med, q3 = 10 ** q1, 10 ** med, 10 ** q3
    ax.plot(x, med, color=COLORS[method], lw=1.6, label=LABELS[method])
    ax.fill_between(x, q1, q3, color=COLORS[method], alpha=0.2, lw=0)


def plot(results, args, png, pdf):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13.5, 4.0), constrained_layout=True)
    t_lo = min(r[m]["seconds"][0] for r in results for m in SOLVERS)
    t_hi = max(r[m]["seconds"][-1] for r in results for m in SOLVERS)
    grid = np.geomspace(max(t_lo, 1e-7), t_hi, 400)
    for method in SOLVERS:
        runs = [r[method] for r in results]
        sub = pad([h["floored"] for h in runs])
        sup = pad([h["support_size"].astype(float) for h in runs])
        it = np.arange(1, sub.shape[1] + 1)
        band(axes[0], it, sub, method, log_stats=True)
        band(axes[1], it, sup, method, log_stats=False)
        T = on_time_grid(runs, "floored", grid)
        # hold the final value after a run returned; show a grid point once half the runs started
        keep = np.sum(np.isfinite(T), axis=0) >= (len(runs) + 1) // 2
        band(axes[2], grid[keep], T[:, keep], method, log_stats=True)
    axes[0].set(xscale="log", yscale="log", xlabel="iteration",
                ylabel="objective − best objective", title="suboptimality")
    axes[1].set(xscale="log", yscale="log", xlabel="iteration", ylabel="structures in support",
                title="support size")
    axes[2].set(xscale="log", yscale="log", xlabel="seconds", ylabel="objective − best objective",
                title="suboptimality vs time")
    for ax in axes:
        ax.grid(True, which="major", alpha=0.3)
    axes[0].legend(loc="lower left", fontsize=8)
    fig.suptitle(f"SparseMAP on a non-projective tree factor, {args.n_nodes} words, "
                 f"scores {args.scale:g}·N(0,1): median and interquartile range over "
                 f"{args.seeds} instances (runs that stopped are padded with their final value; "
                 f"suboptimality floored at eps·|f*|)", fontsize=9)
    fig.savefig(png, dpi=150)
    fig.savefig(pdf)
    plt.close(fig)


def main(argv=None):
    """Run the comparison; return the paths written and the summary rows."""
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    seeds = list(range(args.seeds))
    results = []
    t0 = time.perf_counter()
    for k, seed in enumerate(seeds):
        results.append(run_instance(args.n_nodes, seed, args.scale, args.max_iter))
        print(f"\rinstance {k + 1}/{len(seeds)} ({time.perf_counter() - t0:.1f} s)", end="",
              file=sys.stderr, flush=True)
    print(file=sys.stderr)
    rows = summarise(results)
    print_table(rows, args)
    paths = {ext: os.path.join(args.out, f"solver_comparison.{ext}") for ext in ("png", "pdf", "csv")}
    write_csv(paths["csv"], results, seeds)
    plot(results, args, paths["png"], paths["pdf"])
    print(f"wrote {paths['png']}, {paths['pdf']} and {paths['csv']} "
          f"({time.perf_counter() - t0:.1f} s)")
    return dict(paths=paths, rows=rows)


if __name__ == "__main__":
    main()
