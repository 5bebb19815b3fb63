"""What the sum's fixed order costs: a sync round's tail after its last push, pushes arriving in the
fixed order (none held) against the reverse order (the most held), side by side in one run.

    python benchmarks/sum_order.py [--model gpt-125m] [--islands 3] [--codec int8] [--repeat 3] [--threads 1]

The coordinator's core (:class:`~atoll.coordinator.run.run_state.RunState`, in this process, no
sockets) with ``--islands`` one-rank islands whose pushes of ``--codec`` payloads (random deltas)
commit one after the other; then the round closes (outer step, its record written, published).
Timed: the round's last push's commit, and from its start to the end of the close: the part of
an exchange that follows the last push. In the fixed order each push is decoded into the sum as it
commits; in the reverse order all but the first two wait for the ones that sort ahead of them, and
are decoded after the last push (:mod:`atoll.coordinator.policy.order`). Also checked: θ_{r+1} has
the same bits in both orders, and the rounds' records say ``sum_order: fixed``.

Alternating orders, each leading in turn, a fresh core each run (its state dir in a temporary directory), the median of
``--repeat`` runs each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import MODEL_VOCAB, model_theta  # (and the repository on the path)

from atoll.compression import get_codec
from atoll.coordinator.config import RunConfig
from atoll.coordinator.messages import Entry, JoinRequest, PullRequest, PushHeader, TensorDecl
from atoll.coordinator.policy.rounds import Decision, decide
from atoll.coordinator.run.decider import view
from atoll.coordinator.run.run_state import RunState
from atoll.coordinator.state.plans import Received
from atoll.memory import tune_for_bulk_buffers
from atoll.protos.vocabulary import PushKind


async def push(s: RunState, island: str, payloads: dict, kind: PushKind, spec: str, tokens: int = 1):
    entries = tuple(Entry(n, (), (), len(p)) for n, p in payloads.items())
    header = PushHeader(run_id="b", island_id=island, session_id=island, round=0, kind=kind, codec=spec,
                        entries=entries, tokens=tokens)  # fmt: skip
    plan = await s.plan_push(header)
    reservation = s.open_stream(plan)
    try:
        received = Received()
        views = [memoryview(p) for p in payloads.values()]
        received.add(views, [s.check_entry(plan, i, v) for i, v in enumerate(views)])
        got = await s.commit_push(plan, received, reservation)
    finally:
        s.close_stream(plan)
    if not got.committed:
        raise RuntimeError(f"{island}'s push did not commit: {got}")


def one_round(
    work: Path, theta0: dict, pushes: dict, arrival: list[str], spec: str
) -> tuple[tuple[float, float], dict, str]:
    """Seconds of the last push's commit, and from its start to the round's close; θ_1; the record's
    sum_order."""
    config = RunConfig(run_id="b", codec=spec, downlink_codec="int8", sync_every=1, outer_lr=0.7,
                       outer_momentum=0.9, grace_window="off")  # fmt: skip
    s = RunState(config, work / "state")
    decls = tuple(TensorDecl(n, tuple(t.shape), torch.float32) for n, t in theta0.items())
    for island in sorted(pushes):
        s.join(JoinRequest(run_id="b", island_id=island, session_id=island, codecs=(spec,), tensors=decls))
    ident = get_codec("identity")
    first = sorted(pushes)[0]
    asyncio.run(push(s, first, {n: ident.encode(t) for n, t in theta0.items()}, PushKind.INIT, "identity"))
    for island in sorted(pushes):
        asyncio.run(s.pull(PullRequest(run_id="b", island_id=island, session_id=island, have_round=-1)))

    async def rest() -> tuple[float, float]:
        for island in arrival[:-1]:
            await push(s, island, pushes[island], PushKind.DELTA, spec, tokens=10 + ord(island[-1]))
        began = time.perf_counter()
        await push(s, arrival[-1], pushes[arrival[-1]], PushKind.DELTA, spec, tokens=10 + ord(arrival[-1][-1]))
        committed = time.perf_counter()
        decision, reason = decide(s.clock(), view(s), s.policy())
        if decision is not Decision.CLOSE:
            raise RuntimeError(f"the round did not close: {reason}")
        await s.close_round(reason)
        return committed - began, time.perf_counter() - began

    seconds = asyncio.run(rest())
    s.writer.wait()
    theta = {n: t.clone() for n, t in s.model.params.items()}
    order = s.history[-1].to_json().get("sum_order")
    s.writer.close()
    return seconds, theta, order


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-125m", choices=sorted(MODEL_VOCAB))
    p.add_argument("--islands", type=int, default=3)
    p.add_argument("--codec", default="int8")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the daemon's --threads)")
    a = p.parse_args()
    tune_for_bulk_buffers()
    torch.set_num_threads(a.threads)
    theta0 = model_theta(a.model)
    numel = sum(t.numel() for t in theta0.values())
    codec = get_codec(a.codec)
    islands = [f"island-{i}" for i in range(a.islands)]
    gen = torch.Generator().manual_seed(1)
    pushes = {
        i: {n: codec.encode((torch.randn(t.shape, generator=gen) * 1e-3).contiguous()) for n, t in theta0.items()}
        for i in islands
    }
    print(f"{a.model}: {numel:,} parameters, {a.islands} islands, {a.codec} pushes, "
          f"{torch.get_num_threads()} torch thread(s)", flush=True)  # fmt: skip
    times: dict[str, list[tuple[float, float]]] = {"fixed": [], "reverse": []}
    thetas, orders = {}, set()
    with tempfile.TemporaryDirectory(prefix="atoll-sum-order-") as tmp:
        for r in range(a.repeat):
            pair = [("fixed", islands), ("reverse", islands[::-1])]
            for name, arrival in pair if r % 2 == 0 else pair[::-1]:  # each leads in turn
                seconds, theta, order = one_round(Path(tmp) / f"{name}{r}", theta0, pushes, arrival, a.codec)
                times[name].append(seconds)
                thetas.setdefault(name, theta)
                orders.add(order)
                print(f"  {name:7} order: the last push's commit {seconds[0]:.3f} s, with the close {seconds[1]:.3f} s",
                      flush=True)  # fmt: skip
    same = all(torch.equal(thetas["fixed"][n], thetas["reverse"][n]) for n in theta0)
    held = max(a.islands - 2, 1)
    for i, what in enumerate(("the last push's commit", "the last push's commit and the close")):
        fixed = statistics.median(t[i] for t in times["fixed"])
        reverse = statistics.median(t[i] for t in times["reverse"])
        print(f"{what}: fixed order {fixed:.3f} s, reverse {reverse:.3f} s: {reverse - fixed:+.3f} s "
              f"({(reverse - fixed) / held / numel * 1e9:+.2f} ns/param per held push)")  # fmt: skip
    print(f"θ_1 bitwise the same in both orders: {same}; the records' sum_order: {sorted(orders)}")


if __name__ == "__main__":
    main()
