"""Device bundle files on the published layout: ``/bundles/<sha16>/<name>``, as nginx or an
S3 bucket serve the same folder, with the server's one rule added: a file is sent only
when some template of the catalog lists it (the token may see that template) and after the
bytes in storage passed the catalog's sha256 (:class:`cloud.bundle.BundleVerifier`)."""

from __future__ import annotations

import re

from fastapi import APIRouter, Request
from sakura.cloud.api_errors import ApiError
from sakura.cloud.bundle import bundle_file
from sakura.cloud.errors import ErrorCode, ObjectNotFound, StorageError
from sakura.cloud.resolve import grant_of, read_catalog
from sakura.cloud.responses import OCTET, cache_control, preconditions
from sakura.cloud.routing import add_get_head
from sakura.cloud.state import state_of
from sakura.codec.manifest import BUNDLE_KEY_PATTERN
from starlette.responses import Response

router = APIRouter()
KEY_RE = re.compile(BUNDLE_KEY_PATTERN)


def get_bundle_file(request: Request, digest: str, name: str) -> Response:
    key = f"bundles/{digest}/{name}"
    if not KEY_RE.fullmatch(key):
        raise ApiError(404, f"no bundle file {key[:100]!r}", code=ErrorCode.NOT_FOUND)
    state = state_of(request)
    record, templates = bundle_file(read_catalog(state), key)
    grant = grant_of(request)
    if not templates:
        raise ApiError(404, f"no template of the catalog lists the bundle file {key}",
                       code=ErrorCode.NOT_FOUND)
    if not any(grant.allows(t) for t in templates):
        raise ApiError(403, "this token may not access the templates of this bundle file",
                       code=ErrorCode.FORBIDDEN)
    etag = f'"{record["sha256"]}"'
    headers = {"ETag": etag, "Cache-Control": cache_control(state, True),
               "X-Content-Type-Options": "nosniff"}
    early = preconditions(request, etag, headers)
    if early is not None:
        return early
    try:
        reader = state.storage.open(key)
    except ObjectNotFound as exc:
        raise ApiError(500, f"the device bundle file {key} is missing from storage",
                       code=ErrorCode.PUBLISH_BROKEN) from exc
    except StorageError as exc:
        raise ApiError(503, "storage unavailable", code=ErrorCode.STORAGE_UNAVAILABLE) from exc
    try:
        state.bundles.verify(reader, key, record)  # never send bytes the catalog disowns
        body = b"" if request.method == "HEAD" else reader.read_range(0, reader.size)
        size = reader.size
    except StorageError as exc:
        raise ApiError(503, "storage unavailable", code=ErrorCode.STORAGE_UNAVAILABLE) from exc
    finally:
        reader.close()
    headers["Content-Length"] = str(size)
    return Response(body, media_type=OCTET, headers=headers)


add_get_head(
    router,
    "/bundles/{digest}/{name}",
    get_bundle_file,
    "bundle_file",
    "A device bundle file (graphs, text encoder, vocabulary, tables) listed by the catalog, "
    "sent after its sha256 passed",
    openapi_extra={"security": [{"HTTPBearer": []}]},
)
