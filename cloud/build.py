"""`sakura build`: template catalog -> published, versioned packs (one per codec).

For each template: the template run and importance profiling (``dit``), encoding and
profiling of every codec (``codec``), then an atomic publish (``cloud.publish``): packs and
versioned manifests under new content-addressed names first, ``catalog.json`` last. A
failure anywhere leaves the published catalog exactly as it was; an unchanged template
(same spec, image, mask, weights, codec options and builder version) is skipped.

The catalog entry also carries what the device needs to run an edit of the template and
that is the provider's, not the user's: the template image and mask (PNG, base64), steps,
guidance and resolution (``template`` key). The device needs nothing else from the cloud.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from cloud.publish import (
    CatalogTransaction,
    is_up_to_date,
    sha256_file,
    template_content_hash,
    update_catalog,
)

BUILDER_VERSION = "sakura-build-2"
DEFAULT_CODECS = ("sakura", "svd", "fp16", "intq", "cachegen", "sakura-all")
LOWRANK_CODECS = ("sakura", "svd", "sakura-all")


@dataclass
class BuildConfig:
    catalog: str | None = None  # catalog.json or its folder (default: shipped)
    out_dir: str = "packs"
    codecs: tuple[str, ...] = DEFAULT_CODECS
    templates: tuple[str, ...] = ()  # empty = all
    weights: str | None = None  # default: shipped model
    # 4 of the 8 blocks: ~10-25 ms of masked compute per shard here, so per-request costs
    # (headers, server time) stay small next to the smallest configurations
    blocks_per_shard: int = 4
    resolution: int | None = None  # build at another resolution (ids get a suffix)
    force: bool = False
    codec_options: dict[str, dict] = field(default_factory=dict)


@dataclass
class BuildReport:
    built: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


def shard_compute_cost(model, blocks: list[int]) -> float:
    """Relative compute of a shard: double-stream blocks run two weight sets."""
    return float(sum(2.0 if b < model.cfg.double_blocks else 1.0 for b in blocks))


def build(cfg: BuildConfig, log=print) -> BuildReport:
    import tempfile

    from tqdm import tqdm

    from codec import ShardLayout, get_codec
    from codec.lowrank import rope_option
    from codec.pack import write_pack
    from dit.editing import profile_importance, template_run
    from dit.templates import load_catalog, template_assets, with_resolution
    from dit.text import TextEncoder
    from dit.weights import DEFAULT_WEIGHTS, load_model

    specs = load_catalog(cfg.catalog)
    if cfg.templates:
        unknown = sorted(set(cfg.templates) - set(specs))
        if unknown:
            from cloud.errors import PublishError

            raise PublishError(f"unknown template id(s) {unknown}; the catalog has {sorted(specs)}")
        specs = {k: specs[k] for k in cfg.templates}
    if cfg.resolution:
        specs = {s.id: s for s in (with_resolution(v, cfg.resolution) for v in specs.values())}
    weights = Path(cfg.weights) if cfg.weights else DEFAULT_WEIGHTS
    model = load_model(weights)
    encoder = TextEncoder()
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "catalog.json").exists():
        update_catalog(out, {})
    weights_sha = sha256_file(weights)[0]
    report = BuildReport()
    for tid, spec in tqdm(specs.items(), desc="build", unit="template"):
        content = template_content_hash(
            {
                "spec": {k: v for k, v in spec.meta.items()},
                "resolution": spec.resolution,
                "codecs": list(cfg.codecs),
                "codec_options": cfg.codec_options,
                "blocks_per_shard": cfg.blocks_per_shard,
            },
            [spec.image_path, spec.mask_path, weights],
            salt=BUILDER_VERSION,
        )
        if not cfg.force and is_up_to_date(out, tid, content, codecs=cfg.codecs):
            report.skipped.append(tid)
            continue
        t0 = time.perf_counter()
        template = spec.to_template(encoder)
        run = template_run(model, template)
        profile_importance(model, template, run, spec.requests(encoder, "profiling"))
        bps = min(cfg.blocks_per_shard, run.cache.blocks)
        layout = ShardLayout(run.cache.steps, run.cache.blocks, bps)
        cost = [shard_compute_cost(model, layout.blocks_of(i)[1]) for i in range(layout.num_shards)]
        model_info = {
            "name": "sakura-mmdit",
            "weights_sha256": weights_sha,
            "config": model.cfg.to_dict(),
        }
        with (
            tempfile.TemporaryDirectory(dir=out, prefix=".build-") as tmp,
            CatalogTransaction(out) as txn,
        ):
            rope = rope_option(run.geometry.pos[run.geometry.unmasked], model.cfg.rope_axes,
                               model.cfg.rope_theta, model.cfg.num_heads)
            for name in cfg.codecs:
                options = dict(cfg.codec_options.get(name, {}))
                if name in LOWRANK_CODECS:
                    # keys are factorised in the pre-RoPE frame (codec/README.md)
                    options.setdefault("rope", rope)
                codec = get_codec(name, **options)
                work = Path(tmp) / name
                manifest = write_pack(
                    work,
                    tid,
                    run.cache,
                    codec,
                    blocks_per_shard=bps,
                    model=model_info,
                    compute_cost=cost,
                )
                txn.publish(tid, name, manifest.to_dict(), work / manifest.pack_file)
            txn.set_metadata(
                tid,
                workload=spec.workload,
                resolution=spec.resolution,
                mask_ratio=spec.meta.get("mask_ratio"),
                token_mask_ratio=float(len(run.geometry.masked)) / (len(run.geometry.pos)),
                content_hash=content,
                fp16_bytes=run.cache.fp16_bytes(),
                template=template_assets(spec, template),
            )
        report.built.append(tid)
        report.seconds[tid] = time.perf_counter() - t0
        log(f"built {tid}: {len(cfg.codecs)} codecs in {report.seconds[tid]:.1f}s")
    return report
