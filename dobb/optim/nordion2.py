"""NorDion2 (Dion3, arXiv 2608.11612): Dion2's row selection and error feedback, with
NorMuon's per-neuron normalization of the selected rows. Built from the two modules:
``nordion2_update`` (the reference) and ``nordion2_updates`` (the batched form)."""

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dobb._dtensor import local
from dobb.optim.config import POSITIVE, UNIT, inherit, option
from dobb.optim.dion2 import Dion2, apply_rows, dion2_direction, dion2_updates, row_scale
from dobb.optim.muon import NS_STEPS, newton_schulz
from dobb.optim.normuon import NORM_FLOOR, NorMuon, _any_split, neuron_normalize
from dobb.optim.owner_groups import OwnerExchangeOptimizer


def normalize_selected(update: Tensor, v: Tensor, rows: Tensor, *, beta2: float, eps: float):
    """``Ô`` of the orthogonalized selected rows ``O`` (k x n: rows ``rows`` of W); only
    those rows of ``v`` (m x 1) move, in place. Stacks: ``(b, k, n)``, ``(b, m, 1)``, ``(b, k)``."""
    index = rows.unsqueeze(-1)
    v_selected = v.gather(-2, index)
    # v_S <- β2 v_S + (1 - β2) mean_cols(O ⊙ O);   Ô = O ⊘ (sqrt(v_S) + ε)
    update = neuron_normalize(update, v_selected, beta2=beta2, eps=eps)
    v.scatter_(-2, index, v_selected)
    return update


def norm_ratio(square_before: Tensor, square_after: Tensor) -> Tensor:
    """``||O||_F / ||Ô||_F`` from the squared norms."""
    return square_before.sqrt() / square_after.sqrt().clamp_min(NORM_FLOOR)


def nordion2_update(
    param: Tensor,
    grad: Tensor,
    momentum: Tensor,
    row_second_moment: Tensor,
    blocks: list[int],
    *,
    lr: float,
    fraction: float,
    ef_decay: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    scale: float,
    ns_steps: int = NS_STEPS,
    ns_dtype: torch.dtype = torch.bfloat16,
    ns_coefficients: str = "polar_express",
) -> None:
    """One NorDion2 update of a local piece of whole rows; ``param`` and the state in place."""
    rows, selected = dion2_direction(grad, momentum, blocks, fraction=fraction, ef_decay=ef_decay)
    # O = NS(M_S)
    ortho = newton_schulz(selected, ns_steps, ns_dtype, ns_coefficients).to(row_second_moment.dtype)
    update = normalize_selected(ortho, row_second_moment, rows, beta2=beta2, eps=eps)
    # Ô <- ||O||_F / ||Ô||_F Ô
    update.mul_(norm_ratio(ortho.square().sum(), update.square().sum()))
    apply_rows(param, rows, update, lr=lr, weight_decay=weight_decay, scale=scale)


def selected_normalizer(row_second_moments: list[Tensor], *, beta2: float, eps: float):
    """``dion2_updates``' ``normalize``: a stack's ``(b, k, n)`` O to ``Ô``, ``v`` in place."""

    def normalize(indices: list[int], rows: Tensor, ortho: Tensor) -> Tensor:
        v = torch.stack([row_second_moments[i] for i in indices])  # (b, m, 1)
        ortho = ortho.to(v.dtype)
        update = normalize_selected(ortho, v, rows, beta2=beta2, eps=eps)
        # Ô <- ||O||_F / ||Ô||_F Ô, per matrix
        square = dict(dim=(1, 2), keepdim=True)
        update.mul_(norm_ratio(ortho.square().sum(**square), update.square().sum(**square)))
        torch._foreach_copy_([row_second_moments[i] for i in indices], list(v.unbind()))
        return update

    return normalize


def nordion2_updates(
    params, grads, momenta, row_second_moments, blocks, *, beta2, eps, **options
) -> None:
    """``nordion2_update`` of many pieces: ``dion2_updates`` (``options``) normalizing rows."""
    options.setdefault("ns_coefficients", "polar_express")
    normalize = selected_normalizer(row_second_moments, beta2=beta2, eps=eps)
    dion2_updates(params, grads, momenta, blocks, normalize=normalize, **options)


class NorDion2(Dion2):
    r"""NorDion2 (arXiv 2608.11612; the Dion authors export it also as ``Dion3``).

    .. code-block:: text

        per matrix W (m x n, a row is an output neuron), step t; rows in blocks b as Dion2's:
          M <- M + G
          S = ∪_b  the ceil(f m_b) rows i of block b with the largest ||M_i||_1
          O = NS(M_S)                      Polar Express on the |S| x n rows, in bf16
          M_S <- ef_decay M_S              only the selected rows decay
          v_S <- β2 v_S + (1 - β2) mean_cols(O ⊙ O)        v: one number per row
          Ô = O ⊘ (sqrt(v_S) + ε);   Ô <- ||O||_F / ||Ô||_F  Ô
          W <- W (1 - lr wd);   W_S <- W_S - lr sqrt(m/n) Ô

    Each choice follows the authors' code (``dion/nordion2.py`` of microsoft/dion, with
    ``dion/normuon.py`` and ``dion/megabatch_base.py``): Dion2's selection and feedback on
    rows (so selected rows are whole neurons); the normalization on the orthogonalized
    selected rows only, ``v`` moving only on them; the Frobenius norm of ``O`` kept (not
    NorMuon's RMS 0.2); ``lr sqrt(m/n)`` (their ``adjust_lr="spectral_norm"``); the defaults
    below, Polar Express included. Deviations: ``docs/baselines.md``.

    Options: ``NorDion2.Config`` (Dion2's, and ``beta2``, ``eps``).

    Distributed as Dion2 (rows only), plus one ``all_reduce`` of ``||O||_F²``, ``||Ô||_F²``
    per matrix over the pieces (none under DDP): sharded equals one device whose
    ``row_blocks`` are the shards.
    """

    algorithm = "nordion2"

    @dataclass(frozen=True)
    class Config(Dion2.Config):
        """NorDion2's options: Dion2's, Polar Express by default, and NorMuon's ``v``."""

        ns_coefficients: str = inherit(Dion2.Config, "ns_coefficients", "polar_express")
        """Newton-Schulz polynomials: ``"polar_express"`` (the authors' code's) or Keller's
        ``"quintic"``."""
        beta2: float = option(0.95, UNIT, math=True)
        """``β2``, the EMA factor of ``v``, each row's mean square of ``O``."""
        eps: float = option(1e-8, POSITIVE, math=True)
        """``ε`` in ``O ⊘ (sqrt(v_S) + ε)``."""

    def __init__(
        self,
        params,
        lr: float = Config.lr,
        fraction: float = Config.fraction,
        ef_decay: float = Config.ef_decay,
        beta2: float = Config.beta2,
        weight_decay: float = Config.weight_decay,
        ns_steps: int = Config.ns_steps,
        *,
        eps: float = Config.eps,
        ns_dtype: torch.dtype = Config.ns_dtype,
        ns_coefficients: str = Config.ns_coefficients,
        row_blocks: int | tuple[int, ...] = Config.row_blocks,
        replica_group=Config.replica_group,
        nonfinite: str = Config.nonfinite,
        foreach: bool | None = Config.foreach,
    ):
        self.config = self.Config.from_arguments(locals())
        OwnerExchangeOptimizer.__init__(self, params)  # Dion2's scaffolding, NorDion2's config

    # the state is NorMuon's: the momentum and v, sharded like W's rows
    _init_matrix_state = NorMuon._init_matrix_state

    def _normalizer(self, states: list[dict], group: dict[str, Any]):
        moments = [local(state["row_second_moment"]) for state in states]
        return selected_normalizer(moments, beta2=group["beta2"], eps=group["eps"])

    def _apply_selected(self, exchange, entries, indices, updates) -> None:
        """Normalize each rank's rows of ``O``, sum the two norms over the pieces, update."""
        split = _any_split(exchange)
        normalized, squares = [], []
        zero = torch.zeros(2, dtype=torch.float64, device=updates[0].device)
        for j, ((p, group), rows, ortho) in enumerate(zip(entries, indices, updates)):
            if rows is None:  # no gradient: takes part in the sum, stays unchanged
                normalized.append(None)
                squares.append(zero)
                continue
            v = local(self.state[p]["row_second_moment"])
            ortho = ortho.to(group["ns_dtype"]).to(v.dtype)
            update = normalize_selected(ortho, v, rows, beta2=group["beta2"], eps=group["eps"])
            normalized.append(update)
            counted = not split or exchange.me in exchange.sources[j]
            both = torch.stack([ortho.square().sum(), update.square().sum()]).double()
            squares.append(both if counted else zero)
        squares = torch.stack(squares)
        if split:  # ||O||_F², ||Ô||_F² = sums over the distinct pieces (one all_reduce)
            dist.all_reduce(squares, group=exchange.group)
        for (p, group), rows, update, (before, after) in zip(entries, indices, normalized, squares):
            if rows is None:
                continue
            # Ô <- ||O||_F / ||Ô||_F Ô
            update.mul_(norm_ratio(before, after).to(update.dtype))
            apply_rows(
                local(p),
                rows,
                update,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                scale=row_scale(p.shape),
            )
