"""Bad inputs at the front door (issue 29, item 4): seeds, prompts and catalog images.

Each is one clear error before anything heavy loads (a usage error, exit 2, for an argument;
one ``sakura: error:`` line, exit 1, for a catalog), with nothing written; a long prompt is
truncated to the encoder's window and says how many tokens it kept.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sakura.dit.images import ImageError

from sakura.argtypes import SEED_LIMIT
from sakura.cli import build_parser
from sakura.faults_front_door import write_bomb_png
from tests.sakura.test_cli import EDIT, ROOT, error_lines, invoke

SHIPPED = ROOT / "dit" / "catalog"
HEAVY = ("torch", "transformers", "diffusers", "skimage", "safetensors", "fastapi")

USAGE = [
    ([*EDIT, "--out", "{tmp}/o.png", "--seed", str(2**70)],
     "argument --seed: seed 1180591620717411303424 is out of range: give an integer from 0 "
     "to 9223372036854775807"),
    ([*EDIT, "--out", "{tmp}/o.png", "--seed", str(2**63)], "is out of range"),
    ([*EDIT, "--out", "{tmp}/o.png", "--seed", "-1"], "seed -1 is out of range"),
    ([*EDIT, "--out", "{tmp}/o.png", "--seed", "1.5"], "'1.5' is not an integer"),
    (["demo", "--seed", str(2**64)], "argument --seed: seed 18446744073709551616 is out"),
    (["bench", "link", "--seed", "-3"], "argument --seed: seed -3 is out of range"),
    (["traces", "mahimahi", "--mixed", str(2**63)], "argument --mixed: seed"),
    (["render", "replay", "--seed", str(2**62)], "argument --seed: seed"),
    (["edit", "--server", "http://127.0.0.1:9", "--template", "t", "--prompt", "",
      "--out", "{tmp}/o.png"], "argument --prompt: the prompt is empty"),
    (["edit", "--server", "http://127.0.0.1:9", "--template", "t", "--prompt", " \t\n ",
      "--out", "{tmp}/o.png"], "argument --prompt: the prompt is empty"),
    (["demo", "--prompt", "  "], "argument --prompt: the prompt is empty"),
]


@pytest.mark.parametrize("argv,needle", USAGE, ids=[" ".join(a[-2:]) for a, _ in USAGE])
def test_bad_seed_or_prompt_is_a_usage_error(argv, needle, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path) for a in argv]
    code, _out, err = invoke(argv, capsys)
    assert code == 2, err
    assert "usage: sakura" in err and needle in err, err
    assert len([ln for ln in err.splitlines() if ": error: " in ln]) == 1, err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_every_seed_the_parser_takes_is_one_the_sampler_takes():
    """The top of the range works with the edit's noise offset (seed + 1_000_003)."""
    import torch
    from sakura.dit.sampler import noise_like

    parser = build_parser()
    top = SEED_LIMIT - 1
    args = parser.parse_args([*EDIT, "--out", "o.png", "--seed", str(top)])
    assert args.seed == top
    noise_like((2, 3), args.seed + 1_000_003)  # no OverflowError
    assert not torch.equal(noise_like((4,), 0), noise_like((4,), top))
    assert parser.parse_args(["demo", "--seed", "0"]).seed == 0


def test_bad_seed_costs_nothing_heavy(tmp_path):
    """The seed and prompt checks run at parse time: with torch unimportable the error is
    still the usage error, exit 2."""
    for argv in ([*EDIT, "--out", str(tmp_path / "o.png"), "--seed", str(2**70)],
                 [*EDIT[:6], "--prompt", "", "--out", str(tmp_path / "o.png")]):
        code, err = _blocked(argv, tmp_path)
        assert code == 2 and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------ prompts


def test_token_counts_of_the_shipped_encoder(text_encoder):
    assert text_encoder.max_tokens == 16
    assert text_encoder.token_counts("a red hat") == (5, 5)  # CLS a red hat SEP
    fourteen = " ".join(["hat"] * 14)
    assert text_encoder.token_counts(fourteen) == (16, 16)
    assert text_encoder.token_counts(fourteen + " hat") == (16, 17)
    kept, total = text_encoder.token_counts("pirate " * 20_000)  # ~140 KB
    assert (kept, total) == (16, 20_002)
    # what encode keeps is exactly the first 14 word tokens (and SEP)
    long = text_encoder.encode([fourteen + " and a great deal more"])
    assert long.shape == (1, 16, text_encoder.dim)


class _Runtime:
    default_model = True

    def __init__(self, encoder):
        self.encoder = encoder


def test_a_truncated_prompt_says_how_many_tokens_it_kept(text_encoder, capsys):
    from sakura.edge.cli import prompt_tokens

    doc = prompt_tokens(_Runtime(text_encoder), "a red hat")
    assert doc == {"prompt_tokens_kept": 5, "prompt_tokens_total": 5,
                   "prompt_tokens_window": 16}
    assert capsys.readouterr().err == ""
    doc = prompt_tokens(_Runtime(text_encoder), "word " * 40)
    assert doc["prompt_tokens_kept"] == 16 and doc["prompt_tokens_total"] == 42
    err = capsys.readouterr().err.splitlines()
    assert err == ["sakura: warning: the prompt is 42 tokens; the text encoder's window keeps "
                   "the first 16 (with CLS and SEP) and drops the other 26"]


# ------------------------------------------------------------------ catalog images


def _catalog(tmp_path: Path, image: Path | None = None, mask: Path | None = None,
             **fields) -> Path:
    """A one-template catalog (the shipped face-cook entry) in its own folder."""
    doc = json.loads((SHIPPED / "catalog.json").read_text())
    entry = dict(doc["templates"]["face-cook"])
    entry["image"] = str(image or SHIPPED / entry["image"])
    entry["mask"] = str(mask or SHIPPED / entry["mask"])
    entry.update(fields)
    folder = tmp_path / "catalog"
    folder.mkdir(exist_ok=True)
    (folder / "catalog.json").write_text(json.dumps({**doc, "templates": {"face-cook": entry}}))
    return folder


def _bad_images(tmp_path: Path) -> dict[str, tuple[dict, str]]:
    """case -> (catalog fields, what the one error line says)."""
    bomb = write_bomb_png(tmp_path / "bomb.png")
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes((SHIPPED / "face-cook.png").read_bytes()[:300])
    text = tmp_path / "notes.png"
    text.write_text("not an image\n")
    return {
        "bomb": ({"image": bomb}, "bomb.png: refused as a decompression bomb: 400,000,000 "
                                  "pixels"),
        "truncated": ({"image": truncated}, "truncated.png: cannot read the image"),
        "not-an-image": ({"image": text}, "notes.png: cannot read the image"),
        "upscale": ({"resolution": 4096}, "the declared resolution 4096 px is above the "
                                          "image's 64x64: templates are only resized down"),
        "upscale-mask": ({"mask": _small_mask(tmp_path)}, "mask small-mask.png: the declared "
                                                          "resolution 64 px is above"),
    }


def _small_mask(tmp_path: Path) -> Path:
    path = tmp_path / "small-mask.png"
    Image.fromarray(np.full((32, 32), 255, np.uint8)).save(path)
    return path


CASES = ("bomb", "truncated", "not-an-image", "upscale", "upscale-mask")


def _fields(case: str, tmp_path: Path) -> tuple[Path, str]:
    fields, needle = _bad_images(tmp_path)[case]
    image, mask = fields.pop("image", None), fields.pop("mask", None)
    return _catalog(tmp_path, image, mask, **fields), needle


@pytest.mark.parametrize("case", CASES)
def test_a_bad_catalog_image_is_one_error_before_torch(case, tmp_path):
    catalog, needle = _fields(case, tmp_path)
    out = tmp_path / "out"
    for argv in (["edit", "--server", "http://127.0.0.1:9", "--template", "face-cook",
                  "--prompt", "a red hat", "--no-state", "--catalog", str(catalog),
                  "--out", str(out / "o.png")],
                 ["build", str(catalog), "--out", str(out / "packs")]):
        code, err = _blocked(argv, tmp_path)
        lines = error_lines(err)
        assert code == 1 and len(lines) == 1 and needle in lines[0], (argv, err)
        assert "template 'face-cook'" in lines[0]
        assert "Traceback" not in err
        assert not out.exists()


@pytest.mark.parametrize("case", CASES)
def test_loading_a_bad_template_image_is_an_image_error(case, tmp_path):
    """The library path (cloud.build, the benches) raises the same error."""
    from sakura.dit.templates import load_catalog

    catalog, needle = _fields(case, tmp_path)
    spec = load_catalog(catalog)["face-cook"]
    with pytest.raises(ImageError, match=re.escape(needle)):
        spec.load_image()
        spec.load_mask()


def test_a_larger_image_is_resized_down(tmp_path):
    from sakura.dit.cli import check_template_images
    from sakura.dit.templates import load_catalog

    big = tmp_path / "big.png"
    Image.open(SHIPPED / "face-cook.png").resize((128, 128), Image.BICUBIC).save(big)
    catalog = _catalog(tmp_path, image=big)
    check_template_images(catalog, ["face-cook"])
    assert tuple(load_catalog(catalog)["face-cook"].load_image().shape) == (3, 64, 64)
    with pytest.raises(ImageError, match="resolution 256 px is above the image's 128x128"):
        check_template_images(catalog, ["face-cook"], resolution=256)  # build --resolution


def test_a_bomb_in_a_published_entry_is_an_edge_error(tmp_path):
    import base64

    from sakura.edge.errors import EdgeError
    from sakura.edge.templates import template_from_entry

    bomb = base64.b64encode(write_bomb_png(tmp_path / "bomb.png").read_bytes()).decode()
    png = base64.b64encode((SHIPPED / "face-cook-mask.png").read_bytes()).decode()
    entry = {"template": {"image_png_b64": bomb, "mask_png_b64": png, "steps": 4,
                          "guidance": 3.0, "seed": 1}}
    with pytest.raises(EdgeError, match="refused as a decompression bomb"):
        template_from_entry("t", entry)
    entry["template"]["seed"] = 2**64
    entry["template"]["image_png_b64"] = png
    with pytest.raises(EdgeError, match="is not a seed from 0 to"):
        template_from_entry("t", entry)


@pytest.mark.parametrize("fields,needle", [
    ({"seed": 2**70}, "seed must be 0 to 9223372036854775807"),
    ({"seed": -2}, "seed must be 0 to"),
    ({"resolution": 0}, "resolution must be >= 1"),
    ({"resolution": "64"}, "resolution must be a finite number"),
    ({"seed": 1e400}, "seed must be a finite number"),
    ({"prompt": 5}, "prompt must be a string"),
])
def test_bad_catalog_fields_are_catalog_errors(fields, needle, tmp_path):
    from sakura.dit.templates import CatalogError, load_catalog

    with pytest.raises(CatalogError, match=needle):
        load_catalog(_catalog(tmp_path, **fields))


def _blocked(argv: list[str], cwd: Path) -> tuple[int, str]:
    """``sakura ARGV`` in a child process that cannot import torch or the model stack."""
    script = (f"import sys\nfor m in {HEAVY!r}: sys.modules[m] = None\n"
              f"from sakura.cli import main\nsys.exit(main({argv!r}))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, cwd=cwd)
    return r.returncode, r.stderr
