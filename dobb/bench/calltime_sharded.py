"""Optimizer-call time with the matrices sharded by FSDP2 or HSDP over several ranks.

    python -m dobb.bench.calltime_sharded --layout fsdp --world 4 --config gpt2-xl --layers 1

Spawns ``--world`` ranks on this machine (gloo on CPU, ``dobb.distributed.launch``). Each
rank builds the same ``LinearStack`` as ``dobb.bench.calltime``, shards every layer with
``fully_shard`` (``fsdp``: a 1-D ``data_shard`` mesh; ``hsdp``: ``2 x world/2``
``data_replicate x data_shard``), runs one forward+backward, and times every optimizer's
call, amortized over Dobb's refresh period, in each optimizer's real distributed form:
Dobb averages statistics and shares the refresh over the mesh, Dion reduces its power
iteration over the shard axis, Muon gathers whole matrices to owner ranks. Ranks share
this machine's cores, so compare the optimizers with each other, not with one process.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from dobb.bench.calltime import LinearStack, forward_backward, time_optimizers
from dobb.bench.costmodel import OPTIMIZERS, hidden_matrices

LAYOUT_AXES = {"fsdp": ("data_shard",), "hsdp": ("data_replicate", "data_shard")}


def rank_timings(rank: int, world: int, layout: str, options: dict) -> dict:
    """On one rank: shard the stack, time the optimizers; ``{name: median ms, ...}``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    axes = LAYOUT_AXES[layout]
    shape = (world,) if len(axes) == 1 else (2, world // 2)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=axes)
    torch.manual_seed(0)
    stack = LinearStack(hidden_matrices(options["config"], options["layers"]), options["tokens"])
    for layer in stack.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(stack, mesh=mesh)
    forward_backward(stack, autocast=False)
    names = options["names"]
    result = time_optimizers(
        stack,
        names,
        repeats=options["repeats"],
        warmup=1,
        basis_interval=options["basis_interval"],
        distributed={"dobb": {"data_parallel": mesh}},
    )
    return {name: 1e3 * result[name]["call_s"]["median"] for name in names}


def table(per_rank: list[dict], layout: str, world: int) -> str:
    """Markdown: per optimizer the slowest rank's median call time and the ratio to Dobb."""
    names = list(per_rank[0])
    slowest = {name: max(r[name] for r in per_rank) for name in names}
    lines = [
        "| optimizer | layout | ranks | median ms (slowest rank) | x Dobb |",
        "|---|---|---:|---:|---:|",
    ]
    for name in names:
        ratio = slowest[name] / slowest["dobb"] if "dobb" in slowest else float("nan")
        lines.append(f"| {name} | {layout} | {world} | {slowest[name]:.1f} | {ratio:.2f} |")
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
    parser.add_argument("--basis-interval", type=int, default=10, help="Dobb's k")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for all ranks")
    parser.add_argument("--out", type=Path, help="JSON output")
    args = parser.parse_args(argv)
    if args.layout == "hsdp" and args.world % 2:
        raise ValueError(f"hsdp needs an even --world, got {args.world}")
    from dobb.distributed.launch import run_ranks

    options = dict(
        config=args.config,
        layers=args.layers,
        tokens=args.tokens,
        repeats=args.repeats,
        basis_interval=args.basis_interval,
        names=tuple(n for n in args.optimizers.split(",") if n),
    )
    per_rank = run_ranks(rank_timings, args.world, args.layout, options, timeout=args.timeout)
    command = "python -m dobb.bench.calltime_sharded " + " ".join(argv)
    if args.out:
        record = {"command": command, "layout": args.layout, "world": args.world, **options}
        args.out.write_text(json.dumps({**record, "per_rank_ms": per_rank}, indent=1) + "\n")
    print(f"`{command}`, torch {torch.__version__}\n")
    print(table(per_rank, args.layout, args.world))


if __name__ == "__main__":
    main(sys.argv[1:])
