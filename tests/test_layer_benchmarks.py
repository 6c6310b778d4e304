"""benchmarks/bench_parser_layer.py and bench_tagger_layer.py: their CRF baselines are
right (against brute force over trees and tag sequences), their joined sentences are
trees, and each script's ``--quick`` run works. No timing is checked."""
import itertools
import subprocess
import sys

import numpy as np
import pytest

import torch
import conllu  # noqa: F401  (the treebank reader the benchmarks share needs it)

from _helpers import ROOT_DIR, subprocess_env  # noqa: E402

sys.path.insert(0, str(ROOT_DIR / "benchmarks"))
import _models as M  # noqa: E402

EXCERPT = ROOT_DIR / "examples" / "data"


def all_trees(n, single_root):
    """Every head assignment of ``n`` words that is a tree rooted at 0."""
    for heads in itertools.product(range(n + 1), repeat=n):
        h = (-1,) + heads
        if any(h[m] == m for m in range(1, n + 1)):
            continue
        if single_root and sum(x == 0 for x in heads) != 1:
            continue
        ok = True
        for m in range(1, n + 1):        # every word reaches the root within n steps
            x, steps = m, 0
            while x != 0 and steps <= n:
                x, steps = h[x], steps + 1
            ok &= x == 0
        if ok:
            yield h


@pytest.mark.parametrize("single_root", [False, True])
def test_tree_crf_marginals_match_brute_force(single_root):
    rng = np.random.default_rng(0)
    n = 3
    # padded: a 3-word sentence and a 2-word one in a batch of N = 3
    scores = torch.from_numpy(rng.standard_normal((2, n + 1, n + 1)))
    lengths = torch.tensor([3, 2])
    marg = M.tree_marginals(scores, lengths, single_root)
    for b, nb in enumerate(lengths.tolist()):
        s = scores[b].numpy()
        want, Z = np.zeros((n + 1, n + 1)), 0.0
        for h in all_trees(nb, single_root):
            w = np.exp(sum(s[h[m], m] for m in range(1, nb + 1)))
            Z += w
            for m in range(1, nb + 1):
                want[h[m], m] += w
        want /= Z
        np.testing.assert_allclose(marg[b].numpy(), want, atol=1e-10)
        np.testing.assert_allclose(M.tree_log_partition(scores[b:b + 1], lengths[b:b + 1],
                                                        single_root).item(), np.log(Z))
        np.testing.assert_allclose(marg[b, :, 1:nb + 1].sum(0).numpy(), 1.0)   # per word


@pytest.mark.parametrize("shared", [True, False])
def test_chain_crf_marginals_match_brute_force(shared):
    rng = np.random.default_rng(1)
    B, N, m = 2, 4, 3
    eta_u = torch.from_numpy(rng.standard_normal((B, N, m)))
    eta_v = torch.from_numpy(rng.standard_normal((m, m) if shared else (N - 1, m, m)))
    lengths = torch.tensor([4, 3])
    tags = torch.tensor([[0, 2, 1, 1], [2, 2, 0, -1]])
    marg = M.chain_marginals(eta_u, eta_v, lengths)
    nll = [M.chain_nll(eta_u[b:b + 1], eta_v, tags[b:b + 1], lengths[b:b + 1]).item()
           for b in range(B)]
    V = eta_v.numpy() if not shared else np.broadcast_to(eta_v.numpy(), (N - 1, m, m))
    for b, n in enumerate(lengths.tolist()):
        u = eta_u[b].numpy()

        def score(y):
            return u[np.arange(n), y].sum() + sum(V[i, y[i], y[i + 1]] for i in range(n - 1))

        want, Z = np.zeros((N, m)), 0.0
        for y in itertools.product(range(m), repeat=n):
            w = np.exp(score(y))
            Z += w
            want[np.arange(n), y] += w
        want /= Z
        np.testing.assert_allclose(marg[b].numpy(), want, atol=1e-10)
        np.testing.assert_allclose(marg[b, :n].sum(1).numpy(), 1.0)            # per position
        np.testing.assert_allclose(nll[b], np.log(Z) - score(tags[b, :n].numpy()))


def test_joined_sentences_are_single_root_trees():
    sents = M.read_conllu(EXCERPT / "vi_vtb-excerpt-dev.conllu")
    for L in (7, 60):
        for forms, upos, heads in M.join_sentences(sents, L, 5, np.random.default_rng(L)):
            assert len(forms) == len(upos) == L and len(heads) == L + 1
            assert (heads[1:] == 0).sum() == 1
            for m in range(1, L + 1):
                x, steps = m, 0
                while x != 0 and steps <= L:
                    x, steps = heads[x], steps + 1
                assert x == 0


@pytest.mark.parametrize("script", ["bench_parser_layer.py", "bench_tagger_layer.py"])
def test_quick_run(script):
    proc = subprocess.run([sys.executable, str(ROOT_DIR / "benchmarks" / script), "--quick",
                           "--data", str(EXCERPT)], capture_output=True, text=True,
                          timeout=300, env=subprocess_env(), cwd=ROOT_DIR)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "bar" in out and ("ok" in out or "MISS" in out)
    assert "Traceback" not in proc.stderr
