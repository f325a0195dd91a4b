"""Templates on the device, from the server's catalog entry (or a local catalog).

``sakura build`` puts what the device needs to run an edit of a template into the
template's catalog entry (``template``: image and mask as base64 PNG, prompt, steps,
guidance, resolution, seed). All of it is the provider's, public; fetching it names only
the template id. :func:`template_from_entry` turns it into a ``dit.editing.Template``.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import torch

from dit.editing import Template
from edge.errors import EdgeError


def _png(b64: str) -> np.ndarray:
    from skimage.io import imread

    try:
        return imread(io.BytesIO(base64.b64decode(b64, validate=True)))
    except (ValueError, OSError) as exc:
        raise EdgeError(f"the catalog's template image is not a valid PNG: {exc}") from exc


def has_assets(entry: dict[str, Any]) -> bool:
    t = entry.get("template")
    return isinstance(t, dict) and "image_png_b64" in t and "mask_png_b64" in t


def template_from_entry(template_id: str, entry: dict[str, Any], encoder: Any,
                        seed: int | None = None) -> Template:
    """A catalog entry's ``template`` assets -> ``Template`` (prompt encoded on the device).

    ``seed`` (the template's noise seed) is only needed by the ``local`` policy, which
    recomputes the template trajectory; it defaults to the entry's.
    """
    if not has_assets(entry):
        raise EdgeError(f"the server's catalog entry of {template_id!r} has no template "
                        "assets (image, mask): rebuild it with `sakura build`, or pass "
                        "--catalog to use a local template catalog")
    t = entry["template"]
    img = _png(t["image_png_b64"]).astype(np.float32)
    if img.ndim == 2:
        img = np.stack([img] * 3, axis=-1)
    mask = _png(t["mask_png_b64"])
    if mask.ndim == 3:
        mask = mask[..., 0]
    image = torch.from_numpy(img[..., :3] / 127.5 - 1).permute(2, 0, 1).contiguous()
    if image.shape[-1] != image.shape[-2] or tuple(mask.shape) != tuple(image.shape[-2:]):
        raise EdgeError(f"template {template_id!r}: image {tuple(image.shape)} and mask "
                        f"{tuple(mask.shape)} do not match")
    seed_value = t.get("seed", entry.get("seed", seed))
    return Template(image=image, mask=torch.from_numpy(mask > 127),
                    txt=encoder.encode([str(t.get("prompt", ""))]),
                    seed=int(seed_value if seed_value is not None else -1),
                    steps=int(t["steps"]), guidance=float(t.get("guidance", 3.0)))
