"""The OpenAI Batch API's routes under /v1: files (upload, list, retrieve, content, delete) and
batches (create, retrieve, cancel, list), behind the planner's bearer token.

The service and Redis calls block: each runs in a thread of the loop's default executor, so
one slow call never holds the others."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from aiohttp import BodyPartReader, MultipartReader, web
from aiohttp.http_exceptions import BadHttpMessage

from prefixgrove.planner.http.batches import MAX_LIST, Batches, is_result_file
from prefixgrove.planner.http.errors import ApiError, not_found
from prefixgrove.planner.http.files import READ_CHUNK, Files, PartialFile, file_object

_BATCHES = web.AppKey("batches", Batches)
_FILES = web.AppKey("files", Files)  # type: ignore[type-abstract]
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_MAX_FIELD_BYTES = 1024  # an upload's form fields but its file
_FILES_PAGE = 10_000  # files in one list answer, as OpenAI's API has it
_BATCHES_PAGE = 20


def build_app(batches: Batches, files: Files, token: str | None) -> web.Application:
    app = web.Application(middlewares=[_errors_middleware(), _token_middleware(token)])
    app[_BATCHES] = batches
    app[_FILES] = files
    app.router.add_post("/v1/files", upload_file)
    app.router.add_get("/v1/files", list_files)
    app.router.add_get("/v1/files/{file_id}", retrieve_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", retrieve_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)
    return app


def _errors_middleware() -> Any:
    @web.middleware
    async def errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except web.HTTPException as exc:  # no such route, wrong method
            return ApiError(exc.status, exc.reason).response()

    return errors


def _token_middleware(token: str | None) -> Any:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def check_token(request: web.Request, handler: _Handler) -> web.StreamResponse:
        sent = request.headers.get("Authorization", "").encode()
        if token and not hmac.compare_digest(sent, expected):
            raise ApiError(401, "missing or wrong bearer token (the planner's auth token)",
                           "invalid_api_key")  # fmt: skip
        return await handler(request)

    return check_token


# --- files ----------------------------------------------------------------------------------
async def upload_file(request: web.Request) -> web.Response:
    """Streams the `file` part to disk a chunk at a time: the planner never holds a whole file."""
    files = request.app[_FILES]
    form = _Form()
    try:
        try:
            await _read_form(request, files, form)
        except _MALFORMED as exc:
            raise ApiError(
                400, f"the upload is not well-formed multipart/form-data: {exc}"
            ) from None
        if form.upload is None:
            raise ApiError(400, "the upload has no `file` part (multipart/form-data)")
        if form.purpose != "batch":
            raise ApiError(400, f"purpose {form.purpose!r} is not served: expected 'batch'")
        finished = await asyncio.to_thread(files.finish, form.upload, form.filename, form.purpose)
        return web.json_response(finished)
    finally:
        if form.upload is not None:
            await asyncio.to_thread(
                files.discard, form.upload
            )  # a finished file was renamed away: only its lock goes


@dataclass
class _Form:
    """What an upload's form gave so far."""

    purpose: str = ""
    filename: str = ""
    upload: PartialFile | None = None


async def _read_form(request: web.Request, files: Files, form: _Form) -> None:
    async for part in await _multipart(request):
        if not isinstance(part, BodyPartReader):
            continue
        if part.name == "purpose":
            form.purpose = await _small_text(part, "purpose")
        elif part.name == "file" and form.upload is None:
            form.filename = part.filename or "upload.jsonl"
            form.upload = await asyncio.to_thread(files.create)
            await _copy(part, form.upload.handle)


# what aiohttp's multipart reader raises on a body it cannot read
_MALFORMED = (ValueError, AssertionError, LookupError, RuntimeError, BadHttpMessage)


async def _multipart(request: web.Request) -> MultipartReader:
    if not request.content_type.startswith("multipart/"):
        raise ApiError(400, f"Content-Type {request.content_type!r} is invalid: an upload is "
                            "multipart/form-data")  # fmt: skip
    return await request.multipart()


async def _small_text(part: BodyPartReader, name: str) -> str:
    """A form field's text, read no further than _MAX_FIELD_BYTES."""
    data = b""
    while chunk := await part.read_chunk(_MAX_FIELD_BYTES):
        data += chunk
        if len(data) > _MAX_FIELD_BYTES:
            raise ApiError(400, f"{name} is longer than {_MAX_FIELD_BYTES} bytes")
    return data.decode("utf-8", errors="replace")


async def _copy(part: BodyPartReader, handle: BinaryIO) -> None:
    # NOTE: off the loop: a write into a bucket's file uploads a part whenever one is full
    while chunk := await part.read_chunk(READ_CHUNK):
        await asyncio.to_thread(handle.write, chunk)


async def list_files(request: web.Request) -> web.Response:
    """Newest first; a page starts after the file `after` names."""
    limit = _limit(request, _FILES_PAGE, _FILES_PAGE)
    objects = await asyncio.to_thread(request.app[_FILES].list)
    purpose = request.query.get("purpose")
    data = [o for o in objects if purpose is None or o["purpose"] == purpose]
    after = request.query.get("after")
    if after:
        ids = [o["id"] for o in data]
        if after not in ids:
            raise not_found("file", after)
        data = data[ids.index(after) + 1 :]
    return web.json_response({"object": "list", "data": data[:limit],
                              "has_more": len(data) > limit})  # fmt: skip


def _limit(request: web.Request, default: int, most: int) -> int:
    """The query's `limit`: a whole number from 1 to `most`."""
    text = request.query.get("limit", str(default))
    if not (text.isascii() and text.isdigit() and len(text) < 10 and 1 <= int(text) <= most):
        raise ApiError(400, f"limit {text[:40]!r} is invalid: expected a whole number from 1 to "
                            f"{most}")  # fmt: skip
    return int(text)


async def retrieve_file(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    if not is_result_file(file_id):
        return web.json_response(await asyncio.to_thread(request.app[_FILES].get, file_id))
    return web.json_response(await asyncio.to_thread(_result_file_object, request, file_id))


def _result_file_object(request: web.Request, file_id: str) -> dict[str, Any]:
    """A result file's size is that of its lines, counted as they stream from Redis."""
    job, lines = request.app[_BATCHES].result_lines(file_id)
    size = sum(len(line.encode()) + 1 for line in lines)
    name = "output" if file_id.startswith("file-output-") else "errors"
    return file_object(file_id, size, job.finished_at, f"{job.id}_{name}.jsonl", "batch_output")


async def file_content(request: web.Request) -> web.StreamResponse:
    file_id = request.match_info["file_id"]
    if is_result_file(file_id):
        _, lines = await asyncio.to_thread(request.app[_BATCHES].result_lines, file_id)
        chunks = _joined(lines)
    else:
        await asyncio.to_thread(request.app[_FILES].get, file_id)  # missing: 404 before the answer
        chunks = request.app[_FILES].chunks(file_id)
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    await response.prepare(request)
    while chunk := await asyncio.to_thread(next, chunks, b""):
        await response.write(chunk)
    await response.write_eof()
    return response


def _joined(lines: Iterator[str]) -> Iterator[bytes]:
    """Lines, newline-ended, in chunks of about READ_CHUNK bytes."""
    chunk: list[bytes] = []
    size = 0
    for line in lines:
        chunk.append(line.encode() + b"\n")
        size += len(chunk[-1])
        if size >= READ_CHUNK:
            yield b"".join(chunk)
            chunk, size = [], 0
    if chunk:
        yield b"".join(chunk)


async def delete_file(request: web.Request) -> web.Response:
    file_id = request.match_info["file_id"]
    if is_result_file(file_id):
        raise ApiError(400, f"file {file_id} is a batch's results: it goes with its batch")
    return web.json_response(await asyncio.to_thread(request.app[_FILES].delete, file_id))


# --- batches --------------------------------------------------------------------------------
async def create_batch(request: web.Request) -> web.Response:
    try:
        body = json.loads(await request.read())
    except ValueError as exc:  # not UTF-8, or not JSON
        raise ApiError(400, f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    batch = await asyncio.to_thread(request.app[_BATCHES].create, body)
    return web.json_response(batch)


async def retrieve_batch(request: web.Request) -> web.Response:
    batches = request.app[_BATCHES]
    return web.json_response(await asyncio.to_thread(batches.get, request.match_info["batch_id"]))


async def cancel_batch(request: web.Request) -> web.Response:
    batches = request.app[_BATCHES]
    batch_id = request.match_info["batch_id"]
    return web.json_response(await asyncio.to_thread(batches.cancel, batch_id))


async def list_batches(request: web.Request) -> web.Response:
    limit = _limit(request, _BATCHES_PAGE, MAX_LIST)
    after = request.query.get("after")
    page = await asyncio.to_thread(request.app[_BATCHES].list, after, limit)
    return web.json_response(page)
