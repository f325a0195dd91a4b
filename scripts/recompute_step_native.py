"""The recompute step's cost on the native runtime: a template pass against a full step.

For each tail template, the per-step time (median of 7 20-step runs after one warm-up,
XNNPACK, one thread) of the full graphs (``local``'s step, batch 2 with guidance) and of
the template-pass graphs (``NativeEngine.graphs(..., emit_kv=True)``: one batch row, every
token pinned to the template trajectory). A recompute step costs a template pass plus a
cached step. Prints one line per template (the figures in ``edge/README.md``).

    .venv/bin/python scripts/recompute_step_native.py
"""

from __future__ import annotations

import sys
from pathlib import Path

from sakura.dit.bench_kv import median_time
from sakura.dit.editing import EditRequest, Geometry
from sakura.dit.weights import DEFAULT_WEIGHTS
from sakura.edge.native_runtime import NativeEngine, step_groups

from sakura.digest import file_sha256

sys.path.insert(0, str(Path(__file__).parent))
from stale_reuse import TEMPLATES, shipped  # noqa: E402


def main() -> None:
    model, rt, specs = shipped()
    eng = NativeEngine(model, file_sha256(DEFAULT_WEIGHTS))
    groups = step_groups(model.cfg.num_blocks, model.cfg.num_blocks)
    for tid in TEMPLATES:
        spec = specs[tid]
        tpl = spec.to_template(rt.encoder)
        geo = Geometry.of(model, tpl)
        req = rt.request(spec.evaluation_prompts[0], seed=100)
        full_geo = eng.geometry(tpl, geo, req, full=True)
        full, full_in = eng.graphs(full_geo, groups), eng.inputs(tpl, geo, req, full_geo)
        tmpl_geo = eng.template_geometry(geo, req)
        tmpl = eng.graphs(tmpl_geo, groups, emit_kv=True)
        tmpl_in = eng.inputs(tpl, geo, EditRequest(txt=tpl.txt, txt_uncond=None, seed=0),
                             tmpl_geo, pin_all=True)
        full_s = median_time(lambda g=full, i=full_in: eng.native.run_full(g, i), 7)
        tmpl_s = median_time(lambda g=tmpl, i=tmpl_in: eng.native.run_full(g, i), 7)
        print(f"{tid}: full step {full_s / tpl.steps:.4f} s, "
              f"template pass {tmpl_s / tpl.steps:.4f} s", flush=True)


if __name__ == "__main__":
    main()
