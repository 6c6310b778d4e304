"""The batch runner: many problems solved, or differentiated, by threads without the GIL.

``prepare_solve``, ``prepare_backward`` and ``prepare_loss`` make every Python
object and take every pointer with the GIL, then threads call ``_Batch.run``
and claim problems from an atomic counter without it (in ``_Order``'s order:
largest first with several threads and problems of different sizes, else
input order; the caller may start from the cheap end, ``from_back``). One
problem is one active-set solve with its backward set (``_solve_one``), one
Jacobian product (``_jacobian_apply``) or one loss (``_Batch._loss``); each
outcome stays in C buffers (a ``_Sol``, owned by a ``_Solution``; both from
:mod:`sparsemap._backward`) until a field is asked for. A padded batch (the
PyTorch layer's path) reads every problem from its block of one padded array
and writes into one padded output, the threads copying, converting and
scanning the blocks; its outcomes stay in one C array (``_Solutions``), with no
Python object per problem.
"""
import numpy as np

cimport numpy as cnp
from cpython.pythread cimport (PyThread_allocate_lock, PyThread_free_lock,
                               PyThread_acquire_lock, PyThread_release_lock, WAIT_LOCK)
from cpython.ref cimport PyObject
from libc.math cimport INFINITY
from libc.stdlib cimport calloc, malloc, free, qsort
from libc.string cimport memcpy, memset

from sparsemap._active_set cimport CONVERGED, INFEASIBLE, _Workspace, _now
from sparsemap._backward cimport (BACKWARD_LAZY, BACKWARD_NONE, BACKWARD_NOW, FACE_FIBERED,
                                  SIDE_FACET, _Solution, _Solutions, _jacobian_apply,
                                  _solve_one)
from sparsemap._facet import facet_solver
from sparsemap._factors._base cimport HAS_BAD, HAS_NEGINF, Factor, _scan

cnp.import_array()


cdef extern from *:
    """
    /* The few atomics the batch runner needs, shared by threads without the GIL:
       claiming a problem from either end of the order (front and back counts
       packed in one 64-bit word, updated by compare-and-swap), counting
       finished ones, and a stop flag. */
    #if defined(_MSC_VER)
    #include <intrin.h>
    static CYTHON_INLINE Py_ssize_t sm_fetch_add(Py_ssize_t* p, Py_ssize_t v) {
        return (Py_ssize_t) _InterlockedExchangeAdd64((volatile __int64*) p, (__int64) v);
    }
    static CYTHON_INLINE Py_ssize_t sm_load(Py_ssize_t* p) {
        return (Py_ssize_t) _InterlockedOr64((volatile __int64*) p, 0);
    }
    static CYTHON_INLINE int sm_cas(long long* p, long long* expected, long long desired) {
        long long seen = (long long) _InterlockedCompareExchange64(
            (volatile __int64*) p, (__int64) desired, (__int64) *expected);
        if (seen == *expected) return 1;
        *expected = seen;
        return 0;
    }
    static CYTHON_INLINE long long sm_load64(long long* p) {
        return (long long) _InterlockedOr64((volatile __int64*) p, 0);
    }
    #else
    static CYTHON_INLINE Py_ssize_t sm_fetch_add(Py_ssize_t* p, Py_ssize_t v) {
        return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
    }
    static CYTHON_INLINE Py_ssize_t sm_load(Py_ssize_t* p) {
        return __atomic_load_n(p, __ATOMIC_SEQ_CST);
    }
    static CYTHON_INLINE int sm_cas(long long* p, long long* expected, long long desired) {
        return __atomic_compare_exchange_n(p, expected, desired, 0, __ATOMIC_SEQ_CST,
                                           __ATOMIC_SEQ_CST);
    }
    static CYTHON_INLINE long long sm_load64(long long* p) {
        return __atomic_load_n(p, __ATOMIC_SEQ_CST);
    }
    #endif
    /* Claim the next problem from the front (from_back 0) or the back of 0..n-1;
       -1 when none is left. */
    static CYTHON_INLINE Py_ssize_t sm_claim(long long* packed, Py_ssize_t n, int from_back) {
        long long old = sm_load64(packed), f, b;
        for (;;) {
            f = old >> 32;
            b = old & 0xffffffffLL;
            if (f + b >= (long long) n) return -1;
            if (sm_cas(packed, &old, from_back ? old + 1 : old + (1LL << 32)))
                return (Py_ssize_t) (from_back ? n - 1 - b : f);
        }
    }
    """
    Py_ssize_t sm_claim(long long* packed, Py_ssize_t n, int from_back) nogil
    long long sm_load64(long long* p) nogil
    Py_ssize_t sm_fetch_add(Py_ssize_t* p, Py_ssize_t v) nogil
    Py_ssize_t sm_load(Py_ssize_t* p) nogil



cdef extern from *:
    """
    /* CPU seconds of the calling thread (benchmarks: the time batches spend without the GIL). */
    #if defined(_WIN32)
    #include <windows.h>
    static double sm_thread_cpu(void) {
        FILETIME c, e, k, u;
        ULARGE_INTEGER kk, uu;
        GetThreadTimes(GetCurrentThread(), &c, &e, &k, &u);
        kk.LowPart = k.dwLowDateTime; kk.HighPart = k.dwHighDateTime;
        uu.LowPart = u.dwLowDateTime; uu.HighPart = u.dwHighDateTime;
        return 1e-7 * (double) (kk.QuadPart + uu.QuadPart);
    }
    #else
    #include <time.h>
    static double sm_thread_cpu(void) {
        struct timespec ts;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
        return ts.tv_sec + 1e-9 * ts.tv_nsec;
    }
    #endif
    """
    double sm_thread_cpu() noexcept nogil


# Benchmarks only: when on, batches add the CPU time their threads spend in their
# claim loops without the GIL (in nanoseconds) to _no_gil_ns.
cdef bint _timing = False
cdef Py_ssize_t _no_gil_ns = 0


def no_gil_seconds(on=None):
    """CPU seconds batches have spent on problems without the GIL (benchmarks only).

    Counted only while switched on: ``no_gil_seconds(True)`` switches it on
    (and ``False`` off); every call returns the total so far. Each thread's
    claim loop counts up to its last problem (one clock read per problem),
    except the time it holds the GIL in it (creating a workspace).
    """
    global _timing
    if on is not None:
        _timing = bool(on)
    return sm_load(&_no_gil_ns) * 1e-9


# -- the problems' data -------------------------------------------------------------

cdef inline const double* _data(object arrays, Py_ssize_t i) except NULL:
    """Row i of a 2-d float64 C-contiguous array, or item i of a list of flat arrays."""
    cdef cnp.ndarray a
    if type(arrays) is list:
        a = <cnp.ndarray> arrays[i]
        return <const double*> cnp.PyArray_DATA(a)
    a = <cnp.ndarray> arrays
    return (<const double*> cnp.PyArray_DATA(a)) + i * a.shape[1]


# -- padded batches: each problem's block of one padded array -------------------------
# A padded array is C-contiguous, float64 or float32 (itemsize 8 or 4), shaped
# (n, *pad); problem i's data is the leading block (its factor's shape) of its slot,
# element i. The threads convert to and from float64 as they copy.

cdef void _block_copy(char* padded, Py_ssize_t isz, const Py_ssize_t* pad,
                      const Py_ssize_t* shape, int ndim, double* flat,
                      bint into_padded) noexcept nogil:
    """Copy between the leading block ``shape`` of a padded slot and a flat float64 C-ordered
    array of that block (into the slot if into_padded), row by row."""
    cdef Py_ssize_t idx[MAX_DIMS]
    cdef Py_ssize_t stride[MAX_DIMS]
    cdef Py_ssize_t rows = 1, width = shape[ndim - 1], r, k, off = 0
    cdef int d
    cdef char* q
    cdef double* x
    stride[ndim - 1] = 1
    for d in range(ndim - 2, -1, -1):
        stride[d] = stride[d + 1] * pad[d + 1]
    for d in range(ndim - 1):
        rows *= shape[d]
        idx[d] = 0
    if width == 0:
        return
    for r in range(rows):
        q = padded + off * isz
        x = flat + r * width
        if isz == 8:
            if into_padded:
                memcpy(q, x, width * sizeof(double))
            else:
                memcpy(x, q, width * sizeof(double))
        elif into_padded:
            for k in range(width):
                (<float*> q)[k] = <float> x[k]
        else:
            for k in range(width):
                x[k] = (<const float*> q)[k]
        d = ndim - 2          # the next row: an odometer over the leading dims
        while d >= 0:
            idx[d] += 1
            off += stride[d]
            if idx[d] < shape[d]:
                break
            off -= idx[d] * stride[d]
            idx[d] = 0
            d -= 1


cdef inline Py_ssize_t _prod(const Py_ssize_t* shape, int ndim) noexcept nogil:
    cdef Py_ssize_t n = 1
    cdef int d
    for d in range(ndim):
        n *= shape[d]
    return n


cdef int _gather(const char* slot, Py_ssize_t isz, const Py_ssize_t* pad,
                 const Py_ssize_t* shape, int ndim, double* flat) noexcept nogil:
    """A problem's block of a padded array into flat (float64); its HAS_NEGINF | HAS_BAD flags.

    Only the block is read (the padding may hold anything, NaN included)."""
    _block_copy(<char*> slot, isz, pad, shape, ndim, flat, False)
    return _scan(flat, _prod(shape, ndim))


cdef void _scatter(const double* flat, char* slot, Py_ssize_t isz, const Py_ssize_t* pad,
                   const Py_ssize_t* shape, int ndim) noexcept nogil:
    """flat (NULL: zeros) into the block of a problem's slot, zeros in the rest of the slot."""
    memset(slot, 0, _prod(pad, ndim) * isz)
    if flat != NULL:
        _block_copy(slot, isz, pad, shape, ndim, <double*> flat, True)


cdef bint _fits(tuple shape, const Py_ssize_t* pad, int ndim, Py_ssize_t* out):
    """Whether a block shape fits in a padded shape (then copied to out)."""
    cdef int d
    if len(shape) != ndim:
        return False
    for d in range(ndim):
        out[d] = shape[d]
        if out[d] > pad[d]:
            return False
    return True


cdef Py_ssize_t _check_padded(object arr, str name, Py_ssize_t n, object like=None) except -1:
    """The itemsize of a padded array; a ValueError unless it is one (shaped like ``like``)."""
    if (type(arr) is not np.ndarray or arr.dtype.kind != "f" or arr.itemsize not in (4, 8)
            or not arr.flags.c_contiguous or not 2 <= arr.ndim <= MAX_DIMS + 1
            or arr.shape[0] != n or (like is not None and arr.shape != like.shape)):
        raise ValueError(f"{name}: expected a C-contiguous float32 or float64 array of shape "
                         f"({n}, ...) with 1 to {MAX_DIMS} padded dims"
                         + ("" if like is None else f", shaped {like.shape}")
                         + f", got {arr!r:.60}")
    return arr.itemsize


cdef inline char* _data_pointer(object arr, Py_ssize_t* stride):
    """The data of a padded array (NULL for None) and, in stride, the bytes per slot."""
    if arr is None:
        stride[0] = 0
        return NULL
    stride[0] = (<cnp.ndarray> arr).strides[0]
    return <char*> cnp.PyArray_DATA(<cnp.ndarray> arr)


# What a batch runs
cdef enum:
    SOLVE = 0
    JVP = 1
    VJP = 2
    LOSS = 3

# A loss batch's flags beside HAS_NEGINF and HAS_BAD, and what report() says of them
cdef enum:
    _MAP_INFEASIBLE = 4
    _TARGET_FORBIDDEN = 8
TARGET_FORBIDDEN = -2    # the target uses a part its scores forbid: infinite loss

# A problem of a padded batch whose input block the run refused (nan or +inf in scores; any
# non-finite value in a gradient or direction): not solved, zeros in its outputs.
REFUSED = -1
# A solve that was to untie a fibered face now (BACKWARD_NOW) and could not: converged,
# its backward set the tied face's (see _finish).
UNTIE_FAILED = -3


cdef class _Batch:
    """Problems prepared with the GIL, then run by any number of threads without it.

    Built by :func:`prepare_solve` or :func:`prepare_backward`, which make
    every Python object the run needs (solutions, outputs) and take every
    pointer in one pass. Each thread calls :meth:`run` with its own number;
    threads claim problems one at a time from an atomic counter, in the
    order the prepare function set (largest first where sizes differ and
    several threads run), so they balance problems of unequal cost and touch the GIL only
    to create a workspace the first time they meet a factor. A thread that
    joins late finds nothing left and returns.

    A padded batch reads every problem's input from its block of one padded
    array and writes its outputs into its slot of one padded array (zeros
    outside the block), copying through per-thread buffers without the GIL;
    :meth:`report` then says which problems need a look from Python.
    """

    def __cinit__(self):
        self.P = NULL
        self.ws = NULL
        self.scratch = NULL
        self.finished = NULL
        self.shapes = NULL
        self.flags = NULL
        self.callback = NULL

    def __dealloc__(self):
        free(self.P)
        free(self.ws)
        free(self.scratch)
        free(self.shapes)
        free(self.flags)
        if self.finished != NULL:
            if self.signalled == 0:     # still held: release before freeing, as CPython does
                PyThread_release_lock(self.finished)
            PyThread_free_lock(self.finished)

    cdef int _setup(self, Py_ssize_t n, Py_ssize_t n_threads, int kind) except -1:
        self.n = n
        self.n_threads = n_threads if n_threads > 0 else 1
        self.kind = kind
        self.claimed = 0
        self.n_done = 0
        self.stop = 0
        self.signalled = 0
        self.finished = PyThread_allocate_lock()
        if self.finished == NULL:
            raise MemoryError()
        PyThread_acquire_lock(self.finished, WAIT_LOCK)
        self.P = <_Problem*> calloc(n if n > 0 else 1, sizeof(_Problem))
        if self.P == NULL:
            raise MemoryError()
        self.keep = []
        self.slot_factors = []
        self.error = None
        return 0

    cdef Py_ssize_t _slot(self, dict slots, Factor f) except -1:
        """The slot of factor f (one per distinct factor object), added on first sight."""
        s = slots.get(id(f))
        if s is None:
            s = slots[id(f)] = len(self.slot_factors)
            self.slot_factors.append(f)
        return s

    cdef int _set_pads(self, arr_u, arr_v) except -1:
        """Padded shapes from the arrays (n, *pad_u) and (n, *pad_v) (None: no v), checked."""
        cdef int d
        self.padded = True
        self.ndim_u = arr_u.ndim - 1
        for d in range(self.ndim_u):
            self.pad_u[d] = arr_u.shape[d + 1]
        self.ndim_v = 0 if arr_v is None else arr_v.ndim - 1
        for d in range(self.ndim_v):
            self.pad_v[d] = arr_v.shape[d + 1]
        return 0

    cdef int _set_shapes(self, names) except -1:
        """Each slot's block shapes, checked against the padded shapes (after the slots)."""
        cdef Py_ssize_t s
        cdef Py_ssize_t* sh
        cdef Factor f
        self.shapes = <Py_ssize_t*> calloc(max(self.n_slots, 1) * 2 * MAX_DIMS,
                                           sizeof(Py_ssize_t))
        self.flags = <unsigned char*> calloc(self.n if self.n > 0 else 1, 1)
        if self.shapes == NULL or self.flags == NULL:
            raise MemoryError()
        self.max_nu = self.max_nv = 0
        for s in range(self.n_slots):
            f = self.slot_factors[s]
            sh = self.shapes + s * 2 * MAX_DIMS
            self.max_nu = max(self.max_nu, f.n_u)
            self.max_nv = max(self.max_nv, f.n_v)
            if not _fits(f.shape_u, self.pad_u, self.ndim_u, sh):
                self._misfit(s, names[0], "u", f.shape_u, self.pad_u, self.ndim_u)
            # no padded v, or an empty block: zeros
            if self.ndim_v and f.n_v and not _fits(f.shape_v, self.pad_v, self.ndim_v,
                                                   sh + MAX_DIMS):
                self._misfit(s, names[1], "v", f.shape_v, self.pad_v, self.ndim_v)
        return 0

    cdef int _misfit(self, Py_ssize_t s, name, which, tuple shape, const Py_ssize_t* pad,
                     int ndim) except -1:
        cdef Py_ssize_t i = min(self._problems_of(s))
        raise ValueError(f"{name}[{i}]: the factor's shape_{which} {shape} does not fit in "
                         f"the padded shape {tuple(pad[d] for d in range(ndim))}")

    def _problems_of(self, Py_ssize_t s):
        return [self.P[j].index for j in range(self.n) if self.P[j].slot == s]

    cdef int _alloc_workspaces(self) except -1:
        self.ws = <PyObject**> calloc(self.n_threads * max(len(self.slot_factors), 1),
                                      sizeof(PyObject*))
        if self.ws == NULL:
            raise MemoryError()
        self.n_slots = len(self.slot_factors)
        return 0

    cdef int _alloc_scratch(self, Py_ssize_t per_thread) except -1:
        self.scratch_stride = per_thread if per_thread > 0 else 1
        self.scratch = <double*> malloc(self.n_threads * self.scratch_stride * sizeof(double))
        if self.scratch == NULL:
            raise MemoryError()
        return 0

    cdef int _new_workspace(self, Py_ssize_t t, Py_ssize_t slot) except -1:
        cdef _Workspace ws = _Workspace(self.slot_factors[slot], 16)
        ws.callback = self.callback     # workspaces are per batch
        self.keep.append(ws)
        self.ws[t * self.n_slots + slot] = <PyObject*> ws
        return 0

    cdef int _work(self, Py_ssize_t t, Py_ssize_t j) except -1 nogil:
        """Problem j (claim order) as thread t."""
        cdef _Problem* p = &self.P[j]
        cdef PyObject** ws = self.ws + t * self.n_slots
        cdef double* buf = self.scratch + t * self.scratch_stride if self.scratch != NULL else NULL
        cdef const double* in_u = p.in_u
        cdef const double* in_v = p.in_v
        cdef double* out_u = p.out_u
        cdef double* out_v = p.out_v
        cdef const Py_ssize_t* shape_u = NULL
        cdef const Py_ssize_t* shape_v = NULL
        cdef int flags = 0
        cdef bint ok
        cdef Py_ssize_t n_v = (<Factor> p.factor).n_v
        cdef double t0
        if (self.kind == SOLVE or self.kind == LOSS) and ws[p.slot] == NULL:
            t0 = sm_thread_cpu() if _timing else 0.0
            with gil:
                self._new_workspace(t, p.slot)
            if _timing:     # held the GIL: not counted by run
                sm_fetch_add(&_no_gil_ns, -<Py_ssize_t> (1e9 * (sm_thread_cpu() - t0)))
        if self.padded:
            # the blocks go through this thread's buffers: in_u, in_v, out_u, out_v, then x
            shape_u = self.shapes + p.slot * 2 * MAX_DIMS
            shape_v = shape_u + MAX_DIMS
            flags = _gather(<const char*> p.in_u, self.isz_in_u, self.pad_u, shape_u,
                            self.ndim_u, buf)
            in_u = buf
            if self.v_in_padded and n_v:
                flags |= _gather(<const char*> p.in_v, self.isz_in_v, self.pad_v, shape_v,
                                 self.ndim_v, buf + self.max_nu)
                in_v = buf + self.max_nu
            self.flags[j] = flags
            buf += self.max_nu + self.max_nv
            out_u = buf
            out_v = buf + self.max_nu if (p.out_v != NULL and n_v) else NULL
            buf += self.max_nu + self.max_nv
        if self.kind == LOSS:
            # in_u is this thread's copy of the block: the cost is added there
            if not (flags & HAS_BAD):
                flags |= self._loss(<_Workspace> ws[p.slot], p, <double*> in_u, in_v,
                                    out_u, out_u + self.max_nu)
                self.flags[j] = flags
            ok = flags == 0 or flags == HAS_NEGINF
            _scatter(out_u if ok else NULL, <char*> p.out_u, self.isz_out_u, self.pad_u,
                     shape_u, self.ndim_u)
            if p.out_v != NULL:
                _scatter(out_u + self.max_nu if ok and n_v else NULL, <char*> p.out_v,
                         self.isz_out_v, self.pad_v, shape_v, self.ndim_v)
        elif self.kind == SOLVE:
            if not (flags & HAS_BAD):
                _solve_one(<_Workspace> ws[p.slot], p.sol, in_u, in_v, p.init, p.n_init, p.hist,
                           self.max_iter, self.tol, self.backward, p.facet)
            if self.padded:
                _scatter(p.sol.u if p.sol.buf != NULL else NULL, <char*> p.out_u, self.isz_out_u,
                         self.pad_u, shape_u, self.ndim_u)
        else:
            # a backward product: gradients and directions must be finite (masks are scores)
            if flags == 0:
                _jacobian_apply(p.sol, <Factor> p.factor, in_u, in_v, out_u, out_v, buf,
                                self.kind == VJP)
            if self.padded:
                _scatter(out_u if flags == 0 else NULL, <char*> p.out_u, self.isz_out_u,
                         self.pad_u, shape_u, self.ndim_u)
                if p.out_v != NULL:
                    _scatter(out_v if flags == 0 else NULL, <char*> p.out_v, self.isz_out_v,
                             self.pad_v, shape_v, self.ndim_v)
        return 0

    cdef int _loss(self, _Workspace ws, _Problem* p, double* eu, const double* ev,
                   double* gu, double* gv) except -1 nogil:
        """One loss of a loss batch: ``p.value`` and its gradient ``(gu, gv)`` at the
        scores ``eu`` (a scratch copy, cost-augmented in place) and ``ev``; 0, or the
        flag _MAP_INFEASIBLE or _TARGET_FORBIDDEN (outputs unset).

        As :mod:`sparsemap.losses` computes them for a 0/1 target ``t``: with
        ``eu' = eu + margin (1 - m_t)``, SparseMAP (``sparse``) or MAP at
        ``(eu', ev)`` gives ``(u, v)``; the gradient is ``(u - m_t, v - n_t)``, the
        same elementwise operations as the NumPy losses', and the value is
        :func:`_loss_value`'s, which the NumPy losses call too (:func:`loss_value`):
        one kernel, so the same bits.
        """
        cdef Py_ssize_t n_u = ws.f.n_u, n_v = ws.f.n_v, j
        cdef double[1] score
        cdef const double* u = NULL
        ws.f.c_score(p.target, eu, ev, score)
        if score[0] == -INFINITY:
            return _TARGET_FORBIDDEN
        memset(gu, 0, n_u * sizeof(double))
        if n_v:
            memset(gv, 0, n_v * sizeof(double))
        ws.f.c_add(p.target, 1.0, gu, gv if n_v else NULL)      # (m_t, n_t)
        if self.margin > 0:
            for j in range(n_u):
                eu[j] += self.margin * (1.0 - gu[j])            # -inf stays -inf
        if self.sparse:
            # the loss's gradient is u - m_t: no derivative of u is taken
            _solve_one(ws, p.sol, eu, ev, NULL, 0, NULL, self.max_iter, self.tol, BACKWARD_NONE,
                       p.facet)
            if p.sol.status == INFEASIBLE:
                return _MAP_INFEASIBLE
            u = p.sol.u
            for j in range(n_u):
                gu[j] = u[j] - gu[j]
            for j in range(n_v):
                gv[j] = p.sol.v[j] - gv[j]
        else:
            if ws.f.c_map(eu, ev, ws.snew, ws.work) != 0:
                return _MAP_INFEASIBLE
            for j in range(n_u):
                gu[j] = -gu[j]
            for j in range(n_v):
                gv[j] = -gv[j]
            ws.f.c_add(ws.snew, 1.0, gu, gv if n_v else NULL)   # m_s - m_t, n_s - n_t
        p.value[0] = _loss_value(eu, ev, u, gu, gv, n_u, n_v)
        return 0

    def run(self, Py_ssize_t t, bint from_back=False, double budget=-1.0):
        """Work as thread number t (0 <= t < n_threads) until no problem is left.

        Problems are claimed from the front of the order (the largest first,
        when the order is by size), or from its back with ``from_back``; with ``budget > 0``, return once
        that many seconds have passed (checked between problems).
        """
        cdef Py_ssize_t j = -1
        cdef double t0 = _now(), cpu0 = 0.0, cpu1
        if t < 0 or t >= self.n_threads:
            raise ValueError(f"t: expected a thread number in [0, {self.n_threads}), got {t}")
        try:
            with nogil:
                if _timing:
                    cpu0 = sm_thread_cpu()
                while sm_load(&self.stop) == 0:
                    if budget > 0 and _now() - t0 > budget:
                        break
                    j = sm_claim(&self.claimed, self.n, from_back)
                    if j < 0:
                        break
                    self._work(t, j)
                    if _timing:     # counted before the problem counts as done
                        cpu1 = sm_thread_cpu()
                        sm_fetch_add(&_no_gil_ns, <Py_ssize_t> (1e9 * (cpu1 - cpu0)))
                        cpu0 = cpu1
                    if sm_fetch_add(&self.n_done, 1) == self.n - 1:
                        self._signal()
        except BaseException as exc:
            # stop every thread; the caller raises the first failure (by position)
            if self.error is None or self.error[0] > j:
                self.error = (j, exc)
            sm_fetch_add(&self.stop, 1)
            sm_fetch_add(&self.n_done, 1)
            self._signal()

    cdef void _signal(self) noexcept nogil:
        """Release the caller waiting in wait(), once."""
        if sm_fetch_add(&self.signalled, 1) == 0:
            PyThread_release_lock(self.finished)

    def remaining(self):
        """Problems not claimed yet."""
        cdef long long c = sm_load64(&self.claimed)
        return self.n - (c >> 32) - (c & 0xffffffff)

    def wait(self):
        """Block (without the GIL) until every problem is done or one failed; raise its error."""
        if self.n > 0 and sm_load(&self.n_done) < self.n and sm_load(&self.stop) == 0:
            # Block, not spin: on a virtual machine whose CPUs share a core, a
            # spinning caller starves the thread it waits for.
            with nogil:
                PyThread_acquire_lock(self.finished, WAIT_LOCK)
                PyThread_release_lock(self.finished)
        if self.error is not None:
            j, exc = self.error
            _add_note(exc, self.P[j].index)
            raise exc
        if self.hists is not None:
            for i, sol in enumerate(self.outputs):
                h = self.hists[i]
                # the facet side records one row (it has no iterates of structures)
                k = 1 if (<_Solution> sol).s.side == SIDE_FACET else sol.n_iter
                (<_Solution> sol).history = h[:4 * k].reshape(k, 4).copy()


    def report(self):
        """After :meth:`wait`: the problems to look at, as ``(index, code)`` by index.

        ``code`` is ``REFUSED`` for a problem of a padded batch whose input
        block held a value the run does not accept (nan or +inf in scores; any
        non-finite value in a backward input), else, for solves, the status of
        a problem that did not converge, or ``UNTIE_FAILED``. Usually empty.
        """
        cdef Py_ssize_t j
        cdef int status
        out = []
        for j in range(self.n):
            if self.kind == LOSS:
                if self.flags[j] & HAS_BAD:
                    out.append((self.P[j].index, REFUSED))
                elif self.flags[j] & _TARGET_FORBIDDEN:
                    out.append((self.P[j].index, TARGET_FORBIDDEN))
                elif self.flags[j] & _MAP_INFEASIBLE:
                    out.append((self.P[j].index, INFEASIBLE))
                elif self.sparse and self.P[j].sol.status != CONVERGED:
                    out.append((self.P[j].index, self.P[j].sol.status))
            elif self.flags != NULL and (self.flags[j] & HAS_BAD if self.kind == SOLVE
                                         else self.flags[j]):
                out.append((self.P[j].index, REFUSED))
            elif self.kind == SOLVE:
                status = self.P[j].sol.status
                if status != CONVERGED:
                    out.append((self.P[j].index, status))
                elif self.backward == BACKWARD_NOW and self.P[j].sol.face == FACE_FIBERED:
                    out.append((self.P[j].index, UNTIE_FAILED))
        out.sort()
        return out


cdef struct _Key:
    Py_ssize_t cost
    Py_ssize_t index


cdef int _by_cost(const void* a, const void* b) noexcept nogil:
    """Decreasing cost, then increasing index (a stable order)."""
    cdef const _Key* x = <const _Key*> a
    cdef const _Key* y = <const _Key*> b
    if x.cost != y.cost:
        return -1 if x.cost > y.cost else 1
    return -1 if x.index < y.index else (1 if x.index > y.index else 0)


cdef class _Order:
    """Problems 0..n-1 in the order threads claim them: most expensive first (ties in
    index order), from the costs set in ``keys``."""
    cdef _Key* keys
    cdef Py_ssize_t n

    def __cinit__(self, Py_ssize_t n):
        cdef Py_ssize_t i
        self.n = n
        self.keys = <_Key*> malloc((n if n > 0 else 1) * sizeof(_Key))
        if self.keys == NULL:
            raise MemoryError()
        for i in range(n):
            self.keys[i].cost = 0
            self.keys[i].index = i

    def __dealloc__(self):
        free(self.keys)

    cdef object indices(self, bint sort):
        """An intp array (input order unless sort)."""
        cdef Py_ssize_t j
        out = np.empty(self.n, dtype=np.intp)
        cdef Py_ssize_t[::1] o = out
        if sort and self.n > 1:
            qsort(self.keys, self.n, sizeof(_Key), _by_cost)
        for j in range(self.n):
            o[j] = self.keys[j].index
        return out


def _add_note(exc, Py_ssize_t i):
    if hasattr(exc, "add_note"):   # Python >= 3.11
        exc.add_note(f"(while solving batch element {i})")


def prepare_solve(factors, etas_u, etas_v, inits,
                  Py_ssize_t max_iter, double tol, bint return_history, Py_ssize_t n_threads,
                  callback=None, out_u=None, bint untie=False, side="auto",
                  bint backward=True):
    """A :class:`_Batch` of active-set solves; its ``outputs`` are the ``_Solution`` objects.

    Inputs must be validated: their pointers are read without checks (except
    in a padded batch, whose blocks the threads scan).

    Parameters
    ----------
    factors : Factor or list of Factor
        Shared by every problem, or one per problem.
    etas_u : ndarray or list of ndarray
        A 2-d float64 C-contiguous array (row ``i``: problem ``i``) or a list
        of flat float64 C-contiguous arrays. With ``out_u``: a padded
        C-contiguous float64 or float32 array ``(n, *pad_u)``, problem ``i``
        reading the leading block of shape ``factor.shape_u`` of ``etas_u[i]``.
    etas_v : None, ndarray or list
        As ``etas_u`` (padded with ``out_u``, leading blocks of shape
        ``factor.shape_v``); None (or None entries of a list): zeros.
    inits : None or list
        Warm starts: None entries, or ``(k, struct_size)`` intc arrays.
    max_iter, tol, return_history
        As for :func:`sparsemap.solve`.
    n_threads : int
        How many threads will call :meth:`_Batch.run`. They claim problems by
        decreasing ``n_u + n_v`` (ties, and one thread, in input order).
    callback : callable, optional
        Called with the GIL after every iteration of every problem (see
        :func:`sparsemap.solve`); a problem it stops gets ``STATUS_STOPPED``.
    out_u : ndarray, optional
        Makes the batch padded: a C-contiguous float64 or float32 array
        shaped like ``etas_u``, into which each problem writes its ``u``
        (zeros outside its block). The threads copy each block out in float64,
        scan it (a problem whose block holds nan or +inf is refused, see
        :meth:`_Batch.report`) and solve it: the padding is never read.
    untie : bool
        Untie fibered faces in the solve (the padded layers' backward pass
        has no scores to do it later); else they are left ``FACE_FIBERED``.
    side : {"auto", "vertex", "facet"}
        Where the families with a facet side (``_facet.facet_solver``) are
        solved: "auto" tries the facet side first, which declines at once at
        peaked scores (a problem with a warm start runs on the vertex side);
        "facet" solves there unless it cannot certify; "vertex" runs the active
        set only.
    backward : bool
        False: no backward set (``u`` and ``v`` only, for the losses; the
        outputs' jvp / vjp are then not the Jacobian's).

    Notes
    -----
    A thread keeps one workspace per factor object and reuses it from one
    problem to the next; a solve's arithmetic does not depend on the
    workspace's history (tests check results bitwise against fresh solves).
    A problem whose structures all use a forbidden part gets status
    ``STATUS_INFEASIBLE``.
    """
    cdef _Batch b = _Batch.__new__(_Batch)
    cdef Py_ssize_t n = len(etas_u), j, i, max_nv = 0
    cdef Factor f
    cdef _Solution sol
    cdef _Solutions sols
    cdef _Order by_cost
    cdef const Py_ssize_t[::1] claim
    cdef cnp.ndarray a
    cdef bint shared = isinstance(factors, Factor)
    cdef bint padded = out_u is not None
    cdef const double* zeros = NULL
    cdef char* in_u = NULL
    cdef char* in_v = NULL
    cdef char* o_u = NULL
    cdef Py_ssize_t st_u = 0, st_v = 0, st_o = 0
    cdef _Problem* p
    b._setup(n, n_threads, SOLVE)
    b.max_iter = max_iter
    b.tol = tol
    b.backward = BACKWARD_NONE if not backward else BACKWARD_NOW if untie else BACKWARD_LAZY
    b.callback = NULL if callback is None else <void*> callback
    b.hists = [None] * n if return_history else None
    slots = {}
    if shared:
        b.slot_factors.append(factors)
        max_nv = (<Factor> factors).n_v
    else:
        for f in factors:
            b._slot(slots, f)
            if f.n_v > max_nv:
                max_nv = f.n_v
    # one facet-side solver per distinct factor (None: the vertex side only)
    solvers = [None if side == "vertex" else facet_solver(f, side == "auto")
               for f in b.slot_factors]
    b.keep.append(solvers)
    if max_nv and (etas_v is None or type(etas_v) is list):
        zero_buf = np.zeros(max_nv)
        b.keep.append(zero_buf)
        zeros = <const double*> cnp.PyArray_DATA(<cnp.ndarray> zero_buf)
    if padded:
        b.isz_in_u = _check_padded(etas_u, "etas_u", n)
        b.isz_out_u = _check_padded(out_u, "out_u", n, etas_u)
        b.v_in_padded = etas_v is not None
        if b.v_in_padded:
            b.isz_in_v = _check_padded(etas_v, "etas_v", n)
        b._set_pads(etas_u, etas_v)
        in_u = _data_pointer(etas_u, &st_u)
        in_v = _data_pointer(etas_v, &st_v)
        o_u = _data_pointer(out_u, &st_o)
        sols = _Solutions(factors, n)
        sols.solvers = [fs for fs in solvers if fs is not None]
        b.outputs = sols
    else:
        b.outputs = [None] * n
    b.keep.extend((etas_u, etas_v, inits, callback, out_u))
    by_cost = _Order(n)
    if n_threads > 1 and not shared:
        for i in range(n):
            f = factors[i]
            by_cost.keys[i].cost = f.n_u + f.n_v
    claim = by_cost.indices(n_threads > 1 and not shared)
    for j in range(n):
        i = claim[j]
        p = &b.P[j]
        p.index = i
        f = factors if shared else factors[i]
        p.factor = <PyObject*> f
        p.slot = 0 if shared else slots[id(f)]
        fs = solvers[p.slot]
        if side == "auto" and inits is not None and inits[i] is not None:
            fs = None    # a warm start is a support of structures: the vertex side's
        p.facet = NULL if fs is None else <PyObject*> fs
        if padded:
            p.sol = &sols.items[i]
            p.in_u = <const double*> (in_u + i * st_u)
            p.out_u = <double*> (o_u + i * st_o)
        else:
            sol = _Solution.__new__(_Solution)
            sol.factor = f
            sol.facet_solver = fs
            b.outputs[i] = sol
            p.sol = &sol.s
            p.in_u = _data(etas_u, i)
        if f.n_v == 0:
            p.in_v = NULL
        elif etas_v is None or (type(etas_v) is list and etas_v[i] is None):
            p.in_v = zeros
        elif padded:
            p.in_v = <const double*> (in_v + i * st_v)
        else:
            p.in_v = _data(etas_v, i)
        if inits is not None and inits[i] is not None:
            a = <cnp.ndarray> inits[i]
            p.init = <const int*> cnp.PyArray_DATA(a)
            p.n_init = a.shape[0]
        if return_history:
            h = np.zeros(4 * max_iter + 4)
            b.hists[i] = h
            p.hist = <double*> cnp.PyArray_DATA(<cnp.ndarray> h)
    b._alloc_workspaces()
    if padded:
        b._set_shapes(("etas_u", "etas_v"))
        b._alloc_scratch(2 * (b.max_nu + b.max_nv))
    return b


cdef Py_ssize_t _backward_cost(const _Sol* sol, Factor f) noexcept:
    """What one Jacobian product of sol costs, to order a batch's problems."""
    if sol.side == SIDE_FACET:
        return f.n_u + f.n_v
    return sol.n_support * (f.n_u + f.struct_size)


def prepare_backward(sols, ins_u, ins_v, bint transpose,
                     Py_ssize_t n_threads, out_u=None, out_v=None):
    """A :class:`_Batch` of Jacobian products; its ``outputs`` are the products.

    Parameters
    ----------
    sols : list of _Solution, or _Solutions
        Each with its Cholesky factor.
    ins_u : list of flat float64 arrays, or a 2-d float64 array (row i for sols[i])
        ``d_eta_u`` (jvp) or ``du`` (vjp), validated. With ``out_u``: a padded
        C-contiguous float64 or float32 array ``(n, *pad_u)`` (leading blocks read).
    ins_v : None, or (jvp only) as ins_u, entries None meaning zeros
    transpose : bool
        False: ``du = M_I D A_I^T d_eta`` (jvp); True: ``(g_u, g_v) = A_I D M_I^T du`` (vjp).
    n_threads
        As for :func:`prepare_solve`; problems are claimed by decreasing cost
        of the product, ``|I| (n_u + struct_size)``.
    out_u, out_v : ndarray, optional
        Make the batch padded, as in :func:`prepare_solve`: ``out_u`` shaped
        like ``ins_u`` receives ``du`` (jvp) or ``g_u`` (vjp) of each problem,
        zero-padded; ``out_v`` (vjp only, optional) a C-contiguous float64
        or float32 array ``(n, *pad_v)`` receives ``g_v``. Inputs are scanned in the
        threads: a block holding a non-finite value is refused (see
        :meth:`_Batch.report`).

    Returns
    -------
    _Batch whose ``outputs`` are ``du`` arrays (jvp) or ``(g_u, g_v)`` pairs
    (vjp), shaped like the factors' scores (None when padded).
    """
    cdef _Batch b = _Batch.__new__(_Batch)
    cdef Py_ssize_t n = len(sols), j, i, max_support = 0
    cdef _Solution sol
    cdef _Solutions many = sols if isinstance(sols, _Solutions) else None
    cdef _Order by_cost
    cdef const Py_ssize_t[::1] claim
    cdef Factor f
    cdef _Problem* p
    cdef bint padded = out_u is not None
    cdef char* in_u = NULL
    cdef char* in_v = NULL
    cdef char* o_u = NULL
    cdef char* o_v = NULL
    cdef Py_ssize_t st_u = 0, st_v = 0, st_ou = 0, st_ov = 0
    if many is not None and many.n != n:
        raise ValueError(f"sols: expected {n} solutions, got {many.n}")
    b._setup(n, n_threads, VJP if transpose else JVP)
    b.outputs = None if padded else [None] * n
    b.hists = None
    b.keep.extend((sols, ins_u, ins_v, out_u, out_v))
    slots = {}
    if padded:
        if (ins_v if transpose else out_v) is not None:
            raise ValueError("a vjp takes no ins_v, a jvp gives no out_v")
        b.isz_in_u = _check_padded(ins_u, "ins_u", n)
        b.isz_out_u = _check_padded(out_u, "out_u", n, ins_u)
        b.v_in_padded = ins_v is not None
        if b.v_in_padded:
            b.isz_in_v = _check_padded(ins_v, "ins_v", n)
        if out_v is not None:
            b.isz_out_v = _check_padded(out_v, "out_v", n)
        b._set_pads(ins_u, out_v if transpose else ins_v)
        in_u = _data_pointer(ins_u, &st_u)
        in_v = _data_pointer(ins_v, &st_v)
        o_u = _data_pointer(out_u, &st_ou)
        o_v = _data_pointer(out_v, &st_ov)
    by_cost = _Order(n)
    if n_threads > 1:
        for i in range(n):
            if many is not None:
                f = <Factor> many.factors[i]
                by_cost.keys[i].cost = _backward_cost(&many.items[i], f)
            else:
                sol = sols[i]
                by_cost.keys[i].cost = _backward_cost(&sol.s, sol.factor)
    claim = by_cost.indices(n_threads > 1)
    for j in range(n):
        i = claim[j]
        p = &b.P[j]
        p.index = i
        if many is not None:
            p.sol = &many.items[i]
            p.factor = many.factors[i]
        else:
            sol = sols[i]
            p.sol = &sol.s
            p.factor = <PyObject*> sol.factor
        f = <Factor> p.factor
        if p.sol.n_support > max_support:
            max_support = p.sol.n_support
        if padded:
            p.slot = b._slot(slots, f)
            p.in_u = <const double*> (in_u + i * st_u)
            p.out_u = <double*> (o_u + i * st_ou)
            if in_v != NULL:
                p.in_v = <const double*> (in_v + i * st_v)
            if o_v != NULL:
                p.out_v = <double*> (o_v + i * st_ov)
            continue
        p.in_u = _data(ins_u, i)
        if f.n_v and ins_v is not None and (type(ins_v) is not list or ins_v[i] is not None):
            p.in_v = _data(ins_v, i)
        gu = np.empty(f.shape_u)
        p.out_u = <double*> cnp.PyArray_DATA(<cnp.ndarray> gu)
        if transpose:
            gv = np.empty(f.shape_v)
            if f.n_v:
                p.out_v = <double*> cnp.PyArray_DATA(<cnp.ndarray> gv)
            b.outputs[i] = (gu, gv)
        else:
            b.outputs[i] = gu
    b._alloc_workspaces()
    if padded:
        b._set_shapes(("ins_u", "ins_v" if not transpose else "out_v"))
    b._alloc_scratch(2 * (b.max_nu + b.max_nv) + 2 * max_support + 2)
    return b

def _time_map(Factor factor, double[:, ::1] etas_u, double[:, ::1] etas_v, Py_ssize_t repeats):
    """Median seconds of one C-level MAP call (benchmarks only).

    Cycles through the rows of ``etas_u`` / ``etas_v`` (different score arrays),
    so that branch predictors do not learn one instance.
    """
    cdef _Workspace ws = _Workspace(factor, 4)
    cdef Py_ssize_t K = etas_u.shape[0], i
    cdef double[::1] times = np.empty(repeats)
    cdef double t0
    with nogil:
        for i in range(repeats):
            t0 = _now()
            factor.c_map(&etas_u[i % K, 0], &etas_v[i % K, 0] if factor.n_v else NULL,
                         ws.snew, ws.work)
            times[i] = _now() - t0
    return float(np.median(times))

cdef double _loss_value(const double* eu, const double* ev, const double* u, const double* gu,
                        const double* gv, Py_ssize_t n_u, Py_ssize_t n_v) noexcept nogil:
    """A loss's value from its gradient ``(gu, gv)`` at the (cost-augmented) scores
    ``(eu, ev)``: ``1/2 |g_u|^2 + eu.g_u + ev.g_v - u.g_u`` for SparseMAP's loss (u
    its solution), ``eu.g_u + ev.g_v`` for MAP's (u NULL: ``a_s . eta - a_t . eta``),
    clipped at 0 (round-off of the solver). The products skip the parts where the
    gradient is 0, where forbidden parts score -inf (-inf * 0 would be nan); ev may
    be NULL (no additional scores)."""
    cdef Py_ssize_t j
    cdef double value = 0.0, g
    for j in range(n_u):
        g = gu[j]
        if g != 0:
            value += eu[j] * g
            if u != NULL:
                value += 0.5 * g * g - u[j] * g
    if ev != NULL:
        for j in range(n_v):
            if gv[j] != 0:
                value += ev[j] * gv[j]
    return value if value > 0 else 0.0


def loss_value(const double[::1] eta_u, const double[::1] eta_v, u, const double[::1] g_u,
               const double[::1] g_v):
    """:func:`_loss_value` for the NumPy losses (flat float64 arrays; ``u`` None for
    the MAP losses), so that a single example's loss and a batch's are one kernel."""
    cdef Py_ssize_t n_u = g_u.shape[0], n_v = g_v.shape[0]
    cdef const double[::1] uu
    cdef const double* up = NULL
    if eta_u.shape[0] != n_u or eta_v.shape[0] != n_v:
        raise ValueError(f"eta_u, eta_v: expected {n_u} and {n_v} entries (the gradient's), "
                         f"got {eta_u.shape[0]} and {eta_v.shape[0]}")
    if u is not None:
        uu = u
        if uu.shape[0] != n_u:
            raise ValueError(f"u: expected {n_u} entries, got {uu.shape[0]}")
        if n_u:
            up = &uu[0]
    return _loss_value(&eta_u[0] if n_u else NULL, &eta_v[0] if n_v else NULL,
                       up if u is not None else NULL, &g_u[0] if n_u else NULL,
                       &g_v[0] if n_v else NULL, n_u, n_v)


def prepare_loss(factors, etas_u, etas_v, targets, double margin, bint sparse,
                 Py_ssize_t max_iter, double tol, Py_ssize_t n_threads, out_u, out_v, values):
    """A padded :class:`_Batch` of losses (the PyTorch losses' path; private).

    Problem ``i`` reads its blocks of ``etas_u`` / ``etas_v`` as
    :func:`prepare_solve` does with ``out_u``, adds ``margin`` times the
    Hamming cost of its target to the unary scores, and solves SparseMAP
    (``sparse``; its outcome is kept in the batch's ``outputs``, a
    ``_Solutions``) or MAP there. It writes the loss of :mod:`sparsemap.losses`
    into ``values[i]`` and its gradient into its slots of ``out_u`` and (if
    given) ``out_v``, zero-padded; see :meth:`_Batch._loss`.

    Parameters
    ----------
    factors : Factor or list of Factor
    etas_u, etas_v : padded arrays, as for :func:`prepare_solve` (etas_v may be None)
    targets : ndarray of intc, shape ``(n, k)``, C-contiguous
        Row ``i`` starts with problem ``i``'s target structure (``k`` at least
        its ``struct_size``), validated by the caller: the threads read it
        without checks.
    margin : float
        The cost's scale, >= 0.
    sparse : bool
    max_iter, tol, n_threads
        As for :func:`prepare_solve`.
    out_u : padded array shaped like ``etas_u``
    out_v : padded array ``(n, *pad_v)``, or None
    values : float64 array of shape ``(n,)``, C-contiguous

    :meth:`_Batch.report` then lists problems refused (nan or +inf in a
    block), whose target uses a forbidden part (``TARGET_FORBIDDEN``), whose
    structures all do (``STATUS_INFEASIBLE``), or whose SparseMAP solve did
    not converge; their outputs are zeros (the last: the best iterate's).
    """
    cdef Py_ssize_t n = len(etas_u), j, i, max_k = 0
    cdef const int[:, ::1] tg = targets
    cdef double[::1] vals = values
    cdef char* o_v
    cdef Py_ssize_t st_ov = 0
    cdef _Problem* p
    if tg.shape[0] != n or vals.shape[0] != n:
        raise ValueError(f"targets, values: expected {n} rows")
    for f in ([factors] if isinstance(factors, Factor) else factors):
        max_k = max(max_k, (<Factor> f).struct_size)
    if max_k > tg.shape[1]:
        raise ValueError(f"targets: expected rows of at least {max_k} ints, got {tg.shape[1]}")
    # a padded solve's batch, each problem then given its target, value and out_v
    cdef _Batch b = prepare_solve(factors, etas_u, etas_v, None, max_iter, tol, False,
                                  n_threads, None, out_u)
    b.kind = LOSS
    b.margin = margin
    b.sparse = sparse
    if out_v is not None:
        b.isz_out_v = _check_padded(out_v, "out_v", n, etas_v)
    o_v = _data_pointer(out_v, &st_ov)
    b.keep.extend((targets, out_v, values))
    for j in range(n):
        p = &b.P[j]
        i = p.index
        if o_v != NULL:
            p.out_v = <double*> (o_v + i * st_ov)
        p.target = &tg[i, 0]
        p.value = &vals[i]
        vals[i] = 0.0
    return b

