"""One torchtitan rank on CPU running several training jobs in turn (one import, one
process group): the shim (``torchtitan_cpu``), then for each job torchtitan's own config
parsing, ``Trainer`` build, ``train()`` and ``close()``, as ``torchtitan.train`` does.

Run under ``torchrun``: ``torchtitan_rank.py JOBS.json``, where the file holds a list of
argument lists, each as for ``python -m torchtitan.train`` (``--module ... --config ...``).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from torchtitan_cpu import install  # noqa: E402

install()

import torch.distributed as dist  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.tools.logging import init_logger  # noqa: E402


def main(jobs_file: str) -> None:
    init_logger()
    for args in json.loads(Path(jobs_file).read_text()):
        trainer = ConfigManager().parse_args(args).build()
        try:
            trainer.train()
        finally:
            trainer.close()
        del trainer
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
