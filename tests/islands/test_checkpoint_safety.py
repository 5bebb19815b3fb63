"""An island checkpoint runs no code when it is loaded (hardening round 5, item 7): DCP unpickled its
``.metadata`` and its non-tensor values with pickle, so anyone who could write the checkpoint's prefix
in an object store could run code on the island. Now a checkpoint holding anything but DCP's metadata,
tensors and plain values is refused with one line, and nothing of it runs."""

from __future__ import annotations

import pathlib
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from atoll.islands._safe_dcp import UnsafeCheckpoint
from atoll.islands.checkpoint import IslandCheckpointer


class Planted:
    """What an attacker pickles: unpickling it creates ``path`` (the proof that code ran)."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def saved(tmp_path):
    model, opt = trained()
    ckpt = IslandCheckpointer(tmp_path / "ckpt")
    ckpt.save(7, model, opt, {"n": 1})
    ckpt.wait()
    (path,) = ckpt._complete()
    return ckpt, model, opt, path


def test_a_sound_checkpoint_loads(tmp_path):
    ckpt, model, opt, _ = saved(tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, fresh_opt = trained()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    assert ckpt.load(fresh, fresh_opt) == {"n": 1}
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    assert fresh_opt.param_groups[0]["lr"] == 0.01


def test_planted_metadata_is_refused_and_runs_nothing(tmp_path):
    ckpt, model, opt, path = saved(tmp_path)
    ran = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(Planted(ran)))
    with pytest.raises(UnsafeCheckpoint, match=r"is refused: its metadata names pathlib\.Path\.touch, which"):
        ckpt.load(model, opt)
    assert not ran.exists()


def test_a_planted_value_is_refused_and_runs_nothing(tmp_path):
    ckpt, model, opt, path = saved(tmp_path)
    ran = tmp_path / "ran"
    model_sd, optim_sd = get_state_dict(model, opt)
    optim_sd["param_groups"][0]["lr"] = Planted(ran)
    shutil.rmtree(path)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), no_dist=True)
    torch.save({"n": 1}, path / "rank-0.pt")
    (path / "done-0").write_bytes(b"ok\n")
    with pytest.raises(UnsafeCheckpoint, match=r"is refused: its value optim\.param_groups\.0\.lr is not tensors"):
        ckpt.load(model, opt)
    assert not ran.exists()
