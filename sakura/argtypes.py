"""Value types of the ``sakura`` command line, for argparse's ``type=``.

A value that fails one of these is a usage error: argparse prints the command's usage and
``sakura X: error: argument --opt: ...`` and exits 2, before the command imports anything
heavy. Each type's name says what it accepts; each message says what was wrong.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "at_least",
    "fraction",
    "http_url",
    "json_path",
    "name_list",
    "nonnegative_float",
    "nonnegative_int",
    "port",
    "positive_float",
    "positive_int",
    "prompt_text",
    "seed",
    "seed_below",
    "SEED_LIMIT",
]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def at_least(low: int) -> Callable[[str], int]:
    """An integer >= ``low``."""

    def check(text: str) -> int:
        value = _int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    check.__name__ = f"integer >= {low}"
    return check


positive_int = at_least(1)
nonnegative_int = at_least(0)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    value = _float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text}")
    return value


def port(text: str) -> int:
    """A TCP port, 0-65535 (0: any free port)."""
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0-65535)")
    return value


# Seeds are 0 <= seed < 2**63. torch's generator (``Generator.manual_seed``) takes
# -2**63 .. 2**64 - 1, a negative seed aliasing seed + 2**64, and the edit's noise is drawn
# with seed + 1_000_003 (``dit.editing.edit_noise``); 0 .. 2**63 - 1 keeps every seed
# distinct, in range after that offset, and a signed 64-bit integer in JSON and C++.
SEED_LIMIT = 2**63


def seed_below(limit: int) -> Callable[[str], int]:
    """A noise seed in [0, ``limit``): a command that derives seeds from it (``seed * 1000
    + i``) takes a lower limit, so that every derived seed is one the generator takes."""

    top = f"{limit - 1} (2**63 - 1)" if limit == SEED_LIMIT else f"{limit - 1}"

    def check(text: str) -> int:
        value = _int(text)
        if not 0 <= value < limit:
            raise argparse.ArgumentTypeError(
                f"seed {text} is out of range: give an integer from 0 to {top}")
        return value

    check.__name__ = "seed"
    return check


seed = seed_below(SEED_LIMIT)  # an integer in [0, 2**63)


def prompt_text(text: str) -> str:
    """A prompt: any text that is not empty or only whitespace."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the prompt is empty: give the edit in words, "
                                         "e.g. --prompt 'a red hat'")
    return text


def http_url(text: str) -> str:
    """An ``http://`` or ``https://`` URL with a host (and a valid port, if any)."""
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an http(s) URL such as http://127.0.0.1:8000")
    return text.rstrip("/")


def json_path(text: str) -> str:
    """Where to write JSON: a file path, or ``-`` for standard output."""
    if not text.strip():
        raise argparse.ArgumentTypeError("give a file path, or - for standard output")
    return text


def json_out(parser: Any, help: str = "write the results here (- for stdout)",
             required: bool = True) -> None:
    """The ``--json PATH`` option of a command that writes a JSON result (``-``: stdout)."""
    parser.add_argument("--json", type=json_path, required=required, metavar="PATH",
                        help=help)


def name_list(text: str) -> tuple[str, ...]:
    """A comma-separated list of names (empty items dropped)."""
    return tuple(item.strip() for item in text.split(",") if item.strip())
