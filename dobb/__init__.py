"""dobb: shard-local block-diagonal eigenbasis preconditioning for LLM training."""

from dobb.groups import param_groups
from dobb.optim import Dobb, MatrixOptimizer, NonFiniteGradientError

__all__ = ["Dobb", "MatrixOptimizer", "NonFiniteGradientError", "param_groups"]
__version__ = "0.1.0"
