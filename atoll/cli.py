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

from atoll.flags import LOG_LEVELS, add_dataclass_args, config_from, run_command, tokens_glued


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

    from atoll.coordinator import options as coordinator_options

    coordinator_options.add_arguments(_subparser(sub, "coordinator", "run the coordinator daemon"))

    island_command.add_arguments(_subparser(sub, "island", island_command.HELP))

    from atoll.relay import main as relay_main

    relay_main.add_arguments(_subparser(sub, "relay", "aggregate a region's islands before the WAN (a relay)"))

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
    from atoll.coordinator import options
    from atoll.coordinator.main import main as coordinator_main

    return coordinator_main(options.from_args(ns))


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
    logging.getLogger("botocore").setLevel(logging.WARNING)  # (its INFO says where it found credentials, each start)
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
    if ns.command == "relay":
        from atoll.relay import main as relay_main

        return relay_main.main(relay_main.from_args(ns))
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
