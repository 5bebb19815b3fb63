"""A GPT (pre-norm transformer decoder): tiny and char-level for the demo, up to ~1.3B by preset.

``PRESETS`` gives the sizes (``atoll island --model gpt-125m``); the vocabulary comes from the data.
The GPT presets tie the output head to the token embedding, as GPT-2 does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int
    """Number of distinct tokens (characters)."""
    block_size: int = 64
    """Context length."""
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    tie_weights: bool = False
    """Share the token embedding with the output head (GPT-2)."""

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or self.block_size < 1 or self.n_layer < 1:
            raise ValueError("vocab_size, block_size and n_layer must be >= 1")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        # Separate q/k/v projections so tensor parallelism can shard them by heads.
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q, k, v = (lin(h).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init)
        if cfg.tie_weights:
            self.head.weight = self.tok.weight

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size {self.cfg.block_size}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


PRESETS: dict[str, dict] = {
    "tiny": {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64},
    "gpt-small": {"n_layer": 6, "n_head": 8, "n_embd": 512, "block_size": 256, "tie_weights": True},
    "gpt-125m": {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "tie_weights": True},
    "gpt-350m": {"n_layer": 24, "n_head": 16, "n_embd": 1024, "block_size": 1024, "tie_weights": True},
    "gpt-760m": {"n_layer": 24, "n_head": 16, "n_embd": 1536, "block_size": 1024, "tie_weights": True},
    "gpt-1.3b": {"n_layer": 24, "n_head": 32, "n_embd": 2048, "block_size": 1024, "tie_weights": True},
}
"""Model sizes by name (parameters with GPT-2's 50,257-token vocabulary: gpt-125m 124M, gpt-350m 354M,
gpt-760m 757M, gpt-1.3b 1.3B)."""


def preset(name: str, *, vocab_size: int, **overrides) -> GPTConfig:
    """The config of a preset; keyword arguments that are not None override its fields."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)}")
    fields = {**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}}
    return GPTConfig(vocab_size=vocab_size, **fields)
