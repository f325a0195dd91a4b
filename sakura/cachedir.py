"""The one cache-directory rule: ``$SAKURA_CACHE`` when set, else
``$XDG_CACHE_HOME/sakura``, else ``~/.cache/sakura``.

Everything SAKURA keeps between runs lives under it, one folder per use (``cache_dir(
"compiled")`` for the device's compiled graphs, ``"edge"`` for the device state, ``"psnr"``
for the build's fitted PSNR profiles, ``"data"``-style names for fetched training data).
Before this module the rule was written four ways (``SAKURA_CACHE`` in ``dit/data.py`` and
``cloud/build.py``, ``XDG_CACHE_HOME`` in ``edge/cli.py`` and ``edge/backends/base.py``), so
setting one variable moved half of the caches. Shared ground: imports nothing of SAKURA.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "SAKURA_CACHE"  # what a child process (e.g. ``sakura-edge``) is given to move it


def cache_dir(*parts: str) -> Path:
    """SAKURA's cache folder (see the module docstring), joined with ``parts``; not created."""
    root = os.environ.get(ENV_VAR)
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "sakura"
    return base.joinpath(*parts)
