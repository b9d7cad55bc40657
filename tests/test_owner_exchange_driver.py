"""The owner-exchange driver's contract with its algorithms (Muon, MuonBP, NorMuon, Dion2,
NorDion2): every collective is the driver's, an optimizer is its config plus a core (and
MuonBP's block steps beside Muon's core), and no constructor skips another's."""

import ast
import inspect

import pytest
import torch

import dobb
from dobb.optim import dion2, muon, muonbp, nordion2, normuon, owner_groups
from dobb.optim.owner_groups import Core, OwnerExchangeOptimizer

ALGORITHMS = (muon, muonbp, normuon, dion2, nordion2)


def names_used(module) -> set[str]:
    """Every dotted name a module reads or imports (``dist.all_reduce``, ``torch.distributed``)."""
    tree, names = ast.parse(inspect.getsource(module)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names.add(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update(alias.name for alias in node.names)
            names.add(getattr(node, "module", None) or "")
    return names


@pytest.mark.parametrize("module", ALGORITHMS, ids=lambda m: m.__name__)
def test_the_algorithms_communicate_nothing(module):
    used = names_used(module)
    assert not {n for n in used if n.startswith("dist.") or "torch.distributed" in n}, used


def test_the_driver_holds_the_collectives():
    used = names_used(owner_groups)
    assert {"dist.all_reduce", "dist.all_gather_object"} <= used


@pytest.mark.parametrize("module", ALGORITHMS, ids=lambda m: m.__name__)
def test_no_constructor_is_skipped_and_no_method_borrowed(module):
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "__init__":  # only super().__init__(...)
                assert isinstance(node.func.value, ast.Call), ast.unparse(node)
        for stmt in node.body if isinstance(node, ast.ClassDef) else []:
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Attribute):
                owner = stmt.value.value  # ``x = Other.method`` in a class body
                assert not isinstance(owner, ast.Name), ast.unparse(stmt)


@pytest.mark.parametrize(
    "cls", [dobb.Muon, dobb.MuonBP, dobb.NorMuon, dobb.Dion2, dobb.NorDion2], ids=str
)
def test_each_optimizer_is_the_driver_over_a_core(cls):
    assert issubclass(cls, OwnerExchangeOptimizer) and Core in type(cls.core).__mro__
    opt = cls([torch.nn.Parameter(torch.zeros(4, 3))])
    assert opt.config == cls.Config()  # the constructor's defaults are the config's


def test_muonbp_is_muons_core_with_block_steps_beside_it():
    assert type(dobb.MuonBP.core) is type(dobb.Muon.core)
    assert dobb.Muon.piece_steps is None and dobb.MuonBP.piece_steps is not None
