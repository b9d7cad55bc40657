"""Communication inside one optimizer step, measured and counted from the algorithm.

    python -m bench.results.comm [--world 4] [--config tiny] [--out benchmarks/COMM.md]

Spawns ``--world`` gloo ranks on this machine (``bench.tools.launch``). For each
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
import os
import platform
import sys
from collections import Counter
from datetime import UTC, datetime
from fractions import Fraction
from pathlib import Path

import torch

from bench.optimizers import cost_model, in_table, lab_entry
from bench.tools.markdown import markdown_table
from dobb.registry import get_entry

LAYOUTS = ("ddp", "fsdp", "tp", "fsdp_tp")
OPTIMIZERS = in_table("comm")
COLUMN_SPLITS = ("tp", "fsdp_tp")  # layouts that split some matrices' columns
BATCH = 4  # sequences per rank and step
TENSOR_PARALLEL = 2  # fsdp_tp's tensor-parallel degree
SETTINGS = ("rank_fraction", "basis_interval", "period")  # the report quotes them


def measure(rank: int, world: int, config: str, layouts, optimizers) -> list[dict]:
    """On every rank: per (layout, optimizer, step) the events and the analytic bytes."""
    from bench.tools.comm_recorder import CommRecorder
    from dobb.registry import build_optimizer
    from dobb.train.model import GPT, gpt_config
    from dobb.train.parallel import parallelize

    cfg = gpt_config(config)
    rows = []
    for layout in layouts:
        for name in optimizers:
            if layout in COLUMN_SPLITS and not lab_entry(name).splits_columns:
                continue
            torch.manual_seed(0)
            model, par = parallelize(GPT(cfg), layout, tensor_parallel=TENSOR_PARALLEL)
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
                settings = {k: g[k] for g in opt.param_groups for k in SETTINGS if k in g}
                rows.append(
                    dict(
                        layout=layout,
                        name=name,
                        step=step,
                        events=events,
                        analytic=analytic,
                        settings=settings,
                    )
                )
    return rows


def _options(name: str, data_parallel) -> dict:
    """The comparisons' settings and what the trainer hands the optimizer for this layout
    (its lab entry's ``harness_options``, its registry entry's ``distributed_options``)."""
    return lab_entry(name).harness_options | get_entry(name).distributed_options(data_parallel)


def analytic_bytes(name: str, layout: str, opt, world: int, step: int) -> int:
    """This rank's bytes in ``opt.step()`` by the formulas of the module docstring (the
    entry's cost model, ``bench.model.costs``: ``comm_bytes``)."""
    group = get_entry(name).cls.algorithm
    matrices = [(p, g) for g in opt.param_groups if g["algorithm"] == group for p in g["params"]]
    return cost_model(name).comm_bytes(opt, matrices, layout, world, step)


def summarize(kinds: list[tuple[str, int]]) -> str:
    """``[("all_reduce", 4)] * 3`` -> ``"3 all_reduce(4)"``; none -> ``"-"``."""
    if not kinds:
        return "-"
    counts = Counter(kinds)
    return ", ".join(f"{c} {kind}({size})" for (kind, size), c in counts.items())


def report(results: list[list[dict]], world: int, config: str, command: str) -> str:
    """The Markdown table (per row: rank 0's collectives, bytes averaged over ranks)."""
    settings = {r["name"]: r["settings"] for r in results[0]}
    fraction = next(s["rank_fraction"] for s in settings.values() if "rank_fraction" in s)
    fraction = Fraction(fraction).limit_denominator(1024)
    lines = [
        "# Communication per optimizer step",
        "",
        f"Measured with `{command}` on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: "
        f"{world} gloo ranks on one machine ({platform.machine()}, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}, torch {torch.__version__}); "
        f"model `dobb.train.model.GPT` `{config}`, `fsdp_tp` with tensor-parallel degree "
        f"{TENSOR_PARALLEL}, "
        "`tp` over all ranks. Collectives and bytes are those inside `opt.step()` "
        "(CommRecorder: full-buffer bytes; all_to_all: bytes sent), averaged over ranks; "
        "gradient reduction in the backward pass is not counted. Dion: rank fraction "
        f"{fraction}, randomized Cholesky QR. Muon: bf16 Newton-Schulz; under DDP the replicas "
        "split the matrices (Keller's distributed Muon). Dobb: basis interval "
        f"{settings['dobb_paper']['basis_interval']} (step 1 refreshes). MuonBP: period "
        f"{settings['muonbp']['period']} (step 1 is a full step, step 2 a block step on local "
        "shards).",
        "",
    ]
    rows = []
    for i, row in enumerate(results[0]):
        name, step = row["name"], row["step"]
        calls = lab_entry(name).periodic_calls
        if calls is None and step == 1:
            continue  # Dion and Muon communicate alike every step
        measured = sum(e[2] for r in results for e in r[i]["events"])
        analytic = sum(r[i]["analytic"] for r in results)
        label = calls[step - 1] if calls else "any"
        kinds = summarize([(kind, size) for kind, size, _ in row["events"]])
        formula = cost_model(name).COMM_FORMULA
        rows.append(
            [
                name,
                row["layout"],
                label,
                kinds,
                f"{measured // world:,}",
                f"{analytic // world:,}",
                formula,
            ]
        )
    headers = [
        "optimizer",
        "layout",
        "step",
        "collectives / step (kind(group size))",
        "bytes / step measured",
        "analytic",
        "formula",
    ]
    table = markdown_table(headers, rows, align="llllrrl", pad=False)
    return "\n".join([*lines, table]) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="ranks to spawn (even, >= 2)")
    parser.add_argument("--config", default="tiny", help="GPT config (dobb.train.model)")
    parser.add_argument("--out", type=Path, help="write the Markdown table here")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for all ranks")
    args = parser.parse_args(argv)
    if args.world < 2 or args.world % 2:
        parser.error("--world must be even and >= 2 (fsdp_tp uses a tensor-parallel degree of 2)")
    from bench.tools.launch import run_ranks

    # a gloo measurement on CPU: keep the ranks off any GPU (dobb.train.parallel would
    # build CUDA meshes), whatever the machine has
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    results = run_ranks(measure, args.world, args.config, LAYOUTS, OPTIMIZERS, timeout=args.timeout)
    command = "python -m bench.results.comm " + " ".join(argv if argv is not None else sys.argv[1:])
    table = report(results, args.world, args.config, command.strip())
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
