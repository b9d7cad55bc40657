"""The lab's command: the comparisons that produce the repository's evidence.

    python -m bench compare [--quick] [--lr-sweep] ...   the optimizer comparison (the main job)
    python -m bench study [--tiny] [--out DIR]           tuned comparison, ablations -> STUDY.md
    python -m bench plan CONFIG.yaml --world N           predicted per-rank costs (= dobb plan)

Run from a clone (the lab is not part of the wheel). Errors the user can fix print one line,
`bench: error: <what, and how to fix it>`, and exit with status 2, as `dobb train` does.
"""

import argparse
import importlib.util
import os
import shlex
import sys

from dobb.cli import DEBUG_ENV, one_line
from dobb.train.config import parse_overrides
from dobb.train.errors import RunError

COMMAND = "python -m bench"  # how the records name this command


def _csv(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def _lr_grid(text: str) -> tuple[str, list[float]]:
    name, sep, values = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected NAME=LR,LR,... got {text!r}")
    try:
        return name, [float(v) for v in _csv(values)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad learning rate in {text!r}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", help=f"tracebacks for expected errors too ({DEBUG_ENV}=1)"
    )

    c = sub.add_parser(
        "compare", parents=[common], help="compare the optimizers on one small GPT (the main job)"
    )
    c.add_argument("--quick", action="store_true", help="smoke run: tiny GPT, a few steps")
    c.add_argument("--lr-sweep", action="store_true", help="log-spaced lr grid per optimizer")
    c.add_argument("--out", default=None, help="report folder (default: runs/compare[-quick])")
    c.add_argument("--optimizers", type=_csv, default=None, help="e.g. dobb,adamw (default all)")
    c.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    c.add_argument(
        "--lr-factors",
        type=lambda s: [float(v) for v in _csv(s)],
        default=None,
        help="sweep grid as multiples of each registry lr (default 0.25,0.5,1,2,4)",
    )
    c.add_argument(
        "--lrs",
        type=_lr_grid,
        action="append",
        default=[],
        metavar="NAME=LR,LR,...",
        help="explicit sweep grid for one optimizer (repeatable)",
    )
    c.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    c.add_argument("overrides", nargs="*", metavar="key=value", help="TrainConfig overrides")

    pl = sub.add_parser(
        "plan", help="predicted per-rank state, bytes sent and call time at a layout"
    )
    pl.add_argument("args", nargs=argparse.REMAINDER, help="see `python -m bench plan -h`")
    s = sub.add_parser(
        "study", parents=[common], help="seeds, lr sweeps, Dobb ablations, width trend -> STUDY.md"
    )
    s.add_argument("--tiny", action="store_true", help="the whole pipeline on a tiny GPT")
    s.add_argument("--out", default=None, help="runs and plots (default: benchmarks/study)")
    s.add_argument("--doc", default=None, help="the report (default: STUDY.md next to --out)")
    s.add_argument("--config", default=None, help="the budget (default: bench/study/budget.yaml)")
    s.add_argument("--workers", type=int, default=None, help="runs side by side")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug_env = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    if argv[:1] == ["plan"]:  # its own parser (bench.plan), shared with `dobb plan`
        from bench.plan import main as plan

        try:
            return plan(argv[1:])
        except RunError as e:  # e.g. a config that does not load
            if debug_env:
                raise
            print(f"dobb plan: error: {one_line(e)}", file=sys.stderr)
            return 2
    args = parser().parse_args(argv)
    debug = args.debug or debug_env
    command = f"{COMMAND} {shlex.join(argv)}"
    try:
        if importlib.util.find_spec("matplotlib") is None:  # the plots: found now, not after runs
            raise RunError(f"`{COMMAND} {args.command}` plots: pip install matplotlib")
        return _study(args, command) if args.command == "study" else _compare(args, command)
    except (RunError, FileExistsError) as e:  # FileExistsError: compare's out_dir in use
        if debug:
            raise
        print(f"bench: error: {one_line(e)}", file=sys.stderr)
        return 2


def _compare(args, command: str) -> int:
    import torch

    from bench.compare import LR_FACTORS, OPTIMIZERS, compare

    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or ("runs/compare-quick" if args.quick else "runs/compare")
    compare(
        out,
        args.optimizers or OPTIMIZERS,
        quick=args.quick,
        steps=args.steps,
        lr_sweep=args.lr_sweep or bool(args.lrs),
        lr_factors=args.lr_factors or LR_FACTORS,
        lrs=dict(args.lrs),
        overrides=parse_overrides(args.overrides),
        command=command,
    )
    return 0


def _study(args, command: str) -> int:
    from bench.study import study

    out = args.out or ("runs/study-tiny" if args.tiny else "benchmarks/study")
    study(out, args.doc, tiny=args.tiny, config=args.config, workers=args.workers, command=command)
    return 0
