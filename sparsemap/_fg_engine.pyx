"""The LP-SparseMAP engine: ADMM over a factor graph, its polish, its certificates.

Binary variables ``u`` in ``[0, 1]^V`` are shared by factors; part ``j`` of
factor ``f`` stands for the literal ``l_fj(u) = u_i`` (or ``1 - u_i`` when
negated). The problem (docs/lp_sparsemap.rst, "The problem") is

    max_{u, p}  eta_u . u - 1/2 ||u||^2 + sum_f eta_v[f] . N_f p_f
    s.t.        M_f p_f = l_f(u),  p_f in the simplex      (every factor f)
                0 <= u_i <= 1                              (variables in no factor)

and is solved by ADMM, split so that every factor step is a plain, warm-started
SparseMAP call on the factor's own active-set workspace, so any factor works at
its native cost (docs/lp_sparsemap.rst derives the steps and says why). In the
variable space (a link's value ``y^_j = sigma_j (y_j - s_j)``, its multiplier
``lam^_j``), with over-relaxed values ``r_j = alpha y^_j + (1 - alpha) u_i``:

    factor step  p_f = SparseMAP(eta_u' = l_f(u + lam^/rho), eta_v' = eta_v[f] / rho)
    u step       u_i = (eta_i - sum_j lam^_j + rho sum_j r_j) / (1 + rho d_i)
    dual step    lam^_j -= rho (r_j - u_i)

where the sums run over the links ``j`` of variable ``i`` and ``d_i`` is their
number. The loop holds no Python objects and runs without the GIL.

Once the supports settle, the problem restricted to the faces they span is
solved directly (polishing: a projection onto an affine set, by conjugate
gradient) and accepted only if its KKT conditions hold: then ``u`` is exact up
to round-off. Otherwise ADMM goes on, and stops on its residuals.

The backward pass is exact (docs/lp_sparsemap.rst, "The exact backward
pass"): ``du/deta_u`` is the orthogonal projector onto
``{v : sigma_f C_f v in T_f for all f}``, with ``T_f`` the directions of
factor ``f``'s final face, applied by conjugate gradient over the per-factor
projectors ``P_f`` (each the single-factor SparseMAP Jacobian at the
final support, two triangular solves with the kept Cholesky factor).

This module is the solver layer of the factor graph: the C engine (``_Engine``: ADMM,
the polish, the Farkas certificate of infeasibility, the C side of the backward
pass: face completion and the per-factor projectors) and the graph's structure
(``_Structure``: links, constant-sum groups, counting parts, the factors'
constraints for face completion). It imports factors and the active set only; the
public API (``FactorGraph``, its results, masks and forced groups) is in
``sparsemap._factor_graph``, graphs solved as one factor in ``sparsemap._fg_whole``.
"""

import numpy as np

from cpython.ref cimport PyObject
from libc.math cimport fabs, sqrt, INFINITY
from libc.string cimport memcpy, memset

from sparsemap._active_set cimport _Workspace, _dot, _maxabs, _iterate
from sparsemap._active_set import STATUS_CONVERGED
from sparsemap._backward cimport _complete, FACE_CERTIFIED
from sparsemap._factors._logic import (AndOutFactor, AtMostOneFactor, BudgetFactor,
                                       ImplyFactor, KnapsackFactor, OrFactor, OrOutFactor,
                                       PairFactor, SequenceBudgetFactor, XorFactor,
                                       XorOutFactor)
from sparsemap._factors._matching import MatchingFactor
from sparsemap._factors._sequence import SequenceFactor
from sparsemap._factors._tree import TreeFactor
from sparsemap._factors._base cimport Factor


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

# Conjugate gradient (backward pass and polishing) stops when the constraint
# residual ||R (C y - t)|| is below CG_RTOL times the scale of its input.
cdef double CG_RTOL = 1e-13

# Polishing: tried once the primal residual is below POLISH_START and no support
# changed in the last iteration (after a failed attempt, once it is ten times smaller),
# and, from iteration POLISH_STABLE on, whenever the supports stayed the same for two
# iterations, at gaps that double after each failure up to POLISH_GAP_MAX iterations
# (at large scales ADMM finds the faces long before its residuals are small). An
# attempt runs up to POLISH_ROUNDS rounds of an active set over the faces (see
# _Engine._polish). A polished point is accepted when its KKT conditions hold up to
# KKT_TOL (relative to the scale of the scores and multipliers). Its CG solves take
# at most POLISH_MAX_CG iterations each: on wrong supports the affine set may be
# empty, and CG would not converge.
cdef double POLISH_START = 1e-4
cdef Py_ssize_t POLISH_STABLE = 5
cdef Py_ssize_t POLISH_GAP_MAX = 40
cdef Py_ssize_t POLISH_ROUNDS = 8
# Up to this scale the polish projects w / eps directly (one CG); beyond, it projects w
# onto the scaled set and again onto the set (two), keeping u on its faces to round-off.
cdef double SCALE_ONE_PROJECTION = 1e3
cdef double SCALE_FACE = 1e12
cdef double KKT_TOL = 1e-11
# The support's reduced scores agree by construction; they differ by the round-off of
# the face's projector, which an ill-conditioned support (nearly dependent structures)
# takes to a few 1e-11.
cdef double SPREAD_TOL = 1e-9
cdef Py_ssize_t POLISH_MAX_CG = 1000
# Polished weights up to this are round-off zeros.
cdef double ZERO_WEIGHT = 1e-12

# Infeasibility (_Engine._farkas): checked after FARKAS_FIRST iterations, then every
# FARKAS_EVERY (one MAP call per factor: a fifth of an iteration's work), while the
# primal residual is above FARKAS_MIN_RESIDUAL; a certificate must be negative by
# FARKAS_TOL of its size (round-off in D is far smaller; on the infeasible graphs of the
# tests D / size is below -0.01).
cdef Py_ssize_t FARKAS_FIRST = 4
cdef Py_ssize_t FARKAS_EVERY = 4
cdef double FARKAS_MIN_RESIDUAL = 1e-6
cdef double FARKAS_TOL = 1e-9

# Face completion for the backward pass (_Engine.complete_faces): a part within
# FACE_INTEGRAL of 0 or 1 (the polish leaves round-off) is at its bound, and a linear
# constraint within FACE_INTEGRAL (times its size) of its bound is tight.
cdef double FACE_INTEGRAL = 1e-9

cdef enum:
    RUNNING = 0
    CONVERGED = 1
    MAX_ITER = 2
    INFEASIBLE = 3     # no point satisfies every factor (a certificate, or a masked factor)

cdef int INNER_CONVERGED = STATUS_CONVERGED    # the active set's own code


cdef class _Engine:
    """One solve: the links, the ADMM state and a warm-started workspace per factor.

    A link is a unary part of a factor; link arrays hold every factor's parts,
    factor ``f`` at ``uoff[f]:uoff[f + 1]`` (in the factor's flat order).
    Values attached to links are in *literal* space (what the factor sees:
    ``l = s + sigma u``) when they feed a factor, and in *variable* space
    (``sigma (l - s)``) when they feed the variables; each array says which.

    A result keeps its engine: the supports and Cholesky factors in the
    workspaces are what the backward pass needs; a new solve builds a new engine.
    """
    cdef readonly Py_ssize_t V, F, L, LV
    cdef readonly list factors, workspaces
    cdef readonly object structure   # the graph's _Structure (shared by its solves)
    cdef readonly object _arrays  # the NumPy arrays behind the pointers below
    cdef PyObject** wsp          # borrowed: self.workspaces owns them
    cdef Py_ssize_t* uoff        # F + 1 offsets into the link arrays
    cdef Py_ssize_t* voff        # F + 1 offsets into the eta_v arrays
    cdef int* var                # per link: its variable, -1 where the factor ignores the part
    cdef double* sig             # per link: -1 if negated, else 1
    cdef double* sh              # per link: 1 if negated, else 0
    cdef double* scores          # per link, literal: the factor's eta_u (workspaces point here)
    cdef double* ev              # eta_v of every factor, concatenated
    cdef double* evs             # eta_v / rho (workspaces point here)
    cdef double* lam             # per link, variable space: the multiplier
    cdef double* yh              # per link, variable space: the factor's value
    cdef int* cvar               # per link: var, or -1 where it is not a free variable's
                                 # (the linear algebra of the polish and the backward pass)
    cdef char* lmask             # per link: 1 on a plain (not negated) link of a fixed
                                 # variable: the factor sees -inf there (a mask)
    cdef double* eta             # V, normalised: eta / scale on free variables, else 0
    cdef double* eta0            # V, as given (degree-0 variables: clip; backward: 1[0<eta<1])
    cdef double* u               # V
    cdef double* uprev           # V
    cdef int* deg                # V: links of a free variable (0: in no factor, or fixed)
    cdef char* fix               # V: fixed at 0 (a -inf score, a mask)
    cdef double* lprev           # per link: lam before the last iteration (infeasibility)
    cdef double* zu              # zeros, max n_u
    cdef double* zv              # zeros, max n_v
    # polishing scratch: link arrays (L) and variable arrays (V)
    cdef double* cz
    cdef double* cr
    cdef double* cp
    cdef double* cq
    cdef double* ctmp
    cdef double* ct              # literal: the factors' current values minus s
    cdef double* cg              # literal: each factor's eta_v term M_S D N_S^T eta_v
    cdef double* cmu             # literal: minus the multipliers
    cdef double* cw              # V
    cdef double* ca              # V
    cdef double* cu              # V
    cdef double* ck              # V: the multiplier correction kappa, and its CG vectors
    cdef double* ckr
    cdef double* ckp
    cdef double* ckq
    cdef public double rho, res_primal, res_dual
    # the scores' scale (>= 1): the engine solves (P) divided by it, whose quadratic term
    # has the weight eps = 1 / scale (docs/lp_sparsemap.rst, "Any score scale")
    cdef public double scale, eps
    cdef public Py_ssize_t n_iter, n_inner_fail, n_polish
    cdef bint try_polish
    cdef public int status
    cdef public bint polished
    cdef public Py_ssize_t infeasible_factor   # -1, or a factor that has no allowed structure
    cdef public object counted   # infeasible by counting: (side A, side B, need, room)
    cdef public Py_ssize_t n_rounds     # polish rounds, over all attempts

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
                 wsp=np.zeros(F + 1, dtype=np.intp))
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
        for f in range(F):
            self.wsp[f] = <PyObject*> self.workspaces[f]
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
        self._set_scores(f)
        ws._rescore(self.scores + a, self.evs + self.voff[f] if ws.n_v else NULL)
        if _iterate(ws, INNER_MAX_ITER, INNER_TOL, NULL, &n_it, &gap, &obj) != INNER_CONVERGED:
            self.n_inner_fail += 1
        # _iterate leaves ws.u = M_f p_f (its last gap was computed at the returned weights)
        for j in range(a, self.uoff[f + 1]):
            self.yh[j] = self.sig[j] * (ws.u[j - a] - self.sh[j]) if self.var[j] >= 0 else 0.0
        return 0

    cdef unsigned long long _support_hash(self) noexcept nogil:
        cdef Py_ssize_t f
        cdef unsigned long long h = 0
        for f in range(self.F):
            h = h * 1000003ULL + (<_Workspace> self.wsp[f]).hash
        return h

    cdef int _admm(self, Py_ssize_t max_iter, double tol) except -1 nogil:
        cdef Py_ssize_t it, f, j, i, next_check = FARKAS_FIRST
        cdef Py_ssize_t n_same = 0, next_polish = POLISH_STABLE, polish_gap = POLISH_STABLE
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
            if self.try_polish and n_same > 0 and (rp <= polish_at or
                                                   (n_same >= 2 and it >= next_polish)):
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

    cdef bint _farkas(self) except -1 nogil:
        """Whether the last iteration's step in the multipliers proves that no point
        satisfies every factor (docs/lp_sparsemap.rst, "Infeasible graphs").

        On an infeasible graph ADMM's multipliers grow along a fixed direction. Its
        step d (literal space, -inf on masked links), made to sum to zero over the
        links of each free variable, is a Farkas certificate when
        D(d) = sum_f max_s d_f . m_s - sum_j d_j s_j < 0: every point of the local
        polytope would have D(d) >= 0. One MAP call per factor. The certificate is
        kept in ``cert`` (the first L entries of ``cz``)."""
        cdef Py_ssize_t j, f, i
        cdef double D = 0.0, size = 0.0, best
        cdef double* nu = self.cz
        for i in range(self.V):
            self.ca[i] = 0.0
        for j in range(self.L):
            if self.lmask[j]:
                nu[j] = -INFINITY
            elif self.var[j] >= 0:
                nu[j] = self.sig[j] * (self.lam[j] - self.lprev[j])
                if self.cvar[j] >= 0:
                    self.ca[self.cvar[j]] += self.sig[j] * nu[j]
            else:
                nu[j] = 0.0
        for j in range(self.L):
            i = self.cvar[j]
            if i >= 0:
                nu[j] -= self.sig[j] * self.ca[i] / self.deg[i]
        for j in range(self.L):
            if self.var[j] >= 0 and not self.lmask[j]:
                D -= nu[j] * self.sh[j]
                size += fabs(nu[j])
        if not (size > 0.0):
            return False
        for f in range(self.F):
            best = self._best(<_Workspace> self.wsp[f], nu + self.uoff[f])
            if not (best < INFINITY):
                return False
            D += best
        return D < -FARKAS_TOL * size

    cdef double _best(self, _Workspace ws, const double* nu) except? -1 nogil:
        """max_s nu . m_s over the factor's structures (one MAP call; inf if MAP fails)."""
        cdef double best = 0.0
        if ws.f.c_map(nu, self.zv, ws.snew, ws.work) != 0:
            return INFINITY
        ws.n_map += 1
        ws.f.c_score(ws.snew, nu, self.zv, &best)
        return best

    def verify(self, const double[::1] nu, const char[::1] touched):
        """The first factor among ``touched`` whose support is beaten, at multipliers ``nu``
        (per link, normalised), by a structure MAP finds: its index, or -1 (see
        _masks_hold). The tolerance scales with the certified multipliers of the factor's
        links other than the masked ones."""
        cdef Py_ssize_t f, j
        cdef double tau, best, scale
        cdef const double* ev
        cdef _Workspace ws
        for f in range(self.F):
            if not touched[f]:
                continue
            ws = self.workspaces[f]
            ev = self.ev + self.voff[f] if ws.n_v else self.zv
            scale = 1.0
            for j in range(self.uoff[f], self.uoff[f + 1]):
                if not self.lmask[j] and fabs(self.cmu[j]) > scale:
                    scale = fabs(self.cmu[j])
            if ws.n_v:
                scale = max(scale, _maxabs(self.ev + self.voff[f], ws.n_v))
            ws.f.c_score(ws.S, &nu[self.uoff[f]], ev, &tau)
            if ws.f.c_map(&nu[self.uoff[f]], ev, ws.snew, ws.work) != 0:
                return f
            ws.f.c_score(ws.snew, &nu[self.uoff[f]], ev, &best)
            if best - tau > KKT_TOL * scale:
                return f
        return -1

    def certificate(self):
        """Per link (literal space), the Farkas certificate of an INFEASIBLE status found
        by ADMM (zeros otherwise, or when a single factor had no allowed structure)."""
        if self.status != INFEASIBLE or self.infeasible_factor >= 0:
            return np.zeros(self.L)
        return np.array(self._arrays["cz"][:self.L])

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

    # -- polishing: (P) on the current faces, and its KKT certificate --------------------------
    def _try_polish(self):
        """Polish now, whatever the residuals (tests: the certificate must reject wrong faces)."""
        with nogil:
            ok = self._polish()
        return bool(ok)

    cdef bint _polish(self) except -1 nogil:
        """Polish rounds: after each, a factor whose weights came out negative drops those
        structures, and one whose MAP oracle found a better structure at the multipliers
        takes it in (a primal-dual active set over the faces, ADMM's supports its start);
        at most POLISH_ROUNDS. If no round is certified, ADMM goes on from the changed
        supports."""
        cdef Py_ssize_t k
        cdef int code
        self.n_polish += 1
        for k in range(POLISH_ROUNDS):
            self.n_rounds += 1
            code = self._polish_once()
            if code == 1:
                return True
            if code == 0:
                return False
        return False

    cdef int _polish_once(self) except -1 nogil:
        """Solve (P) restricted to the current supports; keep it if its KKT conditions hold
        (1), else 0, or 2 when supports were changed (see _polish).

        On the faces spanned by the supports, p_f is an affine function of the
        literals, so (P) becomes the projection of w = eta + g (g: the eta_v
        terms, linear in u on the faces) onto the affine set
        {u : R_f (C~_f u - t_f) = 0}, t_f a point of factor f's face: one CG
        solve. The multipliers of a shared variable are not unique; the ones
        closest to ADMM's (mu_A = -sigma lam) among those that satisfy
        stationarity, u = eta + sum_f C~_f^T mu_f, and keep every support
        structure at the same reduced score (mu_f - g_f in range R_f) are
        mu = g + R (mu_A - C~ kappa), (C~^T R C~) kappa = C~^T R (mu_A + z):
        a second CG. The point is optimal for (P) when every factor's weights
        p_f = G_c^{-1} (M_S^T l_f + c 1) are >= 0 and no structure beats the
        support at the multipliers (MAP at scores (-mu_f, eta_v)).

        Scores are divided by the scale (eps = 1 / scale weights the quadratic term),
        so the projection is of w / eps: computed as Proj_{A_eps}(w) / eps, with
        A_eps the affine set scaled by eps, then projected once more onto the affine
        set itself (the division multiplies round-off by the scale; the second
        projection, on numbers of the size of u, puts u back on the faces to round-off).
        Variables fixed at 0 are constants: links to them are rows of R_f with no
        column in C~.
        """
        cdef Py_ssize_t f, j, i
        cdef double res, wmax
        cdef int code
        cdef bint changed = False
        for i in range(self.V):
            self.cw[i] = self.eta[i]      # 0 where deg == 0
        for f in range(self.F):
            self._polish_prepare(<_Workspace> self.wsp[f], f)
        for j in range(self.L):
            if self.cvar[j] >= 0:
                self.cw[self.cvar[j]] += self.sig[j] * self.cg[j]
        if self.scale <= SCALE_ONE_PROJECTION:
            # w / eps = scale * w: round-off in u of 1e-16 scale |w|, no worse than CG's
            if self.eps != 1.0:
                for i in range(self.V):
                    self.cw[i] *= self.scale
            self._project(self.cw, self.ct, self.cu, self.cz, self.cr, self.cp, self.cq,
                          self.ctmp, self.ca, NULL, POLISH_MAX_CG, &res)
            if res > 1e3 * CG_RTOL:
                return 0
            if self.eps != 1.0:
                for j in range(self.L):
                    self.cz[j] *= self.eps
        else:
            wmax = _maxabs(self.cw, self.V)
            for j in range(self.L):
                self.cmu[j] = self.eps * self.ct[j]
            self._project(self.cw, self.cmu, self.cu, self.cz, self.cr, self.cp, self.cq,
                          self.ctmp, self.ca, NULL, POLISH_MAX_CG, &res)
            if res > 1e3 * CG_RTOL:
                return 0
            for i in range(self.V):
                self.ckq[i] = self.cu[i]          # eps u' (free until the kappa solve)
                if self.deg[i] > 0:
                    # beyond SCALE_FACE the division leaves round-off of 1e-16 scale, over
                    # 1e-4 along the faces: the scores do not fix u there to better than
                    # that, and ADMM's u (on a face of the polytope, nearly) is projected
                    self.cw[i] = self.cu[i] / self.eps if self.scale <= SCALE_FACE \
                        else self.u[i]
            # the second projection; its z (times eps) adds to the first's
            self._project(self.cw, self.ct, self.cu, self.cmu, self.cr, self.cp, self.cq,
                          self.ctmp, self.ca, NULL, POLISH_MAX_CG, &res)
            if res > 1e3 * CG_RTOL:
                return 0
            if self.scale <= SCALE_FACE:
                for j in range(self.L):
                    self.cz[j] += self.eps * self.cmu[j]
            else:
                # stationarity holds for eps u' (the first projection's z); it holds for
                # u too only where the face is optimal: there u' - u is round-off along
                # the face, elsewhere u' leaves the polytope by 1 / eps
                for i in range(self.V):
                    if self.deg[i] > 0 and \
                            fabs(self.eps * self.cu[i] - self.ckq[i]) > KKT_TOL * max(1.0, wmax):
                        return 0
        # the multipliers: cmu = -mu = -g - R (mu_A - C~ kappa), with mu_A = -sigma lam
        for j in range(self.L):
            self.cmu[j] = -self.sig[j] * self.lam[j] + self.cz[j] if self.var[j] >= 0 else 0.0
        self._R(self.cmu, self.ctmp, NULL)
        self._Ct(self.ctmp, self.ckr)                  # C~^T R (mu_A + z)
        self._solve_kappa()
        self._C(self.ck, self.ctmp)
        for j in range(self.L):
            self.ctmp[j] = -self.sig[j] * self.lam[j] - self.ctmp[j] if self.var[j] >= 0 else 0.0
        self._R(self.ctmp, self.cmu, NULL)
        for j in range(self.L):
            if self.lmask[j]:
                self.cmu[j] = -INFINITY     # a masked part: no structure may use it
            else:
                self.cmu[j] = -(self.cg[j] + self.cmu[j]) if self.var[j] >= 0 else 0.0
        for f in range(self.F):
            code = self._polish_check(<_Workspace> self.wsp[f], f)
            if code == 2 or code == 5:
                self._polish_repair(<_Workspace> self.wsp[f], code)
                changed = True
            elif code != 1:
                return 0
        if changed:
            return 2
        # accepted: the weights (kept in each ws.x1 by the check), and the polished u
        for f in range(self.F):
            self._polish_accept(<_Workspace> self.wsp[f])
        for i in range(self.V):
            if self.deg[i] > 0:
                self.u[i] = self.cu[i]
        self.res_primal = self._primal_residual()
        self.res_dual = 0.0
        self.polished = True
        return 1

    cdef int _polish_repair(self, _Workspace ws, int code) except -1 nogil:
        """code 2: drop the structures whose polished weight (ws.x1) is negative; code 5:
        take in MAP's structure (ws.snew) at weight 0. The weights are then the polished
        ones clipped (uniform if none is left), and ws.u a point of the new face."""
        cdef Py_ssize_t t, n = ws.nI
        cdef double psum = 0.0
        if code == 5:
            ws._insert(ws.snew, 0.0)
            return 0
        t = n - 1
        while t >= 0 and ws.nI > 1:
            if ws.x1[t] < -KKT_TOL:
                ws._remove(t)
            t -= 1
        for t in range(ws.nI):
            ws.y[t] = 1.0 / ws.nI
        ws._compute_u(ws.y, False)
        return 0

    cdef int _solve_kappa(self) except -1 nogil:
        """ck = kappa with (C~^T R C~) kappa = ckr, by CG from 0 (variables of degree >= 1)."""
        cdef Py_ssize_t i, it = 0, V = self.V
        cdef double rs, rs_new, pq, alpha, target
        for i in range(V):
            if self.deg[i] == 0:
                self.ckr[i] = 0.0
        for i in range(V):
            self.ck[i] = 0.0
            self.ckp[i] = self.ckr[i]
        rs = _dot(self.ckr, self.ckr, V)
        target = CG_RTOL * CG_RTOL * max(rs, 1e-300)
        while rs > target and it < POLISH_MAX_CG:
            self._C(self.ckp, self.ctmp)
            self._R(self.ctmp, self.cq, NULL)
            self._Ct(self.cq, self.ckq)
            for i in range(V):
                if self.deg[i] == 0:
                    self.ckq[i] = 0.0
            pq = _dot(self.ckp, self.ckq, V)
            if pq <= 0.0:
                break
            alpha = rs / pq
            for i in range(V):
                self.ck[i] += alpha * self.ckp[i]
                self.ckr[i] -= alpha * self.ckq[i]
            rs_new = _dot(self.ckr, self.ckr, V)
            for i in range(V):
                self.ckp[i] = self.ckr[i] + (rs_new / rs) * self.ckp[i]
            rs = rs_new
            it += 1
        return 0

    cdef int _polish_prepare(self, _Workspace ws, Py_ssize_t f) except -1 nogil:
        """t_f (a point of the face, minus s) into ct; the eta_v term g_f into cg (literal)."""
        cdef Py_ssize_t j, a = self.uoff[f]
        for j in range(a, self.uoff[f + 1]):
            self.ct[j] = ws.u[j - a] - self.sh[j] if self.var[j] >= 0 else 0.0
            self.cg[j] = 0.0
        if ws.n_v:
            self._prop1(ws, NULL, self.ev + self.voff[f], self.cg + a, NULL, ws.x1, NULL)
        return 0

    cdef int _polish_check(self, _Workspace ws, Py_ssize_t f) except -1 nogil:
        """Factor f's KKT conditions at the polished point: 1 when they hold, else the
        first that fails: 2 a negative weight, 3 weights that do not sum to one, 4 support
        structures of different reduced scores, 5 a better structure (in ws.snew). Its
        weights are left in ws.x1."""
        cdef Py_ssize_t j, t, a = self.uoff[f], b = self.uoff[f + 1], n = ws.nI
        cdef double* x = ws.x1
        cdef double* ev = self.ev + self.voff[f] if ws.n_v else NULL
        cdef double scale = 1.0, val, tau_hi = -INFINITY, tau_lo = INFINITY, best, psum = 0.0
        # the literals of the polished u (into ctmp), then p = G_c^{-1} (M_S^T l + c 1)
        for j in range(a, b):
            self.ctmp[j] = self.sh[j] + self.sig[j] * self.cu[self.var[j]] \
                if self.var[j] >= 0 else 0.0
        for t in range(n):
            ws.f.c_score(ws.S + t * ws.k, self.ctmp + a, self.zv, &x[t])
            x[t] += ws.c
        ws._solve_lower(x)
        ws._solve_upper(x)
        for t in range(n):
            if x[t] < -KKT_TOL:
                return 2
            psum += x[t]
        if fabs(psum - 1.0) > 1e-9:
            return 3
        for j in range(a, b):
            if fabs(self.cmu[j]) > scale and not self.lmask[j]:
                scale = fabs(self.cmu[j])
        if ws.n_v:
            scale = max(scale, _maxabs(ev, ws.n_v))
        # every support structure has the same reduced score, and MAP finds none better
        for t in range(n):
            ws.f.c_score(ws.S + t * ws.k, self.cmu + a, ev if ev != NULL else self.zv, &val)
            tau_hi = max(tau_hi, val)
            tau_lo = min(tau_lo, val)
        if tau_hi - tau_lo > SPREAD_TOL * scale:
            return 4
        ws.f.c_map(self.cmu + a, ev, ws.snew, ws.work)
        ws.n_map += 1
        ws.f.c_score(ws.snew, self.cmu + a, ev if ev != NULL else self.zv, &best)
        return 1 if best - tau_hi <= KKT_TOL * scale else 5

    cdef int _polish_accept(self, _Workspace ws) except -1 nogil:
        """The polished weights; those at round-off level (ADMM approached the face
        through structures whose weight vanishes there) leave the support."""
        cdef Py_ssize_t t
        cdef double psum = 0.0
        for t in range(ws.nI):
            ws.y[t] = ws.x1[t] if ws.x1[t] > ZERO_WEIGHT else 0.0
            psum += ws.y[t]
        for t in range(ws.nI):
            ws.y[t] /= psum
        ws._drop_below(0.0)
        ws._compute_u(ws.y, False)
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
        for j in range(a, self.uoff[f + 1]):
            if self.var[j] >= 0:
                rp = max(rp, fabs(self.sh[j] + self.sig[j] * self.u[self.var[j]] - ws.u[j - a]))
        return rp

    # -- the single-factor Jacobian at the final support (Prop. 1) ------------------------------
    cdef int _prop1(self, _Workspace ws, const double* in_u, const double* in_v, double* out_u,
                    double* out_v, double* buf, double* scratch_u) except -1 nogil:
        """out_u += M_S D (M_S^T in_u + N_S^T in_v); out_v += N_S D (...), D of Prop. 1.

        in_u / in_v NULL: zeros; out_u NULL: scratch_u (n_u) is written instead;
        out_v NULL: skipped. buf holds ws.nI doubles. With in_v, out_v NULL this
        is P_f in_u, the projector onto the directions of factor f's face.
        """
        cdef Py_ssize_t t
        for t in range(ws.nI):
            ws.f.c_score(ws.S + t * ws.k, in_u if in_u != NULL else self.zu,
                         in_v if in_v != NULL else self.zv, &buf[t])
        ws._jacobian(buf)
        if out_u == NULL:
            memset(scratch_u, 0, ws.n_u * sizeof(double))
            out_u = scratch_u
        for t in range(ws.nI):
            ws.f.c_add(ws.S + t * ws.k, buf[t], out_u, out_v if ws.n_v else NULL)
        return 0

    cdef int _R(self, const double* x, double* out, double* buf) except -1 nogil:
        """out = R x = (I - P_f) x, factor by factor, on literal link vectors (0 where untied).

        buf: at least max nI doubles, or NULL to use each workspace's scratch.
        """
        cdef Py_ssize_t f
        for f in range(self.F):
            self._R_factor(<_Workspace> self.wsp[f], f, x, out, buf)
        return 0

    cdef int _R_factor(self, _Workspace ws, Py_ssize_t f, const double* x, double* out,
                       double* buf) except -1 nogil:
        cdef Py_ssize_t j, a = self.uoff[f]
        memset(out + a, 0, ws.n_u * sizeof(double))
        self._prop1(ws, x + a, NULL, out + a, NULL, buf if buf != NULL else ws.x1, NULL)
        for j in range(a, self.uoff[f + 1]):
            out[j] = (x[j] - out[j]) if self.var[j] >= 0 else 0.0
        return 0

    cdef void _C(self, const double* y, double* out) noexcept nogil:
        """out = C~ y: per link sigma_j y_i (0 where untied or the variable is fixed)."""
        cdef Py_ssize_t j
        for j in range(self.L):
            out[j] = self.sig[j] * y[self.cvar[j]] if self.cvar[j] >= 0 else 0.0

    cdef void _Ct(self, const double* z, double* out) noexcept nogil:
        """out = C~^T z on the variables of degree >= 1 (others untouched)."""
        cdef Py_ssize_t j, i
        for i in range(self.V):
            if self.deg[i] > 0:
                out[i] = 0.0
        for j in range(self.L):
            if self.cvar[j] >= 0:
                out[self.cvar[j]] += self.sig[j] * z[j]

    cdef double _residual(self, const double* y, const double* t, double* r, double* tmp,
                          double* buf) except -1 nogil:
        """r = R (C~ y - t) (t NULL: t = 0); returns ||r||^2."""
        cdef Py_ssize_t j
        self._C(y, tmp)
        if t != NULL:
            for j in range(self.L):
                tmp[j] -= t[j]
        self._R(tmp, r, buf)
        return _dot(r, r, self.L)

    cdef Py_ssize_t _project(self, const double* w, const double* t, double* y, double* z,
                             double* r, double* p, double* q, double* tmp, double* a,
                             double* buf, Py_ssize_t max_cg, double* res_out) except -1 nogil:
        """y = w - C~^T R z, the point of {y : R (C~ y - t) = 0} closest to w (degree >= 1).

        (R C~ C~^T R) z = R (C~ w - t) is solved by conjugate gradient from z = 0;
        the system is consistent, so CG converges to its minimum-norm solution (a warm
        start from the last polish round's z saved a tenth of the iterations on the
        alignments, but lets a part of z that CG does not see grow from round to round,
        and with it the round-off of the multipliers).
        With t NULL (t = 0) this is y = Proj_S w, the backward pass. Stops when
        the true constraint residual ||R (C~ y - t)|| is below CG_RTOL times
        max(||w||, ||t||) (checked directly: the recursive residual drifts).
        Returns the CG iterations; res_out gets that residual over the scale.
        """
        cdef Py_ssize_t j, i, it = 0, L = self.L, n_restart = 0
        cdef double scale, rs, rs_new, alpha, pq, target
        cdef bint stalled
        scale = 0.0
        for i in range(self.V):
            if self.deg[i] > 0:
                scale += w[i] * w[i]
        if t != NULL:
            scale = max(scale, _dot(t, t, L))
        scale = sqrt(scale)
        target = CG_RTOL * scale
        for j in range(L):
            z[j] = 0.0
        rs = self._residual(w, t, r, tmp, buf)     # r = b = R (C w - t)
        while True:
            for j in range(L):
                p[j] = r[j]
            stalled = False
            while sqrt(rs) > target and it < max_cg:
                # q = H p = R C C^T R p
                self._R(p, tmp, buf)
                self._Ct(tmp, a)
                self._C(a, tmp)
                self._R(tmp, q, buf)
                pq = _dot(p, q, L)
                if pq <= 0.0:
                    stalled = True
                    break
                alpha = rs / pq
                for j in range(L):
                    z[j] += alpha * p[j]
                    r[j] -= alpha * q[j]
                rs_new = _dot(r, r, L)
                for j in range(L):
                    p[j] = r[j] + (rs_new / rs) * p[j]
                rs = rs_new
                it += 1
            # y = w - C^T R z, and the true residual R (C y - t)
            self._R(z, tmp, buf)
            self._Ct(tmp, a)
            for i in range(self.V):
                if self.deg[i] > 0:
                    y[i] = w[i] - a[i]
            rs = self._residual(y, t, r, tmp, buf)
            n_restart += 1
            if sqrt(rs) <= target or it >= max_cg or stalled or n_restart > 3:
                res_out[0] = sqrt(rs) / scale if scale > 0 else 0.0
                return it
            # else restart CG from the true residual (r = b - H z)

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
        ws._compute_u(ws.y, True)
        v = np.array(<double[:ws.n_v]> ws.v) if ws.n_v else np.zeros(0)
        S, y, _ = ws._export()
        return v, S, y

    def n_map(self):
        return sum([(<_Workspace> ws).n_map for ws in self.workspaces])

    # -- pickling: a result travels with its engine, which its backward pass needs -----------
    def __reduce__(self):
        """The construction, then every array, counter and workspace support (structures,
        weights, Cholesky factor, ``w2``), bitwise: ``jvp`` / ``vjp`` after the trip are
        those before it, with no new solve."""
        a = self._arrays
        st = self.structure
        # wsp: this process's pointers; the structure's arrays are rebuilt from the graph
        arrays = {k: v for k, v in a.items()
                  if k not in ("wsp", "uoff", "voff", "var", "sig", "sh")}
        scalars = dict(res_primal=self.res_primal, res_dual=self.res_dual, n_iter=self.n_iter,
                       n_inner_fail=self.n_inner_fail, status=self.status,
                       polished=self.polished, n_polish=self.n_polish,
                       infeasible_factor=self.infeasible_factor)
        return (_engine_from_state,
                (st.factors, st.variables, st.negated, self.V, a["eta0"][:self.V], a["ev0"],
                 self.rho, self.try_polish, arrays, scalars,
                 [_workspace_state(ws) for ws in self.workspaces]))

    def _restore(self, dict arrays, dict scalars, list workspaces):
        cdef Py_ssize_t f
        cdef Factor fac
        for k, v in arrays.items():
            if self._arrays[k] is not self.structure.__dict__.get(k):   # never the shared
                np.copyto(self._arrays[k], v)
        self.res_primal = scalars["res_primal"]
        self.res_dual = scalars["res_dual"]
        self.n_iter = scalars["n_iter"]
        self.n_inner_fail = scalars["n_inner_fail"]
        self.status = scalars["status"]
        self.polished = scalars["polished"]
        self.n_polish = scalars["n_polish"]
        self.infeasible_factor = scalars["infeasible_factor"]
        for f in range(self.F):
            fac = self.factors[f]
            _workspace_restore(self.workspaces[f], workspaces[f], self.scores + self.uoff[f],
                               self.evs + self.voff[f] if fac.n_v else NULL)

    # -- backward --------------------------------------------------------------------------------
    def project(self, g):
        """Proj_S g (degree-0 entries: g * 1[0 < eta < 1]), CG iterations, relative residual."""
        cdef double[::1] w = np.array(g, dtype=np.float64)
        cdef double[::1] y = np.array(g, dtype=np.float64)
        cdef Py_ssize_t L = self.L + 1, n_cg, i, max_s = 1
        cdef double[::1] z = np.zeros(L), r = np.zeros(L), p = np.zeros(L), q = np.zeros(L)
        cdef double[::1] tmp = np.zeros(L), a = np.zeros(self.V + 1)
        for ws in self.workspaces:
            max_s = max(max_s, (<_Workspace> ws).nI)
        cdef double[::1] buf = np.empty(max_s)
        cdef double res = 0.0
        with nogil:
            n_cg = self._project(&w[0], NULL, &y[0], &z[0], &r[0], &p[0], &q[0], &tmp[0], &a[0],
                                 &buf[0], 10 * (self.L + 10), &res)
            for i in range(self.V):
                if self.deg[i] == 0 and not (0.0 < self.eta0[i] < 1.0):
                    y[i] = 0.0
        return np.asarray(y), n_cg, res

    # The two products below run once per factor in a jvp / vjp, so their buffers are
    # sized for factor f alone (and owned by the call: results may run in threads).
    def add_eta_v_direction(self, Py_ssize_t f, const double[::1] dv, double[::1] out):
        """out (V) += C~_f^T M_S D N_S^T dv: factor f's eta_v direction, mapped to the variables."""
        cdef _Workspace ws = self.workspaces[f]
        cdef double[::1] b = np.empty(max(ws.nI, 1))
        cdef double[::1] lit = np.zeros(max(ws.n_u, 1))
        cdef Py_ssize_t j, a = self.uoff[f]
        with nogil:
            self._prop1(ws, NULL, &dv[0], &lit[0], NULL, &b[0], NULL)
            for j in range(a, self.uoff[f + 1]):
                if self.cvar[j] >= 0:
                    out[self.cvar[j]] += self.sig[j] * lit[j - a]

    def eta_v_gradient(self, Py_ssize_t f, const double[::1] y):
        """N_S D M_S^T C~_f y: the gradient of factor f's eta_v, given Proj_S g = y."""
        cdef _Workspace ws = self.workspaces[f]
        cdef double[::1] b = np.empty(max(ws.nI, 1))
        cdef double[::1] s = np.empty(max(ws.n_u, 1))
        cdef double[::1] gv = np.zeros(ws.n_v)
        cdef double[::1] lit = np.zeros(max(ws.n_u, 1))
        cdef Py_ssize_t j, a = self.uoff[f]
        with nogil:
            for j in range(a, self.uoff[f + 1]):
                lit[j - a] = self.sig[j] * y[self.cvar[j]] if self.cvar[j] >= 0 else 0.0
            self._prop1(ws, &lit[0], NULL, NULL, &gv[0], &b[0], &s[0])
        return np.asarray(gv)

    def complete_faces(self, faces, Py_ssize_t budget):
        """Append weight-0 rows to every factor's support until they span the optimal
        face at the certified multipliers plus the normals of the constraints tight at the
        factor's point (``faces``: the structure's _Faces, the constraints of each
        factor). Returns, per factor, the rows appended and the face status.

        The support alone spans only the part of the face that its weights use: a point
        on a diagonal of a factor's square face has a support of two corners, and a
        backward pass on those alone keeps the other diagonal fixed, which the scores
        do not (a wrong Jacobian with a right u). The rows are for the backward pass:
        the weights are untouched, and each workspace goes back to the engine's scores.
        Polished engines only (the multipliers must be certified)."""
        cdef Py_ssize_t F = self.F, f, n = 1
        for f in range(F):
            n = max(n, (<_Workspace> self.wsp[f]).n_u + (<_Workspace> self.wsp[f]).n_v)
        cdef double[::1] eu = np.zeros(n), ev = np.zeros(n), x = np.zeros(n), d = np.zeros(n)
        cdef Py_ssize_t[::1] added = np.zeros(F, dtype=np.intp)
        cdef int[::1] status = np.zeros(F, dtype=np.intc)
        cdef const char[::1] xbin = faces.xbin
        cdef const Py_ssize_t[::1] xoff = faces.xoff, rfac = faces.rfac, rptr = faces.rptr
        cdef const Py_ssize_t[::1] ridx = faces.ridx
        cdef const double[::1] rcoef = faces.rcoef, rlo = faces.rlo, rhi = faces.rhi
        with nogil:
            for f in range(F):
                self._complete_one(<_Workspace> self.wsp[f], f, &xbin[xoff[f]],
                                   rfac[f], rfac[f + 1], &rptr[0], &ridx[0], &rcoef[0],
                                   &rlo[0], &rhi[0], &eu[0], &ev[0], &x[0], &d[0], budget,
                                   &added[f], &status[f])
        return np.asarray(added), np.asarray(status)

    cdef int _complete_one(self, _Workspace ws, Py_ssize_t f, const char* xbin,
                           Py_ssize_t r0, Py_ssize_t r1, const Py_ssize_t* rptr,
                           const Py_ssize_t* ridx, const double* rcoef, const double* rlo,
                           const double* rhi, double* eu, double* ev, double* x, double* d,
                           Py_ssize_t budget, Py_ssize_t* added, int* status) except -1 nogil:
        """complete_faces for factor f: d = the tight normals at x = (M p, N p)."""
        cdef Py_ssize_t j, r, k, a = self.uoff[f], nu = ws.n_u, nx = ws.n_u + ws.n_v
        cdef Py_ssize_t n0 = ws.nI
        cdef double big = 1.0, val, size
        status[0] = FACE_CERTIFIED
        if ws.nI == 0 or nu == 0:
            return 0
        ws._compute_u(ws.y, True)
        for j in range(nu):
            x[j] = ws.u[j]
        for j in range(ws.n_v):
            x[nu + j] = ws.v[j]
        # box normals where a 0/1 part is at its bound, then the tight rows' normals
        for j in range(nx):
            d[j] = 0.0
            if xbin[j]:
                if x[j] <= FACE_INTEGRAL:
                    d[j] = -1.0
                elif x[j] >= 1.0 - FACE_INTEGRAL:
                    d[j] = 1.0
        for r in range(r0, r1):
            val = 0.0
            size = 0.0
            for k in range(rptr[r], rptr[r + 1]):
                val += rcoef[k] * x[ridx[k]]
                size += fabs(rcoef[k])
            size = FACE_INTEGRAL * max(1.0, size)
            if val >= rhi[r] - size:
                for k in range(rptr[r], rptr[r + 1]):
                    d[ridx[k]] += rcoef[k]
            if val <= rlo[r] + size:
                for k in range(rptr[r], rptr[r + 1]):
                    d[ridx[k]] -= rcoef[k]
        # the normals at the multipliers' scale: a structure off the smallest face then
        # loses at least about that much (one unit of a 0/1 part), far beyond the
        # completion's tie tolerance
        for j in range(a, self.uoff[f + 1]):
            if self.var[j] >= 0 and fabs(self.cmu[j]) < INFINITY:
                big = max(big, fabs(self.cmu[j]))
        if ws.n_v:
            big = max(big, _maxabs(self.ev + self.voff[f], ws.n_v))
        for j in range(nu):
            # the optimal face at (cmu + big d_u, ev + big d_v): adjusted scores eta_u - u
            eu[j] = (self.cmu[a + j] if self.var[a + j] >= 0 else 0.0) + big * d[j] + x[j]
        for j in range(ws.n_v):
            ev[j] = self.ev[self.voff[f] + j] + big * d[nu + j]
        ws._rescore(eu, ev if ws.n_v else NULL)
        status[0] = _complete(ws, budget, 0.0, NULL, NULL)
        # back to the engine's scores (theta of the new rows included)
        ws._rescore(self.scores + a, self.evs + self.voff[f] if ws.n_v else NULL)
        added[0] = ws.nI - n0
        return 0

    def face_rows(self, Py_ssize_t f):
        return (<_Workspace> self.workspaces[f]).nI

    def truncate_face(self, Py_ssize_t f, Py_ssize_t n):
        """Drop factor f's rows from the n-th on (weight-0 rows of complete_face)."""
        cdef _Workspace ws = self.workspaces[f]
        while ws.nI > n:
            ws._remove(ws.nI - 1)

    def u_raw(self):
        """The engine's own u (not clipped)."""
        return np.array(self._arrays["u"][:self.V])

    def factor_u(self, Py_ssize_t f):
        """M_f y_f: factor f's literal values from its support, flat."""
        cdef _Workspace ws = self.workspaces[f]
        ws._compute_u(ws.y, False)
        return np.array(<double[:ws.n_u]> ws.u) if ws.n_u else np.zeros(0)

    def factor_face(self, Py_ssize_t f):
        """``(nu_f, eta_v[f])``, flat: factor f's final face is the set of its structures
        that maximise ``nu_f . m_s + eta_v[f] . n_s``, with ``nu`` the certified
        multipliers (polished results only)."""
        return (self.multipliers()[self.uoff[f]:self.uoff[f + 1]],
                np.array(self._arrays["ev0"][self.voff[f]:self.voff[f + 1]]))

    # -- LP-MAP decoding (sparsemap._lp_map): the multipliers behind its dual bound ----------------
    def multipliers(self):
        """Per link, in literal space, the multipliers nu of the constraints M_f p_f = l_f(u):
        the certified ones when polished (then sum_j sigma_j nu_j = eta_i - u_i and every
        support structure maximises nu_f . m_s + eta_v[f] . n_s), ADMM's otherwise; in the
        scores' units (the engine's are divided by ``scale``), -inf on masked links."""
        a = self._arrays
        if self.polished:
            return a["cmu"][:self.L] * self.scale
        nu = a["sig"][:self.L] * a["lam"][:self.L] * self.scale
        nu[a["lmask"][:self.L] != 0] = -np.inf
        return nu


def _engine_from_state(factors, variables, negated, n_variables, eta_u, eta_v, rho, polish,
                       arrays, scalars, workspaces):
    """Unpickle an :class:`_Engine` (see ``_Engine.__reduce__``)."""
    fixed = arrays["fix"][:n_variables] != 0
    engine = _Engine(_Structure(factors, variables, negated, n_variables), eta_u, eta_v, rho,
                     polish, fixed if fixed.any() else None)
    engine._restore(arrays, scalars, workspaces)
    return engine


cdef tuple _workspace_state(_Workspace ws):
    """What a factor's workspace holds about its final support: the structures, weights,
    Cholesky factor and ``w2 = L^{-1} 1`` (the columns'), the shift ``c``, and counters."""
    S, y, L = ws._export()
    w2 = np.array(<double[:ws.nI]> ws.w2) if ws.nI else np.zeros(0)
    return (S, y, L, w2, ws.c, ws.n_map, ws.hash)


cdef int _workspace_restore(_Workspace ws, tuple state, const double* eta_u,
                            const double* eta_v) except -1:
    """An empty workspace <- a state from :func:`_workspace_state`, pointed at the scores
    (from which ``_rescore`` recomputes the score terms, as after an ADMM step)."""
    S, y, L, w2, c, n_map, h = state
    cdef const int[:, ::1] Sv = np.ascontiguousarray(S, dtype=np.intc)
    cdef const double[::1] yv = np.ascontiguousarray(y, dtype=np.float64)
    cdef const double[:, ::1] Lv = np.ascontiguousarray(L, dtype=np.float64)
    cdef const double[::1] wv = np.ascontiguousarray(w2, dtype=np.float64)
    cdef Py_ssize_t n = yv.shape[0], i, j
    ws._grow(n)
    for i in range(n):
        for j in range(ws.k):
            ws.S[i * ws.k + j] = Sv[i, j]
        ws.y[i] = yv[i]
        ws.w2[i] = wv[i]
        for j in range(i + 1):
            ws.L[i * ws.cap + j] = Lv[i, j]
    ws.nI = n
    ws.c = c
    ws.n_map = n_map
    ws.hash = h
    ws._rescore(eta_u, eta_v)
    ws._compute_u(ws.y, True)
    return 0


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
ENGINE_CONVERGED, ENGINE_MAX_ITER, ENGINE_INFEASIBLE = CONVERGED, MAX_ITER, INFEASIBLE


class _Structure:
    """What every solve of a graph shares: the links (each factor's parts, flat), their
    variables, signs and shifts, the degrees, and the groups of links whose literals sum
    to a constant (see _constant_sums). Built once per graph structure (FactorGraph
    keeps it until a factor or variable is added); engines only read it."""

    def __init__(self, factors, variables, negated, n_variables):
        F = len(factors)
        self.factors = list(factors)
        self.variables, self.negated = list(variables), list(negated)
        self.F, self.V = F, n_variables
        nu = [f.n_u for f in factors]
        nv = [f.n_v for f in factors]
        self.uoff = np.zeros(F + 1, dtype=np.intp)
        self.voff = np.zeros(F + 1, dtype=np.intp)
        np.cumsum(nu, out=self.uoff[1:])
        np.cumsum(nv, out=self.voff[1:])
        self.L, self.LV = int(self.uoff[F]), int(self.voff[F])
        self.max_nu, self.max_nv = max(nu + [1]), max(nv + [1])
        # every link array gets one spare entry, so that none is empty
        self.var = np.concatenate([np.asarray(v, dtype=np.intc).reshape(-1) for v in variables]
                                  + [np.full(1, -1, np.intc)]).astype(np.intc)
        neg = np.concatenate([np.asarray(v, dtype=bool).reshape(-1) for v in negated]
                             + [np.zeros(1, bool)])
        self.tied = self.var >= 0
        self.sig = np.where(neg, -1.0, 1.0)
        self.sh = np.where(neg, 1.0, 0.0)
        self.deg = np.bincount(self.var[self.tied], minlength=n_variables + 1).astype(np.intc)
        self.nofix = np.zeros(n_variables + 1, dtype=np.int8)
        self.nomask = np.zeros(self.L + 1, dtype=np.int8)
        self.factor_of = np.repeat(np.arange(F), nu)          # per link (no spare)
        # groups of links whose literals sum to a constant (plain parts only): id per link
        gid = np.full(self.L, -1, dtype=np.intp)
        k = 0
        for f, factor in enumerate(factors):
            for g in _constant_sums(factor):
                links = self.uoff[f] + g
                if np.all(self.var[links] >= 0) and not np.any(neg[links]):
                    gid[links] = k
                    k += 1
        self.group, self.n_groups = gid, k
        self.counting = _counting_parts(self, factors, neg)
        self._faces = None

    def faces(self):
        """The factors' constraints for the backward pass's face completion (_Faces)."""
        if self._faces is None:
            self._faces = _Faces(self.factors)
        return self._faces


def _cardinality(factor):
    """(lo, hi): the bounds a factor puts on the sum of its parts, when those are all it
    says (a XorFactor, AtMostOneFactor, OrFactor, BudgetFactor); else None."""
    if isinstance(factor, XorFactor):
        return 1, 1
    if isinstance(factor, AtMostOneFactor):
        return 0, 1
    if isinstance(factor, OrFactor):
        return 1, factor.n_u
    if isinstance(factor, BudgetFactor):
        return (factor.budget if factor.exact else 0), factor.budget
    return None


def _counting_parts(st, factors, neg):
    """Parts of a graph where a count proves infeasibility at once: sets of cardinality
    factors (plain, distinct variables) that split into two sides, each covering every
    variable of the set exactly once (the rows and the columns of an alignment). Then
    every point has sum(lo, side A) <= sum(u) <= sum(hi, side B), and the reverse: more
    Xor rows than AtMostOne columns is infeasible. Returns [(side A, side B, lo, hi)],
    lo and hi per factor of the graph."""
    F = len(factors)
    lo = np.zeros(F)
    hi = np.zeros(F)
    card = np.zeros(F, bool)
    for f, factor in enumerate(factors):
        b = _cardinality(factor)
        links = np.arange(st.uoff[f], st.uoff[f + 1])
        v = st.var[links]
        if b is None or np.any(v < 0) or np.any(neg[links]) or np.unique(v).size != v.size:
            continue
        card[f] = True
        lo[f], hi[f] = b
    if card.sum() < 2:
        return []
    links = np.flatnonzero(card[st.factor_of])
    var, fac = st.var[links], st.factor_of[links]
    uses = np.bincount(var, minlength=st.V)
    # factors joined through variables shared by exactly two cardinality factors
    by_var = {}
    for v, f in zip(var.tolist(), fac.tolist()):
        by_var.setdefault(v, []).append(f)
    adj = {}
    for v, fs in by_var.items():
        if len(fs) == 2:
            a, b = fs
            adj.setdefault(a, set()).add(b)
            adj.setdefault(b, set()).add(a)
    side = {}
    out = []
    for f0 in adj:
        if f0 in side:
            continue
        side[f0] = 0
        comp, stack, ok = [f0], [f0], True
        while stack:
            f = stack.pop()
            for g in adj[f]:
                if g not in side:
                    side[g] = 1 - side[f]
                    comp.append(g)
                    stack.append(g)
                elif side[g] == side[f]:
                    ok = False
        # every variable of the component in one factor of each side
        if ok and all(uses[v] == 2 for f in comp
                      for v in st.var[st.uoff[f]:st.uoff[f + 1]].tolist()):
            A = np.array(sorted(f for f in comp if side[f] == 0))
            B = np.array(sorted(f for f in comp if side[f] == 1))
            out.append((A, B))
    return [(A, B, lo, hi) for A, B in out]


def _count_conflict(st, fixed):
    """(side A, side B, need, room) of a counting part that no point satisfies: one
    side needs more variables on than the other has room for (room shrinks with the
    masked variables), or None."""
    if not st.counting:
        return None
    room_cut = None
    if fixed is None:
        fixed = np.zeros(st.V, bool)
    if fixed is not None and fixed.any():
        links = np.flatnonzero(st.tied[:st.L] & fixed[np.maximum(st.var[:st.L], 0)])
        room_cut = np.bincount(st.factor_of[links], minlength=st.F)
    for A, B, lo, hi in st.counting:
        n = np.diff(st.uoff)
        hi_eff = hi if room_cut is None else np.minimum(hi, n - room_cut)
        for X, Y in ((A, B), (B, A)):
            need, room = lo[X].sum(), hi_eff[Y].sum()
            if need > room:
                return X, Y, float(need), float(room)
    return None



def _constant_sums(factor):
    """Groups of a factor's unary parts (flat indices) whose sum is the same for every
    structure: a row of a XorFactor or an exact budget, a position of a sequence, the
    heads of a tree's word, the rows (or columns) of a matching that match them all."""
    cdef Py_ssize_t n, m
    if isinstance(factor, XorFactor) or (isinstance(factor, (BudgetFactor, SequenceBudgetFactor))
                                         and factor.exact):
        return [np.arange(factor.n_u)]
    if isinstance(factor, SequenceFactor):
        return list(np.arange(factor.n_u).reshape(factor.shape_u))
    if isinstance(factor, TreeFactor):
        n = factor.n_words + 1
        return [np.array([h * n + m for h in range(n) if h != m]) for m in range(1, n)]
    if isinstance(factor, MatchingFactor):
        ix = np.arange(factor.n_u).reshape(factor.shape_u)
        if factor.n_rows <= factor.n_cols:
            return list(ix)
        return list(ix.T)
    return []



def _linear_rows(factor):
    """The factor's polytope's inequalities beyond the box: [(idx, coef, lo, hi)] over
    the concatenated parts (unary, then additional: index n_u + k), and whether they,
    with 0 <= x <= 1 and the family's equalities, describe the polytope completely.
    None for a family whose description this does not know (then only the box)."""
    n = factor.n_u
    ix = np.arange(n)
    one = np.ones(n)
    if isinstance(factor, (XorFactor, XorOutFactor)):
        return [], True                      # an equality: tight everywhere
    if isinstance(factor, AtMostOneFactor):
        return [(ix, one, -np.inf, 1.0)], True
    if isinstance(factor, OrFactor):
        return [(ix, one, 1.0, np.inf)], True
    if isinstance(factor, BudgetFactor):
        return ([] if factor.exact else [(ix, one, -np.inf, float(factor.budget))]), True
    if isinstance(factor, ImplyFactor):
        # OR of the negated first n - 1 and the last: -sum_{i<n} x_i + x_n >= 2 - n
        c = -one
        c[n - 1] = 1.0
        return [(ix, c, 2.0 - n, np.inf)], True
    if isinstance(factor, OrOutFactor):
        rows = [(np.array([i, n - 1]), np.array([1.0, -1.0]), -np.inf, 0.0)
                for i in range(n - 1)]
        c = -one
        c[n - 1] = 1.0
        return rows + [(ix, c, -np.inf, 0.0)], True
    if isinstance(factor, AndOutFactor):
        rows = [(np.array([i, n - 1]), np.array([-1.0, 1.0]), -np.inf, 0.0)
                for i in range(n - 1)]
        c = one.copy()
        c[n - 1] = -1.0
        return rows + [(ix, c, -np.inf, n - 2.0)], True
    if isinstance(factor, PairFactor):
        # v = y0 y1: max(0, y0 + y1 - 1) <= v <= min(y0, y1)
        return [(np.array([0, 1, 2]), np.array([-1.0, -1.0, 1.0]), -1.0, np.inf),
                (np.array([0, 2]), np.array([-1.0, 1.0]), -np.inf, 0.0),
                (np.array([1, 2]), np.array([-1.0, 1.0]), -np.inf, 0.0)], True
    if isinstance(factor, KnapsackFactor):
        return [(ix, np.asarray(factor.costs, dtype=np.float64).reshape(-1), -np.inf,
                 float(factor.budget))], True
    if isinstance(factor, SequenceFactor):
        return [], True                      # the chain's local polytope: equalities, x >= 0
    if isinstance(factor, MatchingFactor):
        g = np.arange(n).reshape(factor.shape_u)
        if factor.n_rows == factor.n_cols:
            return [], True
        longer = g.T if factor.n_rows < factor.n_cols else g   # the side matched at most once
        return [(r, np.ones(r.size), -np.inf, 1.0) for r in longer], True
    return [], False


class _Faces:
    """Per factor of a graph, the constraints of its polytope beyond its equalities, for
    the backward pass's face completion (_Engine.complete_faces), flat over factors:
    ``xbin`` (per part, unary then additional, from ``xoff[f]``) marks the 0/1 parts whose
    bounds 0 <= x <= 1 are listed; rows ``rfac[f]..rfac[f + 1]`` are factor f's
    inequalities ``lo <= coef . x[idx] <= hi`` (entries ``rptr[r]..rptr[r + 1]``);
    ``complete[f]``: these, the bounds and the family's equalities describe the
    polytope (_linear_rows), so the completed face is the smallest one holding the
    factor's point. Built once per graph structure, at its first backward pass."""

    def __init__(self, factors):
        xbin, xoff, rfac, rptr = [], [0], [0], [0]
        ridx, rcoef, rlo, rhi, complete = [], [], [], [], []
        for factor in factors:
            nu, nv = factor.n_u, factor.n_v
            binary = np.ones(nu + nv, np.int8)
            nb = factor._non_binary_parts()
            if nb is not None and len(nb):
                binary[np.asarray(nb, dtype=np.intp)] = 0
            if not isinstance(factor, SequenceFactor):
                binary[nu:] = 0   # a sequence's transitions are 0/1; a pair's v has rows
            rows, full = _linear_rows(factor)
            xbin.append(binary)
            xoff.append(xoff[len(xoff) - 1] + nu + nv)
            for idx, c, lo, hi in rows:
                ridx.append(np.asarray(idx, dtype=np.intp))
                rcoef.append(np.asarray(c, dtype=np.float64))
                rptr.append(rptr[len(rptr) - 1] + len(idx))
                rlo.append(lo)
                rhi.append(hi)
            rfac.append(rfac[len(rfac) - 1] + len(rows))
            complete.append(full)
        self.xbin = np.concatenate(xbin + [np.zeros(1, np.int8)]).astype(np.int8)
        self.xoff = np.asarray(xoff, dtype=np.intp)
        self.rfac = np.asarray(rfac, dtype=np.intp)
        self.rptr = np.asarray(rptr, dtype=np.intp)
        self.ridx = np.concatenate(ridx + [np.zeros(1, np.intp)]).astype(np.intp)
        self.rcoef = np.concatenate(rcoef + [np.zeros(1)]).astype(np.float64)
        self.rlo = np.asarray(rlo + [0.0], dtype=np.float64)
        self.rhi = np.asarray(rhi + [0.0], dtype=np.float64)
        self.complete = np.asarray(complete, dtype=bool)
