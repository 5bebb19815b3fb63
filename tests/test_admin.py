"""Admin HTTP: /healthz, /metrics (Prometheus text) and /api/status reflect the run; auth rules."""

import json
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from atoll.coordinator import CoordinatorServer, RunConfig
from atoll.protos import coordinator_pb2 as pb

SHAPES = {"w": (4, 3)}


def get(url, token=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, resp.read().decode()


def metrics(base, token=None):
    _, text = get(base + "/metrics", token)
    return {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_endpoints_follow_a_round(start_server, raw_island):
    srv = start_server(RunConfig(run_id="t", sync_every=1, quorum=1), admin_port=0)
    base = srv.server.admin.address
    assert get(base + "/healthz") == (200, "ok\n")
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    a.push({"w": torch.randn(4, 3)}, round_=0, kind=pb.PUSH_KIND_INIT)
    m = metrics(base)
    assert m["atoll_round{}"] == 0 and m["atoll_rounds_completed_total{}"] == 0
    resp = a.push({"w": torch.randn(4, 3)}, round_=0, tokens=5)
    header, payloads = a.pull(0)
    assert header.round == 1
    m = metrics(base)
    assert m["atoll_round{}"] == 1 and m["atoll_rounds_completed_total{}"] == 1
    assert m["atoll_bytes_in_total{}"] == resp.bytes_received > 0
    assert m["atoll_bytes_out_total{}"] >= len(payloads[0][1])
    assert m['atoll_islands{"state": "active"}'] == 1 and m['atoll_islands{"state": "gone"}'] == 0
    _, body = get(base + "/api/status")
    status = json.loads(body)
    assert status["round"] == 1 and status["bootstrapped"] and status["run"]["run_id"] == "t"
    assert [i["island"] for i in status["islands"]] == ["a"] and status["islands"][0]["state"] == "active"
    assert status["history"][0]["islands"] == ["a"]


def test_token_protects_everything_but_healthz(start_server):
    srv = start_server(admin_port=0, admin_token="s3cret")
    base = srv.server.admin.address
    assert get(base + "/healthz")[0] == 200
    for path in ("/metrics", "/api/status"):
        with pytest.raises(urllib.error.HTTPError) as info:
            get(base + path)
        assert info.value.code == 401
        with pytest.raises(urllib.error.HTTPError):
            get(base + path, token="wrong")
        assert get(base + path, token="s3cret")[0] == 200


def test_non_loopback_admin_needs_a_token(tmp_path):
    import asyncio

    server = CoordinatorServer(RunConfig(run_id="t"), tmp_path, admin_host="0.0.0.0", admin_port=0)
    with pytest.raises(ValueError, match="needs a token"):
        asyncio.run(server.start())
    assert server._server is None  # refused before the gRPC port opened
