"""Robust aggregation of pseudo-gradients against a faulty island.

- ``mean``: the token-weighted mean (DiLoCo; streamed into one accumulator).
- ``clipped_mean``: every island's delta is scaled down to L2 norm <= c before the weighted mean,
  with c = ``clip_norm`` or, if that is 0, the median of the islands' norms: one island sending a
  huge delta moves θ no more than a typical one.
- ``median``: the coordinate-wise median over islands (unweighted; the lower median for an even
  count, as ``torch.median``): tolerates fewer than half the islands being arbitrary.

The robust modes keep each committed island's dense delta until the round closes.
"""

from __future__ import annotations

import math

import torch

AGGREGATIONS = ("mean", "clipped_mean", "median")


def l2_norm(delta: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in delta.values()))


def aggregate(
    kind: str, contributions: list[tuple[float, dict[str, torch.Tensor]]], *, clip_norm: float = 0.0
) -> dict[str, torch.Tensor]:
    """The averaged pseudo-gradient from ``(weight, delta)`` pairs."""
    if kind not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {kind!r}")
    if not contributions:
        raise ValueError("nothing to aggregate")
    names = list(contributions[0][1])
    if kind == "median":
        return {n: torch.stack([d[n] for _, d in contributions]).median(dim=0).values for n in names}
    scales = [1.0] * len(contributions)
    if kind == "clipped_mean":
        norms = [l2_norm(d) for _, d in contributions]
        c = clip_norm if clip_norm > 0 else sorted(norms)[(len(norms) - 1) // 2]
        scales = [min(1.0, c / n) if n > 0 else 1.0 for n in norms]
    total = sum(w for w, _ in contributions) or 1.0  # (all weighed 0, no work: a zero mean)
    out = {}
    for n in names:
        acc = torch.zeros_like(contributions[0][1][n])
        for (w, d), s in zip(contributions, scales, strict=True):
            acc.add_(d[n], alpha=w * s / total)
        out[n] = acc
    return out
