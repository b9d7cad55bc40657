"""Element-wise updates for the parameters a matrix optimizer does not precondition.

Embeddings, the LM head, norms and biases go to AdamW (or Lion) inside the same optimizer
object, routed by a parameter group's ``algorithm`` key. Both functions work on plain local
tensors and update ``param`` and ``state`` in place.
"""

import math

import torch
from torch import Tensor

SCALAR_ALGORITHMS = ("adamw", "lion")
SCALAR_DEFAULTS = {"adamw": {"betas": (0.9, 0.95), "eps": 1e-8}, "lion": {"betas": (0.9, 0.99)}}


def init_scalar_state(param: Tensor, algorithm: str) -> dict:
    """Zero moments (``exp_avg``, and ``exp_avg_sq`` for AdamW) shaped like ``param``."""
    state = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param)}
    if algorithm == "adamw":
        state["exp_avg_sq"] = torch.zeros_like(param)
    return state


def adamw_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """AdamW (Loshchilov & Hutter, arXiv 1711.05101), as ``torch.optim.AdamW`` computes it.

    ``step`` is the 1-based step count, after this step's increment.
    """
    beta1, beta2 = betas
    # W <- W (1 - lr wd)
    param.mul_(1 - lr * weight_decay)
    # m <- beta1 m + (1 - beta1) g ;  v <- beta2 v + (1 - beta2) g^2
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    # W <- W - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**step))


def lion_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
) -> None:
    """Lion (Chen et al., arXiv 2302.06675): sign of an interpolated momentum."""
    beta1, beta2 = betas
    # u = sign(beta1 m + (1 - beta1) g)
    update = exp_avg.lerp(grad, 1 - beta1).sign_()
    # W <- W (1 - lr wd) - lr u
    param.mul_(1 - lr * weight_decay).add_(update, alpha=-lr)
    # m <- beta2 m + (1 - beta2) g
    exp_avg.lerp_(grad, 1 - beta2)
