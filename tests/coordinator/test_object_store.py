"""The coordinator's state in an S3-compatible object store (``--state-dir s3://bucket/prefix``),
against a real server (SeaweedFS, atoll.harness.seaweed): one writer per run by a lease, a round durable
once its record is in the store, a coordinator that lost its machine replaced by another that
resumes bitwise, and the operator's tools on the store."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time

import pytest
import torch
from safetensors.torch import load_file
from support import collect_events, coordinator_flags, exact_config, island_flags, wait_for
from support.stores import run_rounds, state_of

from atoll.cli import main as cli_main
from atoll.coordinator.disk.mirror import Mirror
from atoll.coordinator.disk.store import ObjectState
from atoll.coordinator.options import StorageOptions
from atoll.harness.seaweed import free_ports
from atoll.lease import Lease
from atoll.objects import LEASE, Conflict, ObjectStore, StoreError

pytestmark = pytest.mark.usefixtures("s3_server")


def test_a_coordinator_address_may_name_standbys():
    from atoll.islands._transport.addresses import alternatives, parse_addresses

    assert parse_addresses("a:1|b:2,c:3") == ["a:1|b:2", "c:3"]
    assert alternatives("a:1| b:2") == ["a:1", "b:2"]
    with pytest.raises(ValueError, match="has no port"):
        parse_addresses("a:1|b")


def test_a_store_on_loopback_serves_from_this_machine():
    """(Its records then go up after the step, not while it runs: the store's work would take the
    step's cores.)"""
    from atoll.objects import is_loopback

    for url in ("http://127.0.0.1:8333", "http://localhost:9000", "http://[::1]:9000", "http://127.8.0.1"):
        assert is_loopback(url), url
    for url in ("https://s3.us-east-1.amazonaws.com", "http://10.0.0.5:9000", "https://minio.example.org"):
        assert not is_loopback(url), url


def test_a_url_names_a_bucket_and_a_prefix():
    assert ObjectStore.from_url("s3://runs/exp/7").key("log/x") == "exp/7/log/x"
    for bad in ("s3://runs", "s3://runs/", "s3:///p"):
        with pytest.raises(StoreError, match="s3://BUCKET/PREFIX"):
            ObjectStore.from_url(bad)


def test_the_lease_admits_one_coordinator_and_changes_hands_only_once_expired(s3_url):
    store = ObjectStore.from_url(s3_url)
    now = [1_000.0]

    def lease():
        return Lease(store, 30.0, skew=2.0, clock=lambda: now[0])

    a = lease().acquire()
    try:
        with pytest.raises(StoreError, match=r"is held by coordinator .* for 32 s more"):
            lease().acquire()
        now[0] += 31  # past its expiry by a's clock, not by the skew a contender allows for
        with pytest.raises(StoreError, match="is held"):
            lease().acquire()
        now[0] += 2
        b = lease().acquire()  # a missed its renewals (a dead machine): taken over
        try:
            with pytest.raises(Conflict):
                a.renew()  # a comes back: the lease is b's
            assert a.lost == "another coordinator took the lease"
            with pytest.raises(StoreError, match="no longer holds the run"):
                a.check()
            b.check()
        finally:
            b.release()
        now[0] += 1
        c = lease().acquire()  # given back cleanly: no wait at all
        c.release()
    finally:
        a.release()


def test_a_round_record_is_written_to_the_store_once(s3_url, tmp_path):
    store = ObjectStore.from_url(s3_url)
    for name in ("a", "b"):
        (tmp_path / name / "log").mkdir(parents=True)
        (tmp_path / name / "log" / "round-00000003.safetensors").write_bytes(name.encode() * 100)
    Mirror(store, tmp_path / "a").put_record(tmp_path / "a" / "log" / "round-00000003.safetensors")
    # the same bytes again (a PUT retried after its answer was lost): it is ours, nothing is wrong
    Mirror(store, tmp_path / "a").put_record(tmp_path / "a" / "log" / "round-00000003.safetensors")
    with pytest.raises(StoreError, match="exists already: another coordinator wrote this round"):
        Mirror(store, tmp_path / "b").put_record(tmp_path / "b" / "log" / "round-00000003.safetensors")
    assert store.get("log/round-00000003.safetensors")[0] == b"a" * 100


def test_a_coordinator_that_lost_its_disk_is_replaced_bitwise_from_the_store(s3_url, start_server, tmp_path):
    """Rounds on a coordinator whose state is in the store; its machine-local files deleted; another
    coordinator (another working dir) resumes at the last published round with θ, momentum and
    history bitwise, and trains on."""
    store = ObjectStore.from_url(s3_url)
    config = exact_config(run_id="t", sync_every=2, outer_momentum=0.9)
    first = start_server(
        config,
        tmp_path / "work-1",
        store=ObjectState(store, lease_seconds=5.0),
        storage=StorageOptions(snapshot_every=2),
    )
    run_rounds(first, 5)
    before = state_of(first)
    assert before[0] == 5
    listed = store.listing()
    assert "head.json" in listed and any(k.startswith("log/round-") for k in listed) and LEASE in listed
    first.stop()  # a clean stop gives the lease back
    shutil.rmtree(tmp_path / "work-1")

    second = start_server(
        config,
        tmp_path / "work-2",
        store=ObjectState(store, lease_seconds=5.0),
        storage=StorageOptions(snapshot_every=2),
    )
    after = state_of(second)
    assert after[0] == before[0]
    assert all(torch.equal(before[1][k], after[1][k]) for k in before[1])
    assert all(torch.equal(before[2][k], after[2][k]) for k in before[2])
    # (the newest round's publish and persist times are measured after its record was made durable)
    newest = {k: v for k, v in before[3][-1].items() if k not in ("publish_seconds", "persist_seconds")}
    assert after[3] == [*before[3][:-1], newest]
    run_rounds(second, 7, seed=1)
    assert second.inspect(lambda s: s.round) == 7
    second.stop()

    out = tmp_path / "theta.safetensors"  # the operator's export reads the store
    assert cli_main(["export", "--state-dir", s3_url, "--out", str(out)]) == 0
    exported = load_file(str(out))
    assert set(exported) == {"0.weight", "0.bias", "1.weight", "1.bias"}


def test_a_second_coordinator_on_a_held_run_is_refused_naming_the_holder(s3_url, start_server, tmp_path, capsys):
    store = ObjectStore.from_url(s3_url)
    config = exact_config(run_id="t", sync_every=2)
    first = start_server(config, tmp_path / "one", store=ObjectState(store, lease_seconds=30.0))
    try:
        with pytest.raises(StoreError, match="is held by coordinator"):
            start_server(config, tmp_path / "two", store=ObjectState(store))
        # the rollback tool too: the run is live (listing the snapshots reads a copy: allowed)
        assert cli_main(["rollback", "--state-dir", s3_url, "--round", "0"]) == 1
        assert "is held by coordinator" in capsys.readouterr().err
    finally:
        first.stop()


def test_failover_after_sigkill_islands_carry_on_and_no_round_is_lost(group, s3_server, s3_url, tmp_path):
    """Real processes: the coordinator is SIGKILLed mid-run and its working dir deleted; a replacement
    started at once is refused while the dead one's lease runs; started once it expired, on another
    port with another working dir, it resumes from the store, and the islands, given both addresses
    (``a|b``), move to it by themselves and finish every round without a restart."""
    env = s3_server.env()
    port, bulk, port2, bulk2 = free_ports(4)
    flags = [*coordinator_flags(sync_every=20, quorum=2), "--store-lease-seconds", "4"]
    coord, address = group.start_coordinator(
        s3_url, [*flags, "--bulk-port", str(bulk), "--work-dir", str(tmp_path / "work-1")], port=port, env=env
    )
    both = f"{address}|127.0.0.1:{port2}"
    rounds = 6
    islands = [group.start(f"island-{i}", island_flags(both, f"island-{i}", rounds=rounds)) for i in range(2)]

    def both_finished(r):
        return lambda ev: (
            {e["island"] for e in ev if e["event"] == "round" and e["round"] == r}
            == {
                "island-0",
                "island-1",
            }
        )

    events = collect_events(islands, until=both_finished(1), timeout=240)
    coord.signal(signal.SIGKILL)
    killed = time.monotonic()
    coord.wait(10)
    shutil.rmtree(tmp_path / "work-1")
    standby = [*flags, "--bulk-port", str(bulk2)]
    with pytest.raises(Exception, match=r"held by coordinator|exited|did not"):
        group.start_coordinator(
            s3_url,
            [*standby, "--work-dir", str(tmp_path / "work-x")],
            name="too-early",
            port=port2,
            env=env,
            timeout=30,
        )
    wait_for(lambda: time.monotonic() - killed > 4 + 2 + 0.5, timeout=30, what="the dead coordinator's lease to expire")
    coord2, _ = group.start_coordinator(
        s3_url, [*standby, "--work-dir", str(tmp_path / "work-2")], name="replacement", port=port2, env=env
    )
    events += collect_events(islands, until=lambda ev: sum(e["event"] == "done" for e in ev) == 2, timeout=300)
    assert [p.wait(30) for p in islands] == [0, 0]
    coord2.stop()
    history = [e["round"] for e in events if e["event"] == "round" and e["island"] == "island-0"]
    assert history == list(range(rounds)), history
    assert "restored run" in coord2.log_tail(100_000)
    assert all(f"trying 127.0.0.1:{port2}" in p.log_path.read_text(errors="replace") for p in islands)


def test_the_guides_object_store_and_failover_steps_run_as_written(group, tmp_path):
    """docs/two-site-run.md section 5, its commands as written after step 1b's certificates: the local
    store (SeaweedFS) with its bucket, a coordinator on it with TLS, tokens and the admin port, a hot
    standby (``--standby``), an island given both; the coordinator SIGKILLed with the island training:
    the standby takes over by itself (no restart of anything) and the run ends; the export. (Swapped
    for a test's: the store's port, the dirs, the coordinators' ports, the lease cut to 2 s, a run of
    4 rounds of H=20, a quorum of the one island.)"""
    import subprocess
    import sys

    from support.shell import Shell, blocks

    shell = Shell(tmp_path)
    found = dict(blocks("store-test"))
    assert list(found) == ["store", "coordinator", "standby", "island", "export"]
    certs = [t for w, t in blocks() if w == "run"][1]  # step 1b's
    out = shell.run(certs.replace("export COORD_HOST=coord.example.org", "export COORD_HOST=localhost"))
    assert out.returncode == 0, out.stderr
    (tmp_path / "admin.token").write_text("-admin-token\n")
    store_port, port, bulk, admin, port2, bulk2, admin2 = free_ports(7)
    swaps = {
        "/var/lib/seaweed": f"{tmp_path}/seaweed",
        "/var/lib/atoll/": f"{tmp_path}/",
        "8333": str(store_port),
        "coord-b.example.org:7070": f"localhost:{port2}",
        "7070": str(port),
        "7071": str(bulk),
        "9090": str(admin),
        "--store-lease-seconds 5": "--store-lease-seconds 2",
        "--quorum 2": "--quorum 1",
        "--sync-every 500": "--sync-every 20",
        "--total-rounds 2000": "--total-rounds 4",
        "--host 0.0.0.0": "--host 127.0.0.1",
    }

    def swapped(text: str, **more: str) -> str:
        for old, new in [*more.items(), *swaps.items()]:  # (``more`` first: its ports, not the primary's)
            text = text.replace(old, new)
        return text

    serve, export = swapped(found["store"]).strip().splitlines()
    assert serve.endswith(" &") and export.startswith("export AWS_ENDPOINT_URL=")
    store_args = shell.argv(serve[: -len(" &")])
    assert store_args[:3] == ["python", "-m", "atoll.harness.seaweed"]
    store = group.start("store", store_args[3:], module="atoll.harness.seaweed", cwd=tmp_path)
    shell.export([export])
    keys = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    env = {**os.environ, **{k: shell.value(k) for k in keys}}

    # (it says where it serves once its bucket is made)
    wait_for(lambda: any(ln.startswith("S3 on") for ln in store.lines), timeout=90, what="the local store")

    def start(what: str, name: str, **more: str):
        args = shell.argv(swapped(found[what], **more))
        assert args[:2] == ["atoll", "coordinator"] and "--tls-cert" in args and "--island-tokens" in args
        return group.start(name, args[1:], env=env, cwd=tmp_path)

    coord = start("coordinator", "coordinator")
    wait_for(lambda: any("listening on" in ln for ln in coord.lines), timeout=60, what="the coordinator")
    standby = start("standby", "standby", **{"7070": str(port2), "7071": str(bulk2), "9090": str(admin2)})
    assert f"--port {port2} --bulk-port {bulk2}" in " ".join(standby.argv)
    island_args = shell.argv(swapped(found["island"]))
    assert island_args[island_args.index("--coordinator") + 1] == f"localhost:{port}|localhost:{port2}"
    island = group.start("site-a", [*island_args[1:], "--inner-lr", "3e-3"], cwd=tmp_path)
    events = collect_events([island], until=lambda ev: any(e["event"] == "round" for e in ev), timeout=120)
    try:
        wait_for(lambda: "following run llm-1" in standby.log_tail(100_000), timeout=60, what="the standby")
    except AssertionError:
        raise AssertionError(f"the standby does not follow:\n{standby.log_tail()}") from None
    coord.signal(signal.SIGKILL)
    coord.wait(10)
    events += collect_events([island], until=lambda ev: any(e["event"] == "done" for e in ev), timeout=240)
    assert island.wait(60) == 0
    assert [e["round"] for e in events if e["event"] == "round"] == [0, 1, 2, 3]
    assert "standby: took over run llm-1" in standby.log_tail(100_000)
    standby.stop()
    args = shell.argv(found["export"])
    out = subprocess.run(
        [sys.executable, "-m", "atoll", *args[1:]], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    assert "at round 4" in out.stdout and (tmp_path / "theta.safetensors").exists()
    store.stop()


def test_a_rollback_in_the_store_is_what_the_next_coordinator_restores(s3_url, start_server, tmp_path, capsys):
    store = ObjectStore.from_url(s3_url)
    config = exact_config(run_id="t", sync_every=2)
    srv = start_server(
        config,
        tmp_path / "w1",
        store=ObjectState(store, lease_seconds=5.0),
        storage=StorageOptions(snapshot_every=2, keep_snapshots=3),
    )
    run_rounds(srv, 6)
    srv.stop()
    assert cli_main(["rollback", "--state-dir", s3_url]) == 0
    listed = [int(r) for r in re.findall(r"^round (\d+) .* ok$", capsys.readouterr().out, re.M)]
    assert len(listed) >= 2, listed
    target = sorted(listed)[-2]
    assert cli_main(["rollback", "--state-dir", s3_url, "--round", str(target)]) == 0
    assert any(k.startswith("discarded/") for k in store.listing())  # set aside in the store, not lost
    again = start_server(config, tmp_path / "w2", store=ObjectState(store, lease_seconds=5.0))
    assert again.inspect(lambda s: s.round) == target
    again.stop()


def test_a_stalled_coordinator_that_wakes_after_a_takeover_writes_nothing(group, s3_server, s3_url, tmp_path):
    """Split brain, the hard order of events: the coordinator is frozen (SIGSTOP) with islands
    training, its lease expires, the hot standby (``--standby``) takes the run over and publishes
    rounds; then the frozen one wakes (SIGCONT). It finds the lease taken and exits without writing,
    and every round is in the store exactly once."""
    env = s3_server.env()
    port, bulk, port2, bulk2 = free_ports(4)
    flags = [*coordinator_flags(sync_every=20, quorum=2), "--store-lease-seconds", "3"]
    first, address = group.start_coordinator(
        s3_url, [*flags, "--bulk-port", str(bulk), "--work-dir", str(tmp_path / "w1")], port=port, env=env
    )
    second = group.start_standby(
        s3_url, [*flags, "--bulk-port", str(bulk2), "--work-dir", str(tmp_path / "w2")], port=port2, env=env
    )
    rounds = 6
    both = f"{address}|127.0.0.1:{port2}"
    islands = [group.start(f"island-{i}", island_flags(both, f"island-{i}", rounds=rounds)) for i in range(2)]
    events = collect_events(
        islands, until=lambda ev: any(e["event"] == "round" and e["round"] == 1 for e in ev), timeout=240
    )
    wait_for(lambda: "following run e2e" in second.log_tail(100_000), timeout=60, what="the standby to follow")
    first.signal(signal.SIGSTOP)
    events += collect_events(
        islands, until=lambda ev: any(e["event"] == "round" and e["round"] == 3 for e in ev), timeout=240
    )
    first.signal(signal.SIGCONT)
    assert first.wait(60) == 1
    assert "lost the run's lease" in first.log_tail(100_000)
    assert "standby: took over run e2e" in second.log_tail(100_000)
    events += collect_events(islands, until=lambda ev: sum(e["event"] == "done" for e in ev) == 2, timeout=300)
    assert [p.wait(30) for p in islands] == [0, 0]
    second.stop()
    for k in ("island-0", "island-1"):
        assert [e["round"] for e in events if e["event"] == "round" and e["island"] == k] == list(range(rounds))
    digests = {}
    for e in events:
        if e["event"] == "round":
            digests.setdefault(e["round"], set()).add(e["digest"])
    assert all(len(d) == 1 for d in digests.values()), digests  # one publisher per round: one θ


def test_a_large_file_goes_up_in_parts_and_a_record_in_parts_is_still_written_once(s3_url, tmp_path, monkeypatch):
    import atoll.objects as objects

    monkeypatch.setattr(objects, "PART_BYTES", 5 << 20)  # S3's smallest part: a 12 MiB file is 3 parts
    store = ObjectStore.from_url(s3_url)
    data = bytes(range(256)) * (12 << 12)
    (tmp_path / "big").write_bytes(data)
    store.put_file(tmp_path / "big", "snapshot-big")
    assert store.get("snapshot-big")[0] == data
    store.put_file(tmp_path / "big", "log/round-00000001.safetensors", create_only=True)
    with pytest.raises(Conflict):
        store.put_file(tmp_path / "big", "log/round-00000001.safetensors", create_only=True)


def test_a_record_another_coordinator_wrote_stops_this_one(s3_url, tmp_path):
    """The fence behind the lease: a coordinator about to make a round durable finds its record in the
    store already (another one took the run while it stalled): it loses the run, and says so."""
    store = ObjectStore.from_url(s3_url)
    for name in ("a", "b"):
        (tmp_path / name / "log").mkdir(parents=True)
        (tmp_path / name / "log" / "round-00000004.safetensors").write_bytes(name.encode() * 10)
    Mirror(store, tmp_path / "a").put_record(tmp_path / "a" / "log" / "round-00000004.safetensors")
    lost = []
    lease = Lease(store, 30.0, on_lost=lost.append).acquire()
    try:
        with pytest.raises(StoreError, match="exists already"):
            Mirror(store, tmp_path / "b", lease).put_record(tmp_path / "b" / "log" / "round-00000004.safetensors")
        assert lost and "another coordinator wrote this round" in lost[0]
        with pytest.raises(StoreError, match="no longer holds the run"):
            lease.check()
    finally:
        lease.release()


def test_a_record_goes_up_while_the_step_makes_it_and_is_the_local_file_byte_for_byte(s3_url, tmp_path, monkeypatch):
    """With the state in a store, a round's record is sent as the outer step hands over its payloads (a
    multipart upload: parts while it runs, the header with the first bytes and the rest at the end),
    completed create-only. The object is the local record file, byte for byte, and reads back as the
    round's update; a second coordinator's record of the same round, also streamed, is refused."""
    import atoll.coordinator.disk.upload as upload_mod
    from atoll.compression import get_codec
    from atoll.coordinator.config import RunConfig
    from atoll.coordinator.disk import wal
    from atoll.coordinator.disk.writer import StateWriter

    puts = []
    real_put = upload_mod.RecordUpload._put

    def counted(self, upload, number, body):
        puts.append((number, len(body)))
        return real_put(self, upload, number, body)

    monkeypatch.setattr(upload_mod.RecordUpload, "_put", counted)
    store = ObjectStore.from_url(s3_url)
    codec = get_codec("int8")
    gen = torch.Generator().manual_seed(6)
    update = {f"t{i}": codec.encode(torch.randn(n, generator=gen)) for i, n in enumerate([7 << 20, 3, 9 << 20, 1000])}
    config = RunConfig(run_id="r", codec="int8")

    def write_round(local, loss: float = 1.0):
        kept = ObjectState(store)
        kept.mirror = Mirror(store, local)
        kept.mirror.streams = True  # (on its own a store on loopback takes records after the step)
        writer = StateWriter(local, every=100, keep=1, store=kept)
        hint = wal.head_hint({k: len(p) for k, p in update.items()}, lambda: {}, [{"round": 2}])
        assert hint is not None  # (an update this large is streamed)
        with writer.streaming(2, lambda name, payload: None, hint) as made:
            for name, payload in update.items():
                made(name, payload)
        writer.log_round(2, update, {"round": 2, "loss": loss}, {}, config)
        return local / wal.LOG / wal.record_name(2)

    path = write_round(tmp_path / "a")
    got = store.get("log/round-00000002.safetensors")[0]
    assert got == path.read_bytes() and len(got) > 16 << 20
    assert sorted(n for n, _ in puts) == list(range(1, len(puts) + 1)) and len(puts) >= 3
    assert puts[-1][0] == 1 or 1 in [n for n, _ in puts[-2:]]  # the header's part went up last
    (tmp_path / "check" / wal.LOG).mkdir(parents=True)
    (tmp_path / "check" / wal.LOG / path.name).write_bytes(got)
    rec = wal.read(tmp_path / "check" / wal.LOG / path.name)  # every checksum verified
    assert {k: bytes(v) for k, v in rec.payloads.items()} == {k: bytes(p) for k, p in update.items()}
    with pytest.raises(StoreError, match="exists already: another coordinator wrote this round"):
        write_round(tmp_path / "b", loss=2.0)  # (another round 2: its history differs)
    assert store.get("log/round-00000002.safetensors")[0] == got
    assert not store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads")  # the refused one aborted


def test_a_streamed_record_the_store_refused_a_part_of_is_put_whole(s3_url, tmp_path, monkeypatch, caplog):
    """A part the store refuses while the step runs costs nothing but time: the round's record is then
    put whole after the step, as before the streaming, and the broken upload is aborted."""
    import atoll.coordinator.disk.upload as upload_mod
    from atoll.compression import get_codec
    from atoll.coordinator.config import RunConfig
    from atoll.coordinator.disk import wal
    from atoll.coordinator.disk.writer import StateWriter

    real_put = upload_mod.RecordUpload._put

    def refuse_part_3(self, upload, number, body):
        if number == 3:
            raise StoreError("part 3: refused (a test)")
        return real_put(self, upload, number, body)

    monkeypatch.setattr(upload_mod.RecordUpload, "_put", refuse_part_3)
    store = ObjectStore.from_url(s3_url)
    update = {"t": get_codec("int8").encode(torch.randn(30 << 20))}
    kept = ObjectState(store)
    kept.mirror = Mirror(store, tmp_path / "a")
    kept.mirror.streams = True
    writer = StateWriter(tmp_path / "a", every=100, keep=1, store=kept)
    hint = wal.head_hint({k: len(p) for k, p in update.items()}, lambda: {}, [{"round": 0}])
    with writer.streaming(0, lambda name, payload: None, hint) as made:
        made("t", update["t"])
    with caplog.at_level("INFO", logger="atoll.coordinator"):
        writer.log_round(0, update, {"round": 0}, {}, RunConfig(run_id="r", codec="int8"))
    assert "did not go up (part 3: refused (a test)); putting it whole" in caplog.text
    path = tmp_path / "a" / wal.LOG / wal.record_name(0)
    assert store.get("log/round-00000000.safetensors")[0] == path.read_bytes()
    assert not store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads")
