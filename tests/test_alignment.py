"""examples/alignment.py: the paper's binned transition scores against a hand-computed case
and against the formula of Section 5.2 on every tag sequence; the three alignments against
sm.solve and sparsemax; the synthetic task's labels; the command line end to end."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import sparsemap as sm

from _helpers import ROOT_DIR, load_script, subprocess_env, torch_state_restored
from _reference import all_sequences, sequence_column, sparsemax

SCRIPT = ROOT_DIR / "examples" / "alignment.py"
alignment = load_script(SCRIPT, "alignment_example")

W_JUMP = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64)    # <=-2, -1, 0, 1, >=2
W_START = torch.tensor([10.0, 20.0], dtype=torch.float64)              # first word, later
W_END = torch.tensor([100.0, 200.0], dtype=torch.float64)              # earlier, last word


def paper_score(S, tags, w_jump, w_start, w_end):
    """a_s . eta of a tag sequence, written from the paper's eta_F(i, t1, t2) case by case
    (1-based words: start bins {1, 2 or more}, end bins {-2 or less, -1} from the end)."""
    n_p = S.shape[1]
    total = sum(S[i, t] for i, t in enumerate(tags))
    for t1, t2 in zip(tags[:-1], tags[1:]):
        d = t2 - t1
        total += w_jump[0 if d <= -2 else 1 if d == -1 else 2 if d == 0 else 3 if d == 1 else 4]
    first = tags[0] + 1
    total += w_start[0] if first == 1 else w_start[1]
    from_end = tags[-1] - n_p          # -1 for the last word
    total += w_end[1] if from_end == -1 else w_end[0]
    return total


def test_transition_scores_hand_computed():
    eta_v, start, end = alignment.transition_scores(W_JUMP, W_START, W_END, 3, 4)
    jumps = [[3, 4, 5, 5],     # from word 0: jumps 0, 1, 2, 3
             [2, 3, 4, 5],     # from word 1: -1, 0, 1, 2
             [1, 2, 3, 4],     # from word 2: -2, -1, 0, 1
             [1, 1, 2, 3]]     # from word 3: -3, -2, -1, 0
    assert eta_v.shape == (2, 4, 4)
    for i in range(2):
        np.testing.assert_array_equal(eta_v[i].numpy(), jumps)
    np.testing.assert_array_equal(start.numpy(), [10, 20, 20, 20])
    np.testing.assert_array_equal(end.numpy(), [100, 100, 100, 200])


def test_folded_scores_give_every_sequence_the_papers_score():
    """Folding start and end into eta_u scores every structure as the paper's eta_F does,
    for each element of a ragged batch (padding filled with junk)."""
    rng = np.random.default_rng(0)
    sizes = [(3, 4), (2, 3), (1, 2), (4, 1)]
    H, P = 4, 4
    scores = torch.full((len(sizes), H, P), 7.0, dtype=torch.float64)
    for b, (h, p) in enumerate(sizes):
        scores[b, :h, :p] = torch.from_numpy(rng.standard_normal((h, p)))
    w = [torch.from_numpy(rng.standard_normal(k)) for k in (5, 2, 2)]
    hyp_len = torch.tensor([h for h, _ in sizes])
    prem_len = torch.tensor([p for _, p in sizes])
    eta_u, eta_v = alignment.fold(scores, hyp_len, prem_len, *w)
    assert eta_u.shape == (4, H, P) and eta_v.shape == (4, H - 1, P, P)
    for b, (h, p) in enumerate(sizes):
        eu, ev = eta_u[b, :h, :p].numpy(), eta_v[b, :h - 1, :p, :p].numpy()
        for tags in all_sequences(h, p):
            m_s, n_s = sequence_column(tags, p)
            got = (m_s * eu).sum() + (n_s * ev).sum()
            want = paper_score(scores[b, :h, :p].numpy(), list(tags), *(x.numpy() for x in w))
            assert got == pytest.approx(want, abs=1e-12)


def reference_sequential_scores(S, w_jump, w_start, w_end):
    """eta_u, eta_v for sm.SequenceFactor, built by loops from the paper's bins."""
    n_h, n_p = S.shape
    eta_u = S.copy()
    for t in range(n_p):
        eta_u[0, t] += w_start[0 if t == 0 else 1]
        eta_u[n_h - 1, t] += w_end[1 if t == n_p - 1 else 0]
    eta_v = np.zeros((n_h - 1, n_p, n_p))
    for t1 in range(n_p):
        for t2 in range(n_p):
            eta_v[:, t1, t2] = w_jump[min(max(t2 - t1, -2), 2) + 2]
    return eta_u, eta_v


def ragged_batch(rng, sizes, junk=5.0):
    H = max(h for h, _ in sizes)
    P = max(p for _, p in sizes)
    scores = torch.full((len(sizes), H, P), junk, dtype=torch.float64)
    for b, (h, p) in enumerate(sizes):
        scores[b, :h, :p] = torch.from_numpy(rng.standard_normal((h, p)))
    return (scores, torch.tensor([h for h, _ in sizes]), torch.tensor([p for _, p in sizes]))


SIZES = [(3, 5), (5, 5), (2, 3), (4, 2), (1, 4)]


def test_sequential_and_matching_equal_solve():
    rng = np.random.default_rng(1)
    scores, hyp_len, prem_len = ragged_batch(rng, SIZES)
    w = [torch.from_numpy(rng.standard_normal(k)) for k in (5, 2, 2)]
    seq = alignment.align("sequential", scores, hyp_len, prem_len, w)
    match = alignment.align("matching", scores, hyp_len, prem_len)
    n_structures = []
    for b, (h, p) in enumerate(SIZES):
        S = scores[b, :h, :p].numpy()
        eu, ev = reference_sequential_scores(S, *(x.numpy() for x in w))
        r = sm.solve(sm.SequenceFactor(h, p), eu, ev)
        np.testing.assert_allclose(seq[b, :h, :p].numpy(), r.u, atol=1e-12)
        r_m = sm.solve(sm.MatchingFactor(h, p), S)
        np.testing.assert_allclose(match[b, :h, :p].numpy(), r_m.u, atol=1e-12)
        n_structures += [len(r.structures), len(r_m.structures)]
        for a in (seq, match):          # zero padding
            assert not a[b, h:].any() and not a[b, :, p:].any()
    assert max(n_structures) > 1        # some real mixtures, not only MAP structures
    sizes = alignment.support_sizes("sequential", scores, hyp_len, prem_len, w)
    want = [len(sm.solve(sm.SequenceFactor(h, p),
                         *reference_sequential_scores(scores[b, :h, :p].numpy(),
                                                      *(x.numpy() for x in w))).structures)
            for b, (h, p) in enumerate(SIZES)]
    assert sizes.tolist() == want


def test_sequential_without_transition_scores_is_row_sparsemax():
    """With all bin scores 0 the chain adds nothing: the marginal polytope is a product of
    simplices and SparseMAP splits into one sparsemax per hypothesis word."""
    rng = np.random.default_rng(2)
    scores, hyp_len, prem_len = ragged_batch(rng, SIZES)
    zeros = [torch.zeros(k, dtype=torch.float64) for k in (5, 2, 2)]
    seq = alignment.align("sequential", scores, hyp_len, prem_len, zeros)
    for b, (h, p) in enumerate(SIZES):
        for j in range(h):
            np.testing.assert_allclose(seq[b, j, :p].numpy(),
                                       sparsemax(scores[b, j, :p].numpy()), atol=1e-12)


def test_softmax_rows_within_each_block():
    rng = np.random.default_rng(3)
    scores, hyp_len, prem_len = ragged_batch(rng, SIZES)
    a = alignment.align("softmax", scores, hyp_len, prem_len)
    for b, (h, p) in enumerate(SIZES):
        S = scores[b, :h, :p].numpy()
        want = np.exp(S) / np.exp(S).sum(1, keepdims=True)
        np.testing.assert_allclose(a[b, :h, :p].numpy(), want, atol=1e-12)
        assert not a[b, h:].any() and not a[b, :, p:].any()
    with pytest.raises(ValueError, match="kind"):
        alignment.align("sparsemax", scores, hyp_len, prem_len)


def test_gradient_reaches_the_bin_scores():
    rng = np.random.default_rng(4)
    scores, hyp_len, prem_len = ragged_batch(rng, [(3, 4), (2, 3)])
    scores.requires_grad_(True)
    w = [torch.from_numpy(0.3 * rng.standard_normal(k)).requires_grad_(True)
         for k in (5, 2, 2)]
    weights = torch.from_numpy(rng.standard_normal(scores.shape))

    def f(scores, *w):
        return (alignment.align("sequential", scores, hyp_len, prem_len, w) * weights).sum()

    assert torch.autograd.gradcheck(f, (scores, *w), eps=1e-6, atol=1e-7)
    f(scores, *w).backward()
    assert all(x.grad.abs().sum() > 0 for x in w)


def test_data_labels_are_decided_through_the_gold_alignment():
    rng = np.random.default_rng(5)
    d = alignment.make_data(300, vocab=12, min_len=4, max_len=7, repeats=1, rng=rng)
    assert d["label"].sum() == 150
    for k in range(300):
        P, H = int(d["prem_len"][k]), int(d["hyp_len"][k])
        assert 4 <= P <= 7 and 2 <= H <= P
        prem = d["premise"][k, :P].numpy()
        gold = d["gold"][k, :H].numpy()
        np.testing.assert_array_equal(gold, gold[0] + np.arange(H))     # a span
        np.testing.assert_array_equal(d["hypothesis"][k, :H].numpy(), prem[gold])
        assert len(set(prem.tolist())) == P - 1                          # one repeat
        flips = int((d["hypothesis_attr"][k, :H] != d["premise_attr"][k, gold]).sum())
        assert flips == int(d["label"][k])


def test_order_blind_rules_by_hand():
    """Premise A B A with attributes 0 1 1; the hypothesis restates positions 1..2 (B A)."""
    def pair(hyp, hyp_attr, label):
        return {"premise": [0, 1, 0], "premise_attr": [0, 1, 1], "hypothesis": hyp,
                "hypothesis_attr": hyp_attr, "prem_len": 3, "hyp_len": len(hyp), "label": label}

    pairs = [pair([1, 0], [1, 1], 0),         # entailment: both rules right
             pair([1, 0], [1, 0], 1),         # A flipped to 0, the other copy's: both wrong
             pair([1, 0], [0, 1], 1),         # B flipped: both right
             pair([0, 1, 0], [0, 1, 0], 1)]   # all of A B A, second A flipped to 0:
    #                                           any copy matches, one to one does not
    data = {k: [p[k] for p in pairs] for k in pairs[0]}
    data = {k: torch.tensor([v + [0] * (3 - len(v)) for v in vs]) if isinstance(vs[0], list)
            else torch.tensor(vs) for k, vs in data.items()}
    rules = alignment.order_blind_rules(data)
    assert rules == {"any_copy": 50.0, "one_to_one": 75.0}


def run_cli(out, *extra):
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--epochs", "2", "--train-size",
           "300", "--test-size", "60", "--threads", "1", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    return json.loads((out / "results.json").read_text()), proc.stdout


def test_cli_contract(tmp_path):
    res, stdout = run_cli(tmp_path)
    assert stdout.count("epoch") >= 6                       # progress per epoch
    for name in ("alignments.png", "training.png", "learned_alignments.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
    assert set(res["alignments"]) == set(alignment.ALIGNMENTS)
    for kind, r in res["alignments"].items():
        assert [e["epoch"] for e in r["epochs"]] == [1, 2]
        assert len(r["train_loss"]) == len(r["train_accuracy"]) == 2
        assert r["train_loss"][1] < r["train_loss"][0]
        assert 0 <= r["final_accuracy"] <= 100 and r["seconds"] > 0
        s = r["sparsity"]
        assert set(s) == {"mean_nnz_per_row", "percent_nonzero", "mean_support"}
        if kind == "softmax":
            assert s["percent_nonzero"] == 100
        else:
            assert 1 <= s["mean_nnz_per_row"] <= 8 and s["mean_support"] >= 1
            assert s["percent_nonzero"] < 100
    assert any(w != 0 for w in res["alignments"]["sequential"]["transitions"]["w_jump"])
    assert set(res["order_blind_rules"]) == {"any_copy", "one_to_one"}
    pair = res["figure_pair"]
    assert pair["softmax"]["nnz"] == pair["softmax"]["size"] == 56
    assert pair["sequential"]["nnz"] < 56 and pair["matching"]["nnz"] < 56


def test_main_is_deterministic_given_the_seed(tmp_path):
    with torch_state_restored():
        runs = [alignment.main(["--out", str(tmp_path / name), "--epochs", "2", "--train-size",
                                "200", "--test-size", "40", "--seed", "3", "--no-figures"])
                for name in "ab"]
    for r in runs:
        for a in r["alignments"].values():
            for e in a["epochs"]:
                del e["seconds"]
            del a["seconds"]
        del r["settings"]["out"]
    assert runs[0] == runs[1]
    assert not list(tmp_path.glob("*/*.png"))


@pytest.mark.parametrize("argv, name", [
    (["--min-len", "9", "--max-len", "4"], "--min-len"),
    (["--epochs", "0"], "--epochs"),
    (["--lr", "-1"], "--lr"),
    (["--alignments", "sparsemax"], "--alignments"),
])
def test_bad_arguments_are_named(tmp_path, capsys, argv, name):
    with pytest.raises(SystemExit) as exc:
        alignment.parse_args(["--out", str(tmp_path)] + argv)
    assert exc.value.code != 0 and name in capsys.readouterr().err
