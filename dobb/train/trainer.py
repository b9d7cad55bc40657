"""The training loop: `train(cfg) -> summary`, one process or every rank of a `torchrun` job.

Top to bottom: join the job, decide where to start (a fresh `out_dir`, or the newest
intact checkpoint of the run in it), load data, build the model and apply the layout
(DDP, FSDP2, TP, HSDP, FSDP x TP), build the optimizer by registry name with a warmup +
decay schedule, resume, then loop: micro-batches, backward, optional clipping, a timed
`opt.step()`, periodic validation (of the weights' EMA too, with `eval_ema`) and
checkpoints. A run never replaces another (`dobb.train.lock`, `dobb.train.resume`); errors
the user can fix are a one-line `RunError`. The run's files and their fields, and the
resume rule: `docs/harness.md`.
"""

import math
import os
import platform
import random
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm

from dobb._dtensor import DTensor
from dobb.optim.scalar import SCALAR_ALGORITHMS
from dobb.registry import build_optimizer, get_entry
from dobb.train.checkpoint import (
    load_checkpoint,
    read_metadata,
    save_checkpoint,
)
from dobb.train.config import ConfigError, TrainConfig
from dobb.train.data import TokenStream
from dobb.train.ema import WeightEMA
from dobb.train.errors import RunError, RunWarning
from dobb.train.lock import OutDirLock
from dobb.train.model import EXPERT_WEIGHTS, GPT, gpt_config
from dobb.train.parallel import Parallelism, init_distributed, parallelize
from dobb.train.resume import RUN_FILES, apply_resumed_settings, earlier_corpus, start_point
from dobb.train.runlog import RunLog


def lr_multiplier(warmed: float, decayed: float, decay: str, min_lr_ratio: float) -> float:
    """The schedule's lr multiplier by how much of the run is done, whatever counts it
    (`lr_schedule`: steps; the lab's time-budget runs: the clock).

    1. warmup, while `warmed` (the share of the warmup done) is below 1: `warmed` itself,
       a linear rise;
    2. decay, `decayed` (the share of the decay done, clipped to [0, 1]) of the way from 1
       down to `min_lr_ratio`, along a half cosine or a line; or 1 ("constant").
    """
    if warmed < 1:
        return warmed
    if decay == "constant":
        return 1.0
    progress = min(1.0, max(0.0, decayed))
    if decay == "cosine":
        progress = 0.5 * (1.0 - math.cos(math.pi * progress))
    return 1.0 - (1.0 - min_lr_ratio) * progress


def lr_schedule(cfg: TrainConfig) -> Callable[[int], float]:
    """The lr multiplier of step `s` (0-based; LambdaLR's count of steps taken so far):
    `lr_multiplier` with (s + 1) / warmup_steps of the warmup done, then the decay done by
    its last step (s = steps - 1)."""

    def multiplier(s: int) -> float:
        warmed = (s + 1) / cfg.warmup_steps if s < cfg.warmup_steps else 1.0
        decayed = (s - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps)
        return lr_multiplier(warmed, decayed, cfg.decay, cfg.min_lr_ratio)

    return multiplier


def distributed_options(name: str, parallelism: Parallelism) -> dict[str, Any]:
    """Constructor arguments telling optimizer `name` how the model is distributed.

    DTensor parameters carry their own meshes; what no placement shows is which ranks see
    different tokens. The harness's DDP and FSDP average the gradients over them, and the
    optimizer's registry entry says which argument takes them, if any
    (`OptimizerEntry.distributed_options`; the meanings are in `dobb.distributed.groups`).
    """
    return get_entry(name).distributed_options(parallelism.data_parallel)


@cache
def load_data(spec: str, val_spec, val_fraction, tokenizer, cache_dir) -> TokenStream:
    """`TokenStream.load`, cached per process (compare runs and tests load the corpus once)."""
    return TokenStream.load(spec, val_fraction, val_spec, tokenizer, cache_dir)


def _on_rank0(decide: Callable[[], Any]) -> Any:
    """`decide()` on rank 0 only, its result (or its RunError) shared with every rank."""
    outcome = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            outcome = [(True, decide())]
        except RunError as e:
            outcome = [(False, e)]
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0)
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def check_data_length(data: TokenStream, data_spec: str, block_size: int) -> None:
    """RunError unless both splits hold more than `block_size` tokens (one window + target)."""
    for split, tokens in data.splits.items():
        if len(tokens) <= block_size:
            raise RunError(
                f"data {data_spec!r}: its {split} split has {len(tokens)} tokens, a batch needs "
                f"more than block_size={block_size}; give more data, a smaller block_size"
                + (" or a larger val_fraction" if split == "val" else "")
            )


def optimizer_state_bytes_per_param(opt: torch.optim.Optimizer, num_params: int) -> float:
    """Bytes of optimizer state per model parameter, counted by *global* (logical) size.

    A DTensor counts by its global shape, so replicated state counts once and sharded
    state counts whole: the number equals the single-process one under every layout.
    Transient buffers that are not in `opt.state` (Dobb's per-step activation sums) are
    not counted.
    """
    total = sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    return total / num_params


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _mean_over_ranks(value: torch.Tensor) -> float:
    """Average a scalar over all ranks. Ranks of one TP group hold equal values, so this is
    the average over the data-parallel ranks."""
    if dist.is_initialized():
        value = value.detach().clone()
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


def _set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient reduction on all but the last micro-batch (DDP, FSDP2)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model.require_backward_grad_sync = enabled
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model, data, cfg, block_size, par, device) -> float:
    """Mean loss over the fixed validation batches 0 .. eval_batches-1, over all DP ranks."""
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(cfg.eval_batches):
        x, y = data.get_batch("val", i, cfg.batch_size, block_size, *_rows(par), cfg.seed)
        for xm, ym in zip(x.chunk(cfg.grad_accum), y.chunk(cfg.grad_accum)):
            total += model(xm.to(device), ym.to(device))[1].float() / cfg.grad_accum
    model.train()
    return _mean_over_ranks(total / cfg.eval_batches)


def validate(model, ema: WeightEMA | None, data, cfg, block_size, par, device) -> dict:
    """`{"val_loss": ...}` of the live weights; with `ema`, of the EMA weights, and the
    live weights' as "val_loss_live"."""
    if ema is None:
        return {"val_loss": evaluate(model, data, cfg, block_size, par, device)}
    live = evaluate(model, data, cfg, block_size, par, device)
    with ema.swapped_in(model):
        averaged = evaluate(model, data, cfg, block_size, par, device)
    return {"val_loss": averaged, "val_loss_live": live}


def _rows(par: Parallelism) -> tuple[int, int]:
    return par.dp_rank, par.dp_size


def run_info(cfg: TrainConfig, data: TokenStream, world_size: int, num_params: int) -> dict:
    """What ran, where, on what: the head of every run log."""
    return {
        "config": cfg.to_dict(),
        "optimizer_settings": get_entry(cfg.optimizer).settings(cfg.optimizer_options),
        "corpus": asdict(data.corpus),
        "num_params": num_params,
        "world_size": world_size,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "command": sys.argv,
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm to `max_norm`; return the norm before clipping.

    `clip_grad_norm_` handles DTensor gradients on one mesh (FSDP2, TP); parameters on
    different meshes (FSDP x TP: 2-D weights, 1-D embeddings) or mixed with plain tensors
    (TP: replicated norms) have their norms made global (`full_tensor`) one by one first.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    meshes = {p.grad.device_mesh if isinstance(p.grad, DTensor) else None for p in params}
    if len(meshes) == 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
    norms = [torch.linalg.vector_norm(p.grad) for p in params]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms))
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(scale.item())
    return total.item()


def build_model(cfg: TrainConfig, vocab_size: int, device) -> tuple[nn.Module, Parallelism]:
    """The GPT of `cfg` (vocab from the data) on `device`, with `cfg.layout` applied.

    `ConfigError` for a model config that does not build (naming `model_overrides`); a
    layout that does not fit raises `ValueError`."""
    overrides = dict(cfg.model_overrides, vocab_size=vocab_size)
    if cfg.block_size is not None:
        overrides["block_size"] = cfg.block_size
    try:
        model = GPT(gpt_config(cfg.model, **overrides)).to(device)
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"model={cfg.model!r} with model_overrides={cfg.model_overrides}: {e}; "
            "fix model_overrides (GPTConfig's fields in dobb.train.model)"
        ) from None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if cfg.layout == "tp" and dist.is_initialized() and cfg.tensor_parallel != world:
        raise ValueError(
            f"layout 'tp' puts all WORLD_SIZE={world} ranks on its tensor axis, but "
            f"tensor_parallel={cfg.tensor_parallel}; set tensor_parallel={world}, or use "
            "layout=fsdp_tp to combine TP with FSDP"
        )
    model, par = parallelize(model, cfg.layout, cfg.tensor_parallel)
    if cfg.batch_size % (cfg.grad_accum * par.dp_size):
        raise ValueError(
            f"batch_size={cfg.batch_size} must be divisible by grad_accum ({cfg.grad_accum}) "
            f"x data-parallel ranks ({par.dp_size})"
        )
    return model, par


def train_step(model, opt, x, y, cfg: TrainConfig, device) -> dict[str, Any]:
    """Forward/backward over the micro-batches of (x, y), clip, and a timed `opt.step()`."""
    loss = torch.zeros((), device=device)
    for i, (xm, ym) in enumerate(zip(x.chunk(cfg.grad_accum), y.chunk(cfg.grad_accum))):
        _set_grad_sync(model, i == cfg.grad_accum - 1)
        micro_loss = model(xm.to(device), ym.to(device))[1] / cfg.grad_accum
        micro_loss.backward()
        loss += micro_loss.detach()
    record = {"lr": opt.param_groups[0]["lr"]}  # the first group: hidden matrices (AdamW: all)
    if len(opt.param_groups) > 1:
        record["scalar_lr"] = opt.param_groups[-1]["lr"]  # embeddings, head, norms, biases
    if cfg.grad_clip is not None:
        record["grad_norm"] = clip_grad_norm(model, cfg.grad_clip)
    skipped = getattr(opt, "skipped_steps", 0)
    _synchronize(device)
    t0 = time.perf_counter()
    opt.step()
    _synchronize(device)
    record["opt_ms"] = 1e3 * (time.perf_counter() - t0)
    if getattr(opt, "skipped_steps", 0) > skipped:  # nonfinite="skip" skipped this step
        record["skipped"] = True
    opt.zero_grad(set_to_none=True)
    record["loss"] = _mean_over_ranks(loss)
    return record


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train as `cfg` says; return the summary (the same dict on every rank)."""
    cfg.validate()
    owns_process_group = not dist.is_initialized()
    device = init_distributed(cfg.timeout)
    locks: list[OutDirLock] = []

    def decide() -> Path | None:  # rank 0: take out_dir, then choose where to start
        locks.append(OutDirLock(cfg.out_dir))
        return start_point(cfg)

    try:
        resumed = _on_rank0(decide)  # before any work: refuse early
        return _train(cfg, device, resumed, owns_process_group)
    finally:
        for lock in locks:
            lock.release(RUN_FILES)


def _load_data(cfg: TrainConfig, resumed: Path | None) -> tuple[TokenStream, dict]:
    """The data, and the metadata of the checkpoint `resumed` (`{}` for a fresh run).

    Seeds first: the same seed on every rank, so every rank builds the same init. RunError
    for data that does not load; ConfigError for a resumed run whose corpus has changed."""
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed)
    random.seed(cfg.seed)
    try:
        data = load_data(cfg.data, cfg.val_data, cfg.val_fraction, cfg.tokenizer, cfg.data_cache)
    except (OSError, ValueError, ModuleNotFoundError) as e:  # data.py's messages name the fix
        raise RunError(str(e)) from e
    if resumed is None:
        return data, {}
    meta = read_metadata(resumed)
    saved_corpus = meta.get("corpus") or earlier_corpus(Path(cfg.out_dir))
    if saved_corpus and saved_corpus.get("sha256") != data.corpus.sha256:
        raise ConfigError(
            f"resume: data {cfg.data!r} has changed since {resumed} was saved (sha256 "
            f"{data.corpus.sha256[:12]}..., was {saved_corpus.get('sha256', '?')[:12]}...); "
            "restore the data the run trained on, or start a new run in another out_dir"
        )
    return data, meta


def _model_for(cfg: TrainConfig, data: TokenStream, device) -> tuple[nn.Module, Parallelism]:
    """`build_model` for `data`'s vocabulary, a layout that does not fit as a ConfigError
    (with the launch hint outside torchrun), and `data` long enough for the model's window."""
    try:
        model, par = build_model(cfg, data.vocab_size, device)
    except ValueError as e:  # a layout that needs torchrun, a world size that does not fit
        if isinstance(e, ConfigError):
            raise
        launch = "" if dist.is_initialized() else "; launch it with torchrun or use layout=single"
        raise ConfigError(f"layout={cfg.layout!r}: {e}{launch}") from e
    check_data_length(data, cfg.data, _block_size(model))
    return model, par


def _block_size(model: nn.Module) -> int:
    """The model's context window (DDP wraps it in `.module`)."""
    return (model.module if hasattr(model, "module") else model).cfg.block_size


def _build_optimizer(cfg: TrainConfig, model: nn.Module, par: Parallelism) -> torch.optim.Optimizer:
    """One registry lookup for every optimizer; ConfigError for an unknown or invalid option."""
    try:
        return build_optimizer(
            cfg.optimizer,
            model,
            cfg.lr,
            scalar_lr=cfg.scalar_lr,
            weight_decay=cfg.weight_decay,
            scalar_weight_decay=cfg.scalar_weight_decay,
            experts=EXPERT_WEIGHTS,  # a mixture of experts' stacks (a dense GPT has none)
            **cfg.optimizer_options,
            **distributed_options(cfg.optimizer, par),
        )
    except (TypeError, ValueError) as e:  # an unknown or invalid constructor option
        raise ConfigError(
            f"optimizer={cfg.optimizer!r} with optimizer_options={cfg.optimizer_options}: {e}; "
            f"the docstring of {_qualname(get_entry(cfg.optimizer).cls)} lists its options"
        ) from e


def _resume(cfg, resumed: Path, meta: dict, model, opt, scheduler, ema, rank: int) -> int:
    """Load the checkpoint `resumed` into the model, optimizer, scheduler and EMA; this
    config's resumable settings win. Returns the step it was saved at (the data position)."""
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    # the EMA of a checkpoint saved without one starts over from the resumed weights
    saved_ema = ema is not None and "ema_updates" in meta
    extra = {"ema": dict(ema.averages)} if saved_ema else None
    meta = load_checkpoint(resumed, model, opt, extra)
    if saved_ema:
        ema.load(extra["ema"], meta["ema_updates"])
    scheduler.load_state_dict(meta["scheduler"])
    apply_resumed_settings(opt, scheduler, fresh, resumed)
    start = meta["step"]
    changed = [k for k, v in cfg.to_dict().items() if meta["config"].get(k, v) != v]
    changed = sorted(set(changed) - {"resume", "progress", "out_dir"})  # a run may move
    if changed and rank == 0:
        warnings.warn(
            f"resuming {resumed} with changed fields {changed}: they take effect from "
            f"step {start + 1}",
            RunWarning,
            3,
        )
    return start


def _save(cfg: TrainConfig, done: int, model, opt, scheduler, data, ema) -> None:
    """The checkpoint of step `done`: model, optimizer, scheduler, config, corpus, EMA."""
    meta = {"scheduler": scheduler.state_dict(), "config": cfg.to_dict()}
    meta["corpus"] = asdict(data.corpus)
    extra = None
    if ema is not None:
        meta["ema_updates"], extra = ema.updates, {"ema": ema.averages}
    checkpoints = Path(cfg.out_dir) / "checkpoints"
    save_checkpoint(checkpoints, done, model, opt, meta, keep=cfg.keep_checkpoints, extra=extra)


def _summary(cfg, record, step_times, opt_ms, tokens_per_step, state_bytes, ema, opt) -> dict:
    """The run's summary, but for its size and place (`_train` adds them). This process's
    first step (allocations, warm-up) is left out of speeds. Its learning rates are the
    peaks the run used (the registry's recommended ones where the config left them unset)."""
    timed = slice(1, None) if len(step_times) > 1 else slice(None)
    peaks = {g.get("algorithm"): g["initial_lr"] for g in reversed(opt.param_groups)}
    scalar = get_entry(cfg.optimizer).is_matrix
    return {
        "optimizer": cfg.optimizer,
        "lr": opt.param_groups[0]["initial_lr"],
        "scalar_lr": next((v for k, v in peaks.items() if k in SCALAR_ALGORITHMS), None)
        if scalar
        else None,
        "steps": cfg.steps,
        "tokens": cfg.steps * tokens_per_step,
        "final_val_loss": record["val_loss"],  # of the EMA weights with eval_ema
        **({"final_val_loss_live": record["val_loss_live"]} if ema else {}),
        "final_train_loss": record.get("loss"),
        "tokens_per_s": tokens_per_step * len(step_times[timed]) / sum(step_times[timed])
        if step_times
        else None,
        "opt_ms": float(np.mean(opt_ms[timed])) if opt_ms else None,
        "opt_ms_median": float(np.median(opt_ms[timed])) if opt_ms else None,
        "state_bytes_per_param": state_bytes,
    }


def _train(cfg: TrainConfig, device, resumed: Path | None, owns_process_group: bool) -> dict:
    rank, world_size = _world()
    data, meta = _load_data(cfg, resumed)
    model, par = _model_for(cfg, data, device)
    block_size = _block_size(model)
    num_params = sum(p.numel() for p in model.parameters())  # global sizes under DTensor
    opt = _build_optimizer(cfg, model, par)
    scheduler = LambdaLR(opt, lr_schedule(cfg))  # one LambdaLR for every optimizer
    ema = None if cfg.eval_ema is None else WeightEMA(model, cfg.eval_ema)
    start = 0 if resumed is None else _resume(cfg, resumed, meta, model, opt, scheduler, ema, rank)
    info = run_info(cfg, data, world_size, num_params) | {"resumed_from": resumed and str(resumed)}
    log = RunLog(Path(cfg.out_dir), rank == 0, info, start if resumed else None)

    # ---- the loop
    tokens_per_step = cfg.batch_size * block_size
    train_time, step_times, opt_ms, record = log.time_s, [], [], {}
    quiet = not (cfg.progress and rank == 0 and sys.stderr.isatty())
    progress = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=quiet)
    model.train()
    for step in progress:  # `step` steps are done; this one trains on global batch `step`
        t0 = time.perf_counter()
        x, y = data.get_batch("train", step, cfg.batch_size, block_size, *_rows(par), cfg.seed)
        record = {"step": step + 1} | train_step(model, opt, x, y, cfg, device)
        if ema is not None:
            ema.update()
        scheduler.step()
        step_times.append(time.perf_counter() - t0)
        opt_ms.append(record["opt_ms"])
        train_time += step_times[-1]
        record |= {
            "tokens_per_s": tokens_per_step / step_times[-1],
            "step_ms": 1e3 * step_times[-1],
            "time_s": train_time,
        }
        done = step + 1
        if done % cfg.eval_interval == 0 or done == cfg.steps:
            record |= validate(model, ema, data, cfg, block_size, par, device)
            if cfg.progress and progress.disable and rank == 0:
                live = f" (live {record['val_loss_live']:.4f})" if ema else ""
                print(
                    f"step {done}/{cfg.steps}  loss {record['loss']:.4f}  "
                    f"val {record['val_loss']:.4f}{live}  {record['tokens_per_s']:.0f} tok/s  "
                    f"opt {record['opt_ms']:.1f} ms",
                    flush=True,
                )
        # the record first: a kill after the checkpoint's rename must not lose it (a kill
        # before it is redone from the previous checkpoint, its record dropped on resume)
        log.write(record)
        if cfg.checkpoint_interval and (done % cfg.checkpoint_interval == 0 or done == cfg.steps):
            _save(cfg, done, model, opt, scheduler, data, ema)
        progress.set_postfix(loss=f"{record['loss']:.3f}")
    progress.close()
    if "val_loss" not in record:  # nothing was left to train (a finished run resumed)
        record |= validate(model, ema, data, cfg, block_size, par, device)

    state_bytes = optimizer_state_bytes_per_param(opt, num_params)
    summary = _summary(cfg, record, step_times, opt_ms, tokens_per_step, state_bytes, ema, opt) | {
        "num_params": num_params,
        "train_time_s": train_time,
        "world_size": world_size,
        "layout": cfg.layout,
        "skipped_steps": log.skipped,  # rank 0's count: steps nonfinite="skip" skipped
    }
    if dist.is_initialized():  # losses are already averaged; timings are rank 0's
        shared = [summary]
        dist.broadcast_object_list(shared, src=0)
        summary = shared[0]
    log.finish(summary)
    if owns_process_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return summary
