"""Layers the tests build models from, besides ``torch.nn``'s."""

from torch import nn


class TransposedLinear(nn.Module):
    """Stores its weight as (d_in, d_out) and computes x @ W, like GPT-2's Conv1D."""

    def __init__(self, weight):
        super().__init__()
        self.weight = nn.Parameter(weight.clone())

    def forward(self, x):
        return x @ self.weight
