"""Measure stale reuse (dit/stale.py) against local steps on the shipped model.

For each template of one workload each, and each pattern of late steps, the edit is run on
the exact cache with those steps late: every late step computed with every token (``cap 0``,
the local fallback alone), or run on each block's last K/V when it is at most ``cap`` steps
old (older: locally). PSNR (dB) against the exact edit. Writes docs/bench/stale-reuse.json.

    .venv/bin/python scripts/stale_reuse.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from sakura.dit.cache import StepLate
from sakura.dit.editing import cached_edit, region_psnr, template_run
from sakura.dit.stale import STALE_MAX_AGE
from sakura.dit.templates import load_catalog
from sakura.dit.weights import DEFAULT_WEIGHTS, load_model
from sakura.edge.runtime import EdgeRuntime

TEMPLATES = ("face-technologist", "tryon-tuxedo", "edit-car-top")
"""One template per workload (face swap, try-on, instruction): the late-step measurements'
templates (this script's, ``recompute_step.py``, ``recompute_step_native.py``,
``stale_vs_smallest.py``)."""


def shipped() -> tuple:
    """What those measurements read: the shipped model (one torch thread), a device runtime
    on it, and the template catalog."""
    torch.set_num_threads(1)
    model = load_model(DEFAULT_WEIGHTS)
    return model, EdgeRuntime(model), load_catalog()
CAPS = (0, 1, 2, 3, 4, 6, 20)


def patterns(steps: int) -> dict[str, list[int]]:
    return {"2 early (1-2)": [1, 2], "3 mid (5-7)": [5, 6, 7], "6 mid (6-11)": list(range(6, 12)),
            "10 from 5": list(range(5, 15)), "late half": list(range(steps // 2, steps)),
            "all but the first": list(range(1, steps))}


class Late:
    def __init__(self, cache, late):
        self.cache, self.late = cache, set(late)

    def get(self, step, block):
        if step in self.late:
            raise StepLate(step)
        return self.cache.get(step, block)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="docs/bench/stale-reuse.json")
    args = ap.parse_args()
    model, rt, specs = shipped()
    out: dict = {"caps": list(CAPS), "default_cap": STALE_MAX_AGE, "templates": {},
                 "reference": "the exact edit (uncompressed template cache, no late step)",
                 "model": "the shipped MMDiT (dit/weights)", "torch_threads": 1}
    t0 = time.monotonic()
    for tid in TEMPLATES:
        spec = specs[tid]
        template = spec.to_template(rt.encoder)
        req = rt.request(spec.evaluation_prompts[0], seed=100)
        run = template_run(model, template)
        exact = run.cache.to_fp16_exact()
        ref = cached_edit(model, template, run.geometry, exact, req)
        rows = {}
        for name, late in patterns(template.steps).items():
            rows[name] = {str(c): round(region_psnr(cached_edit(
                model, template, run.geometry, Late(exact, late), req, stale_max_age=c), ref), 2)
                for c in CAPS}
            print(tid, name, rows[name], flush=True)
        out["templates"][tid] = rows
    cells = [r for t in out["templates"].values() for r in t.values()]
    out["mean_psnr_db_by_cap"] = {str(c): round(statistics.fmean(r[str(c)] for r in cells), 2)
                                  for c in CAPS}
    out["default_minus_local_db"] = {
        "min": round(min(r[str(STALE_MAX_AGE)] - r["0"] for r in cells), 2),
        "max": round(max(r[str(STALE_MAX_AGE)] - r["0"] for r in cells), 2)}
    out["seconds"] = round(time.monotonic() - t0, 1)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("mean_psnr_db_by_cap", "default_minus_local_db")}))


if __name__ == "__main__":
    main()
