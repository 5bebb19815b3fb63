"""The reference island's inner optimizer: AdamW, or Muon on the blocks' matrices with AdamW on the rest."""

from __future__ import annotations

import pytest
import torch

from atoll.data import CharDataset
from atoll.models import TinyGPT, preset
from atoll.workload.inner import InnerOptimizer, muon_parameters
from atoll.workload.options import IslandArgs


def model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(preset("tiny", vocab_size=65))


def train(kind: str, steps: int, lr: float = 3e-3) -> tuple[TinyGPT, InnerOptimizer, list[float]]:
    m, data, gen = model(), CharDataset(block_size=64), torch.Generator().manual_seed(0)
    opt = InnerOptimizer.build(m, kind, lr, warmup_steps=5)
    losses = []
    for _ in range(steps):
        x, y = data.batch(gen, 16)
        _, loss = m(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return m, opt, losses


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    m = model()
    matrices, rest = muon_parameters(m)
    names = {id(p): n for n, p in m.named_parameters()}
    assert sorted(names[id(p)] for p in matrices) == sorted(
        f"blocks.{i}.{w}.weight" for i in range(len(m.blocks)) for w in ("q", "k", "v", "proj", "fc", "fc_proj")
    )
    assert {names[id(p)] for p in rest} == {n for n, _ in m.named_parameters()} - {names[id(p)] for p in matrices}
    opt = InnerOptimizer.build(m, "muon", 1e-3)
    assert [type(o).__name__ for o in opt.optimizers] == ["Muon", "AdamW"]


def test_a_muon_island_learns_and_its_matrices_move_as_muon_moves_them():
    """Loss falls under both optimizers; Muon's step of a matrix is orthogonalised (its singular values
    nearly equal, where AdamW's spread), so the two runs part from the first step on."""
    _, _, adamw = train("adamw", 80)
    m, opt, muon = train("muon", 80)
    for losses in (adamw, muon):
        assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:10]) / 10, losses[::10]
    assert adamw[0] == muon[0] and adamw[2] != muon[2]
    # One more step with the learning rate's warm-up done: the change of a block's matrix is Muon's.
    w = m.blocks[0].fc.weight
    before = w.detach().clone()
    x, y = CharDataset(block_size=64).batch(torch.Generator().manual_seed(1), 16)
    opt.zero_grad()
    m(x, y)[1].backward()
    opt.step()
    s = torch.linalg.svdvals((w.detach() - before * (1 - 3e-3 * 0.1)).double())  # less the weight decay
    assert float(s[: min(w.shape) // 2].max() / s[: min(w.shape) // 2].min()) < 3.0, s


def test_the_schedule_state_round_trips_and_a_checkpoint_of_the_other_optimizer_is_refused():
    _, opt, _ = train("muon", 3)
    fresh = InnerOptimizer.build(model(), "muon", 3e-3, warmup_steps=5)
    fresh.load_schedule_state(opt.schedule_state())
    assert [s.last_epoch for s in fresh.schedulers] == [3, 3]
    for s in fresh.schedulers:  # (the learning rates themselves come back with the optimizers' state)
        s.step()
    assert [g["lr"] for o in fresh.optimizers for g in o.param_groups] == pytest.approx([3e-3 * 5 / 5] * 2)
    _, adamw, _ = train("adamw", 3)
    assert set(adamw.schedule_state()) >= {"last_epoch", "base_lrs"}  # the form AdamW islands always saved
    with pytest.raises(ValueError, match="another --inner-optimizer"):
        fresh.load_schedule_state(adamw.schedule_state())


def test_bad_choices_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="inner_optimizer must be one of adamw, muon"):
        IslandArgs(coordinator="-", island_id="a", inner_optimizer="sgd")
    with pytest.raises(ValueError, match="whole on a rank, not --parallel fsdp"):
        IslandArgs(coordinator="-", island_id="a", inner_optimizer="muon", parallel="fsdp", nproc=2)
    with pytest.raises(ValueError, match="--parallel none"):
        InnerOptimizer.build(model(), "muon", 1e-3, sharded=True)
