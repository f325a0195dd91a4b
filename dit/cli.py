"""`sakura train` and `sakura bench kv|model`: the dit package's commands.

Also :func:`template_ids`, the ids of a template catalog read without torch, and
:func:`check_template_images`, its entries' images checked without torch (``dit.images``),
so that commands can reject an unknown template or a bad image before they load anything.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sakura.argtypes import fraction, json_path, nonnegative_float, nonnegative_int, positive_int
from sakura.errors import SakuraError

# Keep in step with dit.train.TrainConfig.out_dir and dit.templates.DEFAULT_CATALOG (not
# imported: they import torch, and the CLI must start fast; tests/sakura checks both).
DEFAULT_TRAIN_DIR = str(Path.home() / ".cache" / "sakura" / "train")
SHIPPED_CATALOG = Path(__file__).parent / "catalog" / "catalog.json"


def _catalog_doc(catalog: str | Path | None) -> tuple[Path, dict]:
    path = Path(catalog) if catalog else SHIPPED_CATALOG
    if path.is_dir():
        path = path / "catalog.json"
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or not isinstance(doc["templates"], dict):
            raise TypeError("'templates' is not an object of template entries")
    except FileNotFoundError:
        raise SakuraError(f"catalog not found: {path}") from None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise SakuraError(f"{path} is not a template catalog ({exc})") from None
    return path, doc


def template_ids(catalog: str | Path | None = None) -> list[str]:
    """The template ids of ``catalog`` (catalog.json or its folder; default: the shipped
    one), in catalog order. The entries themselves are checked by
    ``dit.templates.load_catalog`` when a command loads them."""
    return list(_catalog_doc(catalog)[1]["templates"])


def check_template_images(catalog: str | Path | None, templates: list[str] | tuple[str, ...],
                          resolution: int | None = None) -> None:
    """Read the image and mask of each of ``templates`` (ids of ``catalog``) without torch:
    an unreadable image, a decompression bomb or a declared resolution (``resolution``:
    the one a build asks for instead) above the image's size is one
    :class:`~sakura.dit.images.ImageError` (``dit.images``)."""
    from sakura.dit.images import check_template_files  # lazy: CLI --help stays fast

    path, doc = _catalog_doc(catalog)
    for tid in templates:
        entry = doc["templates"].get(tid)
        what = f"{path}: template {tid!r}"
        try:
            image, mask = path.parent / entry["image"], path.parent / entry["mask"]
            res = int(resolution if resolution is not None else entry.get("resolution", 64))
        except (KeyError, TypeError, ValueError) as exc:
            raise SakuraError(f"{what} is missing or has a bad field: {exc}") from None
        if res < 1:
            raise SakuraError(f"{what}: resolution must be >= 1, got {res}")
        check_template_files(image, mask, res, what)


def check_template(template: str | None, catalog: str | Path | None = None) -> None:
    """Raise :class:`SakuraError` (exit 1) unless ``template`` is in ``catalog`` and its
    image and mask are usable at its resolution (:func:`check_template_images`)."""
    if template is None:
        return
    ids = template_ids(catalog)
    if template not in ids:
        where = f"catalog {catalog}" if catalog else "shipped catalog"
        raise SakuraError(f"template {template!r} is not in the {where} (known: "
                          f"{', '.join(ids)})")
    check_template_images(catalog, [template])


def check_file(path: str | None, option: str) -> None:
    """Raise :class:`SakuraError` (exit 1) unless ``path`` (if given) is a readable file."""
    if path is not None and not Path(path).is_file():
        raise SakuraError(f"{option}: no such file: {path}")


def _train(args: argparse.Namespace) -> int:
    from sakura.dit.train import TrainConfig, train  # lazy: torch

    cfg = TrainConfig(arch=args.arch, steps=args.steps, out_dir=args.out_dir,
                      weights_out=args.weights_out,
                      threads=args.threads, batch_size=args.batch_size,
                      t_uniform=args.t_uniform, variant_power=args.variant_power)
    train(cfg)
    return 0


def _bench_kv(args: argparse.Namespace) -> int:
    check_template(args.template)
    import torch
    from sakura.dit.bench_kv import main  # lazy: torch

    torch.set_num_threads(args.threads)
    return main(args.json, args.quick, args.template)


def _bench_model(args: argparse.Namespace) -> int:
    if args.arch == "flux2":
        if args.weights is not None and not Path(args.weights).is_dir():
            raise SakuraError(f"--weights: no such folder: {args.weights}")
    else:
        check_file(args.weights, "--weights")
    from sakura.dit.bench_model import main  # lazy: torch

    return main(args.json, args.quick, args.grid, args.weights, args.arch)


def register(commands, bench) -> None:
    m = bench.add_parser("model", help="does the model generate its prompts? (classifier check)",
                         description="Generate held-out prompts with the model and check "
                                     "them with a classifier; prints the JSON.")
    m.add_argument("--json", type=json_path, metavar="PATH",
                   help="also write the result JSON here (- for stdout)")
    m.add_argument("--quick", action="store_true", help="4 samples per category, fewer steps")
    m.add_argument("--grid", metavar="PNG", help="also write a held-out sample grid")
    m.add_argument("--weights", metavar="PATH",
                   help="weights file, or folder for --arch flux2 (default: shipped)")
    m.add_argument("--arch", choices=("mmdit", "flux2"), default="mmdit",
                   help="mmdit: the shipped model; flux2: the second model "
                        "(dit/weights/sakura-flux2) (default %(default)s)")
    m.set_defaults(func=_bench_model)

    b = bench.add_parser("kv", help="KV reuse: masked vs full, reference cache, text KV, offload",
                         description="Template-KV reuse on one catalog template: masked "
                                     "vs full execution, reference and text KV, offload.")
    b.add_argument("--json", type=json_path, metavar="PATH",
                   help="write the result JSON here (- for stdout)")
    b.add_argument("--quick", action="store_true", help="fewer steps and repeats (< 60 s)")
    b.add_argument("--template", default="face-technologist", metavar="ID",
                   help="catalog template (default %(default)s)")
    b.add_argument("--threads", type=positive_int, default=1, metavar="N",
                   help="torch threads (default 1, as the edge runtime; more threads than "
                        "free cores slow execution down many times)")
    b.set_defaults(func=_bench_kv)

    p = commands.add_parser("train", help="train the default MMDiT on the emoji data (resumable)",
                            description="Train the shipped MMDiT on the emoji data set; "
                                        "resumes from the last checkpoint in --out-dir.")
    p.add_argument("--steps", type=positive_int, default=20000, metavar="N",
                   help="optimizer steps (default %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=32, metavar="N",
                   help="images per step (default %(default)s)")
    p.add_argument("--arch", choices=("mmdit", "flux2"), default="mmdit",
                   help="mmdit: the shipped model; flux2: the second model, diffusers' "
                        "Flux2Transformer2DModel on the same pixel patches (default %(default)s)")
    p.add_argument("--out-dir", default=None, metavar="DIR",
                   help=f"checkpoints and loss log (default {DEFAULT_TRAIN_DIR}, "
                        f"{DEFAULT_TRAIN_DIR}-flux2 for --arch flux2)")
    p.add_argument("--weights-out", default=None, metavar="PATH",
                   help="where the trained weights go (default "
                        "dit/weights/sakura-mmdit.safetensors, or the folder "
                        "dit/weights/sakura-flux2 for --arch flux2)")
    p.add_argument("--threads", type=nonnegative_int, default=0, metavar="N",
                   help="torch threads (0 = torch's default)")
    p.add_argument("--t-uniform", type=fraction, default=0.5, metavar="FRACTION",
                   help="fraction of samples with uniform t (rest logit-normal; default 0.5)")
    p.add_argument("--variant-power", type=nonnegative_float, default=0.5, metavar="P",
                   help="draw each image with weight (its emoji's skin-tone variants) ** -P, so "
                        "people stop crowding out objects (0 = uniform; default 0.5)")
    p.set_defaults(func=_train)
