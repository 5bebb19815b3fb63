"""A RunState driven by hand in the test's process: a run of two tensors, islands joining, pushing
and pulling by direct calls, a clock the test moves (no sockets)."""

from __future__ import annotations

import asyncio

import torch

from atoll.compression import get_codec
from atoll.coordinator.config import RunConfig
from atoll.coordinator.messages import Entry, JoinRequest, PullRequest, PushHeader, PushResult, TensorDecl
from atoll.coordinator.run.run_state import RunState
from atoll.coordinator.state.plans import Received
from atoll.protos.vocabulary import PushKind
from support.servers import FakeClock

SHAPES = {"w": (3, 2), "b": (4,)}


IDENT = get_codec("identity")


def run_state(tmp_path, clock=None, **config) -> RunState:
    config.setdefault("sync_every", 1)
    config = {"codec": "identity", "downlink_codec": "identity", **config}  # exact fp32 arithmetic
    return RunState(RunConfig(run_id="t", **config), tmp_path / "state", clock=clock or FakeClock())


def join(s: RunState, island: str):
    decls = tuple(TensorDecl(n, shape, torch.float32) for n, shape in SHAPES.items())
    return s.join(JoinRequest(run_id="t", island_id=island, session_id=island, codecs=("identity",), tensors=decls))


async def push(s: RunState, island: str, tensors: dict, round_: int = 0, kind=PushKind.DELTA, tokens: int = 1, **more):
    payloads = [IDENT.encode(tensors[n].contiguous()) for n in SHAPES]
    entries = tuple(Entry(n, (), (), len(p)) for n, p in zip(SHAPES, payloads, strict=True))
    header = PushHeader(
        run_id="t", island_id=island, session_id=island, round=round_, kind=kind, codec="identity",
        entries=entries, tokens=tokens, **more,
    )  # fmt: skip
    plan = await s.plan_push(header)
    if isinstance(plan, PushResult):
        return plan
    reservation = s.open_stream(plan)  # the bytes its header declares, as the service does
    try:
        received = Received()
        views = [memoryview(p) for p in payloads]
        received.add(views, [s.check_entry(plan, i, v) for i, v in enumerate(views)])
        return await s.commit_push(plan, received, reservation)
    finally:
        s.close_stream(plan)


def pull(s: RunState, island: str, have: int):
    return asyncio.run(s.pull(PullRequest(run_id="t", island_id=island, session_id=island, have_round=have)))


def rand(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g) for n, shape in SHAPES.items()}
