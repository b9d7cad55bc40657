"""Part (f), continued: the recommended Dobb at many row shards.

Under FSDP each rank holds ``d_out / P`` rows of every matrix, and the recommended Dobb's row
blocks are those rows (``row_blocks=P`` emulates P ranks in one process: the same update).
More ranks make smaller row blocks, so the row side sees less of each matrix. At each width
of ``many_shards_widths`` (each one (f) tunes the recommended configuration at) and each
count of ``many_shards_counts``:

- the recommended configuration at its tuned lr of (f) there, seed 0 (the row-shard trend of
  (f) at its own width: the same runs);
- ``many_shards_seeds`` seeds at the ``(width, count)`` pairs of ``many_shards_seeded``;
- its lr retuned, ``many_shards_lr_factors`` x the tuned lr, at the pairs of
  ``many_shards_retuned``: whether fewer rows per block move the best lr;

each set against Muon's seeds of (f) at that width, which do not depend on the count (Muon
gathers whole matrices), and against the configurations of (f) with no row blocks (the
one-sided ones), which do not either.
"""

import math
from functools import partial
from pathlib import Path

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
from bench.study.tuning import RECOMMENDED, widths_of
from dobb.train.config import ConfigError


def check_many_shards(spec, configs) -> None:
    """``ConfigError`` unless every width of ``many_shards_widths`` is one (f) tunes the
    recommended configuration at, and every seeded or retuned pair names one of those widths
    and a count of ``many_shards_counts`` (``study`` checks it before any run)."""
    recommended = next(t for t in configs if t.label == RECOMMENDED)
    tuned_at = widths_of(spec, recommended)
    missing = [w for w in spec.many_shards_widths if w not in tuned_at]
    if missing:
        raise ConfigError(
            f"study config: many_shards_widths={spec.many_shards_widths!r}: (f) does not tune "
            f"the recommended Dobb at {missing} (its widths: {tuned_at})"
        )
    for key in ("many_shards_seeded", "many_shards_retuned"):
        bad = [
            p
            for p in getattr(spec, key)
            if len(p) != 2
            or p[0] not in spec.many_shards_widths
            or p[1] not in spec.many_shards_counts
        ]
        if bad:
            raise ConfigError(
                f"study config: {key}: {bad} is not a [width, count] pair of "
                f"many_shards_widths={spec.many_shards_widths!r} and "
                f"many_shards_counts={spec.many_shards_counts!r}"
            )


def run_many_shards(spec, base, out: Path, runner, tuning: dict, log=print) -> dict:
    """Every run of this part; returns ``{"seeds": {(w, n): runs}, "lrs": {(w, n): runs}}``:
    per pair its seeds at the tuned lr (seed 0 first; one where not seeded) and its lr grid
    (sorted by lr; the tuned lr alone where not retuned). ``tuning``: the runs of (f)."""
    configs, width = tuning["configs"], width_of(base)
    i = next(k for k, t in enumerate(configs) if t.label == RECOMMENDED)
    t = configs[i]
    seeded = {tuple(p) for p in spec.many_shards_seeded}
    retuned = {tuple(p) for p in spec.many_shards_retuned}
    sweeps = {}
    for w in spec.many_shards_widths:
        lr = best_run(tuning["sweeps"][(i, w)])["lr"]
        for n in spec.many_shards_counts:
            options = t.options | row_block_options(t.optimizer, n, t.options)
            make = partial(
                run_config, base, out, t.optimizer, options=options, width=None if w == width else w
            )
            factors = [1.0, *spec.many_shards_lr_factors] if (w, n) in retuned else [1.0]
            sweeps[("lrs", w, n)] = Sweep(make, [lr * f for f in factors], unit=t.unit(w))
            for seed in range(1, spec.many_shards_seeds if (w, n) in seeded else 1):
                sweeps[("seed", w, n, seed)] = Sweep(partial(make, seed=seed), [lr], unit=t.unit(w))
    log(f"(f) many row shards: {sum(len(s.grid) for s in sweeps.values())} runs")
    done = tune(runner, sweeps)
    lrs = {(w, n): done[("lrs", w, n)] for _, w, n in (k for k in done if k[0] == "lrs")}
    seeds = {
        (w, n): [_tuned_run(runs, best_run(tuning["sweeps"][(i, w)])["lr"])]
        + [done[k][0] for k in sorted(done) if k[0] == "seed" and k[1:3] == (w, n)]
        for (w, n), runs in lrs.items()
    }
    return {"seeds": seeds, "lrs": lrs, "index": i}


def _tuned_run(runs: list[dict], lr: float) -> dict:
    """The run of a pair's grid at (f)'s tuned lr (its seed 0)."""
    return next(s for s in runs if math.isclose(s["lr"], lr, rel_tol=1e-6))


def all_runs(shards: dict) -> list[list[dict]]:
    """Every summary of this part, for the study's compute total."""
    return [*shards["lrs"].values(), *(runs[1:] for runs in shards["seeds"].values())]


def analyse_many_shards(shards: dict, tuning: dict) -> dict:
    """Per width and count: the recommended Dobb's seeds at its tuned lr against Muon's seeds
    at that width (``compare_seeds`` where both have two or more), its lr grid and best lr
    there, and the best configuration of (f) with no row blocks (seed means) at that width."""
    configs = tuning["configs"]
    muon = next(k for k, t in enumerate(configs) if t.label == "Muon")
    rows = []
    for (w, n), runs in sorted(shards["seeds"].items()):
        stats, reference = seed_stats(runs), seed_stats(tuning["seeds"][(muon, w)])
        flat = {
            t.label: seed_stats(tuning["seeds"][(k, w)])["mean"]
            for k, t in enumerate(configs)
            if not t.sharded() and t.shard_local and (k, w) in tuning["seeds"]
        }
        grid = shards["lrs"][(w, n)]
        one_sided = min(flat, key=flat.get) if flat else None
        rows.append(
            {
                "n_embd": w,
                "row_shards": n,
                "seeds": stats,
                "muon": reference,
                "gap": stats["mean"] - reference["mean"],
                "noise": compare_seeds(stats, reference)
                if min(stats["n"], reference["n"]) >= 2
                else None,
                "lrs": [s["lr"] for s in grid],
                "losses": [loss_of(s) for s in grid],
                "best_lr": best_run(grid)["lr"],
                "tuned_lr": runs[0]["lr"],
                "one_sided": one_sided,
                "one_sided_loss": flat.get(one_sided),
            }
        )
    return {"label": configs[shards["index"]].label, "rows": rows}
