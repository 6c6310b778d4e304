"""Fuzz harness: SparseMAP at ties, masks and extreme scales against brute force.

Each instance draws a small factor (non-projective trees up to 5 words in both root
settings, matchings up to 5 x 5 in both orientations, sequences of up to 1024
structures), scores of one of several kinds (zeros, integers, repeated rows and
columns, Gaussian at a scale from 1e-12 to 1e8, ``-inf`` masks, float32 and
non-contiguous input), and solves it with each of ``method="auto"`` (the
default), ``"facet"`` and ``"vertex"``. The reference enumerates the structures,
solves the simplex QP of eq. 6 by its own active set (NumPy, no code of the package),
and certifies it by its Wolfe gap over every structure. Each solve is checked for:

- ``u`` within ``1e-6`` of the reference (``1e-6`` relative beyond scale 1);
- ``converged``;
- no structure in ``r.structures`` that uses a ``-inf`` part;
- where ``u`` is differentiable along a random direction ``d`` (one-sided finite
  differences of the reference, forward and backward, at two steps, agree: ``u`` is
  piecewise affine, so they agree exactly unless a kink is crossed or lies at the
  point), ``jvp(d)`` within ``1e-6`` of them and ``vjp`` its transpose
  (``<vjp(g), d> = <g, jvp(d)>``);
- for trees of at most 16 words solved on the facet side, at every instance (kinks
  included), ``jvp(d)`` within ``1e-8`` of the rule of docs/solvers.rst: the
  projection onto the null space of every constraint tight at ``u``, its tight cuts
  found by enumerating all word sets (outcome ``rule``).

Trees of more than 5 words (``--tree-sizes``: 11 to 20 for the facet side's tight-cut
search at ties) are too many to enumerate: their reference ``u``, and the finite
differences that decide differentiability, come from the vertex side
(``method="vertex"``: the active set over trees, certified by its gap), which shares
no code with the facet side's solver.

Run by hand for long campaigns (the pytest module ``test_fuzz_ties.py`` keeps a fast
sample)::

    python tests/fuzz_ties.py --n 100000 --seed 0 [--families tree matching sequence]
    python tests/fuzz_ties.py --n 3000 --families tree --tree-sizes 11 20

It prints the counts per family and method (instances, Jacobians checked, failures
by kind) and the first failures in full.
"""
import argparse
import itertools
import os
import sys
import time
import warnings
from collections import Counter, defaultdict

import numpy as np

if __name__ == "__main__":
    # run as a script: test the checkout this file is in, not an installed copy
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sparsemap as sm  # noqa: E402
from _reference import all_matchings, null_space_projection, tree_tight_rows  # noqa: E402

METHODS = ("auto", "facet", "vertex")
KINDS = ("zeros", "integers", "repeated", "gauss", "mask", "float32", "strided")


# -- structures, enumerated without the package --------------------------------------
def _trees(n, single_root):
    out = []
    for hs in itertools.product(*[[h for h in range(n + 1) if h != m] for m in range(1, n + 1)]):
        heads = (-1,) + hs
        ok = True
        for m in range(1, n + 1):
            seen, z = set(), m
            while z != 0:
                if z in seen:
                    ok = False
                    break
                seen.add(z)
                z = heads[z]
            if not ok:
                break
        if ok and (not single_root or sum(h == 0 for h in hs) == 1):
            out.append(np.array(heads))
    return out


def columns(f):
    """(structures, M, N): the compact structures, their dense m_s (n_u, D) and n_s
    (n_v, D), built from the factor's definition (not from the package's code)."""
    if isinstance(f, sm.TreeFactor):
        n = f.n_words
        S = _trees(n, f.single_root)
        M = np.zeros(((n + 1) ** 2, len(S)))
        for j, h in enumerate(S):
            a = np.zeros((n + 1, n + 1))
            a[h[1:], np.arange(1, n + 1)] = 1
            M[:, j] = a.ravel()
        return S, M, np.zeros((0, len(S)))
    if isinstance(f, sm.MatchingFactor):
        S = all_matchings(f.n_rows, f.n_cols)
        M = np.zeros((f.n_rows * f.n_cols, len(S)))
        for j, s in enumerate(S):
            a = np.zeros((f.n_rows, f.n_cols))
            for i, c in enumerate(s):
                if c >= 0:
                    a[i, c] = 1
            M[:, j] = a.ravel()
        return S, M, np.zeros((0, len(S)))
    n, m = f.shape_u
    S = [np.array(t) for t in itertools.product(range(m), repeat=n)]
    M = np.zeros((n * m, len(S)))
    N = np.zeros((max(n - 1, 0) * m * m, len(S)))
    for j, t in enumerate(S):
        a = np.zeros((n, m))
        a[np.arange(n), t] = 1
        M[:, j] = a.ravel()
        b = np.zeros((max(n - 1, 0), m, m))
        for i in range(n - 1):
            b[i, t[i], t[i + 1]] = 1
        N[:, j] = b.ravel()
    return S, M, N


# -- the reference QP -------------------------------------------------------------------
def simplex_qp(M, theta, tol=1e-13):
    """``argmin_{y in simplex} 1/2 |M y|^2 - theta . y`` by a primal active set in NumPy
    that keeps its support affinely independent (a column affinely dependent on the
    support enters by moving the weights along the dependence, u fixed, until one
    reaches 0), certified: returns ``(u, y, gap)`` with ``gap = max_s (theta_s - m_s .
    u) - (theta - M^T u) . y`` (the Wolfe gap, an upper bound on suboptimality), or None
    when it is not below ``10 tol`` times the scale."""
    D = theta.shape[0]
    scale = 1.0 + np.abs(theta).max()
    S = [int(np.argmax(theta))]
    y = np.zeros(D)
    y[S[0]] = 1.0
    for _ in range(20 * D + 100):
        MS = M[:, S]
        K = np.block([[MS.T @ MS, np.ones((len(S), 1))], [np.ones((1, len(S))), np.zeros((1, 1))]])
        # the scores shifted to the support's mean (the simplex absorbs the shift), and
        # one step of iterative refinement: large scores leave little precision
        rhs = np.r_[theta[S] - theta[S].mean(), 1.0]
        sol = np.linalg.solve(K, rhs)
        sol += np.linalg.solve(K, rhs - K @ sol)
        z = sol[:-1]
        if z.min() < 0:
            # step from y towards z until a weight reaches 0, drop it
            yS = y[S]
            neg = z < 0
            t = np.min(yS[neg] / (yS[neg] - z[neg]))
            yS = yS + t * (z - yS)
            drop = int(np.flatnonzero(neg)[np.argmin(yS[neg])])
            y[S] = np.clip(yS, 0.0, None)
            y[S[drop]] = 0.0
            S.pop(drop)
            y /= y.sum()
            continue
        y[:] = 0.0
        y[S] = z
        u = M @ y
        adj = theta - M.T @ u
        j = int(np.argmax(adj))
        if adj[j] - adj[S].max() <= tol * scale or j in S:
            gap = float(adj.max() - adj @ y)
            if gap <= 10 * tol * scale:
                return u, y, gap
            return None
        # is m_j affinely dependent on the support? then m_j = sum c_i m_i, sum c = 1
        A = np.vstack([M[:, S], np.ones(len(S))])
        b = np.r_[M[:, j], 1.0]
        c = np.linalg.lstsq(A, b, rcond=None)[0]
        if np.abs(A @ c - b).max() <= 1e-10:
            pos = c > 1e-12
            if pos.any():
                ratios = y[S][pos] / c[pos]
                t = ratios.min()
                out = int(np.flatnonzero(pos)[np.argmin(ratios)])
                y[S] = np.clip(y[S] - t * c, 0.0, None)
                y[S[out]] = 0.0
                y[j] = t
                S[out] = j
                y /= y.sum()
                continue
        S.append(j)
    return None


class Reference:
    """The brute-force solution of one factor at any scores."""

    relative_accuracy = 1e-8     # of u, relative to the scores' scale, times 1e-6

    def __init__(self, f):
        self.f = f
        self.S, self.M, self.N = columns(f)

    def theta(self, eu, ev):
        th = self.M.T @ np.where(np.isneginf(eu), 0.0, eu).ravel()
        if self.N.shape[0] and ev is not None:
            th = th + self.N.T @ np.where(np.isneginf(ev), 0.0, ev).ravel()
        allowed = ~((self.M.T @ np.isneginf(eu).ravel()) > 0)
        if self.N.shape[0] and ev is not None:
            allowed &= ~((self.N.T @ np.isneginf(ev).ravel()) > 0)
        return th, allowed

    def feasible(self, eu, ev):
        return bool(self.theta(eu, ev)[1].any())

    def u(self, eu, ev=None):
        th, allowed = self.theta(eu, ev)
        idx = np.flatnonzero(allowed)
        out = simplex_qp(self.M[:, idx], th[idx])
        if out is None:
            return None
        return out[0].reshape(self.f.shape_u)

    def forbidden(self, eu, ev):
        """Predicate on a compact structure: does it use a -inf part?"""
        ban_u = np.isneginf(eu)
        ban_v = np.isneginf(ev) if ev is not None else None
        f = self.f

        def uses(s):
            if isinstance(f, sm.TreeFactor):
                return any(ban_u[s[m], m] for m in range(1, len(s)))
            if isinstance(f, sm.MatchingFactor):
                return any(c >= 0 and ban_u[i, c] for i, c in enumerate(s))
            s = np.asarray(s)
            if ban_u[np.arange(len(s)), s].any():
                return True
            return ban_v is not None and any(ban_v[i, s[i], s[i + 1]] for i in range(len(s) - 1))
        return uses


class VertexReference:
    """Trees too large to enumerate: u from the vertex side (certified by its gap)."""

    # the vertex side's u at scores of scale s is exact to about 1e-11 s (at 2e7 its
    # gap was 1e-4 and u was 3e-5 off the facet side's, whose gap was below 1e-7)
    relative_accuracy = 1e-5

    def __init__(self, f):
        self.f = f

    forbidden = Reference.forbidden

    def feasible(self, eu, ev):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sm.solve(self.f, eu, method="vertex", max_iter=1)
        except ValueError:              # no tree avoids the -inf arcs
            return False
        return True

    def u(self, eu, ev=None):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = sm.solve(self.f, eu, method="vertex")
        return r.u if r.converged else None


def reference(f):
    """The reference of a factor: enumeration where it is small, else the vertex side."""
    if isinstance(f, sm.TreeFactor) and f.n_words > 5:
        return VertexReference(f)
    return Reference(f)


# -- instances ---------------------------------------------------------------------------
def random_factor(rng, family, tree_sizes=(1, 5)):
    if family == "tree":
        return sm.TreeFactor(int(rng.integers(tree_sizes[0], tree_sizes[1] + 1)),
                             single_root=bool(rng.integers(2)))
    if family == "matching":
        return sm.MatchingFactor(int(rng.integers(1, 6)), int(rng.integers(1, 6)))
    while True:
        n, m = int(rng.integers(1, 7)), int(rng.integers(1, 6))
        if m ** n <= 1024:
            return sm.SequenceFactor(n, m)


def random_scores(rng, f, kind):
    """(eta_u, eta_v, kind): eta_v None or an array (sequences)."""
    shape_u, shape_v = f.shape_u, f.shape_v
    scale = 10.0 ** rng.uniform(-12, 8)
    base = kind
    if kind in ("mask", "float32", "strided"):
        base = ("zeros", "integers", "repeated", "gauss")[int(rng.integers(4))]
    if base == "zeros":
        eu = np.zeros(shape_u)
    elif base == "integers":
        hi = int(rng.integers(1, 3))
        eu = rng.integers(-hi, hi + 1, shape_u).astype(float) * (10.0 ** rng.integers(-3, 2))
    elif base == "repeated":
        row = np.round(rng.standard_normal(shape_u[-1]), int(rng.integers(0, 3)))
        eu = np.tile(row, (shape_u[0], 1))
        if rng.integers(2):
            col = np.round(rng.standard_normal(shape_u[0]), 1)
            eu = eu + col[:, None] * rng.integers(0, 2)
        eu = eu * scale
    else:
        eu = scale * rng.standard_normal(shape_u)
        if rng.integers(3) == 0:
            eu = np.round(eu / scale, 1) * scale
    ev = None
    if len(shape_v) and int(np.prod(shape_v)) > 0 and rng.integers(3):
        if base == "zeros" or rng.integers(3) == 0:
            ev = np.zeros(shape_v)
        elif base == "integers":
            ev = rng.integers(-1, 2, shape_v).astype(float)
        else:
            ev = scale * rng.standard_normal(shape_v)
    if kind == "mask" or rng.integers(4) == 0:
        eu = eu.copy()
        eu[rng.random(shape_u) < 0.25] = -np.inf
        if ev is not None and rng.integers(2):
            ev = ev.copy()
            ev[rng.random(shape_v) < 0.15] = -np.inf
    if kind == "float32":
        eu = eu.astype(np.float32)
        ev = None if ev is None else ev.astype(np.float32)
    return eu, ev


def as_passed(rng, eu, kind):
    """The array handed to sm.solve: a strided view for kind 'strided'."""
    if kind != "strided":
        return eu
    big = np.full((eu.shape[0], 2 * eu.shape[1]), 7.0)
    big[:, ::2] = eu
    return big[:, ::2]


# -- one instance --------------------------------------------------------------------------
def tree_rule_jvp(f, u, d, scale):
    """J d for the rule of docs/solvers.rst at a tree's u: the projection onto the null
    space of every constraint tight there (enumerated), within the arcs where u > 0;
    None when a cut is neither clearly tight nor clearly slack (its value within
    1e-7 (1 + scale) of 1 but not within 1e-12 (1 + scale), around the solver's
    tolerance, 1e-12 (1 + max |mu|) and at least n (n + 1) units in the last place):
    the rule is then a matter of round-off."""
    rows = tree_tight_rows(u, f.single_root, 1e-12 * (1 + scale), 1e-7 * (1 + scale))
    if rows is None:
        return None
    J = null_space_projection(rows, (u > 1e-12).ravel())
    return (J @ np.asarray(d, dtype=np.float64).ravel()).reshape(u.shape)


def check_instance(rng, f, eu, ev, kind, methods=METHODS, ref=None):
    """Solve with each method and check it; returns a list of records
    (method, outcome, detail) with outcome in 'ok', 'skip' (no feasible structure),
    'u', 'converged', 'forbidden', 'rule', 'jacobian', 'vjp', 'error', and whether
    the Jacobian was checked against finite differences."""
    ref = ref or reference(f)
    eu64 = np.asarray(eu, dtype=np.float64)
    ev64 = None if ev is None else np.asarray(ev, dtype=np.float64)
    if not ref.feasible(eu64, ev64):
        return [(m, "skip", "no feasible structure", False) for m in methods]
    u0 = ref.u(eu64, ev64)
    if u0 is None:
        return [(m, "refskip", "reference not certified", False) for m in methods]
    # a random direction on the allowed parts, and the one-sided differences of the
    # reference along it at two steps
    du = rng.standard_normal(f.shape_u) * ~np.isneginf(eu64)
    dv = None
    if ev64 is not None:
        dv = rng.standard_normal(f.shape_v) * ~np.isneginf(ev64)
    big = max(1.0, float(np.abs(eu64[np.isfinite(eu64)]).max(initial=0.0)),
              float(np.abs(ev64[np.isfinite(ev64)]).max(initial=0.0)) if ev64 is not None else 0.0)
    # the step, relative to the scores: the reference's own round-off grows with the
    # scale (at 7.5e3, a relative step of 1e-9 gave differences 1.4e-4 off the closed
    # form that all three methods matched to 1e-16), so large scores take 1e-7
    h = 1e-6 if big <= 100 else 1e-7 * big
    fd = []
    for t in (h, -h, h / 8, -h / 8):
        ut = ref.u(eu64 + t * du, None if ev64 is None else ev64 + t * dv)
        fd.append(None if ut is None else (ut - u0) / t)
    noise = 1e-9 * (1.0 + big * 1e-16 / h * 1e8)
    diff = None
    if all(x is not None for x in fd):
        spread = max(np.abs(x - fd[0]).max() for x in fd[1:])
        if spread <= max(1e-8, noise):
            diff = fd[0]
    g = rng.standard_normal(f.shape_u)
    banned = ref.forbidden(eu64, ev64)
    out = []
    for method in methods:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = sm.solve(f, as_passed(rng, eu, kind), ev, method=method)
                tol_u = 1e-6 * max(1.0, big * ref.relative_accuracy)
                if not np.all(np.isfinite(r.u)) or np.abs(r.u - u0).max() > tol_u:
                    out.append((method, "u", f"|u - ref| = {np.abs(r.u - u0).max():.3g} "
                                f"(side {r.side})", False))
                    continue
                if not r.converged:
                    out.append((method, "converged", f"gap {r.gap:.3g} side {r.side}", False))
                    continue
                bad = [s for s in r.structures if banned(s)]
                if bad:
                    out.append((method, "forbidden", f"{len(bad)} forbidden structures, weights "
                                f"{r.weights[[banned(s) for s in r.structures]]} side {r.side}",
                                False))
                    continue
                jd = r.jvp(du, dv)
                rule = None
                if isinstance(f, sm.TreeFactor) and f.n_words <= 16 and r.side == "facet":
                    rule = tree_rule_jvp(f, r.u, du, big)
                if rule is not None:
                    err = np.abs(jd - rule).max()
                    if err > 1e-8:
                        out.append((method, "rule", f"|jvp - rule| = {err:.3g}", False))
                        continue
                if diff is None:
                    out.append((method, "ok", "", False))
                    continue
                err = np.abs(jd - diff).max()
                if err > 1e-6:
                    out.append((method, "jacobian", f"|jvp - fd| = {err:.3g} side {r.side}", True))
                    continue
                gu, gv = r.vjp(g)
                lhs = float((gu * du).sum() + (0.0 if dv is None else (gv * dv).sum()))
                rhs = float((g * jd).sum())
                if abs(lhs - rhs) > 1e-6 * (1.0 + abs(rhs)) * np.sqrt(g.size):
                    out.append((method, "vjp", f"<vjp g, d> {lhs:.6g} vs <g, jvp d> {rhs:.6g} "
                                f"side {r.side}", True))
                    continue
                out.append((method, "ok", "", True))
        except Exception as e:      # noqa: BLE001 (a harness: every exception is a finding)
            out.append((method, "error", f"{type(e).__name__}: {e}", False))
    return out


def describe(f):
    if isinstance(f, sm.TreeFactor):
        return f"TreeFactor({f.n_words}, single_root={f.single_root})"
    if isinstance(f, sm.MatchingFactor):
        return f"MatchingFactor({f.n_rows}, {f.n_cols})"
    return f"SequenceFactor{tuple(f.shape_u)}"


def run(n, seed=0, families=("tree", "matching", "sequence"), methods=METHODS, verbose=True,
        max_print=10, seconds=None, tree_sizes=(1, 5)):
    """Draw and check n instances (round-robin over families); returns (counts, failures)
    with counts[(family, method)] a Counter of outcomes and failures a list of
    (family, method, outcome, detail, seed, index)."""
    rng = np.random.default_rng(seed)
    counts = defaultdict(Counter)
    failures = []
    refs = {}
    t0 = time.time()
    for i in range(n):
        if seconds is not None and time.time() - t0 > seconds:
            break
        family = families[i % len(families)]
        f = random_factor(rng, family, tree_sizes)
        kind = KINDS[int(rng.integers(len(KINDS)))]
        eu, ev = random_scores(rng, f, kind)
        key = (family, tuple(f.shape_u), getattr(f, "single_root", None))
        if key not in refs:
            refs[key] = reference(f)
        for method, outcome, detail, jac in check_instance(rng, f, eu, ev, kind, methods,
                                                            refs[key]):
            c = counts[(family, method)]
            c["instances"] += 1
            c[outcome] += 1
            c["jacobian checked"] += jac
            if outcome not in ("ok", "skip", "refskip"):
                failures.append((family, method, outcome, detail, describe(f), kind, eu, ev))
                if verbose and len(failures) <= max_print:
                    print(f"FAIL {describe(f)} {method} {kind}: {outcome}: {detail}\n"
                          f"  eta_u={np.array2string(np.asarray(eu), precision=17)}"
                          f"\n  eta_v={None if ev is None else np.asarray(ev).tolist()}",
                          file=sys.stderr)
    return counts, failures


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=3000, help="instances (each solved by every method)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--families", nargs="+", default=["tree", "matching", "sequence"],
                    choices=["tree", "matching", "sequence"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--seconds", type=float, default=None, help="stop after this long")
    ap.add_argument("--tree-sizes", type=int, nargs=2, default=[1, 5], metavar=("LO", "HI"),
                    help="words of the trees drawn (more than 5: the vertex side is the "
                         "reference)")
    ap.add_argument("--log", default=None, help="write every failure, with its scores, here")
    args = ap.parse_args(argv)
    t0 = time.time()
    counts, failures = run(args.n, args.seed, tuple(args.families), tuple(args.methods),
                           seconds=args.seconds, tree_sizes=tuple(args.tree_sizes))
    if args.log:
        with open(args.log, "w") as fh:
            for family, method, outcome, detail, name, kind, eu, ev in failures:
                fh.write(f"{name} {method} {kind}: {outcome}: {detail}\n"
                         f"eta_u = {np.asarray(eu, dtype=np.float64).tolist()!r}\n"
                         f"eta_v = {None if ev is None else np.asarray(ev, np.float64).tolist()!r}\n")
    seq_none = Counter((m, o) for fam, m, o, *_, ev in failures
                       if fam == "sequence" and ev is None and o in ("jacobian", "vjp"))
    print(f"{sum(c['instances'] for c in counts.values())} solves in {time.time() - t0:.0f} s "
          f"(seed {args.seed})")
    for (family, method), c in sorted(counts.items()):
        bad = {k: v for k, v in c.items() if k not in ("instances", "ok", "skip", "refskip",
                                                         "jacobian checked")}
        print(f"{family:9s} {method:11s} solves {c['instances']:7d}  jacobians checked "
              f"{c['jacobian checked']:7d}  no feasible {c['skip']:5d}  reference uncertified "
              f"{c['refskip']:4d}  failures {dict(bad) or 0}")
    if seq_none:
        print("of the sequence failures, Jacobians at eta_v=None (per-position sparsemax): "
              + ", ".join(f"{m} {o} {v}" for (m, o), v in sorted(seq_none.items())))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
