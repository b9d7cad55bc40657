"""Loss against wall-clock time: one GPT trained for the same time budget per optimizer.

    python -m bench.timebudget prepare --out benchmarks/gpu/data/code-gpt2
    python -m bench.timebudget run --data benchmarks/gpu/data/code-gpt2 --device cuda \\
        --config gpt2 --budget-s 45 --out timebudget.json
    python -m bench.timebudget render timebudget.json --out-dir benchmarks/gpu

``prepare`` tokenizes offline text (this Python's standard library, the installed torch
package's sources, or directories of ``.py`` files) with GPT-2's BPE into ``train.bin`` and
``val.bin`` (llm.c shards, ``dobb.train.data``): every ``val_every``-th file is held out, with
an end-of-text token between files.

``run`` trains a fresh GPT (``dobb.train.model``, same seed and init) with each optimizer
(by default the lab's time-budget table, ``bench.optimizers.in_table("timebudget")``;
``build_optimizer`` with the registry's starting lr and the comparisons' options,
``bench.optimizers.LabEntry.harness_options``) for ``budget_s`` seconds of training time:
data fetch and the harness's step (``dobb.train.trainer.train_step``: forward under bf16
autocast, backward, clipping, ``opt.step()`` timed between device synchronizations, so the
optimizer's share is measured too). The learning rate of every group follows the harness's
schedule (``dobb.train.trainer.lr_multiplier``) on the budget's clock, not the step count:
with ``f = t / budget_s``,

    lr(t) = lr0 * f / w                                               f < w (warmup)
    lr(t) = lr0 * (1 - (1 - r) (1 - cos(pi (f - w) / (1 - w))) / 2)   otherwise

(``w = warmup_frac``, ``r = min_lr_ratio``). At ``evals`` equally spaced points of training
time the clock stops for the harness's evaluation (``dobb.train.trainer.evaluate``) on the
same ``eval_batches`` validation batches for every optimizer. The JSON (rewritten after
each evaluation, so a killed run leaves what it finished) holds per optimizer the points
``(time_s, step, train_loss, val_loss)`` (train loss: mean of the steps since the previous
point), a train-loss curve, steps, tokens/s and ms per ``opt.step()`` call (the rest of a
step: ``fwd_bwd_ms``). ``render`` writes ``timebudget.md`` (table) and ``timebudget.png``
(loss against time) from the JSON alone.

``timebudget_data`` prepares, ``timebudget_train`` trains and ``timebudget_report`` renders;
this module is their command line.
"""

import argparse
import json
from pathlib import Path

from bench.timebudget.data import prepare
from bench.timebudget.report import render, table
from bench.timebudget.train import NAMES, run


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
            command="python -m bench.timebudget " + " ".join(argv),
            progress=say,
        )
        say(table(record))
    else:
        md, png = render(args.json, args.out_dir or args.json.parent)
        say(md.read_text())
        say(f"wrote {md} and {png}")
