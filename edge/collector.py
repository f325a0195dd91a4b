"""Python's cyclic garbage collector paused for an edit.

An edit runs with Python's cyclic garbage collector paused
(:func:`collector_paused`), and it is resumed as it was when the edit returns or raises.
With the shipped model, its graphs and an origin's manifests in memory the process holds
~470k tracked objects, and a full collection of them took 350-460 ms, once every ~8 edits
of the demo's template (15 repeated edits, ``gc.callbacks`` timing; an edit locally is
0.6 s): one such pause inside an edit is the tail of a whole benchmark. The youngest
generation was collected ~36 times per edit (3-4 ms). What an edit allocates is a few
thousand objects, reclaimed at the next collection after it; nothing here relies on a
collection during an edit.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any


@contextlib.contextmanager
def collector_paused() -> Any:
    """Python's cyclic garbage collector off for the block, then back as it was (the
    module docstring has the pauses it avoids; reference counting still frees at once)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
