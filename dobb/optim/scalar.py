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

from dobb.optim.batching import each, foreach_mul_

SCALAR_ALGORITHMS = ("adamw", "lion")
# A scalar group's defaults. Its learning rate and weight decay are its own, never the
# matrix optimizer's: torch.optim would otherwise fill them in from the constructor's, so
# Muon's lr of 0.02 would step embeddings, norms and the head with AdamW at 0.02, and
# Dion's weight decay of 0.01 would decay them while Muon's 0 would not. The lr is AdamW's
# usual 1e-3 (the lab's studies keep it for every optimizer); weight decay none, as nanoGPT
# leaves norms and biases undecayed.
SCALAR_DEFAULTS = {
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0},
    "lion": {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.0},
}


def init_scalar_state(param: Tensor, algorithm: str, capturable: bool = False) -> dict:
    """Zero moments (``exp_avg``, and ``exp_avg_sq`` for AdamW) shaped like ``param``; the
    step count on the CPU, or on the device if ``capturable``."""
    step = torch.zeros((), device=param.device if capturable else "cpu")
    state = {"step": step, "exp_avg": torch.zeros_like(param)}
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
    live: Tensor | None = None,
) -> None:
    """``adamw_update`` of many tensors, as ``torch.optim.AdamW(foreach=True)`` computes it
    (the same kernels and scalars, so the same bits). ``steps``: 1-based counts, as floats;
    with ``live`` (capturable) device tensors, and ``_adamw_capturable`` runs."""
    if live is not None:
        _adamw_capturable(
            params, grads, exp_avgs, exp_avg_sqs, steps, live, lr, betas, eps, weight_decay
        )
        return
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


def _adamw_capturable(params, grads, exp_avgs, exp_avg_sqs, steps, live, lr, betas, eps, wd):
    """``adamw_updates`` with no host read: bias corrections from the device ``steps``
    (already advanced by ``live``), and a no-op where ``live`` is 0 (non-finite inputs)."""
    beta1, beta2 = betas
    lr = live * lr  # 0 on a skipped step: the parameters stay
    foreach_mul_(params, 1 - lr * wd)
    # m <- beta1 m + (1 - beta1) g ;  v <- beta2 v + (1 - beta2) g^2  (both kept if skipped)
    grads = [torch.where(live.bool(), g, 0) for g in grads]
    torch._foreach_lerp_(exp_avgs, grads, [live * (1 - beta1)] * len(grads))
    foreach_mul_(exp_avg_sqs, torch.where(live.bool(), beta2, 1.0))
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    # W <- W - m / ((sqrt(v) / sqrt(1 - beta2^t) + eps) (1 - beta1^t) / lr)
    corrections1 = torch._foreach_pow(beta1, steps)
    corrections2 = torch._foreach_pow(beta2, steps)
    torch._foreach_sub_(corrections1, 1)  # beta1^t - 1: the step's sign folded in
    torch._foreach_neg_(corrections2)
    torch._foreach_add_(corrections2, 1)
    torch._foreach_sqrt_(corrections2)
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, corrections2)
    torch._foreach_add_(denoms, eps)
    torch._foreach_mul_(denoms, torch._foreach_div(corrections1, each(lr, corrections1)))
    torch._foreach_addcdiv_(params, exp_avgs, denoms)


def lion_updates(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    live: Tensor | None = None,
) -> None:
    """``lion_update`` of many tensors with ``torch._foreach_*`` kernels; with ``live``
    (capturable) a no-op where it is 0."""
    beta1, beta2 = betas
    if live is not None:  # a skipped step: g := m keeps m, u := 0 and no decay keep W
        grads = [torch.where(live.bool(), g, m) for g, m in zip(grads, exp_avgs)]
    # u = sign(beta1 m + (1 - beta1) g)
    updates = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
    torch._foreach_sign_(updates)
    factor = 1 - lr * weight_decay
    if live is not None:
        torch._foreach_mul_(updates, each(live, updates))
        factor = torch.where(live.bool(), factor, 1.0)
    # W <- W (1 - lr wd) - lr u
    foreach_mul_(params, factor)
    if isinstance(lr, Tensor):
        torch._foreach_mul_(updates, each(-lr, updates))
        torch._foreach_add_(params, updates)
    else:
        torch._foreach_add_(params, updates, alpha=-lr)
    # m <- beta2 m + (1 - beta2) g
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta2)
