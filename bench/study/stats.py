"""Seed statistics of the optimizer study: mean and spread over seeds, and a difference of
means set against the seed noise (pooled std) with Welch's t."""

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.study.runs import loss_of

NOISE_FACTOR = 2.0  # a difference "exceeds the noise" when |diff| > 2 x (pooled) seed std


def seed_stats(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean and sample std (ddof 1) of final val loss over one optimizer's seed runs."""
    losses = [loss_of(s) for s in runs]
    finite = all(math.isfinite(x) for x in losses)
    return {
        "runs": [s["run"] for s in runs],
        "losses": losses,
        "n": len(losses),
        "mean": float(np.mean(losses)),
        "std": float(np.std(losses, ddof=1)) if finite and len(losses) > 1 else math.nan,
        "tokens_per_s": _mean_of(runs, "tokens_per_s"),
        "opt_ms": _mean_of(runs, "opt_ms"),
    }


def _mean_of(runs, key: str) -> float:
    values = [s[key] for s in runs if s.get(key) is not None]
    return float(np.mean(values)) if values else math.nan


def compare_seeds(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | bool]:
    """`a - b` in mean final val loss against the seed noise.

    pooled std s_p = sqrt(((n_a - 1) s_a² + (n_b - 1) s_b²) / (n_a + n_b - 2)); the difference
    exceeds the noise when |diff| > 2 s_p. Welch's t = diff / sqrt(s_a²/n_a + s_b²/n_b).
    """
    diff = a["mean"] - b["mean"]
    dof = a["n"] + b["n"] - 2
    pooled = math.sqrt(((a["n"] - 1) * a["std"] ** 2 + (b["n"] - 1) * b["std"] ** 2) / dof)
    se = math.sqrt(a["std"] ** 2 / a["n"] + b["std"] ** 2 / b["n"])
    if se > 0:
        welch = diff / se
    else:
        welch = 0.0 if diff == 0 else math.copysign(math.inf, diff)
    exceeds = bool(abs(diff) > NOISE_FACTOR * pooled) if math.isfinite(pooled) else False
    return {"diff": diff, "pooled_std": pooled, "welch_t": welch, "exceeds": exceeds}
