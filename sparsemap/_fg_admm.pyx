"""The factor graph's ADMM engine: the state of one solve, and the ADMM loop.

Binary variables ``u`` in ``[0, 1]^V`` are shared by factors; part ``j`` of
factor ``f`` stands for the literal ``l_fj(u) = u_i`` (or ``1 - u_i`` when
negated). The problem (docs/lp_sparsemap.rst, "The problem") is

    max_{u, p}  eta_u . u - 1/2 ||u||^2 + sum_f eta_v[f] . N_f p_f
    s.t.        M_f p_f = l_f(u),  p_f in the simplex      (every factor f)
                0 <= u_i <= 1                              (variables in no factor)

and is solved by ADMM, split so that every factor step is a plain SparseMAP call
on the factor alone, so any factor works at its native cost (docs/lp_sparsemap.rst
derives the steps and says why): a warm-started one on the factor's own active-set
workspace (the vertex side), or, for a factor with a facet-side solver
(``sparsemap._facet``) where that side is the cheaper one, its solver's (the factor
then holds its point by its tight constraints; see FACET_FAMILIES). In the
variable space (a link's value ``y^_j = sigma_j (y_j - s_j)``, its multiplier
``lam^_j``), with over-relaxed values ``r_j = alpha y^_j + (1 - alpha) u_i``:

    factor step  p_f = SparseMAP(eta_u' = l_f(u + lam^/rho), eta_v' = eta_v[f] / rho)
    u step       u_i = (eta_i - sum_j lam^_j + rho sum_j r_j) / (1 + rho d_i)
    dual step    lam^_j -= rho (r_j - u_i)

where the sums run over the links ``j`` of variable ``i`` and ``d_i`` is their
number. The loop holds no Python objects and runs without the GIL.

The loop decides when to try the polish and the infeasibility check; both are the
certificate's (``sparsemap._fg_certificate``, which extends ``_Admm``), as the
backward pass is ``sparsemap._fg_backward``'s (whose ``_Engine`` is the class the
public ``FactorGraph`` uses). The state is declared in ``_fg_admm.pxd``.
"""

import numpy as np

from libc.math cimport fabs, INFINITY
from libc.string cimport memcpy

from sparsemap._active_set cimport _hash_structure, _iterate
from sparsemap._active_set import STATUS_CONVERGED
from sparsemap._facet cimport FACET_SOLVED, FacetState, state_clear
from sparsemap._facet import facet_solver
from sparsemap._factors._matching import MatchingFactor
from sparsemap._factors._sequence import SequenceFactor
from sparsemap._factors._tree import TreeFactor


def default_rho(scale):
    """The ADMM penalty for scores divided by ``scale`` (>= 1): 1 / sqrt(scale), at least
    0.1 (docs/lp_sparsemap.rst, "Any score scale": measured over twelve graphs and scales
    from 1e-6 to 1e8)."""
    return max(RHO_MIN, scale ** -0.5)


RHO_MIN = 0.1


# Over-relaxation of the ADMM steps (Eckstein and Bertsekas): the u and dual steps use
# alpha y + (1 - alpha) u_prev for the factors' values y.
cdef double ALPHA = 1.7

# Each factor step is an exact SparseMAP solve (the active set stops on a
# duality gap of round-off size).
cdef Py_ssize_t INNER_MAX_ITER = 10_000
cdef double INNER_TOL = 1e-12

# When the loop tries the polish (how an attempt runs, and when its point is accepted,
# is in sparsemap._fg_certificate): once the primal residual is below POLISH_START and no
# support changed in the last iteration (after a failed attempt, once it is ten times
# smaller), and, from iteration POLISH_STABLE on, whenever the supports stayed the same
# for two iterations, at gaps that double after each failure up to POLISH_GAP_MAX
# iterations (at large scales ADMM finds the faces long before its residuals are small).
cdef double POLISH_START = 1e-4
cdef Py_ssize_t POLISH_STABLE = 5
cdef Py_ssize_t POLISH_GAP_MAX = 40
# With a factor on the facet side, from iteration POLISH_STABLE_FACET on, and when the
# supports and pieces stayed the same for one iteration: a facet-side step costs as much
# as a polish round, and the polish's rounds move the pieces themselves (its check
# solves at the polished scores and hands the piece it finds to the next round).
cdef Py_ssize_t POLISH_STABLE_FACET = 1

# When the loop runs the infeasibility check (_Certified._farkas, sparsemap._fg_certificate):
# after FARKAS_FIRST iterations, then every FARKAS_EVERY (one MAP call per factor: a fifth
# of an iteration's work), while the primal residual is above FARKAS_MIN_RESIDUAL.
cdef Py_ssize_t FARKAS_FIRST = 4
cdef Py_ssize_t FARKAS_EVERY = 4
cdef double FARKAS_MIN_RESIDUAL = 1e-6

cdef int INNER_CONVERGED = STATUS_CONVERGED    # the active set's own code

# The families whose factor steps try the facet side, at the scores where sm.solve would
# choose it: the solver declines peaked ones (and a sequence's spread transitions) at
# once, and the step then runs on the vertex side. At flat scores a tree's or a
# matching's vertex side needs hundreds of structures per step, a sequence's tens; their
# facet side one solve (benchmarks/bench_fg_facet.py: a tree, a matching and a sequence,
# each with a small factor, at 0.01 to 0.1 randn, 3 to 4,000 times faster). Where a
# sequence's transitions are nearly as spread as its unary scores and its solver still
# takes them, its steps cost as much as the sequence alone and the warm-started active
# set's can be cheaper (eta_v at 0.05 randn there: twice as long as the vertex side).
FACET_FAMILIES = (TreeFactor, MatchingFactor, SequenceFactor)
# A facet-side step's iteration budget; past it the solver declines (vertex side).
cdef Py_ssize_t FACET_BUDGET = 1000


cdef class _FacetSlot:
    def __cinit__(self, solver):
        factor = solver.factor
        self.solver = solver
        self.n_u, self.n_v = factor.n_u, factor.n_v
        nu, nv = max(self.n_u, 1), max(self.n_v, 1)
        self._block = np.zeros(4 * nu + 3 * nv)
        b = self._block
        self.u, self.u2 = <double*> _ptr(b[0:nu]), <double*> _ptr(b[nu:2 * nu])
        self.th, self.ju = <double*> _ptr(b[2 * nu:3 * nu]), <double*> _ptr(b[3 * nu:4 * nu])
        o = 4 * nu
        self.v, self.v2 = <double*> _ptr(b[o:o + nv]), <double*> _ptr(b[o + nv:o + 2 * nv])
        self.jv = <double*> _ptr(b[o + 2 * nv:o + 3 * nv])

    def __dealloc__(self):
        state_clear(&self.st)
        state_clear(&self.st2)

    cdef void _swap(self) noexcept nogil:
        """The check's state and point become the slot's (and the other way round)."""
        cdef FacetState t = self.st
        cdef double* p = self.u
        self.st = self.st2
        self.st2 = t
        self.u = self.u2
        self.u2 = p
        p = self.v
        self.v = self.v2
        self.v2 = p
        self.hash = _hash_structure(self.st.ints, self.st.n_ints)


def _facet_slot(factor):
    """The factor's _FacetSlot when its steps try the facet side, else None."""
    if type(factor) not in FACET_FAMILIES:
        return None
    solver = facet_solver(factor, True)
    return None if solver is None else _FacetSlot(solver)


cdef class _Admm:
    """One solve: the links, the ADMM state and a warm-started workspace per factor.

    A link is a unary part of a factor; link arrays hold every factor's parts,
    factor ``f`` at ``uoff[f]:uoff[f + 1]`` (in the factor's flat order).
    Values attached to links are in *literal* space (what the factor sees:
    ``l = s + sigma u``) when they feed a factor, and in *variable* space
    (``sigma (l - s)``) when they feed the variables; each array says which.

    A result keeps its engine: the supports and Cholesky factors in the
    workspaces are what the backward pass needs; a new solve builds a new engine.
    """
    def __cinit__(self, st, eta_u, ev0, rho, bint polish, fixed=None):
        """One solve of the graph ``st`` at scores ``eta_u`` (V,) and ``ev0`` (every
        factor's eta_v, concatenated, with a spare entry), variables ``fixed`` at 0."""
        cdef Py_ssize_t f, F = st.F, V = st.V
        cdef Py_ssize_t L1 = st.L + 1, V1 = V + 1, LV1 = st.LV + 1
        self.V = V
        self.F = F
        self.L = st.L
        self.LV = st.LV
        self.factors = st.factors
        a = dict(uoff=st.uoff, voff=st.voff, var=st.var, sig=st.sig, sh=st.sh,
                 zu=np.zeros(st.max_nu), zv=np.zeros(st.max_nv),
                 wsp=np.zeros(F + 1, dtype=np.intp), fsp=np.zeros(F + 1, dtype=np.intp),
                 side=np.zeros(F + 1, dtype=np.int8))
        if fixed is None:
            a["fix"], a["deg"], a["cvar"], a["lmask"] = st.nofix, st.deg, st.var, st.nomask
        else:
            fix = np.zeros(V1, dtype=np.int8)
            fix[:V] = fixed
            free_link = st.tied & (fix[np.maximum(st.var, 0)] == 0)
            a["fix"] = fix
            a["deg"] = np.bincount(st.var[free_link], minlength=V1).astype(np.intc)
            a["cvar"] = np.where(free_link, st.var, -1).astype(np.intc)
            a["lmask"] = (st.tied & ~free_link & (st.sig > 0)).astype(np.int8)
        deg = a["deg"]
        # one block for every per-solve double array (views below)
        sizes = dict(ev=LV1, ev0=LV1, evs=LV1, eta=V1, eta0=V1, u=V1, uprev=V1,
                     cw=V1, ca=V1, cu=V1, ck=V1, ckr=V1, ckp=V1, ckq=V1)
        for k in ("scores", "lam", "lprev", "yh", "cz", "cr", "cp", "cq", "ctmp", "ct", "cg",
                  "cmu"):
            sizes[k] = L1
        block = np.zeros(sum(sizes.values()))
        o = 0
        for k, n in sizes.items():
            a[k] = block[o:o + n]
            o += n
        a["eta0"][:V] = eta_u
        a["ev0"][:] = ev0
        on = deg[:V] > 0
        # the scale: the largest score that counts (free variables, eta_v), at least 1 (the
        # quadratic term's): scores are divided by it, so any magnitude is solved alike
        scale = max(1.0, float(np.abs(a["eta0"][:V][on]).max(initial=0.0)),
                    float(np.abs(ev0).max(initial=0.0)))
        np.divide(a["eta0"], scale, out=a["eta"], where=deg > 0)
        np.divide(ev0, scale, out=a["ev"])
        if rho is None:
            rho = default_rho(scale)
        np.divide(a["ev"], rho, out=a["evs"])
        # degree-0 variables keep this value, fixed ones 0
        np.clip(a["eta0"], 0.0, 1.0, out=a["u"])
        if fixed is not None:
            a["u"][a["fix"] != 0] = 0.0
        self._arrays = a
        self.uoff = <Py_ssize_t*> _ptr(a["uoff"])
        self.voff = <Py_ssize_t*> _ptr(a["voff"])
        self.var = <int*> _ptr(a["var"])
        self.cvar = <int*> _ptr(a["cvar"])
        self.lmask = <char*> _ptr(a["lmask"])
        self.deg = <int*> _ptr(a["deg"])
        self.fix = <char*> _ptr(a["fix"])
        self.wsp = <PyObject**> _ptr(a["wsp"])
        self.fsp = <PyObject**> _ptr(a["fsp"])
        self.side = <char*> _ptr(a["side"])
        self.sig, self.sh, self.ev, self.evs = _d(a, "sig"), _d(a, "sh"), _d(a, "ev"), _d(a, "evs")
        self.eta, self.eta0 = _d(a, "eta"), _d(a, "eta0")
        self.u, self.uprev = _d(a, "u"), _d(a, "uprev")
        self.scores, self.lam, self.yh = _d(a, "scores"), _d(a, "lam"), _d(a, "yh")
        self.lprev = _d(a, "lprev")
        self.zu, self.zv = _d(a, "zu"), _d(a, "zv")
        self.cz, self.cr, self.cp, self.cq = _d(a, "cz"), _d(a, "cr"), _d(a, "cp"), _d(a, "cq")
        self.ctmp, self.ct, self.cg, self.cmu = _d(a, "ctmp"), _d(a, "ct"), _d(a, "cg"), _d(a, "cmu")
        self.cw, self.ca, self.cu = _d(a, "cw"), _d(a, "ca"), _d(a, "cu")
        self.ck, self.ckr, self.ckp, self.ckq = _d(a, "ck"), _d(a, "ckr"), _d(a, "ckp"), _d(a, "ckq")
        self.rho = rho
        self.scale = scale
        self.eps = 1.0 / scale
        self.structure = st
        self.workspaces = [_Workspace(fac, 16) for fac in st.factors]
        self.slots = [_facet_slot(fac) for fac in st.factors]
        for f in range(F):
            self.wsp[f] = <PyObject*> self.workspaces[f]
            self.fsp[f] = <PyObject*> self.slots[f] if self.slots[f] is not None else NULL
        self.n_iter = 0
        self.n_inner_fail = 0
        self.n_polish = 0
        self.polished = False
        self.try_polish = polish
        self.status = RUNNING
        self.infeasible_factor = -1

    # -- forward: ADMM (docs/lp_sparsemap.rst, "The ADMM iteration") --------------------------
    cdef void _set_scores(self, Py_ssize_t f) noexcept nogil:
        """The factor's eta_u for the current u and lam: l_f(u + lam / rho)."""
        cdef Py_ssize_t j
        cdef int i
        cdef double inv = 1.0 / self.rho
        for j in range(self.uoff[f], self.uoff[f + 1]):
            i = self.var[j]
            if self.lmask[j]:
                self.scores[j] = -INFINITY
            elif i >= 0:
                self.scores[j] = self.sh[j] + self.sig[j] * (self.u[i] + inv * self.lam[j])
            else:
                self.scores[j] = 0.0

    cdef bint _start(self) except -1 nogil:
        """Initial supports: the MAP structure of each factor at the first scores. A factor
        whose every structure uses a masked part (a fixed variable) stops the solve:
        status INFEASIBLE, with ``infeasible_factor`` set."""
        cdef Py_ssize_t f
        for f in range(self.F):
            if not self._start_factor(<_Workspace> self.wsp[f], f):
                self.infeasible_factor = f
                self.status = INFEASIBLE
                return False
        return True

    cdef bint _start_factor(self, _Workspace ws, Py_ssize_t f) except -1 nogil:
        cdef double sc = 0.0
        cdef int rc
        self._set_scores(f)
        ws._rescore(self.scores + self.uoff[f], self.evs + self.voff[f] if ws.n_v else NULL)
        rc = ws.f.c_map(ws.eta_u, ws.eta_v, ws.snew, ws.work)
        ws.n_map += 1
        if rc == 0:
            ws.f.c_score(ws.snew, ws.eta_u, ws.eta_v if ws.n_v else self.zv, &sc)
        if rc != 0 or not (sc > -INFINITY):
            return False
        ws._start(ws.snew, 1, NULL)
        return True

    cdef int _factor_step(self, _Workspace ws, Py_ssize_t f) except -1 nogil:
        """Warm-started SparseMAP of factor f at the current scores; its values into yh.

        The one place where a factor's step is solved (the single-factor solver is
        called here and nowhere else in the loop)."""
        cdef Py_ssize_t j, a = self.uoff[f], n_it
        cdef double gap, obj
        cdef double* x
        self._set_scores(f)
        if self.fsp[f] != NULL and self._facet_step(<_FacetSlot> self.fsp[f], f):
            self.side[f] = FACET
        else:
            # no facet solver, or it declined: the warm-started active set (its support
            # is the one it left at its last step)
            self.side[f] = VERTEX
            ws._rescore(self.scores + a, self.evs + self.voff[f] if ws.n_v else NULL)
            if _iterate(ws, INNER_MAX_ITER, INNER_TOL, NULL, &n_it, &gap, &obj) \
                    != INNER_CONVERGED:
                self.n_inner_fail += 1
        # _iterate leaves ws.u = M_f p_f (its last gap was computed at the returned weights)
        x = self._point(ws, f)
        for j in range(a, self.uoff[f + 1]):
            self.yh[j] = self.sig[j] * (x[j - a] - self.sh[j]) if self.var[j] >= 0 else 0.0
        return 0

    cdef bint _facet_step(self, _FacetSlot s, Py_ssize_t f) except -1 nogil:
        """Factor f's step on the facet side, at the scores _set_scores left: whether its
        solver solved it (then s holds the point and the piece)."""
        cdef Py_ssize_t n_it = 0
        cdef double res[2]
        cdef FacetState t = s.st
        # warm started from the last step's state (moved to st2, the polish check's scratch
        # until the next check: st2 always holds a state of this solver, or none)
        s.st = s.st2
        s.st2 = t
        if s.solver.c_solve_warm(self.scores + self.uoff[f],
                                 self.evs + self.voff[f] if s.n_v else NULL, s.u, s.v, &s.st,
                                 &s.st2, FACET_BUDGET, &n_it, res) != FACET_SOLVED:
            return False
        s.hash = _hash_structure(s.st.ints, s.st.n_ints)
        return True

    cdef double* _point(self, _Workspace ws, Py_ssize_t f) noexcept nogil:
        """Factor f's literal values M_f p_f, from the side of its last step."""
        if self.side[f] == FACET:
            return (<_FacetSlot> self.fsp[f]).u
        return ws.u

    cdef bint _any_facet(self) noexcept nogil:
        cdef Py_ssize_t f
        for f in range(self.F):
            if self.side[f] == FACET:
                return True
        return False

    cdef unsigned long long _support_hash(self) noexcept nogil:
        cdef Py_ssize_t f
        cdef unsigned long long h = 0
        for f in range(self.F):
            h = h * 1000003ULL + ((<_FacetSlot> self.fsp[f]).hash if self.side[f] == FACET
                                  else (<_Workspace> self.wsp[f]).hash)
        return h

    cdef int _admm(self, Py_ssize_t max_iter, double tol) except -1 nogil:
        cdef Py_ssize_t it, f, j, i, next_check = FARKAS_FIRST
        cdef Py_ssize_t n_same = 0, next_polish = POLISH_STABLE, polish_gap = POLISH_STABLE
        cdef Py_ssize_t n_stable = 2
        cdef double rho = self.rho, rp, rd, r, yr, polish_at = POLISH_START
        cdef int v
        cdef unsigned long long h, h_prev = 0
        for it in range(max_iter):
            if it + 1 == next_check:
                memcpy(self.lprev, self.lam, self.L * sizeof(double))
            for f in range(self.F):
                self._factor_step(<_Workspace> self.wsp[f], f)
            # u step, with over-relaxed values alpha y + (1 - alpha) u_prev; free
            # variables only (fixed ones stay at 0)
            for i in range(self.V):
                if self.deg[i] > 0:
                    self.uprev[i] = self.u[i]
                    self.u[i] = self.eta[i]
            for j in range(self.L):
                v = self.cvar[j]
                if v >= 0:
                    yr = ALPHA * self.yh[j] + (1.0 - ALPHA) * self.uprev[v]
                    self.u[v] += rho * yr - self.lam[j]
            rd = 0.0
            for i in range(self.V):
                if self.deg[i] > 0:
                    self.u[i] /= self.eps + rho * self.deg[i]
                    r = fabs(self.u[i] - self.uprev[i])
                    if r > rd:
                        rd = r
            rd *= rho
            # dual step (links of fixed variables too: a negated one is pushed to 1)
            rp = 0.0
            for j in range(self.L):
                v = self.var[j]
                if v >= 0:
                    r = fabs(self.yh[j] - self.u[v])
                    if r > rp:
                        rp = r
                    yr = ALPHA * self.yh[j] + (1.0 - ALPHA) * self.uprev[v]
                    self.lam[j] -= rho * (yr - self.u[v])
            self.n_iter = it + 1
            self.res_primal = rp
            self.res_dual = rd
            # polishing: once the supports look settled, solve (P) on them and certify;
            # tried when the primal residual is small, and when the supports stayed the
            # same for a while (at large scales they settle long before ADMM converges)
            h = self._support_hash()
            n_same = n_same + 1 if h == h_prev else 0
            if it == 0 and self._any_facet():
                next_polish = polish_gap = POLISH_STABLE_FACET
                n_stable = 1
            if self.try_polish and n_same > 0 and (rp <= polish_at or
                                                   (n_same >= n_stable and it >= next_polish)):
                if self._polish():
                    self.status = CONVERGED
                    return 0
                if rp <= polish_at:
                    polish_at = rp / 10
                next_polish = it + polish_gap
                polish_gap = min(2 * polish_gap, POLISH_GAP_MAX)
            h_prev = h
            if rp <= tol and rd <= tol:
                self.status = CONVERGED
                return 0
            if it + 1 == next_check:
                next_check += FARKAS_EVERY
                if rp > FARKAS_MIN_RESIDUAL and self._farkas():
                    self.status = INFEASIBLE
                    return 0
        self.status = MAX_ITER
        return 0

    def run(self, Py_ssize_t max_iter, double tol):
        with nogil:
            self._run_nogil(max_iter, tol)

    cdef int _run_nogil(self, Py_ssize_t max_iter, double tol) except -1 nogil:
        if not self._start():
            return 0
        self._admm(max_iter, tol)
        if (self.status != INFEASIBLE and self.try_polish and not self.polished
                and self.F > 0 and self.res_primal <= POLISH_START):
            # a last attempt at the returned supports (not counted as an iteration)
            if self._polish():
                self.status = CONVERGED
        return 0

    cdef double _primal_residual(self) noexcept nogil:
        """max over links of |l_f(u) - M_f p_f| (each ws.u holds M_f p_f)."""
        cdef Py_ssize_t f
        cdef double rp = 0.0
        for f in range(self.F):
            rp = max(rp, self._factor_residual(<_Workspace> self.wsp[f], f))
        return rp

    cdef double _factor_residual(self, _Workspace ws, Py_ssize_t f) noexcept nogil:
        cdef Py_ssize_t j, a = self.uoff[f]
        cdef double rp = 0.0
        cdef double* x = self._point(ws, f)
        for j in range(a, self.uoff[f + 1]):
            if self.var[j] >= 0:
                rp = max(rp, fabs(self.sh[j] + self.sig[j] * self.u[self.var[j]] - x[j - a]))
        return rp

    # -- results -------------------------------------------------------------------------------
    def u_array(self):
        """The marginals, clipped to [0, 1]: the polish and the ADMM averages leave round-off
        outside (-1e-15, 1 + 2e-15), and a downstream log(u) or log(1 - u) must not see it.
        Only the reported values: the engine's own u (and so the backward pass, which
        depends on the supports alone) is untouched."""
        return np.clip(self._arrays["u"][:self.V], 0.0, 1.0)

    def factor_result(self, Py_ssize_t f):
        """(v, structures, weights) of factor f."""
        cdef _Workspace ws = self.workspaces[f]
        cdef _FacetSlot s
        if self.side[f] == FACET:
            # the point is held by constraints: its structures are a decomposition of it
            s = self.slots[f]
            u, v = self.factor_u(f), np.array(<double[:s.n_v]> s.v) if s.n_v else np.zeros(0)
            S, y = s.solver.decompose(u.reshape(ws.f.shape_u), v.reshape(ws.f.shape_v))
            return v, np.asarray(S, dtype=np.intc).reshape(len(y), -1), np.asarray(y)
        ws._compute_u(ws.y, True)
        v = np.array(<double[:ws.n_v]> ws.v) if ws.n_v else np.zeros(0)
        S, y, _ = ws._export()
        return v, S, y

    def factor_sides(self):
        """Per factor, the side of its last step: True where the facet side."""
        return np.asarray(self._arrays["side"][:self.F]) == FACET

    def n_map(self):
        return sum([(<_Workspace> ws).n_map for ws in self.workspaces])

    def u_raw(self):
        """The engine's own u (not clipped)."""
        return np.array(self._arrays["u"][:self.V])

    def factor_u(self, Py_ssize_t f):
        """M_f y_f: factor f's literal values from its support, flat."""
        cdef _Workspace ws = self.workspaces[f]
        if self.side[f] == FACET:
            return np.array(<double[:ws.n_u]> (<_FacetSlot> self.fsp[f]).u) if ws.n_u \
                else np.zeros(0)
        ws._compute_u(ws.y, False)
        return np.array(<double[:ws.n_u]> ws.u) if ws.n_u else np.zeros(0)

    # -- the certificate's hooks: plain ADMM neither polishes nor certifies infeasibility ---
    cdef bint _farkas(self) except -1 nogil:
        return False

    cdef bint _polish(self) except -1 nogil:
        return False


cdef void* _ptr(arr):
    """Data pointer of a non-empty C-contiguous NumPy array kept alive by the caller."""
    cdef char[::1] raw = arr.reshape(-1).view(np.int8)
    return <void*> &raw[0]


cdef double* _d(dict arrays, str key):
    return <double*> _ptr(arrays[key])


_MESSAGES = {
    CONVERGED: "converged",
    MAX_ITER: "maximum number of iterations reached",
    INFEASIBLE: "infeasible: no point satisfies every factor",
}


# The statuses as Python ints, for the API module (FactorGraph reads engine.status and
# sets it when a graph is infeasible by counting).
ENGINE_CONVERGED, ENGINE_INFEASIBLE = CONVERGED, INFEASIBLE

