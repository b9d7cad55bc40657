"""The `dobb` command.

`dobb train [CONFIG.yaml] [key=value ...]` (also `python -m dobb`); `dobb plan CONFIG.yaml
--world N` prints each optimizer's predicted per-rank costs (the lab's ``bench.plan``). A
failure the user can fix (a divergence too) prints one line, `dobb: error: <what, and how to
fix it>`, and exits with status 2 (`--debug` or DOBB_DEBUG=1: its traceback too); any other
error is a bug.
The harness needs the train extra (numpy, pyyaml, tqdm), which the optimizers do not: without
it `dobb train` is such a failure, naming `pip install 'dobb[train]'`.
"""

import argparse
import os
import subprocess
import sys
import warnings

from dobb.optim.base import NonFiniteGradientError
from dobb.train.errors import RunError, RunWarning

DEBUG_ENV = "DOBB_DEBUG"  # set to 1 for the traceback of an expected error, as --debug
TRAIN_EXTRA = ("numpy", "yaml", "tqdm")  # what `pip install 'dobb[train]'` adds, by module


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
    pl = sub.add_parser(
        "plan", parents=[common], help="per-rank costs at a layout, predicted (needs a clone)"
    )
    pl.add_argument("args", nargs=argparse.REMAINDER, metavar="CONFIG.yaml --world N ...")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    with warnings.catch_warnings():  # restores showwarning when main returns
        warnings.showwarning = _show_warning
        try:
            return _plan(args.args) if args.command == "plan" else _train(args.args)
        except (RunError, NonFiniteGradientError) as e:  # the input's fault, or a divergence
            if debug:
                raise
            print(f"dobb: error: {one_line(e)}", file=sys.stderr)
            return _leave(2)


def _leave(code: int) -> int:
    """`code`; under torchrun, exit the process with it at once instead: a plain interpreter
    exit sometimes dies in gloo's process-group teardown."""
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


def _plan(items: list[str]) -> int:
    """``python -m bench plan``: the lab's cost model (not in the wheel), in a clone's root."""
    if not os.path.isfile(os.path.join("bench", "plan.py")):
        raise RunError(
            "`dobb plan` runs the lab's cost model (bench/), which the wheel does not ship: "
            "run it from the root of a clone of the repository"
        )
    return subprocess.call([sys.executable, "-m", "bench", "plan", *items])


def _train(items: list[str]) -> int:
    try:
        from dobb.train.config import ConfigError, load_config
        from dobb.train.trainer import train
    except ModuleNotFoundError as e:  # a bare `pip install dobb`: the optimizers alone
        missing = (e.name or "").partition(".")[0]
        if missing not in TRAIN_EXTRA:
            raise
        raise RunError(
            f"`dobb train` needs numpy, pyyaml and tqdm (no module named {missing!r}): "
            "pip install 'dobb[train]'"
        ) from e
    paths = [a for a in items if "=" not in a]
    if len(paths) > 1:
        raise ConfigError(f"expected at most one config file, got {paths}")
    cfg = load_config(paths[0] if paths else None, [a for a in items if "=" in a])
    summary = train(cfg)
    if "RANK" not in os.environ:
        print(f"final val loss {summary['final_val_loss']:.4f}; logs in {cfg.out_dir}")
    return _leave(0)
