"""Per-shard outer state and the exchange math, on the device the parameters live on.

One :class:`ShardState` per local shard owns its outer state and where it lives:

- the round-start θ (fp32) and the error-feedback residual, in host memory by default (pinned
  when CUDA is present; write-backs run on a side stream so training is not held up), or on the
  parameters' device (``DiLoCo(outer_state="device")``: faster, one more model copy there);
- the overlap snapshot (θ when the exchange was pushed), placed the same way;
- codec state that is not the residual (PowerSGD's Q: small) stays on the device with the codec.

The pseudo-gradient θ_start − θ is formed and encoded on the parameters' device, a chunk at a time
for chunked codecs; only the encoded payload crosses to the host. Pulled payloads are copied to the
device compressed and decoded and applied there. On the CPU nothing moves and the arithmetic is
exactly that of the plain implementation (payloads and θ bitwise unchanged).
"""

from __future__ import annotations

import contextlib

import torch

from atoll.compression import codec_of
from atoll.compression.staging import DeviceStaging
from atoll.islands._shards import LocalShard
from atoll.memory import Leases

HOST, DEVICE = "host", "device"
PLACEMENTS = (HOST, DEVICE)


class Placement:
    """Where outer state lives, and the (deliberate) copies between there and the device."""

    def __init__(self, where: str, device: torch.device) -> None:
        if where not in PLACEMENTS:
            raise ValueError(f"outer_state must be one of {PLACEMENTS}, got {where!r}")
        self.where = where
        self.device = device
        self.on_host = where == HOST and device.type != "cpu"
        """Outer state in host memory for a device that is not the CPU (else it stays where it is)."""
        self.pin = self.on_host and device.type == "cuda" and torch.cuda.is_available()
        self._side = torch.cuda.Stream(device) if self.pin else None
        self._written = None
        """Event of the last write-back on the side stream."""

    def keep(self, t: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """Keep ``t`` (a finished device tensor nobody modifies afterwards) as outer state: ``t`` itself,
        or a host copy (into ``into`` when it fits) written on the side stream."""
        if not self.on_host:
            return t
        dst = into if into is not None and into.shape == t.shape and into.dtype == t.dtype else self._host_like(t)
        if self._side is None:
            dst.copy_(t)  # a device without streams: a plain device-to-host copy
            return dst
        ready = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self._side):
            self._side.wait_event(ready)
            dst.copy_(t, non_blocking=True)
        t.record_stream(self._side)  # the allocator keeps t until the copy is done
        self._written = self._side.record_event()
        return dst

    def copy_of(self, t: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of a live tensor (a parameter about to change) as outer state, taken now on the
        current stream, so later kernels cannot overtake it: a device copy (the device's memory speed),
        then, in host memory, moved there on the side stream like any outer state (the training
        stream does not carry the crossing; the device copy is freed once it ran). ``into``: outer
        state of ``t``'s shape to write it into (memory already mapped: a fresh tensor takes a page
        fault every 4 KiB, which at 124M doubled the copy's time on the CPU)."""
        if not self.on_host and into is not None and into.shape == t.shape and into.dtype == t.dtype:
            return into.copy_(t.detach())
        return self.keep(t.detach().clone(), into=into)

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        """Outer state on the device: ``t`` itself, or a host-to-device copy of it."""
        if not self.on_host:
            return t
        if self._written is not None:
            torch.cuda.current_stream(self.device).wait_event(self._written)
        return t.to(self.device, non_blocking=self.pin)

    def settle(self) -> None:
        """Wait for write-backs before the host reads outer state (a checkpoint)."""
        if self._written is not None:
            self._written.synchronize()
            self._written = None

    def _host_like(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)


class ShardState:
    """The outer state of one local shard, and the math of one exchange on it."""

    def __init__(
        self, shard: LocalShard, placement: Placement, leases: Leases, staging: DeviceStaging | None = None
    ) -> None:
        """``leases``: who reads this shard's payloads (a push, a flight keeping it for a re-push): its
        next encode takes the last payload's buffer only once nobody does. ``staging``: the device's
        (an accelerator's): payloads cross in one copy each way, on its side stream, through this
        shard's pinned buffer and device mirror (:mod:`atoll.compression.staging`)."""
        self.shard = shard
        self.placement = placement
        self.leases = leases
        self.staging = staging
        self._stage = staging.buffers() if staging is not None else None
        self.start: torch.Tensor | None = None
        """θ of the round start (fp32, placed)."""
        self.codec_state: dict = {}
        """The codec's per-tensor state; its ``residual`` (error feedback) placed like ``start``."""
        self.snapshot: torch.Tensor | None = None
        """Overlap: θ when the exchange was pushed (placed)."""
        self._spare: torch.Tensor | None = None
        """Overlap: the last snapshot's storage (it held the merge's delta), the next snapshot's."""
        self.merge_delta: torch.Tensor | None = None
        """Overlap, once the update arrived and θ_start holds it: θ_start − snapshot, made on the
        exchange's thread in the snapshot's storage (:meth:`prepare_merge`); the merge adds it."""
        self._payload: bytearray | None = None
        """The last payload encoded: the next one's buffer once nobody holds a lease on it."""

    @property
    def device(self) -> torch.device:
        return self.shard.local().device

    @torch.no_grad()
    def encode(self, codec, *, pushed: bool = False) -> bytearray:
        """Encode this shard's pseudo-gradient θ_start − θ; the arithmetic runs on the parameters'
        device and the payload is on the host. ``pushed``: of θ as it was pushed, the snapshot (the
        exchange's thread encodes while the training thread moves θ on): the same bits."""
        start = self.placement.fetch(self.start)
        kept = self.codec_state.get("residual")
        if kept is not None:
            self.codec_state["residual"] = self.placement.fetch(kept)
        spare, self._payload = self._payload, None
        if spare is not None and self.leases.held(spare):  # kept for a re-push, in a stream
            spare = None  # never written over
        local = self.placement.fetch(self.snapshot) if pushed else self.shard.local().detach()
        if self._stage is None:
            payload = codec.encode_difference(start, local, self.codec_state, out=spare)
        else:  # into pinned memory, copied on the side stream: sealed by settle(), not here
            room = self._stage.payload_buffer(codec.encoded_size(self.shard.sizes), busy=self.leases.held)
            with self._stage.encoding():
                payload = codec.encode_difference(start, local, self.codec_state, out=room)
        self._payload = payload
        if "residual" in self.codec_state:
            self.codec_state["residual"] = self.placement.keep(self.codec_state["residual"], into=kept)
        return payload

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """θ_start − θ as a tensor on the device (for inspection: ``DiLoCo.pseudo_gradient()``)."""
        return self.placement.fetch(self.start) - self.shard.local().detach().float()

    @torch.no_grad()
    def start_from_local(self) -> None:
        """θ_start = θ itself, in fp32: what the identity θ_0 this rank uploaded decodes to."""
        self.start = self.placement.copy_of(self.shard.local().float())

    @torch.no_grad()
    def take_snapshot(self) -> None:
        self.snapshot, self._spare = self.placement.copy_of(self.shard.local().float(), into=self._spare), None

    @torch.no_grad()
    def keep_base(self) -> None:
        """The push was dropped: keep θ_start (before the update) as the snapshot, so loading the new θ
        keeps all the local progress of the round, θ ← θ_new + (θ − θ_start), for the next push."""
        self.snapshot = self.placement.copy_of(self.placement.fetch(self.start))

    @torch.no_grad()
    def apply(self, payload, full: bool, *, verified: bool = False) -> None:
        """Advance θ_start by one pulled update: θ itself (``full``) or θ_start + u, decoded on the device.
        ``verified``: the payload's checksum was checked already (it is not read again)."""
        codec = codec_of(payload)
        if full:  # θ itself (a join, a catch-up): read piece by piece, the mirror is a payload's size
            new = codec.decode(payload, self.shard.sizes, device=self.device, verified=verified)
        else:
            with self._stage.reading(payload) if self._stage is not None else contextlib.nullcontext():
                new = codec.add_decoded_(payload, self.placement.fetch(self.start), verified=verified)
        self.start = self.placement.keep(new, into=self.start)

    @torch.no_grad()
    def prepare_merge(self, updates: list[tuple[object, bool]]) -> None:
        """The merge made ready off the training thread: θ_start advanced by ``updates`` (each
        ``(payload, full)``, checked already), then the merge's delta θ_start − snapshot, into the
        snapshot's storage; :meth:`load_into_param` then adds it in one pass."""
        for payload, full in updates:
            self.apply(payload, full, verified=True)
        snapshot = self.placement.fetch(self.snapshot)
        delta = torch.sub(self.placement.fetch(self.start), snapshot, out=snapshot)
        self.merge_delta = self.placement.keep(delta, into=self.snapshot)
        self.snapshot = None

    @torch.no_grad()
    def load_into_param(self, merge: bool) -> None:
        """Write θ_start into the parameter; with ``merge``, keep the progress made since the snapshot:
        θ ← θ_start + (θ − θ_snapshot)."""
        start = self.placement.fetch(self.start)
        local = self.shard.local()
        if merge and self.merge_delta is not None:  # made on the exchange's thread: one pass here
            local.add_(self.placement.fetch(self.merge_delta))
        elif merge:
            local.add_(start - self.placement.fetch(self.snapshot))
        else:
            local.copy_(start)
        # The snapshot's storage is the next one's: the island's peak (a flight's) held between flights.
        self._spare = self.merge_delta if self.merge_delta is not None else self.snapshot
        self.snapshot = self.merge_delta = None

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """CPU copies of the outer state (the snapshot is not kept: it is θ at a push, which a
        checkpoint taken at the push holds as the model itself)."""
        self.placement.settle()
        return {"start": _cpu(self.start), "codec_state": _map_tensors(self.codec_state, _cpu)}

    def load_state_dict(self, sd: dict) -> None:
        device = self.device
        start = sd["start"].to(device=device, dtype=torch.float32)
        self.start = self.placement.keep(start)
        state = _map_tensors(sd["codec_state"], lambda t: t.to(device))
        if state.get("residual") is not None:
            state["residual"] = self.placement.keep(state["residual"])
        self.codec_state = state


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu", copy=True)


def _map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj
