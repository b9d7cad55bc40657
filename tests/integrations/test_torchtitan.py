"""torchtitan 0.3.0 with dobb's optimizers, run for real on two gloo ranks on CPU.

Marked ``torchtitan``: deselected by ``make test`` (pyproject's ``addopts``), run by
``make test-torchtitan`` after ``pip install -e ".[torchtitan]"``. One ``torchrun`` of two
ranks runs ten torchtitan jobs in turn (``torchtitan_rank.py``): the debug llama3 with
Dobb, Muon and Dion under FSDP and Dobb under TP, each for 4 steps saving DCP checkpoints
at steps 2 and 4, and each again resumed from its step-2 checkpoint; the two step-4
checkpoints of every pair must be bit-identical. Dobb and Muon under FSDP run once more
with torchtitan's compile switch on (``COMPILE``: each transformer block compiled with
``fullgraph=True``, where a graph break is an error, and the loss): their losses and step-4
checkpoints must equal the eager run's bit for bit, with no graph break. The CPU shim is
``torchtitan_cpu.py``, the assets (tokenizer, 400 documents) are written by
``titan_assets.py``.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.torchtitan

HERE = Path(__file__).parent
STEPS, SAVE_EVERY = 4, 2
# (optimizer, layout, state every hidden matrix of that optimizer holds)
JOBS = [
    ("dobb", "fsdp", "basis"),
    ("muon", "fsdp", "momentum"),
    ("dion", "fsdp", "Q"),
    ("dobb", "tp", "basis"),
]
LAYOUTS = {
    "fsdp": [],  # data_parallel_shard_degree -1: both ranks
    "tp": ["--parallelism.tensor_parallel_degree", "2"],
}
# jobs run again with torchtitan's compile switch on, as (optimizer, layout)
COMPILED = [("dobb", "fsdp"), ("muon", "fsdp")]
# the model's blocks and the loss; aot_eager: Dynamo and AOTAutograd as with inductor, the
# graphs run by torch's eager kernels (inductor's C++ builds would take minutes on 2 cores)
COMPILE = ["--compile.enable", "--compile.components", "model,loss"]
COMPILE += ["--compile.backend", "aot_eager"]
RUN_TIMEOUT = 420  # seconds for all ten jobs (about 75 on two cores)


def job_args(out: Path, name: str, layout: str, resume: bool, compiled: bool = False) -> list:
    """torchtitan's command line of one job; its dump folder is ``out/{name}_{layout}``
    with ``_resumed`` (from the step-2 checkpoint) or ``_compiled`` appended."""
    suffix = "_resumed" if resume else "_compiled" if compiled else ""
    folder = out / f"{name}_{layout}"
    args = [
        "--module", "titan_configs", "--config", "llama3_cpu",
        "--optimizer.name", name, *LAYOUTS[layout], *(COMPILE if compiled else []),
        "--debug.seed", "0", "--training.steps", str(STEPS),
        "--checkpoint.enable", "--checkpoint.interval", str(SAVE_EVERY),
        "--comm.init_timeout_seconds", "120",
        "--dump_folder", str(folder.with_name(folder.name + suffix)),
    ]  # fmt: skip
    if resume:
        args += [
            "--checkpoint.initial_load_path",
            str(folder / "checkpoint" / f"step-{SAVE_EVERY}"),
            "--checkpoint.no-initial_load_model_only",
        ]
    return args


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run every job and its resumed twin in one torchrun; returns (folder, wall seconds)."""
    from titan_assets import make_assets

    root = tmp_path_factory.mktemp("torchtitan")
    assets = make_assets(root / "assets")
    jobs = [
        job_args(root / "runs", name, layout, resume)
        for name, layout, _ in JOBS
        for resume in (False, True)
    ] + [job_args(root / "runs", name, layout, False, compiled=True) for name, layout in COMPILED]
    (root / "jobs.json").write_text(json.dumps(jobs))
    env = {
        **os.environ,
        "TITAN_ASSETS": str(assets),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(root / "hf"),
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
        "2", str(HERE / "torchtitan_rank.py"), str(root / "jobs.json"),
    ]  # fmt: skip
    start = time.perf_counter()
    result = subprocess.run(
        command, cwd=root, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    wall = time.perf_counter() - start
    (root / "torchrun.log").write_text(result.stdout + result.stderr)
    assert result.returncode == 0, (
        f"torchrun failed (rc {result.returncode}); log {root / 'torchrun.log'}:\n"
        + (result.stdout + result.stderr)[-6000:]
    )
    print(f"torchtitan: {len(jobs)} jobs on 2 gloo ranks in {wall:.1f} s")
    return root / "runs", wall


def load_checkpoint(folder: Path) -> dict:
    """A DCP checkpoint as one flat dict, read in this (single) process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = folder.with_suffix(".pt")
    dcp_to_torch_save(folder, target)
    return torch.load(target, weights_only=False)


def flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from flatten(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], tree


def same(a, b) -> bool:
    """Bit-identical tensors, or equal other values."""
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("name, layout, state_key", JOBS, ids=[f"{n}-{lay}" for n, lay, _ in JOBS])
def test_resume_gives_a_bit_identical_checkpoint(runs, name, layout, state_key):
    out, _ = runs
    straight = load_checkpoint(out / f"{name}_{layout}" / "checkpoint" / f"step-{STEPS}")
    resumed = load_checkpoint(out / f"{name}_{layout}_resumed" / "checkpoint" / f"step-{STEPS}")
    assert straight["train_state"]["step"] == resumed["train_state"]["step"] == STEPS
    a, b = dict(flatten(straight)), dict(flatten(resumed))
    assert a.keys() == b.keys()
    differ = [key for key in a if not same(a[key], b[key])]
    assert not differ, f"{len(differ)} entries differ after a resume, e.g. {differ[:5]}"
    # the registry's optimizer ran: its state, on the hidden matrices, moved the weights
    assert f"optimizer.state.layers.0.attention.wo.weight.{state_key}" in a
    first = load_checkpoint(out / f"{name}_{layout}" / "checkpoint" / f"step-{SAVE_EVERY}")
    assert not torch.equal(first["layers.0.attention.wo.weight"], a["layers.0.attention.wo.weight"])


def records(folder: Path) -> list[dict]:
    """The ``record-rank*.json`` of a job's two ranks (``torchtitan_rank.py``)."""
    return [json.loads((folder / f"record-rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.parametrize("name, layout", COMPILED, ids=[f"{n}-{lay}" for n, lay in COMPILED])
def test_compiled_blocks_train_as_eager_without_graph_breaks(runs, name, layout):
    out, _ = runs
    eager, compiled = out / f"{name}_{layout}", out / f"{name}_{layout}_compiled"
    eager_losses = records(eager)[0]["losses"]
    assert len(eager_losses) == STEPS
    for record in records(compiled):
        assert record["graph_breaks"] == {}, f"graph breaks in {compiled.name}"
        # one graph for all the blocks (identical blocks share it), one for the loss; more
        # would mean a recompile per block, which fullgraph turns into an error past the limit
        assert record["frames_compiled"] == 2, record
        assert record["losses"] == eager_losses
    # Dobb's statistics were gathered inside the compiled blocks (dobb::observe): every
    # basis, statistic count and weight equals the eager run's
    a = dict(flatten(load_checkpoint(eager / "checkpoint" / f"step-{STEPS}")))
    b = dict(flatten(load_checkpoint(compiled / "checkpoint" / f"step-{STEPS}")))
    assert a.keys() == b.keys()
    differ = [key for key in a if not same(a[key], b[key])]
    assert not differ, f"{len(differ)} entries differ from eager, e.g. {differ[:5]}"


def test_dobb_counted_steps_and_statistics_once_per_step(runs):
    # 4 optimizer steps, each with statistics: the counters say 4, not 5 (the resume's DCP
    # state-initialising step, before the checkpoint is loaded into it, counts nothing)
    out, _ = runs
    state = load_checkpoint(out / "dobb_fsdp_resumed" / "checkpoint" / f"step-{STEPS}")
    prefix = "state.layers.0.feed_forward.w1.weight."
    assert float(state["optimizer"][prefix + "step"]) == STEPS
    assert float(state["optimizer"][prefix + "stats_steps"]) == STEPS


def test_the_jobs_fit_the_ci_budget(runs):
    _, wall = runs
    assert wall < 180, f"ten torchtitan jobs took {wall:.0f} s; the CI stage allows ~120"


# ------------------------------------------------------------------ in one process
@pytest.fixture(scope="module")
def titan():
    sys.path.insert(0, str(HERE))
    from torchtitan_cpu import install

    install()  # the model package imports Triton kernels; this process has no GPU
    from torchtitan.models.llama3 import model_registry

    from dobb.integrations import torchtitan as integration

    return integration, model_registry


def debug_model(model_registry) -> nn.Module:
    torch.manual_seed(0)
    with torch.device("cpu"):
        return model_registry("debugmodel").model.build()


def container(integration, model, **fields):
    config = integration.DobbOptimizersContainer.Config(**fields)
    return integration.DobbOptimizersContainer(config, model_parts=[model])


def names_by_algorithm(optimizers):
    (opt,) = optimizers.optimizers
    return {g["algorithm"]: sorted(g["param_names"]) for g in opt.param_groups}


def test_parameter_names_do_not_depend_on_checkpoint_or_compile_wrappers(titan):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    integration, model_registry = titan
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")
    plain = names_by_algorithm(container(integration, debug_model(model_registry)))
    for wrap in (checkpoint_wrapper, torch.compile):
        model = debug_model(model_registry)
        for key, block in model.layers.items():
            model.layers[key] = wrap(block)
        assert any("_checkpoint_wrapped_module" in n or "_orig_mod" in n for n, _ in
                   model.named_parameters())  # fmt: skip
        assert names_by_algorithm(container(integration, model)) == plain
    assert "lm_head.weight" in plain["adamw"] and "tok_embeddings.weight" in plain["adamw"]
    assert "layers.0.attention.wo.weight" in plain["dobb"]


@pytest.mark.parametrize("name", ["dion", "adamw"])
def test_the_scalar_group_takes_its_own_weight_decay(titan, name):
    """Embeddings, norms and the head decay by ``scalar_weight_decay`` (default 0), never
    by the hidden matrices' ``weight_decay`` (Dion's 0.01, AdamW's given here)."""
    from torchtitan.distributed.utils import set_spmd_backend

    integration, model_registry = titan
    set_spmd_backend("partial_dtensor")
    options = '{"weight_decay": 0.3}'
    for fields, scalar in (({}, 0.0), ({"scalar_weight_decay": 0.05}, 0.05)):
        optimizers = container(
            integration, debug_model(model_registry), name=name, options=options, **fields
        )
        (opt,) = optimizers.optimizers
        assert [g["weight_decay"] for g in opt.param_groups] == [0.3, scalar]
        assert "lm_head.weight" in opt.param_groups[1]["param_names"]


def test_config_selects_any_registry_optimizer_from_the_command_line(titan):
    from torchtitan.config import ConfigManager

    integration, _ = titan
    args = ["--module", "dobb.integrations.torchtitan", "--config", "llama3_debugmodel"]
    config = ConfigManager().parse_args(
        args + ["--optimizer.name", "dion", "--optimizer.options", '{"rank_fraction": 0.5}']
    )
    assert isinstance(config.optimizer, integration.DobbOptimizersContainer.Config)
    assert (config.optimizer.name, config.optimizer.options) == ("dion", '{"rank_fraction": 0.5}')
    assert config.parallelism.spmd_backend == "partial_dtensor"


def test_unsupported_settings_raise_saying_what_to_change(titan):
    from torchtitan.distributed.utils import set_spmd_backend

    integration, model_registry = titan
    model = debug_model(model_registry)
    set_spmd_backend("spmd_types")
    with pytest.raises(NotImplementedError, match="spmd_backend='spmd_types'"):
        container(integration, model)
    set_spmd_backend("partial_dtensor")
    config = integration.DobbOptimizersContainer.Config()
    with pytest.raises(NotImplementedError, match="pipeline parallelism"):
        integration.DobbOptimizersContainer(
            config, model_parts=[model, debug_model(model_registry)]
        )
    with pytest.raises(ValueError, match="JSON object"):
        container(integration, model, options="num_blocks=8")
    with pytest.raises(ValueError, match="implementation"):
        container(integration, model, implementation="fused")
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        container(integration, model, name="sgd")
    from torchtitan.components.optimizer import ParamGroupConfig

    with pytest.raises(ValueError, match="routes parameters itself"):
        container(
            integration,
            model,
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW")],
        )
