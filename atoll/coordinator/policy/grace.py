"""How long a round that has its quorum waits for the live islands still missing: pure functions.

Each island's arrival in a round (its push committing, in seconds after the round opened) is tracked
as TCP tracks a round-trip time (Jacobson/Karels): a smoothed mean and a smoothed mean deviation,
updated with gains 1/8 and 1/4. An island is expected by ``mean + 4 * deviation``. Once the quorum
has committed, the round waits for the missing islands until the latest of their expected arrivals
(``--grace-window auto``, the default), or a fixed number of seconds after the quorum
(``--grace-window SECONDS``); ``off`` waits until the deadline, as before. An island with no history
yet gives no ground to cut the wait short: the round then waits until its deadline, which stays the
hard cap in every case.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO, OFF = "auto", "off"
MEAN_GAIN, DEV_GAIN, DEVIATIONS = 1 / 8, 1 / 4, 4.0


@dataclass
class Arrival:
    """One island's arrival statistics (seconds after its round opened)."""

    mean: float | None = None
    dev: float = 0.0

    def observe(self, offset: float) -> None:
        if self.mean is None:
            self.mean, self.dev = offset, offset / 2
            return
        err = offset - self.mean
        self.mean += MEAN_GAIN * err
        self.dev += DEV_GAIN * (abs(err) - self.dev)

    def expected(self) -> float | None:
        """When in a round the island should have committed (None: no history)."""
        return None if self.mean is None else self.mean + DEVIATIONS * self.dev

    def to_json(self) -> dict:
        return {"mean": self.mean, "dev": self.dev}

    @classmethod
    def from_json(cls, d: dict | None) -> Arrival:
        d = d or {}
        return cls(d.get("mean"), float(d.get("dev", 0.0)))


def parse(window: str) -> float | str:
    """``auto``, ``off`` or a number of seconds >= 0 (ValueError otherwise)."""
    if window in (AUTO, OFF):
        return window
    try:
        seconds = float(window)
    except ValueError:
        raise ValueError(f"grace_window must be auto, off or seconds >= 0, got {window!r}") from None
    if not (seconds >= 0 and seconds < float("inf")):
        raise ValueError(f"grace_window must be auto, off or seconds >= 0, got {window!r}")
    return seconds


def grace_until(
    window: float | str, opened_at: float, quorum_at: float, missing: dict[str, float | None]
) -> tuple[float | None, str]:
    """When the wait for ``missing`` (island -> expected arrival after the round opened, None: no
    history) ends, and why; None: no grace (wait until the deadline)."""
    if window == OFF or not missing:
        return None, ""
    if window != AUTO:
        return quorum_at + float(window), f"grace {float(window):g}s after quorum"
    if any(e is None for e in missing.values()):
        unknown = sorted(i for i, e in missing.items() if e is None)
        return None, f"{', '.join(unknown)} has no arrival history yet"
    latest = max(missing, key=lambda i: missing[i])
    until = max(opened_at + missing[latest], quorum_at)
    said = ", ".join(f"{i} expected at +{e:.1f}s" for i, e in sorted(missing.items()))
    return until, f"grace {until - quorum_at:.1f}s after quorum: {said}"
