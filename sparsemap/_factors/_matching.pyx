# cython: boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Bipartite matching factor: MAP is the rectangular linear assignment problem.

MAP uses the shortest augmenting path method of Jonker and Volgenant in the
rectangular form of Crouse (2016), *On implementing 2D rectangular assignment
algorithms* (IEEE Trans. Aerospace and Electronic Systems 52(4)), the method
behind ``scipy.optimize.linear_sum_assignment``, written here in typed Cython
without the GIL and without allocation (scratch lives in the caller's buffer).
"""
import numpy as np

from libc.float cimport DBL_MAX
from libc.math cimport INFINITY, fabs, frexp, ldexp
from libc.stdlib cimport calloc, free

from sparsemap._factors._base cimport Factor
from sparsemap._factors._base import check_positive_int


cdef class MatchingFactor(Factor):
    """MatchingFactor(n_rows, n_cols)

    Matchings of ``min(n_rows, n_cols)`` pairs in a complete bipartite graph.

    A structure pairs rows with columns, each row and each column at most once,
    with exactly ``min(n_rows, n_cols)`` pairs (a permutation when the matrix is
    square). Its compact form is an int array ``s`` of shape ``(n_rows,)``:
    ``s[i]`` is the column matched to row ``i``, or ``-1`` when row ``i`` is
    unmatched (only possible when ``n_rows > n_cols``). Its column ``m_s`` is the
    0/1 matrix with ones at ``(i, s[i])``; there is no ``n_s``.

    Parameters
    ----------
    n_rows : int
        Number of rows (>= 1).
    n_cols : int
        Number of columns (>= 1).

    Attributes
    ----------
    n_rows, n_cols : int
        The sizes given at construction (read-only).

    Notes
    -----
    Scores: ``eta_u`` of shape ``(n_rows, n_cols)``, ``eta_u[i, j]`` scoring the
    pair ``(i, j)``; no ``eta_v`` (``shape_v == (0,)``).

    MAP solves the maximum-weight assignment of ``min(n_rows, n_cols)`` pairs by
    shortest augmenting paths (Jonker-Volgenant, in Crouse's rectangular form):
    O(k^2 K) in the worst case with ``k = min(n_rows, n_cols)`` and
    ``K = max(n_rows, n_cols)``. Tall matrices are handled as their transpose by
    index arithmetic, without copying. Scores so large that the dual variables
    could overflow are scaled by an exact power of two first, which leaves the
    optimal matching unchanged.

    A ``-inf`` score forbids a pair: the augmenting paths then run over the
    allowed pairs only (a forbidden pair's reduced cost is ``+inf``, never
    reached while a finite path exists, so no ``inf - inf`` arises), and no
    finite path left means that no matching avoids the forbidden pairs.

    Ties are broken deterministically; in particular, constant scores give the
    diagonal matching ``s[i] = i`` for ``i < min(n_rows, n_cols)`` (and ``-1``
    for the remaining rows). ``score``, ``overlap`` and ``add_column`` are
    O(n_rows).

    Examples
    --------
    >>> import numpy as np, sparsemap as sm
    >>> f = sm.MatchingFactor(2, 3)
    >>> f.map(np.array([[1.0, 5.0, 0.0], [0.0, 4.0, 3.0]]))
    array([1, 2])
    """
    cdef readonly int n_rows
    cdef readonly int n_cols

    def __init__(self, n_rows, n_cols):
        nr = check_positive_int(n_rows, "n_rows")
        nc = check_positive_int(n_cols, "n_cols")
        if nr * nc >= 2 ** 31:
            raise ValueError(f"n_rows, n_cols: n_rows * n_cols must be below 2**31, "
                             f"got {nr} * {nc}")
        self.n_rows = nr
        self.n_cols = nc
        k, K = min(nr, nc), max(nr, nc)
        # work (see c_map): doubles u[k], v[K], dist[K]; ints path[K], col4row[k],
        # row4col[K], remaining[K]
        work = 8 * (k + 2 * K) + 4 * (k + 3 * K) + 16
        self._set_shapes((nr, nc), (0,), nr, work)

    def _init_args(self):
        return (self.n_rows, self.n_cols)

    cdef int c_valid(self, const int* s) except -1 nogil:
        cdef Py_ssize_t i, matched = 0
        cdef int ok = 1
        cdef char* used = <char*> calloc(self.n_cols + 1, 1)
        if used == NULL:
            with gil:
                raise MemoryError()
        for i in range(self.n_rows):
            if s[i] < -1 or s[i] >= self.n_cols or (s[i] >= 0 and used[s[i]]):
                ok = 0
                break
            if s[i] >= 0:
                used[s[i]] = 1
                matched += 1
        free(used)
        return ok and matched == min(self.n_rows, self.n_cols)

    def _validate_structure(self, s, name):
        k = min(self.n_rows, self.n_cols)
        if np.any(s < -1) or np.any(s >= self.n_cols):
            raise ValueError(f"{name}: expected columns in [0, {self.n_cols}) or -1 for an "
                             f"unmatched row, got {s!r}")
        matched = s[s >= 0]
        if matched.shape[0] != k:
            raise ValueError(f"{name}: expected exactly {k} matched rows "
                             f"(min(n_rows, n_cols)), got {matched.shape[0]} in {s!r}")
        if np.unique(matched).shape[0] != k:
            raise ValueError(f"{name}: a column is matched to more than one row in {s!r}")

    def _from_dense(self, m, n):
        # the column of each row's 1, -1 for an empty row
        return np.where(m.any(axis=1), m.argmax(axis=1), -1)

    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        # Logical problem: k rows, K >= k columns, minimise cost(i, j) =
        # neg * eta_u[i * rs + j * cs]. For a tall matrix the logical rows are the
        # original columns (rs = 1, cs = n_cols): the transpose, by strides only.
        cdef Py_ssize_t k, K, rs, cs
        cdef bint tall = self.n_rows > self.n_cols
        if tall:
            k = self.n_cols
            K = self.n_rows
            rs = 1
            cs = self.n_cols
        else:
            k = self.n_rows
            K = self.n_cols
            rs = self.n_cols
            cs = 1

        cdef double* u = <double*> work          # row duals
        cdef double* v = u + k                   # column duals (always <= 0)
        cdef double* dist = v + K                # shortest path costs to each column
        cdef int* path = <int*> (dist + K)       # predecessor row of each column
        cdef int* col4row = path + K
        cdef int* row4col = col4row + k
        # remaining[:n_rem]: columns not yet reached; remaining[n_rem:]: the
        # columns reached so far in this search (their rows, row4col, too)
        cdef int* remaining = row4col + K

        cdef Py_ssize_t i, j, it, idx, n_rem, cur, sink, tmp, e
        cdef const double* row
        cdef double d, h, lowest, min_val, maxabs, neg
        cdef int expo

        # Dual values and path lengths are sums of O(k + K) scores; scale huge
        # scores by an exact power of two so these sums cannot overflow.
        maxabs = 0.0
        for e in range(k * K):
            d = fabs(eta_u[e])
            if d > maxabs and d != INFINITY:   # -inf: a forbidden pair
                maxabs = d
        neg = -1.0
        d = DBL_MAX / (64.0 * <double> (k + K + 2))
        if maxabs > d:
            frexp(maxabs / d, &expo)
            neg = -ldexp(1.0, -expo)

        for i in range(k):
            u[i] = 0.0
            col4row[i] = -1
        for j in range(K):
            v[j] = 0.0
            row4col[j] = -1

        for cur in range(k):
            # Shortest augmenting path from row cur, Dijkstra on reduced costs.
            # Columns are scanned in reverse order so that, among equal
            # distances, free columns with low index win (constant scores give
            # the diagonal matching, as in SciPy).
            for j in range(K):
                remaining[j] = <int> (K - 1 - j)
                dist[j] = INFINITY
            min_val = 0.0
            n_rem = K
            sink = -1
            i = cur
            while sink < 0:
                row = eta_u + i * rs
                h = min_val - u[i]
                # the stride is a literal in the common (wide or square) case
                if cs == 1:
                    idx = _scan(row, 1, h, neg, <int> i, n_rem, remaining, v, dist, path,
                                row4col, &lowest)
                else:
                    idx = _scan(row, cs, h, neg, <int> i, n_rem, remaining, v, dist, path,
                                row4col, &lowest)
                if idx < 0 or lowest == INFINITY:
                    # Only forbidden pairs (-inf) reach the columns left: no
                    # matching avoids them. Otherwise every path followed is
                    # finite, so duals and reduced costs stay finite (no inf - inf).
                    return 1
                min_val = lowest
                j = remaining[idx]
                if row4col[j] < 0:
                    sink = j
                else:
                    i = row4col[j]
                n_rem -= 1
                remaining[idx] = remaining[n_rem]
                remaining[n_rem] = <int> j

            # Dual update keeps reduced costs >= 0 and zero on the matching. The
            # rows reached besides cur are those matched to reached columns.
            u[cur] += min_val
            for it in range(n_rem, K):
                j = remaining[it]
                d = min_val - dist[j]
                v[j] -= d
                i = row4col[j]
                if i >= 0:
                    u[i] += d

            # Augment along the path back to row cur.
            j = sink
            while True:
                i = path[j]
                row4col[j] = <int> i
                tmp = col4row[i]
                col4row[i] = <int> j
                j = tmp
                if i == cur:
                    break

        if tall:
            # logical columns are the original rows
            for j in range(K):
                out[j] = row4col[j]
        else:
            for i in range(k):
                out[i] = col4row[i]
        return 0

    cdef int c_score(self, const int* s, const double* eta_u, const double* eta_v,
                     double* out) except -1 nogil:
        cdef Py_ssize_t i, nc = self.n_cols
        cdef double acc = 0.0
        for i in range(self.n_rows):
            if s[i] >= 0:
                acc += eta_u[i * nc + s[i]]
        out[0] = acc
        return 0

    cdef int c_overlap(self, const int* s, const int* t, double* out) except -1 nogil:
        cdef Py_ssize_t i, n = 0
        for i in range(self.n_rows):
            if s[i] >= 0 and s[i] == t[i]:
                n += 1
        out[0] = <double> n
        return 0

    cdef int c_add(self, const int* s, double w, double* u, double* v) except -1 nogil:
        cdef Py_ssize_t i, nc = self.n_cols
        if u != NULL:
            for i in range(self.n_rows):
                if s[i] >= 0:
                    u[i * nc + s[i]] += w
        return 0


cdef inline Py_ssize_t _scan(const double* row, Py_ssize_t cs, double h, double neg, int i,
                             Py_ssize_t n_rem, const int* remaining, const double* v,
                             double* dist, int* path, const int* row4col,
                             double* lowest_out) noexcept nogil:
    """One Dijkstra step: relax the edges of row ``i`` to the remaining columns and
    return the position in ``remaining`` of the closest column (free columns win
    ties), or -1 if none is finite."""
    cdef Py_ssize_t it, j, idx = -1
    cdef double r, d, lowest = INFINITY
    for it in range(n_rem):
        j = remaining[it]
        r = h + neg * row[j * cs] - v[j]
        d = dist[j]
        if r < d:
            path[j] = i
            dist[j] = r
            d = r
        if d < lowest or (d == lowest and row4col[j] < 0):
            lowest = d
            idx = it
    lowest_out[0] = lowest
    return idx
