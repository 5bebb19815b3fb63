"""A real coordinator in the test's process, an island that speaks the protocol by hand, a clock
the test moves, and HTTP calls: what most tests of the coordinator share."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from atoll.compression import get_codec
from atoll.coordinator import CoordinatorServer, RunConfig
from atoll.islands import CoordinatorClient, RetryPolicy
from atoll.protos import coordinator_pb2 as pb


class FakeClock:
    """A clock tests move by hand (``clock.now += 5``) instead of sleeping."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def wait_for(condition, *, timeout: float = 10.0, what: str = "the condition"):
    """Return ``condition()``'s first truthy value, checked every 10 ms; fail after ``timeout``.

    The tests' one way to wait for something another thread or process does: the condition is the
    event, so a fast machine does not wait and a slow one does not fail by a fixed sleep's margin."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)
    return value


def exact_config(**kw) -> RunConfig:
    """A run config with identity both ways: the tests' exact fp32 arithmetic (a new run's default
    is int8 both ways)."""
    return RunConfig(**{"codec": "identity", "downlink_codec": "identity", **kw})


class LoopThread:
    """A server (``start()``, ``stop(grace=)``, ``address``, ``state``) on its own event loop thread."""

    def __init__(self, server) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> LoopThread:
        self.thread.start()
        try:
            self.call(self.server.start())
        except BaseException:
            self._close_loop()
            raise
        return self

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def inspect(self, fn):
        """Run ``fn(state)`` on the server's loop (no races with the handlers)."""

        async def run():
            return fn(self.server.state)

        return self.call(run())

    @property
    def address(self) -> str:
        return self.server.address

    def stop(self) -> None:
        """Stop the server and its loop (again: nothing)."""
        if self.loop.is_closed():
            return
        try:
            self.call(self.server.stop(grace=0.5))
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class ServerThread(LoopThread):
    """A real CoordinatorServer (grpc.aio, port 0) on its own event loop thread."""

    def __init__(self, config: RunConfig, state_dir: Path, **server_kwargs) -> None:
        super().__init__(CoordinatorServer(config, state_dir, **server_kwargs))


class RawIsland:
    """Drives the protocol by hand (no DiLoCo wrapper), for exact-value and bad-input tests."""

    def __init__(
        self,
        address: str,
        island_id: str,
        shapes: dict[str, tuple[int, ...]],
        run_id: str = "t",
        codec: str = "identity",
        **client_options,
    ) -> None:
        """``client_options``: the client's ``token`` and ``tls``."""
        retry = RetryPolicy(give_up_seconds=10, rpc_timeout_seconds=10)
        self.client = CoordinatorClient(address, retry=retry, **client_options)
        self.island_id = island_id
        self.shapes = shapes
        self.run_id = run_id
        self.codec = codec

    def join(self, **overrides) -> pb.JoinResponse:
        req = pb.JoinRequest(run_id=self.run_id, island_id=self.island_id, codecs=[self.codec], num_ranks=1)
        for name, shape in self.shapes.items():
            req.tensors.add(name=name, shape=list(shape), dtype=pb.DTYPE_FLOAT32)
        for k, v in overrides.items():
            if isinstance(v, list):
                del getattr(req, k)[:]
                getattr(req, k).extend(v)
            else:
                setattr(req, k, v)
        return self.client.join(req)

    def push(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        round_: int,
        kind=pb.PUSH_KIND_DELTA,
        tokens: int = 0,
        codec: str | None = None,
        **header_overrides,
    ) -> pb.PushResponse:
        codec = codec or ("identity" if kind == pb.PUSH_KIND_INIT else self.codec)
        c = get_codec(codec)
        payloads = [c.encode(t) for t in tensors.values()]
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
        for name, p in zip(tensors, payloads, strict=True):
            h.entries.add(name=name, num_bytes=len(p))
        for k, v in header_overrides.items():
            setattr(h, k, v)
        return self.client.push(h, payloads)

    def pull(self, have_round: int, wait_seconds: float = 5.0, rank: int = 0):
        return self.client.pull(
            pb.PullRequest(
                run_id=self.run_id,
                island_id=self.island_id,
                have_round=have_round,
                wait_seconds=wait_seconds,
                rank=rank,
            )
        )

    def close(self) -> None:
        self.client.close()


def http(url: str, *, token: str | None = None, data: bytes | None = None, headers=None) -> tuple[int, str]:
    """One HTTP request (POST when ``data`` is given), with a bearer ``token``: (status, body text),
    error statuses included. The answer is always closed: an HTTPError left to the garbage collector
    leaks its socket, and a ResourceWarning then fails whatever test is running when it is collected."""
    req = urllib.request.Request(url, data=data, headers=dict(headers or {}), method="POST" if data else "GET")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.read().decode()


def post_json(url: str, body, token: str) -> tuple[int, object]:
    """POST ``body`` as JSON with a bearer token: (status, parsed JSON answer, or the error text)."""
    code, text = http(url, token=token, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return code, json.loads(text) if code < 400 else text
