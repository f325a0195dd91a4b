"""Developer tool: how much do the first shards at the smallest configuration cost?

Re-decodes the demo's sakura pack with the configurations the demo's allocator chose
(``out/demo/summary.json``), then with the first three shards swapped for better ones, and
prints the edit PSNR over the mask against the exact cache (mean of the template's three
evaluation prompts). Run ``./scripts/demo`` first.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/first_shards_probe.py

``--summary A.json B.json ... --demo-only`` instead prints only the demo's choice of each
summary (e.g. demos run with ``--startup-fraction F --out out/demo-F``), the exact edits
computed once.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from codec.pack import Manifest, PackReader
from codec.provider import PackProvider
from dit.editing import Geometry, cached_edit, exact_edits, region_psnr
from dit.templates import load_catalog
from dit.text import TextEncoder
from dit.weights import load_model

PACK = Path("packs/templates/face-technologist/sakura")
SUMMARY = Path("out/demo/summary.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--summary", nargs="+", type=Path, default=[SUMMARY],
                    help=f"demo summaries (default {SUMMARY})")
    ap.add_argument("--demo-only", action="store_true",
                    help="only the demo's own choice of every summary")
    args = ap.parse_args()
    torch.set_num_threads(1)
    manifest = Manifest.load(PACK / "manifest.json")
    reader = PackReader(PACK / manifest.pack_file)
    demos = {str(p): json.loads(p.read_text())["policies"]["sakura"]["configs"]
             for p in args.summary}
    demo = next(iter(demos.values()))
    model, enc = load_model(), TextEncoder()
    spec = load_catalog()["face-technologist"]
    tpl = spec.to_template(enc)
    reqs = spec.requests(enc, "evaluation")
    exact = exact_edits(model, tpl, reqs)  # once: every variant is compared with these
    geometry = Geometry.of(model, tpl)
    best = [max(s.configs, key=lambda c: c.bytes).id for s in manifest.shards]

    def psnr(choice: list[int]) -> float:
        vals = [region_psnr(cached_edit(model, tpl, geometry,
                                        PackProvider(manifest, reader, choice), r), ref, tpl.mask)
                for r, ref in zip(reqs, exact)]
        return sum(vals) / len(vals)

    if args.demo_only or len(demos) > 1:
        for name, choice in demos.items():
            print(f"{name}: demo's choice {choice[:4]}...: {psnr(choice):.2f} dB", flush=True)
        return
    variants = {"demo's choice": demo,
                "demo's, first 3 shards at the largest configuration": best[:3] + demo[3:],
                "demo's, first 3 shards at configuration 10": [10, 10, 10] + demo[3:],
                "demo's first 3, the rest at the largest": demo[:3] + best[3:],
                "all at the largest": best}
    for name, choice in variants.items():
        print(f"{name}: {psnr(choice):.2f} dB", flush=True)


if __name__ == "__main__":
    main()
