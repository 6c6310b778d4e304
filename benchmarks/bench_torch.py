"""Forward+backward throughput of the PyTorch layers, against the layer a user would pick instead.

* Trees: ``sparsemap.torch.tree`` on batches of 32 sentences of 10 to 40 words
  (ragged, padded to 40), against CRF arc marginals by the matrix-tree theorem:
  the gradient of a batched ``torch.logdet`` of the Laplacian (Koo et al., 2007),
  with the downstream gradient taken through the marginals (double backward).
* Matchings: ``sparsemap.torch.matching`` on batches of 32 20x20 problems,
  against a row softmax.

Scores are standard normal times ``scale`` (1, and 5 for peaked scores as in a
trained model), float32 as a model would produce them. Each configuration runs
on 1 and 2 threads (``torch.set_num_threads`` and ``n_jobs``), and SparseMAP
also with 2 solver threads and torch on 1 (row ``2s``). The ``2s`` speedup is
measured in a phase of its own, against 1 solver thread with torch on 1: torch's
OpenMP workers, once a 2-thread torch pass has woken them, spin-wait for a while
and hold the second core, so that a ``2s`` pass sampled right after one gains
nothing (its throughput is given on the scale of the ``1`` row). A pass is a
forward, a random linear downstream loss and its backward; the table gives
problems per second (median over ``--repeats`` passes, the configurations
sampled in turn so that drifting machine conditions hit all alike), the ratio
SparseMAP / alternative, and the speedup from 1 to 2 threads. The machine's own
ceiling for that speedup is measured first, as in ``bench_batch.py``.

A second table splits a serial SparseMAP tree pass (``n_jobs=1``, torch on one
thread) by CPU time, which other processes' load disturbs far less than wall-clock
time: the time the batch runner's threads spend on problems without the GIL (the
solves and the backward products, as the runner itself counts it with
``_batch.no_gil_seconds``), and the rest, with the GIL held. The rest is split
again into the downstream loss (the same pass with a stand-in layer that costs
nothing: cloning the scores, the loss, autograd) and what the layer itself adds.
The share that threads can run in parallel bounds the 2-thread speedup (Amdahl).

A third table compares the training losses of ``sparsemap.torch`` (forward, and
backward of their mean) with the tree layer's forward and backward on the same
batch, gold trees drawn at random: the SparseMAP and margin SparseMAP losses
(one SparseMAP solve each, at the cost-augmented scores for the margin) and the
structured SVM and perceptron (one MAP each). It gives CPU milliseconds on one
thread (medians of ``--repeats`` passes) and wall milliseconds with the default
``n_jobs`` (torch on one thread; the configurations sampled in turn), and the
ratios loss / layer; targets: at most 1.2 for the SparseMAP losses, at most 1.0
for the MAP losses.

Usage: python benchmarks/bench_torch.py [--repeats 15] [--batch 32] [--seed 0]
       [--breakdown-only | --losses-only]
"""
import argparse
import statistics
import time

import numpy as np
import torch

import sparsemap as sm
import sparsemap.torch as smt
from bench_batch import median_times, reference_speedup
from sparsemap import _batch

THREADS = (1, 2)
SCALES = (1, 5)


def crf_tree_marginals(scores, lengths):
    """Arc marginals of the non-projective tree CRF (multiple root children), by the
    matrix-tree theorem: d logdet(L) / d scores, differentiable (create_graph)."""
    B, n1, _ = scores.shape
    idx = torch.arange(n1)
    valid_m = (idx[None, :] >= 1) & (idx[None, :] <= lengths[:, None])          # (B, n1)
    valid_h = idx[None, :] <= lengths[:, None]
    arc = valid_h[:, :, None] & valid_m[:, None, :] & (idx[:, None] != idx[None, :])
    s = scores.masked_fill(~arc, float("-inf"))
    # Each word has one head: shifting a modifier's column leaves the marginals unchanged.
    top = s.max(dim=1, keepdim=True).values
    s = s - torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    w = torch.exp(s)                                   # 0 on masked arcs
    A = w[:, 1:, 1:]
    lap = torch.diag_embed(w[:, 0, 1:] + A.sum(dim=1)) - A
    pad = ~valid_m[:, 1:]                              # identity rows/cols for padded words
    lap = lap + torch.diag_embed(pad.to(lap.dtype))
    logz = torch.logdet(lap).sum()
    (marg,) = torch.autograd.grad(logz, scores, create_graph=True)
    return marg


def tree_batch(rng, batch, scale):
    lengths = rng.integers(10, 41, size=batch)
    n1 = int(lengths.max()) + 1
    scores = torch.from_numpy(scale * rng.standard_normal((batch, n1, n1))).float()
    return scores, torch.from_numpy(lengths)


def pass_fn(layer, scores, g, threads, torch_threads=None):
    """One forward+backward pass of ``layer(x, n_jobs=threads)`` with torch on
    ``torch_threads`` threads (default: ``threads``)."""
    def run():
        torch.set_num_threads(threads if torch_threads is None else torch_threads)
        x = scores.detach().clone().requires_grad_()
        (layer(x, threads) * g).sum().backward()
    return run


def cpu_ms(fn, repeats):
    """Median CPU milliseconds of fn() in this process (insensitive to other processes' load)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return 1e3 * statistics.median(times)


class _StandIn(torch.autograd.Function):
    """A layer that costs nothing: the downstream loss's share of a pass."""

    @staticmethod
    def forward(ctx, x):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, gu):
        return torch.empty_like(gu)


def tree_breakdown(scores, lengths, g, repeats):
    """CPU ms of one serial tree pass (n_jobs=1, torch on 1 thread) and of its parts.

    Each repeat runs a pass, reading the CPU time the batch runner's threads spent on
    problems without the GIL, then the same pass with the stand-in layer (right after,
    so that it meets the caches the solves leave), then a pass with 2 solver threads
    (the CPU time of both); medians over the repeats.
    """
    def ours(n_jobs):
        x = scores.clone().requires_grad_()
        (smt.tree(x, lengths, n_jobs=n_jobs) * g).sum().backward()

    def stand_in():
        x = scores.clone().requires_grad_()
        (_StandIn.apply(x) * g).sum().backward()

    rows = {k: [] for k in ("whole", "no_gil", "downstream", "whole2", "no_gil2")}
    ours(1)
    ours(2)
    stand_in()
    _batch.no_gil_seconds(True)
    try:
        for _ in range(repeats):
            for n_jobs, suffix in ((1, ""), (2, "2")):
                n0, t0 = _batch.no_gil_seconds(), time.process_time()
                ours(n_jobs)
                rows["whole" + suffix].append(time.process_time() - t0)
                rows["no_gil" + suffix].append(_batch.no_gil_seconds() - n0)
                if n_jobs == 1:
                    t0 = time.process_time()
                    stand_in()
                    rows["downstream"].append(time.process_time() - t0)
    finally:
        _batch.no_gil_seconds(False)
    rows["serial"] = [w - n for w, n in zip(rows["whole"], rows["no_gil"])]
    rows["serial2"] = [w - n for w, n in zip(rows["whole2"], rows["no_gil2"])]
    t = {k: 1e3 * statistics.median(v) for k, v in rows.items()}
    t["layer"] = t["serial"] - t["downstream"]
    t["crf"] = cpu_ms(pass_fn(lambda x, _: crf_tree_marginals(x, lengths), scores, g, 1), repeats)
    factors = [sm.TreeFactor(int(n)) for n in lengths]
    eus = [scores[b, :n + 1, :n + 1].double().numpy() for b, n in enumerate(lengths.tolist())]
    rs = sm.solve_batch(factors, eus, n_jobs=1)
    t["iters"] = np.mean([r.n_iter for r in rs])
    t["support"] = np.mean([len(r.weights) for r in rs])
    return t


NOTES = """
'no GIL': CPU ms the batch runner's threads spend on problems without the GIL: the
  solves and the backward products, with the copies of each sentence's block out of
  the padded scores and into the padded outputs; threads share it out.
'serial': the rest of the pass, with the GIL held; 'downstream': its part that any
  layer pays (the same pass with a stand-in layer of no cost: cloning the scores, the
  loss, autograd); 'layer': what the SparseMAP layer itself adds (validation, setup,
  results).
'parallel': the share of the pass threads can run in parallel (no GIL / pass);
  '2-thr bound': Amdahl's limit on the 1 to 2 thread speedup it implies.
'serial 2s': the serial CPU ms of the same pass with 2 solver threads (what waking
  and joining the helper thread adds); 'bound 2s': the speedup the 2-thread pass's
  own split allows, pass / (serial 2s + no GIL 2s / 2).
'CRF pass': CPU ms of the CRF layer's pass on one thread; 'ratio': the SparseMAP / CRF
  throughput these CPU times give, free of other processes' load."""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    only = p.add_mutually_exclusive_group()
    only.add_argument("--breakdown-only", action="store_true",
                      help="only the CPU-time breakdown (the second table)")
    only.add_argument("--losses-only", action="store_true",
                      help="only the losses against the layer (the third table)")
    args = p.parse_args(argv)
    if not (args.breakdown_only or args.losses_only):
        throughput(args)
    if not args.losses_only:
        breakdown(args)
    if not args.breakdown_only:
        losses(args)


def tree_case(args, scale):
    """``(rng, scores, lengths, g)``: a tree batch at ``scale`` and a downstream gradient,
    from ``args.seed`` (the same batch in every table)."""
    rng = np.random.default_rng(args.seed)
    scores, lengths = tree_batch(rng, args.batch, scale)
    g = torch.from_numpy(rng.standard_normal(tuple(scores.shape))).float()
    return rng, scores, lengths, g


def random_heads(rng, lengths, n1):
    """A random single-root dependency tree per sentence (each word's head drawn among
    the words before it, or the root for the first), in random word order, padded with
    -1."""
    heads = torch.full((len(lengths), n1), -1, dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        order = rng.permutation(n) + 1
        h = np.empty(n + 1, dtype=np.int64)
        h[0], h[order[0]] = -1, 0
        for k in range(1, n):
            h[order[k]] = order[rng.integers(0, k)]
        heads[b, :n + 1] = torch.from_numpy(h)
    return heads


LOSSES = (("SparseMAP", smt.sparsemap_loss, {}, 1.2),
          ("margin SparseMAP", smt.sparsemap_loss, {"margin": 1.0}, 1.2),
          ("structured SVM", smt.structured_svm_loss, {}, 1.0),
          ("perceptron", smt.perceptron_loss, {}, 1.0))


def losses(args):
    """The third table: each loss's pass against the tree layer's, CPU and wall ms."""
    print(f"\nlosses against the tree layer (forward + backward, batches of {args.batch} "
          f"trees of 10 to 40 words, float32 scores, torch on 1 thread; median of "
          f"{args.repeats}): CPU ms with n_jobs=1, wall ms with the default n_jobs")
    print(f"{'scale':>6}  {'pass':<17}{'CPU ms':>8}{'ratio':>7}{'wall ms':>9}{'ratio':>7}"
          f"{'target':>8}")
    torch.set_num_threads(1)
    for scale in SCALES:
        rng, scores, lengths, g = tree_case(args, scale)
        heads = random_heads(rng, lengths, scores.shape[1])
        factors = [sm.TreeFactor(int(n)) for n in lengths]

        def layer(n_jobs):
            def run():
                x = scores.clone().requires_grad_()
                (smt.tree(x, lengths, n_jobs=n_jobs) * g).sum().backward()
            return run

        def loss(fn, kw, n_jobs):
            def run():
                x = scores.clone().requires_grad_()
                fn(factors, x, heads, n_jobs=n_jobs, **kw).backward()
            return run

        rows = [("tree layer", layer, None)] + [
            (name, lambda n_jobs, fn=fn, kw=kw: loss(fn, kw, n_jobs), target)
            for name, fn, kw, target in LOSSES]
        serial = [make(1) for _, make, _ in rows]
        default = [make(None) for _, make, _ in rows]
        for fn in serial + default:
            fn()
        cpu = [cpu_ms(fn, args.repeats) / 1e3 for fn in serial]
        wall = median_times(default, args.repeats)
        for (name, _, target), c, w in zip(rows, cpu, wall):
            ratio = "" if target is None else f"{c / cpu[0]:>7.2f}"
            wratio = "" if target is None else f"{w / wall[0]:>7.2f}"
            print(f"{scale:>6}  {name:<17}{1e3 * c:>8.2f}{ratio:>7}{1e3 * w:>9.2f}{wratio:>7}"
                  f"{'' if target is None else f'<= {target}':>8}", flush=True)


def throughput(args):
    """The first table: wall-clock problems per second, 1 and 2 threads, against the
    alternative; the machine's sha256 ceiling first."""
    B = args.batch
    print(f"sparsemap.torch forward+backward, batches of {B}, float32 scores, "
          f"median of {args.repeats} passes (configurations sampled in turn); problems/s\n")
    print(f"machine ceiling (sha256 on 1 vs 2 threads, the same conditions): "
          f"{reference_speedup(2, args.repeats):.2f}x\n")
    head = (f"{'layer':<10}{'scale':>6}{'thr':>5}{'SparseMAP':>12}{'alternative':>13}"
            f"{'ratio':>8}   alternative")
    print(head)
    print("-" * len(head))
    rows = {}
    for kind in ("tree", "matching"):
        for scale in SCALES:
            rng = np.random.default_rng(args.seed)
            if kind == "tree":
                scores, lengths = tree_batch(rng, B, scale)
                ours = lambda x, t: smt.tree(x, lengths, n_jobs=t)            # noqa: E731
                alt = lambda x, t: crf_tree_marginals(x, lengths)           # noqa: E731
                alt_name = "CRF marginals (matrix-tree, logdet)"
            else:
                scores = torch.from_numpy(scale * rng.standard_normal((B, 20, 20))).float()
                ours = lambda x, t: smt.matching(x, n_jobs=t)                 # noqa: E731
                alt = lambda x, t: torch.softmax(x, dim=-1)                   # noqa: E731
                alt_name = "row softmax"
            g = torch.from_numpy(rng.standard_normal(tuple(scores.shape))).float()
            if kind == "tree":
                m = crf_tree_marginals(scores.clone().requires_grad_(), lengths).detach()
                sums = m.sum(dim=1)[:, 1:]
                real = torch.arange(1, scores.shape[1])[None, :] <= lengths[:, None]
                assert torch.allclose(sums[real], torch.ones(()), atol=1e-4), "CRF check"
            fns = [pass_fn(layer, scores, g, t) for t in THREADS for layer in (ours, alt)]
            for fn in fns:                 # warm up pools and caches
                fn()
            times = median_times(fns, args.repeats)
            # Solver threads alone, in a phase of their own: torch's OpenMP workers,
            # once woken by a 2-thread pass, spin for a while and take the core.
            solo = [pass_fn(ours, scores, g, t, torch_threads=1) for t in (1, 2)]
            for fn in solo:
                fn()
            t1s, t2s = median_times(solo, args.repeats)
            times.append(t2s * times[0] / t1s)   # on the 1-thread row's scale
            for i, t in enumerate(THREADS):
                a, b = B / times[2 * i], B / times[2 * i + 1]
                rows[kind, scale, t] = (a, b)
                print(f"{kind:<10}{scale:>6}{t:>5}{a:>12.0f}{b:>13.0f}{a / b:>8.2f}   {alt_name}",
                      flush=True)
            rows[kind, scale, "2s"] = B / times[-1]
            print(f"{kind:<10}{scale:>6}{'2s':>5}{B / times[-1]:>12.0f}{'':>13}{'':>8}   "
                  f"(2s: 2 solver threads, torch on 1; see below)", flush=True)
    print("\nspeedup from 1 to 2 threads (target >= 1.8x for SparseMAP)")
    print(f"{'layer':<10}{'scale':>6}{'SparseMAP':>12}{'(2s)':>8}{'alternative':>13}")
    for kind in ("tree", "matching"):
        for scale in SCALES:
            (a1, b1), (a2, b2) = rows[kind, scale, 1], rows[kind, scale, 2]
            a2s = rows[kind, scale, "2s"]
            print(f"{kind:<10}{scale:>6}{a2 / a1:>11.2f}x{a2s / a1:>7.2f}x{b2 / b1:>12.2f}x")
    a, b = rows["tree", 5, 1]
    print(f"\ntree layer at scale 5, 1 thread: SparseMAP / CRF throughput = {a / b:.2f} "
          f"(target >= 0.5)\n")


def breakdown(args):
    """The second table: where a serial tree pass goes, in CPU time."""
    print(f"where a serial SparseMAP tree pass goes (batches of {args.batch}, median of "
          f"{args.repeats}): CPU ms (process time, so other processes' load counts little)")
    print(f"{'scale':>6}{'pass':>8}{'no GIL':>8}{'serial':>8}{'downstream':>12}{'layer':>7}"
          f"{'parallel':>10}{'2-thr bound':>13}{'serial 2s':>11}{'bound 2s':>10}{'iters':>7}"
          f"{'support':>9}{'CRF pass':>10}{'ratio':>7}")
    torch.set_num_threads(1)
    for scale in SCALES:
        _, scores, lengths, g = tree_case(args, scale)
        t = tree_breakdown(scores, lengths, g, args.repeats)
        p = min(1.0, t["no_gil"] / t["whole"])
        bound2 = t["whole"] / (t["serial2"] + t["no_gil2"] / 2)
        print(f"{scale:>6g}{t['whole']:>8.2f}{t['no_gil']:>8.2f}{t['serial']:>8.2f}"
              f"{t['downstream']:>12.2f}{t['layer']:>7.2f}{p:>10.2f}"
              f"{1 / ((1 - p) + p / 2):>12.2f}x{t['serial2']:>11.2f}{bound2:>9.2f}x"
              f"{t['iters']:>7.1f}{t['support']:>9.1f}{t['crf']:>10.2f}"
              f"{t['crf'] / t['whole']:>7.2f}", flush=True)
    print(NOTES)


if __name__ == "__main__":
    main()
