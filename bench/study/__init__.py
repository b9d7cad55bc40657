"""The optimizer study, ``python -m bench study``: tuned comparison with seeds, Dobb
ablations, width trend, MuonBP's period, closing the gap, tuning at every width, a mixture of
experts -> STUDY.md.

    python -m bench study                          # 1-2 h on 2 CPU cores (budget.yaml)
    python -m bench study --tiny --out /tmp/study  # the whole pipeline on a tiny GPT

Seven parts, every run trained by `bench.compare.run` (so a finished run is never
repeated and an interrupted one resumes from its checkpoint: re-running the command after a
kill finishes the study; each run's ``code.json`` and each line of ``invocations.jsonl``
name the commit that trained it):

(a) Tuned comparison. Per optimizer (Dobb with 16 blocks, Dion with rank fraction 1/16,
    Muon, MuonBP over 4 row blocks, AdamW) a log-spaced lr grid around the registry's
    starting lr, extended one point at a time while the best lr sits at an edge, then extra
    seeds at each best lr (seed 0 is the sweep's own run). Dobb's difference to each
    baseline is set against the seed noise: it "exceeds the noise" when |mean difference|
    > 2 x pooled standard deviation of single runs; Welch's t is reported beside it.
(b) Dobb ablations at Dobb's tuned lr (paired with its seed-0 run): num_blocks, basis
    interval, eigh vs power-QR, statistics sync, basis source, update scale. Options whose
    best lr moves (num_blocks, update_scale) get a small lr sweep of their own.
(c) Width trend: the Dobb-Dion gap at several widths at fixed depth, each at its own best
    lr from a small sweep around the tuned lr of (a).
(d) MuonBP's period P (1: Muon with MuonBP's lr scaling, 2, 20, None: BlockMuon), each with a
    small lr sweep around MuonBP's tuned lr, against its seed-0 run (P=5) as in (b).
(e) Closing the gap to Muon without leaving the shard: two-sided Dobb and Dobb's variants
    (block sizes, Adam coefficients, slower statistics, a weights EMA), the row-shard trend
    and the width trend of the best variants.
(f) Every optimizer tuned at every width (``bench.study.tuning``): its own lr grid at each
    width, seeds at each tuned lr, whether the tuned lr transfers across width; and the
    recommended Dobb at many row shards (``bench.study.shards``): FSDP's rows per rank at
    two widths, with seeds and a retuned lr.
(g) A mixture of experts (``bench.study.moe``): the GPT of (a) with each MLP a mixture of
    experts, each optimizer of ``moe_optimizers`` and each configuration of (f) named in
    ``moe_tuned`` on its own lr grid with seeds, beside its dense numbers of (a) or (f):
    whether the dense ordering holds for experts.

``bench.study.runs`` plans and runs the training runs (``bench.study.gap``: those of (e),
and their analysis; ``bench.study.tuning``: those of (f); ``bench.study.moe``: those of
(g)); ``bench.study.analysis`` turns
them into numbers (seed statistics: ``bench.study.stats``), ``bench.study.findings`` into
statements and ``bench.study.report`` (with ``bench.study.plots``, ``bench.study.format``,
``bench.study.gap_report``, ``bench.study.tuning_report`` and ``bench.study.moe_report``)
into the document.
"""

import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.study.analysis import analyse
from bench.study.gap import run_gap
from bench.study.moe import check_moe_tuned, run_moe
from bench.study.report import write_document
from bench.study.runs import Runner, base_config, code_version, load_spec, run_study
from bench.study.shards import check_many_shards, run_many_shards
from bench.study.tuning import run_tuning, tuned
from bench.tools.records import stamped


def study(
    out: str | Path,
    doc: str | Path | None = None,
    *,
    tiny: bool = False,
    config: str | Path | None = None,
    workers: int | None = None,
    command: str | None = None,
    log=print,
) -> dict[str, Any]:
    """Run (or finish) the study into `out` and write the report; return its numbers.

    doc: the Markdown report (default: `STUDY.md` next to `out`); config: the budget
    (default `bench/study/budget.yaml`; `tiny` applies its `tiny` section); workers: override
    the config's number of parallel runs.
    """
    spec = load_spec(config, tiny)
    check_moe_tuned(spec)
    check_many_shards(spec, tuned(spec))
    if workers is not None:
        spec.workers = workers
    out = Path(out)
    doc = Path(doc) if doc is not None else out.parent / "STUDY.md"
    base = base_config(spec)
    started, t0, code = datetime.now(UTC), time.perf_counter(), code_version()  # what runs
    with Runner(spec.workers, spec.threads) as runner:
        results = run_study(spec, base, out, runner, log)
        results["gap"] = run_gap(spec, base, out, runner, results["best_lr"], log)
        results["tuning"] = run_tuning(spec, base, out, runner, results["best_lr"], log)
        results["many_shards"] = run_many_shards(spec, base, out, runner, results["tuning"], log)
        results["moe"] = run_moe(
            spec, base, out, runner, results["best_lr"], results["tuning"], log
        )
    command = command or " ".join(["dobb", *sys.argv[1:]])
    invocation = {
        "started": started.isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - t0,
        "new_runs": runner.new_runs,
        "command": command,
    } | code
    with open(out / "invocations.jsonl", "a") as f:
        f.write(json.dumps(invocation) + "\n")
    report = analyse(spec, base, out, results) | {
        "command": command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "invocations": [
            json.loads(x) for x in (out / "invocations.jsonl").read_text().splitlines()
        ],
        "new_runs": runner.new_runs,
    }
    write_document(report, out, doc)
    (out / "study.json").write_text(json.dumps(stamped(report), indent=1, default=str))
    log(f"{runner.new_runs} new runs; report: {doc}")
    return report
