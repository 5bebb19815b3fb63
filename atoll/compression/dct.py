"""Top-k in a blockwise DCT basis (the transform DeMo uses), values quantised, compact indices.

A pseudo-gradient of an Adam-trained matrix spreads its energy thinly over the raw elements:
after the bundled model's first round the top 1% of raw elements hold 6% of ``||Δ||²``, the
same number of 2-D DCT-II coefficients over ``chunk x chunk`` blocks 16%
(``benchmarks/topk_basis.py``). So this codec views the tensor as 2-D (first dim by the rest; a
0-/1-D tensor as one row), cuts it into blocks (see :func:`block_len`; zero-padded only where a
dim has no divisor in ``(chunk/2, chunk]``), transforms every block with the orthonormal DCT and
keeps the top-k coefficients by magnitude (:func:`atoll.compression.topk.select_topk`, no sort
of the whole tensor).

``k = round(fraction * numel)`` of the *unpadded* tensor, so the payload is plain top-k's size
(indices may be one width wider when padding crosses a width boundary). The price is compute:
two small GEMMs per direction, ~0.07x memcpy to encode on 2 CPU cores with huge pages (see
:mod:`atoll.memory`), ~0.05x without (``benchmarks/RESULTS.md``). Decoding scatters into a dense
coefficient array of the padded tensor and runs the inverse's first GEMM into a second temporary;
the second GEMM writes into the output (a padded tensor takes a third temporary). Raw top-k
accumulates in place.

Params: ``k, index width, value kind, value block, chunk``. Body: ``k`` strictly increasing
indices into the padded coefficient array, then the values (as in ``topk``).
"""

from __future__ import annotations

import functools
import math
import struct
from typing import ClassVar

import torch

from atoll.compression.base import Codec, add_product, expect_body, expect_params, weighted
from atoll.compression.topk import (
    VALUE_BLOCK,
    VALUES_FP16,
    VALUES_INT8,
    check_indices,
    check_sparse_options,
    check_sparse_params,
    conform_sparse,
    index_width,
    read_indices,
    read_values,
    select_topk,
    sparse_body_len,
    sparse_count,
    values_bound,
    write_sparse,
)
from atoll.compression.wire import WireFormatError

_PARAMS = struct.Struct("<QBBII")  # k, index width, value kind, value block, chunk
MAX_CHUNK = 256


@functools.lru_cache(maxsize=32)
def dct_matrix(n: int, device: torch.device | None = None) -> torch.Tensor:
    """Orthonormal DCT-II matrix ``M`` (``M @ x`` transforms, ``M.T @ y`` inverts), float32, built
    on the CPU in float64 (the same bits on every device) and cached per device."""
    if device is not None and device.type != "cpu":
        return dct_matrix(n).to(device)
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    m = torch.cos(math.pi * (i + 0.5) * k / n) * math.sqrt(2.0 / n)
    m[0] /= math.sqrt(2.0)
    return m.to(torch.float32)


def block_len(dim: int, chunk: int) -> int:
    """Block length along a dim: the whole dim if it fits a chunk, else a divisor in
    ``(chunk/2, chunk]`` (no padding) if there is one, else ``chunk`` (the last block is padded)."""
    if dim <= chunk:
        return max(1, dim)
    for d in range(chunk, chunk // 2, -1):
        if dim % d == 0:
            return d
    return chunk


def layout(shape: tuple[int, ...], chunk: int) -> tuple[int, int, int, int, int, int]:
    """``(rows, cols, block_rows, block_cols, padded_rows, padded_cols)`` of the 2-D view a tensor
    of ``shape`` is coded in: the first dim by the rest (a 0-/1-D tensor is one row)."""
    n = math.prod(shape)
    rows = shape[0] if len(shape) >= 2 else 1
    cols = n // rows if rows else 0
    br, bc = block_len(rows, chunk), block_len(cols, chunk)
    return rows, cols, br, bc, -(-rows // br) * br, -(-cols // bc) * bc


def _blockwise(
    x2d: torch.Tensor, left: torch.Tensor, right: torch.Tensor, out: torch.Tensor | None, alpha: float | None
) -> torch.Tensor:
    """``left @ block @ right`` for every block of ``x2d``, as two plain GEMMs (no permutes). The
    second GEMM writes into ``out`` (contiguous, ``x2d``'s shape) when given, or adds ``alpha`` times
    its result to it when ``alpha`` is given too."""
    r, c = x2d.shape
    br, bc = left.shape[0], right.shape[0]
    rows = torch.matmul(left, x2d.reshape(r // br, br, c)).view(-1, bc)  # mixes rows in each block row
    if out is None:
        return torch.mm(rows, right).view(r, c)  # mixes cols within each block
    target = out.view(-1, bc)
    if alpha is None:
        torch.mm(rows, right, out=target)
    else:
        add_product(target, rows, right, alpha)
    return out


def forward(x2d: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """Blockwise orthonormal 2-D DCT-II of a padded ``R x C`` matrix; coefficients stay in place."""
    return _blockwise(x2d, dct_matrix(br, x2d.device), dct_matrix(bc, x2d.device).T, None, None)


def inverse(
    c2d: torch.Tensor, br: int, bc: int, out: torch.Tensor | None = None, alpha: float | None = None
) -> torch.Tensor:
    """Inverse of :func:`forward`; into (or, with ``alpha``, added to) ``out`` when given."""
    return _blockwise(c2d, dct_matrix(br, c2d.device).T, dct_matrix(bc, c2d.device), out, alpha)


class DctTopKCodec(Codec):
    name = "dcttopk"
    params: ClassVar[dict[str, type]] = {"fraction": float, "values": str, "chunk": int}
    codec_id = 9
    drops_values = True

    def __init__(self, fraction: float = 0.01, values: str = "int8", chunk: int = 64) -> None:
        check_sparse_options(self.name, fraction, values)
        if not 1 <= chunk <= MAX_CHUNK:
            raise ValueError(f"dcttopk: chunk must be in [1, {MAX_CHUNK}], got {chunk}")
        self.fraction = fraction
        self.values = values
        self.chunk = chunk

    @property
    def spec(self) -> str:
        return f"dcttopk:fraction={self.fraction:g},values={self.values},chunk={self.chunk}"

    def _encode(self, flat, shape, state):
        n = flat.numel()
        rows, cols, br, bc, pr, pc = layout(shape, self.chunk)
        k = sparse_count(self.fraction, n)
        if n:
            x = flat.view(rows, cols)
            if (pr, pc) != (rows, cols):
                x = torch.nn.functional.pad(x, (0, pc - cols, 0, pr - rows))
            coef = forward(x, br, bc).view(-1)
        else:
            coef = flat
        idx = select_topk(coef, k)
        vals = coef[idx]
        width = index_width(pr * pc)
        kind = VALUES_INT8 if self.values == "int8" else VALUES_FP16
        params = _PARAMS.pack(k, width, kind, VALUE_BLOCK, self.chunk)
        return params, sparse_body_len(k, width, kind), lambda body: write_sparse(body, idx, vals, width, kind)

    def _sizes(self, shape):
        *_, pr, pc = layout(shape, self.chunk)
        kind = VALUES_INT8 if self.values == "int8" else VALUES_FP16
        return _PARAMS.size, sparse_body_len(sparse_count(self.fraction, math.prod(shape)), index_width(pr * pc), kind)

    def _params(self, frame):
        k, width, kind, block, chunk = expect_params(frame, _PARAMS, self.name)
        if not 1 <= chunk <= MAX_CHUNK:
            raise WireFormatError(f"dcttopk: bad chunk {chunk}")
        rows, cols, br, bc, pr, pc = layout(frame.shape, chunk)
        check_sparse_params(self.name, frame.numel, k, width, kind, block, pr * pc, "coefficients")
        return k, width, kind, (rows, cols, br, bc, pr, pc)

    def _check(self, frame):
        k, width, kind, (*_, pr, pc) = self._params(frame)
        expect_body(frame, sparse_body_len(k, width, kind), self.name)
        check_indices(frame.body, k, width, pr * pc, self.name)

    def _conforms(self, frame):
        k, width, kind, (*_, pr, pc) = self._params(frame)
        chunk = expect_params(frame, _PARAMS, self.name)[4]
        if chunk != self.chunk:
            raise WireFormatError(f"dcttopk: chunk={chunk}, not the run's {self.spec}")
        conform_sparse(self, frame.numel, k, width, kind, pr * pc)

    def _norm_bound(self, frame):
        k, width, kind, _ = self._params(frame)
        return values_bound(frame.body, k, width, kind)  # the inverse DCT is orthonormal: the same norm

    def _decode_into(self, frame, out, alpha, accumulate):
        k, width, kind, (rows, cols, br, bc, pr, pc) = self._params(frame)
        coef = torch.zeros(pr * pc, device=out.device)
        coef[read_indices(frame.body, k, width, out.device)] = read_values(frame.body, k, width, kind, out.device)
        view = out.view(rows, cols)
        if (pr, pc) == (rows, cols):  # the inverse's second GEMM writes (or adds) straight into out
            inverse(coef.view(pr, pc), br, bc, out=view, alpha=alpha if accumulate else None)
            return
        dense = inverse(coef.view(pr, pc), br, bc)[:rows, :cols]
        if accumulate:
            view.add_(weighted(dense, alpha))
        else:
            view.copy_(dense)
