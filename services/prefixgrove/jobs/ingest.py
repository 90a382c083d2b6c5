"""A job's input, streamed: lines -> validated, tokenized requests; then the whole job grouped.

What is held per request until grouping is its prefix index entry (a hash per shareable KV block,
prefix_index.py); the parsed requests and their tokens go out to the caller (Redis, or the local
run) batch by batch. What the whole upload shares (line indices, custom_ids taken, the counts
behind `job_error`) lives in an `UploadLedger`: in memory for the local run, in Redis for the
planner (jobs/redis_store/uploads.py), so that every planner replica can take lines of the same job.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from prefixgrove.jobs.line_parser import LineParser, LineRules
from prefixgrove.jobs.prefix_index import PrefixIndex
from prefixgrove.jobs.prompt_parts import groupable
from prefixgrove.jobs.redis_store.schema import GroupRecord
from prefixgrove.jobs.request_errors import RequestError
from prefixgrove.jobs.requests import BatchRequest
from prefixgrove.jobs.tokenize import PromptTokenizer
from prefixgrove.settings import IngestSettings

_BYTE_ORDER_MARKS = (
    (b"\x00\x00\xfe\xff", "UTF-32 (big-endian, with a byte order mark)"),
    (b"\xff\xfe\x00\x00", "UTF-32 (little-endian, with a byte order mark)"),
    (b"\xfe\xff", "UTF-16 (big-endian, with a byte order mark)"),
    (b"\xff\xfe", "UTF-16 (little-endian, with a byte order mark)"),
)
_UTF8_BOM = b"\xef\xbb\xbf"
_NOT_JSON = ("invalid_json", "invalid_encoding", "line_too_large")  # codes of lines never read


def foreign_encoding(first_line: bytes) -> str | None:
    """The encoding the input's first line is in, when it is UTF-16 or UTF-32 rather than UTF-8."""
    for mark, name in _BYTE_ORDER_MARKS:
        if first_line.startswith(mark):
            return name
    # NOTE: JSON in UTF-8 never holds a raw NUL byte; UTF-16 and UTF-32 put one beside every ASCII
    # character, so they are half NULs or more. A stray NUL is a bad line, not a file in UTF-16.
    head = first_line[:64]
    if len(head) < 4 or head.count(0) * 3 < len(head):
        return None
    wide = "UTF-32" if b"\x00\x00\x00" in head else "UTF-16"
    order = "big" if head.startswith(b"\x00") else "little"
    return f"{wide} ({order}-endian)"


@dataclass(frozen=True)
class UploadCounts:
    """What a whole upload has taken in so far, whoever took it."""

    lines: int = 0  # request lines (blank lines are not requests): the indices handed out
    json_lines: int = 0  # lines that parsed as JSON objects
    prompt_tokens: int = 0
    encoding: str | None = None  # set when the input is not UTF-8: no line is read


class UploadClosed(RuntimeError):
    """The upload ended (sealed, failed, cancelled) or is being sealed: it takes no more lines."""


class UploadLedger(Protocol):
    """The state one job's upload shares between all the streams that feed it.

    Rules: `reserve` hands out each line index once, job-wide, in one contiguous run per call;
    `first_uses` says of each custom_id whether no earlier call named it (a second use in the same
    call is a repeat too); counts only grow. Any call may raise UploadClosed."""

    def reserve(self, lines: int) -> tuple[int, str | None]:
        """(first index of `lines` new lines, the input's foreign encoding if noted so far)."""
        ...

    def note_encoding(self, name: str) -> None: ...

    def first_uses(self, custom_ids: Sequence[str]) -> list[bool]: ...

    def count(self, json_lines: int, prompt_tokens: int) -> UploadCounts:
        """Adds to the counts; returns them as they are now."""
        ...

    def counts(self) -> UploadCounts: ...

    def forget_custom_ids(self) -> None:
        """No more lines come: the custom_ids need not be kept for this process's sake."""
        ...


class MemoryLedger:
    """The ledger of an upload that one process takes whole (the local run)."""

    def __init__(self) -> None:
        self._counts = UploadCounts()
        self._seen: set[str] = set()

    def reserve(self, lines: int) -> tuple[int, str | None]:
        first = self._counts.lines
        self._counts = _grown(self._counts, lines=lines)
        return first, self._counts.encoding

    def note_encoding(self, name: str) -> None:
        self._counts = UploadCounts(**{**self._counts.__dict__, "encoding": name})

    def first_uses(self, custom_ids: Sequence[str]) -> list[bool]:
        fresh = []
        for custom_id in custom_ids:
            fresh.append(custom_id not in self._seen)
            self._seen.add(custom_id)
        return fresh

    def count(self, json_lines: int, prompt_tokens: int) -> UploadCounts:
        self._counts = _grown(self._counts, json_lines=json_lines, prompt_tokens=prompt_tokens)
        return self._counts

    def counts(self) -> UploadCounts:
        return self._counts

    def forget_custom_ids(self) -> None:
        self._seen.clear()  # make room for grouping's own copy of the prompts


def _grown(counts: UploadCounts, lines: int = 0, json_lines: int = 0, prompt_tokens: int = 0) -> UploadCounts:  # fmt: skip
    return UploadCounts(counts.lines + lines, counts.json_lines + json_lines,
                        counts.prompt_tokens + prompt_tokens, counts.encoding)  # fmt: skip


def job_error(counts: UploadCounts) -> tuple[str, str] | None:
    """The reason the whole input is not a batch, if it is not one."""
    if counts.lines == 0:
        return "empty_file", "the input holds no request lines"
    if counts.encoding is not None:
        return (
            "invalid_encoding",
            f"the input is {counts.encoding}, not UTF-8: save it as UTF-8 (for example "
            f"`iconv -f {counts.encoding.split()[0]} -t UTF-8 IN > OUT`)",
        )
    if counts.json_lines == 0:
        return (
            "invalid_file",
            f"none of the {counts.lines} lines is a JSON object: the input is not JSONL",
        )
    return None


@dataclass
class IngestedBatch:
    """What one call to `add` produced: valid requests with their tokens, and per-request errors."""

    requests: list[tuple[BatchRequest, np.ndarray]] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)


@dataclass(frozen=True)
class JobPlan:
    units: list[GroupRecord]  # line indices, in the order they are queued
    prefix_tokens_saved: int
    num_groups: int
    # per unit, the name of its prefix that workers advertise (PrefixIndex.affinity_key; "": none)
    affinity_keys: list[str] = field(default_factory=list)
    # the groups' prefix tokens one engine computes, leading blocks that groups share once (the
    # prefix cache gives them to the later groups); None: each group's prefix apart
    prefix_tokens_computed: int | None = None


def plan_groups(index: PrefixIndex, line_indices: Sequence[int], settings: IngestSettings) -> JobPlan:  # fmt: skip
    """Groups a job by shared prefix; requests in no group travel in small chunks. `index` holds
    the prompts in the order of `line_indices` (ascending, so that every planner that builds the
    index of a job builds the same one and groups it the same way)."""
    s = settings
    result = index.group(s.min_prefix_len, s.max_group_requests)
    units = [
        GroupRecord(g.prefix_len, [line_indices[i] for i in g.request_indices])
        for g in result.groups
    ]
    keys = [index.affinity_key(g.request_indices[0], g.prefix_len) for g in result.groups]
    rest = [line_indices[i] for i in result.ungrouped]
    for start in range(0, len(rest), s.ungrouped_chunk):
        units.append(GroupRecord(0, rest[start : start + s.ungrouped_chunk]))
        keys.append("")
    return JobPlan(
        units, result.tokens_saved, len(result.groups), keys, result.prefix_tokens_computed
    )


class JobIngestor:
    """Validates and tokenizes one job's lines as they arrive; groups the job when it is sealed.

    A job may mix models: each line goes to the model its body names (`tokenizers` is keyed by
    served name; a line naming none goes to `default_model`), is tokenized with that model's
    tokenizer and grouped only with lines of the same model. A line naming a model not in
    `tokenizers` is a `model_not_found` error. The prefix indexes hold the lines this ingestor
    took, which is the whole job when every stream of the job went through it."""

    def __init__(
        self,
        tokenizers: Mapping[str, PromptTokenizer],
        settings: IngestSettings,
        ledger: UploadLedger | None = None,
        parser: LineParser | None = None,
        default_model: str | None = None,
        aliases: Mapping[str, str] | None = None,
    ) -> None:
        """`parser`: parses the lines (in several processes, for the planner); default: here.
        `default_model`: the model of lines that name none; default: the first of `tokenizers`.
        `aliases`: other names of the served models (alias -> served name)."""
        self.aliases = dict(aliases or {})
        if not tokenizers:
            raise ValueError("a job needs at least one model to tokenize its lines")
        self.tokenizers = dict(tokenizers)
        self.default_model = default_model if default_model is not None else next(iter(tokenizers))
        if self.default_model not in self.tokenizers:
            raise ValueError(
                f"default_model={self.default_model!r} is not among the models "
                f"{sorted(self.tokenizers)}"
            )
        self.settings = settings
        rules = LineRules(settings.max_line_bytes, settings.default_max_tokens)
        self.parser = parser if parser is not None else LineParser(rules)
        self.ledger: UploadLedger = ledger if ledger is not None else MemoryLedger()
        self.models: dict[str, ModelLines] = {}  # per served model: the lines it took
        self.last_counts = UploadCounts()  # the whole upload's, as the last `add` saw them

    def __len__(self) -> int:
        """How many requests this ingestor took (tokenized, over every model)."""
        return sum(len(lines.index) for lines in self.models.values())

    @property
    def total(self) -> int:
        return self.last_counts.lines

    @property
    def prompt_tokens(self) -> int:
        return self.last_counts.prompt_tokens

    @property
    def encoding(self) -> str | None:
        return self.last_counts.encoding

    def add(self, lines: Iterable[bytes | str]) -> IngestedBatch:
        out = IngestedBatch()
        kept = [line for line in lines if line.strip()]
        first, encoding = self.ledger.reserve(len(kept))
        if first == 0 and kept:
            kept[0], encoding = self._first_line(kept[0])
        if encoding is not None:
            self.last_counts = self.ledger.count(0, 0)
            return out  # not UTF-8: the job fails whole at its seal, no line is judged
        parsed, json_lines = self._parse(kept, first, out.errors)
        prompt_tokens = self._tokenize(parsed, out)
        self.last_counts = self.ledger.count(json_lines, prompt_tokens)
        out.errors.sort(key=lambda e: e.index)
        return out

    def _first_line(self, line: bytes | str) -> tuple[bytes | str, str | None]:
        """The first line without a UTF-8 byte order mark; notes an input in UTF-16 or UTF-32."""
        if isinstance(line, str):
            return line.removeprefix("\ufeff"), None
        encoding = foreign_encoding(line)
        if encoding is not None:
            self.ledger.note_encoding(encoding)
        return line.removeprefix(_UTF8_BOM), encoding

    def _parse(
        self, lines: list[bytes | str], first: int, errors: list[RequestError]
    ) -> tuple[list[BatchRequest], int]:
        """The valid requests of `lines` (indices from `first`) and how many lines were JSON;
        the invalid ones go to `errors`."""
        s = self.settings
        items = self.parser.parse(lines, first)
        json_lines = sum(
            1 for item in items if isinstance(item, BatchRequest) or item.code not in _NOT_JSON
        )
        candidates: list[BatchRequest] = []
        for item in items:
            if isinstance(item, RequestError):
                errors.append(item)
            elif item.index >= s.max_requests_per_job:
                limit = s.max_requests_per_job
                errors.append(RequestError(item.index, item.custom_id, "job_too_large",
                                           f"a job holds at most {limit} requests"))  # fmt: skip
            else:
                candidates.append(item)
        fresh = (
            self.ledger.first_uses([item.custom_id for item in candidates]) if candidates else []
        )
        for item, first_use in zip(candidates, fresh, strict=True):
            if not first_use:
                message = f"custom_id {item.custom_id!r} is used by an earlier line"
                errors.append(
                    RequestError(item.index, item.custom_id, "duplicate_custom_id", message)
                )
        return [
            item for item, first_use in zip(candidates, fresh, strict=True) if first_use
        ], json_lines

    def _tokenize(self, parsed: list[BatchRequest], out: IngestedBatch) -> int:
        """Tokenizes `parsed` into `out` and the prefix indexes, each request with its model's
        tokenizer; returns the prompt tokens taken."""
        by_model: dict[str, list[BatchRequest]] = {}
        for request in parsed:
            name = self.model_of(request)
            if name in self.tokenizers:
                by_model.setdefault(name, []).append(request)
            else:
                out.errors.append(self._not_served(request, name))
        prompt_tokens = 0
        step = self.settings.tokenize_batch
        taken: dict[int, np.ndarray] = {}
        for name, requests in by_model.items():
            lines = self.models.setdefault(name, ModelLines(self.settings.block_size))
            for start in range(0, len(requests), step):
                chunk = requests[start : start + step]
                encoded = self.tokenizers[name].encode(chunk)
                for request, tokens in zip(chunk, encoded, strict=True):
                    if isinstance(tokens, RequestError):
                        out.errors.append(tokens)
                        continue
                    lines.add(request.index, groupable(tokens, request.params))
                    prompt_tokens += len(tokens)
                    taken[request.index] = tokens
        out.requests.extend((r, taken[r.index]) for r in parsed if r.index in taken)
        return prompt_tokens

    def model_of(self, request: BatchRequest) -> str:
        """The served name a request goes to: its body's model (or the model it is an alias of),
        else the job's."""
        if request.model is None:
            return self.default_model
        return self.aliases.get(request.model, request.model)

    def _not_served(self, request: BatchRequest, name: str) -> RequestError:
        # NOTE: the message names only the line's model, so the local run and the services (which
        # may serve more models) write the same bytes.
        message = f"model {name!r} is not served here: no worker pool serves a model of that name"
        return RequestError(request.index, request.custom_id, "model_not_found", message)

    def job_error(self) -> tuple[str, str] | None:
        """The reason the whole input is not a batch, if it is not one."""
        return job_error(self.ledger.counts())

    def plan(self) -> dict[str, JobPlan]:
        """Groups the lines this ingestor took (the whole job, when it took every line): one plan
        per model that has lines, the job's own model always among them."""
        self.ledger.forget_custom_ids()
        return plan_models(self.models, self.default_model, self.settings)


class ModelLines:
    """The lines of one model in a job: a prefix index of their prompts, with their line indices
    in the same order."""

    def __init__(self, block_size: int) -> None:
        self.index = PrefixIndex(block_size)
        self.line_indices = array.array("q")

    def add(self, line: int, tokens: np.ndarray) -> None:
        self.index.add(tokens)
        self.line_indices.append(line)


def plan_models(
    models: Mapping[str, ModelLines], default_model: str, settings: IngestSettings
) -> dict[str, JobPlan]:
    """One plan per model, the default model's first (and present even with no lines, so that a
    job whose lines all failed still has a model to be queued under), the others by name."""
    names = [default_model, *sorted(set(models) - {default_model})]
    plans = {}
    for name in names:
        lines = models.get(name) or ModelLines(settings.block_size)
        plans[name] = plan_groups(lines.index, lines.line_indices, settings)
    return plans
