"""The WAN proxy: latency, bandwidth and cuts measured on real loopback sockets."""

import socket
import threading
import time

import pytest
from support import wait_for

from atoll.harness.wan import LinkProfile, ProxyThread


@pytest.fixture
def echo_server():
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    def echo(conn):
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield f"127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join(5)
    srv.close()


def connect(address):
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def test_latency(echo_server):
    with ProxyThread(echo_server, LinkProfile(rtt_ms=100)) as proxy, connect(proxy.address) as s:
        s.sendall(b"x")
        s.recv(1)  # warm
        t = time.perf_counter()
        s.sendall(b"ping")
        assert s.recv(4) == b"ping"
        rtt = time.perf_counter() - t
    # rtt/2 each way through the proxy: one ping-pong costs the configured 100 ms RTT
    assert 0.095 < rtt < 0.2, rtt


def test_bandwidth(echo_server):
    n = 2_000_000
    with ProxyThread(echo_server, LinkProfile(rate_mbit=40)) as proxy, connect(proxy.address) as s:
        t = time.perf_counter()
        threading.Thread(target=s.sendall, args=(b"\0" * n,), daemon=True).start()
        got = 0
        while got < n:
            got += len(s.recv(1 << 20))
        dt = time.perf_counter() - t
    mbit = n * 8 / dt / 1e6
    assert 30 < mbit < 44, mbit  # 40 Mbit/s each way, pipelined


def test_cut_drops_and_refuses_then_recovers(echo_server):
    with ProxyThread(echo_server) as proxy:
        s = connect(proxy.address)
        s.sendall(b"a")
        assert s.recv(1) == b"a"
        proxy.cut(1.0)
        with pytest.raises(OSError):
            s.sendall(b"b" * 100000)
            if not s.recv(1):
                raise ConnectionResetError
        s.close()
        with pytest.raises(OSError), connect(proxy.address) as s2:
            s2.sendall(b"c")
            if not s2.recv(1):
                raise ConnectionResetError
        wait_for(lambda: not proxy.is_cut, what="the cut to end")
        with connect(proxy.address) as s3:
            s3.sendall(b"d")
            assert s3.recv(1) == b"d"
