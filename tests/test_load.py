"""32 simulated islands pushing concurrently: every round completes with all of them, memory stays bounded."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
