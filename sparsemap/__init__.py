"""SparseMAP: sparse, differentiable structured inference from a MAP oracle.

Implements Niculae, Martins, Blondel and Cardie, *SparseMAP: Differentiable
Sparse Structured Inference* (ICML 2018).
"""
from sparsemap._factors._base import Factor
from sparsemap._factors._sequence import SequenceFactor
from sparsemap._factors._generic import GenericFactor, OracleFactor
from sparsemap._factors._matching import MatchingFactor
from sparsemap._factors._tree import TreeFactor

__version__ = "0.1.0.dev0"

__all__ = ["Factor", "SequenceFactor", "GenericFactor", "OracleFactor"]
__all__ += ["MatchingFactor"]
__all__ += ["TreeFactor"]

from sparsemap._solve import ConvergenceWarning, SparseMAPResult, solve

__all__ += ["solve", "SparseMAPResult", "ConvergenceWarning"]

from sparsemap.losses import batch_loss, perceptron_loss, sparsemap_loss, structured_svm_loss

__all__ += ["sparsemap_loss", "perceptron_loss", "structured_svm_loss", "batch_loss"]
