"""dobb: shard-local block-diagonal eigenbasis preconditioning for LLM training."""

__version__ = "0.1.0"  # the one place it is written: pyproject.toml reads it from here

from dobb.groups import param_groups
from dobb.optim.base import MatrixOptimizer, NonFiniteGradientError
from dobb.optim.dion import Dion
from dobb.optim.dion2 import Dion2
from dobb.optim.dobb import Dobb
from dobb.optim.muon import Muon
from dobb.optim.muonbp import MuonBP
from dobb.optim.nordion2 import NorDion2
from dobb.optim.normuon import NorMuon
from dobb.registry import OPTIMIZERS, build_optimizer, get_entry, recommended_lr

__all__ = [
    "OPTIMIZERS",
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
    "get_entry",
    "param_groups",
    "recommended_lr",
]
