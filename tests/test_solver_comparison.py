"""The Figure 2 script runs end to end on a tiny configuration and writes sensible files."""
import csv
import importlib.util
import os
from collections import defaultdict

import numpy as np
import pytest

import sparsemap as sm
from sparsemap.testing import check_kkt, enumerate_structures

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "solver_comparison.py")


def load_script():
    spec = importlib.util.spec_from_file_location("solver_comparison", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def optimal_objective(n_nodes, seed):
    """f* of the script's instance for a seed, from a solution certified by the KKT
    conditions over every tree (brute force), not from the solvers being compared."""
    f = sm.TreeFactor(n_nodes)
    eta = np.random.default_rng(seed).standard_normal((n_nodes + 1, n_nodes + 1))
    r = sm.solve(f, eta)
    check_kkt(f, eta, None, r, structures=enumerate_structures(f))
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
    assert "instance 2/2" in stderr
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


def test_script_rejects_bad_options(tmp_path):
    mod = load_script()
    for argv in (["--seeds", "0"], ["--scale", "-1"], ["--n-nodes", "x"]):
        with pytest.raises(SystemExit):
            mod.main(argv + ["--out", str(tmp_path)])
