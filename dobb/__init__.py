"""dobb: shard-local block-diagonal eigenbasis preconditioning for LLM training."""

__version__ = "0.1.0"  # the one place it is written: pyproject.toml reads it from here

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
