"""The reference workload's model."""

from atoll.models.tiny_gpt import GPTConfig, TinyGPT

__all__ = ["GPTConfig", "TinyGPT"]
