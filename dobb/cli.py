"""The `dobb` command.

    dobb train [CONFIG.yaml] [key=value ...]     train one model (torchrun for several ranks)
    dobb compare [--quick] [--lr-sweep] ...      the optimizer comparison (the main job)
    dobb study [--tiny] [--out DIR]              tuned comparison, ablations -> STUDY.md

`python -m dobb` is the same command. A config is a YAML path or the name of one shipped
with dobb (`configs/tiny.yaml` works from any directory). A failure the user can fix (bad
config, data, optimizer options, damaged checkpoints, an `out_dir` in use, a layout
without torchrun) prints one line, `dobb: error: <what, and how to fix it>`, and exits
with status 2; `--debug` or DOBB_DEBUG=1 shows its traceback too. Any other error is a
bug and shows its traceback.
"""

import argparse
import importlib.util
import os
import shlex
import sys
import warnings

from dobb.train.config import ConfigError, find_config, load_config, parse_overrides
from dobb.train.errors import RunError, RunWarning

DEBUG_ENV = "DOBB_DEBUG"  # set to 1 for the traceback of an expected error, as --debug


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
    p = argparse.ArgumentParser(prog="dobb", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", help=f"tracebacks for expected errors too ({DEBUG_ENV}=1)"
    )

    t = sub.add_parser(
        "train", parents=[common], help="train a GPT from a YAML config plus key=value overrides"
    )
    t.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")

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

    s = sub.add_parser(
        "study", parents=[common], help="seeds, lr sweeps, Dobb ablations, width trend -> STUDY.md"
    )
    s.add_argument("--tiny", action="store_true", help="the whole pipeline on a tiny GPT")
    s.add_argument("--out", default=None, help="runs and plots (default: benchmarks/study)")
    s.add_argument("--doc", default=None, help="the report (default: STUDY.md next to --out)")
    s.add_argument("--config", default=None, help="the budget (default: configs/study/budget.yaml)")
    s.add_argument("--workers", type=int, default=None, help="runs side by side")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    with warnings.catch_warnings():  # restores showwarning when main returns
        warnings.showwarning = _show_warning
        try:
            if args.command == "train":
                return _train(args.args)
            if args.command == "study":
                return _study(args, "dobb " + shlex.join(argv))
            return _compare(args, "dobb " + shlex.join(argv))
        except (RunError, FileExistsError) as e:  # FileExistsError: compare's out_dir in use
            if debug:
                raise
            print(f"dobb: error: {one_line(e)}", file=sys.stderr)
            return _leave(2)


def _leave(code: int) -> int:
    """`code`; under torchrun, exit the process with it at once instead: a plain interpreter
    exit sometimes dies in gloo's teardown (DESIGN.md §5)."""
    if "RANK" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def one_line(error: BaseException) -> str:
    """The message of `error` on one line (a multi-line message's lines joined by '; ')."""
    return "; ".join(line.strip() for line in str(error).splitlines() if line.strip())


_default_show_warning = warnings.showwarning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A RunWarning as `dobb: warning: <message>`; any other warning as Python shows it."""
    if issubclass(category, RunWarning):
        print(f"dobb: warning: {one_line(message)}", file=sys.stderr if file is None else file)
    else:
        _default_show_warning(message, category, filename, lineno, file, line)


def _require(module: str, extra: str, command: str) -> None:
    """RunError before any work if `command` needs `module`, which the extra `extra` installs."""
    if importlib.util.find_spec(module) is None:
        raise RunError(
            f"`dobb {command}` needs {module}, which is not installed: pip install 'dobb[{extra}]'"
        )


def _train(items: list[str]) -> int:
    from dobb.train.trainer import train

    paths = [a for a in items if "=" not in a]
    if len(paths) > 1:
        raise ConfigError(f"expected at most one config file, got {paths}")
    cfg = load_config(paths[0] if paths else None, [a for a in items if "=" in a])
    summary = train(cfg)
    if "RANK" not in os.environ:
        print(f"final val loss {summary['final_val_loss']:.4f}; logs in {cfg.out_dir}")
    return _leave(0)


def _compare(args, command: str) -> int:
    _require("matplotlib", "bench", "compare")  # its plots; found now, not after the runs
    import torch

    from dobb.train.compare import LR_FACTORS, OPTIMIZERS, compare

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
    _require("matplotlib", "bench", "study")
    from dobb.bench.study import study

    out = args.out or ("runs/study-tiny" if args.tiny else "benchmarks/study")
    config = find_config(args.config or "configs/study/budget.yaml")  # from the package if need be
    study(out, args.doc, tiny=args.tiny, config=config, workers=args.workers, command=command)
    return 0
