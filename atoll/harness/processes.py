"""Start, follow and reliably stop the processes of a local run.

``ProcessGroup`` is a context manager: every process started through it is killed on exit,
also when the body raises, so tests never leak processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGKILL this child when the process that started it dies, however it dies. And SIGINT back
    to its default: a harness run as a background job of a non-interactive shell inherits it ignored,
    and its children then ignore Ctrl-C (found when the test of Ctrl-C failed only there)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


class ManagedProcess:
    """A child process whose stdout lines are parsed as JSON events and whose stderr goes to a log."""

    def __init__(
        self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = Path(log_dir) / f"{name}.log"
        self.events: queue.Queue[dict] = queue.Queue()
        self.lines: list[str] = []
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in _release()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    self.events.put(json.loads(line))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def next_event(self, timeout: float) -> dict | None:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def wait(self, timeout: float | None = None) -> int:
        rc = self.proc.wait(timeout)
        self._release()
        return rc

    def _release(self) -> None:
        """Close what this object owns once the child is gone: the reader ends at the pipe's EOF, then the
        pipe and the log are closed (left open, the garbage collector closes them with a ResourceWarning)."""
        self._reader.join(timeout=5)
        if not self._reader.is_alive():  # a grandchild still holding the pipe: leave it to the reader
            self.proc.stdout.close()
        self._log.close()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the process (and its process group) and reap it."""
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._release()

    def stop(self, grace_seconds: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace_seconds``."""
        self.signal(signal.SIGTERM)
        try:
            return self.wait(grace_seconds)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    def log_tail(self, num_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-num_bytes:].decode(errors="replace")


class ProcessGroup:
    """Starts the coordinator and islands of a local run; kills whatever is left on exit."""

    def __init__(self, work_dir: Path, *, python: str = sys.executable) -> None:
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.python = python
        self.processes: list[ManagedProcess] = []

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.kill_all()

    def kill_all(self) -> None:
        for p in self.processes:
            p.kill()

    def start(
        self,
        name: str,
        args: list[str],
        env: dict[str, str] | None = None,
        *,
        faults: str = "",
        cwd: Path | None = None,
        module: str = "atoll",
    ) -> ManagedProcess:
        """``python -m atoll ARGS`` (in ``cwd``, or this process's); with island-side ``faults`` (JSON,
        :mod:`atoll.harness.faults`) the island runs under the harness's entry point, which injects them.
        ``module``: another one to run (``atoll.harness.seaweed``). Its temporary files go under the
        group's work dir (``TMPDIR``, unless ``env`` names one): the group SIGKILLs its processes at its
        end, and what they could not remove (a relay's state dir) stays with the run, not in /tmp."""
        entry = ["atoll.harness.island", "--faults", faults] if faults else [module]
        tmp = self.work_dir / "tmp"
        tmp.mkdir(exist_ok=True)
        env = {"TMPDIR": str(tmp), **(env or {})}
        proc = ManagedProcess(name, [self.python, "-m", *entry, *args], self.work_dir, env, cwd)
        self.processes.append(proc)
        return proc

    def start_standby(
        self,
        state_dir: str,
        flags: list[str],
        *,
        port: int,
        name: str = "standby",
        env: dict[str, str] | None = None,
    ) -> ManagedProcess:
        """Start ``atoll coordinator --standby`` on a run in an object store: it follows the run, and
        serves on ``port`` once it takes the run over (it reports no port before)."""
        args = ["coordinator", "--standby", "--host", "127.0.0.1", "--port", str(port), "--state-dir", str(state_dir)]
        return self.start(name, [*args, *flags], env)

    def start_coordinator(
        self,
        state_dir: Path,
        flags: list[str],
        *,
        name: str = "coordinator",
        port: int = 0,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> tuple[ManagedProcess, str]:
        """Start ``atoll coordinator`` and wait until it reports its port; returns (process, address).

        With ``--fragments P`` in ``flags`` the address lists the P fragments' addresses, comma-separated."""
        port_file = self.work_dir / f"{name}.port"
        port_file.unlink(missing_ok=True)
        proc = self.start(
            name,
            [
                "coordinator",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--state-dir",
                str(state_dir),
                "--port-file",
                str(port_file),
                *flags,
            ],
            env,
        )
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"coordinator exited with {proc.poll()}:\n{proc.log_tail()}")
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"coordinator did not report a port in {timeout}s:\n{proc.log_tail()}")
            time.sleep(0.05)
        ports = [int(x) for x in port_file.read_text().strip().split(",")]  # several with --fragments
        return proc, ",".join(f"127.0.0.1:{port}" for port in ports)
