"""Active-set SparseMAP: solve time, iterations, MAP calls, support and overhead.

For each instance family this prints the median over random instances of the
wall-clock solve time, the iterations, the MAP calls, the support size, and the
overhead ratio = solve time / (MAP calls x MAP time). The C-level MAP time is
measured in the same run on the scores the solver's MAP calls actually see: the
adjusted scores eta_u - u* at the solution (for trees and matchings these
near-ties make MAP up to 2x slower than fresh random scores, which are timed
too). A ratio near 1 means the solver costs little beyond its MAP calls.

A second table times the logic factors alone (n = 10, 100, 1000) against their
closed-form SparseMAP written in NumPy (sparsemax; clip, then sparsemax or the
projection onto a budget by sorting the breakpoints; the XOR-out and OR-out
projections). Scores are N(0, 1), minus 3 for OR so that its constraint binds. The
closed forms give u only; ``sm.solve`` also returns the support and weights that
its backward pass uses. The last column is max |u - u_closed_form|.

Usage: python benchmarks/bench_solvers.py [--instances 5] [--repeats 3] [--only logic]
"""
import argparse
import statistics
import warnings

import numpy as np

import sparsemap as sm
from sparsemap._batch import _time_map
from bench_batch import median_times


def families():
    for n in (20, 50, 100):
        for scale in (1.0, 5.0):
            yield "tree", n, scale, sm.TreeFactor(n)
    for nm in ((20, 10), (50, 20)):
        for scale in (1.0, 5.0):
            yield "sequence", nm, scale, sm.SequenceFactor(*nm)
    for n in (10, 30):
        for scale in (1.0, 5.0):
            yield "matching", n, scale, sm.MatchingFactor(n, n)


def draw_scores(f, scale, rng):
    eu = scale * rng.standard_normal(f.shape_u)
    ev = scale * rng.standard_normal(f.shape_v) if f.n_v else None
    return eu, ev


def map_time(f, score_list, repeats=64):
    """Median C-level MAP time, cycling through the given (eta_u, eta_v) pairs."""
    flats = [f.check_scores(eu, ev) for eu, ev in score_list]
    etas_u = np.stack([fu for fu, _ in flats])
    etas_v = np.stack([fv if fv.size else np.zeros(1) for _, fv in flats])
    return _time_map(f, etas_u, etas_v, repeats)


def bench(f, scale, n_instances, repeats, seed):
    rng = np.random.default_rng(seed)
    rows, fresh, adjusted = [], [], []
    for _ in range(n_instances):
        eu, ev = draw_scores(f, scale, rng)
        r = sm.solve(f, eu, ev, method="vertex")
        assert r.converged, r
        t, = median_times([lambda: sm.solve(f, eu, ev, method="vertex")], repeats)
        rows.append((t, r.n_iter, r.n_map, len(r.structures), r.gap))
        fresh.append((eu, ev))
        adjusted.append((eu - r.u, ev))
    t_fresh = map_time(f, fresh)
    t_adj = map_time(f, adjusted)
    t, it, nmap, supp, gap = [statistics.median(col) for col in zip(*rows)]
    return t, it, nmap, supp, t / (nmap * t_adj), t_fresh, t_adj, gap


# -- logic factors alone: the active set against closed forms in NumPy --------------------

def np_sparsemax(z):
    """Projection onto the simplex, by sorting."""
    zs = np.sort(z)[::-1]
    cs = np.cumsum(zs) - 1
    k = np.flatnonzero(zs * np.arange(1, z.size + 1) > cs)[-1]
    return np.maximum(z - cs[k] / (k + 1), 0.0)


def np_box_sum(a, lo=-np.inf, hi=np.inf):
    """Projection onto {z in [0, 1]^n : lo <= sum z <= hi}: clip, or clip(a - tau, 0, 1)
    with tau found among the sorted breakpoints a - 1 and a (O(n log n))."""
    z = np.clip(a, 0.0, 1.0)
    total = z.sum()
    if lo <= total <= hi:
        return z
    target = hi if total > hi else lo
    n = a.size
    b = np.concatenate([a - 1.0, a])
    order = np.argsort(b, kind="stable")
    b = b[order]
    slope = np.cumsum(np.where(order < n, -1.0, 1.0))     # slope of the sum after b[k]
    g = n + np.concatenate([[0.0], np.cumsum(slope[:-1] * np.diff(b))])
    k = np.flatnonzero(g >= target)[-1]
    tau = b[k] if slope[k] == 0 else b[k] + (g[k] - target) / -slope[k]
    return np.clip(a - tau, 0.0, 1.0)


def np_at_most_one(a):
    """Clip; if more than one in total, the projection onto the simplex instead."""
    z = np.clip(a, 0.0, 1.0)
    return np_sparsemax(a) if z.sum() > 1 else z


def np_or(a):
    """Clip; if less than one in total, the projection onto the simplex instead."""
    z = np.clip(a, 0.0, 1.0)
    return np_sparsemax(a) if z.sum() < 1 else z


def np_xor_out(a):
    p = np_sparsemax(np.r_[a[:-1], 1.0 - a[-1]])
    return np.r_[p[:-1], 1.0 - p[-1]]


def np_or_out(a):
    """Pool the output with the inputs above it, clip; if the output then exceeds
    the sum of the inputs, project onto the XOR-out face."""
    x, out = a[:-1], a[-1]
    xs = np.sort(x)[::-1]
    t = (out + np.concatenate([[0.0], np.cumsum(xs)])) / np.arange(1, x.size + 2)
    j = np.flatnonzero(np.r_[xs <= t[:-1], True])[0]
    z = np.clip(np.r_[np.minimum(x, t[j]), t[j]], 0.0, 1.0)
    return np_xor_out(a) if z[-1] > z[:-1].sum() else z


def logic_cases(n):
    """(label, factor, score shift making the constraint bind, closed form)."""
    yield "xor", sm.XorFactor(n), 0.0, np_sparsemax
    yield "at most one", sm.AtMostOneFactor(n), 0.0, np_at_most_one
    yield "or", sm.OrFactor(n), -3.0, np_or
    b = max(1, n // 10)
    yield "budget n/10", sm.BudgetFactor(n, b), 0.0, lambda a: np_box_sum(a, hi=b)
    yield "budget n/2 exact", sm.BudgetFactor(n, n // 2, exact=True), 0.0, \
        lambda a: np_box_sum(a, lo=n // 2, hi=n // 2)
    yield "xor-out", sm.XorOutFactor(n), 0.0, np_xor_out
    yield "or-out", sm.OrOutFactor(n), 0.0, np_or_out
    yield "and-out", sm.AndOutFactor(n), 0.0, lambda a: 1.0 - np_or_out(1.0 - a)


def bench_logic(n_instances, repeats, seed):
    head = (f"{'factor':<18}{'n':>6}{'solve':>11}{'iters':>7}{'support':>8}{'closed f.':>11}"
            f"{'ratio':>9}{'max |du|':>10}")
    print(head)
    print("-" * len(head))
    for n in (10, 100, 1000):
        for label, f, shift, cf in logic_cases(n):
            rng = np.random.default_rng(seed)
            rows = []
            for _ in range(n_instances):
                eu = rng.standard_normal(n) + shift
                r = sm.solve(f, eu, method="vertex")
                t_solve, = median_times([lambda: sm.solve(f, eu, method="vertex")], repeats)
                t_cf, = median_times([lambda: cf(eu)], max(repeats, 11))
                rows.append((t_solve, r.n_iter, len(r.structures), t_cf,
                             float(np.abs(r.u - cf(eu)).max())))
            t, it, supp, tcf, _ = [statistics.median(col) for col in zip(*rows)]
            err = max(row[4] for row in rows)
            print(f"{label:<18}{n:>6}{_fmt(t):>11}{it:>7.0f}{supp:>8.0f}{_fmt(tcf):>11}"
                  f"{t / tcf:>9.1f}{err:>10.1e}", flush=True)
    print("\nmedians over instances; ratio = solve time / closed-form time; max |du| over "
          "instances")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--instances", type=int, default=5, help="random instances per family")
    p.add_argument("--repeats", type=int, default=3, help="timed solves per instance")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=("structured", "logic"),
                   help="print only one of the two tables")
    args = p.parse_args(argv)
    warnings.simplefilter("error", sm.ConvergenceWarning)
    if args.only == "logic":
        bench_logic(args.instances, args.repeats, args.seed)
        return
    head = (f"{'family':<10}{'size':>10}{'scale':>6}{'solve':>11}{'iters':>7}{'MAPs':>6}"
            f"{'support':>8}{'MAP fresh':>10}{'MAP adj.':>10}{'overhead':>9}{'gap':>10}")
    print(head)
    print("-" * len(head))
    for name, size, scale, f in families():
        t, it, nmap, supp, ratio, tfresh, tadj, gap = bench(f, scale, args.instances, args.repeats,
                                                    args.seed)
        print(f"{name:<10}{str(size):>10}{scale:>6g}{_fmt(t):>11}{it:>7.0f}{nmap:>6.0f}"
              f"{supp:>8.0f}{_fmt(tfresh):>10}{_fmt(tadj):>10}{ratio:>9.2f}{gap:>10.1e}",
              flush=True)
    print("\nmedians over instances (gap: duality gap at return)\n")
    if args.only is None:
        bench_logic(args.instances, args.repeats, args.seed)


def _fmt(seconds):
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


if __name__ == "__main__":
    main()
