"""``sparse``: per-chunk top-k, values in a few bits, compact indices (SparseLoCo's recipe).

Each chunk of ``chunk`` consecutive values keeps its ``k = round(density * chunk)`` largest magnitudes;
a last, shorter chunk of ``t`` values keeps its share, ``max(1, round(k * t / chunk))`` (at most ``t``).
The kept values are quantised to ``bits`` bits on odd levels ``(2j - L) * s``, ``L = 2^bits - 1``,
``s`` = the chunk's largest kept magnitude / L rounded to bfloat16 (2 bits: ±s, ±3s; no zero: a value
sits on a level at most s away, and error feedback carries the rest).

The indices, sorted in each chunk, are coded in whichever of three fixed-size forms is smallest for
the chunk and ``k`` (fixed for a spec and a shape, so the payload's size is known before it is
encoded, as a push header declares it):

- Elias-Fano (the default's: 9 bits an index at 1/128 of 4096): each offset's ``l = floor(log2(chunk
  / k))`` low bits as they are, and its high part ``h = offset >> l`` in unary, as the set bit ``h + i``
  (the i-th offset of the chunk) of the chunk's ``count + ((length - 1) >> l) + 1`` bits: the Rice code
  of the sorted gaps, laid out so every chunk takes the same bits;
- offsets: ``w = bit_length(chunk - 1)`` bits each;
- a bitmap: one bit a value (from a density of about 1/w up).

Body: the chunks' scales (bfloat16), the codes (``bits`` each), then the indices: Elias-Fano's low
bits of every index, then every chunk's high bits; or the offsets; or the bitmap. Each packed
little-end-first. Params: ``chunk, k, bits, coding``.

Decoding adds ``K`` values at their indices (O(K), not O(numel)). Every size-like field is checked
against the tensor's size and the body's length before anything is allocated for it, and the indices
are checked inside their chunks and strictly increasing (Elias-Fano and the bitmap: exactly each
chunk's count of bits set in its span).
"""

from __future__ import annotations

import math
import struct
from typing import ClassVar

import numpy as np
import torch

from atoll.compression.base import (
    Codec,
    chunk_elems,
    expect_body,
    expect_params,
    norm_bound,
    read_tensor,
    report,
    span,
    to_host,
    weighted,
    write_tensor,
)
from atoll.compression.wire import WireFormatError

_PARAMS = struct.Struct("<IIBB")  # chunk, k, bits, coding
OFFSETS, BITMAP, ELIAS_FANO = 0, 1, 2
CODINGS = (OFFSETS, BITMAP, ELIAS_FANO)
MAX_CHUNK = 1 << 20


def offset_bits(chunk: int) -> int:
    return max(1, (chunk - 1).bit_length())


def low_bits(chunk: int, k: int) -> int:
    """Elias-Fano's low bits an index: ``floor(log2(chunk / k))``."""
    return max(1, chunk // k).bit_length() - 1


def tail_count(k: int, chunk: int, tail: int) -> int:
    """Values a last chunk of ``tail`` values keeps: its share of ``k``, at least one."""
    return min(tail, max(1, (k * tail + chunk // 2) // chunk))


class Layout:
    """Where everything lies in the body of a payload of ``n`` values (params ``chunk, k, bits,
    coding``), all from integers already bounded."""

    def __init__(self, n: int, chunk: int, k: int, bits: int, coding: int) -> None:
        self.n, self.chunk, self.k, self.bits, self.coding = n, chunk, k, bits, coding
        self.full, self.tail = divmod(n, chunk)
        self.tail_k = tail_count(k, chunk, self.tail) if self.tail else 0
        self.chunks = self.full + (1 if self.tail else 0)
        self.total = self.full * k + self.tail_k
        self.low = low_bits(chunk, k)
        self.span = k + ((chunk - 1) >> self.low) + 1  # Elias-Fano's high bits of a full chunk
        self.tail_span = self.tail_k + ((self.tail - 1) >> self.low) + 1 if self.tail else 0
        self.codes_at = 2 * self.chunks
        self.index_at = self.codes_at + -(-self.total * bits // 8)
        if coding == OFFSETS:
            index_bits = self.total * offset_bits(chunk)
        elif coding == BITMAP:
            index_bits = n
        else:
            self.high_at = self.index_at + -(-self.total * self.low // 8)
            index_bits = 8 * (self.high_at - self.index_at) + self.full * self.span + self.tail_span
        self.body_len = self.index_at + -(-index_bits // 8)

    def counts(self) -> np.ndarray:
        counts = np.full(self.chunks, self.k, dtype=np.int64)
        if self.tail:
            counts[-1] = self.tail_k
        return counts


def chunk_bits(chunk: int, k: int, coding: int) -> int:
    if coding == OFFSETS:
        return k * offset_bits(chunk)
    if coding == BITMAP:
        return chunk
    low = low_bits(chunk, k)
    return k * low + k + ((chunk - 1) >> low) + 1


def coding_for(chunk: int, k: int) -> int:
    """The smallest coding of a chunk's ``k`` indices (Elias-Fano first on a tie, then offsets)."""
    return min((ELIAS_FANO, OFFSETS, BITMAP), key=lambda c: chunk_bits(chunk, k, c))


def _group(width: int) -> tuple[int, int]:
    """(values, bytes) of the smallest run of ``width``-bit values that ends on a byte."""
    values = 8 // math.gcd(width, 8)
    return values, values * width // 8


def pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Non-negative integers below 2^width (width <= 16), ``width`` bits each, packed little-end-first:
    a run of values that ends on a byte at a time, as one 64-bit word, where one fits."""
    count, (per, nbytes) = values.size, _group(width)
    if nbytes > 8:  # 9, 11, 13, 15 bits: bit by bit
        bits = np.unpackbits(values.astype("<u2").view(np.uint8), bitorder="little").reshape(-1, 16)
        return np.packbits(bits[:, :width], bitorder="little")
    groups = -(-count // per)
    v = np.zeros(groups * per, dtype=np.uint64)
    v[:count] = values
    shifts = np.arange(per, dtype=np.uint64) * np.uint64(width)
    words = np.bitwise_or.reduce(v.reshape(groups, per) << shifts, axis=1).astype("<u8")
    return words.view(np.uint8).reshape(groups, 8)[:, :nbytes].reshape(-1)[: -(-count * width // 8)]


def unpack_bits(buf: memoryview, count: int, width: int) -> np.ndarray:
    """``count`` integers of ``width`` bits (<= 16) packed little-end-first (uint8 or uint16)."""
    raw, (per, nbytes) = np.frombuffer(buf, dtype=np.uint8), _group(width)
    used = -(-count * width // 8)
    dtype = np.uint8 if width <= 8 else np.uint16
    mask = (1 << width) - 1
    if nbytes > 8:  # each value from the 3 bytes it lies in
        padded = np.zeros(used + 3, dtype=np.uint8)
        padded[:used] = raw[:used]
        pos = np.arange(count, dtype=np.int64) * width
        at = pos >> 3
        word = (
            padded[at].astype(np.uint32)
            | padded[at + 1].astype(np.uint32) << 8
            | padded[at + 2].astype(np.uint32) << 16
        )
        return ((word >> (pos & 7).astype(np.uint32)) & mask).astype(dtype)
    groups = -(-count // per)
    words = np.zeros((groups, 8), dtype=np.uint8)
    flat = np.zeros(groups * nbytes, dtype=np.uint8)
    flat[:used] = raw[:used]
    words[:, :nbytes] = flat.reshape(groups, nbytes)
    shifts = np.arange(per, dtype=np.uint64) * np.uint64(width)
    return ((words.view("<u8") >> shifts) & np.uint64(mask)).reshape(-1)[:count].astype(dtype)


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
        self.coding = coding_for(chunk, self.k)

    @property
    def spec(self) -> str:
        return f"sparse:density={self.density:g},bits={self.bits},chunk={self.chunk}"

    def layout(self, n: int) -> Layout:
        return Layout(n, self.chunk, self.k, self.bits, self.coding)

    @property
    def chunked_input(self) -> bool:
        return True  # chunks are encoded independently, a cache-sized block of them at a time

    # ---- encoding ---------------------------------------------------------------------------------
    def _encode(self, flat, shape, state):
        lay = self.layout(flat.numel())
        params = _PARAMS.pack(self.chunk, self.k, self.bits, self.coding)

        def write(body: memoryview) -> None:
            offsets, codes, scales = self._select(flat, lay)
            to_host(write_tensor(body, torch.bfloat16, lay.chunks), scales)
            host_offsets = offsets.cpu().numpy()  # (payload-sized: the host packs the bits)
            self._put(body, lay.codes_at, pack_bits(codes.cpu().numpy(), self.bits))
            if lay.coding == OFFSETS:
                self._put(body, lay.index_at, pack_bits(host_offsets, offset_bits(self.chunk)))
            elif lay.coding == BITMAP:
                bitmap = np.zeros(lay.n, dtype=np.uint8)
                bitmap[host_offsets + self._starts(lay)] = 1
                self._put(body, lay.index_at, np.packbits(bitmap, bitorder="little"))
            else:
                self._put(body, lay.index_at, pack_bits(host_offsets & ((1 << lay.low) - 1), lay.low))
                high = np.zeros(8 * (lay.body_len - lay.high_at), dtype=np.uint8)
                high[(host_offsets >> lay.low) + self._high_base(lay)] = 1
                self._put(body, lay.high_at, np.packbits(high, bitorder="little"))

        return params, lay.body_len, write

    @staticmethod
    def _put(body: memoryview, at: int, packed: np.ndarray) -> None:
        body[at : at + packed.nbytes] = packed.tobytes()

    def _select(self, flat, lay: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(offsets sorted in their chunks (int64), their codes (uint8), each chunk's scale (bf16)) of
        a flat tensor or a :class:`Chunks` input, on its device: a cache-sized block of chunks at a
        time (one kernel on an accelerator), read once and in order, their magnitudes in one reused
        buffer. A :class:`Chunks` input that wants it is told each block's decoded values."""
        level, device = (1 << self.bits) - 1, flat.device
        offsets = torch.empty(lay.total, dtype=torch.int64, device=device)
        codes = torch.empty(lay.total, dtype=torch.uint8, device=device)
        scales = torch.empty(lay.chunks, dtype=torch.bfloat16, device=device)
        block = max(1, chunk_elems(device) // lay.chunk)
        scratch = torch.empty(min(block, max(1, lay.full)) * lay.chunk, device=device)
        row, kept = 0, 0
        for start, rows, length, keep in self._groups(lay):
            for first in range(0, rows, block):
                n = min(block, rows - first)
                at = start + first * length
                x = span(flat, at, n * length).view(n, length)
                mag = torch.abs(x, out=scratch[: n * length].view(n, length))
                top = torch.topk(mag, keep, dim=1, sorted=False).indices.sort(dim=1).values
                v = torch.gather(x, 1, top)
                s = scales.narrow(0, row, n)
                s.copy_(v.abs().amax(dim=1).div_(level))  # rounded to bfloat16 as it is stored
                per = s.float()[:, None]
                q = torch.where(per > 0, v / torch.where(per > 0, per, 1.0), 0.0)
                c = torch.round((q + level) / 2).clamp_(0, level)
                offsets.narrow(0, kept, n * keep).copy_(top.view(-1))
                codes.narrow(0, kept, n * keep).copy_(c.view(-1))

                def decoded(x=x, top=top, c=c, per=per, n=n, length=length) -> torch.Tensor:
                    out = scratch[: n * length].view(n, length).zero_()  # (the magnitudes are done with)
                    return out.scatter_(1, top, (2 * c - level) * per).view(-1)  # as _values makes them

                report(flat, at, decoded)
                row, kept = row + n, kept + n * keep
        return offsets, codes, scales

    @staticmethod
    def _groups(lay: Layout):
        """(first value, chunks, chunk length, values kept a chunk) of the full chunks and the last one."""
        if lay.full:
            yield 0, lay.full, lay.chunk, lay.k
        if lay.tail:
            yield lay.full * lay.chunk, 1, lay.tail, lay.tail_k

    @staticmethod
    def _starts(lay: Layout) -> np.ndarray:
        """Each kept value's chunk's first index in the tensor."""
        return np.repeat(np.arange(lay.chunks, dtype=np.int64) * lay.chunk, lay.counts())

    @staticmethod
    def _high_base(lay: Layout) -> np.ndarray:
        """Each kept value's bit in its chunk's Elias-Fano high bits but for its high part: the chunk's
        first bit plus the value's rank in its chunk."""
        base = np.repeat(np.arange(lay.full, dtype=np.int64) * lay.span, lay.k).reshape(lay.full, lay.k)
        base += np.arange(lay.k, dtype=np.int64)
        tail = lay.full * lay.span + np.arange(lay.tail_k, dtype=np.int64)
        return np.concatenate([base.reshape(-1), tail])

    def _sizes(self, shape):
        return _PARAMS.size, self.layout(math.prod(shape)).body_len

    # ---- decoding ---------------------------------------------------------------------------------
    def _layout_of(self, frame) -> Layout:
        chunk, k, bits, coding = expect_params(frame, _PARAMS, self.name)
        if not 8 <= chunk <= MAX_CHUNK or not 1 <= k <= chunk or not 1 <= bits <= 8 or coding not in CODINGS:
            raise WireFormatError(f"sparse: bad params chunk={chunk} k={k} bits={bits} coding={coding}")
        return Layout(frame.numel, chunk, k, bits, coding)

    def _check(self, frame):
        lay = self._layout_of(frame)
        expect_body(frame, lay.body_len, self.name)
        self._indices(frame, lay)  # inside their chunks, strictly increasing, each chunk's count

    def _conforms(self, frame):
        lay = self._layout_of(frame)
        if (lay.chunk, lay.k, lay.bits, lay.coding) != (self.chunk, self.k, self.bits, self.coding):
            raise WireFormatError(
                f"sparse: chunk={lay.chunk} k={lay.k} bits={lay.bits} coding={lay.coding}, not the run's {self.spec}"
            )

    def _indices(self, frame, lay: Layout) -> np.ndarray:
        """The kept values' indices in the tensor (int64), checked."""
        body, total = frame.body, lay.total
        if lay.coding == BITMAP:
            bitmap = np.unpackbits(np.frombuffer(body[lay.index_at :], dtype=np.uint8), count=lay.n, bitorder="little")
            index = np.flatnonzero(bitmap)
            per = np.bincount(index // lay.chunk, minlength=lay.chunks) if index.size else np.zeros(0, dtype=np.int64)
            if index.size != total or not np.array_equal(per, lay.counts()):
                raise WireFormatError("sparse: the bitmap's counts disagree with the header")
            return index
        if lay.coding == OFFSETS:
            offsets = unpack_bits(body[lay.index_at :], total, offset_bits(lay.chunk))
        else:
            high_bits = lay.full * lay.span + lay.tail_span
            high = np.unpackbits(np.frombuffer(body[lay.high_at :], dtype=np.uint8), count=high_bits, bitorder="little")
            at = np.flatnonzero(high)
            if at.size != total:
                raise WireFormatError(f"sparse: {at.size} Elias-Fano high bits set, the header says {total}")
            base = self._high_base(lay)  # a chunk's bits lie from its base (rank 0) on, before the next's
            ends = np.repeat(np.arange(1, lay.chunks + 1, dtype=np.int64) * lay.span, lay.counts())
            if lay.tail:
                ends[lay.full * lay.k :] = high_bits
            if total and ((at < base).any() or (at >= ends).any()):
                raise WireFormatError("sparse: a chunk's Elias-Fano high bits disagree with its count")
            offsets = ((at - base) << lay.low) | unpack_bits(body[lay.index_at :], total, lay.low)
        self._check_offsets(offsets, lay)
        return offsets + self._starts(lay)

    @staticmethod
    def _check_offsets(offsets: np.ndarray, lay: Layout) -> None:
        for begin, (_, rows, length, keep) in zip((0, lay.full * lay.k), SparseCodec._groups(lay), strict=False):
            part = offsets[begin : begin + rows * keep].reshape(rows, keep)
            if (part >= length).any():
                raise WireFormatError("sparse: an index lies outside its chunk")
            if keep > 1 and (part[:, 1:] <= part[:, :-1]).any():
                raise WireFormatError("sparse: indices must be strictly increasing in their chunk")

    def _values(self, frame, lay: Layout, device) -> torch.Tensor:
        scales = read_tensor(frame.body, torch.bfloat16, lay.chunks).to(device=device, dtype=torch.float32)
        counts = torch.from_numpy(lay.counts()).to(device)
        codes = torch.from_numpy(unpack_bits(frame.body[lay.codes_at :], lay.total, lay.bits)).to(device)
        level = (1 << lay.bits) - 1
        return (2 * codes.to(torch.float32) - level) * torch.repeat_interleave(scales, counts)

    def _norm_bound(self, frame):
        lay = self._layout_of(frame)
        scales = read_tensor(frame.body, torch.bfloat16, lay.chunks).to(torch.float64)
        counts = torch.from_numpy(lay.counts()).to(torch.float64)
        return norm_bound((scales * counts.sqrt()).to(torch.float32), float((1 << lay.bits) - 1))

    def _decode_into(self, frame, out, alpha, accumulate):
        lay = self._layout_of(frame)
        index = torch.from_numpy(self._indices(frame, lay)).to(out.device)
        values = self._values(frame, lay, out.device)
        if accumulate:
            out.index_add_(0, index, weighted(values, alpha))  # O(K): only what the payload holds
        else:
            out.zero_()
            out[index] = weighted(values, alpha)
