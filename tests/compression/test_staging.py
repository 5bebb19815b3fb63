"""Payloads staged through a device mirror (atoll.compression.staging), checked on the CPU: with the
mirror in host memory every copy is synchronous, so the bookkeeping (where each piece lands, when a
payload is sealed, which buffer is reused) is exercised exactly and compared byte for byte with the
direct path. The device side (one copy each way, on no other stream) is in tests/islands/test_device.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import make_diloco

from atoll.compression import ErrorFeedback, get_codec
from atoll.compression.staging import DeviceStaging
from atoll.compression.wire import WireFormatError, unpack
from atoll.coordinator import RunConfig
from atoll.islands._transport.client import RetryPolicy
from atoll.memory import Leases

CPU = torch.device("cpu")
SPECS = [
    "identity",
    "fp16",
    "bf16",
    "int8",
    "int4",
    "int8:block=64,scale=fp16",
    "int2",
    "topk:fraction=0.05",
    "dcttopk",
    "powersgd:rank=2",
]


def tensors():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(300, 70, generator=gen)
    return a, a - 0.01 * torch.randn(300, 70, generator=gen)


def staged_encode(stage, codec, a, b, state=None):
    room = stage.payload_buffer(codec.encoded_size(tuple(a.shape)))
    np.frombuffer(room, np.uint8)[:] = 0xAB  # (what the last payload left: every byte must be written)
    with stage.encoding():
        return codec.encode_difference(a, b, {} if state is None else state, out=room)


@pytest.mark.parametrize("spec", SPECS)
def test_a_staged_payload_is_the_direct_one_once_settled_and_decodes_the_same(spec):
    codec = get_codec(spec)
    a, b = tensors()
    direct = bytes(codec.encode_difference(a, b, {}))
    staging = DeviceStaging(CPU, enabled=True)
    stage = staging.buffers()
    payload = staged_encode(stage, codec, a, b)
    assert stage._written is not None and stage._written.used > 0  # the codec wrote the mirror, not the host
    assert staging.pending() == 1
    with pytest.raises(WireFormatError, match="checksum|crc|CRC"):
        unpack(payload)  # not sealed yet: nobody may read it before settle()
    assert bytes(staging.settle(payload)) == direct
    assert staging.pending() == 0
    staging.settle(payload)  # settled already: nothing happens
    assert bytes(payload) == direct

    # Decoding from the mirror: the same bits as from the host, pieces read there.
    want = torch.ones(a.shape)
    codec.decode_add_(direct, want, alpha=0.5)
    got = torch.ones(a.shape)
    with stage.reading(payload) as window:
        codec.decode_add_(payload, got, alpha=0.5)
    assert window.used > 0
    assert torch.equal(got, want)


def test_error_feedback_reads_what_it_sent_from_the_mirror():
    codec = ErrorFeedback(get_codec("int8"), 0.9)
    a, b = tensors()
    direct_state, staged_state = {}, {}
    staging = DeviceStaging(CPU, enabled=True)
    stage = staging.buffers()
    for _ in range(3):  # the residual carries over: both paths keep the same one, round after round
        direct = bytes(codec.encode_difference(a, b, direct_state))
        payload = staging.settle(staged_encode(stage, codec, a, b, staged_state))
        assert bytes(payload) == direct
        assert torch.equal(staged_state["residual"], direct_state["residual"])
        b = b - 0.001


def test_the_pinned_buffer_is_reused_unless_a_push_still_reads_it():
    codec = get_codec("int8")
    a, b = tensors()
    staging = DeviceStaging(CPU, enabled=True)
    stage, leases = staging.buffers(), Leases()
    size = codec.encoded_size(tuple(a.shape))
    first = staging.settle(staged_encode(stage, codec, a, b))
    kept = bytes(first)
    room = stage.payload_buffer(size, busy=leases.held)
    assert np.frombuffer(room, np.uint8).ctypes.data == np.frombuffer(first, np.uint8).ctypes.data  # reused
    lease = leases.take(first, "a push")
    room = stage.payload_buffer(size, busy=leases.held)
    assert np.frombuffer(room, np.uint8).ctypes.data != np.frombuffer(first, np.uint8).ctypes.data
    with stage.encoding():
        second = codec.encode_difference(a, b + 1, {}, out=room)
    staging.settle(second)
    assert bytes(first) == kept  # never written over while leased
    assert bytes(second) != kept
    lease.release()


@pytest.mark.parametrize("overlap", [0, 2])
@pytest.mark.parametrize("spec", ["int8", "int8+ef", "identity"])
def test_a_staged_island_ends_on_the_same_theta_as_a_direct_one(start_server, tmp_path, spec, overlap):
    """Two runs, one island each, the same steps: staged copies change no bit of θ (streamed pushes,
    pushes kept for the flight, error feedback, overlap's merge)."""
    finals = []
    for staged in (False, True):
        cfg = RunConfig(
            run_id="t", sync_every=3, codec=spec.removesuffix("+ef"), error_feedback=spec.endswith("+ef"), quorum=1
        )
        srv = start_server(cfg, tmp_path / f"staged-{staged}")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sync = make_diloco(
            model,
            srv.address,
            island_id="a",
            overlap_steps=overlap,
            staged_copies=staged,
            retry=RetryPolicy(give_up_seconds=20),
        ).start()
        stagings = sync._outer.stagings
        assert len(stagings) == (1 if staged else 0)
        try:
            gen = torch.Generator().manual_seed(1)
            for _ in range(10):
                x = torch.randn(8, 16, generator=gen)
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                sync.step(tokens=8, loss=loss.item())
            sync.drain()
        finally:
            sync.close()
        assert all(st.pending() == 0 for st in stagings)  # every payload staged was sealed and sent
        finals.append(([p.detach().clone() for p in model.parameters()], srv.inspect(lambda s: s.round)))
    (direct, rounds_direct), (staged, rounds_staged) = finals
    assert rounds_direct == rounds_staged == 3
    assert all(torch.equal(x, y) for x, y in zip(direct, staged, strict=True))
