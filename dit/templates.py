"""The template catalog: shipped edit templates and how to turn one into a ``Template``.

Schema of ``catalog.json`` (``dit/catalog/`` is the default catalog; see its README)::

    {"version": 1, "templates": {"<id>": {
        "workload": "face-swap" | "try-on" | "instruction",
        "image": "<png, RGB>", "mask": "<png, white = editable>",
        "prompt": "<template prompt>", "seed": int, "steps": int, "guidance": float,
        "strength": float in (0, 1] (optional, default 1: edits start from pure noise),
        "resolution": int (pixels; the image and mask are resized down to it, never up),
        "mask_ratio": float, "token_mask_ratio": float,
        "profiling_prompts": [...], "evaluation_prompts": [...], "source": {...}}}}

Template ids match ``sakura.ids.TEMPLATE_ID`` (a lowercase letter or digit, then up to 63
of those, ``_`` and ``-``), the rule the pack manifest and the server check too.
"""

from __future__ import annotations

import base64
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sakura.dit.editing import EditRequest, Template, check_strength
from sakura.dit.errors import CatalogError
from sakura.dit.images import read_mask, read_rgb

from sakura.argtypes import SEED_LIMIT
from sakura.ids import TEMPLATE_ID  # the one template-id rule (codec checks the same)

DEFAULT_CATALOG = Path(__file__).parent / "catalog" / "catalog.json"
WORKLOADS = ("face-swap", "try-on", "instruction")



@dataclass
class TemplateSpec:
    """One catalog entry (paths resolved)."""

    id: str
    workload: str
    image_path: Path
    mask_path: Path
    prompt: str
    seed: int
    steps: int
    guidance: float
    resolution: int
    profiling_prompts: list[str]
    evaluation_prompts: list[str]
    meta: dict = field(default_factory=dict)
    strength: float = 1.0

    def load_image(self) -> torch.Tensor:
        """The image ``[3, R, R]`` in [-1, 1], resized down to the resolution R (an
        :class:`~sakura.dit.images.ImageError` for an unreadable image, a decompression
        bomb, or one smaller than R)."""
        what = f"template {self.id!r}: image {self.image_path.name}"
        arr = read_rgb(self.image_path, what, self.resolution).astype(np.float32) / 127.5 - 1
        x = torch.from_numpy(arr).permute(2, 0, 1)
        return _resize(x, self.resolution)

    def load_mask(self) -> torch.Tensor:
        what = f"template {self.id!r}: mask {self.mask_path.name}"
        m = torch.from_numpy(read_mask(self.mask_path, what, self.resolution) > 127)
        if m.shape[-1] != self.resolution:
            m = F.interpolate(m.float()[None, None], size=(self.resolution,) * 2, mode="nearest")[0, 0] > 0.5
        return m

    def to_template(self, encoder) -> Template:
        return Template(image=self.load_image(), mask=self.load_mask(),
                        txt=encoder.encode([self.prompt]), seed=self.seed, steps=self.steps,
                        guidance=self.guidance, prompt=self.prompt, strength=self.strength)

    def to_device_template(self) -> Template:
        """What the device knows of the template (as ``device_template`` of its published
        entry): pixels, mask, seed, steps, guidance and prompt text, no embeddings."""
        return Template(image=self.load_image(), mask=self.load_mask(),
                        txt=torch.zeros(1, 0, 384), seed=self.seed, steps=self.steps,
                        guidance=self.guidance, prompt=self.prompt, strength=self.strength)

    def requests(self, encoder, which: str = "evaluation", seed0: int = 100) -> list[EditRequest]:
        prompts = self.evaluation_prompts if which == "evaluation" else self.profiling_prompts
        unc = encoder.encode([""])
        embs = encoder.encode(prompts)
        base = seed0 if which == "evaluation" else seed0 + 500
        return [EditRequest(txt=embs[i : i + 1], txt_uncond=unc, seed=base + i)
                for i in range(len(prompts))]


def _resize(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] == size:
        return x
    return F.interpolate(x[None], size=(size, size), mode="bilinear", antialias=True)[0].clamp(-1, 1)


def load_catalog(path: str | Path | None = None) -> dict[str, TemplateSpec]:
    """The catalog at ``path`` (catalog.json or its folder; default: the shipped one).
    Anything wrong with it, whatever the JSON holds, is one :class:`CatalogError`."""
    path = Path(path) if path else DEFAULT_CATALOG
    if path.is_dir():
        path = path / "catalog.json"
    if not path.exists():
        raise CatalogError(f"catalog not found: {path}")
    try:
        doc = json.loads(path.read_text())
        entries = doc["templates"]
        if not isinstance(entries, dict):
            raise TypeError("'templates' is not an object of template entries")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise CatalogError(f"{path} is not a template catalog ({exc})") from None
    return {tid: _spec(path, tid, e) for tid, e in entries.items()}


def _spec(path: Path, tid: str, e: object) -> TemplateSpec:
    """One catalog entry, checked (a :class:`CatalogError` names what is wrong)."""
    if not TEMPLATE_ID.match(tid):
        raise CatalogError(f"{path}: bad template id {tid!r} (allowed: {TEMPLATE_ID.pattern})")
    bad = f"{path}: template {tid!r}"
    try:
        if not isinstance(e, dict):
            raise TypeError("the entry is not an object")
        texts = {k: e[k] for k in ("workload", "image", "mask", "prompt")}
        lists = {k: e[k] for k in ("profiling_prompts", "evaluation_prompts")}
        for k, v in texts.items():
            if not isinstance(v, str):
                raise TypeError(f"{k} must be a string")
        for k, v in lists.items():
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise TypeError(f"{k} must be a list of strings")
        numbers = {k: e[k] for k in ("seed", "steps", "guidance", "resolution", "strength")
                   if k in e}
        for k, v in numbers.items():
            if (isinstance(v, bool) or not isinstance(v, (int, float))
                    or isinstance(v, float) and not math.isfinite(v)):
                raise TypeError(f"{k} must be a finite number")
        spec = TemplateSpec(
            id=tid, workload=texts["workload"], image_path=path.parent / texts["image"],
            mask_path=path.parent / texts["mask"], prompt=texts["prompt"],
            seed=int(e["seed"]),
            steps=int(numbers.get("steps", 20)), guidance=float(numbers.get("guidance", 3.0)),
            resolution=int(numbers.get("resolution", 64)),
            strength=check_strength(float(numbers.get("strength", 1.0))),
            profiling_prompts=list(lists["profiling_prompts"]),
            evaluation_prompts=list(lists["evaluation_prompts"]),
            meta={k: v for k, v in e.items() if k not in ("image", "mask")},
        )
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise CatalogError(f"{bad} is missing or has a bad field: {exc}") from None
    if not 0 <= spec.seed < SEED_LIMIT:
        raise CatalogError(f"{bad}: seed must be 0 to {SEED_LIMIT - 1}, got {spec.seed}")
    if spec.resolution < 1:
        raise CatalogError(f"{bad}: resolution must be >= 1, got {spec.resolution}")
    if spec.steps < 1:
        raise CatalogError(f"{bad}: steps must be >= 1, got {spec.steps}")
    if spec.workload not in WORKLOADS:
        raise CatalogError(f"{bad}: workload must be one of {WORKLOADS}")
    for p in (spec.image_path, spec.mask_path):
        try:
            found = p.is_file()
        except (OSError, ValueError):  # a name the file system refuses (NUL, too long)
            found = False
        if not found:
            raise CatalogError(f"{bad}: file not found: {p}")
    return spec


def with_resolution(spec: TemplateSpec, resolution: int) -> TemplateSpec:
    """The same template at another resolution (a second resolution for evaluation)."""
    from dataclasses import replace

    return replace(spec, id=f"{spec.id}-{resolution}", resolution=resolution)


# ---------------------------------------------------------------- published assets


def _png_b64(arr: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def template_assets(spec: TemplateSpec, template: Template) -> dict:
    """The provider-owned template data the device needs (no user data here): the
    ``template`` key of a published catalog entry."""
    img = ((template.image.permute(1, 2, 0).numpy() + 1) * 127.5).round().clip(0, 255)
    mask = template.mask.numpy().astype(np.uint8) * 255
    return {
        "prompt": spec.prompt,
        "seed": template.seed,  # the template's own noise (provider data; `local` needs it)
        "steps": template.steps,
        "guidance": template.guidance,
        "strength": template.strength,
        "resolution": template.size,
        "image_png_b64": _png_b64(img.astype(np.uint8)),
        "mask_png_b64": _png_b64(mask),
    }


def decode_assets(entry: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Published catalog entry -> (image ``[3, H, W]`` in [-1, 1], mask ``[H, W]`` bool)."""
    t = entry["template"]
    img = read_rgb(base64.b64decode(t["image_png_b64"]), "the published template image")
    mask = read_mask(base64.b64decode(t["mask_png_b64"]), "the published template mask")
    image = torch.from_numpy(img.astype(np.float32) / 127.5 - 1).permute(2, 0, 1).contiguous()
    return image, torch.from_numpy(mask > 127)


def device_template(entry: dict) -> Template:
    """The template as the device sees it, from a published catalog entry.

    The device needs the image (outside the mask the output *is* the template), the mask,
    steps and guidance, and for ``local`` the template's noise seed; never the template's
    prompt embeddings (``txt`` is empty).
    """
    image, mask = decode_assets(entry)
    t = entry["template"]
    return Template(image=image, mask=mask, txt=torch.zeros(1, 0, 384), seed=int(t.get("seed", 0)),
                    steps=int(t["steps"]), guidance=float(t["guidance"]),
                    prompt=str(t.get("prompt", "")), strength=float(t.get("strength", 1.0)))
