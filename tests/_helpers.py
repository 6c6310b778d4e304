"""Utilities shared by the tests (not references: those are in tests/_reference.py).

- ``ArgmaxOracle``: sparsemax as a subclassed ``OracleFactor``, at module level so
  its instances pickle;
- ``load_script``: import an example or benchmark script as a module;
- ``subprocess_env``: the environment of a subprocess that must import the same
  sparsemap as the test session;
- ``torch_state_restored``: undo the global torch settings a script's ``main`` makes.
"""
import contextlib
import importlib.util
import os
import pathlib

import numpy as np

import sparsemap as sm

ROOT_DIR = pathlib.Path(__file__).resolve().parent.parent


class ArgmaxOracle(sm.OracleFactor):
    """Sparsemax as a subclassed oracle: structures are the basis vectors of R^d."""

    def __init__(self, d):
        super().__init__(shape_u=d)
        self.d = d

    def oracle_map(self, eta_u, eta_v):
        return int(np.argmax(eta_u))

    def oracle_vertex(self, s):
        return np.eye(self.d)[s]


def load_script(path, name):
    """A fresh module of the script at ``path`` (absolute, or relative to the repository
    root), imported under ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT_DIR / path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def subprocess_env():
    """os.environ with PYTHONPATH leading to the sparsemap this test session imports,
    wherever pytest runs from."""
    root = str(pathlib.Path(sm.__file__).resolve().parent.parent)
    path = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


@contextlib.contextmanager
def torch_state_restored():
    """Give back torch's thread count, deterministic mode and global RNG state, which
    the example scripts' ``main`` set."""
    import torch

    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    rng = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_rng_state(rng)
