"""What a request names, resolved: the checks on ids, integers and bearer tokens, the
published catalog, and the one manifest and pack version (:class:`Resolved`) a request is
answered from, opened as one pinned reader (:func:`open_pack`).

What is served is decided by ``catalog.json`` alone: a template's manifest is the versioned
manifest of the ``pack_file`` the catalog names (falling back to ``manifest.json`` for
hand-written catalogs without ``pack_file``); ``?pack=<pack_file>`` pins an older version
until garbage collection. Every failure is an :class:`~sakura.cloud.api_errors.ApiError`
with its :class:`~sakura.cloud.errors.ErrorCode`. Nothing here reads pack bytes beyond
opening the pack: :mod:`cloud.responses` does, through :mod:`cloud.verify`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from sakura.cloud import layout
from sakura.cloud.api_errors import ApiError
from sakura.cloud.auth import Grant, bearer_token
from sakura.cloud.errors import ErrorCode, ManifestError, ObjectNotFound, StorageError
from sakura.cloud.layout import ManifestIndex
from sakura.cloud.state import ServerState, state_of
from sakura.cloud.storage import ObjectReader

log = logging.getLogger("sakura.cloud.server")

_INT_RE = re.compile(r"^[0-9]{1,9}$")


@dataclass(frozen=True)
class Resolved:
    """A template/codec resolved through the catalog to one manifest and pack version."""

    template_id: str
    codec: str
    manifest_raw: bytes
    index: ManifestIndex
    pack_key: str
    pinned: bool

    @property
    def etag(self) -> str:
        return f'"{self.index.pack_sha256}"'


# --------------------------------------------------------------------- request checks


def check_template_id(template_id: str) -> None:
    if not layout.valid_template_id(template_id):
        raise ApiError(
            400,
            f"invalid template id {template_id[:80]!r}: must match {layout.TEMPLATE_ID_RE.pattern}",
            code=ErrorCode.BAD_REQUEST,
        )


def check_codec(codec: str) -> None:
    if not layout.valid_codec(codec):
        raise ApiError(400, f"invalid codec {codec[:80]!r}: must match {layout.CODEC_RE.pattern}",
                       code=ErrorCode.BAD_REQUEST)


def int_param(value: str, what: str) -> int:
    if not _INT_RE.fullmatch(value):
        raise ApiError(400, f"invalid {what} {value[:40]!r}: must be a non-negative integer",
                       code=ErrorCode.BAD_REQUEST)
    return int(value)


def grant_of(request: Request) -> Grant:
    state = state_of(request)
    if state.tokens is None:
        return Grant(None)
    header = request.headers.get("authorization")
    token = bearer_token(header)
    grant = state.tokens.verify(token)
    if grant is None:
        if header is None:
            raise ApiError(
                401, "missing bearer token", {"WWW-Authenticate": 'Bearer realm="sakura"'},
                code=ErrorCode.UNAUTHORIZED,
            )
        raise ApiError(
            401,
            "invalid bearer token",
            {"WWW-Authenticate": 'Bearer realm="sakura", error="invalid_token"'},
            code=ErrorCode.UNAUTHORIZED,
        )
    return grant


def authorize(request: Request, template_id: str) -> Grant:
    grant = grant_of(request)
    if not grant.allows(template_id):
        raise ApiError(403, f"this token may not access template {template_id!r}",
                       code=ErrorCode.FORBIDDEN)
    return grant


# ----------------------------------------------------------------------- resolution


def read_catalog(state: ServerState) -> dict[str, Any]:
    assert state.json_cache is not None
    try:
        _raw, catalog = state.json_cache.get(layout.CATALOG_KEY, layout.validate_catalog)
    except ObjectNotFound as exc:
        raise ApiError(503, "no catalog is published yet (catalog.json is missing)",
                       code=ErrorCode.CATALOG_MISSING) from exc
    except ManifestError as exc:
        log.error("catalog.json is invalid: %s", exc)
        raise ApiError(500, f"the published catalog is invalid: {exc}",
                       code=ErrorCode.PUBLISH_BROKEN) from exc
    except StorageError as exc:
        log.error("cannot read catalog.json: %s", exc)
        raise ApiError(503, "storage unavailable", code=ErrorCode.STORAGE_UNAVAILABLE) from exc
    return catalog


def resolve(state: ServerState, template_id: str, codec: str, pinned: str | None) -> Resolved:
    catalog = read_catalog(state)
    entry = catalog["templates"].get(template_id)
    if entry is None:
        raise ApiError(404, f"unknown template {template_id!r}", code=ErrorCode.UNKNOWN_TEMPLATE)
    centry = entry.get("codecs", {}).get(codec)
    if centry is None:
        raise ApiError(404, f"template {template_id!r} has no codec {codec!r}",
                       code=ErrorCode.UNKNOWN_CODEC)
    if pinned is not None and not layout.valid_pack_file(pinned):
        raise ApiError(400, f"invalid pack version {pinned[:80]!r}", code=ErrorCode.BAD_REQUEST)
    pack_file = pinned or centry.get("pack_file")
    candidates: list[tuple[str, bool]] = []
    if pack_file:
        candidates.append((layout.versioned_manifest_key(template_id, codec, pack_file), True))
    if not pinned:
        candidates.append((layout.manifest_key(template_id, codec), False))

    def parse(document: Any) -> ManifestIndex:
        return layout.validate_manifest(document, template_id=template_id, codec=codec)

    assert state.json_cache is not None
    for key, immutable in candidates:
        try:
            raw, index = state.json_cache.get(key, parse, immutable=immutable)
        except ObjectNotFound:
            continue
        except ManifestError as exc:
            log.error("manifest %s is invalid: %s", key, exc)
            raise ApiError(500, f"the manifest of {template_id}/{codec} is invalid: {exc}",
                           code=ErrorCode.PUBLISH_BROKEN) from exc
        except StorageError as exc:
            log.error("cannot read %s: %s", key, exc)
            raise ApiError(503, "storage unavailable", code=ErrorCode.STORAGE_UNAVAILABLE) from exc
        if pack_file and index.pack_file != pack_file:
            continue  # manifest.json not (yet) matching the catalog's version
        return Resolved(
            template_id,
            codec,
            raw,
            index,
            layout.pack_key(template_id, codec, index.pack_file),
            bool(pinned),
        )
    if pinned:
        raise ApiError(404, gone_message(template_id, codec, pinned), code=ErrorCode.VERSION_GONE)
    raise ApiError(500, f"the manifest of {template_id}/{codec} is missing from storage",
                   code=ErrorCode.PUBLISH_BROKEN)


def resolve_request(
    request: Request, template_id: str, codec: str, pack: str | None
) -> tuple[ServerState, Resolved]:
    check_template_id(template_id)
    check_codec(codec)
    authorize(request, template_id)
    state = state_of(request)
    return state, resolve(state, template_id, codec, pack)


def open_pack(state: ServerState, resolved: Resolved) -> ObjectReader:
    try:
        reader = state.storage.open(resolved.pack_key)
    except ObjectNotFound as exc:
        if resolved.pinned:
            raise ApiError(
                404, gone_message(resolved.template_id, resolved.codec, resolved.index.pack_file),
                code=ErrorCode.VERSION_GONE,
            ) from exc
        log.error("pack %s is missing", resolved.pack_key)
        raise ApiError(
            500, pack_missing(resolved), code=ErrorCode.PUBLISH_BROKEN
        ) from exc
    except StorageError as exc:
        log.error("cannot open %s: %s", resolved.pack_key, exc)
        raise ApiError(503, "storage unavailable", code=ErrorCode.STORAGE_UNAVAILABLE) from exc
    if reader.size != resolved.index.pack_bytes:
        reader.close()
        why = size_mismatch(resolved, reader.size)
        log.error("%s (%s)", why, resolved.pack_key)
        raise ApiError(500, why, code=ErrorCode.PACK_DAMAGED)
    return reader


def gone_message(template_id: str, codec: str, pack_file: str) -> str:
    return (
        f"pack version {pack_file!r} of {template_id}/{codec} is not available "
        "(superseded and collected); fetch the current manifest"
    )


def size_mismatch(resolved: Resolved, size: int) -> str:
    return (f"the pack of {resolved.template_id}/{resolved.codec} is damaged: it has {size} "
            f"bytes, its manifest says {resolved.index.pack_bytes} (truncated or corrupt); it "
            "is not served until it is repaired")


def pack_missing(resolved: Resolved) -> str:
    return f"the pack of {resolved.template_id}/{resolved.codec} is missing from storage"
