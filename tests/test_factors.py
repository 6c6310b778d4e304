"""What every factor shares: how it was built (repr, equality, hashing, pickling) and
reading a structure off its dense column (``from_vertex``).

Dense columns are built from the compact forms by tests/_reference.py (which also
enumerates the structures), not with ``factor.vertex``.
"""
import inspect
import os
import pathlib
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest

import sparsemap as sm

from _helpers import ArgmaxOracle
from _reference import (all_matchings, all_sequences, all_trees, arc_matrix, logic_columns,
                        matching_matrix, sequence_column)


def _argmax(eu, ev):
    return int(np.argmax(eu))


def _onehot(s):
    return np.eye(3)[s]


# (make, the same construction spelled another way, a different construction)
CONSTRUCTIONS = {
    "sequence": (lambda: sm.SequenceFactor(3, 2), lambda: sm.SequenceFactor(np.int64(3), 2),
                 lambda: sm.SequenceFactor(2, 3)),
    "tree": (lambda: sm.TreeFactor(4, projective=True),
             lambda: sm.TreeFactor(4, True, single_root=False),
             lambda: sm.TreeFactor(4, projective=True, single_root=True)),
    "matching": (lambda: sm.MatchingFactor(2, 3), lambda: sm.MatchingFactor(2, np.int32(3)),
                 lambda: sm.MatchingFactor(3, 2)),
    "generic": (lambda: sm.GenericFactor(np.eye(3)), lambda: sm.GenericFactor([[1, 0, 0], [0, 1, 0],
                                                                              [0, 0, 1]]),
                lambda: sm.GenericFactor(np.eye(3), np.zeros((1, 3)))),
    "generic_n": (lambda: sm.GenericFactor(np.eye(2), [[0.0, -0.0]]),
                  lambda: sm.GenericFactor(np.eye(2), [[-0.0, 0.0]]),   # -0.0 == 0.0
                  lambda: sm.GenericFactor(np.eye(2), [[0.0, 1.0]])),
    "oracle": (lambda: sm.OracleFactor(_argmax, _onehot, shape_u=3),
               lambda: sm.OracleFactor(_argmax, _onehot, shape_u=(3,), shape_v=0),
               lambda: sm.OracleFactor(_argmax, _onehot, shape_u=3, shape_v=2)),
    "oracle_subclass": (lambda: ArgmaxOracle(3), lambda: ArgmaxOracle(np.int64(3)),
                        lambda: ArgmaxOracle(4)),
    "xor": (lambda: sm.XorFactor(3), lambda: sm.XorFactor(np.int64(3)),
            lambda: sm.AtMostOneFactor(3)),
    "budget": (lambda: sm.BudgetFactor(4, 2), lambda: sm.BudgetFactor(4, 2, exact=False),
               lambda: sm.BudgetFactor(4, 2, exact=True)),
    "pair": (lambda: sm.PairFactor(), lambda: sm.PairFactor(), lambda: sm.XorFactor(2)),
    "sequence_budget": (lambda: sm.SequenceBudgetFactor(3, 1),
                        lambda: sm.SequenceBudgetFactor(3, 1, exact=False),
                        lambda: sm.SequenceBudgetFactor(3, 2)),
}


@pytest.mark.parametrize("name", CONSTRUCTIONS)
def test_equal_construction_compares_and_hashes_equal(name):
    make, same, other = CONSTRUCTIONS[name]
    f, g, h = make(), same(), other()
    assert f is not g
    assert f == g and not (f != g) and hash(f) == hash(g)
    assert f != h and not (f == h)
    assert {f: "cached"}[g] == "cached"
    assert len({f, g, h}) == 2
    assert f != "not a factor" and f != 3


@pytest.mark.parametrize("name", [n for n in CONSTRUCTIONS if n != "oracle_subclass"])
def test_pickle_round_trip_keeps_equality(name):
    f = CONSTRUCTIONS[name][0]()
    g = pickle.loads(pickle.dumps(f))
    assert g == f and hash(g) == hash(f) and repr(g) == repr(f)


def test_pickled_subclass_keeps_its_state():
    f = ArgmaxOracle(3)
    g = pickle.loads(pickle.dumps(f))
    assert type(g) is ArgmaxOracle and g.d == 3 and g == f
    assert g.map([0.0, 2.0, 1.0]) == 1


def test_different_families_are_never_equal():
    a = sm.MatchingFactor(2, 2)
    b = sm.SequenceFactor(2, 2)   # same shape_u, same ints
    assert a != b and b != a


def test_subclass_state_takes_part_in_equality():
    f, g = ArgmaxOracle(3), ArgmaxOracle(3)
    g.extra = 1
    assert f != g


def test_repr_shows_the_construction():
    assert repr(sm.TreeFactor(6, projective=True)) == \
        "TreeFactor(6, projective=True, single_root=False)"
    assert repr(sm.SequenceFactor(3, 2)) == "SequenceFactor(3, 2)"
    assert repr(sm.MatchingFactor(3, 5)) == "MatchingFactor(3, 5)"
    assert repr(sm.GenericFactor(np.eye(3))) == "GenericFactor(<3 x 3 array>)"
    assert repr(sm.GenericFactor(np.eye(3), np.ones((2, 3)))) == \
        "GenericFactor(<3 x 3 array>, <2 x 3 array>)"
    assert repr(sm.OracleFactor(_argmax, _onehot, shape_u=3)) == \
        "OracleFactor(_argmax, _onehot, shape_u=(3,), shape_v=(0,), structure_size=1)"
    assert repr(sm.BudgetFactor(5, 2)) == "BudgetFactor(5, 2, exact=False)"
    assert repr(sm.PairFactor()) == "PairFactor()"
    # the repr is the constructor call for factors without arrays or callables
    for make, _, _ in (CONSTRUCTIONS[k] for k in ("sequence", "tree", "matching", "xor", "budget",
                                                  "pair", "sequence_budget")):
        f = make()
        assert eval(repr(f), {c: getattr(sm, c) for c in sm.__all__}) == f



class _Perm(sm.OracleFactor):
    """Permutations of n items: a user's oracle subclass that says how it was built."""

    def __init__(self, n, scale=1.0):
        super().__init__(shape_u=(n, n), structure_size=n)
        self.n, self.scale = n, scale

    def _init_args(self):
        return (self.n,)

    def oracle_map(self, eta_u, eta_v):
        return np.argsort(-eta_u[0], kind="stable")

    def oracle_vertex(self, s):
        return np.eye(self.n)[s]


class _PermWithOptions(_Perm):
    def _init_kwargs(self):
        return {"scale": self.scale}


class _NoInitArgs(sm.OracleFactor):
    def __init__(self, n):
        super().__init__(lambda eu, ev: int(np.argmax(eu)), lambda s: np.eye(n)[s], shape_u=n)


def test_repr_of_an_oracle_subclass_is_its_constructor():
    # its own _init_args (and _init_kwargs) are its constructor; OracleFactor's keywords
    # (shape_u, shape_v, structure_size) are not among its arguments
    assert repr(_Perm(6)) == "_Perm(6)"
    assert repr(_PermWithOptions(4, scale=2.0)) == "_PermWithOptions(4, scale=2.0)"
    namespace = {"_Perm": _Perm, "_PermWithOptions": _PermWithOptions}
    for f in (_Perm(6), _PermWithOptions(4, scale=2.0)):
        g = eval(repr(f), namespace)
        assert g == f and hash(g) == hash(f) and pickle.loads(pickle.dumps(f)) == f
    assert _Perm(6) != _Perm(5)
    # a subclass with a constructor of its own that does not say how it was built:
    # no call that would not build it
    assert repr(_NoInitArgs(3)) == "<_NoInitArgs: shape_u=(3,), shape_v=(0,), structure_size=1>"
    # subclasses that keep OracleFactor's constructor keep its repr
    plain = type("Plain", (sm.OracleFactor,), {})(_argmax, _onehot, shape_u=3)
    assert repr(plain) == "Plain(_argmax, _onehot, shape_u=(3,), shape_v=(0,), structure_size=1)"

def test_docstrings_start_with_the_constructor_signature():
    """The API reference reads a Cython class's signature off its docstring's first line;
    it must name the constructor's real arguments (those repr and pickle use)."""
    for name in sm.__all__:
        cls = getattr(sm, name)
        if not (isinstance(cls, type) and issubclass(cls, sm.Factor)):
            continue
        first = cls.__doc__.splitlines()[0]
        assert first.startswith(f"{name}(") and first.endswith(")"), first
    for make, _, _ in CONSTRUCTIONS.values():
        f = make()
        if type(f) is ArgmaxOracle:
            continue
        first = type(f).__doc__.splitlines()[0]
        namespace = {}
        exec(f"def signature{first[first.index('('):]}: pass", namespace)
        inspect.signature(namespace["signature"]).bind(*f._init_args(), **f._init_kwargs())


# -- from_vertex ----------------------------------------------------------------------
def _families():
    for n, m in ((1, 3), (3, 2)):
        f = sm.SequenceFactor(n, m)
        yield f, [(s, *sequence_column(s, m)) for s in all_sequences(n, m)]
    for proj in (False, True):
        for single in (False, True):
            f = sm.TreeFactor(3, projective=proj, single_root=single)
            yield f, [(h, arc_matrix(h), None) for h in all_trees(3, proj, single)]
    for r, c in ((2, 3), (3, 2), (3, 3)):
        yield sm.MatchingFactor(r, c), [(s, matching_matrix(s, c), None)
                                        for s in all_matchings(r, c)]
    M = np.array([[1, 0, 1, 0], [0, 1, 1, 0]], dtype=float)   # includes a zero column
    yield sm.GenericFactor(M), [(j, M[:, j], None) for j in range(4)]
    # logic factors: the compact form is the 0/1 column itself
    for f in (sm.BudgetFactor(4, 2), sm.OrOutFactor(3), sm.PairFactor()):
        Z, M, N = logic_columns(f)
        yield f, [(z, M[:, k], N[:, k] if N.shape[0] else None) for k, z in enumerate(Z)]


FAMILIES = list(_families())


@pytest.mark.parametrize("factor, cases", FAMILIES, ids=[repr(f) for f, _ in FAMILIES])
def test_from_vertex_inverts_the_column(factor, cases):
    for s, m, n in cases:
        got = factor.from_vertex(m)
        np.testing.assert_array_equal(got, s)
        if n is not None:
            np.testing.assert_array_equal(factor.from_vertex(m, n), s)
        np.testing.assert_array_equal(factor.from_vertex(m.tolist()), s)


@pytest.mark.parametrize("factor, cases", FAMILIES, ids=[repr(f) for f, _ in FAMILIES])
def test_from_vertex_refuses_what_is_no_column(factor, cases):
    columns = {m.tobytes() for _, m, _ in cases}
    s, m, n = cases[len(cases) // 2]
    bad = [0.5 * m, m + 1, -m]
    for i in range(m.size):   # every single flip that is not another structure's column
        flipped = m.copy().reshape(-1)
        flipped[i] = 1 - flipped[i]
        if flipped.reshape(m.shape).tobytes() not in columns:
            bad.append(flipped.reshape(m.shape))
    for b in bad:
        with pytest.raises(ValueError, match="^m: "):
            factor.from_vertex(b)
    if n is not None and n.size:
        with pytest.raises(ValueError, match="^n: "):
            factor.from_vertex(m, 1 - n)
    with pytest.raises(ValueError, match=r"^target: expected shape"):
        factor.from_vertex(np.zeros(m.size + 1), names=("target", "target"))
    with pytest.raises(ValueError, match="^m: contains non-finite"):
        factor.from_vertex(np.full(m.shape, np.nan))
    with pytest.raises(ValueError, match="^m: expected real numbers"):
        factor.from_vertex(m.astype(complex))


def test_from_vertex_generic_ambiguity_and_duplicates():
    M = np.array([[1.0, 0.0, 1.0, 1.0]])
    N = np.array([[0.0, 0.0, 1.0, 0.0]])
    f = sm.GenericFactor(M, N)
    with pytest.raises(ValueError, match=r"columns \[0, 2, 3\] of M equal it but differ in N"):
        f.from_vertex([1.0])
    assert f.from_vertex([1.0], [1.0]) == 2
    assert f.from_vertex([1.0], [0.0]) == 0   # exact duplicates 0 and 3: the lowest index
    with pytest.raises(ValueError, match="^m: .*no column of M"):
        f.from_vertex([0.5])


def test_from_vertex_without_a_reader():
    f = sm.OracleFactor(_argmax, _onehot, shape_u=3)
    with pytest.raises(ValueError, match="^m: OracleFactor cannot read .*compact form"):
        f.from_vertex([0.0, 1.0, 0.0])


# -- importing an unbuilt source folder -------------------------------------------------
def test_unbuilt_source_folder_explains_itself(tmp_path):
    """A source folder without compiled modules says what is wrong and what to do."""
    src = pathlib.Path(sm.__file__).parent
    shutil.copytree(src, tmp_path / "sparsemap",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", "*.c"))
    env = dict(os.environ, PYTHONPATH="")
    out = subprocess.run([sys.executable, "-c", "import sparsemap"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "compiled modules are missing" in out.stderr and "pip install -e ." in out.stderr
