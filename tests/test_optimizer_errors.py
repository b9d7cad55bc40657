"""Optimizer errors that lose nothing: a raised non-finite step leaves the optimizer ready
for the next clean batch, and no optimizer takes another optimizer's state."""

import pytest
import torch
from tinylm import (
    MATRIX_CASES,
    TinyLM,
    assert_same_params,
    assert_same_state,
    loss_of,
    make,
    params,
    state_snapshot,
    train,
)

from dobb.optim.base import NonFiniteGradientError
from dobb.registry import OPTIMIZERS, build_optimizer


def failed_then_clean(name, scalar, poison):
    """Train 2 steps, fail step 3 (``poison`` spoils its batch), then step on batch 3."""
    model, opt = make(name, scalar, foreach=False)
    train(model, opt, 2)
    opt.zero_grad()
    poison(model)
    with pytest.raises(NonFiniteGradientError):
        opt.step()
    train(model, opt, 1, first=3)
    return model, opt


def nan_gradient(model):
    loss_of(model, 2).backward()
    model.fc.weight.grad.view(-1)[0] = float("nan")


def nan_activation(model):
    handle = model.fc.register_forward_pre_hook(lambda m, args: (args[0] * float("nan"),))
    try:
        loss_of(model, 2).backward()
    finally:
        handle.remove()


@pytest.mark.parametrize("poison", [nan_gradient, nan_activation], ids=["grad", "activation"])
@pytest.mark.parametrize("name, scalar", MATRIX_CASES)
def test_after_a_raised_nonfinite_step_the_next_batch_steps_as_if_it_never_happened(
    name, scalar, poison
):
    model, opt = failed_then_clean(name, scalar, poison)
    reference, reference_opt = make(name, scalar, foreach=False)
    train(reference, reference_opt, 2)
    train(reference, reference_opt, 1, first=3)
    assert_same_params(params(model), params(reference))
    assert_same_state(state_snapshot(opt), state_snapshot(reference_opt))  # Dobb: C_b too


# every pair of registry entries whose optimizers differ (class, or its scalar algorithm)
FOREIGN = [
    pytest.param(saver, loader, id=f"{saver}->{loader}")
    for saver in OPTIMIZERS
    for loader in OPTIMIZERS
    if OPTIMIZERS[saver].cls is not OPTIMIZERS[loader].cls
]


@pytest.mark.parametrize("saver, loader", FOREIGN)
def test_no_optimizer_loads_another_optimizers_state(saver, loader):
    torch.manual_seed(0)
    model = TinyLM()
    source = build_optimizer(saver, model)
    train(model, source, 1)
    target = build_optimizer(loader, model)
    before = [dict(g) for g in target.param_groups]
    with pytest.raises(ValueError, match="cannot load this state|parameter groups"):
        target.load_state_dict(source.state_dict())
    assert [dict(g) for g in target.param_groups] == before and not target.state


@pytest.mark.parametrize("name", [n for n, e in OPTIMIZERS.items() if e.is_matrix])
def test_a_state_saved_with_another_scalar_algorithm_is_refused(name):
    model, lion = make(name, "lion", foreach=False)
    train(model, lion, 1)
    _, adamw = make(name, "adamw", foreach=False)
    with pytest.raises(ValueError, match=r"saved by an optimizer with parameter groups .*lion"):
        adamw.load_state_dict(lion.state_dict())
