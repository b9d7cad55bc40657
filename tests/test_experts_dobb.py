"""Dobb on expert stacks: each expert preconditioned by the statistics of its routed tokens.

A grouped-experts module (``tests/expert_layers.py``: two stacks, ``dobb.stats``'s protocol)
fed routed tokens equals ``2 E`` separate ``nn.Linear`` layers fed the same tokens, tensor
for tensor (float64, ``torch.equal``: the same products, so the same gradients and the
same statistics), wherever each expert gets the same number of tokens at every step (its
token-weighted EMA is then the layers' EMA). Statistics pooled over the experts, or one
expert's read for another, fail it. Beside it: the token-weighted fold against its formula
written out here, an idle expert's step, an expert that never had tokens, and a resume.
"""

import copy

import pytest
import torch
from expert_layers import Experts, Separate
from torch import nn

from dobb import Dobb
from dobb.optim.dobb_core import EXPERT_TOKENS
from dobb.optim.parts import COUNTERS
from dobb.registry import get_entry
from dobb.stats import register_experts

E, DIM, HIDDEN, STEPS = 3, 6, 8, 5
CONFIGS = {  # the registry's three Dobbs, refreshed every 2 steps
    name: {k: v for k, v in get_entry(name).hyperparameters.items() if k != "lr"}
    | {"basis_interval": 2}
    for name in ("dobb", "dobb_paper", "dobb_sign")
}


def weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, HIDDEN, DIM, generator=g, dtype=torch.float64)
    return w1, torch.randn(E, DIM, HIDDEN, generator=g, dtype=torch.float64)


def batch(step: int, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routed rows sorted by expert, their counts, and a target for the loss."""
    g = torch.Generator().manual_seed(100 + step)
    rows = sum(counts)
    x = torch.randn(rows, DIM, generator=g, dtype=torch.float64)
    return x, torch.tensor(counts), torch.randn(rows, DIM, generator=g, dtype=torch.float64)


def train_step(model: nn.Module, opt, step: int, counts: list[int]) -> None:
    x, n, target = batch(step, counts)
    opt.zero_grad()
    (model(x, n) * target).sum().backward()
    opt.step()


def stacked(options: dict, w1=None, w2=None) -> tuple[Experts, Dobb]:
    model = Experts(*(weights() if w1 is None else (w1, w2)))
    opt = Dobb([{"params": [("w1", model.w1), ("w2", model.w2)]}], lr=0.01, **options)
    opt.track(model)
    return model, opt


@pytest.mark.parametrize("foreach", [False, True], ids=["per-matrix", "batched"])
@pytest.mark.parametrize("name", CONFIGS)
def test_a_stack_fed_routed_tokens_equals_its_experts_as_linear_layers(name, foreach):
    counts = [5, 3, 7]  # each expert's every step: its EMA is the layers'
    options = CONFIGS[name] | {"foreach": foreach}
    model, opt = stacked(options)
    separate = Separate(*weights())
    reference = Dobb([{"params": separate.named_experts()}], lr=0.01, **options)
    reference.track(separate)
    for step in range(STEPS):
        train_step(model, opt, step, counts)
        train_step(separate, reference, step, counts)
    for stack, layers in ((model.w1, separate.l1), (model.w2, separate.l2)):
        for e, layer in enumerate(layers):
            assert torch.equal(stack.detach()[e], layer.weight.detach()), (name, e)
            theirs = reference.state[layer.weight]
            for key, value in theirs.items():
                assert torch.equal(opt.state[stack][key][e], value), (name, key, e)
        assert torch.equal(opt.state[stack][EXPERT_TOKENS], torch.tensor(counts).double())


def test_a_stack_whose_token_counts_change_differs_from_its_experts_as_linear_layers():
    """Outside the condition of the test above: counts that change from step to step. The
    stack's ``C`` is the token-weighted EMA, each ``nn.Linear``'s the per-step EMA, so the
    two differ (by far more than rounding: here above 1e-3 relatively) from the second
    fold on, though each step's gradients and sums are the same products."""
    schedule = [[5, 3, 7], [1, 9, 2], [8, 2, 4]]
    model, opt = stacked(CONFIGS["dobb"])
    separate = Separate(*weights())
    reference = Dobb([{"params": separate.named_experts()}], lr=0.01, **CONFIGS["dobb"])
    reference.track(separate)
    for step, counts in enumerate(schedule):
        train_step(model, opt, step, counts)
        train_step(separate, reference, step, counts)
    gaps = []
    for e, layer in enumerate(separate.l1):
        for key, value in reference.state[layer.weight].items():
            if "_cov" in key:
                ours = opt.state[model.w1][key][e]
                gaps.append(float((ours - value).norm() / value.norm()))
    assert max(gaps) > 1e-3, gaps


def test_the_fold_is_the_token_weighted_ema_written_out():
    """Counts that change from step to step (and an idle step) fold as
    ``expert_weights``' formula, computed here from the routed rows themselves."""
    beta = 0.9
    options = CONFIGS["dobb_paper"] | {"stats_beta": beta, "num_blocks": 1, "basis_interval": 100}
    model, opt = stacked(options)
    schedule = [[4, 1, 6], [1, 0, 6], [9, 2, 1]]
    cov, seen = [None] * E, [0.0] * E
    for step, counts in enumerate(schedule):
        train_step(model, opt, step, counts)
        x, _, _ = batch(step, counts)
        start = 0
        for e, n in enumerate(counts):
            rows = x[start : start + n]
            start += n
            if n == 0:
                continue
            moment = rows.T @ rows / n
            if seen[e] == 0:
                cov[e], seen[e] = moment, float(n)
            else:
                gamma = (1 - beta) * n / (beta * seen[e] + (1 - beta) * n)
                cov[e] = cov[e] + gamma * (moment - cov[e])
                seen[e] = beta * seen[e] + (1 - beta) * n
    state = opt.state[model.w1]
    for e in range(E):
        torch.testing.assert_close(state["input_cov_0"][e, 0], cov[e], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(state[EXPERT_TOKENS], torch.tensor(seen, dtype=torch.float64))


def test_an_idle_expert_keeps_its_statistics_and_basis():
    """An expert with no tokens for a step, then for two refresh periods, keeps ``C`` and
    its token count; a refresh recomputes its basis from the same ``C``, so it keeps that
    too (eigh); its step is Dobb's step on a zero gradient."""
    model, opt = stacked(CONFIGS["dobb"] | {"basis_interval": 2})  # refreshes at steps 1, 3, ...
    for step in range(3):  # the third folds, then refreshes
        train_step(model, opt, step, [3, 4, 5])
    state = opt.state[model.w1]
    kept = {k: state[k][1].clone() for k in ("input_cov_0", "input_basis_0", EXPERT_TOKENS)}
    other = state["input_basis_0"][0].clone()
    for step in range(3, 7):  # idle through the refreshes of steps 5 and 7
        train_step(model, opt, step, [6, 0, 6])
        for key, value in kept.items():
            assert torch.equal(state[key][1], value), (key, step)
    assert not torch.equal(state["input_basis_0"][0], other)  # a busy expert's moved
    assert int(opt.basis_failures.counter(torch.device("cpu"))) == 0


def test_an_expert_that_never_had_tokens_keeps_the_identity():
    options = CONFIGS["dobb"] | {"basis_interval": 1, "basis_method": "cholqr"}
    model, opt = stacked(options)
    for step in range(3):
        train_step(model, opt, step, [5, 0, 5])
    state = opt.state[model.w1]
    identity = torch.eye(DIM, dtype=torch.float64)
    assert torch.equal(state["input_basis_0"][1, 0], identity)
    assert torch.equal(state["input_cov_0"][1], torch.zeros_like(state["input_cov_0"][1]))
    assert not torch.equal(state["input_basis_0"][0, 0], identity)
    # C = 0 was never handed to the solver, which would have rejected its basis
    assert int(opt.basis_failures.counter(torch.device("cpu"))) == 0


def test_a_stack_resumes_from_its_state_dict():
    counts = [[2, 5, 1], [0, 4, 4], [3, 3, 3], [6, 1, 0]]
    straight, opt = stacked(CONFIGS["dobb"])
    for step, c in enumerate(counts):
        train_step(straight, opt, step, c)
    first, opt = stacked(CONFIGS["dobb"])
    for step, c in enumerate(counts[:2]):
        train_step(first, opt, step, c)
    saved = copy.deepcopy(opt.state_dict())
    resumed, opt = stacked(CONFIGS["dobb"], first.w1.detach(), first.w2.detach())
    opt.load_state_dict(saved)
    for step, c in enumerate(counts[2:], start=2):
        train_step(resumed, opt, step, c)
    assert torch.equal(resumed.w1, straight.w1) and torch.equal(resumed.w2, straight.w2)


def test_a_module_computing_in_another_order_is_refused():
    class Backwards(Experts):
        def forward(self, x, counts):  # w2's shape first: (E, hidden, dim) is w1's transpose
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            return self._grouped_mm(A=x, B_t=self.w1.transpose(-2, -1), offs=offs)

    register_experts(Backwards, ("w2", "w1"))
    model = Backwards(*weights())
    opt = Dobb([{"params": [("w1", model.w1), ("w2", model.w2)]}], lr=0.01)
    opt.track(model)
    x, n, _ = batch(0, [2, 2, 2])
    with pytest.raises(RuntimeError, match=r"registered order \('w2', 'w1'\) names w2"):
        model(x, n)


def test_a_stack_without_statistics_is_refused_before_anything_changes():
    model = Experts(*weights())
    opt = Dobb([{"params": [("w1", model.w1), ("w2", model.w2)]}], lr=0.01)
    x, n, target = batch(0, [2, 2, 2])
    (model(x, n) * target).sum().backward()
    before = model.w1.detach().clone()
    with pytest.raises(RuntimeError, match="w1 has no activation statistics.*register_experts"):
        opt.step()
    assert torch.equal(model.w1, before) and not opt.state


def test_a_capturable_step_with_an_idle_expert_reads_nothing():
    """Capturable (``docs/gpu.md``): with an expert idle, steady steps and refresh steps
    read nothing on the host (the token counts stay on the device: the fold's weights and
    the refresh's keep are ``torch.where``s), and train as the default step does, bit for
    bit (two-sided Dobb with the sign: Adam coefficients' bias correction would take the
    device counters there and the host's floats here, which round differently)."""
    from opcount import OpCounter

    schedule = [[4, 3, 5], [6, 0, 6], [6, 0, 6], [2, 7, 3]]
    options = CONFIGS["dobb_sign"] | {
        "basis_interval": 2,
        "basis_method": "cholqr",
        "foreach": True,
    }
    finals = []
    for capturable in (False, True):
        extra = {"capturable": True, "nonfinite": "skip"} if capturable else {}
        model, opt = stacked(options | extra)
        reads = []
        for step, counts in enumerate(schedule):  # steps 3 (idle expert) and 4: refresh, steady
            x, n, target = batch(step, counts)
            opt.zero_grad()
            (model(x, n) * target).sum().backward()
            with OpCounter() as counter:
                opt.step()
            reads.append(counter.host_reads)
        if capturable:
            assert reads[1:] == [0, 0, 0], reads  # the first builds the state, eagerly
        finals.append(torch.cat([model.w1.detach().flatten(), model.w2.detach().flatten()]))
    assert torch.equal(*finals)


def test_the_example_of_docs_algorithm_runs():
    """docs/algorithm.md's "Experts" example, run as written: one step with an idle
    expert."""
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "algorithm.md").read_text()
    section = doc[doc.index("## Experts: statistics from the routed tokens") :]
    code = section[section.index("```python\n") + 10 : section.index("\n```\n")]
    scope = {}
    exec(compile(code, "docs/algorithm.md", "exec"), scope)
    state = scope["opt"].state[scope["model"].w1]
    assert state[EXPERT_TOKENS].tolist() == [5.0, 0.0, 4.0, 3.0]


def test_a_compiled_forward_gathers_the_same_statistics_with_no_graph_break():
    """Under ``torch.compile(fullgraph=True)`` (where a graph break is an error) the hook is
    the op ``dobb::observe_experts``: statistics, counts and weights equal the eager run's
    bit for bit, and other token splits of the same batch size (an idle expert among them)
    recompile nothing (``error_on_recompile``). ``aot_eager``: Dynamo and AOTAutograd as
    with inductor, the graph run by eager kernels (inductor's C++ builds take minutes on 2
    cores)."""
    import torch._dynamo
    from expert_layers import GatheredExperts

    schedule = [[4, 3, 5], [5, 0, 7], [2, 6, 4]]
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model = GatheredExperts(*weights())
        opt = Dobb([{"params": [("w1", model.w1), ("w2", model.w2)]}], lr=0.01, basis_interval=2)
        opt.track(model)
        forward = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
        for step, counts in enumerate(schedule):
            x, n, target = batch(step, counts)
            opt.zero_grad()
            with torch._dynamo.config.patch(error_on_recompile=compiled and step > 0):
                (forward(x, n) * target).sum().backward()
            opt.step()
        state = opt.state[model.w1]
        results.append([model.w1.detach(), state["input_cov_0"], state[EXPERT_TOKENS]])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def test_a_stack_given_new_memory_after_track_keeps_its_statistics():
    """A stack whose memory changes after ``track`` (``param.data = ...``, as a move or a
    load with ``assign`` does) gets new expert views; its statistics, layouts and state
    are found through the stack, and the run equals one that kept its memory."""
    runs = []
    for move in (False, True):
        model, opt = stacked(CONFIGS["dobb"])
        for step in range(3):
            if move and step == 1:
                model.w1.data = model.w1.data.clone()
            train_step(model, opt, step, [3, 4, 5])
        runs.append(model.w1.detach())
    assert torch.equal(*runs)


def test_expert_statistics_stay_on_the_device_on_fake_cuda():
    """The CUDA path without a GPU (``tests/fake_cuda.py``): the hook's sums and counts,
    every stacked state (``expert_tokens`` included) and the refresh stay on the stack's
    device (a CPU tensor mixed in raises there), the counters on the host; the twin of the
    result equals the CPU run. The forward runs without autograd (the fake mode's limit):
    gradients are drawn on the CPU and copied over."""
    from fake_cuda import FakeCuda, twin

    def run(device: str) -> torch.Tensor:
        model = Experts(*(w.to(device) for w in weights()))
        params = [{"params": [("w1", model.w1), ("w2", model.w2)]}]
        same = {"basis_method": "cholqr", "foreach": True}  # "auto" and None pick by device
        opt = Dobb(params, lr=0.01, basis_interval=2, **same)
        opt.track(model)
        for step, counts in enumerate([[4, 3, 5], [6, 0, 6], [2, 7, 3]]):
            x, n, _ = batch(step, counts)
            for p in model.parameters():
                p.requires_grad_(False)
            with torch.enable_grad():
                model(x.to(device), n.to(device))
            g = torch.Generator().manual_seed(step)
            for p in model.parameters():
                p.requires_grad_(True)
                p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype).to(device)
            opt.step()
        devices = {key: value.device.type for key, value in opt.state[model.w1].items()}
        stats = opt.statistics.expert_statistics()[0][1]
        devices |= {"sums": stats.sums[0].device.type, "tokens": stats.tokens.device.type}
        assert {d for k, d in devices.items() if k not in COUNTERS} == {device[:4]}, devices
        assert {d for k, d in devices.items() if k in COUNTERS} == {"cpu"}, devices
        return model.w1.detach()

    cpu = run("cpu")
    with FakeCuda():
        on_device = twin(run("cuda:0"))
    assert torch.equal(on_device, cpu)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_layer_called_on_no_token_keeps_its_statistics_like_an_idle_expert(name):
    """An ``nn.Linear`` whose forward pass gets 0 rows follows the idle expert's rule: its
    ``C`` (every side's) and its statistics counter stay, and the next step with tokens
    folds its inputs as if that step had not been (the row side's output gradients depend
    on the weights, which the idle step moved by its momentum); before this rule, ``C``
    decayed toward 0 and the counter advanced."""
    torch.manual_seed(0)
    layers = [nn.Linear(DIM, HIDDEN, bias=False, dtype=torch.float64) for _ in range(2)]
    opts = []
    for layer in layers:
        layer.weight.data.copy_(layers[0].weight.data)
        opts.append(Dobb([layer.weight], lr=0.01, **CONFIGS[name]))
        opts[-1].track(layer)

    def step(layer, opt, rows: int, seed: int) -> None:
        x = torch.randn(
            rows, DIM, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
        )
        opt.zero_grad()
        layer(x).square().sum().backward()
        opt.step()

    for layer, opt in zip(layers, opts):
        step(layer, opt, 5, 1)
    state = opts[0].state[layers[0].weight]
    kept = {k: v.clone() for k, v in state.items() if "_cov" in k or k == "stats_steps"}
    assert kept["stats_steps"] == 1
    step(layers[0], opts[0], 0, 2)  # no token: a step on a zero gradient, no statistics
    for key, value in kept.items():
        assert torch.equal(state[key], value), key
    step(layers[0], opts[0], 5, 3)
    step(layers[1], opts[1], 5, 3)
    other = opts[1].state[layers[1].weight]
    for key in (k for k in kept if not k.startswith("row_")):
        assert torch.allclose(state[key], other[key], rtol=1e-12, atol=0), key
