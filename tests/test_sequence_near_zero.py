"""Near-zero sequences on the facet side: degenerate starts (tied rows of eta_u, eta_u = 0)
with tiny transitions, where every transport plan of the path's start is degenerate.

Every solution is certified here independently of the solver: feasibility and the Wolfe
gap from a NumPy Viterbi (test_facet_sequence.check_kkt), and, at sizes that can be
enumerated, the brute-force QP (its reference at tiny scores extrapolates along the ray,
test_facet_sequence.brute_force). Jacobians are checked against central differences of
certified solves where u is differentiable (tied rows of eta_u with random transitions).
"""
import warnings

import numpy as np
import pytest

import sparsemap as sm
from sparsemap._facet_sequence import SequenceFacetSolver

from test_facet_sequence import SOLVED, brute_force, check_kkt


def near_zero(n, S, su, sv, seed=0, tied_rows=False):
    rng = np.random.default_rng(seed)
    eu = su * rng.standard_normal((n, S))
    if tied_rows:
        eu = np.tile(eu[0], (n, 1))
    return eu, sv * rng.standard_normal((n - 1, S, S))


# warm=False: the path from per-position sparsemax, whose start is degenerate here (the
# default, warm=None, takes the warm path at these scores and never meets that start)
WARM = [None, False]


@pytest.mark.parametrize("warm", WARM)
@pytest.mark.parametrize("n, S", [(30, 8), (100, 17)])
@pytest.mark.parametrize("sv", [1e-9, 1e-6, 0.1])
def test_near_zero_cases_converge_certified(n, S, sv, warm):
    """eta_u = 0, eta_v = sv randn (seed 0): solved on the facet side, on the default and
    the "facet" methods, with gap <= 1e-10 (checked here by an independent Viterbi)."""
    eu, ev = near_zero(n, S, 0.0, sv)
    f = sm.SequenceFactor(n, S)
    sol = SequenceFacetSolver(f, decline_peaked=False, warm=warm).solve(eu, ev, budget=10000)
    assert sol.status == SOLVED
    assert check_kkt(eu, ev, sol.u, sol.v, tol=1e-10) <= 1e-10
    for method in ("facet",) + (("auto",) if sv < 0.01 else ()):
        r = sm.solve(f, eu, ev, method=method)
        assert r.side == "facet" and r.converged and r.gap <= 1e-10
        np.testing.assert_allclose(r.u, sol.u, atol=1e-14)


@pytest.mark.parametrize("warm", WARM)
@pytest.mark.parametrize("n, S", [(2, 3), (3, 3), (4, 2), (5, 2), (3, 4)])
@pytest.mark.parametrize("su, sv", [(0.0, 1e-9), (0.0, 1e-4), (0.0, 0.1), (0.0, 1.0),
                                    (1e-9, 1e-9), (1e-4, 1e-4), (0.3, 0.1), (0.3, 1.0)])
def test_degenerate_starts_against_brute_force(n, S, su, sv, warm):
    """Tied rows of eta_u (eta_u = 0 when su = 0) make the start degenerate. (The
    reference needs scores of one scale: SciPy cannot certify 0.3 against 1e-9.)"""
    eu, ev = near_zero(n, S, su, sv, seed=n * 10 + S, tied_rows=True)
    f = sm.SequenceFactor(n, S)
    sol = SequenceFacetSolver(f, decline_peaked=False, warm=warm).solve(eu, ev, budget=10000)
    assert sol.status == SOLVED
    check_kkt(eu, ev, sol.u, sol.v)
    np.testing.assert_allclose(sol.u, brute_force(eu, ev), atol=1e-6 * max(su, sv, 1e-3))


@pytest.mark.parametrize("warm", WARM)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("su, sv", [(0.0, 1e-3), (0.3, 0.1), (0.0, 0.5)])
def test_degenerate_start_jacobian_against_finite_differences(seed, su, sv, warm):
    """At tied rows with random transitions u is differentiable (almost surely): the
    Jacobian (jvp and vjp) against central differences of certified solves."""
    n, S = 6, 4
    eu, ev = near_zero(n, S, su, sv, seed=seed, tied_rows=True)
    f = sm.SequenceFactor(n, S)
    solver = SequenceFacetSolver(f, decline_peaked=False, warm=warm)
    sol = solver.solve(eu, ev)
    assert sol.status == SOLVED
    rng = np.random.default_rng(100 + seed)
    d_u, d_v = rng.standard_normal((n, S)), rng.standard_normal((n - 1, S, S))
    h = 1e-6 * sv
    ends = []
    for sign in (1, -1):
        s = solver.solve(eu + sign * h * d_u, ev + sign * h * d_v)
        assert s.status == SOLVED
        check_kkt(eu + sign * h * d_u, ev + sign * h * d_v, s.u, s.v)
        ends.append(s.u)
    fd = (ends[0] - ends[1]) / (2 * h)
    np.testing.assert_allclose(sol.jvp(d_u, d_v), fd, atol=1e-6 * max(1.0, np.abs(fd).max()))
    g = rng.standard_normal((n, S))
    g_u, g_v = sol.vjp(g)
    assert np.isclose((g * sol.jvp(d_u, d_v)).sum(), (g_u * d_u).sum() + (g_v * d_v).sum(),
                      rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("n, S", [(30, 8), (100, 17)])
@pytest.mark.parametrize("method", ["vertex", "active_set"])
def test_forced_vertex_side_converges_at_near_zero(n, S, method):
    """The vertex side forced at eta_u = 0, eta_v = 1e-9 randn starts from the facet
    side's point and certifies it: gap <= 1e-10, KKT checked by an independent Viterbi,
    u equal to the facet side's; a batch gives the same bits as single solves."""
    eu, ev = near_zero(n, S, 0.0, 1e-9)
    f = sm.SequenceFactor(n, S)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)     # "active_set" names the vertex side
        warnings.simplefilter("error", sm.ConvergenceWarning)
        r = sm.solve(f, eu, ev, method=method)
        rb = sm.solve_batch(f, [eu, eu], [ev, ev], method=method, n_jobs=2)
    assert r.side == "vertex" and r.converged and r.gap <= 1e-10
    assert check_kkt(eu, ev, r.u, r.v, tol=1e-10) <= 1e-10
    np.testing.assert_allclose(r.u, sm.solve(f, eu, ev, method="facet").u, atol=1e-12)
    for b in rb:
        assert np.array_equal(b.u, r.u) and np.array_equal(b.v, r.v)


def test_vertex_side_warning_names_what_works():
    """The active set alone (from a start the caller gives) stalls on a near-zero
    sequence (at 30 x 8, 100,000 iterations left a gap of 1e-8): its warning names the
    default method, which converges there."""
    eu, ev = near_zero(30, 8, 0.0, 1e-9)
    f = sm.SequenceFactor(30, 8)
    with pytest.warns(sm.ConvergenceWarning, match="facet side converges") as rec:
        r = sm.solve(f, eu, ev, method="vertex", max_iter=300, init=[f.map(eu, ev)])
    assert not r.converged and len(rec) == 1
    r = sm.solve(f, eu, ev)
    assert r.converged and r.gap <= 1e-10
    # a converged vertex-side solve says nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sm.solve(f, eu, 0.3 * ev / 1e-9, method="vertex")
