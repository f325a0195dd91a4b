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
from sakura.codec.pack import Manifest, PackReader
from sakura.codec.provider import PackProvider
from sakura.dit.editing import Geometry, cached_edit, exact_edits, region_psnr
from sakura.dit.templates import load_catalog
from sakura.dit.text import TextEncoder
from sakura.dit.weights import load_model

PACK = Path("packs/templates/face-technologist/sakura")
SUMMARY = Path("out/demo/summary.json")


class ChoiceQuality:
    """Edit PSNR over the mask against the exact cache of one configuration choice per
    shard of a template's pack (mean of its evaluation prompts; the exact edits once)."""

    def __init__(self, model, template_id: str, pack: Path) -> None:
        self.manifest = Manifest.load(pack / "manifest.json")
        self.reader = PackReader(pack / self.manifest.pack_file)
        enc = TextEncoder()
        spec = load_catalog()[template_id]
        self.model, self.tpl = model, spec.to_template(enc)
        self.reqs = spec.requests(enc, "evaluation")
        self.exact = exact_edits(model, self.tpl, self.reqs)
        self.geometry = Geometry.of(model, self.tpl)

    def largest(self) -> list[int]:
        return [max(s.configs, key=lambda c: c.bytes).id for s in self.manifest.shards]

    def __call__(self, choice: list[int]) -> float:
        provider = PackProvider(self.manifest, self.reader, list(choice))
        vals = [region_psnr(cached_edit(self.model, self.tpl, self.geometry, provider, r),
                            ref, self.tpl.mask) for r, ref in zip(self.reqs, self.exact)]
        return sum(vals) / len(vals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--summary", nargs="+", type=Path, default=[SUMMARY],
                    help=f"demo summaries (default {SUMMARY})")
    ap.add_argument("--demo-only", action="store_true",
                    help="only the demo's own choice of every summary")
    args = ap.parse_args()
    torch.set_num_threads(1)
    demos = {str(p): json.loads(p.read_text())["policies"]["sakura"]["configs"]
             for p in args.summary}
    demo = next(iter(demos.values()))
    psnr = ChoiceQuality(load_model(), "face-technologist", PACK)
    best = psnr.largest()

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
