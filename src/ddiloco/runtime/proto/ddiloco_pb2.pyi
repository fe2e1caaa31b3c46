from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Param(_message.Message):
    __slots__ = ("name", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class FragmentLayout(_message.Message):
    __slots__ = ("index", "params", "numel", "offset", "is_embedding")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    IS_EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    index: int
    params: _containers.RepeatedCompositeFieldContainer[Param]
    numel: int
    offset: int
    is_embedding: bool
    def __init__(self, index: _Optional[int] = ..., params: _Optional[_Iterable[_Union[Param, _Mapping]]] = ..., numel: _Optional[int] = ..., offset: _Optional[int] = ..., is_embedding: _Optional[bool] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("incarnation", "number")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    number: int
    def __init__(self, incarnation: _Optional[int] = ..., number: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("boot", "tokens", "steps")
    BOOT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    boot: str
    tokens: int
    steps: int
    def __init__(self, boot: _Optional[str] = ..., tokens: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("learner_id", "probe", "boot", "tokens_per_step", "part")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    BOOT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    probe: bool
    boot: str
    tokens_per_step: int
    part: RankSlice
    def __init__(self, learner_id: _Optional[str] = ..., probe: _Optional[bool] = ..., boot: _Optional[str] = ..., tokens_per_step: _Optional[int] = ..., part: _Optional[_Union[RankSlice, _Mapping]] = ...) -> None: ...

class RankSlice(_message.Message):
    __slots__ = ("rank", "world")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world: int
    def __init__(self, rank: _Optional[int] = ..., world: _Optional[int] = ...) -> None: ...

class JoinHeader(_message.Message):
    __slots__ = ("incarnation", "protocol_json", "period", "fragments", "versions", "data_shard", "finished", "layout_sha256", "session", "run_json", "stop", "shard", "shards", "run_sha256", "data_position")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_JSON_FIELD_NUMBER: _ClassVar[int]
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DATA_SHARD_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_SHA256_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RUN_JSON_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    RUN_SHA256_FIELD_NUMBER: _ClassVar[int]
    DATA_POSITION_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    protocol_json: str
    period: int
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentLayout]
    versions: _containers.RepeatedScalarFieldContainer[int]
    data_shard: int
    finished: bool
    layout_sha256: str
    session: Session
    run_json: str
    stop: bool
    shard: int
    shards: int
    run_sha256: str
    data_position: int
    def __init__(self, incarnation: _Optional[int] = ..., protocol_json: _Optional[str] = ..., period: _Optional[int] = ..., fragments: _Optional[_Iterable[_Union[FragmentLayout, _Mapping]]] = ..., versions: _Optional[_Iterable[int]] = ..., data_shard: _Optional[int] = ..., finished: _Optional[bool] = ..., layout_sha256: _Optional[str] = ..., session: _Optional[_Union[Session, _Mapping]] = ..., run_json: _Optional[str] = ..., stop: _Optional[bool] = ..., shard: _Optional[int] = ..., shards: _Optional[int] = ..., run_sha256: _Optional[str] = ..., data_position: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("fragment", "version", "offset", "total_bytes", "data")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    offset: int
    total_bytes: int
    data: bytes
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: JoinHeader
    chunk: StateChunk
    def __init__(self, header: _Optional[_Union[JoinHeader, _Mapping]] = ..., chunk: _Optional[_Union[StateChunk, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("learner_id", "session", "progress")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    session: Session
    progress: Progress
    def __init__(self, learner_id: _Optional[str] = ..., session: _Optional[_Union[Session, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("stop",)
    STOP_FIELD_NUMBER: _ClassVar[int]
    stop: bool
    def __init__(self, stop: _Optional[bool] = ...) -> None: ...

class ContributionHeader(_message.Message):
    __slots__ = ("learner_id", "fragment", "base_version", "seq", "tokens", "steps", "compute_s", "step_time_s", "codec", "payload_bytes", "first_step", "session", "progress", "slice")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    fragment: int
    base_version: int
    seq: int
    tokens: int
    steps: int
    compute_s: float
    step_time_s: float
    codec: str
    payload_bytes: int
    first_step: int
    session: Session
    progress: Progress
    slice: Slice
    def __init__(self, learner_id: _Optional[str] = ..., fragment: _Optional[int] = ..., base_version: _Optional[int] = ..., seq: _Optional[int] = ..., tokens: _Optional[int] = ..., steps: _Optional[int] = ..., compute_s: _Optional[float] = ..., step_time_s: _Optional[float] = ..., codec: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., first_step: _Optional[int] = ..., session: _Optional[_Union[Session, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., slice: _Optional[_Union[Slice, _Mapping]] = ...) -> None: ...

class Slice(_message.Message):
    __slots__ = ("rank", "world", "starts", "lengths")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world: int
    starts: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., world: _Optional[int] = ..., starts: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class ContributionChunk(_message.Message):
    __slots__ = ("header", "offset", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ContributionHeader
    offset: int
    data: bytes
    def __init__(self, header: _Optional[_Union[ContributionHeader, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ContributeReply(_message.Message):
    __slots__ = ("stop",)
    STOP_FIELD_NUMBER: _ClassVar[int]
    stop: bool
    def __init__(self, stop: _Optional[bool] = ...) -> None: ...

class UpdatesRequest(_message.Message):
    __slots__ = ("learner_id", "have_versions", "session", "part")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    have_versions: _containers.RepeatedScalarFieldContainer[int]
    session: Session
    part: RankSlice
    def __init__(self, learner_id: _Optional[str] = ..., have_versions: _Optional[_Iterable[int]] = ..., session: _Optional[_Union[Session, _Mapping]] = ..., part: _Optional[_Union[RankSlice, _Mapping]] = ...) -> None: ...

class Update(_message.Message):
    __slots__ = ("fragment", "version", "codec", "data", "stop", "offset", "total_bytes", "incarnation", "round_age_s", "merged")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROUND_AGE_S_FIELD_NUMBER: _ClassVar[int]
    MERGED_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    codec: str
    data: bytes
    stop: bool
    offset: int
    total_bytes: int
    incarnation: int
    round_age_s: float
    merged: _containers.RepeatedCompositeFieldContainer[MergedRef]
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., codec: _Optional[str] = ..., data: _Optional[bytes] = ..., stop: _Optional[bool] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., incarnation: _Optional[int] = ..., round_age_s: _Optional[float] = ..., merged: _Optional[_Iterable[_Union[MergedRef, _Mapping]]] = ...) -> None: ...

class MergedRef(_message.Message):
    __slots__ = ("learner_id", "session", "seq")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    session: int
    seq: int
    def __init__(self, learner_id: _Optional[str] = ..., session: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class FetchStateRequest(_message.Message):
    __slots__ = ("learner_id", "session", "part")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    session: Session
    part: RankSlice
    def __init__(self, learner_id: _Optional[str] = ..., session: _Optional[_Union[Session, _Mapping]] = ..., part: _Optional[_Union[RankSlice, _Mapping]] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("learner_id", "session", "progress")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    session: Session
    progress: Progress
    def __init__(self, learner_id: _Optional[str] = ..., session: _Optional[_Union[Session, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("learner_offset", "learner_limit")
    LEARNER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LEARNER_LIMIT_FIELD_NUMBER: _ClassVar[int]
    learner_offset: int
    learner_limit: int
    def __init__(self, learner_offset: _Optional[int] = ..., learner_limit: _Optional[int] = ...) -> None: ...

class LearnerStatus(_message.Message):
    __slots__ = ("id", "alive", "last_seen_s_ago", "accepted", "rejected", "registrations", "tokens", "step_time_s", "bytes_up", "bytes_down", "accepted_per_min", "link_starved", "joining", "data_position", "refused", "refused_steps", "refused_tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_AGO_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    REGISTRATIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_MIN_FIELD_NUMBER: _ClassVar[int]
    LINK_STARVED_FIELD_NUMBER: _ClassVar[int]
    JOINING_FIELD_NUMBER: _ClassVar[int]
    DATA_POSITION_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_STEPS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: str
    alive: bool
    last_seen_s_ago: float
    accepted: int
    rejected: int
    registrations: int
    tokens: int
    step_time_s: float
    bytes_up: int
    bytes_down: int
    accepted_per_min: int
    link_starved: bool
    joining: bool
    data_position: int
    refused: _containers.RepeatedCompositeFieldContainer[CountEntry]
    refused_steps: _containers.RepeatedCompositeFieldContainer[CountEntry]
    refused_tokens: _containers.RepeatedCompositeFieldContainer[CountEntry]
    def __init__(self, id: _Optional[str] = ..., alive: _Optional[bool] = ..., last_seen_s_ago: _Optional[float] = ..., accepted: _Optional[int] = ..., rejected: _Optional[int] = ..., registrations: _Optional[int] = ..., tokens: _Optional[int] = ..., step_time_s: _Optional[float] = ..., bytes_up: _Optional[int] = ..., bytes_down: _Optional[int] = ..., accepted_per_min: _Optional[int] = ..., link_starved: _Optional[bool] = ..., joining: _Optional[bool] = ..., data_position: _Optional[int] = ..., refused: _Optional[_Iterable[_Union[CountEntry, _Mapping]]] = ..., refused_steps: _Optional[_Iterable[_Union[CountEntry, _Mapping]]] = ..., refused_tokens: _Optional[_Iterable[_Union[CountEntry, _Mapping]]] = ...) -> None: ...

class FragmentStatus(_message.Message):
    __slots__ = ("id", "version", "numel", "bytes_up", "bytes_down")
    ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    id: int
    version: int
    numel: int
    bytes_up: int
    bytes_down: int
    def __init__(self, id: _Optional[int] = ..., version: _Optional[int] = ..., numel: _Optional[int] = ..., bytes_up: _Optional[int] = ..., bytes_down: _Optional[int] = ...) -> None: ...

class CountEntry(_message.Message):
    __slots__ = ("key", "count")
    KEY_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    key: str
    count: int
    def __init__(self, key: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("incarnation", "shard", "shards", "protocol_version", "mode", "phase", "uptime_s", "finished", "tokens", "token_budget", "tokens_left", "time_budget_s", "elapsed_s", "time_left_s", "pending_tokens", "learners", "learners_total", "learners_forgotten", "progress_clipped", "weights_capped", "claims_clipped", "link_starved_episodes", "norms_clipped", "refused_steps", "refused_tokens", "honest_refused_steps", "honest_refused_tokens", "idle_registrations", "oldest_idle_registration_s", "fragments", "round_phases", "quorum", "effective_quorum", "rounds_closed", "grace_window_s", "grace_quorum_s", "grace_sync_s", "rejections", "bytes_up", "bytes_down", "longest_pause_s", "goodput", "model_uptime", "checkpoints", "last_checkpoint_s_ago", "checkpoint_failures", "last_checkpoint_error")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_LEFT_FIELD_NUMBER: _ClassVar[int]
    TIME_BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    TIME_LEFT_S_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEARNERS_FIELD_NUMBER: _ClassVar[int]
    LEARNERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LEARNERS_FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CAPPED_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    LINK_STARVED_EPISODES_FIELD_NUMBER: _ClassVar[int]
    NORMS_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_STEPS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HONEST_REFUSED_STEPS_FIELD_NUMBER: _ClassVar[int]
    HONEST_REFUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IDLE_REGISTRATIONS_FIELD_NUMBER: _ClassVar[int]
    OLDEST_IDLE_REGISTRATION_S_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    ROUND_PHASES_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_QUORUM_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_CLOSED_FIELD_NUMBER: _ClassVar[int]
    GRACE_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    GRACE_QUORUM_S_FIELD_NUMBER: _ClassVar[int]
    GRACE_SYNC_S_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    LONGEST_PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_UPTIME_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_S_AGO_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_ERROR_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    shard: int
    shards: int
    protocol_version: int
    mode: str
    phase: str
    uptime_s: float
    finished: bool
    tokens: int
    token_budget: int
    tokens_left: int
    time_budget_s: float
    elapsed_s: float
    time_left_s: float
    pending_tokens: int
    learners: _containers.RepeatedCompositeFieldContainer[LearnerStatus]
    learners_total: int
    learners_forgotten: int
    progress_clipped: int
    weights_capped: int
    claims_clipped: _containers.RepeatedCompositeFieldContainer[CountEntry]
    link_starved_episodes: int
    norms_clipped: int
    refused_steps: _containers.RepeatedCompositeFieldContainer[CountEntry]
    refused_tokens: _containers.RepeatedCompositeFieldContainer[CountEntry]
    honest_refused_steps: int
    honest_refused_tokens: int
    idle_registrations: int
    oldest_idle_registration_s: float
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentStatus]
    round_phases: _containers.RepeatedScalarFieldContainer[str]
    quorum: int
    effective_quorum: int
    rounds_closed: _containers.RepeatedCompositeFieldContainer[CountEntry]
    grace_window_s: float
    grace_quorum_s: float
    grace_sync_s: float
    rejections: _containers.RepeatedCompositeFieldContainer[CountEntry]
    bytes_up: int
    bytes_down: int
    longest_pause_s: float
    goodput: float
    model_uptime: float
    checkpoints: int
    last_checkpoint_s_ago: float
    checkpoint_failures: int
    last_checkpoint_error: str
    def __init__(self, incarnation: _Optional[int] = ..., shard: _Optional[int] = ..., shards: _Optional[int] = ..., protocol_version: _Optional[int] = ..., mode: _Optional[str] = ..., phase: _Optional[str] = ..., uptime_s: _Optional[float] = ..., finished: _Optional[bool] = ..., tokens: _Optional[int] = ..., token_budget: _Optional[int] = ..., tokens_left: _Optional[int] = ..., time_budget_s: _Optional[float] = ..., elapsed_s: _Optional[float] = ..., time_left_s: _Optional[float] = ..., pending_tokens: _Optional[int] = ..., learners: _Optional[_Iterable[_Union[LearnerStatus, _Mapping]]] = ..., learners_total: _Optional[int] = ..., learners_forgotten: _Optional[int] = ..., progress_clipped: _Optional[int] = ..., weights_capped: _Optional[int] = ..., claims_clipped: _Optional[_Iterable[_Union[CountEntry, _Mapping]]] = ..., link_starved_episodes: _Optional[int] = ..., norms_clipped: _Optional[int] = ..., refused_steps: _Optional[_Iterable[_Union[CountEntry, _Mapping]]] = ..., refused_tokens: _Optional[_Iterable[_Union[CountEntry, _Mapping]]] = ..., honest_refused_steps: _Optional[int] = ..., honest_refused_tokens: _Optional[int] = ..., idle_registrations: _Optional[int] = ..., oldest_idle_registration_s: _Optional[float] = ..., fragments: _Optional[_Iterable[_Union[FragmentStatus, _Mapping]]] = ..., round_phases: _Optional[_Iterable[str]] = ..., quorum: _Optional[int] = ..., effective_quorum: _Optional[int] = ..., rounds_closed: _Optional[_Iterable[_Union[CountEntry, _Mapping]]] = ..., grace_window_s: _Optional[float] = ..., grace_quorum_s: _Optional[float] = ..., grace_sync_s: _Optional[float] = ..., rejections: _Optional[_Iterable[_Union[CountEntry, _Mapping]]] = ..., bytes_up: _Optional[int] = ..., bytes_down: _Optional[int] = ..., longest_pause_s: _Optional[float] = ..., goodput: _Optional[float] = ..., model_uptime: _Optional[float] = ..., checkpoints: _Optional[int] = ..., last_checkpoint_s_ago: _Optional[float] = ..., checkpoint_failures: _Optional[int] = ..., last_checkpoint_error: _Optional[str] = ...) -> None: ...
