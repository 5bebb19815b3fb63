"""TLS, mutual TLS and per-island bearer tokens, against a real server with generated certificates."""

import contextlib
import logging
import socket
import ssl

import grpc
import pytest
import torch
from support import exact_config, wait_for
from support.pki import make_pki

from atoll.coordinator.options import AdminOptions, NetworkOptions, SecurityOptions
from atoll.coordinator.transport.security import IslandTokens, TlsConfig
from atoll.islands._transport.client import BulkPort, ClientTls, CoordinatorClient, RetryPolicy
from atoll.islands._transport.tcp_streams import TcpPush
from atoll.islands._transport.transfer import write_push
from atoll.islands.errors import CoordinatorRefused, WrongEndpoint
from atoll.protos import bulk
from atoll.protos import coordinator_pb2 as pb

FAST = RetryPolicy(give_up_seconds=1, rpc_timeout_seconds=3, initial_backoff_seconds=0.1)
SLOW = RetryPolicy(give_up_seconds=60, rpc_timeout_seconds=3, initial_backoff_seconds=0.1)
"""An island's patience: a setup mistake must be said long before it runs out."""


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def retried(caplog) -> list[str]:
    """What the island's client said about retrying (a setup mistake must be said at the first try)."""
    return [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]


def join(client, island="a"):
    req = pb.JoinRequest(run_id="t", island_id=island, codecs=["identity"], num_ranks=1)
    req.tensors.add(name="w", shape=[2, 2], dtype=pb.DTYPE_FLOAT32)
    return client.join(req)


def test_tls_server(start_server, pki, caplog):
    caplog.set_level(logging.INFO, logger="atoll")
    srv = start_server(security=SecurityOptions(tls=TlsConfig(cert=pki / "server.pem", key=pki / "server.key")))
    ok = CoordinatorClient(srv.address, retry=FAST, tls=ClientTls(ca=str(pki / "ca.pem")))
    joined = join(ok)
    assert joined.bootstrap
    assert joined.bulk_port > 0 and ok.bulk is not None and ok.bulk.tls is not None  # the bulk port, over TLS
    plain = CoordinatorClient(srv.address, retry=SLOW)
    with pytest.raises(WrongEndpoint, match="serves TLS: give the island its CA"):
        join(plain, "b")
    assert retried(caplog) == []  # (before: UNAVAILABLE "Socket closed", retried for the whole timeout)
    ok.close()
    plain.close()


def test_mutual_tls_requires_a_client_certificate(start_server, pki, caplog):
    caplog.set_level(logging.INFO, logger="atoll")
    srv = start_server(
        security=SecurityOptions(
            tls=TlsConfig(cert=pki / "server.pem", key=pki / "server.key", client_ca=pki / "ca.pem")
        )
    )
    no_cert = CoordinatorClient(srv.address, retry=SLOW, tls=ClientTls(ca=str(pki / "ca.pem")))
    with pytest.raises(WrongEndpoint, match="requires a client certificate"):
        join(no_cert)
    assert retried(caplog) == []
    with_cert = CoordinatorClient(
        srv.address,
        retry=FAST,
        tls=ClientTls(ca=str(pki / "ca.pem"), cert=str(pki / "client.pem"), key=str(pki / "client.key")),
    )
    assert join(with_cert).bootstrap
    assert srv.inspect(lambda s: sorted(s.membership.islands)) == ["a"]
    no_cert.close()
    with_cert.close()


def test_tls_mistakes_and_the_admin_port_are_said_at_the_first_try(start_server, pki, tmp_path, caplog):
    """A server certificate from another CA, a client certificate the coordinator does not trust, TLS
    against a plaintext coordinator, and the admin HTTP port for the gRPC one: each looked like an
    outage ("unreachable ... Socket closed") for the whole connect timeout. The first Join now says
    what is wrong, without a retry, as a refusal (WrongEndpoint, a CoordinatorRefused)."""
    caplog.set_level(logging.INFO, logger="atoll")
    mtls = start_server(
        security=SecurityOptions(
            tls=TlsConfig(cert=pki / "server.pem", key=pki / "server.key", client_ca=pki / "ca.pem")
        )
    )
    plain = start_server(state_dir=tmp_path / "plain", admin=AdminOptions(port=0))
    cases = [
        (mtls.address, ClientTls(ca=str(pki / "other-ca.pem")), "does not verify with the island's CA"),
        (
            mtls.address,
            ClientTls(ca=str(pki / "ca.pem"), cert=str(pki / "other-client.pem"), key=str(pki / "other-client.key")),
            "does not accept the island's certificate",
        ),
        (plain.address, ClientTls(ca=str(pki / "ca.pem")), "does not speak TLS"),
        (f"127.0.0.1:{plain.server.admin.port}", None, "HTTP/1.x server, not the coordinator's gRPC port"),
    ]
    for address, tls, said in cases:
        client = CoordinatorClient(address, retry=SLOW, tls=tls)
        with pytest.raises(CoordinatorRefused, match=said):
            join(client)
        assert retried(caplog) == [], said
        client.close()
    down = CoordinatorClient(f"127.0.0.1:{free_port()}", retry=FAST)  # nothing listens: an outage, retried
    with pytest.raises(grpc.RpcError) as info:
        join(down)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    down.close()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_island_tokens(start_server):
    tokens = IslandTokens({"a": "token-a", "b": "token-b"})
    srv = start_server(exact_config(run_id="t", sync_every=1), security=SecurityOptions(tokens=tokens))
    none = CoordinatorClient(srv.address, retry=FAST)
    wrong = CoordinatorClient(srv.address, retry=FAST, token="nope")
    a = CoordinatorClient(srv.address, retry=FAST, token="token-a")
    for client in (none, wrong):
        with pytest.raises(grpc.RpcError) as info:
            join(client)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert join(a).bootstrap
    # a's token cannot speak for b: not in Join, Heartbeat, PushDelta or PullUpdate.
    with pytest.raises(grpc.RpcError) as info:
        join(a, "b")
    assert (
        info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "cannot act for island 'b'" in info.value.details()
    )
    from atoll.compression import get_codec

    payload = get_codec("identity").encode(torch.ones(2, 2))
    h = pb.PushHeader(run_id="t", island_id="b", round=0, kind=pb.PUSH_KIND_INIT, num_ranks=1, codec="identity")
    h.entries.add(name="w", num_bytes=len(payload))
    for call in (
        lambda: a.push(h, [payload]),
        lambda: a.heartbeat(pb.HeartbeatRequest(run_id="t", island_id="b")),
        lambda: a.pull(pb.PullRequest(run_id="t", island_id="b", have_round=-1)),
    ):
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert srv.inspect(lambda s: (sorted(s.membership.islands), s.model.params)) == (["a"], None)
    h.island_id = "a"
    assert a.push(h, [payload]).committed
    for c in (none, wrong, a):
        c.close()


def test_token_file_validation(tmp_path):
    for bad in ["{}", '{"a": ""}', '{"a": "x", "b": "x"}', "[1]"]:
        p = tmp_path / "t.json"
        p.write_text(bad)
        with pytest.raises(ValueError):
            IslandTokens.load(p)


def test_the_coordinator_says_failed_handshakes_in_its_own_words_once_a_minute(pki, tmp_path):
    """An island without a client certificate, or in plaintext, made the coordinator print raw gRPC
    core lines ("Handshake failed ... PEER_DID_NOT_RETURN_A_CERTIFICATE", "WRONG_VERSION_NUMBER") every
    1-2 s. Now one WARNING per cause and minute, in the coordinator's words."""
    import signal
    import subprocess
    import sys

    port_file = tmp_path / "port"
    cmd = [sys.executable, "-m", "atoll", "coordinator", "--state-dir", str(tmp_path / "state"), "--run-id", "t"]
    cmd += ["--port-file", str(port_file), "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key")]
    cmd += ["--tls-client-ca", str(pki / "ca.pem")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(port_file.exists, timeout=30, what="the port file")
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        for tls in (None, ClientTls(ca=str(pki / "ca.pem"))) * 3:
            client = CoordinatorClient(address, retry=SLOW, tls=tls)
            with pytest.raises(WrongEndpoint):
                join(client)
            client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "ssl_transport_security" not in err and "Handshake failed" not in err, err
    said = [line for line in err.splitlines() if "TLS handshake refused" in line]
    assert len(said) == 2, said
    assert any("plaintext" in line for line in said) and any("no client certificate" in line for line in said)


def test_a_token_sent_to_a_coordinator_that_checks_none_is_warned_about_once_on_both_sides(start_server, caplog):
    """(Before: accepted silently; the island's operator believed it was protected.)"""
    import logging

    caplog.set_level(logging.WARNING)
    srv = start_server()
    client = CoordinatorClient(srv.address, retry=FAST, token="s3cret")
    for _ in range(2):
        assert not join(client).checks_tokens
    client.close()
    words = [r.getMessage() for r in caplog.records]
    assert sum("checks none (no --island-tokens)" in w and "island a" in w for w in words) == 1, words
    assert sum("checks no island tokens" in w for w in words) == 1, words


SHAPES = {"w": (1 << 20,), "b": (300, 70), "empty": (0,)}


def tls_round(start_server, raw_island, pki, state_dir, streams=None, **server_kwargs):
    """θ_0 and two islands' deltas for round 0 over mutual TLS with island tokens, then a pull of round 1:
    (Join's bulk port, the pulled payloads, the coordinator's counters)."""
    tokens = IslandTokens({"a": "ta", "b": "tb"})
    tls = TlsConfig(cert=pki / "server.pem", key=pki / "server.key", client_ca=pki / "ca.pem")
    config = exact_config(run_id="t", sync_every=1, quorum=2)
    srv = start_server(config, state_dir, security=SecurityOptions(tls=tls, tokens=tokens), **server_kwargs)
    mine = ClientTls(ca=str(pki / "ca.pem"), cert=str(pki / "client.pem"), key=str(pki / "client.key"))
    gen = torch.Generator().manual_seed(7)
    a = raw_island(srv.address, "a", SHAPES, tls=mine, token="ta", bulk_streams=streams)
    b = raw_island(srv.address, "b", SHAPES, tls=mine, token="tb", bulk_streams=streams)
    port = a.join().bulk_port
    b.join()
    a.push({k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}, round_=0, kind=pb.PUSH_KIND_INIT)
    for isl, n in ((a, 10), (b, 30)):
        isl.push({k: torch.randn(s, generator=gen) for k, s in SHAPES.items()}, round_=0, tokens=n)
    _, payloads = a.pull(have_round=0)
    return srv, port, [bytes(p) for _, p in payloads], srv.server.counters.as_dict()


def test_the_bulk_port_speaks_tls_with_the_same_certificates_and_tokens(start_server, raw_island, pki, tmp_path):
    """With --tls-cert the bulk port is served over TLS (mutual TLS and island tokens as on gRPC), and TLS
    islands push and pull there: the same update, byte for byte, as over gRPC."""
    srv, port, pulled, counters = tls_round(start_server, raw_island, pki, tmp_path / "bulk")
    _, port_g, pulled_g, counters_g = tls_round(
        start_server, raw_island, pki, tmp_path / "grpc", network=NetworkOptions(bulk_port=None)
    )
    assert port > 0 and port_g == 0
    assert pulled == pulled_g and sum(map(len, pulled)) > 4 << 20
    assert counters["bulk_calls"] == 4 and counters_g["bulk_calls"] == 0  # three pushes and a pull
    assert counters["bytes_in"] == counters_g["bytes_in"]
    assert counters["bulk_kept_calls"] == 2  # island a's second push and its pull: on its first one's connection
    _, _, pulled_s, counters_s = tls_round(start_server, raw_island, pki, tmp_path / "striped", streams=3)
    assert pulled_s == pulled and counters_s["bulk_calls"] == 4  # striped over three TLS connections
    assert counters_s["bulk_kept_calls"] == 2

    h = pb.PushHeader(run_id="t", island_id="a", round=1, kind=pb.PUSH_KIND_DELTA, num_ranks=1, codec="identity")
    h.entries.add(name="w", num_bytes=8)
    # No plaintext side door: a call in the clear is dropped at the handshake, unanswered and uncounted.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as clear:
        clear.sendall(bulk.preamble(bulk.PUSH, "Bearer ta", pb.PushChunk(header=h).SerializeToString()))
        clear.settimeout(5)
        with contextlib.suppress(ConnectionResetError):
            assert clear.recv(1024) == b""
    # Mutual TLS: no client certificate, or one from another CA, cannot connect.
    for cert in (None, "other-client"):
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        if cert:
            ctx.load_cert_chain(str(pki / f"{cert}.pem"), str(pki / f"{cert}.key"))
        with (
            pytest.raises((ssl.SSLError, ConnectionResetError)),
            socket.create_connection(("127.0.0.1", port)) as s,
            ctx.wrap_socket(s, server_hostname="127.0.0.1") as t,
        ):
            t.sendall(bulk.preamble(bulk.PULL, "Bearer ta", b""))
            t.recv(1)  # TLS 1.3: the server's refusal of the certificate comes with the first read
    # Island tokens: checked as on gRPC.
    mine = ClientTls(ca=str(pki / "ca.pem"), cert=str(pki / "client.pem"), key=str(pki / "client.key"))
    port_tls = BulkPort("127.0.0.1", port, tls=mine.ssl_context(), server_name=None)
    for auth, code in [("", "UNAUTHENTICATED"), ("Bearer tb", "PERMISSION_DENIED")]:
        with pytest.raises(grpc.RpcError) as info:
            write_push(TcpPush(port_tls, h, auth=auth, timeout=5), h, [bytes(8)])
        assert info.value.code().name == code, auth
    assert srv.server.counters.bulk_calls == 6
