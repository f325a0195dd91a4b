"""`sakura demo`: the main job on the embedded defaults, end to end.

1. build the default template's packs (``sakura`` and ``fp16``) with the provider's builder
   if they are missing or stale (``cloud.build``: template run, importance profiling,
   encoding, atomic publish), with the template's device bundle (``sakura.bundle_cli``:
   the graphs, text encoder and tables the device executes, published beside the packs);
2. start ``sakura serve`` on them (a separate process on 127.0.0.1);
3. the device fetches the template from the server's catalog (image, mask, steps: the
   provider's data), encodes its private prompt, and runs the edit with ``sakura`` over a
   real 5G trace (Lumos5G, from ``../shared/traces``) replayed by the paced link, regime-
   matched (FP16 cache at the trace median = 10x the masked execution time); then ``fp16``
   over the same trace window and ``local`` (whole model on the device, no network);
4. prints a side-by-side summary and writes images, timeline plots and JSON to
   ``out/demo/``.

Without ``../shared/traces`` it uses a fixed rate and says so.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sakura.argtypes import nonnegative_float, prompt_text, seed
from sakura.dit.cli import check_file, check_template
from sakura.edge.cli import runtime_arg, startup_fraction
from sakura.traces import Trace, default_trace_dir, load_trace, trace_set

DEFAULT_TEMPLATE = "face-technologist"


def register(commands: Any, bench: Any) -> None:
    p = commands.add_parser("demo", help="the main job: build, serve, replay a real trace, edit",
                            description=__doc__.split("\n\n")[0])
    p.add_argument("--template", default=DEFAULT_TEMPLATE, metavar="ID",
                   help="shipped catalog template (default %(default)s)")
    p.add_argument("--prompt", type=prompt_text,
                   help="private edit prompt (default: the template's first evaluation "
                        "prompt)")
    p.add_argument("--seed", type=seed, default=100, metavar="N",
                   help="edit noise seed, 0 to 2**63 - 1 (default 100)")
    p.add_argument("--out", default="out/demo", metavar="DIR",
                   help="where images, plots and JSON go (default out/demo)")
    p.add_argument("--packs", default="packs", metavar="DIR",
                   help="published catalog directory (default packs)")
    p.add_argument("--trace", metavar="PATH",
                   help="trace file (default: a Lumos5G 5G walking trace)")
    p.add_argument("--start", type=nonnegative_float, default=20.0, metavar="S",
                   help="start offset in the trace (s; default 20)")
    p.add_argument("--startup-fraction", type=startup_fraction, metavar="F",
                   help="startup allowance of the streamed edits, a fraction of the predicted "
                        "execution time (default: the runtime's, EditOptions.startup_fraction)")
    runtime_arg(p, python_needs="")
    p.set_defaults(func=run_demo)


def _save(img, path: Path) -> None:
    from PIL import Image

    arr = ((img.permute(1, 2, 0).clamp(-1, 1) + 1) * 127.5).round().byte().numpy()
    Image.fromarray(arr).resize((arr.shape[1] * 4, arr.shape[0] * 4), Image.NEAREST).save(path)


def side_by_side(panels: list[tuple[Any, str, str]], path: Path, scale: int = 4) -> Path:
    """Images ``[3, H, W]`` in [-1, 1] side by side, each enlarged ``scale`` x (nearest)
    under its label (what it is) and over its caption (how it was made, how close it is)."""
    from PIL import Image, ImageDraw, ImageFont

    arrays = [((img.permute(1, 2, 0).clamp(-1, 1) + 1) * 127.5).round().byte().numpy()
              for img, _, _ in panels]
    h, w = arrays[0].shape[0] * scale, arrays[0].shape[1] * scale
    gap, top, bottom = 8, 30, 24
    font = ImageFont.load_default(size=17)
    small = ImageFont.load_default(size=13)
    sheet = Image.new("RGB", (len(panels) * (w + gap) + gap, top + h + bottom), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (arr, (_, label, caption)) in enumerate(zip(arrays, panels)):
        x = gap + i * (w + gap)
        tile = Image.fromarray(arr).resize((arr.shape[1] * scale, arr.shape[0] * scale),
                                           Image.NEAREST)
        sheet.paste(tile, (x, top))
        draw.text((x + w / 2, top / 2), label, fill="black", font=font, anchor="mm")
        draw.text((x + w / 2, top + h + bottom / 2), caption, fill="#444444", font=small,
                  anchor="mm")
    sheet.save(path)
    return path


def _pick_trace(path: str | None):
    if path:
        return load_trace(path), Path(path).name, None
    root = default_trace_dir()
    if root is None:
        note = ("../shared/traces not found: using a fixed 100 Mbit/s link instead of a real "
                "trace (set SAKURA_TRACES to a trace folder)")
        return Trace.constant(100e6, 1.0), "constant-100mbps", note

    files = trace_set("5g-walking")
    return load_trace(files[0]), files[0].name, None


def _psnr(db: float | None) -> str:
    if db is None:
        return "PSNR n/a"
    return "identical" if db == float("inf") else f"{db:.1f} dB"


def run_demo(args: argparse.Namespace) -> int:
    """``sakura demo``: the arguments checked before anything loads, then the four steps
    (``sakura/demo_run.py``)."""
    check_template(args.template)  # before anything loads
    check_file(args.trace, "--trace")
    from sakura.demo_run import run  # lazy: torch, aiohttp (the demo's steps)

    return run(args)
