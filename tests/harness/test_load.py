"""32 simulated islands pushing concurrently: every round completes with all of them, memory stays bounded."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.load import run  # noqa: E402


def test_32_concurrent_islands(tmp_path):
    res = run(islands=32, numel=1 << 16, rounds=3, work=tmp_path)
    assert res["rounds_completed"] == 3 and res["islands_per_round"] == [32, 32, 32]
    growth = (res["peak_kib"] - res["rss_before_kib"]) * 1024
    # Bounded by what one round of pushes can hold at once (payloads staged encoded, plus gRPC's
    # buffers), not by the number of rounds: measured ~3.5x one round's payloads.
    assert growth < 6 * 32 * res["payload"] + 64 * 2**20, growth


def test_bulk_buffer_malloc_tuning_applies_and_can_be_switched_off():
    import os
    import subprocess

    code = "from atoll.memory import tune_for_bulk_buffers as t; print(t())"
    env = dict(os.environ)
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    env["ATOLL_MALLOC_TUNING"] = "0"
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert (on.stdout.strip(), off.stdout.strip()) == ("True", "False")


_ARENAS_PROBE = """
import threading
from atoll.memory import tune_for_bulk_buffers
print(tune_for_bulk_buffers(huge_pages=False))

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

turn = [threading.Event() for _ in range(9)]
turn[0].set()

def take(i):  # 16 chunks of 1 MiB held at once and freed, one thread after another, all alive together
    turn[i].wait()
    chunks = [bytearray(1 << 20) for _ in range(16)]
    del chunks
    turn[i + 1].set()
    turn[8].wait()

before = rss()
threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(rss() - before)
"""


def test_the_daemons_allocator_keeps_freed_chunks_in_at_most_two_arenas():
    """The daemon keeps freed payload chunks for reuse (no trim below 256 MiB), in glibc's arenas. Eight
    threads that each take and free 16 MiB of 1 MiB chunks, while all are alive, kept 8 x 16 MiB with
    glibc's arenas (one a thread, up to 8 a core); tuned, they share two."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "ATOLL_MALLOC_TUNING"}
    run = subprocess.run([sys.executable, "-c", _ARENAS_PROBE], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    tuned, grown = run.stdout.split()
    if tuned != "True":
        import pytest

        pytest.skip("no glibc mallopt here")
    assert int(grown) <= 2 * 16 * 2**20 + 8 * 2**20, f"eight threads kept {int(grown) / 2**20:.0f} MiB of freed chunks"
    env["ATOLL_MALLOC_ARENAS"] = "0"  # glibc's own arenas: one a thread here
    run = subprocess.run([sys.executable, "-c", _ARENAS_PROBE], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout.split()[1]) >= 6 * 16 * 2**20, run.stdout


_HUGE_PAGES_PROBE = """
import importlib, pkgutil, sys
import atoll
for m in pkgutil.walk_packages(atoll.__path__, "atoll."):  # every module: none may allocate a tensor
    if m.name not in ("atoll.__main__",):
        importlib.import_module(m.name)
from atoll.memory import tune_for_bulk_buffers
tune_for_bulk_buffers()
import torch

def huge_kib():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])

before = huge_kib()
x = torch.ones(16 << 20)  # 64 MiB, first-touched
print(huge_kib() - before)
"""


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def test_bulk_buffers_get_huge_pages_after_importing_all_of_atoll():
    """The huge-page switch only works if no tensor was allocated before it: importing every atoll
    module first proves none does. Under THP "madvise" the switch is what makes the difference."""
    import os
    import subprocess

    import pytest

    mode = _thp_mode()
    if mode not in ("madvise", "always") or not Path("/proc/self/smaps_rollup").exists():
        pytest.skip(f"transparent huge pages unavailable here ({mode})")
    env = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "ATOLL_MALLOC_TUNING")}

    def probe(**extra) -> int:
        run = subprocess.run(
            [sys.executable, "-c", _HUGE_PAGES_PROBE], env={**env, **extra}, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        return int(run.stdout.strip().splitlines()[-1])

    assert probe() >= 32 << 10  # KiB: at least half of the 64 MiB tensor on 2 MiB pages
    if mode == "madvise":
        assert probe(ATOLL_MALLOC_TUNING="0") == 0
        assert probe(THP_MEM_ALLOC_ENABLE="0") == 0
