"""Solve + backward at flat scores: the cost of exact derivatives (face completion).

For each (family, words, scale) the script times ``sm.solve(f, eta)`` followed by one
``r.vjp(g)`` on random scores ``scale * randn`` (fixed seeds; ``eta_v`` None, except for
``sequence-v``, whose transition scores are random too: ``sequence`` at ``eta_v = 0`` pays
for untying its tied transitions on the ``vjp``), and prints medians over
repeats with the support and backward-set sizes. With ``--compare PATH`` it also runs
itself on the checkout at PATH (e.g. the main branch) in a subprocess and prints both
medians and their ratio (this checkout / PATH); the two runs alternate, problem by
problem, so that the machine's noise hits both alike.

Usage::

    python benchmarks/bench_flat.py                         # this checkout only
    python benchmarks/bench_flat.py --compare ../old-checkout   # ratios against another built checkout
    python benchmarks/bench_flat.py --quick                 # fewer sizes and repeats
    python benchmarks/bench_flat.py --only sequence-v       # one family

Timings are CPU seconds of the calling thread (``time.thread_time``; a single solve runs
in it): for each seed the fastest of as many runs as fit in ~20 ms (at most 30; one for
problems slower than that), then the median over seeds. ``--rounds`` rounds (15; 5 for
a case whose round takes over 2 s) each start fresh processes, the checkouts
alternating; the table prints the medians over rounds, and the median of the rounds'
ratios. On a shared, overloaded machine wall-clock times vary by 2-5x from run to run,
CPU time much less; a single run of a 20-40 us problem still swings by 20% or more,
which the per-seed minimum removes, and one process can be 10-40% slower than another
on every problem (its placement and memory layout), which many fresh processes and the
median over rounds remove. Ratios within ~5% are still noise.
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
    # with transition scores of the unary scores' scale (no ties in eta_v to break)
    "sequence-v": lambda n: __import__("sparsemap").SequenceFactor(n, 8),
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
    for fam, n in (("sequence", 30), ("sequence-v", 30), ("matching", 12)):
        for scale in (5.0, 1.0, 0.1):
            out.append((fam, n, scale))
    return out


SLOW_ROUNDS = 5        # rounds for a case whose round takes over 2 s
INNER_SECONDS = 0.02   # per seed: repeat a fast problem for about this long
INNER_MAX = 30


def time_case(fam, n, scale, repeats, budget):
    """Median over seeds 0..repeats-1 of the fastest solve + vjp of each seed (stops
    early past budget s: the slowest cases, a 100-word tree at scale 0.01, get one
    seed)."""
    import warnings

    import sparsemap as sm
    f = FAMILIES[fam](n)
    times, supp, back = [], [], []
    t_start = time.perf_counter()
    for seed in range(repeats):
        rng = np.random.default_rng(seed)
        eta = scale * rng.standard_normal(f.shape_u)
        eta_v = scale * rng.standard_normal(f.shape_v) if fam.endswith("-v") else None
        g = rng.standard_normal(f.shape_u)
        best, runs, spent = np.inf, 0, 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            while runs < INNER_MAX and (runs == 0 or spent < INNER_SECONDS):
                t0 = time.thread_time()
                r = sm.solve(f, eta, eta_v, method="vertex")
                r.vjp(g)
                t = time.thread_time() - t0
                best, runs, spent = min(best, t), runs + 1, spent + t
        times.append(best)
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
    ap.add_argument("--rounds", type=int, default=15,
                    help="rounds, each in fresh processes (checkouts alternating): the "
                         "medians over rounds are printed; a case whose round takes "
                         "over 2 s runs in the first 5 only")
    ap.add_argument("--only", metavar="FAMILY", choices=sorted(FAMILIES),
                    help="time this family's cases alone")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker()
    repeats = args.repeats or (5 if args.quick else 11)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [here] + ([os.path.abspath(args.compare)] if args.compare else [])
    todo = [c for c in cases(args.quick) if args.only in (None, c[0])]
    results = {c: [] for c in todo}     # per case: one list of answers (one per path) a round
    slow = {}     # per case: its first round took over 2 s
    for r in range(args.rounds):
        # Fresh processes each round: a process's placement and memory layout can make
        # every problem in it 10-40% slower or faster, which alternating within one pair
        # cannot undo.
        procs = [spawn(p) for p in paths]
        for case in todo:
            if r > 0 and results[case][0][0]["n"] < repeats:
                continue     # past the budget in round 1 (one seed): not repeated
            if r >= SLOW_ROUNDS and slow[case]:
                continue
            order = range(len(paths)) if r % 2 == 0 else reversed(range(len(paths)))
            got = {}
            t0 = time.perf_counter()
            for i in order:
                got[i] = ask(procs[i], list(case) + [repeats, args.budget])
            if r == 0:
                slow[case] = time.perf_counter() - t0 > 2.0
            results[case].append([got[i] for i in range(len(paths))])
        for p in procs:
            p.stdin.close()
            p.wait()
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    head = f"{'family':<11}{'words':>6}{'scale':>7}{'runs':>5}{'ms':>10}{'support':>9}{'backward':>9}"
    if len(paths) > 1:
        head += f"{'ms other':>10}{'support':>9}{'ratio':>7}"
    print(head)
    for case in todo:
        fam, n, scale = case
        rounds = results[case]
        a = rounds[0][0]
        ms = 1e3 * np.median([rr[0]["median"] for rr in rounds])
        line = (f"{fam:<11}{n:>6}{scale:>7g}{a['n']:>5}{ms:>10.2f}{a['support']:>9.0f}"
                f"{a['backward']:>9.0f}")
        if len(paths) > 1:
            b = rounds[0][1]
            ms_b = 1e3 * np.median([rr[1]["median"] for rr in rounds])
            ratio = np.median([rr[0]["median"] / rr[1]["median"] for rr in rounds])
            line += f"{ms_b:>10.2f}{b['support']:>9.0f}{ratio:>7.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
