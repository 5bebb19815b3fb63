"""A round's update streams to the islands while the outer step makes it and its log record is being
written, and their pulls return only once the stream confirms the round saved: the step's and the
save's time overlap the transfer, and an island ends every pull at a θ the coordinator can rebuild."""

from __future__ import annotations

import asyncio
import errno
import threading
import time

import pytest
import torch
from conftest import exact_config

from atoll.coordinator.disk import wal
from atoll.coordinator.run import pulls
from atoll.islands.transport.client import PartialUpdate
from atoll.protos import coordinator_pb2 as pb

SHAPES = {"w": (256, 1024), "b": (5,)}
SAVE_SECONDS = 1.0


@pytest.fixture(params=["bulk", "grpc"])
def transport(request):
    return {"bulk_port": 0 if request.param == "bulk" else None}


def _round_zero(start_server, raw_island, transport, tmp_path):
    srv = start_server(exact_config(run_id="t", sync_every=1, quorum=2), tmp_path / "state", **transport)
    a, b = raw_island(srv.address, "a", SHAPES), raw_island(srv.address, "b", SHAPES)
    a.join()
    b.join()
    a.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    return srv, a, b


def _slow_save(monkeypatch, saves: list, fail: threading.Event | None = None, seconds: float = SAVE_SECONDS):
    """The round's log record takes ``seconds``; ``saves`` gets the time each one ended."""
    real = wal.append

    def append(*args, **kwargs):
        time.sleep(seconds)
        if fail is not None and fail.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        real(*args, **kwargs)
        saves.append(time.monotonic())

    monkeypatch.setattr(wal, "append", append)


def test_the_update_streams_during_the_save_and_is_confirmed_after_it(
    start_server, raw_island, transport, tmp_path, monkeypatch
):
    srv, a, b = _round_zero(start_server, raw_island, transport, tmp_path)
    saves: list[float] = []
    _slow_save(monkeypatch, saves)
    a.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, tokens=1)
    got: list[tuple[float, int]] = []
    done: list[float] = []

    def pull():
        req = pb.PullRequest(run_id="t", island_id="b", have_round=0, wait_seconds=10)
        header, _ = b.client.pull(req, on_entry=lambda h, i, p: got.append((time.monotonic(), len(p))))
        done.append(time.monotonic())
        return header

    puller = threading.Thread(target=lambda: done.append(pull()))
    puller.start()
    time.sleep(0.2)  # b waits in its long-poll
    pushed = time.monotonic()
    b.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, tokens=1)  # the round closes
    puller.join(30)
    assert saves and len(got) == len(SHAPES) and len(done) == 2
    header = done[1]
    assert header.kind == pb.UPDATE_KIND_DELTA and header.round == 1 and header.tentative
    # Every entry was in well before the save ended, the pull returned only after it.
    assert max(t for t, _ in got) < saves[0] - 0.5 * SAVE_SECONDS
    assert done[0] >= saves[0] and done[0] - pushed < SAVE_SECONDS + 2.0
    assert srv.server.state.round == 1
    # A second island asking now gets the published update, not a tentative one.
    header, payloads = a.pull(0)
    assert header.round == 1 and not header.tentative and len(payloads) == len(SHAPES)


def test_a_failed_save_ends_the_stream_unconfirmed_and_later_pulls_wait(
    start_server, raw_island, transport, tmp_path, monkeypatch
):
    srv, a, b = _round_zero(start_server, raw_island, transport, tmp_path)
    fail = threading.Event()
    fail.set()
    _slow_save(monkeypatch, [], fail)
    a.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, tokens=1)
    b.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, tokens=1)  # the round closes, its save fails
    applied = []
    req = pb.PullRequest(run_id="t", island_id="b", have_round=0, wait_seconds=10)
    with pytest.raises(PartialUpdate, match="broke after 2 entries"):
        b.client.pull(req, on_entry=lambda h, i, p: applied.append(i))
    assert applied == [0, 1]  # applied to its θ_start, never installed: the island pulls the full θ next
    assert srv.server.state.round == 0
    header, _ = a.pull(0, wait_seconds=0.5)  # while saving fails, pulls wait as before
    assert header.kind == pb.UPDATE_KIND_NOT_READY and not header.tentative
    fail.clear()
    header, payloads = a.pull(0, wait_seconds=20)
    assert header.kind == pb.UPDATE_KIND_DELTA and header.round == 1 and len(payloads) == len(SHAPES)


def test_a_slow_save_ends_the_stream_unconfirmed_after_the_wait(
    start_server, raw_island, transport, tmp_path, monkeypatch
):
    srv, a, b = _round_zero(start_server, raw_island, transport, tmp_path)
    monkeypatch.setattr(pulls, "DURABLE_WAIT_SECONDS", 0.3)
    _slow_save(monkeypatch, [], seconds=3.0)
    a.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, tokens=1)
    b.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, tokens=1)
    req = pb.PullRequest(run_id="t", island_id="b", have_round=0, wait_seconds=10)
    with pytest.raises(PartialUpdate):
        b.client.pull(req, on_entry=lambda h, i, p: None)
    header, _ = b.pull(-1, wait_seconds=5)  # the island's resync: the full θ, of the round now saved
    assert header.kind == pb.UPDATE_KIND_FULL and header.round == srv.server.state.round


def _slow_outer_step(monkeypatch) -> dict[str, float]:
    """The outer step takes 0.5 s after making each tensor's payload; returns when each was made."""
    from atoll.coordinator.state import model as global_model

    real_step = global_model.outer_step_
    made_at: dict[str, float] = {}

    def slow_step(*args, made=None, **kwargs):
        def made_slowly(name, payload):
            made_at[name] = time.monotonic()  # before it can be sent
            made(name, payload)
            time.sleep(0.5)  # the rest of this tensor's work, and the next tensor's

        return real_step(*args, made=None if made is None else made_slowly, **kwargs)

    monkeypatch.setattr(global_model, "outer_step_", slow_step)
    return made_at


def test_the_update_streams_while_the_outer_step_makes_it(start_server, raw_island, transport, tmp_path, monkeypatch):
    """Each tensor of the update is sent as soon as the outer step has made it: the island has the
    first one while the step still works on the second."""
    made_at = _slow_outer_step(monkeypatch)
    srv, a, b = _round_zero(start_server, raw_island, transport, tmp_path)
    a.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, tokens=1)
    got: dict[int, float] = {}
    data: dict[int, bytes] = {}

    def on_entry(header, i, payload):
        got[i], data[i] = time.monotonic(), bytes(payload)

    req = pb.PullRequest(run_id="t", island_id="b", have_round=0, wait_seconds=10)
    puller = threading.Thread(target=lambda: b.client.pull(req, on_entry=on_entry))
    puller.start()
    time.sleep(0.2)  # b waits in its long-poll
    b.push({k: torch.randn(s) for k, s in SHAPES.items()}, round_=0, tokens=1)  # the round closes
    puller.join(30)
    assert set(made_at) == set(SHAPES) and sorted(got) == [0, 1]
    first, last = min(made_at.values()), max(made_at.values())
    assert got[0] < last - 0.2  # in before the step made the last tensor
    assert got[0] >= first and got[1] >= last
    header, payloads = a.pull(0)  # the published update: the very bytes b was streamed
    assert header.round == 1 and [bytes(p) for _, p in payloads] == [data[0], data[1]]


def test_an_island_whose_tentative_update_breaks_waits_for_the_round_again(start_server, monkeypatch):
    """The round's first save fails while its update streams: the stream ends unconfirmed, the island
    pulls the full θ, which is still θ_0 (the round was not published), and waits on for round 0
    instead of training on from θ_0 with its push's work gone. It ends at θ_1, bit for bit the
    coordinator's, having pushed once."""
    from conftest import inner_step
    from small_island import H, batches, config, island

    real = wal.append
    failed = []

    def append(*args, **kwargs):
        if not failed:
            failed.append(1)
            time.sleep(0.5)  # the update is on its way meanwhile
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
