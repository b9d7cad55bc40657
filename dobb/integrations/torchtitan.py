"""Any optimizer of dobb's registry in torchtitan 0.3 (``pip install "dobb[torchtitan]"``).

``DobbOptimizersContainer`` is torchtitan's ``OptimizersContainer`` for a registry entry,
built after parallelization, so the optimizer sees the sharded parameters (FSDP2, TP, HSDP,
FSDP x TP DTensors) and Dobb's hooks the layers that run. Routing, data-parallel ranks,
names and checkpoints, pipeline stages, expert parallelism, the command, and what is
refused at build time (an axis splitting each expert, the ``spmd_types`` backend):
``docs/torchtitan.md``. Nothing in torchtitan or torch is patched: this module subclasses
torchtitan's container and returns its configs. Under pipeline parallelism the container
adds two forward hooks to each stage's module, so that Dobb's statistics skip the forward
torch's ``PipelineStage`` runs to infer shapes (``uncount_pipeline_metadata_inference``).
Tested with torchtitan ``TESTED_VERSION`` on torch 2.13.
"""

import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torchtitan
from torch import nn
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed.utils import get_spmd_backend
from torchtitan.models.common.moe import GroupedExperts

from dobb._dtensor import DTensor
from dobb.groups import DEFAULT_EXCLUDE, param_groups
from dobb.optim.scalar import SCALAR_ALGORITHMS
from dobb.registry import get_entry, without_algorithm
from dobb.stats import layer_weights, register_experts

TESTED_VERSION = "0.3.0"
# Mesh axes (torchtitan's names) whose ranks see different tokens, and the one that splits
# the matrices' features: the axes of every parameter but the routed experts'.
DATA_AXES = ("dp_replicate", "fsdp", "dp_shard", "cp")
MODEL_AXES = ("tp",)
# Under expert parallelism (``parallelism.expert_parallel_degree`` > 1) torchtitan puts the
# routed experts on a mesh of their own: ``ep`` splits the stacks along ``E`` (``Shard(0)``)
# and FSDP shards each rank's experts over ``efsdp`` (``Shard(0)`` again, which makes the
# first placement a ``_StridedShard``), replicated over ``dp_replicate`` under HSDP. Each
# rank holds whole experts whose gradients sum every rank's tokens routed to them (its
# all-to-all), so they are stepped where they are. Any other axis (e.g. ``etp``: expert
# tensor parallelism, which splits each expert's matrices) is unsupported.
EXPERT_AXES = ("dp_replicate", "efsdp", "ep")
SPMD_BACKENDS = ("partial_dtensor", "full_dtensor")
# Name segments of wrapper modules: activation checkpointing's (torchtitan strips it from
# its FQNs too) and ``torch.compile(module)``'s (torchtitan compiles blocks in place).
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod")
# torchtitan's routed experts (``GroupedExperts``: ``w1_EFD``, ``w2_EDF``, ``w3_EFD``), each an
# (E, d_out, d_in) stack: the matrix group of an optimizer that steps experts
# (``dobb.optim.experts``), every registry optimizer's
EXPERT_WEIGHTS = r"\.w[123]_E[DF]{2}$"
# Its forward multiplies the routed tokens by w1, then w3, then (their product) by w2,
# each through its ``_grouped_mm``: Dobb's expert statistics hook there (dobb.stats)
register_experts(GroupedExperts, ("w1_EFD", "w3_EFD", "w2_EDF"))


def part_mesh(model: nn.Module):
    """The one mesh of ``model``'s DTensor parameters but the routed experts under expert
    parallelism (None: no DTensors).

    ``model`` is one model part: the whole model, or one pipeline stage. Every DTensor
    parameter must lie on one mesh whose axes are torchtitan's data axes (``DATA_AXES``)
    and ``tp``, except torchtitan's routed expert stacks (``EXPERT_WEIGHTS``) on an ``ep``
    mesh, whose axes must be ``EXPERT_AXES`` (``on_expert_mesh``). Under pipeline
    parallelism that mesh holds only the ranks of this stage (world size / pipeline
    degree): the other ranks hold other parameters.
    """
    meshes = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and not on_expert_mesh(name, p):
            meshes.setdefault(tuple(p.device_mesh.mesh_dim_names or ()), (name, p.device_mesh))
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not meshes:
        if world > 1:
            raise NotImplementedError(
                f"{world} ranks but no parameter is a DTensor: a model left unsharded is not "
                "supported by dobb.integrations.torchtitan (its ranks would see different "
                "data with no group to average over); shard it with FSDP and/or TP"
            )
        return None
    names, (example, mesh) = max(meshes.items(), key=lambda item: len(item[0]))
    for axes, (name, _) in meshes.items():
        other = [a for a in axes if a not in DATA_AXES + MODEL_AXES]
        if other:
            raise NotImplementedError(
                f"{name} lies on mesh axes {list(axes)}: axis {other[0]!r} is not supported "
                "by dobb.integrations.torchtitan for a parameter other than the routed "
                f"experts' stacks ({EXPERT_WEIGHTS}); its axes are {DATA_AXES + MODEL_AXES}"
            )
        if not set(axes) <= set(names):
            raise NotImplementedError(
                f"{name} lies on mesh axes {list(axes)}, {example} on {list(names)}: "
                "dobb.integrations.torchtitan needs one mesh for all parameters of a part"
            )
    return mesh


def on_expert_mesh(name: str, param) -> bool:
    """Whether the DTensor ``param`` lies on torchtitan's mesh of the routed experts under
    expert parallelism (axes ``ep``, ``efsdp``); raise if it is not an expert stack there,
    or if that mesh has an axis other than ``EXPERT_AXES``."""
    axes = tuple(param.device_mesh.mesh_dim_names or ())
    if not {"ep", "efsdp"} & set(axes):
        return False
    fqn = canonical_fqn(name, WRAPPER_SEGMENTS)
    if not re.search(EXPERT_WEIGHTS, fqn):
        raise NotImplementedError(
            f"{fqn} lies on the experts' mesh {list(axes)} but is not a routed expert stack "
            f"({EXPERT_WEIGHTS}): dobb.integrations.torchtitan steps only those there"
        )
    other = [a for a in axes if a not in EXPERT_AXES]
    if other:
        raise NotImplementedError(
            f"{fqn} lies on mesh axes {list(axes)}: axis {other[0]!r} (e.g. expert tensor "
            "parallelism, which splits each expert) is not supported by dobb.integrations."
            f"torchtitan, whose optimizers step each expert whole (expert axes {EXPERT_AXES})"
        )
    return True


def data_mesh(mesh):
    """The data axes of ``mesh`` (``part_mesh``) with more than one rank; None if none: the
    ranks over which a part's statistics are averaged."""
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or ()
    axes = tuple(a for a in names if a in DATA_AXES and mesh[a].size() > 1)
    return mesh[axes] if axes else None


def named_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``groups`` of ``(name, param)`` pairs with torchtitan's canonical names (wrappers of
    activation checkpointing and ``torch.compile`` stripped), as its checkpoints key them."""
    return [
        {**g, "params": [(canonical_fqn(n, WRAPPER_SEGMENTS), p) for n, p in g["params"]]}
        for g in groups
    ]


class DobbOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container holding one optimizer of dobb's registry per model
    part.

    Built by torchtitan after parallelization (``config.optimizer.build(model_parts=...)``):
    one part for the whole model, or one per pipeline stage this rank runs (two or more
    under looped schedules). Each part gets its own optimizer, routed and, for Dobb, hooked
    (``track``) on that part alone, with the data axes of that part's mesh as its group.
    ``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` are torchtitan's: every
    optimizer in turn, and one flat DCP state keyed by the parameters' FQNs, which the
    stages of a model never share.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        name: str = "dobb"
        """Registry name: dobb, dobb_sign, muon, muonbp, blockmuon, normuon, dion, dion2, adamw."""

        lr: float | None = None
        """Learning rate of the hidden matrices (every parameter for adamw); None: the
        registry's starting value (dobb 1e-3, muon 0.02, dion 0.02, ...). torchtitan's
        lr_scheduler scales it (warmup, decay)."""

        scalar_lr: float | None = None
        """Learning rate of the AdamW/Lion group (embeddings, output, norms, biases); None:
        the registry's (1e-3). Not for adamw, which has one group."""

        scalar_algorithm: Literal["adamw", "lion"] = "adamw"
        """Algorithm of that group."""

        scalar_weight_decay: float = 0.0
        """Decoupled weight decay of that group (adamw too); the hidden matrices' is the
        class's ``weight_decay`` (set it in ``options``). Never inherited from it."""

        exclude: str = DEFAULT_EXCLUDE
        """Regex searched in each canonical parameter name: matching layer weights go to
        the scalar group (torchtitan's llama3 ``output`` head matches the default)."""

        options: str = "{}"
        """Further constructor arguments as a JSON object, e.g. '{"num_blocks": 8}' (dobb)
        or '{"rank_fraction": 0.25}' (dion); see each class's docstring."""

        implementation: Literal["for-loop", "foreach", "fused", "fused_opt_states_bf16"] = "foreach"
        """adamw only: torchtitan's kernel choice. dobb's matrix optimizers have one
        implementation (batched foreach kernels) and take only "foreach"."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        check_supported(config)
        meshes = [part_mesh(model) for model in model_parts]
        self.optimizers = [
            build(config, model, data_mesh(mesh)) for model, mesh in zip(model_parts, meshes)
        ]
        self.model_parts = model_parts
        world = dist.get_world_size() if dist.is_initialized() else 1
        if len(model_parts) > 1 or any(m is not None and m.size() < world for m in meshes):
            for model, optimizer in zip(model_parts, self.optimizers):
                uncount_pipeline_metadata_inference(model, optimizer)
        params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        self._validate_params(params)
        self._post_init(params)


def check_supported(config: DobbOptimizersContainer.Config):
    """Raise for what ``DobbOptimizersContainer`` does not run, saying what to change."""
    backend = get_spmd_backend()
    if backend not in SPMD_BACKENDS:
        raise NotImplementedError(
            f"parallelism.spmd_backend={backend!r} is not supported: dobb's optimizers read "
            f"DTensor placements; set parallelism.spmd_backend to one of {SPMD_BACKENDS} "
            "(the config functions of dobb.integrations.torchtitan use 'partial_dtensor')"
        )
    if config.param_groups:
        raise ValueError(
            "DobbOptimizersContainer routes parameters itself (hidden matrices to the "
            "matrix optimizer, the rest to AdamW/Lion); leave optimizer.param_groups empty "
            "and use optimizer.exclude to send layers to the scalar group"
        )
    if get_entry(config.name).is_matrix and config.implementation != "foreach":
        raise ValueError(
            f"optimizer.implementation={config.implementation!r}: {config.name} has one "
            "implementation (batched foreach kernels); leave implementation='foreach'"
        )


def parse_options(text: str) -> dict[str, Any]:
    """``optimizer.options``: a JSON object of constructor arguments."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"optimizer.options must be a JSON object, e.g. '{{\"num_blocks\": 8}}'; got "
            f"{text!r} ({error})"
        ) from None
    if not isinstance(options, dict):
        raise ValueError(f"optimizer.options must be a JSON object, got {text!r}")
    return options


def build(
    config: DobbOptimizersContainer.Config, model: nn.Module, group=None
) -> torch.optim.Optimizer:
    """The registry's optimizer ``config.name`` for ``model`` (one model part, already
    parallelized) whose ranks see different data along ``group`` (``data_mesh``)."""
    entry = get_entry(config.name)
    kwargs = {
        **entry.hyperparameters,
        "lr": entry.lr if config.lr is None else config.lr,
        **entry.distributed_options(group),
        **parse_options(config.options),
    }
    if not entry.is_matrix:
        if config.scalar_lr is not None or config.scalar_algorithm != "adamw":
            raise ValueError(f"{config.name!r} has one lr: drop scalar_lr/scalar_algorithm")
        decay = {"weight_decay": config.scalar_weight_decay}
        groups = param_groups(model, exclude=config.exclude, scalar_options=decay)
        impl = OptimizersContainer._build_impl_kwargs(config)
        return entry.cls(named_groups([without_algorithm(g) for g in groups]), **impl, **kwargs)
    assert config.scalar_algorithm in SCALAR_ALGORITHMS, config.scalar_algorithm
    scalar_lr = entry.scalar_lr if config.scalar_lr is None else config.scalar_lr
    groups = param_groups(
        model,
        entry.cls.algorithm,
        exclude=config.exclude,
        scalar_algorithm=config.scalar_algorithm,
        scalar_options={"lr": scalar_lr, "weight_decay": config.scalar_weight_decay},
        experts=EXPERT_WEIGHTS if entry.cls.supports_experts else None,
    )
    optimizer = entry.cls(named_groups(groups), **kwargs)
    if entry.needs_statistics and kwargs.get("basis_source", "activations") == "activations":
        optimizer.track(model)
    return optimizer


def uncount_pipeline_metadata_inference(model: nn.Module, optimizer) -> None:
    """Dobb's statistics hooks on ``model`` (a pipeline stage's module) skip the stage's
    metadata inference; torch is left as it is.

    Before its first microbatch (and after a switch from eval), torch's ``PipelineStage``
    runs the stage's forward once to learn its output shapes (``_forward_metadata_inference``,
    with grad on when backward follows): on the first stage's first microbatch (counted
    twice otherwise) and, on every other stage, on ``torch.empty`` inputs (uninitialized
    memory: garbage or NaN statistics). Two hooks on ``model`` itself (not on its compiled
    blocks) handle it: before each forward, one looks up the Python stack for that method's
    code and, if it is there, puts the hooked layers in eval mode, which Dobb's hooks read (an
    ``nn.Linear`` computes the same either way); after the forward (also one that raised) the
    other puts them back. No torch function or class is replaced. Other optimizers have no
    hooks: nothing to do.
    """
    if getattr(optimizer, "statistics", None) is None:
        return
    from torch.distributed.pipelining.stage import PipelineStage

    if not hasattr(PipelineStage, "_forward_metadata_inference"):
        raise NotImplementedError(
            f"torch {torch.__version__}'s PipelineStage has no _forward_metadata_inference "
            "(torch 2.13's), so Dobb cannot keep that shape-inference forward out of its "
            "statistics; use torch 2.13 or set parallelism.pipeline_parallel_degree=1"
        )
    dobb_weights = {
        p
        for g in optimizer.param_groups
        if g["algorithm"] == optimizer.algorithm
        for p in g["params"]
    }
    layers = [m for m, w, _ in layer_weights(model) if w in dobb_weights]
    paused: list[nn.Module] = []

    def before(module, args):
        if in_metadata_inference(PipelineStage):
            paused.extend(m for m in layers if m.training)
            for layer in paused:
                layer.training = False

    def after(module, args, output):
        for layer in paused:
            layer.training = True
        paused.clear()

    model.register_forward_pre_hook(before)
    model.register_forward_hook(after, always_call=True)


def in_metadata_inference(stage_class) -> bool:
    """Whether a caller on the Python stack runs ``stage_class._forward_metadata_inference``
    (compared by code object, looked up now: torch's own, or a test's stand-in)."""
    code = getattr(stage_class._forward_metadata_inference, "__code__", None)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def use_dobb(trainer_config, name: str = "dobb", **fields: Any):
    """``trainer_config`` (a torchtitan ``Trainer.Config``) with its optimizer replaced by
    ``DobbOptimizersContainer.Config(name=name, **fields)`` and the ``partial_dtensor``
    SPMD backend; everything else (model, parallelism, schedule, checkpoints) is kept."""
    trainer_config.optimizer = DobbOptimizersContainer.Config(name=name, **fields)
    trainer_config.parallelism.spmd_backend = "partial_dtensor"
    return trainer_config


# --------------------------------------------- config functions for --module/--config
def llama3_debugmodel():
    """torchtitan's ``llama3_debugmodel`` with Dobb (``--optimizer.name`` to change)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel as base

    return use_dobb(base())


def llama3_8b():
    """torchtitan's ``llama3_8b`` with Dobb (``--optimizer.name`` to change)."""
    from torchtitan.models.llama3.config_registry import llama3_8b as base

    return use_dobb(base())


if getattr(torchtitan, "__version__", TESTED_VERSION) not in (TESTED_VERSION, "0.0.0"):
    import warnings

    warnings.warn(
        f"dobb.integrations.torchtitan is tested with torchtitan {TESTED_VERSION}, found "
        f"{torchtitan.__version__}; pip install 'dobb[torchtitan]' installs the tested one",
        stacklevel=2,
    )
