"""The main job: train one small GPT with each optimizer of the comparison and report it.

    python -m bench compare             # mini GPT on the stdlib corpus, ~23 min on 2 CPU cores
    python -m bench compare --quick     # smoke run: tiny GPT, a few steps, < 1 min
    python -m bench compare --lr-sweep  # a log-spaced lr grid per optimizer, then the best

Each optimizer trains at its tuned learning rate at the model's width
(`dobb.registry.recommended_lr`: the study's tuned lr at the nearest width it tuned that
entry at, held to `benchmarks/study/study.json` by a test) with its registry entry's settings
(`dobb_paper`: the paper's 16 blocks; Dion: rank fraction 1/16). Every run writes its own log under
`<out>/runs/<optimizer>-lr<lr>/`; the report (`summary.md`, `results.json`, PNG plots)
is built from those logs only. A finished run (its `summary.json` exists) is not repeated,
and an interrupted one resumes from its last checkpoint, so re-running the same command
finishes the job.
"""

import json
import shlex
import shutil
import sys
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.optimizers import BLOCK_OPTIONS, COMPARED, LAB, lab_entry
from bench.tools.markdown import markdown_table
from bench.tools.records import stamped
from dobb.registry import PAPER_DOBB, RENAMED, TUNED_LR, get_entry, recommended_lr
from dobb.train.config import ConfigError, TrainConfig, apply_overrides
from dobb.train.model import gpt_config
from dobb.train.trainer import train

OPTIMIZERS = COMPARED  # the main job runs every entry of the lab's table, in its order
# each one's settings (the paper's, and 4 row blocks standing for 4 FSDP shards)
OPTIONS: dict[str, dict[str, Any]] = {name: dict(e.harness_options) for name, e in LAB.items()}
# Default budget: the mini GPT (4 layers, d=256, 3.3M parameters, byte tokens) at 16 x 256
# tokens per step. Measured on the 2-core CPU machine (torch 2.13, 2 threads, another job
# using about one core): 0.51 s/step (adamw), 0.53 (dion), 0.58 (muon), 0.55-0.95 (dobb,
# whose many small ops suffer most from the contention; ~0.55 when it had the cores).
# 350 steps x ~0.6 s + 11 evaluations x ~1.4 s + checkpoints ~ 225 s per run (the five
# runs of 2026-11-30 took 14 min together), so the eight (NorMuon and Dion2 added; not yet
# timed together) should take ~23 min. 350 steps x 4096
# tokens = 1.43M tokens per run.
BUDGET = dict(
    model="mini",
    batch_size=16,
    block_size=256,
    steps=350,
    warmup_steps=35,
    eval_interval=35,
    eval_batches=8,
    checkpoint_interval=70,
    keep_checkpoints=1,
)
# Smoke test: the tiny GPT, a few steps, about a minute for all six optimizers.
QUICK_BUDGET = dict(
    model="tiny",
    batch_size=8,
    block_size=64,
    steps=20,
    warmup_steps=2,
    eval_interval=5,
    eval_batches=2,
    checkpoint_interval=0,
)
LR_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)  # the sweep grid: each default lr times these
# Fields set per run by `compare` itself, not by `key=value` overrides.
PER_RUN = ("optimizer", "lr", "scalar_lr", "optimizer_options", "out_dir", "resume")
# Config fields that do not change what a run computes (ignored when matching old runs).
UNCOMPARED = (
    "out_dir",
    "resume",
    "progress",
    "checkpoint_interval",
    "keep_checkpoints",
    "timeout",
)
# Config fields added after runs were logged, with the value a config without them means.
ADDED_FIELDS = {"eval_ema": None}
# Before weight decay was a TrainConfig field (one protocol, issue #35), a run's hidden
# matrices took the class default (or optimizer_options.weight_decay), and the scalar group
# inherited it through torch.optim's default filling; these classes' defaults were 0.01
# (torch.optim.AdamW's for "adamw"), every other optimizer's 0.
PRE_PROTOCOL_WEIGHT_DECAY = {"dion": 0.01, "dion2": 0.01, "nordion2": 0.01, "adamw": 0.01}
# Until Dobb's defaults became the recommended configuration (issue #43) they were the
# paper's, so a "dobb" run logged before the lab's options pinned them (one-sided, the sign,
# statistics averaged on refresh steps) took them without naming them; its block count was
# always named, and a block width given beside it overrode it (now the lab drops the count).
# Logs since carry what their entry built (``optimizer_settings``) and need no such rule.
PRE_RECOMMENDED_OPTIONS = {
    "dobb": {k: v for k, v in PAPER_DOBB.items() if k not in ("lr", "num_blocks")}
}


def weight_decay_of(config: dict[str, Any]) -> dict[str, float]:
    """The weight decay a logged config trained with: ``weight_decay`` (hidden matrices)
    and ``scalar_weight_decay`` (embeddings, head, norms, biases), also for older logs."""
    if "weight_decay" in config:
        return {k: config[k] for k in ("weight_decay", "scalar_weight_decay")}
    default = PRE_PROTOCOL_WEIGHT_DECAY.get(config["optimizer"], 0.0)
    decay = config.get("optimizer_options", {}).get("weight_decay", default)
    return {"weight_decay": decay, "scalar_weight_decay": decay}


def base_config(quick: bool = False, steps: int | None = None, overrides=None) -> TrainConfig:
    """The shared config of every run: budget, then `--steps`, then `key=value` overrides."""
    fixed = sorted(k.partition(".")[0] for k in overrides or {} if k.partition(".")[0] in PER_RUN)
    if fixed:
        raise ConfigError(
            f"compare sets {fixed} per run; choose optimizers with --optimizers and learning "
            "rates with --lr-sweep/--lrs"
        )
    budget = dict(QUICK_BUDGET if quick else BUDGET)
    if steps is not None:
        budget |= dict(steps=steps, warmup_steps=steps // 10, eval_interval=max(1, steps // 10))
        if budget["checkpoint_interval"]:
            budget["checkpoint_interval"] = max(1, steps // 5)
    cfg = TrainConfig(**budget, decay="cosine")
    return apply_overrides(cfg, overrides or {}).validate()


def width_of(cfg: TrainConfig) -> int:
    """The model width (``n_embd``) ``cfg`` trains."""
    return gpt_config(cfg.model, **cfg.model_overrides).n_embd


def run_name(optimizer: str, lr: float) -> str:
    return f"{optimizer}-lr{lr:.4g}"


def run_config(base: TrainConfig, optimizer: str, lr: float | None, out: Path) -> TrainConfig:
    """`base` for one optimizer at `lr` (None: the registry's), logging under `out/runs/`."""
    lr = lab_entry(optimizer).start_lr if lr is None else lr
    return replace(
        base,
        optimizer=optimizer,
        lr=lr,
        scalar_lr=None,
        optimizer_options=dict(OPTIONS.get(optimizer, {})),
        out_dir=str(out / "runs" / run_name(optimizer, lr)),
        resume=True,
    )


def logged_settings(record: dict[str, Any]) -> dict[str, Any]:
    """The optimizer a run log (``run.json``, ``diverged.json``) trained: its class and the
    options it took beyond the class's defaults (``OptimizerEntry.settings``). A log written
    before logs recorded them names an entry: a renamed one by its new name
    (``dobb.registry.RENAMED``), and "dobb" with the defaults it had then
    (``PRE_RECOMMENDED_OPTIONS``)."""
    if "optimizer_settings" in record:
        return record["optimizer_settings"]
    config = record["config"]
    name = RENAMED.get(config["optimizer"], config["optimizer"])
    options = PRE_RECOMMENDED_OPTIONS.get(name, {}) | config["optimizer_options"]
    return get_entry(name).settings(options)


def settings_record(cfg: TrainConfig) -> dict[str, Any]:
    """``cfg`` as a run log records it (the fields ``comparable_config`` reads)."""
    settings = get_entry(cfg.optimizer).settings(cfg.optimizer_options)  # as the trainer's
    return {"config": cfg.to_dict(), "optimizer_settings": settings}


def comparable_config(record: dict[str, Any]) -> dict[str, Any]:
    """The fields of a run log (``run.json``: ``config`` and ``optimizer_settings``) that
    decide what the run computes; a field added later and missing from an older log takes
    its `ADDED_FIELDS` value (the old behaviour). The optimizer is compared by what it
    built (``logged_settings``), so a configuration keeps matching its runs when the lab
    names it anew (the paper's Dobb: logged as "dobb", now "dobb_paper")."""
    config = record["config"]
    logged = ADDED_FIELDS | config | weight_decay_of(config)
    settings = logged_settings(record)
    options = json.loads(json.dumps(settings["options"]))  # as logged: tuples are lists
    overridden = {count for count, width in BLOCK_OPTIONS if options.get(width) is not None}
    options = {k: v for k, v in options.items() if k != "weight_decay" and k not in overridden}
    logged["optimizer"], logged["optimizer_options"] = settings["class"], options
    return {k: v for k, v in logged.items() if k not in UNCOMPARED}


def run(cfg: TrainConfig, log=print) -> dict[str, Any]:
    """Train `cfg` unless its directory holds a finished run of the same config."""
    out = Path(cfg.out_dir)
    if (out / "run.json").exists():
        old = comparable_config(json.loads((out / "run.json").read_text()))
        new = comparable_config(settings_record(cfg))
        if old != new:
            diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
            raise FileExistsError(
                f"{out} holds a run with a different config ({', '.join(diff)}); "
                "choose another --out or delete that directory"
            )
    if (out / "summary.json").exists():
        log(f"{out.name}: finished earlier, not repeated")
        return json.loads((out / "summary.json").read_text())
    log(f"{out.name}: training {cfg.steps} steps")
    summary = train(cfg)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the logs hold the results
    log(
        f"{out.name}: val loss {summary['final_val_loss']:.4f}, "
        f"{summary['tokens_per_s']:.0f} tok/s, optimizer {summary['opt_ms']:.1f} ms/step"
    )
    return summary


def compare(
    out: str | Path,
    optimizers=OPTIMIZERS,
    *,
    quick: bool = False,
    steps: int | None = None,
    lr_sweep: bool = False,
    lr_factors=LR_FACTORS,
    lrs: dict[str, list[float]] | None = None,
    overrides: dict[str, str] | None = None,
    command: str | None = None,
    log=print,
) -> dict[str, Any]:
    """Run the comparison (or the lr sweep) into `out` and write the report; return it.

    lrs: explicit sweep grids per optimizer (otherwise the registry lr times `lr_factors`).
    overrides: `key=value` TrainConfig overrides applied to every run.
    """
    out = Path(out)
    base = base_config(quick, steps, overrides)
    grids = {}
    for name in optimizers:
        default = lab_entry(name).start_lr
        if lr_sweep:
            grids[name] = sorted((lrs or {}).get(name) or [default * f for f in lr_factors])
        else:
            grids[name] = [recommended_lr(name, width_of(base))]
    results = {  # each summary under the lab's name (an older log keeps the name it ran as)
        name: [run(run_config(base, name, lr, out), log) | {"optimizer": name} for lr in grid]
        for name, grid in grids.items()
    }
    best = {name: min(runs, key=lambda s: s["final_val_loss"]) for name, runs in results.items()}
    report = {
        "command": command or shlex.join(sys.argv),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "budget": {k: v for k, v in base.to_dict().items() if k not in UNCOMPARED},
        "lr_sweep": lr_sweep,
        "results": results,
        "best": best,
    }
    write_report(out, report)
    log(table(best.values()))
    log(f"report: {out / 'summary.md'}")
    return report


# ---- report --------------------------------------------------------------------------

COLUMNS = (  # (header, summary key, format)
    ("optimizer", "optimizer", "{}"),
    ("lr", "lr", "{:.4g}"),
    ("final val loss", "final_val_loss", "{:.4f}"),
    ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ("optimizer ms/step", "opt_ms", "{:.2f}"),
    ("optimizer state B/param", "state_bytes_per_param", "{:.2f}"),
    ("train time s", "train_time_s", "{:.1f}"),
)


def table(summaries) -> str:
    """The results table (markdown, also printed): one row per run summary."""
    rows = [[fmt.format(s[key]) for _, key, fmt in COLUMNS] for s in summaries]
    return markdown_table([h for h, _, _ in COLUMNS], rows)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def plot_curves(out: Path, run_dirs: dict[str, Path]) -> list[str]:
    """Validation loss against step and against training time, one line per run."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    files = []
    for x_key, x_label, filename in (
        ("step", "step", "val_loss_vs_step.png"),
        ("time_s", "training time (s, evaluation excluded)", "val_loss_vs_time.png"),
    ):
        fig = Figure(figsize=(6, 4), layout="constrained")
        ax = fig.subplots()
        for label, run_dir in run_dirs.items():
            points = [(r[x_key], r["val_loss"]) for r in read_metrics(run_dir) if "val_loss" in r]
            ax.plot(*zip(*points), marker="o", markersize=3, label=label)
        ax.set_xlabel(x_label)
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.savefig(out / filename, dpi=120)
        files.append(filename)
    return files


def plot_sweep(out: Path, results: dict[str, list[dict[str, Any]]]) -> str:
    """Final validation loss against learning rate (log scale), one line per optimizer."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for name, runs in results.items():
        runs = sorted(runs, key=lambda s: s["lr"])
        ax.plot([s["lr"] for s in runs], [s["final_val_loss"] for s in runs], "o-", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (hidden matrices; all parameters for AdamW)")
    ax.set_ylabel("final validation loss")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.savefig(out / "lr_sweep.png", dpi=120)
    return "lr_sweep.png"


def write_report(out: Path, report: dict[str, Any]) -> None:
    """`summary.md`, `results.json` and the plots, from the runs' own logs and summaries."""
    out.mkdir(parents=True, exist_ok=True)
    best = report["best"]
    run_dirs = {
        f"{name} (lr {s['lr']:.4g})": out / "runs" / run_name(name, s["lr"])
        for name, s in best.items()
    }
    info = json.loads((next(iter(run_dirs.values())) / "run.json").read_text())
    corpus, machine = info["corpus"], info["machine"]
    budget = report["budget"]
    tokens = budget["steps"] * budget["batch_size"] * (budget["block_size"] or 0)
    plots = plot_curves(out, run_dirs)
    lines = [
        f"# Optimizer comparison{' (lr sweep)' if report['lr_sweep'] else ''}",
        "",
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
        f"- machine: {machine['platform']}, {machine['processor']}, "
        f"{machine['cpu_count']} CPUs, {machine['torch_threads']} torch threads"
        + (f", {machine['cuda']}" if machine.get("cuda") else ""),
        f"- torch {info['torch']}, Python {info['python']}",
        f"- corpus: {corpus['name']} ({corpus['num_bytes']:,} bytes, {corpus['num_tokens']:,} "
        f"tokens, {corpus['tokenizer']} tokenizer), sha256 `{corpus['sha256']}`",
        f"- model: GPT `{budget['model']}` ({info['num_params']:,} parameters)",
        f"- budget: {budget['steps']} steps x {budget['batch_size']} sequences x "
        f"{budget['block_size']} tokens = {tokens:,} tokens per run; warmup "
        f"{budget['warmup_steps']} steps, {budget['decay']} decay to "
        f"{budget['min_lr_ratio']} x lr; validation every {budget['eval_interval']} steps on "
        f"{budget['eval_batches']} fixed batches",
        "",
        "## Learning rates used",
        "",
    ]

    def source(name: str) -> str:
        if report["lr_sweep"]:
            return "best of the sweep below"
        width = gpt_config(budget["model"], **budget["model_overrides"]).n_embd
        tuned = sorted(TUNED_LR.get(name, ()))
        if not tuned:
            return "registry starting value (not tuned)"
        return f"recommended_lr at width {width} (tuned at {', '.join(map(str, tuned))})"
        return "registry starting value (not tuned)"

    lr_rows = [
        [
            name,
            f"{s['lr']:.4g}",
            "-" if s["scalar_lr"] is None else f"{s['scalar_lr']:.4g}",
            options_text(name),
            source(name),
        ]
        for name, s in best.items()
    ]
    lines += [
        markdown_table(["optimizer", "lr", "scalar lr", "options", "source"], lr_rows),
        "",
        "Study values are the best of `python -m bench study`'s grids on a smaller GPT "
        "(4 layers, width 128); registry starting values (`dobb/registry.py`) are untuned. "
        "`python -m bench compare --lr-sweep` sweeps at this budget.",
        "",
        "## Results",
        "",
        table(best.values()),
        "",
        "tokens/s and optimizer ms/step leave out each run's first step; optimizer ms/step "
        "is measured around `opt.step()` only (Dobb's basis refreshes included, amortized). "
        "State bytes count every tensor in the optimizer state by its global size.",
        "",
        *[f"![{p}]({p})" for p in plots],
        "",
    ]
    if report["lr_sweep"]:
        sweep_plot = plot_sweep(out, report["results"])
        rows = [
            [name, f"{s['lr']:.4g}", f"{s['final_val_loss']:.4f}", "yes" if s is best[name] else ""]
            for name, runs in report["results"].items()
            for s in sorted(runs, key=lambda s: s["lr"])
        ]
        lines += [
            "## Learning-rate sweep",
            "",
            markdown_table(["optimizer", "lr", "final val loss", "best"], rows),
            "",
            f"![{sweep_plot}]({sweep_plot})",
            "",
        ]
        best_lrs = {name: s["lr"] for name, s in best.items()}
        (out / "best_lrs.json").write_text(json.dumps(best_lrs, indent=1))
    lines += ["## Run logs", ""]
    lines += [
        f"- {name}: [`{d.relative_to(out)}/summary.json`]({d.relative_to(out)}/summary.json)"
        for name, d in run_dirs.items()
    ]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(stamped(report), indent=1, default=float))


def spell_options(options: dict[str, Any]) -> str:
    """Options as `key=value, ...` (floats to 4 significant digits); "-" for none."""
    spelt = (f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in options.items())
    return ", ".join(spelt) or "-"


def options_text(name: str) -> str:
    """What the lab runs ``name`` with beyond its class's defaults, e.g.
    `rank_fraction=0.0625`: its registry entry's settings and the lab's
    (``OptimizerEntry.settings``)."""
    return spell_options(get_entry(name).settings(OPTIONS.get(name))["options"])
