"""Command lines built from dataclasses, and one way every ``atoll`` command ends.

A config dataclass gives one ``--flag`` per field, its docstring as the help; a command runs under
:func:`run_command`, which turns the errors a user can act on into one line and an exit code. Shared by
:mod:`atoll.cli` and the island's own entry (:mod:`atoll.workload.command`), so neither imports the other.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import sys
import textwrap
from collections.abc import Callable

from atoll.errors import UserError

LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]
_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def field_docs(cls) -> dict[str, str]:
    """The docstrings under a dataclass's fields (``x: int = 1`` then ``\"\"\"what x is\"\"\"``)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (frozen app): no help text, still works
        return {}
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _field_type(f: dataclasses.Field) -> type:
    """The scalar type of a config field (``int | None`` gives ``int``)."""
    name = f.type if isinstance(f.type, str) else f.type.__name__
    return _TYPES[name.split("|")[0].strip()]


def add_dataclass_args(parser, cls, *, skip=(), track_given: bool = False) -> None:
    """One ``--flag`` per field of a config dataclass, with the field's docstring as help, on ``parser``
    (a parser or one of its argument groups).

    ``track_given``: flags default to None, so the caller can tell what was given on the command line
    (the dataclass's own default applies otherwise)."""
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        required = f.default is dataclasses.MISSING
        kind = _field_type(f)
        doc = docs.get(f.name, "")
        shown = "required" if required else f"default: {default}"
        help_text = f"{doc} ({shown})" if doc else f"({shown})"
        help_text = help_text.replace("%", "%%")
        if kind is bool:
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None if track_given else default,
                help=help_text,
            )
            continue
        parser.add_argument(
            flag,
            dest=f.name,
            type=kind,
            default=None if track_given else default,
            required=required,
            metavar=kind.__name__.upper(),
            help=help_text,
        )


def config_from(cls, ns: argparse.Namespace, **extra):
    """``cls`` from the flags ``add_dataclass_args`` made (those not given keep the field's default)."""
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    values = {k: v for k, v in values.items() if v is not None}
    values.update(extra)
    return cls(**values)


def given_fields(cls, ns: argparse.Namespace) -> frozenset[str]:
    """The fields of ``cls`` given on the command line (flags made with ``track_given``)."""
    return frozenset(f.name for f in dataclasses.fields(cls) if getattr(ns, f.name, None) is not None)


TOKEN_FLAGS = ("--token", "--admin-token")
"""Flags whose value is a bearer token: the next word is the value whatever it looks like. argparse
takes a word that begins with '-' for a flag, and a URL-safe token (``secrets.token_urlsafe``, as
docs/two-site-run.md makes them) begins with '-' one time in 64."""


def tokens_glued(argv: list[str]) -> list[str]:
    """``argv`` with each ``TOKEN_FLAG VALUE`` as ``TOKEN_FLAG=VALUE`` (a flag with no word after it
    stays as it is: argparse says what is missing)."""
    out, words = [], iter(argv)
    for word in words:
        value = next(words, None) if word in TOKEN_FLAGS else None
        out.append(word if value is None else f"{word}={value}")
    return out


def run_command(
    command: str,
    body: Callable[[], int],
    usage: argparse.ArgumentParser,
    refusals: tuple[type[BaseException], ...] = (),
) -> int:
    """``body()``'s exit code, with the ends every command shares: a :class:`UserError` or one of
    ``refusals`` prints one line (``atoll COMMAND: error: ...``) and exits 1 (a
    :class:`~atoll.errors.BadInput` 2), Ctrl-C 130, a closed stdout 141 (as SIGPIPE), and a ValueError
    is a bad argument (``usage``'s error, exit 2)."""
    try:
        return body()
    except (UserError, *refusals) as err:
        print(f"atoll {command}: error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", 1)
    except KeyboardInterrupt:
        print(f"atoll {command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `atoll status | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 141  # as a process killed by SIGPIPE, the shell's convention
    except ValueError as err:
        usage.error(str(err))
    return 2
