"""`sakura bench faults`: integrity and fault tolerance on loopback, case by case.

Each case builds its own small synthetic catalog (``cloud.synthetic``), runs the real server
(uvicorn on 127.0.0.1; ``sakura serve`` in a child process where it must be killed) and the
real edge client, injects one fault and checks the promise ``cloud/README.md`` makes:

- ``repair_after_corruption``: a pack with one flipped byte is refused (500 with the reason,
  listed by /healthz); replaced on disk by the original (copy, ``mv``), it is served again
  without a restart, with the right ``X-Sakura-Sha256``;
- ``corrupt_pack_served``: the server never sends a body of a damaged unit (shard endpoint
  and pack ranges), still serves the undamaged configurations, and the client without a
  manifest accepts no wrong byte;
- ``metrics_cardinality``: 400 requests with random 8,000-character methods and 400 unknown
  paths leave ``/metrics`` as it was; a 60,000-character method is refused;
- ``restart_mid_edit``: ``sakura serve`` killed while a body streams and restarted ~6 s
  later on the same port: the client's default policy resumes with Range, same bytes;
- ``truncated_pack_message``: a truncated pack gives one error naming the URL the user
  gave and the server's own message, not "unreachable";
- ``killed_build_cleanup``: the work folder of a killed build is removed by the next one;
  a running build's folder is left alone;
- ``healthz_bad_catalog``: ``/healthz`` answers 503 while ``catalog.json`` is unreadable;
- ``range_over_response_limit_verified``: Range headers over the limit (65, 101, 150
  overlapping ranges) are 400 ``bad_range`` and send nothing, not the whole pack with its
  damaged unit; 64 are one coalesced 206; ``bytes=5-3`` (ignored) verifies the whole pack;
- ``healthz_truncated_pack``: a truncated pack makes ``/healthz`` ``degraded`` naming it
  (``pack_damaged``) before any request failed, and ``ok`` again after the repair;
- ``serve_refuses_bad_catalog``: ``sakura serve`` on an unparseable or ill-shaped
  ``catalog.json`` exits with one ``sakura: error:`` line, no traceback, nothing listening;
- ``head_routes``: HEAD on every GET route; distinct ETags per content coding; ``q=0``;
- ``slow_headers``: connections that trickle their request head are closed after the
  header timeout and the server keeps answering;
- ``reproducible_build``: the same inputs give byte-identical packs for every codec;
- ``seed_out_of_range``: ``sakura edit --seed 2**70`` is a usage error naming the range,
  before torch is imported, nothing written;
- ``bomb_image``: a catalog whose template image is a 20000x20000 PNG is refused by
  ``sakura edit --catalog`` and ``sakura build`` as a decompression bomb, before torch;
- ``empty_prompt``: an empty (whitespace) ``--prompt`` is a usage error, nothing written;
- ``native_truncated_total_checked``: a truncated pack on a single-range static origin:
  the native runtime (``sakura edit``'s default) says "has N bytes, its manifest says M:
  the published pack is truncated or was replaced" within 3 s of its first pack request,
  not after refetches;
- ``native_python_same_errors``: four broken origins (truncated, 416, a damaged unit on
  ``sakura serve``, Range ignored) through ``EdgeRuntime.edit`` of both runtimes: the same
  error class and the same numbers in the messages.

The two native cases run the product path on the shipped model: the shipped template
``face-technologist`` built by ``sakura build``'s builder (one real build per run, in a
work folder the run shares between them: ~25 s on an idle 2-core machine, minutes under
load), the shipped weights loaded as ``sakura edit`` loads them.

``cases`` maps each name to ``{"ok", "detail"}``; ``wrong_bytes_accepted`` counts bodies the
client returned that differ from the published bytes; ``crashes`` counts servers that
stopped answering. Every case is also a test (``tests/cloud/test_faults.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sakura.argtypes import json_out
from sakura.cloud.origins import free_port
from sakura.dit.cli import SHIPPED_CATALOG
from sakura.edge.errors import EdgeError, OriginError, ServerUnreachable
from sakura.errors import UsageError
from sakura.output import write_json

# The imports inside functions below keep torch, the model and the web stack (FastAPI,
# uvicorn, aiohttp, pydantic) off `sakura --help`: this module registers the command.

TEMPLATE = "face-a"


def register(commands: Any, bench: Any) -> None:
    b = bench.add_parser(
        "faults", help="integrity and fault tolerance of serving, case by case (loopback)",
        description="Corrupted and repaired packs, hostile methods, a server restart mid-edit, "
                    "truncated packs, killed builds, a bad catalog, HEAD, slow headers, "
                    "reproducible builds: each case checked, a JSON report.")
    json_out(b, help="write the result here (- for stdout)")
    b.add_argument("--cases", metavar="LIST", help="comma-separated case names (default all)")
    b.set_defaults(func=_main)


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


# ----------------------------------------------------------------------------- helpers


def _catalog(root: Path, shards: int = 4, configs: int = 3, unit_bytes: int = 4096) -> Any:
    from sakura.cloud.synthetic import SyntheticSpec, build_catalog  # lazy: pydantic

    return build_catalog(root, [TEMPLATE], spec=SyntheticSpec(shards, configs, unit_bytes))[
        TEMPLATE]


def _manifest(root: Path, pub: Any) -> dict[str, Any]:
    return json.loads((root / pub.versioned_manifest_key).read_text())


@contextlib.contextmanager
def _server(root: Path, header_timeout_s: float | None = None) -> Iterator[tuple[str, Any]]:
    from sakura.cloud.runner import HEADER_TIMEOUT_S, serve_in_thread  # lazy: web stack
    from sakura.cloud.server import create_app  # lazy: web stack
    from sakura.cloud.storage import LocalStorage  # lazy: CLI --help stays fast

    app = create_app(LocalStorage(root))
    with serve_in_thread(app, header_timeout_s=header_timeout_s or HEADER_TIMEOUT_S) as url:
        yield url, app


def _get(url: str, headers: dict[str, str] | None = None, method: str = "GET"
         ) -> tuple[int, Any, bytes]:
    """(status, headers (case-insensitive), body) of one request."""
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def _alive(url: str, tally: Tally) -> None:
    try:
        status, _, _ = _get(url + "/healthz")
    except OSError:
        status = 0
    if status == 0:
        tally.crashes += 1
        raise CaseFailed(f"the server at {url} stopped answering")


def _fetch(url: str, manifest: dict[str, Any] | None, shard: int, config: int,
           retry: Any = None) -> bytes:
    from sakura.edge.client import PackClient, RetryPolicy  # lazy: aiohttp

    policy = retry or RetryPolicy(window_s=2.0, backoff_s=0.05, backoff_max_s=0.2)

    async def go() -> bytes:
        async with PackClient(url, retry=policy) as c:
            got = await c.fetch_config(TEMPLATE, "sakura", shard, config, manifest=manifest)
            return got.data

    return asyncio.run(go())


def _body(root: Path, pub: Any, manifest: dict[str, Any], shard: int, config: int) -> bytes:
    pack = (root / pub.pack_key).read_bytes()
    entry = next(c for c in manifest["shards"][shard]["configs"] if c["id"] == config)
    (offset, length), = entry["ranges"]
    return pack[offset : offset + length]


def _flip(path: Path, offset: int) -> bytes:
    data = path.read_bytes()
    bad = bytearray(data)
    bad[offset] ^= 0xFF
    path.write_bytes(bytes(bad))
    return data


# ------------------------------------------------------------------------------- cases


def case_repair_after_corruption(work: Path, tally: Tally) -> str:
    root = work / "catalog"
    pub = _catalog(root)
    m = _manifest(root, pub)
    pack = root / pub.pack_key
    (offset, length), = m["shards"][1]["configs"][0]["ranges"]
    original = _flip(pack, offset + 7)
    with _server(root) as (url, _app):
        shard_url = f"{url}/v1/templates/{TEMPLATE}/sakura/shards/1/0"
        pack_url = f"{url}/templates/{TEMPLATE}/sakura/{pub.pack_file}"
        rng = {"Range": f"bytes={offset}-{offset + length - 1}"}
        for _ in range(2):  # two fetches while damaged (and the caches that had)
            status, _, body = _get(shard_url)
            check(status == 500 and b"damaged" in body, f"damaged shard answered {status}")
            status, _, body = _get(pack_url, rng)
            check(status == 500 and b"damaged" in body, f"damaged range answered {status}")
        status, _, body = _get(url + "/healthz")
        health = json.loads(body)
        check(health["status"] == "degraded" and health["damaged"][0]["pack"] == pub.pack_key,
              f"/healthz did not report the damaged pack: {health}")
        # repair as an operator would: copy to a temp name, rename over it
        tmp = pack.with_name(".repair.tmp")
        tmp.write_bytes(original)
        os.replace(tmp, pack)
        want = _body(root, pub, m, 1, 0)
        status, headers, body = _get(shard_url)
        check(status == 200 and body == want, f"repaired shard answered {status}")
        check(headers.get("X-Sakura-Sha256") == hashlib.sha256(want).hexdigest(),
              "the checksum header is not the repaired body's")
        status, _, body = _get(pack_url, rng)
        check(status == 206 and body == want, f"repaired range answered {status}")
        got = _fetch(url, None, 1, 0)
        tally.wrong_bytes_accepted += got != want
        check(got == want, "the client got other bytes after the repair")
        health = json.loads(_get(url + "/healthz")[2])
        check(health == {"status": "ok", "damaged": []}, f"/healthz after repair: {health}")
        _alive(url, tally)
    return "refused while damaged (500, /healthz degraded), served again after the mv"


def case_corrupt_pack_served(work: Path, tally: Tally) -> str:
    root = work / "catalog"
    pub = _catalog(root)
    m = _manifest(root, pub)
    pack = root / pub.pack_key
    (offset, _length), = m["shards"][2]["configs"][-1]["ranges"]
    unit = m["shards"][2]["configs"][-1]["units"][-1]
    flip_at = m["units"][unit][0] + 3  # in the last unit of shard 2's largest config
    original = _flip(pack, flip_at)
    refused = served = 0
    with _server(root) as (url, _app):
        for shard in m["shards"]:
            for cfg in shard["configs"]:
                (o, n), = cfg["ranges"]
                damaged = o <= flip_at < o + n
                for target, headers in (
                        (f"{url}/v1/templates/{TEMPLATE}/sakura/shards/{shard['index']}/"
                         f"{cfg['id']}", {}),
                        (f"{url}/templates/{TEMPLATE}/sakura/{pub.pack_file}",
                         {"Range": f"bytes={o}-{o + n - 1}"})):
                    status, _, body = _get(target, headers)
                    if damaged:
                        check(status == 500, f"a damaged range answered {status}")
                        refused += 1
                    else:
                        check(status in (200, 206) and body == original[o : o + n],
                              f"an undamaged configuration answered {status}")
                        served += 1
        status, _, _ = _get(f"{url}/templates/{TEMPLATE}/sakura/{pub.pack_file}")
        check(status == 500, f"the whole damaged pack answered {status}")
        cfg = m["shards"][2]["configs"][-1]
        for manifest in (None, m):  # with and without a manifest in hand
            try:
                got = _fetch(url, manifest, 2, cfg["id"])
            except EdgeError:
                continue
            tally.wrong_bytes_accepted += got != original[offset : offset + len(got)]
            raise CaseFailed("the client returned a body of a damaged pack")
        _alive(url, tally)
    return f"{refused} damaged requests refused (500), {served} undamaged served"


def case_metrics_cardinality(work: Path, tally: Tally) -> str:
    root = work / "catalog"
    _catalog(root)
    rng = random.Random(0)
    with _server(root) as (url, _app):
        host, port = url.removeprefix("http://").split(":")
        _get(url + "/healthz")
        before = len(_get(url + "/metrics")[2])
        statuses: set[int] = set()
        for i in range(400):
            method = "".join(rng.choice(string.ascii_uppercase) for _ in range(8000))
            statuses.add(_raw_status(host, int(port), f"{method} /v1/templates HTTP/1.1\r\n"
                                     f"Host: x\r\n\r\n".encode()))
            path = f"/nope/{i}/" + "x" * 200
            statuses.add(_get(url + path)[0])
        huge = "M" * 60_000
        status = _raw_status(host, int(port), f"{huge} / HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        check(status in (0, 400, 413, 414, 431, 501), f"a 60,000-character method: {status}")
        check(200 not in statuses, f"hostile requests answered {sorted(statuses)}")
        after = len(_get(url + "/metrics")[2])
        check(after - before < 4000, f"/metrics grew from {before} to {after} bytes")
        _alive(url, tally)
    return (f"/metrics {before} -> {after} bytes after 800 hostile requests; answers "
            f"{sorted(statuses)}; 60,000-character method: {status or 'connection closed'}")


def _raw_status(host: str, port: int, request: bytes) -> int:
    """Send raw bytes, return the status of the answer (0: closed without one)."""
    with socket.create_connection((host, port), timeout=10) as s:
        try:
            s.sendall(request)
            data = s.recv(4096)
        except OSError:
            return 0
    try:
        return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    except (IndexError, ValueError):
        return 0


@contextlib.contextmanager
def _serve_process(root: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-m", "sakura.cli", "serve", str(root), "--port",
                             str(port), "--no-access-log", "--log-level", "critical"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise CaseFailed("sakura serve did not start") from None
                time.sleep(0.1)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def case_restart_mid_edit(work: Path, tally: Tally) -> str:
    import threading

    from sakura.edge.client import PackClient, RetryPolicy  # lazy: aiohttp

    root = work / "catalog"
    pub = _catalog(root, shards=2, configs=2, unit_bytes=1 << 20)  # a 6 MB configuration
    m = _manifest(root, pub)
    cfg = m["shards"][1]["configs"][-1]
    want = _body(root, pub, m, 1, cfg["id"])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    state: dict[str, Any] = {}
    stack = contextlib.ExitStack()
    with stack:
        state["proc"] = stack.enter_context(_serve_process(root, port))
        down = threading.Event()

        def restart() -> None:
            proc = state["proc"]
            proc.send_signal(signal.SIGKILL)  # killed, not stopped: the body is cut
            proc.wait()
            down.set()
            time.sleep(4.0)  # + the start of a new process: about 6 s without a server
            state["proc"] = stack.enter_context(_serve_process(root, port))
            state["back"] = time.monotonic()

        def progress(n: int) -> None:
            if n >= 256 * 1024 and "killer" not in state:
                state["killer"] = threading.Thread(target=restart, daemon=True)
                state["killer"].start()
                down.wait(10)
            time.sleep(0.002)  # a slow reader: the body is still streaming when it dies

        async def go() -> Any:
            async with PackClient(url, retry=RetryPolicy()) as c:  # the default policy
                return await c.fetch_config(TEMPLATE, "sakura", 1, cfg["id"], manifest=m,
                                            progress=progress)

        t0 = time.monotonic()
        got = asyncio.run(go())
        elapsed = time.monotonic() - t0
        state["killer"].join(30)
        tally.wrong_bytes_accepted += got.data != want
        check(got.data == want, "the resumed body differs")
        check(got.resumes >= 1 and got.refetches == 0, f"resumes {got.resumes}")
        check("back" in state and elapsed >= 4.0, "the server was not down long enough")
    return (f"killed at {256 * 1024 // 1024} KB of {len(want) // 1024} KB, back after "
            f"{state['back'] - t0:.1f} s; body complete in {elapsed:.1f} s with "
            f"{got.resumes} Range resume(s), {got.attempts} attempts")


def case_truncated_pack_message(work: Path, tally: Tally) -> str:
    root = work / "catalog"
    pub = _catalog(root)
    m = _manifest(root, pub)
    pack = root / pub.pack_key
    pack.write_bytes(pack.read_bytes()[:-100])
    with _server(root) as (url, _app):
        try:
            _fetch(url, m, 0, 0)
        except OriginError as exc:
            message = str(exc)
        else:
            raise CaseFailed("a truncated pack was served")
        check(url in message, f"the error does not name {url}: {message}")
        check("truncated or corrupt" in message and "HTTP 500" in message,
              f"the server's message is missing: {message}")
        check("reach" not in message, f"reported as unreachable: {message}")
        _alive(url, tally)
    return message


def case_killed_build_cleanup(work: Path, tally: Tally) -> str:
    from sakura.cloud.publish import build_workdir, sweep_stale_builds  # lazy: pydantic

    root = work / "catalog"
    root.mkdir(parents=True)
    script = ("import os, signal, sys, time; from pathlib import Path; "
              "from sakura.cloud.publish import build_workdir\n"
              "with build_workdir(sys.argv[1]) as d:\n"
              "    (Path(d) / 'half-written.pack').write_bytes(os.urandom(1 << 20))\n"
              "    print(d, flush=True)\n"
              "    if sys.argv[2] == 'kill': os.kill(os.getpid(), signal.SIGKILL)\n"
              "    time.sleep(60)\n")
    killed = subprocess.run([sys.executable, "-c", script, str(root), "kill"],
                            capture_output=True, text=True, timeout=60)
    dead = Path(killed.stdout.strip())
    check(dead.is_dir(), "the killed build left no folder to clean (test setup)")
    running = subprocess.Popen([sys.executable, "-c", script, str(root), "run"],
                               stdout=subprocess.PIPE, text=True)
    try:
        alive = Path(running.stdout.readline().strip())
        with build_workdir(root) as mine:
            check(not dead.exists(), "the next build did not remove the killed build's folder")
            check(alive.is_dir(), "the next build removed a running build's folder")
            check(mine.is_dir(), "no work folder")
    finally:
        running.kill()
        running.wait()
    removed = sweep_stale_builds(root)
    check(alive.name in removed and not alive.exists(), "a killed build's folder survived")
    left = sorted(p.name for p in root.iterdir())
    check(not any(n.startswith(".build-") for n in left), f"left behind: {left}")
    return f"the killed build's {dead.name} removed, a running build's kept until it died"


def case_healthz_bad_catalog(work: Path, tally: Tally) -> str:
    root = work / "catalog"
    _catalog(root)
    catalog = root / "catalog.json"
    good = catalog.read_bytes()
    with _server(root) as (url, _app):
        check(_get(url + "/healthz")[0] == 200, "healthy catalog not ok")
        catalog.write_bytes(b"{ not json")
        status, _, body = _get(url + "/healthz")
        check(status == 503 and b"invalid" in body, f"/healthz with a broken catalog: {status}")
        status, _, _ = _get(f"{url}/v1/templates")
        check(status >= 500, f"/v1 with a broken catalog: {status}")
        catalog.write_bytes(good)
        check(_get(url + "/healthz")[0] == 200, "/healthz did not recover")
        _alive(url, tally)
    return f"/healthz 503 while catalog.json is broken: {json.loads(body)['error'][:80]}"


def case_head_routes(work: Path, tally: Tally) -> str:
    root = work / "catalog"
    pub = _catalog(root)
    paths = ["/healthz", "/metrics", "/catalog.json", "/v1/templates", f"/v1/templates/{TEMPLATE}",
             f"/v1/templates/{TEMPLATE}/sakura/manifest",
             f"/templates/{TEMPLATE}/sakura/manifest.json",
             f"/templates/{TEMPLATE}/sakura/{pub.pack_file}",
             f"/v1/templates/{TEMPLATE}/sakura/pack", f"/v1/templates/{TEMPLATE}/sakura/shards/0/0"]
    with _server(root) as (url, _app):
        for path in paths:
            status, headers, body = _get(url + path, method="HEAD")
            check(status == 200 and body == b"", f"HEAD {path}: {status}")
        manifest = f"{url}/templates/{TEMPLATE}/sakura/manifest.json"
        plain = _get(manifest, {"Accept-Encoding": "identity"})[1]
        zipped = _get(manifest, {"Accept-Encoding": "gzip"})[1]
        check(plain["ETag"] != zipped["ETag"], "gzip and identity share one ETag")
        check(zipped.get("Content-Encoding") == "gzip", "gzip not served when asked")
        refused = _get(manifest, {"Accept-Encoding": "*;q=0.5, gzip;q=0"})[1]
        check("Content-Encoding" not in refused, "gzip;q=0 still got gzip")
        _alive(url, tally)
    return f"HEAD 200 on {len(paths)} routes; ETags {plain['ETag'][-8:]} / {zipped['ETag'][-8:]}"


def case_slow_headers(work: Path, tally: Tally) -> str:
    root = work / "catalog"
    _catalog(root)
    timeout = 1.0
    with _server(root, header_timeout_s=timeout) as (url, _app):
        host, port = url.removeprefix("http://").split(":")
        socks = []
        for _ in range(20):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        t0 = time.monotonic()
        closed = 0
        while time.monotonic() - t0 < timeout + 4 and closed < len(socks):
            closed = 0
            for s in socks:
                try:
                    s.sendall(b"X-Slow: 1\r\n")  # a header line now and then, never the end
                except OSError:
                    closed += 1
            time.sleep(0.25)
        elapsed = time.monotonic() - t0
        for s in socks:
            s.close()
        check(closed == len(socks), f"{len(socks) - closed} slow-header connections still open "
                                    f"after {elapsed:.1f} s")
        check(_get(url + "/healthz")[0] == 200, "the server stopped answering")
        _alive(url, tally)
    return f"20 slow-header connections closed within {elapsed:.1f} s (header timeout {timeout} s)"


def _error_code(body: bytes) -> str | None:
    try:
        return json.loads(body).get("code")
    except (ValueError, AttributeError):
        return None


def case_range_over_response_limit_verified(work: Path, tally: Tally) -> str:
    """One Range parse decides what is verified and what is sent: ranges over good bytes in
    a header over the limit never bring the pack's damaged unit along."""
    root = work / "catalog"
    pub = _catalog(root)
    m = _manifest(root, pub)
    pack = root / pub.pack_key
    last_off, last_len = m["units"][-1][0], m["units"][-1][1]
    original = _flip(pack, last_off + 1)  # the last unit is damaged, the first ones are not
    damaged = pack.read_bytes()[last_off : last_off + last_len]
    (offset, length), = m["shards"][0]["configs"][0]["ranges"]
    check(offset + length <= last_off, "test setup: the range reaches the damaged unit")
    spec = f"{offset}-{offset + length - 1}"
    with _server(root) as (url, _app):
        pack_url = f"{url}/templates/{TEMPLATE}/sakura/{pub.pack_file}"
        t0 = time.perf_counter()
        status, _, body = _get(pack_url, {"Range": "bytes=" + ",".join([spec] * 101)})
        seconds = time.perf_counter() - t0
        message = json.loads(body).get("error", "") if status == 400 else ""
        for count in (65, 101, 150):
            status, _, body = _get(pack_url, {"Range": "bytes=" + ",".join([spec] * count)})
            check(damaged not in body, f"{count} ranges: the damaged unit was sent ({status})")
            check(status == 400 and _error_code(body) == "bad_range",
                  f"{count} ranges answered {status} {body[:120]!r}")
        status, headers, body = _get(pack_url, {"Range": "bytes=" + ",".join([spec] * 64)})
        check(status == 206 and body == original[offset : offset + length]
              and headers.get("Content-Range") == f"bytes {spec}/{len(original)}",
              f"64 overlapping ranges answered {status} ({len(body)} bytes)")
        status, _, body = _get(pack_url, {"Range": "bytes=5-3"})  # ignored: the whole pack
        check(status == 500 and _error_code(body) == "pack_damaged",
              f"bytes=5-3 on a damaged pack answered {status} {body[:120]!r}")
        _alive(url, tally)
    return f"{message} ({seconds:.3f} s, HTTP 400 bad_range; 64 ranges: one 206)"


def case_healthz_truncated_pack(work: Path, tally: Tally) -> str:
    root = work / "catalog"
    pub = _catalog(root)
    pack = root / pub.pack_key
    good = pack.read_bytes()
    with _server(root) as (url, _app):
        health = json.loads(_get(url + "/healthz")[2])
        check(health == {"status": "ok", "damaged": []}, f"/healthz before: {health}")
        pack.write_bytes(good[:-100])
        t0 = time.perf_counter()
        status, _, body = _get(url + "/healthz")
        seconds = time.perf_counter() - t0
        health = json.loads(body)
        check(status == 200 and health["status"] == "degraded",
              f"/healthz with a truncated pack: {status} {health}")
        entries = [(d["pack"], d.get("code")) for d in health["damaged"]]
        check(entries == [(pub.pack_key, "pack_damaged")], f"/healthz lists {entries}")
        message = health["damaged"][0]["error"]
        check(f"has {len(good) - 100} bytes" in message, f"no sizes in {message!r}")
        status, _, body = _get(f"{url}/v1/templates/{TEMPLATE}/sakura/shards/0/0")
        check(status == 500 and _error_code(body) == "pack_damaged",
              f"a shard of the truncated pack answered {status} {body[:120]!r}")
        pack.write_bytes(good)
        health = json.loads(_get(url + "/healthz")[2])
        check(health == {"status": "ok", "damaged": []}, f"/healthz after the repair: {health}")
        _alive(url, tally)
    return f"{message} ({seconds:.3f} s, /healthz degraded)"


def case_serve_refuses_bad_catalog(work: Path, tally: Tally) -> str:
    root = work / "catalog"
    _catalog(root)
    first = ""
    worst = 0.0
    for text in (b"{ not json", b'{"version": 1, "templates": []}'):
        (root / "catalog.json").write_bytes(text)
        port = free_port()
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "sakura.cli", "serve", str(root), "--port",
                            str(port)], capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL)
        worst = max(worst, time.perf_counter() - t0)
        lines = r.stderr.strip().splitlines()
        check("Traceback" not in r.stderr, f"a traceback: {r.stderr[-800:]}")
        check(r.returncode != 0, f"sakura serve started on {text!r} (exit {r.returncode})")
        check(len(lines) == 1 and lines[0].startswith("sakura: error: ")
              and "catalog.json" in lines[0], f"expected one error line: {r.stderr[-400:]}")
        try:
            _get(f"http://127.0.0.1:{port}/healthz")
        except OSError:
            pass
        else:
            raise CaseFailed(f"something answers on port {port} after the refusal")
        first = first or f"{lines[0]} ({worst:.2f} s, exit {r.returncode})"
    return first


def case_reproducible_build(work: Path, tally: Tally) -> str:
    from sakura.codec import get_codec  # lazy: torch
    from sakura.codec.pack import write_pack  # lazy: torch
    from sakura.dit.synthetic import synthetic_cache  # lazy: torch

    cache = synthetic_cache(steps=1, blocks=2, grid=8, channels=32, heads=2, seed=5)
    names = ("sakura", "svd", "sakura-all", "fp16", "intq", "cachegen")
    shas = {}
    for run in ("a", "b"):
        for name in names:
            m = write_pack(work / run / name, "tpl", cache, get_codec(name), blocks_per_shard=1)
            shas.setdefault(name, []).append(m.pack_sha256)
    differ = [n for n, (a, b) in shas.items() if a != b]
    check(not differ, f"packs differ between two builds: {differ}")
    return f"{len(names)} codecs: byte-identical packs from the same inputs"


# ------------------------------------------------------- bad inputs at the front door
# Each runs the real `sakura` command in a child process whose heavy modules cannot be
# imported (torch, the model, the web stack): the error must come from the argument or
# catalog check, before anything loads, as one line, with nothing written.

INPUT_HEAVY = ("torch", "transformers", "diffusers", "skimage", "safetensors")
BOMB_SIDE = 20_000  # a 20000 x 20000 PNG: 400 M pixels, ~50 KB on disk (1 bit per pixel)


def write_bomb_png(path: Path, side: int = BOMB_SIDE) -> Path:
    """A valid black ``side`` x ``side`` 1-bit PNG: tiny on disk, ``side**2`` pixels
    decoded (PIL's decompression-bomb limit is ~89.5 M; 20000**2 is 400 M)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    row = b"\0" * (1 + (side + 7) // 8)  # filter byte + packed bits
    z = zlib.compressobj(9)
    rows_per_piece = 1000
    parts = [z.compress(row * min(rows_per_piece, side - i))
             for i in range(0, side, rows_per_piece)]
    parts.append(z.flush())
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1-bit greyscale
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
                     + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b""))
    return path


def _front_door(argv: list[str], work: Path) -> tuple[int, list[str], str, float]:
    """``sakura ARGV`` with the heavy modules blocked: (exit code, its ``error:`` lines,
    all of stderr, seconds until it exited)."""
    script = (f"import sys\nfor m in {INPUT_HEAVY!r}: sys.modules[m] = None\n"
              f"from sakura.cli import main\nsys.exit(main({argv!r}))\n")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, cwd=work)
    seconds = time.perf_counter() - t0
    lines = [ln for ln in r.stderr.splitlines() if ": error: " in ln]
    return r.returncode, lines, r.stderr, seconds


def _one_clear_error(argv: list[str], work: Path, code: int, needle: str) -> str:
    """Check that ``sakura ARGV`` fails with exit ``code`` and one error line holding
    ``needle``, no traceback, nothing written to ``work/out``; returns that line."""
    out = work / "out"
    got, lines, err, seconds = _front_door(argv, work)
    check("Traceback" not in err, f"a traceback: {err[-800:]}")
    check(got == code, f"exit {got}, expected {code}: {err[-400:]}")
    check(len(lines) == 1 and needle in lines[0], f"expected one error with {needle!r}: {err}")
    check(not out.exists() or not any(out.iterdir()), f"wrote {sorted(out.iterdir())}")
    return f"{lines[0]} ({seconds:.2f} s, exit {got})"


def _edit_argv(work: Path, *extra: str) -> list[str]:
    (work / "out").mkdir(exist_ok=True)
    return ["edit", "--server", "http://127.0.0.1:9", "--template", "t", "--prompt",
            "a red hat", "--no-state", "--out", str(work / "out" / "edit.png"), *extra]


def case_seed_out_of_range(work: Path, tally: Tally) -> str:
    argv = _edit_argv(work, "--seed", str(2**70))
    return _one_clear_error(argv, work, 2, "argument --seed: seed 1180591620717411303424 is "
                                           "out of range")


def case_empty_prompt(work: Path, tally: Tally) -> str:
    argv = _edit_argv(work)
    argv[argv.index("--prompt") + 1] = " \t "
    return _one_clear_error(argv, work, 2, "the prompt is empty")


def case_bomb_image(work: Path, tally: Tally) -> str:
    """A catalog whose template image is a 20000 x 20000 PNG: refused by `sakura edit
    --catalog` and by `sakura build`, naming the image, before torch is imported."""
    catalog = work / "catalog"
    catalog.mkdir()
    doc = json.loads(SHIPPED_CATALOG.read_text())
    entry = dict(next(iter(doc["templates"].values())))
    entry["image"] = write_bomb_png(catalog / "bomb.png").name
    entry["mask"] = str(SHIPPED_CATALOG.parent / entry["mask"])
    (catalog / "catalog.json").write_text(json.dumps({**doc, "templates": {"bomb": entry}}))
    edit = _edit_argv(work, "--catalog", str(catalog))
    edit[edit.index("--template") + 1] = "bomb"
    message = _one_clear_error(edit, work, 1, "bomb.png: refused as a decompression bomb")
    _one_clear_error(["build", str(catalog), "--out", str(work / "out" / "packs")], work, 1,
                     "bomb.png: refused as a decompression bomb")
    return message


def case_damaged_pack_reported_not_unreachable(work: Path, tally: Tally) -> str:
    """A flipped byte in a pack on `sakura serve`: the client (its default 30 s retry
    window) reports the server's own reason (code pack_damaged) at once, not 'cannot
    reach the server' after the window."""
    from sakura.edge.client import RetryPolicy  # lazy: aiohttp

    root = work / "catalog"
    pub = _catalog(root)
    m = _manifest(root, pub)
    cfg = m["shards"][1]["configs"][0]
    (offset, _), = cfg["ranges"]
    _flip(root / pub.pack_key, offset + 1)
    with _server(root) as (url, _app):
        t0 = time.perf_counter()
        try:
            _fetch(url, m, 1, cfg["id"], retry=RetryPolicy())
        except ServerUnreachable as exc:
            raise CaseFailed(f"reported as unreachable: {exc}") from None
        except OriginError as exc:
            seconds = time.perf_counter() - t0
            check("pack_damaged" in str(exc) and "damaged" in str(exc),
                  f"the error does not name the damage: {exc}")
            check(seconds <= 3.0, f"the damage was reported after {seconds:.1f} s")
            _alive(url, tally)
            return f"{seconds:.2f} s: {exc}"
        tally.wrong_bytes_accepted += 1
        raise CaseFailed("the client accepted a body of a damaged pack")


def case_unreachable_origin_progress(work: Path, tally: Tally) -> str:
    """Nothing listens at the origin: the client says what it waits for at its first retry
    (not silence until the retry window ends), then gives up naming the cause."""
    import socket

    from sakura.edge.client import PackClient, RetryPolicy  # lazy: aiohttp

    with socket.socket() as sock:  # a port with nothing behind it
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()

    async def go() -> None:
        async with PackClient(url, retry=RetryPolicy(window_s=3.0),
                              on_wait=lambda m: lines.append((time.perf_counter() - t0, m))
                              ) as client:
            await client.catalog()

    try:
        asyncio.run(go())
    except ServerUnreachable as exc:
        check(bool(lines), "no line while waiting")
        first_s, first = lines[0]
        check(first_s <= 1.0, f"the first waiting line came after {first_s:.1f} s")
        check("connection refused" in first and "retry 1" in first, f"unclear line: {first}")
        check("connection refused" in str(exc), f"the error does not name the cause: {exc}")
        return f"first line after {first_s:.2f} s: {first}; {len(lines)} lines, then: {exc}"
    raise CaseFailed("a client reached an origin with nothing listening")


# ------------------------------------------------- the native runtime on the real model
# The two native cases run the product's edit path: the shipped catalog template built by
# the provider's builder (`sakura build`: the shipped model's template run, importance
# profiling, the sakura codec, an atomic publish), the shipped model on the device
# (`load_engine(None)`, as `sakura edit` loads it), `EdgeRuntime.edit` with the default
# options. A real build takes ~25 s on 2 cores, so one `sakura bench faults` run builds it
# once (under the run's shared work folder) for both cases; a case run on its own (a test)
# builds it in its own folder unless a shared one is set (:func:`shared_work`).

REAL_MODEL_CASES = ("native_truncated_total_checked", "native_python_same_errors")
REAL_TEMPLATE = "face-technologist"  # the shipped catalog's first template (the demo's)
_SHARED: dict[str, Any] = {}  # "dir": the run's shared work folder; "world": what is built


@contextlib.contextmanager
def shared_work(folder: Path) -> Iterator[Path]:
    """Within the block, the native cases share one real catalog and runtimes built under
    ``folder`` (the first case that needs them builds them)."""
    saved = dict(_SHARED)
    _SHARED.clear()
    _SHARED["dir"] = Path(folder)
    try:
        yield Path(folder)
    finally:
        _SHARED.clear()
        _SHARED.update(saved)


@dataclass
class RealWorld:
    catalog: Path  # a published catalog: REAL_TEMPLATE's sakura pack
    runtimes: dict[str, Any]  # "python" / "native": EdgeRuntime on the shipped model
    manifest: dict[str, Any]
    pack_key: str


def _real_world(work: Path) -> RealWorld:
    if "world" in _SHARED:
        return _SHARED["world"]
    from sakura.cloud.build import BuildConfig, build  # lazy: CLI --help stays fast
    from sakura.dit.adapters.engine import load_engine  # lazy: torch
    from sakura.edge.runtime import EdgeRuntime  # lazy: torch

    root = _SHARED.get("dir", work) / "real-catalog"
    build(BuildConfig(out_dir=str(root), templates=(REAL_TEMPLATE,), codecs=("sakura",)),
          log=lambda *_: None)
    folder = root / "templates" / REAL_TEMPLATE / "sakura"
    manifest = json.loads((folder / "manifest.json").read_text())
    engine = load_engine(None)  # the shipped model, as `sakura edit` loads it
    runtimes = {name: EdgeRuntime(engine, state_dir=None, runtime=name)
                for name in ("python", "native")}
    world = RealWorld(root, runtimes, manifest,
                      f"templates/{REAL_TEMPLATE}/sakura/{manifest['pack_file']}")
    if "dir" in _SHARED:
        _SHARED["world"] = world
    return world


class StaticOrigin:
    """A plain static file origin (aiohttp ``FileResponse``: one range per GET, 206 with
    ``Content-Range`` of the file on disk, 416 past its end) on 127.0.0.1 in a thread.
    ``ignore_range``: it answers every GET 200 with the whole object (no range support).
    ``first_pack_get``: ``time.perf_counter()`` when the first GET of a pack arrived."""

    def __init__(self, root: Path, ignore_range: bool = False) -> None:
        self.root, self.ignore_range = Path(root).resolve(), ignore_range
        self.first_pack_get: float | None = None
        self.pack_gets = 0
        self.url = ""

    def __enter__(self) -> StaticOrigin:
        import threading

        from aiohttp import web

        async def static(request: web.Request) -> web.StreamResponse:
            path = (self.root / request.match_info["path"]).resolve()
            if not path.is_relative_to(self.root) or not path.is_file():
                raise web.HTTPNotFound()
            if request.method == "GET" and path.suffix == ".pack":
                self.pack_gets += 1
                if self.first_pack_get is None:
                    self.first_pack_get = time.perf_counter()
            if self.ignore_range:  # a server without range support: the whole object
                return web.Response(body=path.read_bytes(),
                                    content_type="application/octet-stream")
            return web.FileResponse(path)

        app = web.Application()
        app.router.add_get("/{path:.+}", static)
        self._loop = asyncio.new_event_loop()
        runner = web.AppRunner(app, access_log=None)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.SockSite(runner, sock).start())
        self._runner = runner
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="static-origin")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def _copy_catalog(world: RealWorld, to: Path) -> Path:
    import shutil

    shutil.copytree(world.catalog, to)
    return to / world.pack_key


def _edit_error(world: RealWorld, runtime: str, url: str) -> tuple[BaseException, float]:
    """The error ``EdgeRuntime.edit`` of the runtime raises against ``url`` (the default
    options: the product's 30 s retry window), and when it was raised
    (``time.perf_counter()``)."""
    rt = world.runtimes[runtime]
    rt.manifests.clear()  # each edit starts from its own manifest fetch
    template = rt.fetch_template(url, REAL_TEMPLATE)
    req = rt.request("a man technologist with a red hat", 7)
    try:
        res = rt.edit(url, REAL_TEMPLATE, template, req, "sakura")
    except EdgeError as exc:
        return exc, time.perf_counter()
    raise CaseFailed(f"the {runtime} runtime finished an edit from a broken origin at {url} "
                     f"({res.bytes} bytes, {res.local_fallbacks} local steps, warnings "
                     f"{res.warnings})")


def case_native_truncated_total_checked(work: Path, tally: Tally) -> tuple[str, float]:
    """A truncated pack on a single-range static origin: the native runtime (the default of
    `sakura edit`) compares the ``Content-Range`` total with the manifest's ``pack_bytes``
    and reports it at once, in the Python runtime's words, not after refetches.

    The real product path: the shipped model and a real build (shared, see
    :func:`shared_work`); seconds counted from the first pack GET the origin received."""
    world = _real_world(work)
    pack = _copy_catalog(world, work / "truncated")
    full = int(world.manifest["pack_bytes"])
    pack.write_bytes(pack.read_bytes()[: full // 2])
    with StaticOrigin(work / "truncated") as origin:
        exc, at = _edit_error(world, "native", origin.url)
        check(origin.first_pack_get is not None, "the native runtime requested no pack byte")
        seconds = at - origin.first_pack_get
        gets = origin.pack_gets
    message = str(exc)
    want = (f"has {full // 2} bytes, its manifest says {full}: the published pack is "
            "truncated or was replaced")
    check(isinstance(exc, OriginError), f"{type(exc).__name__}, not OriginError: {message}")
    check(want in message, f"not the size check's message: {message}")
    check("keeps failing verification" not in message and "reach" not in message,
          f"reported as another failure: {message}")
    check(seconds <= 3.0, f"reported {seconds:.2f} s after the first pack request")
    return f"{seconds:.3f} s after the first pack GET ({gets} pack GETs): {message}", seconds


def error_numbers(message: str) -> list[int]:
    """The numbers a failure message states (sizes, offsets, unit numbers, HTTP statuses,
    the origin's own ``Content-Range`` that both runtimes' 416 message quotes), in order:
    URLs and paths (their ports and hashes) left out."""
    import re

    text = re.sub(r"\S*/\S*", " ", message.replace("bytes */", "bytes * "))
    return [int(x) for x in re.findall(r"(?<![\w.])\d+(?![\w.])", text)]


def case_native_python_same_errors(work: Path, tally: Tally) -> tuple[str, float]:
    """The same broken origins fed to both runtimes through ``EdgeRuntime.edit`` (the
    shipped model, a real build shared with ``native_truncated_total_checked``): a
    truncated pack on a static origin (its ``Content-Range`` total is not the manifest's),
    one shorter than the first range (416), a damaged unit on ``sakura serve``
    (``pack_damaged``), a static origin that ignores Range (200 with the whole object).
    Each: the same error class and the same numbers in the two messages."""
    world = _real_world(work)
    m = world.manifest
    full = int(m["pack_bytes"])
    first = min(int(r[0]) for s in m["shards"] for c in s["configs"] for r in c["ranges"])

    def truncated(folder: Path) -> Any:
        pack = _copy_catalog(world, folder)
        pack.write_bytes(pack.read_bytes()[: full - 1000])
        return StaticOrigin(folder)

    def short(folder: Path) -> Any:
        pack = _copy_catalog(world, folder)
        pack.write_bytes(pack.read_bytes()[: first // 2])  # every range starts past the end
        return StaticOrigin(folder)

    def damaged(folder: Path) -> Any:
        pack = _copy_catalog(world, folder)
        (offset, _), = m["shards"][0]["configs"][0]["ranges"]  # every edit requests it
        _flip(pack, int(offset))
        return _server(folder)

    def whole(folder: Path) -> Any:
        _copy_catalog(world, folder)
        return StaticOrigin(folder, ignore_range=True)

    origins = {"truncated": truncated, "416": short, "pack_damaged": damaged,
               "range_ignored": whole}
    seen: dict[str, dict[str, Any]] = {}
    worst = 0.0
    for name, make in origins.items():
        for runtime in ("python", "native"):
            folder = work / f"{name}-{runtime}"
            with make(folder) as served:
                url = served.url if isinstance(served, StaticOrigin) else served[0]
                t0 = time.perf_counter()
                try:
                    exc, at = _edit_error(world, runtime, url)
                except CaseFailed as failed:
                    raise CaseFailed(f"{name}: {failed}") from None
                if not isinstance(served, StaticOrigin):
                    _alive(url, tally)
            worst = max(worst, at - t0)
            message = str(exc).replace(url, "ORIGIN")
            seen.setdefault(name, {})[runtime] = (type(exc).__name__, error_numbers(message),
                                                  message)
    differ = [f"{name}: python {got['python'][:2]} / native {got['native'][:2]} "
              f"({got['python'][2]!r} / {got['native'][2]!r})"
              for name, got in seen.items() if got["python"][:2] != got["native"][:2]]
    check(not differ, "the runtimes disagree: " + "; ".join(differ))
    return (f"{len(seen)} origins, the same error class and numbers in both runtimes "
            f"(slowest edit call to its error {worst:.2f} s): "
            + "; ".join(f"{name}: {got['native'][0]} {got['native'][1]}"
                        for name, got in seen.items())), worst


# a case returns its detail, or (detail, seconds to the error) where the case's own
# duration (a build, servers starting) is not the time the user waits for the error
CASES: dict[str, Callable[[Path, Tally], str | tuple[str, float]]] = {
    "repair_after_corruption": case_repair_after_corruption,
    "corrupt_pack_served": case_corrupt_pack_served,
    "metrics_cardinality": case_metrics_cardinality,
    "restart_mid_edit": case_restart_mid_edit,
    "truncated_pack_message": case_truncated_pack_message,
    "killed_build_cleanup": case_killed_build_cleanup,
    "healthz_bad_catalog": case_healthz_bad_catalog,
    "head_routes": case_head_routes,
    "slow_headers": case_slow_headers,
    "range_over_response_limit_verified": case_range_over_response_limit_verified,
    "healthz_truncated_pack": case_healthz_truncated_pack,
    "serve_refuses_bad_catalog": case_serve_refuses_bad_catalog,
    "reproducible_build": case_reproducible_build,
    "seed_out_of_range": case_seed_out_of_range,
    "bomb_image": case_bomb_image,
    "empty_prompt": case_empty_prompt,
    "damaged_pack_reported_not_unreachable": case_damaged_pack_reported_not_unreachable,
    "unreachable_origin_progress": case_unreachable_origin_progress,
    "native_truncated_total_checked": case_native_truncated_total_checked,
    "native_python_same_errors": case_native_python_same_errors,
}


def run_case(name: str, tally: Tally) -> dict[str, Any]:
    """One case in its own temporary folder: ``{"ok", "detail", "seconds"}`` (the case's
    duration), and ``seconds_to_error`` where the case measures it."""
    t0 = time.perf_counter()
    to_error = None
    with tempfile.TemporaryDirectory(prefix=f"sakura-faults-{name}-") as tmp:
        try:
            detail, ok = CASES[name](Path(tmp), tally), True
            if isinstance(detail, tuple):
                detail, to_error = detail
        except CaseFailed as exc:
            detail, ok = str(exc), False
        except Exception as exc:  # noqa: BLE001 - a case that breaks is a failed case
            detail, ok = f"{type(exc).__name__}: {exc}"[:500], False
    out = {"ok": ok, "detail": detail, "seconds": round(time.perf_counter() - t0, 2)}
    if to_error is not None:
        out["seconds_to_error"] = round(to_error, 3)
    return out


def run(names: list[str] | None = None) -> dict[str, Any]:
    import logging

    tally = Tally()
    t0 = time.perf_counter()
    load = [round(x, 2) for x in os.getloadavg()]
    server_log = logging.getLogger("sakura.cloud.server")
    level = server_log.level
    server_log.setLevel(logging.CRITICAL)  # the faults are injected: their errors are expected
    try:  # one shared work folder: the native cases' real catalog is built once per run
        with tempfile.TemporaryDirectory(prefix="sakura-faults-shared-") as shared, \
                shared_work(Path(shared)):
            cases = {name: run_case(name, tally) for name in (names or list(CASES))}
    finally:
        server_log.setLevel(level)
    return {
        "bench": "faults",
        "cases": cases,
        "ok": all(c["ok"] for c in cases.values()),
        "wrong_bytes_accepted": tally.wrong_bytes_accepted,
        "crashes": tally.crashes,
        "seconds": round(time.perf_counter() - t0, 1),
        "load_avg": {"start": load, "end": [round(x, 2) for x in os.getloadavg()]},
    }


def _main(args: argparse.Namespace) -> int:
    names = None
    if args.cases:
        names = [n.strip() for n in args.cases.split(",") if n.strip()]
        unknown = [n for n in names if n not in CASES]
        if unknown:
            raise UsageError(f"--cases: unknown {', '.join(unknown)}; known: "
                             f"{', '.join(CASES)}")
    result = run(names)
    write_json(args.json, result)
    failed = [n for n, c in result["cases"].items() if not c["ok"]]
    if failed or result["wrong_bytes_accepted"] or result["crashes"]:
        print(f"sakura bench faults: failed: {', '.join(failed) or 'totals'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run(sys.argv[1:] or None), indent=1))
