"""Regenerate ``benchmarks/RESULTS.md`` and its plots: one command, a few minutes on 2 CPUs.

    python -m dobb.bench.results                      # everything, into benchmarks/
    python -m dobb.bench.results --quick --out-dir /tmp/bench   # tiny and fast (tests)
    python -m dobb.bench.results gpu-table FILE.json ...        # Markdown of GPU runs

Steps: calibrate the cost model on this machine (``calibrate.calibrate``), measure the
optimizer-call times in one process (``calltime.run``) and sharded over gloo ranks under
FSDP, HSDP and TP (``calltime_sharded.run``), check the model against the single-process
measurement, predict GPT-2 XL on 32 H100 under FSDP beside the paper's numbers, sweep
world size and model width (PNG plots), and include GPU runs (``benchmarks/gpu/*.json``,
written by ``benchmarks/gpu_calltime.sh``) and the communication table
(``benchmarks/COMM.md``) when they exist. Raw JSON goes next to the report.
"""

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import torch

from dobb.bench import calibrate, calltime, calltime_sharded
from dobb.bench.costmodel import (
    CATEGORIES,
    OPTIMIZERS,
    PAPER_XL_32_H100_MS,
    format_terms,
    predict,
    predict_hooks,
    state_bytes,
)
from dobb.bench.costs import dobb as dobb_cost
from dobb.bench.hardware import H100, H200, Hardware, Network
from dobb.bench.workload import WIDTHS, Layout, hidden_matrices, transformer_matrices
from dobb.eigensolve import AUTO_CUDA

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"  # the repository's
WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
FULL = dict(config="gpt2-xl", layers=1, tokens=512, repeats=5, calls=1, warmup=1)
QUICK = dict(config="tiny", layers=2, tokens=64, repeats=2, calls=1, warmup=1)
# (layout, ranks) of the sharded runs; each gets the whole machine in turn
SHARDED = (("fsdp", 2), ("fsdp", 4), ("hsdp", 4), ("tp", 2))
QUICK_SHARDED = (("fsdp", 2), ("tp", 2))
# sensitivity rows: another option of ours, or our implementation before batching
VARIANTS = {
    "Dobb, refresh replicated (shard_refresh=False)": ("dobb", dict(refresh="replicated")),
    "Dobb, eigh refresh (torch.linalg.eigh per block)": ("dobb", dict(solver="eigh")),
    "Dobb before batching (per-matrix ops, eigh)": (
        "dobb",
        dict(launches="per_matrix", solver="eigh"),
    ),
    "Muon before batching (per-matrix ops)": ("muon", dict(launches="per_matrix")),
    "MuonBP before batching (per-matrix ops)": ("muonbp", dict(launches="per_matrix")),
    "BlockMuon (period None)": ("muonbp", dict(period=None)),
}
UNBATCHED = {"dobb": "Dobb before batching (per-matrix ops, eigh)"}  # dashed in the plots
# optimizers a call-time record may hold that the cost model cannot predict (not in
# costmodel.OPTIMIZERS): how the check tables name them; others go by their registry name
MEASURED_ONLY = {"dobb2s": "two-sided Dobb"}


def measured_only_note(name: str) -> str:
    """The check tables' words for an optimizer measured without a cost-model prediction."""
    return f"{MEASURED_ONLY.get(name, name)}: measured only, no cost model yet"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}" if seconds < 0.1 else f"{seconds * 1e3:.1f}"


def predict_variant(label, matrices, hardware, **options):
    """``predict`` of the ``VARIANTS`` row ``label``."""
    name, variant = VARIANTS[label]
    return predict(name, matrices, hardware, **options, **variant)


# --------------------------------------------------------------------------- sections
def machine_section(meta: dict, commands: list[str]) -> str:
    lines = [
        f"- Generated: {meta['date']} by `{meta['invocation']}` ({meta['wall_s']:.0f} s).",
        f"- Machine: {meta['cpu']}, {meta['cpus']} logical CPUs, torch "
        f"{meta['torch']} with {meta['threads']} threads, Python {meta['python']}.",
        "- Commands (what this run did, as stand-alone commands):",
        "",
        "```",
        *commands,
        "```",
    ]
    return "\n".join(lines)


def calltime_section(record: dict) -> str:
    m = record["meta"]
    head = (
        f"{m['config']}, first {m['layers']} block(s): {m['matrices']} hidden matrices, "
        f"{m['params'] / 1e6:.1f}M parameters, shapes {m['shapes']}; token batch "
        f"{m['tokens']}; Dobb {m['num_blocks']} blocks, refresh every {m['basis_interval']} "
        f"calls; Dion rank fraction {m['rank_fraction']:.4g}; {m['repeats']} repeats after "
        f"{m['warmup_periods']} warm-up period(s), interleaved; device {m['device_name']}."
    )
    if "dobb2s" in record.get("optimizers", {}):
        head += (
            f" Two-sided Dobb (dobb2s): Dobb's input blocks and refresh period, and "
            f"{dobb2s_row_blocks(m)} row blocks per matrix (the rows one rank holds under "
            f"FSDP over {dobb2s_row_blocks(m)} ranks)."
        )
    return head + "\n\n" + calltime.format_table(record)


def sharded_section(records: list[dict]) -> str:
    """The sharded runs' tables: each optimizer's slowest rank, side by side."""
    head = (
        "Each layout spawns its ranks on this machine's cores (gloo); every optimizer runs in "
        "its distributed form (see `dobb.bench.calltime_sharded`), timed as in section 1 "
        "(Dobb amortized over its refresh period, MuonBP over its period, one full step in "
        "five; blocks: each rank's shard). Ranks share the cores, so compare optimizers "
        "within a table, not across tables or with section 1."
    )
    parts = [head]
    for r in records:
        parts.append(f"`{r['command']}`\n\n" + calltime_sharded.table(r))
    return "\n\n".join(parts)


def dobb2s_row_blocks(meta: dict) -> int:
    """Two-sided Dobb's row blocks in a call-time record (older records: calltime's)."""
    return meta.get("dobb2s_row_blocks", calltime.DOBB2S_ROW_BLOCKS)


def state_section(record: dict) -> str:
    m = record["meta"]
    matrices = hidden_matrices(m["config"], m["layers"])
    numel = sum(x.numel for x in matrices)
    lines = [
        "| optimizer | measured B/param | formula B/param | formula |",
        "|---|---:|---:|---|",
    ]
    formulas = {
        "dobb": "4 (momentum) + 8 s / d_out (C_b, Q_b) + 8 / (m n) (step counters)",
        "dobb2s": "4 (momentum) + 8 s / d_out (C_b, Q_b) + 8 m / d_in (P_r and its moments) "
        "+ 8 / (m n)",
        "dion": "4 (momentum) + 4 r / d_out (Q) + 4 / (m n) (step)",
        "muon": "4 (momentum)",
        "muonbp": "4 (momentum) + 4 / (m n) (step)",
        "normuon": "4 (momentum) + 4 / d_in (row second moment)",
        "dion2": "4 (momentum)",
        "adamw": "8 (two moments) + 4 / (m n) (step)",
    }
    kw = dict(
        num_blocks=m["num_blocks"],
        rank_fraction=m["rank_fraction"],
        row_blocks=dobb2s_row_blocks(m),
    )
    for name, entry in record["optimizers"].items():
        try:
            expected = f"{sum(state_bytes(name, x, **kw) for x in matrices) / numel:.4f}"
        except ValueError:  # an optimizer without a state formula (e.g. blockmuon)
            expected = "–"
        formula = formulas.get(name, "–")
        lines.append(f"| {name} | {entry['state_bytes_per_param']:.4f} | {expected} | {formula} |")
    lines.append("")
    lines.append(
        "Dobb also keeps statistics accumulators outside its state (one more `s x s` per "
        "block: +4 s / d_out bytes per parameter)."
    )
    if "dobb2s" in record["optimizers"]:
        lines.append(
            f"Two-sided Dobb (dobb2s): m is its row-block size, d_out / {kw['row_blocks']} "
            "rows (in 8 / (m n), m n = d_out d_in as above); it keeps Dobb's input-side "
            'accumulators, and its row moments (`row_stats="gradients"`, G_r G_rᵀ / d_in) '
            "come from the gradient in the step, with no accumulator."
        )
    return "\n".join(lines)


def calibration_section(hw: Hardware) -> str:
    meas = hw.measurements
    eigh = ", ".join(f"s={s}: {t * 1e3:.2f}" for s, t in sorted(meas["eigh_s_per_block"].items()))
    bmm = ", ".join(f"s={s}: {r / 1e9:.1f}" for s, r in sorted(hw.bmm_rates.items()))
    a, b = hw.eigh_s
    return "\n".join(
        [
            f"Profile `{hw.name}` ({hw.source}):",
            "",
            f"- fp32 GEMM {hw.rates['gemm_fp32'] / 1e9:.1f} GFLOP/s (square); at the "
            f"optimizers' shapes: bf16 X Xᵀ {hw.rates['gemm_bf16'] / 1e9:.1f} GFLOP/s "
            f"(Newton-Schulz), fp32 rank-r {hw.rates['gemm_skinny'] / 1e9:.1f} GFLOP/s and "
            f"rank-r update {hw.rate('gemm_update') / 1e9:.1f} GFLOP/s (Dion).",
            f"- fp32 bmm by block size (GFLOP/s): {bmm}.",
            f"- eigh per block (ms, batch of 16): {eigh}; fit a + b s³ with a = "
            f"{a * 1e3:.3f} ms, b = {b:.3g} s.",
            f"- Householder QR: latency {hw.latency_s['qr'] * 1e6:.0f} us + FLOPs at "
            f"{hw.rates['qr'] / 1e9:.1f} GFLOP/s; Cholesky (r x r) "
            f"{hw.latency_s['small'] * 1e6:.0f} us.",
            f"- Memory bandwidth (in-place lerp_, mul_, addcdiv_; read + write) "
            f"{hw.memory_bandwidth / 1e9:.1f} GB/s; "
            f"a fresh output costs {hw.alloc_s_per_byte * 1e9:.3f} s/GB more (first touch); "
            f"full reductions read {(hw.reduction_bandwidth or hw.memory_bandwidth) / 1e9:.1f} "
            "GB/s; "
            "per-op cost (us): "
            + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in hw.op_s.items())
            + ".",
        ]
    )


def check_rows(record: dict, hw: Hardware) -> tuple[list[str], list[float]]:
    """Predicted vs measured per-call time of the calltime workload on ``hw``: Markdown
    rows and the ratios predicted / measured."""
    m = record["meta"]
    matrices = hidden_matrices(m["config"], m["layers"])
    batched = m.get("batched", False)  # CPU records, and all from before batching: per matrix
    kw = dict(
        num_blocks=m["num_blocks"],
        basis_interval=m["basis_interval"],
        rank_fraction=m["rank_fraction"],
        period=m.get("period", 5),
        row_blocks=m.get("row_blocks", 1),
        launches="per_shape" if batched else "per_matrix",
        solver=refresh_solver(m),
    )
    rows, ratios = [], []

    def row(label, predicted, measured):
        ratios.append(predicted / measured)
        rows.append(f"| {label} | {ms(measured)} | {ms(predicted)} | {ratios[-1] - 1:+.0%} |")

    for name, entry in record["optimizers"].items():
        if name not in OPTIMIZERS:  # measured beside the others, but no work model yet
            measured = ms(entry["call_s"]["median"])
            rows.append(f"| {name} ({measured_only_note(name)}) | {measured} | – | – |")
            continue
        row(name, predict(name, matrices, hw, **kw)["total"], entry["call_s"]["median"])
    dobb = record["optimizers"].get("dobb")
    if dobb and "steady_call_s" in dobb:
        steady = predict("dobb", matrices, hw, **{**kw, "basis_interval": 10**9})["total"]
        row("dobb, call without refresh", steady, dobb["steady_call_s"]["median"])
        refresh = predict("dobb", matrices, hw, **{**kw, "basis_interval": 1})["total"]
        row("dobb, refresh call", refresh, dobb["refresh_call_s"]["median"])
    muonbp = record["optimizers"].get("muonbp")
    if muonbp and "block_call_s" in muonbp:
        block = predict("muonbp", matrices, hw, **{**kw, "period": None})["total"]
        row("muonbp, block-step call", block, muonbp["block_call_s"]["median"])
        full = predict("muonbp", matrices, hw, **{**kw, "period": 1})["total"]
        row("muonbp, full-step call", full, muonbp["full_call_s"]["median"])
    kind = "gemm_bf16" if m.get("autocast") == "bf16" else "gemm_fp32"
    hooks = predict_hooks(
        matrices,
        m["tokens"],
        hw,
        num_blocks=m["num_blocks"],
        forward_kind=kind,
        low_precision=batched and kind == "gemm_bf16" and m.get("device") != "cpu",
        share_inputs=m.get("shared_hook_inputs", False),
    )
    measured = record["hooks"]
    row("statistics hooks, one forward", hooks["hooks_s"], measured["hooks_alone_s"]["median"])
    row(
        "forward + backward (no hooks)",
        hooks["forward_backward_s"],
        measured["forward_backward_s"]["median"],
    )
    return rows, ratios


def refresh_solver(meta: dict) -> str:
    """The refresh solver a call-time record's Dobb ran (``basis_method``; ``"auto"`` is
    Jacobi on CUDA); records without the field ran ``eigh``."""
    method = meta.get("basis_method") or "eigh"
    if method == "auto":
        method = AUTO_CUDA if meta.get("device", "cpu").startswith("cuda") else "eigh"
    return "jacobi" if method == "jacobi" else "eigh"


def check_section(record: dict, hw: Hardware, title: str) -> str:
    rows, ratios = check_rows(record, hw)
    worst = max(ratios, key=lambda r: abs(math.log(r)))
    bound = next((b for b in (1.25, 1.5, 2.0) if all(1 / b <= r <= b for r in ratios)), None)
    within = f"within {bound:g}x" if bound else "NOT all within 2x"
    return "\n".join(
        [
            f"{title}",
            "",
            "| quantity | measured ms | predicted ms | error |",
            "|---|---:|---:|---:|",
            *rows,
            "",
            f"Worst row: predicted / measured = {worst:.2f}; rows {within} "
            "(error = predicted / measured - 1).",
        ]
    )


def paper_section(hardware: Hardware = H100) -> tuple[str, dict[str, dict[str, float]]]:
    matrices = hidden_matrices("gpt2-xl")
    rows = {}
    for algorithm in ("hierarchical", "ring"):
        net = Network(algorithm=algorithm)
        for name in OPTIMIZERS:
            rows[f"{name} ({algorithm})"] = predict(name, matrices, hardware, world=32, network=net)
    for label in VARIANTS:
        rows[label + " (hierarchical)"] = predict_variant(
            label, matrices, hardware, world=32, network=Network()
        )
    for algorithm in ("hierarchical", "ring"):
        rows[f"Dion, 3 all-reduces per matrix ({algorithm})"] = predict(
            "dion",
            matrices,
            hardware,
            world=32,
            network=Network(algorithm=algorithm),
            collectives="per_matrix",
        )
    dobb, dion = rows["dobb (hierarchical)"]["total"], rows["dion (hierarchical)"]["total"]
    before = rows[UNBATCHED["dobb"] + " (hierarchical)"]["total"]
    paper = PAPER_XL_32_H100_MS
    lines = [
        f"GPT-2 XL (all 48 blocks, {len(matrices)} hidden matrices), FSDP over 32 GPUs "
        f"(4 nodes of 8), profile `{hardware.name}`, per-call ms by category:",
        "",
        format_terms(rows),
        "",
        "| | paper (ms) | model, our implementation (ms) | model / paper |",
        "|---|---:|---:|---:|",
        f"| Dobb | {paper['dobb']} | {ms(dobb)} | {dobb / 1e-3 / paper['dobb']:.1f}x |",
        f"| Dion | {paper['dion']} | {ms(dion)} | {dion / 1e-3 / paper['dion']:.1f}x |",
        f"| Dion / Dobb | {paper['dion'] / paper['dobb']:.1f} | {dion / dobb:.2f} | |",
        f"| {UNBATCHED['dobb']} | {paper['dobb']} | {ms(before)} | "
        f"{before / 1e-3 / paper['dobb']:.1f}x |",
    ]
    return "\n".join(lines), rows


# 32 GPUs (4 nodes of 8) split four ways; every group of 8 lies inside a node
LAYOUTS_32 = {
    "FSDP 32": Layout(shard=32),
    "HSDP 4 x 8": Layout(shard=8, replicate=4),
    "DDP 32": Layout(replicate=32),
    "TP 8 (one node)": Layout(tensor=8),
}


def layout_table(hardware: Hardware = H100) -> str:
    """Predicted ms per call of GPT-2 XL under each of ``LAYOUTS_32``."""
    xl = hidden_matrices("gpt2-xl")
    lines = [
        "Predicted ms per call, GPT-2 XL, by layout (H100 model, two-level collectives; HSDP "
        "shards inside a node and replicates across nodes; TP: Megatron's plan):",
        "",
        "| optimizer | " + " | ".join(LAYOUTS_32) + " |",
        "|---|" + "---:|" * len(LAYOUTS_32),
    ]
    for name in OPTIMIZERS:
        cells = [
            ms(predict(name, xl, hardware, layout=lay)["total"]) for lay in LAYOUTS_32.values()
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_tables(hardware: Hardware = H100) -> tuple[str, dict, dict]:
    """World-size and width sweeps (H100, hierarchical), as Markdown and raw series."""
    net = Network()
    models = {"xl": hidden_matrices("gpt2-xl")}
    models |= {d: transformer_matrices(d, layers) for d, layers in WIDTHS.values()}

    def series(mats, world):
        """Seconds per call of every optimizer, and of Dobb before batching, on ``mats``."""
        out = {n: predict(n, mats, hardware, world=world, network=net)["total"] for n in OPTIMIZERS}
        for label in UNBATCHED.values():
            out[label] = predict_variant(label, mats, hardware, world=world, network=net)["total"]
        return out

    by_world = [series(models["xl"], p) for p in WORLDS]
    by_width = [series(models[d], 32) for d, _ in WIDTHS.values()]
    worlds = {name: [point[name] for point in by_world] for name in by_world[0]}
    widths = {name: [point[name] for point in by_width] for name in by_width[0]}
    head_w = "| optimizer | " + " | ".join(str(p) for p in WORLDS) + " |"
    lines = [
        "Predicted ms per call, GPT-2 XL under FSDP, by number of GPUs:",
        "",
        head_w,
        "|---|" + "---:|" * len(WORLDS),
        *(f"| {n} | " + " | ".join(ms(t) for t in ts) + " |" for n, ts in worlds.items()),
        "",
        "Predicted ms per call on 32 GPUs, by model (width d, layers L):",
        "",
        "| optimizer | " + " | ".join(f"{k}" for k in WIDTHS) + " |",
        "|---|" + "---:|" * len(WIDTHS),
        *(f"| {n} | " + " | ".join(ms(t) for t in ts) + " |" for n, ts in widths.items()),
    ]
    return "\n".join(lines), worlds, widths


def plot(worlds: dict, widths: dict, out_dir: Path) -> list[str]:
    """Two PNG plots of the sweeps; returns their file names (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    for fname, xs, series, xlabel in (
        ("calltime_vs_world.png", WORLDS, worlds, "GPUs (FSDP, 8 per node)"),
        ("calltime_vs_width.png", [d for d, _ in WIDTHS.values()], widths, "model width d"),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name, ys in series.items():
            style = "--" if name in UNBATCHED.values() else "-"
            ax.plot(xs, [y * 1e3 for y in ys], style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("predicted ms per optimizer call")
        if "world" in fname:
            for name, value in PAPER_XL_32_H100_MS.items():
                ax.plot([32], [value], "k*", markersize=10)
                ax.annotate(
                    f"paper: {name}",
                    (32, value),
                    textcoords="offset points",
                    xytext=(6, 4),
                    fontsize=8,
                )
            ax.set_title("GPT-2 XL under FSDP, H100 model (stars: paper, 32 GPUs)")
        else:
            ax.set_xticks(xs, [str(x) for x in xs], rotation=45)
            ax.set_title("32 GPUs, FSDP, H100 model (layers per model as in the table)")
        ax.grid(True, which="both", lw=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        files.append(fname)
    return files


def gpu_section(files: list[Path]) -> str | None:
    """Tables of GPU JSON files (call-time records, calibrations, eigh backends), if any."""
    if not files:
        return None
    records, profiles, eighs = [], [], []
    for f in files:
        data = json.loads(f.read_text())
        if "optimizers" in data:
            records.append((f, data))
        elif "rates" in data:
            profiles.append((f, Hardware.from_json(data)))
        elif "eigh_backends" in data:
            eighs.append((f, data["eigh_backends"]))
    parts = [gpu_table(records)]
    for f, record in records:  # the assumed H200 constants against the measurement
        if record["meta"].get("complete") and record["meta"]["device"].startswith("cuda"):
            title = f"Cost model with the *assumed* H200 profile vs `{f.name}`:"
            parts.append(check_section(record, H200, title))
    for f, e in eighs:
        parts.append(f"### eigh backends `{f.name}`\n\n" + eigh_table(e))
    for f, hw in profiles:
        parts.append(f"### Calibration `{f.name}`\n\n" + calibration_section(hw))
        for rf, record in records:
            if record["meta"].get("complete") and record["optimizers"]:
                title = f"Cost model with this profile vs `{rf.name}`:"
                parts.append(check_section(record, hw, title))
        section, _ = paper_section(replace(hw, memory_bandwidth=H100.memory_bandwidth))
        parts.append(
            "GPT-2 XL on 32 GPUs with this measured compute profile (memory bandwidth set to "
            "the H100 value; the H200's chip computes as an H100's):\n\n" + section
        )
    return "\n\n".join(parts)


def eigh_table(e: dict) -> str:
    """ms per block of a batched eigh, by backend (``costmodel.eigh_backends``)."""
    backends = sorted({k for row in e["s"].values() for k in row if k != "count"})
    lines = [
        f"{e['device']}; CPU backend with {e['threads']} threads. ms per s x s block:",
        "",
        "| s | blocks | " + " | ".join(backends) + " |",
        "|---:|---:|" + "---:|" * len(backends),
    ]
    for size, row in e["s"].items():
        cells = [
            f"{row[b] * 1e3:.3f}" if isinstance(row.get(b), float) else str(row.get(b, "-"))
            for b in backends
        ]
        lines.append(f"| {size} | {row['count']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gpu_table(records: list[tuple[Path, dict]]) -> str:
    parts = []
    for f, record in records:
        m = record["meta"]
        state = "" if m.get("complete") else " (INCOMPLETE: partial results)"
        parts.append(
            f"### `{f.name}`{state}\n\n{m['device_name']}, torch {m['torch']}, autocast "
            f"{m['autocast']}, {m['date']}\n\n"
            + (m["command"] and f"`{m['command']}`\n\n" or "")
            + calltime_section(record)
        )
    return "\n\n".join(parts)


CONSTANTS = """\
Cost-model constants (`dobb/bench/costmodel.py`; values from datasheets are marked, every
other value is our assumption):

- H100 SXM5 compute (datasheet): dense bf16 989 TFLOP/s, fp32 67 TFLOP/s (PyTorch keeps TF32
  off for matmul by default, so fp32 products run on CUDA cores); efficiency assumed 0.65 for
  GEMMs (an 8192³ bf16 product ran at 790 TFLOP/s on an H200 of this workplace) and 0.5 for
  the fp32 block products of Dobb.
- HBM3 3.35 TB/s (datasheet) x 0.85 (assumed; 4.3 of 4.8 TB/s was seen on an H200 here).
  H200: 4.8 TB/s (datasheet) x 0.9.
- Per-op cost 6 us (PyTorch eager dispatch + launch; assumed).
- eigh per s x s block on CUDA through `torch.linalg.eigh`: 1.7 ms + 1.3e-10 s · s³ (PyTorch
  loops cuSOLVER syevd for n > 32; pytorch/pytorch#174674 measured 1.8 ms a block at s=100;
  the s³ term is assumed). Batched Jacobi (CuPy's syevjBatched, same issue: 17 us a block at
  s=100): 16 us + 1e-12 s · s³.
- Small factorizations on GPU (QR, Cholesky, triangular solves): 150 us (QR) / 30 us
  latency + FLOPs at 2 TFLOP/s (assumed).
- Links: NVLink 4 450 GB/s per direction per GPU (datasheet), 360 GB/s used (nccl-tests bus
  bandwidth on 8 H100 is typically 350-480 GB/s); InfiniBand NDR 400 Gb/s = 50 GB/s per GPU
  (datasheet), 40 GB/s used; α = 3 us per ring step inside a node, 10 us between nodes
  (assumed); 8 GPUs per node.
- Collectives: ring all-reduce 2(p-1)α + 2(p-1)/p · n/β; ring all-gather (p-1)α +
  (p-1)/p · n/β; hierarchical = reduce-scatter + all-gather inside the node on n, ring across
  nodes on n/8; all-to-all (p-1)α + max(intra-node bytes / β_intra, inter-node bytes /
  β_inter).
"""


def scaling(worlds: dict[str, list[float]], widths: dict[str, list[float]]) -> str:
    """What drives each curve of the sweeps (``sweep_tables``' series), with their numbers."""
    first, last = WORLDS[0], WORLDS[-1]
    dobb, dion, muon = worlds["dobb"], worlds["dion"], worlds["muon"]
    before = worlds[UNBATCHED["dobb"]]
    turn = WORLDS[min(range(len(WORLDS)), key=muon.__getitem__)]
    models = list(WIDTHS)
    return f"""\
What drives each curve in the model (H100 profile, two-level collectives; dashed: Dobb before
batching, per-matrix ops and a per-block eigh):

- Dobb (ours: same-shape matrices batched, `shard_refresh=True`, the batched Jacobi refresh
  of `basis_method="auto"` on CUDA) goes from {ms(dobb[0])} ms at {first} GPUs to
  {ms(dobb[-1])} ms at {last}: its update is row-local, each rank refreshes 1/p of the
  blocks, and what remains is a fixed number of launches per shape and the Jacobi rounds.
  Before batching the same model gives {ms(before[0])} ms and {ms(before[-1])} ms.
- Dion goes from {ms(dion[0])} to {ms(dion[-1])} ms: its small factorizations (QR of the
  k x r sketch, Cholesky, two triangular solves per matrix) are replicated on every rank,
  and the latency of its three all-reduce rounds grows with the number of nodes.
- Muon is lowest at {turn} GPUs ({ms(min(muon))} ms): the whole-matrix Newton-Schulz work
  divides among more owners, then its two all-to-alls pay (p - 1) latencies.
- MuonBP (P = 5) runs Newton-Schulz on every rank's shard of every matrix on its block
  steps, batched per shape; its full steps' all-to-alls grow with p.
- AdamW falls as 1/p: elementwise on the local shard, no communication.
- With width (32 GPUs, {models[0]} to {models[-1]}: Dobb {ms(widths["dobb"][0])} to
  {ms(widths["dobb"][-1])} ms), Dobb's block size grows (s = d/16 and 4d/16 with 16
  blocks) and its refresh with s³; a fixed block size would keep it linear in d. Muon's
  whole-matrix Newton-Schulz grows as d³ on the owner; MuonBP's block steps as d³/p.
- By layout (last table): HSDP shares Dobb's refresh only among the ranks of a replica (the
  innermost data axis), and pure TP has no data axis, so every TP rank refreshes all of its
  blocks, those of column-parallel matrices identical on every TP rank. Sharing the refresh
  over the TP ranks too (their statistics agree) is an improvement we have not made. DDP
  keeps whole matrices on every rank, so every update is whole-matrix."""


def discussion(rows: dict[str, dict[str, float]]) -> str:
    """How to read section 5, with its numbers (``rows`` from ``paper_section``)."""
    dobb, dion = rows["dobb (hierarchical)"], rows["dion (hierarchical)"]
    replicated = rows["Dobb, refresh replicated (shard_refresh=False) (hierarchical)"]
    eigh = rows["Dobb, eigh refresh (torch.linalg.eigh per block) (hierarchical)"]
    before = rows[UNBATCHED["dobb"] + " (hierarchical)"]
    muonbp, muon = rows["muonbp (hierarchical)"], rows["muon (hierarchical)"]
    paper = PAPER_XL_32_H100_MS

    def share(terms, *keys):
        return sum(terms[k] for k in keys) / terms["total"]

    xl = hidden_matrices("gpt2-xl")
    shapes = len({(m.d_out, m.d_in) for m in xl})
    refresh = dobb_cost.work(xl, layout=Layout(shard=32), solver="eigh").refresh
    blocks_per_rank = sum(k.count for k in refresh if k.kind == "eigh")
    per_matrix = rows["Dion, 3 all-reduces per matrix (hierarchical)"]
    per_matrix_ring = rows["Dion, 3 all-reduces per matrix (ring)"]
    dion_fixed = share(dion, "comm_latency", "factorization", "overhead")
    return f"""\
How to read this (and where and why it disagrees with the paper):

- The model describes *our* implementation: matrices of one shape updated together (a few
  batched kernels per shape: {shapes} shapes in GPT-2 XL), some Python work per matrix, each
  op with a fixed cost; at a refresh each rank's 1/32 of the blocks through the batched
  Jacobi solver, then one all-gather per block size; Dion's three all-reduce rounds per step
  each sent for all matrices in one buffer (`dobb.distributed.reduce.all_reduce_`), its
  ops per matrix. The paper's implementation is not described in its abstract. All of it
  is a *prediction* from assumed H100 constants.
- **Dion**: {ms(dion["total"])} ms predicted against the paper's {paper["dion"]} ms
  ({dion["total"] * 1e3 / paper["dion"]:.1f}x). Latency-bound terms (small factorizations,
  per-op costs, collective latency) are {dion_fixed:.0%} of it; its communication is
  {ms(dion["comm_latency"] + dion["comm_bandwidth"])} ms. An implementation that issues the
  three all-reduces per matrix (864 for 288 matrices) would take {ms(per_matrix["total"])} ms
  with NCCL-like two-level collectives and {ms(per_matrix_ring["total"])} ms on one flat ring.
  The agreement with the paper rests on assumed latencies of small cuSOLVER calls and of
  PyTorch ops (the GPU section measures both on an H200).
- **Dobb**: {ms(dobb["total"])} ms predicted against the paper's {paper["dobb"]} ms
  ({dobb["total"] * 1e3 / paper["dobb"]:.1f}x): matmul and memory
  {ms(dobb["matmul"] + dobb["memory"])} ms, per-op costs {ms(dobb["overhead"])} ms, the
  refresh's small factorizations {ms(dobb["factorization"])} ms and the statistics
  all-reduce and bases all-gather {ms(dobb["comm_latency"] + dobb["comm_bandwidth"])} ms
  (amortized). With `torch.linalg.eigh` for the refresh ({blocks_per_rank} blocks per rank,
  one cuSOLVER call each) it would be {ms(eigh["total"])} ms; before batching (per-matrix
  ops and eigh) {ms(before["total"])} ms; without sharding the refresh
  (`shard_refresh=False`) {ms(replicated["total"])} ms.
- **MuonBP**: {ms(muonbp["total"])} ms (Muon: {ms(muon["total"])} ms), of which
  {ms(muonbp["overhead"])} ms are per-op costs: shard-local Newton-Schulz on a rank's rows
  is cheap (a = d_out / p).
- So the predicted Dion/Dobb ratio ({dion["total"] / dobb["total"]:.1f} for our batched code,
  {dion["total"] / before["total"]:.2f} before batching, {paper["dion"] / paper["dobb"]:.1f}
  in the paper) hinges on assumed constants: per-op and factorization latencies above all.
  Read the absolute numbers as order-of-magnitude and the breakdown as the useful part.
"""


# --------------------------------------------------------------------------- driver
def generate(
    out_dir: Path = BENCHMARKS,
    *,
    quick: bool = False,
    threads: int | None = None,
    invocation: str = "dobb.bench.results.generate()",
    **overrides,
) -> Path:
    """Run everything and write ``out_dir/RESULTS.md`` (+ JSON, PNG); returns its path.

    ``overrides``: ``config``, ``layers``, ``tokens``, ``repeats`` ... of the call-time run.
    """
    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    settings = {**(QUICK if quick else FULL), **overrides}

    def log(s):
        print(s, flush=True)

    matrices = hidden_matrices(settings["config"], settings["layers"])
    log("calibrating the cost model on this machine ...")
    hw = calibrate.calibrate("cpu", matrices, quick=quick, progress=log)
    (out_dir / "cpu_calibration.json").write_text(json.dumps(hw.to_json(), indent=1))
    thread_flag = f" --threads {threads}" if threads else ""
    shown = out_dir.resolve()
    shown = shown.relative_to(Path.cwd()) if shown.is_relative_to(Path.cwd()) else shown
    commands = [
        f"python -m dobb.bench.calibrate calibrate --config {settings['config']} --layers "
        f"{settings['layers']}{' --quick' if quick else ''}{thread_flag} "
        f"--out {shown / 'cpu_calibration.json'}",
        f"python -m dobb.bench.calltime --config {settings['config']} --layers "
        f"{settings['layers']} --tokens {settings['tokens']} --repeats {settings['repeats']} "
        f"--warmup {settings['warmup']} --calls {settings['calls']}{thread_flag} "
        f"--out {shown / 'calltime_cpu.json'}",
    ]
    log("timing optimizer calls ...")
    record = calltime.run(
        settings["config"],
        settings["layers"],
        tokens=settings["tokens"],
        repeats=settings["repeats"],
        warmup=settings["warmup"],
        calls=settings["calls"],
        out=out_dir / "calltime_cpu.json",
        command=commands[1],
        progress=log,
    )
    sharded = []
    for layout, world in QUICK_SHARDED if quick else SHARDED:
        log(f"timing optimizer calls sharded over {world} ranks ({layout}) ...")
        record_s = calltime_sharded.run(
            layout,
            world,
            config=settings["config"],
            layers=settings["layers"],
            tokens=settings["tokens"],
            repeats=min(settings["repeats"], 3),  # ranks share the cores: slow
        )
        path = out_dir / "sharded" / f"calltime_{layout}{world}.json"
        calltime.write_json(path, record_s)
        commands.append(f"{record_s['command']} --out {shown / path.relative_to(out_dir)}")
        sharded.append(record_s)
    log("predicting ...")
    paper, paper_rows = paper_section()
    sweeps, worlds, widths = sweep_tables()
    plots = plot(worlds, widths, out_dir)
    gpu = gpu_section(sorted((out_dir / "gpu").glob("*.json")))
    comm = out_dir / "COMM.md"
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "invocation": invocation,
        "cpu": calltime.device_name(torch.device("cpu")),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    meta["wall_s"] = time.perf_counter() - started
    sections = [
        "# Optimizer-call benchmarks and cost model",
        machine_section(meta, commands),
        "## 1. Measured optimizer-call time (CPU, single process)\n\n" + calltime_section(record),
        "## 2. Measured optimizer-call time, sharded (CPU, gloo ranks)\n\n"
        + sharded_section(sharded),
        "## 3. Optimizer state per parameter\n\n" + state_section(record),
        "## 4. Cost model: calibration here, and its error against section 1\n\n"
        + calibration_section(hw)
        + "\n\n"
        + check_section(record, hw, "Predicted (calibrated profile) vs measured medians:"),
        "## 5. Prediction: GPT-2 XL, FSDP on 32 H100, beside the paper\n\n"
        + paper
        + "\n\n"
        + discussion(paper_rows),
        "## 6. Scaling with world size, model width and layout (model)\n\n"
        + scaling(worlds, widths)
        + "\n\n"
        + sweeps
        + "\n\n"
        + layout_table()
        + "".join(f"\n\n![{p}]({p})" for p in plots),
        "## 7. GPU measurements\n\n"
        + (gpu or "No `benchmarks/gpu/*.json` yet (run `benchmarks/gpu_calltime.sh` on a GPU)."),
    ]
    if comm.exists():
        sections.append("## 8. Communication (from `benchmarks/COMM.md`)\n\n" + comm.read_text())
    sections.append("## Constants and sources\n\n" + CONSTANTS + f"\nCategories: {CATEGORIES}.")
    path = out_dir / "RESULTS.md"
    path.write_text("\n\n".join(sections) + "\n")
    log(f"wrote {path} ({time.perf_counter() - started:.0f} s)")
    return path


def main(argv: list[str]) -> None:
    if argv and argv[0] == "gpu-table":  # Markdown of GPU JSON files (no plots, no runs)
        print(gpu_section([Path(f) for f in argv[1:]]) or "no files")
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=BENCHMARKS)
    parser.add_argument("--quick", action="store_true", help="tiny config, for tests")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--config", help="GPT config of the call-time run")
    parser.add_argument("--layers", type=int, help="blocks of the call-time run")
    parser.add_argument("--repeats", type=int)
    args = parser.parse_args(argv)
    overrides = {k: getattr(args, k) for k in ("config", "layers", "repeats")}
    generate(
        args.out_dir,
        quick=args.quick,
        threads=args.threads,
        invocation=" ".join(["python -m dobb.bench.results", *argv]),
        **{k: v for k, v in overrides.items() if v is not None},
    )


if __name__ == "__main__":
    main(sys.argv[1:])
