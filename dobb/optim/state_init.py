"""Recognise the step ``torch.distributed.checkpoint.state_dict`` takes to build state.

``get_optimizer_state_dict`` (and ``get_state_dict``) on an optimizer with no state calls
``_init_optim_state``: it sets every gradient to zeros, every ``lr`` to 0, and calls
``step()``. No parameter moves, but a full step would count it: Dobb's first basis
refresh, MuonBP's period, Dion's sketch seeds and AdamW's bias correction would all run one
step late, so a run checkpointed before its first step would train differently from one
that was not. dobb's optimizers build their state on that step and count nothing.

torch's AdamW counts that step (``state["step"]`` becomes 1, its moments stay 0), so the
first real step runs with bias corrections ``1 - beta^2`` instead of ``1 - beta``. Here
(``AdamW``) that step runs as torch runs it (``lr`` 0 and zero gradients leave the moments
and the parameters exactly unchanged), and the counters go back to 0; every other step is
torch's, untouched.

Checked on the host first; the gradients are read (one read) only on that rare path.
Every rank decides alike: DCP zeroes every gradient on every rank, and an empty FSDP shard
counts as zeros.
"""

import torch

from dobb._dtensor import local


def is_state_init_step(optimizer: torch.optim.Optimizer) -> bool:
    """True if ``optimizer.step()`` now would be DCP's state-initialising step: no state
    yet, every ``lr`` 0, at least one gradient, and every gradient all zeros.

    Host checks first; the gradients are read (once) only then. Every rank decides alike.
    """
    if any(optimizer.state.values()) or any(g["lr"] != 0 for g in optimizer.param_groups):
        return False
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return False
    nonzero = [local(t).any() for t in grads if t.numel()]
    return not nonzero or not bool(torch.stack(nonzero).any())


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW``, except that DCP's state-initialising step counts no step.

    torch's counts it (``state["step"]`` 1: the first real step's bias corrections would be
    ``1 - beta^2``); here the counters go back to 0, every other step is torch's.
    """

    def load_state_dict(self, state_dict):
        """torch's, refusing a matrix optimizer's state: built by ``build_optimizer``, AdamW
        has the same two groups as Dion or Dobb, which torch alone would accept."""
        saved = [g["algorithm"] for g in state_dict["param_groups"] if "algorithm" in g]
        if saved:
            raise ValueError(
                f"AdamW cannot load this state: it was saved by an optimizer with parameter "
                f"groups {saved}; load it into the optimizer that saved it, or start afresh"
            )
        super().load_state_dict(state_dict)

    def step(self, closure=None):
        init = closure is None and is_state_init_step(self)
        loss = super().step(closure)
        if init:
            for state in self.state.values():
                state["step"].zero_()  # the state a fresh AdamW has before its first step
        return loss
