"""Measure the local fallback's two ways to compute a late step on the shipped model.

A late step (its shards cannot arrive in time) is computed on the device either with every
token (``full``: what ``local`` computes at that step, the old fallback) or as a
**recompute step** (``dit.editing.RecomputedKV``): the template's own K/V of that step
recomputed from public catalog data, then the cached step. The device's template is built
as a device builds it (the published PNG of the template image, the prompt encoded by the
device's text encoder), so float differences against the cloud's template run are in.

For each template of one workload each and each pattern of late steps (those of
``scripts/stale_reuse.py``), PSNR (dB) of the edit against the exact edit, with stale reuse
off (cap 0) and at the default cap; and the time of a full step, a template pass and a
cached step (median of 20, one torch thread). Writes docs/bench/recompute-step.json.

    .venv/bin/python scripts/recompute_step.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from sakura.dit.bench_kv import median_time
from sakura.dit.editing import (
    Geometry,
    RecomputedKV,
    _cfg_batch,
    cached_edit,
    region_psnr,
    template_run,
)
from sakura.dit.stale import STALE_MAX_AGE
from sakura.dit.templates import device_template, template_assets

sys.path.insert(0, str(Path(__file__).parent))
from stale_reuse import TEMPLATES, Late, patterns, shipped  # noqa: E402


def step_costs(model, template, device, geo, exact, req, ts) -> dict[str, float]:
    """Median seconds of a full step, a template pass and a cached step at a mid step."""
    t = ts[len(ts) // 2]
    rec = RecomputedKV(model, device, Geometry.of(model, device))
    xf = rec.trajectory.at(t)

    def full():
        with torch.inference_mode():
            model(_cfg_batch(xf, geo.pos, req, t, template.guidance))

    def template_pass():
        with torch.inference_mode():
            rec.step(0, t)

    def cached():
        cached_edit(model, template, geo, exact, req)

    cached_s = median_time(cached, 5) / template.steps
    out = {"full": round(median_time(full, 20), 4),
           "template_pass": round(median_time(template_pass, 20), 4),
           "cached_edit_per_step": round(cached_s, 4)}
    out["recompute"] = round(out["template_pass"] + cached_s, 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="docs/bench/recompute-step.json")
    args = ap.parse_args()
    model, rt, specs = shipped()
    out: dict = {"reference": "the exact edit (uncompressed template cache, no late step)",
                 "model": "the shipped MMDiT (dit/weights)", "torch_threads": 1,
                 "default_cap": STALE_MAX_AGE, "templates": {}, "step_s": {}}
    t0 = time.monotonic()
    for tid in TEMPLATES:
        spec = specs[tid]
        template = spec.to_template(rt.encoder)
        device = device_template({"template": template_assets(spec, template)})
        device.txt = rt.encoder.encode([device.prompt])
        req = rt.request(spec.evaluation_prompts[0], seed=100)
        run = template_run(model, template)
        geo = run.geometry
        exact = run.cache.to_fp16_exact()
        ref = cached_edit(model, template, geo, exact, req)
        rows = {}
        for name, late in patterns(template.steps).items():
            row = {}
            for way, recompute in (("full", False), ("recompute", True)):
                for cap in (0, STALE_MAX_AGE):
                    img = cached_edit(model, device, geo, Late(exact, late), req,
                                      stale_max_age=cap, recompute=recompute)
                    row[f"{way}_cap{cap}"] = round(region_psnr(img, ref), 2)
            rows[name] = row
            print(tid, name, row, flush=True)
        out["templates"][tid] = rows
        out["step_s"][tid] = step_costs(model, template, device, geo, exact, req,
                                        run.cache.timesteps)
        print(tid, out["step_s"][tid], flush=True)
    cells = [r for t in out["templates"].values() for r in t.values()]
    keys = list(cells[0])
    out["mean_psnr_db"] = {k: round(statistics.fmean(r[k] for r in cells), 2) for k in keys}
    out["min_psnr_db"] = {k: round(min(r[k] for r in cells), 2) for k in keys}
    cap = STALE_MAX_AGE
    out["recompute_minus_full_db"] = {
        f"cap{c}": {"min": round(min(r[f"recompute_cap{c}"] - r[f"full_cap{c}"] for r in cells), 2),
                    "max": round(max(r[f"recompute_cap{c}"] - r[f"full_cap{c}"] for r in cells), 2)}
        for c in (0, cap)}
    out["recompute_over_full_step"] = round(statistics.fmean(
        v["recompute"] / v["full"] for v in out["step_s"].values()), 3)
    out["seconds"] = round(time.monotonic() - t0, 1)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("mean_psnr_db", "min_psnr_db",
                                          "recompute_minus_full_db",
                                          "recompute_over_full_step")}))


if __name__ == "__main__":
    main()
