"""The tree facet side's backward at ties: default solve + vjp, this checkout against another.

For non-projective trees of 20, 60 and 120 words (both root settings) at flat
scores (``eta = s * randn``, s = 0.01, 0.1), where the search for tight cuts with
zero multipliers does not run, and at zero scores, where it does (its two
Hao-Orlin runs), it times ``sm.solve`` + ``r.vjp(g)`` in this checkout and, with
``--against DIR``, in the checkout at DIR, side by side: each checkout runs in a
worker process of its own (the package is imported once per process), and the
two are asked in turn, case by case and round by round, so that drifts of a shared
machine hit both alike. A sample is the CPU time (``time.process_time``) of enough
calls to fill about 2 ms, divided by their number; the table gives the median
over ``--repeats`` samples and the ratio of the medians.

Usage::

    python benchmarks/bench_tree_ties.py --against /path/to/other/checkout
    python benchmarks/bench_tree_ties.py                 # this checkout alone
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = [(n, scores, single_root) for single_root in (False, True)
         for scores in ("0.01", "0.1", "zeros") for n in (20, 60, 120)]


def problem(n, scores, single_root):
    import sparsemap as sm
    rng = np.random.default_rng(n)
    eta = np.zeros((n + 1, n + 1)) if scores == "zeros" else \
        float(scores) * rng.standard_normal((n + 1, n + 1))
    return sm.TreeFactor(n, single_root=single_root), eta, rng.standard_normal((n + 1, n + 1))


def sample(f, eta, g):
    """CPU seconds per call of solve + vjp, over enough calls to fill about 2 ms; and
    the side that solved."""
    import sparsemap as sm

    def run():
        r = sm.solve(f, eta)
        r.vjp(g)
        return r.side
    calls, side = 1, run()
    while True:
        t0 = time.process_time()
        for _ in range(calls):
            run()
        t = time.process_time() - t0
        if t >= 2e-3:
            return t / calls, side
        calls *= 2


def worker():
    """Read case indices from stdin, answer 'seconds side' lines (one problem object
    per case, built on first use)."""
    warnings.simplefilter("ignore")
    built = {}
    for line in sys.stdin:
        i = int(line)
        if i not in built:
            built[i] = problem(*CASES[i])
        t, side = sample(*built[i])
        print(f"{t!r} {side}", flush=True)


def start(path):
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                            cwd=HERE, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, bufsize=1)


def ask(proc, i):
    proc.stdin.write(f"{i}\n")
    t, side = proc.stdout.readline().split()
    return float(t), side


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default=None, help="another checkout, timed side by side")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker()
        return
    procs = [start(os.path.dirname(HERE))]
    if args.against:
        procs.append(start(os.path.abspath(args.against)))
    head = (f"{'root':>6} {'scores':>6} {'n':>4} | {'this ms':>8} {'side':>6}"
            + (f" | {'other ms':>8} {'side':>6} | {'ratio':>6}" if args.against else ""))
    print(head + "\n" + "-" * len(head))
    for i, (n, scores, single_root) in enumerate(CASES):
        times = [[] for _ in procs]
        sides = [None for _ in procs]
        for _ in range(args.repeats):
            for j, p in enumerate(procs):
                t, sides[j] = ask(p, i)
                times[j].append(t)
        med = [np.median(t) for t in times]
        line = (f"{'single' if single_root else 'multi':>6} {scores:>6} {n:4d} | "
                f"{1e3 * med[0]:8.4f} {sides[0]:>6}")
        if args.against:
            line += f" | {1e3 * med[1]:8.4f} {sides[1]:>6} | {med[0] / med[1]:6.3f}"
        print(line, flush=True)
    for p in procs:
        p.stdin.close()
        p.wait()


if __name__ == "__main__":
    main()
