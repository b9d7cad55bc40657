"""torchtitan config for the resharding tests (``--module titan_reshard_configs``).

``llama3_reshard`` is ``titan_configs.llama3_cpu`` (the debug llama3 on CPU, with Dobb)
whose data do not depend on the world size: ``GlobalBatches`` gives data-parallel rank
``r`` of ``W`` its ``G / W`` rows of the same global batch of ``G`` sequences at every
step, so a job on 2 ranks and one on 4 see the same tokens per step and train the same
model up to the rounding of their reductions. torchtitan's own text loader splits the
documents by rank and refuses to load its state on another data-parallel degree
("dataloader resharding is not supported yet"); this one keeps one number, the global
sequences consumed, the same on every rank, so DCP reshards it like any other state.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from titan_configs import llama3_cpu
from torchtitan.components.dataloader import BaseDataLoader

LAYERS = 2  # of the debug model's 6: every matrix shape, a third of the time


class GlobalBatches(BaseDataLoader):
    """Sequence ``i`` of the stream is ``seq_len + 1`` tokens drawn (Zipf-like, seed
    ``i``) from the first ``vocab`` ids; step ``t``'s global batch is sequences
    ``[t G, (t + 1) G)`` and rank ``r`` of ``W`` holds rows ``[r G/W, (r + 1) G/W)``."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab: int = 510
        """Token ids drawn from [0, vocab) (the test tokenizer's 510 words)."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        seq_len: int,
        local_batch_size: int,
        **kwargs,
    ):
        self.rank, self.world, self.rows = dp_rank, dp_world_size, local_batch_size
        self.seq_len = seq_len
        self.weights = 1.0 / torch.arange(1, config.vocab + 1, dtype=torch.float64)
        self.consumed = 0  # sequences of every rank handed out so far

    def sequence(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(index)
        return torch.multinomial(self.weights, self.seq_len + 1, True, generator=generator)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            first = self.consumed + self.rank * self.rows
            tokens = torch.stack([self.sequence(first + j) for j in range(self.rows)])
            self.consumed += self.rows * self.world
            yield {"input": tokens[:, :-1]}, tokens[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        consumed = state_dict.get("consumed", 0)
        if consumed % (self.rows * self.world):
            raise ValueError(
                f"{consumed} sequences consumed is not a whole number of global batches of "
                f"{self.rows * self.world}: keep the global batch size when resuming"
            )
        self.consumed = consumed


def llama3_reshard():
    """The CPU debug llama3, its first ``LAYERS`` blocks, fed ``GlobalBatches``: a global
    batch of ``training.local_batch_size`` times the data-parallel ranks sequences a step
    (keep the product when changing the number of ranks)."""
    config = llama3_cpu()
    config.dataloader = GlobalBatches.Config()
    model = config.model_spec.model
    model.layers = model.layers[:LAYERS]
    return config
