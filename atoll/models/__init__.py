"""The reference workload's model."""

from atoll.models.tiny_gpt import PRESETS, GPTConfig, TinyGPT, preset

__all__ = ["PRESETS", "GPTConfig", "TinyGPT", "preset"]
