"""Overlapped (one-step-delayed) outer updates and streaming fragments, against a hand-rolled reference.

One in-process coordinator (or one per fragment), one DiLoCo island on a small model trained with
plain SGD on fixed batches, so every inner step is deterministic. The reference replays the same
inner steps and applies the outer step (SGD, momentum 0) on the schedule the feature promises.
"""

from __future__ import annotations

import pytest
import torch
from support import collect_events, coordinator_flags, exact_config, inner_step, island_flags, make_diloco, wait_for

from atoll.coordinator import RunConfig
from atoll.coordinator.options import PlacementOptions
from atoll.islands import CoordinatorRefused, DiLoCo
from atoll.islands._transport.client import RetryPolicy
from atoll.sharding import layer_partition, layout_digest

H = 4
OUTER_LR = 0.7


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=gen), torch.randn(16, 8, generator=gen)) for _ in range(n)]


def config(**kw) -> RunConfig:
    kw = {"codec": "identity", "downlink_codec": "identity", **kw}
    return RunConfig(run_id="t", sync_every=H, outer_lr=OUTER_LR, outer_momentum=0.0, nesterov=False, **kw)


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference(steps: int, *, tau: int, fragment_of=None, num_fragments: int = 1) -> dict[str, torch.Tensor]:
    """θ of the island after ``steps`` inner steps, by the rules alone (no coordinator, no network).

    Fragment f pushes Δ_f = θ_f,start − θ_f after its k-th interval, first ⌈(f+1)H/P⌉ steps then H;
    the global θ_f' = θ_f,start − lr Δ_f arrives τ steps later and the model takes
    θ_f ← θ_f' + (θ_f − θ_f,at_push)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    fragment_of = fragment_of or (lambda name: 0)
    start = params(model)
    since = [0] * num_fragments
    pushed = [0] * num_fragments
    inflight: dict[int, tuple[int, dict, dict]] = {}  # fragment -> (push step, new global, snapshot)
    named = dict(model.named_parameters())
    for t, batch in enumerate(batches(steps), start=1):
        inner_step(model, opt, batch)
        since = [s + 1 for s in since]
        with torch.no_grad():
            for f, (at, new, snap) in list(inflight.items()):
                if t - at >= tau:
                    for n in new:
                        named[n].add_(new[n] - snap[n])
                        start[n] = new[n]
                    del inflight[f]
            for f in range(num_fragments):
                first = -(-(f + 1) * H // num_fragments)
                if f in inflight or since[f] < (first if pushed[f] == 0 else H):
                    continue
                names = [n for n in named if fragment_of(n) == f]
                new = {n: start[n] - OUTER_LR * (start[n] - named[n]) for n in names}
                snap = {n: named[n].clone() for n in names}
                since[f], pushed[f] = 0, pushed[f] + 1
                if tau == 0:
                    for n in names:
                        named[n].copy_(new[n])
                        start[n] = new[n]
                else:
                    inflight[f] = (t, new, snap)
    with torch.no_grad():  # drain: the last exchanges land with no further steps
        for _, new, snap in inflight.values():
            for n in new:
                named[n].add_(new[n] - snap[n])
    return params(model)


def train(address: str, steps: int, **diloco_kw) -> tuple[DiLoCo, dict[str, torch.Tensor]]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = make_diloco(model, address, island_id="solo", run_id="t", **diloco_kw).start()
    try:
        for batch in batches(steps):
            loss = inner_step(model, opt, batch)
            sync.step(tokens=16, loss=loss)
        sync.drain()
    finally:
        sync.close()
    return sync, params(model)


@pytest.mark.parametrize("tau", [0, 1, 3])
def test_overlap_matches_one_step_delayed_reference(start_server, tau):
    srv = start_server(config())
    steps = 5 * H + 2  # ends mid-round: the partial round stays local
    sync, got = train(srv.address, steps, overlap_steps=tau)
    want = reference(steps, tau=tau)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=2e-6)
    assert srv.inspect(lambda s: s.round) == 5
    assert [h.round for h in sync.history] == [0, 1, 2, 3, 4]
    assert all(h.inner_steps == H for h in sync.history)


def test_overlap_off_is_plain_diloco_exactly(start_server, tmp_path):
    """overlap_steps=0 (the default) and an explicit 0 give bitwise the same θ as each other and as
    the blocking reference; and overlapping changes the result (the test can fail)."""
    a = start_server(config(), tmp_path / "a")
    b = start_server(config(), tmp_path / "b")
    c = start_server(config(), tmp_path / "c")
    _, default = train(a.address, 3 * H)
    _, explicit = train(b.address, 3 * H, overlap_steps=0)
    _, overlapped = train(c.address, 3 * H, overlap_steps=2)
    for name in default:
        assert torch.equal(default[name], explicit[name])
    assert any(not torch.allclose(default[n], overlapped[n], atol=1e-4) for n in default)


def test_overlap_keeps_training_while_the_exchange_is_out(start_server, raw_island):
    """With overlap the island's inner steps run while its round is still open on the coordinator
    (a second island has not pushed yet); the update lands when that island pushes."""
    srv = start_server(exact_config(run_id="t", sync_every=H, quorum=2, round_deadline_seconds=600))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = make_diloco(model, srv.address, island_id="solo", run_id="t", overlap_steps=3).start()
    try:
        other = raw_island(srv.address, "other", {n: tuple(p.shape) for n, p in model.named_parameters()})
        other.join()
        for batch in batches(H + 2):  # pushes after step H, then 2 more steps with the round still open
            assert sync.step(tokens=16, loss=inner_step(model, opt, batch)) is None
        assert sync.rounds_pushed == 1 and sync.round == 0
        wait_for(  # the push is in flight meanwhile
            lambda: srv.inspect(lambda s: sorted(s.accumulator.committed)) == ["solo"], timeout=30, what="the push"
        )
        assert srv.inspect(lambda s: s.round) == 0
        other.push({n: torch.zeros_like(p) for n, p in model.named_parameters()}, round_=0, tokens=16)
        (stats,) = sync.drain()
        assert (stats.round, sync.round, srv.inspect(lambda s: s.round)) == (0, 1, 1)
    finally:
        sync.close()


def test_overlap_must_be_below_h(start_server):
    srv = start_server(config())
    model = make_model()
    sync = make_diloco(model, srv.address, run_id="t", overlap_steps=H)
    with pytest.raises(ValueError, match="overlap_steps"):
        sync.start()
    sync.close()
    with pytest.raises(ValueError, match="overlap_steps"):
        make_diloco(model, srv.address, overlap_steps=-1)
    with pytest.raises(ValueError, match="time budget"):
        make_diloco(model, srv.address, streaming=True, sync_every_seconds=1.0)


def fragment_servers(start_server, tmp_path, n: int):
    return [
        start_server(config(), tmp_path / f"f{i}", placement=PlacementOptions(shard=(i, n), partition="layers"))
        for i in range(n)
    ]


def test_layer_partition_is_contiguous_and_balanced():
    tensors = [(n, p.numel()) for n, p in make_model().named_parameters()]
    assert layer_partition(tensors, 2) == {"0.weight": 0, "0.bias": 0, "1.weight": 1, "1.bias": 1}
    sizes = [10, 10, 10, 10, 10, 10, 10, 10]
    part = layer_partition([(f"t{i}", s) for i, s in enumerate(sizes)], 4)
    assert list(part.values()) == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="no tensors"):
        layer_partition([("a", 1), ("b", 1)], 3)


@pytest.mark.parametrize("tau", [0, 1])
def test_streaming_fragments_sync_staggered(start_server, tmp_path, tau):
    servers = fragment_servers(start_server, tmp_path, 2)
    steps = 3 * H
    sync, got = train(",".join(s.address for s in servers), steps, streaming=True, overlap_steps=tau)
    part = layer_partition([(n, p.numel()) for n, p in make_model().named_parameters()], 2)
    want = reference(steps, tau=tau, fragment_of=part.__getitem__, num_fragments=2)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=2e-6)
    # Fragment 0 syncs after steps 2, 6, 10 and fragment 1 after 4, 8, 12: one fragment per sync.
    assert [h.shards for h in sync.history] == [(0,), (1,), (0,), (1,), (0,), (1,)]
    assert [h.inner_steps for h in sync.history] == [2, 4, 4, 4, 4, 4]
    assert [s.inspect(lambda st: st.round) for s in servers] == [3, 3]
    owned = [s.inspect(lambda st: sorted(st.model.params)) for s in servers]
    assert owned == [["0.bias", "0.weight"], ["1.bias", "1.weight"]]
    # Each sync moves one fragment's bytes (half the model here) plus headers, never the whole model.
    numel = {n: p.numel() for n, p in make_model().named_parameters()}
    for h in sync.history:
        frag = sum(k for n, k in numel.items() if part[n] == h.shards[0])
        assert frag == sum(numel.values()) // 2
        assert 4 * frag < h.bytes_sent < 4 * frag + 400
        assert 4 * frag < h.bytes_received < 4 * frag + 400


def test_fragments_refuse_a_mismatched_island(start_server, tmp_path):
    servers = fragment_servers(start_server, tmp_path, 2)
    address = ",".join(s.address for s in servers)
    model = make_model()

    def refused(m, match, **kw):
        sync = make_diloco(m, address, run_id="t", retry=RetryPolicy(give_up_seconds=5), **kw)
        try:
            with pytest.raises(CoordinatorRefused, match=match):
                sync.start()
        finally:
            sync.close()

    refused(model, "partitions tensors by 'hash'", island_id="h")
    train(address, H, streaming=True)  # the first island fixes the layout
    other = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8, bias=False))
    layout = [(n, tuple(p.shape)) for n, p in other.named_parameters()]
    assert layout_digest(layout) != layout_digest([(n, tuple(p.shape)) for n, p in model.named_parameters()])
    refused(other, "model layout", island_id="o", streaming=True)


def test_streaming_overlapped_islands_end_to_end(group, tmp_path):
    """Two island processes, a 2-fragment coordinator process (``--fragments 2``), overlap 10:
    each fragment completes its rounds, both islands hold the same global θ after every fragment
    sync, and the loss falls."""
    coord, address = group.start_coordinator(
        tmp_path / "state", [*coordinator_flags(sync_every=30, quorum=2), "--fragments", "2"]
    )
    assert address.count(",") == 1
    islands = [
        group.start(
            f"i{k}",
            island_flags(
                address, f"i{k}", rounds=3, extra=["--streaming", "--overlap-steps", "10", "--no-eval-every-round"]
            ),
        )
        for k in range(2)
    ]
    events = collect_events(islands, until=lambda evs: sum(e["event"] == "done" for e in evs) == 2, timeout=300)
    assert [p.wait(30) for p in islands] == [0, 0]
    rounds = [e for e in events if e["event"] == "round"]
    for k in ("i0", "i1"):
        mine = [(e["shards"], e["round"]) for e in rounds if e["island"] == k]
        assert mine == [([0], 0), ([1], 0), ([0], 1), ([1], 1), ([0], 2), ([1], 2)]
    by_sync = {}
    for e in rounds:
        by_sync.setdefault((tuple(e["shards"]), e["round"]), set()).add(e["digest"])
    assert all(len(d) == 1 for d in by_sync.values()), by_sync
    joined = [e["eval_loss"] for e in events if e["event"] == "joined"]
    losses = [e["global_loss"] for e in rounds if e["island"] == "i0"]
    assert losses[-1] < losses[0] < joined[0]
    # Each round reports its inner steps' mean time, apart for those taken while an exchange was in
    # flight (10 of each fragment's 15 steps here) and the others.
    timed = [(e["step_seconds"], e["step_seconds_in_flight"]) for e in rounds]
    assert sum(idle is not None and 0 < idle < 5 and 0 < busy < 5 for idle, busy in timed if busy) >= 6, timed
    coord.stop()
    for i in range(2):
        assert (tmp_path / "state" / f"fragment-{i}").is_dir()
