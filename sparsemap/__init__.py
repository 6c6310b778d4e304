"""SparseMAP: sparse, differentiable structured inference from a MAP oracle.

Implements Niculae, Martins, Blondel and Cardie, *SparseMAP: Differentiable
Sparse Structured Inference* (ICML 2018).

Factors describe a family of structures and solve MAP; :func:`solve` computes
SparseMAP on top of any factor, :func:`solve_batch` many problems at once in
threads; the losses of Section 4 live in
:mod:`sparsemap.losses` and tools to property-test a factor of your own in
:mod:`sparsemap.testing`.
"""
try:
    from sparsemap._factors._base import Factor
except ModuleNotFoundError as exc:   # pragma: no cover - depends on how it was installed
    if not (exc.name or "").startswith("sparsemap."):
        raise
    import os as _os
    raise ImportError(
        f"sparsemap's compiled modules are missing from {_os.path.dirname(__file__)}. This is "
        f"a source folder that was not built in place (it hides any installed sparsemap when "
        f"Python starts in the folder above it). Build it in place with `pip install -e .` "
        f"from the repository root, or start Python from another folder to use an installed "
        f"sparsemap.") from exc
from sparsemap._factors._generic import GenericFactor, OracleFactor
from sparsemap._factors._logic import (AndOutFactor, AtMostOneFactor, BudgetFactor, ImplyFactor,
                                       KnapsackFactor, OrFactor, OrOutFactor, PairFactor,
                                       SequenceBudgetFactor, XorFactor, XorOutFactor)
from sparsemap._factors._matching import MatchingFactor
from sparsemap._factors._sequence import SequenceFactor
from sparsemap._factors._tree import TreeFactor
from sparsemap._exceptions import ConvergenceError, ConvergenceWarning
from sparsemap._factor_graph import FactorGraph, FactorGraphResult
from sparsemap._lp_map import LPMAPResult, MAPAssignment
from sparsemap._variables import VariableArray
from sparsemap._solve import SparseMAPResult, jvp_batch, solve, solve_batch, vjp_batch
from sparsemap.losses import batch_loss, perceptron_loss, sparsemap_loss, structured_svm_loss

__version__ = "0.1.0.dev0"

__all__ = [
    "Factor", "SequenceFactor", "TreeFactor", "MatchingFactor", "GenericFactor", "OracleFactor",
    "XorFactor", "AtMostOneFactor", "OrFactor", "BudgetFactor", "PairFactor", "OrOutFactor",
    "AndOutFactor", "XorOutFactor", "SequenceBudgetFactor", "ImplyFactor", "KnapsackFactor",
    "solve", "solve_batch", "vjp_batch", "jvp_batch", "SparseMAPResult", "ConvergenceWarning",
    "ConvergenceError",
    "FactorGraph", "FactorGraphResult", "LPMAPResult", "MAPAssignment", "VariableArray",
    "sparsemap_loss", "perceptron_loss", "structured_svm_loss", "batch_loss",
]
