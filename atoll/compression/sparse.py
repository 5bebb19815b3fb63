"""``sparse``: per-chunk top-k, values in a few bits, compact indices (SparseLoCo's recipe).

Each chunk of ``chunk`` consecutive values keeps its ``k = round(density * chunk)`` largest magnitudes
(a last, shorter chunk keeps ``min(k, its length)``). The kept values are quantised to ``bits`` bits on
odd levels ``(2j - L) * s``, ``L = 2^bits - 1``, ``s`` = the chunk's largest kept magnitude / L (2 bits:
±s, ±3s; no zero: a value sits on a level at most s away, and error feedback carries the rest). Each
index is its offset in its chunk in ``w = bit_length(chunk - 1)`` bits, or the chunk's bitmap where
that is smaller (a density above 1/w): both fixed for a spec and a shape, so the payload's size is
known before it is encoded, as a push header declares it.

Body: the chunks' scales (fp32), the codes (``bits`` each), then the offsets (``w`` bits each) or the
bitmap (one bit per value), each packed little-end-first. Params: ``chunk, k, bits, coding``.

Decoding adds ``K`` values at their indices (O(K), not O(numel)). Every size-like field is checked
against the tensor's size and the body's length before anything is allocated for it, and the indices
are checked inside their chunks and strictly increasing (the bitmap: exactly ``k`` set a chunk).
"""

from __future__ import annotations

import math
import struct
from typing import ClassVar

import numpy as np
import torch

from atoll.compression.base import (
    Codec,
    expect_body,
    expect_params,
    norm_bound,
    read_tensor,
    to_host,
    weighted,
    write_tensor,
)
from atoll.compression.wire import WireFormatError

_PARAMS = struct.Struct("<IIBB")  # chunk, k, bits, coding
OFFSETS, BITMAP = 0, 1
MAX_CHUNK = 1 << 20


def offset_bits(chunk: int) -> int:
    return max(1, (chunk - 1).bit_length())


def layout(n: int, chunk: int, k: int) -> tuple[int, int, int]:
    """(full chunks, the last chunk's length (0: none), values kept in all: K)."""
    full, tail = divmod(n, chunk)
    return full, tail, full * k + min(k, tail)


def counts_of(chunks: int, tail: int, k: int) -> np.ndarray:
    """Values kept in each chunk: ``k``, and ``min(k, tail)`` in a last, shorter chunk."""
    counts = np.full(chunks, k, dtype=np.int64)
    if tail:
        counts[-1] = min(k, tail)
    return counts


def coding_for(chunk: int, k: int) -> int:
    """Offsets or a bitmap, whichever is smaller: k offsets of w bits, or ``chunk`` bits."""
    return OFFSETS if k * offset_bits(chunk) <= chunk else BITMAP


def body_len(n: int, chunk: int, k: int, bits: int, coding: int) -> int:
    full, tail, total = layout(n, chunk, k)
    chunks = full + (1 if tail else 0)
    index_bytes = -(-total * offset_bits(chunk) // 8) if coding == OFFSETS else -(-n // 8)
    return 4 * chunks + -(-total * bits // 8) + index_bytes


def pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Non-negative integers below 2^width, ``width`` bits each, packed little-end-first."""
    shifts = np.arange(width, dtype=np.int64)
    bits = ((values.astype(np.int64)[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little")


def unpack_bits(buf: memoryview, count: int, width: int) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), count=count * width, bitorder="little")
    return (bits.reshape(count, width).astype(np.int64) << np.arange(width, dtype=np.int64)).sum(axis=1)


class SparseCodec(Codec):
    name = "sparse"
    codec_id = 10
    params: ClassVar[dict[str, type]] = {"density": float, "bits": int, "chunk": int}

    def __init__(self, density: float = 1 / 128, bits: int = 2, chunk: int = 4096) -> None:
        if not 0 < density <= 1:
            raise ValueError(f"sparse: density must be in (0, 1], got {density}")
        if not 1 <= bits <= 8:
            raise ValueError(f"sparse: bits must be in 1..8, got {bits}")
        if not 8 <= chunk <= MAX_CHUNK:
            raise ValueError(f"sparse: chunk must be in 8..{MAX_CHUNK}, got {chunk}")
        self.density, self.bits, self.chunk = density, bits, chunk
        self.k = min(chunk, max(1, round(density * chunk)))

    @property
    def spec(self) -> str:
        return f"sparse:density={self.density:g},bits={self.bits},chunk={self.chunk}"

    # ---- encoding ---------------------------------------------------------------------------------
    def _select(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sorted offsets in their chunks, the kept values, each chunk's count), on ``flat``'s device."""
        n, c, k = flat.numel(), self.chunk, self.k
        full, tail, _ = layout(n, c, k)
        offsets, values, counts = [], [], []
        if full:
            x = flat.narrow(0, 0, full * c).view(full, c)
            top = torch.topk(x.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
            offsets.append(top.reshape(-1))
            values.append(torch.gather(x, 1, top).reshape(-1))
            counts += [k] * full
        if tail:
            t = flat.narrow(0, full * c, tail)
            kt = min(k, tail)
            top = torch.topk(t.abs(), kt, sorted=False).indices.sort().values
            offsets.append(top)
            values.append(t[top])
            counts.append(kt)
        device = flat.device

        def cat(xs, dtype):
            return torch.cat(xs) if xs else torch.empty(0, dtype=dtype, device=device)

        return cat(offsets, torch.int64), cat(values, torch.float32), torch.tensor(counts, device=device)

    def _encode(self, flat, shape, state):
        n, coding = flat.numel(), coding_for(self.chunk, self.k)
        params = _PARAMS.pack(self.chunk, self.k, self.bits, coding)

        def write(body: memoryview) -> None:
            offsets, values, counts = self._select(flat)
            level = (1 << self.bits) - 1
            chunk_of = torch.repeat_interleave(torch.arange(counts.numel(), device=flat.device), counts)
            top = torch.zeros(counts.numel(), device=flat.device).scatter_reduce_(
                0, chunk_of, values.abs(), reduce="amax", include_self=True
            )
            scales = top / level
            s = scales[chunk_of]
            q = torch.where(s > 0, values / torch.where(s > 0, s, 1.0), 0.0)
            codes = torch.round((q + level) / 2).clamp_(0, level).to(torch.int64)
            pos = 0
            to_host(write_tensor(body, torch.float32, counts.numel()), scales)
            pos += 4 * counts.numel()
            packed = pack_bits(codes.cpu().numpy(), self.bits)  # (payload-sized: the host packs the bits)
            body[pos : pos + packed.nbytes] = packed.tobytes()
            pos += packed.nbytes
            if coding == OFFSETS:
                packed = pack_bits(offsets.cpu().numpy(), offset_bits(self.chunk))
            else:
                starts = torch.arange(counts.numel(), device=flat.device) * self.chunk
                bitmap = np.zeros(n, dtype=np.uint8)
                bitmap[(offsets + starts[chunk_of]).cpu().numpy()] = 1
                packed = np.packbits(bitmap, bitorder="little")
            body[pos : pos + packed.nbytes] = packed.tobytes()

        return params, body_len(n, self.chunk, self.k, self.bits, coding), write

    def _sizes(self, shape):
        n = math.prod(shape)
        return _PARAMS.size, body_len(n, self.chunk, self.k, self.bits, coding_for(self.chunk, self.k))

    # ---- decoding ---------------------------------------------------------------------------------
    def _params(self, frame) -> tuple[int, int, int, int]:
        chunk, k, bits, coding = expect_params(frame, _PARAMS, self.name)
        if not 8 <= chunk <= MAX_CHUNK or not 1 <= k <= chunk or not 1 <= bits <= 8 or coding not in (OFFSETS, BITMAP):
            raise WireFormatError(f"sparse: bad params chunk={chunk} k={k} bits={bits} coding={coding}")
        return chunk, k, bits, coding

    def _check(self, frame):
        chunk, k, bits, coding = self._params(frame)
        expect_body(frame, body_len(frame.numel, chunk, k, bits, coding), self.name)
        self._indices(frame)  # inside their chunks, strictly increasing (the bitmap: k set in each)

    def _conforms(self, frame):
        chunk, k, bits, coding = self._params(frame)
        if (chunk, k, bits, coding) != (self.chunk, self.k, self.bits, coding_for(self.chunk, self.k)):
            raise WireFormatError(f"sparse: chunk={chunk} k={k} bits={bits} coding={coding}, not the run's {self.spec}")

    def _parts(self, frame):
        """(params, full chunks, tail, K, the chunk count, each part's byte offset in the body)."""
        chunk, k, bits, coding = self._params(frame)
        full, tail, total = layout(frame.numel, chunk, k)
        chunks = full + (1 if tail else 0)
        codes_at = 4 * chunks
        return (chunk, k, bits, coding), full, tail, total, chunks, codes_at, codes_at + -(-total * bits // 8)

    def _indices(self, frame) -> np.ndarray:
        """The kept values' indices in the tensor (int64), checked."""
        (chunk, k, _, coding), full, tail, total, chunks, _, at = self._parts(frame)
        counts = counts_of(chunks, tail, k)
        starts = np.arange(chunks, dtype=np.int64) * chunk
        if coding == BITMAP:
            bitmap = np.unpackbits(np.frombuffer(frame.body[at:], dtype=np.uint8), count=frame.numel, bitorder="little")
            index = np.flatnonzero(bitmap)
            per = np.bincount(index // chunk, minlength=chunks) if index.size else np.zeros(chunks, dtype=np.int64)
            if index.size != total or not np.array_equal(per, counts):
                raise WireFormatError("sparse: the bitmap's counts disagree with the header")
            return index
        offsets = unpack_bits(frame.body[at:], total, offset_bits(chunk))
        chunk_of = np.repeat(np.arange(chunks, dtype=np.int64), counts)
        lengths = np.full(chunks, chunk, dtype=np.int64)
        if tail:
            lengths[-1] = tail
        if total and (offsets >= lengths[chunk_of]).any():
            raise WireFormatError("sparse: an index lies outside its chunk")
        same = chunk_of[1:] == chunk_of[:-1]
        if total > 1 and (offsets[1:][same] <= offsets[:-1][same]).any():
            raise WireFormatError("sparse: indices must be strictly increasing in their chunk")
        return starts[chunk_of] + offsets

    def _values(self, frame, device) -> torch.Tensor:
        (_, k, bits, _), full, tail, total, chunks, codes_at, _ = self._parts(frame)
        scales = read_tensor(frame.body, torch.float32, chunks)
        counts = torch.from_numpy(counts_of(chunks, tail, k))
        codes = torch.from_numpy(unpack_bits(frame.body[codes_at:], total, bits)).to(device)
        level = (1 << bits) - 1
        s = torch.repeat_interleave(scales.to(device), counts.to(device))
        return (2 * codes - level).to(torch.float32) * s

    def _norm_bound(self, frame):
        (_, k, bits, _), _, tail, _, chunks, _, _ = self._parts(frame)
        scales = read_tensor(frame.body, torch.float32, chunks).to(torch.float64)
        counts = torch.from_numpy(counts_of(chunks, tail, k)).to(torch.float64)
        return norm_bound((scales * counts.sqrt()).to(torch.float32), float((1 << bits) - 1))

    def _decode_into(self, frame, out, alpha, accumulate):
        index = torch.from_numpy(self._indices(frame)).to(out.device)
        values = self._values(frame, out.device)
        if accumulate:
            out.index_add_(0, index, weighted(values, alpha))  # O(K): only what the payload holds
        else:
            out.zero_()
            out[index] = values
