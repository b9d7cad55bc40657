"""The training of ``bench.timebudget``: each optimizer trains a fresh GPT for the same
budget of training time, the learning rate on the budget's clock (the loop, the schedule and
the record are described in ``bench.timebudget``).

The step is the harness's (``dobb.train.trainer.train_step``: forward and backward, clipping,
a timed ``opt.step()``), the schedule its ``lr_multiplier`` driven by the budget's clock
through a ``LambdaLR``, as the harness drives it by steps, and the evaluation its
``evaluate``; the forward passes run under bf16 autocast (``Autocast``). What is
timebudget's own: the loop on the clock, the evaluation points and the record. The
optimizers are the lab's time-budget table (``bench.optimizers.in_table``).
"""

import math
import statistics
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from bench.optimizers import in_table, lab_entry
from bench.results.calltime import device_name, write_json
from bench.tools.records import LAB_NAMES
from bench.tools.timing import synchronize
from dobb.registry import build_optimizer, get_entry
from dobb.train.config import TrainConfig
from dobb.train.data import TokenStream
from dobb.train.model import GPT, gpt_config
from dobb.train.parallel import Parallelism
from dobb.train.trainer import evaluate, lr_multiplier, train_step

NAMES = in_table("timebudget")
CURVE_POINTS = 200  # train-loss curve: at most this many (time, step, loss) rows
ONE_PROCESS = Parallelism("single", None, None)  # the harness's pieces on one device
Progress = Callable[[str], None]


def lr_factor(fraction: float, warmup_frac: float, min_lr_ratio: float) -> float:
    """The harness's schedule (``lr_multiplier``) at ``fraction`` (in [0, 1]) of the budget:
    linear warmup over its first ``warmup_frac``, then cosine down to ``min_lr_ratio`` (the
    formula: ``bench.timebudget``)."""
    warmed = fraction / warmup_frac if fraction < warmup_frac else 1.0
    decayed = (fraction - warmup_frac) / (1.0 - warmup_frac)
    return lr_multiplier(warmed, decayed, "cosine", min_lr_ratio)


def ms_spread(seconds: list[float]) -> dict[str, float]:
    """Mean and median of ``seconds``, in milliseconds."""
    if not seconds:
        return {"mean": math.nan, "median": math.nan}
    return {"mean": 1e3 * statistics.fmean(seconds), "median": 1e3 * statistics.median(seconds)}


class Autocast(nn.Module):
    """``model`` whose forward runs under bf16 autocast where ``enabled``; the harness's step
    backpropagates, clips and steps outside it."""

    def __init__(self, model: nn.Module, enabled: bool):
        super().__init__()
        self.model, self.enabled = model, enabled

    def forward(self, *args):
        device = next(self.model.parameters()).device
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.enabled):
            return self.model(*args)


def train_for(
    name: str,
    stream: TokenStream,
    cfg,
    *,
    budget_s: float,
    device: torch.device,
    batch_size: int,
    evals: int,
    eval_batches: int,
    lr: float | None,
    options: dict,
    warmup_frac: float,
    min_lr_ratio: float,
    grad_clip: float,
    autocast: bool,
    seed: int,
    clock: Callable[[], float] = time.perf_counter,
    on_point: Callable[[dict], None] = lambda _: None,
    progress: Progress = lambda _: None,
) -> dict:
    """Train a fresh ``GPT(cfg)`` with optimizer ``name`` for ``budget_s`` seconds of
    training time on ``clock`` (``bench.timebudget``); returns its record (``on_point``
    gets it after each eval)."""
    started = clock()
    torch.manual_seed(seed)
    gpt = GPT(cfg).to(device)
    model = Autocast(gpt, autocast)
    model.train()
    optimizer = build_optimizer(name, gpt, lr, **options)
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    # the harness's step and evaluation, configured as this run: one micro-batch per step
    run = TrainConfig(
        batch_size=batch_size, grad_clip=grad_clip or None, eval_batches=eval_batches, seed=seed
    )
    train_s = 0.0  # the budget's clock: the schedule reads it after every step

    def on_the_clock(_: int) -> float:  # LambdaLR's step count: not what this schedule reads
        return lr_factor(train_s / budget_s, warmup_frac, min_lr_ratio)

    scheduler = LambdaLR(optimizer, on_the_clock)
    record = {
        "lr": base_lrs[0],
        "group_lrs": base_lrs,
        "options": get_entry(name).settings(options)["options"],  # beyond the class's defaults
        "points": [],
        "curve": [],
        "steps": 0,
        "diverged": False,
    }
    eval_at = [budget_s * (i + 1) / evals for i in range(evals)]
    eval_s, step = 0.0, 0
    losses, since_point, fwd_bwd, opt_calls = [], [], [], []
    while train_s < budget_s and not record["diverged"]:
        synchronize(device)
        t0 = clock()
        x, y = stream.get_batch("train", step, batch_size, cfg.block_size, seed=seed)
        done = train_step(model, optimizer, x, y, run, device)  # ends on the loss's host read
        t1 = clock()
        train_s += t1 - t0
        scheduler.step()
        fwd_bwd.append(t1 - t0 - done["opt_ms"] / 1e3)  # data, forward, backward, clipping
        opt_calls.append(done["opt_ms"] / 1e3)
        step += 1
        value = done["loss"]
        losses.append((train_s, step, value))
        since_point.append(value)
        if not math.isfinite(value):
            record["diverged"] = True
            eval_at = eval_at[:1]  # one evaluation of where it stopped
            progress(f"{name}: loss {value} at step {step}: stopped")
        if eval_at and (train_s >= eval_at[0] or record["diverged"]):
            eval_at = [t for t in eval_at if t > train_s]  # a long step may pass several
            e0 = clock()
            val = evaluate(model, stream, run, cfg.block_size, ONE_PROCESS, device)
            eval_s += clock() - e0
            point = {
                "time_s": train_s,
                "step": step,
                "train_loss": statistics.fmean(since_point),
                "val_loss": val,
            }
            record["points"].append(point)
            since_point = []
            progress(
                f"{name}: {train_s:6.1f} s, step {step}, train {point['train_loss']:.4f}, "
                f"val {val:.4f}"
            )
            stride = max(1, len(losses) // CURVE_POINTS)
            record.update(
                steps=step,
                train_s=train_s,
                eval_s=eval_s,
                tokens_per_s=step * batch_size * cfg.block_size / train_s,
                opt_ms=ms_spread(opt_calls),
                fwd_bwd_ms=ms_spread(fwd_bwd),
                curve=losses[stride - 1 :: stride],
                wall_s=clock() - started,
            )
            on_point(record)
    del model, gpt, optimizer, scheduler
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def warm_up(cfg, device: torch.device, batch_size: int, autocast: bool) -> None:
    """One untimed forward+backward, so that the first run does not pay the device's
    start-up (context, library handles, kernel selection)."""
    model = Autocast(GPT(cfg).to(device), autocast)
    x = torch.zeros(batch_size, cfg.block_size, dtype=torch.long, device=device)
    _, loss = model(x, x)
    loss.backward()
    synchronize(device)


def run(
    data: Path,
    names: tuple[str, ...] = NAMES,
    *,
    config: str = "gpt2",
    budget_s: float = 45.0,
    device: str = "cuda",
    batch_size: int = 16,
    block_size: int | None = None,
    evals: int = 4,
    eval_batches: int = 8,
    lrs: dict[str, float] | None = None,
    basis_method: str | None = None,
    warmup_frac: float = 0.05,
    min_lr_ratio: float = 0.1,
    grad_clip: float = 1.0,
    autocast: bool = True,
    matmul_precision: str = "highest",
    seed: int = 0,
    out: Path | None = None,
    command: str | None = None,
    clock: Callable[[], float] = time.perf_counter,
    progress: Progress = lambda _: None,
) -> dict:
    """Train ``config`` with each of ``names`` for ``budget_s`` s; return (and write) the
    record. ``data``: a folder with ``train.bin`` and ``val.bin`` (``timebudget_data.prepare``);
    ``matmul_precision``: ``torch.set_float32_matmul_precision`` for the run ("high": TF32
    for the fp32 products, e.g. the optimizers' own); ``clock``: the training time's."""
    lrs = lrs or {}
    for name in (*names, *lrs):
        get_entry(name)  # ValueError naming the known optimizers
    if budget_s <= 0 or evals < 1 or eval_batches < 1 or batch_size < 1:
        raise ValueError("budget_s must be > 0 and evals, eval_batches, batch_size >= 1")
    if not 0 <= warmup_frac < 1 or not 0 <= min_lr_ratio <= 1:
        raise ValueError("warmup_frac must be in [0, 1) and min_lr_ratio in [0, 1]")
    data = Path(data)
    if not (data / "train.bin").is_file() or not (data / "val.bin").is_file():
        raise FileNotFoundError(
            f"{data} needs train.bin and val.bin: create them with "
            f"`python -m bench.timebudget prepare --out {data}`"
        )
    stream = TokenStream.load(data / "train.bin", val_spec=data / "val.bin")
    overrides = {} if block_size is None else {"block_size": block_size}
    cfg = gpt_config(config, vocab_size=stream.vocab_size, **overrides)
    device_ = torch.device(device)
    with torch.device("meta"):
        params = GPT(cfg).num_params()
    options = {name: dict(lab_entry(name).harness_options) for name in names}
    for name in options if basis_method is not None else ():
        if get_entry(name).needs_statistics:  # every Dobb entry takes the solver given
            options[name]["basis_method"] = basis_method
    record = {
        "lab_names": LAB_NAMES,  # the record names optimizers as the lab's table does today
        "meta": {
            "command": command,
            "config": config,
            "params": params,
            "batch_size": batch_size,
            "block_size": cfg.block_size,
            "tokens_per_step": batch_size * cfg.block_size,
            "budget_s": budget_s,
            "evals": evals,
            "eval_batches": eval_batches,
            "schedule": {"warmup_frac": warmup_frac, "min_lr_ratio": min_lr_ratio},
            "grad_clip": grad_clip,
            "autocast": "bf16" if autocast else "none",
            "matmul_precision": matmul_precision,
            "seed": seed,
            "data": {
                "path": str(data),
                "train_tokens": len(stream.splits["train"]),
                "val_tokens": len(stream.splits["val"]),
            },
            "device": device,
            "device_name": device_name(device_),
            "torch": torch.__version__,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "complete": False,
        },
        "optimizers": {},
    }

    def save(name: str, entry: dict) -> None:
        record["optimizers"][name] = entry
        if out is not None:
            write_json(out, record)

    def train_or_report(name: str) -> dict:
        """``train_for``'s record, or what it saved with the error that stopped it: one
        optimizer's failure must not cost the others their runs (traceback in the log)."""
        try:
            return train_for(
                name,
                stream,
                cfg,
                budget_s=budget_s,
                device=device_,
                batch_size=batch_size,
                evals=evals,
                eval_batches=eval_batches,
                lr=lrs.get(name),
                options=options[name],
                warmup_frac=warmup_frac,
                min_lr_ratio=min_lr_ratio,
                grad_clip=grad_clip,
                autocast=autocast,
                seed=seed,
                clock=clock,
                on_point=lambda entry: save(name, entry),
                progress=progress,
            )
        except Exception as error:
            traceback.print_exc()
            progress(f"{name}: FAILED ({type(error).__name__}); going on with the others")
            message = f"{type(error).__name__}: {error}"
            return {**record["optimizers"].get(name, {}), "error": message}

    progress(f"{config}: {record['meta']['params'] / 1e6:.1f}M parameters, {device_name(device_)}")
    previous_precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(matmul_precision)
    try:
        warm_up(cfg, device_, batch_size, autocast)
        for name in names:
            save(name, train_or_report(name))
    finally:
        torch.set_float32_matmul_precision(previous_precision)
    record["meta"]["complete"] = True
    if out is not None:
        write_json(out, record)
    return record
