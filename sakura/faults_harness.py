"""The loopback harness of ``sakura bench faults``: what a case reports (:class:`Tally`,
:class:`CaseFailed`, :func:`check`), and what a case builds and calls: a small synthetic
catalog (``cloud.synthetic``), the real server (uvicorn on 127.0.0.1, in a thread), plain
HTTP requests, the real edge client, one flipped byte.

The imports inside functions keep torch, the model and the web stack (FastAPI, uvicorn,
aiohttp, pydantic) off ``sakura --help``, which loads this module to register the command.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEMPLATE = "face-a"


@dataclass
class Tally:
    """What every case adds to the report's totals."""

    wrong_bytes_accepted: int = 0
    crashes: int = 0
    notes: list[str] = field(default_factory=list)


class CaseFailed(Exception):
    """A promise did not hold (the message says which)."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CaseFailed(message)


def synthetic_catalog(root: Path, shards: int = 4, configs: int = 3, unit_bytes: int = 4096
                      ) -> Any:
    """A one-template synthetic catalog (``TEMPLATE``) published under ``root``."""
    from sakura.cloud.synthetic import SyntheticSpec, build_catalog  # lazy: pydantic

    return build_catalog(root, [TEMPLATE], spec=SyntheticSpec(shards, configs, unit_bytes))[
        TEMPLATE]


def read_manifest(root: Path, pub: Any) -> dict[str, Any]:
    return json.loads((root / pub.versioned_manifest_key).read_text())


@contextlib.contextmanager
def serve_app(root: Path, header_timeout_s: float | None = None) -> Iterator[tuple[str, Any]]:
    from sakura.cloud.runner import HEADER_TIMEOUT_S, serve_in_thread  # lazy: web stack
    from sakura.cloud.server import create_app  # lazy: web stack
    from sakura.cloud.storage import LocalStorage  # lazy: CLI --help stays fast

    app = create_app(LocalStorage(root))
    with serve_in_thread(app, header_timeout_s=header_timeout_s or HEADER_TIMEOUT_S) as url:
        yield url, app


def http_get(url: str, headers: dict[str, str] | None = None, method: str = "GET"
             ) -> tuple[int, Any, bytes]:
    """(status, headers (case-insensitive), body) of one request."""
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def check_alive(url: str, tally: Tally) -> None:
    try:
        status, _, _ = http_get(url + "/healthz")
    except OSError:
        status = 0
    if status == 0:
        tally.crashes += 1
        raise CaseFailed(f"the server at {url} stopped answering")


def client_fetch(url: str, manifest: dict[str, Any] | None, shard: int, config: int,
                 retry: Any = None) -> bytes:
    from sakura.edge.client import PackClient, RetryPolicy  # lazy: aiohttp

    policy = retry or RetryPolicy(window_s=2.0, backoff_s=0.05, backoff_max_s=0.2)

    async def go() -> bytes:
        async with PackClient(url, retry=policy) as c:
            got = await c.fetch_config(TEMPLATE, "sakura", shard, config, manifest=manifest)
            return got.data

    return asyncio.run(go())


def published_body(root: Path, pub: Any, manifest: dict[str, Any], shard: int, config: int
                   ) -> bytes:
    """The published bytes of one (shard, configuration) unit, read from the pack."""
    pack = (root / pub.pack_key).read_bytes()
    entry = next(c for c in manifest["shards"][shard]["configs"] if c["id"] == config)
    (offset, length), = entry["ranges"]
    return pack[offset : offset + length]


def flip_byte(path: Path, offset: int) -> bytes:
    """Flip one byte of ``path`` in place; returns the original contents."""
    data = path.read_bytes()
    bad = bytearray(data)
    bad[offset] ^= 0xFF
    path.write_bytes(bytes(bad))
    return data
