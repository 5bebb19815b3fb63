"""Error feedback: carry what a lossy codec dropped into the next round's input."""

from __future__ import annotations

import contextlib

import torch

from atoll.compression import staging
from atoll.compression.base import Chunks, Codec


class _Residual(Chunks):
    """``x`` read a chunk at a time by a chunked codec, each chunk left holding ``x − decode`` once it is
    encoded (the codec reports the bits of ``decode(payload)`` for it: x − d is x + (−d), bit for bit)."""

    wants_decoded = True

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__(x.numel(), x.device)
        self.x = x.view(-1)

    def span(self, start: int, length: int) -> torch.Tensor:
        return self.x.narrow(0, start, length)

    def encoded(self, start: int, decoded: torch.Tensor) -> None:
        self.x.narrow(0, start, decoded.numel()).sub_(decoded)


class ErrorFeedback:
    """Wraps any codec: ``encode(x)`` sends ``C(x + βe)`` and keeps ``e <- x + βe - D(C(x + βe))``.

    The payload is the inner codec's, so decoders need not know error feedback was used. The
    residual lives in the caller's per-tensor ``state`` (shard-sized on a sharded island).
    ``decay`` is β: 1 is classic error feedback, whose decoded updates sum to the true ones up
    to the (bounded) last residual; β < 1 forgets old residual geometrically.
    """

    def __init__(self, inner: Codec, decay: float = 1.0) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"error feedback decay must be in (0, 1], got {decay}")
        self.inner = inner
        self.decay = float(decay)
        self.name = inner.name
        self.codec_id = inner.codec_id
        self.lossy = inner.lossy
        self.stateful = True

    @property
    def spec(self) -> str:
        return self.inner.spec

    @property
    def chunked_input(self) -> bool:
        return False  # the residual needs the whole input

    def encode_difference(self, a: torch.Tensor, b: torch.Tensor, state: dict | None = None, *, out=None) -> bytearray:
        return self.encode(a.float() - b.float(), state, out=out)

    def encode(self, tensor: torch.Tensor, state: dict | None = None, *, out: bytearray | None = None) -> bytearray:
        """Everything on ``tensor``'s device; the residual in ``state`` must be there too (the caller
        places it: :mod:`atoll.islands._shard_state` keeps it in host memory between rounds)."""
        if state is None:
            raise ValueError("error feedback needs a per-tensor state dict to keep its residual in")
        x = tensor.detach().to(dtype=torch.float32)
        residual = state.get("residual")
        if residual is not None:
            if residual.shape != x.shape or residual.device != x.device:
                raise ValueError(
                    f"residual is {tuple(residual.shape)} on {residual.device}, tensor {tuple(x.shape)} on {x.device}"
                )
            x = torch.add(x, residual, alpha=self.decay)  # alpha 1 is exactly x + residual
        elif tensor.dtype == torch.float32:  # x is a view of the caller's tensor: never written into
            x = x.clone()
        x = x.contiguous()
        if self.inner.chunked_input:  # each chunk's decoded values subtracted as it is encoded: no decode
            payload = self.inner.encode_chunks(_Residual(x), tuple(x.shape), state.setdefault("inner", {}), out=out)
        else:
            payload = self.inner.encode(x, state.setdefault("inner", {}), out=out)
            stage = staging.current()  # staged: the body is still on the device, read it there
            with stage.again() if stage is not None else contextlib.nullcontext():
                # Our own payload, just made (staged, its checksum is not even written yet).
                self.inner.decode_add_(payload, x, alpha=-1.0, verified=True)
        state["residual"] = x  # x + e - D(C(x + e))
        return payload

    def encoded_size(self, shape) -> int:
        return self.inner.encoded_size(shape)

    def decode(self, payload, expected_shape=None, *, device=None) -> torch.Tensor:
        return self.inner.decode(payload, expected_shape, device=device)

    def decode_into(self, payload, out: torch.Tensor) -> torch.Tensor:
        return self.inner.decode_into(payload, out)

    def decode_add_(self, payload, out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        return self.inner.decode_add_(payload, out, alpha)

    def validate(self, payload, expected_shape):
        return self.inner.validate(payload, expected_shape)
