"""The front-door cases of ``sakura bench faults``: bad inputs refused at the command line.

- ``seed_out_of_range``: ``sakura edit --seed 2**70`` is a usage error naming the range,
  before torch is imported, nothing written;
- ``bomb_image``: a catalog whose template image is a 20000x20000 PNG is refused by
  ``sakura edit --catalog`` and ``sakura build`` as a decompression bomb, before torch;
- ``empty_prompt``: an empty (whitespace) ``--prompt`` is a usage error, nothing written;

Each runs the real ``sakura`` command in a child process whose heavy modules cannot be
imported (torch, the model, the web stack): the error must come from the argument or
catalog check, before anything loads, as one line, with nothing written.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from sakura.dit.cli import SHIPPED_CATALOG
from sakura.faults_harness import Tally, check

INPUT_HEAVY = ("torch", "transformers", "diffusers", "skimage", "safetensors")
BOMB_SIDE = 20_000  # a 20000 x 20000 PNG: 400 M pixels, ~50 KB on disk (1 bit per pixel)


def write_bomb_png(path: Path, side: int = BOMB_SIDE) -> Path:
    """A valid black ``side`` x ``side`` 1-bit PNG: tiny on disk, ``side**2`` pixels
    decoded (PIL's decompression-bomb limit is ~89.5 M; 20000**2 is 400 M)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    row = b"\0" * (1 + (side + 7) // 8)  # filter byte + packed bits
    z = zlib.compressobj(9)
    rows_per_piece = 1000
    parts = [z.compress(row * min(rows_per_piece, side - i))
             for i in range(0, side, rows_per_piece)]
    parts.append(z.flush())
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1-bit greyscale
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
                     + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b""))
    return path


def _front_door(argv: list[str], work: Path) -> tuple[int, list[str], str, float]:
    """``sakura ARGV`` with the heavy modules blocked: (exit code, its ``error:`` lines,
    all of stderr, seconds until it exited)."""
    script = (f"import sys\nfor m in {INPUT_HEAVY!r}: sys.modules[m] = None\n"
              f"from sakura.cli import main\nsys.exit(main({argv!r}))\n")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, cwd=work)
    seconds = time.perf_counter() - t0
    lines = [ln for ln in r.stderr.splitlines() if ": error: " in ln]
    return r.returncode, lines, r.stderr, seconds


def _one_clear_error(argv: list[str], work: Path, code: int, needle: str) -> str:
    """Check that ``sakura ARGV`` fails with exit ``code`` and one error line holding
    ``needle``, no traceback, nothing written to ``work/out``; returns that line."""
    out = work / "out"
    got, lines, err, seconds = _front_door(argv, work)
    check("Traceback" not in err, f"a traceback: {err[-800:]}")
    check(got == code, f"exit {got}, expected {code}: {err[-400:]}")
    check(len(lines) == 1 and needle in lines[0], f"expected one error with {needle!r}: {err}")
    check(not out.exists() or not any(out.iterdir()), f"wrote {sorted(out.iterdir())}")
    return f"{lines[0]} ({seconds:.2f} s, exit {got})"


def _edit_argv(work: Path, *extra: str) -> list[str]:
    (work / "out").mkdir(exist_ok=True)
    return ["edit", "--server", "http://127.0.0.1:9", "--template", "t", "--prompt",
            "a red hat", "--no-state", "--out", str(work / "out" / "edit.png"), *extra]


def case_seed_out_of_range(work: Path, tally: Tally) -> str:
    argv = _edit_argv(work, "--seed", str(2**70))
    return _one_clear_error(argv, work, 2, "argument --seed: seed 1180591620717411303424 is "
                                           "out of range")


def case_empty_prompt(work: Path, tally: Tally) -> str:
    argv = _edit_argv(work)
    argv[argv.index("--prompt") + 1] = " \t "
    return _one_clear_error(argv, work, 2, "the prompt is empty")


def case_bomb_image(work: Path, tally: Tally) -> str:
    """A catalog whose template image is a 20000 x 20000 PNG: refused by `sakura edit
    --catalog` and by `sakura build`, naming the image, before torch is imported."""
    catalog = work / "catalog"
    catalog.mkdir()
    doc = json.loads(SHIPPED_CATALOG.read_text())
    entry = dict(next(iter(doc["templates"].values())))
    entry["image"] = write_bomb_png(catalog / "bomb.png").name
    entry["mask"] = str(SHIPPED_CATALOG.parent / entry["mask"])
    (catalog / "catalog.json").write_text(json.dumps({**doc, "templates": {"bomb": entry}}))
    edit = _edit_argv(work, "--catalog", str(catalog))
    edit[edit.index("--template") + 1] = "bomb"
    message = _one_clear_error(edit, work, 1, "bomb.png: refused as a decompression bomb")
    _one_clear_error(["build", str(catalog), "--out", str(work / "out" / "packs")], work, 1,
                     "bomb.png: refused as a decompression bomb")
    return message
