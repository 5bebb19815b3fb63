"""WAN emulation as a user-space asyncio TCP proxy: latency, bandwidth, loss, and network cuts.

Each island talks to the coordinator through its own proxy, so one island's link can be slowed or
cut while the others stay clean. Network namespaces with ``tc netem`` would emulate the kernel's
behaviour more faithfully; this proxy needs no privileges and reports itself as
``EMULATION = "user-space asyncio proxy"``.

Model per direction: a chunk occupies the link for ``8 * len / rate`` seconds (serialised behind
earlier chunks), then arrives ``rtt / 2`` later. Packet loss is approximated as a retransmission:
a chunk is "lost" with probability ``loss`` and arrives one extra RTT later (TCP carries the bytes
either way). A cut closes every connection and refuses new ones until it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from dataclasses import dataclass

EMULATION = "user-space asyncio proxy"
CHUNK = 64 * 1024


@dataclass(frozen=True, kw_only=True)
class LinkProfile:
    rtt_ms: float = 0.0
    """Round-trip latency added by the link."""
    rate_mbit: float = 0.0
    """Bandwidth of each direction in Mbit/s; 0 = unlimited."""
    loss: float = 0.0
    """Probability that a chunk needs a retransmission (costs one extra RTT)."""

    def __post_init__(self) -> None:
        if self.rtt_ms < 0 or self.rate_mbit < 0 or not 0 <= self.loss < 1:
            raise ValueError("need rtt_ms >= 0, rate_mbit >= 0 and 0 <= loss < 1")


class WanProxy:
    """``await start()``; ``address``; ``cut(seconds)``; ``await stop()``."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        profile: LinkProfile = LinkProfile(),
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int = 0,
    ) -> None:
        self.target = (target_host, target_port)
        self.profile = profile
        self.host, self.requested_port = host, port
        self.port: int | None = None
        self.bytes = {"up": 0, "down": 0}
        self.cuts = 0
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._cut_until = 0.0
        self._rng = random.Random(seed)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.requested_port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self._drop_all()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    def cut(self, seconds: float) -> None:
        """Cut the link now for ``seconds``: open connections die, new ones are refused."""
        self._cut_until = time.monotonic() + seconds
        self.cuts += 1
        self._drop_all()

    @property
    def is_cut(self) -> bool:
        return time.monotonic() < self._cut_until

    def _drop_all(self) -> None:
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.is_cut:
            writer.transport.abort()
            return
        task = asyncio.current_task()
        self._conns.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            self._conns.discard(task)
            return
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(self._pipe(reader, up_writer, "up"), self._pipe(up_reader, writer, "down"))
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()
            self._conns.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        queue: asyncio.Queue = asyncio.Queue(maxsize=64)  # bounded: TCP back-pressure reaches the sender
        loop = asyncio.get_running_loop()

        async def deliver() -> None:
            while True:
                item = await queue.get()
                if item is None:
                    writer.close()
                    return
                due, data = item
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
                self.bytes[direction] += len(data)

        sender = asyncio.create_task(deliver())
        one_way = self.profile.rtt_ms / 2000.0
        rate = self.profile.rate_mbit * 1e6 / 8
        link_free = loop.time()
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    await queue.put(None)
                    break
                now = loop.time()
                link_free = max(link_free, now) + (len(data) / rate if rate else 0.0)
                due = link_free + one_way
                if self.profile.loss and self._rng.random() < self.profile.loss:
                    due += 2 * one_way
                await queue.put((due, data))
            await sender
        finally:
            sender.cancel()


class ProxyThread:
    """A WanProxy on its own event loop thread, for harnesses and tests driven from sync code."""

    def __init__(self, target: str, profile: LinkProfile = LinkProfile(), **kwargs) -> None:
        host, port = target.rsplit(":", 1)
        self.proxy = WanProxy(host, int(port), profile, **kwargs)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="wan-proxy", daemon=True)

    def __enter__(self) -> ProxyThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> ProxyThread:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(10)
        return self

    @property
    def address(self) -> str:
        return self.proxy.address

    def cut(self, seconds: float) -> None:
        """Cut the link for ``seconds``; returns once it is cut (open connections dropped)."""

        async def cut() -> None:
            self.proxy.cut(seconds)

        asyncio.run_coroutine_threadsafe(cut(), self.loop).result(10)

    @property
    def is_cut(self) -> bool:
        return self.proxy.is_cut

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.proxy.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
