"""Codecs for pseudo-gradients and their wire format.

``get_codec("int8")``, ``get_codec("int4:block=128,scale=fp16")``, ``get_codec("topk:fraction=0.01")``,
``get_codec("dcttopk:fraction=0.01")`` (top-k in a block-DCT basis), ``get_codec("powersgd:rank=4")``,
``get_codec("sparse:density=0.0078125,bits=2,chunk=4096")`` (per-chunk top-k, 2-bit values, compact indices);
wrap a lossy one in :class:`ErrorFeedback` to carry its error over.
"""

from __future__ import annotations

from atoll.compression.base import Codec
from atoll.compression.blockwise import Int2Codec, Int4Codec, Int8Codec
from atoll.compression.cast import Bf16Codec, Fp16Codec, IdentityCodec
from atoll.compression.dct import DctTopKCodec
from atoll.compression.feedback import ErrorFeedback
from atoll.compression.powersgd import PowerSGDCodec
from atoll.compression.sparse import SparseCodec
from atoll.compression.topk import TopKCodec
from atoll.compression.wire import WireFormatError, peek_codec_id

_REGISTRY: dict[str, type[Codec]] = {
    cls.name: cls
    for cls in (
        IdentityCodec,
        Fp16Codec,
        Bf16Codec,
        Int8Codec,
        Int4Codec,
        Int2Codec,
        TopKCodec,
        DctTopKCodec,
        PowerSGDCodec,
        SparseCodec,
    )
}
_BY_ID = {cls.codec_id: cls for cls in _REGISTRY.values()}


def available_codecs() -> list[str]:
    """Codec names accepted by :func:`get_codec`."""
    return sorted(_REGISTRY)


def codec_name(spec: str) -> str:
    """The codec name of a spec string (``"int8:block=128"`` -> ``"int8"``)."""
    return spec.split(":", 1)[0].strip()


def downlink_for(codec: str) -> str:
    """The coordinator's update codec for islands that push ``codec``, in a run that names none: for
    ``sparse`` pushes, ``sparse`` at 4x their density (room for the union of four islands' values:
    >100x fewer bytes than fp32 at the default 1/128, and a lower loss than the uplink's own density in
    benchmarks/RESULTS.md, "Issue 52"); int8 for every other codec (identity down is named)."""
    pushed = get_codec(codec)
    if pushed.name == "sparse":
        return f"sparse:density={min(1.0, 4 * pushed.density):g},bits={pushed.bits},chunk={pushed.chunk}"
    return "int8"


def get_codec(spec: str) -> Codec:
    """A codec from a spec string ``name[:key=value,...]``; ValueError with the reason otherwise."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(available_codecs())}")
    kwargs = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in cls.params:
            takes = f"it takes {', '.join(sorted(cls.params))}" if cls.params else "it takes none"
            raise ValueError(f"codec {name!r}: bad parameter {item!r} ({takes})")
        try:
            kwargs[key] = cls.params[key](value.strip())
        except ValueError:
            raise ValueError(f"codec {name!r}: {key}={value!r} is not a {cls.params[key].__name__}") from None
    return cls(**kwargs)


def codec_for_id(codec_id: int) -> type[Codec]:
    try:
        return _BY_ID[codec_id]
    except KeyError:
        raise WireFormatError(f"unknown codec id {codec_id}") from None


def codec_of(payload) -> Codec:
    """A decoder for whichever codec a payload's header names (decoding needs no parameters)."""
    return codec_for_id(peek_codec_id(payload))()


def decode_any(payload, expected_shape: tuple[int, ...] | None = None, *, device=None):
    """Decode a payload with whichever codec its header names, on ``device`` (default: the CPU)."""
    return codec_of(payload).decode(payload, expected_shape, device=device)


__all__ = [
    "Codec",
    "ErrorFeedback",
    "WireFormatError",
    "available_codecs",
    "codec_name",
    "codec_of",
    "decode_any",
    "downlink_for",
    "get_codec",
]
