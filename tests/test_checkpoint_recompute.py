"""Activation checkpointing with Dobb tracking: the recompute in backward gathers nothing.

Checkpointing re-runs each block's forward during backward; the statistics hooks must not
count those tokens again (twice the Gram work, on backward's critical path). Covered:
``torch.utils.checkpoint`` non-reentrant and reentrant, and torch's ``checkpoint_wrapper``
(which torchtitan and FSDP users wrap blocks with) in both of its implementations.
"""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from dobb import Dobb, param_groups

WIDTH, HIDDEN, DEPTH = 16, 32, 2


class Ops(TorchDispatchMode):
    """Counts the aten ops dispatched inside the ``with`` block."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.proj = nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(x)))


class Call(nn.Module):
    """``block`` run through ``torch.utils.checkpoint.checkpoint(**kwargs)``."""

    def __init__(self, block, **kwargs):
        super().__init__()
        self.block, self.kwargs = block, kwargs

    def forward(self, x):
        return checkpoint(self.block, x, **self.kwargs)


MODES = {
    "plain": lambda b: b,
    "non_reentrant": lambda b: Call(b, use_reentrant=False),
    "reentrant": lambda b: Call(b, use_reentrant=True),
    "wrapper": lambda b: checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
    "wrapper_reentrant": lambda b: checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.REENTRANT),
}


class Net(nn.Module):
    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, WIDTH)  # reentrant checkpoints need an input with grad
        self.blocks = nn.ModuleList(MODES[mode](Block()) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def data(step):
    return torch.randn(4, 8, 4, generator=torch.Generator().manual_seed(step))


def build(mode, track=True, **options):
    model = Net(mode)
    groups = param_groups(model, exclude=r"^(inp|head)\.")
    opt = Dobb(groups, lr=1e-2, num_blocks=4, basis_interval=2, **options)
    if track:
        opt.track(model)
    return model, opt


def backward_ops(mode, track):
    model, _ = build(mode, track)
    loss = model(data(0))
    with Ops() as ops:
        loss.backward()
    return ops.ops


@pytest.mark.parametrize("mode", [m for m in MODES if m != "plain"])
def test_checkpointed_backward_dispatches_as_many_ops_with_tracking_as_without(mode):
    tracked, untracked = backward_ops(mode, True), backward_ops(mode, False)
    differ = {op: (tracked[op], untracked[op]) for op in tracked | untracked}
    assert tracked == untracked, {op: n for op, n in differ.items() if n[0] != n[1]}
    assert tracked["aten::bmm"] == 0  # no Gram product in backward


def trajectory(mode, steps=4, **options):
    model, opt = build(mode, **options)
    for t in range(steps):
        opt.zero_grad()
        model(data(t)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", [m for m in MODES if m != "plain"])
@pytest.mark.parametrize(
    "options",
    [{}, {"two_sided": True, "row_stats": "outputs"}],
    ids=["one_sided", "two_sided_outputs"],
)
def test_checkpointed_training_is_bit_identical_to_plain_training(mode, options):
    # every token counted exactly once, input and (two-sided) output sides; doubling every
    # sum would be exact in floating point, which the op count above and the mixed test
    # below catch instead
    plain = trajectory("plain", **options)
    for got, want in zip(trajectory(mode, **options), plain, strict=True):
        assert torch.equal(got, want)


def test_a_checkpointed_forward_without_backward_still_counts_its_tokens():
    # a recompute happens only in backward; a forward in training mode counts as usual
    model, opt = build("non_reentrant")
    with torch.no_grad():
        model(data(0))  # no grad: nothing counted
    model(data(0))
    opt.zero_grad()
    model(data(1)).backward()
    opt.step()  # would raise "no activation statistics" had nothing been counted
    reference, reference_opt = build("plain")
    reference(data(0))
    reference_opt.zero_grad()
    reference(data(1)).backward()
    reference_opt.step()
    for got, want in zip(model.parameters(), reference.parameters()):
        assert torch.equal(got, want)
