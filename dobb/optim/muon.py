"""Muon: MomentUm Orthogonalized by Newton-Schulz (Keller Jordan, 2024).

A faithful baseline of https://github.com/KellerJordan/Muon (post:
https://kellerjordan.github.io/posts/muon/): SGD with Nesterov momentum whose update is
replaced by (approximately) the nearest semi-orthogonal matrix, computed with five quintic
Newton-Schulz iterations in bfloat16 (the maths: the class docstring).

The update is three pure steps on local tensors (``nesterov_direction``, ``newton_schulz``,
``apply_update``); ``muon_update`` runs them in a row on one matrix (the reference). The
optimizer runs their batched forms (``nesterov_directions``, ``batched_newton_schulz``,
``apply_updates``; ``muon_updates`` on one device): foreach kernels over all matrices and
one Newton-Schulz per ``(n, m, k)`` stack of same-shape matrices, so a step costs O(shapes)
kernels, not O(matrices), as Keller's and the Dion authors' implementations batch. The
optimizer is the owner-exchange driver (``dobb.optim.owner_groups``) over ``MuonCore``:
shared matrices run the same three with the direction gathered to one owner rank per
matrix in between (``OwnerExchange``; the protocol and its bytes: ``owner_groups``).
"""

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dobb._dtensor import DTensor
from dobb.distributed.groups import check_group
from dobb.distributed.placement import matrix_placement
from dobb.optim.base import MatrixOptimizer
from dobb.optim.batching import foreach_mul_, group_by, stack_apply
from dobb.optim.config import BOOL, COUNT, UNIT, inherit, one_of, option
from dobb.optim.experts import is_experts
from dobb.optim.owner_groups import ExchangeCore, OwnerExchangeConfig, OwnerExchanges
from dobb.optim.parts import Local, Placement, state_dtype

# Quintic Newton-Schulz coefficients (a, b, c) of p(x) = a x + b x^3 + c x^5, chosen to
# maximize the slope at zero: https://github.com/KellerJordan/Muon/blob/00ba60d3a0d188993831f86e4d62597bb0e9b21c/muon.py#L21
NS_A, NS_B, NS_C = 3.4445, -4.7750, 2.0315
# Polar Express (Amsel et al., arXiv 2505.16932): each of 5 steps' optimal quintic, safety
# factor 1.02 baked in, as microsoft/dion's polar_express.py (and modded-nanogpt) use them
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# name -> (per-step (a, b, c), later steps repeating the last; the safety s of X / (s ||X||_F))
NS_COEFFICIENTS = {"quintic": (((NS_A, NS_B, NS_C),), 1.0), "polar_express": (POLAR_EXPRESS, 1.02)}
NS_STEPS = 5
NS_EPS = 1e-7  # added to the Frobenius norm before dividing (Keller's value)
NS_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
UPDATE_SCALES = ("spectral", "adamw")  # Muon's update scales (``lr_scale``)


def newton_schulz(
    G: Tensor, steps=NS_STEPS, dtype=torch.bfloat16, coefficients="quintic"
) -> Tensor:
    """Approximate the orthogonal polar factor ``U Vᵀ`` of ``G = U S Vᵀ`` (returned in ``dtype``).

    ``"quintic"`` (Keller's) pushes every singular value towards 1 as fast as possible
    rather than converging exactly: ``U S' Vᵀ`` with ``S'`` roughly in ``[0.7, 1.2]`` (for
    singular values not far below ``||G||_F / 100``). ``"polar_express"`` changes the
    polynomial each step (``NS_COEFFICIENTS``); its 5 steps land ``S'`` in about
    ``[0.85, 1.15]`` for singular values down to ``||G||_F / 1000``.
    """
    table, safety = NS_COEFFICIENTS[coefficients]
    X = G.to(dtype)
    tall = G.shape[-2] > G.shape[-1]
    if tall:  # iterate on the wide orientation so X Xᵀ is the smaller Gram matrix
        X = X.mT
    # X <- X / (s ||X||_F + eps)   (every singular value <= 1 / s)
    norm = X.norm(dim=(-2, -1), keepdim=True)
    X = X / ((norm if safety == 1.0 else norm * safety) + NS_EPS)
    fma = torch.addmm if X.ndim == 2 else torch.baddbmm  # one matrix or a (batch, m, n) stack
    for step in range(steps):
        a, b, c = table[min(step, len(table) - 1)]
        A = X @ X.mT
        # B = b A + c A²
        B = fma(A, A, A, beta=b, alpha=c)
        # X <- a X + B X
        X = fma(X, B, X, beta=a)
    return X.mT if tall else X


def lr_scale(shape: tuple[int, int], update_scale: str) -> float:
    """Multiplier of ``lr`` for a ``(d_out, d_in)`` matrix.

    ``"spectral"`` (Keller): ``sqrt(max(1, d_out/d_in))``, the spectral-norm scale.
    ``"adamw"`` (Moonshot's RMS matching, arXiv 2502.16982): ``0.2 sqrt(max(d_out, d_in))``,
    which puts the update's RMS at about AdamW's (0.2 lr, as Dobb's ``"adamw"``), so AdamW
    learning rates transfer.
    """
    d_out, d_in = shape
    if update_scale == "spectral":
        return math.sqrt(max(1.0, d_out / d_in))
    return 0.2 * math.sqrt(max(d_out, d_in))


def nesterov_direction(grad: Tensor, momentum: Tensor, *, beta: float, nesterov: bool) -> Tensor:
    """Update ``momentum`` in place and return the direction to orthogonalize."""
    grad = grad.to(momentum.dtype)
    # M <- mu M + (1 - mu) G
    momentum.lerp_(grad, 1 - beta)
    # N = (1 - mu) G + mu M  (Nesterov),  else  N = M
    return grad.lerp(momentum, beta) if nesterov else momentum


def apply_update(
    param: Tensor, update: Tensor, *, lr: float, weight_decay: float, scale: float
) -> None:
    """``W <- W (1 - lr wd) - lr scale O`` in place (on a whole matrix or any piece of it)."""
    # W <- W (1 - lr wd)
    param.mul_(1 - lr * weight_decay)
    # W <- W - lr scale O
    param.add_(update, alpha=-lr * scale)


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
    ns_coefficients: str = "quintic",
) -> None:
    """One Muon update of a whole ``(d_out, d_in)`` matrix; ``param`` and ``momentum`` in place."""
    direction = nesterov_direction(grad, momentum, beta=beta, nesterov=nesterov)
    # O = NS5(N) ≈ U Vᵀ
    update = newton_schulz(direction, ns_steps, ns_dtype, ns_coefficients)
    apply_update(param, update, lr=lr, weight_decay=weight_decay, scale=scale)


# Batched forms of the three steps: many matrices (of any shapes) sharing hyperparameters,
# with foreach kernels for the elementwise steps and one NS5 per stack of equal shapes, so
# a step dispatches O(shapes) kernels, not O(matrices). ``muon_update`` is their reference.


def nesterov_directions(
    grads: list[Tensor], momenta: list[Tensor], *, beta: float, nesterov: bool
) -> list[Tensor]:
    """``nesterov_direction`` of many matrices: ``momenta`` in place, directions returned."""
    # a copy only where the dtypes differ (bf16 gradients, fp32 momentum)
    grads = [g.to(m.dtype) for g, m in zip(grads, momenta, strict=True)]
    # M <- mu M + (1 - mu) G
    torch._foreach_lerp_(momenta, grads, 1 - beta)
    # N = (1 - mu) G + mu M  (Nesterov),  else  N = M
    return torch._foreach_lerp(grads, momenta, beta) if nesterov else list(momenta)


@functools.cache
def update_dtype(param_dtype: torch.dtype, ns_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``W - lr s O`` is computed in: the wider of W's and NS5's (cached: a
    ``torch.promote_types`` call is a dispatched op)."""
    return torch.promote_types(param_dtype, ns_dtype)


def batched_newton_schulz(
    directions: list[Tensor],
    out_dtypes: list[torch.dtype],
    steps: int = NS_STEPS,
    dtype: torch.dtype = torch.bfloat16,
    coefficients: str = "quintic",
    *,
    batched: bool = True,
) -> list[Tensor]:
    """``newton_schulz`` of each matrix, cast to ``out_dtypes[i]``: one call per same-shape
    ``(n, m, k)`` stack, each matrix still normalized by its own Frobenius norm."""
    return stack_apply(
        directions,
        lambda N, out_dtype: newton_schulz(N, steps, dtype, coefficients).to(out_dtype),
        key=lambda i: out_dtypes[i],
        batched=batched,
    )


def apply_updates(
    params: list[Tensor],
    updates: list[Tensor],
    *,
    lr: float,
    weight_decay: float,
    scales: list[float],
) -> None:
    """``apply_update`` of many matrices (or pieces): one foreach call per distinct scale."""
    if not params:  # e.g. only empty tiles
        return
    # W <- W (1 - lr wd)
    foreach_mul_(params, 1 - lr * weight_decay)
    for scale, indices in group_by(scales, float).items():
        # W <- W - lr s O
        torch._foreach_add_(
            [params[i] for i in indices], [updates[i] for i in indices], alpha=-lr * scale
        )


def muon_updates(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    *,
    lr: float,
    beta: float,
    nesterov: bool,
    weight_decay: float,
    scales: list[float],
    ns_steps: int = NS_STEPS,
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_coefficients: str = "quintic",
    batched: bool = True,
) -> None:
    """``muon_update`` of many whole matrices sharing hyperparameters (``scales[i]``: matrix
    ``i``'s ``lr_scale``; ``batched``: same-shape stacks share kernels); ``params`` and
    ``momenta`` in place."""
    directions = nesterov_directions(grads, momenta, beta=beta, nesterov=nesterov)
    # O = NS5(N), batched by shape; cast to W's precision for the update (a widening: exact)
    out_dtypes = [update_dtype(p.dtype, ns_dtype) for p in params]
    updates = batched_newton_schulz(
        directions, out_dtypes, ns_steps, ns_dtype, ns_coefficients, batched=batched
    )
    apply_updates(params, updates, lr=lr, weight_decay=weight_decay, scales=scales)


def momentum_state(param: Tensor) -> dict[str, Tensor]:
    """The momentum ``M``, zero, in ``param``'s placement and the state dtype."""
    return {"momentum": torch.zeros_like(param, dtype=state_dtype(param))}


def orthogonalize(matrices: Tensor, config) -> Tensor:
    """``newton_schulz`` of a matrix or a ``(b, m, n)`` stack with ``config``'s options: the
    owner's step of every Newton-Schulz optimizer (Muon, NorMuon, Dion2, NorDion2)."""
    return newton_schulz(matrices, config.ns_steps, config.ns_dtype, config.ns_coefficients)


class OwnerExchangeOptimizer(MatrixOptimizer):
    """The driver over an ``ExchangeCore`` with the placements ``piece_steps`` (if any),
    ``OwnerExchanges`` and ``Local``."""

    core: ExchangeCore
    piece_steps: Placement | None = None  # MuonBP's block steps: claims by a schedule
    # the argument that takes a job's data-parallel ranks (see dobb.distributed.groups)
    data_parallel_option = "replica_group"

    def __init__(self, params, lr=None, **options):
        config = self.Config.from_options(type(self).__name__, lr, options)
        replica_group = check_group(type(self).__name__, "replica_group", config.replica_group)
        self.exchanges = OwnerExchanges(self.core, replica_group)
        before = () if self.piece_steps is None else (self.piece_steps,)
        self.placements = (*before, self.exchanges, Local())
        self._planned = False
        super().__init__(params, config)
        self._plan_exchanges()

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        if self._planned:  # a group added after construction: plan again
            self._plan_exchanges()

    def _plan_exchanges(self) -> None:
        configs = {p: config for g, config in self.configs() for p in g["params"]}
        # experts are stepped where they are (dobb.optim.experts), never exchanged
        self.exchanges.plan({p: c for p, c in configs.items() if not is_experts(p)})
        self._planned = True

    def _validate_group(self, group) -> None:
        super()._validate_group(group)
        if group["algorithm"] != self.algorithm:
            return
        for p in group["params"]:
            if not isinstance(p, DTensor) or is_experts(p):  # experts: whole on each rank
                continue
            placement = matrix_placement(p)  # rejects Partial placements
            if self.core.whole_rows and len(placement.cols) != p.shape[1]:
                raise NotImplementedError(
                    f"{self.name_of(p)} is split along its columns ({tuple(p.placements)}); "
                    f"{self.core.whole_rows}, so shard its rows only (FSDP Shard(0)) or give "
                    "it to Muon"
                )


class MuonCore(ExchangeCore):
    """Muon's core: ``muon_updates`` on unshared matrices; shared, the Nesterov direction
    ``N`` travels to the owner, ``O = NS5(N)`` comes back (``apply_updates`` then)."""

    def init_state(self, param: Tensor, config, name: str) -> dict[str, Tensor]:
        return momentum_state(param)

    def updates(self, batch, config) -> None:
        params, grads, states = batch
        muon_updates(
            params,
            grads,
            [state["momentum"] for state in states],
            lr=config.lr,
            beta=config.momentum,
            nesterov=config.nesterov,
            weight_decay=config.weight_decay,
            scales=[lr_scale(p.shape, config.update_scale) for p in params],
            ns_steps=config.ns_steps,
            ns_dtype=config.ns_dtype,
            ns_coefficients=config.ns_coefficients,
            batched=config.batched(params[0].device),
        )

    def directions(self, grads, states, config) -> tuple[list[Tensor], list]:
        momenta = [state["momentum"] for state in states]
        found = nesterov_directions(grads, momenta, beta=config.momentum, nesterov=config.nesterov)
        return found, [None] * len(found)

    orthogonalize = staticmethod(orthogonalize)

    def result_dtype(self, config) -> torch.dtype:
        return config.ns_dtype

    def apply(self, params, updates, shapes, aux, config, sums) -> None:
        scales = [lr_scale(shape, config.update_scale) for shape in shapes]
        apply_updates(
            params, updates, lr=config.lr, weight_decay=config.weight_decay, scales=scales
        )


@dataclass(frozen=True)
class NewtonSchulzConfig(OwnerExchangeConfig):
    """The options of an optimizer that orthogonalizes by ``newton_schulz``."""

    ns_steps: int = option(NS_STEPS, COUNT, math=True)
    """Newton-Schulz iterations."""
    ns_dtype: torch.dtype = option(torch.bfloat16, one_of(*NS_DTYPES), math=True)
    """dtype of the iteration: ``torch.bfloat16`` (Keller's) or a wider one such as
    ``torch.float32`` (a deviation, for exact comparisons)."""
    ns_coefficients: str = option("quintic", one_of(*NS_COEFFICIENTS), math=True)
    """``"quintic"`` (Keller's) or ``"polar_express"`` (a polynomial per step, the Dion
    authors' default; see ``newton_schulz``)."""


class Muon(OwnerExchangeOptimizer):
    r"""Muon, as in KellerJordan/Muon, for hidden weight matrices.

    .. code-block:: text

        per matrix W (d_out x d_in), step t:
          M <- mu M + (1 - mu) G;   N = (1 - mu) G + mu M  (Nesterov)  or  N = M
          O = NS5(N)                 5 quintic Newton-Schulz steps on N / ||N||_F, in bf16
          W <- W (1 - lr wd) - lr s O,   s = sqrt(max(1, d_out/d_in))  ("spectral")

    ``algorithm="adamw"``/``"lion"`` groups take the rest: "Muon should only be used for
    hidden weight layers."

    Options: ``Muon.Config``.

    Distributed (matrices split over ranks, or ``replica_group`` set): ``N`` is formed on
    each rank's own piece, travels to the matrix's owner rank, which runs ``NS5``, and every
    rank gets its piece of ``O`` back (the driver's owner exchange, one ``all_to_all`` each
    way: ``dobb.optim.owner_groups``); any placement.

    Differences from the reference, both harmless: momentum is kept in fp32 (or the
    parameter's dtype where wider), and the shape scale ``s`` multiplies ``lr`` rather than
    the bf16 update (as ``torch.optim.Muon`` does).
    """

    algorithm = "muon"
    core = MuonCore()

    @dataclass(frozen=True)
    class Config(NewtonSchulzConfig):
        """Muon's options (``dobb.optim.config``)."""

        # the Dion authors' name and value (torch.optim.Muon's: adjust_lr_fn)
        renamed = {"adjust_lr": "update_scale"}
        renamed_values = {("update_scale", "match_rms_adamw"): "adamw"}

        lr: float = inherit(NewtonSchulzConfig, "lr", 0.02)
        """Learning rate, in spectral norm per update (Keller's 0.02)."""
        momentum: float = option(0.95, UNIT, math=True)
        """``mu``, the momentum's EMA factor."""
        nesterov: bool = option(True, BOOL, math=True)
        """Nesterov momentum (the direction ``(1 - mu) G + mu M``), else ``M``."""
        update_scale: str = option("spectral", one_of(*UPDATE_SCALES), math=True)
        """The lr's scale per ``(d_out, d_in)`` matrix: ``"spectral"`` (Keller's
        ``sqrt(max(1, d_out/d_in))``) or ``"adamw"`` (Moonshot's
        ``0.2 sqrt(max(d_out, d_in))``: update RMS ``0.2 lr``, AdamW's; a deviation).
        Dobb's option of the same name (the Dion authors' code and torch's: ``adjust_lr``,
        ``adjust_lr_fn``)."""
