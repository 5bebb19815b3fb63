"""Error feedback: carry what a lossy codec dropped into the next round's input."""

from __future__ import annotations

import contextlib

import torch

from atoll.compression import staging
from atoll.compression.base import Chunks, Codec, chunk_elems


class _Residual(Chunks):
    """The residual ``e`` read a chunk at a time by a chunked codec. With ``a`` and ``b`` each chunk is
    first made ``β·e + (a − b)`` in e's own storage (the pseudo-gradient is never whole: one scratch
    chunk); once encoded it is left holding ``itself − decode`` (the codec reports the bits of
    ``decode(payload)`` for it: x − d is x + (−d), bit for bit)."""

    wants_decoded = True

    def __init__(self, e: torch.Tensor, a=None, b=None, decay: float = 1.0) -> None:
        super().__init__(e.numel(), e.device)
        self.e, self.decay = e.view(-1), decay
        self.a = None if a is None else a.detach().reshape(-1)
        self.b = None if b is None else b.detach().reshape(-1)
        self._scratch = None if a is None else torch.empty(min(e.numel(), chunk_elems(e.device)), device=e.device)

    def span(self, start: int, length: int) -> torch.Tensor:
        e = self.e.narrow(0, start, length)
        if self.a is not None:
            d = torch.sub(
                self.a.narrow(0, start, length), self.b.narrow(0, start, length), out=self._scratch.narrow(0, 0, length)
            )
            if self.decay != 1.0:
                e.mul_(self.decay)
            e.add_(d)  # β·e + d (+ is commutative: with β = 1, the bits of d + e)
        return e

    def encoded(self, start: int, decoded: torch.Tensor) -> None:
        self.e.narrow(0, start, decoded.numel()).sub_(decoded)


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
        """``encode(a − b)``; around a chunked codec made in the residual's own storage a chunk at a time
        (no tensor of |a| allocated or written whole but e itself, from the second round)."""
        if state is None or not self.inner.chunked_input or a.shape != b.shape:
            return self.encode(a.float() - b.float(), state, out=out)
        e = state.get("residual")
        if e is None:
            e = torch.zeros(a.shape, dtype=torch.float32, device=a.device)
        elif e.shape != a.shape or e.device != a.device:
            raise ValueError(f"residual is {tuple(e.shape)} on {e.device}, tensor {tuple(a.shape)} on {a.device}")
        source = _Residual(e, a, b, self.decay)
        payload = self.inner.encode_chunks(source, tuple(a.shape), state.setdefault("inner", {}), out=out)
        state["residual"] = e
        return payload

    def encode(self, tensor: torch.Tensor, state: dict | None = None, *, out: bytearray | None = None) -> bytearray:
        """Everything on ``tensor``'s device; the residual in ``state`` must be there too (the caller
        places it: :mod:`atoll.islands._shard_state` keeps it in host memory between rounds)."""
        x = tensor.detach().to(dtype=torch.float32)
        residual = self._residual(state, x)
        if residual is not None:
            x = torch.add(x, residual, alpha=self.decay)  # alpha 1 is exactly x + residual
        elif tensor.dtype == torch.float32:  # x is a view of the caller's tensor: never written into
            x = x.clone()
        return self._encode_into_residual(x.contiguous(), state, out)

    def encode_consuming(self, x: torch.Tensor, state: dict, *, out: bytearray | None = None) -> bytearray:
        """:meth:`encode` of ``x`` (contiguous float32, the caller's to give up), the same bits, without a
        tensor the size of ``x`` allocated: ``x`` itself becomes the new residual. The old residual's
        storage is the caller's again (read it from ``state`` first)."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError("encode_consuming needs a contiguous float32 tensor")
        residual = self._residual(state, x)
        if residual is not None:
            x.add_(residual, alpha=self.decay)  # the bits of torch.add(x, residual, alpha=decay)
        return self._encode_into_residual(x, state, out)

    @staticmethod
    def _residual(state: dict | None, x: torch.Tensor) -> torch.Tensor | None:
        if state is None:
            raise ValueError("error feedback needs a per-tensor state dict to keep its residual in")
        residual = state.get("residual")
        if residual is not None and (residual.shape != x.shape or residual.device != x.device):
            raise ValueError(
                f"residual is {tuple(residual.shape)} on {residual.device}, tensor {tuple(x.shape)} on {x.device}"
            )
        return residual

    def _encode_into_residual(self, x: torch.Tensor, state: dict, out: bytearray | None) -> bytearray:
        """Encode ``x`` (the input plus the old residual) and leave it holding ``x − D(C(x))``, the residual."""
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
