"""torchtitan's DCP checkpoints read back in one process, flat, for the torchtitan tests
(``test_torchtitan``, ``test_torchtitan_reshard``) to compare entry by entry."""

from pathlib import Path

import torch


def load_checkpoint(folder: Path) -> dict:
    """A DCP checkpoint as one flat dict, read in this (single) process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = folder.with_suffix(".pt")
    dcp_to_torch_save(folder, target)
    return torch.load(target, weights_only=False)


def flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from flatten(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], tree


def same(a, b) -> bool:
    """Bit-identical tensors, or equal other values."""
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
