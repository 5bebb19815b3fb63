"""Real processes: the flags of a coordinator and of islands, their JSON events gathered, and a module
run to its end with its own peak memory."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

IDENTITY_FLAGS = ["--codec", "identity", "--downlink-codec", "identity"]
"""``atoll coordinator`` flags of the tests' exact fp32 runs."""


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
