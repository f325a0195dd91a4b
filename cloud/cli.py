"""``sakura build``, ``sakura serve`` and ``sakura bench serve``: the cloud package's commands.

``sakura build [CATALOG]`` checks every argument (codecs against the codec registry,
template ids against the catalog, files, the model options) before it loads the model, so
a bad one costs nothing and publishes nothing.

``sakura serve DIR`` serves a published catalog directory; with ``--s3-bucket`` it serves a
catalog stored in an S3-compatible bucket instead (DIR is then ignored in favour of
``--s3-prefix``). Tokens come from ``--tokens-file`` or the ``SAKURA_TOKENS`` environment
variable; without either the API is open. The listening socket is bound before the app is
built, so a port in use or an address that does not exist is one ``sakura: error:`` line.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
from pathlib import Path
from typing import Any

from sakura.cloud.errors import ManifestError, ServeConfigError, StorageError
from sakura.codec import DEFAULT_BLOCKS_PER_SHARD
from sakura.codec.cli import check_codecs
from sakura.dit.adapters.cli import check_model_options
from sakura.dit.cli import check_file, check_template_images, template_ids

from sakura.argtypes import (
    http_url,
    json_out,
    json_path,
    name_list,
    nonnegative_int,
    port,
    positive_float,
    positive_int,
)
from sakura.errors import SakuraError, UsageError
from sakura.extras import require
from sakura.output import write_json

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# cloud.build.DEFAULT_CODECS, not imported so that the CLI starts without the builder
# (tests/sakura/test_cli.py checks that they agree)
BUILD_CODECS = ("sakura", "svd", "fp16", "intq", "cachegen", "sakura-all")


def register(commands: Any, bench: Any) -> None:
    build = commands.add_parser(
        "build",
        help="build and atomically publish template packs for a catalog",
        description="Template run + importance profiling, encode every codec, publish. "
                    "Arguments are checked before any compute; a failed build leaves the "
                    "published catalog as it was.",
    )
    build.add_argument("catalog", nargs="?", metavar="CATALOG",
                       help="catalog.json or its folder (default: the shipped catalog)")
    build.add_argument("--out", default="packs", metavar="DIR",
                       help="published catalog directory (default %(default)s)")
    build.add_argument("--codecs", type=name_list, default=BUILD_CODECS, metavar="LIST",
                       help=f"comma-separated codecs (default {','.join(BUILD_CODECS)})")
    build.add_argument("--templates", type=name_list, default=(), metavar="LIST",
                       help="comma-separated template ids (default: all)")
    build.add_argument("--weights", metavar="FILE",
                       help="model weights (default: the shipped model)")
    build.add_argument("--model", help="a diffusers model instead of the shipped one, e.g. "
                       "flux2-klein-4b, sd3.5-medium, qwenimage, qwenimage-2.1 (with --model-path)")
    build.add_argument("--model-path", metavar="DIR",
                       help="the --model's local checkpoint (pipeline folder)")
    build.add_argument("--blocks-per-shard", type=positive_int, default=DEFAULT_BLOCKS_PER_SHARD, metavar="N",
                       help="transformer blocks per shard (default %(default)s)")
    build.add_argument("--resolution", type=positive_int, metavar="PX",
                       help="build at this resolution (ids get -PX)")
    build.add_argument("--force", action="store_true", help="rebuild unchanged templates too")
    build.add_argument("--publish", metavar="URL",
                       help="then upload the published catalog to this bucket: s3://bucket/"
                            "prefix[?endpoint_url=...] (AWS credentials from the environment)")
    build.add_argument("--profile-psnr", type=nonnegative_int, default=0, metavar="N",
                       help="measure every configuration's output PSNR against exact on "
                            "N profiling requests (slow: one edit per configuration and "
                            "request; default 0: the fitted profile of --psnr-fit)")
    build.add_argument("--psnr-fit", type=nonnegative_int, default=1, metavar="N",
                       help="the default, cheap output-PSNR profile: a few sampled shards "
                            "measured on N profiling requests, the rest fitted per step "
                            "(codec.profile.FittedPSNR; 0: KV error only; default 1)")
    build.add_argument("--bundle", action=argparse.BooleanOptionalAction, default=True,
                       help="also export and publish each template geometry's device bundle "
                            "(graphs, text encoder, vocabulary, tables; default: on)")
    build.add_argument("--ray", metavar="ADDRESS",
                       help="build the templates as Ray tasks (one CPU and one torch thread "
                            "each) on the cluster whose head is ADDRESS (HOST:PORT; auto: a "
                            "cluster started on this machine; local: start Ray here) and "
                            "publish here, as without it; the packs are the same bytes (needs "
                            "the [ray] extra)")
    build.add_argument("--json", type=json_path, metavar="PATH",
                       help="write the build report (built, skipped, seconds) here "
                            "(- for stdout)")
    build.set_defaults(func=_build)

    serve = commands.add_parser(
        "serve",
        help="serve a published template catalog over HTTP (FastAPI + uvicorn)",
        description="Serve catalog.json, manifests, packs (HTTP Range) and shard bodies.",
    )
    serve.add_argument("dir", nargs="?", metavar="DIR",
                       help="published catalog directory (holds catalog.json)")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=port, default=8000,
                       help="listen port, 0 for any free one (default 8000)")
    serve.add_argument("--tokens-file", metavar="FILE",
                       help="bearer tokens, one per line: TOKEN [id,id,...]")
    serve.add_argument("--s3-endpoint", type=http_url, metavar="URL",
                       help="S3-compatible endpoint URL (e.g. http://127.0.0.1:9000)")
    serve.add_argument("--s3-bucket", metavar="NAME",
                       help="serve the catalog from this bucket instead of DIR")
    serve.add_argument("--s3-prefix", default="", metavar="PREFIX",
                       help="key prefix of the catalog in the bucket")
    serve.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                       help="uvicorn log level (default info)")
    serve.add_argument("--no-access-log", action="store_true", help="do not log every request")
    serve.add_argument("--fd", type=nonnegative_int, help=argparse.SUPPRESS)  # inherited socket
    serve.set_defaults(func=_serve)

    bench_serve = bench.add_parser(
        "serve",
        help="concurrent loopback clients fetching shard configs vs a static file server",
        description="Benchmark the shard endpoint against a plain static file server on the "
                    "same pack.",
    )
    json_out(bench_serve, help="write the result here (- for stdout)")
    bench_serve.add_argument("--quick", action="store_true", help="small pack, 2 s per server")
    bench_serve.add_argument("--clients", type=positive_int, default=32, metavar="N",
                             help="concurrent clients (default 32)")
    bench_serve.add_argument("--duration", type=positive_float, metavar="S",
                             help="seconds of measured load per server")
    bench_serve.add_argument("--restart-at", type=positive_float, metavar="S",
                             help="ride-through mode: only sakura serve, the product's client "
                                  "on every --clients, the server restarted S seconds into "
                                  "--duration (keys errors_after_ride_through, wrong_bytes, "
                                  "p99_ms)")
    bench_serve.set_defaults(func=_bench_serve, ride_client=None)


def _build(args: argparse.Namespace) -> int:
    check_model_options(args.model, args.model_path, args.weights)
    check_file(args.weights, "--weights")
    ids = template_ids(args.catalog)
    unknown = [t for t in args.templates if t not in ids]
    if unknown:
        raise SakuraError(f"unknown template id(s) {', '.join(unknown)}; the catalog has "
                          f"{', '.join(ids)}")
    check_template_images(args.catalog, args.templates or ids, args.resolution)
    check_codecs(args.codecs, "--codecs")
    if args.publish:
        from urllib.parse import urlparse

        if urlparse(args.publish).scheme not in ("s3", "file", ""):
            raise SakuraError(f"--publish {args.publish[:80]!r}: give s3://bucket/prefix "
                              "(or a folder)")
    if args.ray:
        require("ray", what="--ray")
    from sakura.cloud.build import BuildConfig, build  # lazy: CLI --help stays fast

    # the edge's exporter, set as this parser's default by the app layer (sakura.bundle_cli):
    # the cloud package may not import the edge
    exporter = getattr(args, "bundle_exporter", None) if args.bundle else None
    if args.bundle and exporter is None:
        raise SakuraError("the device bundle exporter is not installed (sakura.bundle_cli); "
                          "give --no-bundle to build packs only")
    cfg = BuildConfig(
        catalog=args.catalog,
        out_dir=args.out,
        codecs=args.codecs,
        templates=args.templates,
        weights=args.weights,
        model=args.model,
        model_path=args.model_path,
        blocks_per_shard=args.blocks_per_shard,
        resolution=args.resolution,
        force=args.force,
        profile_psnr=args.profile_psnr,
        psnr_fit=args.psnr_fit,
        publish=args.publish,
        bundle_exporter=exporter,
        ray=args.ray,
    )
    report = build(cfg)
    doc = {"built": report.built, "skipped": report.skipped, "bundles": report.bundles,
           "seconds": {k: round(v, 1) for k, v in report.seconds.items()},
           **({"published": len(report.published)} if args.publish else {})}
    if args.json:
        write_json(args.json, doc)
    print(f"sakura build: built {', '.join(report.built) or 'nothing'}; up to date "
          f"{', '.join(report.skipped) or 'nothing'} -> {args.out}")
    return 0


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port), or a
    :class:`ServeConfigError` that says why not."""
    where = f"{host}:{port}"
    try:
        family, kind, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ServeConfigError(f"cannot listen on {where}: unknown host {host!r} ({exc})") from None
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose protocol says TCP
    sock = socket.socket(family, kind, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        hint = {errno.EADDRINUSE: " (another server is listening there: pick another --port)",
                errno.EACCES: " (ports below 1024 need privileges: pick another --port)",
                errno.EADDRNOTAVAIL: " (no such address on this machine: check --host)",
                }.get(exc.errno, "")
        raise ServeConfigError(f"cannot listen on {where}: {exc.strerror}{hint}") from None
    return sock


def _serve(args: argparse.Namespace) -> int:
    if args.s3_bucket:
        require("boto3", what="--s3-bucket")
    elif args.s3_endpoint:
        raise UsageError("--s3-endpoint needs --s3-bucket")
    elif not args.dir:
        raise UsageError("give the published catalog directory DIR (or --s3-bucket)")
    from sakura.cloud.auth import load_tokens  # lazy: CLI --help stays fast
    from sakura.cloud.runner import run  # lazy: web stack
    from sakura.cloud.server import create_app  # lazy: web stack

    storage = open_serve_storage(args.dir, args.s3_bucket, args.s3_endpoint, args.s3_prefix)
    tokens = load_tokens(args.tokens_file)
    fd = args.fd
    if fd is None:
        sock = listen(args.host, args.port)
        host, bound = sock.getsockname()[:2]
        print(f"sakura serve: listening on http://{_url_host(host)}:{bound}", file=sys.stderr)
        fd = sock.detach()  # uvicorn owns it from here
    app = create_app(storage, tokens)
    auth = f"bearer auth with {len(tokens)} token(s)" if tokens else "no auth"
    print(f"sakura serve: {storage.describe()}, {auth}", file=sys.stderr)
    run(app, args.host, args.port, fd=fd, log_level=args.log_level,
        access_log=not args.no_access_log)
    return 0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def open_serve_storage(
    directory: str | None, bucket: str | None, endpoint: str | None, prefix: str = ""
) -> Any:
    """The storage ``sakura serve`` reads, checked to hold a catalog.json."""
    from sakura.cloud.layout import CATALOG_KEY  # lazy: CLI --help stays fast
    from sakura.cloud.storage import LocalStorage, S3Storage  # lazy: CLI --help stays fast

    if bucket:
        try:
            storage = S3Storage(bucket, prefix, endpoint)
            found = storage.exists(CATALOG_KEY)
        except StorageError as exc:
            raise ServeConfigError(
                f"cannot read {CATALOG_KEY} from S3 bucket {bucket!r}: {exc}"
            ) from exc
        if not found:
            raise ServeConfigError(
                f"no {CATALOG_KEY} in {storage.describe()}: publish a catalog first"
            )
        check_catalog(storage, f"{CATALOG_KEY} in {storage.describe()}")
        return storage
    if endpoint:
        raise ServeConfigError("--s3-endpoint needs --s3-bucket")
    if not directory:
        raise ServeConfigError("give the published catalog directory (or --s3-bucket)")
    path = Path(directory)
    if not path.is_dir():
        raise ServeConfigError(f"{directory} is not a directory")
    if not (path / CATALOG_KEY).is_file():
        raise ServeConfigError(
            f"{directory} has no {CATALOG_KEY}: build or publish a catalog into it first"
        )
    storage = LocalStorage(path)
    check_catalog(storage, str(path / CATALOG_KEY))
    return storage


def check_catalog(storage: Any, where: str) -> None:
    """Refuse to serve a catalog.json that does not parse or has the wrong shape (one
    :class:`ServeConfigError` line). The running server re-reads it on change, and
    answers 500/503 with the reason if it is broken later."""
    import json

    from sakura.cloud.layout import CATALOG_KEY, validate_catalog  # lazy: CLI --help stays fast

    try:
        raw = storage.read_bytes(CATALOG_KEY)
    except StorageError as exc:
        raise ServeConfigError(f"cannot read {where}: {exc}") from None
    try:
        validate_catalog(json.loads(raw))
    except (ValueError, RecursionError) as exc:  # JSON syntax, UTF-8, nesting
        raise ServeConfigError(f"{where} is not valid JSON ({str(exc)[:200]}): rebuild or "
                               "republish the catalog") from None
    except ManifestError as exc:
        raise ServeConfigError(f"{where} is not a SAKURA catalog ({exc}): rebuild or "
                               "republish the catalog") from None


def _bench_serve(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from sakura.cloud.bench import BenchConfig, run_bench  # lazy: CLI --help stays fast

    config = BenchConfig.quick(args.clients) if args.quick else BenchConfig(clients=args.clients)
    if args.duration is not None:
        config = replace(config, duration_s=args.duration)
    if args.restart_at is not None:
        return _bench_ride_through(args, replace(config, restart_at_s=args.restart_at))
    result = run_bench(config)
    write_json(args.json, result)
    print(f"sakura bench serve: {result['requests_per_s']:.0f} requests/s, "
          f"{result['gbytes_per_s']:.3f} GB/s, p99 {result['p99_ms']:.2f} ms, "
          f"{result['errors']} errors (static file server: "
          f"{result['reference_gbytes_per_s']:.3f} GB/s)")
    if result["errors"]:
        print(
            f"sakura bench serve: {result['errors']} errors: {result['first_error']}",
            file=sys.stderr,
        )
        return 1
    return 0


def _bench_ride_through(args: argparse.Namespace, config: Any) -> int:
    from sakura.cloud.bench import run_ride_through  # lazy: CLI --help stays fast

    if config.restart_at_s >= config.duration_s:
        raise UsageError(f"--restart-at {config.restart_at_s:g} must be less than the "
                         f"duration ({config.duration_s:g} s; set it with --duration)")
    if args.ride_client is None:
        raise UsageError("--restart-at needs the product's client (sakura.serve_ride_cli)")
    result = run_ride_through(config, args.ride_client)
    write_json(args.json, result)
    restart = result["restart"]
    print(f"sakura bench serve: ride-through, {result['clients']} clients, "
          f"{result['requests_per_s']:.0f} fetches/s, p99 {result['p99_ms']:.1f} ms "
          f"(max {result['max_ms']:.0f} ms), restart at {restart.get('at_s', 0):.1f} s "
          f"down {restart.get('down_s', 0):.2f} s, "
          f"{result['errors_after_ride_through']} errors after ride-through, "
          f"{result['wrong_bytes']} wrong bytes")
    if result["errors_after_ride_through"] or result["wrong_bytes"]:
        print(f"sakura bench serve: {result['first_error'] or 'wrong bytes returned'}",
              file=sys.stderr)
        return 1
    return 0
