"""A job's input, streamed: lines -> validated, tokenized requests; then the whole job grouped.

What is held per request until grouping is its custom_id and its prefix index entry (a hash per
shareable KV block, prefix_index.py); the parsed requests and their tokens go out to the caller
(Redis, or the local run) batch by batch.
"""

from __future__ import annotations

import array
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from prefixgrove.jobs.prefix_index import PrefixIndex
from prefixgrove.jobs.requests import BatchRequest, RequestError, parse_line
from prefixgrove.jobs.schema import GroupRecord
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


class JobIngestor:
    """Validates and tokenizes one job's lines as they arrive; groups the job when it is sealed."""

    def __init__(self, tokenizer: PromptTokenizer, settings: IngestSettings) -> None:
        self.tokenizer = tokenizer
        self.settings = settings
        self.total = 0  # request lines (blank lines are not requests)
        self.json_lines = 0  # lines that parsed as JSON objects
        self.prompt_tokens = 0
        self.index = PrefixIndex(settings.block_size)
        self.line_indices = array.array("q")
        self.encoding: str | None = None  # set when the input is not UTF-8: no line is read
        self._seen: set[str] = set()

    def add(self, lines: Iterable[bytes | str]) -> IngestedBatch:
        out = IngestedBatch()
        parsed: list[BatchRequest] = []
        for line in lines:
            if not line.strip():
                continue
            if self.total == 0:
                line = self._first_line(line)
            if self.encoding is not None:
                self.total += 1
                continue
            item = self._parse(line)
            if isinstance(item, RequestError):
                out.errors.append(item)
            else:
                parsed.append(item)
        step = self.settings.tokenize_batch
        for start in range(0, len(parsed), step):
            chunk = parsed[start : start + step]
            for request, tokens in zip(chunk, self.tokenizer.encode(chunk), strict=True):
                if isinstance(tokens, RequestError):
                    out.errors.append(tokens)
                    continue
                self.index.add(tokens)
                self.line_indices.append(request.index)
                self.prompt_tokens += len(tokens)
                out.requests.append((request, tokens))
        out.errors.sort(key=lambda e: e.index)
        return out

    def _first_line(self, line: bytes | str) -> bytes | str:
        """The first line without a UTF-8 byte order mark; notes an input in UTF-16 or UTF-32."""
        if isinstance(line, str):
            return line.removeprefix("\ufeff")
        self.encoding = foreign_encoding(line)
        return line.removeprefix(_UTF8_BOM)

    def _parse(self, line: bytes | str) -> BatchRequest | RequestError:
        index = self.total
        self.total += 1
        item = parse_line(
            line,
            index,
            max_line_bytes=self.settings.max_line_bytes,
            default_max_tokens=self.settings.default_max_tokens,
        )
        if isinstance(item, BatchRequest) or item.code not in _NOT_JSON:
            self.json_lines += 1
        if isinstance(item, RequestError):
            return item
        if index >= self.settings.max_requests_per_job:
            limit = self.settings.max_requests_per_job
            return RequestError(
                index, item.custom_id, "job_too_large", f"a job holds at most {limit} requests"
            )
        if item.custom_id in self._seen:
            return RequestError(
                index,
                item.custom_id,
                "duplicate_custom_id",
                f"custom_id {item.custom_id!r} is used by an earlier line",
            )
        self._seen.add(item.custom_id)
        return item

    def job_error(self) -> tuple[str, str] | None:
        """The reason the whole input is not a batch, if it is not one."""
        if self.total == 0:
            return "empty_file", "the input holds no request lines"
        if self.encoding is not None:
            return (
                "invalid_encoding",
                f"the input is {self.encoding}, not UTF-8: save it as UTF-8 (for example "
                f"`iconv -f {self.encoding.split()[0]} -t UTF-8 IN > OUT`)",
            )
        if self.json_lines == 0:
            return (
                "invalid_file",
                f"none of the {self.total} lines is a JSON object: the input is not JSONL",
            )
        return None

    def plan(self) -> JobPlan:
        """Groups the whole job by shared prefix; requests in no group travel in small chunks."""
        s = self.settings
        self._seen.clear()  # no more lines come: make room for grouping's own copy of the prompts
        result = self.index.group(s.min_prefix_len, s.max_group_requests)
        lines = self.line_indices
        units = [
            GroupRecord(g.prefix_len, [lines[i] for i in g.request_indices]) for g in result.groups
        ]
        rest = [lines[i] for i in result.ungrouped]
        for start in range(0, len(rest), s.ungrouped_chunk):
            units.append(GroupRecord(0, rest[start : start + s.ungrouped_chunk]))
        return JobPlan(units, result.tokens_saved, len(result.groups))
