"""Blockwise absmax quantisation to int8, int4 or 2-bit.

Each block of ``block`` consecutive values shares one scale ``s = absmax / qmax`` with
``qmax = 2**(bits-1) - 1`` (127, 7, 1); values are rounded to ``q = round(x / s)`` in
``[-qmax, qmax]``, so ``|x - q*s| <= s/2``. Scales are fp32, or fp16 relative to a per-tensor fp32
scale (``scale=fp16``: half the scale bytes, still exact over any magnitude range).

Body: ``nblocks`` scales, then the codes packed little-end-first (2 per byte for int4, 4 for 2-bit).
"""

from __future__ import annotations

import math
import struct
from typing import ClassVar

import torch

from atoll.compression import staging
from atoll.compression.base import (
    Codec,
    chunk_elems,
    expect_body,
    expect_params,
    norm_bound,
    read_tensor,
    report,
    span,
    to_device,
    to_host,
    weighted,
    write_tensor,
)
from atoll.compression.wire import Frame, WireFormatError

_PARAMS = struct.Struct("<IBBf")  # block, bits, scale kind (0 fp32, 1 fp16-relative), global scale
SCALE_FP32, SCALE_FP16 = 0, 1
MAX_BLOCK = 1 << 20
"""The largest block a spec takes, and a payload may declare: a decode's temporaries are a block at
least (one island's 4 KB push declaring block 2^32 - 8 had the coordinator OOM-killed)."""


def qmax_of(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def packed_len(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def body_len(n: int, block: int, bits: int, scale_kind: int) -> int:
    nblocks = -(-n // block)
    return nblocks * (4 if scale_kind == SCALE_FP32 else 2) + packed_len(n, bits)


def _pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 codes in [-qmax, qmax] (length a multiple of 8/bits) -> packed uint8."""
    if bits == 8:
        return q.view(torch.uint8)
    u = (q + (qmax_of(bits) + 1)).to(torch.uint8)  # offset to unsigned
    per = 8 // bits
    u = u.view(-1, per)
    out = u.select(1, 0).clone()
    for j in range(1, per):
        out |= u.select(1, j) << (bits * j)
    return out


def _unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """packed uint8 (sub-byte codes) -> float32 codes (first ``n``)."""
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [((packed >> (bits * j)) & mask) for j in range(per)]
    u = span(torch.stack(parts, dim=1).reshape(-1), 0, n)
    return u.to(torch.float32) - float(qmax_of(bits) + 1)


def _step(block: int, device: torch.device) -> int:
    """Elements per chunk (whole blocks): on the CPU small enough that a chunk's temporaries stay in
    cache, on an accelerator large enough to amortise kernel launches and host copies."""
    return max(block, (chunk_elems(device) // block) * block)


def encode_into(
    flat: torch.Tensor, body: memoryview, *, block: int, bits: int, scale_kind: int, global_scale: float
) -> None:
    """Quantise ``flat`` (fp32, on any device; or a :class:`~atoll.compression.base.Chunks` input)
    into the host ``body`` (laid out per ``body_len``): the arithmetic runs on ``flat``'s device, and
    each chunk's scales and codes are copied to the host once finished."""
    n = flat.numel()
    nblocks = -(-n // block)
    qmax = qmax_of(bits)
    scale_bytes = 4 if scale_kind == SCALE_FP32 else 2
    scales_out = write_tensor(body, torch.float32 if scale_kind == SCALE_FP32 else torch.float16, nblocks)
    codes_out = write_tensor(body, torch.uint8, packed_len(n, bits), offset=nblocks * scale_bytes)
    device = flat.device
    step = _step(block, device)
    # Two scratch buffers reused by every chunk: per-chunk temporaries cost allocator work and
    # fresh pages, which here is as slow as the arithmetic.
    scratch_abs = torch.empty(min(step, nblocks * block), device=device)
    scratch_q = torch.empty(min(step, nblocks * block), device=device)
    for s in range(0, n, step):
        x = span(flat, s, step)
        m = x.numel()
        nb = -(-m // block)
        if nb * block != m:
            x = torch.nn.functional.pad(x, (0, nb * block - m))
        x = x.view(nb, block)
        a = scratch_abs.narrow(0, 0, nb * block).view(nb, block)
        torch.abs(x, out=a)
        scale = a.amax(dim=1).div_(qmax)
        b0 = s // block
        if scale_kind == SCALE_FP32:
            to_host(scales_out[b0 : b0 + nb], scale)
            eff = scale
        else:
            rel = (scale / global_scale).to(torch.float16) if global_scale > 0 else torch.zeros_like(scale).half()
            to_host(scales_out[b0 : b0 + nb], rel)
            eff = rel.to(torch.float32).mul_(global_scale)
        inv = torch.where(eff > 0, eff.reciprocal(), torch.zeros_like(eff))
        q = scratch_q.narrow(0, 0, nb * block).view(nb, block)
        torch.mul(x, inv.unsqueeze(1), out=q)
        q.round_()
        if scale_kind != SCALE_FP32:
            # fp16 scales round down by up to 2^-11 (more when subnormal): clamp the overshoot.
            # With exact fp32 scales |x / s| <= qmax already.
            q.clamp_(-qmax, qmax)
        c0 = packed_len(s, bits)
        take = packed_len(s + m, bits) - c0
        codes = None
        if bits == 8 and take == nb * block:
            codes = codes_out[c0 : c0 + take].view(torch.int8).view(nb, block)
            to_host(codes, q)
        else:
            to_host(codes_out[c0 : c0 + take], span(_pack_codes(q.to(torch.int8).view(-1), bits), 0, take))
        host_codes = staging.stored(codes) if codes is not None and device.type == "cpu" else None
        report(flat, s, lambda q=q, a=a, eff=eff, m=m, c=host_codes: _decoded(q, eff, a, m, c))


def _decoded(q: torch.Tensor, eff: torch.Tensor, out: torch.Tensor, m: int, codes=None) -> torch.Tensor:
    """What :func:`decode_into` gives for a chunk's codes ``q`` (float, rounded) and scales ``eff``, into
    ``out`` (a free scratch chunk of the same shape): code x scale, the first ``m`` values. A -0.0 code
    (a small negative value rounded) is 0 in the payload, so it becomes +0.0 first. ``codes``: the
    chunk's int8 codes where they are on the same device, cast into ``out`` and scaled there (the
    same bits, one pass fewer: decode_into's way on the CPU)."""
    if codes is not None:
        return span(out.copy_(codes).mul_(eff.unsqueeze(1)).view(-1), 0, m)
    q.add_(0.0)
    return span(torch.mul(q, eff.unsqueeze(1), out=out).view(-1), 0, m)


def decode_into(
    body: memoryview,
    n: int,
    out: torch.Tensor,
    alpha: float,
    accumulate: bool,
    *,
    block: int,
    bits: int,
    scale_kind: int,
    global_scale: float,
) -> None:
    """``out = alpha * decode`` or ``out += alpha * decode`` (fp32, length ``n``, on any device), one fused pass
    per chunk. Each chunk's scales and codes are copied to ``out``'s device and decoded there."""
    nblocks = -(-n // block)
    scale_bytes = 4 if scale_kind == SCALE_FP32 else 2
    scales = read_tensor(body, torch.float32 if scale_kind == SCALE_FP32 else torch.float16, nblocks)
    codes = read_tensor(body, torch.uint8, packed_len(n, bits), offset=nblocks * scale_bytes)
    device = out.device
    step = _step(block, device)
    # The decoded chunk of an accumulating decode goes through one scratch buffer, not a fresh
    # temporary per chunk (a fresh one costs allocator work and, above glibc's mmap threshold, page faults).
    scratch = torch.empty(min(step, nblocks * block), device=device) if accumulate else None
    # On the CPU an int8 x fp32 product with a broadcast scale is slower than casting the codes into
    # the fp32 destination and multiplying it in place: 228 against 95 us per 2^20 elements in cache
    # on the dev machine, 33-36 against 28-30 ms for a decode-and-add of 124M values from memory. On
    # an accelerator the one mixed kernel reads and writes less.
    cast_first = bits == 8 and device.type == "cpu"
    for s in range(0, n, step):
        m = min(step, n - s)
        nb = -(-m // block)
        c0 = packed_len(s, bits)
        sc = to_device(scales[s // block : s // block + nb], device)
        sc = sc.to(torch.float32) if scale_kind == SCALE_FP32 else sc.to(torch.float32).mul_(global_scale)
        if bits == 8:
            q = to_device(codes[c0 : c0 + m], device).view(torch.int8)
        else:
            q = _unpack_codes(to_device(codes[c0 : packed_len(s + m, bits)], device), bits, m)
        target = span(out, s, m)
        if nb * block == m:
            q2, t2 = q.view(nb, block), target.view(nb, block)
            d = scratch.narrow(0, 0, m).view(nb, block) if accumulate else t2
            if cast_first:  # the same bits: int8 -> fp32 is exact, then one fp32 product
                d.copy_(q2).mul_(sc.unsqueeze(1))
            else:
                torch.mul(q2, sc.unsqueeze(1), out=d)
            if accumulate:
                t2.add_(d if alpha == 1.0 else d.mul_(alpha))  # rounded before the add: see weighted()
            elif alpha != 1.0:
                t2.mul_(alpha)
        else:  # ragged last block
            v = torch.nn.functional.pad(q.to(torch.float32), (0, nb * block - m)).view(nb, block).mul_(sc.unsqueeze(1))
            v = weighted(span(v.view(-1), 0, m), alpha)
            target.add_(v) if accumulate else target.copy_(v)


def scales_bound(body: memoryview, n: int, *, block: int, bits: int, scale_kind: int, global_scale: float) -> float:
    """An upper bound of the L2 norm of ``n`` values decoded from ``body``: each block's values are
    at most ``qmax x scale`` in magnitude, so the norm is at most ``qmax x sqrt(block) x ||scales||``
    (from the scales alone, 1/block of the values)."""
    if not math.isfinite(global_scale):
        return math.nan
    nblocks = -(-n // block)
    scales = read_tensor(body, torch.float32 if scale_kind == SCALE_FP32 else torch.float16, nblocks)
    factor = qmax_of(bits) * math.sqrt(block) * (abs(global_scale) if scale_kind == SCALE_FP16 else 1.0)
    return norm_bound(scales, factor)


class BlockQuantCodec(Codec):
    params: ClassVar[dict[str, type]] = {"block": int, "scale": str}
    adds_exactly = True  # code x scale, element by element
    writes_weighted = True  # and a zero code decodes to +0.0 (scales are >= 0)

    bits: int

    def __init__(self, block: int = 256, scale: str = "fp32") -> None:
        if block < 8 or block % 8 or block > MAX_BLOCK:
            raise ValueError(f"{self.name}: block must be a multiple of 8 in 8..{MAX_BLOCK}, got {block}")
        if scale not in ("fp32", "fp16"):
            raise ValueError(f"{self.name}: scale must be 'fp32' or 'fp16', got {scale!r}")
        self.block = block
        self.scale = scale

    @property
    def chunked_input(self) -> bool:
        return self.scale == "fp32"  # fp16 scales are relative to the whole tensor's absmax

    @property
    def spec(self) -> str:
        return f"{self.name}:block={self.block},scale={self.scale}"

    def _encode(self, flat, shape, state):
        kind = SCALE_FP32 if self.scale == "fp32" else SCALE_FP16
        g = 0.0
        if kind == SCALE_FP16 and flat.numel():
            g = float(flat.abs().max()) / qmax_of(self.bits)
        params = _PARAMS.pack(self.block, self.bits, kind, g)

        def write(body):
            encode_into(flat, body, block=self.block, bits=self.bits, scale_kind=kind, global_scale=g)

        return params, body_len(flat.numel(), self.block, self.bits, kind), write

    def _sizes(self, shape):
        kind = SCALE_FP32 if self.scale == "fp32" else SCALE_FP16
        return _PARAMS.size, body_len(math.prod(shape), self.block, self.bits, kind)

    def _params(self, frame: Frame):
        block, bits, kind, g = expect_params(frame, _PARAMS, self.name)
        if bits != self.bits or not 8 <= block <= MAX_BLOCK or block % 8 or kind not in (SCALE_FP32, SCALE_FP16):
            raise WireFormatError(f"{self.name}: bad params block={block} bits={bits} scale kind={kind}")
        return block, kind, g

    def _conforms(self, frame):
        block, kind, _ = self._params(frame)
        if (block, kind) != (self.block, SCALE_FP32 if self.scale == "fp32" else SCALE_FP16):
            raise WireFormatError(f"{self.name}: block={block} scale kind={kind}, not the run's {self.spec}")

    def _check(self, frame):
        block, kind, _ = self._params(frame)
        expect_body(frame, body_len(frame.numel, block, self.bits, kind), self.name)

    def _norm_bound(self, frame):
        block, kind, g = self._params(frame)
        return scales_bound(frame.body, frame.numel, block=block, bits=self.bits, scale_kind=kind, global_scale=g)

    def _decode_into(self, frame, out, alpha, accumulate):
        block, kind, g = self._params(frame)
        decode_into(
            frame.body,
            frame.numel,
            out,
            alpha,
            accumulate,
            block=block,
            bits=self.bits,
            scale_kind=kind,
            global_scale=g,
        )


class Int8Codec(BlockQuantCodec):
    name = "int8"
    codec_id = 4
    bits = 8


class Int4Codec(BlockQuantCodec):
    name = "int4"
    codec_id = 5
    bits = 4


class Int2Codec(BlockQuantCodec):
    name = "int2"
    codec_id = 6
    bits = 2
