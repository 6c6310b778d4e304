"""MAP oracle timings: trees, sequences, matchings and the logic factors.

Run from the repository root after building::

    python benchmarks/bench_map.py [--quick]

For every configuration the time per call is the median, over repeated runs, of
the mean of a batch of calls on the same random scores (``time.perf_counter``).
Columns:

* ``f.map``: the public Python call, which validates ``eta_u`` (shape, finite
  values, contiguous float64 copy) and allocates the output and scratch space;
* ``no valid.``: ``f._map_flat`` on already-validated flat arrays, i.e. the
  MAP algorithm plus the allocation of its output and scratch space;
* ``(min)``: the fastest batch of ``f.map``, a steadier figure on a busy
  machine (the load average is printed first).

Matchings are compared with ``scipy.optimize.linear_sum_assignment`` on the same
matrices in the same run; budgets with ``numpy.argpartition`` (the top ``budget``
scores, with no tie rule and no sign test).
"""
import argparse
import os
import statistics
import time

import numpy as np

import sparsemap as sm


def per_call(fn, repeats, min_batch_seconds=2e-3):
    """Median and minimum over ``repeats`` batches of the mean seconds per call of ``fn()``."""
    fn()  # warm up
    number = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - t0
        if elapsed >= min_batch_seconds or number >= 1 << 20:
            break
        number *= 2
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return statistics.median(times), min(times)


def us(seconds):
    return f"{seconds * 1e6:10.1f}"


def row(label, *seconds):
    return f"{label:<34}" + "".join(us(t) for t in seconds)


def bench_factor(f, eta_u, eta_v, repeats):
    eu, ev = f.check_scores(eta_u, eta_v)
    t_map, t_min = per_call(lambda: f.map(eta_u, eta_v), repeats)
    t_raw, _ = per_call(lambda: f._map_flat(eu, ev), repeats)
    return t_map, t_raw, t_min


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    repeats = 7 if args.quick else 31
    rng = np.random.default_rng(args.seed)

    print(f"MAP time per call in microseconds (median of {repeats} batches)")
    if hasattr(os, "getloadavg"):
        print("load average at start: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    print()
    header = f"{'factor':<34}{'f.map':>10}{'no valid.':>10}{'(min)':>10}"

    print(header)
    print("-" * len(header))
    tree_times = {}
    for kind, options, sizes in (("non-projective", {}, (20, 50, 100, 200)),
                                 ("projective", {"projective": True}, (20, 50, 100)),
                                 ("non-proj. single-root", {"single_root": True}, (20, 100))):
        for n in sizes:
            f = sm.TreeFactor(n, **options)
            eta = rng.normal(size=(n + 1, n + 1))
            t_map, t_raw, t_min = bench_factor(f, eta, None, repeats)
            tree_times[kind, n] = t_map, t_min
            print(row(f"tree {kind} n={n}", t_map, t_raw, t_min))
    med200, min200 = tree_times["non-projective", 200]
    med100, min100 = tree_times["non-projective", 100]
    # two lines, so that the docs can quote them within the page's width
    print(f"\ntree non-projective n=200 / n=100 f.map time ratio: {med200 / med100:.2f} "
          f"(medians), {min200 / min100:.2f} (minima);\nO(n^2) would give 4\n")

    print(header)
    print("-" * len(header))
    for n, m in ((20, 10), (50, 20), (100, 50)):
        f = sm.SequenceFactor(n, m)
        eta_u = rng.normal(size=(n, m))
        eta_v = rng.normal(size=(n - 1, m, m))
        t_map, t_raw, t_min = bench_factor(f, eta_u, eta_v, repeats)
        print(row(f"sequence n={n} m={m}", t_map, t_raw, t_min))
    print()

    from scipy.optimize import linear_sum_assignment

    header_m = header + f"{'scipy LSA':>10}{'ratio':>8}"
    print(header_m)
    print("-" * len(header_m))
    for n in (20, 50, 100, 200):
        f = sm.MatchingFactor(n, n)
        eta = rng.normal(size=(n, n))
        t_map, t_raw, t_min = bench_factor(f, eta, None, repeats)
        t_lsa, _ = per_call(lambda: linear_sum_assignment(eta, maximize=True), repeats)
        print(row(f"matching {n}x{n}", t_map, t_raw, t_min, t_lsa) + f"{t_map / t_lsa:8.2f}")
    print("\nratio: f.map time / scipy.optimize.linear_sum_assignment time (medians)\n")

    header_l = header + f"{'numpy':>10}{'ratio':>8}"
    print(header_l)
    print("-" * len(header_l))
    n = 1000
    eta = rng.normal(size=n)
    for label, f in (("xor", sm.XorFactor(n)), ("at most one", sm.AtMostOneFactor(n)),
                     ("or", sm.OrFactor(n)), ("or-out", sm.OrOutFactor(n)),
                     ("and-out", sm.AndOutFactor(n)), ("xor-out", sm.XorOutFactor(n))):
        print(row(f"{label} n={n}", *bench_factor(f, eta, None, repeats)))
    for budget, exact in ((10, False), (100, False), (500, False), (500, True)):
        f = sm.BudgetFactor(n, budget, exact=exact)
        t_map, t_raw, t_min = bench_factor(f, eta, None, repeats)
        t_np, _ = per_call(lambda: np.argpartition(-eta, budget), repeats)
        print(row(f"budget n={n} B={budget}{' exact' if exact else ''}", t_map, t_raw, t_min,
                  t_np) + f"{t_map / t_np:8.2f}")
    print(row("pair", *bench_factor(sm.PairFactor(), eta[:2], eta[2:3], repeats)))
    for n, budget in ((100, 10), (1000, 10), (1000, 100)):
        f = sm.SequenceBudgetFactor(n, budget)
        print(row(f"sequence budget n={n} B={budget}",
                  *bench_factor(f, rng.normal(size=n), rng.normal(size=(n - 1, 2, 2)), repeats)))
    print("\nratio: f.map time / numpy.argpartition time (medians); sequence budget is "
          "O(n B)")


if __name__ == "__main__":
    main()
