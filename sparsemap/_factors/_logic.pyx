"""Logic factors over binary variables, and the budgeted binary sequence.

Every factor here has ``n`` binary variables scored by ``eta_u`` of shape
``(n,)``; a structure is an allowed configuration, in compact form the 0/1 int
vector ``s`` of length ``n``, and its unary column is ``m_s = s``. The factors
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

import numpy as np

from sparsemap._factors._base cimport Factor
from sparsemap._factors._base import check_bool, check_positive_int

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
