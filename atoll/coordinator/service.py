"""The gRPC shell around :class:`RunState`, and the server object with start/stop/address."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from atoll.coordinator.config import RunConfig
from atoll.coordinator.core import PushPlan, RequestError, RunState
from atoll.coordinator.security import IslandTokens, TlsConfig, TokenInterceptor
from atoll.protos import coordinator_pb2 as pb
from atoll.protos import coordinator_pb2_grpc as pb_grpc
from atoll.protos import raw
from atoll.protos.raw import RawData

log = logging.getLogger("atoll.coordinator")

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 16 << 20
SERVICE_NAME = "atoll.v1.Coordinator"
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


async def _abort(context: grpc.aio.ServicerContext, err: RequestError):
    log.warning("refused: %s", err.reason)
    await context.abort(err.code, err.reason)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, state: RunState, tokens: IslandTokens | None = None) -> None:
        self.state = state
        self.tokens = tokens

    def _check_identity(self, context, island_id: str) -> None:
        """With island tokens configured, an island may only act for itself."""
        if self.tokens is None:
            return
        holder = self.tokens.island_for(context.invocation_metadata())
        if holder is None:
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown island token")
        if holder != island_id:
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED, f"token of island {holder!r} cannot act for island {island_id!r}"
            )

    async def _unary(self, handler, request, context):
        try:
            self._check_identity(context, request.island_id)
            return handler(request)
        except RequestError as err:
            await _abort(context, err)

    async def Join(self, request, context):
        return await self._unary(self.state.join, request, context)

    async def Heartbeat(self, request, context):
        return await self._unary(self.state.heartbeat, request, context)

    async def Leave(self, request, context):
        return await self._unary(self.state.leave, request, context)

    async def PushDelta(self, request_iterator, context):
        try:
            return await self._push(request_iterator, context)
        except RequestError as err:
            if err.code == grpc.StatusCode.INVALID_ARGUMENT:
                self.state.counters["pushes_refused"] += 1
            await _abort(context, err)

    async def _push(self, request_iterator, context) -> pb.PushResponse:
        it = request_iterator.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "empty push stream") from None
        if isinstance(first, RawData) or first.WhichOneof("kind") != "header":
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "a push stream must start with a header")
        self._check_identity(context, first.header.island_id)
        plan = self.state.plan_push(first.header)
        if isinstance(plan, pb.PushResponse):
            return plan  # duplicate: nothing to read
        payloads = await _receive_entries(self.state, plan, it)
        num_bytes = sum(e.num_bytes for e in plan.entries)
        return await self.state.commit_push(plan, payloads, num_bytes)

    async def PullUpdate(self, request, context):
        try:
            self._check_identity(context, request.island_id)
            answer = await self.state.pull(request)
        except RequestError as err:
            await _abort(context, err)
            return
        header = pb.UpdateHeader(
            kind=answer.kind,
            round=answer.round,
            codec=answer.codec,
            committed=answer.committed,
            latest_round=self.state.round,
        )
        if answer.loss is not None:
            header.loss = answer.loss
        for name, region, payload in answer.payloads:
            entry = header.entries.add(name=name, num_bytes=len(payload))
            if region is not None:
                entry.offsets.extend(region.offsets)
                entry.sizes.extend(region.sizes)
        yield pb.PullChunk(header=header)
        self.state.counters["bytes_out"] += sum(len(p) for _, _, p in answer.payloads)
        for _, _, payload in answer.payloads:
            view = memoryview(payload)
            for start in range(0, len(view), CHUNK_BYTES):
                yield RawData(view[start : start + CHUNK_BYTES])


async def _receive_entries(state: RunState, plan: PushPlan, it) -> list[bytearray]:
    """Read the data chunks of a push, validating each entry as soon as its bytes are in.

    Each entry's buffer is allocated once at its declared size (already bounded by ``plan_push``
    against the tensor's size), so receiving never regrows or copies a payload twice.
    """
    payloads = []
    index, filled = 0, 0
    buf: bytearray | None = None
    async for chunk in it:
        if isinstance(chunk, RawData):
            data = chunk.view
        elif chunk.WhichOneof("kind") == "data":
            data = memoryview(chunk.data)
        else:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "a push stream has one header, then data chunks")
        while data.nbytes:
            if index >= len(plan.entries):
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT, "push stream carries more bytes than its header declares"
                )
            size = plan.entries[index].num_bytes
            if buf is None:
                buf, filled = bytearray(size), 0
            take = min(size - filled, data.nbytes)
            buf[filled : filled + take] = data[:take]
            filled += take
            data = data[take:]
            if filled == size:
                payloads.append(await asyncio.to_thread(state.check_entry, plan, index, buf))
                buf = None
                index += 1
    if index != len(plan.entries):
        raise RequestError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"push stream ended early: {index} of {len(plan.entries)} tensors complete",
        )
    return payloads


def _add_servicer(servicer: CoordinatorServicer, server: grpc.aio.Server) -> None:
    """The generated registration, with the bulk streams' chunks on the raw path (atoll.protos.raw)."""
    handlers = {
        "Join": grpc.unary_unary_rpc_method_handler(
            servicer.Join,
            request_deserializer=pb.JoinRequest.FromString,
            response_serializer=pb.JoinResponse.SerializeToString,
        ),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(
            servicer.Heartbeat,
            request_deserializer=pb.HeartbeatRequest.FromString,
            response_serializer=pb.HeartbeatResponse.SerializeToString,
        ),
        "PushDelta": grpc.stream_unary_rpc_method_handler(
            servicer.PushDelta,
            request_deserializer=raw.deserialize_push_chunk,
            response_serializer=pb.PushResponse.SerializeToString,
        ),
        "PullUpdate": grpc.unary_stream_rpc_method_handler(
            servicer.PullUpdate, request_deserializer=pb.PullRequest.FromString, response_serializer=raw.serialize
        ),
        "Leave": grpc.unary_unary_rpc_method_handler(
            servicer.Leave,
            request_deserializer=pb.LeaveRequest.FromString,
            response_serializer=pb.LeaveResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class CoordinatorServer:
    """The coordinator daemon: ``await start()``, ``address``, ``await stop(grace)``."""

    def __init__(
        self,
        config: RunConfig,
        state_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        admin_host: str = "127.0.0.1",
        admin_port: int | None = None,
        admin_token: str | None = None,
        tls: TlsConfig | None = None,
        tokens: IslandTokens | None = None,
        shard: tuple[int, int] = (0, 1),
        partition: str = "hash",
    ) -> None:
        """``admin_port``: serve the admin HTTP endpoints there (0 picks a port; None: no admin server).
        ``shard``/``partition``: this coordinator's shard and how tensors map to shards (atoll.sharding)."""
        self.config = config
        self.admin_args = (admin_host, admin_port, admin_token)
        self.tls = tls
        self.tokens = tokens
        self.shard = shard
        self.partition = partition
        self.admin = None
        self.state_dir = Path(state_dir)
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self.state: RunState | None = None
        self._server: grpc.aio.Server | None = None
        self._decider: asyncio.Task | None = None

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        self.state = RunState(self.config, self.state_dir, shard=self.shard, partition=self.partition)
        self.state.restore()
        admin_host, admin_port, admin_token = self.admin_args
        if admin_port is not None:  # built first: a bad admin config fails before anything listens
            from atoll.coordinator.admin import AdminServer

            self.admin = AdminServer(self.state, host=admin_host, port=admin_port, token=admin_token)
        interceptors = [TokenInterceptor(self.tokens)] if self.tokens else []
        self._server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=interceptors)
        _add_servicer(CoordinatorServicer(self.state, self.tokens), self._server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self._server)
        bind = f"{self.host}:{self.requested_port}"
        if self.tls is not None:
            self.port = self._server.add_secure_port(bind, self.tls.server_credentials())
        else:
            self.port = self._server.add_insecure_port(bind)
        if self.port == 0:
            raise RuntimeError(f"could not bind {self.host}:{self.requested_port}")
        await self._server.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._decider = asyncio.create_task(self.state.run_decider(), name="atoll-decider")
        if self.admin is not None:
            await self.admin.start()
            log.info("admin HTTP on %s", self.admin.address)
        log.info(
            "coordinator for run %s serving on %s (state in %s)", self.state.config.run_id, self.address, self.state_dir
        )

    async def stop(self, grace: float | None = 1.0) -> None:
        if self.admin is not None:
            await self.admin.stop()
            self.admin = None
        if self._decider is not None:
            self._decider.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._decider
            self._decider = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
