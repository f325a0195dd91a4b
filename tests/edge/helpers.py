"""Test infrastructure for the edge runtime: real packs of a tiny model, a real server.

``build_world`` runs the tiny seeded model's template run, profiles token importance,
writes one pack per codec with ``codec.pack.write_pack`` and publishes them into a catalog
directory with ``cloud.publish``. ``Server`` runs the real FastAPI app under uvicorn on a
fixed 127.0.0.1 port in a thread and can be stopped and started again (a server restart
mid-edit). ``RecordingApp`` wraps an ASGI app and records every request it receives.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import uvicorn
from sakura.cloud.publish import CatalogTransaction
from sakura.cloud.server import create_app
from sakura.cloud.storage import LocalStorage
from sakura.codec.base import get_codec
from sakura.codec.pack import write_pack
from sakura.dit.editing import Template, profile_importance, template_run
from sakura.dit.model import MMDiT
from sakura.edge.runtime import EdgeRuntime

from tests.dit.common import (
    text_width_model,
    tiny_template,  # noqa: F401 (re-exported for the edge tests)
)
from tests.dit.common import tiny_model as _tiny_model

CODECS = ("sakura", "fp16", "intq", "svd", "cachegen")
TEMPLATE_ID = "tiny-face"


def tiny_model(seed: int = 0, double_blocks: int = 2, single_blocks: int = 2) -> MMDiT:
    return _tiny_model(seed=seed, double_blocks=double_blocks, single_blocks=single_blocks)


class FakeEncoder:
    """Deterministic prompt embeddings for the tiny model (text_dim 32): a seeded hash."""

    def __init__(self, tokens: int = 5, dim: int = 32) -> None:
        self.tokens, self.dim = tokens, dim

    def encode(self, prompts: list[str]) -> torch.Tensor:
        out = []
        for p in prompts:
            seed = int.from_bytes(p.encode()[:8].ljust(8, b"\0"), "little") % (2**31)
            g = torch.Generator().manual_seed(seed + len(p))
            out.append(torch.randn(self.tokens, self.dim, generator=g))
        return torch.stack(out)


@dataclass
class World:
    model: MMDiT
    template: Template
    cache: Any
    catalog_dir: Path
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)

    def runtime(self) -> EdgeRuntime:
        return EdgeRuntime(self.model, encoder=FakeEncoder())


def build_world(root: Path, codecs: tuple[str, ...] = CODECS, steps: int = 4,
                blocks_per_shard: int = 2, model: MMDiT | None = None) -> World:
    model = model or tiny_model()
    template = tiny_template(model, steps=steps)
    run = template_run(model, template)
    enc = FakeEncoder()
    reqs = [EdgeRuntime(model, encoder=enc).request(p, seed=i)
            for i, p in enumerate(["a profiling prompt", "another one"])]
    profile_importance(model, template, run, reqs)
    out = root / "catalog"
    manifests = {}
    with CatalogTransaction(out) as txn:
        for name in codecs:
            work = root / "work" / name
            m = write_pack(work, TEMPLATE_ID, run.cache, get_codec(name),
                           blocks_per_shard=blocks_per_shard, model={"name": "tiny"})
            txn.publish(TEMPLATE_ID, name, m.to_dict(), work / m.pack_file,
                        {"workload": "face-swap"})
            manifests[name] = m.to_dict()
    return World(model, template, run.cache, out, manifests)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """uvicorn serving ``app`` on 127.0.0.1:``port`` in a thread; stop() and start() again."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.app = app
        self.port = port or free_port()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on accepted sockets of a TCP-proto
        # listener; without it every small body waits ~40 ms (Nagle + delayed ACK).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        config = uvicorn.Config(self.app, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=1)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        self._server, self._thread, self._sock = server, thread, sock
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        self._server.force_exit = True
        assert self._thread is not None
        self._thread.join(10)
        self._sock.close()
        self._server = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_catalog(catalog_dir: Path, port: int | None = None, wrap: Any = None) -> Server:
    app = create_app(LocalStorage(catalog_dir))
    return Server(wrap(app) if wrap else app, port)


class RecordingApp:
    """ASGI wrapper recording (method, path, query, headers, body) of every request."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.requests: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        entry = {"method": scope["method"], "path": scope["path"],
                 "query": scope.get("query_string", b"").decode("latin-1"),
                 "headers": {k.decode("latin-1"): v.decode("latin-1")
                             for k, v in scope["headers"]},
                 "body": b""}
        self.requests.append(entry)

        async def recv() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                entry["body"] += message.get("body", b"")
            return message

        await self.app(scope, recv, send)


class FaultyApp:
    """ASGI wrapper injecting faults into shard responses whose path ends with ``suffix``
    (and, with ``range_header``, whose Range header is exactly that: one configuration of a
    pack).

    ``mode``: ``corrupt`` flips one body byte (the ``X-Sakura-Sha256`` header stays right);
    ``cut`` sends half the body and then drops the connection; ``rehash`` corrupts the body
    and rewrites the sha256 header to match (a corrupted pack on the server); ``stall``
    sends the first ``keep`` share of the body and then nothing for ``stall_s`` before it
    drops the connection (``keep=0``: headers, then silence); ``flip-at`` flips the byte at
    the ``keep`` share of the body (damage inside a prefix). ``times`` responses are
    affected.
    """

    def __init__(self, app: Any, suffix: str, mode: str, times: int = 1,
                 range_header: str | None = None, keep: float = 0.5,
                 stall_s: float = 30.0) -> None:
        self.app, self.suffix, self.mode, self.remaining = app, suffix, mode, times
        self.range_header = range_header  # only requests with exactly this Range header
        self.keep, self.stall_s = keep, stall_s
        self.hits = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or self.remaining <= 0
                or scope["method"] != "GET"  # (not the native runtime's warm-up HEADs)
                or not scope["path"].endswith(self.suffix)
                or (self.range_header is not None and dict(scope["headers"]).get(b"range")
                    != self.range_header.encode())):
            await self.app(scope, receive, send)
            return
        self.remaining -= 1
        self.hits += 1
        if self.mode == "rehash":
            await self._rehash(scope, receive, send)
            return
        state = {"sent": 0, "length": 0, "flipped": False}

        async def faulty_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = dict(message["headers"])
                state["length"] = int(headers.get(b"content-length", b"0"))
                await send(message)
                return
            body = message.get("body", b"")
            if self.mode == "corrupt" and body and not state["flipped"]:
                body = bytes([body[0] ^ 0xFF]) + body[1:]
                state["flipped"] = True
                message = {**message, "body": body}
            if self.mode == "flip-at" and body and not state["flipped"]:
                at = int(state["length"] * self.keep) - state["sent"]
                if 0 <= at < len(body):
                    body = body[:at] + bytes([body[at] ^ 0xFF]) + body[at + 1:]
                    state["flipped"] = True
                    message = {**message, "body": body}
            if self.mode in ("cut", "stall") and body:
                half = int(state["length"] * (0.5 if self.mode == "cut" else self.keep))
                if state["sent"] + len(body) > half:
                    await send({**message, "body": body[: half - state["sent"]],
                                "more_body": True})
                    if self.mode == "stall":
                        await asyncio.sleep(self.stall_s)
                    raise ConnectionResetError("fault injection: connection dropped")
            state["sent"] += len(body)
            await send(message)

        await self.app(scope, receive, faulty_send)

    async def _rehash(self, scope: Any, receive: Any, send: Any) -> None:
        import hashlib

        held: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def hold(message: Any) -> None:
            if message["type"] == "http.response.start":
                held["start"] = message
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = b"".join(chunks)
            if body:
                body = bytes([body[0] ^ 0xFF]) + body[1:]
            headers = [(k, v) for k, v in held["start"]["headers"]
                       if k.lower() != b"x-sakura-sha256"]
            headers.append((b"x-sakura-sha256", hashlib.sha256(body).hexdigest().encode()))
            await send({**held["start"], "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, receive, hold)


def check_dynamic_step_graphs(model: Any, tokens: int, tmp_path: Path, bound: float) -> None:
    """StepIn / StepOut of ``model`` exported once with a dynamic M (up to ``tokens``) give
    the torch modules' outputs at M = 1, ``tokens`` and 30, with every compute op inside
    the XNNPACK delegate (one subgraph, no portable kernels)."""
    from executorch.runtime import Runtime
    from sakura.edge.backends.delegation import pte_kernel_calls
    from sakura.edge.backends.executorch_backend import export_dynamic
    from sakura.edge.backends.step import StepIn, StepOut, step_dynamic_shapes, step_examples

    shapes = step_dynamic_shapes(tokens)
    modules = {"step_in": StepIn(model, 2).eval(), "step_out": StepOut(model, 2).eval()}
    example = step_examples(model, 2, 13)
    for name, module in modules.items():
        path = tmp_path / f"{name}.pte"
        info = export_dynamic(module, example[name], shapes[name], path)
        assert info.outside == {} and info.subgraphs == 1, (name, info.outside)
        assert pte_kernel_calls(path.read_bytes()).kernels == {}
        method = Runtime.get().load_program(str(path)).load_method("forward")
        for m in (1, tokens, 30):
            xs = step_examples(model, 2, m)[name]
            with torch.no_grad():
                want = module(*xs)
            got = method.execute(list(xs))[0]
            assert got.shape == want.shape
            assert float((got - want).abs().max()) < bound, (name, m)


#: a replay config line: the packs of :func:`write_replay_world`'s model in the shard
#: grouping of the ``sakura-edge`` binary's world (tests/native/test_sakura_edge.py, the
#: same model), whose compiled graphs are in the shared cache, so a replay exports none
#: (49 s of test_replay.py's 174 s with the builder's grouping, 2026-12-07)
ONE_BLOCK_SHARDS = "blocks_per_shard: 1\n"


def write_replay_world(root: Path) -> tuple[Path, str]:
    """The replays' world in ``root``: the text-width model (tests/dit/common.py) saved as
    ``model.safetensors`` and a ``catalog.json`` of one 32-pixel, 3-step template made
    from a shipped one; returns ``(root, template id)``."""
    from sakura.dit.templates import DEFAULT_CATALOG
    from sakura.dit.weights import save_model

    save_model(text_width_model(), root / "model.safetensors")
    entries = json.loads(DEFAULT_CATALOG.read_text())["templates"]
    tid = "face-technologist"
    entry = {**entries[tid], "image": str(DEFAULT_CATALOG.parent / entries[tid]["image"]),
             "mask": str(DEFAULT_CATALOG.parent / entries[tid]["mask"]), "steps": 3,
             "resolution": 32}
    entry["profiling_prompts"] = entry["profiling_prompts"][:1]
    (root / "catalog.json").write_text(json.dumps({"version": 1, "templates": {tid: entry}}))
    return root, tid


def children_of(pid: int) -> set[int]:
    """The live process ids whose parent is ``pid`` (read from /proc)."""
    found = set()
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.add(int(p))
        except (OSError, ValueError, IndexError):
            continue
    return found


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
