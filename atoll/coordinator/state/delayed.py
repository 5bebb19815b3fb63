"""Delayed Nesterov and its rules for decoupled rounds made of some of the islands: when the outer
momentum advances, and how far a round of S full rounds' work steps (:func:`momentum_steps`)."""

from __future__ import annotations

import torch

from atoll.coordinator.policy.steps import Advance
from atoll.coordinator.state.outer import NesterovSGD

SPREAD_CAP = 1.5
"""``spread``: a round steps at most this many times the usual share (the rounds' shares averaged, a
fifth of the way each round) and at least one full round's; the rest of its work waits and joins the
rounds after. Under the chaos trace the round holding a cut island's 550-700 carried steps (share
2.4-3) raised θ's loss by 0.08 under ``even`` (benchmarks/RESULTS.md)."""

USUAL_SHARE_PULL = 0.2
"""``spread``: how far each round moves the usual share towards its own."""


class DelayedNesterov(NesterovSGD):
    """Delayed Nesterov (Liu et al. 2024, "Asynchronous Local-SGD Training for Language Modeling"),
    for decoupled rounds made of some of the islands: each round steps by its own (share-scaled)
    mean, ``u = -lr * g``, and the momentum, which would otherwise be applied at every one of these
    small rounds (N times per round's worth of work with N islands: the overshoot the paper names as
    asynchronous Local-SGD's main problem), advances and is applied only once the rounds since it
    last did add up to a full round's share: ``m <- mu * m + G / S`` (G the sum of their gradients,
    S of their shares) and ``u = -lr * (g + mu * m)`` (without Nesterov, with m before it advanced):
    ``advance="once"``, the paper's rule. A run whose every round is full (share 1) is exactly
    Nesterov SGD (or SGD with momentum). A round may hold more than a full round's work (share > 1);
    with ``advance="progress"`` the rounds since the momentum last advanced then count as S full rounds
    of G / S (:func:`momentum_steps`), so a round of islands that each trained 2H steps moves θ as two
    rounds of H-step deltas would.

    Holding the momentum back made the steps lumpy: under ``progress``, a round of 0.8 of a full
    round's share stepped by its gradient alone and the next one also by 1.6 rounds' momentum at
    once (|u| ~1.6x as long under the chaos trace), and θ's loss rose after each of those and fell
    after the others (benchmarks/RESULTS.md). With ``advance="even"`` every round steps the momentum
    as its own share's worth of full rounds, whatever the share (:func:`momentum_steps` for any k > 0),
    and nothing waits: rounds whose shares add up to whole rounds, each with its share of a whole
    round's gradient, move θ and m exactly as Nesterov SGD over those whole rounds, and a steady run
    of rounds of share s steps s times as far as full rounds would, every round.

    A round holding many rounds' work at once (a cut island's carried delta, share 2.4-3 under the
    chaos trace) still stepped it at once and θ's loss rose for that round. With ``advance="spread"``
    a round steps at most :data:`SPREAD_CAP` times the usual share (at least one full round's); the
    rest of its gradient and share waits in ``pending`` and joins the rounds after, so nothing is lost:
    with one gradient throughout, θ and m end exactly as Nesterov SGD over the same whole rounds.

    :meth:`begin_round` gives each round's share before its tensors are stepped."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        *,
        lr: float,
        momentum: float,
        nesterov: bool,
        advance: Advance | str = Advance.ONCE,
    ) -> None:
        try:
            advance = Advance(advance)
        except ValueError:
            raise ValueError(f"advance must be one of {', '.join(a.value for a in Advance)}, got {advance!r}") from None
        super().__init__(shapes, lr=lr, momentum=momentum, nesterov=nesterov)
        self.advance = advance
        """When the momentum advances (:class:`~atoll.coordinator.policy.steps.Advance`)."""
        self._steps: tuple[float, float, float, float] | None = None
        """This round's coefficients from :func:`momentum_steps` when it advances S > 1 rounds' worth
        (``even``, ``spread``: S > 0, every round; ``spread``: S capped)."""
        self.pending = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}
        """G: the sum of the gradients of the rounds since the momentum last advanced."""
        self.pending_share = 0.0
        """S: the sum of those rounds' shares."""
        self._advance: float | None = None
        """This round's 1 / S when it advances the momentum, else None."""
        self.usual_share = 1.0
        """``spread``: the rounds' shares, averaged (:data:`USUAL_SHARE_PULL`)."""
        self._take = 1.0
        """``even``, ``spread``: the part of the work there is (this round's and what waits) that this
        round steps (``even``: all of it)."""

    def begin_round(self, share: float) -> None:
        if not share >= 0.0:  # (0: a round whose contributions weigh nothing moves nothing)
            raise ValueError(f"a round's share must be at least 0, got {share}")
        self.pending_share += share
        k = self.pending_share
        if self.advance.every_round:  # k: what waits and this round's share (spread: capped)
            if self.advance.capped:
                k = min(k, max(1.0, SPREAD_CAP * self.usual_share))
                self.usual_share += USUAL_SHARE_PULL * (share - self.usual_share)
            self._take = k / self.pending_share if self.pending_share > 0.0 else 1.0
            self._advance = 1.0 / self.pending_share if k > 0.0 else None
            self._steps = momentum_steps(self.momentum, k, self.nesterov) if k > 0.0 else None
            return
        self._advance = 1.0 / self.pending_share if self.pending_share >= 1.0 - 1e-9 else None
        per_share = self.advance.as_full_rounds
        self._steps = momentum_steps(self.momentum, k, self.nesterov) if per_share and k > 1.0 else None

    def end_round(self) -> None:
        if self.advance.every_round:  # (even: the whole of it, take 1)
            self.pending_share *= 1.0 - self._take
        elif self._advance is not None:
            self.pending_share = 0.0

    def step_(self, name: str, g: torch.Tensor, start: int = 0) -> torch.Tensor:
        m, acc = self.buffers[name], self.pending[name]
        if g.shape != m.shape:
            m, acc = (t.view(-1).narrow(0, start, g.numel()) for t in (m, acc))
        if self.advance.every_round and self._steps is None:  # a round of no share
            return g.mul_(-self.lr)
        acc.add_(g)
        if self.advance.capped:  # k full rounds of ĝ = G / S (k = S unless capped); the rest waits
            c, d, part_m, part_g = self._steps
            k = self._take / self._advance
            torch.mul(acc, (k + part_g) * self._advance, out=g).add_(m, alpha=part_m)
            m.mul_(c).add_(acc, alpha=d * self._advance)
            acc.mul_(1.0 - self._take)
            return g.mul_(-self.lr)
        if self._steps is not None:  # S full rounds of G / S: the momentum's part of them, then m_S
            c, d, part_m, part_g = self._steps
            g.add_(m, alpha=part_m).add_(acc, alpha=part_g * self._advance)
            m.mul_(c).add_(acc, alpha=d * self._advance)
            acc.zero_()
        elif self._advance is not None:
            if not self.nesterov:  # heavy ball: u = -lr * (g + mu * m) with the momentum before it advances
                g.add_(m, alpha=self.momentum)
            m.mul_(self.momentum).add_(acc, alpha=self._advance)
            acc.zero_()
            if self.nesterov:
                g.add_(m, alpha=self.momentum)
        return g.mul_(-self.lr)

    @property
    def fuses(self) -> bool:
        return False

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = super().state_tensors()
        out.update({f"pending/{k}": v for k, v in self.pending.items()})
        out["pending_share"] = torch.tensor([self.pending_share], dtype=torch.float64)
        if self.advance.capped:
            out["usual_share"] = torch.tensor([self.usual_share], dtype=torch.float64)
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state_tensors(tensors)
        for name in self.pending:
            self.pending[name].copy_(tensors[f"pending/{name}"])
        self.pending_share = float(tensors["pending_share"][0])
        if "usual_share" in tensors:
            self.usual_share = float(tensors["usual_share"][0])


def momentum_steps(mu: float, k: float, nesterov: bool) -> tuple[float, float, float, float]:
    """k full rounds (k > 0, not necessarily whole) of one gradient ĝ under momentum ``mu``, from
    momentum m: (c, d, part_m, part_g) with m_k = c·m + d·ĝ, and the momentum's part of the k steps
    (beyond k·ĝ) part_m·m + part_g·ĝ: Nesterov mu·Σ_{j=1..k} m_j, heavy ball mu·Σ_{j=0..k-1} m_j,
    where m_j = mu·m_{j-1} + ĝ. For whole k these are the sums; between them the same formulas.
    ``mu`` < 1."""
    c = mu**k
    d = (1.0 - c) / (1.0 - mu)  # Σ_{j<k} mu^j
    ramp = (k - d) / (1.0 - mu)  # Σ_{j<k} (1 - mu^j) / (1 - mu)
    if nesterov:  # Σ_{j=1..k} m_j = mu·d·m + (k - mu·d) / (1 - mu)·ĝ
        return c, d, mu * mu * d, mu * (k - mu * d) / (1.0 - mu)
    return c, d, mu * d, mu * ramp
