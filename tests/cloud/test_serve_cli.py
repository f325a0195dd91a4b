"""``sakura serve`` / ``sakura bench serve`` and serving a catalog from S3 (moto on loopback)."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sakura.cloud import cli
from sakura.cloud.bench import BenchConfig, run_bench
from sakura.cloud.errors import AuthConfigError, ServeConfigError
from sakura.cloud.publish import mirror_to_storage
from sakura.cloud.server import create_app
from sakura.cloud.storage import S3Storage

from sakura.errors import UsageError
from tests.cloud.helpers import parse_multipart, shard_bytes

ROOT = Path(__file__).resolve().parents[2]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sakura")
    commands = parser.add_subparsers(dest="command")
    bench = commands.add_parser("bench").add_subparsers(dest="bench")
    cli.register(commands, bench)
    return parser.parse_args(argv)


def test_serve_refuses_a_missing_dir_or_catalog(tmp_path):
    with pytest.raises(ServeConfigError, match="is not a directory"):
        parse(["serve", str(tmp_path / "nope")]).func(parse(["serve", str(tmp_path / "nope")]))
    args = parse(["serve", str(tmp_path)])
    with pytest.raises(ServeConfigError, match="has no catalog.json"):
        args.func(args)
    # bad combinations of arguments are usage errors (exit 2 through sakura.cli.main)
    args = parse(["serve"])
    with pytest.raises(UsageError, match="give the published catalog directory"):
        args.func(args)
    args = parse(["serve", str(tmp_path), "--s3-endpoint", "http://127.0.0.1:1"])
    with pytest.raises(UsageError, match="needs --s3-bucket"):
        args.func(args)


@pytest.mark.parametrize("text, message", [
    ("{ not json", "is not valid JSON"),
    ("", "is not valid JSON"),
    ("[" * 100_000, "is not valid JSON"),  # nesting beyond the parser's recursion limit
    ('{"version": 1, "templates": 5}', "is not a SAKURA catalog"),
    ('["a"]', "is not a SAKURA catalog"),
])
def test_serve_refuses_a_catalog_it_cannot_parse(published, text, message):
    (published.root / "catalog.json").write_text(text)
    args = parse(["serve", str(published.root)])
    with pytest.raises(ServeConfigError, match=message):
        args.func(args)


def test_sakura_serve_on_a_broken_catalog_prints_one_error_line(published):
    (published.root / "catalog.json").write_bytes(b"{ not json\xff")
    proc = subprocess.run([sys.executable, "-m", "sakura.cli", "serve", str(published.root),
                           "--port", "0"], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("sakura: error: "), proc.stderr
    assert "catalog.json is not valid JSON" in lines[0]
    assert "listening" not in proc.stderr + proc.stdout


def test_serve_refuses_a_bad_tokens_file(published, tmp_path):
    bad = tmp_path / "tokens"
    bad.write_text("short\n")
    args = parse(["serve", str(published.root), "--tokens-file", str(bad)])
    with pytest.raises(AuthConfigError, match="at least 16"):
        args.func(args)


def test_sakura_serve_end_to_end_in_a_subprocess(published, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("cli-test-token-0123456789\n")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    cmd = [
        sys.executable,
        "-m",
        "sakura.cli",
        "serve",
        str(published.root),
        "--tokens-file",
        str(tokens),
    ]
    cmd += ["--fd", str(sock.fileno()), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, pass_fds=(sock.fileno(),), stderr=subprocess.PIPE)
    sock.close()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
        assert httpx.get(f"{url}/v1/templates").status_code == 401
        auth = {"Authorization": "Bearer cli-test-token-0123456789"}
        r = httpx.get(
            f"{url}/v1/templates/face-a/sakura/pack", headers={**auth, "Range": "bytes=-64"}
        )
        assert r.status_code == 206 and r.content == published.pack("face-a")[-64:]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        err = proc.stderr.read().decode()
        proc.stderr.close()
    assert "Traceback" not in err
    assert "local folder" in err and "1 token(s)" in err


def test_serving_a_catalog_mirrored_to_s3(published, s3_endpoint):
    import boto3

    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(
        Bucket="packs"
    )
    storage = S3Storage("packs", "prod/catalog", s3_endpoint)
    uploaded = mirror_to_storage(published.root, storage)
    assert uploaded[-1] == "catalog.json"
    assert cli.open_serve_storage(None, "packs", s3_endpoint, "prod/catalog").bucket == "packs"
    with pytest.raises(ServeConfigError, match="no catalog.json"):
        cli.open_serve_storage(None, "packs", s3_endpoint, "elsewhere")
    pack, manifest = published.pack("face-a"), published.manifest("face-a")
    with TestClient(create_app(storage), raise_server_exceptions=False) as client:
        assert client.get("/v1/templates").json() == json.loads(
            (published.root / "catalog.json").read_text()
        )
        assert client.get("/v1/templates/face-a/sakura/manifest").json() == manifest
        r = client.get("/v1/templates/face-a/sakura/pack", headers={"Range": "bytes=0-99,-100"})
        parts = parse_multipart(r.content, r.headers["content-type"])
        assert [p[1] for p in parts] == [pack[:100], pack[-100:]]
        r = client.get("/v1/templates/face-a/sakura/shards/2/1")
        assert r.content == shard_bytes(pack, manifest, 2, 1)
        assert client.get("/v1/templates/face-a/sakura/pack").content == pack
        assert client.get("/v1/templates/tryon-b/sakura/shards/9/9").status_code == 404
        r = client.get(f"/templates/face-a/sakura/{published.packs['face-a'].pack_file}",
                       headers={"Range": "bytes=" + ",".join(["0-1"] * 101)})
        assert r.status_code == 400 and r.json()["code"] == "bad_range"  # one rule, S3 too
    S3Storage("packs", "broken", s3_endpoint).put_atomic("catalog.json", b"{ not json")
    with pytest.raises(ServeConfigError, match="catalog.json in .* is not valid JSON"):
        cli.open_serve_storage(None, "packs", s3_endpoint, "broken")


def test_bench_serve_quick(tmp_path):
    config = BenchConfig(
        clients=32, duration_s=0.6, warmup_s=0.2, shards=4, configs=3, unit_bytes=4096
    )
    result = run_bench(config)
    for key in ["requests_per_s", "gbytes_per_s", "p99_ms", "errors", "reference_gbytes_per_s",
                "nginx_gbytes_per_s"]:
        assert key in result
    assert result["errors"] == 0, result["first_error"]
    assert result["clients"] == 32
    for server in ("sakura", "reference", "nginx"):  # the same single-range GETs on each
        assert result["detail"][server]["requests"] > 0
        assert result["detail"][server]["errors"] == 0


def test_bench_serve_command_writes_json(tmp_path, monkeypatch):
    import sakura.cloud.bench as cloud_bench

    fake = {
        "requests_per_s": 1.0,
        "gbytes_per_s": 0.1,
        "p99_ms": 2.0,
        "errors": 0,
        "reference_gbytes_per_s": 0.2,
        "first_error": "",
    }
    seen = {}
    monkeypatch.setattr(
        cloud_bench, "run_bench", lambda config: seen.setdefault("c", config) and fake
    )
    out = tmp_path / "sub" / "bench.json"
    args = parse(
        ["bench", "serve", "--json", str(out), "--quick", "--clients", "40", "--duration", "1.5"]
    )
    assert args.func(args) == 0
    assert json.loads(out.read_text()) == fake
    assert seen["c"].clients == 40 and seen["c"].duration_s == 1.5
    with pytest.raises(SystemExit) as info:  # a usage error: argparse exits 2
        parse(["bench", "serve", "--json", str(out), "--clients", "0"])
    assert info.value.code == 2
