"""The ``atoll`` command: ``coordinator``, ``island``, ``demo``, ``plan``, ``status``, ``export``, ``rollback``
and ``restore-store``.

Every flag is spelled out in full (no prefix matching: ``--sync-every`` is never taken for
``--sync-every-seconds``). A refusal the user can act on (a damaged state dir, a model the run does
not take) prints one line and exits non-zero; no traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from atoll.flags import LOG_LEVELS, add_dataclass_args, config_from, given_fields, run_command, tokens_glued


def _version() -> str:
    try:
        return version("atoll")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
        return "unknown"


def _subparser(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
    p.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS, help="log verbosity (default: INFO)")
    return p


def build_parser() -> argparse.ArgumentParser:
    from atoll.coordinator.config import RunConfig
    from atoll.harness.demo import DemoArgs
    from atoll.workload import command as island_command

    parser = argparse.ArgumentParser(
        prog="atoll",
        description="atoll: DiLoCo training across islands of accelerators, coordinated over gRPC.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"atoll {_version()}")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS, help="log verbosity (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.subcommands = sub.choices

    coord = _subparser(sub, "coordinator", "run the coordinator daemon")
    coord.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    coord.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default: 0)")
    coord.add_argument(
        "--state-dir",
        required=True,
        help="where the run's state is kept: a local dir, or s3://BUCKET/PREFIX in an S3-compatible object store "
        "(endpoint and credentials from the standard AWS environment/config; needs pip install 'atoll[s3]') (required)",
    )
    coord.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="with an s3:// --state-dir: the machine-local working copy (default: a dir under the system's temp dir)",
    )
    coord.add_argument(
        "--store-lease-seconds",
        type=float,
        default=15.0,
        help="with an s3:// --state-dir: the run's lease in the store, which a coordinator replacing a dead one "
        "waits out (default: 15)",
    )
    coord.add_argument("--port-file", type=Path, default=None, help="write the bound port(s) here once serving")
    coord.add_argument(
        "--keep-snapshots", type=int, default=2, help="verified snapshots kept for an explicit rollback (default: 2)"
    )
    coord.add_argument(
        "--snapshot-every",
        type=int,
        default=8,
        help="rounds between full snapshots, written in the background; every round is durable before it "
        "is published by its write-ahead log record, small (default: 8)",
    )
    coord.add_argument(
        "--max-inflight-bytes",
        type=int,
        default=0,
        help="push payload bytes admitted at once (declared at each push's header); past it pushes get "
        "RESOURCE_EXHAUSTED before their data flows and retry (default 0: two whole fp32 pushes of the model, "
        "at least 256 MiB)",
    )
    coord.add_argument(
        "--max-pull-bytes",
        type=int,
        default=0,
        help="memory the pulls being answered may hold at once (their copies of θ's regions, updates read from "
        "the log, what their transport buffers); past it a pull gets RESOURCE_EXHAUSTED before its data "
        "flows and retries (default 0: two fp32 copies of the model, at least 256 MiB)",
    )
    coord.add_argument(
        "--stream-idle-seconds",
        type=float,
        default=120.0,
        help="end a push stream silent this long, or a pull stream whose peer takes nothing for this long "
        "(default: 120)",
    )
    coord.add_argument(
        "--bulk-port",
        type=int,
        default=0,
        help="serve pushes and pulls as TCP streams on this port too, beside gRPC (islands learn it at Join and "
        "fall back to gRPC if it is unreachable; over TLS with --tls-cert's certificates, as gRPC); 0 picks a free "
        "one, -1: none (default: 0)",
    )
    coord.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads of the outer step and the decoding; a coordinator sharing its cores with "
        "islands should take fewer than the cores (0: torch's default, one per core)",
    )
    coord.add_argument("--admin-host", default="127.0.0.1", help="admin HTTP address (non-loopback needs a token)")
    coord.add_argument("--admin-port", type=int, default=None, help="serve /healthz, /metrics, /api/status, / here")
    coord.add_argument("--admin-token", default=None, help="bearer token of the admin endpoints (enables POST control)")
    coord.add_argument("--admin-port-file", type=Path, default=None, help="write the admin port here")
    coord.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain: serve gRPC over TLS")
    coord.add_argument("--tls-key", type=Path, default=None, help="PEM private key for --tls-cert")
    coord.add_argument("--tls-client-ca", type=Path, default=None, help="require client certs from this CA (mTLS)")
    coord.add_argument("--shard", default="0/1", help="i/n: this coordinator owns tensors crc32(name) %% n == i")
    coord.add_argument(
        "--partition",
        default="hash",
        choices=["hash", "layers"],
        help="how tensors map to shards: crc32 of the name, or contiguous size-balanced blocks (streaming)",
    )
    coord.add_argument(
        "--fragments",
        type=int,
        default=0,
        help="streaming DiLoCo: serve all P fragments (shards i/P, --partition layers) from this process, "
        "one port each; islands run with --streaming (default: 0, off)",
    )
    coord.add_argument(
        "--island-tokens",
        type=Path,
        default=None,
        help='JSON {"island-id": "token"}: islands must present their own bearer token',
    )
    coord.add_argument(
        "--exit-when-complete",
        action="store_true",
        help="exit 0 by itself once the run is complete (--total-rounds) and every live island holds the "
        "final θ (for batch schedulers)",
    )
    add_dataclass_args(coord, RunConfig, track_given=True)

    island_command.add_arguments(_subparser(sub, "island", island_command.HELP))

    demo = _subparser(sub, "demo", "coordinator + islands as processes on loopback, a few rounds")
    add_dataclass_args(demo, DemoArgs)

    from atoll import plan_cli

    plan_cli.add_arguments(_subparser(sub, "plan", "what a run costs on a link, and which settings to pick"))

    status = _subparser(sub, "status", "print a running coordinator's run at a glance")
    status.add_argument("--admin", required=True, help="the admin URL, e.g. http://127.0.0.1:9090 (required)")
    status.add_argument("--token", default=None, help="the admin bearer token, if the coordinator has one")

    export = _subparser(sub, "export", "write the trained θ of a coordinator's state dir as safetensors")
    export.add_argument(
        "--state-dir",
        required=True,
        help="the coordinator's --state-dir; for a --fragments coordinator, the same parent dir (required)",
    )
    where = export.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--out",
        type=Path,
        help="the .safetensors file to write; the model card the islands declared goes beside it (X.config.json)",
    )
    where.add_argument(
        "--hf-dir",
        type=Path,
        help="a Hugging Face model dir (config.json, model.safetensors), for a run of a Hugging Face model",
    )
    export.add_argument("--round", type=int, default=None, help="a kept snapshot's round (default: the newest)")

    rollback = _subparser(sub, "rollback", "list a state dir's snapshots, or make an older one the newest")
    rollback.add_argument(
        "--state-dir",
        required=True,
        help="the coordinator's --state-dir; --round on a live dir is refused: stop the coordinator first (required)",
    )
    rollback.add_argument(
        "--round", type=int, default=None, help="roll back to this kept round (without it: list the snapshots)"
    )
    restore = _subparser(
        sub, "restore-store", "put a run back in an object store that lost it, from a coordinator's working copy"
    )
    restore.add_argument(
        "--from",
        dest="source",
        type=Path,
        required=True,
        help="the working copy (the coordinator's --work-dir) or any state dir holding the run (required)",
    )
    restore.add_argument(
        "--state-dir", required=True, help="the s3://BUCKET/PREFIX to put it in; it must hold no run (required)"
    )
    return parser


def _coordinator(ns: argparse.Namespace) -> int:
    from atoll.coordinator.config import RunConfig
    from atoll.coordinator.main import main as coordinator_main
    from atoll.coordinator.transport.security import IslandTokens, TlsConfig
    from atoll.sharding import parse_shard

    config = config_from(RunConfig, ns)
    if (ns.tls_cert is None) != (ns.tls_key is None) or (ns.tls_client_ca and not ns.tls_cert):
        raise ValueError("--tls-cert and --tls-key go together; --tls-client-ca needs them")
    for flag, port, low in (
        ("--port", ns.port, 0),
        ("--bulk-port", ns.bulk_port, -1),
        ("--admin-port", ns.admin_port, 0),
    ):
        if port is not None and not low <= port <= 65535:
            raise ValueError(f"{flag} must be in {low}..65535, got {port}")
    if ns.fragments < 0:
        raise ValueError(f"--fragments must be >= 0, got {ns.fragments}")
    if ns.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {ns.threads}")
    if not MIN_LEASE_SECONDS <= ns.store_lease_seconds <= MAX_LEASE_SECONDS:  # (False for nan)
        raise ValueError(
            f"--store-lease-seconds must be in {MIN_LEASE_SECONDS:g}..{MAX_LEASE_SECONDS:g}, "
            f"got {ns.store_lease_seconds}"
        )
    if ns.threads:
        import torch

        torch.set_num_threads(ns.threads)
    security = {
        "tls": TlsConfig(cert=ns.tls_cert, key=ns.tls_key, client_ca=ns.tls_client_ca) if ns.tls_cert else None,
        "tokens": IslandTokens.load(ns.island_tokens) if ns.island_tokens else None,
        "shard": parse_shard(ns.shard),
        "partition": ns.partition,
    }
    return coordinator_main(
        config,
        ns.state_dir,
        work_dir=ns.work_dir,
        host=ns.host,
        port=ns.port,
        port_file=ns.port_file,
        admin={"host": ns.admin_host, "port": ns.admin_port, "token": ns.admin_token, "port_file": ns.admin_port_file},
        security=security,
        fragments=ns.fragments,
        exit_when_complete=ns.exit_when_complete,
        options={
            "keep_snapshots": ns.keep_snapshots,
            "snapshot_every": ns.snapshot_every,
            "max_inflight_bytes": ns.max_inflight_bytes,
            "max_pull_bytes": ns.max_pull_bytes,
            "stream_idle_seconds": ns.stream_idle_seconds,
            "bulk_port": None if ns.bulk_port < 0 else ns.bulk_port,
            "given": given_fields(RunConfig, ns),
            "store_lease_seconds": ns.store_lease_seconds,
        },
    )


MIN_LEASE_SECONDS, MAX_LEASE_SECONDS = 1.0, 86400.0
"""--store-lease-seconds: renewed every third of it, so under a second leaves a store's round trip no
room; past a day a dead coordinator's run waits longer than any operator would."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line as ``main`` reads it; a wrong flag gets the subcommand's usage (exit 2)."""
    parser = build_parser()
    ns, unknown = parser.parse_known_args(tokens_glued(argv))
    if ns.command == "island":
        from atoll.workload.command import refuse_run_flags

        refuse_run_flags(parser.subcommands["island"], unknown)
    if unknown:  # the subcommand's usage, not the top-level one
        parser.subcommands[ns.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return ns


def main(argv: list[str] | None = None, island_hooks=None) -> int:
    """``island_hooks``: seams of ``atoll island``'s loop (:class:`atoll.workload.hooks.IslandHooks`;
    the harness's entry point, :mod:`atoll.harness.island`, runs the island without this module)."""
    words = list(sys.argv[1:] if argv is None else argv)
    ns = parse_args(words)
    logging.basicConfig(level=ns.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from atoll.coordinator.config import ConfigMismatch
    from atoll.coordinator.disk.snapshots import StateError
    from atoll.workload.command import REFUSALS

    return run_command(
        ns.command,
        lambda: _dispatch(ns, words, island_hooks),
        build_parser().subcommands[ns.command],
        (StateError, ConfigMismatch, *REFUSALS),
    )


def _dispatch(ns: argparse.Namespace, words: list[str], island_hooks) -> int:
    if ns.command == "coordinator":
        return _coordinator(ns)
    if ns.command == "island":
        from atoll.workload.command import run

        return run(ns, words, island_hooks)
    if ns.command == "demo":
        from atoll.harness.demo import DemoArgs, run_demo

        return run_demo(config_from(DemoArgs, ns))
    if ns.command == "plan":
        from atoll import plan_cli

        return plan_cli.run(ns)
    from atoll import tools

    commands = {
        "status": tools.status,
        "export": tools.export,
        "rollback": tools.rollback,
        "restore-store": tools.restore_store,
    }
    return commands[ns.command](ns)


if __name__ == "__main__":
    sys.exit(main())
