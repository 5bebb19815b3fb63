"""Islands the wrapper tests train: one MSE step, the DiLoCo of a model and an address, and a small
island (a two-layer MLP, fixed batches, a run config of H = 4) for the tests of resuming, the run's
lifecycle and the operator's tools."""

from __future__ import annotations

import torch

from atoll.coordinator import RunConfig
from atoll.islands import RetryPolicy

H = 4


def inner_step(model, opt, batch) -> float:
    """One MSE step of the small regression models the wrapper tests train; returns the loss."""
    x, y = batch
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def make_diloco(model, address: str, **kw):
    """``DiLoCo(model, CoordinatorLink(address, ...), **options)``: the link's arguments (run id "t" by
    default) taken out of ``kw``, the rest DiLoCo's options."""
    from atoll.islands import CoordinatorLink, DiLoCo
    from atoll.islands._legacy import LINK_ARGUMENTS

    kw.setdefault("run_id", "t")
    link_kw = {k: kw.pop(k) for k in list(kw) if k in LINK_ARGUMENTS}
    return DiLoCo(model, CoordinatorLink(address, **link_kw), **kw)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches(n: int):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)) for _ in range(n)]


def config(**kw) -> RunConfig:
    kw = {"codec": "identity", "downlink_codec": "identity", **kw}  # exact fp32 arithmetic
    return RunConfig(run_id="t", sync_every=H, outer_lr=0.7, outer_momentum=0.9, **kw)


def island(address, **kw):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kw.setdefault("island_id", "solo")
    sync = make_diloco(model, address, run_id="t", retry=RetryPolicy(give_up_seconds=20), **kw)
    return model, opt, sync
