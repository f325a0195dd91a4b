"""The native-runtime cases of ``sakura bench faults``, on the real model:

- ``native_truncated_total_checked``: a truncated pack on a single-range static origin:
  the native runtime (``sakura edit``'s default) says "has N bytes, its manifest says M:
  the published pack is truncated or was replaced" within 3 s of its first pack request,
  not after refetches;
- ``native_python_same_errors``: four broken origins (truncated, 416, a damaged unit on
  ``sakura serve``, Range ignored) through ``EdgeRuntime.edit`` of both runtimes: the same
  error class and the same numbers in the messages.

The two cases run the product's edit path: the shipped catalog template
``face-technologist`` built by the provider's builder (``sakura build``: the shipped model's
template run, importance profiling, the sakura codec, an atomic publish), the shipped model
on the device (``load_engine(None)``, as ``sakura edit`` loads it), ``EdgeRuntime.edit``
with the default options. A real build takes ~25 s on an idle 2-core machine (minutes
under load), so one ``sakura bench faults`` run builds it once (under the run's shared work
folder) for both cases; a case run on its own (a test) builds it in its own folder unless
a shared one is set (:func:`shared_work`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sakura.edge.errors import EdgeError, OriginError
from sakura.faults_harness import CaseFailed, Tally, check, check_alive, flip_byte, serve_app

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
        flip_byte(pack, int(offset))
        return serve_app(folder)

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
                    check_alive(url, tally)
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
