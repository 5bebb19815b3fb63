"""The coordinator's options, typed: one dataclass per concern, built once (from the command line by
:func:`from_args`, or in Python), checked where they are made, and handed to the daemon whole
(:func:`atoll.coordinator.main.serve`).

The run itself (its math and its round policy) is :class:`~atoll.coordinator.config.RunConfig`, stored
with the state; the rest is how this process serves it, and is not stored:
:mod:`~atoll.coordinator.transport.options` (network, admin, security) and
:mod:`~atoll.coordinator.run.options` (placement, storage, limits).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from atoll.coordinator.config import MATH_FIELDS, RunConfig
from atoll.coordinator.run.options import LimitsOptions, PlacementOptions, StorageOptions
from atoll.coordinator.transport.options import (
    STREAM_IDLE_SECONDS,
    AdminOptions,
    NetworkOptions,
    SecurityOptions,
    check_port,
)
from atoll.coordinator.transport.security import IslandTokens, TlsConfig
from atoll.flags import add_dataclass_args, config_from, given_fields
from atoll.sharding import PARTITIONS, parse_shard


@dataclass(frozen=True, kw_only=True)
class CoordinatorOptions:
    run: RunConfig
    state_dir: str | Path
    """A local dir, or ``s3://bucket/prefix``."""
    work_dir: Path | None = None
    """With an object store: the machine-local working copy (default: under the temp dir)."""
    given: frozenset[str] | None = None
    """The run fields the operator set (None: all): on an existing state, the math ones must match and
    the operational ones apply."""
    network: NetworkOptions = field(default_factory=NetworkOptions)
    admin: AdminOptions = field(default_factory=AdminOptions)
    security: SecurityOptions = field(default_factory=SecurityOptions)
    storage: StorageOptions = field(default_factory=StorageOptions)
    limits: LimitsOptions = field(default_factory=LimitsOptions)
    placement: PlacementOptions = field(default_factory=PlacementOptions)
    exit_when_complete: bool = False

    def fragment(self, i: int, state_dir: Path) -> CoordinatorOptions:
        """Fragment ``i`` of a ``--fragments P`` coordinator: shard i/P of the layers, its own state
        dir, its own ports (fixed ports counted up from the first; 0 stays 0), the admin server on
        fragment 0 only."""
        p, net = self.placement.fragments, self.network
        return dataclasses.replace(
            self,
            state_dir=state_dir,
            placement=PlacementOptions(shard=(i, p), partition="layers"),
            network=dataclasses.replace(
                net,
                port=net.port + i if net.port else 0,
                bulk_port=net.bulk_port + i if net.bulk_port else net.bulk_port,
            ),
            admin=self.admin if i == 0 else AdminOptions(),
        )


# ---- the command line ------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``atoll coordinator``'s flags, in groups by concern."""
    net = parser.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    net.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default: 0)")
    net.add_argument(
        "--bulk-port",
        type=int,
        default=0,
        help="serve pushes and pulls as TCP streams on this port too, beside gRPC (islands learn it at Join and "
        "fall back to gRPC if it is unreachable; over TLS with --tls-cert's certificates, as gRPC); 0 picks a free "
        "one, -1: none (default: 0)",
    )
    net.add_argument("--port-file", type=Path, default=None, help="write the bound port(s) here once serving")
    net.add_argument(
        "--stream-idle-seconds",
        type=float,
        default=STREAM_IDLE_SECONDS,
        help="end a push stream silent this long, or a pull stream whose peer takes nothing for this long "
        "(default: 120)",
    )

    storage = parser.add_argument_group("storage")
    storage.add_argument(
        "--state-dir",
        required=True,
        help="where the run's state is kept: a local dir, or s3://BUCKET/PREFIX in an S3-compatible object store "
        "(endpoint and credentials from the standard AWS environment/config; needs pip install 'atoll[s3]') (required)",
    )
    storage.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="with an s3:// --state-dir: the machine-local working copy (default: a dir under the system's temp dir)",
    )
    storage.add_argument(
        "--store-lease-seconds",
        type=float,
        default=15.0,
        help="with an s3:// --state-dir: the run's lease in the store, which a coordinator replacing a dead one "
        "waits out (default: 15)",
    )
    storage.add_argument(
        "--standby",
        action="store_true",
        help="with an s3:// --state-dir: follow the run another coordinator serves (θ, momentum and membership "
        "in memory, each record verified as it lands) and take it over the moment that one's lease lapses; "
        "give islands both addresses, PRIMARY|STANDBY",
    )
    storage.add_argument(
        "--exact-failover",
        action="store_true",
        help="with an s3:// --state-dir: each round's outer optimizer state (momentum, downlink error feedback) "
        "goes up before the round is published, not just after, so a standby continues bitwise however the "
        "primary dies (|θ| to 2|θ| fp32 more before each publish); without it, a primary killed in that window "
        "leaves the standby the previous round's momentum",
    )
    storage.add_argument(
        "--keep-snapshots", type=int, default=2, help="verified snapshots kept for an explicit rollback (default: 2)"
    )
    storage.add_argument(
        "--snapshot-every",
        type=int,
        default=8,
        help="rounds between full snapshots, written in the background; every round is durable before it "
        "is published by its write-ahead log record, small (default: 8)",
    )

    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--max-inflight-bytes",
        type=int,
        default=0,
        help="push payload bytes admitted at once (declared at each push's header); past it pushes get "
        "RESOURCE_EXHAUSTED before their data flows and retry (default 0: two whole fp32 pushes of the model, "
        "at least 256 MiB)",
    )
    limits.add_argument(
        "--max-pull-bytes",
        type=int,
        default=0,
        help="memory the pulls being answered may hold at once (their copies of θ's regions, updates read from "
        "the log, what their transport buffers); past it a pull gets RESOURCE_EXHAUSTED before its data "
        "flows and retries (default 0: two fp32 copies of the model, at least 256 MiB)",
    )
    limits.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads of the outer step and the decoding; a coordinator sharing its cores with "
        "islands should take fewer than the cores (0: torch's default, one per core)",
    )
    limits.add_argument(
        "--tensor-workers",
        type=int,
        default=0,
        help="threads that run the outer step and a push's decoding on several of θ's tensors at once, each "
        "tensor's work whole, so θ keeps its bits whatever the number (0: one per core that --threads leaves "
        "idle, at most 4; 1: one tensor after another)",
    )

    add_admin_arguments(parser.add_argument_group("admin HTTP"))
    add_security_arguments(parser.add_argument_group("security"))

    placement = parser.add_argument_group("sharding and fragments")
    placement.add_argument("--shard", default="0/1", help="i/n: this coordinator owns tensors crc32(name) %% n == i")
    placement.add_argument(
        "--partition",
        default="hash",
        choices=list(PARTITIONS),
        help="how tensors map to shards: crc32 of the name, or contiguous size-balanced blocks (streaming)",
    )
    placement.add_argument(
        "--fragments",
        type=int,
        default=0,
        help="streaming DiLoCo: serve all P fragments (shards i/P, --partition layers) from this process, "
        "one port each; islands run with --streaming (default: 0, off)",
    )
    parser.add_argument(
        "--exit-when-complete",
        action="store_true",
        help="exit 0 by itself once the run is complete (--total-rounds) and every live island holds the "
        "final θ (for batch schedulers)",
    )
    math_fields = set(MATH_FIELDS)
    other = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name not in math_fields)
    add_dataclass_args(
        parser.add_argument_group("the run's math (stored with the run; a restart may not change it)"),
        RunConfig,
        skip=other,
        track_given=True,
    )
    add_dataclass_args(
        parser.add_argument_group("the round policy (stored with the run; changeable on a restart or a live run)"),
        RunConfig,
        skip=tuple(math_fields),
        track_given=True,
    )


def add_admin_arguments(admin) -> None:
    """The admin server's flags (``atoll coordinator``'s, and ``atoll relay``'s for its own islands)."""
    admin.add_argument("--admin-host", default="127.0.0.1", help="admin HTTP address (non-loopback needs a token)")
    admin.add_argument("--admin-port", type=int, default=None, help="serve /healthz, /metrics, /api/status, / here")
    admin.add_argument("--admin-token", default=None, help="bearer token of the admin endpoints (enables POST control)")
    admin.add_argument("--admin-port-file", type=Path, default=None, help="write the admin port here")


def add_security_arguments(security) -> None:
    """How islands reach this server: TLS, mutual TLS, their tokens (a coordinator's, a relay's)."""
    security.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain: serve gRPC over TLS")
    security.add_argument("--tls-key", type=Path, default=None, help="PEM private key for --tls-cert")
    security.add_argument("--tls-client-ca", type=Path, default=None, help="require client certs from this CA (mTLS)")
    security.add_argument(
        "--island-tokens",
        type=Path,
        default=None,
        help='JSON {"island-id": "token"}: islands must present their own bearer token',
    )


def admin_from_args(ns: argparse.Namespace) -> AdminOptions:
    return AdminOptions(host=ns.admin_host, port=ns.admin_port, token=ns.admin_token, port_file=ns.admin_port_file)


def security_from_args(ns: argparse.Namespace) -> SecurityOptions:
    """ValueError for a TLS flag without its partner."""
    if (ns.tls_cert is None) != (ns.tls_key is None) or (ns.tls_client_ca and not ns.tls_cert):
        raise ValueError("--tls-cert and --tls-key go together; --tls-client-ca needs them")
    return SecurityOptions(
        tls=TlsConfig(cert=ns.tls_cert, key=ns.tls_key, client_ca=ns.tls_client_ca) if ns.tls_cert else None,
        tokens=IslandTokens.load(ns.island_tokens) if ns.island_tokens else None,
    )


def from_args(ns: argparse.Namespace) -> CoordinatorOptions:
    """The options of ``atoll coordinator``'s parsed flags (ValueError, naming the flag, on a bad one)."""
    security = security_from_args(ns)
    check_port("--bulk-port", ns.bulk_port, low=-1)  # (-1: none; NetworkOptions holds None for it)
    return CoordinatorOptions(
        run=config_from(RunConfig, ns),
        state_dir=ns.state_dir,
        work_dir=ns.work_dir,
        given=given_fields(RunConfig, ns),
        network=NetworkOptions(
            host=ns.host,
            port=ns.port,
            port_file=ns.port_file,
            bulk_port=None if ns.bulk_port < 0 else ns.bulk_port,
            stream_idle_seconds=ns.stream_idle_seconds,
        ),
        admin=admin_from_args(ns),
        security=security,
        storage=StorageOptions(
            keep_snapshots=ns.keep_snapshots,
            snapshot_every=ns.snapshot_every,
            lease_seconds=ns.store_lease_seconds,
            standby=ns.standby,
            exact_failover=ns.exact_failover,
        ),
        limits=LimitsOptions(
            max_inflight_bytes=ns.max_inflight_bytes,
            max_pull_bytes=ns.max_pull_bytes,
            threads=ns.threads,
            tensor_workers=ns.tensor_workers,
        ),
        placement=PlacementOptions(shard=parse_shard(ns.shard), partition=ns.partition, fragments=ns.fragments),
        exit_when_complete=ns.exit_when_complete,
    )
