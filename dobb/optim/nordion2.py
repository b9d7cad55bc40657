"""NorDion2 (Dion3, arXiv 2608.11612): Dion2's row selection and error feedback, with
NorMuon's per-neuron normalization of the selected rows.

Built from the two modules: Dion2's selection, error feedback and row update
(``dion2_direction``, ``dion2_updates``, ``apply_rows``; ``Dion2Core``'s planned exchange of
the selected rows) around NorMuon's ``neuron_normalize`` on the selected rows
(``normalize_selected``). ``nordion2_update`` is the reference, ``nordion2_updates`` the
batched form, and ``NorDion2Core`` Dion2's core with NorMuon's state and a post step (the
owner-exchange driver, ``dobb.optim.owner_groups``, sums its norms over a split matrix's
pieces).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from dobb.optim.config import POSITIVE, UNIT, inherit, option
from dobb.optim.dion2 import Dion2, Dion2Core, apply_rows, dion2_direction, dion2_updates
from dobb.optim.muon import NS_STEPS, OwnerExchangeOptimizer, newton_schulz, orthogonalize
from dobb.optim.normuon import NORM_FLOOR, neuron_normalize, row_moment_state
from dobb.optim.owner_groups import ExchangeCore


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
    row_fraction: float,
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
    rows, selected = dion2_direction(
        grad, momentum, blocks, row_fraction=row_fraction, ef_decay=ef_decay
    )
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


class NorDion2Core(ExchangeCore):
    """NorDion2's core: Dion2's selection, exchange of the selected rows and row update (a
    ``Dion2Core``, composed) with NorMuon's ``v`` normalizing the selected rows; unshared
    matrices take ``dion2_updates`` normalizing each stack's rows (``nordion2_updates``'
    form); shared, the post step normalizes each rank's rows of ``O`` and sums ``||O||_F²``,
    ``||Ô||_F²`` over the pieces, and ``apply`` rescales by their ratio."""

    sums = (2,)  # ||O||_F², ||Ô||_F²
    whole_rows = "NorDion2 selects and normalizes whole rows"
    selection = Dion2Core()

    def init_state(self, param: Tensor, config, name: str) -> dict[str, Tensor]:
        return row_moment_state(param)

    def updates(self, batch, config) -> None:
        moments = [state["row_second_moment"] for state in batch.states]
        normalize = selected_normalizer(moments, beta2=config.beta2, eps=config.eps)
        self.selection.updates(batch, config, normalize=normalize)

    def directions(self, grads, states, config) -> tuple[list[Tensor], list]:
        return self.selection.directions(grads, states, config)

    orthogonalize = staticmethod(orthogonalize)

    def result_dtype(self, config) -> torch.dtype:
        return config.ns_dtype

    def exchanged_rows(self, rows: int, config) -> int:
        return self.selection.exchanged_rows(rows, config)

    def normalize(self, pieces, states, rows, config) -> tuple[list[Tensor], list[Tensor]]:
        """Ô on this rank's selected rows, and its parts of ``||O||_F²`` and ``||Ô||_F²``."""
        found, sums = [], []
        for ortho, state, selected in zip(pieces, states, rows):
            v = state["row_second_moment"]
            ortho = ortho.to(v.dtype)
            update = normalize_selected(ortho, v, selected, beta2=config.beta2, eps=config.eps)
            found.append(update)
            sums.append(torch.stack([ortho.square().sum(), update.square().sum()]).double())
        return found, sums

    def apply(self, params, updates, shapes, rows, config, sums) -> None:
        for update, (before, after) in zip(updates, sums):
            # Ô <- ||O||_F / ||Ô||_F Ô
            update.mul_(norm_ratio(before, after).to(update.dtype))
        self.selection.apply(params, updates, shapes, rows, config, sums)


class NorDion2(OwnerExchangeOptimizer):
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
    below, Polar Express included.

    Where we differ: the selection scope. The authors' default (``selection_scope="global"``)
    selects the exact top rows of the assembled matrix, sending every row to the owner; we
    select per shard, as our Dion2 does (their opt-in ``"local"``), so only the selected
    rows travel. On one device ``row_blocks=1`` is their global selection. On their local
    path the rescale uses each shard's own norms; we sum ``||O||_F²`` and ``||Ô||_F²`` over
    the shards, so a sharded run equals one device with ``row_blocks`` set to the shards.
    ``v`` is fp32 state (theirs is kept in the parameter's dtype).

    Options: ``NorDion2.Config`` (Dion2's, and ``beta2``, ``eps``).

    Distributed as Dion2 (rows only), its post step's two sums added over the pieces
    (``dobb.optim.owner_groups``).
    """

    algorithm = "nordion2"
    core = NorDion2Core()

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
