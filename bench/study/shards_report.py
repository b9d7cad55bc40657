"""The recommended Dobb at many row shards in STUDY.md (f), from the numbers of
`bench.study.shards.analyse_many_shards`: its table, and the summary's sentences (how far
from Muon at each count, whether the lr moves, whether rotating the rows still pays)."""

from bench.study.format import NOISE, fmt_loss, in_words
from bench.study.gap import GOAL_GAP
from bench.study.stats import NOISE_FACTOR


def many_shards_lines(report: dict, table) -> list[str]:
    """The table: per width and row-shard count, the recommended Dobb's seeds at its tuned
    lr, its lr grid where retuned, Muon's seeds, the gap, and the best configuration of (f)
    with no row blocks (nothing if this part was not run)."""
    rows = report["rows"]
    if not rows:
        return []
    return [
        "",
        f"{report['label']} at many row shards (FSDP's rows per rank; `row_blocks=P` "
        "emulates P ranks in one process): at each width its tuned lr of (f), seeds where "
        "shown, its lr retuned where a grid is shown; Muon (whole matrices) and the "
        "configurations with no row blocks (one-sided) do not depend on the count. Fewest "
        "rows per rank: the narrowest matrix's (d_out = the width) over the count.",
        "",
        table(
            "width|row shards|fewest rows per rank|loss (mean ± std (n))|lr grid: loss|"
            f"best lr|Muon|gap to Muon|{NOISE} pooled std|best with no row blocks",
            [_row(r) for r in rows],
        ),
    ]


def _row(r: dict) -> str:
    s, p = r["seeds"], r["noise"]
    grid = ", ".join(f"{lr:.4g}: {fmt_loss(x)}" for lr, x in zip(r["lrs"], r["losses"]))
    noise = "-" if p is None else f"{NOISE_FACTOR * p['pooled_std']:.4f}"
    side = "-" if r["one_sided"] is None else f"{r['one_sided']} {fmt_loss(r['one_sided_loss'])}"
    return (
        f"{r['n_embd']}|{r['row_shards']}|{r['n_embd'] // r['row_shards']}|{_seeds(s)}|"
        f"{grid if len(r['lrs']) > 1 else '-'}|{r['best_lr']:.4g}|{_seeds(r['muon'])}|"
        f"{r['gap']:+.4f}|{noise}|{side}"
    )


def _seeds(s: dict) -> str:
    if s["n"] == 1:
        return f"{fmt_loss(s['mean'])} (one seed)"
    return f"{fmt_loss(s['mean'])} ± {s['std']:.4f} ({s['n']})"


def many_shards_findings(report: dict) -> list[str]:
    """Per width: the counts within ``GOAL_GAP`` of Muon (or better), the gap at the
    largest count, where the retuned lr moved, and whether two-sided still beats the best
    one-sided configuration at every count (the default's rule)."""
    lines = []
    for w in sorted({r["n_embd"] for r in report["rows"]}):
        rows = [r for r in report["rows"] if r["n_embd"] == w]
        close = [r["row_shards"] for r in rows if r["gap"] <= GOAL_GAP]
        last = rows[-1]
        moved = [r for r in rows if len(r["lrs"]) > 1 and r["best_lr"] != r["tuned_lr"]]
        retuned = [r for r in rows if len(r["lrs"]) > 1]
        ahead = [r for r in rows if r["one_sided_loss"] is not None]
        lines.append(
            f"(f) {report['label']} at width {w} over "
            f"{', '.join(str(r['row_shards']) for r in rows)} row shards: within "
            f"{GOAL_GAP:g} of Muon or better at "
            + (f"{', '.join(map(str, close))} row shards" if close else "no count")
            + f"; at {last['row_shards']} ({w // last['row_shards']} rows per rank in the "
            f"narrowest matrix) {fmt_loss(last['seeds']['mean'])} against Muon's "
            f"{fmt_loss(last['muon']['mean'])} ({last['gap']:+.4f})"
            + _lr_clause(retuned, moved)
            + _side_clause(ahead)
            + "."
        )
    return lines


def _lr_clause(retuned: list[dict], moved: list[dict]) -> str:
    if not retuned:
        return ""
    counts = ", ".join(str(r["row_shards"]) for r in retuned)
    if not moved:
        return f"; retuned at {counts} row shards, the best lr stays put"
    gains = "; ".join(
        f"at {r['row_shards']} the best lr {r['best_lr']:.4g} (x{r['best_lr'] / r['tuned_lr']:g}) "
        f"gains {r['losses'][r['lrs'].index(r['tuned_lr'])] - min(r['losses']):.4f}"
        for r in moved
    )
    return f"; retuned at {counts} row shards: {gains}"


def _side_clause(rows: list[dict]) -> str:
    if not rows:
        return ""
    behind = [r["row_shards"] for r in rows if r["seeds"]["mean"] > r["one_sided_loss"]]
    best = rows[0]["one_sided"]
    if not behind:
        return (
            f"; ahead of the best configuration with no row blocks ({best}, "
            f"{fmt_loss(rows[0]['one_sided_loss'])}) at all {in_words(len(rows))} counts, so "
            "rotating the rows pays at every count measured"
        )
    return (
        f"; behind the best configuration with no row blocks ({best}, "
        f"{fmt_loss(rows[0]['one_sided_loss'])}) from {min(behind)} row shards on"
    )
