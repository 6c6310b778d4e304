"""Figure 2 of the paper: the active set vs conditional-gradient variants.

SparseMAP on a non-projective tree factor over ``--n-nodes`` words with random
arc scores ``scale * N(0, 1)`` of shape ``(n + 1, n + 1)``, one instance per
seed, solved by every method with ``sm.solve(..., return_history=True)``.

Panels, against the number of steps: the suboptimality (objective minus the
best objective any solver found on that instance, floored at the round-off
level ``eps * max(1, |f*|)`` for the log scale), the duality gap each solver
certifies at its iterate (an upper bound on the suboptimality, computable
without knowing the optimum; the table's "reached" is about it), and the
support size; then the suboptimality against wall-clock seconds. Lines are
medians over the seeds, bands the interquartile range. For the per-step
statistics a run that stopped early (converged) is padded with its final value;
on the time axis a run holds its last value after it returned. The active set
is Cython, the CG variants pure Python: the time panel shows what a user gets,
not a like-for-like comparison of the algorithms.

Steps are counted alike for every solver: step 0 is the MAP structure, where
every solver starts, and step k the iterate after k updates. The solvers'
histories count differently (the active set's iteration 1 records its starting
point, a CG variant's iteration 1 the point after its first step), so the
figure draws the active set's iteration k at step k - 1 and prepends step 0 to
the CG variants; the CSV keeps each solver's own count.

Writes ``solver_comparison.png``, ``.pdf`` and ``.csv`` (long format, one row
per recorded iteration, unpadded) to ``--out`` and prints, per solver, the
median iterations and seconds to reach a duality gap <= 1e-8 and the median
final support size. Progress goes to stderr, on one updating line on a
terminal and as whole lines otherwise (logs, CI).

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
# The paper's Figure 2: its active set (Appendix A.2) against the conditional-gradient
# variants. The active set runs on the vertex side (method="vertex"): the default method
# would take the facet side where that is cheaper, and it has no iterates to plot.
SOLVERS = ("active_set", "cg", "away_cg", "pairwise_cg", "bpcg")
LABELS = {"active_set": "active set", "cg": "CG", "away_cg": "away-step CG",
          "pairwise_cg": "pairwise CG", "bpcg": "blended pairwise CG"}
# The active set runs in Cython, the conditional-gradient variants in pure Python.
IMPLEMENTATION = {m: "Cython" if m == "active_set" else "Python" for m in SOLVERS}
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


def starting_point(f, eta):
    """Objective and duality gap at the MAP structure, where every solver starts."""
    m0, _ = f.vertex(f.map(eta))
    m1, _ = f.vertex(f.map(eta - m0))          # the best move from there
    objective = 0.5 * np.sum(m0 * m0) - np.sum(eta * m0)
    gap = np.sum((eta - m0) * (m1 - m0))
    return float(objective), float(gap)


def by_steps(method, h, start):
    """The run's (objective, gap, support) with step k at index k (see the module notes)."""
    if method == "active_set":   # its iteration 1 records the starting point
        return h["objective"], h["gap"], h["support_size"]
    return (np.r_[start[0], h["objective"]], np.r_[start[1], h["gap"]],
            np.r_[1, h["support_size"]])


def run_instance(n_nodes, seed, scale, max_iter):
    """Solve one random instance with every solver; return {solver: history dict}."""
    f = sm.TreeFactor(n_nodes)
    rng = np.random.default_rng(seed)
    eta = scale * rng.standard_normal((n_nodes + 1, n_nodes + 1))
    start = starting_point(f, eta)
    runs = {}
    for method in SOLVERS:
        with warnings.catch_warnings():
            # CG variants are expected to hit the iteration limit
            warnings.simplefilter("ignore", sm.ConvergenceWarning)
            r = sm.solve(f, eta, method="vertex" if method == "active_set" else method,
                         max_iter=max_iter, return_history=True)
        runs[method] = dict(r.history, final_support=len(r.structures), converged=r.converged)
    best = min(float(h["objective"].min()) for h in runs.values())
    floor = np.finfo(float).eps * max(1.0, abs(best))
    for method, h in runs.items():
        h["suboptimality"] = h["objective"] - best
        h["floored"] = np.maximum(h["suboptimality"], floor)
        obj, gap, support = by_steps(method, h, start)
        h["steps"] = dict(floored=np.maximum(obj - best, floor), gap=np.maximum(gap, floor),
                          support=support.astype(float))
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


def band(ax, x, Y, method, log_stats, **line_kw):
    """Median line and interquartile band over the rows of Y (NaN-aware); returns the median."""
    Z = np.log10(Y) if log_stats else Y
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # all-NaN columns before any run started
        q1, med, q3 = np.nanpercentile(Z, [25, 50, 75], axis=0)
    if log_stats:
        q1, med, q3 = 10 ** q1, 10 ** med, 10 ** q3
    # the active set on top: it finishes first and would hide under the others
    z = 3 if method == "active_set" else 2
    ax.plot(x, med, color=COLORS[method], lw=2.4, zorder=z + 0.5, **line_kw)
    ax.fill_between(x, q1, q3, color=COLORS[method], alpha=0.18, lw=0, zorder=z)
    return med


def plot(results, args, png, pdf):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rc = {"font.size": 15, "axes.titlesize": 17, "axes.labelsize": 15, "xtick.labelsize": 13,
          "ytick.labelsize": 13, "legend.fontsize": 14}
    with plt.rc_context(rc):
        # a fixed layout: title, legend for every panel, 2 x 2 panels, caption
        fig, axes = plt.subplots(2, 2, figsize=(14, 11.5),
                                 gridspec_kw=dict(left=0.075, right=0.985, top=0.85, bottom=0.115,
                                                  hspace=0.36, wspace=0.22))
        ax_sub, ax_gap, ax_sup, ax_time = axes.ravel()
        n_steps = max(len(r[m]["steps"]["floored"]) for r in results for m in SOLVERS)
        t_lo = min(r[m]["seconds"][0] for r in results for m in SOLVERS)
        t_hi = max(r[m]["seconds"][-1] for r in results for m in SOLVERS)
        grid = np.geomspace(max(t_lo, 1e-7), t_hi, 400)
        for method in SOLVERS:
            runs = [r[method] for r in results]
            curves = {key: pad([h["steps"][key] for h in runs])
                      for key in ("floored", "gap", "support")}
            x = np.arange(curves["floored"].shape[1])
            band(ax_sub, x, curves["floored"], method, log_stats=True)
            band(ax_gap, x, curves["gap"], method, log_stats=True)
            sup = band(ax_sup, x, curves["support"], method, log_stats=False)
            T = on_time_grid(runs, "floored", grid)
            # hold the final value after a run returned; show a grid point once half the runs started
            keep = np.sum(np.isfinite(T), axis=0) >= (len(runs) + 1) // 2
            tmed = band(ax_time, grid[keep], T[:, keep], method, log_stats=True)
            if method == "active_set" and all(h["converged"] for h in runs):
                # every instance has converged by the end of its line: mark it, and carry
                # the final support on to the end of the others
                end = x[-1]
                for ax, key in ((ax_sub, "floored"), (ax_gap, "gap"), (ax_sup, "support")):
                    y = sup[-1] if key == "support" else 10 ** np.median(np.log10(curves[key][:, -1]))
                    ax.plot(end, y, "o", ms=11, color=COLORS[method], mec="white", mew=1.5,
                            zorder=5)
                t_end = float(np.median([h["seconds"][-1] for h in runs]))
                ax_time.plot(t_end, tmed[np.searchsorted(grid[keep], t_end)], "o", ms=11,
                             color=COLORS[method], mec="white", mew=1.5, zorder=5)
                ax_sup.plot([end, n_steps - 1], [sup[-1], sup[-1]], ":", lw=2.4,
                            color=COLORS[method], zorder=3.5)
                ax_sup.annotate(f"active set: converged\nwith {sup[-1]:.0f} trees",
                                (0.6 * (n_steps - 1), sup[-1]), xytext=(0.97, 0.06),
                                textcoords="axes fraction", ha="right", va="bottom",
                                color=COLORS[method],
                                arrowprops=dict(arrowstyle="->", color=COLORS[method]))
        ax_gap.axhline(GAP_TARGET, color="0.3", ls="--", lw=1.2, zorder=1)
        ax_gap.annotate(f"target of the table, {GAP_TARGET:.0e}", (1, GAP_TARGET),
                        xytext=(4, 4), textcoords="offset points", color="0.3", fontsize=13)
        for ax in (ax_sub, ax_gap, ax_sup):
            # step 0 (the MAP structure, the common start) on a log axis
            ax.set_xscale("symlog", linthresh=1, linscale=0.4)
            ax.set_xlim(0, n_steps - 1)
            ax.set_xlabel("steps (0 = the best single tree)")
        ax_sub.set(yscale="log", ylabel="objective − optimum", title="Distance to the optimum")
        ax_gap.set(yscale="log", ylabel="duality gap (bound on the distance)",
                   title="What each solver can certify")
        ax_sup.set(yscale="log", ylabel="trees with nonzero weight", title="Size of the solution")
        ax_time.set(xscale="log", yscale="log", xlabel="seconds",
                    ylabel="objective − optimum", title="Distance to the optimum over time")
        ax_time.text(0.97, 0.97, "active set: compiled (Cython)\n"
                     "CG variants: pure Python\nso not a like-for-like race",
                     transform=ax_time.transAxes, ha="right", va="top", fontsize=13,
                     bbox=dict(boxstyle="round", fc="white", ec="0.7"))
        for ax in axes.ravel():
            ax.grid(True, which="major", alpha=0.3)
        handles = [Line2D([], [], color=COLORS[m], lw=3,
                          label=f"{LABELS[m]} ({IMPLEMENTATION[m]})") for m in SOLVERS]
        handles.append(Line2D([], [], color=COLORS["active_set"], marker="o", ms=11, ls=":",
                              lw=2.4, mec="white", label="active set converged"))
        fig.suptitle(f"SparseMAP solvers on random {args.n_nodes}-word dependency trees "
                     f"({args.seeds} instances)", fontsize=20, fontweight="bold", y=0.985)
        fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.955), ncol=3,
                   frameon=False)
        fig.text(0.5, 0.015,
                 "Every solver starts from the best single tree (MAP) at step 0; a step is one "
                 "update of the solution, with at most one MAP call.\nLines: median over "
                 "instances; shaded: middle half. Distances below "
                 f"{np.finfo(float).eps:.0e} (relative) are round-off and drawn at that floor.",
                 ha="center", va="bottom", fontsize=13)
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
    # one updating line on a terminal, whole lines in a log
    start, end = ("\r", "") if sys.stderr.isatty() else ("", "\n")
    for k, seed in enumerate(seeds):
        results.append(run_instance(args.n_nodes, seed, args.scale, args.max_iter))
        print(f"{start}instance {k + 1}/{len(seeds)} ({time.perf_counter() - t0:.1f} s)",
              end=end, file=sys.stderr, flush=True)
    if end == "":
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
