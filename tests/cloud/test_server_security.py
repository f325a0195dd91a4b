"""Hostile input: path-like ids over raw sockets, bearer tokens and scopes, tokens files."""

from __future__ import annotations

import socket

import pytest
from fastapi.testclient import TestClient
from sakura.cloud.auth import TokenSet, bearer_token, load_tokens
from sakura.cloud.errors import AuthConfigError
from sakura.cloud.runner import serve_in_thread
from sakura.cloud.server import create_app
from sakura.cloud.storage import LocalStorage
from sakura.cloud.synthetic import SyntheticSpec, build_catalog

ADMIN = "admin-token-0123456789abcdef"
PARTNER = "partner-token-0123456789abcd"


def raw_get(base_url: str, target: bytes, extra: bytes = b"") -> tuple[int, bytes]:
    """Send a request target byte-for-byte (no client-side normalisation)."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + extra + b"\r\n"
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("security") / "catalog"
    build_catalog(root, ["face-a", "tryon-b"], spec=SyntheticSpec(2, 2, 256))
    with serve_in_thread(create_app(LocalStorage(root))) as url:
        yield url


@pytest.mark.parametrize(
    "target",
    [
        b"/v1/templates/../catalog.json",
        b"/v1/templates/..%2F..%2Fetc%2Fpasswd/sakura/manifest",
        b"/v1/templates/face-a%2F..%2Ftryon-b/sakura/manifest",
        b"/v1/templates/face-a/sakura/..%2fmanifest",
        b"/v1/templates/%2e%2e/sakura/manifest",
        b"/v1/templates/face-a/../../../etc/passwd",
        b"/v1/templates/face-a%5c..%5ccatalog.json/sakura/pack",
        b"/v1/templates/face-a%00/sakura/pack",
        b"/v1/templates/./face-a/sakura/pack",
        b"/v1/templates/face-a/sakura/shards/0/..",
    ],
)
def test_path_like_ids_never_reach_the_filesystem(live, target):
    status, body = raw_get(live, target)
    assert status == 400, (target, status, body)
    assert body.startswith(b'{"error":')


@pytest.mark.parametrize(
    "template_id",
    ["Face-A", "face.a", "-face", "_x", "a" * 65, "face%20a", "%C3%A9t%C3%A9", ".hidden", "..."],
)
def test_invalid_template_ids_are_400_with_a_clear_error(live, template_id):
    status, body = raw_get(live, f"/v1/templates/{template_id}/sakura/manifest".encode())
    assert status == 400
    assert b"invalid template id" in body


def test_invalid_codec_and_unknown_ids(client):
    r = client.get("/v1/templates/face-a/Sakura!/manifest")
    assert r.status_code == 400 and "invalid codec" in r.json()["error"]
    r = client.get("/v1/templates/face-zz/sakura/pack")
    assert r.status_code == 404
    assert r.json() == {"error": "unknown template 'face-zz'", "code": "unknown_template"}


def test_server_stays_healthy_after_garbage_requests(live):
    host, port = live.removeprefix("http://").split(":")
    for junk in [
        b"\x00\xff\xfe garbage\r\n\r\n",
        b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
        b"GE",
    ]:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(junk)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
    status, body = raw_get(live, b"/healthz")
    assert status == 200 and body == b'{"status":"ok","damaged":[]}'


# ----------------------------------------------------------------------------------- auth


@pytest.fixture
def secured(published):
    tokens = TokenSet.parse(f"# tokens\n{ADMIN}\n{PARTNER}  face-a  # scoped\n")
    with TestClient(
        create_app(LocalStorage(published.root), tokens), raise_server_exceptions=False
    ) as c:
        yield c


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": ""},
        {"Authorization": "Bearer"},
        {"Authorization": f"Basic {ADMIN}"},
        {"Authorization": "Bearer wrong-token-0123456789abcdef"},
        {"Authorization": f"Bearer {ADMIN}x"},
        {"Authorization": f"Bearer {ADMIN[:-1]}"},
        {"Authorization": f"Bearer {ADMIN} extra"},
    ],
)
def test_missing_or_wrong_token_is_401(secured, headers):
    for url in [
        "/v1/templates",
        "/v1/templates/face-a",
        "/v1/templates/face-a/sakura/pack",
        "/v1/templates/face-a/sakura/shards/0/0",
    ]:
        r = secured.get(url, headers=headers)
        assert r.status_code == 401, (url, headers)
        assert r.headers["www-authenticate"].startswith('Bearer realm="sakura"')
        assert "bearer token" in r.json()["error"]
    if headers.get("Authorization", "").startswith("Bearer "):
        assert 'error="invalid_token"' in r.headers["www-authenticate"]


def test_valid_tokens_and_scopes(secured, published):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    partner = {"Authorization": f"bearer {PARTNER}"}  # scheme is case-insensitive
    assert set(secured.get("/v1/templates", headers=admin).json()["templates"]) == {
        "face-a",
        "tryon-b",
    }
    assert set(secured.get("/v1/templates", headers=partner).json()["templates"]) == {"face-a"}
    r = secured.get("/v1/templates/face-a/sakura/pack", headers=partner)
    assert r.status_code == 200 and r.content == published.pack("face-a")
    assert "private" in r.headers["cache-control"]
    for url in [
        "/v1/templates/tryon-b",
        "/v1/templates/tryon-b/sakura/manifest",
        "/v1/templates/nonexistent/sakura/pack",
    ]:
        r = secured.get(url, headers=partner)
        assert (
            r.status_code == 403 and "may not access" in r.json()["error"]
        )  # same for unknown ids
    assert secured.get("/v1/templates/tryon-b/sakura/shards/0/0", headers=admin).status_code == 200


def test_health_metrics_and_openapi_are_open(secured):
    assert secured.get("/healthz").status_code == 200
    assert secured.get("/metrics").status_code == 200
    spec = secured.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_tokens_file_and_env(tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"{ADMIN}\n\n  # comment only\n{PARTNER} face-a,tryon-b\n")
    tokens = load_tokens(f)
    assert len(tokens) == 2
    assert tokens.verify(ADMIN).templates is None
    assert tokens.verify(PARTNER).templates == frozenset({"face-a", "tryon-b"})
    assert tokens.verify("nope-nope-nope-nope") is None and tokens.verify(None) is None
    env = load_tokens(None, {"SAKURA_TOKENS": f"{ADMIN};{PARTNER} face-a"})
    assert env.verify(PARTNER).allows("face-a") and not env.verify(PARTNER).allows("tryon-b")
    assert load_tokens(None, {}) is None
    # set but blank (an empty secret in a deployment): refused, never an open API
    with pytest.raises(AuthConfigError, match="holds no tokens; unset it"):
        load_tokens(None, {"SAKURA_TOKENS": "  "})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "holds no tokens"),
        ("# nothing\n", "holds no tokens"),
        ("short", "at least 16"),
        ("bad token with spaces inside here", "at least 16"),
        ("tok\u00e9n-0123456789abcdef", "must match"),
        (f"{ADMIN}\n{ADMIN}", "duplicate"),
        (f"{ADMIN} ../etc", "invalid template id"),
        (f"{ADMIN} ,", "empty template scope"),
    ],
)
def test_bad_tokens_files_are_clear_errors(tmp_path, text, message):
    with pytest.raises(AuthConfigError, match=message):
        TokenSet.parse(text)


def test_unreadable_tokens_file(tmp_path):
    with pytest.raises(AuthConfigError, match="cannot read tokens file"):
        TokenSet.from_file(tmp_path / "missing")


def test_bearer_header_parsing():
    assert bearer_token(f"Bearer {ADMIN}") == ADMIN
    assert bearer_token(f"  BEARER   {ADMIN}  ") == ADMIN
    assert bearer_token(None) is None
    assert bearer_token("Bearer a b") is None
    assert bearer_token("Bearer \x00") is None
