"""Template images, read with one clear error for each way a catalog's image can be wrong.

A catalog entry's image and mask are resized *down* to its declared ``resolution``. Each of
these is an :class:`ImageError` (a :class:`SakuraError`: one ``sakura: error:`` line):

- the file cannot be read as an image (missing, truncated, not an image format PIL knows);
- a decompression bomb: more pixels than PIL's ``Image.MAX_IMAGE_PIXELS`` (~89.5 M, where
  PIL warns; twice that, where it raises ``DecompressionBombError``), refused at the
  header, before any pixel is decoded;
- a declared resolution above the image's size (upscaling would invent detail the
  template does not have, and the edit would silently run on a blurred template).

Torch-free (PIL and numpy): ``dit.cli.check_template`` checks a catalog's images before a
command imports torch or loads a model.
"""

from __future__ import annotations

import io
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from sakura.dit.errors import ImageError


def max_pixels() -> int:
    """The most pixels a template image may have: PIL's decompression-bomb warning
    threshold (``Image.MAX_IMAGE_PIXELS``), which this module treats as an error."""
    from PIL import Image

    return int(Image.MAX_IMAGE_PIXELS or 89_478_485)


def open_image(source: str | Path | bytes, what: str):
    """``source`` (a file, or the bytes of one) decoded by PIL, or an :class:`ImageError`
    naming ``what`` ("template 'x': image a.png"). Decompression bombs are refused from
    the header, before decoding."""
    from PIL import Image

    limit = max_pixels()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
            im.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        found = re.search(r"\((\d+) pixels\)", str(exc))
        size = f"{int(found.group(1)):,} pixels" if found else "too many pixels"
        raise ImageError(f"{what}: refused as a decompression bomb: {size}, more than the "
                         f"{limit:,} a template image may have") from None
    except FileNotFoundError:
        raise ImageError(f"{what}: no such file") from None
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for a broken file
        reason = str(exc) or type(exc).__name__
        raise ImageError(f"{what}: cannot read the image ({reason})") from None
    return im


def check_resolution(size: tuple[int, int], resolution: int, what: str) -> None:
    """Images are resized down, never up: ``resolution`` must fit in ``size`` (w, h)."""
    w, h = size
    if resolution > min(w, h):
        raise ImageError(f"{what}: the declared resolution {resolution} px is above the "
                         f"image's {w}x{h}: templates are only resized down (give an "
                         f"image of at least {resolution}x{resolution} px, or a "
                         f"resolution of at most {min(w, h)})")


def _open_checked(source: str | Path | bytes, what: str, resolution: int | None) -> Any:
    """:func:`open_image`, checked against ``resolution`` when given."""
    im = open_image(source, what)
    if resolution is not None:
        check_resolution(im.size, resolution, what)
    return im


def read_rgb(source: str | Path | bytes, what: str, resolution: int | None = None
             ) -> np.ndarray:
    """An RGB image as ``uint8 [H, W, 3]`` (alpha dropped), checked against
    ``resolution`` when given."""
    return np.asarray(_open_checked(source, what, resolution).convert("RGB"))


def read_mask(source: str | Path | bytes, what: str, resolution: int | None = None
              ) -> np.ndarray:
    """A mask as ``uint8 [H, W]`` (its first channel; white = editable), checked against
    ``resolution`` when given."""
    im = _open_checked(source, what, resolution)
    if im.mode in ("1", "L", "LA", "I", "I;16", "F"):
        return np.asarray(im.convert("L"))
    return np.asarray(im.convert("RGB"))[..., 0]


def check_template_files(image: Path, mask: Path, resolution: int, what: str) -> None:
    """Both files of a catalog entry read, neither a bomb nor below ``resolution``."""
    read_rgb(image, f"{what}: image {image.name}", resolution)
    read_mask(mask, f"{what}: mask {mask.name}", resolution)
