"""Write ``benchmarks/RESULTS.md`` and its plots from the JSON of a measuring run.

``render(out_dir)`` reads what ``bench.results`` wrote there (``RUN_FILE``,
``cpu_calibration.json``, ``calltime_cpu.json``, the sharded records ``RUN_FILE`` lists,
``gpu/*.json``, ``COMM.md``) and measures nothing: the sections come from
``results_sections`` (measured data) and ``results_model`` (the cost model's predictions).
"""

from pathlib import Path

from bench.model.costmodel import CATEGORIES
from bench.model.hardware import Hardware
from bench.results.model import (
    XL_WORLD,
    constants_section,
    discussion,
    layout_table,
    paper_section,
    scaling,
    sweep_tables,
)
from bench.results.plots import plot
from bench.results.sections import (
    calibration_section,
    calltime_section,
    check_section,
    gpu_section,
    machine_section,
    sharded_section,
    state_section,
)
from bench.tools.records import read_record

RUN_FILE = "results_run.json"  # the measuring run: date, machine, commands, sharded records
CALIBRATION_FILE, CALLTIME_FILE = "cpu_calibration.json", "calltime_cpu.json"


def read_json(path: Path) -> dict:
    """The JSON object in ``path``."""
    return read_record(path)


def render(out_dir: Path, rendered_by: str | None = None) -> Path:
    """Write ``out_dir/RESULTS.md`` (+ PNG plots) from the JSON in ``out_dir``; returns its
    path. ``rendered_by``: the command rendering again, named in the document."""
    out_dir = Path(out_dir)
    run = read_json(out_dir / RUN_FILE)
    record = read_json(out_dir / CALLTIME_FILE)
    hw = Hardware.from_json(read_json(out_dir / CALIBRATION_FILE))
    sharded = [read_json(out_dir / f) for f in run["sharded"]]
    paper, paper_rows = paper_section()
    sweeps, worlds, widths = sweep_tables()
    plots = plot(worlds, widths, out_dir)
    gpu = gpu_section(sorted((out_dir / "gpu").glob("*.json")))
    comm = out_dir / "COMM.md"
    sections = [
        "# Optimizer-call benchmarks and cost model",
        machine_section(run, rendered_by),
        "## 1. Measured optimizer-call time (CPU, single process)\n\n" + calltime_section(record),
        "## 2. Measured optimizer-call time, sharded (CPU, gloo ranks)\n\n"
        + sharded_section(sharded),
        "## 3. Optimizer state per parameter\n\n" + state_section(record),
        "## 4. Cost model: calibration here, and its error against section 1\n\n"
        + calibration_section(hw)
        + "\n\n"
        + check_section(record, hw, "Predicted (calibrated profile) vs measured medians:"),
        f"## 5. Prediction: GPT-2 XL, FSDP on {XL_WORLD} H100, beside the paper\n\n"
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
    sections.append(
        "## Constants and sources\n\n" + constants_section() + f"\nCategories: {CATEGORIES}."
    )
    path = out_dir / "RESULTS.md"
    path.write_text("\n\n".join(sections) + "\n")
    return path
