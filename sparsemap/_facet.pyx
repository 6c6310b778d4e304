"""The facet side's shared interface: a solver per family, its state, Python wrappers.

A :class:`FacetSolver` solves SparseMAP for one factor as a projection onto the
factor's polytope described by constraints, and applies the Jacobian of ``u`` from
the constraints tight at the solution (the active rows on the positive
coordinates). The families (non-projective trees, sequences, matchings) subclass it
in modules of their own and implement ``c_solve`` and ``c_apply`` at C level,
without the GIL; the Python methods here wrap them for tests and for the solvers'
layer.

Result types. :meth:`FacetSolver.solve` returns a :class:`FacetSolution` (``u``,
``v``, status, iterations and the backward state), for tests and direct use. The
solvers' layer does not: it calls ``c_solve`` into the solution record of
:mod:`sparsemap._backward` (``_Sol``), so that a facet-side solution and a
vertex-side one travel as one type through batches and the torch layer.
"""
import numpy as np

from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from sparsemap._factors._base cimport Factor


cdef int state_resize(FacetState* st, Py_ssize_t n_ints, Py_ssize_t n_reals) except -1 nogil:
    free(st.ints)
    free(st.reals)
    st.ints = <int*> malloc((n_ints if n_ints > 0 else 1) * sizeof(int))
    st.reals = <double*> malloc((n_reals if n_reals > 0 else 1) * sizeof(double))
    st.n_ints = n_ints
    st.n_reals = n_reals
    if st.ints == NULL or st.reals == NULL:
        state_clear(st)
        with gil:
            raise MemoryError()
    return 0


cdef void state_clear(FacetState* st) noexcept nogil:
    free(st.ints)
    free(st.reals)
    st.ints = NULL
    st.reals = NULL
    st.n_ints = 0
    st.n_reals = 0


cdef int state_copy(FacetState* dst, const FacetState* src) except -1 nogil:
    state_resize(dst, src.n_ints, src.n_reals)
    if src.n_ints:
        memcpy(dst.ints, src.ints, src.n_ints * sizeof(int))
    if src.n_reals:
        memcpy(dst.reals, src.reals, src.n_reals * sizeof(double))
    return 0


cdef int state_check_header(const FacetState* st, Py_ssize_t n_ints) except -1 nogil:
    if st.n_ints < n_ints:
        with gil:
            raise ValueError("the facet state is empty (the solve declined)")
    return 0


cdef int state_check_sizes(const FacetState* st, Py_ssize_t n_ints,
                           Py_ssize_t n_reals) except -1 nogil:
    if st.n_ints != n_ints or st.n_reals != n_reals:
        with gil:
            raise ValueError(f"the facet state holds {st.n_ints} ints and {st.n_reals} "
                             f"doubles, its header's layout {n_ints} and {n_reals}")
    return 0


_SOLVER_CLASSES = None
# The solvers of the factors solved last, by the factor's id (each entry holds its
# factor, so an id is not reused while cached): sm.solve builds a solver per call,
# which cost as much as a small problem's choice of side. Solvers hold no per-solve
# state, and batches already share one across threads.
_RECENT = {}
_RECENT_MAX = 64


def facet_solver(Factor factor, bint decline_peaked=True):
    """The facet-side solver of ``factor``, or None where its family has none.

    The families with a compact constraint description: non-projective
    :class:`~sparsemap.TreeFactor`, :class:`~sparsemap.SequenceFactor` and
    :class:`~sparsemap.MatchingFactor` (exactly these types: a subclass may
    change what MAP means).

    Parameters
    ----------
    factor : Factor
    decline_peaked : bool, default True
        Whether the solver declines at once at peaked scores, where the vertex
        side is the cheaper one (the automatic choice); False solves them too
        (``method="facet"``).
    """
    global _SOLVER_CLASSES
    if _SOLVER_CLASSES is None:
        # the families' modules subclass this one: imported on first use
        from sparsemap._facet_matching import MatchingFacetSolver
        from sparsemap._facet_sequence import SequenceFacetSolver
        from sparsemap._facet_tree import TreeFacetSolver
        from sparsemap._factors._matching import MatchingFactor
        from sparsemap._factors._sequence import SequenceFactor
        from sparsemap._factors._tree import TreeFactor
        _SOLVER_CLASSES = {TreeFactor: TreeFacetSolver, SequenceFactor: SequenceFacetSolver,
                     MatchingFactor: MatchingFacetSolver}
    key = (id(factor), decline_peaked)
    hit = _RECENT.get(key)
    if hit is not None:
        return hit[1]
    cls = _SOLVER_CLASSES.get(type(factor))
    if cls is None or getattr(factor, "projective", False):
        return None
    solver = cls(factor, decline_peaked)
    if len(_RECENT) >= _RECENT_MAX:
        del _RECENT[next(iter(_RECENT))]          # the oldest
    _RECENT[key] = (factor, solver)
    return solver


cdef class FacetSolver:
    """The facet-side solver of one factor (a base class: families subclass it).

    Parameters
    ----------
    factor : Factor
        The factor whose polytope the solver projects onto.
    decline_peaked : bool, default True
        Decline at once at peaked scores, where the vertex side is cheaper
        (each family measures where); False solves them too.
    """

    def __init__(self, Factor factor, decline_peaked=True):
        self.factor = factor
        self.decline_peaked = bool(decline_peaked)

    def __reduce__(self):
        return (type(self), (self.factor, bool(self.decline_peaked)))

    cdef int c_solve(self, const double* eta_u, const double* eta_v, double* u, double* v,
                     FacetState* st, Py_ssize_t budget, Py_ssize_t* n_iter,
                     double* residuals) except -1 nogil:
        with gil:
            raise NotImplementedError(f"{type(self).__name__}.c_solve")

    cdef int c_solve_warm(self, const double* eta_u, const double* eta_v, double* u,
                          double* v, FacetState* st, const FacetState* prev,
                          Py_ssize_t budget, Py_ssize_t* n_iter,
                          double* residuals) except -1 nogil:
        return self.c_solve(eta_u, eta_v, u, v, st, budget, n_iter, residuals)

    cdef int c_apply(self, const FacetState* st, const double* in_u, const double* in_v,
                     double* out_u, double* out_v, bint transpose) except -1 nogil:
        with gil:
            raise NotImplementedError(f"{type(self).__name__}.c_apply")

    def solve(self, eta_u, eta_v=None, Py_ssize_t budget=1000, FacetSolution warm=None):
        """Solve from the facet side (tests and the solvers' layer).

        Parameters
        ----------
        eta_u, eta_v : array_like
            Scores shaped like ``factor.shape_u`` and ``factor.shape_v``
            (``eta_v=None``: zeros). Not validated beyond their size.
        budget : int
            Iteration limit; past it the solver declines.
        warm : FacetSolution, optional
            An earlier solution of this solver to start from (``c_solve_warm``): the
            same point as without it, in fewer iterations where the family can use it.

        Returns
        -------
        FacetSolution
        """
        cdef Factor f = self.factor
        cdef const double[::1] eu = np.ascontiguousarray(eta_u, dtype=np.float64).reshape(-1)
        cdef const double[::1] ev = np.ascontiguousarray(
            np.zeros(f.n_v) if eta_v is None else eta_v, dtype=np.float64).reshape(-1)
        if eu.shape[0] != f.n_u or ev.shape[0] != f.n_v:
            raise ValueError(f"eta_u, eta_v: expected {f.n_u} and {f.n_v} entries, got "
                             f"{eu.shape[0]} and {ev.shape[0]}")
        if warm is not None and warm.solver is not self:
            raise ValueError("warm: expected a solution of this solver")
        cdef FacetSolution sol = FacetSolution.__new__(FacetSolution)
        sol.solver = self
        sol.u = np.zeros(f.n_u)
        sol.v = np.zeros(f.n_v)
        cdef double[::1] uu = sol.u, vv = sol.v
        cdef double res[2]
        cdef Py_ssize_t n_iter = 0
        cdef int status
        cdef FacetState empty
        empty.ints = NULL
        empty.reals = NULL
        empty.n_ints = empty.n_reals = 0
        cdef const FacetState* prev = &warm.st if warm is not None else &empty
        res[0] = res[1] = 0.0
        with nogil:
            status = self.c_solve_warm(&eu[0] if f.n_u else NULL, &ev[0] if f.n_v else NULL,
                                       &uu[0] if f.n_u else NULL, &vv[0] if f.n_v else NULL,
                                       &sol.st, prev,
                                       budget, &n_iter, res)
        sol.status = status
        sol.n_iter = n_iter
        sol.residuals = (res[0], res[1])
        sol.u = sol.u.reshape(f.shape_u)
        sol.v = sol.v.reshape(f.shape_v)
        return sol

    def decompose(self, u, v=None):
        """A convex combination of structures equal to ``(u, v)``.

        Returns
        -------
        structures : ndarray of intc, shape (k, factor.struct_size)
        weights : ndarray of float64, shape (k,)
            Positive, summing to one, with ``sum_s w_s m_s = u`` (and ``n_s``: ``v``).
        """
        raise NotImplementedError(f"{type(self).__name__}.decompose")


cdef class FacetSolution:
    """A facet-side solve's outcome: ``u``, ``v``, its status and its backward state."""

    def __dealloc__(self):
        state_clear(&self.st)

    def jvp(self, d_u, d_v=None):
        """``J [d_u; d_v]``, shaped like ``u``."""
        return _apply(self, d_u, d_v, False)[0]

    def vjp(self, du):
        """``(J_u^T du, J_v^T du)``, shaped like ``eta_u`` and ``eta_v``."""
        return _apply(self, du, None, True)

    def state_arrays(self):
        """Copies of the state's ints and doubles (pickling)."""
        ints = np.empty(self.st.n_ints, dtype=np.intc)
        reals = np.empty(self.st.n_reals)
        cdef int[::1] iv = ints
        cdef double[::1] rv = reals
        if self.st.n_ints:
            memcpy(&iv[0], self.st.ints, self.st.n_ints * sizeof(int))
        if self.st.n_reals:
            memcpy(&rv[0], self.st.reals, self.st.n_reals * sizeof(double))
        return ints, reals

    def set_state(self, ints, reals):
        """Restore the state from :meth:`state_arrays`."""
        cdef const int[::1] iv = np.ascontiguousarray(ints, dtype=np.intc)
        cdef const double[::1] rv = np.ascontiguousarray(reals, dtype=np.float64)
        state_resize(&self.st, iv.shape[0], rv.shape[0])
        if iv.shape[0]:
            memcpy(self.st.ints, &iv[0], iv.shape[0] * sizeof(int))
        if rv.shape[0]:
            memcpy(self.st.reals, &rv[0], rv.shape[0] * sizeof(double))


cdef tuple _apply(FacetSolution sol, a, b, bint transpose):
    cdef FacetSolver solver = sol.solver
    cdef Factor f = solver.factor
    cdef const double[::1] ia = np.ascontiguousarray(a, dtype=np.float64).reshape(-1)
    cdef const double[::1] ib
    if ia.shape[0] != f.n_u:
        raise ValueError(f"expected {f.n_u} entries, got {ia.shape[0]}")
    cdef bint with_b = (b is not None) and f.n_v > 0 and not transpose
    if with_b:
        ib = np.ascontiguousarray(b, dtype=np.float64).reshape(-1)
        if ib.shape[0] != f.n_v:
            raise ValueError(f"expected {f.n_v} entries, got {ib.shape[0]}")
    out_u = np.zeros(f.n_u)
    out_v = np.zeros(f.n_v)
    cdef double[::1] ou = out_u, ov = out_v
    with nogil:
        solver.c_apply(&sol.st, &ia[0] if f.n_u else NULL, &ib[0] if with_b else NULL,
                       &ou[0] if f.n_u else NULL,
                       &ov[0] if (transpose and f.n_v) else NULL, transpose)
    return out_u.reshape(f.shape_u), out_v.reshape(f.shape_v)
