"""`sakura bench kv`: the KV-reuse mechanisms of ``dit`` measured side by side in one run.

On the shipped model and a shipped template: masked execution vs full execution (10% and
40% token masks), reference-KV caching with 1 and 3 references vs recomputing them, the
text-KV approximation on/off, and layer-wise offload with and without prefetch vs a fully
resident cache. All times are medians of repeats in this one process (ratios, not absolute
seconds, are what carry across machines).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from sakura.dit.editing import (
    Geometry,
    cached_edit,
    full_edit,
    pinned_reference_edit,
    template_run,
)
from sakura.dit.offload import OffloadedCache
from sakura.dit.templates import load_catalog
from sakura.dit.text import TextEncoder
from sakura.dit.weights import load_model


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def box_mask(size: int, patch: int, ratio: float) -> torch.Tensor:
    """A centred square pixel mask covering about ``ratio`` of the tokens."""
    grid = size // patch
    side = max(1, round((ratio * grid * grid) ** 0.5))
    a = (grid - side) // 2
    m = torch.zeros(size, size, dtype=torch.bool)
    m[a * patch : (a + side) * patch, a * patch : (a + side) * patch] = True
    return m


def run_bench(quick: bool = False, template_id: str = "face-technologist",
              weights: str | None = None) -> dict:
    torch.manual_seed(0)
    model = load_model(weights)
    enc = TextEncoder()
    spec = load_catalog()[template_id]
    steps = 6 if quick else spec.steps
    repeats = 2 if quick else 5
    tpl = replace(spec.to_template(enc), steps=steps)
    req = spec.requests(enc, "evaluation")[0]
    out: dict = {"template": template_id, "steps": steps, "repeats": repeats,
                 "model_blocks": model.cfg.num_blocks, "threads": torch.get_num_threads()}

    # 1) exactness of the cached path against the slow pinned reference
    run = template_run(model, tpl, keep_hidden=True)
    fast = cached_edit(model, tpl, run.geometry, run.cache, req)
    slow = pinned_reference_edit(model, tpl, run, req)
    out["masked_exact_max_abs_err"] = float((fast - slow).abs().max())

    # 2) masked vs full execution at 10% and 40% of the tokens
    for ratio in (0.10, 0.40):
        t = replace(tpl, mask=box_mask(tpl.size, model.cfg.patch_size, ratio))
        r = template_run(model, t)
        masked = median_time(
            lambda t=t, r=r: cached_edit(model, t, r.geometry, r.cache, req), repeats)
        full = median_time(lambda t=t: full_edit(model, t, req), repeats)
        key = f"{int(ratio * 100)}pct"
        out[f"masked_time_s_{key}"] = masked
        out[f"full_time_s_{key}"] = full
        out[f"masked_speedup_{key}"] = full / masked
        out[f"token_ratio_{key}"] = len(r.geometry.masked) / (tpl.size // model.cfg.patch_size) ** 2

    # 3) reference KV caching in generation (every image token computed, as Flux.2-klein KV)
    gen = replace(tpl, mask=torch.ones_like(tpl.mask))
    empty = template_run(model, gen).cache  # zero cached tokens: nothing is unmasked
    catalog = list(load_catalog().values())
    refs = torch.stack([s.load_image() for s in catalog[1:4]])
    geo = Geometry.of(model, gen)
    for n in (1, 3):
        rq = replace(req, ref_images=refs[:n])
        cached = median_time(
            lambda rq=rq: cached_edit(model, gen, geo, empty, rq, cache_refs=True), repeats)
        uncached = median_time(
            lambda rq=rq: cached_edit(model, gen, geo, empty, rq, cache_refs=False), repeats)
        out[f"ref_cache_time_s_{n}ref"] = cached
        out[f"ref_nocache_time_s_{n}ref"] = uncached
        out[f"ref_cache_speedup_{n}ref"] = uncached / cached
        out[f"ref_cache_latency_reduction_{n}ref"] = 1 - cached / uncached

    # 4) text-KV reuse (approximation) on the masked edit
    exact = cached_edit(model, tpl, run.geometry, run.cache, req)
    approx = cached_edit(model, tpl, run.geometry, run.cache, req, reuse_text_kv=True)
    t_on = median_time(lambda: cached_edit(model, tpl, run.geometry, run.cache, req,
                                            reuse_text_kv=True), repeats)
    t_off = median_time(lambda: cached_edit(model, tpl, run.geometry, run.cache, req), repeats)
    mse = float(((exact - approx) / 2).pow(2).mean())
    out["text_kv_reuse_speedup"] = t_off / t_on
    out["text_kv_reuse_psnr_db"] = float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(1 / mse)).item()
    out["text_kv_reuse_max_abs_err"] = float((exact - approx).abs().max())

    # 5) layer-wise offload with / without prefetch vs everything resident
    resident16 = run.cache.to_fp16_exact()
    t_res = median_time(lambda: cached_edit(model, tpl, run.geometry, resident16, req), repeats)
    res = {}
    for prefetch in (False, True):
        with OffloadedCache(run.cache, prefetch=prefetch) as off:
            def once(off=off):
                off.drop_page_cache()
                return cached_edit(model, tpl, run.geometry, off, req)
            res[prefetch] = median_time(once, repeats)
            assert torch.equal(once(), cached_edit(model, tpl, run.geometry, resident16, req))
    out["resident_time_s"] = t_res
    out["offload_no_prefetch_overhead"] = res[False] / t_res
    out["offload_prefetch_overhead"] = res[True] / t_res
    out["cache_fp16_bytes"] = run.cache.fp16_bytes()
    return out


def main(json_path: str | None, quick: bool, template: str) -> int:
    result = run_bench(quick=quick, template_id=template)
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(text + "\n")
    return 0


__all__ = ["run_bench", "main", "box_mask"]
