"""Communication inside one optimizer step, measured and counted from the algorithm.

    python -m dobb.bench.comm [--world 4] [--config tiny] [--out benchmarks/COMM.md]

Spawns ``--world`` gloo ranks on this machine (``dobb.distributed.launch``). For each
layout (``ddp``, ``fsdp``, ``tp``, ``fsdp_tp``; ``dobb.train.parallel``) and optimizer
(Dobb; Dion with rank fraction 1/16 and randomized Cholesky QR, the paper's distributed
form; Muon) it builds a GPT from ``dobb.train.model``, takes two steps and records the
collectives issued inside ``opt.step()`` with ``CommRecorder``: Dobb's first step
refreshes its bases (and averages its statistics), its second does not; Dion and Muon
communicate alike every step (their second step is shown). Gradient reduction in the
backward pass (DDP, FSDP) is the same for every optimizer and is not counted.

Bytes follow ``CommRecorder``'s convention (the full buffer of each collective, as
nccl-tests' "size"; all_to_all: what this rank sends), averaged over ranks. The analytic
column evaluates the formula on the model's shapes and this rank's pieces:

- Dobb: on refresh steps ``sum_layers d_in²/B`` fp32 (the blocks ``C_b`` this rank
  holds), one all-reduce per data axis; nothing otherwise.
- Dion (``m x n``, rank ``r``, sketch ``k = 128 ceil(1.25 r / 128)``): per axis
  splitting rows ``(k r + 1) + r² + n_local r`` (``S P`` with the ``B != 0`` flag,
  ``P₁ᵀ P₁``, ``Bᵀ P``), per axis splitting columns ``(m_local r + 1) + r`` (``B Q``
  with the flag, column norms), fp32; batched: one all-reduce per axis and round.
- Muon: ``m n (W - 1) / W`` fp32 to the owners and ``m n (W - 1) / W`` bf16 back, over
  all ``W`` ranks of the mesh together, for an evenly split matrix (per rank: ``/ W``);
  DDP: nothing to the owners, ``m n (W - 1)`` bf16 back (per rank ``/ W``).
- NorMuon: Muon's, plus (sharded layouts) one all-reduce of one fp64 ``||Ô||_F²`` per
  matrix.
- Dion2: Muon's on the ``K x n`` matrix of selected rows, ``K = Σ_shards ceil(f m_local)``
  (DDP: ``K = ceil(f m)``). NorMuon and Dion2 need whole rows on each rank, so they run
  under ``ddp`` and ``fsdp`` only (TP's row-parallel weights split columns).
"""

import argparse
import math
import os
import platform
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist

from dobb.optim.registry import get_entry

LAYOUTS = ("ddp", "fsdp", "tp", "fsdp_tp")
OPTIMIZERS = ("dobb", "dion", "muon", "muonbp", "normuon", "dion2")
COLUMN_SPLITS = ("tp", "fsdp_tp")  # layouts that split some matrices' columns
BATCH = 4  # sequences per rank and step


def measure(rank: int, world: int, config: str, layouts, optimizers) -> list[dict]:
    """On every rank: per (layout, optimizer, step) the events and the analytic bytes."""
    from dobb.distributed import CommRecorder
    from dobb.optim.registry import build_optimizer
    from dobb.train.model import GPT, gpt_config
    from dobb.train.parallel import parallelize

    cfg = gpt_config(config)
    rows = []
    for layout in layouts:
        for name in optimizers:
            if layout in COLUMN_SPLITS and not get_entry(name).splits_columns:
                continue
            torch.manual_seed(0)
            model, par = parallelize(GPT(cfg), layout, tensor_parallel=2)
            opt = build_optimizer(name, model, **_options(name, par.data_parallel))
            gen = torch.Generator().manual_seed(rank)
            for step in (1, 2):
                idx = torch.randint(cfg.vocab_size, (BATCH, cfg.block_size + 1), generator=gen)
                opt.zero_grad()
                model(idx[:, :-1], idx[:, 1:])[1].backward()
                with CommRecorder() as rec:
                    opt.step()
                events = [(e.kind, e.group_size, e.nbytes) for e in rec.events]
                analytic = analytic_bytes(name, layout, opt, world, step)
                rows.append(
                    dict(layout=layout, name=name, step=step, events=events, analytic=analytic)
                )
    return rows


def _options(name: str, data_parallel) -> dict:
    """The main job's options (``compare.OPTIONS``) and what the trainer hands the optimizer
    for this layout (its registry entry's ``distributed_options``)."""
    from dobb.train.compare import OPTIONS

    return OPTIONS[name] | get_entry(name).distributed_options(data_parallel)


def analytic_bytes(name: str, layout: str, opt, world: int, step: int) -> int:
    """This rank's bytes in ``opt.step()`` by the formulas of the module docstring."""
    from dobb.distributed.placement import matrix_placement
    from dobb.optim.dion import Dion
    from dobb.optim.dion2 import Dion2, selected_count

    matrices = [(p, g) for g in opt.param_groups if g["algorithm"] == name for p in g["params"]]
    if name == "muonbp":  # a full step (the first, then every period) moves what Muon's does
        if any(not _muonbp_full_step(step, g) for _, g in matrices):
            return 0
        name = "muon"
    if name == "normuon" and layout != "ddp":  # ||Ô||_F² of every matrix, one fp64 each
        total = 8 * len(matrices)
    else:
        total = 0
    gathered: Counter = Counter()  # Dobb's sharded refresh: blocks per size, all matrices
    for p, group in matrices:
        placement = matrix_placement(p)
        m, n = p.shape
        m_local, n_local = len(placement.rows), len(placement.cols)
        if name == "dion2":  # Muon's exchange on the selected rows: K x n, K = W k_local
            blocks = Dion2.blocks(m_local, group)
            m_local = sum(selected_count(b, group["fraction"]) for b in blocks)
            m = m_local * (1 if layout == "ddp" else world)
        split_rows, split_cols = len(placement.row_groups), len(placement.col_groups)
        if name == "dobb":
            refresh = (step - 1) % group["basis_interval"] == 0
            blocks = sum(s.count * s.size**2 for s in opt.local_blocks(p))  # local C_b
            axes = len(opt.stats_groups) if refresh else 0
            total += 4 * blocks * axes
            if refresh and axes:
                gathered.update({s.size: s.count for s in opt.local_blocks(p)})
        elif name == "dion":
            r = Dion.rank_of((m, n), group)
            k = 128 * math.ceil(1.25 * r / 128)
            floats = split_rows * ((k * r + 1) + r * r + n_local * r)
            floats += split_cols * ((m_local * r + 1) + r)
            total += 4 * floats
        elif layout == "ddp":  # the owner sends W - 1 copies of its matrices; per rank / W
            total += 2 * m * n * (world - 1) // world
        elif split_rows or split_cols:  # to the owner in fp32, back in bf16; per rank / W
            total += (4 + 2) * m * n * (world - 1) // world**2
    if gathered:  # one all-gather per block size, padded to a multiple of the group size
        ranks = dist.get_world_size(opt.stats_groups[-1])
        total += sum(4 * ranks * -(-count // ranks) * size**2 for size, count in gathered.items())
    return total


def _muonbp_full_step(step: int, group: dict) -> bool:
    return group["period"] is not None and (step - 1) % group["period"] == 0


def summarize(kinds: list[tuple[str, int]]) -> str:
    """``[("all_reduce", 4)] * 3`` -> ``"3 all_reduce(4)"``; none -> ``"-"``."""
    if not kinds:
        return "-"
    counts = Counter(kinds)
    return ", ".join(f"{c} {kind}({size})" for (kind, size), c in counts.items())


FORMULAS = {
    "dobb": "refresh: Σ d_in²/B fp32 per data axis + bases all-gather Σ_s P⌈n_s/P⌉ s²; else 0",
    "dion": "per row axis (k r + 1 + r² + n r), per col axis (m r + 1 + r) fp32",
    "muon": "m n (W-1)/W fp32 to owner + m n (W-1)/W bf16 back (DDP: m n (W-1) bf16)",
    "muonbp": "full step (step 1, then every period): as Muon; block step: 0",
    "normuon": "as Muon + 1 fp64 per matrix all-reduced (DDP: as Muon)",
    "dion2": "as Muon on the K x n selected rows, K = Σ_shards ceil(f m_shard)",
}


def report(results: list[list[dict]], world: int, config: str, command: str) -> str:
    """The Markdown table (per row: rank 0's collectives, bytes averaged over ranks)."""
    lines = [
        "# Communication per optimizer step",
        "",
        f"Measured with `{command}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: "
        f"{world} gloo ranks on one machine ({platform.machine()}, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}, torch {torch.__version__}); "
        f"model `dobb.train.model.GPT` `{config}`, `fsdp_tp` with tensor-parallel degree 2, "
        "`tp` over all ranks. Collectives and bytes are those inside `opt.step()` "
        "(CommRecorder: full-buffer bytes; all_to_all: bytes sent), averaged over ranks; "
        "gradient reduction in the backward pass is not counted. Dion: rank fraction 1/16, "
        "randomized Cholesky QR. Muon: bf16 Newton-Schulz; under DDP the replicas split the "
        "matrices (Keller's distributed Muon). Dobb: basis interval 10 (step 1 refreshes). "
        "MuonBP: period 5 (step 1 is a full step, step 2 a block step on local shards).",
        "",
        "| optimizer | layout | step | collectives / step (kind(group size)) "
        "| bytes / step measured | analytic | formula |",
        "|---|---|---|---|---:|---:|---|",
    ]
    for i, row in enumerate(results[0]):
        name, step = row["name"], row["step"]
        if name not in ("dobb", "muonbp") and step == 1:
            continue  # Dion and Muon communicate alike every step
        measured = sum(e[2] for r in results for e in r[i]["events"])
        analytic = sum(r[i]["analytic"] for r in results)
        label = {
            "dobb": "refresh" if step == 1 else "no refresh",
            "muonbp": "full" if step == 1 else "block",
        }.get(name, "any")
        kinds = summarize([(kind, size) for kind, size, _ in row["events"]])
        lines.append(
            f"| {name} | {row['layout']} | {label} | {kinds} | {measured // world:,} "
            f"| {analytic // world:,} | {FORMULAS[name]} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="ranks to spawn (even, >= 2)")
    parser.add_argument("--config", default="tiny", help="GPT config (dobb.train.model)")
    parser.add_argument("--out", type=Path, help="write the Markdown table here")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for all ranks")
    args = parser.parse_args(argv)
    if args.world < 2 or args.world % 2:
        parser.error("--world must be even and >= 2 (fsdp_tp uses a tensor-parallel degree of 2)")
    from dobb.distributed.launch import run_ranks

    # a gloo measurement on CPU: keep the ranks off any GPU (dobb.train.parallel would
    # build CUDA meshes), whatever the machine has
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    results = run_ranks(measure, args.world, args.config, LAYOUTS, OPTIMIZERS, timeout=args.timeout)
    command = "python -m dobb.bench.comm " + " ".join(argv if argv is not None else sys.argv[1:])
    table = report(results, args.world, args.config, command.strip())
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
