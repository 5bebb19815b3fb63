"""docs/two-site-run.md's shell blocks, and a shell that runs them as written."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "two-site-run.md"


ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
"""`atoll` on the PATH, as after the README's install."""


def split(block: str) -> tuple[list[str], str]:
    """A block's ``export`` lines, and its one command (continuation lines joined)."""
    lines = block.replace("\\\n", " ").strip().splitlines()
    exports = [ln for ln in lines if ln.startswith("export ")]
    rest = [ln for ln in lines if not ln.startswith("export ")]
    assert len(rest) == 1, block
    return exports, rest[0]


def blocks(tag: str = "test") -> list[tuple[str, str]]:
    """The doc's commands a test runs: (what, text), in order."""
    return re.findall(rf"<!-- {tag}: ([^>]+?) -->\n```sh\n(.*?)```", DOC.read_text(), re.S)


class Shell:
    """The reader's shell: the exports of the blocks run so far (each evaluated once, as a reader's
    shell does: a token made by ``$(...)`` keeps its value), in ``cwd``."""

    def __init__(self, cwd: Path, env: dict[str, str] | None = None) -> None:
        self.cwd, self.env, self.exports = cwd, env or ENV, ["export COORD_HOST=localhost"]

    def export(self, lines: list[str]) -> None:
        for line in lines:
            names = re.findall(r"(?:^export |\s)(\w+)=", line)
            script = "; ".join([*self.exports, line]) + "".join(f'; printf "%s\\0" "${n}"' for n in names)
            out = subprocess.run(["bash", "-c", script], cwd=self.cwd, capture_output=True, text=True, check=True,
                                 env=self.env)  # fmt: skip
            values = out.stdout.split("\0")[:-1]
            self.exports += [f"export {n}={shlex.quote(v)}" for n, v in zip(names, values, strict=True)]

    def argv(self, block: str, **swap: str) -> list[str]:
        """The block's command as bash runs it after its exports (``swap``: text replaced first)."""
        for old, new in swap.items():
            block = block.replace(old.replace("_", "-") if old.startswith("__") else old, new)
        exports, command = split(block)
        self.export(exports)
        script = "; ".join(self.exports) + f'; set -- {command}; printf "%s\\0" "$@"'
        out = subprocess.run(["bash", "-c", script], cwd=self.cwd, capture_output=True, text=True, check=True,
                             env=self.env)  # fmt: skip
        return out.stdout.split("\0")[:-1]

    def run(self, block: str) -> subprocess.CompletedProcess:
        """A block run whole in the reader's shell (its exports kept for the blocks after it)."""
        self.export([ln for ln in block.splitlines() if ln.startswith("export ")])
        script = "\n".join([*self.exports, *(ln for ln in block.splitlines() if not ln.startswith("export "))])
        return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=self.cwd, capture_output=True,
                              text=True, env=self.env)  # fmt: skip

    def value(self, name: str) -> str:
        script = "; ".join(self.exports) + f'; printf "%s" "${name}"'
        return subprocess.run(["bash", "-c", script], cwd=self.cwd, capture_output=True, text=True, check=True,
                              env=self.env).stdout  # fmt: skip
