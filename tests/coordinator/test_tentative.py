"""A round's update streams to the islands while the outer step makes it and its log record is being
written, and their pulls return only once the stream confirms the round saved: the step's and the
save's time overlap the transfer, and an island ends every pull at a θ the coordinator can rebuild."""

from __future__ import annotations

import asyncio
import errno
import threading

import pytest
import torch
from support import exact_config, wait_for

from atoll.coordinator.disk import wal
from atoll.coordinator.options import NetworkOptions
from atoll.coordinator.run import pulls
from atoll.islands._transport.client import PartialUpdate
from atoll.protos import coordinator_pb2 as pb

SHAPES = {"w": (256, 1024), "b": (5,)}


@pytest.fixture(params=["bulk", "grpc"])
def transport(request):
    return {"network": NetworkOptions(bulk_port=0 if request.param == "bulk" else None)}


def _round_zero(start_server, raw_island, transport, tmp_path):
    srv = start_server(exact_config(run_id="t", sync_every=1, quorum=2), tmp_path / "state", **transport)
    a, b = raw_island(srv.address, "a", SHAPES), raw_island(srv.address, "b", SHAPES)
    a.join()
    b.join()
    a.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    return srv, a, b


class HeldSave:
    """The round's log record is written only once the test says so (``release``), and then fails
    while ``fail`` is set; ``started`` is set when a save waits."""

    def __init__(self, monkeypatch, *, released: bool = False) -> None:
        self.started, self.released, self.fail = threading.Event(), threading.Event(), threading.Event()
        if released:
            self.released.set()
        real = wal.append

        def append(*args, **kwargs):
            self.started.set()
            assert self.released.wait(30), "the test never released the save"
            if self.fail.is_set():
                raise OSError(errno.ENOSPC, "No space left on device")
            real(*args, **kwargs)

        monkeypatch.setattr(wal, "append", append)

    def release(self) -> None:
        self.released.set()


def _polling(srv, n: int = 1):
    wait_for(lambda: srv.inspect(lambda s: s.pulls.polling) == n, what=f"{n} pull(s) in their long-poll")


def _rand():
    return {k: torch.randn(s) for k, s in SHAPES.items()}


def test_the_update_streams_during_the_save_and_is_confirmed_after_it(
    start_server, raw_island, transport, tmp_path, monkeypatch
):
    srv, a, b = _round_zero(start_server, raw_island, transport, tmp_path)
    save = HeldSave(monkeypatch)
    a.push(_rand(), round_=0, tokens=1)
    got: list[int] = []
    all_in = threading.Event()
    done: list = []

    def on_entry(header, i, payload):
        got.append(i)
        if len(got) == len(SHAPES):
            all_in.set()

    req = pb.PullRequest(run_id="t", island_id="b", have_round=0, wait_seconds=20)
    puller = threading.Thread(target=lambda: done.append(b.client.pull(req, on_entry=on_entry)[0]))
    puller.start()
    try:
        _polling(srv)  # b waits in its long-poll
        b.push(_rand(), round_=0, tokens=1)  # the round closes
        assert save.started.wait(20)
        assert all_in.wait(20)  # every entry is in while the save is held...
        assert not done and srv.server.state.round == 0  # ...the pull returns only once it is saved
        save.release()
        puller.join(30)
    finally:
        save.release()
        puller.join(30)
    (header,) = done
    assert header.kind == pb.UPDATE_KIND_DELTA and header.round == 1 and header.tentative
    assert sorted(got) == [0, 1] and srv.server.state.round == 1
    # A second island asking now gets the published update, not a tentative one.
    header, payloads = a.pull(0)
    assert header.round == 1 and not header.tentative and len(payloads) == len(SHAPES)


def test_a_failed_save_ends_the_stream_unconfirmed_and_later_pulls_wait(
    start_server, raw_island, transport, tmp_path, monkeypatch
):
    srv, a, b = _round_zero(start_server, raw_island, transport, tmp_path)
    save = HeldSave(monkeypatch)
    save.fail.set()
    a.push(_rand(), round_=0, tokens=1)
    b.push(_rand(), round_=0, tokens=1)  # the round closes; its save waits
    applied = []

    def on_entry(header, i, payload):
        applied.append(i)
        if len(applied) == len(SHAPES):
            save.release()  # the save fails once the whole update is in

    req = pb.PullRequest(run_id="t", island_id="b", have_round=0, wait_seconds=10)
    with pytest.raises(PartialUpdate, match="broke after 2 entries"):
        b.client.pull(req, on_entry=on_entry)
    assert applied == [0, 1]  # applied to its θ_start, never installed: the island pulls the full θ next
    assert srv.server.state.round == 0
    header, _ = a.pull(0, wait_seconds=0.5)  # while saving fails, pulls wait as before
    assert header.kind == pb.UPDATE_KIND_NOT_READY and not header.tentative
    save.fail.clear()
    header, payloads = a.pull(0, wait_seconds=20)
    assert header.kind == pb.UPDATE_KIND_DELTA and header.round == 1 and len(payloads) == len(SHAPES)


def test_a_slow_save_ends_the_stream_unconfirmed_after_the_wait(
    start_server, raw_island, transport, tmp_path, monkeypatch
):
    srv, a, b = _round_zero(start_server, raw_island, transport, tmp_path)
    monkeypatch.setattr(pulls, "DURABLE_WAIT_SECONDS", 0.3)
    save = HeldSave(monkeypatch)
    a.push(_rand(), round_=0, tokens=1)
    b.push(_rand(), round_=0, tokens=1)
    req = pb.PullRequest(run_id="t", island_id="b", have_round=0, wait_seconds=10)
    try:
        with pytest.raises(PartialUpdate):
            b.client.pull(req, on_entry=lambda h, i, p: None)  # the save is held past the stream's wait
        assert srv.server.state.round == 0
    finally:
        save.release()
    wait_for(lambda: srv.server.state.round == 1, what="the round saved")
    header, _ = b.pull(-1, wait_seconds=5)  # the island's resync: the full θ, of the round now saved
    assert header.kind == pb.UPDATE_KIND_FULL and header.round == 1


def _held_outer_step(monkeypatch, first_in: threading.Event) -> list:
    """The outer step, once it has made its first tensor's payload, waits for ``first_in`` before it
    goes on to the next; returns ``[(name, whether first_in came while it waited)]``."""
    from atoll.coordinator.state import model as global_model

    real_step = global_model.outer_step_
    made_in_order: list = []

    def held_step(*args, made=None, **kwargs):
        def made_then_wait(name, payload):
            made(name, payload)
            made_in_order.append((name, first_in.wait(20) if not made_in_order else None))

        return real_step(*args, made=None if made is None else made_then_wait, **kwargs)

    monkeypatch.setattr(global_model, "outer_step_", held_step)
    return made_in_order


def test_the_update_streams_while_the_outer_step_makes_it(start_server, raw_island, transport, tmp_path, monkeypatch):
    """Each tensor of the update is sent as soon as the outer step has made it: the island has the
    first one while the step, held, has not made the second."""
    first_in = threading.Event()
    made = _held_outer_step(monkeypatch, first_in)
    srv, a, b = _round_zero(start_server, raw_island, transport, tmp_path)
    a.push(_rand(), round_=0, tokens=1)
    data: dict[int, bytes] = {}

    def on_entry(header, i, payload):
        data[i] = bytes(payload)
        first_in.set()

    req = pb.PullRequest(run_id="t", island_id="b", have_round=0, wait_seconds=20)
    puller = threading.Thread(target=lambda: b.client.pull(req, on_entry=on_entry))
    puller.start()
    try:
        _polling(srv)  # b waits in its long-poll
        b.push(_rand(), round_=0, tokens=1)  # the round closes
        puller.join(30)
    finally:
        first_in.set()
        puller.join(30)
    assert [came for _, came in made] == [True, None]  # the first was in before the step went on
    assert sorted(n for n, _ in made) == sorted(SHAPES) and sorted(data) == [0, 1]
    header, payloads = a.pull(0)  # the published update: the very bytes b was streamed
    assert header.round == 1 and [bytes(p) for _, p in payloads] == [data[0], data[1]]


def test_an_island_whose_tentative_update_breaks_waits_for_the_round_again(start_server, monkeypatch):
    """The round's first save fails once its update has gone out to the island: the stream ends
    unconfirmed, the island pulls the full θ, which is still θ_0 (the round was not published), and
    waits on for round 0 instead of training on from θ_0 with its push's work gone. It ends at θ_1,
    bit for bit the coordinator's, having pushed once."""
    from support import H, batches, config, inner_step, island

    real = wal.append
    failed = []

    def append(*args, **kwargs):
        if not failed:
            failed.append(1)
            wait_for(lambda: srv.server.counters.bytes_out > 0, what="the update on its way")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(wal, "append", append)
    srv = start_server(config())
    model, opt, sync = island(srv.address)
    sync.start()
    for b in batches(H):
        sync.step(tokens=32, loss=inner_step(model, opt, b))
    theta1 = srv.inspect(lambda st: {k: v.clone() for k, v in st.model.params.items()})
    assert failed and srv.server.state.round == 1 and sync.rounds_pushed == 1
    assert all(torch.equal(v, theta1[k]) for k, v in model.state_dict().items())
    sync.close()


# ---- the stages of a round's update, driven by hand ------------------------------------------------
def test_the_stages_of_a_rounds_update_and_what_its_tentative_streams_are_told():
    """OPEN -> MAKING (its step streams each payload as made) -> SAVING (sealed, first save) ->
    RETRYING (a save failed: streams end unconfirmed, new pulls wait) -> published: the next round is
    OPEN and the streams of this one are confirmed. Driven through the ledger, no sockets."""
    from atoll.coordinator.state.ledger import Confirmation, Ledger, Sealed, Stage

    async def drive() -> None:
        ledger = Ledger(0.0)
        ledger.round = 3
        assert ledger.stage is Stage.OPEN and not ledger.streams(3)
        with ledger.producing_step(3, {"w": 8}, 1.5) as made:
            assert ledger.stage is Stage.MAKING and ledger.streams(3) and not ledger.streams(2)
            made("w", bytearray(8))
        ledger.seal(Sealed(3, {}, {"w": bytearray(8)}, {"round": 3}, frozenset({"a"})))
        assert ledger.stage is Stage.SAVING and ledger.streams(3) and ledger.confirmation(3) is Confirmation.WAIT
        ledger.save_failed()
        assert ledger.stage is Stage.RETRYING and not ledger.streams(3)
        assert ledger.confirmation(3) is Confirmation.BROKEN and ledger.sealed.failures == 1
        ledger.save_failed()
        assert ledger.stage is Stage.RETRYING and ledger.sealed.failures == 2
        ledger.advance(ledger.sealed, 1.0)
        assert (ledger.stage, ledger.round) == (Stage.OPEN, 4) and ledger.confirmation(3) is Confirmation.DURABLE

    asyncio.run(drive())


def test_a_step_that_fails_leaves_its_round_open_and_impossible_events_are_refused():
    from atoll.coordinator.state.ledger import Event, Ledger, Stage, transition

    async def drive() -> None:
        ledger = Ledger(0.0)
        with pytest.raises(RuntimeError), ledger.producing_step(0, {"w": 8}, None):
            raise RuntimeError("the step failed")
        assert ledger.stage is Stage.OPEN and ledger.producing is None

    asyncio.run(drive())
    for stage, event in [(Stage.OPEN, Event.SAVE_FAILED), (Stage.OPEN, Event.PUBLISHED), (Stage.SAVING, Event.STEP)]:
        with pytest.raises(AssertionError, match="cannot happen"):
            transition(stage, event)
