"""Throughput of the active set from several threads sharing one factor.

The active-set loop and the MAP oracles run without the GIL, so independent
problems solved from a thread pool should scale with the cores. Prints, for one
thread and for ``--threads`` threads, the wall-clock time to solve the same
batch of problems (median of ``--repeats`` runs) and the speedup.

Usage: python benchmarks/bench_threads.py [--threads 2] [--problems 64] [--repeats 5]
"""
import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import sparsemap as sm


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--problems", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"{'factor':<22}{'1 thread':>12}{f'{args.threads} threads':>12}{'speedup':>9}")
    for name, f in (("tree n=50", sm.TreeFactor(50)), ("sequence (50, 20)", sm.SequenceFactor(50, 20)),
                    ("matching 30x30", sm.MatchingFactor(30, 30))):
        batch = [(rng.standard_normal(f.shape_u),
                  rng.standard_normal(f.shape_v) if f.n_v else None) for _ in range(args.problems)]
        ref = [sm.solve(f, eu, ev).u for eu, ev in batch]

        def run(n_threads):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=n_threads) as ex:
                out = list(ex.map(lambda e: sm.solve(f, *e).u, batch))
            elapsed = time.perf_counter() - t0
            assert all(np.array_equal(a, b) for a, b in zip(out, ref))  # deterministic
            return elapsed

        t1 = statistics.median(run(1) for _ in range(args.repeats))
        tn = statistics.median(run(args.threads) for _ in range(args.repeats))
        print(f"{name:<22}{t1 * 1e3:>10.1f}ms{tn * 1e3:>10.1f}ms{t1 / tn:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
