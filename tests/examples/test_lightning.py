"""examples/lightning_module.py: Dobb under Lightning's automatic optimization, resume."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import lightning_module  # noqa: E402

import dobb  # noqa: E402

STEPS_PER_EPOCH = 4
# bases refresh at steps 1, 4, 7: step 7 (after the resume at 4) uses the restored C_b
OPTIONS = dict(steps_per_epoch=STEPS_PER_EPOCH, basis_interval=3)


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # resume
def test_trains_and_resume_equals_uninterrupted(tmp_path):
    steps = 2 * STEPS_PER_EPOCH
    trainer, straight = lightning_module.train(tmp_path / "straight", steps, **OPTIONS)
    assert trainer.global_step == steps and len(straight.losses) == steps
    assert all(torch.isfinite(torch.tensor(straight.losses)))
    assert straight.losses[-1] < straight.losses[0]
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, dobb.Dobb)
    dobb_names = {
        n for g in optimizer.param_groups if g["algorithm"] == "dobb" for n in g["param_names"]
    }
    assert "model.blocks.0.attn.q.weight" in dobb_names and "model.wte.weight" not in dobb_names

    # a job killed at the end of the first epoch, then a fresh module, optimizer and
    # Trainer resuming from its checkpoint
    lightning_module.train(tmp_path / "run", steps, stop_at=STEPS_PER_EPOCH, **OPTIONS)
    assert (tmp_path / "run" / "last.ckpt").is_file()
    trainer, resumed = lightning_module.train(tmp_path / "run", steps, resume=True, **OPTIONS)
    assert trainer.global_step == steps
    assert resumed.losses == straight.losses[STEPS_PER_EPOCH:]

    torch.manual_seed(0)  # as `train` seeds before building the module
    initial = lightning_module.DobbLM(steps).state_dict()
    expected, final = straight.state_dict(), resumed.state_dict()
    for name, value in expected.items():
        assert not torch.equal(value, initial[name]), f"{name} did not train"
        torch.testing.assert_close(final[name], value, rtol=0, atol=0, msg=name)
