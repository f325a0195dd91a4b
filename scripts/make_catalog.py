"""Developer tool: derive the default template catalog (dit/catalog/) from the emoji data.

Masks come from the data itself: a face mask is where skin-tone variants of the same emoji
differ (the skin), restricted to the head; a clothing mask is the figure below the head minus
the skin, in whole 4x4 tokens; an object mask is the object's silhouette (or a part of it).
Run once; the output is shipped.
    .venv/bin/python scripts/make_catalog.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sakura.dit.data import fetch_emoji_package, list_items, load_image
from skimage.io import imsave

OUT = Path(__file__).resolve().parents[1] / "dit" / "catalog"
# SDEdit strength per workload (dit.editing.Template.strength): a face swap changes the skin
# tone and needs most freedom; a roof or a car top keeps its layout. Chosen by eye on the
# step-11000 model (dit/catalog/README.md) from 1.0 / 0.9 / 0.8 / 0.7.
STRENGTH = {"face-swap": 0.9, "try-on": 0.8, "instruction": 0.7}


def dilate(m: np.ndarray, r: int) -> np.ndarray:
    t = torch.from_numpy(m.astype(np.float32))[None, None]
    return (F.max_pool2d(t, 2 * r + 1, stride=1, padding=r)[0, 0] > 0).numpy()


def token_ratio(mask: np.ndarray, patch: int = 4) -> float:
    t = torch.from_numpy(mask.astype(np.float32))[None, None]
    return float((F.max_pool2d(t, patch)[0, 0] > 0).float().mean())


def main() -> None:
    root = fetch_emoji_package()
    items = {it.name: it for it in list_items(root)}

    def img(name: str) -> np.ndarray:
        return load_image(root / "img/google/64" / items[name].image_file).numpy()

    def fg(x: np.ndarray) -> np.ndarray:
        return (x < 0.94).any(axis=0)  # not white background

    def skin(base: str) -> np.ndarray:
        a, b = img(f"{base}: light skin tone"), img(f"{base}: dark skin tone")
        return np.abs(a - b).max(axis=0) > 0.15

    specs = []

    def face(tid, base, tone, prompts_prof, prompts_eval, head_rows=0.62, seed=11):
        m = skin(base)
        m[int(64 * head_rows):] = False
        specs.append((tid, "face-swap", f"{base}: {tone}", m, prompts_prof, prompts_eval, seed))

    def body(tid, base, tone, top, prompts_prof, prompts_eval, seed=12):
        # clothing = the figure below ``top`` minus the skin (dilated a pixel), kept per
        # 4x4 token where at least half of it is clothing: a token mask that cuts through
        # the chin or a hand made the model redraw half a face inside the outfit
        name = f"{base}: {tone}"
        m = fg(img(name)) & ~dilate(skin(base), 1)
        m[: int(64 * top)] = False
        t = torch.from_numpy(m.astype(np.float32))[None, None]
        tok = (F.avg_pool2d(t, 4)[0, 0] >= 0.5).numpy()
        m = tok.repeat(4, axis=0).repeat(4, axis=1)
        specs.append((tid, "try-on", name, m, prompts_prof, prompts_eval, seed))

    def obj(tid, name, prompts_prof, prompts_eval, rows=None, seed=13):
        m = fg(img(name))
        if rows:
            m[: int(64 * rows[0])] = False
            m[int(64 * rows[1]):] = False
        m = dilate(m, 1)
        specs.append((tid, "instruction", name, m, prompts_prof, prompts_eval, seed))

    tones = ["light skin tone", "medium-light skin tone", "medium skin tone",
             "medium-dark skin tone", "dark skin tone"]
    face("face-technologist", "man technologist", "light skin tone",
         [f"people & body: man technologist: {t}" for t in tones[1:3]] + ["people & body: woman technologist: medium skin tone"],
         [f"people & body: man technologist: {t}" for t in tones[3:]] + ["people & body: woman technologist: dark skin tone"])
    face("face-cook", "woman cook", "medium-light skin tone",
         [f"people & body: woman cook: {t}" for t in (tones[0], tones[2])] + ["people & body: man cook: medium skin tone"],
         [f"people & body: woman cook: {t}" for t in tones[3:]] + ["people & body: man cook: dark skin tone"])
    face("face-student", "man student", "medium skin tone",
         [f"people & body: man student: {t}" for t in tones[:2]] + ["people & body: woman student: light skin tone"],
         [f"people & body: man student: {t}" for t in tones[3:]] + ["people & body: woman student: dark skin tone"],
         head_rows=0.7)
    # outfits whose emoji are mostly clothing (no laptop, flask or frying pan in the region)
    outfits_prof = ["mechanic", "student", "firefighter"]
    outfits_eval = ["police officer", "construction worker", "guard"]
    body("tryon-tuxedo", "man in tuxedo", "medium skin tone", 0.0,  # outfit and hair/headwear
         [f"people & body: man {o}: medium skin tone" for o in outfits_prof],
         [f"people & body: man {o}: medium skin tone" for o in outfits_eval])
    body("tryon-farmer", "woman farmer", "light skin tone", 0.62,
         [f"people & body: woman {o}: light skin tone" for o in outfits_prof],
         [f"people & body: woman {o}: light skin tone" for o in outfits_eval])
    obj("edit-apple-leaf", "red apple",
        ["food & drink: green apple", "food & drink: peach", "food & drink: tomato"],
        ["food & drink: tangerine", "food & drink: lemon", "food & drink: pear"],
        rows=(0.0, 0.3))
    obj("edit-car-top", "automobile",
        ["travel & places: taxi", "travel & places: police car", "travel & places: bus"],
        ["travel & places: ambulance", "travel & places: fire engine", "travel & places: oncoming automobile"],
        rows=(0.3, 0.45))
    obj("edit-house-roof", "house building",
        ["travel & places: house with garden", "travel & places: office building", "travel & places: school"],
        ["travel & places: hospital", "travel & places: bank", "travel & places: hotel"],
        rows=(0.0, 0.3))

    OUT.mkdir(parents=True, exist_ok=True)
    entries = {}
    for tid, workload, name, mask, prof, ev, seed in specs:
        x = img(name)
        imsave(OUT / f"{tid}.png", ((x.transpose(1, 2, 0) + 1) * 127.5).round().astype(np.uint8),
               check_contrast=False)
        imsave(OUT / f"{tid}-mask.png", (mask * 255).astype(np.uint8), check_contrast=False)
        entries[tid] = {
            "workload": workload, "image": f"{tid}.png", "mask": f"{tid}-mask.png",
            "prompt": f"{items[name].caption}", "seed": seed, "steps": 20, "guidance": 3.0,
            "strength": STRENGTH[workload],
            "resolution": 64, "mask_ratio": round(float(mask.mean()), 4),
            "token_mask_ratio": round(float(token_ratio(mask)), 4),
            "profiling_prompts": prof, "evaluation_prompts": ev,
            "source": {"dataset": "emoji-datasource-google 16.0.0 (Noto Emoji, Apache-2.0)",
                       "image": items[name].image_file},
        }
        print(f"{tid:18s} {workload:12s} mask {mask.mean():.3f}")
    (OUT / "catalog.json").write_text(json.dumps({"version": 1, "templates": entries}, indent=2) + "\n")


if __name__ == "__main__":
    main()
