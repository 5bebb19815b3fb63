"""The reference model's card (what the run keeps and ``atoll export`` writes beside the weights), and
the model back from an export.

    model, symbols = load_export("theta.safetensors")    # TinyGPT with θ, the bundled text's characters
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from atoll.models.tiny_gpt import GPTConfig, TinyGPT

FORMAT = "atoll"
MODEL = "atoll.models.TinyGPT"


def card_of(model: TinyGPT, *, symbols: list[str] | None = None, vocab_size: int | None = None) -> dict:
    """The card of the reference island's model: its class and config, and its tokens (the characters
    of a char-level run, in id order; or a token file's vocabulary size)."""
    tokens = {"kind": "chars", "symbols": list(symbols)} if symbols is not None else {"kind": "ids"}
    if vocab_size is not None:
        tokens["vocab_size"] = vocab_size
    return {"format": FORMAT, "model": MODEL, "config": dataclasses.asdict(model.cfg), "tokens": tokens}


def card_path(weights: Path) -> Path:
    """Where ``atoll export --out X.safetensors`` writes the card: ``X.config.json``."""
    weights = Path(weights)
    return weights.with_name(weights.name.removesuffix(".safetensors") + ".config.json")


def load_export(weights: str | Path) -> tuple[TinyGPT, list[str] | None]:
    """The reference model of an export (its card beside it) with θ loaded, and its characters (None
    for a token-file run). ValueError naming the file when the card is not a reference model's."""
    from safetensors.torch import load_file

    path = card_path(Path(weights))
    try:
        card = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{path}: no model card beside {weights} (an export of a run whose islands said none)"
        ) from None
    if not isinstance(card, dict) or card.get("format") != FORMAT or card.get("model") != MODEL:
        raise ValueError(f"{path}: not the card of atoll's reference model ({str(card)[:80]})")
    model = TinyGPT(GPTConfig(**card["config"]))
    model.load_state_dict(load_file(str(weights)))
    tokens = card.get("tokens", {})
    return model, tokens.get("symbols") if tokens.get("kind") == "chars" else None
