"""The training of ``bench.timebudget``: each optimizer trains a fresh GPT for the same
budget of training time, the learning rate on the budget's clock (the loop, the schedule and
the record are described in ``bench.timebudget``)."""

import math
import statistics
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

import torch

from bench.compare import OPTIONS
from bench.results.calltime import device_name, write_json
from bench.tools.timing import synchronize
from dobb.registry import build_optimizer, get_entry
from dobb.train.data import TokenStream
from dobb.train.model import GPT, gpt_config

NAMES = ("dobb", "dion", "muon", "blockmuon", "adamw")
CURVE_POINTS = 200  # train-loss curve: at most this many (time, step, loss) rows
Progress = Callable[[str], None]


def lr_factor(fraction: float, warmup_frac: float, min_lr_ratio: float) -> float:
    """The schedule's multiplier at ``fraction`` (in [0, 1]) of the budget: linear warmup,
    then cosine down to ``min_lr_ratio`` (the formula: ``bench.timebudget``)."""
    if fraction < warmup_frac:
        return fraction / warmup_frac
    decay = min(1.0, (fraction - warmup_frac) / (1.0 - warmup_frac))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * decay))


def ms_spread(seconds: list[float]) -> dict[str, float]:
    """Mean and median of ``seconds``, in milliseconds."""
    if not seconds:
        return {"mean": math.nan, "median": math.nan}
    return {"mean": 1e3 * statistics.fmean(seconds), "median": 1e3 * statistics.median(seconds)}


@torch.no_grad()
def evaluate(model: GPT, stream: TokenStream, batches: int, batch_size: int, context) -> float:
    """Mean loss over validation batches ``0 .. batches - 1`` (the same for every run)."""
    model.eval()
    device = next(model.parameters()).device
    losses = []
    for i in range(batches):
        x, y = stream.get_batch("val", i, batch_size, model.cfg.block_size)
        with context():
            _, loss = model(x.to(device), y.to(device))
        losses.append(loss.float())
    model.train()
    return torch.stack(losses).mean().item()


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
    on_point: Callable[[dict], None] = lambda _: None,
    progress: Progress = lambda _: None,
) -> dict:
    """Train a fresh ``GPT(cfg)`` with optimizer ``name`` for ``budget_s`` seconds of
    training time (``bench.timebudget``); returns its record (``on_point`` gets it
    after each eval)."""
    started = time.perf_counter()
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    model.train()
    optimizer = build_optimizer(name, model, lr, **options)
    base_lrs = [group["lr"] for group in optimizer.param_groups]

    def context():
        return torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext()

    record = {
        "lr": base_lrs[0],
        "group_lrs": base_lrs,
        "options": options,
        "points": [],
        "curve": [],
        "steps": 0,
        "diverged": False,
    }
    eval_at = [budget_s * (i + 1) / evals for i in range(evals)]
    train_s, eval_s, step = 0.0, 0.0, 0
    losses, since_point, fwd_bwd, opt_calls = [], [], [], []
    while train_s < budget_s and not record["diverged"]:
        factor = lr_factor(train_s / budget_s, warmup_frac, min_lr_ratio)
        for group, lr0 in zip(optimizer.param_groups, base_lrs, strict=True):
            group["lr"] = lr0 * factor
        synchronize(device)
        t0 = time.perf_counter()
        x, y = stream.get_batch("train", step, batch_size, cfg.block_size, seed=seed)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with context():
            _, loss = model(x, y)
        loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        synchronize(device)
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        t2 = time.perf_counter()
        train_s += t2 - t0
        fwd_bwd.append(t1 - t0)
        opt_calls.append(t2 - t1)
        step += 1
        value = loss.item()
        losses.append((train_s, step, value))
        since_point.append(value)
        if not math.isfinite(value):
            record["diverged"] = True
            eval_at = eval_at[:1]  # one evaluation of where it stopped
            progress(f"{name}: loss {value} at step {step}: stopped")
        if eval_at and (train_s >= eval_at[0] or record["diverged"]):
            eval_at = [t for t in eval_at if t > train_s]  # a long step may pass several
            e0 = time.perf_counter()
            val = evaluate(model, stream, eval_batches, batch_size, context)
            eval_s += time.perf_counter() - e0
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
                wall_s=time.perf_counter() - started,
            )
            on_point(record)
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def warm_up(cfg, device: torch.device, batch_size: int, autocast: bool) -> None:
    """One untimed forward+backward, so that the first run does not pay the device's
    start-up (context, library handles, kernel selection)."""
    model = GPT(cfg).to(device)
    x = torch.zeros(batch_size, cfg.block_size, dtype=torch.long, device=device)
    context = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else nullcontext()
    with context:
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
    progress: Progress = lambda _: None,
) -> dict:
    """Train ``config`` with each of ``names`` for ``budget_s`` s; return (and write) the
    record. ``data``: a folder with ``train.bin`` and ``val.bin`` (``timebudget_data.prepare``);
    ``matmul_precision``: ``torch.set_float32_matmul_precision`` for the run ("high": TF32
    for the fp32 products, e.g. the optimizers' own)."""
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
    options = {name: dict(OPTIONS.get(name, {})) for name in names}
    if basis_method is not None and "dobb" in options:
        options["dobb"]["basis_method"] = basis_method
    record = {
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
