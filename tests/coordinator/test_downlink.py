"""The downlink built by hand: exact regions, the full θ one entry at a time, kept updates."""

from __future__ import annotations

import numpy as np
import torch
from support import exact_config

from atoll.compression import codec_of, get_codec
from atoll.coordinator.disk import wal
from atoll.coordinator.regions import Region
from atoll.coordinator.state.downlink import Downlink, identity_size


# ---- downlink -----------------------------------------------------------------------------------
def test_downlink_serves_regions_exactly_and_the_full_theta_one_entry_at_a_time(tmp_path):
    theta = {"w": torch.randn(6, 4), "b": torch.randn(5)}
    update = {"w": torch.randn(6, 4)}
    int8 = get_codec("int8")
    down = Downlink(tmp_path, window=2)
    log_update(tmp_path, 2, {"w": int8.encode(update["w"])})  # round 2's record: the update to θ_3
    down.restore(3)
    assert down.latest_round == 3 and down.can_catch_up(2, 3) and not down.can_catch_up(0, 3)
    region = Region((2, 0), (3, 4))
    entries = down.delta_entries(3, [("w", None), ("w", region)], {"w": (6, 4)})
    whole = codec_of(entries[0].payload()).decode(entries[0].payload(), (6, 4))
    sliced = get_codec("identity").decode(entries[1].payload(), (3, 4))
    assert entries[1].num_bytes == identity_size((3, 4)) and torch.equal(sliced, whole[2:5])
    full = Downlink.full_entries(theta, [("w", None), ("b", None)])
    assert all(callable(e.data) for e in full)  # nothing encoded until sent
    joined = [b"".join(bytes(p) for p in e.parts()) for e in full]
    assert [len(j) for j in joined] == [e.num_bytes for e in full]
    assert torch.equal(get_codec("identity").decode(joined[1], (5,)), theta["b"])
    body = full[0].parts()[1]  # θ's own memory, not a copy
    assert body.obj is not None and np.shares_memory(np.asarray(body), theta["w"].numpy())


def log_update(state_dir, round_, payloads):
    wal.append(
        state_dir,
        round_,
        payloads,
        {"round": round_},
        {},
        exact_config(run_id="d"),
    )


def test_the_logged_updates_serve_catch_ups_and_are_pruned_to_the_window(tmp_path):
    identity = get_codec("identity")
    updates = [identity.encode(torch.full((3,), float(r))) for r in range(5)]
    for r in range(0, 5):
        log_update(tmp_path, r, {"w": updates[r]})
        wal.prune(tmp_path, snapshot_round=r + 1, keep_from=r - 1)
    assert [r for r, _ in wal.records(tmp_path)] == [3, 4]
    assert bytes(wal.load_update(tmp_path, 5)["w"]) == bytes(updates[4])  # θ_5 = θ_4 + round 4's update
    assert wal.load_update(tmp_path, 2) is None
    assert len(wal.load_update(tmp_path, 4)["w"]) == len(updates[3])


def test_a_logged_update_that_is_not_a_sealed_payload_is_refused_when_read(tmp_path):
    """A record's digest of a payload is CRC-32C's residue (a sealed payload ends in its own crc32c):
    bytes that are not such a payload fail it, like a flipped bit."""
    log_update(tmp_path, 0, {"w": bytearray(b"abc")})
    assert wal.load_update(tmp_path, 1) is None


def test_a_chain_of_sparse_updates_is_taken_until_it_would_outweigh_one_fp32_theta(tmp_path):
    """A sparse update is ~1/110 of θ in fp32 (sparse:density=0.03125 here): an island far behind gets
    the chain of updates while it weighs no more than one θ, and θ itself beyond (the bound holds
    whatever the codec)."""
    specs = {"w": (512, 512), "b": (512,)}
    down, sparse = Downlink(tmp_path, window=1000), get_codec("sparse:density=0.03125")
    regions = [("w", None), ("b", None)]
    per_round = sum(sparse.encoded_size(s) for s in specs.values())
    full = sum(identity_size(s) for s in specs.values())
    most = full // per_round
    assert most > 100  # ~1/110 of an fp32 θ each
    assert down.catch_up_pays(1000 - most, 1000, regions, specs, "sparse:density=0.03125")
    assert not down.catch_up_pays(1000 - most - 1, 1000, regions, specs, "sparse:density=0.03125")
    assert most * per_round <= full < (most + 1) * per_round
