"""The sequence layer and loss in a real tagger, against a forward-algorithm CRF.

A new user's tagger: word embeddings, a two-layer bi-LSTM and a linear layer to the
17 UPOS tags, at PyTorch's default initialisation, plus transition scores
(``_models.Tagger``): one ``(m, m)`` matrix shared by the positions, as CRF taggers
hold it, or one per position; initialised at zero, ``uniform(-0.1, 0.1)`` or
``0.1 * randn``. One model per treebank, transition form and initialisation,
trained with Adam (at its default learning rate) on batches of 16 training
sentences with the SparseMAP loss (or ``--train-loss crf``: the CRF's negative
log-likelihood). The CRF's cost hardly depends on the scores, so both are timed on
the scores of the one model.

At each phase (at init, after 1 update, after 100) the scores of ``--batches``
batches of 16 dev sentences are computed, and on those same scores, CPU time, torch
on one thread and ``n_jobs=1``:

* loss: ``smt.sparsemap_loss`` (forward, and backward of the mean) against the CRF's
  negative log-likelihood by the forward algorithm (a log-sum-exp recursion) and
  its backward;
* layer: ``smt.sequence`` forward and the backward of a random linear function of
  its output, against the CRF marginals (forward-backward, as the gradient of the
  forward algorithm) used the same way (a second backward through them).

The transitions go to both in the form the model holds them. Where
``smt.sparsemap_loss`` refuses a shared ``(m, m)`` matrix, it is expanded to
``(B, N - 1, m, m)`` inside the timed call, as a user would (column ``expanded``).
Each SparseMAP call runs in a worker process killed after ``--limit`` seconds
(shown as ``>``: a lower bound).

Per row: median and worst over the batches of the per-batch ratio (medians over
``--repeats``), the milliseconds behind the median, the side (facet / vertex
sequences), fallbacks by reason, sequences not converged, the solver's iterations
(homotopy pieces on the facet side; median and max over sequences) and warnings,
read from ``smt.sequence(..., return_info=True)`` on the same scores (the loss
solves the same problems). The bar (median at most 2x and worst at most 5x the
CRF, loss and layer, at every initialisation and phase) is marked ``ok`` / ``MISS``.

Usage::

    python benchmarks/bench_tagger_layer.py [--data DIR] [--batches 4] [--repeats 3]
        [--phases 0 1 100] [--inits zero uniform randn] [--forms shared position]
        [--train-loss sparsemap|crf] [--limit 30] [--seed 0] [--quick]
"""
import argparse
import sys
import warnings

import numpy as np
import torch

import _models as M
from _limited import LimitedWorker

import sparsemap as sm
import sparsemap.torch as smt

BAR_MEDIAN, BAR_WORST = 2.0, 5.0
BATCH = 16
# The 17 tags of Universal Dependencies: a tagger's output layer has all of them, even
# where a treebank's files use fewer (the Hungarian one has no X).
UPOS = ("ADJ", "ADP", "ADV", "AUX", "CCONJ", "DET", "INTJ", "NOUN", "NUM", "PART", "PRON",
        "PROPN", "PUNCT", "SCONJ", "SYM", "VERB", "X")


def _full_transitions(eta_v, B, N):
    """A user's workaround for entry points that refuse a shared matrix."""
    m = eta_v.shape[-1]
    return eta_v.expand(B, N - 1, m, m)


def _layer_v(eta_v, B, N):
    """Transitions for ``smt.sequence``: a shared ``(m, m)`` matrix as it is (the layer
    takes it), per-position ones with the batch dimension it expects."""
    return eta_v if eta_v.dim() == 2 else eta_v.expand(B, *eta_v.shape)


def sparsemap_loss(eta_u, eta_v, tags, lengths):
    """The SparseMAP loss of the batch (its mean), and whether eta_v was expanded."""
    B, N, m = eta_u.shape
    factors = [sm.SequenceFactor(n, m) for n in lengths.tolist()]
    if eta_v.dim() == 2:
        try:
            return smt.sparsemap_loss(factors, eta_u, tags, eta_v, n_jobs=1), False
        except ValueError:
            pass
    return smt.sparsemap_loss(factors, eta_u, tags, _full_transitions(eta_v, B, N),
                              n_jobs=1), eta_v.dim() == 2


# -- the timed jobs (module level: they run in the worker) --------------------------
_warm = []


def _warm_up():
    """One small untimed call of each timed function in each fresh process: a process's
    first call pays one-time costs (lazy imports, allocator) that are no part of it."""
    if not _warm:
        _warm.append(True)
        eta_u, eta_v = torch.randn(2, 4, 3), torch.randn(3, 3)
        tags, lengths = torch.tensor([[0, 1, 2, 0], [1, 1, 0, -1]]), torch.tensor([4, 3])
        sparsemap_job(eta_u, eta_v, tags, lengths, 1)
        crf_job(eta_u, eta_v, tags, lengths, 1)

def sparsemap_job(eta_u, eta_v, tags, lengths, repeats):
    """Median CPU seconds of the loss and of the layer (forward + backward), whether the
    loss needed the transitions expanded, the layer's SolveInfo and warnings."""
    _warm_up()
    B, N, m = eta_u.shape
    g = torch.randn(eta_u.shape, generator=torch.Generator().manual_seed(1))
    caught, expanded, info = [], [False], None

    def loss_pass():
        u, v = eta_u.clone().requires_grad_(), eta_v.clone().requires_grad_()
        loss, expanded[0] = sparsemap_loss(u, v, tags, lengths)
        loss.backward()

    def layer_pass():
        nonlocal info
        u, v = eta_u.clone().requires_grad_(), eta_v.clone().requires_grad_()
        out, info = smt.sequence(u, _layer_v(v, B, N), lengths, n_jobs=1, return_info=True)
        (out * g).sum().backward()

    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        t_loss = M.cpu_seconds(loss_pass, repeats)[0]
        t_layer = M.cpu_seconds(layer_pass, repeats)[0]
    caught = sorted({f"{w.category.__name__}: {str(w.message)[:120]}" for w in ws})
    return t_loss, t_layer, expanded[0], dict(
        facet=info.facet.tolist(), fallback=info.fallback.tolist(),
        status=info.status.tolist(), n_iter=info.n_iter.tolist(), warnings=caught)


def crf_job(eta_u, eta_v, tags, lengths, repeats):
    """Median CPU seconds of the CRF's NLL (forward + backward) and of its marginals as
    a layer (forward-backward, then the backward of a random linear function)."""
    _warm_up()
    g = torch.randn(eta_u.shape, generator=torch.Generator().manual_seed(1))

    def loss_pass():
        u, v = eta_u.clone().requires_grad_(), eta_v.clone().requires_grad_()
        M.chain_nll(u, v, tags, lengths).backward()

    def layer_pass():
        u, v = eta_u.clone().requires_grad_(), eta_v.clone().requires_grad_()
        (M.chain_marginals(u, v, lengths, create_graph=True) * g).sum().backward()

    return M.cpu_seconds(loss_pass, repeats)[0], M.cpu_seconds(layer_pass, repeats)[0]


# -- data and training ---------------------------------------------------------------
def batch_of(vocab, labels, sentences):
    words, _, _, lengths = M.encode_batch(vocab, sentences, root=False)
    tags = torch.full(words.shape, -1, dtype=torch.int64)    # -1 past each sentence
    for b, (_, upos, _) in enumerate(sentences):
        tags[b, :len(upos)] = torch.tensor([labels[t] for t in upos])
    return words, tags, lengths


def update(model, opt, batch, train_loss):
    words, tags, lengths = batch
    eta_u, eta_v = model(words, lengths)
    if train_loss == "crf":
        loss = M.chain_nll(eta_u, eta_v, tags, lengths)
    else:
        loss = sparsemap_loss(eta_u, eta_v, tags, lengths)[0]
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def fmt(r, lower=False):
    return (">" if lower else "") + (f"{r:.2f}" if r < 100 else f"{r:.0f}")


def measure(worker, model, batches, args):
    """One row's figures over the timed batches, at the model's current parameters."""
    loss_r, layer_r, ms, lowers = [], [], [], []
    facet = vertex = unconverged = 0
    iters, warns, expanded, fallbacks = [], set(), False, []
    for words, tags, lengths in batches:
        with torch.no_grad():
            eta_u, eta_v = model(words, lengths)
        eta_u, eta_v = eta_u.detach(), eta_v.detach()
        c_loss, c_layer = crf_job(eta_u, eta_v, tags, lengths, args.repeats)
        out = worker.run(sparsemap_job, eta_u, eta_v, tags, lengths, args.repeats)
        if out is None:
            loss_r.append(args.limit / c_loss)
            layer_r.append(args.limit / c_layer)
            lowers.append(True)
            continue
        t_loss, t_layer, exp, info = out
        expanded |= exp
        loss_r.append(t_loss / c_loss)
        layer_r.append(t_layer / c_layer)
        lowers.append(False)
        ms.append((t_loss, c_loss, t_layer, c_layer))
        facet += sum(info["facet"])
        vertex += len(info["facet"]) - sum(info["facet"])
        fallbacks += info["fallback"]
        unconverged += sum(1 for s in info["status"] if s)
        iters += info["n_iter"]
        warns |= set(info["warnings"])
    lm, lw = M.ratio_summary(loss_r)
    ym, yw = M.ratio_summary(layer_r)
    cut = any(lowers)
    ok = lm <= BAR_MEDIAN and ym <= BAR_MEDIAN and lw <= BAR_WORST and yw <= BAR_WORST and not cut
    med = np.median(np.array(ms), 0) * 1e3 if ms else [np.nan] * 4
    return [fmt(lm, cut), fmt(lw, cut), f"{med[0]:.1f}/{med[1]:.1f}",
            fmt(ym, cut), fmt(yw, cut), f"{med[2]:.1f}/{med[3]:.1f}",
            f"{facet}f/{vertex}v" + (f"/{sum(lowers)}t" if cut else ""),
            M.fallback_text(fallbacks),
            unconverged, f"{int(np.median(iters))}/{max(iters)}" if iters else "-",
            "yes" if expanded else "no", len(warns), "ok" if ok else "MISS"], warns


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(M.DEFAULT_DATA))
    p.add_argument("--batches", type=int, default=4, help="timed batches of 16 per treebank")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--phases", type=int, nargs="*", default=[0, 1, 100])
    p.add_argument("--inits", nargs="*", default=["zero", "uniform", "randn"],
                   choices=["zero", "uniform", "randn"])
    p.add_argument("--forms", nargs="*", default=["shared", "position"],
                   choices=["shared", "position"])
    p.add_argument("--train-loss", choices=("sparsemap", "crf"), default="sparsemap")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's (a new user keeps its default)")
    p.add_argument("--limit", type=float, default=30.0, help="seconds before a call is cut")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: one batch, shared uniform and per-position zero, phases 0, 1")
    args = p.parse_args(argv)
    cases = [(f, i) for f in args.forms for i in args.inits]
    if args.quick:
        args.batches, args.repeats, args.phases = 1, 1, [0, 1]
        cases = [("shared", "uniform"), ("position", "zero")]
    M.set_one_thread()
    print(f"sparsemap {sm.__version__} from {sm.__file__}")
    print(f"torch {torch.__version__}, 1 thread; n_jobs=1; CPU time; medians of "
          f"{args.repeats}; batches of {BATCH}; training: {args.train_loss} loss, Adam lr "
          f"{args.lr:g}, seed {args.seed}")
    print(f"bar: median <= {BAR_MEDIAN:g}x and worst <= {BAR_WORST:g}x the CRF, loss and layer")
    worker = LimitedWorker(args.limit)
    try:
        for name, files in M.treebanks(args.data).items():
            train, dev = M.read_conllu(files["train"]), M.read_conllu(files["dev"])
            vocab = M.Vocab(train)
            tagset = sorted(set(UPOS) | {t for s in train + dev for t in s[1]})
            labels = {t: i for i, t in enumerate(tagset)}
            rng = np.random.default_rng(args.seed)
            timed = [batch_of(vocab, labels, [dev[i] for i in
                                              rng.choice(len(dev), BATCH, replace=False)])
                     for _ in range(args.batches)]
            max_len = max(len(s[0]) for s in train + dev)
            print(f"\n== {name}: {len(labels)} tags; timed batches of {BATCH} dev sentences, "
                  f"{[int(b[2].max()) for b in timed]} words at most ==")
            rows, warns = [], set()
            for form, init in cases:
                torch.manual_seed(args.seed)
                model = M.Tagger(len(vocab.words) + 3, len(labels), init=init,
                                 shared=form == "shared", max_len=max_len)
                opt = torch.optim.Adam(model.parameters(), lr=args.lr)
                train_rng = np.random.default_rng(args.seed + 1)
                done = 0
                for phase in args.phases:
                    while done < phase:
                        sents = [train[i] for i in train_rng.choice(len(train), BATCH,
                                                                    replace=False)]
                        update(model, opt, batch_of(vocab, labels, sents), args.train_loss)
                        done += 1
                    row, w = measure(worker, model, timed, args)
                    T = model.transitions.detach()
                    rows.append([form, init, phase, f"{float(T.std()) if T.any() else 0:.3f}"]
                                + row)
                    warns |= {f"{form}, {init}, {phase} updates: {m}" for m in w}
                    print(f"  [{form}, {init}, {phase} updates: done]", file=sys.stderr,
                          flush=True)
            M.print_table(["transitions", "init", "updates", "T sd", "loss med", "loss worst",
                           "loss ms (SM/CRF)", "layer med", "layer worst", "layer ms (SM/CRF)",
                           "side f/v", "fallbacks", "unconv.", "iters med/max", "expanded",
                           "warnings", "bar"], rows)
            for m in sorted(warns):
                print(f"  warning: {m}")
    finally:
        worker.close()
    print("\nmed, worst: over the batches, of the per-batch ratio SparseMAP / CRF (CPU time); "
          "'>' marks a lower bound (a call cut at the limit). loss: smt.sparsemap_loss vs the "
          "forward algorithm's NLL, each forward + backward; layer: smt.sequence vs the CRF "
          "marginals, each forward + backward. ms: medians over the batches. side: sequences "
          "on the facet side / the vertex side. expanded: the loss refused the shared matrix "
          "and got it expanded. T sd: the transitions' standard deviation.")


if __name__ == "__main__":
    main()
