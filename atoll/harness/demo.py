"""``atoll demo``: a coordinator and K islands as separate processes on loopback."""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from atoll.harness.processes import ProcessGroup


@dataclass(frozen=True, kw_only=True)
class DemoArgs:
    islands: int = 2
    """Number of island processes."""
    rounds: int = 6
    """Outer rounds to run."""
    sync_every: int = 30
    """H: inner steps per round."""
    codec: str = "int8"
    """Uplink codec spec, e.g. "identity" or "topk:fraction=0.01"."""
    error_feedback: bool = False
    """Islands carry the lossy codec's error into the next round."""
    error_feedback_decay: float | None = None
    """β: error feedback sends C(Δ + β·residual) (1: classic; not given: the coordinator's default for
    the codec, 0.9 for sparse and 1 for the rest)."""
    downlink_codec: str = "auto"
    """Codec of the outer update the coordinator sends back (auto: the coordinator's rule for the
    uplink codec: sparse for sparse, else int8)."""
    overlap_steps: int = 0
    """Islands keep training while the exchange is in flight and apply it this many steps later."""
    outer_mode: str = "sync"
    """sync, or decoupled: islands never wait for the outer step (see atoll coordinator --outer-mode)."""
    fragments: int = 0
    """Streaming DiLoCo: P fragments on staggered schedules (0: every tensor syncs at once)."""
    outer_lr: float = 1.0
    """Outer learning rate. The demo's few outer steps do better at 1.0 / Nesterov 0.5 than at the
    coordinator's long-run defaults 0.7 / 0.9 (identity over 6 rounds: 2.622 vs 2.698)."""
    outer_momentum: float = 0.5
    """Outer Nesterov momentum (see outer_lr)."""
    inner_lr: float = 3e-3
    """AdamW learning rate of the islands' inner steps."""
    batch_size: int = 16
    """Sequences per inner step on each island."""
    work_dir: str = ""
    """Where logs and coordinator state go (default: a temporary directory)."""
    timeout_seconds: float = 900.0
    """Give up (and fail) if the run takes longer than this."""

    def __post_init__(self) -> None:
        if self.islands < 1 or self.rounds < 1 or self.sync_every < 1:
            raise ValueError("islands, rounds and sync_every must be >= 1")
        if not 0 <= self.overlap_steps < self.sync_every:
            raise ValueError(f"overlap_steps must be in [0, sync_every), got {self.overlap_steps}")
        if self.outer_mode not in ("sync", "decoupled"):
            raise ValueError(f"outer_mode must be sync or decoupled, got {self.outer_mode!r}")
        if self.fragments < 0:
            raise ValueError(f"fragments must be >= 0, got {self.fragments}")


def run_island_group(args: DemoArgs, work: Path, *, progress: bool) -> tuple[list[dict], list[int]]:
    """Run the demo's processes; return the islands' events and exit codes."""
    events: list[dict] = []
    decay = [] if args.error_feedback_decay is None else ["--error-feedback-decay", str(args.error_feedback_decay)]
    with ProcessGroup(work) as group:
        coord, address = group.start_coordinator(
            work / "state",
            [
                "--run-id",
                "demo",
                "--sync-every",
                str(args.sync_every),
                "--codec",
                args.codec,
                "--downlink-codec",
                args.downlink_codec,
                "--fragments",
                str(args.fragments),
                "--outer-lr",
                str(args.outer_lr),
                "--outer-momentum",
                str(args.outer_momentum),
                "--error-feedback" if args.error_feedback else "--no-error-feedback",
                *decay,
                "--outer-mode",
                args.outer_mode,
                "--quorum",
                str(args.islands),
                "--round-deadline-seconds",
                "300",
                "--lease-seconds",
                "60",
                "--threads",
                "1",  # it shares the machine's cores with the islands (one thread each)
            ],
        )
        islands = [
            group.start(
                f"island-{i}",
                [
                    "island",
                    "--coordinator",
                    address,
                    "--island-id",
                    f"island-{i}",
                    "--run-id",
                    "demo",
                    "--rounds",
                    str(args.rounds),
                    "--codec",
                    args.codec,
                    "--inner-lr",
                    str(args.inner_lr),
                    "--batch-size",
                    str(args.batch_size),
                    "--overlap-steps",
                    str(args.overlap_steps),
                    "--streaming" if args.fragments else "--no-streaming",
                ],
            )
            for i in range(args.islands)
        ]
        bar = tqdm(total=args.rounds, desc="outer rounds", unit="round", disable=not progress, file=sys.stderr)
        done_rounds: dict[int, int] = {}
        deadline = time.monotonic() + args.timeout_seconds
        running = set(range(len(islands)))
        while running:
            if time.monotonic() > deadline:
                raise TimeoutError(f"demo did not finish in {args.timeout_seconds}s; logs in {work}")
            for i in list(running):
                ev = islands[i].next_event(timeout=0.05)
                if ev is not None:
                    events.append(ev)
                    if ev["event"] == "round":
                        done_rounds[ev["round"]] = done_rounds.get(ev["round"], 0) + 1
                        if done_rounds[ev["round"]] == len(islands):
                            bar.update(1)
                            bar.set_postfix(loss=f"{ev['global_loss']:.3f}")
                elif islands[i].poll() is not None and islands[i].events.empty():
                    running.discard(i)
        bar.close()
        codes = [p.wait() for p in islands]
        coord.stop()
    return events, codes


def run_demo(args: DemoArgs) -> int:
    with tempfile.TemporaryDirectory(prefix="atoll-demo-") as tmp:
        work = Path(args.work_dir or tmp)
        print(
            f"atoll demo: 1 coordinator + {args.islands} islands on loopback, {args.rounds} rounds of "
            f"H={args.sync_every} inner steps, codec {args.codec}",
            flush=True,
        )
        events, codes = run_island_group(args, work, progress=True)
        bad = [i for i, rc in enumerate(codes) if rc != 0]
        if bad:
            for i in bad:
                print(f"island-{i} failed with exit code {codes[i]}; log: {work / f'island-{i}.log'}")
                print((work / f"island-{i}.log").read_text()[-3000:])
            return 1
        return _report(args, events)


def _report(args: DemoArgs, events: list[dict]) -> int:
    joined = [e for e in events if e["event"] == "joined"]
    rounds = sorted({e["round"] for e in events if e["event"] == "round"})
    print(f"\n{'round':>5} {'train loss':>10} {'eval loss':>9} {'bytes sent':>12} {'bytes recv':>12}  θ identical")
    start = sum(e["eval_loss"] for e in joined) / len(joined)
    print(f"{'start':>5} {'':>10} {start:9.4f} {'':>12} {'':>12}")
    total_sent = 0
    final = start
    for r in rounds:
        evs = [e for e in events if e["event"] == "round" and e["round"] == r]
        sent = sum(e["bytes_sent"] for e in evs)
        recv = sum(e["bytes_received"] for e in evs)
        total_sent += sent
        final = sum(e["eval_loss"] for e in evs) / len(evs)
        same = len({e["digest"] for e in evs}) == 1
        print(f"{r:>5} {evs[0]['global_loss']:10.4f} {final:9.4f} {sent:12,d} {recv:12,d}  {'yes' if same else 'NO'}")
    print(f"\neval loss {start:.4f} -> {final:.4f}; {total_sent:,d} bytes pushed by all islands")
    if not final < start:
        print("FAILED: the loss did not decrease")
        return 1
    return 0
