"""`sakura bench model`: does the shipped model generate what its prompts ask for?

A small CNN is trained on the real emoji images' categories (train split) and checked on
held-out real images; then the model generates images from category prompts ("food &
drink", ...) and the same classifier labels them. ``prompt_accuracy_generated`` well above
``chance_level`` means the model learned text-conditional generation, not just texture.
Also writes a sample grid from held-out captions (``--grid PATH``).

``masked_self_edit`` measures what issue 3 calls coherent masked edits: every shipped
template is edited with the uncompressed cache and its *own* prompt, and the editable
region is compared with the template image (PSNR over the pixel mask). A model that
inpaints coherently redraws the face / clothes / object it is shown around the mask; the
biharmonic inpainting of the same region (scikit-image, no model) is given as the floor a
learned inpainter should beat. Both the catalog's strength (what ships) and strength 1 (the
model alone, from pure noise: the fair match for biharmonic) are reported.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from sakura.dit.data import CATEGORIES, EmojiDataset, category_prompt
from sakura.dit.editing import exact_edits, region_psnr
from sakura.dit.model import TokenBatch, grid_positions, patchify
from sakura.dit.sampler import generate, renoise
from sakura.dit.templates import load_catalog
from sakura.dit.text import TextEncoder
from sakura.dit.weights import load_model
from torch import nn


class EmojiClassifier(nn.Module):
    """A small CNN on 32x32 images -> emoji category."""

    def __init__(self, classes: int = len(CATEGORIES)):
        super().__init__()
        def block(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(),
                                 nn.Conv2d(o, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(),
                                 nn.MaxPool2d(2))
        self.net = nn.Sequential(block(3, 32), block(32, 64), block(64, 128),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2),
                                 nn.Linear(128, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(F.interpolate(x, size=(32, 32), mode="bilinear", antialias=True))


def _labelled(ds: EmojiDataset, held_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
    idx = [i for i in ds.split(held_out) if ds.items[i].category in CATEGORIES]
    y = torch.tensor([CATEGORIES.index(ds.items[i].category) for i in idx])
    return ds.images[idx].float(), y


def train_classifier(ds: EmojiDataset, epochs: int = 12, seed: int = 0) -> EmojiClassifier:
    torch.manual_seed(seed)
    x, y = _labelled(ds, held_out=False)
    clf = EmojiClassifier()
    opt = torch.optim.AdamW(clf.parameters(), lr=2e-3, weight_decay=1e-4)
    rng = random.Random(seed)
    n = len(y)
    for _ in range(epochs):
        clf.train()
        order = list(range(n))
        rng.shuffle(order)
        for i in range(0, n, 128):
            b = order[i : i + 128]
            xb = x[b]
            shift = rng.randint(-3, 3), rng.randint(-3, 3)
            xb = torch.roll(xb, shifts=shift, dims=(2, 3))
            loss = F.cross_entropy(clf(xb), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return clf.eval()


@torch.inference_mode()
def accuracy(clf: EmojiClassifier, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((clf(x).argmax(-1) == y).float().mean())


def load_arch(arch: str, weights: str | None = None) -> nn.Module:
    """``mmdit``: the shipped model (``weights``: its file); ``flux2``: the second model
    (``dit.flux2_pixel``; ``weights``: its folder)."""
    if arch == "flux2":
        from sakura.dit.flux2_pixel import load_flux2  # lazy: diffusers, for this arch only

        return load_flux2(weights)
    return load_model(weights)


def run_bench(per_category: int = 8, steps: int = 20, guidance: float = 3.0,
              weights: str | None = None, grid: str | None = None, quick: bool = False,
              arch: str = "mmdit") -> dict:
    t0 = time.perf_counter()
    ds = EmojiDataset.load()
    clf = train_classifier(ds, epochs=4 if quick else 12)
    xh, yh = _labelled(ds, held_out=True)
    model = load_arch(arch, weights)
    enc = TextEncoder()
    unc = enc.encode([""])
    prompts = [category_prompt(c) for c in CATEGORIES for _ in range(per_category)]
    labels = torch.tensor([i for i in range(len(CATEGORIES)) for _ in range(per_category)])
    txt = enc.encode(prompts)
    imgs = torch.cat([generate(model, txt[i : i + 24], unc, 64, seed=1000 + i, steps=steps,
                               guidance=guidance) for i in range(0, len(prompts), 24)])
    out = {
        "real_heldout_accuracy": accuracy(clf, xh, yh),
        "real_heldout_images": len(yh),
        "prompt_accuracy_generated": accuracy(clf, imgs, labels),
        "generated_images": len(labels),
        "chance_level": 1.0 / len(CATEGORIES),
        "categories": list(CATEGORIES),
        "steps": steps, "guidance": guidance, "arch": arch,
        "model_class": type(getattr(model, "transformer", model)).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "weights_train_step": getattr(model, "weights_meta", {}).get("train_step"),
    }
    out["ratio_to_chance"] = out["prompt_accuracy_generated"] / out["chance_level"]
    per_cat = (clf(imgs).argmax(-1) == labels).float().view(len(CATEGORIES), -1).mean(-1)
    out["per_category_generated_accuracy"] = {c: float(a) for c, a in zip(CATEGORIES, per_cat)}
    out["denoise_x0_psnr_db_by_t"] = denoise_by_t(model, enc, ds)
    # (the MMDiT's own cached edit; the FLUX.2 model's edits run through dit.adapters)
    if arch == "mmdit":
        out["masked_self_edit"] = masked_self_edit(model, enc, seeds=(0,) if quick else (0, 1))
    if grid:
        out["grid"] = write_grid(model, enc, ds, grid, steps, guidance)
    out["seconds"] = time.perf_counter() - t0
    return out


@torch.inference_mode()
def denoise_by_t(model=None, enc=None, ds: EmojiDataset | None = None,
                 ts: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 0.95),
                 images: int = 16) -> dict[str, float]:
    """One-step denoising quality per noise level: PSNR of the predicted clean image
    ``x_t - t v`` against the real one (64 px training images with their captions, fixed
    noise). The noisy input itself scores about ``10 log10(4 / t^2)``."""
    model = model or load_model()
    enc = enc or TextEncoder()
    ds = ds or EmojiDataset.load()
    train_idx = ds.split(held_out=False)
    idx = train_idx[:: max(1, len(train_idx) // images)][:images]
    x0 = patchify(ds.images[idx].float(), model.cfg.patch_size)
    txt = enc.encode([ds.items[i].caption for i in idx])
    pos = grid_positions(ds.images.shape[-1] // model.cfg.patch_size, model.cfg.pos_span)
    e = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    out = {}
    for t in ts:
        xt = renoise(x0, e, t)
        v = model(TokenBatch(img=xt, img_pos=pos, txt=txt, t=torch.full((len(idx),), t)))
        mse = float(((xt - t * v - x0) ** 2).mean())
        out[f"{t:g}"] = 10 * math.log10(4.0 / mse)
    return out


def masked_self_edit(model, enc, seeds: tuple[int, ...] = (0, 1)) -> dict:
    """Per template: PSNR of the exact-cache edit with the template's own prompt against
    the template over its mask, next to biharmonic inpainting of the same region.

    ``psnr_db`` edits at the catalog's strength (the shipped behaviour: the region starts
    from the template noised to ``t = strength``); ``from_noise_psnr_db`` at strength 1,
    where the model alone must invent the region from its context, which is the fair match
    for biharmonic inpainting (which also sees only the context)."""
    from skimage.restoration import inpaint_biharmonic

    def self_psnr(tpl, base) -> float:
        edits = exact_edits(model, tpl, [replace(base, txt=tpl.txt, seed=sd) for sd in seeds])
        return sum(region_psnr(e, tpl.image, tpl.mask) for e in edits) / len(edits)

    per: dict[str, dict] = {}
    for tid, spec in load_catalog().items():
        tpl = spec.to_template(enc)
        base = spec.requests(enc, "evaluation")[0]
        hole = tpl.image.permute(1, 2, 0).numpy().copy()
        filled = inpaint_biharmonic(hole, tpl.mask.numpy(), channel_axis=-1)
        bih = region_psnr(torch.from_numpy(filled).permute(2, 0, 1), tpl.image, tpl.mask)
        shipped = self_psnr(tpl, base)
        per[tid] = {"workload": spec.workload, "strength": tpl.strength, "psnr_db": shipped,
                    "from_noise_psnr_db": (shipped if tpl.strength == 1.0 else
                                           self_psnr(replace(tpl, strength=1.0), base)),
                    "biharmonic_psnr_db": bih}

    def mean(key: str) -> float:
        return sum(v[key] for v in per.values()) / len(per)

    return {"mean_psnr_db": mean("psnr_db"), "mean_from_noise_psnr_db": mean("from_noise_psnr_db"),
            "mean_biharmonic_psnr_db": mean("biharmonic_psnr_db"), "seeds": list(seeds),
            "templates": per}


def write_grid(model, enc, ds: EmojiDataset, path: str, steps: int, guidance: float,
               n: int = 16) -> str:
    """Generated (top) vs real (bottom) for held-out captions the model never saw."""
    from skimage.io import imsave

    held = ds.split(held_out=True)
    pick = [held[i * len(held) // n] for i in range(n)]
    captions = [ds.items[i].caption for i in pick]
    gen = generate(model, enc.encode(captions), enc.encode([""]), 64, seed=7, steps=steps,
                   guidance=guidance)
    real = ds.images[pick].float()
    rows = [torch.cat(list(gen), dim=2), torch.cat(list(real), dim=2)]
    img = ((torch.cat(rows, dim=1).permute(1, 2, 0) + 1) * 127.5).clamp(0, 255).byte().numpy()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    imsave(path, img, check_contrast=False)
    Path(path).with_suffix(".txt").write_text("\n".join(captions) + "\n")
    return path


def main(json_path: str | None, quick: bool, grid: str | None, weights: str | None,
         arch: str = "mmdit") -> int:
    result = run_bench(per_category=4 if quick else 8, weights=weights, grid=grid, quick=quick,
                       arch=arch)
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(text + "\n")
    return 0
