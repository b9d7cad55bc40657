"""Part (e) of the study: closing the gap to Muon without leaving the shard.

Three questions, each answered by training runs of `bench.study.runs`:

- Variants (at the study's width): Dobb and two-sided Dobb (``dobb_sign``: row blocks with
  their own eigenbases, ``Dobb(two_sided=True)``) at input block sizes 32, 64 and the whole
  width, Adam coefficients in the eigenbasis instead of the sign (SOAP's idea), K-FAC's
  output-gradient row moments instead of Shampoo's ``G Gᵀ``, slower statistics, and an EMA
  of the weights for evaluation. Each gets a small lr sweep around its optimizer's tuned lr
  of (a); the best ``seeded`` ones get more seeds, set against Muon's and BlockMuon's.
- Shard count (at ``shard_width``): two-sided Dobb, BlockMuon and MuonBP with 2..32 row
  blocks (the FSDP degrees they emulate) against one-sided Dobb, whose update does not
  depend on the number of row shards, and Muon. One seed, each at its tuned lr of (a).
- Width: Dobb, two-sided Dobb, the best variant, BlockMuon and Muon at the first width of
  ``gap_widths``, and Muon, BlockMuon and the best variant at the wider ones (one seed,
  tuned lrs of (a)).

"Shard-local" means no collective inside ``step()`` besides the statistics average on
refresh steps, at 4 row shards (FSDP, column-parallel TP); a variant's input blocks also
tile the column shards of row-parallel TP over 4 ranks when its block count at every
``d_in`` (the width and 4 x the width) is a multiple of 4.

This module plans the runs and computes the numbers; ``bench.study.gap_report`` writes the section.
"""

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from bench.compare import OPTIONS
from bench.optimizers import lab_entry, with_options
from bench.study.runs import (
    Sweep,
    best_run,
    loss_of,
    row_block_options,
    run_config,
    tune,
    width_of,
)
from bench.study.stats import compare_seeds, seed_stats

TP_DEGREE = 4  # the row-parallel TP degree the "shard-local under TP" column checks
ROW_SHARDS = OPTIONS["dobb_sign"]["row_blocks"]  # the FSDP degree "shard-local" is judged at
REFERENCE_OPTIMIZERS = ("muon", "blockmuon")  # each variant's seeds are set against these
# The section's design, by lab name (labels: the lab's): the row-blocked optimizers traced
# over shard counts; the unblocked Dobb each is set against (its loss at every count); the
# width trend's optimizers, the wider widths' (the costliest runs) and its reference, Muon
SHARD_TREND = ("dobb_sign", "blockmuon", "muonbp")
UNBLOCKED = "dobb_paper"
WIDTH_TREND = ("dobb_paper", "dobb_sign", "blockmuon", "muon")
WIDER = ("muon", "blockmuon")
REFERENCE = "muon"
GOAL_GAP, GOAL_WIDTHS = 0.02, 2  # the goal: within GOAL_GAP of Muon at GOAL_WIDTHS widths


@dataclass(frozen=True)
class Variant:
    """One configuration of (e): options on top of ``OPTIONS[optimizer]``, and trainer
    overrides (``train``, e.g. the weights EMA)."""

    label: str
    optimizer: str
    options: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    shard_local: bool = True  # False: a control that reads rows of other shards
    lr_scale: float = 1.0  # the sweep's centre: lr_scale x the optimizer's tuned lr

    def settings(self) -> dict[str, Any]:
        return with_options(self.optimizer, self.options)


WHOLE = {"block_size": None, "num_blocks": 1}  # one input block: the whole width


def variants() -> list[Variant]:
    """The configurations of (e). Two-sided Dobb's settings of (a): 4 row blocks, input
    blocks of 32 columns (``compare.OPTIONS["dobb_sign"]``)."""
    adam = {"coefficients": "adam", "update_scale": 1.0}  # RMS ~0.2 by itself
    return [
        Variant("Dobb, input blocks of 32", "dobb_paper", {"block_size": 32}),
        Variant("Dobb, input blocks of 64", "dobb_paper", {"block_size": 64}),
        Variant("Dobb, one input block", "dobb_paper", {"num_blocks": 1}),
        Variant("Dobb, Adam coefficients", "dobb_paper", adam),
        Variant("two-sided, input blocks of 64", "dobb_sign", {"block_size": 64}),
        Variant("two-sided, one input block", "dobb_sign", WHOLE),
        Variant(
            "two-sided, 16 input blocks (the paper's)",
            "dobb_sign",
            {"block_size": None, "num_blocks": 16},
        ),
        Variant("two-sided, Adam coefficients", "dobb_sign", adam),
        Variant("two-sided, K-FAC row moments", "dobb_sign", {"row_stats": "outputs"}),
        Variant(
            "two-sided, statistics EMA 0.99, refresh every 20",
            "dobb_sign",
            {"stats_beta": 0.99, "basis_interval": 20},
        ),
        Variant(
            "two-sided, statistics EMA 0.999, refresh every 50",
            "dobb_sign",
            {"stats_beta": 0.999, "basis_interval": 50},
        ),
        Variant(
            "two-sided, weights EMA 0.99 for evaluation", "dobb_sign", train={"eval_ema": 0.99}
        ),
        Variant(
            "two-sided, one row block (not shard-local)",
            "dobb_sign",
            {"row_blocks": 1},
            shard_local=False,
        ),
    ]


def input_blocks(settings: dict[str, Any], d_in: int) -> int:
    """Dobb's number of input blocks of a ``d_in``-wide matrix under ``settings``."""
    size = settings.get("block_size")
    return -(-d_in // size) if size else min(settings.get("num_blocks", 16), d_in)


def tiles_tp(settings: dict[str, Any], width: int) -> bool:
    """Whether the input blocks tile row-parallel TP's column shards over ``TP_DEGREE``."""
    return all(input_blocks(settings, d) % TP_DEGREE == 0 for d in (width, 4 * width))


# ---- runs ------------------------------------------------------------------------------


def run_gap(spec, base, out: Path, runner, best: dict[str, float], log=print) -> dict:
    """Every run of (e); returns their summaries, grouped."""
    make = partial(run_config, base, out)
    width = width_of(base)

    def maker(v: Variant, **kw):
        return partial(make, v.optimizer, options=v.options, train=v.train, **kw)

    sweeps = {
        ("variant", i): Sweep(
            maker(v),
            [best[v.optimizer] * v.lr_scale * f for f in spec.ablation_lr_factors],
            spec.ablation_max_extensions,
        )
        for i, v in enumerate(variants())
    }
    log(f"(e) variants: {sum(len(s.grid) for s in sweeps.values())} runs + extensions")
    swept = tune(runner, sweeps)
    ranked = sorted(
        (i for i, v in enumerate(variants()) if v.shard_local),
        key=lambda i: loss_of(best_run(swept[("variant", i)])),
    )
    seeded = ranked[: spec.gap_seeded]
    later: dict = {}
    for i in seeded:
        v, lr = variants()[i], best_run(swept[("variant", i)])["lr"]
        for seed in range(1, spec.gap_seeds):
            later[("seed", i, seed)] = Sweep(maker(v, seed=seed), [lr])
    shard_width = spec.gap_widths[0]
    for n in spec.shard_counts:
        for name in SHARD_TREND:
            options = row_block_options(name, n)  # at (a)'s count: the width trend's run
            run = partial(make, name, options=options, width=shard_width)
            later[("shards", name, n)] = Sweep(run, [best[name]])
    top = variants()[ranked[0]] if ranked else None
    for name, w in _width_keys(spec, top):
        if name == "top":
            lr = best_run(swept[("variant", ranked[0])])["lr"]
            later[("width", "top", w)] = Sweep(maker(top, width=w), [lr])
        else:
            later[("width", name, w)] = Sweep(partial(make, name, width=w), [best[name]])
    log(f"(e) seeds, shard counts, widths: {len(later)} runs")
    done = tune(runner, later)
    return {
        "variants": [(v, swept[("variant", i)]) for i, v in enumerate(variants())],
        "variant_seeds": {
            i: [best_run(swept[("variant", i)])]
            + [done[("seed", i, s)][0] for s in range(1, spec.gap_seeds)]
            for i in seeded
        },
        "shards": {
            (name, n): done[("shards", name, n)][0]
            for n in spec.shard_counts
            for name in SHARD_TREND
        },
        "shard_width": shard_width,
        "widths": {(name, w): done[("width", name, w)][0] for name, w in _width_keys(spec, top)},
        "top": ranked[0] if ranked else None,
        "width": width,
    }


def _width_keys(spec, top) -> list[tuple[str, int]]:
    """(optimizer, width) of the width trend: every trend optimizer at the first width;
    at the wider ones (the costliest runs) only Muon, BlockMuon and the best variant."""
    names = [*WIDTH_TREND] + (["top"] if top is not None else [])
    first, *wider = spec.gap_widths
    return [(n, first) for n in names] + [
        (n, w) for w in wider for n in names if n in (*WIDER, "top")
    ]


def all_runs(gap: dict) -> list[list[dict]]:
    """Every summary of (e), for the study's compute total."""
    return [
        *(runs for _, runs in gap["variants"]),
        *gap["variant_seeds"].values(),
        [*gap["shards"].values(), *gap["widths"].values()],
    ]


# ---- analysis --------------------------------------------------------------------------


def analyse_gap(gap: dict, seeds: dict, results: dict) -> dict:
    """The numbers of (e): variant table, seeded comparisons, shard-count and width trends.

    ``seeds``: (a)'s seed statistics per optimizer; ``results``: the other parts' runs (for
    one-sided Dobb at the widths of (c)).
    """
    width = gap["width"]
    rows = []
    for i, (v, runs) in enumerate(gap["variants"]):
        top = best_run(runs)
        row = {
            "label": v.label,
            "optimizer": v.optimizer,
            "settings": {k: val for k, val in v.settings().items()},
            "train": dict(v.train),
            "shard_local": v.shard_local,
            "tiles_tp": v.shard_local and tiles_tp(v.settings(), width),
            "lrs": [s["lr"] for s in runs],
            "losses": [loss_of(s) for s in runs],
            "best_lr": top["lr"],
            "loss": loss_of(top),
            "opt_ms": top.get("opt_ms"),
            "state_bytes_per_param": top.get("state_bytes_per_param"),
            "seeds": None,
        }
        if i in gap["variant_seeds"]:
            stats = seed_stats(gap["variant_seeds"][i])
            stats["pairs"] = {n: compare_seeds(stats, seeds[n]) for n in REFERENCE_OPTIMIZERS}
            row["seeds"] = stats
        rows.append(row)
    # (a)'s two-sided Dobb and one-sided Dobb, as rows of the same table
    for name in (SHARD_TREND[0], UNBLOCKED):
        stats = dict(seeds[name])
        stats["pairs"] = {n: compare_seeds(stats, seeds[n]) for n in REFERENCE_OPTIMIZERS}
        rows.insert(
            0,
            {
                "label": f"{lab_entry(name).label} (a)",
                "optimizer": name,
                "settings": dict(OPTIONS[name]),
                "train": {},
                "shard_local": True,
                "tiles_tp": tiles_tp(OPTIONS[name], width),
                "lrs": [],
                "losses": [],
                "best_lr": None,
                "loss": stats["losses"][0],
                "opt_ms": stats["opt_ms"],
                "state_bytes_per_param": None,
                "seeds": stats,
            },
        )
    shard_width = gap["shard_width"]
    counts = sorted({n for _, n in gap["shards"]})
    flat = {  # no row blocks: the same run at every shard count
        UNBLOCKED: _width_run(gap, results, UNBLOCKED, shard_width),
        REFERENCE: gap["widths"][(REFERENCE, shard_width)],
    }
    shards = {name: [loss_of(gap["shards"][(name, n)]) for n in counts] for name in SHARD_TREND}
    crossings = {
        name: next((n for n, x in zip(counts, losses) if x > loss_of(flat[UNBLOCKED])), None)
        for name, losses in shards.items()
    }
    widths = sorted({w for _, w in gap["widths"]} - {width})
    trend = []
    for w in sorted({width, *widths}):
        entry = {"n_embd": w, "losses": {}}
        for name in (*WIDTH_TREND, "top"):
            if w == width:
                loss = seeds[name]["mean"] if name in seeds else None
                if name == "top" and gap["top"] is not None:
                    top_row = rows[gap["top"] + 2]
                    loss = (top_row["seeds"] or {}).get("mean", top_row["loss"])
            else:
                run = _width_run(gap, results, name, w)
                loss = loss_of(run) if run else None
            entry["losses"][name] = loss
        local = {n: x for n, x in entry["losses"].items() if n != REFERENCE and x is not None}
        best = min(local, key=local.get)
        entry["best_local"] = best
        entry["gap"] = local[best] - entry["losses"][REFERENCE]
        trend.append(entry)
    top_label = rows[gap["top"] + 2]["label"] if gap["top"] is not None else None
    return {
        "rows": rows,
        "shard_width": shard_width,
        "counts": counts,
        "shards": shards,
        "flat": {k: loss_of(v) for k, v in flat.items()},
        "crossings": crossings,
        "widths": trend,
        "top_label": top_label,
        "width": width,
    }


def _width_run(gap: dict, results: dict, name: str, w: int) -> dict:
    """Optimizer ``name`` at width ``w``: the width trend's (c) best run there (Dobb's),
    else (e)'s run, None if neither ran."""
    runs = results["widths"].get((name, w))
    return best_run(runs) if runs else gap["widths"].get((name, w))
