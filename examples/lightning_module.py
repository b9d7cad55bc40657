"""Train a tiny GPT with Dobb from a ``LightningModule``, with checkpoint resume.

    python examples/lightning_module.py --steps 40 --output-dir /tmp/dobb-pl --stop-at 20
    python examples/lightning_module.py --steps 40 --output-dir /tmp/dobb-pl --resume

(``--stop-at`` plays a job killed at step 20; the second command continues from
``last.ckpt`` and ends where an uninterrupted run would.)

The part to copy is ``configure_optimizers``: Dobb + a per-step LR schedule in Lightning's
dict form, and ``opt.track(self)`` so forward pre-hooks collect activation statistics.
Lightning's automatic optimization calls ``optimizer.step(closure)``; Dobb runs the closure
(forward, where the hooks fire, and backward) and then updates. Needs ``pip install
"dobb[examples]"``; no network (byte-level data from a standard-library file).
"""

import argparse
import math
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, Sampler

import dobb
from dobb.train.model import GPT, gpt_config


class DobbLM(L.LightningModule):
    """A GPT language model whose hidden ``nn.Linear`` layers train with Dobb.

    ``dobb_options``: further ``dobb.Dobb`` arguments, e.g. ``{"num_blocks": 8}``.
    """

    def __init__(
        self,
        total_steps: int,
        lr: float | None = None,
        warmup_steps: int = 0,
        weight_decay: float = 0.0,
        model: str = "tiny",
        dobb_options: dict | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(gpt_config(model))
        self.losses: list[float] = []
        self._hooks = []  # Dobb's statistics hooks on this module

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.losses.append(loss.item())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        hp = self.hparams
        # `wte`/`wpe`/`lm_head` (matched by name) and norms go to AdamW
        groups = dobb.param_groups(self, scalar_options={"weight_decay": 0.0})
        # None: the registry's recommended lr at the model's width
        lr = hp.lr or dobb.recommended_lr("dobb", width=self.model.cfg.n_embd)
        optimizer = dobb.Dobb(
            groups, lr=lr, weight_decay=hp.weight_decay, **(hp.dobb_options or {})
        )
        for hook in self._hooks:  # a second `fit` builds a new optimizer: hook that one
            hook.remove()
        self._hooks = optimizer.track(self)

        def warmup_cosine(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            progress = (step - hp.warmup_steps) / max(1, hp.total_steps - hp.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class ByteWindows(Dataset):
    """Non-overlapping ``block_size + 1``-byte windows of a file as ``(x, y)`` LM pairs."""

    def __init__(self, path: str | Path, block_size: int = 64):
        data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)
        n = len(data) // (block_size + 1)
        self.windows = data[: n * (block_size + 1)].long().view(n, block_size + 1)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int):
        return self.windows[i, :-1], self.windows[i, 1:]  # y is x shifted by one


class EpochShuffle(Sampler):
    """A permutation that depends only on ``(seed, epoch)``, so a resumed run sees the same order.

    Lightning calls ``set_epoch`` at the start of every epoch (``shuffle=True`` would draw
    from the global RNG, which Lightning checkpoints do not save).
    """

    def __init__(self, size: int, seed: int = 0):
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        return iter(np.random.default_rng([self.seed, self.epoch]).permutation(self.size).tolist())


def train(
    output_dir: str | Path,
    steps: int,
    *,
    steps_per_epoch: int = 20,
    resume: bool | str = False,
    stop_at: int | None = None,
    lr: float | None = None,
    batch_size: int = 8,
    seed: int = 0,
    data: str | Path = argparse.__file__,
    **dobb_options,
) -> tuple[L.Trainer, DobbLM]:
    """Fit ``DobbLM`` for ``steps`` steps, checkpointing after every ``steps_per_epoch``.

    ``resume``: True for ``output_dir/last.ckpt``, or a checkpoint path. ``stop_at``: stop
    at that step (the LR schedule still spans ``steps``). Resume from an end-of-epoch
    checkpoint: a plain ``DataLoader`` cannot restart in the middle of an epoch.
    """
    L.seed_everything(seed, verbose=False)
    module = DobbLM(steps, lr=lr, warmup_steps=steps // 10, dobb_options=dobb_options)
    dataset = ByteWindows(data, module.model.cfg.block_size)
    loader = DataLoader(dataset, batch_size, sampler=EpochShuffle(len(dataset), seed))
    # Save on the last batch of every epoch: Lightning (2.6) resumes such a checkpoint at the
    # next epoch's first batch, but resumes one saved by the default `on_train_epoch_end`
    # with a one-batch epoch, which shifts the data order.
    checkpoint = ModelCheckpoint(
        output_dir, every_n_train_steps=steps_per_epoch, save_top_k=-1, save_last=True
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=stop_at or steps,
        max_epochs=-1,
        limit_train_batches=steps_per_epoch,
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    ckpt_path = Path(output_dir) / "last.ckpt" if resume is True else resume or None
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, module


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="total optimizer steps")
    parser.add_argument("--steps-per-epoch", type=int, default=20, help="checkpoint interval")
    parser.add_argument("--output-dir", default="out-lightning")
    parser.add_argument("--resume", action="store_true", help="continue from last.ckpt")
    parser.add_argument(
        "--stop-at",
        type=int,
        help="stop at this step (a multiple of --steps-per-epoch), as if the job were killed",
    )
    parser.add_argument("--lr", type=float, default=None, help="default: dobb.recommended_lr")
    args = parser.parse_args(argv)
    trainer, module = train(
        args.output_dir,
        args.steps,
        steps_per_epoch=args.steps_per_epoch,
        resume=args.resume,
        stop_at=args.stop_at,
        lr=args.lr,
    )
    first = trainer.global_step - len(module.losses)  # > 0 after --resume
    for step, loss in enumerate(module.losses, start=first):
        print(f"step {step:4d}  loss {loss:.4f}")


if __name__ == "__main__":
    main()
