"""Block layout of a matrix's input dimension and the per-block eigenbases.

``d_in`` is split into ``B`` contiguous, near-equal blocks: the first ``d_in % B`` blocks
have ``ceil(d_in / B)`` columns, the rest ``floor(d_in / B)``. Blocks of one size form a
*stack*, so every per-block quantity is a batched ``(count, size, size)`` tensor and a
matrix has at most two stacks. The per-block eigenbases are computed in ``dobb.eigensolve``
(re-exported here: ``eigenbasis``, ``power_qr_basis``, ``refresh_bases``, ``BASIS_METHODS``).
"""

from dataclasses import dataclass

from dobb.eigensolve import BASIS_METHODS, eigenbasis, power_qr_basis, refresh_bases

__all__ = [
    "BASIS_METHODS",
    "BlockStack",
    "block_stacks",
    "eigenbasis",
    "power_qr_basis",
    "refresh_bases",
]


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
