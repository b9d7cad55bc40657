"""The two PNG plots of ``benchmarks/RESULTS.md``: the model's world-size and width sweeps."""

from pathlib import Path

from bench.model.costmodel import PAPER_XL_32_H100_MS
from bench.model.hardware import Network
from bench.model.workload import WIDTHS
from bench.results.model import UNBATCHED, WORLDS, XL_WORLD


def plot(worlds: dict, widths: dict, out_dir: Path) -> list[str]:
    """Plots of ``sweep_tables``' series into ``out_dir``; returns their file names (none
    without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    node = Network().gpus_per_node
    for fname, xs, series, xlabel in (
        ("calltime_vs_world.png", WORLDS, worlds, f"GPUs (FSDP, {node} per node)"),
        ("calltime_vs_width.png", [d for d, _ in WIDTHS.values()], widths, "model width d"),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name, ys in series.items():
            style = "--" if name in UNBATCHED.values() else "-"
            ax.plot(xs, [y * 1e3 for y in ys], style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("predicted ms per optimizer call")
        if "world" in fname:
            for name, value in PAPER_XL_32_H100_MS.items():
                ax.plot([XL_WORLD], [value], "k*", markersize=10)
                ax.annotate(
                    f"paper: {name}",
                    (XL_WORLD, value),
                    textcoords="offset points",
                    xytext=(6, 4),
                    fontsize=8,
                )
            ax.set_title(f"GPT-2 XL under FSDP, H100 model (stars: paper, {XL_WORLD} GPUs)")
        else:
            ax.set_xticks(xs, [str(x) for x in xs], rotation=45)
            ax.set_title(f"{XL_WORLD} GPUs, FSDP, H100 model (layers per model as in the table)")
        ax.grid(True, which="both", lw=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        files.append(fname)
    return files
