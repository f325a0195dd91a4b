"""Fixtures for the cloud tests: small published catalogs, an app, a TestClient, an S3 server."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sakura.cloud.server import create_app
from sakura.cloud.storage import LocalStorage
from sakura.cloud.synthetic import SyntheticSpec, build_catalog

SMALL = SyntheticSpec(shards=4, configs=3, unit_bytes=1024, seed=0)


class Published:
    """A published catalog directory plus the expected bytes of each template's pack."""

    def __init__(self, root: Path, ids: list[str]) -> None:
        self.root = root
        self.packs = build_catalog(root, ids, spec=SMALL)

    def manifest(self, template_id: str, codec: str = "sakura") -> dict:
        pub = self.packs[template_id]
        return json.loads((self.root / pub.versioned_manifest_key).read_text())

    def pack(self, template_id: str) -> bytes:
        return (self.root / self.packs[template_id].pack_key).read_bytes()


@pytest.fixture
def published(tmp_path: Path) -> Published:
    return Published(tmp_path / "catalog", ["face-a", "tryon-b"])


@pytest.fixture
def client(published: Published) -> TestClient:
    with TestClient(create_app(LocalStorage(published.root)), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def s3_endpoint():
    """A real S3-speaking HTTP server (moto, in this process) on 127.0.0.1, one per test
    module that asks for it (test_storage_backends, test_serve_cli); yields its URL."""
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def ray_auth_mode_of_this_process() -> str:
    """The RAY_AUTH_MODE a Ray cluster started from this test process must run with: the
    one this process's Ray already uses. Ray reads the variable when it is imported, and a
    local ``ray.init`` sets it to ``token`` in this process's environment; a cluster started
    with another mode than the driver's accepts the driver but cancels its actors before
    they run ("all references to the actor were removed"). Without an earlier ``ray.init``
    here: ``disabled`` (this process imported Ray before it could ask for a token)."""
    return os.environ.get("RAY_AUTH_MODE", "disabled")
