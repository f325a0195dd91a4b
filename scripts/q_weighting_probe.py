"""Issue 33 item 3: why does importance weighting (q = 0.5) lose to plain SVD (q = 0) at 5x
and 50x in `sakura bench codec --quick`?

One quick template (the bench's --quick capture: 6 steps, 1 profiling and 2 evaluation
requests), then the low-rank codec at several (q, floor) settings through the bench's own
path (`run_codec_bench`: real pack, the allocator's per-ratio choice by weighted KV error,
edit PSNR over the mask against exact). Prints and writes docs/bench/q_weighting_probe.json:
per setting the edit PSNR and the importance-weighted KV dB (kv_db, what q = 0.5 minimises
and what the selection uses) at 5x / 15x / 50x.

Usage: python scripts/q_weighting_probe.py [--keys] [--out PATH]
(default PATH: docs/bench/q_weighting_probe.json, with --keys q_weighting_keys.json)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from sakura.codec_bench import model_templates, run_codec_bench

# one q for every shard: q_candidates None (the bench gives sakura the builder's per-shard
# q choice on the output front when a model is there: codec.lowrank.OUTPUT_Q_CHOICE)
FIXED = {"q_candidates": None}
SETTINGS = {
    "svd": {},                                   # q = 0
    "sakura@q025": {**FIXED, "q": 0.25},
    "sakura": FIXED,                             # q = 0.5, floor 1e-3 (the codec's default)
    "sakura@q1": {**FIXED, "q": 1.0},
    "sakura@floor005": {**FIXED, "floor": 0.05},
    "sakura@floor03": {**FIXED, "floor": 0.3},
    # the per-shard choice on the weighted-KV front (q = 0 always a candidate)
    "sakura@qchoice": {"q_candidates": [0.25, 0.5, 1.0], "q_front": "kv", "q_dominate": True},
}

# --keys: the importance weighting on the values only (keys at q = 0: codec option key_q)
KEY_SETTINGS = {
    "svd": {},
    "sakura": FIXED,
    "sakura@kq0": {**FIXED, "key_q": 0.0},
    "sakura@kq0v1": {**FIXED, "key_q": 0.0, "q": 1.0},
    "sakura@kq0f03": {**FIXED, "key_q": 0.0, "floor": 0.3},
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--keys", action="store_true", help="the key/value split settings")
    args = ap.parse_args()
    global SETTINGS
    if args.keys:
        SETTINGS = KEY_SETTINGS
    args.out = args.out or ("docs/bench/q_weighting_keys.json" if args.keys
                            else "docs/bench/q_weighting_probe.json")
    t0 = time.time()
    templates = model_templates(quick=True)
    res = run_codec_bench(templates, SETTINGS, log=lambda s: print(s, flush=True))
    imp = templates[0].cache
    out = {
        "probe": "q_weighting",
        "source": "sakura bench codec --quick capture (face-technologist, 6 steps)",
        "settings": {k: res["codec_options"][k] for k in SETTINGS},
        "psnr_db": res["psnr_db"], "kv_db": res["kv_db"], "bytes": res["bytes"],
        "seconds": round(time.time() - t0, 1),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    del imp
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for k in SETTINGS:
        print(f"{k:24s} psnr " + "  ".join(f"{r}x {v}" for r, v in res["psnr_db"][k].items())
              + " | kv " + "  ".join(f"{v}" for v in res["kv_db"][k].values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
