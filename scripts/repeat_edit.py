"""Experiment: an app's repeated edits, as a user runs them (issue 28, "Rate memory").

The ``repeat_edit`` part of ``sakura bench tail`` on its own (``edge.replay.tail.
repeat_edits``, which defines it): pairs of native-runtime edits 30 s apart over the same
window of a Lumos5G trace with the device state kept and no rate prior, beside the same
edit given the trace's rate; medians over the pairs, and every edit. Run ``./scripts/demo``
first (it builds ``packs/``).

    .venv/bin/python scripts/repeat_edit.py --json docs/bench/repeat-edit.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--packs", default="packs", type=Path)
    ap.add_argument("--windows", type=float, nargs="+", default=None,
                    help="trace start of each pair's first edit (s; default the bench's)")
    ap.add_argument("--gap", type=float, default=None, help="seconds between a pair's edits")
    args = ap.parse_args()

    import torch
    from sakura.dit.adapters.engine import load_engine
    from sakura.edge.replay.tail import REPEAT_GAP_S, REPEAT_WINDOWS, repeat_edits

    torch.set_num_threads(1)
    doc = repeat_edits(args.packs, load_engine(None, None), print,
                       tuple(args.windows or REPEAT_WINDOWS),
                       REPEAT_GAP_S if args.gap is None else args.gap)
    doc["conditions"]["load_avg"] = os.getloadavg()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"repeat_edit": doc}, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if k != "pairs"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
