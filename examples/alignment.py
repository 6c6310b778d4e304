"""Structured attention: the alignments of Section 5.2 of the paper as hidden layers.

Three ways to turn a score matrix ``S`` (hypothesis words by premise words) into
an alignment of each hypothesis word to the premise, as in the paper's Table 2
and Figure 5:

* ``softmax``: a row softmax; every pair gets some weight;
* ``sequential``: SparseMAP of a :class:`sparsemap.SequenceFactor` running over
  the hypothesis, whose states are the premise words, with the paper's binned
  transition scores (:func:`transition_scores`); it can learn continuous,
  monotone alignments and keeps a few of them;
* ``matching``: SparseMAP of a :class:`sparsemap.MatchingFactor`: a few
  one-to-one alignments.

The script does two things.

1. The three alignments of one hand-made sentence pair (Figure 5's sentences,
   with word-similarity scores set by hand and fixed bin scores), drawn side by
   side with :func:`sparsemap.plot.heatmap`: ``DIR/alignments.png``.
2. A tiny decomposable-attention model (Parikh et al., 2016; no encoder, no
   positions) trained with each alignment as its hidden layer on a synthetic
   inference task whose label is decided through the alignment
   (:func:`make_data`: the hypothesis restates a span of the premise, and the
   label says whether an attribute was flipped; one word of each premise occurs
   twice, which only the order of the words disambiguates). Minibatches of
   pairs of different lengths go through the ragged batches of
   :mod:`sparsemap.torch`. It reports per-epoch training loss and accuracy,
   test accuracy, how often the alignment's heaviest premise word is the right
   one, and the sparsity of the alignments on the test set;
   ``DIR/training.png`` has the curves, ``DIR/learned_alignments.png`` the
   three trained models' alignments of one test pair.

Usage::

    python examples/alignment.py --out DIR [--epochs 8] [--seed 0] [--threads 1]
        [--train-size 2000] [--test-size 500] [--vocab 24] [--min-len 5]
        [--max-len 8] [--dim 32] [--batch-size 32] [--lr 0.003]
        [--repeats 1] [--alignments softmax sequential matching] [--no-figures]

It prints one line per epoch and writes ``DIR/results.json``::

    {"settings": {...}, "figure_pair": {kind: {"nnz", "size", "support"}},
     "order_blind_rules": {"any_copy", "one_to_one"},
     "alignments": {kind: {"epochs": [{"epoch", "train_loss", "train_accuracy",
                                       "test_accuracy", "alignment_accuracy",
                                       "mean_nnz_per_row", "percent_nonzero",
                                       "mean_support", "seconds"}, ...],
                           "train_loss": [...], "train_accuracy": [...],
                           "test_accuracy": [...], "final_accuracy",
                           "final_train_accuracy", "final_alignment_accuracy",
                           "sparsity": {"mean_nnz_per_row", "percent_nonzero",
                                        "mean_support"},
                           "seconds", "transitions" (sequential only)}}}

``train_loss`` and ``train_accuracy`` are means over the epoch's minibatches
(while training); the accuracies are percentages; ``final_accuracy`` is the
test accuracy after the last epoch; ``seconds`` the wall time of the training
passes (evaluation excluded). Sparsity is measured on the test set:
``mean_nnz_per_row`` is the mean number of premise words with nonzero weight
per hypothesis word; ``percent_nonzero`` the percentage of (hypothesis word,
premise word) pairs with nonzero weight (the figure in parentheses in Table 2);
``mean_support`` the mean number of structures in SparseMAP's support. A row
softmax is a distribution over the ``n_premise ** n_hypothesis`` ways of
pointing each hypothesis word at a premise word, all with nonzero probability;
its ``mean_support`` is the mean of that count.
"""
import argparse
import functools
import json
import os
import sys
import time
from collections import Counter

import numpy as np
import torch
from torch import nn

import sparsemap as sm
import sparsemap.torch as smt

ALIGNMENTS = ("softmax", "sequential", "matching")


# -- binned transition scores (Section 5.2) --------------------------------------------
# The sequence runs over the hypothesis; its states are the premise words
# t = 0 .. n_states - 1. A move from t1 at one position to t2 at the next is
# scored by the bin of t2 - t1 in {<= -2, -1, 0, 1, >= 2}; the first state by
# the bin of t2 in {first word, second or later} (the paper's {1, 2 or more},
# 1-based); the last state by the bin of t1 in {second to last or earlier,
# the last word} (the paper's {-2 or less, -1}, counted from the end).
N_JUMP_BINS, N_START_BINS, N_END_BINS = 5, 2, 2


def jump_bin(d):
    """Bin index (0..4) of a jump ``d = t2 - t1``: ``<= -2, -1, 0, 1, >= 2``."""
    return torch.clamp(torch.as_tensor(d), -2, 2) + 2


def start_bin(t):
    """Bin index of the first state: 0 for the first premise word, 1 for any later one."""
    return (torch.as_tensor(t) >= 1).long()


def end_bin(t, n_states):
    """Bin index of the last state: 1 for the last premise word, 0 for any earlier one.

    ``n_states`` may be a tensor of per-element sizes broadcasting against ``t``.
    """
    return (torch.as_tensor(t) == torch.as_tensor(n_states) - 1).long()


def transition_scores(w_jump, w_start, w_end, n_positions, n_states):
    """The paper's ``eta_F(i, t1, t2)`` for one sequence, as SequenceFactor scores.

    Parameters
    ----------
    w_jump : Tensor (5,)
        Scores of the jump bins ``<= -2, -1, 0, 1, >= 2``.
    w_start : Tensor (2,)
        Scores of the first state: the first premise word, or a later one.
    w_end : Tensor (2,)
        Scores of the last state: an earlier premise word, or the last one.
    n_positions, n_states : int
        Hypothesis and premise lengths.

    Returns
    -------
    eta_v : Tensor (n_positions - 1, n_states, n_states)
        ``eta_v[i, t1, t2] = w_jump[bin(t2 - t1)]``, the same at every position.
    start, end : Tensor (n_states,)
        ``w_start[bin(t)]`` and ``w_end[bin(t)]``. The paper's transitions out
        of the start and into the end touch a single state each, so they are
        unary scores of the first and last positions: :func:`fold` adds them
        to ``eta_u`` (the QP is unchanged, since they add to the linear term
        exactly what a separate start/end part would).
    """
    t = torch.arange(n_states)
    trans = w_jump[jump_bin(t[None, :] - t[:, None])]
    eta_v = trans.expand(max(n_positions - 1, 0), n_states, n_states)
    return eta_v, w_start[start_bin(t)], w_end[end_bin(t, n_states)]


def fold(scores, hyp_len, prem_len, w_jump, w_start, w_end):
    """Sequential-alignment scores of a padded batch.

    Parameters
    ----------
    scores : Tensor (B, H, P)
        Word-pair scores, hypothesis by premise, padded.
    hyp_len, prem_len : LongTensor (B,)
    w_jump, w_start, w_end : Tensor
        Bin scores, as in :func:`transition_scores`.

    Returns
    -------
    eta_u : Tensor (B, H, P)
        ``scores`` plus the start scores on the first row and the end scores
        (which depend on each premise's length) on each element's last row.
    eta_v : Tensor (B, H - 1, P, P)
        Binned jump scores; element ``b`` reads its leading block.
    """
    B, H, P = scores.shape
    eta_v, start, _ = transition_scores(w_jump, w_start, w_end, H, P)
    t = torch.arange(P)
    end = w_end[end_bin(t[None, :], prem_len[:, None])]                  # (B, P)
    rows = torch.arange(H)
    first = (rows == 0).to(scores.dtype)[None, :, None]                  # (1, H, 1)
    last = (rows[None, :] == hyp_len[:, None] - 1).to(scores.dtype)[..., None]
    eta_u = scores + first * start[None, None, :] + last * end[:, None, :]
    return eta_u, eta_v.expand(B, H - 1, P, P)


# -- the three alignments -----------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _factor(kind, n_hyp, n_prem):
    return (sm.SequenceFactor if kind == "sequential" else sm.MatchingFactor)(n_hyp, n_prem)


def structured_problems(kind, scores, hyp_len, prem_len, transitions=None):
    """Factors (one per element) and padded scores of a sequential or matching batch."""
    factors = [_factor(kind, int(h), int(p)) for h, p in zip(hyp_len, prem_len)]
    if kind == "matching":
        return factors, scores, None
    return (factors,) + fold(scores, hyp_len, prem_len, *transitions)


def align(kind, scores, hyp_len, prem_len, transitions=None, n_jobs=1):
    """Alignment of each hypothesis word to the premise words, for a padded batch.

    Parameters
    ----------
    kind : {"softmax", "sequential", "matching"}
    scores : Tensor (B, H, P)
        Word-pair scores, padding anywhere past ``hyp_len`` rows and
        ``prem_len`` columns (never read).
    hyp_len, prem_len : LongTensor (B,)
    transitions : tuple of Tensor, optional
        ``(w_jump, w_start, w_end)`` for ``"sequential"``.
    n_jobs : int
        Threads for the SparseMAP solves.

    Returns
    -------
    Tensor (B, H, P)
        Differentiable; 0 in the padding. Rows sum to one, except the
        matching's unmatched rows (when the hypothesis is the longer).
    """
    B, H, P = scores.shape
    row_ok = torch.arange(H)[None, :] < hyp_len[:, None]
    col_ok = torch.arange(P)[None, :] < prem_len[:, None]
    if kind == "softmax":
        a = scores.masked_fill(~col_ok[:, None, :], float("-inf")).softmax(-1)
        return a * row_ok[:, :, None]
    if kind not in ALIGNMENTS:
        raise ValueError(f"kind: expected one of {ALIGNMENTS}, got {kind!r}")
    factors, eta_u, eta_v = structured_problems(kind, scores, hyp_len, prem_len, transitions)
    return smt.sparsemap(factors, eta_u, eta_v, n_jobs=n_jobs)


def support_sizes(kind, scores, hyp_len, prem_len, transitions=None, n_jobs=1):
    """Number of structures in each element's support (softmax: ``P ** H``, as a float)."""
    if kind == "softmax":
        return prem_len.double() ** hyp_len.double()
    factors, eta_u, eta_v = structured_problems(kind, scores, hyp_len, prem_len, transitions)
    _, weights = smt.distribution(factors, eta_u, eta_v, n_jobs=n_jobs)
    return (weights > 0).sum(-1).double()


# -- figure 1: a hand-made sentence pair ----------------------------------------------------
PREMISE = "a gentleman overlooking a neighborhood situation .".split()
HYPOTHESIS = "a police officer watches a situation closely .".split()
# Word-similarity-like scores set by hand (hypothesis word, premise word): what
# dot products of good word vectors would give. Unlisted pairs score 0.
SIMILAR = {("a", "a"): 1.5, ("police", "gentleman"): 0.9, ("officer", "gentleman"): 1.2,
           ("watches", "overlooking"): 1.6, ("situation", "situation"): 2.0,
           ("situation", "neighborhood"): 0.6, ("closely", "overlooking"): 0.5,
           (".", "."): 1.8, ("police", "neighborhood"): 0.4}
# Fixed bin scores for the figure: moving one word forward is good, staying or
# going back is not, a long jump is neutral; starting on the first and ending on
# the last word are slightly preferred.
FIGURE_BINS = (torch.tensor([-1.0, -1.0, -0.5, 0.5, 0.0]), torch.tensor([0.3, 0.0]),
               torch.tensor([0.0, 0.3]))


def figure_scores():
    """The hand-set score matrix of the figure pair (hypothesis by premise)."""
    S = np.zeros((len(HYPOTHESIS), len(PREMISE)))
    for j, h in enumerate(HYPOTHESIS):
        for i, p in enumerate(PREMISE):
            S[j, i] = SIMILAR.get((h, p), 0.0)
    return S


def figure_alignments(S, bins=FIGURE_BINS):
    """The softmax matrix and the sequential and matching SparseMAP results for ``S``."""
    n_h, n_p = S.shape
    lengths = torch.tensor([n_h]), torch.tensor([n_p])
    softmax = align("softmax", torch.tensor(S)[None], *lengths)[0].numpy()
    eta_u, eta_v = fold(torch.tensor(S)[None], *lengths, *(b.double() for b in bins))
    seq = sm.solve(sm.SequenceFactor(n_h, n_p), eta_u[0].numpy(), eta_v[0].numpy())
    match = sm.solve(sm.MatchingFactor(n_h, n_p), S)
    return {"softmax": softmax, "sequential": seq, "matching": match}


def _pyplot():
    """pyplot on the off-screen Agg backend (the script only writes files)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def draw_alignments(panels, row_labels, col_labels, path, suptitle=None):
    """Heatmaps side by side, each titled with its sparsity; saved to ``path``."""
    import sparsemap.plot as smp
    plt = _pyplot()
    height = 2.4 + 0.42 * len(row_labels)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), height),
                             layout="constrained")
    for ax, (kind, a) in zip(np.atleast_1d(axes), panels.items()):
        smp.heatmap(a, ax=ax, row_labels=row_labels, col_labels=col_labels, max_structures=4)
        ax.set_title(f"{kind}\n{ax.get_title()}", fontsize=10)
    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# -- the synthetic task -----------------------------------------------------------------
def make_data(n, vocab, min_len, max_len, repeats, rng):
    """Premise/hypothesis pairs whose label is decided through the alignment.

    A premise is ``P`` words (``min_len <= P <= max_len``) from a vocabulary of
    ``vocab`` word types, each word with a random binary attribute; its word
    types are distinct except that ``repeats`` of them occur twice (at random
    positions, each copy with its own attribute). The hypothesis restates a
    span of the premise: ``H`` consecutive premise words (``2 <= H <= P``),
    with their attributes. The label is 1 ("contradiction") when the attribute
    of one hypothesis word was flipped, 0 ("entailment") when all attributes
    agree with the premise words they restate; half and half.

    Why the alignment decides it: the label is a function of the pairs
    (hypothesis word, the premise word it restates). A model that aligns each
    hypothesis word to that premise word and compares the attributes solves
    the task exactly. The words themselves say which premise word that is,
    except for a repeated word: when the span holds one copy and the two
    copies' attributes differ, only the order tells them apart (the copy whose
    neighbours are the span's). The model has no encoder and no positions,
    so a row softmax sees two equally good copies; the sequential alignment
    can learn, through its jump scores, that consecutive hypothesis words
    align to consecutive premise words. With ``repeats=0`` every alignment can
    solve the task.

    Returns
    -------
    dict of LongTensor
        ``premise, premise_attr (N, max_len)``; ``hypothesis, hypothesis_attr``
        and ``gold`` (the premise position each hypothesis word restates)
        ``(N, max_len)``; padded with 0. ``prem_len, hyp_len, label (N,)``.
    """
    out = {k: np.zeros((n, max_len), dtype=np.int64) for k in
           ("premise", "premise_attr", "hypothesis", "hypothesis_attr", "gold")}
    out.update({k: np.zeros(n, dtype=np.int64) for k in ("prem_len", "hyp_len", "label")})
    for k in range(n):
        P = int(rng.integers(min_len, max_len + 1))
        r = min(repeats, P // 2)
        words = rng.choice(vocab, size=P - r, replace=False)
        words = rng.permutation(np.concatenate([words, words[:r]]))
        attrs = rng.integers(0, 2, size=P)
        H = int(rng.integers(2, P + 1))
        pos = np.arange(H) + rng.integers(0, P - H + 1)
        h_attrs = attrs[pos].copy()
        label = k % 2
        if label:
            h_attrs[rng.integers(H)] ^= 1
        out["premise"][k, :P], out["premise_attr"][k, :P] = words, attrs
        out["hypothesis"][k, :H], out["hypothesis_attr"][k, :H] = words[pos], h_attrs
        out["gold"][k, :H] = pos
        out["prem_len"][k], out["hyp_len"][k], out["label"][k] = P, H, label
    perm = rng.permutation(n)
    return {k: torch.from_numpy(v[perm]) for k, v in out.items()}


def order_blind_rules(data):
    """Test accuracy (%) of the best rules that ignore word order, for reference.

    ``any_copy`` says "contradiction" when some hypothesis word's attribute
    matches no premise copy of that word: what attention that can only look
    for the same word (with the same attribute if there is one) can do.
    ``one_to_one`` says it when the hypothesis' (word, attribute) pairs cannot
    be matched one to one with the premise's: what a matching can do. Neither
    can tell which copy of a repeated word the hypothesis restates; only the
    order can, and a model that aligns by order reaches 100%.
    """
    any_copy = one_to_one = 0
    n = len(data["label"])
    for k in range(n):
        P, H = int(data["prem_len"][k]), int(data["hyp_len"][k])
        prem = Counter(zip(data["premise"][k, :P].tolist(), data["premise_attr"][k, :P].tolist()))
        hyp = Counter(zip(data["hypothesis"][k, :H].tolist(),
                          data["hypothesis_attr"][k, :H].tolist()))
        label = int(data["label"][k])
        any_copy += int(any(prem[pair] == 0 for pair in hyp)) == label
        one_to_one += int(any(c > prem[pair] for pair, c in hyp.items())) == label
    return {"any_copy": 100.0 * any_copy / n, "one_to_one": 100.0 * one_to_one / n}


def pair_with_repeat(data):
    """Index of a test pair that shows the ambiguity of repeated words.

    The first pair whose hypothesis (of 4 words or more) holds one copy of a
    word the premise repeats with two different attributes (only the order
    tells the copies apart); else the first whose hypothesis holds a repeated
    word; else 0.
    """
    fallback = None
    for k in range(len(data["label"])):
        P, H = int(data["prem_len"][k]), int(data["hyp_len"][k])
        prem, attr = data["premise"][k, :P].tolist(), data["premise_attr"][k, :P].tolist()
        hyp = data["hypothesis"][k, :H].tolist()
        for w in set(hyp):
            if prem.count(w) == 2:
                fallback = k if fallback is None else fallback
                if (hyp.count(w) == 1 and H >= 4
                        and len({a for v, a in zip(prem, attr) if v == w}) == 2):
                    return k
    return 0 if fallback is None else fallback


def batches(data, batch_size, rng=None):
    n = len(data["label"])
    order = np.arange(n) if rng is None else rng.permutation(n)
    for s in range(0, n, batch_size):
        idx = torch.from_numpy(order[s:s + batch_size])
        b = {k: v[idx] for k, v in data.items()}
        H, P = int(b["hyp_len"].max()), int(b["prem_len"].max())   # trim the padding
        for k in ("hypothesis", "hypothesis_attr", "gold"):
            b[k] = b[k][:, :H]
        for k in ("premise", "premise_attr"):
            b[k] = b[k][:, :P]
        yield b


# -- the model --------------------------------------------------------------------------
class DecomposableAttention(nn.Module):
    """Attend (hypothesis to premise), compare, aggregate: Parikh et al. (2016), tiny.

    ``S[j, i] = F(h_j) . F(p_i) / sqrt(dim)`` (scaled so that the alignments
    start dense: SparseMAP passes no gradient to the scores while its support
    is one structure); the alignment ``A = align(S)``; each
    hypothesis word is compared with what it attends to, ``v_j = G([h_j;
    sum_i A[j, i] p_i])``; the sum of the ``v_j`` goes through a linear
    classifier. The sequential alignment adds its 9 bin scores.
    """

    def __init__(self, kind, vocab, dim, n_jobs=1):
        super().__init__()
        self.kind, self.n_jobs = kind, n_jobs
        self.scale = dim ** 0.5
        self.words = nn.Embedding(vocab, dim)
        self.attr = nn.Embedding(2, dim)
        self.F = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.G = nn.Sequential(nn.Linear(2 * dim, dim), nn.ReLU())
        self.out = nn.Linear(dim, 2)
        if kind == "sequential":
            self.w_jump = nn.Parameter(torch.zeros(N_JUMP_BINS))
            self.w_start = nn.Parameter(torch.zeros(N_START_BINS))
            self.w_end = nn.Parameter(torch.zeros(N_END_BINS))

    def transitions(self):
        return (self.w_jump, self.w_start, self.w_end) if self.kind == "sequential" else None

    def forward(self, b):
        p = self.words(b["premise"]) + self.attr(b["premise_attr"])
        h = self.words(b["hypothesis"]) + self.attr(b["hypothesis_attr"])
        scores = self.F(h) @ self.F(p).transpose(1, 2) / self.scale          # (B, H, P)
        a = align(self.kind, scores, b["hyp_len"], b["prem_len"], self.transitions(),
                  self.n_jobs)
        v = self.G(torch.cat([h, a @ p], dim=-1))
        rows = (torch.arange(h.shape[1])[None, :] < b["hyp_len"][:, None]).to(v.dtype)
        return self.out((v * rows[..., None]).sum(1)), a, scores


# -- training and evaluation ------------------------------------------------------------
@torch.no_grad()
def evaluate(model, data, batch_size):
    """Accuracy, alignment accuracy and sparsity of the alignments on ``data``."""
    model.eval()
    correct = found = rows = nnz = pairs = 0
    support = []
    for b in batches(data, batch_size):
        logits, a, scores = model(b)
        correct += int((logits.argmax(-1) == b["label"]).sum())
        ok = torch.arange(a.shape[1])[None, :] < b["hyp_len"][:, None]
        found += int(((a.argmax(-1) == b["gold"]) & ok).sum())
        rows += int(ok.sum())
        nnz += int((a > 0).sum())
        pairs += int((b["hyp_len"] * b["prem_len"]).sum())
        support.append(support_sizes(model.kind, scores, b["hyp_len"], b["prem_len"],
                                     model.transitions(), model.n_jobs))
    model.train()
    n = len(data["label"])
    return {"test_accuracy": 100.0 * correct / n, "alignment_accuracy": 100.0 * found / rows,
            "mean_nnz_per_row": nnz / rows, "percent_nonzero": 100.0 * nnz / pairs,
            "mean_support": float(torch.cat(support).mean())}


def train(kind, train_data, test_data, args, log=print):
    """Train one model; returns its results record and the model."""
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed + 1)
    model = DecomposableAttention(kind, args.vocab, args.dim, n_jobs=args.threads)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    epochs = []
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        total = correct = 0.0
        for b in batches(train_data, args.batch_size, rng):
            logits, _, _ = model(b)
            loss = loss_fn(logits, b["label"])
            opt.zero_grad()
            (loss / len(b["label"])).backward()
            opt.step()
            total += float(loss.detach())
            correct += int((logits.argmax(-1) == b["label"]).sum())
        seconds = time.perf_counter() - t0
        n = len(train_data["label"])
        rec = {"epoch": epoch, "train_loss": total / n, "train_accuracy": 100.0 * correct / n}
        rec.update(evaluate(model, test_data, 4 * args.batch_size))
        rec["seconds"] = seconds
        epochs.append(rec)
        log(f"{kind:>10} epoch {epoch:2d}  loss {rec['train_loss']:.4f}  "
            f"train acc {rec['train_accuracy']:5.1f}  test acc {rec['test_accuracy']:5.1f}  "
            f"align acc {rec['alignment_accuracy']:5.1f}  nnz/row {rec['mean_nnz_per_row']:.2f}  "
            f"support {rec['mean_support']:.3g}  {seconds:.2f}s")
    last = epochs[-1]
    res = {"alignment": kind, "epochs": epochs,
           "train_loss": [e["train_loss"] for e in epochs],
           "train_accuracy": [e["train_accuracy"] for e in epochs],
           "test_accuracy": [e["test_accuracy"] for e in epochs],
           "final_accuracy": last["test_accuracy"],
           "final_train_accuracy": last["train_accuracy"],
           "final_alignment_accuracy": last["alignment_accuracy"],
           "sparsity": {k: last[k] for k in ("mean_nnz_per_row", "percent_nonzero",
                                             "mean_support")},
           "seconds": sum(e["seconds"] for e in epochs)}
    if kind == "sequential":
        res["transitions"] = {k: getattr(model, k).detach().tolist()
                              for k in ("w_jump", "w_start", "w_end")}
    return res, model


# -- command line -------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder (created)")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="threads for the SparseMAP solves and for torch")
    ap.add_argument("--train-size", type=int, default=2000)
    ap.add_argument("--test-size", type=int, default=500)
    ap.add_argument("--vocab", type=int, default=24, help="word types per vocabulary")
    ap.add_argument("--min-len", type=int, default=5, help="shortest premise")
    ap.add_argument("--max-len", type=int, default=8, help="longest premise")
    ap.add_argument("--repeats", type=int, default=1,
                    help="word types that occur twice in each premise")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.003)
    ap.add_argument("--alignments", nargs="+", choices=ALIGNMENTS, default=list(ALIGNMENTS))
    ap.add_argument("--no-figures", dest="figures", action="store_false",
                    help="write results.json only")
    args = ap.parse_args(argv)
    for name in ("epochs", "threads", "train_size", "test_size", "dim", "batch_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected a positive integer, "
                     f"got {getattr(args, name)}")
    if not 2 <= args.min_len <= args.max_len <= args.vocab:
        ap.error(f"--min-len, --max-len, --vocab: expected 2 <= min-len <= max-len <= vocab, "
                 f"got {args.min_len}, {args.max_len}, {args.vocab}")
    if args.repeats < 0:
        ap.error(f"--repeats: expected a non-negative integer, got {args.repeats}")
    if args.lr <= 0:
        ap.error(f"--lr: expected a positive number, got {args.lr}")
    return args


def figure_pair_sparsity(panels, S):
    """nnz, size and support size of the figure pair's three alignments."""
    out = {}
    for kind, a in panels.items():
        structured = isinstance(a, sm.SparseMAPResult)
        u = a.u if structured else a
        out[kind] = {"nnz": int(np.count_nonzero(u)), "size": int(u.size),
                     "support": len(a.structures) if structured
                     else float(S.shape[1]) ** S.shape[0]}
    return out


def draw_training(results, path):
    """Training loss, test accuracy and nonzeros per row over the epochs."""
    import sparsemap.plot as smp
    plt = _pyplot()
    fig = smp.sparsity_over_training(
        results["alignments"], metrics=("train_loss", "test_accuracy", "mean_nnz_per_row"),
        yscale={"mean_nnz_per_row": "linear"})
    for ax, name in zip(fig.axes, ("training loss", "test accuracy (%)", "nonzeros per row")):
        ax.set_ylabel(name)
    fig.axes[0].legend(frameon=False)
    fig.axes[-1].set_xlabel("epoch")
    fig.savefig(path, dpi=90)
    plt.close(fig)


def draw_learned(models, test_data, path):
    """The trained models' alignments of one test pair (see :func:`pair_with_repeat`)."""
    k = pair_with_repeat(test_data)
    one = next(batches({key: v[k:k + 1] for key, v in test_data.items()}, 1))
    learned = {}
    with torch.no_grad():
        for kind, model in models.items():
            model.eval()
            _, a, scores = model(one)
            if kind == "softmax":
                learned[kind] = a[0].double().numpy()
            else:       # solve again, for the support (the same problem as the layer's)
                trans = None if kind == "matching" else [w.double() for w in model.transitions()]
                factors, eta_u, eta_v = structured_problems(
                    kind, scores.double(), one["hyp_len"], one["prem_len"], trans)
                learned[kind] = sm.solve(factors[0], eta_u[0].numpy(),
                                         None if eta_v is None else eta_v[0].numpy())
    P, H = int(one["prem_len"][0]), int(one["hyp_len"][0])

    def word_labels(words, attrs, n):      # word type, then its attribute as + or -
        return [f"w{int(w)}{'+-'[int(a)]}" for w, a in zip(words[0, :n], attrs[0, :n])]

    gold = one["gold"][0]
    draw_alignments(learned, word_labels(one["hypothesis"], one["hypothesis_attr"], H),
                    word_labels(one["premise"], one["premise_attr"], P), path,
                    f"trained models on test pair {k} (label {int(one['label'][0])}; "
                    f"gold: premise words {int(gold[0])}..{int(gold[H - 1])})")


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(args.threads)
    log = functools.partial(print, flush=True)

    # 1. the hand-made pair
    S = figure_scores()
    panels = figure_alignments(S)
    figure_pair = figure_pair_sparsity(panels, S)
    for kind, f in figure_pair.items():
        log(f"figure pair, {kind:>10}: nnz {f['nnz']} / {f['size']}, support {f['support']:.3g}")
    if args.figures:
        draw_alignments(panels, HYPOTHESIS, PREMISE, os.path.join(args.out, "alignments.png"),
                        "hypothesis (rows) aligned to premise (columns)")

    # 2. training
    rng = np.random.default_rng(args.seed)
    train_data = make_data(args.train_size, args.vocab, args.min_len, args.max_len,
                           args.repeats, rng)
    test_data = make_data(args.test_size, args.vocab, args.min_len, args.max_len,
                          args.repeats, rng)
    rules = order_blind_rules(test_data)
    log(f"order-blind rules on the test set: any copy {rules['any_copy']:.1f}%, "
        f"one to one {rules['one_to_one']:.1f}%")
    results = {"settings": vars(args), "figure_pair": figure_pair,
               "order_blind_rules": rules, "alignments": {}}
    models = {}
    for kind in args.alignments:
        results["alignments"][kind], models[kind] = train(kind, train_data, test_data, args,
                                                          log)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    if args.figures:
        draw_training(results, os.path.join(args.out, "training.png"))
        draw_learned(models, test_data, os.path.join(args.out, "learned_alignments.png"))
    log(f"wrote {args.out}/results.json"
        + (", alignments.png, training.png, learned_alignments.png" if args.figures else ""))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
