"""MatrixPlacement, the one description of the part of a matrix a rank holds: its spans.

The layouts themselves (uneven, empty, strided shards) are covered by every distributed
optimizer test; here, the index runs that Dobb reads as column ranges.
"""

import pytest
import torch

from dobb.distributed.placement import MatrixPlacement, matrix_placement


def test_a_plain_tensor_is_the_whole_matrix_on_one_rank():
    placement = matrix_placement(torch.zeros(5, 7))
    assert placement.span(0) == (0, 5) and placement.span(1) == (0, 7)
    assert placement.split_degree(0) == placement.split_degree(1) == 1
    assert not placement.is_split


def test_span_of_a_contiguous_empty_and_strided_piece():
    piece = MatrixPlacement((6, 8), torch.arange(2, 5), torch.tensor([], dtype=torch.long))
    assert piece.span(0) == (2, 5)
    assert piece.span(1) == (0, 0)  # an empty FSDP shard
    strided = MatrixPlacement((6, 8), torch.tensor([0, 1, 4, 5]), torch.arange(8))
    with pytest.raises(ValueError, match="4 scattered indices along dim 0"):
        strided.span(0)
