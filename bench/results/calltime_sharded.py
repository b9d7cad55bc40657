"""Optimizer-call time with the matrices sharded by FSDP2, HSDP or TP over several ranks.

    python -m bench.results.calltime_sharded --layout fsdp --world 4 --config gpt2-xl --layers 1

Spawns ``--world`` ranks on this machine (gloo on CPU, ``bench.tools.launch``). Each
rank builds the same ``LinearStack`` as ``bench.results.calltime`` and shards it:

- ``fsdp``: ``fully_shard`` on a 1-D ``data_shard`` mesh (every matrix ``Shard(0)``);
- ``hsdp``: ``fully_shard`` on a ``2 x world/2`` ``data_replicate x data_shard`` mesh;
- ``tp``: Megatron's plan on a 1-D ``tensor`` mesh: q, k, v and the MLP's up projection
  column-parallel (``Shard(0)``), the two output projections row-parallel (``Shard(1)``).

Then it runs one forward+backward and times every optimizer's call, amortized over its
period (Dobb's refresh, MuonBP's full step), in each optimizer's real distributed form:
Dobb averages statistics over the data axes (none under TP: every TP rank sees the same
tokens) and shares the refresh among those ranks, Dion reduces its power iteration over
the shard axis, Muon gathers whole matrices to owner ranks, MuonBP orthogonalizes each
rank's shard on block steps and takes Muon's path on full steps. Ranks share this
machine's cores, so compare the optimizers with each other, not with one process.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.model.workload import hidden_matrices
from bench.optimizers import CALL_SETTINGS, SUBJECT, lab_entry
from bench.results.calltime import OPTIMIZERS, device_name, time_optimizers
from bench.results.linear_stack import LinearStack, forward_backward
from bench.tools.matmul_dtype import fastest_ns_dtype
from bench.tools.records import stamped
from dobb.registry import get_entry
from dobb.train.parallel import ROW_PARALLEL

LAYOUT_AXES = {
    "fsdp": ("data_shard",),
    "hsdp": ("data_replicate", "data_shard"),
    "tp": ("tensor",),
}


def shard(stack: LinearStack, layout: str, world: int):
    """Shard ``stack`` in place; returns the mesh its statistics are averaged over (or None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    axes = LAYOUT_AXES[layout]
    shape = (world,) if len(axes) == 1 else (2, world // 2)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=axes)
    if layout == "tp":
        # the stack feeds every layer the whole input and contracts its whole output, so
        # column-parallel outputs are gathered and row-parallel inputs split on the way in
        plan = {
            f"layers.{key}": RowwiseParallel(input_layouts=Replicate())
            if m.name.endswith(ROW_PARALLEL)
            else ColwiseParallel(output_layouts=Replicate())
            for key, m in zip(stack.layers, stack.matrices)
        }
        parallelize_module(stack, mesh, plan)
        return None
    for layer in stack.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(stack, mesh=mesh)
    return mesh


def rank_timings(rank: int, world: int, layout: str, options: dict) -> dict:
    """On one rank: shard the stack, time the optimizers; ``{name: {"median": ms, "q1":
    ms, "q3": ms}}`` over the repeats."""
    torch.manual_seed(0)
    stack = LinearStack(hidden_matrices(options["config"], options["layers"]), options["tokens"])
    data_parallel = shard(stack, layout, world)
    forward_backward(stack, autocast=False)
    names = options["names"]
    result = time_optimizers(
        stack,
        names,
        repeats=options["repeats"],
        warmup=1,
        basis_interval=options["basis_interval"],
        period=options["period"],
        ns_dtype=options["newton_schulz"]["ns_dtype"],
        distributed={name: get_entry(name).distributed_options(data_parallel) for name in names},
    )
    quantiles = ("median", "q1", "q3")
    return {name: {q: 1e3 * result[name]["call_s"][q] for q in quantiles} for name in names}


def run(
    layout: str = "fsdp",
    world: int = 2,
    *,
    config: str = "gpt2-xl",
    layers: int = 1,
    names: tuple[str, ...] = OPTIMIZERS,
    tokens: int = 512,
    repeats: int = 3,
    basis_interval: int = CALL_SETTINGS["basis_interval"],
    period: int = CALL_SETTINGS["period"],
    ns_dtype: str = "fastest",
    timeout: float = 600.0,
) -> dict:
    """Time ``names`` on ``world`` ranks under ``layout``; the record (per-rank medians)."""
    if layout not in LAYOUT_AXES:
        raise ValueError(f"unknown layout {layout!r}; choose one of {sorted(LAYOUT_AXES)}")
    if layout == "hsdp" and world % 2:
        raise ValueError(f"hsdp needs an even --world, got {world}")
    from bench.tools.launch import run_ranks

    unsupported = tuple(
        n for n in names if layout == "tp" and not lab_entry(n).splits_columns
    )  # row-parallel TP splits the output projections' columns
    names = tuple(n for n in names if n not in unsupported)
    options = dict(
        config=config,
        layers=layers,
        tokens=tokens,
        repeats=repeats,
        basis_interval=basis_interval,
        period=period,
        names=names,
        newton_schulz=fastest_ns_dtype(torch.device("cpu"), ns_dtype),
    )
    per_rank = run_ranks(rank_timings, world, layout, options, timeout=timeout)
    command = (
        f"python -m bench.results.calltime_sharded --layout {layout} --world {world} --config "
        f"{config} --layers {layers} --optimizers {','.join(names)} --tokens {tokens} "
        f"--repeats {repeats} --basis-interval {basis_interval} --period {period} "
        f"--ns-dtype {ns_dtype}"
    )
    return stamped(  # its names are today's lab names, whoever writes it
        {
            "command": command,
            "layout": layout,
            "world": world,
            "torch": torch.__version__,
            "device_name": device_name(torch.device("cpu")),
            **options,
            "unsupported": unsupported,
            "per_rank_ms": per_rank,
        }
    )


def slowest_ranks(record: dict) -> dict[str, dict[str, float]]:
    """Per optimizer (in the record's order), the timing (``median``, ``q1``, ``q3``, in ms)
    of its slowest rank: the call time of a sharded step."""
    per_rank = record["per_rank_ms"]
    return {
        name: max((r[name] for r in per_rank), key=lambda t: t["median"]) for name in per_rank[0]
    }


def table(record: dict) -> str:
    """Markdown: per optimizer the slowest rank's median call time (and that rank's
    quartiles over the repeats), and its ratio to Dobb's."""
    layout, world = record["layout"], record["world"]
    slowest = slowest_ranks(record)
    names = list(slowest)
    lines = [
        "| optimizer | layout | ranks | median ms (slowest rank) | IQR ms | x Dobb |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name in names:
        t = slowest[name]
        ratio = t["median"] / slowest[SUBJECT]["median"] if SUBJECT in slowest else float("nan")
        lines.append(
            f"| {name} | {layout} | {world} | {t['median']:.1f} | {t['q1']:.1f}–{t['q3']:.1f} "
            f"| {ratio:.2f} |"
        )
    lines += [
        f"| {name} | {layout} | {world} | not supported (splits rows only) | | |"
        for name in record.get("unsupported", ())
    ]
    ns = record.get("newton_schulz")
    if ns:
        lines += [
            "",
            f"Newton-Schulz in {ns['ns_dtype']} ({ns['chosen_by']}); {record['device_name']}.",
        ]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=sorted(LAYOUT_AXES), default="fsdp")
    parser.add_argument("--world", type=int, default=2, help="ranks (hsdp: even)")
    parser.add_argument("--config", default="gpt2-xl", help="GPT config (dobb.train.model)")
    parser.add_argument("--layers", type=int, default=1, help="transformer blocks to include")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated")
    parser.add_argument("--tokens", type=int, default=512, help="rows of the token batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--basis-interval", type=int, default=CALL_SETTINGS["basis_interval"], help="Dobb's k"
    )
    parser.add_argument(
        "--period", type=int, default=CALL_SETTINGS["period"], help="MuonBP's full-step period P"
    )
    parser.add_argument("--ns-dtype", choices=("fastest", "bfloat16", "float32"), default="fastest")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for all ranks")
    parser.add_argument("--out", type=Path, help="JSON output")
    args = parser.parse_args(argv)
    record = run(
        args.layout,
        args.world,
        config=args.config,
        layers=args.layers,
        names=tuple(n for n in args.optimizers.split(",") if n),
        tokens=args.tokens,
        repeats=args.repeats,
        basis_interval=args.basis_interval,
        period=args.period,
        ns_dtype=args.ns_dtype,
        timeout=args.timeout,
    )
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"`{record['command']}`, torch {torch.__version__}\n")
    print(table(record))


if __name__ == "__main__":
    main(sys.argv[1:])
