"""The product's client as a device of ``sakura bench serve --restart-at`` (issue 29 item 7).

:func:`make_client` adapts :class:`sakura.edge.client.PackClient` (what ``sakura edit``
uses: unit checks, jittered backoff, ``If-Range`` resumes) to
:class:`sakura.cloud.bench.RideClient`. It lives in the app layer because ``cloud`` does not
import ``edge`` (``tests/test_layering.py``); ``sakura/serve_ride_cli.py`` hands it to
the bench command.
"""

from __future__ import annotations

from typing import Any

from sakura.edge.client import PackClient
from sakura.edge.errors import IntegrityError


class EdgeRideClient:
    """One simulated device: one :class:`PackClient`, the manifest fetched once."""

    def __init__(self, base_url: str, template: str, codec: str) -> None:
        self.template = template
        self.codec = codec
        self.retries = 0
        self.client = PackClient(base_url, on_wait=self._waited)
        self.manifest: dict[str, Any] | None = None

    def _waited(self, _line: str) -> None:
        self.retries += 1

    async def __aenter__(self) -> EdgeRideClient:
        await self.client.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()

    async def fetch(self, shard: int, config: int) -> bytes:
        if self.manifest is None:
            self.manifest = await self.client.manifest(self.template, self.codec)
        got = await self.client.fetch_config(self.template, self.codec, shard, config,
                                             manifest=self.manifest)
        if got.config is not None and got.config != config:
            raise IntegrityError(f"asked for config {config} of shard {shard}, got "
                                 f"{got.config} ({got.damage})")
        return got.data


def make_client(base_url: str, template: str, codec: str) -> EdgeRideClient:
    return EdgeRideClient(base_url, template, codec)
