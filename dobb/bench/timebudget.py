"""Loss against wall-clock time: one GPT trained for the same time budget per optimizer.

    python -m dobb.bench.timebudget prepare --out benchmarks/gpu/data/code-gpt2
    python -m dobb.bench.timebudget run --data benchmarks/gpu/data/code-gpt2 --device cuda \\
        --config gpt2 --budget-s 45 --out timebudget.json
    python -m dobb.bench.timebudget render timebudget.json --out-dir benchmarks/gpu

``prepare`` tokenizes offline text (this Python's standard library, the installed torch
package's sources, or directories of ``.py`` files) with GPT-2's BPE into ``train.bin`` and
``val.bin`` (llm.c shards, ``dobb.train.data``): every ``val_every``-th file is held out, with
an end-of-text token between files.

``run`` trains a fresh GPT (``dobb.train.model``, same seed and init) with each optimizer
(``build_optimizer`` with the registry's starting lr and the paper comparison's options of
``dobb.train.compare.OPTIONS``) for ``budget_s`` seconds of training time: data fetch,
forward, backward, clipping and ``opt.step()``, the device synchronized after the backward
pass and after the step (so the optimizer's share is measured too). The learning rate of
every group follows the budget's clock, not the step count: with ``f = t / budget_s``,

    lr(t) = lr0 * f / w                                               f < w (warmup)
    lr(t) = lr0 * (r + (1 - r) (1 + cos(pi (f - w) / (1 - w))) / 2)   otherwise

(``w = warmup_frac``, ``r = min_lr_ratio``). At ``evals`` equally spaced points of training
time the clock stops for an evaluation on the same ``eval_batches`` validation batches for
every optimizer. The JSON (rewritten after each evaluation, so a killed run leaves what it
finished) holds per optimizer the points ``(time_s, step, train_loss, val_loss)`` (train
loss: mean of the steps since the previous point), a train-loss curve, steps, tokens/s and
ms per ``opt.step()`` call. ``render`` writes ``timebudget.md`` (table) and
``timebudget.png`` (loss against time) from the JSON alone.
"""

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from dobb.bench.calltime import device_name, write_json
from dobb.markdown import markdown_table
from dobb.optim.registry import build_optimizer, get_entry
from dobb.train.compare import OPTIONS
from dobb.train.data import (
    GPT2_VOCAB_SIZE,
    STDLIB_SKIP,
    TokenStream,
    gpt2_tokenizer,
    stdlib_files,
    write_bin_shard,
)
from dobb.train.model import GPT, gpt_config

NAMES = ("dobb", "dion", "muon", "blockmuon", "adamw")
EOT = 50256  # GPT-2's <|endoftext|>
CURVE_POINTS = 200  # train-loss curve: at most this many (time, step, loss) rows
Progress = Callable[[str], None]


# --------------------------------------------------------------------------- prepare
def source_files(source: str) -> list[Path]:
    """``.py`` files of ``source``: "stdlib", "torch" (the installed package) or a directory.

    Tests, caches and vendored trees (``dobb.train.data.STDLIB_SKIP``) are skipped; sorted.
    """
    if source == "stdlib":
        return stdlib_files()
    root = Path(torch.__file__).parent if source == "torch" else Path(source)
    if not root.is_dir():
        raise FileNotFoundError(
            f"source {source!r} is neither 'stdlib', 'torch' nor a directory of .py files"
        )
    files = [p for p in root.rglob("*.py") if not STDLIB_SKIP & set(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def prepare(
    out: Path,
    sources: tuple[str, ...] = ("stdlib",),
    *,
    max_tokens: int | None = None,
    val_every: int = 20,
    progress: Progress = lambda _: None,
) -> dict:
    """Tokenize ``sources`` into ``out/train.bin`` and ``out/val.bin`` (GPT-2 BPE).

    File ``i`` of the concatenated source lists goes to validation if
    ``i % val_every == val_every - 1``. Stops adding files once ``max_tokens`` tokens
    (train + val) are reached. Writes and returns ``out/meta.json``.
    """
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2 (one file in n is held out), got {val_every}")
    started = time.perf_counter()
    tokenizer = gpt2_tokenizer()
    files = [f for source in sources for f in source_files(source)]
    if not files:
        raise FileNotFoundError(f"no .py files in the sources {sources}")
    splits: dict[str, list[int]] = {"train": [], "val": []}
    used, num_bytes = 0, 0
    for i, path in enumerate(files):
        data = path.read_bytes()
        split = "val" if i % val_every == val_every - 1 else "train"
        splits[split] += tokenizer.encode(data.decode("utf-8", "replace")) + [EOT]
        used, num_bytes = i + 1, num_bytes + len(data)
        total = len(splits["train"]) + len(splits["val"])
        if used % 200 == 0:
            progress(f"{used}/{len(files)} files, {total:,} tokens")
        if max_tokens is not None and total >= max_tokens:
            break
    out.mkdir(parents=True, exist_ok=True)
    for split, tokens in splits.items():
        write_bin_shard(out / f"{split}.bin", np.array(tokens, np.uint16), GPT2_VOCAB_SIZE)
    meta = {
        "sources": list(sources),
        "files": used,
        "bytes": num_bytes,
        "train_tokens": len(splits["train"]),
        "val_tokens": len(splits["val"]),
        "val_every": val_every,
        "max_tokens": max_tokens,
        "tokenizer": "gpt2",
        "seconds": time.perf_counter() - started,
        "python": sys.version.split()[0],
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


# --------------------------------------------------------------------------- run
def lr_factor(fraction: float, warmup_frac: float, min_lr_ratio: float) -> float:
    """The schedule's multiplier at ``fraction`` (in [0, 1]) of the budget (module doc)."""
    if fraction < warmup_frac:
        return fraction / warmup_frac
    decay = min(1.0, (fraction - warmup_frac) / (1.0 - warmup_frac))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * decay))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    training time (module doc); returns its record (``on_point`` gets it after each eval)."""
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
    record. ``data``: a folder with ``train.bin`` and ``val.bin`` (``prepare``);
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
            f"`python -m dobb.bench.timebudget prepare --out {data}`"
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


# --------------------------------------------------------------------------- render
def table(record: dict) -> str:
    """Markdown: per optimizer its lr, steps, throughput, call times and the val losses."""
    meta = record["meta"]
    columns = max([len(e.get("points", [])) for e in record["optimizers"].values()] + [1])
    headers = ["optimizer", "lr", "steps", "tokens/s", "opt ms/call (mean, median)", "fwd+bwd ms"]
    headers += [f"val loss @ s ({i + 1})" for i in range(columns)]
    rows = []
    for name, e in record["optimizers"].items():
        label = name + (" (diverged)" if e.get("diverged") else "")
        if "error" in e:
            label += " (FAILED: " + e["error"][:120].replace("|", "/").replace("\n", " ") + ")"
        if "tokens_per_s" not in e:  # failed before its first evaluation
            rows.append([label] + ["-"] * (len(headers) - 1))
            continue
        vals = [f"{p['val_loss']:.3f} @ {p['time_s']:.0f}" for p in e["points"]]
        vals += ["-"] * (columns - len(vals))
        opt_ms = f"{e['opt_ms']['mean']:.1f}, {e['opt_ms']['median']:.1f}"
        rows.append(
            [label, f"{e['lr']:.3g}", e["steps"], f"{e['tokens_per_s']:,.0f}", opt_ms]
            + [f"{e['fwd_bwd_ms']['median']:.1f}", *vals]
        )
    state = "" if meta["complete"] else " INCOMPLETE (partial results)."
    schedule = meta["schedule"]
    head = (
        f"{meta['config']} ({meta['params'] / 1e6:.1f}M parameters), {meta['device_name']}, "
        f"torch {meta['torch']}, autocast {meta['autocast']}, fp32 matmul precision "
        f"{meta['matmul_precision']}, {meta['date']}.{state} "
        f"{meta['budget_s']:g} s of training per optimizer (evaluation excluded), "
        f"{meta['tokens_per_step']:,} tokens per step, lr warmup {schedule['warmup_frac']:g} "
        f"of the budget then cosine to {schedule['min_lr_ratio']:g} x; validation on "
        f"{meta['eval_batches']} batches when training time first passes each of "
        f"{meta['evals']} equally spaced times; data {meta['data']['path']} "
        f"({meta['data']['train_tokens']:,} train / {meta['data']['val_tokens']:,} val tokens)."
    )
    command = f"\n\n`{meta['command']}`" if meta.get("command") else ""
    body = markdown_table(headers, rows, align="l" + "r" * (len(headers) - 1), pad=False)
    return head + command + "\n\n" + body


def plot(record: dict, path: Path) -> None:
    """Train loss (thin) and validation loss (markers) against training time."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    for i, (name, e) in enumerate(record["optimizers"].items()):
        color = f"C{i}"
        if e.get("curve"):
            t, _, loss = zip(*e["curve"])
            ax.plot(t, loss, color=color, alpha=0.35, linewidth=0.8)
        if e.get("points"):
            t = [p["time_s"] for p in e["points"]]
            ax.plot(t, [p["val_loss"] for p in e["points"]], "o-", color=color, label=name)
    meta = record["meta"]
    ax.set_xlabel("training time (s, evaluation excluded)")
    ax.set_ylabel("loss (markers: validation; thin: train)")
    ax.set_title(f"{meta['config']} on {meta['device_name']}, {meta['budget_s']:g} s each")
    finals = [p["val_loss"] for e in record["optimizers"].values() for p in e.get("points", [])]
    if finals:  # the early steep part would flatten the comparison
        ax.set_ylim(min(finals) - 0.2, max(finals) + 0.5)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120)


def render(path: Path, out_dir: Path) -> tuple[Path, Path]:
    """``timebudget.md`` and ``timebudget.png`` in ``out_dir`` from the JSON at ``path``."""
    record = json.loads(Path(path).read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    md, png = out_dir / "timebudget.md", out_dir / "timebudget.png"
    md.write_text(table(record) + "\n")
    plot(record, png)
    return md, png


# --------------------------------------------------------------------------- CLI
def parse_lrs(items: list[str]) -> dict[str, float]:
    """``["dobb=2e-3", ...]`` -> ``{"dobb": 0.002}``."""
    lrs = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            lrs[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--lr takes NAME=VALUE (e.g. dobb=2e-3), got {item!r}")
    return lrs


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize offline text into train.bin / val.bin")
    p.add_argument("--out", type=Path, required=True, help="folder for the shards")
    p.add_argument(
        "--source",
        action="append",
        help="'stdlib', 'torch' or a directory of .py files (repeatable; default stdlib)",
    )
    p.add_argument("--max-tokens", type=int, help="stop adding files past this many tokens")
    p.add_argument("--val-every", type=int, default=20, help="every n-th file is validation")
    r = sub.add_parser("run", help="train each optimizer for the same time budget")
    r.add_argument("--data", type=Path, required=True, help="folder with train.bin, val.bin")
    r.add_argument("--optimizers", default=",".join(NAMES), help="comma-separated")
    r.add_argument("--config", default="gpt2", help="GPT config (dobb.train.model)")
    r.add_argument("--budget-s", type=float, default=45.0, help="training seconds each")
    r.add_argument("--device", default="cuda")
    r.add_argument("--batch-size", type=int, default=16)
    r.add_argument("--block-size", type=int, help="context length (default: the config's)")
    r.add_argument("--evals", type=int, default=4, help="validation points in the budget")
    r.add_argument("--eval-batches", type=int, default=8)
    r.add_argument("--lr", action="append", default=[], help="NAME=VALUE (repeatable)")
    r.add_argument("--basis-method", help="Dobb's basis_method (default: Dobb's)")
    r.add_argument("--warmup-frac", type=float, default=0.05)
    r.add_argument("--min-lr-ratio", type=float, default=0.1)
    r.add_argument("--grad-clip", type=float, default=1.0, help="0: no clipping")
    r.add_argument("--autocast", choices=("bf16", "none"), default="bf16")
    r.add_argument(
        "--matmul-precision",
        choices=("highest", "high"),
        default="highest",
        help="torch.set_float32_matmul_precision (high: TF32)",
    )
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", type=Path, required=True, help="JSON output")
    d = sub.add_parser("render", help="Markdown table and PNG plot from the JSON")
    d.add_argument("json", type=Path)
    d.add_argument("--out-dir", type=Path, help="default: the JSON's folder")
    args = parser.parse_args(argv)
    say = lambda s: print(s, flush=True)  # noqa: E731
    if args.command == "prepare":
        meta = prepare(
            args.out,
            tuple(args.source or ("stdlib",)),
            max_tokens=args.max_tokens,
            val_every=args.val_every,
            progress=say,
        )
        say(json.dumps(meta, indent=1))
    elif args.command == "run":
        record = run(
            args.data,
            tuple(n.strip() for n in args.optimizers.split(",") if n.strip()),
            config=args.config,
            budget_s=args.budget_s,
            device=args.device,
            batch_size=args.batch_size,
            block_size=args.block_size,
            evals=args.evals,
            eval_batches=args.eval_batches,
            lrs=parse_lrs(args.lr),
            basis_method=args.basis_method,
            warmup_frac=args.warmup_frac,
            min_lr_ratio=args.min_lr_ratio,
            grad_clip=args.grad_clip,
            autocast=args.autocast == "bf16",
            matmul_precision=args.matmul_precision,
            seed=args.seed,
            out=args.out,
            command="python -m dobb.bench.timebudget " + " ".join(argv),
            progress=say,
        )
        say(table(record))
    else:
        md, png = render(args.json, args.out_dir or args.json.parent)
        say(md.read_text())
        say(f"wrote {md} and {png}")


if __name__ == "__main__":
    main(sys.argv[1:])
