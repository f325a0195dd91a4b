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


def publish_folder(final: str | os.PathLike[str], build: Callable[[Path], None],
                   current: Callable[[Path], bool] | None = None) -> Path:
    """Make a whole folder appear at ``final`` at once: ``build(tmp)`` fills a fresh
    temporary folder beside it, which is then renamed into place (the parent ``fsync``-ed);
    on any error nothing is left behind. Used for the compiled-graph folders of the
    execution backends, the text encoder's program and the device bundle's files
    (``edge/``).

    A folder found under the name once ``build`` is done is either another process's
    publication of the same content, made meanwhile (``current(path)`` says so: it is kept
    and this one dropped, the first writer wins), or a stale or damaged one: it is renamed
    aside, the new one renamed into place, then the old one removed. Two processes that
    compiled the same graph into one cache (two test workers, two device processes) used to
    replace each other's folder with ``rmtree`` while the other loaded from it."""
    out = Path(final)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    aside: Path | None = None
    try:
        build(tmp)
        if out.exists():
            if current is not None and current(out):
                return out
            aside = Path(tempfile.mkdtemp(prefix=".stale-", dir=out.parent))
            with contextlib.suppress(FileNotFoundError):
                os.replace(out, aside)  # (onto an empty folder: allowed)
        try:
            os.replace(tmp, out)
        except OSError:
            # another process put its folder there between the two renames
            if current is not None and current(out):
                return out
            raise
    finally:
        for left in (tmp, aside):
            if left is not None and left.exists():
                shutil.rmtree(left, ignore_errors=True)
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
