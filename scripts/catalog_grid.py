"""Developer tool: before/after grid of every shipped template, edited with the exact cache.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/catalog_grid.py [--weights FILE] [--out PNG]

Writes docs/model/edits.png: per template (columns), top to bottom: the template; its three
evaluation prompts edited with the uncompressed cache (``exact``) at the catalog's strength;
the first prompt by full local execution (``full``); the first prompt with the exact cache
from pure noise (strength 1), to show what the strength buys.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch
from PIL import Image
from sakura.dit.editing import exact_edits, full_edit
from sakura.dit.templates import load_catalog
from sakura.dit.text import TextEncoder
from sakura.dit.weights import load_model

OUT = Path(__file__).resolve().parents[1] / "docs" / "model" / "edits.png"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", help="model weights (default: the shipped model)")
    ap.add_argument("--out", default=str(OUT), help=f"output PNG (default {OUT})")
    args = ap.parse_args()
    out = Path(args.out)
    model, enc = load_model(args.weights), TextEncoder()
    cols = []
    for spec in load_catalog().values():
        tpl = spec.to_template(enc)
        reqs = spec.requests(enc, "evaluation")
        exact = exact_edits(model, tpl, reqs)
        full = full_edit(model, tpl, reqs[0])
        from_noise = exact_edits(model, replace(tpl, strength=1.0), reqs[:1])[0]
        cols.append(torch.cat([tpl.image, *exact, full, from_noise], dim=1))
    grid = torch.cat(cols, dim=2)
    arr = ((grid.permute(1, 2, 0) + 1) * 127.5).clamp(0, 255).byte().numpy()
    out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).resize((arr.shape[1] * 2, arr.shape[0] * 2), Image.NEAREST).save(out)
    print(out)


if __name__ == "__main__":
    main()
