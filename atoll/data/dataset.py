"""Char-level dataset over the bundled text, with a held-out split and per-island sampling."""

from __future__ import annotations

from importlib import resources

import torch


def bundled_text() -> str:
    return resources.files("atoll.data").joinpath("tinyshakespeare.txt").read_text(encoding="utf-8")


class CharDataset:
    def __init__(self, text: str | None = None, *, block_size: int = 64, eval_fraction: float = 0.1) -> None:
        text = bundled_text() if text is None else text
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        split = int(len(data) * (1 - eval_fraction))
        self.train, self.eval = data[:split], data[split:]
        if len(self.eval) <= block_size + 1:
            raise ValueError(f"text too short for block_size {block_size}")
        self.block_size = block_size

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, generator: torch.Generator, batch_size: int, split: str = "train"):
        """A random batch of (input, target) windows; ``generator`` fixes which."""
        data = self.train if split == "train" else self.eval
        starts = torch.randint(len(data) - self.block_size - 1, (batch_size,), generator=generator)
        x = torch.stack([data[s : s + self.block_size] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + 1 + self.block_size] for s in starts.tolist()])
        return x, y

    def eval_batches(self, batch_size: int = 32):
        """Fixed, non-overlapping windows over the held-out split (deterministic eval)."""
        n = (len(self.eval) - 1) // self.block_size
        xs = torch.stack([self.eval[i * self.block_size : (i + 1) * self.block_size] for i in range(n)])
        ys = torch.stack([self.eval[i * self.block_size + 1 : (i + 1) * self.block_size + 1] for i in range(n)])
        for i in range(0, n, batch_size):
            yield xs[i : i + batch_size], ys[i : i + batch_size]
