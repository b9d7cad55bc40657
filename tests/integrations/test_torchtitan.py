"""torchtitan 0.3.0 with dobb's optimizers, run for real on 2 and 4 gloo ranks on CPU.

Marked ``torchtitan``: deselected by ``make test`` (pyproject's ``addopts``), run by
``make test-torchtitan`` after ``pip install -e ".[torchtitan]"``. Two ``torchrun`` calls
(``torchtitan_rank.py``: one process per rank runs the jobs of a list in turn) run the debug
llama3, each job for 4 steps saving DCP checkpoints at steps 2 and 4:

- 2 ranks (``JOBS``): Dobb, Muon and Dion under FSDP and under TP, and Dobb with two
  pipeline stages on each rank (pipeline degree 2, torchtitan's ``Interleaved1F1B``: 4
  stages, 2 model parts a rank); each job again resumed from its step-2 checkpoint, and
  the two step-4 checkpoints of every pair must be bit-identical. Dobb and Muon under FSDP
  run once more with torchtitan's compile switch on (``COMPILE``: each transformer block
  compiled with ``fullgraph=True``, where a graph break is an error, and the loss): their
  losses and step-4 checkpoints must equal the eager run's bit for bit, with no graph break.
  Muon on qwen3's MoE cut down (``MOE_JOBS``) under FSDP and under expert parallelism 2,
  resumed likewise; the two saved after step 1 too, whose states must agree within the
  rounding of torchtitan's bf16 expert products.
- 4 ranks (``JOBS_4``): Dobb under HSDP (2 replicas of 2 FSDP shards) and FSDP x TP (2 x 2),
  each resumed likewise; Muon on the MoE under EP 2 x FSDP 2, resumed likewise; and Dobb
  under pipeline x FSDP (2 x 2) resumed from the 2-rank FSDP job's step-2 checkpoint
  (``PIPELINE_FROM_FSDP``): the same data and weights, so its steps 3 and 4 must continue
  the FSDP job as a different reduction order allows, on any CPU (``titan_continuation``:
  Dobb's weights by their signs, the rest within rounding).

The CPU shim is ``torchtitan_cpu.py``, the assets (tokenizer, 400 documents) are written
by ``titan_assets.py``.
"""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from titan_checkpoints import flatten, load_checkpoint, same
from titan_continuation import assert_loss_agrees, assert_step_agrees
from torch import nn

from dobb.registry import get_entry

RUN_TIMEOUT = 1800  # seconds for each torchrun: a guard against a hung gloo rank, not a speed limit
# the module's first test sets up both torchruns (pytest-timeout's 300 s would cut it short on a
# loaded machine): the same kind of guard
pytestmark = [pytest.mark.torchtitan, pytest.mark.timeout(2 * RUN_TIMEOUT + 300)]

HERE = Path(__file__).parent
STEPS, SAVE_EVERY = 4, 2
PIPELINE = ["--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs"]
# expert parallelism, which torchtitan, like pipelines, takes only with CUDA graphs off
EXPERT_PARALLEL = ["--parallelism.expert_parallel_degree", "2", "--training.disable_cuda_graphs"]
# the parallelism flags of each layout; the FSDP degree is torchtitan's default, -1: the
# ranks left over (on 2 ranks "tp" is TP alone, on 4 "fsdp_tp" is 2 FSDP x 2 TP)
LAYOUTS = {
    "fsdp": [],
    "tp": ["--parallelism.tensor_parallel_degree", "2"],
    "pp": PIPELINE,
    "hsdp": ["--parallelism.data_parallel_replicate_degree", "2"],
    "fsdp_tp": ["--parallelism.tensor_parallel_degree", "2"],
    "pp_fsdp": PIPELINE,
    # on titan_configs.qwen3_moe_cpu: FSDP over 2 ranks; EP 2 on 2 ranks (the experts split
    # over "ep", the rest FSDP over both ranks); EP 2 x FSDP 2 on 4 ranks (each EP group's
    # experts sharded again over "efsdp", the rest FSDP over all 4)
    "fsdp_moe": [],
    "ep_moe": EXPERT_PARALLEL,
    "ep_fsdp_moe": EXPERT_PARALLEL,
}
# the config of each layout's jobs (titan_configs), where not llama3_cpu
CONFIGS = {layout: "qwen3_moe_cpu" for layout in ("fsdp_moe", "ep_moe", "ep_fsdp_moe")}
# (optimizer, layout, state every hidden matrix of that optimizer holds), run with their
# resumed twins: on 2 ranks, and on 4
# ("dobb": the recommended configuration, the library's default; "dobb_paper": the paper's,
# one-sided with the sign, whose steps titan_continuation's bounds hold across layouts, and
# which FSDP x TP's strided rows need)
JOBS = [
    ("dobb", "fsdp", "input_basis_0"),
    ("dobb_paper", "fsdp", "input_basis_0"),
    ("muon", "fsdp", "momentum"),
    ("dion", "fsdp", "Q"),
    ("dobb_paper", "tp", "input_basis_0"),
    ("muon", "tp", "momentum"),
    ("dion", "tp", "Q"),
    ("dobb_paper", "pp", "input_basis_0"),
]
JOBS_4 = [("dobb_paper", "hsdp", "input_basis_0"), ("dobb_paper", "fsdp_tp", "input_basis_0")]
# (optimizer, layout) run on the mixture of experts, with their resumed twins
MOE_JOBS = [("muon", "fsdp_moe"), ("muon", "ep_moe"), ("muon", "ep_fsdp_moe")]
# Dobb (the recommended preset, "dobb"; the paper's under EP) on the MoE: each expert's
# statistics from its routed tokens, folded where its grouped GEMM ran
MOE_JOBS += [("dobb", "fsdp_moe"), ("dobb", "ep_moe"), ("dobb_paper", "ep_moe")]
MOE_JOBS += [("dobb", "ep_fsdp_moe")]
RANKS = {**{layout: 2 for _, layout, _ in JOBS}, **{layout: 4 for _, layout, _ in JOBS_4}}
RANKS.update(pp_fsdp=4, fsdp_moe=2, ep_moe=2, ep_fsdp_moe=4)
# jobs run again with torchtitan's compile switch on, as (optimizer, layout)
COMPILED = [("dobb", "fsdp"), ("muon", "fsdp")]
# the model's blocks and the loss; aot_eager: Dynamo and AOTAutograd as with inductor, the
# graphs run by torch's eager kernels (inductor's C++ builds would take minutes on 2 cores)
COMPILE = ["--compile.enable", "--compile.components", "model,loss"]
COMPILE += ["--compile.backend", "aot_eager"]
# (optimizer, layout, layout whose step-2 checkpoint it loads); the folder is
# "{optimizer}_{layout}_from_{source}"
PIPELINE_FROM_FSDP = ("dobb_paper", "pp_fsdp", "fsdp")
# (optimizer, layout) of the jobs that save a checkpoint after every step (the others every
# SAVE_EVERY): the pipeline test compares each step of the two
EVERY_STEP = [("dobb_paper", "fsdp"), ("dobb_paper", "pp_fsdp")]
# (optimizer, layout) of the jobs that also save after step 1 (the others' first is step 2):
# the expert-parallel test compares the first step of the two
FIRST_STEP = [("muon", "fsdp_moe"), ("muon", "ep_moe")]
TOKENS = 2 * 2 * 64  # a step's global batch: 2 FSDP ranks x 2 sequences x 64 tokens
MAX_NORM = 1.0  # torchtitan's training.max_norm (its default): gradients clipped to it
# what the stage costs, counted: optimizer steps times ranks over every job, which the
# plan below must not exceed (each 2-rank job of 4 steps is 8, a resumed one 4; each
# 4-rank one 16 and 8; the plan is 276)
RANK_STEP_BUDGET = 276


def job_args(out: Path, name: str, layout: str, resume: bool = False, **kw) -> list:
    """torchtitan's command line of one job; its dump folder is ``out/{name}_{layout}``
    with ``_resumed`` (from its own step-2 checkpoint), ``_compiled`` (``compiled=True``)
    or ``_from_{source}`` (from the step-2 checkpoint of layout ``source``) appended."""
    compiled, source = kw.pop("compiled", False), kw.pop("source", None)
    assert not kw, kw
    suffix = "_resumed" if resume else "_compiled" if compiled else ""
    suffix = f"_from_{source}" if source else suffix
    folder = out / f"{name}_{layout}"
    config = CONFIGS.get(layout, "llama3_cpu")
    args = ["--module", "titan_configs", "--config", config, "--optimizer.name", name]
    args += [*LAYOUTS[layout], *(COMPILE if compiled else []), "--debug.seed", "0"]
    args += ["--training.steps", str(STEPS), "--comm.init_timeout_seconds", "120"]
    interval = 1 if (name, layout) in EVERY_STEP else SAVE_EVERY
    args += ["--checkpoint.enable", "--checkpoint.interval", str(interval)]
    if (name, layout) in FIRST_STEP and not (resume or compiled or source):
        args += ["--checkpoint.enable_first_step_checkpoint"]
    args += ["--dump_folder", str(folder.with_name(folder.name + suffix))]
    if resume or source:
        loaded = out / f"{name}_{source}" if source else folder
        args += [
            "--checkpoint.initial_load_path",
            str(loaded / "checkpoint" / f"step-{SAVE_EVERY}"),
            "--checkpoint.no-initial_load_model_only",
        ]
    return args


def plan(out: Path) -> dict[int, list[list]]:
    """Every job's command line, by the number of ranks of its torchrun."""
    jobs = [(n, lay) for n, lay, _ in JOBS + JOBS_4] + MOE_JOBS
    twins = [(n, lay, r) for n, lay in jobs for r in (False, True)]
    jobs = {2: [], 4: []}
    for name, layout, resume in twins:
        jobs[RANKS[layout]].append(job_args(out, name, layout, resume))
    for name, layout in COMPILED:
        jobs[2].append(job_args(out, name, layout, compiled=True))
    name, layout, source = PIPELINE_FROM_FSDP
    jobs[4].append(job_args(out, name, layout, source=source))
    return jobs


def torchrun(root: Path, ranks: int, jobs: list[list], assets: Path) -> None:
    """Run ``jobs`` in one ``torchrun`` of ``ranks`` gloo ranks; its log is
    ``root/torchrun-{ranks}.log``."""
    jobs_file = root / f"jobs-{ranks}.json"
    jobs_file.write_text(json.dumps(jobs))
    env = {
        **os.environ,
        "TITAN_ASSETS": str(assets),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(root / "hf"),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(ranks), str(HERE / "torchtitan_rank.py"), str(jobs_file)]
    result = subprocess.run(
        command, cwd=root, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    log = root / f"torchrun-{ranks}.log"
    log.write_text(result.stdout + result.stderr)
    assert result.returncode == 0, (
        f"torchrun of {ranks} ranks failed (rc {result.returncode}); log {log}:\n"
        + (result.stdout + result.stderr)[-6000:]
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run every job: the 2-rank ones, then the 4-rank ones (one loads a 2-rank job's
    checkpoint); returns the folder holding their dump folders."""
    from titan_assets import make_assets

    root = tmp_path_factory.mktemp("torchtitan")
    assets = make_assets(root / "assets")
    for ranks, jobs in plan(root / "runs").items():
        torchrun(root, ranks, jobs, assets)
    return root / "runs"


def ids(jobs) -> list[str]:
    return ["-".join(job[:2]) for job in jobs]


def step_checkpoint(folder: Path, step: int = STEPS) -> dict:
    """The job's checkpoint at ``step``, flat: ``{"optimizer.state.<fqn>.<key>": ...}``."""
    return dict(flatten(load_checkpoint(folder / "checkpoint" / f"step-{step}")))


@pytest.mark.parametrize("name, layout, state_key", JOBS + JOBS_4, ids=ids(JOBS + JOBS_4))
def test_resume_gives_a_bit_identical_checkpoint(runs, name, layout, state_key):
    a = step_checkpoint(runs / f"{name}_{layout}")
    b = step_checkpoint(runs / f"{name}_{layout}_resumed")
    assert a["train_state.step"] == b["train_state.step"] == STEPS
    assert a.keys() == b.keys()
    differ = [key for key in a if not same(a[key], b[key])]
    assert not differ, f"{len(differ)} entries differ after a resume, e.g. {differ[:5]}"
    # the registry's optimizer ran: its state, on the hidden matrices of every pipeline
    # stage (layers 0 and 5 are on different ranks under "pp"), moved the weights
    first = step_checkpoint(runs / f"{name}_{layout}", SAVE_EVERY)
    for weight in ("layers.0.attention.wo.weight", "layers.5.feed_forward.w2.weight"):
        assert f"optimizer.state.{weight}.{state_key}" in a
        assert not torch.equal(first[weight], a[weight])


@pytest.mark.parametrize("name, layout", MOE_JOBS, ids=ids(MOE_JOBS))
def test_routed_experts_are_stepped_as_matrices_and_resume_bit_identical(runs, name, layout):
    """torchtitan's MoE (qwen3, ``titan_configs.EXPERTS`` routed experts a block), each rank
    holding whole experts: under FSDP over 2 ranks (``Shard(0)``), expert parallelism on 2
    (``ep`` splits them, ``(_StridedShard(0), Shard(0))`` on ``(efsdp, ep)``) and EP 2 x
    FSDP 2 on 4 (2 experts a rank). Each expert stack goes to the matrix optimizer, its
    state one ``(E, d_out, d_in)`` tensor per key (``dobb.optim.experts``), and a resumed
    run's step-4 checkpoint equals the uninterrupted one bit for bit."""
    a = step_checkpoint(runs / f"{name}_{layout}")
    b = step_checkpoint(runs / f"{name}_{layout}_resumed")
    assert a.keys() == b.keys()
    differ = [key for key in a if not same(a[key], b[key])]
    assert not differ, f"{len(differ)} entries differ after a resume, e.g. {differ[:5]}"
    first = step_checkpoint(runs / f"{name}_{layout}", SAVE_EVERY)
    for block in (0, 1):
        for weight in ("w1_EFD", "w2_EDF", "w3_EFD"):
            fqn = f"layers.{block}.moe.routed_experts.inner_experts.{weight}"
            assert a[f"optimizer.state.{fqn}.momentum"].shape == a[fqn].shape, fqn
            assert a[fqn].ndim == 3 and f"optimizer.state.{fqn}.exp_avg" not in a
            assert not torch.equal(first[fqn], a[fqn])
            if name.startswith("dobb"):  # every expert's own statistics, token counts
                experts = a[fqn].shape[0]
                tokens = a[f"optimizer.state.{fqn}.expert_tokens"]
                cov = a[f"optimizer.state.{fqn}.input_cov_0"]
                assert tokens.shape == (experts,) and bool((tokens > 0).all()), tokens
                assert cov.shape[0] == experts and not torch.equal(cov[0], cov[1])


def test_expert_parallel_first_step_is_fsdps(runs):
    """EP 2 and FSDP 2 on the same 2 data ranks see the same tokens and start from the
    same weights: only where each expert's tokens are multiplied differs (EP's all-to-all
    brings both ranks' tokens to the expert's rank). After step 1:

    - the losses (the forward before any update) agree within rtol 1e-5 (measured equal);
    - each optimizer state, per expert for the stacks, agrees within 2^-7 of its norm
      (Frobenius): Muon's momentum after one step is ``(1 - beta)`` times the clipped
      gradient, and torchtitan multiplies the experts in bf16 (``GroupedExperts``), so each
      layout rounds an expert's gradient its own way (EP: one product over both ranks'
      tokens; FSDP: one per rank, summed in fp32), about ``u / sqrt(3)`` of its norm with
      ``u = 2^-8`` (measured 2026-12-05: at most 2.4e-3 per expert; every entry but the
      experts' was bit-identical);
    - the experts' weights are not compared: Muon's Newton-Schulz (bf16, the default)
      lifts the gradients' smallest singular directions, where that rounding is of the
      size of the signal, to unit size (measured: step-1 expert weights 0.7% to 9.1% of a
      full-lr Muon step apart; the step-2 losses 1e-6 relative).

    A gradient or a state on the wrong expert, an expert left out of its rank's step or
    of the all-to-all, moves a state by far more than 2^-7."""
    fsdp, ep = runs / "muon_fsdp_moe", runs / "muon_ep_moe"
    losses = [job_losses(job)["1"] for job in (fsdp, ep)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=0)
    a, b = step_checkpoint(fsdp, 1), step_checkpoint(ep, 1)
    assert a.keys() == b.keys()
    states = [key for key in a if key.startswith("optimizer.state.") and a[key].ndim >= 1]
    assert any(".inner_experts.w2_EDF.momentum" in key for key in states)
    for key in states:
        x, y = a[key].double(), b[key].double()
        pieces = zip(x, y) if ".inner_experts." in key else [(x, y)]
        for e, (xe, ye) in enumerate(pieces):
            scale = max(xe.norm().item(), ye.norm().item())
            assert (xe - ye).norm().item() <= 2**-7 * scale, (key, e)


def records(folder: Path) -> list[dict]:
    """The ``record-rank*.json`` of every rank of a job (``torchtitan_rank.py``)."""
    return [json.loads(f.read_text()) for f in sorted(folder.glob("record-rank*.json"))]


def job_losses(folder: Path) -> dict[str, float]:
    """The job's losses by step, as the ranks holding the loss logged them (under
    pipeline parallelism, the last stage's; torchtitan logs -1 or -2 on the others)."""
    logged = [r["losses"] for r in records(folder) if min(r["losses"].values()) > 0]
    assert logged and all(losses == logged[0] for losses in logged[1:]), folder
    return logged[0]


@pytest.mark.parametrize("name, layout", COMPILED, ids=ids(COMPILED))
def test_compiled_blocks_train_as_eager_without_graph_breaks(runs, name, layout):
    eager, compiled = runs / f"{name}_{layout}", runs / f"{name}_{layout}_compiled"
    eager_losses = job_losses(eager)
    assert len(eager_losses) == STEPS
    for record in records(compiled):
        assert record["graph_breaks"] == {}, f"graph breaks in {compiled.name}"
        # one graph for all the blocks (identical blocks share it), one for the loss; more
        # would mean a recompile per block, which fullgraph turns into an error past the limit
        assert record["frames_compiled"] == 2, record
        assert record["losses"] == eager_losses
    # Dobb's statistics were gathered inside the compiled blocks (dobb::observe): every
    # basis, statistic count and weight equals the eager run's
    a, b = step_checkpoint(eager), step_checkpoint(compiled)
    assert a.keys() == b.keys()
    differ = [key for key in a if not same(a[key], b[key])]
    assert not differ, f"{len(differ)} entries differ from eager, e.g. {differ[:5]}"


def test_pipeline_stages_are_model_parts_each_with_its_own_optimizer(runs):
    """Interleaved1F1B on 2 ranks: stages 0 and 2 on rank 0, 1 and 3 on rank 1, so each
    rank's container holds two model parts and one Dobb optimizer for each."""
    for record in records(runs / "dobb_paper_pp"):
        assert record["model_parts"] == record["optimizers"] == 2, record


def test_pipeline_stages_resumed_from_fsdp_train_as_fsdp(runs):
    """PP 2 x FSDP 2 on 4 ranks, from the 2-rank FSDP job's step-2 checkpoint (the same
    FQN-keyed entries, cut into stages on load), trains steps 3 and 4 as that job did: same
    data (2 FSDP ranks, 2 sequences each, as 2 microbatches of 1), same weights. Only the
    order of reductions differs, so each step is held to what that guarantees on any CPU
    (``titan_continuation``: counters, schedule and bases equal; Dobb's weights by their
    signs, at most 1e-3 of a matrix's differing; momenta, statistics and Adam's group
    within the rounding of a sum over the batch; the losses as the weights' difference
    predicts), not to a tolerance tuned on one machine: Dobb's sign coefficients turn
    rounding in a near-zero coefficient into a whole step (measured 2026-12-02: 15 of
    65,536 weights in two matrices), to which the next step's state responds. The step-2
    state the pipeline job started from is the FSDP job's checkpoint it loaded. Dobb's
    statistics of the stage's metadata inference (a forward on uninitialized inputs) would
    show here: the first stage's counted twice, the other's garbage or NaN."""
    name, layout, source = PIPELINE_FROM_FSDP
    fsdp, piped = runs / f"{name}_{source}", runs / f"{name}_{layout}_from_{source}"
    assert sorted(job_losses(piped)) == ["3", "4"]
    logged = [{**records(job)[0], "losses": job_losses(job)} for job in (fsdp, piped)]
    for step in range(SAVE_EVERY + 1, STEPS + 1):
        # the piped job's step 3 starts from the FSDP job's step-2 checkpoint, which it loaded
        start = fsdp if step == SAVE_EVERY + 1 else piped
        before = step_checkpoint(fsdp, step - 1), step_checkpoint(start, step - 1)
        after = step_checkpoint(fsdp, step), step_checkpoint(piped, step)
        since = step - SAVE_EVERY
        # the data position counts microbatches, not steps, under PP
        assert_step_agrees(before, after, steps=since, tokens=TOKENS, skip=["dataloader."])
        assert_loss_agrees(step, logged, before, after, tokens=TOKENS, max_norm=MAX_NORM)


@pytest.mark.parametrize("job", ["dobb_fsdp_resumed", "dobb_paper_pp_resumed"])
def test_dobb_counted_steps_and_statistics_once_per_step(runs, job):
    # 4 optimizer steps, each with statistics: the counters say 4, not 5 (the resume's DCP
    # state-initialising step, before the checkpoint is loaded into it, counts nothing)
    state = step_checkpoint(runs / job)
    for layer in ("layers.0.feed_forward.w1.weight", "layers.5.attention.wo.weight"):
        assert float(state[f"optimizer.state.{layer}.step"]) == STEPS
        assert float(state[f"optimizer.state.{layer}.stats_steps"]) == STEPS


def test_every_job_ran_its_planned_steps_within_the_stage_budget(runs):
    """Counted, not timed: each job logged steps 1-4, or 3-4 if it started from a step-2
    checkpoint; the stage's work, optimizer steps times ranks over all jobs, stays within
    ``RANK_STEP_BUDGET``."""
    work = 0
    for ranks, jobs in plan(runs).items():
        for args in jobs:
            folder = Path(args[args.index("--dump_folder") + 1])
            first = SAVE_EVERY + 1 if "--checkpoint.initial_load_path" in args else 1
            steps = range(first, STEPS + 1)
            assert sorted(map(int, job_losses(folder))) == list(steps), folder.name
            assert len(records(folder)) == ranks, folder.name
            work += len(steps) * ranks
    assert work <= RANK_STEP_BUDGET, f"{work} rank-steps; the stage's budget is {RANK_STEP_BUDGET}"


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
        wrapped = ("_checkpoint_wrapped_module", "_orig_mod")
        assert any(w in n for n, _ in model.named_parameters() for w in wrapped)
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


@pytest.mark.parametrize("name", ["muon", "dion", "dobb"])
def test_routed_experts_go_to_the_matrix_optimizer(titan, name):
    """torchtitan's ``GroupedExperts`` stacks (named ``w1_EFD``, ``w2_EDF``, ``w3_EFD``) go
    to the matrix group; Dobb hooks their grouped GEMMs."""
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.moe import GroupedExperts

    integration, _ = titan
    set_spmd_backend("partial_dtensor")
    model = nn.Module()
    model.attention = nn.Linear(16, 16, bias=False)
    config = GroupedExperts.Config(dim=16, hidden_dim=8, num_experts=4)
    model.experts = config.build()
    optimizers = container(integration, model, name=name)
    groups = names_by_algorithm(optimizers)
    stacks = ["experts.w1_EFD", "experts.w2_EDF", "experts.w3_EFD"]
    algorithm = get_entry(name).cls.algorithm
    assert set(stacks) <= set(groups[algorithm])
    assert "attention.weight" in groups[algorithm]
    if name == "dobb":
        (opt,) = optimizers.optimizers
        tracked = [stack for stack, _ in opt.statistics.expert_statistics()]
        assert {id(s) for s in tracked} == {id(getattr(model.experts, n[8:])) for n in stacks}


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


@pytest.fixture
def fake_world():
    """A fake process group of 2 ranks in this process (this is rank 0; collectives do
    nothing): its world mesh, and torchtitan's two meshes under expert parallelism 2, the
    dense ``("fsdp",)`` and the experts' ``("efsdp", "ep")``, 1 x 2, cut from it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        world = init_device_mesh("cpu", (2,), mesh_dim_names=("world",))
        dense, experts = (
            world._unflatten(0, (2,), ("fsdp",)),
            world._unflatten(0, (1, 2), ("efsdp", "ep")),
        )
        yield world, dense, experts
    finally:
        dist.destroy_process_group()


def expert_parallel_model(dense_mesh, expert_mesh, *, router_on_experts_mesh=False):
    """A dense ``nn.Linear`` FSDP-sharded on ``dense_mesh`` and a ``GroupedExperts`` of 4
    experts split over ``expert_mesh`` as torchtitan splits them (rank 0's part: this
    process); with ``router_on_experts_mesh`` the dense weight lies on ``expert_mesh``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    from torchtitan.models.common.moe import GroupedExperts

    torch.manual_seed(0)
    model = nn.Module()
    model.attention = nn.Linear(16, 16, bias=False)
    model.experts = GroupedExperts.Config(dim=16, hidden_dim=8, num_experts=4).build()
    strided = [_StridedShard(0, split_factor=2), Shard(0)]
    if router_on_experts_mesh:
        dense_mesh, dense = expert_mesh, [Replicate(), Shard(0)]
    else:
        dense = [Shard(0)]
    for module, name, placements, mesh in [
        (model.attention, "weight", dense, dense_mesh),
        *[(model.experts, w, strided, expert_mesh) for w in ("w1_EFD", "w2_EDF", "w3_EFD")],
    ]:
        full = torch.randn(getattr(module, name).shape)
        mine = full.chunk(2)[0]  # rank 0's half of the first dim, either way
        shape, stride = full.shape, full.stride()
        param = DTensor.from_local(mine, mesh, placements, shape=shape, stride=stride)
        setattr(module, name, nn.Parameter(param))
    return model


def test_expert_parallel_routes_the_stacks_to_the_matrix_optimizer(titan, fake_world):
    """torchtitan's two meshes under EP: the stacks (on ``("efsdp", "ep")``) go to the
    matrix optimizer (Dion's and Dobb's here; AdamW takes everything), which steps them
    where they are, and the dense weight's data axes stay the group (``data_mesh``:
    ``fsdp``, the Muon family's ``replica_group``, Dobb's ``stats_group``); Dobb hooks
    the stacks' grouped GEMMs. A dense weight on the experts' mesh and an expert axis that
    would split each expert (``etp``) are refused saying why, before any collective (the
    fake group's do nothing)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torchtitan.distributed.utils import set_spmd_backend

    integration, _ = titan
    set_spmd_backend("partial_dtensor")
    world, *meshes = fake_world
    stacks = ["experts.w1_EFD", "experts.w2_EDF", "experts.w3_EFD"]
    # built here where construction needs no collective (the fake group's are no-ops);
    # Muon's plans its owner exchange with one (the 2-rank jobs build it)
    groups = names_by_algorithm(container(integration, expert_parallel_model(*meshes), name="dion"))
    assert groups["dion"] == ["attention.weight", *stacks]
    (adamw,) = container(integration, expert_parallel_model(*meshes), name="adamw").optimizers
    assert sorted(n for g in adamw.param_groups for n in g["param_names"]) == groups["dion"]
    model = expert_parallel_model(*meshes)
    named = [(n, p) for n, p in model.named_parameters()]
    assert [n for n, p in named if integration.on_expert_mesh(n, p)] == stacks
    assert integration.data_mesh(integration.part_mesh(model)).mesh_dim_names == ("fsdp",)
    for name in ("dobb", "dobb_paper"):
        model = expert_parallel_model(*meshes)
        built = container(integration, model, name=name)
        assert names_by_algorithm(built)["dobb"] == groups["dion"]
        (opt,) = built.optimizers
        tracked = {id(stack) for stack, _ in opt.statistics.expert_statistics()}
        assert tracked == {id(getattr(model.experts, w)) for w in ("w1_EFD", "w2_EDF", "w3_EFD")}
    model = expert_parallel_model(*meshes, router_on_experts_mesh=True)
    with pytest.raises(NotImplementedError, match="attention.weight lies on the experts' mesh"):
        container(integration, model, name="muon")
    etp = world._unflatten(0, (2, 1), ("ep", "etp"))
    model = expert_parallel_model(*meshes)
    w1 = model.experts.w1_EFD
    model.experts.w1_EFD = nn.Parameter(
        DTensor.from_local(
            w1.to_local(), etp, [Shard(0), Replicate()], shape=w1.shape, stride=w1.stride()
        )
    )
    with pytest.raises(NotImplementedError, match="axis 'etp'.*expert tensor parallelism"):
        container(integration, model, name="muon")


def pipeline_stages(model_registry) -> list[nn.Module]:
    """The debug model cut into two stages as torchtitan cuts it: layers 0-2 with the
    embedding, layers 3-5 with the norm and head (each part keeps the whole model's FQNs)."""
    first, last = debug_model(model_registry), debug_model(model_registry)
    for key in ("3", "4", "5"):
        del first.layers[key]
    for key in ("0", "1", "2"):
        del last.layers[key]
    first.norm = first.lm_head = last.tok_embeddings = None
    return [first, last]


def test_model_parts_get_one_optimizer_each_and_one_flat_state(titan):
    """Two parts (pipeline stages) in one process: each part's optimizer routes and tracks
    that part only, and the container's state is one dict keyed by the parts' FQNs, which a
    new container of the same parts loads back entry for entry."""
    from torchtitan.distributed.utils import set_spmd_backend

    integration, model_registry = titan
    set_spmd_backend("partial_dtensor")
    # a step on random gradients, the statistics taken as the identity (no forward here)
    config = integration.DobbOptimizersContainer.Config(options='{"missing_stats": "identity"}')
    parts = pipeline_stages(model_registry)
    optimizers = integration.DobbOptimizersContainer(config, model_parts=parts)
    assert len(optimizers.optimizers) == 2
    for part, opt in zip(parts, optimizers.optimizers):
        assert {n for g in opt.param_groups for n in g["param_names"]} == {
            n for n, _ in part.named_parameters()
        }
        linears = [m for m in part.layers.modules() if isinstance(m, nn.Linear)]
        assert {id(w) for w in opt.statistics._stats} == {id(m.weight) for m in linears}
    torch.manual_seed(1)
    for p in (p for part in parts for p in part.parameters()):
        p.grad = torch.randn_like(p)
    optimizers.step()
    optimizers.zero_grad()  # else DCP's state initialisation of the new one would not run
    saved = optimizers.state_dict()
    for key in ("state.layers.0.attention.wo.weight.momentum", "param_groups.norm.weight.lr"):
        assert key in saved
    assert "state.layers.5.attention.wo.weight.input_basis_0" in saved
    fresh = integration.DobbOptimizersContainer(config, model_parts=parts)
    fresh.load_state_dict(saved)
    loaded = fresh.state_dict()
    assert loaded.keys() == saved.keys()
    assert all(same(loaded[k], saved[k]) for k in saved)


def test_stage_metadata_inference_adds_no_statistics(titan, monkeypatch):
    """The forward torch's ``PipelineStage`` runs to learn a stage's shapes adds nothing to
    Dobb's statistics; the same forward in training does, and the layers are left in
    training mode, also after a forward that raised. torch's method is the same function
    after the container is built. A stand-in for ``_forward_metadata_inference`` calls the
    stage's module, whose forward runs its feed-forward layers (the debug model's attention
    needs masks made by the trainer)."""
    from torch.distributed.pipelining.stage import PipelineStage
    from torchtitan.distributed.utils import set_spmd_backend

    integration, model_registry = titan
    set_spmd_backend("partial_dtensor")
    torchs = PipelineStage._forward_metadata_inference
    parts = pipeline_stages(model_registry)
    config = integration.DobbOptimizersContainer.Config()
    optimizers = integration.DobbOptimizersContainer(config, model_parts=parts)
    assert PipelineStage._forward_metadata_inference is torchs  # torch left as it was

    def feed_forwards(x):
        if x is None:
            raise RuntimeError("a forward that fails")
        return [block.feed_forward(x) for block in parts[0].layers.values()]

    def shape_inference(stage, x):
        return stage.submod(x)

    monkeypatch.setattr(parts[0], "forward", feed_forwards)
    monkeypatch.setattr(PipelineStage, "_forward_metadata_inference", shape_inference)
    tracked = optimizers.optimizers[0].statistics._stats
    stats = [tracked[b.feed_forward.w1.weight]["input"] for b in parts[0].layers.values()]
    stage, x = types.SimpleNamespace(submod=parts[0]), torch.randn(1, 16, 256)
    PipelineStage._forward_metadata_inference(stage, x)
    assert not any(s.seen for s in stats)
    assert all(m.training for m in parts[0].modules())
    with pytest.raises(RuntimeError, match="a forward that fails"):
        PipelineStage._forward_metadata_inference(stage, None)
    assert all(m.training for m in parts[0].modules())
    parts[0](x)  # the training forward
    assert all(s.seen for s in stats)
