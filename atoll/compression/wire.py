"""The versioned, self-describing wire format of one encoded tensor.

Layout (little endian)::

    magic    4s   b"ATLC"
    version  u8   WIRE_VERSION
    codec    u8   codec id (see ``CODEC_IDS``)
    dtype    u8   dtype of the original tensor (see ``DTYPE_IDS``)
    ndim     u8   number of dims, <= MAX_NDIM
    shape    ndim x u64
    params   u32 length + bytes   codec parameters (e.g. block size)
    body     u64 length + bytes   codec payload
    crc32c   u32  CRC-32C (Castagnoli) of everything before it

Decoders never trust a length before checking it against the bytes actually present and the
caller's limits, so a truncated, corrupt or oversized payload raises ``WireFormatError``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import google_crc32c
import numpy as np
import torch

MAGIC = b"ATLC"
WIRE_VERSION = 1
MAX_NDIM = 8
_FIXED = struct.Struct("<4sBBBB")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

DTYPE_IDS: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
}
DTYPES_BY_ID = {v: k for k, v in DTYPE_IDS.items()}


def checksum(view: memoryview) -> int:
    """CRC-32C, hardware-accelerated by google-crc32c (~2.5x zlib's crc32 here)."""
    # The extension takes numpy arrays (zero-copy) but refuses memoryviews.
    return google_crc32c.value(np.frombuffer(view, dtype=np.uint8))


class WireFormatError(ValueError):
    """A payload is truncated, corrupt, oversized or does not match what was expected."""


@dataclass(frozen=True)
class Frame:
    """A parsed payload: header fields plus views of the params and body bytes."""

    codec_id: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    params: memoryview
    body: memoryview

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def payload_size(ndim: int, params_len: int, body_len: int) -> int:
    """Bytes of a payload with these parts (e.g. an identity payload: ``payload_size(ndim, 0, 4 * numel)``)."""
    return _FIXED.size + 8 * ndim + _U32.size + params_len + _U64.size + body_len + _U32.size


def header(codec_id: int, dtype: torch.dtype, shape: tuple[int, ...], params: bytes, body_len: int) -> bytes:
    """The bytes of a payload before its body."""
    if dtype not in DTYPE_IDS:
        raise WireFormatError(f"unsupported dtype {dtype}")
    if len(shape) > MAX_NDIM:
        raise WireFormatError(f"tensor has {len(shape)} dims, the wire format allows {MAX_NDIM}")
    return b"".join(
        [
            _FIXED.pack(MAGIC, WIRE_VERSION, codec_id, DTYPE_IDS[dtype], len(shape)),
            struct.pack(f"<{len(shape)}Q", *shape),
            _U32.pack(len(params)),
            params,
            _U64.pack(body_len),
        ]
    )


def parts(codec_id: int, dtype: torch.dtype, shape: tuple[int, ...], params: bytes, body) -> list:
    """A payload whose body is already in memory, as [head, body, crc] without copying the body
    (sent as is: a pull of the full θ serves θ's own memory)."""
    body = memoryview(body).cast("B")
    head = header(codec_id, dtype, shape, params, body.nbytes)
    crc = google_crc32c.extend(google_crc32c.value(head), np.frombuffer(body, dtype=np.uint8))
    return [head, body, _U32.pack(crc)]


def allocate(
    codec_id: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    params: bytes,
    body_len: int,
    out: bytearray | None = None,
):
    """Lay out a payload with room for ``body_len`` body bytes.

    Returns ``(payload, body)``: the codec writes its body into the writable memoryview ``body``,
    then calls :func:`seal` on ``payload``. Writing in place avoids copying large bodies. ``out``,
    if given, is resized and reused as the payload: fresh large buffers cost page faults that can
    exceed the encoding itself, so callers that encode every round pass last round's buffer. A
    writable buffer of fixed size (a memoryview of pinned memory) that has room is used as it is:
    the payload is then a memoryview of its first bytes.
    """
    head = header(codec_id, dtype, shape, params, body_len)
    total = len(head) + body_len + _U32.size
    if out is not None and not isinstance(out, bytearray):
        room = memoryview(out).cast("B")
        if room.readonly or room.nbytes < total:
            raise ValueError(f"a payload of {total} bytes does not fit the {room.nbytes}-byte buffer given")
        payload = room[:total]
        payload[: len(head)] = head
        return payload, payload[len(head) : len(head) + body_len]
    if out is None:
        payload = bytearray(total)
    else:
        payload = out
        if len(payload) > total:
            del payload[total:]
        elif len(payload) < total:
            payload.extend(bytes(total - len(payload)))
    payload[: len(head)] = head
    return payload, memoryview(payload)[len(head) : len(head) + body_len]


def seal(payload):
    """Write the trailing crc32 of a payload laid out by :func:`allocate`."""
    view = memoryview(payload)
    _U32.pack_into(payload, len(payload) - 4, checksum(view[:-4]))
    return payload


def pack(codec_id: int, dtype: torch.dtype, shape: tuple[int, ...], params: bytes, body) -> bytearray:
    """Serialise one encoded tensor whose body is already in a buffer (bytes, memoryview, ndarray)."""
    body = memoryview(body).cast("B")
    payload, dest = allocate(codec_id, dtype, shape, params, body.nbytes)
    dest[:] = body
    return seal(payload)


def peek_codec_id(payload) -> int:
    """The codec id in a payload's header (the payload itself is checked when decoded)."""
    buf = memoryview(payload).cast("B")
    if buf.nbytes < _FIXED.size or bytes(buf[:4]) != MAGIC:
        raise WireFormatError("not an atoll payload (too short or bad magic)")
    return buf[5]


SEALED_DIGEST = 0x48674BC7
"""The crc32c of any sealed payload, taken over all its bytes: data followed by their own crc32c
(little-endian) always checksum to CRC-32C's residue. A file that stores payloads records this as
their digest without reading them again."""


def unpack(payload, *, max_numel: int | None = None, verified: bool = False) -> Frame:
    """Parse and check a payload. ``max_numel`` bounds the tensor the caller is willing to build.
    ``verified``: the caller checked this very payload's crc32c already (it is not read again)."""
    buf = memoryview(payload).cast("B")
    n = buf.nbytes
    if n < _FIXED.size:
        raise WireFormatError(f"payload truncated: {n} bytes is shorter than any valid header")
    magic, version, codec_id, dtype_id, ndim = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise WireFormatError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != WIRE_VERSION:
        raise WireFormatError(f"wire version {version} is not supported (this build reads {WIRE_VERSION})")
    if dtype_id not in DTYPES_BY_ID:
        raise WireFormatError(f"unknown dtype id {dtype_id}")
    if ndim > MAX_NDIM:
        raise WireFormatError(f"{ndim} dims exceeds the limit of {MAX_NDIM}")
    pos = _FIXED.size

    def take(size: int) -> memoryview:
        nonlocal pos
        if size > n - pos:
            raise WireFormatError(f"payload truncated: needs {size} more bytes at offset {pos}, has {n - pos}")
        view = buf[pos : pos + size]
        pos += size
        return view

    shape = struct.unpack(f"<{ndim}Q", take(8 * ndim))
    numel = math.prod(shape)
    if max_numel is not None and numel > max_numel:
        raise WireFormatError(f"payload declares {numel} elements, more than the {max_numel} allowed")
    (params_len,) = _U32.unpack(take(4))
    params = take(params_len)
    (body_len,) = _U64.unpack(take(8))
    body = take(body_len)
    end = pos
    (crc,) = _U32.unpack(take(4))
    if pos != n:
        raise WireFormatError(f"{n - pos} trailing bytes after the payload")
    if not verified and checksum(buf[:end]) != crc:
        raise WireFormatError("payload corrupt: crc32c mismatch")
    return Frame(codec_id, DTYPES_BY_ID[dtype_id], tuple(shape), params, body)
