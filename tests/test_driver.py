"""The driver's contract (``dobb.optim.base``): every matrix optimizer is ``MatrixOptimizer``
over a ``Core`` and an ordered list of placements ending in ``Local``; the cores
communicate nothing; placements claim in order and ``Local`` steps the rest, one call per
set of math options."""

import pytest
import torch
from test_owner_exchange_driver import names_used

import dobb
from dobb.optim import dion2, dion_core, dobb_core, dobb_update, muon, muonbp, nordion2, normuon
from dobb.optim.base import Core, Local, MatrixOptimizer
from dobb.optim.registry import OPTIMIZERS

MATRIX_OPTIMIZERS = sorted(
    {e.cls for e in OPTIMIZERS.values() if issubclass(e.cls, MatrixOptimizer)},
    key=lambda c: c.__name__,
)
CORE_MODULES = (muon, muonbp, normuon, dion2, nordion2, dion_core, dobb_core, dobb_update)


def test_the_registry_has_every_matrix_optimizer():
    assert {c.__name__ for c in MATRIX_OPTIMIZERS} == {
        "Dion",
        "Dion2",
        "Dobb",
        "Muon",
        "MuonBP",
        "NorDion2",
        "NorMuon",
    }


@pytest.mark.parametrize("cls", MATRIX_OPTIMIZERS, ids=lambda c: c.__name__)
def test_each_optimizer_is_the_driver_over_a_core_and_placements(cls):
    opt = cls([torch.nn.Parameter(torch.zeros(4, 3))], lr=0.01)
    assert isinstance(opt.core, Core)
    assert type(opt.placements[-1]) is Local  # the rest: local, no communication
    assert all(isinstance(p, Local) for p in opt.placements)
    for klass in cls.__mro__[: cls.__mro__.index(MatrixOptimizer)]:
        overridden = {"_matrix_step", "_init_matrix_state"} & set(vars(klass))
        assert not overridden, f"{klass.__name__} overrides the driver's {overridden}"


@pytest.mark.parametrize("module", CORE_MODULES, ids=lambda m: m.__name__)
def test_no_core_communicates(module):
    used = names_used(module)
    assert not {n for n in used if n.startswith("dist.") or "torch.distributed" in n}, used


def test_placements_claim_in_order_and_local_takes_the_rest():
    """A placement before ``Local`` that claims one matrix (and steps nothing) keeps it
    unchanged, its own state beside the core's; ``Local`` updates the other."""

    class Hold(Local):
        def __init__(self, held):
            self.held, self.stepped = held, []

        def init_state(self, param, group, name):
            return {"held": torch.tensor(param is self.held)}

        def claim(self, entries):
            mine = [e for e in entries if e[0] is self.held]
            return mine, [e for e in entries if e[0] is not self.held]

        def step(self, entries, driver):
            self.stepped.append([p for p, _, _ in entries])

    a, b = (torch.nn.Parameter(torch.randn(4, 3)) for _ in range(2))
    opt = dobb.Muon([a, b], lr=0.1)
    hold = Hold(a)
    opt.placements = (hold, *opt.placements)
    before = a.detach().clone(), b.detach().clone()
    a.grad, b.grad = torch.randn(4, 3), torch.randn(4, 3)
    opt.step()
    assert hold.stepped == [[a]]
    assert torch.equal(a, before[0]) and not torch.equal(b, before[1])
    assert bool(opt.state[a]["held"]) and not bool(opt.state[b]["held"])
    assert "momentum" in opt.state[a]  # the core's state too


@pytest.mark.parametrize("foreach", [False, True])
def test_local_calls_the_core_once_per_set_of_math_options(foreach, monkeypatch):
    """Same-shape matrices of groups with equal options share a call (and so a stack);
    another lr is another call."""
    params = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(4)]
    groups = [
        {"params": params[:1], "lr": 0.1},
        {"params": params[1:2], "lr": 0.1},
        {"params": params[2:], "lr": 0.2},
    ]
    opt = dobb.Muon(groups, foreach=foreach)
    calls = []
    updates = opt.core.updates

    def spy(params, grads, states, group, *, batched):
        calls.append((len(params), group["lr"], batched))
        updates(params, grads, states, group, batched=batched)

    monkeypatch.setattr(opt.core, "updates", spy)
    for p in params:
        p.grad = torch.randn(4, 3)
    opt.step()
    assert calls == [(2, 0.1, foreach), (2, 0.2, foreach)]
