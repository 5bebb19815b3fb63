"""Run configuration: what every island and the coordinator agree on for one run."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from atoll.compression import downlink_for, get_codec
from atoll.coordinator.policy import grace, steps

OUTER_MODES = ("sync", "decoupled")
TOKENS_PER_STEP_BOUND = 1 << 24
"""Default bound on the tokens an island may claim per inner step (16.8M, above the global batch of
any published LLM run): a push claiming more than H x this is refused."""


SPARSE_DECAY = 0.9
"""The error feedback's β for ``sparse`` pushes where a run names none."""


def decay_for(codec: str) -> float:
    """The error feedback's β for islands that push ``codec``, in a run that names none: ``sparse``
    0.9 (over 80 rounds of H=30 on a 3.2M GPT, 3 islands, β = 1 ended 10.6% above identity's eval loss
    and 0.9 below it: benchmarks/RESULTS.md, "Issue 52"); 1 (classic error feedback) for the rest."""
    return SPARSE_DECAY if get_codec(codec).name == "sparse" else 1.0


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    run_id: str = "atoll"
    """Name of the run; every request must carry it."""
    sync_every: int = 50
    """H: inner steps per round."""
    outer_lr: float = 0.7
    """Outer SGD learning rate (DiLoCo default 0.7)."""
    outer_momentum: float = 0.9
    """Outer momentum (DiLoCo default 0.9)."""
    nesterov: bool = True
    """Nesterov momentum (DiLoCo) rather than heavy-ball."""
    codec: str = "int8"
    """Codec of the islands' pseudo-gradients: identity, fp16, bf16, int8, int4, int2 (blockwise; block=B,
    scale=fp32|fp16), topk:fraction=F, dcttopk:fraction=F (top-k of block-DCT coefficients),
    powersgd:rank=R. int8 both ways is the default: within 0.02% of identity's eval loss on the demo
    and benchmarks/convergence.py at a quarter of the bytes (benchmarks/RESULTS.md); identity is
    plain DiLoCo, bit for bit."""
    downlink_codec: str = "auto"
    """Codec of the outer update sent back to islands (same choices; with downlink error feedback).
    auto: sparse at 4x the density for sparse pushes, int8 for the rest
    (:func:`atoll.compression.downlink_for`)."""
    error_feedback: bool = False
    """Islands carry what the lossy uplink codec dropped into the next round (per-rank residual)."""
    error_feedback_decay: float | None = None
    """Error feedback sends C(Δ + β·e): the residual decays by β each round (1: classic EF). Not given:
    0.9 for ``sparse`` pushes, 1 for the rest (:func:`decay_for`; a run stores it resolved).

    An island restarts every round from the global θ and re-learns what it did not transmit, so
    with β = 1 a coordinate's residual grows by about one Δ per round until top-k picks it. The
    value then sent is many rounds' worth. In a 20-round top-k 1% demo that made the global θ
    diverge; β = 0.5 kept it converging. ``sparse`` over 80 rounds of H=30 ended 10.6% above identity
    with β = 1 and below it with β = 0.9 (benchmarks/RESULTS.md, "Issue 52")."""
    outer_mode: str = "sync"
    """sync: islands wait at each push for the round's outer step (bitwise deterministic for a given
    set of pushes: they enter the sum in a fixed order, :mod:`~atoll.coordinator.policy.order`).
    decoupled: islands never wait; each applies the update when it arrives, keeping the
    progress made since its push, and its next push is folded with its staleness (timing-dependent by
    design). ``quorum`` is then the minimum quorum of a round."""
    decoupled_step: str = steps.DEFAULT
    """decoupled: how far a round made of some of the islands steps, one of the rules of
    :mod:`atoll.coordinator.policy.steps`: share, full, delayed, whole, progress, even, spread (the
    default: a round steps by its share of a round of everyone, each island's progress entering once,
    the momentum stepped every round, at most 1.5x the usual share; the rest joins the rounds after).
    Each rule, and what it measured: docs/design.md, "The decoupled-step rules". A run stored with
    another rule keeps it."""
    late_policy: str = "fold"
    """A push for a closed round: fold it into the open round (down-weighted; the default), or drop it."""
    staleness_weight: float = 0.5
    """fold: a delta k rounds late weighs staleness_weight**k times its tokens."""
    max_staleness: int = 4
    """fold: pushes more than this many rounds late are dropped (counted in the round record's
    ``too_stale``; the island keeps the work and carries it into its next push)."""
    aggregation: str = "mean"
    """How deltas are combined: mean (token-weighted), clipped_mean or median (robust)."""
    clip_norm: float = 0.0
    """clipped_mean: clip each island's delta to this L2 norm (0: the median of the islands' norms)."""
    max_delta_norm: float = 0.0
    """Refuse an island's delta whose L2 norm exceeds this (0: no bound)."""
    quorum: int = 1
    """Minimum committed islands for a round to close at its deadline."""
    round_deadline_seconds: float = 600.0
    """Seconds after the round opened when a round with quorum closes without its stragglers."""
    lease_seconds: float = 30.0
    """Seconds without a call after which an island stops counting as live."""
    grace_window: str = "auto"
    """Once quorum has committed, how long a round waits for the live islands still missing: auto (until
    each is expected, from its past arrivals; the deadline when one has none yet), SECONDS after the
    quorum, or off (until the deadline). The deadline is the hard cap."""
    total_rounds: int = 0
    """The run is complete after this many rounds (0: no end); islands then stop by themselves."""
    max_tokens_per_round: int = 0
    """Refuse a push claiming more tokens than this (0: sync_every x 2^24). A token count weighs an
    island's delta in the mean, so an absurd claim would take the run over."""

    def __post_init__(self) -> None:
        if self.downlink_codec == "auto":  # what a run that names no downlink gets (stored resolved)
            try:
                object.__setattr__(self, "downlink_codec", downlink_for(self.codec))
            except ValueError as err:
                raise ValueError(f"codec: {err}") from None
        if self.error_feedback_decay is None:  # (stored resolved, like the downlink)
            try:
                object.__setattr__(self, "error_feedback_decay", decay_for(self.codec))
            except ValueError as err:
                raise ValueError(f"codec: {err}") from None
        if not self.run_id or len(self.run_id) > 128:
            raise ValueError(f"run_id must be 1..128 characters, got {self.run_id!r}")
        for name, bounds in RANGES.items():
            check_range(name, getattr(self, name), *bounds)
        for field in ("codec", "downlink_codec"):
            try:
                get_codec(getattr(self, field))
            except ValueError as err:
                raise ValueError(f"{field}: {err}") from None
        grace.parse(self.grace_window)
        if self.outer_mode not in OUTER_MODES:
            raise ValueError(f"outer_mode must be one of {', '.join(OUTER_MODES)}, got {self.outer_mode!r}")
        steps.rule(self.decoupled_step)
        if self.late_policy not in ("drop", "fold"):
            raise ValueError(f"late_policy must be 'drop' or 'fold', got {self.late_policy!r}")
        if self.aggregation not in ("mean", "clipped_mean", "median"):
            raise ValueError(f"aggregation must be mean, clipped_mean or median, got {self.aggregation!r}")

    @property
    def token_bound(self) -> int:
        """Most tokens one push may claim."""
        return self.max_tokens_per_round or self.sync_every * TOKENS_PER_STEP_BOUND

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        fields = json.loads(text)
        fields.setdefault("decoupled_step", steps.STORED_BEFORE_RULES)  # it keeps the step it had
        fields.setdefault("error_feedback_decay", 1.0)  # stored before the field: classic error feedback
        return cls(**fields)


INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
MAX_ISLANDS = 1_000_000
"""The largest quorum a run may ask for."""

RANGES: dict[str, tuple[float, float, bool, bool]] = {
    # field: (low, high, low included, high included). Each fits the field's wire type in
    # RunConfigProto (int32, int64, uint64, double) and makes sense for a run; floats must be finite.
    "sync_every": (1, INT32_MAX, True, True),
    "outer_lr": (0.0, 100.0, False, True),
    "outer_momentum": (0.0, 1.0, True, False),
    "error_feedback_decay": (0.0, 1.0, False, True),
    "staleness_weight": (0.0, 1.0, False, True),
    "max_staleness": (1, 1000, True, True),
    "clip_norm": (0.0, 1e30, True, True),
    "max_delta_norm": (0.0, 1e30, True, True),
    "quorum": (1, MAX_ISLANDS, True, True),
    "round_deadline_seconds": (0.0, 1e7, False, True),
    "lease_seconds": (0.0, 1e6, False, True),
    "total_rounds": (0, 2**53, True, True),
    "max_tokens_per_round": (0, 2**62, True, True),
}
"""Every numeric setting's allowed range: checked in one place (RunConfig itself), so the command
line, ``POST /api/config`` and a restored snapshot all take the same values."""


def check_range(name: str, value, low, high, low_in: bool, high_in: bool) -> None:
    """ValueError naming the field and its range unless ``value`` is a finite number inside it."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    inside = (
        is_number
        and math.isfinite(value)
        and (value >= low if low_in else value > low)
        and (value <= high if high_in else value < high)
    )
    if not inside:
        lo, hi = "[" if low_in else "(", "]" if high_in else ")"
        raise ValueError(f"{name} must be in {lo}{_num(low)}, {_num(high)}{hi}, got {value!r}")


def _num(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


MATH_FIELDS = (
    "run_id",
    "sync_every",
    "outer_lr",
    "outer_momentum",
    "nesterov",
    "codec",
    "downlink_codec",
    "error_feedback",
    "error_feedback_decay",
    "aggregation",
    "outer_mode",
    "decoupled_step",
)
"""Fields that define the run's math or model: a restart may not change them."""
OPERATIONAL_FIELDS = (
    "quorum",
    "round_deadline_seconds",
    "grace_window",
    "lease_seconds",
    "late_policy",
    "staleness_weight",
    "max_staleness",
    "clip_norm",
    "max_delta_norm",
    "total_rounds",
    "max_tokens_per_round",
)
"""Fields an operator may change on a live or restarted run (``POST /api/config``, or the command line)."""


class ConfigMismatch(ValueError):
    """The configuration asked for cannot apply to the stored run."""


def reconcile(stored: RunConfig, requested: RunConfig, given: frozenset[str]) -> tuple[RunConfig, list[str]]:
    """The config of a restored run: ``stored``, with the operational fields in ``given`` taken from
    ``requested``. A math field in ``given`` that differs is refused. Returns the config and one line
    per changed field."""
    if "run_id" in given and requested.run_id != stored.run_id:
        raise ConfigMismatch(f"the state dir holds run {stored.run_id!r}, not {requested.run_id!r}")
    differ = [
        f"{name} (run: {getattr(stored, name)!r}, asked: {getattr(requested, name)!r})"
        for name in MATH_FIELDS
        if name in given and getattr(requested, name) != getattr(stored, name)
    ]
    if differ:
        raise ConfigMismatch("these fields define the run's math and cannot change on a restart: " + "; ".join(differ))
    return apply_operational(stored, {name: getattr(requested, name) for name in OPERATIONAL_FIELDS if name in given})


def apply_operational(config: RunConfig, values: dict) -> tuple[RunConfig, list[str]]:
    """``config`` with operational ``values`` applied (ValueError for other fields or bad values);
    returns the new config and one line per field that changed."""
    unknown = sorted(set(values) - set(OPERATIONAL_FIELDS))
    if unknown:
        raise ConfigMismatch(f"not operational fields (only {', '.join(OPERATIONAL_FIELDS)} can change): {unknown}")
    values = {k: _typed(k, v) for k, v in values.items()}
    changes = [f"{k}: {getattr(config, k)!r} -> {v!r}" for k, v in values.items() if getattr(config, k) != v]
    return dataclasses.replace(config, **values), changes


def _typed(name: str, value):
    """``value`` as the field's type (JSON gives 2.0 for 2 and never a tuple); ValueError otherwise."""
    kind = {f.name: f.type for f in dataclasses.fields(RunConfig)}[name]
    ok = {
        "int": isinstance(value, int) or (isinstance(value, float) and value.is_integer()),
        "float": isinstance(value, (int, float)),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
    }[kind]
    if not ok or (kind != "bool" and isinstance(value, bool)):
        raise ConfigMismatch(f"{name} must be a {kind}, got {value!r}")
    return {"int": int, "float": float, "str": str, "bool": bool}[kind](value)
