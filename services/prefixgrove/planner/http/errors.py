"""Errors in OpenAI's shape, and the gRPC call context through which the HTTP API calls the
planner service: an abort there becomes an HTTP error here."""

from __future__ import annotations

from typing import NoReturn

import grpc
from aiohttp import web

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}


class ApiError(Exception):
    """An answer other than 2xx, with what OpenAI's clients read: a message, a type and a code."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code

    def response(self) -> web.Response:
        kind = "authentication_error" if self.status == 401 else "invalid_request_error"
        error = {"message": self.message, "type": kind, "param": None, "code": self.code}
        return web.json_response({"error": error}, status=self.status)


def not_found(what: str, name: str) -> ApiError:
    return ApiError(404, f"No such {what}: {name!r}", "not_found")


class ServiceCall:
    """Stands in for a gRPC context when the HTTP API calls PlannerService's methods: the same
    checks run, and an abort raises ApiError with the matching HTTP status."""

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise ApiError(_HTTP_STATUS.get(code, 500), details, code.name.lower())

    def is_active(self) -> bool:
        return True
