"""The report of ``bench.timebudget``: ``timebudget.md`` (table) and ``timebudget.png``
(loss against training time), from the run's JSON alone."""

import json
from pathlib import Path

from bench.tools.markdown import markdown_table


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
