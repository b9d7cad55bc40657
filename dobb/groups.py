"""Split a model's parameters into matrix-optimizer and AdamW groups.

Shape alone cannot tell a hidden projection from an embedding or an output head (all are
2-D), so routing is by layer type and name. Weights of tracked layers (``nn.Linear``,
``transformers``' ``Conv1D``, types added with ``dobb.stats.register_layer``) go to the
matrix optimizer unless their name matches ``exclude`` or they are shared with an
``nn.Embedding`` (tied LM heads); everything else (embeddings, heads, norms, biases) goes
to AdamW.
"""

import re
from typing import Any

from torch import nn

from dobb.stats import layer_weights

# Names of output heads and embeddings in common model families (GPT-2, Llama, BERT, ...).
DEFAULT_EXCLUDE = (
    r"(^|\.)(lm_head|head|output|wte|wpe|embed_tokens|embed_positions|embeddings?)(\.|$)"
)


def param_groups(
    model: nn.Module,
    algorithm: str | None = None,
    *,
    exclude: str = DEFAULT_EXCLUDE,
    matrix_options: dict[str, Any] | None = None,
    scalar_algorithm: str = "adamw",
    scalar_options: dict[str, Any] | None = None,
    experts: str | None = None,
) -> list[dict[str, Any]]:
    r"""Named parameter groups: ``[{matrix...}, {algorithm: scalar...}]``, for any of dobb's
    matrix optimizers (``dobb.Muon(dobb.param_groups(model))``): the matrix group takes the
    optimizer's own algorithm unless ``algorithm`` names one; the scalar group takes AdamW
    (``scalar_algorithm``) at its own learning rate (1e-3 unless ``scalar_options`` sets
    ``lr``), never the matrix optimizer's.

    Args:
        exclude: regex searched in each parameter's name; matching layer weights go to the
            scalar group. Pass your model's head/embedding names if they differ.
        matrix_options / scalar_options: extra keys for each group (e.g. ``{"lr": 3e-3}``).
        experts: regex searched in the names of 3-D parameters, ``(E, d_out, d_in)`` stacks
            of a mixture of experts' weights (torchtitan's ``GroupedExperts``:
            ``r"experts\.w[123]$"``): matching ones go to the matrix group, each expert
            stepped as its own matrix (``dobb.optim.experts``; Dobb's statistics come from
            each expert's routed tokens: ``dobb.stats.register_experts``). None: every 3-D
            parameter goes to the scalar group.
    """
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matrices = {id(weight) for _, weight, _ in layer_weights(model)}
    pattern = re.compile(exclude)
    expert = re.compile(experts) if experts is not None else None
    matrix, scalar = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_matrix = id(p) in matrices and id(p) not in tied and not pattern.search(name)
        is_matrix |= p.ndim == 3 and expert is not None and bool(expert.search(name))
        (matrix if is_matrix else scalar).append((name, p))
    groups = []
    if matrix:
        named = {} if algorithm is None else {"algorithm": algorithm}
        groups.append({"params": matrix, **named, **(matrix_options or {})})
    if scalar:
        groups.append({"params": scalar, "algorithm": scalar_algorithm, **(scalar_options or {})})
    return groups
