"""A BatchJob's spec as a typed record: its input read into request lines, its paths confined to the
shared volume, and its default sampling params merged into every request body."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

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
class BatchJobSpec:
    model: str
    output_path: Path
    errors_path: Path
    inline: tuple[Mapping[str, Any], ...] = ()
    config_map: tuple[str, str] | None = None  # (name, key)
    input_path: Path | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    volume_root: str = ""
    cancel: bool = False  # the owner asked for the job to stop
    max_failed_ratio: float | None = None  # failed / total above which the job is Failed
    queue_timeout_s: float | None = None  # Queued this long, no worker serving: Failed

    @classmethod
    def parse(cls, spec: Mapping[str, Any], volume_root: str) -> BatchJobSpec:
        model = spec.get("model")
        if not isinstance(model, str) or not model.strip():
            raise InvalidSpec("InvalidModel", f"spec.model must be a model name, got {model!r}")
        source = dict(spec.get("input") or {})
        if len(source) != 1 or next(iter(source)) not in ("inline", "configMap", "path"):
            raise InvalidSpec(
                "InvalidInput",
                f"spec.input must set exactly one of inline, configMap, path; got {sorted(source)}",
            )
        output = spec.get("output") or {}
        if not output.get("path"):
            raise InvalidSpec("InvalidOutput", "spec.output.path is required")
        output_path = confine(volume_root, output["path"], "spec.output.path")
        errors = output.get("errorsPath") or output["path"] + ".errors.jsonl"
        config_map = source.get("configMap")
        return cls(
            model=model,
            output_path=output_path,
            errors_path=confine(volume_root, errors, "spec.output.errorsPath"),
            inline=tuple(source.get("inline") or ()),
            config_map=(config_map["name"], config_map["key"]) if config_map else None,
            input_path=(
                confine(volume_root, source["path"], "spec.input.path")
                if "path" in source
                else None
            ),
            sampling=_sampling_defaults(spec.get("sampling") or {}),
            volume_root=volume_root,
            cancel=bool(spec.get("cancel")),
            max_failed_ratio=_optional_float(spec, "maxFailedRatio"),
            queue_timeout_s=_optional_float(spec, "queueTimeoutSeconds"),
        )

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
        if not self.sampling:
            return raw
        try:
            request = json.loads(raw)
        except ValueError:
            return raw  # the planner reports the line as a per-request error
        body = request.get("body") if isinstance(request, dict) else None
        if not isinstance(body, dict):
            return raw
        chat = str(request.get("url", "")).endswith("/chat/completions")
        for name, value in self.sampling.items():
            if name == "logprobs":
                _set_logprobs(body, value, chat)
            elif name == "max_tokens" and "max_completion_tokens" in body:
                continue
            else:
                body.setdefault(name, value)
        return json.dumps(request, separators=(",", ":")).encode()


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


def _set_logprobs(body: dict[str, Any], count: int, chat: bool) -> None:
    if not chat:
        body.setdefault("logprobs", count)
    elif "logprobs" not in body and "top_logprobs" not in body:
        body["logprobs"] = True
        body["top_logprobs"] = count


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
