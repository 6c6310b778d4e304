"""LP-MAP decoding (FactorGraph.solve_map): seconds, solves, certificate, against solve().

Graphs (standard-normal scores, fixed seed), built with variables and slices:

- ``grid8x12``: an 8 x 12 alignment, ``XorFactor`` on every row and
  ``AtMostOneFactor`` on every column;
- ``treeN``: a non-projective tree over N words (10, 20) with a
  ``BudgetFactor(., 2)`` on the modifiers of every word (LP-SparseMAP's Figure 1);
- ``pairs6x6``: a loopy 6 x 6 grid of ``PairFactor`` with random couplings
  (fractional LP optima are common);
- ``budget32``: 32 sentences of 20 to 40 words, one ``BudgetFactor(n, 5)`` each,
  a graph per sentence (no variable in two factors: one MAP per factor).

Columns, medians over ``--repeats`` runs: seconds of ``solve_map`` and of
``solve`` (LP-SparseMAP, for scale), their ratio, the number of LP-SparseMAP
solves ``solve_map`` ran (0: one MAP per factor), whether the answer is integral
and the duality gap.

Usage: python benchmarks/bench_lp_map.py [--repeats 7]
"""
import argparse
import statistics
import time

import numpy as np

import sparsemap as sm


def grid(rng):
    fg = sm.FactorGraph()
    x = fg.add_variables((8, 12))
    for i in range(8):
        fg.add(sm.XorFactor(12), x[i])
    for j in range(12):
        fg.add(sm.AtMostOneFactor(8), x[:, j])
    return [(fg, fg.scores({x: rng.standard_normal((8, 12))}), None)]


def tree(n):
    def make(rng):
        N = n + 1
        var = -np.ones((N, N), int)
        mask = ~np.eye(N, dtype=bool)
        mask[:, 0] = False
        var[mask] = np.arange(mask.sum())
        fg = sm.FactorGraph(int(mask.sum()))
        fg.add(sm.TreeFactor(n), var)
        for h in range(1, N):
            vs = var[h][var[h] >= 0]
            fg.add(sm.BudgetFactor(vs.size, 2), vs)
        return [(fg, rng.standard_normal(fg.n_variables), None)]
    return make


def pairs(rng, n=6):
    fg = sm.FactorGraph()
    x = fg.add_variables((n, n))
    ev = []
    for i in range(n):
        for j in range(n):
            for di, dj in ((0, 1), (1, 0)):
                if i + di < n and j + dj < n:
                    fg.add(sm.PairFactor(), sm.VariableArray.stack([x[i, j], x[i + di, j + dj]]))
                    ev.append(2 * rng.standard_normal(1))
    return [(fg, fg.scores({x: rng.standard_normal((n, n))}), ev)]


def budgets(rng):
    out = []
    for n in rng.integers(20, 41, 32):
        fg = sm.FactorGraph()
        z = fg.add_variables(int(n))
        fg.add(sm.BudgetFactor(int(n), 5), z)
        out.append((fg, fg.scores({z: rng.standard_normal(n)}), None))
    return out


CASES = {"grid8x12": grid, "tree10": tree(10), "tree20": tree(20), "pairs6x6": pairs,
         "budget32": budgets}


def median_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"{'graph':10s} {'solve_map s':>12s} {'solve s':>10s} {'ratio':>6s} {'solves':>6s} "
          f"{'integral':>8s} {'max gap':>9s}")
    for name, make in CASES.items():
        problems = make(np.random.default_rng(0))
        t_map = median_seconds(lambda: [fg.solve_map(e, ev) for fg, e, ev in problems],
                               args.repeats)
        t_qp = median_seconds(lambda: [fg.solve(e, ev) for fg, e, ev in problems], args.repeats)
        rs = [fg.solve_map(e, ev) for fg, e, ev in problems]
        print(f"{name:10s} {t_map:12.2e} {t_qp:10.2e} {t_map / t_qp:6.1f} "
              f"{max(r.n_solves for r in rs):6d} {str(all(r.integral for r in rs)):>8s} "
              f"{max(r.gap for r in rs):9.1e}")


if __name__ == "__main__":
    main()
