"""The resume rule: what a resume restores, which settings it may change, where it starts.

A resume restores the model, the optimizer state, the EMA, the RNG state and the step (the
data position). The settings in ``RESUMABLE`` may differ from the checkpoint's run and take
effect from the resumed step on (``apply_resumed_settings``); any other difference stops
the run with one line naming the field and the fix (``resume_conflict``).
"""

import json
import warnings
from pathlib import Path
from typing import Any

from torch.optim.lr_scheduler import LambdaLR

from dobb.train.checkpoint import CheckpointError, intact_checkpoint, read_metadata
from dobb.train.config import ConfigError, TrainConfig
from dobb.train.errors import RunError, RunWarning

# Config fields a resume may change: they take effect from the resumed step on. Any other
# field that differs from the checkpoint's run stops the resume (`resume_conflict`).
RESUMABLE = frozenset(
    {"lr", "scalar_lr", "steps", "warmup_steps", "decay", "min_lr_ratio", "grad_clip"}
    | {"weight_decay", "scalar_weight_decay"}
    | {"eval_interval", "eval_batches", "eval_ema", "grad_accum", "layout", "tensor_parallel"}
    | {"checkpoint_interval", "keep_checkpoints", "out_dir", "resume", "progress"}
    | {"data_cache", "timeout"}
)


# of optimizer_options; weight_decay for runs saved before it became a top-level setting
RESUMABLE_OPTIONS = frozenset({"weight_decay", "nonfinite"})


# optimizer group keys set from this run's config on resume; the rest must match the state
RESUMABLE_GROUP_KEYS = frozenset({"lr", "initial_lr", "weight_decay"})


RUN_FILES = ("run.json", "metrics.jsonl", "summary.json", "checkpoints")  # a run's files


def resume_conflict(cfg: TrainConfig, saved: dict[str, Any], checkpoint: Path) -> str | None:
    """Why `cfg` cannot resume the run whose config was `saved` (a one-line message naming
    the field and the fix), or None: every field outside `RESUMABLE` is the same."""
    fix = "or start a new run in another out_dir"
    current = cfg.to_dict()
    for key, value in current.items():
        if key in RESUMABLE or key not in saved:  # a field newer than the checkpoint
            continue
        old = saved[key]
        if key == "optimizer_options":
            names = sorted((set(old) | set(value)) - RESUMABLE_OPTIONS)
            for name in (n for n in names if old.get(n) != value.get(n)):
                was = f"{name}={old[name]!r}" if name in old else f"no {name}"
                return (
                    f"resume: optimizer_options.{name} is {value.get(name, 'unset')!r} but "
                    f"{checkpoint} was saved with {was}; a resume may change only "
                    f"optimizer_options {sorted(RESUMABLE_OPTIONS)}: set it as saved, {fix}"
                )
        elif old != value:
            return (
                f"resume: {key} is {value!r} but {checkpoint} was saved with {key}={old!r}; a "
                f"resume may change only {', '.join(sorted(RESUMABLE))} and optimizer_options "
                f"{', '.join(sorted(RESUMABLE_OPTIONS))}: set {key}={old!r}, {fix}"
            )
    return None


def start_point(cfg: TrainConfig) -> Path | None:
    """The checkpoint a run of `cfg` resumes from, or None to start at step 0.

    Without `resume`, an `out_dir` holding any of `RUN_FILES` is refused (a run is never
    silently replaced). With it, the newest intact checkpoint (damaged ones skipped with
    a warning; none intact: `CheckpointError`), or None if there is no checkpoint; a
    `cfg` that differs from the checkpoint's run outside `RESUMABLE` is a `ConfigError`,
    as is `steps` below the checkpoint's step.
    """
    out = Path(cfg.out_dir)
    if cfg.resume:
        found = intact_checkpoint(out / "checkpoints")
        if found is None and any((out / name).exists() for name in RUN_FILES):
            warnings.warn(f"{out} has no checkpoint to resume; starting over", RunWarning, 2)
        if found is not None:
            meta = read_metadata(found)
            if conflict := resume_conflict(cfg, meta.get("config", {}), found):
                raise ConfigError(conflict)
            if cfg.steps < meta["step"]:
                raise ConfigError(
                    f"resume: steps={cfg.steps} is below the step of {found} ({meta['step']}); "
                    f"set steps >= {meta['step']}, or start a new run in another out_dir"
                )
        return found
    held = [name for name in RUN_FILES if (out / name).exists()]
    if held:
        raise RunError(
            f"out_dir {str(out)!r} already holds a run ({', '.join(held)}); pass resume=true to "
            "continue it, or choose another out_dir (runs are never overwritten)"
        )
    return None


def apply_resumed_settings(opt, scheduler: LambdaLR, fresh: list[dict], checkpoint: Path) -> None:
    """After loading a checkpoint: this run's settings for `RESUMABLE_GROUP_KEYS` (the
    groups as `fresh`, built from this config, had them) and the scheduler's base rates;
    `CheckpointError` naming the first other group setting that differs from the state's.

    The lr of the resumed step is this schedule's: `initial_lr * multiplier(last_epoch)`.
    """
    for index, (group, new) in enumerate(zip(opt.param_groups, fresh, strict=True)):
        for key in sorted(set(group) | set(new)):
            if key in RESUMABLE_GROUP_KEYS or key in ("params", "param_names"):
                continue
            if group.get(key) != new.get(key):
                raise CheckpointError(
                    f"{checkpoint}: its optimizer's param_groups[{index}] has {key}="
                    f"{group.get(key)!r}, this run's optimizer {key}={new.get(key)!r}; resume "
                    "with the optimizer options it was saved with, or choose another out_dir"
                )
        for key in RESUMABLE_GROUP_KEYS & set(new):
            group[key] = new[key]
    scheduler.base_lrs = [group["initial_lr"] for group in opt.param_groups]
    for group, base, rule in zip(opt.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * rule(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in opt.param_groups]


def earlier_corpus(out: Path) -> dict[str, Any] | None:
    """The corpus `run.json` recorded (checkpoints older than their own "corpus" entry)."""
    try:
        return json.loads((out / "run.json").read_text()).get("corpus")
    except (OSError, ValueError):
        return None
