"""Top-k sparsification by magnitude, values quantised (blockwise int8 or fp16), compact indices.

Selection never sorts the whole tensor: a strided sample estimates the magnitude threshold that
about ``1.25 k`` elements exceed, a chunked pass collects those candidates, and an exact top-k runs
on the candidates only (if it kept fewer than k, the pass is repeated with the sample's threshold at
twice the share).

Body: ``k`` strictly increasing indices (uint16 / uint32 / uint64, the narrowest that fits the
tensor), then the values' body (see ``values``).
"""

from __future__ import annotations

import math
import struct
from typing import ClassVar

import numpy as np
import torch

from atoll.compression import blockwise
from atoll.compression.base import (
    CHUNK,
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

_PARAMS = struct.Struct("<QBBIf")  # k, index width, value kind (0 int8 blockwise, 1 fp16), value block, 0
VALUES_INT8, VALUES_FP16 = 0, 1
VALUE_BLOCK = 256
SAMPLE = 1 << 16
INDEX_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def index_width(n: int) -> int:
    return 2 if n <= 1 << 15 else 4 if n <= 1 << 31 else 8


def check_sparse_options(what: str, fraction: float, values: str) -> None:
    if not 0 < fraction <= 1:
        raise ValueError(f"{what}: fraction must be in (0, 1], got {fraction}")
    if values not in ("int8", "fp16"):
        raise ValueError(f"{what}: values must be 'int8' or 'fp16', got {values!r}")


def sparse_count(fraction: float, n: int) -> int:
    """How many of ``n`` elements a top-``fraction`` codec keeps (at least one of a non-empty tensor)."""
    return min(n, max(1, round(fraction * n))) if n else 0


def check_sparse_params(
    what: str, numel: int, k: int, width: int, kind: int, block: int, slots: int, unit: str
) -> None:
    """Raise unless a sparse payload's params fit a tensor of ``numel`` elements whose indices
    address ``slots`` positions (``unit``: what they are, for the message)."""
    if k > numel or width not in INDEX_DTYPES or kind not in (VALUES_INT8, VALUES_FP16) or block != VALUE_BLOCK:
        raise WireFormatError(f"{what}: bad params k={k} width={width} value kind={kind} block={block}")
    if width < index_width(slots):
        raise WireFormatError(f"{what}: {width}-byte indices cannot address {slots} {unit}")


def conform_sparse(codec, numel: int, k: int, width: int, kind: int, slots: int) -> None:
    """Raise unless a checked sparse payload's count, index width and value kind are those ``codec`` (a
    spec with ``fraction`` and ``values``) writes for ``numel`` values addressed over ``slots``."""
    want = (
        sparse_count(codec.fraction, numel),
        index_width(slots),
        VALUES_INT8 if codec.values == "int8" else VALUES_FP16,
    )
    if (k, width, kind) != want:
        raise WireFormatError(f"{codec.name}: k={k} width={width} value kind={kind}, not the run's {codec.spec}")


def sparse_body_len(k: int, width: int, kind: int) -> int:
    """Bytes of a body of ``k`` indices of ``width`` bytes and ``k`` values of ``kind``."""
    if kind == VALUES_FP16:
        return k * width + 2 * k
    return k * width + blockwise.body_len(k, VALUE_BLOCK, 8, blockwise.SCALE_FP32)


def write_sparse(body: memoryview, idx: torch.Tensor, vals: torch.Tensor, width: int, kind: int) -> None:
    """Lay ``k`` indices and values (on any device) into the host ``body``."""
    k = idx.numel()
    to_host(write_tensor(body, INDEX_DTYPES[width], k), idx)
    rest = body[k * width :]
    if kind == VALUES_FP16:
        to_host(write_tensor(rest, torch.float16, k), vals)
    else:
        blockwise.encode_into(vals, rest, block=VALUE_BLOCK, bits=8, scale_kind=blockwise.SCALE_FP32, global_scale=0.0)


def read_indices(body: memoryview, k: int, width: int, device: torch.device | None = None) -> torch.Tensor:
    idx = read_tensor(body, INDEX_DTYPES[width], k, device=device).to(torch.int64)
    if width == 2:
        idx = idx & 0xFFFF  # stored unsigned
    return idx


def check_indices(body: memoryview, k: int, width: int, limit: int, what: str) -> None:
    """Raise unless the ``k`` indices are strictly increasing and below ``limit``."""
    if k:
        a = read_indices(body, k, width).numpy()
        if a[0] < 0 or a[-1] >= limit or (k > 1 and not bool(np.all(a[1:] > a[:-1]))):
            raise WireFormatError(f"{what}: indices must be strictly increasing and inside the tensor")


def read_values(body: memoryview, k: int, width: int, kind: int, device: torch.device | None = None) -> torch.Tensor:
    rest = body[k * width :]
    if kind == VALUES_FP16:
        return read_tensor(rest, torch.float16, k, device=device).to(torch.float32)
    out = torch.empty(k, dtype=torch.float32, device=device)
    blockwise.decode_into(
        rest, k, out, 1.0, False, block=VALUE_BLOCK, bits=8, scale_kind=blockwise.SCALE_FP32, global_scale=0.0
    )
    return out


def values_bound(body: memoryview, k: int, width: int, kind: int) -> float:
    """An upper bound of the L2 norm of the ``k`` values (see :meth:`Codec.validate`)."""
    rest = body[k * width :]
    if kind == VALUES_FP16:
        return norm_bound(read_tensor(rest, torch.float16, k))
    return blockwise.scales_bound(rest, k, block=VALUE_BLOCK, bits=8, scale_kind=blockwise.SCALE_FP32, global_scale=0.0)


def select_topk(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted int64 indices (on ``flat``'s device) of the ``k`` largest-magnitude elements of ``flat``."""
    n = flat.numel()
    if k >= n:
        return torch.arange(n, device=flat.device)
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=flat.device)
    if n <= 4 * SAMPLE:
        return torch.topk(flat.abs(), k, sorted=False).indices.sort().values
    stride = n // SAMPLE
    sample = flat[::stride].abs()
    frac = min(1.0, 1.25 * k / n)
    while True:  # a threshold that kept fewer than k: the sample's at twice the share (until all of it)
        rank = max(1, int(sample.numel() * (1 - frac)))
        thr = float(sample.kthvalue(rank).values) if frac < 1 else 0.0
        found = [(flat[s : s + CHUNK].abs() >= thr).nonzero().view(-1).add_(s) for s in range(0, n, CHUNK)]
        cand = torch.cat(found)
        if cand.numel() >= k or thr == 0.0:
            break
        frac = min(1.0, 2 * frac)
    if cand.numel() > k:
        cand = cand[torch.topk(flat[cand].abs(), k, sorted=False).indices]
    return cand.sort().values


class TopKCodec(Codec):
    name = "topk"
    codec_id = 7
    params: ClassVar[dict[str, type]] = {"fraction": float, "values": str}
    drops_values = True

    def __init__(self, fraction: float = 0.01, values: str = "int8") -> None:
        check_sparse_options(self.name, fraction, values)
        self.fraction = fraction
        self.values = values

    @property
    def spec(self) -> str:
        return f"topk:fraction={self.fraction:g},values={self.values}"

    def _encode(self, flat, shape, state):
        n = flat.numel()
        k = sparse_count(self.fraction, n)
        idx = select_topk(flat, k)
        vals = flat[idx]
        width = index_width(n)
        kind = VALUES_INT8 if self.values == "int8" else VALUES_FP16
        params = _PARAMS.pack(k, width, kind, VALUE_BLOCK, 0.0)
        return params, sparse_body_len(k, width, kind), lambda body: write_sparse(body, idx, vals, width, kind)

    def _sizes(self, shape):
        n = math.prod(shape)
        kind = VALUES_INT8 if self.values == "int8" else VALUES_FP16
        return _PARAMS.size, sparse_body_len(sparse_count(self.fraction, n), index_width(n), kind)

    def _params(self, frame):
        k, width, kind, block, _ = expect_params(frame, _PARAMS, self.name)
        check_sparse_params(self.name, frame.numel, k, width, kind, block, frame.numel, "elements")
        return k, width, kind

    def _check(self, frame):
        k, width, kind = self._params(frame)
        expect_body(frame, sparse_body_len(k, width, kind), self.name)
        check_indices(frame.body, k, width, frame.numel, self.name)

    def _conforms(self, frame):
        k, width, kind = self._params(frame)
        conform_sparse(self, frame.numel, k, width, kind, frame.numel)

    def _norm_bound(self, frame):
        return values_bound(frame.body, *self._params(frame))

    def _decode_into(self, frame, out, alpha, accumulate):
        k, width, kind = self._params(frame)
        idx = read_indices(frame.body, k, width, out.device)
        vals = read_values(frame.body, k, width, kind, out.device)
        if accumulate:
            out.index_add_(0, idx, weighted(vals, alpha))
        else:
            out.zero_()
            out[idx] = vals
