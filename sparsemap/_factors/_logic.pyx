"""Logic factors over binary variables, and the budgeted binary sequence.

Every factor here has ``n`` binary variables scored by ``eta_u`` of shape
``(n,)``; a structure is an allowed configuration, in compact form the 0/1 int
vector ``s`` of length ``n``, and its unary column is ``m_s = s``. The one
exception is :class:`KnapsackFactor`, whose polytope has vertices with one
fractional coordinate (see its docstring for their compact form). The factors
differ in the configurations they allow (a first-order logic constraint, a
budget) and in their additional parts: :class:`PairFactor` scores "both on",
:class:`SequenceBudgetFactor` scores the transitions of a two-state chain.

MAP ties
--------
Every factor returns, among the best configurations, the one with the fewest
variables on, and among those the one whose "on" variables come first (the
sorted list of their indices is lexicographically smallest). So a variable
with score exactly 0 stays off unless the constraint needs it, and among equal
scores the lowest indices are switched on first. "Equal" means equal in
floating point: sums of scores that are equal in exact arithmetic may differ
by round-off.
"""

import math

import numpy as np

from libc.float cimport DBL_EPSILON
from libc.math cimport INFINITY
from libc.stdlib cimport qsort

from sparsemap._factors._base cimport Factor
from sparsemap._factors._base import (_real_array, _typed_array, check_bool, check_positive_int,
                                     check_real)

# The back-pointer table of SequenceBudgetFactor's MAP, n * (min(budget, n) + 1)
# bytes, must stay below this size.
_MAX_TABLE = 2 ** 31


def _check_budget(value, exact, n):
    """``budget`` as an int in range: >= 0, and <= n when it must be met exactly."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"budget: expected a non-negative integer, got {value!r}")
    if value < 0:
        raise ValueError(f"budget: expected a non-negative integer, got {value!r}")
    if exact and value > n:
        raise ValueError(f"budget: exactly {value} of n={n} variables on is infeasible "
                         f"(exact=True needs budget <= n)")
    return int(value)


def _show(s):
    """A structure for an error message, summarised when long."""
    return np.array2string(np.asarray(s), separator=", ", threshold=40, edgeitems=5)


cdef union _Bits:
    double d
    unsigned long long b


cdef inline double _keep(double x, int on) noexcept nogil:
    """x if on (0 or 1) else +0.0, without a branch."""
    cdef _Bits v
    v.d = x
    v.b &= <unsigned long long> (-<long long> on)
    return v.d


cdef class _BinaryFactor(Factor):
    """Shared part of the factors over ``n`` binary variables with ``m_s = s``.

    ``c_score``, ``c_overlap`` and ``c_add`` here cover the unary part;
    factors with additional parts extend ``c_score`` and ``c_add``.
    """
    cdef readonly int n

    def __init__(self, n):
        self._set_n(n)

    def _set_n(self, n, minimum=1, need=None):
        """Check ``n`` (>= ``minimum``, ``need`` says why) and set unary-only shapes."""
        self.n = check_positive_int(n, "n")
        if self.n < minimum:
            raise ValueError(f"n: expected an integer >= {minimum} ({need}), got {n!r}")
        self._set_shapes((self.n,), (0,), self.n, 0)

    def _init_args(self):
        return (self.n,)

    def _from_dense(self, m, n):
        return m   # the compact form is the 0/1 column itself

    def _validate_structure(self, s, name):
        if np.any((s != 0) & (s != 1)):
            raise ValueError(f"{name}: expected 0/1 entries, got {_show(s)}")
        msg = self._constraint_error(s)
        if msg is not None:
            raise ValueError(f"{name}: {msg}, got {_show(s)}")

    def _constraint_error(self, s):
        """A message saying which constraint the 0/1 array ``s`` breaks, or None."""
        return None

    cdef int c_score(self, const int* s, const double* eta_u, const double* eta_v,
                     double* out) except -1 nogil:
        # The active set calls this and c_add O(|I|) times per iteration, on 0/1
        # patterns a branch predictor cannot learn. So no branch: eta_u[i] is
        # kept or zeroed by masking its bits (not by a product: 0 * -inf would be
        # nan), and four accumulators let the additions overlap.
        cdef int i = 0, n = self.n
        cdef double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0
        while i + 4 <= n:
            a0 += _keep(eta_u[i], s[i])
            a1 += _keep(eta_u[i + 1], s[i + 1])
            a2 += _keep(eta_u[i + 2], s[i + 2])
            a3 += _keep(eta_u[i + 3], s[i + 3])
            i += 4
        while i < n:
            a0 += _keep(eta_u[i], s[i])
            i += 1
        out[0] = (a0 + a1) + (a2 + a3)
        return 0

    cdef int c_overlap(self, const int* s, const int* t, double* out) except -1 nogil:
        cdef int i, k = 0
        for i in range(self.n):
            k += s[i] & t[i]
        out[0] = k
        return 0

    cdef int c_add(self, const int* s, double w, double* u, double* v) except -1 nogil:
        cdef int i
        if u != NULL:
            for i in range(self.n):
                u[i] += w * s[i]      # w is finite: a product vectorises, a branch does not
        return 0


cdef inline void _zero(int* out, int n) noexcept nogil:
    cdef int i
    for i in range(n):
        out[i] = 0


cdef inline int _argmax(const double* x, int n) noexcept nogil:
    """Index of the largest of x[0:n] (n >= 1), the lowest on ties."""
    cdef int i, arg = 0
    for i in range(1, n):
        if x[i] > x[arg]:
            arg = i
    return arg


cdef inline double _or_into(const double* eta, int K, int* out) noexcept nogil:
    """MAP of "at least one of K >= 1 variables on" into out[0:K]; returns its score.

    Every variable with a positive score, and the best one (lowest index on
    ties) if none is positive.
    """
    cdef int i, arg
    cdef bint any_on = False
    cdef double val = 0.0
    for i in range(K):
        out[i] = eta[i] > 0
        if out[i]:
            any_on = True
            val += eta[i]
    if not any_on:
        arg = _argmax(eta, K)
        out[arg] = 1
        val = eta[arg]
    return val


cdef class XorFactor(_BinaryFactor):
    """XorFactor(n)

    Exactly one of ``n`` binary variables on.

    The configurations are the ``n`` unit vectors, so SparseMAP alone is
    sparsemax of ``eta_u``.

    Parameters
    ----------
    n : int
        Number of variables (>= 1; ``n = 1`` forces the variable on).

    Attributes
    ----------
    n : int

    Notes
    -----
    Scores: ``eta_u`` of shape ``(n,)``; no ``eta_v``. Compact form: the 0/1
    int vector ``s`` of length ``n`` with one entry 1; ``m_s = s``. MAP is the
    argmax, O(n), the lowest index on ties.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> f = sm.XorFactor(3)
    >>> f.map(np.array([0.2, 0.7, 0.7]))
    array([0, 1, 0])
    >>> sm.solve(f, np.array([1.0, 0.5, -1.0])).u      # sparsemax
    array([0.75, 0.25, 0.  ])
    """

    def _constraint_error(self, s):
        if s.sum() != 1:
            return f"expected exactly one variable on, {int(s.sum())} are"

    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        _zero(out, self.n)
        out[_argmax(eta_u, self.n)] = 1
        return 0


cdef class AtMostOneFactor(_BinaryFactor):
    """AtMostOneFactor(n)

    At most one of ``n`` binary variables on.

    Parameters
    ----------
    n : int
        Number of variables (>= 1).

    Attributes
    ----------
    n : int

    Notes
    -----
    Scores: ``eta_u`` of shape ``(n,)``; no ``eta_v``. Compact form: the 0/1
    int vector ``s`` of length ``n`` with at most one entry 1 (the all-zero
    vector is a structure, with ``m_s = 0``). MAP switches on the best
    variable if its score is positive, O(n); the lowest index on ties, all
    off when the best score is 0.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> f = sm.AtMostOneFactor(3)
    >>> f.map(np.array([-0.2, -0.5, -1.0]))
    array([0, 0, 0])
    >>> sm.solve(f, np.array([0.3, -0.5, 0.1])).u   # clipped: sum <= 1
    array([0.3, 0. , 0.1])
    """

    def _constraint_error(self, s):
        if s.sum() > 1:
            return f"expected at most one variable on, {int(s.sum())} are"

    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        cdef int arg = _argmax(eta_u, self.n)
        _zero(out, self.n)
        if eta_u[arg] > 0:
            out[arg] = 1
        return 0


cdef class OrFactor(_BinaryFactor):
    """OrFactor(n)

    At least one of ``n`` binary variables on.

    Parameters
    ----------
    n : int
        Number of variables (>= 1).

    Attributes
    ----------
    n : int

    Notes
    -----
    Scores: ``eta_u`` of shape ``(n,)``; no ``eta_v``. Compact form: the 0/1
    int vector ``s`` of length ``n`` with at least one entry 1. MAP switches
    on every variable with a positive score, and the best one (lowest index
    on ties) if none is positive, O(n).

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> sm.OrFactor(3).map(np.array([-0.2, -0.5, -1.0]))
    array([1, 0, 0])
    """

    def _constraint_error(self, s):
        if s.sum() < 1:
            return "expected at least one variable on, none is"

    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        _or_into(eta_u, self.n, out)
        return 0


# -- selection of the k best of m indices -----------------------------------------------
# The order is total (score, then index), so the selected set does not depend on
# the pivots: they only decide the running time.

cdef inline bint _better(const double* x, int a, int b) noexcept nogil:
    """Whether index a comes before index b: higher score, then lower index."""
    return x[a] > x[b] or (x[a] == x[b] and a < b)


cdef inline void _swap(int* idx, Py_ssize_t a, Py_ssize_t b) noexcept nogil:
    cdef int t = idx[a]
    idx[a] = idx[b]
    idx[b] = t


cdef void _sift_down(const double* x, int* h, Py_ssize_t size, Py_ssize_t i) noexcept nogil:
    """Restore the heap below h[i]; the root of the heap is its worst element."""
    cdef Py_ssize_t c
    while True:
        c = 2 * i + 1
        if c >= size:
            return
        if c + 1 < size and _better(x, h[c], h[c + 1]):
            c += 1                       # the worse child
        if not _better(x, h[i], h[c]):
            return
        _swap(h, i, c)
        i = c


cdef void _heap_select(const double* x, int* idx, Py_ssize_t m, Py_ssize_t k) noexcept nogil:
    """Move the k best of idx[0:m] to idx[0:k] (0 < k < m), O(m log k)."""
    cdef Py_ssize_t i
    for i in range(k // 2 - 1, -1, -1):
        _sift_down(x, idx, k, i)
    for i in range(k, m):
        if _better(x, idx[i], idx[0]):
            _swap(idx, 0, i)
            _sift_down(x, idx, k, 0)


cdef void _select_top(const double* x, int* idx, Py_ssize_t m, Py_ssize_t k,
                      int depth) noexcept nogil:
    """Move the k best of idx[0:m] to idx[0:k], in any order.

    Quickselect with a median-of-three pivot, O(m) on average; after ``depth``
    partitions the remaining range is finished by heap selection, so the worst
    case is O(m log m).
    """
    cdef Py_ssize_t lo = 0, hi = m, mid, j, store
    cdef int pv
    while lo < k < hi:
        if depth <= 0:
            _heap_select(x, idx + lo, hi - lo, k - lo)
            return
        depth -= 1
        # median of three, moved to hi - 1
        mid = lo + (hi - lo) // 2
        if _better(x, idx[mid], idx[lo]):
            _swap(idx, mid, lo)
        if _better(x, idx[hi - 1], idx[lo]):
            _swap(idx, hi - 1, lo)
        if _better(x, idx[mid], idx[hi - 1]):
            _swap(idx, mid, hi - 1)
        pv = idx[hi - 1]
        store = lo
        for j in range(lo, hi - 1):
            if _better(x, idx[j], pv):
                _swap(idx, j, store)
                store += 1
        _swap(idx, store, hi - 1)
        # idx[lo:store] beat the pivot, idx[store + 1:hi] lose to it
        if store < k:
            lo = store + 1
        else:
            hi = store


cdef inline int _depth_limit(Py_ssize_t m) noexcept nogil:
    cdef int d = 4
    while m > 1:
        m >>= 1
        d += 2
    return d


def _top_k(x, k, depth=None):
    """The k best indices of x (higher value, then lower index), as a sorted array.

    For tests only: ``depth=0`` forces the heap selection of every range.
    """
    cdef double[::1] xv = np.ascontiguousarray(x, dtype=np.float64)
    cdef Py_ssize_t m = xv.shape[0]
    idx = np.arange(m, dtype=np.intc)
    cdef int[::1] iv = idx
    if 0 < k < m:
        _select_top(&xv[0], &iv[0], m, k, _depth_limit(m) if depth is None else depth)
    return np.sort(idx[:k])


cdef class _Budgeted(_BinaryFactor):
    """Shared part of the factors with at most (or exactly) ``budget`` of ``n`` on.

    Subclasses set their shapes after this ``__init__`` and name what is
    counted (``_counted``) in constraint messages.
    """
    cdef readonly int budget
    cdef readonly bint exact
    _counted = "variables"

    def __init__(self, n, budget, exact=False):
        self._set_n(n)
        self.exact = check_bool(exact, "exact")
        self.budget = _check_budget(budget, self.exact, self.n)

    def _init_args(self):
        return (self.n, self.budget)

    def _init_kwargs(self):
        return {"exact": bool(self.exact)}

    def _constraint_error(self, s):
        k = int(s.sum())
        if self.exact and k != self.budget:
            return f"expected exactly budget={self.budget} {self._counted} on, {k} are"
        if k > self.budget:
            return f"expected at most budget={self.budget} {self._counted} on, {k} are"


cdef class BudgetFactor(_Budgeted):
    """BudgetFactor(n, budget, exact=False)

    At most (or exactly) ``budget`` of ``n`` binary variables on.

    Parameters
    ----------
    n : int
        Number of variables (>= 1).
    budget : int
        Largest number of variables on (>= 0; a budget of ``n`` or more
        allows every configuration).
    exact : bool, default False
        Require exactly ``budget`` variables on (then ``budget <= n``).

    Attributes
    ----------
    n, budget : int
    exact : bool

    Notes
    -----
    Scores: ``eta_u`` of shape ``(n,)``; no ``eta_v``. Compact form: the 0/1
    int vector ``s`` of length ``n`` with at most (exactly) ``budget`` ones.

    MAP switches on the ``budget`` best variables among those with a positive
    score (``exact=True``: among all variables), ties to the lowest index.
    They are found by selection, not sorting: quickselect with a
    median-of-three pivot, O(n) on average, falling back to heap selection
    after O(log n) partitions, so O(n log n) at worst.

    SparseMAP is the Euclidean projection of ``eta_u`` onto
    ``{u in [0, 1]^n : sum(u) <= budget}`` (``= budget``: the capped simplex),
    ``clip(eta_u - tau, 0, 1)`` for a scalar ``tau``.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> f = sm.BudgetFactor(4, 2)
    >>> f.map(np.array([0.5, -1.0, 2.0, 0.5]))
    array([1, 0, 1, 0])
    >>> eta = np.array([-0.5, -1.0, -2.0, 0.5])
    >>> sm.BudgetFactor(4, 2, exact=True).map(eta)
    array([1, 0, 0, 1])
    >>> print(sm.solve(f, np.array([0.9, 0.8, 0.7, -0.5])).u)
    [0.76666667 0.66666667 0.56666667 0.        ]
    """

    def __init__(self, n, budget, exact=False):
        _Budgeted.__init__(self, n, budget, exact)
        self._set_shapes((self.n,), (0,), self.n, 4 * self.n)   # MAP's index buffer

    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        cdef int* idx = <int*> work
        cdef Py_ssize_t i, m = 0, k = self.budget
        for i in range(self.n):
            out[i] = 0
            if self.exact or eta_u[i] > 0:
                idx[m] = <int> i
                m += 1
        if k < m:
            _select_top(eta_u, idx, m, k, _depth_limit(m))
            m = k
        for i in range(m):
            out[idx[i]] = 1
        return 0


cdef class PairFactor(_BinaryFactor):
    """PairFactor()

    Two binary variables, all four configurations, with a score for "both on".

    Parameters
    ----------
    (none)

    Notes
    -----
    Scores: ``eta_u`` of shape ``(2,)``; ``eta_v`` of shape ``(1,)`` scoring
    "both on". Compact form: the 0/1 int vector ``s`` of length 2;
    ``m_s = s`` and ``n_s = [s[0] * s[1]]``. MAP compares the four
    configurations, preferring ``00``, then ``10``, ``01``, ``11`` on ties.

    SparseMAP has a closed form (Martins' thesis, Prop. 6.5): ``v`` sits at
    ``min(u0, u1)`` when ``eta_v >= 0`` and at ``max(0, u0 + u1 - 1)``
    otherwise.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> f = sm.PairFactor()
    >>> f.map(np.array([-0.5, -0.5]), np.array([2.0]))
    array([1, 1])
    >>> r = sm.solve(f, np.array([0.5, 0.5]), np.array([0.4]))
    >>> print(r.u, r.v)
    [0.7 0.7] [0.7]
    """

    def __init__(self):
        self.n = 2
        self._set_shapes((2,), (1,), 2, 0)

    def _init_args(self):
        return ()

    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        cdef double w = eta_v[0] if eta_v != NULL else 0.0
        cdef double best = 0.0, both = eta_u[0] + eta_u[1] + w
        out[0] = 0
        out[1] = 0
        if eta_u[0] > best:
            best = eta_u[0]
            out[0] = 1
        if eta_u[1] > best:
            best = eta_u[1]
            out[0] = 0
            out[1] = 1
        if both > best:
            out[0] = 1
            out[1] = 1
        return 0

    cdef int c_score(self, const int* s, const double* eta_u, const double* eta_v,
                     double* out) except -1 nogil:
        _BinaryFactor.c_score(self, s, eta_u, eta_v, out)
        if eta_v != NULL and s[0] and s[1]:
            out[0] += eta_v[0]
        return 0

    cdef int c_add(self, const int* s, double w, double* u, double* v) except -1 nogil:
        _BinaryFactor.c_add(self, s, w, u, v)
        if v != NULL and s[0] and s[1]:
            v[0] += w
        return 0


cdef class OrOutFactor(_BinaryFactor):
    """OrOutFactor(n)

    The last of ``n`` binary variables is the OR of the first ``n - 1``.

    Parameters
    ----------
    n : int
        Number of variables, the ``n - 1`` inputs and the output (>= 3).

    Attributes
    ----------
    n : int

    Notes
    -----
    Scores: ``eta_u`` of shape ``(n,)``; no ``eta_v``. Compact form: the 0/1
    int vector ``s`` of length ``n`` with ``s[-1] == max(s[:-1])``. MAP
    compares the all-off configuration (score 0) with the best one whose
    output is on: the output, every input with a positive score, and the best
    input (lowest index on ties) if none is positive; O(n).

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> sm.OrOutFactor(3).map(np.array([-0.5, -0.2, 1.0]))
    array([0, 1, 1])
    """

    def __init__(self, n):
        self._set_n(n, 3, "at least two inputs and the output")

    def _constraint_error(self, s):
        K = self.n - 1
        if s[K] != s[:K].max():
            return "expected the last variable to be the OR of the others"

    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        # the best configuration with the output on (the inputs' OR MAP), against all off
        cdef int K = self.n - 1
        if _or_into(eta_u, K, out) + eta_u[K] > 0:
            out[K] = 1
        else:
            _zero(out, self.n)
        return 0


cdef class AndOutFactor(_BinaryFactor):
    """AndOutFactor(n)

    The last of ``n`` binary variables is the AND of the first ``n - 1``.

    Parameters
    ----------
    n : int
        Number of variables, the ``n - 1`` inputs and the output (>= 3).

    Attributes
    ----------
    n : int

    Notes
    -----
    Scores: ``eta_u`` of shape ``(n,)``; no ``eta_v``. Compact form: the 0/1
    int vector ``s`` of length ``n`` with ``s[-1] == min(s[:-1])``. MAP
    compares the all-on configuration with the best one whose output is off:
    every input with a positive score, except the worst input if all are
    positive (the highest index among equal worst, so that the lowest indices
    stay on); O(n). It is :class:`OrOutFactor` on negated variables.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> sm.AndOutFactor(3).map(np.array([0.5, 0.2, -1.0]))
    array([1, 0, 0])
    """

    def __init__(self, n):
        self._set_n(n, 3, "at least two inputs and the output")

    def _constraint_error(self, s):
        K = self.n - 1
        if s[K] != s[:K].min():
            return "expected the last variable to be the AND of the others"

    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        cdef int i, K = self.n - 1, n_on = 0, worst = 0
        cdef double all_on = eta_u[K], off = 0.0
        for i in range(K):
            all_on += eta_u[i]
            out[i] = eta_u[i] > 0
            if out[i]:
                n_on += 1
                off += eta_u[i]
            if eta_u[i] <= eta_u[worst]:
                worst = i        # the last of the smallest
        if n_on == K:
            off -= eta_u[worst]
            out[worst] = 0
        out[K] = 0
        if all_on > off:
            for i in range(self.n):
                out[i] = 1
        return 0


cdef class XorOutFactor(_BinaryFactor):
    """XorOutFactor(n)

    At most one of the first ``n - 1`` binary variables on; the last says whether one is.

    Equivalently, exactly one of ``s[0], ..., s[n - 2], 1 - s[n - 1]`` is on:
    XOR with the last variable negated. Not parity: two inputs on is not
    allowed.

    Parameters
    ----------
    n : int
        Number of variables, the ``n - 1`` inputs and the output (>= 2).

    Attributes
    ----------
    n : int

    Notes
    -----
    Scores: ``eta_u`` of shape ``(n,)``; no ``eta_v``. Compact form: the 0/1
    int vector ``s`` of length ``n`` with ``sum(s[:-1]) <= 1`` and
    ``s[-1] == sum(s[:-1])``. MAP switches on the best input (lowest index on
    ties) and the output when their scores add up to more than 0; O(n).
    SparseMAP is sparsemax in the literals ``(eta[:-1], 1 - eta[-1])``.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> sm.XorOutFactor(3).map(np.array([0.5, 0.7, -0.6]))
    array([0, 1, 1])
    """

    def __init__(self, n):
        self._set_n(n, 2, "at least one input and the output")

    def _constraint_error(self, s):
        K = self.n - 1
        k = int(s[:K].sum())
        if k > 1:
            return f"expected at most one of the first n - 1 variables on, {k} are"
        if s[K] != k:
            return "expected the last variable on exactly when one of the others is"

    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        cdef int K = self.n - 1, arg = _argmax(eta_u, K)
        _zero(out, self.n)
        if eta_u[arg] + eta_u[K] > 0:
            out[arg] = 1
            out[K] = 1
        return 0


cdef class ImplyFactor(_BinaryFactor):
    """ImplyFactor(n)

    The first ``n - 1`` binary variables, all on, imply the last.

    The configurations are those with ``AND(s[:-1]) <= s[-1]``: every one
    except "all of the first ``n - 1`` on and the last off". This is AD3's
    (and lp-sparsemap's) ``IMPLY`` factor, ``s[0] and ... and s[n - 2] =>
    s[n - 1]``: an :class:`OrFactor` over the literals ``1 - s[0], ...,
    1 - s[n - 2], s[n - 1]``. For ``n = 2`` it reads ``s[0] <= s[1]``.

    Parameters
    ----------
    n : int
        Number of variables, the ``n - 1`` premises and the conclusion (>= 2).

    Attributes
    ----------
    n : int

    Notes
    -----
    Scores: ``eta_u`` of shape ``(n,)``; no ``eta_v``. Compact form: the 0/1
    int vector ``s`` of length ``n`` with ``s[-1] >= min(s[:-1])``. MAP
    switches on every variable with a positive score; when that is the one
    forbidden configuration, it either switches the conclusion on or the
    worst premise off, whichever costs less (the premise on ties, the
    highest index among equal worst premises); O(n).

    SparseMAP is the Euclidean projection onto
    ``{u in [0, 1]^n : sum(1 - u[:-1]) + u[-1] >= 1}``.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> f = sm.ImplyFactor(3)
    >>> f.map(np.array([1.0, 2.0, -0.5]))   # both premises on: so is the last
    array([1, 1, 1])
    >>> f.map(np.array([0.4, 2.0, -0.5]))   # cheaper to drop a premise
    array([0, 1, 0])
    """

    def __init__(self, n):
        self._set_n(n, 2, "at least one premise and the conclusion")

    def _constraint_error(self, s):
        K = self.n - 1
        if s[K] < s[:K].min():
            return "expected the last variable on when all the others are"

    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        cdef int i, K = self.n - 1, worst = 0
        cdef bint all_on = True
        for i in range(K):
            out[i] = eta_u[i] > 0
            if not out[i]:
                all_on = False
            if eta_u[i] <= eta_u[worst]:
                worst = i        # the last of the smallest
        out[K] = eta_u[K] > 0
        if all_on and not out[K]:
            # forbidden: the conclusion on (eta_u[K] <= 0), or the worst premise off
            if -eta_u[worst] >= eta_u[K]:
                out[worst] = 0
            else:
                out[K] = 1
        return 0


cdef class SequenceBudgetFactor(_Budgeted):
    """SequenceBudgetFactor(n, budget, exact=False)

    Binary sequences of length ``n`` with at most (or exactly) ``budget`` positions on.

    A two-state chain (off/on) with transition scores, under a budget on the
    number of positions on.

    Parameters
    ----------
    n : int
        Sequence length (>= 1).
    budget : int
        Largest number of positions on (>= 0; ``n`` or more means no limit).
    exact : bool, default False
        Require exactly ``budget`` positions on (then ``budget <= n``).

    Attributes
    ----------
    n, budget : int
    exact : bool

    Raises
    ------
    ValueError
        Bad arguments, or a MAP table of ``n * (min(budget, n) + 1)`` bytes
        of 2**31 bytes or more.

    Notes
    -----
    Scores: ``eta_u`` of shape ``(n,)``, ``eta_u[i]`` scoring position ``i``
    on; ``eta_v`` of shape ``(n - 1, 2, 2)``, ``eta_v[i, a, b]`` scoring state
    ``a`` at ``i`` followed by state ``b`` at ``i + 1`` (as
    :class:`SequenceFactor` with 2 states; state 1 is "on"). Compact form: the
    0/1 int vector ``s`` of length ``n``; ``m_s = s`` and
    ``n_s[i, a, b] = 1`` where ``s[i] == a`` and ``s[i + 1] == b``.

    MAP is Viterbi with a count dimension, O(n * min(budget, n)) time and
    ``n * (min(budget, n) + 1)`` bytes of back-pointers. It runs from the end
    of the sequence to the start, so that the structure can be read off from
    the start and ties follow the rule of the other logic factors: fewest
    positions on, then the earliest ones.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> f = sm.SequenceBudgetFactor(5, 2)
    >>> eta_v = np.zeros((4, 2, 2))
    >>> eta_v[:, 1, 1] = 1.0                      # reward neighbours both on
    >>> f.map(np.array([0.5, 0.0, -0.3, 0.4, 0.4]), eta_v)
    array([0, 0, 0, 1, 1])
    """
    cdef int cap               # min(budget, n): the largest count the MAP tracks
    _counted = "positions"

    def __init__(self, n, budget, exact=False):
        _Budgeted.__init__(self, n, budget, exact)
        self.cap = min(self.budget, self.n)
        cdef Py_ssize_t rows = self.cap + 1
        if self.n * rows >= _MAX_TABLE:
            raise ValueError(f"n, budget: the MAP table of n * (min(budget, n) + 1) = "
                             f"{self.n * rows} bytes must stay below 2**31")
        # two rows of 2 (cap + 1) doubles, then n (cap + 1) bytes of back-pointers
        self._set_shapes((self.n,), (self.n - 1, 2, 2), self.n,
                         2 * 2 * 8 * rows + self.n * rows + 16)

    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        # best[r, x] (row i): best score of positions i..n-1 given s[i] = x and r
        # positions on among them. Cell (i, r, x) is feasible iff x <= r and
        # r - x <= n - 1 - i; only feasible cells are read, so no sentinel values
        # (which masked -inf scores could not be told apart from) are needed.
        cdef int n = self.n, C = self.cap, R = self.cap + 1
        cdef double* nxt = <double*> work
        cdef double* cur = nxt + 2 * R
        cdef double* tmp
        cdef unsigned char* back = <unsigned char*> (cur + 2 * R)
        cdef int i, r, x, y, rr, top, best_r, best_x
        cdef double val, v0, v1, best
        cdef bint ok0, ok1, have
        # row n - 1: r == x
        nxt[0] = 0.0
        if C >= 1:
            nxt[2 + 1] = eta_u[n - 1]
        for i in range(n - 2, -1, -1):
            top = n - i if n - i < C else C
            for r in range(top + 1):
                back[i * R + r] = 0
                for x in range(2):
                    if x > r or r - x > n - 1 - i:
                        continue
                    rr = r - x              # positions on among i+1..n-1
                    ok0 = rr <= n - 2 - i
                    ok1 = rr >= 1
                    v0 = v1 = 0.0
                    if ok0:
                        v0 = nxt[2 * rr] + (eta_v[(i * 2 + x) * 2] if eta_v != NULL else 0.0)
                    if ok1:
                        v1 = nxt[2 * rr + 1] + (eta_v[(i * 2 + x) * 2 + 1]
                                                if eta_v != NULL else 0.0)
                    if ok1 and (not ok0 or v1 >= v0):     # on, on ties
                        y = 1
                        val = v1
                    else:
                        y = 0
                        val = v0
                    if x:
                        val += eta_u[i]
                    cur[2 * r + x] = val
                    back[i * R + r] |= <unsigned char> (y << x)
            tmp = nxt
            nxt = cur
            cur = tmp
        # nxt is row 0: the fewest positions on, then s[0] on, among the best
        have = False
        best = 0.0
        best_r = best_x = 0
        for r in range(C + 1):
            if self.exact and r != self.budget:
                continue
            for x in range(1, -1, -1):
                if x > r or r - x > n - 1:
                    continue
                if not have or nxt[2 * r + x] > best:
                    have = True
                    best = nxt[2 * r + x]
                    best_r = r
                    best_x = x
        r = best_r
        x = best_x
        for i in range(n - 1):
            out[i] = x
            y = (back[i * R + r] >> x) & 1
            r -= x
            x = y
        out[n - 1] = x
        return 0

    cdef int c_score(self, const int* s, const double* eta_u, const double* eta_v,
                     double* out) except -1 nogil:
        cdef int i
        _BinaryFactor.c_score(self, s, eta_u, eta_v, out)
        if eta_v != NULL:
            for i in range(self.n - 1):
                out[0] += eta_v[(i * 2 + s[i]) * 2 + s[i + 1]]
        return 0

    cdef int c_add(self, const int* s, double w, double* u, double* v) except -1 nogil:
        cdef int i
        _BinaryFactor.c_add(self, s, w, u, v)
        if v != NULL:
            for i in range(self.n - 1):
                v[(i * 2 + s[i]) * 2 + s[i + 1]] += w
        return 0


# -- the relaxed knapsack polytope ---------------------------------------------------------

cdef struct _Item:
    double key
    int idx


cdef int _by_key(const void* a, const void* b) noexcept nogil:
    """qsort order of items: larger key first, then lower index."""
    cdef const _Item* x = <const _Item*> a
    cdef const _Item* y = <const _Item*> b
    if x.key > y.key:
        return -1
    if x.key < y.key:
        return 1
    return (x.idx > y.idx) - (x.idx < y.idx)


# In the compact form of a knapsack vertex, the code of the fractional entry.
cdef int FRACTIONAL = 2


cdef class KnapsackFactor(Factor):
    """KnapsackFactor(costs, budget)

    The relaxed knapsack polytope ``{u in [0, 1]^n : costs @ u <= budget}``.

    AD3's (and lp-sparsemap's) ``KNAPSACK`` factor. Unlike the other logic
    factors, its polytope is not the convex hull of 0/1 configurations: a
    vertex has every entry at 0 or 1 except at most one, which fills what is
    left of the budget. MAP over it is a linear program, solved by the
    fractional-knapsack greedy.

    Parameters
    ----------
    costs : array_like of float, shape (n,)
        Non-negative cost of each variable (n >= 1). A variable of cost 0 is
        free: only the box ``[0, 1]`` limits it.
    budget : float
        Non-negative budget.

    Attributes
    ----------
    n : int
    costs : ndarray of float64, shape (n,)
        A read-only copy.
    budget : float

    Notes
    -----
    Scores: ``eta_u`` of shape ``(n,)``; no ``eta_v``.

    Compact form: the vertex itself, a float64 array ``s`` of shape ``(n,)``
    with ``m_s = s``: entries 0 or 1 where ``costs . s <= budget`` holds, or
    additionally one entry ``j`` in ``(0, 1)`` equal to
    ``(budget - costs . [s == 1]) / costs[j]``, which makes the budget tight.
    Sums of costs are compared with the budget up to round-off,
    ``4 n eps (budget + sum(costs))``: a fraction that close to 0 or 1 is
    that 0/1 vertex.
    Methods that take a structure also accept an entry ``2`` in place of the
    fractional value (they compute it); a fractional value given by hand must
    match it to 1e-9. ``score``, ``overlap`` and ``add_column`` are O(n).
    A budget of ``sum(costs)`` or more leaves the box ``[0, 1]^n``.

    MAP is the fractional-knapsack greedy, O(n log n): among the variables
    with a positive score, in decreasing order of ``score / cost`` (free
    variables first, the lowest index on ties), switch each on while it fits,
    and the first that does not fit takes the rest of the budget.

    SparseMAP is the Euclidean projection of ``eta_u`` onto the polytope,
    ``clip(eta_u - tau * costs, 0, 1)`` with the smallest ``tau >= 0`` that
    meets the budget.

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> f = sm.KnapsackFactor([1.0, 2.0, 2.0], 2.5)
    >>> f.map(np.array([1.0, 3.0, 1.0]))       # ratios 1, 1.5, 0.5
    array([0.5, 1. , 0. ])
    >>> f.vertex([1, 0, 2])[0]          # 2: compute the fractional entry
    array([1.  , 0.  , 0.75])
    >>> # SparseMAP here is clip(1 - tau costs, 0, 1):
    >>> print(np.round(sm.solve(f, np.array([1.0, 1.0, 1.0])).u, 6))
    [0.722222 0.444444 0.444444]
    """
    cdef readonly int n
    cdef readonly double budget
    cdef object _costs
    cdef const double* c
    cdef double slack

    def __init__(self, costs, budget):
        arr = _real_array(costs, "costs")
        if arr.ndim != 1 or arr.shape[0] == 0:
            raise ValueError(f"costs: expected a non-empty 1-d array of non-negative floats, "
                             f"got shape {arr.shape}")
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise ValueError(f"costs: expected finite non-negative values, got "
                             f"{_show(arr)}")
        arr = np.array(arr, dtype=np.float64)   # our own copy
        arr.setflags(write=False)
        self.budget = check_real(budget, "budget")
        self._costs = arr
        cdef const double[::1] cv = arr
        self.c = &cv[0]
        self.n = arr.shape[0]
        self.slack = 4 * DBL_EPSILON * self.n * (self.budget + math.fsum(arr))
        self._set_shapes((self.n,), (0,), self.n, self.n * sizeof(_Item))

    @property
    def costs(self):
        return self._costs

    def _init_args(self):
        return (self._costs, self.budget)

    def __repr__(self):
        costs = self._costs.tolist() if self.n <= 8 else f"<{self.n} array>"
        return f"KnapsackFactor({costs}, {self.budget!r})"

    # -- compact form: codes 0, 1 and FRACTIONAL ------------------------------------------
    cdef double _fraction(self, const int* s, int* j) noexcept nogil:
        """Value of the fractional entry of s (written to j[0], -1 if none; then 0)."""
        cdef int i
        cdef double spent = 0.0, x
        j[0] = -1
        for i in range(self.n):
            if s[i] == 1:
                spent += self.c[i]
            elif s[i] == FRACTIONAL:
                j[0] = i
        if j[0] < 0:
            return 0.0
        x = (self.budget - spent) / self.c[j[0]]
        return 0.0 if x < 0.0 else (1.0 if x > 1.0 else x)

    def _fraction_of(self, s):
        """(j, value) of the fractional entry of an intc code array (j = -1: none)."""
        cdef const int[::1] sv = np.ascontiguousarray(s, dtype=np.intc)
        cdef int j
        cdef double x = self._fraction(&sv[0], &j)
        return j, x

    def _to_public(self, s):
        j, x = self._fraction_of(s)
        out = (np.asarray(s) == 1).astype(np.float64)
        if j >= 0:
            out[j] = x
        return out

    def _from_dense(self, m, n):
        return m

    def check_structure(self, s, name="s"):
        """Validate a vertex and return its codes (0, 1 or 2 = fractional) as a C int array.

        Parameters
        ----------
        s : array_like of float, shape (n,)
            A vertex of the polytope (see the class docstring); an entry 2
            stands for the fractional entry, whose value is then computed.
        name : str
            Argument name used in error messages.

        Returns
        -------
        ndarray of intc, shape (n,)

        Raises
        ------
        ValueError
            Wrong shape, entries outside ``[0, 1]`` (other than 2), more than
            one fractional entry, or a point that is not a vertex of the
            polytope.
        """
        arr = _typed_array(s, name, None, "biuf", "a vertex (numbers in [0, 1])")
        arr = arr.reshape(-1) if arr.ndim == 0 else arr
        if arr.shape != (self.n,):
            raise ValueError(f"{name}: expected shape {(self.n,)}, got {arr.shape}")
        a = arr.astype(np.float64)
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{name}: contains non-finite values (nan or inf)")
        frac = ((a > 0) & (a < 1)) | (a == FRACTIONAL)
        if np.any(~((a == 0) | (a == 1) | frac)):
            raise ValueError(f"{name}: expected entries in [0, 1] (or 2 for the fractional "
                             f"entry), got {_show(a)}")
        codes = (a == 1).astype(np.intc)
        codes[frac] = FRACTIONAL
        self._validate_structure(codes, name)
        j = np.flatnonzero(frac)
        if j.size and a[j[0]] != FRACTIONAL:
            _, x = self._fraction_of(codes)
            if abs(a[j[0]] - x) > 1e-9:
                raise ValueError(f"{name}: not a vertex: entry {int(j[0])} is {float(a[j[0]])!r}, where "
                                 f"the budget left by the entries at 1 gives {x!r}")
        return codes

    def _validate_structure(self, s, name):
        frac = np.flatnonzero(s == FRACTIONAL)
        if frac.size > 1:
            raise ValueError(f"{name}: not a vertex: {frac.size} fractional entries (at most one)")
        spent = 0.0
        for i in np.flatnonzero(s == 1):   # the order of _fraction, for the same round-off
            spent += float(self._costs[i])
        if frac.size == 0:
            if spent > self.budget + self.slack:
                raise ValueError(f"{name}: costs . s = {spent!r} exceeds budget={self.budget!r}")
            return
        j = int(frac[0])
        left = self.budget - spent
        if not (self.slack < left < self._costs[j] - self.slack):
            raise ValueError(f"{name}: not a vertex: a fractional entry {j} needs 0 < budget - "
                             f"costs . [s == 1] < costs[{j}] (beyond round-off), got {left!r} "
                             f"and costs[{j}] = {float(self._costs[j])!r}")

    # -- the C interface ------------------------------------------------------------------
    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        cdef _Item* items = <_Item*> work
        cdef int i, k, m = 0, j = -1
        cdef double left = self.budget, x
        for i in range(self.n):
            out[i] = 0
            if eta_u[i] > 0:
                items[m].key = eta_u[i] / self.c[i] if self.c[i] > 0 else INFINITY
                items[m].idx = i
                m += 1
        qsort(items, m, sizeof(_Item), _by_key)
        for k in range(m):
            i = items[k].idx
            if self.c[i] <= left + self.slack:
                out[i] = 1
                left -= self.c[i]
            else:
                if left > 0:
                    j = i
                break
        if j >= 0:
            # the budget left, summed in index order as the other methods do; a
            # fraction within round-off of 0 or 1 is that (a 0/1 vertex)
            out[j] = FRACTIONAL
            x = self.budget
            for i in range(self.n):
                if out[i] == 1:
                    x -= self.c[i]
            if not (x > self.slack):
                out[j] = 0
            elif x >= self.c[j] - self.slack:
                out[j] = 1
        return 0

    cdef int c_score(self, const int* s, const double* eta_u, const double* eta_v,
                     double* out) except -1 nogil:
        cdef int i, j
        cdef double acc = 0.0, x = self._fraction(s, &j)
        for i in range(self.n):
            if s[i] == 1:
                acc += eta_u[i]
        if j >= 0 and x > 0.0:      # 0 * -inf would be nan
            acc += x * eta_u[j]
        out[0] = acc
        return 0

    cdef int c_overlap(self, const int* s, const int* t, double* out) except -1 nogil:
        cdef int i, js, jt, k = 0
        cdef double xs = self._fraction(s, &js), xt = self._fraction(t, &jt), acc
        for i in range(self.n):
            k += (s[i] == 1) & (t[i] == 1)
        acc = k
        if js >= 0:
            if t[js] == 1:
                acc += xs
            elif js == jt:
                acc += xs * xt
        if jt >= 0 and s[jt] == 1:
            acc += xt
        out[0] = acc
        return 0

    cdef int c_add(self, const int* s, double w, double* u, double* v) except -1 nogil:
        cdef int i, j
        cdef double x
        if u == NULL:
            return 0
        for i in range(self.n):
            if s[i] == 1:
                u[i] += w
        x = self._fraction(s, &j)
        if j >= 0:
            u[j] += w * x
        return 0
