"""Non-projective trees on head-biased scores: the tree layer against the CRF.

Scores shaped like a parser's at initialisation: a per-head offset on top of small
arc noise, ``eta = head_sd * randn(n + 1, 1) + noise_sd * randn(n + 1, n + 1)``.
For each root setting, ``n``, ``head_sd`` and ``noise_sd`` (seeds 0, 1, ...), the
script times

* **default**: ``sm.solve(f, eta)`` + one ``vjp`` (the side the package chooses),
  with the side, ``converged`` and the number of warnings;
* **facet**: ``TreeFacetSolver(f, decline_peaked=False).solve(eta)`` (the facet
  side made to solve): its status (0 solved, 1 declined), projection passes
  (``n_iter``) and active cuts at the solution;
* **CRF**: the matrix-tree theorem in torch float64 (log-determinant of the
  Laplacian and its gradient), on the same scores in the same process;

and prints CPU times (``time.process_time``, torch on one thread): per seed the
median of ``--repeats`` runs, then the median and the worst over seeds of the
ratio default / CRF. A default solve that takes longer than ``--limit`` seconds is
run once. ``rounds`` (separation rounds), ``held`` (cuts held at the end) and
``cuts`` (active cuts: positive multiplier or the root equality) are the
worst over seeds; ``passes`` the median.

``--switch`` instead checks the choice of side on model-like scores (seed 0): a
per-head offset ``a * randn(n + 1, 1)``, that plus a per-modifier offset
``a * randn(1, n + 1)``, and low-rank biaffine scores ``a * U V^T / sqrt(3)``
(``U``, ``V``: ``randn(n + 1, 3)``), each plus ``b * randn(n + 1, n + 1)``: the
default ``sm.solve`` + ``vjp`` against ``method="facet"`` and, where the default
took the vertex side or took over 2 ms, ``method="vertex"`` (elsewhere the
vertex side takes seconds at these flat scores); ``default/best`` is the
default's time over the faster side's.

Usage::

    python benchmarks/bench_tree_headbias.py             # the full grid
    python benchmarks/bench_tree_headbias.py --sizes 60 --seeds 2
    python benchmarks/bench_tree_headbias.py --switch
"""
import argparse
import os
import time
import warnings

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import sparsemap as sm  # noqa: E402
from sparsemap._facet_tree import TreeFacetSolver  # noqa: E402
from bench_facet_tree import crf_timer  # noqa: E402  (the matrix-tree CRF both time)


def head_biased(n, head_sd, noise_sd, seed):
    rng = np.random.default_rng(seed)
    eta = head_sd * rng.standard_normal((n + 1, 1)) + noise_sd * rng.standard_normal((n + 1, n + 1))
    g = rng.standard_normal((n + 1, n + 1))
    return eta, g


def timed(fn, repeats, limit):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.process_time()
        out = fn()
        t = time.process_time() - t0
        times.append(t)
        if t > limit:
            break
    return float(np.median(times)), out


def model_like(kind, n, a, b, seed):
    rng = np.random.default_rng(seed)
    noise = b * rng.standard_normal((n + 1, n + 1))
    if kind == "head":
        return a * rng.standard_normal((n + 1, 1)) + noise
    if kind == "head+mod":
        return a * rng.standard_normal((n + 1, 1)) + a * rng.standard_normal((1, n + 1)) + noise
    U, V = rng.standard_normal((n + 1, 3)), rng.standard_normal((n + 1, 3))
    return a * (U @ V.T) / np.sqrt(3) + noise


def switch(args):
    header = (f"{'scores':>9} {'n':>4} {'a':>4} {'b':>5} {'root':>6} | {'default':>7} {'ms':>8} | "
              f"{'facet ms':>9} | {'vertex ms':>9} | {'default/best':>12}")
    print(header)
    print("-" * len(header))
    worst = 0.0
    for kind in ("head", "head+mod", "lowrank"):
        for n in (60, 150):
            for a in (0.1, 0.3, 1.0, 2.0, 4.0):
                for b in (0.03, 0.3):
                    for single_root in (False, True):
                        f = sm.TreeFactor(n, single_root=single_root)
                        eta = model_like(kind, n, a, b, 0)
                        g = np.ones_like(eta)

                        def run(method):
                            def go():
                                r = sm.solve(f, eta, method=method)
                                r.vjp(g)
                                return r
                            return go
                        td, r = timed(run("auto"), args.repeats, args.limit)
                        tf, _ = timed(run("facet"), args.repeats, args.limit)
                        tv = np.nan
                        if r.side == "vertex" or td > 2e-3:
                            tv, _ = timed(run("vertex"), 1, np.inf)
                        best = min(tf, tv) if tv == tv else tf
                        worst = max(worst, td / best)
                        print(f"{kind:>9} {n:>4} {a:>4g} {b:>5g} {'single' if single_root else 'multi':>6} | "
                              f"{r.side:>7} {1e3 * td:>8.2f} | {1e3 * tf:>9.2f} | {1e3 * tv:>9.2f} | "
                              f"{td / best:>12.2f}", flush=True)
    print(f"worst default/best {worst:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[60, 100, 150])
    ap.add_argument("--head-sd", type=float, nargs="+", default=[0.02, 0.08, 0.3])
    ap.add_argument("--noise-sd", type=float, nargs="+", default=[0.01, 0.03])
    ap.add_argument("--single-root", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--limit", type=float, default=1.0,
                    help="seconds: a default solve longer than this is not repeated")
    ap.add_argument("--switch", action="store_true",
                    help="check the choice of side on model-like scores instead")
    args = ap.parse_args()
    if args.switch:
        switch(args)
        return
    import torch
    torch.set_num_threads(1)
    crf = crf_timer(torch)
    header = (f"{'root':>6} {'n':>4} {'head':>5} {'noise':>5} | {'side':>11} {'conv':>4} "
              f"{'warn':>4} | {'f.stat':>6} {'passes':>6} {'rounds':>6} {'held':>4} {'cuts':>4} | {'ms':>8} {'CRF ms':>7} | "
              f"{'median':>7} {'worst':>7}")
    print(header)
    print("-" * len(header))
    for single_root in args.single_root:
        for n in args.sizes:
            f = sm.TreeFactor(n, single_root=bool(single_root))
            forced = TreeFacetSolver(f, decline_peaked=False)
            for hs in args.head_sd:
                for ns in args.noise_sd:
                    sides, conv, warn, stat, passes, cuts, rounds, held, td, tc, ratios = \
                        set(), True, 0, [], [], [], [], [], [], [], []
                    for seed in range(args.seeds):
                        eta, g = head_biased(n, hs, ns, seed)
                        sol = forced.solve(eta)
                        stat.append(sol.status)
                        passes.append(sol.n_iter)
                        st = sol.state_arrays()[0] if sol.status == 0 else [-1] * 6
                        cuts.append(int(st[2]))
                        rounds.append(int(st[4]))
                        held.append(int(st[5]))

                        def default():
                            with warnings.catch_warnings(record=True) as w:
                                warnings.simplefilter("always")
                                r = sm.solve(f, eta)
                                r.vjp(g)
                            return r, len(w)
                        t, (r, nw) = timed(default, args.repeats, args.limit)
                        sides.add(r.side)
                        conv &= bool(r.converged)
                        warn += nw
                        et = torch.tensor(eta, dtype=torch.float64)
                        c, _ = timed(lambda: crf(et, bool(single_root)), args.repeats, np.inf)
                        td.append(t)
                        tc.append(c)
                        ratios.append(t / c)
                    print(f"{'single' if single_root else 'multi':>6} {n:>4} {hs:>5g} {ns:>5g} | "
                          f"{'/'.join(sorted(sides)):>11} {'y' if conv else 'N':>4} {warn:>4} | "
                          f"{max(stat):>6} {int(np.median(passes)):>6} {max(rounds):>6} {max(held):>4} {max(cuts):>4} | "
                          f"{1e3 * np.median(td):>8.2f} {1e3 * np.median(tc):>7.3f} | "
                          f"{np.median(ratios):>7.1f} {max(ratios):>7.1f}", flush=True)


if __name__ == "__main__":
    main()
