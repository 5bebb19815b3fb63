"""The coordinator's safetensors files (snapshots, log records), written and checked before anything in
them is trusted or allocated.

- The safetensors header is read with bounds (its length against the file's), every tensor's dtype,
  shape and byte range against each other and the file, with no overlaps.
- Every tensor's bytes are checksummed as they lie in the file, a block at a time (nothing the size
  of a tensor is allocated), so a damaged or hand-made file declaring gigabytes is refused before it
  is read into memory; what passes must still fit in this machine's memory.
- The metadata (config, round, membership, history, ...) carries a checksum of its own, so rewriting
  a field (outer_lr 0.7 -> 7.0) without the tensors is refused like a flipped bit.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import google_crc32c
import numpy as np
import torch

from atoll.compression.wire import SEALED_DIGEST
from atoll.files import write_atomic

META_DIGEST = "meta_digest"
TRAILERS = "trailers"
"""Metadata of a file of sealed payloads (each ends in its own crc32c, so its digest is the residue
:data:`~atoll.compression.wire.SEALED_DIGEST` whatever it holds): those last four bytes, per tensor, in hex.
With them the header names every tensor's content, as a file of plain digests does (:func:`header_of`)."""
MAX_HEADER_BYTES = 100 << 20
READ_BLOCK = 8 << 20
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class IntegrityError(ValueError):
    """What is wrong with the file, in a few words."""


def metadata_digest(metadata: dict[str, str]) -> str:
    """CRC-32C of the metadata's canonical JSON (without the digest itself)."""
    body = json.dumps({k: v for k, v in metadata.items() if k != META_DIGEST}, sort_keys=True).encode()
    return f"{google_crc32c.value(body):08x}"


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _raw_header(path: Path) -> tuple[int, bytes]:
    """(the file's size, its header as it lies there: the length, then the JSON), read with bounds."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise IntegrityError(f"{size} bytes: too short for a header")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise IntegrityError(f"header of {n} bytes in a file of {size}")
        return size, head + f.read(n)


def check_file(path: Path, *, require_meta_digest: bool) -> dict[str, str]:
    """Check ``path`` as described above; returns its metadata. IntegrityError otherwise."""
    size, raw = _raw_header(path)
    n = len(raw) - 8
    try:
        header = json.loads(raw[8:])
    except (ValueError, RecursionError):
        raise IntegrityError("header is not JSON") from None
    if not isinstance(header, dict):
        raise IntegrityError("header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise IntegrityError("metadata is not a string map")
    recorded = metadata.get(META_DIGEST)
    if recorded is None and require_meta_digest:
        raise IntegrityError("metadata has no checksum")
    if recorded is not None and recorded != metadata_digest(metadata):
        raise IntegrityError(f"metadata fails its checksum (crc32c {metadata_digest(metadata)}, recorded {recorded})")
    spans = _spans(header, size - 8 - n)
    total = sum(end - begin for begin, end in spans.values())
    if total > memory_bytes():
        raise IntegrityError(f"its tensors declare {total} bytes, more than this machine's memory")
    try:
        digests = json.loads(metadata.get("digests", "{}"))
    except ValueError:
        raise IntegrityError("metadata digests are not JSON") from None
    if set(digests) != set(spans):
        raise IntegrityError(f"tensors {sorted(set(spans) ^ set(digests))[:3]} have no checksum or no data")
    try:
        trailers = json.loads(metadata.get(TRAILERS, "{}"))
    except ValueError:
        raise IntegrityError("metadata trailers are not JSON") from None
    if not isinstance(trailers, dict) or not set(trailers) <= set(spans):
        raise IntegrityError("metadata trailers name tensors the file does not hold")
    _check_digests(path, 8 + n, spans, digests, trailers)
    return metadata


def header_of(path: Path) -> tuple[bytes, bool]:
    """The header of the file at ``path`` as it lies there (its length, then the JSON), and whether it
    names the content of every tensor (each one's digest, or for a sealed payload its trailer): two
    files with the same such header that both pass :func:`check_file` hold the same bytes. IntegrityError
    when it is not a header."""
    _, raw = _raw_header(path)
    try:
        metadata = json.loads(raw[8:]).get("__metadata__") or {}
        digests = json.loads(metadata.get("digests", "{}"))
        trailers = json.loads(metadata.get(TRAILERS, "{}"))
    except (ValueError, AttributeError, TypeError):
        raise IntegrityError("header is not a JSON object with string metadata") from None
    sealed = f"{SEALED_DIGEST:08x}"
    names_content = all(d != sealed or k in trailers for k, d in digests.items())
    return raw, names_content


def _spans(header: dict, data_bytes: int) -> dict[str, tuple[int, int]]:
    spans = {}
    for key, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            numel = math.prod(int(d) for d in shape)
            want = numel * DTYPE_BYTES[dtype]
        except (KeyError, TypeError, ValueError):
            raise IntegrityError(f"tensor {key}: malformed entry") from None
        if any(int(d) < 0 for d in shape) or not 0 <= begin <= end <= data_bytes or end - begin != want:
            raise IntegrityError(
                f"tensor {key}: {dtype}{list(shape)} needs {want} bytes, spans {begin}..{end} of {data_bytes}"
            )
        spans[key] = (begin, end)
    ordered = sorted(spans.values())
    if any(a_end > b_begin for (_, a_end), (b_begin, _) in zip(ordered, ordered[1:], strict=False)):
        raise IntegrityError("tensors overlap")
    return spans


def _check_digests(
    path: Path, base: int, spans: dict[str, tuple[int, int]], digests: dict[str, str], trailers: dict[str, str]
) -> None:
    """Each tensor's CRC-32C, read a block at a time into one small buffer (nothing the size of a
    tensor is allocated or mapped); and a sealed payload's last four bytes against ``trailers``."""
    block = np.empty(READ_BLOCK, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        for key, (begin, end) in sorted(spans.items(), key=lambda kv: kv[1]):
            f.seek(base + begin)
            crc, left = 0, end - begin
            while left:
                got = f.readinto(memoryview(block)[: min(left, READ_BLOCK)])
                if not got:
                    raise IntegrityError(f"tensor {key}: the file ends inside it")
                crc = google_crc32c.extend(crc, block[:got])  # a numpy view: crc32c takes it as is
                left -= got
            if f"{crc:08x}" != digests[key]:
                raise IntegrityError(f"tensor {key} fails its checksum (crc32c {crc:08x}, recorded {digests[key]})")
            if key in trailers:
                f.seek(base + max(begin, end - 4))
                if f.read(end - max(begin, end - 4)).hex() != trailers[key]:
                    raise IntegrityError(f"tensor {key} does not end in its recorded checksum")


# ---- writing ------------------------------------------------------------------------------------
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _bytes_of(t) -> np.ndarray:
    """A CPU tensor's (or a bytes-like's) bytes as a flat uint8 array over its own memory (no copy
    when contiguous)."""
    if not isinstance(t, torch.Tensor):
        return np.frombuffer(t, dtype=np.uint8)
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def write_file(
    path: Path, tensors: dict, metadata: dict[str, str], *, durable: bool = True, digests: dict[str, str] | None = None
) -> None:
    """Write a safetensors file that :func:`check_file` accepts: every tensor's digest and the
    metadata's own in its metadata, the tensors' bytes written straight from their memory (no
    serialised copy of them is built). Atomic: a temporary file, fsynced, renamed, the directory
    fsynced (``durable=False``: renamed only, for a cache). A value that is not a tensor is bytes (U8).
    ``digests``: some tensors' digests known already (not computed again)."""
    path = Path(path)
    arrays = {k: _bytes_of(v) for k, v in tensors.items()}
    known = digests or {}
    crcs = {k: known.get(k) or f"{google_crc32c.value(a):08x}" for k, a in arrays.items()}
    head = header_bytes(tensors, metadata, crcs)
    write_atomic(path, [head, *(memoryview(a) for a in arrays.values())], durable)


def header_bytes(tensors: dict, metadata: dict[str, str], digests: dict[str, str], size: int = 0) -> bytes:
    """The header of a file of ``tensors`` (their bytes laid out in this order right after it): the
    length, then the JSON padded with spaces to a multiple of 8 bytes, or to exactly ``size`` bytes in
    all (ValueError if it does not fit). ``digests``: every tensor's CRC-32C, in hex."""
    meta = {**metadata, "digests": json.dumps(digests)}
    meta[META_DIGEST] = metadata_digest(meta)
    header: dict = {"__metadata__": meta}
    offset = 0
    for k, v in tensors.items():
        n = v.nbytes if isinstance(v, torch.Tensor) else memoryview(v).nbytes
        dtype, shape = (SAFETENSORS_DTYPES[v.dtype], list(v.shape)) if isinstance(v, torch.Tensor) else ("U8", [n])
        header[k] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    pad = -len(head) % 8 if not size else size - 8 - len(head)
    if pad < 0:
        raise ValueError(f"a header of {len(head) + 8} bytes does not fit in {size}")
    return struct.pack("<Q", len(head) + pad) + head + b" " * pad
