# The factor graph's ADMM engine (sparsemap/_fg_admm.pyx): its state, shared with the
# certificate and the backward pass, which extend it (_fg_certificate, _fg_backward).

from cpython.ref cimport PyObject

from sparsemap._active_set cimport _Workspace
from sparsemap._facet cimport FacetSolver, FacetState

# Which side a factor's last step ran on (_Admm.side): the factor holds its point by its
# workspace's structures, or by its facet solver's state (a _FacetSlot).
cdef enum:
    VERTEX = 0
    FACET = 1


cdef class _FacetSlot:
    """A factor's facet side in one solve: its solver, the state of its last step (the
    piece whose Jacobian c_apply applies) and that step's point; a second state and
    point for the polish's check at the polished scores."""
    cdef FacetSolver solver
    cdef FacetState st, st2
    cdef Py_ssize_t n_u, n_v
    cdef double* u               # the last step's point (n_u), v (n_v)
    cdef double* v
    cdef double* u2              # the check's point and v
    cdef double* v2
    cdef double* th              # scratch: the check's scores (n_u)
    cdef double* ju              # scratch: c_apply's outputs (n_u, n_v)
    cdef double* jv
    cdef object _block           # the NumPy array behind the pointers above
    cdef unsigned long long hash  # of the state's ints (the piece)
    cdef void _swap(self) noexcept nogil


cdef enum:
    RUNNING = 0
    CONVERGED = 1
    MAX_ITER = 2
    INFEASIBLE = 3     # no point satisfies every factor (a certificate, or a masked factor)


cdef class _Admm:
    cdef readonly Py_ssize_t V, F, L, LV
    cdef readonly list factors, workspaces
    cdef readonly object structure   # the graph's _Structure (shared by its solves)
    cdef readonly object _arrays  # the NumPy arrays behind the pointers below
    cdef PyObject** wsp          # borrowed: self.workspaces owns them
    cdef readonly list slots     # per factor: its _FacetSlot, or None (vertex side only)
    cdef PyObject** fsp          # borrowed from slots (NULL: none)
    cdef char* side              # per factor: VERTEX or FACET, the side of its last step
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

    cdef void _set_scores(self, Py_ssize_t f) noexcept nogil
    cdef bint _start(self) except -1 nogil
    cdef bint _start_factor(self, _Workspace ws, Py_ssize_t f) except -1 nogil
    cdef int _factor_step(self, _Workspace ws, Py_ssize_t f) except -1 nogil
    cdef bint _facet_step(self, _FacetSlot s, Py_ssize_t f) except -1 nogil
    cdef double* _point(self, _Workspace ws, Py_ssize_t f) noexcept nogil
    cdef bint _any_facet(self) noexcept nogil
    cdef unsigned long long _support_hash(self) noexcept nogil
    cdef int _admm(self, Py_ssize_t max_iter, double tol) except -1 nogil
    cdef int _run_nogil(self, Py_ssize_t max_iter, double tol) except -1 nogil
    cdef double _primal_residual(self) noexcept nogil
    cdef double _factor_residual(self, _Workspace ws, Py_ssize_t f) noexcept nogil
    # the certificate's hooks, called by the loop (sparsemap._fg_certificate overrides them)
    cdef bint _farkas(self) except -1 nogil
    cdef bint _polish(self) except -1 nogil


cdef void* _ptr(arr)
cdef double* _d(dict arrays, str key)
