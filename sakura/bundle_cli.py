"""The device bundle at the app layer: the builder's exporter and ``sakura bench bundle``.

``sakura build`` is the cloud package's command, and the cloud may not import the edge
(``tests/test_layering.py``: the edge imports the cloud). The bundle's export is the
edge's (``sakura.edge.bundle``: the graphs the native runtime runs), so this module, which
may import both, hands :data:`export_for_build` (a :class:`DeviceBundleExporter`) to the
build command as its default
``bundle_exporter`` (``--no-bundle`` turns it off), and ``sakura demo`` passes it too.

``sakura bench bundle --json PATH`` measures one bundle of the shipped model's default
template (:func:`sakura.edge.bundle_bench.bundle_figures`): ``{bytes, files, export_s,
device_export_s_saved}``; ``docs/bench/bundle.json`` is its record.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sakura.argtypes import json_path, positive_int
from sakura.codec import DEFAULT_BLOCKS_PER_SHARD
from sakura.output import write_json

DEFAULT_TEMPLATE = "face-technologist"


class DeviceBundleExporter:
    """``cloud.build.BundleExporter`` of the shipped MMDiT's device bundle."""

    def export(self, engine: Any, device: Any, blocks_per_shard: int, work: Path
               ) -> tuple[list[tuple[str, str, Path]], dict] | None:
        """The device bundle of ``device`` (a ``dit.editing.Template``) for the shipped
        MMDiT; None for other engines (the native runtime runs only the shipped model)."""
        from sakura.dit.adapters.engine import DefaultEngine  # lazy: torch
        from sakura.edge.backends.base import weights_sha256  # lazy: torch
        from sakura.edge.bundle import export_bundle  # lazy: torch, executorch

        if not isinstance(engine, DefaultEngine):
            return None
        model = engine.model
        # the shapes of a device request: the encoder's tokens, the unconditional prompt
        req = engine.request(device.prompt or "", 0)
        made = export_bundle(model, engine.weights_id or weights_sha256(model), device, req,
                             min(blocks_per_shard, model.cfg.num_blocks), work=work)
        return made.files, made.doc

    def is_current(self, bundle: dict) -> bool:
        """Whether a published bundle is what :meth:`export` makes now
        (``sakura.edge.bundle.bundle_is_current``): a stale one is exported again."""
        from sakura.edge.bundle import bundle_is_current  # lazy: torch, executorch

        return bundle_is_current(bundle)


export_for_build = DeviceBundleExporter()


def register(commands: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    build = commands.choices.get("build")
    if build is not None:
        build.set_defaults(bundle_exporter=export_for_build)
    p = bench.add_parser(
        "bundle", help="the device bundle of the shipped model: bytes, files, cloud export "
                       "time and the device export time it saves",
        description="Export the default template's device bundle in the cloud (fresh "
                    "caches), serve it with sakura serve on loopback, and on a fresh device "
                    "time loading it against exporting the same graphs there.")
    p.add_argument("--template", default=DEFAULT_TEMPLATE, metavar="ID",
                   help=f"a template of the shipped catalog (default {DEFAULT_TEMPLATE})")
    p.add_argument("--blocks-per-shard", type=positive_int, default=DEFAULT_BLOCKS_PER_SHARD, metavar="N",
                   help="blocks per shard of the cached chain (default %(default)s, as sakura build)")
    p.add_argument("--json", type=json_path, default="-", metavar="PATH",
                   help="write the figures here (- for stdout)")
    p.set_defaults(func=_bench_bundle)


def _bench_bundle(args: argparse.Namespace) -> int:
    from sakura.edge.bundle_bench import bundle_figures  # lazy: torch, executorch

    doc = bundle_figures(args.template, blocks_per_shard=args.blocks_per_shard)
    write_json(args.json, doc)
    return 0
