"""NumPy references of the coordinator's arithmetic, for exact-value tests."""

from __future__ import annotations

import numpy as np


def numpy_outer_sgd(theta, momentum, deltas, tokens, *, lr, mu, nesterov):
    """Reference: g = token-weighted mean delta; m = mu*m + g; θ -= lr*(g + mu*m) (or lr*m)."""
    w = np.asarray(tokens, dtype=np.float64)
    new_theta, new_m = {}, {}
    for name in theta:
        g = sum(wi * d[name].astype(np.float64) for wi, d in zip(w, deltas, strict=True)) / w.sum()
        m = mu * momentum[name] + g
        step = g + mu * m if nesterov else m
        new_theta[name] = theta[name] - lr * step
        new_m[name] = m
    return new_theta, new_m
