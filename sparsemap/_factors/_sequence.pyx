"""Sequence tagging factor: first-order chain, MAP by Viterbi in O(n m^2)."""
import numpy as np

from libc.math cimport INFINITY

from sparsemap._factors._base cimport Factor
from sparsemap._factors._base import check_positive_int


cdef class SequenceFactor(Factor):
    """SequenceFactor(n_positions, n_states)

    Tag sequences of length ``n_positions`` over ``n_states`` tags.

    A structure is a tag sequence ``tags`` (int array of shape ``(n,)``, values
    in ``[0, n_states)``). Its column has ``m_s[i, t] = 1`` where ``tags[i] == t``
    and ``n_s[i, a, b] = 1`` where ``tags[i] == a`` and ``tags[i + 1] == b``.

    Parameters
    ----------
    n_positions : int
        Sequence length ``n`` (>= 1).
    n_states : int
        Number of tags ``m`` (>= 1).

    Notes
    -----
    Scores: ``eta_u`` of shape ``(n, m)``; ``eta_v`` of shape ``(n - 1, m, m)``,
    ``eta_v[i, a, b]`` scoring tag ``a`` at ``i`` followed by ``b`` at ``i + 1``.
    MAP is Viterbi, O(n m^2); ``score``, ``overlap`` and ``add_column`` are O(n).
    Ties are broken towards the lowest tag index at each backtracking step.
    A ``-inf`` score forbids a tag at a position (in ``eta_u``) or a
    transition (in ``eta_v``, e.g. BIO constraints); Viterbi needs no change
    for that, since it only adds and compares scores.

    Examples
    --------
    Three positions, two tags; the transition from tag 0 to tag 1 costs 1:

    >>> import numpy as np, sparsemap as sm
    >>> f = sm.SequenceFactor(3, 2)
    >>> eta_u = np.array([[1.0, 0.0], [0.0, 0.5], [1.0, 0.0]])
    >>> eta_v = np.zeros(f.shape_v)
    >>> eta_v[:, 0, 1] = -1.0
    >>> f.map(eta_u, eta_v)              # Viterbi
    array([0, 0, 0])
    >>> r = sm.solve(f, eta_u, eta_v)
    >>> for s, w in zip(r.structures, r.weights):
    ...     print(s.tolist(), round(float(w), 3))
    [0, 0, 0] 0.625
    [1, 1, 0] 0.375
    >>> print(np.round(r.u, 3))          # tag posteriors, one row per position
    [[0.625 0.375]
     [0.625 0.375]
     [1.    0.   ]]
    """
    cdef readonly int n_positions
    cdef readonly int n_states

    def __init__(self, n_positions, n_states):
        n = check_positive_int(n_positions, "n_positions")
        m = check_positive_int(n_states, "n_states")
        self.n_positions = n
        self.n_states = m
        # work: two score rows (doubles) and the backpointers (ints)
        self._set_shapes((n, m), (n - 1, m, m), n, 16 * m + 4 * n * m + 16)

    def _init_args(self):
        return (self.n_positions, self.n_states)

    cdef int c_valid(self, const int* s) except -1 nogil:
        cdef Py_ssize_t i
        for i in range(self.n_positions):
            if s[i] < 0 or s[i] >= self.n_states:
                return 0
        return 1

    def _validate_structure(self, s, name):
        if np.any(s < 0) or np.any(s >= self.n_states):
            raise ValueError(f"{name}: tags must lie in [0, {self.n_states}), got {s!r}")

    def _from_dense(self, m, n):
        return m.argmax(axis=1)   # the tag of each position

    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        cdef int n = self.n_positions, m = self.n_states
        cdef double* prev = <double*> work
        cdef double* cur = prev + m
        cdef int* back = <int*> (cur + m)
        cdef double* tmp
        cdef double best, val
        cdef int i, a, b, arg
        for b in range(m):
            prev[b] = eta_u[b]
        for i in range(1, n):
            for b in range(m):
                arg = 0
                best = prev[0] + eta_v[((i - 1) * m + 0) * m + b]
                for a in range(1, m):
                    val = prev[a] + eta_v[((i - 1) * m + a) * m + b]
                    if val > best:
                        best = val
                        arg = a
                cur[b] = best + eta_u[i * m + b]
                back[i * m + b] = arg
            tmp = prev
            prev = cur
            cur = tmp
        arg = 0
        for b in range(1, m):
            if prev[b] > prev[arg]:
                arg = b
        if prev[arg] == -INFINITY:
            return 1    # every tag sequence uses a forbidden tag or transition
        out[n - 1] = arg
        for i in range(n - 1, 0, -1):
            out[i - 1] = back[i * m + out[i]]
        return 0

    cdef int c_score(self, const int* s, const double* eta_u, const double* eta_v,
                     double* out) except -1 nogil:
        cdef int n = self.n_positions, m = self.n_states, i
        cdef double acc = 0
        for i in range(n):
            acc += eta_u[i * m + s[i]]
        if eta_v != NULL:
            for i in range(n - 1):
                acc += eta_v[(i * m + s[i]) * m + s[i + 1]]
        out[0] = acc
        return 0

    cdef int c_overlap(self, const int* s, const int* t, double* out) except -1 nogil:
        cdef int i, k = 0
        for i in range(self.n_positions):
            if s[i] == t[i]:
                k += 1
        out[0] = k
        return 0

    cdef int c_add(self, const int* s, double w, double* u, double* v) except -1 nogil:
        cdef int n = self.n_positions, m = self.n_states, i
        if u != NULL:
            for i in range(n):
                u[i * m + s[i]] += w
        if v != NULL:
            for i in range(n - 1):
                v[(i * m + s[i]) * m + s[i + 1]] += w
        return 0
