"""Developer tool: which outfits can the try-on templates take? (how the prompts were chosen)

    OMP_NUM_THREADS=1 .venv/bin/python scripts/tryon_outfits.py [--out PNG]

For both try-on templates of the shipped catalog, edits the clothing region with the exact
cache at the catalog's strength to each of 16 professions (rows: per template, the edits,
then the professions' own emoji for comparison). `dit/catalog/README.md` says which were
kept and why.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from PIL import Image
from sakura.dit.data import fetch_emoji_package, list_items, load_image
from sakura.dit.editing import EditRequest, exact_edits
from sakura.dit.templates import load_catalog
from sakura.dit.text import TextEncoder
from sakura.dit.weights import load_model

PROFESSIONS = ["student", "judge", "health worker", "office worker", "mechanic", "cook",
               "farmer", "scientist", "pilot", "police officer", "construction worker",
               "guard", "firefighter", "teacher", "factory worker", "singer"]
TRY_ONS = {"tryon-tuxedo": ("man", "medium skin tone"),
           "tryon-farmer": ("woman", "light skin tone")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/tryon-outfits.png", help="output PNG")
    args = ap.parse_args()
    root = fetch_emoji_package()
    items = {it.name: it for it in list_items(root)}
    model, enc = load_model(), TextEncoder()
    catalog = load_catalog()
    uncond = enc.encode([""])
    rows = []
    for tid, (person, tone) in TRY_ONS.items():
        tpl = catalog[tid].to_template(enc)
        names = [f"{person} {p}: {tone}" for p in PROFESSIONS]
        reqs = [EditRequest(enc.encode([f"people & body: {n}"]), uncond, 100 + i)
                for i, n in enumerate(names)]
        emoji = [load_image(root / "img/google/64" / items[n].image_file) for n in names]
        rows.append(torch.cat([tpl.image, *exact_edits(model, tpl, reqs)], dim=2))
        rows.append(torch.cat([tpl.image, *emoji], dim=2))
    grid = torch.cat(rows, dim=1)
    arr = ((grid.permute(1, 2, 0) + 1) * 127.5).clamp(0, 255).byte().numpy()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(out)
    print(out, "columns:", ", ".join(["template", *PROFESSIONS]))


if __name__ == "__main__":
    main()
