"""The codec interface and the helpers every codec shares.

A codec turns a float tensor into a self-describing payload (:mod:`atoll.compression.wire`) and
back. ``encode`` may keep per-tensor state between rounds (PowerSGD's warm-started Q, error
feedback's residual) in the ``state`` dict the caller owns. Decoding is stateless, and
``decode_add_`` accumulates straight into an fp32 buffer (the coordinator's accumulator) without
building a dense copy where the codec allows it.
"""

from __future__ import annotations

import math
import struct
import warnings
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch

from atoll.compression import staging
from atoll.compression.wire import Frame, WireFormatError, allocate, payload_size, seal, unpack

CHUNK = 1 << 20
"""Elements processed per step by chunked codecs on the CPU: temporaries stay cache-resident."""
DEVICE_CHUNK = 1 << 24
"""Elements per step on an accelerator: fewer kernel launches and host copies, 64 MiB fp32 temporaries."""


def chunk_elems(device: torch.device) -> int:
    """Elements a chunked codec processes per step on ``device``."""
    return CHUNK if device.type == "cpu" else DEVICE_CHUNK


class Chunks:
    """A flat fp32 input that a chunked codec (:attr:`Codec.chunked_input`) reads through :func:`span`,
    a chunk at a time, each chunk once and in order, never whole. Subclasses make each chunk.

    One that :attr:`wants_decoded` is told, after each chunk is encoded, what decoding the payload
    gives for it (:meth:`encoded`): the bits of ``decode(payload)``, from values the encoder has in
    hand (a quantised chunk is still in cache), so no second pass over the payload is needed."""

    wants_decoded = False
    dtype = torch.float32

    def __init__(self, numel: int, device: torch.device) -> None:
        self._numel = numel
        self.device = device

    def numel(self) -> int:
        return self._numel

    def span(self, start: int, length: int) -> torch.Tensor:
        raise NotImplementedError

    def encoded(self, start: int, decoded: torch.Tensor) -> None:
        """The chunk at ``start`` is encoded; ``decoded`` is what decoding gives for it (only called when
        :attr:`wants_decoded`; valid during the call only)."""


class Difference(Chunks):
    """``a - b`` (flat, fp32) computed a chunk at a time into one scratch buffer, never whole.

    Codecs that read their input in chunks (:attr:`Codec.chunked_input`) take it in place of a flat
    tensor, so the pseudo-gradient θ_start − θ is never materialised: one scratch chunk, not a copy
    of the largest tensor, on the parameters' device. Elementwise subtraction of a chunk equals the
    chunk of the whole subtraction, so payloads are bitwise those of ``encode(a - b)``.
    """

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.shape != b.shape or a.device != b.device:
            raise ValueError(f"difference of {tuple(a.shape)}@{a.device} and {tuple(b.shape)}@{b.device}")
        super().__init__(a.numel(), a.device)
        self.a = a.detach().reshape(-1)
        self.b = b.detach().reshape(-1)
        self._scratch = torch.empty(min(self.a.numel(), chunk_elems(a.device)), dtype=torch.float32, device=a.device)

    def span(self, start: int, length: int) -> torch.Tensor:
        out = self._scratch.narrow(0, 0, length)
        return torch.sub(self.a.narrow(0, start, length), self.b.narrow(0, start, length), out=out)


def report(flat, start: int, decoded: Callable[[], torch.Tensor]) -> None:
    """Tell a :class:`Chunks` input that wants it what its chunk at ``start`` decodes to (``decoded()``
    is computed only then)."""
    if isinstance(flat, Chunks) and flat.wants_decoded:
        flat.encoded(start, decoded())


def weighted(v: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha * v`` rounded on its own, for ``out += weighted(v, alpha)``: a fused multiply-add into
    the accumulator would make the sum of two contributions depend on which came first, and the
    coordinator's first two may come in either order (:mod:`atoll.coordinator.policy.order`). ``v``
    itself when ``alpha`` is 1 (exact either way)."""
    if alpha == 1.0:
        return v
    return v * alpha if v.dtype == torch.float32 else v.to(torch.float32).mul_(alpha)


def add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """``out += weighted(a @ b, alpha)`` for a 2-D ``out``, a block of rows at a time: the product's
    temporary is one chunk (cache-sized on the CPU), not the whole matrix."""
    rows = max(1, chunk_elems(out.device) // max(1, out.shape[1]))
    for r in range(0, out.shape[0], rows):
        n = min(rows, out.shape[0] - r)
        out.narrow(0, r, n).add_(weighted(torch.mm(a.narrow(0, r, n), b), alpha))


def span(x, start: int, length: int) -> torch.Tensor:
    """Elements ``[start, start + length)`` (clipped) of a flat tensor or a :class:`Chunks` input.

    ``narrow`` rather than Python slicing: the same view, without the device guard some builds run
    for ``__getitem__`` (it keeps the codecs runnable under FakeTensorMode on a CPU-only build)."""
    length = min(length, x.numel() - start)
    return x.span(start, length) if isinstance(x, Chunks) else x.narrow(0, start, length)


Writer = Callable[[memoryview], None]


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite, in one summing pass without temporaries.

    A NaN or an infinity makes any sum that includes it non-finite (inf - inf is NaN), so a
    finite sum proves every element finite. Only a non-finite sum, which a finite tensor reaches
    solely by overflow, takes the exact elementwise check. That is ~28x faster on the common path
    than ``torch.isfinite(t).all()``, which materialises two boolean temporaries.
    """
    if t.numel() == 0:
        return True
    if math.isfinite(float(t.sum(dtype=torch.float32))):
        return True
    return all(bool(torch.isfinite(t[s : s + CHUNK]).all()) for s in range(0, t.numel(), CHUNK))


def norm_bound(t: torch.Tensor, scale: float = 1.0) -> float:
    """``scale * ||t||_2`` in one pass without temporaries (fp32 accumulation: as fast as a sum, for
    any float dtype): NaN when ``t`` holds a NaN or an infinity, +inf when only its finite values
    overflow the computation."""
    if t.numel() == 0:
        return 0.0
    n = float(torch.linalg.vector_norm(t, dtype=torch.float32)) * scale
    if math.isfinite(n):
        return n
    return math.inf if all_finite(t) else math.nan


def product_bound(a: float, b: float) -> float:
    """``a * b`` for two norm bounds: NaN if either is, 0 if either is 0 (inf * 0 is not NaN here)."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return 0.0 if a == 0 or b == 0 else a * b


class Codec:
    """Base class: subclasses set ``name``/``codec_id`` and implement the underscored hooks."""

    name: ClassVar[str]
    codec_id: ClassVar[int]
    params: ClassVar[dict[str, type]] = {}
    """The parameters its spec string takes (``int8:block=128``), with their types: the keyword
    arguments of its constructor."""
    lossy: ClassVar[bool] = True
    writes_weighted: ClassVar[bool] = False
    """Whether ``_decode_into`` with ``accumulate`` False writes ``alpha * decode`` (else it ignores
    ``alpha``), and its decode never gives -0.0 (so that equals ``0 + alpha * decode``)."""
    stateful: ClassVar[bool] = False
    """Whether ``encode`` reads or writes per-tensor ``state`` (then encoding twice is not the same)."""
    drops_values: ClassVar[bool] = False
    """Whether a payload sends only some of the tensor's values (top-k, sparse): what it drops is lost
    unless error feedback carries it into the next round."""
    adds_exactly: ClassVar[bool] = False
    """Whether ``decode_add_(payload, out)`` (alpha 1) is bit for bit ``out + decode(payload)``: it is
    for codecs that decode element by element; a codec that decodes through a matmul or a transform
    may round a chunk differently from the whole."""

    @property
    def chunked_input(self) -> bool:
        """Whether ``_encode`` reads its input only through ``numel()`` and chunk slices (it then
        accepts a :class:`Chunks` input: :meth:`encode_chunks`, a :class:`Difference`)."""
        return False

    @property
    def spec(self) -> str:
        """Canonical spec string, accepted by :func:`atoll.compression.get_codec`."""
        return self.name

    def __repr__(self) -> str:
        return f"<codec {self.spec}>"

    # ---- public API ------------------------------------------------------------------------
    def encode(self, tensor: torch.Tensor, state: dict | None = None, *, out: bytearray | None = None) -> bytearray:
        """Encode a floating-point tensor into a host payload.

        The codec's arithmetic runs on the tensor's device; only the finished payload bytes cross to
        the host (a device-to-host copy into ``out``). ``out``: a buffer to reuse as the payload
        (e.g. last round's); returned, resized.
        """
        if not tensor.is_floating_point():
            raise TypeError(f"{self.name} encodes floating-point tensors, got {tensor.dtype}")
        flat = tensor.detach().reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        return self._pack(flat, tuple(tensor.shape), tensor.dtype, state, out)

    def encode_difference(
        self, a: torch.Tensor, b: torch.Tensor, state: dict | None = None, *, out: bytearray | None = None
    ) -> bytearray:
        """``encode(a - b)`` for tensors on one device; a chunked codec never builds ``a - b`` whole."""
        if not self.chunked_input:
            return self.encode(a.float() - b.float(), state, out=out)
        if not (a.is_floating_point() and b.is_floating_point()):
            raise TypeError(f"{self.name} encodes floating-point tensors, got {a.dtype} and {b.dtype}")
        dtype = torch.promote_types(a.dtype, b.dtype)
        return self._pack(Difference(a, b), tuple(a.shape), dtype, state, out)

    def encode_chunks(
        self, source: Chunks, shape: tuple[int, ...], state: dict | None = None, *, out: bytearray | None = None
    ) -> bytearray:
        """Encode ``source`` (fp32, ``shape``), made a chunk at a time as it is read (a
        :attr:`chunked_input` codec only)."""
        if not self.chunked_input:
            raise TypeError(f"{self.spec} reads its input whole, not in chunks")
        return self._pack(source, tuple(shape), torch.float32, state, out)

    def _pack(self, flat, shape: tuple[int, ...], dtype: torch.dtype, state: dict | None, out) -> bytearray:
        params, body_len, write = self._encode(flat, shape, {} if state is None else state)
        dtype = dtype if dtype != torch.float64 else torch.float32
        payload, body = allocate(self.codec_id, dtype, shape, params, body_len, out)
        stage = staging.current()
        window = stage.window_for(body) if stage is not None else None
        if window is None:
            if body_len:
                write(body)
            return seal(payload)
        with staging.active(window):  # the body is written to a device mirror, then copied whole
            write(body)
        stage.written(payload, window)
        return payload  # sealed once on the host (DeviceStaging.settle)

    def encoded_size(self, shape: tuple[int, ...]) -> int:
        """Bytes of the payload of any tensor of ``shape`` (known before encoding: a push header
        declares it, and the payload can then be encoded while the stream goes out)."""
        params_len, body_len = self._sizes(tuple(int(d) for d in shape))
        return payload_size(len(shape), params_len, body_len)

    def _sizes(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """(params bytes, body bytes) of a payload of ``shape``."""
        raise NotImplementedError

    def frame(self, payload, expected_shape: tuple[int, ...] | None = None, *, verified: bool = False) -> Frame:
        """Parse a payload and check it belongs to this codec and (if given) the expected shape.
        ``verified``: this very payload was checked already, its checksum and its structure (it passed
        :meth:`frame` or :meth:`validate` here, or this process made it): neither is checked again (see
        :func:`~atoll.compression.wire.unpack`; a sparse payload's structure is an O(K) pass over its
        indices). Its header is still parsed, against this codec and the shape."""
        max_numel = None if expected_shape is None else math.prod(int(d) for d in expected_shape)
        frame = unpack(payload, max_numel=max_numel, verified=verified)
        if frame.codec_id != self.codec_id:
            raise WireFormatError(f"payload was encoded with codec id {frame.codec_id}, expected {self.name}")
        if expected_shape is not None and frame.shape != tuple(int(d) for d in expected_shape):
            raise WireFormatError(f"payload has shape {list(frame.shape)}, expected {list(expected_shape)}")
        if not verified:
            self._check(frame)
        return frame

    def validate(self, payload, expected_shape: tuple[int, ...]) -> float:
        """Full structural check, the payload's params against this codec's own (the run's spec: a push
        cannot declare another block, count, chunk or rank), plus "decodes to finite values", without
        decoding densely. Returns an upper bound of the L2 norm of what the payload decodes to
        (:meth:`norm_bound`)."""
        frame = self.frame(payload, expected_shape)
        self._conforms(frame)
        bound = self._norm_bound(frame)
        if math.isnan(bound):
            raise WireFormatError("non-finite values (NaN/Inf) in the payload")
        return bound

    def norm_bound(self, payload, expected_shape: tuple[int, ...] | None = None, *, verified: bool = False) -> float:
        """An upper bound of the L2 norm of what the payload decodes to, so of every decoded value's
        magnitude too, from one pass over its stored values or only their scales (int8: 1/64 of the
        values): NaN when it decodes to a NaN or an infinity, +inf when finite stored values are too
        large for the bound itself. ``verified``: as for :meth:`frame`."""
        return self._norm_bound(self.frame(payload, expected_shape, verified=verified))

    def decode(
        self,
        payload,
        expected_shape: tuple[int, ...] | None = None,
        *,
        device: torch.device | None = None,
        verified: bool = False,
    ) -> torch.Tensor:
        """Decode to a new float32 tensor of the payload's shape, on ``device`` (default: the CPU).

        The payload stays on the host; its (compressed) parts are copied to ``device`` and
        decompressed there."""
        frame = self.frame(payload, expected_shape, verified=verified)
        out = torch.empty(frame.numel, dtype=torch.float32, device=device)
        if frame.numel:
            self._decode_into(frame, out, 1.0, False)
        return out.reshape(frame.shape)

    def decode_into(self, payload, out: torch.Tensor) -> torch.Tensor:
        """``out = decode(payload)`` without a temporary; ``out`` is contiguous float32, on any device."""
        self._check_out(out)
        frame = self.frame(payload, tuple(out.shape))
        if frame.numel:
            self._decode_into(frame, out.view(-1), 1.0, False)
        return out

    def decode_add_(self, payload, out: torch.Tensor, alpha: float = 1.0, *, verified: bool = False) -> torch.Tensor:
        """``out += alpha * decode(payload)``; ``out`` is contiguous float32, on any device. The
        product is rounded before it is added (see :func:`weighted`), so two contributions sum to
        bitwise the same result in either order. ``verified``: as for :meth:`frame`."""
        self._check_out(out)
        frame = self.frame(payload, tuple(out.shape), verified=verified)
        if frame.numel:
            self._decode_into(frame, out.view(-1), float(alpha), True)
        return out

    def write_weighted_(
        self, payload, out: torch.Tensor, alpha: float = 1.0, *, verified: bool = False
    ) -> torch.Tensor:
        """``out = alpha * decode(payload)`` with the product rounded as :meth:`decode_add_` rounds it:
        what adding into a zeroed ``out`` gives, without reading or zeroing ``out`` first (a codec
        whose decode never gives -0.0, :attr:`writes_weighted`; any other zeroes ``out`` and adds)."""
        if not self.writes_weighted:
            out.zero_()
            return self.decode_add_(payload, out, alpha, verified=verified)
        self._check_out(out)
        frame = self.frame(payload, tuple(out.shape), verified=verified)
        if frame.numel:
            self._decode_into(frame, out.view(-1), float(alpha), False)
        return out

    def add_decoded_(self, payload, out: torch.Tensor, *, verified: bool = False) -> torch.Tensor:
        """``out += decode(payload)``, bit for bit ``out + decode(payload)``: how an outer update
        is applied to θ wherever it is (an island's θ_start, a replayed log), the same bits as the
        coordinator's θ_{r+1} = decode(u) + θ_r. Straight from the payload when the codec
        :attr:`adds_exactly` (no temporary the size of the tensor), else through a decoded one."""
        if self.adds_exactly:
            return self.decode_add_(payload, out, verified=verified)
        return out.add_(self.decode(payload, tuple(out.shape), device=out.device, verified=verified))

    @staticmethod
    def _check_out(out: torch.Tensor) -> None:
        if out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError("decoding into a tensor needs a contiguous float32 tensor")

    # ---- hooks -----------------------------------------------------------------------------
    def _encode(self, flat: torch.Tensor, shape: tuple[int, ...], state: dict) -> tuple[bytes, int, Writer]:
        raise NotImplementedError

    def _check(self, frame: Frame) -> None:
        """Raise WireFormatError unless params and body sizes are consistent with the shape, every
        size-like param bounded (by the tensor's size or the codec's own limits) before anything is
        allocated for it."""
        raise NotImplementedError

    def _conforms(self, frame: Frame) -> None:
        """Raise WireFormatError unless the params of a checked payload are those this codec (its spec)
        writes for the payload's shape; a codec without params has nothing to compare."""

    def _norm_bound(self, frame: Frame) -> float:
        """An upper bound of ``||decode(payload)||_2`` (see :func:`norm_bound`: NaN for non-finite values)."""
        raise NotImplementedError

    def _decode_into(self, frame: Frame, out: torch.Tensor, alpha: float, accumulate: bool) -> None:
        raise NotImplementedError


def read_tensor(
    buf, dtype: torch.dtype, count: int, offset: int = 0, *, device: torch.device | None = None
) -> torch.Tensor:
    """``count`` items at byte ``offset`` of a (possibly read-only) host buffer: a view of it, or with
    ``device`` given, on that device (a host-to-device copy of exactly those bytes; none for the CPU).

    Callers only read from it; torch warns about read-only buffers, which is moot here.
    """
    if device is not None:
        return to_device(read_tensor(buf, dtype, count, offset), device)
    if count == 0:
        return torch.empty(0, dtype=dtype)
    np_dtype = {
        torch.float32: np.float32,
        torch.float16: np.float16,
        torch.int8: np.int8,
        torch.uint8: np.uint8,
        torch.int16: np.int16,
        torch.int32: np.int32,
        torch.int64: np.int64,
    }
    bf16 = dtype == torch.bfloat16
    arr = np.frombuffer(buf, dtype=np.int16 if bf16 else np_dtype[dtype], count=count, offset=offset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if bf16 else t


def write_tensor(buf: memoryview, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    """A writable host tensor view of ``count`` items at byte ``offset`` of ``buf``."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def to_host(dest: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` (any device) into the host view ``dest``, converting the dtype on ``src``'s device
    first so only ``dest``'s bytes cross to the host (on the CPU the copy converts as it goes).
    Staged (:mod:`~atoll.compression.staging`): into the device mirror of ``dest`` instead."""
    if staging.write(dest, src):
        return
    dest.copy_(src if src.dtype == dest.dtype or src.device.type == "cpu" else src.to(dest.dtype))


def to_device(src: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor of a payload on ``device``: a copy of exactly its bytes, or, staged
    (:mod:`~atoll.compression.staging`), the device mirror's view of them (no copy)."""
    mirror = staging.view(src)
    device = torch.device(device)
    if mirror is not None and mirror.device.type == device.type and device.index in (None, mirror.device.index):
        return mirror
    return src.to(device)


def expect_params(frame: Frame, fmt: struct.Struct, what: str) -> tuple:
    if frame.params.nbytes != fmt.size:
        raise WireFormatError(f"{what}: params are {frame.params.nbytes} bytes, expected {fmt.size}")
    return fmt.unpack(frame.params)


def expect_body(frame: Frame, need: int, what: str) -> None:
    if frame.body.nbytes != need:
        raise WireFormatError(f"{what}: body is {frame.body.nbytes} bytes, expected {need}")
