"""Dependency parsing with the SparseMAP losses: Table 1 of the paper at small scale.

An arc-factored, non-projective dependency parser in the spirit of Kiperwasser and
Goldberg (2016), as in Section 5.1 of the paper: a bi-LSTM over word and gold UPOS
embeddings, an MLP arc scorer, and one of four training losses:

* ``sparsemap``: the SparseMAP loss (Section 4);
* ``margin_sparsemap``: the SparseMAP loss with a Hamming cost (margin 1);
* ``svm``: the structured SVM with the Hamming cost (cost-augmented MAP);
* ``crf``: the CRF loss, with the log-partition of the single-root matrix-tree
  theorem (Koo et al., 2007) computed as a log-determinant.

Decoding is the MAP tree (non-projective, one root per sentence, as in Universal
Dependencies), by Chu-Liu-Edmonds. UAS counts punctuation, as in the CoNLL 2017
evaluation. The model is selected on the dev set (best epoch by UAS) and scored
on the test set.

Usage::

    python examples/parsing.py --train T.conllu --dev D.conllu --test X.conllu \\
        --loss {sparsemap,margin_sparsemap,svm,crf} --epochs E --out DIR \\
        [--seed S] [--threads K] [--min-updates U]

Training runs ``E`` epochs, or more when ``E`` epochs would make fewer than ``U``
parameter updates (default 400; see :func:`epochs_to_run`).

It prints one line per epoch and writes ``DIR/results.json``::

    {"loss": ..., "test_uas": ..., "best_epoch": ...,
     "epochs": [{"epoch", "dev_uas", "train_loss", "seconds", "score_spread",
                 "mean_trees", "mean_heads_per_word", ...}, ...],
     "warnings": [{"epoch", "kind", "message"}, ...], ...}

``score_spread`` is the largest standard deviation of the arc scores within a
training sentence over the epoch. A guard (:class:`Guard`) warns, on stderr and
in ``warnings``, when an epoch's arc scores tie (``score_spread`` below
``TIE_SPREAD``: ``kind`` ``"tied_scores"``) or the training loss stops moving
(``"stalled_loss"``): a run that learns nothing never ends silently.

``seconds`` is the wall time of the epoch's training pass (forward, loss,
backward and update over the training set; dev evaluation excluded), and
``cpu_seconds`` the CPU time of this process over the same pass (all its
threads), which other jobs on a busy machine disturb less.
``mean_trees`` and ``mean_heads_per_word`` are the sparsity measures of the
paper's Figure 4 on the dev set, for the distribution over trees that each loss
trains the model to predict: the mean number of trees with nonzero probability
per sentence and the mean number of heads with nonzero probability per word
(pooled over the dev words). For the SparseMAP losses, the support of SparseMAP
solved on the model's arc scores. For the CRF, the Gibbs distribution gives
every tree nonzero probability, so they are the dense values: the number of
single-root trees over ``n`` words (``n ** (n - 1)``, computed with the
matrix-tree theorem on unit weights) and ``n`` possible heads per word. For
the SVM, the prediction is the MAP tree alone: 1 and 1.
"""
import argparse
import copy
import json
import math
import os
import sys
import time
from collections import Counter

import conllu
import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import sparsemap as sm
import sparsemap.torch as smt

LOSSES = ("sparsemap", "margin_sparsemap", "svm", "crf")
PAD, UNK, ROOT = 0, 1, 2          # reserved indices of both vocabularies
# Evaluation batches hold at most this many arc scores (B * (N + 1) ** 2), which
# bounds the (B, N + 1, N + 1, mlp_dim) hidden tensor of the arc scorer.
EVAL_ARCS = 60000


# -- data ---------------------------------------------------------------------------
def read_conllu(path):
    """Read a CoNLL-U file into ``(forms, upos, heads)`` triples, one per sentence.

    Multiword-token lines and empty nodes are skipped (their ids are not
    integers). ``heads`` is an int array of shape ``(n + 1,)`` in the
    :class:`sparsemap.TreeFactor` compact form: ``heads[0] == -1`` and
    ``heads[m]`` the head of word ``m``.
    """
    sentences = []
    with open(path, encoding="utf-8") as f:
        for tokenlist in conllu.parse_incr(f):
            words = [t for t in tokenlist if isinstance(t["id"], int)]
            if not words:
                continue
            where = f"{path}: sentence {tokenlist.metadata.get('sent_id')!r}"
            if [t["id"] for t in words] != list(range(1, len(words) + 1)):
                raise ValueError(f"{where} has word ids that are not 1..n")
            if any(not isinstance(t["head"], int) for t in words):
                raise ValueError(f"{where} has a word without a head")
            heads = np.array([-1] + [t["head"] for t in words], dtype=np.int64)
            sentences.append(([t["form"] for t in words], [t["upos"] for t in words], heads))
    if not sentences:
        raise ValueError(f"{path}: no sentences found")
    return sentences


class Vocab:
    """Word and tag indices from the training set; unseen words map to UNK."""

    def __init__(self, sentences):
        self.word_counts = Counter(w.lower() for forms, _, _ in sentences for w in forms)
        self.words = {w: i + 3 for i, w in enumerate(sorted(self.word_counts))}
        tags = sorted({t for _, upos, _ in sentences for t in upos})
        self.tags = {t: i + 3 for i, t in enumerate(tags)}

    def encode(self, sentence):
        """Word ids, tag ids (ROOT first), word counts, heads; arrays of length n + 1."""
        forms, upos, heads = sentence
        words = [w.lower() for w in forms]
        w = np.array([ROOT] + [self.words.get(x, UNK) for x in words], dtype=np.int64)
        t = np.array([ROOT] + [self.tags.get(x, UNK) for x in upos], dtype=np.int64)
        c = np.array([np.inf] + [self.word_counts.get(x, 0) for x in words])
        return w, t, c, heads


def pad_batch(encoded, word_dropout=0.0, rng=None):
    """Stack encoded sentences into padded tensors ``(words, tags, heads, lengths)``.

    With ``word_dropout = alpha > 0``, a word seen ``c`` times in training is
    replaced by UNK with probability ``alpha / (alpha + c)`` (Kiperwasser and
    Goldberg), so the UNK embedding is trained.
    """
    lengths = np.array([len(e[0]) - 1 for e in encoded])
    B, N1 = len(encoded), lengths.max() + 1
    words = np.full((B, N1), PAD, dtype=np.int64)
    tags = np.full((B, N1), PAD, dtype=np.int64)
    heads = np.full((B, N1), -1, dtype=np.int64)
    for b, (w, t, c, h) in enumerate(encoded):
        if word_dropout > 0:
            w = np.where(rng.random(len(w)) < word_dropout / (word_dropout + c), UNK, w)
        words[b, :len(w)], tags[b, :len(t)], heads[b, :len(h)] = w, t, h
    return (torch.from_numpy(words), torch.from_numpy(tags), torch.from_numpy(heads),
            torch.from_numpy(lengths))


def eval_batches(encoded):
    """Index lists of length-sorted batches of at most EVAL_ARCS arc scores each."""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))
    batches, current = [], []
    for i in order:
        n1 = len(encoded[i][0])
        if current and (len(current) + 1) * n1 * n1 > EVAL_ARCS:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current]


# -- model --------------------------------------------------------------------------
def normalize_over_arcs(A, M, lengths, eps=1e-8):
    """The hidden layer ``A[:, h] + M[:, m]`` standardised over each sentence's arcs.

    ``A`` (the head part) and ``M`` (the modifier part) have shape ``(B, N + 1,
    H)``; the hidden unit ``k`` of arc ``h -> m`` is ``A[b, h, k] + M[b, m, k]``.
    Returns ``(A', M')`` such that ``A'[:, h] + M'[:, m]`` has, for every sentence
    and unit, mean 0 and variance 1 over the sentence's arcs (``h`` in ``0..n``,
    ``m`` in ``1..n``, ``h != m``; ``eps`` added to the variance, far below that of a
    fresh model's hidden layer, about ``2e-3``). The mean and
    variance over the ``n ** 2`` arcs are sums over the ``n + 1`` words, so this
    costs no more than the layer itself; entries past a sentence are never read.
    """
    N1 = A.shape[1]
    n = lengths.to(A.dtype)[:, None, None]                                  # (B, 1, 1)
    idx = torch.arange(N1)
    inside = (idx[None, :] <= lengths[:, None]).to(A.dtype)[..., None]      # words 0..n
    is_mod = inside * (idx >= 1).to(A.dtype)[None, :, None]                 # words 1..n
    heads_of = inside * (n - (idx >= 1).to(A.dtype)[None, :, None])         # arcs from h
    a = A - (heads_of * A).sum(1, keepdim=True) / (n * n)
    mu = M - (is_mod * M).sum(1, keepdim=True) / n
    # sum over the arcs of (a_h + mu_m)^2: the mu_m sum to 0, the diagonal h = m is out
    var = ((heads_of * a * a).sum(1, keepdim=True) + n * (is_mod * mu * mu).sum(1, keepdim=True)
           - 2 * (is_mod * a * mu).sum(1, keepdim=True)) / (n * n)
    scale = torch.rsqrt(var.clamp(min=0) + eps)
    return a * scale, mu * scale


class Parser(nn.Module):
    """Bi-LSTM arc scorer: ``score[b, h, m] = w . tanh(norm(W_h x_h + W_m x_m))``.

    ``x`` are the bi-LSTM states over ``[ROOT] + words``, each word the
    concatenation of its word and gold UPOS embeddings; ``norm`` standardises
    each hidden unit over the arcs of the sentence (:func:`normalize_over_arcs`).
    Returns scores of shape ``(B, N + 1, N + 1)``, the :class:`sparsemap.TreeFactor`
    layout (0 is the root; column 0 and the diagonal are ignored downstream).
    """

    def __init__(self, n_words, n_tags, word_dim=100, tag_dim=25, lstm_dim=125,
                 lstm_layers=2, mlp_dim=100, dropout=0.0):
        super().__init__()
        self.word_emb = nn.Embedding(n_words, word_dim, padding_idx=PAD)
        self.tag_emb = nn.Embedding(n_tags, tag_dim, padding_idx=PAD)
        self.lstm = nn.LSTM(word_dim + tag_dim, lstm_dim, lstm_layers, batch_first=True,
                            bidirectional=True, dropout=dropout if lstm_layers > 1 else 0.0)
        self.drop = nn.Dropout(dropout)
        # no bias: the normalisation takes every unit's mean out
        self.head = nn.Linear(2 * lstm_dim, mlp_dim, bias=False)
        self.mod = nn.Linear(2 * lstm_dim, mlp_dim, bias=False)
        self.out = nn.Linear(mlp_dim, 1, bias=False)
        # Normalised over the arcs, every tanh unit varies from arc to arc, so the arc
        # scores cannot all tie unless w is 0 (docs/parsing.rst, "Small treebanks"):
        # w starts standard normal, about 200 Adam steps of the default 4e-3 from 0.
        nn.init.xavier_uniform_(self.head.weight)
        nn.init.xavier_uniform_(self.mod.weight)
        nn.init.normal_(self.out.weight)

    def encode(self, words, tags, lengths):
        """The bi-LSTM states over ``[ROOT] + words``, ``(B, N + 1, 2 * lstm_dim)``."""
        N1 = words.shape[1]
        x = self.drop(torch.cat([self.word_emb(words), self.tag_emb(tags)], -1))
        packed = pack_padded_sequence(x, lengths + 1, batch_first=True, enforce_sorted=False)
        h, _ = self.lstm(packed)
        h, _ = pad_packed_sequence(h, batch_first=True, total_length=N1)
        return self.drop(h)

    def hidden(self, h, lengths):
        """The arcs' hidden units ``tanh(norm(W_h x_h + W_m x_m))``, ``(B, N + 1, N + 1,
        mlp_dim)``, from the states ``h`` of :meth:`encode`."""
        A, M = normalize_over_arcs(self.head(h), self.mod(h), lengths)
        return torch.tanh(A[:, :, None, :] + M[:, None, :, :])

    def forward(self, words, tags, lengths):
        return self.out(self.hidden(self.encode(words, tags, lengths), lengths)).squeeze(-1)


# -- losses -------------------------------------------------------------------------
def arc_mask(lengths, N1):
    """Bool ``(B, N1, N1)``: the arcs ``h -> m`` of each sentence (``m >= 1``, ``h != m``)."""
    idx = torch.arange(N1)
    inside = idx[None, :] <= lengths[:, None]                       # (B, N1)
    valid = inside[:, :, None] & inside[:, None, :]
    valid &= (idx[None, :] >= 1)[:, None, :].expand_as(valid)      # no arcs into the root
    valid &= ~torch.eye(N1, dtype=torch.bool)[None]
    return valid


def log_partition(scores, lengths):
    """Log of the sum over single-root trees of ``exp(sum of arc scores)``, per sentence.

    Single-root matrix-tree theorem (Koo et al., 2007): with ``A[h, m] =
    exp(scores[h, m])`` for words ``h, m``, the Laplacian ``L = diag(sum_h A[h,
    :]) - A`` restricted to words, and its first row replaced by the root
    scores ``exp(scores[0, 1:])``, the partition function is ``det(L)``. Every
    entry in column ``m`` involves only arcs into ``m``, so each column is
    shifted by its maximum score and the shift added back. Padding gets an
    identity block, which leaves the determinant unchanged.
    """
    B, N1, _ = scores.shape
    valid = arc_mask(lengths, N1)
    s = scores.masked_fill(~valid, -math.inf)
    shift = s.max(dim=1, keepdim=True).values
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    A = torch.exp(s - shift)                                         # 0 off the arcs
    W = A[:, 1:, 1:]
    L = torch.diag_embed(W.sum(1)) - W
    L = torch.cat([A[:, :1, 1:], L[:, 1:, :]], dim=1)
    padding = torch.arange(1, N1)[None, :] > lengths[:, None]
    L = L + torch.diag_embed(padding.to(L.dtype))
    return torch.linalg.slogdet(L).logabsdet + shift[:, 0, 1:].sum(-1)


def tree_score(scores, heads, lengths):
    """Sum of the arc scores of the trees ``heads`` (padded with -1), per sentence."""
    N1 = scores.shape[1]
    m = torch.arange(1, N1)
    inside = m[None, :] <= lengths[:, None]
    h = heads[:, 1:].clamp(min=0)
    picked = scores[:, :, 1:].gather(1, h[:, None, :]).squeeze(1)    # scores[b, h_m, m]
    return (picked * inside).sum(-1)


def crf_loss(scores, heads, lengths):
    """Mean negative log-likelihood of the gold trees under the tree CRF."""
    s = scores.double()
    return (log_partition(s, lengths) - tree_score(s, heads, lengths)).mean()


def training_loss(loss, scores, heads, lengths, threads=1):
    """The training loss ``loss`` of a batch: the mean over its sentences.

    The SparseMAP, margin SparseMAP and SVM losses come from
    :mod:`sparsemap.torch`, one single-root tree factor per sentence over the
    leading block of the padded scores; their problems run on ``threads``
    threads.
    """
    if loss == "crf":
        return crf_loss(scores, heads, lengths)
    factors = [sm.TreeFactor(n, single_root=True) for n in lengths.tolist()]
    if loss == "svm":
        return smt.structured_svm_loss(factors, scores, heads, n_jobs=threads)
    margin = 1.0 if loss == "margin_sparsemap" else 0.0
    return smt.sparsemap_loss(factors, scores, heads, margin=margin, n_jobs=threads)


# -- decoding and evaluation --------------------------------------------------------
def n_trees(n):
    """Number of single-root dependency trees over ``n`` words, ``n ** (n - 1)`` (the
    rooted trees on n labelled nodes), as a float: ``inf`` past float64's range."""
    with np.errstate(over="ignore"):
        return float(np.float64(n) ** (n - 1))


def evaluate(model, encoded, loss, sparsity=True, threads=1):
    """UAS (percent) of the MAP trees, and the Figure 4 sparsity measures.

    Returns ``(uas, mean_trees, mean_heads_per_word)``; the last two are None
    when ``sparsity`` is false. SparseMAP runs on ``threads`` threads.
    """
    model.eval()
    etas, golds = [None] * len(encoded), [e[3] for e in encoded]
    with torch.no_grad():
        for idx in eval_batches(encoded):
            words, tags, _, lengths = pad_batch([encoded[i] for i in idx])
            S = model(words, tags, lengths).double().numpy()
            for b, (i, n) in enumerate(zip(idx, lengths.tolist())):
                etas[i] = S[b, :n + 1, :n + 1]
    factors = [sm.TreeFactor(len(g) - 1, single_root=True) for g in golds]
    correct = sum(int((f.map(eta)[1:] == g[1:]).sum()) for f, eta, g in zip(factors, etas, golds))
    n_words = np.array([len(g) - 1 for g in golds])
    uas = 100.0 * correct / n_words.sum()
    if not sparsity:
        return uas, None, None
    if loss == "crf":
        # every tree, and every one of the n possible heads of each word
        trees = float(np.mean([n_trees(n) for n in n_words]))
        return uas, trees, float(n_words @ n_words / n_words.sum())
    if loss == "svm":
        return uas, 1.0, 1.0
    trees = heads = 0
    # Figure 4 counts the active set's support; the facet side holds no list of trees
    # (its r.structures is one decomposition of u among many)
    for r in sm.solve_batch(factors, etas, method="vertex", n_jobs=threads):
        support = np.array(r.structures)
        trees += len(support)
        heads += sum(len(np.unique(col)) for col in support[:, 1:].T)
    return uas, trees / len(golds), heads / n_words.sum()


# -- the guard ----------------------------------------------------------------------
# A run whose arc scores tie, or whose loss stops moving, learns nothing more: say so.
TIE_SPREAD = 1e-2     # arc scores within a sentence spread less than this: tied
STALL_CHANGE = 1e-3   # training loss within this fraction of itself ...
STALL_EPOCHS = 3      # ... over this many epochs in a row: stalled (two alike is chance)


def score_spread(scores, lengths):
    """Per sentence, the standard deviation of its arc scores ``(B,)`` (no gradient; 0
    for a one-word sentence, whose one arc has nothing to tie with)."""
    with torch.no_grad():
        valid = arc_mask(lengths, scores.shape[1])
        n = valid.sum((1, 2))
        s = scores.detach().double().masked_fill(~valid, 0.0)
        mean = s.sum((1, 2)) / n
        var = ((s - mean[:, None, None]) ** 2).masked_fill(~valid, 0.0).sum((1, 2))
        return torch.where(n > 1, var / (n - 1).clamp(min=1), 0.0).sqrt()


class Guard:
    """Watches a training run for the two ways it can stop learning without failing.

    * **Tied scores**: every training sentence of an epoch had arc scores spread
      (standard deviation) below ``TIE_SPREAD``, so the decoded trees are
      decided by round-off and every loss's gradient is nearly flat.
    * **A stalled loss**: the training losses of the last ``STALL_EPOCHS``
      epochs lie within ``STALL_CHANGE`` of the largest of them, which is above
      zero. A window, not two epochs: in a run that trains normally two
      consecutive epochs can end at nearly the same loss by chance (0.7837 and
      0.7829, then 0.6861), while a collapsed run's loss stays frozen.

    Call :meth:`observe` with each batch's scores and :meth:`end_epoch` after
    each epoch; the latter returns the epoch's warnings (also kept in
    :attr:`warnings`, as dictionaries for ``results.json``).
    """

    def __init__(self, tie_spread=TIE_SPREAD, stall_change=STALL_CHANGE,
                 stall_epochs=STALL_EPOCHS):
        self.tie_spread, self.stall_change = tie_spread, stall_change
        self.stall_epochs = stall_epochs
        self.warnings, self._spread, self._seen, self._losses = [], 0.0, False, []

    def observe(self, scores, lengths):
        """Record a batch's arc scores ``(B, N + 1, N + 1)`` of sentences of ``lengths``."""
        self._spread = max(self._spread, float(score_spread(scores, lengths).max()))
        self._seen |= bool((lengths > 1).any())

    def end_epoch(self, epoch, train_loss):
        """The epoch's largest score spread, and its warnings (a list of dicts)."""
        spread, seen, self._spread, self._seen = self._spread, self._seen, 0.0, False
        found = []
        if seen and spread < self.tie_spread:
            found.append({"epoch": epoch, "kind": "tied_scores", "message": (
                f"epoch {epoch}: the arc scores tie (largest spread within a sentence "
                f"{spread:.2g} < {self.tie_spread:g}): the model scores every arc the same")})
        self._losses = (self._losses + [train_loss])[-self.stall_epochs:]
        top, low = max(self._losses), min(self._losses)
        if len(self._losses) == self.stall_epochs and top > 0 and \
                top - low < self.stall_change * top:
            found.append({"epoch": epoch, "kind": "stalled_loss", "message": (
                f"epoch {epoch}: the training loss stopped moving (the last "
                f"{self.stall_epochs} epochs' losses lie within {self.stall_change:.1%}: "
                f"{', '.join(f'{x:.6g}' for x in self._losses)})")})
        self.warnings += found
        return spread, found


# -- training -----------------------------------------------------------------------
def epochs_to_run(n_sentences, batch_size, epochs, min_updates):
    """The number of epochs to train: ``epochs``, or more if that makes fewer than
    ``min_updates`` parameter updates.

    An epoch makes ``ceil(n_sentences / batch_size)`` updates. A fixed epoch count
    gives a small treebank few updates: 500 sentences in batches of 32 make 240 in
    15 epochs, after which the SparseMAP loss, whose gradient reaches only the
    arcs of its support, still trails the CRF. Counting training in updates is
    what Dozat and Manning (2017) do.
    """
    per_epoch = -(-n_sentences // batch_size)
    return max(epochs, -(-min_updates // per_epoch))


def train(args):
    """Train, select on dev, score on test; return the results dictionary."""
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)

    train_set, dev_set, test_set = (read_conllu(p) for p in (args.train, args.dev, args.test))
    vocab = Vocab(train_set)
    train_enc, dev_enc, test_enc = ([vocab.encode(s) for s in data]
                                    for data in (train_set, dev_set, test_set))
    model = Parser(len(vocab.words) + 3, len(vocab.tags) + 3, dropout=args.dropout)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.9))

    epochs, best_uas, best_state, best_epoch = [], -1.0, None, 0
    guard = Guard()
    print(f"{args.loss}: {len(train_set)} / {len(dev_set)} / {len(test_set)} sentences, "
          f"{len(vocab.words)} words, {len(vocab.tags)} tags, batches of {args.batch_size}",
          flush=True)
    n_epochs = epochs_to_run(len(train_enc), args.batch_size, args.epochs, args.min_updates)
    if n_epochs > args.epochs:
        print(f"{args.loss}: {n_epochs} epochs, so that training makes at least "
              f"{args.min_updates} updates", flush=True)
    for epoch in range(1, n_epochs + 1):
        model.train()
        order = rng.permutation(len(train_enc))
        total = 0.0
        start, cpu_start = time.perf_counter(), time.process_time()
        for k in range(0, len(order), args.batch_size):
            batch = [train_enc[i] for i in order[k:k + args.batch_size]]
            words, tags, heads, lengths = pad_batch(batch, args.word_dropout, rng)
            scores = model(words, tags, lengths)
            guard.observe(scores, lengths)
            loss = training_loss(args.loss, scores, heads, lengths, args.threads)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            total += loss.item() * len(batch)
        seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu_start
        start = time.perf_counter()
        dev_uas, mean_trees, mean_heads = evaluate(model, dev_enc, args.loss, args.sparsity,
                                                   threads=args.threads)
        train_loss = total / len(train_enc)
        spread, alarms = guard.end_epoch(epoch, train_loss)
        record = {"epoch": epoch, "dev_uas": dev_uas, "train_loss": train_loss,
                  "seconds": seconds, "cpu_seconds": cpu_seconds, "mean_trees": mean_trees,
                  "mean_heads_per_word": mean_heads, "score_spread": spread,
                  "eval_seconds": time.perf_counter() - start}
        epochs.append(record)
        if dev_uas > best_uas:
            best_uas, best_epoch = dev_uas, epoch
            best_state = copy.deepcopy(model.state_dict())
        sparsity = (f"trees {mean_trees:9.3g}  heads/word {mean_heads:6.3f}  "
                    if args.sparsity else "")
        print(f"epoch {epoch:3d}  train loss {record['train_loss']:8.4f}  dev UAS {dev_uas:6.2f}  "
              f"{sparsity}{seconds:6.1f} s (+{record['eval_seconds']:.1f} s dev)", flush=True)
        for alarm in alarms:
            print(f"parsing.py: warning: {args.loss}: {alarm['message']}", file=sys.stderr,
                  flush=True)

    model.load_state_dict(best_state)
    test_uas, _, _ = evaluate(model, test_enc, args.loss, sparsity=False)
    print(f"test UAS {test_uas:.2f} (dev-best epoch {best_epoch}, dev UAS {best_uas:.2f})",
          flush=True)
    if guard.warnings:
        kinds = sorted({w["kind"] for w in guard.warnings})
        print(f"parsing.py: warning: {args.loss}: this run did not train normally "
              f"({', '.join(kinds)} in epochs "
              f"{', '.join(str(e) for e in sorted({w['epoch'] for w in guard.warnings}))}); "
              f"see 'warnings' in results.json", file=sys.stderr, flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    return {"loss": args.loss, "test_uas": test_uas, "best_epoch": best_epoch,
            "dev_uas": best_uas, "epochs": epochs, "settings": settings,
            "warnings": guard.warnings}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", required=True, help="training treebank (CoNLL-U)")
    p.add_argument("--dev", required=True, help="dev treebank for model selection (CoNLL-U)")
    p.add_argument("--test", required=True, help="test treebank (CoNLL-U)")
    p.add_argument("--loss", required=True, choices=LOSSES)
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--min-updates", type=int, default=400,
                   help="train more epochs than --epochs when needed to make at least "
                        "this many parameter updates (0: exactly --epochs)")
    p.add_argument("--out", required=True, help="output directory for results.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch and sparsemap threads")
    p.add_argument("--lr", type=float, default=4e-3, help="Adam learning rate")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per update")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="dropout on the embeddings and bi-LSTM states")
    p.add_argument("--word-dropout", type=float, default=0.25,
                   help="alpha of the frequency-based word dropout")
    p.add_argument("--clip", type=float, default=5.0, help="gradient-norm clipping")
    p.add_argument("--sparsity", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the dev sparsity of every epoch (--no-sparsity: UAS only, "
                        "faster; mean_trees and mean_heads_per_word are then null)")
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error(f"--epochs: expected a positive integer, got {args.epochs}")
    if args.min_updates < 0:
        p.error(f"--min-updates: expected a non-negative integer, got {args.min_updates}")
    if args.threads < 1:
        p.error(f"--threads: expected a positive integer, got {args.threads}")
    if args.batch_size < 1:
        p.error(f"--batch-size: expected a positive integer, got {args.batch_size}")
    return args


def main(argv=None):
    args = parse_args(argv)
    results = train(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
