"""What keeping the coordinator's state in an object store costs (issue 36), side by side with the local disk.

    python benchmarks/object_store.py [--model gpt-125m] [--repeat 5] [--pin]

A SeaweedFS server on loopback (atoll.harness.seaweed, the tests' server). For the model's int8 outer
update (the round's log record, exactly what the coordinator writes before it publishes):

- the round made durable on the local disk (``wal.append``: written, fsynced) against the same plus
  its create-only PUT to the store (``Mirror.put_record``), interleaved ``--repeat`` times; the
  ratio is the cost on the critical path of every round;
- the same inside a round, as the coordinator does it: the outer step (``GlobalModel.step``, int8
  downlink) makes the update while its record is streamed to the local disk, alone, or also to the
  store (a multipart upload as the payloads come, :mod:`atoll.coordinator.disk.upload`: what the
  coordinator does with a store that is not on loopback), or put to the store whole after the step
  (what it does with one on loopback, as this benchmark's), then the round is made durable
  (``StateWriter.log_round``); beside it the step with no record at all. ``--pin`` puts the store's
  server on the second core and this process on the first (one torch thread): a store whose work
  does not take the step's cores, as a remote one's would not. Per way: the
  seconds from the step's end to durable, and what the record costs over the step alone; their ratio
  (store / disk) is the cost on the critical path of every round;
- a replacement coordinator's start: the state pulled from the store into an empty working dir
  (a snapshot of θ with momentum, and the log after it) and restored, against a restore from a
  local dir that already holds it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (the repository and benchmarks/ on the path: benchmarks/common.py)
import torch

from atoll.compression import get_codec
from atoll.coordinator.config import RunConfig
from atoll.coordinator.disk import snapshots, wal
from atoll.coordinator.disk.mirror import Mirror
from atoll.coordinator.disk.store import ObjectState
from atoll.coordinator.disk.writer import StateWriter
from atoll.coordinator.state.model import GlobalModel
from atoll.harness.seaweed import SeaweedS3
from atoll.memory import tune_for_bulk_buffers
from atoll.models import TinyGPT, preset
from atoll.objects import ObjectStore, close_client


def model_theta(name: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    tiny = name == "tiny"
    model = TinyGPT(preset(name, vocab_size=256 if tiny else 50257, block_size=64 if tiny else 1024))
    return {k: v.detach().float().contiguous() for k, v in model.state_dict().items() if v.is_floating_point()}


def in_the_round(theta: dict[str, torch.Tensor], config: RunConfig, store: ObjectStore, tmp: Path, repeat: int) -> None:
    """The outer step with its record streamed to the disk, or to the disk and the store, or not at all
    (interleaved, ``repeat`` rounds each after a warm-up); see the module's docstring."""
    model = GlobalModel(config)
    model.define({k: tuple(v.shape) for k, v in theta.items()}, frozenset(), None)
    model.install(theta)
    gen = torch.Generator().manual_seed(1)
    base = {k: torch.randn(v.shape, generator=gen) * 1e-3 for k, v in theta.items()}
    writers = {"none": None, "disk": StateWriter(tmp / "round-disk", every=10**6, keep=1)}
    for way, name, streams in (("store, streamed", "streamed", True), ("store, after the step", "after", False)):
        beside = ObjectStore(store.bucket, f"round-{name}")  # (not under the run's prefix)
        kept = ObjectState(beside)
        kept.mirror = Mirror(beside, tmp / f"round-{name}")
        kept.mirror.streams = streams
        writers[way] = StateWriter(tmp / f"round-{name}", every=10**6, keep=1, store=kept)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in writers}
    for r in range(repeat + 1):
        for way in list(writers) if r % 2 == 0 else list(reversed(writers)):
            sums, w = {k: v.clone() for k, v in base.items()}, writers[way]
            started = time.perf_counter()
            if w is None:
                model.step(sums, 1.0, None, lambda name, payload: None)
                stepped = time.perf_counter()
            else:
                hint = wal.head_hint(model.update_sizes(), lambda: {}, [{"round": r}])
                with w.streaming(r, lambda name, payload: None, hint) as made:
                    _, payloads = model.step(sums, 1.0, None, made)
                stepped = time.perf_counter()
                w.log_round(r, payloads, {"round": r}, {}, config)
            if r:  # (round 0: the warm-up)
                times[way].append((stepped - started, time.perf_counter() - stepped))
    alone = statistics.median(s for s, _ in times["none"])
    cost = {}
    for way in ("disk", "store, streamed", "store, after the step"):
        after = statistics.median(a for _, a in times[way])
        cost[way] = statistics.median(s + a for s, a in times[way]) - alone
        step = statistics.median(s for s, _ in times[way])
        print(
            f"in the round, record to the {way}: step {step * 1e3:.0f} ms (alone {alone * 1e3:.0f} ms), then "
            f"durable in {after * 1e3:.0f} ms; over the step alone {cost[way] * 1e3:.0f} ms"
        )
    for way in ("store, streamed", "store, after the step"):
        ratio = cost[way] / cost["disk"]
        print(f"in the round, {way}: the store's cost on the critical path {ratio:.2f}x the disk's (goal <= 1.5x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--model", default="gpt-125m")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--pin", action="store_true", help="the store's server on CPU 1, this process on CPU 0")
    args = p.parse_args()
    tune_for_bulk_buffers()  # as the daemon does
    if args.pin:
        os.sched_setaffinity(0, {0})  # (before any thread of this process starts)
        torch.set_num_threads(1)
    theta = model_theta(args.model)
    numel = sum(v.numel() for v in theta.values())
    codec = get_codec("int8")
    update = {k: codec.encode(v * 1e-3) for k, v in theta.items()}
    record_bytes = sum(len(u) for u in update.values())
    config = RunConfig(run_id="bench", codec="int8")
    print(f"model {args.model}: {numel:,} values; the round's record {record_bytes / 1e6:.1f} MB (int8)")
    with tempfile.TemporaryDirectory(prefix="atoll-s3-bench-") as tmp:
        tmp = Path(tmp)
        server = SeaweedS3(tmp / "seaweed").start()
        if args.pin:  # every thread of the server, and those it starts later
            subprocess.run(["taskset", "-a", "-p", "2", str(server.proc.pid)], check=True, capture_output=True)
        try:
            os.environ.update(server.env())
            server.make_bucket("bench")
            store = ObjectStore.from_url("s3://bench/run")
            local_dir, mirrored_dir = tmp / "local", tmp / "mirrored"
            mirror = Mirror(store, mirrored_dir)
            local_t, store_t = [], []
            for r in range(args.repeat):
                started = time.perf_counter()
                wal.append(local_dir, r, update, {"round": r}, {}, config)
                local_t.append(time.perf_counter() - started)
                started = time.perf_counter()
                wal.append(mirrored_dir, r, update, {"round": r}, {}, config)
                mirror.put_record(mirrored_dir / wal.LOG / wal.record_name(r))
                store_t.append(time.perf_counter() - started)
            lm, sm = statistics.median(local_t), statistics.median(store_t)
            print(
                f"round durable: local disk {lm * 1e3:.0f} ms, local + PUT to the store {sm * 1e3:.0f} ms: "
                f"{sm / lm:.2f}x (goal <= 1.5x); each pair: "
                + ", ".join(f"{s / lo:.2f}x" for lo, s in zip(local_t, store_t, strict=True))
            )
            in_the_round(theta, config, store, tmp, args.repeat)
            # A snapshot of θ with momentum, then a replacement's start from the store.
            snap = snapshots.Snapshot(
                params={k: v.clone() for k, v in theta.items()},
                extra={f"momentum/{k}": torch.zeros_like(v) for k, v in theta.items()},
                round=args.repeat,
                config=config,
                history=[{"round": r} for r in range(args.repeat)],
                islands={},
            )
            snapshots.save(mirrored_dir, snap, keep=None)
            mirror.sync()
            started = time.perf_counter()
            snapshots.load(mirrored_dir)
            local_restore = time.perf_counter() - started
            fresh = tmp / "replacement"
            started = time.perf_counter()
            got = Mirror(store, fresh).pull()
            pulled = time.perf_counter() - started
            restored = snapshots.load(fresh)
            total = time.perf_counter() - started
            assert all(torch.equal(restored.params[k], theta[k]) for k in theta)
            print(
                f"replacement start: {got / 1e6:.0f} MB pulled in {pulled:.2f} s, restored in {total - pulled:.2f} s "
                f"({total:.2f} s in all; a restore from a local dir holding it: {local_restore:.2f} s)"
            )
        finally:
            close_client()
            server.stop()


if __name__ == "__main__":
    main()
