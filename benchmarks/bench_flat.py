"""Solve + backward at flat scores: the cost of exact derivatives (face completion).

For each (family, words, scale) the script times ``sm.solve(f, eta)`` followed by one
``r.vjp(g)`` on random scores ``scale * randn`` (fixed seeds), and prints medians over
repeats with the support and backward-set sizes. With ``--compare PATH`` it also runs
itself on the checkout at PATH (e.g. the main branch) in a subprocess and prints both
medians and their ratio (this checkout / PATH); the two runs alternate, problem by
problem, so that the machine's noise hits both alike.

Usage::

    python benchmarks/bench_flat.py                         # this checkout only
    python benchmarks/bench_flat.py --compare ../old-checkout   # ratios against another built checkout
    python benchmarks/bench_flat.py --quick                 # fewer sizes and repeats

Timings are CPU seconds of the calling thread (``time.thread_time``; a single solve runs
in it), medians over seeds, the minimum over ``--rounds`` rounds in which the two
checkouts alternate: on a shared, overloaded machine wall-clock times vary by 2-5x from
run to run, CPU time much less, and a round that other load slowed down is dropped by
the minimum. Ratios within ~5% are still noise.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

FAMILIES = {
    "tree": lambda n: __import__("sparsemap").TreeFactor(n),
    "tree-proj": lambda n: __import__("sparsemap").TreeFactor(n, projective=True),
    "sequence": lambda n: __import__("sparsemap").SequenceFactor(n, 8),
    "matching": lambda n: __import__("sparsemap").MatchingFactor(n, n),
}


def cases(quick):
    out = []
    for scale in (5.0, 1.0, 0.1):
        for n in ((20, 50) if quick else (10, 20, 50)):
            out.append(("tree", n, scale))
    for n in ((10, 20) if quick else (10, 20, 50, 100)):
        out.append(("tree", n, 0.01))
    out.append(("tree-proj", 20, 0.1))
    for fam, n in (("sequence", 30), ("matching", 12)):
        for scale in (1.0, 0.1):
            out.append((fam, n, scale))
    return out


def time_case(fam, n, scale, repeats, budget):
    """Median seconds of solve + vjp over seeds 0..repeats-1 (stops early past budget s:
    the slowest cases, a 100-word tree at scale 0.01, get one seed)."""
    import warnings

    import sparsemap as sm
    f = FAMILIES[fam](n)
    times, supp, back = [], [], []
    t_start = time.perf_counter()
    for seed in range(repeats):
        rng = np.random.default_rng(seed)
        eta = scale * rng.standard_normal(f.shape_u)
        g = rng.standard_normal(f.shape_u)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.thread_time()
            r = sm.solve(f, eta)
            r.vjp(g)
            times.append(time.thread_time() - t0)
        supp.append(r._sol.n_support)
        back.append(getattr(r._sol, "n_backward", r._sol.n_support))
        if time.perf_counter() - t_start > budget:
            break
    return {"median": float(np.median(times)), "support": float(np.median(supp)),
            "backward": float(np.median(back)), "n": len(times)}


def worker():
    """Read cases as JSON lines on stdin, answer each with a JSON line."""
    for line in sys.stdin:
        fam, n, scale, repeats, budget = json.loads(line)
        print(json.dumps(time_case(fam, n, scale, repeats, budget)), flush=True)


def spawn(path):
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], cwd=path,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def ask(proc, msg):
    proc.stdin.write(json.dumps(msg) + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", metavar="PATH", help="another checkout to time alongside")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--budget", type=float, default=20.0,
                    help="seconds per case and checkout before stopping early")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds per case (checkouts alternating): the minimum of the "
                         "rounds' medians is printed")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker()
    repeats = args.repeats or (5 if args.quick else 11)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mine = spawn(here)
    other = spawn(os.path.abspath(args.compare)) if args.compare else None
    head = f"{'family':<10}{'words':>6}{'scale':>7}{'runs':>5}{'ms':>10}{'support':>9}{'backward':>9}"
    if other:
        head += f"{'ms other':>10}{'support':>9}{'ratio':>7}"
    print(head)
    for fam, n, scale in cases(args.quick):
        msg = [fam, n, scale, repeats, args.budget]
        # Rounds alternate the checkouts; a round whose median the machine's other load
        # inflated is dropped by taking the minimum (one round past the budget: the
        # slowest cases, a 100-word tree at scale 0.01, get one).
        a = b = None
        for r in range(args.rounds):
            ra = ask(mine, msg)
            a = ra if a is None or ra["median"] < a["median"] else a
            if other:
                rb = ask(other, msg)
                b = rb if b is None or rb["median"] < b["median"] else b
            if ra["n"] < repeats:
                break
        line = (f"{fam:<10}{n:>6}{scale:>7g}{a['n']:>5}{1e3 * a['median']:>10.2f}{a['support']:>9.0f}"
                f"{a['backward']:>9.0f}")
        if other:
            line += (f"{1e3 * b['median']:>10.2f}{b['support']:>9.0f}"
                     f"{a['median'] / b['median']:>7.2f}")
        print(line, flush=True)
    for p in (mine, other):
        if p:
            p.stdin.close()
            p.wait()


if __name__ == "__main__":
    main()
