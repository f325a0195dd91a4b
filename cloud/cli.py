"""``sakura serve`` and ``sakura bench serve`` (the pack builder's ``sakura build`` comes later).

``sakura serve DIR`` serves a published catalog directory; with ``--s3-bucket`` it serves a
catalog stored in an S3-compatible bucket instead (DIR is then optional and, if given, is
ignored in favour of ``--s3-prefix``). Tokens come from ``--tokens-file`` or the
``SAKURA_TOKENS`` environment variable; without either the API is open.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sakura.cloud.build import DEFAULT_CODECS
from sakura.cloud.errors import ServeConfigError


def register(commands: Any, bench: Any) -> None:
    build = commands.add_parser(
        "build",
        help="build and atomically publish template packs for a catalog",
        description="Template run + importance profiling, encode every codec, publish.",
    )
    build.add_argument("catalog", nargs="?", help="catalog.json or its folder (default: shipped)")
    build.add_argument("--out", default="packs", help="published catalog directory")
    build.add_argument("--codecs", default=",".join(DEFAULT_CODECS), help="comma-separated")
    build.add_argument("--templates", default="", help="comma-separated ids (default: all)")
    build.add_argument("--weights", help="model weights (default: the shipped model)")
    build.add_argument("--model", help="a diffusers model instead of the shipped one, e.g. "
                       "flux2-klein-4b, sd3.5-medium, qwenimage, qwenimage-2.1 (with --model-path)")
    build.add_argument("--model-path", help="the --model's local checkpoint (pipeline folder)")
    build.add_argument("--blocks-per-shard", type=int, default=4)
    build.add_argument("--resolution", type=int, help="build at this resolution (ids get -RES)")
    build.add_argument("--force", action="store_true", help="rebuild unchanged templates too")
    build.add_argument("--profile-psnr", type=int, default=0, metavar="N",
                       help="also profile every configuration's output PSNR against exact on "
                            "N profiling requests (slow: one edit per configuration and "
                            "request; default 0: importance-weighted KV error only)")
    build.set_defaults(func=_build)

    serve = commands.add_parser(
        "serve",
        help="serve a published template catalog over HTTP (FastAPI + uvicorn)",
        description="Serve catalog.json, manifests, packs (HTTP Range) and shard bodies.",
    )
    serve.add_argument("dir", nargs="?", help="published catalog directory (holds catalog.json)")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    serve.add_argument("--tokens-file", help="bearer tokens, one per line: TOKEN [id,id,...]")
    serve.add_argument(
        "--s3-endpoint", help="S3-compatible endpoint URL (e.g. http://127.0.0.1:9000)"
    )
    serve.add_argument("--s3-bucket", help="serve the catalog from this bucket instead of DIR")
    serve.add_argument("--s3-prefix", default="", help="key prefix of the catalog in the bucket")
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    serve.add_argument("--no-access-log", action="store_true", help="do not log every request")
    serve.add_argument("--fd", type=int, help=argparse.SUPPRESS)  # inherited listening socket
    serve.set_defaults(func=_serve)

    bench_serve = bench.add_parser(
        "serve",
        help="concurrent loopback clients fetching shard configs vs a static file server",
        description="Benchmark the shard endpoint against a plain static file server on the same pack.",
    )
    bench_serve.add_argument("--json", required=True, metavar="PATH", help="write the result here")
    bench_serve.add_argument("--quick", action="store_true", help="small pack, 2 s per server")
    bench_serve.add_argument(
        "--clients", type=int, default=32, help="concurrent clients (default 32)"
    )
    bench_serve.add_argument("--duration", type=float, help="seconds of measured load per server")
    bench_serve.set_defaults(func=_bench_serve)


def _build(args: argparse.Namespace) -> int:
    from sakura.cloud.build import BuildConfig, build

    cfg = BuildConfig(
        catalog=args.catalog,
        out_dir=args.out,
        codecs=tuple(c for c in args.codecs.split(",") if c),
        templates=tuple(t for t in args.templates.split(",") if t),
        weights=args.weights,
        model=args.model,
        model_path=args.model_path,
        blocks_per_shard=args.blocks_per_shard,
        resolution=args.resolution,
        force=args.force,
        profile_psnr=args.profile_psnr,
    )
    report = build(cfg)
    print(
        json.dumps(
            {
                "built": report.built,
                "skipped": report.skipped,
                "seconds": {k: round(v, 1) for k, v in report.seconds.items()},
            }
        )
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from sakura.cloud.auth import load_tokens
    from sakura.cloud.runner import run
    from sakura.cloud.server import create_app

    storage = open_serve_storage(args.dir, args.s3_bucket, args.s3_endpoint, args.s3_prefix)
    tokens = load_tokens(args.tokens_file)
    app = create_app(storage, tokens)
    auth = f"bearer auth with {len(tokens)} token(s)" if tokens else "no auth"
    print(f"sakura serve: {storage.describe()}, {auth}", file=sys.stderr)
    run(
        app,
        args.host,
        args.port,
        fd=args.fd,
        log_level=args.log_level,
        access_log=not args.no_access_log,
    )
    return 0


def open_serve_storage(
    directory: str | None, bucket: str | None, endpoint: str | None, prefix: str = ""
) -> Any:
    """The storage ``sakura serve`` reads, checked to hold a catalog.json."""
    from sakura.cloud.errors import StorageError
    from sakura.cloud.layout import CATALOG_KEY
    from sakura.cloud.storage import LocalStorage, S3Storage

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
    return LocalStorage(path)


def _bench_serve(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from sakura.cloud.bench import BenchConfig, run_bench

    if args.clients < 1:
        raise ServeConfigError("--clients must be >= 1")
    config = BenchConfig.quick(args.clients) if args.quick else BenchConfig(clients=args.clients)
    if args.duration is not None:
        if args.duration <= 0:
            raise ServeConfigError("--duration must be > 0")
        config = replace(config, duration_s=args.duration)
    result = run_bench(config)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    keys = ("requests_per_s", "gbytes_per_s", "p99_ms", "errors", "reference_gbytes_per_s")
    print(json.dumps({k: result[k] for k in keys}))
    if result["errors"]:
        print(
            f"sakura bench serve: {result['errors']} errors: {result['first_error']}",
            file=sys.stderr,
        )
        return 1
    return 0
