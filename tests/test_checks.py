"""One mistake, one message: the NumPy, torch and drop-in paths share their input checks."""
import numpy as np
import pytest

import sparsemap as sm


def message(fn):
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def test_eta_v_list_of_the_wrong_length_numpy_and_torch():
    import torch
    import sparsemap.torch as smt
    fg = sm.FactorGraph(4)
    fg.add(sm.XorFactor(3), [0, 1, 2])
    fg.add(sm.PairFactor(), [2, 3])
    x = np.zeros(4)
    want = "eta_v: expected a list with one entry per factor (2), got length 1"
    assert message(lambda: fg.solve(x, [None])) == want
    assert message(lambda: smt.factor_graph(fg, torch.zeros(4), [None])) == want


def test_integer_scores_torch_and_drop_in():
    import torch
    import sparsemap.torch as smt
    from sparsemap.lpsmap import TorchFactorGraph
    scores = torch.zeros(3, dtype=torch.long)
    layer = message(lambda: smt.sparsemax(scores)).replace("x:", "scores:", 1)
    drop_in = message(lambda: TorchFactorGraph().variable_from(scores))
    assert drop_in == layer == "scores: expected a floating-point tensor, got dtype torch.int64"
