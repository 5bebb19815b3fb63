"""Per-region pushes from multi-rank islands: assembly, coverage, partial contributions."""

import time

import grpc
import numpy as np
import pytest
import torch
from support import exact_config

from atoll.compression import get_codec
from atoll.islands._transport.client import CoordinatorClient, RetryPolicy
from atoll.protos import coordinator_pb2 as pb

SHAPES = {"w": (6, 4), "b": (5,)}


class RankClient:
    def __init__(self, address, island_id, rank, num_ranks):
        self.client = CoordinatorClient(address, retry=RetryPolicy(give_up_seconds=5, rpc_timeout_seconds=10))
        self.island_id, self.rank, self.num_ranks = island_id, rank, num_ranks

    def join(self):
        req = pb.JoinRequest(run_id="t", island_id=self.island_id, codecs=["identity"], num_ranks=self.num_ranks)
        for n, s in SHAPES.items():
            req.tensors.add(name=n, shape=list(s), dtype=pb.DTYPE_FLOAT32)
        return self.client.join(req)

    def push(self, pieces, *, round_, kind=pb.PUSH_KIND_DELTA, tokens=10):
        """pieces: list of (name, offsets, tensor-of-the-region)."""
        ident = get_codec("identity")
        payloads = [ident.encode(t) for _, _, t in pieces]
        h = pb.PushHeader(
            run_id="t",
            island_id=self.island_id,
            round=round_,
            kind=kind,
            rank=self.rank,
            num_ranks=self.num_ranks,
            tokens=tokens,
            codec="identity",
        )
        for (name, offsets, t), p in zip(pieces, payloads, strict=True):
            h.entries.add(name=name, offsets=list(offsets), sizes=list(t.shape), num_bytes=len(p))
        return self.client.push(h, payloads)

    def pull(self, have_round, regions=()):
        req = pb.PullRequest(run_id="t", island_id=self.island_id, have_round=have_round, wait_seconds=5)
        for name, offsets, sizes in regions:
            req.regions.add(name=name, offsets=list(offsets), sizes=list(sizes))
        return self.client.pull(req)


@pytest.fixture
def two_rank_island(start_server):
    srv = start_server(
        exact_config(
            run_id="t",
            sync_every=1,
            quorum=1,
            outer_lr=1.0,
            outer_momentum=0.0,
            round_deadline_seconds=1.0,
        )
    )
    ranks = [RankClient(srv.address, "fsdp", r, 2) for r in range(2)]
    for r in ranks:
        assert r.join().bootstrap
    theta0 = {n: torch.randn(s) for n, s in SHAPES.items()}
    # Rank 0 holds rows 0-2 of w and all of b; rank 1 rows 3-5 of w (FSDP-like dim-0 shards).
    assert (
        not ranks[0]
        .push([("w", (0, 0), theta0["w"][:3]), ("b", (0,), theta0["b"])], round_=0, kind=pb.PUSH_KIND_INIT)
        .committed
    )
    assert ranks[1].push([("w", (3, 0), theta0["w"][3:])], round_=0, kind=pb.PUSH_KIND_INIT).committed
    yield srv, ranks, theta0
    for r in ranks:
        r.client.close()


def test_regions_assemble_and_pull_by_region(two_rank_island):
    srv, ranks, theta0 = two_rank_island
    assert torch.equal(srv.inspect(lambda s: s.model.params["w"].clone()), theta0["w"])
    delta = {n: torch.randn(s) for n, s in SHAPES.items()}
    assert not ranks[0].push([("w", (0, 0), delta["w"][:3]), ("b", (0,), delta["b"])], round_=0).committed
    assert srv.inspect(lambda s: s.round) == 0  # half an island does not count
    assert ranks[1].push([("w", (3, 0), delta["w"][3:])], round_=0).committed
    header, payloads = ranks[1].pull(0, regions=[("w", (3, 0), (3, 4))])
    assert header.kind == pb.UPDATE_KIND_DELTA
    assert [(e.name, list(e.offsets), list(e.sizes)) for e in header.entries] == [("w", [3, 0], [3, 4])]
    u = get_codec("identity").decode(payloads[0][1], (3, 4))
    # lr 1, no momentum: θ1 = θ0 - Δ; the region's update is exactly -Δ of those rows.
    np.testing.assert_allclose(u.numpy(), -delta["w"][3:].numpy(), atol=1e-6)
    theta1 = srv.inspect(lambda s: s.model.params["w"].clone())
    assert torch.equal(theta1[3:], theta0["w"][3:] + u)


@pytest.mark.parametrize("case", ["overlap", "gap"])
def test_bad_coverage_discards_the_island(two_rank_island, case):
    srv, ranks, _ = two_rank_island
    ranks[0].push([("w", (0, 0), torch.ones(3, 4)), ("b", (0,), torch.ones(5))], round_=0)
    rows = (2, 0) if case == "overlap" else (4, 0)
    with pytest.raises(grpc.RpcError) as info:
        ranks[1].push([("w", rows, torch.ones(2 if case == "gap" else 3, 4))], round_=0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("overlap" if case == "overlap" else "cover 20 of 24") in info.value.details()
    assert srv.inspect(lambda s: (s.round, dict(s.accumulator.committed), dict(s.accumulator.pending))) == (0, {}, {})


def test_partial_island_is_dropped_at_the_deadline(two_rank_island, start_server):
    """One rank of an island dies mid-round: its half push never counts; the round closes on others."""
    srv, ranks, theta0 = two_rank_island
    other = RankClient(srv.address, "single", 0, 1)
    other.join()
    d_other = {n: torch.randn(s) for n, s in SHAPES.items()}
    ranks[0].push([("w", (0, 0), torch.full((3, 4), 100.0)), ("b", (0,), torch.full((5,), 100.0))], round_=0)
    assert other.push([("w", (0, 0), d_other["w"]), ("b", (0,), d_other["b"])], round_=0).committed
    # The fsdp island's lease stays alive (its rank 0 heartbeats), so the deadline (1 s) closes the round.
    deadline = time.monotonic() + 10
    while srv.inspect(lambda s: s.round) == 0 and time.monotonic() < deadline:
        ranks[0].client.heartbeat(pb.HeartbeatRequest(run_id="t", island_id="fsdp"))
        time.sleep(0.1)
    snap = srv.inspect(lambda s: (s.round, {k: v.clone() for k, v in s.model.params.items()}, s.history[-1]["islands"]))
    assert snap[0] == 1 and snap[2] == ["single"]
    for n in SHAPES:  # θ moved by the single island's Δ only (lr 1): no trace of the 100s
        np.testing.assert_allclose(snap[1][n].numpy(), (theta0[n] - d_other[n]).numpy(), atol=1e-6)
    other.client.close()
