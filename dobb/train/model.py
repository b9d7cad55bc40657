"""GPT-2 family decoder: learned positions, pre-LayerNorm blocks, tied LM head; optionally a
mixture of experts in place of each block's MLP (`GPTConfig.n_experts`, `MoE`).

Every hidden projection is a plain `nn.Linear` (optimizers hook their inputs), but for the
experts' `(E, d_out, d_in)` stacks (`GroupedExperts`; their names match `EXPERT_WEIGHTS`), and
the embedding and head are found by name: `wte`, `wpe`, `lm_head`. The head shares its
weight with `wte`, so `named_parameters()` lists that tensor once, as `wte.weight`.
"""

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from dobb.stats import register_experts


@dataclass
class GPTConfig:
    vocab_size: int = 50257  # GPT-2 BPE; 256 for byte-level text
    block_size: int = 1024  # context length T
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768  # model width C; head size is C // n_head
    dropout: float = 0.0
    bias: bool = False  # biases in Linear and LayerNorm (GPT-2 had them; experts have none)
    # ---- mixture of experts (`MoE`): 0 experts is the dense MLP
    n_experts: int = 0  # E experts per block, each token routed to expert_top_k of them
    expert_top_k: int = 2  # k experts per token, in 1 .. n_experts
    expert_hidden: int = 0  # each expert's hidden width; 0: 4 * n_embd // expert_top_k
    router_aux_loss_coef: float = 0.01  # the load-balancing loss's weight in training

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if min(self.n_experts, self.expert_hidden, self.router_aux_loss_coef) < 0:
            raise ValueError(
                f"n_experts={self.n_experts}, expert_hidden={self.expert_hidden} and "
                f"router_aux_loss_coef={self.router_aux_loss_coef} must all be >= 0"
            )
        if self.n_experts and not 1 <= self.expert_top_k <= self.n_experts:
            raise ValueError(f"expert_top_k={self.expert_top_k} is not in 1 .. {self.n_experts}")


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


# the names of the experts' stacks: `dobb.param_groups(model, experts=EXPERT_WEIGHTS)`
EXPERT_WEIGHTS = r"\.experts\.w[12]$"


class GroupedExperts(nn.Module):
    """E expert MLPs, `x -> gelu(x W1_e^T) W2_e^T`, on rows sorted by expert.

    `w1` (E, hidden, C) and `w2` (E, C, hidden) stack each expert's weights as `nn.Linear`
    holds one, (d_out, d_in). Each projection is one `_grouped_mm` call, `w1`'s then `w2`'s
    (`grouped_mm_calls`), that hooks may wrap: an expert's rows are the inputs it sees.
    """

    grouped_mm_calls = ("w1", "w2")  # the stacks, in the order `forward` projects with them

    def __init__(self, n_experts: int, n_embd: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, n_embd))
        self.w2 = nn.Parameter(torch.empty(n_experts, n_embd, hidden))

    def forward(self, x: Tensor, offs: Tensor) -> Tensor:
        """x (N, C), rows sorted by expert, `offs` as `_grouped_mm`'s -> (N, C)."""
        h = F.gelu(self._grouped_mm(A=x, B_t=self.w1.transpose(-2, -1), offs=offs))
        return self._grouped_mm(A=h, B_t=self.w2.transpose(-2, -1), offs=offs)

    def _grouped_mm(self, A: Tensor, B_t: Tensor, offs: Tensor) -> Tensor:
        """A (N, d_in) @ B_t (E, d_in, d_out) by groups of rows -> (N, d_out): rows
        offs[e-1]:offs[e] times B_t[e] (offs: int32 (E,), the cumulative row counts, offs[-1]
        = N). A loop of matmuls: `torch._grouped_mm`'s backward fails on CPU (torch 2.13)."""
        bounds = [0, *offs.tolist()]
        return torch.cat([A[bounds[e] : bounds[e + 1]] @ B_t[e] for e in range(len(B_t))])


# Dobb's per-expert statistics hook `_grouped_mm` (the protocol of dobb.stats)
register_experts(GroupedExperts, GroupedExperts.grouped_mm_calls)


class MoE(nn.Module):
    """A mixture of E expert MLPs in place of the dense one (dropless, top-k routing).

    For a token x (C,): router logits l = W_r x (E,) (`router`, an `nn.Linear`); its k
    experts T = top-k(l); scores s_e = softmax over T of l (exp(l_e) / sum_{j in T} exp(l_j),
    summing to 1 over the k chosen); output sum_{e in T} s_e MLP_e(x). Each expert's hidden
    width is `expert_hidden` (default 4C / k: k experts then do the dense MLP's FLOPs per
    token, 2C each at k = 2). The (token, expert) pairs are sorted by expert, every pair
    kept (no capacity limit).

    It keeps the Switch Transformer's load-balancing loss (arXiv 2101.03961, eq. 4) of its
    last forward as `aux_loss` (`GPT` adds it to the loss in training only): E sum_e f_e P_e,
    f_e the share of the N k pairs routed to e, P_e the mean over the N tokens of the softmax
    over all E logits; 1 when either is uniform. Gradients reach the router through P_e only.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.top_k, self.aux_loss = cfg.expert_top_k, None
        hidden = cfg.expert_hidden or 4 * cfg.n_embd // cfg.expert_top_k
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.n_embd, hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., C) -> (..., C), each of the N tokens mixed from its k experts."""
        tokens = x.flatten(0, -2)  # (N, C)
        logits = self.router(tokens)  # (N, E)
        top, chosen = logits.topk(self.top_k, dim=-1)  # (N, k)
        order = chosen.flatten().argsort(stable=True)  # the N k pairs sorted by expert
        rows = order // self.top_k  # each sorted pair's token
        counts = torch.bincount(chosen.flatten(), minlength=logits.shape[-1])  # (E,)
        y = self.experts(tokens[rows], counts.cumsum(0).to(torch.int32))  # (N k, C)
        y = y * F.softmax(top, dim=-1).flatten()[order, None]
        share = F.softmax(logits, dim=-1).mean(0)  # P_e
        self.aux_loss = len(counts) * (counts / counts.sum() * share).sum()
        return self.drop(tokens.new_zeros(tokens.shape).index_add(0, rows, y).view_as(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; `forward(idx (B, T), targets (B, T)) -> (logits (B, T, V), loss)`.

    The loss is the mean cross-entropy; with experts, in training mode only, plus
    `router_aux_loss_coef` x the mean over blocks of their `MoE.aux_loss`, so that a
    validation loss (eval mode) is the cross-entropy alone, as a dense model's. Builds on
    any device, including `meta` (count parameters without allocating them).
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
        """GPT-2 init: N(0, 0.02), and the residual projections `*.proj` scaled by 1/sqrt(2L);
        the experts' `w1` and `w2` as the MLP's `fc` and `proj`, the router as a Linear."""
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)  # 2 residual adds per block
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                std = resid_std if name.endswith(".proj") else 0.02
                nn.init.normal_(m.weight, mean=0.0, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, GroupedExperts):  # w1 as the MLP's fc, w2 as its proj
                nn.init.normal_(m.w1, mean=0.0, std=0.02)
                nn.init.normal_(m.w2, mean=0.0, std=resid_std)

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
        if self.training and self.cfg.n_experts:  # the blocks' mean load-balancing loss
            aux = torch.stack([block.mlp.aux_loss for block in self.blocks]).mean()
            loss = loss + self.cfg.router_aux_loss_coef * aux
        return logits, loss
