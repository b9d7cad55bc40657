"""Expert stacks ``(E, d_out, d_in)`` are ``E`` matrices (``dobb.optim.experts``).

Every registry optimizer that steps experts, on one stack fed per-expert gradients, equals
the same optimizer on ``E`` separate matrices fed the same gradients, tensor for tensor
(both computed here, in float64, with the same ops: ``torch.equal``). An update computed
across ``E`` (one orthogonalization or normalization of the stack, a state shared by the
experts) fails it. The state is stacked per key, and a checkpoint resumes exactly. Dobb
runs here without activation statistics (``missing_stats="identity"``: its input bases
stay the identity, its row bases come from the gradients); its statistics from routed
tokens are ``tests/test_experts_dobb.py``'s.
"""

import copy

import pytest
import torch
from optim_db import SMALL_INPUTS, over_foreach
from torch import nn

import dobb
from dobb.optim.dobb_core import EXPERT_TOKENS
from dobb.optim.parts import COUNTERS
from dobb.registry import OPTIMIZERS, get_entry

EXPERTS, D_OUT, D_IN, STEPS = 3, 12, 8, 6
MATRIX = [n for n in OPTIMIZERS if hasattr(get_entry(n).cls, "supports_experts")]
STEPPED = sorted(n for n in MATRIX if get_entry(n).cls.supports_experts)


def cases():
    return over_foreach([pytest.param(n, SMALL_INPUTS[n][-1], id=n) for n in STEPPED])


def make(name: str, params: list[tuple[str, nn.Parameter]], options: dict, foreach: bool):
    entry = get_entry(name)
    options = entry.hyperparameters | options
    options = {k: v for k, v in options.items() if k != "lr"}
    if entry.cls is dobb.Dobb:  # gradients only: no statistics (the module docstring)
        options["missing_stats"] = "identity"
    return entry.cls([{"params": params}], lr=0.02, foreach=foreach, **options)


def gradients(step: int) -> torch.Tensor:
    """The stack's gradient at ``step``: expert ``e``'s own, of another scale each (a
    normalization across the stack would show)."""
    g = torch.randn(EXPERTS, D_OUT, D_IN, generator=torch.Generator().manual_seed(step))
    return g * torch.tensor([1.0, 10.0, 0.1]).view(-1, 1, 1).double()


def train(opt, params, steps, first=0):
    for step in range(first, first + steps):
        grad = gradients(step)
        if len(params) == 1:
            params[0].grad = grad.clone()
        else:
            for e, p in enumerate(params):
                p.grad = grad[e].clone()
        opt.step()


@pytest.mark.parametrize("name, options, foreach", cases())
def test_a_stack_steps_as_its_experts_one_by_one(name, options, foreach):
    torch.manual_seed(0)
    weights = torch.randn(EXPERTS, D_OUT, D_IN, dtype=torch.float64)
    stack = nn.Parameter(weights.clone())
    experts = [nn.Parameter(weights[e].clone()) for e in range(EXPERTS)]
    stacked = make(name, [("w", stack)], options, foreach)
    separate = make(name, [(f"w[{e}]", p) for e, p in enumerate(experts)], options, foreach)
    train(stacked, [stack], STEPS)
    train(separate, experts, STEPS)
    for e, p in enumerate(experts):
        assert torch.equal(stack.detach()[e], p.detach()), (name, e)
    state = stacked.state[stack]
    assert set(state) - set(separate.state[experts[0]]) <= {EXPERT_TOKENS}  # Dobb's, of tokens
    for key in separate.state[experts[0]]:  # each one (E, ...): expert e its slice
        for e, p in enumerate(experts):
            assert torch.equal(state[key][e], separate.state[p][key]), (name, key, e)


@pytest.mark.parametrize("name", STEPPED)
def test_a_stack_resumes_from_its_state_dict(name):
    torch.manual_seed(0)
    weights = torch.randn(EXPERTS, D_OUT, D_IN, dtype=torch.float64)
    options = SMALL_INPUTS[name][-1]
    straight = nn.Parameter(weights.clone())
    opt = make(name, [("w", straight)], options, False)
    train(opt, [straight], STEPS)
    first = nn.Parameter(weights.clone())
    opt = make(name, [("w", first)], options, False)
    train(opt, [first], STEPS // 2)
    saved = copy.deepcopy(opt.state_dict())
    resumed = nn.Parameter(first.detach().clone())
    opt = make(name, [("w", resumed)], options, False)
    opt.load_state_dict(saved)
    train(opt, [resumed], STEPS - STEPS // 2, first=STEPS // 2)
    assert torch.equal(resumed.detach(), straight.detach())


class MoE(nn.Module):
    """A router, shared projections and an expert stack, named as torchtitan names them."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D_IN, EXPERTS, bias=False)
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.randn(EXPERTS, D_OUT, D_IN))
        self.shared = nn.Linear(D_IN, D_IN)


def test_param_groups_routes_expert_stacks_only_when_asked():
    model = MoE()
    names = lambda groups: [[n for n, _ in g["params"]] for g in groups]  # noqa: E731
    matrix, scalar = names(dobb.param_groups(model))
    assert "experts.w1" in scalar and "experts.w1" not in matrix
    matrix, scalar = names(dobb.param_groups(model, experts=r"experts\.w[123]$"))
    assert matrix == ["router.weight", "experts.w1", "shared.weight"]
    assert scalar == ["shared.bias"]
    opt = dobb.Muon(dobb.param_groups(model, experts=r"experts\."), lr=0.02)
    x = torch.randn(4, D_IN)
    (model.router(x).sum() + model.shared(x).sum() + model.experts.w1.square().sum()).backward()
    before = model.experts.w1.detach().clone()
    opt.step()
    assert opt.state[model.experts.w1]["momentum"].shape == (EXPERTS, D_OUT, D_IN)
    assert not torch.equal(before, model.experts.w1.detach())


def initial(device: str = "cpu") -> nn.Parameter:
    """A stack drawn on the CPU (the same values on any device) and moved to ``device``."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(EXPERTS, D_OUT, D_IN, generator=generator, dtype=torch.float64)
    return nn.Parameter(weights.to(device))


@pytest.mark.parametrize("name", STEPPED)
def test_a_stack_steps_on_fake_cuda_as_on_the_cpu(name):
    """The CUDA path without a GPU (``tests/fake_cuda.py``): a stack's views, gradient
    slices and stacked state stay on its device (no mismatch, counters on the host), and
    its twin equals the CPU run of the same steps (foreach on: same-shape experts stacked)."""
    from fake_cuda import FakeCuda, twin

    options = SMALL_INPUTS[name][-1]
    cpu = initial()
    train(make(name, [("w", cpu)], options, True), [cpu], 3)
    with FakeCuda():
        stack = initial("cuda:0")  # drawn inside the fake mode, so that it has a twin
        opt = make(name, [("w", stack)], options, True)
        for step in range(3):
            stack.grad = gradients(step).to("cuda:0")
            opt.step()
        devices = {key: value.device.type for key, value in opt.state[stack].items()}
        values = twin(stack.detach())
    assert {d for k, d in devices.items() if k not in COUNTERS} == {"cuda"}, devices
    assert {d for k, d in devices.items() if k in COUNTERS} <= {"cpu"}, devices
    assert torch.equal(values, cpu.detach())
