"""The optimizer study's report: turns the logs of the runs of `dobb.bench.study_runs` into
numbers (seed statistics, each
difference set against the seed noise, ablation deltas, the width trend), computed findings,
plots and STUDY.md next to the output folder (plots and `study.json` inside it). Nothing in
the document is typed in by hand: every sentence in "What the data show" is computed.
"""

import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dobb.bench import study_gap
from dobb.bench.study_runs import (
    StudySpec,
    at_edge,
    base_alpha,
    best_run,
    defaults,
    loss_of,
    lr_center,
    round_lr,
)
from dobb.bench.study_stats import NOISE_FACTOR, compare_seeds, seed_stats
from dobb.markdown import markdown_table
from dobb.optim.registry import get_entry
from dobb.train import compare
from dobb.train.compare import OPTIMIZERS, OPTIONS, read_metrics
from dobb.train.config import TrainConfig
from dobb.train.model import gpt_config

BASELINES = tuple(name for name in OPTIMIZERS if name != "dobb")
YES_NO = {True: "yes", False: "no"}


def trace_difference(out: Path, run_a: str, run_b: str) -> float:
    """Largest |difference| between two runs' train and val losses, step by step."""
    a, b = (read_metrics(out / "runs" / r) for r in (run_a, run_b))
    if [r["step"] for r in a] != [r["step"] for r in b]:
        return math.inf
    keys = ("loss", "val_loss")
    return max(abs(x[k] - y[k]) for x, y in zip(a, b) for k in keys if k in x and k in y)


# ---- analysis --------------------------------------------------------------------------


def analyse(spec: StudySpec, base: TrainConfig, out: Path, results: dict) -> dict[str, Any]:
    """The numbers of the report, from the runs' summaries and logs."""
    best_lr, main = results["best_lr"], results["main"]
    seeds = {name: seed_stats(runs) for name, runs in results["seeds"].items()}
    pairs = {name: compare_seeds(seeds["dobb"], seeds[name]) for name in BASELINES}
    references = {  # each ablated optimizer at its tuned lr, seed 0, and its seed noise
        name: {
            "run": results["seeds"][name][0]["run"],
            "loss": loss_of(results["seeds"][name][0]),
            "noise": NOISE_FACTOR * seeds[name]["std"],
        }
        for name in dict.fromkeys(ab.optimizer for ab, _ in results["ablations"])
    }

    rows = []
    for i, (ab, runs) in enumerate(results["ablations"]):
        top = best_run(runs)
        delta = loss_of(top) - references[ab.optimizer]["loss"]
        seeded = results.get("ablation_seeds", {}).get(i)
        if seeded:  # seeds of both sides: the difference of means against the pooled noise
            seeded = seed_stats(seeded)
            seeded["pair"] = compare_seeds(seeded, seeds[ab.optimizer])
        rows.append(
            {
                "optimizer": ab.optimizer,
                "option": ab.option,
                "value": ab.value,
                "default": defaults(ab.optimizer)[ab.option],
                "note": ab.note,
                "lrs": [s["lr"] for s in runs],
                "losses": [loss_of(s) for s in runs],
                "runs": [s["run"] for s in runs],
                "best_lr": top["lr"],
                "loss": loss_of(top),
                "delta": delta,
                "exceeds": seeded["pair"]["exceeds"]
                if seeded
                else bool(abs(delta) > references[ab.optimizer]["noise"]),
                "at_edge": at_edge(runs),
                "seeds": seeded,
            }
        )
    checks = {}
    for (ab, _), row in zip(results["ablations"], rows):
        # same math as Dobb at its tuned lr: stats_sync on one process; a numeric update_scale
        # at the lr that keeps alpha x lr (it only rescales the hidden matrices' lr)
        lr = round_lr(lr_center(ab, best_lr))
        same = ab.option == "stats_sync" or (
            ab.option == "update_scale" and not isinstance(ab.value, str)
        )
        if same and lr in row["lrs"]:
            run = row["runs"][row["lrs"].index(lr)]
            checks[f"{ab.option}={ab.value}"] = trace_difference(
                out, references["dobb"]["run"], run
            )
    signum = [r for r in rows if r["note"].startswith("block size 1")]
    identity = [r for r in rows if r["option"] == "basis_source" and r["value"] == "identity"]
    if signum and identity and best_lr["dobb"] in signum[0]["lrs"]:
        run = signum[0]["runs"][signum[0]["lrs"].index(best_lr["dobb"])]
        checks["signum"] = trace_difference(out, identity[0]["runs"][0], run)

    width_noise = compare_seeds(seeds["dobb"], seeds["dion"])["pooled_std"] * NOISE_FACTOR
    widths = []
    for w in spec.widths:
        dobb, dion = (best_run(results["widths"][(n, w)]) for n in ("dobb", "dion"))
        gap = loss_of(dobb) - loss_of(dion)
        widths.append(
            {
                "n_embd": w,
                "num_params": dobb.get("num_params"),
                "dobb_lr": dobb["lr"],
                "dobb_loss": loss_of(dobb),
                "dion_lr": dion["lr"],
                "dion_loss": loss_of(dion),
                "gap": gap,
                "exceeds": bool(abs(gap) > width_noise),
                "at_edge": [n for n in ("dobb", "dion") if at_edge(results["widths"][(n, w)])],
            }
        )

    used = {s["run"]: s for runs in _all_runs(results) for s in runs}
    info = json.loads((out / "runs" / references["dobb"]["run"] / "run.json").read_text())
    return {
        "budget": {k: v for k, v in base.to_dict().items() if k not in compare.UNCOMPARED},
        "spec": asdict(spec),
        "info": {k: info[k] for k in ("corpus", "num_params", "torch", "python", "machine")},
        "best_lr": best_lr,
        "sweeps": {
            name: [{"lr": s["lr"], "loss": loss_of(s), "run": s["run"]} for s in runs]
            for name, runs in main.items()
        },
        "sweep_edge": {name: at_edge(runs) for name, runs in main.items()},
        "seeds": seeds,
        "pairs": pairs,
        "references": references,
        "ablations": rows,
        "checks": checks,
        "width": results["width"],
        "width_noise": width_noise,
        "widths": widths,
        **(
            {"gap": study_gap.analyse_gap(results["gap"], seeds, results)}
            if "gap" in results
            else {}
        ),
        "compute": {
            "runs": len(used),
            "diverged": sorted(name for name, s in used.items() if "diverged" in s),
            "train_time_s": sum(s.get("train_time_s") or 0.0 for s in used.values()),
        },
    }


def _all_runs(results: dict) -> list[list[dict]]:
    return [
        *results["main"].values(),
        *results["seeds"].values(),
        *(runs for _, runs in results["ablations"]),
        *results.get("ablation_seeds", {}).values(),
        *results["widths"].values(),
        *(study_gap.all_runs(results["gap"]) if "gap" in results else []),
    ]


# ---- what the data show ------------------------------------------------------------------


def _fmt(x: float) -> str:
    return f"{x:.4f}" if math.isfinite(x) else "diverged"


def _options_text(name: str) -> str:
    """The options of `name` in (a), e.g. `rank_fraction=0.0625`."""
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in OPTIONS[name].items()) or "-"  # fmt: skip


def _title(name: str) -> str:
    """The optimizer's class name: Dobb, MuonBP, ..."""
    return get_entry(name).cls.__name__


def _label(row: dict[str, Any]) -> str:
    return f"{row['option']}={row['value']}" + (f" ({row['note']})" if row["note"] else "")


def findings(report: dict[str, Any]) -> list[str]:
    """Plain-language statements, each computed from the report's numbers."""
    return [
        *_comparison_findings(report),
        *_ablation_findings(report, "dobb"),
        *_signum_findings(report),
        *_width_findings(report),
        *_ablation_findings(report, "muonbp"),
        *(study_gap.gap_findings(report["gap"]) if "gap" in report else []),
        *_scope_findings(report),
    ]


def _comparison_findings(report: dict[str, Any]) -> list[str]:
    seeds, pairs = report["seeds"], report["pairs"]
    order = sorted(seeds, key=lambda n: seeds[n]["mean"])
    lines = [
        f"**{order[0]} has the lowest mean final validation loss** at this budget "
        f"({_fmt(seeds[order[0]]['mean'])} over {seeds[order[0]]['n']} seeds). Ranking: "
        + " < ".join(f"{n} ({_fmt(seeds[n]['mean'])})" for n in order)
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
            f"{abs(p['diff']):.4f} (2 x pooled seed std {NOISE_FACTOR * p['pooled_std']:.4f}, "
            f"Welch t {p['welch_t']:.2f}): {verdict}."
        )
    return lines


def _ablation_findings(report: dict[str, Any], name: str) -> list[str]:
    title, noise, lines = _title(name), report["references"][name]["noise"], []
    rows = [r for r in report["ablations"] if r["optimizer"] == name]
    varied = [r for r in rows if r["option"] != "stats_sync"]
    matter = sorted((r for r in varied if r["exceeds"]), key=lambda r: -abs(_delta(r)))
    within = [r for r in varied if not r["exceeds"]]
    text = (
        f"{title} ablations, each against {title}'s seed-0 run at its tuned lr (threshold: 2 x "
        f"{title}'s seed std = {noise:.4f}): "
    )
    if matter:
        text += "beyond the noise: " + ", ".join(f"{_label(r)} {_delta(r):+.4f}" for r in matter)
    else:
        text += "no change moves the loss beyond the seed noise"
    if within:
        text += "; within the noise: " + ", ".join(_label(r) for r in within)
    lines.append(text + ".")
    better = [r for r in matter if _delta(r) < 0]
    if better:
        lines.append(
            f"Better than {title}'s default beyond the noise: "
            + ", ".join(f"{_label(r)} ({_delta(r):+.4f})" for r in better)
            + "; the default ("
            + ", ".join(sorted({f"{r['option']}={r['default']}" for r in better}))
            + ") is not the best setting at this budget."
        )
    return lines


def _delta(row: dict[str, Any]) -> float:
    """An ablation's loss difference: of seed means where it has seeds, else of seed 0."""
    return row["seeds"]["pair"]["diff"] if row.get("seeds") else row["delta"]


def _signum_findings(report: dict[str, Any]) -> list[str]:
    """Dobb's Signum ablation and the same-math checks."""
    lines = []
    for r in report["ablations"]:
        if r["note"].startswith("block size 1"):
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
    checks = report["checks"]
    for key, d in checks.items():
        same = "identical loss curves" if d == 0 else f"largest loss difference {d:.3g}"
        if key.startswith("stats_sync"):
            lines.append(
                "stats_sync='step' vs 'refresh' on one process (the same math; it differs only "
                f"in communication, so this is a check, not an ablation): {same}."
            )
        elif key.startswith("update_scale"):
            alpha = key.partition("=")[2]
            lines.append(
                f"update_scale={alpha} at lr x {base_alpha()}/{alpha} vs Dobb "
                f"at its lr: {same}"
                + (
                    ": a numeric update_scale only rescales the hidden matrices' lr, so it moves "
                    "the best lr, not the best loss."
                    if d < 1e-4
                    else "."
                )
            )
    if "signum" in checks:
        d = checks["signum"]
        lines.append(
            "Block size 1 and the identity basis (both Signum) at the same lr: "
            + ("identical loss curves." if d == 0 else f"largest loss difference {d:.3g}.")
        )
    return lines


def _width_findings(report: dict[str, Any]) -> list[str]:
    widths, lines = report["widths"], []
    gaps = ", ".join(f"n_embd {r['n_embd']}: {r['gap']:+.4f}" for r in widths)
    lines.append(
        f"Dobb - Dion gap in final val loss (negative: Dobb lower) at {gaps}; noise 2 x pooled "
        f"seed std at n_embd {report['width']} = {report['width_noise']:.4f}, one seed per width."
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
    edges += [_label(r) for r in rows if r["at_edge"]]
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
    scalar = sorted({get_entry(n).scalar_lr for n in BASELINES + ("dobb",)} - {None})
    lines.append(
        f"Scope: one {report['info']['num_params']:,}-parameter byte-level GPT, {tokens:,} "
        "tokens per run, one process per run on CPU. Only the hidden-matrix lr is tuned: the "
        f"embedding/head/norm lr of Dobb, Dion and Muon stays at the registry's "
        f"{', '.join(f'{s:g}' for s in scalar)} (AdamW's one lr covers all parameters). The "
        "paper's numbers are for GPT-2 XL; this budget says nothing about that scale."
    )
    return lines


# ---- plots ---------------------------------------------------------------------------


def plot_ablations(out: Path, report: dict[str, Any], name: str, file: str) -> str:
    """Horizontal bars: each ablation of `name`, its final val loss minus `name`'s at its
    tuned lr, with the noise band."""
    from matplotlib.figure import Figure

    title, noise = _title(name), report["references"][name]["noise"]
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
    ax.axvspan(-noise, noise, color="tab:blue", alpha=0.15, label=f"2 x {title} seed std")
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel(f"final val loss minus {title}'s (lower is better)")
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
    ax.axhspan(-noise, noise, color="tab:blue", alpha=0.15, label="2 x pooled seed std")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(widths, [str(w) for w in widths])
    ax.set_xlabel("model width n_embd")
    ax.set_ylabel("gap in final val loss (negative: Dobb lower)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(out / "width.png", dpi=120)
    return "width.png"


# ---- the document --------------------------------------------------------------------


def table(headers: str, rows: list[str]) -> str:
    """A Markdown table from `|`-separated header and row strings."""
    return markdown_table(headers.split("|"), [row.split("|") for row in rows])


def write_document(report: dict[str, Any], out: Path, doc: Path) -> None:
    """STUDY.md (links relative to its folder) and the plots (in `out`)."""
    doc.parent.mkdir(parents=True, exist_ok=True)

    def link(name: str) -> str:
        return Path(os.path.relpath(out / name, doc.parent)).as_posix()

    seeds, best_lr, spec = report["seeds"], report["best_lr"], report["spec"]
    dobb, muonbp = report["references"]["dobb"], report["references"]["muonbp"]
    sweeps = {  # compare's plot wants summaries; a diverged run is a gap (NaN)
        name: [{"lr": s["lr"], "final_val_loss": s["loss"] if s["loss"] < math.inf else math.nan}
               for s in runs]
        for name, runs in report["sweeps"].items()
    }  # fmt: skip
    runs = {f"{n} (lr {best_lr[n]:.4g})": out / "runs" / seeds[n]["runs"][0] for n in seeds}
    plots = [compare.plot_sweep(out, sweeps), *compare.plot_curves(out, runs)]
    ablation_plot = plot_ablations(out, report, "dobb", "ablations.png")
    period_plot = plot_ablations(out, report, "muonbp", "muonbp_period.png")
    width_plot = plot_widths(out, report)
    model = gpt_config(report["budget"]["model"], **report["budget"]["model_overrides"])

    lines = [
        "# Optimizer study: tuned comparison, Dobb ablations, width trend, MuonBP's period, "
        "closing the gap to Muon",
        "",
        *_header(report, model, link),
        "",
        "## What the data show",
        "",
        *[f"- {line}" for line in findings(report)],
        "",
        "## (a) Tuned comparison",
        "",
        f"Each optimizer's lr grid is its registry lr x {spec['lr_factors']}, extended by one "
        f"point at a time (up to {spec['max_extensions']}) while the best lr is at an edge. At "
        f"each best lr, {spec['seeds']} seeds (seed 0 is the sweep's own run, the selected one; "
        "the seed changes the initialization, the batch order and the validation batches). "
        "A difference exceeds the noise when |difference of means| > 2 x pooled std of single "
        "runs; Welch's t is shown beside it.",
        "",
        table(
            "optimizer|options|best lr|final val loss (mean ± std)|per seed|tokens/s|"
            "optimizer ms/step",
            [
                f"{n}|{_options_text(n)}|{best_lr[n]:.4g}|{_fmt(s['mean'])} ± {s['std']:.4f}|"
                f"{', '.join(map(_fmt, s['losses']))}|{s['tokens_per_s']:,.0f}|{s['opt_ms']:.2f}"
                for n, s in seeds.items()
            ],
        ),
        "",
        table(
            "Dobb vs|difference of means (Dobb - other)|2 x pooled std|Welch t|exceeds noise",
            [
                f"{n}|{p['diff']:+.4f}|{NOISE_FACTOR * p['pooled_std']:.4f}|{p['welch_t']:.2f}|"
                f"{YES_NO[p['exceeds']]}"
                for n, p in report["pairs"].items()
            ],
        ),
        "",
        *[f"![{p}]({link(p)})" for p in plots],
        "",
        "Learning-rate sweeps (final val loss; hidden-matrix lr, all parameters for AdamW):",
        "",
        table(
            "optimizer|lr|final val loss|best",
            [
                f"{n}|{s['lr']:.4g}|{_fmt(s['loss'])}|{'yes' if s['lr'] == best_lr[n] else ''}"
                for n, runs in report["sweeps"].items()
                for s in runs
            ],
        ),
        "",
        "## (b) Dobb ablations",
        "",
        f"Each row changes one option of Dobb ({_options_text('dobb')}, class defaults "
        "otherwise) and is compared with Dobb's seed-0 run at its tuned lr "
        f"({_fmt(dobb['loss'])}, lr {best_lr['dobb']:.4g}). num_blocks and "
        f"update_scale move the best lr, so they run at {spec['ablation_lr_factors']} x an lr "
        "centre (Dobb's tuned lr; for a numeric update_scale the lr keeping alpha x lr; for "
        "'muon' Muon's tuned lr) and report the best. Beyond noise: |Δ| > 2 x Dobb's seed std "
        f"({dobb['noise']:.4f}).",
        "",
        _ablation_table(report, "dobb"),
        "",
        f"![ablations]({link(ablation_plot)})",
        "",
        "## (c) Width trend",
        "",
        f"Dobb and Dion at n_embd {[r['n_embd'] for r in report['widths']]} ({model.n_layer} "
        f"layers, {model.n_head} heads), each at its best lr of {spec['ablation_lr_factors']} x "
        f"its tuned lr of (a) (n_embd {report['width']}: the sweep of (a)); one seed per width. "
        "Beyond noise: |gap| > 2 x pooled Dobb/Dion seed std at n_embd "
        f"{report['width']} ({report['width_noise']:.4f}).",
        "",
        table(
            "n_embd|parameters|Dobb lr|Dobb loss|Dion lr|Dion loss|gap (Dobb - Dion)|beyond noise",
            [
                f"{r['n_embd']}|{r['num_params']:,}|{r['dobb_lr']:.4g}|{_fmt(r['dobb_loss'])}|"
                f"{r['dion_lr']:.4g}|{_fmt(r['dion_loss'])}|{r['gap']:+.4f}|{YES_NO[r['exceeds']]}"
                for r in report["widths"]
            ],
        ),
        "",
        f"![width trend]({link(width_plot)})",
        "",
        "## (d) MuonBP's period",
        "",
        "Each row sets MuonBP's period P (a full step every P updates of a matrix, block steps "
        f"in between; {_options_text('muonbp')}; P={defaults('muonbp')['period']} in (a)) and "
        f"is compared with MuonBP's seed-0 run at its tuned lr ({_fmt(muonbp['loss'])}, lr "
        f"{best_lr['muonbp']:.4g}; its {seeds['muonbp']['n']} seeds: "
        f"{_fmt(seeds['muonbp']['mean'])} ± {seeds['muonbp']['std']:.4f}). Each period ran "
        f"at {spec['ablation_lr_factors']} x the tuned lr (extended by one point at a time, up "
        f"to {spec['ablation_max_extensions']}, while the best is at an edge) and reports the "
        f"best. Beyond noise: |Δ| > 2 x MuonBP's seed std ({muonbp['noise']:.4f}).",
        "",
        _ablation_table(report, "muonbp"),
        "",
        f"![MuonBP's period]({link(period_plot)})",
        "",
        *(study_gap.gap_section(report["gap"], out, link, table) if "gap" in report else []),
    ]
    doc.write_text("\n".join(lines))


def _ablation_table(report: dict[str, Any], name: str) -> str:
    """The ablations of optimizer `name`, each against its seed-0 run at its tuned lr."""
    title = _title(name)
    return table(
        f"option|{title}'s value|ablation|lrs tried|best lr|final val loss|Δ vs {title}|"
        "beyond noise|note",
        [
            f"{r['option']}|{r['default']}|{r['value']}|"
            f"{', '.join(f'{lr:.4g}' for lr in r['lrs'])}|{r['best_lr']:.4g}|"
            f"{_fmt(r['loss'])}|{r['delta']:+.4f}|{YES_NO[r['exceeds']]}|"
            + "; ".join(
                filter(None, [r["note"], r["at_edge"] and "best lr at grid edge", _seeded(r)])
            )
            for r in report["ablations"]
            if r["optimizer"] == name
        ],
    )


def _seeded(row: dict[str, Any]) -> str:
    """A seeded ablation's means against its optimizer's seeds (empty for one-seed rows)."""
    stats = row.get("seeds")
    if not stats:
        return ""
    pair = stats["pair"]
    return (
        f"{stats['n']} seeds: mean {_fmt(stats['mean'])} ± {stats['std']:.4f}, Δ of means "
        f"{pair['diff']:+.4f} (2 x pooled std {NOISE_FACTOR * pair['pooled_std']:.4f}, "
        f"Welch t {pair['welch_t']:.2f}); beyond noise judged on the means"
    )


def _header(report: dict[str, Any], model, link) -> list[str]:
    """Provenance: command, date, machine, versions, corpus, model, budget, compute."""
    info, budget, spec = report["info"], report["budget"], report["spec"]
    machine, corpus, compute = info["machine"], info["corpus"], report["compute"]
    tokens = budget["steps"] * budget["batch_size"] * budget["block_size"]
    invocations = report["invocations"]
    wall = sum(i["wall_s"] for i in invocations)
    return [
        f"Generated by `{report['command']}` on {report['date']} from the run logs in "
        f"[`{link('runs')}`]({link('runs')}) (numbers: [`study.json`]({link('study.json')})). "
        "Nothing here is typed in by hand.",
        "",
        f"- machine: {machine['platform']}, {machine['processor']}, {machine['cpu_count']} CPUs; "
        f"{spec['workers']} runs side by side, {spec['threads']} torch thread(s) each"
        + (f", {machine['cuda']}" if machine.get("cuda") else ""),
        f"- torch {info['torch']}, Python {info['python']}",
        f"- corpus: {corpus['name']} ({corpus['num_tokens']:,} tokens, {corpus['tokenizer']} "
        f"tokenizer), sha256 `{corpus['sha256']}`",
        f"- model: GPT, {model.n_layer} layers, n_embd {model.n_embd}, {model.n_head} heads, "
        f"{info['num_params']:,} parameters",
        f"- budget per run: {budget['steps']} steps x {budget['batch_size']} x "
        f"{budget['block_size']} tokens = {tokens:,} tokens; warmup {budget['warmup_steps']}, "
        f"{budget['decay']} decay to {budget['min_lr_ratio']} x lr; final val loss on "
        f"{budget['eval_batches']} fixed batches (drawn per seed)",
        f"- compute: {compute['runs']} runs, {compute['train_time_s'] / 60:.1f} min of training "
        "summed over runs (evaluation excluded); wall-clock of the completed `dobb study` "
        f"invocations: {wall / 60:.1f} min over {len(invocations)}, the last one "
        f"{invocations[-1]['wall_s']:.0f} s with {invocations[-1]['new_runs']} new runs",
    ]


# ---- the command -----------------------------------------------------------------------
