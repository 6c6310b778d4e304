"""The tree's facet solver warm started from an earlier solution, against a cold solve.

Each row solves a non-projective ``TreeFactor`` at scores ``eta`` (fixed seed), then
at ``eta`` moved by ``--move`` times its scale (standard normal), cold and warm
started from the first solution (``FacetSolver.solve(..., warm=)``, the path of a
factor graph's ADMM steps): projection passes and CPU milliseconds (medians over
``--repeats``) of each, and the largest difference of the two points.

- ``iid``: ``scale`` times standard normal;
- ``head``: head-biased, ``scale`` times a per-head normal offset plus 0.01 noise.

    PYTHONPATH=. python benchmarks/bench_facet_warm.py [--repeats 20]
"""
import argparse

import numpy as np

import sparsemap as sm
from sparsemap._facet_tree import TreeFacetSolver
from _timing import cpu_median

CASES = [(60, "iid", 0.01), (60, "iid", 0.1), (60, "iid", 1.0), (60, "iid", 3.0),
         (60, "head", 0.3), (100, "head", 0.3)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--move", type=float, default=0.02)
    args = ap.parse_args()
    head = (f"{'words':>5} {'kind':>4} {'scale':>5} {'cold it':>7} {'cold ms':>8} "
            f"{'warm it':>7} {'warm ms':>8} {'warm/cold':>9} {'max diff':>9}")
    print(head)
    print("-" * len(head))
    for n, kind, scale in CASES:
        rng = np.random.default_rng(0)
        s = TreeFacetSolver(sm.TreeFactor(n), decline_peaked=False)
        if kind == "iid":
            eta = scale * rng.standard_normal((n + 1, n + 1))
        else:
            eta = (scale * rng.standard_normal((n + 1, 1))
                   + 0.01 * rng.standard_normal((n + 1, n + 1)))
        prev = s.solve(eta)
        eta2 = eta + args.move * scale * rng.standard_normal(eta.shape)
        t_c, c = cpu_median(lambda: s.solve(eta2), args.repeats)
        t_w, w = cpu_median(lambda: s.solve(eta2, warm=prev), args.repeats)
        print(f"{n:>5} {kind:>4} {scale:>5g} {c.n_iter:>7d} {1e3 * t_c:>8.3f} "
              f"{w.n_iter:>7d} {1e3 * t_w:>8.3f} {t_w / t_c:>9.2f} "
              f"{np.abs(w.u - c.u).max():>9.1e}", flush=True)


if __name__ == "__main__":
    main()
