from . import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerInfo(_message.Message):
    __slots__ = ("role", "epoch", "compat_hash", "model_name", "block_size", "num_blocks", "free_blocks", "running", "waiting", "max_model_len", "kv_transports", "address", "queued_prefill_tokens", "prefix_hashes", "started_at", "reported_at", "busy_seconds", "draining", "max_batch", "prefix_caching")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    REPORTED_AT_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    role: str
    epoch: str
    compat_hash: str
    model_name: str
    block_size: int
    num_blocks: int
    free_blocks: int
    running: int
    waiting: int
    max_model_len: int
    kv_transports: _containers.RepeatedScalarFieldContainer[str]
    address: str
    queued_prefill_tokens: int
    prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    started_at: float
    reported_at: float
    busy_seconds: float
    draining: bool
    max_batch: int
    prefix_caching: bool
    def __init__(self, role: _Optional[str] = ..., epoch: _Optional[str] = ..., compat_hash: _Optional[str] = ..., model_name: _Optional[str] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., max_model_len: _Optional[int] = ..., kv_transports: _Optional[_Iterable[str]] = ..., address: _Optional[str] = ..., queued_prefill_tokens: _Optional[int] = ..., prefix_hashes: _Optional[_Iterable[int]] = ..., started_at: _Optional[float] = ..., reported_at: _Optional[float] = ..., busy_seconds: _Optional[float] = ..., draining: _Optional[bool] = ..., max_batch: _Optional[int] = ..., prefix_caching: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TransportOffer(_message.Message):
    __slots__ = ("backend", "meta", "rank")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    backend: str
    meta: bytes
    rank: int
    def __init__(self, backend: _Optional[str] = ..., meta: _Optional[bytes] = ..., rank: _Optional[int] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("request_id", "epoch", "block_ids", "num_tokens", "write_deadline", "offers", "compat_hash", "write_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WRITE_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    OFFERS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    WRITE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    write_deadline: float
    offers: _containers.RepeatedCompositeFieldContainer[TransportOffer]
    compat_hash: str
    write_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., write_deadline: _Optional[float] = ..., offers: _Optional[_Iterable[_Union[TransportOffer, _Mapping]]] = ..., compat_hash: _Optional[str] = ..., write_seconds: _Optional[float] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "lease_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    lease_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "epoch", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "handle", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generate_pb2.SamplingParams
    handle: KVHandle
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., handle: _Optional[_Union[KVHandle, _Mapping]] = ..., priority: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "kv_bytes", "prefill_seconds", "transfer_seconds", "transport", "transport_fallback", "cached_tokens", "first_logprob", "prompt_logprobs", "seconds_per_token")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    kv_bytes: int
    prefill_seconds: float
    transfer_seconds: float
    transport: str
    transport_fallback: bool
    cached_tokens: int
    first_logprob: _generate_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    seconds_per_token: float
    def __init__(self, first_token_id: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., transport: _Optional[str] = ..., transport_fallback: _Optional[bool] = ..., cached_tokens: _Optional[int] = ..., first_logprob: _Optional[_Union[_generate_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., seconds_per_token: _Optional[float] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("stopped",)
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    stopped: bool
    def __init__(self, stopped: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "epoch", "prompt_token_ids", "first_token_id", "sampling", "kv_bytes", "local_prefill", "transport", "n", "first_token_given", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_GIVEN_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    sampling: _generate_pb2.SamplingParams
    kv_bytes: int
    local_prefill: bool
    transport: str
    n: int
    first_token_given: bool
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_generate_pb2.SamplingParams, _Mapping]] = ..., kv_bytes: _Optional[int] = ..., local_prefill: _Optional[bool] = ..., transport: _Optional[str] = ..., n: _Optional[int] = ..., first_token_given: _Optional[bool] = ..., priority: _Optional[int] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "logprobs", "index", "prompt_logprobs", "cached_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    cached_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("info", "prompt_tokens_computed", "kv_bytes_received", "kv_bytes_sent", "active_handoffs")
    INFO_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    prompt_tokens_computed: int
    kv_bytes_received: int
    kv_bytes_sent: int
    active_handoffs: int
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., prompt_tokens_computed: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., active_handoffs: _Optional[int] = ...) -> None: ...
