"""Count what one optimizer step dispatches: aten ops and device-to-host reads.

Speed targets live here, not in timed tests: a GPU step costs about one kernel launch per
dispatched op, and a host read stalls the device queue. A host read is an
``aten._local_scalar_dense`` event of the profiler (``.item()``, ``bool(t)``, ``int(t)``, and
the error-flag checks inside ``torch.linalg`` kernels, which a dispatch mode does not see:
``bench.tools.opcount.OpCounter``); reading CPU step counters with ``tolist()`` dispatches
nothing, so on CPU every counted read is one that would also stall a GPU.
"""

import torch

from bench.tools.opcount import OpCounter
from dobb.registry import build_optimizer
from dobb.train.model import GPT, gpt_config


def tiny_gpt(n_layer: int, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(gpt_config("tiny", n_layer=n_layer, n_embd=32, n_head=2, block_size=16))


def count_steps(
    name: str, n_layer: int, *, steps: int = 1, warmup_steps: int = 2, model=None, **overrides
) -> list[OpCounter]:
    """Ops of each of ``steps`` steps after ``warmup_steps`` steps of optimizer ``name`` on a
    tiny GPT of ``n_layer`` layers, or on ``model`` (``overrides``: constructor arguments,
    e.g. ``scalar_algorithm="lion"``)."""
    model = model or tiny_gpt(n_layer)
    opt = build_optimizer(name, model, **overrides)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    counters = []
    for step in range(warmup_steps + steps):
        opt.zero_grad(set_to_none=True)
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        if step < warmup_steps:
            opt.step()
            continue
        with OpCounter() as counter:
            opt.step()
        counters.append(counter)
    return counters


def count_step(name: str, n_layer: int, *, warmup_steps: int = 2, **overrides) -> OpCounter:
    """Ops of the step after ``warmup_steps`` steps of optimizer ``name`` on a tiny GPT."""
    return count_steps(name, n_layer, warmup_steps=warmup_steps, **overrides)[0]
