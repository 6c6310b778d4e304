"""Inputs NumPy would convert silently (complex, boolean, strings) raise a ValueError naming the argument."""
import warnings

import numpy as np
import pytest

import sparsemap as sm
from sparsemap.testing import finite_difference_jvp

SEQ = sm.SequenceFactor(3, 2)
EU, EV = np.zeros((3, 2)), np.zeros((2, 2, 2))
R = sm.solve(SEQ, EU, EV)


def calls(x_u, x_v):
    """(call, argument name) for every score or direction argument, with x_u / x_v passed."""
    gen = sm.GenericFactor(np.eye(3), np.ones((1, 3)))
    return [
        (lambda: SEQ.map(x_u), "eta_u"), (lambda: SEQ.map(EU, x_v), "eta_v"),
        (lambda: SEQ.score([0, 1, 0], x_u), "eta_u"),
        (lambda: sm.solve(SEQ, x_u), "eta_u"), (lambda: sm.solve(SEQ, EU, x_v), "eta_v"),
        (lambda: sm.solve(SEQ, x_u, method="cg"), "eta_u"),
        (lambda: R.jvp(x_u), "d_eta_u"), (lambda: R.jvp(EU, x_v), "d_eta_v"),
        (lambda: R.vjp(x_u), "du"),
        (lambda: sm.solve_batch(SEQ, [EU, x_u]), r"etas_u\[1\]"),
        (lambda: sm.solve_batch(SEQ, np.stack([x_u, x_u])), r"etas_u"),
        (lambda: sm.solve_batch(SEQ, [EU, EU], [None, x_v]), r"etas_v\[1\]"),
        (lambda: sm.vjp_batch([R, R], [EU, x_u]), r"dus\[1\]"),
        (lambda: sm.jvp_batch([R], [x_u]), r"d_etas_u\[0\]"),
        (lambda: sm.jvp_batch([R], [EU], [x_v]), r"d_etas_v\[0\]"),
        (lambda: sm.solve(gen, x_u[0, :1].repeat(3)), "eta_u"),
        (lambda: finite_difference_jvp(SEQ, EU, EV, d_eta_u=x_u), "d_eta_u"),
    ]


@pytest.mark.parametrize("i", range(len(calls(EU, EV))))
def test_complex_raises_naming_the_argument(i):
    call, name = calls(EU + 1j, EV + 1j)[i]
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # no ComplexWarning on the way
        with pytest.raises(ValueError, match=name + ".*complex"):
            call()


@pytest.mark.parametrize("i", range(len(calls(EU, EV))))
def test_boolean_scores_raise_naming_the_argument(i):
    call, name = calls(EU > 0, EV > 0)[i]
    with pytest.raises(ValueError, match=name + ".*boolean.*-inf"):
        call()


def test_complex_with_zero_imaginary_part_still_raises():
    with pytest.raises(ValueError, match="eta_u.*complex"):
        sm.solve(SEQ, EU.astype(complex))
    with pytest.raises(ValueError, match="eta_u.*complex"):
        sm.solve(SEQ, [[1 + 0j, 0], [0, 0], [0, 0]])


@pytest.mark.parametrize("bad, name", [
    (np.array([[1, 0], [0, 1j], [0, 0]], dtype=object), "eta_u"),
    (np.array([["1", "0"], ["0", "0"], ["0", "0"]]), "eta_u"),
    (np.array([[None, 0], [0, 0], [0, 0]], dtype=object), "eta_u"),
    (np.zeros((3, 2), dtype="datetime64[s]"), "eta_u"),
])
def test_other_non_numeric_input(bad, name):
    with pytest.raises(ValueError, match=name):
        sm.solve(SEQ, bad)


def test_real_numeric_inputs_are_accepted():
    ref = sm.solve(SEQ, [[1.0, 0.0], [0.0, 2.0], [0.5, 0.0]]).u
    for eta in ([[1, 0], [0, 2], [0.5, 0]], np.array([[1, 0], [0, 2], [0.5, 0]], dtype=object),
                np.array([[1, 0], [0, 2], [0.5, 0]], dtype=np.float32),
                np.array([[2, 0], [0, 4], [1, 0]], dtype=np.int8) / 2):
        np.testing.assert_array_equal(sm.solve(SEQ, eta).u, ref)


def test_generic_factor_columns():
    for M, N in ((np.eye(3) + 1j, None), (np.eye(3), np.ones((1, 3)) * 1j)):
        name = "M" if N is None else "N"
        with pytest.raises(ValueError, match=name + ".*complex"):
            sm.GenericFactor(M, N)
    # boolean columns are natural 0/1 columns
    f = sm.GenericFactor(np.eye(3, dtype=bool), np.ones((1, 3), dtype=bool))
    np.testing.assert_array_equal(f.M, np.eye(3))


def test_oracle_vertex_output():
    f = sm.OracleFactor(lambda eu, ev: int(np.argmax(eu)), lambda s: np.eye(3)[s] * 1j, shape_u=3)
    with pytest.raises(ValueError, match=r"^vertex_fn result: expected real values, got complex"):
        sm.solve(f, [1.0, 0.0, 0.0])
    g = sm.OracleFactor(lambda eu, ev: int(np.argmax(eu)), lambda s: np.eye(3, dtype=bool)[s],
                        shape_u=3)
    np.testing.assert_allclose(sm.solve(g, [1.0, 0.5, 0.0]).u, [0.75, 0.25, 0.0])
