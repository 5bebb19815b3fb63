"""The coordinator's options: typed, one dataclass per concern, built once from the command line or in
Python, checked where they are made; ``atoll coordinator --help`` in groups by concern."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from atoll.cli import build_parser, parse_args
from atoll.coordinator.config import RunConfig
from atoll.coordinator.options import (
    AdminOptions,
    CoordinatorOptions,
    LimitsOptions,
    NetworkOptions,
    PlacementOptions,
    StorageOptions,
    from_args,
)


def test_help_groups_the_coordinators_flags_by_concern():
    text = build_parser().subcommands["coordinator"].format_help()
    groups = [
        "network:",
        "storage:",
        "limits:",
        "admin HTTP:",
        "security:",
        "sharding and fragments:",
        "the run's math (stored with the run; a restart may not change it):",
        "the round policy (stored with the run; changeable on a restart or a live run):",
    ]
    at = [text.index("\n" + g) for g in groups]
    assert at == sorted(at)
    math = text[at[-2] : at[-1]]
    policy = text[at[-1] :]
    assert "--codec" in math and "--sync-every" in math and "--quorum" not in math
    assert "--quorum" in policy and "--round-deadline-seconds" in policy and "--codec " not in policy
    assert "--bulk-port" in text[at[0] : at[1]] and "--store-lease-seconds" in text[at[1] : at[2]]


def test_the_command_line_makes_one_typed_options_object():
    ns = parse_args(
        [
            "coordinator",
            "--state-dir",
            "s3://b/p",
            "--work-dir",
            "/tmp/w",
            "--port",
            "7070",
            "--bulk-port",
            "-1",
            "--admin-port",
            "9090",
            "--admin-token",
            "t",
            "--store-lease-seconds",
            "4",
            "--snapshot-every",
            "3",
            "--max-inflight-bytes",
            "1000",
            "--threads",
            "1",
            "--tensor-workers",
            "3",
            "--shard",
            "1/2",
            "--partition",
            "layers",
            "--sync-every",
            "30",
            "--quorum",
            "2",
            "--exit-when-complete",
        ]  # fmt: skip
    )
    o = from_args(ns)
    assert o.state_dir == "s3://b/p" and o.work_dir == Path("/tmp/w") and o.exit_when_complete
    assert o.network == NetworkOptions(port=7070, bulk_port=None)
    assert o.admin == AdminOptions(port=9090, token="t")
    assert o.storage == StorageOptions(lease_seconds=4.0, snapshot_every=3)
    assert o.limits == LimitsOptions(max_inflight_bytes=1000, threads=1, tensor_workers=3)
    assert o.limits.workers() == 3
    assert o.placement == PlacementOptions(shard=(1, 2), partition="layers")
    assert o.run.sync_every == 30 and o.run.quorum == 2 and o.given == {"sync_every", "quorum"}
    assert o.security.tls is None and o.security.tokens is None


def test_options_are_checked_where_they_are_made_whether_from_python_or_the_command_line():
    with pytest.raises(ValueError, match=r"--store-lease-seconds must be in 1\.\.86400, got 0\.5"):
        StorageOptions(lease_seconds=0.5)
    with pytest.raises(ValueError, match="--port must be in 0..65535, got 70000"):
        NetworkOptions(port=70000)
    with pytest.raises(ValueError, match="keep_snapshots must be >= 1"):
        StorageOptions(keep_snapshots=0)
    with pytest.raises(ValueError, match="--threads must be >= 0"):
        LimitsOptions(threads=-1)
    with pytest.raises(ValueError, match="--tensor-workers must be >= 0, got -1"):
        LimitsOptions(tensor_workers=-1)
    with pytest.raises(ValueError, match="--tensor-workers must be <= 64, got 65"):
        from_args(parse_args(["coordinator", "--state-dir", "d", "--tensor-workers", "65"]))
    with pytest.raises(ValueError, match="--fragments runs every shard of the run itself; drop --shard"):
        PlacementOptions(shard=(0, 2), fragments=2)
    with pytest.raises(ValueError, match=r"--bulk-port must be in -1\.\.65535"):
        from_args(parse_args(["coordinator", "--state-dir", "d", "--bulk-port", "-2"]))
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        from_args(parse_args(["coordinator", "--state-dir", "d", "--tls-cert", "c.pem"]))


def test_a_fragment_has_its_own_shard_state_dir_and_ports_and_only_the_first_serves_admin():
    o = CoordinatorOptions(
        run=RunConfig(),
        state_dir="d",
        network=NetworkOptions(port=7000, bulk_port=8000),
        admin=AdminOptions(port=9090),
        placement=PlacementOptions(fragments=3),
    )
    frags = [o.fragment(i, Path(f"d/fragment-{i}")) for i in range(3)]
    assert [f.placement for f in frags] == [PlacementOptions(shard=(i, 3), partition="layers") for i in range(3)]
    assert [(f.network.port, f.network.bulk_port) for f in frags] == [(7000, 8000), (7001, 8001), (7002, 8002)]
    assert [f.admin.port for f in frags] == [9090, None, None]
    assert frags[2].state_dir == Path("d/fragment-2") and frags[2].run is o.run
    free = dataclasses.replace(o, network=NetworkOptions()).fragment(1, Path("x"))
    assert (free.network.port, free.network.bulk_port) == (0, 0)  # 0 stays "pick one" for each


def test_the_flat_keywords_of_the_last_release_still_work_for_one_more_with_a_warning(tmp_path):
    """CoordinatorServer is public (atoll.coordinator): a program that made one with the keywords of the
    release before the typed options keeps working this release, told what to write instead."""
    from atoll.coordinator import CoordinatorServer

    with pytest.warns(FutureWarning, match=r"CoordinatorServer\(admin_port, max_inflight_bytes, shard=...\) is "):
        server = CoordinatorServer(
            RunConfig(run_id="t"), tmp_path, admin_port=0, shard=(1, 2), max_inflight_bytes=1 << 30
        )
    assert server.admin_options == AdminOptions(port=0)
    assert server.state_options["placement"] == PlacementOptions(shard=(1, 2))
    assert server.state_options["limits"] == LimitsOptions(max_inflight_bytes=1 << 30)
    with pytest.raises(TypeError, match="unexpected keyword arguments: admin_prot"):
        CoordinatorServer(RunConfig(run_id="t"), tmp_path, admin_prot=0)
