"""Configuration of the planner, the worker, the CLI and the operator: command-line flags over
PREFIXGROVE_* environment variables over defaults. The only module that reads the environment.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

ENV_PREFIX = "PREFIXGROVE_"
T = TypeVar("T")
_KEEPS_EMPTY = "keeps_empty"
HELP = "help"  # field metadata: what --help says of the setting before its default
REPEATED = "repeated"  # field metadata: the flag may be given several times, values joined by ","
REDIS_URL_HELP = (
    "redis://[:password@]host:port/db (rediss:// for TLS, or unix://path); a Redis Cluster: "
    "redis+cluster://host:port[,host:port...]; a master found through Sentinels: "
    "redis+sentinel://host:port[,host:port...]/master-name[/db] (rediss+ for TLS)"
)


def keeps_empty(default: str) -> Any:
    """A str field for which an empty value means something (it turns a feature off), so an
    empty variable sets it; for every other field an empty variable is as good as unset."""
    return field(default=default, metadata={_KEEPS_EMPTY: True})


# The most any job may allow in one input line. The client sends a longer line cut to one byte
# over it, so it is refused as too large by any planner, never as a message over gRPC's limit.
MAX_LINE_BYTES_LIMIT = 32 << 20


@dataclass(frozen=True)
class IngestSettings:
    """Limits on what a job's input may hold; shared by the planner and the local run."""

    max_line_bytes: int = 1 << 20
    max_requests_per_job: int = 5_000_000
    default_max_tokens: int = 256
    max_model_len: int | None = None  # None: the model's own limit
    tokenize_batch: int = 512
    block_size: int = 16  # the engine's KV block size: shared prefixes are whole blocks
    min_prefix_len: int = 32
    max_group_requests: int = 256  # larger prefix groups are split so several workers share them
    ungrouped_chunk: int = 64  # requests without a shared prefix travel in units of this many

    def __post_init__(self) -> None:
        positive(self, "max_line_bytes", "max_requests_per_job", "default_max_tokens",
                 "tokenize_batch", "max_group_requests", "ungrouped_chunk", "block_size",
                 "min_prefix_len")  # fmt: skip
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} is invalid: expected >= 2")
        if self.max_line_bytes > MAX_LINE_BYTES_LIMIT:
            raise ValueError(
                f"max_line_bytes={self.max_line_bytes} is invalid: expected at most "
                f"{MAX_LINE_BYTES_LIMIT} (a line travels to the planner in one gRPC message)"
            )


@dataclass(frozen=True)
class SecuritySettings:
    """gRPC transport security; a token is compared in constant time and never logged."""

    auth_token: str | None = None
    tls_cert: str | None = None  # server: its certificate; client: unused
    tls_key: str | None = None
    tls_ca: str | None = None  # server: require client certificates signed by it (mutual TLS)
    tls_client_cert: str | None = None  # client side of mutual TLS
    tls_client_key: str | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")

    def __repr__(self) -> str:
        token = "<set>" if self.auth_token else None
        return f"SecuritySettings(auth_token={token}, tls_cert={self.tls_cert!r}, tls_ca={self.tls_ca!r})"


@dataclass(frozen=True)
class StorageSettings:
    """Object storage (s3://, gs://). Credentials come the platform's way, never from here: the
    AWS_* variables, web identity (IRSA) and instance roles; GOOGLE_APPLICATION_CREDENTIALS and
    workload identity. These settings are for S3-compatible stores and the size of output parts."""

    # MinIO, Ceph, R2, ...: http(s)://host:port; empty: AWS_ENDPOINT_URL, else AWS itself
    s3_endpoint_url: str = ""
    s3_region: str = ""  # empty: AWS_REGION or AWS_DEFAULT_REGION, else us-east-1
    gcs_endpoint_url: str = ""  # an emulator's http://host:port; empty: Google's
    # an output is uploaded in parts of about this many bytes (a part is what a resume keeps)
    object_part_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if not 1 << 10 <= self.object_part_bytes <= 1 << 30:
            raise ValueError(
                f"object_part_bytes={self.object_part_bytes} is invalid: expected 1 KiB to 1 GiB"
            )
        for name in ("s3_endpoint_url", "gcs_endpoint_url"):
            value = getattr(self, name)
            if value and not value.startswith(("http://", "https://")):
                raise ValueError(f"{name}={value!r} is invalid: expected http(s)://HOST[:PORT]")


@dataclass(frozen=True)
class ClientSettings:
    """Where the command-line client finds the planner (`--planner`, PREFIXGROVE_PLANNER)."""

    planner: str = field(default="127.0.0.1:50051", metadata={HELP: "the planner's HOST:PORT"})


@dataclass(frozen=True)
class LogSettings:
    """How every `prefixgrove` command writes its logs and progress on stderr."""

    log_format: str = field(
        default="text", metadata={HELP: "text, or json: one JSON object a line"}
    )

    def __post_init__(self) -> None:
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format={self.log_format!r} is invalid: expected text or json")


@dataclass(frozen=True)
class ServedModel:
    """A model a planner serves: `name` is what jobs and lines call it (and its Redis queue);
    `source` loads its tokenizer (a preset, a Hugging Face directory or a .gguf file); `aliases`
    are other names lines and jobs may call it by (`--model-alias`), as vLLM serves one model under
    several `--served-model-name`s."""

    name: str
    source: str
    aliases: tuple[str, ...] = ()

    @classmethod
    def parse(cls, value: str) -> ServedModel:
        """`SOURCE` or `NAME=SOURCE`."""
        name, _, source = value.partition("=") if "=" in value else ("", "", value)
        name, source = name.strip() or source.strip(), source.strip()
        if not source or "," in value:
            raise ValueError(
                f"model {value!r} is invalid: expected SOURCE or NAME=SOURCE (a preset, a "
                "Hugging Face directory or a .gguf file)"
            )
        return cls(name, source)


MODELS_HELP = (
    "SOURCE or NAME=SOURCE; give it again (or comma-separate) for several models; NAME (default: "
    "SOURCE) is what body.model and a job's model name; the first is the default"
)
ALIASES_HELP = (
    "ALIAS=NAME: lines and jobs naming ALIAS run on model NAME (e.g. gpt-4o-mini=llama, for files "
    "written for another provider); give it again (or comma-separate) for several"
)


def model_aliases(value: str, names: list[str]) -> dict[str, str]:
    """`ALIAS=NAME[,ALIAS=NAME...]` -> {alias: name}, each NAME one of `names` and no ALIAS one."""
    aliases: dict[str, str] = {}
    for item in (v.strip() for v in value.split(",") if v.strip()):
        alias, _, name = (part.strip() for part in item.partition("="))
        if not alias or name not in names or alias in names or alias in aliases:
            raise ValueError(
                f"model_alias {item!r} is invalid: expected ALIAS=NAME with NAME a served model "
                f"({', '.join(names)}) and ALIAS a name no other model or alias has"
            )
        aliases[alias] = name
    return aliases


def served_names(value: str) -> list[str]:
    """`--served-model-name`'s names (given several times, or comma-separated): the first names
    the model, the others are its aliases."""
    return [name.strip() for name in value.split(",") if name.strip()]


@dataclass(frozen=True)
class PlannerSettings:
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata={HELP: REDIS_URL_HELP})
    host: str = "127.0.0.1"  # loopback unless told otherwise (a container passes 0.0.0.0)
    port: int = 50051
    model: str = field(default="tiny-random-llama", metadata={HELP: MODELS_HELP, REPEATED: True})
    model_alias: str = field(default="", metadata={HELP: ALIASES_HELP, REPEATED: True})
    metrics_port: int = 0  # 0: no Prometheus endpoint
    # the OpenAI Batch API (/v1/files, /v1/batches) over HTTP beside gRPC; 0: not served
    http_port: int = 0
    # where files uploaded through the OpenAI Batch API are kept; empty: a folder in the temp dir
    data_dir: str = ""
    # or a bucket (s3://BUCKET[/PREFIX], gs://...) all replicas share, instead of data_dir
    files_url: str = field(default="", metadata={HELP: (
        "a bucket for the OpenAI Batch API's files, s3://BUCKET[/PREFIX] or gs://BUCKET[/PREFIX], "
        "shared by every replica; default: under --data-dir")})  # fmt: skip
    max_message_bytes: int = 64 << 20
    job_retention_s: int = 7 * 24 * 3600  # a finished job's keys expire after this; 0: kept
    # streaming calls (uploads, status --watch, submit --wait's results) served at once; the
    # thread pool holds this many and 8 more for the short calls and the health check
    max_streams: int = 64
    # a job whose input stops arriving this long before it is sealed fails (`upload_abandoned`),
    # and an upload stream whose client sends nothing this long is ended
    upload_idle_timeout_s: float = 900.0
    # a watch or results stream whose client takes no message this long is ended
    stream_stall_timeout_s: float = 300.0
    # processes that parse uploaded lines (JSON and validation hold the GIL); 0: half the cores,
    # at most 8; 1: parsed in the planner's own process
    parse_processes: int = 0

    def __post_init__(self) -> None:
        names = [m.name for m in self.models]
        if not names:
            raise ValueError(f"model={self.model!r} is invalid: expected SOURCE or NAME=SOURCE")
        if len(set(names)) < len(names):
            raise ValueError(f"model={self.model!r} is invalid: two models share a name")
        model_aliases(self.model_alias, names)
        _port(self, "port")
        _port(self, "metrics_port")
        _port(self, "http_port")
        positive(self, "max_message_bytes")
        if self.max_message_bytes < MAX_LINE_BYTES_LIMIT + (2 << 20):
            raise ValueError(
                f"max_message_bytes={self.max_message_bytes} is invalid: expected at least "
                f"{MAX_LINE_BYTES_LIMIT + (2 << 20)} (an upload chunk holds a line of up to "
                f"{MAX_LINE_BYTES_LIMIT} bytes)"
            )
        positive(self, "max_streams")
        positive(self, "upload_idle_timeout_s", "stream_stall_timeout_s")
        if self.files_url and not self.files_url.startswith(("s3://", "gs://")):
            raise ValueError(
                f"files_url={self.files_url!r} is invalid: expected s3://BUCKET[/PREFIX] or "
                "gs://BUCKET[/PREFIX]"
            )
        if self.parse_processes < 0:
            raise ValueError(
                f"parse_processes={self.parse_processes} is invalid: expected >= 0 (0: automatic)"
            )
        if self.job_retention_s < 0:
            raise ValueError(
                f"job_retention_s={self.job_retention_s} is invalid: expected >= 0 (0 keeps jobs)"
            )

    @property
    def models(self) -> tuple[ServedModel, ...]:
        """The models served, the default first, each with its aliases."""
        models = [ServedModel.parse(v) for v in self.model.split(",") if v.strip()]
        aliases = model_aliases(self.model_alias, [m.name for m in models])
        return tuple(
            ServedModel(m.name, m.source, tuple(a for a, n in aliases.items() if n == m.name))
            for m in models
        )

    @property
    def files_dir(self) -> Path:
        """The folder of the files uploaded through the OpenAI Batch API."""
        return Path(self.data_dir or tempfile.gettempdir()) / "prefixgrove-files"


@dataclass(frozen=True)
class PlanSettings:
    """What `prefixgrove plan` plans for: the device kind the job runs on (every GPU kind is
    predicted beside it), how many, the price of a device-hour, and an observed mean of output
    tokens for the requests that may stop before max_tokens."""

    gpu: str = field(default="h100", metadata={HELP: "the device kind: h100, h200, a100, l40s or cpu"})  # fmt: skip
    gpus: int = field(default=1, metadata={HELP: "devices (replicas of tensor-parallel-size each)"})
    price_per_gpu_hour: float | None = field(default=None, metadata={HELP: "prints the cost"})
    mean_output_tokens: float | None = field(default=None, metadata={
        HELP: "an observed mean (an earlier run's) for requests that may stop early; unset: "
        "their max_tokens"})  # fmt: skip

    def __post_init__(self) -> None:
        from prefixgrove.costmodel.devices import device_kind

        device_kind(self.gpu)
        positive(self, "gpus")
        for name in ("price_per_gpu_hour", "mean_output_tokens"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name}={value} is invalid: expected a number >= 0")


@dataclass(frozen=True)
class WorkerSettings:
    """How a worker leases and runs groups; the engine's own knobs are EngineSettings
    (prefixgrove/engine_settings.py), read beside these."""

    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata={HELP: REDIS_URL_HELP})
    model: str = "tiny-random-llama"  # what loads the weights and tokenizer
    served_model_name: str = field(
        default="",
        metadata={
            HELP: "NAME [ALIAS ...]: the name jobs call the model by, whose queue the worker "
            "leases from (the planner's --model-alias routes the aliases to it); unset: --model",
            REPEATED: True,
        },
    )
    # where the metrics endpoint listens: loopback unless told otherwise (a pod passes 0.0.0.0)
    host: str = "127.0.0.1"
    consumer: str = ""  # empty: host name and process id
    lease_timeout_s: float = 30.0  # a group idle this long in another worker's hands is taken over
    # a group delivered this many times to workers that failed on it fails its requests instead
    max_deliveries: int = 5
    # groups held at most (0: no count; the engine's batch and KV cache decide, see lease_ahead)
    max_groups_in_flight: int = 0
    # leased beyond what the engine runs at once (its requests and KV tokens), so the next groups are
    # ready when running ones finish; more keeps the GPU fuller, less leaves more to other workers
    lease_ahead: float = 0.25
    cancel_poll_s: float = 1.0
    drain_timeout_s: float = (
        120.0  # on SIGTERM: finish groups in flight for this long, then give back
    )
    # on SIGTERM while Redis does not answer: give back what can be, then exit within about this
    stop_timeout_s: float = 10.0
    metrics_port: int = 0

    def __post_init__(self) -> None:
        if self.lease_timeout_s < 1.0:
            raise ValueError(f"lease_timeout_s={self.lease_timeout_s} is invalid: expected >= 1")
        positive(self, "stop_timeout_s", "max_deliveries")
        if self.max_groups_in_flight < 0:
            raise ValueError(
                f"max_groups_in_flight={self.max_groups_in_flight} is invalid: expected >= 0 "
                "(0: as many as the engine's batch and KV cache hold)"
            )
        if not 0 <= self.lease_ahead <= 4:  # NaN fails too
            raise ValueError(f"lease_ahead={self.lease_ahead} is invalid: expected 0 to 4")
        _port(self, "metrics_port")

    @property
    def keepalive_s(self) -> float:
        return self.lease_timeout_s / 3

    @property
    def served_name(self) -> str:
        names = served_names(self.served_model_name)
        return names[0] if names else self.model


def env_name(field_name: str) -> str:
    """The variable that sets a field (load reads it, --help names it)."""
    return ENV_PREFIX + field_name.upper()


def load(
    cls: type[T],
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> T:
    """Builds settings from flags (when not None), then PREFIXGROVE_<FIELD>, then defaults."""
    values = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    env = os.environ if env is None else env
    kwargs: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        variable = env_name(f.name)
        raw = env.get(variable)
        if values.get(f.name) is not None:
            kwargs[f.name] = _convert(f.type, values[f.name], f.name)
        elif raw is not None and (raw != "" or f.metadata.get(_KEEPS_EMPTY)):
            kwargs[f.name] = _convert(f.type, raw, variable)
    return cls(**kwargs)


def _convert(annotation: Any, raw: Any, name: str) -> Any:
    kind = str(annotation)
    if isinstance(raw, list):  # a flag given several times
        return ",".join(raw)
    if not isinstance(raw, str):
        return raw
    try:
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
        if kind.startswith("bool"):
            return raw.lower() in ("1", "true", "yes", "on")
    except ValueError:
        raise ValueError(f"{name}={raw!r} is invalid: expected {kind.split(' ')[0]}") from None
    return raw


def positive(obj: object, *names: str) -> None:
    """Raises for the first of `obj`'s fields `names` that is not a finite number > 0."""
    for name in names:
        value = getattr(obj, name)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name}={value} is invalid: expected > 0")


def _port(obj: object, name: str) -> None:
    value = getattr(obj, name)
    if not 0 <= value <= 65535:
        raise ValueError(f"{name}={value} is invalid: expected a port in [0, 65535]")
