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

:func:`paper_study` measures each part of the paper's design against what it replaces:
the gate's eps sweep, the gate against a signal-free periodic schedule of the same skipped
fraction (cap only), the Otsu focus/context partition against a uniform grid and the
recursive cuts at equal compute, the drift gate at equal skipped fraction (where each
alternative wins), and what probing costs.

Quality is PSNR (from the mean squared error pooled over prompts) and mean SSIM against
full execution; compute is modelled multiply-accumulates (``compute_fraction``, probes
included) and measured single-thread wall time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch
from sakura.dit.attention import AttentionHook
from sakura.dit.editing import cached_edit, template_run
from sakura.dit.model import TokenBatch
from sakura.dit.regional import (
    DEFAULT_EPS,
    ProbeDone,
    RegionalConfig,
    make_partition,
    salient_token_mask,
)
from sakura.dit.regional_mmdit import generation_backend, regional_edit, regional_generate
from sakura.dit.sampler import generate, noise_like


@dataclass
class ImageAccumulator:
    """Pooled squared error, mean SSIM, skipped and compute fractions of images against
    their references."""

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
                  seed0: int = 100, refs: list | None = None) -> dict:
    """Every system on every prompt against full execution (``refs``: the full runs,
    :func:`references`, computed here when not given)."""
    unc = encoder.encode([""])
    refs = refs or references(model, encoder, prompts, size, steps, seed0)
    acc = {k: ImageAccumulator() for k in ("flashdiff", "separate", "uniform_steps", "naive_patches")}
    per_prompt = []
    for i, (tid, prompt, guidance) in enumerate(prompts):
        r = refs[i]
        seed, txt, sal, full, t_full = r.seed, r.txt, r.salient, r.full, r.full_seconds
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
        a = ImageAccumulator()
        for i, (txt, guidance, sal, full) in enumerate(fulls):
            img, st = regional_generate(model, txt, unc, size, seed0 + i, steps, guidance,
                                        replace(cfg, eps=eps), sal)
            a.add(img, full, st.stats.skipped_fraction, st.stats.compute_fraction)
        rows.append({"eps": eps, **{k: v for k, v in a.to_dict().items() if k != "seconds"}})
    return rows


@dataclass
class Reference:
    """One evaluation prompt with its full-execution image (computed once, shared by
    every study)."""

    template: str
    prompt: str
    guidance: float
    seed: int
    txt: torch.Tensor
    salient: torch.Tensor
    full: torch.Tensor
    full_seconds: float


def references(model, encoder, prompts, size: int, steps: int, seed0: int = 100) -> list[Reference]:
    unc = encoder.encode([""])
    out = []
    for i, (tid, prompt, guidance) in enumerate(prompts):
        txt = encoder.encode([prompt])
        t0 = time.perf_counter()
        full = generate(model, txt, unc, size, seed0 + i, steps, guidance)
        out.append(Reference(tid, prompt, guidance, seed0 + i, txt,
                             salient_token_mask(encoder.tokenizer, prompt, encoder.max_tokens),
                             full, time.perf_counter() - t0))
    return out


def run_config(model, encoder, refs: list[Reference], size: int, steps: int,
               cfg: RegionalConfig, per_prompt_cfg=None) -> dict:
    """Regional generation of every reference prompt with ``cfg`` (``per_prompt_cfg(i,
    cfg)`` may adapt it per prompt) -> pooled PSNR / mean SSIM vs full, skipped and compute
    fractions, the probes' modelled share and measured wall-time share."""
    unc = encoder.encode([""])
    a = ImageAccumulator()
    probe_share = probe_s = total_s = 0.0
    rows = []
    for i, r in enumerate(refs):
        c = per_prompt_cfg(i, cfg) if per_prompt_cfg else cfg
        timer: dict = {}
        t0 = time.perf_counter()
        img, st = regional_generate(model, r.txt, unc, size, r.seed, steps, r.guidance, c,
                                    r.salient, timer=timer)
        dt = time.perf_counter() - t0
        a.add(img, r.full, st.stats.skipped_fraction, st.stats.compute_fraction, dt)
        probe_share += st.stats.probe_fraction
        probe_s += timer.get("probe_s", 0.0)
        total_s += dt
        rows.append({"skipped_fraction": st.stats.skipped_fraction,
                     "compute_fraction": st.stats.compute_fraction,
                     "patches": st.stats.patches, "focus_patches": st.stats.focus_patches,
                     "gated_steps": len(st.stats.active_log),
                     "min_active_patches": st.stats.min_active_patches,
                     "executed_patch_steps": st.stats.executed_patch_steps,
                     "forced_patch_steps": st.stats.forced_patch_steps,
                     "guaranteed_patch_steps": st.stats.guaranteed_patch_steps,
                     "psnr_db_vs_full": psnr_from_mse(
                         float(((img.double() - r.full.double()) / 2).pow(2).mean()))})
    out = a.to_dict()
    out["probe_compute_share"] = probe_share / max(1, len(refs))
    out["probe_time_share"] = probe_s / total_s if total_s else 0.0
    out["per_prompt"] = rows
    return out


def sweep(model, encoder, refs, size: int, steps: int, cfg: RegionalConfig,
          eps_values) -> list[dict]:
    """``cfg`` at every threshold in ``eps_values`` (the ``epsilon_sweep`` rows)."""
    rows = []
    for eps in eps_values:
        d = run_config(model, encoder, refs, size, steps, replace(cfg, eps=eps))
        rows.append({"epsilon": eps, "skipped_fraction": d["skipped_fraction"],
                     "compute_fraction": d["compute_fraction"],
                     "psnr_db_vs_full": d["psnr_db_vs_full"], "ssim_vs_full": d["ssim_vs_full"]})
    return rows


def at(rows: list[dict], key: str, value: float) -> dict:
    """PSNR / SSIM of a sweep linearly interpolated at ``rows[key] == value`` (the
    equal-compute / equal-skip comparisons); ``extrapolated`` when ``value`` is outside
    the sweep's range (then the nearest point's quality)."""
    pts = sorted((r[key], r["psnr_db_vs_full"], r["ssim_vs_full"]) for r in rows)
    xs = [p[0] for p in pts]
    if value <= xs[0] or value >= xs[-1]:
        p = pts[0] if value <= xs[0] else pts[-1]
        return {"psnr_db_vs_full": p[1], "ssim_vs_full": p[2], key: p[0],
                "extrapolated": abs(value - p[0]) > 1e-9}
    for (x0, q0, s0), (x1, q1, s1) in zip(pts, pts[1:]):
        if x0 <= value <= x1:
            w = 0.0 if x1 == x0 else (value - x0) / (x1 - x0)
            return {"psnr_db_vs_full": q0 + w * (q1 - q0), "ssim_vs_full": s0 + w * (s1 - s0),
                    key: value, "extrapolated": False}
    raise AssertionError("unreachable")


def cap_only(model, encoder, refs, size: int, steps: int, cfg: RegionalConfig,
             gated: dict) -> dict:
    """The same partition with a fixed periodic schedule of the same skipped fraction
    as the gated run (``gated["per_prompt"]``, prompt by prompt): the gate's own value is
    the PSNR difference."""
    fr = [min(0.95, r["skipped_fraction"]) for r in gated["per_prompt"]]
    per = run_config(model, encoder, refs, size, steps, replace(cfg, gate="periodic"),
                     lambda i, c: replace(c, skip_fraction=fr[i]))
    keys = ("psnr_db_vs_full", "ssim_vs_full", "skipped_fraction", "compute_fraction")
    return {"gate": {k: gated[k] for k in keys}, "periodic": {k: per[k] for k in keys},
            "gate_minus_periodic_db": gated["psnr_db_vs_full"] - per["psnr_db_vs_full"]}


def probe_timing(model, encoder, ref: Reference, size: int, steps: int, cfg: RegionalConfig,
                 repeats: int = 5) -> dict:
    """Wall time of one probe (fused kernel + reduction) against the same probe with the
    attention matrix materialised, and against a full guided step (the paper's Fig. 13
    question: what does gating cost)."""
    unc = encoder.encode([""])
    be = generation_backend(model, ref.txt, unc, size, ref.guidance)
    n = len(be.coords)
    x = noise_like((1, n, model.cfg.patch_dim), 7)[0]
    parts = list(make_partition(cfg.partition, be.coords, torch.rand(n), cfg.patches).patches)
    t = 0.5

    def clock(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    fused = clock(lambda: be.probe(0, t, x, parts, cfg.probe_depth))
    explicit = clock(lambda: _explicit_probe(be, t, x, parts))
    full = clock(lambda: be.run_full(0, t, x, False, False))
    return {"size": size, "tokens": n, "probe_fused_s": fused, "probe_explicit_s": explicit,
            "full_step_s": full, "probe_vs_full_step": fused / full,
            "explicit_vs_fused": explicit / fused, "repeats": repeats,
            "timing": "best of repeats, one torch thread"}


def _explicit_probe(be, t: float, x: torch.Tensor, parts) -> torch.Tensor:
    """The probe with the attention matrix materialised (the reference the fused kernel
    replaces): block 0, cond branch, then the forward is cut."""
    T = be.text_tokens
    out = {}

    class Explicit(AttentionHook):
        def attend(self, block, q, k, v, layout):
            p = ((q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5).softmax(-1)[0].mean(0)
            out["mass"] = torch.stack([p[T + i][:, T + i].sum() for i in parts])
            raise ProbeDone

    batch = TokenBatch(img=x[None], img_pos=be.pos, txt=be.txt[:1], t=torch.full((1,), t))
    try:
        with torch.no_grad():
            be.model(batch, Explicit("joint"))
    except ProbeDone:
        pass
    return out["mass"]


EPS_SWEEPS = {"paper": (0.05, 0.1, 0.15, 0.2, 0.22, 0.24, 0.3),
              "importance": (0.002, 0.005, 0.01, 0.02, 0.05)}


def gate_summary(cfg: RegionalConfig, run: dict) -> dict:
    """The bench's ``gate`` key from a :func:`run_config` of the default: the rule, the
    fewest patches any gated step ran (over every prompt), and ``forced_fraction`` = the
    share of the gated patch-steps run only because of the K cap."""
    rows = run["per_prompt"]
    executed = sum(r["executed_patch_steps"] for r in rows)
    forced = sum(r["forced_patch_steps"] for r in rows)
    mins = [r["min_active_patches"] for r in rows if r["min_active_patches"] is not None]
    return {"rule": cfg.gate, "epsilon": cfg.threshold, "max_skips": cfg.max_skips,
            "min_active_patches_per_gated_step": min(mins) if mins else None,
            "forced_fraction": forced / executed if executed else 0.0,
            "guaranteed_fraction": (sum(r["guaranteed_patch_steps"] for r in rows) / executed
                                    if executed else 0.0),
            "gated_steps": sum(r["gated_steps"] for r in rows),
            "executed_patch_steps": executed, "forced_patch_steps": forced,
            "skipped_fraction": run["skipped_fraction"],
            "compute_fraction": run["compute_fraction"],
            "psnr_db_vs_full": run["psnr_db_vs_full"]}


def step_reuse_baseline(model, encoder, refs: list[Reference], size: int, steps: int,
                        cfg: RegionalConfig, compute_fraction: float) -> dict:
    """Whole-step velocity reuse at ``compute_fraction``: the warm-up runs, then the whole
    image is one patch on a periodic schedule (a skipped step reuses the last velocity:
    with one patch and nothing stale this *is* the full step or the reused one), no K cap.
    Skipped steps come in whole numbers, so the two skip counts around the target are run
    and the PSNR is interpolated at the target's compute (as the other equal-compute
    comparisons)."""
    w = min(cfg.warmup, steps)
    gated = max(1, steps - w)
    want = (1 - compute_fraction) * steps  # skipped steps at the target compute
    counts = sorted({min(gated, max(0, int(want))), min(gated, max(0, int(want) + 1))})
    rows = []
    for k in counts:
        c = replace(cfg, gate="periodic", partition="grid", patches=1,
                    skip_fraction=min(0.95, k / gated), max_skips=steps)
        d = run_config(model, encoder, refs, size, steps, c)
        rows.append({"skipped_steps": k, "compute_fraction": d["compute_fraction"],
                     "psnr_db_vs_full": d["psnr_db_vs_full"], "ssim_vs_full": d["ssim_vs_full"]})
    eq = at(rows, "compute_fraction", compute_fraction)
    return {"psnr_db_vs_full": eq["psnr_db_vs_full"], "ssim_vs_full": eq["ssim_vs_full"],
            "compute_fraction": compute_fraction, "extrapolated": eq["extrapolated"],
            "runs": rows, "warmup": w,
            "what": "full steps with the previous velocity reused on an evenly spaced "
                    "share of the post-warm-up steps, PSNR interpolated between the two "
                    "whole skip counts around the default's compute fraction (the saliency "
                    "probe of the last warm-up step is counted in their compute)"}


def paper_study(model, encoder, refs: list[Reference], size: int, steps: int,
                cfg: RegionalConfig, eps_values=None,
                drift_eps=(0.6, 0.8, 1.0, 1.4)) -> dict:
    """The bench's ``epsilon_sweep``, ``cap_only``, ``partition_comparison``,
    ``alternatives``, ``gate``, ``gate_alternative``, ``step_reuse_baseline`` and
    ``probe_overhead`` (see the module doc)."""
    out: dict = {}
    eps_values = eps_values or EPS_SWEEPS.get(cfg.gate, EPS_SWEEPS["importance"])
    sweep_rows = sweep(model, encoder, refs, size, steps, cfg, eps_values)
    out["epsilon_sweep"] = sweep_rows
    default = run_config(model, encoder, refs, size, steps, cfg)
    out["default"] = {k: default[k] for k in ("psnr_db_vs_full", "ssim_vs_full",
                                              "skipped_fraction", "compute_fraction")}
    out["default"]["epsilon"] = cfg.threshold
    out["cap_only"] = cap_only(model, encoder, refs, size, steps, cfg, default)
    out["gate"] = gate_summary(cfg, default)
    out["step_reuse_baseline"] = step_reuse_baseline(model, encoder, refs, size, steps, cfg,
                                                     default["compute_fraction"])
    if cfg.gate != "importance":  # the earlier gate, a named alternative: where it wins
        imp = sweep(model, encoder, refs, size, steps, replace(cfg, gate="importance", eps=None),
                    EPS_SWEEPS["importance"])
        rows = []
        for row in sweep_rows:
            i = at(imp, "compute_fraction", row["compute_fraction"])
            rows.append({"epsilon": row["epsilon"], "compute_fraction": row["compute_fraction"],
                         "default_gate_db": row["psnr_db_vs_full"],
                         "importance_gate_db": None if i["extrapolated"] else i["psnr_db_vs_full"]})
        out["gate_alternative"] = {
            "importance_gate_sweep": imp, "at_equal_compute": rows,
            "importance_wins_at": [r["compute_fraction"] for r in rows
                                   if r["importance_gate_db"] is not None
                                   and r["importance_gate_db"] > r["default_gate_db"]],
            "method": "the earlier importance gate swept over eps, PSNR interpolated at each "
                      "default-gate sweep point's compute fraction (None: outside its range)"}
    # partitions at equal compute: the default's own run, the others swept and
    # interpolated at the default's compute (keys by the bench's names)
    target = default["compute_fraction"]
    names = {"otsu": "otsu", "uniform_grid": "grid", "cuts": "cuts"}
    parts = {}
    for name, kind in names.items():
        parts[name] = (sweep_rows if kind == cfg.partition else
                       sweep(model, encoder, refs, size, steps, replace(cfg, partition=kind),
                             eps_values[1:]))
    eq = {name: ({"psnr_db_vs_full": default["psnr_db_vs_full"],
                  "ssim_vs_full": default["ssim_vs_full"], "extrapolated": False}
                 if kind == cfg.partition else
                 at(parts[name], "compute_fraction", target))
          for name, kind in names.items()}
    others = [n for n, k in names.items() if k != cfg.partition]
    out["partition_comparison"] = {
        **{name: eq[name]["psnr_db_vs_full"] for name in names},
        "default": default["psnr_db_vs_full"],
        "default_partition": cfg.partition,
        "compute_fraction": target,
        "ssim": {name: eq[name]["ssim_vs_full"] for name in names},
        "extrapolated": {n: eq[n]["extrapolated"] for n in others},
        "sweeps": {n: parts[n] for n in others},
        "method": f"each other partition swept over eps with the {cfg.gate} gate; PSNR "
                  f"linearly interpolated at the default ({cfg.partition}, eps "
                  f"{cfg.threshold})'s compute fraction",
    }
    drift = sweep(model, encoder, refs, size, steps, replace(cfg, gate="drift", eps=None),
                  drift_eps)
    where = []
    for row in sweep_rows:  # the drift gate at each default-sweep point's skipped fraction
        d = at(drift, "skipped_fraction", row["skipped_fraction"])
        o = at(parts["otsu"], "compute_fraction", row["compute_fraction"])
        g = at(parts["uniform_grid"], "compute_fraction", row["compute_fraction"])
        c = at(parts["cuts"], "compute_fraction", row["compute_fraction"])
        where.append({"epsilon": row["epsilon"], "skipped_fraction": row["skipped_fraction"],
                      "compute_fraction": row["compute_fraction"],
                      "default_gate_db": row["psnr_db_vs_full"],
                      "drift_gate_db": None if d["extrapolated"] else d["psnr_db_vs_full"],
                      "otsu_db": None if o["extrapolated"] else o["psnr_db_vs_full"],
                      "uniform_grid_db": None if g["extrapolated"] else g["psnr_db_vs_full"],
                      "cuts_db": None if c["extrapolated"] else c["psnr_db_vs_full"]})
    out["alternatives"] = {
        "drift_gate_sweep": drift, "drift_gate_default_eps": DEFAULT_EPS["drift"],
        "at_equal_points": where,
        "method": "drift gate interpolated at each default-gate sweep point's skipped "
                  "fraction, the other partitions at its compute fraction (None: outside "
                  "the swept range)",
    }
    timing = probe_timing(model, encoder, refs[0], size, steps, cfg)
    large = probe_timing(model, encoder, refs[0], 2 * size, steps, cfg, repeats=3)
    out["probe_overhead"] = {
        "compute_share": default["probe_compute_share"],
        "time_share": default["probe_time_share"],
        **timing,
        f"at_{2 * size}px": large,
        "what": "compute_share: modelled MACs of the saliency and gate probes over all MACs "
                "of the default runs; time_share: measured wall time of the gate probes "
                "over the regional runs' wall time (single process, one torch thread); "
                "probe_*_s: one probe, fused (indicator values through the fused kernel) "
                "and materialised (softmax(q k^T) computed), against one full guided step",
    }
    return out


def edit_bench(model, encoder, spec, steps: int, cfg: RegionalConfig, requests: int = 1) -> dict:
    """Regional execution inside the masked region of a cached edit vs the cached edit."""
    tpl = replace(spec.to_template(encoder), steps=steps)
    run = template_run(model, tpl)
    a = ImageAccumulator()
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


__all__ = ["EPS_SWEEPS", "Reference", "at", "cap_only", "edit_bench", "eps_sweep", "eval_prompts",
           "gate_summary", "paper_study", "step_reuse_baseline", "probe_timing", "psnr_from_mse", "quality_bench", "references", "run_config",
           "ssim", "sweep"]
