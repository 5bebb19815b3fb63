"""The DiLoCo wrapper an island drops into its training loop.

    sync = DiLoCo(model, inner_opt, coordinator="host:port", sync_every=100, codec="int8")
    sync.start()                     # joins; all islands start from the same θ
    for batch in data:
        loss = ...; loss.backward(); inner_opt.step(); inner_opt.zero_grad()
        sync.step(tokens=batch.numel(), loss=loss.item())   # pushes/pulls every H steps
    sync.close()

The constructor does no network I/O; ``start()`` does.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass

import grpc
import torch

from atoll.compression import ErrorFeedback, available_codecs, codec_name, get_codec
from atoll.islands.client import CoordinatorClient, RetryPolicy
from atoll.protos import coordinator_pb2 as pb

log = logging.getLogger("atoll.island")

_PB_DTYPES = {
    torch.float32: pb.DTYPE_FLOAT32,
    torch.float16: pb.DTYPE_FLOAT16,
    torch.bfloat16: pb.DTYPE_BFLOAT16,
    torch.float64: pb.DTYPE_FLOAT64,
}


@dataclass
class RoundStats:
    round: int
    """The round this island just finished (its delta was for this round)."""
    inner_steps: int
    tokens: int
    loss: float | None
    """Mean of the losses passed to ``step`` during the round."""
    global_loss: float | None
    """Token-weighted mean loss over the islands that committed the round (from the coordinator)."""
    bytes_sent: int
    bytes_received: int
    sync_seconds: float
    update_kind: str


class DiLoCo:
    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        coordinator: str,
        sync_every: int | None = None,
        codec: str | None = None,
        run_id: str = "atoll",
        island_id: str | None = None,
        heartbeat_seconds: float = 5.0,
        pull_wait_seconds: float = 10.0,
        retry: RetryPolicy | None = None,
    ) -> None:
        if codec is not None:
            get_codec(codec)  # ValueError with the reason for a bad spec
        if sync_every is not None and sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.address = coordinator
        self.requested_sync_every = sync_every
        self.codec_name = codec
        self.run_id = run_id
        self.island_id = island_id or f"island-{uuid.uuid4().hex[:8]}"
        self.heartbeat_seconds = heartbeat_seconds
        self.pull_wait_seconds = pull_wait_seconds
        self.retry = retry
        self.params = dict(model.named_parameters())
        self.client: CoordinatorClient | None = None
        self.round = -1
        self.sync_every = sync_every or 0
        self.inner_steps = 0
        self.history: list[RoundStats] = []
        self._start_params: dict[str, torch.Tensor] = {}
        self._tokens = 0
        self._losses: list[float] = []
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self.codec = None  # the run's codec, set by start()
        self._codec_state: dict[str, dict] = {}
        self._buffers: dict[str, bytearray] = {}

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> DiLoCo:
        self.client = CoordinatorClient(self.address, retry=self.retry)
        resp = self._join()
        if resp.bootstrap:
            self._bootstrap()
        self._pull_until_ready(have_round=-1)
        self._hb_thread = threading.Thread(target=self._heartbeats, name="atoll-heartbeat", daemon=True)
        self._hb_thread.start()
        return self

    def __enter__(self) -> DiLoCo:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, leave: bool = True) -> None:
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
            self._hb_thread = None
        if self.client is not None:
            if leave:
                try:
                    self.client.leave(pb.LeaveRequest(run_id=self.run_id, island_id=self.island_id))
                except grpc.RpcError as err:
                    log.warning("leave failed: %s", err)
            self.client.close()
            self.client = None

    def _join(self) -> pb.JoinResponse:
        offered = [codec_name(self.codec_name)] if self.codec_name else available_codecs()
        req = pb.JoinRequest(run_id=self.run_id, island_id=self.island_id, codecs=offered, num_ranks=1)
        for name, p in self.params.items():
            req.tensors.add(name=name, shape=list(p.shape), dtype=_PB_DTYPES[p.dtype])
        resp = self.client.join(req)
        if self.requested_sync_every is None:
            self.sync_every = resp.config.sync_every
        if self.codec is None or self.codec.spec != get_codec(resp.codec).spec:
            codec = get_codec(resp.codec)
            self.codec = ErrorFeedback(codec) if resp.config.error_feedback and codec.lossy else codec
            self._codec_state = {}
        log.info(
            "%s joined run %s at round %d (H=%d, codec %s)",
            self.island_id,
            self.run_id,
            resp.round,
            self.sync_every,
            resp.codec,
        )
        return resp

    def _bootstrap(self) -> None:
        ident = get_codec("identity")
        names = list(self.params)
        payloads = [ident.encode(self.params[n].detach()) for n in names]
        self.client.push(self._header(pb.PUSH_KIND_INIT, 0, names, payloads, "identity"), payloads)

    def _heartbeats(self) -> None:
        while not self._hb_stop.wait(self.heartbeat_seconds):
            try:
                self.client.heartbeat(
                    pb.HeartbeatRequest(run_id=self.run_id, island_id=self.island_id, round=self.round)
                )
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    log.info("coordinator forgot %s; re-joining", self.island_id)
                    with contextlib.suppress(grpc.RpcError):
                        self._join()
            except ValueError:  # channel closed under us during shutdown
                return

    # ---- training loop ---------------------------------------------------------------------
    def step(self, tokens: int = 0, loss: float | None = None) -> RoundStats | None:
        """Call after each inner optimizer step. Returns the round's stats when it synced."""
        if self.client is None:
            raise RuntimeError("DiLoCo.start() was not called")
        self.inner_steps += 1
        self._tokens += int(tokens)
        if loss is not None:
            self._losses.append(float(loss))
        if self.inner_steps % self.sync_every:
            return None
        return self.sync()

    def sync(self) -> RoundStats:
        """Push this round's pseudo-gradient, wait for the outer step and apply it."""
        started = time.perf_counter()
        sent0, recv0 = self.client.bytes_sent, self.client.bytes_received
        names = list(self.params)
        with torch.no_grad():
            payloads = [
                self.codec.encode(
                    self._start_params[n] - self.params[n].detach().float(), self._codec_state.setdefault(n, {})
                )
                for n in names
            ]
        loss = sum(self._losses) / len(self._losses) if self._losses else None
        header = self._header(
            pb.PUSH_KIND_DELTA, self.round, names, payloads, self.codec_name, tokens=self._tokens, loss=loss
        )
        finished_round, tokens = self.round, self._tokens
        steps = len(self._losses) or self.sync_every
        self._push(header, payloads)
        kind, global_loss = self._pull_until_ready(self.round, repush=(header, payloads))
        self._tokens = 0
        self._losses = []
        stats = RoundStats(
            finished_round,
            steps,
            tokens,
            loss,
            global_loss,
            self.client.bytes_sent - sent0,
            self.client.bytes_received - recv0,
            time.perf_counter() - started,
            kind,
        )
        self.history.append(stats)
        return stats

    def _header(self, kind, round_, names, payloads, codec, *, tokens=0, loss=None) -> pb.PushHeader:
        h = pb.PushHeader(
            run_id=self.run_id,
            island_id=self.island_id,
            round=round_,
            kind=kind,
            rank=0,
            num_ranks=1,
            tokens=tokens,
            codec=codec,
        )
        if loss is not None:
            h.loss = loss
        for n, payload in zip(names, payloads, strict=True):
            h.entries.add(name=n, num_bytes=len(payload))
        return h

    def _push(self, header: pb.PushHeader, payloads: list[bytes]) -> bool:
        """Push; returns False when the round closed without us (the work is dropped)."""
        try:
            self.client.push(header, payloads)
            return True
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:
                self._join()
                return self._push(header, payloads)
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION and "closed" in (err.details() or ""):
                log.warning("%s: round %d closed before our push arrived; dropping it", self.island_id, header.round)
                return False
            raise

    def _pull_until_ready(self, have_round: int, repush=None) -> tuple[str, float | None]:
        while True:
            req = pb.PullRequest(
                run_id=self.run_id, island_id=self.island_id, have_round=have_round, wait_seconds=self.pull_wait_seconds
            )
            try:
                header, payloads = self.client.pull(req)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    self._join()
                    continue
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION and have_round >= 0:
                    log.warning("%s: %s; pulling full parameters", self.island_id, err.details())
                    have_round = -1
                    continue
                raise
            if header.kind == pb.UPDATE_KIND_NOT_READY:
                if repush is not None and not header.committed and header.round == have_round:
                    # The coordinator lost our push (it restarted): idempotent, so send it again.
                    log.info("%s: coordinator has no push from us for round %d; re-pushing", self.island_id, have_round)
                    self._push(*repush)
                continue
            self._apply(header, payloads)
            return pb.UpdateKind.Name(header.kind), (header.loss if header.HasField("loss") else None)

    def _apply(self, header: pb.UpdateHeader, payloads: list[tuple[str, bytes]]) -> None:
        got = [name for name, _ in payloads]
        if sorted(got) != sorted(self.params):
            raise RuntimeError(f"update covers tensors {got[:5]}..., the model has {list(self.params)[:5]}...")
        codec = get_codec(header.codec)
        new = {}
        for name, payload in payloads:
            shape = tuple(self.params[name].shape)
            if header.kind == pb.UPDATE_KIND_FULL:
                new[name] = codec.decode(payload, shape)
            else:
                new[name] = self._start_params[name] + codec.decode(payload, shape)
        with torch.no_grad():
            for name, value in new.items():
                self.params[name].copy_(value)
        self._start_params = new
        self.round = header.round

    def global_params(self) -> dict[str, torch.Tensor]:
        """θ of the current round as received from the coordinator (fp32)."""
        return dict(self._start_params)
