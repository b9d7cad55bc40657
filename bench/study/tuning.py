"""Part (f) of the study: every optimizer tuned at every width.

(a) tunes at one width and (c), (e) reuse those lrs at wider models. Sign updates have no
width-transfer rule, so (f) tunes each configuration of ``tuned()`` at each width of
``tuning_widths`` (and the ``wide`` ones also at ``tuning_wide_widths``) on its own
log-spaced grid:

- at the study's width, ``tuning_lr_factors`` x the lr of (a) for its optimizer (times
  ``lr_scale``);
- at each wider width, the same factors x its tuned lr at the previous width,

each grid extended one point at a time (up to ``tuning_max_extensions``) while its best lr
sits at an edge, then ``tuning_seeds`` seeds at every best lr of ``tuning_widths`` (seed 0
is the sweep's own run) and, at each wide width, at Muon's and the ``tuning_wide_seeded``
best shard-local configurations' (the others keep seed 0 only). Each of ``variants()``
(a configuration with one change, e.g. another basis solver) runs at that configuration's
tuned lr of every width of ``tuning_widths`` with ``tuning_seeds`` seeds, set against its
seeds there. A configuration shares its runs with the other parts wherever the settings
agree (same run name), so nothing is trained twice.

"Shard-local" as in (e): no collective inside ``step()`` besides the statistics average, at
4 row shards (FSDP); AdamW is elementwise, so it is.
"""

import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from bench.compare import OPTIONS
from bench.model.workload import transformer_matrices
from bench.study.gap import WHOLE
from bench.study.runs import (
    Sweep,
    at_edge,
    best_run,
    loss_of,
    row_block_options,
    run_config,
    tune,
    width_of,
)
from bench.study.stats import compare_seeds, seed_stats
from dobb.optim.dobb import BLOCK_WIDTH
from dobb.optim.dobb_core import WIDTH_REFERENCE
from dobb.registry import get_entry


@dataclass(frozen=True)
class Tuned:
    """One configuration of (f): ``OPTIONS[optimizer]`` with ``options`` on top."""

    label: str
    optimizer: str
    options: dict[str, Any] = field(default_factory=dict)
    shard_local: bool = False
    wide: bool = False  # also tuned at `tuning_wide_widths`
    lr_scale: float = 1.0  # first grid's centre: lr_scale x (a)'s tuned lr of `centre`
    centre: str | None = None  # None: `optimizer`
    scale_rule: bool = False  # a width-aware update scale: run with `tuning_scale_rules`
    front: str | None = None  # its name on the front page's figure (README), if there
    # the lab entry whose defaults apply update_scale="width" (alpha = 256/width) on top of
    # `options` (alpha = 1): lr x of the rule at width w is lr x * 256/w at alpha = 1, the
    # same computation (weight decay 0 and every hidden matrix of the study's GPT has the
    # model's width as its narrowest input: alpha multiplies lr and nothing else), so the
    # sweeps read those runs in the rule's units (`Sweep.unit`); one run of the entry itself
    # per width, at the tuned lr, checks the identity (`rule_checks`)
    width_rule: str | None = None

    def unit(self, width: int) -> float:
        """What an lr of this configuration's grid is worth in its runs' lr at ``width``."""
        return WIDTH_REFERENCE / width if self.width_rule else 1.0

    def sharded(self) -> bool:
        """Whether its update depends on the number of row shards (it has row blocks)."""
        return "row_blocks" in OPTIONS[self.optimizer]


@dataclass(frozen=True)
class Variant:
    """A configuration of ``tuned()`` (label ``of``) with ``options`` on top, run at that
    configuration's tuned lr with ``tuning_seeds`` seeds at every width of ``tuning_widths``
    (no grid of its own) and set against its seeds there: whether a change is within the
    seed noise at each width."""

    label: str
    of: str
    options: dict[str, Any]


RECOMMENDED = (
    "recommended Dobb (two-sided SOAP, one input block, one row block per shard, "
    "update x 256/width)"
)
# the recommended configuration's options but for its width rule: alpha = 1 at every width
UNSCALED = WHOLE | {"row_blocks": None, "coefficients": "adam", "update_scale": 1.0}


def variants() -> list[Variant]:
    """The variants of (f), in report order."""
    cholqr = {"basis_method": "cholqr"}  # the batched orthogonal iteration, not eigh
    return [Variant("Dobb, 16 blocks, Cholesky-QR refresh", "Dobb, 16 blocks", cholqr)]


def tuned(spec=None) -> list[Tuned]:
    """The configurations of (f), in report order; the width-aware update scales (Muon's
    RMS, ``update_scale="muon"``: ``1/sqrt(d_in)``) only if ``spec.tuning_scale_rules``."""
    soap = {"num_blocks": 1, "coefficients": "adam", "update_scale": 1.0}
    muon_rms = {"update_scale": "muon"}
    rules = [
        Tuned(
            "Dobb, one block, Muon's RMS scale",
            "dobb_paper",
            {"num_blocks": 1} | muon_rms,
            True,
            centre="muon",
            scale_rule=True,
        ),
        Tuned(
            "two-sided Dobb, one input block, Muon's RMS scale",
            "dobb_sign",
            WHOLE | muon_rms,
            True,
            centre="muon",
            scale_rule=True,
        ),
    ]
    return [
        Tuned("Muon", "muon", wide=True, front="Muon"),
        Tuned("NorMuon", "normuon"),
        Tuned("NorDion2", "nordion2", wide=True),
        Tuned("BlockMuon", "blockmuon", shard_local=True, wide=True),
        Tuned("MuonBP", "muonbp"),
        Tuned("Dion", "dion", front="Dion"),
        Tuned("Dobb, 16 blocks", "dobb_paper", shard_local=True, front="Dobb, the paper's"),
        Tuned("Dobb, one block", "dobb_paper", {"num_blocks": 1}, shard_local=True, wide=True),
        Tuned("two-sided Dobb, one input block", "dobb_sign", WHOLE, shard_local=True, wide=True),
        Tuned("one-sided SOAP (Dobb, Adam coefficients, one block)", "dobb_paper", soap, True),
        # variance adaptation in place of the sign at the recommended layout (arXiv 2510.25000
        # finds it ahead of sign descent); one-sided, Adam coefficients wanted twice the sign's
        # lr at width 128, so its grid is centred on twice two-sided Dobb's
        Tuned(
            "two-sided SOAP (two-sided Dobb, Adam coefficients, one input block)",
            "dobb_sign",
            WHOLE | {"coefficients": "adam", "update_scale": 1.0},
            True,
            lr_scale=2.0,
        ),
        # the library's default (the recommended configuration): two-sided SOAP with one input
        # block and one row block of each rank's rows (in one process: all rows), its update
        # scaled by 256/width; its runs are the next configuration's (alpha = 1) read in the
        # rule's lr (`width_rule`), and its grid at the first width maps onto that one's
        Tuned(
            RECOMMENDED,
            "dobb_sign",
            UNSCALED,
            True,
            wide=True,
            front="Dobb, recommended",
            width_rule="dobb",
        ),
        Tuned(
            "two-sided SOAP, one input block, one row block per shard (update not scaled by width)",
            "dobb_sign",
            UNSCALED,
            True,
            wide=True,
            lr_scale=2.0,
        ),
        Tuned("AdamW", "adamw", shard_local=True, front="AdamW"),
        *(rules if spec is not None and spec.tuning_scale_rules else []),
    ]


def widths_of(spec, t: Tuned) -> list[int]:
    """The widths configuration ``t`` is tuned at, narrowest first."""
    return sorted(set(spec.tuning_widths) | (set(spec.tuning_wide_widths) if t.wide else set()))


def run_tuning(spec, base, out: Path, runner, best: dict[str, float], log=print) -> dict:
    """Every run of (f); returns ``{"sweeps": {(i, width): runs}, "seeds": {(i, width):
    runs}}`` with ``i`` the index in ``tuned()``."""
    make = partial(run_config, base, out)
    width, configs = width_of(base), tuned(spec)

    def sweep(t: Tuned, w: int, grid, extensions: int = 0, **kw) -> Sweep:
        kw = {"options": t.options} | kw
        run = partial(make, t.optimizer, width=None if w == width else w, **kw)
        return Sweep(run, grid, extensions, t.unit(w))

    centre = {i: best[t.centre or t.optimizer] * t.lr_scale for i, t in enumerate(configs)}
    sweeps: dict = {}
    for w in sorted({w for t in configs for w in widths_of(spec, t)}):
        round_ = {
            (i, w): sweep(
                t, w, [centre[i] * f for f in spec.tuning_lr_factors], spec.tuning_max_extensions
            )
            for i, t in enumerate(configs)
            if w in widths_of(spec, t)
        }
        log(f"(f) width {w}: {sum(len(s.grid) for s in round_.values())} runs + extensions")
        sweeps |= tune(runner, round_)
        centre |= {i: best_run(sweeps[(i, w)])["lr"] for i, _ in round_}
    chosen = _seeded(spec, configs, sweeps)
    seeded = {key: range(1, spec.tuning_seeds if key in chosen else 1) for key in sweeps}
    later = {
        (key, seed): sweep(configs[key[0]], key[1], [best_run(runs)["lr"]], seed=seed)
        for key, runs in sweeps.items()
        for seed in seeded[key]
    }
    shard_width = spec.tuning_widths[-1]
    for n in spec.tuning_shard_counts:  # the row-shard trend at the tuned lrs there
        for i, t in enumerate(configs):
            if t.sharded() and not t.scale_rule and (i, shard_width) in sweeps:
                lr = best_run(sweeps[(i, shard_width)])["lr"]
                rows = row_block_options(t.optimizer, n, t.options)  # its own: the sweep's
                later[("shards", i, n)] = sweep(t, shard_width, [lr], options=t.options | rows)
    index = {t.label: i for i, t in enumerate(configs)}
    for v, variant in enumerate(variants()):  # at the tuned lrs of tuning_widths, seeded
        i = index[variant.of]
        for w in spec.tuning_widths:
            lr = best_run(sweeps[(i, w)])["lr"]
            for seed in range(spec.tuning_seeds):
                options = configs[i].options | variant.options
                later[("variant", v, w, seed)] = sweep(
                    configs[i], w, [lr], options=options, seed=seed
                )
    for (i, w), runs in sweeps.items():  # the width rule's entry itself, at its tuned lr
        if configs[i].width_rule:
            rule = partial(make, configs[i].width_rule, width=None if w == width else w)
            later[("rule", i, w)] = Sweep(rule, [best_run(runs)["lr"]])
    log(f"(f) seeds, row shards, variants and rule checks: {len(later)} runs")
    done = tune(runner, later)
    seeds = {
        key: [best_run(runs)] + [done[(key, s)][0] for s in seeded[key]]
        for key, runs in sweeps.items()
    }
    shards = {(i, n): done[("shards", i, n)][0] for _, i, n in filter(_is_shard, later)}
    variant_seeds = {
        (v, w): [done[("variant", v, w, s)][0] for s in range(spec.tuning_seeds)]
        for v, _ in enumerate(variants())
        for w in spec.tuning_widths
    }
    checks = {(i, w): done[("rule", i, w)][0] for _, i, w in filter(_is_rule, later)}
    return {
        "sweeps": sweeps,
        "seeds": seeds,
        "rule_checks": checks,
        "shards": shards,
        "shard_width": shard_width,
        "configs": configs,
        "variants": variant_seeds,
    }


def _seeded(spec, configs: list[Tuned], sweeps: dict) -> set:
    """The sweeps whose best lr gets ``tuning_seeds`` seeds: every one at ``tuning_widths``;
    at each wide width Muon's and the ``tuning_wide_seeded`` best shard-local ones'."""
    keys = {key for key in sweeps if key[1] in spec.tuning_widths}
    for w in spec.tuning_wide_widths:
        at = {i: loss_of(best_run(runs)) for (i, v), runs in sweeps.items() if v == w}
        local = sorted((i for i in at if configs[i].shard_local), key=at.get)
        muon = [i for i in at if configs[i].label == "Muon"]
        keys |= {(i, w) for i in muon + local[: spec.tuning_wide_seeded]}
    return keys


def _is_shard(key) -> bool:
    return key[0] == "shards"


def _is_rule(key) -> bool:
    return key[0] == "rule"


def all_runs(tuning: dict) -> list[list[dict]]:
    """Every summary of (f), for the study's compute total."""
    return [
        *tuning["sweeps"].values(),
        *tuning["seeds"].values(),
        [*tuning["shards"].values()],
        [*tuning["rule_checks"].values()],
        *tuning["variants"].values(),
    ]


# ---- analysis --------------------------------------------------------------------------


def analyse_tuning(tuning: dict) -> dict:
    """The numbers of (f): per configuration and width the grid, the tuned lr, its seeds;
    whether the tuned lr moved between widths; the best shard-local one against Muon."""
    rows = []
    for i, t in enumerate(tuning["configs"]):
        per_width = []
        for (j, w), runs in sorted(tuning["sweeps"].items()):
            if j != i:
                continue
            stats = seed_stats(tuning["seeds"][(j, w)])
            per_width.append(
                {
                    "n_embd": w,
                    "lrs": [s["lr"] for s in runs],
                    "run_lrs": [s.get("run_lr", s["lr"]) for s in runs],  # as trained
                    "losses": [loss_of(s) for s in runs],
                    "best_lr": best_run(runs)["lr"],
                    "at_edge": at_edge(runs),
                    "seeds": stats,
                }
            )
        rows.append(
            {
                "label": t.label,
                "optimizer": t.optimizer,
                "options": dict(t.options),
                "shard_local": t.shard_local,
                "front": t.front,
                "widths": per_width,
                "moves": [_move(a, b) for a, b in zip(per_width, per_width[1:])],
            }
        )
    widths = sorted({w for _, w in tuning["sweeps"]})
    best_local = []
    for w in widths:
        at = {r["label"]: e for r in rows for e in r["widths"] if e["n_embd"] == w}
        local = {k: at[k]["seeds"]["mean"] for k in at if _row(rows, k)["shard_local"]}
        name = min(local, key=local.get)
        a, muon = at[name]["seeds"], at["Muon"]["seeds"]
        noise = compare_seeds(a, muon) if min(a["n"], muon["n"]) >= 2 else None
        best_local.append(
            {
                "n_embd": w,
                "label": name,
                "mean": a["mean"],
                "muon": muon["mean"],
                "gap": a["mean"] - muon["mean"],
                "noise": noise,
            }
        )
    return {
        "rows": rows,
        "widths": widths,
        "best_local": best_local,
        "rule_checks": _rule_checks(tuning, rows),
        "shards": _shard_rows(tuning, rows),
        "variants": _variant_rows(tuning),
    }


def _rule_checks(tuning: dict, rows: list[dict]) -> list[dict]:
    """Per width rule (``Tuned.width_rule``) and width: its entry's own run at the tuned lr
    against the run it was read from (``difference``: the largest of the final train and val
    losses' differences; 0 is the same computation), and what the entry's default lr costs
    there against the tuned loss."""
    checks = []
    for (i, w), run in sorted(tuning["rule_checks"].items()):
        t, row = tuning["configs"][i], rows[i]
        read = best_run(tuning["sweeps"][(i, w)])
        entry = next(e for e in row["widths"] if e["n_embd"] == w)
        default = get_entry(t.width_rule).lr
        kept = dict(zip(entry["lrs"], entry["losses"])).get(default)
        keys = ("final_val_loss", "final_train_loss")
        widest = max(m.d_in for m in transformer_matrices(w, 1))
        checks.append(
            {
                "label": t.label,
                "entry": t.width_rule,
                "n_embd": w,
                "lr": read["lr"],
                "run_lr": read.get("run_lr", read["lr"]),  # at width 256 the unit is 1
                "difference": max(abs(run[k] - read[k]) for k in keys),
                "loss": loss_of(run),
                "read_loss": loss_of(read),
                # the entry cuts inputs into blocks of at most BLOCK_WIDTH (the library's
                # defaults), the read configuration keeps one block per matrix: one layout
                # only while every hidden matrix is at most BLOCK_WIDTH wide
                "widest_input": widest,
                "same_blocks": widest <= BLOCK_WIDTH,
                "default_lr": default,
                "default_cost": None if kept is None else kept - min(entry["losses"]),
            }
        )
    return checks


def _variant_rows(tuning: dict) -> list[dict]:
    """Each variant at each width: its seeds against its configuration's seeds there (the
    difference of means, ``compare_seeds``)."""
    index = {t.label: i for i, t in enumerate(tuning["configs"])}
    rows = []
    for (v, w), runs in sorted(tuning["variants"].items()):
        variant = variants()[v]
        stats = seed_stats(runs)
        reference = seed_stats(tuning["seeds"][(index[variant.of], w)])
        rows.append(
            {
                "label": variant.label,
                "of": variant.of,
                "options": dict(variant.options),
                "n_embd": w,
                "lr": runs[0]["lr"],
                "seeds": stats,
                "reference": reference,
                "pair": compare_seeds(stats, reference),
            }
        )
    return rows


def _shard_rows(tuning: dict, rows: list[dict]) -> dict:
    """The row-shard trend at ``shard_width``: per row-shard count, every sharded
    configuration's loss (seed 0, its tuned lr there), and per count the best shard-local
    configuration, the flat ones (no row blocks) at their seed-0 losses too."""
    w = tuning["shard_width"]
    counts = sorted({n for _, n in tuning["shards"]})
    sharded = sorted({i for i, _ in tuning["shards"]})
    flat = {
        r["label"]: min(e["losses"])
        for r, t in zip(rows, tuning["configs"])
        for e in r["widths"]
        if e["n_embd"] == w and not t.sharded()
    }
    table = []
    for n in counts:
        losses = {rows[i]["label"]: loss_of(tuning["shards"][(i, n)]) for i in sharded}
        local = {k: v for k, v in (losses | flat).items() if _row(rows, k)["shard_local"]}
        best = min(local, key=local.get)
        table.append(
            {
                "row_shards": n,
                "losses": losses,
                "best_local": best,
                "best": local[best],
                "muon": flat.get("Muon"),
            }
        )
    return {"n_embd": w, "flat": flat, "rows": table}


def _row(rows: list[dict], label: str) -> dict:
    return next(r for r in rows if r["label"] == label)


def _move(narrow: dict, wide: dict) -> dict:
    """How the tuned lr moved from one width to the next, and what keeping the narrow
    width's lr costs at the wide one (None when that lr is not in the wide grid)."""
    ratio = wide["best_lr"] / narrow["best_lr"]
    kept = dict(zip(wide["lrs"], wide["losses"])).get(narrow["best_lr"])
    best = min(wide["losses"])
    cost = kept - best if kept is not None and math.isfinite(kept) else None
    return {
        "from": narrow["n_embd"],
        "to": wide["n_embd"],
        "ratio": ratio,
        "transfers": math.isclose(ratio, 1.0, rel_tol=1e-3),
        "cost": cost,
    }
