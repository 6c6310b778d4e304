"""Figures for SparseMAP solutions (matplotlib, an optional dependency).

The pictures of the paper, for your own models:

* :func:`arc_marginals` -- the arc posteriors of a dependency tree over a
  sentence (Figure 3): arcs above the words, drawn by probability.
* :func:`tree_support` -- the trees in a SparseMAP support, one row each with
  its weight; the arcs the trees disagree on stand out.
* :func:`heatmap` -- the posteriors ``u`` of a matching, a sequence or any
  factor with 2-D parts (Figure 5), the support's structures outlined, with the
  sparsity of the solution in the title.
* :func:`sparsity_over_training` -- trees in the support and heads per word
  over training epochs, one line per loss (Figure 4).

Each function takes either arrays or a :class:`~sparsemap.SparseMAPResult`,
draws on the Axes given by ``ax`` (a new figure when ``None``) and returns
what it drew on. ``import sparsemap`` does not import this module, so
matplotlib is needed only here: ``pip install -e ".[plot]"`` in the
repository's clone.
"""
import math
import numbers

import numpy as np

try:
    import matplotlib.colors as mcolors
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch, Rectangle
    from matplotlib.path import Path
    from matplotlib.ticker import MaxNLocator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("sparsemap.plot needs matplotlib: pip install matplotlib, or "
                      "pip install -e '.[plot]' in the repository's clone") from exc

from sparsemap import SparseMAPResult, TreeFactor

__all__ = ["arc_marginals", "tree_support", "heatmap", "sparsity_over_training"]

# Probabilities within this distance of 1 are drawn as certain.
_CERTAIN = 1e-9
# Colours of the support's structures, in order of weight (colour-blind safe).
_PALETTE = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9",
            "#882255", "#117733"]
_AMBIGUOUS = "#0072B2"


# -- shared helpers ----------------------------------------------------------------

def _new_axes(ax, figsize):
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt
    _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _check_probabilities(a, name):
    a = np.asarray(a, dtype=np.float64)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name}: expected finite probabilities, got non-finite values")
    if a.size and (a.min() < -1e-9 or a.max() > 1 + 1e-9):
        raise ValueError(f"{name}: expected probabilities in [0, 1], got values in "
                         f"[{a.min():.3g}, {a.max():.3g}]")
    return np.clip(a, 0.0, 1.0)


def _check_labels(labels, n, name):
    if labels is None:
        return None
    labels = [str(w) for w in labels]
    if len(labels) != n:
        raise ValueError(f"{name}: expected {n} labels, got {len(labels)}")
    return labels


def _fmt(p):
    """A probability as a short label: '.76', '1', '>.99', '<.01'."""
    if p >= 1 - _CERTAIN:
        return "1"
    if p >= 1 - 5e-3:
        return ">.99"
    if p < 5e-3:
        return "<.01"
    return f"{p:.2f}".lstrip("0")


def _support(structures, weights, name):
    """(structures, weights) from a result or from lists, weights checked."""
    if isinstance(structures, SparseMAPResult):
        if weights is not None:
            raise ValueError("weights: must be None when a SparseMAPResult is given")
        return list(structures.structures), np.asarray(structures.weights, dtype=np.float64)
    structures = [np.asarray(s) for s in structures]
    if weights is None:
        raise ValueError(f"weights: required when {name} is not a SparseMAPResult")
    weights = np.asarray(weights, dtype=np.float64).reshape(-1)
    if len(weights) != len(structures):
        raise ValueError(f"weights: expected one weight per structure ({len(structures)}), "
                         f"got {len(weights)}")
    if not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise ValueError("weights: expected finite non-negative weights")
    return structures, weights


# -- arc diagrams ------------------------------------------------------------------

def _tree_marginals(u):
    if isinstance(u, SparseMAPResult):
        if not isinstance(u.factor, TreeFactor):
            raise ValueError(f"u: expected the result of a TreeFactor, got one of "
                             f"{type(u.factor).__name__}")
        u = u.u
    u = _check_probabilities(u, "u")
    if u.ndim != 2 or u.shape[0] != u.shape[1] or u.shape[0] < 2:
        raise ValueError(f"u: expected arc marginals of shape (n+1, n+1) with n >= 1, "
                         f"got shape {u.shape}")
    u = u.copy()
    u[:, 0] = 0.0  # the root has no head and no word heads itself
    np.fill_diagonal(u, 0.0)
    return u


def _check_heads(structures):
    heads = [np.asarray(s) for s in structures]
    if not heads:
        raise ValueError("structures: expected at least one tree")
    n1 = heads[0].shape
    for h in heads:
        if h.ndim != 1 or h.shape != n1 or h.size < 2 or h[0] != -1 or not np.issubdtype(
                h.dtype, np.integer) or np.any(h[1:] < 0) or np.any(h[1:] >= h.size):
            raise ValueError("structures: expected head arrays of one length n+1, "
                             "heads[0] == -1 and heads[m] in [0, n]")
    return [h.astype(int) for h in heads]


def _levels(arcs):
    """Arc heights: one level per distinct span, so nested arcs stack evenly.

    An arc whose reverse is also drawn sits a little lower, so both stay visible.
    """
    arcs = set(arcs)
    spans = sorted({abs(h - m) for h, m in arcs})
    rank = {s: i + 1 for i, s in enumerate(spans)}
    return {(h, m): rank[abs(h - m)] - (0.4 if h > m and (m, h) in arcs else 0.0)
            for h, m in arcs}


def _arc(ax, h, m, y0, height, label=None, **style):
    """One arc h -> m above the baseline y0, peaking at y0 + height."""
    c = y0 + 4.0 * height / 3.0  # a cubic Bezier with both controls at c peaks at 3c/4
    path = Path([(h, y0), (h, c), (m, c), (m, y0)],
                [Path.MOVETO, Path.CURVE4, Path.CURVE4, Path.CURVE4])
    patch = FancyArrowPatch(path=path, arrowstyle="-|>", mutation_scale=11,
                            joinstyle="miter", capstyle="butt", **style)
    patch.set_gid(f"arc {h}->{m}")
    ax.add_patch(patch)
    if label is not None:
        ax.text((h + m) / 2.0, y0 + height, label, ha="center", va="center", fontsize=9,
                color=style.get("color", "k"), zorder=5,
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.9))
    return patch


def _sentence(ax, y0, n, words, root, fontsize=11):
    tokens = [root] + (words if words is not None else [str(i) for i in range(1, n + 1)])
    for i, w in enumerate(tokens):
        ax.annotate(w, (i, y0), xytext=(0, -3), textcoords="offset points",
                    ha="center", va="top", fontsize=fontsize,
                    fontweight="bold" if i == 0 else "normal")


def _bare(ax, n, top, bottom):
    ax.set_xlim(-0.6, n + 0.6)
    ax.set_ylim(bottom, top)
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)


def arc_marginals(u, words=None, *, ax=None, min_prob=0.0, labels=True, root="ROOT",
                  color=_AMBIGUOUS):
    """Draw the arc marginals of a dependency tree above its sentence.

    Every arc with probability above `min_prob` is an arrow from head to
    modifier above the words; the root is node 0, at the left. Arcs that are
    certain (probability 1) are thin and black; uncertain arcs are drawn in
    `color`, thicker and more opaque as their probability grows, and labelled
    with it, as in Figure 3 of the paper.

    Parameters
    ----------
    u : array_like of shape (n+1, n+1) or SparseMAPResult
        Arc marginals, ``u[h, m]`` the probability of the arc head ``h`` ->
        modifier ``m`` (node 0 is the root; column 0 and the diagonal are
        ignored), or the result of :func:`sparsemap.solve` on a
        :class:`~sparsemap.TreeFactor`. Any source of marginals works:
        SparseMAP, a factor graph, matrix-tree marginals.
    words : sequence of str, optional
        The ``n`` words; by default their indices ``1..n``.
    ax : matplotlib.axes.Axes, optional
        Where to draw; a new figure when ``None``.
    min_prob : float, default 0
        Arcs with probability ``<= min_prob`` are not drawn (raise it for
        dense marginals, such as a CRF's).
    labels : bool, default True
        Write the probability on each uncertain arc.
    root : str, default "ROOT"
        Label of node 0.
    color : color, default blue
        Colour of the uncertain arcs.

    Returns
    -------
    matplotlib.axes.Axes
        The Axes drawn on. Each arc is a matplotlib ``FancyArrowPatch``
        in ``ax.patches`` with gid ``"arc h->m"``.

    Raises
    ------
    ValueError
        If `u` is not square of side at least 2, holds values outside
        ``[0, 1]``, or is the result of another factor; if `words` does not
        have ``n`` entries.

    Examples
    --------
    >>> import numpy as np
    >>> import sparsemap as sm
    >>> import sparsemap.plot as smp
    >>> eta = np.zeros((4, 4))
    >>> eta[0, 2] = eta[2, 1] = eta[2, 3] = 2.0   # "she" <- "eats" -> "fish"
    >>> eta[1, 3] = 1.8                           # or "she" -> "fish"?
    >>> r = sm.solve(sm.TreeFactor(3), eta)
    >>> ax = smp.arc_marginals(r, ["she", "eats", "fish"])
    >>> len(ax.patches)                           # 4 arcs, 2 of them uncertain
    4
    >>> [t.get_text() for t in ax.texts]
    ['.40', '.60', 'ROOT', 'she', 'eats', 'fish']
    """
    u = _tree_marginals(u)
    n = u.shape[0] - 1
    words = _check_labels(words, n, "words")
    if not (isinstance(min_prob, numbers.Real) and 0 <= min_prob < 1):
        raise ValueError(f"min_prob: expected a number in [0, 1), got {min_prob!r}")
    arcs = [(h, m) for h, m in zip(*np.nonzero(u > min_prob))]
    level = _levels(arcs)
    top = max(level.values(), default=1)
    ax = _new_axes(ax, (max(4.0, 0.85 * (n + 1)), 0.9 + 0.45 * top))
    # Most probable last, so they are drawn on top.
    for h, m in sorted(arcs, key=lambda a: u[a]):
        p = u[h, m]
        if p >= 1 - _CERTAIN:
            _arc(ax, h, m, 0.0, level[h, m], color="0.15", linewidth=1.2, alpha=1.0)
        else:
            _arc(ax, h, m, 0.0, level[h, m], label=_fmt(p) if labels else None,
                 color=color, linewidth=0.8 + 2.4 * p, alpha=0.35 + 0.65 * p)
    _sentence(ax, 0.0, n, words, root)
    _bare(ax, n, top + 0.35, -0.75)
    return ax


def tree_support(structures, weights=None, words=None, *, ax=None, max_trees=8,
                 root="ROOT"):
    """Draw the trees of a support, one row each, with their weights.

    Arcs that every drawn tree has are grey; the arcs that tell a tree apart
    from at least one other are drawn in the tree's colour, so the few
    ambiguous attachments stand out (Figure 3 of the paper). Heights depend on
    the arc only, so the same arc sits at the same place in every row.

    Parameters
    ----------
    structures : SparseMAPResult or sequence of array_like
        The result of :func:`sparsemap.solve` on a
        :class:`~sparsemap.TreeFactor`, or head arrays (each of length
        ``n+1``, ``heads[0] == -1``, ``heads[m]`` the head of word ``m``).
    weights : array_like, optional
        The trees' weights; required with head arrays, ``None`` with a result.
    words : sequence of str, optional
        The ``n`` words; by default their indices ``1..n``.
    ax : matplotlib.axes.Axes, optional
        Where to draw; a new figure when ``None``.
    max_trees : int, default 8
        Draw at most this many trees, the heaviest; the title says how many
        were left out.
    root : str, default "ROOT"
        Label of node 0.

    Returns
    -------
    matplotlib.axes.Axes
        The Axes drawn on; each arc is a patch with gid ``"tree k: arc h->m"``,
        ``k`` the row (0 = heaviest).

    Raises
    ------
    ValueError
        If the structures are not head arrays of one length, the weights do
        not match them, `words` does not have ``n`` entries, or a result of
        another factor is given.

    Examples
    --------
    >>> import sparsemap.plot as smp
    >>> ax = smp.tree_support([[-1, 2, 0], [-1, 0, 1]], [0.7, 0.3], ["a", "b"])
    >>> [t.get_text() for t in ax.texts if t.get_text().startswith("p =")]
    ['p = .70', 'p = .30']
    """
    if isinstance(structures, SparseMAPResult) and not isinstance(structures.factor,
                                                                  TreeFactor):
        raise ValueError(f"structures: expected the result of a TreeFactor, got one of "
                         f"{type(structures.factor).__name__}")
    heads, weights = _support(structures, weights, "structures")
    heads = _check_heads(heads)
    if not (isinstance(max_trees, numbers.Integral) and max_trees >= 1):
        raise ValueError(f"max_trees: expected a positive integer, got {max_trees!r}")
    n = heads[0].size - 1
    words = _check_labels(words, n, "words")
    order = np.argsort(-weights, kind="stable")[:max_trees]
    trees = [{(int(h[m]), m) for m in range(1, n + 1)} for h in (heads[k] for k in order)]
    shared = set.intersection(*trees)
    level = _levels(set.union(*trees))
    top = max(level.values())
    row = top + 1.6  # arcs, then the words under them
    ax = _new_axes(ax, (max(4.0, 0.85 * (n + 1)), len(trees) * (0.32 * row + 0.1) + 0.3))
    for k, (arcs, w) in enumerate(zip(trees, weights[order])):
        y0 = -k * row
        colour = _PALETTE[k % len(_PALETTE)]
        for h, m in sorted(arcs, key=lambda a: a in shared, reverse=True):
            if (h, m) in shared:
                p = _arc(ax, h, m, y0, level[h, m], color="0.6", linewidth=1.0)
            else:
                p = _arc(ax, h, m, y0, level[h, m], color=colour, linewidth=2.4)
            p.set_gid(f"tree {k}: arc {h}->{m}")
        _sentence(ax, y0, n, words, root, fontsize=10)
        ax.text(-0.5, y0 + top, f"p = {_fmt(w)}", ha="left", va="top", fontsize=10,
                color=colour, fontweight="bold")
    left_out = len(heads) - len(trees)
    ax.set_title(f"{len(heads)} trees in the support"
                 + (f" ({left_out} lightest not shown)" if left_out else ""), fontsize=11)
    _bare(ax, n, top + 0.3, -(len(trees) - 1) * row - 0.8)
    return ax


# -- heatmaps ----------------------------------------------------------------------

def heatmap(u, structures=None, weights=None, *, factor=None, row_labels=None,
            col_labels=None, ax=None, max_structures=6, values=None, title=None,
            cmap=None, colorbar=None):
    """Heatmap of posteriors ``u``, with the support's structures outlined.

    Each structure of the support (the `max_structures` heaviest) outlines
    its cells in its own colour, nested inside one another where structures
    share a cell; the legend gives their weights. The title gives the
    sparsity: nonzero entries of ``u`` and the support size. Works for any
    factor whose parts form a matrix: a :class:`~sparsemap.MatchingFactor`
    (rows x columns), a :class:`~sparsemap.SequenceFactor` (positions x
    states), a tree's arcs; 1-D parts are drawn as one row.

    Parameters
    ----------
    u : array_like of shape (n_rows, n_cols) or (n,), or SparseMAPResult
        The posteriors, or a result of :func:`sparsemap.solve` (then
        `structures` and `weights` come from it).
    structures : sequence, optional
        The support: compact structures of `factor`, or, without `factor`,
        0/1 masks shaped like `u`. ``None`` draws no outlines (for example
        for a softmax).
    weights : array_like, optional
        The weights of `structures`.
    factor : Factor, optional
        Turns compact `structures` into cells (``factor.vertex``).
    row_labels, col_labels : sequence of str, optional
        Tick labels; by default indices.
    ax : matplotlib.axes.Axes, optional
        Where to draw; a new figure when ``None``.
    max_structures : int, default 6
        Outline at most this many structures, the heaviest.
    values : bool, optional
        Write the value in each nonzero cell; by default when ``u`` has at
        most 12 rows and columns.
    title : str, optional
        Replaces the sparsity title.
    cmap : str or Colormap, optional
        Colour map over ``[0, 1]``; by default white to dark grey (not
        black, so that outlines stay visible on certain cells).
    colorbar : bool, optional
        Draw a colour bar; by default when the values are not written.

    Returns
    -------
    matplotlib.axes.Axes
        The Axes drawn on; the outlines are the
        matplotlib ``Rectangle`` patches with gid
        ``"structure k"``, ``k`` in order of decreasing weight.

    Raises
    ------
    ValueError
        If `u` is not 1-D or 2-D or holds values outside ``[0, 1]``, the
        structures do not match `u` or their weights, or labels have the
        wrong length.

    Examples
    --------
    >>> import numpy as np
    >>> import sparsemap as sm
    >>> import sparsemap.plot as smp
    >>> eta = np.array([[1.0, 0.9, 0.0], [0.0, 1.0, 0.9], [0.9, 0.0, 1.0]])
    >>> r = sm.solve(sm.MatchingFactor(3, 3), eta)
    >>> ax = smp.heatmap(r)
    >>> ax.get_title()
    'nnz(u) = 6 / 9, support: 2 structures'
    """
    if isinstance(u, SparseMAPResult):
        if structures is not None or weights is not None or factor is not None:
            raise ValueError("structures, weights, factor: must be None when u is a "
                             "SparseMAPResult")
        structures, weights, factor = u.structures, u.weights, u.factor
        u = u.u
    u = _check_probabilities(u, "u")
    if u.ndim == 1:
        u = u[None, :]
    if u.ndim != 2 or u.size == 0:
        raise ValueError(f"u: expected a 1-D or 2-D array, got shape {u.shape}")
    n_rows, n_cols = u.shape
    row_labels = _check_labels(row_labels, n_rows, "row_labels")
    col_labels = _check_labels(col_labels, n_cols, "col_labels")
    if not (isinstance(max_structures, numbers.Integral) and max_structures >= 0):
        raise ValueError(f"max_structures: expected a non-negative integer, "
                         f"got {max_structures!r}")
    masks = []
    if structures is not None:
        structures, weights = _support(structures, weights, "structures")
        for s in structures:
            mask = np.asarray(factor.vertex(s)[0] if factor is not None else s)
            if mask.size != u.size:
                kind = "compact structures of factor" if factor is not None else "0/1 masks"
                raise ValueError(f"structures: expected {kind} with {u.size} parts, "
                                 f"got {mask.size}")
            masks.append(mask.reshape(u.shape) > 0.5)
    ax = _new_axes(ax, (max(3.0, 0.5 * n_cols + 1.6), max(2.2, 0.5 * n_rows + 1.6)))
    if cmap is None:
        cmap = mcolors.LinearSegmentedColormap.from_list("sparsemap_grey", ["white", "0.3"])
    im = ax.imshow(u, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest",
                   aspect="equal")
    if values is None:
        values = max(n_rows, n_cols) <= 12
    if colorbar is None:
        colorbar = not values
    if colorbar:
        ax.figure.colorbar(im, ax=ax, shrink=0.8, pad=0.03)
    if values:
        rgba = im.get_cmap()(u)
        for i, j in zip(*np.nonzero(u)):
            dark = 0.299 * rgba[i, j, 0] + 0.587 * rgba[i, j, 1] + 0.114 * rgba[i, j, 2] < 0.5
            ax.text(j, i, _fmt(u[i, j]), ha="center", va="center", fontsize=8, zorder=4,
                    color="white" if dark else "black")
    order = np.argsort(-np.asarray(weights), kind="stable")[:max_structures] if masks else []
    # Nested outlines: the k-th structure sits k steps inside the cell, the
    # innermost still wide enough to frame the value written in it.
    step = min(0.07, 0.25 / max(len(order) - 1, 1))
    handles = []
    for k, idx in enumerate(order):
        colour = _PALETTE[k % len(_PALETTE)]
        d = 0.5 - 0.04 - k * step
        for i, j in zip(*np.nonzero(masks[idx])):
            rect = Rectangle((j - d, i - d), 2 * d, 2 * d, fill=False, edgecolor=colour,
                             linewidth=1.5, zorder=3)
            rect.set_gid(f"structure {k}")
            ax.add_patch(rect)
        handles.append(Line2D([], [], color=colour, linewidth=2.5, label=_fmt(weights[idx])))
    if title is None:
        title = f"nnz(u) = {np.count_nonzero(u)} / {u.size}"
        if masks:
            title += f", support: {len(masks)} structure{'s' if len(masks) != 1 else ''}"
    ax.set_title(title, fontsize=11)
    # Column labels on top, like an alignment matrix; the legend goes below.
    ax.xaxis.tick_top()
    ax.set_xticks(range(n_cols), col_labels if col_labels is not None else range(n_cols))
    ax.set_yticks(range(n_rows), row_labels if row_labels is not None else range(n_rows))
    if col_labels is not None and max(len(c) for c in col_labels) > 2:
        ax.tick_params(axis="x", labelrotation=60)
        for t in ax.get_xticklabels():
            t.set_horizontalalignment("left")
    ax.tick_params(length=0)
    if handles:
        left_out = len(masks) - len(order)
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02),
                  ncol=min(len(handles), 3), frameon=False, fontsize=9, title_fontsize=9,
                  handlelength=1.5, columnspacing=1.2,
                  title="support weights" + (f" (+{left_out} lighter)" if left_out else ""))
    return ax


# -- training curves ---------------------------------------------------------------

_METRIC_NAMES = {"mean_trees": "trees in the support", "mean_heads_per_word": "heads per word",
                 "dev_uas": "dev UAS (%)", "train_loss": "training loss", "seconds": "seconds"}


def _runs_by_label(runs):
    """{label: [list of epoch dicts, one per run]} from the accepted inputs."""
    def epochs_of(run, name):
        if isinstance(run, dict):
            if "epochs" not in run:
                raise ValueError(f"{name}: expected a results dict with an 'epochs' list "
                                 f"or a list of epoch dicts")
            run = run["epochs"]
        run = list(run)
        if not all(isinstance(e, dict) and "epoch" in e for e in run):
            raise ValueError(f"{name}: expected epoch records, dicts with an 'epoch' key")
        return run

    if isinstance(runs, dict):
        out = {}
        for label, rs in runs.items():
            single = isinstance(rs, dict) or (len(rs) > 0 and isinstance(rs[0], dict)
                                              and "epoch" in rs[0])
            rs = [rs] if single else list(rs)
            out[str(label)] = [epochs_of(r, f"runs[{label!r}]") for r in rs]
        return out
    out = {}
    for i, r in enumerate(runs):
        if not (isinstance(r, dict) and "loss" in r):
            raise ValueError("runs: expected a dict {label: runs} or a list of results "
                             "dicts with 'loss' and 'epochs' keys")
        out.setdefault(str(r["loss"]), []).append(epochs_of(r, f"runs[{i}]"))
    return out


def sparsity_over_training(runs, metrics=("mean_trees", "mean_heads_per_word"), *,
                           labels=None, axes=None, yscale=None):
    """Plot sparsity over training epochs, one line per loss (Figure 4).

    For each label (a loss), the mean over its runs (seeds) at each epoch,
    and, with several runs, their range (min to max) as a band.

    Parameters
    ----------
    runs : dict or list
        Either a list of results, each a dict with ``"loss"`` and ``"epochs"``
        (the ``results.json`` of ``examples/parsing.py``), grouped by loss;
        or a dict mapping a label to one run or to a list of runs, a run
        being such a results dict or directly its list of epoch records.
        An epoch record is a dict with ``"epoch"`` and the `metrics`.
    metrics : sequence of str, default ("mean_trees", "mean_heads_per_word")
        The keys to plot, one panel each, stacked.
    labels : sequence of str, optional
        The labels (losses) to draw, in this order; by default all, in the
        order met. A CRF's dense counts (every tree, every head) dwarf the
        sparse losses' few trees even on a log scale: leave it out to see
        those shrink.
    axes : sequence of matplotlib.axes.Axes, optional
        One Axes per metric; a new figure when ``None``.
    yscale : dict, optional
        Scale per metric (``"linear"`` or ``"log"``). By default a panel is
        logarithmic when its values are positive and span more than a
        factor 50 (a CRF's tree count next to SparseMAP's few trees).
        Values that are not finite are not drawn.

    Returns
    -------
    matplotlib.figure.Figure
        The figure of the panels; ``fig.axes[k]`` holds one line per label
        for ``metrics[k]``.

    Raises
    ------
    ValueError
        If `runs` is not in one of the accepted forms, a record lacks a
        metric, `labels` names a label without runs, or `axes` does not
        have one Axes per metric.

    Examples
    --------
    >>> import sparsemap.plot as smp
    >>> runs = {"sparsemap": [
    ...     {"epoch": 1, "mean_trees": 3.0, "mean_heads_per_word": 1.4},
    ...     {"epoch": 2, "mean_trees": 1.5, "mean_heads_per_word": 1.1}]}
    >>> fig = smp.sparsity_over_training(runs)
    >>> [line.get_label() for line in fig.axes[0].get_lines()]
    ['sparsemap']
    """
    groups = _runs_by_label(runs)
    if labels is not None:
        labels = [labels] if isinstance(labels, str) else [str(la) for la in labels]
        missing = [la for la in labels if la not in groups]
        if missing:
            raise ValueError(f"labels: no runs for {missing}; the runs have {list(groups)}")
        groups = {la: groups[la] for la in labels}
    if not groups:
        raise ValueError("runs: expected at least one run")
    metrics = [metrics] if isinstance(metrics, str) else list(metrics)
    yscale = dict(yscale or {})
    if axes is None:
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(len(metrics), 1, sharex=True, squeeze=False,
                                 figsize=(6.0, 2.4 * len(metrics) + 0.4), layout="constrained")
        axes = list(axes[:, 0])
    else:
        axes = list(np.atleast_1d(axes))
        if len(axes) != len(metrics):
            raise ValueError(f"axes: expected {len(metrics)} Axes, one per metric, "
                             f"got {len(axes)}")
        fig = axes[0].figure
    for ax, metric in zip(axes, metrics):
        drawn = []
        for k, (label, label_runs) in enumerate(groups.items()):
            table = {}
            for run in label_runs:
                for e in run:
                    if metric not in e:
                        raise ValueError(f"runs: epoch record {e!r} of {label!r} has no "
                                         f"{metric!r}")
                    v = e[metric]
                    table.setdefault(int(e["epoch"]), []).append(
                        float(v) if v is not None else math.nan)
            epochs = np.array(sorted(table))
            vals = [np.array(table[t]) for t in epochs]
            vals = [v[np.isfinite(v)] for v in vals]
            keep = np.array([v.size > 0 for v in vals], dtype=bool)
            epochs = epochs[keep]
            vals = [v for v in vals if v.size]
            colour = _PALETTE[k % len(_PALETTE)]
            mean = np.array([v.mean() for v in vals])
            ax.plot(epochs, mean, marker="o", markersize=3.5, color=colour, linewidth=1.8,
                    label=label)
            if len(label_runs) > 1 and len(vals):
                ax.fill_between(epochs, [v.min() for v in vals], [v.max() for v in vals],
                                color=colour, alpha=0.2, linewidth=0)
            drawn.extend(v for vs in vals for v in vs)
        drawn = np.array(drawn)
        scale = yscale.get(metric)
        if scale is None:
            scale = ("log" if drawn.size and drawn.min() > 0 and drawn.max() > 50 * drawn.min()
                     else "linear")
        ax.set_yscale(scale)
        ax.set_ylabel(_METRIC_NAMES.get(metric, metric))
        ax.grid(True, alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    axes[-1].set_xlabel("epoch")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(frameon=False, fontsize=9)
    return fig
