"""`TrainConfig`: every knob of a training run, typed and commented, loaded from YAML.

    cfg = load_config("configs/mini.yaml", ["optimizer=muon", "lr=0.01"])

A YAML file and `key=value` overrides go through one typed path: each value is converted
to its field's type (`"3e-4"` -> 0.0003, `"none"` -> None, `"true"` -> True). Dict fields
take a YAML mapping (`optimizer_options={num_blocks: 8}`) or one dotted key at a time
(`optimizer_options.num_blocks=8`). Unknown keys and bad values raise `ConfigError` naming
the key.

A config path that is not a file is looked up among the configs shipped inside the package
(`dobb/configs/`, which the repository's `configs/` links to): `configs/tiny.yaml`,
`tiny.yaml` and `tiny` all name it, from any working directory.
"""

import math
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dobb.registry import OPTIMIZERS
from dobb.train.errors import RunError
from dobb.train.model import GPT_CONFIGS
from dobb.train.parallel import LAYOUTS

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"  # shipped in the wheel

TOKENIZERS = ("bytes", "gpt2")
DECAYS = ("cosine", "linear", "constant")


class ConfigError(RunError, ValueError):
    """A config key is unknown or its value is invalid; the message names the key."""


@dataclass
class TrainConfig:
    # ---- model
    model: str = "mini"  # a GPT_CONFIGS name: tiny, mini, gpt2, gpt2-medium, ... gpt2-xl
    model_overrides: dict = field(default_factory=dict)  # GPTConfig fields, e.g. {n_layer: 6}
    # ---- data (vocab_size comes from the data, not from the model config)
    data: str = "stdlib"  # "stdlib", a text file/dir, or .bin shards (file, dir or glob)
    val_data: str | None = None  # separate validation data (e.g. fineweb_val_*.bin); None: split
    val_fraction: float = 0.05  # tail of `data` held out for validation when val_data is None
    tokenizer: str | None = None  # text: "bytes" (the default, vocab 256) or "gpt2"; .bin: none
    data_cache: str | None = None  # directory caching GPT-2 tokenizations of text; None: none
    # ---- batch: tokens per optimizer step = batch_size * block_size
    batch_size: int = 16  # global sequences per optimizer step, summed over data-parallel ranks
    grad_accum: int = 1  # micro-batches per step; batch_size % (grad_accum * dp ranks) == 0
    block_size: int | None = None  # context length T; None: the model config's block_size
    # ---- schedule: linear warmup, then decay to lr * min_lr_ratio at the last step
    steps: int = 1000  # optimizer steps in the whole run
    warmup_steps: int = 0  # steps of linear warmup from lr / warmup_steps up to lr
    decay: str = "cosine"  # after warmup: "cosine", "linear" or "constant"
    min_lr_ratio: float = 0.1  # the floor of the decay, as a fraction of the peak lr
    # ---- optimizer (one registry lookup: dobb.registry.build_optimizer)
    optimizer: str = "dobb"  # a registry name (dobb.registry.OPTIMIZERS)
    lr: float | None = None  # peak lr of the hidden matrices (all params for adamw); None: registry
    scalar_lr: float | None = None  # peak lr of embeddings/head/norms/biases; None: registry
    optimizer_options: dict = field(default_factory=dict)  # constructor args, e.g. {num_blocks: 8}
    # ---- weight decay: one protocol for every optimizer (docs/harness.md). Decoupled,
    # W <- W (1 - lr wd), on the hidden matrices (every optimizer, AdamW too) and, with its
    # own value, on embeddings/head/norms/biases. None on either by default: the study's
    # runs are 400 steps, where a decay of lr * wd * steps <= 0.02 * 0.01 * 400 = 8% of W
    # is a weak regulariser that only some baselines applied by default before.
    weight_decay: float = 0.0  # hidden matrices (AdamW: the same parameters)
    scalar_weight_decay: float = 0.0  # embeddings, head, norms, biases
    grad_clip: float | None = None  # clip the global gradient norm to this; None: no clipping
    # ---- evaluation
    eval_interval: int = 100  # validate every this many steps (and always after the last)
    eval_batches: int = 8  # fixed validation batches of batch_size sequences, same every eval
    # evaluate an exponential moving average of the weights (iterate averaging) with this
    # decay d in [0, 1): after step t, ema_t = lerp(ema_{t-1}, w_t, (1 - d) / (1 - d**t)),
    # the bias-corrected EMA of the weights after each step (dobb.train.ema); val_loss is
    # then the EMA's, val_loss_live the live weights'. None: off, val_loss is the live one
    eval_ema: float | None = None
    # ---- reproducibility and parallelism
    seed: int = 0  # model init and the batch sampler; data batch = f(seed, step, rank)
    layout: str = "single"  # single, ddp, fsdp, hsdp, tp, fsdp_tp (dobb.train.parallel)
    tensor_parallel: int = 2  # fsdp_tp: TP degree; tp: = WORLD_SIZE; hsdp: replica groups
    timeout: float = 600.0  # seconds a collective waits for the other ranks, then fails
    # ---- output and checkpoints
    out_dir: str = "runs/default"  # metrics.jsonl, run.json, summary.json, checkpoints/
    checkpoint_interval: int = 0  # save every this many steps and after the last; 0: never
    keep_checkpoints: int = 2  # complete checkpoints kept (oldest deleted first); 0: keep all
    resume: bool = False  # continue from the latest complete checkpoint in out_dir, if any
    progress: bool = True  # tqdm progress bar on rank 0 (only when stderr is a terminal)

    def validate(self) -> "TrainConfig":
        """Raise ConfigError naming the first invalid field; return self."""
        checks = {
            "model": (self.model in GPT_CONFIGS, f"one of {sorted(GPT_CONFIGS)}"),
            "optimizer": (self.optimizer in OPTIMIZERS, f"one of {sorted(OPTIMIZERS)}"),
            "tokenizer": (self.tokenizer in (None, *TOKENIZERS), f"none or one of {TOKENIZERS}"),
            "decay": (self.decay in DECAYS, f"one of {DECAYS}"),
            "layout": (self.layout in LAYOUTS, f"one of {sorted(LAYOUTS)}"),
            "val_fraction": (0 < self.val_fraction < 1, "in (0, 1)"),
            "batch_size": (self.batch_size >= 1, ">= 1"),
            "grad_accum": (self.grad_accum >= 1, ">= 1"),
            "block_size": (self.block_size is None or self.block_size >= 1, ">= 1 or none"),
            "steps": (self.steps >= 1, ">= 1"),
            "warmup_steps": (0 <= self.warmup_steps <= self.steps, f"in [0, steps={self.steps}]"),
            "min_lr_ratio": (0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
            "lr": (self.lr is None or 0 <= self.lr < math.inf, "a finite number >= 0, or none"),
            "scalar_lr": (
                self.scalar_lr is None or 0 <= self.scalar_lr < math.inf,
                "a finite number >= 0, or none",
            ),
            "weight_decay": (0 <= self.weight_decay < math.inf, "a finite number >= 0"),
            "scalar_weight_decay": (
                0 <= self.scalar_weight_decay < math.inf,
                "a finite number >= 0",
            ),
            "grad_clip": (
                self.grad_clip is None or 0 < self.grad_clip < math.inf,
                "a finite number > 0, or none",
            ),
            "eval_interval": (self.eval_interval >= 1, ">= 1"),
            "eval_batches": (self.eval_batches >= 1, ">= 1"),
            "eval_ema": (
                self.eval_ema is None or 0 <= self.eval_ema < 1,
                "an EMA decay in [0, 1), e.g. 0.9 (0: the live weights), or none (off)",
            ),
            "tensor_parallel": (self.tensor_parallel >= 1, ">= 1"),
            "checkpoint_interval": (self.checkpoint_interval >= 0, ">= 0 (0: never)"),
            "keep_checkpoints": (self.keep_checkpoints >= 0, ">= 0 (0: keep all)"),
            "timeout": (0 < self.timeout < math.inf, "a number of seconds > 0"),
        }
        for key, (ok, expected) in checks.items():
            if not ok:
                raise ConfigError(f"{key}={getattr(self, key)!r} is invalid: must be {expected}")
        if "weight_decay" in self.optimizer_options:
            raise ConfigError(
                "optimizer_options.weight_decay: weight decay is a top-level setting, the same "
                "for every optimizer; set weight_decay=... (hidden matrices) and "
                "scalar_weight_decay=... (embeddings, head, norms, biases) instead"
            )
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"batch_size={self.batch_size} is not divisible by grad_accum={self.grad_accum}"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Convert `value` (a YAML value or a command-line string) to the field's type."""
    if isinstance(annotation, types.UnionType):  # `X | None`
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "~")):
            return None
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    try:
        if annotation is bool:
            if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "no", "off", "0"):
                return False
            if isinstance(value, bool):
                return value
            raise ValueError("expected true or false")
        if annotation is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("expected an integer")
            return int(value)
        if annotation is float:
            if isinstance(value, bool):
                raise ValueError("expected a number")
            return float(value)
        if annotation is str:
            if not isinstance(value, str | int | float) or isinstance(value, bool):
                raise ValueError("expected a string")
            return str(value)
        if annotation is dict:
            value = yaml.safe_load(value) if isinstance(value, str) else value
            if value is None:
                return {}
            if not isinstance(value, dict):
                raise ValueError("expected a mapping such as {name: value}")
            return {str(k): _yaml_number(v) for k, v in value.items()}
    except (ValueError, TypeError, yaml.YAMLError) as e:
        raise ConfigError(f"bad value {value!r} for {key}: {e}") from None
    raise TypeError(f"TrainConfig.{key} has an unsupported type {annotation}")


def _yaml_number(value: Any) -> Any:
    """YAML 1.1 reads `1e-3` (no dot) as a string; read number-like strings as numbers."""
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
        try:
            return float(value)
        except ValueError:
            pass
    return value


def apply_overrides(cfg: TrainConfig, values: dict[str, Any]) -> TrainConfig:
    """Set fields from a mapping; dotted keys (`optimizer_options.num_blocks`) set one entry."""
    types_ = _field_types()
    for key, value in values.items():
        name, _, sub = key.partition(".")
        if name not in types_:
            raise ConfigError(f"unknown config key {name!r}; known keys: {sorted(types_)}")
        if sub:
            if types_[name] is not dict:
                raise ConfigError(f"{key}: only dict fields take dotted keys, {name} is not one")
            parsed = yaml.safe_load(value) if isinstance(value, str) else value
            getattr(cfg, name)[sub] = _yaml_number(parsed)
        else:
            setattr(cfg, name, _coerce(name, value, types_[name]))
    return cfg


def parse_overrides(items: list[str]) -> dict[str, str]:
    """`["lr=3e-4", "optimizer=muon"]` -> `{"lr": "3e-4", "optimizer": "muon"}`."""
    values = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        values[key.strip()] = value
    return values


def shipped_configs() -> list[str]:
    """Names of the configs shipped in the package, e.g. `["gpt2-fineweb", "mini", "tiny"]`."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def find_config(path: str | Path) -> Path:
    """`path` if it is a file, else the shipped config it names; ConfigError if neither.

    A relative path is looked up under `CONFIG_DIR` with a leading `configs/` dropped and
    `.yaml` added when it has no suffix: `configs/tiny.yaml`, `tiny.yaml`, `tiny`.
    """
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_absolute():
        rel = Path(*path.parts[1:]) if path.parts[:1] == ("configs",) else path
        for candidate in (CONFIG_DIR / rel, CONFIG_DIR / rel.with_name(rel.name + ".yaml")):
            if rel.parts and candidate.is_file():
                return candidate
    raise ConfigError(
        f"no config file {str(path)!r}: not a file here, nor a config shipped with dobb "
        f"({', '.join(shipped_configs())}); give the path of a YAML file or one of those names"
    )


def read_yaml(path: Path) -> Any:
    """The YAML document at `path`; ConfigError naming the line of a syntax error."""
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}; fix the file") from None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Defaults, then the YAML file at `path` (if given, see `find_config`), then overrides."""
    cfg = TrainConfig()
    if path is not None:
        path = find_config(path)
        data = read_yaml(path) or {}
        if not isinstance(data, dict):
            raise ConfigError(
                f"{path}: expected a mapping of config keys, got {type(data).__name__}"
            )
        apply_overrides(cfg, data)
    apply_overrides(cfg, parse_overrides(list(overrides)))
    return cfg.validate()
