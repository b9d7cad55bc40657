"""Dobb's step in the bases it was taken in: the sign coefficients by which two runs are
compared when only the order of their floating-point sums differs (sharded against one
device, another number of ranks, another CPU).

Dobb's update of a matrix ``W`` with input blocks ``I_b`` (orthonormal bases ``Q_b``) and
row blocks ``R_r`` (bases ``P_r``; one block of all rows and ``P = I`` when one-sided)::

    W <- W (1 - lr wd) - lr alpha P_r sign(C) Q_bᵀ,   C = P_rᵀ N Q_b   (N: the momentum)

so ``-P_rᵀ (W_after - W_before (1 - lr wd)) Q_b / (lr alpha)`` is ``±1`` in every
coefficient: the signs the step took (``sign_steps``). A coefficient of ``C`` within
rounding of zero may take the other sign in a run whose sums round otherwise; that moves
the tile by ``2 lr alpha P_r[:, k] Q_b[:, l]ᵀ`` (Frobenius norm exactly ``2 lr alpha``,
each weight by at most ``2 lr alpha``), however small the rounding was. Which coefficients
that happens to depends on the CPU (AVX2 and AVX-512 kernels round sums differently), so
two such runs are compared through their signs, never by an elementwise tolerance tuned on
one machine.
"""

import torch
from torch import Tensor


def rotate(x: Tensor, input_bases, row_bases=(), *, into: bool = True) -> Tensor:
    """``P_rᵀ X Q_b`` on every tile of ``x`` (``into``), or ``P_r X Q_bᵀ`` (back), in fp64.
    ``input_bases`` and ``row_bases``: the stacks of a side, each ``(count, size, size)``,
    covering that side's indices in order (``dobb.stats.block_stacks``: the longer blocks
    first)."""
    x = x.double()
    for dim, bases in ((0, row_bases), (1, input_bases)):
        start, pieces = 0, []
        for basis in bases:
            basis = basis.double()
            count, size, _ = basis.shape
            tile = x.narrow(dim, start, count * size)
            if dim == 0:  # (count, size, cols): P_rᵀ X_r, or P_r X_r
                rows = tile.unflatten(0, (count, size))
                pieces.append(((basis.mT if into else basis) @ rows).flatten(0, 1))
            else:  # (count, rows, size): X_b Q_b, or X_b Q_bᵀ
                blocks = tile.unflatten(1, (count, size)).transpose(0, 1)
                pieces.append((blocks @ (basis if into else basis.mT)).transpose(0, 1).flatten(1))
            start += count * size
        if pieces:
            assert start == x.shape[dim], (start, tuple(x.shape), dim)
            x = torch.cat(pieces, dim=dim)
    return x


def sign_steps(
    before: Tensor,
    after: Tensor,
    input_bases,
    row_bases=(),
    *,
    lr: float,
    weight_decay: float,
    alpha: float,
) -> Tensor:
    """``-P_rᵀ (W_after - W_before (1 - lr wd)) Q_b / (lr alpha)``: a step of Dobb with
    sign coefficients, in the bases it used and in units of ``lr alpha`` (``±1``)."""
    step = after.double() - before.double() * (1 - lr * weight_decay)
    return -rotate(step, input_bases, row_bases) / (lr * alpha)


def stacks(state: dict, side: str, read=lambda t: t) -> list[Tensor]:
    """A side's bases (``"input"``, ``"row"``) in a matrix's optimizer state, in stack order
    (``{side}_basis_{i}``), each through ``read`` (e.g. gathering a DTensor)."""
    found = []
    while f"{side}_basis_{len(found)}" in state:
        found.append(read(state[f"{side}_basis_{len(found)}"]))
    return found
