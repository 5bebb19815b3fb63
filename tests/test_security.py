"""TLS, mutual TLS and per-island bearer tokens, against a real server with generated certificates."""

import datetime
import ipaddress

import grpc
import pytest
import torch
from conftest import exact_config
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from atoll.coordinator.security import IslandTokens, TlsConfig
from atoll.islands.client import ClientTls, CoordinatorClient, RetryPolicy
from atoll.protos import coordinator_pb2 as pb

FAST = RetryPolicy(give_up_seconds=1, rpc_timeout_seconds=3, initial_backoff_seconds=0.1)


def _cert(subject, issuer_key, issuer_name, key, *, ca=False, san=None):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")

    def write(name, cert, key):
        (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "atoll test CA")])
    ca = _cert(ca_name, ca_key, ca_name, ca_key, ca=True)
    write("ca", ca, ca_key)
    srv_key = ec.generate_private_key(ec.SECP256R1())
    srv = _cert(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "coordinator")]),
        ca_key,
        ca_name,
        srv_key,
        san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    write("server", srv, srv_key)
    cli_key = ec.generate_private_key(ec.SECP256R1())
    cli = _cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "island-a")]), ca_key, ca_name, cli_key)
    write("client", cli, cli_key)
    return d


def join(client, island="a"):
    req = pb.JoinRequest(run_id="t", island_id=island, codecs=["identity"], num_ranks=1)
    req.tensors.add(name="w", shape=[2, 2], dtype=pb.DTYPE_FLOAT32)
    return client.join(req)


def test_tls_server(start_server, pki):
    srv = start_server(tls=TlsConfig(cert=pki / "server.pem", key=pki / "server.key"))
    ok = CoordinatorClient(srv.address, retry=FAST, tls=ClientTls(ca=str(pki / "ca.pem")))
    joined = join(ok)
    assert joined.bootstrap
    assert joined.bulk_port == 0 and srv.server.bulk is None and ok.bulk is None  # no plaintext side door
    plain = CoordinatorClient(srv.address, retry=FAST)
    with pytest.raises(grpc.RpcError) as info:
        join(plain, "b")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    ok.close()
    plain.close()


def test_mutual_tls_requires_a_client_certificate(start_server, pki):
    srv = start_server(tls=TlsConfig(cert=pki / "server.pem", key=pki / "server.key", client_ca=pki / "ca.pem"))
    no_cert = CoordinatorClient(srv.address, retry=FAST, tls=ClientTls(ca=str(pki / "ca.pem")))
    with pytest.raises(grpc.RpcError) as info:
        join(no_cert)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with_cert = CoordinatorClient(
        srv.address,
        retry=FAST,
        tls=ClientTls(ca=str(pki / "ca.pem"), cert=str(pki / "client.pem"), key=str(pki / "client.key")),
    )
    assert join(with_cert).bootstrap
    assert srv.inspect(lambda s: sorted(s.membership.islands)) == ["a"]
    no_cert.close()
    with_cert.close()


def test_island_tokens(start_server):
    tokens = IslandTokens({"a": "token-a", "b": "token-b"})
    srv = start_server(exact_config(run_id="t", sync_every=1), tokens=tokens)
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
