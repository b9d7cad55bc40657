"""The measured sections of ``benchmarks/RESULTS.md``, each from JSON records as dicts.

The run (``machine_section``), the single-process call times (``calltime_section``), the
sharded runs (``sharded_section``), optimizer state (``state_section``), a calibrated
profile (``calibration_section``), the cost model against a measurement (``check_table``,
``check_section``) and the GPU files (``gpu_section``). Nothing here measures.
"""

import math
from dataclasses import replace
from pathlib import Path

from bench.model.costmodel import predict, predict_hooks, state_bytes, state_formula
from bench.model.hardware import H100, H200, Hardware
from bench.model.workload import hidden_matrices
from bench.optimizers import LAB
from bench.results import calltime, calltime_sharded
from bench.results.gpu_checks import checks_section, solvers_section
from bench.results.model import OPTIMIZERS, XL_WORLD, ms, paper_section
from bench.tools.markdown import markdown_table
from bench.tools.records import read_record
from dobb.eigensolve import AUTO_CUDA

# optimizers a call-time record may hold that the cost model does not predict (not in
# OPTIMIZERS, the call-time table): measured_only_note names them in the check tables
# the bounds a check table's rows are reported within (predicted / measured)
CHECK_BOUNDS = (1.25, 1.5, 2.0)


def measured_only_note(name: str) -> str:
    """The check tables' words for an optimizer measured without a cost-model prediction."""
    label = LAB[name].label if name in LAB else name
    return f"{label}: measured only, no cost model yet"


def machine_section(run: dict, rendered_by: str | None = None) -> str:
    """The measuring run (``bench.results.report.RUN_FILE``): when, by what, where, its commands;
    and the command that rendered the document again from the JSON, if one did."""
    lines = [
        f"- Generated: {run['date']} by `{run['invocation']}` ({run['wall_s']:.0f} s).",
        f"- Machine: {run['cpu']}, {run['cpus']} logical CPUs, torch "
        f"{run['torch']} with {run['threads']} threads, Python {run['python']}.",
    ]
    if rendered_by:
        lines.append(f"- Rendered again from the run's JSON by `{rendered_by}` (no measuring).")
    lines += ["- Commands (what this run did, as stand-alone commands):", "", "```"]
    return "\n".join([*lines, *run["commands"], "```"])


def calltime_section(record: dict) -> str:
    """The single-process call-time record: its workload, then ``calltime.format_table``."""
    m = record["meta"]
    shapes = [tuple(shape) for shape in m["shapes"]]  # lists once read back from JSON
    head = (
        f"{m['config']}, first {m['layers']} block(s): {m['matrices']} hidden matrices, "
        f"{m['params'] / 1e6:.1f}M parameters, shapes {shapes}; token batch "
        f"{m['tokens']}; Dobb {m['num_blocks']} blocks, refresh every {m['basis_interval']} "
        f"calls; Dion rank fraction {m['rank_fraction']:.4g}; {m['repeats']} repeats after "
        f"{m['warmup_periods']} warm-up period(s), interleaved; device {m['device_name']}."
    )
    if "dobb_sign" in record.get("optimizers", {}):
        head += (
            f" Two-sided Dobb (dobb_sign): Dobb's input blocks and refresh period, and "
            f"{dobb_sign_row_blocks(m)} row blocks per matrix (the rows one rank holds under "
            f"FSDP over {dobb_sign_row_blocks(m)} ranks)."
        )
    return head + "\n\n" + calltime.format_table(record)


def one_value(records: list[dict], key: str) -> str:
    """``key`` of ``records``: its one value, or all of them joined by ``/``."""
    return "/".join(dict.fromkeys(str(r[key]) for r in records))


def sharded_section(records: list[dict]) -> str:
    """The sharded runs' tables: each optimizer's slowest rank, side by side."""
    head = (
        "Each layout spawns its ranks on this machine's cores (gloo); every optimizer runs in "
        "its distributed form (see `bench.results.calltime_sharded`), timed as in section 1 "
        f"(Dobb amortized over its refresh period of {one_value(records, 'basis_interval')} "
        f"calls, MuonBP over its period of {one_value(records, 'period')}, one full step "
        "then block steps; blocks: each rank's shard). Ranks share the cores, so compare "
        "optimizers within a table, not across tables or with section 1."
    )
    parts = [head]
    for r in records:
        parts.append(f"`{r['command']}`\n\n" + calltime_sharded.table(r))
    return "\n\n".join(parts)


def dobb_sign_row_blocks(meta: dict) -> int:
    """Two-sided Dobb's row blocks in a call-time record (older records: calltime's)."""
    return meta.get("dobb_sign_row_blocks", calltime.DOBB_SIGN_ROW_BLOCKS)


def state_section(record: dict) -> str:
    """Optimizer state per parameter: measured, and by each optimizer's ``state_bytes``."""
    m = record["meta"]
    matrices = hidden_matrices(m["config"], m["layers"])
    numel = sum(x.numel for x in matrices)
    kw = dict(
        num_blocks=m["num_blocks"],
        rank_fraction=m["rank_fraction"],
        row_blocks=dobb_sign_row_blocks(m),
    )
    rows = []
    for name, entry in record["optimizers"].items():
        # the settings the run gave it (the recommended Dobb keeps its own blocks)
        given = (
            calltime.optimizer_overrides(
                name, m["num_blocks"], m["basis_interval"], m["rank_fraction"], m["period"]
            )
            if name in LAB
            else kw
        )
        try:
            expected = f"{sum(state_bytes(name, x, **given) for x in matrices) / numel:.4f}"
        except ValueError:  # an optimizer without a state formula (e.g. blockmuon)
            expected = "–"
        measured = f"{entry['state_bytes_per_param']:.4f}"
        formula = state_formula(name) if name in LAB else "–"
        rows.append([name, measured, expected, formula])
    headers = ["optimizer", "measured B/param", "formula B/param", "formula"]
    lines = [
        markdown_table(headers, rows, "lrrl", pad=False),
        "",
        "Dobb also keeps statistics accumulators outside its state (one more `s x s` per "
        "block: +4 s / d_out bytes per parameter).",
    ]
    if "dobb_sign" in record["optimizers"]:
        lines.append(
            f"Two-sided Dobb (dobb_sign): m is its row-block size, d_out / {kw['row_blocks']} "
            "rows (in 8 / (m n), m n = d_out d_in as above); it keeps Dobb's input-side "
            'accumulators, and its row moments (`row_stats="gradients"`, G_r G_rᵀ / d_in) '
            "come from the gradient in the step, with no accumulator."
        )
    return "\n".join(lines)


def calibration_section(hw: Hardware) -> str:
    """A calibrated profile's rates, latencies and fits, as it measured them."""
    meas = hw.measurements
    per_block = sorted((int(s), t) for s, t in meas["eigh_s_per_block"].items())
    eigh = ", ".join(f"s={s}: {t * 1e3:.2f}" for s, t in per_block)
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
            f"- eigh per block (ms, one batched call over its blocks): {eigh}; fit a + b s³ "
            f"with a = {a * 1e3:.3f} ms, b = {b:.3g} s.",
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


def check_table(record: dict, hw: Hardware) -> tuple[str, list[float]]:
    """Predicted vs measured per-call time of the calltime workload on ``hw``: a Markdown
    table of ``check_rows`` and the ratios predicted / measured of its modelled rows."""
    rows, ratios = [], []
    for label, predicted, measured in check_rows(record, hw):
        if predicted is None:  # measured beside the others, but no work model yet
            rows.append([label, ms(measured), "–", "–"])
            continue
        ratios.append(predicted / measured)
        rows.append([label, ms(measured), ms(predicted), f"{ratios[-1] - 1:+.0%}"])
    headers = ["quantity", "measured ms", "predicted ms", "error"]
    return markdown_table(headers, rows, "lrrr", pad=False), ratios


def check_rows(record: dict, hw: Hardware) -> list[tuple[str, float | None, float]]:
    """``(label, predicted s, measured s)`` of each row of the check of the calltime workload
    on ``hw``: every optimizer's median call, its periodic and other calls apart, the hooks
    and a forward+backward; ``predicted`` is None for an optimizer with no work model."""
    m = record["meta"]
    matrices = hidden_matrices(m["config"], m["layers"])
    batched = m.get("batched", False)  # CPU records, and all from before batching: per matrix
    knobs = dict(
        num_blocks=m["num_blocks"],
        basis_interval=m["basis_interval"],
        rank_fraction=m["rank_fraction"],
        period=m.get("period", 5),
        row_blocks=m.get("row_blocks", 1),
    )
    model = dict(launches="per_shape" if batched else "per_matrix", solver=refresh_solver(m))
    rows = []

    def row(label, predicted, measured):
        rows.append((label, predicted, measured))

    for name, entry in record["optimizers"].items():
        if name not in OPTIMIZERS:  # measured beside the others, but no work model yet
            row(f"{name} ({measured_only_note(name)})", None, entry["call_s"]["median"])
            continue
        options = model | calltime.optimizer_overrides(name, **knobs)  # as it was timed
        row(name, predict(name, matrices, hw, **options)["total"], entry["call_s"]["median"])
        keys = calltime.periodic_calls(name)
        if keys and keys[0] in entry:  # the periodic call and the others, each alone
            periodic, other = LAB[name].periodic_calls
            for label, key, calls in ((other, keys[1], "other"), (periodic, keys[0], "periodic")):
                predicted = predict(name, matrices, hw, calls=calls, **options)
                row(f"{name}, {label} call", predicted["total"], entry[key]["median"])
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
    return rows


def refresh_solver(meta: dict) -> str:
    """The refresh solver a call-time record's Dobb ran (``basis_method``; ``"auto"`` is
    ``AUTO_CUDA`` on CUDA); records without the field ran ``eigh``."""
    method = meta.get("basis_method") or "eigh"
    if method == "auto":
        method = AUTO_CUDA if meta.get("device", "cpu").startswith("cuda") else "eigh"
    return method if method in ("jacobi", "cholqr") else "eigh"


def check_section(record: dict, hw: Hardware, title: str) -> str:
    """``check_table`` under ``title``, with its worst row and the bound all rows are within."""
    table, ratios = check_table(record, hw)
    worst = max(ratios, key=lambda r: abs(math.log(r)))
    bound = next((b for b in CHECK_BOUNDS if all(1 / b <= r <= b for r in ratios)), None)
    within = f"within {bound:g}x" if bound else f"NOT all within {CHECK_BOUNDS[-1]:g}x"
    return (
        f"{title}\n\n{table}\n\nWorst row: predicted / measured = {worst:.2f}; rows {within} "
        "(error = predicted / measured - 1)."
    )


def gpu_section(files: list[Path]) -> str | None:
    """Tables of GPU JSON files (checks, refresh solvers, call-time records, calibrations,
    eigh backends), if any."""
    if not files:
        return None
    records, profiles, eighs, checks = [], [], [], []
    for f in files:
        data = read_record(f)
        if "checks" in data:
            checks.append(checks_section(f.name, data))
        elif "rows" in data and "command" in data:  # bench.results.eigensolve
            checks.append(solvers_section(f.name, data))
        elif "optimizers" in data:
            records.append((f, data))
        elif "rates" in data:
            profiles.append((f, Hardware.from_json(data)))
        elif "eigh_backends" in data:
            eighs.append((f, data["eigh_backends"]))
    parts = [*checks, gpu_table(records)]
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
            f"GPT-2 XL on {XL_WORLD} GPUs with this measured compute profile (memory bandwidth "
            "set to the H100 value; the H200's chip computes as an H100's):\n\n" + section
        )
    return "\n\n".join(parts)


def eigh_table(e: dict) -> str:
    """ms per block of a batched eigh, by backend (``costmodel.eigh_backends``)."""
    backends = sorted({k for row in e["s"].values() for k in row if k != "count"})
    rows = [
        [
            size,
            row["count"],
            *(
                f"{row[b] * 1e3:.3f}" if isinstance(row.get(b), float) else str(row.get(b, "-"))
                for b in backends
            ),
        ]
        for size, row in e["s"].items()
    ]
    table = markdown_table(["s", "blocks", *backends], rows, "rr" + "r" * len(backends), pad=False)
    return f"{e['device']}; CPU backend with {e['threads']} threads. ms per s x s block:\n\n{table}"


def gpu_table(records: list[tuple[Path, dict]]) -> str:
    """One subsection per GPU call-time record: its run, command and ``calltime_section``."""
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
