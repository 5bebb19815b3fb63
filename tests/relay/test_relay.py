"""Relays (``atoll relay``): islands behind a relay train the run a flat star would, the root takes one
push per relay, and a relay that cannot serve exactly is refused with its reason.

Real servers on loopback (the root, relays on their own event loops), islands speaking the protocol by
hand (:class:`RawIsland`), so every value is known: θ after the rounds is checked against a flat run of
the same deltas, and the islands' θ bit for bit against the root's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time

import grpc
import pytest
import torch
from coordinator.test_dashboard import CHROMIUM, render
from support.core import SHAPES as CORE_SHAPES
from support.core import join, push, rand, run_state
from support.pki import make_pki
from support.servers import LoopThread, RawIsland, ServerThread, exact_config, http, wait_for

from atoll.compression import codec_of
from atoll.coordinator.messages import JoinRequest, Member, TensorDecl
from atoll.coordinator.transport.options import NetworkOptions, SecurityOptions
from atoll.coordinator.transport.security import IslandTokens, TlsConfig
from atoll.islands import ClientTls
from atoll.islands.errors import WrongEndpoint
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.reasons import Reason
from atoll.protos.status import reason_of
from atoll.protos.vocabulary import PushKind
from atoll.relay.main import RelayOptions, RelayServer

SHAPES = {"w": (64, 33), "b": (33,)}


class RelayThread(LoopThread):
    """A relay (port 0) on its own event loop thread."""

    def __init__(
        self,
        upstream: str,
        relay_id: str,
        tmp_path,
        run_id: str = "t",
        tokens=None,
        upstream_token=None,
        tls=None,
        upstream_tls=None,
        grace_window=None,
    ) -> None:
        options = RelayOptions(
            upstream=upstream,
            run_id=run_id,
            relay_id=relay_id,
            network=NetworkOptions(port=0, bulk_port=0),
            security=SecurityOptions(tokens=None if tokens is None else IslandTokens(tokens), tls=tls),
            upstream_token=upstream_token,
            upstream_tls=upstream_tls,
            give_up_seconds=20.0,
            grace_window=grace_window,
        )
        super().__init__(RelayServer(options, tmp_path / relay_id))
        self.relay = self.server
        self.start()


def theta0() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def delta(island: int, round_: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * island + round_)
    return {n: torch.randn(s, generator=gen) * 0.01 for n, s in SHAPES.items()}


TOKENS = [100, 250, 40, 333]


def pull_round(island: RawIsland, have: int, timeout: float = 30.0):
    """The island's pull past ``have`` once it is ready: (header, payloads)."""

    def ready():
        header, payloads = island.pull(have, wait_seconds=2.0)
        return (header, payloads) if header.kind != pb.UPDATE_KIND_NOT_READY else None

    return wait_for(ready, timeout=timeout, what=f"{island.island_id}'s update past round {have}")


def apply(theta: dict[str, torch.Tensor], header, payloads) -> None:
    for entry, (_, payload) in zip(header.entries, payloads, strict=True):
        if header.kind == pb.UPDATE_KIND_FULL:
            theta[entry.name] = codec_of(payload).decode(payload, SHAPES[entry.name])
        else:
            codec_of(payload).add_decoded_(payload, theta[entry.name])


def started(islands: list[RawIsland], claim_at_join: bool = False) -> list[dict[str, torch.Tensor]]:
    """The first island uploads θ_0 (the claim may come with its relay's join of the root, or after;
    ``claim_at_join``: it must come with the join), the others join, and each pulls θ_0: their θ."""
    claimed = islands[0].join().bootstrap
    assert claimed or not claim_at_join
    if not claimed:
        wait_for(lambda: islands[0].pull(-1, wait_seconds=1.0)[0].bootstrap, what="the bootstrap claim")
    assert islands[0].push(theta0(), round_=0, kind=pb.PUSH_KIND_INIT).committed
    for isl in islands[1:]:
        isl.join()
    thetas = []
    for isl in islands:
        t = {}
        apply(t, *pull_round(isl, -1))
        thetas.append(t)
    return thetas


def train(
    addresses: list[str], rounds: int, codec: str = "identity", order=(0, 1, 2, 3)
) -> list[dict[str, torch.Tensor]]:
    """Four islands at ``addresses`` (one each) push the same deltas every round, in ``order``; returns
    their θ."""
    islands = [RawIsland(a, f"island-{i}", SHAPES, codec=codec) for i, a in enumerate(addresses)]
    try:
        thetas = started(islands)
        for r in range(rounds):
            for i in order:
                out = islands[i].push(delta(i, r), round_=r, tokens=TOKENS[i])
                assert out.outcome == pb.PUSH_OUTCOME_COMMITTED, out
            for isl, t in zip(islands, thetas, strict=True):
                header, payloads = pull_round(isl, r)
                assert header.kind == pb.UPDATE_KIND_DELTA and header.round == r + 1
                apply(t, header, payloads)
        return thetas
    finally:
        for isl in islands:
            isl.close()


@pytest.fixture
def servers():
    started = []
    yield started
    for s in reversed(started):
        s.stop()


def root(tmp_path, servers, name="root", config=None, **server_kwargs):
    """A root whose rounds wait for every live island (``grace_window`` off: the default's learned
    arrival times cut a round short when a push comes late on a loaded machine, and the trainings
    here compare whole runs)."""
    run = exact_config(
        **{
            "run_id": "t",
            "sync_every": 1,
            "outer_lr": 0.7,
            "outer_momentum": 0.9,
            "grace_window": "off",
            **(config or {}),
        }
    )
    srv = ServerThread(run, tmp_path / name, **server_kwargs)
    servers.append(srv.start())
    return srv


def test_two_relays_train_what_the_flat_star_trains_and_islands_hold_the_roots_theta_bitwise(tmp_path, servers):
    rounds = 3
    flat = root(tmp_path, servers, "flat")
    train([flat.address] * 4, rounds)
    want = flat.inspect(lambda s: {n: t.clone() for n, t in s.model.params.items()})

    top = root(tmp_path, servers)
    relays = [RelayThread(top.address, name, tmp_path) for name in ("eu", "us")]
    servers.extend(relays)
    thetas = train([relays[0].address, relays[0].address, relays[1].address, relays[1].address], rounds)
    got = top.inspect(lambda s: {n: t.clone() for n, t in s.model.params.items()})

    for name in SHAPES:  # the same run, but for the fp32 rounding of the sums' order
        rel = (got[name] - want[name]).norm() / want[name].norm()
        assert rel <= 1e-5, (name, float(rel))
        assert not torch.equal(got[name], theta0()[name])  # (it trained)
        for t in thetas:
            assert torch.equal(t[name], got[name])  # every island holds the root's θ, bit for bit
    for relay in relays:
        held = relay.inspect(lambda s: {n: t.clone() for n, t in s.model.params.items()})
        assert all(torch.equal(held[n], got[n]) for n in SHAPES)

    history = top.inspect(lambda s: [h.to_json() for h in s.history])
    assert len(history) == rounds
    last = history[-1]
    assert last["islands"] == ["eu", "us"]  # the root took one push per relay
    assert last["tokens_by_island"] == {
        "eu/island-0": TOKENS[0],
        "eu/island-1": TOKENS[1],
        "us/island-2": TOKENS[2],
        "us/island-3": TOKENS[3],
    }
    flat_in = flat.inspect(lambda s: s.history[-1].bytes_in)
    assert last["bytes_in"] <= flat_in / 2 * 1.01  # the root's ingress, by the fan-in of 2


def test_a_relay_chained_under_a_relay_serves_the_same_run(tmp_path, servers):
    top = root(tmp_path, servers)
    mid = RelayThread(top.address, "region", tmp_path)
    servers.append(mid)
    leaf = RelayThread(mid.address, "site", tmp_path)
    servers.append(leaf)
    thetas = train([leaf.address, leaf.address, mid.address, top.address], 2)
    got = top.inspect(lambda s: {n: t.clone() for n, t in s.model.params.items()})
    assert all(torch.equal(t[n], got[n]) for t in thetas for n in SHAPES)
    assert leaf.relay.upstream.chain == ("site", "region")
    last = top.inspect(lambda s: s.history[-1].to_json())
    assert last["islands"] == ["island-3", "region"]
    assert last["tokens_by_island"] == {  # the islands behind both relays, by name and tokens
        "island-3": TOKENS[3],
        "region/island-2": TOKENS[2],
        "region/site/island-0": TOKENS[0],
        "region/site/island-1": TOKENS[1],
    }


def test_a_relay_for_another_run_is_refused_with_the_upstreams_reason(tmp_path, servers):
    top = root(tmp_path, servers)
    relay = RelayThread(top.address, "eu", tmp_path, run_id="other")
    servers.append(relay)
    island = RawIsland(relay.address, "island-0", SHAPES, run_id="other")
    try:
        with pytest.raises(grpc.RpcError) as caught:
            island.join()
        assert reason_of(caught.value) is Reason.WRONG_RUN
    finally:
        island.close()


def test_a_relay_loop_is_refused_as_one(tmp_path, servers):
    a = RelayThread("127.0.0.1:1", "a", tmp_path)  # re-pointed below, once both have ports
    servers.append(a)
    b = RelayThread(a.address, "b", tmp_path)
    servers.append(b)
    a.relay.upstream.transport.close()  # a's upstream is b, now that b has a port
    a.relay.upstream.__init__(b.address, run_id="t", relay_id="a")
    a.relay.upstream.state = a.relay.server.state
    island = RawIsland(a.address, "island-0", SHAPES)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            wait_for(lambda: island.join(), timeout=60, what="the loop's refusal")
        assert reason_of(caught.value) is Reason.RELAY_LOOP
        assert "a -> b -> a" in caught.value.details()
    finally:
        island.close()


def test_a_push_for_a_round_the_relay_forwarded_is_told_so(tmp_path, servers):
    top = root(tmp_path, servers)
    relay = RelayThread(top.address, "eu", tmp_path)
    servers.append(relay)
    train([relay.address] * 2 + [top.address] * 2, 1)
    late = RawIsland(relay.address, "island-0", SHAPES)
    try:
        out = late.push(delta(0, 0), round_=0, tokens=5)
        assert out.outcome in (pb.PUSH_OUTCOME_DUPLICATE, pb.PUSH_OUTCOME_ROUND_CLOSED)
        assert out.outcome == pb.PUSH_OUTCOME_DUPLICATE and out.committed  # it counted, once
    finally:
        late.close()


def test_tokens_hold_on_both_hops(tmp_path, servers):
    top = root(tmp_path, servers, security=SecurityOptions(tokens=IslandTokens({"eu": "eu-secret", "us": "us-secret"})))
    good = RelayThread(top.address, "eu", tmp_path, tokens={"island-0": "t0"}, upstream_token="eu-secret")
    servers.append(good)
    bad = RelayThread(top.address, "us", tmp_path, upstream_token="eu-secret")  # another relay's token
    servers.append(bad)
    islands = [
        RawIsland(good.address, "island-0", SHAPES, token="t0"),
        RawIsland(good.address, "island-0", SHAPES, token="wrong"),
        RawIsland(bad.address, "island-9", SHAPES),
    ]
    try:
        assert islands[0].join().bootstrap  # the relay reached the root with its own token
        for island, reason in ((islands[1], Reason.UNAUTHENTICATED), (islands[2], Reason.PERMISSION_DENIED)):
            with pytest.raises(grpc.RpcError) as caught:
                island.join()
            assert reason_of(caught.value) is reason, caught.value.details()
        assert "upstream" in caught.value.details()  # the relay says its upstream refused it
    finally:
        for island in islands:
            island.close()


def test_member_reports_are_checked_member_by_member_at_the_root(tmp_path):
    """Only a relay's push may name members, each once, each within the run's token bound; the root
    weighs the push by its members' tokens, and its record names them."""
    s = run_state(tmp_path, max_tokens_per_round=1000)
    join(s, "plain")
    decls = tuple(TensorDecl(n, shape, torch.float32) for n, shape in CORE_SHAPES.items())
    s.join(JoinRequest(run_id="t", island_id="eu", session_id="eu", codecs=("identity",), tensors=decls, relay=True))
    zero = {n: torch.zeros(shape) for n, shape in CORE_SHAPES.items()}
    assert asyncio.run(push(s, "plain", zero, kind=PushKind.INIT)).committed
    ones = {n: torch.ones(shape) for n, shape in CORE_SHAPES.items()}
    cases = [
        ("plain", (Member("a", 10),), "did not join as a relay"),
        ("eu", (Member("a", 10), Member("a", 10)), "listed twice"),
        ("eu", (Member("a", 10), Member("", 10)), "empty"),
        ("eu", (Member("a", 10), Member("b", 1001)), "more than the run allows"),
    ]
    for island, members, why in cases:
        with pytest.raises(Exception) as caught:
            asyncio.run(push(s, island, ones, tokens=20, members=members))
        assert why in str(caught.value), (members, caught.value)
    assert asyncio.run(push(s, "eu", ones, tokens=30, members=(Member("a", 10), Member("b", 20)))).committed
    assert asyncio.run(push(s, "plain", zero, tokens=30)).committed
    asyncio.run(s.close_round("test"))
    assert s.round == 1
    assert s.history[-1].to_json()["tokens_by_island"] == {"eu/a": 10, "eu/b": 20, "plain": 30}
    # The mean weighs the relay's push 10 + 20 = 30 tokens against plain's 30: Δ = 0.5, and Nesterov's
    # first step (lr 0.7, momentum 0.9) moves θ by -0.7 * 1.9 * 0.5.
    for t in s.model.params.values():
        assert torch.allclose(t, torch.full_like(t, -0.7 * 1.9 * 0.5), rtol=0, atol=1e-6)


@pytest.mark.parametrize("calm_order", [(0, 1, 2, 3), (2, 3, 0, 1)])
def test_islands_of_a_relay_that_died_after_forwarding_count_once_at_the_root(tmp_path, servers, calm_order):
    """The relay forwards round 0 (its islands' work is in the root's round) and dies before its
    islands have the update: they move to the root (``relay|root``), push round 0 again there, and are
    told it counted (DUPLICATE, committed), so θ_1 is what it is when nothing dies, bit for bit, in
    whichever order the pushes reached the root when nothing died: the relay's before islands 2 and 3's
    as below, or after them. (Before the sum's fixed order, the root added them as they came, and
    the bits followed: CI caught the race.)"""
    want = root(tmp_path, servers, "calm")
    calm = RelayThread(want.address, "eu", tmp_path / "calm")
    servers.append(calm)
    train([calm.address, calm.address, want.address, want.address], 1, order=calm_order)
    theta1 = want.inspect(lambda s: {n: t.clone() for n, t in s.model.params.items()})

    top = root(tmp_path, servers, config={"lease_seconds": 2.0})
    relay = RelayThread(top.address, "eu", tmp_path / "dies")
    servers.append(relay)
    both = f"{relay.address}|{top.address}"
    islands = [RawIsland(a, f"island-{i}", SHAPES) for i, a in enumerate([both, both, top.address, top.address])]
    try:
        started(islands, claim_at_join=True)
        for i in (0, 1):
            assert islands[i].push(delta(i, 0), round_=0, tokens=TOKENS[i]).committed
        wait_for(lambda: top.inspect(lambda s: "eu" in s.accumulator.committed), what="the relay's push at the root")
        relay.relay.upstream._stopping.set()  # dies: no leave, no more heartbeats
        relay.call(relay.relay.server.stop(grace=0))
        for i in (0, 1):
            with pytest.raises(grpc.RpcError) as caught:
                islands[i].pull(0, wait_seconds=0.5)  # the relay is gone: the client moves to the root
            assert reason_of(caught.value) is Reason.NOT_JOINED
            islands[i].join()
            out = islands[i].push(delta(i, 0), round_=0, tokens=TOKENS[i])
            assert out.outcome == pb.PUSH_OUTCOME_DUPLICATE and out.committed  # it counted, in the relay's
        for i in (2, 3):
            assert islands[i].push(delta(i, 0), round_=0, tokens=TOKENS[i]).committed
        for isl in islands:
            header, _ = pull_round(isl, 0)
            assert header.round == 1
        got = top.inspect(lambda s: {n: t.clone() for n, t in s.model.params.items()})
        assert all(torch.equal(got[n], theta1[n]) for n in SHAPES)
        record = top.inspect(lambda s: s.history[-1].to_json())
        assert record["relayed"] == {"island-0": "eu", "island-1": "eu"}
        assert record["tokens"] == sum(TOKENS)  # each island's tokens once
    finally:
        for isl in islands:
            isl.close()


def test_a_lossy_uplink_through_a_relay_costs_one_more_encoding_bounded_by_its_error_feedback(tmp_path, servers):
    """int8 both ways: the relay decodes its islands' int8 pushes and encodes their mean in int8 again
    (its own error feedback carries what that drops into its next push), so θ moves off the flat run's
    by about one int8 rounding of an update a round: measured here, and bounded."""
    int8 = {"codec": "int8", "downlink_codec": "int8"}
    rounds = 6
    flat = root(tmp_path, servers, "flat", config=int8)
    train([flat.address] * 4, rounds, codec="int8")
    want = flat.inspect(lambda s: {n: t.clone() for n, t in s.model.params.items()})
    top = root(tmp_path, servers, config=int8)
    relays = [RelayThread(top.address, name, tmp_path) for name in ("eu", "us")]
    servers.extend(relays)
    thetas = train([relays[0].address, relays[0].address, relays[1].address, relays[1].address], rounds, "int8")
    got = top.inspect(lambda s: {n: t.clone() for n, t in s.model.params.items()})
    moved = {n: float((want[n] - theta0()[n]).norm()) for n in SHAPES}
    off = {n: float((got[n] - want[n]).norm()) / moved[n] for n in SHAPES}
    print(f"int8 through relays, {rounds} rounds: |θ - θ_flat| / |θ_flat - θ_0| = {off}")
    assert all(0 < v < 0.02 for v in off.values()), off  # the extra rounding: small, but not none
    assert all(torch.equal(t[n], got[n]) for t in thetas for n in SHAPES)  # still one θ, the root's


def test_mutual_tls_on_both_hops(tmp_path, servers):
    """The root and the relay each serve mutual TLS; the relay reaches the root with a client certificate
    of its own, islands reach the relay with theirs, and one without a certificate the CA signed is
    refused at the relay."""
    pki = make_pki(tmp_path / "pki")
    mtls = TlsConfig(cert=pki / "server.pem", key=pki / "server.key", client_ca=pki / "ca.pem")
    top = root(tmp_path, servers, security=SecurityOptions(tls=mtls))
    relay = RelayThread(
        top.address.replace("127.0.0.1", "localhost"),
        "eu",
        tmp_path,
        tls=mtls,
        upstream_tls=ClientTls(ca=str(pki / "ca.pem"), cert=str(pki / "client.pem"), key=str(pki / "client.key")),
    )
    servers.append(relay)
    island = ClientTls(ca=str(pki / "ca.pem"), cert=str(pki / "client.pem"), key=str(pki / "client.key"))
    stranger = ClientTls(ca=str(pki / "ca.pem"), cert=str(pki / "other-client.pem"), key=str(pki / "other-client.key"))
    address = relay.address.replace("127.0.0.1", "localhost")
    good, bad = RawIsland(address, "island-0", SHAPES, tls=island), RawIsland(address, "island-1", SHAPES, tls=stranger)
    try:
        assert good.join().bootstrap  # through the relay, over mTLS both ways, to the root
        assert good.push(theta0(), round_=0, kind=pb.PUSH_KIND_INIT).committed
        header, payloads = pull_round(good, -1)
        assert header.kind == pb.UPDATE_KIND_FULL
        wait_for(lambda: top.inspect(lambda s: s.model.ready), what="θ_0 at the root, sent up over mTLS")
        with pytest.raises(WrongEndpoint, match="does not accept the island's certificate"):
            bad.join()  # the handshake fails at the relay, said at once
    finally:
        good.close()
        bad.close()


@pytest.mark.parametrize(
    "flags,said",
    [
        (["--upstream", "nonsense"], "has no port"),
        (["--upstream", "h:1", "--quorum", "0"], "--quorum must be at least 1"),
        (["--upstream", "h:1", "--upstream-cert", "a.pem", "--upstream-key", "a.key"], "need --upstream-ca"),
        (["--upstream", "h:1", "--tls-cert", "a.pem"], "--tls-cert and --tls-key go together"),
        (["--upstream", "h:1", "--grace-window", "soon"], "grace_window must be auto, off or seconds"),
    ],
)
def test_atoll_relay_refuses_bad_flags_in_one_line(capsys, flags, said):
    from atoll.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["relay", "--run-id", "t", *flags])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and said in err and "Traceback" not in err, err


def test_a_decoupled_root_steps_a_relays_mean_as_it_steps_its_islands_own_pushes(tmp_path):
    """Decoupled rounds weigh each delta by its tokens and scale a long one by H/n; a relay's mean carries
    those scales already, so the root takes it whole, counts its members' Σ w_i s_i in the round's share
    and their usual weights in a round of everyone: θ_1 as if the two islands had pushed themselves."""
    cfg = {"outer_mode": "decoupled", "sync_every": 2, "max_tokens_per_round": 10_000}
    deltas = [rand(1), rand(2)]
    pushed = [dict(tokens=300, inner_steps=4), dict(tokens=100, inner_steps=2)]  # the first: twice H, scale 1/2
    zero = {n: torch.zeros(shape) for n, shape in CORE_SHAPES.items()}

    flat = run_state(tmp_path / "flat", **cfg)
    join(flat, "a")
    join(flat, "b")
    assert asyncio.run(push(flat, "a", zero, kind=PushKind.INIT)).committed
    for island, d, more in zip("ab", deltas, pushed, strict=True):
        assert asyncio.run(push(flat, island, d, **more)).committed
    asyncio.run(flat.close_round("test"))

    top = run_state(tmp_path / "relayed", **cfg)
    decls = tuple(TensorDecl(n, shape, torch.float32) for n, shape in CORE_SHAPES.items())
    top.join(JoinRequest(run_id="t", island_id="eu", session_id="eu", codecs=("identity",), tensors=decls, relay=True))
    assert asyncio.run(push(top, "eu", zero, kind=PushKind.INIT)).committed
    w = [300.0, 100.0]
    mean = {n: (w[0] * 0.5 * deltas[0][n] + w[1] * 1.0 * deltas[1][n]) / sum(w) for n in CORE_SHAPES}
    members = tuple(Member(i, **more) for i, more in zip("ab", pushed, strict=True))
    assert asyncio.run(push(top, "eu", mean, tokens=400, inner_steps=6, members=members)).committed
    asyncio.run(top.close_round("test"))

    assert flat.round == top.round == 1
    for n in CORE_SHAPES:
        assert torch.allclose(top.model.params[n], flat.model.params[n], rtol=1e-6, atol=1e-7), n
        assert not torch.equal(top.model.params[n], zero[n])
    assert top.history[-1].share == pytest.approx(flat.history[-1].share)


def test_a_relay_left_behind_by_its_upstream_takes_theta_and_its_islands_follow(tmp_path, servers):
    """The root closes two rounds with relay eu alone (its deadline passes without us); relay us then
    forwards its round 0 (folded late at the root) and is answered with θ of round 2 itself (catching up
    two identity updates costs more). It takes that θ at round 2, and its islands pull it: bit for bit
    the root's."""
    top = root(tmp_path, servers, config={"quorum": 1, "round_deadline_seconds": 1.0, "grace_window": "off"})
    eu, us = RelayThread(top.address, "eu", tmp_path), RelayThread(top.address, "us", tmp_path)
    servers.extend([eu, us])
    islands = [RawIsland(r.address, f"island-{i}", SHAPES) for i, r in enumerate([eu, eu, us, us])]
    try:
        started(islands, claim_at_join=True)
        for r in (0, 1):  # two rounds of eu's islands alone
            for i in (0, 1):
                assert islands[i].push(delta(i, r), round_=r, tokens=TOKENS[i]).committed
            for i in (0, 1):
                assert pull_round(islands[i], r)[0].round == r + 1
        for i in (2, 3):  # us's islands, still at round 0
            assert islands[i].push(delta(i, 0), round_=0, tokens=TOKENS[i]).committed
        wait_for(lambda: us.inspect(lambda s: s.round) == 2, what="relay us at the root's round")
        got = top.inspect(lambda s: {n: t.clone() for n, t in s.model.params.items()})
        for i in (2, 3):
            header, payloads = pull_round(islands[i], 0)
            assert header.kind == pb.UPDATE_KIND_FULL and header.round == 2
            theta = {}
            apply(theta, header, payloads)
            assert all(torch.equal(theta[n], got[n]) for n in SHAPES)
        assert top.inspect(lambda s: sorted(s.accumulator.late)) == [("us", 0)]  # its work: folded, not lost
    finally:
        for isl in islands:
            isl.close()


def test_a_relay_keeps_its_own_quorum_and_grace_and_takes_the_rest_of_the_runs_configuration(tmp_path, servers):
    top = root(tmp_path, servers, config={"quorum": 3, "grace_window": "auto", "sync_every": 7})
    relay = RelayThread(top.address, "eu", tmp_path, grace_window="0")
    servers.append(relay)
    island = RawIsland(relay.address, "island-0", SHAPES)
    try:
        island.join()
        config = relay.inspect(lambda s: s.config)
        assert (config.quorum, config.grace_window) == (1, "0")  # its own: forward what has arrived
        assert (config.sync_every, config.outer_lr, config.codec) == (7, 0.7, "identity")  # the run's
    finally:
        island.close()


@contextlib.contextmanager
def one_island_late_behind_a_relay(tmp_path, servers, **root_kwargs):
    """Root --quorum 2, relay eu with two islands, island-2 at the root. Round 0: eu's push for its two
    islands is the quorum (the root does not wait for island-2: grace 0). Round 1: island-1 does not push;
    eu forwards island-0 alone once its own grace passed, and with island-2 that is the quorum again.
    Yields the root and when the islands had joined."""
    top = root(tmp_path, servers, config={"quorum": 2, "grace_window": "0", "round_deadline_seconds": 60.0},
               **root_kwargs)  # fmt: skip
    eu = RelayThread(top.address, "eu", tmp_path, grace_window="auto")
    servers.append(eu)
    islands = [RawIsland(a, f"island-{i}", SHAPES) for i, a in enumerate([eu.address, eu.address, top.address])]
    try:
        started(islands)
        joined = time.monotonic()
        time.sleep(1.0)  # (an island's time joined counts from its join at its relay, not from its first push)
        for i in (0, 1):
            assert islands[i].push(delta(i, 0), round_=0, tokens=TOKENS[i]).committed
        wait_for(lambda: top.inspect(lambda s: s.round) == 1, timeout=20, what="round 0 closed without island-2")
        assert top.inspect(lambda s: s.history[-1].islands) == ["eu"]
        assert top.inspect(lambda s: s.membership.islands["eu"].stands_for) == 2
        for i in (0, 2):
            assert pull_round(islands[i], 0)[0].round == 1
        assert islands[0].push(delta(0, 1), round_=1, tokens=TOKENS[0]).committed
        assert islands[2].push(delta(2, 1), round_=1, tokens=TOKENS[2]).committed
        wait_for(lambda: top.inspect(lambda s: s.round) == 2, timeout=30, what="round 1 with eu's island-0")
        yield top, joined
    finally:
        for isl in islands:
            isl.close()


def test_the_root_counts_a_relays_islands_in_its_quorum_and_shows_each_with_its_state_and_goodput(tmp_path, servers):
    """The root shows eu/island-0 active and eu/island-1 late, each with its goodput, in /api/status and
    /metrics. (Before: eu counted one in the quorum, and round 0 waited for island-2.)"""
    from atoll.coordinator.options import AdminOptions

    with one_island_late_behind_a_relay(tmp_path, servers, admin=AdminOptions(port=0)) as (top, joined):
        base = top.server.admin.address
        code, body = http(f"{base}/api/status")
        assert code == 200, body
        since = time.monotonic() - joined
        status = json.loads(body)
        behind = next(r for r in status["islands"] if r["island"] == "eu")["behind"]
        assert list(behind) == ["eu/island-0", "eu/island-1"]
        assert (behind["eu/island-0"]["state"], behind["eu/island-1"]["state"]) == ("active", "late")
        assert behind["eu/island-0"]["tokens_into_theta"] == 2 * TOKENS[0]
        assert behind["eu/island-1"]["tokens_into_theta"] == TOKENS[1]
        for row in behind.values():  # its time joined: from its join at its relay to the last push naming it
            assert 1.0 <= row["joined_seconds"] <= since + 0.5 and row["goodput"] is not None
            assert row["joined_seconds"] + row["last_push_age_seconds"] == pytest.approx(since, abs=0.5)
        assert behind["eu/island-1"]["joined_seconds"] < behind["eu/island-0"]["joined_seconds"]  # (round 0's)
        assert "goodput" not in next(r for r in status["islands"] if r["island"] == "eu")  # (its islands' instead)
        code, text = http(f"{base}/metrics")
        assert code == 200, text
        assert 'atoll_island_state{island="eu/island-1",state="late"} 1.0' in text
        assert 'atoll_island_goodput{island="eu/island-0"}' in text
        assert 'atoll_islands{state="active"} 2.0' in text  # island-0 behind eu, island-2: not eu itself


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium; .ci/run does)")
def test_the_dashboard_lists_a_relays_islands_under_it(tmp_path, servers):
    from atoll.coordinator.options import AdminOptions

    with one_island_late_behind_a_relay(tmp_path, servers, admin=AdminOptions(port=0)) as (top, _):
        dom = render(f"{top.server.admin.address}/dashboard", tmp_path / "profile")
    names = re.findall(r"<tr(?: class=\"behind\")?><td>(.*?)</td><td class=\"state-(\w+)\">", dom)
    assert names == [("eu (relay)", "active"), ("eu/island-0", "active"), ("eu/island-1", "late"),
                     ("island-2", "active")], names  # fmt: skip
    assert '<span id="islands-count">3 live of 3</span>' in dom  # the islands, not the relay


def test_a_relay_removes_the_state_dirs_that_dead_relays_left_and_nothing_else(tmp_path):
    """(Before: a SIGKILLed relay's temporary state dir stayed for good: 2.8-3.5 GB each at 124M after four
    rounds, five of them in /tmp after one benchmark session.)"""
    from atoll.coordinator.disk.lock import StateLock
    from atoll.relay.main import STATE_PREFIX, sweep_stale

    dead, live, starting = (tmp_path / f"{STATE_PREFIX}{x}" for x in ("dead", "live", "starting"))
    other = tmp_path / "atoll-coordinator-state"
    for d in (dead, live, starting, other):
        d.mkdir()
        (d / "log").write_bytes(b"x" * 1000)
    StateLock(dead).acquire("test").release()  # its relay took the lock and died: the kernel dropped it
    held = StateLock(live).acquire("test")  # a live relay's
    StateLock(other).acquire("test").release()  # not a relay's dir
    try:
        assert sweep_stale(tmp_path) == [dead]
        assert not dead.exists() and (live / "log").exists() and (starting / "log").exists() and other.exists()
    finally:
        held.release()
