"""The catalog and the manifests on the ``/v1`` API: ``/v1/templates`` (catalog.json,
filtered to the templates the token may see), ``/v1/templates/{id}`` (one catalog entry)
and ``/v1/templates/{id}/{codec}/manifest`` (the manifest bytes exactly as published,
gzip when accepted, ETag the pack's sha256). The layout's routes answer catalog.json and
the manifests with the same functions (:mod:`cloud.layout_routes`)."""

from __future__ import annotations

import hashlib
import json

from fastapi import APIRouter, Request, Security
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials
from sakura.cloud.api_errors import ApiError
from sakura.cloud.errors import ErrorCode
from sakura.cloud.resolve import (
    Resolved,
    authorize,
    check_template_id,
    grant_of,
    read_catalog,
    resolve_request,
)
from sakura.cloud.responses import cache_control, preconditions
from sakura.cloud.routing import bearer, get_head
from sakura.cloud.state import ServerState, state_of
from starlette.responses import Response

router = APIRouter()


@get_head(
    router,
    "/v1/templates",
    tags=["catalog"],
    summary="The template catalog (catalog.json, filtered by token scope)",
)
def list_templates(
    request: Request, _c: HTTPAuthorizationCredentials | None = Security(bearer)
) -> Response:
    state = state_of(request)
    grant = grant_of(request)
    catalog = read_catalog(state)
    visible = {k: v for k, v in catalog["templates"].items() if grant.allows(k)}
    document = {**catalog, "templates": visible}
    raw = json.dumps(document, separators=(",", ":")).encode()
    etag = '"' + hashlib.sha256(raw).hexdigest()[:32] + '"'
    headers = {"ETag": etag, "Cache-Control": cache_control(state, False)}
    return preconditions(request, etag, headers) or Response(
        raw, media_type="application/json", headers=headers
    )


@get_head(
    router,
    "/v1/templates/{template_id}",
    tags=["catalog"],
    summary="One template's catalog entry",
)
def get_template(
    request: Request,
    template_id: str,
    _c: HTTPAuthorizationCredentials | None = Security(bearer),
) -> Response:
    check_template_id(template_id)
    authorize(request, template_id)
    state = state_of(request)
    entry = read_catalog(state)["templates"].get(template_id)
    if entry is None:
        raise ApiError(404, f"unknown template {template_id!r}", code=ErrorCode.UNKNOWN_TEMPLATE)
    return JSONResponse(entry, headers={"Cache-Control": cache_control(state, False)})


@get_head(
    router,
    "/v1/templates/{template_id}/{codec}/manifest",
    tags=["packs"],
    summary="The manifest (JSON); ETag is the quoted pack sha256",
)
def get_manifest(
    request: Request,
    template_id: str,
    codec: str,
    pack: str | None = None,
    _c: HTTPAuthorizationCredentials | None = Security(bearer),
) -> Response:
    state, resolved = resolve_request(request, template_id, codec, pack)
    return manifest_response(request, state, resolved)


def manifest_response(request: Request, state: ServerState, resolved: Resolved) -> Response:
    """The manifest bytes exactly as published (gzip when accepted), ETag the pack sha256."""
    gzipped = accepts_gzip(request.headers.get("accept-encoding", ""))
    # each content coding is its own representation with its own strong ETag
    etag = f'"{resolved.index.pack_sha256}-gzip"' if gzipped else resolved.etag
    headers = {
        "ETag": etag,
        "Cache-Control": cache_control(state, resolved.pinned),
        "X-Sakura-Pack-File": resolved.index.pack_file,
        "Vary": "Accept-Encoding",
    }
    early = preconditions(request, etag, headers)
    if early:
        return early
    body = resolved.manifest_raw
    if gzipped:
        # manifests are mostly hex checksums and unit lists: gzip shrinks them several
        # times, which is start-up latency on a slow link (packs are never compressed)
        body = state.gzip_manifest(resolved.etag, body)
        headers["Content-Encoding"] = "gzip"
    return Response(body, media_type="application/json", headers=headers)


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether gzip is acceptable (RFC 9110 section 12.5.3): its own entry decides, else
    ``*``; ``q=0`` means not acceptable."""
    explicit: float | None = None
    star: float | None = None
    for item in accept_encoding.split(","):
        name, _, params = item.strip().partition(";")
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0
        name = name.strip().lower()
        if name in ("gzip", "x-gzip"):
            explicit = q if explicit is None else max(explicit, q)
        elif name == "*":
            star = q
    q = explicit if explicit is not None else star
    return q is not None and q > 0
