"""Element-wise updates for the parameters a matrix optimizer does not precondition.

Embeddings, the LM head, norms and biases go to AdamW (or Lion) inside the same optimizer
object, routed by a parameter group's ``algorithm`` key. Every function works on plain local
tensors and updates ``param`` and the moments in place. ``adamw_update`` and ``lion_update``
take one tensor and are the readable references; ``adamw_updates`` and ``lion_updates``
take lists and run torch's multi-tensor (``_foreach_*``) kernels, a few per group.
"""

import math

import torch
from torch import Tensor

from dobb.optim.batching import foreach_mul_

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


def adamw_updates(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[float],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """``adamw_update`` of many tensors, as ``torch.optim.AdamW(foreach=True)`` computes it
    (the same kernels and scalars, so the same bits). ``steps``: 1-based counts, as floats."""
    beta1, beta2 = betas
    # W <- W (1 - lr wd)
    if weight_decay != 0:
        foreach_mul_(params, 1 - lr * weight_decay)
    # m <- beta1 m + (1 - beta1) g ;  v <- beta2 v + (1 - beta2) g^2
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    # W <- W - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    step_sizes = [-lr / (1 - beta1**t) for t in steps]
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, [(1 - beta2**t) ** 0.5 for t in steps])
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, step_sizes)


def lion_updates(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
) -> None:
    """``lion_update`` of many tensors with ``torch._foreach_*`` kernels."""
    beta1, beta2 = betas
    # u = sign(beta1 m + (1 - beta1) g)
    updates = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
    torch._foreach_sign_(updates)
    # W <- W (1 - lr wd) - lr u
    foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_add_(params, updates, alpha=-lr)
    # m <- beta2 m + (1 - beta2) g
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta2)
