"""The harness never leaks processes, and `atoll demo` (the README's main command) works."""

import os
import signal
import subprocess
import sys

from support import wait_for

from atoll.harness import ProcessGroup


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); look at its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_group_kills_children_on_error(tmp_path):
    pids = []
    try:
        with ProcessGroup(tmp_path) as g:
            p = g.start("sleeper", ["coordinator", "--state-dir", str(tmp_path / "s")])
            pids.append(p.pid)
            raise RuntimeError("test body failed")
    except RuntimeError:
        pass
    assert not _alive(pids[0])


def test_a_stopped_or_killed_child_leaves_no_open_pipe(tmp_path):
    """Each ManagedProcess owns its stdout pipe and log file: after stop() or kill() both are closed, so
    no file is left for the garbage collector (CI once failed on a ResourceWarning for the pipe, raised
    from a finaliser in an unrelated test)."""
    with ProcessGroup(tmp_path) as g:
        stopped, _ = g.start_coordinator(str(tmp_path / "a"), [])
        killed, _ = g.start_coordinator(str(tmp_path / "b"), [])
        stopped.stop()
        killed.kill()
        for p in (stopped, killed):
            assert p.proc.stdout.closed and p._log.closed
            assert not p._reader.is_alive()


def test_children_die_with_their_parent(tmp_path):
    # A parent that starts a coordinator through the harness, then is SIGKILLed.
    script = (
        "import sys, time; from atoll.harness import ProcessGroup; "
        f"g = ProcessGroup({str(tmp_path)!r}); "
        f"p, addr = g.start_coordinator({str(tmp_path / 'state')!r}, []); "
        "print(p.pid, flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_for(lambda: not _alive(child), what="the orphaned child to die")
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()


def test_atoll_demo_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "atoll", "demo", "--rounds", "3", "--sync-every", "15", "--work-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    table = [line.split() for line in lines if line.strip()[:1].isdigit()]
    assert [row[0] for row in table] == ["0", "1", "2"]
    assert all(row[-1] == "yes" for row in table)  # θ identical on both islands
    assert all(int(row[3].replace(",", "")) > 0 for row in table)  # bytes sent
    assert "eval loss" in lines[-1]
