"""The facet side as users meet it: the bar it was built to meet, and the fit of the switching rule.

Tables (``--tables``, default all), each timed in one process, side by side:

a. Non-projective trees at flat scores (``eta = s * randn``, s in 0.01, 0.03, 0.1),
   both root settings: the default ``sm.solve`` + one ``vjp`` against the
   matrix-tree CRF in torch float64 (log-determinant of the Laplacian and its
   gradient), with ``converged`` and the number of warnings. Bar: ratio <= 10.
b. Scales 1 and 5 (``eta = s * randn``; sequences ``eta_v`` too): the default
   against ``method="vertex"`` (the active set alone, as before the facet side),
   for trees, sequences (17 tags) and matchings, run alternately (per seed at least
   ``--repeats`` times and until 0.2 s is spent, at most 400). Bar: ratio <= 1.10.
c. A sequence of 60 positions and 17 tags, flat ``eta_u = 0.1 randn`` and
   ``eta_v`` = 0, 1e-6 randn, 1e-3 randn: the default against a forward-algorithm
   CRF in torch (log-partition and its gradient), converged, warnings, and the
   norm of the ``eta_v`` part of the ``vjp`` against the norm of one-sided finite
   differences of ``u`` (a sample of coordinates, scaled up). Bars: ratio <= 10;
   norms within 10x.
d. Matchings 40 x 40 and 30 x 50 at flat scores: the default, the vertex side and
   Sinkhorn (entropic optimal transport, log domain, to 1e-9) in torch.
e. The torch layer at init: a parser's arc scorer (word and tag embeddings, a
   one-layer BiLSTM, a biaffine scorer; PyTorch's default initialisation) on
   batches of 16 consecutive dev sentences (at most 96 words) of
   UD_Vietnamese-VTB and UD_Hungarian-Szeged: ``smt.tree`` forward + backward
   against the matrix-tree CRF's (log-partition, gradient) on the same scores.
   Bar: ratio <= 10, median and worst batch.

``--fit`` instead measures the switching rule (the peaked-score test each facet
solver runs before anything else; ``decline_peaked``): for each family it times
``sm.solve`` + ``vjp`` with ``method="vertex"`` and ``method="facet"`` over sizes
and a log grid of scales, fits the rule's constants to the measured crossover, and
checks the fitted rule, and the compiled default, on fresh seeds. See
``docs/benchmarks.rst``, "The facet side".

Timings: CPU seconds of the process (``time.process_time``), the median of
``--repeats`` runs per seed, then the median over seeds. Torch runs on one thread
(``torch.set_num_threads(1)``) and the script sets ``OPENBLAS_NUM_THREADS=1``
before NumPy loads (LAPACK calls would otherwise use threads the process time
counts).

Usage::

    python benchmarks/bench_facet.py --quick            # every table, in about a minute
    python benchmarks/bench_facet.py                     # the full tables
    python benchmarks/bench_facet.py --tables a e        # some of them
    python benchmarks/bench_facet.py --fit tree          # the rule: tree, matching, sequence
"""
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402

import sparsemap as sm  # noqa: E402
from sparsemap._facet_matching import single_row_count  # noqa: E402
from sparsemap._facet_sequence import transition_spread  # noqa: E402
from sparsemap._facet_tree import single_head_count  # noqa: E402

# the alternatives, as the family benchmarks time them (this folder is on sys.path)
from bench_facet_matching import sinkhorn_case  # noqa: E402
from bench_facet_sequence import crf_functions  # noqa: E402
from bench_facet_tree import crf_timer  # noqa: E402
from _timing import cpu_median  # noqa: E402

TAGS = 17
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")
TREEBANKS = ("UD_Vietnamese-VTB", "UD_Hungarian-Szeged")


# -- timing -----------------------------------------------------------------------------
def solve_vjp(f, eta_u, eta_v, g, method="auto"):
    """A timer of ``sm.solve`` + ``r.vjp(g)``; its result is (r, number of warnings)."""
    def run():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            r = sm.solve(f, eta_u, eta_v, method=method)
            r.vjp(g)
        return r, len(caught)
    return run


def load_torch():
    import torch
    torch.set_num_threads(1)
    return torch


# -- problems ---------------------------------------------------------------------------
def tree_problem(n, s, seed, single_root=False):
    rng = np.random.default_rng(seed)
    f = sm.TreeFactor(n, single_root=single_root)
    return f, s * rng.standard_normal((n + 1, n + 1)), None, rng.standard_normal((n + 1, n + 1))


def matching_problem(shape, s, seed):
    rng = np.random.default_rng(seed)
    return sm.MatchingFactor(*shape), s * rng.standard_normal(shape), None, \
        rng.standard_normal(shape)


def sequence_problem(n, s, seed, s_v=None):
    rng = np.random.default_rng(seed)
    eta_u = s * rng.standard_normal((n, TAGS))
    eta_v = (s if s_v is None else s_v) * rng.standard_normal((n - 1, TAGS, TAGS))
    g = rng.standard_normal((n, TAGS))
    return sm.SequenceFactor(n, TAGS), eta_u, eta_v, g / np.linalg.norm(g)


# -- the switching rule -------------------------------------------------------------------
# Trees and matchings: the peaked-score test counts the blocks (a tree's words, the
# shorter side's rows of a matching) whose sparsemax has a single nonzero, of those the
# masks leave free, and declines when single - forced >= (A + B size) (size - forced).
def tree_feature(f, eta_u, eta_v):
    single, forced = single_head_count(eta_u)
    return single, forced, f.n_words


def matching_feature(f, eta_u, eta_v):
    single, forced = single_row_count(eta_u)
    return single, forced, min(eta_u.shape)


def blocks_rule(x, params):
    a, b = params
    single, forced, blocks = x[:, 0], x[:, 1], x[:, 2]
    return (blocks > forced) & (single - forced >= (a + b * blocks) * (blocks - forced))


BLOCKS_GRID = [(round(a, 2), round(b, 4)) for a in np.arange(0.0, 1.0001, 0.01)
               for b in np.arange(0.0, 0.01001, 0.0005)]


# Sequences: the spread of the transition scores decides (u moves away from per-position
# sparsemax, the start of the facet side's path, as eta_v grows, against the scale 1 of
# u): sv and su, the pooled standard deviations of eta_v (per transition) and eta_u (per
# position) about their means, finite entries; decline when sv >= A max(su, SU_FLOOR)^B.
SU_FLOOR = 0.01


def sequence_feature(f, eta_u, eta_v):
    return transition_spread(eta_u, eta_v)[:2]


def sequence_rule(x, params):
    a, b = params
    return x[:, 0] >= a * np.maximum(x[:, 1], SU_FLOOR) ** b


SEQUENCE_GRID = [(round(float(a), 4), round(b, 2)) for a in np.geomspace(0.01, 1.0, 61)
                 for b in np.arange(0.0, 1.0001, 0.05)]

FAMILIES = {
    # name: (cases (a label and a problem maker per size), sizes, feature, rule, grid,
    #        the rule's constants as named in the solver)
    "tree": ([("multi", lambda n, s, seed: tree_problem(n, s, seed, False)),
              ("single", lambda n, s, seed: tree_problem(n, s, seed, True))],
             [20, 40, 60, 80, 100, 120], tree_feature, blocks_rule, BLOCKS_GRID,
             ("PEAKED_A", "PEAKED_B")),
    "matching": ([("square", lambda k, s, seed: matching_problem((k, k), s, seed)),
                  ("k x 5k/3", lambda k, s, seed: matching_problem((k, 5 * k // 3), s, seed))],
                 [10, 20, 30, 40, 50, 60], matching_feature, blocks_rule, BLOCKS_GRID,
                 ("PEAKED_A", "PEAKED_B")),
    "sequence": ([(f"v={rho:g}s", lambda n, s, seed, rho=rho: sequence_problem(n, s, seed,
                                                                              rho * s))
                  for rho in (1.0, 0.3, 0.1)],
                 [20, 40, 60, 80], sequence_feature, sequence_rule, SEQUENCE_GRID,
                 ("SPREAD_A", "SPREAD_B")),
}
FIT_SCALES = [0.01, 0.03, 0.1, 0.3, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]
# Below a scale where the facet side was this many times faster, the vertex side is
# not timed (it takes seconds to minutes there); its time counts as this bound.
VERTEX_SKIP = 10.0


class Row:
    __slots__ = ("case", "size", "scale", "seed", "x", "t_v", "t_f", "t_d", "side")

    def __init__(self, *values):
        for k, v in zip(self.__slots__, values):
            setattr(self, k, v)


def measure(family, seeds, repeats, scales):
    """Rows over the family's grid: features x, times of the vertex side (nan where
    skipped), the facet side and the default, and the default's side."""
    cases, sizes, feature = FAMILIES[family][:3]
    rows = []
    for label, make in cases:
        for n in sizes:
            skip = False
            for s in sorted(scales, reverse=True):
                tv, tf = [], []
                for seed in seeds:
                    f, eta_u, eta_v, g = make(n, s, seed)
                    x = feature(f, eta_u, eta_v)
                    t_f, _ = cpu_median(solve_vjp(f, eta_u, eta_v, g, "facet"), repeats)
                    t_v = np.nan
                    if not skip:
                        t_v, _ = cpu_median(solve_vjp(f, eta_u, eta_v, g, "vertex"), repeats)
                    t_d, (r, _) = cpu_median(solve_vjp(f, eta_u, eta_v, g), repeats)
                    rows.append(Row(label, n, s, seed, x, t_v, t_f, t_d, r.side))
                    tv.append(t_v)
                    tf.append(t_f)
                if not skip and np.median(tv) > VERTEX_SKIP * np.median(tf):
                    skip = True
                print(f"  {label:>8} {n:4d} {s:6g}: vertex {1e3 * np.median(tv):9.3f} ms, "
                      f"facet {1e3 * np.median(tf):9.3f} ms, default {1e3 * rows[-1].t_d:9.3f} "
                      f"({rows[-1].side}), features {np.round(x, 3).tolist()}", flush=True)
    return rows


def _times(rows):
    tv = np.array([r.t_v for r in rows])
    tf = np.array([r.t_f for r in rows])
    return np.where(np.isnan(tv), VERTEX_SKIP * tf, tv), tf   # the skipped: a lower bound


def fit_rule(family, rows):
    """The grid's constants minimising the summed log-slowdown of the side the rule
    picks against the faster one (ties: the first in the grid)."""
    rule, grid = FAMILIES[family][3:5]
    tv, tf = _times(rows)
    x = np.array([r.x for r in rows], dtype=float)
    best, cost_best = None, np.inf
    for params in grid:
        cost = np.log(np.where(rule(x, params), tv, tf) / np.minimum(tv, tf)).sum()
        if cost < cost_best - 1e-12:
            best, cost_best = params, cost
    return best


def report_check(family, rows, params):
    rule = FAMILIES[family][3]
    tv, tf = _times(rows)
    best = np.minimum(tv, tf)
    x = np.array([r.x for r in rows], dtype=float)
    picked = np.where(rule(x, params), tv, tf) / best - 1.0
    default = np.array([r.t_d for r in rows]) / best - 1.0
    print(f"  the rule's side is the slower one in {int((picked > 0).sum())} of {len(rows)} "
          f"problems; slowdown against the better side: median {100 * np.median(picked):.1f}%, "
          f"worst {100 * picked.max():.1f}%")
    print(f"  default sm.solve as timed (the compiled rule): median "
          f"{100 * np.median(default):.1f}%, worst {100 * default.max():.1f}% "
          f"(timing noise included)")
    for i in np.argsort(-picked)[:3]:
        r = rows[i]
        print(f"    rule's worst: {r.case} size {r.size} scale {r.scale:g} seed {r.seed}: "
              f"vertex {1e3 * tv[i]:.3f} ms, facet {1e3 * tf[i]:.3f} ms, default "
              f"{1e3 * r.t_d:.3f} ms ({r.side}), features {np.round(r.x, 3).tolist()}")


def crossover_table(rows):
    """Per case and size: the smallest scale of the grid where the vertex side is faster
    on the median over seeds."""
    keys = []
    for r in rows:
        if (r.case, r.size) not in keys:
            keys.append((r.case, r.size))
    print(f"  {'case':>8} {'size':>4} | {'vertex first faster at scale':>28}")
    for case, n in keys:
        sub = [r for r in rows if r.case == case and r.size == n]
        cross = "-"
        for s in sorted({r.scale for r in sub}):
            tv, tf = _times([r for r in sub if r.scale == s])
            if np.median(tv) < np.median(tf):
                cross = f"{s:g}"
                break
        print(f"  {case:>8} {n:4d} | {cross:>28}")


def run_fit(args):
    for family in args.fit:
        names = FAMILIES[family][5]
        seeds_fit = list(range(args.seeds))
        seeds_check = list(range(1000, 1000 + args.seeds))
        print(f"\n== {family}: fit on seeds {seeds_fit}, scales {FIT_SCALES}", flush=True)
        rows = measure(family, seeds_fit, args.repeats, FIT_SCALES)
        crossover_table(rows)
        params = fit_rule(family, rows)
        print(f"  fitted: {names[0]} = {params[0]:g}, {names[1]} = {params[1]:g}")
        print("  on the fitting seeds:")
        report_check(family, rows, params)
        print(f"== {family}: check on fresh seeds {seeds_check}", flush=True)
        check = measure(family, seeds_check, args.repeats, FIT_SCALES)
        report_check(family, check, params)


# -- table a: trees at flat scores ---------------------------------------------------------
def status(convs, warns):
    return f"{'yes' if all(convs) else f'{sum(convs)}/{len(convs)}':>5} {sum(warns):>5}"


def table_a(args, torch):
    crf = crf_timer(torch)
    print("\n(a) non-projective trees, eta = s randn: default solve + vjp vs the matrix-tree "
          "CRF (torch float64, logdet + gradient); bar: ratio <= 10")
    head = (f"{'root':>6} {'s':>5} {'n':>4} | {'default ms':>10} {'side':>6} {'conv':>5} "
            f"{'warn':>5} | {'CRF ms':>7} | {'ratio':>6}")
    print(head + "\n" + "-" * len(head))
    worst = 0.0
    for single_root in (False, True):
        for s in (0.01, 0.03, 0.1):
            for n in args.tree_sizes:
                td, tc, convs, warns, sides = [], [], [], [], []
                for seed in range(args.seeds):
                    f, eta, _, g = tree_problem(n, s, seed, single_root)
                    t, (r, w) = cpu_median(solve_vjp(f, eta, None, g), args.repeats)
                    td.append(t)
                    convs.append(r.converged)
                    warns.append(w)
                    sides.append(r.side)
                    et = torch.tensor(eta)
                    tc.append(cpu_median(lambda: crf(et, single_root), args.repeats)[0])
                md, mc = np.median(td), np.median(tc)
                worst = max(worst, md / mc)
                side = sides[0] if len(set(sides)) == 1 else "mixed"
                print(f"{'single' if single_root else 'multi':>6} {s:5g} {n:4d} | "
                      f"{1e3 * md:10.3f} {side:>6} {status(convs, warns)} | {1e3 * mc:7.3f} | "
                      f"{md / mc:6.2f}", flush=True)
    print(f"worst ratio {worst:.2f} (bar 10)")


# -- table b: peaked scales, default vs vertex ------------------------------------------------
def table_b(args, torch):
    print("\n(b) scales 1 and 5: default solve + vjp vs method='vertex' (the active set "
          "alone); bar: ratio <= 1.10")
    head = (f"{'family':>16} {'size':>6} {'s':>3} | {'default ms':>10} {'sides':>10} | "
            f"{'vertex ms':>10} | {'ratio':>6}")
    print(head + "\n" + "-" * len(head))
    cases = []
    for n in args.tree_sizes_b:
        cases.append(("tree multi", str(n), lambda s, seed, n=n: tree_problem(n, s, seed, False)))
        cases.append(("tree single", str(n), lambda s, seed, n=n: tree_problem(n, s, seed, True)))
    for n in args.seq_sizes_b:
        cases.append(("sequence x17", str(n), lambda s, seed, n=n: sequence_problem(n, s, seed)))
    for shape in args.match_shapes_b:
        cases.append(("matching", f"{shape[0]}x{shape[1]}",
                      lambda s, seed, shape=shape: matching_problem(shape, s, seed)))
    worst = 0.0
    for name, size, make in cases:
        for s in (1.0, 5.0):
            td, tv, sides = [], [], []
            for seed in range(args.seeds):
                f, eta_u, eta_v, g = make(s, seed)
                # interleaved, so that drifts of the machine hit both alike; small
                # problems (0.05-0.3 ms) run until 0.2 s is spent, at most 400 times: a few
                # runs of them move by 20% on a shared machine, more than the bar allows
                a, b = [], []
                while len(a) < args.repeats or (sum(a) + sum(b) < args.b_budget
                                                and len(a) < 400):
                    a.append(cpu_median(solve_vjp(f, eta_u, eta_v, g), 1)[0])
                    b.append(cpu_median(solve_vjp(f, eta_u, eta_v, g, "vertex"), 1)[0])
                r, _ = solve_vjp(f, eta_u, eta_v, g)()
                td.append(np.median(a))
                tv.append(np.median(b))
                sides.append(r.side[0])
            md, mv = np.median(td), np.median(tv)
            worst = max(worst, md / mv)
            n_f = sides.count("f")
            sides = f"{n_f}f/{len(sides) - n_f}v"
            print(f"{name:>16} {size:>6} {s:3g} | {1e3 * md:10.3f} {sides:>10} | "
                  f"{1e3 * mv:10.3f} | {md / mv:6.3f}", flush=True)
    print(f"worst ratio {worst:.3f} (bar 1.10)")


# -- table c: a sequence at flat unary scores -----------------------------------------------
def ratio(a, b):
    """a / b in a 6-wide column ('-' when b is 0: every sampled difference was 0)."""
    return f"{a / b:6.2f}" if b > 0 else f"{'-':>6}"


def fd_norm(f, eta_u, eta_v, g, u, n_sample, eps, rng):
    """The norm of one-sided differences g . (u(eta_v + eps e_j) - u) / eps over all j,
    estimated from a random sample of coordinates j (default solves)."""
    diffs = []
    for j in rng.choice(eta_v.size, n_sample, replace=False):
        e = np.zeros(eta_v.size)
        e[j] = eps
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r2 = sm.solve(f, eta_u, eta_v + e.reshape(eta_v.shape))
        diffs.append(float(((r2.u - u) * g).sum()) / eps)
    return float(np.sqrt(np.mean(np.square(diffs)) * eta_v.size))


def table_c(args, torch):
    crf = crf_functions()[0]          # log-partition and its gradient
    n = 60
    print(f"\n(c) sequence {n} x {TAGS}, eta_u = 0.1 randn: default solve + vjp vs the forward-"
          "algorithm CRF (torch float64, log-partition + gradient); bars: ratio <= 10, "
          "|g_v| / |fd| within 10x")
    head = (f"{'eta_v':>12} | {'default ms':>10} {'side':>6} {'conv':>5} {'warn':>5} | "
            f"{'CRF ms':>7} | {'ratio':>6} | {'|g_v|':>8} {'|fd| eps=1e-6':>13} "
            f"{'ratio':>6} {'|fd| eps=1e-4':>13} {'ratio':>6}")
    print(head + "\n" + "-" * len(head))
    for label, s_v in (("0", 0.0), ("1e-6 randn", 1e-6), ("1e-3 randn", 1e-3)):
        td, tc, convs, warns, sides, gv, fds = [], [], [], [], [], [], []
        for seed in range(args.seeds):
            f, eta_u, eta_v, g = sequence_problem(n, 0.1, seed, s_v)
            t, (r, w) = cpu_median(solve_vjp(f, eta_u, eta_v, g), args.repeats)
            td.append(t)
            convs.append(r.converged)
            warns.append(w)
            sides.append(r.side)
            tc.append(cpu_median(lambda: crf(eta_u, eta_v, g), args.repeats)[0])
            if seed == 0:
                gv = np.linalg.norm(r.vjp(g)[1])
                rng = np.random.default_rng(7)
                fds = [fd_norm(f, eta_u, eta_v, g, r.u, args.fd_sample, eps, rng)
                       for eps in (1e-6, 1e-4)]
        md, mc = np.median(td), np.median(tc)
        side = sides[0] if len(set(sides)) == 1 else "mixed"
        print(f"{label:>12} | {1e3 * md:10.3f} {side:>6} {status(convs, warns)} | "
              f"{1e3 * mc:7.3f} | {md / mc:6.2f} | {gv:8.3g} {fds[0]:13.3g} {ratio(gv, fds[0])} "
              f"{fds[1]:13.3g} {ratio(gv, fds[1])}", flush=True)


# -- table d: matchings at flat scores ----------------------------------------------------------
def table_d(args, torch):
    print("\n(d) matchings at flat scores: default solve + vjp vs the vertex side vs "
          "Sinkhorn to 1e-9 (torch float64, forward + backward)")
    head = (f"{'shape':>6} {'s':>5} | {'default ms':>10} {'side':>6} {'conv':>5} {'warn':>5} | "
            f"{'vertex ms':>10} | {'Sinkhorn ms':>11} {'iters':>6} | {'vertex/def':>10} "
            f"{'Sinkhorn/def':>12}")
    print(head + "\n" + "-" * len(head))
    for shape in ((40, 40), (30, 50)):
        for s in (0.01, 0.1):
            td, tv, ts, its, convs, warns, sides = [], [], [], [], [], [], []
            for seed in range(args.seeds):
                f, eta, _, g = matching_problem(shape, s, seed)
                t, (r, w) = cpu_median(solve_vjp(f, eta, None, g), args.repeats)
                td.append(t)
                convs.append(r.converged)
                warns.append(w)
                sides.append(r.side)
                tv.append(cpu_median(solve_vjp(f, eta, None, g, "vertex"), args.repeats)[0])
                t, it = cpu_median(sinkhorn_case(eta, g, torch), max(1, args.repeats // 2))
                ts.append(t)
                its.append(it)
            md, mv, ms = np.median(td), np.median(tv), np.median(ts)
            side = sides[0] if len(set(sides)) == 1 else "mixed"
            it = f">{-min(its)}" if min(its) < 0 else f"{np.median(its):.0f}"
            print(f"{shape[0]}x{shape[1]:<3} {s:5g} | {1e3 * md:10.3f} {side:>6} "
                  f"{status(convs, warns)} | {1e3 * mv:10.3f} | {1e3 * ms:11.3f} {it:>6} | "
                  f"{mv / md:10.1f} {ms / md:12.1f}", flush=True)


# -- table e: the torch layer at a fresh initialisation ------------------------------------------
def read_conllu(path, max_words):
    """(words, upos) per sentence (multiword tokens and empty nodes skipped), those of at
    most max_words words, in file order."""
    sentences, words, tags = [], [], []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.rstrip("\n")
            if not line:
                if words and len(words) <= max_words:
                    sentences.append((words, tags))
                words, tags = [], []
            elif not line.startswith("#"):
                cols = line.split("\t")
                if cols[0].isdigit():
                    words.append(cols[1].lower())
                    tags.append(cols[3])
    if words and len(words) <= max_words:
        sentences.append((words, tags))
    return sentences


def arc_scorer(torch, n_words, n_tags):
    """Embeddings, a one-layer BiLSTM and a biaffine arc scorer, PyTorch's default init."""
    nn = torch.nn

    class Scorer(nn.Module):
        def __init__(self):
            super().__init__()
            self.word = nn.Embedding(n_words, 100)
            self.tag = nn.Embedding(n_tags, 25)
            self.lstm = nn.LSTM(125, 125, 1, batch_first=True, bidirectional=True)
            self.head = nn.Linear(250, 100)
            self.mod = nn.Linear(250, 100)
            self.biaffine = nn.Bilinear(100, 100, 1)
            self.root_bias = nn.Linear(100, 1)

        def forward(self, words, tags):
            h, _ = self.lstm(torch.cat([self.word(words), self.tag(tags)], -1))
            hh, hm = torch.relu(self.head(h)), torch.relu(self.mod(h))
            w = self.biaffine.weight[0]
            s = torch.einsum("bhi,ij,bmj->bhm", hh, w, hm) + self.biaffine.bias
            return s + self.root_bias(hh)      # a head's own bias

    return Scorer()


def batch_crf(torch):
    def crf(scores, lengths):
        """Summed log-partition of the multi-root arborescences of a padded batch (matrix-
        tree theorem) and its gradient."""
        scores = scores.detach().requires_grad_(True)
        B, n1, _ = scores.shape
        idx = torch.arange(n1)
        valid_m = (idx[None, :] >= 1) & (idx[None, :] <= lengths[:, None])
        valid_h = idx[None, :] <= lengths[:, None]
        arc = valid_h[:, :, None] & valid_m[:, None, :] & (idx[:, None] != idx[None, :])
        s = scores.masked_fill(~arc, float("-inf"))
        top = s.max(dim=1, keepdim=True).values
        s = s - torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
        w = torch.exp(s)
        A = w[:, 1:, 1:]
        lap = torch.diag_embed(w[:, 0, 1:] + A.sum(dim=1)) - A
        lap = lap + torch.diag_embed((~valid_m[:, 1:]).to(lap.dtype))
        torch.logdet(lap).sum().backward()
        return scores.grad
    return crf


def table_e(args, torch):
    import sparsemap.torch as smt
    crf = batch_crf(torch)
    print(f"\n(e) the torch layer at init (PyTorch's default initialisation), batches of 16 "
          f"dev sentences (<= 96 words): smt.tree forward + backward vs the matrix-tree CRF "
          f"(float64, logdet + gradient) on the same scores; bar: ratio <= 10")
    head = (f"{'treebank':>22} {'batches':>7} {'spread':>6} | {'smt.tree ms':>11} {'worst':>8} | "
            f"{'CRF ms':>7} {'worst':>7} | {'ratio':>6} {'worst':>6} | {'conv':>5} {'warn':>5}")
    print(head + "\n" + "-" * len(head))
    for tb in TREEBANKS:
        folder = os.path.join(args.data, tb)
        dev = [os.path.join(folder, x) for x in os.listdir(folder) if x.endswith("-dev.conllu")][0]
        sents = read_conllu(dev, 96)
        vocab = {w: i + 1 for i, w in enumerate(sorted({w for ws, _ in sents for w in ws}))}
        tagset = {t: i + 1 for i, t in enumerate(sorted({t for _, ts in sents for t in ts}))}
        torch.manual_seed(0)
        model = arc_scorer(torch, len(vocab) + 1, len(tagset) + 1).double()
        batches = [sents[i:i + 16] for i in range(0, len(sents) - 15, 16)][:args.batches]
        tl, tc, ratios, spreads, convs, warns = [], [], [], [], [], []
        for batch in batches:
            lengths = torch.tensor([len(ws) for ws, _ in batch])
            n1 = int(lengths.max()) + 1
            words = torch.zeros(len(batch), n1, dtype=torch.long)
            tags = torch.zeros(len(batch), n1, dtype=torch.long)
            for b, (ws, ts) in enumerate(batch):
                words[b, 1:len(ws) + 1] = torch.tensor([vocab[w] for w in ws])
                tags[b, 1:len(ts) + 1] = torch.tensor([tagset[t] for t in ts])
            with torch.no_grad():
                scores = model(words, tags)
            for b, n in enumerate(lengths.tolist()):
                blk = scores[b, :n + 1, 1:n + 1].clone()
                blk[torch.arange(1, n + 1), torch.arange(n)] = float("nan")   # h == m
                spreads.append(float(np.nanstd(blk.numpy())))
            g = torch.randn(scores.shape, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(1))

            def layer():
                x = scores.clone().requires_grad_(True)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    u = smt.tree(x, lengths)
                    (u * g).sum().backward()
                return len(caught)
            t_l, w = cpu_median(layer, args.repeats)
            t_c, _ = cpu_median(lambda: crf(scores, lengths), args.repeats)
            tl.append(t_l)
            tc.append(t_c)
            ratios.append(t_l / t_c)
            warns.append(w)
            # converged: the same problems through sm.solve (smt.tree warns otherwise)
            convs.append(w == 0)
        print(f"{tb:>22} {len(batches):7d} {np.median(spreads):6.3f} | {1e3 * np.median(tl):11.2f} "
              f"{1e3 * max(tl):8.2f} | {1e3 * np.median(tc):7.2f} {1e3 * max(tc):7.2f} | "
              f"{np.median(ratios):6.2f} {max(ratios):6.2f} | {status(convs, warns)}", flush=True)
    print("(spread: median over sentences of the arc scores' standard deviation at init; "
          "ratio: per batch)")


TABLES = {"a": table_a, "b": table_b, "c": table_c, "d": table_d, "e": table_e}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", nargs="+", default=sorted(TABLES), choices=sorted(TABLES))
    ap.add_argument("--fit", nargs="+", choices=sorted(FAMILIES),
                    help="measure and fit the switching rule instead of the tables")
    ap.add_argument("--quick", action="store_true",
                    help="fewer sizes, seeds, runs and batches (about a minute)")
    ap.add_argument("--seeds", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--data", default=DATA, help="the folder holding the UD treebanks")
    args = ap.parse_args()
    quick = args.quick
    if args.seeds is None:
        args.seeds = 2 if quick else (3 if args.fit else 5)
    if args.repeats is None:
        args.repeats = 2 if quick else 5
    args.tree_sizes = [20, 60, 120] if quick else [20, 40, 60, 80, 100, 120]
    args.tree_sizes_b = [20, 120] if quick else [20, 60, 120]
    args.seq_sizes_b = [20] if quick else [20, 60]
    args.match_shapes_b = [(20, 20), (30, 50)] if quick else [(20, 20), (40, 40), (30, 50)]
    args.fd_sample = 10 if quick else 40
    args.b_budget = 0.02 if quick else 0.2
    args.batches = 3 if quick else 10**6
    print(f"CPU time (process), median of {args.repeats} runs per seed, then over "
          f"{args.seeds} seeds; torch on one thread, OPENBLAS_NUM_THREADS="
          f"{os.environ.get('OPENBLAS_NUM_THREADS')}")
    if args.fit:
        global FIT_SCALES
        if quick:
            FIT_SCALES = [0.01, 0.3, 1.0, 3.0, 10.0]
            for fam in FAMILIES.values():
                fam[1][:] = fam[1][::3]
        run_fit(args)
        return
    torch = load_torch()
    for t in args.tables:
        TABLES[t](args, torch)


if __name__ == "__main__":
    main()
