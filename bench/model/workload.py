"""The workloads of the benchmarks: GPT hidden matrices and how ranks split them.

A ``Matrix`` is one hidden weight (``d_out x d_in``, the ``nn.Linear`` layout);
``hidden_matrices`` lists those of a GPT config, ``WIDTHS`` the models of the width sweep.
A ``Layout`` says how many ranks split each matrix's rows and columns (FSDP, HSDP, DDP,
Megatron TP) and so what a rank holds; ``dion_rank`` is Dion's rank.
"""

import math
from dataclasses import dataclass

from dobb.optim.dion_core import rank_of
from dobb.train.model import GPT_CONFIGS, gpt_config
from dobb.train.parallel import ROW_PARALLEL

XL_WORLD = 32  # GPUs of the paper's GPT-2 XL call-time run (FSDP; arXiv 2610.39412)

# Randomized Cholesky QR sketch rows: ceil(1.25 r) rounded up to a multiple of 128, as
# dobb.optim.dion (microsoft/dion's values).


@dataclass(frozen=True)
class Matrix:
    """One hidden weight matrix, ``d_out x d_in`` (the ``nn.Linear`` layout)."""

    name: str
    d_out: int
    d_in: int
    source: str = ""
    """The tensor the layer reads; layers with one source (q, k, v) share their input.
    Empty: the layer's own."""

    @property
    def numel(self) -> int:
        return self.d_out * self.d_in

    @property
    def input(self) -> str:
        return self.source or self.name


def transformer_matrices(width: int, layers: int) -> list[Matrix]:
    """The hidden matrices of ``layers`` GPT blocks of width ``d``: q, k, v, attention
    output (``d x d``), MLP up (``4d x d``) and down (``d x 4d``) projections."""
    d = width
    per_block = (
        ("attn.q", d, d, "ln_1"),  # q, k and v read the same normalized input
        ("attn.k", d, d, "ln_1"),
        ("attn.v", d, d, "ln_1"),
        ("attn.proj", d, d, ""),
        ("mlp.fc", 4 * d, d, ""),
        ("mlp.proj", d, 4 * d, ""),
    )
    return [
        Matrix(f"blocks.{i}.{n}", o, k, f"blocks.{i}.{src}" if src else "")
        for i in range(layers)
        for n, o, k, src in per_block
    ]


def hidden_matrices(config: str, layers: int | None = None) -> list[Matrix]:
    """Hidden matrices of the first ``layers`` blocks (default: all) of a GPT config."""
    cfg = gpt_config(config)
    layers = cfg.n_layer if layers is None else layers
    if not 1 <= layers <= cfg.n_layer:
        raise ValueError(f"layers must be in [1, {cfg.n_layer}] for {config!r}, got {layers}")
    return transformer_matrices(cfg.n_embd, layers)


# Width sweep: the GPT-2 family, then wider GPT-style models (4d MLP). The wider ones are
# our own choice of (width, layers), of the sizes of common 2.7B / 7B / 13B / 70B models.
WIDTHS: dict[str, tuple[int, int]] = {
    **{name: (c["n_embd"], c["n_layer"]) for name, c in GPT_CONFIGS.items() if "gpt2" in name},
    "d2560-L32": (2560, 32),
    "d4096-L32": (4096, 32),
    "d5120-L40": (5120, 40),
    "d8192-L80": (8192, 80),
}


def dion_rank(matrix: Matrix, rank_fraction: float) -> int:
    """Dion's rank ``r`` for ``matrix`` at ``rank_fraction`` (``dion_core.rank_of``)."""
    return rank_of((matrix.d_out, matrix.d_in), rank_fraction)


def local_rows(rows: int, world: int) -> int:
    """Rows of the largest FSDP2 shard: ``torch.chunk`` gives ``ceil(rows / world)``."""
    return math.ceil(rows / world)


@dataclass(frozen=True)
class Layout:
    """How ranks split the matrices, by mesh axis (torchtitan's names).

    ``shard``: FSDP2 ranks, splitting rows (``Shard(0)``); ``replicate``: HSDP or DDP
    replicas; ``tensor``: Megatron TP ranks, splitting the rows of column-parallel matrices
    and the columns of row-parallel ones (``ROW_PARALLEL`` names). The ranks of ``shard``
    and ``replicate`` see different tokens (Dobb averages its statistics over them).
    """

    shard: int = 1
    replicate: int = 1
    tensor: int = 1

    @property
    def world(self) -> int:
        return self.shard * self.replicate * self.tensor

    @property
    def data(self) -> int:
        """Ranks that see different tokens."""
        return self.shard * self.replicate

    @property
    def refresh_split(self) -> int:
        """Ranks sharing Dobb's refresh: its innermost data axis (``shard``, else
        ``replicate``)."""
        return self.shard if self.shard > 1 else self.replicate

    def splits(self, m: Matrix) -> tuple[int, int]:
        """Ranks splitting ``m``'s rows and its columns."""
        if self.tensor > 1 and m.name.endswith(ROW_PARALLEL):
            return self.shard, self.tensor
        return self.shard * self.tensor, 1

    def local(self, m: Matrix) -> tuple[int, int]:
        """``(rows, columns)`` of the largest local piece of ``m``."""
        row_split, col_split = self.splits(m)
        return local_rows(m.d_out, row_split), math.ceil(m.d_in / col_split)


ONE_DEVICE = Layout()


def layout_of(name: str, world: int, *, shard: int = 8) -> Layout:
    """The ``Layout`` of a named layout over ``world`` ranks: ``single``, ``ddp``,
    ``fsdp``, ``hsdp`` (``shard`` ranks per replica: one node by default) or ``tp``."""
    if name == "hsdp":
        if world % shard:
            raise ValueError(f"hsdp over {world} ranks needs a multiple of shard={shard}")
        return Layout(shard=shard, replicate=world // shard)
    layouts = {
        "single": ONE_DEVICE,
        "ddp": Layout(replicate=world),
        "fsdp": Layout(shard=world),
        "tp": Layout(tensor=world),
    }
    if name not in layouts:
        raise ValueError(f"unknown layout {name!r}; choose single, ddp, fsdp, hsdp or tp")
    if name == "single" and world != 1:
        raise ValueError(f"layout 'single' has one rank, got world={world}")
    return layouts[name]
