"""How the template server answers a request that fails: ``{"error": message, "code":
code}`` with the status, never a traceback.

:class:`ApiError` is what the server's code raises; :func:`error_response` is the one JSON
body of every failure (the ASGI middleware answers with it directly);
:func:`install_error_handlers` maps ApiError, Starlette's HTTP errors (unknown route: 404),
FastAPI's validation errors (400) and anything unexpected (500 ``internal``, logged) to it.
The codes are :class:`sakura.cloud.errors.ErrorCode`'s (the table is in ``cloud/README.md``).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sakura.cloud.errors import ErrorCode
from starlette.exceptions import HTTPException as StarletteHTTPException

# every module of the server logs as "sakura.cloud.server" (tests and `sakura bench faults`
# set that logger's level)
log = logging.getLogger("sakura.cloud.server")


class ApiError(Exception):
    """An error answered as ``{"error": message, "code": code}`` with ``status`` (and extra
    headers); ``code`` is one of :class:`~sakura.cloud.errors.ErrorCode`'s."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, *,
                 code: str) -> None:
        super().__init__(message)
        assert code in ErrorCode.ALL, code
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.code = code


def error_response(status: int, message: str, headers: dict[str, str] | None = None, *,
                   code: str) -> JSONResponse:
    """The JSON error body of every failed request: the message for people, the stable
    ``code`` (:class:`~sakura.cloud.errors.ErrorCode`) for programs."""
    return JSONResponse({"error": message, "code": code}, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every failed request of ``app`` with :func:`error_response`."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal_error)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.headers, code=exc.code)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = exc.detail if isinstance(exc.detail, str) else "error"
    if exc.status_code == 404 and message == "Not Found":
        message = f"no such route: {request.url.path[:200]}"
    return error_response(exc.status_code, message, getattr(exc, "headers", None),
                          code=ErrorCode.for_status(exc.status_code))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()))
    return error_response(400, f"invalid request: {where}: {first.get('msg', 'invalid')}",
                          code=ErrorCode.BAD_REQUEST)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return error_response(500, "internal server error", code=ErrorCode.INTERNAL)
