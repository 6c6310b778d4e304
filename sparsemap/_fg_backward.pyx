"""The factor graph's backward pass, C side, and the engine the public API uses.

The backward pass is exact (docs/lp_sparsemap.rst, "The exact backward
pass"): ``du/deta_u`` is the orthogonal projector onto
``{v : sigma_f C_f v in T_f for all f}``, with ``T_f`` the directions of
factor ``f``'s final face, applied by conjugate gradient over the per-factor
projectors ``P_f`` (each the single-factor SparseMAP Jacobian at the
final support, two triangular solves with the kept Cholesky factor).
Before it, each factor's support is completed to its point's smallest face. The
projectors ``P_f`` and the conjugate gradient are ``_Certified``'s
(``sparsemap._fg_certificate``): the polish solves the same affine projection. This
module holds the products with ``eta_v`` and face completion; the conjugate gradient's
caller, with its checks and the untying of ties in ``eta_v``, is
``FactorGraphResult`` (``sparsemap._factor_graph``).

``_Engine`` (ADMM from ``sparsemap._fg_admm``, the certificate from
``sparsemap._fg_certificate``, and the products and face completion here) is
the engine of ``sparsemap._factor_graph``'s results; it pickles with them.
"""

import numpy as np

from libc.math cimport fabs, INFINITY

from sparsemap._active_set cimport _Workspace, _maxabs
from sparsemap._backward cimport _complete, FACE_CERTIFIED
from sparsemap._factors._base cimport Factor
from sparsemap._facet cimport state_resize
from sparsemap._fg_admm cimport FACET, _FacetSlot
from sparsemap._fg_certificate cimport _Certified
from sparsemap._fg_structure import _Structure


# Face completion for the backward pass (_Engine.complete_faces): a part within
# FACE_INTEGRAL of 0 or 1 (the polish leaves round-off) is at its bound, and a linear
# constraint within FACE_INTEGRAL (times its size) of its bound is tight.
cdef double FACE_INTEGRAL = 1e-9


cdef class _Engine(_Certified):
    """One solve of a graph with everything its result needs: ADMM, the certificate,
    the backward pass's products and face completion, and pickling."""

    # -- pickling: a result travels with its engine, which its backward pass needs -----------
    def __reduce__(self):
        """The construction, then every array, counter, workspace support (structures,
        weights, Cholesky factor, ``w2``) and facet-side state, bitwise: ``jvp`` / ``vjp``
        after the trip are those before it, with no new solve."""
        a = self._arrays
        st = self.structure
        # wsp, fsp: this process's pointers; the structure's arrays are rebuilt from the graph
        arrays = {k: v for k, v in a.items()
                  if k not in ("wsp", "fsp", "uoff", "voff", "var", "sig", "sh")}
        scalars = dict(res_primal=self.res_primal, res_dual=self.res_dual, n_iter=self.n_iter,
                       n_inner_fail=self.n_inner_fail, status=self.status,
                       polished=self.polished, n_polish=self.n_polish,
                       infeasible_factor=self.infeasible_factor)
        return (_engine_from_state,
                (st.factors, st.variables, st.negated, self.V, a["eta0"][:self.V], a["ev0"],
                 self.rho, self.try_polish, arrays, scalars,
                 [_workspace_state(ws) for ws in self.workspaces],
                 [None if s is None else _slot_state(s) for s in self.slots]))

    def _restore(self, dict arrays, dict scalars, list workspaces, list slots=None):
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
            if slots is not None and slots[f] is not None and self.slots[f] is not None:
                _slot_restore(self.slots[f], slots[f])

    # -- backward --------------------------------------------------------------------------------
    def project(self, g):
        """Proj_S g (degree-0 entries: g * 1[0 < eta < 1]), CG iterations, relative residual."""
        cdef double[::1] w = np.array(g, dtype=np.float64)
        cdef double[::1] y = np.array(g, dtype=np.float64)
        cdef Py_ssize_t L = self.L + 1, n_cg, i, max_s = 1
        cdef double[::1] z = np.zeros(L), r = np.zeros(L), p = np.zeros(L), q = np.zeros(L)
        cdef double[::1] tmp = np.zeros(L), a = np.zeros(self.V + 1)
        for ws in self.workspaces:
            # a facet-side factor's c_apply writes n_u + n_v doubles there
            max_s = max(max_s, (<_Workspace> ws).nI, (<_Workspace> ws).n_u + (<_Workspace> ws).n_v)
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
        cdef double[::1] b = np.empty(max(ws.nI, ws.n_u + ws.n_v, 1))
        cdef double[::1] lit = np.zeros(max(ws.n_u, 1))
        cdef Py_ssize_t j, a = self.uoff[f]
        with nogil:
            self._jac(ws, f, NULL, &dv[0], &lit[0], NULL, &b[0], NULL)
            for j in range(a, self.uoff[f + 1]):
                if self.cvar[j] >= 0:
                    out[self.cvar[j]] += self.sig[j] * lit[j - a]

    def eta_v_gradient(self, Py_ssize_t f, const double[::1] y):
        """N_S D M_S^T C~_f y: the gradient of factor f's eta_v, given Proj_S g = y."""
        cdef _Workspace ws = self.workspaces[f]
        cdef double[::1] b = np.empty(max(ws.nI, ws.n_u + ws.n_v, 1))
        cdef double[::1] s = np.empty(max(ws.n_u, 1))
        cdef double[::1] gv = np.zeros(ws.n_v)
        cdef double[::1] lit = np.zeros(max(ws.n_u, 1))
        cdef Py_ssize_t j, a = self.uoff[f]
        with nogil:
            for j in range(a, self.uoff[f + 1]):
                lit[j - a] = self.sig[j] * y[self.cvar[j]] if self.cvar[j] >= 0 else 0.0
            self._jac(ws, f, &lit[0], NULL, NULL, &gv[0], &b[0], &s[0])
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
        if ws.nI == 0 or nu == 0 or self.side[f] == FACET:
            # a facet-side factor's Jacobian is its solver's, from the constraints tight at
            # its point: its face needs no structures
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

    def factor_face(self, Py_ssize_t f):
        """``(nu_f, eta_v[f])``, flat: factor f's final face is the set of its structures
        that maximise ``nu_f . m_s + eta_v[f] . n_s``, with ``nu`` the certified
        multipliers (polished results only)."""
        return (self.multipliers()[self.uoff[f]:self.uoff[f + 1]],
                np.array(self._arrays["ev0"][self.voff[f]:self.voff[f + 1]]))


def _engine_from_state(factors, variables, negated, n_variables, eta_u, eta_v, rho, polish,
                       arrays, scalars, workspaces, slots=None):
    """Unpickle an :class:`_Engine` (see ``_Engine.__reduce__``)."""
    fixed = arrays["fix"][:n_variables] != 0
    engine = _Engine(_Structure(factors, variables, negated, n_variables), eta_u, eta_v, rho,
                     polish, fixed if fixed.any() else None)
    engine._restore(arrays, scalars, workspaces, slots)
    return engine


cdef tuple _slot_state(_FacetSlot s):
    """A facet slot's point (u, v), its state's ints and doubles, and its piece's hash."""
    u = np.array(<double[:s.n_u]> s.u) if s.n_u else np.zeros(0)
    v = np.array(<double[:s.n_v]> s.v) if s.n_v else np.zeros(0)
    ints = np.array(<int[:s.st.n_ints]> s.st.ints) if s.st.n_ints else np.zeros(0, np.intc)
    reals = np.array(<double[:s.st.n_reals]> s.st.reals) if s.st.n_reals else np.zeros(0)
    return (u, v, ints, reals, s.hash)


cdef int _slot_restore(_FacetSlot s, tuple state) except -1:
    u, v, ints, reals, h = state
    cdef const double[::1] uv = np.ascontiguousarray(u, dtype=np.float64)
    cdef const double[::1] vv = np.ascontiguousarray(v, dtype=np.float64)
    cdef const int[::1] iv = np.ascontiguousarray(ints, dtype=np.intc)
    cdef const double[::1] rv = np.ascontiguousarray(reals, dtype=np.float64)
    cdef Py_ssize_t j
    if uv.shape[0] != s.n_u or vv.shape[0] != s.n_v:
        raise ValueError(f"a facet slot's state holds {uv.shape[0]} and {vv.shape[0]} "
                         f"values, its factor {s.n_u} and {s.n_v}")
    for j in range(s.n_u):
        s.u[j] = uv[j]
    for j in range(s.n_v):
        s.v[j] = vv[j]
    state_resize(&s.st, iv.shape[0], rv.shape[0])
    for j in range(iv.shape[0]):
        s.st.ints[j] = iv[j]
    for j in range(rv.shape[0]):
        s.st.reals[j] = rv[j]
    s.hash = h
    return 0


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
