"""Table 1 (Vietnamese column) and Figure 4 of the paper, rerun with examples/parsing.py.

Trains the parser of ``examples/parsing.py`` with each of the four losses and the
same seeds and settings, on the full training set and on its first ``--subset``
sentences (a small treebank: same dev and test sets, dev sparsity not measured),
then writes

* ``DOCS/parsing_results.inc``: the test UAS tables of both training sizes (mean
  and spread over the seeds, each seed, the paper's figure for the full set, the
  spread between the losses), the training-epoch times and the dev sparsity at
  the first and the selected epoch, included by ``docs/parsing.rst``;
* ``DOCS/figures/parsing_sparsity.png``: the SparseMAP support on the dev set over
  training (mean trees per sentence, mean heads per word), as in Figure 4;
* ``OUT/summary.json``: the same numbers.

Each run writes ``OUT/LOSS-seedS/results.json`` (``OUT/subN-LOSS-seedS/`` on the
subset) and is skipped when that file
exists (delete it, or pass ``--force``, to rerun), so an interrupted table
resumes where it stopped. Runs go one after the other unless ``--jobs`` > 1;
wall times are comparable only between runs made under the same load (each epoch also
records its CPU time, which other jobs disturb less).

Usage::

    python benchmarks/parsing_table.py --data /path/to/UD_Vietnamese-VTB \\
        [--epochs 15] [--seeds 0 1 2] [--subset 500] [--subset-seeds 0 1 2] \\
        [--out out/parsing] [--docs docs] [--threads 1] [--jobs 1] [--force] \\
        [-- extra options for parsing.py]
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "parsing.py")
LOSSES = ("svm", "crf", "sparsemap", "margin_sparsemap")
NAMES = {"svm": "Structured SVM", "crf": "CRF", "sparsemap": "SparseMAP",
         "margin_sparsemap": "m-SparseMAP"}
# Table 1 of the paper, column "vi" (UD 2.0 Vietnamese), and its UDPipe baseline.
PAPER = {"svm": 69.42, "crf": 69.10, "sparsemap": 69.71, "margin_sparsemap": 70.87}
PAPER_UDPIPE = 69.63


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


def subset_file(train, n, out):
    """The first n sentences of the CoNLL-U file train, written to out/subN/train.conllu."""
    path = os.path.join(out, f"sub{n}", "train.conllu")
    with open(train, encoding="utf-8") as f:
        blocks = [b for b in f.read().split("\n\n") if b.strip()]
    if len(blocks) < n:
        raise ValueError(f"--subset: the training set has {len(blocks)} sentences, fewer "
                         f"than {n}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(b.strip("\n") for b in blocks[:n]) + "\n\n")
    return path


def run_one(files, loss, seed, args, extra, subset=0):
    name = f"{loss}-seed{seed}" if not subset else f"sub{subset}-{loss}-seed{seed}"
    out = os.path.join(args.out, name)
    path = os.path.join(out, "results.json")
    if os.path.exists(path) and not args.force:
        print(f"{name}: reusing {path}", flush=True)
    else:
        train, dev, test = files
        cmd = [sys.executable, SCRIPT, "--train", train, "--dev", dev, "--test", test,
               "--loss", loss, "--epochs", str(args.epochs), "--out", out,
               "--seed", str(seed), "--threads", str(args.threads)] + extra
        if subset:
            cmd.append("--no-sparsity")
        os.makedirs(out, exist_ok=True)
        start = time.perf_counter()
        with open(os.path.join(out, "log.txt"), "w") as log:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)
        print(f"{name}: done in {time.perf_counter() - start:.0f} s", flush=True)
    with open(path) as f:
        return json.load(f)


def batch_sizes(results):
    """The batch sizes the runs used, as text ("28", or "10, 12" if they differ)."""
    sizes = sorted({r["settings"].get("batch_size") for r in results.values()})
    return ", ".join(str(b) for b in sizes)


def spread(values):
    return statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(results, seeds):
    """Per loss: test UAS per seed, mean, standard deviation, median epoch time, sparsity."""
    summary = {}
    for loss in LOSSES:
        runs = [results[loss, s] for s in seeds]
        uas = [r["test_uas"] for r in runs]
        seconds = [e["seconds"] for r in runs for e in r["epochs"]]
        first = [r["epochs"][0] for r in runs]
        best = [r["epochs"][r["best_epoch"] - 1] for r in runs]
        summary[loss] = {
            "test_uas": uas, "mean": statistics.mean(uas), "std": spread(uas),
            "paper": PAPER[loss], "best_epochs": [r["best_epoch"] for r in runs],
            "dev_uas": [r["dev_uas"] for r in runs],
            "median_epoch_seconds": statistics.median(seconds),
            "median_epoch_cpu_seconds": statistics.median(
                e["cpu_seconds"] for r in runs for e in r["epochs"]),
            "trees_first": statistics.mean(e["mean_trees"] for e in first),
            "trees_best": statistics.mean(e["mean_trees"] for e in best),
            "heads_first": statistics.mean(e["mean_heads_per_word"] for e in first),
            "heads_best": statistics.mean(e["mean_heads_per_word"] for e in best),
        }
    return summary


def subset_summary(results, seeds):
    """Per loss on the subset: test UAS per seed, mean, standard deviation, best epochs."""
    out = {}
    for loss in LOSSES:
        runs = [results[loss, s] for s in seeds]
        uas = [r["test_uas"] for r in runs]
        out[loss] = {"test_uas": uas, "mean": statistics.mean(uas), "std": spread(uas),
                     "best_epochs": [r["best_epoch"] for r in runs],
                     "dev_uas": [r["dev_uas"] for r in runs],
                     "median_epoch_cpu_seconds": statistics.median(
                         e["cpu_seconds"] for r in runs for e in r["epochs"])}
    return out


def mean_sd(s, seeds):
    """``mean ± sd`` over the seeds (the mean alone for one seed)."""
    return f"{s['mean']:.2f}" + (f" ± {s['std']:.2f}" if len(seeds) > 1 else "")


def loss_spread(summary):
    """Largest difference between the losses' mean test UAS."""
    means = [summary[loss]["mean"] for loss in LOSSES]
    return max(means) - min(means)


def rst_table(header, rows):
    cols = list(zip(header, *rows))
    widths = [max(len(c) for c in col) for col in cols]
    rule = "  ".join("=" * w for w in widths)
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([rule, line(header), rule] + [line(r) for r in rows] + [rule])


def results_rst(summary, seeds, args, settings, batch):
    crf_time = summary["crf"]["median_epoch_seconds"]
    crf_cpu = summary["crf"]["median_epoch_cpu_seconds"]
    uas_rows, time_rows = [], []
    for loss in LOSSES:
        s = summary[loss]
        uas_rows.append([NAMES[loss], mean_sd(s, seeds),
                         ", ".join(f"{u:.2f}" for u in s["test_uas"]), f"{s['paper']:.2f}",
                         f"{s['mean'] - s['paper']:+.2f}",
                         ", ".join(str(b) for b in s["best_epochs"])])
        fmt = (lambda x: f"{x:.2g}") if loss == "crf" else (lambda x: f"{x:.2f}")
        time_rows.append([NAMES[loss], f"{s['median_epoch_seconds']:.1f}",
                          f"{s['median_epoch_seconds'] / crf_time:.2f}",
                          f"{s['median_epoch_cpu_seconds']:.1f}",
                          f"{s['median_epoch_cpu_seconds'] / crf_cpu:.2f}",
                          f"{fmt(s['trees_first'])} → {fmt(s['trees_best'])}",
                          f"{s['heads_first']:.2f} → {s['heads_best']:.2f}"])
    uas_rows.append(["UDPipe baseline (paper)", "", "", f"{PAPER_UDPIPE:.2f}", "", ""])
    uas_rows.append(["spread between the losses", f"{loss_spread(summary):.2f}", "", "", "", ""])
    opts = " ".join(settings)
    return "\n".join([
        f".. Generated by benchmarks/parsing_table.py on {time.strftime('%Y-%m-%d')}; "
        "do not edit by hand.",
        "",
        f"Test UAS (percent, punctuation included) with the dev-best epoch, over seeds "
        f"{', '.join(map(str, seeds))}; {args.epochs} epochs; batches of {batch} "
        "sentences; ``parsing.py`` options: "
        f"``--threads {args.threads}{(' ' + opts) if opts else ''}`` (defaults otherwise). "
        "Mean ± sample standard deviation over the seeds; \"paper\" is Table 1's "
        "Vietnamese column (UD 2.0).",
        "",
        rst_table(["loss", "test UAS", "per seed", "paper", "difference", "best epochs"],
                  uas_rows),
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


def subset_rst(sub, n, seeds, args, batch):
    rows = [[NAMES[loss], mean_sd(s, seeds),
             ", ".join(f"{u:.2f}" for u in s["test_uas"]),
             ", ".join(str(b) for b in s["best_epochs"]),
             f"{s['median_epoch_cpu_seconds']:.1f}"]
            for loss, s in sub.items()]
    rows.append(["spread between the losses", f"{loss_spread(sub):.2f}", "", "", ""])
    return "\n".join([
        f"A small treebank: the first {n} training sentences only (the same dev and test "
        f"sets, the same options), over seeds {', '.join(map(str, seeds))}; "
        f"{args.epochs} epochs; batches of {batch} sentences. Test UAS, mean ± sample "
        "standard deviation over the "
        "seeds, and the median CPU time of a training epoch.",
        "",
        rst_table(["loss", "test UAS", "per seed", "best epochs", "CPU s / epoch"], rows),
        "",
    ])


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
    p.add_argument("--subset-seeds", type=int, nargs="+", default=None,
                   help="seeds of the subset runs (default: --seeds)")
    p.add_argument("--out", default=os.path.join(ROOT, "out", "parsing"))
    p.add_argument("--docs", default=os.path.join(ROOT, "docs"))
    p.add_argument("--threads", type=int, default=1, help="threads of each run")
    p.add_argument("--jobs", type=int, default=1, help="runs at the same time")
    p.add_argument("--force", action="store_true", help="rerun runs that have results")
    args = p.parse_args(argv)
    files = treebank_files(args.data)
    sub_seeds = args.subset_seeds or args.seeds
    sub_files = None
    if args.subset:
        sub_files = [subset_file(files[0], args.subset, args.out)] + files[1:]

    # the long runs first, so that the short ones fill the gaps at the end
    jobs = [(0, loss, seed) for seed in args.seeds for loss in LOSSES]
    if args.subset:
        jobs += [(args.subset, loss, seed) for seed in sub_seeds for loss in LOSSES]
    with ThreadPoolExecutor(max_workers=args.jobs) as ex:
        done = ex.map(lambda job: run_one(sub_files if job[0] else files, job[1], job[2],
                                          args, extra, job[0]), jobs)
        everything = dict(zip(jobs, done))
    results = {(loss, seed): r for (n, loss, seed), r in everything.items() if not n}
    summary = summarize(results, args.seeds)
    record = {"epochs": args.epochs, "seeds": args.seeds, "options": extra,
              "losses": summary}
    text = results_rst(summary, args.seeds, args, extra, batch_sizes(results))
    if args.subset:
        sub_results = {(loss, seed): r for (n, loss, seed), r in everything.items() if n}
        sub = subset_summary(sub_results, sub_seeds)
        record["subset"] = {"sentences": args.subset, "seeds": sub_seeds, "losses": sub}
        text += "\n" + subset_rst(sub, args.subset, sub_seeds, args,
                                   batch_sizes(sub_results))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(record, f, indent=1)
    with open(os.path.join(args.docs, "parsing_results.inc"), "w") as f:
        f.write(text)
    sparsity_figure(results, args.seeds, os.path.join(args.docs, "figures",
                                                      "parsing_sparsity.png"))
    print(text)


if __name__ == "__main__":
    main()
