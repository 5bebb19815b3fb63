"""Outer optimizers: turn the averaged pseudo-gradient into the update of θ."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch.optim.sgd import sgd

from atoll.compression.base import Chunks
from atoll.coordinator.state.workers import SERIAL, TensorWorkers
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
    workers: TensorWorkers = SERIAL,
) -> dict[str, bytearray]:
    """θ_{r+1} = θ_r + decode(encode(u + e)), tensor by tensor, in place in ``accum`` (which ends up
    holding θ_{r+1}): besides θ, momentum and the accumulator, only one tensor's temporaries.

    ``accum`` holds Σ w_i Δ_i and ``weight_total`` is Σ w_i (or ``robust_grads`` holds the
    aggregated pseudo-gradient). u is the outer optimizer's update of the mean; buffers take the
    mean itself (θ − mean Δ = the islands' mean buffer). A lossy ``downlink`` codec sends u + e and
    keeps e, the error it made (downlink error feedback). Returns the encoded update per tensor:
    what islands add to θ_r is exactly what was added here. ``spares``: last round's payloads, each
    reused as this round's buffer when nobody holds a lease on it in ``leases`` (see :func:`spare`).
    ``made(name, payload)``: called as each tensor's payload is final (pulls stream it meanwhile), in
    ``accum``'s order, on this thread. ``workers``: the tensors' steps run on them, several at once
    (each tensor's own arithmetic, so the same bits whatever their number).

    A codec that reads its input in chunks gets each tensor as an :class:`_Update`: every step above
    runs a cache-sized chunk at a time as the codec reads it (one pass over each tensor instead of
    ten), element by element the same arithmetic, so the same bits.
    """
    payloads = {}
    weight_total = weight_total if weight_total > 0 else 1.0  # every contribution weighed 0: Σ w Δ is 0, as is the mean
    total = torch.tensor([weight_total], dtype=torch.float32)  # the fused pass's gradient scale

    def one(name: str, acc: torch.Tensor, robust: torch.Tensor | None, out, state) -> bytearray:
        """Tensor ``name``'s step (its own storage only: a task of ``workers``); its payload."""

        def prepare(a: torch.Tensor, start: int = 0) -> None:
            """``a``, the flat chunk of ``acc`` from element ``start`` (or all of it), into u."""
            if robust is not None:
                a.copy_(robust.narrow(0, start, a.numel()))
            else:
                a.div_(weight_total)
            if name in buffers:
                a.neg_()
            else:
                optimizer.step_(name, a, start)

        # With error feedback, u + e is made in e's own storage by one fused pass (see NesterovSGD.fused_).
        fused = None
        if downlink.lossy and robust is None and name not in buffers and optimizer.fuses:

            def fused(a: torch.Tensor, e: torch.Tensor, start: int = 0) -> None:
                optimizer.fused_(name, a, e, total, start)

        if downlink.chunked_input:
            update = _Update(acc, params[name], prepare, downlink_ef[name] if downlink.lossy else None, fused)
            return downlink.encode_chunks(update, tuple(acc.shape), state, out=out)
        if fused is not None:
            ef = downlink_ef[name]
            fused(acc.view(-1), ef.view(-1))  # e <- u + e
            payload = downlink.encode(ef, state, out=out)
            downlink.decode_into(payload, acc)  # what islands add: decode(u + e), no temporary
            ef.sub_(acc)
            acc.add_(params[name])
            return payload
        prepare(acc.view(-1))
        if downlink.lossy:
            acc.add_(downlink_ef[name])
        payload = downlink.encode(acc, state, out=out)
        if downlink.lossy:
            downlink_ef[name].copy_(acc)
            downlink.decode_into(payload, acc)  # what islands add: decode(u + e), no temporary
            downlink_ef[name].sub_(acc)
        acc.add_(params[name])
        return payload

    tasks = []
    for name, acc in accum.items():  # what the tasks share is taken out here, on this thread
        robust = robust_grads.pop(name).reshape(-1) if robust_grads is not None else None
        state = downlink_state.setdefault(name, {}) if downlink.lossy else None
        tasks.append((name, functools.partial(one, name, acc, robust, spare(spares, name, leases), state)))

    def done(name: str, payload: bytearray) -> None:
        payloads[name] = payload
        if made is not None:
            made(name, payload)

    workers.ordered(tasks, done)
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
