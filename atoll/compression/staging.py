"""Payloads staged through the device: one copy each way per payload, on a side stream.

A codec writes a payload's body to the host a piece at a time (:func:`~atoll.compression.base.to_host`:
a chunk's scales, then its codes) and reads a pulled one the same way. On an accelerator each piece
is a small synchronous copy to or from pageable memory: on one H200 that held the identity codec's
encode to 1.3 GB/s of fp32 input and int8's to 4.0 GB/s, where the quantisation itself ran at 360
GB/s (``benchmarks/gpu.py``), and it held the training thread while it ran.

Inside a :class:`Window` those pieces go to a **mirror** of the payload on the device instead (a
device-to-device copy on the compute stream, or a view for a read), and the whole payload crosses
once, between the mirror and a **pinned** host buffer, on a **side stream** ordered against the
compute stream by events:

- encode: the codec fills the mirror; :meth:`StageBuffers.written` queues the mirror's copy to the
  pinned payload and returns at once; the payload is sealed (its CRC-32C, read from host memory) by
  whoever first needs its bytes, :meth:`DeviceStaging.settle`, after that copy's event. An
  overlapped exchange settles on its I/O thread, so the training thread never waits on the copy.
- decode: :meth:`StageBuffers.reading` copies the payload to the mirror on the side stream, the
  compute stream waits for that copy's event only, and the codec reads views of the mirror.

The mirror keeps each byte at the same address modulo 64 as on the host, so a view of a typed part
(fp32 scales, int16 indices) is exactly as aligned as the host bytes are; where they are not (the
body follows a header of any length) a read takes a device copy of those bytes instead of a view.
Every tensor outside a window is copied as before.
Each shard keeps its pinned buffer and mirror from round to round (allocated once, grown if a
payload needs more): GPU memory costs one payload per shard (int8: about a quarter of the shard's
fp32 bytes). A pinned payload a flight still holds for a re-push (:class:`~atoll.memory.Leases`) is
never written over; a fresh pinned buffer takes the next encode, as a bytearray did before.

Nothing here runs on the CPU unless asked (``DeviceStaging(cpu, enabled=True)``, for tests: the
mirror is then host memory and every copy synchronous); a CPU island's path is unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from contextvars import ContextVar

import numpy as np
import torch

ALIGN = 64
"""The mirror keeps host addresses modulo this (every dtype's alignment, and a cache line)."""


def address(buf) -> int:
    """The address of a bytes-like object's (or a CPU tensor's) first byte."""
    if isinstance(buf, torch.Tensor):
        return buf.data_ptr()
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data if memoryview(buf).nbytes else 0


def _data_ptr(t: torch.Tensor) -> int:
    """A CPU tensor's address (-1 for one that has none: a view made under FakeTensorMode)."""
    if type(t) is not torch.Tensor and type(t).__name__ == "FakeTensor":
        return -1
    return t.data_ptr()


def pinned_buffer(size: int) -> np.ndarray:
    """A pulled entry's room in pinned memory (for a :class:`~atoll.protos.rpc.BufferPool` that keeps
    it for the next pulls: pinning costs more than a mapping, once)."""
    return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()


class Window:
    """A host byte range ``[base, base + nbytes)`` mirrored on the device: ``mirror[pad:pad + nbytes]``."""

    def __init__(self, base: int, nbytes: int, mirror: torch.Tensor) -> None:
        self.base, self.nbytes, self.pad = base, nbytes, base % ALIGN
        self.mirror = mirror
        self.used = 0
        """Pieces served from the mirror (a test reads it)."""

    def bytes_of(self, host: torch.Tensor) -> torch.Tensor | None:
        """The mirror's bytes of a contiguous host tensor inside the range (uint8), or None."""
        if host.device.type != "cpu" or not host.is_contiguous():
            return None
        start, size = _data_ptr(host) - self.base, host.numel() * host.element_size()
        if start < 0 or start + size > self.nbytes:
            return None
        self.used += 1
        return self.mirror.narrow(0, self.pad + start, size)

    def write(self, host: torch.Tensor, src: torch.Tensor) -> bool:
        """``host = src`` into the mirror instead (``src`` converted to ``host``'s dtype on its own
        device); False when ``host`` is outside the range."""
        part = self.bytes_of(host)
        if part is None:
            return False
        part.copy_(src.to(host.dtype).reshape(-1).view(torch.uint8))
        return True

    def view(self, host: torch.Tensor) -> torch.Tensor | None:
        """The mirror's ``host`` (same dtype and shape), or None when it lies outside the range: a
        view where the device can take one at that alignment, else a device copy of those bytes."""
        part = self.bytes_of(host)
        if part is None:
            return None
        if (self.pad + _data_ptr(host) - self.base) % host.element_size():
            part = part.clone()  # (a fresh allocation is aligned)
        return part.view(host.dtype).view(host.shape)


_ACTIVE: ContextVar[Window | None] = ContextVar("atoll_staging_window", default=None)
_STAGE: ContextVar[StageBuffers | None] = ContextVar("atoll_staging", default=None)


def write(host: torch.Tensor, src: torch.Tensor) -> bool:
    """``host = src`` into the active window's mirror (see :meth:`Window.write`); False outside one."""
    window = _ACTIVE.get()
    return window is not None and window.write(host, src)


def view(host: torch.Tensor) -> torch.Tensor | None:
    """The active window's device copy of ``host`` (see :meth:`Window.view`), if any."""
    window = _ACTIVE.get()
    return None if window is None else window.view(host)


def stored(host: torch.Tensor) -> torch.Tensor:
    """Where the bytes written to ``host`` are now: the active window's mirror of it, or ``host``."""
    mirror = view(host)
    return host if mirror is None else mirror


def current() -> StageBuffers | None:
    """The buffers an encode running now stages through (:meth:`StageBuffers.encoding`), if any."""
    return _STAGE.get()


@contextlib.contextmanager
def active(window: Window | None):
    token = _ACTIVE.set(window)
    try:
        yield window
    finally:
        _ACTIVE.reset(token)


class DeviceStaging:
    """One device's side stream and the payloads waiting for their copy to the host (thread-safe:
    the training thread encodes, an overlapped exchange's I/O thread settles)."""

    def __init__(self, device: torch.device, *, enabled: bool | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.enabled = self.cuda if enabled is None else enabled
        self.side = torch.cuda.Stream(device) if self.cuda and self.enabled else None
        self._unsealed: dict[int, object] = {}
        """The copy event of each payload not sealed yet, by the payload's address (a buffer encoded
        into again replaces its entry)."""
        self._lock = threading.Lock()

    def buffers(self) -> StageBuffers | None:
        """A shard's own pinned buffer and mirror (None when staging is off)."""
        return StageBuffers(self) if self.enabled else None

    def settle(self, payload):
        """``payload``, its copy to the host complete and its checksum written (a payload that was
        not staged, or is settled already, comes back as it is)."""
        from atoll.compression.wire import seal

        if not self._unsealed:
            return payload
        with self._lock:
            waiting = self._unsealed.pop(address(payload), False)
        if waiting is not False:
            if waiting is not None:
                waiting.synchronize()
            seal(payload)
        return payload

    def pending(self) -> int:
        with self._lock:
            return len(self._unsealed)

    def _wait_for_host(self, payload, done) -> None:
        with self._lock:
            self._unsealed[address(payload)] = done

    # ---- stream ordering (no-ops on the CPU) -----------------------------------------------------
    def _compute_event(self):
        return torch.cuda.current_stream(self.device).record_event() if self.side is not None else None

    def _on_side(self):
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def _side_done(self, mirror: torch.Tensor):
        """The side stream's copy is queued: the allocator keeps ``mirror`` until it ran; its event."""
        if self.side is None:
            return None
        mirror.record_stream(self.side)
        return self.side.record_event()

    def _compute_waits(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


class StageBuffers:
    """One shard's pinned payload buffer and device mirror, reused round after round."""

    def __init__(self, staging: DeviceStaging) -> None:
        self.staging = staging
        self.host: torch.Tensor | None = None
        """Pinned uint8: the payloads encoded into it are memoryviews of :attr:`_array`."""
        self._array: np.ndarray | None = None
        self.mirror: torch.Tensor | None = None
        self._last = None
        """Event of the side stream's last copy to or from the mirror."""
        self._written: Window | None = None

    def payload_buffer(self, nbytes: int, busy=None) -> memoryview:
        """Room for a payload of ``nbytes`` in pinned memory: the last one's buffer unless it is too
        small or ``busy(buffer)`` (someone still reads the last payload)."""
        if self.host is None or self.host.numel() < nbytes or (busy is not None and busy(memoryview(self._array))):
            if self.staging.cuda:
                self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self._array = self.host.numpy()
            else:  # (numpy's: a real buffer under FakeTensorMode too)
                self._array = np.zeros(nbytes, dtype=np.uint8)
                self.host = torch.from_numpy(self._array)
        return memoryview(self._array)

    @contextlib.contextmanager
    def encoding(self):
        """Encodes in this block stage their bodies here (see :func:`current`)."""
        token = _STAGE.set(self)
        try:
            yield self
        finally:
            _STAGE.reset(token)

    def window_for(self, body: memoryview) -> Window | None:
        """The mirror of ``body`` (a part of :attr:`host`) that the codec writes instead, once the side
        stream's last copy from it is done (the compute stream waits for it, not the host)."""
        self._written = None
        if self.host is None or not body.nbytes:
            return None
        base = address(body)
        if not address(self._array) <= base < address(self._array) + self._array.nbytes:
            return None  # not our buffer (e.g. the codec was handed another one)
        self.staging._compute_waits(self._last)
        return Window(base, body.nbytes, self._mirror(base % ALIGN + body.nbytes))

    def written(self, payload: memoryview, window: Window) -> None:
        """The codec has written the mirror: queue its copy into the pinned payload (on the side
        stream, after the codec's kernels); the payload is sealed by :meth:`DeviceStaging.settle`."""
        staging = self.staging
        start = window.base - address(self._array)
        ready = staging._compute_event()
        with staging._on_side():
            if staging.side is not None:
                staging.side.wait_event(ready)
            dest = self.host.narrow(0, start, window.nbytes)
            dest.copy_(window.mirror.narrow(0, window.pad, window.nbytes), non_blocking=staging.side is not None)
            done = staging._side_done(window.mirror)
        self._last, self._written = done, window
        staging._wait_for_host(payload, done)

    def again(self):
        """Reads in this block see the last payload :meth:`written` from its mirror (error feedback
        decodes what it just encoded, before the payload is on the host)."""
        return active(self._written)

    @contextlib.contextmanager
    def reading(self, payload):
        """Decodes in this block read ``payload`` (host bytes) from a device copy of it: one copy on
        the side stream, which the compute stream waits for. The host is free to reuse ``payload``'s
        memory once the block ends."""
        view = memoryview(payload).cast("B")
        if not view.nbytes:
            yield None
            return
        staging = self.staging
        base = address(view)
        pad = base % ALIGN
        mirror = self._mirror(pad + view.nbytes)
        ready = staging._compute_event()  # earlier kernels reading the mirror
        with staging._on_side():
            if staging.side is not None:
                staging.side.wait_event(ready)
            src = torch.frombuffer(view, dtype=torch.uint8) if not view.readonly else _readonly_tensor(view)
            mirror.narrow(0, pad, view.nbytes).copy_(src, non_blocking=staging.side is not None)
            done = staging._side_done(mirror)
        staging._compute_waits(done)
        self._last = done
        window = Window(base, view.nbytes, mirror)
        try:
            with active(window):
                yield window
        finally:
            if done is not None:
                done.synchronize()  # the host's bytes are read (the DMA only; the decode runs on)

    def _mirror(self, nbytes: int) -> torch.Tensor:
        if self.mirror is None or self.mirror.numel() < nbytes:
            if self.mirror is not None and self._last is not None:
                self._last.synchronize()  # the old mirror may still be copied from
            self.mirror = torch.empty(nbytes, dtype=torch.uint8, device=self.staging.device)
        return self.mirror


def _readonly_tensor(view: memoryview) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.frombuffer(view, dtype=np.uint8))
