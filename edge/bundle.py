"""The device bundle: what the device executes, exported in the cloud (issue 31, items 1 and 5).

Before bundles, the native runtime exported its ExecuTorch graphs on the device, on a
template geometry's first edit (minutes on this host; far more on a phone). A bundle moves
that export to ``sakura build``:

* **export** (:func:`export_bundle`, called by the builder through the app layer,
  ``sakura.bundle_cli``: the cloud package may not import the edge): the graph chains an
  edit of the template runs, exactly as :class:`~edge.native_runtime.NativeEngine` would
  export them (``StepIn``, the block groups' shards, ``StepOut``; the streamed edit's
  ``cached`` chain, the ``full`` chain of ``local`` and the local fallback, and the
  ``template`` chain of the local fallback's recompute step, whose groups also output
  every block's K/V: ``dit.editing.RecomputedKV``), each named
  by the device's own cache-key digest; the MiniLM text encoder as an ExecuTorch program
  and its ``vocab.txt`` (``edge/backends/text_encoder.py``; for the shipped model); and one
  ``tables.bin`` of float32 tables (the RoPE angles' cos / sin of the text positions and of
  every image position, the edit schedule and its modulation vectors) that a device without
  the model in Python needs. Exports go through the builder's compiled-artifact cache, so
  templates of one geometry share the same graph files and nothing is exported twice.
* **publish** (``cloud.bundle``): every file under its content address
  ``bundles/<sha16>/<name>``, listed with its length and sha256 in the template's catalog
  entry (``bundle``, schema ``sakura.codec.manifest.DeviceBundle``).
* **use** (:class:`DeviceBundles`, driven by ``edge.runner.NativeRunner``): before the
  first edit of a template the device reads its catalog entry, refuses a bundle made for
  other weights, another model architecture, another graphs format or another exporter,
  downloads each file it does not hold (the request names only the file's content address),
  checks its sha256, keeps it in the cache (``sakura.cachedir``: ``compiled/bundles/<sha256>/
  <name>``, published by rename) and hands the graph chains to the engine, which then
  exports nothing. A catalog entry without a bundle (packs built before bundles) makes the
  device export as before, and it says so once.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sakura.codec.errors import PackError
from sakura.codec.manifest import BUNDLE_FORMAT, BUNDLE_VERSION, DeviceBundle, parse_bundle
from sakura.dit.editing import EditRequest, Geometry, Template, edit_schedule
from sakura.edge.client import PackClient, RetryPolicy
from sakura.edge.errors import EdgeError, IntegrityError
from sakura.edge.native_runtime import (
    GRAPHS_FORMAT,
    TEMPLATE_SET,
    GraphSet,
    NativeEngine,
    exporter_version,
)
from sakura.edge.netloop import NetLoop

from sakura.atomic import publish_folder
from sakura.cachedir import cache_dir

TABLES_NAME = "tables.bin"
# the arrays of tables.bin that this exporter writes and sakura-edge reads (txt_in since
# sakura-edge, issue 31 item 2): a published bundle without one of them is stale
TABLE_ARRAYS = ("rope_txt_cos", "rope_txt_sin", "rope_img_cos", "rope_img_sin", "schedule",
                "vec_img", "vec_txt", "txt_in_weight", "txt_in_bias")


def bundle_is_current(bundle: dict[str, Any]) -> bool:
    """Whether a published bundle entry is what this exporter makes now: the same graphs
    format, every table array and the recompute step's graph set (``sakura build``
    re-exports a stale one; without this,
    a bundle from before sakura-edge was kept, and the binary refused it, telling the user
    to run the very ``sakura build`` that skipped it)."""
    tables = bundle.get("tables") or {}
    arrays = tables.get("arrays") or {}
    sets = bundle.get("graph_sets") or []
    return (bundle.get("graphs_format") == GRAPHS_FORMAT
            and all(name in arrays for name in TABLE_ARRAYS)
            and any(isinstance(gs, dict) and gs.get("name") == TEMPLATE_SET
                    and gs.get("emits_kv") is True for gs in sets))


# ------------------------------------------------------------------------------ export
@dataclass
class BundleExport:
    """An exported bundle before publishing: its files on disk and its description (the
    catalog's ``bundle`` entry without ``id`` and ``files``, which publishing adds)."""

    files: list[tuple[str, str, Path]]  # (name, role, path)
    doc: dict[str, Any]
    export_s: float = 0.0  # wall time of this export (short when the parts were cached)


def export_bundle(model: Any, weights_sha256: str, template: Template, req: EditRequest,
                  blocks_per_shard: int, *, cache_dir_: Path | None = None,
                  text_encoder: bool = True, text_cache: Path | None = None,
                  work: Path, precision: str = "fp32") -> BundleExport:
    """Export what an edit of ``template`` executes on the device (see the module
    docstring) for requests shaped like ``req`` (its text tokens and whether it carries
    the unconditional prompt). Graphs are exported into ``cache_dir_`` and the text encoder
    into ``text_cache`` (default: the compiled-artifact cache) unless they are there;
    ``work`` receives the tables. ``precision="int8"`` also exports the int8 variant of
    every chain's block-group graphs (``edge.backends.int8``; graph sets ``<name>-int8``);
    each graph set records its ``precision``."""
    from sakura.edge.backends.int8 import check_precision  # lazy: keeps torchao optional

    check_precision(precision)
    t0 = time.perf_counter()
    kw = {"cache_dir": cache_dir_} if cache_dir_ is not None else {}
    native = NativeEngine(model, weights_sha256, **kw)
    engines = {"fp32": native}
    if precision == "int8":
        engines["int8"] = NativeEngine(model, weights_sha256, precision="int8", **kw)
    geo = Geometry.of(model, template)
    files: list[tuple[str, str, Path]] = []
    sets = []
    plan = [(name if p == "fp32" else f"{name}-{p}", p, shape, groups)
            for p in engines
            for name, shape, groups in native.graph_plan(template, geo, req,
                                                         blocks_per_shard)]
    for name, prec, shape, groups in plan:
        graphs, digest = engines[prec].export(shape, groups, emit_kv=name == TEMPLATE_SET)
        group_files = [f"{name}-group{i}.pte" for i in range(len(groups))]
        files += [(f"{name}-step_in.pte", "graph", graphs.step_in),
                  *[(n, "graph", p) for n, p in zip(group_files, graphs.groups)],
                  (f"{name}-step_out.pte", "graph", graphs.step_out)]
        sets.append({"name": name, "digest": digest, "shape": shape.to_dict(),
                     "groups": [list(g) for g in groups], "dynamic": graphs.dynamic,
                     "takes_cache": graphs.takes_cache, "emits_kv": graphs.emits_kv,
                     "precision": prec,
                     "step_in": f"{name}-step_in.pte",
                     "group_files": group_files, "step_out": f"{name}-step_out.pte"})
    doc: dict[str, Any] = {
        "format": BUNDLE_FORMAT, "version": BUNDLE_VERSION,
        "weights_sha256": weights_sha256, "architecture": native.architecture(),
        "graphs_format": GRAPHS_FORMAT, "executorch": exporter_version(),
        "graph_sets": sets,
    }
    if text_encoder:
        from sakura.edge.backends.text_encoder import (  # lazy: transformers
            compiled_text_encoder,
        )

        program = compiled_text_encoder(int(req.txt.shape[1]), text_cache)
        files += [("text_encoder.pte", "text_encoder", program.pte),
                  ("vocab.txt", "vocab", program.vocab)]
        doc["text_encoder"] = {"program": "text_encoder.pte", "vocab": "vocab.txt",
                               "max_tokens": program.max_tokens, "lower_case": True}
    work.mkdir(parents=True, exist_ok=True)
    doc["tables"] = write_tables(model, template, geo, int(req.txt.shape[1]),
                                 work / TABLES_NAME)
    files.append((TABLES_NAME, "tables", work / TABLES_NAME))
    return BundleExport(files, doc, time.perf_counter() - t0)


@torch.inference_mode()
def write_tables(model: Any, template: Template, geo: Geometry, txt_tokens: int,
                 path: Path) -> dict[str, Any]:
    """``tables.bin``: float32 little-endian arrays, one after another, and their index
    (name -> byte offset and shape): the RoPE cos / sin of the text positions and of every
    image position (the device takes the masked rows), the edit schedule's ``steps + 1``
    timesteps, the per-step modulation vectors of the image and text streams
    (``NativeEngine.inputs`` computes the same from the model) and ``txt_in``'s weight
    ``[D, text_dim]`` and bias ``[D]`` (``native/src/edge``, the ``sakura-edge`` binary)."""
    ts = edit_schedule(template)
    vt, vi = [], []
    for s in range(template.steps):
        t = ts[s].reshape(1)
        vec = model.vec(t)[0, 0]
        vi.append(vec)
        vt.append(model.vec(torch.zeros_like(t))[0, 0]
                  if model.cfg.attention_mode == "block_causal" else vec)
    txt = model.angles(model.text_positions(txt_tokens))
    img = model.angles(geo.pos)
    arrays = {"rope_txt_cos": txt.cos(), "rope_txt_sin": txt.sin(),
              "rope_img_cos": img.cos(), "rope_img_sin": img.sin(),
              "schedule": ts[: template.steps + 1], "vec_img": torch.stack(vi),
              "vec_txt": torch.stack(vt),
              # the text stream's input projection (prompt embeddings -> the DiT's width):
              # a device without the model in Python applies it to the encoder's output
              # (zeros for a model without biases, the converted FLUX.2: one device format)
              "txt_in_weight": model.txt_in.weight,
              "txt_in_bias": (model.txt_in.bias if model.txt_in.bias is not None
                              else model.txt_in.weight.new_zeros(model.cfg.hidden_size))}
    index: dict[str, Any] = {}
    offset = 0
    with open(path, "wb") as f:
        for name, t in arrays.items():
            a = np.ascontiguousarray(t.detach().to(torch.float32).cpu().numpy(), "<f4")
            f.write(a.tobytes())
            index[name] = {"offset": offset, "shape": list(a.shape)}
            offset += a.nbytes
    return {"file": TABLES_NAME, "dtype": "float32", "steps": template.steps,
            "strength": float(template.strength), "grid": int(geo.grid), "arrays": index}


# ------------------------------------------------------------------------------ device
def _say(line: str) -> None:
    print(f"sakura: {line}", file=sys.stderr, flush=True)


@dataclass
class DeviceBundles:
    """The device's side of bundles (see the module docstring): one check, download and
    hand-over per (origin, template); ``say`` gets the one-line notes."""

    root: Path = field(default_factory=lambda: cache_dir("compiled", "bundles"))
    say: Callable[[str], None] = _say
    _done: dict[tuple[str, str], DeviceBundle | None] = field(default_factory=dict,
                                                             init=False, repr=False)
    downloaded: int = field(default=0, init=False)  # files fetched (identical bytes: once)

    def ensure(self, native: NativeEngine, server: str, template_id: str,
               token: str | None = None, retry: RetryPolicy | None = None,
               entry: dict[str, Any] | None = None) -> DeviceBundle | None:
        """Make ``native`` use the template's bundle (downloaded once, checked, cached);
        None when the catalog has none (the device exports, and says so once)."""
        key = (server, template_id)
        if key in self._done:
            return self._done[key]
        retry = retry or RetryPolicy()
        if entry is None:
            async def get() -> dict[str, Any]:
                async with PackClient(server, token=token, retry=retry) as c:
                    return await c.template_entry(template_id)

            with NetLoop() as net:
                entry = net.run(get())
        doc = entry.get("bundle")
        if doc is None:
            # said when the device does export (a warm edit, its graphs in the cache, says
            # nothing: it printed on every `sakura edit` of a bundle-less catalog)
            line = (f"note: {server} publishes no device bundle for {template_id} (packs "
                    "built before bundles, or with --no-bundle): this device exports the "
                    "graphs itself, once per geometry")
            native.when_exporting(lambda: self.say(line))
            self._done[key] = None
            return None
        bundle = self.check(doc, native, template_id)
        paths = self.fetch(bundle, server, template_id, token, retry)
        self.use(bundle, paths, native)
        self._done[key] = bundle
        return bundle

    @staticmethod
    def check(doc: Any, native: NativeEngine, template_id: str) -> DeviceBundle:
        """The parsed bundle, or an :class:`EdgeError` saying why it is refused."""
        try:
            bundle = parse_bundle(doc)
        except PackError as exc:
            raise EdgeError(f"the device bundle of {template_id} is refused: {exc}") from None
        why = None
        if bundle.graphs_format != GRAPHS_FORMAT:
            why = (f"its graphs format is {bundle.graphs_format}, this runtime reads "
                   f"{GRAPHS_FORMAT}")
        elif bundle.weights_sha256 != native.weights_sha256:
            why = (f"it was made for model weights {bundle.weights_sha256[:12]}, this device "
                   f"runs {native.weights_sha256[:12]}")
        elif bundle.architecture != native.architecture():
            why = "it was made for another model architecture"
        elif bundle.executorch != exporter_version():
            why = (f"it was exported with {bundle.executorch}, this device runs "
                   f"{exporter_version()}")
        if why:
            raise EdgeError(f"the device bundle of {template_id} is refused: {why} (rebuild "
                            "it with this version of `sakura build`)")
        return bundle

    def fetch(self, bundle: DeviceBundle, server: str, template_id: str,
              token: str | None, retry: RetryPolicy) -> dict[str, Path]:
        """Every file of ``bundle`` in the cache (downloaded and checked where missing).

        A file lives at ``<sha256>/<name>``; files with the same bytes under other names (an
        int8 bundle's graph sets share the fp32 sets' ``step_in`` / ``step_out``) are
        downloaded once and written under every name into that one folder (published whole:
        a folder per name would replace the other names)."""
        paths: dict[str, Path] = {}
        by_sha: dict[str, list[Any]] = {}
        for f in bundle.files:
            paths[f.name] = self.root / f.sha256 / f.name
            by_sha.setdefault(f.sha256, []).append(f)
        missing = []
        for same in by_sha.values():
            try:
                if all(paths[f.name].stat().st_size == f.bytes for f in same):
                    continue
            except OSError:
                pass
            missing.append(same)
        if not missing:
            return paths

        async def get_all() -> list[bytes]:
            async with PackClient(server, token=token, retry=retry) as c:
                return [await c.fetch_file(same[0].key, f"the device bundle file "
                                                        f"{same[0].name} of {template_id}")
                        for same in missing]

        with NetLoop() as net:
            bodies = net.run(get_all())
        for same, data in zip(missing, bodies):
            f = same[0]
            got = hashlib.sha256(data).hexdigest()
            if got != f.sha256 or len(data) != f.bytes:
                raise IntegrityError(
                    f"the device bundle file {f.name} of {template_id} ({f.key}) fails its "
                    f"checksum: {len(data)} bytes with sha256 {got[:16]}..., the catalog "
                    f"says {f.bytes} bytes with {f.sha256[:16]}...; it is not used")

            def fill(tmp: Path, data: bytes = data,
                     names: tuple[str, ...] = tuple(sorted({g.name for g in same}))) -> None:
                for name in names:
                    with open(tmp / name, "wb") as out:
                        out.write(data)
                        out.flush()
                        os.fsync(out.fileno())

            publish_folder(self.root / f.sha256, fill, current=lambda p, names=tuple(
                {g.name for g in same}): all((p / n).is_file() for n in names))
            self.downloaded += 1
        return paths

    @staticmethod
    def use(bundle: DeviceBundle, paths: dict[str, Path], native: NativeEngine) -> None:
        """Hand the bundle's graph chains to ``native`` (by their cache-key digests)."""
        for gs in bundle.graph_sets:
            native.add_graphs(gs.digest, GraphSet(
                paths[gs.step_in], tuple(paths[n] for n in gs.group_files),
                paths[gs.step_out], tuple(len(g) for g in gs.groups), gs.takes_cache,
                gs.dynamic, gs.emits_kv))
