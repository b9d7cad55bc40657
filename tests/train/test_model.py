import hashlib
import math

import pytest
import torch
import torch.nn as nn

from dobb.train.model import GPT, GPT_CONFIGS, MoE, gpt_config


def tiny(**overrides):
    torch.manual_seed(0)
    return GPT(gpt_config("tiny", **overrides))


def test_forward_shapes_and_initial_loss_near_uniform():
    model = tiny()
    idx, targets = torch.randint(0, 256, (2, 3, 64))
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 64, 256)
    assert abs(loss.item() - math.log(256)) < 0.1
    assert model(idx)[1] is None


def test_future_tokens_do_not_change_past_logits():
    model = tiny().eval()
    idx = torch.randint(0, 256, (2, 32))
    edited = idx.clone()
    edited[:, 20] = (idx[:, 20] + 1) % 256
    a, b = model(idx)[0], model(edited)[0]
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


@pytest.mark.parametrize(
    "name, millions",
    [("gpt2", 124.3), ("gpt2-medium", 354.6), ("gpt2-large", 773.5), ("gpt2-xl", 1556.8)],
)
def test_gpt2_param_counts_on_meta_device(name, millions):
    with torch.device("meta"):
        model = GPT(gpt_config(name))
    assert model.num_params() / 1e6 == pytest.approx(millions, abs=0.1)
    assert model.wte.weight.is_meta


def test_layout_names_and_tied_head():
    model = tiny()
    names = {n for n, _ in model.named_parameters()}
    assert {"wte.weight", "wpe.weight", "blocks.0.attn.q.weight"} <= names
    assert {
        "blocks.1.attn.proj.weight",
        "blocks.1.mlp.fc.weight",
        "blocks.1.mlp.proj.weight",
    } <= names
    assert model.lm_head.weight is model.wte.weight
    # every hidden matrix is the weight of a plain nn.Linear (optimizers hook their inputs)
    linear_weights = {id(m.weight) for m in model.modules() if type(m) is nn.Linear}
    for n, p in model.named_parameters():
        if p.ndim == 2 and n not in ("wte.weight", "wpe.weight"):
            assert id(p) in linear_weights, n


def layout_digest(model: GPT) -> str:
    """sha256 of the parameters' names and shapes in `named_parameters()` order: what the
    model is, with no float in it (a float drawn or computed here could differ on another
    CPU)."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(f"{name}{tuple(p.shape)}".encode())
    return digest.hexdigest()


def test_the_dense_model_is_the_one_before_experts():
    # `layout_digest(tiny())` by dobb/train/model.py at commit 38760f7, before the mixture of
    # experts: the same parameters, named and shaped alike, in the same order (and so drawn
    # alike from the seed: the weights and a batch's loss were checked equal to that
    # commit's bit for bit, on one machine, when the experts came)
    assert layout_digest(tiny(n_experts=0)) == (
        "a144a3702afaf352663279ce17444ec18204a6ae330d776b2134e92f35440783"
    )
    assert not any(isinstance(m, MoE) for m in tiny(n_experts=0).modules())


def test_gpt2_init_scales_residual_projections():
    model = GPT(gpt_config("tiny", n_layer=8, n_embd=256))
    assert model.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)


def test_tiny_model_learns_with_adamw():
    model = tiny()
    text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 8))
    x, y = text[:-1].unfold(0, 64, 16), text[1:].unfold(0, 64, 16)  # (B, 64) windows
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 2.0


def test_config_errors():
    with pytest.raises(ValueError, match="unknown GPT config 'gpt5'"):
        gpt_config("gpt5")
    with pytest.raises(ValueError, match="n_layers"):
        gpt_config("tiny", n_layers=3)
    with pytest.raises(ValueError, match="n_embd=65 is not divisible by n_head=4"):
        gpt_config("tiny", n_embd=65)
    with pytest.raises(ValueError, match="exceeds block_size=64"):
        tiny()(torch.zeros(1, 65, dtype=torch.long))
    assert set(GPT_CONFIGS) == {"tiny", "mini", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"}
