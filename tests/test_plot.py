"""sparsemap.plot draws what it is given: arcs, outlines, titles and lines are
read back from the figures and checked against the supports they come from."""
import io
import math
import subprocess
import sys

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgba
from matplotlib.patches import FancyArrowPatch, Rectangle

import sparsemap as sm
import sparsemap.plot as smp

from _helpers import subprocess_env


@pytest.fixture(autouse=True)
def render_and_close():
    """Every figure a test made is rendered (to PNG, in memory), then closed."""
    yield
    for num in plt.get_fignums():
        buf = io.BytesIO()
        plt.figure(num).savefig(buf, format="png")
        assert buf.getvalue().startswith(b"\x89PNG")
    plt.close("all")


def arcs_drawn(ax, prefix="arc "):
    """{(h, m): patch} for the arc patches whose gid starts with `prefix`."""
    out = {}
    for p in ax.patches:
        gid = p.get_gid() or ""
        if isinstance(p, FancyArrowPatch) and gid.startswith(prefix):
            h, m = gid[len(prefix):].split("->")
            out[int(h), int(m)] = p
    return out


def expected_arcs(structures, weights):
    """Arc probabilities summed over the support's trees, without the solver's u."""
    probs = {}
    for heads, w in zip(structures, weights):
        for m in range(1, len(heads)):
            probs[int(heads[m]), m] = probs.get((int(heads[m]), m), 0.0) + w
    return probs


def ambiguous_tree_solve():
    """A real TreeFactor solve with a support of several trees."""
    rng = np.random.default_rng(4)
    eta = rng.standard_normal((7, 7))
    r = sm.solve(sm.TreeFactor(6), eta)
    assert len(r.structures) >= 3
    return r


def test_import_sparsemap_does_not_import_matplotlib():
    code = ("import sys, sparsemap, sparsemap.losses, sparsemap.testing; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported'; "
            "import sparsemap.plot; assert 'matplotlib' in sys.modules; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr


def test_arc_marginals_of_a_tree_result():
    r = ambiguous_tree_solve()
    words = ["w%d" % i for i in range(1, 7)]
    ax = smp.arc_marginals(r, words)
    probs = expected_arcs(r.structures, r.weights)
    drawn = arcs_drawn(ax)
    assert set(drawn) == set(probs)
    uncertain = {a: p for a, p in probs.items() if p < 1 - 1e-9}
    assert uncertain  # the support has several trees
    for a, patch in drawn.items():
        p = probs[a]
        if a in uncertain:
            assert patch.get_alpha() == pytest.approx(0.35 + 0.65 * p)
            assert patch.get_linewidth() == pytest.approx(0.8 + 2.4 * p)
        else:
            assert patch.get_alpha() == 1.0
            assert to_rgba(patch.get_edgecolor())[:3] == to_rgba("0.15")[:3]
    # Each uncertain arc is labelled with its probability, at its apex.
    labels = sorted(t.get_text() for t in ax.texts if t.get_text().startswith("."))
    assert labels == sorted(f"{p:.2f}".lstrip("0") for p in uncertain.values())
    # Heavier arcs are drawn later, on top.
    order = [probs[a] for a in drawn]
    assert order == sorted(order)
    # The sentence: the root, then the words in order.
    assert [t.get_text() for t in ax.texts if not t.get_text().startswith(".")] == \
        ["ROOT"] + words


def test_arc_marginals_from_a_plain_array():
    # Marginals from anywhere (a factor graph, say): 3 words, word 3 torn between two heads.
    u = np.zeros((4, 4))
    u[0, 2] = u[2, 1] = 1.0
    u[2, 3], u[1, 3] = 0.75, 0.25
    u[3, 0] = u[1, 1] = 0.5          # ignored entries: column 0 and the diagonal
    ax = smp.arc_marginals(u, labels=False)
    drawn = arcs_drawn(ax)
    assert set(drawn) == {(0, 2), (2, 1), (2, 3), (1, 3)}
    assert drawn[2, 3].get_alpha() > drawn[1, 3].get_alpha()
    assert drawn[2, 3].get_linewidth() > drawn[1, 3].get_linewidth()
    assert [t.get_text() for t in ax.texts] == ["ROOT", "1", "2", "3"]
    ax = smp.arc_marginals(u, min_prob=0.3, root="*")
    assert set(arcs_drawn(ax)) == {(0, 2), (2, 1), (2, 3)}
    assert ax.texts[-4].get_text() == "*"


def test_arc_marginals_labels_near_certain_and_faint_arcs():
    u = np.zeros((3, 3))
    u[0, 1], u[2, 1] = 0.997, 0.003
    u[1, 2] = 1.0
    ax = smp.arc_marginals(u)
    assert [t.get_text() for t in ax.texts][:2] == ["<.01", ">.99"]   # 1.0 is not labelled
    assert len(ax.texts) == 2 + 3


def test_arc_marginals_draws_both_directions_between_two_words():
    u = np.zeros((3, 3))
    u[0, 1] = u[0, 2] = u[1, 2] = u[2, 1] = 0.5
    ax = smp.arc_marginals(u)
    drawn = arcs_drawn(ax)
    assert set(drawn) == {(0, 1), (0, 2), (1, 2), (2, 1)}
    top = {a: p.get_path().vertices[:, 1].max() for a, p in drawn.items()}
    assert top[2, 1] != top[1, 2]  # not on top of one another


def test_arc_marginals_on_given_axes():
    fig, (ax1, ax2) = plt.subplots(2)
    r = ambiguous_tree_solve()
    assert smp.arc_marginals(r.u, ax=ax2) is ax2
    assert not ax1.patches and ax2.patches


def test_tree_support_rows():
    r = ambiguous_tree_solve()
    ax = smp.tree_support(r)
    k = len(r.structures)
    order = np.argsort(-r.weights, kind="stable")
    trees = [{(int(r.structures[i][m]), m) for m in range(1, 7)} for i in order]
    shared = set.intersection(*trees)
    assert shared and shared != trees[0]
    for row, arcs in enumerate(trees):
        drawn = arcs_drawn(ax, f"tree {row}: arc ")
        assert set(drawn) == arcs
        for a, patch in drawn.items():
            grey = to_rgba(patch.get_edgecolor())[:3] == to_rgba("0.6")[:3]
            assert grey == (a in shared)
    assert len(ax.patches) == 6 * k
    weights = [t.get_text() for t in ax.texts if t.get_text().startswith("p = ")]
    assert weights == [f"p = {w:.2f}".replace("0.", ".") for w in r.weights[order]]
    assert ax.get_title() == f"{k} trees in the support"


def test_tree_support_from_head_arrays_keeps_the_heaviest():
    heads = [[-1, 2, 0], [-1, 0, 1], [-1, 0, 0]]
    ax = smp.tree_support(heads, [0.2, 0.5, 0.3], ["a", "b"], max_trees=2)
    assert set(arcs_drawn(ax, "tree 0: arc ")) == {(0, 1), (1, 2)}
    assert set(arcs_drawn(ax, "tree 1: arc ")) == {(0, 1), (0, 2)}
    assert not arcs_drawn(ax, "tree 2: arc ")
    assert ax.get_title() == "3 trees in the support (1 lightest not shown)"


def outlines(ax):
    """{k: set of (row, col) cells} outlined for the k-th structure."""
    out = {}
    for p in ax.patches:
        if isinstance(p, Rectangle) and (p.get_gid() or "").startswith("structure "):
            x, y = p.get_xy()
            cell = (round(y + p.get_height() / 2), round(x + p.get_width() / 2))
            assert cell == pytest.approx((y + p.get_height() / 2, x + p.get_width() / 2))
            out.setdefault(int(p.get_gid().split()[1]), set()).add(cell)
    return out


def test_heatmap_of_a_matching():
    rng = np.random.default_rng(0)
    r = sm.solve(sm.MatchingFactor(4, 5), rng.standard_normal((4, 5)))
    assert len(r.structures) >= 2
    ax = smp.heatmap(r, row_labels=list("abcd"), col_labels=list("vwxyz"))
    order = np.argsort(-r.weights, kind="stable")
    drawn = outlines(ax)
    assert len(drawn) == len(r.structures)
    for k, i in enumerate(order):
        assert drawn[k] == {(row, int(c)) for row, c in enumerate(r.structures[i]) if c >= 0}
    # Distinct colours, the legend gives the weights in the same order.
    colours = {k: {to_rgba(p.get_edgecolor()) for p in ax.patches
                   if p.get_gid() == f"structure {k}"} for k in drawn}
    assert all(len(c) == 1 for c in colours.values())
    assert len({c.pop() for c in colours.values()}) == len(drawn)
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == \
        [f"{w:.2f}".lstrip("0") for w in r.weights[order]]
    # Sparsity in the title, counted from the structures rather than from u.
    used = set().union(*drawn.values())
    assert ax.get_title() == f"nnz(u) = {len(used)} / 20, support: {len(r.structures)} structures"
    # One value per nonzero cell, at that cell.
    cells = {(round(t.get_position()[1]), round(t.get_position()[0])) for t in ax.texts}
    assert cells == used
    assert [t.get_text() for t in ax.get_yticklabels()] == list("abcd")


def test_heatmap_of_a_sequence_caps_the_outlines():
    rng = np.random.default_rng(1)
    f = sm.SequenceFactor(6, 4)
    r = sm.solve(f, rng.standard_normal((6, 4)), rng.standard_normal((5, 4, 4)))
    assert len(r.structures) > 3
    ax = smp.heatmap(r, max_structures=3, values=False)
    order = np.argsort(-r.weights, kind="stable")
    drawn = outlines(ax)
    assert sorted(drawn) == [0, 1, 2]
    for k in range(3):
        tags = r.structures[order[k]]
        assert drawn[k] == {(i, int(t)) for i, t in enumerate(tags)}
    assert ax.get_legend().get_title().get_text() == \
        f"support weights (+{len(r.structures) - 3} lighter)"
    assert not ax.texts
    assert len(ax.figure.axes) == 2  # the colour bar, since no values are written


def test_heatmap_from_masks_and_without_structures():
    u = np.array([[0.5, 0.5, 0.0], [0.5, 0.0, 0.5]])
    masks = [np.array([[1, 0, 0], [0, 0, 1]]), np.array([[0, 1, 0], [1, 0, 0]])]
    ax = smp.heatmap(u, masks, [0.5, 0.5])
    assert outlines(ax) == {0: {(0, 0), (1, 2)}, 1: {(0, 1), (1, 0)}}
    assert ax.get_title() == "nnz(u) = 4 / 6, support: 2 structures"
    soft = np.full((2, 3), 1 / 3)
    ax = smp.heatmap(soft, title="softmax")
    assert not outlines(ax) and ax.get_legend() is None
    assert ax.get_title() == "softmax"
    ax = smp.heatmap(np.array([0.0, 1.0, 0.0]))   # 1-D parts: one row
    assert ax.get_title() == "nnz(u) = 1 / 3"
    assert ax.get_images()[0].get_array().shape == (1, 3)


def epochs(values):
    return [{"epoch": e + 1, "mean_trees": t, "mean_heads_per_word": h}
            for e, (t, h) in enumerate(values)]


def test_sparsity_over_training_mean_and_spread_per_loss():
    runs = [{"loss": "sparsemap", "epochs": epochs([(4.0, 1.5), (2.0, 1.2), (1.0, 1.0)])},
            {"loss": "sparsemap", "epochs": epochs([(6.0, 1.7), (3.0, 1.1), (2.0, 1.0)])},
            {"loss": "crf", "epochs": epochs([(math.inf, 9.0), (math.inf, 9.0)])}]
    fig = smp.sparsity_over_training(runs)
    trees_ax, heads_ax = fig.axes
    lines = {line.get_label(): line for line in trees_ax.get_lines()}
    assert set(lines) == {"sparsemap", "crf"}
    np.testing.assert_allclose(lines["sparsemap"].get_xdata(), [1, 2, 3])
    np.testing.assert_allclose(lines["sparsemap"].get_ydata(), [5.0, 2.5, 1.5])
    assert len(lines["crf"].get_xdata()) == 0       # an infinite tree count is not drawn
    heads = {line.get_label(): line.get_ydata() for line in heads_ax.get_lines()}
    np.testing.assert_allclose(heads["sparsemap"], [1.6, 1.15, 1.0])
    np.testing.assert_allclose(heads["crf"], [9.0, 9.0])
    # One band (min to max over seeds) for the loss with several runs.
    bands = [c for c in heads_ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 1
    ys = bands[0].get_paths()[0].vertices[:, 1]
    assert ys.min() == pytest.approx(1.0) and ys.max() == pytest.approx(1.7)
    assert trees_ax.get_yscale() == "linear" and heads_ax.get_yscale() == "linear"
    assert heads_ax.get_xlabel() == "epoch"
    assert [t.get_text() for t in trees_ax.get_legend().get_texts()] == ["sparsemap", "crf"]


def test_sparsity_over_training_inputs_and_scales():
    runs = {"a": epochs([(200.0, 2.0), (1.0, 1.0)]),            # one run, epoch records
            "b": [{"epochs": epochs([(2.0, 1.0)])}, epochs([(4.0, 1.0)])]}
    fig = smp.sparsity_over_training(runs)
    assert fig.axes[0].get_yscale() == "log"      # 200 trees next to 1
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["a", "b"]
    np.testing.assert_allclose(fig.axes[0].get_lines()[1].get_ydata(), [3.0])
    fig2, ax = plt.subplots()
    out = smp.sparsity_over_training(runs, ["mean_trees"], axes=ax,
                                     yscale={"mean_trees": "linear"})
    assert out is fig2 and ax.get_yscale() == "linear"
    fig = smp.sparsity_over_training(runs, labels=["b"])
    assert [line.get_label() for line in fig.axes[1].get_lines()] == ["b"]


@pytest.mark.parametrize("call, match", [
    (lambda: smp.arc_marginals(np.zeros((3, 4))), "^u: "),
    (lambda: smp.arc_marginals(np.full((3, 3), 2.0)), "^u: "),
    (lambda: smp.arc_marginals(np.full((3, 3), np.nan)), "^u: "),
    (lambda: smp.arc_marginals(np.zeros((3, 3)), ["a"]), "^words: "),
    (lambda: smp.arc_marginals(np.zeros((3, 3)), min_prob=1.0), "^min_prob: "),
    (lambda: smp.arc_marginals(sm.solve(sm.MatchingFactor(2, 2), np.eye(2))), "^u: "),
    (lambda: smp.tree_support([[-1, 0], [-1, 0, 1]], [0.5, 0.5]), "^structures: "),
    (lambda: smp.tree_support([[-1, 0]]), "^weights: "),
    (lambda: smp.tree_support([[-1, 0]], [0.5, 0.5]), "^weights: "),
    (lambda: smp.tree_support([[-1, 0]], [1.0], max_trees=0), "^max_trees: "),
    (lambda: smp.heatmap(np.zeros((2, 2, 2))), "^u: "),
    (lambda: smp.heatmap(np.zeros((2, 2)), [np.ones(3)], [1.0]), "^structures: "),
    (lambda: smp.heatmap(np.zeros((2, 2)), row_labels=["a"]), "^row_labels: "),
    (lambda: smp.sparsity_over_training([{"epochs": []}]), "^runs: "),
    (lambda: smp.sparsity_over_training({"a": epochs([(1.0, 1.0)])}, labels=["b"]), "^labels: "),
    (lambda: smp.sparsity_over_training({"a": epochs([(1.0, 1.0)])}, ["dev_uas"]), "^runs: "),
    (lambda: smp.sparsity_over_training({"a": epochs([(1.0, 1.0)])},
                                        axes=plt.subplots()[1]), "^axes: "),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
