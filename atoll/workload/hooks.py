"""The seams of the reference island's loop, with the trivial implementation (they do nothing).

The product never injects faults itself: the harness subclasses :class:`IslandHooks`
(:class:`atoll.harness.faults.IslandFaults`) and starts the island through its own entry point
(``python -m atoll.harness.island``).
"""

from __future__ import annotations

from atoll.islands import Transport


class IslandHooks:
    module = "atoll"
    """The module a multi-rank island re-launches itself with (``python -m MODULE``)."""

    def relaunch_argv(self) -> list[str]:
        """Arguments the re-launched ranks need before the island's own (to rebuild these hooks)."""
        return []

    def before_round(self, round_: int, first_step: bool) -> None:
        """Before each inner step (``first_step``: the first of ``round_``)."""

    def after_step(self, round_: int, step_seconds: float) -> None:
        """After each inner step, which took ``step_seconds``."""

    def transport(self, transport: Transport) -> Transport:
        """The transport to a coordinator shard, given the real one."""
        return transport
