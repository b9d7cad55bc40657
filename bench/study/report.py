"""The optimizer study's document: STUDY.md next to the output folder (plots inside it),
from the numbers of `bench.study.analysis` and the statements of
`bench.study.findings`. Nothing in the document is typed in by hand.
"""

import math
import os
from pathlib import Path
from typing import Any

from bench import compare
from bench.compare import options_text
from bench.study.findings import findings
from bench.study.format import NOISE, fmt_loss, table, title
from bench.study.gap_report import gap_section
from bench.study.moe_report import moe_section
from bench.study.plots import plot_ablations, plot_widths
from bench.study.runs import defaults
from bench.study.shards_report import many_shards_lines
from bench.study.stats import NOISE_FACTOR
from bench.study.tuning_report import tuning_section
from dobb.train.model import gpt_config

YES_NO = {True: "yes", False: "no"}


def write_document(report: dict[str, Any], out: Path, doc: Path) -> None:
    """STUDY.md (links relative to its folder) and the plots (in `out`)."""
    doc.parent.mkdir(parents=True, exist_ok=True)

    def link(name: str) -> str:
        return Path(os.path.relpath(out / name, doc.parent)).as_posix()

    seeds, best_lr, spec = report["seeds"], report["best_lr"], report["spec"]
    dobb, muonbp = report["references"]["dobb_paper"], report["references"]["muonbp"]
    sweeps = {  # compare's plot wants summaries; a diverged run is a gap (NaN)
        name: [
            {"lr": s["lr"], "final_val_loss": s["loss"] if s["loss"] < math.inf else math.nan}
            for s in runs
        ]
        for name, runs in report["sweeps"].items()
    }
    runs, unlogged = curve_runs(out, seeds, best_lr)
    plots = [compare.plot_sweep(out, sweeps), *compare.plot_curves(out, runs)]
    ablation_plot = plot_ablations(out, report, "dobb_paper", "ablations.png")
    period_plot = plot_ablations(out, report, "muonbp", "muonbp_period.png")
    width_plot = plot_widths(out, report)
    model = gpt_config(report["budget"]["model"], **report["budget"]["model_overrides"])

    lines = [
        "# Optimizer study: tuned comparison, Dobb ablations, width trend, MuonBP's period, "
        "closing the gap to Muon, every optimizer tuned at every width"
        + (", a mixture of experts" if "moe" in report else ""),
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
        f"A difference exceeds the noise when |difference of means| > {NOISE} pooled std of single "
        "runs; Welch's t is shown beside it.",
        "",
        table(
            "optimizer|options|best lr|final val loss (mean ± std)|per seed|tokens/s|"
            "optimizer ms/step",
            [
                f"{n}|{options_text(n)}|{best_lr[n]:.4g}|{fmt_loss(s['mean'])} ± {s['std']:.4f}|"
                f"{', '.join(map(fmt_loss, s['losses']))}|{s['tokens_per_s']:,.0f}|"
                f"{s['opt_ms']:.2f}"
                for n, s in seeds.items()
            ],
        ),
        "",
        table(
            f"Dobb vs|difference of means (Dobb - other)|{NOISE} pooled std|Welch t|exceeds noise",
            [
                f"{n}|{p['diff']:+.4f}|{NOISE_FACTOR * p['pooled_std']:.4f}|{p['welch_t']:.2f}|"
                f"{YES_NO[p['exceeds']]}"
                for n, p in report["pairs"].items()
            ],
        ),
        "",
        *[f"![{p}]({link(p)})" for p in plots],
        *(
            [
                "",
                f"Not in the loss curves: {', '.join(unlogged)}: no step log (`metrics.jsonl`) "
                "of the seed-0 run on record (only its config and summary are kept).",
            ]
            if unlogged
            else []
        ),
        "",
        "Learning-rate sweeps (final val loss; hidden-matrix lr, all parameters for AdamW):",
        "",
        table(
            "optimizer|lr|final val loss|best",
            [
                f"{n}|{s['lr']:.4g}|{fmt_loss(s['loss'])}|{'yes' if s['lr'] == best_lr[n] else ''}"
                for n, runs in report["sweeps"].items()
                for s in runs
            ],
        ),
        "",
        "Newton-Schulz coefficients: Muon with the Polar Express coefficients (arXiv "
        "2505.16932; Keller Jordan's quintic is its default) and NorDion2 with the quintic "
        "(Polar Express is its default, as in the authors' code), each at its optimizer's "
        f"tuned lr, against its seed-0 run there; beyond noise: |Δ| > {NOISE} its seed std.",
        "",
        _ablation_table(report, "muon"),
        "",
        _ablation_table(report, "nordion2"),
        "",
        "## (b) Dobb ablations",
        "",
        f"Each row changes one option of Dobb ({options_text('dobb_paper')}, class defaults "
        "otherwise) and is compared with Dobb's seed-0 run at its tuned lr "
        f"({fmt_loss(dobb['loss'])}, lr {best_lr['dobb_paper']:.4g}). num_blocks and "
        f"update_scale move the best lr, so they run at {spec['ablation_lr_factors']} x an lr "
        "centre (Dobb's tuned lr; for a numeric update_scale the lr keeping alpha x lr; for "
        f"'muon' Muon's tuned lr) and report the best. Beyond noise: |Δ| > {NOISE} Dobb's seed std "
        f"({dobb['noise']:.4f}).",
        "",
        _ablation_table(report, "dobb_paper"),
        "",
        f"![ablations]({link(ablation_plot)})",
        "",
        "## (c) Width trend",
        "",
        f"Dobb and Dion at n_embd {[r['n_embd'] for r in report['widths']]} ({model.n_layer} "
        f"layers, {model.n_head} heads), each at its best lr of {spec['ablation_lr_factors']} x "
        f"its tuned lr of (a) (n_embd {report['width']}: the sweep of (a)); one seed per width. "
        f"Beyond noise: |gap| > {NOISE} pooled Dobb/Dion seed std at n_embd "
        f"{report['width']} ({report['width_noise']:.4f}).",
        "",
        table(
            "n_embd|parameters|Dobb lr|Dobb loss|Dion lr|Dion loss|gap (Dobb - Dion)|beyond noise",
            [
                f"{r['n_embd']}|{r['num_params']:,}|{r['dobb_lr']:.4g}|{fmt_loss(r['dobb_loss'])}|"
                f"{r['dion_lr']:.4g}|{fmt_loss(r['dion_loss'])}|{r['gap']:+.4f}|{YES_NO[r['exceeds']]}"
                for r in report["widths"]
            ],
        ),
        "",
        f"![width trend]({link(width_plot)})",
        "",
        "## (d) MuonBP's period",
        "",
        "Each row sets MuonBP's period P (a full step every P updates of a matrix, block steps "
        f"in between; {options_text('muonbp')}; P={defaults('muonbp')['period']} in (a)) and "
        f"is compared with MuonBP's seed-0 run at its tuned lr ({fmt_loss(muonbp['loss'])}, lr "
        f"{best_lr['muonbp']:.4g}; its {seeds['muonbp']['n']} seeds: "
        f"{fmt_loss(seeds['muonbp']['mean'])} ± {seeds['muonbp']['std']:.4f}). Each period ran "
        f"at {spec['ablation_lr_factors']} x the tuned lr (extended by one point at a time, up "
        f"to {spec['ablation_max_extensions']}, while the best is at an edge) and reports the "
        f"best. Beyond noise: |Δ| > {NOISE} MuonBP's seed std ({muonbp['noise']:.4f}).",
        "",
        _ablation_table(report, "muonbp"),
        "",
        f"![MuonBP's period]({link(period_plot)})",
        "",
        *(gap_section(report["gap"], spec, out, link, table) if "gap" in report else []),
        "",
        *(tuning_section(report["tuning"], spec, out, link, table) if "tuning" in report else []),
        *(many_shards_lines(report["many_shards"], table) if "many_shards" in report else []),
        *(
            ["", *moe_section(report["moe"], spec, report["info"], out, link, table)]
            if "moe" in report
            else []
        ),
    ]
    doc.write_text("\n".join(lines))


def curve_runs(
    out: Path, seeds: dict[str, Any], best_lr: dict[str, float]
) -> tuple[dict[str, Path], list[str]]:
    """The loss curves of (a): each optimizer's seed-0 run at its tuned lr, by label, if its
    step log is on record; and the optimizers whose log is not."""
    runs = {n: out / "runs" / seeds[n]["runs"][0] for n in seeds}
    logged = {n for n, run in runs.items() if (run / "metrics.jsonl").exists()}
    curves = {f"{n} (lr {best_lr[n]:.4g})": run for n, run in runs.items() if n in logged}
    return curves, [n for n in runs if n not in logged]


def _ablation_table(report: dict[str, Any], name: str) -> str:
    """The ablations of optimizer `name`, each against its seed-0 run at its tuned lr."""
    name_title = title(name)
    return table(
        f"option|{name_title}'s value|ablation|lrs tried|best lr|final val loss|Δ vs {name_title}|"
        "beyond noise|note",
        [
            f"{r['option']}|{r['default']}|{r['value']}|"
            f"{', '.join(f'{lr:.4g}' for lr in r['lrs'])}|{r['best_lr']:.4g}|"
            f"{fmt_loss(r['loss'])}|{r['delta']:+.4f}|{YES_NO[r['exceeds']]}|"
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
        f"{stats['n']} seeds: mean {fmt_loss(stats['mean'])} ± {stats['std']:.4f}, Δ of means "
        f"{pair['diff']:+.4f} ({NOISE} pooled std {NOISE_FACTOR * pair['pooled_std']:.4f}, "
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
        "summed over runs (evaluation excluded); wall-clock of the completed "
        f"`python -m bench study` invocations: {wall / 60:.1f} min over {len(invocations)}, "
        "the last one "
        f"{invocations[-1]['wall_s']:.0f} s with {invocations[-1]['new_runs']} new runs",
        f"- code: {compute['code_records']} of {compute['runs']} runs name the commit that "
        "trained them (`<run>/code.json`); the others were trained before that record existed",
        "- weight decay, one protocol for every optimizer (`weight_decay` and "
        "`scalar_weight_decay` of the harness's config, decoupled: W <- W (1 - lr wd)): "
        f"hidden matrices {compute['protocol']['weight_decay']}, embeddings, head, norms and "
        f"biases {compute['protocol']['scalar_weight_decay']}; "
        + (
            f"runs off the protocol: {', '.join(compute['off_protocol'])}"
            if compute["off_protocol"]
            else f"all {compute['runs']} runs follow it (read from each run's logged config)"
        ),
    ]
