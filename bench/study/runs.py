"""The optimizer study's training runs: the budget, one config per run, parallel and
resumable running, lr sweeps that grow at an edge, and the runs of every part of the study
(``bench.study`` describes the parts)."""

import fcntl
import inspect
import json
import math
import shutil
import signal
import subprocess
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, datetime
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
import yaml

from bench import compare
from bench.compare import OPTIONS, width_of
from bench.optimizers import STUDIED, lab_entry, with_options
from dobb.optim.dobb_core import update_alpha, update_scale_of
from dobb.registry import get_entry
from dobb.train.config import ConfigError, TrainConfig, apply_overrides
from dobb.train.model import GPTConfig, gpt_config

DEFAULT_CONFIG = Path(__file__).with_name("budget.yaml")  # the lab's: not in the wheel
PER_RUN = (*compare.PER_RUN, "seed")  # set by the study for each run

# (c)'s design, by lab name: the paper's comparison, Dobb against Dion, at each width
WIDTH_PAIR = ("dobb_paper", "dion")


# ---- the budget ----------------------------------------------------------------------


@dataclass
class StudySpec:
    """One section of `bench/study/budget.yaml` (see the comments there)."""

    train: dict[str, Any]
    lr_factors: list[float]
    max_extensions: int
    seeds: int
    ablation_lr_factors: list[float]
    ablation_max_extensions: int
    widths: list[int]
    gap_widths: list[int] = field(default_factory=lambda: [256, 512])
    shard_counts: list[int] = field(default_factory=lambda: [2, 4, 8, 16, 32])
    gap_seeds: int = 3
    gap_seeded: int = 2
    tuning_widths: list[int] = field(default_factory=lambda: [128, 256])
    tuning_wide_widths: list[int] = field(default_factory=list)
    tuning_lr_factors: list[float] = field(default_factory=lambda: [0.25, 0.5, 1, 2])
    tuning_max_extensions: int = 2
    tuning_seeds: int = 3
    tuning_wide_seeded: int = 0
    tuning_scale_rules: bool = False
    tuning_shard_counts: list[int] = field(default_factory=list)
    many_shards_widths: list[int] = field(default_factory=list)
    many_shards_counts: list[int] = field(default_factory=list)
    many_shards_seeds: int = 3
    many_shards_seeded: list[list[int]] = field(default_factory=list)
    many_shards_lr_factors: list[float] = field(default_factory=list)
    many_shards_retuned: list[list[int]] = field(default_factory=list)
    moe_optimizers: list[str] = field(default_factory=list)
    moe_tuned: list[str] = field(default_factory=list)
    moe_model: dict[str, Any] = field(default_factory=dict)
    moe_lr_factors: list[float] = field(default_factory=lambda: [0.25, 0.5, 1, 2, 4])
    moe_max_extensions: int = 2
    moe_seeds: int = 2
    workers: int = 2
    threads: int = 1

    def validate(self) -> "StudySpec":
        checks = {
            "lr_factors": len(self.lr_factors) >= 2 and min(self.lr_factors) > 0,
            "max_extensions": self.max_extensions >= 0,
            "seeds": self.seeds >= 2,
            "ablation_lr_factors": len(self.ablation_lr_factors) >= 1,
            "ablation_max_extensions": self.ablation_max_extensions >= 0,
            "widths": len(self.widths) >= 2,
            "gap_widths": len(self.gap_widths) >= 1,
            "shard_counts": len(self.shard_counts) >= 1,
            "gap_seeds": self.gap_seeds >= 2,
            "gap_seeded": self.gap_seeded >= 0,
            "tuning_widths": len(self.tuning_widths) >= 1,
            "tuning_lr_factors": len(self.tuning_lr_factors) >= 2
            and min(self.tuning_lr_factors) > 0,
            "tuning_max_extensions": self.tuning_max_extensions >= 0,
            "tuning_seeds": self.tuning_seeds >= 2,
            "tuning_wide_seeded": self.tuning_wide_seeded >= 0,
            "many_shards_counts": all(n >= 1 for n in self.many_shards_counts),
            "many_shards_seeds": self.many_shards_seeds >= 2,
            "many_shards_lr_factors": all(f > 0 and f != 1 for f in self.many_shards_lr_factors),
            "moe_optimizers": set(self.moe_optimizers) <= set(STUDIED),
            "moe_model": not (self.moe_optimizers or self.moe_tuned)
            or self.moe_model.get("n_experts", 0) > 0,
            "moe_lr_factors": len(self.moe_lr_factors) >= 2 and min(self.moe_lr_factors) > 0,
            "moe_max_extensions": self.moe_max_extensions >= 0,
            "moe_seeds": self.moe_seeds >= 2,
            "workers": self.workers >= 1,
            "threads": self.threads >= 1,
        }
        for key, ok in checks.items():
            if not ok:
                raise ConfigError(f"study config: {key}={getattr(self, key)!r} is invalid")
        fixed = [k for k in self.train if k in PER_RUN]
        if fixed:
            raise ConfigError(f"study config: the study sets {fixed} per run")
        try:  # (g)'s model: GPTConfig fields on top of the study's
            moe_config(self)
        except ValueError as e:
            raise ConfigError(f"study config: moe_model={self.moe_model!r}: {e}") from None
        return self


def load_spec(path: str | Path | None = None, tiny: bool = False) -> StudySpec:
    """The `full` section of the study config; with `tiny`, the `tiny` section on top."""
    path = Path(path or DEFAULT_CONFIG)
    if not path.is_file():
        raise ConfigError(f"study config {str(path)!r}: no such file")
    data = yaml.safe_load(path.read_text())
    spec = dict(data["full"])
    if tiny:
        small = dict(data.get("tiny") or {})
        spec |= small | {"train": spec["train"] | small.get("train", {})}
    unknown = set(spec) - {f.name for f in fields(StudySpec)}
    if unknown:
        raise ConfigError(f"study config: unknown keys {sorted(unknown)}")
    return StudySpec(**spec).validate()


def moe_config(spec: StudySpec) -> GPTConfig:
    """The GPT of (g): the study's model (``train``) with ``moe_model``'s fields on top."""
    overrides = spec.train.get("model_overrides", {}) | spec.moe_model
    return gpt_config(spec.train.get("model", TrainConfig.model), **overrides)


def base_config(spec: StudySpec) -> TrainConfig:
    return apply_overrides(TrainConfig(), dict(spec.train)).validate()


def run_config(
    base: TrainConfig,
    out: Path,
    optimizer: str,
    lr: float,
    *,
    options: dict[str, Any] | None = None,
    width: int | None = None,
    seed: int = 0,
    train: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
) -> TrainConfig:
    """`base` for one run, logging under `out/runs/<name>`; the name spells what differs.

    Runs of (a) at seed 0 are named as `python -m bench compare` names them (`dobb_paper-lr0.002`).
    `train`: TrainConfig fields set for this run (e.g. `eval_ema`); `model`: GPTConfig
    fields on top of `base.model_overrides` (e.g. (g)'s `n_experts`), named first.
    """
    options, train, model = dict(options or {}), dict(train or {}), dict(model or {})
    tags = [f"{k}-{v}" for k, v in {**model, **options, **train}.items()]
    tags += [f"w{width}"] if width else []
    name = "-".join([optimizer, *tags, f"lr{lr:.4g}"]) + (f"-s{seed}" if seed else "")
    overrides = dict(base.model_overrides) | model | ({"n_embd": width} if width else {})
    return replace(
        base,
        **train,
        optimizer=optimizer,
        lr=lr,
        scalar_lr=None,
        optimizer_options=with_options(optimizer, options),
        model_overrides=overrides,
        seed=seed,
        out_dir=str(out / "runs" / name),
        resume=True,
    )


# ---- running -------------------------------------------------------------------------


def row_block_options(
    optimizer: str, n: int, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The option that sets ``n`` row blocks on top of ``OPTIONS[optimizer] | options``: none
    where those already have ``n``, so the run keeps its name (and is that run)."""
    rows = (OPTIONS[optimizer] | (options or {})).get("row_blocks")
    return {} if rows == n else {"row_blocks": n}


def loss_of(summary: dict[str, Any]) -> float:
    """Final validation loss; +inf for a diverged run (NaN loss or a non-finite gradient)."""
    value = summary.get("final_val_loss")
    return value if value is not None and math.isfinite(value) else math.inf


def is_done(cfg: TrainConfig) -> bool:
    out = Path(cfg.out_dir)
    return (out / "summary.json").exists() or (out / "diverged.json").exists()


def run_one(cfg: TrainConfig) -> dict[str, Any]:
    """`compare.run`, and a run that stops on a non-finite gradient is recorded as diverged
    (`diverged.json`, loss NaN) instead of failing the study; neither is ever repeated.
    Each start of an unfinished run appends the lab's commit to `<run>/code.json`.

    A lock on `<run>/.lock` (released by the OS when its process dies) refuses a second
    process on the same run, e.g. a restarted study racing a worker that outlived a kill.
    """
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"another process is training {out}; wait for it") from None
        return _run_unlocked(cfg, out) | {"run": out.name}


def code_version() -> dict[str, Any]:
    """The lab's commit and whether `dobb/` or `bench/` differ from it (None outside git)."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        return {
            "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--", "dobb", "bench")),
        }
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def _record_code(out: Path) -> None:
    """Append this start of the run to `out/code.json`: the code that trained it."""
    path = out / "code.json"
    starts = json.loads(path.read_text()) if path.exists() else []
    starts.append(code_version() | {"started": datetime.now(UTC).isoformat(timespec="seconds")})
    path.write_text(json.dumps(starts, indent=1))


def _run_unlocked(cfg: TrainConfig, out: Path) -> dict[str, Any]:
    marker = out / "diverged.json"
    if marker.exists():
        old = json.loads(marker.read_text())
        new = compare.settings_record(cfg)
        if compare.comparable_config(old) != compare.comparable_config(new):
            raise FileExistsError(f"{out} holds a diverged run with a different config")
        return old["summary"]
    if not (out / "summary.json").exists():
        _record_code(out)
    try:
        return compare.run(cfg, log=partial(print, flush=True))
    except FloatingPointError as e:  # NonFiniteGradientError from a matrix optimizer
        summary = {"optimizer": cfg.optimizer, "lr": cfg.lr, "final_val_loss": math.nan}
        summary["diverged"] = str(e).splitlines()[0]
        marker.write_text(json.dumps(compare.settings_record(cfg) | {"summary": summary}, indent=1))
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        print(f"{out.name}: diverged ({summary['diverged']})", flush=True)
        return summary


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent terminates workers


class Runner:
    """Runs configs `workers` at a time in spawned processes, `threads` torch threads each.

    One worker (or nothing left to train) runs in this process. `new_runs` counts the runs
    that had not finished before (the resumability check of the tests). On an error or
    Ctrl-C the workers are terminated; their runs resume from checkpoints next time.
    """

    def __init__(self, workers: int = 1, threads: int = 1):
        self.workers, self.threads, self.new_runs = workers, threads, 0
        self._pool = None

    def __call__(self, configs: Sequence[TrainConfig]) -> list[dict[str, Any]]:
        todo = sum(not is_done(c) for c in configs)
        self.new_runs += todo
        if self.workers == 1 or todo == 0:
            threads = torch.get_num_threads()
            torch.set_num_threads(self.threads)
            try:
                return [run_one(c) for c in configs]
            finally:
                torch.set_num_threads(threads)
        if self._pool is None:  # spawn: `fork` hangs once the parent used OpenMP threads
            self._pool = get_context("spawn").Pool(self.workers, _init_worker, (self.threads,))
        return self._pool.map(run_one, configs, chunksize=1)

    def __enter__(self) -> "Runner":
        # `kill` (SIGTERM) exits through __exit__ like Ctrl-C, so no worker outlives the study
        self._sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self

    def __exit__(self, error, *_) -> None:
        signal.signal(signal.SIGTERM, self._sigterm)
        if self._pool is not None:
            self._pool.close() if error is None else self._pool.terminate()
            self._pool.join()


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


# ---- learning-rate sweeps --------------------------------------------------------------


def round_lr(lr: float) -> float:
    """4 significant digits: the precision of run names, so a name maps to one lr."""
    return float(f"{lr:.4g}")


def edge_extension(runs: Sequence[dict[str, Any]]) -> float | None:
    """The next lr to try if the best run sits at an edge of the grid, else None.

    One more point beyond that edge, at the spacing of the two outermost points there.
    """
    runs = sorted(runs, key=lambda s: s["lr"])
    losses = [loss_of(s) for s in runs]
    if len(runs) < 2 or not math.isfinite(min(losses)):
        return None
    best = losses.index(min(losses))
    if best == 0:
        return runs[0]["lr"] ** 2 / runs[1]["lr"]
    if best == len(runs) - 1:
        return runs[-1]["lr"] ** 2 / runs[-2]["lr"]
    return None


def at_edge(runs: Sequence[dict[str, Any]]) -> bool:
    """True if the best of these runs has the lowest or the highest lr (and there are >1)."""
    return edge_extension(runs) is not None


def best_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return min(runs, key=loss_of)


@dataclass
class Sweep:
    """An lr sweep: `make(lr)` builds a run's config; the grid grows at an edge.

    `unit`: the grid is in units of another parametrization of the same update: each point
    `lr` trains `make(lr * unit)` and reads back as `lr` (its summary's `run_lr` keeps the
    lr it trained with). (f)'s width rule is read so (`bench.study.tuning.Tuned.width_rule`).
    """

    make: Callable[[float], TrainConfig]
    grid: Sequence[float]
    max_extensions: int = 0
    unit: float = 1.0

    def read(self, lr: float, summary: dict[str, Any]) -> dict[str, Any]:
        """`summary` of the run made for grid point `lr`, in the grid's units."""
        return summary if self.unit == 1.0 else summary | {"lr": lr, "run_lr": summary["lr"]}


def tune(
    runner: Callable[[list[TrainConfig]], list[dict]], sweeps: dict[Hashable, Sweep]
) -> dict[Hashable, list[dict[str, Any]]]:
    """Run every sweep's grid together, then extend each at its best edge while allowed.

    Each round hands all pending runs to `runner` at once (widest model first, so the
    longest runs start first), so sweeps run side by side. Returns each sweep's summaries
    sorted by lr.
    """
    results: dict[Hashable, list[dict]] = {key: [] for key in sweeps}
    extensions = dict.fromkeys(sweeps, 0)
    pending = [(k, lr) for k, s in sweeps.items() for lr in sorted({round_lr(x) for x in s.grid})]
    while pending:
        configs = [sweeps[k].make(round_lr(lr * sweeps[k].unit)) for k, lr in pending]
        unique = {c.out_dir: c for c in configs}  # two sweeps may share a run
        order = sorted(unique.values(), key=width_of, reverse=True)
        done = dict(zip((c.out_dir for c in order), runner(order)))
        for (key, lr), cfg in zip(pending, configs):
            results[key].append(sweeps[key].read(lr, done[cfg.out_dir]))
        pending = []
        for key, sweep in sweeps.items():
            if extensions[key] < sweep.max_extensions:
                lr = edge_extension(results[key])
                if lr is not None:
                    extensions[key] += 1
                    pending.append((key, round_lr(lr)))
    return {key: sorted(runs, key=lambda s: s["lr"]) for key, runs in results.items()}


# ---- the study ------------------------------------------------------------------------


@dataclass(frozen=True)
class Ablation:
    """One change to an optimizer's options of (a), compared with it at its tuned lr."""

    option: str
    value: Any
    sweep: bool = False  # its best lr moves: a small sweep around `lr_center`
    note: str = ""
    optimizer: str = "dobb_paper"
    seeds: int = 1  # > 1: also run seeds 1.. at `lr_center`, set against the optimizer's seeds


def ablations(width: int) -> list[Ablation]:
    """The ablations of (b) and (d) for a model of width `width`."""
    # MuonBP's period: the share of full steps moves the best lr, so every period is swept
    period = partial(Ablation, "period", sweep=True, optimizer="muonbp")
    return [
        Ablation("num_blocks", 1, sweep=True),
        Ablation("num_blocks", 4, sweep=True),
        Ablation("num_blocks", 64, sweep=True),
        Ablation("num_blocks", one_column_blocks(width), sweep=True, note="block size 1: Signum"),
        Ablation("basis_interval", 1),
        Ablation("basis_interval", 100),
        Ablation("basis_method", "power_qr"),
        Ablation("basis_method", "jacobi", seeds=4, note="batched solver, the CUDA default"),
        Ablation("basis_method", "cholqr", seeds=4, note="batched orthogonal iteration"),
        Ablation("projection_dtype", "bfloat16", note="bf16 rotations; the solver stays fp32"),
        Ablation("stats_sync", "step", note="one process: same math, a check"),
        Ablation("basis_source", "identity", note="Signum"),
        Ablation("basis_source", "random"),
        Ablation("basis_source", "gradients"),
        Ablation("update_scale", "muon", sweep=True, note="lr centred on Muon's tuned lr"),
        Ablation("update_scale", 1.0, sweep=True, note="Lion-like"),
        Ablation("ns_coefficients", "polar_express", optimizer="muon"),
        Ablation("ns_coefficients", "quintic", optimizer="nordion2"),
        period(1, note="a full step every update: Muon, MuonBP's lr scaling"),
        period(2),
        period(20),
        period(None, note="block steps only: BlockMuon"),
    ]


def one_column_blocks(width: int) -> int:
    """The num_blocks that leaves one column per block in every hidden matrix of a GPT of
    width `width` (Dobb is then Signum): the widest input is the MLP's, 4 x width."""
    return 4 * width


def is_one_column(row: dict[str, Any], width: int) -> bool:
    """Whether an ablation row (option, value) is Dobb with blocks of one column."""
    return row["option"] == "num_blocks" and row["value"] == one_column_blocks(width)


def defaults(name: str) -> dict[str, Any]:
    """The options of optimizer `name` in (a): class defaults, registry, `OPTIONS`."""
    entry = get_entry(name)
    params = inspect.signature(entry.cls).parameters.values()
    options = {p.name: p.default for p in params if p.default is not p.empty}
    return options | entry.hyperparameters | OPTIONS[name]


def lr_center(ablation: Ablation, best: dict[str, float]) -> float:
    """The lr an ablation is run at (its sweep's centre).

    update_scale sets the update RMS to `alpha lr`: a number keeps Dobb's tuned `alpha lr`
    (lr = best x 0.2 / alpha); "muon" is meant to take Muon's lr, so it starts from Muon's
    tuned lr. Everything else starts at its optimizer's tuned lr.
    """
    if ablation.option == "update_scale":
        if ablation.value == "muon":
            return best["muon"]
        return best["dobb_paper"] * base_alpha() / ablation.value
    return best[ablation.optimizer]


def base_alpha() -> float:
    """Dobb's default update scale alpha (0.2, the "adamw" setting) as a number."""
    options = defaults("dobb_paper")
    return update_alpha(update_scale_of(options["update_scale"], options["coefficients"]), 1)


def run_study(spec: StudySpec, base: TrainConfig, out: Path, runner, log=print) -> dict:
    """Every run of (a), (b) and (c); returns their summaries, grouped."""
    make = partial(run_config, base, out)
    sweeps = {
        name: Sweep(
            partial(make, name),
            [lab_entry(name).start_lr * f for f in spec.lr_factors],
            spec.max_extensions,
        )
        for name in STUDIED
    }
    log(f"(a) lr sweeps: {sum(len(s.grid) for s in sweeps.values())} runs + extensions")
    main = tune(runner, sweeps)
    best = {name: best_run(runs)["lr"] for name, runs in main.items()}

    width = width_of(base)
    later: dict[Hashable, Sweep] = {}
    for name in STUDIED:
        for seed in range(1, spec.seeds):
            later[("seed", name, seed)] = Sweep(partial(make, name, seed=seed), [best[name]])
    for i, ab in enumerate(ablations(width)):
        center = lr_center(ab, best)
        grid = [center * f for f in spec.ablation_lr_factors] if ab.sweep else [center]
        extend = spec.ablation_max_extensions if ab.sweep else 0
        later[("ablation", i)] = Sweep(
            partial(make, ab.optimizer, options={ab.option: ab.value}), grid, extend
        )
        for seed in range(1, ab.seeds):
            run = partial(make, ab.optimizer, options={ab.option: ab.value}, seed=seed)
            later[("ablation", i, seed)] = Sweep(run, [center])
    for w in spec.widths:
        for name in WIDTH_PAIR:
            if w != width:
                grid = [best[name] * f for f in spec.ablation_lr_factors]
                sweep = Sweep(partial(make, name, width=w), grid, spec.ablation_max_extensions)
                later[("width", name, w)] = sweep
    log(f"(a) seeds, (b) ablations, (c) widths: {sum(len(s.grid) for s in later.values())} runs")
    done = tune(runner, later)
    return {
        "main": main,
        "best_lr": best,
        "seeds": {
            n: [best_run(main[n])] + [done[("seed", n, s)][0] for s in range(1, spec.seeds)]
            for n in STUDIED
        },
        "ablations": [(ab, done[("ablation", i)]) for i, ab in enumerate(ablations(width))],
        "ablation_seeds": {
            i: [best_run(done[("ablation", i)])]
            + [done[("ablation", i, s)][0] for s in range(1, ab.seeds)]
            for i, ab in enumerate(ablations(width))
            if ab.seeds > 1
        },
        "widths": {
            (name, w): done[("width", name, w)] if w != width else main[name]
            for w in spec.widths
            for name in WIDTH_PAIR
        },
        "width": width,
    }
