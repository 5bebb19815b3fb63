"""Faults as a schedule keyed by (island, round), injected from outside the product by wrapping the real
components.

Island-side kinds run inside the island process, started as ``python -m atoll.harness.island --faults
JSON island ...`` (the reference island with :class:`IslandFaults` as its hooks):

- ``slow``: each inner step takes ``factor`` times as long, for ``rounds`` rounds from ``round``;
- ``stall``: sleep ``seconds`` before the first step of the first round at or after ``round`` (once:
  a decoupled island may skip round numbers; compute stall, heartbeats go on);
- ``kill_mid_push``: the process dies (exit 137) after sending half of that round's push;
- ``exit``: the process dies at the start of the round.

Harness-side kinds are carried out by :class:`ChaosDriver` when the island reports the round:
``kill`` (SIGKILL the island), ``cut`` (cut its network for ``seconds``), ``kill_coordinator``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass

import grpc

from atoll.islands import Transport, WireTransport
from atoll.islands._messages import Identity, PushHeader
from atoll.islands._transport.seam import wire_header
from atoll.islands._transport.transfer import write_push
from atoll.protos.vocabulary import PushKind, PushOutcome
from atoll.workload.hooks import IslandHooks

ISLAND_KINDS = ("slow", "stall", "kill_mid_push", "exit")
HARNESS_KINDS = ("kill", "cut", "kill_coordinator")
KILLED = 137
"""The exit status of an island a fault kills (as a SIGKILL's)."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    island: str
    round: int
    kind: str
    seconds: float = 0.0
    factor: float = 1.0
    rounds: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ISLAND_KINDS + HARNESS_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; known: {ISLAND_KINDS + HARNESS_KINDS}")
        if self.round < 0 or self.seconds < 0 or self.factor < 1 or self.rounds < 1:
            raise ValueError(f"bad fault {self}")


def island_faults_json(faults: list[Fault], island: str) -> str:
    return json.dumps([asdict(f) for f in faults if f.island == island and f.kind in ISLAND_KINDS])


class IslandFaults(IslandHooks):
    """The island-side faults of one island, as hooks of the reference island's loop."""

    module = "atoll.harness.island"

    def __init__(self, spec: str = "") -> None:
        self.spec = spec
        self.faults = [Fault(**f) for f in json.loads(spec)] if spec else []
        self._stalled: set[int] = set()

    def relaunch_argv(self) -> list[str]:
        return ["--faults", self.spec]

    def _active(self, kind: str, round_: int) -> Fault | None:
        for f in self.faults:
            if f.kind == kind and f.round <= round_ < f.round + f.rounds:
                return f
        return None

    def before_round(self, round_: int, first_step: bool) -> None:
        if not first_step:
            return
        if self._active("exit", round_):
            os._exit(KILLED)
        for i, f in enumerate(self.faults):
            if f.kind == "stall" and f.round <= round_ and i not in self._stalled:
                self._stalled.add(i)
                time.sleep(f.seconds)

    def after_step(self, round_: int, step_seconds: float) -> None:
        slow = self._active("slow", round_)
        if slow:
            time.sleep((slow.factor - 1) * step_seconds)

    def transport(self, transport: Transport) -> Transport:
        kills = {f.round for f in self.faults if f.kind == "kill_mid_push"}
        return DyingTransport(transport, kills) if kills else transport


class DyingTransport:
    """The real transport, except that the process dies halfway through the delta push of chosen rounds."""

    def __init__(self, transport: WireTransport, kill_rounds: set[int]) -> None:
        self.transport = transport
        self.kill_rounds = kill_rounds

    def __getattr__(self, name):  # every other call is the real transport's
        return getattr(self.transport, name)

    def __setattr__(self, name, value) -> None:
        if name in ("transport", "kill_rounds"):
            object.__setattr__(self, name, value)
        else:  # (the link sets its cancel event on the real one)
            setattr(self.transport, name, value)

    def push(self, me: Identity, header: PushHeader, payloads) -> PushOutcome:
        if header.round not in self.kill_rounds or header.kind is not PushKind.DELTA:
            return self.transport.push(me, header, payloads)
        wire = wire_header(me, header)
        if callable(payloads):  # a streamed push: encode them all here, then die halfway through
            payloads = [payloads(i) for i in range(len(wire.entries))]
        half = sum(len(p) for p in payloads) // 2

        def pieces():
            sent = 0
            for payload in payloads:
                view = memoryview(payload).cast("B")
                for start in range(0, view.nbytes, 16384):  # small pieces: it dies close to half
                    if sent >= half:
                        time.sleep(0.2)  # let the server take in what was sent
                        os._exit(KILLED)
                    piece = view[start : start + 16384]
                    sent += piece.nbytes
                    yield piece

        client = self.transport.client
        with contextlib.suppress(grpc.RpcError):  # one attempt, which never ends: it dies halfway through
            write_push(client.open_push(wire), wire, pieces())
        os._exit(KILLED)


class ChaosDriver:
    """Watches island events and carries out the harness-side faults of a schedule."""

    def __init__(
        self,
        faults: list[Fault],
        *,
        islands: dict,
        proxies: dict | None = None,
        coordinator=None,
        restart_coordinator=None,
    ) -> None:
        self.pending = [f for f in faults if f.kind in HARNESS_KINDS]
        self.islands = islands
        self.proxies = proxies or {}
        self.coordinator = coordinator
        self.restart_coordinator = restart_coordinator
        self.done: list[tuple[Fault, float]] = []

    def on_event(self, event: dict) -> None:
        if event.get("event") != "round":
            return
        for f in list(self.pending):
            if f.island == event["island"] and event["round"] + 1 >= f.round:
                self.pending.remove(f)
                self._carry_out(f)

    def _carry_out(self, f: Fault) -> None:
        self.done.append((f, time.monotonic()))
        if f.kind == "kill":
            self.islands[f.island].signal(signal.SIGKILL)
        elif f.kind == "cut":
            self.proxies[f.island].cut(f.seconds)
        elif f.kind == "kill_coordinator":
            self.coordinator.signal(signal.SIGKILL)
            self.coordinator.wait(10)
            if self.restart_coordinator is not None:
                threading.Timer(f.seconds, self._restart).start()

    def _restart(self) -> None:
        self.coordinator = self.restart_coordinator()
