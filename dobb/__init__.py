"""dobb: shard-local block-diagonal eigenbasis preconditioning for LLM training."""

from dobb.groups import param_groups
from dobb.optim import (
    Dion,
    Dion2,
    Dobb,
    MatrixOptimizer,
    Muon,
    MuonBP,
    NonFiniteGradientError,
    NorDion2,
    NorMuon,
    build_optimizer,
)

__all__ = [
    "Dion",
    "Dion2",
    "Dobb",
    "MatrixOptimizer",
    "Muon",
    "MuonBP",
    "NonFiniteGradientError",
    "NorDion2",
    "NorMuon",
    "build_optimizer",
    "param_groups",
]
__version__ = "0.1.0"
