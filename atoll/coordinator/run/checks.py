"""Validation of what islands send: pure functions that raise a RequestError with a reason, or return
the checked value. Nothing here changes state (a refused request changes nothing)."""

from __future__ import annotations

import json
import math

from atoll.compression import available_codecs, codec_name, get_codec
from atoll.coordinator.config import RunConfig
from atoll.coordinator.errors import Reason, RequestError, invalid, refuse
from atoll.coordinator.messages import JoinRequest, PushHeader, TensorDecl, TensorKind, TensorRegion
from atoll.coordinator.regions import Region, check_coverage
from atoll.coordinator.state.plans import EntryPlan, StagedRank
from atoll.sharding import shard_of

MAX_ID_LEN = 128
MAX_RANKS = 65536
MAX_ALIASES = 16
MAX_REPORTED_SECONDS = 1e7
MAX_REPORTED_LOSS = 1e30
"""The largest magnitude of a loss an island may report (it is only shown, never used in the math): any
weighted mean of such values stays finite, and so do the status endpoints."""
PAYLOAD_SLACK = 65536
"""A payload may exceed 8 bytes per element by this much (headers, codec params)."""
MAX_TENSOR_NORM = 2.0**40
"""The largest L2 norm (1.1e12) a tensor of θ_0 or of a pseudo-gradient may decode to, by the bound its
codec gives from the payload (:meth:`atoll.compression.base.Codec.validate`). Far above any model's:
GPT-2's largest tensor has a norm near 100. It keeps every decoded value finite, and with the round's
running bound (:data:`atoll.coordinator.state.accumulator.SUM_LIMIT`) the weighted sum and the outer step."""


def run_id(config: RunConfig, given: str) -> None:
    if given != config.run_id:
        raise refuse(Reason.WRONG_RUN, f"run id {given!r} does not match this coordinator's run {config.run_id!r}")


def join(req: JoinRequest, shard: tuple[int, int], partition: str, config: RunConfig) -> int:
    """Check a join's routing and codec; returns the island's rank count."""
    if not req.island_id or len(req.island_id) > MAX_ID_LEN:
        raise invalid(f"island_id must be 1..{MAX_ID_LEN} characters")
    num_ranks = req.num_ranks or 1
    if not 1 <= num_ranks <= MAX_RANKS:
        raise invalid(f"num_ranks must be in 1..{MAX_RANKS}, got {req.num_ranks}")
    index, count = shard
    if (req.shard_index, req.num_shards or 1) != (index, count):
        raise refuse(
            Reason.SHARD_MISMATCH,
            f"island routes to shard {req.shard_index}/{req.num_shards or 1}; "
            f"this coordinator is shard {index}/{count}",
        )
    if (req.partition or "hash") != partition:
        raise refuse(
            Reason.SHARD_MISMATCH,
            f"island partitions tensors by {req.partition or 'hash'!r}; this coordinator by {partition!r}",
        )
    if partition == "hash":
        foreign = sorted(t.name for t in req.tensors if shard_of(t.name, count) != index)
        if foreign:
            raise refuse(Reason.SHARD_MISMATCH, f"tensors {foreign[:5]} do not belong to shard {index}/{count}")
    elif not req.layout_digest:
        raise invalid('partition "layers" needs the layout_digest of the whole model')
    model_card(req.model_card)
    offered_codec(config, req.codecs)
    return num_ranks


MAX_MODEL_CARD_BYTES = 64 << 10


def model_card(card: str) -> None:
    """A join's model card: empty, or a JSON object of at most 64 KiB (it is kept with the run)."""
    if not card:
        return
    if len(card.encode()) > MAX_MODEL_CARD_BYTES:
        raise invalid(f"model_card is {len(card.encode())} bytes, more than {MAX_MODEL_CARD_BYTES}")
    try:
        parsed = json.loads(card)
    except (ValueError, RecursionError):
        raise invalid("model_card is not JSON") from None
    if not isinstance(parsed, dict):
        raise invalid("model_card is not a JSON object")


def offered_codec(config: RunConfig, offered: tuple[str, ...]) -> None:
    """The island must offer the run's codec: by name (it takes the run's parameters), or as a spec
    with parameters, which must then be exactly the run's (refused here, before the island holds any
    claim on the run, rather than by the island after it joined)."""
    run = get_codec(config.codec).spec
    for c in offered:
        if codec_name(c) != codec_name(run) or ":" not in c:
            continue
        try:
            asked = get_codec(c).spec
        except ValueError as err:
            raise invalid(f"codec spec {c!r}: {err}") from None
        if asked != run:
            raise refuse(
                Reason.CODEC_MISMATCH,
                f"codec {asked!r} was asked for; run {config.run_id!r} uses {run!r} "
                "(pass the codec name alone to take the run's parameters)",
            )
    if codec_name(run) not in {codec_name(c) for c in offered}:
        unknown = [c for c in offered if codec_name(c) not in available_codecs()]
        raise refuse(
            Reason.CODEC_MISMATCH,
            f"run {config.run_id!r} uses codec {config.codec!r}; the island offers {list(offered)}"
            + (f" (unknown here: {unknown})" if unknown else ""),
        )


def tensors(decls: tuple[TensorDecl, ...]) -> dict[str, tuple[int, ...]]:
    """The declared model as {name: shape}."""
    specs: dict[str, tuple[int, ...]] = {}
    for t in decls:
        if not t.name:
            raise invalid("a tensor has an empty name")
        if t.name in specs:
            raise invalid(f"tensor {t.name!r} listed twice")
        if t.dtype is None:
            raise invalid(f"tensor {t.name!r}: unsupported dtype")
        if any(d < 0 for d in t.shape):
            raise invalid(f"tensor {t.name!r}: negative dim in shape {list(t.shape)}")
        specs[t.name] = tuple(int(d) for d in t.shape)
    if not specs:
        raise invalid("the island lists no tensors")
    return specs


def aliases_of(decls: tuple[TensorDecl, ...]) -> dict[str, tuple[str, ...]]:
    """Tied weights: each tensor's other names (none may be a tensor's name or another's alias)."""
    names = {t.name for t in decls}
    seen: set[str] = set()
    out = {}
    for t in decls:
        if not t.aliases:
            continue
        if len(t.aliases) > MAX_ALIASES:
            raise invalid(f"tensor {t.name!r} lists {len(t.aliases)} aliases (at most {MAX_ALIASES})")
        for a in t.aliases:
            if not a or a in names or a in seen:
                raise invalid(f"tensor {t.name!r}: alias {a!r} is empty, a tensor's name or listed twice")
            seen.add(a)
        out[t.name] = tuple(t.aliases)
    return out


def buffers_of(decls: tuple[TensorDecl, ...]) -> frozenset[str]:
    return frozenset(t.name for t in decls if t.kind is TensorKind.BUFFER)


def same_model(
    have: dict[str, tuple[int, ...]],
    got: dict[str, tuple[int, ...]],
    have_buffers: frozenset[str],
    got_buffers: frozenset[str],
) -> None:
    missing = sorted(have.keys() - got.keys())
    extra = sorted(got.keys() - have.keys())
    if missing or extra:
        hint = ""
        if set(missing) <= have_buffers and set(extra) <= got_buffers:
            hint = " (buffers: every island must sync buffers the same way, see DiLoCo(sync_buffers=))"
        raise refuse(
            Reason.MODEL_MISMATCH,
            f"model does not match the run: missing tensors {missing[:5]}, unknown tensors {extra[:5]}{hint}",
        )
    for name, shape in got.items():
        if have[name] != shape:
            raise refuse(
                Reason.MODEL_MISMATCH, f"tensor {name!r} has shape {list(shape)}, the run has {list(have[name])}"
            )
    kinds = sorted(have_buffers ^ got_buffers)
    if kinds:
        raise refuse(Reason.MODEL_MISMATCH, f"tensors {kinds[:5]} are buffers on one side and parameters on the other")


def codec(config: RunConfig, given: str) -> None:
    """A push's codec: a bad request when it is not the run's (the island joined with the run's)."""
    if codec_name(given) != codec_name(config.codec):
        raise RequestError(
            Reason.CODEC_MISMATCH,
            f"codec {given!r} is not the run's codec {config.codec!r}",
            code="INVALID_ARGUMENT",
        )


def tokens(config: RunConfig, claimed: int, inner_steps: int) -> None:
    """The tokens a push claims, and its inner steps (each step takes at least a token), within the
    run's bound per round: either weighs the island's delta in the mean."""
    bound = config.token_bound
    which = "--max-tokens-per-round" if config.max_tokens_per_round else "H x 2^24; set --max-tokens-per-round"
    for what, n in (("tokens", claimed), ("inner_steps", inner_steps)):
        if n > bound:
            raise refuse(
                Reason.TOKENS_OUT_OF_RANGE,
                f"the push claims {n} {what}, more than the run allows per round ({bound}: {which})",
            )


MAX_MEMBERS = 65536
"""The most islands one relay's push may report."""


def members(config: RunConfig, relay: bool, reported, island_id: str) -> None:
    """A push's member reports: only a relay's push has them, each a distinct island within the run's
    bounds (its tokens and inner steps, as an island's own push is checked)."""
    if not reported:
        return
    if not relay:
        raise invalid(f"island {island_id!r} reports members but did not join as a relay")
    if len(reported) > MAX_MEMBERS:
        raise invalid(f"a relay's push reports {len(reported)} members, more than {MAX_MEMBERS}")
    seen: set[str] = set()
    for m in reported:
        if not m.island_id or len(m.island_id) > MAX_ID_LEN or m.island_id in seen:
            raise invalid(f"member {m.island_id[:MAX_ID_LEN]!r}: empty, longer than {MAX_ID_LEN} or listed twice")
        seen.add(m.island_id)
        tokens(config, m.tokens, m.inner_steps)


def delta_round(round_: int, joined_round: int) -> bool:
    """Whether a delta for ``round_`` can be the island's: a round below 0 is a bad request; one before
    the island joined (it never held that θ) is False (not folded: the island is told the round closed)."""
    if round_ < 0:
        raise invalid(f"round {round_} is below 0")
    return round_ >= joined_round


def push_header(h: PushHeader, num_ranks: int, specs: dict[str, tuple[int, ...]]) -> tuple[EntryPlan, ...]:
    """Check a push header against the island and the model; returns its entries as regions."""
    if h.num_ranks != num_ranks:
        raise invalid(f"island {h.island_id!r} joined with {num_ranks} ranks, push says {h.num_ranks}")
    if not 0 <= h.rank < num_ranks:
        raise invalid(f"rank {h.rank} outside 0..{num_ranks - 1}")
    if h.loss is not None and not (math.isfinite(h.loss) and abs(h.loss) <= MAX_REPORTED_LOSS):
        raise invalid(f"reported loss {h.loss} is not finite, or past +-{MAX_REPORTED_LOSS:g}")
    for what, seconds in (("compute_seconds", h.compute_seconds), ("blocked_seconds", h.blocked_seconds)):
        if not (math.isfinite(seconds) and 0 <= seconds <= MAX_REPORTED_SECONDS):
            raise invalid(f"{what} {seconds} outside 0..{MAX_REPORTED_SECONDS:g}")
    entries = []
    for e in h.entries:
        shape = specs.get(e.name)
        if shape is None:
            raise invalid(f"unknown tensor {e.name!r}")
        try:
            region = Region.parse(e.offsets, e.sizes, shape)
        except ValueError as err:
            raise invalid(f"tensor {e.name!r}: {err}") from None
        bound = 8 * region.numel + PAYLOAD_SLACK
        if not 0 < e.num_bytes <= bound:
            raise invalid(f"tensor {e.name!r}: payload of {e.num_bytes} bytes outside 1..{bound}")
        entries.append(EntryPlan(e.name, region, e.num_bytes))
    return tuple(entries)


def magnitude(name: str, bound: float, init: bool) -> None:
    """A tensor's payload decodes to values whose norm is at most ``bound``: refused past
    :data:`MAX_TENSOR_NORM` (DELTA_TOO_LARGE), before it can count."""
    if not bound <= MAX_TENSOR_NORM:
        what = "θ_0 tensor" if init else "tensor"
        size = "overflows fp32" if math.isinf(bound) else f"is up to {bound:.3g}"
        raise refuse(
            Reason.DELTA_TOO_LARGE,
            f"{what} {name!r}: its norm {size}, past the most a run takes ({MAX_TENSOR_NORM:.3g})",
        )


def coverage(specs: dict[str, tuple[int, ...]], ranks: list[StagedRank], what: str) -> None:
    """The island's ranks must tile every tensor exactly once."""
    regions: dict[str, list[Region]] = {name: [] for name in specs}
    for staged in ranks:
        for entry in staged.plan.entries:
            regions[entry.name].append(entry.region)
    try:
        for name, shape in specs.items():
            check_coverage(name, shape, regions[name])
    except ValueError as err:
        raise refuse(Reason.INCOMPLETE_ISLAND, f"{what}: {err}") from None


def regions(entries: tuple[TensorRegion, ...], specs: dict[str, tuple[int, ...]]) -> list[tuple[str, Region | None]]:
    """A pull's regions, checked against the model (None: the whole tensor; no entries: every tensor)."""
    if not entries:
        return [(name, None) for name in specs]
    if len(entries) > 4 * len(specs) + 64:
        raise invalid(f"{len(entries)} regions requested for a model of {len(specs)} tensors")
    out = []
    for entry in entries:
        name, offsets, sizes = entry.name, entry.offsets, entry.sizes
        shape = specs.get(name)
        if shape is None:
            raise invalid(f"unknown tensor {name!r}")
        if not offsets and not sizes:
            out.append((name, None))
            continue
        try:
            out.append((name, Region.parse(offsets, sizes, shape)))
        except ValueError as err:
            raise invalid(f"tensor {name!r}: {err}") from None
    return out
