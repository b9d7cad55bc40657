"""Train a tiny GPT-2 with Dobb through Hugging Face's ``Trainer``, with checkpoint resume.

    python examples/hf_trainer.py --steps 40 --output-dir /tmp/dobb-hf --stop-at 20
    python examples/hf_trainer.py --steps 40 --output-dir /tmp/dobb-hf --resume

(``--stop-at`` plays a job killed at step 20; the second command continues from the newest
checkpoint and ends with the weights an uninterrupted run would have.)

The part to copy is ``make_dobb_optimizer``: build the optimizer and its schedule yourself
and hand both to ``Trainer(..., optimizers=(optimizer, scheduler))``. GPT-2's projections
(``c_attn``, ``c_proj``, ``c_fc``) are ``transformers``' ``Conv1D``, which stores its weight
as ``(d_in, d_out)``; Dobb recognizes it once ``transformers`` is imported and blocks it
along ``d_in``. The tied ``wte``/``lm_head`` matrix, ``wpe``, LayerNorms and biases go to
AdamW. Needs ``pip install "dobb[examples]"``; no network (model from a config, byte-level
data from a standard-library file).
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    get_cosine_schedule_with_warmup,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

import dobb


def make_dobb_optimizer(
    model: torch.nn.Module,
    lr: float | None,
    *,
    num_training_steps: int,
    warmup_steps: int = 0,
    weight_decay: float = 0.0,
    **dobb_options,
) -> tuple[dobb.Dobb, torch.optim.lr_scheduler.LambdaLR]:
    """Dobb for the hidden matrices, AdamW for the rest, and a warmup + cosine schedule.

    Call it after the model is on its training device and before ``Trainer`` is built:
    ``track`` allocates the statistics buffers next to the weights and hooks this model
    object, which ``Trainer`` then trains (and loads checkpoints into in place).
    """
    # `dobb.param_groups` excludes GPT-2's `wte`/`wpe`/`lm_head` by name (and tied heads by
    # identity); norms and biases are not layer weights, so they land in the AdamW group.
    groups = dobb.param_groups(model, scalar_options={"weight_decay": 0.0})
    if lr is None:  # the registry's recommended lr at the model's width
        lr = dobb.recommended_lr("dobb", width=model.config.n_embd)
    optimizer = dobb.Dobb(groups, lr=lr, weight_decay=weight_decay, **dobb_options)
    optimizer.track(model)  # forward pre-hooks on every Dobb layer collect E[xᵀx] blocks
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup_steps, num_training_steps)
    return optimizer, scheduler


def tiny_gpt2(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    """A 2-layer, 64-wide byte-level GPT-2 (about 0.12M parameters), built offline."""
    set_seed(seed)
    config = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    return GPT2LMHeadModel(GPT2Config(**{**config, **overrides}))


class ByteChunks(torch.utils.data.Dataset):
    """Non-overlapping ``block_size``-byte windows of a text file, as GPT-2 LM examples."""

    def __init__(self, path: str | Path, block_size: int = 64):
        data = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)
        n = len(data) // block_size
        self.chunks = data[: n * block_size].long().view(n, block_size)  # (n, T)

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        # GPT2LMHeadModel shifts the labels itself
        return {"input_ids": self.chunks[i], "labels": self.chunks[i]}


class StopAt(TrainerCallback):
    """End training after ``step`` optimizer steps, as if the job had been killed there."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def train(
    output_dir: str | Path,
    steps: int,
    *,
    resume: bool | str = False,
    save_steps: int | None = None,
    stop_at: int | None = None,
    lr: float | None = None,
    batch_size: int = 8,
    seed: int = 0,
    data: str | Path = argparse.__file__,
    **dobb_options,
) -> Trainer:
    """Train ``tiny_gpt2`` for ``steps`` optimizer steps; returns the ``Trainer``.

    ``resume``: True for the newest checkpoint in ``output_dir``, or a checkpoint path.
    ``stop_at``: stop early at that step (the schedule still spans ``steps``).
    """
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or steps,
        logging_steps=max(1, steps // 10),
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        report_to=[],
        use_cpu=True,  # a tiny model: CPU is quick and bit-reproducible
        disable_tqdm=True,
    )
    model = tiny_gpt2(seed).to(args.device)
    optimizer, scheduler = make_dobb_optimizer(
        model, lr, num_training_steps=steps, warmup_steps=steps // 10, **dobb_options
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=ByteChunks(data, model.config.n_positions),
        optimizers=(optimizer, scheduler),
        callbacks=[StopAt(stop_at)] if stop_at else None,
    )
    if resume is True:
        resume = get_last_checkpoint(str(output_dir))
        if resume is None:
            raise FileNotFoundError(f"--resume: no checkpoint-* directory in {output_dir}")
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="total optimizer steps")
    parser.add_argument("--output-dir", default="out-hf-trainer")
    parser.add_argument("--resume", action="store_true", help="continue the newest checkpoint")
    parser.add_argument("--save-steps", type=int, default=20, help="checkpoint interval")
    parser.add_argument(
        "--stop-at",
        type=int,
        help="stop at this step (a multiple of --save-steps), as if the job were killed",
    )
    parser.add_argument("--lr", type=float, default=None, help="default: dobb.recommended_lr")
    args = parser.parse_args(argv)
    trainer = train(
        args.output_dir,
        args.steps,
        resume=args.resume,
        save_steps=args.save_steps,
        stop_at=args.stop_at,
        lr=args.lr,
    )
    for entry in trainer.state.log_history:
        print(json.dumps(entry))


if __name__ == "__main__":
    main()
