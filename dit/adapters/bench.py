"""`sakura bench adapters`: SAKURA on every diffusers adapter, measured in one run.

Per model (tiny random configs of the real diffusers classes, ``dit.adapters.tiny``
``size="bench"``: a 32x32 token grid, i.e. the token count of a 512x512 image):

* ``exact_max_abs_err`` - cached masked execution vs the slow pinned reference (fp32);
* ``fp16_max_abs_err`` - the same with the cache rounded to FP16 (what ``fp16`` delivers)
  vs the FP32 cache (a property of the model's sensitivity, not an exactness check);
* ``masked_speedup_10pct`` - full execution (``local``) time / cached masked execution time
  at a 10% token mask (median of repeats, same process, same threads);
* FLUX.2: reference-KV caching (1 reference, 32x32) vs the pipeline's own recomputation:
  max abs error of the velocity and the speedup of a denoising step;
  QwenImage 2.1: prefix caching (a 64-token prompt and a 16x16 condition image) vs the
  stock block-causal forward: error and speedup of a step.

Plus the cache geometry (bytes per 512x512 template, FP16) computed for the released
FLUX.2-klein / FLUX.2-dev / SD3.5 / Qwen-Image configs and how our FLUX.2-klein-4B figure
compares with the paper's 1.46 GiB.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from sakura.dit.adapters.errors import UnknownModelError
from sakura.dit.adapters.geometry import paper_comparison, released
from sakura.dit.adapters.hook import AdapterHook
from sakura.dit.adapters.inputs import LatentImage, LatentTemplate
from sakura.dit.adapters.processors import Branch
from sakura.dit.adapters.tiny import (
    KINDS,
    box_mask,
    conditioning,
    tiny_adapter,
    tiny_request,
    tiny_spec,
    tiny_template,
)
from sakura.dit.bench_kv import median_time


def _reference_kv(adapter, spec, repeats: int) -> dict[str, float]:
    from sakura.dit.adapters.flux2 import native_velocity  # lazy: diffusers

    gen = torch.Generator().manual_seed(11)
    n = spec.grid[0] * spec.grid[1]
    x = torch.randn(1, n, adapter.latent_channels, generator=gen)
    refs = [LatentImage(torch.randn(n, adapter.latent_channels, generator=gen), spec.grid)]
    cond = conditioning(spec, 16, gen)
    t = torch.tensor(600.0)
    br = adapter.prepare_branch(cond, refs, cache_refs=True)
    cached = adapter.velocity(x, torch.arange(n), spec.grid, t, br,
                              AdapterHook(heads=adapter.heads, extra=br.extra))
    stock, _ = native_velocity(adapter, x, spec.grid, t, cond, refs)
    plain = Branch(cond, extra=br.extra)
    t_cached = median_time(lambda: adapter.velocity(
        x, torch.arange(n), spec.grid, t, plain, AdapterHook(heads=adapter.heads, extra=br.extra)),
        repeats)
    t_stock = median_time(lambda: native_velocity(adapter, x, spec.grid, t, cond, refs), repeats)
    return {"ref_cache_max_abs_err": float((cached - stock).abs().max()),
            "ref_cache_step_speedup_1ref": t_stock / t_cached, "ref_tokens": n}


def _prefix_kv(adapter, spec, repeats: int) -> dict[str, float]:
    from sakura.dit.adapters.qwenimage21 import native_velocity  # lazy: diffusers

    gen = torch.Generator().manual_seed(12)
    n = spec.grid[0] * spec.grid[1]
    x = torch.randn(1, n, adapter.latent_channels, generator=gen)
    cond = conditioning(spec, 64 + 64, gen, image=(16, 16))
    tpl = LatentTemplate(x[0], spec.grid, torch.zeros(n, dtype=torch.bool), cond, seed=0)
    t = torch.tensor(600.0)
    br = adapter.prepare_branch(cond, template=tpl)
    hook = AdapterHook(heads=adapter.heads, extra=br.extra)
    cached = adapter.velocity(x, torch.arange(n), spec.grid, t, br, hook)
    stock = native_velocity(adapter, x, spec.grid, t, cond)
    t_cached = median_time(lambda: adapter.velocity(
        x, torch.arange(n), spec.grid, t, br, AdapterHook(heads=adapter.heads, extra=br.extra)),
        repeats)
    t_stock = median_time(lambda: native_velocity(adapter, x, spec.grid, t, cond), repeats)
    return {"prefix_cache_max_abs_err": float((cached - stock).abs().max()),
            "prefix_cache_step_speedup": t_stock / t_cached,
            "prefix_tokens": int(cond.embeds.shape[1] - cond.image_slots.sum() + 256)}


def bench_model(kind: str, size: str, steps: int, repeats: int) -> dict[str, Any]:
    adapter = tiny_adapter(kind, size)
    spec = tiny_spec(kind, size)
    tpl = tiny_template(adapter, spec, ratio=0.2, steps=steps)
    req = tiny_request(adapter, spec, refs=0)
    out: dict[str, Any] = {
        "model_class": type(adapter.model).__name__,
        "parameters": sum(p.numel() for p in adapter.model.parameters()),
        "grid": list(spec.grid), "blocks": adapter.num_blocks, "block_names": adapter.block_names,
        "heads": adapter.heads, "head_dim": adapter.head_dim, "steps": steps,
    }
    run = adapter.template_run(tpl, keep_hidden=True)
    fast = adapter.cached_edit(tpl, run.geometry, run.cache, req)
    slow = adapter.pinned_reference_edit(tpl, run, req)
    out["exact_max_abs_err"] = float((fast - slow).abs().max())
    half = adapter.cached_edit(tpl, run.geometry, run.cache.to_fp16_exact(), req)
    out["fp16_max_abs_err"] = float((half - fast).abs().max())
    del run, fast, slow, half

    t10 = replace(tpl, mask=box_mask(spec.grid, 0.10))
    r10 = adapter.template_run(t10)
    masked = median_time(lambda: adapter.cached_edit(t10, r10.geometry, r10.cache, req), repeats)
    full = median_time(lambda: adapter.full_edit(t10, req), repeats)
    out.update({
        "token_ratio_10pct": len(r10.geometry.masked) / r10.geometry.tokens,
        "masked_time_s_10pct": masked, "full_time_s_10pct": full,
        "masked_speedup_10pct": full / masked,
        "cache_fp16_bytes_10pct": r10.cache.fp16_bytes(),
    })
    if kind == "flux2":
        out.update(_reference_kv(adapter, spec, repeats))
    if kind == "qwenimage-2.1":
        out.update(_prefix_kv(adapter, spec, repeats))
    return out


def run_bench(quick: bool = False, kinds: tuple[str, ...] = KINDS) -> dict[str, Any]:
    size = "test" if quick else "bench"
    steps, repeats = (4, 1) if quick else (8, 3)
    result: dict[str, Any] = {
        "config": f"sakura.dit.adapters.tiny size={size!r}: real diffusers classes, random weights",
        "diffusers": __import__("diffusers").__version__, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "steps": steps, "repeats": repeats, "models": {},
    }
    for kind in kinds:
        result["models"][kind] = bench_model(kind, size, steps, repeats)
    geo = released(512)
    result["cache_geometry_512"] = {k: g.to_dict() for k, g in geo.items()}
    result["paper_comparison"] = paper_comparison(geo["flux2-klein-4b"])
    return result


def main(json_path: str | None, quick: bool = False, models: str | None = None) -> int:
    kinds = tuple(m.strip() for m in models.split(",")) if models else KINDS
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise UnknownModelError(f"unknown bench model(s) {unknown}; choose from {list(KINDS)}")
    result = run_bench(quick, kinds)
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(text + "\n")
    return 0


__all__ = ["bench_model", "main", "run_bench"]
