"""Lossless fp32 (identity) and the fp16 / bf16 casts."""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from atoll.compression import staging
from atoll.compression.base import (
    CHUNK,
    Codec,
    all_finite,
    chunk_elems,
    expect_body,
    norm_bound,
    read_tensor,
    report,
    span,
    to_device,
    to_host,
    weighted,
    write_tensor,
)
from atoll.compression.wire import WireFormatError


class _CastCodec(Codec):
    store: ClassVar[torch.dtype]
    adds_exactly = True
    writes_weighted = True  # as ``alpha * value + 0.0``: a stored -0.0 is written +0.0, as 0 + (-0.0) gives

    @property
    def chunked_input(self) -> bool:
        return True

    def _encode(self, flat, shape, state):
        n = flat.numel()
        step = chunk_elems(flat.device)

        def write(body):
            dest = write_tensor(body, self.store, n)
            for s in range(0, n, step):
                chunk, x = dest[s : s + step], span(flat, s, step)
                to_host(chunk, x)  # cast on the device, copy the stored bytes
                if self.store == torch.float16 and not all_finite(staging.stored(chunk)):
                    raise OverflowError("value outside the fp16 range (|x| > 65504) or non-finite; use bf16")
                report(flat, s, lambda x=x: x if self.store == torch.float32 else x.to(self.store).float())

        return b"", n * self.store.itemsize, write

    def _sizes(self, shape):
        return 0, math.prod(shape) * self.store.itemsize

    def _check(self, frame):
        if frame.params.nbytes:
            raise WireFormatError(f"{self.name}: takes no params, payload has {frame.params.nbytes} bytes")
        expect_body(frame, frame.numel * self.store.itemsize, self.name)

    def _values(self, frame) -> torch.Tensor:
        return read_tensor(frame.body, self.store, frame.numel)

    def _norm_bound(self, frame):
        return norm_bound(self._values(frame))

    def _parts(self, frame, out: torch.Tensor):
        """The stored values a chunk at a time, each with its span of the flat ``out``: (part, target)."""
        v, flat = self._values(frame), out.view(-1)
        step = CHUNK if out.device.type == "cpu" else max(CHUNK, chunk_elems(out.device))
        for s in range(0, v.numel(), step):
            # the stored bytes on the device; a view on the CPU
            yield to_device(v[s : s + step], out.device), span(flat, s, step)

    def _decode_into(self, frame, out, alpha, accumulate):
        for part, target in self._parts(frame, out):
            if accumulate:
                target.add_(weighted(part, alpha))
            else:
                target.copy_(part)

    def write_weighted_(
        self, payload, out: torch.Tensor, alpha: float = 1.0, *, verified: bool = False
    ) -> torch.Tensor:
        """``out = alpha * decode(payload)``, bit for bit what adding it into a zeroed ``out`` gives (the
        product rounded on its own, then ``+ 0.0``), in one pass a chunk at a time instead of zeroing
        ``out`` first: the first contribution to a tensor of the coordinator's sum."""
        self._check_out(out)
        for part, target in self._parts(self.frame(payload, tuple(out.shape), verified=verified), out):
            if alpha != 1.0 and part.dtype == torch.float32:
                torch.mul(part, alpha, out=target)  # = weighted(part, alpha)
            else:
                target.copy_(part)
                if alpha != 1.0:
                    target.mul_(alpha)
            target.add_(0.0)  # -0.0 -> +0.0, every other value as it is
        return out


class IdentityCodec(_CastCodec):
    """Lossless fp32 (float64 input is stored as fp32: the run's master copy is fp32)."""

    name = "identity"
    codec_id = 1
    lossy = False
    store = torch.float32


class Fp16Codec(_CastCodec):
    name = "fp16"
    codec_id = 2
    store = torch.float16


class Bf16Codec(_CastCodec):
    name = "bf16"
    codec_id = 3
    store = torch.bfloat16
