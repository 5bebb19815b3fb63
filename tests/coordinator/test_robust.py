"""Robust aggregation and the delta norm bound against a faulty island, vs NumPy references."""

import grpc
import numpy as np
import pytest
import torch
from support import exact_config

from atoll.coordinator import RunConfig
from atoll.protos import coordinator_pb2 as pb

SHAPES = {"w": (5, 4), "b": (3,)}


def run_round(start_server, raw_island, **config):
    srv = start_server(
        exact_config(
            run_id="t", sync_every=1, quorum=3, outer_lr=1.0, outer_momentum=0.0, round_deadline_seconds=0.5, **config
        )
    )
    isl = {n: raw_island(srv.address, n, SHAPES) for n in "abcf"}
    for i in isl.values():
        i.join()
    rng = np.random.default_rng(1)
    theta0 = {k: torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for k, s in SHAPES.items()}
    isl["a"].push(theta0, round_=0, kind=pb.PUSH_KIND_INIT)
    deltas = {n: {k: rng.standard_normal(s).astype(np.float32) * 0.01 for k, s in SHAPES.items()} for n in "abc"}
    deltas["f"] = {k: rng.standard_normal(s).astype(np.float32) * 1000 for k, s in SHAPES.items()}  # faulty
    refused = []
    for n, i in isl.items():
        try:
            i.push({k: torch.from_numpy(v) for k, v in deltas[n].items()}, round_=0, tokens=10)
        except grpc.RpcError as err:
            refused.append((n, err.code(), err.details()))
    header, _ = isl["a"].pull(0)
    assert header.round == 1
    theta1 = srv.inspect(lambda s: {k: v.clone().numpy() for k, v in s.model.params.items()})
    g = {k: theta0[k].numpy() - theta1[k] for k in SHAPES}  # lr 1, no momentum: θ1 = θ0 - g
    return g, deltas, refused, srv


def flat(d):
    return np.concatenate([d[k].reshape(-1).astype(np.float64) for k in SHAPES])


def test_mean_is_dragged_by_the_faulty_island(start_server, raw_island):
    g, deltas, refused, _ = run_round(start_server, raw_island)
    assert not refused
    expected = {k: sum(deltas[n][k] for n in "abcf") / 4 for k in SHAPES}
    for k in SHAPES:
        np.testing.assert_allclose(g[k], expected[k], rtol=1e-5, atol=1e-5)
    assert np.linalg.norm(flat(g)) > 100


def test_coordinate_median(start_server, raw_island):
    g, deltas, _, _ = run_round(start_server, raw_island, aggregation="median")
    for k in SHAPES:
        stacked = np.stack([deltas[n][k] for n in "abcf"])
        np.testing.assert_allclose(g[k], np.sort(stacked, axis=0)[1], atol=1e-6)  # lower median of 4
    assert np.linalg.norm(flat(g)) < 0.1


def test_clipped_mean_bounds_the_faulty_island(start_server, raw_island):
    g, deltas, _, _ = run_round(start_server, raw_island, aggregation="clipped_mean")
    norms = {n: np.linalg.norm(flat(deltas[n])) for n in "abcf"}
    c = sorted(norms.values())[1]
    expected = sum(flat(deltas[n]) * min(1.0, c / norms[n]) for n in "abcf") / 4
    np.testing.assert_allclose(flat(g), expected, atol=1e-6)
    assert np.linalg.norm(flat(g)) <= c * (1 + 1e-6)


def test_norm_bound_refuses_the_faulty_island(start_server, raw_island):
    g, deltas, refused, srv = run_round(start_server, raw_island, max_delta_norm=10.0)
    assert [(n, code) for n, code, _ in refused] == [("f", grpc.StatusCode.INVALID_ARGUMENT)]
    assert "exceeds 10" in refused[0][2]
    assert srv.inspect(lambda s: s.history[-1]["islands"]) == ["a", "b", "c"]
    expected = sum(flat(deltas[n]) for n in "abc") / 3
    np.testing.assert_allclose(flat(g), expected, atol=1e-6)


def test_bad_aggregation_config():
    with pytest.raises(ValueError, match="aggregation"):
        RunConfig(aggregation="trimmed")
