"""The user's data for the reference island: a token file, or a UTF-8 text file read as bytes.

- A flat binary of uint16 token ids (the nanoGPT ``train.bin`` convention), memory-mapped: nothing
  is read until a batch needs it. The vocabulary size comes from ``--vocab-size`` or from a small
  JSON sidecar beside the file (``train.bin.json`` or ``meta.json``: ``{"vocab_size": 50257}``).
- Any other file is UTF-8 text, trained on byte by byte (vocabulary 256).

Both hold out the file's last ``eval_fraction`` for evaluation and sample training windows with a
``torch.Generator`` (whose state is the data position a checkpoint saves).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

TOKEN_SUFFIXES = (".bin",)
MAX_EVAL_WINDOWS = 256
"""Evaluation reads at most this many windows (a fixed, deterministic subset of the held-out part)."""


def _sidecar_vocab(path: Path) -> int | None:
    for side in (path.with_name(path.name + ".json"), path.with_name("meta.json")):
        if side.exists():
            try:
                return int(json.loads(side.read_text())["vocab_size"])
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{side}: expected JSON with an integer vocab_size ({err})") from None
    return None


class TokenDataset:
    """Windows of a 1-D token array (uint16 from a memory-mapped file, or any integer array)."""

    def __init__(self, tokens: np.ndarray, vocab_size: int, *, block_size: int, eval_fraction: float = 0.05) -> None:
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        split = int(len(tokens) * (1 - eval_fraction))
        self.train, self.eval = tokens[:split], tokens[split:]
        if len(self.train) <= block_size + 1 or len(self.eval) <= block_size + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for block_size {block_size}")
        self.vocab_size = vocab_size
        self.block_size = block_size

    @classmethod
    def from_file(cls, path: str | Path, *, block_size: int, vocab_size: int = 0) -> TokenDataset:
        """A ``.bin`` token file (uint16, memory-mapped) or a text file (bytes)."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"--data {path}: no such file")
        if path.suffix in TOKEN_SUFFIXES:
            if path.stat().st_size % 2:
                raise ValueError(f"{path}: {path.stat().st_size} bytes is not a whole number of uint16 tokens")
            tokens = np.memmap(path, dtype=np.uint16, mode="r")
            vocab = vocab_size or _sidecar_vocab(path)
            if not vocab:
                raise ValueError(f'{path}: give --vocab-size, or put {{"vocab_size": N}} in {path.name}.json')
            return cls(tokens, vocab, block_size=block_size)
        raw = path.read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{path}: neither a .bin token file nor UTF-8 text ({err.reason} at {err.start})"
            ) from None
        if vocab_size not in (0, 256):
            raise ValueError(f"{path}: a text file is read byte by byte (vocabulary 256), not {vocab_size}")
        return cls(np.frombuffer(raw, dtype=np.uint8), 256, block_size=block_size)

    def _windows(self, data: np.ndarray, starts) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(self.block_size + 1)
        chunk = torch.from_numpy(data[idx].astype(np.int64))
        if int(chunk.max()) >= self.vocab_size:
            raise ValueError(f"token id {int(chunk.max())} is not below the vocabulary size {self.vocab_size}")
        return chunk[:, :-1], chunk[:, 1:]

    def batch(self, generator: torch.Generator, batch_size: int, split: str = "train"):
        """A random batch of (input, target) windows; ``generator`` fixes which."""
        data = self.train if split == "train" else self.eval
        starts = torch.randint(len(data) - self.block_size - 1, (batch_size,), generator=generator)
        return self._windows(data, starts.tolist())

    def eval_batches(self, batch_size: int = 32):
        """Fixed, non-overlapping windows over the held-out part (deterministic eval)."""
        n = min((len(self.eval) - 1) // self.block_size, MAX_EVAL_WINDOWS)
        for i in range(0, n, batch_size):
            yield self._windows(self.eval, [j * self.block_size for j in range(i, min(i + batch_size, n))])
