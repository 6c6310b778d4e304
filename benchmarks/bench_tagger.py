"""A BiLSTM tagger on the sequence layer, against a forward-algorithm CRF, from init.

A part-of-speech tagger (UPOS, 17 tags) on ``../shared/data``'s treebanks: word
embeddings, a one-layer BiLSTM and a linear layer give the unary scores (PyTorch's
default initialisation); the transition scores are a parameter, one ``(17, 17)`` matrix
shared by the positions or one per position (``(N - 1, 17, 17)``, sliced to each
batch), initialised at zero, ``uniform(-0.1, 0.1)`` or ``0.1 * randn``. Trained with the
SparseMAP loss (Adam, lr 1e-3) on batches of 16 consecutive training sentences; at
init, after 1 update and after 100, the structured part alone is timed on the same
batches of 16 dev sentences (the BiLSTM's cost is the same for both):

* loss: ``smt.sparsemap_loss`` forward + backward, against the CRF's negative
  log-likelihood (forward algorithm in torch, masked for the batch's lengths) forward +
  backward;
* layer: ``smt.sequence`` forward + backward of ``<u, g>`` (a fixed random ``g``),
  against the CRF's marginals (the gradient of the log-partition, ``create_graph``)
  forward + backward of ``<marginals, g>``.

Both get the scores as leaf tensors in float64 (the layer solves in float64 anyway).
The ratio is SparseMAP's CPU time over the CRF's, per batch; the table gives the median
and the worst batch (the bar: median <= 2, worst <= 5 at every initialisation and
phase). CPU time of the process (``time.process_time``), the median of ``--repeats``
runs per batch; torch and the layer on one thread (``n_jobs=1``,
``torch.set_num_threads(1)``, ``OPENBLAS_NUM_THREADS=1``).

Usage::

    python benchmarks/bench_tagger.py                  # the full table (a few minutes)
    python benchmarks/bench_tagger.py --quick          # fewer batches and updates
    python benchmarks/bench_tagger.py --treebank UD_Vietnamese-VTB
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")
UPOS = ("ADJ", "ADP", "ADV", "AUX", "CCONJ", "DET", "INTJ", "NOUN", "NUM", "PART", "PRON",
        "PROPN", "PUNCT", "SCONJ", "SYM", "VERB", "X")


def read_conllu(path, max_words):
    """(words, upos) per sentence (multiword tokens and empty nodes skipped), those of
    2 to max_words words, in file order."""
    sentences, words, tags = [], [], []

    def close():
        if 2 <= len(words) <= max_words:
            sentences.append((list(words), list(tags)))
        words.clear()
        tags.clear()

    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.rstrip("\n")
            if not line:
                close()
            elif not line.startswith("#"):
                cols = line.split("\t")
                if cols[0].isdigit():
                    words.append(cols[1].lower())
                    tags.append(UPOS.index(cols[3]) if cols[3] in UPOS else UPOS.index("X"))
    close()
    return sentences


def batches(torch, sentences, vocab, size):
    """Padded (words, tags, lengths) tensors of consecutive sentences."""
    out = []
    for k in range(0, len(sentences) - size + 1, size):
        chunk = sentences[k:k + size]
        N = max(len(w) for w, _ in chunk)
        words = torch.zeros(size, N, dtype=torch.long)
        tags = torch.full((size, N), -1, dtype=torch.long)
        for b, (w, t) in enumerate(chunk):
            words[b, :len(w)] = torch.tensor([vocab.get(x, 1) for x in w])
            tags[b, :len(t)] = torch.tensor(t)
        out.append((words, tags, torch.tensor([len(w) for w, _ in chunk])))
    return out


def tagger(torch, n_words, n_tags, max_len, shared, init):
    nn = torch.nn

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(n_words, 100)
            self.lstm = nn.LSTM(100, 100, 1, batch_first=True, bidirectional=True)
            self.out = nn.Linear(200, n_tags)
            shape = (n_tags, n_tags) if shared else (max_len - 1, n_tags, n_tags)
            T = torch.zeros(shape)
            if init == "uniform":
                T.uniform_(-0.1, 0.1)
            elif init == "randn":
                T = 0.1 * torch.randn(shape)
            self.trans = nn.Parameter(T)

        def forward(self, words, lengths):
            h, _ = self.lstm(self.emb(words))
            eta_u = self.out(h)
            B, N = words.shape
            if shared:
                eta_v = self.trans.expand(B, N - 1, n_tags, n_tags)
            else:
                eta_v = self.trans[:N - 1].expand(B, N - 1, n_tags, n_tags)
            return eta_u, eta_v

    return Tagger()


def crf_parts(torch):
    """Log-partition and target score of padded sequences (forward algorithm)."""

    def log_partition(eta_u, eta_v, lengths):
        B, N, m = eta_u.shape
        alpha = eta_u[:, 0]
        out = torch.zeros(B, dtype=eta_u.dtype)
        for i in range(1, N):
            nxt = torch.logsumexp(alpha[:, :, None] + eta_v[:, i - 1], dim=1) + eta_u[:, i]
            live = (i < lengths)[:, None]
            alpha = torch.where(live, nxt, alpha)
        out = torch.logsumexp(alpha, dim=1)
        return out

    def target_score(eta_u, eta_v, tags, lengths):
        B, N, m = eta_u.shape
        mask = tags >= 0
        t = tags.clamp(min=0)
        s = (eta_u.gather(2, t[:, :, None])[:, :, 0] * mask).sum(1)
        pair = mask[:, 1:] & mask[:, :-1]
        tv = eta_v.gather(2, t[:, :-1, None, None].expand(B, N - 1, 1, m))[:, :, 0]
        tv = tv.gather(2, t[:, 1:, None])[:, :, 0]
        return s + (tv * pair).sum(1)

    return log_partition, target_score


def cpu_median(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return float(np.median(times))


def measure(torch, smt, sm, model, dev, repeats, log_partition, target_score, kw):
    """Per dev batch: (loss ratio, layer ratio, SparseMAP loss s, CRF loss s, layer s,
    CRF layer s)."""
    rows = []
    with torch.no_grad():
        scored = [(model(w, n), t, n) for w, t, n in dev]
    for (eta_u, eta_v), tags, lengths in scored:
        eu = eta_u.double().detach()
        ev = eta_v.double().detach().contiguous()
        factors = [sm.SequenceFactor(int(n), eu.shape[2]) for n in lengths]
        g = torch.tensor(np.random.default_rng(0).standard_normal(eu.shape))
        g = g * (tags >= 0)[:, :, None]

        def sm_loss():
            a, b = eu.clone().requires_grad_(), ev.clone().requires_grad_()
            smt.sparsemap_loss(factors, a, tags, b, n_jobs=1, **kw).backward()

        def crf_loss():
            a, b = eu.clone().requires_grad_(), ev.clone().requires_grad_()
            (log_partition(a, b, lengths) - target_score(a, b, tags, lengths)).mean().backward()

        def sm_layer():
            a, b = eu.clone().requires_grad_(), ev.clone().requires_grad_()
            (smt.sequence(a, b, lengths, n_jobs=1, **kw) * g).sum().backward()

        def crf_layer():
            a, b = eu.clone().requires_grad_(), ev.clone().requires_grad_()
            marg = torch.autograd.grad(log_partition(a, b, lengths).sum(), a, create_graph=True)[0]
            (marg * g).sum().backward()

        t_l, t_cl = cpu_median(sm_loss, repeats), cpu_median(crf_loss, repeats)
        t_y, t_cy = cpu_median(sm_layer, repeats), cpu_median(crf_layer, repeats)
        rows.append((t_l / t_cl, t_y / t_cy, t_l, t_cl, t_y, t_cy))
    return np.array(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--treebank", default="UD_Hungarian-Szeged")
    ap.add_argument("--max-words", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dev-batches", type=int, default=8)
    ap.add_argument("--updates", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--inits", nargs="+", default=["zero", "uniform", "randn"])
    ap.add_argument("--method", default=None, help="solve_kw method of the layer and the "
                    "loss (default: the package's default)")
    ap.add_argument("--quick", action="store_true", help="4 dev batches, 20 updates, 1 repeat")
    args = ap.parse_args()
    if args.quick:
        args.dev_batches, args.updates, args.repeats = 4, 20, 1

    import torch
    import sparsemap as sm
    import sparsemap.torch as smt
    torch.set_num_threads(1)
    root = os.path.join(DATA, args.treebank)
    files = sorted(os.listdir(root))
    train = read_conllu(os.path.join(root, next(f for f in files if f.endswith("train.conllu"))),
                        args.max_words)
    dev = read_conllu(os.path.join(root, next(f for f in files if f.endswith("dev.conllu"))),
                      args.max_words)
    vocab = {"<pad>": 0, "<unk>": 1}
    for w, _ in train:
        for x in w:
            vocab.setdefault(x, len(vocab))
    max_len = max(len(w) for w, _ in train + dev)
    train_b = batches(torch, train, vocab, args.batch)
    dev_b = batches(torch, dev, vocab, args.batch)[:args.dev_batches]
    log_partition, target_score = crf_parts(torch)
    lens = [int(n.max()) for _, _, n in dev_b]
    print(f"{args.treebank}: {len(train)} training sentences of 2 to {args.max_words} words, "
          f"dev batches of {args.batch} (longest {min(lens)} to {max(lens)} words), 17 UPOS "
          f"tags; CPU time, median of {args.repeats} runs per batch, one thread")
    print(f"{'transitions':>11} {'kind':>8} {'phase':>6} | {'loss x CRF':>16} "
          f"{'layer x CRF':>16} | {'loss ms':>8} {'CRF':>6} {'layer ms':>8} {'CRF':>6}")
    print(f"{'':>11} {'':>8} {'':>6} | {'median':>7} {'worst':>8} {'median':>7} "
          f"{'worst':>8} |")
    kw = {} if args.method is None else {"method": args.method}
    bar = True
    for init in args.inits:
        for shared in (True, False):
            torch.manual_seed(0)
            model = tagger(torch, len(vocab), 17, max_len, shared, init)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            done = 0
            for phase in (0, 1, args.updates):
                while done < phase:
                    words, tags, lengths = train_b[done % len(train_b)]
                    eta_u, eta_v = model(words, lengths)
                    factors = [sm.SequenceFactor(int(n), 17) for n in lengths]
                    loss = smt.sparsemap_loss(factors, eta_u, tags, eta_v, n_jobs=1, **kw)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    done += 1
                rows = measure(torch, smt, sm, model, dev_b, args.repeats, log_partition,
                               target_score, kw)
                med, worst = np.median(rows[:, :2], 0), rows[:, :2].max(0)
                ms = np.median(rows[:, 2:6], 0) * 1e3
                ok = med.max() <= 2 and worst.max() <= 5
                bar &= ok
                print(f"{init:>11} {'shared' if shared else 'per-pos':>8} {phase:>6} | "
                      f"{med[0]:7.2f} {worst[0]:8.2f} {med[1]:7.2f} {worst[1]:8.2f} | "
                      f"{ms[0]:8.1f} {ms[1]:6.1f} {ms[2]:8.1f} {ms[3]:6.1f}"
                      f"{'' if ok else '   over the bar'}", flush=True)
    print("bar (median <= 2, worst <= 5 everywhere):", "met" if bar else "not met")


if __name__ == "__main__":
    main()
