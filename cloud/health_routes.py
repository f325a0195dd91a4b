"""``/healthz`` and ``/metrics``: the operations routes, open without a token.

``/healthz`` answers 503 while the catalog cannot be read, and lists damaged packs: those
the unit verifier caught (a failed checksum) and those whose size on storage is not their
manifest's ``pack_bytes`` (:func:`pack_sizes`); and the device bundle files
that failed their sha256 on serving, or whose size is not the catalog's
(``cloud.bundle``). ``/metrics`` is the Prometheus text of the
app's registry (:mod:`cloud.metrics`).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from sakura.cloud import layout
from sakura.cloud.api_errors import ApiError
from sakura.cloud.bundle import bundle_sizes
from sakura.cloud.errors import ErrorCode, ObjectNotFound, StorageError
from sakura.cloud.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from sakura.cloud.resolve import pack_missing, read_catalog, resolve, size_mismatch
from sakura.cloud.routing import get_head
from sakura.cloud.state import ServerState, state_of
from starlette.responses import Response

router = APIRouter()


@get_head(router, "/healthz", tags=["operations"],
          summary="Health: the catalog is readable (503 otherwise); damaged packs (failed "
                  "checksums, or a size other than the manifest's) listed (no auth)")
def healthz(request: Request) -> JSONResponse:
    state = state_of(request)
    try:
        catalog = read_catalog(state)
    except ApiError as exc:
        return JSONResponse({"status": "error", "error": exc.message, "code": exc.code},
                            status_code=503)
    damaged = {d["pack"]: d for d in [*state.verifier.damaged(), *state.bundles.damaged()]}
    damaged.update((d["pack"], d) for d in pack_sizes(state, catalog))  # the newer news
    damaged.update((d["pack"], d) for d in bundle_sizes(state.storage, catalog))
    listed = [damaged[k] for k in sorted(damaged)]
    return JSONResponse({"status": "degraded" if listed else "ok", "damaged": listed})


@get_head(
    router,
    "/metrics",
    tags=["operations"],
    summary="Prometheus metrics (no auth)",
    response_class=PlainTextResponse,
)
def metrics(request: Request) -> Response:
    return Response(state_of(request).metrics.render(), media_type=METRICS_CONTENT_TYPE)


def pack_sizes(state: ServerState, catalog: dict[str, Any]) -> list[dict[str, str]]:
    """``/healthz``'s size check: every pack the catalog names, against its manifest's
    ``pack_bytes`` (a stat each; kept for the catalog cache's TTL, 0 s for a folder).
    Entries ``{"pack", "error", "code"}`` for the packs that are not servable."""
    assert state.json_cache is not None
    now = time.monotonic()
    cached = state.health_sizes
    if cached is not None and cached[0] is catalog and now - cached[1] < state.json_cache.ttl_s:
        return cached[2]
    problems: list[dict[str, str]] = []
    for template_id, entry in sorted(catalog["templates"].items()):
        for codec, centry in sorted(entry.get("codecs", {}).items()):
            pack_file = centry.get("pack_file")
            where = (layout.pack_key(template_id, codec, pack_file) if pack_file
                     else f"templates/{template_id}/{codec}")
            try:
                resolved = resolve(state, template_id, codec, None)
                where = resolved.pack_key
                size = state.storage.stat(resolved.pack_key).size
            except ApiError as exc:
                problems.append({"pack": where, "error": exc.message, "code": exc.code})
                continue
            except ObjectNotFound:
                problems.append({"pack": where, "error": pack_missing(resolved),
                                 "code": ErrorCode.PUBLISH_BROKEN})
                continue
            except StorageError as exc:
                problems.append({"pack": where, "error": f"storage unavailable: {exc}"[:300],
                                 "code": ErrorCode.STORAGE_UNAVAILABLE})
                continue
            if size != resolved.index.pack_bytes:
                problems.append({"pack": where, "error": size_mismatch(resolved, size),
                                 "code": ErrorCode.PACK_DAMAGED})
    state.health_sizes = (catalog, now, problems)
    return problems
