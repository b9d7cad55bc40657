"""The owner-exchange placement, for the optimizers that orthogonalize whole matrices on an
owner rank: Muon, MuonBP, NorMuon, Dion2 and NorDion2.

Each of them is the driver (``dobb.optim.base.MatrixOptimizer``) over an ``ExchangeCore``:
its state (``init_state``) and pure functions on plain local tensors, each call over the
matrices of one set of math options (``math_key``), which the functions stack by shape (a
stack of one is the per-matrix form). ``OwnerExchangeOptimizer`` gives them two placements:

- ``OwnerExchanges``: the matrices a process group shares (a DTensor's mesh; DDP with
  ``replica_group``) go through one ``OwnerExchange`` per group (``exchange_step``, the
  protocol below);
- ``Local``: a matrix no other rank shares (one device; DDP without ``replica_group``) takes
  ``core.updates``, the algorithm's batched ``*_updates`` function; nothing communicates.

Composition, not inheritance between optimizers: MuonBP's block steps are a placement
before these two (``piece_steps``), which claims the matrices its schedule does not send to
the core this step and steps their local pieces with no communication; an exchange then
carries only the others (an exchange over that subset, planned on first use).

The owner exchange, per step and process group, for all its matrices together (the pieces
are read from the placements, ``dobb.distributed.exchange``; the owners are balanced over
the group's ranks by size, largest first, so each owner holds about ``1/size`` of them):

1. ``core.directions`` on each rank's own piece (elementwise: momentum and direction);
2. one ``all_to_all`` sends every piece to its matrix's owner, which assembles it: a piece
   held by several ranks (HSDP replicas) is sent once, a piece the owner holds is not sent,
   and under DDP, where every rank holds every matrix whole, the collective is skipped;
3. each owner runs ``core.orthogonalize`` on its whole matrices, stacked by shape;
4. one ``all_to_all`` sends every rank (every holder of a replicated piece) its piece of
   the result, in ``core.result_dtype``;
5. the post step, if the core has one (``sums``): ``core.normalize`` on each rank's rows,
   and one ``all_reduce`` (float64) adds its partial sums over the distinct pieces of each
   matrix, skipped when every rank holds whole matrices (DDP);
6. ``core.apply`` updates each rank's own piece of ``W``.

Per core, what travels (elements per ``m x n`` matrix; back, in ``ns_dtype``: as many,
times replicas; MuonBP's full steps are ``MuonCore``'s, its block steps send nothing):

============  ==============================  ================================  ==========
core          to the owner (state dtype)      post-step ``all_reduce``          pieces
============  ==============================  ================================  ==========
MuonCore      ``N``: up to ``m n``            none                              any
NorMuonCore   ``N``: up to ``m n``            ``||Ô||_F²``: 1 float             whole rows
Dion2Core     ``M_S``: ``k n`` selected rows  none                              whole rows
NorDion2Core  ``M_S``: ``k n`` selected rows  ``||O||_F², ||Ô||_F²``: 2 floats  whole rows
============  ==============================  ================================  ==========

"Whole rows": the core's maths is per row (``whole_rows``), so each piece must hold whole
rows (DDP, FSDP ``Shard(0)``, HSDP, column-parallel TP); a parameter split along its columns
(row-parallel TP's ``Shard(1)``) raises ``NotImplementedError`` at construction. Where the
core sends only some rows (``exchanged_rows``), the owner's matrix is the ``k x n`` stack of
every rank's rows in row order, its size planned at construction: a sharded matrix whose
selection sizes change later (another ``row_fraction`` or ``row_blocks``) raises. With
``ns_dtype=torch.float32`` the result equals the single-device update up to float rounding
of the matmuls (the distributed tests hold every optimizer to one device).

Phases: MuonBP's ``BlockSteps`` schedules each matrix by its own counter (``step``, in
the state, checkpointed), so the matrices of one exchange can fall out of phase (one had no
gradient on some step); the core's step of those due then runs over an exchange of just
them, planned once (a collective: every rank reaches it with the same matrices) and kept.

Why this shape. Of the three designs the issue names, torch's ``adam()`` over
``_multi_tensor_adam`` keeps the maths in functions on tensor lists, which ours already
were (the ``*_update`` references and ``*_updates`` batched forms, tested against each
other and the authors' code): the cores only name them. microsoft/dion's megabatch base
writes each algorithm as a generator that yields at its collectives, so the communication
stays inside the maths, which is what this driver removes. Distributed Shampoo's
distributors separate placement from the algorithm as we do, but also own the blocking of
parameters and one class per parallelism; seven algorithms sharing three protocols need one
driver with a short list of placements per optimizer, not a hierarchy of distributors.
"""

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dobb._dtensor import DTensor, local
from dobb.distributed.exchange import OwnerExchange
from dobb.distributed.groups import mesh_group, one_group
from dobb.distributed.placement import MatrixPlacement, matrix_placement
from dobb.optim.batching import group_by, stack_apply
from dobb.optim.config import OptimizerConfig, option
from dobb.optim.parts import (
    Core,
    Matrix,
    Placement,
    Step,
    local_state,
    partition,
    state_dtype,
)


def holders(param: Tensor, replica_group):
    """The process group whose ranks share ``param``'s update, None for a local update."""
    return mesh_group(param.device_mesh) if isinstance(param, DTensor) else one_group(replica_group)


def shared_buckets(params: list[Tensor], replica_group) -> list[tuple[Any, list[Tensor]]]:
    """``(process group, its parameters)`` for every group of shared matrices among
    ``params``, in an order every rank agrees on (each bucket builds one ``OwnerExchange``
    collectively)."""
    buckets: dict[str, tuple[Any, list[Tensor]]] = {}
    for p in params:
        owners = holders(p, replica_group)
        if owners is not None:
            buckets.setdefault(owners.group_name, (owners, []))[1].append(p)
    return list(buckets.values())


class ExchangeCore(Core):
    """The core of an algorithm that orthogonalizes whole matrices on an owner: besides
    ``Core``'s ``init_state`` and ``updates`` (unshared matrices), the steps around the
    owner exchange. Each method takes the matrices of one set of math options as lists of
    plain local tensors (``states``: their state dicts, with local tensors) and ``config``,
    their options.

    ``sums``: the shape of each matrix's partial sums in the post step (None: no post step).
    ``whole_rows``: why the algorithm needs whole rows (None: it does not); a parameter
    split along its columns (row-parallel TP's ``Shard(1)``) then raises.
    """

    sums: tuple[int, ...] | None = None
    whole_rows: str | None = None

    def directions(self, grads, states, config) -> tuple[list[Tensor], list]:
        """Before the exchange: the ``(rows, cols)`` piece of each matrix to orthogonalize
        (its rows: ``exchanged_rows``), and what ``apply`` needs of each (None: nothing)."""
        raise NotImplementedError

    def orthogonalize(self, matrices: Tensor, config) -> Tensor:
        """On the owner: a whole matrix, or a ``(b, m, n)`` stack, orthogonalized, in
        ``result_dtype(config)`` (the exchange sends it back exactly)."""
        raise NotImplementedError

    def result_dtype(self, config) -> torch.dtype:
        """The dtype ``orthogonalize`` returns."""
        raise NotImplementedError

    def normalize(self, pieces, states, aux, config) -> tuple[list[Tensor], list[Tensor]]:
        """The post step on each rank's pieces of the orthogonalized matrices: the updates
        so far and their partial sums (of shape ``sums``), which ``apply`` gets summed
        over the pieces of each matrix."""
        raise NotImplementedError

    def apply(self, params, updates, shapes, aux, config, sums) -> None:
        """After the exchange: each piece of ``params`` updated in place (``shapes``: the
        whole matrices'; ``sums``: the summed partial sums, or None)."""
        raise NotImplementedError

    def exchanged_rows(self, rows: int, config) -> int | None:
        """How many rows of a ``rows``-row piece travel to the owner (None: the piece)."""
        return None


@dataclass(frozen=True)
class OwnerExchangeConfig(OptimizerConfig):
    """The options of an optimizer that sends whole matrices to owner ranks."""

    replica_group: Any = option(None, group=False)
    """For plain parameters replicated by DDP with averaged gradients: None (every replica
    does all the work) or their ProcessGroup (or DeviceMesh), whose ranks then share it,
    each matrix orthogonalized on one owner as Keller's distributed Muon does; DTensors
    share over their own mesh."""


class OwnerExchanges(Placement):
    """The placement of shared matrices: one ``OwnerExchange`` per process group of them
    (``exchanges``: with its parameters), planned by ``plan`` (collective), and the step of
    each (``exchange_step``, the protocol of the module docstring)."""

    def __init__(self, core: ExchangeCore, replica_group):
        self.core, self.replica_group = core, replica_group
        self.exchanges: list[tuple[OwnerExchange, list[Tensor]]] = []
        self.subsets: dict[tuple[int, ...], OwnerExchange] = {}

    def plan(self, configs: dict[Tensor, Any]) -> None:
        """One ``OwnerExchange`` per process group of shared matrices among ``configs``' keys
        (every matrix parameter, with its config; collective: every rank builds the
        optimizer, so every rank gets here with the same parameters)."""
        self.subsets = {}
        self.exchanges = [
            (OwnerExchange(self._placements(params, owners, configs), owners), params)
            for owners, params in shared_buckets(list(configs), self.replica_group)
        ]

    def _placements(self, params: list[Tensor], owners, configs) -> list[MatrixPlacement]:
        """This rank's placement of what each matrix sends its owner: its piece, or, where
        the core sends only some rows (``exchanged_rows``: Dion2's selection), its rows of
        the ``k x n`` matrix of every rank's: a fixed range, after the rows of the pieces
        that start above it (collective: one ``all_gather_object``)."""
        placements = [matrix_placement(p) for p in params]
        counts = [
            self.core.exchanged_rows(len(pl.rows), configs[p]) for p, pl in zip(params, placements)
        ]
        if all(count is None for count in counts):
            return placements
        # per matrix: (first global row of my piece or -1, its exchanged rows)
        mine = [(int(pl.rows[0]) if len(pl.rows) else -1, k) for pl, k in zip(placements, counts)]
        everyone = [None] * dist.get_world_size(owners)
        dist.all_gather_object(everyone, mine, group=owners)
        out = []
        for j, (p, (first, count)) in enumerate(zip(params, mine)):
            distinct = dict(theirs[j] for theirs in everyone if theirs[j][0] >= 0)
            before = sum(k for start, k in distinct.items() if start < first)
            shape = (sum(distinct.values()), p.shape[1])
            rows = torch.arange(before, before + count)
            out.append(MatrixPlacement(shape, rows, torch.arange(p.shape[1])))
        return out

    def _subset(self, exchange: OwnerExchange, params: list[Tensor], configs) -> OwnerExchange:
        """An exchange over just ``params`` of ``exchange``'s (planned collectively on first
        use, then kept: every rank reaches it with the same matrices)."""
        key = (id(exchange), *(id(p) for p in params))
        if key not in self.subsets:
            placements = self._placements(params, exchange.group, configs)
            self.subsets[key] = OwnerExchange(placements, exchange.group)
        return self.subsets[key]

    def claim(self, matrices: list[Matrix]) -> tuple[list[Matrix], list[Matrix]]:
        """The matrices of an exchange; the rest are local."""
        shared = {p for _, params in self.exchanges for p in params}
        return partition(matrices, [m.param in shared for m in matrices])

    def step(self, matrices: list[Matrix], core: ExchangeCore, step: Step) -> None:
        """Each exchange's step of its matrices among ``matrices`` (the others of it took
        another placement's step, or have no gradient), with this step's options."""
        due = {m.param: m for m in matrices}
        for exchange, params in self.exchanges:
            self.exchange_step(exchange, params, due, step.configs)

    def exchange_step(self, exchange: OwnerExchange, params, due: dict, configs) -> None:
        """The core's step of the matrices shared by ``exchange``'s ranks that are ``due``
        (``Matrix`` by parameter; the others took a piece step), with this step's options
        (``configs``: each parameter's). A parameter without a gradient takes part with
        zeros (every rank must) and stays unchanged."""
        live = [p for p in params if p.grad is not None]
        if not any(p in due for p in live):
            return
        if not all(p in due for p in live):
            params = [p for p in live if p in due]
            exchange = self._subset(exchange, params, configs)
        options = [configs[p] for p in params]
        live = [j for j, p in enumerate(params) if p.grad is not None]
        keys = [config.math_key() for config in options]
        stacks = [[live[i] for i in ix] for ix in group_by(live, keys.__getitem__).values()]
        states = {j: local_state(due[params[j]].state) for j in live}
        pieces, aux = [None] * len(params), [None] * len(params)
        for js in stacks:
            grads = [local(params[j].grad) for j in js]
            found, extra = self.core.directions(grads, [states[j] for j in js], options[js[0]])
            for j, piece, a in zip(js, found, extra):
                pieces[j], aux[j] = piece, a
        for j, p in enumerate(params):
            rows, cols = exchange.pieces[j][exchange.me]
            if pieces[j] is None:
                pieces[j] = local(p).new_zeros((len(rows), len(cols)), dtype=state_dtype(p))
            elif len(pieces[j]) != len(rows):
                raise RuntimeError(
                    f"{due[p].name}: {len(pieces[j])} rows selected but {len(rows)} "
                    "planned; row_fraction and row_blocks of a sharded matrix are fixed at "
                    "construction"
                )
        device = pieces[0].device
        # every piece to its matrix's owner (one all_to_all)
        whole = exchange.gather(pieces)
        # orthogonalized on the owner, stacked by shape and math options
        owned, options_of_key = list(whole), dict(zip(keys, options))
        results = stack_apply(
            [whole[j] for j in owned],
            lambda matrices, k: self.core.orthogonalize(matrices, options_of_key[k]),
            key=lambda i: keys[owned[i]],
            batched=options[0].batched(device),
        )
        # every rank's piece of the results back from the owner (one all_to_all)
        dtypes = [self.core.result_dtype(config) for config in options]
        buffer_dtype = functools.reduce(torch.promote_types, dtypes)
        back = exchange.scatter(dict(zip(owned, results)), buffer_dtype, device)
        updates = {j: back[j].to(dtypes[j]) for j in live}  # exact: they were in dtypes[j]
        sums = self._post_step(exchange, stacks, updates, states, aux, options, device)
        for js in stacks:
            self.core.apply(
                [local(params[j]) for j in js],
                [updates[j] for j in js],
                [tuple(params[j].shape) for j in js],
                [aux[j] for j in js],
                options[js[0]],
                None if sums is None else [sums[j] for j in js],
            )

    def _post_step(self, exchange, stacks, updates, states, aux, options, device) -> Tensor | None:
        """``core.normalize`` of each stack (``updates`` replaced in place), and every
        matrix's partial sums added over its distinct pieces: one ``all_reduce`` when some
        rank holds less than a matrix (each distinct piece counted once, by its sender);
        None without a post step."""
        if self.core.sums is None:
            return None
        zero = torch.zeros(self.core.sums, dtype=torch.float64, device=device)
        sums = [zero] * len(options)
        for js in stacks:
            found, partial = self.core.normalize(
                [updates[j] for j in js],
                [states[j] for j in js],
                [aux[j] for j in js],
                options[js[0]],
            )
            for j, update, part in zip(js, found, partial):
                updates[j] = update
                if not exchange.split or exchange.me in exchange.sources[j]:
                    sums[j] = part
        sums = torch.stack(sums)
        if exchange.split:
            dist.all_reduce(sums, group=exchange.group)
        return sums
