"""Part (g) of the study: a mixture of experts.

The GPT of (a) (its depth and width) with each block's MLP a mixture of experts
(``moe_model``'s fields on top of the study's model: ``n_experts`` experts, each token routed
to ``expert_top_k`` of them; ``dobb.train.model.MoE``), trained by each optimizer of
``moe_optimizers`` with its settings of (a) (``bench.compare.OPTIONS``), the expert stacks
stepped with its hidden matrices (``dobb train`` routes them). Each optimizer runs its own lr
grid, ``moe_lr_factors`` x its tuned lr of (a) (the dense model's, same width), extended one
point at a time (up to ``moe_max_extensions``) while its best lr sits at an edge, then
``moe_seeds`` seeds at that best lr (seed 0 is the sweep's own run). Beside each, the dense
numbers of (a): does the dense ordering of the optimizers hold for experts?

An optimizer joins (g) by its name in ``moe_optimizers`` (``bench/study/budget.yaml``); one
that cannot step expert stacks (Dobb, until it can) stops its first run with the reason.
"""

from functools import partial
from itertools import combinations
from pathlib import Path

import torch

from bench.study.runs import Sweep, at_edge, best_run, loss_of, moe_config, run_config, tune
from bench.study.stats import compare_seeds, seed_stats
from dobb.train.model import MLP, MoE


def run_moe(spec, base, out: Path, runner, best: dict[str, float], log=print) -> dict:
    """Every run of (g); returns ``{"sweeps": {name: runs}, "seeds": {name: runs}}`` (each
    optimizer's grid sorted by lr; its seeds at the best lr, seed 0 first). ``best``: the
    tuned lrs of (a)."""
    make = partial(run_config, base, out, model=spec.moe_model)
    sweeps = {
        name: Sweep(
            partial(make, name),
            [best[name] * f for f in spec.moe_lr_factors],
            spec.moe_max_extensions,
        )
        for name in spec.moe_optimizers
    }
    log(f"(g) mixture of experts: {sum(len(s.grid) for s in sweeps.values())} runs + extensions")
    tuned = tune(runner, sweeps)
    later = {
        (name, seed): Sweep(partial(make, name, seed=seed), [best_run(runs)["lr"]])
        for name, runs in tuned.items()
        for seed in range(1, spec.moe_seeds)
    }
    log(f"(g) seeds: {len(later)} runs")
    done = tune(runner, later)
    seeds = {
        name: [best_run(runs)] + [done[(name, s)][0] for s in range(1, spec.moe_seeds)]
        for name, runs in tuned.items()
    }
    return {"sweeps": tuned, "seeds": seeds}


def all_runs(moe: dict) -> list[list[dict]]:
    """Every summary of (g), for the study's compute total."""
    return [*moe["sweeps"].values(), *moe["seeds"].values()]


def analyse_moe(moe: dict, spec, dense: dict) -> dict:
    """The numbers of (g): per optimizer its grid, tuned lr and seeds, beside (a)'s dense
    ones (``dense``: ``{name: {"lr", "lrs", "losses", "seeds"}}``, its seed statistics as
    ``seed_stats``'s); both orderings by mean final val loss, and each pair's difference of
    means against its seed noise (``compare_seeds``), with experts and dense."""
    model = moe_config(spec)
    with torch.device("meta"):  # the MLPs' shapes, without allocating them
        experts, dense_mlp = MoE(model).experts, MLP(model)
    rows = []
    for name, runs in moe["sweeps"].items():
        stats = seed_stats(moe["seeds"][name])
        rows.append(
            {
                "optimizer": name,
                "lrs": [s["lr"] for s in runs],
                "losses": [loss_of(s) for s in runs],
                "runs": [s["run"] for s in runs],
                "best_lr": best_run(runs)["lr"],
                "at_edge": at_edge(runs),
                "seeds": stats,
                "num_params": runs[0].get("num_params"),
                "dense": dense[name],
            }
        )
    moe_seeds = {r["optimizer"]: r["seeds"] for r in rows}
    dense_seeds = {r["optimizer"]: r["dense"]["seeds"] for r in rows}
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
    """The optimizers by mean final val loss, lowest first."""
    return sorted(seeds, key=lambda name: seeds[name]["mean"])
