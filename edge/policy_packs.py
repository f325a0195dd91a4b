"""The packs a comparison of policies streams: built by the provider's builder, checked to
decode, what a server offers, which pack each policy streams, their manifests fetched ahead.

Packs: ``sakura bench edit`` runs the provider's builder (``cloud.build``, what ``sakura
build`` does, :func:`build_packs`), which skips templates that are up to date (same spec,
weights, codecs) and is forced when the cached packs no longer decode
(:func:`catalog_usable`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sakura.cloud.build import BuildConfig, build
from sakura.codec.pack import PackReader, decode_config
from sakura.edge.allocator import ABLATION_PACK, ABLATIONS, POLICIES
from sakura.edge.client import PackClient
from sakura.edge.errors import EdgeError
from sakura.edge.runtime import EdgeRuntime

from sakura.errors import SakuraError


def build_packs(out_dir: Path, template_id: str, weights: Path, catalog: str | None = None,
                force: bool = False, log: Any = print) -> Path:
    """Build and publish the template's packs with the provider's builder (``sakura
    build``: every codec, importance profiling, template assets in the catalog entry)."""
    build(BuildConfig(catalog=catalog, out_dir=str(out_dir), templates=(template_id,),
                      weights=str(weights), force=force), log=log)
    return out_dir


def catalog_usable(catalog_dir: Path, template_id: str) -> bool:
    """Every pack of ``template_id`` opens and its first shard decodes with this codec."""
    try:
        doc = json.loads((catalog_dir / "catalog.json").read_text())
        codecs = doc["templates"][template_id]["codecs"]
        for name, entry in codecs.items():
            folder = catalog_dir / "templates" / template_id / name
            with PackReader(folder / entry["pack_file"]) as reader:
                m = reader.manifest
                cfg = min(m.shard(0).configs, key=lambda c: c.bytes)
                decode_config(m, 0, cfg.id, reader.read_config(0, cfg.id))
    except (SakuraError, OSError, ValueError, KeyError, TypeError):
        return False
    return True


async def catalog_entry(server: str, template_id: str) -> dict[str, Any]:
    """The catalog entry ``server`` publishes for ``template_id`` (an error if none)."""
    async with PackClient(server) as client:
        catalog = await client.catalog()
    entry = catalog.get("templates", {}).get(template_id)
    if entry is None:
        raise EdgeError(f"the server at {server} does not serve template {template_id!r}")
    return entry


async def prefetch_manifests(server: str, template_id: str, codecs: list[str],
                             runtime: EdgeRuntime) -> None:
    """Fetch the manifests of ``codecs`` into the runtime's manifest cache (device state as on
    a phone that has used the template before)."""
    async with PackClient(server, manifests=runtime.manifests) as client:
        for codec in codecs:
            await client.manifest(template_id, codec)


async def catalog_codecs(server: str, template_id: str) -> set[str]:
    """The codecs ``server`` offers for ``template_id``."""
    return set((await catalog_entry(server, template_id)).get("codecs", {}))


def policy_packs(offered: set[str], policies, template_id: str) -> dict[str, str | None]:
    """The pack (codec) each policy streams given the codecs the server ``offered``: the
    ablations use ``sakura-all`` when there is one; ``local`` none. A missing pack is an
    error naming it."""
    ablation = ABLATION_PACK if ABLATION_PACK in offered else None
    packs = {p: (ablation if p in ABLATIONS and ablation else POLICIES[p].codec)
             for p in policies}
    missing = sorted({c for c in packs.values() if c and c not in offered})
    if missing:
        raise EdgeError(f"the server has no {', '.join(missing)} pack for {template_id}")
    return packs
