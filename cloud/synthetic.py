"""Synthetic packs with valid manifests, for tests and ``sakura bench serve``.

The bytes are random (seeded); the manifest follows the pack schema exactly: every shard
is one run of progressive units and configuration ``j`` of a shard is its first ``j + 1``
units: one contiguous byte range, as in the SAKURA embedded progressive layout
(``codec/FORMAT.md``). No model or codec is involved.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sakura.cloud import layout
from sakura.cloud.publish import CatalogTransaction, PublishedPack


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape of a synthetic pack: ``shards`` x ``configs`` progressive configurations."""

    shards: int = 6
    configs: int = 4
    unit_bytes: int = 4096  # bytes of the first unit; unit k has unit_bytes * (k + 1)
    seed: int = 0


def make_pack(
    directory: str | os.PathLike[str],
    template_id: str,
    codec: str = "sakura",
    spec: SyntheticSpec | None = None,
) -> tuple[dict[str, Any], Path]:
    """Write ``<directory>/<template_id>.<codec>.pack`` and return (manifest, pack path)."""
    spec = spec or SyntheticSpec()
    rng = np.random.default_rng(spec.seed)
    # two regions' worth per unit, so bodies keep the sizes of the two-range layout
    unit_sizes = [2 * spec.unit_bytes * (k + 1) for k in range(spec.configs)]
    region = sum(unit_sizes)
    pack_bytes = spec.shards * region
    data = rng.integers(0, 256, size=pack_bytes, dtype=np.uint8).tobytes()
    units: list[list[Any]] = []
    shards: list[dict[str, Any]] = []
    offset = 0
    for s in range(spec.shards):
        start = offset
        indices = []
        for size in unit_sizes:
            units.append([offset, size, hashlib.sha256(data[offset : offset + size]).hexdigest()])
            indices.append(len(units) - 1)
            offset += size
        configs = []
        for j in range(spec.configs):
            prefix = sum(unit_sizes[: j + 1])
            configs.append(
                {
                    "id": j,
                    "params": {"rank": 4 * (j + 1), "bits": 8},
                    "units": indices[: j + 1],
                    "ranges": [[start, prefix]],
                    "bytes": prefix,
                    "quality": {"weighted_err": 1.0 / (j + 1), "psnr_db": 20.0 + 5 * j},
                    "pareto": True,
                }
            )
        shards.append(
            {
                "index": s,
                "step": s // 2,
                "blocks": [2 * (s % 2), 2 * (s % 2) + 2],
                "compute_cost": 1.0,
                "configs": configs,
            }
        )
    sha = hashlib.sha256(data).hexdigest()
    manifest = {
        "format": layout.MANIFEST_FORMAT,
        "version": layout.MANIFEST_VERSION,
        "template_id": template_id,
        "codec": codec,
        "codec_options": {},
        "pack_file": layout.pack_file_name(codec, sha),
        "pack_bytes": pack_bytes,
        "pack_sha256": sha,
        "geometry": {
            "steps": (spec.shards + 1) // 2,
            "blocks": 4,
            "tokens": 64,
            "channels": 32,
            "heads": 2,
            "blocks_per_shard": 2,
            "dtype": "fp16",
        },
        "model": {"name": "synthetic"},
        "fp16_bytes": pack_bytes * 4,
        "stored_bytes": pack_bytes,
        "units": units,
        "shards": shards,
    }
    path = Path(directory) / f"{template_id}.{codec}.pack"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return manifest, path


def build_catalog(
    out_dir: str | os.PathLike[str],
    template_ids: list[str],
    *,
    codec: str = "sakura",
    spec: SyntheticSpec | None = None,
    work_dir: str | os.PathLike[str] | None = None,
) -> dict[str, PublishedPack]:
    """Publish one synthetic pack per template id into ``out_dir`` (with catalog.json)."""
    spec = spec or SyntheticSpec()
    with contextlib.ExitStack() as stack:
        work = (
            Path(work_dir)
            if work_dir is not None
            else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        return _build(Path(out_dir), work, template_ids, codec, spec)


def _build(
    out_dir: Path, work: Path, template_ids: list[str], codec: str, spec: SyntheticSpec
) -> dict[str, PublishedPack]:
    published: dict[str, PublishedPack] = {}
    with CatalogTransaction(out_dir) as txn:
        for i, template_id in enumerate(template_ids):
            manifest, pack = make_pack(
                work,
                template_id,
                codec,
                SyntheticSpec(spec.shards, spec.configs, spec.unit_bytes, spec.seed + i),
            )
            published[template_id] = txn.publish(
                template_id,
                codec,
                manifest,
                pack,
                {"workload": "synthetic", "mask_ratio": 0.12, "resolution": 64},
            )
    return published


def config_bytes(pack: bytes, manifest: dict[str, Any], shard: int, config: int) -> bytes:
    """The expected body of the shard endpoint for (shard, config) of an in-memory pack."""
    for entry in manifest["shards"]:
        if entry["index"] == shard:
            for cfg in entry["configs"]:
                if cfg["id"] == config:
                    return b"".join(pack[o : o + n] for o, n in cfg["ranges"])
    raise KeyError((shard, config))
