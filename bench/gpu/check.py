"""The checks of ``benchmarks/gpu_check.sh``: what a GPU must show that the CPU cannot.

    python -m bench.gpu.check correctness --device cuda --out correctness.json
    python -m bench.gpu.check captured --device cuda --out captured.json
    python -m bench.gpu.check compiled --device cuda --out compiled.json [--backend inductor]
    python -m bench.gpu.check merge gpu_check.json correctness.json captured.json ...

- ``correctness``: every registry optimizer trains a small GPT for ``--steps`` steps (two
  of Dobb's refreshes) on the device and on the CPU from the same seed and batches; the
  largest parameter and loss differences go to the JSON. Dobb's entries run
  ``basis_method="cholqr"`` on both (``"auto"`` is ``eigh`` on the CPU), so the two runs do
  the same arithmetic; the other optimizers compare their batched CUDA step with the
  per-matrix CPU one.
- ``captured``: Dobb with ``capturable=True, nonfinite="skip"``: a whole training step
  (forward, backward, ``opt.step()``) captured twice as CUDA graphs, a steady and a refresh
  step, replayed as ``opt.refresh_due()`` says (docs/gpu.md's loop), against the same
  training run eagerly: losses and parameters, and each graph's replay time beside its
  eager step.
- ``compiled``: a small GPT tracked by Dobb compiled whole with ``torch.compile``: graph
  breaks and graphs compiled after the first step and at the end (Dynamo's counters),
  losses against eager training, and the statistics hooks' share of a compiled
  forward+backward (tracked against untracked, same weights).

Every command writes its JSON after each row or measurement (a timeout leaves what
finished) and records an error instead of stopping. With ``--device cpu`` the same code
runs on tiny shapes (the smoke test): no CUDA graph exists there, so a "replay" is the
eager step (``Replay``).
"""

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from dobb.optim.dobb import Dobb
from dobb.registry import OPTIMIZERS, build_optimizer, get_entry
from dobb.train.model import GPT, gpt_config

SHAPES = {  # (layers, width, heads, sequence, batch) of the small GPT
    "cuda": (2, 256, 4, 128, 8),
    "cpu": (1, 32, 2, 16, 2),
}


class Record:
    """A JSON object written to ``path`` on every ``save``."""

    def __init__(self, path: Path, **meta):
        self.path, self.data = Path(path), {"meta": meta}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")


def error_of(exc: BaseException) -> str:
    """One line naming an exception, then its innermost frame."""
    last = traceback.extract_tb(exc.__traceback__)[-1:] or [None]
    where = f" ({last[0].filename}:{last[0].lineno})" if last[0] else ""
    return f"{type(exc).__name__}: {exc}{where}"


def small_gpt(device: torch.device, seed: int = 0) -> GPT:
    """The small GPT of ``SHAPES`` for ``device``, initialised from ``seed``."""
    layers, width, heads, seq, _ = SHAPES[device.type]
    torch.manual_seed(seed)
    cfg = gpt_config("tiny", n_layer=layers, n_embd=width, n_head=heads, block_size=seq)
    return GPT(cfg).to(device)


def batches(device: torch.device, steps: int) -> list[torch.Tensor]:
    """``steps`` token batches of ``(batch, sequence + 1)``, the same on every device."""
    _, _, _, seq, batch = SHAPES[device.type]
    gen = torch.Generator().manual_seed(1234)
    vocab = gpt_config("tiny").vocab_size
    return [torch.randint(0, vocab, (batch, seq + 1), generator=gen) for _ in range(steps)]


def sync(device: torch.device) -> None:
    """Wait for ``device``'s work (all of its streams) to finish."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, the device synchronised around each."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest absolute elementwise difference between two lists of tensors (on the CPU)."""
    return max(float((x.detach().cpu() - y.detach().cpu()).abs().max()) for x, y in zip(a, b))


def train(model, opt, tokens, device) -> list[float]:
    """One training step per batch of ``tokens`` (on ``device``); the losses."""
    losses = []
    for batch in tokens:
        batch = batch.to(device)
        opt.zero_grad(set_to_none=True)
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


# ------------------------------------------------------------------------ correctness
def compare_on_devices(name: str, device: torch.device, steps: int) -> dict:
    """Optimizer ``name`` trained on ``device`` and on the CPU from the same start."""
    overrides = {"basis_method": "cholqr"} if get_entry(name).cls is Dobb else {}
    runs = {}
    for where in (torch.device("cpu"), device):
        model = small_gpt(device).to(where)  # the device's shapes on both
        opt = build_optimizer(name, model, **overrides)
        losses = train(model, opt, batches(device, steps), where)
        runs[where.type] = (losses, [p.detach().cpu() for p in model.parameters()])
    (cpu_loss, cpu_params), (dev_loss, dev_params) = runs["cpu"], runs[device.type]
    return {
        "options": overrides,
        "max_param_diff": max_difference(cpu_params, dev_params),
        "max_param": max(float(p.abs().max()) for p in cpu_params),
        "max_loss_diff": max(abs(a - b) for a, b in zip(cpu_loss, dev_loss)),
        "losses_cpu": cpu_loss,
        f"losses_{device.type}": dev_loss,
    }


def correctness(device: torch.device, out: Path, steps: int, names: list[str]) -> Record:
    record = Record(out, device=str(device), steps=steps, shapes=SHAPES[device.type])
    record.data["optimizers"] = rows = {}
    for name in names:
        try:
            rows[name] = compare_on_devices(name, device, steps)
        except Exception as exc:  # a failing optimizer costs its row, not the phase
            rows[name] = {"error": error_of(exc)}
        print(name, json.dumps(rows[name])[:300], flush=True)
        record.save()
    return record


# ------------------------------------------------------------------------ captured
class Replay:
    """A training step as a CUDA graph: capturing records it (running nothing), then one
    replay runs it; later ``replay(opt)`` calls replay and advance the optimizer's host-side
    schedule (``opt.count_replay()``). On the CPU the eager step stands in (smoke test)."""

    def __init__(self, step: Callable[[], torch.Tensor], device: torch.device):
        self.step, self.graph = step, None
        if device.type == "cuda":
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.loss = step()
            self.graph.replay()
        else:
            self.loss = step()

    def replay(self, opt) -> torch.Tensor:
        if self.graph is None:
            self.loss = self.step()  # the eager step counts itself
        else:
            self.graph.replay()
            opt.count_replay()
        return self.loss


def capturable_run(device: torch.device, basis_interval: int):
    """A small GPT, its capturable Dobb and a whole training step on static buffers."""
    model = small_gpt(device)
    opt = build_optimizer(
        "dobb", model, capturable=True, nonfinite="skip", basis_interval=basis_interval
    )
    static = batches(device, 1)[0].to(device)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        _, loss = model(static[:, :-1], static[:, 1:])
        loss.backward()
        opt.step()
        return loss.detach()

    return model, opt, static, step


def on_side_stream(step: Callable[[], torch.Tensor], side) -> torch.Tensor:
    """``step()`` on CUDA stream ``side`` (None: where it is), ordered after the current
    stream's work and before its next (PyTorch's warm-up before a capture)."""
    if side is None:
        return step()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        loss = step()
    torch.cuda.current_stream().wait_stream(side)
    return loss


def captured(device: torch.device, out: Path, steps: int, repeats: int = 20) -> Record:
    """Eager and graph-replayed training of the same capturable Dobb (see module). The first
    ``interval + 1`` steps run eagerly on a side stream (the cold refresh at step 1, a warm
    one at step ``interval + 1``: every code path runs once before it is captured); the
    steady graph is captured at the next step, the refresh graph at the next refresh."""
    interval = 3
    warmup = interval + 1
    record = Record(out, device=str(device), steps=steps, basis_interval=interval)
    tokens = batches(device, steps)
    eager_model, eager_opt, eager_in, eager_step = capturable_run(device, interval)
    model, opt, static, step = capturable_run(device, interval)
    side = torch.cuda.Stream() if device.type == "cuda" else None
    losses, eager_losses, graphs = [], [], {}
    for i, batch in enumerate(tokens):
        eager_in.copy_(batch)
        eager_losses.append(float(eager_step()))
        static.copy_(batch)
        due = opt.refresh_due()
        if i < warmup:
            loss = on_side_stream(step, side)
        elif due not in graphs:
            graphs[due] = Replay(step, device)
            loss = graphs[due].loss
        else:
            loss = graphs[due].replay(opt)
        losses.append(float(loss))
    params, eager_params = list(model.parameters()), list(eager_model.parameters())
    record.data.update(
        graphs={"refresh" if due else "steady": True for due in graphs},
        losses=losses,
        eager_losses=eager_losses,
        max_loss_diff=max(abs(a - b) for a, b in zip(losses, eager_losses)),
        max_param_diff=max_difference(params, eager_params),
    )
    record.save()
    record.data["timing"] = time_replays(graphs, opt, eager_step, eager_opt, device, repeats)
    record.save()
    return record


def time_replays(graphs: dict, opt, eager_step, eager_opt, device, repeats: int = 20) -> dict:
    """Median seconds of each captured step's replay and of the eager step of its kind."""
    timing = {}
    for due, graph in graphs.items():
        kind = "refresh" if due else "steady"
        timing[f"{kind}_replay_s"] = median_s(lambda g=graph: g.replay(opt), device, repeats)
    steady, refresh = [], []
    for _ in range(repeats):
        due = eager_opt.refresh_due()
        (refresh if due else steady).append(median_s(eager_step, device, 1))
    timing["steady_eager_s"] = statistics.median(steady) if steady else None
    timing["refresh_eager_s"] = statistics.median(refresh) if refresh else None
    return timing


# ------------------------------------------------------------------------ compiled
def compiled(device: torch.device, out: Path, steps: int, backend: str) -> Record:
    """A tracked small GPT compiled whole: breaks, graphs, losses and the hooks' share."""
    from torch._dynamo.utils import counters

    record = Record(out, device=str(device), steps=steps, backend=backend)
    tokens = batches(device, steps)
    eager_model = small_gpt(device)
    eager_losses = train(eager_model, build_optimizer("dobb", eager_model), tokens, device)
    torch._dynamo.reset()
    counters.clear()
    model = small_gpt(device)
    opt = build_optimizer("dobb", model)  # tracks the model's Linear layers
    run = torch.compile(model, backend=backend)
    losses, graphs = [], []
    for batch in tokens:
        losses += train(run, opt, [batch], device)
        graphs.append(counters["stats"]["unique_graphs"])
    record.data.update(
        graph_breaks=sum(counters["graph_break"].values()),
        break_reasons=dict(counters["graph_break"]),
        graphs_after_first_step=graphs[0],
        graphs_at_end=graphs[-1],
        losses=losses,
        eager_losses=eager_losses,
        max_loss_diff=max(abs(a - b) for a, b in zip(losses, eager_losses)),
    )
    record.save()
    record.data["hooks"] = hooks_share(model, run, tokens[0].to(device), device, backend)
    record.save()
    return record


def hooks_share(model, run, batch, device, backend: str, repeats: int = 10) -> dict:
    """Compiled forward+backward seconds with Dobb's hooks (``run``, ``model`` compiled) and
    of an untracked model with the same weights compiled alike; the share of the tracked
    time the hooks add."""
    untracked = small_gpt(device)
    untracked.load_state_dict(model.state_dict())
    bare = torch.compile(untracked, backend=backend)

    def fwd_bwd(m):
        _, loss = m(batch[:, :-1], batch[:, 1:])
        loss.backward()

    for m in (run, bare):  # compile and warm
        fwd_bwd(m)
    with_hooks = median_s(lambda: fwd_bwd(run), device, repeats)
    without = median_s(lambda: fwd_bwd(bare), device, repeats)
    return {
        "forward_backward_s": without,
        "forward_backward_hooks_s": with_hooks,
        "share": (with_hooks - without) / with_hooks,
    }


# ------------------------------------------------------------------------ command line
def merge(out: Path, parts: list[Path]) -> None:
    """One JSON ``{"checks": {part's stem: its record}}`` from the checks' files, which are
    deleted (the device returns few files); a missing part is named in ``"missing"``."""
    merged = {"checks": {}, "missing": []}
    for part in parts:
        if part.exists():
            merged["checks"][part.stem] = json.loads(part.read_text())
            part.unlink()
        else:
            merged["missing"].append(part.stem)
    out.write_text(json.dumps(merged, indent=1) + "\n")


def main(argv: list[str]) -> None:
    if argv and argv[0] == "merge":  # merge OUT PART...
        merge(Path(argv[1]), [Path(p) for p in argv[2:]])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=("correctness", "captured", "compiled"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12, help="training steps (2 refreshes)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="correctness")
    parser.add_argument("--backend", default="inductor", help="compiled: torch.compile backend")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible to torch")
    try:
        if args.check == "correctness":
            correctness(device, args.out, args.steps, args.optimizers.split(","))
        elif args.check == "captured":
            captured(device, args.out, args.steps)
        else:
            compiled(device, args.out, args.steps, args.backend)
    except Exception as exc:  # the phase's error beside what it wrote
        record = json.loads(args.out.read_text()) if args.out.exists() else {}
        record["error"] = error_of(exc)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(record["error"], file=sys.stderr)
        raise SystemExit(1) from exc


if __name__ == "__main__":
    main(sys.argv[1:])
