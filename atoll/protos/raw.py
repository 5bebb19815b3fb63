"""A copy-saving path for the bulk tensor chunks, wire-compatible with ``coordinator.proto``.

A ``PushChunk``/``PullChunk`` that carries only ``data`` (field 2, bytes) is, on the wire, the
tag byte 0x12, a varint length and the bytes. These (de)serializers produce and recognise exactly
that form without going through protobuf objects: receiving hands out a zero-copy ``RawData``
view, sending joins prefix and payload once. Any other message (the header) goes through
protobuf as usual, and a peer using the generated code interoperates unchanged.
"""

from __future__ import annotations

from atoll.protos import coordinator_pb2 as pb

_DATA_TAG = 0x12  # field 2, wire type 2 (length-delimited)


class RawData:
    """A data chunk as a memoryview (what the generated code would wrap in ``PushChunk(data=...)``),
    or, to send, as buffers sent one after the other (joined once, when serialised)."""

    __slots__ = ("view", "parts")

    def __init__(self, view) -> None:
        self.view = memoryview(view).cast("B")
        self.parts: list | None = None

    @property
    def nbytes(self) -> int:
        return self.view.nbytes if self.parts is None else sum(p.nbytes for p in self.parts)

    @classmethod
    def of(cls, parts: list) -> RawData:
        chunk = cls(b"")
        chunk.parts = [memoryview(p).cast("B") for p in parts]
        return chunk


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf, pos: int) -> tuple[int, int] | None:
    shift = result = 0
    while pos < len(buf) and shift < 64:
        b = buf[pos]
        result |= (b & 0x7F) << shift
        pos += 1
        if not b & 0x80:
            return result, pos
        shift += 7
    return None


def serialize(msg) -> bytes:
    if isinstance(msg, RawData):
        parts = [msg.view] if msg.parts is None else msg.parts
        return b"".join((bytes([_DATA_TAG]), _varint(msg.nbytes), *parts))
    return msg.SerializeToString()


def _deserializer(message_cls):
    def deserialize(raw: bytes):
        if raw[:1] == b"\x12":
            parsed = _read_varint(raw, 1)
            if parsed is not None and parsed[1] + parsed[0] == len(raw):
                return RawData(memoryview(raw)[parsed[1] :])
        return message_cls.FromString(raw)

    return deserialize


deserialize_push_chunk = _deserializer(pb.PushChunk)
deserialize_pull_chunk = _deserializer(pb.PullChunk)
