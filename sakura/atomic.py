"""The one atomic write: a whole file appears at its path or the old one stays.

The data goes to a temporary file in the same folder (``mkstemp``: a unique name, so two
writers never share one), is flushed and ``fsync``-ed, then renamed over the path with
``os.replace``, and the folder is ``fsync``-ed so that the rename survives a power cut
too. On any error the temporary file is removed and the old file is untouched. Before this
module about ten writes did temp-then-rename each their own way, some without fsync and
some with a fixed ``.tmp`` name that two processes could share. Writes that stream a
large source (``cloud/storage.py``) or that a library writes itself (safetensors in
``dit/weights.py``) keep their own code and follow the same steps. Shared ground: imports
nothing of SAKURA.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> Path:
    """Write ``data`` (text is UTF-8) to ``path`` atomically, creating its folder; returns
    the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else bytes(data)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(out.parent)
    return out


def publish_folder(final: str | os.PathLike[str], build: Callable[[Path], None]) -> Path:
    """Make a whole folder appear at ``final`` at once: ``build(tmp)`` fills a fresh
    temporary folder beside it, a stale or damaged folder under the name is removed, and
    the temporary one is renamed into place (the parent ``fsync``-ed); on any error nothing
    is left behind. Used for the compiled-graph folders of the execution backends and the
    text encoder's program (``edge/backends/``)."""
    out = Path(final)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    try:
        build(tmp)
        if out.exists():
            shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    fsync_dir(out.parent)
    return out


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """``fsync`` a folder so that a rename inside it survives a power cut (quietly nothing
    where the file system does not let a folder be opened or synced)."""
    with contextlib.suppress(OSError):
        dir_fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
