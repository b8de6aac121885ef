from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_MOVED: _ClassVar[FinishReason]

class ReleaseStage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RELEASE_STAGE_UNSPECIFIED: _ClassVar[ReleaseStage]
    RELEASE_STAGE_PREFILL_DONE: _ClassVar[ReleaseStage]
    RELEASE_STAGE_DONE: _ClassVar[ReleaseStage]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_MOVED: FinishReason
RELEASE_STAGE_UNSPECIFIED: ReleaseStage
RELEASE_STAGE_PREFILL_DONE: ReleaseStage
RELEASE_STAGE_DONE: ReleaseStage

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "repetition_penalty", "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs", "n", "logit_bias", "grammar", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logprobs: bool
    top_logprobs: int
    n: int
    logit_bias: _containers.ScalarMap[int, float]
    grammar: Grammar
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., n: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "text")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "logprob", "top_logprobs")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class WorkerRef(_message.Message):
    __slots__ = ("worker_id", "address", "instance_nonce")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_NONCE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    instance_nonce: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., instance_nonce: _Optional[str] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_tokens", "max_tokens", "page_hashes", "n", "exclude_instances", "checkpoint", "lora_adapter", "exclude_decode_instances", "admission_waiting_tokens", "gateway_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_DECODE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_tokens: int
    max_tokens: int
    page_hashes: _containers.RepeatedScalarFieldContainer[int]
    n: int
    exclude_instances: _containers.RepeatedScalarFieldContainer[str]
    checkpoint: str
    lora_adapter: str
    exclude_decode_instances: _containers.RepeatedScalarFieldContainer[str]
    admission_waiting_tokens: int
    gateway_id: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., page_hashes: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., exclude_instances: _Optional[_Iterable[str]] = ..., checkpoint: _Optional[str] = ..., lora_adapter: _Optional[str] = ..., exclude_decode_instances: _Optional[_Iterable[str]] = ..., admission_waiting_tokens: _Optional[int] = ..., gateway_id: _Optional[str] = ...) -> None: ...

class RouteReply(_message.Message):
    __slots__ = ("request_id", "prefill", "decode", "colocated", "cached_tokens", "reason", "decode_cached_tokens", "local_prefill", "checkpoint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill: WorkerRef
    decode: WorkerRef
    colocated: bool
    cached_tokens: int
    reason: str
    decode_cached_tokens: int
    local_prefill: bool
    checkpoint: str
    def __init__(self, request_id: _Optional[str] = ..., prefill: _Optional[_Union[WorkerRef, _Mapping]] = ..., decode: _Optional[_Union[WorkerRef, _Mapping]] = ..., colocated: _Optional[bool] = ..., cached_tokens: _Optional[int] = ..., reason: _Optional[str] = ..., decode_cached_tokens: _Optional[int] = ..., local_prefill: _Optional[bool] = ..., checkpoint: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "stage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    stage: ReleaseStage
    def __init__(self, request_id: _Optional[str] = ..., stage: _Optional[_Union[ReleaseStage, str]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StreamsRequest(_message.Message):
    __slots__ = ("stream_id", "generate", "cancel", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    generate: GenerateRequest
    cancel: bool
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, stream_id: _Optional[int] = ..., generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StreamsReply(_message.Message):
    __slots__ = ("pieces",)
    PIECES_FIELD_NUMBER: _ClassVar[int]
    pieces: _containers.RepeatedCompositeFieldContainer[StreamPiece]
    def __init__(self, pieces: _Optional[_Iterable[_Union[StreamPiece, _Mapping]]] = ...) -> None: ...

class StreamPiece(_message.Message):
    __slots__ = ("stream_id", "chunk", "end", "status_code", "status_details")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    chunk: TokenChunk
    end: bool
    status_code: int
    status_details: str
    def __init__(self, stream_id: _Optional[int] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., end: _Optional[bool] = ..., status_code: _Optional[int] = ..., status_details: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "max_tokens", "prefill_worker_id", "timeout_ms", "n", "prompt_token_ids", "cache_namespace", "tenant", "lora_adapter", "request_group")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_GROUP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    max_tokens: int
    prefill_worker_id: str
    timeout_ms: int
    n: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_namespace: int
    tenant: int
    lora_adapter: str
    request_group: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., prefill_worker_id: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., n: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_namespace: _Optional[int] = ..., tenant: _Optional[int] = ..., lora_adapter: _Optional[str] = ..., request_group: _Optional[str] = ...) -> None: ...

class RankPages(_message.Message):
    __slots__ = ("rank", "agent_name", "page_ids")
    RANK_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    agent_name: str
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., agent_name: _Optional[str] = ..., page_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("reservation_id", "generation", "decode_worker_id", "decode_instance_nonce", "page_size", "num_layers", "kv_dtype", "compat_hash", "ranks", "held_pages", "held_page_hashes", "capability", "lease_ttl_ms")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_NONCE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    HELD_PAGES_FIELD_NUMBER: _ClassVar[int]
    HELD_PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    generation: int
    decode_worker_id: str
    decode_instance_nonce: str
    page_size: int
    num_layers: int
    kv_dtype: str
    compat_hash: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankPages]
    held_pages: int
    held_page_hashes: _containers.RepeatedScalarFieldContainer[int]
    capability: WriteCapability
    lease_ttl_ms: int
    def __init__(self, reservation_id: _Optional[int] = ..., generation: _Optional[int] = ..., decode_worker_id: _Optional[str] = ..., decode_instance_nonce: _Optional[str] = ..., page_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., compat_hash: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankPages, _Mapping]]] = ..., held_pages: _Optional[int] = ..., held_page_hashes: _Optional[_Iterable[int]] = ..., capability: _Optional[_Union[WriteCapability, _Mapping]] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class WriteCapability(_message.Message):
    __slots__ = ("writer_id", "lifetime_ms", "secret", "signature")
    WRITER_ID_FIELD_NUMBER: _ClassVar[int]
    LIFETIME_MS_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    writer_id: str
    lifetime_ms: int
    secret: bytes
    signature: bytes
    def __init__(self, writer_id: _Optional[str] = ..., lifetime_ms: _Optional[int] = ..., secret: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("reservation_id", "generation", "prefill_not_sent", "request_id")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NOT_SENT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    generation: int
    prefill_not_sent: bool
    request_id: str
    def __init__(self, reservation_id: _Optional[int] = ..., generation: _Optional[int] = ..., prefill_not_sent: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class CancelReply(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class ReservationKey(_message.Message):
    __slots__ = ("reservation_id", "generation")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    generation: int
    def __init__(self, reservation_id: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("reservations",)
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    reservations: _containers.RepeatedCompositeFieldContainer[ReservationKey]
    def __init__(self, reservations: _Optional[_Iterable[_Union[ReservationKey, _Mapping]]] = ...) -> None: ...

class RenewLeaseReply(_message.Message):
    __slots__ = ("lost",)
    LOST_FIELD_NUMBER: _ClassVar[int]
    lost: _containers.RepeatedCompositeFieldContainer[ReservationKey]
    def __init__(self, lost: _Optional[_Iterable[_Union[ReservationKey, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "reservation", "prefill_worker_id", "first_token", "first_tokens", "cache_namespace", "tenant", "request_group", "resumed_output_tokens", "lora_adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_GROUP_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    reservation: Reservation
    prefill_worker_id: str
    first_token: Token
    first_tokens: _containers.RepeatedCompositeFieldContainer[Token]
    cache_namespace: int
    tenant: int
    request_group: str
    resumed_output_tokens: int
    lora_adapter: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., reservation: _Optional[_Union[Reservation, _Mapping]] = ..., prefill_worker_id: _Optional[str] = ..., first_token: _Optional[_Union[Token, _Mapping]] = ..., first_tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., cache_namespace: _Optional[int] = ..., tenant: _Optional[int] = ..., request_group: _Optional[str] = ..., resumed_output_tokens: _Optional[int] = ..., lora_adapter: _Optional[str] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("tokens", "finish_reason", "usage", "index", "prompt_logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    finish_reason: FinishReason
    usage: Usage
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[Token]
    def __init__(self, tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[Token, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "reservation", "cache_namespace", "tenant", "request_group", "resumed_output_tokens", "lora_adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_GROUP_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    reservation: Reservation
    cache_namespace: int
    tenant: int
    request_group: str
    resumed_output_tokens: int
    lora_adapter: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., reservation: _Optional[_Union[Reservation, _Mapping]] = ..., cache_namespace: _Optional[int] = ..., tenant: _Optional[int] = ..., request_group: _Optional[str] = ..., resumed_output_tokens: _Optional[int] = ..., lora_adapter: _Optional[str] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first_token", "cached_tokens", "computed_tokens", "kv_bytes_sent", "finish_reason", "sequences", "prompt_logprobs")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token: Token
    cached_tokens: int
    computed_tokens: int
    kv_bytes_sent: int
    finish_reason: FinishReason
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceStart]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[Token]
    def __init__(self, first_token: _Optional[_Union[Token, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., sequences: _Optional[_Iterable[_Union[SequenceStart, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[Token, _Mapping]]] = ...) -> None: ...

class SequenceStart(_message.Message):
    __slots__ = ("first_token", "finish_reason")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    first_token: Token
    finish_reason: FinishReason
    def __init__(self, first_token: _Optional[_Union[Token, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoraAdapterReply(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapters: _Optional[_Iterable[str]] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role", "reason", "hand_over")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HAND_OVER_FIELD_NUMBER: _ClassVar[int]
    role: str
    reason: str
    hand_over: int
    def __init__(self, role: _Optional[str] = ..., reason: _Optional[str] = ..., hand_over: _Optional[int] = ...) -> None: ...

class SetRoleReply(_message.Message):
    __slots__ = ("role", "previous_role", "changed", "inflight_requests", "handed_over")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_ROLE_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HANDED_OVER_FIELD_NUMBER: _ClassVar[int]
    role: str
    previous_role: str
    changed: bool
    inflight_requests: int
    handed_over: int
    def __init__(self, role: _Optional[str] = ..., previous_role: _Optional[str] = ..., changed: _Optional[bool] = ..., inflight_requests: _Optional[int] = ..., handed_over: _Optional[int] = ...) -> None: ...
