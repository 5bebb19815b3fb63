"""What the benchmark scripts share, through atoll's public APIs: the repository on the path, a
coordinator process started on loopback and stopped, and a raw island's Join request and push headers
(for scripts that speak the protocol with the public client).

Import it first (``import common``: the script's own folder is on the path when it runs)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT), str(ROOT / "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)


class Coordinator:
    """``atoll coordinator`` on loopback as a process, on ports it picks and reports (``--port-file``,
    and ``--admin-port-file`` with ``admin``); ``with`` stops it, even on failure."""

    def __init__(self, state_dir: Path, flags: list[str], *, admin: bool = False, log_level: str = "WARNING") -> None:
        state_dir = Path(state_dir)
        self._port_file = state_dir.parent / f"{state_dir.name}.port"
        self._admin_file = state_dir.parent / f"{state_dir.name}.admin" if admin else None
        extra = ["--admin-port", "0", "--admin-port-file", str(self._admin_file)] if admin else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "atoll", "coordinator", "--host", "127.0.0.1", "--port", "0",
             "--port-file", str(self._port_file), "--state-dir", str(state_dir), "--log-level", log_level,
             *extra, *flags],
            cwd=ROOT,
        )  # fmt: skip
        self.address = self.admin_port = None

    def __enter__(self) -> Coordinator:
        try:
            while not self._port_file.exists() or (self._admin_file is not None and not self._admin_file.exists()):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the coordinator exited with {self.proc.returncode}")
                time.sleep(0.05)
            time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        self.address = f"127.0.0.1:{self._port_file.read_text().strip()}"
        if self._admin_file is not None:
            self.admin_port = int(self._admin_file.read_text().strip())
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def join_request(run_id: str, island_id: str, shapes: dict[str, tuple[int, ...]], codecs: list[str]):
    """A one-rank island's JoinRequest declaring fp32 tensors of ``shapes``."""
    from atoll.protos import coordinator_pb2 as pb

    req = pb.JoinRequest(run_id=run_id, island_id=island_id, codecs=codecs, num_ranks=1)
    for name, shape in shapes.items():
        req.tensors.add(name=name, shape=list(shape), dtype=pb.DTYPE_FLOAT32)
    return req


def push_header(run_id: str, island_id: str, round_: int, kind, spec: str, names, payloads, tokens: int = 1):
    """A one-rank push of ``payloads`` (one per name, in order) for ``round_``."""
    from atoll.protos import coordinator_pb2 as pb

    h = pb.PushHeader(run_id=run_id, island_id=island_id, round=round_, kind=kind, num_ranks=1, tokens=tokens)
    h.codec = spec
    for name, payload in zip(names, payloads, strict=True):
        h.entries.add(name=name, num_bytes=len(payload))
    return h


MODEL_VOCAB = {"tiny": 256, "gpt-small": 8192, "gpt-125m": 50257}
"""The models the coordinator-side benchmarks take by name (``--model``), with their vocabularies."""


def model_theta(model: str) -> dict:
    """θ_0 of the tiny GPT preset ``model`` (one of :data:`MODEL_VOCAB`), seeded, fp32, by name."""
    import torch

    from atoll.models import TinyGPT, preset

    torch.manual_seed(0)
    gpt = TinyGPT(preset(model, vocab_size=MODEL_VOCAB[model]))
    return {n: t.detach().clone() for n, t in gpt.named_parameters()}
