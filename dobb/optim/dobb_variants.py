"""Dobb's variants: a basis on both sides of the matrix, and Adam in the eigenbasis.

The paper's update rotates only the input side: ``U[:, I_b] = sign(N[:, I_b] Q_b) Q_bᵀ``.
The variants here generalise it to row blocks ``R_r`` with their own bases ``P_r`` (from
the output side's second moment) and to a second moment of the coefficients instead of
their sign (SOAP's idea, on Dobb's block bases):

.. code-block:: text

    C[R_r, I_b] = P_rᵀ N[R_r, I_b] Q_b                 (coefficients; P_r = I one-sided)
    sign:   D = sign(C)
    adam:   V <- beta2 V + (1 - beta2) (P_rᵀ G[R_r, I_b] Q_b)²   (kept in the eigenbasis)
            D = C / (sqrt(V / (1 - beta2^t)) + eps)
    U[R_r, I_b] = P_r D[R_r, I_b] Q_bᵀ

A row block never straddles a row shard and an input block never straddles a column shard,
so every product stays on the rank that holds the tile. Shapes carry a leading ``n``: ``n``
same-shape matrices share each kernel (``n = 1`` for one matrix).
"""

import torch
from torch import Tensor

from dobb.blocks import BlockStack
from dobb.optim.batching import foreach_mul_

COEFFICIENTS = ("sign", "adam")


def _tiles(x: Tensor, rows: BlockStack | None, cols: BlockStack) -> Tensor:
    """The tiles of ``x`` ``(n, d_out, d_in)`` as a view ``(n, R, B, m, s)``: ``R`` row blocks
    of ``m`` rows (``R = 1``, ``m = d_out`` without row blocks) by ``B`` input blocks of
    ``s`` columns."""
    if rows is not None:
        x = x[:, rows.start : rows.stop].unflatten(1, (rows.count, rows.size))
    else:
        x = x.unsqueeze(1)
    x = x[..., cols.start : cols.stop].unflatten(-1, (cols.count, cols.size))
    return x.transpose(2, 3)


def _pairs(row_stacks, col_stacks):
    """Every (row stack index, row stack, column stack index, column stack) pair."""
    rows = list(enumerate(row_stacks)) if row_stacks else [(None, None)]
    return [(i, r, j, c) for i, r in rows for j, c in enumerate(col_stacks)]


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
    ``col_stacks[j]`` and ``row_bases[i]`` ``(n, count, m, m)`` for ``row_stacks[i]``.
    """
    out = torch.empty_like(x)
    for i, rows, j, cols in _pairs(row_stacks, col_stacks):
        q = col_bases[j][:, None]  # (n, 1, B, s, s)
        tile = _tiles(x, rows, cols) @ (q if into else q.mT)
        if rows is not None:
            p = row_bases[i][:, :, None]  # (n, R, 1, m, m)
            tile = (p.mT if into else p) @ tile
        _tiles(out, rows, cols).copy_(tile)
    return out


def dobb_variant_update(
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
) -> None:
    """The update above for ``n`` matrices of one local shape; updates in place.

    ``params``, ``grads``, ``momenta`` and (Adam coefficients) ``variances`` hold ``n``
    ``(d_out, d_in)`` tensors, or ``(d_in, d_out)`` with ``transposed=True``; ``steps`` are
    the matrices' step counts (for Adam's bias correction). Sign coefficients without row
    blocks give ``dobb.optim.dobb.dobb_update`` (a test holds them together).
    """
    dtype = momenta[0].dtype
    if grads[0].dtype != dtype:
        grads = [g.to(dtype) for g in grads]
    torch._foreach_lerp_(momenta, grads, 1 - beta)  # M <- mu M + (1 - mu) G
    direction = torch._foreach_lerp(grads, momenta, beta) if nesterov else momenta
    orient = (lambda t: t.mT) if transposed else (lambda t: t)  # noqa: E731
    bases = (col_bases, col_stacks, row_bases, row_stacks)
    coefficients = rotate(orient(torch.stack(direction)), *bases)
    if variances is None:
        coefficients.sign_()
    else:
        projected = rotate(orient(torch.stack(grads)), *bases)
        variance = torch.stack([orient(v) for v in variances])
        variance.lerp_(projected.square_(), 1 - beta2)
        torch._foreach_copy_([orient(v) for v in variances], list(variance.unbind(0)))
        correction = 1 - beta2 ** torch.tensor(steps, dtype=dtype, device=variance.device)
        denominator = (variance / correction[:, None, None]).sqrt_().add_(eps)
        coefficients.div_(denominator)
    update = orient(rotate(coefficients, *bases, into=False))
    if weight_decay:  # W <- W (1 - lr wd) - lr alpha U
        foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_add_(params, update.unbind(0), alpha=-lr * scale)
