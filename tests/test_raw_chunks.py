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
