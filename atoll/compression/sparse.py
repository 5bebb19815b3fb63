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

    def counts(self, device=None) -> torch.Tensor:
        """Values kept in each chunk (int64, on ``device``)."""
        counts = torch.full((self.chunks,), self.k, dtype=torch.int64, device=device)
        counts.narrow(0, self.full, self.chunks - self.full).fill_(self.tail_k)  # the last, short chunk's
        return counts

    def host_counts(self) -> np.ndarray:
        """:meth:`counts` in NumPy, for the host's check of a payload (never a torch tensor: a fake
        tensor mode would fake it)."""
        counts = np.full(self.chunks, self.k, dtype=np.int64)
        counts[self.full :] = self.tail_k
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


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers below 2^width (width <= 16), ``width`` bits each, packed little-end-first
    (uint8, on ``values``' device): a run of values that ends on a byte at a time, as one 64-bit word
    (at most 56 of its bits used), where one fits; else bit by bit."""
    count, (per, nbytes) = values.numel(), _group(width)
    used, device = -(-count * width // 8), values.device
    if nbytes > 8:  # 9, 11, 13, 15 bits
        bits = (values.long().view(-1, 1) >> torch.arange(width, device=device)) & 1
        flat = torch.zeros(8 * used, dtype=torch.int64, device=device)
        flat.narrow(0, 0, count * width).copy_(bits.view(-1))
        return (flat.view(-1, 8) << torch.arange(8, device=device)).sum(1).to(torch.uint8)
    groups = -(-count // per)
    v = torch.zeros(groups * per, dtype=torch.int64, device=device)
    v.narrow(0, 0, count).copy_(values)
    words = (v.view(groups, per) << (torch.arange(per, device=device) * width)).sum(1)  # disjoint fields: OR
    return words.view(torch.uint8).view(groups, 8).narrow(1, 0, nbytes).reshape(-1).narrow(0, 0, used)


def unpack_bits(raw: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """``count`` integers of ``width`` bits (<= 16) packed little-end-first in the uint8 tensor ``raw``
    (at least their bytes), as int64 on its device."""
    (per, nbytes), device = _group(width), raw.device
    used, mask = -(-count * width // 8), (1 << width) - 1
    if nbytes > 8:  # each value from the 3 bytes it lies in
        padded = torch.zeros(used + 3, dtype=torch.int64, device=device)
        padded.narrow(0, 0, used).copy_(raw.narrow(0, 0, used))
        pos = torch.arange(count, dtype=torch.int64, device=device) * width
        at = pos >> 3
        word = padded[at] | padded[at + 1] << 8 | padded[at + 2] << 16
        return (word >> (pos & 7)) & mask
    groups = -(-count // per)
    flat = torch.zeros(groups * nbytes, dtype=torch.uint8, device=device)
    flat.narrow(0, 0, used).copy_(raw.narrow(0, 0, used))
    words = torch.zeros(groups, 8, dtype=torch.uint8, device=device)
    words.narrow(1, 0, nbytes).copy_(flat.view(groups, nbytes))
    shifts = torch.arange(per, device=device) * width  # (an arithmetic shift: the mask drops the sign)
    return ((words.view(torch.int64) >> shifts) & mask).reshape(-1).narrow(0, 0, count)


class SparseCodec(Codec):
    name = "sparse"
    codec_id = 10
    params: ClassVar[dict[str, type]] = {"density": float, "bits": int, "chunk": int}
    drops_values = True
    adds_exactly = True
    """A decode holds -0.0 where nothing was kept, and x + (-0.0) is x for every x (+0.0 and -0.0
    too), so the coordinator's θ_{r+1} = decode(u) + θ_r is bit for bit θ_r with the kept values added
    at their indices: what an island's O(K) ``decode_add_`` does."""

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
            offsets, codes, scales = self._select(flat, lay)  # packed on their device: only bytes cross
            to_host(write_tensor(body, torch.bfloat16, lay.chunks), scales)
            self._put(body, lay.codes_at, pack_bits(codes, self.bits))
            if lay.coding == OFFSETS:
                self._put(body, lay.index_at, pack_bits(offsets, offset_bits(self.chunk)))
                return
            flags = torch.zeros(8 * (lay.body_len - (lay.index_at if lay.coding == BITMAP else lay.high_at)),
                                dtype=torch.uint8, device=offsets.device)  # fmt: skip
            if lay.coding == BITMAP:
                flags.index_fill_(0, offsets + self._starts(lay, offsets.device), 1)
                self._put(body, lay.index_at, pack_bits(flags, 1))
                return
            self._put(body, lay.index_at, pack_bits(offsets & ((1 << lay.low) - 1), lay.low))
            flags.index_fill_(0, (offsets >> lay.low) + self._high_base(lay, offsets.device), 1)
            self._put(body, lay.high_at, pack_bits(flags, 1))

        return params, lay.body_len, write

    @staticmethod
    def _put(body: memoryview, at: int, packed: torch.Tensor) -> None:
        to_host(write_tensor(body, torch.uint8, packed.numel(), offset=at), packed)

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
                mag = torch.abs(x, out=scratch.narrow(0, 0, n * length).view(n, length))
                top = torch.topk(mag, keep, dim=1, sorted=False).indices.sort(dim=1).values
                v = torch.gather(x, 1, top)
                s = scales.narrow(0, row, n)
                s.copy_(v.abs().amax(dim=1).div_(level))  # rounded to bfloat16 as it is stored
                per = s.float().unsqueeze(1)
                q = torch.where(per > 0, v / torch.where(per > 0, per, 1.0), 0.0)
                c = torch.round((q + level) / 2).clamp_(0, level)
                offsets.narrow(0, kept, n * keep).copy_(top.view(-1))
                codes.narrow(0, kept, n * keep).copy_(c.view(-1))

                def decoded(top=top, c=c, per=per, n=n, length=length) -> torch.Tensor:
                    out = scratch.narrow(0, 0, n * length).view(n, length).fill_(-0.0)  # (magnitudes done with)
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
    def _starts(lay: Layout, device) -> torch.Tensor:
        """Each kept value's chunk's first index in the tensor."""
        starts = torch.arange(lay.chunks, dtype=torch.int64, device=device) * lay.chunk
        return torch.repeat_interleave(starts, lay.counts(device), output_size=lay.total)

    @staticmethod
    def _high_base(lay: Layout, device) -> torch.Tensor:
        """Each kept value's bit in its chunk's Elias-Fano high bits but for its high part: the chunk's
        first bit plus the value's rank in its chunk."""
        rows = torch.arange(lay.full, dtype=torch.int64, device=device).unsqueeze(1) * lay.span
        full = rows + torch.arange(lay.k, dtype=torch.int64, device=device)
        tail = lay.full * lay.span + torch.arange(lay.tail_k, dtype=torch.int64, device=device)
        return torch.cat([full.view(-1), tail])

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
        check_indices(np.frombuffer(frame.body, dtype=np.uint8), lay)

    def _conforms(self, frame):
        lay = self._layout_of(frame)
        if (lay.chunk, lay.k, lay.bits, lay.coding) != (self.chunk, self.k, self.bits, self.coding):
            raise WireFormatError(
                f"sparse: chunk={lay.chunk} k={lay.k} bits={lay.bits} coding={lay.coding}, not the run's {self.spec}"
            )

    def _indices(self, frame, lay: Layout, device) -> torch.Tensor:
        """The kept values' indices in the tensor (int64, on ``device``: the payload's bytes cross, the
        bits are unpacked there, in shapes known in advance). Checked on the host first (``frame()``:
        :func:`check_indices`)."""

        def part(at: int, end: int | None = None) -> torch.Tensor:
            end = lay.body_len if end is None else end
            return read_tensor(frame.body, torch.uint8, end - at, at, device=device)

        def set_bits(flags: torch.Tensor) -> torch.Tensor:
            """Where the first ``total`` set bits lie, in a shape known in advance (no device sync; 2.4x
            faster on the CPU than the first place each running count is reached, by a search)."""
            return torch.nonzero_static(flags, size=lay.total).view(-1)

        if lay.coding == BITMAP:
            return set_bits(unpack_bits(part(lay.index_at), lay.n, 1))
        if lay.coding == OFFSETS:
            offsets = unpack_bits(part(lay.index_at), lay.total, offset_bits(lay.chunk))
        else:
            at = set_bits(unpack_bits(part(lay.high_at), lay.full * lay.span + lay.tail_span, 1))
            low = unpack_bits(part(lay.index_at, lay.high_at), lay.total, lay.low)
            offsets = ((at - self._high_base(lay, device)) << lay.low) | low
        return offsets + self._starts(lay, device)

    def _values(self, frame, lay: Layout, device) -> torch.Tensor:
        scales = read_tensor(frame.body, torch.bfloat16, lay.chunks, device=device).to(torch.float32)
        codes = read_tensor(frame.body, torch.uint8, lay.index_at - lay.codes_at, lay.codes_at, device=device)
        level = (1 << lay.bits) - 1
        per = torch.repeat_interleave(scales, lay.counts(device), output_size=lay.total)
        return (2 * unpack_bits(codes, lay.total, lay.bits).to(torch.float32) - level) * per

    def _norm_bound(self, frame):
        lay = self._layout_of(frame)
        scales = read_tensor(frame.body, torch.bfloat16, lay.chunks).to(torch.float64)
        counts = lay.counts().to(torch.float64)
        return norm_bound((scales * counts.sqrt()).to(torch.float32), float((1 << lay.bits) - 1))

    def _decode_into(self, frame, out, alpha, accumulate):
        lay = self._layout_of(frame)
        index = self._indices(frame, lay, out.device)
        values = self._values(frame, lay, out.device)
        if accumulate:
            out.index_add_(0, index, weighted(values, alpha))  # O(K): only what the payload holds
        else:
            out.fill_(-0.0).index_copy_(0, index, weighted(values, alpha))  # -0.0 elsewhere: see adds_exactly


# ---- the host's check of a payload's indices (NumPy: the bytes are there, whatever device decodes) ----
def _np_unpack(raw: np.ndarray, count: int, width: int) -> np.ndarray:
    """:func:`unpack_bits` in NumPy (int64), a byte-aligned run of values at a time where one fits in
    a 64-bit word, else bit by bit."""
    used, (per, nbytes) = -(-count * width // 8), _group(width)
    if nbytes > 8:
        bits = np.unpackbits(raw, count=count * width, bitorder="little").reshape(count, width).astype(np.int64)
        return (bits << np.arange(width, dtype=np.int64)).sum(axis=1)
    groups = -(-count // per)
    flat = np.zeros(groups * nbytes, dtype=np.uint8)
    flat[:used] = raw[:used]
    words = np.zeros((groups, 8), dtype=np.uint8)
    words[:, :nbytes] = flat.reshape(groups, nbytes)
    shifts = np.arange(per, dtype=np.uint64) * np.uint64(width)
    return ((words.view("<u8") >> shifts) & np.uint64((1 << width) - 1)).reshape(-1)[:count].astype(np.int64)


def check_indices(body: np.ndarray, lay: Layout) -> None:
    """WireFormatError unless the payload's indices lie inside their chunks, strictly increasing,
    and each chunk holds exactly its count (Elias-Fano's high bits and the bitmap: inside the chunk's
    own span). Only arrays of the payload's counts (bounded by the tensor's size) are made."""
    total = lay.total
    counts = lay.host_counts()
    if lay.coding == BITMAP:
        index = np.flatnonzero(np.unpackbits(body[lay.index_at :], count=lay.n, bitorder="little"))
        if index.size != total or not np.array_equal(np.bincount(index // lay.chunk, minlength=lay.chunks), counts):
            raise WireFormatError(f"sparse: the bitmap bits disagree with the header ({index.size} set, {total} kept)")
        return
    if lay.coding == OFFSETS:
        offsets = _np_unpack(body[lay.index_at :], total, offset_bits(lay.chunk))
    else:
        high_bits = lay.full * lay.span + lay.tail_span
        at = np.flatnonzero(np.unpackbits(body[lay.high_at :], count=high_bits, bitorder="little"))
        if at.size != total:
            raise WireFormatError(
                f"sparse: the Elias-Fano high bits disagree with the header ({at.size} set, {total} kept)"
            )
        chunk_of = np.repeat(np.arange(lay.chunks, dtype=np.int64), counts)
        rank = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        base, ends = chunk_of * lay.span + rank, np.minimum((chunk_of + 1) * lay.span, high_bits)
        if total and ((at < base) | (at >= ends)).any():
            raise WireFormatError("sparse: a chunk's Elias-Fano high bits disagree with its count")
        offsets = ((at - base) << lay.low) | _np_unpack(body[lay.index_at : lay.high_at], total, lay.low)
    for begin, (_, rows, length, keep) in zip((0, lay.full * lay.k), SparseCodec._groups(lay), strict=False):
        got = offsets[begin : begin + rows * keep].reshape(rows, keep)
        if (got >= length).any():
            raise WireFormatError("sparse: an index lies outside its chunk")
        if keep > 1 and (got[:, 1:] <= got[:, :-1]).any():
            raise WireFormatError("sparse: indices must be strictly increasing in their chunk")
