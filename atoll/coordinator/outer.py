"""Outer optimizers: turn the averaged pseudo-gradient into the update of θ."""

from __future__ import annotations

from typing import Protocol

import torch


class OuterOptimizer(Protocol):
    """Computes the outer update ``u`` from the averaged pseudo-gradient; θ_{r+1} = θ_r + u."""

    def update(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def state_tensors(self) -> dict[str, torch.Tensor]: ...

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None: ...


class NesterovSGD:
    """SGD with (Nesterov) momentum, PyTorch's convention (DiLoCo's outer optimizer).

    ``m <- mu * m + g``; update ``u = -lr * (g + mu * m)`` (Nesterov) or ``-lr * m``.
    The pseudo-gradient g = θ_start − θ_island points *against* the island's progress, so
    subtracting it moves θ towards where the islands went.
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], *, lr: float, momentum: float, nesterov: bool) -> None:
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.buffers = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}

    def update(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if grads.keys() != self.buffers.keys():
            raise ValueError("gradient tensors do not match the optimizer's tensors")
        out = {}
        for name, g in grads.items():
            m = self.buffers[name]
            m.mul_(self.momentum).add_(g)
            step = g.add(m, alpha=self.momentum) if self.nesterov else m.clone()
            out[name] = step.mul_(-self.lr)
        return out

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"momentum/{k}": v for k, v in self.buffers.items()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in self.buffers:
            self.buffers[name].copy_(tensors[f"momentum/{name}"])
