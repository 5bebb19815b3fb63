"""The island's parts, each on its own: the route table (pure), the outer state's one checked path for
updates, and the run's terms settled from the Join answers."""

from __future__ import annotations

import pytest
import torch

from atoll.compression import WireFormatError, get_codec
from atoll.islands._messages import Entry, Update
from atoll.islands._options import DiLoCoOptions
from atoll.islands._outer_state import OuterState
from atoll.islands._route_table import RouteTable
from atoll.islands._shards import local_shards
from atoll.protos.vocabulary import UpdateKind
from atoll.sharding import shard_of


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def test_the_route_table_routes_each_tensor_where_the_coordinator_looks_for_it():
    shards = local_shards(model())
    table = RouteTable.of(shards, 2, streaming=False)
    assert len(table) == 2 and table.digest == ""
    for i in range(2):
        assert all(shard_of(s.name, 2) == i for s in table.shards(i))
        assert [r.name for r in table.regions(i)] == [s.name for s in table.shards(i)]
    assert sorted(s.name for s in table.all_shards()) == sorted(s.name for s in shards)
    request = table.join_request(1, codec="int8", num_ranks=1, aliases={}, card="{}")()
    assert request.codecs == ("int8",) and request.shard_index == 1 and request.num_shards == 2
    assert [t.name for t in request.tensors] == [s.name for s in table.shards(1)] and request.partition == "hash"
    streaming = RouteTable.of(shards, 2, streaming=True)
    assert (
        streaming.digest
        and streaming.join_request(0, codec=None, num_ranks=1, aliases={}, card="")().partition == "layers"
    )
    assert [s.name for r in streaming.routes for s in r] == [s.name for s in shards]  # contiguous, in order
    with pytest.raises(ValueError, match=r"coordinator shards \[\d+(, \d+)*\] of 9 own none of the model's tensors"):
        RouteTable.of(shards, 9, streaming=False)


def test_an_update_reaches_the_outer_state_by_one_checked_path_and_a_corrupt_one_changes_nothing():
    m = model()
    shards = local_shards(m)
    outer = OuterState(shards, DiLoCoOptions())
    ident = get_codec("identity")
    theta = {s.name: torch.randn(s.sizes) for s in shards}
    full = Update(UpdateKind.FULL, 0, entries=tuple(Entry(s.name, (), (), 0) for s in shards))
    outer.apply_all(shards, [(full, [(s.name, ident.encode(theta[s.name])) for s in shards])])
    for s in shards:
        assert torch.equal(outer.of(s).start.cpu(), theta[s.name])
    step = {s.name: torch.full(s.sizes, 0.5) for s in shards}
    delta = Update(UpdateKind.DELTA, 1, entries=full.entries)
    payloads = [(s.name, ident.encode(step[s.name])) for s in shards]
    bad = list(payloads)
    bad[-1] = (bad[-1][0], bytearray(bad[-1][1])[:-3])  # the last entry cut short
    with pytest.raises(WireFormatError):
        outer.apply_all(shards, [(delta, bad)])
    for s in shards:  # checked whole before any was applied
        assert torch.equal(outer.of(s).start.cpu(), theta[s.name])
    apply = outer.applier(shards)  # entry by entry, as a pull streams them: the same check, then apply
    for i, (_, payload) in enumerate(payloads):
        apply(delta, i, payload)
    for s in shards:
        assert torch.equal(outer.of(s).start.cpu(), theta[s.name] + 0.5)
    with pytest.raises(RuntimeError, match="is no region of this rank"):
        apply(Update(UpdateKind.DELTA, 2, entries=(Entry("nope", (), (), 0),)), 0, payloads[0][1])


def test_the_transport_seam_speaks_atolls_messages_and_a_bare_client_still_plugs_in(start_server):
    """What wraps the seam (``CoordinatorLink(connect=...)``: the harness's faults, a user's tracing) sees
    the island's own messages, never protobuf; a bare protobuf client (the seam's form before this
    release) is put behind the real transport."""
    from support import exact_config, inner_step

    from atoll.islands import CoordinatorClient, CoordinatorLink, DiLoCo, RetryPolicy, WireTransport
    from atoll.islands._messages import Identity, JoinAnswer, PushHeader
    from atoll.protos.vocabulary import PushOutcome

    srv = start_server(exact_config(run_id="t", sync_every=2))
    seen = []

    class Recording:
        def __init__(self, inner) -> None:
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def join(self, me, req, **kw):
            answer = self.inner.join(me, req, **kw)
            seen.append(("join", type(me), type(answer)))
            return answer

        def push(self, me, header, payloads):
            outcome = self.inner.push(me, header, payloads)
            seen.append(("push", type(header), outcome))
            return outcome

    retry = RetryPolicy(give_up_seconds=20)
    for connect in (
        lambda a: Recording(WireTransport(CoordinatorClient(a, retry=retry))),
        lambda a: CoordinatorClient(a, retry=retry),  # a bare client: wrapped by the link
    ):
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sync = DiLoCo(m, CoordinatorLink(srv.address, run_id="t", connect=connect)).start()
        try:
            gen = torch.Generator().manual_seed(0)
            for _ in range(2):
                batch = (torch.randn(8, 4, generator=gen), torch.randn(8, 3, generator=gen))
                sync.step(tokens=8, loss=inner_step(m, opt, batch))
            assert sync.round >= 1
        finally:
            sync.close()
    assert ("join", Identity, JoinAnswer) in seen
    assert any(kind == "push" and t is PushHeader and out is PushOutcome.COMMITTED for kind, t, out in seen)


def test_an_overlapped_merge_made_ready_off_the_training_thread_is_the_plain_merge_bit_for_bit():
    """Overlapping, the exchange's thread encodes θ as pushed (the snapshot), and once the update is in
    checks it, applies it to θ_start and makes θ_start − snapshot in the snapshot's storage; the merge
    then adds that. θ_start, the payload and the model's θ are bitwise what the training thread's own
    encode, apply and merge θ ← θ_start + (θ − snapshot) give; a corrupt update changes nothing; and
    the next snapshot is written into the same storage (no fresh |θ| a round)."""
    ident, int8 = get_codec("identity"), get_codec("int8")
    runs = []
    for ready in (False, True):
        m = model()
        shards = local_shards(m)
        outer = OuterState(shards, DiLoCoOptions())
        theta = {s.name: torch.randn(s.sizes, generator=torch.Generator().manual_seed(1)) for s in shards}
        full = Update(UpdateKind.FULL, 0, entries=tuple(Entry(s.name, (), (), 0) for s in shards))
        outer.apply_all(shards, [(full, [(s.name, ident.encode(theta[s.name])) for s in shards])])
        outer.load_params(shards, merge=False)
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(1.01)  # the round's progress
        outer.take_snapshots(shards)
        pushed = outer.encode(shards, int8, pushed=True) if ready else outer.encode(shards, int8)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.003)  # progress made while the exchange is out
        delta = Update(UpdateKind.DELTA, 1, entries=full.entries)
        update = [(delta, [(s.name, int8.encode(torch.full(s.sizes, 0.25))) for s in shards])]
        if ready:
            storage = {s.name: outer.of(s).snapshot for s in shards}
            bad = [(delta, [*update[0][1][:-1], (shards[-1].name, bytearray(update[0][1][-1][1])[:-3])])]
            with pytest.raises(WireFormatError):
                outer.prepare_merge(shards, bad)
            assert all(outer.of(s).snapshot is not None and outer.of(s).merge_delta is None for s in shards)
            outer.prepare_merge(shards, update)
        else:
            outer.apply_all(shards, update)
        outer.load_params(shards, merge=True)
        starts = {s.name: outer.of(s).start.clone() for s in shards}
        runs.append((pushed, starts, [p.detach().clone() for p in m.parameters()]))
        if ready:
            outer.take_snapshots(shards)
            assert all(outer.of(s).snapshot is storage[s.name] for s in shards)  # the same tensors
    (plain_pushed, plain_start, plain_theta), (pushed, start, theta_) = runs
    assert [bytes(p) for p in pushed] == [bytes(p) for p in plain_pushed]
    assert all(torch.equal(start[k], plain_start[k]) for k in start)
    assert all(torch.equal(a, b) for a, b in zip(theta_, plain_theta, strict=True))
