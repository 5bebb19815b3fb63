"""Wire messages to the coordinator's own (:mod:`atoll.coordinator.messages`) and back: the gRPC
layer's and the bulk port's one conversion."""

from __future__ import annotations

import dataclasses

from atoll.coordinator.messages import (
    Entry,
    JoinRequest,
    Member,
    PullRequest,
    PushHeader,
    PushResult,
    TensorDecl,
    TensorKind,
    TensorRegion,
)
from atoll.names import canonical_name
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.dtypes import TORCH_FROM_PB
from atoll.protos.vocabulary import PushKind, PushOutcome, UpdateKind

PUSH_OUTCOMES = {o: getattr(pb, f"PUSH_OUTCOME_{o.name}") for o in PushOutcome}
UPDATE_KINDS = {k: getattr(pb, f"UPDATE_KIND_{k.name}") for k in UpdateKind}
PUSH_KINDS = {pb.PUSH_KIND_DELTA: PushKind.DELTA, pb.PUSH_KIND_INIT: PushKind.INIT}
TENSOR_KINDS = {pb.TENSOR_KIND_PARAMETER: TensorKind.PARAMETER, pb.TENSOR_KIND_BUFFER: TensorKind.BUFFER}


def join_request(m: pb.JoinRequest) -> JoinRequest:
    return JoinRequest(
        run_id=m.run_id,
        island_id=m.island_id,
        session_id=m.session_id,
        codecs=tuple(m.codecs),
        tensors=tuple(
            TensorDecl(
                canonical_name(t.name),
                tuple(t.shape),
                TORCH_FROM_PB.get(t.dtype),
                TENSOR_KINDS.get(t.kind),
                tuple(canonical_name(a) for a in t.aliases),
            )
            for t in m.tensors
        ),
        num_ranks=m.num_ranks,
        shard_index=m.shard_index,
        num_shards=m.num_shards,
        partition=m.partition,
        layout_digest=m.layout_digest,
        model_card=m.model_card,
        relay=m.relay,
    )


def push_header(h: pb.PushHeader) -> PushHeader:
    return PushHeader(
        run_id=h.run_id,
        island_id=h.island_id,
        session_id=h.session_id,
        round=h.round,
        kind=PUSH_KINDS.get(h.kind),
        rank=h.rank,
        num_ranks=h.num_ranks,
        tokens=h.tokens,
        codec=h.codec,
        entries=tuple(Entry(canonical_name(e.name), tuple(e.offsets), tuple(e.sizes), e.num_bytes) for e in h.entries),
        loss=h.loss if h.HasField("loss") else None,
        inner_steps=h.inner_steps,
        compute_seconds=h.compute_seconds,
        blocked_seconds=h.blocked_seconds,
        members=tuple(
            Member(
                x.island_id,
                x.tokens,
                x.inner_steps,
                x.loss if x.HasField("loss") else None,
                x.compute_seconds,
                x.via,
                x.joined_seconds,
            )
            for x in h.members
        ),
    )


def pull_request(m: pb.PullRequest) -> PullRequest:
    return PullRequest(
        run_id=m.run_id,
        island_id=m.island_id,
        session_id=m.session_id,
        have_round=m.have_round,
        wait_seconds=m.wait_seconds,
        regions=tuple(TensorRegion(canonical_name(e.name), tuple(e.offsets), tuple(e.sizes)) for e in m.regions),
    )


def config_proto(config) -> pb.RunConfigProto:
    return pb.RunConfigProto(**dataclasses.asdict(config))


def push_response(r: PushResult) -> pb.PushResponse:
    return pb.PushResponse(
        committed=r.committed,
        duplicate=r.outcome is PushOutcome.DUPLICATE,
        round=r.round,
        bytes_received=r.bytes_received,
        outcome=PUSH_OUTCOMES[r.outcome],
    )
