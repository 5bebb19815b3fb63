"""The reference island's inner optimizer: AdamW, or Muon on the hidden weight matrices with AdamW on
the rest (``atoll island --inner-optimizer``).

Muon (``torch.optim.Muon``, torch 2.9 and later) orthogonalises each 2-D update with a Newton-Schulz
iteration; it is meant for the matrices inside the blocks, not for embeddings, the output head, norms
or biases, which keep AdamW (as Keller Jordan's and Moonlight's recipes do). Its learning rate is
adjusted to match AdamW's update RMS (``adjust_lr_fn="match_rms_adamw"``, Moonlight's rule), so one
``--inner-lr`` and one weight decay serve both. Newton-Schulz needs each matrix whole: an island
whose parameters are sharded (``--parallel`` fsdp or tp) is refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

OPTIMIZERS = ("adamw", "muon")
"""``--inner-optimizer``'s choices."""

WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)


def muon_parameters(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(Muon's, AdamW's): the 2-D weights inside the transformer blocks, and everything else
    (token and position embeddings, the head, norms, biases)."""
    muon, rest = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (muon if p.ndim == 2 and name.startswith("blocks.") else rest).append(p)
    return muon, rest


class InnerOptimizer:
    """The island's optimizers, stepped together, each under the same linear warm-up of its learning
    rate over ``warmup_steps`` inner steps (none for 0). ``optimizers``: what a checkpoint of the
    model and its optimizer states takes (``torch.distributed.checkpoint.state_dict`` accepts a list)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], warmup_steps: int = 0) -> None:
        self.optimizers = optimizers
        ramp: Callable[[int], float] = lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0  # noqa: E731
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, ramp) for o in optimizers]

    @classmethod
    def build(cls, model: torch.nn.Module, kind: str, lr: float, warmup_steps: int = 0, *, sharded: bool = False):
        def adamw(params) -> torch.optim.AdamW:
            return torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, betas=BETAS)

        if kind == "adamw":
            return cls([adamw(model.parameters())], warmup_steps)
        if kind != "muon":
            raise ValueError(f"inner optimizer must be one of {', '.join(OPTIMIZERS)}, got {kind!r}")
        if sharded:
            raise ValueError("--inner-optimizer muon needs each weight matrix whole on a rank: use --parallel none")
        if not hasattr(torch.optim, "Muon"):
            have = torch.__version__
            raise ValueError(f"--inner-optimizer muon needs torch.optim.Muon (torch 2.9 or later; this is {have})")
        matrices, rest = muon_parameters(model)
        if not matrices:
            raise ValueError("--inner-optimizer muon: the model has no 2-D weights inside its blocks")
        muon = torch.optim.Muon(matrices, lr=lr, weight_decay=WEIGHT_DECAY, adjust_lr_fn="match_rms_adamw")
        return cls([muon, adamw(rest)], warmup_steps)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """One inner step of every optimizer, then of their learning-rate schedules."""
        for o in self.optimizers:
            o.step()
        for s in self.schedulers:
            s.step()

    def schedule_state(self) -> dict:
        """The schedules' state for a checkpoint (an AdamW island's has the form it always had)."""
        if len(self.schedulers) == 1:
            return self.schedulers[0].state_dict()
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_schedule_state(self, state: dict) -> None:
        states = state.get("schedulers", [state])
        if len(states) != len(self.schedulers):
            raise ValueError(
                f"the checkpoint holds {len(states)} inner optimizer schedule(s), this island has "
                f"{len(self.schedulers)}: was it written with another --inner-optimizer?"
            )
        for s, st in zip(self.schedulers, states, strict=True):
            s.load_state_dict(st)
