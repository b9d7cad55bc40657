"""docs/evidence.md's figures, rendered from the committed JSON of the benchmarks.

    python -m bench.evidence            # rewrite the rendered part of docs/evidence.md
    python -m bench.evidence --check    # exit 1 if the committed text is not the rendered one

The page summarizes what ``benchmarks/`` holds; every number in its rendered part comes from
the JSON there (``results_run.json``, ``calltime_cpu.json``, ``cpu_calibration.json``,
``sharded/*.json``, ``gpu/*.json``, ``study/study.json``) through the functions that render
RESULTS.md and STUDY.md, or from the cost model (``bench.results.model.paper_section``).
Nothing is measured. The text between ``BEGIN`` and ``END`` is replaced; the rest of the
page is left as written. A test holds the committed page to this rendering.
"""

import argparse
import math
import re
import sys
import textwrap
from pathlib import Path

from bench.model.costmodel import PAPER_XL_32_H100_MS
from bench.model.hardware import H100, Hardware
from bench.optimizers import LAB, SUBJECT
from bench.results.calltime_sharded import slowest_ranks
from bench.results.model import (
    UNBATCHED,
    XL_WORLD,
    captured_label,
    launch_us,
    ms,
    paper_section,
)
from bench.results.report import CALIBRATION_FILE, CALLTIME_FILE, RUN_FILE
from bench.results.sections import check_rows
from bench.study.format import fmt_loss, in_words
from bench.study.moe_report import ordering_sentence
from bench.tools.records import read_record

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "evidence.md"
BENCHMARKS = ROOT / "benchmarks"
BEGIN = "<!-- rendered from benchmarks/ by `python -m bench.evidence`: edit bench/evidence.py -->"
END = "<!-- end of the rendered part -->"
JACOBI = "Dobb, Jacobi refresh (the CUDA default before #32) (hierarchical)"
WIDTH = 90  # the page's line width
GPU_RECORD = "calltime_xl.json"  # the GPU run the page quotes (gpu/)


def blocks(n: int) -> str:
    """``"one GPT-2 XL block"``, ``"two GPT-2 XL blocks"``."""
    return f"{in_words(n)} GPT-2 XL block{'' if n == 1 else 's'}"


def read(path: Path) -> dict:
    return read_record(path)


def errors(record: dict, hw: Hardware) -> list[tuple[str, float]]:
    """``(label, predicted / measured)`` of each modelled row of the cost model's check."""
    return [(label, p / m) for label, p, m in check_rows(record, hw) if p is not None]


def pct(ratio: float) -> str:
    """An error as RESULTS.md prints it (``predicted / measured - 1``)."""
    return f"{ratio - 1:+.0%}"


def worst(rows: list[tuple[str, float]]) -> tuple[str, float]:
    """The row furthest from its measurement (in log ratio), as RESULTS.md's check picks it."""
    return max(rows, key=lambda row: abs(math.log(row[1])))


def row_words(label: str) -> str:
    """``"dobb_sign, steady call"`` -> ``"two-sided Dobb's steady call"``; ``"muon"`` -> Muon."""
    name, _, call = label.partition(", ")
    if name not in LAB:
        return label
    return f"{LAB[name].label}'s {call}" if call else LAB[name].label


def cpu_calibration(bench: Path) -> str:
    """The cost model against the CPU measurements (section 4 of RESULTS.md)."""
    run = read(bench / RUN_FILE)
    hw = Hardware.from_json(read(bench / CALIBRATION_FILE))
    rows = errors(read(bench / CALLTIME_FILE), hw)
    label, ratio = worst(rows)
    of = dict(rows)
    names = [(label.partition(", ")[0], r) for label, r in rows]
    dobb = [r for name, r in names if name in LAB and LAB[name].entry.needs_statistics]
    over = all(r > 1 for r in [*dobb, of["adamw"]])
    return (
        f"Calibrated here, its worst CPU row is off by {pct(ratio)} ({row_words(label)}, in "
        f"sample): on this {run['cpu']} it {'over-predicts' if over else 'mispredicts'} every "
        f"Dobb and AdamW call ({pct(min(dobb))} to {pct(max(dobb))}, AdamW {pct(of['adamw'])}; "
        f"Dion {pct(of['dion'])}, Muon {pct(of['muon'])}), which is not yet explained, so its "
        "CPU rows are no evidence for its GPU predictions."
    )


def gpu_calibration(bench: Path) -> str:
    """The cost model with the profile measured on the GPU against the GPU call times."""
    hw = Hardware.from_json(read(bench / "gpu" / "calibration.json"))
    records = [read(f) for f in sorted((bench / "gpu").glob("calltime_*.json"))]
    label, ratio = worst([row for record in records for row in errors(record, hw)])
    device = records[0]["meta"]["device_name"].removeprefix("NVIDIA ")
    return (
        f"Out of sample, with the profile measured on the {device}, it is off by up to "
        f"{pct(ratio)} ({row_words(label)}; section 7)."
    )


def prediction() -> str:
    """The cost model's GPT-2 XL prediction beside the paper's (section 5 of RESULTS.md)."""
    _, rows = paper_section(H100)
    dobb = rows["dobb_paper (hierarchical)"]

    def total(label: str) -> str:
        return ms(rows[label]["total"])

    paper = PAPER_XL_32_H100_MS
    return (
        f"It *predicts* GPT-2 XL on {XL_WORLD} H100 beside the paper's {paper['dobb_paper']} ms / "
        f"{paper['dion']} ms (predicted: Dobb {ms(dobb['total'])} ms eager, of which matmul "
        f"and memory {ms(dobb['matmul'] + dobb['memory'])} ms, per-op costs "
        f"{ms(dobb['overhead'])} ms and the refresh's small factorizations "
        f"{ms(dobb['factorization'])} ms; {total(captured_label('dobb_paper'))} ms captured; Muon "
        f"{total('muon (hierarchical)')} ms; Dion {total('dion (hierarchical)')} ms; Dobb with "
        f"the Jacobi refresh it replaced {total(JACOBI)} ms, before batching "
        f"{total(UNBATCHED['dobb_paper'] + ' (hierarchical)')} ms)."
    )


def sharded(bench: Path, layout: str = "fsdp", world: int = 4) -> str:
    """One sharded layout's call times (section 2 of RESULTS.md), fastest first, AdamW last."""
    run = read(bench / RUN_FILE)
    records = [read(bench / f) for f in run["sharded"]]
    (record,) = [r for r in records if (r["layout"], r["world"]) == (layout, world)]
    times = {name: t["median"] for name, t in slowest_ranks(record).items()}
    # the matrix optimizers fastest first, each against the lab's Dobb; AdamW last
    order = sorted(times, key=lambda n: (not LAB[n].entry.is_matrix, times[n]))
    parts = []
    for name in order:
        against = LAB[name].entry.is_matrix and name != SUBJECT
        notes = [f"{times[name] / times[SUBJECT]:.2f}x"] if against else []
        notes += [LAB[name].sharded_note] if LAB[name].sharded_note else []
        extra = f" ({'; '.join(notes)})" if notes else ""
        parts.append(f"{LAB[name].label} {times[name]:.1f} ms{extra}")
    return (
        f"Measured on {blocks(record['layers'])} under {layout.upper()} "
        f"over {world} gloo ranks sharing {run['cpus']} cores: " + ", ".join(parts) + "."
    )


def layouts(bench: Path) -> str:
    """``"FSDP (2 and 4 ranks), HSDP (4 ranks) and TP (2 ranks)"``: the sharded runs."""
    worlds: dict[str, list[int]] = {}
    for f in read(bench / RUN_FILE)["sharded"]:
        record = read(bench / f)
        worlds.setdefault(record["layout"], []).append(record["world"])
    parts = [
        f"{layout.upper()} ({' and '.join(map(str, sorted(ws)))} ranks)"
        for layout, ws in worlds.items()
    ]
    return ", ".join(parts[:-1]) + f" and {parts[-1]}" if len(parts) > 1 else parts[0]


def results_bullet(bench: Path) -> str:
    """The bullet on benchmarks/RESULTS.md."""
    run = read(bench / RUN_FILE)
    ns = read(bench / CALLTIME_FILE)["meta"]["newton_schulz"]
    dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(ns["ns_dtype"], ns["ns_dtype"])
    native = "native" if ns["bf16_native"] else "emulated"
    return f"""\
- [benchmarks/RESULTS.md](../benchmarks/RESULTS.md) (`{run["invocation"]}`, one command,
  {run["wall_s"]:.0f} s on the {run["cpus"]} cores of an {run["cpu"]} on {run["date"][:10]}; every
  table of it from that one machine; it writes the measurements as JSON beside the
  document, and `python -m bench.results --render` rewrites the document from that JSON
  alone, measuring nothing): amortized optimizer-call time over a whole period (Dobb's
  refresh, MuonBP's full step) on GPT-2 XL shapes, in one process and sharded over gloo
  ranks under {layouts(bench)}, each optimizer in its distributed form, the Muon family's
  Newton-Schulz in the dtype measured fastest there ({dtype} on this {run["cpu"]}: bf16
  matmuls are {native}); statistics-hook overhead; state bytes per parameter; and a cost
  model (FLOPs, memory traffic, per-op costs, alpha-beta collectives with documented H100
  link parameters, per-matrix layouts for FSDP, HSDP, DDP and Megatron TP; on GPU profiles
  the batched step and the `cholqr` refresh op by op, its ops traced from the code by
  `bench.model.costs.traced`; a captured profile prices a replayed CUDA graph at an
  assumed {launch_us()} us a kernel). {cpu_calibration(bench)} {gpu_calibration(bench)}
  {prediction()} {sharded(bench)} On CPU the optimizers run matrix by matrix; the
  before/after runs of an earlier change are in
  [benchmarks/before_after](../benchmarks/before_after)."""


def gpu_bullet(bench: Path) -> str:
    """The bullet on the GPU measurements (benchmarks/gpu/)."""
    record = read(bench / "gpu" / GPU_RECORD)
    meta, calls = record["meta"], record["optimizers"]
    s = sorted(read(bench / "gpu" / "eigh.json")["eigh_backends"]["s"].items())[0]
    size, eigh = int(s[0]), s[1]
    dobb = calls["dobb_paper"]

    def t(entry: dict, key: str = "call_s") -> str:
        return f"{entry[key]['median'] * 1e3:.1f}"

    torch_version = ".".join(meta["torch"].split(".")[:2])
    return f"""\
- [benchmarks/gpu/gpu_calltime.md](../benchmarks/gpu/gpu_calltime.md)
  (`bash benchmarks/gpu_calltime.sh` on one {meta["device_name"].removeprefix("NVIDIA ")},
  torch {torch_version}, {meta["date"][:10]}): on {meta["layers"]} GPT-2 XL blocks Dobb's calls
  between refreshes take {t(dobb, "steady_call_s")} ms against Muon's {t(calls["muon"])} ms and
  Dion's {t(calls["dion"])} ms (AdamW {t(calls["adamw"])} ms), but a refresh takes
  {t(dobb, "refresh_call_s")} ms, so the amortized Dobb call is {t(dobb)} ms:
  `torch.linalg.eigh` on CUDA costs {eigh["torch_cuda"] * 1e3:.1f} ms per {size} x {size}
  block (CuPy: {eigh["cupy_cuda"] * 1e3:.2f} ms; `gpu/eigh.json`). This is why the refresh
  is sharded over data-parallel ranks and, on CUDA, runs the batched `cholqr` solver by
  default. That run predates batching, the batched refreshes, MuonBP, NorMuon and Dion2;
  no GPU was available to rerun it. `OUT=dir bash benchmarks/gpu_calltime.sh` (at most 8
  minutes, its header says) is the one command that reruns it: `bench.gpu.check` first
  writes `gpu_check.json` (each registry optimizer on CUDA against its CPU result, the
  capturable Dobb's steady and refresh steps captured as CUDA graphs and replayed against
  eager and timed, a tracked GPT under `torch.compile` with its graph breaks and the
  hooks' share of a compiled forward+backward), then the calibration, the solver table
  (`python -m bench.results.eigensolve`: eigh, CuPy, cholqr, Jacobi), the call-time table
  and the eager hook share; copy its files to `benchmarks/gpu/` and `python -m
  bench.results --render` puts them in RESULTS.md section 7. `DEVICE=cpu CONFIG=tiny
  TOKENS=64 LAYERS=1 COMPILE_BACKEND=eager` runs it on the CPU, and
  `tests/bench/test_gpu_check.py` runs the check phases there; `bash
  benchmarks/gpu_scale.sh` (about 5 minutes, its header says) trains the 124M GPT-2 for
  the same wall-clock time per optimizer (`bench/timebudget/__init__.py`; its data is
  prepared here and carried)."""


COMM_BULLET = """\
- [benchmarks/COMM.md](../benchmarks/COMM.md) (`python -m bench.results.comm --world 4`):
  collectives and bytes per step for each optimizer and layout, measured with
  `CommRecorder` beside the analytic formula."""

MEMORY_BULLET = """\
- [benchmarks/memory.json](../benchmarks/memory.json) (`python -m bench.results.memory
  --config gpt2 --worlds 1 2 4`): each optimizer's bytes alive per rank under FSDP2 on
  gloo (every tensor that is not a parameter: state, statistics sums,
  caches, bases), the record `dobb plan` sets its per-rank state model against;
  [benchmarks/plan/](../benchmarks/plan) (`dobb plan CONFIG.yaml --world N`): each
  optimizer's predicted per-rank state, bytes sent and call time at a layout, beside the
  model's measured errors."""


def names(labels: list[str]) -> str:
    """Configuration labels in a list (their own commas kept apart by semicolons)."""
    return "; ".join(labels) if any("," in label for label in labels) else ", ".join(labels)


def moves(rows: list[dict], low: int, high: int) -> str:
    """How the tuned lrs moved from width ``low`` to ``high`` (rows of the study's (f))."""
    stay, moved = [], {}
    for row in rows:
        for m in row["moves"]:
            if (m["from"], m["to"]) == (low, high):
                target = stay if m["transfers"] else moved.setdefault(m["ratio"], [])
                target.append(row["label"])
    verbs = {0.5: "halves", 2.0: "doubles"}
    groups = ([("stays put", stay)] if stay else []) + [
        (verbs.get(r, f"moves x{r:.3g}"), labels) for r, labels in moved.items()
    ]
    parts = [f"{verb} for {in_words(len(ls))} ({names(ls)})" for verb, ls in groups]
    return f"from width {low} to {high} the tuned lr " + " and ".join(parts)


def rows_of(rows: list[dict], optimizer: str) -> list[dict]:
    """The per-width entries of ``optimizer``'s row in the study's (f)."""
    return [
        w for r in rows if r["optimizer"] == optimizer and not r["options"] for w in r["widths"]
    ]


def wide(tuning: dict, spec: dict, width: int) -> str:
    """What (f) found at a wide width: how many configurations, the seeded pair."""
    rows = [r for r in tuning["rows"] if any(w["n_embd"] == width for w in r["widths"])]
    (best,) = [b for b in tuning["best_local"] if b["n_embd"] == width]
    (muon,) = [w for w in rows_of(rows, "muon") if w["n_embd"] == width]
    noise, k = best["noise"], spec["tuning_wide_seeded"]
    seeded = "shard-local one" if k == 1 else f"{in_words(k)} shard-local ones"
    verdict = (
        "no noise estimate"
        if noise is None
        else (f"{'beyond' if noise['exceeds'] else 'within'} the seed noise")
    )
    return (
        f"At width {width} {in_words(len(rows))} configurations are tuned "
        f"(`tuning_wide_widths`), with {in_words(muon['seeds']['n'])} seeds for Muon and the "
        f"best {seeded} (`tuning_wide_seeded`): "
        f"{best['label']}, {fmt_loss(best['mean'])}, against Muon's {fmt_loss(best['muon'])} "
        f"(gap {best['gap']:+.4f}, {verdict})"
    )


def study_bullet(bench: Path) -> str:
    """The bullet on benchmarks/STUDY.md."""
    study = read(bench / "study" / "study.json")
    spec, tuning = study["spec"], study["tuning"]
    periods = sorted(
        {a["value"] for a in study["ablations"] if a["option"] == "period"}
        | {a["default"] for a in study["ablations"] if a["option"] == "period"},
        key=lambda p: math.inf if p is None else p,
    )
    widths = tuning["widths"]
    narrow = [w for w in widths if w in spec["tuning_widths"]]
    tuned = [r for r in tuning["rows"] if {w["n_embd"] for w in r["widths"]} >= set(narrow)]
    sentences = [moves(tuning["rows"], a, b) for a, b in zip(narrow, narrow[1:])]
    sentences += [wide(tuning, spec, w) for w in spec["tuning_wide_widths"]]
    sentences += [
        moves(tuning["rows"], a, b) for a, b in zip(widths, widths[1:]) if b not in narrow
    ]
    sentences += [f"(g) {ordering_sentence(study['moe'])}"] if "moe" in study else []
    return f"""\
- [benchmarks/STUDY.md](../benchmarks/STUDY.md) (`python -m bench study`): learning-rate
  grids per optimizer, seeds at the best rates, Dobb's ablations (blocks, refresh interval,
  eigh vs power iteration, control bases, update scale, bf16 projections), the trend with
  width, MuonBP's period ({", ".join("never" if p is None else str(p) for p in periods)}),
  and (f) {in_words(len(tuned))} configurations each tuned on its own grid at widths
  {" and ".join(map(str, narrow))} with {in_words(spec["tuning_seeds"])} seeds at each tuned
  lr; the row-shard trend at width {narrow[-1]} uses each configuration's tuned lr there.
  """ + " ".join(f"{s[0].upper()}{s[1:]}." for s in sentences)


def render(bench: Path = BENCHMARKS) -> str:
    """The rendered part of docs/evidence.md, markers included: one list item per bullet,
    wrapped at ``WIDTH``."""
    bullets = [
        results_bullet(bench),
        gpu_bullet(bench),
        COMM_BULLET,
        MEMORY_BULLET,
        study_bullet(bench),
    ]
    items = [
        textwrap.fill(
            # a number ending in "." or ")" never starts a line (Markdown would list it)
            re.sub(r" (\d+[.)])", "\0\\1", " ".join(b.split()).removeprefix("- ")),
            WIDTH,
            initial_indent="- ",
            subsequent_indent="  ",
            break_long_words=False,
            break_on_hyphens=False,
        ).replace("\0", " ")
        for b in bullets
    ]
    return "\n".join([BEGIN, *items, END])


def rewrite(text: str, bench: Path = BENCHMARKS) -> str:
    """``text`` (docs/evidence.md) with its part between ``BEGIN`` and ``END`` rendered."""
    start, stop = text.find(BEGIN), text.find(END)
    if start < 0 or stop < start:
        raise ValueError(f"docs/evidence.md needs the markers {BEGIN!r} and {END!r}, in order")
    return text[:start] + render(bench) + text[stop + len(END) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if stale")
    args = parser.parse_args(argv)
    text = DOC.read_text()
    rendered = rewrite(text)
    if args.check:
        if rendered != text:
            print("docs/evidence.md is stale: run python -m bench.evidence", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(rendered)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
