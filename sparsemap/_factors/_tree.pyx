"""Dependency-tree factor: arborescences over ``n`` words rooted at node 0.

MAP is Chu-Liu-Edmonds in Tarjan's O(n^2) dense form (non-projective) or
Eisner's O(n^3) dynamic program (projective), each with an exact single-root
variant.
"""
import numpy as np

from libc.math cimport INFINITY
from libc.stdlib cimport free, malloc

from sparsemap._factors._base cimport Factor
from sparsemap._factors._base import check_bool, check_positive_int

# Slot states in the Chu-Liu-Edmonds contraction.
cdef enum:
    DEAD = 0        # slot no longer holds a supernode (merged into another slot)
    UNVISITED = 1   # best in-arc not chosen yet
    ONPATH = 2      # on the path being grown
    DONE = 3        # connected to the root; in-arc final at this level
    # (n + 1)^2 matrix offsets must fit in a C int.
    MAX_WORDS = 46339


cdef class TreeFactor(Factor):
    """TreeFactor(n_words, projective=False, single_root=False)

    Dependency trees (arborescences) over ``n_words`` words, rooted at node 0.

    A structure is a head array ``heads`` (int array of shape ``(n + 1,)``)
    with ``heads[0] == -1`` and ``heads[m]`` in ``[0, n]`` the head of word
    ``m``; following heads from any word reaches the root 0. Its column is the
    ``(n + 1, n + 1)`` 0/1 arc matrix ``m_s[h, m] = 1`` iff ``heads[m] == h``
    (column 0 and the diagonal are always zero). There are no ``eta_v``.

    Parameters
    ----------
    n_words : int
        Number of words ``n`` (>= 1).
    projective : bool, default False
        Restrict to projective trees (no crossing arcs, the root being at
        position 0 to the left of every word).
    single_root : bool, default False
        Restrict to trees in which the root has exactly one child.

    Attributes
    ----------
    n_words : int
    projective : bool
    single_root : bool

    Notes
    -----
    Scores: ``eta_u`` of shape ``(n + 1, n + 1)``, ``eta_u[h, m]`` scoring the
    arc ``h -> m``; column 0 and the diagonal are ignored and accept any value
    (``-inf``, nan). ``-inf`` elsewhere forbids an arc; no tree returned uses
    one (see "Masks" in the solvers documentation).

    MAP:

    * non-projective: maximum spanning arborescence by Chu-Liu-Edmonds in
      Tarjan's (1977) dense form, O(n^2) time and memory. Greedy in-arcs are
      chosen along a growing path; a cycle ``C`` is contracted by merging the
      in-arc score rows of its members (each reduced by the in-arc that member
      gives up) into one row, ``O(n |C|)``, the columns staying indexed by the
      head word. There are fewer than n contractions with fewer than 2n
      members in all, so contracting costs O(n^2); the tree is recovered by
      expanding the contraction forest in O(n).
    * non-projective, ``single_root=True``: exact, still O(n^2). It is
      Chu-Liu-Edmonds with lexicographic arc weights ``(-[h == 0],
      eta_u[h, m])``, whose best tree has the fewest root arcs (one) and,
      among those, the highest score. Since the root never lies on a cycle,
      the reduced root-arc counts stay -1 for root arcs and 0 otherwise, so
      this amounts to contracting over the words alone until one supernode
      holds them all, then attaching it to the root by its best reduced root
      arc. No penalty constant is involved, so no precision is lost.
    * projective: Eisner's algorithm, O(n^3) time, O(n^2) memory.
    * projective, ``single_root=True``: Eisner over the words ``1..n``, then
      the root attaches the best single word ``m`` whose left and right
      complete spans cover the sentence, O(n^3).

    Forbidden arcs need no penalty constant. Eisner's recursions only add
    and compare. Chu-Liu-Edmonds subtracts in-arc scores, which stay finite
    as long as an allowed arc enters every (super)node; one that none enters
    proves that every tree uses a forbidden arc. With ``single_root=True``, a
    word with no allowed word head takes the root early, and a result with
    more than one root child proves that no single-root tree is allowed.

    Ties are broken deterministically: in the non-projective case every
    (super)node takes the lowest-numbered head word among its best in-arcs;
    in Eisner's algorithm the lowest split point wins, and with
    ``single_root=True`` the lowest-numbered root child. ``score``,
    ``overlap`` and ``add_column`` are O(n). ``n_words`` is at most 46339 so
    that offsets into the ``(n + 1)^2`` score matrix fit in a C int (the
    O(n^2) scratch space would be tens of gigabytes long before that).

    Examples
    --------
    "she eats fish": word 2 heads the other two, or word 1 heads word 3:

    >>> import numpy as np, sparsemap as sm
    >>> f = sm.TreeFactor(3)
    >>> eta = np.zeros((4, 4))           # eta[h, m]: arc from head h to word m
    >>> eta[0, 2] = eta[2, 1] = eta[2, 3] = 2.0
    >>> eta[1, 3] = 1.8
    >>> f.map(eta)                       # heads[m] is the head of word m
    array([-1,  2,  0,  2])
    >>> r = sm.solve(f, eta)
    >>> for s, w in zip(r.structures, r.weights):
    ...     print(s.tolist(), round(float(w), 3))
    [-1, 2, 0, 2] 0.6
    [-1, 2, 0, 1] 0.4
    >>> print(np.round(r.u[:, 3], 3))    # the heads of word 3
    [0.  0.4 0.6 0. ]
    """
    cdef readonly int n_words
    cdef readonly bint projective
    cdef readonly bint single_root

    def __init__(self, n_words, projective=False, single_root=False):
        n = check_positive_int(n_words, "n_words")
        if n > MAX_WORDS:
            raise ValueError(f"n_words: expected at most {MAX_WORDS}, got {n}")
        self.n_words = n
        self.projective = check_bool(projective, "projective")
        self.single_root = check_bool(single_root, "single_root")
        cdef Py_ssize_t N = n + 1, nb
        if self.projective:
            # 3 tables of doubles and a backtracking stack
            nb = 8 * 3 * N * N + 4 * 3 * (6 * N + 8)
        else:
            # see _cle: T (doubles) and M (ints) are N x N, in_score is 2N
            # doubles, then 9 int arrays per supernode id (2N each) and 5 per
            # slot (N each)
            nb = 8 * N * N + 4 * N * N + 8 * 2 * N + 4 * (9 * 2 * N + 5 * N) + 64
        self._set_shapes((N, N), (0,), N, nb)

    def _init_args(self):
        return (self.n_words,)

    def _init_kwargs(self):
        return {"projective": bool(self.projective), "single_root": bool(self.single_root)}

    cdef int c_valid(self, const int* s) except -1 nogil:
        cdef int word, value, code
        cdef int* work = <int*> malloc(8 * (self.n_words + 2) * sizeof(int))
        if work == NULL:
            with gil:
                raise MemoryError()
        code = _tree_check(s, self.n_words, self.projective, self.single_root, work,
                           &word, &value)
        free(work)
        return code == TREE_OK

    def _validate_structure(self, s, name):
        msg = _tree_error(s, self.n_words, self.projective, self.single_root)
        if msg is not None:
            raise ValueError(f"{name}: {msg}; heads = {s.tolist()!r}")

    def _from_dense(self, m, n):
        heads = m.argmax(axis=0)   # the head of each word: the 1 in its column
        heads[0] = -1
        return heads

    # -- MAP ------------------------------------------------------------------
    cdef int c_map(self, const double* eta_u, const double* eta_v, int* out,
                   char* work) except -1 nogil:
        if self.projective:
            return _eisner(eta_u, self.n_words, self.single_root, out, work)
        return _cle(eta_u, self.n_words, self.single_root, out, work)

    def _ignored_entries(self, bint on_v):
        if on_v:
            return None
        N = self.n_words + 1
        return np.concatenate([np.arange(0, N * N, N), np.arange(N + 1, N * N, N + 1)])

    # -- vertex/column interface, O(n) --------------------------------------
    cdef int c_score(self, const int* s, const double* eta_u, const double* eta_v,
                     double* out) except -1 nogil:
        cdef int N = self.n_words + 1, m
        cdef double acc = 0
        for m in range(1, N):
            acc += eta_u[s[m] * N + m]
        out[0] = acc
        return 0

    cdef int c_overlap(self, const int* s, const int* t, double* out) except -1 nogil:
        cdef int m, k = 0
        for m in range(1, self.n_words + 1):
            if s[m] == t[m]:
                k += 1
        out[0] = k
        return 0

    cdef int c_add(self, const int* s, double w, double* u, double* v) except -1 nogil:
        cdef int N = self.n_words + 1, m
        if u != NULL:
            for m in range(1, N):
                u[s[m] * N + m] += w
        return 0


# ---------------------------------------------------------------------------
# Non-projective: Chu-Liu-Edmonds, Tarjan's O(n^2) dense version.
#
# Supernodes get ids: 0..n are the words (0 the root), n+1.. the contracted
# cycles. Each live supernode occupies a slot, i.e. a row of the N x N matrix
# T; a contracted cycle reuses the row of its first member. Columns always
# stay indexed by the original head word j, so contracting a cycle only
# merges the members' rows (O(N |C|)) and never touches any other row:
#   T[y*N + j]  score of the best arc from word j into supernode y, reduced by
#               the in-arc scores given up inside y; -inf when j lies in y;
#   M[y*N + j]  the modifier (a word of y) of that arc, for contracted rows
#               (in an original row y the modifier is y itself).
# rep[j] is the slot of the live supernode containing word j; slot_id and
# id_slot map live slots to supernode ids and back. A slot holds a contracted
# cycle exactly when its id is >= N (then its row of M is in use).
#
# single_root: CLE with lexicographic weights (-[h == 0], eta[h, m]). The root
# is never on a cycle, so every in-arc given up inside a supernode is a word
# arc and the reduced counts stay exactly -1 for the root column and 0
# elsewhere: the comparison is "any word head beats the root, then score".
# The contraction therefore runs over the words alone until one supernode
# holds them all, and only that supernode takes a root arc: exactly one word
# is attached to the root, and no big penalty constant is involved.
# ---------------------------------------------------------------------------
cdef extern from *:
    """
    /* Merge a cycle member's in-arc row into the cycle's (Chu-Liu-Edmonds):
       row0[j] = max(row0[j], row[j] - off), its modifier taken from mrow[j]
       (or v when mrow is NULL) where the member wins. Written with a max and a
       mask, not branches: at flat scores each comparison is a coin flip, and a
       mispredicted jump per entry was half of the MAP's time. */
    static void sm_merge_row(double* row0, int* mrow0, const double* row,
                             const int* mrow, int v, double off, int n) {
        int j, mask;
        double val, old;
        for (j = 0; j < n; j++) {
            val = row[j] - off;
            old = row0[j];
            /* all ones where the member wins ("take ? a : b" on the stored value
               compiles back into a jump) */
            mask = -(int) (val > old);
            row0[j] = val > old ? val : old;
            mrow0[j] ^= (mrow0[j] ^ (mrow ? mrow[j] : v)) & mask;
        }
    }
    """
    void sm_merge_row(double* row0, int* mrow0, const double* row, const int* mrow,
                      int v, double off, int n) noexcept nogil


cdef inline int _first_argmax(const double* row, int lo, int hi, double* best) noexcept nogil:
    """First index of the maximum of row[lo:hi] (its value into best); -1 when none
    exceeds -inf. Four interleaved chains, each keeping its first maximum, shorten
    the compare-and-select dependency chain; the lowest index among the chains
    that reach the overall maximum is the first one."""
    cdef int j, i, b = -1
    cdef double bv = -INFINITY
    cdef int[4] bi
    cdef double[4] v
    for i in range(4):
        bi[i] = -1
        v[i] = -INFINITY
    j = lo
    while j + 4 <= hi:
        for i in range(4):
            if row[j + i] > v[i]:
                v[i] = row[j + i]
                bi[i] = j + i
        j += 4
    while j < hi:
        # the tail's indices exceed every earlier one: chain 0 still keeps its first
        if row[j] > v[0]:
            v[0] = row[j]
            bi[0] = j
        j += 1
    for i in range(4):
        if v[i] > bv or (v[i] == bv and bi[i] >= 0 and (b < 0 or bi[i] < b)):
            bv = v[i]
            b = bi[i]
    best[0] = bv
    return b


cdef int _cle(const double* eta, int n, bint single_root, int* out,
              char* work) noexcept nogil:
    """Best arborescence into out; 1 when every one uses a forbidden (-inf) arc."""
    cdef int N = n + 1
    cdef Py_ssize_t NN = <Py_ssize_t> N * N
    cdef double* T = <double*> work
    cdef double* in_score = T + NN                    # per id (2N)
    cdef int* M = <int*> (in_score + 2 * N)
    # per supernode id (fewer than 2N of them)
    cdef int* in_head = M + NN
    cdef int* in_mod = in_head + 2 * N
    cdef int* parent = in_mod + 2 * N
    cdef int* first_child = parent + 2 * N
    cdef int* next_sib = first_child + 2 * N
    cdef int* id_slot = next_sib + 2 * N
    cdef int* first_word = id_slot + 2 * N
    cdef int* last_word = first_word + 2 * N
    cdef int* stack = last_word + 2 * N
    # per slot or word
    cdef int* path = stack + 2 * N
    cdef int* slot_id = path + N
    cdef int* state = slot_id + N
    cdef int* rep = state + N
    cdef int* next_word = rep + N

    cdef int h, m, x, y, v, j, b, k, s, top, p, c, cs, n_ids, z
    cdef double bs, val, off
    cdef double* row
    cdef double* row0
    cdef int* mrow
    cdef int* mrow0

    # transposed copy: row m = scores of the arcs into m
    for m in range(1, N):
        row = T + m * N
        for h in range(N):
            row[h] = eta[h * N + m]
        row[m] = -INFINITY
    for j in range(N):
        slot_id[j] = j
        id_slot[j] = j
        state[j] = UNVISITED
        rep[j] = j
        first_word[j] = j
        last_word[j] = j
        next_word[j] = -1
    state[0] = DONE
    for j in range(2 * N):
        parent[j] = -1
        first_child[j] = -1
        next_sib[j] = -1
    n_ids = N

    for s in range(1, N):
        if state[s] != UNVISITED:
            continue
        top = 0
        path[top] = s
        top += 1
        state[s] = ONPATH
        while True:
            x = path[top - 1]
            cs = id_slot[x]
            # best in-arc of x: row argmax, ties to the lowest head word; with
            # single_root, any word beats the root, which x takes only once it
            # holds every word (all other entries -inf)
            row = T + cs * N
            b = _first_argmax(row, 1, N, &bs)
            if b < 0 or not (single_root or bs > row[0]):
                b = 0
                bs = row[0]
            if bs == -INFINITY:
                # No allowed arc enters x: every tree uses a forbidden arc.
                # While each in-score is finite, contracting subtracts only
                # finite numbers, so -inf never meets -inf (no nan).
                return 1
            in_score[x] = bs
            in_head[x] = b
            in_mod[x] = M[cs * N + b] if x >= N else x
            b = rep[b]
            if state[b] == DONE:
                for k in range(top):
                    state[id_slot[path[k]]] = DONE
                break
            if state[b] == UNVISITED:
                state[b] = ONPATH
                path[top] = slot_id[b]
                top += 1
                continue
            # state ONPATH: the path from slot b to x closes a cycle; contract it
            p = top - 1
            while path[p] != slot_id[b]:
                p -= 1
            # the members are the ids path[p:top]
            c = n_ids
            n_ids += 1
            for k in range(p, top):
                y = path[k]
                parent[y] = c
                next_sib[y] = first_child[c]
                first_child[c] = y
                # concatenate the word lists
                if k == p:
                    first_word[c] = first_word[y]
                else:
                    next_word[last_word[c]] = first_word[y]
                last_word[c] = last_word[y]

            # in-arcs of c, in place in the row of the first member:
            # best over members y of (arc into y) - (in-arc of y)
            y = path[p]
            cs = id_slot[y]
            row0 = T + cs * N
            mrow0 = M + cs * N
            off = in_score[y]
            for j in range(N):
                row0[j] -= off
            if y < N:  # a word: its modifier was implicit until now
                for j in range(N):
                    mrow0[j] = cs
            for k in range(p + 1, top):
                y = path[k]
                v = id_slot[y]
                off = in_score[y]
                row = T + v * N
                if y >= N:
                    sm_merge_row(row0, mrow0, row, M + v * N, v, off, N)
                else:
                    sm_merge_row(row0, mrow0, row, NULL, v, off, N)
                state[v] = DEAD
            # words inside c are not heads of arcs into c
            z = first_word[c]
            while z != -1:
                row0[z] = -INFINITY
                rep[z] = cs
                z = next_word[z]
            slot_id[cs] = c
            id_slot[c] = cs
            top = p
            path[top] = c
            top += 1

    # Expansion: every top-level supernode keeps its in-arc (h, m); inside
    # it, the members on the way down to m give up theirs, all others keep
    # theirs and are expanded in turn.
    top = 0
    for j in range(1, N):
        if state[j] != DEAD:
            stack[top] = slot_id[j]
            top += 1
    out[0] = -1
    while top > 0:
        top -= 1
        x = stack[top]
        m = in_mod[x]
        out[m] = in_head[x]
        z = m
        while z != x:
            p = parent[z]
            v = first_child[p]
            while v != -1:
                if v != z:
                    stack[top] = v
                    top += 1
                v = next_sib[v]
            z = p
    if single_root:
        # Without masks exactly one word takes the root. A word left with no
        # allowed word head takes it too: then the lexicographic optimum has
        # the fewest root children, and more than one means no single-root
        # tree avoids the forbidden arcs.
        k = 0
        for m in range(1, N):
            k += out[m] == 0
        if k != 1:
            return 1
    return 0


# ---------------------------------------------------------------------------
# Projective: Eisner's algorithm.
#
# Positions lo..n (lo = 1 for single root: the root is attached at the end).
# Each N x N table holds two kinds of spans, one in each triangle, so that
# every inner loop over split points reads two contiguous rows:
#   Cr[s*N + t] (s <= t): complete span s..t headed at s; Cr[t*N + s] the same value
#   Cl[s*N + t] (s <= t): complete span s..t headed at t; Cl[t*N + s] the same value
#   I[s*N + t]  (s < t):  incomplete span with arc s -> t
#   I[t*N + s]  (s < t):  incomplete span with arc t -> s
# The forward pass keeps only the best values (a max over split points, with
# four independent accumulators); backtracking recomputes the best split of
# each of the O(n) spans it visits (the first split reaching the maximum, the
# same floating-point sums), O(n^2) in all.
# ---------------------------------------------------------------------------
cdef inline double _max_sum(const double* a, const double* b, int k) noexcept nogil:
    """max over 0 <= r < k of a[r] + b[r] (k >= 1)."""
    cdef double m0 = -INFINITY, m1 = -INFINITY, m2 = -INFINITY, m3 = -INFINITY, v
    cdef int r = 0
    while r + 4 <= k:
        v = a[r] + b[r]
        m0 = v if v > m0 else m0
        v = a[r + 1] + b[r + 1]
        m1 = v if v > m1 else m1
        v = a[r + 2] + b[r + 2]
        m2 = v if v > m2 else m2
        v = a[r + 3] + b[r + 3]
        m3 = v if v > m3 else m3
        r += 4
    while r < k:
        v = a[r] + b[r]
        m0 = v if v > m0 else m0
        r += 1
    m0 = m1 if m1 > m0 else m0
    m2 = m3 if m3 > m2 else m2
    return m2 if m2 > m0 else m0


cdef inline int _argmax_sum(const double* a, const double* b, int k) noexcept nogil:
    """Lowest r < k where a[r] + b[r] is maximal."""
    cdef double best = _max_sum(a, b, k)
    cdef int r
    for r in range(k):
        if a[r] + b[r] == best:
            return r
    return 0


cdef int _eisner(const double* eta, int n, bint single_root, int* out,
                 char* work) noexcept nogil:
    """Best projective tree into out; 1 when every one uses a forbidden (-inf) arc."""
    cdef int N = n + 1
    cdef Py_ssize_t NN = <Py_ssize_t> N * N
    cdef double* Cr = <double*> work
    cdef double* Cl = Cr + NN
    cdef double* I = Cl + NN
    cdef int* stack = <int*> (I + NN)
    cdef int lo = 1 if single_root else 0
    cdef int s, t, r, k, top, kind, m, bm
    cdef double best, val

    for s in range(lo, N):
        Cr[s * N + s] = 0
        Cl[s * N + s] = 0
    for k in range(1, N - lo):
        for s in range(lo, N - k):
            t = s + k
            # incomplete spans s..t, split Cr(s..r) + Cl(r+1..t), s <= r < t:
            # the same for both arc directions
            best = _max_sum(Cr + s * N + s, Cl + t * N + s + 1, k)
            I[s * N + t] = best + eta[s * N + t]
            I[t * N + s] = best + eta[t * N + s] if s > 0 else -INFINITY
            # complete, headed at s: I(s -> r) + Cr(r..t), s < r <= t
            best = _max_sum(I + s * N + s + 1, Cr + t * N + s + 1, k)
            Cr[s * N + t] = best
            Cr[t * N + s] = best
            # complete, headed at t: Cl(s..r) + I(t -> r), s <= r < t
            best = _max_sum(Cl + s * N + s, I + t * N + s, k)
            Cl[s * N + t] = best
            Cl[t * N + s] = best

    # Backtracking with an explicit stack of (kind, s, t):
    # kind 0: complete headed at s, 1: complete headed at t,
    #      2: incomplete s -> t,    3: incomplete t -> s
    out[0] = -1
    top = 0
    if single_root:
        bm = 1
        best = Cl[1 * N + 1] + Cr[1 * N + n] + eta[1]
        for m in range(2, N):
            val = Cl[1 * N + m] + Cr[m * N + n] + eta[m]
            if val > best:
                best = val
                bm = m
        if best == -INFINITY:
            return 1
        out[bm] = 0
        stack[0] = 1; stack[1] = 1; stack[2] = bm
        stack[3] = 0; stack[4] = bm; stack[5] = n
        top = 2
    else:
        if Cr[n] == -INFINITY:   # the complete span 0..n headed at the root
            return 1
        stack[0] = 0; stack[1] = 0; stack[2] = n
        top = 1
    while top > 0:
        top -= 1
        kind = stack[3 * top]
        s = stack[3 * top + 1]
        t = stack[3 * top + 2]
        if s == t:
            continue
        if kind == 0:
            r = s + 1 + _argmax_sum(I + s * N + s + 1, Cr + t * N + s + 1, t - s)
            stack[3 * top] = 2; stack[3 * top + 1] = s; stack[3 * top + 2] = r
            stack[3 * top + 3] = 0; stack[3 * top + 4] = r; stack[3 * top + 5] = t
            top += 2
        elif kind == 1:
            r = s + _argmax_sum(Cl + s * N + s, I + t * N + s, t - s)
            stack[3 * top] = 1; stack[3 * top + 1] = s; stack[3 * top + 2] = r
            stack[3 * top + 3] = 3; stack[3 * top + 4] = r; stack[3 * top + 5] = t
            top += 2
        else:
            if kind == 2:
                out[t] = s
            else:
                out[s] = t
            r = s + _argmax_sum(Cr + s * N + s, Cl + t * N + s + 1, t - s)
            stack[3 * top] = 0; stack[3 * top + 1] = s; stack[3 * top + 2] = r
            stack[3 * top + 3] = 1; stack[3 * top + 4] = r + 1; stack[3 * top + 5] = t
            top += 2
    return 0


# ---------------------------------------------------------------------------
# Validation of head arrays, O(n).
# ---------------------------------------------------------------------------
cdef enum:
    TREE_OK = 0
    TREE_ROOT_HEAD = 1     # heads[0] != -1 (value: heads[0])
    TREE_RANGE = 2         # a head outside [0, n] (word, value)
    TREE_SELF_LOOP = 3     # (word)
    TREE_N_ROOT = 4        # single_root and not one word on the root (value: how many)
    TREE_CYCLE = 5         # (a word on the cycle)
    TREE_NOT_PROJECTIVE = 6  # (a word whose subtree is not contiguous)


cdef int _tree_check(const int* s, int n, bint projective, bint single_root, int* work,
                     int* word, int* value) noexcept nogil:
    """TREE_OK if heads s[:n + 1] are a valid tree, else what is wrong (the word and
    value concerned in word[0], value[0]). work: 8 (n + 2) ints of scratch."""
    cdef int N = n + 1, m, h, k, z, n_root = 0, top, head
    cdef int* mark = work
    cdef int* start = work + N
    cdef int* kids = start + N + 1
    cdef int* fill = kids + N
    cdef int* order = fill + N
    cdef int* lo = order + N
    cdef int* hi = lo + N
    cdef int* size = hi + N
    if s[0] != -1:
        value[0] = s[0]
        return TREE_ROOT_HEAD
    for m in range(1, N):
        h = s[m]
        word[0] = m
        value[0] = h
        if h < 0 or h > n:
            return TREE_RANGE
        if h == m:
            return TREE_SELF_LOOP
        if h == 0:
            n_root += 1
    if single_root and n_root != 1:
        value[0] = n_root
        return TREE_N_ROOT
    # acyclicity: walk up from each word; mark 1 = on the current walk, 2 = reaches 0
    for m in range(N):
        mark[m] = 0
    mark[0] = 2
    for m in range(1, N):
        z = m
        while mark[z] == 0:
            mark[z] = 1
            z = s[z]
        if mark[z] == 1:
            word[0] = z
            return TREE_CYCLE
        z = m
        while mark[z] == 1:
            mark[z] = 2
            z = s[z]
    if not projective:
        return TREE_OK
    # projectivity: every subtree covers a contiguous range of positions.
    # Breadth-first order from the root over children in CSR form, then
    # accumulate spans and sizes bottom-up.
    for m in range(N + 1):
        start[m] = 0
    for m in range(N):
        lo[m] = m
        hi[m] = m
        size[m] = 1
    for m in range(1, N):
        start[s[m] + 1] += 1
    for h in range(N):
        start[h + 1] += start[h]
        fill[h] = start[h]
    for m in range(1, N):
        kids[fill[s[m]]] = m
        fill[s[m]] += 1
    order[0] = 0
    top = 1
    k = 0
    while k < top:
        h = order[k]
        k += 1
        for z in range(start[h], start[h + 1]):
            order[top] = kids[z]
            top += 1
    for k in range(N - 1, 0, -1):
        m = order[k]
        if hi[m] - lo[m] + 1 != size[m]:
            word[0] = m
            return TREE_NOT_PROJECTIVE
        head = s[m]
        size[head] += size[m]
        if lo[m] < lo[head]:
            lo[head] = lo[m]
        if hi[m] > hi[head]:
            hi[head] = hi[m]
    return TREE_OK


def _tree_error(s_arr, int n, bint projective, bint single_root):
    """Return None if ``s_arr`` (intc, shape (n+1,)) is a valid tree, else a message."""
    cdef const int[::1] s = s_arr
    cdef int[::1] work = np.empty(8 * (n + 2), dtype=np.intc)
    cdef int word = 0, value = 0
    cdef int code = _tree_check(&s[0], n, projective, single_root, &work[0], &word, &value)
    if code == TREE_OK:
        return None
    if code == TREE_ROOT_HEAD:
        return f"heads[0] must be -1 (the root has no head), got {value}"
    if code == TREE_RANGE:
        return f"heads[{word}] must lie in [0, {n}], got {value}"
    if code == TREE_SELF_LOOP:
        return f"heads[{word}] is a self-loop"
    if code == TREE_N_ROOT:
        return f"expected exactly one word attached to the root (single_root=True), got {value}"
    if code == TREE_CYCLE:
        return f"heads contain a cycle through word {word} (not every word reaches the root)"
    return f"the tree is not projective (the subtree of word {word} is not contiguous)"
