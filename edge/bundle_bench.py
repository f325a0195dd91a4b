"""The ``bundle`` figures of ``sakura bench phone`` (issue 31): what a device bundle weighs and
what it saves the device, measured in one run (``sakura bench bundle``; record:
``docs/bench/bundle.json``).

:func:`bundle_figures`, for one template of the shipped catalog and the shipped model:

1. **cloud**: export the template's bundle into fresh caches (graphs and the MiniLM text
   encoder program: nothing reused from earlier runs) and publish it into a fresh catalog
   folder (``cloud.bundle.publish_bundle``): ``export_s`` is that wall time;
2. ``sakura serve`` on that folder, in a child process on loopback;
3. **device with the bundle**: a fresh graph cache; the catalog entry read, every file
   downloaded, checked and cached, and the graph chains loaded (``NativeEngine.prepare`` and
   ``prepare_full``, as an edit's set-up does): ``bundle_load_s``; no export happens
   (``device_compiles_with_bundle`` = 0);
4. **device without it**: another fresh graph cache; the same ``prepare`` calls export the
   same chains on the device: ``device_export_s``.

``device_export_s_saved`` = ``device_export_s - bundle_load_s``. ``bytes`` and ``files`` are
the catalog entry's. Timings are this host's (x86, shared cores), not a phone's.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from sakura.cloud.bundle import publish_bundle
from sakura.cloud.publish import update_catalog
from sakura.codec import DEFAULT_BLOCKS_PER_SHARD
from sakura.dit.adapters.engine import load_engine
from sakura.dit.editing import Geometry
from sakura.dit.templates import load_catalog
from sakura.edge.bundle import DeviceBundles, export_bundle
from sakura.edge.native_runtime import NativeEngine
from sakura.edge.server_process import ServerProcess


def bundle_figures(template_id: str = "face-technologist", blocks_per_shard: int = DEFAULT_BLOCKS_PER_SHARD,
                   work: Path | None = None) -> dict[str, Any]:
    """``{bytes, files, export_s, device_export_s_saved, ...}`` (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="sakura-bundle-bench-") as tmp:
        root = Path(work) if work is not None else Path(tmp)
        engine = load_engine()
        model = engine.model
        spec = load_catalog()[template_id]
        template = spec.to_device_template()
        req = engine.request(spec.evaluation_prompts[0], 0)
        weights = engine.weights_id
        bps = min(blocks_per_shard, model.cfg.num_blocks)

        t0 = time.perf_counter()
        made = export_bundle(model, weights, template, req, bps,
                             cache_dir_=root / "cloud-compiled",
                             text_cache=root / "cloud-text", work=root / "work")
        catalog = root / "catalog"
        entry = publish_bundle(catalog, made.files, made.doc)
        update_catalog(catalog, {template_id: {"bundle": entry}})
        export_s = time.perf_counter() - t0

        geo = Geometry.of(model, template)
        with ServerProcess(catalog) as server:
            with_bundle = NativeEngine(model, weights, cache_dir=root / "device-a")
            t0 = time.perf_counter()
            DeviceBundles(root / "device-a" / "bundles", say=lambda _l: None).ensure(
                with_bundle, server.url, template_id)
            with_bundle.prepare(template, geo, req, bps)
            with_bundle.prepare_full(template, req)
            bundle_load_s = time.perf_counter() - t0

        exporting = NativeEngine(model, weights, cache_dir=root / "device-b")
        t0 = time.perf_counter()
        exporting.prepare(template, geo, req, bps)
        exporting.prepare_full(template, req)
        device_export_s = time.perf_counter() - t0

        return {
            "template": template_id,
            "bundle_id": entry["id"],
            "bytes": sum(f["bytes"] for f in entry["files"]),
            "files": len(entry["files"]),
            "by_role": {role: sum(f["bytes"] for f in entry["files"] if f["role"] == role)
                        for role in sorted({f["role"] for f in entry["files"]})},
            "graph_sets": [{"name": g["name"], "shape": g["shape"], "groups": len(g["groups"])}
                           for g in entry["graph_sets"]],
            "export_s": round(export_s, 2),
            "device_export_s": round(device_export_s, 2),
            "bundle_load_s": round(bundle_load_s, 2),
            "device_export_s_saved": round(device_export_s - bundle_load_s, 2),
            "device_compiles_with_bundle": with_bundle.compiles,
            "device_compiles_without": exporting.compiles,
            "host": f"{platform.machine()}, {len(os.sched_getaffinity(0))} "
                    "CPUs (shared); loopback sakura serve; not a phone",
        }
