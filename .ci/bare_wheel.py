"""The wheel without extras (torch alone), run by .ci/install_check in its fresh virtualenv.

    venv/bin/python .ci/bare_wheel.py

Checks that numpy, pyyaml and tqdm are not installed (so nothing below can use them), that
``dobb.__version__`` is the installed distribution's version, that the wheel holds the library
alone (modules under ``dobb/``, the harness's run configs, its metadata and the ``dobb``
script: no study config, nothing of the lab), and that every registry optimizer builds on a
small model with an embedding and a head, steps, reloads its ``state_dict`` and steps again,
leaving every parameter changed and finite.
"""

import importlib.metadata
import importlib.util
import sys

import torch
from torch import nn

import dobb
from dobb import OPTIMIZERS, build_optimizer

TRAIN_EXTRA = ("numpy", "yaml", "tqdm")
present = [name for name in TRAIN_EXTRA if importlib.util.find_spec(name) is not None]
assert not present, f"{present} installed: this check wants the wheel without extras"
assert dobb.__version__ == importlib.metadata.version("dobb"), dobb.__version__

files = [str(f) for f in importlib.metadata.files("dobb")]
stray = [
    f
    for f in files
    if not (
        (f.startswith("dobb/") and f.endswith(".py"))
        or (f.startswith("dobb/configs/") and f.count("/") == 2 and f.endswith(".yaml"))
        or f.startswith(f"dobb-{dobb.__version__}.dist-info/")
        or f.endswith("bin/dobb")
        or "__pycache__" in f
    )
]
assert not stray, f"the wheel holds more than the library: {stray}"


class Tiny(nn.Module):
    """Embedding, two hidden matrices, head: the shapes `param_groups` routes by name."""

    def __init__(self, vocab: int = 32, width: int = 64):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.fc = nn.Linear(width, 2 * width)
        self.proj = nn.Linear(2 * width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        return self.head(x + self.proj(torch.relu(self.fc(x))))


def steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        idx = torch.randint(0, 32, (4, 16))
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.roll(1, 1).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


for name in OPTIMIZERS:
    torch.manual_seed(0)
    model = Tiny()
    opt = build_optimizer(name, model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps(model, opt, 1)
    opt.load_state_dict(opt.state_dict())
    steps(model, opt, 1)
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all() and not torch.equal(p, before[n]), (name, n)

loaded = sorted(m for m in sys.modules if m.split(".")[0] in (*TRAIN_EXTRA, "bench"))
assert not loaded, f"loaded {loaded}"
print(
    f"bare wheel: dobb {dobb.__version__} with torch {torch.__version__} alone (no numpy, "
    f"pyyaml, tqdm): {len(OPTIMIZERS)} optimizers built, stepped and reloaded"
)
