"""Expert weights: a mixture of experts' ``(E, d_out, d_in)`` parameter is ``E`` matrices.

torchtitan's ``GroupedExperts`` (and Megatron's grouped GEMM) keep a projection's routed
experts in one 3-D parameter, ``w[e]`` the ``d_out x d_in`` weight of expert ``e``. A
matrix optimizer steps each expert as the matrix it is: its own momentum, its own
orthogonalization or selection, its own normalization; nothing is ever computed across
``E``. The driver (``dobb.optim.base``) expands such a parameter into ``E`` ``Matrix``
records (``expert_matrices``): views of the parameter, of its gradient and of its state,
which the placements and cores step like any other matrices (same-shape experts share
kernels where ``foreach`` stacks them).

The state is stacked (``stacked_state``): each tensor of a matrix's state, made per expert
by the core's and the placements' ``init_state`` (expert ``e`` named ``"<name>[e]"``, which
seeds Dion's ``Q_0``), stacked along a leading ``E`` dim, so that ``state_dict()`` holds one
tensor per key and parameter, and a step writes each expert's slice in place.

Where the experts are: plain tensors (one process; DDP, where every replica steps every
expert: the owner exchange that splits 2-D matrices over replicas does not take experts),
or DTensors split along ``E`` only (``Shard(0)`` and ``Replicate`` placements: FSDP2's
default sharding of a stack, expert parallelism; and FSDP2 over an expert-parallel stack,
whose placements are ``(_StridedShard(0), Shard(0))``), where each rank holds whole experts
and steps its own with no communication; their stacked state is a DTensor placed as the
parameter, so that DCP saves and reshards it. Each local expert is named by its global
index (``expert_indices``). Refused at construction with the reason: a
stack split inside its experts (``Shard(1)``, ``Shard(2)``: tensor parallelism of the
experts).

The views are made once per stack (``ExpertViews``) and kept while the stack's local memory
and its state's are the same, so that an expert is the same tensor from step to step (what
keys a matrix's host counts and stacked bases keys an expert too); ``expert_of`` says
which stack and expert a view is, through which Dobb finds an expert's layout and its
statistics (``dobb.stats.ExpertStatistics``), so that new views (the stack given new
memory) find them too.
"""

import functools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dobb._dtensor import DTensor, Replicate, Shard, StridedShard, local
from dobb.optim.parts import Matrix


def is_experts(param: Tensor) -> bool:
    """Whether ``param`` is a stack of expert matrices, ``(E, d_out, d_in)``."""
    return param.ndim == 3


def expert_name(name: str, expert: int) -> str:
    """Expert ``expert``'s name in ``name`` (seeds, errors): ``"w1[3]"``."""
    return f"{name}[{expert}]"


def experts_refusal(param: Tensor, name: str, algorithm: str, supported: bool) -> str | None:
    """Why the ``(E, d_out, d_in)`` parameter ``param`` cannot be stepped as experts by
    ``algorithm`` (its class's ``supports_experts``); None if it can."""
    if not supported:
        return (
            f"{name} is a stack of {param.shape[0]} expert matrices, which algorithm="
            f"{algorithm!r} does not step; put it in a group with algorithm='adamw'"
        )
    if isinstance(param, DTensor) and not all(map(along_experts, param.placements)):
        return (
            f"{name} is a stack of expert matrices split inside its experts "
            f"({param.placements}); an expert stack may be split along its experts only "
            "(Shard(0): FSDP2's default, expert parallelism, FSDP2 over expert parallelism), "
            "so that each rank holds whole experts"
        )
    return None


def along_experts(placement) -> bool:
    """Whether ``placement`` leaves each expert of a stack whole: ``Replicate``, or a split
    along ``E`` (``Shard(0)``; ``_StridedShard(0)``, FSDP2's shard of an ``E`` already
    split by expert parallelism)."""
    return isinstance(placement, Replicate) or (
        isinstance(placement, (Shard, StridedShard)) and placement.dim == 0
    )


def expert_indices(param: Tensor) -> list[int]:
    """The global index of each of this rank's experts of ``param``, in local order
    (``range(E)`` unless a DTensor split along ``E``)."""
    if not isinstance(param, DTensor):
        return list(range(param.shape[0]))
    return list(_placed_indices(param.device_mesh, tuple(param.placements), param.shape[0]))


@functools.cache
def _placed_indices(mesh, placements: tuple, count: int) -> tuple[int, ...]:
    """This rank's part of ``range(count)`` placed as ``placements`` on ``mesh``: torch's
    own split (a local split of a replicated tensor: no communication), once per layout."""
    replicated = DTensor.from_local(
        torch.arange(count), mesh, [Replicate()] * mesh.ndim, run_check=False
    )
    return tuple(local(replicated.redistribute(mesh, placements)).tolist())


def gemm_window(stack: Tensor, seen: int) -> tuple[tuple[int, ...], tuple]:
    """The experts of ``stack`` that a grouped GEMM of ``seen`` experts multiplies on this
    rank (their global numbers, in its order), and the groups of the mesh axes that split
    the stack across them (ranks holding other experts of the one window, which see other
    tokens for them). The window is this rank's experts (expert parallelism: no group),
    the expert-parallel rank's (FSDP2 over expert parallelism gathers its ``_StridedShard``
    axes for the forward), or all of them (FSDP2 gathers every axis)."""
    if not isinstance(stack, DTensor):
        return tuple(range(stack.shape[0])), ()
    mesh, placements = stack.device_mesh, tuple(stack.placements)
    split = [a for a, p in enumerate(placements) if not isinstance(p, Replicate)]
    strided = [a for a in split if isinstance(placements[a], StridedShard)]
    for gathered in ((), strided, split):
        kept = tuple(Replicate() if a in gathered else p for a, p in enumerate(placements))
        window = _placed_indices(mesh, kept, stack.shape[0])
        if len(window) == seen:
            return window, tuple(mesh.get_group(a) for a in gathered)
    raise ValueError(
        f"a grouped GEMM multiplied by {seen} experts of a stack of {stack.shape[0]} placed "
        f"{placements}: neither this rank's experts, its expert-parallel rank's, nor all"
    )


def placed_like(stack: Tensor, param: Tensor) -> Tensor:
    """``stack`` (this rank's ``(E_local, ...)``) placed as ``param`` along ``E``: a DTensor
    of global shape ``(E, ...)`` where ``param`` is one, else ``stack`` itself."""
    if not isinstance(param, DTensor):
        return stack
    shape = (param.shape[0], *stack.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        stack, param.device_mesh, param.placements, run_check=False, shape=shape, stride=stride
    )


def stacked_state(
    param: Tensor, name: str, init: Callable[[Tensor, str], dict[str, Any]], weights: list
) -> dict[str, Tensor]:
    """The state of this rank's experts of ``param`` (``weights``: their views,
    ``ExpertViews.weights``), ``init(w_e, name_e)`` each (``e`` global), stacked along a new
    leading dim and placed as ``param``: ``{key: (E, *shape)}``."""
    indices = expert_indices(param)
    states = [init(weight, expert_name(name, i)) for weight, i in zip(weights, indices)]
    if not states:  # an uneven split can leave a rank without experts: keys and shapes
        template = local(param).new_zeros(param.shape[1:])
        alike = init(template, expert_name(name, param.shape[0]))
        stacked = {key: value.new_empty((0, *value.shape)) for key, value in alike.items()}
    else:
        stacked = {key: torch.stack([state[key] for state in states]) for key in states[0]}
    return {key: placed_like(value, param) for key, value in stacked.items()}


class Expert(NamedTuple):
    """Which expert a view is: of ``stack`` (the parameter), its ``index`` on this rank,
    ``number`` globally (``expert_indices``)."""

    stack: Tensor
    index: int
    number: int


# id(view) -> (a weak reference to the view, its Expert); by identity (a tensor's == is
# elementwise), dropped when the view is freed
_EXPERTS: dict[int, tuple[weakref.ref, Expert]] = {}


def _register(view: Tensor, expert: Expert) -> None:
    key = id(view)

    def drop(dead: weakref.ref) -> None:
        if _EXPERTS.get(key, (None,))[0] is dead:
            del _EXPERTS[key]

    _EXPERTS[key] = (weakref.ref(view, drop), expert)


def expert_of(weight: Tensor) -> Expert | None:
    """The stack and expert of ``weight`` if it is an expert's view (``ExpertViews``)."""
    ref, expert = _EXPERTS.get(id(weight), (None, None))
    return expert if ref is not None and ref() is weight else None


def where(t: Tensor) -> tuple:
    """What identifies a tensor's memory: its address, shape and strides (a DTensor's local
    tensor is a new view object at each ``to_local``, over the same memory)."""
    return t.data_ptr(), tuple(t.shape), t.stride()


class ExpertViews:
    """Each stack's per-expert views, made once and kept (the module docstring): the
    weights' while the stack's local memory is the same, the state's while its tensors'
    are."""

    def __init__(self):
        self._weights: dict[Tensor, tuple[tuple, list[Tensor]]] = {}
        self._states: dict[Tensor, tuple[tuple, list[dict[str, Any]]]] = {}

    def weights(self, stack: Tensor) -> list[Tensor]:
        """This rank's experts of ``stack``, ``(d_out, d_in)`` views of its local tensor."""
        tensor = local(stack)
        held = self._weights.get(stack)
        if held is None or held[0] != where(tensor):
            detached = tensor.detach()
            views = [detached[e] for e in range(detached.shape[0])]
            for e, (view, number) in enumerate(zip(views, expert_indices(stack))):
                _register(view, Expert(stack, e, number))
            held = self._weights[stack] = (where(tensor), views)
        return held[1]

    def states(self, stack: Tensor, state: dict[str, Any]) -> list[dict[str, Any]]:
        """Each expert's state: views of ``state``'s stacked tensors."""
        tensors = {key: local(value) for key, value in state.items()}
        memory = tuple((key, where(t)) for key, t in tensors.items())
        held = self._states.get(stack)
        if held is None or held[0] != memory:
            count = local(stack).shape[0]
            views = [{key: t[e] for key, t in tensors.items()} for e in range(count)]
            held = self._states[stack] = (memory, views)
        return held[1]

    def matrices(self, matrix: Matrix) -> list[Matrix]:
        """``matrix`` (an ``(E, d_out, d_in)`` parameter with its stacked state) as ``E``
        matrices: the experts' views with their gradients' views as ``.grad`` (None
        without a gradient), and their state's views (a step's in-place writes land in the
        parameter and its state)."""
        grad, numbers = local(matrix.param.grad), expert_indices(matrix.param)
        weights = self.weights(matrix.param)
        states = self.states(matrix.param, matrix.state)
        experts = []
        for e, (weight, state) in enumerate(zip(weights, states, strict=True)):
            weight.grad = None if grad is None else grad[e]
            name = expert_name(matrix.name, numbers[e])
            experts.append(Matrix(weight, state, matrix.config, name))
        return experts


def stack_groups(stack: Tensor) -> tuple[tuple, tuple]:
    """The process groups of the mesh axes that split ``stack`` along its experts, and of
    those that copy it (``Replicate``); ``((), ())`` for a plain tensor."""
    if not isinstance(stack, DTensor):
        return (), ()
    mesh, split, copied = stack.device_mesh, [], []
    for axis, placement in enumerate(stack.placements):
        (copied if isinstance(placement, Replicate) else split).append(mesh.get_group(axis))
    return tuple(split), tuple(copied)
