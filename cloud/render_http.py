"""HTTP front of the render engine (FastAPI): requests arrive here, results are polled.

* ``POST /v1/renders`` ``{"prompt", "seed", "steps", "size", "guidance", "mode", "priority",
  "patches", "wait"}`` -> ``202 {"id", "status": "queued"}``, or with ``"wait": true``
  ``200`` and the result. ``priority``: ``high`` / ``normal`` / ``low`` (the scheduler's
  classes); ``patches``: a fixed R (default: the engine's online search).
* ``GET /v1/renders/{id}`` -> status (``queued`` / ``done`` / ``failed``), latency, stats.
* ``GET /v1/renders/{id}/image.png`` -> the image (``409`` while it is not done).
* ``GET /v1/engine`` -> scheduler and worker metrics; ``GET /healthz``.

Errors are JSON ``{"error": message}`` with 400 (bad request), 404 (unknown id), 409, 422
(malformed body), 503 (engine down).
"""

from __future__ import annotations

import asyncio
import io
import itertools
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from sakura.cloud.render import RenderEngine
from sakura.cloud.render_api import RenderError, RenderRequest, RenderResult

from sakura.output import json_safe


class RenderBody(BaseModel):
    prompt: str = Field(min_length=1, max_length=300)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    steps: int = Field(default=20, ge=1, le=100)
    size: int = Field(default=64, ge=8, le=1024)
    guidance: float = Field(default=3.0, ge=0.0, le=20.0)
    mode: Literal["regional", "separate", "full", "naive"] = "regional"
    priority: Literal["high", "normal", "low"] = "normal"
    patches: int | None = Field(default=None, ge=1, le=64)
    wait: bool = False


def png_bytes(image) -> bytes:
    """``[3, H, W]`` in [-1, 1] -> PNG."""
    from PIL import Image

    arr = ((image.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _result_json(rid: int, fut: Future) -> dict:
    if not fut.done():
        return {"id": rid, "status": "queued"}
    exc = fut.exception()
    if exc is not None:
        return {"id": rid, "status": "failed", "error": str(exc)}
    res: RenderResult = fut.result()
    # stats hold NaN where a figure does not apply (a full-mode request has no partition:
    # "explained"): null in the JSON; the NaN made every full-mode answer a 500
    out = {"id": rid, "status": "done", "mode": res.mode, "priority": res.priority,
           "latency_s": res.latency_s, "stats": json_safe(res.stats)}
    if res.image is not None:
        out["image"] = f"/v1/renders/{rid}/image.png"
    return out


def create_render_app(engine: RenderEngine, keep: int = 1000) -> FastAPI:
    """The HTTP API over a started engine (the caller owns the engine's lifecycle)."""
    app = FastAPI(title="SAKURA render engine", version="1")
    jobs: OrderedDict[int, Future] = OrderedDict()
    lock = threading.Lock()
    ids = itertools.count()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()))
        return _error(422, f"invalid request body: {where}: {first.get('msg', 'malformed')}")

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": engine.loop_error is None}

    @app.get("/v1/engine")
    async def metrics() -> dict:
        return engine.metrics()

    @app.post("/v1/renders")
    async def create(body: RenderBody):
        if engine.loop_error is not None:
            return _error(503, "the render engine is down")
        req = RenderRequest(prompt=body.prompt, seed=body.seed, steps=body.steps,
                            size=body.size, guidance=body.guidance, mode=body.mode,
                            priority=body.priority, patches=body.patches)
        try:
            fut = await asyncio.to_thread(engine.submit, req)
        except RenderError as exc:
            return _error(400, str(exc))
        with lock:
            rid = next(ids)
            jobs[rid] = fut
            while len(jobs) > keep:
                jobs.popitem(last=False)
        if body.wait:
            try:
                await asyncio.wrap_future(fut)
            except RenderError:
                pass
            return _result_json(rid, fut)
        return JSONResponse({"id": rid, "status": "queued"}, status_code=202)

    def _job(rid: int) -> Future | None:
        with lock:
            return jobs.get(rid)

    @app.get("/v1/renders/{rid}")
    async def status(rid: int):
        fut = _job(rid)
        if fut is None:
            return _error(404, f"no render {rid}")
        return _result_json(rid, fut)

    @app.get("/v1/renders/{rid}/image.png")
    async def image(rid: int):
        fut = _job(rid)
        if fut is None:
            return _error(404, f"no render {rid}")
        if not fut.done():
            return _error(409, f"render {rid} is not done")
        if fut.exception() is not None:
            return _error(409, f"render {rid} failed: {fut.exception()}")
        if fut.result().image is None:
            return _error(409, f"render {rid} has latents only (no VAE in this engine)")
        return Response(png_bytes(fut.result().image), media_type="image/png")

    return app


__all__ = ["RenderBody", "create_render_app", "png_bytes"]
