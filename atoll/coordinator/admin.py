"""The coordinator's admin HTTP server (aiohttp): /healthz, /metrics (Prometheus), /api/status, and a
live dashboard at / (loss, bytes and the round timeline per island, polled from /api/status).

Bound to loopback by default; on any other address it refuses to start without a bearer token,
and with a token every endpoint but /healthz requires ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import time
from importlib import resources

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from atoll.coordinator.core import IslandState, RunState


class _StateCollector:
    """Reads the run state at scrape time (no global registry, no duplicated bookkeeping)."""

    def __init__(self, state: RunState) -> None:
        self.state = state

    def collect(self):
        s = self.state
        yield GaugeMetricFamily("atoll_round", "The open round (rounds below it are complete)", value=s.round)
        yield CounterMetricFamily("atoll_rounds_completed", "Rounds closed by the outer step", value=len(s.history))
        states = s.states()
        g = GaugeMetricFamily("atoll_islands", "Member islands by state", labels=["state"])
        for name in (IslandState.JOINING, IslandState.ACTIVE, IslandState.LATE, IslandState.GONE):
            g.add_metric([name], sum(1 for v in states.values() if v == name))
        yield g
        for key, help_text in [
            ("bytes_in", "Payload bytes received in validated pushes"),
            ("bytes_out", "Payload bytes sent in pulls"),
            ("pushes_late_folded", "Late pushes folded into a later round"),
            ("pushes_late_dropped", "Pushes refused because their round had closed"),
            ("pushes_refused", "Pushes refused for bad input"),
        ]:
            yield CounterMetricFamily(f"atoll_{key}", help_text, value=s.counters[key])
        last = s.history[-1]["seconds_open"] if s.history else 0.0
        yield GaugeMetricFamily("atoll_last_round_seconds", "How long the last closed round was open", value=last)
        yield CounterMetricFamily(
            "atoll_round_seconds", "Total seconds rounds were open", value=sum(h["seconds_open"] for h in s.history)
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AdminServer:
    def __init__(self, state: RunState, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        if not _is_loopback(host) and not token:
            raise ValueError(f"admin HTTP on non-loopback address {host!r} needs a token (--admin-token)")
        self.state = state
        self.host, self.requested_port, self.token = host, port, token
        self.port: int | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(state))
        self._runner: web.AppRunner | None = None
        self.started_at = time.time()

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/api/status", self.status)
        app.router.add_get("/", self.dashboard)
        app.router.add_get("/dashboard", self.dashboard)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.token and request.path != "/healthz":
            given = request.headers.get("Authorization", "")
            if request.path in ("/", "/dashboard"):  # a browser opens the page as /dashboard?token=...
                given = f"Bearer {request.query.get('token', '')}"
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                raise web.HTTPUnauthorized(text="missing or wrong bearer token\n")
        return await handler(request)

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.requested_port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def dashboard(self, request: web.Request) -> web.Response:
        page = resources.files("atoll.coordinator").joinpath("static/dashboard.html").read_text(encoding="utf-8")
        return web.Response(text=page, content_type="text/html")

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status(self, request: web.Request) -> web.Response:
        s = self.state
        states = s.states()
        islands = [
            {
                "island": i,
                "state": states[i],
                "num_ranks": rec.num_ranks,
                "joined_round": rec.joined_round,
                "rounds_committed": rec.rounds_committed,
                "holds_round": rec.holds_round,
                "committed_this_round": i in s.committed,
            }
            for i, rec in sorted(s.islands.items())
        ]
        return web.json_response(
            {
                "run": dataclasses.asdict(s.config),
                "round": s.round,
                "bootstrapped": s.params is not None,
                "islands": islands,
                "counters": dict(s.counters),
                "history": s.history[-100:],
                "uptime_seconds": time.time() - self.started_at,
            }
        )
