"""Admin HTTP: /healthz, /metrics (Prometheus text) and /api/status reflect the run; auth rules."""

from __future__ import annotations

import json
import logging

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from support import exact_config, http, post_json, wait_for

from atoll.coordinator import CoordinatorServer
from atoll.coordinator.options import AdminOptions, PlacementOptions
from atoll.protos import coordinator_pb2 as pb

SHAPES = {"w": (4, 3)}


def get(url, token=None):
    return http(url, token=token)


def metrics(base, token=None):
    _, text = get(base + "/metrics", token)
    return {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_endpoints_follow_a_round(start_server, raw_island):
    srv = start_server(exact_config(run_id="t", sync_every=1, quorum=1), admin=AdminOptions(port=0))
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
    held = status["memory"]  # bytes, by holder: θ, momentum and the next round's sum are each |θ| = 48
    assert (held["theta"], held["optimizer"], held["sum"], held["downlink_ef"]) == (48, 48, 48, 0)
    assert held["update"] >= 48 and held["push_reserved"] == held["pull_reserved"] == 0


def test_token_protects_everything_but_healthz(start_server):
    srv = start_server(admin=AdminOptions(port=0, token="s3cret"))
    base = srv.server.admin.address
    assert get(base + "/healthz")[0] == 200
    for path in ("/metrics", "/api/status"):
        assert get(base + path)[0] == 401
        assert get(base + path, token="wrong")[0] == 401
        assert get(base + path, token="s3cret")[0] == 200


def test_non_loopback_admin_needs_a_token(tmp_path):
    import asyncio

    server = CoordinatorServer(exact_config(run_id="t"), tmp_path, admin=AdminOptions(host="0.0.0.0", port=0))
    with pytest.raises(ValueError, match="needs a token"):
        asyncio.run(server.start())
    assert server._server is None  # refused before the gRPC port opened


# ---- observability ----------------------------------------------------------------------------------
def test_metrics_carry_loss_tokens_and_each_islands_state(start_server, raw_island):
    from prometheus_client.parser import text_string_to_metric_families

    srv = start_server(exact_config(run_id="t", sync_every=1), admin=AdminOptions(port=0))
    a = raw_island(srv.address, "a", {"w": (2, 2)})
    a.join()
    a.push({"w": torch.zeros(2, 2)}, round_=0, kind=pb.PUSH_KIND_INIT)
    a.push({"w": torch.ones(2, 2)}, round_=0, tokens=640, loss=2.5)
    a.pull(0)
    for shapes in ({"w": (3, 3)}, {"w": (2, 2)}):  # a wrong model, then a wrong run: refused, and counted
        with pytest.raises(grpc.RpcError):
            raw_island(srv.address, "x", shapes, run_id="t" if shapes["w"] == (3, 3) else "other").join()
    _, text = get(srv.server.admin.address + "/metrics")
    m = {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert m["atoll_round_loss{}"] == 2.5 and m["atoll_round_tokens{}"] == 640 and m["atoll_tokens_per_second{}"] > 0
    assert m['atoll_island_state{"island": "a", "state": "active"}'] == 1
    assert 0 <= m['atoll_island_last_push_age_seconds{"island": "a"}'] < 30
    assert m["atoll_joins_refused_total{}"] == 2  # (before: refused joins were not counted anywhere)


def test_lease_expiry_is_logged_and_fragment_lines_say_which(start_server, raw_island, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="atoll")
    srv = start_server(
        exact_config(run_id="t", sync_every=1, lease_seconds=0.3),
        placement=PlacementOptions(shard=(1, 2), partition="layers"),
        name="fragment 1/2: ",
    )
    a = raw_island(srv.address, "a", {"w": (2, 2)})
    a.join(shard_index=1, num_shards=2, partition="layers", layout_digest="d")

    def messages():
        return [r.getMessage() for r in caplog.records if r.name == "atoll.coordinator"]

    wait_for(lambda: any(m.startswith("fragment 1/2: island a: lease expired") for m in messages()), what="expiry")
    assert any(m.startswith("fragment 1/2: island a joined") for m in messages())


# ---- operator control ----------------------------------------------------------------------------
def test_control_endpoints_need_a_token(start_server):
    srv = start_server(admin=AdminOptions(port=0))
    code, body = post_json(srv.server.admin.address + "/api/config", {"quorum": 1}, "")
    assert code == 403 and "--admin-token" in body


def rand(shapes=SHAPES):
    return {k: torch.randn(s) for k, s in shapes.items()}


def test_dashboard_accepts_the_token_in_the_authorization_header(start_server):
    """(Before: only ?token= worked for the page, while the API took only the header.)"""
    srv = start_server(admin=AdminOptions(port=0, token="s3cret"))
    base = srv.server.admin.address
    assert get(base + "/", token="s3cret")[0] == 200
    assert get(base + "/dashboard?token=s3cret")[0] == 200
    assert get(base + "/", token="wrong")[0] == 401


def test_status_json_is_valid_with_a_closed_round(start_server, raw_island):
    srv = start_server(exact_config(run_id="t", sync_every=1), admin=AdminOptions(port=0))
    a = raw_island(srv.address, "a", SHAPES)
    a.join()
    a.push(rand(), round_=0, kind=pb.PUSH_KIND_INIT)
    a.push(rand(), round_=0, tokens=2, loss=1.0)
    a.pull(0)
    code, body = get(srv.server.admin.address + "/api/status")

    def not_json(token):
        raise AssertionError(f"/api/status holds {token}, which is not JSON")

    status = json.loads(body, parse_constant=not_json)  # strict: no NaN / Infinity
    assert code == 200 and status["round"] == 1 and status["bootstrapped"] and status["healthy"]
    (record,) = status["history"]
    assert (record["round"], record["islands"], record["tokens"], record["loss"]) == (0, ["a"], 2, 1.0)
    assert record["bytes_in"] == status["counters"]["bytes_in"] > 0
    assert [(i["island"], i["state"], i["rounds_committed"]) for i in status["islands"]] == [("a", "active", 1)]
    assert status["num_params"] == 12 and status["inflight_bytes"] == 0


def test_config_values_the_protocol_cannot_carry_and_deep_json_get_a_4xx_and_change_nothing(start_server, caplog):
    """(Before: quorum 2^31 answered 200 and broke every later Join; NaN turned the delta bound off;
    a deeply nested body, or one that is not UTF-8, answered 500 with a server traceback.)"""
    srv = start_server(admin=AdminOptions(port=0, token="tok"))
    url = srv.server.admin.address + "/api/config"
    for body in ({"quorum": 2147483648}, {"quorum": 1e30}, {"total_rounds": 2**63}, {"max_tokens_per_round": 2**64}):
        code, text = post_json(url, body, "tok")
        (field,) = body
        assert code == 400 and f"{field} must be in" in text, (body, code, text)
    code, text = http(url, token="tok", data=b'{"max_delta_norm": NaN}')
    assert code == 400 and "max_delta_norm must be in" in text
    assert http(url, token="tok", data=b"[" * 100_000 + b"]" * 100_000)[0] == 400
    code, text = http(url, token="tok", data=b'{"quorum": "\xff\xfe"}')  # not UTF-8 (before: 500)
    assert code == 400 and "JSON" in text
    assert not [r for r in caplog.records if r.exc_info], "a server traceback was logged"
    config = srv.inspect(lambda s: s.config)
    assert (config.quorum, config.max_delta_norm, config.total_rounds) == (1, 0.0, 0)


def test_an_island_at_the_admin_port_is_one_line_per_peer_not_a_traceback_per_retry(start_server, caplog):
    """An island pointed at the admin HTTP port filled the coordinator's log with an aiohttp traceback
    per retry (its gRPC Join every second or two). Now: one line per peer and minute, in our words."""
    import socket

    from atoll.islands._transport.probe import PREFACE

    srv = start_server(admin=AdminOptions(port=0))
    caplog.set_level(logging.DEBUG)
    for _ in range(5):  # what a gRPC client sends first
        with socket.create_connection(("127.0.0.1", srv.server.admin.port), timeout=5) as sock:
            sock.sendall(PREFACE)
            assert sock.recv(64).startswith(b"HTTP/1")
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    said = [r.getMessage() for r in caplog.records if "not HTTP/1.x" in r.getMessage()]
    assert len(said) == 1 and "127.0.0.1" in said[0] and "--port" in said[0], said
