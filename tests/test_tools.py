"""The operator's commands on a run's state: atoll export (and atoll status, rollback elsewhere)."""

from __future__ import annotations

import subprocess
import sys

import torch
from conftest import inner_step, make_diloco

from atoll.coordinator import RunConfig
from atoll.islands.client import RetryPolicy

H = 4


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches(n: int):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)) for _ in range(n)]


def config(**kw) -> RunConfig:
    return RunConfig(run_id="t", sync_every=H, outer_lr=0.7, outer_momentum=0.9, **kw)


def island(address, **kw):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kw.setdefault("island_id", "solo")
    sync = make_diloco(model, address, run_id="t", retry=RetryPolicy(give_up_seconds=20), **kw)
    return model, opt, sync


# ---- getting the model out -------------------------------------------------------------------------
def test_export_writes_theta_with_the_models_own_names(start_server, tmp_path):
    from safetensors.torch import load_file

    srv = start_server(config(), tmp_path / "state")
    model, opt, sync = island(srv.address)
    sync.start()
    for b in batches(2 * H):
        sync.step(tokens=32, loss=inner_step(model, opt, b))
    sync.close()
    out = tmp_path / "model.safetensors"
    done = subprocess.run(
        [sys.executable, "-m", "atoll", "export", "--state-dir", str(tmp_path / "state"), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "at round 2" in done.stdout
    fresh = make_model()
    fresh.load_state_dict(load_file(str(out)))  # strict: every name matches
    for n, p in fresh.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[n])
    older = subprocess.run(
        [
            sys.executable,
            "-m",
            "atoll",
            "export",
            "--state-dir",
            str(tmp_path / "state"),
            "--out",
            str(out),
            "--round",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert older.returncode == 0 and "at round 1" in older.stdout
