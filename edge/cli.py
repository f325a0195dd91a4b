"""``sakura edit`` (one private edit against a server) and ``sakura bench edit``.

``sakura edit --server URL --template ID --prompt TEXT [--reference IMG] [--seed N]
[--policy P] [--trace PATH --start S | --rate MBPS] --out FILE`` writes the edited image
to FILE, the timeline to ``FILE-stem.timeline.json`` and its plot to
``FILE-stem.timeline.png``, and prints latency, bytes, stalls and the chosen
configurations; ``--compare-exact`` also computes ``exact`` (the FP16 cache, fetched
without link emulation) and prints PSNR/SSIM against it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sakura.codec.cli import check_codecs
from sakura.dit.adapters.cli import check_model_options, runs_native
from sakura.dit.cli import check_file, check_template
from sakura.edge import PRECISIONS, RUNTIMES
from sakura.edge.allocator import POLICIES
from sakura.edge.backends import BACKENDS, create_backend
from sakura.edge.errors import EdgeError
from sakura.edge.monitor import DEFAULT_STARTUP_FRACTION, check_startup_fraction

from sakura.argtypes import (
    http_url,
    json_out,
    json_path,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    prompt_text,
    seed,
)
from sakura.cachedir import cache_dir as sakura_cache_dir
from sakura.errors import SakuraError
from sakura.extras import require

#: EditOptions.max_inflight (edge/runtime.py imports torch; a test keeps them equal)
MAX_INFLIGHT = 6
#: RetryPolicy.window_s (edge/retry.py imports aiohttp; the same test keeps them equal)
RETRY_WINDOW_S = 30.0

# what each non-torch backend imports (sakura.extras names the extra to install)
BACKEND_MODULES = {"executorch": ("executorch",), "qnn": ("onnxruntime_qnn", "onnx")}

SWITCH_INTERVAL_S = 0.0005  # measured: 5 ms (default) -> 0.5 ms cut a paced edit 1.45 -> 0.9 s


def startup_fraction(text: str) -> float:
    """``--startup-fraction``: a number in [0, 1] (``edge.monitor``'s rule), else exit 2."""
    try:
        return check_startup_fraction(float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def png_file(text: str) -> str:
    """``--out``: the edited image, a .png file name."""
    if Path(text).suffix.lower() != ".png" or not Path(text).stem:
        raise argparse.ArgumentTypeError(f"{text!r} is not a .png file name")
    return text


def origin_url(text: str) -> str:
    """An origin: an http(s) URL (sakura serve, nginx, a CDN) or ``s3://bucket[/prefix]``."""
    if text.startswith("s3://"):
        if not urlsplit(text).netloc:
            raise argparse.ArgumentTypeError(f"{text!r}: an S3 origin is s3://bucket[/prefix]")
        return text.rstrip("/")
    return http_url(text)


def register(commands: Any, bench: Any) -> None:
    """``sakura edit`` and ``sakura bench edit``."""
    _edit_parser(commands)
    _bench_edit_parser(bench)


def _edit_parser(commands: Any) -> None:
    p = commands.add_parser(
        "edit", help="run one private edit on this device, streaming the template cache",
        description="Run one edit: the template's KV cache streams from the server shard "
                    "by shard; the prompt, reference image and seed never leave this "
                    "machine. Every argument (and the template, in the server's catalog) "
                    "is checked before the model loads.")
    p.add_argument("--server", "--origin", dest="server", type=origin_url, required=True,
                   metavar="URL",
                   help="where the published packs are: sakura serve, nginx or a CDN "
                        "(http://127.0.0.1:8000) or an S3 bucket (s3://bucket/prefix, AWS "
                        "credentials and AWS_ENDPOINT_URL from the environment)")
    p.add_argument("--template", required=True, metavar="ID", help="template id")
    p.add_argument("--prompt", required=True, type=prompt_text,
                   help="the (private) edit prompt (not empty; the shipped encoder keeps its "
                        "first 14 tokens, and says so when it drops any)")
    p.add_argument("--reference", metavar="IMG", help="a (private) reference image")
    p.add_argument("--seed", type=seed, default=0, metavar="N",
                   help="noise seed, 0 to 2**63 - 1 (default 0)")
    p.add_argument("--policy", default="sakura", choices=list(POLICIES),
                   help="system to run (default sakura)")
    p.add_argument("--pack", metavar="CODEC",
                   help="stream this codec's pack instead of the policy's own (e.g. "
                        "sakura-all for the ablations)")
    link = p.add_mutually_exclusive_group()
    link.add_argument("--trace", metavar="PATH", help="replay this network trace on the link")
    link.add_argument("--rate", type=positive_float, metavar="MBPS",
                      help="a constant-rate link instead")
    p.add_argument("--start", type=nonnegative_float, default=0.0, metavar="S",
                   help="trace start offset in seconds (default 0)")
    p.add_argument("--rtt-ms", type=nonnegative_float, default=30.0, metavar="MS",
                   help="the emulated link's round trip (with --trace or --rate; default "
                        "30 ms, a 5G round trip, as is: on this host that is ~4 shard "
                        "executions, against ~0.3 on a phone; the demo and benches "
                        "time-scale it, e.g. 1.8 ms for face-technologist: "
                        "docs/bench/connections.json)")
    p.add_argument("--scale", type=positive_float, default=1.0, metavar="F",
                   help="multiply the trace/rate by this factor (default 1)")
    p.add_argument("--out", type=png_file, required=True, metavar="FILE",
                   help="edited image (PNG); the timeline goes beside it")
    p.add_argument("--json", type=json_path, metavar="PATH",
                   help="also write the result (latency, bytes, stalls, configurations, "
                        "timeline) here (- for stdout)")
    p.add_argument("--token", help="bearer token for the server")
    p.add_argument("--retry-window", type=positive_float, default=RETRY_WINDOW_S,
                   metavar="S",
                   help="give up on an origin that makes no progress for this long (no "
                        "answer, refused connections, 5xx), saying so once per retry "
                        "(default %(default)g s: long enough for a sakura serve restart)")
    p.add_argument("--weights", metavar="FILE", help="model weights (default: the shipped model)")
    p.add_argument("--model", help="run a diffusers model instead of the shipped one, e.g. "
                   "flux2-klein-4b, sd3.5-medium, qwenimage, qwenimage-2.1 (with --model-path; "
                   "the server's packs must have been built with the same checkpoint)")
    p.add_argument("--model-path", metavar="DIR",
                   help="the --model's local checkpoint (pipeline folder)")
    p.add_argument("--catalog", metavar="CATALOG",
                   help="take the template from this local catalog instead of the server's "
                        "catalog entry")
    p.add_argument("--compare-exact", action="store_true",
                   help="also compute `exact` and print PSNR/SSIM against it")
    p.add_argument("--state-dir", default=str(default_state_dir()), metavar="DIR",
                   help="device state kept between edits: manifests (revalidated by ETag), "
                        "execution calibration, last rate estimate (default %(default)s)")
    p.add_argument("--no-state", action="store_true", help="keep no state between edits")
    p.add_argument("--threads", type=positive_int, default=1, metavar="N",
                   help="torch threads for execution and reconstruction (default 1; more "
                        "threads than free cores slow execution down many times)")
    p.add_argument("--max-ahead", type=positive_int, default=4, metavar="N",
                   help="shards fetched ahead of execution (default 4)")
    p.add_argument("--max-inflight", type=positive_int, default=MAX_INFLIGHT,
                   metavar="N", help="requests in flight at once, one connection each "
                                     "(default %(default)s)")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS,
                   help="the shard loop's graphs (native runtime): fp32 (default) or int8 "
                        "(the bundle's int8 XNNPACK variant; sakura build --int8)")
    p.add_argument("--http-version", choices=("1.1", "2"), default="1.1",
                   help="the native runtime's HTTP for pack ranges: 1.1 (default), or 2 "
                        "(h2c with prior knowledge, e.g. nginx's `listen PORT http2;`; "
                        "`sakura serve` speaks HTTP/1.1 only; needs libcurl >= 7.89.0)")
    p.add_argument("--pack-origin", default=None, metavar="URL",
                   help="read pack ranges from this scheme://host:port (same paths as "
                        "--server; e.g. nginx 1.22's separate HTTP/2 listener)")
    p.add_argument("--startup-fraction", type=startup_fraction,
                   default=DEFAULT_STARTUP_FRACTION, metavar="F",
                   help="startup allowance: execution may start up to F x the predicted "
                        "execution time after the manifest is in, so the first shards go at "
                        "better configurations (with a current rate estimate: see "
                        "edge/README.md); 0 to 1, 0: none (default %(default)s)")
    p.add_argument("--backend", default="torch", choices=BACKENDS,
                   help="execution backend (default torch; executorch: XNNPACK .pte shard "
                        "graphs; qnn: QNN HTP context binaries, x86 simulator here)")
    p.add_argument("--compiled-dir", metavar="DIR",
                   help="compiled shard graphs are cached here (default "
                        "compiled/ in the cache folder: $SAKURA_CACHE, else "
                        "$XDG_CACHE_HOME/sakura, else ~/.cache/sakura)")
    runtime_arg(p)
    reconstruct_arg(p)
    p.set_defaults(func=_edit)


def _bench_edit_parser(bench: Any) -> None:
    b = bench.add_parser(
        "edit", help="all policies on one template and one trace window (regime-matched)",
        description="Run every policy on the same edit over the same paced trace window; "
                    "the trace is scaled so that the FP16 cache at its median rate takes "
                    "10x the masked execution time.")
    json_out(b)
    b.add_argument("--quick", action="store_true", help="one start point (under a minute)")
    b.add_argument("--template", metavar="ID", help="template (default: the first one)")
    b.add_argument("--trace", metavar="PATH", help="trace file (default: the first 5G trace)")
    b.add_argument("--start", type=nonnegative_float, metavar="S", help="trace start offset (s)")
    b.add_argument("--runs", type=positive_int, metavar="N",
                   help="start points (default 1 quick, 3 otherwise)")
    b.add_argument("--policies", nargs="+", choices=list(POLICIES), metavar="P",
                   help=f"policies (default all: {', '.join(POLICIES)})")
    b.add_argument("--server", type=http_url, metavar="URL",
                   help="use this running server (it must hold the template)")
    b.add_argument("--catalog-dir", metavar="DIR", help="serve this published catalog directory")
    b.add_argument("--cache-dir", default="runs/edge-bench", metavar="DIR",
                   help="where built packs are kept (default runs/edge-bench)")
    b.add_argument("--weights", metavar="FILE", help="model weights (default: the shipped model)")
    b.add_argument("--plots", metavar="DIR", help="write a timeline plot per run here")
    b.add_argument("--threads", type=positive_int, default=1, metavar="N",
                   help="torch threads of the device (default 1), the same for every system")
    runtime_arg(b, python_needs="")
    reconstruct_arg(b)
    b.add_argument("--background-load", type=nonnegative_int, default=0, metavar="N",
                   help="run N busy processes beside the edits (default 0), to measure "
                        "with other work on the machine; the JSON says how many")
    b.add_argument("--compare-python", action="store_true",
                   help="also run sakura and local on the Python runtime in the same run "
                        "(python_runtime in the JSON)")
    b.add_argument("--rtt-ms", type=nonnegative_float, default=30.0, metavar="MS",
                   help="the network's round trip (default 30 ms, a 5G RTT)")
    b.add_argument("--pipeline-cpus", choices=("network", "device"), default="network",
                   help="where the native receive and reconstruct threads run: network "
                        "(default: the server and link's CPU, as a phone's modem and GPU) or "
                        "device (beside execution, to measure what that costs)")
    b.add_argument("--rtt-scale", choices=("matched", "none"), default="matched",
                   help="matched (default): the link carries RTT x T / the phone profile's "
                        "masked execution, time scaled like the rates; none: the RTT as is")
    b.set_defaults(func=_bench)


def runtime_arg(p: Any, python_needs: str = " (diffusers models, reference images and "
                "--backend executorch|qnn run on the Python runtime)") -> None:
    p.add_argument("--runtime", choices=RUNTIMES, default=None,
                   help="device runtime: native (default: the shard loop in C++, "
                        f"sakura_native) or python (the reference pipeline){python_needs}")


def reconstruct_arg(p: Any) -> None:
    p.add_argument("--reconstruct", default="cpu", metavar="cpu|opencl[:DEVICE]",
                   type=reconstruct_stage,
                   help="where the native runtime decodes sakura/svd shards: cpu (default, "
                        "SIMD kernels) or opencl (the GPU path; here pocl on the CPU); "
                        "DEVICE picks an OpenCL device by name")


def reconstruct_stage(text: str) -> str:
    if text != "cpu" and text != "opencl" and not text.startswith("opencl:"):
        raise argparse.ArgumentTypeError(f"{text!r} is not cpu, opencl or opencl:DEVICE")
    return text


def resolve_runtime(args: argparse.Namespace, needs_python: list[str]) -> str:
    """``--runtime``, defaulting to native unless what is asked for needs the Python
    runtime (then a note says so); an explicit native that cannot be is an error."""
    if args.runtime == "native" and needs_python:
        raise EdgeError(f"--runtime native runs the shipped model on text and masked image "
                        f"tokens; {', '.join(needs_python)} need --runtime python")
    if args.runtime is None and needs_python:
        print(f"sakura: note: {', '.join(needs_python)} run on the Python runtime",
              file=sys.stderr)
        return "python"
    runtime = args.runtime or "native"
    if runtime == "native":
        from sakura.edge.native_status import native_module  # lazy: CLI --help stays fast

        native_module()  # one clear error when it is not built (no torch imported)
    return runtime


def default_state_dir() -> Path:
    return sakura_cache_dir("edge")


def load_image(path: str, size: int) -> Any:
    """An RGB image file -> ``[3, size, size]`` tensor in [-1, 1]."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from skimage.io import imread

    try:
        arr = imread(path)
    except (OSError, ValueError) as exc:
        raise EdgeError(f"cannot read image {path}: {exc}") from exc
    if arr.ndim == 2:
        arr = np.stack([arr] * 3, axis=-1)
    x = torch.from_numpy(arr[..., :3].astype(np.float32) / 127.5 - 1).permute(2, 0, 1)
    if x.shape[-1] != size or x.shape[-2] != size:
        x = F.interpolate(x[None], size=(size, size), mode="bilinear", antialias=True)[0]
    return x.clamp(-1, 1)


def save_image(img: Any, path: Path) -> None:
    import numpy as np
    from skimage.io import imsave

    arr = ((img.detach().float().clamp(-1, 1) + 1) * 127.5).round().byte()
    path.parent.mkdir(parents=True, exist_ok=True)
    imsave(str(path), arr.permute(1, 2, 0).numpy().astype(np.uint8), check_contrast=False)


def check_edit_args(args: argparse.Namespace) -> None:
    """Everything about ``sakura edit``'s arguments that can be checked without the model or
    the network: exit 2 for a bad argument, 1 for a missing file."""
    check_model_options(args.model, args.model_path, args.weights,
                        reference=bool(args.reference))
    check_file(args.weights, "--weights")
    check_file(args.reference, "--reference")
    check_file(args.trace, "--trace")
    if args.catalog:
        check_template(args.template, args.catalog)
    if args.backend != "torch":
        require(*BACKEND_MODULES[args.backend], what=f"--backend {args.backend}")

        create_backend(args.backend, _backend_config(args))  # raises if it cannot run here
    if args.pack:
        check_codecs([args.pack], "--pack")
    needs = [what for what, asked in ((f"--model {args.model}", not runs_native(args.model)),
                                      ("--reference", args.reference),
                                      (f"--backend {args.backend}", args.backend != "torch"))
             if asked]
    args.runtime = resolve_runtime(args, needs)
    if args.reconstruct != "cpu" and args.runtime != "native":
        raise EdgeError(f"--reconstruct {args.reconstruct} is a stage of the native runtime; "
                        f"this edit runs on the {args.runtime} runtime")


def fetch_template_entry(server: str, template_id: str, token: str | None,
                         retry: Any = None) -> dict[str, Any]:
    """The template's entry in the server's catalog (only its id is sent), fetched before
    torch or the model load, so that an unknown template or a server that is not there
    costs nothing (the same request as ``EdgeRuntime.fetch_template``)."""
    import asyncio

    from sakura.edge.client import PackClient, RetryPolicy  # lazy: aiohttp

    async def get() -> dict[str, Any]:
        async with PackClient(server, token=token, retry=retry or RetryPolicy(),
                              on_wait=say_waiting) as client:
            return await client.template_entry(template_id)

    return asyncio.run(get())


def say_waiting(message: str) -> None:
    """One line per retry while the origin does not answer (never silent for 30 s)."""
    print(f"sakura: {message}", file=sys.stderr, flush=True)


def _edit(args: argparse.Namespace) -> int:
    check_edit_args(args)
    out = Path(args.out)
    from sakura.edge.netem import trace_from_args  # lazy: CLI --help stays fast

    trace = trace_from_args(args.trace, args.rate, args.scale)
    from sakura.edge.retry import RetryPolicy  # lazy: aiohttp

    retry = RetryPolicy(window_s=args.retry_window)
    entry = None if args.catalog else fetch_template_entry(args.server, args.template,
                                                           args.token, retry)
    _set_threads(args.threads)
    if entry is None:
        from sakura.dit.templates import load_catalog  # lazy: torch

        template = load_catalog(args.catalog)[args.template].to_device_template()
    else:
        from sakura.edge.templates import template_from_entry  # lazy: torch

        template = template_from_entry(args.template, entry)
        shipped = _shipped_seed(args.template)
        if template.seed < 0 and shipped is not None:
            template.seed = shipped

    from sakura.dit.adapters.engine import load_engine  # lazy: torch
    from sakura.dit.weights import DEFAULT_WEIGHTS  # lazy: torch
    from sakura.edge.netem import shaped  # lazy: CLI --help stays fast
    from sakura.edge.runtime import EdgeRuntime, EditOptions  # lazy: torch
    from sakura.edge.timeline import plot_timeline, write_json  # lazy: CLI --help stays fast

    weights = Path(args.weights) if args.weights else DEFAULT_WEIGHTS
    engine = load_engine(args.model, args.model_path, weights=weights)
    runtime = EdgeRuntime(engine, state_dir=None if args.no_state else args.state_dir,
                          backend=args.backend, backend_config=_backend_config(args),
                          runtime=args.runtime)
    reference = load_image(args.reference, template.size) if args.reference else None
    tokens = prompt_tokens(runtime, args.prompt)
    req = runtime.request(args.prompt, args.seed, reference)
    options = EditOptions(max_ahead=args.max_ahead, max_inflight=args.max_inflight,
                          pack=args.pack, http_version=args.http_version,
                          pack_origin=args.pack_origin, precision=args.precision,
                          reconstruct=args.reconstruct,
                          startup_fraction=args.startup_fraction, on_wait=say_waiting,
                          retry=retry)
    link_info: dict[str, Any] = {"mode": "direct"}
    if trace is not None:
        stats = trace.slice(args.start, 60.0).stats() if args.trace else trace.stats()
        options.budget_rate_bps = float(stats["median_mbps"]) * 1e6
        link_info = {"mode": "paced", "trace": args.trace, "rate_mbps": args.rate,
                     "scale": args.scale, "start_s": args.start, "window_stats": stats}
        options.rate_origin = args.server  # (the link's proxy port changes every run)
        with shaped(args.server, trace, args.start, rtt_ms=args.rtt_ms) as (url, link):
            link_info.update(link.conditions())  # emulator, RTT, loss, its process and CPUs
            try:
                result = runtime.edit(url, args.template, template, req, args.policy,
                                      token=args.token, options=options)
            except EdgeError as exc:  # name the URL the user gave, not the link's proxy
                raise type(exc)(str(exc).replace(
                    url, f"{args.server} (through the emulated link)")) from None
    else:
        result = runtime.edit(args.server, args.template, template, req, args.policy,
                              token=args.token, options=options)
    if args.compare_exact:
        exact = runtime.edit(args.server, args.template, template, req, "fp16",
                             token=args.token, options=EditOptions(remember_rate=False,
                                                                   retry=retry))
        result.compare(exact.image)
    save_image(result.image, out)
    stem = out.with_suffix("")
    doc = {"template": args.template, "link": link_info, "server": args.server,
           "runtime": runtime.runtime, "model": runtime.engine.name, **tokens,
           **result.to_json()}
    tl_json = write_json(stem.with_name(stem.name + ".timeline.json"), doc)
    if args.json:
        write_json(Path(args.json), doc)
    tl_png = plot_timeline(result.timeline, stem.with_name(stem.name + ".timeline.png"),
                           f"{args.policy} on {args.template}", phases=result.phases,
                           latency_s=result.latency_s) if result.timeline else None
    _print_summary(result, out, tl_json, tl_png)
    return 0


def prompt_tokens(runtime: Any, prompt: str) -> dict[str, int]:
    """How much of ``prompt`` the shipped text encoder keeps (its window counts CLS and
    SEP; a longer prompt is truncated): ``prompt_tokens_kept``/``_total``/``_window`` for
    the result JSON, and one warning line when tokens were dropped. Empty for a diffusers
    model, whose pipeline's own text encoders tokenize the prompt."""
    if not runtime.default_model:
        return {}
    encoder = runtime.encoder
    kept, total = encoder.token_counts(prompt)
    if kept < total:
        print(f"sakura: warning: the prompt is {total} tokens; the text encoder's window "
              f"keeps the first {kept} (with CLS and SEP) and drops the other "
              f"{total - kept}", file=sys.stderr)
    return {"prompt_tokens_kept": kept, "prompt_tokens_total": total,
            "prompt_tokens_window": int(encoder.max_tokens)}


def startup_fraction_arg(value: float) -> float:
    """``--startup-fraction`` checked (an :class:`EdgeError` naming the option otherwise)."""
    try:
        return check_startup_fraction(value)
    except ValueError as exc:
        raise EdgeError(f"--startup-fraction: {exc}") from None


def _backend_config(args: argparse.Namespace) -> Any:
    from sakura.edge.backends.base import BackendConfig  # lazy: torch

    return BackendConfig(cache_dir=Path(args.compiled_dir)) if args.compiled_dir else None


def _set_threads(n: int) -> None:
    """Process settings of the device runtime: torch threads, and a short GIL switch
    interval so that the receive/reconstruct threads (and an in-process emulated link) do
    not hold the executing thread up for CPython's default 5 ms at a time."""
    import torch

    if n < 1:
        raise EdgeError(f"--threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def _shipped_seed(template_id: str) -> int | None:
    """The template seed from the shipped catalog (the local policy needs it)."""
    from sakura.dit.templates import load_catalog  # lazy: torch

    try:
        spec = load_catalog().get(template_id)
    except SakuraError:
        return None
    return None if spec is None else spec.seed


def _print_summary(result: Any, out: Path, tl_json: Path, tl_png: Path | None) -> None:
    w = sys.stdout.write
    for warning in result.warnings:
        sys.stderr.write(f"sakura: warning: {warning}\n")
    w(f"policy      {result.policy} (pack: {result.codec or 'none'})\n")
    w(f"latency     {result.latency_s:.3f} s (startup {result.startup_s:.3f} s, "
      f"execution {result.exec_s:.3f} s, startup allowance "
      f"{result.startup_allowance_s:.3f} s)\n")
    w(f"bytes       {result.bytes} shard bytes + {result.manifest_bytes} manifest bytes "
      f"in {result.requests} requests\n")
    w(f"stalls      {result.stalls} ({result.stall_s:.3f} s)\n")
    if result.truncations or result.hedges or result.local_fallbacks or result.stale_steps:
        w(f"deadlines   {result.truncations} shards truncated, {result.hedges} re-requested, "
          f"{result.stale_steps} steps on their blocks' last K/V ({result.planned_stale} "
          f"shards not fetched by plan), "
          f"{result.local_fallbacks} steps computed on the device ({result.planned_local} "
          "shards by plan, the rest because nothing could arrive)\n")
    if result.refinements:
        w(f"refinements {result.refinements} shards extended by one more range before they "
          "ran (the link was faster than their choice assumed)\n")
    if result.configs:
        w("configs     " + " ".join(
            _short(p) for p in result.params) + "\n")
    quality = result.quality_line()
    if quality:
        w(f"quality     {quality}\n")
    if result.psnr_db is not None:
        w(f"vs exact    PSNR {result.psnr_db:.2f} dB, SSIM {result.ssim:.4f}\n")
    w(f"wrote       {out}, {tl_json}" + (f", {tl_png}" if tl_png else "") + "\n")


def _short(params: dict[str, Any]) -> str:
    if not params:
        return "-"
    if "rank" in params and "bits" in params:
        return f"r{params['rank']}b{params['bits']}"
    return ",".join(f"{k}{v}" for k, v in params.items())


def _bench(args: argparse.Namespace) -> int:
    check_template(args.template)
    check_file(args.trace, "--trace")
    check_file(args.weights, "--weights")
    if args.catalog_dir and not Path(args.catalog_dir).is_dir():
        raise EdgeError(f"--catalog-dir: no such folder: {args.catalog_dir}")
    from sakura.edge.bench import DEFAULT_POLICIES, BenchSpec, run_bench, write  # lazy: torch

    runtime = resolve_runtime(args, [])
    _set_threads(args.threads)
    spec = BenchSpec(
        json_path=Path(args.json), quick=args.quick, template=args.template, trace=args.trace,
        start_s=args.start, policies=tuple(args.policies or DEFAULT_POLICIES),
        server=args.server, catalog=args.catalog_dir, cache_dir=Path(args.cache_dir),
        weights=args.weights, runs=args.runs, threads=args.threads, runtime=runtime,
        background_load=args.background_load, compare_python=args.compare_python,
        reconstruct=args.reconstruct, rtt_ms=args.rtt_ms, rtt_scale=args.rtt_scale,
        pipeline_cpus=args.pipeline_cpus,
        plots=Path(args.plots) if args.plots else None,
        log=lambda msg: print(msg, file=sys.stderr, flush=True))
    doc = run_bench(spec)
    write(doc, spec.json_path)
    print(f"wrote {spec.json_path}: " + ", ".join(
        f"{p} {doc['latency_s'][p]:.2f} s" for p in doc["policies"]))
    return 0
