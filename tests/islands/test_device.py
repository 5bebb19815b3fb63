"""Accelerator islands on a CPU-only machine: parameters on a fake ``cuda`` device.

Under ``FakeTensorMode`` tensors carry a device but no data, and any op that mixes devices raises
``FakeTensorDeviceMismatchError``; a dispatch mode stacked on it counts the bytes that cross between
host and device. So these tests run the island's exchange math, and a whole DiLoCo island against a
real coordinator, with the parameters "on the GPU": the pseudo-gradient must be formed and encoded
on the device, and only encoded payloads may cross to the host. (Before: the round-start θ lived on
the CPU and was subtracted from the device parameters; every codec copied the whole tensor to host
fp32 first.)
"""

from __future__ import annotations

import math

import pytest
import torch
from support import exact_config, make_diloco
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from atoll.compression import ErrorFeedback, get_codec
from atoll.compression.staging import DeviceStaging
from atoll.coordinator import RunConfig
from atoll.coordinator.options import PlacementOptions
from atoll.islands._shard_state import Placement, ShardState
from atoll.islands._shards import local_shards
from atoll.islands._transport.client import RetryPolicy
from atoll.memory import Leases

CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def copy_into_fake_cuda(monkeypatch):
    """On a CPU-only build, ``Tensor.copy_`` into a (fake) cuda tensor asks the CUDA runtime for a
    device guard before it dispatches, and fails; the aten op it dispatches to runs under
    FakeTensorMode, so route it there (every other op dispatches as on a GPU build)."""
    monkeypatch.setattr(
        torch.Tensor,
        "copy_",
        lambda self, src, non_blocking=False: torch.ops.aten.copy_.default(self, src, non_blocking),
    )


class CrossingCounter(TorchDispatchMode):
    """Bytes copied host->device and device->host by the ops it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.h2d = self.d2h = 0
        self.h2d_copies = self.d2h_copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        if name.startswith("_to_copy") and isinstance(args[0], torch.Tensor):
            src, dst = args[0].device, kwargs.get("device") or args[0].device
            self._count(src, torch.device(dst), args[0].numel() * _itemsize(kwargs.get("dtype") or args[0].dtype))
        elif name.startswith("copy_") and len(args) >= 2:
            dst, src = args[0], args[1]
            self._count(src.device, dst.device, dst.numel() * dst.element_size())
        return func(*args, **kwargs)

    def _count(self, src: torch.device, dst: torch.device, num_bytes: int) -> None:
        if src.type == "cpu" and dst.type != "cpu":
            self.h2d += num_bytes
            self.h2d_copies += 1
        elif src.type != "cpu" and dst.type == "cpu":
            self.d2h += num_bytes
            self.d2h_copies += 1


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def real_zeros(codec, shape) -> bytearray:
    """A payload of zeros made outside the fake mode: a fake tensor's bytes are never written, and a
    codec that checks its indices (sparse) refuses a payload of zero bytes."""
    with unset_fake_temporarily():
        return codec.encode(torch.zeros(shape), {})


def fake_model():
    """Built on the CPU, its tensors moved to the fake GPU (call inside FakeTensorMode)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.BatchNorm1d(96), torch.nn.Linear(96, 32))
    for mod in model.modules():
        for name, p in mod._parameters.items():
            mod._parameters[name] = torch.nn.Parameter(p.detach().to(CUDA))
        for name, b in mod._buffers.items():
            mod._buffers[name] = b.to(CUDA)
    return model


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("spec", ["identity", "int8", "int8+ef", "powersgd:rank=2", "sparse", "sparse+ef"])
def test_exchange_math_stays_on_the_device(where, spec):
    """Delta, encode up to the host payload, decode and apply, overlap merge: no device mixing, and
    only the encoded bytes (plus, with host placement, the outer state itself) cross."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_model()
        shards = local_shards(model)
        assert {s.kind.value for s in shards} == {"parameter", "buffer"} and shards[0].local().device == CUDA
        placement = Placement(where, CUDA)
        states = [ShardState(s, placement, Leases()) for s in shards]
        ident = get_codec("identity")
        for st in states:  # θ_0 arrives as a full fp32 payload
            st.apply(ident.encode(torch.zeros(st.shard.sizes)), full=True)
            st.load_into_param(merge=False)
            assert st.start.device == (CUDA if where == "device" else torch.device("cpu"))
        codec = get_codec(spec.removesuffix("+ef"))
        if spec.endswith("+ef"):
            codec = ErrorFeedback(codec, 0.5)
        numel = sum(math.prod(s.sizes) for s in shards)
        with CrossingCounter() as crossings:
            payloads = [st.encode(codec) for st in states]
        pushed = sum(len(p) for p in payloads)
        outer_state = 4 * numel * (2 if spec.endswith("+ef") else 1)  # start (and residual) fetched
        decoded = pushed if spec.endswith("+ef") else 0  # error feedback decodes what it sent
        if where == "device":
            assert crossings.h2d <= decoded + 4096  # (and codec constants)
            assert crossings.d2h <= pushed, (crossings.d2h, pushed)  # the payload bytes, nothing else
        else:
            assert crossings.h2d <= outer_state + decoded + 4096
            assert crossings.d2h <= pushed + (outer_state - 4 * numel) + 4096
        for st in states:
            st.take_snapshot()
            st.apply(ident.encode(torch.zeros(st.shard.sizes)), full=False)
            st.load_into_param(merge=True)  # θ ← θ_start + (θ − θ_snapshot)
            st.apply(real_zeros(codec, st.shard.sizes), full=False)
            st.load_into_param(merge=False)
            assert st.shard.local().device == CUDA


@pytest.mark.parametrize("spec", ["identity", "int8", "int8+ef", "int4", "powersgd:rank=2", "sparse", "sparse+ef"])
def test_staged_payloads_stay_on_the_device_until_their_one_copy(spec):
    """Staged (atoll.compression.staging): the mirror is on the parameters' device, the codec's
    arithmetic and error feedback's decode run there, and only payload bytes cross each way (views
    made under FakeTensorMode have no address, so pieces the window cannot place are copied directly
    here; tests/compression/test_staging.py checks the placement byte for byte on the CPU)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_model()
        shard = local_shards(model)[0]  # the first Linear's weight: 96 x 64
        codec = get_codec(spec.removesuffix("+ef"))
        if spec.endswith("+ef"):
            codec = ErrorFeedback(codec, 0.5)
        staging = DeviceStaging(CUDA, enabled=True)
        st = ShardState(shard, Placement("device", CUDA), Leases(), staging)
        st.apply(get_codec("identity").encode(torch.zeros(shard.sizes)), full=True)
        with CrossingCounter() as encoding:
            payload = staging.settle(st.encode(codec))
        assert st._stage.mirror.device == CUDA
        assert encoding.d2h <= 2 * len(payload) and encoding.h2d <= len(payload) + 4096, (encoding.d2h, encoding.h2d)
        payload = real_zeros(codec, shard.sizes) if "sparse" in spec else payload  # (its bytes unwritten: fake)
        with CrossingCounter() as decoding:
            st.apply(payload, full=False)
        assert decoding.h2d <= 2 * len(payload) and decoding.d2h == 0
        assert st.start.device == CUDA


@pytest.mark.parametrize(
    ("where", "overlap", "staged"),
    [
        ("host", 0, False),
        ("host", 2, False),
        ("device", 0, False),
        ("device", 2, False),
        ("host", 0, True),
        ("host", 2, True),
    ],
)
def test_an_island_on_a_fake_gpu_runs_rounds_against_a_real_coordinator(start_server, where, overlap, staged):
    srv = start_server(RunConfig(run_id="t", sync_every=4, codec="int8", error_feedback=True))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_model()
        sync = make_diloco(
            model,
            srv.address,
            run_id="t",
            island_id="gpu",
            outer_state=where,
            overlap_steps=overlap,
            staged_copies=staged,
            retry=RetryPolicy(give_up_seconds=20),
        ).start()
        assert len(sync._outer.stagings) == int(staged)
        try:
            for _ in range(13):
                sync.step(tokens=256, loss=1.0)
            sync.drain()
        finally:
            sync.close()
        assert all(p.device == CUDA for p in model.parameters())
    assert srv.inspect(lambda s: s.round) == 3
    assert [h.tokens for h in sync.history] == [1024, 1024, 1024]


def test_streaming_fragments_on_a_fake_gpu(start_server, tmp_path):
    servers = [
        start_server(
            exact_config(run_id="t", sync_every=4),
            tmp_path / f"f{i}",
            placement=PlacementOptions(shard=(i, 2), partition="layers"),
        )
        for i in range(2)
    ]
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_model()
        sync = make_diloco(
            model,
            ",".join(s.address for s in servers),
            run_id="t",
            island_id="gpu",
            streaming=True,
            overlap_steps=1,
            retry=RetryPolicy(give_up_seconds=20),
        ).start()
        try:
            for _ in range(10):
                sync.step(tokens=8, loss=1.0)
            sync.drain()
        finally:
            sync.close()
    assert [h.shards for h in sync.history] == [(0,), (1,), (0,), (1,), (0,)]  # steps 2, 4, 6, 8, 10
