"""The driver's contract (``dobb.optim.base``, ``dobb.optim.parts``): every matrix optimizer
is ``MatrixOptimizer`` over a ``Core`` (``init_state``, ``updates``) and an ordered list of
placements, the last claiming what the others left; cores get typed configs, never group
dicts; placements claim in order and ``Local`` steps the rest, one call per set of math
options. That no core communicates is held at run time, under FSDP and TP
(``tests/distributed/test_no_core_communicates.py``)."""

import pytest
import torch

import dobb
from dobb.optim.base import MatrixOptimizer
from dobb.optim.parts import Core, Local, Placement
from dobb.registry import OPTIMIZERS

MATRIX_OPTIMIZERS = sorted(
    {e.cls for e in OPTIMIZERS.values() if issubclass(e.cls, MatrixOptimizer)},
    key=lambda c: c.__name__,
)


def public(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


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


def test_a_core_is_init_state_and_updates_and_a_placement_claims_and_steps():
    assert public(Core) == {"init_state", "updates"}
    assert public(Placement) == {"init_state", "claim", "step"}
    assert public(Local) == {"step"}


@pytest.mark.parametrize("cls", MATRIX_OPTIMIZERS, ids=lambda c: c.__name__)
def test_each_optimizer_is_the_driver_over_a_core_and_placements(cls):
    opt = cls([torch.nn.Parameter(torch.zeros(4, 3))], lr=0.01)
    assert isinstance(opt.core, Core)
    assert all(isinstance(p, Placement) for p in opt.placements)
    last = type(opt.placements[-1])
    assert last.claim is Placement.claim  # the last takes the rest
    for klass in cls.__mro__[: cls.__mro__.index(MatrixOptimizer)]:
        overridden = {"_matrix_step", "_state_of", "_step_inputs"} & set(vars(klass))
        assert not overridden, f"{klass.__name__} overrides the driver's {overridden}"


@pytest.mark.parametrize("cls", MATRIX_OPTIMIZERS, ids=lambda c: c.__name__)
def test_the_core_reads_a_typed_config_never_the_group(cls):
    """``init_state`` and ``updates`` get this step's ``Config``, with the group's values."""
    seen = []

    class Spy(Core):
        def __init__(self, core):
            self.core = core

        def init_state(self, param, config, name):
            seen.append(config)
            return self.core.init_state(param, config, name)

        def updates(self, batch, config):
            seen.append(config)
            return self.core.updates(batch, config)

        def __getattr__(self, name):
            return getattr(self.core, name)

    layer = torch.nn.Linear(3, 4, bias=False)
    options = {"missing_stats": "identity"} if cls is dobb.Dobb else {}
    opt = cls([{"params": [layer.weight], "lr": 0.125}], **options)
    opt.core = Spy(opt.core)
    layer.weight.grad = torch.ones(4, 3)
    opt.step()
    assert len(seen) == 2 and all(type(c) is cls.Config and c.lr == 0.125 for c in seen)


def test_placements_claim_in_order_and_local_takes_the_rest():
    """A placement before ``Local`` that claims one matrix (and steps nothing) keeps it
    unchanged, its own state beside the core's; ``Local`` updates the other."""

    class Hold(Placement):
        def __init__(self, held):
            self.held, self.stepped = held, []

        def init_state(self, param, config, name):
            return {"held": torch.tensor(param is self.held)}

        def claim(self, matrices):
            mine = [m for m in matrices if m.param is self.held]
            return mine, [m for m in matrices if m.param is not self.held]

        def step(self, matrices, core, step):
            self.stepped.append([m.param for m in matrices])

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

    def spy(batch, config):
        calls.append((len(batch.params), config.lr, config.batched(batch.params[0].device)))
        updates(batch, config)

    monkeypatch.setattr(opt.core, "updates", spy)
    for p in params:
        p.grad = torch.randn(4, 3)
    opt.step()
    assert calls == [(2, 0.1, foreach), (2, 0.2, foreach)]


@pytest.mark.parametrize("cls", MATRIX_OPTIMIZERS, ids=lambda c: c.__name__)
def test_the_constructor_takes_the_configs_fields(cls):
    """Derived from the config: an unknown option is refused with the list of options."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'.*lr"):
        cls([torch.nn.Parameter(torch.zeros(4, 3))], bogus=1)
    opt = cls([torch.nn.Parameter(torch.zeros(4, 3))], 0.5)  # lr positional, as torch.optim
    assert opt.param_groups[0]["lr"] == 0.5
