"""The ``atoll`` command: ``coordinator``, ``island`` and ``demo``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def _field_type(f: dataclasses.Field) -> type:
    """The scalar type of a config field (``int | None`` gives ``int``)."""
    name = f.type if isinstance(f.type, str) else f.type.__name__
    return _TYPES[name.split("|")[0].strip()]


def _add_dataclass_args(parser: argparse.ArgumentParser, cls, skip=()) -> None:
    """One ``--flag`` per field of a config dataclass."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        required = f.default is dataclasses.MISSING
        kind = _field_type(f)
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default)
            continue
        parser.add_argument(
            flag,
            dest=f.name,
            type=kind,
            default=default,
            required=required,
            help=f"(default: {default})" if not required else "(required)",
        )


def _config_from(cls, ns: argparse.Namespace, **extra):
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    values.update(extra)
    return cls(**values)


def build_parser() -> argparse.ArgumentParser:
    from atoll.coordinator.config import RunConfig
    from atoll.harness.demo import DemoArgs
    from atoll.islands.runner import IslandArgs

    parser = argparse.ArgumentParser(prog="atoll", description=__doc__)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    coord = sub.add_parser("coordinator", help="run the coordinator daemon")
    coord.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    coord.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    coord.add_argument("--state-dir", type=Path, required=True, help="where the per-round state is persisted")
    coord.add_argument("--port-file", type=Path, default=None, help="write the bound port here once serving")
    coord.add_argument("--admin-host", default="127.0.0.1", help="admin HTTP address (non-loopback needs a token)")
    coord.add_argument("--admin-port", type=int, default=None, help="serve /healthz, /metrics, /api/status here")
    coord.add_argument("--admin-token", default=None, help="bearer token required by the admin endpoints")
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
        "one port each; islands run with --streaming",
    )
    coord.add_argument(
        "--island-tokens",
        type=Path,
        default=None,
        help='JSON {"island-id": "token"}: islands must present their own bearer token',
    )
    _add_dataclass_args(coord, RunConfig)

    island = sub.add_parser("island", help="run a reference island (tiny GPT on the bundled text)")
    _add_dataclass_args(island, IslandArgs)

    demo = sub.add_parser("demo", help="coordinator + islands as processes on loopback, a few rounds")
    _add_dataclass_args(demo, DemoArgs)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if ns.command == "coordinator":
            from atoll.coordinator.config import RunConfig
            from atoll.coordinator.main import main as coordinator_main

            config = _config_from(RunConfig, ns)
            from atoll.coordinator.security import IslandTokens, TlsConfig
            from atoll.sharding import parse_shard

            if (ns.tls_cert is None) != (ns.tls_key is None) or (ns.tls_client_ca and not ns.tls_cert):
                raise ValueError("--tls-cert and --tls-key go together; --tls-client-ca needs them")
            security = {
                "tls": TlsConfig(cert=ns.tls_cert, key=ns.tls_key, client_ca=ns.tls_client_ca) if ns.tls_cert else None,
                "tokens": IslandTokens.load(ns.island_tokens) if ns.island_tokens else None,
                "shard": parse_shard(ns.shard),
                "partition": ns.partition,
            }
            if ns.fragments < 0:
                raise ValueError(f"--fragments must be >= 0, got {ns.fragments}")
            return coordinator_main(
                config,
                ns.state_dir,
                host=ns.host,
                port=ns.port,
                port_file=ns.port_file,
                admin={
                    "host": ns.admin_host,
                    "port": ns.admin_port,
                    "token": ns.admin_token,
                    "port_file": ns.admin_port_file,
                },
                security=security,
                fragments=ns.fragments,
            )
        if ns.command == "island":
            from atoll.islands.runner import IslandArgs, run_island

            island_argv = list(sys.argv[1:] if argv is None else argv)
            return run_island(_config_from(IslandArgs, ns), island_argv)
        if ns.command == "demo":
            from atoll.harness.demo import DemoArgs, run_demo

            return run_demo(_config_from(DemoArgs, ns))
    except ValueError as err:
        parser.error(str(err))
    return 2


if __name__ == "__main__":
    sys.exit(main())
