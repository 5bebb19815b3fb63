"""The downlink built by hand: exact regions, the full θ one entry at a time, kept updates."""

from __future__ import annotations

import math

import numpy as np
import torch

from atoll.compression import codec_of, get_codec
from atoll.coordinator import persistence
from atoll.coordinator.downlink import Downlink, identity_size
from atoll.coordinator.regions import Region


# ---- downlink -----------------------------------------------------------------------------------
def test_downlink_serves_regions_exactly_and_the_full_theta_one_entry_at_a_time(tmp_path):
    theta = {"w": torch.randn(6, 4), "b": torch.randn(5)}
    update = {"w": torch.randn(6, 4)}
    int8 = get_codec("int8")
    down = Downlink(tmp_path, window=2)
    persistence.save_update(tmp_path, 3, {"w": int8.encode(update["w"])}, keep_from=2)
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


def test_updates_are_kept_for_the_window(tmp_path):
    for r in range(1, 6):
        persistence.save_update(tmp_path, r, {"w": bytearray(b"abc" * r)}, keep_from=r - 1)
    kept = [int(p.stem.split("-")[1]) for p in persistence.update_paths(tmp_path)]
    assert kept == [4, 5] and bytes(persistence.load_update(tmp_path, 5)["w"]) == b"abc" * 5
    assert persistence.load_update(tmp_path, 1) is None
    assert math.isclose(len(persistence.load_update(tmp_path, 4)["w"]), 12)
