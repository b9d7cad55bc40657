"""The training loop on the tiny GPT: every optimizer learns, logs are complete, configs parse."""

import itertools
import json
import math
import shutil
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dobb.registry import OPTIMIZERS
from dobb.train.checkpoint import checkpoint_dir, latest_checkpoint
from dobb.train.config import CONFIG_DIR, ConfigError, TrainConfig, find_config, load_config
from dobb.train.errors import RunError, RunWarning
from dobb.train.parallel import Parallelism
from dobb.train.trainer import (
    build_model,
    distributed_options,
    evaluate,
    load_data,
    lr_schedule,
    train,
)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models; two threads on a shared 2-core box are slower
    yield
    torch.set_num_threads(threads)


def tiny(tmp_path, **overrides) -> TrainConfig:
    settings = dict(
        model="tiny", batch_size=8, steps=12, warmup_steps=2, eval_interval=6, eval_batches=2
    )
    return TrainConfig(**(settings | overrides), out_dir=str(tmp_path), progress=False)


def metrics(cfg):
    with open(f"{cfg.out_dir}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_training_reduces_loss(tmp_path, optimizer):
    cfg = tiny(tmp_path, optimizer=optimizer)
    summary = train(cfg)
    records = metrics(cfg)
    assert [r["step"] for r in records] == list(range(1, cfg.steps + 1))
    assert math.isfinite(summary["final_val_loss"])
    assert summary["final_val_loss"] < records[0]["loss"] - 0.3  # starts near ln 256 = 5.55
    assert records[-1]["loss"] < records[0]["loss"] - 0.3


def test_logs_record_run_metrics_and_summary(tmp_path):
    cfg = tiny(tmp_path, optimizer="adamw", grad_clip=1.0)
    summary = train(cfg)
    records = metrics(cfg)
    assert {"loss", "lr", "tokens_per_s", "step_ms", "opt_ms", "time_s", "grad_norm"} <= set(
        records[0]
    )
    assert [r["step"] for r in records if "val_loss" in r] == [6, 12]
    assert records[-1]["val_loss"] == summary["final_val_loss"]
    assert all(r["opt_ms"] < r["step_ms"] for r in records)
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["corpus"]["name"].startswith("stdlib-py")
    assert len(info["corpus"]["sha256"]) == 64 and info["corpus"]["num_bytes"] > 1e6
    assert info["torch"] == torch.__version__ and info["machine"]["cpu_count"] >= 1
    assert info["config"]["optimizer"] == "adamw"
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    # AdamW keeps exp_avg and exp_avg_sq in fp32 (+ a scalar step per tensor)
    assert summary["state_bytes_per_param"] == pytest.approx(8.0, abs=0.01)
    assert summary["tokens"] == 12 * 8 * 64


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    one = train(tiny(tmp_path / "one", optimizer="adamw", steps=4))
    two = train(tiny(tmp_path / "two", optimizer="adamw", steps=4, grad_accum=2))
    assert two["final_val_loss"] == pytest.approx(one["final_val_loss"], rel=1e-5)
    assert two["final_train_loss"] == pytest.approx(one["final_train_loss"], rel=1e-5)


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(steps=11, warmup_steps=2, min_lr_ratio=0.1, decay="cosine")
    f = lr_schedule(cfg)
    assert [f(0), f(1), f(2)] == [0.5, 1.0, 1.0]
    assert f(10) == pytest.approx(0.1) and f(6) == pytest.approx(0.55)  # cosine midpoint
    linear = lr_schedule(TrainConfig(steps=11, warmup_steps=0, min_lr_ratio=0.0, decay="linear"))
    assert [linear(0), linear(5), linear(10)] == pytest.approx([1.0, 0.5, 0.0])
    assert lr_schedule(TrainConfig(steps=5, decay="constant"))(4) == 1.0


def _schedule_before_lr_multiplier(cfg):
    """``lr_schedule`` as it was written before ``lr_multiplier`` was factored out of it."""

    def multiplier(s):
        if s < cfg.warmup_steps:
            return (s + 1) / cfg.warmup_steps
        if cfg.decay == "constant":
            return 1.0
        progress = min(1.0, (s - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps))
        if cfg.decay == "cosine":
            progress = 0.5 * (1.0 - math.cos(math.pi * progress))
        return 1.0 - (1.0 - cfg.min_lr_ratio) * progress

    return multiplier


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_lr_schedule_is_bit_identical_to_its_form_before_lr_multiplier(decay):
    """``dobb train``'s rates did not move when the schedule was factored into
    ``lr_multiplier`` (shared with the lab's time-budget runs): every step of runs of
    several lengths, warmups and floors, compared with ``==``."""
    runs = [(1, 0), (1, 1), (7, 3), (18, 3), (350, 35), (1000, 0), (1000, 1000), (999, 998)]
    for (steps, warmup), floor in itertools.product(runs, (0.0, 0.1, 0.25)):
        cfg = TrainConfig(steps=steps, warmup_steps=warmup, decay=decay, min_lr_ratio=floor)
        now, before = lr_schedule(cfg), _schedule_before_lr_multiplier(cfg)
        assert [now(s) for s in range(steps + 3)] == [before(s) for s in range(steps + 3)]


def test_each_optimizer_gets_the_data_parallel_group_under_its_own_argument():
    group = object()
    distributed = Parallelism("ddp", None, group, 0, 2)
    assert distributed_options("dobb", distributed) == {"stats_group": group}
    for name in ("muon", "muonbp", "normuon", "dion2"):
        assert distributed_options(name, distributed) == {"replica_group": group}
    for name in ("dion", "adamw"):  # Dion's sync_group needs unaveraged gradients
        assert distributed_options(name, distributed) == {}
    assert distributed_options("dobb", Parallelism("single", None, None)) == {}


# ---- iterate averaging (eval_ema) --------------------------------------------------------


def losses(cfg) -> list[tuple]:
    return [(r["step"], r["loss"], r.get("val_loss"), r.get("val_loss_live")) for r in metrics(cfg)]


def saved_state(cfg, model, step) -> tuple[dict, dict]:
    """The model weights and the EMA weights in the checkpoint of `step`."""
    state = {"model": model.state_dict()}
    state["ema"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    dcp.load(state, checkpoint_id=checkpoint_dir(f"{cfg.out_dir}/checkpoints", step), no_dist=True)
    return {k: v.clone() for k, v in state["model"].items()}, state["ema"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_eval_ema_evaluates_the_bias_corrected_average_of_the_weights(tmp_path):
    decay, steps = 0.6, 4
    cfg = tiny(tmp_path, optimizer="adamw", steps=steps, eval_interval=steps, eval_ema=decay)
    cfg = replace(cfg, checkpoint_interval=1, keep_checkpoints=0)  # the weights of every step
    summary = train(cfg)

    data = load_data(cfg.data, cfg.val_data, cfg.val_fraction, cfg.tokenizer, cfg.data_cache)
    model, par = build_model(cfg, data.vocab_size, torch.device("cpu"))
    weights = [saved_state(cfg, model, t)[0] for t in range(1, steps + 1)]
    # ema_T = sum_t (1 - d) d^(T - t) w_t / (1 - d^T), t = 1..T, in float64
    scale = [(1 - decay) * decay ** (steps - t) / (1 - decay**steps) for t in range(1, steps + 1)]
    expected = {
        name: sum(c * w[name].double() for c, w in zip(scale, weights)).float()
        for name in weights[0]
    }

    def val_loss(state):
        model.load_state_dict(state)
        return evaluate(model, data, cfg, model.cfg.block_size, par, torch.device("cpu"))

    assert summary["final_val_loss_live"] == pytest.approx(val_loss(weights[-1]), rel=1e-6)
    assert summary["final_val_loss"] == pytest.approx(val_loss(expected), rel=1e-5)
    assert abs(summary["final_val_loss"] - summary["final_val_loss_live"]) > 1e-3
    _, saved_ema = saved_state(cfg, model, steps)  # the checkpoint holds the average
    for name, average in saved_ema.items():
        torch.testing.assert_close(average, expected[name], rtol=1e-5, atol=1e-6)
    last = metrics(cfg)[-1]
    assert (last["val_loss"], last["val_loss_live"]) == (
        summary["final_val_loss"],
        summary["final_val_loss_live"],
    )
    assert json.loads((tmp_path / "run.json").read_text())["config"]["eval_ema"] == decay


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_eval_ema_resumed_run_equals_uninterrupted_run(tmp_path):
    cfg = tiny(tmp_path, optimizer="adamw", steps=6, eval_interval=3, eval_ema=0.9)
    cfg = replace(cfg, checkpoint_interval=3, keep_checkpoints=0)
    whole = train(cfg)
    logged = losses(cfg)
    shutil.rmtree(tmp_path / "checkpoints" / "step_000006")  # resume from step 3
    resumed = train(replace(cfg, resume=True))
    assert resumed["final_val_loss"] == whole["final_val_loss"]
    assert resumed["final_val_loss_live"] == whole["final_val_loss_live"]
    assert losses(cfg) == logged
    assert [r["step"] for r in metrics(cfg) if "val_loss_live" in r] == [3, 6]


@pytest.mark.parametrize("value", ["1", "1.5", "-0.1", "nan"])
def test_eval_ema_must_be_a_decay_in_0_1(value):
    with pytest.raises(
        ConfigError, match=r"eval_ema=.* is invalid: must be an EMA decay in \[0, 1\)"
    ):
        load_config(None, [f"eval_ema={value}"])


def test_eval_ema_is_off_by_default():
    assert TrainConfig().eval_ema is None
    assert load_config(None, ["eval_ema=0.99"]).eval_ema == 0.99
    assert load_config(None, ["eval_ema=0"]).eval_ema == 0.0
    assert load_config(None, ["eval_ema=0.99", "eval_ema=none"]).eval_ema is None


def test_fresh_run_refuses_a_directory_with_checkpoints(tmp_path):
    train(tiny(tmp_path, optimizer="adamw", steps=2, checkpoint_interval=2))
    assert latest_checkpoint(tmp_path / "checkpoints") is not None
    with pytest.raises(RunError, match="resume=true"):
        train(tiny(tmp_path, optimizer="adamw", steps=2, checkpoint_interval=2))


def test_a_run_is_never_overwritten(tmp_path):
    train(tiny(tmp_path, optimizer="adamw", steps=2))  # no checkpoints: only the logs
    logs = {name: (tmp_path / name).read_bytes() for name in ("run.json", "metrics.jsonl")}
    with pytest.raises(RunError, match="already holds a run .*run.json, metrics.jsonl"):
        train(tiny(tmp_path, optimizer="adamw", steps=3))
    assert {name: (tmp_path / name).read_bytes() for name in logs} == logs
    # resume=true with nothing to resume from starts over, and says so
    with pytest.warns(RunWarning, match="no checkpoint to resume; starting over"):
        train(tiny(tmp_path, optimizer="adamw", steps=3, resume=True))
    assert [r["step"] for r in metrics(tiny(tmp_path))] == [1, 2, 3]


# ---- config ---------------------------------------------------------------------------


def test_yaml_then_overrides_typed_by_field(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: tiny\nlr: 1e-3\nsteps: 50\noptimizer_options: {num_blocks: 8}\n"
        "model_overrides:\n  dropout: 0.1\n"
    )
    cfg = load_config(
        path,
        [
            "steps=20",
            "grad_clip=1",
            "resume=true",
            "optimizer_options.basis_interval=5",
            "scalar_lr=none",
            "val_data=null",
        ],
    )
    assert cfg.model == "tiny" and cfg.lr == 1e-3 and isinstance(cfg.lr, float)
    assert cfg.steps == 20 and cfg.grad_clip == 1.0 and cfg.resume is True
    assert cfg.optimizer_options == {"num_blocks": 8, "basis_interval": 5}
    assert cfg.model_overrides == {"dropout": 0.1}
    assert cfg.scalar_lr is None and cfg.val_data is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("stepz=3", "unknown config key 'stepz'"),
        ("steps=ten", "bad value 'ten' for steps"),
        ("steps=2.5", "bad value '2.5' for steps"),
        ("resume=maybe", "bad value 'maybe' for resume"),
        ("lr=fast", "bad value 'fast' for lr"),
        ("optimizer_options=[1, 2]", "bad value .* for optimizer_options"),
        ("steps", "not of the form key=value"),
        ("lr.x=1", "lr.x: only dict fields take dotted keys"),
        ("layout=ring", "layout='ring' is invalid"),
        ("warmup_steps=5000", "warmup_steps=5000 is invalid"),
        ("grad_accum=3", "batch_size=16 is not divisible by grad_accum=3"),
        ("weight_decay=-0.1", "weight_decay=-0.1 is invalid"),
        ("scalar_weight_decay=inf", "scalar_weight_decay=inf is invalid"),
        ("optimizer_options.weight_decay=0.1", "weight decay is a top-level setting"),
    ],
)
def test_bad_config_names_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_bad_yaml_key_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: tiny\nbatchsize: 4\n")
    with pytest.raises(ConfigError, match="unknown config key 'batchsize'"):
        load_config(path)


def test_shipped_configs_load(pytestconfig):
    paths = sorted((pytestconfig.rootpath / "configs").glob("*.yaml"))
    assert paths and [p.name for p in paths] == sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))
    for path in paths:
        load_config(path)


def test_shipped_configs_are_found_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("configs/tiny.yaml", "tiny.yaml", "tiny"):
        assert find_config(name) == CONFIG_DIR / "tiny.yaml"
    (tmp_path / "tiny.yaml").write_text("model: tiny\nsteps: 3\n")
    assert load_config("tiny.yaml").steps == 3  # a file here comes first
    with pytest.raises(ConfigError, match="no config file 'nope.yaml'.*mini, tiny"):
        find_config("nope.yaml")


def test_malformed_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: tiny\nsteps: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml: invalid YAML at line 3"):
        load_config(path)
