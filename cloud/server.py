"""The SAKURA template server: catalog, manifests, raw packs with HTTP Range, shard bodies.

``create_app(storage, tokens=None)`` returns a FastAPI app; all state lives on
``app.state.sakura`` (:class:`~sakura.cloud.state.ServerState`). See ``cloud/README.md``
for the API table and the Range decisions; :mod:`cloud.ranges` holds the header parsing.
This module only wires the app together; each mechanism has its module:

* ``cloud/state.py``: settings, the app state, the catalog/manifest and hash caches
* ``cloud/resolve.py``: id and token checks; catalog -> one manifest and pack version
* ``cloud/verify.py``: unit checksums checked on storage before any byte is served
* ``cloud/responses.py``: Range / If-Range / If-Match / If-None-Match and the pack-byte
  responses (one Range parse; sendfile by :mod:`cloud.zerocopy`)
* ``cloud/api_errors.py``: the ``{"error", "code"}`` answers and the exception handlers
* ``cloud/middleware.py``: the path guard and the pack fast path, in front of FastAPI
* ``cloud/routing.py``: GET + HEAD registration, the bearer scheme
* ``cloud/health_routes.py``: ``/healthz``, ``/metrics``
* ``cloud/catalog_routes.py``: ``/v1/templates``, ``/v1/templates/{id}``, ``.../manifest``
* ``cloud/pack_routes.py``: ``/v1/.../pack`` and the shard endpoint
* ``cloud/layout_routes.py``: ``/catalog.json``, ``/templates/{id}/{codec}/{name}``

Errors are ``{"error": message, "code": code}``; the codes are
:class:`sakura.cloud.errors.ErrorCode`'s (the table is in ``cloud/README.md``).
"""

from __future__ import annotations

from fastapi import FastAPI
from sakura.cloud import (
    bundle_routes,
    catalog_routes,
    health_routes,
    layout_routes,
    pack_routes,
)
from sakura.cloud.api_errors import ApiError, error_response, install_error_handlers
from sakura.cloud.auth import TokenSet
from sakura.cloud.metrics import MetricsMiddleware
from sakura.cloud.middleware import PackFastPath, PathGuard
from sakura.cloud.resolve import Resolved
from sakura.cloud.responses import OCTET, Body, PackResponse
from sakura.cloud.state import HashCache, JsonCache, ServerSettings, ServerState
from sakura.cloud.storage import Storage
from sakura.cloud.verify import UnitVerifier

# what other modules and tests import from here
__all__ = [
    "OCTET",
    "ApiError",
    "Body",
    "HashCache",
    "JsonCache",
    "PackFastPath",
    "PackResponse",
    "PathGuard",
    "Resolved",
    "ServerSettings",
    "ServerState",
    "UnitVerifier",
    "create_app",
    "error_response",
]


def create_app(
    storage: Storage,
    tokens: TokenSet | None = None,
    *,
    settings: ServerSettings | None = None,
) -> FastAPI:
    """The SAKURA template server over ``storage``; ``tokens`` enables bearer auth."""
    settings = settings or ServerSettings()
    app = FastAPI(
        title="SAKURA template server",
        version="1",
        summary="Template catalog, pack manifests, raw packs with HTTP Range, and shard bodies.",
        description=(
            "Serves published SAKURA template packs. `/v1/*` routes need `Authorization: Bearer "
            "<token>` when the server runs with tokens; `/healthz`, `/metrics` and the OpenAPI "
            'documents are always open. Errors are JSON objects `{"error": "...", "code": "..."}`; '
            "`code` is stable (see cloud/README.md), the message is for people."
        ),
    )
    app.state.sakura = ServerState(storage, tokens, settings)
    app.add_middleware(PackFastPath, fastapi_app=app)  # innermost: behind the guard, counted
    app.add_middleware(PathGuard)
    app.add_middleware(MetricsMiddleware, metrics=app.state.sakura.metrics)
    install_error_handlers(app)
    # in this order: the OpenAPI document lists the paths as registered
    for routes in (health_routes, catalog_routes, pack_routes, layout_routes, bundle_routes):
        app.include_router(routes.router)
    return app
