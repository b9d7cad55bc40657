"""No core communicates: every collective of a step is issued by a placement or the driver,
never from inside a core (``dobb.optim.base``'s contract).

Every registry matrix optimizer takes three steps (Dobb refreshing at the first and the
third) under FSDP2 and under tensor parallelism on 2 gloo ranks, with every collective
seen where torch dispatches it (``c10d`` and functional-collective ops, so also those
issued through a helper, DTensor or FSDP) and the Python frames that called it
recorded. A frame running a method of the optimizer's core, or of a core it is composed
of, fails the test. Before the restructuring of issue #41 this failed for Dobb and
two-sided Dobb: their statistics all-reduce ran in ``DobbCore.begin``.
"""

import sys

import pytest
import torch
from multirank import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

import dobb
from dobb.optim.base import MatrixOptimizer
from dobb.optim.parts import Core

NAMES = sorted(n for n, e in dobb.OPTIMIZERS.items() if issubclass(e.cls, MatrixOptimizer))
OPTIONS = {"dobb": {"basis_interval": 2, "num_blocks": 2}, "dobb_sign": {"basis_interval": 2}}
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


class CollectiveCallers(TorchDispatchMode):
    """Records, for every collective dispatched inside it, the code objects of the Python
    frames that issued it (innermost first)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, list]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in COLLECTIVE_NAMESPACES:
            frame, codes = sys._getframe(1), []
            while frame is not None:
                codes.append(frame.f_code)
                frame = frame.f_back
            self.calls.append((str(func), codes))
        return func(*args, **(kwargs or {}))


def core_codes(core, seen=None) -> dict:
    """The code object of every method of ``core``'s class (and its bases) and of every core
    it is composed of, with the name of the method."""
    seen = set() if seen is None else seen
    codes = {}
    for cls in type(core).__mro__:
        if cls is object or cls in seen:
            continue
        seen.add(cls)
        for name, value in vars(cls).items():
            function = getattr(value, "__func__", value)
            if hasattr(function, "__code__"):
                codes[function.__code__] = f"{cls.__name__}.{name}"
            if isinstance(value, Core):
                codes |= core_codes(value, seen)
    for value in vars(core).values():
        if isinstance(value, Core):
            codes |= core_codes(value, seen)
    return codes


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 20), nn.Linear(20, 8)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def layout_model(name: str, layout: str):
    """The MLP under ``layout`` for optimizer ``name``, and its data-parallel mesh (None)."""
    model = MLP()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("data_shard",))
        for module in (model.fc1, model.fc2, model):
            fully_shard(module, mesh=mesh)
        return model, mesh
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tensor",))
    if getattr(getattr(dobb.get_entry(name).cls, "core", None), "whole_rows", None):
        # rows only: a column-parallel first layer, its output gathered
        plan = {"fc1": ColwiseParallel(output_layouts=Replicate())}
    else:
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    parallelize_module(model, mesh, plan)
    return model, None


def offenders(rank, world, layout):
    """``[(optimizer, collective, core method)]`` of collectives issued from inside a core in
    three steps of every matrix optimizer under ``layout``, and how many were seen."""
    found, seen = [], 0
    for name in NAMES:
        torch.manual_seed(0)
        model, data = layout_model(name, layout)
        extra = dobb.get_entry(name).distributed_options(data)
        opt = dobb.build_optimizer(name, model, **OPTIONS.get(name, {}), **extra)
        codes = core_codes(opt.core)
        # FSDP's ranks see other tokens; tensor parallelism's the same
        gen = torch.Generator().manual_seed(rank if layout == "fsdp" else 0)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 8, generator=gen)).square().mean().backward()
            with CollectiveCallers() as callers:
                opt.step()
            seen += len(callers.calls)
            for op, stack in callers.calls:
                inside = [codes[c] for c in stack if c in codes]
                if inside:
                    found.append((name, op, inside[0]))
    return found, seen


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_no_collective_is_issued_from_inside_a_core(layout):
    results = run_ranks(offenders, 2, layout, timeout=300)
    found = sorted({f for rank_found, _ in results for f in rank_found})
    assert sum(seen for _, seen in results) > 0  # the recorder sees the placements' traffic
    assert not found, f"collectives issued from inside a core: {found}"
