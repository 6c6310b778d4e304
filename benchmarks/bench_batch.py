"""Batch throughput of solve_batch (+ vjp_batch) on 1 and 2 threads, and its overhead.

For each family, a batch of ``--batch`` problems is solved ``--repeats`` times
with ``n_jobs=1`` and with ``n_jobs=--threads``, forward only (``solve_batch``)
and forward + backward (``solve_batch`` then ``vjp_batch``). The table gives
medians, in problems per second:

- ``1 thr``, ``N thr`` and their ratio ``speedup``;
- ``loop``: the throughput the solver loop alone would give, from the summed
  time each problem spent inside the GIL-free solve (``problems / sum``);
  ``overhead`` is the share of the 1-thread forward time spent elsewhere
  (validation, setup, results);
- ``vs serial``: ``solve_batch`` on 1 thread against a Python loop of
  ``sm.solve`` calls, the alternative a user would write.

The first row is the machine's own ceiling: the speedup of ``hashlib.sha256``
over large buffers (GIL-free C, no shared data) on the same threads. On a
machine shared with other jobs it can be far below the number of threads, and
no batch can scale better.

Families: ragged trees of 10 to 40 words (scores scaled by 1 and by 5, the
peaked scores of a trained model), sequences (30 positions, 8 tags, with
transition scores), 20 x 20 matchings, and sparsemax over 10 items (a tiny
problem, where fixed costs show).

Usage: python benchmarks/bench_batch.py [--threads 2] [--batch 32] [--repeats 15]
       [--families tree1,tree5,sequence,matching,sparsemax]
"""
import argparse
import hashlib
import statistics
import threading
import time

import numpy as np

import sparsemap as sm


def families(rng, B):
    """name -> (factors, etas_u, etas_v)."""
    out = {}
    lengths = rng.integers(10, 41, size=B)
    trees = [sm.TreeFactor(int(n)) for n in lengths]
    for scale in (1, 5):
        out[f"tree1040 x{scale}"] = (trees, [scale * rng.standard_normal(f.shape_u)
                                             for f in trees], None)
    seq = sm.SequenceFactor(30, 8)
    out["sequence 30x8"] = (seq, rng.standard_normal((B,) + seq.shape_u),
                            rng.standard_normal((B,) + seq.shape_v))
    mat = sm.MatchingFactor(20, 20)
    out["matching 20x20"] = (mat, rng.standard_normal((B, 20, 20)), None)
    out["sparsemax 10"] = (sm.GenericFactor(np.eye(10)), rng.standard_normal((B, 10)), None)
    return out


def reference_speedup(n_threads, repeats):
    """Speedup of GIL-free hashing on n_threads threads: what the machine allows."""
    data = [bytes([k]) * (8 << 20) for k in range(n_threads)]

    def run(k):
        threads = [threading.Thread(target=lambda b=b: hashlib.sha256(b).digest())
                   for b in data[:k]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    t1, tn = median_times([lambda: run(1), lambda: run(n_threads)], repeats)
    return n_threads * t1 / tn


def median_times(fns, repeats):
    """Median seconds of each function, sampled in turn (conditions on a shared
    machine drift; interleaving exposes every function to the same drift)."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--families", default=None,
                   help="comma-separated name prefixes (default: all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    fams = families(rng, args.batch)
    if args.families:
        keep = args.families.split(",")
        fams = {k: v for k, v in fams.items() if any(k.startswith(x) for x in keep)}
    T = args.threads
    head = (f"{'family':<18}{'mode':<9}{'1 thr':>10}{f'{T} thr':>10}{'speedup':>9}"
            f"{'loop':>10}{'overhead':>10}{'vs serial':>11}")
    print(f"problems/s, batch of {args.batch}, median of {args.repeats}")
    print(head)
    print("-" * len(head))
    print(f"{'(sha256 ceiling)':<27}{'':>20}{reference_speedup(T, args.repeats):>8.2f}x")
    for name, (factors, etas_u, etas_v) in fams.items():
        B = len(etas_u)
        fs = factors if isinstance(factors, list) else [factors] * B
        evs = [None] * B if etas_v is None else list(etas_v)
        dus = [rng.standard_normal(f.shape_u) for f in fs]
        rs = sm.solve_batch(factors, etas_u, etas_v, n_jobs=1)
        ref = [sm.solve(f, eu, ev) for f, eu, ev in zip(fs, etas_u, evs)]
        assert all(np.array_equal(r.u, s.u) for r, s in zip(rs, ref))   # bitwise, as promised

        def forward(n):
            return sm.solve_batch(factors, etas_u, etas_v, n_jobs=n)

        def both(n):
            sm.vjp_batch(forward(n), dus, n_jobs=n)

        loop = statistics.median(
            sum(r._sol.seconds for r in forward(1)) for _ in range(args.repeats))
        t_serial, = median_times([lambda: [sm.solve(f, eu, ev).u
                                           for f, eu, ev in zip(fs, etas_u, evs)]], args.repeats)
        for mode, fn in (("forward", forward), ("fwd+bwd", both)):
            t1, tn = median_times([lambda: fn(1), lambda: fn(T)], args.repeats)
            extra = ""
            if mode == "forward":
                extra = (f"{B / loop:>10.0f}{100 * (1 - loop / t1):>9.0f}%"
                         f"{t_serial / t1:>10.2f}x")
            print(f"{name:<18}{mode:<9}{B / t1:>10.0f}{B / tn:>10.0f}{t1 / tn:>8.2f}x{extra}",
                  flush=True)


if __name__ == "__main__":
    main()
