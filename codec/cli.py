"""`sakura pack inspect`: the codec package's command, and the codec-name check.

``sakura pack inspect TARGET`` takes a ``.pack`` file, a manifest, a folder written by
``write_pack`` or a published catalog folder (what ``sakura build --out`` writes): manifests
are found in the folder and its subfolders (a folder holding a current ``manifest.json``
offers only that one, not the versioned manifests of earlier packs beside it), and
``--template`` / ``--codec`` pick one when there are several. Every unit checksum and the
file hash are verified (``--no-verify`` skips that): a corrupt pack is one error, exit 1.

``sakura bench codec`` runs the model, which ``codec`` does not import: the app layer owns
it (``sakura/codec_bench_cli.py``, ``sakura/codec_bench.py``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from sakura.codec.errors import CodecError, PackError

from sakura.argtypes import json_out
from sakura.errors import UsageError
from sakura.output import write_json

CURRENT_MANIFEST = "manifest.json"  # cloud.layout.MANIFEST_NAME (codec knows nothing of cloud)


def check_codecs(names: list[str] | tuple[str, ...], option: str) -> None:
    """Raise :class:`UsageError` (exit 2) for a codec name that is not registered."""
    from sakura.codec.base import get_codec  # lazy: torch

    if not names:
        raise UsageError(f"{option}: give at least one codec")
    for name in names:
        try:
            get_codec(name)
        except CodecError as exc:
            raise UsageError(f"{option}: {exc}") from None


def find_manifests(folder: Path) -> list[Path]:
    """The manifests a folder offers (see the module docstring), sorted."""
    found: list[Path] = []
    for d in sorted({p.parent for p in folder.rglob("*manifest.json")}):
        current = d / CURRENT_MANIFEST
        found.extend([current] if current.is_file() else sorted(d.glob("*.manifest.json")))
    return found


def _identity(path: Path) -> tuple[str, str]:
    try:
        doc = json.loads(path.read_bytes())
        return str(doc["template_id"]), str(doc["codec"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PackError(f"{path} is not a pack manifest ({exc})") from None


def pick_manifest(folder: Path, template: str | None, codec: str | None) -> Path:
    """The one manifest of ``folder`` matching ``template`` and ``codec`` (:class:`PackError`
    naming the choices otherwise)."""
    candidates = [(p, *_identity(p)) for p in find_manifests(folder)]
    chosen = [c for c in candidates
              if (template is None or c[1] == template) and (codec is None or c[2] == codec)]
    if len(chosen) == 1:
        return chosen[0][0]
    wanted = " ".join(f"{flag} {v}" for flag, v in (("--template", template), ("--codec", codec))
                      if v)
    have = ", ".join(f"{t}/{c}" for _, t, c in candidates) or "none"
    if not chosen:
        raise PackError(f"{folder} holds no pack manifest{' for ' + wanted if wanted else ''} "
                        f"(template/codec found: {have})")
    raise PackError(f"{folder} holds {len(chosen)} pack manifests ({have}); pick one with "
                    "--template ID and --codec NAME")


def _open(target: str, template: str | None, codec: str | None) -> tuple[Any, Any]:
    path = Path(target)
    if not path.exists():
        raise PackError(f"{path}: no such file or folder")
    if path.is_dir():
        path = pick_manifest(path, template, codec)
    from sakura.codec.pack import Manifest, PackReader  # lazy: torch

    if path.name.endswith(".json"):
        manifest = Manifest.load(path)
        return manifest, PackReader(path.parent / manifest.pack_file)
    if path.suffix == ".pack":
        reader = PackReader(path)
        return reader.manifest, reader
    raise PackError(f"{path} is neither a pack, a manifest nor a folder holding packs")


def _inspect(args: argparse.Namespace) -> int:
    manifest, reader = _open(args.target, args.template, args.codec)
    from sakura.codec.profile import rate_quality_curve  # lazy: torch

    with reader:
        if args.json:
            write_json(args.json, json.loads(manifest.to_json()), indent=1)
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
        chosen = [s.q for s in manifest.shards]
        if any(q is not None for q in chosen):  # the builder's per-shard q (issue 33)
            counts: dict[str, int] = {}
            for q in chosen:
                key = "default" if q is None else f"{q:g}"
                counts[key] = counts.get(key, 0) + 1
            front = ("output-PSNR" if manifest.codec_options.get("q_front") == "output"
                     else "weighted-KV")
            print(f"q per shard (chosen from the measured {front} front): "
                  + " ".join("-" if q is None else f"{q:g}" for q in chosen) + "  ("
                  + ", ".join(f"q={k}: {n}" for k, n in sorted(counts.items())) + ")")
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
            print(f"verify: the {len(manifest.units)} unit checksums"
                  f"{' and the file hash' if manifest.pack_sha256 else ''} match")
        else:
            print("verify: skipped (--no-verify): checksums not checked")
    return 0


def register(commands, bench) -> None:
    p = commands.add_parser("pack", help="inspect and verify template packs",
                            description="Inspect and verify template packs.")
    sub = p.add_subparsers(dest="pack_command", metavar="ACTION")
    i = sub.add_parser("inspect", help="geometry, configs and rate-quality of a pack",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    i.add_argument("target", metavar="TARGET",
                   help="a .pack file, a manifest, or a folder holding packs (a published "
                        "catalog such as `sakura build --out`, or a write_pack folder)")
    i.add_argument("--template", metavar="ID", help="template id, when TARGET holds several")
    i.add_argument("--codec", metavar="NAME", help="codec, when TARGET holds several")
    json_out(i, help="also write the manifest JSON here (- for stdout)", required=False)
    i.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="check every unit checksum and the file hash (default; a corrupt "
                        "pack is an error, exit 1); --no-verify only reads the manifest")
    i.set_defaults(func=_inspect)
