"""Where a push stands against the open round, and how much a contribution weighs in the round's mean:
the one place for the rules (tokens, a token-less island's steps, staleness, step count).

Round r's outer gradient is Σ w_i s_i Δ_i / Σ w_i over the contributions that entered it:

- w_i, the weight: the tokens the delta covers (:func:`weight`); an island that reports none but took
  inner steps weighs its steps times the others' tokens per step, never more than the run's token
  bound; a delta k rounds late (:func:`classify`: LATE) weighs ``staleness_weight ** k`` times that;
- s_i, the step scale (:func:`step_scale`): decoupled runs enter a delta of n > H inner steps as
  (H/n)·Δ_i, an estimate of the H-step update (sync runs: 1), except under the ``whole`` rule, where
  it enters whole and its island's usual weight (the share of a round of some islands) is its weight
  per H steps (:func:`per_round_weight`; so under ``progress`` and ``even`` too);
- the mean's denominator and the round's share of a full round (:func:`round_share`): under
  ``progress`` and ``even`` Σ w_i s_i Δ_i over a full round's weight, so a long delta's whole
  progress enters at its island's share of a round of everyone.
"""

from __future__ import annotations

import enum

from atoll.coordinator.policy.steps import DecoupledStep


class PushClass(enum.Enum):
    NEW = "new"
    LATE = "late"
    """For a closed round, folded into the open one (late policy "fold", not too stale)."""
    DUPLICATE = "duplicate"
    CLOSED = "closed"
    """For a closed round that is not folded: dropped."""
    FUTURE = "future"


def classify(push_round: int, open_round: int, *, sealed: bool, fold: bool, max_staleness: int) -> PushClass:
    """Where a push for ``push_round`` stands. ``sealed``: the open round's outer step is computed
    and waits to be saved (it takes nothing more; the next round is not open yet)."""
    if push_round > open_round:
        return PushClass.FUTURE
    if sealed:
        return PushClass.CLOSED
    if push_round == open_round:
        return PushClass.NEW
    if fold and open_round - push_round <= max_staleness:
        return PushClass.LATE
    return PushClass.CLOSED


def weight(
    tokens: int,
    inner_steps: int,
    tokens_per_step: float | None,
    token_bound: int,
    staleness_weight: float,
    late_by: int,
) -> float:
    """A contribution's weight in the round's mean: its ``tokens``; a token-less one that took
    ``inner_steps`` weighs them times ``tokens_per_step`` of the islands that report both (1 when none
    does), capped at ``token_bound``; one that reports neither did no work and weighs 0 (it weighed 1, as
    much as a token); ``late_by`` rounds late, times ``staleness_weight ** late_by``."""
    w = float(tokens) if tokens else min(inner_steps * (tokens_per_step or 1.0), float(token_bound))
    return w * staleness_weight**late_by if late_by else w


def step_scale(rule: DecoupledStep | None, sync_every: int, inner_steps: int) -> float:
    """Decoupled: a delta of n > H inner steps (its island trained on while its exchange was out, or
    carried a dropped push) enters the mean scaled by H/n, an estimate of the H-step update, while its
    weight stays its tokens. At full size, in rounds that each stepped as far as a round of everyone
    (the ``full`` rule), it both outweighed and outsized the H-step deltas beside it, and the outer
    step overshot (benchmarks/RESULTS.md). The scale drops 1 − H/n of that island's progress for good
    (it has re-based on the new θ): ``whole`` (a round steps by its share, capped at a full round's)
    enters it whole. ``rule``: the decoupled run's ``decoupled_step`` (None: sync mode, scale 1). 1 for
    n <= H."""
    if rule is None or rule.long_delta_whole or inner_steps <= sync_every:
        return 1.0
    return sync_every / inner_steps


def per_round_weight(rule: DecoupledStep | None, weight: float, sync_every: int, inner_steps: int) -> float:
    """An island's usual weight: under a rule with ``usual_weight_per_h`` its contribution's weight per
    H inner steps, so that one long delta does not shrink the share of every round after it; else the
    weight itself."""
    if rule is not None and rule.usual_weight_per_h and inner_steps > sync_every:
        return weight * sync_every / inner_steps
    return weight


def round_share(rule: DecoupledStep, weight: float, entered: float, full: float) -> tuple[float, float]:
    """A decoupled round of some islands under ``rule`` (not ``full``): (its share of a full round, the
    denominator D of its mean Σ w_i s_i Δ_i / D). ``even`` is ``progress`` here (it differs in the
    momentum: :class:`~atoll.coordinator.state.delayed.DelayedNesterov`). ``weight``: Σ w_i, the work
    that entered; ``entered``: Σ w_i s_i; ``full``: the live islands' usual weights together (0: none
    known yet).

    ``progress``: D = max(Σ w_i s_i, full), so an island's progress since its last push enters as its
    share of a round of everyone, a long delta whole and once (such a round's mean sums the islands'
    progress over N; ``whole`` had entered a long delta alone at full size, N times that, and the
    outer momentum took it: the one-round spikes under the chaos trace). The share is the work that
    entered, uncapped: Delayed Nesterov steps the momentum as that many full rounds of the round's
    gradient per full round would. The other rules: D = max(Σ w_i, full), the share capped at 1."""
    if rule.progress_share:
        return (weight / full if full > 0 else 1.0), max(entered, full)
    return (min(weight / full, 1.0) if full > 0 else 1.0), max(weight, full)
