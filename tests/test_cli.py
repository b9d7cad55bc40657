"""The `dobb` command: a failure the user can fix is one line and exit status 2; --debug and
DOBB_DEBUG show its traceback; a bug keeps its traceback; shipped configs work anywhere."""

import errno
import importlib
import importlib.util
import re
import sys

import numpy as np
import pytest
import torch

from dobb.cli import main
from dobb.train.checkpoint import MARKER
from dobb.train.config import ConfigError
from dobb.train.data import write_bin_shard
from dobb.train.errors import RunError

QUICK = ["steps=2", "warmup_steps=0", "batch_size=4", "eval_batches=1", "progress=false"]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.chdir(tmp_path)  # runs/ and relative paths land here, outside the source tree
    monkeypatch.delenv("DOBB_DEBUG", raising=False)
    yield
    torch.set_num_threads(threads)


def error_line(capsys, argv) -> str:
    """Run `dobb argv`; assert it failed with exit status 2 and one line; return that line."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    errors = [line for line in lines if line.startswith("dobb: error: ")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(lines), lines
    return errors[0]


def test_train_from_outside_the_source_tree_finds_the_shipped_config(capsys, tmp_path):
    assert main(["train", "configs/tiny.yaml", *QUICK, "out_dir=run"]) == 0
    assert "final val loss" in capsys.readouterr().out
    assert (tmp_path / "run" / "summary.json").is_file()


def _files(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "short.txt").write_bytes(b"just a few bytes")
    (tmp_path / "bad.bin").write_bytes(np.arange(600, dtype="<i4").tobytes())  # no magic
    write_bin_shard(tmp_path / "cut.bin", np.arange(100))
    data = (tmp_path / "cut.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-10])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data=missing.txt"], "no data at 'missing.txt'"),
        (["data=empty.txt"], "train split has 0 tokens.*block_size=64"),
        (["data=short.txt"], "train split has 16 tokens.*smaller block_size"),
        (["data=bad.bin"], "bad.bin: magic number 0, expected 20240520"),
        (["data=cut.bin"], r"cut.bin: header says 100 tokens .*\(truncated\)"),
        (["optimizer=sgd"], "optimizer='sgd' is invalid: must be one of"),
        (["optimizer_options.num_blocks=0"], "num_blocks.*docstring of dobb.optim.dobb.Dobb"),
        (["optimizer_options.blocks=8"], "unexpected keyword argument 'blocks'"),
        (["layout=fsdp"], "layout='fsdp'.*needs torchrun.*launch it with torchrun"),
        (["steps=ten"], "bad value 'ten' for steps"),
        (["tokenizer=gpt3"], "tokenizer='gpt3' is invalid"),
    ],
)
def test_expected_failures_print_one_line(capsys, tmp_path, overrides, message):
    _files(tmp_path)
    line = error_line(capsys, ["train", "tiny", *QUICK, *overrides])
    assert re.search(message, line), line
    assert not (tmp_path / "runs").exists()  # failed before writing anything


def test_a_diverged_run_is_one_line_and_keeps_its_checkpoints(capsys, tmp_path):
    run = [*QUICK, "steps=3", "out_dir=run", "checkpoint_interval=1", "lr=1e30"]
    line = error_line(capsys, ["train", "tiny", *run])
    assert "non-finite values" in line and "Lower the learning rate" in line, line
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / MARKER).is_file()


def test_missing_or_malformed_config_file(capsys, tmp_path):
    assert "no config file 'nope.yaml'" in error_line(capsys, ["train", "nope.yaml"])
    (tmp_path / "bad.yaml").write_text("model: [tiny\n")
    assert "bad.yaml: invalid YAML at line 2" in error_line(capsys, ["train", "bad.yaml"])


def test_out_dir_in_use_and_damaged_checkpoints(capsys, tmp_path):
    run = [*QUICK, "out_dir=run", "checkpoint_interval=1", "keep_checkpoints=0"]
    assert main(["train", "tiny", *run]) == 0
    assert "already holds a run" in error_line(capsys, ["train", "tiny", *run])

    (tmp_path / "run" / "checkpoints" / "step_000002" / MARKER).unlink()
    assert main(["train", "tiny", *run, "resume=true"]) == 0  # falls back to step 1
    err = capsys.readouterr().err
    assert "dobb: warning: skipping damaged checkpoint" in err and "step_000002" in err

    for step in (1, 2):
        (tmp_path / "run" / "checkpoints" / f"step_{step:06d}" / "rng_rank0.pt").unlink()
    line = error_line(capsys, ["train", "tiny", *run, "resume=true"])
    assert "no intact checkpoint" in line and "rng_rank0.pt is missing" in line


def test_debug_flag_and_environment_show_the_traceback(monkeypatch):
    with pytest.raises(ConfigError, match="optimizer='sgd'"):
        main(["train", "tiny", "optimizer=sgd", "--debug"])
    monkeypatch.setenv("DOBB_DEBUG", "1")
    with pytest.raises(RunError, match="no data at"):
        main(["train", "tiny", *QUICK, "data=missing.txt"])


def test_unexpected_errors_keep_their_traceback(monkeypatch):
    def broken(cfg):
        raise RuntimeError("a bug")

    monkeypatch.setattr("dobb.train.trainer.train", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["train", "tiny"])


def test_commands_that_plot_name_the_extra_they_need(capsys, monkeypatch):
    from bench.cli import main as bench_main  # compare and study live in the bench package

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    for command in (["compare", "--quick"], ["study", "--tiny"]):
        assert bench_main(command) == 2
        assert "pip install matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["yaml", "numpy", "tqdm"])
def test_train_without_the_train_extra_names_it(capsys, monkeypatch, module):
    """A bare `pip install dobb` has torch alone: `dobb train` is one line naming the extra."""
    loaded = {name: importlib.import_module(f"dobb.train.{name}") for name in ("config", "trainer")}
    for name, mod in loaded.items():  # imported again by the command, `module` missing
        monkeypatch.setattr(sys.modules["dobb.train"], name, mod)  # restored after the test
        monkeypatch.delitem(sys.modules, mod.__name__)
    monkeypatch.setitem(sys.modules, module, None)
    line = error_line(capsys, ["train", "tiny", *QUICK])
    assert f"'{module}'" in line and line.endswith("pip install 'dobb[train]'")


def test_a_resume_that_changes_the_run_is_one_line(capsys, tmp_path):
    run = [*QUICK, "out_dir=run", "checkpoint_interval=1"]
    assert main(["train", "tiny", *run]) == 0
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    for change, field in (("optimizer=muon", "optimizer"), ("model_overrides.n_layer=1", "model")):
        line = error_line(capsys, ["train", "tiny", *run, "resume=true", change])
        assert f"resume: {field}" in line and "another out_dir" in line, line
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before


def test_a_checkpoint_save_on_a_full_disk_is_one_line(capsys, tmp_path, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("dobb.train.checkpoint.dcp.save", no_space)
    line = error_line(capsys, ["train", "tiny", *QUICK, "out_dir=run", "checkpoint_interval=1"])
    assert "saving checkpoint" in line and "No space left on device" in line, line
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []
