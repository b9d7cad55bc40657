"""A grouped-experts module for tests, and the same experts as separate ``nn.Linear`` layers.

``Experts`` keeps two stacks, ``w1`` ``(E, hidden, dim)`` and ``w2`` ``(E, dim, hidden)``, and
computes ``w2_e relu(w1_e x)`` for each token ``x`` routed to expert ``e`` through its own
``_grouped_mm(A, B_t, offs)`` (the protocol of ``dobb.stats.register_experts``: first for
``w1``, then ``w2``). Its grouped GEMM is one ``F.linear`` per expert over its rows, the
products ``nn.Linear`` computes, so that ``Separate`` (expert ``e`` as ``l1[e]``, ``l2[e]``,
fed the same rows) has bit-identical gradients (ReLU: exact on any kernel path, where a
vectorized GELU and a scalar one can differ in the last bit).
"""

import torch
import torch.nn.functional as F
from torch import nn

from dobb.stats import register_experts


class Experts(nn.Module):
    grouped_mm_calls = ("w1", "w2")

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.w1 = nn.Parameter(w1.clone())
        self.w2 = nn.Parameter(w2.clone())

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x``: ``(N, dim)`` rows sorted by expert, ``counts[e]`` of them expert ``e``'s."""
        w1 = self.w1.to_local() if hasattr(self.w1, "to_local") else self.w1
        w2 = self.w2.to_local() if hasattr(self.w2, "to_local") else self.w2
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = torch.relu(self._grouped_mm(A=x, B_t=w1.transpose(-2, -1), offs=offs))
        return self._grouped_mm(A=h, B_t=w2.transpose(-2, -1), offs=offs)

    def _grouped_mm(self, *, A, B_t, offs):
        out, start = [], 0
        for e, stop in enumerate(offs.tolist()):
            out.append(F.linear(A[start:stop], B_t[e].mT))
            start = stop
        return torch.cat(out)


register_experts(Experts, Experts.grouped_mm_calls)


class Separate(nn.Module):
    """``Experts``' experts as ``2 E`` ``nn.Linear`` layers, named ``w1[e]``, ``w2[e]``."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        experts, hidden, dim = w1.shape
        kind = dict(bias=False, dtype=w1.dtype)
        self.l1 = nn.ModuleList(nn.Linear(dim, hidden, **kind) for _ in range(experts))
        self.l2 = nn.ModuleList(nn.Linear(hidden, dim, **kind) for _ in range(experts))
        with torch.no_grad():
            for e in range(experts):
                self.l1[e].weight.copy_(w1[e])
                self.l2[e].weight.copy_(w2[e])

    def named_experts(self) -> list[tuple[str, nn.Parameter]]:
        return [(f"w1[{e}]", lin.weight) for e, lin in enumerate(self.l1)] + [
            (f"w2[{e}]", lin.weight) for e, lin in enumerate(self.l2)
        ]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out, start = [], 0
        for e, n in enumerate(counts.tolist()):
            out.append(self.l2[e](torch.relu(self.l1[e](x[start : start + n]))))
            start += n
        return torch.cat(out)


class GatheredExperts(Experts):
    """``Experts`` whose grouped GEMM reads nothing on the host: each row times its expert's
    weights, gathered by the row's expert (``searchsorted`` of the offsets), so that a
    compiled forward has no graph break of its own."""

    def _grouped_mm(self, *, A, B_t, offs):
        rows = torch.arange(A.shape[0], device=A.device)
        expert = torch.searchsorted(offs, rows, right=True)  # (N,): each row's expert
        return torch.einsum("ni,nio->no", A, B_t[expert])


register_experts(GatheredExperts, Experts.grouped_mm_calls)
