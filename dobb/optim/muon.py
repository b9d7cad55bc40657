"""Muon: MomentUm Orthogonalized by Newton-Schulz (Keller Jordan, 2024).

A faithful baseline of https://github.com/KellerJordan/Muon (post:
https://kellerjordan.github.io/posts/muon/): SGD with Nesterov momentum whose update is
replaced by (approximately) the nearest semi-orthogonal matrix, computed with five quintic
Newton-Schulz iterations in bfloat16. The update is three pure steps on local tensors
(``nesterov_direction``, ``newton_schulz``, ``apply_update``); on one device
``muon_update`` runs them in a row, and the distributed path runs the same three with the
direction gathered to one owner rank per matrix in between (``OwnerExchange``).
"""

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dobb.distributed.exchange import OwnerExchange
from dobb.distributed.placement import matrix_placement, mesh_group
from dobb.optim.base import DTensor, MatrixOptimizer, local, state_dtype

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # torch built without distributed support
    DeviceMesh = ()

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
) -> None:
    """One Muon update of a whole ``(d_out, d_in)`` matrix; ``param`` and ``momentum`` in place."""
    direction = nesterov_direction(grad, momentum, beta=beta, nesterov=nesterov)
    # O = NS5(N) ≈ U Vᵀ
    update = newton_schulz(direction, ns_steps, ns_dtype)
    apply_update(param, update, lr=lr, weight_decay=weight_decay, scale=scale)


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
        data_parallel: for plain (non-DTensor) parameters replicated by DDP: None (every
            replica orthogonalizes every matrix, no communication), or the ProcessGroup
            (or DeviceMesh) of the replicas, which then share the work as Keller's
            distributed Muon does. Gradients must already be averaged (DDP does that).
            DTensor parameters always share the work over their own mesh.
        nonfinite: ``"raise"`` or ``"skip"`` on NaN/Inf gradients (checked per rank: under
            sharding, rely on a global grad-norm check to skip a step on every rank).

    Distributed (matrices split over several ranks, or ``data_parallel`` set): momentum and
    the Nesterov direction are computed on each rank's own piece (elementwise). Each matrix
    has an owner rank; matrices are balanced over the ranks holding them, largest first.
    Per step and per mesh (or data-parallel group), for all its matrices together:

    1. one ``all_to_all`` sends every piece of ``N`` to the owner, which assembles it
       (skipped under DDP, where every rank holds ``N`` whole),
    2. each owner runs ``NS5`` on its whole matrices (about ``1/world`` of them),
    3. one ``all_to_all`` sends every rank its piece of ``O``,

    and each rank updates its own piece of ``W``. Pieces are read from the placements
    (uneven, empty, and ``_StridedShard`` FSDP x TP shards included). A piece held by
    several ranks (HSDP replicas) is sent to the owner once; every holder gets the result.
    Bytes per matrix: up to ``m n`` to the owner, ``m n`` (times replicas) back, in the
    state dtype and in ``ns_dtype``. With ``ns_dtype=torch.float32`` the result equals the
    single-device update up to float rounding of the matmuls.

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
        data_parallel=None,
        nonfinite: str = "raise",
    ):
        if data_parallel is not None and not isinstance(
            data_parallel, DeviceMesh | dist.ProcessGroup
        ):
            raise TypeError(
                "data_parallel must be a DeviceMesh, a ProcessGroup or None, got "
                f"{type(data_parallel)}"
            )
        self._data_parallel = data_parallel
        self._exchanges: list[tuple[OwnerExchange, list[Tensor]]] | None = None  # set below
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
        self._plan_exchanges()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if self._exchanges is not None:  # a group added after construction: plan again
            self._plan_exchanges()

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
            if isinstance(p, DTensor):
                matrix_placement(p)  # rejects Partial placements

    # ------------------------------------------------------------ placement
    def _holders(self, param: Tensor):
        """The process group whose ranks share ``param``'s update, None for a local update."""
        if isinstance(param, DTensor):
            return mesh_group(param.device_mesh)
        if isinstance(self._data_parallel, DeviceMesh):
            return mesh_group(self._data_parallel)
        return self._data_parallel

    def _plan_exchanges(self) -> None:
        """One ``OwnerExchange`` per process group of shared matrices (collective: every
        rank builds the optimizer, so every rank gets here with the same parameters)."""
        buckets: dict[str, tuple[Any, list[Tensor]]] = {}
        for group in self.param_groups:
            if group["algorithm"] != self.algorithm:
                continue
            for p in group["params"]:
                holders = self._holders(p)
                if holders is not None:
                    buckets.setdefault(holders.group_name, (holders, []))[1].append(p)
        self._exchanges = [
            (OwnerExchange([matrix_placement(p) for p in params], holders), params)
            for holders, params in buckets.values()
        ]

    # ------------------------------------------------------------------ step
    def _init_matrix_state(self, param: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        return {"momentum": torch.zeros_like(param, dtype=state_dtype(param))}

    def _matrix_step(self, groups: list[dict[str, Any]]) -> None:
        shared = {p for _, params in self._exchanges for p in params}
        for group in groups:
            for p in group["params"]:
                if p.grad is not None and p not in shared:
                    state = self.state[p]
                    if not state:
                        state.update(self._init_matrix_state(p, group))
                    self._update_matrix(p, state, group)
        group_of = {p: g for g in groups for p in g["params"]}
        for exchange, params in self._exchanges:
            self._shared_step(exchange, [(p, group_of[p]) for p in params])

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

    def _shared_step(self, exchange: OwnerExchange, entries: list[tuple[Tensor, dict]]) -> None:
        """Muon on matrices shared by ``exchange``'s ranks: NS5 on the owner of each.

        A parameter without a gradient sends a zero direction (every rank must take part)
        and is left unchanged, as on one device.
        """
        directions = []
        for p, group in entries:
            if p.grad is None:
                directions.append(torch.zeros_like(local(p), dtype=state_dtype(p)))
                continue
            state = self.state[p]
            if not state:
                state.update(self._init_matrix_state(p, group))
            directions.append(
                nesterov_direction(
                    local(p.grad),
                    local(state["momentum"]),
                    beta=group["momentum"],
                    nesterov=group["nesterov"],
                )
            )
        # N: every piece to the matrix's owner (one all_to_all)
        whole = exchange.gather(directions)
        # O = NS5(N), for the matrices this rank owns
        results = {
            j: newton_schulz(N, entries[j][1]["ns_steps"], entries[j][1]["ns_dtype"])
            for j, N in whole.items()
        }
        # O: every rank's piece back from the owner (one all_to_all)
        dtypes = [group["ns_dtype"] for _, group in entries]
        buffer_dtype = functools.reduce(torch.promote_types, dtypes)
        updates = exchange.scatter(results, buffer_dtype, directions[0].device)
        for (p, group), update in zip(entries, updates):
            if p.grad is None:
                continue
            apply_update(
                local(p),
                update.to(group["ns_dtype"]),
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                scale=lr_scale(p.shape, group["adjust_lr"]),
            )
