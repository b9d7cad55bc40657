"""The optimizers: Dobb, and the baselines it is compared against."""

from dobb.optim.base import MatrixOptimizer, NonFiniteGradientError
from dobb.optim.dion import Dion, dion_update
from dobb.optim.dion2 import Dion2, dion2_update
from dobb.optim.dobb import Dobb
from dobb.optim.dobb_update import dobb_update
from dobb.optim.muon import Muon, muon_update, newton_schulz
from dobb.optim.muonbp import MuonBP, block_muon_update
from dobb.optim.nordion2 import NorDion2, nordion2_update
from dobb.optim.normuon import NorMuon, normuon_update
from dobb.optim.registry import OPTIMIZERS, build_optimizer, get_entry

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
    "block_muon_update",
    "build_optimizer",
    "dion2_update",
    "dion_update",
    "dobb_update",
    "get_entry",
    "muon_update",
    "newton_schulz",
    "nordion2_update",
    "normuon_update",
]
