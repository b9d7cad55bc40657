"""Part (e)'s section of STUDY.md: the variant, row-shard and width tables, the row-shards
plot and the findings, from the numbers of `bench.study.gap.analyse_gap`."""

from pathlib import Path

from bench.compare import OPTIONS
from bench.optimizers import lab_entry
from bench.study.format import fmt_loss, in_words, times
from bench.study.gap import (
    GOAL_GAP,
    GOAL_WIDTHS,
    REFERENCE,
    REFERENCE_OPTIMIZERS,
    ROW_SHARDS,
    SHARD_TREND,
    TP_DEGREE,
    UNBLOCKED,
    WIDTH_TREND,
)


def _name(report: dict, key: str) -> str:
    """How the section names a trend's line: the lab's label, or the best variant's."""
    return report["top_label"] if key == "top" else lab_entry(key).label


def gap_findings(report: dict) -> list[str]:
    """One sentence per width, the shard-count crossings and the goal, all computed."""
    lines = []
    for entry in report["widths"]:
        losses = entry["losses"]
        lines.append(
            f"At (a)'s lrs (untuned), n_embd {entry['n_embd']}: best shard-local: "
            f"{_name(report, entry['best_local'])} "
            f"{losses[entry['best_local']]:.4f} vs Muon {losses[REFERENCE]:.4f} "
            f"(gap {entry['gap']:+.3f})"
        )
    close = [e["n_embd"] for e in report["widths"] if e["gap"] <= GOAL_GAP]
    goal = "met" if len(close) >= GOAL_WIDTHS else "not met"
    lines.append(
        f"Goal at (a)'s lrs (a shard-local update within {GOAL_GAP:g} of Muon at "
        f"{in_words(GOAL_WIDTHS)} widths, or better): {goal}; within {GOAL_GAP:g} at n_embd "
        f"{', '.join(map(str, close)) or 'none'}."
    )
    flat = report["flat"][UNBLOCKED]
    for name, n in report["crossings"].items():
        where = f"from {n} row shards on" if n else "at none of the shard counts tried"
        lines.append(
            f"{_name(report, name)} is worse than one-sided Dobb ({flat:.4f}, which does not "
            f"depend on the shard count) {where} (n_embd {report['shard_width']})."
        )
    return lines


def plot_shards(out: Path, report: dict) -> str:
    """Final val loss against the number of row shards (row blocks), log2 x axis."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    counts = report["counts"]
    for name, losses in report["shards"].items():
        ax.plot(counts, losses, "o-", label=_name(report, name))
    for name, style in ((UNBLOCKED, "--"), (REFERENCE, ":")):
        ax.axhline(report["flat"][name], linestyle=style, color="black", label=_name(report, name))
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.set_xlabel("row shards (row blocks per matrix)")
    ax.set_ylabel("final validation loss")
    ax.set_title(f"n_embd {report['shard_width']}, one seed, tuned lrs of (a)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(out / "row_shards.png", dpi=120)
    return "row_shards.png"


def _settings(row: dict) -> str:
    items = {**row["settings"], **row["train"]}
    if items.get("block_size"):  # it overrides num_blocks
        items.pop("num_blocks", None)
    return ", ".join(f"{k}={v}" for k, v in items.items() if k != "two_sided") or "-"


def _seed_text(row: dict) -> tuple[str, str, str]:
    stats = row["seeds"]
    if not stats:
        return "-", "-", "-"
    pairs = stats["pairs"]
    return (
        f"{fmt_loss(stats['mean'])} ± {stats['std']:.4f} ({stats['n']})",
        *(f"{pairs[n]['diff']:+.4f} (t {pairs[n]['welch_t']:.1f})" for n in REFERENCE_OPTIMIZERS),
    )


def gap_section(report: dict, spec: dict, out: Path, link, table) -> list[str]:
    """The Markdown of (e); ``spec``: the study's budget (its mini-sweeps)."""
    plot = plot_shards(out, report)
    rows = []
    for r in report["rows"]:
        local = "FSDP, TP" if r["tiles_tp"] else "FSDP" if r["shard_local"] else "no"
        lrs = ", ".join(f"{lr:.4g}" for lr in r["lrs"]) or "(a)"
        best_lr = f"{r['best_lr']:.4g}" if r["best_lr"] else "(a)"
        rows.append(
            f"{r['label']}|{_settings(r)}|{local}|{lrs}|{best_lr}|{fmt_loss(r['loss'])}|"
            + "|".join(_seed_text(r))
        )
    widths = report["widths"]
    keys = [*WIDTH_TREND[:2], "top", *WIDTH_TREND[2:]]
    width_rows = [
        f"{e['n_embd']}|"
        + "|".join(fmt_loss(e["losses"].get(k)) for k in keys)
        + f"|{_name(report, e['best_local'])}|{e['gap']:+.4f}"
        for e in widths
    ]
    counts = report["counts"]
    shard_rows = [
        f"{n}|"
        + "|".join(fmt_loss(report["shards"][name][i]) for name in report["shards"])
        + f"|{fmt_loss(report['flat'][UNBLOCKED])}|{fmt_loss(report['flat'][REFERENCE])}"
        for i, n in enumerate(counts)
    ]
    return [
        "## (e) Closing the gap to Muon without leaving the shard",
        "",
        "Two-sided Dobb (`dobb_sign`, `Dobb(two_sided=True)`) rotates both sides of each tile: "
        "row blocks with eigenbases of their own moments (Shampoo's `G Gᵀ` of the rank's rows "
        "by default) and Dobb's input blocks. In (a) it uses "
        f"{', '.join(f'{k}={v}' for k, v in OPTIONS[SHARD_TREND[0]].items())}. Each variant below "
        "changes the listed settings, runs at "
        f"{'/'.join(f'{f:g}' for f in spec['ablation_lr_factors'])} x its optimizer's tuned lr "
        f"of (a) (extended {times(spec['ablation_max_extensions'])} at an edge), and the best "
        "shard-local ones get more seeds, set against Muon's and BlockMuon's seeds of (a) "
        "(difference of means, Welch t). "
        "Shard-local: no collective inside `step()` besides the statistics average on "
        f"refresh steps at {ROW_SHARDS} row shards (FSDP, column-parallel TP); 'FSDP, TP': the "
        f"input blocks also tile row-parallel TP's column shards over {TP_DEGREE} ranks.",
        "",
        table(
            "variant|settings|shard-local|lrs tried|best lr|final val loss (seed 0)|"
            "seeds: mean ± std (n)|vs Muon|vs BlockMuon",
            rows,
        ),
        "",
        f"### Row shards (n_embd {report['shard_width']}, one seed, tuned lrs of (a))",
        "",
        table(
            "row shards|"
            + "|".join(_name(report, n) for n in report["shards"])
            + "|one-sided Dobb|Muon",
            shard_rows,
        ),
        "",
        f"![final loss against row shards]({link(plot)})",
        "",
        "### Width (one seed per width above the study's; the study's width: seed means; "
        "the widest: Muon, BlockMuon and the best variant only)",
        "",
        table(
            "n_embd|" + "|".join(_name(report, k) for k in keys) + "|best shard-local|gap to Muon",
            width_rows,
        ),
        "",
        *[f"- {line}" for line in gap_findings(report)],
        "",
    ]
