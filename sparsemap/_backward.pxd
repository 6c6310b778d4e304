# The backward set and the solution record at C level, for the batch runner
# (sparsemap._batch): a solve into a record (_solve_one), Jacobian products with it
# (_jacobian_apply), and the records themselves.
from cpython.ref cimport PyObject

from sparsemap._active_set cimport _Workspace
from sparsemap._facet cimport FacetState
from sparsemap._factors._base cimport Factor


# What a face completion found: a solution's face status (FACE_STATUS_* in Python).
cdef enum:
    FACE_CERTIFIED = 0    # a round of random directions found nothing new
    FACE_BUDGET = 1       # the MAP budget ran out first
    FACE_UNRESOLVED = 2   # near-ties below what double precision separates: stopped
    FACE_FIBERED = 3      # certified, but n is not affine in m on the face: to untie


cdef enum:
    # what _finish prepares for the backward pass
    BACKWARD_LAZY = 0  # the completed face, checked for fibers (FACE_FIBERED: untie later)
    BACKWARD_NOW = 1   # the completed face, a fibered one untied now
    BACKWARD_NONE = 2  # nothing: no derivative will be taken (losses; u and v as ever)


# The scales of a face completion: the maximum adjusted score, the tie tolerance
# and the last perturbation size that stayed in the face.
cdef struct _FaceScale:
    double s_ref, tau, eps


# Face completion after a converged solve (weight-0 rows appended): returns
# FACE_CERTIFIED, FACE_BUDGET or FACE_UNRESOLVED; its scales into fs (or NULL);
# u: the solution's u (NULL: the rows' M y).
cdef int _complete(_Workspace ws, Py_ssize_t budget, double gap, _FaceScale* fs,
                   const double* u=*) except -1 nogil


# Which representation a solution holds (docs/solvers.rst, "Two representations").
cdef enum:
    SIDE_VERTEX = 0   # rows of structures (the active set): S, y, L
    SIDE_FACET = 1    # the tight constraints: facet (a FacetSolver's state); no rows


# Why the facet side did not return a problem it was offered (_Sol.fallback). The
# facet solvers report one status for every decline (FACET_DECLINED), so a decline
# that used the whole iteration budget is told apart by its iteration count only.
cdef enum:
    FALLBACK_NONE = 0       # not offered to the facet side, or solved there
    FALLBACK_DECLINED = 1   # the facet solver declined (FACET_DECLINED) within its budget
    FALLBACK_BUDGET = 2     # it declined having spent its budget (max_iter iterations)
    FALLBACK_GAP = 3        # it solved, but the duality gap at its answer missed tol


cdef struct _Sol:
    # Outcome of one solve: n_support rows S with weights y, in the solver's order,
    # which the backward pass uses as it is; u and v are flat. The first n_pos rows are
    # the support (weights > 0). Rows b0.. are the backward set, with its Cholesky
    # factor L ((n_support - b0)^2, row-major lower triangular). b0 = 0: the support,
    # then weight-0 rows completing it to span the optimal face. b0 = n_pos: the
    # backward set is another solve's (_untie), its rows weight 0 here. A solution of
    # a solver that keeps no factor (CG) has no L. One malloc'ed block, buf, holds
    # them all (NULL: nothing solved).
    void* buf
    int* S
    double* y
    double* L
    double* u
    double* v
    Py_ssize_t n_support, n_pos, b0, n_iter, n_map
    int status
    int face            # FACE_CERTIFIED, FACE_BUDGET, FACE_UNRESOLVED or FACE_FIBERED
    double gap, objective
    double seconds       # spent in the solve without the GIL (benchmarks)
    bint has_cholesky
    # The facet side (side == SIDE_FACET): u and v are in buf as above, with no rows;
    # the backward pass is solver.c_apply on facet. solver is a FacetSolver, borrowed:
    # the record's owner keeps it alive (_Solution.facet_solver, _Solutions.keep).
    int side
    FacetState facet
    PyObject* solver
    # Why a problem offered to the facet side went to the vertex side (FALLBACK_*), with
    # the facet solver's iterations and, for FALLBACK_GAP, the gap its answer had.
    int fallback
    Py_ssize_t fallback_iter
    double fallback_gap


# The records' owners: one solve's (NumPy copies on request) and a padded batch's
# (one record per problem, no Python object per problem).
cdef class _Solution:
    cdef public Factor factor
    cdef _Sol s
    cdef public object history
    cdef public object facet_solver   # what s.solver points to (the facet side), or None


cdef class _Solutions:
    cdef _Sol* items
    cdef PyObject** factors      # per problem (borrowed from self.keep)
    cdef Py_ssize_t n
    cdef object keep
    cdef public list solvers     # the FacetSolvers its records' solver fields borrow


# Free a record's buffers (its block and any facet state); the struct stays zeroed.
cdef void _sol_free(_Sol* sol) noexcept nogil


# One solve into sol: on the facet side when facet (a FacetSolver, or NULL) solves
# and certifies it, else by the active set, its backward set prepared as backward
# says (BACKWARD_*); status INFEASIBLE when every structure is forbidden.
cdef int _solve_one(_Workspace ws, _Sol* sol, const double* eta_u, const double* eta_v,
                    const int* init, Py_ssize_t n_init, double* hist, Py_ssize_t max_iter,
                    double tol, int backward, PyObject* facet) except -1 nogil


# The Jacobian of a solution applied to a vector (Prop. 1, or the facet side's
# projection): jvp (transpose False; in_v may be NULL) or vjp (transpose True; out_v
# may be NULL); x is scratch for 2 * (rows of the backward set) doubles.
cdef int _jacobian_apply(const _Sol* sol, Factor f, const double* in_u, const double* in_v,
                         double* out_u, double* out_v, double* x,
                         bint transpose) except -1 nogil
