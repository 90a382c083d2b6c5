"""Parquet datasets in and out of `prefixgrove run`, a row group at a time (pyarrow).

In: each row becomes one OpenAI Batch request line: its prompt column's text as a
`/v1/completions` prompt, or its messages column (a list of {role, content}) as a
`/v1/chat/completions` body; `custom_id` is the id column's value (default: `row-<n>`), and the
sampling JSON's fields join every body. The id column (if named) is carried along as a column; the
lines' own custom_id is `row-<n>`, which ties each answer to its row. Out: the input's columns with `generated_text`,
`finish_reason`, `prompt_tokens`, `completion_tokens` and `error` added, row for row, read back
from the run's JSONL outputs (which stay beside it, so `--resume` works as for JSONL). Without the
input's rows (`results` with no dataset), the answers alone: `custom_id` and the result columns.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, cast

from prefixgrove import settings as cfg
from prefixgrove.input_lines import open_source
from prefixgrove.output_files import replaced
from prefixgrove.settings import StorageSettings
from prefixgrove.storage.locations import is_url
from prefixgrove.storage.staged import StagedObject
from prefixgrove.storage.stores import storage_error

RESULT_COLUMNS = ("generated_text", "finish_reason", "prompt_tokens", "completion_tokens", "error")


def _result_types() -> dict[str, Any]:
    import pyarrow as pa

    kinds = (pa.string(), pa.string(), pa.int64(), pa.int64(), pa.string())
    return dict(zip(RESULT_COLUMNS, kinds, strict=True))


def is_parquet(source: Path | str) -> bool:
    return str(source).endswith(".parquet")


@dataclass(frozen=True)
class ParquetColumns:
    prompt: str = ""  # a text column: completions
    messages: str = ""  # a list-of-messages column: chat
    id: str = ""  # a column that must exist, carried into the output like every other
    sampling: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if bool(self.prompt) == bool(self.messages):
            raise ValueError("a Parquet input needs one of --prompt-column and --messages-column")


def columns_of(args: Any) -> ParquetColumns:
    """The columns and sampling JSON the command line names (--prompt-column, ...)."""
    try:
        sampling = json.loads(args.sampling_json)
    except ValueError as exc:
        raise ValueError(f"--sampling-json is not JSON: {exc}") from None
    if not isinstance(sampling, dict):
        raise ValueError("--sampling-json must be a JSON object of body fields")
    return ParquetColumns(args.prompt_column, args.messages_column, args.id_column, sampling)


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("Parquet needs pyarrow: pip install 'prefixgrove[parquet]'") from None
    return pq


def _open_parquet(source: Path | str) -> Any:
    """A ParquetFile over a local file or an object (read by ranges: a row group at a time)."""
    pq = _pyarrow()
    if not is_url(source):
        return pq.ParquetFile(str(source))
    import obstore

    from prefixgrove.storage.locations import ObjectLocation
    from prefixgrove.storage.stores import store_for

    location = ObjectLocation.parse(str(source))
    try:
        reader = obstore.open_reader(store_for(location), location.key)
    except Exception as exc:
        raise storage_error(exc, location.url, "reading") from None
    return pq.ParquetFile(_Ranges(reader))


def request_lines(source: Path | str, columns: ParquetColumns) -> Iterator[bytes]:
    """One request line per row, row group by row group."""
    dataset = _open_parquet(source)
    wanted = [c for c in (columns.prompt, columns.messages, columns.id) if c]
    missing = [c for c in wanted if c not in dataset.schema_arrow.names]
    if missing:
        raise ValueError(
            f"{source}: no column {missing[0]!r}; columns: {dataset.schema_arrow.names}"
        )
    row = 0
    for group in range(dataset.num_row_groups):
        for record in dataset.read_row_group(group, columns=wanted).to_pylist():
            yield json.dumps(_request(record, row, columns), ensure_ascii=False).encode()
            row += 1


def _request(record: dict[str, Any], row: int, columns: ParquetColumns) -> dict[str, Any]:
    custom_id = f"row-{row}"
    if columns.prompt:
        url, body = "/v1/completions", {"prompt": record[columns.prompt]}
    else:
        url, body = "/v1/chat/completions", {"messages": record[columns.messages]}
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {**columns.sampling, **body}}  # fmt: skip


def write_jsonl(source: Path | str, columns: ParquetColumns, target: Path) -> Path:
    """The dataset as a batch file (what the run reads), written a row at a time."""
    with target.open("wb") as f:
        for line in request_lines(source, columns):
            f.write(line + b"\n")
    return target


def write_results(
    source: Path | str, outputs: Path | str, errors: Path | str, target: Path | str
) -> int:
    """The input's rows with the result columns, row group by row group; returns the rows."""
    import pyarrow as pa

    pq = _pyarrow()
    dataset = _open_parquet(source)
    answers = _answers(outputs, errors)
    schema = dataset.schema_arrow
    types = _result_types()
    for name, kind in types.items():
        schema = schema.append(pa.field(name, kind))
    rows = 0
    with _output(target) as out:
        sink = _Sink(out)
        writer = pq.ParquetWriter(sink, schema)
        try:
            for group in range(dataset.num_row_groups):
                table = dataset.read_row_group(group)
                results = [_next_answer(answers, source) for _ in range(table.num_rows)]
                for name, kind in types.items():
                    column = pa.array([r.get(name) for r in results], type=kind)
                    table = table.append_column(name, column)
                writer.write_table(table)
                rows += table.num_rows
            if next(answers, None) is not None:
                raise ValueError(f"{source}: the job answered more requests than its {rows} rows")
            writer.close()
        finally:
            sink.closed = True  # NOTE: a writer left open on an error writes nothing more
    return rows


def _next_answer(answers: Iterator[dict[str, Any]], source: Path | str) -> dict[str, Any]:
    answer = next(answers, None)
    if answer is None:
        raise ValueError(f"{source}: more rows than the job has answers (another dataset?)")
    return answer


def write_result_columns(
    outputs: Path | str, errors: Path | str, target: Path | str, group_rows: int = 10_000
) -> int:
    """The answers alone, where the input's rows are not at hand: `custom_id` and the result
    columns, a row per line (the output lines, then the error lines), `group_rows` to a row
    group; returns the rows."""
    import pyarrow as pa

    pq = _pyarrow()
    types = {"custom_id": pa.string(), **_result_types()}
    schema = pa.schema([pa.field(name, kind) for name, kind in types.items()])
    rows = 0
    with _output(target) as out:
        sink = _Sink(out)
        writer = pq.ParquetWriter(sink, schema)
        try:
            for batch in _batches(_result_lines(outputs, errors), group_rows):
                columns = [pa.array([r.get(n) for r in batch], type=k) for n, k in types.items()]
                writer.write_table(pa.Table.from_arrays(columns, schema=schema))
                rows += len(batch)
            writer.close()
        finally:
            sink.closed = True  # NOTE: as in write_results
    return rows


def _result_lines(*sources: Path | str) -> Iterator[dict[str, Any]]:
    for source in sources:
        with open_source(source) as f:
            for raw in f:
                line = json.loads(raw)
                yield {"custom_id": str(line["custom_id"]), **_result(line)}


def _batches(records: Iterator[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for record in records:
        batch.append(record)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


@contextmanager
def _output(target: Path | str) -> Iterator[BinaryIO]:
    """The Parquet file, whole under its name once written: a file renamed into place, or an
    object committed from its parts."""
    if not is_url(target):
        with replaced(Path(target)) as f:
            yield f
        return
    staged = StagedObject(str(target), cfg.load(StorageSettings).object_part_bytes)
    staged.start()
    yield cast(BinaryIO, staged)
    staged.commit()


def _answers(outputs: Path | str, errors: Path | str) -> Iterator[dict[str, Any]]:
    """Each row's result, in input order, from the output and error lines (each file in input
    order; a line's custom_id `row-<n>` names its row)."""
    ok, failed = _lines(outputs), _lines(errors)
    heads: list[dict[str, Any] | None] = [next(ok, None), next(failed, None)]
    while heads[0] is not None or heads[1] is not None:
        side = (
            0
            if heads[1] is None or (heads[0] is not None and heads[0]["_i"] < heads[1]["_i"])
            else 1
        )
        line = heads[side]
        assert line is not None
        yield _result(line)
        heads[side] = next(ok if side == 0 else failed, None)


def _lines(source: Path | str) -> Iterator[dict[str, Any]]:
    with open_source(source) as f:
        for raw in f:
            record = json.loads(raw)
            record["_i"] = _row_of(str(record["custom_id"]), source)
            yield record


def _row_of(custom_id: str, source: Path | str) -> int:
    row = custom_id.removeprefix("row-")
    if custom_id == row or not row.isdigit():
        raise ValueError(f"{source}: custom_id {custom_id!r} is not row-<n>: these answers are "
                         "not of a Parquet dataset's rows")  # fmt: skip
    return int(row)


def _result(line: dict[str, Any]) -> dict[str, Any]:
    if line.get("error"):
        return {"error": f"{line['error'].get('code')}: {line['error'].get('message')}"}
    body = line["response"]["body"]
    choice = body["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    usage = body["usage"]
    return {"generated_text": text, "finish_reason": choice["finish_reason"],
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"]}  # fmt: skip


class _Sink:
    """What pyarrow writes to: a file or a staged object, which counts what it was given."""

    def __init__(self, out: BinaryIO) -> None:
        self.out, self.position, self.closed = out, 0, False

    def write(self, data: Any) -> int:
        if self.closed:
            return 0
        self.out.write(bytes(data))
        self.position += len(data)
        self.out.flush()
        return len(data)

    def tell(self) -> int:
        return self.position

    def flush(self) -> None:
        self.out.flush()

    def close(self) -> None:
        self.closed = True


class _Ranges:
    """An object read by ranges, as pyarrow reads a file (its footer, then one row group)."""

    closed = False

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return bytes(self.reader.read(None if size < 0 else size))

    def seek(self, offset: int, whence: int = 0) -> int:
        return int(self.reader.seek(offset, whence))

    def tell(self) -> int:
        return int(self.reader.tell())

    def size(self) -> int:
        return int(self.reader.size)

    def close(self) -> None:
        self.closed = True
