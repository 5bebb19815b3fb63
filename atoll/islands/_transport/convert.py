"""The island's messages (:mod:`atoll.islands._messages`) to and from their protobuf form: the one place
on the island where the wire's types and the algorithm's meet."""

from __future__ import annotations

from atoll.islands._messages import Entry, JoinAnswer, JoinRequest, PushHeader, RunTerms, TensorRegion, Update
from atoll.protos import coordinator_pb2 as pb
from atoll.protos.dtypes import PB_FROM_TORCH
from atoll.protos.vocabulary import PushKind, PushOutcome, TensorKind, UpdateKind

PUSH_KINDS = {PushKind.DELTA: pb.PUSH_KIND_DELTA, PushKind.INIT: pb.PUSH_KIND_INIT}
TENSOR_KINDS = {TensorKind.PARAMETER: pb.TENSOR_KIND_PARAMETER, TensorKind.BUFFER: pb.TENSOR_KIND_BUFFER}
OUTCOMES = {getattr(pb, f"PUSH_OUTCOME_{o.name}"): o for o in PushOutcome}
UPDATE_KINDS = {getattr(pb, f"UPDATE_KIND_{k.name}"): k for k in UpdateKind}


def join_request(run_id: str, island_id: str, session_id: str, req: JoinRequest) -> pb.JoinRequest:
    m = pb.JoinRequest(
        run_id=run_id,
        island_id=island_id,
        session_id=session_id,
        codecs=list(req.codecs),
        num_ranks=req.num_ranks,
        shard_index=req.shard_index,
        num_shards=req.num_shards,
        partition=req.partition,
        layout_digest=req.layout_digest,
        model_card=req.model_card,
        relay=req.relay,
    )
    for t in req.tensors:
        m.tensors.add(
            name=t.name,
            shape=list(t.shape),
            dtype=PB_FROM_TORCH[t.dtype],
            kind=TENSOR_KINDS[t.kind],
            aliases=t.aliases,
        )
    return m


def join_answer(m: pb.JoinResponse) -> JoinAnswer:
    c = m.config
    terms = RunTerms(
        sync_every=c.sync_every,
        outer_mode=c.outer_mode,
        max_staleness=c.max_staleness,
        error_feedback=c.error_feedback,
        error_feedback_decay=c.error_feedback_decay or 1.0,  # 0: unset by an older coordinator
    )
    return JoinAnswer(
        round=m.round,
        bootstrap=m.bootstrap,
        codec=m.codec,
        run_complete=m.run_complete,
        run=terms,
        bulk_port=m.bulk_port,
        checks_tokens=m.checks_tokens,
        relay_chain=tuple(m.relay_chain),
        config={f.name: getattr(c, f.name) for f in c.DESCRIPTOR.fields},
    )


def push_header(
    run_id: str, island_id: str, session_id: str, rank: int, num_ranks: int, h: PushHeader
) -> pb.PushHeader:
    m = pb.PushHeader(
        run_id=run_id,
        island_id=island_id,
        session_id=session_id,
        round=h.round,
        kind=PUSH_KINDS[h.kind],
        rank=rank,
        num_ranks=num_ranks,
        tokens=h.tokens,
        codec=h.codec,
        inner_steps=h.inner_steps,
        compute_seconds=h.compute_seconds,
        blocked_seconds=h.blocked_seconds,
    )
    if h.loss is not None:
        m.loss = h.loss
    for e in h.entries:
        m.entries.add(name=e.name, offsets=list(e.offsets), sizes=list(e.sizes), num_bytes=e.num_bytes)
    for x in h.members:
        member = m.members.add(
            island_id=x.island_id,
            tokens=x.tokens,
            inner_steps=x.inner_steps,
            compute_seconds=x.compute_seconds,
            via=x.via,
            joined_seconds=x.joined_seconds,
        )
        if x.loss is not None:
            member.loss = x.loss
    return m


def push_header_from_wire(data: bytes) -> PushHeader:
    """A push header a checkpoint of an earlier release stored in its protobuf form."""
    m = pb.PushHeader.FromString(data)
    return PushHeader(
        kind=next(k for k, v in PUSH_KINDS.items() if v == m.kind),
        round=m.round,
        codec=m.codec,
        entries=tuple(Entry(e.name, tuple(e.offsets), tuple(e.sizes), e.num_bytes) for e in m.entries),
        tokens=m.tokens,
        loss=m.loss if m.HasField("loss") else None,
        inner_steps=m.inner_steps,
        compute_seconds=m.compute_seconds,
        blocked_seconds=m.blocked_seconds,
    )


def outcome(m: pb.PushResponse) -> PushOutcome:
    return OUTCOMES.get(m.outcome, PushOutcome.COMMITTED if m.committed else PushOutcome.STAGED)


def update(m: pb.UpdateHeader) -> Update:
    return Update(
        kind=UPDATE_KINDS.get(m.kind, UpdateKind.NOT_READY),
        round=m.round,
        codec=m.codec,
        entries=tuple(Entry(e.name, tuple(e.offsets), tuple(e.sizes), e.num_bytes) for e in m.entries),
        committed=m.committed,
        loss=m.loss if m.HasField("loss") else None,
        latest_round=m.latest_round,
        bootstrap=m.bootstrap,
        run_complete=m.run_complete,
        waiting=m.waiting,
        stalled=m.stalled,
        tentative=m.tentative,
        arrival_offset=m.arrival_offset if m.HasField("arrival_offset") else None,
    )


def regions(rs: list[TensorRegion]) -> list[pb.TensorEntry]:
    return [pb.TensorEntry(name=r.name, offsets=list(r.offsets), sizes=list(r.sizes)) for r in rs]
