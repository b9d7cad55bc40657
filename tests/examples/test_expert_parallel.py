"""examples/expert_parallel.py: Dobb on ``Shard(0)`` expert stacks, tokens dispatched by
``all_to_all_single``, on 2 gloo ranks, against one process that runs every rank's tokens
through the whole stacks in the same order."""

import sys
from pathlib import Path

import torch
from multirank import run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import expert_parallel as ep  # noqa: E402

import dobb  # noqa: E402

STEPS = 6


def on_ranks(rank: int, world: int):
    return ep.train(STEPS)


def one_process(world: int) -> tuple[list[float], torch.Tensor, torch.Tensor]:
    """The example's training in one process: each step, every rank's rows in rank order,
    sorted by expert (the order a rank's dispatch delivers each expert's rows in)."""
    torch.manual_seed(0)
    model = ep.GroupedExperts(ep.EXPERTS, ep.DIM, ep.HIDDEN)
    params = [("w1", model.w1), ("w2", model.w2)]
    opt = dobb.Dobb([{"params": params}], lr=dobb.recommended_lr("dobb", width=ep.DIM))
    opt.track(model)
    losses = []
    for step in range(STEPS):
        x, expert, target = (torch.cat(t) for t in zip(*(ep.tokens(step, r) for r in range(world))))
        rows, counts, targets = ep.by_expert(x, target, expert, ep.EXPERTS)
        loss = ep.loss_of(model, rows, counts, targets, world)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, model.w1.detach(), model.w2.detach()


def test_expert_parallel_training_equals_one_process():
    ranks = run_ranks(on_ranks, 2, timeout=120)
    losses, w1, w2 = one_process(2)
    for got_losses, got_w1, got_w2 in ranks:
        # fp32: the same products in the same order; the tolerance is for the reduction
        # orders of the losses' sums and of the ranks' bincounts and sorts, not bitwise
        assert torch.allclose(torch.tensor(got_losses), torch.tensor(losses), rtol=1e-5)
        assert torch.allclose(got_w1, w1, rtol=1e-5, atol=1e-6)
        assert torch.allclose(got_w2, w2, rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0]  # it trains
    torch.manual_seed(0)
    start = ep.GroupedExperts(ep.EXPERTS, ep.DIM, ep.HIDDEN)
    assert (start.w1 - w1).abs().max() > 1e-3  # the stacks moved
