"""Forward+backward time of ``sparsemap.torch.factor_graph`` against the NumPy loop it wraps.

The problems are parsers with valency constraints: a batch of ``--batch``
sentences of 8 to 16 words, each a factor graph of a tree and a budget of 2
modifiers per word (ragged: ``eta_u`` padded to the longest sentence's arcs),
with standard normal arc scores times ``scale`` (1, and 5 for peaked scores as in
a trained model), float32 as a model would produce them.

A pass is a forward, a random linear downstream loss and its backward. The
alternative is what a user would write without the layer: ``FactorGraph.solve``
then ``FactorGraphResult.vjp`` for each sentence, in a Python loop. The table
gives milliseconds per batch (median over ``--repeats`` passes, the
configurations sampled in turn), the layer's overhead over the loop on one
thread, and its speedup on 2 threads, next to the machine's own ceiling for a
2-thread speedup (GIL-free hashing, as in ``bench_batch.py``), plus the ADMM
iterations and the backward CG iterations per sentence.

Usage: python benchmarks/bench_torch_factor_graph.py [--repeats 15] [--batch 32] [--seed 0]
"""
import argparse

import numpy as np
import torch

import sparsemap as sm
import sparsemap.torch as smt
from bench_batch import median_times, reference_speedup
from bench_factor_graph import valency_graph


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    graphs = [valency_graph(int(n)) for n in rng.integers(8, 17, args.batch)]
    V = max(g.n_variables for g in graphs)
    print(f"batch of {args.batch} valency-constrained trees of 8 to 16 words "
          f"({min(g.n_variables for g in graphs)} to {V} arcs), budget 2")
    print(f"machine's 2-thread ceiling (GIL-free hashing): {reference_speedup(2, args.repeats):.2f}x")
    print(f"{'scale':>5} {'numpy loop':>11} {'layer 1 thr':>12} {'overhead':>9} "
          f"{'layer 2 thr':>12} {'speedup':>8} {'admm it':>8} {'cg it':>6}")
    for scale in (1, 5):
        eta = torch.tensor(scale * rng.standard_normal((args.batch, V)), dtype=torch.float32)
        gu = torch.tensor(rng.standard_normal((args.batch, V)), dtype=torch.float32)
        e64 = eta.double().numpy()
        g64 = gu.double().numpy()
        stats = []

        def loop():
            stats.clear()
            for b, g in enumerate(graphs):
                r = g.solve(e64[b, :g.n_variables])
                r.vjp(g64[b, :g.n_variables])
                stats.append((r.n_iter, r.backward_info["cg_iterations"]))

        def layer(n_jobs):
            def run():
                x = eta.clone().requires_grad_()
                (smt.factor_graph(graphs, x, n_jobs=n_jobs) * gu).sum().backward()
            return run

        t_loop, t1, t2 = median_times([loop, layer(1), layer(2)], args.repeats)
        it, cg = np.mean(stats, axis=0)
        print(f"{scale:>5} {1e3 * t_loop:>11.2f} {1e3 * t1:>12.2f} {t1 / t_loop:>8.2f}x "
              f"{1e3 * t2:>12.2f} {t1 / t2:>7.2f}x {it:>8.1f} {cg:>6.1f}")


if __name__ == "__main__":
    main()
