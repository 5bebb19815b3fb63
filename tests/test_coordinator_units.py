"""The coordinator's parts built by hand, without gRPC: membership, staging and the in-flight budget,
the downlink, the outer step, config reconciliation and persistence. Clocks are moved by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from atoll.compression import codec_of, get_codec
from atoll.coordinator import persistence
from atoll.coordinator.config import ConfigMismatch, RunConfig, apply_operational, reconcile
from atoll.coordinator.downlink import Downlink, identity_size
from atoll.coordinator.errors import Reason, RequestError
from atoll.coordinator.membership import IslandState, Membership, island_state
from atoll.coordinator.outer import NesterovSGD, outer_step_
from atoll.coordinator.regions import Region
from atoll.coordinator.rounds import IslandView, RoundPolicy, RoundView, stall
from atoll.coordinator.staging import (
    EntryPlan,
    InflightBudget,
    PushClass,
    PushPlan,
    Reservation,
    StagedRank,
    Staging,
    classify,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def membership(lease: float = 10.0) -> tuple[Membership, Clock]:
    clock = Clock()
    return Membership(clock, lambda: lease), clock


def reason(err: RequestError) -> Reason:
    return err.reason


# ---- membership -------------------------------------------------------------------------------
def test_leases_expire_and_renew_with_calls():
    m, clock = membership()
    rec, new = m.join("a", num_ranks=1, session_id="s1", round_=0)
    assert new and rec.lease_expires_at == 110.0
    clock.now = 105.0
    m.touch("a", "s1")
    assert rec.lease_expires_at == 115.0
    clock.now = 115.0
    assert [r.island_id for r in m.newly_expired()] == ["a"] and m.newly_expired() == []  # reported once
    assert island_state(rec, clock(), 0) == IslandState.GONE
    with pytest.raises(RequestError) as info:
        m.touch("ghost")
    assert reason(info.value) is Reason.NOT_JOINED


def test_a_second_live_process_with_the_same_id_is_refused_and_takes_over_once_the_lease_lapses():
    m, clock = membership()
    m.join("a", num_ranks=1, session_id="first", round_=0)
    with pytest.raises(RequestError) as info:
        m.join("a", num_ranks=1, session_id="second", round_=0)
    assert reason(info.value) is Reason.SESSION_CONFLICT and "another live process" in info.value.message
    rec, _ = m.join("a", num_ranks=1, session_id="first", round_=0)  # the same process again: welcome
    clock.now = rec.lease_expires_at
    rec, new = m.join("a", num_ranks=1, session_id="second", round_=3)
    assert new and rec.session_id == "second" and rec.joined_round == 3
    with pytest.raises(RequestError) as info:  # the old process is now a stranger
        m.touch("a", "first")
    assert reason(info.value) is Reason.NOT_JOINED


def test_a_restored_member_is_claimed_by_the_first_session_that_joins():
    m, _ = membership()
    m.restore({"a": {"num_ranks": 2, "joined_round": 1, "rounds_committed": 3}}, {"b": IslandState.LEFT})
    assert list(m.islands) == ["a"] and m.islands["a"].session_id == ""
    rec, new = m.join("a", num_ranks=2, session_id="s", round_=4)
    assert not new and rec.session_id == "s" and rec.rounds_committed == 3


def test_departures_are_remembered_and_eviction_is_for_good():
    m, _ = membership()
    for i in "abc":
        m.join(i, num_ranks=1, session_id=i, round_=0)
    m.leave("a")
    m.evict("b")
    assert sorted(m.islands) == ["c"] and m.departed == {"a": IslandState.LEFT, "b": IslandState.EVICTED}
    assert m.to_json()["departed"] == m.departed
    m.join("a", num_ranks=1, session_id="a2", round_=1)  # a left cleanly: it may come back
    assert "a" not in m.departed
    with pytest.raises(RequestError) as info:
        m.join("b", num_ranks=1, session_id="b2", round_=1)
    assert reason(info.value) is Reason.EVICTED
    with pytest.raises(KeyError):
        m.evict("nobody")


def test_the_bootstrap_claim_moves_when_its_holder_leaves_or_goes_silent():
    m, clock = membership(lease=5.0)
    m.join("rogue", num_ranks=1, session_id="r", round_=0)
    m.join("real", num_ranks=1, session_id="x", round_=0)
    assert m.claim_bootstrap("rogue") and not m.claim_bootstrap("real")
    clock.now += 3.0
    m.touch("real", "x")
    clock.now += 2.5  # the rogue's lease lapsed, the real island's did not
    assert m.claim_bootstrap("real") and m.bootstrapper == "real"
    m.leave("real")
    assert m.bootstrapper is None


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


def plan(island="a", round_=0, rank=0, num_ranks=2, nbytes=10):
    return PushPlan(
        island, round_, False, rank, num_ranks, 5, None, "identity", (EntryPlan("w", Region((0,), (2,)), nbytes),)
    )


def test_staging_commits_an_island_whole_and_releases_its_budget():
    budget = InflightBudget(100)
    staging = Staging()
    held = []
    for rank in (1, 0):
        r = Reservation(budget)
        r.add(10)
        held.append(r)
        ranks = staging.stage(StagedRank(plan(rank=rank), [b"x"], r), num_ranks=2)
    assert [s.plan.rank for s in ranks] == [0, 1] and staging.pending == {}
    assert budget.used == 20  # the caller releases once decoded
    staging.commit("a", 0, None, late=False)
    assert staging.is_duplicate("a", 0, 0, PushClass.NEW) and staging.is_done("a", 0, PushClass.NEW)
    # A half-staged island is dropped with its bytes.
    r = Reservation(budget)
    r.add(30)
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
    assert reason(info.value) is Reason.INFLIGHT_BUDGET and r.bytes == 20
    staging = Staging()
    staging.stage(StagedRank(plan(round_=0), [b"z"], r), num_ranks=2)
    staging.advance(keep_from=1)
    assert staging.pending == {} and budget.used == 0


# ---- downlink -----------------------------------------------------------------------------------
def test_downlink_serves_regions_exactly_and_the_full_theta_one_entry_at_a_time(tmp_path):
    theta = {"w": torch.randn(6, 4), "b": torch.randn(5)}
    update = {"w": torch.randn(6, 4)}
    int8 = get_codec("int8")
    down = Downlink(tmp_path, window=2)
    persistence.save_update(tmp_path, 3, {"w": int8.encode(update["w"])}, keep_from=2)
    down.restore(3)
    assert down.latest_round == 3 and down.can_catch_up(2, 3) and not down.can_catch_up(0, 3)
    region = Region((2, 0), (3, 4))
    entries = down.delta_entries(3, [("w", None), ("w", region)], {"w": (6, 4)})
    whole = codec_of(entries[0].payload()).decode(entries[0].payload(), (6, 4))
    sliced = get_codec("identity").decode(entries[1].payload(), (3, 4))
    assert entries[1].num_bytes == identity_size((3, 4)) and torch.equal(sliced, whole[2:5])
    full = Downlink.full_entries(theta, [("w", None), ("b", None)])
    assert all(callable(e.data) for e in full)  # nothing encoded until sent
    joined = [b"".join(bytes(p) for p in e.parts()) for e in full]
    assert [len(j) for j in joined] == [e.num_bytes for e in full]
    assert torch.equal(get_codec("identity").decode(joined[1], (5,)), theta["b"])
    body = full[0].parts()[1]  # θ's own memory, not a copy
    assert body.obj is not None and np.shares_memory(np.asarray(body), theta["w"].numpy())


# ---- the outer step ---------------------------------------------------------------------------
@pytest.mark.parametrize("downlink", ["identity", "int8"])
def test_outer_step_in_place_matches_numpy(downlink):
    rng = np.random.default_rng(0)
    shapes = {"w": (5, 3), "bn.running_mean": (3,)}
    theta = {k: torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for k, s in shapes.items()}
    deltas = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in range(2)]
    weights = [3.0, 1.0]
    accum = {k: torch.zeros(s) for k, s in shapes.items()}
    for w, d in zip(weights, deltas, strict=True):
        for k in shapes:
            accum[k].add_(torch.from_numpy(d[k]), alpha=w)
    opt = NesterovSGD({"w": shapes["w"]}, lr=0.7, momentum=0.9, nesterov=True)
    codec = get_codec(downlink)
    ef = {k: torch.zeros(s) for k, s in shapes.items()}
    payloads = outer_step_(
        accum,
        theta,
        weight_total=4.0,
        optimizer=opt,
        buffers=frozenset({"bn.running_mean"}),
        downlink=codec,
        downlink_ef=ef,
        downlink_state={},
    )
    g = {k: (3 * deltas[0][k] + deltas[1][k]).astype(np.float64) / 4 for k in shapes}
    u = {"w": -0.7 * (g["w"] + 0.9 * g["w"]), "bn.running_mean": -g["bn.running_mean"]}  # m = g after one step
    for k in shapes:
        sent = codec.decode(payloads[k], shapes[k])
        assert torch.equal(accum[k], theta[k] + sent)  # exactly what an island adds to θ_r
        np.testing.assert_allclose(sent.numpy() + ef[k].numpy(), u[k], atol=1e-5)
        if downlink == "identity":
            assert not ef[k].any()
    np.testing.assert_allclose(opt.buffers["w"].numpy(), g["w"], atol=1e-6)


# ---- rounds.stall -----------------------------------------------------------------------------
def test_stall_says_what_would_unblock_the_round():
    islands = (
        IslandView(island_id="a", lease_expires_at=50.0, committed=True),
        IslandView(island_id="b", lease_expires_at=5.0, committed=False),
    )
    state = RoundView(round=4, opened_at=0.0, islands=islands)
    policy = RoundPolicy(quorum=2, deadline_seconds=10.0)
    assert stall(4.0, state, policy) is None  # b is still alive
    why = stall(6.0, state, policy)
    assert "cannot reach quorum 2" in why and "gone: b" in why and "--quorum 1" in why
    assert stall(6.0, RoundView(round=4, opened_at=0.0, islands=()), policy) is None  # nobody there yet


# ---- config -----------------------------------------------------------------------------------
def test_reconcile_applies_operational_fields_and_refuses_math_changes():
    stored = RunConfig(run_id="r", quorum=2, codec="int8", outer_lr=0.7)
    asked = RunConfig(run_id="r", quorum=1, codec="int8", outer_lr=0.7, round_deadline_seconds=60.0)
    config, changes = reconcile(stored, asked, frozenset({"run_id", "quorum", "codec"}))
    assert config.quorum == 1 and config.round_deadline_seconds == 600.0  # not given: the stored value
    assert changes == ["quorum: 2 -> 1"]
    with pytest.raises(
        ConfigMismatch, match=r"outer_lr \(run: 0.7, asked: 0.5\); codec \(run: 'int8', asked: 'identity'\)"
    ):
        reconcile(stored, RunConfig(run_id="r", codec="identity", outer_lr=0.5), frozenset({"codec", "outer_lr"}))
    with pytest.raises(ConfigMismatch, match="holds run 'r', not 'x'"):
        reconcile(stored, RunConfig(run_id="x"), frozenset({"run_id"}))


def test_apply_operational_checks_names_and_types():
    c = RunConfig()
    assert apply_operational(c, {"quorum": 3.0})[0].quorum == 3
    for bad in ({"codec": "int8"}, {"quorum": "2"}, {"quorum": True}, {"quorum": 0}):
        with pytest.raises(ValueError):
            apply_operational(c, bad)


# ---- persistence --------------------------------------------------------------------------------
def snap(round_: int) -> persistence.Snapshot:
    params = {"w": torch.full((3, 2), float(round_))}
    history = [{"round": i} for i in range(round_)]
    return persistence.Snapshot(RunConfig(run_id="p"), round_, params, {"momentum/w": torch.zeros(3, 2)}, {}, history)


def test_snapshots_are_kept_verified_and_rolled_back(tmp_path):
    for r in range(4):
        persistence.save(tmp_path, snap(r), keep=2)
    assert [persistence.read_round(p) for p in persistence.snapshot_paths(tmp_path)] == [2, 3]
    assert persistence.load(tmp_path).round == 3
    persistence.rollback(tmp_path, 2)
    assert persistence.load(tmp_path).round == 2 and len(list((tmp_path / "discarded").rglob("*.safetensors"))) == 1
    with pytest.raises(persistence.StateError, match="kept rounds: 2"):
        persistence.rollback(tmp_path, 0)


def test_an_empty_or_foreign_dir_is_a_fresh_run_but_a_dir_of_atoll_leftovers_is_not(tmp_path):
    assert persistence.load(tmp_path / "nope") is None
    (tmp_path / "notes.txt").write_text("unrelated")
    assert persistence.load(tmp_path) is None
    (tmp_path / persistence.MEMBERSHIP).write_text("{}")
    with pytest.raises(persistence.StateError, match="no valid snapshot"):
        persistence.load(tmp_path)


def test_updates_are_kept_for_the_window(tmp_path):
    for r in range(1, 6):
        persistence.save_update(tmp_path, r, {"w": bytearray(b"abc" * r)}, keep_from=r - 1)
    kept = [int(p.stem.split("-")[1]) for p in persistence.update_paths(tmp_path)]
    assert kept == [4, 5] and bytes(persistence.load_update(tmp_path, 5)["w"]) == b"abc" * 5
    assert persistence.load_update(tmp_path, 1) is None
    assert math.isclose(len(persistence.load_update(tmp_path, 4)["w"]), 12)


@pytest.mark.parametrize("spec", ["identity", "int8"])
def test_accumulating_two_islands_regions_is_independent_of_arrival_order(spec):
    """Pushes are decoded into the accumulator as they arrive. For regions that are contiguous (row
    blocks) and for those that are not (column blocks, as a tensor-parallel rank holds), two islands
    sum to bitwise the same accumulator in either order: runs repeat across processes."""
    from atoll.coordinator.regions import Region
    from atoll.coordinator.staging import EntryPlan, PushPlan, StagedRank, accumulate

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
