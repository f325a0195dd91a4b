"""`sakura bench adapters`: the adapters' command (registered by ``sakura.cli``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from sakura.argtypes import json_path
from sakura.errors import SakuraError, UsageError
from sakura.extras import require

# dit.adapters.bench.KINDS (not imported: it imports torch; tests/sakura checks they agree)
BENCH_MODELS = ("flux2", "sd3.5", "qwenimage", "qwenimage-2.1")


def model_list(text: str) -> tuple[str, ...]:
    """``--models``: a comma-separated subset of :data:`BENCH_MODELS`."""
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in names if m not in BENCH_MODELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown model(s) {', '.join(unknown) or '(none given)'}; choose from "
            f"{','.join(BENCH_MODELS)}")
    return names


def runs_native(model: str | None) -> bool:
    """Whether ``--model`` runs on the native runtime: the shipped model, and a model
    converted into its form (``ModelSpec.mmdit_form``, e.g. sakura-flux2); the other
    diffusers models run the Python shard loop through their adapters."""
    if model is None:
        return True
    from sakura.dit.adapters.registry import MODELS  # lazy: torch

    return model in MODELS and MODELS[model].mmdit_form


def check_model_options(model: str | None, model_path: str | None,
                        weights: str | None, reference: bool = False) -> None:
    """``--model`` / ``--model-path`` / ``--weights`` (and ``edit``'s ``--reference``) of
    ``build`` and ``edit``, checked before anything loads: a usage error (exit 2) for a bad
    combination or an unknown model name, a :class:`SakuraError` (exit 1) for a checkpoint
    folder that is not there."""
    if model is None:
        if model_path is not None:
            raise UsageError("--model-path needs --model (the checkpoint's model name)")
        return
    if weights:
        raise UsageError("--weights is the shipped model's; a --model checkpoint is given by "
                         "--model-path")
    require("diffusers", what="--model")
    from sakura.dit.adapters.registry import MODELS, read_checkpoint  # lazy: torch

    if model not in MODELS:
        raise UsageError(f"--model: unknown model {model!r}; choose one of "
                         f"{', '.join(sorted(MODELS))}")
    if reference and not MODELS[model].references:
        raise UsageError(f"--reference: {model} was trained without reference images; "
                         "reference edits need the shipped model (no --model) or a diffusers "
                         "model that takes them")
    if model_path is None:
        if MODELS[model].default_path is None:
            raise UsageError(f"--model {model} needs --model-path (a local checkpoint folder)")
        model_path = str(MODELS[model].default_path)
        if not Path(model_path).is_dir():
            raise SakuraError(f"--model {model}: no weights at {model_path} (sakura train "
                              f"--arch flux2 writes them)")
    if not Path(model_path).expanduser().is_dir():
        raise SakuraError(f"--model-path: no such folder: {model_path}")
    # the checkpoint's own config says whether it is that model (no weights read yet)
    read_checkpoint(model, model_path)


def _bench_adapters(args: argparse.Namespace) -> int:
    require("diffusers", what="sakura bench adapters")
    from sakura.dit.adapters.bench import main  # lazy: torch

    return main(args.json, args.quick, ",".join(args.models) if args.models else None)


def register(commands, bench) -> None:
    b = bench.add_parser(
        "adapters",
        help="diffusers adapters: exactness, masked speed-up, reference/prefix KV, cache geometry",
        description="The diffusers adapters on test-size models: cached edit vs the pinned "
                    "reference, masked speed-up, reference/prefix KV, cache geometry.")
    b.add_argument("--json", type=json_path, metavar="PATH",
                   help="write the result JSON here (- for stdout)")
    b.add_argument("--quick", action="store_true", help="test-size models, 4 steps, 1 repeat")
    b.add_argument("--models", type=model_list, metavar="LIST",
                   help=f"comma-separated subset of {','.join(BENCH_MODELS)} (default all)")
    b.set_defaults(func=_bench_adapters)
