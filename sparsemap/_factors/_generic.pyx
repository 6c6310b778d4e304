"""Generic factors: explicit columns (GenericFactor) and a user's own MAP oracle (OracleFactor)."""
import numpy as np

from libc.math cimport INFINITY

from sparsemap._factors._base cimport Factor
from sparsemap._factors._base import _real_array, check_positive_int


cdef class GenericFactor(Factor):
    """GenericFactor(M, N=None)

    Structures given as explicit columns.

    Parameters
    ----------
    M : array_like of shape (n_u, n_structures)
        Column ``s`` is ``m_s``.
    N : array_like of shape (n_v, n_structures), optional
        Column ``s`` is ``n_s`` (no ``eta_v`` when omitted).

    Notes
    -----
    A structure is the int column index ``s``. ``GenericFactor(np.eye(d))`` is the
    unstructured case, where SparseMAP is sparsemax. MAP scans all columns,
    O(n_structures (n_u + n_v)); ties go to the lowest index. ``overlap`` is an
    O(n_u) dot product.

    Examples
    --------
    The identity's columns give sparsemax:

    >>> import numpy as np, sparsemap as sm
    >>> f = sm.GenericFactor(np.eye(3))
    >>> f.map(np.array([0.2, 1.0, 0.9]))
    1
    >>> sm.solve(f, np.array([0.2, 1.0, 0.9])).u
    array([0.  , 0.55, 0.45])

    Three structures over two parts, the middle one with an additional part
    (scored -0.5):

    >>> g = sm.GenericFactor([[1, 1, 0], [0, 1, 1]], [[0, 1, 0]])
    >>> g.shape_u, g.shape_v, g.n_structures
    ((2,), (1,), 3)
    >>> r = sm.solve(g, np.array([1.0, 1.0]), np.array([-0.5]))
    >>> r.structures, r.weights
    ([0, 2], array([0.5, 0.5]))
    """
    cdef readonly object M
    cdef readonly object N
    cdef const double[:, ::1] Mt
    cdef const double[:, ::1] Nt
    cdef readonly int n_structures

    def __init__(self, M, N=None):
        M = _as_matrix(M, "M")
        d = M.shape[1]
        if N is None:
            N = np.zeros((0, d))
        else:
            N = _as_matrix(N, "N", allow_empty_rows=True)
            if N.shape[1] != d:
                raise ValueError(f"N: expected shape ({N.shape[0]}, {d}) (one column per "
                                 f"structure, as in M), got {N.shape}")
        M.setflags(write=False)
        N.setflags(write=False)
        self.M = M
        self.N = N
        self.Mt = np.ascontiguousarray(M.T)
        self.Nt = np.ascontiguousarray(N.T)
        self.n_structures = d
        self._set_shapes((M.shape[0],), (N.shape[0],), 1, 0)

    def _init_args(self):
        return (self.M, self.N) if self.n_v else (self.M,)

    def _non_binary_parts(self):
        return np.flatnonzero(np.any((self.M < 0) | (self.M > 1), axis=1))

    cdef int c_valid(self, const int* s) except -1 nogil:
        return 0 <= s[0] < self.n_structures

    def _validate_structure(self, s, name):
        if s[0] < 0 or s[0] >= self.n_structures:
            raise ValueError(f"{name}: expected a column index in [0, {self.n_structures}), "
                             f"got {int(s[0])}")

    def _to_public(self, s):
        return int(s[0])

    def _from_dense(self, m, n):
        hits = np.flatnonzero(np.all(self.M == m[:, None], axis=0))
        if n is not None:
            hits = hits[np.all(self.N[:, hits] == n[:, None], axis=0)]
        if hits.shape[0] == 0:
            raise ValueError("it is no column of M" + (" with n the same column of N"
                                                      if n is not None else ""))
        if any(not np.array_equal(self.N[:, j], self.N[:, hits[0]]) for j in hits[1:]):
            raise ValueError(f"columns {hits.tolist()} of M equal it but differ in N; "
                             f"give n too, or the column index")
        return hits[:1]   # exact duplicates: the lowest index, as MAP breaks ties

    cdef inline double _dot(self, int s, const double* eta_u, const double* eta_v) noexcept nogil:
        # The plain dot product first: a loop without branches, where the masked terms
        # (a branch per part, mispredicted on 0/1 columns) cost up to 4x. An infinite
        # score makes it +-inf or nan (0 * -inf), so a finite result saw finite scores
        # only, where every term is _term's (c * e; +-0 for c == 0, the same in a sum)
        # and the sum is the masked one, bit for bit.
        cdef Py_ssize_t j
        cdef double acc = 0
        cdef const double* col = &self.Mt[s, 0]
        for j in range(self.n_u):
            acc += col[j] * eta_u[j]
        if eta_v != NULL and self.n_v:
            col = &self.Nt[s, 0]
            for j in range(self.n_v):
                acc += col[j] * eta_v[j]
        if acc - acc == 0.0:
            return acc
        # a -inf mask (or an overflow, which the masked terms reproduce)
        acc = 0
        for j in range(self.n_u):
            acc += _term(self.Mt[s, j], eta_u[j])
        if eta_v != NULL:
            for j in range(self.n_v):
                acc += _term(self.Nt[s, j], eta_v[j])
        return acc

    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        cdef int s, arg = 0
        cdef double val, best = self._dot(0, eta_u, eta_v)
        for s in range(1, self.n_structures):
            val = self._dot(s, eta_u, eta_v)
            if val > best:
                best = val
                arg = s
        if best == -INFINITY:
            return 1    # every column has a nonzero at a forbidden part
        out[0] = arg
        return 0

    cdef int c_score(self, const int* s, const double* eta_u, const double* eta_v,
                     double* out) except -1 nogil:
        out[0] = self._dot(s[0], eta_u, eta_v)
        return 0

    cdef int c_overlap(self, const int* s, const int* t, double* out) except -1 nogil:
        cdef Py_ssize_t j
        cdef double acc = 0
        for j in range(self.n_u):
            acc += self.Mt[s[0], j] * self.Mt[t[0], j]
        out[0] = acc
        return 0

    cdef int c_add(self, const int* s, double w, double* u, double* v) except -1 nogil:
        cdef Py_ssize_t j
        if u != NULL:
            for j in range(self.n_u):
                u[j] += w * self.Mt[s[0], j]
        if v != NULL:
            for j in range(self.n_v):
                v[j] += w * self.Nt[s[0], j]
        return 0


cdef inline double _term(double c, double e) noexcept nogil:
    """Contribution ``c * e`` of one part to a column's score.

    A part the column does not use (``c == 0``) contributes 0 even at an
    infinite score (``0 * -inf`` is nan), and a used part with an infinite
    score contributes that score whatever the sign of ``c``: ``-inf`` forbids
    the column (``-1 * -inf`` would be ``+inf``).
    """
    if c == 0.0:
        return 0.0
    if e == INFINITY or e == -INFINITY:
        return e
    return c * e


def _as_matrix(X, name, allow_empty_rows=False):
    X = np.array(_real_array(X, name, allow_bool=True), dtype=np.float64)
    if X.ndim != 2:
        rows = "n_u" if name == "M" else "n_v"
        raise ValueError(f"{name}: expected a 2-d array ({rows}, n_structures), "
                         f"got shape {X.shape}")
    if X.shape[1] == 0 or (X.shape[0] == 0 and not allow_empty_rows):
        raise ValueError(f"{name}: expected at least one row and one column, got shape {X.shape}")
    if not np.all(np.isfinite(X)):
        raise ValueError(f"{name}: contains non-finite values (nan or inf)")
    return X


cdef class OracleFactor(Factor):
    """OracleFactor(map_fn=None, vertex_fn=None, *, shape_u, shape_v=0, structure_size=1)

    A factor defined by a user's own MAP oracle, written in Python.

    Either pass the two callables, or subclass and override
    :meth:`oracle_map` and :meth:`oracle_vertex` (and, for speed,
    :meth:`oracle_score` and :meth:`oracle_overlap`). Every solver accepts the
    result like a built-in factor; its callbacks run with the GIL held.

    Parameters
    ----------
    map_fn : callable, optional
        ``map_fn(eta_u, eta_v) -> s``: the best structure for the scores (arrays
        of shapes ``shape_u`` and ``shape_v``), as an int (``structure_size == 1``)
        or an int array of length ``structure_size``.
    vertex_fn : callable, optional
        ``vertex_fn(s) -> (m, n)`` or ``m``: the dense column of ``s``, shaped like
        ``eta_u`` (and ``eta_v``).
    shape_u : int or tuple of int
        Shape of ``eta_u``.
    shape_v : int or tuple of int, optional
        Shape of ``eta_v`` (default: no ``eta_v``).
    structure_size : int, optional
        Number of ints in a compact structure (default 1).

    Examples
    --------
    Sparsemax over 3 items, as an oracle:

    >>> import numpy as np, sparsemap as sm
    >>> f = sm.OracleFactor(lambda eu, ev: int(np.argmax(eu)),
    ...                     lambda s: np.eye(3)[s], shape_u=3)
    >>> sm.solve(f, np.array([1.0, 0.5, -1.0])).u
    array([0.75, 0.25, 0.  ])
    """
    cdef readonly object map_fn
    cdef readonly object vertex_fn

    def __init__(self, map_fn=None, vertex_fn=None, *, shape_u, shape_v=0, structure_size=1):
        shape_u = _as_shape(shape_u, "shape_u", positive=True)
        shape_v = _as_shape(shape_v, "shape_v", positive=False)
        k = check_positive_int(structure_size, "structure_size")
        if map_fn is not None and not callable(map_fn):
            raise ValueError(f"map_fn: expected a callable, got {map_fn!r}")
        if vertex_fn is not None and not callable(vertex_fn):
            raise ValueError(f"vertex_fn: expected a callable, got {vertex_fn!r}")
        self.map_fn = map_fn
        self.vertex_fn = vertex_fn
        self._set_shapes(shape_u, shape_v, k, 0)

    def _init_args(self):
        return (self.map_fn, self.vertex_fn)

    def _init_kwargs(self):
        # A subclass that says how it was built (its own _init_args) is built by its
        # own constructor: OracleFactor's keywords are not among its arguments.
        if type(self)._init_args is not OracleFactor._init_args:
            return {}
        return {"shape_u": self.shape_u, "shape_v": self.shape_v,
                "structure_size": self.struct_size}

    def __repr__(self):
        cls = type(self)
        if cls._init_args is OracleFactor._init_args and cls.__init__ is not OracleFactor.__init__:
            # a subclass with a constructor of its own that does not say how it was
            # built: name what it is, not a call that would not build it
            return (f"<{cls.__name__}: shape_u={self.shape_u}, shape_v={self.shape_v}, "
                    f"structure_size={self.struct_size}>")
        return Factor.__repr__(self)

    def __reduce__(self):
        return (_rebuild_oracle, (type(self), self.map_fn, self.vertex_fn, self.shape_u,
                                  self.shape_v, self.struct_size, getattr(self, "__dict__", None)))

    def _to_public(self, s):
        return int(s[0]) if self.struct_size == 1 else s.astype(np.intp)

    # -- user-facing hooks -----------------------------------------------------
    def oracle_map(self, eta_u, eta_v):
        """Best structure for scores ``eta_u`` (shape_u) and ``eta_v`` (shape_v)."""
        if self.map_fn is None:
            raise NotImplementedError("pass map_fn or override oracle_map")
        return self.map_fn(eta_u, eta_v)

    def oracle_vertex(self, s):
        """Dense column ``(m, n)`` (or just ``m``) of the compact structure ``s``."""
        if self.vertex_fn is None:
            raise NotImplementedError("pass vertex_fn or override oracle_vertex")
        return self.vertex_fn(s)

    def oracle_score(self, s, eta_u, eta_v):
        """``a_s . eta``; the default goes through :meth:`oracle_vertex`.

        With masks, the score of a structure must ignore the parts it does not
        use (``0 * -inf`` is nan) and be ``-inf`` when it uses a part scored
        ``-inf``; the default does both.
        """
        m, n = self._dense(s)
        return _column_score(m, eta_u.reshape(-1)) + _column_score(n, eta_v.reshape(-1))

    def oracle_overlap(self, s, t):
        """``m_s . m_t``; the default goes through :meth:`oracle_vertex`."""
        return float(self._dense(s)[0] @ self._dense(t)[0])

    def _hook(self, what):
        """The name the user knows the callback by, for error messages: the
        constructor's ``map_fn`` / ``vertex_fn``, or the overridden method."""
        method = f"oracle_{what}"
        if getattr(type(self), method) is getattr(OracleFactor, method) \
                and getattr(self, f"{what}_fn") is not None:
            return f"{what}_fn"
        return f"{method}()"

    def _dense(self, s):
        out = self.oracle_vertex(s)
        if isinstance(out, tuple):
            m, n = out
        else:
            m, n = out, None
        m = self._result_array(m)
        if m.shape != (self.n_u,):
            raise ValueError(f"{self._hook('vertex')} result: expected m of size {self.n_u}, "
                             f"got shape {m.shape}")
        if n is None or self.n_v == 0:
            n = np.zeros(self.n_v)
        else:
            n = self._result_array(n)
            if n.shape != (self.n_v,):
                raise ValueError(f"{self._hook('vertex')} result: expected n of size {self.n_v}, "
                                 f"got shape {n.shape}")
        return m, n

    def _result_array(self, x):
        """Part of a vertex result as a flat float64 array (booleans allowed); the
        callback's name is looked up for an error only (_dense runs per column)."""
        if type(x) is np.ndarray and x.dtype == np.float64:
            return x.reshape(-1)
        return _real_array(x, f"{self._hook('vertex')} result", allow_bool=True).reshape(-1)

    cdef object _public(self, const int* s):
        arr = np.array(<int[:self.struct_size]> <int*> s, dtype=np.intp)
        return int(arr[0]) if self.struct_size == 1 else arr

    cdef object _arr(self, const double* x, Py_ssize_t n, tuple shape):
        if n == 0 or x == NULL:
            return np.zeros(shape)
        return np.array(<double[:n]> <double*> x).reshape(shape)

    # -- C interface, through the GIL -------------------------------------------
    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        cdef Py_ssize_t i
        with gil:
            s = self.oracle_map(self._arr(eta_u, self.n_u, self.shape_u),
                                self._arr(eta_v, self.n_v, self.shape_v))
            arr = self.check_structure(s, f"{self._hook('map')} result")
            for i in range(self.struct_size):
                out[i] = arr[i]
        return 0

    cdef int c_score(self, const int* s, const double* eta_u, const double* eta_v,
                     double* out) except -1 nogil:
        with gil:
            out[0] = self.oracle_score(self._public(s),
                                       self._arr(eta_u, self.n_u, self.shape_u),
                                       self._arr(eta_v, self.n_v, self.shape_v))
        return 0

    cdef int c_overlap(self, const int* s, const int* t, double* out) except -1 nogil:
        with gil:
            out[0] = self.oracle_overlap(self._public(s), self._public(t))
        return 0

    cdef int c_add(self, const int* s, double w, double* u, double* v) except -1 nogil:
        cdef Py_ssize_t j
        with gil:
            m, n = self._dense(self._public(s))
            for j in range(self.n_u):
                u[j] += w * m[j]
            if v != NULL:
                for j in range(self.n_v):
                    v[j] += w * n[j]
        return 0


def _column_score(m, eta):
    """``m . eta`` over the parts ``m`` uses, -inf if one of them scores -inf (see _term)."""
    used = m != 0
    e = eta[used]
    inf = np.isinf(e)
    if inf.any():
        return float(e[inf].min())   # only -inf in scores (+inf in their absolute values)
    return float(m[used] @ e)


def _rebuild_oracle(cls, map_fn, vertex_fn, shape_u, shape_v, k, state):
    obj = cls.__new__(cls)
    OracleFactor.__init__(obj, map_fn, vertex_fn, shape_u=shape_u, shape_v=shape_v,
                          structure_size=k)
    if state:
        obj.__dict__.update(state)
    return obj


def _as_shape(shape, name, positive):
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (int(shape),)
    try:
        shape = tuple(int(d) for d in shape)
    except TypeError:
        raise ValueError(f"{name}: expected an int or a tuple of ints, got {shape!r}")
    if any(d < 0 for d in shape) or (positive and (len(shape) == 0 or int(np.prod(shape)) == 0)):
        raise ValueError(f"{name}: expected a {'non-empty ' if positive else ''}shape of "
                         f"non-negative ints, got {shape!r}")
    return shape
