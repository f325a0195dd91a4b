"""The serving cases of ``sakura bench faults``: the real server and the real edge client
on loopback, one injected fault each, and the promise ``cloud/README.md`` makes:

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
- ``damaged_pack_reported_not_unreachable``: a flipped byte in a pack on ``sakura serve``:
  the client reports the server's own reason (``pack_damaged``) at once, not "cannot reach
  the server" after its retry window;
- ``unreachable_origin_progress``: nothing listens at the origin: the client says what it
  waits for at its first retry, then gives up naming the cause.

Each case builds its own small synthetic catalog (``sakura.faults_harness``); ``sakura
serve`` runs in a child process where it must be killed.
"""

from __future__ import annotations

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
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sakura.cloud.origins import free_port
from sakura.edge.errors import EdgeError, OriginError, ServerUnreachable
from sakura.faults_harness import (
    TEMPLATE,
    CaseFailed,
    Tally,
    check,
    check_alive,
    client_fetch,
    flip_byte,
    http_get,
    published_body,
    read_manifest,
    serve_app,
    synthetic_catalog,
)


def case_repair_after_corruption(work: Path, tally: Tally) -> str:
    root = work / "catalog"
    pub = synthetic_catalog(root)
    m = read_manifest(root, pub)
    pack = root / pub.pack_key
    (offset, length), = m["shards"][1]["configs"][0]["ranges"]
    original = flip_byte(pack, offset + 7)
    with serve_app(root) as (url, _app):
        shard_url = f"{url}/v1/templates/{TEMPLATE}/sakura/shards/1/0"
        pack_url = f"{url}/templates/{TEMPLATE}/sakura/{pub.pack_file}"
        rng = {"Range": f"bytes={offset}-{offset + length - 1}"}
        for _ in range(2):  # two fetches while damaged (and the caches that had)
            status, _, body = http_get(shard_url)
            check(status == 500 and b"damaged" in body, f"damaged shard answered {status}")
            status, _, body = http_get(pack_url, rng)
            check(status == 500 and b"damaged" in body, f"damaged range answered {status}")
        status, _, body = http_get(url + "/healthz")
        health = json.loads(body)
        check(health["status"] == "degraded" and health["damaged"][0]["pack"] == pub.pack_key,
              f"/healthz did not report the damaged pack: {health}")
        # repair as an operator would: copy to a temp name, rename over it
        tmp = pack.with_name(".repair.tmp")
        tmp.write_bytes(original)
        os.replace(tmp, pack)
        want = published_body(root, pub, m, 1, 0)
        status, headers, body = http_get(shard_url)
        check(status == 200 and body == want, f"repaired shard answered {status}")
        check(headers.get("X-Sakura-Sha256") == hashlib.sha256(want).hexdigest(),
              "the checksum header is not the repaired body's")
        status, _, body = http_get(pack_url, rng)
        check(status == 206 and body == want, f"repaired range answered {status}")
        got = client_fetch(url, None, 1, 0)
        tally.wrong_bytes_accepted += got != want
        check(got == want, "the client got other bytes after the repair")
        health = json.loads(http_get(url + "/healthz")[2])
        check(health == {"status": "ok", "damaged": []}, f"/healthz after repair: {health}")
        check_alive(url, tally)
    return "refused while damaged (500, /healthz degraded), served again after the mv"


def case_corrupt_pack_served(work: Path, tally: Tally) -> str:
    root = work / "catalog"
    pub = synthetic_catalog(root)
    m = read_manifest(root, pub)
    pack = root / pub.pack_key
    (offset, _length), = m["shards"][2]["configs"][-1]["ranges"]
    unit = m["shards"][2]["configs"][-1]["units"][-1]
    flip_at = m["units"][unit][0] + 3  # in the last unit of shard 2's largest config
    original = flip_byte(pack, flip_at)
    refused = served = 0
    with serve_app(root) as (url, _app):
        for shard in m["shards"]:
            for cfg in shard["configs"]:
                (o, n), = cfg["ranges"]
                damaged = o <= flip_at < o + n
                for target, headers in (
                        (f"{url}/v1/templates/{TEMPLATE}/sakura/shards/{shard['index']}/"
                         f"{cfg['id']}", {}),
                        (f"{url}/templates/{TEMPLATE}/sakura/{pub.pack_file}",
                         {"Range": f"bytes={o}-{o + n - 1}"})):
                    status, _, body = http_get(target, headers)
                    if damaged:
                        check(status == 500, f"a damaged range answered {status}")
                        refused += 1
                    else:
                        check(status in (200, 206) and body == original[o : o + n],
                              f"an undamaged configuration answered {status}")
                        served += 1
        status, _, _ = http_get(f"{url}/templates/{TEMPLATE}/sakura/{pub.pack_file}")
        check(status == 500, f"the whole damaged pack answered {status}")
        cfg = m["shards"][2]["configs"][-1]
        for manifest in (None, m):  # with and without a manifest in hand
            try:
                got = client_fetch(url, manifest, 2, cfg["id"])
            except EdgeError:
                continue
            tally.wrong_bytes_accepted += got != original[offset : offset + len(got)]
            raise CaseFailed("the client returned a body of a damaged pack")
        check_alive(url, tally)
    return f"{refused} damaged requests refused (500), {served} undamaged served"


def case_metrics_cardinality(work: Path, tally: Tally) -> str:
    root = work / "catalog"
    synthetic_catalog(root)
    rng = random.Random(0)
    with serve_app(root) as (url, _app):
        host, port = url.removeprefix("http://").split(":")
        http_get(url + "/healthz")
        before = len(http_get(url + "/metrics")[2])
        statuses: set[int] = set()
        for i in range(400):
            method = "".join(rng.choice(string.ascii_uppercase) for _ in range(8000))
            statuses.add(_raw_status(host, int(port), f"{method} /v1/templates HTTP/1.1\r\n"
                                     f"Host: x\r\n\r\n".encode()))
            path = f"/nope/{i}/" + "x" * 200
            statuses.add(http_get(url + path)[0])
        huge = "M" * 60_000
        status = _raw_status(host, int(port), f"{huge} / HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        check(status in (0, 400, 413, 414, 431, 501), f"a 60,000-character method: {status}")
        check(200 not in statuses, f"hostile requests answered {sorted(statuses)}")
        after = len(http_get(url + "/metrics")[2])
        check(after - before < 4000, f"/metrics grew from {before} to {after} bytes")
        check_alive(url, tally)
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
    pub = synthetic_catalog(root, shards=2, configs=2, unit_bytes=1 << 20)  # a 6 MB configuration
    m = read_manifest(root, pub)
    cfg = m["shards"][1]["configs"][-1]
    want = published_body(root, pub, m, 1, cfg["id"])
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
    pub = synthetic_catalog(root)
    m = read_manifest(root, pub)
    pack = root / pub.pack_key
    pack.write_bytes(pack.read_bytes()[:-100])
    with serve_app(root) as (url, _app):
        try:
            client_fetch(url, m, 0, 0)
        except OriginError as exc:
            message = str(exc)
        else:
            raise CaseFailed("a truncated pack was served")
        check(url in message, f"the error does not name {url}: {message}")
        check("truncated or corrupt" in message and "HTTP 500" in message,
              f"the server's message is missing: {message}")
        check("reach" not in message, f"reported as unreachable: {message}")
        check_alive(url, tally)
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
    synthetic_catalog(root)
    catalog = root / "catalog.json"
    good = catalog.read_bytes()
    with serve_app(root) as (url, _app):
        check(http_get(url + "/healthz")[0] == 200, "healthy catalog not ok")
        catalog.write_bytes(b"{ not json")
        status, _, body = http_get(url + "/healthz")
        check(status == 503 and b"invalid" in body, f"/healthz with a broken catalog: {status}")
        status, _, _ = http_get(f"{url}/v1/templates")
        check(status >= 500, f"/v1 with a broken catalog: {status}")
        catalog.write_bytes(good)
        check(http_get(url + "/healthz")[0] == 200, "/healthz did not recover")
        check_alive(url, tally)
    return f"/healthz 503 while catalog.json is broken: {json.loads(body)['error'][:80]}"


def case_head_routes(work: Path, tally: Tally) -> str:
    root = work / "catalog"
    pub = synthetic_catalog(root)
    paths = ["/healthz", "/metrics", "/catalog.json", "/v1/templates", f"/v1/templates/{TEMPLATE}",
             f"/v1/templates/{TEMPLATE}/sakura/manifest",
             f"/templates/{TEMPLATE}/sakura/manifest.json",
             f"/templates/{TEMPLATE}/sakura/{pub.pack_file}",
             f"/v1/templates/{TEMPLATE}/sakura/pack", f"/v1/templates/{TEMPLATE}/sakura/shards/0/0"]
    with serve_app(root) as (url, _app):
        for path in paths:
            status, headers, body = http_get(url + path, method="HEAD")
            check(status == 200 and body == b"", f"HEAD {path}: {status}")
        manifest = f"{url}/templates/{TEMPLATE}/sakura/manifest.json"
        plain = http_get(manifest, {"Accept-Encoding": "identity"})[1]
        zipped = http_get(manifest, {"Accept-Encoding": "gzip"})[1]
        check(plain["ETag"] != zipped["ETag"], "gzip and identity share one ETag")
        check(zipped.get("Content-Encoding") == "gzip", "gzip not served when asked")
        refused = http_get(manifest, {"Accept-Encoding": "*;q=0.5, gzip;q=0"})[1]
        check("Content-Encoding" not in refused, "gzip;q=0 still got gzip")
        check_alive(url, tally)
    return f"HEAD 200 on {len(paths)} routes; ETags {plain['ETag'][-8:]} / {zipped['ETag'][-8:]}"


def case_slow_headers(work: Path, tally: Tally) -> str:
    root = work / "catalog"
    synthetic_catalog(root)
    timeout = 1.0
    with serve_app(root, header_timeout_s=timeout) as (url, _app):
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
        check(http_get(url + "/healthz")[0] == 200, "the server stopped answering")
        check_alive(url, tally)
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
    pub = synthetic_catalog(root)
    m = read_manifest(root, pub)
    pack = root / pub.pack_key
    last_off, last_len = m["units"][-1][0], m["units"][-1][1]
    original = flip_byte(pack, last_off + 1)  # the last unit is damaged, the first ones are not
    damaged = pack.read_bytes()[last_off : last_off + last_len]
    (offset, length), = m["shards"][0]["configs"][0]["ranges"]
    check(offset + length <= last_off, "test setup: the range reaches the damaged unit")
    spec = f"{offset}-{offset + length - 1}"
    with serve_app(root) as (url, _app):
        pack_url = f"{url}/templates/{TEMPLATE}/sakura/{pub.pack_file}"
        t0 = time.perf_counter()
        status, _, body = http_get(pack_url, {"Range": "bytes=" + ",".join([spec] * 101)})
        seconds = time.perf_counter() - t0
        message = json.loads(body).get("error", "") if status == 400 else ""
        for count in (65, 101, 150):
            status, _, body = http_get(pack_url, {"Range": "bytes=" + ",".join([spec] * count)})
            check(damaged not in body, f"{count} ranges: the damaged unit was sent ({status})")
            check(status == 400 and _error_code(body) == "bad_range",
                  f"{count} ranges answered {status} {body[:120]!r}")
        status, headers, body = http_get(pack_url, {"Range": "bytes=" + ",".join([spec] * 64)})
        check(status == 206 and body == original[offset : offset + length]
              and headers.get("Content-Range") == f"bytes {spec}/{len(original)}",
              f"64 overlapping ranges answered {status} ({len(body)} bytes)")
        status, _, body = http_get(pack_url, {"Range": "bytes=5-3"})  # ignored: the whole pack
        check(status == 500 and _error_code(body) == "pack_damaged",
              f"bytes=5-3 on a damaged pack answered {status} {body[:120]!r}")
        check_alive(url, tally)
    return f"{message} ({seconds:.3f} s, HTTP 400 bad_range; 64 ranges: one 206)"


def case_healthz_truncated_pack(work: Path, tally: Tally) -> str:
    root = work / "catalog"
    pub = synthetic_catalog(root)
    pack = root / pub.pack_key
    good = pack.read_bytes()
    with serve_app(root) as (url, _app):
        health = json.loads(http_get(url + "/healthz")[2])
        check(health == {"status": "ok", "damaged": []}, f"/healthz before: {health}")
        pack.write_bytes(good[:-100])
        t0 = time.perf_counter()
        status, _, body = http_get(url + "/healthz")
        seconds = time.perf_counter() - t0
        health = json.loads(body)
        check(status == 200 and health["status"] == "degraded",
              f"/healthz with a truncated pack: {status} {health}")
        entries = [(d["pack"], d.get("code")) for d in health["damaged"]]
        check(entries == [(pub.pack_key, "pack_damaged")], f"/healthz lists {entries}")
        message = health["damaged"][0]["error"]
        check(f"has {len(good) - 100} bytes" in message, f"no sizes in {message!r}")
        status, _, body = http_get(f"{url}/v1/templates/{TEMPLATE}/sakura/shards/0/0")
        check(status == 500 and _error_code(body) == "pack_damaged",
              f"a shard of the truncated pack answered {status} {body[:120]!r}")
        pack.write_bytes(good)
        health = json.loads(http_get(url + "/healthz")[2])
        check(health == {"status": "ok", "damaged": []}, f"/healthz after the repair: {health}")
        check_alive(url, tally)
    return f"{message} ({seconds:.3f} s, /healthz degraded)"


def case_serve_refuses_bad_catalog(work: Path, tally: Tally) -> str:
    root = work / "catalog"
    synthetic_catalog(root)
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
            http_get(f"http://127.0.0.1:{port}/healthz")
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


def case_damaged_pack_reported_not_unreachable(work: Path, tally: Tally) -> str:
    """A flipped byte in a pack on `sakura serve`: the client (its default 30 s retry
    window) reports the server's own reason (code pack_damaged) at once, not 'cannot
    reach the server' after the window."""
    from sakura.edge.client import RetryPolicy  # lazy: aiohttp

    root = work / "catalog"
    pub = synthetic_catalog(root)
    m = read_manifest(root, pub)
    cfg = m["shards"][1]["configs"][0]
    (offset, _), = cfg["ranges"]
    flip_byte(root / pub.pack_key, offset + 1)
    with serve_app(root) as (url, _app):
        t0 = time.perf_counter()
        try:
            client_fetch(url, m, 1, cfg["id"], retry=RetryPolicy())
        except ServerUnreachable as exc:
            raise CaseFailed(f"reported as unreachable: {exc}") from None
        except OriginError as exc:
            seconds = time.perf_counter() - t0
            check("pack_damaged" in str(exc) and "damaged" in str(exc),
                  f"the error does not name the damage: {exc}")
            check(seconds <= 3.0, f"the damage was reported after {seconds:.1f} s")
            check_alive(url, tally)
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
