"""A stalled object store is heard of (hardening round 5, items 4, 8 and 13): a WARNING and an unhealthy
/healthz within the lease's time, a coordinator whose lease lapsed publishes nothing, a malformed lease
is one line naming it, and the lease's length is checked where it is given."""

from __future__ import annotations

import logging
import signal
import time

import pytest
from support import exact_config, wait_for
from support.stores import run_rounds

from atoll.cli import main as cli_main
from atoll.coordinator.disk.mirror import Mirror
from atoll.coordinator.disk.store import ObjectState
from atoll.lease import Lease
from atoll.objects import LEASE, ObjectStore, StoreError

pytestmark = pytest.mark.usefixtures("s3_server")


def test_a_stalled_store_is_a_warning_and_unhealthy_within_the_lease(s3_server, s3_url, start_server, caplog):
    """The store SIGSTOPped under a live coordinator (lease 3 s): a WARNING and /healthz's reason come
    within the lease (nothing was said for 80 s), and the lease is lost when it lapses, not when the
    store answers again."""
    lost: list[str] = []
    srv = start_server(
        exact_config(run_id="t", sync_every=2),
        store=ObjectState(ObjectStore.from_url(s3_url), lease_seconds=3.0, on_lost=lost.append),
    )
    run_rounds(srv, 1)
    assert srv.inspect(lambda s: s.unhealthy()) is None
    with caplog.at_level(logging.WARNING, logger="atoll.coordinator"):
        s3_server.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            wait_for(lambda: srv.inspect(lambda s: s.unhealthy()) is not None, timeout=10, what="/healthz to say")
            heard = time.monotonic() - stopped
            assert heard < 3.0, heard
            assert "the lease was not renewed" in srv.inspect(lambda s: s.unhealthy())
            assert "could not renew the lease on" in caplog.text
            wait_for(lambda: lost, timeout=10, what="the lease to lapse")
            assert time.monotonic() - stopped < 3.0 + 2.0
            assert "unreachable" in lost[0]
        finally:
            s3_server.proc.send_signal(signal.SIGCONT)
    assert "the lease is lost" in srv.inspect(lambda s: s.unhealthy())


def test_a_record_whose_put_outlasted_the_lease_is_not_published(s3_url, tmp_path, monkeypatch):
    """The record's PUT completes after the lease lapsed (the store stalled meanwhile): durable in the
    store, but put_record raises and the lease is lost, so the round is never published by this one."""
    store = ObjectStore.from_url(s3_url)
    now = [100.0]
    lost: list[str] = []
    lease = Lease(store, 30.0, monotonic=lambda: now[0], on_lost=lost.append).acquire()
    real = Mirror._commit

    def slow(self, path, rel, upload):
        real(self, path, rel, upload)
        now[0] += 31  # the PUT took longer than the lease

    monkeypatch.setattr(Mirror, "_commit", slow)
    (tmp_path / "log").mkdir()
    path = tmp_path / "log" / "round-00000000.safetensors"
    path.write_bytes(b"r" * 10)
    try:
        with pytest.raises(StoreError, match="no longer holds the run"):
            Mirror(store, tmp_path, lease).put_record(path)
        assert lost and "not renewed for 31 s" in lost[0]
        assert store.get("log/round-00000000.safetensors")[0] == b"r" * 10
    finally:
        lease.release()


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"expires": "soon"}', b'{"expires": Infinity}'])
def test_a_malformed_lease_is_one_line_naming_it(s3_url, body):
    store = ObjectStore.from_url(s3_url)
    store.put_bytes(LEASE, body)
    with pytest.raises(StoreError, match=rf"{s3_url}/lease.json is not a lease atoll wrote .*delete it") as err:
        Lease(store, 5.0).acquire()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "0.5", "1e9"])
def test_store_lease_seconds_out_of_range_is_one_line(value, capsys):
    """0, -1 and nan were accepted (the coordinator died at its next write); inf crashed the renewal
    thread and wrote a lease that never expires."""
    with pytest.raises(SystemExit) as exit_:
        cli_main(["coordinator", "--state-dir", "s3://b/p", "--store-lease-seconds", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--store-lease-seconds must be in 1..86400" in err and "Traceback" not in err


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan"), float("inf")])
def test_a_lease_of_no_finite_length_is_refused(seconds):
    with pytest.raises(ValueError, match="a finite number of seconds > 0"):
        Lease(ObjectStore.from_url("s3://b/p"), seconds)
