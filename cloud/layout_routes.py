"""The published layout served as nginx or an S3 bucket serve it, which is what the edge
reads: ``/catalog.json`` (filtered to the token's templates) and
``/templates/{id}/{codec}/{name}``: ``manifest.json``, ``<stem>.manifest.json`` or the
immutable pack itself, with exactly the Range rules of ``/v1/.../pack``.

The pack file is read by one single-range GET per configuration; from a local folder those
requests are answered in front of FastAPI by :class:`cloud.middleware.PackFastPath`, with
:func:`layout_pack`, the function this route calls, so both answer alike.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Security
from fastapi.security import HTTPAuthorizationCredentials
from sakura.cloud import layout
from sakura.cloud.api_errors import ApiError
from sakura.cloud.catalog_routes import list_templates, manifest_response
from sakura.cloud.errors import ErrorCode
from sakura.cloud.resolve import check_codec, check_template_id, resolve_request
from sakura.cloud.responses import pack_file_response
from sakura.cloud.routing import add_get_head, bearer
from starlette.responses import Response

router = APIRouter()


def get_layout_catalog(
    request: Request, _c: HTTPAuthorizationCredentials | None = Security(bearer)
) -> Response:
    return list_templates(request)


add_get_head(
    router,
    "/" + layout.CATALOG_KEY,
    get_layout_catalog,
    "layout_catalog",
    "catalog.json of the published layout (filtered by token scope)",
    json_body=True,
)


def get_layout_file(
    request: Request,
    template_id: str,
    codec: str,
    name: str,
) -> Response:
    # the route the edge reads packs by: no FastAPI Security dependency (its solving
    # was a fifth of the server's CPU per range under `sakura bench serve`); the token
    # is checked by authorize in resolve_request as on every route, and the OpenAPI
    # document still lists the bearer requirement (openapi_extra below)
    if name == layout.MANIFEST_NAME:
        state, resolved = resolve_request(request, template_id, codec, None)
        return manifest_response(request, state, resolved)
    if name.endswith(".manifest.json"):
        pack_file = name.removesuffix(".manifest.json") + ".pack"
        state, resolved = resolve_request(request, template_id, codec, pack_file)
        return manifest_response(request, state, resolved)
    if layout.valid_pack_file(name):
        return layout_pack(request, template_id, codec, name)
    check_template_id(template_id)
    check_codec(codec)
    raise ApiError(404, f"no file {name[:80]!r} in the layout of {template_id}/{codec}",
                   code=ErrorCode.NOT_FOUND)


add_get_head(
    router,
    "/templates/{template_id}/{codec}/{name}",
    get_layout_file,
    "layout_file",
    "A file of the published layout: manifest.json, <pack>.manifest.json or the "
    "immutable pack itself (the Range rules of /v1/.../pack)",
    openapi_extra={"security": [{"HTTPBearer": []}]},
)


def layout_pack(request: Request, template_id: str, codec: str, name: str, *,
                inline: bool = False) -> Response:
    """``GET /templates/<id>/<codec>/<pack_file>``: the route the edge reads packs by."""
    state, resolved = resolve_request(request, template_id, codec, name)
    return pack_file_response(request, state, resolved, inline=inline)
