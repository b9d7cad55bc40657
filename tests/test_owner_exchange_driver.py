"""The owner-exchange optimizers' contract (Muon, MuonBP, NorMuon, Dion2, NorDion2): every
collective is the owner-exchange placement's (``dobb.optim.owner_groups``), an optimizer is
its config plus a core (and MuonBP's block steps beside Muon's core), and no constructor
skips another's. The driver's contract for every optimizer: ``tests/test_driver.py``."""

import ast
import inspect

import pytest
import torch
from multirank import run_ranks

import dobb
from dobb.optim import dion2, muon, muonbp, nordion2, normuon, owner_groups
from dobb.optim.muon import OwnerExchangeOptimizer
from dobb.optim.owner_groups import ExchangeCore
from dobb.registry import build_optimizer

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
    assert issubclass(cls, OwnerExchangeOptimizer) and ExchangeCore in type(cls.core).__mro__
    opt = cls([torch.nn.Parameter(torch.zeros(4, 3))])
    assert opt.config == cls.Config()  # the constructor's defaults are the config's


def test_muonbp_is_muons_core_with_block_steps_beside_it():
    assert type(dobb.MuonBP.core) is type(dobb.Muon.core)
    assert dobb.Muon.piece_steps is None and dobb.MuonBP.piece_steps is not None


def _resume_with_lr_zero(rank: int, world: int, name: str) -> bool:
    """On DDP-style replicas sharing the work (``replica_group``): step, save, load into a
    new optimizer, set ``lr = 0`` in its param_groups (what a scheduler does) and step:
    True if no matrix moved."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8))
    options = dict(ns_dtype=torch.float32, replica_group=torch.distributed.group.WORLD)
    options |= {"period": 1} if name == "muonbp" else {}
    make = lambda: build_optimizer(name, model, **options)  # noqa: E731
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    def step(opt):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    first = make()
    step(first)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    for group in resumed.param_groups:
        group["lr"] = 0.0
    before = [layer.weight.detach().clone() for layer in model]
    step(resumed)
    return all(torch.equal(a, layer.weight) for a, layer in zip(before, model))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["muon", "muonbp", "normuon", "dion2", "nordion2"])
def test_a_loaded_optimizer_steps_with_its_current_groups(name):
    """``load_state_dict`` replaces the group dicts; the exchange reads the new ones (an lr
    schedule after a resume is followed by the shared matrices too)."""
    assert run_ranks(_resume_with_lr_zero, 2, name, timeout=110) == [True, True]
