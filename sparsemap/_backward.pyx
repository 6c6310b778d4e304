"""The backward set of an active-set solve, the solution record that keeps it, Jacobian products.

The Jacobian of ``u`` (Prop. 1) is the projection onto the directions of the
optimal face. A converged support may span only part of that face (flat
scores): ``_complete`` appends weight-0 rows until their affine hull spans it,
certified by MAP calls along random directions. Where ``n`` is not an affine
function of ``m`` on the face (ties in ``eta_v``), ``_fibered`` sees it and
``_untie`` takes the backward set of a solve at ``eta_v + delta r`` instead (a
one-sided derivative).

``_solve_one`` runs one active-set solve (:mod:`sparsemap._active_set`) and
prepares its backward set (``_finish``) into a ``_Sol``: support, weights,
``u``, ``v`` and the backward set's Cholesky factor in one C block, owned by a
``_Solution`` (in a padded batch, by a ``_Solutions``) until a field is asked
for. ``_jacobian_apply`` applies a solution's Jacobian, or its transpose, to a
vector. The batch runner (:mod:`sparsemap._batch`) calls both without the GIL.
``reduce_support`` gives a support from another solver (conditional gradient)
its backward set.

Result types. The record is the C struct ``_Sol`` (no Python object, so that
threads fill it without the GIL). Two owners hold records: ``_Solution``, one
solve's (what :class:`sparsemap.SparseMAPResult` wraps), and ``_Solutions``, a
padded batch's C array of records (the torch layer's path, with no Python
object per problem). The facet side's own ``FacetSolution``
(:mod:`sparsemap._facet`) serves its tests; here its state lives in the record.
"""
import numpy as np

from cpython.ref cimport PyObject
from libc.math cimport fabs, INFINITY
from libc.stdlib cimport calloc, malloc, free
from libc.string cimport memcpy, memset

from sparsemap._active_set cimport (CONVERGED, FACE_INCOMPLETE, INFEASIBLE, STALLED, _Workspace,
                                    _copy_out, _dot, _gap_scale, _hash_structure, _now,
                                    _iterate, _perturb, _point, _trsv_lower,
                                    _trsv_lower_t)
from sparsemap._facet cimport (FACET_SOLVED, FacetSolver, FacetState, state_clear,
                               state_copy, state_resize)
from sparsemap._factors._base cimport Factor

from sparsemap._active_set import notify

SIDE_NAMES = {SIDE_VERTEX: "vertex", SIDE_FACET: "facet"}
# The codes of _Solution.fallback, as Python names them.
FALLBACK_STATUS_NONE, FALLBACK_STATUS_DECLINED, FALLBACK_STATUS_BUDGET, FALLBACK_STATUS_GAP = (
    FALLBACK_NONE, FALLBACK_DECLINED, FALLBACK_BUDGET, FALLBACK_GAP)


# -- face completion --------------------------------------------------------------
# The Jacobian of u is the projection onto the directions of the optimal face: the
# face of the marginal polytope whose vertices all score the maximum at the adjusted
# scores eta - [u; 0]. A converged support lies in that face but may span only part
# of it (flat scores), so after a solve the backward set is completed: weight-0 rows
# are appended until their affine hull spans the face, certified by MAP calls along
# random directions orthogonal to the rows' span (see _complete).

FACE_STATUS_CERTIFIED, FACE_STATUS_BUDGET, FACE_STATUS_UNRESOLVED, FACE_STATUS_FIBERED = (
    FACE_CERTIFIED, FACE_BUDGET, FACE_UNRESOLVED, FACE_FIBERED)

# Scores within FACE_TIE * max(1, |score|) (plus the solve's gap) of the maximum tie.
cdef double FACE_TIE = 1e-10
# First perturbation size, relative to max(1, |score|); shrunk when a probe leaves the face.
cdef double FACE_EPS = 1e-6
# The perturbation is never shrunk below FACE_MIN tie tolerances (then
# FACE_UNRESOLVED).
cdef double FACE_MIN = 64.0
# The fiber check (_fibered) counts a tied vertex off the rows' map when its phi is off
# the rows' value by more than FIBER_ROUND times the size of the terms summed (round-
# off), however little the probe moved its score: as in the face completion, the
# difference is the random direction's component along the fiber, which can be
# small. A bar of 4 tie tolerances on the probe's move (4e-4 of the direction there)
# missed a crossover of two 17-tag sequences whose component along the fixed tie
# direction is 8.1e-5, and the Jacobian was then not the one along it.
cdef double FIBER_ROUND = 1e-9
# Most rows of a completed backward set: its Cholesky factor (cap x cap doubles, the
# capacity doubling) then stays within 512 MiB, which the solve reaches by itself once
# its support passes 4096 (projective trees of 100 and 120 words at scale 0.01: faces
# of 4872 and 6529 trees, supports of 4206 and 5545; benchmarks/bench_projective.py).
# Reaching it ends the completion uncertified (FACE_BUDGET).
cdef Py_ssize_t FACE_MAX_ROWS = 8192
# Fixed seed: completion is deterministic, and batches stay bitwise equal to solves.
cdef unsigned long long FACE_SEED = 0x5eed5eed2018ULL


def max_backward_rows():
    """The backward set's cap, FACE_MAX_ROWS (for the solvers' layer's messages)."""
    return FACE_MAX_ROWS


def _set_max_backward_rows(Py_ssize_t rows):
    """Set the cap and return the old one (tests: the cap's path without 4096 rows)."""
    global FACE_MAX_ROWS
    old = FACE_MAX_ROWS
    FACE_MAX_ROWS = rows
    return old


cdef struct _Seen:
    # Hashes (| 1, so that 0 marks an empty slot) of structures already in the rows or
    # already tried, in an open-addressing table of size m (a power of 2) kept at most
    # half full. A false match (two structures, one hash) only skips a candidate.
    unsigned long long* table
    Py_ssize_t m, count


cdef int _seen_init(_Seen* seen, Py_ssize_t expected) except -1 nogil:
    seen.m = 16
    seen.count = 0
    while seen.m < 2 * expected:
        seen.m *= 2
    seen.table = <unsigned long long*> calloc(seen.m, sizeof(unsigned long long))
    if seen.table == NULL:
        with gil:
            raise MemoryError()
    return 0


cdef inline Py_ssize_t _seen_slot(const unsigned long long* table, Py_ssize_t m,
                                  unsigned long long h) noexcept nogil:
    """The slot of h in a table of size m (a power of 2): h's own, or the empty one
    where it goes (linear probing)."""
    cdef Py_ssize_t i = <Py_ssize_t> (h & <unsigned long long> (m - 1))
    while table[i] != 0 and table[i] != h:
        i = (i + 1) & (m - 1)
    return i


cdef int _seen_add(_Seen* seen, const int* s, Py_ssize_t k) except -1 nogil:
    """Add s; 1 if it is new, 0 if it was there."""
    cdef unsigned long long h = _hash_structure(s, k) | 1
    cdef unsigned long long* old = seen.table
    cdef Py_ssize_t j, m = seen.m
    cdef Py_ssize_t i = _seen_slot(old, m, h)
    if old[i] == h:
        return 0
    old[i] = h
    seen.count += 1
    if 2 * seen.count > m:
        seen.table = <unsigned long long*> calloc(2 * m, sizeof(unsigned long long))
        if seen.table == NULL:
            seen.table = old
            with gil:
                raise MemoryError()
        seen.m = 2 * m
        for j in range(m):
            if old[j] != 0:
                seen.table[_seen_slot(seen.table, 2 * m, old[j])] = old[j]
        free(old)
    return 1


cdef int _from_log(_Workspace ws, _Seen* seen, double s_ref, double tau) except -1 nogil:
    """Append the logged structures that tie at the adjusted scores (face vertices the
    solve met and dropped), skipping those seen (the rows, hashed into seen)."""
    cdef Py_ssize_t t, k = ws.k
    cdef double st
    for t in range(ws.n_log):
        if not _seen_add(seen, ws.log + t * k, k):
            continue
        ws.f.c_score(ws.log + t * k, ws.adj, ws.eta_v, &st)
        if st - s_ref >= -tau:
            if ws.nI + 1 >= FACE_MAX_ROWS:
                break
            ws._append_face(ws.log + t * k)
    return 0


cdef int _probe_random(_Workspace ws, _Seen* seen, Py_ssize_t budget,
                       Py_ssize_t* n_calls, double s_ref, double tau, double* eps,
                       unsigned long long* rng) except -1 nogil:
    """Append face vertices found by MAP at theta + eps g for random g, not projected.

    Until the rows span most of the face, the maximiser of a random direction over
    the face is almost always a new, affinely independent vertex (measured on
    trees: every probe but the last), so this finds the bulk of the face for one
    MAP call and one Cholesky row each, without the projections that _complete's
    certifying directions cost. Stops at the first probe that brings nothing new
    (a row, or a vertex in the rows' hull). Returns FACE_CERTIFIED to go on (the
    certification is _complete's), else FACE_BUDGET or FACE_UNRESOLVED.
    """
    cdef double st
    while True:
        if n_calls[0] >= budget or ws.nI + 1 >= FACE_MAX_ROWS:
            return FACE_BUDGET
        _perturb(ws.adj, eps[0], ws.pert, ws.n_u, rng)
        ws.f.c_map(ws.pert, ws.eta_v, ws.snew, ws.work)
        ws.n_map += 1
        n_calls[0] += 1
        ws.f.c_score(ws.snew, ws.adj, ws.eta_v, &st)
        if st - s_ref < -tau:
            # past the face's margin: a smaller step (the certifying loop shrinks it
            # the same way, and gives up at the same floor)
            eps[0] /= 4
            if eps[0] < FACE_MIN * tau:
                return FACE_UNRESOLVED
            continue
        if not _seen_add(seen, ws.snew, ws.k) or ws._append_face(ws.snew) == 0:
            return FACE_CERTIFIED


cdef int _fresh_direction(_Workspace ws, double* d, unsigned long long* rng) except -1 nogil:
    """d = g - J g for a random g: orthogonal to the rows' span. Its entries on
    forbidden parts (no row uses them, so J ignores them) are _complete's to zero."""
    cdef Py_ssize_t t, k = ws.k
    _perturb(NULL, 1.0, d, ws.n_u, rng)
    if ws.nI + 1 >= ws.cap:
        ws._grow(2 * ws.cap)
    for t in range(ws.nI):
        ws.f.c_score(ws.S + t * k, d, NULL, &ws.x1[t])
    ws._jacobian(ws.x1)
    for t in range(ws.nI):
        ws.f.c_add(ws.S + t * k, -ws.x1[t], d, NULL)
    return 0


cdef int _complete(_Workspace ws, Py_ssize_t budget, double gap, _FaceScale* fs,
                   const double* u=NULL) except -1 nogil:
    """Append weight-0 rows to a solved workspace until they span the optimal face.

    With theta = eta_u - u (eta_v unchanged), every face vertex scores the
    maximum s*, which the rows (the support) attain. One random g is projected
    to d = g - J g (J: Prop. 1 on the rows, the orthogonal projector onto the
    span of their differences; so d . m_t is one constant c over the rows'
    affine hull) and MAP is called at theta + eps d. A returned vertex t that
    still ties at theta and is affinely independent of the rows (the Cholesky
    test of _append_face, not the size of d . m_t - c) lies in the face
    outside the rows' affine hull: it is appended (weight 0), and d is
    updated to stay orthogonal to the new span,
    d -= (d . m_t - c) / (w . m_t - w . m_0) w with w the part of m_t
    orthogonal to the rows' hull (one triangular solve with the factor before
    the append). The first time a direction finds such a vertex, the rows miss
    part of the face: the structures the solve met (ws.log) that tie are
    appended (much of the face, without MAP calls), then MAP at theta + eps g
    for random g, not projected, appends the bulk of the rest at one MAP call
    and one Cholesky row each, until a call brings nothing new
    (_probe_random), and a fresh d is drawn. A support that spans the face
    costs one projection and one MAP call. When MAP returns nothing new for an
    updated d, a fresh one is drawn; when it returns nothing new for a fresh
    one, the span is certified: where u is differentiable it lies in the
    face's relative interior, so face vertices outside the rows' hull lie on
    both sides of it, and a random d orthogonal to the rows' span sees one
    unless the spans coincide. At a kink the rows then span the face left tied
    at theta + delta d (a one-sided derivative). A vertex that does not tie at
    theta means eps was too large: it shrinks (and stays shrunk); below
    FACE_MIN tie tolerances, FACE_UNRESOLVED. At most ``budget`` MAP calls
    (ws.n_map counts them) and FACE_MAX_ROWS rows, else FACE_BUDGET. fs (if
    not NULL) gets s*, the tie tolerance and the last eps (s_ref = -inf: no
    completion ran). u (if not NULL) is the solution's u, for rows that are a
    face's vertices without weights that give it (_untie).
    """
    cdef Py_ssize_t j, t, n_u = ws.n_u, k = ws.k, n_calls = 0, n
    cdef unsigned long long rng = FACE_SEED
    cdef double s, s_ref = -INFINITY, big = 0.0, tau, eps, dmax, c_d, st, dt, wt, w0, alpha
    cdef double* p = ws.pert
    cdef double* d = ws.dvec
    cdef double* w = NULL
    cdef bint fresh = True, probed = False
    cdef _Seen seen
    cdef int status, appended
    if fs != NULL:
        fs.s_ref = -INFINITY
    if ws.nI == 0 or n_u == 0:
        return FACE_CERTIFIED
    if u == NULL:
        ws._compute_u(ws.y, False)
    else:
        memcpy(ws.u, u, n_u * sizeof(double))
    for j in range(n_u):
        ws.adj[j] = ws.eta_u[j] - ws.u[j]
    # the score scale: |a_t| . |eta| (kept as theta_abs), at least 1
    for t in range(ws.nI):
        ws.f.c_score(ws.S + t * k, ws.adj, ws.eta_v, &s)
        if s > s_ref:
            s_ref = s
        if ws.theta_abs[t] > big:
            big = ws.theta_abs[t]
    big = big if big > 1.0 else 1.0
    tau = FACE_TIE * big + (gap if gap > 0 else 0.0)
    eps = FACE_EPS * big
    if eps < FACE_MIN * tau:
        eps = FACE_MIN * tau
    seen.table = NULL
    try:
        _fresh_direction(ws, d, &rng)
        while True:
            # zero on forbidden parts; then scaled to max |d_j| = 1 (a loop without
            # branches), so that the perturbation below needs none either
            dmax = 0.0
            for j in range(n_u):
                if ws.adj[j] > -INFINITY:
                    dmax = max(dmax, fabs(d[j]))
                else:
                    d[j] = 0.0
            if dmax == 0.0:
                return FACE_CERTIFIED      # the rows span every direction
            dmax = 1.0 / dmax
            for j in range(n_u):
                d[j] *= dmax
            ws.f.c_score(ws.S, d, NULL, &c_d)
            while True:
                if n_calls >= budget:
                    return FACE_BUDGET
                for j in range(n_u):
                    p[j] = ws.adj[j] + eps * d[j]
                ws.f.c_map(p, ws.eta_v, ws.snew, ws.work)
                ws.n_map += 1
                n_calls += 1
                ws.f.c_score(ws.snew, ws.adj, ws.eta_v, &st)
                st -= s_ref
                ws.f.c_score(ws.snew, d, NULL, &dt)
                dt -= c_d
                if st >= -tau:
                    break
                # not in the face: the perturbation reached past the face's margin
                eps = eps / 4 if dt <= 0 else min(eps / 4, 0.5 * (-st) / dt)
                if eps < FACE_MIN * tau:
                    return FACE_UNRESOLVED
            # A tied vertex is beyond the rows' hull exactly when the Cholesky test
            # finds it affinely independent, however little d moved its score: the
            # size of d . m_t - c is that of d's random component along the face's
            # missing directions, which can be small (2e-4 of max |d| was seen), so a
            # threshold on it would certify a face the rows do not span.
            n = ws.nI
            if ws._find(ws.snew) >= 0:
                appended = 0
            elif n + 1 >= FACE_MAX_ROWS:
                return FACE_BUDGET
            else:
                appended = ws._append_face(ws.snew)
            if appended == 0:
                if fresh:
                    return FACE_CERTIFIED
                # an updated d has certified nothing (its entries can shrink where the
                # face's remaining vertices differ): confirm with a fresh one
                _fresh_direction(ws, d, &rng)
                fresh = True
                continue
            if not probed:
                # the rows miss part of the face: the structures the solve met and
                # random probes append the bulk of it (no MAP calls, then no
                # projections), then certification starts over from a fresh d
                probed = True
                _seen_init(&seen, ws.nI + ws.n_log)
                for t in range(ws.nI):
                    _seen_add(&seen, ws.S + t * k, k)
                _from_log(ws, &seen, s_ref, tau)
                status = _probe_random(ws, &seen, budget, &n_calls, s_ref, tau, &eps, &rng)
                if status != FACE_CERTIFIED:
                    return status
                _fresh_direction(ws, d, &rng)
                fresh = True
                continue
            if w == NULL:
                w = <double*> malloc((n_u + 1) * sizeof(double))
                if w == NULL:
                    with gil:
                        raise MemoryError()
            # w = m_t - M z, z = L^{-T} l (x1 still holds l = L^{-1} G_c[rows, t]): the
            # part of m_t orthogonal to the old rows' hull, so w . m_s is one constant
            _trsv_lower_t(ws.L, ws.cap, n, ws.x1)
            memset(w, 0, n_u * sizeof(double))
            ws.f.c_add(ws.snew, 1.0, w, NULL)
            for t in range(n):
                ws.f.c_add(ws.S + t * k, -ws.x1[t], w, NULL)
            ws.f.c_score(ws.snew, w, NULL, &wt)
            ws.f.c_score(ws.S, w, NULL, &w0)
            if not (wt - w0 > 0.0):
                # round-off in w (t was found independent): no update, a fresh d
                _fresh_direction(ws, d, &rng)
                fresh = True
                continue
            alpha = dt / (wt - w0)
            for j in range(n_u):
                d[j] -= alpha * w[j]
            fresh = False
    finally:
        free(w)
        free(seen.table)
        if fs != NULL:
            fs.s_ref = s_ref
            fs.tau = tau
            fs.eps = eps


# -- untying: the eta_v part where n is not a function of m on the face -------------
# The completion spans the optimal face in u-space, which fixes du/deta_u. The eta_v
# part, M_I D N_I^T, is the derivative only where n is an affine function of m on the
# face's vertices. Where it is not, the face has "fibers" (at tied transition scores,
# the crossovers of two optimal sequences have the unary columns of the pair they
# cross and other transitions): the eta_v part then depends on which vertices I holds,
# and u has a kink in eta_v. There the backward set is that of a solve at
# eta_v + delta r, for a fixed pseudo-random direction r (tie_direction): the
# Jacobian of the affine piece u follows from eta along r, a one-sided derivative and
# an element of the B-subdifferential.

# The first delta, relative to the score scale: large, since a solve at eta_v + delta r
# takes fewer iterations the larger delta is (about 1800 at 1e-6, 1200 at 1e-3 for a
# sequence of 15 x 5 at scale 0.1), and shrunk by 8 while u is not affine on
# [0, delta] along r (past the piece: breakpoints were at 1e-3 to 1e-2 there). Median
# untying times over 4 seeds, 1e-4 / 1e-3 / 1e-2 / 1e-1: 15 x 5 at scale 0.1: 7.0 /
# 3.2 / 1.6 / 1.5 ms; 30 x 8 at scale 1: 1.1 / 0.7 / 0.9 / 1.1 ms.
cdef double UNTIE_DELTA = 1e-2
# Attempts at delta (each shrinking it by 8) before FACE_UNRESOLVED.
cdef Py_ssize_t UNTIE_TRIES = 8
# Check (a) of _untie: weights down to -UNTIE_YTOL, and M y0 = u0 to UNTIE_YTOL max(1, |u0|).
cdef double UNTIE_YTOL = 1e-9


cdef int _v_weights(_Workspace ws, const double* r, Py_ssize_t n) except -1 nogil:
    """x1[:n] <- D N^T r, Prop. 1 on the first n rows (the leading block of the factor
    and of w2 is theirs): the weights' derivative along (0, r). Leaves dvec zero."""
    cdef Py_ssize_t t, nI = ws.nI
    if ws.nI + 1 >= ws.cap:
        ws._grow(2 * ws.cap)
    memset(ws.dvec, 0, ws.n_u * sizeof(double))
    for t in range(n):
        ws.f.c_score(ws.S + t * ws.k, ws.dvec, r, &ws.x1[t])
    ws.nI = n
    ws._jacobian(ws.x1)
    ws.nI = nI
    return 0


cdef double _v_direction(_Workspace ws, const double* r) except? -1.0 nogil:
    """dvec <- -J_v r = -M_I D N_I^T r on the rows (as a jvp along (0, r)); returns c,
    the rows' common value of phi_s = r . n_s - (J_v r) . m_s (Prop. 1 ties it)."""
    cdef Py_ssize_t t
    cdef double c
    _v_weights(ws, r, ws.nI)
    for t in range(ws.nI):
        ws.f.c_add(ws.S + t * ws.k, -ws.x1[t], ws.dvec, NULL)
    ws.f.c_score(ws.S, ws.dvec, r, &c)
    return c


cdef int _fibered(_Workspace ws, const double* r, _FaceScale* fs) except -1 nogil:
    """Whether the face holds a vertex off the affine map m -> n that the rows fix.

    For a completed workspace (adj = eta_u - u, rows spanning the face in u-space)
    and its scales fs. phi_s = r . n_s - (J_v r) . m_s is one constant c on the
    rows, hence on the whole face if n is affine in m there; MAP at
    theta + eps [-J_v r; r] and at theta - eps [-J_v r; r] returns the face's
    maximiser and minimiser of phi. Returns 1 if one of them is off c beyond
    round-off (FIBER_ROUND), 0 if neither is (two MAP calls; for a random r, a
    fiber is seen with probability 1), 2 if eps shrank below FACE_MIN tie
    tolerances first.
    """
    cdef Py_ssize_t j
    cdef double c = _v_direction(ws, r), st, ph, sign, eps = fs.eps, big = 1.0
    cdef int side
    for j in range(ws.n_u):
        big = max(big, fabs(ws.dvec[j]))
    for j in range(ws.n_v):
        big = max(big, fabs(r[j]))
    for side in range(2):
        sign = 1.0 if side == 0 else -1.0
        while True:
            for j in range(ws.n_u):
                ws.pert[j] = ws.adj[j] + (sign * eps) * ws.dvec[j]
            for j in range(ws.n_v):
                ws.qv[j] = ws.eta_v[j] + (sign * eps) * r[j]
            ws.f.c_map(ws.pert, ws.qv, ws.snew, ws.work)
            ws.n_map += 1
            ws.f.c_score(ws.snew, ws.adj, ws.eta_v, &st)
            if st - fs.s_ref >= -fs.tau:
                break
            eps /= 4          # past the face's margin (J_v r can be large)
            if eps < FACE_MIN * fs.tau:
                return 2
        ws.f.c_score(ws.snew, ws.dvec, r, &ph)
        if sign * (ph - c) > FIBER_ROUND * big * ws.k:
            return 1
    return 0


cdef void _drop_completion(_Workspace ws) noexcept nogil:
    """Drop the trailing weight-0 rows (a face completion's): the leading block of the
    Cholesky factor, and of w2, is that of the rows kept."""
    while ws.nI > 1 and not (ws.y[ws.nI - 1] > 0.0):
        ws.nI -= 1
        ws.hash -= _hash_structure(ws.S + ws.nI * ws.k, ws.k)


cdef int _untie(_Workspace ws, const double* u0, Py_ssize_t max_iter, double tol,
                const _FaceScale* fs) except -1 nogil:
    """Make the rows a backward set for eta_v + 0+ r (r: TIE_SEED's direction).

    For a completed workspace whose face F is fibered (_fibered), u0 the
    solve's u and fs its completion's scales. Warm-started from the support,
    solve at eta_v + delta r and complete that face F'; certified when

    (a) the support's weights, moved back along their own derivative
        (Prop. 1 on the support: dy = D N^T r), y0 = y - delta dy, are
        nonnegative and give u0 (M y0 = u0): then (u(t), y(t)) =
        (M y(t), y + (t - delta) dy) satisfies the KKT conditions for every
        t in [0, delta] (every score is affine in t along it, and at most the
        maximum at both ends), so u is affine on the segment;
    (b) every row of F' ties at eta (F' lies in F): then the face at
        eta + t r is F' for every t in (0, delta), and J (Prop. 1 on F') is
        the limit of the Jacobians there, an element of the B-subdifferential.
        Ties here, and M y0 = u0 in (a), are up to FACE_MIN tie tolerances,
        the completion's floor: a structure that close to the face is a kink
        no finite difference resolves (binned transition scores gave ones 4
        tolerances below F, which kept every delta down to 1e-7 from
        passing; in the support at delta, they moved y0's u by 1e-9).

    Else delta was past the piece u follows from eta along r: it shrinks by 8.
    (a) is needed: on a sequence, u(delta) - u0 = delta J r held past a
    breakpoint where J changed. The first delta is UNTIE_DELTA of the score
    scale. (c) F' must not be fibered itself, along another random direction
    (_fibered; inconclusive when the pieces along r are thin cones). The
    workspace's u, y and v are then the perturbed solve's: the caller keeps
    the solve's support. Returns FACE_CERTIFIED, or FACE_BUDGET /
    FACE_UNRESOLVED.
    """
    cdef const double* ev = ws.eta_v
    cdef void* callback = ws.callback
    cdef int face
    ws.callback = NULL          # the user's callback sees the solve's iterations only
    try:
        face = _untie_tries(ws, ev, u0, max_iter, tol, fs)
    finally:
        ws.callback = callback
        ws._set_eta(ws.eta_u, ev)
    return face


cdef bint _extends_back(_Workspace ws, const double* u0, double delta,
                        double tie) except -1 nogil:
    """_untie's check (a): y - delta dy >= 0 and M (y - delta dy) = u0 on the support
    (the leading rows of weight > 0; dy = D N^T r with r in ws.rv), up to round-off
    and, for the second, the tie tolerance tie. Uses x1, dvec."""
    cdef Py_ssize_t t, j, n = 0
    cdef double y0, lo = 0.0, err = 0.0, ref = 1.0
    while n < ws.nI and ws.y[n] > 0.0:
        n += 1
    _v_weights(ws, ws.rv, n)           # Prop. 1 on the support alone
    for t in range(n):
        y0 = ws.y[t] - delta * ws.x1[t]
        lo = min(lo, y0)
        ws.f.c_add(ws.S + t * ws.k, y0, ws.dvec, NULL)
    for j in range(ws.n_u):
        err = max(err, fabs(ws.dvec[j] - u0[j]))
        ref = max(ref, fabs(u0[j]))
    return lo >= -UNTIE_YTOL and err <= UNTIE_YTOL * ref + tie


cdef int _untie_tries(_Workspace ws, const double* ev, const double* u0, Py_ssize_t max_iter,
                      double tol, const _FaceScale* fs) except -1 nogil:
    """_untie's attempts at delta."""
    cdef double delta = UNTIE_DELTA * (fs.eps / FACE_EPS), gap, obj, st
    cdef Py_ssize_t j, t, tries, n_iter
    cdef int status
    cdef bint ok
    cdef _FaceScale fs2
    for tries in range(UNTIE_TRIES):
        for j in range(ws.n_v):
            ws.pv[j] = ev[j] + delta * ws.rv[j]
        _drop_completion(ws)
        ws._rescore(ws.eta_u, ws.pv)
        status = _iterate(ws, max_iter, tol, NULL, &n_iter, &gap, &obj)
        if status != CONVERGED and status != STALLED:
            return FACE_UNRESOLVED
        status = _complete(ws, max_iter, gap, &fs2)
        if status != FACE_CERTIFIED:
            return status
        ok = _extends_back(ws, u0, delta, FACE_MIN * fs.tau)
        for j in range(ws.n_u):
            ws.pert[j] = ws.eta_u[j] - u0[j]
        t = 0
        while ok and t < ws.nI:
            ws.f.c_score(ws.S + t * ws.k, ws.pert, ev, &st)
            ok = st - fs.s_ref >= -FACE_MIN * fs.tau
            t += 1
        if ok:
            status = _fibered(ws, ws.rc, &fs2)
            return FACE_UNRESOLVED if status == 1 else FACE_CERTIFIED
        delta /= 8
        if delta < FACE_MIN * fs.tau:
            break
    return FACE_UNRESOLVED


# -- the solution record ------------------------------------------------------------
# One solve's outcome, in C buffers (a _Sol, declared in _backward.pxd) until a field
# is asked for; a _Solution owns one, a _Solutions (a padded batch's) one per problem.

cdef int _sol_alloc(_Sol* sol, Factor f, Py_ssize_t n, Py_ssize_t b0,
                    bint with_L) except -1 nogil:
    """(Re)allocate sol's block for n rows of factor f, the backward set from row b0."""
    cdef Py_ssize_t nL = (n - b0) * (n - b0) if with_L else 0
    free(sol.buf)
    state_clear(&sol.facet)
    sol.side = SIDE_VERTEX
    sol.solver = NULL
    sol.buf = malloc((n + nL + f.n_u + f.n_v) * sizeof(double)
                     + n * f.struct_size * sizeof(int) + sizeof(double))
    if sol.buf == NULL:
        with gil:
            raise MemoryError()
    sol.y = <double*> sol.buf
    sol.L = sol.y + n
    sol.u = sol.L + nL
    sol.v = sol.u + f.n_u
    sol.S = <int*> (sol.v + f.n_v)
    sol.n_support = n
    sol.n_pos = n
    sol.b0 = b0
    sol.has_cholesky = with_L
    return 0


cdef void _sol_free(_Sol* sol) noexcept nogil:
    free(sol.buf)
    state_clear(&sol.facet)
    memset(sol, 0, sizeof(_Sol))


cdef int _sol_copy(_Sol* dst, const _Sol* src, Factor f) except -1 nogil:
    """dst <- a copy of src (same factor f), its facet state included (the solver it
    points to is borrowed: dst's owner must keep it alive)."""
    cdef void* buf = dst.buf
    cdef FacetState facet = dst.facet
    dst[0] = src[0]
    dst.buf = buf
    dst.facet = facet
    if src.buf == NULL:
        _sol_free(dst)
        return 0
    _sol_alloc(dst, f, src.n_support, src.b0, src.has_cholesky)
    dst.n_pos = src.n_pos
    memcpy(dst.buf, src.buf, (<char*> (src.S + src.n_support * f.struct_size))
                             - <char*> src.buf)
    dst.side = src.side
    dst.solver = src.solver
    state_copy(&dst.facet, &src.facet)
    return 0


cdef class _Solution:
    """Outcome of one solve, in C buffers (a ``_Sol``); NumPy copies are made on request."""

    def __dealloc__(self):
        _sol_free(&self.s)

    @property
    def side(self):
        """Which representation holds the solution: "vertex" (the active set's
        structures) or "facet" (the constraints tight at u)."""
        return SIDE_NAMES[self.s.side]

    def facet_state(self):
        """The facet side's backward state as (ints, reals) copies."""
        ints = np.empty(self.s.facet.n_ints, dtype=np.intc)
        reals = np.empty(self.s.facet.n_reals)
        cdef int[::1] iv = ints
        cdef double[::1] rv = reals
        if self.s.facet.n_ints:
            memcpy(&iv[0], self.s.facet.ints, self.s.facet.n_ints * sizeof(int))
        if self.s.facet.n_reals:
            memcpy(&rv[0], self.s.facet.reals, self.s.facet.n_reals * sizeof(double))
        return ints, reals

    @property
    def fallback(self):
        """Why the facet side did not return the problem (``FALLBACK_STATUS_*``; NONE
        when it was not offered it or solved it), its iterations, and for
        ``FALLBACK_STATUS_GAP`` the duality gap of its answer."""
        return self.s.fallback, self.s.fallback_iter, self.s.fallback_gap

    @property
    def n_support(self):
        """The support's size (weights > 0)."""
        return self.s.n_pos

    @property
    def n_backward(self):
        """The backward set's size: the support and its completion to the optimal face
        (or, where ties in eta_v were broken, the face at eta_v + delta r)."""
        return self.s.n_support - self.s.b0

    @property
    def untied(self):
        """Whether the backward set is that of a solve at eta_v + delta r (_untie)."""
        return self.s.b0 > 0

    @property
    def face_status(self):
        """``FACE_STATUS_CERTIFIED``, ``FACE_STATUS_BUDGET`` or ``FACE_STATUS_UNRESOLVED``."""
        return self.s.face

    @property
    def n_iter(self):
        return self.s.n_iter

    @property
    def n_map(self):
        return self.s.n_map

    @property
    def status(self):
        return self.s.status

    @property
    def gap(self):
        return self.s.gap

    @property
    def objective(self):
        return self.s.objective

    @property
    def seconds(self):
        """Spent in the solve without the GIL (benchmarks)."""
        return self.s.seconds

    @property
    def has_cholesky(self):
        return self.s.has_cholesky

    def structures_array(self, bint backward=False, bint rows=False):
        """The support (or with ``backward`` the backward set; with ``rows`` every
        row kept), ``(n, struct_size)`` intc, solver's order."""
        cdef Py_ssize_t k = self.factor.struct_size
        cdef Py_ssize_t a = self.s.b0 if (backward and not rows) else 0
        cdef Py_ssize_t n = self.s.n_support if (backward or rows) else self.s.n_pos
        out = np.empty((n - a, k), dtype=np.intc)
        cdef int[:, ::1] o = out
        if n > a:
            memcpy(&o[0, 0], self.s.S + a * k, (n - a) * k * sizeof(int))
        return out

    def weights_array(self, bint rows=False):
        """The support's weights (with ``rows``, every row's)."""
        return _copy_out(self.s.y, self.s.n_support if rows else self.s.n_pos)

    def u_array(self):
        return _copy_out(self.s.u, self.factor.n_u)

    def v_array(self):
        return _copy_out(self.s.v, self.factor.n_v)

    def cholesky_array(self):
        """``L`` as an ``(n, n)`` array, or None."""
        if not self.s.has_cholesky:
            return None
        cdef Py_ssize_t n = self.s.n_support - self.s.b0
        return _copy_out(self.s.L, n * n).reshape(n, n)

    def __reduce__(self):
        return (solution_from_arrays,
                (self.factor, self.structures_array(rows=True), self.weights_array(True),
                 self.cholesky_array(), self.u_array(), self.v_array(), self.s.n_iter,
                 self.s.n_map, self.s.status, self.s.gap, self.s.objective, self.history,
                 self.s.n_pos, self.s.face, self.s.b0, self.s.side,
                 self.facet_solver if self.s.side == SIDE_FACET else None,
                 *(self.facet_state() if self.s.side == SIDE_FACET else (None, None)),
                 self.fallback))


cdef class _Solutions:
    """The outcomes of a padded batch, one ``_Sol`` per problem in one C array.

    What the backward pass of a padded batch needs, without a Python object per
    problem; :meth:`solution` copies one out as a :class:`_Solution`.
    """

    def __cinit__(self, factors, Py_ssize_t n):
        cdef Py_ssize_t i
        self.n = n
        self.solvers = []
        self.items = <_Sol*> calloc(n if n > 0 else 1, sizeof(_Sol))
        self.factors = <PyObject**> malloc((n if n > 0 else 1) * sizeof(PyObject*))
        if self.items == NULL or self.factors == NULL:
            raise MemoryError()
        if isinstance(factors, Factor):
            self.keep = factors
            for i in range(n):
                self.factors[i] = <PyObject*> factors
        else:
            self.keep = tuple(factors)
            for i in range(n):
                self.factors[i] = <PyObject*> self.keep[i]

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.items != NULL:
            for i in range(self.n):
                _sol_free(&self.items[i])
        free(self.items)
        free(self.factors)

    def __len__(self):
        return self.n

    def solution(self, Py_ssize_t i):
        """A :class:`_Solution` copy of problem i's outcome."""
        cdef _Solution sol = _Solution.__new__(_Solution)
        sol.factor = <Factor> self.factors[i]
        _sol_copy(&sol.s, &self.items[i], sol.factor)
        if sol.s.solver != NULL:
            sol.facet_solver = <object> sol.s.solver
        return sol

    def put(self, Py_ssize_t i, _Solution sol):
        """Problem i's outcome <- a copy of sol's (of the same factor)."""
        if sol.factor is not <object> self.factors[i]:
            raise ValueError(f"put: problem {i} has another factor")
        _sol_copy(&self.items[i], &sol.s, sol.factor)
        if sol.facet_solver is not None:
            self.solvers.append(sol.facet_solver)    # items[i].solver borrows it


def solution_from_arrays(Factor factor, S, y, L, u, v, Py_ssize_t n_iter, Py_ssize_t n_map,
                         int status, double gap, double objective, history=None,
                         n_pos=None, int face=FACE_CERTIFIED, Py_ssize_t b0=0,
                         int side=SIDE_VERTEX, FacetSolver facet_solver=None,
                         facet_ints=None, facet_reals=None, fallback=None):
    """A :class:`_Solution` from NumPy arrays (CG solvers, the backward support, unpickling).

    ``S`` and ``y`` are every row kept: the first ``n_pos`` (None: all) are the
    support, rows ``b0``.. the backward set, whose Cholesky factor is ``L``. A
    facet-side solution (``side=SIDE_FACET``) has no rows: its backward pass is
    ``facet_solver`` applied with the state ``(facet_ints, facet_reals)``.
    ``fallback``: :attr:`_Solution.fallback`'s triple (None: the facet side was not
    offered the problem).
    """
    cdef _Solution sol = _Solution.__new__(_Solution)
    cdef const int[:, ::1] Sv = np.ascontiguousarray(S, dtype=np.intc).reshape(
        -1, factor.struct_size)
    cdef const double[::1] yv = np.ascontiguousarray(y, dtype=np.float64).reshape(-1)
    cdef const double[::1] uv = np.ascontiguousarray(u, dtype=np.float64).reshape(-1)
    cdef const double[::1] vv = np.ascontiguousarray(v, dtype=np.float64).reshape(-1)
    cdef const double[::1] Lv
    cdef const int[::1] fiv
    cdef const double[::1] frv
    cdef Py_ssize_t n = Sv.shape[0]
    if not 0 <= b0 <= n or yv.shape[0] != n:
        raise ValueError(f"b0, y: expected b0 in [0, {n}] and {n} weights, got {b0}, "
                         f"{yv.shape[0]}")
    sol.factor = factor
    _sol_alloc(&sol.s, factor, n, b0, L is not None)
    if n:
        memcpy(sol.s.S, &Sv[0, 0], n * factor.struct_size * sizeof(int))
        memcpy(sol.s.y, &yv[0], n * sizeof(double))
        if L is not None and n > b0:
            Lv = np.ascontiguousarray(L, dtype=np.float64).reshape(-1)
            if Lv.shape[0] != (n - b0) * (n - b0):
                raise ValueError(f"L: expected {(n - b0) * (n - b0)} entries, "
                                 f"got {Lv.shape[0]}")
            memcpy(sol.s.L, &Lv[0], (n - b0) * (n - b0) * sizeof(double))
    memcpy(sol.s.u, &uv[0], factor.n_u * sizeof(double))
    if factor.n_v:
        memcpy(sol.s.v, &vv[0], factor.n_v * sizeof(double))
    if b0 > 0 and n_pos is None:
        n_pos = b0
    if n_pos is not None:
        if not 0 <= n_pos <= n or (b0 > 0 and n_pos != b0):
            raise ValueError(f"n_pos: expected an int in [0, {n}]"
                             + (f" equal to b0 = {b0}" if b0 > 0 else "")
                             + f", got {n_pos!r}")
        sol.s.n_pos = n_pos
    if side == SIDE_FACET:
        if facet_solver is None or facet_solver.factor is not factor:
            raise ValueError("facet_solver: expected the factor's FacetSolver for a facet-side "
                             f"solution, got {facet_solver!r}")
        fiv = np.ascontiguousarray(facet_ints, dtype=np.intc).reshape(-1)
        frv = np.ascontiguousarray(facet_reals, dtype=np.float64).reshape(-1)
        state_resize(&sol.s.facet, fiv.shape[0], frv.shape[0])
        if fiv.shape[0]:
            memcpy(sol.s.facet.ints, &fiv[0], fiv.shape[0] * sizeof(int))
        if frv.shape[0]:
            memcpy(sol.s.facet.reals, &frv[0], frv.shape[0] * sizeof(double))
        sol.s.side = SIDE_FACET
        sol.s.solver = <PyObject*> facet_solver
        sol.facet_solver = facet_solver
    elif side != SIDE_VERTEX:
        raise ValueError(f"side: expected {SIDE_VERTEX} or {SIDE_FACET}, got {side}")
    sol.s.face = face
    sol.s.n_iter = n_iter
    sol.s.n_map = n_map
    sol.s.status = status
    sol.s.gap = gap
    sol.s.objective = objective
    if fallback is not None:
        sol.s.fallback, sol.s.fallback_iter, sol.s.fallback_gap = fallback
    sol.history = history
    return sol


# -- one solve into a record ---------------------------------------------------------

cdef void _copy_factor(double* L, _Workspace ws) noexcept nogil:
    """L <- the workspace's Cholesky factor, nI x nI, row-major, zeros above."""
    cdef Py_ssize_t n = ws.nI, i
    for i in range(n):
        memcpy(L + i * n, ws.L + i * ws.cap, (i + 1) * sizeof(double))
        memset(L + i * n + i + 1, 0, (n - 1 - i) * sizeof(double))


cdef int _export_backward(_Sol* sol, _Workspace ws) except -1 nogil:
    """Make the workspace's rows sol's backward set (b0 = n_pos), after _untie; sol
    (from _export_to) keeps its support, weights, u and v."""
    cdef _Sol old = sol[0]
    cdef Py_ssize_t p = old.n_pos, n = ws.nI, k = ws.k
    sol.buf = NULL
    try:
        _sol_alloc(sol, ws.f, p + n, p, True)
        memcpy(sol.S, old.S, p * k * sizeof(int))
        memcpy(sol.S + p * k, ws.S, n * k * sizeof(int))
        memcpy(sol.y, old.y, p * sizeof(double))
        memset(sol.y + p, 0, n * sizeof(double))
        _copy_factor(sol.L, ws)
        memcpy(sol.u, old.u, ws.n_u * sizeof(double))
        memcpy(sol.v, old.v, ws.n_v * sizeof(double))
        sol.n_pos = p
    finally:
        free(old.buf)
    return 0


cdef int _finish(_Workspace ws, _Sol* sol, Py_ssize_t budget, Py_ssize_t max_iter,
                 double tol, Py_ssize_t n_iter, int status, double gap, double obj,
                 int backward) except -1 nogil:
    """A finished active-set loop into sol: unless BACKWARD_NONE, its face
    completed (at most budget MAP calls) where it converged or stalled, and
    checked for fibers (n not affine in m on it). A fibered face is untied (the
    backward set is then _untie's) with BACKWARD_NOW, else marked FACE_FIBERED:
    its backward set is right for eta_u only, and the caller unties it when a
    derivative is asked for (reduce_support). Untying that fails keeps the
    completed face: FACE_FIBERED, or FACE_BUDGET (which makes a converged solve
    FACE_INCOMPLETE, as the completion's does)."""
    cdef Py_ssize_t n_pos = ws.nI
    cdef int face = FACE_CERTIFIED, fib
    cdef _FaceScale fs
    if (status == CONVERGED or status == STALLED) and backward != BACKWARD_NONE:
        face = _complete(ws, budget, gap, &fs)
        if face == FACE_BUDGET and status == CONVERGED:
            status = FACE_INCOMPLETE
        elif face == FACE_CERTIFIED and ws.n_v > 0 and fs.s_ref > -INFINITY:
            fib = _fibered(ws, ws.rv, &fs)
            if fib == 2:
                face = FACE_UNRESOLVED
            elif fib == 1 and backward == BACKWARD_LAZY:
                face = FACE_FIBERED
            elif fib == 1:
                # the support and the completed face first: the backward set kept if
                # untying fails (with its status, which the callers report)
                _export_to(sol, ws, n_iter, status, gap, obj, n_pos, face)
                face = _untie(ws, sol.u, max_iter, tol, &fs)
                if face == FACE_CERTIFIED:
                    _export_backward(sol, ws)
                elif face == FACE_BUDGET and status == CONVERGED:
                    sol.status = FACE_INCOMPLETE
                sol.face = face if face != FACE_UNRESOLVED else FACE_FIBERED
                return 0
    _export_to(sol, ws, n_iter, status, gap, obj, n_pos, face)
    return 0


cdef int _export_to(_Sol* sol, _Workspace ws, Py_ssize_t n_iter, int status, double gap,
                    double obj, Py_ssize_t n_pos, int face) except -1 nogil:
    """Copy a finished solve out of the workspace (which the next problem reuses); its
    first n_pos rows are the support, the rest (weight 0) the face completion."""
    cdef Py_ssize_t n = ws.nI
    ws._compute_u(ws.y, True)
    _sol_alloc(sol, ws.f, n, 0, True)
    sol.n_pos = n_pos
    sol.face = face
    memcpy(sol.S, ws.S, n * ws.k * sizeof(int))
    memcpy(sol.y, ws.y, n * sizeof(double))
    _copy_factor(sol.L, ws)
    memcpy(sol.u, ws.u, ws.n_u * sizeof(double))
    memcpy(sol.v, ws.v, ws.n_v * sizeof(double))
    sol.n_iter = n_iter
    sol.n_map = ws.n_map
    sol.status = status
    sol.gap = gap
    sol.objective = obj
    return 0


# A facet-side solution whose gap misses the tolerance by round-off only (below
# FACET_FLOOR * gap_scale) is kept, STALLED, as the active set keeps an iterate whose
# gap double precision cannot lower; a larger gap sends the problem to the vertex side.
cdef double FACET_FLOOR = 1e-13


cdef bint _facet_try(_Workspace ws, _Sol* sol, const double* eta_u, const double* eta_v,
                     double* hist, Py_ssize_t max_iter, double tol, PyObject* facet,
                     double t0) except -1 nogil:
    """The facet side's attempt at one solve into sol: True when it solved it and the
    duality gap at its (u, v), from one MAP call, certifies it (sol then complete)."""
    cdef Py_ssize_t n_iter = 0, j
    cdef double res[2]
    cdef double gap, scale, best, lin = 0.0, lin_abs = 0.0, usq, x
    _sol_alloc(sol, ws.f, 0, 0, False)
    if (<FacetSolver> facet).c_solve(eta_u, eta_v, sol.u, sol.v, &sol.facet, max_iter,
                                     &n_iter, res) != FACET_SOLVED:
        state_clear(&sol.facet)
        sol.fallback = FALLBACK_BUDGET if n_iter >= max_iter else FALLBACK_DECLINED
        sol.fallback_iter = n_iter
        return False
    # gap = max_s <a_s - x, eta - [u; 0]> (Wolfe), independent of how x was found;
    # products skip the zeros of x (forbidden parts score -inf there)
    for j in range(ws.n_u):
        ws.adj[j] = eta_u[j] - sol.u[j]
        if sol.u[j] != 0.0:
            x = eta_u[j] * sol.u[j]
            lin += x
            lin_abs += fabs(x)
    for j in range(ws.n_v):
        if sol.v[j] != 0.0:
            x = eta_v[j] * sol.v[j]
            lin += x
            lin_abs += fabs(x)
    usq = _dot(sol.u, sol.u, ws.n_u)
    sol.fallback_iter = n_iter
    if ws.f.c_map(ws.adj, eta_v, ws.snew, ws.work) != 0:
        # no structure avoids the forbidden parts: the vertex side reports it
        state_clear(&sol.facet)
        sol.fallback = FALLBACK_DECLINED
        return False
    ws.f.c_score(ws.snew, ws.adj, eta_v, &best)
    gap = best - (lin - usq)
    scale = _gap_scale(lin_abs, usq)
    if not (gap <= tol * scale or gap <= FACET_FLOOR * scale):
        state_clear(&sol.facet)
        sol.fallback = FALLBACK_GAP
        sol.fallback_gap = gap
        return False
    sol.side = SIDE_FACET
    sol.solver = facet
    sol.status = CONVERGED if gap <= tol * scale else STALLED
    sol.face = FACE_CERTIFIED
    sol.n_iter = n_iter if n_iter > 0 else 1   # a closed form (one position) is one step
    sol.n_map = 1
    sol.gap = gap
    sol.objective = 0.5 * usq - lin
    sol.seconds = _now() - t0
    if hist != NULL:
        # one record, the solution's: the facet side's iterates are not points of the
        # polytope (its dual iterates are infeasible until the last), so there is
        # nothing earlier to report
        hist[0] = sol.objective
        hist[1] = gap
        hist[2] = 0.0
        hist[3] = sol.seconds
    if ws.callback != NULL:
        with gil:
            notify(<object> ws.callback, sol.n_iter, sol.objective, gap, 0, sol.seconds,
                   _copy_out(sol.u, ws.n_u).reshape(ws.f.shape_u))
    return True


cdef int _solve_one(_Workspace ws, _Sol* sol, const double* eta_u, const double* eta_v,
                    const int* init, Py_ssize_t n_init, double* hist, Py_ssize_t max_iter,
                    double tol, int backward, PyObject* facet) except -1 nogil:
    """One solve into sol: the facet side's when facet (a FacetSolver, or NULL) solves
    and certifies it, else the active set's, its support completed to span the optimal
    face (as backward says, see _finish); status INFEASIBLE when every structure is
    forbidden."""
    cdef Py_ssize_t n_iter = 0
    cdef double gap = 0, obj = 0, t0 = _now()
    cdef int status
    sol.fallback = FALLBACK_NONE
    sol.fallback_iter = 0
    sol.fallback_gap = 0.0
    if facet != NULL and _facet_try(ws, sol, eta_u, eta_v, hist, max_iter, tol, facet, t0):
        return 0
    _point(ws, eta_u, eta_v)
    ws.log_on = True
    if n_init > 0:
        ws._start(init, n_init, NULL)
    if ws.nI == 0:
        # cold start from the MAP structure (weight 1), unless it is forbidden too
        status = ws.f.c_map(ws.eta_u, ws.eta_v, ws.snew, ws.work)
        ws.n_map += 1
        if status == 0:
            ws._start(ws.snew, 1, NULL)
        if ws.nI == 0:
            sol.status = INFEASIBLE
            sol.n_map = ws.n_map
            sol.seconds = _now() - t0
            return 0
    status = _iterate(ws, max_iter, tol, hist, &n_iter, &gap, &obj)
    # max_iter bounds the loop's iterations and the completion's MAP calls together
    _finish(ws, sol, max_iter - n_iter, max_iter, tol, n_iter, status, gap, obj, backward)
    sol.seconds = _now() - t0
    return 0


# -- a support from another solver -----------------------------------------------------

def reduce_support(Factor factor, const int[:, ::1] structures, const double[::1] weights,
                   const double[::1] eta_u, const double[::1] eta_v, double gap=0.0,
                   Py_ssize_t budget=0, double tol=1e-12, bint untie=True):
    """Affinely independent support with the same ``u``, and its Cholesky factor.

    Used for the backward pass of solvers (conditional gradient) whose final
    support may be affinely dependent. Structures are inserted one at a time
    with their weights; a dependent one shifts weight along the null direction
    (Caratheodory), exactly as when the active set meets one. With
    ``budget > 0`` the support is then completed to span the optimal face
    (weight-0 rows, as after an active-set solve; ``gap``: the solve's), and
    untied where ``n`` is not affine in ``m`` on the face (``tol``: the tolerance
    of that solve at ``eta_v + delta r``; without ``untie``, such a face is only
    reported, ``FACE_STATUS_FIBERED``: the factor graph's check).

    Returns
    -------
    structures, weights, L, n_pos, face_status, b0
        Every row kept (its first ``n_pos`` rows are the support, rows ``b0``..
        the backward set, whose Cholesky factor is ``L``).
    """
    cdef _Workspace ws = _Workspace(factor, structures.shape[0] + 4)
    cdef Py_ssize_t t
    cdef double wmax = 0.0
    cdef Py_ssize_t n_pos
    _point(ws, &eta_u[0] if factor.n_u else NULL, &eta_v[0] if factor.n_v else NULL)
    ws._start(&structures[0, 0], structures.shape[0], &weights[0])
    # exact ties in the ratio tests leave round-off weights behind
    for t in range(ws.nI):
        wmax = max(wmax, ws.y[t])
    ws._drop_below(1e-14 * wmax)
    n_pos = ws.nI
    if budget == 0:
        S, y, L = ws._export()
        return S, y / y.sum(), L, n_pos, FACE_CERTIFIED, 0
    cdef _Solution sol = _Solution.__new__(_Solution)
    sol.factor = factor
    with nogil:
        _finish(ws, &sol.s, budget, budget, tol, 0, CONVERGED, gap, 0.0,
                BACKWARD_NOW if untie else BACKWARD_LAZY)
    y = sol.weights_array(True)
    return (sol.structures_array(rows=True), y / y.sum(), sol.cholesky_array(),
            sol.s.n_pos, sol.s.face, sol.s.b0)


# -- Jacobian products -----------------------------------------------------------------

cdef void _jacobian_transform(const double* L, int n, double* x, double* w2) noexcept nogil:
    """x <- (Z - Z 1 1^T Z / 1^T Z 1) x with Z = (L L^T)^{-1} (Prop. 1), L n x n.

    As ``_Workspace._jacobian``: with w2 = L^{-1} 1 (w2 is scratch for n
    doubles) and x' = L^{-1} x, x <- L^{-T} (x' - w2 (w2.x') / (w2.w2)).
    """
    cdef Py_ssize_t t
    cdef double a
    if n == 0:
        return
    for t in range(n):
        w2[t] = 1.0
    _trsv_lower(L, n, n, w2)
    _trsv_lower(L, n, n, x)
    a = _dot(w2, x, n) / _dot(w2, w2, n)
    for t in range(n):
        x[t] -= a * w2[t]
    _trsv_lower_t(L, n, n, x)


cdef int _jacobian_apply(const _Sol* sol, Factor f, const double* in_u, const double* in_v,
                         double* out_u, double* out_v, double* x,
                         bint transpose) except -1 nogil:
    """``M_I D A_I^T`` or ``A_I D M_I^T`` applied to a vector, D of Prop. 1.

    x_t = a_t . [in_u; in_v] (in_v NULL: only the m_t part), x <- D x, and
    out_u = sum_t x_t m_t, plus out_v = sum_t x_t n_t when out_v is not NULL.
    x is scratch for 2 |I| doubles. O(|I| n + |I|^2). (The two products are one
    formula on the vertex side; the facet side's solver is told which with
    transpose.)
    """
    cdef Py_ssize_t n = sol.n_support - sol.b0, k = f.struct_size, t
    cdef const int* S = sol.S + sol.b0 * k
    if sol.side == SIDE_FACET:
        return (<FacetSolver> sol.solver).c_apply(&sol.facet, in_u, in_v, out_u, out_v,
                                                  transpose)
    memset(out_u, 0, f.n_u * sizeof(double))
    if out_v != NULL:
        memset(out_v, 0, f.n_v * sizeof(double))
    for t in range(n):
        f.c_score(S + t * k, in_u, in_v, &x[t])
    _jacobian_transform(sol.L, <int> n, x, x + n)
    for t in range(n):
        f.c_add(S + t * k, x[t], out_u, out_v)
    return 0
