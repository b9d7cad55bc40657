"""Group tensors that can share kernels, so a step costs O(groups) kernels, not O(tensors).

Whether an optimizer stacks same-shape matrices is its ``foreach`` option
(``MatrixOptimizer.batched``): on by default off the CPU, where a launch costs more than
the stacking copies; on the CPU one matrix at a time, where the copies cost more than the
launches they save.

Same-shape matrices stack into one ``(n, m, k)`` batch; tensors of one dtype and device
with the same hyperparameters share ``torch._foreach_*`` calls. ``group_by`` finds such
groups; ``stack_apply`` runs a batched function once per same-shape stack: tensors of one
shape, dtype, device and ``key(i)`` (e.g. hyperparameters) stack into ``(n, *shape)``
(each tensor alone unless ``batched``), and ``fn(stack, k)`` must treat each slice on its
own and return ``(n, *shape')``. A group of one is passed unstacked (``shape``, not
``(1, *shape)``). Results of a stack are views of its output.
"""

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def solo(i: int, batched: bool) -> tuple:
    """A grouping-key suffix that keeps item ``i`` in a group of its own unless ``batched``
    (an optimizer's ``foreach``: stack same-shape matrices into shared kernels)."""
    return () if batched else (i,)


def group_by(items: Iterable[T], key: Callable[[T], Hashable]) -> dict[Any, list[int]]:
    """Indices of ``items`` by ``key(item)``; groups and indices in first-seen order."""
    groups: dict[Any, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(key(item), []).append(i)
    return groups


def stack_apply(
    tensors: list[Tensor],
    fn: Callable[[Tensor, Any], Tensor],
    key: Callable[[int], Hashable] = lambda i: None,
    *,
    batched: bool = True,
) -> list[Tensor]:
    """``[fn(t, key(i)) for i, t in enumerate(tensors)]``, as one call per same-shape stack.

    Tensors of one shape, dtype, device and ``key(i)`` stack into ``(n, *shape)`` (unless
    not ``batched``; a group of one is passed unstacked); ``fn`` treats each slice alone.
    """
    groups = group_by(
        range(len(tensors)),
        lambda i: (
            (key(i), tuple(tensors[i].shape), tensors[i].dtype, tensors[i].device)
            + solo(i, batched)
        ),
    )
    out: list[Tensor] = [None] * len(tensors)
    for (k, *_), indices in groups.items():
        if len(indices) == 1:
            out[indices[0]] = fn(tensors[indices[0]], k)
            continue
        results = fn(torch.stack([tensors[i] for i in indices]), k).unbind()
        for i, result in zip(indices, results):
            out[i] = result
    return out


def each(value, tensors: list[Tensor]):
    """``value`` as a ``torch._foreach_*`` scalar over ``tensors``: a 0-d tensor repeated (the
    list overload stays on the device; CPU's tensor-scalar one reads it), a number as is."""
    return [value] * len(tensors) if isinstance(value, Tensor) else value


def foreach_mul_(tensors: list[Tensor], factor: float | Tensor) -> None:
    """``t.mul_(factor)`` for every tensor: one ``torch._foreach_mul_`` for the fp32/fp64 ones.

    bf16/fp16 tensors take ``mul_`` one by one: torch's CPU ``_foreach_mul_`` rounds the
    scalar to the tensor's dtype first (``1 - 2e-3`` becomes ``1 - 3.9e-3`` in bf16), which
    ``mul_`` does not.
    """
    wide = [t for t in tensors if t.dtype not in (torch.bfloat16, torch.float16)]
    if wide:
        torch._foreach_mul_(wide, each(factor, wide))
    for t in tensors:
        if t.dtype in (torch.bfloat16, torch.float16):
            t.mul_(factor)


def chunk_sizes(size: int, splits: int | Sequence[int] | None) -> list[int]:
    """Sizes of ``size`` indices split like ``torch.chunk`` into ``splits[0]`` parts, each
    part into ``splits[1]`` parts, and so on (outer split first); empty parts are kept. An
    integer is one split; None none (``[size]``, as ``1``). MuonBP's tiles and Dion2's
    selection blocks emulate shards so.

    As FSDP2's ``Shard`` (18 over 4: 5/5/5/3); nested: ``_StridedShard`` (18: 5/4/5/4).
    """
    sizes = [size]
    for parts in splits if isinstance(splits, Sequence) else (splits or 1,):
        sizes = [piece for n in sizes for piece in _chunk(n, parts)]
    return sizes


def _chunk(n: int, parts: int) -> list[int]:
    # torch.chunk: parts of ceil(n / parts) each, the last ones short or empty
    step = -(-n // parts)
    return [min(step, max(0, n - i * step)) for i in range(parts)]
