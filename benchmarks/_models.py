"""Models, data and CRF baselines shared by bench_parser_layer.py and bench_tagger_layer.py.

Both benchmarks time a SparseMAP layer on the scores of a model as a new user would
build it: a bi-LSTM over word and UPOS embeddings with PyTorch's default
initialisation and no normalisation of the scores (unlike ``examples/parsing.py``,
whose scorer standardises its hidden layer over the arcs). Reading CoNLL-U and the
vocabulary come from that example, so both read the treebanks the same way.

The CRF baselines are what a user would pick instead of SparseMAP:

* trees: the matrix-tree theorem (Koo et al., 2007), the log-partition as a
  ``torch.logdet`` of the Laplacian, its arc marginals by autograd;
* sequences: the forward algorithm (a log-sum-exp recursion), its marginals by
  autograd (the forward-backward algorithm).
"""
import importlib.util
import math
import os
import pathlib

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from _timing import cpu_median

ROOT_DIR = pathlib.Path(__file__).resolve().parent.parent
# The treebanks sit beside the repository (its README names ../shared/data).
DEFAULT_DATA = ROOT_DIR.parent / "shared" / "data"


def _load_example():
    # examples/ is not a package: import the parsing example by path, under a name of
    # its own so that it never shadows another module called "parsing".
    spec = importlib.util.spec_from_file_location("_sparsemap_parsing_example",
                                                  ROOT_DIR / "examples" / "parsing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


parsing = _load_example()
read_conllu = parsing.read_conllu
Vocab = parsing.Vocab
PAD, UNK, ROOT = parsing.PAD, parsing.UNK, parsing.ROOT


# -- data ---------------------------------------------------------------------------
def treebanks(data):
    """``{name: {"train": path, "dev": path}}`` for every treebank folder under ``data``
    (a folder with ``*-train.conllu`` files), or for the one folder ``data`` itself."""
    data = pathlib.Path(data)
    folders = [data] if list(data.glob("*train*.conllu")) else \
        sorted(p for p in data.iterdir() if p.is_dir() and list(p.glob("*train*.conllu")))
    out = {}
    for folder in folders:
        train = sorted(folder.glob("*train*.conllu"))[0]
        dev = sorted(folder.glob("*dev*.conllu"))
        name = folder.name.replace("UD_", "")
        out[name] = {"train": train, "dev": dev[0] if dev else train}
    if not out:
        raise SystemExit(f"no treebank (*train*.conllu) under {data}")
    return out


def join_sentences(sentences, length, count, rng):
    """``count`` sentences of exactly ``length`` words, each made of randomly drawn
    sentences put end to end, as a user who times long inputs would make them.

    The first sentence's root word stays the root; the root words of the others take
    it as their head, so the heads still form a single-root tree. The last sentence
    is cut at ``length`` words; a kept word whose head was cut takes the root word
    as its head (its subtree was hanging below words that are gone, so no cycle
    appears)."""
    out = []
    for _ in range(count):
        forms, upos, heads = [], [], [-1]
        root_word = None
        while len(forms) < length:
            f, u, h = sentences[rng.integers(len(sentences))]
            off = len(forms)
            forms += list(f)
            upos += list(u)
            for m in range(1, len(h)):
                if h[m] == 0:
                    if root_word is None:
                        root_word = off + m
                        heads.append(0)
                    else:
                        heads.append(root_word)
                else:
                    heads.append(off + int(h[m]))
        forms, upos, heads = forms[:length], upos[:length], np.array(heads[:length + 1])
        if root_word > length:      # the first sentence's root was cut (a long first one)
            root_word = int(np.argmax(heads[1:] > length)) + 1
            heads[root_word] = 0
        heads[1:][heads[1:] > length] = root_word
        heads[root_word] = 0
        out.append((forms, upos, heads))
    return out


def encode_batch(vocab, sentences, root=True):
    """Padded ``(words, tags, heads, lengths)`` tensors of ``sentences`` (with the ROOT
    token first when ``root``; without it for a tagger, whose heads are then unused)."""
    words, tags, heads, lengths = parsing.pad_batch([vocab.encode(s) for s in sentences])
    if not root:
        words, tags = words[:, 1:], tags[:, 1:]
    return words, tags, heads, lengths


# -- models -------------------------------------------------------------------------
class Encoder(nn.Module):
    """Word and UPOS embeddings into a bi-LSTM, every layer at PyTorch's default init."""

    def __init__(self, n_words, n_tags, word_dim=100, tag_dim=25, lstm_dim=125, layers=2,
                 use_tags=True):
        super().__init__()
        self.use_tags = use_tags
        self.word_emb = nn.Embedding(n_words, word_dim, padding_idx=PAD)
        self.tag_emb = nn.Embedding(n_tags, tag_dim, padding_idx=PAD) if use_tags else None
        self.lstm = nn.LSTM(word_dim + (tag_dim if use_tags else 0), lstm_dim, layers,
                            batch_first=True, bidirectional=True)

    def encode(self, words, tags, lengths):
        x = self.word_emb(words)
        if self.use_tags:
            x = torch.cat([x, self.tag_emb(tags)], -1)
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        h, _ = self.lstm(packed)
        h, _ = pad_packed_sequence(h, batch_first=True, total_length=words.shape[1])
        return h


class ArcParser(Encoder):
    """Arc scores ``(B, N + 1, N + 1)`` with no scaling: ``mlp`` is
    ``w . tanh(W_h x_h + W_m x_m + b) + c`` (Kiperwasser and Goldberg), ``biaffine``
    is ``x_h' U x_m + u . x_h + c`` (Dozat and Manning), all at default init."""

    def __init__(self, n_words, n_tags, scorer="mlp", mlp_dim=100, **kw):
        super().__init__(n_words, n_tags, **kw)
        d = 2 * self.lstm.hidden_size
        self.scorer = scorer
        if scorer == "mlp":
            self.head, self.mod = nn.Linear(d, mlp_dim), nn.Linear(d, mlp_dim, bias=False)
            self.out = nn.Linear(mlp_dim, 1)
        elif scorer == "biaffine":
            self.bilinear = nn.Bilinear(d, d, 1)
            self.head_bias = nn.Linear(d, 1, bias=False)
        else:
            raise ValueError(f"scorer: {scorer!r}")

    def forward(self, words, tags, lengths):
        x = self.encode(words, tags, lengths + 1)          # ROOT is token 0
        if self.scorer == "mlp":
            hid = torch.tanh(self.head(x)[:, :, None, :] + self.mod(x)[:, None, :, :])
            return self.out(hid).squeeze(-1)
        U = self.bilinear.weight[0]
        s = torch.einsum("bhi,ij,bmj->bhm", x, U, x)
        return s + self.head_bias(x) + self.bilinear.bias


class Tagger(Encoder):
    """Tag scores ``(B, N, m)`` (a linear layer over the bi-LSTM states) and transition
    scores: one ``(m, m)`` matrix shared by the positions, or one per position
    ``(max_len - 1, m, m)``, initialised at ``init`` (``zero``, ``uniform``:
    uniform(-0.1, 0.1), or ``randn``: 0.1 * standard normal)."""

    def __init__(self, n_words, n_labels, init="zero", shared=True, max_len=None, **kw):
        super().__init__(n_words, 0, use_tags=False, **kw)
        self.emit = nn.Linear(2 * self.lstm.hidden_size, n_labels)
        shape = (n_labels, n_labels) if shared else (max_len - 1, n_labels, n_labels)
        T = torch.zeros(shape)
        if init == "uniform":
            T.uniform_(-0.1, 0.1)
        elif init == "randn":
            T = 0.1 * torch.randn(shape)
        elif init != "zero":
            raise ValueError(f"init: {init!r}")
        self.transitions = nn.Parameter(T)
        self.shared = shared

    def forward(self, words, lengths):
        """``(eta_u (B, N, m), eta_v)``: eta_v the shared ``(m, m)`` matrix, or the
        per-position ``(N - 1, m, m)`` block for this batch's length ``N``."""
        eta_u = self.emit(self.encode(words, None, lengths))
        N = words.shape[1]
        return eta_u, self.transitions if self.shared else self.transitions[:N - 1]


# -- tree CRF -----------------------------------------------------------------------
def tree_log_partition(scores, lengths, single_root=False):
    """Per sentence, the log of the sum over non-projective trees of ``exp(sum of arc
    scores)`` (matrix-tree theorem). ``single_root``: one child of the root (Koo et
    al.'s first row replaced by the root scores), else any number (the root as an
    ordinary head in the Laplacian). Each modifier's column is shifted by its largest
    score (every tree has one arc into it) so that exp cannot overflow."""
    if single_root:
        return parsing.log_partition(scores, lengths)
    B, n1, _ = scores.shape
    valid = parsing.arc_mask(lengths, n1)
    s = scores.masked_fill(~valid, -math.inf)
    shift = s.max(dim=1, keepdim=True).values
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    w = torch.exp(s - shift)
    A = w[:, 1:, 1:]
    lap = torch.diag_embed(w[:, 0, 1:] + A.sum(dim=1)) - A
    pad = torch.arange(1, n1)[None, :] > lengths[:, None]
    lap = lap + torch.diag_embed(pad.to(lap.dtype))
    return torch.logdet(lap) + shift[:, 0, 1:].sum(-1)


def tree_marginals(scores, lengths, single_root=False, create_graph=False):
    """Arc marginals ``(B, N + 1, N + 1)`` of the tree CRF: the gradient of the
    log-partition (0 off the arcs)."""
    x = scores if scores.requires_grad else scores.detach().requires_grad_()
    logz = tree_log_partition(x, lengths, single_root).sum()
    (marg,) = torch.autograd.grad(logz, x, create_graph=create_graph)
    return marg


def score_stats(scores, lengths):
    """Per sentence ``(head_sd, noise_sd, total_sd)`` of its arc scores: the standard
    deviation over heads of a head's mean score (the per-head offset), that of the
    residual once head and modifier means are taken out (the arc noise), and that of
    the scores. Over arcs ``h -> m``, ``h in 0..n``, ``m in 1..n``, ``h != m``."""
    out = []
    for b, n in enumerate(lengths.tolist()):
        s = scores[b, :n + 1, 1:n + 1].detach().double().clone()
        keep = ~torch.eye(n + 1, n + 1, dtype=torch.bool)[:, 1:]    # h != m
        s[~keep] = float("nan")
        head = torch.nanmean(s, 1, keepdim=True)
        mod = torch.nanmean(s - head, 0, keepdim=True)
        noise = (s - head - mod)[keep]
        out.append((float(head.std()), float(noise.std()), float(s[keep].std())))
    return np.array(out)


# -- sequence CRF -------------------------------------------------------------------
def _per_position(eta_v, B, N):
    """Transitions as ``(B, N - 1, m, m)`` (a view where they are shared)."""
    m = eta_v.shape[-1]
    if eta_v.dim() == 2:
        return eta_v.expand(B, N - 1, m, m)
    if eta_v.dim() == 3:
        return eta_v.expand(B, N - 1, m, m)
    return eta_v


def chain_log_partition(eta_u, eta_v, lengths):
    """Per sequence, the log-partition of the linear-chain CRF by the forward
    algorithm: ``eta_u (B, N, m)``, transitions ``(m, m)``, ``(N - 1, m, m)`` or
    ``(B, N - 1, m, m)``; positions at and past ``lengths[b]`` are left out."""
    B, N, m = eta_u.shape
    V = _per_position(eta_v, B, N)
    alpha = eta_u[:, 0]
    for i in range(1, N):
        nxt = torch.logsumexp(alpha[:, :, None] + V[:, i - 1], dim=1) + eta_u[:, i]
        alpha = torch.where((i < lengths)[:, None], nxt, alpha)
    return torch.logsumexp(alpha, dim=1)


def chain_score(eta_u, eta_v, tags, lengths):
    """Per sequence, the score of the tag sequence ``tags (B, N)`` (padding ignored)."""
    B, N, m = eta_u.shape
    V = _per_position(eta_v, B, N)
    pos = torch.arange(N)
    inside = pos[None, :] < lengths[:, None]
    t = tags.clamp(min=0)
    unary = eta_u.gather(2, t[:, :, None]).squeeze(2)
    total = (unary * inside).sum(1)
    if N > 1:
        idx = (t[:, :-1] * m + t[:, 1:])                               # (B, N - 1)
        pair = V.reshape(B, N - 1, m * m).gather(2, idx[:, :, None]).squeeze(2)
        total = total + (pair * inside[:, 1:]).sum(1)
    return total


def chain_nll(eta_u, eta_v, tags, lengths):
    """Mean negative log-likelihood of ``tags`` under the linear-chain CRF."""
    logz = chain_log_partition(eta_u, eta_v, lengths)
    return (logz - chain_score(eta_u, eta_v, tags, lengths)).mean()


def chain_marginals(eta_u, eta_v, lengths, create_graph=False):
    """Tag marginals ``(B, N, m)`` of the linear-chain CRF (forward-backward, as the
    gradient of the forward algorithm's log-partition; 0 in the padding)."""
    x = eta_u if eta_u.requires_grad else eta_u.detach().requires_grad_()
    (marg,) = torch.autograd.grad(chain_log_partition(x, eta_v, lengths).sum(), x,
                                  create_graph=create_graph)
    return marg


# -- timing -------------------------------------------------------------------------
# the CPU medians of every benchmark come from one place
cpu_seconds = cpu_median


def fallback_text(codes):
    """Counts of the nonzero ``SolveInfo.fallback`` codes by name ("64 declined"), or
    "0"; codes this version of sparsemap does not name are shown as numbers."""
    import sparsemap.torch as smt
    names = getattr(getattr(smt, "SolveInfo", None), "FALLBACKS", ())
    counts = {}
    for c in codes:
        if c:
            key = names[c] if c < len(names) else str(c)
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} {v}" for v, k in sorted((v, k) for k, v in counts.items())[::-1]) \
        if counts else "0"


def ratio_summary(ratios):
    """``(median, worst)`` of a list of ratios (nan when empty)."""
    if not len(ratios):
        return float("nan"), float("nan")
    return float(np.median(ratios)), float(np.max(ratios))


def print_table(header, rows):
    """A plain text table: columns as wide as their widest cell."""
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for k, r in enumerate(cells):
        print("  ".join(c.rjust(w) if k and i else c.ljust(w) for i, (c, w) in
                        enumerate(zip(r, widths))))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def set_one_thread():
    """One core for torch (the solver gets ``n_jobs=1`` at each call)."""
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
