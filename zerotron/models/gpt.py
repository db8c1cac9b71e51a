"""The reference model: a Llama-style decoder LM, plain single-device PyTorch.

RMSNorm, rotary positions, grouped-query attention through `scaled_dot_product_attention`, SwiGLU.
Parallelism is applied to it from outside; nothing in here knows about ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from .moe import Experts, MoEMLP


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4  # < n_head: grouped-query attention
    d_model: int = 128
    ffn_hidden: int = 0  # 0: SwiGLU's usual 8/3 * d_model, rounded up to a multiple of 32
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dropout: float = 0.0
    n_experts: int = 0  # > 0: every block's MLP is a mixture of this many experts (models/moe.py)
    top_k: int = 2  # experts per token
    expert_ffn: int = 0  # each expert's hidden size; 0: ffn
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss in the training loss

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if (self.d_model // self.n_head) % 2:
            raise ValueError("the head size d_model / n_head must be even for rotary positions")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and n_experts ({self.n_experts})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 32 * math.ceil(8 * self.d_model / 3 / 32)

    @property
    def expert_hidden(self) -> int:
        return self.expert_ffn or self.ffn


# Sizes by name, from ~0.1M parameters (tests) to billions (GPUs). Vocabulary: bytes unless overridden.
SIZES = {
    "tiny": GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64),
    "small": GPTConfig(n_layer=4, n_head=4, n_kv_head=2, d_model=128),
    "medium": GPTConfig(n_layer=6, n_head=8, n_kv_head=4, d_model=256),
    "large": GPTConfig(n_layer=8, n_head=8, n_kv_head=4, d_model=512),
    "125m": GPTConfig(n_layer=12, n_head=12, n_kv_head=12, d_model=768, max_seq_len=2048),
    "350m": GPTConfig(n_layer=24, n_head=16, n_kv_head=16, d_model=1024, max_seq_len=2048),
    "1.3b": GPTConfig(n_layer=24, n_head=16, n_kv_head=16, d_model=2048, max_seq_len=2048),
    "2.7b": GPTConfig(n_layer=32, n_head=32, n_kv_head=32, d_model=2560, max_seq_len=2048),
    "7b": GPTConfig(n_layer=32, n_head=32, n_kv_head=32, d_model=4096, ffn_hidden=11008, max_seq_len=4096),
    "13b": GPTConfig(n_layer=40, n_head=40, n_kv_head=40, d_model=5120, ffn_hidden=13824, max_seq_len=4096),
    # mixtures of experts: each block's MLP is n_experts SwiGLU experts, top_k of them per token
    "moe-tiny": GPTConfig(n_layer=2, n_head=4, n_kv_head=2, d_model=64, n_experts=4, top_k=2, expert_ffn=96),
    "moe-small": GPTConfig(n_layer=4, n_head=4, n_kv_head=2, d_model=128, n_experts=8, top_k=2, expert_ffn=192),
    "moe-medium": GPTConfig(n_layer=6, n_head=8, n_kv_head=4, d_model=256, n_experts=8, top_k=2, expert_ffn=384),
}


def config_for(size: str, **overrides) -> GPTConfig:
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}")
    return replace(SIZES[size], **overrides)


def rotary_tables(
    cfg: GPTConfig, seq_len: int, device=None, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the rotary angles of `positions` (default 0 .. seq_len - 1), always fp32 and
    computed per call (cheap), so casting the model to bf16/fp16 never degrades positions."""
    dims = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=device)
    inv_freq = 1.0 / cfg.rope_theta ** (dims / cfg.head_dim)
    if positions is None:
        positions = torch.arange(seq_len, device=device)
    angles = torch.outer(positions.to(torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); rotate pairs (first half, second half) of each head."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)
        self.wo.residual_projection = True
        # q, k, v (batch, heads, seq, head_dim) -> (batch, heads, seq, head_dim); Ulysses wraps it
        # in its all-to-alls (long_context/gpt.py)
        self.core = self.attend

    def attend(self, q, k, v):
        if k.shape[1] != q.shape[1]:  # grouped-query attention: share each k/v head
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)

    def forward(self, x, cos, sin):
        # Shapes come from the projections, not from x: with tensor parallelism a rank holds fewer
        # heads, and with sequence parallelism x holds part of the sequence while q/k/v hold all of it.
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        b, t = q.shape[:2]
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, t, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = self.core(q, k, v)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn, cfg.d_model, bias=False)  # down
        self.w2.residual_projection = True

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MoEMLP(cfg.d_model, cfg.n_experts, cfg.top_k, cfg.expert_hidden) if cfg.n_experts else MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, cos, sin):
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # Tensor parallelism swaps in a vocabulary-parallel loss, and an output_fn that gathers
        # the vocabulary-split logits when they are returned instead of consumed by the loss.
        self.loss_fn = cross_entropy
        self.output_fn = None
        # Sequence parallelism: (local length, device) -> where this copy's tokens sit in the
        # whole sequence and its length (long_context/layout.py); None: the tokens are the whole sequence
        self.token_positions = None
        self.apply(self._init_weights)

    def _init_weights(self, m: nn.Module):
        """Per-module init (also what zero.Init runs when it materializes a partitioned model)."""
        # GPT-2's scaled init for projections that write into the residual stream.
        scale = math.sqrt(2 * self.config.n_layer)
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02 / (scale if getattr(m, "residual_projection", False) else 1.0))
        elif isinstance(m, Experts):
            nn.init.normal_(m.gate_up_proj, std=0.02)
            nn.init.normal_(m.down_proj, std=0.02 / scale)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits (batch, seq, vocab); or, given targets, the mean cross-entropy loss."""
        t = tokens.shape[1]
        positions, whole = (None, t) if self.token_positions is None else self.token_positions(t, tokens.device)
        if whole > self.config.max_seq_len:
            raise ValueError(f"sequence length {whole} exceeds max_seq_len {self.config.max_seq_len}")
        x = self.tok_emb(tokens)
        cos, sin = rotary_tables(self.config, t, tokens.device, positions)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits if self.output_fn is None else self.output_fn(logits)
        loss = self.loss_fn(logits, targets)
        if self.config.n_experts and self.config.aux_loss_coef:
            loss = loss + self.config.aux_loss_coef * sum(layer.mlp.aux_loss for layer in self.layers)
        return loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """6N + 12·L·d·s: N counts every weight a token meets in a matmul (the embedding lookup is not
        one; of a mixture's experts, its top_k)."""
        cfg = self.config
        n = self.num_params() - (0 if cfg.tie_embeddings else self.tok_emb.weight.numel())
        if cfg.n_experts:
            per_expert = 3 * cfg.d_model * cfg.expert_hidden
            n -= cfg.n_layer * (cfg.n_experts - cfg.top_k) * per_expert
        return 6 * n + 12 * cfg.n_layer * cfg.d_model * seq_len

    @torch.no_grad()
    def generate(
        self,
        tokens: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        for _ in range(max_new_tokens):
            context = tokens[:, -self.config.max_seq_len :]
            logits = self(context)[:, -1, :].float() / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            tokens = torch.cat((tokens, nxt), dim=1)
        return tokens
