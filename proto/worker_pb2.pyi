from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GraphMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRAPH_MODE_UNSPECIFIED: _ClassVar[GraphMode]
    GRAPH_MODE_NONE: _ClassVar[GraphMode]
    GRAPH_MODE_PIECEWISE: _ClassVar[GraphMode]
    GRAPH_MODE_FULL: _ClassVar[GraphMode]
    GRAPH_MODE_FULL_DECODE_ONLY: _ClassVar[GraphMode]
    GRAPH_MODE_FULL_AND_PIECEWISE: _ClassVar[GraphMode]

class FallbackReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FALLBACK_REASON_UNSPECIFIED: _ClassVar[FallbackReason]
    FALLBACK_REASON_EXCEEDS_MAX_CAPTURE_SIZE: _ClassVar[FallbackReason]
    FALLBACK_REASON_SIZE_OVER_BUDGET: _ClassVar[FallbackReason]
    FALLBACK_REASON_SIZE_CAPTURE_FAILED: _ClassVar[FallbackReason]
    FALLBACK_REASON_MODE_EXCLUDES_STEP: _ClassVar[FallbackReason]
    FALLBACK_REASON_TENANT_DISABLED: _ClassVar[FallbackReason]
    FALLBACK_REASON_BACKEND_UNSUPPORTED: _ClassVar[FallbackReason]
    FALLBACK_REASON_RECAPTURING: _ClassVar[FallbackReason]
    FALLBACK_REASON_GRAPH_RELEASED_IDLE: _ClassVar[FallbackReason]
    FALLBACK_REASON_SIZE_OVER_MAX_GRAPHS: _ClassVar[FallbackReason]
    FALLBACK_REASON_COMPUTE_BOUND: _ClassVar[FallbackReason]

class LifecycleState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LIFECYCLE_STATE_UNSPECIFIED: _ClassVar[LifecycleState]
    LIFECYCLE_STATE_LOADING: _ClassVar[LifecycleState]
    LIFECYCLE_STATE_MODEL_LOADED: _ClassVar[LifecycleState]
    LIFECYCLE_STATE_WARMED: _ClassVar[LifecycleState]
    LIFECYCLE_STATE_CAPTURED: _ClassVar[LifecycleState]
    LIFECYCLE_STATE_READY: _ClassVar[LifecycleState]
    LIFECYCLE_STATE_RECAPTURING: _ClassVar[LifecycleState]
    LIFECYCLE_STATE_DRAINING: _ClassVar[LifecycleState]
    LIFECYCLE_STATE_SLEEPING: _ClassVar[LifecycleState]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class CaptureLadder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CAPTURE_LADDER_UNSPECIFIED: _ClassVar[CaptureLadder]
    CAPTURE_LADDER_DEFAULT: _ClassVar[CaptureLadder]
    CAPTURE_LADDER_INTERACTIVITY: _ClassVar[CaptureLadder]

class TenantGraphs(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENANT_GRAPHS_UNSPECIFIED: _ClassVar[TenantGraphs]
    TENANT_GRAPHS_ENABLED: _ClassVar[TenantGraphs]
    TENANT_GRAPHS_DISABLED: _ClassVar[TenantGraphs]

class LedgerStage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEDGER_STAGE_UNSPECIFIED: _ClassVar[LedgerStage]
    LEDGER_STAGE_CONTEXT: _ClassVar[LedgerStage]
    LEDGER_STAGE_WEIGHTS: _ClassVar[LedgerStage]
    LEDGER_STAGE_KV_CACHE: _ClassVar[LedgerStage]
    LEDGER_STAGE_WARMUP: _ClassVar[LedgerStage]
    LEDGER_STAGE_CAPTURE: _ClassVar[LedgerStage]
    LEDGER_STAGE_STEADY: _ClassVar[LedgerStage]
GRAPH_MODE_UNSPECIFIED: GraphMode
GRAPH_MODE_NONE: GraphMode
GRAPH_MODE_PIECEWISE: GraphMode
GRAPH_MODE_FULL: GraphMode
GRAPH_MODE_FULL_DECODE_ONLY: GraphMode
GRAPH_MODE_FULL_AND_PIECEWISE: GraphMode
FALLBACK_REASON_UNSPECIFIED: FallbackReason
FALLBACK_REASON_EXCEEDS_MAX_CAPTURE_SIZE: FallbackReason
FALLBACK_REASON_SIZE_OVER_BUDGET: FallbackReason
FALLBACK_REASON_SIZE_CAPTURE_FAILED: FallbackReason
FALLBACK_REASON_MODE_EXCLUDES_STEP: FallbackReason
FALLBACK_REASON_TENANT_DISABLED: FallbackReason
FALLBACK_REASON_BACKEND_UNSUPPORTED: FallbackReason
FALLBACK_REASON_RECAPTURING: FallbackReason
FALLBACK_REASON_GRAPH_RELEASED_IDLE: FallbackReason
FALLBACK_REASON_SIZE_OVER_MAX_GRAPHS: FallbackReason
FALLBACK_REASON_COMPUTE_BOUND: FallbackReason
LIFECYCLE_STATE_UNSPECIFIED: LifecycleState
LIFECYCLE_STATE_LOADING: LifecycleState
LIFECYCLE_STATE_MODEL_LOADED: LifecycleState
LIFECYCLE_STATE_WARMED: LifecycleState
LIFECYCLE_STATE_CAPTURED: LifecycleState
LIFECYCLE_STATE_READY: LifecycleState
LIFECYCLE_STATE_RECAPTURING: LifecycleState
LIFECYCLE_STATE_DRAINING: LifecycleState
LIFECYCLE_STATE_SLEEPING: LifecycleState
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
CAPTURE_LADDER_UNSPECIFIED: CaptureLadder
CAPTURE_LADDER_DEFAULT: CaptureLadder
CAPTURE_LADDER_INTERACTIVITY: CaptureLadder
TENANT_GRAPHS_UNSPECIFIED: TenantGraphs
TENANT_GRAPHS_ENABLED: TenantGraphs
TENANT_GRAPHS_DISABLED: TenantGraphs
LEDGER_STAGE_UNSPECIFIED: LedgerStage
LEDGER_STAGE_CONTEXT: LedgerStage
LEDGER_STAGE_WEIGHTS: LedgerStage
LEDGER_STAGE_KV_CACHE: LedgerStage
LEDGER_STAGE_WARMUP: LedgerStage
LEDGER_STAGE_CAPTURE: LedgerStage
LEDGER_STAGE_STEADY: LedgerStage

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "logprobs", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: int
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class OutputConstraint(_message.Message):
    __slots__ = ("json_schema", "json_object")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ...) -> None: ...

class StoppingCriteria(_message.Message):
    __slots__ = ("max_new_tokens", "stop_token_ids", "ignore_eos")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "tenant", "prompt_token_ids", "sampling", "stopping", "prompt_text", "messages", "constraint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    stopping: StoppingCriteria
    prompt_text: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    constraint: OutputConstraint
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stopping: _Optional[_Union[StoppingCriteria, _Mapping]] = ..., prompt_text: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., constraint: _Optional[_Union[OutputConstraint, _Mapping]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "completion")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenChunk
    completion: Completion
    def __init__(self, tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., completion: _Optional[_Union[Completion, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("request_id", "finish_reason", "prompt_tokens", "generated_tokens", "time_to_first_token_seconds", "total_seconds", "execution", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    time_to_first_token_seconds: float
    total_seconds: float
    execution: ExecutionSummary
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., time_to_first_token_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ..., execution: _Optional[_Union[ExecutionSummary, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class ExecutionSummary(_message.Message):
    __slots__ = ("graph_steps", "eager_steps", "preemptions", "cached_prompt_tokens")
    GRAPH_STEPS_FIELD_NUMBER: _ClassVar[int]
    EAGER_STEPS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    graph_steps: _containers.RepeatedCompositeFieldContainer[GraphStepCount]
    eager_steps: _containers.RepeatedCompositeFieldContainer[FallbackCount]
    preemptions: int
    cached_prompt_tokens: int
    def __init__(self, graph_steps: _Optional[_Iterable[_Union[GraphStepCount, _Mapping]]] = ..., eager_steps: _Optional[_Iterable[_Union[FallbackCount, _Mapping]]] = ..., preemptions: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GraphStepCount(_message.Message):
    __slots__ = ("mode", "size", "steps")
    MODE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    mode: GraphMode
    size: int
    steps: int
    def __init__(self, mode: _Optional[_Union[GraphMode, str]] = ..., size: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class FallbackCount(_message.Message):
    __slots__ = ("reason", "steps")
    REASON_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    reason: FallbackReason
    steps: int
    def __init__(self, reason: _Optional[_Union[FallbackReason, str]] = ..., steps: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("source", "revision", "architecture", "dtype", "vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "max_seq_len", "max_num_seqs", "eos_token_id", "device", "parameter_count", "eos_token_ids", "model_context_length", "tokenizer", "chat_template", "step_budget", "tensor_parallel_size")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KEY_VALUE_HEADS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_COUNT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    STEP_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    source: str
    revision: str
    architecture: str
    dtype: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_seq_len: int
    max_num_seqs: int
    eos_token_id: int
    device: str
    parameter_count: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    model_context_length: int
    tokenizer: bool
    chat_template: bool
    step_budget: StepBudgetStatus
    tensor_parallel_size: int
    def __init__(self, source: _Optional[str] = ..., revision: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_key_value_heads: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., device: _Optional[str] = ..., parameter_count: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., model_context_length: _Optional[int] = ..., tokenizer: _Optional[bool] = ..., chat_template: _Optional[bool] = ..., step_budget: _Optional[_Union[StepBudgetStatus, _Mapping]] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class WatchGraphStatusRequest(_message.Message):
    __slots__ = ("heartbeat_seconds",)
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_seconds: int
    def __init__(self, heartbeat_seconds: _Optional[int] = ...) -> None: ...

class CaptureSizes(_message.Message):
    __slots__ = ("explicit", "ladder", "max_capture_size")
    EXPLICIT_FIELD_NUMBER: _ClassVar[int]
    LADDER_FIELD_NUMBER: _ClassVar[int]
    MAX_CAPTURE_SIZE_FIELD_NUMBER: _ClassVar[int]
    explicit: ExplicitSizes
    ladder: CaptureLadder
    max_capture_size: int
    def __init__(self, explicit: _Optional[_Union[ExplicitSizes, _Mapping]] = ..., ladder: _Optional[_Union[CaptureLadder, str]] = ..., max_capture_size: _Optional[int] = ...) -> None: ...

class ExplicitSizes(_message.Message):
    __slots__ = ("sizes",)
    SIZES_FIELD_NUMBER: _ClassVar[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class TenantToggle(_message.Message):
    __slots__ = ("tenant", "graphs")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    graphs: TenantGraphs
    def __init__(self, tenant: _Optional[str] = ..., graphs: _Optional[_Union[TenantGraphs, str]] = ...) -> None: ...

class GraphPolicy(_message.Message):
    __slots__ = ("policy_uid", "policy_name", "generation", "mode", "capture_sizes", "memory_budget_bytes", "tenants", "default_tenant_graphs", "max_graphs", "idle_release_seconds", "sleep_after_idle_seconds", "sleep_level")
    POLICY_UID_FIELD_NUMBER: _ClassVar[int]
    POLICY_NAME_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_SIZES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TENANT_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    IDLE_RELEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SLEEP_AFTER_IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    policy_uid: str
    policy_name: str
    generation: int
    mode: GraphMode
    capture_sizes: CaptureSizes
    memory_budget_bytes: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantToggle]
    default_tenant_graphs: TenantGraphs
    max_graphs: int
    idle_release_seconds: int
    sleep_after_idle_seconds: int
    sleep_level: int
    def __init__(self, policy_uid: _Optional[str] = ..., policy_name: _Optional[str] = ..., generation: _Optional[int] = ..., mode: _Optional[_Union[GraphMode, str]] = ..., capture_sizes: _Optional[_Union[CaptureSizes, _Mapping]] = ..., memory_budget_bytes: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantToggle, _Mapping]]] = ..., default_tenant_graphs: _Optional[_Union[TenantGraphs, str]] = ..., max_graphs: _Optional[int] = ..., idle_release_seconds: _Optional[int] = ..., sleep_after_idle_seconds: _Optional[int] = ..., sleep_level: _Optional[int] = ...) -> None: ...

class ApplyGraphPolicyRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: GraphPolicy
    def __init__(self, policy: _Optional[_Union[GraphPolicy, _Mapping]] = ...) -> None: ...

class ApplyGraphPolicyResponse(_message.Message):
    __slots__ = ("applied_generation", "recapture_started", "unchanged")
    APPLIED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    RECAPTURE_STARTED_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    applied_generation: int
    recapture_started: bool
    unchanged: bool
    def __init__(self, applied_generation: _Optional[int] = ..., recapture_started: _Optional[bool] = ..., unchanged: _Optional[bool] = ...) -> None: ...

class GetGraphStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CapturedSize(_message.Message):
    __slots__ = ("size", "mode", "capture_seconds", "device_bytes", "reserved_bytes", "replay_seconds", "eager_seconds", "replays", "padded_tokens", "released")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EAGER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_FIELD_NUMBER: _ClassVar[int]
    PADDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    size: int
    mode: GraphMode
    capture_seconds: float
    device_bytes: int
    reserved_bytes: int
    replay_seconds: float
    eager_seconds: float
    replays: int
    padded_tokens: int
    released: bool
    def __init__(self, size: _Optional[int] = ..., mode: _Optional[_Union[GraphMode, str]] = ..., capture_seconds: _Optional[float] = ..., device_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., replay_seconds: _Optional[float] = ..., eager_seconds: _Optional[float] = ..., replays: _Optional[int] = ..., padded_tokens: _Optional[int] = ..., released: _Optional[bool] = ...) -> None: ...

class SkippedSize(_message.Message):
    __slots__ = ("size", "mode", "reason", "message", "eager_seconds")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EAGER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    size: int
    mode: GraphMode
    reason: FallbackReason
    message: str
    eager_seconds: float
    def __init__(self, size: _Optional[int] = ..., mode: _Optional[_Union[GraphMode, str]] = ..., reason: _Optional[_Union[FallbackReason, str]] = ..., message: _Optional[str] = ..., eager_seconds: _Optional[float] = ...) -> None: ...

class LedgerEntry(_message.Message):
    __slots__ = ("stage", "device_used_bytes", "torch_allocated_bytes", "torch_reserved_bytes", "residual_bytes", "generation")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TORCH_ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TORCH_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    stage: LedgerStage
    device_used_bytes: int
    torch_allocated_bytes: int
    torch_reserved_bytes: int
    residual_bytes: int
    generation: int
    def __init__(self, stage: _Optional[_Union[LedgerStage, str]] = ..., device_used_bytes: _Optional[int] = ..., torch_allocated_bytes: _Optional[int] = ..., torch_reserved_bytes: _Optional[int] = ..., residual_bytes: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class GraphStatus(_message.Message):
    __slots__ = ("state", "requested_mode", "effective_mode", "mode_downgrade_reason", "policy_uid", "policy_generation", "model_revision", "captured", "skipped", "fallbacks", "graph_steps", "eager_steps", "graph_memory_bytes", "total_capture_seconds", "ledger", "running_sequences", "queued_requests", "last_error", "pending_policy_uid", "pending_policy_generation", "pending_model_revision", "compile", "traffic", "kv_cache", "capture_parts", "previous_ledger", "serving", "step_budget", "startup", "sleep", "tensor_parallel_size")
    STATE_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_MODE_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_MODE_FIELD_NUMBER: _ClassVar[int]
    MODE_DOWNGRADE_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_UID_FIELD_NUMBER: _ClassVar[int]
    POLICY_GENERATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    CAPTURED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_STEPS_FIELD_NUMBER: _ClassVar[int]
    EAGER_STEPS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CAPTURE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    PENDING_POLICY_UID_FIELD_NUMBER: _ClassVar[int]
    PENDING_POLICY_GENERATION_FIELD_NUMBER: _ClassVar[int]
    PENDING_MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    COMPILE_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_PARTS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_LEDGER_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    STEP_BUDGET_FIELD_NUMBER: _ClassVar[int]
    STARTUP_FIELD_NUMBER: _ClassVar[int]
    SLEEP_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    state: LifecycleState
    requested_mode: GraphMode
    effective_mode: GraphMode
    mode_downgrade_reason: str
    policy_uid: str
    policy_generation: int
    model_revision: str
    captured: _containers.RepeatedCompositeFieldContainer[CapturedSize]
    skipped: _containers.RepeatedCompositeFieldContainer[SkippedSize]
    fallbacks: _containers.RepeatedCompositeFieldContainer[FallbackCount]
    graph_steps: int
    eager_steps: int
    graph_memory_bytes: int
    total_capture_seconds: float
    ledger: _containers.RepeatedCompositeFieldContainer[LedgerEntry]
    running_sequences: int
    queued_requests: int
    last_error: str
    pending_policy_uid: str
    pending_policy_generation: int
    pending_model_revision: str
    compile: CompileStatus
    traffic: StepHistogram
    kv_cache: KVCacheStatus
    capture_parts: _containers.RepeatedCompositeFieldContainer[CapturePart]
    previous_ledger: _containers.RepeatedCompositeFieldContainer[LedgerEntry]
    serving: ServingCounters
    step_budget: StepBudgetStatus
    startup: StartupStatus
    sleep: SleepStatus
    tensor_parallel_size: int
    def __init__(self, state: _Optional[_Union[LifecycleState, str]] = ..., requested_mode: _Optional[_Union[GraphMode, str]] = ..., effective_mode: _Optional[_Union[GraphMode, str]] = ..., mode_downgrade_reason: _Optional[str] = ..., policy_uid: _Optional[str] = ..., policy_generation: _Optional[int] = ..., model_revision: _Optional[str] = ..., captured: _Optional[_Iterable[_Union[CapturedSize, _Mapping]]] = ..., skipped: _Optional[_Iterable[_Union[SkippedSize, _Mapping]]] = ..., fallbacks: _Optional[_Iterable[_Union[FallbackCount, _Mapping]]] = ..., graph_steps: _Optional[int] = ..., eager_steps: _Optional[int] = ..., graph_memory_bytes: _Optional[int] = ..., total_capture_seconds: _Optional[float] = ..., ledger: _Optional[_Iterable[_Union[LedgerEntry, _Mapping]]] = ..., running_sequences: _Optional[int] = ..., queued_requests: _Optional[int] = ..., last_error: _Optional[str] = ..., pending_policy_uid: _Optional[str] = ..., pending_policy_generation: _Optional[int] = ..., pending_model_revision: _Optional[str] = ..., compile: _Optional[_Union[CompileStatus, _Mapping]] = ..., traffic: _Optional[_Union[StepHistogram, _Mapping]] = ..., kv_cache: _Optional[_Union[KVCacheStatus, _Mapping]] = ..., capture_parts: _Optional[_Iterable[_Union[CapturePart, _Mapping]]] = ..., previous_ledger: _Optional[_Iterable[_Union[LedgerEntry, _Mapping]]] = ..., serving: _Optional[_Union[ServingCounters, _Mapping]] = ..., step_budget: _Optional[_Union[StepBudgetStatus, _Mapping]] = ..., startup: _Optional[_Union[StartupStatus, _Mapping]] = ..., sleep: _Optional[_Union[SleepStatus, _Mapping]] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class SleepStatus(_message.Message):
    __slots__ = ("level", "pending_level", "since_unix_seconds", "released_bytes", "sleeps", "wakes", "last_wake_seconds", "unavailable_reason")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    PENDING_LEVEL_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLEEPS_FIELD_NUMBER: _ClassVar[int]
    WAKES_FIELD_NUMBER: _ClassVar[int]
    LAST_WAKE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_REASON_FIELD_NUMBER: _ClassVar[int]
    level: int
    pending_level: int
    since_unix_seconds: float
    released_bytes: int
    sleeps: int
    wakes: int
    last_wake_seconds: float
    unavailable_reason: str
    def __init__(self, level: _Optional[int] = ..., pending_level: _Optional[int] = ..., since_unix_seconds: _Optional[float] = ..., released_bytes: _Optional[int] = ..., sleeps: _Optional[int] = ..., wakes: _Optional[int] = ..., last_wake_seconds: _Optional[float] = ..., unavailable_reason: _Optional[str] = ...) -> None: ...

class StepBudgetStatus(_message.Message):
    __slots__ = ("tokens", "tokens_with_decode", "itl_target_seconds", "source", "tokens_source", "itl_max_seconds", "ttft_target_seconds", "tokens_stretched", "guard_source")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_WITH_DECODE_FIELD_NUMBER: _ClassVar[int]
    ITL_TARGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SOURCE_FIELD_NUMBER: _ClassVar[int]
    ITL_MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TTFT_TARGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_STRETCHED_FIELD_NUMBER: _ClassVar[int]
    GUARD_SOURCE_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    tokens_with_decode: int
    itl_target_seconds: float
    source: str
    tokens_source: str
    itl_max_seconds: float
    ttft_target_seconds: float
    tokens_stretched: int
    guard_source: str
    def __init__(self, tokens: _Optional[int] = ..., tokens_with_decode: _Optional[int] = ..., itl_target_seconds: _Optional[float] = ..., source: _Optional[str] = ..., tokens_source: _Optional[str] = ..., itl_max_seconds: _Optional[float] = ..., ttft_target_seconds: _Optional[float] = ..., tokens_stretched: _Optional[int] = ..., guard_source: _Optional[str] = ...) -> None: ...

class StartupStatus(_message.Message):
    __slots__ = ("stages", "ready_seconds", "started_unix_seconds", "compile_cache", "tuning_cache", "caches")
    STAGES_FIELD_NUMBER: _ClassVar[int]
    READY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPILE_CACHE_FIELD_NUMBER: _ClassVar[int]
    TUNING_CACHE_FIELD_NUMBER: _ClassVar[int]
    CACHES_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedCompositeFieldContainer[StartupStage]
    ready_seconds: float
    started_unix_seconds: float
    compile_cache: str
    tuning_cache: str
    caches: str
    def __init__(self, stages: _Optional[_Iterable[_Union[StartupStage, _Mapping]]] = ..., ready_seconds: _Optional[float] = ..., started_unix_seconds: _Optional[float] = ..., compile_cache: _Optional[str] = ..., tuning_cache: _Optional[str] = ..., caches: _Optional[str] = ...) -> None: ...

class StartupStage(_message.Message):
    __slots__ = ("stage", "seconds")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    seconds: float
    def __init__(self, stage: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class ServingCounters(_message.Message):
    __slots__ = ("generated_tokens", "sequence_seconds", "graph_steps", "eager_steps", "replayed_tokens", "padded_tokens", "itl_bounds_seconds", "itl_counts", "since_unix_seconds")
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_STEPS_FIELD_NUMBER: _ClassVar[int]
    EAGER_STEPS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PADDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ITL_BOUNDS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ITL_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    generated_tokens: int
    sequence_seconds: float
    graph_steps: int
    eager_steps: int
    replayed_tokens: int
    padded_tokens: int
    itl_bounds_seconds: _containers.RepeatedScalarFieldContainer[float]
    itl_counts: _containers.RepeatedScalarFieldContainer[int]
    since_unix_seconds: float
    def __init__(self, generated_tokens: _Optional[int] = ..., sequence_seconds: _Optional[float] = ..., graph_steps: _Optional[int] = ..., eager_steps: _Optional[int] = ..., replayed_tokens: _Optional[int] = ..., padded_tokens: _Optional[int] = ..., itl_bounds_seconds: _Optional[_Iterable[float]] = ..., itl_counts: _Optional[_Iterable[int]] = ..., since_unix_seconds: _Optional[float] = ...) -> None: ...

class CapturePart(_message.Message):
    __slots__ = ("part", "seconds")
    PART_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    part: str
    seconds: float
    def __init__(self, part: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class StepShape(_message.Message):
    __slots__ = ("num_tokens", "num_seqs", "uniform_decode", "steps")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    UNIFORM_DECODE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    num_seqs: int
    uniform_decode: bool
    steps: int
    def __init__(self, num_tokens: _Optional[int] = ..., num_seqs: _Optional[int] = ..., uniform_decode: _Optional[bool] = ..., steps: _Optional[int] = ...) -> None: ...

class StepHistogram(_message.Message):
    __slots__ = ("shapes", "steps", "overflow_steps", "since_unix_seconds", "policy_uid", "policy_generation")
    SHAPES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_UID_FIELD_NUMBER: _ClassVar[int]
    POLICY_GENERATION_FIELD_NUMBER: _ClassVar[int]
    shapes: _containers.RepeatedCompositeFieldContainer[StepShape]
    steps: int
    overflow_steps: int
    since_unix_seconds: float
    policy_uid: str
    policy_generation: int
    def __init__(self, shapes: _Optional[_Iterable[_Union[StepShape, _Mapping]]] = ..., steps: _Optional[int] = ..., overflow_steps: _Optional[int] = ..., since_unix_seconds: _Optional[float] = ..., policy_uid: _Optional[str] = ..., policy_generation: _Optional[int] = ...) -> None: ...

class KVCacheStatus(_message.Message):
    __slots__ = ("block_size", "blocks_total", "blocks_used", "blocks_cached", "prefix_caching", "prefix_query_tokens", "prefix_hit_tokens", "preemptions", "bytes", "sizing", "planned_bytes", "free_after_capture_bytes")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZING_FIELD_NUMBER: _ClassVar[int]
    PLANNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_AFTER_CAPTURE_BYTES_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_cached: int
    prefix_caching: bool
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    bytes: int
    sizing: str
    planned_bytes: int
    free_after_capture_bytes: int
    def __init__(self, block_size: _Optional[int] = ..., blocks_total: _Optional[int] = ..., blocks_used: _Optional[int] = ..., blocks_cached: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., preemptions: _Optional[int] = ..., bytes: _Optional[int] = ..., sizing: _Optional[str] = ..., planned_bytes: _Optional[int] = ..., free_after_capture_bytes: _Optional[int] = ...) -> None: ...

class CompileStatus(_message.Message):
    __slots__ = ("optimization_level", "enabled", "reason", "cache", "cache_key", "seconds", "compiled_graphs", "kernels", "quantization")
    OPTIMIZATION_LEVEL_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPILED_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    optimization_level: int
    enabled: bool
    reason: str
    cache: str
    cache_key: str
    seconds: float
    compiled_graphs: int
    kernels: str
    quantization: str
    def __init__(self, optimization_level: _Optional[int] = ..., enabled: _Optional[bool] = ..., reason: _Optional[str] = ..., cache: _Optional[str] = ..., cache_key: _Optional[str] = ..., seconds: _Optional[float] = ..., compiled_graphs: _Optional[int] = ..., kernels: _Optional[str] = ..., quantization: _Optional[str] = ...) -> None: ...

class LoadModelRevisionRequest(_message.Message):
    __slots__ = ("source", "revision")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    source: str
    revision: str
    def __init__(self, source: _Optional[str] = ..., revision: _Optional[str] = ...) -> None: ...

class LoadModelRevisionResponse(_message.Message):
    __slots__ = ("revision", "recapture_started")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    RECAPTURE_STARTED_FIELD_NUMBER: _ClassVar[int]
    revision: str
    recapture_started: bool
    def __init__(self, revision: _Optional[str] = ..., recapture_started: _Optional[bool] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ("level", "released_bytes", "seconds", "already_asleep", "context_offloaded", "context_note")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_ASLEEP_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_NOTE_FIELD_NUMBER: _ClassVar[int]
    level: int
    released_bytes: int
    seconds: float
    already_asleep: bool
    context_offloaded: bool
    context_note: str
    def __init__(self, level: _Optional[int] = ..., released_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., already_asleep: _Optional[bool] = ..., context_offloaded: _Optional[bool] = ..., context_note: _Optional[str] = ...) -> None: ...

class WakeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeResponse(_message.Message):
    __slots__ = ("level", "restored_bytes", "seconds", "was_asleep", "withdrew_sleep")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    RESTORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAS_ASLEEP_FIELD_NUMBER: _ClassVar[int]
    WITHDREW_SLEEP_FIELD_NUMBER: _ClassVar[int]
    level: int
    restored_bytes: int
    seconds: float
    was_asleep: bool
    withdrew_sleep: bool
    def __init__(self, level: _Optional[int] = ..., restored_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., was_asleep: _Optional[bool] = ..., withdrew_sleep: _Optional[bool] = ...) -> None: ...
