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
experts) and Dobb, whose expert statistics must come from each expert's routed tokens
(issue #42).
"""

import functools
from collections.abc import Callable
from typing import Any

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
            f"{algorithm!r} does not step yet (its statistics must come from each expert's "
            "routed tokens); put it in a group with algorithm='adamw', or use Muon, NorMuon, "
            "MuonBP, Dion, Dion2 or NorDion2 for it"
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
    param: Tensor, name: str, init: Callable[[Tensor, str], dict[str, Any]]
) -> dict[str, Tensor]:
    """The state of this rank's experts of ``param``, ``init(w_e, name_e)`` each (``e``
    global), stacked along a new leading dim and placed as ``param``: ``{key: (E, *shape)}``."""
    weights, indices = local(param).detach(), expert_indices(param)
    states = [init(weights[e], expert_name(name, i)) for e, i in enumerate(indices)]
    if not states:  # an uneven split can leave a rank without experts: keys and shapes
        template = weights.new_zeros(weights.shape[1:])
        alike = init(template, expert_name(name, param.shape[0]))
        stacked = {key: value.new_empty((0, *value.shape)) for key, value in alike.items()}
    else:
        stacked = {key: torch.stack([state[key] for state in states]) for key in states[0]}
    return {key: placed_like(value, param) for key, value in stacked.items()}


def expert_matrices(matrix: Matrix) -> list[Matrix]:
    """``matrix`` (an ``(E, d_out, d_in)`` parameter with its stacked state) as ``E``
    matrices: views of its weights with their gradients' views as ``.grad``, and views of
    its state (a step's in-place writes land in the parameter and its state)."""
    weights, grad = local(matrix.param).detach(), local(matrix.param.grad)
    states = {key: local(value) for key, value in matrix.state.items()}
    experts = []
    for e, i in enumerate(expert_indices(matrix.param)):
        weight = weights[e]
        weight.grad = grad[e]
        state = {key: value[e] for key, value in states.items()}
        experts.append(Matrix(weight, state, matrix.config, expert_name(matrix.name, i)))
    return experts
