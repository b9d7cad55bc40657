"""Muon: MomentUm Orthogonalized by Newton-Schulz (Keller Jordan, 2024).

A faithful baseline of https://github.com/KellerJordan/Muon (post:
https://kellerjordan.github.io/posts/muon/): SGD with Nesterov momentum whose update is
replaced by (approximately) the nearest semi-orthogonal matrix, computed with five quintic
Newton-Schulz iterations in bfloat16. ``newton_schulz`` is a pure function on a local
matrix so that a distributed Muon can reuse it after gathering a whole matrix.
"""

import math
from typing import Any

import torch
from torch import Tensor

from dobb.optim.base import MatrixOptimizer, local, state_dtype

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = ()

# Quintic Newton-Schulz coefficients (a, b, c) of p(x) = a x + b x^3 + c x^5, chosen to
# maximize the slope at zero: https://github.com/KellerJordan/Muon/blob/00ba60d3a0d188993831f86e4d62597bb0e9b21c/muon.py#L21
NS_A, NS_B, NS_C = 3.4445, -4.7750, 2.0315
NS_STEPS = 5
NS_EPS = 1e-7  # added to the Frobenius norm before dividing (Keller's value)
NS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
ADJUST_LR_MODES = ("spectral", "match_rms_adamw")


def newton_schulz(G: Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximate the orthogonal polar factor ``U Vᵀ`` of ``G = U S Vᵀ`` (returned in ``dtype``).

    The coefficients push every singular value towards 1 as fast as possible rather than
    converging exactly, so the result is ``U S' Vᵀ`` with ``S'`` roughly in ``[0.7, 1.2]``
    (for singular values not far below ``||G||_F / 100``), which does not hurt training.
    """
    X = G.to(dtype)
    tall = G.shape[-2] > G.shape[-1]
    if tall:  # iterate on the wide orientation so X Xᵀ is the smaller Gram matrix
        X = X.mT
    # X <- X / (||X||_F + eps)   (every singular value <= 1)
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + NS_EPS)
    fma = torch.addmm if X.ndim == 2 else torch.baddbmm  # one matrix or a (batch, m, n) stack
    for _ in range(steps):
        A = X @ X.mT
        # B = b A + c A²
        B = fma(A, A, A, beta=NS_B, alpha=NS_C)
        # X <- a X + B X
        X = fma(X, B, X, beta=NS_A)
    return X.mT if tall else X


def lr_scale(shape: tuple[int, int], adjust_lr: str) -> float:
    """Multiplier of ``lr`` for a ``(d_out, d_in)`` matrix.

    ``"spectral"`` (Keller): ``sqrt(max(1, d_out/d_in))``, the spectral-norm scale.
    ``"match_rms_adamw"`` (Moonshot, arXiv 2502.16982): ``0.2 sqrt(max(d_out, d_in))``,
    which puts the update's RMS at about AdamW's, so AdamW learning rates transfer.
    """
    d_out, d_in = shape
    if adjust_lr == "spectral":
        return math.sqrt(max(1.0, d_out / d_in))
    return 0.2 * math.sqrt(max(d_out, d_in))


def muon_update(
    param: Tensor,
    grad: Tensor,
    momentum: Tensor,
    *,
    lr: float,
    beta: float,
    nesterov: bool,
    weight_decay: float,
    scale: float,
    ns_steps: int = NS_STEPS,
    ns_dtype: torch.dtype = torch.bfloat16,
) -> None:
    """One Muon update of a whole ``(d_out, d_in)`` matrix; ``param`` and ``momentum`` in place."""
    grad = grad.to(momentum.dtype)
    # M <- mu M + (1 - mu) G
    momentum.lerp_(grad, 1 - beta)
    # N = (1 - mu) G + mu M  (Nesterov),  else  N = M
    direction = grad.lerp(momentum, beta) if nesterov else momentum
    # O = NS5(N) ≈ U Vᵀ
    update = newton_schulz(direction, ns_steps, ns_dtype)
    # W <- W (1 - lr wd)
    param.mul_(1 - lr * weight_decay)
    # W <- W - lr scale O
    param.add_(update, alpha=-lr * scale)


def check_unsharded(optimizer: MatrixOptimizer, param: Tensor) -> None:
    """Raise ``NotImplementedError`` for a sharded DTensor (single-device/DDP update only)."""
    if isinstance(param, DTensor) and any(p.is_shard() for p in param.placements):
        raise NotImplementedError(
            f"{optimizer.name_of(param)} is a sharded DTensor ({param.placements}); "
            f"{type(optimizer).__name__} updates whole matrices only. Use the distributed "
            "version, or replicate the parameter."
        )


class Muon(MatrixOptimizer):
    r"""Muon, as in KellerJordan/Muon, for hidden weight matrices.

    .. code-block:: text

        per matrix W (d_out x d_in), step t:
          M <- mu M + (1 - mu) G;   N = (1 - mu) G + mu M  (Nesterov)  or  N = M
          O = NS5(N)                 5 quintic Newton-Schulz steps on N / ||N||_F, in bf16
          W <- W (1 - lr wd) - lr s O,   s = sqrt(max(1, d_out/d_in))  ("spectral")

    Parameter groups with ``algorithm="adamw"`` or ``"lion"`` (see ``dobb.param_groups``)
    take the embeddings, the LM head, norms and biases: "Muon should only be used for
    hidden weight layers."

    Args:
        params: parameters or parameter groups.
        lr: learning rate, in units of spectral norm per update (default 0.02, Keller's).
        momentum: ``mu`` (default 0.95). nesterov: Nesterov momentum (default True).
        weight_decay: decoupled weight decay, multiplied by ``lr`` (default 0, Keller's).
        ns_steps: Newton-Schulz iterations (default 5).
        ns_dtype: dtype of the iteration: ``torch.bfloat16`` (default, Keller's) or a wider
            one such as ``torch.float32`` (a deviation, for exact comparisons).
        adjust_lr: ``"spectral"`` (default, Keller's ``sqrt(max(1, d_out/d_in))``) or
            ``"match_rms_adamw"`` (``0.2 sqrt(max(d_out, d_in))``, Moonshot's; a deviation).
        nonfinite: ``"raise"`` or ``"skip"`` on NaN/Inf gradients.

    Differences from the reference, all harmless: momentum is kept in fp32 (or the
    parameter's dtype where wider), and the shape scale multiplies ``lr`` rather than the
    bf16 update (as ``torch.optim.Muon`` does).
    """

    algorithm = "muon"

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = NS_STEPS,
        *,
        ns_dtype: torch.dtype = torch.bfloat16,
        adjust_lr: str = "spectral",
        nonfinite: str = "raise",
    ):
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            adjust_lr=adjust_lr,
        )
        super().__init__(params, defaults, nonfinite=nonfinite)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        if group["algorithm"] != self.algorithm:
            return
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"invalid momentum: {group['momentum']} (must be in [0, 1))")
        if not (isinstance(group["ns_steps"], int) and group["ns_steps"] >= 1):
            raise ValueError(f"invalid ns_steps: {group['ns_steps']!r} (must be an integer >= 1)")
        if group["ns_dtype"] not in NS_DTYPES:
            raise ValueError(f"invalid ns_dtype: {group['ns_dtype']!r} (one of {NS_DTYPES})")
        if group["adjust_lr"] not in ADJUST_LR_MODES:
            raise ValueError(
                f"invalid adjust_lr: {group['adjust_lr']!r} (one of {ADJUST_LR_MODES})"
            )
        for p in group["params"]:
            check_unsharded(self, p)

    def _init_matrix_state(self, param: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {"momentum": torch.zeros_like(param, dtype=state_dtype(param))}

    def _update_matrix(self, param: Tensor, state: dict[str, Any], group: dict) -> None:
        muon_update(
            local(param),
            local(param.grad),
            local(state["momentum"]),
            lr=group["lr"],
            beta=group["momentum"],
            nesterov=group["nesterov"],
            weight_decay=group["weight_decay"],
            scale=lr_scale(param.shape, group["adjust_lr"]),
            ns_steps=group["ns_steps"],
            ns_dtype=group["ns_dtype"],
        )
