"""The open round's accumulator built by hand: classifying pushes, staging ranks, the in-flight budget,
order-independent sums."""

from __future__ import annotations

import math

import pytest
import torch

from atoll.compression import get_codec
from atoll.coordinator.errors import Reason, RequestError
from atoll.coordinator.policy.weighting import PushClass, classify
from atoll.coordinator.regions import Region
from atoll.coordinator.state.accumulator import RoundAccumulator
from atoll.coordinator.state.budget import InflightBudget, Reservation
from atoll.coordinator.state.plans import Committed, EntryPlan, PushPlan, StagedRank


def plan(island="a", round_=0, rank=0, num_ranks=2, nbytes=10):
    return PushPlan(
        island, round_, False, rank, num_ranks, 5, None, "identity", (EntryPlan("w", Region((0,), (2,)), nbytes),)
    )


# ---- staging and the budget -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("push", "open_", "sealed", "fold", "want"),
    [
        (3, 3, False, False, PushClass.NEW),
        (4, 3, False, False, PushClass.FUTURE),
        (2, 3, False, False, PushClass.CLOSED),
        (2, 3, False, True, PushClass.LATE),
        (1, 3, False, True, PushClass.CLOSED),  # beyond max_staleness 1
        (3, 3, True, True, PushClass.CLOSED),  # sealed: the outer step is computed
        (4, 3, True, False, PushClass.FUTURE),
    ],
)
def test_classify(push, open_, sealed, fold, want):
    assert classify(push, open_, sealed=sealed, fold=fold, max_staleness=1) is want


def test_staging_commits_an_island_whole_and_releases_its_budget():
    staging = RoundAccumulator(max_inflight_bytes=100)
    budget = staging.budget
    held = []
    for rank in (1, 0):
        r = staging.open_stream("a", rank, 10)
        held.append(r)
        ranks = staging.stage(StagedRank(plan(rank=rank), [b"x"], r), num_ranks=2)
    assert [s.plan.rank for s in ranks] == [0, 1] and staging.pending == {}
    assert budget.used == 20  # the caller releases once decoded
    staging.commit("a", 0, Committed(1, None, 20, 1.0), late=False)
    assert staging.is_duplicate("a", 0, 0, PushClass.NEW) and staging.is_done("a", 0, PushClass.NEW)
    # A half-staged island is dropped with its bytes.
    r = staging.open_stream("b", 0, 30)
    assert staging.stage(StagedRank(plan("b", rank=0), [b"y"], r), num_ranks=2) is None
    staging.drop_island("b")
    assert budget.used == 20 and r.bytes == 0
    for h in held:
        h.release()
    assert budget.used == 0 and budget.peak == 50


def test_the_budget_refuses_past_its_limit_and_advance_drops_old_staged_pushes():
    budget = InflightBudget(25)
    r = Reservation(budget)
    r.add(20)
    with pytest.raises(RequestError) as info:
        r.add(6)
    assert info.value.reason is Reason.INFLIGHT_BUDGET and r.bytes == 20
    staging = RoundAccumulator()
    staging.stage(StagedRank(plan(round_=0), [b"z"], r), num_ranks=2)
    staging.advance(keep_from=1)
    assert staging.pending == {} and budget.used == 0


def test_a_push_is_admitted_or_refused_for_its_declared_size_at_its_header():
    """(Before: the reservation grew as bytes arrived, so a push over the budget was refused at its
    last bytes, after they had crossed the wire, and sent again whole.)"""
    acc = RoundAccumulator(max_inflight_bytes=100)
    first = acc.open_stream("a", 0, 60)
    assert acc.budget.used == 60
    with pytest.raises(RequestError) as info:
        acc.open_stream("b", 0, 41)  # refused before a byte of it is read
    assert info.value.reason is Reason.INFLIGHT_BUDGET and acc.budget.used == 60
    assert ("b", 0) not in acc.streams  # a refused stream holds nothing: its retry is not "in progress"
    with pytest.raises(RequestError) as info:
        acc.open_stream("a", 0, 1)
    assert info.value.reason is Reason.PUSH_IN_PROGRESS
    first.release()
    acc.close_stream("a", 0)
    assert acc.open_stream("b", 0, 41).bytes == 41


def test_the_default_budget_admits_two_whole_fp32_pushes_of_a_model_of_many_tensors():
    """The 124M measurement: 196 tensors, 124,439,808 parameters; the default was exactly 2 × 4 bytes
    per parameter, and two identity pushes with their framing are 4,376 bytes more."""
    from atoll.compression import get_codec
    from atoll.coordinator.state.accumulator import fp32_push_bytes

    specs = {f"h.{i}.w": (768, 768) for i in range(160)} | {f"h.{i}.b": (768,) for i in range(36)}
    specs["wte"] = (50257, 768)
    ident = get_codec("identity")
    one_push = sum(ident.encoded_size(s) for s in specs.values())
    acc = RoundAccumulator()
    acc.size_budget(specs)
    assert fp32_push_bytes(specs) >= one_push
    assert acc.budget.limit >= 2 * one_push > 2 * 4 * sum(math.prod(s) for s in specs.values())
    acc.open_stream("a", 0, one_push)
    acc.open_stream("b", 0, one_push)  # both admitted on the first try


@pytest.mark.parametrize("spec", ["identity", "int8"])
def test_accumulating_two_islands_regions_is_independent_of_arrival_order(spec):
    """Pushes are decoded into the accumulator as they arrive. For regions that are contiguous (row
    blocks) and for those that are not (column blocks, as a tensor-parallel rank holds), two islands
    sum to bitwise the same accumulator in either order: runs repeat across processes."""
    from atoll.coordinator.regions import Region
    from atoll.coordinator.state.accumulator import accumulate
    from atoll.coordinator.state.plans import EntryPlan, PushPlan, StagedRank

    codec = get_codec(spec)
    gen = torch.Generator().manual_seed(5)
    halves = {"rows": [((0, 0), (32, 48)), ((32, 0), (32, 48))], "cols": [((0, 0), (64, 24)), ((0, 24), (64, 24))]}

    def island(scale: float) -> list[StagedRank]:
        delta = torch.randn(64, 48, generator=gen) * scale
        ranks = []
        for rank, (offsets, sizes) in enumerate(halves["rows"] + halves["cols"]):
            region = Region(offsets, sizes)
            name = "rows" if rank < 2 else "cols"
            payload = codec.encode(delta[region.slices()].contiguous(), {})
            entry = EntryPlan(name, region, len(payload))
            plan = PushPlan("x", 0, False, rank, 4, 1, None, spec, (entry,))
            ranks.append(StagedRank(plan, [payload]))
        return ranks

    a, b = island(1.0), island(1e-3)

    def total(first, second):
        accum = {"rows": torch.zeros(64, 48), "cols": torch.zeros(64, 48)}
        accumulate(first[0], accum, codec, first[1])
        accumulate(second[0], accum, codec, second[1])
        return accum

    ab, ba = total((a, 3.0), (b, 7.0)), total((b, 7.0), (a, 3.0))
    for name in ("rows", "cols"):
        assert torch.equal(ab[name], ba[name]), name


@pytest.mark.parametrize("spec", ["int8", "identity", "int4:scale=fp16"])
def test_a_sum_over_old_values_counts_them_as_zero(spec):
    """A round's sum reuses the θ a publish replaced without zeroing it: the first contribution to a
    tensor is written (the bits adding it to zeros gives), a partial region zeroes its tensor first,
    a dense add too, and a tensor nobody contributed to comes out of take() zeroed."""
    codec = get_codec(spec)
    gen = torch.Generator().manual_seed(5)
    shapes = {"whole": (300, 7), "halves": (64, 48), "dense": (5,), "none": (3, 3)}
    deltas = [{k: torch.randn(s, generator=gen) for k, s in shapes.items() if k != "none"} for _ in range(2)]

    def ranks(delta: dict) -> list[StagedRank]:
        out = []
        for name, region in [("whole", Region((0, 0), (300, 7))), ("halves", Region((0, 0), (32, 48)))]:
            payload = codec.encode(delta[name][region.slices()].contiguous(), {})
            entry = EntryPlan(name, region, len(payload))
            out.append(StagedRank(PushPlan("x", 0, False, len(out), 2, 1, None, spec, (entry,)), [payload]))
        return out

    def run(sums: dict, stale: set) -> dict:
        acc = RoundAccumulator()
        acc.reset(sums, stale)
        for delta, weight in zip(deltas, (3.0, 0.7), strict=True):
            acc.add(ranks(delta), codec, weight)
            acc.add_dense(("x", 0), {"dense": delta["dense"]}, weight, mean=True)
        return acc.take("mean", 0.0)[0]

    want = run({k: torch.zeros(s) for k, s in shapes.items()}, set())
    old = {k: torch.full(s, float("nan")) for k, s in shapes.items()}
    got = run(old, set(shapes))
    for name in shapes:
        assert torch.equal(got[name], want[name]), name
        assert got[name] is old[name]  # the storage it was given
    assert not got["none"].any() and got["halves"][32:].abs().sum() == 0
