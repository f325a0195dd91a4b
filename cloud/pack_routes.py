"""Pack bytes on the ``/v1`` API: ``/v1/templates/{id}/{codec}/pack`` (the raw pack, full
HTTP Range semantics) and the shard endpoint,
``/v1/templates/{id}/{codec}/shards/{shard}/{config}`` (exactly the bytes of one
configuration of one shard, with their sha256 in ``X-Sakura-Sha256``; Range for resume).
Both are answered by :func:`cloud.responses.serve_body`."""

from __future__ import annotations

import hashlib
import logging

from fastapi import APIRouter, Request, Security
from fastapi.security import HTTPAuthorizationCredentials
from sakura.cloud.api_errors import ApiError
from sakura.cloud.errors import ErrorCode, StorageError
from sakura.cloud.resolve import Resolved, int_param, open_pack, resolve_request
from sakura.cloud.responses import Body, pack_file_response, serve_body
from sakura.cloud.routing import add_get_head, bearer
from sakura.cloud.state import ServerState
from starlette.responses import Response

log = logging.getLogger("sakura.cloud.server")

router = APIRouter()


def get_pack(
    request: Request,
    template_id: str,
    codec: str,
    pack: str | None = None,
    _c: HTTPAuthorizationCredentials | None = Security(bearer),
) -> Response:
    state, resolved = resolve_request(request, template_id, codec, pack)
    return pack_file_response(request, state, resolved)


add_get_head(
    router,
    "/v1/templates/{template_id}/{codec}/pack",
    get_pack,
    "pack",
    "The raw pack with full HTTP Range support (206, multipart/byteranges, 416, If-Range)",
)


def get_shard(
    request: Request,
    template_id: str,
    codec: str,
    shard: str,
    config: str,
    pack: str | None = None,
    _c: HTTPAuthorizationCredentials | None = Security(bearer),
) -> Response:
    shard_i, config_i = int_param(shard, "shard"), int_param(config, "config")
    state, resolved = resolve_request(request, template_id, codec, pack)
    entry = resolved.index.config(shard_i, config_i)
    if entry is None:
        if not any(s == shard_i for s, _ in resolved.index.configs):
            raise ApiError(404, f"{template_id}/{codec} has no shard {shard_i}",
                           code=ErrorCode.NOT_FOUND)
        raise ApiError(
            404, f"shard {shard_i} of {template_id}/{codec} has no config {config_i}",
            code=ErrorCode.NOT_FOUND,
        )
    body = Body(entry.ranges)
    etag = f'"{resolved.index.pack_sha256}:{shard_i}:{config_i}"'
    sha, prefetched = shard_hash(state, resolved, shard_i, config_i, body)
    extra = {
        "X-Sakura-Sha256": sha,
        "X-Sakura-Pack-Etag": resolved.etag,
        "X-Sakura-Pack-File": resolved.index.pack_file,
    }
    return serve_body(request, state, resolved, body, etag, extra, prefetched)


add_get_head(
    router,
    "/v1/templates/{template_id}/{codec}/shards/{shard}/{config}",
    get_shard,
    "shard",
    "Exactly the bytes of one configuration of one shard (Range supported for resume)",
)


def shard_hash(
    state: ServerState, resolved: Resolved, shard: int, config: int, body: Body
) -> tuple[str, bytes | None]:
    """sha256 of a shard body whose units passed their checksums (cached per version on
    storage); returns the body too when it was read to hash it."""
    assert state.hashes is not None
    reader = open_pack(state, resolved)
    try:
        state.verifier.verify(reader, resolved, body.spans)
        key = (resolved.pack_key, reader.info.etag, shard, config)
        cached = state.hashes.get(key)
        if cached is not None:
            return cached, None
        digest = hashlib.sha256()
        keep = body.size <= state.settings.buffer_limit
        parts: list[bytes] = []
        for offset, length in body.segments(0, body.size):
            for chunk in reader.iter_range(offset, offset + length, state.settings.chunk_size):
                digest.update(chunk)
                if keep:
                    parts.append(chunk)
    except StorageError as exc:
        log.error("reading %s failed: %s", resolved.pack_key, exc)
        raise ApiError(503, "storage unavailable", code=ErrorCode.STORAGE_UNAVAILABLE) from exc
    finally:
        reader.close()
    value = digest.hexdigest()
    state.hashes.put(key, value)
    return value, b"".join(parts) if keep else None
