from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_VALIDATING: _ClassVar[JobState]
    JOB_STATE_IN_PROGRESS: _ClassVar[JobState]
    JOB_STATE_FINALIZING: _ClassVar[JobState]
    JOB_STATE_COMPLETED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLING: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]

class ResultKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESULT_KIND_UNSPECIFIED: _ClassVar[ResultKind]
    RESULT_KIND_OUTPUT: _ClassVar[ResultKind]
    RESULT_KIND_ERROR: _ClassVar[ResultKind]
    RESULT_KIND_ALL: _ClassVar[ResultKind]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_VALIDATING: JobState
JOB_STATE_IN_PROGRESS: JobState
JOB_STATE_FINALIZING: JobState
JOB_STATE_COMPLETED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLING: JobState
JOB_STATE_CANCELLED: JobState
RESULT_KIND_UNSPECIFIED: ResultKind
RESULT_KIND_OUTPUT: ResultKind
RESULT_KIND_ERROR: ResultKind
RESULT_KIND_ALL: ResultKind

class RequestCounts(_message.Message):
    __slots__ = ("total", "completed", "failed")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    total: int
    completed: int
    failed: int
    def __init__(self, total: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class QueueDepth(_message.Message):
    __slots__ = ("groups_waiting", "groups_leased", "depth")
    GROUPS_WAITING_FIELD_NUMBER: _ClassVar[int]
    GROUPS_LEASED_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    groups_waiting: int
    groups_leased: int
    depth: int
    def __init__(self, groups_waiting: _Optional[int] = ..., groups_leased: _Optional[int] = ..., depth: _Optional[int] = ...) -> None: ...

class JobError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "idempotency_key", "model", "state", "request_counts", "queue", "groups_total", "groups_done", "prefix_tokens_saved", "prompt_tokens", "completion_tokens", "created_at", "in_progress_at", "finished_at", "error", "metadata", "plan", "dry_run", "eta_s")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_COUNTS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GROUPS_DONE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_SAVED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    IN_PROGRESS_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    ETA_S_FIELD_NUMBER: _ClassVar[int]
    id: str
    idempotency_key: str
    model: str
    state: JobState
    request_counts: RequestCounts
    queue: QueueDepth
    groups_total: int
    groups_done: int
    prefix_tokens_saved: int
    prompt_tokens: int
    completion_tokens: int
    created_at: float
    in_progress_at: float
    finished_at: float
    error: JobError
    metadata: _containers.ScalarMap[str, str]
    plan: JobPlan
    dry_run: bool
    eta_s: float
    def __init__(self, id: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., model: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., request_counts: _Optional[_Union[RequestCounts, _Mapping]] = ..., queue: _Optional[_Union[QueueDepth, _Mapping]] = ..., groups_total: _Optional[int] = ..., groups_done: _Optional[int] = ..., prefix_tokens_saved: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., created_at: _Optional[float] = ..., in_progress_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., error: _Optional[_Union[JobError, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., plan: _Optional[_Union[JobPlan, _Mapping]] = ..., dry_run: _Optional[bool] = ..., eta_s: _Optional[float] = ...) -> None: ...

class PlanOptions(_message.Message):
    __slots__ = ("gpu", "gpus", "tensor_parallel_size", "quantization", "kv_cache_dtype", "price_per_gpu_hour", "mean_output_tokens")
    GPU_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PRICE_PER_GPU_HOUR_FIELD_NUMBER: _ClassVar[int]
    MEAN_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    gpu: str
    gpus: int
    tensor_parallel_size: int
    quantization: str
    kv_cache_dtype: str
    price_per_gpu_hour: float
    mean_output_tokens: float
    def __init__(self, gpu: _Optional[str] = ..., gpus: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., quantization: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., price_per_gpu_hour: _Optional[float] = ..., mean_output_tokens: _Optional[float] = ...) -> None: ...

class JobPlan(_message.Message):
    __slots__ = ("requests", "invalid_lines", "prompt_tokens", "prefill_tokens", "saved_share", "groups", "grouped_requests", "group_sizes", "largest_group", "output_tokens", "output_tokens_low", "output_tokens_high", "output_exact", "mean_output_tokens", "devices")
    class GroupSizesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INVALID_LINES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAVED_SHARE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    GROUPED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZES_FIELD_NUMBER: _ClassVar[int]
    LARGEST_GROUP_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_LOW_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_HIGH_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_EXACT_FIELD_NUMBER: _ClassVar[int]
    MEAN_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    requests: int
    invalid_lines: int
    prompt_tokens: int
    prefill_tokens: int
    saved_share: float
    groups: int
    grouped_requests: int
    group_sizes: _containers.ScalarMap[str, int]
    largest_group: int
    output_tokens: int
    output_tokens_low: int
    output_tokens_high: int
    output_exact: bool
    mean_output_tokens: float
    devices: _containers.RepeatedCompositeFieldContainer[DevicePlan]
    def __init__(self, requests: _Optional[int] = ..., invalid_lines: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., saved_share: _Optional[float] = ..., groups: _Optional[int] = ..., grouped_requests: _Optional[int] = ..., group_sizes: _Optional[_Mapping[str, int]] = ..., largest_group: _Optional[int] = ..., output_tokens: _Optional[int] = ..., output_tokens_low: _Optional[int] = ..., output_tokens_high: _Optional[int] = ..., output_exact: _Optional[bool] = ..., mean_output_tokens: _Optional[float] = ..., devices: _Optional[_Iterable[_Union[DevicePlan, _Mapping]]] = ...) -> None: ...

class DevicePlan(_message.Message):
    __slots__ = ("kind", "unavailable", "gpus", "tensor_parallel_size", "prefill_s", "decode_s", "gpu_hours", "wall_s", "wall_s_low", "wall_s_high", "cost", "calibration", "borrowed")
    KIND_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    GPU_HOURS_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    WALL_S_LOW_FIELD_NUMBER: _ClassVar[int]
    WALL_S_HIGH_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    BORROWED_FIELD_NUMBER: _ClassVar[int]
    kind: str
    unavailable: str
    gpus: int
    tensor_parallel_size: int
    prefill_s: float
    decode_s: float
    gpu_hours: float
    wall_s: float
    wall_s_low: float
    wall_s_high: float
    cost: float
    calibration: str
    borrowed: bool
    def __init__(self, kind: _Optional[str] = ..., unavailable: _Optional[str] = ..., gpus: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., prefill_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., gpu_hours: _Optional[float] = ..., wall_s: _Optional[float] = ..., wall_s_low: _Optional[float] = ..., wall_s_high: _Optional[float] = ..., cost: _Optional[float] = ..., calibration: _Optional[str] = ..., borrowed: _Optional[bool] = ...) -> None: ...

class CreateJobRequest(_message.Message):
    __slots__ = ("model", "idempotency_key", "metadata", "input", "source", "dry_run", "plan_options")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    PLAN_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    idempotency_key: str
    metadata: _containers.ScalarMap[str, str]
    input: InputFingerprint
    source: InputSource
    dry_run: bool
    plan_options: PlanOptions
    def __init__(self, model: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., input: _Optional[_Union[InputFingerprint, _Mapping]] = ..., source: _Optional[_Union[InputSource, _Mapping]] = ..., dry_run: _Optional[bool] = ..., plan_options: _Optional[_Union[PlanOptions, _Mapping]] = ...) -> None: ...

class InputSource(_message.Message):
    __slots__ = ("url", "format", "prompt_column", "messages_column", "id_column", "body_defaults_json", "credentials")
    class CredentialsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    URL_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_COLUMN_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_COLUMN_FIELD_NUMBER: _ClassVar[int]
    ID_COLUMN_FIELD_NUMBER: _ClassVar[int]
    BODY_DEFAULTS_JSON_FIELD_NUMBER: _ClassVar[int]
    CREDENTIALS_FIELD_NUMBER: _ClassVar[int]
    url: str
    format: str
    prompt_column: str
    messages_column: str
    id_column: str
    body_defaults_json: str
    credentials: _containers.ScalarMap[str, str]
    def __init__(self, url: _Optional[str] = ..., format: _Optional[str] = ..., prompt_column: _Optional[str] = ..., messages_column: _Optional[str] = ..., id_column: _Optional[str] = ..., body_defaults_json: _Optional[str] = ..., credentials: _Optional[_Mapping[str, str]] = ...) -> None: ...

class InputFingerprint(_message.Message):
    __slots__ = ("lines", "digest")
    LINES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    lines: int
    digest: str
    def __init__(self, lines: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class AddRequestsChunk(_message.Message):
    __slots__ = ("job_id", "lines", "first_line")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LINES_FIELD_NUMBER: _ClassVar[int]
    FIRST_LINE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    lines: _containers.RepeatedScalarFieldContainer[bytes]
    first_line: int
    def __init__(self, job_id: _Optional[str] = ..., lines: _Optional[_Iterable[bytes]] = ..., first_line: _Optional[int] = ...) -> None: ...

class AddRequestsResponse(_message.Message):
    __slots__ = ("accepted", "rejected", "total")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    rejected: int
    total: int
    def __init__(self, accepted: _Optional[int] = ..., rejected: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class SealJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("limit", "page_token")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    limit: int
    page_token: str
    def __init__(self, limit: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class StreamResultsRequest(_message.Message):
    __slots__ = ("job_id", "offset", "kind", "follow", "unanswered")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    UNANSWERED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    offset: int
    kind: ResultKind
    follow: bool
    unanswered: bool
    def __init__(self, job_id: _Optional[str] = ..., offset: _Optional[int] = ..., kind: _Optional[_Union[ResultKind, str]] = ..., follow: _Optional[bool] = ..., unanswered: _Optional[bool] = ...) -> None: ...

class ResultLine(_message.Message):
    __slots__ = ("index", "is_error", "line")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    IS_ERROR_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    index: int
    is_error: bool
    line: str
    def __init__(self, index: _Optional[int] = ..., is_error: _Optional[bool] = ..., line: _Optional[str] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id", "upload_interrupted")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_INTERRUPTED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    upload_interrupted: bool
    def __init__(self, job_id: _Optional[str] = ..., upload_interrupted: _Optional[bool] = ...) -> None: ...

class GetQueueDepthRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...
