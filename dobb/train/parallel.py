"""Process groups, device meshes and the parallel layouts the harness trains under.

Mesh axes are named by what they carry (torchtitan's convention): ``data_replicate`` (DDP /
HSDP replicas), ``data_shard`` (FSDP shards) and ``tensor`` (TP). Both data axes see
different tokens, so optimizer statistics are averaged over them; ``tensor`` never.
"""

import os
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel


class MeshAxis(StrEnum):
    DATA_REPLICATE = "data_replicate"
    DATA_SHARD = "data_shard"
    TENSOR = "tensor"


# layout -> mesh axes, outermost first ("single" and "ddp" need no mesh)
LAYOUTS: dict[str, tuple[MeshAxis, ...]] = {
    "single": (),
    "ddp": (MeshAxis.DATA_REPLICATE,),
    "fsdp": (MeshAxis.DATA_SHARD,),
    "hsdp": (MeshAxis.DATA_REPLICATE, MeshAxis.DATA_SHARD),
    "tp": (MeshAxis.TENSOR,),
    "fsdp_tp": (MeshAxis.DATA_SHARD, MeshAxis.TENSOR),
}


@dataclass
class Parallelism:
    """How this rank takes part: its mesh, and its share of the global batch."""

    layout: str
    mesh: DeviceMesh | None
    data_parallel: DeviceMesh | dist.ProcessGroup | None  # where statistics are averaged
    dp_rank: int = 0
    dp_size: int = 1


def init_distributed(timeout: float | None = None) -> torch.device:
    """Join the ``torchrun`` job if there is one (gloo on CPU, nccl on CUDA).

    ``timeout``: seconds a collective waits for the other ranks before it fails (a hung
    rank then stops the job instead of blocking it); None: torch's default (gloo 30 min).
    """
    if "RANK" not in os.environ or dist.is_initialized():
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    wait = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", **wait)
        return torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo", **wait)
    return torch.device("cpu")


def mesh_shape(layout: str, world_size: int, tensor_parallel: int) -> tuple[int, ...]:
    """Sizes of the layout's mesh axes; the one data axis of a 2-D mesh takes the rest."""
    axes = LAYOUTS[layout]
    if len(axes) == 1:
        return (world_size,)
    inner = tensor_parallel if MeshAxis.TENSOR in axes else world_size // tensor_parallel
    if inner < 1 or world_size % inner:
        raise ValueError(
            f"layout {layout!r} needs WORLD_SIZE ({world_size}) divisible by its inner axis "
            f"size {inner} (set tensor_parallel=N to a divisor of WORLD_SIZE)"
        )
    return (world_size // inner, inner)


# Megatron's split of a transformer block: these split outputs (rows), those inputs (columns)
COLUMN_PARALLEL = ("attn.q", "attn.k", "attn.v", "mlp.fc")
ROW_PARALLEL = ("attn.proj", "mlp.proj")


def tensor_parallel_plan(model: nn.Module) -> dict[str, object]:
    """Megatron-style plan for ``dobb.train.model.GPT``: q, k, v and fc column-parallel,
    the two output projections row-parallel; embeddings and head stay replicated."""
    plan = {}
    for i in range(len(model.blocks)):
        for name in COLUMN_PARALLEL:
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ROW_PARALLEL:
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


def parallelize(model: nn.Module, layout: str, tensor_parallel: int = 2):
    """Apply ``layout`` to ``model`` (already on its device); return (model, Parallelism)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {sorted(LAYOUTS)}")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if layout == "single":
        if world > 1:
            raise ValueError("layout 'single' runs in one process; pick ddp/fsdp/... for torchrun")
        return model, Parallelism(layout, None, None)
    if not dist.is_initialized():
        raise ValueError(f"layout {layout!r} needs torchrun (no process group is initialized)")
    if layout == "ddp":
        model = DistributedDataParallel(model)
        return model, Parallelism(layout, None, dist.group.WORLD, dist.get_rank(), world)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    axes = LAYOUTS[layout]
    mesh = init_device_mesh(
        device_type, mesh_shape(layout, world, tensor_parallel), mesh_dim_names=axes
    )
    if MeshAxis.TENSOR in axes:
        if model.cfg.n_head % mesh[MeshAxis.TENSOR].size():
            raise ValueError(f"n_head={model.cfg.n_head} is not divisible by the TP degree")
        parallelize_module(model, mesh[MeshAxis.TENSOR], tensor_parallel_plan(model))
    data_axes = tuple(a for a in axes if a != MeshAxis.TENSOR)
    if not data_axes:
        return model, Parallelism(layout, mesh, None)
    data = mesh[data_axes]
    if MeshAxis.DATA_SHARD in data_axes:
        for block in model.blocks:
            fully_shard(block, mesh=data)
        fully_shard(model, mesh=data)
    dp_rank = 0
    for axis, coordinate in enumerate(data.get_coordinate()):  # row-major over data axes
        dp_rank = dp_rank * data.size(axis) + coordinate
    return model, Parallelism(layout, mesh, data, dp_rank, data.size())
