"""The coordinator's admin HTTP server (aiohttp).

- ``GET /healthz``: 200 ``ok``, or 503 with the reason (a state save failing, a dead background task).
- ``GET /metrics``: Prometheus (round, loss, tokens and tokens/s, islands by state, each island's
  state and last-push age, bytes, pushes, round durations).
- ``GET /api/status``: the run at a glance as JSON (config, islands, history, health, stall).
- ``GET /``: a live dashboard polling /api/status.
- ``POST /api/islands/{id}/evict`` and ``POST /api/config`` (JSON of operational fields): operator
  control of a live run; they need ``--admin-token``.

Bound to loopback by default; on any other address it refuses to start without a bearer token, and
with a token every endpoint but /healthz requires ``Authorization: Bearer <token>`` (the dashboard
page also takes ``?token=``, since a browser cannot set the header on a link).
"""

from __future__ import annotations

import dataclasses
import functools
import hmac
import json
import logging
import math
import time
from importlib import resources

import torch
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from atoll.coordinator.config import OPERATIONAL_FIELDS, ConfigMismatch
from atoll.coordinator.policy.goodput import run_goodput
from atoll.coordinator.state.held import held_bytes
from atoll.coordinator.state.membership import IslandState
from atoll.coordinator.state.record import RoundRecord
from atoll.coordinator.transport import behind
from atoll.coordinator.transport.behind import RECENT_ROUNDS
from atoll.coordinator.transport.counters import Counters
from atoll.coordinator.transport.guard import KEEPALIVE_SECONDS, ConnectionGuard, GuardedSite
from atoll.errors import PortInUse
from atoll.net import is_loopback_host

log = logging.getLogger("atoll.coordinator")

STATES = (
    IslandState.JOINING,
    IslandState.ACTIVE,
    IslandState.LATE,
    IslandState.GONE,
    IslandState.LEFT,
    IslandState.EVICTED,
)


def health_problem(server) -> str | None:
    if server.failed is not None and server.failed.done():
        return "a background task died; the coordinator is stopping"
    return server.state.unhealthy()


class _StateCollector:
    """Reads the run state at scrape time (no global registry, no duplicated bookkeeping). A figure that
    is not finite is left out (a scrape never shows +Inf or NaN for a run's figure)."""

    def __init__(self, server) -> None:
        self.server = server

    def collect(self):
        for family in self._families():
            family.samples = [x for x in family.samples if math.isfinite(x.value)]
            yield family

    def _families(self):
        s, counters = self.server.state, self.server.counters
        yield GaugeMetricFamily("atoll_round", "The open round (rounds below it are complete)", value=s.round)
        yield CounterMetricFamily("atoll_rounds_completed", "Rounds closed by the outer step", value=len(s.history))
        yield GaugeMetricFamily(
            "atoll_healthy", "1 unless a state save is failing", value=0 if health_problem(self.server) else 1
        )
        last = s.history[-1] if s.history else RoundRecord(round=-1)
        if last.loss is not None:
            yield GaugeMetricFamily(
                "atoll_round_loss", "Token-weighted training loss of the last round", value=last.loss
            )
        yield GaugeMetricFamily(
            "atoll_round_tokens", "Tokens the islands processed in the last round", value=last.tokens
        )
        seconds = last.seconds_open or 0.0
        yield GaugeMetricFamily(
            "atoll_tokens_per_second",
            "Tokens of the last round over its duration",
            value=last.tokens / seconds if seconds else 0.0,
        )
        yield CounterMetricFamily(
            "atoll_tokens", "Tokens processed over the run", value=sum(h.tokens for h in s.history)
        )
        states = s.states()
        relayed = behind.states(s)
        relays = {i for i, rec in s.membership.islands.items() if rec.relay}
        g = GaugeMetricFamily(
            "atoll_islands", "Islands by state (those behind relays, not the relays themselves)", labels=["state"]
        )
        counted = [v for i, v in states.items() if i not in relays] + list(relayed.values())
        for name in STATES:
            g.add_metric([name], sum(1 for v in counted if v == name))
        yield g
        per = GaugeMetricFamily(
            "atoll_island_state",
            "1 for each island's current state (relays too; island: relay/island behind a relay)",
            labels=["island", "state"],
        )
        for island, state in [*states.items(), *relayed.items()]:
            per.add_metric([island, state], 1)
        yield per
        relayed_tokens = GaugeMetricFamily(
            "atoll_relayed_island_tokens",
            "Tokens of each island behind a relay in the last closed round (island: relay/island)",
            labels=["island"],
        )
        for key, tokens in (s.history[-1].tokens_by_island if s.history else {}).items():
            if "/" in key:
                relayed_tokens.add_metric([key], tokens)
        yield relayed_tokens
        age = GaugeMetricFamily(
            "atoll_island_last_push_age_seconds", "Seconds since the island's last push counted", labels=["island"]
        )
        now = s.clock()
        for island, rec in s.membership.islands.items():
            if rec.last_push_at is not None:
                age.add_metric([island], now - rec.last_push_at)
        yield age
        for key, help_text in Counters.HELP.items():
            yield CounterMetricFamily(f"atoll_{key}", help_text, value=getattr(counters, key))
        resent = CounterMetricFamily("atoll_resent_bytes", Counters.RESENT_HELP, labels=["cause"])
        for cause, num_bytes in counters.resent_bytes.items():
            resent.add_metric([cause], num_bytes)
        yield resent
        yield GaugeMetricFamily("atoll_last_round_seconds", "How long the last closed round was open", value=seconds)
        yield CounterMetricFamily(
            "atoll_round_seconds", "Total seconds rounds were open", value=sum(h.seconds_open for h in s.history)
        )
        run = run_goodput(s.membership.goodput(), now)
        yield GaugeMetricFamily(
            "atoll_goodput",
            "Island compute-seconds whose tokens entered θ over island wall-seconds while joined (the run)",
            value=run if run is not None else 0.0,
        )
        per = GaugeMetricFamily("atoll_island_goodput", "The same, per island", labels=["island"])
        blocked = GaugeMetricFamily(
            "atoll_island_blocked_seconds", "Seconds the island reported blocked on exchanges", labels=["island"]
        )
        for island, rec in s.membership.islands.items():
            if rec.goodput is not None:
                per.add_metric([island], rec.goodput.ratio(now) or 0.0)
                blocked.add_metric([island], rec.goodput.blocked_seconds)
            for name, g in rec.behind.items():  # (a relay's islands: their blocked time is their relay's to see)
                per.add_metric([name], g.ratio(now) or 0.0)
        yield per
        yield blocked
        yield GaugeMetricFamily(
            "atoll_inflight_bytes",
            "Push bytes held now: declared by admitted streams, or staged",
            value=s.accumulator.budget.used,
        )
        yield GaugeMetricFamily(
            "atoll_pull_bytes",
            "Memory the pulls being answered hold now (copies, updates read from the log, transport buffers)",
            value=s.downlink.budget.used,
        )


def finite_json(data, where: str = "") -> tuple[object, list[tuple[str, float]]]:
    """``data`` (dicts, lists, scalars) with every float that is not finite replaced by None, and where
    each was (``history[3].loss``): strict JSON whatever a record holds."""
    if isinstance(data, float) and not math.isfinite(data):
        return None, [(where, data)]
    bad: list[tuple[str, float]] = []
    if isinstance(data, dict):
        out = {}
        for k, v in data.items():
            out[k], found = finite_json(v, f"{where}.{k}" if where else str(k))
            bad += found
        return out, bad
    if isinstance(data, (list, tuple)):
        out = []
        for i, v in enumerate(data):
            value, found = finite_json(v, f"{where}[{i}]")
            out.append(value)
            bad += found
        return out, bad
    return data, bad


class NotHttp(logging.Filter):
    """aiohttp logs a traceback at ERROR for every request that is not HTTP/1.x: an island pointed at the
    admin port retries its gRPC Join every second or two, each a traceback. This filter on aiohttp's
    server logger drops those records and says it once a minute per peer, in the coordinator's words."""

    def __init__(self, port_of, every: float = 60.0) -> None:
        super().__init__()
        self.port_of, self.every = port_of, every
        self._said: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        peer = str(record.args[0]) if isinstance(record.args, tuple) and record.args else "a peer"
        now = time.monotonic()
        if now - self._said.get(peer, -math.inf) >= self.every:
            self._said[peer] = now
            log.warning(
                "admin port %s: %s sent what is not HTTP/1.x (an island pointed at the admin port instead of the "
                "coordinator's gRPC --port?); said once a minute per peer",
                self.port_of(),
                peer,
            )
        return False


def json_response(data) -> web.Response:
    """Strict JSON (no NaN or Infinity, which JSON parsers, the dashboard's included, refuse)."""
    return web.json_response(data, dumps=functools.partial(json.dumps, allow_nan=False))


class AdminServer:
    def __init__(
        self,
        server,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        guard: ConnectionGuard | None = None,
    ) -> None:
        """``server``: the :class:`~atoll.coordinator.transport.server.CoordinatorServer` (its state and
        counters). ``guard``: the limits on its connections (default: :class:`ConnectionGuard`'s)."""
        if not is_loopback_host(host) and not token:
            raise ValueError(f"admin HTTP on non-loopback address {host!r} needs a token (--admin-token)")
        self.server = server
        self.host, self.requested_port, self.token = host, port, token
        self.port: int | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(server))
        self._runner: web.AppRunner | None = None
        self.started_at = time.time()
        self._warned: set[str] = set()
        self._not_http = NotHttp(lambda: self.port)
        self.guard = guard or ConnectionGuard()

    @property
    def state(self):
        return self.server.state

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.guard.middleware, self._auth])
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/api/status", self.status)
        app.router.add_get("/", self.dashboard)
        app.router.add_get("/dashboard", self.dashboard)
        app.router.add_post("/api/islands/{island}/evict", self.evict)
        app.router.add_post("/api/config", self.set_config)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if request.method == "POST" and not self.token:
            raise web.HTTPForbidden(text="control endpoints need the coordinator to run with --admin-token\n")
        if self.token and request.path != "/healthz":
            given = request.headers.get("Authorization", "")
            if not given and request.path in ("/", "/dashboard"):  # a browser link: /dashboard?token=...
                given = f"Bearer {request.query.get('token', '')}"
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                raise web.HTTPUnauthorized(text="missing or wrong bearer token\n")
        return await handler(request)

    async def start(self) -> None:
        logging.getLogger("aiohttp.server").addFilter(self._not_http)
        self._runner = web.AppRunner(self.app(), access_log=None, keepalive_timeout=KEEPALIVE_SECONDS)
        await self._runner.setup()
        site = GuardedSite(self._runner, self.host, self.requested_port, self.guard)
        try:
            await site.start()
        except OSError as err:
            await self.stop()
            raise PortInUse(
                f"--admin-port {self.requested_port} on {self.host} cannot be bound: {err.strerror or err}"
            ) from None
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        logging.getLogger("aiohttp.server").removeFilter(self._not_http)

    async def dashboard(self, request: web.Request) -> web.Response:
        page = resources.files("atoll.coordinator").joinpath("static/dashboard.html").read_text(encoding="utf-8")
        return web.Response(text=page, content_type="text/html")

    async def healthz(self, request: web.Request) -> web.Response:
        problem = health_problem(self.server)
        if problem:
            return web.Response(status=503, text=f"unhealthy: {problem}\n")
        return web.Response(text="ok\n")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status(self, request: web.Request) -> web.Response:
        status, bad = finite_json(status_json(self.server, self.started_at))
        status["warnings"] = [f"{where} was not finite ({value}): shown as null" for where, value in bad]
        for where, value in bad:
            if where not in self._warned:  # once per figure, not at every poll of the dashboard
                self._warned.add(where)
                log.warning("/api/status: %s is not finite (%s); shown as null", where, value)
        return json_response(status)

    async def evict(self, request: web.Request) -> web.Response:
        island = request.match_info["island"]
        async with self.state.lock:
            try:
                self.state.evict(island)
            except KeyError:
                raise web.HTTPNotFound(text=f"no island {island!r} in the run\n") from None
        return json_response({"evicted": island, "round": self.state.round})

    async def set_config(self, request: web.Request) -> web.Response:
        try:
            values = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):  # RecursionError: absurdly deep nesting
            raise web.HTTPBadRequest(text="the body must be a JSON object of operational fields\n") from None
        if not isinstance(values, dict):
            raise web.HTTPBadRequest(text="the body must be a JSON object of operational fields\n")
        async with self.state.lock:
            try:
                changes = self.state.set_operational(values)
            except (ConfigMismatch, ValueError) as err:
                raise web.HTTPBadRequest(text=f"{err}\n") from None
        config = dataclasses.asdict(self.state.config)
        return json_response({"changed": changes, "operational": {k: config[k] for k in OPERATIONAL_FIELDS}})


def status_json(server, started_at: float) -> dict:
    s = server.state
    states = s.states()
    relayed = behind.states(s)
    now = s.clock()
    islands = []
    for island, state in states.items():
        rec = s.membership.islands.get(island)
        row = {"island": island, "state": state, "committed_this_round": island in s.accumulator.committed}
        g = rec.goodput if rec is not None else s.membership.left_goodput(island)  # (one that left: still shown)
        if g is not None:
            row.update(
                goodput=g.ratio(now),
                joined_seconds=g.wall(now),
                compute_seconds_into_theta=g.compute_into_theta,
                blocked_seconds=g.blocked_seconds,
                tokens_into_theta=g.tokens_into_theta,
            )
        if rec is not None:
            row.update(
                num_ranks=rec.num_ranks,
                joined_round=rec.joined_round,
                rounds_committed=rec.rounds_committed,
                holds_round=rec.holds_round,
                last_push_age_seconds=None if rec.last_push_at is None else now - rec.last_push_at,
            )
            if rec.relay:
                row.update(relay=True, behind=behind.rows(s, island, rec, now, relayed))
        else:  # left or evicted: what it did is still the run's history (its folded deltas too)
            row.update(rounds_committed=sum(island in (h.tokens_by_island or h.islands) for h in s.history))
        islands.append(row)
    return {
        "run": dataclasses.asdict(s.config),
        "round": s.round,
        "bootstrapped": s.model.ready,
        "run_complete": s.run_complete,
        "num_params": sum(t.numel() for t in s.model.params.values()) if s.model.ready else 0,
        "goodput": run_goodput(s.membership.goodput(), now),
        "healthy": health_problem(server) is None,
        "problem": health_problem(server),
        "stall": s.stall,
        "waiting": s.waiting,
        "islands": islands,
        "counters": server.counters.as_dict(),
        "inflight_bytes": s.accumulator.budget.used,
        "inflight_peak_bytes": s.accumulator.budget.peak,
        "inflight_budget_bytes": s.accumulator.budget.limit,
        "pull_bytes": s.downlink.budget.used,
        "pull_budget_bytes": s.downlink.budget.limit,
        "memory": held_bytes(s.model, s.accumulator, s.downlink),
        "lease": s.store.lease_timing(),
        "history": [h.to_json() for h in s.history[-RECENT_ROUNDS:]],
        "uptime_seconds": time.time() - started_at,
        "torch_threads": torch.get_num_threads(),
        "tensor_workers": s.model.workers.count,
    }
