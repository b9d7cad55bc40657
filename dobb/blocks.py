"""Block layout of a matrix's input dimension and the per-block eigenbases.

``d_in`` is split into ``B`` contiguous, near-equal blocks: the first ``d_in % B`` blocks
have ``ceil(d_in / B)`` columns, the rest ``floor(d_in / B)``. Blocks of one size form a
*stack*, so every per-block quantity is a batched ``(count, size, size)`` tensor and a
matrix has at most two stacks.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

EIGH_JITTER = 1e-7  # relative diagonal jitter: C + JITTER * mean(diag C) * I


@dataclass(frozen=True)
class BlockStack:
    """``count`` consecutive blocks of ``size`` columns starting at column ``start``."""

    start: int
    size: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.size * self.count


def block_stacks(d_in: int, num_blocks: int) -> tuple[BlockStack, ...]:
    """Near-equal contiguous blocks of ``range(d_in)``; ``num_blocks > d_in`` gives size 1."""
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    num_blocks = min(num_blocks, d_in)
    size, big = divmod(d_in, num_blocks)
    stacks = [BlockStack(0, size + 1, big)] if big else []
    stacks.append(BlockStack(big * (size + 1), size, num_blocks - big))
    return tuple(s for s in stacks if s.count)


def eigenbasis(cov: Tensor) -> Tensor:
    """Orthonormal eigenvectors of each ``(s, s)`` block in ``cov`` (``(n, s, s)``).

    Columns are sorted by decreasing eigenvalue. Computed in fp32 (or the input's wider
    dtype) with a tiny diagonal jitter; if that fails to converge, retried in fp64.
    """
    dtype = torch.promote_types(cov.dtype, torch.float32)
    scale = cov.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(torch.finfo(dtype).tiny)
    eye = torch.eye(cov.shape[-1], dtype=dtype, device=cov.device)
    jittered = cov.to(dtype) + (EIGH_JITTER * scale)[:, None, None] * eye
    try:
        _, vectors = torch.linalg.eigh(jittered)
        if bool(torch.isfinite(vectors).all()):
            return vectors.flip(-1)
    except torch.linalg.LinAlgError:
        pass
    _, vectors = torch.linalg.eigh(jittered.double())
    return vectors.flip(-1).to(dtype)


def power_qr_basis(cov: Tensor, basis: Tensor) -> Tensor:
    """One warm-started orthogonal-iteration step toward the eigenbasis (as in SOAP).

    Sort the previous basis by its Rayleigh quotients ``diag(Qᵀ C Q)`` (decreasing), then
    ``Q <- qr(C Q).Q``. Cheaper than ``eigh``; converges over repeated refreshes.
    """
    rayleigh = torch.einsum("nij,nik,nkj->nj", basis, cov, basis)
    order = rayleigh.argsort(dim=-1, descending=True)
    basis = basis.gather(-1, order[:, None, :].expand_as(basis))
    return torch.linalg.qr(cov @ basis).Q


def refresh_bases(
    covs: list[Tensor], bases: list[Tensor], method: str = "eigh", run=None
) -> list[Tensor]:
    """New bases for many stacks at once: one batched call per block size.

    ``covs[i]`` and ``bases[i]`` are ``(n_i, s_i, s_i)``; stacks of equal size (across all
    layers) are concatenated so that ``eigh`` runs once per distinct block size. ``run(fn,
    cov, basis)`` evaluates ``fn`` on the concatenated stacks (default: directly; Dobb can
    pass ``dobb.distributed.sharding.split_over_ranks`` to share the work between ranks).
    """
    run = run or (lambda fn, *stacks: fn(*stacks))
    basis_fn = (lambda cov, _: eigenbasis(cov)) if method == "eigh" else power_qr_basis
    by_size: dict[tuple[int, torch.dtype], list[int]] = {}
    for i, cov in enumerate(covs):
        by_size.setdefault((cov.shape[-1], cov.dtype), []).append(i)
    new: list[Tensor] = [torch.empty(0)] * len(covs)
    for indices in by_size.values():
        cov = torch.cat([covs[i] for i in indices])
        result = run(basis_fn, cov, torch.cat([bases[i] for i in indices]).to(cov.dtype))
        for i, part in zip(indices, result.split([covs[i].shape[0] for i in indices])):
            new[i] = part.to(bases[i].dtype)
    return new
