"""`sakura bench codec` and `sakura pack inspect|verify`: the codec package's commands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sakura.codec.errors import PackError


def _bench(args: argparse.Namespace) -> int:
    from sakura.codec.bench import main

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


def _open(target: str, template: str | None):
    from sakura.codec.pack import Manifest, PackReader, manifest_path

    path = Path(target)
    if path.is_dir():
        manifests = sorted(path.glob("*.manifest.json"))
        if template:
            manifests = [manifest_path(path, template)]
        if len(manifests) != 1:
            names = ", ".join(m.name.removesuffix(".manifest.json") for m in manifests)
            raise PackError(f"{path} holds {len(manifests)} manifests ({names or 'none'}); "
                            "pick one with --template")
        manifest = Manifest.load(manifests[0])
        return manifest, PackReader(path / manifest.pack_file)
    if path.suffix == ".pack":
        reader = PackReader(path)
        return reader.manifest, reader
    raise PackError(f"{path} is neither a pack directory nor a .pack file")


def _inspect(args: argparse.Namespace) -> int:
    from sakura.codec.profile import rate_quality_curve

    manifest, reader = _open(args.target, args.template)
    with reader:
        if args.json:
            print(manifest.to_json(indent=1))
            return 0
        g = manifest.geometry
        configs = sum(len(s.configs) for s in manifest.shards)
        options = dict(manifest.codec_options)
        if isinstance(options.get("rope"), dict):
            rope = options["rope"]
            options["rope"] = (f"{rope.get('heads')} heads, axes {rope.get('axes')}, theta "
                               f"{rope.get('theta')}, {len(rope.get('positions', []))} positions")
        print(f"template {manifest.template_id}  codec {manifest.codec}  "
              f"options {json.dumps(options)}")
        print(f"pack {reader.path} ({reader.manifest.pack_bytes} bytes)")
        print(f"geometry steps {g['steps']} blocks {g['blocks']} tokens {g['tokens']} "
              f"channels {g['channels']} heads {g['heads']} blocks/shard {g['blocks_per_shard']}")
        print(f"shards {len(manifest.shards)}  units {len(manifest.units)}  configs {configs}")
        print(f"fp16 {manifest.fp16_bytes} B  stored {manifest.stored_bytes} B  "
              f"({manifest.fp16_bytes / max(manifest.stored_bytes, 1):.2f}x below FP16)")
        s0 = manifest.shards[0]
        print(f"shard 0 ({len(s0.configs)} configs; * = Pareto):")
        for c in s0.configs:
            q = c.quality
            psnr = "" if q.get("psnr_db") is None else f" psnr {q['psnr_db']:.2f} dB"
            print(f"  {'*' if c.pareto else ' '} id {c.id:3d} {json.dumps(c.params):48s} "
                  f"{c.bytes:9d} B {len(c.ranges)} range(s) kv {q.get('kv_db', 0):6.2f} dB{psnr}")
        print("rate-quality (per-shard best within fp16/ratio):")
        for p in rate_quality_curve(manifest):
            print(f"  {p.ratio:6.1f}x -> {p.bytes:10d} B  {p.quality:6.2f} dB")
        if args.verify:
            reader.verify(manifest.pack_sha256 or None)
            print("verify: every unit checksum and the file hash match")
    return 0


def register(commands, bench) -> None:
    b = bench.add_parser("codec", help="codecs at ~5x/15x/50x vs FP16: bytes, KV error, edit PSNR")
    b.add_argument("--json", required=True, help="write the results here")
    b.add_argument("--quick", action="store_true",
                   help="one template, 6 steps, 1 profiling and 2 evaluation requests (< 60 s)")
    src = b.add_mutually_exclusive_group()
    src.add_argument("--cache", action="append", metavar="FILE",
                     help="a saved TemplateCache (.safetensors); repeatable; KV metrics only")
    src.add_argument("--synthetic", action="store_true",
                     help="seeded synthetic caches instead of the model's (KV metrics only)")
    b.add_argument("--weights", help="model weights (default: the shipped model)")
    b.add_argument("--template", action="append", help="catalog template id; repeatable")
    b.add_argument("--steps", type=int, help="denoising steps (default: the template's)")
    b.add_argument("--codec", action="append", help="codecs to run (default: all)")
    b.add_argument("--blocks-per-shard", type=int, default=2)
    b.add_argument("--silent", action="store_true", help="no progress lines")
    b.set_defaults(func=_bench)

    p = commands.add_parser("pack", help="inspect and verify template packs")
    sub = p.add_subparsers(dest="pack_command", metavar="ACTION")
    p.set_defaults(func=lambda args: (p.print_usage(), 2)[1])
    i = sub.add_parser("inspect", help="geometry, configs and rate-quality of a pack")
    i.add_argument("target", help="a directory written by write_pack, or a .pack file")
    i.add_argument("--template", help="template id when the directory holds several")
    i.add_argument("--json", action="store_true", help="print the manifest")
    i.add_argument("--verify", action="store_true", help="check every checksum")
    i.set_defaults(func=_inspect)
