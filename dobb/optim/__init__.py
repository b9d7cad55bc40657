"""The optimizers: Dobb, and the baselines it is compared against."""

from dobb.optim.base import MatrixOptimizer, NonFiniteGradientError
from dobb.optim.dobb import Dobb

__all__ = ["Dobb", "MatrixOptimizer", "NonFiniteGradientError"]
