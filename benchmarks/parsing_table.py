"""Table 1 of the paper and Figure 4, rerun with examples/parsing.py on any UD treebank.

Trains the parser of ``examples/parsing.py`` with each of the four losses and the
same seeds and settings on a treebank's full training set and on smaller training
sets cut from it (the same dev and test sets; dev sparsity not measured there):
its first ``--subset`` sentences, and its ``--longest`` longest ones. Then writes

* ``DOCS/parsing_results_TAG.inc``: the test UAS tables of every training set
  (mean and spread over the seeds, each seed, the spread between the losses, the
  paper's figure where Table 1 has the treebank), the training-epoch times, the
  dev sparsity at the first and the selected epoch, and any warning the runs'
  guard raised; included by ``docs/parsing.rst``;
* ``DOCS/figures/parsing_sparsity_TAG.png``: the SparseMAP support on the dev set
  over training (mean trees per sentence, mean heads per word), as in Figure 4;
* ``OUT/summary.json``: the same numbers.

``TAG`` is the treebank's language code (``vi``, ``hu``: the prefix of its file
names) unless ``--tag`` says otherwise.

Each run of ``examples/parsing.py`` imports this repository's ``sparsemap`` (built
in place) and writes ``OUT/LOSS-seedS/`` (``OUT/subN-...`` and ``OUT/longN-...`` for
the smaller sets) with its ``results.json``, its log, and ``run.json``: the command,
the package used and hashes of ``examples/parsing.py`` and of the data files. A run
whose ``run.json`` matches is reused (``--force`` reruns it), so an interrupted or
repeated table redoes only the runs it lacks, and a change to the example or its
options reruns them all. ``--no-run`` trains nothing: it writes the tables of the runs
already done (the seeds that every loss has finished) and names the runs still
missing, for a table read while another call is still training. Runs go one after the
other unless ``--jobs`` > 1; wall times are comparable only between runs made under the
same load (each epoch also records its CPU time, which other jobs disturb less).

Usage::

    python benchmarks/parsing_table.py --data /path/to/UD_Vietnamese-VTB \\
        [--epochs 15] [--seeds 0 1 2] [--subset 500] [--longest 500] [--tag vi] \\
        [--out out/parsing/vi] [--docs docs] [--threads 1] [--jobs 1] [--force] \\
        [--no-run] [-- extra options for parsing.py]
"""
import argparse
import glob
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "parsing.py")
# The runs import this repository's sparsemap (built in place), not whichever one the
# interpreter would find from examples/ (another clone's, installed elsewhere).
PACKAGE = os.path.join(ROOT, "sparsemap")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
LOSSES = ("svm", "crf", "sparsemap", "margin_sparsemap")
NAMES = {"svm": "Structured SVM", "crf": "CRF", "sparsemap": "SparseMAP",
         "margin_sparsemap": "m-SparseMAP"}
# Table 1 of the paper, by treebank tag: column "vi" (UD 2.0 Vietnamese), and the
# UDPipe baseline of that column.
PAPER = {"vi": {"svm": 69.42, "crf": 69.10, "sparsemap": 69.71, "margin_sparsemap": 70.87}}
PAPER_UDPIPE = {"vi": 69.63}


def treebank_files(data):
    """The train, dev and test CoNLL-U files of a UD treebank folder."""
    found = []
    for split in ("train", "dev", "test"):
        matches = sorted(glob.glob(os.path.join(data, f"*-{split}.conllu")))
        if len(matches) != 1:
            raise ValueError(f"--data: expected one *-{split}.conllu in {data!r}, "
                             f"found {len(matches)}")
        found.append(matches[0])
    return found


def read_blocks(path):
    """The sentences of a CoNLL-U file, as text blocks."""
    with open(path, encoding="utf-8") as f:
        return [b.strip("\n") for b in f.read().split("\n\n") if b.strip()]


def n_words(block):
    """Words of a CoNLL-U sentence block (multiword-token lines and empty nodes aside)."""
    return sum(1 for line in block.split("\n")
               if line and not line.startswith("#") and line.split("\t", 1)[0].isdigit())


def smaller_set(train, kind, n, out):
    """A training set cut from ``train``: its first ``n`` sentences (``kind="sub"``)
    or its ``n`` longest ones, in file order (``kind="long"``; ties: the earlier
    first). Written to ``out/KINDn/train.conllu``; returns the path."""
    blocks = read_blocks(train)
    if len(blocks) < n:
        raise ValueError(f"--{'subset' if kind == 'sub' else 'longest'}: the training set "
                         f"has {len(blocks)} sentences, fewer than {n}")
    if kind == "sub":
        keep = blocks[:n]
    else:
        order = sorted(range(len(blocks)), key=lambda i: (-n_words(blocks[i]), i))
        keep = [blocks[i] for i in sorted(order[:n])]
    path = os.path.join(out, f"{kind}{n}", "train.conllu")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(keep) + "\n\n")
    return path


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run_one(files, loss, seed, args, extra, prefix=""):
    """Train one run (or reuse it when its run.json matches); its results.json (None
    with ``--no-run`` when it has none)."""
    name = f"{prefix}{loss}-seed{seed}"
    out = os.path.join(args.out, name)
    path, stamp_path = os.path.join(out, "results.json"), os.path.join(out, "run.json")
    train, dev, test = files
    cmd = ["--train", train, "--dev", dev, "--test", test, "--loss", loss,
           "--epochs", str(args.epochs), "--out", out, "--seed", str(seed),
           "--threads", str(args.threads)] + extra + (["--no-sparsity"] if prefix else [])
    stamp = {"args": cmd, "script_sha256": sha256(SCRIPT),
             "data_sha256": [sha256(p) for p in files], "sparsemap": PACKAGE}
    reuse = False
    if os.path.exists(path) and os.path.exists(stamp_path) and not args.force:
        with open(stamp_path) as f:
            reuse = json.load(f) == stamp
    if reuse:
        print(f"{name}: reusing {path}", flush=True)
    elif args.no_run:
        print(f"{name}: not run yet", flush=True)
        return None
    else:
        os.makedirs(out, exist_ok=True)
        for stale in (path, stamp_path):
            if os.path.exists(stale):
                os.remove(stale)
        start = time.perf_counter()
        with open(os.path.join(out, "log.txt"), "w") as log:
            # faulthandler: a crash leaves its Python traceback in the log
            subprocess.run([sys.executable, "-X", "faulthandler", SCRIPT] + cmd, stdout=log,
                           stderr=subprocess.STDOUT, check=True, env=ENV)
        with open(stamp_path, "w") as f:
            json.dump(stamp, f, indent=1)
        print(f"{name}: done in {time.perf_counter() - start:.0f} s", flush=True)
    with open(path) as f:
        return json.load(f)


def schedule(results):
    """How the runs trained, as text: "15 epochs; batches of 32 sentences", saying
    when ``--min-updates`` raised the epoch count (values that differ are listed)."""
    text = lambda values: ", ".join(str(v) for v in sorted(values))  # noqa: E731
    ran = {len(r["epochs"]) for r in results.values()}
    asked = {r["settings"]["epochs"] for r in results.values()}
    floor = {r["settings"].get("min_updates") for r in results.values()}
    sizes = {r["settings"].get("batch_size") for r in results.values()}
    raised = (f" (``--epochs {text(asked)}``, raised to make at least {text(floor)} "
              "updates)" if ran != asked else "")
    return f"{text(ran)} epochs{raised}; batches of {text(sizes)} sentences"


def spread(values):
    return statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(results, seeds, paper):
    """:func:`subset_summary`, with the paper's figure, the median epoch wall time and
    the dev sparsity at the first and the selected epoch (the full set's table)."""
    summary = subset_summary(results, seeds)
    for loss, s in summary.items():
        runs = [results[loss, seed] for seed in seeds]
        first = [r["epochs"][0] for r in runs]
        best = [r["epochs"][r["best_epoch"] - 1] for r in runs]
        s.update({
            "paper": paper.get(loss),
            "median_epoch_seconds": statistics.median(
                e["seconds"] for r in runs for e in r["epochs"]),
            "trees_first": statistics.mean(e["mean_trees"] for e in first),
            "trees_best": statistics.mean(e["mean_trees"] for e in best),
            "heads_first": statistics.mean(e["mean_heads_per_word"] for e in first),
            "heads_best": statistics.mean(e["mean_heads_per_word"] for e in best),
        })
    return summary


def warning_counts(runs):
    """How many runs the guard of examples/parsing.py warned about, by kind."""
    counts = {}
    for r in runs:
        for kind in sorted({w["kind"] for w in r.get("warnings", [])}):
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def warnings_text(summary):
    """A sentence on the guard's warnings over the runs of a table ("" when none)."""
    parts = [f"{NAMES[loss]}: {n} run{'s' if n > 1 else ''} with {kind.replace('_', ' ')}"
             for loss, s in summary.items() for kind, n in s["warnings"].items()]
    if not parts:
        return "The guard of ``parsing.py`` raised no warning in these runs."
    return "The guard of ``parsing.py`` warned: " + "; ".join(parts) + "."


def subset_summary(results, seeds):
    """Per loss: test UAS per seed, their mean and standard deviation, best epochs, dev
    UAS, median epoch CPU time and the guard's warnings (a smaller set's table)."""
    out = {}
    for loss in LOSSES:
        runs = [results[loss, s] for s in seeds]
        uas = [r["test_uas"] for r in runs]
        out[loss] = {"test_uas": uas, "mean": statistics.mean(uas), "std": spread(uas),
                     "best_epochs": [r["best_epoch"] for r in runs],
                     "dev_uas": [r["dev_uas"] for r in runs],
                     "median_epoch_cpu_seconds": statistics.median(
                         e["cpu_seconds"] for r in runs for e in r["epochs"]),
                     "warnings": warning_counts(runs)}
    return out


def seed_list(seeds):
    """``seed 0`` or ``seeds 0, 1, 2``."""
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, seeds))


def mean_sd(s, seeds):
    """``mean ± sd`` over the seeds (the mean alone for one seed)."""
    return f"{s['mean']:.2f}" + (f" ± {s['std']:.2f}" if len(seeds) > 1 else "")


def loss_spread(summary):
    """Largest difference between the losses' mean test UAS."""
    means = [summary[loss]["mean"] for loss in LOSSES]
    return max(means) - min(means)


def seed_spread(summary):
    """Largest difference between the losses' test UAS with the same seed."""
    per_seed = zip(*(summary[loss]["test_uas"] for loss in LOSSES))
    return max(max(u) - min(u) for u in per_seed)


def rst_table(header, rows):
    cols = list(zip(header, *rows))
    widths = [max(len(c) for c in col) for col in cols]
    rule = "  ".join("=" * w for w in widths)
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([rule, line(header), rule] + [line(r) for r in rows] + [rule])


def results_rst(summary, seeds, args, settings, training, tag, treebank):
    crf_time = summary["crf"]["median_epoch_seconds"]
    crf_cpu = summary["crf"]["median_epoch_cpu_seconds"]
    paper = tag in PAPER
    uas_rows, time_rows = [], []
    for loss in LOSSES:
        s = summary[loss]
        row = [NAMES[loss], mean_sd(s, seeds), ", ".join(f"{u:.2f}" for u in s["test_uas"])]
        if paper:
            row += [f"{s['paper']:.2f}", f"{s['mean'] - s['paper']:+.2f}"]
        uas_rows.append(row + [", ".join(str(b) for b in s["best_epochs"])])
        fmt = (lambda x: f"{x:.2g}") if loss == "crf" else (lambda x: f"{x:.2f}")
        time_rows.append([NAMES[loss], f"{s['median_epoch_seconds']:.1f}",
                          f"{s['median_epoch_seconds'] / crf_time:.2f}",
                          f"{s['median_epoch_cpu_seconds']:.1f}",
                          f"{s['median_epoch_cpu_seconds'] / crf_cpu:.2f}",
                          f"{fmt(s['trees_first'])} → {fmt(s['trees_best'])}",
                          f"{s['heads_first']:.2f} → {s['heads_best']:.2f}"])
    blank = [""] * (3 if paper else 1)
    if paper:
        uas_rows.append(["UDPipe baseline (paper)", "", "", f"{PAPER_UDPIPE[tag]:.2f}", "",
                         ""])
    uas_rows.append(["spread between the losses' means", f"{loss_spread(summary):.2f}", ""]
                    + blank)
    uas_rows.append(["largest spread with one seed", f"{seed_spread(summary):.2f}", ""]
                    + blank)
    header = ["loss", "test UAS", "per seed"] + (["paper", "difference"] if paper else []) \
        + ["best epochs"]
    opts = " ".join(settings)
    return "\n".join([
        f"{treebank}, the full training set. Test UAS (percent, punctuation included) "
        f"with the dev-best epoch, over {seed_list(seeds)}; "
        f"{training}; ``parsing.py`` options: "
        f"``--threads {args.threads}{(' ' + opts) if opts else ''}`` (defaults otherwise). "
        "Mean ± sample standard deviation over the seeds"
        + ("; \"paper\" is Table 1's column for this treebank (UD 2.0)." if paper else ".")
        + " " + warnings_text(summary),
        "",
        rst_table(header, uas_rows),
        "",
        "Median wall time and CPU time of a training epoch (forward, loss, backward and "
        "update over the training sentences; dev evaluation excluded), over every epoch "
        "of every seed, with their ratios to the CRF's. The wall times depend on what "
        "else ran on the machine during the runs; the CPU time counts a run's own work, "
        "the steadier figure. Dev sparsity: mean trees per sentence and heads per word "
        "at the first epoch → at the selected epoch, averaged over the seeds (the CRF's "
        "are the dense counts, every tree and every head; the SVM predicts one tree).",
        "",
        rst_table(["loss", "wall s / epoch", "ratio", "CPU s / epoch", "ratio",
                   "trees / sentence (dev)",
                   "heads / word (dev)"], time_rows),
        "",
    ])


SMALL = {"sub": "its first {n} training sentences", "long": "its {n} longest training "
         "sentences"}


def smaller_rst(sub, kind, n, words, seeds, args, training, treebank):
    rows = [[NAMES[loss], mean_sd(s, seeds),
             ", ".join(f"{u:.2f}" for u in s["test_uas"]),
             ", ".join(str(b) for b in s["best_epochs"]),
             f"{s['median_epoch_cpu_seconds']:.1f}"]
            for loss, s in sub.items()]
    rows.append(["spread between the losses' means", f"{loss_spread(sub):.2f}", "", "", ""])
    rows.append(["largest spread with one seed", f"{seed_spread(sub):.2f}", "", "", ""])
    return "\n".join([
        f"{treebank}, {SMALL[kind].format(n=n)} only ({words:.1f} words on average; the "
        f"same dev and test sets, the same options), over {seed_list(seeds)}; "
        f"{training}. Test UAS, mean ± sample standard deviation over the seeds, and the "
        "median CPU time of a training epoch. " + warnings_text(sub),
        "",
        rst_table(["loss", "test UAS", "per seed", "best epochs", "CPU s / epoch"], rows),
        "",
    ])


def missing_text(everything, kind, all_seeds, seeds):
    """A sentence naming the runs a table lacks (``--no-run``), or ""."""
    missing = [f"{NAMES[loss]} seed {s}" for s in all_seeds for loss in LOSSES
               if everything[kind, loss, s] is None]
    if not missing:
        return "\n"
    return (f"\n{seed_list(seeds).capitalize()} only: not run yet when this table was written: "
            f"{', '.join(missing)}.\n\n")


def sparsity_figure(results, seeds, path):
    """Figure 4 for the SparseMAP losses (the CRF's dense counts would flatten them;
    the SVM predicts one tree)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import sparsemap.plot as smp

    losses = ("sparsemap", "margin_sparsemap")
    runs = {NAMES[loss]: [results[loss, s] for s in seeds] for loss in losses}
    fig = smp.sparsity_over_training(runs, yscale={"mean_trees": "log",
                                                   "mean_heads_per_word": "linear"})
    fig.axes[0].set_ylabel("trees in the support\n(dev mean per sentence)")
    fig.axes[1].set_ylabel("heads with nonzero\nprobability per word (dev)")
    fig.axes[0].set_title(f"SparseMAP support on dev (mean and range over "
                          f"{len(seeds)} seeds)", fontsize="medium")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        k = argv.index("--")
        argv, extra = argv[:k], argv[k + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="UD treebank folder with train/dev/test")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--subset", type=int, default=500,
                   help="also train on the first SUBSET training sentences (0: not)")
    p.add_argument("--longest", type=int, default=0,
                   help="also train on the LONGEST longest training sentences (0: not)")
    p.add_argument("--tag", default=None,
                   help="names the docs files (default: the treebank's language code)")
    p.add_argument("--out", default=None, help="runs' folder (default: out/parsing/TAG)")
    p.add_argument("--docs", default=os.path.join(ROOT, "docs"))
    p.add_argument("--threads", type=int, default=1, help="threads of each run")
    p.add_argument("--jobs", type=int, default=1, help="runs at the same time")
    p.add_argument("--force", action="store_true", help="rerun runs that have results")
    p.add_argument("--no-run", action="store_true",
                   help="train nothing: tables of the runs done, the missing ones named")
    args = p.parse_args(argv)
    if args.force and args.no_run:
        p.error("--force and --no-run: expected one of them, got both")
    files = treebank_files(args.data)
    tag = args.tag or os.path.basename(files[0]).split("_")[0].split("-")[0]
    args.out = args.out or os.path.join(ROOT, "out", "parsing", tag)
    treebank = os.path.basename(os.path.normpath(args.data)).replace("_", " ")
    sets = [("", 0, files)]
    for kind, n in (("sub", args.subset), ("long", args.longest)):
        if n:
            sets.append((kind, n, [smaller_set(files[0], kind, n, args.out)] + files[1:]))

    # the long runs first, so that the short ones fill the gaps at the end
    jobs = [(kind, n, fs, loss, seed) for kind, n, fs in sets
            for seed in args.seeds for loss in LOSSES]
    with ThreadPoolExecutor(max_workers=args.jobs) as ex:
        done = ex.map(lambda job: run_one(job[2], job[3], job[4], args, extra,
                                          f"{job[0]}{job[1]}-" if job[0] else ""), jobs)
        everything = {(kind, loss, seed): r
                      for (kind, n, fs, loss, seed), r in zip(jobs, done)}
    record = {"treebank": treebank, "epochs": args.epochs, "seeds": args.seeds,
              "options": extra}
    text = f".. Generated by benchmarks/parsing_table.py on {time.strftime('%Y-%m-%d')}; " \
        "do not edit by hand.\n\n"
    figure = None
    for kind, n, fs in sets:
        runs = {(loss, seed): r for (k, loss, seed), r in everything.items() if k == kind}
        seeds = [s for s in args.seeds if all(runs[loss, s] is not None for loss in LOSSES)]
        runs = {key: r for key, r in runs.items() if key[1] in seeds}
        label = f"{treebank}, " + (SMALL[kind].format(n=n) if kind else "the full training set")
        if not seeds:
            text += f"{label}: not run yet.\n\n"
            continue
        if not kind:
            summary = summarize(runs, seeds, PAPER.get(tag, {}))
            record["losses"] = summary
            text += results_rst(summary, seeds, args, extra, schedule(runs), tag, treebank)
            figure = runs, seeds
        else:
            sub = subset_summary(runs, seeds)
            blocks = read_blocks(fs[0])
            words = statistics.mean(n_words(b) for b in blocks)
            record[f"{kind}{n}"] = {"sentences": n, "mean_words": words, "losses": sub}
            text += smaller_rst(sub, kind, n, words, seeds, args, schedule(runs), treebank)
        text += missing_text(everything, kind, args.seeds, seeds)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(record, f, indent=1)
    with open(os.path.join(args.docs, f"parsing_results_{tag}.inc"), "w") as f:
        f.write(text)
    if figure is not None:
        sparsity_figure(*figure, os.path.join(args.docs, "figures",
                                              f"parsing_sparsity_{tag}.png"))
    print(text)


if __name__ == "__main__":
    main()
