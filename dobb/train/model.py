"""GPT-2 family decoder: learned positions, pre-LayerNorm blocks, tied LM head.

Every hidden projection is a plain `nn.Linear` (optimizers hook their inputs), and the
embedding and head are found by name: `wte`, `wpe`, `lm_head`. The head shares its weight
with `wte`, so `named_parameters()` lists that tensor once, as `wte.weight`.
"""

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 50257  # GPT-2 BPE; 256 for byte-level text
    block_size: int = 1024  # context length T
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768  # model width C; head size is C // n_head
    dropout: float = 0.0
    bias: bool = False  # biases in Linear and LayerNorm (GPT-2 had them)

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")


GPT_CONFIGS = {
    "tiny": dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64),  # CI-sized
    "mini": dict(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=256),  # ~3M, 2 CPUs
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 355M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}


def gpt_config(name: str, **overrides) -> GPTConfig:
    """A GPT_CONFIGS entry with fields overridden, e.g. gpt_config("gpt2", dropout=0.1)."""
    if name not in GPT_CONFIGS:
        raise ValueError(f"unknown GPT config {name!r}; choose one of {sorted(GPT_CONFIGS)}")
    unknown = set(overrides) - {f.name for f in fields(GPTConfig)}
    if unknown:
        raise ValueError(f"unknown GPTConfig fields {sorted(unknown)}")
    return replace(GPTConfig(**GPT_CONFIGS[name]), **overrides)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        # separate q, k, v (not one packed qkv) so column-parallel TP splits whole heads
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, _ = x.shape
        # (B, T, C) -> (B, nh, T, hs); under TP, nh counts this rank's heads only
        q, k, v = (
            f(x).view(B, T, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, nh, T, hs) -> (B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; `forward(idx (B, T), targets (B, T)) -> (logits (B, T, V), loss)`.

    Builds on any device, including `meta` (count parameters without allocating them).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one (V, C) matrix reads and writes tokens
        self.reset_parameters()

    def reset_parameters(self):
        """GPT-2 init: N(0, 0.02), and the residual projections `*.proj` scaled by 1/sqrt(2L)."""
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)  # 2 residual adds per block
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                std = resid_std if name.endswith(".proj") else 0.02
                nn.init.normal_(m.weight, mean=0.0, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def num_params(self) -> int:
        """Number of parameters, the tied embedding/head counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss
