"""Why a structured SVM collapses: the scorer's state over training, epoch by epoch.

Trains the parser of ``examples/parsing.py`` (its data, batches, losses and Adam)
with the arc scorer it had before its hidden layer was normalised over the arcs,
``w . tanh(W_h x_h + W_m x_m + b)`` with ``w`` standard normal (``--scorer plain``),
or variants of it, and prints per epoch what ``docs/parsing.rst`` ("Small
treebanks") cites:

* ``loss``: the mean training loss per sentence (a scorer whose arc scores all
  tie has the mean sentence length as its SVM loss: every head of the
  cost-augmented tree is wrong);
* ``dev``: dev UAS;
* ``spread``: the median over the epoch's sentences of the standard deviation of
  their arc scores (``examples/parsing.py``'s ``score_spread``);
* ``lstm``: the median over sentences of the standard deviation of the bi-LSTM
  states over the sentence's words (mean over the units), and ``|h|`` their mean
  magnitude;
* ``sat``: the fraction of hidden units beyond 0.99 in magnitude over the arcs;
* ``grad``: the norm of the whole gradient before clipping, and per layer
  (embeddings, bi-LSTM, ``W_h``, ``W_m``, ``b``, ``w``), means over the updates.

Scorers: ``plain`` (the old one), ``plain-ln`` (the same after a LayerNorm of the
bi-LSTM states, so the MLP sees inputs of unit scale), ``plain-leaky`` (a leaky
ReLU, slope 0.1, instead of the tanh: it cannot saturate), ``normalized`` (the
example's own scorer).

Usage::

    python benchmarks/parsing_collapse.py --train T.conllu --dev D.conllu \\
        [--loss svm] [--scorer plain] [--epochs 15] [--seed 1] [--batch-size 12] \\
        [--lr 2e-3] [--beta2 0.9] [--json OUT.json]
"""
import argparse
import importlib.util
import json
import math
import os
import statistics
import sys

import numpy as np
import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("parsing_example",
                                               os.path.join(ROOT, "examples", "parsing.py"))
parsing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parsing)
SCORERS = ("plain", "plain-ln", "plain-leaky", "normalized")


def parts(model, words, tags, lengths):
    """``(bi-LSTM states, hidden units, scores)`` of ``model`` (either scorer) over the
    padded batch, as its forward pass computes them."""
    h = model.encode(words, tags, lengths)
    z = model.hidden(h, lengths)
    return h, z, model.out(z).squeeze(-1)


class PlainParser(parsing.Parser):
    """The example's parser with the scorer it had before: ``w . act(W_h x_h + W_m x_m
    + b)``, the same parameters drawn in the same order, and ``w`` standard normal."""

    def __init__(self, n_words, n_tags, scorer, word_dim=100, tag_dim=25, lstm_dim=125,
                 mlp_dim=100):
        nn.Module.__init__(self)
        self.word_emb = nn.Embedding(n_words, word_dim, padding_idx=parsing.PAD)
        self.tag_emb = nn.Embedding(n_tags, tag_dim, padding_idx=parsing.PAD)
        self.lstm = nn.LSTM(word_dim + tag_dim, lstm_dim, 2, batch_first=True,
                            bidirectional=True)
        self.drop = nn.Dropout(0.0)
        self.head = nn.Linear(2 * lstm_dim, mlp_dim, bias=False)
        self.mod = nn.Linear(2 * lstm_dim, mlp_dim)
        self.out = nn.Linear(mlp_dim, 1, bias=False)
        nn.init.xavier_uniform_(self.head.weight)
        nn.init.xavier_uniform_(self.mod.weight)
        nn.init.normal_(self.out.weight)
        self.norm = nn.LayerNorm(self.mod.in_features) if scorer == "plain-ln" else None
        self.act = (lambda x: nn.functional.leaky_relu(x, 0.1)) if scorer == "plain-leaky" \
            else torch.tanh

    def encode(self, words, tags, lengths):
        h = super().encode(words, tags, lengths)
        return h if self.norm is None else self.norm(h)

    def hidden(self, h, lengths):
        return self.act(self.head(h)[:, :, None, :] + self.mod(h)[:, None, :, :])


def layer_of(name):
    if name.startswith(("word_emb", "tag_emb")):
        return "emb"
    if name.startswith(("lstm", "norm")):
        return "lstm"
    return {"head.weight": "W_h", "mod.weight": "W_m", "mod.bias": "b",
            "out.weight": "w"}[name]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", required=True)
    p.add_argument("--dev", required=True)
    p.add_argument("--loss", default="svm", choices=parsing.LOSSES)
    p.add_argument("--scorer", default="plain", choices=SCORERS)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--beta2", type=float, default=0.9)
    p.add_argument("--json", default=None, help="write the records there")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    train, dev = parsing.read_conllu(args.train), parsing.read_conllu(args.dev)
    vocab = parsing.Vocab(train)
    train_enc, dev_enc = [vocab.encode(s) for s in train], [vocab.encode(s) for s in dev]
    sizes = (len(vocab.words) + 3, len(vocab.tags) + 3)
    model = parsing.Parser(*sizes) if args.scorer == "normalized" else \
        PlainParser(*sizes, args.scorer)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, args.beta2))
    named = list(model.named_parameters())
    print(f"{args.loss}, {args.scorer} scorer: {len(train)} sentences of "
          f"{statistics.mean(len(s[0]) for s in train):.2f} words on average, batches of "
          f"{args.batch_size}, Adam lr {args.lr:g}, beta2 {args.beta2:g}", flush=True)
    records = []
    for epoch in range(1, args.epochs + 1):
        model.train()
        order = rng.permutation(len(train_enc))
        total, spreads, lstm, mag, sat, grads = 0.0, [], [], [], [], []
        for k in range(0, len(order), args.batch_size):
            batch = [train_enc[i] for i in order[k:k + args.batch_size]]
            words, tags, heads, lengths = parsing.pad_batch(batch, 0.25, rng)
            h, z, scores = parts(model, words, tags, lengths)
            loss = parsing.training_loss(args.loss, scores, heads, lengths)
            optimizer.zero_grad()
            loss.backward()
            per = {}
            for name, q in named:
                if q.grad is not None:
                    per[layer_of(name)] = per.get(layer_of(name), 0.0) + float(q.grad.norm()) ** 2
            per = {key: math.sqrt(v) for key, v in per.items()}
            per["all"] = float(nn.utils.clip_grad_norm_(model.parameters(), 5.0))
            grads.append(per)
            optimizer.step()
            total += loss.item() * len(batch)
            with torch.no_grad():
                spreads += parsing.score_spread(scores, lengths).tolist()
                valid = parsing.arc_mask(lengths, words.shape[1])
                sat.append(float((z[valid].abs() > 0.99).double().mean()))
                for b, n in enumerate(lengths.tolist()):
                    lstm.append(float(h[b, :n + 1].std(0).mean()))
                    mag.append(float(h[b, :n + 1].abs().mean()))
        dev_uas, _, _ = parsing.evaluate(model, dev_enc, args.loss, sparsity=False)
        rec = {"epoch": epoch, "loss": total / len(train_enc), "dev_uas": dev_uas,
               "spread": statistics.median(spreads), "lstm_spread": statistics.median(lstm),
               "lstm_magnitude": statistics.mean(mag), "saturated": statistics.mean(sat),
               "grad": {key: statistics.mean(g.get(key, 0.0) for g in grads)
                        for key in grads[0]}}
        records.append(rec)
        g = rec["grad"]
        print(f"epoch {epoch:2d}  loss {rec['loss']:7.3f}  dev {dev_uas:5.1f}  spread "
              f"{rec['spread']:8.2g}  lstm {rec['lstm_spread']:6.3f}  |h| "
              f"{rec['lstm_magnitude']:5.3f}  sat {rec['saturated']:5.3f}  grad {g['all']:8.2g} ("
              + ", ".join(f"{key} {g[key]:.2g}" for key in ("emb", "lstm", "W_h", "W_m", "b", "w")
                          if key in g) + ")", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "epochs": records}, f, indent=1)
    return records


if __name__ == "__main__":
    main(sys.argv[1:])
