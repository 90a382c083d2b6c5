"""A BatchJob's spec as a typed record: its input read into request lines (or, for `input.url`, left
for the planner to read), its paths confined to the shared volume, its URLs checked, and its
default sampling params merged into every request body."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from prefixgrove.request_defaults import with_body_defaults
from prefixgrove.storage.locations import ObjectLocation, StorageError, errors_beside
from prefixgrove_proto import planner_pb2 as pb

# spec.sampling field -> OpenAI request body field
_SAMPLING_FIELDS = {
    "maxTokens": "max_tokens",
    "temperature": "temperature",
    "topP": "top_p",
    "topK": "top_k",
    "minP": "min_p",
    "seed": "seed",
    "stop": "stop",
    "ignoreEos": "ignore_eos",
}
INPUT_SOURCES = ("inline", "configMap", "path", "url")
# what may stand beside input.url: how the object is read
_URL_INPUT_FIELDS = {"format", "promptColumn", "messagesColumn", "idColumn"}
INPUT_FORMATS = ("jsonl", "parquet")


class InvalidSpec(ValueError):
    """The BatchJob cannot run as written; retrying will not help. The message is for its owner."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def confine(root: str, relative: str, what: str) -> Path:
    """The path `relative` under `root`, refusing anything (absolute, `..`, a symlink) that leaves it."""
    if not relative or os.path.isabs(relative) or ".." in Path(relative).parts:
        raise InvalidSpec(
            "PathOutsideVolume",
            f"{what} {relative!r} must be a relative path inside the shared volume, without '..'",
        )
    base = Path(root).resolve()
    resolved = (base / relative).resolve()
    if resolved != base and base not in resolved.parents:
        # NOTE: the operator's own paths stay out of messages users read (status, Events)
        raise InvalidSpec(
            "PathOutsideVolume", f"{what} {relative!r} leads outside the shared volume (a link)"
        )
    return resolved


def on_volume(root: str, path: Path) -> str:
    """`path` as users name it in a BatchJob: relative to the shared volume's root."""
    try:
        return str(path.relative_to(Path(root).resolve()))
    except ValueError:
        return path.name


@dataclass(frozen=True)
class UrlInput:
    """`spec.input.url`: an object the planner reads, and how."""

    url: str
    format: str = "jsonl"
    prompt_column: str = ""
    messages_column: str = ""
    id_column: str = ""


@dataclass(frozen=True)
class BatchJobSpec:
    model: str
    output_path: Path | None  # one of output_path and output_url is set
    errors_path: Path | None
    inline: tuple[Mapping[str, Any], ...] = ()
    config_map: tuple[str, str] | None = None  # (name, key)
    input_path: Path | None = None
    input_url: UrlInput | None = None
    output_url: str = ""
    errors_url: str = ""
    credentials_secret: str = ""  # a Secret in the BatchJob's namespace: the store's credentials
    sampling: Mapping[str, Any] = field(default_factory=dict)
    volume_root: str = ""
    cancel: bool = False  # the owner asked for the job to stop
    max_failed_ratio: float | None = None  # failed / total above which the job is Failed
    queue_timeout_s: float | None = None  # Queued this long, no worker serving: Failed
    dry_run: bool = False  # planned only: status.plan, and nothing runs

    @classmethod
    def parse(cls, spec: Mapping[str, Any], volume_root: str) -> BatchJobSpec:
        model = spec.get("model")
        if not isinstance(model, str) or not model.strip():
            raise InvalidSpec("InvalidModel", f"spec.model must be a model name, got {model!r}")
        source = dict(spec.get("input") or {})
        config_map = source.get("configMap")
        secret = spec.get("credentialsSecret") or ""
        if not isinstance(secret, str):
            raise InvalidSpec("InvalidSpec", "spec.credentialsSecret must name a Secret")
        return cls(
            model=model,
            **_outputs(spec.get("output") or {}, volume_root),
            inline=tuple(_one_source(source).get("inline") or ()),
            config_map=(config_map["name"], config_map["key"]) if config_map else None,
            input_path=(
                confine(volume_root, source["path"], "spec.input.path")
                if "path" in source
                else None
            ),
            input_url=_url_input(source) if "url" in source else None,
            credentials_secret=secret,
            sampling=_sampling_defaults(spec.get("sampling") or {}),
            volume_root=volume_root,
            cancel=bool(spec.get("cancel")),
            max_failed_ratio=_optional_float(spec, "maxFailedRatio"),
            queue_timeout_s=_optional_float(spec, "queueTimeoutSeconds"),
            dry_run=bool(spec.get("dryRun")),
        )

    @property
    def output_name(self) -> str:
        """The output as its owner names it: a URL, or a path on the shared volume."""
        if self.output_path is None:
            return self.output_url
        return on_volume(self.volume_root, self.output_path)

    @property
    def errors_name(self) -> str:
        if self.errors_path is None:
            return self.errors_url
        return on_volume(self.volume_root, self.errors_path)

    def source(self, credentials: Mapping[str, str]) -> pb.InputSource:
        """What the planner reads for `input.url`, the job's sampling defaults and credentials."""
        assert self.input_url is not None
        given = self.input_url
        return pb.InputSource(
            url=given.url, format=given.format, prompt_column=given.prompt_column,
            messages_column=given.messages_column, id_column=given.id_column,
            body_defaults_json=json.dumps(self.sampling), credentials=dict(credentials),
        )  # fmt: skip

    def request_lines(self, core: client.CoreV1Api, namespace: str) -> Iterator[bytes]:
        """The job's OpenAI Batch request lines, sampling defaults merged in, blank lines dropped.

        A missing ConfigMap, key or file raises InvalidSpec here, before anything is streamed.
        """
        raw = self._raw_lines(core, namespace)
        return (self._with_defaults(line) for line in raw if line.strip())

    def _raw_lines(self, core: client.CoreV1Api, namespace: str) -> Iterable[bytes]:
        if self.inline:
            return [json.dumps(r, separators=(",", ":")).encode() for r in self.inline]
        if self.config_map is not None:
            return _config_map_text(core, namespace, *self.config_map).encode().splitlines()
        assert self.input_path is not None  # parse() sets exactly one source
        if not self.input_path.is_file():
            shown = on_volume(self.volume_root, self.input_path)
            raise InvalidSpec(
                "InputNotFound", f"spec.input.path: the file {shown!r} is absent from the volume"
            )
        return _file_lines(self.input_path)

    def _with_defaults(self, raw: bytes) -> bytes:
        return with_body_defaults(raw, self.sampling)


def _one_source(source: Mapping[str, Any]) -> Mapping[str, Any]:
    named = [key for key in INPUT_SOURCES if key in source]
    extra = set(source) - set(INPUT_SOURCES) - (_URL_INPUT_FIELDS if named == ["url"] else set())
    if len(named) != 1 or extra:
        raise InvalidSpec(
            "InvalidInput",
            f"spec.input must set exactly one of {', '.join(INPUT_SOURCES)}; got {sorted(source)}"
            " (format, promptColumn, messagesColumn and idColumn go with url)",
        )
    return source


def _url_input(source: Mapping[str, Any]) -> UrlInput:
    url = _checked_url(source["url"], "spec.input.url")
    given = UrlInput(url, source.get("format") or "jsonl", source.get("promptColumn") or "",
                     source.get("messagesColumn") or "", source.get("idColumn") or "")  # fmt: skip
    if given.format not in INPUT_FORMATS:
        raise InvalidSpec(
            "InvalidInput", f"spec.input.format {given.format!r} is not read: expected one of "
            f"{', '.join(INPUT_FORMATS)}",
        )  # fmt: skip
    if given.format == "parquet" and bool(given.prompt_column) == bool(given.messages_column):
        raise InvalidSpec(
            "InvalidInput", "spec.input.format parquet needs one of promptColumn and messagesColumn"
        )
    return given


def _outputs(output: Mapping[str, Any], volume_root: str) -> dict[str, Any]:
    """The output and error files, on the volume (path, errorsPath) or in a bucket (url,
    errorsUrl): one of the two kinds."""
    if bool(output.get("path")) == bool(output.get("url")):
        raise InvalidSpec("InvalidOutput", "spec.output must set one of path and url")
    if output.get("url"):
        url = _checked_url(output["url"], "spec.output.url")
        errors = _checked_url(output.get("errorsUrl") or str(errors_beside(url)),
                              "spec.output.errorsUrl")  # fmt: skip
        return {"output_path": None, "errors_path": None, "output_url": url, "errors_url": errors}
    errors = output.get("errorsPath") or output["path"] + ".errors.jsonl"
    return {
        "output_path": confine(volume_root, output["path"], "spec.output.path"),
        "errors_path": confine(volume_root, errors, "spec.output.errorsPath"),
    }


def _checked_url(url: Any, what: str) -> str:
    try:
        return ObjectLocation.parse(str(url)).url
    except StorageError as exc:
        raise InvalidSpec("InvalidUrl", f"{what}: {exc}") from None


def _optional_float(spec: Mapping[str, Any], name: str) -> float | None:
    value = spec.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise InvalidSpec("InvalidSpec", f"spec.{name} must be a number >= 0, got {value!r}")
    return float(value)


def _sampling_defaults(sampling: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(sampling) - set(_SAMPLING_FIELDS) - {"logprobs"})
    if unknown:
        raise InvalidSpec(
            "InvalidSampling",
            f"spec.sampling has unknown fields {unknown}; known: {sorted([*_SAMPLING_FIELDS, 'logprobs'])}",
        )
    defaults = {_SAMPLING_FIELDS[k]: v for k, v in sampling.items() if k in _SAMPLING_FIELDS}
    if "logprobs" in sampling:
        defaults["logprobs"] = sampling["logprobs"]
    return defaults


def _file_lines(path: Path) -> Iterator[bytes]:
    with path.open("rb") as lines:
        for line in lines:
            yield line.rstrip(b"\r\n")


def _config_map_text(core: client.CoreV1Api, namespace: str, name: str, key: str) -> str:
    try:
        config_map = core.read_namespaced_config_map(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            raise InvalidSpec(
                "InputNotFound", f"spec.input.configMap: no ConfigMap {name!r} in {namespace!r}"
            ) from None
        raise
    data = config_map.data or {}
    if key not in data:
        raise InvalidSpec(
            "InputNotFound",
            f"spec.input.configMap: ConfigMap {name!r} has no key {key!r}; keys: {sorted(data)}",
        )
    return str(data[key])
