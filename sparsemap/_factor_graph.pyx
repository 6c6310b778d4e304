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
from libc.string cimport memset

from sparsemap._active_set cimport _Workspace, _dot, _run
from sparsemap._active_set import STATUS_CONVERGED, tie_direction
from sparsemap._backward import FACE_STATUS_FIBERED, reduce_support
from sparsemap import _variables
from sparsemap._exceptions import warn
from sparsemap._factors._base cimport Factor
from sparsemap._factors._base import (_as_float_array, _typed_array, check_bool,
                                     check_positive_int, check_real)

DEFAULT_MAX_ITER = 10_000
# Untying ties in eta_v (FactorGraphResult._untie): the first delta, relative to the
# scores' scale (small: the check that the piece is the one adjacent to eta is weaker
# than a single factor's), and the most solves.
UNTIE_DELTA = 1e-6
UNTIE_TRIES = 6
DEFAULT_TOL = 1e-10
DEFAULT_RHO = 2.0

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

# Polishing: first tried once the primal residual is below POLISH_START and no
# support changed in the last iteration; after a failed attempt, once it is ten
# times smaller. A polished point is accepted when its KKT conditions hold up
# to KKT_TOL (relative to the scale of the scores and multipliers). Its two CG
# solves take at most POLISH_MAX_CG iterations each (on the graphs measured in
# benchmarks/bench_factor_graph.py a successful attempt took at most 115): on
# wrong supports the affine set may be empty, and CG would not converge.
cdef double POLISH_START = 1e-4
cdef double KKT_TOL = 1e-11
cdef Py_ssize_t POLISH_MAX_CG = 1000
# Polished weights up to this are round-off zeros.
cdef double ZERO_WEIGHT = 1e-12

cdef enum:
    RUNNING = 0
    CONVERGED = 1
    MAX_ITER = 2

cdef int INNER_CONVERGED = STATUS_CONVERGED    # the active set's own code


cdef inline double _amax(const double* a, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    cdef double m = 0
    for i in range(n):
        if fabs(a[i]) > m:
            m = fabs(a[i])
    return m


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
    cdef Py_ssize_t V, F, L, LV
    cdef list factors, workspaces
    cdef object _arrays          # the NumPy arrays behind the pointers below
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
    cdef double* eta             # V
    cdef double* u               # V
    cdef double* uprev           # V
    cdef int* deg                # V
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
    cdef public Py_ssize_t n_iter, n_inner_fail
    cdef bint try_polish
    cdef public int status
    cdef public bint polished

    def __cinit__(self, list factors, list variables, list negated, Py_ssize_t n_variables,
                  eta_u, list eta_v, double rho, bint polish):
        cdef Py_ssize_t f, F = len(factors)
        cdef Factor fac
        self.V = n_variables
        self.F = F
        self.factors = factors
        uoff = np.zeros(F + 1, dtype=np.intp)
        voff = np.zeros(F + 1, dtype=np.intp)
        for f in range(F):
            fac = factors[f]
            uoff[f + 1] = uoff[f] + fac.n_u
            voff[f + 1] = voff[f] + fac.n_v
        self.L = uoff[F]
        self.LV = voff[F]
        max_nu = max([(<Factor> x).n_u for x in factors] + [1])
        max_nv = max([(<Factor> x).n_v for x in factors] + [1])
        # every array gets one spare entry, so that none is empty
        var = np.concatenate([np.asarray(v, dtype=np.intc).reshape(-1) for v in variables]
                             + [np.full(1, -1, np.intc)]).astype(np.intc)
        neg = np.concatenate([np.asarray(v, dtype=bool).reshape(-1) for v in negated]
                             + [np.zeros(1, bool)])
        deg = np.bincount(var[var >= 0], minlength=n_variables).astype(np.intc)
        ev = np.concatenate([np.asarray(e, dtype=np.float64).reshape(-1) for e in eta_v]
                            + [np.zeros(1)])
        eta = np.array(eta_u, dtype=np.float64)
        L1, V1 = self.L + 1, n_variables + 1
        a = dict(uoff=uoff, voff=voff, var=var, deg=deg, ev=ev, eta=eta,
                 sig=np.where(neg, -1.0, 1.0), sh=np.where(neg, 1.0, 0.0), evs=ev / rho,
                 u=np.clip(eta, 0.0, 1.0),   # degree-0 variables keep this value
                 uprev=np.zeros(V1), zu=np.zeros(max_nu), zv=np.zeros(max_nv),
                 wsp=np.zeros(F + 1, dtype=np.intp))
        for k in ("scores", "lam", "yh", "cz", "cr", "cp", "cq", "ctmp", "ct", "cg", "cmu"):
            a[k] = np.zeros(L1)
        for k in ("cw", "ca", "cu", "ck", "ckr", "ckp", "ckq"):
            a[k] = np.zeros(V1)
        self._arrays = a
        self.uoff = <Py_ssize_t*> _ptr(a["uoff"])
        self.voff = <Py_ssize_t*> _ptr(a["voff"])
        self.var = <int*> _ptr(a["var"])
        self.deg = <int*> _ptr(a["deg"])
        self.wsp = <PyObject**> _ptr(a["wsp"])
        self.sig, self.sh, self.ev, self.evs = _d(a, "sig"), _d(a, "sh"), _d(a, "ev"), _d(a, "evs")
        self.eta, self.u, self.uprev = _d(a, "eta"), _d(a, "u"), _d(a, "uprev")
        self.scores, self.lam, self.yh = _d(a, "scores"), _d(a, "lam"), _d(a, "yh")
        self.zu, self.zv = _d(a, "zu"), _d(a, "zv")
        self.cz, self.cr, self.cp, self.cq = _d(a, "cz"), _d(a, "cr"), _d(a, "cp"), _d(a, "cq")
        self.ctmp, self.ct, self.cg, self.cmu = _d(a, "ctmp"), _d(a, "ct"), _d(a, "cg"), _d(a, "cmu")
        self.cw, self.ca, self.cu = _d(a, "cw"), _d(a, "ca"), _d(a, "cu")
        self.ck, self.ckr, self.ckp, self.ckq = _d(a, "ck"), _d(a, "ckr"), _d(a, "ckp"), _d(a, "ckq")
        self.rho = rho
        self.workspaces = [_Workspace(fac, 16) for fac in factors]
        for f in range(F):
            self.wsp[f] = <PyObject*> self.workspaces[f]
        self.n_iter = 0
        self.n_inner_fail = 0
        self.polished = False
        self.try_polish = polish
        self.status = RUNNING

    # -- forward: ADMM (docs/lp_sparsemap.rst, "The ADMM iteration") --------------------------
    cdef void _set_scores(self, Py_ssize_t f) noexcept nogil:
        """The factor's eta_u for the current u and lam: l_f(u + lam / rho)."""
        cdef Py_ssize_t j
        cdef int i
        cdef double inv = 1.0 / self.rho
        for j in range(self.uoff[f], self.uoff[f + 1]):
            i = self.var[j]
            if i >= 0:
                self.scores[j] = self.sh[j] + self.sig[j] * (self.u[i] + inv * self.lam[j])
            else:
                self.scores[j] = 0.0

    def _start(self):
        """Initial supports: the MAP structure of each factor at the first scores."""
        cdef Py_ssize_t f
        cdef _Workspace ws
        cdef Factor fac
        for f in range(self.F):
            ws = self.workspaces[f]
            fac = ws.f
            self._set_scores(f)
            ws._rescore(self.scores + self.uoff[f], self.evs + self.voff[f] if fac.n_v else NULL)
            fac.c_map(ws.eta_u, ws.eta_v, ws.snew, ws.work)
            ws.n_map += 1
            ws._start(ws.snew, 1, NULL)

    cdef int _factor_step(self, _Workspace ws, Py_ssize_t f) except -1 nogil:
        """Warm-started SparseMAP of factor f at the current scores; its values into yh."""
        cdef Py_ssize_t j, a = self.uoff[f], n_it
        cdef double gap, obj
        self._set_scores(f)
        ws._rescore(self.scores + a, self.evs + self.voff[f] if ws.n_v else NULL)
        if _run(ws, INNER_MAX_ITER, INNER_TOL, NULL, &n_it, &gap, &obj) != INNER_CONVERGED:
            self.n_inner_fail += 1
        # _run leaves ws.u = M_f p_f (its last gap was computed at the returned weights)
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
        cdef Py_ssize_t it, f, j, i
        cdef double rho = self.rho, rp, rd, r, yr, polish_at = POLISH_START
        cdef int v
        cdef unsigned long long h, h_prev = 0
        for it in range(max_iter):
            for f in range(self.F):
                self._factor_step(<_Workspace> self.wsp[f], f)
            # u step, with over-relaxed values alpha y + (1 - alpha) u_prev
            for i in range(self.V):
                if self.deg[i] > 0:
                    self.uprev[i] = self.u[i]
                    self.u[i] = self.eta[i]
            for j in range(self.L):
                v = self.var[j]
                if v >= 0:
                    yr = ALPHA * self.yh[j] + (1.0 - ALPHA) * self.uprev[v]
                    self.u[v] += rho * yr - self.lam[j]
            rd = 0.0
            for i in range(self.V):
                if self.deg[i] > 0:
                    self.u[i] /= 1.0 + rho * self.deg[i]
                    r = fabs(self.u[i] - self.uprev[i])
                    if r > rd:
                        rd = r
            rd *= rho
            # dual step
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
            # polishing: once the supports look settled, solve (P) on them and certify
            h = self._support_hash()
            if self.try_polish and rp <= polish_at and h == h_prev:
                if self._polish():
                    self.status = CONVERGED
                    return 0
                polish_at = rp / 10
            h_prev = h
            if rp <= tol and rd <= tol:
                self.status = CONVERGED
                return 0
        self.status = MAX_ITER
        return 0

    def run(self, Py_ssize_t max_iter, double tol):
        self._start()
        with nogil:
            self._admm(max_iter, tol)
            if (self.try_polish and not self.polished and self.F > 0
                    and self.res_primal <= POLISH_START):
                # a last attempt at the returned supports (not counted as an iteration)
                if self._polish():
                    self.status = CONVERGED

    # -- polishing: (P) on the current faces, and its KKT certificate --------------------------
    def _try_polish(self):
        """Polish now, whatever the residuals (tests: the certificate must reject wrong faces)."""
        with nogil:
            ok = self._polish()
        return ok

    cdef bint _polish(self) except -1 nogil:
        """Solve (P) restricted to the current supports; keep it if its KKT conditions hold.

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
        """
        cdef Py_ssize_t f, j, i
        cdef double res
        for i in range(self.V):
            self.cw[i] = self.eta[i]
        for f in range(self.F):
            self._polish_prepare(<_Workspace> self.wsp[f], f)
        for j in range(self.L):
            if self.var[j] >= 0:
                self.cw[self.var[j]] += self.sig[j] * self.cg[j]
        self._project(self.cw, self.ct, self.cu, self.cz, self.cr, self.cp, self.cq, self.ctmp,
                      self.ca, NULL, POLISH_MAX_CG, &res)
        if res > 1e3 * CG_RTOL:
            return False
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
            self.cmu[j] = -(self.cg[j] + self.cmu[j]) if self.var[j] >= 0 else 0.0
        for f in range(self.F):
            if not self._polish_check(<_Workspace> self.wsp[f], f):
                return False
        # accepted: the weights (kept in each ws.x1 by the check), and the polished u
        for f in range(self.F):
            self._polish_accept(<_Workspace> self.wsp[f])
        for i in range(self.V):
            if self.deg[i] > 0:
                self.u[i] = self.cu[i]
        self.res_primal = self._primal_residual()
        self.res_dual = 0.0
        self.polished = True
        return True

    cdef int _solve_kappa(self) except -1 nogil:
        """ck = kappa with (C~^T R C~) kappa = ckr, by CG from 0 (variables of degree >= 1)."""
        cdef Py_ssize_t i, it = 0, V = self.V
        cdef double rs, rs_new, pq, alpha, target
        for i in range(V):
            self.ck[i] = 0.0
            if self.deg[i] == 0:
                self.ckr[i] = 0.0
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
        """Factor f's KKT conditions at the polished point; its weights are left in ws.x1."""
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
                return 0
            psum += x[t]
        if fabs(psum - 1.0) > 1e-9:
            return 0
        for j in range(a, b):
            if fabs(self.cmu[j]) > scale:
                scale = fabs(self.cmu[j])
        if ws.n_v:
            scale = max(scale, _amax(ev, ws.n_v))
        # every support structure has the same reduced score, and MAP finds none better
        for t in range(n):
            ws.f.c_score(ws.S + t * ws.k, self.cmu + a, ev if ev != NULL else self.zv, &val)
            tau_hi = max(tau_hi, val)
            tau_lo = min(tau_lo, val)
        if tau_hi - tau_lo > KKT_TOL * scale:
            return 0
        ws.f.c_map(self.cmu + a, ev, ws.snew, ws.work)
        ws.n_map += 1
        ws.f.c_score(ws.snew, self.cmu + a, ev if ev != NULL else self.zv, &best)
        return 1 if best - tau_hi <= KKT_TOL * scale else 0

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
        """out = C~ y: per link sigma_j y_i (0 where untied)."""
        cdef Py_ssize_t j
        for j in range(self.L):
            out[j] = self.sig[j] * y[self.var[j]] if self.var[j] >= 0 else 0.0

    cdef void _Ct(self, const double* z, double* out) noexcept nogil:
        """out = C~^T z on the variables of degree >= 1 (others untouched)."""
        cdef Py_ssize_t j, i
        for i in range(self.V):
            if self.deg[i] > 0:
                out[i] = 0.0
        for j in range(self.L):
            if self.var[j] >= 0:
                out[self.var[j]] += self.sig[j] * z[j]

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
        the system is consistent, so CG converges to its minimum-norm solution.
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
        return np.clip(self._arrays["u"], 0.0, 1.0)

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
        uoff, voff = a["uoff"], a["voff"]
        F = self.F
        variables = [a["var"][uoff[f]:uoff[f + 1]] for f in range(F)]
        negated = [a["sig"][uoff[f]:uoff[f + 1]] < 0 for f in range(F)]
        eta_v = [a["ev"][voff[f]:voff[f + 1]] for f in range(F)]
        arrays = {k: v for k, v in a.items() if k != "wsp"}   # wsp: this process's pointers
        scalars = dict(res_primal=self.res_primal, res_dual=self.res_dual, n_iter=self.n_iter,
                       n_inner_fail=self.n_inner_fail, status=self.status,
                       polished=self.polished)
        return (_engine_from_state,
                (self.factors, variables, negated, self.V, a["eta"][:self.V], eta_v, self.rho,
                 self.try_polish, arrays, scalars,
                 [_workspace_state(ws) for ws in self.workspaces]))

    def _restore(self, dict arrays, dict scalars, list workspaces):
        cdef Py_ssize_t f
        cdef Factor fac
        for k, v in arrays.items():
            np.copyto(self._arrays[k], v)
        self.res_primal = scalars["res_primal"]
        self.res_dual = scalars["res_dual"]
        self.n_iter = scalars["n_iter"]
        self.n_inner_fail = scalars["n_inner_fail"]
        self.status = scalars["status"]
        self.polished = scalars["polished"]
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
                if self.deg[i] == 0 and not (0.0 < self.eta[i] < 1.0):
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
                if self.var[j] >= 0:
                    out[self.var[j]] += self.sig[j] * lit[j - a]

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
                lit[j - a] = self.sig[j] * y[self.var[j]] if self.var[j] >= 0 else 0.0
            self._prop1(ws, &lit[0], NULL, NULL, &gv[0], &b[0], &s[0])
        return np.asarray(gv)

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
                np.array(self._arrays["ev"][self.voff[f]:self.voff[f + 1]]))

    # -- LP-MAP decoding (sparsemap._lp_map): the multipliers behind its dual bound ----------------
    def multipliers(self):
        """Per link, in literal space, the multipliers nu of the constraints M_f p_f = l_f(u):
        the certified ones when polished (then sum_j sigma_j nu_j = eta_i - u_i and every
        support structure maximises nu_f . m_s + eta_v[f] . n_s), ADMM's otherwise."""
        a = self._arrays
        if self.polished:
            return np.array(a["cmu"][:self.L])
        return a["sig"][:self.L] * a["lam"][:self.L]


def _engine_from_state(factors, variables, negated, n_variables, eta_u, eta_v, rho, polish,
                       arrays, scalars, workspaces):
    """Unpickle an :class:`_Engine` (see ``_Engine.__reduce__``)."""
    engine = _Engine(list(factors), list(variables), list(negated), n_variables, eta_u,
                     list(eta_v), rho, polish)
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
    if values is None:
        values = [None] * F
    elif isinstance(values, np.ndarray) or not isinstance(values, (list, tuple)):
        raise ValueError(f"{name}: expected a list with one entry per factor ({F}), "
                         f"got {type(values).__name__}")
    elif len(values) != F:
        raise ValueError(f"{name}: expected a list with one entry per factor ({F}), "
                         f"got length {len(values)}")
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

    def solve(self, eta_u, eta_v=None, max_iter=None, tol=DEFAULT_TOL, rho=DEFAULT_RHO,
              polish=True):
        """LP-SparseMAP marginals of the graph's variables.

        Parameters
        ----------
        eta_u : array_like, shape ``(n_variables,)``, or dict
            Unary scores of the variables (each counted once, whatever the
            number of factors the variable is in), or a dict
            ``{VariableArray: scores}`` (see :meth:`scores`).
        eta_v : list, optional
            One entry per added factor, in order: its additional scores
            (shape ``factor.shape_v``), or None (zeros). Must be None for a
            factor without additional scores.
        max_iter : int, optional
            ADMM iteration limit (default 10000).
        tol : float, default 1e-10
            ADMM stops when every factor agrees with ``u`` up to ``tol``
            (primal residual ``max |l_f(u) - M_f p_f|``) and ``u`` moved by at
            most ``tol / rho`` in the last iteration (dual residual), unless a
            polished point was certified before.
        rho : float, default 2.0
            ADMM penalty.
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
            Wrong shapes or lengths, non-finite scores, ``eta_v`` for a factor
            without additional scores, bad ``max_iter``, ``tol``, ``rho`` or
            ``polish``.

        Warns
        -----
        ConvergenceWarning
            When neither a certified polished point nor residuals below ``tol``
            were reached within ``max_iter``; the last iterate is returned with
            ``converged=False``.
        """
        if isinstance(eta_u, dict):
            eta_u = self.scores(eta_u)
        result = self._solve_quiet(eta_u, eta_v, max_iter, tol, rho, polish)
        if not result.converged:
            _warn_not_converged(result, "")
        return result

    def _solve_quiet(self, eta_u, eta_v=None, max_iter=None, tol=DEFAULT_TOL, rho=DEFAULT_RHO,
                     polish=True):
        """:meth:`solve` without its warning: callers that solve in threads (the torch
        layer) warn from their own thread, naming the problem."""
        eu = _as_float_array(eta_u, "eta_u", (self.n_variables,))
        ev = _check_per_factor(self.factors, eta_v, "eta_v", zeros=True)
        max_iter = DEFAULT_MAX_ITER if max_iter is None else check_positive_int(max_iter, "max_iter")
        tol = check_real(tol, "tol")
        rho = check_real(rho, "rho", positive=True)
        polish = check_bool(polish, "polish")
        engine = _Engine(list(self.factors), list(self.variables), list(self.negated),
                         self.n_variables, eu, ev, rho, polish)
        engine.run(max_iter, tol)
        result = FactorGraphResult(self, engine, eu, ev)
        result._tol = tol
        result._solve_args = (max_iter, tol, rho, polish)
        return result


    # -- LP-MAP decoding (issue 16): the method; the algorithm is in sparsemap/_lp_map.py ------
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

    # -- variables and slices (issue 16): arrays of variables, scores per array ----------------
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



def _warn_not_converged(result, where):
    warn(f"{where}FactorGraph.solve stopped after {result.n_iter} iterations with "
         f"residuals {result.primal_residual:.3g} (primal), "
         f"{result.dual_residual:.3g} (dual) above tol={result._tol:g}; raise "
         f"max_iter or tol.")


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
        reached ``tol``.
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
        ``rho * max_i |u_i - u_i^{prev}|`` over the last ADMM iteration (0 when
        polished: the certificate replaces it).
    objective : float
        ``1/2 ||u||^2 - eta_u . u - sum_f eta_v[f] . v[f]`` (a minimisation,
        as for :func:`solve`).
    rho : float
        The ADMM penalty used.
    n_map : int
        MAP oracle calls, over all factors.
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
        self.v, self.structures, self.weights = [], [], []
        for f, factor in enumerate(self.factors):
            v, S, y = engine.factor_result(f)
            self.v.append(v.reshape(factor.shape_v))
            self.structures.append([factor._to_public(s) for s in S])
            self.weights.append(y)
        self.converged = engine.status == CONVERGED
        self.n_iter = int(engine.n_iter)
        self.primal_residual = float(engine.res_primal)
        self.dual_residual = float(engine.res_dual)
        self.rho = float(engine.rho)
        self.n_map = int(engine.n_map())
        self.n_inner_unconverged = int(engine.n_inner_fail)
        self.polished = bool(engine.polished)
        self.message = _MESSAGES[engine.status]
        self.objective = float(0.5 * self.u @ self.u - eta_u @ self.u
                               - sum(float(e @ v.reshape(-1)) for e, v in zip(eta_v, self.v)))
        self.backward_info = None
        # what untying ties in eta_v needs (_backward_engine)
        self._graph, self._eta, self._solve_args, self._bengine = graph, (eta_u, eta_v), None, None

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
            self._bengine = self._engine
            if self.polished and self._solve_args is not None and self._fibered():
                self._bengine = self._untie()
        return self._bengine

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
                     for e, r, f in zip(ev, rs, self.factors)], max_iter, tol, rho, polish)
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
