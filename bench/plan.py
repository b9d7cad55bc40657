"""What each optimizer will cost at your scale, per rank: predictions of the cost model.

    dobb plan configs/gpt2-fineweb.yaml --world 32                 # FSDP over 32 ranks
    dobb plan CONFIG.yaml --world 64 --layout hsdp --shard 8 --json plan.json

(``python -m bench plan`` is the same command; both need a clone: the lab is not in the
wheel.) For the hidden matrices of the config's GPT (its ``model`` and
``model_overrides``), split as the layout says (``bench.model.workload.layout_of``), every
registry optimizer with a cost model at its defaults (the config's own optimizer with its
``optimizer_options``), on the rank holding the largest piece of each matrix:

- the bytes it keeps alive (``costmodel.rank_state_bytes``: state, statistics sums and
  bases; a tensor every data rank holds alike counted whole), per local parameter and
  against AdamW's;
- the bytes it sends on a call without periodic work and on a periodic one (Dobb's refresh,
  MuonBP's full step): per collective of ``build_work`` the ring's share of one rank (an
  all-reduce of ``B`` bytes: ``2 (p - 1) / p B``; an all-gather or all-to-all: ``(p - 1) /
  p B``);
- its amortized call time on the H100 profile (``costmodel.predict``).

Each figure is a prediction. Beside it stands the model's error against what the
repository measured: the state against ``bench.results.memory``'s record (FSDP2 on gloo),
the call time against the CPU call-time record with the CPU profile calibrated here
(RESULTS.md section 4); bytes sent are not checked against a measurement here
(``benchmarks/COMM.md`` measures the tiny GPT's with the analytic formulas).
"""

import argparse
import json
import math
import shlex
from pathlib import Path

from bench.model.costmodel import build_work, predict, rank_state_bytes
from bench.model.costs import MODELS
from bench.model.hardware import H100, Collective, Hardware, Network
from bench.model.workload import Layout, Matrix, hidden_matrices, layout_of, transformer_matrices
from bench.tools.markdown import markdown_table
from dobb.train.model import gpt_config

MEMORY_RECORD = Path("benchmarks/memory.json")
CALLTIME_RECORD = Path("benchmarks/calltime_cpu.json")
CPU_PROFILE = Path("benchmarks/cpu_calibration.json")
REFERENCE = "adamw"  # the per-rank state others are set against


def sent_per_rank(c: Collective) -> float:
    """Bytes one rank sends in ``c`` by the ring's algorithm."""
    p = c.group
    if p <= 1:
        return 0.0
    share = 2 * (p - 1) / p if c.kind == "all_reduce" else (p - 1) / p
    return c.count * share * c.bytes


def plan(
    matrices: list[Matrix],
    layout: Layout,
    *,
    options: dict[str, dict] | None = None,
    hardware: Hardware = H100,
) -> dict:
    """Per optimizer (``MODELS``' registry order): ``state_bytes`` and
    ``state_per_local_param`` on the largest rank, ``sent_steady`` and ``sent_periodic``
    bytes per rank, ``call_ms`` amortized. ``options``: constructor options per name."""
    options = options or {}
    local = sum(math.prod(layout.local(m)) for m in matrices)
    network = Network() if layout.world > 1 else None
    rows = {}
    for name in MODELS:
        given = options.get(name, {})
        work = build_work(name, matrices, layout=layout, foreach=hardware.foreach, **given)
        steady = sum(map(sent_per_rank, work.step_comm))
        periodic = sum(map(sent_per_rank, work.refresh_comm))
        if work.due is not None and not work.replaces_step:
            periodic += steady
        state = rank_state_bytes(name, matrices, layout, **given)
        call = predict(name, matrices, hardware, layout=layout, network=network, **given)
        rows[name] = {
            "state_bytes": state,
            "state_per_local_param": state / local,
            "sent_steady": steady,
            "sent_periodic": periodic if work.due is not None else None,
            "call_ms": call["total"] * 1e3,
        }
    for row in rows.values():
        row["state_vs_adamw"] = row["state_bytes"] / rows[REFERENCE]["state_bytes"]
    return {"local_params": local, "optimizers": rows}


def state_errors(record: dict) -> dict[str, float]:
    """Per optimizer, the largest |predicted / measured - 1| of its per-rank state over the
    world sizes of a ``bench.results.memory`` record."""
    m = record["meta"]
    matrices = hidden_matrices(m["config"], m["layers"])
    errors: dict[str, float] = {}
    for world, row in record["worlds"].items():
        for name, measured in row.items():
            if name in MODELS:
                predicted = rank_state_bytes(name, matrices, Layout(shard=int(world)))
                error = abs(predicted / measured["bytes"] - 1)
                errors[name] = max(errors.get(name, 0.0), error)
    return errors


def call_errors(record: dict, hardware: Hardware) -> dict[str, float]:
    """Per optimizer, |predicted / measured - 1| of its amortized call in the call-time
    record (``bench.results.sections.check_rows``: the same rows as RESULTS.md's check)."""
    from bench.results.sections import check_rows

    return {
        label: abs(predicted / measured - 1)
        for label, predicted, measured in check_rows(record, hardware)
        if predicted is not None and label in MODELS
    }


def measured_errors(root: Path = Path(".")) -> dict:
    """The model's errors against the repository's records (empty where one is missing)."""
    out: dict = {"state": {}, "call": {}}
    if (root / MEMORY_RECORD).exists():
        record = json.loads((root / MEMORY_RECORD).read_text())
        out["state"] = state_errors(record)
        out["state_source"] = _memory_source(record)
        out["state_measured"] = {
            world: {n: r["bytes"] / r["local_params"] for n, r in row.items()}
            for world, row in record["worlds"].items()
        }
    if (root / CALLTIME_RECORD).exists() and (root / CPU_PROFILE).exists():
        profile = Hardware.from_json(json.loads((root / CPU_PROFILE).read_text()))
        out["call"] = call_errors(json.loads((root / CALLTIME_RECORD).read_text()), profile)
        out["call_source"] = f"{CALLTIME_RECORD} on {profile.name}"
    return out


def _memory_source(record: dict) -> str:
    m = record["meta"]
    worlds = ", ".join(map(str, m["worlds"]))
    return f"{MEMORY_RECORD} ({m['config']}, {m['layers']} block, FSDP on {worlds} gloo ranks)"


def render(config: str, layout_name: str, layout: Layout, result: dict, errors: dict) -> str:
    """The plan as text: one table, every figure a prediction, the errors beside it."""

    def pct(table: dict, name: str) -> str:
        return f"{table[name]:.1%}" if name in table else "not measured"

    rows = []
    for name, r in result["optimizers"].items():
        periodic = "-" if r["sent_periodic"] is None else f"{r['sent_periodic'] / 1e6:,.1f}"
        rows.append(
            [
                name,
                f"{r['state_bytes'] / 2**20:,.1f}",
                f"{r['state_per_local_param']:.2f}",
                f"{r['state_vs_adamw']:.2f}x",
                pct(errors["state"], name),
                f"{r['sent_steady'] / 1e6:,.1f}",
                periodic,
                f"{r['call_ms']:,.2f}",
                pct(errors["call"], name),
            ]
        )
    headers = [
        "optimizer",
        "state MiB",
        "B / local param",
        "vs AdamW",
        "state error",
        "MB sent, every call",
        "MB sent, periodic call",
        "call ms (H100)",
        "call error",
    ]
    lines = [
        f"dobb plan: {config}, {layout_name} ({layout.world} ranks: shard {layout.shard}, "
        f"replicate {layout.replicate}, tensor {layout.tensor}); per rank, the largest; "
        f"{result['local_params']:,} local hidden-matrix parameters. Every figure is a "
        "PREDICTION of the cost model (bench.model).",
        "",
        markdown_table(headers, rows, "l" + "r" * (len(headers) - 1), pad=False),
        "",
        "Errors are the model's largest |predicted / measured - 1| against the repository's "
        "records: state against "
        + errors.get("state_source", "no record")
        + "; call time against "
        + errors.get("call_source", "no record")
        + " (one process; the H100 profile itself is datasheet values, not measured here). "
        "Bytes sent are not checked against a measurement here. Periodic call: Dobb's "
        "refresh, MuonBP's full step. Dobb's statistics hooks run in the forward pass, "
        "outside the call.",
        *_measured_lines(errors.get("state_measured")),
    ]
    return "\n".join(lines)


def _measured_lines(measured: dict | None) -> list[str]:
    """The memory record the state error is taken against: bytes per local parameter by
    world size, measured."""
    if not measured:
        return []
    worlds = list(measured)
    names = list(measured[worlds[0]])
    rows = [[n, *(f"{measured[w][n]:.2f}" for w in worlds)] for n in names]
    return [
        "",
        "Measured (the memory record above), bytes per local parameter:",
        "",
        markdown_table(
            ["optimizer", *(f"{w} rank{'' if w == '1' else 's'}" for w in worlds)],
            rows,
            "l" + "r" * len(worlds),
            pad=False,
        ),
    ]


def matrices_of(config_path: str, overrides: list[str]) -> tuple[str, list[Matrix], dict]:
    """The config's GPT (name and width), its hidden matrices, and its optimizer's options
    (``overrides``: ``key=value`` on top of the file, as ``dobb train`` takes them)."""
    from dobb.train.config import load_config

    cfg = load_config(config_path, overrides)
    gpt = gpt_config(cfg.model, **cfg.model_overrides)
    name = f"{cfg.model} (width {gpt.n_embd}, {gpt.n_layer} layers)"
    options = {cfg.optimizer: dict(cfg.optimizer_options)} if cfg.optimizer in MODELS else {}
    return name, transformer_matrices(gpt.n_embd, gpt.n_layer), options


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dobb plan", description=__doc__.splitlines()[0])
    p.add_argument("config", help="a `dobb train` YAML config (its model and optimizer)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. model=gpt2-xl")
    p.add_argument("--world", type=int, required=True, help="ranks in all")
    p.add_argument("--layout", choices=("fsdp", "hsdp", "tp", "ddp"), default="fsdp")
    p.add_argument("--shard", type=int, default=8, help="hsdp: ranks per replica")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    p.add_argument("--out", type=Path, default=None, help="also write the text here")
    args = p.parse_args(argv)
    name, matrices, options = matrices_of(args.config, args.overrides)
    layout = layout_of(args.layout, args.world, shard=args.shard)
    result = plan(matrices, layout, options=options)
    errors = measured_errors()
    text = render(name, args.layout, layout, result, errors)
    print(text)
    command = shlex.join(["dobb", "plan", *argv])
    if args.out:
        args.out.write_text(f"Written by `{command}`.\n\n{text}\n")
    if args.json:
        record = {
            "command": command,
            "config": args.config,
            "overrides": args.overrides,
            "model": name,
            "layout": {"name": args.layout, **vars(layout)},
            "prediction": result,
            "measured_errors": errors,
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0
