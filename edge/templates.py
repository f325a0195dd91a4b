"""Templates on the device, from the server's catalog entry (or a local catalog).

``sakura build`` puts what the device needs to run an edit of a template into the
template's catalog entry (``template``: image and mask as base64 PNG, steps, guidance,
resolution; see ``dit.templates.template_assets``). All of it is the provider's, public;
fetching it names only the template id. :func:`template_from_entry` turns it into a
``dit.editing.Template``.
"""

from __future__ import annotations

from typing import Any

from sakura.dit.editing import Template
from sakura.dit.images import ImageError
from sakura.dit.templates import device_template
from sakura.edge.errors import EdgeError

from sakura.argtypes import SEED_LIMIT


def has_assets(entry: dict[str, Any]) -> bool:
    t = entry.get("template") if isinstance(entry, dict) else None
    return isinstance(t, dict) and "image_png_b64" in t and "mask_png_b64" in t


def template_from_entry(template_id: str, entry: dict[str, Any], encoder: Any = None,
                        seed: int | None = None) -> Template:
    """A catalog entry's ``template`` assets -> ``Template`` (``dit.templates``'
    ``device_template``: image, mask, steps, guidance; no prompt embeddings).

    ``seed`` (the template's noise seed) is only needed by the ``local`` policy, which
    recomputes the template trajectory: the entry's when it has one, else ``seed``, else
    -1 (unknown; the local policy refuses it).
    """
    if not has_assets(entry):
        raise EdgeError(f"the server's catalog entry of {template_id!r} has no template "
                        "assets (image, mask): rebuild it with `sakura build`, or pass "
                        "--catalog to use a local template catalog")
    try:
        template = device_template(entry)
    except (ValueError, OSError, KeyError, TypeError, ImageError) as exc:
        raise EdgeError(f"template {template_id!r}: the catalog's template assets are not "
                        f"valid ({exc})") from exc
    image, mask = template.image, template.mask
    if image.shape[-1] != image.shape[-2] or tuple(mask.shape) != tuple(image.shape[-2:]):
        raise EdgeError(f"template {template_id!r}: image {tuple(image.shape)} and mask "
                        f"{tuple(mask.shape)} do not match")
    t = entry["template"]
    seed_value = t.get("seed", entry.get("seed", seed))
    try:
        template.seed = int(seed_value) if seed_value is not None else -1
    except (TypeError, ValueError, OverflowError):
        template.seed = SEED_LIMIT  # (refused below)
    if template.seed >= SEED_LIMIT:
        raise EdgeError(f"template {template_id!r}: the catalog's template seed "
                        f"{seed_value!r:.40} is not a seed from 0 to {SEED_LIMIT - 1}")
    return template
