"""Codecs: turn a float tensor into bytes (``encode``) and back (``decode`` / ``decode_add_``).

Every codec writes the self-describing wire format of :mod:`atoll.compression.wire`, so a
payload can be checked and decoded without any side information except the expected shape.
"""

from __future__ import annotations

import struct
from typing import ClassVar

import numpy as np
import torch

from atoll.compression.wire import Frame, WireFormatError, pack, unpack


class Codec:
    """Base class. Subclasses set ``name``/``codec_id`` and implement ``_encode``/``_decode``."""

    name: ClassVar[str]
    codec_id: ClassVar[int]
    lossy: ClassVar[bool] = True

    def encode(self, tensor: torch.Tensor) -> bytes:
        """Encode a floating-point tensor (any device, any float dtype)."""
        if not tensor.is_floating_point():
            raise TypeError(f"{self.name} encodes floating-point tensors, got {tensor.dtype}")
        flat = tensor.detach().reshape(-1).to(device="cpu")
        params, body = self._encode(flat)
        return pack(self.codec_id, tensor.dtype, tuple(tensor.shape), params, body)

    def frame(self, payload, expected_shape: tuple[int, ...] | None = None) -> Frame:
        """Parse a payload and check it belongs to this codec and, if given, the expected shape."""
        max_numel = None if expected_shape is None else _numel(expected_shape)
        frame = unpack(payload, max_numel=max_numel)
        if frame.codec_id != self.codec_id:
            raise WireFormatError(f"payload was encoded with codec id {frame.codec_id}, expected {self.name}")
        if expected_shape is not None and frame.shape != tuple(expected_shape):
            raise WireFormatError(f"payload has shape {list(frame.shape)}, expected {list(expected_shape)}")
        return frame

    def decode(self, payload, expected_shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Decode to a new float32 tensor of the payload's shape."""
        frame = self.frame(payload, expected_shape)
        out = self._decode(frame)
        return out.reshape(frame.shape)

    def decode_add_(self, payload, out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """``out += alpha * decode(payload)`` for a float32 ``out`` of the payload's shape."""
        frame = self.frame(payload, tuple(out.shape))
        out.view(-1).add_(self._decode(frame), alpha=alpha)
        return out

    def _encode(self, flat: torch.Tensor) -> tuple[bytes, object]:
        raise NotImplementedError

    def _decode(self, frame: Frame) -> torch.Tensor:
        raise NotImplementedError


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _body_array(frame: Frame, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    """View ``count`` items of ``dtype`` at the start of the body, checking the size first."""
    need = count * np.dtype(dtype).itemsize
    if frame.body.nbytes != need:
        raise WireFormatError(f"{what}: body is {frame.body.nbytes} bytes, expected {need}")
    return np.frombuffer(frame.body, dtype=dtype, count=count)


class _CastCodec(Codec):
    """Store the values in a narrower float type (or fp32 for identity)."""

    torch_dtype: ClassVar[torch.dtype]
    np_view: ClassVar[np.dtype]

    def _encode(self, flat):
        arr = flat.to(self.torch_dtype).contiguous()
        if self.torch_dtype == torch.bfloat16:
            arr = arr.view(torch.int16)
        return b"", arr.numpy()

    def _decode(self, frame):
        arr = _body_array(frame, self.np_view, frame.numel, self.name)
        t = torch.from_numpy(arr.copy() if not arr.flags.writeable else arr)
        if self.torch_dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        return t.to(torch.float32)


class IdentityCodec(_CastCodec):
    """Lossless fp32."""

    name = "identity"
    codec_id = 1
    lossy = False
    torch_dtype = torch.float32
    np_view = np.dtype("<f4")

    def encode(self, tensor):
        if tensor.dtype == torch.float64:
            # identity means "no loss at fp32": the run's master copy is fp32.
            tensor = tensor.to(torch.float32)
        return super().encode(tensor)


class Fp16Codec(_CastCodec):
    name = "fp16"
    codec_id = 2
    torch_dtype = torch.float16
    np_view = np.dtype("<f2")


class Bf16Codec(_CastCodec):
    name = "bf16"
    codec_id = 3
    torch_dtype = torch.bfloat16
    np_view = np.dtype("<i2")


class Int8BlockCodec(Codec):
    """Blockwise absmax int8: each block of ``block_size`` values shares one fp32 scale."""

    name = "int8"
    codec_id = 4
    _PARAMS = struct.Struct("<I")

    def __init__(self, block_size: int = 256) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size

    def _encode(self, flat):
        n = flat.numel()
        b = self.block_size
        nblocks = -(-n // b)
        x = flat.to(torch.float32)
        if nblocks * b != n:
            x = torch.nn.functional.pad(x, (0, nblocks * b - n))
        x = x.view(nblocks, b)
        scale = x.abs().amax(dim=1) / 127.0
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(x * inv[:, None]).clamp_(-127, 127).to(torch.int8)
        body = scale.numpy().tobytes() + q.reshape(-1)[:n].numpy().tobytes()
        return self._PARAMS.pack(b), body

    def _decode(self, frame):
        if frame.params.nbytes != self._PARAMS.size:
            raise WireFormatError(f"int8: params are {frame.params.nbytes} bytes, expected {self._PARAMS.size}")
        (b,) = self._PARAMS.unpack(frame.params)
        if b == 0:
            raise WireFormatError("int8: block size 0")
        n = frame.numel
        nblocks = -(-n // b)
        need = 4 * nblocks + n
        if frame.body.nbytes != need:
            raise WireFormatError(f"int8: body is {frame.body.nbytes} bytes, expected {need}")
        scale = torch.from_numpy(np.frombuffer(frame.body, dtype="<f4", count=nblocks).copy())
        q = torch.from_numpy(np.frombuffer(frame.body, dtype=np.int8, count=n, offset=4 * nblocks).copy())
        out = torch.empty(nblocks * b, dtype=torch.float32)
        out[:n] = q
        out[n:] = 0
        out = out.view(nblocks, b).mul_(scale[:, None]).view(-1)[:n]
        return out


_REGISTRY: dict[str, type[Codec]] = {cls.name: cls for cls in (IdentityCodec, Fp16Codec, Bf16Codec, Int8BlockCodec)}


def available_codecs() -> list[str]:
    """Names accepted by :func:`get_codec`."""
    return sorted(_REGISTRY)


def get_codec(name: str) -> Codec:
    """A codec by name, e.g. ``"identity"``, ``"bf16"``, ``"int8"``."""
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(available_codecs())}") from None
