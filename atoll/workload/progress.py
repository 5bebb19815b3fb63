"""What ``atoll island`` shows: a live progress line on a terminal, JSON lines otherwise (there, a
``progress`` event at most every ``progress_seconds`` between syncs, so a log under nohup, Slurm or
Kubernetes is never silent for long)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

PROGRESS_SECONDS = 30.0
"""Default interval of the ``progress`` JSON line when stdout is not a terminal."""


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


class Reporter:
    def __init__(
        self,
        mode: str,
        *,
        lead: bool,
        island: str,
        stream=None,
        progress_seconds: float = PROGRESS_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``mode``: "terminal", "json", or "auto" (terminal when stdout is one). ``progress_seconds``:
        the least time between two ``progress`` JSON lines (0: none)."""
        self.stream = stream or sys.stdout
        self.progress_seconds = progress_seconds
        self.clock = clock
        self.terminal = mode == "terminal" or (mode == "auto" and self.stream.isatty())
        self.lead = lead
        self.island = island
        self._shown = 0.0
        self._rate = 0.0
        self._step_seconds = 0.0
        self._status = False
        self._reported = clock()

    def event(self, name: str, **fields) -> None:
        """One event: a JSON line, or on a terminal a line for people."""
        if not self.lead:
            return
        if not self.terminal:
            print(json.dumps({"event": name, "island": self.island, **fields}), file=self.stream, flush=True)
            self._reported = self.clock()
            return
        self._clear()
        print(self._describe(name, fields), file=self.stream, flush=True)

    def step(self, sync, loss: float, tokens: int, seconds: float) -> None:
        """After an inner step: refresh the progress line (on a terminal, at most twice a second), or
        emit a ``progress`` JSON line once ``progress_seconds`` passed since the last line."""
        if not self.lead:
            return
        self._step_seconds = 0.9 * self._step_seconds + 0.1 * seconds if self._step_seconds else seconds
        self._rate = tokens / self._step_seconds if self._step_seconds else 0.0
        h = sync.sync_every
        left = max(h - sync.round_steps, 0) * self._step_seconds
        now = self.clock()
        if not self.terminal:
            if self.progress_seconds and now - self._reported >= self.progress_seconds:
                self.event(
                    "progress",
                    round=sync.round,
                    step=sync.round_steps,
                    sync_every=h,
                    loss=loss,
                    tokens_per_second=round(self._rate, 1),
                    next_sync_seconds=round(left, 1),
                )
            return
        if now - self._shown < 0.5:
            return
        self._shown = now
        line = (
            f"round {sync.round} · step {sync.round_steps}/{h} · loss {loss:.4f} · {self._rate:,.0f} tok/s"
            f" · next sync in ~{left:.0f}s"
        )
        print(f"\r{line:<90}", end="", file=self.stream, flush=True)
        self._status = True

    def _clear(self) -> None:
        if self._status:
            print("\r" + " " * 90 + "\r", end="", file=self.stream)
            self._status = False

    def _describe(self, name: str, f: dict) -> str:
        if name == "joined":
            state = "resumed from its checkpoint" if f.get("resumed") else "joined"
            return (
                f"{self.island} {state} at round {f['round']} (H={f['sync_every']}, {f['ranks']} rank(s), "
                f"{f['parallel']}); eval loss {f['eval_loss']:.4f}"
            )
        if name == "round":
            parts = [f"round {f['round']}"]
            if f.get("loss") is not None:
                parts.append(f"train {f['loss']:.4f}")
            if f.get("global_loss") is not None:
                parts.append(f"global {f['global_loss']:.4f}")
            if f.get("eval_loss") is not None:
                parts.append(f"eval {f['eval_loss']:.4f}")
            share = f["sync_seconds"] / f["round_seconds"] if f.get("round_seconds") else 0.0
            tail = (
                f"{f['inner_steps']} steps, {f['tokens']:,} tokens | sent {human_bytes(f['bytes_sent'])}, received "
                f"{human_bytes(f['bytes_received'])} | sync {f['sync_seconds']:.2f}s ({share:.0%} of the round"
                + (f"; own work {f['host_seconds']:.2f}s" if f.get("host_seconds") is not None else "")
                + ")"
                + (f", exchange {f['exchange_seconds']:.2f}s" if f.get("exchange_seconds") is not None else "")
                + (f" (own work on its thread {f['background_seconds']:.2f}s)" if f.get("background_seconds") else "")
            )
            flags = " | DROPPED: the round closed before the push" if f.get("dropped") else ""
            flags += " | run complete" if f.get("run_complete") else ""
            return ": ".join([parts[0], ", ".join(parts[1:]) or "-"]) + f" | {tail}{flags}"
        if name == "done":
            if f.get("preempted"):
                return f"{self.island}: SIGTERM: checkpointed at step {f['step']} and left the run"
            return f"{self.island}: " + (
                "the run is complete" if f.get("run_complete") else f"done at round {f['round']}"
            )
        return f"{name}: {f}"
