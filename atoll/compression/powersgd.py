"""PowerSGD low-rank compression (Vogels et al. 2019) with a warm-started Q.

A tensor of ``ndim >= 2`` is viewed as a matrix M (first dim x the rest). One power iteration per
encode: ``P = orth(M Q)``, ``Q = M^T P``; the payload carries P (rows x r) and Q (cols x r) in fp32,
and decodes to ``P Q^T``. Q is kept in ``state`` and warm-starts the next round. Tensors where
low rank does not save bytes (vectors, tiny matrices) travel as raw fp32 in the same payload.
"""

from __future__ import annotations

import struct
from typing import ClassVar

import torch

from atoll.compression.base import (
    Codec,
    add_product,
    expect_body,
    expect_params,
    norm_bound,
    product_bound,
    read_tensor,
    to_host,
    weighted,
    write_tensor,
)
from atoll.compression.wire import WireFormatError

_PARAMS = struct.Struct("<BIQQ")  # mode (0 raw, 1 low rank), rank, rows, cols
RAW, LOW_RANK = 0, 1


def as_matrix(shape: tuple[int, ...]) -> tuple[int, int] | None:
    if len(shape) < 2:
        return None
    rows = shape[0]
    cols = 1
    for d in shape[1:]:
        cols *= d
    return rows, cols


class PowerSGDCodec(Codec):
    name = "powersgd"
    params: ClassVar[dict[str, type]] = {"rank": int, "seed": int}
    codec_id = 8
    stateful = True

    def __init__(self, rank: int = 4, seed: int = 0) -> None:
        if not 1 <= rank <= 1024:
            raise ValueError(f"powersgd: rank must be in 1..1024, got {rank}")
        self.rank = rank
        self.seed = seed

    @property
    def spec(self) -> str:
        return f"powersgd:rank={self.rank}"

    def _encode(self, flat, shape, state):
        mat = as_matrix(shape)
        if mat is None or self.rank * (mat[0] + mat[1]) >= mat[0] * mat[1]:
            n = flat.numel()

            def write_raw(body):
                to_host(write_tensor(body, torch.float32, n), flat)

            return _PARAMS.pack(RAW, 0, 0, 0), 4 * n, write_raw
        rows, cols = mat
        r = self.rank
        m = flat.view(rows, cols)
        q = state.get("q")
        if q is None or q.shape != (cols, r) or q.device != m.device:
            # Drawn on the CPU (the same start on every device), then moved: Q lives where M does.
            q = torch.randn(cols, r, generator=torch.Generator().manual_seed(self.seed)).to(m.device)
        p = m @ q
        p = torch.linalg.qr(p).Q
        q = m.t() @ p
        state["q"] = q

        def write(body):
            to_host(write_tensor(body, torch.float32, rows * r), p.reshape(-1))
            to_host(write_tensor(body, torch.float32, cols * r, offset=4 * rows * r), q.reshape(-1))

        return _PARAMS.pack(LOW_RANK, r, rows, cols), 4 * r * (rows + cols), write

    def _sizes(self, shape):
        mat = as_matrix(shape)
        if mat is None or self.rank * (mat[0] + mat[1]) >= mat[0] * mat[1]:
            n = 1
            for d in shape:
                n *= d
            return _PARAMS.size, 4 * n
        return _PARAMS.size, 4 * self.rank * (mat[0] + mat[1])

    def _params(self, frame):
        mode, r, rows, cols = expect_params(frame, _PARAMS, self.name)
        if mode == RAW:
            return mode, 0, 0, 0
        mat = as_matrix(frame.shape)
        if mode != LOW_RANK or mat != (rows, cols) or not 1 <= r <= min(rows, cols):
            raise WireFormatError(f"powersgd: bad params mode={mode} rank={r} matrix={rows}x{cols} for {frame.shape}")
        return mode, r, rows, cols

    def _check(self, frame):
        mode, r, rows, cols = self._params(frame)
        expect_body(frame, 4 * frame.numel if mode == RAW else 4 * r * (rows + cols), self.name)

    def _conforms(self, frame):
        mode, r, _, _ = self._params(frame)
        mat = as_matrix(frame.shape)
        raw = mat is None or self.rank * (mat[0] + mat[1]) >= mat[0] * mat[1]
        if (mode, r) != ((RAW, 0) if raw else (LOW_RANK, self.rank)):
            raise WireFormatError(f"powersgd: mode={mode} rank={r}, not the run's {self.spec} for {list(frame.shape)}")

    def _factors(self, frame, r, rows, cols, device=None):
        p = read_tensor(frame.body, torch.float32, rows * r, device=device).view(rows, r)
        q = read_tensor(frame.body, torch.float32, cols * r, offset=4 * rows * r, device=device).view(cols, r)
        return p, q

    def _norm_bound(self, frame):
        mode, r, rows, cols = self._params(frame)
        if mode == RAW:
            return norm_bound(read_tensor(frame.body, torch.float32, frame.numel))
        p, q = self._factors(frame, r, rows, cols)
        return product_bound(norm_bound(p), norm_bound(q))  # ||P Q^T||_F <= ||P||_F ||Q||_F

    def _decode_into(self, frame, out, alpha, accumulate):
        mode, r, rows, cols = self._params(frame)
        if mode == RAW:
            v = read_tensor(frame.body, torch.float32, frame.numel, device=out.device)
            out.add_(weighted(v, alpha)) if accumulate else out.copy_(v)
            return
        p, q = self._factors(frame, r, rows, cols, out.device)
        m = out.view(rows, cols)
        if accumulate:
            add_product(m, p, q.t(), alpha)
        else:
            torch.mm(p, q.t(), out=m)
