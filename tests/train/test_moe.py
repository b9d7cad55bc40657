"""The mixture of experts of `dobb.train.model` (`MoE`, `GroupedExperts`): the layer against
a per-token float64 reference, the `_grouped_mm` call protocol that hooks rely on, the
load-balancing loss, the init, and `dobb train` routing the expert stacks and training."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

from dobb.registry import build_optimizer
from dobb.train.config import load_config
from dobb.train.model import EXPERT_WEIGHTS, GPT, MLP, GroupedExperts, MoE, gpt_config
from dobb.train.trainer import train

C, E = 16, 4


def moe(top_k=2, **overrides) -> MoE:
    """A float64 MoE layer of width C with E experts, every weight drawn at random."""
    torch.manual_seed(0)
    cfg = gpt_config("tiny", n_embd=C, n_experts=E, expert_top_k=top_k, **overrides)
    layer = MoE(cfg).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    return layer


def reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """sum over a token's top-k experts e of softmax-over-the-k(logits)_e x MLP_e(token),
    token by token."""
    w_r, w1, w2 = layer.router.weight, layer.experts.w1, layer.experts.w2
    out = torch.zeros_like(x)
    for i, token in enumerate(x.flatten(0, -2)):
        logits = w_r @ token
        top = logits.topk(layer.top_k).indices.tolist()
        scores = torch.exp(logits[top]) / torch.exp(logits[top]).sum()
        for score, e in zip(scores, top):
            out.view(-1, x.shape[-1])[i] += score * (w2[e] @ F.gelu(w1[e] @ token))
    return out


@pytest.mark.parametrize("top_k", [1, 2, E])
def test_the_layer_is_the_per_token_mixture_of_its_top_k_experts(top_k):
    layer = moe(top_k)
    x = torch.randn(3, 5, C, dtype=torch.float64)
    torch.testing.assert_close(layer(x), reference(layer, x), rtol=1e-12, atol=1e-12)


def test_each_expert_is_twice_the_width_wide_at_top_2_as_many_flops_as_the_dense_mlp():
    for top_k, hidden in [(1, 4 * C), (2, 2 * C), (4, C)]:
        assert moe(top_k).experts.w1.shape == (E, hidden, C)
        assert moe(top_k).experts.w2.shape == (E, C, hidden)
    assert moe(2, expert_hidden=24).experts.w1.shape == (E, 24, C)
    dense = MLP(gpt_config("tiny", n_embd=C))
    assert 2 * moe(2).experts.w1[0].numel() == dense.fc.weight.numel()


def test_gradients_of_the_layer_are_its_derivatives():
    layer = moe()
    x = torch.randn(2, 3, C, dtype=torch.float64, requires_grad=True)
    weights = (layer.router.weight, layer.experts.w1, layer.experts.w2)

    def f(x, w_r, w1, w2):
        named = {"router.weight": w_r, "experts.w1": w1, "experts.w2": w2}
        return torch.func.functional_call(layer, named, (x,))

    inputs = (x, *(w.detach().clone().requires_grad_() for w in weights))
    assert torch.autograd.gradcheck(f, inputs)


def test_grouped_mm_multiplies_each_group_of_rows_by_its_matrix():
    experts = GroupedExperts(3, 4, 6).double()
    A = torch.randn(7, 4, dtype=torch.float64)
    B_t = torch.randn(3, 4, 5, dtype=torch.float64)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)  # expert 1 has no rows
    out = experts._grouped_mm(A=A, B_t=B_t, offs=offs)
    expected = torch.cat([A[:2] @ B_t[0], A[2:7] @ B_t[2]])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


class Spy:
    """Records each `_grouped_mm` call of the experts of `model` (by keyword, as the
    protocol calls it) and returns what the method returns."""

    def __init__(self, model):
        self.calls = []
        for module in model.modules():
            if isinstance(module, GroupedExperts):
                module._grouped_mm = self.wrap(module, module._grouped_mm)

    def wrap(self, module, method):
        def spy(*, A, B_t, offs):
            out = method(A=A, B_t=B_t, offs=offs)
            self.calls.append((module, A, B_t, offs, out))
            return out

        return spy


def test_the_experts_call_grouped_mm_once_per_stack_w1_then_w2():
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", n_embd=C, n_head=2, n_layer=2, n_experts=E)).double()
    spy = Spy(model)
    idx = torch.randint(0, 256, (2, 6))
    model(idx)
    top_k, tokens = model.cfg.expert_top_k, idx.numel()
    layers = [block.mlp.experts for block in model.blocks]
    assert GroupedExperts.grouped_mm_calls == ("w1", "w2")
    stacks = [(experts, name) for experts in layers for name in GroupedExperts.grouped_mm_calls]
    assert len(spy.calls) == len(stacks)  # exactly once per stack per forward, in order
    for (experts, name), (module, A, B_t, offs, out) in zip(stacks, spy.calls):
        w = getattr(experts, name)
        assert module is experts
        assert B_t.shape == (E, w.shape[2], w.shape[1])  # (E, d_in, d_out)
        assert B_t.data_ptr() == w.data_ptr() and torch.equal(B_t, w.transpose(-2, -1))
        assert offs.dtype == torch.int32 and offs.shape == (E,)
        assert A.shape == (tokens * top_k, w.shape[2]) and out.shape == (A.shape[0], w.shape[1])
        assert offs[-1] == A.shape[0] and bool((offs.diff() >= 0).all())
        bounds = [0, *offs.tolist()]
        for e in range(E):
            rows = slice(bounds[e], bounds[e + 1])
            torch.testing.assert_close(out[rows], A[rows] @ B_t[e], rtol=0, atol=0)


def test_the_rows_of_each_expert_are_the_tokens_routed_to_it():
    layer = moe()
    spy = Spy(layer)
    x = torch.randn(2, 5, C, dtype=torch.float64)
    layer(x)
    _, A, _, offs, _ = spy.calls[0]  # w1's call: A holds the tokens themselves
    chosen = layer.router(x.flatten(0, 1)).topk(layer.top_k).indices
    bounds = [0, *offs.tolist()]
    for e in range(E):
        routed = x.flatten(0, 1)[(chosen == e).any(-1)]
        torch.testing.assert_close(A[bounds[e] : bounds[e + 1]], routed, rtol=0, atol=0)


def test_the_load_balancing_loss_is_switchs_and_joins_the_training_loss_only():
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", n_layer=2, n_experts=E, router_aux_loss_coef=0.5))
    idx, targets = torch.randint(0, 256, (2, 2, 64))
    logits, loss = model(idx, targets)
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    x, auxes = model.drop(model.wte(idx) + model.wpe(torch.arange(64))), []
    for block in model.blocks:
        h = block.ln_2(x + block.attn(block.ln_1(x))).flatten(0, 1)
        logits_r = block.mlp.router(h)
        chosen = logits_r.topk(model.cfg.expert_top_k).indices
        f = torch.stack([(chosen == e).sum() for e in range(E)]) / chosen.numel()
        P = torch.softmax(logits_r, -1).mean(0)
        auxes.append(E * (f * P).sum())
        torch.testing.assert_close(block.mlp.aux_loss, auxes[-1])
        x = block(x)
    torch.testing.assert_close(loss, ce + 0.5 * torch.stack(auxes).mean())
    model.blocks[0].mlp.aux_loss.backward()
    assert model.blocks[0].mlp.router.weight.grad.abs().sum() > 0
    model.eval()
    torch.testing.assert_close(model(idx, targets)[1], ce)  # validation: cross-entropy alone


def test_the_experts_are_initialized_as_the_dense_mlp():
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", n_layer=8, n_embd=256, n_experts=E))
    mlp = model.blocks[0].mlp
    assert mlp.experts.w1.std().item() == pytest.approx(0.02, rel=0.05)  # the fc's
    assert mlp.experts.w2.std().item() == pytest.approx(0.02 / 4, rel=0.05)  # the proj's
    assert mlp.router.weight.std().item() == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"n_experts": 4, "expert_top_k": 5}, "expert_top_k=5 is not in 1 .. 4"),
        ({"n_experts": 4, "expert_top_k": 0}, "expert_top_k=0 is not in 1 .. 4"),
        ({"n_experts": -1}, "n_experts=-1, expert_hidden=0 and router_aux_loss_coef=0.01 must"),
        ({"n_experts": 4, "expert_hidden": -2}, "expert_hidden=-2 and"),
        ({"n_experts": 4, "router_aux_loss_coef": -0.1}, "router_aux_loss_coef=-0.1 must all"),
    ],
)
def test_bad_expert_settings_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        gpt_config("tiny", **overrides)


def expert_stacks(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.ndim == 3}


def test_the_stacks_are_named_by_expert_weights():
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", n_experts=E))
    names = {n for n, _ in model.named_parameters() if re.search(EXPERT_WEIGHTS, n)}
    assert (
        names
        == expert_stacks(model)
        == {f"blocks.{i}.mlp.experts.w{j}" for i in range(2) for j in (1, 2)}
    )


def test_muon_steps_the_stacks_with_the_hidden_matrices_adamw_with_its_hidden_group():
    torch.manual_seed(0)
    model = GPT(gpt_config("tiny", n_experts=E))
    stacks = expert_stacks(model)
    muon = build_optimizer("muon", model, experts=EXPERT_WEIGHTS)
    matrix, scalar = muon.param_groups
    assert matrix["algorithm"] == "muon" and stacks <= set(matrix["param_names"])
    assert "blocks.0.mlp.router.weight" in matrix["param_names"]  # a hidden nn.Linear
    assert not stacks & set(scalar["param_names"])
    adamw = build_optimizer("adamw", model, experts=EXPERT_WEIGHTS, weight_decay=0.1)
    hidden, rest = adamw.param_groups
    assert stacks <= set(hidden["param_names"]) and hidden["weight_decay"] == 0.1
    assert not stacks & set(rest["param_names"]) and rest["weight_decay"] == 0.0
    no_regex = build_optimizer("muon", model)  # without the regex: with the scalars
    assert stacks <= set(no_regex.param_groups[-1]["param_names"])


def tiny_moe(tmp_path, optimizer: str, steps: int = 2):
    overrides = [f"optimizer={optimizer}", f"steps={steps}", f"out_dir={tmp_path}"]
    return load_config("configs/tiny-moe.yaml", overrides + ["progress=false"])


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_dobb_train_runs_the_tiny_moe_config(tmp_path, optimizer):
    cfg = tiny_moe(tmp_path, optimizer)
    assert cfg.model_overrides["n_experts"] > 0
    summary = train(cfg)
    assert math.isfinite(summary["final_val_loss"])
    assert summary["num_params"] > GPT(gpt_config("tiny")).num_params()


def test_training_the_tiny_moe_reduces_the_loss(tmp_path):
    summary = train(tiny_moe(tmp_path, "muon", steps=12))
    assert summary["final_val_loss"] < math.log(256) - 0.3


@pytest.mark.parametrize("optimizer", ["dobb", "dobb_paper"])
def test_dobb_trains_the_tiny_moe_with_each_experts_statistics(tmp_path, optimizer):
    """Dobb's statistics of each expert come from its routed rows (the stacks' grouped
    GEMMs hooked: ``GroupedExperts`` is registered), and the loss falls."""
    summary = train(tiny_moe(tmp_path, optimizer, steps=12))
    assert summary["final_val_loss"] < math.log(256) - 0.3
    from dobb.stats import expert_modules

    assert [type(m) for m, _ in expert_modules(GPT(gpt_config("tiny", n_experts=4)))] == [
        GroupedExperts
    ] * 2
