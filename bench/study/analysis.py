"""The optimizer study's numbers: from the summaries and logs of the runs of
`bench.study.runs`, the seed statistics, each difference set against the seed noise,
the ablation deltas, the same-math checks and the width trend."""

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import compare
from bench.compare import read_metrics
from bench.optimizers import STUDIED
from bench.study import gap as study_gap
from bench.study import moe as study_moe
from bench.study import shards as study_shards
from bench.study import tuning as study_tuning
from bench.study.runs import (
    WIDTH_PAIR,
    StudySpec,
    at_edge,
    best_run,
    defaults,
    is_one_column,
    loss_of,
    lr_center,
    round_lr,
)
from bench.study.stats import NOISE_FACTOR, compare_seeds, seed_stats
from dobb.train.config import TrainConfig

BASELINES = tuple(name for name in STUDIED if name != "dobb_paper")


def trace_difference(out: Path, run_a: str, run_b: str) -> float:
    """Largest |difference| between two runs' train and val losses, step by step."""
    a, b = (read_metrics(out / "runs" / r) for r in (run_a, run_b))
    if [r["step"] for r in a] != [r["step"] for r in b]:
        return math.inf
    keys = ("loss", "val_loss")
    return max(abs(x[k] - y[k]) for x, y in zip(a, b) for k in keys if k in x and k in y)


def protocol(base: TrainConfig) -> dict[str, float]:
    """The study's weight-decay protocol: the base config's, the same for every optimizer."""
    return compare.weight_decay_of(base.to_dict())


def follows(out: Path, run: str, base: TrainConfig) -> bool:
    """True if `run` trained with the protocol's weight decay (read from its logged config,
    `run.json`, or `diverged.json` for a run that diverged)."""
    logs = [out / "runs" / run / name for name in ("run.json", "diverged.json")]
    config = json.loads(next(p for p in logs if p.exists()).read_text())["config"]
    return compare.weight_decay_of(config) == protocol(base)


def check_key(row: dict[str, Any]) -> str:
    """An ablation row's key in the report's same-math `checks`: `option=value`."""
    return f"{row['option']}={row['value']}"


def analyse(spec: StudySpec, base: TrainConfig, out: Path, results: dict) -> dict[str, Any]:
    """The numbers of the report, from the runs' summaries and logs."""
    best_lr, main = results["best_lr"], results["main"]
    seeds = {name: seed_stats(runs) for name, runs in results["seeds"].items()}
    pairs = {name: compare_seeds(seeds["dobb_paper"], seeds[name]) for name in BASELINES}
    references = {  # each ablated optimizer at its tuned lr, seed 0, and its seed noise
        name: {
            "run": results["seeds"][name][0]["run"],
            "loss": loss_of(results["seeds"][name][0]),
            "noise": NOISE_FACTOR * seeds[name]["std"],
        }
        for name in dict.fromkeys(ab.optimizer for ab, _ in results["ablations"])
    }
    rows = _ablation_rows(results, seeds, references)
    width_noise = compare_seeds(seeds["dobb_paper"], seeds["dion"])["pooled_std"] * NOISE_FACTOR
    used = {s["run"]: s for runs in _all_runs(results) for s in runs}
    info = json.loads((out / "runs" / references["dobb_paper"]["run"] / "run.json").read_text())
    return {
        "budget": {k: v for k, v in base.to_dict().items() if k not in compare.UNCOMPARED},
        "spec": asdict(spec),
        "info": {k: info[k] for k in ("corpus", "num_params", "torch", "python", "machine")},
        "best_lr": best_lr,
        "sweeps": {
            name: [{"lr": s["lr"], "loss": loss_of(s), "run": s["run"]} for s in runs]
            for name, runs in main.items()
        },
        "sweep_edge": {name: at_edge(runs) for name, runs in main.items()},
        "seeds": seeds,
        "pairs": pairs,
        "references": references,
        "ablations": rows,
        "checks": _checks(out, results, rows, references["dobb_paper"]["run"]),
        "width": results["width"],
        "width_noise": width_noise,
        "widths": _width_rows(spec, results, width_noise),
        **(
            {"gap": study_gap.analyse_gap(results["gap"], seeds, results)}
            if "gap" in results
            else {}
        ),
        **(
            {"tuning": study_tuning.analyse_tuning(results["tuning"])}
            if "tuning" in results
            else {}
        ),
        **(
            {
                "many_shards": study_shards.analyse_many_shards(
                    results["many_shards"], results["tuning"]
                )
            }
            if results.get("many_shards", {}).get("seeds")
            else {}
        ),
        **(
            {
                "moe": study_moe.analyse_moe(
                    results["moe"], spec, study_moe.dense_numbers(spec, results, seeds)
                )
            }
            if results.get("moe", {}).get("sweeps")
            else {}
        ),
        "compute": {
            "runs": len(used),
            "diverged": sorted(name for name, s in used.items() if "diverged" in s),
            "train_time_s": sum(s.get("train_time_s") or 0.0 for s in used.values()),
            "code_records": sum((out / "runs" / name / "code.json").exists() for name in used),
            "protocol": protocol(base),
            "off_protocol": sorted(name for name in used if not follows(out, name, base)),
        },
    }


def _ablation_rows(results: dict, seeds: dict, references: dict) -> list[dict[str, Any]]:
    """Each ablation's best run against its optimizer's seed-0 run (and seeds, if seeded)."""
    rows = []
    for i, (ab, runs) in enumerate(results["ablations"]):
        top = best_run(runs)
        delta = loss_of(top) - references[ab.optimizer]["loss"]
        seeded = results.get("ablation_seeds", {}).get(i)
        if seeded:  # seeds of both sides: the difference of means against the pooled noise
            seeded = seed_stats(seeded)
            seeded["pair"] = compare_seeds(seeded, seeds[ab.optimizer])
        rows.append(
            {
                "optimizer": ab.optimizer,
                "option": ab.option,
                "value": ab.value,
                "default": defaults(ab.optimizer)[ab.option],
                "note": ab.note,
                "lrs": [s["lr"] for s in runs],
                "losses": [loss_of(s) for s in runs],
                "runs": [s["run"] for s in runs],
                "best_lr": top["lr"],
                "loss": loss_of(top),
                "delta": delta,
                "exceeds": seeded["pair"]["exceeds"]
                if seeded
                else bool(abs(delta) > references[ab.optimizer]["noise"]),
                "at_edge": at_edge(runs),
                "seeds": seeded,
            }
        )
    return rows


def _checks(out: Path, results: dict, rows: list[dict], dobb_run: str) -> dict[str, float]:
    """Runs that do Dobb's math by another route, against Dobb's seed-0 run (`dobb_run`):
    their largest loss difference, keyed by `check_key`; "signum": block size 1 against the
    identity basis at the same lr."""
    best_lr, checks = results["best_lr"], {}
    for (ab, _), row in zip(results["ablations"], rows):
        # same math as Dobb at its tuned lr: stats_sync on one process; a numeric update_scale
        # at the lr that keeps alpha x lr (it only rescales the hidden matrices' lr)
        lr = round_lr(lr_center(ab, best_lr))
        same = ab.option == "stats_sync" or (
            ab.option == "update_scale" and not isinstance(ab.value, str)
        )
        if same and lr in row["lrs"]:
            checks[check_key(row)] = trace_difference(
                out, dobb_run, row["runs"][row["lrs"].index(lr)]
            )
    signum = [r for r in rows if is_one_column(r, results["width"])]
    identity = [r for r in rows if r["option"] == "basis_source" and r["value"] == "identity"]
    if signum and identity and best_lr["dobb_paper"] in signum[0]["lrs"]:
        run = signum[0]["runs"][signum[0]["lrs"].index(best_lr["dobb_paper"])]
        checks["signum"] = trace_difference(out, identity[0]["runs"][0], run)
    return checks


def _width_rows(spec: StudySpec, results: dict, noise: float) -> list[dict[str, Any]]:
    """The Dobb - Dion gap at each width of (c), each at its best lr."""
    widths = []
    for w in spec.widths:
        dobb, dion = (best_run(results["widths"][(n, w)]) for n in WIDTH_PAIR)
        gap = loss_of(dobb) - loss_of(dion)
        widths.append(
            {
                "n_embd": w,
                "num_params": dobb.get("num_params"),
                "dobb_lr": dobb["lr"],
                "dobb_loss": loss_of(dobb),
                "dion_lr": dion["lr"],
                "dion_loss": loss_of(dion),
                "gap": gap,
                "exceeds": bool(abs(gap) > noise),
                "at_edge": [n for n in WIDTH_PAIR if at_edge(results["widths"][(n, w)])],
            }
        )
    return widths


def _all_runs(results: dict) -> list[list[dict]]:
    return [
        *results["main"].values(),
        *results["seeds"].values(),
        *(runs for _, runs in results["ablations"]),
        *results.get("ablation_seeds", {}).values(),
        *results["widths"].values(),
        *(study_gap.all_runs(results["gap"]) if "gap" in results else []),
        *(study_tuning.all_runs(results["tuning"]) if "tuning" in results else []),
        *(study_shards.all_runs(results["many_shards"]) if "many_shards" in results else []),
        *(study_moe.all_runs(results["moe"]) if "moe" in results else []),
    ]
