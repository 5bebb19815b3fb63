"""A sync round's sum in a fixed order: the pushes enter it sorted by island id, whatever order they
arrive in, so θ_{r+1} has the same bits for the same set of pushes (fp32 addition does not associate:
with three or more contributions the arrival order used to show in the last bits)."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from support.core import IDENT, SHAPES, join, pull, push, rand
from support.servers import FakeClock

from atoll.coordinator.config import RunConfig
from atoll.coordinator.policy import order
from atoll.coordinator.policy.rounds import Decision, decide
from atoll.coordinator.run.decider import view
from atoll.coordinator.run.options import LimitsOptions
from atoll.coordinator.run.run_state import RunState
from atoll.protos.vocabulary import PushKind


# ---- the pure decision: every arrival order, every set that comes ---------------------------------
def simulate(islands: list[str], arrival: list[str], never: set[str]) -> list[str]:
    """The order the sum takes contributions in when ``arrival`` (those not in ``never``) commit in
    that order and the islands in ``never`` drop out after the rest came, as the core does: a
    contribution is held unless :func:`order.may_add`, the held ones are let in as :func:`order.ready`
    says after each, and what is still held enters, sorted, at the close."""
    sequence: list[str] = []
    held: set[str] = set()
    committed: set[str] = set()
    for island in [i for i in arrival if i not in never]:
        waiting = set(islands) - committed
        if order.may_add(island, len(sequence), waiting | held):
            sequence.append(island)
        else:
            held.add(island)
        committed.add(island)
        while turn := order.ready(held, len(sequence), set(islands) - committed):
            sequence += turn
            held -= set(turn)
    return sequence + sorted(held)  # the close


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_every_arrival_order_and_every_dropout_sums_in_the_fixed_order(n):
    islands = [f"island-{i}" for i in range(n)]
    seen = 0
    for arrival in itertools.permutations(islands):
        for k in range(n):
            for never in itertools.combinations(islands, k):
                sequence = simulate(islands, list(arrival), set(never))
                assert sorted(sequence) == sorted(set(islands) - set(never))
                assert order.order_of(sequence) == order.FIXED, (arrival, never, sequence)
                seen += 1
    assert seen == sum(1 for _ in itertools.permutations(islands)) * (2**n - 1)


def test_the_first_two_enter_as_they_come_and_only_out_of_order_ones_wait():
    abc = {"a", "b", "c"}
    assert order.may_add("b", 0, abc)  # one ahead of it and an empty sum: b + a is a + b
    assert not order.may_add("c", 0, abc)  # two ahead of it
    assert not order.may_add("c", 1, {"a", "c"})  # b is in: a must come before c
    assert order.may_add("c", 2, {"c"})
    assert order.ready({"c", "d"}, 2, set()) == ["c", "d"]
    assert order.ready({"c", "d"}, 1, {"b"}) == []
    assert order.order_of(["b", "a", "c"]) == order.FIXED
    assert order.order_of(["a", "c", "b"]) == order.ARRIVAL


# ---- the core: three islands' pushes in every order, the same bits ------------------------------
def one_round(
    tmp_path, arrival: list[str], deltas: dict, tokens: dict, members=None, budget: int = 0, **config
) -> tuple[dict, dict]:
    """θ_1 and round 0's record when ``members`` (default: the islands of ``deltas``) join, "a" uploads
    θ_0, and the islands in ``arrival`` push in that order; the round closes once the decider says so
    (at its deadline when a member stays silent)."""
    members = sorted(members or deltas)
    s = RunState(
        RunConfig(run_id="t", codec="identity", downlink_codec="identity", sync_every=1, outer_lr=0.7,
                  outer_momentum=0.9, grace_window="off", **config),
        tmp_path / "state", clock=FakeClock(), limits=LimitsOptions(max_inflight_bytes=budget),
    )  # fmt: skip
    for island in members:
        join(s, island)
    assert asyncio.run(push(s, "a", rand(0), kind=PushKind.INIT)).committed
    for island in members:
        pull(s, island, -1)
    for island in arrival:
        assert asyncio.run(push(s, island, deltas[island], tokens=tokens[island])).committed
    decision, reason = decide(s.clock(), view(s), s.policy())
    if decision is not Decision.CLOSE:  # a silent member: the deadline
        s.clock.now += s.config.round_deadline_seconds
        decision, reason = decide(s.clock(), view(s), s.policy())
    assert decision is Decision.CLOSE, reason
    asyncio.run(s.close_round(reason))
    assert s.round == 1 and s.accumulator.budget.used == 0 and not s.accumulator.held
    return {n: t.clone() for n, t in s.model.params.items()}, s.history[-1].to_json()


def test_three_islands_pushes_in_any_order_make_the_same_theta_bit_for_bit(tmp_path):
    names = ["a", "b", "c"]
    deltas = {n: {k: v * 10 ** (i - 1) for k, v in rand(10 + i).items()} for i, n in enumerate(names)}
    tokens = {"a": 3, "b": 7, "c": 5}
    thetas, records = [], []
    for i, arrival in enumerate(itertools.permutations(names)):
        theta, record = one_round(tmp_path / str(i), list(arrival), deltas, tokens)
        thetas.append(theta)
        records.append(record)
    for theta in thetas[1:]:
        assert all(torch.equal(theta[n], thetas[0][n]) for n in SHAPES)
    assert [r["sum_order"] for r in records] == [order.FIXED] * 6
    assert all(r["islands"] == names for r in records)


DELTAS = {n: {k: v * 10 ** (i % 3 - 1) for k, v in rand(10 + i).items()} for i, n in enumerate("abcd")}
TOKENS = {"a": 3, "b": 7, "c": 5, "d": 2}


def test_a_member_that_never_pushes_leaves_the_others_in_the_fixed_order_at_the_close(tmp_path):
    """d and c come before b, and a never does: b enters first (the sum's first two commute), c and d
    wait for a until the round closes at its deadline without it, then enter in their order: the bits
    of b, c, d arriving in order."""
    deltas = {k: DELTAS[k] for k in "bcd"}
    held, held_record = one_round(tmp_path / "held", ["d", "c", "b"], deltas, TOKENS, "abcd", quorum=3)
    calm, _ = one_round(tmp_path / "calm", ["b", "c", "d"], deltas, TOKENS, "abcd", quorum=3)
    assert all(torch.equal(held[n], calm[n]) for n in SHAPES)
    assert held_record["sum_order"] == order.FIXED and held_record["islands"] == ["b", "c", "d"]


def test_held_pushes_stay_within_half_the_budget_and_past_it_enter_as_they_come(tmp_path):
    """With room for three pushes, half of it holds one: d waits, c then enters at once (out of the
    order, so the pushes it waits for are admitted; so does b), and the round's record says so."""
    one = sum(len(IDENT.encode(t.contiguous())) for t in DELTAS["a"].values())  # a push's bytes
    theta, record = one_round(tmp_path, ["d", "c", "b", "a"], DELTAS, TOKENS, budget=3 * one)
    assert record["sum_order"] == order.ARRIVAL
    calm, calm_record = one_round(tmp_path / "calm", ["a", "b", "c", "d"], DELTAS, TOKENS, budget=3 * one)
    assert calm_record["sum_order"] == order.FIXED
    for n in SHAPES:  # the same sum but for the order: within fp32 rounding, here not the same bits
        torch.testing.assert_close(theta[n], calm[n], rtol=1e-6, atol=1e-6)
