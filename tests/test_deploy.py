"""Every command in deploy/ parses with the real CLI and builds a valid config."""

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from atoll.cli import build_parser
from atoll.coordinator.config import RunConfig
from atoll.flags import config_from
from atoll.workload.options import IslandArgs

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def dockerfile_argv(name: str) -> tuple[list[str], list[str]]:
    text = (DEPLOY / name).read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    return entry, cmd


def substitute(argv: list[str]) -> list[str]:
    """Environment references ($(X), ${X:-d}, $X) stand for operator-supplied values."""
    return [re.sub(r"\$\(\w+\)|\$\{[^}]+\}|\$\w+", "VALUE", a) for a in argv]


def atoll_argv(argv: list[str]) -> list[str]:
    """The `atoll ...` part of a command: after the binary, or after `-m atoll` under torchrun."""
    argv = substitute(argv)
    if "-m" in argv and argv[argv.index("-m") + 1] == "atoll":
        return argv[argv.index("-m") + 2 :]
    assert Path(argv[0]).name == "atoll", argv
    return argv[1:]


def commands():
    out = []
    for name in ("Dockerfile.coordinator", "Dockerfile.island"):
        entry, cmd = dockerfile_argv(name)
        out.append((name, atoll_argv(entry + cmd)))
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    for svc, spec in compose["services"].items():
        entry, _ = dockerfile_argv(Path(spec["build"]["dockerfile"]).name)
        out.append((f"compose:{svc}", atoll_argv(entry + spec["command"])))
    for manifest in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(manifest.read_text()):
            spec = doc.get("spec", {})
            pod = spec.get("template", {}).get("spec", {})
            for c in pod.get("containers", []):
                out.append((f"{manifest.name}:{c['name']}", atoll_argv(c["command"] + c.get("args", []))))
    sbatch = (DEPLOY / "slurm" / "island.sbatch").read_text().replace("\\\n", " ")
    line = next(ln for ln in sbatch.splitlines() if "-m atoll" in ln)
    out.append(("island.sbatch", atoll_argv(shlex.split(line))))
    unit = (DEPLOY / "systemd" / "atoll-coordinator.service").read_text()
    exec_start = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1)
    out.append(("atoll-coordinator.service", atoll_argv(shlex.split(exec_start))))
    return out


def test_every_deploy_file_is_covered():
    names = {n.split(":")[0] for n, _ in commands()}
    assert names >= {
        "Dockerfile.coordinator",
        "Dockerfile.island",
        "compose",
        "coordinator.yaml",
        "island-job.yaml",
        "island.sbatch",
        "atoll-coordinator.service",
    }


@pytest.mark.parametrize("name,argv", commands(), ids=[n for n, _ in commands()])
def test_command_parses_and_builds_a_valid_config(name, argv):
    ns = build_parser().parse_args(argv)  # SystemExit on an unknown flag or bad value
    if ns.command == "coordinator":
        config_from(RunConfig, ns)
    elif ns.command == "island":
        config_from(IslandArgs, ns)
    else:
        pytest.fail(f"{name}: unexpected command {ns.command}")
