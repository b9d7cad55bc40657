"""Dobb's statistics in a compiled model: no graph break, no recompile after warm-up.

``opt.track(model)`` hooks every tracked layer with a forward pre-hook whose work is one
opaque op (``dobb::observe``); Dynamo traces the hook, guarding on what it reads (training
mode, grad and autocast modes, shapes). Compiled per block (torchtitan's way, also with
``fullgraph=True``, where a break is an error) and whole, with and without activation
checkpointing; the losses and the optimizer's statistics and bases equal eager's.
"""

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

import dobb.stats
from dobb import Dobb, param_groups

WIDTH, HIDDEN, DEPTH, STEPS = 16, 32, 2, 4
OP = "dobb::observe"  # the op each statistics hook dispatches


class Block(nn.Module):
    """Attention-like (``q``, ``k`` fed one tensor) then an MLP (``fc``, ``proj``)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH, bias=False)
        self.k = nn.Linear(WIDTH, WIDTH, bias=False)
        self.fc = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.proj = nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x):  # x: (batch, seq, WIDTH)
        scores = self.q(x) @ self.k(x).mT / WIDTH**0.5  # (batch, seq, seq)
        x = x + torch.softmax(scores, dim=-1) @ x
        return x + self.proj(torch.relu(self.fc(x)))


class Checkpointed(nn.Module):
    """``block`` run through ``checkpoint(block, x, use_reentrant=reentrant)``."""

    def __init__(self, block, reentrant):
        super().__init__()
        self.block, self.reentrant = block, reentrant

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=self.reentrant)


class Net(nn.Module):
    """``DEPTH`` blocks between an input and a head layer (both AdamW); ``ac``: None, or
    each block wrapped in ``Checkpointed(block, reentrant=ac)`` (torchtitan wraps, then
    compiles the wrapper)."""

    def __init__(self, ac=None):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, WIDTH)  # reentrant checkpoints need an input with grad
        blocks = (Block() for _ in range(DEPTH))
        self.blocks = nn.ModuleList(b if ac is None else Checkpointed(b, ac) for b in blocks)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def data(step):
    return torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(step))


def counted(opt):
    """Tokens the hooks have counted since the last step, all layers, both sides."""
    return sum(int(s.tokens) for _, s in opt.statistics._hooked())


def train(compile_as=None, ac=None, backend="aot_eager", steps=STEPS, **options):
    """Losses, the model and its optimizer after ``steps`` steps (a basis refresh every 2),
    the model compiled as ``compile_as``: None (eager), "block", "block_fullgraph" (each
    entry of ``model.blocks``, checkpoint wrapper included), "inside_checkpoint" (the
    block inside each checkpoint wrapper, fullgraph) or "whole"; the tokens the
    hooks counted at each step (all layers, both sides); and Dynamo's graph count after the
    first step and at the end."""
    torch._dynamo.reset()
    counters.clear()
    model = Net(ac)
    groups = param_groups(model, exclude=r"^(inp|head)\.")
    opt = Dobb(groups, lr=1e-2, num_blocks=2, basis_interval=2, **options)
    opt.track(model)
    run = torch.compile(model, backend=backend) if compile_as == "whole" else model
    if compile_as in ("block", "block_fullgraph"):
        for block in model.blocks:
            block.compile(backend=backend, fullgraph=compile_as == "block_fullgraph")
    if compile_as == "inside_checkpoint":  # checkpoint(compiled block): AC around the graph
        for wrapper in model.blocks:
            wrapper.block.compile(backend=backend, fullgraph=True)
    losses, tokens, graphs = [], [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = run(data(len(losses)))
        loss.backward()
        tokens.append(counted(opt))
        opt.step()
        losses.append(loss.detach())
        graphs.append(counters["stats"]["unique_graphs"])
    return torch.stack(losses), opt, tokens, (graphs[0], graphs[-1])


def statistics_and_bases(opt):
    """Every tensor of every Dobb matrix's state (``C_b``, bases, momentum, ...)."""
    return [t for state in opt.state.values() for t in state.values() if torch.is_tensor(t)]


@pytest.fixture(scope="module")
def eager():
    return {ac: train(None, ac) for ac in (None, False, True)}


def assert_compiled_matches(compiled, eager, tokens_per_step):
    """No break, no recompile after the first step, every token counted once (none in a
    recompute), and the losses and optimizer state of eager training."""
    losses, opt, tokens, (warm, final) = compiled
    want_losses, want_opt, want_tokens, _ = eager
    assert dict(counters["graph_break"]) == {}
    assert warm == final > 0  # every graph compiled in the first step: no recompile after
    assert tokens == want_tokens == [tokens_per_step] * STEPS
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(statistics_and_bases(opt), statistics_and_bases(want_opt), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


TOKENS = 2 * 8 * 4 * DEPTH  # (batch, seq) tokens into 4 tracked layers per block


CASES = [(how, ac) for how in ("block_fullgraph", "whole") for ac in (None, False, True)] + [
    ("inside_checkpoint", ac) for ac in (False, True)
]
AC_NAMES = {None: "no_ac", False: "non_reentrant", True: "reentrant"}


@pytest.mark.parametrize("compile_as, ac", CASES, ids=lambda v: AC_NAMES.get(v, v))
def test_compiled_tracking_has_no_graph_break_and_matches_eager(compile_as, ac, eager):
    assert_compiled_matches(train(compile_as, ac), eager[ac], TOKENS)


@pytest.mark.parametrize("compile_as", ["block_fullgraph", "whole"])
def test_two_sided_output_gradient_hooks_compile_too(compile_as):
    """``row_stats="outputs"``: a hook on each layer's output feeds it ``dL/dy`` in backward."""
    options = {"two_sided": True, "row_stats": "outputs"}
    both_sides = 2 * TOKENS
    assert_compiled_matches(train(compile_as, **options), train(**options), both_sides)


def test_compiled_eval_and_no_grad_forwards_count_nothing():
    """Dynamo guards on training mode and grad mode: each mode gets its graph, and only a
    training forward with grad counts (outside a reentrant checkpoint's forward)."""
    torch._dynamo.reset()
    counters.clear()
    model = Net()
    opt = Dobb(param_groups(model, exclude=r"^(inp|head)\."), lr=1e-2, num_blocks=2)
    opt.track(model)
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        model(data(0))
    model.eval()
    model(data(0))
    assert counted(opt) == 0 and not any(s.seen for _, s in opt.statistics._hooked())
    model.train()
    model(data(0))
    assert counted(opt) == TOKENS and dict(counters["graph_break"]) == {}


def test_compiled_layers_fed_one_tensor_share_its_gram_product():
    """q and k read one tensor: inside the compiled graph too, its ``X_bᵀ X_b`` runs once
    (the cache runs in the op, on the real tensors)."""
    torch._dynamo.reset()
    model = Net()
    opt = Dobb(param_groups(model, exclude=r"^(inp|head)\."), lr=1e-2, num_blocks=2)
    opt.track(model)
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    model(data(0)).backward()  # compiles
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(data(1))
    inside = [e.name for e in prof.events() if e.cpu_parent and e.cpu_parent.name == OP]
    # 1 per layer here
    stacks = len(opt.statistics._stats[model.blocks[0].q.weight]["input"].stacks)
    assert [e.name for e in prof.events()].count(OP) == 4 * DEPTH  # one op per layer
    assert inside.count("aten::bmm") == 3 * DEPTH * stacks  # inputs: x (q, k), fc's, proj's


def test_the_16bit_product_probe_is_a_constant_to_a_compiler(monkeypatch):
    """Under fp16 autocast on CUDA the hook asks whether ``bmm`` has ``out_dtype`` there (a
    probe ``bmm`` in ``try``): traced, the probe would land in the graph and raise at run
    time where the answer is no. A compiler gets the answer instead (the CPU's: no)."""
    monkeypatch.setattr(dobb.stats, "_OUT_DTYPE_BMM", {})  # not yet probed

    def scale(x):
        return x * (2 if dobb.stats._has_out_dtype(x.device, torch.float16) else 3)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(scale, backend="eager", fullgraph=True)  # no dead code dropped
    assert torch.equal(compiled(torch.ones(2)), scale(torch.ones(2)))
    assert dict(counters["graph_break"]) == {}


def test_many_blocks_compiled_one_by_one_share_one_graph(monkeypatch):
    """torchtitan compiles each of many identical blocks: tracked, they still share one graph,
    as untracked ones do. A per-layer constant in the traced hook (an int key) recompiled
    once per layer, and past Dynamo's recompile limit ``fullgraph=True`` failed."""
    monkeypatch.setattr(f"{__name__}.DEPTH", torch._dynamo.config.recompile_limit + 2)
    _, _, tokens, graphs = train("block_fullgraph", steps=2)
    assert dict(counters["graph_break"]) == {}
    assert graphs == (1, 1)
    assert tokens == [2 * 8 * 4 * (torch._dynamo.config.recompile_limit + 2)] * 2
