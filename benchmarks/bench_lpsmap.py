"""sparsemap.lpsmap (the drop-in) against lp-sparsemap itself, line by line.

Three workloads, each written once against lp-sparsemap's API and run with either
``from lpsmap import ...`` or ``from sparsemap.lpsmap import ...``:

* ``budget_loop``: rationale-robustness' per-sentence loop, 32 sentences of 20 to 40
  words, one TorchFactorGraph and one ``Budget(z, budget=torch.round(0.3 * n))`` each;
* ``constrained_tree``: lp-sparsemap's examples/constrained_tree.py at n=10 (a packed
  projective tree, at most 2 modifiers per head), its ``u.value[1, -1].backward()``;
* ``grid``: an 8x12 grid, Xor on each row and AtMostOne on each column.

Each is timed forward (build the graph, ``fg.solve()`` at lp-sparsemap's defaults) and
forward + backward, as the median of ``--repeats`` runs after a warm-up, in the process's
CPU time (all its threads; robust to other processes on a shared machine) and
in wall-clock time; ``--rounds`` interleaves the implementations. A native column
shows the batched sparsemap form of the same work (one call for the whole batch / graph
shape). lp-sparsemap runs in a separate interpreter (``--lpsmap-python``, a venv where
``import lpsmap`` works, e.g. one made by building lp-sparsemap from source); without it
only sparsemap's rows are printed. The answers of both are compared: lp-sparsemap stops
at its ADMM tolerance, sparsemap's are exact.

    python benchmarks/bench_lpsmap.py --lpsmap-python /path/to/venv/bin/python
    python benchmarks/bench_lpsmap.py --lpsmap-python /path/to/venv/bin/python --accuracy
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _data(seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 41, size=32)
    sentences = [rng.normal(size=(1, int(n))).astype(np.float32) for n in lengths]
    tree = rng.normal(size=(10, 10)).astype(np.float32)
    grid = rng.normal(size=(8, 12)).astype(np.float32)
    return sentences, tree, grid


def worker(impl, repeats):
    import torch
    torch.set_num_threads(1)
    if impl == "lpsmap":
        from lpsmap import AtMostOne, Budget, DepTree, TorchFactorGraph, Xor
    else:
        from sparsemap.lpsmap import AtMostOne, Budget, DepTree, TorchFactorGraph, Xor
    sentences, tree, grid = _data()

    def budget_loop(backward):
        out = []
        for s in sentences:
            x = torch.tensor(s, requires_grad=backward)
            fg = TorchFactorGraph()
            z = fg.variable_from(x)
            fg.add(Budget(z, budget=torch.round(0.3 * torch.tensor(float(s.shape[1])))))
            fg.solve()
            if backward:
                z.value.sum().backward()
            out.append(z.value.detach().numpy().ravel())
        return np.concatenate(out)

    def constrained_tree(backward):
        n = tree.shape[0]
        x = torch.tensor(tree, requires_grad=backward)
        fg = TorchFactorGraph()
        u = fg.variable_from(x)
        fg.add(DepTree(u, packed=True, projective=True))
        for k in range(n):
            ix = list(range(k)) + list(range(k + 1, n))
            fg.add(Budget(u[ix, k], budget=2))
        fg.solve()
        if backward:
            u.value[1, -1].backward()
        return u.value.detach().numpy().ravel()

    def grid_case(backward):
        m, n = grid.shape
        x = torch.tensor(grid, requires_grad=backward)
        fg = TorchFactorGraph()
        z = fg.variable_from(x)
        for i in range(m):
            fg.add(Xor(z[i, :]))
        for j in range(n):
            fg.add(AtMostOne(z[:, j]))
        fg.solve()
        if backward:
            (z.value * torch.arange(m * n).reshape(m, n)).sum().backward()
        return z.value.detach().numpy().ravel()

    cases = {"budget_loop": budget_loop, "constrained_tree": constrained_tree,
             "grid": grid_case}
    if impl == "native":
        cases = _native_cases(sentences, tree, grid)
    out = {}
    for name, fn in cases.items():
        for backward in (False, True):
            fn(backward)          # warm-up (and caches)
            times, cpu = [], []
            for _ in range(repeats):
                t, c = time.perf_counter(), time.process_time()
                val = fn(backward)
                cpu.append(time.process_time() - c)
                times.append(time.perf_counter() - t)
            out[f"{name}/{'fwd+bwd' if backward else 'fwd'}"] = {
                "median": statistics.median(cpu), "wall": statistics.median(times),
                "value": val.tolist()}
    return out


def accuracy(impl, seeds=20):
    """Per seed, u and the gradient of w . u for the constrained tree (n=6, 10) and the
    grid, in float64 at lp-sparsemap's defaults: the data of the accuracy table."""
    import torch
    if impl == "lpsmap":
        from lpsmap import AtMostOne, Budget, DepTree, TorchFactorGraph, Xor
    else:
        from sparsemap.lpsmap import AtMostOne, Budget, DepTree, TorchFactorGraph, Xor

    def tree(x, n):
        fg = TorchFactorGraph()
        u = fg.variable_from(x)
        fg.add(DepTree(u, packed=True, projective=True))
        for k in range(n):
            fg.add(Budget(u[list(range(k)) + list(range(k + 1, n)), k], budget=2))
        fg.solve()
        return u.value

    def grid(x, _):
        fg = TorchFactorGraph()
        z = fg.variable_from(x)
        for i in range(x.shape[0]):
            fg.add(Xor(z[i, :]))
        for j in range(x.shape[1]):
            fg.add(AtMostOne(z[:, j]))
        fg.solve()
        return z.value

    out = {}
    for name, fn, shape in (("tree n=6", tree, (6, 6)), ("tree n=10", tree, (10, 10)),
                            ("grid 8x12", grid, (8, 12))):
        us, gs = [], []
        for seed in range(seeds):
            x = torch.tensor(np.random.default_rng(seed).normal(size=shape), requires_grad=True)
            w = torch.tensor(np.random.default_rng(100 + seed).normal(size=shape))
            u = fn(x, shape[0])
            (u * w).sum().backward()
            us.append(u.detach().numpy().ravel().tolist())
            gs.append(x.grad.numpy().ravel().tolist())
        out[name] = {"u": us, "g": gs}
    return out


def _native_cases(sentences, tree, grid):
    """The same work in sparsemap's native, batched forms."""
    import torch
    import sparsemap as sm
    import sparsemap.torch as smt
    lengths = [s.shape[1] for s in sentences]
    T = max(lengths)
    factors = [sm.BudgetFactor(n, int(round(0.3 * n))) for n in lengths]
    padded = np.zeros((len(sentences), T), np.float32)
    for b, s in enumerate(sentences):
        padded[b, :s.shape[1]] = s[0]

    def budget_loop(backward):
        x = torch.tensor(padded, requires_grad=backward)
        u = smt.sparsemap(factors, x)
        if backward:
            u.sum().backward()
        return np.concatenate([u[b, :n].detach().numpy() for b, n in enumerate(lengths)])

    n = tree.shape[0]
    g = sm.FactorGraph(n * n)
    ids = np.arange(n * n).reshape(n, n)        # packed u[m, h] -> arc index h -> m
    head = np.full((n + 1, n + 1), -1)
    head[1:, 1:] = ids.T
    head[0, 1:] = np.diagonal(ids)
    head[np.arange(1, n + 1), np.arange(1, n + 1)] = -1
    g.add(sm.TreeFactor(n, projective=True, single_root=True), head)
    for k in range(n):
        g.add(sm.BudgetFactor(n - 1, 2), [ids[i, k] for i in range(n) if i != k])

    def constrained_tree(backward):
        x = torch.tensor(tree.reshape(-1), requires_grad=backward)
        u = smt.factor_graph(g, x)
        if backward:
            u[1 * n + n - 1].backward()
        return u.detach().numpy()

    m, k = grid.shape
    gg = sm.FactorGraph(m * k)
    gids = np.arange(m * k).reshape(m, k)
    for i in range(m):
        gg.add(sm.XorFactor(k), gids[i])
    for j in range(k):
        gg.add(sm.AtMostOneFactor(m), gids[:, j])

    def grid_case(backward):
        x = torch.tensor(grid.reshape(-1), requires_grad=backward)
        u = smt.factor_graph(gg, x)
        if backward:
            (u * torch.arange(m * k)).sum().backward()
        return u.detach().numpy()

    return {"budget_loop": budget_loop, "constrained_tree": constrained_tree,
            "grid": grid_case}


def _run(python, impl, repeats, accuracy=False):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = ["--accuracy-worker", impl] if accuracy else ["--worker", impl, "--repeats",
                                                         str(repeats)]
    res = subprocess.run([python, __file__, *args], capture_output=True, text=True, env=env,
                         cwd="/")
    if res.returncode:
        raise RuntimeError(f"{impl} worker failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lpsmap-python", default=os.environ.get("LPSMAP_PYTHON"),
                   help="python of an environment with lp-sparsemap installed")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds per implementation (medians over all)")
    p.add_argument("--accuracy", action="store_true",
                   help="instead of timing, compare the answers and gradients (20 seeds)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--accuracy-worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.repeats)))
        return
    if a.accuracy:
        if a.accuracy_worker or not a.lpsmap_python:
            raise SystemExit("--accuracy needs --lpsmap-python")
        got = {i: _run(a.lpsmap_python if i == "lpsmap" else sys.executable, i, 0, True)
               for i in ("sparsemap", "lpsmap")}
        print("lp-sparsemap against the drop-in (exact), float64, its defaults, 20 seeds: "
              "max (median) over seeds of max |u - u*| and of max |w.J - w.J*|")
        for k in got["sparsemap"]:
            cells = []
            for q in ("u", "g"):
                d = np.abs(np.array(got["lpsmap"][k][q]) - np.array(got["sparsemap"][k][q]))
                d = d.max(axis=1)
                cells.append(f"{d.max():.2e} ({np.median(d):.2e})")
            print(f"{k:12s} u: {cells[0]:22s} gradient: {cells[1]}")
        return
    if a.accuracy_worker:
        print(json.dumps(accuracy(a.accuracy_worker)))
        return
    impls = ["sparsemap", "native"] + (["lpsmap"] if a.lpsmap_python else [])
    runs = {i: [] for i in impls}
    for _ in range(a.rounds):            # interleaved, against drift on a shared machine
        for i in impls:
            runs[i].append(_run(a.lpsmap_python if i == "lpsmap" else sys.executable, i,
                                a.repeats))
    med = {i: {k: statistics.median(r[k]["median"] for r in runs[i]) for k in runs[i][0]}
           for i in impls}
    spread = {i: {k: (min(r[k]["median"] for r in runs[i]), max(r[k]["median"] for r in runs[i]))
                  for k in runs[i][0]} for i in impls}
    print(f"CPU time of the process (time.process_time, robust to other processes on a "
          f"shared machine), ms: medians over {a.rounds} rounds x {a.repeats} repeats (range "
          f"of the per-round medians in brackets); ratio = lp-sparsemap / drop-in; wall-clock "
          f"medians at the end")
    head = f"{'case':26s} {'drop-in':>22s} {'native batched':>22s}"
    if "lpsmap" in impls:
        head += f" {'lp-sparsemap':>22s} {'ratio':>6s} {'max |du|':>9s}"
    print(head)
    for k in med["sparsemap"]:
        def cell(i):
            lo, hi = spread[i][k]
            return f"{1e3 * med[i][k]:7.2f} [{1e3 * lo:5.2f}-{1e3 * hi:5.2f}]"
        line = f"{k:26s} {cell('sparsemap'):>22s} {cell('native'):>22s}"
        if "lpsmap" in impls:
            du = np.abs(np.array(runs["lpsmap"][0][k]["value"])
                        - np.array(runs["sparsemap"][0][k]["value"])).max()
            line += (f" {cell('lpsmap'):>22s} {med['lpsmap'][k] / med['sparsemap'][k]:6.2f}"
                     f" {du:9.2e}")
        wall = [statistics.median(r[k]["wall"] for r in runs[i]) for i in impls]
        print(line + "   wall " + " / ".join(f"{1e3 * w:.2f}" for w in wall))


if __name__ == "__main__":
    main()
