"""Section (f) of STUDY.md, from the numbers of `bench.study.tuning.analyse_tuning`: the
tuned-lr sentences, the lr-vs-width plot and the tuned width table."""

import math
from pathlib import Path

from bench.study.format import NOISE, fmt_loss, in_words
from bench.study.gap import GOAL_GAP, GOAL_WIDTHS
from bench.study.stats import NOISE_FACTOR
from dobb.optim.dobb import BLOCK_WIDTH


def _lr(x: float) -> str:
    return f"{x:.4g}"


def tuned_sentence(row: dict, entry: dict) -> str:
    """``width W: NAME tuned lr X (grid a, b, c, d)``, and whether X sits at an edge."""
    grid = ", ".join(map(_lr, entry["lrs"]))
    edge = "; at the grid's edge" if entry["at_edge"] else ""
    name, lr = row["label"], _lr(entry["best_lr"])
    return f"width {entry['n_embd']}: {name} tuned lr {lr} (grid {grid}){edge}"


def best_local_sentence(b: dict) -> str:
    """``width W: best shard-local: NAME MEAN vs Muon MEAN (gap X)``, against the seed noise
    where both have seeds."""
    p = b["noise"]
    if p is None:
        noise = "one seed of either: no noise estimate"
    else:
        verdict = "beyond" if p["exceeds"] else "within"
        noise = f"{NOISE} pooled seed std {NOISE_FACTOR * p['pooled_std']:.4f}: {verdict} the noise"
    return (
        f"width {b['n_embd']}: best shard-local: {b['label']} {fmt_loss(b['mean'])} vs Muon "
        f"{fmt_loss(b['muon'])} (gap {b['gap']:+.4f}); {noise}"
    )


def tuning_findings(report: dict) -> list[str]:
    """The summary of (f): the best shard-local update against Muon per width, each tuned
    there, and the goal on these tuned gaps."""
    best = report["best_local"]
    close = [b["n_embd"] for b in best if b["gap"] <= GOAL_GAP]
    goal = "met" if len(close) >= GOAL_WIDTHS else "not met"
    return [
        *[f"Each tuned at its width (f), {best_local_sentence(b)}" for b in best],
        f"Goal on the tuned gaps (a shard-local update within {GOAL_GAP:g} of Muon at "
        f"{in_words(GOAL_WIDTHS)} widths, or better): {goal}; within {GOAL_GAP:g} at width "
        f"{', '.join(map(str, close)) or 'none'}.",
        *[f"(f) {variant_sentence(rows)}" for rows in _by_variant(report["variants"])],
        *_rule_findings(report),
    ]


def _rule_findings(report: dict) -> list[str]:
    """The width rule in the summary: what keeping the narrower width's tuned lr, and the
    default lr, cost at each width, and each width where the library's layout differs."""
    checks = report.get("rule_checks") or []
    if not checks:
        return []
    label = checks[0]["label"]
    row = next(r for r in report["rows"] if r["label"] == label)
    kept = ", ".join(
        f"{m['from']} to {m['to']} {m['cost']:+.4f}" for m in row["moves"] if m["cost"] is not None
    )
    default = ", ".join(
        f"{c['default_cost']:+.4f} at width {c['n_embd']}"
        for c in checks
        if c["default_cost"] is not None
    )
    lines = [
        f"(f) {label}: keeping the narrower width's tuned lr costs {kept}; the default lr "
        f"{_lr(checks[0]['default_lr'])} costs {default} against the tuned one."
    ]
    lines += [
        f"(f) At width {c['n_embd']}, `{c['entry']}` (the library's defaults) against the run "
        f"read for it: {_rule_outcome(c)}."
        for c in checks
        if not c["same_blocks"]
    ]
    return lines


def _by_variant(rows: list[dict]) -> list[list[dict]]:
    """The rows of ``analyse_tuning``'s variants grouped by variant, in report order."""
    labels = dict.fromkeys(r["label"] for r in rows)
    return [[r for r in rows if r["label"] == label] for label in labels]


def variant_sentence(rows: list[dict]) -> str:
    """``VARIANT vs CONFIGURATION at its tuned lrs: width W: Δ of means X (2 pooled std Y,
    Welch t Z): within the noise; ...``, one clause per width."""
    clauses = [
        f"width {r['n_embd']}: Δ of means {r['pair']['diff']:+.4f} ({NOISE} pooled std "
        f"{NOISE_FACTOR * r['pair']['pooled_std']:.4f}, Welch t {r['pair']['welch_t']:.2f}): "
        f"{'beyond' if r['pair']['exceeds'] else 'within'} the noise"
        for r in rows
    ]
    first = rows[0]
    return f"{first['label']} vs {first['of']} at its tuned lrs: " + "; ".join(clauses) + "."


def _variant_lines(variants: list[dict], table) -> list[str]:
    """The variants of (f), each width a row (nothing if there are none)."""
    if not variants:
        return []

    def stats(s: dict) -> str:
        losses = ", ".join(map(fmt_loss, s["losses"]))
        return f"{fmt_loss(s['mean'])} ± {s['std']:.4f} ({losses})"

    return [
        "",
        "Variants: a configuration with one change, at its tuned lr and seeds of each width "
        f"(mean ± std (per seed)); beyond noise: |Δ of means| > {NOISE} pooled std:",
        "",
        table(
            "variant|width|lr|variant's loss|configuration|configuration's loss|Δ of means|"
            f"{NOISE} pooled std|Welch t|beyond noise",
            [
                f"{r['label']}|{r['n_embd']}|{_lr(r['lr'])}|{stats(r['seeds'])}|{r['of']}|"
                f"{stats(r['reference'])}|{r['pair']['diff']:+.4f}|"
                f"{NOISE_FACTOR * r['pair']['pooled_std']:.4f}|{r['pair']['welch_t']:.2f}|"
                f"{'yes' if r['pair']['exceeds'] else 'no'}"
                for r in variants
            ],
        ),
        "",
        *[f"- {variant_sentence(rows)}" for rows in _by_variant(variants)],
    ]


def transfer_sentence(row: dict) -> str:
    """Whether the configuration's tuned lr stayed put from each width to the next."""
    parts = []
    for m in row["moves"]:
        cost = "" if m["cost"] is None else f"; keeping it costs {m['cost']:+.4f} in loss"
        verb = "stays put" if m["transfers"] else f"moves x{m['ratio']:.3g}"
        parts.append(f"from width {m['from']} to {m['to']} the tuned lr {verb}{cost}")
    return f"{row['label']}: " + ("; ".join(parts) if parts else "tuned at one width only")


def _rule_lines(checks: list[dict]) -> list[str]:
    """The width rule's reading checked at each width, and its default lr's cost there."""
    if not checks:
        return []
    lines = [
        "",
        f"{checks[0]['label']}: its update is scaled by 256/width, so its lr x at "
        "width w trains as x * 256/w does with the scale fixed at 1 (weight decay 0; the "
        "narrowest input of every hidden matrix is the width); its grids read that "
        f"configuration's runs so, and one run of `{checks[0]['entry']}` itself (the library's "
        "default) at each tuned lr checks it:",
        "",
    ]
    for c in checks:
        lines.append(
            f"- width {c['n_embd']}: `{c['entry']}` at lr {_lr(c['lr'])} against the scale-1 "
            f"run at lr {_lr(c['run_lr'])}: {_rule_outcome(c)}{_default_cost(c)}"
        )
    return lines


def _rule_outcome(c: dict) -> str:
    """What one check of the width rule found."""
    if not c["same_blocks"]:  # another layout: a measurement, not a check
        return (
            f"not the same computation: the library cuts the {c['widest_input']:,}-column "
            f"inputs into blocks of at most {BLOCK_WIDTH:,} where the read configuration keeps "
            f"one block; final val loss {fmt_loss(c['loss'])} against "
            f"{fmt_loss(c['read_loss'])} ({c['loss'] - c['read_loss']:+.4f}, one seed)"
        )
    if c["difference"] == 0:
        return "the same final losses"
    return f"final losses differ by up to {c['difference']:.3g}"


def _default_cost(c: dict) -> str:
    if c["default_cost"] is None:
        return ""
    return f"; the default lr {_lr(c['default_lr'])} costs {c['default_cost']:+.4f} there"


def plot_tuning(out: Path, report: dict) -> str:
    """Final val loss against lr, a panel per configuration, a curve per width."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    rows = report["rows"]
    cols = 4
    fig = Figure(figsize=(4 * cols, 3 * -(-len(rows) // cols)), layout="constrained")
    axes = fig.subplots(-(-len(rows) // cols), cols, squeeze=False).ravel()
    for ax, row in zip(axes, rows):
        for e in row["widths"]:
            losses = [x if math.isfinite(x) else math.nan for x in e["losses"]]
            ax.plot(e["lrs"], losses, "o-", label=f"width {e['n_embd']}")
        ax.set_xscale("log")
        ticks = sorted({lr for e in row["widths"] for lr in e["lrs"]})
        ax.set_xticks(ticks, [_lr(x) for x in ticks], fontsize=7, rotation=45)
        ax.xaxis.set_minor_locator(NullLocator())  # the grid's lrs are the ticks
        ax.set_title(row["label"], fontsize=9)
        ax.set_xlabel("lr")
        ax.set_ylabel("final val loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[len(rows) :]:
        ax.set_visible(False)
    fig.savefig(out / "tuning.png", dpi=100)
    return "tuning.png"


def plot_front(out: Path, report: dict) -> str:
    """The front page's figure (README): each marked configuration's final val loss at its
    tuned lr against the width, the mean of its seeds with their standard deviation."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for row in (r for r in report["rows"] if r.get("front")):
        seeded = [e for e in row["widths"] if e["seeds"]["n"] > 1]
        widths = [e["n_embd"] for e in seeded]
        means = [e["seeds"]["mean"] for e in seeded]
        spread = [e["seeds"]["std"] for e in seeded]
        ax.errorbar(widths, means, yerr=spread, marker="o", capsize=3, label=row["front"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(report["widths"], [str(w) for w in report["widths"]])
    ax.set_xlabel("width (n_embd), 4 layers, 409,600 tokens")
    ax.set_ylabel("final val loss, tuned lr (seeds: mean, std)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out / "front.png", dpi=120)
    return "front.png"


def tuning_section(report: dict, spec: dict, out: Path, link, table) -> list[str]:
    """The lines of section (f)."""
    rows, widths = report["rows"], report["widths"]
    seeds = spec["tuning_seeds"]
    plot = plot_tuning(out, report)
    front = plot_front(out, report)
    return [
        "## (f) Every optimizer tuned at every width",
        "",
        f"Each configuration runs its own grid at each width: {spec['tuning_lr_factors']} x "
        "(a)'s tuned lr of its optimizer at the first width, x its own tuned lr of the "
        "previous width at the next, extended by one point at a time (up to "
        f"{spec['tuning_max_extensions']}) while the best lr sits at an edge; then "
        f"{in_words(seeds)} seeds at each tuned lr of widths {spec['tuning_widths']} (seed 0 "
        f"is the sweep's own run{_wide_seeds(spec['tuning_wide_seeded'])}). "
        "Runs whose settings equal another part's are that part's runs.",
        "",
        *[f"- {tuned_sentence(r, e)}" for r in rows for e in r["widths"]],
        "",
        "Does the tuned lr transfer across width? (Keeping it: the loss at the wider width with "
        "the narrower width's tuned lr minus the tuned loss there.)",
        "",
        *[f"- {transfer_sentence(r)}" for r in rows],
        *_rule_lines(report["rule_checks"]),
        "",
        f"![final loss against lr, one curve per width]({link(plot)})",
        "",
        "The front page's figure: the final loss at each tuned lr against the width, for "
        "the configurations it names (mean and standard deviation of the seeds):",
        "",
        f"![final loss against width]({link(front)})",
        "",
        f"Tuned at each width (mean ± std over {in_words(seeds)} seeds at the tuned lr):",
        "",
        table(
            "configuration|shard-local|" + "|".join(f"width {w}" for w in widths),
            [
                f"{r['label']}|{'yes' if r['shard_local'] else 'no'}|"
                + "|".join(_cell(r, w) for w in widths)
                for r in rows
            ],
        ),
        "",
        *[f"- {best_local_sentence(b)}" for b in report["best_local"]],
        *_variant_lines(report["variants"], table),
        *_shard_lines(report["shards"], table),
    ]


def _shard_lines(shards: dict, table) -> list[str]:
    """The row-shard trend at the tuned lrs (nothing if it was not run)."""
    if not shards["rows"]:
        return []
    names = list(shards["rows"][0]["losses"])
    return [
        "",
        f"Row shards at width {shards['n_embd']} (seed 0, each at its tuned lr there; "
        "the configurations without row blocks do not depend on the count: "
        + ", ".join(f"{k} {fmt_loss(v)}" for k, v in shards["flat"].items())
        + "):",
        "",
        table(
            "row shards|" + "|".join(names) + "|best shard-local",
            [
                f"{r['row_shards']}|"
                + "|".join(fmt_loss(r["losses"][k]) for k in names)
                + f"|{r['best_local']} {fmt_loss(r['best'])}"
                for r in shards["rows"]
            ],
        ),
    ]


def _wide_seeds(k: int) -> str:
    """Which tuned lrs of the wider widths are seeded too."""
    if k == 0:
        return "; wider widths keep that one seed"
    best = "best shard-local configuration" if k == 1 else f"{in_words(k)} best shard-local ones"
    return f"; at wider widths those of Muon and the {best}, the others keep that one seed"


def _cell(row: dict, width: int) -> str:
    entry = next((e for e in row["widths"] if e["n_embd"] == width), None)
    if entry is None:
        return "-"
    s, lr = entry["seeds"], _lr(entry["best_lr"])
    if s["n"] == 1:
        return f"{fmt_loss(s['mean'])} (lr {lr}, one seed)"
    return f"{fmt_loss(s['mean'])} ± {s['std']:.4f} (lr {lr})"
