"""The study's plots of (b), (c) and (d): ablation deltas and the width trend, each with the
seed-noise band."""

import math
from pathlib import Path
from typing import Any

from bench.study.format import NOISE, title


def plot_ablations(out: Path, report: dict[str, Any], name: str, file: str) -> str:
    """Horizontal bars: each ablation of `name`, its final val loss minus `name`'s at its
    tuned lr, with the noise band."""
    from matplotlib.figure import Figure

    name_title, noise = title(name), report["references"][name]["noise"]
    rows = [r for r in report["ablations"] if r["optimizer"] == name]
    fig = Figure(figsize=(8, 1.5 + 0.35 * len(rows)), layout="constrained")
    ax = fig.subplots()
    deltas = [r["delta"] if math.isfinite(r["delta"]) else math.nan for r in rows]
    colors = [
        "tab:gray" if not r["exceeds"] else "tab:red" if r["delta"] > 0 else "tab:green"
        for r in rows
    ]
    ax.barh(range(len(rows)), deltas, color=colors)
    ax.set_yticks(range(len(rows)), [f"{r['option']}={r['value']}" for r in rows])
    ax.invert_yaxis()
    ax.axvspan(-noise, noise, color="tab:blue", alpha=0.15, label=f"{NOISE} {name_title} seed std")
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel(f"final val loss minus {name_title}'s (lower is better)")
    ax.legend(loc="lower right")
    fig.savefig(out / file, dpi=120)
    return file


def plot_widths(out: Path, report: dict[str, Any]) -> str:
    """The Dobb - Dion gap in best final val loss against width, with the noise band."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    widths = [r["n_embd"] for r in report["widths"]]
    ax.plot(widths, [r["gap"] for r in report["widths"]], "o-", label="Dobb - Dion")
    noise = report["width_noise"]
    ax.axhspan(-noise, noise, color="tab:blue", alpha=0.15, label=f"{NOISE} pooled seed std")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set_xlabel("model width n_embd")
    ax.set_ylabel("gap in final val loss (negative: Dobb lower)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(out / "width.png", dpi=120)
    return "width.png"
