"""Base class of all factors: the Python half of the vertex/column interface.

The C half (``c_map``, ``c_score``, ``c_overlap``, ``c_add``) is declared in
``_base.pxd``; each family implements it without the GIL. The Python methods
here validate their input once and then call the C methods, so every family
gets ``map``, ``vertex``, ``score``, ``overlap`` and ``add_column`` for free.
"""
import math
import numbers

import numpy as np

from libc.math cimport INFINITY
from libc.string cimport memcpy

class _NoAllowedStructure(ValueError):
    """Every structure uses a forbidden part (MAP on masked scores)."""


def _sizes_message(name, expected, got):
    return f"{name}: expected shape {tuple(expected)}, got {tuple(got)}"


cdef class Factor:
    """Factor()

    Abstract base of every factor (do not instantiate directly).

    A factor describes a family of structures ``s``, each a column
    ``a_s = [m_s; n_s]`` of an implicit 0/1 matrix ``A = [M; N]``, and knows how
    to find the best one for given scores (MAP). Scores ``eta_u`` have shape
    :attr:`shape_u` and ``eta_v`` shape :attr:`shape_v`.

    Attributes
    ----------
    shape_u, shape_v : tuple of int
        Shapes of the unary scores / posteriors ``eta_u``, ``u`` and of the
        additional scores ``eta_v``, ``v`` (size 0 when the factor has none).
    n_u, n_v : int
        Their flattened sizes.
    struct_size : int
        Number of integers in one compact structure.

    Examples
    --------
    Every factor has the same interface; here a :class:`SequenceFactor`:

    >>> import numpy as np, sparsemap as sm
    >>> f = sm.SequenceFactor(3, 2)
    >>> isinstance(f, sm.Factor), f.shape_u, f.shape_v
    (True, (3, 2), (2, 2, 2))
    >>> eta_u = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 0.0]])
    >>> s = f.map(eta_u)                 # the best structure, in compact form
    >>> s
    array([0, 1, 0])
    >>> m, n = f.vertex(s)               # its column a_s = [m_s; n_s]
    >>> m
    array([[1., 0.],
           [0., 1.],
           [1., 0.]])
    >>> float(f.score(s, eta_u, np.zeros(f.shape_v)))   # a_s . eta
    4.0
    """

    def __cinit__(self, *args, **kwargs):
        self.n_u = 0
        self.n_v = 0
        self.struct_size = 1
        self.work_bytes = 0
        self.shape_u = (0,)
        self.shape_v = (0,)

    cdef int _set_shapes(self, tuple shape_u, tuple shape_v, Py_ssize_t struct_size,
                         Py_ssize_t work_bytes) except -1:
        self.shape_u = tuple(int(d) for d in shape_u)
        self.shape_v = tuple(int(d) for d in shape_v)
        # math.prod: np.prod costs microseconds, and models build factors per batch
        self.n_u = math.prod(self.shape_u)
        self.n_v = math.prod(self.shape_v)
        self.struct_size = struct_size
        self.work_bytes = work_bytes
        return 0

    # -- C interface: subclasses override ------------------------------------
    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        with gil:
            raise NotImplementedError(f"{type(self).__name__} does not implement MAP")

    cdef int c_score(self, const int* s, const double* eta_u, const double* eta_v,
                     double* out) except -1 nogil:
        with gil:
            raise NotImplementedError(f"{type(self).__name__} does not implement score")

    cdef int c_overlap(self, const int* s, const int* t, double* out) except -1 nogil:
        with gil:
            raise NotImplementedError(f"{type(self).__name__} does not implement overlap")

    cdef int c_add(self, const int* s, double w, double* u, double* v) except -1 nogil:
        with gil:
            raise NotImplementedError(f"{type(self).__name__} does not implement add_column")

    cdef int c_valid(self, const int* s) except -1 nogil:
        cdef int[::1] view
        with gil:
            arr = np.empty(self.struct_size, dtype=np.intc)
            view = arr
            memcpy(&view[0], s, self.struct_size * sizeof(int))
            try:
                self._validate_structure(arr, "s")
            except ValueError:
                return 0
            return 1

    # -- validation hooks: subclasses override -------------------------------
    def _validate_structure(self, s, str name):
        """Raise ValueError if the int array ``s`` is not a valid structure."""

    def _to_public(self, s):
        """Turn a validated int array into the factor's public compact form."""
        return s.astype(np.intp)

    def _from_dense(self, m, n):
        """Read the compact form off a dense column; families override.

        ``m`` is a float64 array shaped like :attr:`shape_u`, ``n`` one shaped
        like :attr:`shape_v` or None. Return an int array of length
        :attr:`struct_size`, or raise ValueError with the reason
        (NotImplementedError: the family has no reader). The result needs no
        checking: :meth:`from_vertex` validates it and compares its column with
        ``(m, n)``.
        """
        raise NotImplementedError

    # -- construction: repr, equality, hashing and pickling ----------------------
    # Each family says how it was built: positional arguments in _init_args(),
    # keyword options in _init_kwargs(). Two factors built alike compare and hash
    # equal (arrays by value), so they work as dict keys and in caches.
    def _init_args(self):
        raise NotImplementedError(f"{type(self).__name__} does not implement _init_args")

    def _init_kwargs(self):
        return {}

    def _construction(self):
        return (type(self), tuple(self._init_args()), tuple(self._init_kwargs().items()),
                getattr(self, "__dict__", None))

    def __reduce__(self):
        kwargs = self._init_kwargs()
        state = getattr(self, "__dict__", None) or None
        if not kwargs and state is None:
            return (type(self), tuple(self._init_args()))
        return (_rebuild, (type(self), tuple(self._init_args()), kwargs), state)

    def __repr__(self):
        parts = [_short_repr(a) for a in self._init_args()]
        parts += [f"{k}={_short_repr(v)}" for k, v in self._init_kwargs().items()]
        return f"{type(self).__name__}({', '.join(parts)})"

    def __eq__(self, other):
        if other is self:
            return True
        if not isinstance(other, Factor):
            return NotImplemented
        return type(other) is type(self) and _same(self._construction(), other._construction())

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self):
        # The instance __dict__ of a Python subclass takes part in equality only.
        return hash(_hashable(self._construction()[:3]))

    # -- validation shared by every family ------------------------------------
    def check_scores(self, eta_u, eta_v=None, names=("eta_u", "eta_v"), masks=True):
        """Validate scores and return them as flat C-contiguous float64 arrays.

        Parameters
        ----------
        eta_u : array_like of shape :attr:`shape_u`
        eta_v : array_like of shape :attr:`shape_v`, or None
            ``None`` means zeros (the only choice when the factor has no
            ``eta_v``).
        names : pair of str
            Argument names used in error messages.
        masks : bool, default True
            Accept ``-inf``, which forbids a part (see "Masks" in the solvers
            documentation). Directions and gradients pass ``False``.

        Returns
        -------
        eta_u, eta_v : ndarray of float64, 1-d
            Copies are made only when the input is not already float64 and
            C-contiguous, or when entries the factor ignores hold non-finite
            values (they are set to 0).

        Raises
        ------
        ValueError
            Wrong shape; complex, boolean or non-numeric values; nan or
            ``+inf`` (and ``-inf`` unless ``masks``) in an entry the factor
            reads.
        """
        eu = self._check_array(eta_u, names[0], False, masks)
        if eta_v is None:
            ev = np.zeros(self.n_v, dtype=np.float64)
        else:
            ev = self._check_array(eta_v, names[1], True, masks)
        return eu, ev

    def _check_array(self, x, name, bint on_v, bint masks):
        """One score array (``eta_v``-shaped if on_v), flat float64; see check_scores."""
        shape = self.shape_v if on_v else self.shape_u
        arr = _real_array(x, name)
        if arr.shape != shape:
            if arr.size == 0 and (self.n_v if on_v else self.n_u) == 0:
                return np.zeros(0, dtype=np.float64)
            raise ValueError(_sizes_message(name, shape, arr.shape))
        flat = np.ascontiguousarray(arr).reshape(-1)
        cdef int flags = scan_values(flat)
        if flags:
            flat = self._screen(flat, name, on_v, masks, flags)
        return flat

    def _screen(self, flat, name, bint on_v, bint masks, int flags):
        """Slow path of validation, for arrays holding non-finite values.

        Entries the factor ignores (:meth:`_ignored_entries`) accept any value
        and are set to 0 in a copy; elsewhere nan and +inf raise, and -inf
        (a forbidden part) raises unless ``masks``.
        """
        ignored = self._ignored_entries(on_v)
        if ignored is not None and len(ignored):
            flat = flat.copy()
            flat[ignored] = 0.0
            flags = scan_values(flat)
        if flags & HAS_BAD:
            if masks:
                raise ValueError(f"{name}: contains non-finite values other than -inf (nan or "
                                 f"+inf); only -inf is accepted, to forbid a part")
            raise ValueError(f"{name}: contains non-finite values (nan or inf)")
        if flags & HAS_NEGINF and not masks:
            raise ValueError(f"{name}: contains non-finite values (-inf)")
        return flat

    def _ignored_entries(self, bint on_v):
        """Flat indices of the ``eta_u`` (``eta_v`` if on_v) entries MAP never reads.

        They accept any value, non-finite included. Override in a factor that
        ignores some entries (the tree's diagonal and column 0); None: none.
        """
        return None

    def _non_binary_parts(self):
        """Flat indices of the unary parts that some structure's ``m_s`` sets outside ``[0, 1]``.

        For these, ``1 - u`` is not the complement of the part, so a
        :class:`FactorGraph` refuses to negate them. Override in a family whose
        columns can hold such values (:class:`GenericFactor`); None: none.
        """
        return None

    def check_structure(self, s, name="s"):
        """Validate a compact structure and return it as a C int array.

        Parameters
        ----------
        s : compact structure
            In the factor's compact form (see the factor's docstring).
        name : str
            Argument name used in error messages.

        Returns
        -------
        ndarray of intc, shape (struct_size,)

        Raises
        ------
        ValueError
            When ``s`` has the wrong shape, is not integral, or does not
            describe a structure of this factor.
        """
        arr = _typed_array(s, name, None, "biuf", "integers")
        arr = arr.reshape(-1) if arr.ndim == 0 else arr
        if arr.shape != (self.struct_size,):
            raise ValueError(_sizes_message(name, (self.struct_size,), arr.shape))
        if arr.dtype.kind == "f":
            if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
                raise ValueError(f"{name}: expected integers, got {arr!r}")
        out = np.ascontiguousarray(arr, dtype=np.intc)
        if np.any(out != arr):
            raise ValueError(f"{name}: values out of range: {arr!r}")
        self._validate_structure(out, name)
        return out

    def check_structures(self, structures, name="structures"):
        """Validate a sequence of compact structures; return an (k, struct_size) intc array."""
        rows = list(structures)
        out = np.empty((len(rows), self.struct_size), dtype=np.intc)
        for i, s in enumerate(rows):
            out[i] = self.check_structure(s, f"{name}[{i}]")
        return out

    # -- the public Python interface -----------------------------------------
    def map(self, eta_u, eta_v=None):
        """Best structure (MAP) for the given scores.

        Parameters
        ----------
        eta_u : array_like of shape :attr:`shape_u`
            Unary scores.
        eta_v : array_like of shape :attr:`shape_v`, optional
            Additional scores (zeros when omitted).

        Returns
        -------
        structure
            The highest-scoring structure in the factor's compact form; ties
            are broken deterministically. A ``-inf`` score forbids a part: the
            structure returned uses none.

        Raises
        ------
        ValueError
            Invalid scores (see :meth:`check_scores`), or every structure uses
            a forbidden part.
        """
        eu, ev = self.check_scores(eta_u, eta_v)
        return self._to_public(self._map_flat(eu, ev))

    def _map_flat(self, double[::1] eu, double[::1] ev):
        """MAP on validated flat scores, as an intc array; ValueError when every
        structure uses a forbidden part (a -inf score)."""
        return self._map_score(eu, ev)[0]

    def _map_score(self, double[::1] eu, double[::1] ev):
        """:meth:`_map_flat` and the score of the structure: ``(intc array, float)``."""
        cdef out = np.empty(self.struct_size, dtype=np.intc)
        cdef double[::1] work = np.empty(self.work_bytes // 8 + 2, dtype=np.float64)
        cdef int[::1] o = out
        cdef const double* pu = &eu[0] if eu.shape[0] > 0 else NULL
        cdef const double* pv = &ev[0] if ev.shape[0] > 0 else NULL
        cdef int rc
        cdef double score = 0
        with nogil:
            rc = self.c_map(pu, pv, &o[0], <char*> &work[0])
            if rc == 0:
                self.c_score(&o[0], pu, pv, &score)
        if rc != 0 or not (score > -INFINITY):
            raise _NoAllowedStructure(self._infeasible_message("eta_u" if self.n_v == 0 else "eta_u, eta_v",
                                                      score))
        return out, score

    def _infeasible_message(self, names, double score=-INFINITY):
        if score != score:
            return (f"{names}: the MAP structure of {type(self).__name__} scores nan (with "
                    f"-inf scores, a structure's score must ignore the parts it does not use)")
        return (f"{names}: every structure of {type(self).__name__} uses a forbidden part "
                f"(a -inf score); no structure is allowed")

    def vertex(self, s):
        """Dense column of a structure.

        Parameters
        ----------
        s : structure in the factor's compact form

        Returns
        -------
        m : ndarray of float64, shape :attr:`shape_u`
        n : ndarray of float64, shape :attr:`shape_v` (empty if the factor has none)
        """
        cdef int[::1] sa = self.check_structure(s)
        m = np.zeros(self.n_u, dtype=np.float64)
        n = np.zeros(self.n_v, dtype=np.float64)
        cdef double[::1] mv = m
        cdef double[::1] nv = n
        self.c_add(&sa[0], 1.0, &mv[0] if self.n_u else NULL, &nv[0] if self.n_v else NULL)
        return m.reshape(self.shape_u), n.reshape(self.shape_v)

    def from_vertex(self, m, n=None, names=("m", "n")):
        """The structure whose dense column is ``(m, n)``: the inverse of :meth:`vertex`.

        Parameters
        ----------
        m : array_like of shape :attr:`shape_u`
            A structure's column ``m_s``, such as a 0/1 target array.
        n : array_like of shape :attr:`shape_v`, optional
            Its ``n_s``; when given it must match as well. Only needed to tell
            apart structures with the same ``m_s`` (possible for a
            :class:`GenericFactor`).
        names : pair of str
            Argument names used in error messages.

        Returns
        -------
        structure
            In the factor's compact form.

        Raises
        ------
        ValueError
            Wrong shape, values that are not finite reals, or an array that is
            not the column of any structure of the factor (or the column of
            several that ``n`` would tell apart).

        Examples
        --------
        >>> import sparsemap as sm
        >>> f = sm.TreeFactor(3)
        >>> m, _ = f.vertex([-1, 2, 0, 2])
        >>> f.from_vertex(m)
        array([-1,  2,  0,  2])
        >>> m[1, 2] = 1.0                # word 2 gets a second head, word 1
        >>> f.from_vertex(m)
        Traceback (most recent call last):
            ...
        ValueError: m: not the column of any structure of TreeFactor(3, ...
        """
        mm = _dense_array(m, names[0], self.shape_u)
        nn = None if n is None else _dense_array(n, names[1], self.shape_v)
        try:
            s = self._from_dense(mm, nn)
        except NotImplementedError:
            raise ValueError(f"{names[0]}: {type(self).__name__} cannot read a structure off a "
                             f"dense column; give the structure in its compact form") from None
        except ValueError as exc:
            raise ValueError(f"{names[0]}: not the column of any structure of {self!r}: "
                             f"{exc}") from None
        arr = self.check_structure(s, names[0])
        ms, ns = self.vertex(arr)
        for got, want, nm in ((mm, ms, names[0]), (nn, ns, names[1])):
            if got is not None and not np.array_equal(got, want):
                where = tuple(int(i) for i in np.argwhere(got != want)[0])
                public = self._to_public(arr)
                public = public.tolist() if isinstance(public, np.ndarray) else public
                raise ValueError(
                    f"{nm}: not the column of any structure of {self!r}: it has "
                    f"{float(got[where]):g} at index {where[0] if len(where) == 1 else where}, where "
                    f"the nearest reading, {public!r}, has {float(want[where]):g}")
        return self._to_public(arr)

    def score(self, s, eta_u, eta_v=None):
        """Score ``a_s . [eta_u; eta_v]`` of a structure, in time linear in its compact size.

        Parameters
        ----------
        s : structure in compact form
        eta_u, eta_v : array_like
            Scores, as for :meth:`map`.

        Returns
        -------
        float
        """
        cdef int[::1] sa = self.check_structure(s)
        eu, ev = self.check_scores(eta_u, eta_v)
        cdef double[::1] euv = eu
        cdef double[::1] evv = ev
        cdef double out = 0
        self.c_score(&sa[0], &euv[0] if self.n_u else NULL,
                     &evv[0] if self.n_v else NULL, &out)
        return out

    def overlap(self, s, t):
        """Overlap ``m_s . m_t`` of two structures (a Gram matrix entry).

        Parameters
        ----------
        s, t : structures in compact form

        Returns
        -------
        float
        """
        cdef int[::1] sa = self.check_structure(s, "s")
        cdef int[::1] ta = self.check_structure(t, "t")
        cdef double out = 0
        self.c_overlap(&sa[0], &ta[0], &out)
        return out

    def add_column(self, s, double w, u, v=None):
        """In place: ``u += w * m_s`` and ``v += w * n_s``.

        Parameters
        ----------
        s : structure in compact form
        w : float
        u : ndarray of float64, shape :attr:`shape_u`, C-contiguous, writable
        v : ndarray of float64, shape :attr:`shape_v`, or None to skip ``n_s``
        """
        cdef int[::1] sa = self.check_structure(s)
        cdef double[::1] uv = _as_out_array(u, "u", self.shape_u)
        cdef double[::1] vv
        cdef double* pv = NULL    # c_add skips n_s when v is NULL
        if v is not None and self.n_v:
            vv = _as_out_array(v, "v", self.shape_v)
            pv = &vv[0]
        self.c_add(&sa[0], w, &uv[0] if self.n_u else NULL, pv)


# Bits of -inf, the one non-finite score that is allowed (it forbids a part).
cdef unsigned long long NEGINF_BITS = 0xfff0000000000000ULL


cdef int _scan(const double* x, Py_ssize_t n) noexcept nogil:
    """HAS_NEGINF | HAS_BAD flags of x (-inf; nan or +inf), in one vectorisable pass."""
    # nan and +-inf are exactly the doubles whose exponent bits are all ones; an
    # integer OR-reduction over them vectorises, where float comparisons would not.
    cdef Py_ssize_t i
    cdef const unsigned long long* bits = <const unsigned long long*> x
    cdef unsigned long long b, neg = 0, bad = 0
    for i in range(n):
        b = bits[i]
        neg |= b == NEGINF_BITS
        bad |= (((b >> 52) & 0x7ff) == 0x7ff) & (b != NEGINF_BITS)
    return (HAS_NEGINF if neg else 0) | (HAS_BAD if bad else 0)


def scan_values(const double[::1] x):
    """``HAS_NEGINF | HAS_BAD`` flags of a flat float64 array: -inf; nan or +inf."""
    if x.shape[0] == 0:
        return 0
    return _scan(&x[0], x.shape[0])


SCAN_NEGINF, SCAN_BAD = HAS_NEGINF, HAS_BAD


def _real_array(x, name, bint allow_bool=False):
    """``x`` as a float64 ndarray (no copy when it already is one).

    Complex input raises instead of losing its imaginary part (NumPy would only
    warn), and so do strings, other non-numeric dtypes and, unless
    ``allow_bool``, booleans: a boolean array passed as scores is most likely a
    mask meant to forbid parts, which is written with ``-inf``.
    """
    if type(x) is np.ndarray and x.dtype == np.float64:
        return x
    if x is None:
        raise ValueError(f"{name}: expected an array of floats, got None")
    try:
        arr = np.asarray(x)
    except Exception as exc:  # ragged lists and other junk
        raise ValueError(f"{name}: expected an array of floats ({exc})")
    kind = arr.dtype.kind
    if kind == "c":
        raise ValueError(f"{name}: expected real values, got complex dtype {arr.dtype} "
                         f"(pass np.real(...) if the imaginary part should be dropped)")
    if kind == "b" and not allow_bool:
        raise ValueError(f"{name}: expected real scores, got a boolean array (to forbid "
                         f"parts, put -inf in the scores: np.where(allowed, scores, -np.inf))")
    if kind == "O":
        try:
            return arr.astype(np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}: expected an array of floats ({exc})")
    if kind not in "biuf":
        raise ValueError(f"{name}: expected an array of floats, got dtype {arr.dtype}")
    return arr.astype(np.float64, copy=False)


def _typed_array(x, name, tuple shape, str kinds, str what, where=""):
    """``np.asarray(x)`` with its dtype kind in ``kinds`` and, unless ``shape`` is None,
    that shape; or a ValueError naming ``name``.

    ``what`` says what was expected ("integers", "booleans", "real numbers");
    ``where`` (a str, or a callable returning one when the message is made)
    follows the expected shape in the message. Object arrays are refused
    whatever ``kinds``: their entries are not checked.
    """
    try:
        arr = np.asarray(x)
    except Exception as exc:   # ragged lists and other junk
        raise ValueError(f"{name}: expected {what}"
                         f"{'' if shape is None else f' of shape {shape}'} ({exc})") from None
    if arr.dtype.kind not in kinds or arr.dtype.kind == "O":
        raise ValueError(f"{name}: expected {what}, got dtype {arr.dtype}")
    if shape is not None and arr.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}{where() if callable(where) else where}, "
                         f"got {arr.shape}")
    return arr


def _as_float_array(x, name, tuple shape):
    """Float64 C-contiguous array of the given shape, all finite, or a ValueError naming ``name``."""
    arr = _real_array(x, name)
    if arr.shape != shape:
        if arr.size == 0 and int(np.prod(shape)) == 0:
            return np.zeros(shape, dtype=np.float64)
        raise ValueError(_sizes_message(name, shape, arr.shape))
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    if scan_values(arr.reshape(-1)):
        raise ValueError(f"{name}: contains non-finite values (nan or inf)")
    return arr


def _dense_array(x, name, tuple shape):
    """A float64 array of the given shape with finite real values, or a ValueError."""
    arr = _typed_array(x, name, shape, "biuf", "real numbers").astype(np.float64)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: contains non-finite values (nan or inf)")
    return arr


def _rebuild(cls, args, kwargs):
    """Unpickle a factor: ``cls(*args, **kwargs)`` (the instance state follows)."""
    return cls(*args, **kwargs)


def _short_repr(x):
    """repr of a construction argument: arrays by shape, functions by name."""
    if isinstance(x, np.ndarray):
        return f"<{' x '.join(str(d) for d in x.shape)} array>"
    name = getattr(x, "__qualname__", None)
    if callable(x) and isinstance(name, str) and not isinstance(x, type):
        return name
    return repr(x)


def _same(a, b):
    """Equality of construction records: arrays by shape and value, the rest by ==."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                and a.shape == b.shape and bool(np.array_equal(a, b)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return a is b


def _hashable(x):
    """A hashable stand-in for a construction record, consistent with :func:`_same`."""
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "biuf":
            return ("ndarray", x.shape)
        # Equal values, equal bytes: one dtype, and + 0.0 turns -0.0 into 0.0.
        return ("ndarray", x.shape, (np.ascontiguousarray(x, dtype=np.float64) + 0.0).tobytes())
    if isinstance(x, (tuple, list)):
        return tuple(_hashable(y) for y in x)
    if isinstance(x, dict):
        return tuple((k, _hashable(v)) for k, v in x.items())
    try:
        hash(x)
    except TypeError:   # equal unhashable values must still hash alike
        return ("unhashable", type(x).__qualname__)
    return x


def _as_out_array(x, name, shape):
    if not isinstance(x, np.ndarray) or x.dtype != np.float64 or not x.flags.c_contiguous \
            or not x.flags.writeable:
        raise ValueError(f"{name}: expected a writable C-contiguous float64 ndarray of shape "
                         f"{tuple(shape)}")
    if x.shape != tuple(shape):
        raise ValueError(_sizes_message(name, shape, x.shape))
    return x.reshape(-1)


def check_positive_int(value, name):
    """Return ``value`` as a positive int, or raise ValueError naming ``name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return int(value)


def check_real(value, name, bint positive=False):
    """Return ``value`` as a finite float, non-negative (positive if ``positive``), or raise
    ValueError naming ``name``."""
    if type(value) is not float:     # the common case skips the isinstance checks
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name}: expected a finite "
                             f"{'positive' if positive else 'non-negative'} float, got {value!r}")
        value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name}: expected a finite {'positive' if positive else 'non-negative'} "
                         f"float, got {value!r}")
    return value


def check_bool(value, name):
    """Return ``value`` as a bool (a bool, or the integer 0 or 1), or raise ValueError naming ``name``."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name}: expected a bool, got {value!r}")


def _first_invalid(factors, const int[:, ::1] rows):
    """The index of the first row of ``rows`` (B x k) its factor rejects, or -1.

    ``factors`` is one Factor for every row (then k must be its structure
    size) or a sequence of B; a row is rejected when its factor's structure
    size exceeds k, or by ``c_valid`` on its leading entries. One pass in C for
    the typed families: the batch losses check their targets with it.
    """
    cdef Py_ssize_t i, B = rows.shape[0], k = rows.shape[1]
    cdef Factor f
    cdef bint shared = isinstance(factors, Factor)
    if shared:
        f = factors
        if B and f.struct_size != k:
            return 0
    for i in range(B):
        if not shared:
            f = factors[i]
        if f.struct_size > k or (f.struct_size and not f.c_valid(&rows[i, 0])):
            return i
    return -1
