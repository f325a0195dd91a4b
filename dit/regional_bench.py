"""The quality half of ``sakura bench flashdiff`` (the serving half is
``cloud.render_bench``): FlashDiff regional execution on the default model's evaluation
prompts against full execution, and the two baselines at the same compute.

* ``flashdiff``: regional execution with the given config (joint patch execution);
* ``separate``: the same, every active patch run on its own (the distributable form);
* ``uniform_steps``: full execution with the step count scaled to FlashDiff's compute
  (``round(steps x compute_fraction)``), i.e. uniform step reduction at equal compute;
* ``naive_patches``: the same partition and gate, patches independent (no context);
* ``edit``: regional execution inside the masked region of a cached edit vs the cached
  edit itself (``dit.editing.cached_edit``).

Quality is PSNR (from the mean squared error pooled over prompts) and mean SSIM against
full execution; compute is modelled multiply-accumulates (``compute_fraction``) and
measured single-thread wall time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch
from sakura.dit.editing import cached_edit, template_run
from sakura.dit.regional import RegionalConfig, salient_token_mask
from sakura.dit.regional_mmdit import regional_edit, regional_generate
from sakura.dit.sampler import generate


@dataclass
class _Acc:
    se: float = 0.0
    count: int = 0
    ssim: float = 0.0
    images: int = 0
    skipped: float = 0.0
    compute: float = 0.0
    seconds: float = 0.0

    def add(self, img: torch.Tensor, ref: torch.Tensor, skipped: float = 0.0,
            compute: float = 1.0, seconds: float = 0.0) -> None:
        d = (img.double() - ref.double()) / 2  # images in [-1, 1] -> [0, 1] units
        self.se += float(d.pow(2).sum())
        self.count += d.numel()
        self.ssim += ssim(img, ref)
        self.images += 1
        self.skipped += skipped
        self.compute += compute
        self.seconds += seconds

    def to_dict(self) -> dict:
        n = max(1, self.images)
        mse = self.se / max(1, self.count)
        return {"psnr_db_vs_full": psnr_from_mse(mse), "ssim_vs_full": self.ssim / n,
                "skipped_fraction": self.skipped / n, "compute_fraction": self.compute / n,
                "seconds": self.seconds / n}


def psnr_from_mse(mse: float) -> float:
    return float("inf") if mse <= 0 else 10 * math.log10(1.0 / mse)


def ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """SSIM of two images ``[3, H, W]`` (or ``[1, 3, H, W]``) in [-1, 1]."""
    from skimage.metrics import structural_similarity

    a = a.reshape(-1, *a.shape[-2:]).double().numpy()
    b = b.reshape(-1, *b.shape[-2:]).double().numpy()
    return float(structural_similarity(a, b, channel_axis=0, data_range=2.0))


def eval_prompts(catalog: dict, per_template: int = 1, templates: int | None = None):
    """(template id, prompt, guidance) from the catalog's evaluation prompts."""
    out = []
    for spec in list(catalog.values())[:templates]:
        for p in spec.evaluation_prompts[:per_template]:
            out.append((spec.id, p, spec.guidance))
    return out


def quality_bench(model, encoder, prompts, size: int, steps: int, cfg: RegionalConfig,
                  seed0: int = 100) -> dict:
    """Every system on every prompt against full execution."""
    unc = encoder.encode([""])
    acc = {k: _Acc() for k in ("flashdiff", "separate", "uniform_steps", "naive_patches")}
    per_prompt = []
    for i, (tid, prompt, guidance) in enumerate(prompts):
        seed = seed0 + i
        txt = encoder.encode([prompt])
        sal = salient_token_mask(encoder.tokenizer, prompt, encoder.max_tokens)
        t0 = time.perf_counter()
        full = generate(model, txt, unc, size, seed, steps, guidance)
        t_full = time.perf_counter() - t0
        t0 = time.perf_counter()
        ours, st = regional_generate(model, txt, unc, size, seed, steps, guidance, cfg, sal)
        t_ours = time.perf_counter() - t0
        f = st.stats.compute_fraction
        acc["flashdiff"].add(ours, full, st.stats.skipped_fraction, f, t_ours)
        sep, st_sep = regional_generate(model, txt, unc, size, seed, steps, guidance,
                                        replace(cfg, execution="separate"), sal)
        acc["separate"].add(sep, full, st_sep.stats.skipped_fraction,
                            st_sep.stats.compute_fraction)
        u_steps = max(1, round(steps * f))
        t0 = time.perf_counter()
        uni = generate(model, txt, unc, size, seed, u_steps, guidance)
        acc["uniform_steps"].add(uni, full, 1 - u_steps / steps, u_steps / steps,
                                 time.perf_counter() - t0)
        naive, st_n = regional_generate(model, txt, unc, size, seed, steps, guidance,
                                        replace(cfg, context="none"), sal)
        acc["naive_patches"].add(naive, full, st_n.stats.skipped_fraction,
                                 st_n.stats.compute_fraction)
        per_prompt.append({"template": tid, "prompt": prompt, "patches": st.stats.patches,
                           "patch_sizes": st.stats.patch_sizes,
                           "saliency_explained": st.stats.explained,
                           "skipped_fraction": st.stats.skipped_fraction,
                           "compute_fraction": f, "uniform_steps": u_steps,
                           "full_seconds": t_full, "flashdiff_seconds": t_ours,
                           "psnr_db_vs_full": psnr_from_mse(
                               float(((ours.double() - full.double()) / 2).pow(2).mean())),
                           "uniform_psnr_db_vs_full": psnr_from_mse(
                               float(((uni.double() - full.double()) / 2).pow(2).mean()))})
    out = {k: v.to_dict() for k, v in acc.items()}
    out["full_seconds"] = sum(p["full_seconds"] for p in per_prompt) / max(1, len(per_prompt))
    out["per_prompt"] = per_prompt
    return out


def eps_sweep(model, encoder, prompts, size: int, steps: int, cfg: RegionalConfig,
              eps_values=(0.8, 1.0, 1.2, 1.4), seed0: int = 100) -> list[dict]:
    """Skipped fraction vs quality as the gate threshold moves."""
    unc = encoder.encode([""])
    fulls = []
    for i, (_, prompt, guidance) in enumerate(prompts):
        txt = encoder.encode([prompt])
        fulls.append((txt, guidance, salient_token_mask(encoder.tokenizer, prompt, encoder.max_tokens),
                      generate(model, txt, unc, size, seed0 + i, steps, guidance)))
    rows = []
    for eps in eps_values:
        a = _Acc()
        for i, (txt, guidance, sal, full) in enumerate(fulls):
            img, st = regional_generate(model, txt, unc, size, seed0 + i, steps, guidance,
                                        replace(cfg, eps=eps), sal)
            a.add(img, full, st.stats.skipped_fraction, st.stats.compute_fraction)
        rows.append({"eps": eps, **{k: v for k, v in a.to_dict().items() if k != "seconds"}})
    return rows


def edit_bench(model, encoder, spec, steps: int, cfg: RegionalConfig, requests: int = 1) -> dict:
    """Regional execution inside the masked region of a cached edit vs the cached edit."""
    tpl = replace(spec.to_template(encoder), steps=steps)
    run = template_run(model, tpl)
    a = _Acc()
    reqs = spec.requests(encoder, "evaluation")[:requests]
    for req, prompt in zip(reqs, spec.evaluation_prompts):
        exact = cached_edit(model, tpl, run.geometry, run.cache, req)
        sal = salient_token_mask(encoder.tokenizer, prompt, encoder.max_tokens)
        img, st = regional_edit(model, tpl, run.geometry, run.cache, req, cfg, sal)
        a.add(img, exact, st.stats.skipped_fraction, st.stats.compute_fraction)
    d = a.to_dict()
    return {"template": spec.id, "masked_tokens": len(run.geometry.masked),
            "patches": st.stats.patches, "skipped_fraction": d["skipped_fraction"],
            "compute_fraction": d["compute_fraction"],
            "psnr_db_vs_cached_edit": d["psnr_db_vs_full"], "ssim_vs_cached_edit": d["ssim_vs_full"]}


__all__ = ["edit_bench", "eps_sweep", "eval_prompts", "psnr_from_mse", "quality_bench", "ssim"]
