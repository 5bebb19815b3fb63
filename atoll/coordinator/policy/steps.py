"""The decoupled-step rules: how far a decoupled round made of some of the islands steps, as a registry
(as the codecs have one). ``--decoupled-step NAME`` picks one; a run stored with another rule keeps it.

Each rule is data: the few choices the rules differ in, read by the weighting
(:mod:`~atoll.coordinator.policy.weighting`), the round's share (``run/pushes``) and the outer optimizer
(:class:`~atoll.coordinator.state.delayed.DelayedNesterov`). Why each exists, and what each measured,
is in docs/design.md, "The decoupled-step rules".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Advance(str, Enum):
    """When Delayed Nesterov's momentum advances."""

    ONCE = "once"
    """When the rounds since it last did add up to a full round's share, by their mean gradient."""
    PROGRESS = "progress"
    """As ``once``, as that many full rounds (:func:`~atoll.coordinator.state.delayed.momentum_steps`)."""
    EVEN = "even"
    """Every round, as its own share's worth of full rounds."""
    SPREAD = "spread"
    """As ``even``, a round stepping at most :data:`~atoll.coordinator.state.delayed.SPREAD_CAP` times
    the usual share; the rest of its work joins the rounds after."""

    @property
    def every_round(self) -> bool:
        return self in (Advance.EVEN, Advance.SPREAD)

    @property
    def capped(self) -> bool:
        return self is Advance.SPREAD

    @property
    def as_full_rounds(self) -> bool:
        """``progress``: a round of S > 1 shares steps the momentum as S full rounds would."""
        return self is Advance.PROGRESS


@dataclass(frozen=True)
class DecoupledStep:
    name: str
    summary: str
    """One line: what the rule does."""
    by_share: bool = True
    """A round steps by its share of a round of everyone (False, ``full``: as far as a round of everyone)."""
    long_delta_whole: bool = False
    """A delta of n > H inner steps enters whole (else scaled by H/n: ``weighting.step_scale``)."""
    usual_weight_per_h: bool = False
    """An island's usual weight is its weight per H inner steps (``weighting.per_round_weight``)."""
    progress_share: bool = False
    """Each island's progress since its last push enters as its share of a round of everyone, the
    round's share uncapped (``weighting.round_share``)."""
    advance: Advance | None = None
    """The outer optimizer is Delayed Nesterov with this advance (None: Nesterov every round)."""


RULES: dict[str, DecoupledStep] = {
    r.name: r
    for r in (
        DecoupledStep("share", "a round steps by its share of a full round; Nesterov at every round"),
        DecoupledStep("full", "a round steps as far as a round of everyone (the mean of what came)", by_share=False),
        DecoupledStep("delayed", "as share, with Delayed Nesterov", advance=Advance.ONCE),
        DecoupledStep(
            "whole",
            "as delayed; a delta of more than H steps enters whole",
            long_delta_whole=True,
            usual_weight_per_h=True,
            advance=Advance.ONCE,
        ),
        DecoupledStep(
            "progress",
            "each island's progress enters as its share of a round of everyone; momentum as S full rounds",
            usual_weight_per_h=True,
            progress_share=True,
            advance=Advance.PROGRESS,
        ),
        DecoupledStep(
            "even",
            "as progress; every round steps the momentum by its own share",
            usual_weight_per_h=True,
            progress_share=True,
            advance=Advance.EVEN,
        ),
        DecoupledStep(
            "spread",
            "as even; a round steps at most 1.5x the usual share, the rest joins the rounds after",
            usual_weight_per_h=True,
            progress_share=True,
            advance=Advance.SPREAD,
        ),
    )
}

DEFAULT = "spread"
STORED_BEFORE_RULES = "full"
"""The rule of a run stored before there were rules: it keeps the step it had."""


def rule(name: str) -> DecoupledStep:
    """The rule called ``name``; ValueError naming the rules otherwise."""
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"decoupled_step must be one of {', '.join(RULES)}, got {name!r}") from None
