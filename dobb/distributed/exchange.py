"""Whole-matrix work on sharded or replicated matrices: one owner rank per matrix.

Muon needs each update matrix whole. ``OwnerExchange`` gives each matrix an owner among the
ranks of a process group (balanced by size, the same on every rank), and moves data with
one ``all_to_all_single`` per direction for all the matrices together:

- ``gather``: every piece of a matrix goes to its owner, which assembles the whole matrix.
  A piece held by several ranks (replicated mesh axes, DDP) is sent once, by one holder;
  a piece the owner holds itself is not sent. When nothing needs sending (DDP: every
  rank holds every matrix whole) the collective is skipped on every rank alike.
- ``scatter``: the owner cuts its result into the pieces each rank holds and sends them.

Each rank thus works on about ``1/size`` of the matrices. Rows and columns are global
index tensors (``MatrixPlacement``), so uneven, empty and strided shards need no special
case. The plan is built once, collectively (one ``all_gather_object`` of every rank's
indices), and is never checkpointed.
"""

import torch
import torch.distributed as dist
from torch import Tensor

from dobb.distributed.placement import MatrixPlacement


class OwnerExchange:
    """Gather matrices to their owners and scatter the owners' results back.

    Args:
        placements: this rank's ``MatrixPlacement`` of each matrix, in an order that every
            rank of ``group`` shares.
        group: the ranks that hold pieces of these matrices (all ranks of their mesh, or
            the data-parallel group for plain replicated tensors).
    """

    def __init__(self, placements: list[MatrixPlacement], group):
        self.group = group
        self.size = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        self.shapes = [p.shape for p in placements]
        mine = [(_compact(p.rows), _compact(p.cols)) for p in placements]
        everyone = [None] * self.size
        dist.all_gather_object(everyone, mine, group=group)
        # pieces[j][h]: (rows, cols) of matrix j on group rank h
        self.pieces = [
            [(_expand(everyone[h][j][0]), _expand(everyone[h][j][1])) for h in range(self.size)]
            for j in range(len(placements))
        ]
        self.owners = balanced_owners([m * n for m, n in self.shapes], self.size)
        self.sources = [self._sources(j) for j in range(len(placements))]
        for j, sources in enumerate(self.sources):  # the distinct pieces tile the matrix
            m, n = self.shapes[j]
            assert sum(self._numel(j, h) for h in sources) == m * n, (j, self.pieces[j])
        # some rank holds less than a whole matrix (a sum over a matrix needs its pieces')
        self.split = any(
            len(rows) * len(cols) != m * n
            for (m, n), pieces in zip(self.shapes, self.pieces)
            for rows, cols in pieces
        )
        # both are part of the shared plan, so every rank skips a needless collective alike
        self.gather_needed = any(
            h != self.owners[j] for j, sources in enumerate(self.sources) for h in sources
        )
        self.scatter_needed = any(
            self._numel(j, h)
            for j, owner in enumerate(self.owners)
            for h in range(self.size)
            if h != owner
        )

    def _sources(self, j: int) -> list[int]:
        """Who sends each distinct non-empty piece of matrix ``j`` to its owner."""
        owner, holders = self.owners[j], {}
        for h, (rows, cols) in enumerate(self.pieces[j]):
            if len(rows) and len(cols):
                holders.setdefault((tuple(rows.tolist()), tuple(cols.tolist())), []).append(h)
        return [owner if owner in hs else hs[owner % len(hs)] for hs in holders.values()]

    def owned(self) -> list[int]:
        """Indices of the matrices this rank owns."""
        return [j for j, owner in enumerate(self.owners) if owner == self.me]

    def gather(self, pieces: list[Tensor]) -> dict[int, Tensor]:
        """Whole matrices owned by this rank, assembled from every rank's ``pieces[j]``."""
        dtype, device = _common_dtype(pieces), pieces[0].device
        send = [[] for _ in range(self.size)]
        expect = [[] for _ in range(self.size)]  # per source: matrices, in its send order
        for j, sources in enumerate(self.sources):
            owner = self.owners[j]
            for h in sources:
                if h != owner and h == self.me:
                    send[owner].append(pieces[j].reshape(-1).to(dtype))
                if h != owner and owner == self.me:
                    expect[h].append((j, self._numel(j, h)))
        incoming = self._all_to_all(send, expect, dtype, device, self.gather_needed)
        full = {}
        for j in self.owned():
            full[j] = torch.empty(self.shapes[j], dtype=pieces[j].dtype, device=device)
            if self.me in self.sources[j]:
                self._put(full[j], j, self.me, pieces[j])
        for h, chunks in enumerate(incoming):
            for (j, _), chunk in zip(expect[h], chunks):
                self._put(full[j], j, h, chunk)
        return full

    def scatter(self, results: dict[int, Tensor], dtype: torch.dtype, device) -> list[Tensor]:
        """This rank's piece of every matrix's result (``results``: the owned ones)."""
        send = [[] for _ in range(self.size)]
        expect = [[] for _ in range(self.size)]
        mine: list[Tensor | None] = [None] * len(self.shapes)
        for j, owner in enumerate(self.owners):
            if owner != self.me:
                expect[owner].append((j, self._numel(j, self.me)))
                continue
            for h in range(self.size):
                piece = self._take(results[j], j, h)
                if h == self.me:
                    mine[j] = piece
                elif piece.numel():
                    send[h].append(piece.reshape(-1).to(dtype))
        incoming = self._all_to_all(send, expect, dtype, device, self.scatter_needed)
        for h, chunks in enumerate(incoming):
            for (j, _), chunk in zip(expect[h], chunks):
                rows, cols = self.pieces[j][self.me]
                mine[j] = chunk.view(len(rows), len(cols))
        return mine

    # ------------------------------------------------------------------ helpers
    def _numel(self, j: int, h: int) -> int:
        rows, cols = self.pieces[j][h]
        return len(rows) * len(cols)

    def _put(self, full: Tensor, j: int, h: int, piece: Tensor) -> None:
        rows, cols = (i.to(full.device) for i in self.pieces[j][h])
        full[rows[:, None], cols] = piece.reshape(len(rows), len(cols)).to(full.dtype)

    def _take(self, full: Tensor, j: int, h: int) -> Tensor:
        rows, cols = (i.to(full.device) for i in self.pieces[j][h])
        return full[rows[:, None], cols]

    def _all_to_all(self, send, expect, dtype, device, needed: bool) -> list[list[Tensor]]:
        """One ``all_to_all_single``: ``send[d]`` to rank ``d``; returns, per source ``h``,
        the chunks of the sizes listed in ``expect[h]``. Skipped (on every rank alike, as
        ``needed`` is part of the shared plan) when no rank sends anything."""
        if not needed:
            return [[] for _ in range(self.size)]
        in_splits = [sum(t.numel() for t in parts) for parts in send]
        out_splits = [sum(n for _, n in chunks) for chunks in expect]
        flat = [t for parts in send for t in parts]
        inp = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
        out = torch.empty(sum(out_splits), dtype=dtype, device=device)
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        per_source = out.split(out_splits)
        return [list(chunk.split([n for _, n in expect[h]])) for h, chunk in enumerate(per_source)]


def balanced_owners(sizes: list[int], ranks: int) -> list[int]:
    """An owner rank per matrix: largest first, each to the least-loaded rank (ties: lowest
    rank). Deterministic, so every rank computes the same assignment."""
    load = [0] * ranks
    owners = [0] * len(sizes)
    for j in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        owner = min(range(ranks), key=lambda r: (load[r], r))
        owners[j] = owner
        load[owner] += sizes[j]
    return owners


def _common_dtype(tensors: list[Tensor]) -> torch.dtype:
    """One buffer dtype that holds every tensor exactly (they are cast back on arrival)."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _compact(index: Tensor):
    """A contiguous index run as (start, stop), anything else as a list (for pickling)."""
    if len(index) and torch.equal(index, torch.arange(int(index[0]), int(index[0]) + len(index))):
        return (int(index[0]), int(index[0]) + len(index))
    return index.tolist() if len(index) else (0, 0)


def _expand(compact) -> Tensor:
    if isinstance(compact, tuple):
        return torch.arange(*compact)
    return torch.tensor(compact, dtype=torch.long)
