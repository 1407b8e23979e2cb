from splitserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "decode_address", "peer_address", "peer_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    decode_address: str
    peer_address: str
    peer_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., decode_address: _Optional[str] = ..., peer_address: _Optional[str] = ..., peer_blocks: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "finish_reason", "cached_tokens", "blocks_shipped", "blocks_reused", "bytes_shipped", "blocks_fetched", "transfer_seconds", "transfer_path", "compute_seconds")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SHIPPED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REUSED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SHIPPED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FETCHED_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_PATH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: float
    finish_reason: str
    cached_tokens: int
    blocks_shipped: int
    blocks_reused: int
    bytes_shipped: int
    blocks_fetched: int
    transfer_seconds: float
    transfer_path: str
    compute_seconds: float
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[float] = ..., finish_reason: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., blocks_shipped: _Optional[int] = ..., blocks_reused: _Optional[int] = ..., bytes_shipped: _Optional[int] = ..., blocks_fetched: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., transfer_path: _Optional[str] = ..., compute_seconds: _Optional[float] = ...) -> None: ...

class FetchBlocksRequest(_message.Message):
    __slots__ = ("block_hashes", "model_root_hash", "block_nbytes", "receiver_endpoint", "ticket", "prompt_token_ids", "cache_salt", "first_block")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MODEL_ROOT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    model_root_hash: bytes
    block_nbytes: int
    receiver_endpoint: bytes
    ticket: bytes
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    first_block: int
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., model_root_hash: _Optional[bytes] = ..., block_nbytes: _Optional[int] = ..., receiver_endpoint: _Optional[bytes] = ..., ticket: _Optional[bytes] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., first_block: _Optional[int] = ...) -> None: ...

class TransferKVRequest(_message.Message):
    __slots__ = ("header", "blocks", "end")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    header: TransferHeader
    blocks: BlockData
    end: TransferEnd
    def __init__(self, header: _Optional[_Union[TransferHeader, _Mapping]] = ..., blocks: _Optional[_Union[BlockData, _Mapping]] = ..., end: _Optional[_Union[TransferEnd, _Mapping]] = ...) -> None: ...

class TransferHeader(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "first_token_id", "block_hashes", "model_root_hash", "sampling", "cache_salt", "block_nbytes", "deadline_s", "sender_id", "transfer_path", "receiver_id", "first_token_at_end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MODEL_ROOT_HASH_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_PATH_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_AT_END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    model_root_hash: bytes
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    block_nbytes: int
    deadline_s: float
    sender_id: str
    transfer_path: str
    receiver_id: str
    first_token_at_end: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., model_root_hash: _Optional[bytes] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., block_nbytes: _Optional[int] = ..., deadline_s: _Optional[float] = ..., sender_id: _Optional[str] = ..., transfer_path: _Optional[str] = ..., receiver_id: _Optional[str] = ..., first_token_at_end: _Optional[bool] = ...) -> None: ...

class BlockData(_message.Message):
    __slots__ = ("meta", "data")
    META_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    meta: bytes
    data: bytes
    def __init__(self, meta: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class TransferEnd(_message.Message):
    __slots__ = ("first_token_id",)
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    def __init__(self, first_token_id: _Optional[int] = ...) -> None: ...

class FetchBlocksResponse(_message.Message):
    __slots__ = ("meta", "data", "blocks_sent", "transfer_path")
    META_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_PATH_FIELD_NUMBER: _ClassVar[int]
    meta: bytes
    data: bytes
    blocks_sent: int
    transfer_path: str
    def __init__(self, meta: _Optional[bytes] = ..., data: _Optional[bytes] = ..., blocks_sent: _Optional[int] = ..., transfer_path: _Optional[str] = ...) -> None: ...

class TransferKVResponse(_message.Message):
    __slots__ = ("missing", "done", "blocks_reused", "ticket")
    MISSING_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REUSED_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    missing: _containers.RepeatedScalarFieldContainer[int]
    done: bool
    blocks_reused: int
    ticket: bytes
    def __init__(self, missing: _Optional[_Iterable[int]] = ..., done: _Optional[bool] = ..., blocks_reused: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class GenerateOnNodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class RelayCommand(_message.Message):
    __slots__ = ("decode", "generate", "cancel", "lease", "deadline_s", "trace")
    class TraceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DECODE_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    decode: DecodeRequest
    generate: GenerateOnNodeRequest
    cancel: str
    lease: RelayLease
    deadline_s: float
    trace: _containers.ScalarMap[str, str]
    def __init__(self, decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., generate: _Optional[_Union[GenerateOnNodeRequest, _Mapping]] = ..., cancel: _Optional[str] = ..., lease: _Optional[_Union[RelayLease, _Mapping]] = ..., deadline_s: _Optional[float] = ..., trace: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RelayOutput(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "cached_tokens", "error_code", "error_message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    cached_tokens: int
    error_code: int
    error_message: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class RelayBatch(_message.Message):
    __slots__ = ("outputs", "grant")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[RelayOutput]
    grant: RelayGrant
    def __init__(self, outputs: _Optional[_Iterable[_Union[RelayOutput, _Mapping]]] = ..., grant: _Optional[_Union[RelayGrant, _Mapping]] = ...) -> None: ...

class RelayLease(_message.Message):
    __slots__ = ("want_ppm", "used_ppm", "seen_grant")
    WANT_PPM_FIELD_NUMBER: _ClassVar[int]
    USED_PPM_FIELD_NUMBER: _ClassVar[int]
    SEEN_GRANT_FIELD_NUMBER: _ClassVar[int]
    want_ppm: int
    used_ppm: int
    seen_grant: int
    def __init__(self, want_ppm: _Optional[int] = ..., used_ppm: _Optional[int] = ..., seen_grant: _Optional[int] = ...) -> None: ...

class RelayGrant(_message.Message):
    __slots__ = ("share_ppm", "seq")
    SHARE_PPM_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    share_ppm: int
    seq: int
    def __init__(self, share_ppm: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("role", "num_blocks", "num_free_blocks", "num_cached_blocks", "running", "waiting", "pending_transfers", "counters", "model_root_hash", "model_identity", "prefill_tokens_waiting", "transfer_endpoint", "max_num_seqs", "kv_tokens_held", "kv_token_slots", "max_num_batched_tokens", "relay_leases", "tier_block_load_s")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class TierBlockLoadSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PENDING_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ROOT_HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_WAITING_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_HELD_FIELD_NUMBER: _ClassVar[int]
    KV_TOKEN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELAY_LEASES_FIELD_NUMBER: _ClassVar[int]
    TIER_BLOCK_LOAD_S_FIELD_NUMBER: _ClassVar[int]
    role: str
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    running: int
    waiting: int
    pending_transfers: int
    counters: _containers.ScalarMap[str, float]
    model_root_hash: bytes
    model_identity: str
    prefill_tokens_waiting: int
    transfer_endpoint: bytes
    max_num_seqs: int
    kv_tokens_held: int
    kv_token_slots: int
    max_num_batched_tokens: int
    relay_leases: bool
    tier_block_load_s: _containers.ScalarMap[str, float]
    def __init__(self, role: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., pending_transfers: _Optional[int] = ..., counters: _Optional[_Mapping[str, float]] = ..., model_root_hash: _Optional[bytes] = ..., model_identity: _Optional[str] = ..., prefill_tokens_waiting: _Optional[int] = ..., transfer_endpoint: _Optional[bytes] = ..., max_num_seqs: _Optional[int] = ..., kv_tokens_held: _Optional[int] = ..., kv_token_slots: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., relay_leases: _Optional[bool] = ..., tier_block_load_s: _Optional[_Mapping[str, float]] = ...) -> None: ...
