"""The examples under examples/ run as users would run them: a coordinator and two island processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from atoll.harness.processes import ManagedProcess

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(group, tmp_path, script: str, run_id: str, sync_every: int, extra=()) -> list[dict]:
    coord, address = group.start_coordinator(
        tmp_path / "state", ["--run-id", run_id, "--sync-every", str(sync_every), "--quorum", "2"]
    )
    procs = []
    for island in ("site-a", "site-b"):
        mine = [a.replace("{island}", island) for a in extra]
        argv = [sys.executable, str(EXAMPLES / script), "--coordinator", address, "--island-id", island, *mine]
        procs.append(ManagedProcess(island, argv, group.work_dir))
        group.processes.append(procs[-1])
    codes = [p.wait(240) for p in procs]
    assert codes == [0, 0], [p.log_tail() for p in procs]
    coord.stop()
    return [json.loads(p.lines[-1]) for p in procs]


@pytest.mark.timeout(300)
def test_plain_pytorch_example(group, tmp_path):
    ckpt = str(tmp_path / "ckpt-{island}")
    a, b = run_example(group, tmp_path, "plain_pytorch.py", "example", 20, ["--checkpoint-dir", ckpt])
    assert a["digest"] == b["digest"]
    assert a["last_loss"] < 0.7 * a["first_loss"], a
    for island in ("site-a", "site-b"):  # the library's checkpoint helper wrote one per push, complete
        steps = sorted(p.name for p in (tmp_path / f"ckpt-{island}").glob("step-*") if (p / "done-0").exists())
        assert steps[-1] == "step-0000000100", steps


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hugging_face_transformers_example(group, tmp_path):
    pytest.importorskip("transformers", reason="the dev extra installs transformers (pip install -e '.[dev]')")
    a, b = run_example(group, tmp_path, "hf_transformers.py", "hf", 10)
    assert a["digest"] == b["digest"]
    assert a["last_loss"] < a["first_loss"], a
    # `atoll export` gives a file that loads strictly into the model the islands trained, tied
    # lm_head.weight included, as the README says.
    import subprocess

    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel

    out = tmp_path / "gpt2.safetensors"
    cmd = [sys.executable, "-m", "atoll", "export", "--state-dir", str(tmp_path / "state"), "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4))
    model.load_state_dict(load_file(str(out)), strict=True)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
