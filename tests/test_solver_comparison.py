"""The Figure 2 script runs end to end on a tiny configuration and writes sensible files."""
import csv
import os
from collections import defaultdict

import numpy as np
import pytest

import sparsemap as sm
from sparsemap.testing import check_kkt, enumerate_structures

import _helpers
from _reference import arc_matrix


def load_script():
    return _helpers.load_script("benchmarks/solver_comparison.py", "solver_comparison")


def optimal_objective(n_nodes, seed):
    """f* of the script's instance for a seed, from a solution certified by the KKT
    conditions over every tree (brute force), not from the solvers being compared."""
    f = sm.TreeFactor(n_nodes)
    eta = np.random.default_rng(seed).standard_normal((n_nodes + 1, n_nodes + 1))
    r = sm.solve(f, eta)
    check_kkt(f, r, eta, structures=enumerate_structures(f))
    return r.objective


def test_script_end_to_end(tmp_path, capsys):
    mod = load_script()
    out = mod.main(["--n-nodes", "5", "--seeds", "2", "--max-iter", "50", "--out", str(tmp_path)])
    stdout, stderr = capsys.readouterr()
    paths = out["paths"]
    with open(paths["png"], "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(paths["pdf"], "rb") as fh:
        assert fh.read(5) == b"%PDF-"
    assert os.path.getsize(paths["png"]) > 10_000
    # not a terminal: whole lines, no carriage returns
    assert "\r" not in stderr
    assert [ln.split(" (")[0] for ln in stderr.splitlines()] == ["instance 1/2", "instance 2/2"]
    assert paths["png"] in stdout and paths["csv"] in stdout
    for method in mod.SOLVERS:
        assert mod.LABELS[method] in stdout

    with open(paths["csv"], newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert tuple(rows[0].keys()) == mod.CSV_FIELDS
    runs = defaultdict(list)
    for r in rows:
        runs[r["solver"], int(r["seed"])].append(r)
    assert set(runs) == {(m, s) for m in mod.SOLVERS for s in (0, 1)}
    for seed in (0, 1):
        best = min(float(r["objective"]) for (m, s), rs in runs.items() if s == seed for r in rs)
        # the best objective any solver found is the optimum (so the suboptimality and
        # the gap checks below are against f*)
        assert best == pytest.approx(optimal_objective(5, seed), abs=1e-10)
        for method in mod.SOLVERS:
            rs = runs[method, seed]
            assert 1 <= len(rs) <= 50
            assert [int(r["iteration"]) for r in rs] == list(range(1, len(rs) + 1))
            obj = np.array([float(r["objective"]) for r in rs])
            sub = np.array([float(r["suboptimality"]) for r in rs])
            gap = np.array([float(r["gap"]) for r in rs])
            sec = np.array([float(r["seconds"]) for r in rs])
            np.testing.assert_allclose(sub, obj - best, atol=1e-12)
            assert np.all(sub >= 0)
            assert np.all(gap >= sub - 1e-10)      # the gap certifies suboptimality
            assert np.all(np.diff(sec) >= 0)
            assert all(int(r["support_size"]) >= 1 for r in rs)

    # the active set solves a 5-word tree to a tiny gap well within 50 iterations
    table = {r["solver"]: r for r in out["rows"]}
    assert table["active_set"]["reached"] == 2
    assert table["active_set"]["iterations"] is not None
    assert table["active_set"]["support"] >= 1


def test_steps_start_every_solver_at_the_map_structure():
    """The figure's step 0 is the MAP structure for every solver: the active set records
    it as its iteration 1, and the prepended point of the CG variants is computed
    independently of the solvers (objective and Wolfe gap of the MAP tree)."""
    mod = load_script()
    n = 6
    eta = np.random.default_rng(3).standard_normal((n + 1, n + 1))
    f = sm.TreeFactor(n)
    m0 = arc_matrix(f.map(eta))
    adjusted = np.array([np.sum((eta - m0) * arc_matrix(t)) for t in enumerate_structures(f)])
    objective = 0.5 * np.sum(m0) - np.sum(eta * m0)   # m0 is 0/1
    gap = adjusted.max() - np.sum((eta - m0) * m0)
    assert mod.starting_point(f, eta) == pytest.approx((objective, gap), abs=1e-12)

    runs = mod.run_instance(n, 3, 1.0, 30)
    for method in mod.SOLVERS:
        h, steps = runs[method], runs[method]["steps"]
        extra = 0 if method == "active_set" else 1
        assert len(steps["floored"]) == len(h["objective"]) + extra
        assert steps["support"][0] == 1
        assert steps["floored"][0] == pytest.approx(objective - min(
            float(r["objective"].min()) for r in runs.values()), abs=1e-12)
        assert steps["gap"][0] == pytest.approx(gap, abs=1e-12)
        np.testing.assert_array_equal(steps["support"][extra:], h["support_size"])


def test_script_rejects_bad_options(tmp_path, capsys):
    mod = load_script()
    for argv, msg in ((["--seeds", "0"], "--seeds: expected a positive integer"),
                      (["--scale", "-1"], "--scale: expected a positive finite float"),
                      (["--n-nodes", "x"], "--n-nodes: invalid int value")):
        with pytest.raises(SystemExit) as exc:
            mod.main(argv + ["--out", str(tmp_path)])
        assert exc.value.code == 2 and msg in capsys.readouterr().err
