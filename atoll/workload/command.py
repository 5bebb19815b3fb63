"""``atoll island``'s command line: its flags, its one refusal of a run-wide flag, and an entry point
that runs it without the rest of the CLI (the harness's, ``python -m atoll.harness.island``, which
passes its fault hooks; :mod:`atoll.cli` adds the same flags to its ``island`` subcommand)."""

from __future__ import annotations

import argparse
import logging
import sys

from atoll.flags import LOG_LEVELS, add_dataclass_args, config_from, run_command, tokens_glued
from atoll.islands.errors import CoordinatorRefused, CoordinatorUnreachable
from atoll.workload.hooks import IslandHooks
from atoll.workload.island import run_island
from atoll.workload.options import IslandArgs

HELP = "run the reference island (a GPT on the bundled text or your tokens)"
REFUSALS = (CoordinatorRefused, CoordinatorUnreachable)
"""What ends an island with one line and exit 1 (beside :class:`atoll.errors.UserError`)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, IslandArgs)


def refuse_run_flags(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    """``--sync-every`` on an island gets a line saying whose it is (exit 2), not argparse's bare one."""
    if any(a == "--sync-every" or a.startswith("--sync-every=") for a in unknown):
        parser.error(
            "--sync-every is the run's: the coordinator decides H (atoll coordinator --sync-every) and islands "
            "learn it when they join; an island may sync on a time budget instead (--sync-every-seconds)"
        )


def run(ns: argparse.Namespace, words: list[str], hooks: IslandHooks | None) -> int:
    """The island of parsed flags ``ns``; ``words``: the whole command line (after the program), which a
    multi-rank island re-launches itself with."""
    return run_island(config_from(IslandArgs, ns), words, hooks)


def main(words: list[str], hooks: IslandHooks | None = None) -> int:
    """``atoll [--log-level L] island FLAGS`` with ``hooks``: the same flags, refusals and exit codes."""
    parser = argparse.ArgumentParser(prog="atoll", allow_abbrev=False)
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    island = sub.add_parser("island", help=HELP, description=HELP, allow_abbrev=False)
    island.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS)
    add_arguments(island)
    ns, unknown = parser.parse_known_args(tokens_glued(words))
    refuse_run_flags(island, unknown)
    if unknown:
        island.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=ns.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_command("island", lambda: run(ns, words, hooks), island, REFUSALS)
