"""`sakura bench codec`: every codec at about 5x, 15x and 50x versus FP16 on template caches.

For each template and codec the cache is written to a real pack (honest bytes: what the
codec stores to serve all its budgets), then for each target ratio every shard gets the
best profiled configuration within ``fp16 shard bytes / ratio`` (what the allocator does
at a constant rate; a codec that has no configuration small enough for some shard cannot
meet that budget: ``null``). The chosen configurations are decoded and measured: bytes,
importance-weighted KV reconstruction error, and, when a model is available, PSNR/SSIM of
edits on the template's evaluation requests against ``exact`` (the same edits with the
FP16 cache). ``reconstruct_gbps`` is the decode throughput of ``sakura`` (FP16-equivalent
bytes reconstructed per second, one thread). On model caches ``sakura`` is built as the
builder builds it with a model: q chosen per shard on the output PSNR of the template's
profiling requests (``codec.lowrank.OUTPUT_Q_CHOICE``; explicit options win).

Cache sources: the default model's catalog templates (needs ``dit`` and trained weights),
saved caches (``--cache FILE.safetensors`` from ``TemplateCache.state_dict()``, KV metrics
only), or seeded synthetic caches (``--synthetic``, ``dit.synthetic``; KV metrics only).

Why here, in the app layer: the bench runs the model (``dit``: template runs, importance,
edits, the model's RoPE) to score the codecs (``codec``) by edit PSNR, and ``codec`` and
``dit`` import nothing of each other, so it sits above both. ``sakura/`` is where the
benches that span several packages live (``origins_bench.py``, ``faults_bench.py``); the
other place above both, ``cloud/``, is the serving side (the builder, the server, the
render engine), which this bench neither uses nor measures. The command and its argument
checks are in the light ``sakura/codec_bench_cli.py``; this module imports torch and the
model code, and loads only when the bench runs.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from sakura.codec.base import get_codec
from sakura.codec.errors import CodecError
from sakura.codec.lowrank import OUTPUT_Q_CHOICE
from sakura.codec.metrics import err_to_db, weighted_rel_error
from sakura.codec.pack import PackReader, write_pack
from sakura.codec.profile import select_for_ratio
from sakura.codec.provider import DecodedProvider
from sakura.codec.shards import ShardLayout, shard_data
from sakura.dit.cache import TemplateCache
from sakura.dit.editing import cached_edit, profile_importance, region_psnr, template_run
from sakura.dit.rope import rope_option
from sakura.dit.synthetic import synthetic_cache
from sakura.dit.templates import load_catalog
from sakura.dit.text import TextEncoder
from sakura.dit.weights import load_model

RATIOS = (5, 15, 50)
CODEC_ORDER = ("fp16", "intq", "cachegen", "svd", "sakura")
LOWRANK = ("svd", "sakura")
VARIANTS = ("norope",)  # "sakura@norope": the low-rank codec without the RoPE frame

EditFn = Callable[[Any], list[torch.Tensor]]
"""Runs the evaluation requests with a ``KVProvider``; returns images ``[3, H, W]`` in [-1, 1]."""


@dataclass
class BenchTemplate:
    template_id: str
    cache: TemplateCache
    edit: EditFn | None = None
    region: torch.Tensor | None = None
    """Pixel mask ``[H, W]`` of the edited region (PSNR is measured there)."""
    model: dict[str, Any] | None = None
    rope: dict[str, Any] | None = None
    """The model's RoPE for the low-rank codecs (``dit.rope.rope_option``)."""
    measure: Callable[[Any], Any] | None = None
    """``measure(layout)``: the builder's output-PSNR measure on the template's profiling
    requests (``cloud.psnr_profile.OutputPSNR``, one shard changed), what a low-rank codec
    with ``q_front="output"`` chooses its per-shard q on (never the evaluation requests)."""


# ------------------------------------------------------------------------------ sources
def file_templates(paths: list[str]) -> list[BenchTemplate]:
    out = []
    for p in paths:
        try:
            state = load_file(p)
        except (OSError, ValueError, RuntimeError) as exc:  # safetensors raises these
            raise CodecError(f"cannot read cache {p}: {exc}") from None
        try:
            cache = TemplateCache.from_state_dict(state)
        except KeyError as exc:
            raise CodecError(f"{p} is not a TemplateCache state dict (missing {exc})") from None
        tid = re.sub(r"[^a-z0-9_-]+", "-", Path(p).stem.lower()).strip("-_")[:40] or "cache"
        out.append(BenchTemplate(template_id=tid, cache=cache))
    return out


def synthetic_templates(quick: bool) -> list[BenchTemplate]:
    n = 1 if quick else 3
    return [
        BenchTemplate(
            template_id=f"synthetic-{i}",
            cache=synthetic_cache(steps=4 if quick else 8, blocks=4, grid=16, channels=96,
                                  heads=4, seed=i),
        )
        for i in range(n)
    ]


def model_templates(
    quick: bool, weights: str | None = None, template_ids: list[str] | None = None,
    steps: int | None = None, edit_requests: str = "evaluation",
    measure_requests: int | None = None,
) -> list[BenchTemplate]:
    """Capture caches of catalog templates with the default model (importance profiled on
    the profiling requests; edits run on the evaluation requests, or with
    ``edit_requests="profiling"`` on the profiling ones: what a builder can measure, for
    probes of how well that tracks the evaluation). ``measure_requests``: how many of the
    profiling requests the output-PSNR measure edits (None: all of them, as the builder's
    q choice)."""
    model = load_model(weights)
    enc = TextEncoder()
    catalog = load_catalog()
    if template_ids:
        unknown = [t for t in template_ids if t not in catalog]
        if unknown:
            raise CodecError(f"unknown templates {unknown}; known: {sorted(catalog)}")
        ids = template_ids
    else:
        by_workload: dict[str, str] = {}
        for tid, spec in catalog.items():
            by_workload.setdefault(spec.workload, tid)
        ids = list(by_workload.values())[: 1 if quick else 3]
    out = []
    for tid in ids:
        spec = catalog[tid]
        tpl = spec.to_template(enc)
        if steps or quick:
            tpl = replace(tpl, steps=steps or 6)
        run = template_run(model, tpl)
        profiling = spec.requests(enc, "profiling")[: 1 if quick else None]
        profile_importance(model, tpl, run, profiling)
        reqs = (spec.requests(enc, "evaluation")[: 2 if quick else None]
                if edit_requests == "evaluation" else profiling)
        geo = run.geometry

        def edit(provider, tpl=tpl, geo=geo, reqs=reqs) -> list[torch.Tensor]:
            return [cached_edit(model, tpl, geo, provider, r) for r in reqs]

        p = model.cfg.patch_size
        grid = tpl.size // p
        tok = torch.zeros(grid * grid)
        tok[geo.masked] = 1
        region = F.interpolate(tok.view(1, 1, grid, grid), scale_factor=p)[0, 0] > 0
        rope = rope_option(geo.pos[geo.unmasked], model.cfg.rope_axes, model.cfg.rope_theta,
                           model.cfg.num_heads)
        meta = {"weights": str(weights or "default"), "steps": tpl.steps,
                "config": model.cfg.to_dict(), "train_step": getattr(model, "weights_meta", {}).get("train_step")}
        out.append(BenchTemplate(template_id=tid, cache=run.cache, edit=edit, region=region,
                                 model=meta, rope=rope,
                                 measure=_output_measure(
                                     model, tpl, run,
                                     spec.requests(enc, "profiling")[:measure_requests],
                                     spec)))
    return out


def _output_measure(model: Any, tpl: Any, run: Any, profiling: list[Any], spec: Any
                    ) -> Callable[[Any], Any]:
    """``measure(layout)`` for :attr:`BenchTemplate.measure`, built on first use and kept
    per layout (its exact edits are run once)."""
    made: dict[Any, Any] = {}

    def measure(layout: Any) -> Any:
        key = (layout.steps, layout.blocks, layout.blocks_per_shard)
        if key not in made:
            from sakura.cloud.psnr_profile import OutputPSNR  # lazy: torch (model caches only)
            from sakura.dit.adapters.engine import DefaultEngine, Prepared  # lazy: torch

            prep = Prepared(tpl, run.geometry, spec.prompt)
            made[key] = OutputPSNR(DefaultEngine(model), prep, run, profiling, layout)
        return made[key]

    return measure


# ------------------------------------------------------------------------------ metrics
def _ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    from pytorch_msssim import ssim  # needed only when a model's edits are scored

    win = 11 if min(a.shape[-2:]) >= 11 else 3
    return float(ssim((a[None] + 1) / 2, (b[None] + 1) / 2, data_range=1.0, win_size=win))


def _decode_all(manifest, reader, choice, codec) -> tuple[list[list[torch.Tensor]], float]:
    shards, seconds = [], 0.0
    for s, c in zip(manifest.shards, choice):
        data = reader.read_config(s.index, c)
        cfg = s.config(c)
        t0 = time.perf_counter()
        shards.append(codec.decode(cfg.params, data, manifest.spec(s.index)))
        seconds += time.perf_counter() - t0
    return shards, seconds


def _kv_error(cache, layout, shards) -> float:
    errs = []
    for i, mats in enumerate(shards):
        sd = shard_data(cache, layout, i)
        errs.append(weighted_rel_error(sd.matrices, mats, sd.importance))
    return sum(errs) / len(errs)


# ------------------------------------------------------------------------------ bench
def run_codec_bench(
    templates: list[BenchTemplate],
    codecs: dict[str, dict[str, Any]] | None = None,
    ratios: tuple[int, ...] = RATIOS,
    blocks_per_shard: int = 2,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    codecs = codecs or {name: {} for name in CODEC_ORDER}
    per_template: dict[str, Any] = {}
    totals: dict[str, dict[str, float]] = {n: {"fp16": 0, "stored": 0, "pack": 0} for n in codecs}
    acc: dict[str, dict[str, dict[str, list[float]]]] = {
        n: {str(r): {"psnr": [], "ssim": [], "kv_db": [], "bytes": [], "ratio": []}
            for r in ratios} for n in codecs
    }
    unreachable: dict[str, set[str]] = {n: set() for n in codecs}
    used_opts: dict[str, dict[str, Any]] = dict(codecs)  # as run (the builder's additions)
    layout_acc: dict[str, dict[str, Any]] = {}
    dec_bytes, dec_secs = 0, 0.0
    t_start = time.perf_counter()
    load_start = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="sakura-bench-codec-") as tmp:
        for bt in templates:
            cache = bt.cache
            exact = bt.edit(cache.to_fp16_exact()) if bt.edit else None
            rec: dict[str, Any] = {"geometry": [cache.steps, cache.blocks, cache.tokens,
                                                cache.channels], "fp16_bytes": cache.fp16_bytes(),
                                   "codecs": {}}
            for name, opts in codecs.items():
                base, _, variant = name.partition("@")
                if base in LOWRANK and bt.rope is not None and variant != "norope":
                    opts = {**opts, "rope": bt.rope}
                if base == "sakura" and bt.measure is not None:
                    # what the builder does with a model: q per shard on the output front
                    opts = {**OUTPUT_Q_CHOICE, **opts}
                used_opts[name] = {k: v for k, v in opts.items() if k != "rope"}
                codec = get_codec(base, **opts)
                t0 = time.perf_counter()
                if getattr(getattr(codec, "opts", None), "q_front", "kv") == "output" \
                        and bt.measure is not None:
                    codec.q_measure = bt.measure(ShardLayout(cache.steps, cache.blocks,
                                                             blocks_per_shard))
                metas: list[dict[str, Any]] = []
                manifest = write_pack(tmp, f"{bt.template_id}-{name.replace('@', '-')}", cache,
                                      codec, blocks_per_shard=blocks_per_shard, model=bt.model,
                                      shard_meta=metas)
                enc_s = time.perf_counter() - t0
                lay = layout_acc.setdefault(name, {"ranges": 0, "ratios": []})
                lay["ranges"] = max([lay["ranges"]] + [len(c.ranges) for s in manifest.shards
                                                       for c in s.configs])
                lay["ratios"] += [r for meta in metas for r in meta.get("bytes_vs_pareto", [])]
                totals[name]["fp16"] += manifest.fp16_bytes
                totals[name]["stored"] += manifest.stored_bytes
                totals[name]["pack"] += manifest.pack_bytes
                layout = manifest.layout()
                crec: dict[str, Any] = {"stored_bytes": manifest.stored_bytes,
                                        "pack_bytes": manifest.pack_bytes,
                                        "encode_s": round(enc_s, 3), "ratios": {}}
                if any(s.q is not None for s in manifest.shards):  # the per-shard q choice
                    crec["q_chosen"] = [s.q for s in manifest.shards]
                    crec["q_front"] = sorted({m.get("q_front", "kv") for m in metas})
                    if any("q_output_db" in m for m in metas):
                        crec["q_output_db"] = [m.get("q_output_db") for m in metas]
                with PackReader(Path(tmp) / manifest.pack_file) as reader:
                    for r in ratios:
                        choice = select_for_ratio(manifest, r)
                        if choice is None:
                            unreachable[name].add(str(r))
                            crec["ratios"][str(r)] = None
                            continue
                        entry, secs, kv_db = _ratio_entry(bt, manifest, layout, reader,
                                                          choice, codec, exact)
                        if name == "sakura":
                            dec_bytes += manifest.fp16_bytes
                            dec_secs += secs
                        a = acc[name][str(r)]
                        if "psnr_db" in entry:
                            a["psnr"].append(entry["psnr_db"])
                            a["ssim"].append(entry["ssim"])
                        a["kv_db"].append(kv_db)
                        a["bytes"].append(entry["bytes"])
                        a["ratio"].append(entry["ratio"])
                        crec["ratios"][str(r)] = entry
                rec["codecs"][name] = crec
                log(_progress_line(bt.template_id, name, manifest.stored_bytes, enc_s, crec))
            per_template[bt.template_id] = rec

    with_edit = all(bt.edit is not None for bt in templates)
    result: dict[str, Any] = {
        "bench": "codec",
        "psnr_source": "edit_masked_region" if with_edit else "kv_weighted",
        "ratios": [str(r) for r in ratios],
        "templates": [bt.template_id for bt in templates],
        "blocks_per_shard": blocks_per_shard,
        "codec_options": {n: get_codec(n.split("@")[0], **o).options
                          for n, o in used_opts.items()},
        "rope_frame": {n: n.split("@")[0] in LOWRANK and "@norope" not in n
                       and any(bt.rope is not None for bt in templates) for n in codecs},
        "psnr_db": {}, "ssim": {}, "kv_db": {}, "bytes": {}, "achieved_ratio": {},
        "storage_ratio_vs_fp16": {}, "pack_ratio_vs_fp16": {}, "stored_bytes": {},
    }
    for n in codecs:
        _summarize_codec(result, n, ratios, acc[n], unreachable[n], totals[n], with_edit)
    result["reconstruct_gbps"] = round(dec_bytes / dec_secs / 1e9, 4) if dec_secs > 0 else None
    result["layout"] = layout_summary(layout_acc)
    result["per_template"] = per_template
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    # other processes on the machine move timings (encode_s, reconstruct_gbps), not PSNR
    result["load_avg"] = {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]}
    result["threads"] = torch.get_num_threads()
    result["targets"] = check_targets(result)
    return result


def _ratio_entry(bt: BenchTemplate, manifest: Any, layout: Any, reader: Any,
                 choice: list[int], codec: Any, exact: Any
                 ) -> tuple[dict[str, Any], float, float]:
    """One (template, codec, ratio) measurement: the chosen configurations decoded, their
    bytes, KV error, decode time and, with an ``exact`` edit, the edit's PSNR / SSIM over the
    region; returns the entry, the decode seconds and the unrounded KV error (dB)."""
    shards, secs = _decode_all(manifest, reader, choice, codec)
    nbytes = sum(s.config(c).bytes for s, c in zip(manifest.shards, choice))
    kv_db = err_to_db(_kv_error(bt.cache, layout, shards))
    entry = {"bytes": nbytes, "ratio": manifest.fp16_bytes / nbytes,
             "kv_db": round(kv_db, 3), "decode_s": round(secs, 4)}
    if exact is not None:
        imgs = bt.edit(DecodedProvider(layout, shards))
        psnr = [region_psnr(x, y, bt.region) for x, y in zip(imgs, exact)]
        ssim = [_ssim(x, y) for x, y in zip(imgs, exact)]
        entry["psnr_db"] = round(sum(psnr) / len(psnr), 3)
        entry["ssim"] = round(sum(ssim) / len(ssim), 5)
    return entry, secs, kv_db


def _mean(xs: list[float]) -> float | None:
    return None if not xs else round(sum(xs) / len(xs), 4)


def _summarize_codec(result: dict[str, Any], n: str, ratios: tuple[int, ...],
                     acc: dict[str, dict[str, list[float]]], unreachable: set[str],
                     totals: dict[str, float], with_edit: bool) -> None:
    """One codec's means per ratio (None where no configuration reaches the ratio) and its
    storage totals, into ``result``."""
    for key in ("psnr_db", "ssim", "kv_db", "bytes", "achieved_ratio"):
        result[key][n] = {}
    for r in ratios:
        a = acc[str(r)]
        reach = str(r) not in unreachable
        psnr = a["psnr"] if with_edit else a["kv_db"]
        result["psnr_db"][n][str(r)] = _mean(psnr) if reach else None
        result["ssim"][n][str(r)] = _mean(a["ssim"]) if reach and with_edit else None
        result["kv_db"][n][str(r)] = _mean(a["kv_db"]) if reach else None
        result["bytes"][n][str(r)] = int(sum(a["bytes"])) if reach else None
        result["achieved_ratio"][n][str(r)] = _mean(a["ratio"]) if reach else None
    result["storage_ratio_vs_fp16"][n] = round(totals["fp16"] / totals["stored"], 4)
    result["pack_ratio_vs_fp16"][n] = round(totals["fp16"] / totals["pack"], 4)
    result["stored_bytes"][n] = int(totals["stored"])


def _progress_line(template_id: str, name: str, stored: int, enc_s: float,
                   crec: dict[str, Any]) -> str:
    return (f"{template_id} {name}: stored {stored} B, encode {enc_s:.1f}s, " + ", ".join(
        f"{r}x: " + ("n/a" if e is None else
                     f"{e['ratio']:.1f}x kv {e['kv_db']:.1f} dB"
                     + (f" psnr {e['psnr_db']:.1f}" if "psnr_db" in e else ""))
        for r, e in crec["ratios"].items()))


def layout_summary(acc: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``layout``: ranges per configuration (max over every codec's table; 1 = any origin
    serves every configuration with one single-range GET) and ``bytes_vs_pareto``: for the
    low-rank codecs, the bytes the embedded stream's shortest prefix needs to reach each
    format-1 Pareto configuration's weighted error over that configuration's bytes
    (``codec.lowrank``; ``None`` entries: the stream never reaches that error)."""

    def stats(ratios: list[float | None]) -> dict[str, Any] | None:
        vals = sorted(r for r in ratios if r is not None)
        if not vals:
            return None
        mid = len(vals) // 2
        median = vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
        return {"median": round(median, 4), "max": round(vals[-1], 4),
                "mean": round(sum(vals) / len(vals), 4), "configs": len(ratios),
                "unreached": sum(r is None for r in ratios)}

    by_codec = {n: stats(a["ratios"]) for n, a in acc.items() if a["ratios"]}
    main = by_codec.get("sakura") or next(iter(by_codec.values()), None)
    return {"ranges_per_config": max((a["ranges"] for a in acc.values()), default=0),
            "bytes_vs_pareto": main, "bytes_vs_pareto_by_codec": by_codec}


def check_targets(result: dict[str, Any]) -> dict[str, bool | None]:
    """The published results to beat, evaluated on this run."""
    psnr, storage = result["psnr_db"], result["storage_ratio_vs_fp16"]
    out: dict[str, bool | None] = {}
    if "sakura" in psnr:
        out["sakura_reaches_every_ratio"] = all(v is not None for v in psnr["sakura"].values())
        beats = []
        for base in ("intq", "cachegen"):
            for r, v in psnr.get(base, {}).items():
                s = psnr["sakura"].get(r)
                if v is not None:
                    beats.append(s is not None and s > v)
        out["sakura_psnr_above_intq_cachegen"] = all(beats) if beats else None
    if "sakura" in psnr and "svd" in psnr:
        ok = []
        for r in ("15", "50"):
            s, v = psnr["sakura"].get(r), psnr["svd"].get(r)
            if s is not None and v is not None:
                ok.append(s >= v)
        out["q05_not_worse_than_q0_at_15_50"] = all(ok) if ok else None
        # issue 33 item 3: importance weighting earns its place at every ratio
        gain = [psnr["sakura"].get(r) is not None and psnr["svd"].get(r) is not None
                and psnr["sakura"][r] >= psnr["svd"][r] + 0.5 for r in ("5", "15", "50")
                if r in psnr["sakura"]]
        out["sakura_0_5_db_above_svd_at_5_15_50"] = all(gain) if gain else None
    lay = result.get("layout") or {}
    if lay:
        out["one_range_per_config"] = lay.get("ranges_per_config") == 1
        ratio = lay.get("bytes_vs_pareto")
        out["prefix_layout_median_at_most_1_02"] = (ratio["median"] <= 1.02 if ratio
                                                    else None)
    if "sakura" in storage:
        out["storage_3_06x_below_fp16"] = storage["sakura"] >= 3.06
        others = [storage[b] for b in ("intq", "cachegen") if b in storage]
        out["storage_1_54x_below_intq_cachegen"] = (
            all(storage["sakura"] / o >= 1.54 for o in others) if others else None)
    return out


def main(
    json_path: str,
    quick: bool = False,
    cache_files: list[str] | None = None,
    synthetic: bool = False,
    weights: str | None = None,
    templates: list[str] | None = None,
    steps: int | None = None,
    codecs: list[str] | None = None,
    blocks_per_shard: int = 2,
    verbose: bool = True,
) -> int:
    if cache_files:
        sources = file_templates(cache_files)
    elif synthetic:
        sources = synthetic_templates(quick)
    else:
        sources = model_templates(quick, weights, templates, steps)
    names = codecs or list(CODEC_ORDER)
    if not codecs and not quick and any(bt.rope is not None for bt in sources):
        names.append("sakura@norope")
    unknown = [n for n in names if n.split("@")[0] not in CODEC_ORDER
               or n.partition("@")[2] not in ("", *VARIANTS)]
    if unknown:
        raise CodecError(f"unknown codecs {unknown}")
    log = (lambda s: print(s, flush=True)) if verbose else (lambda s: None)
    result = run_codec_bench(sources, {n: {} for n in names}, blocks_per_shard=blocks_per_shard,
                             log=log)
    result["quick"] = quick
    out = Path(json_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    if verbose:
        for n in names:
            print(f"{n:9s} storage {result['storage_ratio_vs_fp16'][n]:6.2f}x  psnr " + "  ".join(
                f"{r}x: {'n/a' if v is None else f'{v:.2f}'}" for r, v in result["psnr_db"][n].items()))
        print(f"reconstruct_gbps {result['reconstruct_gbps']}  targets {result['targets']}")
    return 0
