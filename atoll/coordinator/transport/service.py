"""The gRPC layer: the only place that knows protobuf and status codes, and the owner of the counters.

Wire messages become :mod:`messages`, answers become wire messages, a refusal becomes a status
whose details carry the reason (``atoll.v1.Reason`` in a google.rpc.ErrorInfo). Unparseable
request bytes answer INVALID_ARGUMENT (they never reach the core).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from google.protobuf.message import DecodeError

from atoll.coordinator.errors import Reason, RequestError, invalid, refuse
from atoll.coordinator.messages import IslandCall, PushResult
from atoll.coordinator.run.run_state import RunState
from atoll.coordinator.state.plans import Received
from atoll.coordinator.transport.convert import (
    UPDATE_KINDS,
    config_proto,
    join_request,
    pull_request,
    push_header,
    push_response,
)
from atoll.coordinator.transport.counters import Counters, Resent
from atoll.coordinator.transport.parked import InboundPush, ParkedPushes
from atoll.coordinator.transport.security import IslandTokens
from atoll.protos import coordinator_pb2 as pb
from atoll.protos import coordinator_pb2_grpc as pb_grpc
from atoll.protos.bulk import MAX_STREAMS
from atoll.protos.raw import RawData
from atoll.protos.rpc import SERVICE_NAME, ChunkPacker, EntryAssembler, StreamOverrun, server_handlers
from atoll.protos.status import error_status
from atoll.protos.vocabulary import PushKind, PushOutcome

log = logging.getLogger("atoll.coordinator")

STREAM_IDLE_SECONDS = 120.0
"""A push stream that sends nothing for this long, or a pull stream whose peer takes nothing for this
long, is aborted (its memory released)."""
INLINE_CHECK_BYTES = 256 << 10
"""Entries a chunk completes are checked on the event loop below this many bytes, in a worker thread above."""


class StreamBroken(ConnectionError):
    """A resumable push's stream ended before its declared bytes (it is parked for its retry)."""


BROKEN = (OSError, EOFError, asyncio.CancelledError)
"""What ends a push's stream without a refusal: the peer went, the connection broke, it stalled."""


class Malformed:
    """What a request deserializes to when its bytes do not parse (answered INVALID_ARGUMENT)."""

    def __init__(self, error: str) -> None:
        self.error = error


def tolerant(parse):
    def deserialize(data: bytes):
        try:
            return parse(data)
        except DecodeError as err:
            return Malformed(str(err) or "unparseable message")

    return deserialize


def _parsed(request):
    if isinstance(request, Malformed):
        raise invalid(f"request does not parse: {request.error}")
    return request


async def _abort(context: grpc.aio.ServicerContext, err: RequestError):
    busy = (Reason.NOT_JOINED, Reason.INFLIGHT_BUDGET, Reason.PULL_BUDGET, Reason.STREAM_IDLE)
    level = logging.INFO if err.reason in busy else logging.WARNING
    log.log(level, "refused (%s): %s", err.reason.name, err.message)
    await context.abort_with_status(error_status(grpc.StatusCode[err.code], err.reason, err.message, err.chain))


async def next_chunk(it, timeout: float):
    """The next message of a request stream, or STREAM_IDLE after ``timeout`` seconds of silence.

    Not ``asyncio.wait_for`` (see :func:`atoll.coordinator.run.pulls.wait_event`)."""
    task = asyncio.ensure_future(it.__anext__())
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    finally:
        if not task.done():
            task.cancel()
    if not done:
        raise refuse(Reason.STREAM_IDLE, f"the push stream sent nothing for {timeout:g}s")
    err = task.exception()
    if err is None:
        return task.result()
    # The end of the stream (StopAsyncIteration) or its failure. Raised with no reference from this
    # frame to the task, which holds the exception, whose traceback holds the caller's frame and
    # with it every payload the push received: that cycle kept two pushes' bytes per round alive
    # until the cyclic collector happened to run (measured: +2x |θ| per round, 17x in all).
    del task, done
    try:
        raise err
    finally:
        del err


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(
        self,
        state: RunState,
        tokens: IslandTokens | None = None,
        counters: Counters | None = None,
        stream_idle_seconds: float = STREAM_IDLE_SECONDS,
    ) -> None:
        self.state = state
        self.tokens = tokens
        self.counters = counters or Counters()
        self.stream_idle_seconds = stream_idle_seconds
        self.parked = ParkedPushes(stream_idle_seconds, self._unpark)
        """Pushes cut part way on the bulk port, kept for their retry (as long as a stream may be idle)."""
        self.bulk_port = 0
        """The bulk port Join advertises (0: none; set by the server once it listens)."""
        self.bulk_keep_seconds = 0
        """How long the bulk port keeps a connection between calls (Join advertises it)."""
        self._unchecked: set[str] = set()
        """Islands that sent a token this coordinator does not check (each warned about once)."""
        self._answered: dict[tuple, tuple] = {}
        """(island, rank, its regions) -> (kind, have_round, round) of the last answer with data sent to them:
        one sent again is counted (:attr:`Resent.PULL_AGAIN`)."""

    def _check_identity(self, context, island_id: str) -> None:
        """With island tokens configured, an island may only act for itself."""
        if self.tokens is None:
            if island_id not in self._unchecked and dict(context.invocation_metadata() or ()).get("authorization"):
                self._unchecked.add(island_id)
                log.warning(
                    "island %s sends a bearer token, but this coordinator checks none (no --island-tokens): "
                    "anyone may act as any island",
                    island_id,
                )
            return
        holder = self.tokens.island_for(context.invocation_metadata())
        if holder is None:
            raise refuse(Reason.UNAUTHENTICATED, "missing or unknown island token")
        if holder != island_id:
            raise refuse(Reason.PERMISSION_DENIED, f"token of island {holder!r} cannot act for island {island_id!r}")

    async def _unary(self, handler, request, context, refused: str | None = None):
        """``refused``: the counter a refusal adds to."""
        try:
            request = _parsed(request)
            self._check_identity(context, request.island_id)
            return handler(request)
        except RequestError as err:
            if refused is not None:
                setattr(self.counters, refused, getattr(self.counters, refused) + 1)
            await _abort(context, err)

    async def Join(self, request, context):
        try:  # a relay first joins its own upstream (a coroutine: the join below is not one)
            parsed = _parsed(request)
            self._check_identity(context, parsed.island_id)
            await self.state.before_join(join_request(parsed))
        except RequestError as err:
            self.counters.joins_refused += 1
            await _abort(context, err)

        def join(m):
            a = self.state.join(join_request(m))
            return pb.JoinResponse(
                relay_chain=list(a.relay_chain),
                config=config_proto(a.config),
                round=a.round,
                bootstrap=a.bootstrap,
                codec=a.codec,
                run_complete=a.run_complete,
                bulk_port=self.bulk_port,
                bulk_streams=MAX_STREAMS if self.bulk_port else 0,
                bulk_keep_seconds=self.bulk_keep_seconds if self.bulk_port else 0,
                checks_tokens=self.tokens is not None,
            )

        return await self._unary(join, request, context, refused="joins_refused")

    async def Heartbeat(self, request, context):
        def heartbeat(m):
            round_, lease, complete = self.state.heartbeat(
                IslandCall(run_id=m.run_id, island_id=m.island_id, session_id=m.session_id)
            )
            return pb.HeartbeatResponse(round=round_, lease_seconds=lease, run_complete=complete)

        return await self._unary(heartbeat, request, context)

    async def Leave(self, request, context):
        def leave(m):
            self.state.leave(IslandCall(run_id=m.run_id, island_id=m.island_id, session_id=m.session_id))
            return pb.LeaveResponse()

        return await self._unary(leave, request, context)

    # ---- pushes ----------------------------------------------------------------------------
    async def PushDelta(self, request_iterator, context):
        try:
            result, init = await self._push(request_iterator, context)
        except RequestError as err:
            if err.code == "INVALID_ARGUMENT":
                self.counters.pushes_refused += 1
            elif err.reason in (Reason.INFLIGHT_BUDGET, Reason.PUSH_IN_PROGRESS):
                self.counters.pushes_busy += 1
            # The traceback holds the refused stream's frames, and they its received bytes: drop it now
            # rather than when the cyclic collector gets to it (gc.freeze makes that late).
            await _abort(context, err.with_traceback(None))
            return None
        c = self.counters
        if init:  # θ_0: not a pseudo-gradient, not counted
            pass
        elif result.outcome in (PushOutcome.STAGED, PushOutcome.COMMITTED, PushOutcome.FOLDED):
            c.bytes_in += result.bytes_received
            c.pushes_committed += result.outcome is PushOutcome.COMMITTED
            c.pushes_late_folded += result.outcome is PushOutcome.FOLDED
        elif result.outcome is PushOutcome.ROUND_CLOSED and result.carried:
            c.pushes_carried += 1
        elif result.outcome is PushOutcome.ROUND_CLOSED:
            c.pushes_late_dropped += 1
        return push_response(result)

    async def _push(self, request_iterator, context) -> tuple[PushResult, bool]:
        """The push's result, and whether it was an INIT (θ_0) push."""
        it = request_iterator.__aiter__()
        try:
            first = await next_chunk(it, self.stream_idle_seconds)
        except StopAsyncIteration:
            raise invalid("empty push stream") from None
        first = _parsed(first)
        if isinstance(first, RawData) or first.WhichOneof("kind") != "header":
            raise invalid("a push stream must start with a header")
        self._check_identity(context, first.header.island_id)
        header = push_header(first.header)
        key, header_bytes = (header.island_id, header.rank), first.header.SerializeToString()
        resumable = getattr(it, "resumable", False)  # the bulk port: a cut push resumes
        push = None
        if resumable and not getattr(it, "eager", False):
            push = self.parked.take(key, header_bytes)
        else:  # a push over gRPC, or an eager one (its data starts at its first byte), takes the place
            self.parked.drop(key)  # of one cut on the bulk port
        if push is not None:
            self.counters.bulk_resumes += 1
            self.counters.bulk_resumed_bytes += push.assembler.received
        else:
            plan = await self.state.plan_push(header)
            if isinstance(plan, PushResult):
                return plan, header.kind is PushKind.INIT  # nothing to read
            push = InboundPush.admitted(self.state, header_bytes, plan)
        kept = False
        try:
            push.received = await self._receive(push.plan, it, push.assembler, push.received)
            result = await self.state.commit_push(push.plan, push.received, push.reservation)
            if result.outcome is PushOutcome.DUPLICATE:  # read whole, for nothing
                self.counters.resent(Resent.PUSH_DUPLICATE, push.plan.num_bytes)
            return result, push.plan.init
        except BaseException as err:
            if resumable and push.consistent and push.assembler.received > 0 and isinstance(err, BROKEN):
                kept = True  # its retry takes it from here
                self.parked.park(key, push)
                raise
            if isinstance(err, BROKEN):  # its retry sends again what came
                self.counters.resent(Resent.PUSH_CUT, push.assembler.received)
            push.drop_data()  # a refused stream: now, not with its traceback
            if isinstance(err, StreamOverrun):  # more bytes than declared, on either transport
                raise invalid(str(err)) from None
            raise
        finally:
            if not kept:
                push.end(self.state)

    def _unpark(self, push: InboundPush) -> None:
        """A parked push let go (its retry did not come in time, or came in another form): what came of it
        comes again."""
        self.counters.resent(Resent.PUSH_CUT, push.assembler.received)
        push.drop_data()
        push.end(self.state)

    async def _receive(self, plan, it, assembler: EntryAssembler, received: Received) -> Received:
        """Read a push's data (its declared bytes are already held against the in-flight budget; a
        resumed push's assembler holds what came before) and validate each entry as soon as it is
        complete; more bytes than declared are refused."""
        fill = getattr(it, "fill", None)  # the bulk port's stream writes straight into the entries
        if fill is None:
            return await self._read(plan, it, assembler, received)
        await fill(assembler, lambda complete: self._take(plan, complete, received))
        if not assembler.done and getattr(it, "cut", False):
            raise StreamBroken(f"the push stream was cut after {assembler.received} bytes")
        return self._finish(plan, assembler, received)

    async def _check(self, plan, complete: list) -> list[float]:
        """Validate the entries a chunk completed (their norm bounds): small ones here (a thread hop
        costs more than their checksum), larger ones together in one worker thread."""
        if sum(memoryview(p).nbytes for _, p in complete) < INLINE_CHECK_BYTES:
            return [self.state.check_entry(plan, i, p) for i, p in complete]
        return await asyncio.to_thread(lambda: [self.state.check_entry(plan, i, p) for i, p in complete])

    async def _read(self, plan, it, assembler: EntryAssembler, received: Received) -> Received:
        while True:
            try:
                chunk = _parsed(await next_chunk(it, self.stream_idle_seconds))
            except StopAsyncIteration:
                break
            if isinstance(chunk, RawData):
                data = chunk.view
            elif chunk.WhichOneof("kind") == "data":
                data = memoryview(chunk.data)
            else:
                raise invalid("a push stream has one header, then data chunks")
            complete = assembler.feed(data)
            if complete:
                await self._take(plan, complete, received)
        return self._finish(plan, assembler, received)

    async def _take(self, plan, complete: list, received: Received) -> None:
        received.add([payload for _, payload in complete], await self._check(plan, complete))

    @staticmethod
    def _finish(plan, assembler: EntryAssembler, received: Received) -> Received:
        received.add([p for _, p in assembler.finish()], [])  # zero-byte entries only (none is accepted)
        if not assembler.done:
            raise invalid(f"push stream ended early: {assembler.index} of {len(plan.entries)} tensors complete")
        return received

    # ---- pulls -----------------------------------------------------------------------------
    async def PullUpdate(self, request, context) -> None:
        """gRPC: the pull's messages, each written within the idle limit. A peer that takes nothing for
        that long gets its answer's memory back at once (the copies, the pull budget) and its stream
        ends STREAM_IDLE. gRPC sends that status only once the peer reads again or goes (its deadline,
        its connection): until then the stream keeps what gRPC core buffered (~5 MiB). (A handler that
        yields cannot be ended from outside: cancelled, it kept its whole answer.)"""
        async with contextlib.aclosing(self.pull_chunks(request, context)) as chunks:
            async for chunk in chunks:
                write = asyncio.ensure_future(context.write(chunk))
                done, _ = await asyncio.wait({write}, timeout=self.stream_idle_seconds)
                if not done:
                    write.cancel()
                    self.counters.pulls_idle += 1
                    await chunks.aclose()  # its memory goes back now, not when the peer reads again
                    idle = f"the pull stream's peer took nothing for {self.stream_idle_seconds:g}s"
                    await _abort(context, refuse(Reason.STREAM_IDLE, idle))
                write.result()

    async def pull_chunks(self, request, context):
        """A pull's answer as messages: its header, its entries' data, and for a tentative update its
        confirmation; a refusal through ``context`` (both transports: gRPC, the bulk port). The answer's
        share of the pull budget is held until the generator ends."""
        try:
            request = _parsed(request)
            self._check_identity(context, request.island_id)
            answer = await self.state.pull(pull_request(request))
        except RequestError as err:
            self.counters.pulls_busy += err.reason is Reason.PULL_BUDGET
            await _abort(context, err)
            return
        regions = tuple((e.name, tuple(e.offsets), tuple(e.sizes)) for e in request.regions)
        key = (request.island_id, request.rank, regions)
        sent = (answer.kind, request.have_round, answer.round)
        again = bool(answer.entries) and self._answered.get(key) == sent
        if answer.entries:
            self._answered[key] = sent
        try:
            async with contextlib.aclosing(self._answer(answer, context, again)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except RequestError as err:  # a tentative update whose step ended before an entry: pull again
            await _abort(context, err)
        finally:
            answer.done()

    async def _answer(self, answer, context, again: bool = False):
        """``again``: the same answer went to the same rank and regions before (counted as resent)."""
        header = pb.UpdateHeader(
            kind=UPDATE_KINDS[answer.kind],
            round=answer.round,
            codec=answer.codec,
            committed=answer.committed,
            latest_round=answer.latest_round,
            bootstrap=answer.bootstrap,
            run_complete=answer.run_complete,
            waiting=answer.waiting,
            stalled=answer.stalled,
            tentative=answer.durable is not None,
        )
        if answer.loss is not None:
            header.loss = answer.loss
        if answer.arrival_offset is not None:
            header.arrival_offset = answer.arrival_offset
        for entry in answer.entries:
            e = header.entries.add(name=entry.name, num_bytes=entry.num_bytes)
            if entry.region is not None:
                e.offsets.extend(entry.region.offsets)
                e.sizes.extend(entry.region.sizes)
        yield pb.PullChunk(header=header)
        packer = ChunkPacker()  # small entries share messages
        for entry in answer.entries:
            if entry.made is not None:
                parts = [await entry.made()]
            else:
                parts = await asyncio.to_thread(entry.parts) if callable(entry.data) else entry.parts()
            size = sum(memoryview(p).nbytes for p in parts)
            if size != entry.num_bytes:  # pragma: no cover - a bug, not an input
                raise AssertionError(f"entry {entry.name}: {size} bytes, header says {entry.num_bytes}")
            self.counters.bytes_out += size
            if again:
                self.counters.resent(Resent.PULL_AGAIN, size)
            for part in parts:
                for chunk in packer.add(part):
                    yield chunk
            del parts
        for chunk in packer.flush():
            yield chunk
        if answer.durable is not None:
            if not await answer.durable():
                err = refuse(Reason.NOT_DURABLE, f"round {answer.round - 1} was not saved in time; pull again")
                await _abort(context, err)
                return
            yield pb.PullChunk(durable=pb.Durable(round=answer.round))


def add_servicer(servicer: CoordinatorServicer, server: grpc.aio.Server) -> None:
    """Register the servicer with the protocol's method table, every request deserializer tolerant of
    unparseable bytes."""
    handlers = server_handlers(servicer, tolerant)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
