"""The factor graph's certificate: the polish, its KKT check, infeasibility.

Once the supports settle, the problem restricted to the faces they span is
solved directly (polishing: a projection onto an affine set, by conjugate
gradient) and accepted only if its KKT conditions hold: then ``u`` is exact up
to round-off. Otherwise ADMM goes on, and stops on its residuals. A graph with no
feasible point is told by a Farkas certificate (one MAP call per factor) long
before ADMM would stall.

``_Certified`` extends the ADMM engine (``sparsemap._fg_admm``) with those two
hooks of its loop, and with the affine projection (the single-factor Jacobians, and
conjugate gradient over them) that the backward pass (``sparsemap._fg_backward``)
uses too. A factor's Jacobian is that of the side its last step ran on: Prop. 1 on
its support (the vertex side), or its facet solver's ``c_apply`` on the piece its
state holds (the facet side). Either is the orthogonal projector onto the directions
of the factor's face, so the polish and the backward pass treat both alike; only the
KKT check differs (a support's weights and reduced scores, or the facet solver's
projection at the polished scores).
"""

import numpy as np

from libc.math cimport fabs, sqrt, INFINITY
from libc.string cimport memcpy, memset

from sparsemap._active_set cimport _dot, _maxabs
from sparsemap._facet cimport FACET_SOLVED
from sparsemap._fg_admm cimport INFEASIBLE, FACET, _FacetSlot


# Conjugate gradient (backward pass and polishing) stops when the constraint
# residual ||R (C y - t)|| is below CG_RTOL times the scale of its input.
cdef double CG_RTOL = 1e-13

# Polishing (tried when sparsemap._fg_admm's loop says so): an attempt runs up to
# POLISH_ROUNDS rounds of an active set over the faces (see _Certified._polish). A
# polished point is accepted when its KKT conditions hold up to KKT_TOL (relative to the
# scale of the scores and multipliers). Its CG solves take at most POLISH_MAX_CG
# iterations each: on wrong supports the affine set may be empty, and CG would not
# converge.
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
# A facet-side factor's polished point is accepted when its solver's projection at the
# polished scores is this close to it (relative to the scale of the scores and
# multipliers): the point is then in the factor's polytope up to that distance, and its
# optimality is certified by MAP as a support's is (KKT_TOL).
cdef double FACET_POINT_TOL = 1e-9
cdef Py_ssize_t FACET_CHECK_BUDGET = 1000


# Infeasibility (_Certified._farkas, run when sparsemap._fg_admm's loop says so): a
# certificate must be negative by FARKAS_TOL of its size (round-off in D is far smaller;
# on the infeasible graphs of the tests D / size is below -0.01).
cdef double FARKAS_TOL = 1e-9


cdef class _Certified(_Admm):
    """The ADMM engine with its certificates: the polish and the infeasibility check."""

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
            if self.side[f] == FACET:
                tau = _point_score((<_FacetSlot> self.fsp[f]).u, (<_FacetSlot> self.fsp[f]).v,
                                   ws.n_u, ws.n_v, &nu[self.uoff[f]], ev)
            else:
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
            elif code == 6:
                # the facet solver's piece at the polished scores is another: take it
                (<_FacetSlot> self.fsp[f])._swap()
                changed = True
            elif code != 1:
                return 0
        if changed:
            return 2
        # accepted: the weights (kept in each ws.x1 by the check), and the polished u
        for f in range(self.F):
            self._polish_accept(<_Workspace> self.wsp[f], f)
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
        cdef double* x = self._point(ws, f)
        for j in range(a, self.uoff[f + 1]):
            self.ct[j] = x[j - a] - self.sh[j] if self.var[j] >= 0 else 0.0
            self.cg[j] = 0.0
        if ws.n_v:
            self._jac(ws, f, NULL, self.ev + self.voff[f], self.cg + a, NULL, NULL, NULL)
        return 0

    cdef int _polish_check(self, _Workspace ws, Py_ssize_t f) except -1 nogil:
        """Factor f's KKT conditions at the polished point: 1 when they hold, else the
        first that fails: 2 a negative weight, 3 weights that do not sum to one, 4 support
        structures of different reduced scores, 5 a better structure (in ws.snew). Its
        weights are left in ws.x1. A facet-side factor: _facet_check."""
        cdef Py_ssize_t j, t, a = self.uoff[f], b = self.uoff[f + 1], n = ws.nI
        cdef double* x = ws.x1
        cdef double* ev = self.ev + self.voff[f] if ws.n_v else NULL
        cdef double scale = 1.0, val, tau_hi = -INFINITY, tau_lo = INFINITY, best, psum = 0.0
        # the literals of the polished u (into ctmp), then p = G_c^{-1} (M_S^T l + c 1)
        for j in range(a, b):
            self.ctmp[j] = self.sh[j] + self.sig[j] * self.cu[self.var[j]] \
                if self.var[j] >= 0 else 0.0
        if self.side[f] == FACET:
            return self._facet_check(<_FacetSlot> self.fsp[f], ws, f)
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

    cdef int _facet_check(self, _FacetSlot s, _Workspace ws, Py_ssize_t f) except -1 nogil:
        """_polish_check for a factor on the facet side: 1 when its solver's projection at
        the polished scores (the literals in ctmp plus the multipliers -mu) is the polished
        point and MAP finds no structure better than the point at the multipliers; 6 when
        the projection is another point (its state and point left in s.st2, s.u2); else 0.
        The projection proves the point is in the polytope, MAP that it is optimal."""
        cdef Py_ssize_t j, a = self.uoff[f], b = self.uoff[f + 1], n_it = 0
        cdef double* ev = self.ev + self.voff[f] if s.n_v else NULL
        cdef double scale = 1.0, diff = 0.0, tau, best
        cdef double res[2]
        for j in range(a, b):
            if not self.lmask[j] and fabs(self.cmu[j]) > scale:
                scale = fabs(self.cmu[j])
            s.th[j - a] = self.ctmp[j] + self.cmu[j]      # -inf on masked links
        if s.n_v:
            scale = max(scale, _maxabs(ev, s.n_v))
        # warm started from the step's piece (near the polished point's, or the same)
        if s.solver.c_solve_warm(s.th, ev, s.u2, s.v2, &s.st2, &s.st, FACET_CHECK_BUDGET,
                                 &n_it, res) != FACET_SOLVED:
            return 0
        for j in range(a, b):
            diff = max(diff, fabs(s.u2[j - a] - self.ctmp[j]))
        if diff > FACET_POINT_TOL * scale:
            return 6
        # the projection's own point (within diff of the polished one) at the multipliers
        tau = _point_score(s.u2, s.v2, s.n_u, s.n_v, self.cmu + a, ev)
        if ws.f.c_map(self.cmu + a, ev, ws.snew, ws.work) != 0:
            return 0
        ws.n_map += 1
        ws.f.c_score(ws.snew, self.cmu + a, ev if ev != NULL else self.zv, &best)
        return 1 if best - tau <= KKT_TOL * scale else 0

    cdef int _polish_accept(self, _Workspace ws, Py_ssize_t f) except -1 nogil:
        """The polished weights; those at round-off level (ADMM approached the face
        through structures whose weight vanishes there) leave the support. A facet-side
        factor keeps its check's projection (point and state: the backward pass's piece)."""
        cdef Py_ssize_t t
        cdef double psum = 0.0
        if self.side[f] == FACET:
            (<_FacetSlot> self.fsp[f])._swap()
            return 0
        for t in range(ws.nI):
            ws.y[t] = ws.x1[t] if ws.x1[t] > ZERO_WEIGHT else 0.0
            psum += ws.y[t]
        for t in range(ws.nI):
            ws.y[t] /= psum
        ws._drop_below(0.0)
        ws._compute_u(ws.y, False)
        return 0

    # -- the single-factor Jacobian at the final support (Prop. 1) or piece (c_apply) -------
    cdef int _jac(self, _Workspace ws, Py_ssize_t f, const double* in_u, const double* in_v,
                  double* out_u, double* out_v, double* buf, double* scratch_u) except -1 nogil:
        """_prop1 for factor f on the side of its last step. buf: at least max(nI, n_u +
        n_v) doubles, or NULL to use the workspace's (or the facet slot's) scratch."""
        if self.side[f] == FACET:
            return _facet_apply(<_FacetSlot> self.fsp[f], in_u if in_u != NULL else self.zu,
                                in_v, out_u, out_v, buf, scratch_u)
        return self._prop1(ws, in_u, in_v, out_u, out_v, buf if buf != NULL else ws.x1,
                           scratch_u)

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
        self._jac(ws, f, x + a, NULL, out + a, NULL, buf, NULL)
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


cdef double _point_score(const double* u, const double* v, Py_ssize_t n_u, Py_ssize_t n_v,
                         const double* nu, const double* ev) noexcept nogil:
    """nu . u + ev . v at a facet-side factor's point (u, v): the reduced score that every
    structure of an optimal distribution attains (parts at 0 skipped: nu is -inf on
    masked ones)."""
    cdef Py_ssize_t j
    cdef double tau = 0.0
    for j in range(n_u):
        if u[j] != 0.0:
            tau += nu[j] * u[j]
    for j in range(n_v):
        if v[j] != 0.0:
            tau += ev[j] * v[j]
    return tau


cdef int _facet_apply(_FacetSlot s, const double* in_u, const double* in_v, double* out_u,
                      double* out_v, double* buf, double* scratch_u) except -1 nogil:
    """_Certified._prop1's products from a facet-side factor's piece: out_u += J_u in_u +
    J_v in_v, or with out_v, out_v += J_v^T in_u (N_S D M_S^T in_u: callers that want
    out_v pass no in_v). J_u is symmetric (a projector). out_u NULL: scratch_u is written
    instead. buf: n_u + n_v doubles, or NULL for the slot's own."""
    cdef double* ju = buf if buf != NULL else s.ju
    cdef double* jv = buf + s.n_u if buf != NULL else s.jv
    cdef Py_ssize_t j
    if out_v != NULL and s.n_v:
        s.solver.c_apply(&s.st, in_u, NULL, ju, jv, True)
        for j in range(s.n_v):
            out_v[j] += jv[j]
    else:
        s.solver.c_apply(&s.st, in_u, in_v if s.n_v else NULL, ju, NULL, False)
    if out_u == NULL:
        memcpy(scratch_u, ju, s.n_u * sizeof(double))
    else:
        for j in range(s.n_u):
            out_u[j] += ju[j]
    return 0
