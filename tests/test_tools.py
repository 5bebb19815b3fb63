"""The operator's commands on a run's state: atoll export (and atoll status, rollback elsewhere)."""

from __future__ import annotations

import subprocess
import sys

import torch
from support import H, batches, config, inner_step, island, make_diloco, make_model


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


def test_an_export_carries_the_model_card_and_is_readable_by_others(group, tmp_path):
    """Hardening round 5, items 18 and 20: loading the reference island's export needed its vocabulary
    guessed (the bundled text has 58 symbols, not 65), and exports were written with mode 0600. The
    island declares its model card at Join; the export writes it beside the weights, and
    ``atoll.models.load_export`` builds the model from the two."""
    import json
    import os
    import stat

    from support import collect_events, coordinator_flags, island_flags

    from atoll.data.dataset import CharDataset
    from atoll.models import load_export

    state = tmp_path / "state"
    coord, address = group.start_coordinator(state, [*coordinator_flags(sync_every=5, quorum=1), "--bulk-port", "-1"])
    island = group.start("a", island_flags(address, "a", rounds=1))
    collect_events([island], until=lambda ev: any(e["event"] == "done" for e in ev), timeout=120)
    assert island.wait(60) == 0
    coord.stop()
    out = tmp_path / "theta.safetensors"
    done = subprocess.run(
        [sys.executable, "-m", "atoll", "export", "--state-dir", str(state), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    card_file = tmp_path / "theta.config.json"
    card = json.loads(card_file.read_text())
    chars = CharDataset().chars
    assert len(chars) == 58 and card["config"]["vocab_size"] == 58 and card["tokens"]["symbols"] == chars
    umask = os.umask(0)
    os.umask(umask)
    for path in (out, card_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, oct(path.stat().st_mode)
    model, symbols = load_export(out)
    assert symbols == chars
    ids = torch.tensor([[chars.index(c) for c in "To be"]])
    assert model(ids).shape == (1, 5, 58)
    hf = subprocess.run(
        [sys.executable, "-m", "atoll", "export", "--state-dir", str(state), "--hf-dir", str(tmp_path / "hf")],
        capture_output=True,
        text=True,
    )
    assert hf.returncode == 1 and "--hf-dir needs one" in hf.stderr and "Traceback" not in hf.stderr


def test_a_hugging_face_run_exports_a_model_dir_that_from_pretrained_loads(start_server, tmp_path):
    """Item 18: a Hugging Face model's island declares its config (model.config) without being asked;
    ``atoll export --hf-dir`` writes config.json and model.safetensors, and transformers loads the dir
    with θ's values."""
    from transformers import GPT2Config, GPT2LMHeadModel

    srv = start_server(config(), tmp_path / "state")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sync = make_diloco(model, srv.address, island_id="hf").start()
    gen = torch.Generator().manual_seed(2)
    for _ in range(2 * H):
        x = torch.randint(0, 64, (2, 16), generator=gen)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sync.step(tokens=32, loss=loss.item())
    sync.close()
    theta = srv.inspect(lambda s: {k: v.clone() for k, v in s.model.params.items()})
    done = subprocess.run(
        [sys.executable, "-m", "atoll", "export", "--state-dir", str(tmp_path / "state"), "--hf-dir",
         str(tmp_path / "hf")],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    assert loaded.config.n_embd == 32 and loaded.config.vocab_size == 64
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in theta.items())
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
