"""The study's "What the data show": plain-language statements, each computed from the
numbers of `bench.study.analysis`."""

import math
from typing import Any

from bench.study.analysis import BASELINES, check_key
from bench.study.format import NOISE, fmt_loss, label, title
from bench.study.gap_report import gap_findings
from bench.study.moe_report import moe_findings
from bench.study.runs import base_alpha, is_one_column
from bench.study.shards_report import many_shards_findings
from bench.study.stats import NOISE_FACTOR
from bench.study.tuning_report import tuning_findings
from dobb.registry import get_entry

SAME_LR_ONLY = 1e-4  # a numeric update_scale's loss difference below this: it only moves the lr


def findings(report: dict[str, Any]) -> list[str]:
    """Plain-language statements, each computed from the report's numbers."""
    return [
        *_comparison_findings(report),
        *_ablation_findings(report, "dobb_paper"),
        *_signum_findings(report),
        *_check_findings(report),
        *_width_findings(report),
        *_ablation_findings(report, "muonbp"),
        *(gap_findings(report["gap"]) if "gap" in report else []),
        *(tuning_findings(report["tuning"]) if "tuning" in report else []),
        *(many_shards_findings(report["many_shards"]) if "many_shards" in report else []),
        *(moe_findings(report["moe"]) if "moe" in report else []),
        *_scope_findings(report),
    ]


def _comparison_findings(report: dict[str, Any]) -> list[str]:
    seeds, pairs = report["seeds"], report["pairs"]
    order = sorted(seeds, key=lambda n: seeds[n]["mean"])
    lines = [
        f"**{order[0]} has the lowest mean final validation loss** at this budget "
        f"({fmt_loss(seeds[order[0]]['mean'])} over {seeds[order[0]]['n']} seeds). Ranking: "
        + " < ".join(f"{n} ({fmt_loss(seeds[n]['mean'])})" for n in order)
        + "."
    ]
    for other, p in pairs.items():
        if not p["exceeds"]:
            verdict = "within the seed noise: no winner between the two at this budget"
        elif p["diff"] < 0:
            verdict = f"**Dobb beats {other}** beyond the seed noise"
        else:
            verdict = f"**{other} beats Dobb** beyond the seed noise: Dobb does not win here"
        lines.append(
            f"Dobb vs {other}: Dobb's mean is {'lower' if p['diff'] < 0 else 'higher'} by "
            f"{abs(p['diff']):.4f} ({NOISE} pooled seed std "
            f"{NOISE_FACTOR * p['pooled_std']:.4f}, Welch t {p['welch_t']:.2f}): {verdict}."
        )
    return lines


def _ablation_findings(report: dict[str, Any], name: str) -> list[str]:
    name_title, noise, lines = title(name), report["references"][name]["noise"], []
    rows = [r for r in report["ablations"] if r["optimizer"] == name]
    varied = [r for r in rows if r["option"] != "stats_sync"]
    matter = sorted((r for r in varied if r["exceeds"]), key=lambda r: -abs(_delta(r)))
    within = [r for r in varied if not r["exceeds"]]
    text = (
        f"{name_title} ablations, each against {name_title}'s seed-0 run at its tuned lr "
        f"(threshold: {NOISE} {name_title}'s seed std = {noise:.4f}): "
    )
    if matter:
        text += "beyond the noise: " + ", ".join(f"{label(r)} {_delta(r):+.4f}" for r in matter)
    else:
        text += "no change moves the loss beyond the seed noise"
    if within:
        text += "; within the noise: " + ", ".join(label(r) for r in within)
    lines.append(text + ".")
    better = [r for r in matter if _delta(r) < 0]
    if better:
        lines.append(
            f"Better than {name_title}'s default beyond the noise: "
            + ", ".join(f"{label(r)} ({_delta(r):+.4f})" for r in better)
            + "; the default ("
            + ", ".join(sorted({f"{r['option']}={r['default']}" for r in better}))
            + ") is not the best setting at this budget."
        )
    return lines


def _delta(row: dict[str, Any]) -> float:
    """An ablation's loss difference: of seed means where it has seeds, else of seed 0."""
    return row["seeds"]["pair"]["diff"] if row.get("seeds") else row["delta"]


def _signum_findings(report: dict[str, Any]) -> list[str]:
    """Dobb with blocks of one column (Signum) against Dobb."""
    lines = []
    for r in report["ablations"]:
        if is_one_column(r, report["width"]):
            effect = (
                "within the noise: the block eigenbases do not help measurably here"
                if not r["exceeds"]
                else "the block eigenbases help"
                if r["delta"] > 0
                else "the block eigenbases hurt"
            )
            lines.append(
                f"Signum (block size 1, each at its best lr) vs Dobb: {r['delta']:+.4f}: {effect}."
            )
    return lines


def _same(d: float) -> str:
    return "identical loss curves" if d == 0 else f"largest loss difference {d:.3g}"


def _check_findings(report: dict[str, Any]) -> list[str]:
    """The same-math checks: each ablation that only takes another route to Dobb's math,
    and block size 1 against the identity basis."""
    checks, lines = report["checks"], []
    for r in report["ablations"]:
        d = checks.get(check_key(r))
        if d is None:
            continue
        if r["option"] == "stats_sync":
            lines.append(
                f"stats_sync={r['value']!r} vs {r['default']!r} on one process (the same math; "
                "it differs only in communication, so this is a check, not an ablation): "
                f"{_same(d)}."
            )
        elif r["option"] == "update_scale":
            alpha = r["value"]
            lines.append(
                f"update_scale={alpha} at lr x {base_alpha()}/{alpha} vs Dobb at its lr: "
                + _same(d)
                + (
                    ": a numeric update_scale only rescales the hidden matrices' lr, so it moves "
                    "the best lr, not the best loss."
                    if d < SAME_LR_ONLY
                    else "."
                )
            )
    if "signum" in checks:
        lines.append(
            "Block size 1 and the identity basis (both Signum) at the same lr: "
            f"{_same(checks['signum'])}."
        )
    return lines


def _width_findings(report: dict[str, Any]) -> list[str]:
    widths, lines = report["widths"], []
    gaps = ", ".join(f"n_embd {r['n_embd']}: {r['gap']:+.4f}" for r in widths)
    lines.append(
        f"Dobb - Dion gap in final val loss (negative: Dobb lower) at {gaps}; noise {NOISE} "
        f"pooled seed std at n_embd {report['width']} = {report['width_noise']:.4f}, one seed "
        "per width."
    )
    first, last = widths[0], widths[-1]
    change = last["gap"] - first["gap"]
    if not math.isfinite(change) or abs(change) <= report["width_noise"]:
        trend = f"No trend beyond the noise from n_embd {first['n_embd']} to {last['n_embd']}"
    elif change < 0:
        trend = f"Dobb gains on Dion as the width grows ({first['gap']:+.4f} -> {last['gap']:+.4f})"
    else:
        trend = (
            f"Dobb loses ground to Dion as the width grows ({first['gap']:+.4f} -> "
            f"{last['gap']:+.4f})"
        )
    behind = [str(r["n_embd"]) for r in widths if r["exceeds"] and r["gap"] > 0]
    ahead = [str(r["n_embd"]) for r in widths if r["exceeds"] and r["gap"] < 0]
    trend += f"; Dobb ahead beyond noise at n_embd {', '.join(ahead) or 'none'}"
    lines.append(trend + f", behind at {', '.join(behind) or 'none'}.")
    return lines


def _scope_findings(report: dict[str, Any]) -> list[str]:
    lines, rows, widths = [], report["ablations"], report["widths"]
    edges = [f"{n} (a)" for n, e in report["sweep_edge"].items() if e]
    edges += [label(r) for r in rows if r["at_edge"]]
    edges += [f"{n} at n_embd {r['n_embd']}" for r in widths for n in r["at_edge"]]
    lines.append(
        "Best lr still at the edge of its grid after the extensions (its optimum may lie "
        f"beyond, so its loss is an upper bound): {', '.join(edges)}."
        if edges
        else "Every best lr lies inside its grid."
    )
    if report["compute"]["diverged"]:
        lines.append(
            f"Diverged runs (counted as worst): {', '.join(report['compute']['diverged'])}."
        )
    budget = report["budget"]
    tokens = budget["steps"] * budget["batch_size"] * budget["block_size"]
    scalar = sorted({get_entry(n).scalar_lr for n in BASELINES + ("dobb_paper",)} - {None})
    lines.append(
        f"Scope: one {report['info']['num_params']:,}-parameter byte-level GPT, {tokens:,} "
        "tokens per run, one process per run on CPU. Only the hidden-matrix lr is tuned: the "
        f"embedding/head/norm lr of Dobb, Dion and Muon stays at the registry's "
        f"{', '.join(f'{s:g}' for s in scalar)} (AdamW's one lr covers all parameters). The "
        "paper's numbers are for GPT-2 XL; this budget says nothing about that scale."
    )
    return lines
