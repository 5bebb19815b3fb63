"""The raw chunk path is byte-for-byte the protobuf encoding of a data-only chunk."""

import os

import pytest

from atoll.protos import coordinator_pb2 as pb
from atoll.protos import raw


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16383, 16384, 1 << 20])
def test_interoperates_with_generated_code(size):
    data = os.urandom(size)
    wire = raw.serialize(raw.RawData(data))
    assert wire == pb.PushChunk(data=data).SerializeToString() == pb.PullChunk(data=data).SerializeToString()
    got = raw.deserialize_push_chunk(pb.PushChunk(data=data).SerializeToString())
    assert isinstance(got, raw.RawData) and bytes(got.view) == data
    assert pb.PushChunk.FromString(wire).data == data


def test_headers_and_odd_messages_go_through_protobuf():
    header = pb.PushChunk(header=pb.PushHeader(run_id="r", island_id="i", round=3))
    assert raw.serialize(header) == header.SerializeToString()
    back = raw.deserialize_push_chunk(header.SerializeToString())
    assert isinstance(back, pb.PushChunk) and back.header.round == 3
    # A data tag with a length that does not match the message is left to protobuf (which rejects it).
    with pytest.raises(Exception):  # noqa: B017 - protobuf's DecodeError
        raw.deserialize_push_chunk(b"\x12\x05ab")
    pull = raw.deserialize_pull_chunk(pb.PullChunk(header=pb.UpdateHeader(round=2)).SerializeToString())
    assert pull.header.round == 2


def test_small_payloads_share_chunks_and_large_ones_are_not_held_back():
    """2000 tensors of 1 KiB travel as two messages, not 2000. A large payload
    completes the pending chunk and goes out whole, none of it left waiting for the next payload."""
    from atoll.protos.rpc import ChunkPacker, EntryAssembler, data_chunks

    small = [bytes([i % 251]) * 1024 for i in range(2000)]
    chunks = list(data_chunks(small, chunk_bytes=1 << 20))
    assert len(chunks) == 2 and [len(raw.serialize(c)) > 1 << 20 for c in chunks] == [True, False]
    packer = ChunkPacker(chunk_bytes=1 << 20)
    big = bytes(range(256)) * 10_000  # 2.44 MiB
    assert packer.add(b"head") == []
    out = packer.add(big)
    assert [c.nbytes for c in out] == [
        1 << 20,
        1 << 20,
        len(big) + 4 - 2 * (1 << 20),
    ]
    assert packer.flush() == []  # nothing of the large payload waits
    # What arrives is the payloads, in order, whatever the chunk boundaries.
    payloads = [b"head", big, b"x" * 10, b"", b"tail" * 1000]
    sizes = [len(p) for p in payloads]
    asm, got = EntryAssembler(sizes), []
    for c in data_chunks(payloads, chunk_bytes=1 << 20):
        got += asm.feed(raw.deserialize_push_chunk(raw.serialize(c)).view)
    got += asm.finish()
    assert [bytes(p) for _, p in got] == payloads
