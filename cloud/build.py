"""`sakura build`: template catalog -> published, versioned packs (one per codec).

For each template: the template run and importance profiling (``dit``), encoding and
profiling of every codec (``codec``), then an atomic publish (``cloud.publish``): packs and
versioned manifests under new content-addressed names first, ``catalog.json`` last. A
failure anywhere leaves the published catalog exactly as it was; an unchanged template
(same spec, image, mask, weights, codec options and builder version) is skipped. With
``publish="s3://bucket/prefix"`` (``--publish``) the catalog is then uploaded to that bucket
in the same commit order (packs and versioned manifests, then manifests, catalog.json last).

The catalog entry also carries what the device needs to run an edit of the template and
that is the provider's, not the user's: the template image and mask (PNG, base64), steps,
guidance, strength and resolution (``template`` key), and, when an exporter is given
(``BuildConfig.bundle_exporter``; ``sakura build`` and ``sakura demo`` give the edge's
unless ``--no-bundle``), the template's device bundle (``bundle`` key, ``cloud.bundle``):
the graphs, text encoder program, vocabulary and tables the device executes, exported here
instead of on the device. The device needs nothing else from the cloud.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from sakura.cloud.bundle import publish_bundle
from sakura.cloud.errors import PublishError
from sakura.cloud.publish import (
    CatalogTransaction,
    build_workdir,
    is_up_to_date,
    publish_catalog,
    read_catalog,
    template_content_hash,
)
from sakura.codec import DEFAULT_BLOCKS_PER_SHARD

from sakura.cachedir import cache_dir as sakura_cache_dir

BUILDER_VERSION = "sakura-build-3"  # 3: sakura's q per shard on the output front (issue 33)
DEFAULT_CODECS = ("sakura", "svd", "fp16", "intq", "cachegen", "sakura-all")
LOWRANK_CODECS = ("sakura", "svd", "sakura-all")


@dataclass
class BuildConfig:
    catalog: str | None = None  # catalog.json or its folder (default: shipped)
    out_dir: str = "packs"
    codecs: tuple[str, ...] = DEFAULT_CODECS
    templates: tuple[str, ...] = ()  # empty = all
    weights: str | None = None  # default: shipped model
    model: str | None = None  # a diffusers model name (dit.adapters.registry.MODELS) ...
    model_path: str | None = None  # ... and its local checkpoint folder
    blocks_per_shard: int = DEFAULT_BLOCKS_PER_SHARD  # (its measurement: sakura.codec)
    resolution: int | None = None  # build at another resolution (ids get a suffix)
    # output PSNR of every configuration on this many profiling requests (0: only the
    # importance-weighted KV error; see cloud/psnr_profile.py for the cost)
    profile_psnr: int = 0
    # a cheap output-PSNR profile by default (codec.profile.FittedPSNR): a few sampled
    # shards measured on this many profiling requests, the rest fitted per step (0: off;
    # profile_psnr > 0 measures every configuration instead); measured values are cached
    # per weights/template/codec in psnr_cache (default $SAKURA_CACHE/psnr or
    # ~/.cache/sakura/psnr) and reused by the next build
    psnr_fit: int = 1
    psnr_cache: str | None = None
    force: bool = False
    codec_options: dict[str, dict] = field(default_factory=dict)
    # after building, upload the published catalog here (s3://bucket/prefix), packs first
    # and catalog.json last (cloud.publish.publish_catalog)
    publish: str | None = None
    # the device bundle (cloud.bundle): what the device executes, exported per template
    # geometry and published beside the packs. The exporter is the edge's
    # (sakura.edge.bundle), handed in by the app layer (sakura.bundle_cli; this package may
    # not import the edge): `sakura build` and `sakura demo` pass it unless --no-bundle;
    # None: no bundle (a library build of packs only). A template whose packs are up to
    # date but whose bundle is missing gets only its bundle.
    bundle_exporter: BundleExporter | None = None
    # build the templates as Ray tasks (--ray): a cluster's head HOST:PORT, "auto" (a
    # cluster started on this machine) or "local" (start Ray here); None: in this process.
    # The driver (this process) publishes, as a local build does (cloud/README.md)
    ray: str | None = None


class BundleExporter(Protocol):
    """What makes a template's device bundle (the edge's: ``sakura.bundle_cli``; the cloud
    may not import the edge)."""

    def export(self, engine: Any, device: Any, blocks_per_shard: int, work: Path
               ) -> tuple[list[tuple[str, str, Path]], dict] | None:
        """(engine, the device's template, blocks per shard, a work folder) -> the
        bundle's files ((name, role, path)) and its description, or None when the engine
        has no device bundle."""

    def is_current(self, bundle: dict) -> bool:
        """Whether a published bundle entry is what :meth:`export` makes now (one it does
        not accept is exported again: :func:`has_bundle`)."""


@dataclass
class BuildReport:
    built: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    published: list[str] = field(default_factory=list)  # keys uploaded by --publish
    bundles: dict[str, str] = field(default_factory=dict)  # template -> published bundle id
    # CPU seconds of the process that built each template, while it did (its Ray worker's
    # with --ray): over ``seconds``, the share of a core the build got
    cpu_seconds: dict[str, float] = field(default_factory=dict)


def build(cfg: BuildConfig, log=print) -> BuildReport:
    """Build the catalog's templates that are not up to date and publish them (module
    docstring); with ``cfg.ray``, Ray is joined (or started) first, so an unreachable
    cluster costs nothing, and left after the build."""
    if not cfg.ray:
        return _build(cfg, log)
    from sakura.cloud.render_ray import _ray, init_ray  # lazy: ray (an optional extra)

    started = init_ray(cfg.ray)
    try:
        return _build(cfg, log)
    finally:
        if started:
            _ray().shutdown()


def _build(cfg: BuildConfig, log) -> BuildReport:
    from sakura.dit.adapters.engine import load_engine  # lazy: torch
    from sakura.dit.weights import DEFAULT_WEIGHTS  # lazy: torch
    from tqdm import tqdm

    specs = _select_templates(cfg)
    if cfg.profile_psnr < 0:
        raise PublishError(f"--profile-psnr must be >= 0 (profiling requests), got "
                           f"{cfg.profile_psnr}")
    if cfg.model is not None and cfg.weights:
        raise PublishError("--weights is the default model's; a --model checkpoint is given "
                           "by --model-path")
    weights = Path(cfg.weights) if cfg.weights else DEFAULT_WEIGHTS
    engine = load_engine(cfg.model, cfg.model_path, weights=weights)
    out = Path(cfg.out_dir)
    # nothing is published before a template is built: a build that fails leaves no
    # catalog.json behind (the transaction below writes it)
    out.mkdir(parents=True, exist_ok=True)
    model_files = [weights] if cfg.model is None else []
    report = BuildReport()
    jobs: list[UnitJob] = []
    for tid, spec in specs.items():
        content = _content_hash(cfg, spec, engine, model_files)
        packs_ok = not cfg.force and is_up_to_date(out, tid, content, codecs=cfg.codecs)
        if packs_ok and (cfg.bundle_exporter is None or has_bundle(
                out, tid, cfg.bundle_exporter.is_current)):
            report.skipped.append(tid)
            continue
        # the device's view of the template (pixels, mask, seed, steps, guidance, prompt):
        # what the engine prepares from and what the catalog entry publishes
        device = spec.to_device_template()
        if packs_ok:  # only the bundle is missing: here, on the driver
            t0 = time.perf_counter()
            with build_workdir(out) as tmp, CatalogTransaction(out) as txn:
                made = _export_bundle(cfg, engine, device, Path(tmp), log, tid)
                bundle = _publish_bundle(out, made, log, tid)
                txn.set_metadata(tid, bundle=bundle)
            if bundle:
                report.bundles[tid] = bundle["id"]
            report.built.append(tid)
            report.seconds[tid] = time.perf_counter() - t0
            continue
        jobs.append(UnitJob(tid, spec, device, content))
    units = (_ray_units(cfg, jobs, out, log) if cfg.ray
             else _local_units(cfg, engine, jobs, out, log))
    # in catalog order, each in its own transaction, whichever way the units were made; the
    # bar only on a terminal (a replay's log file got one empty bar per model and codec set)
    for unit in tqdm(units, desc="build", unit="template", total=len(jobs), disable=None):
        t0 = time.perf_counter()
        bundle_id = _publish_unit(out, unit, log)
        if bundle_id:
            report.bundles[unit.tid] = bundle_id
        report.built.append(unit.tid)
        report.seconds[unit.tid] = unit.seconds + time.perf_counter() - t0
        report.cpu_seconds[unit.tid] = unit.cpu_seconds
        log(f"built {unit.tid}: {len(cfg.codecs)} codecs in {report.seconds[unit.tid]:.1f}s")
    if cfg.publish:
        report.published = publish_catalog(out, cfg.publish)
        log(f"published {len(report.published)} files to {cfg.publish}")
    return report


def _select_templates(cfg: BuildConfig) -> dict[str, Any]:
    """The catalog's templates the build asks for (all when none are named), at the
    build's resolution when it names one."""
    from sakura.dit.templates import load_catalog, with_resolution  # lazy: torch

    specs = load_catalog(cfg.catalog)
    if cfg.templates:
        unknown = sorted(set(cfg.templates) - set(specs))
        if unknown:
            raise PublishError(f"unknown template id(s) {unknown}; the catalog has {sorted(specs)}")
        specs = {k: specs[k] for k in cfg.templates}
    if cfg.resolution:
        specs = {s.id: s for s in (with_resolution(v, cfg.resolution) for v in specs.values())}
    return specs


def _content_hash(cfg: BuildConfig, spec: Any, engine: Any, model_files: list[Path]) -> str:
    """What decides whether a template's packs are up to date: its spec, image, mask,
    weights, codec options and the builder version."""
    return template_content_hash(
        {
            "spec": {k: v for k, v in spec.meta.items()},
            "resolution": spec.resolution,
            "codecs": list(cfg.codecs),
            "codec_options": cfg.codec_options,
            "blocks_per_shard": cfg.blocks_per_shard,
            **({"profile_psnr": cfg.profile_psnr} if cfg.profile_psnr else {}),
            **({"psnr_fit": cfg.psnr_fit, "psnr_fit_version": _fitted_version()}
               if cfg.psnr_fit and not cfg.profile_psnr else {}),
            **({} if cfg.model is None else {"model": cfg.model,
                                             "weights": engine.weights_id}),
        },
        [spec.image_path, spec.mask_path, *model_files],
        salt=BUILDER_VERSION,
    )


@dataclass
class UnitJob:
    """One template to build: the unit of work of a build (its codecs share the template
    run and the importance profile, so they are built together)."""

    tid: str
    spec: Any
    device: Any  # the device's template (dit.editing.Template)
    content: str  # the content hash the catalog entry records


@dataclass
class TemplateUnit:
    """One template built and not yet published: each codec's manifest and pack, the
    catalog entry's metadata and the device bundle's files. Files are paths in a work
    folder, or their bytes while a unit travels from a Ray task to the driver."""

    tid: str
    packs: list[tuple[str, dict, Any]]  # (codec, manifest, pack: Path | bytes)
    metadata: dict[str, Any]
    bundle: tuple[list[tuple[str, str, Any]], dict] | None = None  # ((name, role, file), doc)
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # the building process's, while it built this unit

    def to_bytes(self) -> TemplateUnit:
        """The same unit with its files' bytes in place of their paths."""
        files = self.bundle and ([(n, r, Path(f).read_bytes()) for n, r, f in self.bundle[0]],
                                 self.bundle[1])
        return replace(self, packs=[(c, m, Path(f).read_bytes()) for c, m, f in self.packs],
                       bundle=files)

    def to_files(self, work: Path) -> TemplateUnit:
        """The same unit with its bytes written under ``work`` (the driver's work folder)."""
        def put(rel: str, data: bytes) -> Path:
            path = work / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            return path

        packs = [(c, m, put(f"{c}/{c}.pack", data))
                 for c, m, data in self.packs]
        bundle = self.bundle and ([(n, r, put(f"bundle/{i}-{n}", data))
                                   for i, (n, r, data) in enumerate(self.bundle[0])],
                                  self.bundle[1])
        return replace(self, packs=packs, bundle=bundle)


def build_unit(cfg: BuildConfig, engine: Any, job: UnitJob, work: Path, log) -> TemplateUnit:
    """One template built into ``work`` (published by :func:`_publish_unit`): the template
    run, importance profiling, every codec's pack, the catalog entry's metadata and its
    device bundle. The same function in this process and in a Ray task."""
    from sakura.codec import ShardLayout, get_codec  # lazy: torch
    from sakura.codec.pack import write_pack  # lazy: torch
    from sakura.dit.templates import template_assets  # lazy: torch

    t0, cpu0 = time.perf_counter(), time.process_time()
    tid, spec, device, content = job.tid, job.spec, job.device, job.content
    if cfg.model is not None and device.strength != 1.0:
        # the diffusers adapters edit from pure noise only (dit.adapters.engine)
        log(f"{tid}: strength {device.strength} is the sakura MMDiT's; {cfg.model} "
            "edits start from pure noise (strength 1)")
        device = replace(device, strength=1.0)
    prep = engine.prepare(device.image, device.mask, spec.prompt, spec.seed, spec.steps,
                          spec.guidance, device.strength)
    run = engine.template_run(prep)
    base = 600  # the profiling requests' seeds (dit.templates.TemplateSpec.requests)
    profiling = [engine.request(p, base + i) for i, p in enumerate(spec.profiling_prompts)]
    engine.profile_importance(prep, run, profiling)
    bps = min(cfg.blocks_per_shard, run.cache.blocks)
    layout = ShardLayout(run.cache.steps, run.cache.blocks, bps)
    block_cost = engine.block_costs()
    cost = [float(sum(block_cost[b] for b in layout.blocks_of(i)[1]))
            for i in range(layout.num_shards)]
    model_info = engine.model_info()
    quality_fn = None
    if cfg.profile_psnr or cfg.psnr_fit:
        from sakura.cloud.psnr_profile import OutputPSNR  # lazy: torch

        quality_fn = OutputPSNR(engine, prep, run,
                                profiling[: cfg.profile_psnr or cfg.psnr_fit], layout)
    # sakura's q per shard on the output front (codec.lowrank.OUTPUT_Q_CHOICE): measured on
    # every profiling request, with the shipped model only (it resumes an edit at the
    # changed shard's step; the diffusers engines re-run whole edits: far too slow here)
    # (not when the caller pins q, q_candidates None: its profiling edits would go unused)
    q_measure = None
    pinned = cfg.codec_options.get("sakura", {}).get("q_candidates", ()) is None
    if "sakura" in cfg.codecs and profiling and not pinned and _q_choice_engine(engine):
        from sakura.cloud.psnr_profile import OutputPSNR  # lazy: torch

        q_measure = (quality_fn if quality_fn is not None
                     and len(quality_fn.requests) == len(profiling)
                     else OutputPSNR(engine, prep, run, profiling, layout))
    psnr_stats: dict[str, dict] = {}
    # an engine may fill in its default steps / guidance
    device = replace(device, steps=run.cache.steps, guidance=float(prep.template.guidance))
    rope = engine.rope_option(prep)
    packs = []
    for name in cfg.codecs:
        options = dict(cfg.codec_options.get(name, {}))
        if name in LOWRANK_CODECS and rope is not None:
            # keys are factorised in the pre-RoPE frame (codec/README.md)
            options.setdefault("rope", rope)
        if name == "sakura" and q_measure is not None:
            from sakura.codec.lowrank import OUTPUT_Q_CHOICE  # lazy: torch

            options = {**OUTPUT_Q_CHOICE, **options}
        codec = get_codec(name, **options)
        if getattr(getattr(codec, "opts", None), "q_front", None) == "output":
            codec.q_measure = q_measure
        manifest = write_pack(
            work / name,
            tid,
            run.cache,
            codec,
            blocks_per_shard=bps,
            model=model_info,
            compute_cost=cost,
            quality_fn=_quality_fn(cfg, quality_fn, codec, layout, run.cache, content,
                                   psnr_stats),
            local_psnr_db=quality_fn.local_psnr_db if quality_fn else None,
        )
        packs.append((name, manifest.to_dict(), work / name / manifest.pack_file))
    metadata = dict(
        workload=spec.workload,
        resolution=spec.resolution,
        mask_ratio=spec.meta.get("mask_ratio"),
        token_mask_ratio=prep.token_mask_ratio,
        content_hash=content,
        fp16_bytes=run.cache.fp16_bytes(),
        template=template_assets(spec, device),
        **({"psnr_profile": psnr_stats} if psnr_stats else {}),
    )
    bundle = (_export_bundle(cfg, engine, device, work, log, tid)
              if cfg.bundle_exporter else None)
    return TemplateUnit(tid, packs, metadata, bundle, time.perf_counter() - t0,
                        time.process_time() - cpu0)


def _publish_unit(out: Path, unit: TemplateUnit, log) -> str | None:
    """Publish one built template atomically (packs and bundle files under new names, then
    the catalog in one transaction); the bundle's id."""
    with CatalogTransaction(out) as txn:
        for name, manifest, pack in unit.packs:
            txn.publish(unit.tid, name, manifest, pack)
        txn.set_metadata(
            unit.tid,
            **unit.metadata,
            # None: packs rebuilt without one drop a bundle made for the old ones
            bundle=_publish_bundle(out, unit.bundle, log, unit.tid),
        )
        return (txn.entries[unit.tid].get("bundle") or {}).get("id")


def _local_units(cfg: BuildConfig, engine: Any, jobs: list[UnitJob], out: Path, log):
    """The units built here, one after another; each one's work folder lives until the
    caller has published it (the next one is made when the caller asks for it)."""
    for job in jobs:
        with build_workdir(out) as tmp:
            yield build_unit(cfg, engine, job, Path(tmp), log)


_ENGINES: dict[tuple, Any] = {}  # a Ray worker's engine, loaded by its first task


def _unit_task(cfg: BuildConfig, job: UnitJob) -> tuple:
    """A Ray task: one unit built with one torch thread, in a private work folder, and sent
    back as bytes; ``("ok", unit, notes)`` or ``("error", one line, notes)``."""
    import tempfile

    import torch  # lazy: torch (a Ray worker)
    from sakura.dit.adapters.engine import load_engine  # lazy: torch (a Ray worker)
    from sakura.dit.weights import DEFAULT_WEIGHTS  # lazy: torch (a Ray worker)

    torch.set_num_threads(1)
    notes: list[str] = []
    try:
        weights = Path(cfg.weights) if cfg.weights else DEFAULT_WEIGHTS
        key = (cfg.model, cfg.model_path, str(weights))
        if key not in _ENGINES:
            _ENGINES.clear()
            _ENGINES[key] = load_engine(cfg.model, cfg.model_path, weights=weights)
        with tempfile.TemporaryDirectory(prefix="sakura-build-") as tmp:
            unit = build_unit(cfg, _ENGINES[key], job, Path(tmp), notes.append)
            return ("ok", unit.to_bytes(), notes)
    except Exception as exc:  # noqa: BLE001 - reported by the driver as one line
        text = str(exc).strip().splitlines()
        return ("error", f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": "),
                notes)


def _ray_units(cfg: BuildConfig, jobs: list[UnitJob], out: Path, log):
    """The units as Ray tasks (one CPU and one torch thread each) on the Ray this process
    has joined (:func:`build`), all submitted at once and taken back in catalog order."""
    from sakura.cloud.render_ray import _ray  # lazy: ray (an optional extra)

    ray = _ray()
    # After an error the remaining tasks are left to finish and their results dropped, not
    # cancelled: ray.cancel of a task that completes at that moment aborts the driver in
    # Ray 2.60 ("Check failed: Tried to complete task that was not pending",
    # task_manager.cc; it killed the clean-clone CI's pytest at 1ed7382). A `sakura build`
    # that fails exits, and Ray then stops the job's workers itself.
    task = ray.remote(_unit_task).options(num_cpus=1)
    cfg_ref = ray.put(cfg)
    refs = [task.remote(cfg_ref, job) for job in jobs]
    for job, ref in zip(jobs, refs):
        try:
            status, got, notes = ray.get(ref)
        except ray.exceptions.RayError as exc:  # the task's worker or node died
            raise PublishError(f"template {job.tid}: the Ray task failed "
                               f"({type(exc).__name__}); nothing of it was published"
                               ) from None
        for note in notes:
            log(note)
        if status != "ok":
            raise PublishError(f"template {job.tid}: {got} (in its Ray task; neither it "
                               "nor the templates after it were published)")
        with build_workdir(out) as tmp:
            yield got.to_files(Path(tmp))


def has_bundle(out: Path, template_id: str,
               is_current: Callable[[dict], bool] | None = None) -> bool:
    """Whether the published catalog lists a device bundle for the template whose files
    are all there with their sizes, and which ``is_current`` (the exporter's own check,
    when it has one: ``BundleExporter.is_current``) accepts as what it makes now."""
    try:
        entry = read_catalog(out)["templates"].get(template_id) or {}
    except Exception:  # noqa: BLE001 - an unreadable catalog: build
        return False
    bundle = entry.get("bundle")
    if not isinstance(bundle, dict) or not bundle.get("files"):
        return False
    for f in bundle["files"]:
        path = out / f["key"]
        if not path.is_file() or path.stat().st_size != f["bytes"]:
            return False
    return is_current is None or is_current(bundle)


def _export_bundle(cfg: BuildConfig, engine: Any, device: Any, work: Path, log,
                   template_id: str) -> tuple[list[tuple[str, str, Path]], dict] | None:
    """Export the template's device bundle into ``work/bundle`` (:func:`_publish_bundle`
    publishes it)."""
    assert cfg.bundle_exporter is not None
    made = cfg.bundle_exporter.export(engine, device, cfg.blocks_per_shard, work / "bundle")
    if made is None:
        log(f"{template_id}: no device bundle for {getattr(engine, 'name', 'this model')} "
            "(the native runtime runs the shipped MMDiT)")
    return made


def _publish_bundle(out: Path, made, log, template_id: str) -> dict[str, Any] | None:
    """Publish an exported device bundle's files (the catalog transaction makes the
    returned entry live); None when there is none."""
    if made is None:
        return None
    files, doc = made
    entry = publish_bundle(out, files, doc)
    log(f"{template_id}: device bundle {entry['id']}: {len(files)} files, "
        f"{sum(f['bytes'] for f in entry['files']) / 1e6:.1f} MB")
    return entry


def _q_choice_engine(engine: Any) -> bool:
    """Whether ``engine`` gets sakura's per-shard q choice on the output front (the shipped
    model; ``codec.lowrank.OUTPUT_Q_CHOICE``)."""
    from sakura.dit.adapters.engine import DefaultEngine  # lazy: torch

    return isinstance(engine, DefaultEngine)


def _fitted_version() -> int:
    from sakura.codec.profile import FittedPSNR  # lazy: torch

    return FittedPSNR.VERSION


def _quality_fn(cfg: BuildConfig, measure, codec, layout, cache, content: str,
                stats: dict[str, dict]):
    """The ``quality_fn`` of one codec's pack: every configuration measured
    (``profile_psnr``: FP16 included, which proves the exact reference measures 200 dB),
    the fitted profile (``psnr_fit``, default), or none (FP16 under the fit: one
    configuration per shard has nothing to rank)."""
    import hashlib
    import json

    if measure is None:
        return None
    if cfg.profile_psnr:
        stats[codec.name] = {"mode": "measured", "requests": cfg.profile_psnr}
        return measure
    if codec.name == "fp16":
        return None
    from sakura.codec.profile import FittedPSNR  # lazy: torch

    cache_dir = cfg.psnr_cache or str(sakura_cache_dir("psnr"))
    key = hashlib.sha256(json.dumps([content, codec.name, codec.options, cfg.psnr_fit],
                                    sort_keys=True, default=str).encode()).hexdigest()[:32]
    fitted = FittedPSNR(measure, layout, cache, codec, cache_dir=cache_dir, key=key)
    stats[codec.name] = {"mode": "fitted", "requests": cfg.psnr_fit, **fitted.stats}
    fitted.stats = stats[codec.name]  # the pack writer's calls update the catalog entry
    return fitted
