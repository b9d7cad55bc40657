"""Section (g) of STUDY.md, from the numbers of `bench.study.moe.analyse_moe`: the mixture
of experts' tuned lrs and seeds beside the dense ones of (a) or (f), both orderings, each
pair's difference against the seed noise, and the lr sweeps' plot."""

import math
from pathlib import Path

from bench.compare import spell_options
from bench.study.format import NOISE, fmt_loss, in_words
from bench.study.stats import NOISE_FACTOR


def _stats(s: dict) -> str:
    """Seed statistics as ``mean ± std``."""
    return f"{fmt_loss(s['mean'])} ± {s['std']:.4f}"


def _pair(p: dict) -> str:
    """A difference of means against its seed noise."""
    verdict = "beyond" if p["exceeds"] else "within"
    return (
        f"{p['diff']:+.4f} ({NOISE} pooled std {NOISE_FACTOR * p['pooled_std']:.4f}, Welch t "
        f"{p['welch_t']:.2f}: {verdict} the noise)"
    )


def _labels(report: dict) -> dict[str, str]:
    """Each row's name (the orderings' and pairs' key) -> its label."""
    return {r["name"]: r["label"] for r in report["rows"]}


def _ranking(report: dict, key: str) -> str:
    """The rows of ``report[key]`` (an ordering) by label, with their mean losses."""
    means = {
        r["name"]: (r["seeds"] if key == "order" else r["dense"]["seeds"])["mean"]
        for r in report["rows"]
    }
    labels = _labels(report)
    return " < ".join(f"{labels[n]} ({fmt_loss(means[n])})" for n in report[key])


def _parts(report: dict, one: str) -> str:
    """Which part of the study the rows' dense numbers (and grid centres) come from: ``one``
    with the part in it where all rows share it (``one.format("(a)")``), else each part
    with its rows: " (AdamW and Muon: (a); Dobb, recommended: (f) at width 128)"."""
    parts: dict[str, list[str]] = {}
    for r in report["rows"]:
        parts.setdefault(r["dense"]["source"], []).append(r["label"])
    if len(parts) == 1:
        return one.format(next(iter(parts)))
    return " (" + "; ".join(f"{' and '.join(k)}: {part}" for part, k in parts.items()) + ")"


def swaps(report: dict) -> list[str]:
    """Each pair that the experts put in the other order than dense (its difference of means
    changes sign), and whether that difference exceeds the seed noise in each setting."""
    labels, found = _labels(report), []
    for p in report["pairs"]:
        if (p["moe"]["diff"] > 0) != (p["dense"]["diff"] > 0):
            moe, dense = ("beyond" if p[k]["exceeds"] else "within" for k in ("moe", "dense"))
            noise = (
                f"{moe} the seed noise with experts and dense"
                if moe == dense
                else f"{moe} the seed noise with experts, {dense} it dense"
            )
            found.append(f"{labels[p['a']]} and {labels[p['b']]} swap places, {noise}")
    return found


def ordering_sentence(report: dict) -> str:
    """Whether the dense ordering holds with experts (the pairs that swap, against the seed
    noise), both rankings spelled out (no closing full stop)."""
    verdict = "holds" if report["holds"] else "does not hold"
    swapped = swaps(report)
    verdict += f" ({'; '.join(swapped)})" if swapped else ""
    return (
        f"Mixture of experts ({report['n_experts']} experts, top {report['expert_top_k']}, "
        f"width {report['n_embd']}): the dense ordering {verdict}. With experts: "
        f"{_ranking(report, 'order')}; dense{_parts(report, ', {}')}: "
        f"{_ranking(report, 'dense_order')}"
    )


def pair_sentence(report: dict, pair: dict) -> str:
    """One pair's difference of means with experts and dense."""
    labels = _labels(report)
    a, b = labels[pair["a"]], labels[pair["b"]]
    return f"{a} - {b}: with experts {_pair(pair['moe'])}; dense {_pair(pair['dense'])}."


def moe_findings(report: dict) -> list[str]:
    """The summary of (g) for "What the data show"."""
    return [
        f"(g) {ordering_sentence(report)}.",
        *[f"(g) {pair_sentence(report, p)}" for p in report["pairs"]],
    ]


def plot_moe(out: Path, report: dict) -> str:
    """Final val loss against lr: each row with experts (solid) and dense, (a) or (f)
    (dashed), in one colour."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for i, row in enumerate(report["rows"]):
        colour = f"C{i}"
        for lrs, losses, style, kind in (
            (row["lrs"], row["losses"], "o-", "experts"),
            (row["dense"]["lrs"], row["dense"]["losses"], "s--", "dense"),
        ):
            finite = [x if math.isfinite(x) else math.nan for x in losses]
            ax.plot(lrs, finite, style, color=colour, label=f"{row['label']}, {kind}")
    ax.set_xscale("log")
    ax.set_xlabel("lr (hidden matrices; all parameters for AdamW)")
    ax.set_ylabel("final val loss (seed 0)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out / "moe.png", dpi=100)
    return "moe.png"


def _options(row: dict) -> str:
    """A row's options; the lab's name first where the row is named otherwise (an entry of
    (f): "dobb_sign: row_blocks=None, ...")."""
    text = spell_options(row["options"])
    return text if row["name"] == row["optimizer"] else f"{row['optimizer']}: {text}"


def moe_section(report: dict, spec: dict, info: dict, out: Path, link, table) -> list[str]:
    """The lines of section (g); ``info``: the study's header numbers (the dense model's
    parameter count)."""
    plot = plot_moe(out, report)
    rows = report["rows"]
    k, hidden = report["expert_top_k"], report["expert_hidden"]
    seeds = spec["moe_seeds"]
    return [
        "## (g) Mixture of experts",
        "",
        f"The GPT of (a) ({report['n_layer']} layers, n_embd {report['n_embd']}) with each "
        f"block's MLP a mixture of {report['n_experts']} experts, each token routed to its top "
        f"{k} by a linear router (`dobb.train.model.MoE`): scores a softmax over the chosen "
        f"{k}, each expert's hidden width {hidden} ({k} x {hidden} = {k * hidden} per token "
        f"against the dense MLP's {report['dense_hidden']}), no capacity limit, the Switch "
        f"load-balancing loss x {report['router_aux_loss_coef']:g} added to the training "
        f"loss (validation: cross-entropy only); {rows[0]['num_params']:,} parameters "
        f"against the dense {info['num_params']:,}. The expert stacks are stepped with the "
        "hidden matrices (each expert its own matrix, `dobb.optim.experts`), the router as a "
        f"hidden `nn.Linear`. Each row runs its own lr grid, {spec['moe_lr_factors']} x "
        f"its tuned lr of the dense model{_parts(report, ' of {}')}, extended by one point at "
        f"a time (up to {spec['moe_max_extensions']}) while the best lr sits at an edge; "
        f"{in_words(seeds)} seeds at the best lr (seed 0 is the sweep's own run). Beside it "
        "the dense model's numbers of the same part: its tuned lr and seeds. Tokens/s: the "
        "seeds' mean training "
        "throughput as they ran (one torch thread each, on a machine shared with other "
        "work), not a controlled timing.",
        "",
        table(
            "optimizer|options|tuned lr, experts|final val loss, experts (mean ± std)|per seed|"
            "tuned lr, dense|final val loss, dense|experts - dense|tokens/s, experts|"
            "tokens/s, dense",
            [
                f"{r['label']}|{_options(r)}|{r['best_lr']:.4g}"
                + ("; at the grid's edge" if r["at_edge"] else "")
                + f"|{_stats(r['seeds'])}|{', '.join(map(fmt_loss, r['seeds']['losses']))}|"
                f"{r['dense']['lr']:.4g}|{_stats(r['dense']['seeds'])} "
                f"({r['dense']['source']}, {in_words(r['dense']['seeds']['n'])} seeds)|"
                f"{r['seeds']['mean'] - r['dense']['seeds']['mean']:+.4f}|"
                f"{r['seeds']['tokens_per_s']:,.0f}|{r['dense']['seeds']['tokens_per_s']:,.0f}"
                for r in rows
            ],
        ),
        "",
        f"- {ordering_sentence(report)}.",
        *[f"- {pair_sentence(report, p)}" for p in report["pairs"]],
        "",
        "Learning-rate sweeps with experts (final val loss, seed 0):",
        "",
        table(
            "optimizer|lr|final val loss|best",
            [
                f"{r['label']}|{lr:.4g}|{fmt_loss(loss)}|{'yes' if lr == r['best_lr'] else ''}"
                for r in rows
                for lr, loss in zip(r["lrs"], r["losses"])
            ],
        ),
        "",
        f"![final loss against lr, experts and dense]({link(plot)})",
    ]
