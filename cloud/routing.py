"""How the template server's routes are registered: every route answers GET and HEAD, each
with its own OpenAPI operation id (``get_<name>``, ``head_<name>``), and the routes under
auth document the bearer scheme (:data:`bearer`). The route modules (``*_routes.py``) each
fill one :class:`fastapi.APIRouter` with these helpers."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.security import HTTPBearer
from sakura.cloud.responses import OCTET
from starlette.responses import Response

# the OpenAPI security scheme of the routes under auth; the token itself is checked by
# cloud.resolve.authorize on every route, this dependency only documents it
bearer = HTTPBearer(
    auto_error=False, description="Bearer token (only when the server runs with tokens)"
)


def get_head(router: APIRouter, path: str, **kwargs: Any) -> Any:
    """Register a route for GET and HEAD (distinct OpenAPI operation ids)."""

    def deco(endpoint: Any) -> Any:
        for method in ("GET", "HEAD"):
            router.add_api_route(path, endpoint, methods=[method],
                                 operation_id=f"{method.lower()}_{endpoint.__name__}", **kwargs)
        return endpoint

    return deco


def add_get_head(
    router: APIRouter, path: str, endpoint: Any, name: str, summary: str, json_body: bool = False,
    openapi_extra: dict[str, Any] | None = None,
) -> None:
    """Register ``endpoint`` for GET and HEAD with distinct OpenAPI operation ids."""
    responses: dict[int | str, dict[str, Any]] = {
        200: {
            "description": "The full body",
            "content": {"application/json" if json_body else OCTET: {}},
        },
        206: {"description": "Partial content (one range, or multipart/byteranges)"},
        304: {"description": "Not modified (If-None-Match)"},
        400: {"description": "Invalid id or rejected Range header"},
        404: {"description": "Unknown template, codec, shard or config"},
        412: {"description": "If-Match failed"},
        416: {"description": "Range not satisfiable"},
    }
    for method in ("GET", "HEAD"):
        router.add_api_route(
            path,
            endpoint,
            methods=[method],
            tags=["packs"],
            summary=summary,
            response_class=Response,
            responses=responses,
            operation_id=f"{method.lower()}_{name}",
            openapi_extra=openapi_extra,
        )
