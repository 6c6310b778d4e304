"""LP-SparseMAP factor graphs: ADMM iterations, seconds, residuals, accuracy, backward.

Graphs (standard-normal scores, fixed seed):

- ``treeN``: a non-projective dependency tree over N words (10, 20, 30) and a
  ``BudgetFactor(., 2)`` on the modifiers of every word (valency constraints,
  LP-SparseMAP's Figure 1);
- ``alignN``: an N x N alignment, ``XorFactor`` on every row (each row aligned
  exactly once) and ``AtMostOneFactor`` on every column, N = 10, 20, 30, 50;
- ``grid10``: a loopy 10 x 10 grid of ``PairFactor`` with random couplings.

Columns, medians over ``--repeats`` runs:

- ``fg.solve()`` at its defaults: ADMM iterations, seconds, whether the point
  was polished (solved exactly on the final supports and certified by the KKT
  conditions), the final primal residual and ``max |u - u_ref|``;
- ``polish=False`` (plain ADMM to ``tol=1e-10``): iterations, seconds, error;
- one ``vjp`` (exact backward: CG iterations, relative residual, seconds);
- lp-sparsemap (``lpsmap``), when it is importable: seconds and error at its
  defaults (``FactorGraph.solve()``: adaptive penalty from 0.1, tol 1e-6,
  1000 iterations) and at ``tol=1e-11`` with 100000 iterations. Timings
  include building its graph, as its ``solve()`` does every call.

``u_ref`` is an independent tight solve: plain ADMM (no polishing) to
``tol=1e-13``.

lp-sparsemap is never a dependency of sparsemap. To compare, build it in a
separate environment (it needs Eigen; with recent compilers add
``CFLAGS="-include tuple"``) that also sees this checkout, e.g.::

    python -m venv --system-site-packages /tmp/lpsm-venv
    CFLAGS="-include tuple" /tmp/lpsm-venv/bin/pip install --no-build-isolation \\
        git+https://github.com/deep-spin/lp-sparsemap
    PYTHONPATH=. /tmp/lpsm-venv/bin/python benchmarks/bench_factor_graph.py

Usage: python benchmarks/bench_factor_graph.py [--repeats 5] [--graphs tree10,align10,...]
"""
import argparse
import statistics
import time
import warnings

import numpy as np

import sparsemap as sm

try:   # an optional comparison, never a dependency
    import lpsmap
    from lpsmap.ad3qp.factor_graph import PFactorGraph
except ImportError:
    lpsmap = None


def tree_arcs(n):
    """Variable of each arc h -> m (row h, column m); -1 on the diagonal and column 0."""
    var = -np.ones((n + 1, n + 1), dtype=int)
    mask = ~np.eye(n + 1, dtype=bool)
    mask[:, 0] = False
    var[mask] = np.arange(mask.sum())
    return var


def valency_graph(n, budget=2):
    """A tree over n words in which every word takes at most ``budget`` modifiers."""
    var = tree_arcs(n)
    fg = sm.FactorGraph(int(var.max()) + 1)
    fg.add(sm.TreeFactor(n), var)
    for h in range(1, n + 1):
        mods = var[h][var[h] >= 0]
        fg.add(sm.BudgetFactor(mods.size, budget), mods)
    return fg


def tree_budget(rng, n, budget=2):
    fg = valency_graph(n, budget)
    return fg, rng.standard_normal(fg.n_variables), None, dict(kind="tree", n=n, budget=budget)


def alignment(rng, n):
    var = np.arange(n * n).reshape(n, n)
    fg = sm.FactorGraph(n * n)
    for i in range(n):
        fg.add(sm.XorFactor(n), var[i])
    for j in range(n):
        fg.add(sm.AtMostOneFactor(n), var[:, j])
    return fg, rng.standard_normal(n * n), None, dict(kind="align", n=n)


def pair_grid(rng, k):
    var = np.arange(k * k).reshape(k, k)
    fg = sm.FactorGraph(k * k)
    edges = [(var[i, j], var[i + 1, j]) for i in range(k - 1) for j in range(k)]
    edges += [(var[i, j], var[i, j + 1]) for i in range(k) for j in range(k - 1)]
    for a, b in edges:
        fg.add(sm.PairFactor(), [a, b])
    eta_v = [rng.standard_normal(1) for _ in edges]
    return fg, rng.standard_normal(k * k), eta_v, dict(kind="grid", edges=edges)


GRAPHS = {
    "tree10": lambda rng: tree_budget(rng, 10), "tree20": lambda rng: tree_budget(rng, 20),
    "tree30": lambda rng: tree_budget(rng, 30),
    "align10": lambda rng: alignment(rng, 10), "align20": lambda rng: alignment(rng, 20),
    "align30": lambda rng: alignment(rng, 30), "align50": lambda rng: alignment(rng, 50),
    "grid10": lambda rng: pair_grid(rng, 10),
}


def median_time(fn, repeats):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


# -- lp-sparsemap, when installed -------------------------------------------------------------

def lpsmap_graph(spec, eta_u, eta_v):
    """The same graph in lp-sparsemap's API; returns (graph, its variable, a map back to ours)."""
    fg = lpsmap.FactorGraph()
    if spec["kind"] == "tree":
        n = spec["n"]
        var = tree_arcs(n)
        # lp-sparsemap's packed layout: x[m - 1, h - 1] is the arc h -> m, x[m - 1, m - 1] root -> m
        rows, cols = [], []
        for h in range(n + 1):
            for m in range(1, n + 1):
                if var[h, m] >= 0:
                    rows.append(m - 1)
                    cols.append((h if h else m) - 1)
        order = var[var >= 0]
        x = np.zeros((n, n))
        x[rows, cols] = eta_u[order]
        u = fg.variable_from(x)
        fg.add(lpsmap.DepTree(u, packed=True, projective=False))
        for k in range(n):
            fg.add(lpsmap.Budget(u[[m for m in range(n) if m != k], k], budget=spec["budget"]))

        def back(val):
            out = np.zeros(len(order))
            out[order] = val[rows, cols]
            return out
    elif spec["kind"] == "align":
        n = spec["n"]
        u = fg.variable_from(eta_u.reshape(n, n).copy())
        for i in range(n):
            fg.add(lpsmap.Xor(u[i, :]))
        for j in range(n):
            fg.add(lpsmap.AtMostOne(u[:, j]))

        def back(val):
            return val.reshape(-1)
    else:
        u = fg.variable_from(eta_u.copy())
        a, b = np.array(spec["edges"]).T
        fg.add(lpsmap.Pair(u[a], u[b], additionals=np.concatenate(eta_v)))

        def back(val):
            return val.reshape(-1)
    return fg, u, back


def lpsmap_solve(spec, eta_u, eta_v, tight):
    """Build and solve in lp-sparsemap (as its FactorGraph.solve does); returns our-layout u."""
    fg, u, back = lpsmap_graph(spec, eta_u, eta_v)
    if not tight:
        fg.solve()
        return back(np.asarray(u.value))
    pfg = PFactorGraph()
    offset, pvars, scores = fg._make_variables(pfg)
    fg._make_factors(pfg, offset, pvars)
    pfg.set_log_potentials(scores)
    _, post, _, _ = pfg.solve_qp(max_iter=100_000, tol=1e-11)
    k = offset[u]
    return back(np.asarray(post)[k:k + u._ix.size].reshape(u._ix.shape))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--graphs", default=",".join(GRAPHS))
    args = ap.parse_args()
    head = (f"{'graph':<8} {'vars':>5} {'facts':>5} | {'iters':>5} {'seconds':>8} {'pol':>3} "
            f"{'primal':>7} {'|u-ref|':>7} | {'iters':>5} {'seconds':>8} {'|u-ref|':>7} | "
            f"{'cg':>3} {'cg res':>7} {'vjp s':>8}")
    sub = (f"{'':<8} {'':>5} {'':>5} | {'fg.solve() defaults':^35} | {'polish=False':^22} | "
           f"{'backward':^20}")
    if lpsmap is not None:
        head += f" | {'seconds':>8} {'|u-ref|':>7} {'seconds':>8} {'|u-ref|':>7}"
        sub += f" | {'lp-sparsemap dflt, tol 1e-11':^33}"
    print(sub)
    print(head)
    print("-" * len(head))
    for name in args.graphs.split(","):
        fg, eta_u, eta_v, spec = GRAPHS[name](np.random.default_rng(0))
        ref = fg.solve(eta_u, eta_v, tol=1e-13, max_iter=200_000, polish=False).u
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sm.ConvergenceWarning)
            sec, r = median_time(lambda: fg.solve(eta_u, eta_v), args.repeats)
            psec, p = median_time(lambda: fg.solve(eta_u, eta_v, polish=False), args.repeats)
        g = np.random.default_rng(1).standard_normal(fg.n_variables)
        vsec, _ = median_time(lambda: r.vjp(g), args.repeats)
        info = r.backward_info
        row = (f"{name:<8} {fg.n_variables:>5} {len(fg.factors):>5} | {r.n_iter:>5} {sec:>8.4f} "
               f"{'yes' if r.polished else 'no':>3} {r.primal_residual:>7.0e} "
               f"{np.abs(r.u - ref).max():>7.0e} | {p.n_iter:>5} {psec:>8.4f} "
               f"{np.abs(p.u - ref).max():>7.0e} | {info['cg_iterations']:>3} "
               f"{info['relative_residual']:>7.0e} {vsec:>8.5f}")
        if lpsmap is not None:
            for tight in (False, True):
                lsec, lu = median_time(lambda: lpsmap_solve(spec, eta_u, eta_v, tight),
                                       args.repeats)
                row += f" {'|' if not tight else ''} {lsec:>8.4f} {np.abs(lu - ref).max():>7.0e}"
        print(row, flush=True)
    if lpsmap is None:
        print("\nlp-sparsemap (lpsmap) is not importable here: no comparison (see the docstring).")


if __name__ == "__main__":
    main()
