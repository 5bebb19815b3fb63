"""Codecs for pseudo-gradients and their wire format."""

from atoll.compression.codecs import Codec, available_codecs, get_codec
from atoll.compression.wire import WireFormatError

__all__ = ["Codec", "WireFormatError", "available_codecs", "get_codec"]
