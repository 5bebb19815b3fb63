"""The reference workload's model."""

from atoll.models.card import card_of, load_export
from atoll.models.tiny_gpt import PRESETS, GPTConfig, TinyGPT, preset

__all__ = ["PRESETS", "GPTConfig", "TinyGPT", "card_of", "load_export", "preset"]
