"""The reference workload's data: a bundled public-domain text, char-level."""

from atoll.data.dataset import CharDataset, bundled_text

__all__ = ["CharDataset", "bundled_text"]
