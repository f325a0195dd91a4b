"""`sakura bench codec`: the command and its argument checks (the bench: ``codec_bench.py``).

The bench scores the codecs with the model, so it belongs to neither ``codec`` nor ``dit``
(which import nothing of each other) and the app layer owns the command. Light: the
argument checks use the packages' ``cli`` modules (no torch); the bench loads when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sakura.argtypes import json_out, positive_int
from sakura.codec.cli import check_codecs
from sakura.codec.errors import PackError
from sakura.dit.cli import check_template


def _bench(args: argparse.Namespace) -> int:
    if args.cache:
        missing = [f for f in args.cache if not Path(f).is_file()]
        if missing:
            raise PackError(f"cannot read cache {missing[0]}: no such file")
    if args.template:
        for template in args.template:
            check_template(template)
    if args.codec:
        check_codecs(args.codec, "--codec")
    from sakura.codec_bench import main  # lazy: torch (and the model code)

    return main(
        args.json,
        quick=args.quick,
        cache_files=args.cache,
        synthetic=args.synthetic,
        weights=args.weights,
        templates=args.template,
        steps=args.steps,
        codecs=args.codec,
        blocks_per_shard=args.blocks_per_shard,
        verbose=not args.silent,
    )


def register(commands: Any, bench: Any) -> None:
    b = bench.add_parser("codec", help="codecs at ~5x/15x/50x vs FP16: bytes, KV error, edit PSNR",
                         description="Every codec at about 5x, 15x and 50x below FP16: bytes, "
                                     "importance-weighted KV error and edit PSNR.")
    json_out(b)
    b.add_argument("--quick", action="store_true",
                   help="one template, 6 steps, 1 profiling and 2 evaluation requests (< 60 s)")
    src = b.add_mutually_exclusive_group()
    src.add_argument("--cache", action="append", metavar="FILE",
                     help="a saved TemplateCache (.safetensors); repeatable; KV metrics only")
    src.add_argument("--synthetic", action="store_true",
                     help="seeded synthetic caches instead of the model's (KV metrics only)")
    b.add_argument("--weights", metavar="FILE", help="model weights (default: the shipped model)")
    b.add_argument("--template", action="append", metavar="ID",
                   help="catalog template id; repeatable (default: every template)")
    b.add_argument("--steps", type=positive_int, metavar="N",
                   help="denoising steps (default: the template's)")
    b.add_argument("--codec", action="append", metavar="NAME",
                   help="a codec to run; repeatable (default: all)")
    b.add_argument("--blocks-per-shard", type=positive_int, default=2, metavar="N",
                   help="blocks per shard (default %(default)s)")
    b.add_argument("--silent", action="store_true", help="no progress lines")
    b.set_defaults(func=_bench)
