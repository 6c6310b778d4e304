"""LP-SparseMAP (Niculae and Martins, ICML 2020): SparseMAP over a factor graph.

Binary variables ``u`` in ``[0, 1]^V`` are shared by factors; part ``j`` of
factor ``f`` stands for the literal ``l_fj(u) = u_i`` (or ``1 - u_i`` when
negated). The problem (``LP_SPARSEMAP.md``, section 1) is

    max_{u, p}  eta_u . u - 1/2 ||u||^2 + sum_f eta_v[f] . N_f p_f
    s.t.        M_f p_f = l_f(u),  p_f in the simplex      (every factor f)
                0 <= u_i <= 1                              (variables in no factor)

and is solved by ADMM with splitting B of the spec (section 2.3): every factor
step is a plain, warm-started SparseMAP call on the factor's own active-set
workspace, so any factor works at its native cost. In the variable space (a
link's value ``y^_j = sigma_j (y_j - s_j)``, its multiplier ``lam^_j``):

    factor step  p_f = SparseMAP(eta_u' = l_f(u + lam^/rho), eta_v' = eta_v[f] / rho)
    u step       u_i = (eta_i - sum_j lam^_j + rho sum_j y^_j) / (1 + rho d_i)
    dual step    lam^_j -= rho (y^_j - u_i)

where the sums run over the links ``j`` of variable ``i`` and ``d_i`` is their
number. The loop holds no Python objects and runs without the GIL.

The backward pass is exact (spec, section 3.3): ``du/deta_u`` is the orthogonal
projector onto ``{v : sigma_f C_f v in T_f for all f}``, with ``T_f`` the
directions of factor ``f``'s final face, applied by conjugate gradient over the
per-factor projectors ``P_f`` (each the single-factor SparseMAP Jacobian at the
final support, two triangular solves with the kept Cholesky factor).
"""
import math
import numbers
import warnings

import numpy as np

from cpython.ref cimport PyObject
from libc.math cimport fabs, sqrt
from libc.string cimport memset

from sparsemap._active_set cimport _Workspace, _run
from sparsemap._active_set import STATUS_CONVERGED
from sparsemap._exceptions import ConvergenceWarning
from sparsemap._factors._base cimport Factor
from sparsemap._factors._base import _as_float_array, check_positive_int
from sparsemap._factors._generic import GenericFactor

DEFAULT_MAX_ITER = 10_000
DEFAULT_TOL = 1e-10
DEFAULT_RHO = 1.0

# Each factor step is an exact SparseMAP solve (the active set stops on a
# duality gap of round-off size).
cdef Py_ssize_t INNER_MAX_ITER = 10_000
cdef double INNER_TOL = 1e-12

# The backward conjugate gradient stops when the distance of the result from
# the tangent space, ||R C y||, is below CG_RTOL ||g||.
cdef double CG_RTOL = 1e-13

cdef enum:
    RUNNING = 0
    CONVERGED = 1
    MAX_ITER = 2


cdef inline double _dot(const double* a, const double* b, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t i
    cdef double acc = 0
    for i in range(n):
        acc += a[i] * b[i]
    return acc


cdef class _Scaled(Factor):
    """Rows scaled by d^{-1/2} (splitting A's weighted SparseMAP; measurement only)."""
    cdef Factor inner
    cdef double[::1] dis
    cdef double[::1] s1, s2, s3

    def __init__(self, Factor inner, dis):
        self.inner = inner
        self.dis = np.ascontiguousarray(dis, dtype=np.float64)
        self.s1 = np.zeros(inner.n_u); self.s2 = np.zeros(inner.n_u); self.s3 = np.zeros(inner.n_u)
        self._set_shapes(inner.shape_u, inner.shape_v, inner.struct_size, inner.work_bytes)

    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out, char* work) except -1 nogil:
        cdef Py_ssize_t j
        for j in range(self.n_u):
            self.s3[j] = eta_u[j] * self.dis[j]
        return self.inner.c_map(&self.s3[0], eta_v, out, work)

    cdef int c_score(self, const int* s, const double* eta_u, const double* eta_v, double* out) except -1 nogil:
        cdef Py_ssize_t j
        for j in range(self.n_u):
            self.s3[j] = eta_u[j] * self.dis[j]
        return self.inner.c_score(s, &self.s3[0], eta_v, out)

    cdef int c_overlap(self, const int* s, const int* t, double* out) except -1 nogil:
        cdef Py_ssize_t j
        cdef double acc = 0
        for j in range(self.n_u):
            self.s1[j] = 0; self.s2[j] = 0
        self.inner.c_add(s, 1.0, &self.s1[0], NULL)
        self.inner.c_add(t, 1.0, &self.s2[0], NULL)
        for j in range(self.n_u):
            acc += self.s1[j] * self.s2[j] * self.dis[j] * self.dis[j]
        out[0] = acc
        return 0

    cdef int c_add(self, const int* s, double w, double* u, double* v) except -1 nogil:
        cdef Py_ssize_t j
        for j in range(self.n_u):
            self.s1[j] = 0
        self.inner.c_add(s, w, &self.s1[0], v)
        if u != NULL:
            for j in range(self.n_u):
                u[j] += self.s1[j] * self.dis[j]
        return 0


cdef class _Engine:
    """One solve: the links, the ADMM state and a warm-started workspace per factor.

    A result keeps its engine: the supports and Cholesky factors there are
    what the backward pass needs, and a new solve builds a new engine.
    """
    cdef Py_ssize_t V, F, L, LV, max_nu, max_nv
    cdef list factors, workspaces
    cdef object _arrays          # the NumPy arrays behind the pointers below
    cdef PyObject** wsp          # borrowed: self.workspaces owns them
    cdef Py_ssize_t* uoff        # F + 1 offsets into the link arrays
    cdef Py_ssize_t* voff        # F + 1 offsets into the eta_v arrays
    cdef int* var                # per link: its variable, -1 where the factor ignores the part
    cdef double* sig             # per link: -1 if negated, else 1
    cdef double* sh              # per link: 1 if negated, else 0
    cdef double* scores          # per link: the factor's eta_u (the workspaces point here)
    cdef double* ev              # eta_v of every factor, concatenated
    cdef double* evs             # eta_v / rho (the workspaces point here)
    cdef double* lam             # per link, in the variable space
    cdef double* yh              # per link: the factor's value, in the variable space
    cdef double* eta             # eta_u (V)
    cdef double* u               # V
    cdef double* acc             # V scratch
    cdef int* deg                # V
    cdef double* zu              # zeros, max n_u
    cdef double* zv              # zeros, max n_v
    cdef double* lh
    cdef double* lh0
    cdef double* y0
    cdef double* l0
    cdef double* u0
    cdef public double rho
    cdef public Py_ssize_t n_iter, n_inner_fail
    cdef public double res_primal, res_dual
    cdef public int status
    cdef public double alpha
    cdef public int adapt
    cdef public double mu
    cdef public int splitting
    cdef double* fscale          # A: per factor, d if uniform (plain call) else 0 (wrapper)
    cdef double* dis             # A: per link d^{-1/2} for wrapped factors, else 1

    def __cinit__(self, list factors, list variables, list negated, Py_ssize_t n_variables,
                  eta_u, list eta_v, double rho, int splitting=0):
        cdef Py_ssize_t f, F = len(factors), j
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
        self.max_nu = max([(<Factor> x).n_u for x in factors] + [1])
        self.max_nv = max([(<Factor> x).n_v for x in factors] + [1])
        # every array gets one spare entry, so that none is empty
        var = np.concatenate([np.asarray(v, dtype=np.intc).reshape(-1) for v in variables]
                             + [np.full(1, -1, np.intc)]).astype(np.intc)
        neg = np.concatenate([np.asarray(v, dtype=bool).reshape(-1) for v in negated]
                             + [np.zeros(1, bool)])
        sig = np.where(neg, -1.0, 1.0)
        sh = np.where(neg, 1.0, 0.0)
        deg = np.bincount(var[var >= 0], minlength=n_variables).astype(np.intc)
        ev = np.concatenate([np.asarray(e, dtype=np.float64).reshape(-1) for e in eta_v]
                            + [np.zeros(1)])
        eta = np.array(eta_u, dtype=np.float64)
        u = np.clip(eta, 0.0, 1.0)          # degree-0 variables keep this value
        arrays = dict(uoff=uoff, voff=voff, var=var, sig=sig, sh=sh, deg=deg, ev=ev, eta=eta, u=u,
                      evs=ev / rho, scores=np.zeros(self.L + 1), lam=np.zeros(self.L + 1),
                      yh=np.zeros(self.L + 1), acc=np.zeros(n_variables + 1),
                      zu=np.zeros(self.max_nu), zv=np.zeros(self.max_nv),
                      wsp=np.zeros(F + 1, dtype=np.intp),
                      lh=np.zeros(self.L + 1), lh0=np.zeros(self.L + 1), y0=np.zeros(self.L + 1),
                      l0=np.zeros(self.L + 1), u0=np.zeros(n_variables + 1))
        self._arrays = arrays
        self.uoff = <Py_ssize_t*> _ptr(arrays["uoff"])
        self.voff = <Py_ssize_t*> _ptr(arrays["voff"])
        self.var = <int*> _ptr(arrays["var"])
        self.sig = <double*> _ptr(arrays["sig"])
        self.sh = <double*> _ptr(arrays["sh"])
        self.deg = <int*> _ptr(arrays["deg"])
        self.ev = <double*> _ptr(arrays["ev"])
        self.evs = <double*> _ptr(arrays["evs"])
        self.eta = <double*> _ptr(arrays["eta"])
        self.u = <double*> _ptr(arrays["u"])
        self.scores = <double*> _ptr(arrays["scores"])
        self.lam = <double*> _ptr(arrays["lam"])
        self.yh = <double*> _ptr(arrays["yh"])
        self.acc = <double*> _ptr(arrays["acc"])
        self.zu = <double*> _ptr(arrays["zu"])
        self.zv = <double*> _ptr(arrays["zv"])
        self.wsp = <PyObject**> _ptr(arrays["wsp"])
        self.lh = <double*> _ptr(arrays["lh"])
        self.lh0 = <double*> _ptr(arrays["lh0"])
        self.y0 = <double*> _ptr(arrays["y0"])
        self.l0 = <double*> _ptr(arrays["l0"])
        self.u0 = <double*> _ptr(arrays["u0"])
        self.rho = rho
        self.splitting = splitting
        fscale = np.zeros(F + 1)
        dis = np.ones(self.L + 1)
        wfactors = list(factors)
        if splitting == 1:
            for f in range(F):
                vv = var[uoff[f]:uoff[f + 1]]
                dd = deg[vv[vv >= 0]]
                if dd.size == 0 or np.all(dd == dd[0]):
                    fscale[f] = dd[0] if dd.size else 1.0
                else:
                    dl = np.where(vv >= 0, deg[np.maximum(vv, 0)], 1).astype(float)
                    dis[uoff[f]:uoff[f + 1]] = 1 / np.sqrt(dl)
                    wfactors[f] = _Scaled(factors[f], 1 / np.sqrt(dl))
        arrays["fscale"] = fscale
        arrays["dis"] = dis
        self.fscale = <double*> _ptr(fscale)
        self.dis = <double*> _ptr(dis)
        self.workspaces = [_Workspace(fac, 16) for fac in wfactors]
        for f in range(F):
            self.wsp[f] = <PyObject*> self.workspaces[f]
        self.n_iter = 0
        self.alpha = 1.0
        self.adapt = 0
        self.mu = 10.0
        self.n_inner_fail = 0
        self.status = RUNNING

    # -- forward ------------------------------------------------------------------
    cdef void _set_scores(self, Py_ssize_t f) noexcept nogil:
        """The factor's eta_u for the current u and lam: l_f(u + lam / rho)."""
        cdef Py_ssize_t j
        cdef int i
        cdef double inv = 1.0 / self.rho
        if self.splitting == 1:
            for j in range(self.uoff[f], self.uoff[f + 1]):
                i = self.var[j]
                if i >= 0:
                    self.scores[j] = self.dis[j] * (self.sh[j] + self.sig[j] * (self.eta[i] + self.lam[j] + self.rho * self.u[i]) / (1 + self.rho))
                else:
                    self.scores[j] = 0.0
            for j in range(self.voff[f], self.voff[f + 1]):
                self.evs[j] = self.ev[j] / (1 + self.rho) * (self.fscale[f] if self.fscale[f] > 0 else 1.0)
            return
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
            S0 = np.empty((1, ws.k), dtype=np.intc)
            fac.c_map(ws.eta_u, ws.eta_v, ws.snew, ws.work)
            ws.n_map += 1
            S0[0] = <int[:ws.k]> ws.snew
            ws._start(S0, NULL)

    cdef int _factor_step(self, _Workspace ws, Py_ssize_t f) except -1 nogil:
        cdef Py_ssize_t j, a = self.uoff[f], n_it
        cdef double gap, obj
        cdef int status
        self._set_scores(f)
        ws._rescore(self.scores + a, self.evs + self.voff[f] if ws.n_v else NULL)
        status = _run(ws, INNER_MAX_ITER, INNER_TOL, NULL, &n_it, &gap, &obj)
        if status != CONVERGED:
            self.n_inner_fail += 1
        # _run leaves ws.u = M_f p_f (the last gap was computed at the returned weights)
        for j in range(a, self.uoff[f + 1]):
            if self.var[j] >= 0:
                self.yh[j] = self.sig[j] * (ws.u[j - a] / self.dis[j] - self.sh[j])
            else:
                self.yh[j] = 0.0
        return 0

    cdef int _admm(self, Py_ssize_t max_iter, double tol) except -1 nogil:
        cdef Py_ssize_t it, f, j, i
        cdef double rho, unew, rp, rd, r, al = self.alpha, yr
        cdef int v
        for it in range(max_iter):
            rho = self.rho
            for f in range(self.F):
                self._factor_step(<_Workspace> self.wsp[f], f)
            if self.adapt <= -100:
                for j in range(self.L):
                    v = self.var[j]
                    if v >= 0:
                        self.lh[j] = self.lam[j] - rho * (self.yh[j] - self.u[v])
            # u step
            if self.splitting == 1:
                for i in range(self.V):
                    self.acc[i] = 0
                for j in range(self.L):
                    v = self.var[j]
                    if v >= 0:
                        self.acc[v] += self.yh[j]
                rd = 0.0
                for i in range(self.V):
                    if self.deg[i] > 0:
                        unew = self.acc[i] / self.deg[i]
                        r = fabs(unew - self.u[i])
                        if r > rd:
                            rd = r
                        self.u[i] = unew
                rd *= rho
                rp = 0.0
                for j in range(self.L):
                    v = self.var[j]
                    if v >= 0:
                        r = self.yh[j] - self.u[v]
                        if fabs(r) > rp:
                            rp = fabs(r)
                        self.lam[j] -= rho * r
                self.n_iter = it + 1
                self.res_primal = rp
                self.res_dual = rd
                if rp <= tol and rd <= tol:
                    self.status = CONVERGED
                    return 0
                if self.adapt == 1 and it % 10 == 0:   # lp-sparsemap's rule
                    if rp > 100 * rd and rho < 100:
                        self.rho = 2 * rho
                    elif rd > 10 * rp and rho > 1e-3:
                        self.rho = rho / 2
                continue
            for i in range(self.V):
                self.acc[i] = self.eta[i]
            for j in range(self.L):
                v = self.var[j]
                if v >= 0:
                    yr = al * self.yh[j] + (1 - al) * self.u[v]
                    self.acc[v] += rho * yr - self.lam[j]
            for j in range(self.L):
                v = self.var[j]
                if v >= 0:
                    self.scores[j] = al * self.yh[j] + (1 - al) * self.u[v]   # relaxed, kept for dual
            rd = 0.0
            for i in range(self.V):
                if self.deg[i] > 0:
                    unew = self.acc[i] / (1.0 + rho * self.deg[i])
                    r = fabs(unew - self.u[i])
                    if r > rd:
                        rd = r
                    self.u[i] = unew
            rd *= rho
            # dual step
            rp = 0.0
            for j in range(self.L):
                v = self.var[j]
                if v >= 0:
                    r = self.yh[j] - self.u[v]
                    if fabs(r) > rp:
                        rp = fabs(r)
                    self.lam[j] -= rho * (self.scores[j] - self.u[v])
            self.n_iter = it + 1
            self.res_primal = rp
            self.res_dual = rd
            if rp <= tol and rd <= tol:
                self.status = CONVERGED
                return 0
            if self.adapt > 0 and it % self.adapt == 0:
                if rp > self.mu * rd:
                    self.rho = rho * 2
                elif rd > self.mu * rp:
                    self.rho = rho / 2
            elif self.adapt <= -100:
                self._spectral(it, -self.adapt - 100)
            elif self.adapt < 0 and it % (-self.adapt) == 0 and rp > 0 and rd > 0:
                r = sqrt(rp / rd)
                if r > self.mu or r < 1.0 / self.mu:
                    self.rho = min(max(rho * r, 1e-4), 1e4)
                if self.rho != rho:
                    for j in range(self.LV):
                        self.evs[j] = self.ev[j] / self.rho
        self.status = MAX_ITER
        return 0

    cdef void _spectral(self, Py_ssize_t it, Py_ssize_t Tf) noexcept nogil:
        """AADMM (Xu, Figueiredo, Goldstein 2017): spectral penalty from the last Tf iterations."""
        cdef Py_ssize_t j
        cdef int v
        cdef double dlh, dH, dl, dG, hh = 0, hl = 0, ll = 0, gg = 0, gl = 0, mm = 0
        cdef double aSD, aMG, bSD, bMG, a, b, acor, bcor, rho = self.rho
        if it > 0 and it % Tf == 0:
            for j in range(self.L):
                v = self.var[j]
                if v >= 0:
                    dlh = self.lh[j] - self.lh0[j]
                    dH = self.yh[j] - self.y0[j]
                    dl = self.lam[j] - self.l0[j]
                    dG = -(self.u[v] - self.u0[v])
                    hh += dH * dH; hl += dH * dlh; ll += dlh * dlh
                    gg += dG * dG; gl += dG * dl; mm += dl * dl
            acor = hl / sqrt(hh * ll) if hh > 0 and ll > 0 else 0.0
            bcor = gl / sqrt(gg * mm) if gg > 0 and mm > 0 else 0.0
            a = 0; b = 0
            if acor > 0.2:
                aSD = ll / hl; aMG = hl / hh
                a = aMG if 2 * aMG > aSD else aSD - aMG / 2
            if bcor > 0.2:
                bSD = mm / gl; bMG = gl / gg
                b = bMG if 2 * bMG > bSD else bSD - bMG / 2
            if acor > 0.2 and bcor > 0.2:
                self.rho = sqrt(a * b)
            elif acor > 0.2:
                self.rho = a
            elif bcor > 0.2:
                self.rho = b
            self.rho = min(max(self.rho, 1e-3), 1e3)
            if self.rho != rho:
                for j in range(self.LV):
                    self.evs[j] = self.ev[j] / self.rho
        if it % Tf == 0:
            for j in range(self.L):
                self.lh0[j] = self.lh[j]
                self.y0[j] = self.yh[j]
                self.l0[j] = self.lam[j]
            for j in range(self.V):
                self.u0[j] = self.u[j]

    def run(self, Py_ssize_t max_iter, double tol):
        self._start()
        with nogil:
            self._admm(max_iter, tol)

    # -- results ---------------------------------------------------------------------
    def u_array(self):
        return np.array(self._arrays["u"])

    def factor_result(self, Py_ssize_t f):
        """(v, structures, weights) of factor f."""
        cdef _Workspace ws = self.workspaces[f]
        ws._compute_u(ws.y, True)
        v = np.array(<double[:ws.n_v]> ws.v) if ws.n_v else np.zeros(0)
        S, y, _ = ws._export()
        return v, S, y

    def n_map(self):
        return sum((<_Workspace> ws).n_map for ws in self.workspaces)

    # -- backward --------------------------------------------------------------------
    cdef void _project_factor(self, _Workspace ws, const double* x, double* out,
                              double* buf) noexcept nogil:
        """out = P_f x: the single-factor SparseMAP Jacobian at the final support (literals)."""
        cdef Py_ssize_t t
        for t in range(ws.nI):
            ws.f.c_score(ws.S + t * ws.k, x, self.zv, &buf[t])
        ws._jacobian(buf)
        memset(out, 0, ws.n_u * sizeof(double))
        for t in range(ws.nI):
            ws.f.c_add(ws.S + t * ws.k, buf[t], out, NULL)

    cdef void _R(self, const double* x, double* out, double* buf) noexcept nogil:
        """out = R x = (I - P_f) x, factor by factor, on link vectors (0 off the tied links)."""
        cdef Py_ssize_t f, j, a
        for f in range(self.F):
            a = self.uoff[f]
            self._project_factor(<_Workspace> self.wsp[f], x + a, out + a, buf)
            for j in range(a, self.uoff[f + 1]):
                out[j] = (x[j] - out[j]) if self.var[j] >= 0 else 0.0

    cdef void _C(self, const double* y, double* out) noexcept nogil:
        """out = C~ y: per link sigma_j y_i (0 where untied)."""
        cdef Py_ssize_t j
        for j in range(self.L):
            out[j] = self.sig[j] * y[self.var[j]] if self.var[j] >= 0 else 0.0

    cdef void _Ct(self, const double* z, double* out) noexcept nogil:
        """out = C~^T z (V), over variables of degree >= 1; others untouched."""
        cdef Py_ssize_t j, i
        for i in range(self.V):
            if self.deg[i] > 0:
                out[i] = 0.0
        for j in range(self.L):
            if self.var[j] >= 0:
                out[self.var[j]] += self.sig[j] * z[j]

    cdef Py_ssize_t _project(self, double* y, double* z, double* r, double* p, double* q,
                             double* w, double* a, double* buf, Py_ssize_t max_cg,
                             double* res_out) noexcept nogil:
        """y <- Proj_S y on the variables of degree >= 1, by CG on R C C^T R z = R C y.

        Returns the number of CG iterations; res_out gets ||R C y|| / ||y_in||.
        """
        cdef Py_ssize_t j, i, it = 0, L = self.L, n_restart = 0
        cdef double gnorm, rs, rs_new, alpha, pq = 1.0, target
        cdef bint stalled
        gnorm = 0.0
        for i in range(self.V):
            if self.deg[i] > 0:
                gnorm += y[i] * y[i]
        gnorm = sqrt(gnorm)
        target = CG_RTOL * gnorm
        for j in range(L):
            z[j] = 0.0
        # r = b = R C y
        self._C(y, w)
        self._R(w, r, buf)
        rs = _dot(r, r, L)
        while True:
            for j in range(L):
                p[j] = r[j]
            stalled = False
            while sqrt(rs) > target and it < max_cg:
                # q = H p = R C C^T R p
                self._R(p, w, buf)
                self._Ct(w, a)
                self._C(a, w)
                self._R(w, q, buf)
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
            # the recursive residual drifts: take the true one, R C (y - C^T R z)
            self._R(z, w, buf)
            self._Ct(w, a)
            for i in range(self.V):
                if self.deg[i] > 0:
                    a[i] = y[i] - a[i]
            self._C(a, w)
            self._R(w, r, buf)
            rs = _dot(r, r, L)
            n_restart += 1
            if sqrt(rs) <= target or it >= max_cg or stalled or n_restart > 3:
                for i in range(self.V):
                    if self.deg[i] > 0:
                        y[i] = a[i]
                res_out[0] = sqrt(rs) / gnorm if gnorm > 0 else 0.0
                return it

    def project(self, g):
        """Proj_S g (degree-0 entries: g * 1[0 < eta < 1]) and (CG iterations, residual)."""
        cdef double[::1] y = np.array(g, dtype=np.float64)
        cdef Py_ssize_t L = self.L + 1, n_cg, max_cg = 10 * (self.L + 10)
        cdef double[::1] z = np.zeros(L), r = np.zeros(L), p = np.zeros(L), q = np.zeros(L)
        cdef double[::1] w = np.zeros(L), a = np.zeros(self.V + 1)
        cdef Py_ssize_t i, max_s = 1
        for ws in self.workspaces:
            max_s = max(max_s, (<_Workspace> ws).nI)
        cdef double[::1] buf = np.zeros(max_s)
        cdef double res = 0.0
        with nogil:
            n_cg = self._project(&y[0] if self.V else NULL, &z[0], &r[0], &p[0], &q[0], &w[0],
                                 &a[0], &buf[0], max_cg, &res)
            for i in range(self.V):
                if self.deg[i] == 0:
                    y[i] = y[i] if 0.0 < self.eta[i] < 1.0 else 0.0
        return np.asarray(y), n_cg, res

    def factor_jvp_v(self, Py_ssize_t f, d_eta_v, double[::1] out):
        """out (V) += C~_f^T M_S Q_f N_S^T d_eta_v: factor f's eta_v direction, in u space."""
        cdef _Workspace ws = self.workspaces[f]
        cdef Factor fac = ws.f
        cdef double[::1] dv = np.ascontiguousarray(d_eta_v, dtype=np.float64).reshape(-1)
        cdef double[::1] buf = np.zeros(ws.nI + 1)
        cdef double[::1] su = np.zeros(ws.n_u)
        cdef Py_ssize_t t, j, a = self.uoff[f]
        with nogil:
            for t in range(ws.nI):
                fac.c_score(ws.S + t * ws.k, self.zu, &dv[0], &buf[t])
            ws._jacobian(&buf[0])
            for t in range(ws.nI):
                fac.c_add(ws.S + t * ws.k, buf[t], &su[0], NULL)
            for j in range(a, self.uoff[f + 1]):
                if self.var[j] >= 0:
                    out[self.var[j]] += self.sig[j] * su[j - a]

    def factor_vjp_v(self, Py_ssize_t f, const double[::1] y):
        """N_S Q_f M_S^T C~_f y: the gradient of factor f's eta_v given Proj_S g = y."""
        cdef _Workspace ws = self.workspaces[f]
        cdef Factor fac = ws.f
        cdef double[::1] gv = np.zeros(ws.n_v)
        cdef double[::1] buf = np.zeros(ws.nI + 1)
        cdef double[::1] su = np.zeros(ws.n_u)
        cdef Py_ssize_t t, j, a = self.uoff[f]
        with nogil:
            for j in range(a, self.uoff[f + 1]):
                su[j - a] = self.sig[j] * y[self.var[j]] if self.var[j] >= 0 else 0.0
            for t in range(ws.nI):
                fac.c_score(ws.S + t * ws.k, &su[0], self.zv, &buf[t])
            ws._jacobian(&buf[0])
            su[:] = 0.0
            for t in range(ws.nI):
                fac.c_add(ws.S + t * ws.k, buf[t], &su[0], &gv[0])
        return np.asarray(gv)


cdef void* _ptr(arr):
    """Data pointer of a non-empty C-contiguous NumPy array kept alive by the caller."""
    cdef char[::1] raw = arr.reshape(-1).view(np.int8)
    return <void*> &raw[0]


_MESSAGES = {
    CONVERGED: "converged",
    MAX_ITER: "maximum number of iterations reached",
}


def _check_real(value, name, positive):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}: expected a finite {'positive' if positive else 'non-negative'} "
                         f"float, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name}: expected a finite {'positive' if positive else 'non-negative'} "
                         f"float, got {value!r}")
    return value


_knobs = {}


def _describe(f, factor):
    return f"factor {f} ({factor!r})"


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
    n_variables : int
        Number of binary variables (>= 1).

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
    >>> fg.add(sm.GenericFactor(np.eye(2)), [0, 1])         # exactly one of u0, u1
    0
    >>> fg.add(sm.GenericFactor([[0., 1, 0], [0, 0, 1]]), [1, 2])   # at most one of u1, u2
    1
    >>> r = fg.solve(np.array([0.2, 0.5, 0.9]))
    >>> r.converged, np.round(r.u, 6)
    (True, array([0.533333, 0.466667, 0.533333]))
    """

    def __init__(self, n_variables):
        self.n_variables = check_positive_int(n_variables, "n_variables")
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
        variables : array_like of int, shape ``factor.shape_u``
            The variable each unary part stands for, in ``[0, n_variables)``;
            ``-1`` only where the factor ignores the part (the diagonal and
            column 0 of a :class:`TreeFactor`).
        negated : array_like of bool, shape ``factor.shape_u``, optional
            Where True, the part stands for ``1 - u[i]`` instead of ``u[i]``
            (default: no negation). Only on attached parts, and only where the
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
        shape = factor.shape_u
        try:
            var = np.asarray(variables)
        except Exception as exc:
            raise ValueError(f"variables: expected an int array of shape {shape}: {exc}")
        if var.dtype == object or var.dtype.kind not in "iu":
            raise ValueError(f"variables: expected integers, got dtype {var.dtype}")
        if var.shape != shape:
            raise ValueError(f"variables: expected shape {shape} (factor.shape_u of {factor!r}), "
                             f"got {var.shape}")
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
            try:
                neg = np.asarray(negated)
            except Exception as exc:
                raise ValueError(f"negated: expected a bool array of shape {shape}: {exc}")
            if neg.dtype == object or neg.dtype.kind not in "biu":
                raise ValueError(f"negated: expected booleans, got dtype {neg.dtype}")
            if neg.shape != shape:
                raise ValueError(f"negated: expected shape {shape} (factor.shape_u of {factor!r}), "
                                 f"got {neg.shape}")
            if neg.dtype.kind != "b":
                if np.any((neg != 0) & (neg != 1)):
                    raise ValueError(f"negated: expected booleans (or 0/1), got {neg!r}")
            neg = neg.astype(bool)
            if np.any(neg & (var < 0)):
                raise ValueError("negated: True on a part attached to no variable (-1)")
            if isinstance(factor, GenericFactor) and np.any(neg):
                M = np.asarray(factor.M).reshape(shape + (-1,))
                rows = np.any((M < 0) | (M > 1), axis=-1) & neg
                if np.any(rows):
                    idx = tuple(int(x) for x in np.argwhere(rows)[0])
                    raise ValueError(f"negated: part {idx} of {factor!r} takes values outside "
                                     f"[0, 1], so 1 - u is not its complement; negation needs "
                                     f"parts that are binary-variable literals")
        var.setflags(write=False)
        neg.setflags(write=False)
        self.factors.append(factor)
        self.variables.append(var)
        self.negated.append(neg)
        return len(self.factors) - 1

    def _check_eta_v(self, eta_v, name):
        """A list with one flat float64 array per factor (zeros where None)."""
        F = len(self.factors)
        if eta_v is None:
            return [np.zeros(f.n_v) for f in self.factors]
        if isinstance(eta_v, np.ndarray) or not isinstance(eta_v, (list, tuple)):
            raise ValueError(f"{name}: expected a list with one entry per factor ({F}), "
                             f"got {type(eta_v).__name__}")
        if len(eta_v) != F:
            raise ValueError(f"{name}: expected a list with one entry per factor ({F}), "
                             f"got length {len(eta_v)}")
        out = []
        for f, (factor, e) in enumerate(zip(self.factors, eta_v)):
            if e is None:
                out.append(np.zeros(factor.n_v))
            elif factor.n_v == 0:
                if np.size(e) != 0:
                    raise ValueError(f"{name}[{f}]: {_describe(f, factor)} has no additional "
                                     f"scores; pass None")
                out.append(np.zeros(0))
            else:
                out.append(_as_float_array(e, f"{name}[{f}]", factor.shape_v).reshape(-1))
        return out

    def solve(self, eta_u, eta_v=None, max_iter=None, tol=DEFAULT_TOL, rho=DEFAULT_RHO):
        """LP-SparseMAP marginals of the graph's variables.

        Parameters
        ----------
        eta_u : array_like, shape ``(n_variables,)``
            Unary scores of the variables (each counted once, whatever the
            number of factors the variable is in).
        eta_v : list, optional
            One entry per added factor, in order: its additional scores
            (shape ``factor.shape_v``), or None (zeros). Must be None for a
            factor without additional scores.
        max_iter : int, optional
            ADMM iteration limit (default 10000).
        tol : float, default 1e-10
            Converged when every factor agrees with ``u`` up to ``tol``
            (primal residual ``max |l_f(u) - M_f p_f|``) and ``u`` moved by at
            most ``tol / rho`` in the last iteration (dual residual).
        rho : float, default 1.0
            ADMM penalty.

        Returns
        -------
        FactorGraphResult

        Raises
        ------
        ValueError
            Wrong shapes or lengths, non-finite scores, ``eta_v`` for a factor
            without additional scores, bad ``max_iter``, ``tol`` or ``rho``.

        Warns
        -----
        ConvergenceWarning
            When the residuals are above ``tol`` at ``max_iter``; the last
            iterate is returned with ``converged=False``.
        """
        eu = _as_float_array(eta_u, "eta_u", (self.n_variables,))
        ev = self._check_eta_v(eta_v, "eta_v")
        max_iter = DEFAULT_MAX_ITER if max_iter is None else check_positive_int(max_iter, "max_iter")
        tol = _check_real(tol, "tol", positive=False)
        rho = _check_real(rho, "rho", positive=True)
        engine = _Engine(list(self.factors), list(self.variables), list(self.negated),
                         self.n_variables, eu, ev, rho, _knobs.get("splitting", 0))
        for k, val in _knobs.items():
            if k != "splitting":
                setattr(engine, k, val)
        engine.run(max_iter, tol)
        result = FactorGraphResult(self, engine, eu, ev)
        if not result.converged:
            warnings.warn(f"FactorGraph.solve stopped after {result.n_iter} iterations with "
                          f"residuals {result.primal_residual:.3g} (primal), "
                          f"{result.dual_residual:.3g} (dual) above tol={tol:g}; raise max_iter "
                          f"or tol.", ConvergenceWarning, stacklevel=2)
        return result


class FactorGraphResult:
    """Outcome of :meth:`FactorGraph.solve`.

    Attributes
    ----------
    u : ndarray, shape ``(n_variables,)``
        Marginals of the variables.
    v : list of ndarray
        Per factor, its additional marginals ``N_f p_f`` (shape ``factor.shape_v``).
    structures : list of list
        Per factor, its distribution's support: structures in the factor's
        compact form.
    weights : list of ndarray
        Per factor, their weights (positive, summing to one).
    converged : bool
        Whether both residuals reached ``tol``.
    n_iter : int
        ADMM iterations run.
    primal_residual : float
        ``max_{f, j} |l_fj(u) - (M_f p_f)_j|``: how far the factors' marginals
        are from the variables'.
    dual_residual : float
        ``rho * max_i |u_i - u_i^{prev}|`` over the last iteration.
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
    message : str
    """

    def __init__(self, graph, engine, eta_u, eta_v):
        self._engine = engine
        self._eta_u = eta_u
        self.factors = tuple(graph.factors)
        self.n_variables = graph.n_variables
        self.u = engine.u_array()
        self.v, self.structures, self.weights = [], [], []
        self._S = []
        for f, factor in enumerate(self.factors):
            v, S, y = engine.factor_result(f)
            self.v.append(v.reshape(factor.shape_v))
            self._S.append(S)
            self.structures.append([factor._to_public(s) for s in S])
            self.weights.append(y)
        self.converged = engine.status == CONVERGED
        self.n_iter = int(engine.n_iter)
        self.primal_residual = float(engine.res_primal)
        self.dual_residual = float(engine.res_dual)
        self.rho = float(engine.rho)
        self.n_map = int(engine.n_map())
        self.n_inner_unconverged = int(engine.n_inner_fail)
        self.message = _MESSAGES[engine.status]
        self.objective = float(0.5 * self.u @ self.u - eta_u @ self.u
                               - sum(float(e @ v.reshape(-1)) for e, v in zip(eta_v, self.v)))
        self.backward_info = None

    def __repr__(self):
        return (f"FactorGraphResult(converged={self.converged}, n_iter={self.n_iter}, "
                f"primal_residual={self.primal_residual:.3g}, "
                f"dual_residual={self.dual_residual:.3g}, objective={self.objective:.10g})")

    def _project(self, g):
        y, n_cg, res = self._engine.project(g)
        self.backward_info = {"cg_iterations": int(n_cg), "relative_residual": float(res)}
        return y

    def _check_direction_v(self, d_eta_v):
        out = []
        F = len(self.factors)
        if d_eta_v is None:
            return [None] * F
        if isinstance(d_eta_v, np.ndarray) or not isinstance(d_eta_v, (list, tuple)):
            raise ValueError(f"d_eta_v: expected a list with one entry per factor ({F}), "
                             f"got {type(d_eta_v).__name__}")
        if len(d_eta_v) != F:
            raise ValueError(f"d_eta_v: expected a list with one entry per factor ({F}), "
                             f"got length {len(d_eta_v)}")
        for f, (factor, e) in enumerate(zip(self.factors, d_eta_v)):
            if e is None:
                out.append(None)
            elif factor.n_v == 0:
                if np.size(e) != 0:
                    raise ValueError(f"d_eta_v[{f}]: {_describe(f, factor)} has no additional "
                                     f"scores; pass None")
                out.append(None)
            else:
                out.append(_as_float_array(e, f"d_eta_v[{f}]", factor.shape_v).reshape(-1))
        return out

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
        the additional scores (``LP_SPARSEMAP.md``, section 3.1). Variables in
        no factor get ``d_eta_u[i] * 1[0 < eta_u[i] < 1]``.
        """
        d = _as_float_array(d_eta_u, "d_eta_u", (self.n_variables,))
        dv = self._check_direction_v(d_eta_v)
        w = np.array(d, dtype=np.float64)
        for f, e in enumerate(dv):
            if e is not None:
                self._engine.factor_jvp_v(f, e, w)
        return self._project(w)

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
        support (``LP_SPARSEMAP.md``, section 3.3).
        """
        g = _as_float_array(du, "du", (self.n_variables,))
        y = self._project(g)
        gv = []
        for f, factor in enumerate(self.factors):
            if factor.n_v:
                gv.append(self._engine.factor_vjp_v(f, y).reshape(factor.shape_v))
            else:
                gv.append(np.zeros(factor.shape_v))
        return y, gv
