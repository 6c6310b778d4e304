"""Factor graphs where users go: any score scale, padding masks, infeasible graphs.

Three tables (factor graphs at any score scale), each from ``sparsemap.FactorGraph.solve`` at its defaults:

* ``--scales``: an 8 x 12 grid (``XorFactor`` on each row, ``AtMostOneFactor`` on each
  column), 10 seeds per score scale, scales 1e-6 to 1e8 and the dtype's extremes
  (standard-normal scores times ``finfo.max / 100``; float32 scores cast to float64 as
  the torch layer does). Per scale: solves that raised, seeds whose answer breaks a
  constraint by more than 1e-9 (checked here, from ``u`` alone: row sums 1, column sums
  at most 1, ``0 <= u <= 1``), the largest violation, the largest KKT residual relative
  to the scale (an independent check: stationarity of ``u`` against multipliers
  recovered by least squares on the returned faces, see ``kkt_residual``), median CPU
  time and iterations (median, max).
* ``--masks``: the same grid with padding: the last rows and columns filled with
  ``-inf``, ``finfo(float32).min``, ``finfo(float64).min`` or ``-1e4``; the answer on
  the unpadded block against the graph without the padded variables, and the time.
* ``--infeasible``: graphs with no feasible point (more Xor rows than AtMostOne columns,
  found by counting; the same with a budget across, which only the Farkas certificate
  of ADMM's multiplier steps finds; a Xor row whose variables are all masked; a tree
  whose word has every incoming arc masked; two exact budgets that disagree; Xor and
  negated Xor on one variable): the time to raise ``ValueError`` (CPU, median of 20) and
  the error's first words.

* ``--suite``: ADMM iterations by score scale (1e-6 to 1e8) over the twelve graphs
  behind the penalty's rule (alignments, a grid, trees with valency budgets, pair
  chains, a sequence with budgets, logic factors with negations, a matching).

    python benchmarks/bench_fg_robustness.py [--scales] [--masks] [--infeasible] [--suite]
"""
import argparse
import statistics
import time

import numpy as np

import sparsemap as sm


def grid(m=8, n=12):
    fg = sm.FactorGraph()
    x = fg.add_variables((m, n))
    for i in range(m):
        fg.add(sm.XorFactor(n), x[i])
    for j in range(n):
        fg.add(sm.AtMostOneFactor(m), x[:, j])
    return fg, x


def violation(u):
    """How far a grid's u is from its constraints (computed here, from u alone)."""
    return max(float(np.abs(u.sum(1) - 1).max()), float(np.maximum(u.sum(0) - 1, 0).max()),
               float(np.maximum(-u, 0).max()), float(np.maximum(u - 1, 0).max()))


def kkt_residual(eta, u, structures):
    """Stationarity of the grid's u, relative to max(1, |eta|): the smallest
    || eta - u - sum_f C_f^T nu_f || over multipliers nu_f (per factor part) that score
    every returned structure of a factor alike, by least squares (independent of the
    solver's own multipliers)."""
    m, n = eta.shape
    rows = []        # unknowns: nu (one per link: m*n for rows, m*n for columns), tau (m+n)
    L = 2 * m * n
    A, b = [], []
    # stationarity: eta_ij - u_ij = nu_row(i, j) + nu_col(i, j)
    for i in range(m):
        for j in range(n):
            r = np.zeros(L + m + n)
            r[i * n + j] = 1.0
            r[m * n + j * m + i] = 1.0
            A.append(r)
            b.append(eta[i, j] - u[i, j])
    # every support structure s of factor f: nu_f . m_s = tau_f
    for f, S in enumerate(structures):
        for s in S:
            r = np.zeros(L + m + n)
            s = np.asarray(s)
            if f < m:
                r[f * n:(f + 1) * n] = s
            else:
                j = f - m
                r[m * n + j * m:m * n + (j + 1) * m] = s
            r[L + f] = -1.0
            A.append(r)
            b.append(0.0)
    A, b = np.array(A), np.array(b)
    x = np.linalg.lstsq(A, b, rcond=None)[0]
    return float(np.abs(A @ x - b).max()) / max(1.0, float(np.abs(eta).max()))


def scales_table(seeds=10):
    fg, x = grid()
    print("8 x 12 grid (Xor rows, AtMostOne columns), sparsemap.FactorGraph.solve, "
          f"{seeds} seeds per scale")
    print(f"{'scale':>16s} {'dtype':>7s} {'raised':>6s} {'violating':>9s} {'worst viol.':>11s} "
          f"{'worst KKT/scale':>15s} {'ms (median)':>11s} {'iters med/max':>13s}")
    cases = [(s, np.float64) for s in (1e-6, 1e-3, 1.0, 100.0, 3000.0, 1e4, 1e6, 1e8)]
    cases += [("f32 max/100", np.float32), ("f64 max/100", np.float64)]
    for scale, dtype in cases:
        raised = bad = 0
        worst = kkt = 0.0
        ts, its = [], []
        for seed in range(seeds):
            z = np.random.default_rng(seed).standard_normal((8, 12))
            if isinstance(scale, str):
                eta = (z * (np.finfo(dtype).max / 100)).astype(dtype).astype(np.float64)
            else:
                eta = (scale * z).astype(dtype).astype(np.float64)
            t = time.process_time()
            try:
                r = fg.solve({x: eta})
            except (ValueError, sm.ConvergenceError):
                raised += 1
                continue
            ts.append(time.process_time() - t)
            its.append(r.n_iter)
            u = r.value(x)
            v = violation(u)
            bad += v > 1e-9
            worst = max(worst, v)
            kkt = max(kkt, kkt_residual(eta, u, r.structures))
        name = f"{scale:.0e}" if not isinstance(scale, str) else scale
        print(f"{name:>16s} {np.dtype(dtype).name:>7s} {raised:6d} {bad:9d} {worst:11.1e} "
              f"{kkt:15.1e} {1e3 * statistics.median(ts):11.2f} "
              f"{int(statistics.median(its)):6d}/{max(its):<6d}")


def masks_table(n=10, pad=3, seeds=5):
    """Padded rows and columns (the last `pad`) of an (n + pad) square grid."""
    N = n + pad
    fg, x = grid(N, N)
    ref_fg, y = grid(n, n)
    print(f"\n{N} x {N} grid, the last {pad} rows and columns padded; the real block "
          f"against the {n} x {n} graph alone (max |u - u_ref| over {seeds} seeds)")
    print(f"{'fill':>22s} {'max |du| real block':>20s} {'padded rows sum':>16s} "
          f"{'ms (median)':>11s}")
    for fill in (-np.inf, float(np.finfo(np.float32).min), float(np.finfo(np.float64).min),
                 -1e4):
        diffs, sums, ts = [], [], []
        for seed in range(seeds):
            z = np.random.default_rng(seed).standard_normal((n, n))
            eta = np.full((N, N), fill)
            eta[:n, :n] = z
            t = time.process_time()
            try:
                r = fg.solve({x: eta})
            except ValueError as exc:
                ts.append(time.process_time() - t)
                diffs.append(np.nan)
                sums.append(str(exc).split(":")[1].strip())
                continue
            ts.append(time.process_time() - t)
            u = r.value(x)
            diffs.append(float(np.abs(u[:n, :n] - ref_fg.solve({y: z}).value(y)).max()))
            sums.append(f"{u[n:].sum(1).min():.3f}-{u[n:].sum(1).max():.3f}")
        print(f"{fill:22.4g} {max(diffs):20.1e} {sums[0]:>16s} "
              f"{1e3 * statistics.median(ts):11.2f}")
    print("(-inf padding makes the padded Xor rows infeasible: each needs one of its "
          "variables on, and all are masked; finite fills are forced groups whose common "
          "score cancels: the answer is the unpadded one)")


def infeasible_families():
    rng = np.random.default_rng(0)
    fams = {}
    fg, x = grid(5, 3)
    fams["5 Xor rows, 3 AtMostOne columns"] = (fg, fg.scores({x: rng.standard_normal((5, 3))}))
    fg, x = grid(30, 20)
    fams["30 x 20 alignment (non-square)"] = (fg, fg.scores({x: rng.standard_normal((30, 20))}))
    fg, x = grid(30, 20)
    fg.add(sm.BudgetFactor(20, 5), x[np.arange(20), np.arange(20)])
    fams["the same, a budget on the diagonal too"] = (
        fg, fg.scores({x: rng.standard_normal((30, 20))}))
    fg, x = grid(4, 4)
    e = rng.standard_normal((4, 4))
    e[2] = -np.inf
    fams["a Xor row all masked (-inf)"] = (fg, fg.scores({x: e}))
    n = 6
    var = -np.ones((n + 1, n + 1), int)
    used = ~np.eye(n + 1, dtype=bool)
    used[:, 0] = False
    var[used] = np.arange(used.sum())
    g = sm.FactorGraph(int(used.sum()))
    g.add(sm.TreeFactor(n), var)
    for h in range(n + 1):
        vs = var[h][var[h] >= 0]
        g.add(sm.BudgetFactor(vs.size, 2), vs)
    e = rng.standard_normal(g.n_variables)
    e[var[:, 3][var[:, 3] >= 0]] = -np.inf         # no arc may enter word 3
    fams["a tree word with every head masked"] = (g, e)
    g = sm.FactorGraph(6)
    g.add(sm.BudgetFactor(6, 3, exact=True), np.arange(6))
    g.add(sm.BudgetFactor(3, 1, exact=True), [0, 1, 2])
    g.add(sm.BudgetFactor(3, 1, exact=True), [3, 4, 5])
    fams["exact budgets 3 = 1 + 1"] = (g, rng.standard_normal(6))
    g = sm.FactorGraph(3)
    g.add(sm.XorFactor(3), [0, 1, 2])
    g.add(sm.XorFactor(3), [0, 1, 2], [True, True, True])
    fams["Xor and Xor of the negations"] = (g, rng.standard_normal(3))
    print("\nInfeasible graphs: CPU time to raise ValueError (median of 20), and the message")
    for name, (g, e) in fams.items():
        ts = []
        msg = ""
        for _ in range(20):
            t = time.process_time()
            try:
                g.solve(e)
                msg = "no error!"
            except ValueError as exc:
                msg = str(exc)
            ts.append(time.process_time() - t)
        print(f"{name:38s} {1e3 * statistics.median(ts):7.2f} ms  {msg[:110]}")


def suite():
    """The twelve graphs behind the ADMM penalty's rule: name -> (graph, eta_v shapes)."""
    def tree_budgets(n, proj=True, b=2):
        N = n + 1
        var = -np.ones((N, N), int)
        used = ~np.eye(N, dtype=bool)
        used[:, 0] = False
        var[used] = np.arange(used.sum())
        g = sm.FactorGraph(int(used.sum()))
        g.add(sm.TreeFactor(n, projective=proj, single_root=proj), var)
        for h in range(1, N):
            vs = var[h][var[h] >= 0]
            g.add(sm.BudgetFactor(vs.size, b), vs)
        return g, None

    def pairs(n):
        g = sm.FactorGraph(n)
        for i in range(n - 1):
            g.add(sm.PairFactor(), [i, i + 1])
        return g, [(1,)] * (n - 1)

    def seq_budget(L=8, S=3, b=3):
        g = sm.FactorGraph(L * S)
        g.add(sm.SequenceFactor(L, S), np.arange(L * S).reshape(L, S))
        for k in range(S):
            g.add(sm.BudgetFactor(L, b), np.arange(L) * S + k)
        return g, [(L - 1, S, S)] + [None] * S

    def negations():
        g = sm.FactorGraph(9)
        for f, v, n in [(sm.OrFactor(3), [0, 1, 2], None),
                        (sm.OrFactor(3), [2, 3, 4], [True, True, False]),
                        (sm.XorOutFactor(4), [1, 4, 5, 6], None),
                        (sm.BudgetFactor(4, 2), [0, 3, 5, 7], [False, True, False, True]),
                        (sm.AtMostOneFactor(3), [6, 7, 8], [False, False, True]),
                        (sm.XorFactor(3), [0, 8, 1], None)]:
            g.add(f, v, n)
        return g, None

    def matching_amo(n=6):
        g = sm.FactorGraph(n * n)
        g.add(sm.MatchingFactor(n, n), np.arange(n * n).reshape(n, n))
        g.add(sm.AtMostOneFactor(n), np.arange(n) * (n + 1))
        return g, None

    return {"grid 8x12": (grid()[0], None), "align 10": (grid(10, 10)[0], None),
            "align 20": (grid(20, 20)[0], None), "align 30": (grid(30, 30)[0], None),
            "tree 5 + budgets": tree_budgets(5), "tree 10 + budgets": tree_budgets(10),
            "tree 10 non-proj.": tree_budgets(10, False), "pairs 6": pairs(6),
            "pairs 20": pairs(20), "sequence + budgets": seq_budget(),
            "logic, negations": negations(), "matching + AtMostOne": matching_amo()}


def suite_table(seeds=5):
    """ADMM iterations by score scale over the twelve graphs (median / max over graphs and
    seeds), every solve at its defaults, with the share of polished solves."""
    scales = [1e-6, 1e-2, 0.1, 1.0, 10.0, 100.0, 1e4, 1e8]
    its = {sc: [] for sc in scales}
    ms = {sc: [] for sc in scales}
    pol = n = 0
    for name, (g, vshapes) in suite().items():
        for sc in scales:
            for seed in range(seeds):
                rng = np.random.default_rng(seed)
                eu = sc * rng.standard_normal(g.n_variables)
                ev = None if vshapes is None else [
                    None if v is None else sc * rng.standard_normal(v) for v in vshapes]
                t = time.process_time()
                r = g.solve(eu, ev)
                ms[sc].append(time.process_time() - t)
                its[sc].append(r.n_iter)
                pol += r.polished
                n += 1
    print(f"\nADMM iterations over twelve graphs x {seeds} seeds, by score scale "
          f"({pol} of {n} solves polished)")
    print(f"{'scale':>8s} {'iterations med/max':>19s} {'ms (median)':>11s}")
    for sc in scales:
        print(f"{sc:8.0e} {int(statistics.median(its[sc])):9d}/{max(its[sc]):<9d} "
              f"{1e3 * statistics.median(ms[sc]):11.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scales", action="store_true")
    p.add_argument("--masks", action="store_true")
    p.add_argument("--infeasible", action="store_true")
    p.add_argument("--suite", action="store_true")
    a = p.parse_args()
    every = not (a.scales or a.masks or a.infeasible or a.suite)
    if a.suite or every:
        suite_table()
    if a.scales or every:
        scales_table()
    if a.masks or every:
        masks_table()
    if a.infeasible or every:
        infeasible_families()


if __name__ == "__main__":
    main()
