"""``sakura bench serve``: concurrent loopback clients fetching shard configurations.

A configuration is one byte range of the pack (pack format 2), so every server gets the
same requests: ``GET /templates/<id>/sakura/<pack_file>`` with ``Range: bytes=a-b``. Three
servers run in child processes on the same synthetic pack, each on its own 127.0.0.1 port:

* ``sakura``: the FastAPI app (:func:`cloud.server.create_app`) under uvicorn, one worker,
  its pack ranges answered by the fast path in front of FastAPI
  (:class:`cloud.middleware.PackFastPath`), sending the verified ranges of one pinned pack
  reader by sendfile (``cloud/zerocopy.py``);
* ``reference``: a plain aiohttp static file server (``FileResponse``, sendfile);
* ``nginx``: the distribution's nginx with the repository's site locations
  (``cloud/origins.py``, one worker process), the static server operators deploy.

``--clients`` coroutines (default 32) each loop: pick a random (shard, config), fetch its
range, check the status, the length and (every 8th body) the sha256 of the body against the
manifest's units, until the duration (or a request cap) is reached. Reported per server:
config fetches per second, decimal GB/s of body bytes, p50/p90/p99 latency per fetch, and
errors (must be 0); the top-level keys are the ``sakura`` server's, ``reference_*`` and
``nginx_*`` the others'.

Ride-through (``--restart-at S``, :func:`run_ride_through`): only ``sakura serve``, and the
clients are the product's own client (``edge/client.py``'s ``PackClient``: unit checks,
retries with jittered backoff, resumes with ``If-Range``), handed in by the app layer
(``sakura/serve_ride.py``; ``cloud`` does not import ``edge``). ``S`` seconds into the load
the server gets SIGTERM (uvicorn's graceful stop, 2 s for requests in flight), its port is
bound again and a new process started on it, as a supervisor restarts it. Every body the
client returns is compared with the pack's bytes. Keys: ``errors_after_ride_through``
(fetches the client gave up on: must be 0), ``wrong_bytes`` (bytes returned that are not
the pack's: must be 0), ``p50_ms`` / ``p90_ms`` / ``p99_ms`` / ``max_ms`` per fetch,
retries included, ``restart`` (when, how long the port was down, the fetches in flight
across it), ``client_retries`` (the client's backoff waits).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from sakura.cloud import layout
from sakura.cloud.errors import CloudError
from sakura.cloud.origins import NginxOrigin
from sakura.cloud.storage import LocalStorage
from sakura.cloud.synthetic import SyntheticSpec, build_catalog

TEMPLATE = "bench-template"


@dataclass(frozen=True)
class BenchConfig:
    """What ``sakura bench serve`` runs."""

    clients: int = 32
    duration_s: float = 8.0
    warmup_s: float = 1.0
    shards: int = 32
    configs: int = 6
    unit_bytes: int = 32 * 1024
    max_requests: int = 200_000
    verify_every: int = 8
    seed: int = 0
    restart_at_s: float | None = None  # ride-through mode: restart the server this far in

    @classmethod
    def quick(cls, clients: int = 32) -> BenchConfig:
        return cls(
            clients=clients,
            duration_s=2.0,
            warmup_s=0.5,
            shards=12,
            configs=4,
            unit_bytes=16 * 1024,
        )


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(round(q / 100.0 * (len(ordered) - 1)))))
    return ordered[index]


@contextlib.contextmanager
def _child_server(kind: str, target: Path) -> Iterator[str]:
    """Start a server child process on a loopback port; yield its base URL."""
    if kind == "nginx":
        with NginxOrigin(target) as url:
            yield url
        return
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    fd = sock.fileno()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "sakura.cloud.bench", kind, str(target), str(fd)],
        pass_fds=(fd,),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    sock.close()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url + "/healthz")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float = 30.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
            raise CloudError(f"bench server exited early ({proc.returncode}): {err}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise CloudError(f"bench server at {url} did not become ready in {timeout_s:.0f}s")


@dataclass
class _Load:
    latencies: list[float]
    bytes: int = 0
    requests: int = 0
    http_requests: int = 0
    errors: int = 0
    first_error: str = ""


async def _run_load(
    url: str,
    jobs: list[tuple[int, int, int, int, str]],
    config: BenchConfig,
    *,
    pack_path: str,
) -> tuple[_Load, float]:
    import aiohttp

    load = _Load(latencies=[])
    rng = random.Random(config.seed)
    connector = aiohttp.TCPConnector(
        limit=config.clients, limit_per_host=config.clients, force_close=False
    )
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False
    ) as session:

        async def fetch(job: tuple[int, int, int, int, str], verify: bool) -> int:
            _shard, _cfg, offset, length, sha = job
            headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
            async with session.get(f"{url}/{pack_path}", headers=headers) as resp:
                body = await resp.read()
                if resp.status != 206 or len(body) != length:
                    raise ValueError(f"status {resp.status}, {len(body)} of {length} bytes")
                if verify and hashlib.sha256(body).hexdigest() != sha:
                    raise ValueError("checksum mismatch")
            return 1

        async def worker(deadline: float, record: bool) -> None:
            while time.perf_counter() < deadline and load.requests < config.max_requests:
                job = jobs[rng.randrange(len(jobs))]
                start = time.perf_counter()
                try:
                    verify = record and load.requests % config.verify_every == 0
                    http = await fetch(job, verify)
                except Exception as exc:  # noqa: BLE001 - every failure is an error of the run
                    if record:
                        load.errors += 1
                        load.first_error = load.first_error or f"{type(exc).__name__}: {exc}"
                    continue
                if record:
                    load.latencies.append(time.perf_counter() - start)
                    load.requests += 1
                    load.http_requests += http
                    load.bytes += job[3]

        warm_end = time.perf_counter() + config.warmup_s
        await asyncio.gather(*(worker(warm_end, False) for _ in range(config.clients)))
        began = time.perf_counter()
        end = began + config.duration_s
        await asyncio.gather(*(worker(end, True) for _ in range(config.clients)))
        elapsed = time.perf_counter() - began
    return load, elapsed


def _summary(load: _Load, elapsed: float) -> dict[str, Any]:
    ms = [x * 1000.0 for x in load.latencies]
    return {
        "requests": load.requests,
        "http_requests": load.http_requests,
        "seconds": round(elapsed, 3),
        "requests_per_s": round(load.requests / elapsed, 1) if elapsed else 0.0,
        "gbytes_per_s": round(load.bytes / elapsed / 1e9, 4) if elapsed else 0.0,
        "p50_ms": round(_percentile(ms, 50), 2),
        "p90_ms": round(_percentile(ms, 90), 2),
        "p99_ms": round(_percentile(ms, 99), 2),
        "errors": load.errors,
        "first_error": load.first_error,
        "bytes": load.bytes,
    }


def _bench_catalog(config: BenchConfig, root: Path) -> tuple[Path, Any, dict[str, Any], Any, bytes]:
    """The bench's synthetic catalog under ``root``: (catalog dir, the published entry, its
    manifest, the pack's key, the pack's bytes); shared by the plain and ride-through runs."""
    catalog_dir = root / "catalog"
    spec = SyntheticSpec(config.shards, config.configs, config.unit_bytes, config.seed)
    published = build_catalog(catalog_dir, [TEMPLATE], spec=spec, work_dir=root / "work")[TEMPLATE]
    manifest = json.loads((catalog_dir / published.versioned_manifest_key).read_text())
    pack_rel = layout.pack_key(TEMPLATE, "sakura", published.pack_file)
    return catalog_dir, published, manifest, pack_rel, (catalog_dir / pack_rel).read_bytes()


def run_bench(
    config: BenchConfig, work_dir: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """Run the serve bench and return the JSON-ready result."""
    with contextlib.ExitStack() as stack:
        root = (
            Path(work_dir)
            if work_dir
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sakura-bench-")))
        )
        catalog_dir, published, manifest, pack_rel, pack = _bench_catalog(config, root)
        jobs = []
        for shard in manifest["shards"]:
            for cfg in shard["configs"]:
                (offset, length), = cfg["ranges"]
                body_sha = hashlib.sha256(pack[offset : offset + length]).hexdigest()
                jobs.append((shard["index"], cfg["id"], offset, length, body_sha))
        results: dict[str, Any] = {}
        load_avg: dict[str, list[float]] = {}
        for kind in ("sakura", "reference", "nginx"):
            load_avg[kind] = [round(x, 2) for x in os.getloadavg()]
            with _child_server(kind, catalog_dir) as url:
                load, elapsed = asyncio.run(
                    _run_load(url, jobs, config, pack_path=pack_rel)
                )
            results[kind] = _summary(load, elapsed)
    ours, ref, nginx = results["sakura"], results["reference"], results["nginx"]
    mean_bytes = sum(j[3] for j in jobs) / len(jobs)
    return {
        "bench": "serve",
        "clients": config.clients,
        "duration_s": config.duration_s,
        "requests": ours["requests"],
        "requests_per_s": ours["requests_per_s"],
        "gbytes_per_s": ours["gbytes_per_s"],
        "p50_ms": ours["p50_ms"],
        "p90_ms": ours["p90_ms"],
        "p99_ms": ours["p99_ms"],
        "errors": ours["errors"] + ref["errors"] + nginx["errors"],
        "first_error": ours["first_error"] or ref["first_error"] or nginx["first_error"],
        "reference_requests_per_s": ref["requests_per_s"],
        "reference_http_requests_per_s": round(ref["http_requests"] / ref["seconds"], 1)
        if ref["seconds"]
        else 0.0,
        "reference_gbytes_per_s": ref["gbytes_per_s"],
        "reference_p99_ms": ref["p99_ms"],
        "reference_errors": ref["errors"],
        "ratio_gbytes_vs_reference": round(ours["gbytes_per_s"] / ref["gbytes_per_s"], 3)
        if ref["gbytes_per_s"]
        else None,
        "nginx_requests_per_s": nginx["requests_per_s"],
        "nginx_gbytes_per_s": nginx["gbytes_per_s"],
        "nginx_p99_ms": nginx["p99_ms"],
        "nginx_errors": nginx["errors"],
        "ratio_gbytes_vs_nginx": round(ours["gbytes_per_s"] / nginx["gbytes_per_s"], 3)
        if nginx["gbytes_per_s"]
        else None,
        "load_avg_at_start": load_avg,
        "pack_bytes": published.pack_bytes,
        "configurations": len(jobs),
        "mean_config_bytes": round(mean_bytes),
        "server": "sakura: FastAPI app under uvicorn (h11, asyncio loop), 1 worker process, "
        "pack ranges answered by the ASGI fast path in front of FastAPI (cloud/middleware.py "
        "PackFastPath), verified ranges sent by sendfile from one pinned reader (ASGI "
        "zero-copy send, cloud/zerocopy.py)",
        "reference_server": "aiohttp FileResponse (sendfile), 1 process",
        "nginx_server": "nginx (distribution package) with cloud/deploy/nginx/sakura-packs.locations, "
        "1 worker process, sendfile",
        "request": "one single-range GET of the pack per configuration (pack format 2)",
        "units": {
            "gbytes_per_s": "1e9 body bytes per second",
            "requests_per_s": "config fetches per second",
        },
        "config": asdict(config),
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "detail": results,
    }


# ------------------------------------------------------------------------ ride-through


class RideClient(Protocol):
    """One device's client of ``sakura serve`` (the product's, retrying as it does)."""

    retries: int  # backoff waits so far

    async def __aenter__(self) -> RideClient: ...

    async def __aexit__(self, *exc: object) -> None: ...

    async def fetch(self, shard: int, config: int) -> bytes:
        """The verified bytes of one configuration (raises when the client gives up)."""
        ...


RideClientFactory = Callable[[str, str, str], RideClient]  # (base URL, template, codec)


class _RestartableServer:
    """``sakura serve``'s app in a child process on one loopback port, restartable."""

    def __init__(self, catalog_dir: Path) -> None:
        self.catalog_dir = catalog_dir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(2048)
        self.port = sock.getsockname()[1]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        root = Path(__file__).resolve().parent.parent
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sakura.cloud.bench", "sakura", str(self.catalog_dir),
             str(sock.fileno())],
            pass_fds=(sock.fileno(),), env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        sock.close()  # the child holds the only listening socket: a stop refuses connects
        _wait_ready(self.proc, self.url + "/healthz")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:  # pragma: no cover
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()

    def restart(self) -> float:
        """SIGTERM, wait for the exit, start again on the same port; the seconds it took."""
        began = time.perf_counter()
        self.stop()
        self.start()
        return time.perf_counter() - began


async def _ride_load(
    server: _RestartableServer,
    jobs: list[tuple[int, int, int, int, str]],
    pack: bytes,
    config: BenchConfig,
    make_client: RideClientFactory,
) -> dict[str, Any]:
    rng = random.Random(config.seed)
    latencies: list[float] = []
    spans: list[tuple[float, float]] = []  # (start, end) of each completed fetch
    tally = {"requests": 0, "bytes": 0, "errors": 0, "wrong_bytes": 0, "wrong_bodies": 0}
    first_error = ""
    restart: dict[str, Any] = {}
    clients = [make_client(server.url, TEMPLATE, "sakura") for _ in range(config.clients)]
    began = time.perf_counter()
    deadline = began + config.duration_s

    async def device(client: RideClient) -> None:
        nonlocal first_error
        async with client:
            while time.perf_counter() < deadline and tally["requests"] < config.max_requests:
                _shard, cfg, offset, length, _sha = jobs[rng.randrange(len(jobs))]
                start = time.perf_counter()
                try:
                    body = await client.fetch(_shard, cfg)
                except Exception as exc:  # noqa: BLE001 - the client gave up: an error
                    tally["errors"] += 1
                    first_error = first_error or f"{type(exc).__name__}: {exc}"[:500]
                    continue
                end = time.perf_counter()
                latencies.append(end - start)
                spans.append((start, end))
                tally["requests"] += 1
                tally["bytes"] += len(body)
                if body != pack[offset : offset + length]:
                    tally["wrong_bodies"] += 1
                    tally["wrong_bytes"] += max(len(body), length)

    async def restarter() -> None:
        assert config.restart_at_s is not None
        await asyncio.sleep(max(0.0, began + config.restart_at_s - time.perf_counter()))
        restart["at_s"] = round(time.perf_counter() - began, 3)
        down = await asyncio.to_thread(server.restart)
        restart["down_s"] = round(down, 3)

    await asyncio.gather(restarter(), *(device(c) for c in clients))
    elapsed = time.perf_counter() - began
    ms = [x * 1000.0 for x in latencies]
    if "at_s" in restart:
        lo = began + restart["at_s"]
        hi = lo + restart["down_s"]
        restart["fetches_across"] = sum(1 for a, b in spans if a < hi and b > lo)
    return {
        "requests": tally["requests"],
        "seconds": round(elapsed, 3),
        "requests_per_s": round(tally["requests"] / elapsed, 1) if elapsed else 0.0,
        "gbytes_per_s": round(tally["bytes"] / elapsed / 1e9, 4) if elapsed else 0.0,
        "p50_ms": round(_percentile(ms, 50), 2),
        "p90_ms": round(_percentile(ms, 90), 2),
        "p99_ms": round(_percentile(ms, 99), 2),
        "max_ms": round(max(ms), 2) if ms else 0.0,
        "errors_after_ride_through": tally["errors"],
        "first_error": first_error,
        "wrong_bytes": tally["wrong_bytes"],
        "wrong_bodies": tally["wrong_bodies"],
        "client_retries": sum(c.retries for c in clients),
        "restart": restart,
        "bytes": tally["bytes"],
    }


def run_ride_through(
    config: BenchConfig,
    make_client: RideClientFactory,
    work_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """``sakura bench serve --restart-at S``: the product's clients against one ``sakura
    serve`` restarted once (see the module docstring); the JSON-ready result."""
    if config.restart_at_s is None or not 0 < config.restart_at_s < config.duration_s:
        raise ValueError("restart_at_s must lie inside the duration")
    with contextlib.ExitStack() as stack:
        root = (
            Path(work_dir)
            if work_dir
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sakura-ride-")))
        )
        catalog_dir, published, manifest, _rel, pack = _bench_catalog(config, root)
        jobs = [(shard["index"], cfg["id"], *cfg["ranges"][0], "")
                for shard in manifest["shards"] for cfg in shard["configs"]]
        server = _RestartableServer(catalog_dir)
        load_start = [round(x, 2) for x in os.getloadavg()]
        server.start()
        stack.callback(server.stop)
        result = asyncio.run(_ride_load(server, jobs, pack, config, make_client))
        load_end = [round(x, 2) for x in os.getloadavg()]
    return {
        "bench": "serve-ride-through",
        "clients": config.clients,
        "duration_s": config.duration_s,
        "restart_at_s": config.restart_at_s,
        **{k: v for k, v in result.items() if k != "bytes"},
        "load_avg_at_start": load_start,
        "load_avg_at_end": load_end,
        "pack_bytes": published.pack_bytes,
        "configurations": len(jobs),
        "server": "sakura serve's app under uvicorn, 1 worker process, SIGTERM then a new "
        "process on the same port at restart_at_s",
        "client": "the product's client (edge/client.py PackClient), one per simulated device, "
        "each fetching one configuration after another; every unit verified by the client, "
        "every body compared with the pack here",
        "units": {"p99_ms": "per fetch, retries and resumes included"},
        "config": asdict(config),
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "detail": {"bytes": result["bytes"]},
    }


# ------------------------------------------------------------------------ child servers


def _serve_sakura(catalog_dir: str, fd: int) -> None:
    from sakura.cloud.runner import run  # lazy: web stack
    from sakura.cloud.server import create_app  # lazy: web stack

    run(create_app(LocalStorage(catalog_dir)), fd=fd, log_level="warning", access_log=False)


def _serve_static(root: str, fd: int) -> None:
    from aiohttp import web

    base = Path(root).resolve()

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def static(request: web.Request) -> web.StreamResponse:
        path = (base / request.match_info["path"]).resolve()
        if not path.is_relative_to(base) or not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/{path:.+}", static)
    web.run_app(
        app, sock=socket.socket(fileno=fd), print=None, access_log=None, handle_signals=True
    )


if __name__ == "__main__":  # child process entry: python -m cloud.bench KIND ROOT FD
    _kind, _root, _fd = sys.argv[1], sys.argv[2], int(sys.argv[3])
    (_serve_sakura if _kind == "sakura" else _serve_static)(_root, _fd)
