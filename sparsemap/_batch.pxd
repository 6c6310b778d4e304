# The batch runner at C level: what one problem of a batch is, and the runner's
# state (its methods in _batch.pyx). Nothing cimports it yet; it is the runner's
# layout at a glance, as _active_set.pxd is the workspace's.
from cpython.pythread cimport PyThread_type_lock
from cpython.ref cimport PyObject

from sparsemap._active_set cimport _Workspace
from sparsemap._backward cimport _Sol
from sparsemap._factors._base cimport Factor


cdef enum:
    MAX_DIMS = 8     # dims of a padded array beyond the batch axis


cdef struct _Problem:
    _Sol* sol                # the outcome solved, or differentiated
    PyObject* factor         # its factor (borrowed: the batch keeps it alive)
    # In a padded batch, in_u, out_u (and in_v, out_v where padded) are the problem's
    # slots of padded arrays, float64 or float32, read and written by _gather / _scatter.
    const double* in_u       # eta_u, or the direction / gradient of a backward product
    const double* in_v       # eta_v or d_eta_v (NULL: none or zeros)
    double* out_u            # backward outputs; padded batches: the solve's u too
    double* out_v
    const int* init          # warm start rows, or NULL
    Py_ssize_t n_init
    double* hist             # history rows, or NULL
    Py_ssize_t slot          # which distinct factor (workspaces are per thread and factor)
    Py_ssize_t index         # the problem's index in the batch
    const int* target        # a loss batch: the target structure
    double* value            # a loss batch: where the loss goes
    PyObject* facet          # a solve: its factor's FacetSolver (borrowed), or NULL


cdef class _Batch:
    cdef _Problem* P
    cdef Py_ssize_t n, n_threads, n_slots
    cdef int kind
    cdef Py_ssize_t max_iter
    cdef double tol
    cdef int backward            # BACKWARD_NOW or BACKWARD_LAZY for solves (see _finish)
    cdef void* callback          # Python callable called per iteration (borrowed), or NULL;
                                 # the same for every problem, set in each new workspace
    cdef long long claimed       # problems claimed from the front (high 32 bits) and back
    cdef Py_ssize_t n_done, stop
    cdef Py_ssize_t signalled    # whether `finished` was released (once)
    cdef PyThread_type_lock finished   # held until every problem is done, or one failed
    cdef PyObject** ws           # n_threads x n_slots workspaces (NULL until needed)
    cdef double* scratch         # per thread: padded blocks, then 2 * max support doubles
    cdef Py_ssize_t scratch_stride
    cdef list keep               # the objects behind the pointers
    cdef list slot_factors
    cdef object error            # (problem, exception) of the first failure
    cdef public object outputs   # list in problem order (_Solution, du, or (g_u, g_v)),
                                 # a padded solve's _Solutions, or None (padded backward)
    cdef list hists              # return_history buffers, in problem order
    # padded batches
    cdef bint padded             # u data (in and out) are slots of padded arrays
    cdef bint v_in_padded        # in_v too (else flat, zeros or NULL)
    cdef Py_ssize_t isz_in_u, isz_in_v, isz_out_u, isz_out_v   # their itemsizes
    cdef int ndim_u, ndim_v
    cdef Py_ssize_t pad_u[MAX_DIMS]
    cdef Py_ssize_t pad_v[MAX_DIMS]
    cdef Py_ssize_t* shapes      # per slot: its factor's shape_u, then shape_v (MAX_DIMS each)
    cdef Py_ssize_t max_nu, max_nv
    cdef unsigned char* flags    # per problem (claim order): flags of its input blocks
    # loss batches
    cdef double margin           # scale of the Hamming cost added to eta_u
    cdef bint sparse             # SparseMAP (else MAP) at the cost-augmented scores

    cdef int _setup(self, Py_ssize_t n, Py_ssize_t n_threads, int kind) except -1
    cdef Py_ssize_t _slot(self, dict slots, Factor f) except -1
    cdef int _set_pads(self, arr_u, arr_v) except -1
    cdef int _set_shapes(self, names) except -1
    cdef int _misfit(self, Py_ssize_t s, name, which, tuple shape, const Py_ssize_t* pad,
                     int ndim) except -1
    cdef int _alloc_workspaces(self) except -1
    cdef int _alloc_scratch(self, Py_ssize_t per_thread) except -1
    cdef int _new_workspace(self, Py_ssize_t t, Py_ssize_t slot) except -1
    cdef int _work(self, Py_ssize_t t, Py_ssize_t j) except -1 nogil
    cdef int _loss(self, _Workspace ws, _Problem* p, double* eu, const double* ev,
                   double* gu, double* gv) except -1 nogil
    cdef void _signal(self) noexcept nogil
