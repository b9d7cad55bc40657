"""The loop people write: Karpathy's nanoGPT ``train.py`` (its model layout, here
``dobb.train.model.GPT``: q/k/v, proj, fc, proj, tied head), under DDP on 2 gloo ranks with
``torch.compile`` on, saving on rank 0 only, with the recommended Dobb.

(a) A rank-0-only ``torch.save(opt.state_dict())`` neither crashes nor hangs (it did: the
default synchronized the statistics in ``state_dict()``, a collective rank 1 never joined),
and both ranks resumed from that one file end bit for bit where the uninterrupted run ends.
(b) ``stats_group`` left unset is refused at the first step, naming the fix (the ranks'
parameters used to drift apart silently). (c) A second compiled instance of the tracked
model's class, whose reused graph has no hooks, fails with the cause and the fix.

Compiled with ``backend="eager"``: what the loop depends on is Dynamo's tracing (the hooks
in the graph, the graph reused between instances); inductor's code generation would add
about 30 s of CPU per rank and nothing these checks need. Each rank function starts with
``torch._dynamo.reset()``, as a new process would (the test's ranks are pooled).
"""

import pytest
import torch
import torch.distributed as dist
from multirank import run_ranks
from torch.nn.parallel import DistributedDataParallel

import dobb
from dobb.train.model import GPT, gpt_config

STEPS, SAVE_AT = 6, 3  # nanoGPT saves after an evaluation; here after step 3
CONFIG = dict(n_layer=2, n_embd=32, n_head=4, block_size=16)


def batch(step: int, rank: int):
    """Rank ``rank``'s batch at ``step`` (nanoGPT: a seed offset per rank)."""
    gen = torch.Generator().manual_seed(1337 + 100 * step + rank)
    tokens = torch.randint(0, 256, (4, CONFIG["block_size"] + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def build(stats_group):
    """nanoGPT's order: the model, its optimizer (tracked), ``torch.compile``, then DDP."""
    torch.manual_seed(1337)  # the same initialization on every rank
    raw = GPT(gpt_config("tiny", **CONFIG))
    opt = dobb.Dobb(dobb.param_groups(raw), stats_group=stats_group)
    opt.track(raw)
    model = DistributedDataParallel(torch.compile(raw, backend="eager"))
    return raw, model, opt


def train(raw, model, opt, steps, rank, save=None):
    for step in steps:
        x, y = batch(step, rank)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if save is not None and step == SAVE_AT and rank == 0:  # master_process only
            torch.save({"model": raw.state_dict(), "optimizer": opt.state_dict()}, save)


def save_on_rank_0_and_resume(rank, world, path):
    """The uninterrupted run (saving on rank 0 at ``SAVE_AT``), and the run resumed on
    both ranks from that file: their final parameters, and rank 1's of the first run."""
    torch._dynamo.reset()
    raw, model, opt = build(dist.group.WORLD)
    train(raw, model, opt, range(STEPS), rank, save=path)
    dist.barrier()
    straight = [p.detach().clone() for p in raw.parameters()]
    torch._dynamo.reset()  # a resumed run is a new process
    raw, model, opt = build(dist.group.WORLD)
    saved = torch.load(path, weights_only=False)
    raw.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    train(raw, model, opt, range(SAVE_AT + 1, STEPS), rank)
    return straight, [p.detach().clone() for p in raw.parameters()]


def test_a_rank_0_save_neither_hangs_and_resumes_exactly(tmp_path):
    results = run_ranks(save_on_rank_0_and_resume, 2, str(tmp_path / "ckpt.pt"), timeout=300)
    (straight_0, resumed_0), (straight_1, resumed_1) = results
    for a, b, c in zip(straight_0, straight_1, resumed_0):
        assert torch.equal(a, b)  # the replicas agree
        assert torch.equal(a, c)  # the resumed run ends where the uninterrupted one does
    assert all(torch.equal(a, b) for a, b in zip(resumed_0, resumed_1))


def without_stats_group(rank, world):
    """The message of the first step without ``stats_group`` (None if none raised), and the
    ranks' parameters after it (unchanged if refused)."""
    torch._dynamo.reset()
    raw, model, opt = build(None)
    before = [p.detach().clone() for p in raw.parameters()]
    try:
        train(raw, model, opt, range(1), rank)
    except RuntimeError as error:
        return str(error), all(torch.equal(a, b) for a, b in zip(before, raw.parameters()))
    return None, False


def test_no_stats_group_under_ddp_is_refused_with_the_fix():
    for message, unchanged in run_ranks(without_stats_group, 2, timeout=300):
        assert message is not None and "stats_group" in message and "drift" in message
        assert "dist.group.WORLD" in message
        assert unchanged  # refused before anything changed


def second_instance(rank, world):
    """A model of the same class compiled first (an evaluation copy, no hooks), then the
    tracked one: the message of its first step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    other = torch.compile(GPT(gpt_config("tiny", **CONFIG)), backend="eager")
    x, y = batch(0, rank)
    other(x, y)
    raw, model, opt = build(dist.group.WORLD)
    try:
        train(raw, model, opt, range(1), rank)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.timeout(600)
def test_a_second_compiled_instance_names_the_cause_and_the_fix():
    for message in run_ranks(second_instance, 2, timeout=300):
        assert message is not None, "the step ran without the tracked model's statistics"
        assert "torch.compile reused a graph" in message
        assert "torch._dynamo.reset()" in message
