"""The model, optimizer and batches of ``dobb_legacy_checkpoint.pt``: a Dobb checkpoint in
the state keys Dobb wrote before its keys named a side and a stack index (``cov``,
``basis``, ``cov_tail``, ``basis_tail``, ``row_cov``, ``row_basis``, ``row_cov_tail``,
``row_basis_tail``), which ``tests/test_dobb_checkpoint_keys.py`` loads.

The file was written by ``python tests/data/dobb_legacy_checkpoint.py`` at commit d368fca
(the last commit with those keys): ``STEPS`` steps on ``batches()``, then ``state_dict()``
of the model and the optimizer and the ``MORE`` next batches, then those ``MORE`` steps,
whose parameters after each step were saved too (``"expected"``; the second step is a
basis refresh). Running it again with a later commit would write that commit's keys: the
file is not to be remade.

The test reads the file for its keys and shapes and for its starting state (model,
optimizer state, next batches), never for ``"expected"``: those floats were computed on the
machine that wrote the file, and another CPU kind rounds matrix products differently
(AVX2 and AVX-512 kernels), which Dobb's sign amplifies to whole steps of a weight. The
test recomputes the continuation from the saved state on the machine running it.

Every matrix has ragged blocks, so every tail key is present: ``fc1`` one-sided (10 input
columns in blocks 4, 3, 3), ``fc2`` two-sided with Adam coefficients and row moments from
the gradients (7 columns: 4, 3; 10 rows: 4, 3, 3), ``fc3`` two-sided with row moments
from the output gradients (10 columns: 3, 3, 2, 2; 5 rows: 3, 2); biases on AdamW.
"""

import copy
from pathlib import Path

import torch
from torch import nn

import dobb

PATH = Path(__file__).with_suffix(".pt")
STEPS, MORE = 3, 2  # steps before the checkpoint; steps after it (the second refreshes)


def build() -> tuple[nn.Sequential, dobb.Dobb]:
    """The model (seeded) and its Dobb optimizer, tracked."""
    torch.manual_seed(0)
    layers = nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 10), nn.Tanh(), nn.Linear(10, 5)
    model = nn.Sequential(*layers)
    fc1, fc2, fc3 = model[0], model[2], model[4]
    groups = [
        {"params": [fc1.weight], "num_blocks": 3},
        {
            "params": [fc2.weight],
            "num_blocks": 2,
            "two_sided": True,
            "row_blocks": 3,
            "coefficients": "adam",
            "update_scale": 1.0,
        },
        {
            "params": [fc3.weight],
            "num_blocks": 4,
            "two_sided": True,
            "row_blocks": 2,
            "row_stats": "outputs",
        },
        # the bias group took the optimizer's lr then (0.02): set now, as the scalar lr is its own
        {"params": [fc1.bias, fc2.bias, fc3.bias], "algorithm": "adamw", "lr": 0.02},
    ]
    # the defaults of the commit that wrote the file (fc1 one-sided with the sign); fc2 and
    # fc3 set what differs
    paper = dict(two_sided=False, coefficients="sign", update_scale=0.2, stats_sync="refresh")
    opt = dobb.Dobb(groups, lr=0.02, basis_interval=2, **paper)
    opt.track(model)
    return model, opt


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (input, target) pairs of 8 rows."""
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 10, generator=gen), torch.randn(8, 5, generator=gen)) for _ in range(n)]


def train(model: nn.Module, opt: dobb.Dobb, data) -> None:
    """One optimizer step per (input, target) pair of ``data`` (mean squared error)."""
    for x, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def main() -> None:
    model, opt = build()
    data = batches(STEPS + MORE)
    train(model, opt, data[:STEPS])
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict(), "batches": data[STEPS:]}
    saved = copy.deepcopy(saved)  # state_dict()s hold the live tensors, which train on
    expected = []
    for batch in data[STEPS:]:
        train(model, opt, [batch])
        expected.append({k: v.clone() for k, v in model.state_dict().items()})
    torch.save({**saved, "expected": expected}, PATH)


if __name__ == "__main__":
    main()
