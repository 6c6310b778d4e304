"""Random-input soak of ``sparsemap.solve`` (not collected by pytest: run it by hand).

Draws factors of every family (including degenerate generic columns and a Python
oracle), scores from 1e-12 to 1e12 (some rounded to create ties), every method,
tolerances down to 0 and small ``max_iter``, and checks that each solve returns
finite posteriors, a distribution over the support, a finite gap and a finite
Jacobian product. The pytest suite checks optimality; this checks robustness.

Usage: python tests/fuzz_solve.py [SEED] [SECONDS]
"""
import sys
import time
import warnings

import numpy as np

import sparsemap as sm


def random_factor(rng):
    kind = rng.integers(6)
    if kind == 0:
        return sm.SequenceFactor(int(rng.integers(1, 8)), int(rng.integers(1, 5)))
    if kind == 1:
        return sm.TreeFactor(int(rng.integers(1, 12)), projective=bool(rng.integers(2)),
                             single_root=bool(rng.integers(2)))
    if kind == 2:
        return sm.MatchingFactor(int(rng.integers(1, 7)), int(rng.integers(1, 7)))
    if kind == 3:
        d = int(rng.integers(1, 10))
        M = rng.integers(-1, 2, (int(rng.integers(1, 5)), d)).astype(float)
        N = rng.integers(0, 2, (int(rng.integers(0, 3)), d)).astype(float) if rng.integers(2) else None
        return sm.GenericFactor(M, N)
    if kind == 4:
        return sm.GenericFactor(np.zeros((2, 3)), rng.standard_normal((1, 3)))
    d = int(rng.integers(1, 6))
    return sm.OracleFactor(lambda eu, ev: int(np.argmax(eu)), lambda s: np.eye(d)[s], shape_u=d)


def main(seed=0, seconds=60.0):
    warnings.simplefilter("ignore", sm.ConvergenceWarning)
    rng = np.random.default_rng(seed)
    t0, n = time.time(), 0
    while time.time() - t0 < seconds:
        f = random_factor(rng)
        scale = 10.0 ** rng.uniform(-12, 12)
        eu = scale * rng.standard_normal(f.shape_u)
        if rng.integers(3) == 0:
            eu = np.round(eu / scale) * scale
        ev = scale * rng.standard_normal(f.shape_v) if f.n_v else None
        method = ("auto", "vertex", "cg", "away_cg", "pairwise_cg", "bpcg")[rng.integers(6)]
        r = sm.solve(f, eu, ev, method=method, max_iter=int(rng.integers(1, 300)),
                     tol=(1e-12, 0.0, 1e-6)[rng.integers(3)],
                     return_history=bool(rng.integers(2)))
        assert np.all(np.isfinite(r.u)), r
        assert abs(r.weights.sum() - 1) < 1e-9 and np.all(r.weights > 0), r
        assert np.isfinite(r.gap), r
        assert np.all(np.isfinite(r.jvp(rng.standard_normal(f.shape_u)))), r
        n += 1
    print(f"{n} random solves, no failure")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0,
         float(sys.argv[2]) if len(sys.argv) > 2 else 60.0)
