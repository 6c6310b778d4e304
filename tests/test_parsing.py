"""examples/parsing.py: the CRF pieces against brute force, the CoNLL-U reader, and the
command-line contract run end to end on the treebank excerpt."""
import copy
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy.special import logsumexp

from _helpers import ROOT_DIR, load_script, subprocess_env, torch_state_restored
from _reference import all_trees, arc_matrix, simplex_qp

SCRIPT = ROOT_DIR / "examples" / "parsing.py"
EXCERPT = ROOT_DIR / "examples" / "data" / "vi_vtb-excerpt"
parsing = load_script(SCRIPT, "parsing_example")


def tree_logit(eta, heads):
    return sum(eta[h, m] for m, h in enumerate(heads) if m > 0)


def padded(etas):
    """Stack square score arrays of different sizes, padding with junk."""
    N1 = max(len(e) for e in etas)
    out = np.full((len(etas), N1, N1), 7.0)
    for b, e in enumerate(etas):
        out[b, :len(e), :len(e)] = e
    return torch.tensor(out), torch.tensor([len(e) - 1 for e in etas])


def test_log_partition_matches_enumeration():
    rng = np.random.default_rng(0)
    etas = [3 * rng.standard_normal((n + 1, n + 1)) for n in (4, 1, 3, 2, 5)]
    scores, lengths = padded(etas)
    got = parsing.log_partition(scores, lengths).numpy()
    for b, eta in enumerate(etas):
        trees = all_trees(len(eta) - 1, single_root=True)
        expected = logsumexp([tree_logit(eta, t) for t in trees])
        assert got[b] == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_log_partition_large_scores_stay_finite():
    # exp(800) overflows; the per-column shift must keep the log-determinant finite.
    eta = np.zeros((4, 4))
    eta[0, 1] = eta[1, 2] = eta[2, 3] = 800.0
    scores, lengths = padded([eta])
    got = float(parsing.log_partition(scores, lengths)[0])
    trees = all_trees(3, single_root=True)
    assert got == pytest.approx(logsumexp([tree_logit(eta, t) for t in trees]), rel=1e-12)


def test_crf_loss_gradient_is_marginals_minus_gold():
    rng = np.random.default_rng(1)
    etas = [rng.standard_normal((n + 1, n + 1)) for n in (3, 4)]
    golds = [np.array([-1, 2, 0, 2]), np.array([-1, 0, 1, 4, 1])]
    scores, lengths = padded(etas)
    scores.requires_grad_(True)
    heads = torch.full((2, 5), -1)
    for b, g in enumerate(golds):
        heads[b, :len(g)] = torch.from_numpy(g)
    loss = parsing.crf_loss(scores, heads, lengths)
    loss.backward()
    expected_loss = 0.0
    for b, (eta, gold) in enumerate(zip(etas, golds)):
        n = len(eta) - 1
        trees = all_trees(n, single_root=True)
        logits = np.array([tree_logit(eta, t) for t in trees])
        p = np.exp(logits - logsumexp(logits))
        marg = sum(pt * arc_matrix(t) for t, pt in zip(trees, p))
        gold_arcs = arc_matrix(gold)
        expected = np.zeros((5, 5))
        expected[:n + 1, :n + 1] = (marg - gold_arcs) / 2    # mean over the batch of 2
        np.testing.assert_allclose(scores.grad[b].numpy(), expected, atol=1e-12)
        expected_loss += (logsumexp(logits) - tree_logit(eta, gold)) / 2
    assert loss.item() == pytest.approx(expected_loss, rel=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_n_trees_counts_single_root_trees(n):
    assert parsing.n_trees(n) == pytest.approx(len(all_trees(n, single_root=True)), rel=1e-12)


def brute_force_loss(loss, eta, gold):
    """The loss of one sentence over every single-root tree: SciPy's certified QP for the
    SparseMAP losses, the max over trees for the SVM; and its gradient in eta."""
    n = len(eta) - 1
    trees = all_trees(n, single_root=True)
    cols = np.array([arc_matrix(t) for t in trees])
    M = cols.reshape(len(trees), -1).T
    gold_col = arc_matrix(gold)
    cost = M.T @ (1.0 - gold_col.ravel())               # Hamming: wrong heads
    theta = M.T @ eta.ravel()
    if loss == "svm":
        k = int(np.argmax(theta + cost))
        return theta[k] + cost[k] - tree_logit(eta, gold), cols[k] - gold_col
    if loss == "margin_sparsemap":
        theta = theta + cost
    u, _, value, _ = simplex_qp(M, theta)
    target = tree_logit(eta, gold) - 0.5 * n
    return value - target, u.reshape(n + 1, n + 1) - gold_col


@pytest.mark.parametrize("loss", ["sparsemap", "margin_sparsemap", "svm"])
def test_structured_losses_match_brute_force(loss):
    rng = np.random.default_rng(2)
    etas = [rng.standard_normal((n + 1, n + 1)) for n in (3, 2, 4)]
    golds = [np.array([-1, 2, 0, 2]), np.array([-1, 0, 1]), np.array([-1, 3, 1, 0, 3])]
    scores, lengths = padded(etas)
    scores.requires_grad_(True)
    heads = torch.full((3, 5), -1)
    for b, g in enumerate(golds):
        heads[b, :len(g)] = torch.from_numpy(g)
    value = parsing.training_loss(loss, scores, heads, lengths)
    value.backward()
    expected = 0.0
    for b, (eta, gold) in enumerate(zip(etas, golds)):
        n = len(eta) - 1
        v, g = brute_force_loss(loss, eta, gold)
        expected += v / 3
        grad = scores.grad[b].numpy()
        np.testing.assert_allclose(grad[:n + 1, 1:n + 1], g[:, 1:] / 3, atol=1e-8)
        assert not np.any(grad[n + 1:]) and not np.any(grad[:, n + 1:])
    assert value.item() == pytest.approx(expected, rel=1e-8, abs=1e-10)


def test_read_conllu_skips_multiword_tokens_and_empty_nodes(tmp_path):
    text = ("# sent_id = 1\n"
            "1-2\tdel\t_\t_\t_\t_\t_\t_\t_\t_\n"
            "1\tde\tde\tADP\t_\t_\t2\tcase\t_\t_\n"
            "2\tel\tel\tDET\t_\t_\t0\troot\t_\t_\n"
            "2.1\tx\tx\tVERB\t_\t_\t_\t_\t1:dep\t_\n"
            "3\t.\t.\tPUNCT\t_\t_\t2\tpunct\t_\t_\n\n")
    path = tmp_path / "t.conllu"
    path.write_text(text, encoding="utf-8")
    [(forms, upos, heads)] = parsing.read_conllu(path)
    assert forms == ["de", "el", "."]
    assert upos == ["ADP", "DET", "PUNCT"]
    assert heads.tolist() == [-1, 2, 0, 2]


def test_read_conllu_rejects_a_word_without_a_head(tmp_path):
    path = tmp_path / "t.conllu"
    path.write_text("# sent_id = 7\n1\ta\ta\tX\t_\t_\t_\t_\t_\t_\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="sentence '7' has a word without a head"):
        parsing.read_conllu(path)


def test_excerpt_is_small_and_single_rooted():
    total = 0
    for split in ("train", "dev", "test"):
        sents = parsing.read_conllu(f"{EXCERPT}-{split}.conllu")
        total += len(sents)
        assert all(int((h[1:] == 0).sum()) == 1 for _, _, h in sents)
    assert total <= 200


def cli_args(out, loss, epochs, seed=0, min_updates=0):
    return ["--train", f"{EXCERPT}-train.conllu", "--dev", f"{EXCERPT}-dev.conllu",
            "--test", f"{EXCERPT}-test.conllu", "--loss", loss, "--epochs", str(epochs),
            "--out", str(out), "--seed", str(seed), "--threads", "1",
            "--min-updates", str(min_updates)]


def run_cli(tmp_path, loss, epochs, seed=0):
    """The documented command line, in a subprocess: (results.json, stdout)."""
    out = tmp_path / loss
    cmd = [sys.executable, str(SCRIPT)] + cli_args(out, loss, epochs, seed)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    return json.loads((out / "results.json").read_text()), proc.stdout


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """run_cli(loss, epochs=2, seed=0), once per loss for the module."""
    done = {}

    def get(loss):
        if loss not in done:
            done[loss] = run_cli(tmp_path_factory.mktemp("cli"), loss, epochs=2)
        return done[loss]
    return get


def without_timings(res):
    res = copy.deepcopy(res)
    for e in res["epochs"]:
        del e["seconds"], e["cpu_seconds"], e["eval_seconds"]
    return res


@pytest.mark.parametrize("loss", parsing.LOSSES)
def test_cli_contract(cli_run, loss):
    res, stdout = cli_run(loss)
    assert stdout.count("epoch") >= 2                       # progress per epoch
    assert res["loss"] == loss
    assert 0 <= res["test_uas"] <= 100
    assert res["best_epoch"] in (1, 2)
    assert [e["epoch"] for e in res["epochs"]] == [1, 2]
    for e in res["epochs"]:
        assert set(e) >= {"epoch", "dev_uas", "train_loss", "seconds", "mean_trees",
                          "mean_heads_per_word"}
        assert 0 <= e["dev_uas"] <= 100 and e["seconds"] > 0 and e["cpu_seconds"] > 0
        assert e["mean_trees"] >= 1 and e["mean_heads_per_word"] >= 1
        assert e["score_spread"] > parsing.TIE_SPREAD
    assert res["epochs"][1]["train_loss"] < res["epochs"][0]["train_loss"]
    assert res["warnings"] == []                            # the guard saw nothing
    if loss == "crf":
        # dense: every single-root tree and every possible head, on the dev excerpt
        dev = parsing.read_conllu(f"{EXCERPT}-dev.conllu")
        lengths = [len(f) for f, _, _ in dev]
        e = res["epochs"][0]
        assert e["mean_trees"] == pytest.approx(np.mean([n ** (n - 1) for n in lengths]),
                                                rel=1e-9)
        assert e["mean_heads_per_word"] == pytest.approx(
            sum(n * n for n in lengths) / sum(lengths))


@pytest.mark.parametrize("n, batch, epochs, min_updates, expected", [
    (500, 32, 15, 400, 25),     # 16 updates an epoch (the last batch holds 20)
    (910, 32, 15, 400, 15),     # 29 an epoch: 435 updates in 15 epochs already
    (512, 32, 15, 400, 25),     # exactly 16 an epoch
    (500, 32, 15, 0, 15),
    (500, 32, 30, 400, 30),     # --epochs is a floor too
    (1, 32, 1, 7, 7),
])
def test_epochs_to_run(n, batch, epochs, min_updates, expected):
    assert parsing.epochs_to_run(n, batch, epochs, min_updates) == expected


def test_cli_trains_at_least_min_updates(tmp_path):
    """--epochs 1 with a floor of 9 updates: the excerpt's 120 training sentences make 4
    batches of 32 an epoch, so 3 epochs run."""
    assert len(parsing.read_conllu(f"{EXCERPT}-train.conllu")) == 120
    argv = cli_args(tmp_path / "u", "crf", epochs=1, min_updates=9)
    with torch_state_restored():
        res = parsing.main(argv + ["--no-sparsity"])
    assert [e["epoch"] for e in res["epochs"]] == [1, 2, 3]
    assert res["settings"]["min_updates"] == 9


def test_cli_is_deterministic_given_the_seed(tmp_path, cli_run):
    """Two runs of main() in this process and the command line's run in a fresh one
    (another str hash seed, no state left by earlier tests) give the same results."""
    with torch_state_restored():
        for name in "ab":
            parsing.main(cli_args(tmp_path / name, "sparsemap", epochs=2, seed=0))
    a, b = (json.loads((tmp_path / name / "results.json").read_text()) for name in "ab")
    assert without_timings(a) == without_timings(b) == without_timings(cli_run("sparsemap")[0])


@pytest.mark.parametrize("argv, message", [
    (["--loss", "hinge", "--epochs", "1"], "argument --loss: invalid choice: 'hinge'"),
    (["--loss", "crf", "--epochs", "0"], "--epochs: expected a positive integer, got 0"),
    (["--loss", "crf", "--epochs", "1", "--threads", "0"],
     "--threads: expected a positive integer, got 0"),
    (["--loss", "crf", "--epochs", "1", "--batch-size", "0"],
     "--batch-size: expected a positive integer, got 0"),
    (["--loss", "crf", "--epochs", "1", "--min-updates", "-1"],
     "--min-updates: expected a non-negative integer, got -1"),
])
def test_cli_rejects_bad_arguments(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        parsing.parse_args(["--train", "x", "--dev", "x", "--test", "x",
                            "--out", str(tmp_path)] + argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def excerpt_batches(vocab_from="train", split="dev", size=8):
    """A fresh Parser for the excerpt's vocabulary and padded batches of one split."""
    vocab = parsing.Vocab(parsing.read_conllu(f"{EXCERPT}-{vocab_from}.conllu"))
    enc = [vocab.encode(s) for s in parsing.read_conllu(f"{EXCERPT}-{split}.conllu")]
    batches = [parsing.pad_batch(enc[k:k + size]) for k in range(0, len(enc), size)]
    return len(vocab.words) + 3, len(vocab.tags) + 3, batches


def guard_epoch(model, batches, epoch, guard, loss):
    with torch.no_grad():
        for words, tags, _, lengths in batches:
            guard.observe(model(words, tags, lengths), lengths)
    return guard.end_epoch(epoch, loss)


def test_guard_fires_on_a_scorer_forced_to_tie():
    """A hidden layer blind to the words (its weights zeroed) gives every arc of a
    sentence the same score, as a collapsed run's does: the guard says so; a fresh
    scorer passes."""
    n_words, n_tags, batches = excerpt_batches()
    with torch_state_restored():
        torch.manual_seed(0)
        model = parsing.Parser(n_words, n_tags)
    guard = parsing.Guard()
    spread, found = guard_epoch(model, batches, 1, guard, 30.0)
    assert found == [] and spread > 10 * parsing.TIE_SPREAD
    with torch.no_grad():
        model.head.weight.zero_()                   # the hidden layer blind to the words
        model.mod.weight.zero_()
    spread, found = guard_epoch(model, batches, 2, guard, 20.0)
    assert spread < parsing.TIE_SPREAD
    assert [w["kind"] for w in found] == ["tied_scores"] and found[0]["epoch"] == 2
    assert guard.warnings == found


def test_hidden_layer_is_standardised_over_each_sentences_arcs():
    """normalize_over_arcs against the mean and variance taken over the listed arcs."""
    g = torch.Generator().manual_seed(5)
    A = 3 * torch.randn(4, 7, 5, generator=g, dtype=torch.float64) + 5   # a common offset
    M = torch.randn(4, 7, 5, generator=g, dtype=torch.float64) - 2
    lengths = torch.tensor([6, 1, 3, 2])
    a, m = parsing.normalize_over_arcs(A, M, lengths, eps=1e-12)
    for b, n in enumerate(lengths.tolist()):
        arcs = [(h, d) for h in range(n + 1) for d in range(1, n + 1) if h != d]
        pre = torch.stack([A[b, h] + M[b, d] for h, d in arcs])
        got = torch.stack([a[b, h] + m[b, d] for h, d in arcs])
        want = (pre - pre.mean(0)) / torch.sqrt(pre.var(0, unbiased=False) + 1e-12)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_scores_cannot_tie_while_the_output_weights_live():
    """However flat the hidden layer (here: 100 times flatter than a fresh model's, whose
    variance over the arcs is about 2e-3, far above eps), each sentence's arc scores
    keep the spread they had: only the output weights set it."""
    n_words, n_tags, batches = excerpt_batches()
    with torch_state_restored():
        torch.manual_seed(0)
        model = parsing.Parser(n_words, n_tags)
    words, tags, _, lengths = batches[0]
    with torch.no_grad():
        full = parsing.score_spread(model(words, tags, lengths), lengths)
        for p in (model.head.weight, model.mod.weight):
            p.mul_(1e-2)
        flat = parsing.score_spread(model(words, tags, lengths), lengths)
    long = lengths > 2
    assert (flat[long] > 0.1).all()
    torch.testing.assert_close(flat[long], full[long], rtol=0.1, atol=0.0)


def test_score_spread_is_the_standard_deviation_over_the_arcs():
    rng = np.random.default_rng(3)
    etas = [rng.standard_normal((n + 1, n + 1)) for n in (4, 1, 3)]
    scores, lengths = padded(etas)
    got = parsing.score_spread(scores, lengths).numpy()
    for b, eta in enumerate(etas):
        n = len(eta) - 1
        arcs = [eta[h, m] for h in range(n + 1) for m in range(1, n + 1) if h != m]
        assert got[b] == pytest.approx(np.std(arcs, ddof=1) if len(arcs) > 1 else 0.0)


@pytest.mark.parametrize("losses, stalled", [
    # frozen: a collapsed structured SVM run's losses, its epochs 5 to 10
    ([25.3627, 25.3341, 25.3303, 25.3301, 25.33, 25.33], [4, 5, 6]),
    ([38.2, 31.4, 30.9], []),              # falling
    ([0.0, 0.0, 0.0], []),                 # a perfect fit does not move either
    ([5.0, 5.2, 5.19], []),                # noise above the threshold
    # a run that trains normally, two epochs alike by chance (m-SparseMAP, first 500
    # Vietnamese sentences, seed 0, epochs 15 to 20)
    ([1.0031, 1.0097, 0.9565, 0.7837, 0.7829, 0.6861], []),
    ([2.0, 2.0001, 2.0, 1.5], [3]),        # three alike, then moving again
])
def test_guard_flags_a_loss_that_stops_moving(losses, stalled):
    guard = parsing.Guard()
    for epoch, loss in enumerate(losses, 1):
        guard.observe(torch.tensor([[[0.0, 1.0], [2.0, 0.0]]]), torch.tensor([1]))
        guard.end_epoch(epoch, loss)
    assert [w["epoch"] for w in guard.warnings if w["kind"] == "stalled_loss"] == stalled
    assert all(w["kind"] == "stalled_loss" for w in guard.warnings)


def test_cli_records_the_batch_size(cli_run):
    """Batches of 32 sentences whatever the treebank's size, and results.json says so."""
    res, stdout = cli_run("svm")
    assert res["settings"]["batch_size"] == 32
    assert "batches of 32" in stdout


def test_collapse_scorers_match_their_formulas():
    """benchmarks/parsing_collapse.py's parts: the example's scorer gives the scores of
    its forward pass, and the old scorer is w . tanh(W_h x_h + W_m x_m + b) on the
    bi-LSTM states, computed here arc by arc."""
    collapse = load_script("benchmarks/parsing_collapse.py", "parsing_collapse")
    n_words, n_tags, batches = excerpt_batches()
    words, tags, _, lengths = batches[0]
    with torch_state_restored():
        torch.manual_seed(0)
        new, old = parsing.Parser(n_words, n_tags), collapse.PlainParser(n_words, n_tags,
                                                                         "plain")
    with torch.no_grad():
        h, _, scores = collapse.parts(new, words, tags, lengths)
        torch.testing.assert_close(scores, new(words, tags, lengths), rtol=0, atol=0)
        h, _, scores = collapse.parts(old, words, tags, lengths)
        w, Wh, Wm, b = (old.out.weight[0], old.head.weight, old.mod.weight, old.mod.bias)
        for hd, m in [(0, 1), (2, 1), (1, 3)]:
            want = w @ torch.tanh(Wh @ h[0, hd] + Wm @ h[0, m] + b)
            torch.testing.assert_close(scores[0, hd, m], want)
