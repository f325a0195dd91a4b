"""Is a stale step better than the smallest configuration? (issue 28, the tail's p10.)

After the recompute step (``dit.editing.RecomputedKV``) the tail bench's worst sakura edits
sit on streamed configurations: the allocator's smallest configuration (configuration 0) on
early steps during a rate dip. A step can also run on K/V it already holds (``dit.stale``),
for no bytes. This measures both on the shipped model, each against the exact edit: for
every shard of steps 1.., the edit with that one shard at configuration 0 (decoded from
the built ``sakura`` pack) and the edit with that shard's blocks on the previous step's
exact K/V (stale, age 1); and for runs of three consecutive steps (every group), the same
two choices, stale at ages 1-3 from the step before the run. Writes
docs/bench/stale-vs-smallest.json.

    .venv/bin/python scripts/stale_vs_smallest.py PACKS [--json PATH]

``PACKS``: a built packs folder (``sakura build --out PACKS``), its ``main/templates/<id>/
sakura`` pack is read (the tail bench's: ``out/bench-tail/packs``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from sakura.codec.pack import Manifest, PackReader, decode_config
from sakura.dit.editing import cached_edit, region_psnr, template_run

sys.path.insert(0, str(Path(__file__).parent))
from stale_reuse import TEMPLATES, shipped  # noqa: E402


class Mixed:
    """The exact cache, with some shards' blocks replaced: ``override[(step, block)]`` is
    a (K, V) pair, or ``("stale", s')``: step s''s exact K/V."""

    def __init__(self, cache, override):
        self.cache, self.override = cache, override

    def get(self, step, block):
        o = self.override.get((step, block))
        if o is None:
            return self.cache.get(step, block)
        if o[0] == "stale":
            return self.cache.get(o[1], block)
        return o


def one_template(model, rt, spec, folder: Path) -> dict:
    """The shard and run measurements of one template (see the module docstring)."""
    manifest = Manifest.load(folder / "manifest.json")
    reader = PackReader(folder / manifest.pack_file)
    layout = manifest.layout()
    template = spec.to_template(rt.encoder)
    req = rt.request(spec.evaluation_prompts[0], seed=100)
    run = template_run(model, template)
    geo, cache = run.geometry, run.cache
    exact = cached_edit(model, template, geo, cache, req)

    def psnr(override):
        return round(region_psnr(cached_edit(model, template, geo, Mixed(cache, override),
                                             req), exact), 2)

    def smallest(j):
        _step, blocks = layout.blocks_of(j)
        t = decode_config(manifest, j, 0, reader.read_config(j, 0))
        return {b: (t[2 * k], t[2 * k + 1]) for k, b in enumerate(blocks)}

    rows = []
    for j in range(len(manifest.shards)):
        step, blocks = layout.blocks_of(j)
        if step == 0:
            continue
        small = smallest(j)
        rows.append({"shard": j, "step": step,
                     "smallest_bytes": manifest.shard(j).config(0).bytes,
                     "smallest": psnr({(step, b): small[b] for b in blocks}),
                     "stale": psnr({(step, b): ("stale", step - 1) for b in blocks})})
    runs = []
    steps = template.steps
    for first in (1, 3, 6, 10, 15):
        if first + 3 > steps:
            continue
        run_steps = range(first, first + 3)
        small_o, stale_o = {}, {}
        for j in range(len(manifest.shards)):
            step, blocks = layout.blocks_of(j)
            if step in run_steps:
                small = smallest(j)
                for b in blocks:
                    small_o[(step, b)] = small[b]
                    stale_o[(step, b)] = ("stale", first - 1)
        runs.append({"steps": list(run_steps), "smallest": psnr(small_o),
                     "stale": psnr(stale_o)})
    reader.close()
    wins = sum(r["stale"] > r["smallest"] for r in rows)
    return {
        "shards": rows, "runs_of_three": runs,
        "stale_beats_smallest": f"{wins} of {len(rows)}",
        "mean_db": {k: round(statistics.fmean(r[k] for r in rows), 2)
                    for k in ("smallest", "stale")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packs")
    ap.add_argument("--json", default="docs/bench/stale-vs-smallest.json")
    args = ap.parse_args()
    model, rt, specs = shipped()
    out: dict = {"reference": "the exact edit (the template run's K/V)", "templates": {},
                 "model": "the shipped MMDiT (dit/weights)", "packs": "sakura"}
    t0 = time.monotonic()
    for tid in TEMPLATES:
        folder = Path(args.packs) / "main" / "templates" / tid / "sakura"
        spec = specs[tid]
        out["templates"][tid] = one_template(model, rt, spec, folder)
        print(tid, out["templates"][tid]["stale_beats_smallest"],
              out["templates"][tid]["mean_db"], out["templates"][tid]["runs_of_three"], flush=True)
    out["seconds"] = round(time.monotonic() - t0, 1)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
