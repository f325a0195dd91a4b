"""The template server's ASGI middleware, outside FastAPI's routing: :class:`PathGuard`
(GET and HEAD only; no encoded slashes, backslashes, NULs or dot segments) and
:class:`PackFastPath` (the layout's pack route answered in front of FastAPI).

Order (outermost first, as :func:`cloud.server.create_app` adds them): the metrics
middleware, the path guard, the fast path, FastAPI. With the fast path, pack ranges of the
layout route reach 1.01 GB/s against nginx's 2.36 on a quiet host, 0.43x, where they were
0.57 against 2.07, 0.28x (``docs/bench/serve.json`` has the recorded run; the reasons and
the per-range measurements are in :class:`PackFastPath`'s docstring).
"""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import FastAPI, Request
from sakura.cloud import layout, layout_routes
from sakura.cloud.api_errors import ApiError, error_response
from sakura.cloud.errors import ErrorCode
from sakura.cloud.metrics import METHODS
from sakura.cloud.responses import Blocking
from sakura.cloud.state import ServerState
from sakura.cloud.storage import LocalStorage


class PathGuard:
    """Rejects methods other than GET and HEAD (405, or 501 for unknown ones) and request
    targets with encoded slashes/backslashes/NULs or dot segments (400)."""

    _BAD_RAW = (b"%2f", b"%5c", b"%00", b"\\")

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") not in ("GET", "HEAD"):
            method = str(scope.get("method", ""))
            response = error_response(
                405 if method in METHODS else 501,
                f"method {method[:16]!r} is not supported: this server answers GET and HEAD",
                {"Allow": "GET, HEAD"},
                code=ErrorCode.METHOD_NOT_ALLOWED,
            )
            await response(scope, receive, send)
            return
        if scope["type"] == "http":
            raw = (
                scope.get("raw_path") or scope.get("path", "").encode("utf-8", "surrogateescape")
            ).lower()
            path = scope.get("path", "")
            segments = path.split("/")
            if (
                any(bad in raw for bad in self._BAD_RAW)
                or "\x00" in path
                or any(s in (".", "..") for s in segments)
            ):
                response = error_response(
                    400,
                    "invalid request path: encoded slashes, backslashes, NULs and dot segments are not allowed",
                    code=ErrorCode.BAD_REQUEST,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class PackFastPath:
    """ASGI middleware answering ``GET``/``HEAD /templates/<id>/<codec>/<pack_file>`` (the
    route the edge reads every configuration by) without FastAPI's routing, ``Request``
    dependency solving and worker-thread hop; everything else goes to FastAPI unchanged.

    It sits inside :class:`PathGuard` and the metrics middleware (so both apply as to any
    route; ``scope["route"]`` is set to the FastAPI route, so the metrics label is the
    same), and builds the response with the functions the FastAPI route calls
    (:func:`cloud.layout_routes.layout_pack`: token check, catalog resolution, one Range
    parse, the unit check), so what is verified, what is sent and every error stay those of
    the route.
    The work runs on the event loop: for a local folder it is a ``stat`` of catalog.json,
    an ``open`` of the pack and a set lookup in the verified-unit cache (catalog.json and a
    new manifest are read and parsed there once per change, as the JSON caches do). A
    range with units not checked yet raises :class:`Blocking` before any is read, and the
    request is done again in a worker thread, as FastAPI would run it. A bucket (S3) is
    never served here: its reads are network calls.

    Why (issue 29 item 7): profiled under ``sakura bench serve`` (py-spy, one process),
    FastAPI's handling around this one route (routing over every route, ``Request`` and
    dependency solving, exception wrappers) and the worker-thread hop with its GIL
    hand-over (``Condition.notify`` alone 7% of the GIL-holding samples) were most of the
    Python per range that was not the send. Measured as the server's CPU time per range
    (``/proc/<pid>/stat``, 32 clients, the same build otherwise): 1829 -> 1311 and
    1432 -> 862 us in two alternating runs on the shared 2-core host.
    """

    ROUTE = "/templates/{template_id}/{codec}/{name}"

    def __init__(self, app: Any, fastapi_app: FastAPI) -> None:
        self.app = app
        self.fastapi_app = fastapi_app
        # the layout route by method, from its router: the route object FastAPI puts in
        # scope["route"] when it routes such a request itself (an included router's routes
        # are not listed in the app's own)
        self.routes: dict[str, Any] = {
            method: route for route in layout_routes.router.routes
            if getattr(route, "path", None) == self.ROUTE
            for method in getattr(route, "methods", ())
        }

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("root_path"):
            await self.app(scope, receive, send)
            return
        parts = scope["path"].split("/")
        state: ServerState = self.fastapi_app.state.sakura
        route = self.routes.get(scope["method"])
        if (
            len(parts) != 5
            or parts[1] != "templates"
            or route is None
            or not (parts[2] and parts[3] and layout.valid_pack_file(parts[4]))
            or not isinstance(state.storage, LocalStorage)
        ):
            await self.app(scope, receive, send)
            return
        _, _, template_id, codec, name = parts
        scope["route"] = route
        scope["endpoint"] = route.endpoint
        scope["path_params"] = {"template_id": template_id, "codec": codec, "name": name}
        request = Request(scope, receive)
        try:
            try:
                response = layout_routes.layout_pack(request, template_id, codec, name,
                                                     inline=True)
            except Blocking:
                response = await anyio.to_thread.run_sync(
                    layout_routes.layout_pack, request, template_id, codec, name)
        except ApiError as exc:
            response = error_response(exc.status, exc.message, exc.headers, code=exc.code)
        await response(scope, receive, send)
