"""Optimizer-call time on the hidden matrices of a GPT: Dobb, two-sided Dobb, Dion, Muon,
MuonBP, NorMuon, Dion2, AdamW.

    python -m bench.results.calltime --config gpt2-xl --layers 2 --repeats 5 --out calltime.json

Single process, one device (``--device cuda`` works; every timed region is bracketed by
``torch.cuda.synchronize``). The workload is a ``LinearStack``: every hidden matrix of the
first ``--layers`` blocks of a GPT config (q, k, v, attention and MLP projections) as an
``nn.Linear`` fed a fixed token batch (``--tokens`` rows with correlated features).

What is measured:

- **Call time**, amortized over one period of the optimizer's periodic work. Dobb's period
  is ``--basis-interval`` (k) calls, exactly one of which refreshes the bases (batched
  ``eigh``), so the refresh is included (two-sided Dobb, ``dobb_sign``, likewise: every
  entry of the registry that needs statistics); MuonBP's is its ``--period`` (P) calls, one full
  Newton-Schulz step and P - 1 block steps (on one device its blocks are
  ``--row-blocks`` row tiles, emulating FSDP over that many ranks); Dion, Muon and AdamW
  do the same work every call, so their period is ``--calls`` calls. Each repeat gives one
  number per optimizer (the mean call time over its period); we report the median and the
  spread (min, quartiles, max) over repeats. The optimizers run interleaved, in a rotated
  order each repeat, after one warm-up period each (lazy state, the first ``eigh``).
  Gradients come from one real backward pass of the stack (``G = Cᵀ X`` with a fixed
  random output cotangent ``C``) and stay fixed. Before every Dobb call a real forward
  pass of every layer on the token batch feeds Dobb's statistics hooks; that forward is
  timed apart, not as part of the call.
- **Statistics hooks' share** of forward+backward: the stack's forward+backward with and
  without hooks (alternated), and the hooks alone (``BlockStatistics.add`` on each input).
- **Optimizer-state bytes per parameter** of the hidden matrices.

Two-sided Dobb's row blocks are ``DOBB_SIGN_ROW_BLOCKS`` per matrix (the rows of one rank
under FSDP over 32 ranks).

The cost model's ``Hardware`` profile of a machine is ``bench.results.calibrate``'s job.

All optimizers share one set of parameters (their updates do not change the work), so
memory is parameters + gradients + the optimizers' states. Sharded timing (FSDP2, HSDP,
TP over gloo ranks) is ``bench.results.calltime_sharded``, which runs ``time_optimizers`` on
every rank.
"""

import argparse
import inspect
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch import Tensor

from bench.model.workload import hidden_matrices
from bench.optimizers import (
    CALL_SETTINGS,
    DOBB_SIGN_ROW_BLOCKS,
    EMULATED_SHARDS,
    LAB,
    RATIO_KEY,
    SUBJECT,
    in_table,
    lab_entry,
)
from bench.results.linear_stack import LinearStack, Progress, autocast_context, hook_overhead
from bench.tools.markdown import markdown_table
from bench.tools.matmul_dtype import fastest_ns_dtype
from bench.tools.records import LAB_NAMES
from bench.tools.timing import spread, timed
from dobb.optim.config import batched_by_default
from dobb.optim.dobb import BLOCK_WIDTH, Dobb
from dobb.optim.muonbp import MuonBP
from dobb.registry import build_optimizer, get_entry

# the optimizers timed, and modelled beside them (BlockMuon: MuonBP's block step, a variant
# row of the model and the block calls of MuonBP's timing)
OPTIMIZERS = in_table("calltime")


def default_basis_method() -> str:
    """Dobb's ``basis_method`` default (how its refresh runs when the option is not given)."""
    return inspect.signature(Dobb).parameters["basis_method"].default


def optimizer_overrides(
    name: str,
    num_blocks: int,
    basis_interval: int,
    rank_fraction: float,
    period: int = CALL_SETTINGS["period"],
    row_blocks: int = MuonBP.Config.row_blocks,
    basis_method: str | None = None,
) -> dict:
    """Constructor arguments of the comparison (everything else: registry defaults).

    The arguments are named as ``costmodel.predict``'s, so one dict feeds both. Each
    optimizer takes the settings its lab entry lists (``calltime_settings``; one left None,
    as ``basis_method`` by default, is not passed) and its ``calltime_fixed`` ones: two-sided
    Dobb takes Dobb's, input blocks by ``num_blocks`` and ``DOBB_SIGN_ROW_BLOCKS`` row blocks."""
    settings = dict(
        num_blocks=num_blocks,
        basis_interval=basis_interval,
        rank_fraction=rank_fraction,
        period=period,
        row_blocks=row_blocks,
        basis_method=basis_method,
    )
    entry = lab_entry(name)
    chosen = {k: settings[k] for k in entry.calltime_settings if settings[k] is not None}
    return chosen | entry.calltime_fixed


def calls_per_period(name: str, options: dict, calls: int) -> int:
    """Calls over which ``name``'s periodic work repeats (``options``: its overrides): the
    lab entry's ``period_option`` (Dobb's ``basis_interval``, MuonBP's ``period``),
    else ``calls``."""
    option = lab_entry(name).period_option
    return (options.get(option) if option else None) or calls


def periodic_flags(name: str, options: dict, first: int, calls: int) -> list[bool]:
    """Which of ``calls`` calls of ``name``, from its call ``first`` (from 1), do its periodic
    work, as the library's schedule says (its lab entry's ``schedule`` at ``options``' value
    of its ``period_option``); all False for an optimizer without periodic work."""
    entry = lab_entry(name)
    period = options.get(entry.period_option) if entry.period_option else None
    if entry.schedule is None or period is None:
        return [False] * calls
    return [entry.schedule(step, period) for step in range(first, first + calls)]


def periodic_calls(name: str) -> tuple[str, str] | None:
    """``(key of the periodic call, key of the others)`` of ``name``, from its lab entry's
    ``periodic_calls`` (``("refresh_call_s", "steady_call_s")`` for Dobb); None if every
    call does the same work."""
    calls = lab_entry(name).periodic_calls
    return tuple(f"{call}_call_s" for call in calls) if calls else None


def state_bytes_measured(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> int:
    """Bytes of every tensor in the optimizer state of ``params``."""
    total = 0
    for p in params:
        for value in optimizer.state[p].values():
            if isinstance(value, Tensor):
                total += value.numel() * value.element_size()
    return total


def time_optimizers(
    stack: LinearStack,
    names: tuple[str, ...] = OPTIMIZERS,
    *,
    repeats: int = 5,
    warmup: int = 1,
    calls: int = 1,
    num_blocks: int = CALL_SETTINGS["num_blocks"],
    basis_interval: int = CALL_SETTINGS["basis_interval"],
    rank_fraction: float = CALL_SETTINGS["rank_fraction"],
    period: int = CALL_SETTINGS["period"],
    row_blocks: int = MuonBP.Config.row_blocks,
    basis_method: str | None = None,
    autocast: bool = False,
    ns_dtype: str | None = None,
    progress: Progress = lambda _: None,
    on_repeat: Callable[[dict], None] = lambda _: None,
    distributed: dict[str, dict] | None = None,
) -> dict:
    """Interleaved call times of ``names`` on ``stack`` (whose ``.grad`` must be set).

    ``period`` and ``row_blocks`` are MuonBP's, ``basis_method`` Dobb's (None: its
    default), ``ns_dtype`` the Newton-Schulz dtype of every optimizer that takes one
    (``bench.tools.matmul_dtype``; None: theirs). ``distributed``: further constructor
    arguments per optimizer (e.g. Dobb's ``data_parallel``) when ``stack`` is sharded.

    Returns ``{name: {...}}`` with per-repeat amortized call times and their spread,
    Dobb's refresh and MuonBP's full-step calls apart from their other calls, Dobb's
    forward-with-hooks time, and the state bytes. ``on_repeat`` gets the partial result
    after every repeat.
    """
    device = next(stack.parameters()).device
    params = list(stack.parameters())
    if any(p.grad is None for p in params):
        raise ValueError("every parameter needs a .grad (run forward_backward first)")
    stack.train()
    kw = dict(
        num_blocks=num_blocks,
        basis_interval=basis_interval,
        rank_fraction=rank_fraction,
        period=period,
        row_blocks=row_blocks,
    )
    overrides = {name: optimizer_overrides(name, **kw, basis_method=basis_method) for name in names}
    for name in names:
        if ns_dtype and "ns_dtype" in inspect.signature(get_entry(name).cls).parameters:
            overrides[name]["ns_dtype"] = getattr(torch, ns_dtype)
    optimizers = {
        name: build_optimizer(name, stack, **overrides[name], **(distributed or {}).get(name, {}))
        for name in names
    }
    results = {name: {"period_calls": [], "amortized_s": [], "forward_s": []} for name in names}

    def forward_for_statistics():
        with torch.enable_grad(), autocast_context(device, autocast):
            stack()  # the hooks accumulate X_bᵀ X_b; the graph is dropped

    made = dict.fromkeys(names, 0)  # calls of each optimizer so far

    def period(name: str) -> tuple[list[float], list[float]]:
        optimizer = optimizers[name]
        stats = get_entry(name).needs_statistics
        calls_s, forward_s = [], []
        n = calls_per_period(name, kw, calls)
        # summarize splits a period's first call off as the periodic one: the library's
        # schedule must mark it, and no other
        flags = periodic_flags(name, kw, made[name] + 1, n)
        if periodic_calls(name) and flags != [True] + [False] * (n - 1):
            raise RuntimeError(
                f"{name}'s calls {made[name] + 1}-{made[name] + n} do not open with its one "
                f"periodic call ({flags}): time whole periods from its first call"
            )
        made[name] += n
        for _ in range(n):
            if stats:
                forward_s.append(timed(forward_for_statistics, device))
            calls_s.append(timed(optimizer.step, device))
        return calls_s, forward_s

    for name in names:
        for _ in range(warmup):
            calls_s, _ = period(name)
            progress(f"warm-up {name}: {sum(calls_s) / len(calls_s) * 1e3:.1f} ms/call")
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            calls_s, forward_s = period(name)
            res = results[name]
            res["period_calls"].append(calls_s)
            res["amortized_s"].append(sum(calls_s) / len(calls_s))
            res["forward_s"] += forward_s
        progress(
            f"repeat {r + 1}/{repeats}: "
            + ", ".join(f"{n} {results[n]['amortized_s'][-1] * 1e3:.1f} ms" for n in names)
        )
        on_repeat(summarize(results, optimizers, params))
    return summarize(results, optimizers, params)


def summarize(results: dict, optimizers: dict, params: list[Tensor]) -> dict:
    """Spread of each optimizer's amortized call time, ratios to Dobb, state bytes."""
    numel = sum(p.numel() for p in params)
    out = {}
    for name, res in results.items():
        if not res["amortized_s"]:
            continue
        entry = {**res, "call_s": spread(res["amortized_s"])}
        keys = periodic_calls(name)
        if keys:  # call 0 of every period (time_optimizers holds it to the library's schedule)
            first, others = keys
            entry[first] = spread([calls[0] for calls in res["period_calls"]])
            rest = [t for calls in res["period_calls"] for t in calls[1:]]
            if rest:
                entry[others] = spread(rest)
        if res["forward_s"]:
            entry["forward_with_hooks_s"] = spread(res["forward_s"])
        state = state_bytes_measured(optimizers[name], params)
        entry["state_bytes"] = state
        entry["state_bytes_per_param"] = state / numel
        out[name] = entry
    if SUBJECT in out:
        base = out[SUBJECT]["call_s"]["median"]
        for entry in out.values():
            entry[RATIO_KEY] = entry["call_s"]["median"] / base
    return out


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU model from ``/proc/cpuinfo``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------- run
def run(
    config: str = "gpt2-xl",
    layers: int | None = 1,
    *,
    names: tuple[str, ...] = OPTIMIZERS,
    tokens: int = 512,
    repeats: int = 5,
    warmup: int = 1,
    calls: int = 1,
    num_blocks: int = CALL_SETTINGS["num_blocks"],
    basis_interval: int = CALL_SETTINGS["basis_interval"],
    rank_fraction: float = CALL_SETTINGS["rank_fraction"],
    period: int = CALL_SETTINGS["period"],
    row_blocks: int = EMULATED_SHARDS,
    basis_method: str | None = None,
    device: str = "cpu",
    autocast: bool = False,
    ns_dtype: str = "fastest",
    seed: int = 0,
    out: Path | None = None,
    command: str | None = None,
    progress: Progress = lambda _: None,
) -> dict:
    """Build the stack, measure hooks and call times, return (and write) the JSON record."""
    started = time.perf_counter()
    device_ = torch.device(device)
    torch.manual_seed(seed)
    matrices = hidden_matrices(config, layers)
    stack = LinearStack(matrices, tokens, device=device_, seed=seed)
    newton_schulz = fastest_ns_dtype(device_, ns_dtype)
    record = {
        "lab_names": LAB_NAMES,  # the record names optimizers as the lab's table does today
        "meta": {
            "config": config,
            "layers": layers,
            "matrices": len(matrices),
            "params": sum(m.numel for m in matrices),
            "shapes": sorted({(m.d_out, m.d_in) for m in matrices}),
            "tokens": tokens,
            "repeats": repeats,
            "warmup_periods": warmup,
            "calls": calls,
            "num_blocks": num_blocks,
            "basis_interval": basis_interval,
            "rank_fraction": rank_fraction,
            "period": period,
            "row_blocks": row_blocks,
            "dobb_sign_row_blocks": DOBB_SIGN_ROW_BLOCKS,
            "basis_method": basis_method or default_basis_method(),
            # same-shape matrices share kernels (off the CPU); hooks share inputs (q, k, v)
            "batched": batched_by_default(device_),
            "shared_hook_inputs": True,
            "device": device,
            "device_name": device_name(device_),
            "newton_schulz": newton_schulz,  # the Muon family's dtype, and why
            "autocast": "bf16" if autocast else "none",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": command,
            "complete": False,
        },
    }

    def write(partial: dict | None = None) -> None:
        if partial is not None:
            record["optimizers"] = partial
        record["meta"]["wall_s"] = time.perf_counter() - started
        if out is not None:
            write_json(out, record)

    progress(f"{config}: {len(matrices)} matrices, {record['meta']['params'] / 1e6:.1f}M params")
    record["hooks"] = hook_overhead(
        stack, num_blocks=num_blocks, repeats=repeats, autocast=autocast, progress=progress
    )
    if "dobb" in names:  # the recommended configuration's input blocks (the library's)
        record["hooks_recommended"] = hook_overhead(
            stack, num_blocks=None, repeats=repeats, autocast=autocast, progress=progress
        )
    write()
    record["optimizers"] = time_optimizers(
        stack,
        names,
        repeats=repeats,
        warmup=warmup,
        calls=calls,
        num_blocks=num_blocks,
        basis_interval=basis_interval,
        rank_fraction=rank_fraction,
        period=period,
        row_blocks=row_blocks,
        basis_method=basis_method,
        autocast=autocast,
        ns_dtype=newton_schulz["ns_dtype"],
        progress=progress,
        on_repeat=write,
    )
    record["meta"]["complete"] = True
    write()
    return record


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` through a temporary file (a reader never sees half)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def format_table(record: dict) -> str:
    """A Markdown table of the call times (ms), their spread, ratios and state bytes; below
    it, the periodic and other calls of each optimizer with periodic work (its lab entry's
    ``periodic_calls``)."""
    rows = []
    for name, e in record["optimizers"].items():
        c = {k: v * 1e3 for k, v in e["call_s"].items()}
        rows.append(
            [
                name,
                len(e["period_calls"][0]),
                f"{c['median']:.1f}",
                f"{c['q1']:.1f}–{c['q3']:.1f}",
                f"{c['min']:.1f}–{c['max']:.1f}",
                f"{e.get(RATIO_KEY, float('nan')):.2f}",
                f"{e['state_bytes_per_param']:.3f}",
            ]
        )
    headers = [
        "optimizer",
        "calls / period",
        "median ms",
        "IQR ms",
        "min–max ms",
        "× Dobb",
        "state B/param",
    ]
    lines = [markdown_table(headers, rows, align="lrrrrrr", pad=False), ""]
    for name, e in record["optimizers"].items():
        entry = LAB.get(name)
        keys = periodic_calls(name) if entry else None
        if not keys or keys[0] not in e:
            continue
        periodic, other = entry.periodic_calls
        note = (
            f"{entry.label[0].upper()}{entry.label[1:]}: {periodic} call "
            f"{e[keys[0]]['median'] * 1e3:.1f} ms, {other} calls "
            f"{e[keys[1]]['median'] * 1e3:.1f} ms (medians)"
        )
        if "forward_with_hooks_s" in e:  # Dobb-class: statistics from a forward pass
            note += (
                f"; forward with hooks before each call "
                f"{e['forward_with_hooks_s']['median'] * 1e3:.1f} ms (not in the call time)"
            )
        lines.append(note + ".")
    ns = record["meta"].get("newton_schulz")
    if ns:
        times = ", ".join(f"{k} {v:.2f} ms" for k, v in ns["matmul_ms"].items())
        lines.append(
            f"Newton-Schulz (Muon, MuonBP, NorMuon, Dion2, NorDion2) in {ns['ns_dtype']}, "
            f"{'the faster here' if ns['chosen_by'] == 'measured' else 'as given'} (one Gram "
            f"matmul: {times}; bf16 matmuls native: {'yes' if ns['bf16_native'] else 'no'})."
        )
    blocks = {
        "hooks": f"{record['meta']['num_blocks']} input blocks (the paper's)",
        "hooks_recommended": f"input blocks of at most {BLOCK_WIDTH:,} columns (the recommended)",
    }
    for key, which in blocks.items():
        h = record.get(key)
        if h:
            lines.append(
                f"Statistics hooks, {which}: forward+backward "
                f"{h['forward_backward_s']['median'] * 1e3:.1f} ms without, "
                f"{h['forward_backward_hooks_s']['median'] * 1e3:.1f} ms with hooks (share "
                f"{h['share_difference']:.1%}); hooks alone "
                f"{h['hooks_alone_s']['median'] * 1e3:.1f} ms (share {h['share_hooks_alone']:.1%})."
            )
    return "\n".join(lines).rstrip()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="A cost-model profile of this machine: python -m bench.results.calibrate.",
    )
    parser.add_argument("--config", default="gpt2-xl", help="GPT config (dobb.train.model)")
    parser.add_argument("--layers", type=int, default=1, help="transformer blocks to include")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated")
    parser.add_argument("--tokens", type=int, default=512, help="rows of the token batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="warm-up periods per optimizer")
    parser.add_argument("--calls", type=int, default=1, help="calls per period (not Dobb)")
    parser.add_argument("--num-blocks", type=int, default=CALL_SETTINGS["num_blocks"])
    parser.add_argument(
        "--basis-interval", type=int, default=CALL_SETTINGS["basis_interval"], help="Dobb's k"
    )
    parser.add_argument("--rank-fraction", type=float, default=CALL_SETTINGS["rank_fraction"])
    parser.add_argument(
        "--period", type=int, default=CALL_SETTINGS["period"], help="MuonBP's full-step period P"
    )
    parser.add_argument(
        "--row-blocks",
        type=int,
        default=EMULATED_SHARDS,
        help="MuonBP's row tiles on one device (emulates FSDP over that many ranks)",
    )
    parser.add_argument(
        "--basis-method", help="Dobb's basis_method (refresh solver); default: Dobb's default"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--autocast", choices=("none", "bf16"), default="none")
    parser.add_argument(
        "--ns-dtype",
        choices=("fastest", "bfloat16", "float32"),
        default="fastest",
        help="the Muon family's Newton-Schulz dtype (fastest: measured on this machine)",
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="JSON output (rewritten after every repeat)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = tuple(n.strip() for n in args.optimizers.split(",") if n.strip())
    for name in names:
        get_entry(name)  # ValueError for unknown names
    if args.repeats < 1 or args.calls < 1 or args.warmup < 0:
        raise ValueError("--repeats and --calls must be >= 1, --warmup >= 0")
    record = run(
        args.config,
        args.layers,
        names=names,
        tokens=args.tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        calls=args.calls,
        num_blocks=args.num_blocks,
        basis_interval=args.basis_interval,
        rank_fraction=args.rank_fraction,
        period=args.period,
        row_blocks=args.row_blocks,
        basis_method=args.basis_method,
        device=args.device,
        autocast=args.autocast == "bf16",
        ns_dtype=args.ns_dtype,
        seed=args.seed,
        out=args.out,
        command="python -m bench.results.calltime " + " ".join(argv),
        progress=lambda s: print(s, flush=True),
    )
    m = record["meta"]
    print(
        f"\n{m['config']} x {m['layers']} layers ({m['params'] / 1e6:.1f}M params), "
        f"{m['device_name']}, torch {m['torch']}, {m['wall_s']:.0f} s"
    )
    print(format_table(record))


if __name__ == "__main__":
    main(sys.argv[1:])
