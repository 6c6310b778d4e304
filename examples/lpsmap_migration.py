"""Moving code from lp-sparsemap to sparsemap: the drop-in, then the native batched form.

Four snippets from projects that use lp-sparsemap, written against its API, run with
``from sparsemap.lpsmap import ...`` in place of ``from lpsmap import ...``:

* a sequence-budget rationale (SequenceBudget over two states, an (L+1, 2, 2) transition
  tensor, a budget from torch.round), as in spectra-rationalization and crest;
* a per-sentence budget loop over a batch of ragged sentences, as in rationale-robustness;
* a matching of Xor rows and AtMostOne columns, decoded with solve_map and relaxed with
  solve;
* lp-sparsemap's own constrained_tree.py: a projective tree with at most two modifiers
  per head.

Each is then written in sparsemap's native form, batched where the shape repeats, and
the two answers are compared (they agree to round-off). See docs/migration.rst.

    python examples/lpsmap_migration.py
"""
import numpy as np
import torch

import sparsemap as sm
import sparsemap.torch as smt
from sparsemap.lpsmap import (AtMostOne, Budget, DepTree, SequenceBudget, TorchFactorGraph,
                              Xor)


# -- the snippets, as written for lp-sparsemap ---------------------------------------------
def seq_budget_smap(unary_scores, transition_scores, max_iter=1, step_size=0, budget=5):
    fg = TorchFactorGraph()
    u = fg.variable_from(unary_scores)
    fg.add(SequenceBudget(u, transition_scores, budget))
    fg.solve(max_iter=max_iter, step_size=step_size)
    return u.value[:, 0]


def matching_smap_budget(scores, max_iter=100, temperature=1.0, budget=None):
    fg = TorchFactorGraph()
    z = fg.variable_from(scores / temperature)
    fg.add(Budget(z, budget=budget))
    fg.solve(max_iter=max_iter)
    return z.value


def matching(scores, decode):
    m, n = scores.shape
    fg = TorchFactorGraph()
    z = fg.variable_from(scores)
    for i in range(m):
        fg.add(Xor(z[i, :]))
    for j in range(n):
        fg.add(AtMostOne(z[:, j]))
    fg.solve_map() if decode else fg.solve()
    return z.value


def constrained_tree(x):
    n = x.shape[0]
    fg = TorchFactorGraph()
    u = fg.variable_from(x)
    fg.add(DepTree(u, packed=True, projective=True))
    for k in range(n):
        ix = list(range(k)) + list(range(k + 1, n))
        fg.add(Budget(u[ix, k], budget=2))
    fg.solve()
    return u.value


# -- their native forms ------------------------------------------------------------------------
def seq_budget_native(unary, transitions, budget):
    """SequenceBudget over two states as sm.SequenceBudgetFactor: "on" is lp-sparsemap's
    state 0; scores (a0 - a1 + 1) / 2 with the start and end scores folded in, transitions
    flipped, all halved (see docs/migration.rst)."""
    L = unary.shape[0]
    flat = transitions.reshape(-1)
    start, trans, end = flat[:2], flat[2:2 + 4 * (L - 1)].reshape(L - 1, 2, 2), \
        flat[2 + 4 * (L - 1):4 * L]
    fold = torch.zeros(L, dtype=unary.dtype)
    fold[0] = fold[0] + start[0] - start[1]
    fold[-1] = fold[-1] + end[0] - end[1]
    eta_u = (unary[:, 0] - unary[:, 1] + 1 + fold) / 2
    eta_v = trans.flip(1, 2) / 2
    return smt.sparsemap(sm.SequenceBudgetFactor(L, budget), eta_u, eta_v)


def budget_loop_native(logits, lengths, ratio):
    """One call for the whole ragged batch: one BudgetFactor per sentence, padded scores."""
    factors = [sm.BudgetFactor(n, int(round(ratio * n))) for n in lengths]
    return smt.sparsemap(factors, logits)


def matching_graph(m, n):
    """The structure only, built once: variables declared by shape, factors on slices."""
    g = sm.FactorGraph()
    z = g.add_variables((m, n))
    for i in range(m):
        g.add(sm.XorFactor(n), z[i, :])
    for j in range(n):
        g.add(sm.AtMostOneFactor(m), z[:, j])
    return g, z


def constrained_tree_graph(n):
    """Packed u[m, h] (root on the diagonal) -> TreeFactor's head-by-modifier indices."""
    ids = np.arange(n * n).reshape(n, n)
    head = np.full((n + 1, n + 1), -1)
    head[1:, 1:] = ids.T
    head[0, 1:] = np.diagonal(ids)
    head[np.arange(1, n + 1), np.arange(1, n + 1)] = -1
    g = sm.FactorGraph(n * n)
    g.add(sm.TreeFactor(n, projective=True, single_root=True), head)
    for k in range(n):
        g.add(sm.BudgetFactor(n - 1, 2), [ids[i, k] for i in range(n) if i != k])
    return g


def main(seed=0, verbose=True):
    """Run every snippet both ways; return the largest difference of each pair."""
    gen = torch.Generator().manual_seed(seed)
    diff = {}

    L = 8
    unary = torch.randn(L, 2, generator=gen, dtype=torch.float64)
    transitions = torch.randn(L + 1, 2, 2, generator=gen, dtype=torch.float64)
    budget = torch.round(torch.tensor(0.3 * L))
    a = seq_budget_smap(unary, transitions, budget=budget)
    b = seq_budget_native(unary, transitions, int(budget))
    diff["sequence budget"] = float((a - b).abs().max())

    lengths = [7, 5, 9, 6]
    logits = torch.randn(len(lengths), max(lengths), generator=gen, dtype=torch.float64)
    loop = torch.zeros_like(logits)
    for i, n in enumerate(lengths):
        budget = torch.round(0.3 * torch.tensor(float(n)))
        loop[i, :n] = matching_smap_budget(logits[i, :n].unsqueeze(0), budget=budget)[0]
    diff["per-sentence budget loop"] = float(
        (loop - budget_loop_native(logits, lengths, 0.3)).abs().max())

    m, n = 4, 6
    scores = torch.randn(m, n, generator=gen, dtype=torch.float64)
    g, z = matching_graph(m, n)
    diff["matching, solve"] = float(
        (matching(scores, False).reshape(-1) - smt.factor_graph(g, scores.reshape(-1))).abs().max())
    r = g.solve_map({z: scores.numpy()})
    diff["matching, solve_map"] = float(np.abs(matching(scores, True).numpy()
                                               - r.value(z)).max())
    batch = torch.randn(16, m * n, generator=gen, dtype=torch.float64)
    u_batch = smt.factor_graph(g, batch)            # 16 matchings, one graph, one call
    diff["matching, batch of 16"] = max(
        float((matching(batch[b].reshape(m, n), False).reshape(-1) - u_batch[b]).abs().max())
        for b in range(16))

    n = 6
    x = torch.randn(n, n, generator=gen, dtype=torch.float64)
    diff["constrained tree"] = float((constrained_tree(x).reshape(-1)
                                      - smt.factor_graph(constrained_tree_graph(n),
                                                         x.reshape(-1))).abs().max())
    if verbose:
        print(f"{'snippet':28s} max |drop-in - native|")
        for k, v in diff.items():
            print(f"{k:28s} {v:.1e}")
    return diff


if __name__ == "__main__":
    main()
