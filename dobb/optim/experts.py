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

Supported: plain tensors (one process; DDP, where every replica steps every expert: the
owner exchange that splits 2-D matrices over replicas does not take experts). Refused at
construction with the reason: experts as DTensors (FSDP, expert parallelism) and Dobb,
whose expert statistics must come from each expert's routed tokens (issue #42).
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from dobb._dtensor import DTensor
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
    if isinstance(param, DTensor):
        return (
            f"{name} is a stack of expert matrices sharded as a DTensor ({param.placements}): "
            "experts under FSDP or expert parallelism are not supported yet; keep expert "
            "weights as plain tensors (one process, DDP) or in an algorithm='adamw' group"
        )
    return None


def stacked_state(
    param: Tensor, name: str, init: Callable[[Tensor, str], dict[str, Any]]
) -> dict[str, Tensor]:
    """The state of every expert of ``param``, ``init(w_e, name_e)`` each, stacked along a
    new leading dim: ``{key: (E, *shape)}``."""
    weights = param.detach()
    states = [init(weights[e], expert_name(name, e)) for e in range(param.shape[0])]
    return {key: torch.stack([state[key] for state in states]) for key in states[0]}


def expert_matrices(matrix: Matrix) -> list[Matrix]:
    """``matrix`` (an ``(E, d_out, d_in)`` parameter with its stacked state) as ``E``
    matrices: views of its weights with their gradients' views as ``.grad``, and views of
    its state (a step's in-place writes land in the parameter and its state)."""
    weights, grad = matrix.param.detach(), matrix.param.grad
    experts = []
    for e in range(weights.shape[0]):
        weight = weights[e]
        weight.grad = grad[e]
        state = {key: value[e] for key, value in matrix.state.items()}
        experts.append(Matrix(weight, state, matrix.config, expert_name(matrix.name, e)))
    return experts
