"""``sakura backends aihub compile|profile``: shard graphs on Qualcomm AI Hub devices.

``compile`` uploads one shard graph (an ONNX file, or the graph of a catalog template's
block group exported on the spot from the shipped model) and submits a compile job to a
QNN context binary for the device; ``--profile`` waits for it and profiles the result.
``profile`` profiles the model of an earlier compile job (or a model id). Profile jobs run
on AI Hub's generated inputs: nothing of any request leaves the machine.

The token comes from ``QAI_HUB_API_TOKEN`` or qai-hub's config file; without one the
command prints one ``sakura: error:`` line saying how to set it, before exporting or
uploading anything (``edge.backends.aihub``). Imports are lazy (``sakura --help`` stays
fast).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sakura.codec import DEFAULT_BLOCKS_PER_SHARD
from sakura.edge.backends.errors import AIHubError


def register(commands: Any, bench: Any) -> None:
    backends = commands.add_parser(
        "backends", help="execution backends: Qualcomm AI Hub jobs of shard graphs",
        description="Execution backends of the edge runtime (sakura bench backends "
                    "measures them).")
    sub = backends.add_subparsers(dest="backends_command", metavar="COMMAND")
    aihub = sub.add_parser(
        "aihub", help="compile / profile shard graphs on Qualcomm AI Hub devices",
        description="Qualcomm AI Hub jobs (token: QAI_HUB_API_TOKEN or `qai-hub "
                    "configure`). Only the shard graph (weights + ops) is uploaded.")
    jobs = aihub.add_subparsers(dest="aihub_command", metavar="JOB")

    c = jobs.add_parser(
        "compile", help="upload a shard graph and compile it to a QNN context binary",
        description="Upload one shard graph and submit an AI Hub compile job for the "
                    "device (QNN context binary); --profile also profiles the result.")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--onnx", metavar="FILE", help="a shard graph's ONNX export (e.g. "
                     "onnx/shard.onnx of a qnn backend artifact folder)")
    src.add_argument("--template", metavar="ID",
                     help="export the shard graph of this catalog template")
    c.add_argument("--group", type=int, default=0, metavar="N",
                   help="with --template: which block group of a step (default 0)")
    c.add_argument("--blocks-per-shard", type=int, default=DEFAULT_BLOCKS_PER_SHARD, metavar="N",
                   help="with --template: blocks per shard graph (default %(default)s)")
    c.add_argument("--weights", metavar="FILE",
                   help="with --template: model weights (default: the shipped model)")
    c.add_argument("--out", metavar="DIR", help="with --template: keep the export here "
                   "(default: a temporary folder)")
    c.add_argument("--profile", action="store_true",
                   help="wait for the compile job, then profile the compiled model")
    _common(c)
    c.set_defaults(func=_compile)

    p = jobs.add_parser(
        "profile", help="profile a compiled shard graph on the device",
        description="Submit an AI Hub profile job (AI Hub's generated inputs) of the "
                    "model of a compile job, or of a model id.")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--compile-job", metavar="ID", help="compile job id (waits for it)")
    which.add_argument("--model", metavar="ID", help="an AI Hub model id")
    _common(p)
    p.set_defaults(func=_profile)


def _common(p: argparse.ArgumentParser) -> None:
    device = "Snapdragon 8 Elite QRD"  # aihub.DEFAULT_DEVICE (not imported: lazy CLI)
    p.add_argument("--device", default=device, metavar="NAME",
                   help=f"AI Hub device (default {device!r})")
    p.add_argument("--options", metavar="FLAGS", default=None,
                   help="qai-hub job options, written --options='...' (compile default: "
                        "--target_runtime qnn_context_binary)")
    p.add_argument("--json", metavar="PATH", help="write the job ids and pages here")


def _config(args: argparse.Namespace, kind: str):
    from sakura.edge.backends.aihub import AIHubConfig  # lazy: CLI --help stays fast

    base = AIHubConfig(device=args.device)
    if args.options is None:
        return base
    if kind == "compile":
        return AIHubConfig(device=args.device, compile_options=args.options)
    return AIHubConfig(device=args.device, profile_options=args.options)


def _write(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    for key in ("compile_job", "profile_job"):
        if key in doc:
            print(f"{key.replace('_', ' ')} {doc[key]['id']}: {doc[key]['url']}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")


def _compile(args: argparse.Namespace) -> int:
    from sakura.edge.backends import aihub  # lazy: CLI --help stays fast

    aihub.require_token()   # before any export or upload
    hub = aihub.load_hub()
    config = _config(args, "compile")
    if args.onnx:
        aihub.upload_path(Path(args.onnx))  # a missing file: one error line
        return _submit(args, Path(args.onnx), config, hub)
    if args.group < 0 or args.blocks_per_shard < 1:
        raise AIHubError("--group must be >= 0 and --blocks-per-shard >= 1")
    import tempfile

    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        return _submit(args, export_template_shard(args, out), config, hub)
    with tempfile.TemporaryDirectory(prefix="sakura-aihub-") as tmp:
        return _submit(args, export_template_shard(args, Path(tmp)), config, hub)


def _submit(args: argparse.Namespace, onnx: Path, config: Any, hub: Any) -> int:
    from sakura.edge.backends import aihub  # lazy: CLI --help stays fast

    if args.profile:
        jobs = aihub.submit_shard_jobs(onnx, config, hub)
    else:
        jobs = aihub.submit_compile(onnx, config, hub)
    _write(args, {"device": config.device, **jobs.summary()})
    return 0


def export_template_shard(args: argparse.Namespace, out: Path) -> Path:
    """The ONNX graph of block group ``args.group`` of a catalog template's edit geometry
    (the same export the qnn backend compiles), written under ``out``."""
    from sakura.dit.editing import Geometry  # lazy: torch
    from sakura.dit.templates import load_catalog  # lazy: torch
    from sakura.dit.text import TextEncoder  # lazy: torch
    from sakura.dit.weights import DEFAULT_WEIGHTS, load_model  # lazy: torch
    from sakura.edge.backends.executor import edit_geometry, step_groups  # lazy: torch
    from sakura.edge.backends.qnn_backend import ONNX_NAME, QnnBackend  # lazy: torch
    from sakura.edge.backends.shard import ShardModule, example_inputs  # lazy: torch

    catalog = load_catalog()
    if args.template not in catalog:
        raise AIHubError(f"template {args.template!r} is not in the catalog "
                         f"(known: {', '.join(catalog)})")
    weights = Path(args.weights) if args.weights else DEFAULT_WEIGHTS
    if not weights.is_file():
        raise AIHubError(f"--weights: no such file: {weights}")
    model = load_model(weights)
    groups = step_groups(model.cfg.num_blocks, args.blocks_per_shard)
    if args.group >= len(groups):
        raise AIHubError(f"--group {args.group}: the model has {len(groups)} block groups "
                         f"of {args.blocks_per_shard}")
    spec = catalog[args.template]
    encoder = TextEncoder(model.cfg.text_tokens)
    template = spec.to_template(encoder)
    req = spec.requests(encoder)[0]
    geometry = edit_geometry(model, template, Geometry.of(model, template), req)
    blocks = groups[args.group]
    qnn = QnnBackend()
    module = ShardModule(model, blocks, geometry, qnn.explicit_rms, qnn.sigmoid_gelu).eval()
    path = out / f"{args.template}-{geometry.describe()}-b{blocks[0]}-{blocks[-1]}" / ONNX_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"exporting blocks {blocks[0]}-{blocks[-1]} of {args.template} "
          f"({geometry.describe()}) to {path}", file=sys.stderr)
    return qnn.export_onnx(module, example_inputs(model, blocks, geometry), path)


def _profile(args: argparse.Namespace) -> int:
    from sakura.edge.backends import aihub  # lazy: CLI --help stays fast

    aihub.require_token()
    hub = aihub.load_hub()
    config = _config(args, "profile")
    if args.compile_job:
        model = aihub.compiled_model_of_job(args.compile_job, hub)
        name = f"{config.name_prefix}-{args.compile_job}-profile"
    else:
        model, name = args.model, f"{config.name_prefix}-{args.model}-profile"
    job = aihub.submit_profile(model, config, hub, name=name)
    _write(args, {"device": config.device, "profile_job": aihub.job_summary(job)})
    return 0
