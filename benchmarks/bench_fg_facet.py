"""Factor graphs around one tree, sequence or matching: time against that factor alone.

Each graph is a structured factor plus one small factor over some of its parts, at flat
scores (``scale`` times standard normal, fixed seed), where the structured factor's
vertex side needs hundreds of structures per ADMM step and its facet side one solve:

- ``tree60b``: a non-projective ``TreeFactor(60)`` and a ``BudgetFactor(60, 1)`` on the
  root's arcs;
- ``seq40``: ``SequenceFactor(40, 17)`` and an ``AtMostOneFactor`` over tag 0's
  positions, ``eta_v`` zero; ``seq40v``: the same with ``eta_v`` at the same scale;
- ``match30b``: ``MatchingFactor(30, 30)`` and a ``BudgetFactor(30, 1)`` on its diagonal.

Columns, medians of CPU time over ``--repeats`` runs:

- ``alone``: :func:`sparsemap.solve` on the structured factor alone at the graph's
  scores (``method="auto"``), in milliseconds: the unit of the ratios;
- ``graph``: ``FactorGraph.solve`` (factor steps on the side each factor's solver
  chooses), as a ratio to ``alone``, with its ADMM iterations, polish rounds and the
  side of the structured factor's last step;
- ``+vjp``: the solve and one ``vjp`` of its result (the backward pass's first call,
  which checks its faces), as a ratio to ``alone``;
- ``vertex``: ``FactorGraph.solve`` with every factor step on the vertex side (the
  factor graph before facet-side steps), as a ratio to ``alone``; one run when it takes
  over ``--slow`` seconds.

Run it on two checkouts to compare them: a checkout without facet-side factor steps
prints its ``graph`` column only (its every step is on the vertex side)::

    PYTHONPATH=. python benchmarks/bench_fg_facet.py [--repeats 5] [--graphs tree60b,seq40]
"""
import argparse
import warnings

import numpy as np

import sparsemap as sm
import sparsemap._fg_admm as fg_admm
from _timing import cpu_median


def tree_budget(rng, scale, n=60):
    var = -np.ones((n + 1, n + 1), dtype=int)
    on = ~np.eye(n + 1, dtype=bool)
    on[:, 0] = False
    var[on] = np.arange(on.sum())
    fg = sm.FactorGraph(int(on.sum()))
    tree = sm.TreeFactor(n)
    fg.add(tree, var)
    fg.add(sm.BudgetFactor(n, 1), var[0, 1:])
    eta = scale * rng.standard_normal(fg.n_variables)
    return fg, eta, None, (tree, np.where(var >= 0, eta[np.maximum(var, 0)], 0.0), None)


def sequence_at_most_one(rng, scale, with_v, n=40, k=17):
    var = np.arange(n * k).reshape(n, k)
    fg = sm.FactorGraph(n * k)
    seq = sm.SequenceFactor(n, k)
    fg.add(seq, var)
    fg.add(sm.AtMostOneFactor(n), var[:, 0])
    eta = scale * rng.standard_normal(n * k)
    ev = scale * rng.standard_normal(seq.shape_v) if with_v else None
    return fg, eta, [ev, None], (seq, eta.reshape(n, k), ev)


def matching_budget(rng, scale, n=30):
    var = np.arange(n * n).reshape(n, n)
    fg = sm.FactorGraph(n * n)
    m = sm.MatchingFactor(n, n)
    fg.add(m, var)
    fg.add(sm.BudgetFactor(n, 1), np.diag(var))
    eta = scale * rng.standard_normal(n * n)
    return fg, eta, None, (m, eta.reshape(n, n), None)


GRAPHS = {
    "tree60b": tree_budget,
    "seq40": lambda rng, s: sequence_at_most_one(rng, s, False),
    "seq40v": lambda rng, s: sequence_at_most_one(rng, s, True),
    "match30b": matching_budget,
}


def vertex_solve(fg, eta, eta_v):
    """The graph's solve with every factor step on the vertex side."""
    keep = fg_admm.FACET_FAMILIES
    fg_admm.FACET_FAMILIES = ()
    try:
        return fg.solve(eta, eta_v)
    finally:
        fg_admm.FACET_FAMILIES = keep


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--graphs", default=",".join(GRAPHS))
    ap.add_argument("--scales", default="0.01,0.05,0.1")
    ap.add_argument("--slow", type=float, default=1.0)
    args = ap.parse_args()
    has_facet = hasattr(fg_admm, "FACET_FAMILIES")
    head = (f"{'graph':<9} {'scale':>5} {'alone ms':>9} {'graph/alone':>11} {'iters':>5} "
            f"{'rounds':>6} {'side':>6} {'+vjp/alone':>10}"
            + (f" {'vertex/alone':>12}" if has_facet else ""))
    print(head)
    print("-" * len(head))
    for name in args.graphs.split(","):
        for scale in (float(s) for s in args.scales.split(",")):
            fg, eta, eta_v, (factor, eu, ev) = GRAPHS[name](np.random.default_rng(0), scale)
            t_alone, _ = cpu_median(lambda: sm.solve(factor, eu, ev), 5 * args.repeats)
            t_graph, r = cpu_median(lambda: fg.solve(eta, eta_v), args.repeats)
            e = r._engine
            side = ("facet" if e.factor_sides()[0] else "vertex") if has_facet else "vertex"
            g = np.random.default_rng(1).standard_normal(fg.n_variables)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t_vjp, _ = cpu_median(lambda: fg.solve(eta, eta_v).vjp(g), args.repeats)
            row = (f"{name:<9} {scale:>5g} {1e3 * t_alone:>9.3f} {t_graph / t_alone:>11.1f} "
                   f"{r.n_iter:>5d} {e.n_rounds:>6d} {side:>6} {t_vjp / t_alone:>10.1f}")
            if has_facet:
                t_v, _ = cpu_median(lambda: vertex_solve(fg, eta, eta_v), 1)
                if t_v < args.slow:
                    t_v, _ = cpu_median(lambda: vertex_solve(fg, eta, eta_v), args.repeats)
                row += f" {t_v / t_alone:>12.1f}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
