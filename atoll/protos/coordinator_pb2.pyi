from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]

class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REASON_UNSPECIFIED: _ClassVar[Reason]
    REASON_BAD_REQUEST: _ClassVar[Reason]
    REASON_WRONG_RUN: _ClassVar[Reason]
    REASON_NOT_JOINED: _ClassVar[Reason]
    REASON_MODEL_MISMATCH: _ClassVar[Reason]
    REASON_CODEC_MISMATCH: _ClassVar[Reason]
    REASON_SHARD_MISMATCH: _ClassVar[Reason]
    REASON_SESSION_CONFLICT: _ClassVar[Reason]
    REASON_EVICTED: _ClassVar[Reason]
    REASON_NO_PARAMETERS: _ClassVar[Reason]
    REASON_NOT_BOOTSTRAPPER: _ClassVar[Reason]
    REASON_ROUND_IN_FUTURE: _ClassVar[Reason]
    REASON_PUSH_IN_PROGRESS: _ClassVar[Reason]
    REASON_INFLIGHT_BUDGET: _ClassVar[Reason]
    REASON_TOKENS_OUT_OF_RANGE: _ClassVar[Reason]
    REASON_DELTA_TOO_LARGE: _ClassVar[Reason]
    REASON_BAD_PAYLOAD: _ClassVar[Reason]
    REASON_INCOMPLETE_ISLAND: _ClassVar[Reason]
    REASON_UNAUTHENTICATED: _ClassVar[Reason]
    REASON_PERMISSION_DENIED: _ClassVar[Reason]
    REASON_STREAM_IDLE: _ClassVar[Reason]
    REASON_NOT_DURABLE: _ClassVar[Reason]
    REASON_PULL_BUDGET: _ClassVar[Reason]
    REASON_RELAY_LOOP: _ClassVar[Reason]
    REASON_RELAY_NOT_READY: _ClassVar[Reason]

class TensorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_KIND_PARAMETER: _ClassVar[TensorKind]
    TENSOR_KIND_BUFFER: _ClassVar[TensorKind]

class PushKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_KIND_UNSPECIFIED: _ClassVar[PushKind]
    PUSH_KIND_DELTA: _ClassVar[PushKind]
    PUSH_KIND_INIT: _ClassVar[PushKind]

class PushOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_OUTCOME_UNSPECIFIED: _ClassVar[PushOutcome]
    PUSH_OUTCOME_COMMITTED: _ClassVar[PushOutcome]
    PUSH_OUTCOME_STAGED: _ClassVar[PushOutcome]
    PUSH_OUTCOME_DUPLICATE: _ClassVar[PushOutcome]
    PUSH_OUTCOME_FOLDED: _ClassVar[PushOutcome]
    PUSH_OUTCOME_ROUND_CLOSED: _ClassVar[PushOutcome]
    PUSH_OUTCOME_RUN_COMPLETE: _ClassVar[PushOutcome]

class UpdateKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPDATE_KIND_UNSPECIFIED: _ClassVar[UpdateKind]
    UPDATE_KIND_NOT_READY: _ClassVar[UpdateKind]
    UPDATE_KIND_FULL: _ClassVar[UpdateKind]
    UPDATE_KIND_DELTA: _ClassVar[UpdateKind]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT64: DType
REASON_UNSPECIFIED: Reason
REASON_BAD_REQUEST: Reason
REASON_WRONG_RUN: Reason
REASON_NOT_JOINED: Reason
REASON_MODEL_MISMATCH: Reason
REASON_CODEC_MISMATCH: Reason
REASON_SHARD_MISMATCH: Reason
REASON_SESSION_CONFLICT: Reason
REASON_EVICTED: Reason
REASON_NO_PARAMETERS: Reason
REASON_NOT_BOOTSTRAPPER: Reason
REASON_ROUND_IN_FUTURE: Reason
REASON_PUSH_IN_PROGRESS: Reason
REASON_INFLIGHT_BUDGET: Reason
REASON_TOKENS_OUT_OF_RANGE: Reason
REASON_DELTA_TOO_LARGE: Reason
REASON_BAD_PAYLOAD: Reason
REASON_INCOMPLETE_ISLAND: Reason
REASON_UNAUTHENTICATED: Reason
REASON_PERMISSION_DENIED: Reason
REASON_STREAM_IDLE: Reason
REASON_NOT_DURABLE: Reason
REASON_PULL_BUDGET: Reason
REASON_RELAY_LOOP: Reason
REASON_RELAY_NOT_READY: Reason
TENSOR_KIND_PARAMETER: TensorKind
TENSOR_KIND_BUFFER: TensorKind
PUSH_KIND_UNSPECIFIED: PushKind
PUSH_KIND_DELTA: PushKind
PUSH_KIND_INIT: PushKind
PUSH_OUTCOME_UNSPECIFIED: PushOutcome
PUSH_OUTCOME_COMMITTED: PushOutcome
PUSH_OUTCOME_STAGED: PushOutcome
PUSH_OUTCOME_DUPLICATE: PushOutcome
PUSH_OUTCOME_FOLDED: PushOutcome
PUSH_OUTCOME_ROUND_CLOSED: PushOutcome
PUSH_OUTCOME_RUN_COMPLETE: PushOutcome
UPDATE_KIND_UNSPECIFIED: UpdateKind
UPDATE_KIND_NOT_READY: UpdateKind
UPDATE_KIND_FULL: UpdateKind
UPDATE_KIND_DELTA: UpdateKind

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "kind", "aliases")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    kind: TensorKind
    aliases: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., kind: _Optional[_Union[TensorKind, str]] = ..., aliases: _Optional[_Iterable[str]] = ...) -> None: ...

class RunConfigProto(_message.Message):
    __slots__ = ("run_id", "sync_every", "outer_lr", "outer_momentum", "nesterov", "codec", "downlink_codec", "quorum", "round_deadline_seconds", "lease_seconds", "error_feedback", "late_policy", "staleness_weight", "max_staleness", "aggregation", "clip_norm", "max_delta_norm", "error_feedback_decay", "total_rounds", "max_tokens_per_round", "grace_window", "outer_mode", "decoupled_step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_FIELD_NUMBER: _ClassVar[int]
    OUTER_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DOWNLINK_CODEC_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    ROUND_DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    LATE_POLICY_FIELD_NUMBER: _ClassVar[int]
    STALENESS_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    MAX_DELTA_NORM_FIELD_NUMBER: _ClassVar[int]
    ERROR_FEEDBACK_DECAY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    GRACE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    OUTER_MODE_FIELD_NUMBER: _ClassVar[int]
    DECOUPLED_STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    sync_every: int
    outer_lr: float
    outer_momentum: float
    nesterov: bool
    codec: str
    downlink_codec: str
    quorum: int
    round_deadline_seconds: float
    lease_seconds: float
    error_feedback: bool
    late_policy: str
    staleness_weight: float
    max_staleness: int
    aggregation: str
    clip_norm: float
    max_delta_norm: float
    error_feedback_decay: float
    total_rounds: int
    max_tokens_per_round: int
    grace_window: str
    outer_mode: str
    decoupled_step: str
    def __init__(self, run_id: _Optional[str] = ..., sync_every: _Optional[int] = ..., outer_lr: _Optional[float] = ..., outer_momentum: _Optional[float] = ..., nesterov: _Optional[bool] = ..., codec: _Optional[str] = ..., downlink_codec: _Optional[str] = ..., quorum: _Optional[int] = ..., round_deadline_seconds: _Optional[float] = ..., lease_seconds: _Optional[float] = ..., error_feedback: _Optional[bool] = ..., late_policy: _Optional[str] = ..., staleness_weight: _Optional[float] = ..., max_staleness: _Optional[int] = ..., aggregation: _Optional[str] = ..., clip_norm: _Optional[float] = ..., max_delta_norm: _Optional[float] = ..., error_feedback_decay: _Optional[float] = ..., total_rounds: _Optional[int] = ..., max_tokens_per_round: _Optional[int] = ..., grace_window: _Optional[str] = ..., outer_mode: _Optional[str] = ..., decoupled_step: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("run_id", "island_id", "codecs", "tensors", "num_ranks", "shard_index", "num_shards", "partition", "layout_digest", "session_id", "model_card", "relay")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_CARD_FIELD_NUMBER: _ClassVar[int]
    RELAY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    island_id: str
    codecs: _containers.RepeatedScalarFieldContainer[str]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    num_ranks: int
    shard_index: int
    num_shards: int
    partition: str
    layout_digest: str
    session_id: str
    model_card: str
    relay: bool
    def __init__(self, run_id: _Optional[str] = ..., island_id: _Optional[str] = ..., codecs: _Optional[_Iterable[str]] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., num_ranks: _Optional[int] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., partition: _Optional[str] = ..., layout_digest: _Optional[str] = ..., session_id: _Optional[str] = ..., model_card: _Optional[str] = ..., relay: _Optional[bool] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("config", "round", "bootstrap", "codec", "run_complete", "bulk_port", "checks_tokens", "bulk_streams", "bulk_keep_seconds", "relay_chain")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RUN_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    CHECKS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BULK_STREAMS_FIELD_NUMBER: _ClassVar[int]
    BULK_KEEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELAY_CHAIN_FIELD_NUMBER: _ClassVar[int]
    config: RunConfigProto
    round: int
    bootstrap: bool
    codec: str
    run_complete: bool
    bulk_port: int
    checks_tokens: bool
    bulk_streams: int
    bulk_keep_seconds: int
    relay_chain: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, config: _Optional[_Union[RunConfigProto, _Mapping]] = ..., round: _Optional[int] = ..., bootstrap: _Optional[bool] = ..., codec: _Optional[str] = ..., run_complete: _Optional[bool] = ..., bulk_port: _Optional[int] = ..., checks_tokens: _Optional[bool] = ..., bulk_streams: _Optional[int] = ..., bulk_keep_seconds: _Optional[int] = ..., relay_chain: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("run_id", "island_id", "round", "session_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    island_id: str
    round: int
    session_id: str
    def __init__(self, run_id: _Optional[str] = ..., island_id: _Optional[str] = ..., round: _Optional[int] = ..., session_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("round", "lease_seconds", "run_complete")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RUN_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    round: int
    lease_seconds: float
    run_complete: bool
    def __init__(self, round: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., run_complete: _Optional[bool] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "offsets", "sizes", "num_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    offsets: _containers.RepeatedScalarFieldContainer[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    num_bytes: int
    def __init__(self, name: _Optional[str] = ..., offsets: _Optional[_Iterable[int]] = ..., sizes: _Optional[_Iterable[int]] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("run_id", "island_id", "round", "kind", "rank", "num_ranks", "tokens", "codec", "entries", "loss", "session_id", "inner_steps", "compute_seconds", "blocked_seconds", "members")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    island_id: str
    round: int
    kind: PushKind
    rank: int
    num_ranks: int
    tokens: int
    codec: str
    entries: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    loss: float
    session_id: str
    inner_steps: int
    compute_seconds: float
    blocked_seconds: float
    members: _containers.RepeatedCompositeFieldContainer[RelayMember]
    def __init__(self, run_id: _Optional[str] = ..., island_id: _Optional[str] = ..., round: _Optional[int] = ..., kind: _Optional[_Union[PushKind, str]] = ..., rank: _Optional[int] = ..., num_ranks: _Optional[int] = ..., tokens: _Optional[int] = ..., codec: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., loss: _Optional[float] = ..., session_id: _Optional[str] = ..., inner_steps: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., blocked_seconds: _Optional[float] = ..., members: _Optional[_Iterable[_Union[RelayMember, _Mapping]]] = ...) -> None: ...

class RelayMember(_message.Message):
    __slots__ = ("island_id", "tokens", "inner_steps", "loss", "compute_seconds", "via", "joined_seconds")
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VIA_FIELD_NUMBER: _ClassVar[int]
    JOINED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    island_id: str
    tokens: int
    inner_steps: int
    loss: float
    compute_seconds: float
    via: str
    joined_seconds: float
    def __init__(self, island_id: _Optional[str] = ..., tokens: _Optional[int] = ..., inner_steps: _Optional[int] = ..., loss: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., via: _Optional[str] = ..., joined_seconds: _Optional[float] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("committed", "duplicate", "round", "bytes_received", "outcome")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    duplicate: bool
    round: int
    bytes_received: int
    outcome: PushOutcome
    def __init__(self, committed: _Optional[bool] = ..., duplicate: _Optional[bool] = ..., round: _Optional[int] = ..., bytes_received: _Optional[int] = ..., outcome: _Optional[_Union[PushOutcome, str]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("run_id", "island_id", "have_round", "wait_seconds", "regions", "session_id", "resume_offset", "rank")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    HAVE_ROUND_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    island_id: str
    have_round: int
    wait_seconds: float
    regions: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    session_id: str
    resume_offset: int
    rank: int
    def __init__(self, run_id: _Optional[str] = ..., island_id: _Optional[str] = ..., have_round: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., regions: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., session_id: _Optional[str] = ..., resume_offset: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class UpdateHeader(_message.Message):
    __slots__ = ("kind", "round", "codec", "entries", "committed", "loss", "latest_round", "bootstrap", "run_complete", "waiting", "tentative", "stalled", "arrival_offset")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    LATEST_ROUND_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_FIELD_NUMBER: _ClassVar[int]
    RUN_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    TENTATIVE_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_OFFSET_FIELD_NUMBER: _ClassVar[int]
    kind: UpdateKind
    round: int
    codec: str
    entries: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    committed: bool
    loss: float
    latest_round: int
    bootstrap: bool
    run_complete: bool
    waiting: str
    tentative: bool
    stalled: bool
    arrival_offset: float
    def __init__(self, kind: _Optional[_Union[UpdateKind, str]] = ..., round: _Optional[int] = ..., codec: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., committed: _Optional[bool] = ..., loss: _Optional[float] = ..., latest_round: _Optional[int] = ..., bootstrap: _Optional[bool] = ..., run_complete: _Optional[bool] = ..., waiting: _Optional[str] = ..., tentative: _Optional[bool] = ..., stalled: _Optional[bool] = ..., arrival_offset: _Optional[float] = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("header", "data", "durable")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    data: bytes
    durable: Durable
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., durable: _Optional[_Union[Durable, _Mapping]] = ...) -> None: ...

class Durable(_message.Message):
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    def __init__(self, round: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("run_id", "island_id", "session_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ISLAND_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    island_id: str
    session_id: str
    def __init__(self, run_id: _Optional[str] = ..., island_id: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
