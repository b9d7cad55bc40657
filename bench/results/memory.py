"""Optimizer memory per rank: every live tensor that is not a parameter, measured under FSDP2.

    python -m bench.results.memory --config gpt2 --layers 1 --worlds 1 2 4

Spawns each world size's ranks on this machine (gloo, ``bench.tools.launch``). Each rank
builds the call-time benchmarks' ``LinearStack`` (a model's hidden matrices), shards every
layer with ``fully_shard`` over all ranks (``Shard(0)``: each rank keeps ``ceil(d_out / P)``
rows of each matrix), and for each registry optimizer in turn, at its defaults in its
distributed form (``OptimizerEntry.distributed_options``):

- one forward and backward first, so FSDP's own buffers exist before the baseline;
- the bytes of every live tensor storage in the process that is neither a parameter's
  (local shard) nor a gradient (``live_bytes``), before the optimizer is built;
- ``steps`` calls (each after a forward and backward; the default covers a refresh of
  Dobb's bases and a full step of MuonBP), gradients dropped;
- the same count again: the difference is what the optimizer keeps alive, wherever it
  keeps it (state, statistics sums, caches, bases), counted once per storage.

``python -m bench plan`` prints the cost model's prediction of the same figure
(``bench.model.costmodel.rank_state_bytes``) beside its error against these records.
"""

import argparse
import gc
import json
import platform
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch import nn

from bench.model.workload import hidden_matrices
from bench.results.calltime_sharded import shard
from bench.results.linear_stack import LinearStack, forward_backward
from bench.tools.records import stamped
from dobb.registry import OPTIMIZERS, build_optimizer, get_entry

RECORD = Path("benchmarks/memory.json")
STEPS = 11  # Dobb refreshes on calls 1 and 11 (basis_interval 10); MuonBP's full step at 5


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def live_bytes(model: nn.Module) -> int:
    """Bytes of every live tensor storage in this process but ``model``'s parameters' and
    gradients' (each storage once; a DTensor counts as its local shard)."""
    gc.collect()
    skip = set()
    for p in model.parameters():
        for t in (p, p.grad):
            if t is not None:
                skip.add(_local(t).untyped_storage().data_ptr())
    seen, total = set(), 0
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or obj.is_meta:  # type(): no attribute reads
            continue
        t = _local(obj)
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in skip or ptr in seen:
            continue
        seen.add(ptr)
        total += storage.nbytes()
    return total


def rank_memory(rank: int, world: int, options: dict) -> dict:
    """On one rank: ``{name: {"bytes": ..., "local_params": ...}}`` for each optimizer."""
    torch.manual_seed(0)
    matrices = hidden_matrices(options["config"], options["layers"])
    stack = LinearStack(matrices, options["tokens"])
    mesh = shard(stack, "fsdp", world)
    local = sum(_local(p).numel() for p in stack.parameters())
    out = {}
    for name in options["names"]:
        forward_backward(stack, autocast=False)
        stack.zero_grad(set_to_none=True)
        before = live_bytes(stack)
        entry = get_entry(name)
        opt = build_optimizer(name, stack, entry.lr, **entry.distributed_options(mesh))
        for _ in range(options["steps"]):
            forward_backward(stack, autocast=False)
            opt.step()
        stack.zero_grad(set_to_none=True)
        out[name] = {"bytes": live_bytes(stack) - before, "local_params": local}
        if hasattr(opt, "untrack"):
            opt.untrack()
        del opt
    return out


def run(
    config: str = "gpt2",
    layers: int = 1,
    worlds: tuple[int, ...] = (1, 2, 4),
    *,
    names: tuple[str, ...] = tuple(OPTIMIZERS),
    tokens: int = 256,
    steps: int = STEPS,
    timeout: float = 600.0,
) -> dict:
    """Measure ``names`` at each world size; the record: per world, the largest rank's bytes
    per optimizer (ranks differ where rows do not split evenly)."""
    from bench.tools.launch import run_ranks

    options = dict(config=config, layers=layers, tokens=tokens, steps=steps, names=names)
    per_world = {}
    for world in worlds:
        ranks = run_ranks(rank_memory, world, options, timeout=timeout)
        per_world[str(world)] = {
            name: max((r[name] for r in ranks), key=lambda x: x["bytes"]) for name in names
        }
    meta = dict(options, names=list(names), worlds=list(worlds), layout="fsdp") | where()
    return stamped({"meta": meta, "worlds": per_world})


def where() -> dict:
    """The command, machine, torch and date a record was measured with."""
    return {
        "command": shlex.join(["python", "-m", "bench.results.memory", *sys.argv[1:]]),
        "machine": platform.platform(),
        "torch": torch.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="gpt2")
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=RECORD)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per world size")
    args = parser.parse_args(argv)
    worlds = tuple(args.worlds)
    record = run(args.config, args.layers, worlds, tokens=args.tokens, timeout=args.timeout)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for world, row in record["worlds"].items():
        cells = ", ".join(f"{n} {r['bytes'] / r['local_params']:.2f}" for n, r in row.items())
        print(f"{world} ranks, B per local parameter: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
