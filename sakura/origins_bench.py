"""`sakura bench origins`: the same edit streamed from three real origins of one catalog.

The origins serve one published catalog: ``sakura serve`` (a child process), nginx (the
distribution's nginx-light with the repository's site locations, ``cloud.origins``) and S3
(the moto server, the catalog uploaded with ``mirror_to_storage``; the edge reads it with
presigned URLs). Each edit runs the shipped model on the device side (this process) behind
the same emulated link (a real trace window, ``edge.netem.shaped``; for S3 the link sits in
front of the S3 endpoint, named by ``AWS_ENDPOINT_URL``). Per origin: ``ok``, ``psnr_db``
against the exact edit, ``bytes``, ``requests``, ``max_ranges_per_request`` (byte ranges in
any one request: 1 means every shard configuration was one single-range GET), ``errors``
(requests beyond one per manifest and shard: retries) and ``latency_s``; and
``identical_images``: the fixed-configuration edit (the same configuration choices on
every origin) gives bit-identical images.

The catalog is ``--packs DIR`` (a published catalog holding the template's ``sakura`` and
``fp16`` packs) or, by default, built for the one template into a temporary folder first
(minutes on an idle machine).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sakura.argtypes import json_out
from sakura.cloud.origins import MotoS3, NginxOrigin, free_port
from sakura.errors import SakuraError
from sakura.output import write_json
from sakura.traces.catalog import default_trace_dir

DEFAULT_TEMPLATE = "face-technologist"
DEFAULT_TRACE = "mahimahi/TMobile-LTE-driving.down"
BUCKET = "sakura-bench"


def register(commands: Any, bench: Any) -> None:
    b = bench.add_parser(
        "origins", help="one edit streamed from sakura serve, nginx and S3 (moto) alike",
        description="The same edit (one template, one trace window) against three real "
                    "origins of one published catalog: bytes, requests, ranges per request, "
                    "PSNR, errors, and identical images for the same choices.")
    json_out(b, help="write the result here (- for stdout)")
    b.add_argument("--template", default=DEFAULT_TEMPLATE, metavar="ID",
                   help=f"catalog template (default {DEFAULT_TEMPLATE})")
    b.add_argument("--packs", metavar="DIR",
                   help="a published catalog with the template's sakura pack (default: build "
                        "one into a temporary folder)")
    b.add_argument("--trace", metavar="PATH",
                   help=f"link trace (default ../shared/traces/{DEFAULT_TRACE} when present)")
    b.add_argument("--rate", type=float, metavar="MBPS",
                   help="a constant link rate instead of a trace")
    b.add_argument("--start", type=float, default=0.0, metavar="S",
                   help="start of the trace window (s)")
    b.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    result = run(args.template, args.packs, args.trace, args.rate, args.start)
    write_json(args.json, result)
    bad = [n for n, o in result["origins"].items() if not o["ok"] or o["errors"]]
    if bad or not result["identical_images"]:
        print(f"sakura bench origins: failed on {', '.join(bad) or 'image identity'}",
              file=sys.stderr)
        return 1
    return 0


def _trace(trace_path: str | None, rate: float | None) -> tuple[Any, str]:
    from sakura.edge.netem import trace_from_args  # lazy: CLI --help stays fast

    if trace_path is None and rate is None:
        root = default_trace_dir()
        if root is None or not (root / DEFAULT_TRACE).exists():
            raise SakuraError(f"no --trace given and no {DEFAULT_TRACE} in the trace folder "
                              "($SAKURA_TRACES or ../shared/traces); give --trace PATH or "
                              "--rate MBPS")
        trace_path = str(root / DEFAULT_TRACE)
    trace = trace_from_args(trace_path, rate)
    return trace, trace_path or f"constant {rate} Mbit/s"


@contextlib.contextmanager
def _sakura_serve(catalog: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sakura.cli", "serve", str(catalog),
                             "--port", str(port), "--no-access-log", "--log-level", "warning"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("sakura serve did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _ranges(header: str | None) -> int:
    if not header:
        return 0
    return len([p for p in header.partition("=")[2].split(",") if p.strip()])


def run(template_id: str, packs: str | None, trace_path: str | None, rate: float | None,
        start_s: float) -> dict[str, Any]:
    from sakura.cloud.build import BuildConfig, build  # lazy: CLI --help stays fast
    from sakura.cloud.publish import mirror_to_storage  # lazy: CLI --help stays fast
    from sakura.cloud.storage import S3Storage  # lazy: CLI --help stays fast
    from sakura.dit.adapters.engine import load_engine  # lazy: torch
    from sakura.edge.netem import shaped  # lazy: CLI --help stays fast
    from sakura.edge.runtime import EdgeRuntime, EditOptions  # lazy: torch

    trace, trace_name = _trace(trace_path, rate)
    t0 = time.perf_counter()
    load = [round(x, 2) for x in os.getloadavg()]
    with contextlib.ExitStack() as stack:
        if packs:
            catalog = Path(packs)
        else:
            catalog = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="sakura-bench-origins-")))
            build(BuildConfig(out_dir=str(catalog), codecs=("sakura", "fp16"),
                              templates=(template_id,)), log=lambda *_: None)
        runtime = EdgeRuntime(load_engine(None), state_dir=None)
        sakura_url = stack.enter_context(_sakura_serve(catalog))
        nginx_url = stack.enter_context(NginxOrigin(catalog))
        moto = MotoS3()
        endpoint = stack.enter_context(moto)
        moto.create_bucket(BUCKET)
        env = moto.env()
        mirror_to_storage(catalog, S3Storage(
            BUCKET, "catalog", endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"]))
        template = runtime.fetch_template(sakura_url, template_id)
        req = runtime.request("a pirate captain with a hat", 11)
        exact = runtime.edit(sakura_url, template_id, template, req, "fp16").image
        window = trace.stats() if rate is not None else trace.slice(start_s, 60.0).stats()
        budget = float(window["median_mbps"]) * 1e6
        origins = {"sakura": (sakura_url, {}), "nginx": (nginx_url, {}),
                   "s3": (endpoint, env)}
        out: dict[str, Any] = {}
        fixed_images = {}
        for name, (url, extra_env) in origins.items():
            entry: dict[str, Any] = {"ok": False, "psnr_db": None, "bytes": 0, "requests": 0,
                                     "max_ranges_per_request": 0, "errors": 0}
            try:
                with shaped(url, trace, start_s) as (link_url, link):
                    env_here = {**extra_env, "AWS_ENDPOINT_URL": link_url} if extra_env else {}
                    origin = f"s3://{BUCKET}/catalog" if extra_env else link_url
                    with _environ(env_here):
                        log: list[Any] = []
                        link.restart(start_s)
                        res = runtime.edit(origin, template_id, template, req, "sakura",
                                           request_log=log,
                                           options=EditOptions(budget_rate_bps=budget))
                        res.compare(exact)
                        fixed = runtime.edit(origin, template_id, template, req,
                                             "sakura-fixed-config",
                                             options=EditOptions(budget_rate_bps=budget))
                fixed_images[name] = fixed.image
                entry.update(
                    ok=True, psnr_db=round(res.psnr_db, 3), bytes=res.bytes,
                    requests=len(log), latency_s=round(res.latency_s, 3),
                    max_ranges_per_request=max(_ranges(r.headers.get("Range")) for r in log),
                    errors=len(log) - 1 - len(res.timeline),
                    fixed_config_choices=fixed.configs)
            except Exception as exc:  # noqa: BLE001 - the bench reports every failure
                entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
                entry["errors"] = 1
            out[name] = entry
    import torch

    images = list(fixed_images.values())
    return {
        "bench": "origins",
        "template": template_id,
        "trace": trace_name, "start_s": start_s,
        "window_median_mbps": round(budget / 1e6, 3),
        "origins": out,
        "identical_images": len(images) == len(origins) and all(
            torch.equal(images[0], x) for x in images[1:]),
        "seconds": round(time.perf_counter() - t0, 1),
        "load_avg": {"start": load, "end": [round(x, 2) for x in os.getloadavg()]},
        "notes": "psnr_db: adaptive sakura edit vs the exact (fp16) edit; identical_images: "
                 "sakura-fixed-config edits (same choices on every origin)",
    }
