"""Logic factors against definitions written here, brute force and closed forms.

References, none of which goes through the factors' MAP or solver:
- the allowed configurations of each factor, as a predicate on 0/1 vectors, and
  their additional parts n_s, both written from the definitions in docs/factors.rst
  (tests/_reference.py: logic_allowed, logic_extra);
- brute force over those configurations for MAP, including the tie rule;
- the KKT-certified SciPy QP over the enumerated columns for SparseMAP;
- the closed-form projections of tests/_reference.py (sparsemax, clip-then-project
  budgets, XOR-out, OR-out / AND-out, the pairwise factor), and central finite
  differences of those closed forms for the Jacobian.
"""
import itertools
import pickle
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import sparsemap as sm
from sparsemap._factors._logic import _top_k
from sparsemap.testing import (check_jacobian, check_kkt, dense_columns, enumerate_structures,
                               factors, scores)

from _reference import (and_out_projection, box_sum_projection, budget_viterbi,
                        or_out_projection, pairwise_closed_form, simplex_qp, sparsemax, viterbi,
                        xor_out_projection)
from _reference import (logic_allowed as allowed, logic_columns as columns,
                        logic_configurations as configurations, logic_extra as extra)

METHODS = ("auto", "cg", "away_cg", "pairwise_cg", "bpcg")
LINEAR_CG = ("away_cg", "pairwise_cg", "bpcg")


def closed_form(f, eta_u, eta_v=None):
    """SparseMAP u (and v) of f by a closed form, or None where there is none."""
    n = eta_u.shape[0]
    if isinstance(f, sm.XorFactor):
        return sparsemax(eta_u), None
    if isinstance(f, sm.AtMostOneFactor):
        return box_sum_projection(eta_u, hi=1), None
    if isinstance(f, sm.OrFactor):
        return box_sum_projection(eta_u, lo=1), None
    if isinstance(f, sm.BudgetFactor):
        b = min(f.budget, n)
        return box_sum_projection(eta_u, lo=b if f.exact else -np.inf, hi=b), None
    if isinstance(f, sm.XorOutFactor):
        return xor_out_projection(eta_u), None
    if isinstance(f, sm.OrOutFactor):
        return or_out_projection(eta_u), None
    if isinstance(f, sm.AndOutFactor):
        return and_out_projection(eta_u), None
    if isinstance(f, sm.ImplyFactor):
        # an OR over the literals (1 - u[:-1], u[-1]): reflect, project, reflect back
        w = box_sum_projection(np.r_[1.0 - eta_u[:-1], eta_u[-1:]], lo=1)
        return np.r_[1.0 - w[:-1], w[-1:]], None
    if isinstance(f, sm.PairFactor):
        u1, u2, v = pairwise_closed_form(eta_u[0], eta_u[1], eta_v[0])
        return np.array([u1, u2]), np.array([v])
    return None


SMALL = [sm.XorFactor(1), sm.XorFactor(4), sm.AtMostOneFactor(1), sm.AtMostOneFactor(4),
         sm.OrFactor(1), sm.OrFactor(4), sm.BudgetFactor(5, 2), sm.BudgetFactor(5, 2, exact=True),
         sm.BudgetFactor(4, 0), sm.BudgetFactor(4, 4, exact=True), sm.BudgetFactor(3, 7),
         sm.BudgetFactor(5, 1, exact=True), sm.PairFactor(), sm.OrOutFactor(3),
         sm.OrOutFactor(5), sm.AndOutFactor(3), sm.AndOutFactor(5), sm.XorOutFactor(2),
         sm.XorOutFactor(5), sm.SequenceBudgetFactor(1, 1), sm.SequenceBudgetFactor(5, 2),
         sm.SequenceBudgetFactor(5, 2, exact=True), sm.SequenceBudgetFactor(4, 9),
         sm.SequenceBudgetFactor(4, 0, exact=True), sm.SequenceBudgetFactor(6, 6, exact=True),
         sm.ImplyFactor(2), sm.ImplyFactor(3), sm.ImplyFactor(5)]
IDS = [repr(f) for f in SMALL]
CLOSED = [f for f in SMALL if not isinstance(f, sm.SequenceBudgetFactor)]


def solve_quiet(*args, **kwargs):
    """solve() turning a ConvergenceWarning into a test failure."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", sm.ConvergenceWarning)
        return sm.solve(*args, **kwargs)


def draw_scores(f, rng, scale=1.0):
    return scale * rng.standard_normal(f.shape_u), scale * rng.standard_normal(f.shape_v)


# -- structures and the column interface ---------------------------------------------------

@pytest.mark.parametrize("f", SMALL, ids=IDS)
def test_structures_match_definition(f):
    Z, M, N = columns(f)
    got = enumerate_structures(f)
    assert [s.tolist() for s in got] == [z.tolist() for z in Z]
    M_f, N_f = dense_columns(f, got)
    np.testing.assert_array_equal(M_f, M)
    np.testing.assert_array_equal(N_f, N)
    for z in Z:
        f.check_structure(z)
        f.check_structure(z.astype(bool))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(SMALL), st.integers(0, 2 ** 32 - 1))
def test_score_overlap_add_column(f, seed):
    rng = np.random.default_rng(seed)
    Z = configurations(f)
    s, t = Z[rng.integers(len(Z))], Z[rng.integers(len(Z))]
    eu, ev = draw_scores(f, rng)
    assert f.score(s, eu, ev) == pytest.approx(s @ eu + extra(f, s) @ ev.ravel(), abs=1e-12)
    assert f.overlap(s, t) == float(s @ t)
    u, v = np.zeros(f.shape_u), np.zeros(f.shape_v)
    f.add_column(s, 0.25, u, v)
    np.testing.assert_array_equal(u, 0.25 * s)
    np.testing.assert_array_equal(v.ravel(), 0.25 * extra(f, s))
    m, n = f.vertex(s)
    assert m.shape == f.shape_u and n.shape == f.shape_v


# -- MAP ------------------------------------------------------------------------------------

def brute_force_map(f, eu, ev):
    """The best configuration under the documented tie rule: highest score, then
    fewest variables on, then the sorted list of "on" indices lexicographically
    smallest."""
    def key(z):
        return (-(z @ eu + extra(f, z) @ ev.ravel()), int(z.sum()), np.flatnonzero(z).tolist())
    return min(configurations(f), key=key)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SMALL), st.integers(0, 2 ** 32 - 1),
       st.sampled_from(["gaussian", "ties", "zeros"]))
def test_map_brute_force(f, seed, kind):
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        eu, ev = draw_scores(f, rng)
    elif kind == "ties":    # small integers: sums are exact, so ties are real ties
        eu = rng.integers(-2, 3, f.shape_u).astype(float)
        ev = rng.integers(-2, 3, f.shape_v).astype(float)
    else:
        eu, ev = np.zeros(f.shape_u), np.zeros(f.shape_v)
    s = f.map(eu, ev)
    best = brute_force_map(f, eu, ev)
    assert s.dtype == np.intp and s.shape == f.shape_u
    if kind == "gaussian":   # no ties: the best score (round-off may differ in the last bit)
        assert f.score(s, eu, ev) == pytest.approx(f.score(best, eu, ev), abs=1e-12)
        assert allowed(f)(s)
    else:
        assert s.tolist() == best.tolist()


@pytest.mark.parametrize("f", SMALL, ids=IDS)
def test_map_ties_exhaustive(f):
    """Every unary score vector in {-1, 0, 1}^n (and eta_v in {-1, 0, 1} for the pair;
    a sample of transition scores for sequences): the tie rule, exactly."""
    rng = np.random.default_rng(5)
    grid = [np.array(e, dtype=float) for e in itertools.product((-1, 0, 1), repeat=f.n_u)]
    for eu in grid:
        evs = [np.array([w]) for w in (-1.0, 0.0, 1.0)] if f.n_v == 1 else \
            [rng.integers(-1, 2, f.shape_v).astype(float) for _ in range(2)]
        for ev in evs:
            assert f.map(eu, ev).tolist() == brute_force_map(f, eu, ev).tolist(), (eu, ev)


@pytest.mark.parametrize("n,k", [(1000, 0), (1000, 1), (1000, 37), (1000, 500), (1000, 999),
                                 (7, 3)])
def test_budget_map_large_against_sort(n, k):
    rng = np.random.default_rng(n + k)
    for eu in (rng.standard_normal(n), rng.integers(-3, 4, n).astype(float), np.zeros(n)):
        order = np.lexsort((np.arange(n), -eu))      # by score, then index
        exact = np.zeros(n, int)
        exact[order[:k]] = 1
        np.testing.assert_array_equal(sm.BudgetFactor(n, k, exact=True).map(eu), exact)
        at_most = exact * (eu > 0)
        np.testing.assert_array_equal(sm.BudgetFactor(n, k).map(eu), at_most)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=80), st.data())
def test_top_k_selection_and_heap_fallback(values, data):
    x = np.array(values, dtype=float)
    k = data.draw(st.integers(0, x.size))
    ref = np.sort(np.lexsort((np.arange(x.size), -x))[:k])
    np.testing.assert_array_equal(_top_k(x, k), ref)
    # depth 0 and 1: heap selection of the whole range, and after one partition
    np.testing.assert_array_equal(_top_k(x, k, depth=0), ref)
    np.testing.assert_array_equal(_top_k(x, k, depth=1), ref)


def test_top_k_sorted_inputs():
    # sorted, reversed and constant inputs, the classic bad cases of quickselect
    for x in (np.arange(2000.0), np.arange(2000.0)[::-1], np.ones(2000)):
        for k in (1, 999, 1000, 1999):
            ref = np.sort(np.lexsort((np.arange(x.size), -x))[:k])
            np.testing.assert_array_equal(_top_k(x, k), ref)


@pytest.mark.parametrize("n", [1, 2, 17, 40])
def test_sequence_budget_map_against_numpy_dp(n):
    rng = np.random.default_rng(n)
    for budget in sorted({0, 1, 3, n // 2, n, n + 2}):
        for exact in (False, True):
            if exact and budget > n:
                continue
            f = sm.SequenceBudgetFactor(n, budget, exact=exact)
            for _ in range(3):
                eu, ev = rng.standard_normal(n), rng.standard_normal((n - 1, 2, 2))
                s = f.map(eu, ev)
                assert allowed(f)(s)
                assert f.score(s, eu, ev) == pytest.approx(budget_viterbi(eu, ev, budget, exact),
                                                           rel=1e-12, abs=1e-12)


def test_sequence_budget_without_a_limit_is_a_two_state_chain():
    rng = np.random.default_rng(3)
    n = 50
    for _ in range(5):
        eu, ev = rng.standard_normal(n), rng.standard_normal((n - 1, 2, 2))
        s = sm.SequenceBudgetFactor(n, n).map(eu, ev)
        _, best = viterbi(np.c_[np.zeros(n), eu], ev)
        assert sm.SequenceBudgetFactor(n, n).score(s, eu, ev) == pytest.approx(best, rel=1e-12)


# -- SparseMAP ------------------------------------------------------------------------------

@pytest.mark.parametrize("f", SMALL, ids=IDS)
def test_sparsemap_against_qp_and_closed_form(f):
    rng = np.random.default_rng(len(repr(f)))
    Z, M, N = columns(f)
    for trial in range(6):
        eu, ev = draw_scores(f, rng, scale=[0.3, 1.0, 3.0][trial % 3])
        r = solve_quiet(f, eu, ev)
        assert r.converged
        check_kkt(f, r, eu, ev)
        ref = simplex_qp(M, M.T @ eu + N.T @ ev.ravel())
        assert ref is not None, "the SciPy reference found no certified solution"
        u_qp, y_qp = ref[0], ref[1]
        np.testing.assert_allclose(r.u, u_qp, atol=1e-8)
        cf = closed_form(f, eu, ev)
        if cf is not None:
            # the two references agree, and the solver matches the closed form tightly
            np.testing.assert_allclose(cf[0], u_qp, atol=1e-8)
            np.testing.assert_allclose(r.u, cf[0], atol=1e-12)
            if cf[1] is not None:
                np.testing.assert_allclose(cf[1], N @ y_qp, atol=1e-8)
                np.testing.assert_allclose(r.v, cf[1], atol=1e-12)


LARGE = [sm.XorFactor(200), sm.AtMostOneFactor(200), sm.OrFactor(200), sm.BudgetFactor(200, 20),
         sm.BudgetFactor(200, 150, exact=True), sm.XorOutFactor(200), sm.OrOutFactor(200),
         sm.AndOutFactor(200), sm.ImplyFactor(200)]


@pytest.mark.parametrize("f", LARGE, ids=[repr(f) for f in LARGE])
def test_sparsemap_large_against_closed_form(f):
    rng = np.random.default_rng(f.n_u)
    shifts = {sm.OrFactor: -2.0, sm.AndOutFactor: 1.0, sm.ImplyFactor: 1.0}   # constraints bind
    for scale in (0.1, 1.0, 10.0):
        eu = scale * rng.standard_normal(f.n_u) + shifts.get(type(f), 0.0)
        r = solve_quiet(f, eu)
        np.testing.assert_allclose(r.u, closed_form(f, eu)[0], atol=1e-10)


@pytest.mark.parametrize("c", [(0.5, 0.5, 0.4), (0.9, 0.2, -0.5), (0.8, 0.7, -0.6),
                               (-0.3, 0.4, 2.0), (1.5, -1.0, 0.3), (-1.0, -1.0, -1.0)])
def test_pair_closed_form_cases(c):
    f = sm.PairFactor()
    r = solve_quiet(f, np.array(c[:2]), np.array(c[2:]))
    u1, u2, v = pairwise_closed_form(*c)
    np.testing.assert_allclose(np.r_[r.u, r.v], [u1, u2, v], atol=1e-12)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("f", SMALL, ids=IDS)
def test_every_method(f, method):
    rng = np.random.default_rng(7)
    eu, ev = draw_scores(f, rng)
    ref = solve_quiet(f, eu, ev, tol=1e-14)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sm.ConvergenceWarning)   # vanilla CG is sublinear
        r = sm.solve(f, eu, ev, method=method, max_iter=5000)
    if r.converged:
        check_kkt(f, r, eu, ev, atol=1e-6)
    # 1-strong convexity in u: ||u - u*||^2 <= 2 (f - f*) <= 2 gap
    assert np.linalg.norm(r.u - ref.u) <= np.sqrt(2 * max(r.gap, 0.0)) + 1e-9
    if method != "cg":
        assert r.converged
        np.testing.assert_allclose(r.u, ref.u, atol=1e-9)
        d_u, d_v = draw_scores(f, rng)
        np.testing.assert_allclose(r.jvp(d_u, d_v), ref.jvp(d_u, d_v), atol=1e-8)
        g_u, g_v = r.vjp(d_u)
        h_u, h_v = ref.vjp(d_u)
        np.testing.assert_allclose(g_u, h_u, atol=1e-8)
        np.testing.assert_allclose(g_v, h_v, atol=1e-8)


# -- Jacobian -------------------------------------------------------------------------------

@pytest.mark.parametrize("f", SMALL, ids=IDS)
def test_jacobian_finite_differences(f):
    rng = np.random.default_rng(11)
    n_checked = 0
    for trial in range(4):
        eu, ev = draw_scores(f, rng, scale=[0.5, 2.0][trial % 2])
        rep = check_jacobian(f, eu, ev, n_directions=3, rng=trial, min_checked=0)
        n_checked += rep.n_checked
    assert n_checked >= 6


def closed_form_fd(f, eu, ev, d_u, d_v, h=1e-6):
    """Central difference of the closed-form u along (d_u, d_v)."""
    up = closed_form(f, eu + h * d_u, ev + h * d_v)[0]
    um = closed_form(f, eu - h * d_u, ev - h * d_v)[0]
    return (up - um) / (2 * h)


@pytest.mark.parametrize("f", CLOSED + [sm.BudgetFactor(40, 10), sm.OrOutFactor(30),
                                        sm.AndOutFactor(30), sm.XorOutFactor(30)],
                         ids=[repr(f) for f in CLOSED] + ["Budget40", "OrOut30", "AndOut30",
                                                          "XorOut30"])
def test_jacobian_against_closed_form_differences(f):
    rng = np.random.default_rng(13)
    n_checked = 0
    for _ in range(8):
        eu, ev = draw_scores(f, rng)
        r = solve_quiet(f, eu, ev)
        d_u, d_v = draw_scores(f, rng)
        fd = closed_form_fd(f, eu, ev, d_u, d_v)
        fd2 = closed_form_fd(f, eu, ev, d_u, d_v, h=1e-7)
        if not np.allclose(fd, fd2, atol=1e-6):     # a kink within the step
            continue
        n_checked += 1
        np.testing.assert_allclose(r.jvp(d_u, d_v), fd, atol=1e-6)
        # the transpose: <vjp(g), d> == <g, fd>
        g = rng.standard_normal(f.shape_u)
        g_u, g_v = r.vjp(g)
        assert g_u @ d_u + g_v.ravel() @ d_v.ravel() == pytest.approx(g @ fd, abs=1e-6)
    assert n_checked >= 5


# -- the all-zero structure (m_s = 0) -------------------------------------------------------

ZERO_CASES = [(sm.AtMostOneFactor(3), [-0.2, -0.5, -1.0], None),
              (sm.BudgetFactor(4, 2), [-0.1, -2.0, -0.3, -0.4], None),
              (sm.PairFactor(), [-0.5, -0.2], [-1.0]),
              (sm.PairFactor(), [-0.5, -0.2], [0.3]),
              (sm.OrOutFactor(3), [0.2, 0.1, -1.0], None),
              (sm.XorOutFactor(3), [0.2, 0.1, -1.0], None),
              (sm.SequenceBudgetFactor(3, 1), [-1.0, -0.5, -0.2], np.zeros((2, 2, 2)))]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("f,eu,ev", ZERO_CASES, ids=[repr(c[0]) for c in ZERO_CASES])
def test_all_zero_structure_alone(f, eu, ev, method):
    eu = np.array(eu)
    r = solve_quiet(f, eu, ev, method=method)
    assert r.converged
    assert [s.tolist() for s in r.structures] == [[0] * f.n_u]
    np.testing.assert_array_equal(r.weights, [1.0])
    np.testing.assert_array_equal(r.u, np.zeros(f.shape_u))
    assert r.gap <= 1e-12
    d = np.random.default_rng(0).standard_normal(f.shape_u)
    np.testing.assert_array_equal(r.jvp(d, np.ones(f.shape_v)), np.zeros(f.shape_u))
    g_u, g_v = r.vjp(d)
    np.testing.assert_array_equal(g_u, np.zeros(f.shape_u))
    np.testing.assert_array_equal(g_v, np.zeros(f.shape_v))


MIXED_ZERO = [(sm.AtMostOneFactor(3), [0.3, -0.5, 0.1], None, [0.3, 0.0, 0.1]),
              (sm.BudgetFactor(3, 2), [0.3, 0.2, -1.0], None, [0.3, 0.2, 0.0]),
              (sm.PairFactor(), [0.4, 0.3], [-1.0], [0.4, 0.3])]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("f,eu,ev,u", MIXED_ZERO, ids=[repr(c[0]) for c in MIXED_ZERO])
def test_all_zero_structure_in_a_support(f, eu, ev, u, method):
    """u = clip(eta): the zero structure carries the remaining weight; J = diag(0 < u < 1)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sm.ConvergenceWarning)
        r = sm.solve(f, np.array(eu), ev, method=method, max_iter=20_000)
    np.testing.assert_allclose(r.u, u, atol=1e-6 if method == "cg" else 1e-12)
    if method == "cg":
        return
    assert [0] * f.n_u in [s.tolist() for s in r.structures]
    J = np.array([r.jvp(e) for e in np.eye(f.n_u)]).T
    np.testing.assert_allclose(J, np.diag((np.array(u) > 0).astype(float)), atol=1e-12)


# -- hypothesis: the strategies of sparsemap.testing draw these factors --------------------

@settings(max_examples=100, deadline=None)
@given(factors(families="logic").flatmap(lambda f: st.tuples(st.just(f), scores(f))))
def test_logic_family_kkt(problem):
    f, (eu, ev) = problem
    r = solve_quiet(f, eu, ev)
    check_kkt(f, r, eu, ev)
    cf = closed_form(f, eu, ev)
    if cf is not None:
        np.testing.assert_allclose(r.u, cf[0], atol=1e-9 * max(1.0, np.abs(eu).max()))


# -- construction, pickling, bad input ------------------------------------------------------

@pytest.mark.parametrize("f", SMALL, ids=IDS)
def test_pickle_and_repr(f):
    g = pickle.loads(pickle.dumps(f))
    assert type(g) is type(f) and repr(g) == repr(f)
    assert g.shape_u == f.shape_u and g.shape_v == f.shape_v
    assert g._init_args() == f._init_args() and g._init_kwargs() == f._init_kwargs()
    assert g == f and hash(g) == hash(f)
    assert eval(repr(f), {"np": np}, vars(sm)) == f


def test_init_args_and_kwargs():
    f = sm.BudgetFactor(5, 2, exact=True)
    assert f._init_args() == (5, 2) and f._init_kwargs() == {"exact": True}
    assert repr(f) == "BudgetFactor(5, 2, exact=True)"
    g = pickle.loads(pickle.dumps(f))
    assert (g.n, g.budget, g.exact) == (5, 2, True)
    g = pickle.loads(pickle.dumps(sm.SequenceBudgetFactor(4, 1, exact=np.True_)))
    assert (g.n, g.budget, g.exact) == (4, 1, True)
    assert repr(sm.PairFactor()) == "PairFactor()" and sm.PairFactor()._init_args() == ()
    assert repr(sm.XorOutFactor(4)) == "XorOutFactor(4)"
    assert sm.BudgetFactor(3, 9).budget == 9          # a budget above n: no limit


@pytest.mark.parametrize("make,match", [
    (lambda: sm.XorFactor(0), "n: expected a positive integer"),
    (lambda: sm.AtMostOneFactor(2.0), "n: expected a positive integer"),
    (lambda: sm.OrFactor(True), "n: expected a positive integer"),
    (lambda: sm.OrOutFactor(2), r"n: expected an integer >= 3"),
    (lambda: sm.AndOutFactor(2), r"n: expected an integer >= 3"),
    (lambda: sm.XorOutFactor(1), r"n: expected an integer >= 2"),
    (lambda: sm.ImplyFactor(1), r"n: expected an integer >= 2 \(at least one premise"),
    (lambda: sm.ImplyFactor(3.0), "n: expected a positive integer"),
    (lambda: sm.BudgetFactor(3, -1), "budget: expected a non-negative integer"),
    (lambda: sm.BudgetFactor(3, 1.5), "budget: expected a non-negative integer"),
    (lambda: sm.BudgetFactor(3, True), "budget: expected a non-negative integer"),
    (lambda: sm.BudgetFactor(3, 4, exact=True), "budget: exactly 4 of n=3 .* infeasible"),
    (lambda: sm.BudgetFactor(3, 1, exact="yes"), "exact: expected a bool"),
    (lambda: sm.BudgetFactor(3, 1, exact=2), "exact: expected a bool"),
    (lambda: sm.BudgetFactor(3, 1, exact=None), "exact: expected a bool"),
    (lambda: sm.SequenceBudgetFactor(0, 1), "n: expected a positive integer"),
    (lambda: sm.SequenceBudgetFactor(3, -2), "budget: expected a non-negative integer"),
    (lambda: sm.SequenceBudgetFactor(3, 5, exact=True), "budget: exactly 5 of n=3"),
    (lambda: sm.SequenceBudgetFactor(3, 1, exact=0.5), "exact: expected a bool"),
    (lambda: sm.SequenceBudgetFactor(100_000, 30_000), "n, budget: the MAP table"),
])
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("f,s,match", [
    (sm.XorFactor(3), [0, 0, 0], "s: expected exactly one variable on, 0 are"),
    (sm.XorFactor(3), [1, 1, 0], "s: expected exactly one variable on, 2 are"),
    (sm.XorFactor(3), [0, 2, 0], r"s: expected 0/1 entries, got \[0, 2, 0\]"),
    (sm.XorFactor(3), [0, -1, 1], "s: expected 0/1 entries"),
    (sm.XorFactor(3), [0, 1], r"s: expected shape \(3,\)"),
    (sm.XorFactor(3), [0, 0.5, 1], "s: expected integers"),
    (sm.AtMostOneFactor(3), [1, 0, 1], "s: expected at most one variable on, 2 are"),
    (sm.OrFactor(3), [0, 0, 0], "s: expected at least one variable on"),
    (sm.BudgetFactor(4, 2), [1, 1, 1, 0], "s: expected at most budget=2 variables on, 3 are"),
    (sm.BudgetFactor(4, 2, exact=True), [1, 0, 0, 0], "s: expected exactly budget=2"),
    (sm.PairFactor(), [1, 2], "s: expected 0/1 entries"),
    (sm.OrOutFactor(3), [1, 0, 0], r"s: expected the last variable to be the OR .*\[1, 0, 0\]"),
    (sm.OrOutFactor(3), [0, 0, 1], "s: expected the last variable to be the OR"),
    (sm.AndOutFactor(3), [1, 0, 1], "s: expected the last variable to be the AND"),
    (sm.AndOutFactor(3), [1, 1, 0], "s: expected the last variable to be the AND"),
    (sm.XorOutFactor(3), [1, 1, 1], "s: expected at most one of the first n - 1 variables on"),
    (sm.XorOutFactor(3), [1, 0, 0], "s: expected the last variable on exactly when"),
    (sm.XorOutFactor(3), [0, 0, 1], "s: expected the last variable on exactly when"),
    (sm.ImplyFactor(3), [1, 1, 0], r"s: expected the last variable on when all the others are"),
    (sm.ImplyFactor(2), [1, 0], r"s: expected the last variable on when all the others are"),
    (sm.SequenceBudgetFactor(3, 1), [1, 1, 0], "s: expected at most budget=1 positions on"),
    (sm.SequenceBudgetFactor(3, 2, exact=True), [1, 0, 0], "s: expected exactly budget=2"),
])
def test_bad_structures(f, s, match):
    with pytest.raises(ValueError, match=match):
        f.vertex(s)


def test_bad_scores():
    with pytest.raises(ValueError, match=r"eta_u: expected shape \(3,\)"):
        sm.XorFactor(3).map(np.zeros(4))
    with pytest.raises(ValueError, match=r"eta_v: expected shape \(1,\)"):
        sm.PairFactor().map(np.zeros(2), np.zeros(2))
    with pytest.raises(ValueError, match=r"eta_v: expected shape \(2, 2, 2\)"):
        sm.SequenceBudgetFactor(3, 1).map(np.zeros(3), np.zeros((3, 2)))
    with pytest.raises(ValueError, match="eta_u: contains non-finite"):
        sm.solve(sm.BudgetFactor(3, 1), [0.0, np.nan, 1.0])


# -- masks: -inf forbids a variable being on (or, for eta_v, a pair / transition) ----------

def masked_draws(f, rng, n_draws=6, p=0.3):
    """Feasible masked scores for f and the indices of the allowed configurations."""
    Z, M, N = columns(f)
    out = []
    while len(out) < n_draws:
        mu, mv = rng.random(f.shape_u) < p, rng.random(f.shape_v) < p
        ok = [k for k in range(len(Z)) if not (M[:, k] @ mu.ravel() or N[:, k] @ mv.ravel())]
        if ok:
            eu, ev = draw_scores(f, rng)
            out.append((np.where(mu, -np.inf, eu), np.where(mv, -np.inf, ev), mu, mv, ok))
    return out


@pytest.mark.parametrize("f", SMALL, ids=IDS)
def test_masks(f):
    rng = np.random.default_rng(21)
    Z, M, N = columns(f)
    for eu, ev, mu, mv, ok in masked_draws(f, rng):
        r = solve_quiet(f, eu, ev)
        assert np.all(r.u[mu] == 0.0) and np.all(r.v[mv] == 0.0)
        for s in r.structures + [f.map(eu, ev)]:
            assert not np.any(s[mu]) and not np.any(extra(f, s)[mv.ravel()])
        # brute force over the allowed configurations only
        eu0, ev0 = np.where(mu, 0.0, eu), np.where(mv, 0.0, ev).ravel()
        theta = M[:, ok].T @ eu0 + N[:, ok].T @ ev0
        u_ref = simplex_qp(M[:, ok], theta)[0]
        np.testing.assert_allclose(r.u, u_ref, atol=1e-8)
        assert f.score(f.map(eu, ev), eu0, ev0.reshape(f.shape_v)) == \
            pytest.approx(theta.max(), abs=1e-12)
        d = rng.standard_normal(f.shape_u)
        assert np.all(r.jvp(d)[mu] == 0.0) and np.all(r.vjp(d)[0][mu] == 0.0)


@pytest.mark.parametrize("f,eu,ev", [
    (sm.XorFactor(3), [-np.inf] * 3, None),
    (sm.OrFactor(2), [-np.inf, -np.inf], None),
    (sm.BudgetFactor(3, 2, exact=True), [-np.inf, 0.0, -np.inf], None),
    (sm.SequenceBudgetFactor(3, 2, exact=True), [0.0, -np.inf, -np.inf], np.zeros((2, 2, 2))),
    (sm.SequenceBudgetFactor(3, 1, exact=True), [0.0, 0.0, 0.0],
     np.full((2, 2, 2), -np.inf)),                  # every transition forbidden
])
def test_masks_infeasible(f, eu, ev):
    msg = rf"^eta_u(, eta_v)?: every structure of {type(f).__name__} uses a forbidden part"
    with pytest.raises(ValueError, match=msg):
        sm.solve(f, np.array(eu), ev)


def test_imply_binding_against_closed_form():
    """Premises mostly on and the conclusion off: the one forbidden configuration is near."""
    rng = np.random.default_rng(17)
    n_binding = 0
    for n in (2, 3, 50):
        f = sm.ImplyFactor(n)
        for scale in (0.1, 0.5, 2.0):
            eu = np.r_[2.0 + scale * rng.standard_normal(n - 1), -1.0 + scale * rng.standard_normal()]
            r = solve_quiet(f, eu)
            ref = closed_form(f, eu)[0]
            n_binding += ref[:-1].sum() - ref[-1] >= n - 2 - 1e-12   # the constraint binds
            np.testing.assert_allclose(r.u, ref, atol=1e-10)
    assert n_binding >= 6
