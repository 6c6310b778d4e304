"""sparsemap.lpsmap (the drop-in) against lp-sparsemap itself, line by line.

Workloads, each written once against lp-sparsemap's API and run with either
``from lpsmap import ...`` or ``from sparsemap.lpsmap import ...``; the last seven are
the downstream shapes lp-sparsemap's users write (see ``_downstream_cases``):

* ``budget_loop``: rationale-robustness' per-sentence loop, 32 sentences of 20 to 40
  words, one TorchFactorGraph and one ``Budget(z, budget=torch.round(0.3 * n))`` each;
* ``constrained_tree``: lp-sparsemap's examples/constrained_tree.py at n=10 (a packed
  projective tree, at most 2 modifiers per head), its ``u.value[1, -1].backward()``;
* ``grid``: an 8x12 grid, Xor on each row and AtMostOne on each column;
* ``alignN (per doc)``: square alignments of N = 10, 20, 30 words (Xor rows, AtMostOne
  columns), ``solve(max_iter=10)`` as the alignment project calls it (lp-sparsemap stops
  there; the drop-in's answer is exact), time per document;
* ``padded batch of 4``: four such documents of 12 to 30 words in one graph, padded to 30
  with the float32 minimum;
* ``constrained_tree n=5``: lp-sparsemap's example at n = 5 without budgets (one tree),
  then with them;
* ``pair_seq``: lp-sparsemap's example (a chain of Pair factors).

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


def _downstream_data(seed=0):
    """The downstream shapes lp-sparsemap's users write: square alignments (8 documents each of 10, 20 and
    30 words), a padded batch of 4 documents (12, 25, 18 and 30 words, padded to 30 with
    the float32 minimum, as allennlp-style code does), lp-sparsemap's constrained_tree.py
    at n = 5 (its seed and scores) and its pair_seq.py."""
    rng = np.random.default_rng(seed)
    aligns = {n: [rng.normal(size=(n, n)).astype(np.float32) for _ in range(8)]
              for n in (10, 20, 30)}
    sizes, P = [12, 25, 18, 30], 30
    padded = np.full((len(sizes), P, P), np.finfo(np.float32).min, np.float32)
    for b, n in enumerate(sizes):
        padded[b, :n, :n] = rng.normal(size=(n, n))
    return aligns, padded


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
        return xor_grid(TorchFactorGraph, Xor, AtMostOne,
                        torch.tensor(grid, requires_grad=backward), backward)

    cases = {"budget_loop": budget_loop, "constrained_tree": constrained_tree,
             "grid": grid_case}
    cases.update(_downstream_cases(impl, TorchFactorGraph, Xor, AtMostOne, DepTree, Budget))
    if impl == "native":
        cases = _native_cases(sentences, tree, grid)
    out = {}
    for name, fn in cases.items():
        for backward in (False, True):
            fn(backward)          # warm-up (and caches)
            times, cpu = [], []
            per = getattr(fn, "per", 1)
            for _ in range(repeats):
                t, c = time.perf_counter(), time.process_time()
                val = fn(backward)
                cpu.append((time.process_time() - c) / per)
                times.append((time.perf_counter() - t) / per)
            out[f"{name}/{'fwd+bwd' if backward else 'fwd'}"] = {
                "median": statistics.median(cpu), "wall": statistics.median(times),
                "value": val.tolist()}
    return out


def xor_grid(TorchFactorGraph, Xor, AtMostOne, x, backward, **solve_kw):
    """Xor on each row of x, AtMostOne on each column (the grid, an alignment), solved with
    ``solve_kw``; with ``backward``, the gradient of a fixed linear function of u."""
    import torch
    m, n = x.shape
    fg = TorchFactorGraph()
    z = fg.variable_from(x)
    for i in range(m):
        fg.add(Xor(z[i, :]))
    for j in range(n):
        fg.add(AtMostOne(z[:, j]))
    fg.solve(**solve_kw)
    if backward:
        (z.value * torch.arange(m * n).reshape(m, n)).sum().backward()
    return z.value.detach().numpy().ravel()


def _downstream_cases(impl, TorchFactorGraph, Xor, AtMostOne, DepTree, Budget):
    """Issue 25's shapes, as the downstream projects call lp-sparsemap: alignments and the
    padded batch with ``solve(max_iter=10)`` (the alignment project's speed setting, which
    the drop-in ignores: its answers are exact), the examples at their defaults. Values
    are per document for the alignments (8 documents per call, time divided by 8)."""
    import torch
    if impl == "lpsmap":
        from lpsmap import Pair
    else:
        from sparsemap.lpsmap import Pair
    aligns, padded = _downstream_data()

    def alignment(x, backward):
        return xor_grid(TorchFactorGraph, Xor, AtMostOne, x, backward, max_iter=10)

    def aligned(n):
        def run(backward):
            xs = [torch.tensor(a, requires_grad=backward) for a in aligns[n]]
            return np.concatenate([alignment(x, backward) for x in xs])
        run.per = len(aligns[n])
        return run

    def padded_batch(backward):
        x = torch.tensor(padded, requires_grad=backward)
        B, P, _ = x.shape
        fg = TorchFactorGraph()
        z = fg.variable_from(x)
        for b in range(B):
            for i in range(P):
                fg.add(Xor(z[b, i, :]))
            for j in range(P):
                fg.add(AtMostOne(z[b, :, j]))
        fg.solve(max_iter=10)
        if backward:
            (z.value * torch.arange(z.value.numel()).reshape(z.value.shape)).sum().backward()
        return z.value.detach().numpy().ravel()

    def tree5(constrain):
        def run(backward):            # examples/constrained_tree.py, n = 5
            torch.manual_seed(4)
            x = torch.randn(5, 5, requires_grad=True)
            fg = TorchFactorGraph()
            u = fg.variable_from(x)
            fg.add(DepTree(u, packed=True, projective=True))
            if constrain:
                for k in range(5):
                    fg.add(Budget(u[list(range(k)) + list(range(k + 1, 5)), k], budget=2))
            fg.solve()
            if backward:
                u.value[1, -1].backward()
            return u.value.detach().numpy().ravel()
        return run

    def pair_seq(backward):           # examples/pair_seq.py
        torch.manual_seed(4)
        x = torch.randn(6, requires_grad=True)
        transition = torch.randn(5, requires_grad=True)
        fg = TorchFactorGraph()
        u = fg.variable_from(.1 * x)
        fg.add(Pair(u[:-1], u[1:], transition))
        fg.solve()
        if backward:
            u.value[1].backward()
        return u.value.detach().numpy().ravel()

    return {"align10 (per doc)": aligned(10), "align20 (per doc)": aligned(20),
            "align30 (per doc)": aligned(30), "padded batch of 4": padded_batch,
            "constrained_tree n=5": tree5(False), "  with budgets": tree5(True),
            "pair_seq": pair_seq}


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

    cases = {"budget_loop": budget_loop, "constrained_tree": constrained_tree,
             "grid": grid_case}
    cases.update(_native_downstream())
    return cases


def _native_downstream():
    """Issue 25's shapes in the native forms: one batched call per shape (the alignments'
    8 documents through one shared graph; the padded batch as a ragged list of graphs, one
    per document at its own size, no padding), the examples as native factors."""
    import torch
    import sparsemap as sm
    import sparsemap.torch as smt
    aligns, padded = _downstream_data()

    from bench_fg_robustness import grid

    def grid_graph(m, n):
        return grid(m, n)[0]

    def aligned(n):
        g = grid_graph(n, n)

        def run(backward):
            x = torch.tensor(np.stack(aligns[n]).reshape(len(aligns[n]), -1),
                             requires_grad=backward)
            u = smt.factor_graph(g, x)
            if backward:
                (u * torch.arange(n * n)).sum().backward()
            return u.detach().numpy().ravel()
        run.per = len(aligns[n])
        return run

    sizes = [12, 25, 18, 30]
    graphs = [grid_graph(n, n) for n in sizes]
    ragged = np.zeros((len(sizes), 30 * 30), np.float32)
    for b, n in enumerate(sizes):
        ragged[b, :n * n] = padded[b, :n, :n].ravel()

    def padded_batch(backward):
        x = torch.tensor(ragged, requires_grad=backward)
        u = smt.factor_graph(graphs, x)
        if backward:
            (u * torch.arange(u.shape[1])).sum().backward()
        return u.detach().numpy().ravel()

    head = np.full((6, 6), -1)
    ids = np.arange(25).reshape(5, 5)
    head[1:, 1:] = ids.T
    head[0, 1:] = np.diagonal(ids)
    head[np.arange(1, 6), np.arange(1, 6)] = -1
    tree = sm.TreeFactor(5, projective=True, single_root=True)
    tg = sm.FactorGraph(25)
    tg.add(tree, head)
    for k in range(5):
        tg.add(sm.BudgetFactor(4, 2), [ids[i, k] for i in range(5) if i != k])

    def tree5(constrain):
        def run(backward):
            torch.manual_seed(4)
            x = torch.randn(5, 5, requires_grad=True)
            if constrain:
                u = smt.factor_graph(tg, x.reshape(-1))
            else:
                eta = torch.zeros(6, 6)
                eta[1:, 1:] = x.T
                eta[0, 1:] = torch.diagonal(x)
                u = smt.sparsemap(tree, eta)
            if backward:
                u.sum().backward()
            return u.detach().numpy().ravel()
        return run

    chain = sm.FactorGraph(6)
    for i in range(5):
        chain.add(sm.PairFactor(), [i, i + 1])

    def pair_seq(backward):
        torch.manual_seed(4)
        x = torch.randn(6, requires_grad=True)
        transition = torch.randn(5, requires_grad=True)
        u = smt.factor_graph(chain, .1 * x, [transition[i:i + 1] for i in range(5)])
        if backward:
            u[1].backward()
        return u.detach().numpy().ravel()

    return {"align10 (per doc)": aligned(10), "align20 (per doc)": aligned(20),
            "align30 (per doc)": aligned(30), "padded batch of 4": padded_batch,
            "constrained_tree n=5": tree5(False), "  with budgets": tree5(True),
            "pair_seq": pair_seq}


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
