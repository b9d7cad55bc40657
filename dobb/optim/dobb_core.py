"""Dobb's update on plain tensors (arXiv 2610.39412): the reference and the batched form.

The paper's update rotates only the input side; the variants (off by default) add row
blocks ``R_r`` with their own bases ``P_r`` (from the output side's second moment) and a
second moment of the coefficients instead of their sign (SOAP's idea, on Dobb's bases).
For a matrix ``W`` of shape ``(rows, d_in)``, input blocks ``I_b`` with orthonormal bases
``Q_b`` ``(s_b, s_b)`` and row blocks ``R_r`` with bases ``P_r`` ``(m_r, m_r)``:

.. code-block:: text

    M <- mu M + (1 - mu) G;   N = (1 - mu) G + mu M  (Nesterov)  or  N = M
    C[R_r, I_b] = P_rᵀ N[R_r, I_b] Q_b                 (coefficients; P_r = I one-sided)
    sign:   D = sign(C)
    adam:   V <- beta2 V + (1 - beta2) (P_rᵀ G[R_r, I_b] Q_b)²   (kept in the eigenbasis)
            D = C / (sqrt(V / (1 - beta2^t)) + eps)
    U[R_r, I_b] = P_r D[R_r, I_b] Q_bᵀ
    W <- W (1 - lr wd) - lr alpha U

``dobb_update`` is one matrix (the reference, every variant written out tile by tile);
``dobb_update_batched`` is ``n`` same-shape matrices in a fixed number of kernels
(``Dobb(foreach=True)``, the default off the CPU); tests hold them together. A row block
never straddles a row shard and an input block never straddles a column shard, so every
product stays on the rank that holds the tile.
"""

import math

import torch
from torch import Tensor

from dobb.blocks import BlockStack
from dobb.optim.batching import foreach_mul_

COEFFICIENTS = ("sign", "adam")


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
    coefficients = _rotate_one(direction.to(low), *sides, into=True)  # C
    if variance is None:
        coefficients.sign_()  # D = sign(C)
    else:  # V, then D = C / (sqrt(V / (1 - beta2^t)) + eps)
        projected = _rotate_one(grad.to(low), *sides, into=True).to(dtype)
        variance.lerp_(projected.square_(), 1 - beta2)
        denominator = variance.sqrt().div_(math.sqrt(1 - beta2**step)).add_(eps)
        coefficients = coefficients.to(dtype).div_(denominator).to(low)
    update = _rotate_one(coefficients, *sides, into=False).to(dtype)  # P_r D_rb Q_bᵀ
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
    coefficients = rotate(orient(torch.stack(direction)).to(low), *bases)
    if variances is None:
        coefficients.sign_()
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
        coefficients = coefficients.to(dtype).div_(denominator).to(low)
    update = orient(rotate(coefficients, *bases, into=False)).to(dtype)
    _apply(params, update, lr, weight_decay, scale, live)


def update_alpha(update_scale: float | str, d_in: int) -> float:
    """``alpha`` of ``update_scale`` for a matrix with (global) input width ``d_in``."""
    if update_scale == "muon":
        return 1.0 / math.sqrt(d_in)
    return {"adamw": 0.2, "lion": 1.0}.get(update_scale, update_scale)
