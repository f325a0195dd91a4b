"""Training data: the captioned 64x64 emoji of the npm package ``emoji-datasource-google``.

3,786 Apache-2.0 images (Noto Emoji) with names and categories in ``emoji.json``;
skin-tone variants of one emoji are natural edit pairs (and reference/target pairs).
The package is fetched once with ``npm pack`` (the npm registry is reachable; nothing else
is) into the cache folder, never into the repository.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tarfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sakura.dit.errors import DataError

from sakura.cachedir import cache_dir as sakura_cache_dir

EMOJI_PACKAGE = "emoji-datasource-google@16.0.0"
CATEGORIES = (
    "Smileys & Emotion", "People & Body", "Animals & Nature", "Food & Drink",
    "Travel & Places", "Activities", "Objects", "Symbols", "Flags",
)
SKIN_TONES = {
    "1F3FB": "light skin tone", "1F3FC": "medium-light skin tone", "1F3FD": "medium skin tone",
    "1F3FE": "medium-dark skin tone", "1F3FF": "dark skin tone",
}



def cache_dir() -> Path:
    return sakura_cache_dir()


def fetch_emoji_package(dest: Path | None = None) -> Path:
    """Download and unpack the npm package once; return the folder holding emoji.json."""
    dest = dest or cache_dir() / "emoji-datasource-google"
    if (dest / "emoji.json").exists():
        return dest
    if shutil.which("npm") is None:
        raise DataError("npm is needed once to fetch the emoji data set (apt-get install npm)")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        res = subprocess.run(["npm", "pack", EMOJI_PACKAGE, "--pack-destination", str(tmp)],
                             capture_output=True, text=True, timeout=900)
        if res.returncode != 0:
            raise DataError(f"npm pack {EMOJI_PACKAGE} failed: {res.stderr.strip()[-500:]}")
        tgz = next(tmp.glob("*.tgz"))
        with tarfile.open(tgz) as tar:
            members = [m for m in tar.getmembers()
                       if m.name in ("package/emoji.json", "package/LICENSE")
                       or m.name.startswith("package/img/google/64/")]
            tar.extractall(tmp, members=members, filter="data")
        tgz.unlink()
        shutil.rmtree(dest, ignore_errors=True)
        (tmp / "package").rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


@dataclass
class EmojiItem:
    caption: str          # "people & body: woman technologist: dark skin tone"
    name: str             # "woman technologist: dark skin tone"
    category: str
    base: str             # unified code of the base emoji (groups skin-tone variants)
    image_file: str


def _name(entry: dict) -> str:
    return (entry.get("name") or entry["short_name"]).lower()


def list_items(root: Path) -> list[EmojiItem]:
    entries = json.loads((root / "emoji.json").read_text())
    items: list[EmojiItem] = []
    for e in entries:
        if not e.get("has_img_google"):
            continue
        cat = e["category"]
        base_name = _name(e)
        items.append(EmojiItem(f"{cat.lower()}: {base_name}", base_name, cat, e["unified"], e["image"]))
        for key, var in (e.get("skin_variations") or {}).items():
            if not var.get("has_img_google"):
                continue
            tones = ", ".join(SKIN_TONES.get(k, k) for k in key.split("-"))
            name = f"{base_name}: {tones}"
            items.append(EmojiItem(f"{cat.lower()}: {name}", name, cat, e["unified"], var["image"]))
    return [it for it in items if (root / "img/google/64" / it.image_file).exists()]


def load_image(path: Path, size: int = 64) -> torch.Tensor:
    """RGBA PNG composited on white -> ``[3, size, size]`` in [-1, 1]."""
    from skimage.io import imread

    with warnings.catch_warnings():
        # a few Noto PNGs are palette images with byte transparency; PIL converts them fine
        warnings.filterwarnings("ignore", "Palette images with Transparency", UserWarning)
        arr = imread(path).astype(np.float32) / 255.0
    if arr.ndim == 2:
        arr = arr[..., None]
    if arr.shape[-1] in (1, 2):  # grey or grey + alpha
        arr = np.concatenate([arr[..., :1]] * 3 + [arr[..., 1:]], axis=-1)
    if arr.shape[-1] == 4:
        rgb, a = arr[..., :3], arr[..., 3:4]
        arr = rgb * a + (1.0 - a)
    x = torch.from_numpy(arr[..., :3].copy()).permute(2, 0, 1)
    if x.shape[-1] != size:
        x = F.interpolate(x[None], size=(size, size), mode="bilinear", antialias=True)[0]
    return x * 2 - 1


def is_held_out(item: EmojiItem, fraction: float = 0.05) -> bool:
    """Deterministic split by base emoji, so every skin-tone variant stays on one side."""
    h = int(hashlib.sha256(item.base.encode()).hexdigest()[:8], 16)
    return (h % 10_000) < fraction * 10_000


@dataclass
class EmojiDataset:
    items: list[EmojiItem]
    images: torch.Tensor  # [N, 3, 64, 64] float16 in [-1, 1]

    @classmethod
    def load(cls, root: Path | None = None) -> EmojiDataset:
        root = root or fetch_emoji_package()
        items = list_items(root)
        imgs = torch.stack([load_image(root / "img/google/64" / it.image_file) for it in items])
        return cls(items, imgs.half())

    def split(self, held_out: bool) -> list[int]:
        return [i for i, it in enumerate(self.items) if is_held_out(it) == held_out]

    def siblings(self) -> dict[int, list[int]]:
        """Index -> indices of the other skin-tone variants of the same emoji."""
        groups: dict[str, list[int]] = {}
        for i, it in enumerate(self.items):
            groups.setdefault(it.base, []).append(i)
        return {i: [j for j in g if j != i] for g in groups.values() if len(g) > 1 for i in g}


def category_prompt(category: str) -> str:
    return category.lower()
