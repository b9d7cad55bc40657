"""One torchtitan rank of the resharding tests: ``torchtitan_rank.py``'s jobs, plus what a
resume onto another world size needs to be checked.

Run under ``torchrun``: ``torchtitan_reshard_rank.py JOBS.json``, where the file holds a
list of ``{"args": [...], "refused": bool}``; ``args`` as for ``python -m torchtitan.train``.

- A job that starts from ``--checkpoint.initial_load_path`` saves, right after the load and
  before its first step, the state it loaded as its own ``checkpoint/step-{step}`` (DCP,
  at this world size): the test compares it with the checkpoint it came from.
- Every job starts from the same weights on any number of ranks (``same_start``).
- Each rank writes ``record-rank{r}.json`` into the job's dump folder: the losses and the
  gradient norms by step (``torchtitan_rank.record_steps``).
- A ``refused`` job must fail while loading (DCP's ``CheckpointException``): each rank
  writes the error into ``refused-rank{r}.txt`` in the dump folder and goes on to the
  next job (the failure is collective, so the ranks stay in step); a refused job that
  loads raises.
"""

import json
import sys
import time
import traceback
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from torchtitan_cpu import install  # noqa: E402

install()  # before torchtitan's modules are imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torchtitan.trainer as trainer_module  # noqa: E402
import torchtitan_rank  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402
from torchtitan.components.checkpointer.dcp import CheckpointManager  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.tools import filesystem  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402


def save_after_initial_load() -> None:
    """``CheckpointManager._load`` followed, for a job's initial load from another job's
    checkpoint, by a save of the loaded state under the loaded step."""
    load = CheckpointManager._load

    def _load(self, step: int = -1) -> bool:
        initial = bool(self.initial_load_path) and not filesystem.exists(self.folder)
        loaded = load(self, step)
        if loaded and initial and not self.initial_load_model_only:
            self._save(self.states["train_state"].step)
        return loaded

    CheckpointManager._load = _load


def same_start(trainer, seed: int = 0) -> None:
    """Load into the (sharded) model the weights of one unsharded model initialised with
    torchtitan's own ``init_weights`` after ``torch.manual_seed(seed)``.

    torchtitan initialises each shard in place; DTensor's random ops follow the global
    tensor only on CUDA-like devices, so on CPU every rank draws its shard from the same
    stream and a job's initial weights would depend on its number of ranks.
    """
    with torch.device("meta"):
        twin = trainer.model_config.build()
    twin.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        twin.init_weights(buffer_device=None)
    full = dict(twin.named_parameters())
    (model,) = trainer.model_parts
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = full[name.replace("_checkpoint_wrapped_module.", "")]
            if isinstance(param, DTensor):  # each rank slices its own shard, no collective
                value = distribute_tensor(
                    value, param.device_mesh, param.placements, src_data_rank=None
                )
            param.copy_(value)


def run(args: list[str], refused: bool) -> None:
    """One job as ``torchtitan.train`` runs it; its losses and gradient norms by step
    (``torchtitan_rank.record_steps``) go to ``record-rank{r}.json`` in its dump folder."""
    config = ConfigManager().parse_args(args)
    trainer = config.build()
    same_start(trainer)
    record = torchtitan_rank.record_steps(trainer)
    try:
        trainer.train()
    except CheckpointException:  # DCP's failure, raised on every rank alike
        if not refused:
            raise
        folder = Path(config.dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"refused-rank{dist.get_rank()}.txt").write_text(traceback.format_exc())
        return
    finally:
        trainer.close()
    if refused:
        raise AssertionError(f"{config.dump_folder}: the resume should have been refused")
    folder = Path(config.dump_folder)
    (folder / f"record-rank{dist.get_rank()}.json").write_text(json.dumps(record))


def main(jobs_file: str) -> None:
    init_logger()
    # rank 0 sleeps 2 s at the end of every job "for other ranks to complete"; they do
    # complete, in the next job's first collective
    trainer_module.time = types.SimpleNamespace(
        perf_counter=time.perf_counter, sleep=lambda seconds: None
    )
    save_after_initial_load()
    for job in json.loads(Path(jobs_file).read_text()):
        run(job["args"], job.get("refused", False))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
