"""One torchtitan rank on CPU running several training jobs in turn (one import, one
process group): the shim (``torchtitan_cpu``), then for each job torchtitan's own config
parsing, ``Trainer`` build, ``train()`` and ``close()``, as ``torchtitan.train`` does.

Run under ``torchrun``: ``torchtitan_rank.py JOBS.json``, where the file holds a list of
argument lists, each as for ``python -m torchtitan.train`` (``--module ... --config ...``).

Each rank writes ``record-rank{r}.json`` into each job's dump folder: the job's losses by
step (torchtitan's global average, as its metrics log them; -1 or -2 on ranks without the
last pipeline stage) and gradient norms by step (before clipping), its model parts and
optimizers on this rank (one each, or one per local pipeline stage), and what Dynamo did in
that job (graph breaks by reason, frames compiled); Dynamo's caches and counters are reset
between jobs, so a compiled job's numbers are its own.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from torchtitan_cpu import install  # noqa: E402

install()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402


def record_steps(trainer) -> dict[str, dict[int, float]]:
    """``{"losses": ..., "grad_norms": ...}`` by step, filled as
    ``trainer.metrics_processor.log(step, loss, max_loss, grad_norm, ...)`` runs:
    torchtitan's global average loss, and the norm of the whole gradient before clipping
    (``titan_continuation``'s loss check)."""
    steps, log = {"losses": {}, "grad_norms": {}}, trainer.metrics_processor.log

    def logged(step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
        steps["losses"][step], steps["grad_norms"][step] = global_avg_loss, grad_norm
        return log(step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

    trainer.metrics_processor.log = logged
    return steps


def write_record(config, trainer, steps: dict[str, dict[int, float]]) -> None:
    counters = torch._dynamo.utils.counters
    record = {
        **steps,
        "model_parts": len(trainer.model_parts),
        "optimizers": len(trainer.optimizers.optimizers),
        "graph_breaks": dict(counters["graph_break"]),
        "frames_compiled": counters["stats"]["unique_graphs"],
    }
    rank = dist.get_rank() if dist.is_initialized() else 0
    folder = Path(config.dump_folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"record-rank{rank}.json").write_text(json.dumps(record))


def main(jobs_file: str) -> None:
    init_logger()
    for args in json.loads(Path(jobs_file).read_text()):
        torch._dynamo.reset()  # Dynamo's caches
        torch._dynamo.utils.counters.clear()
        config = ConfigManager().parse_args(args)
        trainer = config.build()
        steps = record_steps(trainer)
        try:
            trainer.train()
        finally:
            trainer.close()
        write_record(config, trainer, steps)
        del trainer
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
