"""LP-SparseMAP (Niculae and Martins, ICML 2020): SparseMAP over a factor graph.

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
"""

import numpy as np

from cpython.ref cimport PyObject
from libc.math cimport fabs, sqrt, INFINITY
from libc.string cimport memcpy, memset

from sparsemap._active_set cimport _Workspace, _dot, _maxabs, _iterate
from sparsemap._active_set import STATUS_CONVERGED, tie_direction
from sparsemap._backward cimport _complete, FACE_CERTIFIED
from sparsemap._backward import FACE_STATUS_FIBERED, reduce_support
from sparsemap import _variables
from sparsemap._checks import check_per_factor
from sparsemap._factors._logic import (AndOutFactor, AtMostOneFactor, BudgetFactor,
                                       ImplyFactor, KnapsackFactor, OrFactor, OrOutFactor,
                                       PairFactor, SequenceBudgetFactor, XorFactor,
                                       XorOutFactor)
from sparsemap._factors._matching import MatchingFactor
from sparsemap._factors._sequence import SequenceFactor
from sparsemap._factors._tree import TreeFactor
from sparsemap._exceptions import ConvergenceError, warn
from sparsemap._factors._base cimport Factor
from sparsemap._factors._base import (SCAN_BAD, _as_float_array, _real_array, _typed_array,
                                     check_bool, check_positive_int, check_real, scan_values)

DEFAULT_MAX_ITER = 10_000
# Untying ties in eta_v (FactorGraphResult._untie): the first delta, relative to the
# scores' scale (small: the check that the piece is the one adjacent to eta is weaker
# than a single factor's), and the most solves.
UNTIE_DELTA = 1e-6
UNTIE_TRIES = 6
DEFAULT_TOL = 1e-10


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


def _describe(f, factor):
    return f"factor {f} ({factor!r})"


def _check_per_factor(factors, values, name, bint zeros):
    """``eta_v`` (or a direction on it): one flat float64 array per factor.

    ``values`` is None or a list with one entry per factor, each shaped like
    the factor's ``shape_v`` or None. Where it (or an entry) is None, and for
    factors without additional scores: zeros if ``zeros``, else None.
    """
    F = len(factors)
    values = [None] * F if values is None else check_per_factor(values, F, name)
    out = []
    for f, (factor, e) in enumerate(zip(factors, values)):
        if e is not None and factor.n_v == 0 and np.size(e) != 0:
            raise ValueError(f"{name}[{f}]: {_describe(f, factor)} has no additional "
                             f"scores; pass None")
        if e is None or factor.n_v == 0:
            out.append(np.zeros(factor.n_v) if zeros else None)
        else:
            out.append(_as_float_array(e, f"{name}[{f}]", factor.shape_v).reshape(-1))
    return out


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
        self.whole = _recognise(self)      # None, or the one factor the graph is

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


class FactorGraph:
    """Binary variables tied together by factors: LP-SparseMAP (Niculae and Martins, 2020).

    Each added factor's unary parts are attached to binary variables
    ``0 .. n_variables - 1`` (the same variable may appear in several factors);
    :meth:`solve` then computes the marginals ``u`` of the variables in the
    local polytope of the graph, the LP-SparseMAP relaxation: the quadratic
    program

    .. math::

        \\max_{u, p}\\; \\eta_u^\\top u - \\tfrac12 \\|u\\|^2
        + \\sum_f \\eta_{v,f}^\\top N_f p_f
        \\quad \\text{s.t.}\\quad M_f p_f = \\ell_f(u),\\; p_f \\in \\triangle_f,

    where ``l_f(u)`` lists, for every part of factor ``f``, the variable it
    stands for (or ``1 -`` that variable when the part is negated), and
    variables in no factor lie in ``[0, 1]``. A graph of one factor whose
    parts are attached to distinct variables is plain SparseMAP.

    Parameters
    ----------
    n_variables : int, optional
        Number of binary variables (>= 1), numbered ``0 .. n_variables - 1``.
        Omit it to declare them as arrays with :meth:`add_variables` (which
        also adds to a given number).

    Attributes
    ----------
    n_variables : int
    factors : list of Factor
        The added factors, in order.
    variables : list of ndarray of int
        For each factor, the variable of each unary part (shape ``factor.shape_u``).
    negated : list of ndarray of bool
        For each factor, which parts stand for ``1 - u``.

    Notes
    -----
    The algorithm is ADMM in which every step on a factor is a warm-started
    SparseMAP call on the exact active set (see :doc:`/factor_graphs`); the
    backward pass (:meth:`FactorGraphResult.jvp`, :meth:`FactorGraphResult.vjp`)
    is exact.

    Examples
    --------
    Three variables, exactly one of the first two on and at most one of the
    last two on:

    >>> import numpy as np, sparsemap as sm
    >>> fg = sm.FactorGraph(3)
    >>> fg.add(sm.XorFactor(2), [0, 1])
    0
    >>> fg.add(sm.AtMostOneFactor(2), [1, 2])
    1
    >>> r = fg.solve(np.array([0.2, 0.5, 0.9]))
    >>> r.converged, r.polished, np.round(r.u, 6)
    (True, True, array([0.533333, 0.466667, 0.533333]))

    The projection of the scores onto ``{u0 + u1 = 1, u1 + u2 <= 1}``; see
    :doc:`/factor_graphs` for a parser with valency constraints.
    """

    def __init__(self, n_variables=None):
        self.n_variables = 0 if n_variables is None else check_positive_int(n_variables,
                                                                           "n_variables")
        self.factors = []
        self.variables = []
        self.negated = []

    def __repr__(self):
        return f"FactorGraph(n_variables={self.n_variables}, n_factors={len(self.factors)})"

    def add(self, factor, variables, negated=None):
        """Attach a factor's unary parts to variables.

        Parameters
        ----------
        factor : Factor
            Any factor: logic, tree, sequence, matching, generic or oracle.
        variables : VariableArray or array_like of int, shape ``factor.shape_u``
            The variable each unary part stands for: a slice of the arrays of
            :meth:`add_variables` (``x[2:, 1]``, ``~x[0]`` for negated
            literals), or the low-level form, variable indices in
            ``[0, n_variables)`` with ``-1`` only where the factor ignores the
            part (the diagonal and column 0 of a :class:`TreeFactor`).
        negated : array_like of bool, shape ``factor.shape_u``, optional
            Where True, the part stands for ``1 - u[i]`` instead of ``u[i]``
            (default: no negation; with a VariableArray, it flips the
            array's own negation). Only on attached parts, and only where the
            factor's parts lie in ``[0, 1]`` (a :class:`GenericFactor` row with
            other values is refused: ``1 - u`` would not be its complement).

        Returns
        -------
        int
            The index of the factor in the graph (its place in ``eta_v`` lists
            and in the result's per-factor lists).

        Raises
        ------
        ValueError
            When ``factor`` is not a Factor, ``variables`` has the wrong shape,
            non-integer values, an index out of range, or -1 on a part the
            factor uses, or ``negated`` is malformed or refused.
        """
        if not isinstance(factor, Factor):
            raise ValueError(f"factor: expected a sparsemap Factor, got {type(factor).__name__}")
        variables, negated = _variables.unpack(self, variables, negated)
        shape = factor.shape_u
        where = lambda: f" (factor.shape_u of {factor!r})"
        var = _typed_array(variables, "variables", shape, "iu", "integers", where)
        bad = (var < -1) | (var >= self.n_variables)
        if np.any(bad):
            raise ValueError(f"variables: expected indices in [0, {self.n_variables}) (or -1 where "
                             f"the factor ignores the part), got {var[bad].reshape(-1)[0]}")
        var = var.astype(np.intc)
        ignored = np.zeros(factor.n_u, bool)
        idx = factor._ignored_entries(False)
        if idx is not None:
            ignored[np.asarray(idx, dtype=np.intp)] = True
        ignored = ignored.reshape(shape)
        loose = (var == -1) & ~ignored
        if np.any(loose):
            idx = tuple(int(x) for x in np.argwhere(loose)[0])
            raise ValueError(f"variables: -1 at {idx}, a part that {factor!r} uses; every used "
                             f"part must stand for a variable (-1 only where the factor ignores "
                             f"the part)")
        if negated is None:
            neg = np.zeros(shape, bool)
        else:
            neg = _typed_array(negated, "negated", shape, "biu", "booleans", where)
            if neg.dtype.kind != "b":
                if np.any((neg != 0) & (neg != 1)):
                    raise ValueError(f"negated: expected booleans (or 0/1), got {neg!r}")
            neg = neg.astype(bool)
            if np.any(neg & (var < 0)):
                raise ValueError("negated: True on a part attached to no variable (-1)")
            nonbinary = factor._non_binary_parts() if np.any(neg) else None
            if nonbinary is not None and len(nonbinary):
                refused = np.zeros(factor.n_u, bool)
                refused[np.asarray(nonbinary, dtype=np.intp)] = True
                refused = refused.reshape(shape) & neg
                if np.any(refused):
                    idx = tuple(int(x) for x in np.argwhere(refused)[0])
                    raise ValueError(f"negated: part {idx} of {factor!r} takes values outside "
                                     f"[0, 1], so 1 - u is not its complement; negation needs "
                                     f"parts that are binary-variable literals")
        var.setflags(write=False)
        neg.setflags(write=False)
        self.factors.append(factor)
        self.variables.append(var)
        self.negated.append(neg)
        return len(self.factors) - 1

    def _structure(self):
        """The graph's _Structure, rebuilt when factors or variables were added."""
        key = (len(self.factors), self.n_variables)
        st = self.__dict__.get("_st")
        if st is None or st[0] != key:
            st = self._st = (key, _Structure(self.factors, self.variables, self.negated,
                                             self.n_variables))
        return st[1]

    def solve(self, eta_u, eta_v=None, max_iter=None, tol=DEFAULT_TOL, rho=None,
              polish=True):
        """LP-SparseMAP marginals of the graph's variables: the certified optimum, or an error.

        Parameters
        ----------
        eta_u : array_like, shape ``(n_variables,)``, or dict
            Unary scores of the variables (each counted once, whatever the
            number of factors the variable is in), or a dict
            ``{VariableArray: scores}`` (see :meth:`scores`). Any finite
            magnitude; ``-inf`` fixes the variable at 0 (a mask). A finite
            score far below all others (below ``-1e6`` times the largest other
            magnitude, as a padding fill with the dtype's minimum) is tried as
            a mask first, and kept as one when the certificate shows the
            variable is 0 at the solution of the given scores; a group of
            variables that a factor forces to a constant sum (a row of a
            :class:`XorFactor`) and whose scores are all that low has the
            largest of them taken off, which does not change the answer.
        eta_v : list, optional
            One entry per added factor, in order: its additional scores
            (shape ``factor.shape_v``, finite), or None (zeros). Must be None
            for a factor without additional scores.
        max_iter : int, optional
            ADMM iteration limit (default 10000); reaching it without a
            certified point raises :class:`~sparsemap.ConvergenceError`.
        tol : float, default 1e-10
            With ``polish=False``, ADMM stops when every factor agrees with
            ``u`` up to ``tol`` (primal residual ``max |l_f(u) - M_f p_f|``)
            and ``rho max |u - u_prev| <= tol`` (dual residual, relative to the
            scale of the scores). With ``polish=True`` this also ends a solve
            whose polish was not certified first.
        rho : float, optional
            ADMM penalty, relative to the scale of the scores (which are
            divided by ``max(1, max |scores|)``); by default
            ``max(0.1, scale ** -0.5)``.
        polish : bool, default True
            Once the factors' supports settle, solve the problem exactly on
            them and keep the result if its KKT conditions hold (then
            ``polished=True`` and ``u`` is exact up to round-off). False runs
            plain ADMM to ``tol``.

        Returns
        -------
        FactorGraphResult

        Raises
        ------
        ValueError
            Wrong shapes or lengths, nan or ``+inf`` scores, ``eta_v`` for a
            factor without additional scores, bad ``max_iter``, ``tol``,
            ``rho`` or ``polish``; or a graph that no point satisfies (with the
            masked variables at 0): the message names the factors in conflict
            (found by counting, by a factor whose every structure is masked,
            or by a Farkas certificate from ADMM's multipliers, within a few
            iterations).
        ConvergenceError
            When ``max_iter`` iterations ran out before a certified point: the
            last iterate is not returned, since it need not satisfy the
            constraints.
        """
        if isinstance(eta_u, dict):
            eta_u = self.scores(eta_u)
        return _raise_unless_solved(self._solve_quiet(eta_u, eta_v, max_iter, tol, rho, polish),
                                    "")

    def _solve_quiet(self, eta_u, eta_v=None, max_iter=None, tol=DEFAULT_TOL, rho=None,
                     polish=True, whole=True):
        """:meth:`solve` without raising on an infeasible graph or a solve that stopped
        uncertified: the result says which (``_status``). Callers that solve in threads
        (the torch layer) raise from their own thread, naming the problem; LP-MAP
        decoding reads uncertified results. ``whole=False``: the graph's own engine even
        when the graph is one factor's polytope (callers that read the engine)."""
        eu = _eta_u_array(eta_u, self.n_variables)
        ev = _check_per_factor(self.factors, eta_v, "eta_v", zeros=True)
        # an explicit ADMM iteration limit asks for ADMM: no single-factor shortcut
        whole = whole and max_iter is None
        max_iter = DEFAULT_MAX_ITER if max_iter is None else check_positive_int(max_iter, "max_iter")
        tol = check_real(tol, "tol")
        rho = None if rho is None else check_real(rho, "rho", positive=True)
        polish = check_bool(polish, "polish")
        flat = np.concatenate(ev + [np.zeros(1)])
        lo = float(eu.min(initial=0.0))
        whole = self._structure().whole if whole and polish else None
        if whole is not None and lo >= -MASK_GAP:
            result = _solve_whole(self, whole, eu, ev)
            if result is not None:
                return result
        if lo >= -MASK_GAP:           # the common case: no mask, no huge negative score
            engine = self._engine(eu, flat, max_iter, tol, rho, polish, None)
            soft = None
        else:
            hard = np.isneginf(eu)
            soft = _mask_candidates(eu, flat, hard)
            border = np.zeros(self.n_variables, bool)
            if soft.any():
                st = self._structure()
                pad = soft | hard
                eu, soft, done = _cancel_forced(st, eu, soft)
                border = _padding_border(st, pad, done)
            if whole is not None:
                result = _solve_whole(self, whole, eu, ev, hard | soft | border, soft)
                if result is not None:
                    return result
            engine = self._engine(eu, flat, max_iter, tol, rho, polish, hard | soft | border)
            if border.any() and engine.status == INFEASIBLE:
                apart = self._engine(eu, flat, max_iter, tol, rho, polish, hard | soft)
                if apart.status != INFEASIBLE:
                    # the padding needs the real part's room: solve (P) with the fill
                    # cancelled, as documented, and say that the real block moves
                    warn(_padding_message(self, engine, border), UserWarning)
                    engine, border = apart, np.zeros(self.n_variables, bool)
        if soft is not None and soft.any() and (engine.status == INFEASIBLE
                                                or not _masks_hold(engine, eu, soft)):
            # a huge negative score that cannot be read as a mask: solve (P) as it is
            # (the padding kept apart from the real part)
            engine = self._engine(eu, flat, max_iter, tol, rho, polish, hard | border)
        result = FactorGraphResult(self, engine, eu, ev)
        result._tol = tol
        result._solve_args = (max_iter, tol, rho, polish)
        return result

    def _engine(self, eu, ev, max_iter, tol, rho, polish, fixed):
        st = self._structure()
        if fixed is not None and not fixed.any():
            fixed = None
        engine = _Engine(st, eu, ev, rho, polish, fixed)
        clash = _count_conflict(st, fixed)
        if clash is None:
            engine.run(max_iter, tol)
        else:                           # infeasible by counting: no iteration needed
            engine.status = INFEASIBLE
            engine.counted = clash
        return engine

    # -- LP-MAP decoding: the method; the algorithm is in sparsemap/_lp_map.py ------
    def solve_map(self, eta_u, eta_v=None, max_iter=None, tol=1e-9):
        """LP-MAP decoding: the LP relaxation of MAP over the local polytope, with a certificate.

        Solves AD3's LP-MAP problem,

            max  eta_u . u + sum_f eta_v[f] . v[f]
            s.t. every factor's (literals of u, v[f]) in its marginal polytope,

        exactly, and certifies the answer by a duality gap. Each factor step is
        the factor's active set on a quadratic subproblem (AD3's QP step); see
        :doc:`/factor_graphs`.

        Parameters
        ----------
        eta_u : array_like, shape ``(n_variables,)``
            Unary scores (each variable counted once).
        eta_v : list, optional
            One entry per factor, as for :meth:`solve`.
        max_iter : int, optional
            ADMM iteration limit of each inner LP-SparseMAP solve.
        tol : float, default 1e-9
            The answer is accepted when its duality gap is at most
            ``tol * max(max |scores|, |lp_value|)``.

        Returns
        -------
        LPMAPResult
            ``u``, ``v``, ``lp_value``, ``dual_bound``, ``gap``,
            ``primal_residual``, ``integral``, ``map`` (the joint
            configuration when integral), ``exact`` (integral and certified:
            an exact MAP).

        Raises
        ------
        ValueError
            Wrong shapes, non-finite scores, bad ``max_iter`` or ``tol``.

        Warns
        -----
        ConvergenceWarning
            When the gap stays above the tolerance; the best point is returned
            with ``converged=False``.

        Notes
        -----
        The relaxation is exact (``exact=True``) when no variable is in two
        factors (the LP splits into one MAP per factor, solved directly) and
        whenever its optimum is integral. When it is fractional, ``u`` is a
        point of the optimal face (as a rule its least-norm point) and ``map``
        is None.

        Examples
        --------
        A frustrated cycle of three "at most one" constraints over three
        variables with equal scores: the relaxation is fractional.

        >>> import numpy as np, sparsemap as sm
        >>> fg = sm.FactorGraph(3)
        >>> for pair in ([0, 1], [1, 2], [0, 2]):
        ...     _ = fg.add(sm.AtMostOneFactor(2), pair)
        >>> r = fg.solve_map(np.ones(3))
        >>> r.integral, round(r.lp_value, 9), r.gap < 1e-9
        (False, 1.5, True)
        >>> r.u
        array([0.5, 0.5, 0.5])
        >>> r = fg.solve_map(np.array([1.0, -0.2, 0.9]))  # tight: exact
        >>> r.exact, r.map.u, round(r.map.score, 9)
        (True, array([1, 0, 0]), 1.0)
        """
        from sparsemap._lp_map import solve_map
        if isinstance(eta_u, dict):
            eta_u = self.scores(eta_u)
        return solve_map(self, eta_u, eta_v, max_iter=max_iter, tol=tol)

    # -- variables and slices: arrays of variables, scores per array ----------------
    def add_variables(self, shape):
        """Declare new binary variables, as an array of the given shape.

        Parameters
        ----------
        shape : int or tuple of int

        Returns
        -------
        VariableArray
            Their ids, ``n_variables .. n_variables + prod(shape) - 1`` in C
            order (``n_variables`` grows by their number). Index it like a
            NumPy array to attach factors to slices: ``fg.add(factor, x[2:, 1])``.

        Raises
        ------
        ValueError
            ``shape`` is not a tuple of non-negative integers.

        Examples
        --------
        A 2 x 3 grid: exactly one on per row, at most one per column.

        >>> import numpy as np, sparsemap as sm
        >>> fg = sm.FactorGraph()
        >>> x = fg.add_variables((2, 3))
        >>> for i in range(2):
        ...     _ = fg.add(sm.XorFactor(3), x[i])
        >>> for j in range(3):
        ...     _ = fg.add(sm.AtMostOneFactor(2), x[:, j])
        >>> r = fg.solve_map({x: [[1.0, 0.5, 0.0], [0.9, 0.2, 0.1]]})
        >>> r.exact, r.lp_value
        (True, 1.4)
        >>> r.map.value(x)
        array([[0, 1, 0],
               [1, 0, 0]])
        """
        return _variables.add_variables(self, shape)

    def scores(self, assignments):
        """The graph's ``eta_u`` from scores given per variable array.

        The structure of a graph is separate from its scores: build it once,
        then score it for every problem of a batch.

        Parameters
        ----------
        assignments : dict or sequence of pairs
            ``{x: scores_x, ...}`` (or ``[(x, scores_x), ...]``), each
            ``scores_x`` shaped like the VariableArray ``x``, or with the same
            leading batch dimensions for every entry. A variable given scores
            by several entries gets their sum; variables given none get 0.

        Returns
        -------
        ndarray, shape ``batch + (n_variables,)``

        Raises
        ------
        ValueError
            A key that is not a VariableArray of this graph (or is negated),
            scores of the wrong shape or non-finite.

        Examples
        --------
        >>> import numpy as np, sparsemap as sm
        >>> fg = sm.FactorGraph()
        >>> x, y = fg.add_variables(2), fg.add_variables(1)
        >>> fg.scores({x: [0.5, -1.0], y: [2.0]})
        array([ 0.5, -1. ,  2. ])
        >>> fg.scores({x: np.ones((4, 2))}).shape           # a batch of 4
        (4, 3)
        """
        return _variables.scores(self, assignments)



# A finite score below -MASK_GAP times every other score's magnitude (and 1) is tried as a
# mask first: such a variable is 0 at the solution whenever that is feasible and the
# certificate below holds (its multipliers absorb the score); otherwise (P) is solved
# as given, at the scale of that score.
MASK_GAP = 1e6


def _eta_u_array(x, Py_ssize_t V):
    """eta_u as float64 (V,), -inf allowed (a mask: the variable is fixed at 0)."""
    arr = _real_array(x, "eta_u")
    if arr.shape != (V,):
        raise ValueError(f"eta_u: expected shape {(V,)}, got {arr.shape}")
    arr = np.ascontiguousarray(arr)
    if scan_values(arr) & SCAN_BAD:
        raise ValueError("eta_u: contains non-finite values other than -inf (nan or +inf); "
                         "only -inf is accepted, to fix a variable at 0 (a mask)")
    return arr


def _mask_candidates(eu, ev, hard):
    """Finite scores that dwarf all others from below (the dtype's minimum as a padding
    fill): below -MASK_GAP times the largest other magnitude, eta_v's and 1 included."""
    neg = np.flatnonzero(~hard & (eu < 0))
    out = np.zeros(eu.shape[0], bool)
    if neg.size == 0:
        return out
    # ev: the eta_v list, or their concatenation (one reduction instead of one per factor)
    evmax = float(np.abs(ev).max(initial=0.0)) if isinstance(ev, np.ndarray) else \
        max([0.0] + [float(np.abs(e).max(initial=0.0)) for e in ev])
    rest = max(1.0, float(eu[~hard & (eu >= 0)].max(initial=0.0)), evmax)
    order = neg[np.argsort(-eu[neg])]             # smallest magnitude first
    mags = -eu[order]
    below = np.empty(mags.size)
    below[0] = rest
    below[1:] = mags[:mags.size - 1]
    np.maximum.accumulate(below, out=below)
    gap = np.flatnonzero(mags / MASK_GAP > below)
    if gap.size:
        out[order[gap[0]:]] = True
    return out


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


# MAP calls per factor that a face completion may spend (the backward pass's, once).
FACE_BUDGET_CALLS = 2000
# Two candidate Jacobians that differ by more than this (relative) on a random direction
# are told apart by central differences (FactorGraphResult._check_faces).
FACE_CHECK_TOL = 1e-9


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


def _cancel_forced(st, eu, soft):
    """Scores with the huge negative scores of forced groups taken off.

    A group of a factor's parts whose literals sum to a constant (a row of a XorFactor:
    exactly one on, whatever the scores) keeps that sum at every point of the local
    polytope, so adding the same number to the scores of its variables changes (P)'s
    objective by a constant and its solution not at all. A group whose variables all
    carry huge negative scores (a padded row) cannot be masked: the factor needs one of
    them on; the largest of those scores is taken off the whole group, which leaves the
    rest of the problem at its own scale. Groups that share a variable are taken one
    at a time (a variable is shifted once per round)."""
    if st.n_groups == 0:
        return eu, soft, np.zeros(0, bool)
    eu = eu.copy()
    done = np.zeros(st.n_groups, bool)
    links = np.flatnonzero(st.group >= 0)
    g, v = st.group[links], st.var[links]
    while True:
        cand = np.bincount(g, weights=soft[v], minlength=st.n_groups)
        full = (cand == np.bincount(g, minlength=st.n_groups)) & (cand > 0)
        if not full.any():
            break
        sel = full[g]
        # groups whose variables no other full group has: all at once; else the first
        uses = np.bincount(v[sel], minlength=st.V)
        shared = np.zeros(st.n_groups, bool)
        shared[g[sel & (uses[v] > 1)]] = True
        take = full & ~shared
        if not take.any():
            take = np.zeros(st.n_groups, bool)
            take[np.flatnonzero(full)[0]] = True
        top = np.full(st.n_groups, -np.inf)
        np.maximum.at(top, g[take[g]], eu[v[take[g]]])
        np.add.at(eu, v[take[g]], -top[g[take[g]]])
        done |= take
        soft = soft & (eu < 0) & _mask_candidates(eu, [], np.isneginf(eu))
    return eu, soft, done


def _padding_border(st, padding, done):
    """The variables of the forced groups _cancel_forced took the fill off (``done``)
    that another factor shares with real variables (not ``padding``): a padded row's
    variables in a real column. Held at 0, they keep the padding apart from the real
    part, whose answer is then the unpadded one (with them free, the padded rows,
    forced on with tied scores, would take mass from the real columns' slack)."""
    border = np.zeros(st.V, bool)
    if not done.any():
        return border
    L = st.L
    var, tied = st.var[:L], st.tied[:L]
    real = np.zeros(st.F, bool)
    links = np.flatnonzero(tied)
    real[np.unique(st.factor_of[links[~padding[var[links]]]])] = True
    own = np.zeros(L, bool)
    own[st.group >= 0] = done[st.group[st.group >= 0]]
    mine = np.zeros(st.V, bool)
    mine[var[own]] = True                  # variables of the cancelled groups
    cand = tied & ~own & real[st.factor_of] & mine[np.maximum(var, 0)]
    border[var[cand]] = True
    return border


def _masks_hold(engine, eu, soft):
    """Whether variables fixed at 0 for a huge negative (finite) score are 0 at the solution
    of (P) with that score: the certified multipliers, changed on the variable's links so
    that they sum to eta_i (plain links share it; a variable with negated links only
    moves those), still make every factor's support optimal. The links of a fixed
    variable have no stationarity condition, so any sum certifies the masked problem;
    this checks the one the score asks for. Polished results only."""
    if not engine.polished:
        return False
    st = engine.structure
    a = engine._arrays
    L, V = st.L, st.V
    var, tied, lmask = st.var[:L], st.tied[:L], a["lmask"][:L] != 0
    nu = np.array(a["cmu"][:L])                     # normalised units
    sel = tied & soft[np.maximum(var, 0)]
    plain, negd = sel & lmask, sel & ~lmask
    target = np.where(soft, eu, 0.0)[:V] / engine.scale
    sneg = np.bincount(var[negd], weights=nu[negd], minlength=V)
    n_plain = np.bincount(var[plain], minlength=V)
    n_neg = np.bincount(var[negd], minlength=V)
    # sum_j sigma_j nu_j = target: sigma = 1 on plain links, -1 on negated ones
    vp = var[plain]
    nu[plain] = (target[vp] + sneg[vp]) / n_plain[vp]
    only = negd & (n_plain[np.maximum(var, 0)] == 0)
    vn = var[only]
    nu[only] += (-target[vn] - sneg[vn]) / n_neg[vn]
    touched = np.zeros(st.F, dtype=np.int8)
    touched[np.unique(st.factor_of[sel])] = 1
    return engine.verify(np.ascontiguousarray(nu), touched) < 0


def _conflicting(engine):
    """The factors an infeasibility involves: the one with no allowed structure, or those
    the Farkas certificate puts weight on."""
    if engine.infeasible_factor >= 0:
        return [int(engine.infeasible_factor)]
    if engine.counted is not None:
        return sorted(int(f) for f in np.concatenate(engine.counted[:2]))
    cert = engine.certificate()
    off = engine._arrays["uoff"]
    size = [float(np.abs(np.where(np.isfinite(cert[off[g]:off[g + 1]]),
                                  cert[off[g]:off[g + 1]], 0.0)).max(initial=0.0))
            for g in range(engine.F)]
    top = max(size + [0.0])
    return [g for g in range(engine.F) if size[g] > 1e-6 * top]


def _conflict_message(graph, engine, where):
    """The ValueError message of an infeasible graph, naming the factors in conflict."""
    masked = bool(np.any(engine._arrays["fix"]))
    f = engine.infeasible_factor
    if f >= 0:
        factor = graph.factors[f]
        var = graph.variables[f].reshape(-1)
        fixed = np.flatnonzero(engine._arrays["fix"][:graph.n_variables])
        hit = np.intersect1d(var[var >= 0], fixed)
        return (f"{where}FactorGraph.solve: infeasible: every structure of factor {f} "
                f"({factor!r}) uses a masked part: variables {_short_list(hit)} are fixed "
                f"at 0 by their -inf scores, and the factor needs one of them on")
    how = " (with the variables whose score is -inf fixed at 0)" if masked else ""
    if engine.counted is not None:
        X, Y, need, room = engine.counted
        why = (f"factors {_factor_groups(graph, X)} need at least {need:g} of their "
               f"variables on, and factors {_factor_groups(graph, Y)}, over the same "
               f"variables, allow at most {room:g}")
    else:
        why = (f"factors {_factor_groups(graph, _conflicting(engine))} conflict (an LP "
               f"certificate: multipliers on their parts under which every point of their "
               f"constraints would score below zero)")
    return (f"{where}FactorGraph.solve: infeasible: no assignment of the variables satisfies "
            f"every factor{how}; {why}")


def _padding_message(graph, engine, border):
    """Why the padding could not be kept apart from the real part (engine: the solve
    with the border held at 0, infeasible)."""
    return (f"FactorGraph.solve: the padding could not be solved apart from the real "
            f"scores: factors whose variables all carry a padding fill (scores below -1e6 "
            f"times the others) force some of them on, and with the padded variables that "
            f"they share with factors over real scores (variables "
            f"{_short_list(np.flatnonzero(border))}) held at 0, no point satisfies factors "
            f"{_factor_groups(graph, _conflicting(engine))}. The padding uses those "
            f"variables, so the answer on the real scores is not the unpadded one. Pad so "
            f"that the padding can satisfy its own factors (a padded Xor row needs a padded "
            f"column it can use), or leave the padded factors out of the graph")


def _short_list(xs, k=8):
    xs = [int(x) for x in xs]
    return ", ".join(map(str, xs[:k])) + (f", ... ({len(xs)} in all)" if len(xs) > k else "")


def _factor_groups(graph, idx):
    """'0-4 (XorFactor(3)) and 5-7 (AtMostOneFactor(5))': runs of factors by repr."""
    groups = []             # [first, last, repr]
    for f in idx:
        r = repr(graph.factors[f])
        if groups and groups[len(groups) - 1][2] == r and groups[len(groups) - 1][1] == f - 1:
            groups[len(groups) - 1][1] = f
        else:
            groups.append([f, f, r])
    parts = [(f"{a}" if a == b else f"{a}-{b}") + f" ({r})" for a, b, r in groups]
    if len(parts) > 6:
        parts = parts[:6] + [f"... ({len(idx)} factors in all)"]
    n = len(parts)
    return ", ".join(parts[:n - 1]) + (" and " if n > 1 else "") + parts[n - 1]


def _raise_unless_solved(result, where, element=None):
    """The result of a solve, or the error that says why there is none: ValueError for an
    infeasible graph, ConvergenceError for a solve that stopped without a certified
    point (``where`` names the batch element ``element``). The ValueError carries
    ``factors`` (the conflicting factors' indices), ``masked`` (whether masks took part)
    and ``batch_element``."""
    if result._status == INFEASIBLE:
        exc = ValueError(_conflict_message(result._graph, result._engine, where))
        exc.factors = _conflicting(result._engine)
        exc.masked = bool(np.any(result._engine._arrays["fix"]))
        exc.batch_element = element
        raise exc
    if not result.converged:
        raise ConvergenceError(
            f"{where}FactorGraph.solve: no certified solution after {result.n_iter} ADMM "
            f"iterations (primal residual {result.primal_residual:.3g}, dual residual "
            f"{result.dual_residual:.3g}); the last iterate is not returned because it "
            f"may violate the constraints. Raise max_iter (it was {result._solve_args[0]}).")
    return result


class FactorGraphResult:
    """Outcome of :meth:`FactorGraph.solve`.

    Attributes
    ----------
    u : ndarray, shape ``(n_variables,)``
        Marginals of the variables, in ``[0, 1]`` exactly (round-off outside
        is clipped).
    v : list of ndarray
        Per factor, its additional marginals ``N_f p_f`` (shape ``factor.shape_v``).
    structures : list of list
        Per factor, its distribution's support: structures in the factor's
        compact form.
    weights : list of ndarray
        Per factor, their weights (positive, summing to one).
    converged : bool
        Whether a polished point was certified optimal, or both residuals
        reached ``tol`` (always True for a result that :meth:`FactorGraph.solve`
        returns: it raises otherwise).
    polished : bool
        Whether the returned point is the exact solution on the final
        supports, certified by the KKT conditions of the problem (every
        factor's weights nonnegative, and no structure of any factor better
        than its support at the multipliers): ``u`` is then exact up to
        round-off.
    n_iter : int
        ADMM iterations run.
    primal_residual : float
        ``max_{f, j} |l_fj(u) - (M_f p_f)_j|``: how far the factors' marginals
        are from the variables' (round-off when polished).
    dual_residual : float
        ``rho * max_i |u_i - u_i^{prev}|`` over the last ADMM iteration,
        relative to the scale of the scores (0 when polished: the certificate
        replaces it).
    objective : float
        ``1/2 ||u||^2 - eta_u . u - sum_f eta_v[f] . v[f]`` (a minimisation,
        as for :func:`solve`).
    rho : float
        The ADMM penalty used, relative to the scale of the scores.
    n_map : int
        MAP oracle calls, over all factors.
    scale : float
        ``max(1, max |scores|)`` over the variables in factors (masked ones
        excepted) and the additional scores: the engine solves the problem
        divided by it, and residuals are relative to it.
    n_inner_unconverged : int
        Factor steps whose SparseMAP solve stopped before its gap tolerance
        (0 in normal use).
    backward_info : dict or None
        After :meth:`jvp` or :meth:`vjp`: ``cg_iterations`` and
        ``relative_residual`` of the last backward solve.
    message : str

    Notes
    -----
    A result pickles with what its backward pass needs (each factor's final
    support and Cholesky factor), so one solved on a process pool or a Dask
    worker comes back with :meth:`jvp` and :meth:`vjp` exact, without a new
    solve.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> fg = sm.FactorGraph(3)
    >>> fg.add(sm.XorFactor(2), [0, 1])
    0
    >>> fg.add(sm.PairFactor(), [1, 2])
    1
    >>> r = fg.solve(np.array([0.2, 0.5, 0.9]), [None, np.array([0.5])])
    >>> r.converged, r.polished
    (True, True)
    >>> print(np.round(r.u, 6))
    [0.1 0.9 0.9]
    >>> print(r.v[1], [s.tolist() for s in r.structures[1]], r.weights[1])
    [0.9] [[1, 1], [0, 0]] [0.9 0.1]
    >>> g_eta_u, g_eta_v = r.vjp(np.array([0.0, 0.0, 1.0]))
    >>> print(np.round(g_eta_u, 6), np.round(g_eta_v[1], 6))
    [-0.333333  0.333333  0.333333] [0.333333]
    """

    def __init__(self, graph, engine, eta_u, eta_v):
        self._engine = engine
        self.factors = tuple(graph.factors)
        self.n_variables = graph.n_variables
        self.u = engine.u_array()
        self.converged = engine.status == CONVERGED
        self.n_iter = int(engine.n_iter)
        self.primal_residual = float(engine.res_primal)
        self.dual_residual = float(engine.res_dual)
        self.rho = float(engine.rho)
        self.scale = float(engine.scale)
        self.n_map = int(engine.n_map())
        self.n_inner_unconverged = int(engine.n_inner_fail)
        self.polished = bool(engine.polished)
        self.message = _MESSAGES[engine.status]
        self._status = engine.status
        self._parts = None
        self.backward_info = None
        # what untying ties in eta_v needs (_backward_engine)
        self._graph, self._eta, self._solve_args, self._bengine = graph, (eta_u, eta_v), None, None

    # v, structures, weights and objective are read off the engine on first use (a layer
    # that only wants u does not pay for them)
    def _read_parts(self):
        if self._parts is None:
            v, structures, weights = [], [], []
            for f, factor in enumerate(self.factors):
                vf, S, y = self._engine.factor_result(f)
                S, y = S[y > 0], y[y > 0]     # not the backward pass's weight-0 rows
                v.append(vf.reshape(factor.shape_v))
                structures.append([factor._to_public(x) for x in S])
                weights.append(y)
            self._parts = (v, structures, weights)
        return self._parts

    @property
    def v(self):
        return self._read_parts()[0]

    @property
    def structures(self):
        return self._read_parts()[1]

    @property
    def weights(self):
        return self._read_parts()[2]

    @property
    def objective(self):
        eta_u, eta_v = self._eta
        on = self.u != 0              # a masked (-inf) variable is 0 and adds nothing
        with np.errstate(over="ignore"):  # scores near the dtype's maximum
            return float(0.5 * self.u @ self.u - eta_u[on] @ self.u[on]
                         - sum(float(e @ v.reshape(-1)) for e, v in zip(eta_v, self.v)))

    def __repr__(self):
        return (f"FactorGraphResult(converged={self.converged}, n_iter={self.n_iter}, "
                f"primal_residual={self.primal_residual:.3g}, "
                f"dual_residual={self.dual_residual:.3g}, objective={self.objective:.10g})")

    # -- ties in eta_v: as for a single factor (docs/solvers.rst, "Ties in eta_v") -----------
    def _backward_engine(self):
        """The engine whose faces the backward pass uses: the solve's, unless a factor's
        final face is fibered (n not affine in m on it: a sequence at tied transition
        scores); then a solve's at eta_v + delta r (r: each factor's tie_direction), the
        Jacobian of the piece u follows from eta along (0, r). Polished results only:
        the check needs certified multipliers."""
        if self._bengine is None:
            engine = self._engine
            if self.polished and self._solve_args is not None and self._fibered():
                engine = self._untie()
            if engine.polished:
                self._check_faces(engine)
            self._bengine = engine
        return self._bengine

    def _check_faces(self, engine):
        """Complete every factor's support on engine to span the smallest face of its
        polytope that holds the factor's point (_Engine.complete_faces): the faces the
        Jacobian keeps. For a factor whose family's description is not known completely
        (_linear_rows) the completed face may be larger than the smallest one; where
        completing such factors changes the Jacobian (on one random direction), central
        differences along that direction choose between the completed faces and the
        supports alone, and a warning says when neither agrees."""
        faces = engine.structure.faces()
        partial = not faces.complete.all()
        rows = [engine.face_rows(f) for f in range(len(self.factors))] if partial else None
        probe = np.random.default_rng(0).standard_normal(self.n_variables)
        before = engine.project(probe)[0] if partial and self._solve_args is not None \
            else None
        added, status = engine.complete_faces(faces, FACE_BUDGET_CALLS)
        unsure = [int(f) for f in np.flatnonzero((status != FACE_CERTIFIED)
                                                 | ((added > 0) & ~faces.complete))]
        if not unsure or before is None:
            return
        after = engine.project(probe)[0]
        atol = FACE_CHECK_TOL * max(1.0, float(np.abs(after).max()), float(np.abs(before).max()))
        if np.abs(after - before).max() <= atol:
            return
        eu, ev = self._eta
        max_iter, tol, rho, polish = self._solve_args
        scale = max([1.0, float(np.abs(eu[np.isfinite(eu)]).max(initial=0.0))]
                    + [float(np.abs(e).max(initial=0.0)) for e in ev])
        evs = [None if not f.n_v else e.reshape(f.shape_v) for f, e in zip(self.factors, ev)]
        for h in (1e-5 * scale, 1e-7 * scale):
            try:
                up = self._graph._solve_quiet(eu + h * probe, evs, max_iter, tol, rho, polish,
                                              whole=False)
                dn = self._graph._solve_quiet(eu - h * probe, evs, max_iter, tol, rho, polish,
                                              whole=False)
            except ValueError:
                break
            if not (up.polished and dn.polished):
                continue
            fd = (up._engine.u_raw() - dn._engine.u_raw()) / (2 * h)
            deg = np.asarray(engine._arrays["deg"][:self.n_variables]) > 0
            if np.abs(after - fd)[deg].max(initial=0.0) <= 1e3 * atol:
                return
            if np.abs(before - fd)[deg].max(initial=0.0) <= 1e3 * atol:
                for f in unsure:
                    engine.truncate_face(f, rows[f])
                return
        warn("FactorGraphResult: the backward pass could not be checked at this point: "
             f"factors {_short_list(unsure)} lie on a degenerate face of their polytopes "
             f"whose smallest face their family does not describe, and central differences "
             f"agree with neither candidate Jacobian; jvp/vjp may not be the derivative")

    def _fibered(self):
        """Whether some factor's final face is fibered: its face completed and checked as
        a single factor's (two MAP calls, see sparsemap._active_set._fibered)."""
        for f, factor in enumerate(self.factors):
            if factor.n_v == 0:
                continue
            nu, ev = self._engine.factor_face(f)
            _, S, y = self._engine.factor_result(f)
            # as SparseMAP scores of the factor alone, eta_u - M y = nu
            face = reduce_support(factor, S, y, nu + self._engine.factor_u(f), ev, 0.0,
                                  DEFAULT_MAX_ITER, untie=False)[4]
            if face == FACE_STATUS_FIBERED:
                return True
        return False

    def _untie(self):
        """The engine of a solve at eta_v + delta r whose faces are the piece along (0, r).

        delta starts at UNTIE_DELTA of the scores' scale and shrinks by 8 until two
        successive solves (delta and delta / 8) are both polished, agree on the Jacobian
        (jvp of two random directions) and on the slope (u(t) - u) / t = J (0, r), and
        every factor's final face at delta / 8 ties at eta (lies in the solve's face).
        Unlike a single factor's (_active_set._untie) this is not a proof that the piece
        is the one adjacent to eta; it is a check, done after at most UNTIE_TRIES solves
        (else the solve's faces are kept, with a warning).
        """
        max_iter, tol, rho, polish = self._solve_args
        eu, ev = self._eta
        rs = [tie_direction(f) if f.n_v else np.zeros(0) for f in self.factors]
        scale = max([1.0, float(np.abs(eu).max(initial=0.0))]
                    + [float(np.abs(e).max(initial=0.0)) for e in ev])
        rng = np.random.default_rng(0)
        probes = [(rng.standard_normal(self.n_variables),
                   [rng.standard_normal(f.n_v) if f.n_v else None for f in self.factors])
                  for _ in range(2)]
        faces = [self._engine.factor_face(f) if factor.n_v else None
                 for f, factor in enumerate(self.factors)]
        u0 = self._engine.u_raw()
        delta = UNTIE_DELTA * scale
        prev = None
        for _ in range(UNTIE_TRIES):
            res = self._graph._solve_quiet(
                eu, [(e + delta * r).reshape(f.shape_v) if f.n_v else None
                     for e, r, f in zip(ev, rs, self.factors)], max_iter, tol, rho, polish,
                whole=False)
            if not res.polished:
                break
            jac = [res._engine.project(res._direction(res._engine, du, dv))[0]
                   for du, dv in probes]
            slope = (res._engine.u_raw() - u0) / delta
            along = res._direction(res._engine, np.zeros(self.n_variables), rs)
            ok = np.allclose(res._engine.project(along)[0], slope,
                             rtol=0, atol=1e-6 * max(1.0, float(np.abs(slope).max())))
            ok = ok and prev is not None and all(
                np.allclose(a, b, rtol=0, atol=1e-9 * max(1.0, float(np.abs(b).max())))
                for a, b in zip(jac, prev))
            for f, factor in enumerate(self.factors):
                if not ok or faces[f] is None:
                    continue
                nu, fv = faces[f]
                top = max(factor.score(s, nu.reshape(factor.shape_u), fv.reshape(factor.shape_v))
                          for s in self.structures[f])
                ok = all(factor.score(s, nu.reshape(factor.shape_u), fv.reshape(factor.shape_v))
                         >= top - 1e-9 * scale for s in res.structures[f])
            if ok:
                return res._engine
            prev = jac
            delta /= 8
        warn("FactorGraphResult: ties in eta_v could not be broken (a solve at "
             "eta_v + delta r was not polished, or did not settle on one piece); jvp/vjp "
             "use the solve's faces, whose eta_v part may not be a derivative")
        return self._engine

    def _direction(self, engine, d, dv):
        """``d + sum_f C~_f^T M_S D N_S^T dv[f]`` on engine's faces: what jvp projects."""
        w = np.array(d, dtype=np.float64)
        for f, e in enumerate(dv):
            if e is not None and self.factors[f].n_v:
                engine.add_eta_v_direction(f, np.ascontiguousarray(e, dtype=np.float64).ravel(),
                                           w)
        return w

    def _project(self, g):
        y, n_cg, res = self._backward_engine().project(g)
        self.backward_info = {"cg_iterations": int(n_cg), "relative_residual": float(res)}
        if res > 1e-10:
            warn(f"FactorGraphResult: the backward conjugate gradient stopped at a "
                 f"relative residual of {res:.3g} after {n_cg} iterations")
        return y

    def value(self, x):
        """The marginals of a VariableArray (``1 - u`` where negated), shaped like it.

        Examples
        --------
        >>> import numpy as np, sparsemap as sm
        >>> fg = sm.FactorGraph()
        >>> x = fg.add_variables(3)
        >>> _ = fg.add(sm.XorFactor(3), x)
        >>> fg.solve({x: [1.0, 0.5, -1.0]}).value(x[:2])
        array([0.75, 0.25])
        """
        return _variables.read(self.u, x)

    def jvp(self, d_eta_u, d_eta_v=None):
        """Jacobian of ``u`` with respect to ``(eta_u, eta_v)`` applied to a direction.

        Parameters
        ----------
        d_eta_u : array_like, shape ``(n_variables,)``
        d_eta_v : list, optional
            One entry per factor (shape ``factor.shape_v``) or None (zeros).

        Returns
        -------
        du : ndarray, shape ``(n_variables,)``

        Notes
        -----
        ``du = Proj_S(d_eta_u + sum_f sigma_f C_f^T J_f^v d_eta_v[f])``, where
        ``Proj_S`` projects onto the directions that keep every factor on its
        final face and ``J_f^v`` is the single-factor Jacobian with respect to
        the additional scores (see :doc:`/lp_sparsemap`). Variables in
        no factor get ``d_eta_u[i] * 1[0 < eta_u[i] < 1]``.
        """
        d = _as_float_array(d_eta_u, "d_eta_u", (self.n_variables,))
        dv = _check_per_factor(self.factors, d_eta_v, "d_eta_v", zeros=False)
        return self._project(self._direction(self._backward_engine(), d, dv))

    def vjp(self, du):
        """Transpose Jacobian product, for backpropagation.

        Parameters
        ----------
        du : array_like, shape ``(n_variables,)``
            Gradient of a downstream loss with respect to ``u``.

        Returns
        -------
        g_eta_u : ndarray, shape ``(n_variables,)``
        g_eta_v : list of ndarray
            Per factor, the gradient with respect to its ``eta_v``
            (shape ``factor.shape_v``; empty for factors without).

        Notes
        -----
        ``g_eta_u = y = Proj_S(du)``, computed exactly by conjugate gradient
        (stopped when ``y``'s distance from ``S`` is ``1e-13 ||du||``; see
        ``backward_info``), and ``g_eta_v[f] = N_S delta_f`` with
        ``delta_f`` the single-factor backward of ``sigma_f C_f y`` at the final
        support (see :doc:`/lp_sparsemap`).
        """
        g = _as_float_array(du, "du", (self.n_variables,))
        y = self._project(g)
        gv = []
        for f, factor in enumerate(self.factors):
            if factor.n_v:
                gv.append(self._backward_engine().eta_v_gradient(f, y).reshape(factor.shape_v))
            else:
                gv.append(np.zeros(factor.shape_v))
        return y, gv


# -- known polytopes solved whole ----------------------------------------------------------
# A graph that is exactly one factor's polytope (same variables, same constraints, hence
# the same QP) is solved as that factor by sparsemap.solve, which picks the cheaper side
# (a matching's facet solver, a chain's Viterbi active set) and certifies its answer by a
# duality gap: 50 to 500 times faster than ADMM and its polish on those graphs. Recognised
# once per graph structure (_Structure.whole); _WholeResult maps u, v, the support and
# the Jacobian products back. This half of the module (FactorGraph and its results) is
# the layer of sparsemap.solve, whose import is therefore local.

class _Whole:
    """How a graph is one factor: ``factor``; ``parts`` (factor.n_u,): the graph variable
    of each of its unary parts (-1 where the factor ignores the part; every graph variable
    appears once); ``kind``: "itself" (one factor on distinct variables), "matching"
    (Xor rows and AtMostOne or Xor columns covering a block once), "chain" (Pair factors
    along a path of variables: a SequenceBudgetFactor whose budget never binds, the
    pair scores its "both on" transitions); ``links``: for a chain, per Pair factor its
    position i (transition i -> i + 1)."""

    def __init__(self, factor, parts, kind, links=None):
        self.factor, self.parts, self.kind, self.links = factor, parts, kind, links
        self.tied = parts >= 0
        self.at = np.maximum(parts, 0)

    def scores(self, eu, ev):
        """The factor's (eta_u, eta_v) from the graph's."""
        eta_u = np.where(self.tied, eu[self.at], 0.0).reshape(self.factor.shape_u)
        if self.kind == "itself":
            return eta_u, (ev[0].reshape(self.factor.shape_v) if self.factor.n_v else None)
        if self.kind == "chain":
            eta_v = np.zeros(self.factor.shape_v)
            eta_v[self.links, 1, 1] = [float(e[0]) for e in ev]
            return eta_u, eta_v
        return eta_u, None

    def to_graph(self, x, n_variables):
        """A vector over the factor's parts, as one over the graph's variables."""
        out = np.zeros(n_variables)
        out[self.parts[self.tied]] = np.asarray(x).reshape(-1)[self.tied]
        return out

    def eta_v_list(self, gv, factors):
        """The factor's eta_v-shaped array as the graph's per-factor list."""
        if self.kind == "itself":
            return [np.asarray(gv).reshape(factors[0].shape_v)] if factors[0].n_v else \
                [np.zeros(factors[0].shape_v)]
        if self.kind == "chain":
            return [np.array([gv[i, 1, 1]]) for i in self.links]
        return [np.zeros(f.shape_v) for f in factors]


def _recognise(st):
    """The graph's _Whole, or None. Only plain parts (no negation), every variable in use."""
    F, V = st.F, st.V
    if F == 0 or any(np.any(n) for n in st.negated):
        return None
    var = st.var[:st.L]
    tied = var >= 0
    uses = np.bincount(var[tied], minlength=V)
    factors = st.factors
    if F == 1:
        v = np.asarray(st.variables[0]).reshape(-1).astype(np.intp)
        if (uses == 1).all() and v[v >= 0].size == V:
            return _Whole(factors[0], v, "itself")
        return None
    if all(type(f) is PairFactor for f in factors) and F == V - 1 and (uses <= 2).all():
        return _chain(st, uses)
    if all(type(f) in (XorFactor, AtMostOneFactor) for f in factors) and (uses == 2).all():
        return _matching(st)
    return None


def _chain(st, uses):
    """Pair factors along a path through every variable: SequenceBudgetFactor(V, V)."""
    V = st.V
    pairs = [tuple(int(x) for x in np.asarray(v).reshape(-1)) for v in st.variables]
    if any(a == b for a, b in pairs) or (uses == 0).any():
        return None
    nbr = {}
    for f, (a, b) in enumerate(pairs):
        nbr.setdefault(a, []).append((b, f))
        nbr.setdefault(b, []).append((a, f))
    ends = [i for i in range(V) if len(nbr[i]) == 1]
    if len(ends) != 2:
        return None
    order, links, prev, cur = [ends[0]], np.zeros(st.F, dtype=np.intp), -1, ends[0]
    while len(order) < V:
        nxt = [(b, f) for b, f in nbr[cur] if b != prev]
        if len(nxt) != 1:
            return None
        b, f = nxt[0]
        links[f] = len(order) - 1
        prev, cur = cur, b
        order.append(b)
    if len(set(order)) != V:
        return None
    return _Whole(SequenceBudgetFactor(V, V), np.asarray(order, dtype=np.intp), "chain", links)


def _matching(st):
    """Xor rows over AtMostOne (or Xor) columns, each variable in one row and one column,
    every row meeting every column once: MatchingFactor(rows, columns)."""
    F = st.F
    fac_vars = [np.asarray(v).reshape(-1) for v in st.variables]
    by_var = {}
    for f, v in enumerate(fac_vars):
        if np.unique(v).size != v.size or (v < 0).any():
            return None
        for i in v.tolist():
            by_var.setdefault(i, []).append(f)
    side = np.full(F, -1)
    side[0] = 0
    stack = [0]
    while stack:
        f = stack.pop()
        for i in fac_vars[f].tolist():
            for g in by_var[i]:
                if g == f:
                    continue
                if side[g] < 0:
                    side[g] = 1 - side[f]
                    stack.append(g)
                elif side[g] == side[f]:
                    return None
    if (side < 0).any():
        return None
    A, B = np.flatnonzero(side == 0), np.flatnonzero(side == 1)
    kinds = [{type(st.factors[f]) for f in X} for X in (A, B)]
    if len(kinds[0]) != 1 or len(kinds[1]) != 1:
        return None
    xa, xb = XorFactor in kinds[0], XorFactor in kinds[1]
    if not xa and not xb:
        return None
    if xa and xb and A.size != B.size:
        return None
    if not xa:                        # the Xor side is the rows
        A, B = B, A
    if A.size > B.size or st.V != A.size * B.size:
        return None
    if any(fac_vars[f].size != B.size for f in A) or any(fac_vars[f].size != A.size for f in B):
        return None
    col = {int(f): c for c, f in enumerate(B)}
    parts = np.full((A.size, B.size), -1, dtype=np.intp)
    for r, f in enumerate(A):
        for i in fac_vars[f].tolist():
            g = [h for h in by_var[i] if h != f][0]
            if parts[r, col[g]] >= 0:
                return None
            parts[r, col[g]] = i
    if (parts < 0).any():
        return None
    return _Whole(MatchingFactor(int(A.size), int(B.size)), parts.reshape(-1), "matching")


def _matching_blocks(whole, eu, fixed):
    """A matching whose fixed variables (masks, padding) split it into complete blocks:
    [(rows, cols, kind)] with kind "solve" (a MatchingFactor of the block) or "uniform"
    (every score of the block equal: the padding left after its fill is cancelled, whose
    answer is the uniform point, by symmetry). None when the unfixed variables do not
    form complete blocks, or a block has more Xor rows than columns (the graph's path
    then runs and says why)."""
    nr, nc = whole.factor.n_rows, whole.factor.n_cols
    grid = whole.parts.reshape(nr, nc)
    free = ~fixed[grid]
    # complete blocks <=> rows with the same free columns, and those sets disjoint
    if not free.any(axis=1).all():
        return None                 # a Xor row with nothing free
    groups = {}
    packed = np.packbits(free, axis=1)
    for r in range(nr):
        groups.setdefault(packed[r].tobytes(), []).append(r)
    first = [g[0] for g in groups.values()]
    if free[first].sum(axis=0).max(initial=0) > 1:
        return None                 # blocks that overlap
    blocks = []
    for g in groups.values():
        rows, cols = np.asarray(g), np.flatnonzero(free[g[0]])
        if rows.size > cols.size:
            return None
        vals = eu[grid[np.ix_(rows, cols)]]
        blocks.append((rows, cols, "uniform" if (vals == vals.flat[0]).all() else "solve"))
    return blocks


class _Blocks:
    """A matching solved block by block (see _matching_blocks): the same interface as a
    single factor's result (u, v, jvp, vjp, n_iter, gap, converged), on the whole
    matching's (n_rows, n_cols) grid. A uniform block of r rows and c columns is 1 / c
    everywhere; its Jacobian keeps the row sums, and the column sums when r == c (then
    the rows fill the columns: they sum to one whatever the scores)."""

    def __init__(self, whole, blocks, results, eta_u):
        self.whole, self.blocks, self.results = whole, blocks, results
        nr, nc = whole.factor.n_rows, whole.factor.n_cols
        self.u = np.zeros((nr, nc))
        for (rows, cols, kind), r in zip(blocks, results):
            self.u[np.ix_(rows, cols)] = r.u if kind == "solve" else 1.0 / cols.size
        self.v = np.zeros(0)
        self.n_iter = sum(int(r.n_iter) for r in results if r is not None)
        self.n_map = sum(int(getattr(r, "n_map", 0) or 0) for r in results if r is not None)
        self.gap = max([float(r.gap) for r in results if r is not None] + [0.0])
        self.converged = all(r.converged for r in results if r is not None)

    def jvp(self, d, dv=None):
        d = np.asarray(d).reshape(self.u.shape)
        out = np.zeros(self.u.shape)
        for (rows, cols, kind), r in zip(self.blocks, self.results):
            x = d[np.ix_(rows, cols)]
            if kind == "solve":
                out[np.ix_(rows, cols)] = r.jvp(x)
                continue
            y = x - x.mean(axis=1, keepdims=True)
            if rows.size == cols.size:
                y -= y.mean(axis=0, keepdims=True)
            out[np.ix_(rows, cols)] = y
        return out

    def vjp(self, g):
        return self.jvp(g), np.zeros(0)      # a projector: symmetric


def _solve_whole(graph, whole, eu, ev, fixed=None, soft=None):
    """The graph's result from its single factor's solve, or None when that solve did not
    certify an answer (the graph's own path then runs, and gives its own errors).

    ``fixed``: variables held at 0 (masks, and padding: -inf in the factor's scores);
    ``soft``: those of them held for a huge negative score, which must be 0 at the
    solution of the scores as given too (as _masks_hold checks on the graph's path): no
    structure may beat the support at the given scores minus u, one MAP call."""
    import warnings
    from sparsemap._solve import solve
    eu_given = eu
    if fixed is not None and fixed.any():
        eu = np.where(fixed, -np.inf, eu)
    eta_u, eta_v = whole.scores(eu, ev)
    blocks = None
    if whole.kind == "matching" and np.isneginf(eu).any():
        # masks and padding: the free variables' blocks, each an unmasked matching (a
        # mask that makes a column full by counting is not a constraint the matching's
        # own solver sees), or uniform (padding)
        blocks = _matching_blocks(whole, eu, np.isneginf(eu))
        if blocks is None:
            return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # the graph's iteration budget bounds the factor's solver too
            if blocks is None:
                r = solve(whole.factor, eta_u, eta_v, max_iter=DEFAULT_MAX_ITER)
            else:
                r = _Blocks(whole, blocks, [
                    solve(MatchingFactor(rows.size, cols.size), eta_u[np.ix_(rows, cols)],
                          max_iter=DEFAULT_MAX_ITER) if kind == "solve" else None
                    for rows, cols, kind in blocks], eta_u)
    except ValueError:
        return None
    if not r.converged:
        return None
    if soft is not None and soft.any():
        f = whole.factor
        adj = eta_u - r.u
        top = f.score(f.map(adj, eta_v), adj, eta_v)
        given = whole.scores(np.where(soft, eu_given, eu), ev)[0] - r.u
        best = f.score(f.map(given, eta_v), given, eta_v)
        scale = max(1.0, float(np.abs(adj[np.isfinite(adj)]).max(initial=0.0)))
        if not best <= top + 1e-9 * scale:
            return None
    return _WholeResult(graph, whole, r, eu, ev)


class _WholeResult(FactorGraphResult):
    """A FactorGraphResult from the single factor the graph is (see _Whole)."""

    def __init__(self, graph, whole, single, eta_u, eta_v):
        self._whole, self._single = whole, single
        self._engine = None
        self.factors = tuple(graph.factors)
        self.n_variables = graph.n_variables
        u = whole.to_graph(single.u, graph.n_variables)
        np.clip(u, 0.0, 1.0, out=u)
        self.u = u
        self.converged = True
        self.polished = True
        self.n_iter = int(single.n_iter)
        self.primal_residual = 0.0
        self.dual_residual = 0.0
        self.rho = float("nan")
        self.n_map = int(getattr(single, "n_map", 0) or 0)
        self.n_inner_unconverged = 0
        self.message = (f"converged: solved as {whole.factor!r} (the graph is exactly its "
                        f"polytope), certified by its duality gap {float(single.gap):.2g}")
        self._status = CONVERGED
        self._parts = None
        self.backward_info = None
        self._graph, self._eta, self._solve_args, self._bengine = graph, (eta_u, eta_v), None, None

    @property
    def scale(self):
        eta_u, eta_v = self._eta
        return max([1.0, float(np.abs(eta_u[np.isfinite(eta_u)]).max(initial=0.0))]
                   + [float(np.abs(e).max(initial=0.0)) for e in eta_v])

    def _read_parts(self):
        if self._parts is None:
            w, r = self._whole, self._single
            if w.kind == "itself":
                f = self.factors[0]
                self._parts = ([np.asarray(r.v).reshape(f.shape_v)], [list(r.structures)],
                               [np.asarray(r.weights)])
            else:
                self._parts = self._logic_parts()
        return self._parts

    def _logic_parts(self):
        """Per Xor / AtMostOne / Pair factor, its distribution: unique given its marginals
        (their polytopes are simplices)."""
        v, S, W = [], [], []
        for f, factor in enumerate(self.factors):
            x = self.u[np.asarray(self._graph.variables[f]).reshape(-1)]
            if type(factor) is PairFactor:
                both = float(np.asarray(self._single.v)[self._whole.links[f], 1, 1])
                cand = [((1, 1), both), ((1, 0), x[0] - both), ((0, 1), x[1] - both),
                        ((0, 0), 1.0 - x[0] - x[1] + both)]
                v.append(np.array([both]))
                S.append([np.array(s, dtype=np.intc) for s, p in cand if p > 0])
                W.append(np.array([p for s, p in cand if p > 0]))
                continue
            on = np.flatnonzero(x > 0)
            structs = [np.eye(x.size, dtype=np.intc)[j] for j in on]
            weights = list(x[on])
            rest = 1.0 - float(x.sum())
            if type(factor) is AtMostOneFactor and rest > 0:
                structs.append(np.zeros(x.size, dtype=np.intc))
                weights.append(rest)
            v.append(np.zeros(factor.shape_v))
            S.append(structs)
            W.append(np.array(weights) / sum(weights))
        return v, S, W

    def _backward_engine(self):
        """What the backward pass uses: the single factor's result (which completes its
        face and unties ties in eta_v itself), not an engine of the graph."""
        return self._single

    def jvp(self, d_eta_u, d_eta_v=None):
        d = _as_float_array(d_eta_u, "d_eta_u", (self.n_variables,))
        dv = _check_per_factor(self.factors, d_eta_v, "d_eta_v", zeros=True)
        du, dvs = self._whole.scores(d, dv)
        self.backward_info = {"cg_iterations": 0, "relative_residual": 0.0}
        return self._whole.to_graph(self._single.jvp(du, dvs), self.n_variables)

    def vjp(self, du):
        g = _as_float_array(du, "du", (self.n_variables,))
        gu, _ = self._whole.scores(g, [np.zeros(f.n_v) for f in self.factors])
        out_u, out_v = self._single.vjp(gu)
        self.backward_info = {"cg_iterations": 0, "relative_residual": 0.0}
        gv = self._whole.eta_v_list(out_v, self.factors) if out_v is not None and \
            np.size(out_v) else [np.zeros(f.shape_v) for f in self.factors]
        return self._whole.to_graph(out_u, self.n_variables), gv
