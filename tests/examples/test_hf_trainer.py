"""examples/hf_trainer.py: Dobb under Hugging Face's Trainer, GPT-2 Conv1D, resume."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import hf_trainer  # noqa: E402

import dobb  # noqa: E402

STEPS = 8
OPTIONS = dict(basis_interval=3)  # bases refresh at steps 1, 4, 7: step 7 uses restored C_b


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_conv1d_layers_go_to_dobb_blocked_along_d_in():
    model = hf_trainer.tiny_gpt2()
    optimizer, _ = hf_trainer.make_dobb_optimizer(model, 1e-2, num_training_steps=10)
    by_algorithm = {g["algorithm"]: set(g["param_names"]) for g in optimizer.param_groups}
    assert by_algorithm["dobb"] == {
        f"transformer.h.{i}.{layer}.weight"
        for i in range(2)
        for layer in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    # the tied wte/lm_head matrix is listed once, as wte, and goes to AdamW with wpe
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= by_algorithm["adamw"]
    assert model.lm_head.weight is model.transformer.wte.weight

    x = torch.randint(0, 256, (2, 64))
    model(input_ids=x, labels=x).loss.backward()
    optimizer.step()
    c_attn = model.transformer.h[0].attn.c_attn.weight  # Conv1D: (d_in, d_out) = (64, 192)
    state = optimizer.state[c_attn]
    assert c_attn.shape == (64, 192)
    # blocked along d_in (64), not d_out (192): one block of 64 (blocks up to 1,024 columns);
    # two-sided, one row block of the 192 output features
    assert state["input_cov_0"].shape == state["input_basis_0"].shape == (1, 64, 64)
    assert state["row_basis_0"].shape == (1, 192, 192)
    assert state["stats_steps"] == 1  # the hook on c_attn saw this step's input
    mlp_proj = optimizer.state[model.transformer.h[0].mlp.c_proj.weight]
    assert mlp_proj["input_cov_0"].shape == (1, 256, 256)  # d_in = 4 * n_embd = 256


def test_trains_and_resume_equals_uninterrupted(tmp_path):
    straight = hf_trainer.train(tmp_path / "straight", STEPS, **OPTIONS)
    losses = [e["loss"] for e in straight.state.log_history if "loss" in e]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    # Trainer's optimizer is accelerate's wrapper around ours
    assert isinstance(getattr(straight.optimizer, "optimizer", straight.optimizer), dobb.Dobb)

    # a job killed right after its first checkpoint, then a fresh model, optimizer and
    # Trainer resuming from that checkpoint
    half = STEPS // 2
    hf_trainer.train(tmp_path / "run", STEPS, save_steps=half, stop_at=half, **OPTIONS)
    checkpoint = tmp_path / "run" / f"checkpoint-{half}"
    assert (checkpoint / "optimizer.pt").is_file()
    resumed = hf_trainer.train(tmp_path / "run", STEPS, resume=True, **OPTIONS)
    assert resumed.state.global_step == STEPS

    initial = hf_trainer.tiny_gpt2().state_dict()
    final, expected = weights(resumed), weights(straight)
    for name, value in expected.items():
        assert not torch.equal(value, initial[name]), f"{name} did not train"
        torch.testing.assert_close(final[name], value, rtol=0, atol=0, msg=name)
