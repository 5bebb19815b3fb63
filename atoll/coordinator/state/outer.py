"""Outer optimizers: turn the averaged pseudo-gradient into the update of θ."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch.optim.sgd import sgd

from atoll.compression.base import Chunks
from atoll.memory import Leases

THETA_LIMIT = 2.0**120
"""θ is proven finite while a bound of its largest value stays below this (fp32 holds up to 2^128)."""


class NonFiniteTheta(RuntimeError):
    """θ_{r+1} is not finite. The admission bounds (``checks.MAX_TENSOR_NORM``, the round's
    ``SUM_LIMIT``) make this unreachable from any input; should it happen, the round is not sealed:
    nothing of it is saved or published, and the coordinator stops, to restart from its last round."""


class FiniteTheta:
    """θ checked finite before each round is sealed, without a pass over θ: ``bounds[name]`` is at
    least the largest magnitude in θ's tensor ``name``. θ_{r+1} = θ_r + decode(u_r) element by
    element, so ``bound + ||decode(u_r)||`` bounds θ_{r+1}; the codec gives the norm bound of u_r
    from its payload (int8: from the scales alone, 1/64 of the values; ~1 ms at 124M parameters
    where a pass over θ took ~35 ms of a ~300 ms outer step). While the bound stays below
    :data:`THETA_LIMIT` no value can be infinite or NaN; past it (never, for a sane run), one exact
    pass checks the tensor and starts the bound afresh. A bound starts as θ's own largest magnitude,
    measured on the first step after θ_0 or a restore."""

    def __init__(self) -> None:
        self.bounds: dict[str, float] = {}

    def reset(self) -> None:
        """θ was replaced wholesale (θ_0 defined, a restore): bounds are measured again."""
        self.bounds = {}

    def check(self, name: str, before: torch.Tensor, after: torch.Tensor, payload, codec) -> None:
        """``after`` = ``before`` + decode(``payload``): NonFiniteTheta unless it is provably finite."""
        bound = self.bounds.get(name)
        if bound is None:
            bound = largest(name, before)
        step = codec.norm_bound(payload, verified=True)  # the coordinator's own payload
        if math.isnan(step):
            raise NonFiniteTheta(f"the outer update of tensor {name!r} is not finite: the round is not sealed")
        bound += step
        self.bounds[name] = bound if bound <= THETA_LIMIT else largest(name, after)


def largest(name: str, t: torch.Tensor) -> float:
    """The largest magnitude in ``t`` (one pass); NonFiniteTheta if it holds a NaN or an infinity."""
    if t.numel() == 0:
        return 0.0
    low, high = torch.aminmax(t)
    m = max(-float(low), float(high))
    if not math.isfinite(m):
        raise NonFiniteTheta(f"θ of the next round is not finite in tensor {name!r}: the round is not sealed")
    return m


class OuterOptimizer(Protocol):
    """Computes the outer update ``u`` from the averaged pseudo-gradient; θ_{r+1} = θ_r + u."""

    def update(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def state_tensors(self) -> dict[str, torch.Tensor]: ...

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None: ...


class NesterovSGD:
    """SGD with (Nesterov) momentum, PyTorch's convention (DiLoCo's outer optimizer).

    ``m <- mu * m + g``; update ``u = -lr * (g + mu * m)`` (Nesterov) or ``-lr * m``.
    The pseudo-gradient g = θ_start − θ_island points *against* the island's progress, so
    subtracting it moves θ towards where the islands went.
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], *, lr: float, momentum: float, nesterov: bool) -> None:
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.buffers = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}

    def update(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if grads.keys() != self.buffers.keys():
            raise ValueError("gradient tensors do not match the optimizer's tensors")
        return {name: self.step_(name, g.clone()) for name, g in grads.items()}

    def step_(self, name: str, g: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Advance ``name``'s momentum by ``g`` and turn ``g`` into the update, in place (the
        coordinator then holds no second copy of the model); returns ``g``. ``g``: the whole
        gradient, or the flat chunk of it from element ``start`` (element by element, the same bits)."""
        m = self.buffers[name]
        if g.shape != m.shape:
            m = m.view(-1).narrow(0, start, g.numel())
        m.mul_(self.momentum).add_(g)
        if self.nesterov:
            g.add_(m, alpha=self.momentum)
        else:
            g.copy_(m)
        return g.mul_(-self.lr)

    @property
    def fuses(self) -> bool:
        """Whether :meth:`fused_` can stand in for :meth:`step_`: there is momentum (with none the
        fused kernel leaves the buffer alone, where ``step_`` writes g into it)."""
        return self.momentum != 0 and _fused_sgd_runs()

    def fused_(self, name: str, g: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, start: int = 0) -> None:
        """``out += u`` for the mean ``g / scale``, momentum advanced as :meth:`step_` does, in one pass
        (torch's fused SGD, ``torch.optim.sgd.sgd(fused=True)``, with ``out`` as its parameter and
        ``scale`` as its gradient scale)
        instead of six; ``g`` is left holding the mean. The momentum gets the same bits as
        :meth:`step_`'s; ``out`` may differ from ``step_``'s ``u`` added to it in the last bit (the
        kernel rounds ``g + mu * m`` and ``out - lr * (...)`` its own way). ``g`` and ``out``: whole
        tensors, or the flat chunks of them from element ``start``; ``scale``: one fp32 value on their
        device."""
        m = self.buffers[name]
        if g.shape != m.shape:
            m = m.view(-1).narrow(0, start, g.numel())
        sgd(  # m is given (zero at first: mu * 0 + g is g, as in step_), so no "first step" copy
            [out],
            [g],
            [m],
            fused=True,
            grad_scale=scale,
            weight_decay=0.0,
            momentum=self.momentum,
            lr=self.lr,
            dampening=0.0,
            nesterov=self.nesterov,
            maximize=False,
        )

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"momentum/{k}": v for k, v in self.buffers.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in self.buffers:
            self.buffers[name].copy_(tensors[f"momentum/{name}"])


MOMENTUM_ADVANCES = ("once", "progress", "even", "spread")
"""When :class:`DelayedNesterov`'s momentum advances: ``once`` when the rounds since it last did add
up to a full round's share, by their mean gradient (Liu et al. 2024); ``progress`` the same, as that
many full rounds (:func:`momentum_steps`); ``even`` every round, as its own share's worth of full
rounds; ``spread`` as ``even``, a round stepping at most :data:`SPREAD_CAP` times the usual share."""

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
        advance: str = "once",
    ) -> None:
        if advance not in MOMENTUM_ADVANCES:
            raise ValueError(f"advance must be one of {', '.join(MOMENTUM_ADVANCES)}, got {advance!r}")
        super().__init__(shapes, lr=lr, momentum=momentum, nesterov=nesterov)
        self.advance = advance
        """When the momentum advances (:data:`MOMENTUM_ADVANCES`)."""
        self._steps: tuple[float, float, float, float] | None = None
        """This round's coefficients from :func:`momentum_steps` when it advances S > 1 rounds' worth
        (``even``: S > 0, every round)."""
        self.pending = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}
        """G: the sum of the gradients of the rounds since the momentum last advanced."""
        self.pending_share = 0.0
        """S: the sum of those rounds' shares."""
        self._advance: float | None = None
        """This round's 1 / S when it advances the momentum, else None."""
        self.usual_share = 1.0
        """``spread``: the rounds' shares, averaged (:data:`USUAL_SHARE_PULL`)."""
        self._take = 1.0
        """``spread``: the part of the work there is (this round's and what waits) that this round steps."""

    def begin_round(self, share: float) -> None:
        if not share >= 0.0:  # (0: a round whose contributions weigh nothing moves nothing)
            raise ValueError(f"a round's share must be at least 0, got {share}")
        self.pending_share += share
        k = self.pending_share
        if self.advance == "spread":  # (k: what waits and this round's share, capped)
            k = min(k, max(1.0, SPREAD_CAP * self.usual_share))
            self.usual_share += USUAL_SHARE_PULL * (share - self.usual_share)
            self._take = k / self.pending_share if self.pending_share > 0.0 else 1.0
            self._advance = 1.0 / self.pending_share if k > 0.0 else None
            self._steps = momentum_steps(self.momentum, k, self.nesterov) if k > 0.0 else None
            return
        if self.advance == "even":  # (k is this round's share: nothing is held back)
            self._advance = 1.0 / k if k > 0.0 else None
            self._steps = momentum_steps(self.momentum, k, self.nesterov) if k > 0.0 else None
            return
        self._advance = 1.0 / self.pending_share if self.pending_share >= 1.0 - 1e-9 else None
        per_share = self.advance == "progress"
        self._steps = momentum_steps(self.momentum, k, self.nesterov) if per_share and k > 1.0 else None

    def end_round(self) -> None:
        if self.advance == "spread":
            self.pending_share *= 1.0 - self._take
        elif self._advance is not None:
            self.pending_share = 0.0

    def step_(self, name: str, g: torch.Tensor, start: int = 0) -> torch.Tensor:
        m, acc = self.buffers[name], self.pending[name]
        if g.shape != m.shape:
            m, acc = (t.view(-1).narrow(0, start, g.numel()) for t in (m, acc))
        if self.advance in ("even", "spread") and self._steps is None:  # a round of no share
            return g.mul_(-self.lr)
        acc.add_(g)
        if self.advance == "spread":  # k full rounds of ĝ = G / S (k = S unless capped); the rest waits
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
        if self.advance == "spread":
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


@functools.cache
def _fused_sgd_runs() -> bool:
    """Whether this torch has the CPU fused SGD kernel (torch 2.4 and later), tried once on 8 values."""
    t = [torch.zeros(8) for _ in range(3)]
    try:
        sgd([t[0]], [t[1]], [t[2]], fused=True, weight_decay=0.0, momentum=0.9, lr=1.0, dampening=0.0,
            nesterov=True, maximize=False)  # fmt: skip
    except (RuntimeError, NotImplementedError):
        return False
    return True


def spare(spares: dict[str, bytearray] | None, name: str, leases: Leases | None) -> bytearray | None:
    """``spares[name]`` (taken out), if nobody holds a lease on it any more (no pull still streams it,
    the downlink no longer keeps it). A buffer reused fills at memory speed; a fresh one costs a page
    fault every 4 KiB (0.28 s for |θ| = 475 MiB on the dev machine)."""
    buf = spares.pop(name, None) if spares is not None else None
    return buf if buf is not None and (leases is None or not leases.held(buf)) else None


def outer_step_(
    accum: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor],
    *,
    weight_total: float,
    optimizer: NesterovSGD,
    buffers: frozenset[str],
    downlink,
    downlink_ef: dict[str, torch.Tensor],
    downlink_state: dict[str, dict],
    robust_grads: dict[str, torch.Tensor] | None = None,
    spares: dict[str, bytearray] | None = None,
    leases: Leases | None = None,
    made: Callable[[str, bytearray], None] | None = None,
) -> dict[str, bytearray]:
    """θ_{r+1} = θ_r + decode(encode(u + e)), tensor by tensor, in place in ``accum`` (which ends up
    holding θ_{r+1}): besides θ, momentum and the accumulator, only one tensor's temporaries.

    ``accum`` holds Σ w_i Δ_i and ``weight_total`` is Σ w_i (or ``robust_grads`` holds the
    aggregated pseudo-gradient). u is the outer optimizer's update of the mean; buffers take the
    mean itself (θ − mean Δ = the islands' mean buffer). A lossy ``downlink`` codec sends u + e and
    keeps e, the error it made (downlink error feedback). Returns the encoded update per tensor:
    what islands add to θ_r is exactly what was added here. ``spares``: last round's payloads, each
    reused as this round's buffer when nobody holds a lease on it in ``leases`` (see :func:`spare`).
    ``made(name, payload)``: called as each tensor's payload is final (pulls stream it meanwhile).

    A codec that reads its input in chunks gets each tensor as an :class:`_Update`: every step above
    runs a cache-sized chunk at a time as the codec reads it (one pass over each tensor instead of
    ten), element by element the same arithmetic, so the same bits.
    """
    payloads = {}
    total = torch.tensor([weight_total], dtype=torch.float32)  # the fused pass's gradient scale
    for name, acc in accum.items():
        robust = robust_grads.pop(name).reshape(-1) if robust_grads is not None else None

        def prepare(a: torch.Tensor, start: int = 0, name=name, robust=robust) -> None:
            """``a``, the flat chunk of ``acc`` from element ``start`` (or all of it), into u."""
            if robust is not None:
                a.copy_(robust.narrow(0, start, a.numel()))
            else:
                a.div_(weight_total)
            if name in buffers:
                a.neg_()
            else:
                optimizer.step_(name, a, start)

        out = spare(spares, name, leases)
        state = downlink_state.setdefault(name, {}) if downlink.lossy else None
        # With error feedback, u + e is made in e's own storage by one fused pass (see NesterovSGD.fused_).
        fused = None
        if downlink.lossy and robust is None and name not in buffers and optimizer.fuses:

            def fused(a: torch.Tensor, e: torch.Tensor, start: int = 0, name=name) -> None:
                optimizer.fused_(name, a, e, total, start)

        if downlink.chunked_input:
            update = _Update(acc, params[name], prepare, downlink_ef[name] if downlink.lossy else None, fused)
            payloads[name] = downlink.encode_chunks(update, tuple(acc.shape), state, out=out)
        elif fused is not None:
            ef = downlink_ef[name]
            fused(acc.view(-1), ef.view(-1))  # e <- u + e
            payloads[name] = downlink.encode(ef, state, out=out)
            downlink.decode_into(payloads[name], acc)  # what islands add: decode(u + e), no temporary
            ef.sub_(acc)
            acc.add_(params[name])
        else:
            prepare(acc.view(-1))
            if downlink.lossy:
                acc.add_(downlink_ef[name])
            payloads[name] = downlink.encode(acc, state, out=out)
            if downlink.lossy:
                downlink_ef[name].copy_(acc)
                downlink.decode_into(payloads[name], acc)  # what islands add: decode(u + e), no temporary
                downlink_ef[name].sub_(acc)
            acc.add_(params[name])
        if made is not None:
            made(name, payloads[name])
    return payloads


class _Update(Chunks):
    """One tensor's outer step, made a chunk at a time as the downlink codec reads it: ``span`` turns
    the accumulator's chunk into u (+ e), and once it is encoded, ``encoded`` keeps the new error
    e = (u + e) − decode and writes θ_{r+1} = decode + θ_r there. ``fused(a, e, start)``: makes
    u + e in the error's own chunk in one pass (then ``prepare`` is not used)."""

    wants_decoded = True

    def __init__(self, acc: torch.Tensor, param: torch.Tensor, prepare, ef: torch.Tensor | None, fused=None) -> None:
        super().__init__(acc.numel(), acc.device)
        self.acc, self.param = acc.view(-1), param.view(-1)
        self.ef = None if ef is None else ef.view(-1)
        self.prepare, self.fused = prepare, fused
        self._next = 0

    def span(self, start: int, length: int) -> torch.Tensor:
        if start != self._next:  # each chunk is changed in place: read once, in order
            raise AssertionError(f"chunk at {start} read out of order (expected {self._next})")
        self._next = start + length
        a = self.acc.narrow(0, start, length)
        if self.fused is not None:
            e = self.ef.narrow(0, start, length)
            self.fused(a, e, start)
            return e
        self.prepare(a, start)
        if self.ef is not None:
            a.add_(self.ef.narrow(0, start, length))
        return a

    def encoded(self, start: int, decoded: torch.Tensor) -> None:
        n = decoded.numel()
        a = self.acc.narrow(0, start, n)
        if self.fused is not None:  # the error's chunk held u + e (``decoded`` may be that chunk itself)
            torch.add(decoded, self.param.narrow(0, start, n), out=a)
            self.ef.narrow(0, start, n).sub_(decoded)
            return
        if self.ef is not None:
            torch.sub(a, decoded, out=self.ef.narrow(0, start, n))
        torch.add(decoded, self.param.narrow(0, start, n), out=a)
