"""Dobb's core (arXiv 2610.39412): its state and its maths on plain tensors, pure.

The paper's update rotates only the input side; the variants (off by default) add row
blocks ``R_r`` with their own bases ``P_r`` (from the output side's second moment) and a
second moment of the coefficients instead of their sign (SOAP's idea, on Dobb's bases).
For a matrix ``W`` of shape ``(rows, d_in)``, input blocks ``I_b`` with orthonormal bases
``Q_b`` ``(s_b, s_b)`` and row blocks ``R_r`` with bases ``P_r`` ``(m_r, m_r)``:

.. code-block:: text

    C_b <- S_b (first)  else  C_b <- beta C_b + (1 - beta) S_b      (``fold``)
    Q_b <- eigenvectors(C_b), every k steps               (``refresh_due``; dobb.eigensolve)
    M <- mu M + (1 - mu) G;   N = (1 - mu) G + mu M  (Nesterov)  or  N = M
    C[R_r, I_b] = P_rᵀ N[R_r, I_b] Q_b                 (coefficients; P_r = I one-sided)
    sign:   D = sign(C)
    adam:   V <- beta2 V + (1 - beta2) (P_rᵀ G[R_r, I_b] Q_b)²   (kept in the eigenbasis)
            D = C / (sqrt(V / (1 - beta2^t)) + eps)
    U[R_r, I_b] = P_r D[R_r, I_b] Q_bᵀ
    W <- W (1 - lr wd) - lr alpha U

``DobbCore`` is the core the driver calls (``dobb.optim.parts.Core``): ``init_state`` (the
counters, the momentum, ``V``) and ``updates`` of a ``DobbBatch``, matrices of one layout,
with their bases stacked. ``dobb_update`` is one matrix (the reference, every variant
written out tile by tile); ``dobb_update_batched`` is ``n`` same-shape matrices in a fixed
number of kernels (``Dobb(foreach=True)``, the default off the CPU); tests hold them
together. ``fold`` and ``gradient_moments`` are the statistics' maths, ``refresh_due`` the
schedule. Nothing here communicates or keeps anything between calls: the step around them
(counting, the average over data ranks, the refresh, the batches) is Dobb's placement,
``dobb.optim.dobb_steps``. A row block never straddles a row shard and an input block
never straddles a column shard, so every product stays on the rank that holds the tile.

State keys: stack ``i`` of side ``s`` keeps ``C`` under ``"{s}_cov_{i}"`` and its basis under
``"{s}_basis_{i}"`` (``input_cov_0``, ``row_basis_1``; ``side_keys``), ``i`` in
``dobb.stats.block_stacks``' order (the longer blocks first). By stack index, not block
size, for two reasons. The keys are then one to one with those written before
(``LEGACY_KEYS``: ``cov``, ``cov_tail``, ..., which ``Dobb.load_state_dict`` renames and
``dobb.optim.dobb.LegacyKeysLoadPlanner`` reads through DCP). And a name holds no shape,
which is the tensor's to say: where the block size depends on the world size (two-sided
``row_blocks=None``: one block of each rank's rows), a resume onto another world size finds
the same key with another shape, which DCP refuses in one line naming both shapes, rather
than a key that is missing.
"""

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dobb._dtensor import local
from dobb.optim.batching import foreach_mul_, group_by, solo
from dobb.optim.parts import COUNTERS, Core, state_dtype
from dobb.stats import BlockStack

COEFFICIENTS = ("sign", "adam")
INPUT, ROW = "input", "row"  # the sides' names, the prefix of their state keys
# State keys up to commit d368fca: a side's prefix, "_tail" on its second stack's keys.
LEGACY_KEYS = {
    f"{prefix}{kind}{tail}": f"{side}_{kind}_{i}"
    for side, prefix in ((INPUT, ""), (ROW, "row_"))
    for kind in ("cov", "basis")
    for i, tail in enumerate(("", "_tail"))
}
OLD_NAMES = {new: old for old, new in LEGACY_KEYS.items()}


def side_keys(side: str, stacks: int) -> list[tuple[str, str]]:
    """``(C key, basis key)`` of each of a side's ``stacks``, in the optimizer's state."""
    return [(f"{side}_cov_{i}", f"{side}_basis_{i}") for i in range(stacks)]


def rotation_dtype(config, param: Tensor) -> torch.dtype:
    """The dtype of the rotations' operands: ``projection_dtype``, else the state's."""
    return getattr(torch, config.projection_dtype or "", None) or state_dtype(param)


def refresh_due(step: int, interval: int) -> bool:
    """Whether a matrix's ``step``-th step (from 1) refreshes its bases, every ``interval``
    (``basis_interval``) steps: steps 1, 1 + k, ... (the cost model's schedule too)."""
    return (step - 1) % interval == 0


class DobbBatch(NamedTuple):
    """Matrices of one layout (``layout``: the first's ``MatrixLayout``) in one step, as
    plain local tensors: what ``DobbCore.updates`` takes."""

    params: list[Tensor]
    grads: list[Tensor]
    states: list[dict[str, Tensor]]
    layout: Any
    bases: list[Tensor] | None
    """Each input stack's bases of every matrix, ``(n, count, s, s)`` in the rotations'
    dtype; None: a lone matrix, updated by the reference from its own bases."""
    row_bases: list[Tensor] | None
    steps: list
    """Each matrix's step count (floats; capturable: its device counter)."""
    live: Tensor | None


class DobbCore(Core):
    """Dobb's state and update (the module docstring): the state of a matrix besides its
    sides' blocks (which Dobb's placement lays out by shard: ``dobb.optim.dobb_steps``), and
    the update of a ``DobbBatch``."""

    def init_state(self, param: Tensor, config, name: str) -> dict[str, Any]:
        """The counters ``step`` and ``stats_steps`` (CPU scalars; capturable: on the
        device), the momentum and, with Adam coefficients, ``V``, laid out as ``param``."""
        dtype = state_dtype(param)
        counter = local(param).device if config.capturable else "cpu"
        state = {key: torch.zeros((), device=counter) for key in COUNTERS}  # step, stats_steps
        state["momentum"] = torch.zeros_like(param, dtype=dtype)
        if config.coefficients == "adam":
            state["variance"] = torch.zeros_like(param, dtype=dtype)
        return state

    def updates(self, batch: DobbBatch, config) -> None:
        """Dobb's update of ``batch``: ``dobb_update`` on a lone matrix (the reference: no
        stacking copies), else ``dobb_update_batched``; ``(d_in, d_out)`` weights (Conv1D)
        through their transpose."""
        params, grads, states, layout, bases, row_bases, steps, live = batch
        adam = config.coefficients == "adam"
        scale = update_scale_of(config.update_scale, config.coefficients)
        hyper = dict(
            lr=config.lr,
            beta=config.momentum,
            nesterov=config.nesterov,
            weight_decay=config.weight_decay,
            scale=update_alpha(scale, layout.width, config.model_width),
            beta2=config.beta2,
            row_stacks=layout.row.stacks,
            projection_dtype=rotation_dtype(config, params[0]),
        )
        if bases is None:
            orient = (lambda t: t.mT) if layout.input_dim == 0 else (lambda t: t)
            state = states[0]
            own, own_rows = ([state[b] for _, b in side.keys] for side in layout.sides)
            dobb_update(
                *(orient(t) for t in (params[0], grads[0], state["momentum"])),
                own,
                layout.input.stacks,
                row_bases=own_rows,
                variance=orient(state["variance"]) if adam else None,
                step=steps[0],
                **hyper,
            )
            return
        dobb_update_batched(
            params,
            grads,
            [state["momentum"] for state in states],
            bases,
            layout.input.stacks,
            row_bases=row_bases or None,
            variances=[state["variance"] for state in states] if adam else None,
            steps=steps,
            transposed=layout.input_dim == 0,
            live=live,
            **hyper,
        )


def dobb_update(
    param: Tensor,
    grad: Tensor,
    momentum: Tensor,
    bases: list[Tensor],
    stacks: tuple[BlockStack, ...],
    *,
    lr: float,
    beta: float,
    nesterov: bool,
    weight_decay: float,
    scale: float,
    row_bases: list[Tensor] | None = None,
    row_stacks: tuple[BlockStack, ...] = (),
    variance: Tensor | None = None,
    step: float | None = None,
    beta2: float = 0.95,
    eps: float = 1e-8,
    projection_dtype: torch.dtype | None = None,
) -> None:
    """One Dobb update of a ``(rows, d_in)`` matrix (a whole matrix or a row shard): the
    reference, every variant written out on this one matrix's tiles, which the batched form
    and every distributed path are held to.

    ``bases[i]`` is ``(count, size, size)``: the orthonormal basis ``Q_b`` of each block in
    ``stacks[i]``. The variants: ``row_bases[i]`` ``(count, m, m)``, the bases ``P_r`` of
    ``row_stacks[i]`` (two-sided; one-sided: one row block of all rows, ``P = I``);
    ``variance`` ``V``, laid out like ``param`` (Adam coefficients, ``beta2``, ``eps``;
    ``step``, the matrix's step count, for the bias correction); ``projection_dtype`` (e.g.
    bf16): the rotations' operands, the rest in the momentum's dtype. Tile by tile::

        M <- mu M + (1 - mu) G;   N = (1 - mu) G + mu M  (Nesterov)  or  N = M
        W <- W (1 - lr wd)
        C_rb = P_rᵀ N_rb Q_b
        sign: D_rb = sign(C_rb)
        adam: V_rb <- beta2 V_rb + (1 - beta2) (P_rᵀ G_rb Q_b)²
              D_rb = C_rb / (sqrt(V_rb) / sqrt(1 - beta2^t) + eps)
        W_rb <- W_rb - lr alpha P_r D_rb Q_bᵀ

    The rotations are products over this matrix's blocks (``_rotate_one``; no stacking
    across matrices, no copy of a basis per tile). Updates ``param``, ``momentum`` and
    ``variance`` in place.
    """
    dtype = momentum.dtype
    low = projection_dtype or dtype
    grad = grad.to(dtype)
    momentum.lerp_(grad, 1 - beta)  # M <- mu M + (1 - mu) G
    direction = grad.lerp(momentum, beta) if nesterov else momentum  # N
    param.mul_(1 - lr * weight_decay)
    sides = ([b.to(low) for b in bases], stacks, [b.to(low) for b in row_bases or ()], row_stacks)
    C = _rotate_one(direction.to(low), *sides, into=True)
    if variance is None:
        C.sign_()  # D = sign(C)
    else:  # V, then D = C / (sqrt(V / (1 - beta2^t)) + eps)
        projected = _rotate_one(grad.to(low), *sides, into=True).to(dtype)
        variance.lerp_(projected.square_(), 1 - beta2)
        denominator = variance.sqrt().div_(math.sqrt(1 - beta2**step)).add_(eps)
        C = C.to(dtype).div_(denominator).to(low)
    update = _rotate_one(C, *sides, into=False).to(dtype)  # P_r D_rb Q_bᵀ
    param.add_(update, alpha=-lr * scale)


def _rotate_one(x, bases, stacks, row_bases, row_stacks, *, into: bool) -> Tensor:
    """``P_rᵀ X_rb Q_b`` on every tile of one ``(rows, d_in)`` matrix ``x`` (``into``), or
    ``P_r X_rb Q_bᵀ`` (back). The rows first, on whole row slabs ``x[R_r, :]`` ``(count, m,
    d_in)``, then the columns, block by block ``(count, rows, s)``: ``rotate``'s products on
    one matrix, so both round alike."""
    if row_stacks:
        rotated = torch.empty_like(x)
        for p, rows in zip(row_bases, row_stacks, strict=True):
            slab = x[rows.start : rows.stop].unflatten(0, (rows.count, rows.size))
            rotated[rows.start : rows.stop] = ((p.mT if into else p) @ slab).flatten(0, 1)
        x = rotated
    out = torch.empty_like(x)
    for q, cols in zip(bases, stacks, strict=True):
        blocks = x[:, cols.start : cols.stop].unflatten(1, (cols.count, cols.size)).transpose(0, 1)
        blocks = blocks @ (q if into else q.mT)
        out[:, cols.start : cols.stop] = blocks.transpose(0, 1).flatten(1)
    return out


def dobb_update_batched(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    bases: list[Tensor],
    stacks: tuple[BlockStack, ...],
    *,
    lr: float,
    beta: float,
    nesterov: bool,
    weight_decay: float,
    scale: float,
    row_bases: list[Tensor] | None = None,
    row_stacks: tuple[BlockStack, ...] = (),
    variances: list[Tensor] | None = None,
    steps: list[float] | None = None,
    beta2: float = 0.95,
    eps: float = 1e-8,
    transposed: bool = False,
    live: Tensor | None = None,
    projection_dtype: torch.dtype | None = None,
) -> None:
    """``dobb_update`` for ``n`` matrices of one local shape, in a fixed number of kernels.

    ``params``, ``grads`` and ``momenta`` (and ``variances``) hold ``n`` tensors of one
    shape: ``(rows, d_in)``, or ``(d_in, rows)`` with ``transposed=True`` (GPT-2's
    ``Conv1D``). ``bases[i]`` is ``(n, count, size, size)``: the bases of ``stacks[i]`` for
    every matrix (``row_bases[i]`` likewise for ``row_stacks[i]``); ``steps`` are the
    matrices' step counts (floats, or device tensors). The paper's update is
    ``dobb_update``'s arithmetic, op for op, on ``(n, ...)`` stacks; the variants run on
    tiles (``rotate``). Updates in place. ``live`` (capturable; ``lr`` may be a 0-d tensor):
    where it is 0 (non-finite inputs) nothing changes, with no host read.
    ``projection_dtype`` (e.g. bf16): the rotations' operands, the rest in the state's.
    """
    if live is not None:  # a skipped step: G := M keeps M (and U is zeroed in ``_apply``)
        grads = [torch.where(live.bool(), g, m.to(g.dtype)) for g, m in zip(grads, momenta)]
    if row_stacks or variances is not None:
        _rotated_update(
            params,
            grads,
            momenta,
            bases,
            stacks,
            row_bases,
            row_stacks,
            variances,
            steps,
            lr=lr,
            beta=beta,
            nesterov=nesterov,
            weight_decay=weight_decay,
            scale=scale,
            beta2=beta2,
            eps=eps,
            transposed=transposed,
            live=live,
            low=projection_dtype,
        )
        return
    dtype = momenta[0].dtype
    low = projection_dtype or dtype
    if grads[0].dtype != dtype:  # e.g. bf16 gradients, fp32 momentum
        grads = torch.stack(grads).to(dtype).unbind(0)
    # M <- mu M + (1 - mu) G
    torch._foreach_lerp_(momenta, grads, 1 - beta)
    # N = (1 - mu) G + mu M  (Nesterov),  else  N = M
    direction = torch.stack(torch._foreach_lerp(grads, momenta, beta) if nesterov else momenta)
    direction = direction.mT if transposed else direction  # (n, rows, d_in)
    update = _signed_blocks(direction, bases, stacks, low)
    _apply(params, update.mT if transposed else update, lr, weight_decay, scale, live)


def _signed_blocks(direction: Tensor, bases: list[Tensor], stacks, low: torch.dtype) -> Tensor:
    """``U_b = sign(N_b Q_b) Q_bᵀ`` for every block of ``direction`` ``N`` ``(n, rows,
    d_in)``, laid out like it: per stack one ``bmm`` pair over all ``n count`` blocks, the
    operands in ``low``."""
    n, rows, d_in = direction.shape
    update = direction.new_empty(n, rows, d_in)
    for basis, s in zip(bases, stacks, strict=True):
        blocks = direction[..., s.start : s.stop].unflatten(2, (s.count, s.size)).transpose(1, 2)
        if low != direction.dtype:  # convert while laying out: one pass
            blocks = blocks.new_empty(blocks.shape, dtype=low).copy_(blocks)
        blocks = blocks.reshape(n * s.count, rows, s.size)  # (n count, rows, size)
        basis = basis.reshape(n * s.count, s.size, s.size).to(low)
        # U_b = sign(N_b Q_b) Q_bᵀ
        block_update = torch.bmm(torch.bmm(blocks, basis).sign_(), basis.mT)
        target = update[..., s.start : s.stop].unflatten(2, (s.count, s.size))
        target.copy_(block_update.unflatten(0, (n, s.count)).transpose(1, 2))
    return update


def _apply(params, update: Tensor, lr, weight_decay: float, scale: float, live=None) -> None:
    """W <- W (1 - lr wd) - lr alpha U for each slice of ``update``; ``lr`` a float or a
    0-d tensor; where ``live`` is 0 (capturable: a skipped step) W stays."""
    if weight_decay:
        factor = 1 - lr * weight_decay
        foreach_mul_(params, factor if live is None else torch.where(live.bool(), factor, 1.0))
    if live is not None:
        update.mul_(live)
    if isinstance(lr, Tensor):
        torch._foreach_add_(params, update.mul_(-lr * scale).unbind(0))
    else:
        torch._foreach_add_(params, update.unbind(0), alpha=-lr * scale)


def rotate(
    x: Tensor,
    col_bases: list[Tensor],
    col_stacks: tuple[BlockStack, ...],
    row_bases: list[Tensor] | None = None,
    row_stacks: tuple[BlockStack, ...] = (),
    *,
    into: bool = True,
) -> Tensor:
    """``P_rᵀ x Q_b`` on every tile (``into``), or ``P_r x Q_bᵀ`` (back), laid out like ``x``.

    ``x`` is ``(n, d_out, d_in)``; ``col_bases[j]`` is ``(n, count, s, s)`` for
    ``col_stacks[j]`` and ``row_bases[i]`` ``(n, count, m, m)`` for ``row_stacks[i]``. The
    rows are rotated on whole row slabs first (``P_rᵀ x[R_r, :]``), then the columns block
    by block: the same product, with no basis copied per tile.
    """
    if row_stacks:
        rotated = torch.empty_like(x)
        for p, rows in zip(row_bases, row_stacks, strict=True):
            slab = x[:, rows.start : rows.stop].unflatten(1, (rows.count, rows.size))
            rotated[:, rows.start : rows.stop] = ((p.mT if into else p) @ slab).flatten(1, 2)
        x = rotated
    out = torch.empty_like(x)
    for q, cols in zip(col_bases, col_stacks, strict=True):
        tiles = x[..., cols.start : cols.stop].unflatten(-1, (cols.count, cols.size))
        tiles = tiles.transpose(1, 2) @ (q if into else q.mT)  # (n, count, d_out, s)
        out[..., cols.start : cols.stop] = tiles.transpose(1, 2).flatten(2)
    return out


def _rotated_update(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    col_bases: list[Tensor],
    col_stacks: tuple[BlockStack, ...],
    row_bases: list[Tensor] | None = None,
    row_stacks: tuple[BlockStack, ...] = (),
    variances: list[Tensor] | None = None,
    steps: list[float] | None = None,
    *,
    lr: float,
    beta: float,
    nesterov: bool,
    weight_decay: float,
    scale: float,
    beta2: float = 0.95,
    eps: float = 1e-8,
    transposed: bool = False,
    live: Tensor | None = None,
    low: torch.dtype | None = None,
) -> None:
    """The variants' update (row bases and/or Adam coefficients) for ``n`` matrices, on
    tiles: ``rotate`` into the bases, the coefficients, ``rotate`` back (in ``low``)."""
    dtype = momenta[0].dtype
    low = low or dtype
    if grads[0].dtype != dtype:
        grads = [g.to(dtype) for g in grads]
    torch._foreach_lerp_(momenta, grads, 1 - beta)  # M <- mu M + (1 - mu) G
    direction = torch._foreach_lerp(grads, momenta, beta) if nesterov else momenta
    orient = (lambda t: t.mT) if transposed else (lambda t: t)  # noqa: E731
    row_bases = [b.to(low) for b in row_bases] if row_bases else None
    bases = ([b.to(low) for b in col_bases], col_stacks, row_bases, row_stacks)
    C = rotate(orient(torch.stack(direction)).to(low), *bases)
    if variances is None:
        C.sign_()
    else:
        projected = rotate(orient(torch.stack(grads)).to(low), *bases).to(dtype)
        variance = torch.stack([orient(v) for v in variances])
        variance.lerp_(projected.square_(), (1 - beta2) * (1 if live is None else live))
        torch._foreach_copy_([orient(v) for v in variances], list(variance.unbind(0)))
        denominator = variance.sqrt()  # / sqrt(1 - beta2^t), t: device or host counts
        if isinstance(steps[0], Tensor):  # capturable
            denominator.div_((1 - beta2 ** torch.stack(steps).to(dtype)).sqrt()[:, None, None])
        else:  # one scalar per matrix: nothing copied to the device
            corrections = [math.sqrt(1 - beta2**t) for t in steps]
            torch._foreach_div_(list(denominator.unbind(0)), corrections)
        denominator.add_(eps)
        C = C.to(dtype).div_(denominator).to(low)
    update = orient(rotate(C, *bases, into=False)).to(dtype)
    _apply(params, update, lr, weight_decay, scale, live)


def update_scale_of(scale: float | str | None, coefficients: str) -> float | str:
    """The option ``update_scale``, None resolved: ``"adamw"`` (0.2) with the sign, whose
    update's RMS is then AdamW's; ``"width"`` with Adam coefficients, whose best lrs at
    ``alpha = 1`` fell as 1 / width (STUDY.md (f))."""
    if scale is not None:
        return scale
    return "width" if coefficients == "adam" else "adamw"


WIDTH_REFERENCE = 256  # update_scale="width": alpha = 1 at this width, where lr was tuned


def update_alpha(scale: float | str, d_in: int, model_width: int | None = None) -> float:
    """``alpha`` of the option ``update_scale`` (``scale``) for a matrix with (global) input
    width ``d_in`` in a group of width ``model_width`` (``Dobb.Config.model_width``)::

        "muon": 1 / sqrt(d_in)      "width": 256 / model_width      "adamw": 0.2
        "lion": 1.0                 a number: itself

    ``"width"`` is muP's lr rule for Adam-like updates (hidden weights' lr ~ 1 / width); at
    ``alpha = 1`` the recommended Dobb's best lrs fell as 1 / width (STUDY.md (f))."""
    if scale == "muon":
        return 1.0 / math.sqrt(d_in)
    if scale == "width":
        return WIDTH_REFERENCE / (model_width or d_in)
    return {"adamw": 0.2, "lion": 1.0}.get(scale, scale)


EXPERT_TOKENS = "expert_tokens"  # an expert's state: its tokens seen, n_hat


def expert_weights(counts: list[Tensor], seen: list[Tensor], stats_beta: float, live=None) -> list:
    """An expert's fold weights, its ``C`` being a token-weighted EMA of its routed tokens'
    moments: for expert ``e`` with ``n_e`` tokens this step and ``n_hat_e`` seen before
    (``seen``, 0-d, updated in place), with ``beta = stats_beta`` (the kernels' ``beta``
    elsewhere is the momentum's)::

        gamma_e = (1 - beta) n_e / (beta n_hat_e + (1 - beta) n_e)     (0 if n_e = 0)
        C_e <- C_e + gamma_e (S_e - C_e)
        n_hat_e <- n_e (the first tokens), beta n_hat_e + (1 - beta) n_e (later ones),
                   unchanged (none)

    ``n_hat`` is the EMA of the expert's token counts, and a step's tokens weigh ``(1 -
    beta) n_e`` against the ``beta n_hat_e`` of the past: an expert's first tokens give
    ``gamma = 1`` (``C <- S``, as a layer's first statistics); equal counts every step give
    ``gamma = 1 - beta`` (a layer's EMA, up to rounding); a step with few tokens moves
    ``C`` little, so a routing imbalance cannot swing a basis onto a handful of tokens; an
    idle expert keeps ``C`` and ``n_hat``. ``live`` (capturable): where 0, every gamma is 0 and
    ``n_hat`` stays. Returns the ``gamma_e``, 0-d tensors."""
    n, n_hat = torch.stack(counts), torch.stack(seen)
    scaled = n * (1 - stats_beta)
    total = n_hat * stats_beta + scaled
    gamma = torch.where(n > 0, scaled / total.clamp_min(torch.finfo(total.dtype).tiny), 0.0)
    grown = torch.where(n > 0, torch.where(n_hat > 0, total, n), n_hat)
    if live is not None:
        gamma, grown = gamma * live, torch.where(live.bool(), grown, n_hat)
    torch._foreach_copy_(seen, list(grown.unbind(0)))
    return list(gamma.unbind(0))


def fold(first: tuple[list, list], later: dict[float, tuple[list, list]], live=None) -> None:
    """Fold this step's moments ``S`` into the second moments ``C``, in place:
    ``C <- S`` for the pairs ``first = (Cs, Ss)`` (a matrix's first statistics), and
    ``C <- beta C + (1 - beta) S`` for ``later[beta] = (Cs, Ss)``, ``beta`` a matrix's
    ``stats_beta``; one foreach call each.
    ``live`` (capturable): where it is 0 every ``C`` stays (``S`` is replaced by ``C``)."""
    for covs, means in (first, *later.values()) if live is not None else ():
        means[:] = [torch.where(live.bool(), m, c) for c, m in zip(covs, means)]
    if first[0]:
        torch._foreach_copy_(*first)
    for stats_beta, (covs, means) in later.items():
        torch._foreach_lerp_(covs, means, 1 - stats_beta)


def gradient_moments(grads: list[Tensor], sides: list, dtypes: list, batched) -> list[list]:
    """This step's second moments of the gradient on ``sides[i]`` of the matrix whose local
    gradient is ``grads[i]``, per stack, in ``dtypes[i]`` (the momentum's): ``G_bᵀ G_b /
    d_out`` on the input side (``basis_source="gradients"``), ``G_r G_rᵀ / d_in`` on the row
    side (two-sided, ``row_stats="gradients"``). One ``bmm`` per stack for each batch of
    same-shape gradients (one gradient each where not ``batched(device)``)."""

    def key(n: int) -> tuple:
        grad, side = grads[n], sides[n]
        layout = (side.name, tuple(grad.shape), side.dim, side.stacks)
        return *layout, grad.dtype, dtypes[n], grad.device, *solo(n, batched(grad.device))

    moments: list[list] = [None] * len(grads)
    for (_, _, dim, stacks, _, dtype, *_), members in group_by(range(len(grads)), key).items():
        stacked = torch.stack([grads[n] for n in members]).to(dtype)
        stacked = stacked.mT if dim == 0 else stacked  # (n, other, blocked dim)
        per_stack = []
        for s in stacks:
            cols = stacked[..., s.start : s.stop].unflatten(-1, (s.count, s.size))
            cols = cols.movedim(-2, 1)  # (n, count, other, size)
            per_stack.append((cols.mT @ cols / max(1, stacked.shape[1])).unbind(0))
        for j, n in enumerate(members):
            moments[n] = [m[j] for m in per_stack]
    return moments
