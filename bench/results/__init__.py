"""Measure the optimizer-call benchmarks, then write ``benchmarks/RESULTS.md`` from their JSON.

    python -m bench.results                      # measure everything into benchmarks/
    python -m bench.results --render             # RESULTS.md from the JSON there only
    python -m bench.results --quick --out-dir /tmp/bench   # tiny and fast (tests)
    python -m bench.results gpu-table FILE.json ...        # Markdown of GPU runs

Measuring (``measure``): calibrate the cost model on this machine
(``bench.results.calibrate.calibrate``), time the optimizer calls in one process
(``bench.results.calltime.run``) and sharded over gloo ranks under FSDP, HSDP and TP
(``bench.results.calltime_sharded.run``), each into its JSON, and the run's own facts (date,
machine, commands) into ``bench.results.report.RUN_FILE``. Rendering
(``bench.results.report.render``) reads that JSON, the GPU runs (``benchmarks/gpu/*.json``,
written by ``benchmarks/gpu_calltime.sh``) and ``benchmarks/COMM.md`` when they exist, and
adds the cost model's predictions and plots.
"""

import argparse
import json
import os
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from bench.model.workload import hidden_matrices
from bench.results import calibrate, calltime, calltime_sharded
from bench.results.report import CALIBRATION_FILE, CALLTIME_FILE, RUN_FILE, render
from bench.results.sections import gpu_section
from bench.tools.records import stamped

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"  # the repository's
FULL = dict(config="gpt2-xl", layers=1, tokens=512, repeats=5, calls=1, warmup=1)
QUICK = dict(config="tiny", layers=2, tokens=64, repeats=2, calls=1, warmup=1)
# (layout, ranks) of the sharded runs; each gets the whole machine in turn
SHARDED = (("fsdp", 2), ("fsdp", 4), ("hsdp", 4), ("tp", 2))
QUICK_SHARDED = (("fsdp", 2), ("tp", 2))


def measure(
    out_dir: Path = BENCHMARKS,
    *,
    quick: bool = False,
    threads: int | None = None,
    invocation: str = "bench.results.measure()",
    **overrides,
) -> dict:
    """Run every measurement into ``out_dir``'s JSON, the run's facts into ``RUN_FILE``;
    returns those facts. ``overrides``: ``config``, ``layers``, ``tokens``, ``repeats`` ...
    of the call-time runs."""
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
    (out_dir / CALIBRATION_FILE).write_text(json.dumps(stamped(hw.to_json()), indent=1))
    thread_flag = f" --threads {threads}" if threads else ""
    shown = out_dir.resolve()
    shown = shown.relative_to(Path.cwd()) if shown.is_relative_to(Path.cwd()) else shown
    commands = [
        f"python -m bench.results.calibrate calibrate --config {settings['config']} --layers "
        f"{settings['layers']}{' --quick' if quick else ''}{thread_flag} "
        f"--out {shown / CALIBRATION_FILE}",
        f"python -m bench.results.calltime --config {settings['config']} --layers "
        f"{settings['layers']} --tokens {settings['tokens']} --repeats {settings['repeats']} "
        f"--warmup {settings['warmup']} --calls {settings['calls']}{thread_flag} "
        f"--out {shown / CALLTIME_FILE}",
    ]
    log("timing optimizer calls ...")
    calltime.run(
        settings["config"],
        settings["layers"],
        tokens=settings["tokens"],
        repeats=settings["repeats"],
        warmup=settings["warmup"],
        calls=settings["calls"],
        out=out_dir / CALLTIME_FILE,
        command=commands[1],
        progress=log,
    )
    sharded = []
    for layout, world in QUICK_SHARDED if quick else SHARDED:
        log(f"timing optimizer calls sharded over {world} ranks ({layout}) ...")
        record = calltime_sharded.run(
            layout,
            world,
            config=settings["config"],
            layers=settings["layers"],
            tokens=settings["tokens"],
            repeats=min(settings["repeats"], 3),  # ranks share the cores: slow
        )
        path = Path("sharded") / f"calltime_{layout}{world}.json"
        calltime.write_json(out_dir / path, record)
        commands.append(f"{record['command']} --out {shown / path}")
        sharded.append(str(path))
    run = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "invocation": invocation,
        "cpu": calltime.device_name(torch.device("cpu")),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commands": commands,
        "sharded": sharded,
        "wall_s": time.perf_counter() - started,
    }
    (out_dir / RUN_FILE).write_text(json.dumps(stamped(run), indent=1) + "\n")  # its commands
    return run


def generate(out_dir: Path = BENCHMARKS, **options) -> Path:
    """``measure`` into ``out_dir`` (``options`` go to it), then ``render`` there; returns
    the path of ``RESULTS.md``."""
    measure(out_dir, **options)
    path = render(out_dir)
    print(f"wrote {path}", flush=True)
    return path


def main(argv: list[str]) -> None:
    if argv and argv[0] == "gpu-table":  # Markdown of GPU JSON files (no plots, no runs)
        print(gpu_section([Path(f) for f in argv[1:]]) or "no files")
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=BENCHMARKS)
    parser.add_argument("--render", action="store_true", help="only render, from the JSON")
    parser.add_argument("--quick", action="store_true", help="tiny config, for tests")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--config", help="GPT config of the call-time run")
    parser.add_argument("--layers", type=int, help="blocks of the call-time run")
    parser.add_argument("--repeats", type=int)
    args = parser.parse_args(argv)
    invocation = " ".join(["python -m bench.results", *argv])
    if args.render:
        print(f"wrote {render(args.out_dir, rendered_by=invocation)}", flush=True)
        return
    overrides = {k: getattr(args, k) for k in ("config", "layers", "repeats")}
    generate(
        args.out_dir,
        quick=args.quick,
        threads=args.threads,
        invocation=invocation,
        **{k: v for k, v in overrides.items() if v is not None},
    )
