"""One vocabulary: a message an island builds reaches the coordinator's core as the same type with the same
values, who calls said once (by the island's transport, from its session's identity)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from atoll.coordinator.transport import convert as coordinator_side
from atoll.islands._transport import convert as island_side
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.messages import Entry, JoinRequest, PushHeader, TensorDecl, TensorRegion
from atoll.protos.vocabulary import PushKind, TensorKind

WHO = {"run_id": "r", "island_id": "a", "session_id": "s1"}


def test_a_join_request_crosses_the_wire_unchanged_with_the_callers_identity_filled_in():
    sent = JoinRequest(
        codecs=("int8", "sparse:density=0.01"),
        tensors=(
            TensorDecl("w", (3, 4), torch.bfloat16, aliases=("lm_head.weight",)),
            TensorDecl("bn.running_mean", (4,), torch.float32, TensorKind.BUFFER),
        ),
        num_ranks=2,
        shard_index=1,
        num_shards=3,
        partition="layers",
        layout_digest="abc",
        model_card='{"kind": "gpt"}',
    )
    wire = island_side.join_request(WHO["run_id"], WHO["island_id"], WHO["session_id"], sent)
    got = coordinator_side.join_request(type(wire).FromString(wire.SerializeToString()))
    assert type(got) is JoinRequest
    assert got == dataclasses.replace(sent, **WHO)


def test_a_push_header_crosses_the_wire_unchanged_and_survives_an_islands_checkpoint():
    sent = PushHeader(
        kind=PushKind.DELTA,
        round=7,
        codec="int8",
        entries=(Entry("w", (0, 0), (2, 4), 40), Entry("b", (), (), 12)),
        tokens=4096,
        loss=2.5,
        inner_steps=30,
        compute_seconds=1.25,
        blocked_seconds=0.5,
    )
    wire = island_side.push_header(WHO["run_id"], WHO["island_id"], WHO["session_id"], 1, 2, sent)
    got = coordinator_side.push_header(type(wire).FromString(wire.SerializeToString()))
    assert got == dataclasses.replace(sent, **WHO, rank=1, num_ranks=2)
    assert PushHeader.from_json(sent.to_json()) == sent
    assert island_side.push_header_from_wire(wire.SerializeToString()) == sent


def test_a_pulls_regions_cross_the_wire_as_the_same_type():
    sent = [TensorRegion("w", (0, 2), (3, 4)), TensorRegion("b")]
    wire = island_side.regions(sent)
    got = coordinator_side.pull_request(pb.PullRequest(**WHO, have_round=3, regions=wire))
    assert list(got.regions) == sent


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("JoinAnswer", "Admission"),
        ("EntryDecl", "Entry"),
        ("PARAMETER", TensorKind.PARAMETER),
        ("BUFFER", TensorKind.BUFFER),
    ],
)
def test_the_last_releases_names_still_import_with_a_warning(old, new):
    import atoll.coordinator.messages as messages

    with pytest.warns(FutureWarning, match="deprecated"):
        got = getattr(messages, old)
    assert got is (getattr(messages, new) if isinstance(new, str) else new)
    with pytest.raises(AttributeError):
        messages.NoSuchName  # noqa: B018
