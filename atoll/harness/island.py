"""``python -m atoll.harness.island --faults JSON island ...``: the reference island with the harness's
fault hooks (:class:`atoll.harness.faults.IslandFaults`); every other argument is ``atoll``'s own, read
by the island's own entry point (:func:`atoll.workload.command.main`: the same flags and exit codes)."""

from __future__ import annotations

import sys

from atoll.harness.faults import IslandFaults
from atoll.workload.command import main as island_main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    spec = ""
    if "--faults" in argv:
        at = argv.index("--faults")
        spec = argv[at + 1]
        del argv[at : at + 2]
    return island_main(argv, IslandFaults(spec))


if __name__ == "__main__":
    sys.exit(main())
