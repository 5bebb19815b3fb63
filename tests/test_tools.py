"""The operator's commands on a run's state: atoll export (and atoll status, rollback elsewhere)."""

from __future__ import annotations

import subprocess
import sys

import torch
from conftest import inner_step, make_diloco
from small_island import H, batches, config, island, make_model


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


def test_export_of_a_model_with_tied_weights_loads_strictly_into_it(start_server, tmp_path):
    """GPT-2 ties lm_head.weight to transformer.wte.weight: synced once, exported under both names.
    (Before: the export of an HF GPT-2 island lacked lm_head.weight and load_state_dict(strict=True)
    refused it.) The same check with transformers' own GPT-2 runs in test_examples."""
    from safetensors.torch import load_file

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.wte = torch.nn.Embedding(11, 6)
            self.body = torch.nn.Linear(6, 6)
            self.lm_head = torch.nn.Linear(6, 11, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, x):
            return self.lm_head(torch.tanh(self.body(self.wte(x))))

    srv = start_server(config(), tmp_path / "state")
    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = make_diloco(model, srv.address, island_id="tied").start()
    gen = torch.Generator().manual_seed(1)
    for _ in range(H):
        x = torch.randint(0, 11, (4, 5), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 11), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sync.step(tokens=20, loss=loss.item())
    sync.close()
    assert srv.inspect(lambda s: (sorted(s.model.specs), s.model.aliases)) == (
        ["body.bias", "body.weight", "wte.weight"],
        {"wte.weight": ("lm_head.weight",)},
    )
    out = tmp_path / "tied.safetensors"
    done = subprocess.run(
        [sys.executable, "-m", "atoll", "export", "--state-dir", str(tmp_path / "state"), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    fresh = Tied()
    fresh.load_state_dict(load_file(str(out)))  # strict, the tied name included
    assert fresh.lm_head.weight is fresh.wte.weight and torch.equal(fresh.wte.weight, model.wte.weight)
