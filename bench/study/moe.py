"""Part (g) of the study: a mixture of experts.

The GPT of (a) (its depth and width) with each block's MLP a mixture of experts
(``moe_model``'s fields on top of the study's model: ``n_experts`` experts, each token routed
to ``expert_top_k`` of them; ``dobb.train.model.MoE``), trained by each entry of
``entries()``, the expert stacks stepped with its hidden matrices (``dobb train`` routes
them):

- each optimizer of ``moe_optimizers`` (a lab name) with its settings of (a)
  (``bench.compare.OPTIONS``), its lr grid centred on its tuned lr of (a), beside its dense
  numbers of (a);
- each configuration of (f) named in ``moe_tuned`` by its ``front`` label
  (``bench.study.tuning.tuned``, e.g. "Dobb, recommended": the library's default Dobb,
  which (a) does not run) with its options of (f), its grid centred on its tuned lr of (f)
  at (g)'s width, beside its dense numbers of (f) there.

Each runs its own lr grid, ``moe_lr_factors`` x that centre, extended one point at a time
(up to ``moe_max_extensions``) while its best lr sits at an edge, then ``moe_seeds`` seeds at
that best lr (seed 0 is the sweep's own run). Does the dense ordering hold for experts?
"""

from dataclasses import dataclass, field
from functools import partial
from itertools import combinations
from pathlib import Path
from typing import Any

import torch

from bench.optimizers import with_options
from bench.study.format import title
from bench.study.runs import Sweep, at_edge, best_run, loss_of, moe_config, run_config, tune
from bench.study.stats import compare_seeds, seed_stats
from bench.study.tuning import tuned
from dobb.train.config import ConfigError
from dobb.train.model import MLP, MoE


@dataclass(frozen=True)
class Entry:
    """One row of (g): ``name`` its key (a lab name of ``moe_optimizers`` or a front label of
    ``moe_tuned``), ``label`` as the document names it, the lab's ``optimizer`` with
    ``options`` on top of its harness options; ``tuned``: its index in
    ``bench.study.tuning.tuned(spec)`` (centre and dense numbers from (f)), None for (a)."""

    name: str
    label: str
    optimizer: str
    options: dict[str, Any] = field(default_factory=dict)
    tuned: int | None = None
    unit: float = 1.0  # its (f) configuration's `Tuned.unit` at (g)'s width


def entries(spec) -> list[Entry]:
    """The rows of (g) in report order: ``moe_optimizers``, then ``moe_tuned`` (validated
    by ``StudySpec.validate``)."""
    configs = tuned(spec)
    index = {t.front: i for i, t in enumerate(configs) if t.front}
    return [Entry(name, title(name), name) for name in spec.moe_optimizers] + [
        Entry(front, front, t.optimizer, dict(t.options), i, t.unit(width(spec)))
        for front, i, t in ((f, index[f], configs[index[f]]) for f in spec.moe_tuned)
    ]


def width(spec) -> int:
    """The width of (g)'s model: where an entry of (f) takes its tuned lr and dense numbers."""
    return moe_config(spec).n_embd


def centres(spec, best: dict[str, float], tuning: dict) -> dict[str, float]:
    """Each entry's grid centre: its tuned lr of (a) (``best``) or of (f) (``tuning``, the
    runs of ``run_tuning``) at (g)'s width."""
    return {
        e.name: best[e.optimizer]
        if e.tuned is None
        else best_run(tuning["sweeps"][(e.tuned, width(spec))])["lr"]
        for e in entries(spec)
    }


def check_moe_tuned(spec) -> None:
    """``ConfigError`` unless ``spec.moe_tuned`` names configurations of (f) by their
    ``front`` label, each once and none a name of ``moe_optimizers``' rows, and (f) tunes and
    seeds (g)'s width (``study`` checks it after ``load_spec``, before any run)."""
    fronts = [t.front for t in tuned(spec) if t.front]
    unknown = [name for name in spec.moe_tuned if name not in fronts]
    if unknown:
        raise ConfigError(
            f"study config: moe_tuned={spec.moe_tuned!r}: {unknown} is not the front label "
            f"of a configuration of (f) (bench/study/tuning.py); one of {fronts}"
        )
    labels = [title(name) for name in spec.moe_optimizers] + spec.moe_tuned
    twice = sorted({name for name in labels if labels.count(name) > 1})
    if twice:
        raise ConfigError(
            f"study config: moe_optimizers={spec.moe_optimizers!r} and moe_tuned="
            f"{spec.moe_tuned!r} name {twice} twice: (g)'s rows need distinct names"
        )
    width = moe_config(spec).n_embd
    if spec.moe_tuned and width not in spec.tuning_widths:
        raise ConfigError(
            f"study config: moe_tuned={spec.moe_tuned!r} needs (f)'s tuned lr and seeds at "
            f"(g)'s width {width}, which tuning_widths={spec.tuning_widths!r} leaves out"
        )


def run_moe(spec, base, out: Path, runner, best: dict[str, float], tuning: dict, log=print) -> dict:
    """Every run of (g); returns ``{"sweeps": {name: runs}, "seeds": {name: runs}}`` (each
    entry's grid sorted by lr; its seeds at the best lr, seed 0 first). ``best``: the tuned
    lrs of (a); ``tuning``: the runs of (f)."""
    make = partial(run_config, base, out, model=spec.moe_model)
    centre = centres(spec, best, tuning)
    sweeps = {
        e.name: Sweep(
            partial(make, e.optimizer, options=e.options),
            [centre[e.name] * f for f in spec.moe_lr_factors],
            spec.moe_max_extensions,
            e.unit,
        )
        for e in entries(spec)
    }
    log(f"(g) mixture of experts: {sum(len(s.grid) for s in sweeps.values())} runs + extensions")
    swept = tune(runner, sweeps)
    later = {
        (name, seed): Sweep(
            partial(sweeps[name].make, seed=seed), [best_run(runs)["lr"]], unit=sweeps[name].unit
        )
        for name, runs in swept.items()
        for seed in range(1, spec.moe_seeds)
    }
    log(f"(g) seeds: {len(later)} runs")
    done = tune(runner, later)
    seeds = {
        name: [best_run(runs)] + [done[(name, s)][0] for s in range(1, spec.moe_seeds)]
        for name, runs in swept.items()
    }
    return {"sweeps": swept, "seeds": seeds}


def all_runs(moe: dict) -> list[list[dict]]:
    """Every summary of (g), for the study's compute total."""
    return [*moe["sweeps"].values(), *moe["seeds"].values()]


def dense_numbers(spec, results: dict, seeds: dict) -> dict[str, dict[str, Any]]:
    """Each entry's dense numbers: tuned lr, sweep and seed statistics (``seed_stats``'s), of
    (a) (``seeds``: (a)'s statistics) or of (f) at (g)'s width; ``source`` names which."""
    w, dense = width(spec), {}
    for e in entries(spec):
        if e.tuned is None:
            runs, stats, source = results["main"][e.optimizer], seeds[e.optimizer], "(a)"
        else:
            key = (e.tuned, w)
            runs, source = results["tuning"]["sweeps"][key], f"(f) at width {w}"
            stats = seed_stats(results["tuning"]["seeds"][key])
        dense[e.name] = {
            "lr": best_run(runs)["lr"],
            "lrs": [s["lr"] for s in runs],
            "losses": [loss_of(s) for s in runs],
            "seeds": stats,
            "source": source,
        }
    return dense


def analyse_moe(moe: dict, spec, dense: dict) -> dict:
    """The numbers of (g): per entry its grid, tuned lr and seeds, beside its dense ones
    (``dense``: ``dense_numbers``'s); both orderings (entry names) by mean final val loss,
    and each pair's difference of means against its seed noise (``compare_seeds``), with
    experts and dense."""
    model = moe_config(spec)
    with torch.device("meta"):  # the MLPs' shapes, without allocating them
        experts, dense_mlp = MoE(model).experts, MLP(model)
    rows = []
    for e in entries(spec):
        runs = moe["sweeps"][e.name]
        rows.append(
            {
                "name": e.name,
                "label": e.label,
                "optimizer": e.optimizer,
                "options": with_options(e.optimizer, e.options),
                "lrs": [s["lr"] for s in runs],
                "run_lrs": [s.get("run_lr", s["lr"]) for s in runs],  # as trained (Sweep.unit)
                "losses": [loss_of(s) for s in runs],
                "runs": [s["run"] for s in runs],
                "best_lr": best_run(runs)["lr"],
                "at_edge": at_edge(runs),
                "seeds": seed_stats(moe["seeds"][e.name]),
                "num_params": runs[0].get("num_params"),
                "dense": dense[e.name],
            }
        )
    moe_seeds = {r["name"]: r["seeds"] for r in rows}
    dense_seeds = {r["name"]: r["dense"]["seeds"] for r in rows}
    return {
        "n_embd": model.n_embd,
        "n_layer": model.n_layer,
        "n_experts": model.n_experts,
        "expert_top_k": model.expert_top_k,
        "expert_hidden": experts.w1.shape[1],
        "dense_hidden": dense_mlp.fc.weight.shape[0],
        "router_aux_loss_coef": model.router_aux_loss_coef,
        "rows": rows,
        "order": _order(moe_seeds),
        "dense_order": _order(dense_seeds),
        "holds": _order(moe_seeds) == _order(dense_seeds),
        "pairs": [
            {
                "a": a,
                "b": b,
                "moe": compare_seeds(moe_seeds[a], moe_seeds[b]),
                "dense": compare_seeds(dense_seeds[a], dense_seeds[b]),
            }
            for a, b in combinations(moe_seeds, 2)
        ],
    }


def _order(seeds: dict) -> list[str]:
    """The entries by mean final val loss, lowest first."""
    return sorted(seeds, key=lambda name: seeds[name]["mean"])
