"""Every tensor of fixed training setups, to hold a restructuring to the code it replaces.

    python -m bench.tools.trajectories dump OUT.pt [--only NAME ...]  # this checkout's
    python -m bench.tools.trajectories compare BEFORE.pt AFTER.pt

``dump`` trains each setup of ``SETUPS`` (one process) and ``DISTRIBUTED`` (2 or 4 gloo
ranks) with this checkout's ``dobb`` and saves, per setup, the parameters after every step
and every tensor of the optimizer's ``state_dict()`` at the end; ``compare`` checks two
dumps tensor for tensor with ``torch.equal`` and prints every difference. A dump of
another commit: ``git worktree add --detach DIR COMMIT`` and run ``dump`` from ``DIR``.
Only the public API is used (constructors, ``track``, ``step``, ``state_dict``,
``load_state_dict``), so any two commits can be compared.

Each setup trains a small MLP (ragged blocks: 12 inputs, 10 hidden, 8 outputs) for
``STEPS`` steps with ``basis_interval=3`` (Dobb refreshes at steps 1, 4 and 7), saves the
model and the optimizer after ``RELOAD`` steps and continues from that checkpoint in a
fresh model and optimizer: the setups cover refreshes and a reload. Each runs in float32
and in bfloat16 parameters. ``nan_step`` setups get a NaN gradient at step 3
(``nonfinite="skip"``).
"""

import argparse
import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

STEPS, RELOAD = 7, 4
WIDTHS = (12, 10, 8)  # in, hidden, out
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Setup:
    """An optimizer of the registry, its options, and how it is trained."""

    optimizer: str
    options: dict[str, Any] = field(default_factory=dict)
    nan_step: bool = False


DOBB = dict(basis_interval=3, lr=0.02)
SETUPS: dict[str, Setup] = {
    "dobb": Setup("dobb", DOBB | {"num_blocks": 3}),
    "dobb-foreach": Setup("dobb", DOBB | {"num_blocks": 3, "foreach": True}),
    "dobb-one-block": Setup("dobb", DOBB | {"num_blocks": 1, "foreach": True}),
    "dobb-two-sided": Setup("dobb", DOBB | {"two_sided": True, "row_blocks": 2}),
    "dobb-two-sided-foreach": Setup(
        "dobb", DOBB | {"two_sided": True, "num_blocks": 2, "foreach": True}
    ),
    "dobb-two-sided-outputs": Setup(
        "dobb", DOBB | {"two_sided": True, "row_stats": "outputs", "row_blocks": 2}
    ),
    "dobb-adam": Setup(
        "dobb", DOBB | {"coefficients": "adam", "update_scale": 1.0, "num_blocks": 2}
    ),
    "dobb-adam-two-sided-foreach": Setup(
        "dobb",
        DOBB | {"coefficients": "adam", "two_sided": True, "foreach": True, "num_blocks": 2},
    ),
    "dobb-bf16-projections": Setup(
        "dobb", DOBB | {"projection_dtype": "bfloat16", "foreach": True, "num_blocks": 2}
    ),
    "dobb-capturable": Setup(
        "dobb", DOBB | {"capturable": True, "nonfinite": "skip", "num_blocks": 2}, nan_step=True
    ),
    "dobb-skip": Setup("dobb", DOBB | {"nonfinite": "skip", "num_blocks": 2}, nan_step=True),
    "dobb-stats-step": Setup("dobb", DOBB | {"stats_sync": "step", "block_size": 4}),
    "dobb-cholqr": Setup("dobb", DOBB | {"basis_method": "cholqr", "num_blocks": 2}),
    "dobb-jacobi": Setup("dobb", DOBB | {"basis_method": "jacobi", "num_blocks": 2}),
    "dobb-power-qr": Setup("dobb", DOBB | {"basis_method": "power_qr", "foreach": True}),
    "dobb-gradients": Setup("dobb", DOBB | {"basis_source": "gradients", "num_blocks": 2}),
    "dobb-random": Setup("dobb", DOBB | {"basis_source": "random", "num_blocks": 2}),
    "dobb_sign": Setup("dobb_sign", {"basis_interval": 3}),
    "muon": Setup("muon"),
    "muon-foreach": Setup("muon", {"foreach": True, "ns_coefficients": "polar_express"}),
    "muonbp": Setup("muonbp", {"row_blocks": 2, "period": 3}),
    "muonbp-foreach": Setup("muonbp", {"row_blocks": 2, "col_blocks": 2, "foreach": True}),
    "blockmuon": Setup("blockmuon", {"row_blocks": 2}),
    "normuon": Setup("normuon"),
    "normuon-foreach": Setup("normuon", {"foreach": True}),
    "dion": Setup("dion"),
    "dion-foreach": Setup("dion", {"foreach": True, "rank": 3}),
    "dion-qr": Setup("dion", {"orthogonalize": "qr", "rank": 3}),
    "dion2": Setup("dion2", {"row_blocks": 2}),
    "dion2-foreach": Setup("dion2", {"row_blocks": 2, "foreach": True}),
    "nordion2": Setup("nordion2", {"row_blocks": 2}),
    "nordion2-foreach": Setup("nordion2", {"foreach": True}),
    "adamw": Setup("adamw"),
}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(WIDTHS[0], WIDTHS[1])
        self.fc2 = nn.Linear(WIDTHS[1], WIDTHS[2])

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(step: int, dtype: torch.dtype, rows: slice = slice(None)):
    """Step ``step``'s inputs and targets (8 rows of 3 tokens), ``rows`` of them."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, 3, WIDTHS[0], generator=gen) * torch.linspace(0.5, 2.0, WIDTHS[0])
    y = torch.sin(x[..., : WIDTHS[2]] * 1.5)
    return x[rows].to(dtype), y[rows].to(dtype)


def build(setup: Setup, model: nn.Module, **extra):
    import dobb

    return dobb.build_optimizer(setup.optimizer, model, **setup.options, **extra)


def train_steps(model, opt, steps, dtype, setup: Setup, rows=slice(None), record=None):
    for step in steps:
        x, y = batch(step, dtype, rows)
        opt.zero_grad()
        nn.functional.mse_loss(model(x).float(), y.float()).backward()
        if setup.nan_step and step == 3:
            next(model.parameters()).grad[0, 0] = float("nan")
        opt.step()
        if record is not None:
            record += [full(p).detach().clone() for p in model.parameters()]


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def state_tensors(opt) -> list[torch.Tensor]:
    """Every tensor of ``opt.state_dict()['state']``, in key order."""
    out = []
    for index in sorted(opt.state_dict()["state"]):
        entry = opt.state_dict()["state"][index]
        out += [full(entry[k]).detach().clone() for k in sorted(entry) if torch.is_tensor(entry[k])]
    return out


def run_setup(setup: Setup, dtype: torch.dtype) -> list[torch.Tensor]:
    """One setup in one process: ``RELOAD`` steps, a checkpoint, the rest in a new pair."""
    torch.manual_seed(0)
    model = MLP().to(dtype)
    opt = build(setup, model)
    record: list[torch.Tensor] = []
    train_steps(model, opt, range(1, RELOAD + 1), dtype, setup, record=record)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    model = MLP().to(dtype)
    model.load_state_dict(saved["model"])
    opt = build(setup, model)
    opt.load_state_dict(saved["opt"])
    train_steps(model, opt, range(RELOAD + 1, STEPS + 1), dtype, setup, record=record)
    return record + state_tensors(opt)


# distributed setups: (optimizer, options, layout, world size); run by ``run_layout``
DISTRIBUTED: dict[str, tuple[str, dict, str, int]] = {
    "dobb-ddp": ("dobb", {"num_blocks": 3}, "ddp", 2),
    "dobb-fsdp": ("dobb", {"num_blocks": 3}, "fsdp", 2),
    "dobb-fsdp-step": ("dobb", {"num_blocks": 3, "stats_sync": "step"}, "fsdp", 2),
    "dobb-tp": ("dobb", {"num_blocks": 2}, "tp", 2),
    "dobb-hsdp": ("dobb", {"num_blocks": 3, "foreach": True}, "hsdp", 4),
    "dobb-fsdp-tp": ("dobb", {"num_blocks": 2}, "fsdp_tp", 4),
    "dobb_sign-fsdp": ("dobb", {"two_sided": True, "num_blocks": 2}, "fsdp", 2),
    "dobb_sign-tp": ("dobb", {"two_sided": True, "num_blocks": 2}, "tp", 2),
    "muon-fsdp": ("muon", {}, "fsdp", 2),
    "muon-ddp": ("muon", {}, "ddp", 2),
    "muonbp-fsdp": ("muonbp", {"period": 2}, "fsdp", 2),
    "normuon-fsdp": ("normuon", {}, "fsdp", 2),
    "dion2-fsdp": ("dion2", {}, "fsdp", 2),
    "nordion2-fsdp": ("nordion2", {}, "fsdp", 2),
    "dion-fsdp": ("dion", {"rank": 3}, "fsdp", 2),
    "dion-tp": ("dion", {"rank": 3}, "tp", 2),
    "dion-ddp-compressed": ("dion", {"rank": 3}, "ddp-compressed", 2),
    "dion-hsdp": ("dion", {"rank": 3}, "hsdp", 4),
    "dion-fsdp-tp": ("dion", {"rank": 3}, "fsdp_tp", 4),
}


def parallel(model, layout: str, world: int):
    """``model`` under ``layout``; returns it, the data-parallel group (or mesh), this rank's
    data-parallel index and the number of them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.nn.parallel import DistributedDataParallel

    if layout.startswith("ddp"):
        if layout == "ddp-compressed":
            weights = ["fc1.weight", "fc2.weight"]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, weights)
        return DistributedDataParallel(model), dist.group.WORLD, dist.get_rank(), world
    shape = {"hsdp": (2, 2), "fsdp_tp": (2, 2)}.get(layout, (world,))
    names = {
        "fsdp": ("data_shard",),
        "tp": ("tensor",),
        "hsdp": ("data_replicate", "data_shard"),
        "fsdp_tp": ("data_shard", "tensor"),
    }[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if "tensor" in names:
        parallelize_module(
            model, mesh["tensor"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        )
        if layout == "tp":
            return model, None, 0, 1
    data = mesh["data_shard"] if layout == "fsdp_tp" else mesh
    for module in (model.fc1, model.fc2, model):
        fully_shard(module, mesh=data)
    index = 0
    for axis, coordinate in enumerate(data.get_coordinate()):
        index = index * data.size(axis) + coordinate
    return model, data, index, data.size()


def run_layout(rank: int, world: int, name: str) -> list[torch.Tensor]:
    """A distributed setup on this rank: its steps, a reload, its full tensors."""
    try:
        from dobb.registry import get_entry
    except ImportError:  # commits before dobb.registry (the same table, in dobb.optim)
        from dobb.optim.registry import get_entry

    optimizer, options, layout, _ = DISTRIBUTED[name]
    setup = Setup(optimizer, DOBB | options if optimizer == "dobb" else options)
    record: list[torch.Tensor] = []
    saved = None
    for phase in ("first", "second"):
        torch.manual_seed(0)
        model, data, index, size = parallel(MLP(), layout, world)
        group = {} if layout == "ddp-compressed" else get_entry(optimizer).distributed_options(data)
        if layout == "ddp-compressed":
            group = {"sync_group": data}
        opt = build(setup, model, **group)
        rows = slice(index * 8 // size, (index + 1) * 8 // size)
        if phase == "first":
            steps = range(1, RELOAD + 1)
        else:
            from torch.distributed.checkpoint.state_dict import (
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            set_model_state_dict(model, saved["model"])
            set_optimizer_state_dict(model, opt, saved["opt"])
            steps = range(RELOAD + 1, STEPS + 1)
        train_steps(model, opt, steps, torch.float32, setup, rows, record)
        if phase == "first":
            from torch.distributed.checkpoint.state_dict import (
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            saved = copy.deepcopy(
                {"model": get_model_state_dict(model), "opt": get_optimizer_state_dict(model, opt)}
            )
    return record + state_tensors(opt)


def dump(path: str, only: list[str] | None) -> None:
    from bench.tools.launch import run_ranks

    out: dict[str, list[torch.Tensor]] = {}
    for name, setup in SETUPS.items():
        if only and name not in only:
            continue
        for tag, dtype in DTYPES.items():
            out[f"{name}/{tag}"] = run_setup(setup, dtype)
    for name, (_, _, _, world) in DISTRIBUTED.items():
        if only and name not in only:
            continue
        for rank, tensors in enumerate(run_ranks(run_layout, world, name, timeout=600)):
            out[f"{name}/rank{rank}"] = tensors
    torch.save(out, path)
    print(f"{sum(len(v) for v in out.values())} tensors of {len(out)} runs -> {path}")


def compare(before: str, after: str) -> int:
    a, b = torch.load(before), torch.load(after)
    differ = 0
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            print(f"{key}: only in {'after' if key in b else 'before'}")
            differ += 1
            continue
        if len(a[key]) != len(b[key]):
            print(f"{key}: {len(a[key])} tensors before, {len(b[key])} after")
            differ += 1
            continue
        bad = [i for i, (x, y) in enumerate(zip(a[key], b[key])) if not torch.equal(x, y)]
        if bad:
            differ += 1
            print(f"{key}: {len(bad)} of {len(a[key])} tensors differ (first: {bad[0]})")
    tensors = sum(len(v) for v in a.values())
    print(f"{len(a)} runs, {tensors} tensors compared: {differ} runs differ")
    return differ


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--only", nargs="*")
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    args = parser.parse_args()
    if args.command == "dump":
        dump(args.out, args.only)
        return 0
    return 1 if compare(args.before, args.after) else 0


if __name__ == "__main__":
    raise SystemExit(main())
