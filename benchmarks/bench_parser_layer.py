"""The tree layer on a real parser's scores, against the matrix-tree CRF.

A new user's parser: word and UPOS embeddings, a two-layer bi-LSTM and an MLP (or
biaffine) arc scorer, every layer at PyTorch's default initialisation and the scores
unscaled (``_models.ArcParser``; not the example's scorer, which standardises its
hidden layer over the arcs). Such scores are head-biased: each head's scores share
an offset, larger than the arc-to-arc noise. One model per treebank, trained with
Adam (at its default learning rate) on batches of training sentences (by default
with the CRF loss, so that the scores timed do not depend on the solver under test
and two runs on two versions of ``sparsemap`` time the same scores;
``--train-loss sparsemap`` trains with the SparseMAP loss instead). Each update's
batch holds real sentences and, unless ``--no-train-joined``, one sentence joined
to each timed length.

At each phase (at init, after 1 update, after 32) the arc scores of the timed
sentences are computed and, for each set of sentences (real dev sentences, and dev
sentences joined end to end to 100, 120 and 150 words), two things are timed on the
same scores, CPU time, torch on one thread and ``n_jobs=1``:

* the layer: ``smt.tree(scores, lengths, single_root=...)`` forward, then the
  backward of a random linear function of its output;
* the CRF: the log-partition by ``torch.logdet`` of the Laplacian (float64), then
  its backward (the arc marginals), what a CRF-trained parser pays per step. The
  CRF marginals used as a layer (a second backward through them) are timed too:
  column ``vs CRF layer``.

Both per sentence (a batch of one; medians over repeats, then the median and worst
over the set's sentences of the per-sentence ratio layer / CRF) and per batch (the
set as one padded batch). Each layer call runs in a worker process killed after
``--limit`` seconds: a call over the limit is shown as ``>limit`` and its ratio as
a lower bound (``>``), and the set's batch, which holds that sentence, is not run.

Printed per phase and set: the score statistics (``head sd``: the standard deviation
over heads of a head's mean score, the per-head offset; ``noise sd``: that of the
residual arc scores once head and modifier means are out; ``spread``: the standard
deviation of all arc scores, ``examples/parsing.py``'s ``score_spread``), the side
that ran (facet / vertex sentences), fallbacks (``SolveInfo.fallback`` not "none",
counted by reason), sentences not converged, the solver's iterations, and
warnings. The bar (median at most 2x and worst at most 10x the CRF, at every phase
and length up to 150 words) is marked ``ok`` / ``MISS`` per row.

Usage::

    python benchmarks/bench_parser_layer.py [--data DIR] [--roots multi|single|both]
        [--lengths 100 120 150] [--real 8] [--joined 2] [--repeats 3] [--limit 5]
        [--phases 0 1 32] [--train-loss crf|sparsemap] [--scorer mlp|biaffine]
        [--seed 0] [--quick]
"""
import argparse
import math
import sys
import warnings

import numpy as np
import torch

import _models as M
from _limited import LimitedWorker

import sparsemap as sm
import sparsemap.torch as smt

BAR_MEDIAN, BAR_WORST = 2.0, 10.0


# -- the timed jobs (module level: they run in the worker) --------------------------
_warm = []


def _warm_up():
    """One small untimed layer call in each fresh worker: a process's first call pays
    one-time costs (lazy imports, allocator) that are no part of a solve."""
    if not _warm:
        _warm.append(True)
        x = torch.randn(1, 6, 6, requires_grad=True)
        smt.tree(x, n_jobs=1).sum().backward()
        crf_times(x.detach(), torch.tensor([5]), False, 1)

def layer_job(scores, lengths, single_root, repeats, budget):
    """Median CPU seconds of the layer's forward + backward, and what the solver did
    (its SolveInfo fields as lists, and the warnings' messages)."""
    _warm_up()
    g = torch.randn(scores.shape, generator=torch.Generator().manual_seed(1))
    info, caught = None, []

    def run():
        nonlocal info
        x = scores.detach().clone().requires_grad_()
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            u, info = smt.tree(x, lengths, single_root=single_root, n_jobs=1,
                               return_info=True)
            (u * g).sum().backward()
        caught[:] = [f"{w.category.__name__}: {str(w.message)[:120]}" for w in ws]

    times = []
    for _ in range(repeats):       # fewer repeats once a call is slow: its median is the call
        t, _ = M.cpu_seconds(run, 1)
        times.append(t)
        if sum(times) > budget:
            break
    return (float(np.median(times)),
            dict(facet=info.facet.tolist(), fallback=info.fallback.tolist(),
                 status=info.status.tolist(), n_iter=info.n_iter.tolist(),
                 warnings=list(caught)))


def crf_times(scores, lengths, single_root, repeats):
    """Median CPU seconds of the CRF: log-partition + backward (marginals), and the
    marginals as a layer (forward, and the backward of a random linear function)."""
    g = torch.randn(scores.shape, generator=torch.Generator().manual_seed(1)).double()
    s = scores.detach().double()

    def loss_pass():
        x = s.clone().requires_grad_()
        M.tree_log_partition(x, lengths, single_root).sum().backward()

    def layer_pass():
        x = s.clone().requires_grad_()
        (M.tree_marginals(x, lengths, single_root, create_graph=True) * g).sum().backward()

    _warm_up()

    return M.cpu_seconds(loss_pass, repeats)[0], M.cpu_seconds(layer_pass, repeats)[0]


# -- training ------------------------------------------------------------------------
def training_batch(train, vocab, lengths, args, rng):
    sents = [train[i] for i in rng.choice(len(train), args.train_batch, replace=False)]
    if not args.no_train_joined:
        for L in lengths:
            sents += M.join_sentences(train, L, 1, rng)
    return M.encode_batch(vocab, sents)


def update(model, opt, batch, args, single_root):
    words, tags, heads, lengths = batch
    scores = model(words, tags, lengths)
    if args.train_loss == "crf":
        loss = M.parsing.crf_loss(scores, heads, lengths) if single_root else \
            (M.tree_log_partition(scores.double(), lengths)
             - M.parsing.tree_score(scores.double(), heads, lengths)).mean()
    else:
        factors = [sm.TreeFactor(n, single_root=single_root) for n in lengths.tolist()]
        loss = smt.sparsemap_loss(factors, scores, heads, n_jobs=1)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


# -- measuring -----------------------------------------------------------------------
def fmt_ratio(r, lower):
    return ("" if not lower else ">") + (f"{r:.2f}" if r < 100 else f"{r:.0f}")


def measure_set(worker, scores, lengths, single_root, args):
    """One row: per-sentence and per-batch ratios, sides, fallbacks, warnings."""
    ratios, lowers, lratios = [], [], []
    facet = vertex = unconverged = timeouts = 0
    iters, warns, fallbacks = [], [], []
    for b, n in enumerate(lengths.tolist()):
        x = scores[b:b + 1, :n + 1, :n + 1].contiguous()
        ln = lengths[b:b + 1]
        crf, crf_layer = crf_times(x, ln, single_root, args.repeats)
        out = worker.run(layer_job, x, ln, single_root, args.repeats, 1.0)
        if out is None:                     # over the limit: a lower bound on the ratio
            timeouts += 1
            ratios.append(args.limit / crf)
            lratios.append(args.limit / crf_layer)
            lowers.append(True)
            continue
        t, info = out
        ratios.append(t / crf)
        lratios.append(t / crf_layer)
        lowers.append(False)
        facet += sum(info["facet"])
        vertex += len(info["facet"]) - sum(info["facet"])
        fallbacks += info["fallback"]
        unconverged += sum(1 for s in info["status"] if s)
        iters += info["n_iter"]
        warns += info["warnings"]
    med, worst = M.ratio_summary(ratios)
    worst_lower = bool(lowers[int(np.argmax(ratios))])
    # A median is a lower bound once half the sentences are
    med_lower = sum(lowers) * 2 >= len(lowers) and any(lowers)
    lmed, _ = M.ratio_summary(lratios)
    if timeouts:
        batch = "skipped"
    else:
        crf_b, _ = crf_times(scores, lengths, single_root, args.repeats)
        out = worker.run(layer_job, scores, lengths, single_root, args.repeats, 2.0)
        batch = f">{args.limit / crf_b:.0f}" if out is None else \
            f"{out[0] / crf_b:.2f} ({1e3 * out[0]:.1f}/{1e3 * crf_b:.1f} ms)"
    ok = (med <= BAR_MEDIAN and worst <= BAR_WORST) and not timeouts
    return dict(median=fmt_ratio(med, med_lower), worst=fmt_ratio(worst, worst_lower),
                layer=fmt_ratio(lmed, med_lower), batch=batch,
                side=f"{facet}f/{vertex}v" + (f"/{timeouts}t" if timeouts else ""),
                fallbacks=M.fallback_text(fallbacks), unconverged=unconverged,
                iters=(f"{int(np.median(iters))}/{max(iters)}" if iters else "-"),
                warnings=len(warns), bar="ok" if ok else "MISS", messages=warns)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(M.DEFAULT_DATA))
    p.add_argument("--roots", choices=("multi", "single", "both"), default="multi")
    p.add_argument("--lengths", type=int, nargs="*", default=[100, 120, 150])
    p.add_argument("--real", type=int, default=8, help="real dev sentences timed per treebank")
    p.add_argument("--joined", type=int, default=2, help="joined sentences per length")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--limit", type=float, default=5.0, help="seconds before a layer call is cut")
    p.add_argument("--phases", type=int, nargs="*", default=[0, 1, 32])
    p.add_argument("--train-loss", choices=("crf", "sparsemap"), default="crf")
    p.add_argument("--train-batch", type=int, default=12)
    p.add_argument("--no-train-joined", action="store_true")
    p.add_argument("--scorer", choices=("mlp", "biaffine"), default="mlp")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's (a new user keeps its default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 3 real sentences, one joined to 30 words, phases 0 and 1")
    args = p.parse_args(argv)
    if args.quick:
        args.real, args.joined, args.lengths, args.phases = 3, 1, [30], [0, 1]
        args.repeats, args.train_batch = 1, 4
    M.set_one_thread()
    roots = {"multi": [False], "single": [True], "both": [False, True]}[args.roots]
    print(f"sparsemap {sm.__version__} from {sm.__file__}")
    print(f"torch {torch.__version__}, 1 thread; layer n_jobs=1; CPU time; medians of "
          f"{args.repeats}; limit {args.limit:g} s per layer call; training: "
          f"{args.train_loss} loss, Adam lr {args.lr:g}, scorer {args.scorer}, seed {args.seed}")
    print(f"bar: median <= {BAR_MEDIAN:g}x and worst <= {BAR_WORST:g}x the CRF "
          f"(log-partition by logdet + backward), per sentence")
    worker = LimitedWorker(args.limit)
    try:
        for name, files in M.treebanks(args.data).items():
            train, dev = M.read_conllu(files["train"]), M.read_conllu(files["dev"])
            vocab = M.Vocab(train)
            rng = np.random.default_rng(args.seed)
            sets = [("real", [dev[i] for i in rng.choice(len(dev), args.real, replace=False)])]
            sets += [(f"{L} words", M.join_sentences(dev, L, args.joined, rng))
                     for L in args.lengths]
            batches = {k: M.encode_batch(vocab, s) for k, s in sets}
            for single_root in roots:
                torch.manual_seed(args.seed)
                model = M.ArcParser(len(vocab.words) + 3, len(vocab.tags) + 3,
                                    scorer=args.scorer)
                opt = torch.optim.Adam(model.parameters(), lr=args.lr)
                train_rng = np.random.default_rng(args.seed + 1)
                done = 0
                print(f"\n== {name}, single_root={single_root} ==")
                rows, messages = [], []
                for phase in args.phases:
                    while done < phase:
                        update(model, opt, training_batch(train, vocab, args.lengths, args,
                                                          train_rng), args, single_root)
                        done += 1
                    for key, (words, tags, _, lengths) in batches.items():
                        with torch.no_grad():
                            scores = model(words, tags, lengths)
                        stats = M.score_stats(scores, lengths).mean(0)
                        r = measure_set(worker, scores, lengths, single_root, args)
                        messages += [f"{phase} updates, {key}: {m}" for m in r.pop("messages")]
                        rows.append([phase, key, int(lengths.max()), f"{stats[0]:.4f}",
                                     f"{stats[1]:.5f}", f"{stats[2]:.4f}", r["median"],
                                     r["worst"], r["layer"], r["batch"], r["side"],
                                     r["fallbacks"], r["unconverged"], r["iters"],
                                     r["warnings"], r["bar"]])
                        print(f"  [{phase} updates, {key}: done]", file=sys.stderr, flush=True)
                M.print_table(["updates", "sentences", "max n", "head sd", "noise sd", "spread",
                               "median", "worst", "vs CRF layer", "batch ratio (layer/CRF)",
                               "side f/v/t", "fallbacks", "unconv.", "iters med/max",
                               "warnings", "bar"], rows)
                for m in sorted(set(messages)):
                    print(f"  warning: {m}")
    finally:
        worker.close()
    print("\nmedian, worst: per sentence, layer (smt.tree forward + backward) / CRF "
          "(logdet log-partition + backward); '>' marks a lower bound (calls over the "
          "limit). vs CRF layer: median ratio to the CRF marginals as a layer (double "
          "backward). side: sentences solved on the facet side / vertex side / cut at "
          "the limit.")


if __name__ == "__main__":
    main()
