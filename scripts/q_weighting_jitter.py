"""Issue 33 item 3, second probe: how much does the edit PSNR of svd (q = 0) and sakura
(q = 0.5) move between nearby byte budgets (ratios 10% either side of 5x / 15x / 50x)?
If the gap between q = 0 and q = 0.5 at one ratio is inside that spread, one ratio's
ranking is not evidence either way. Also the importance profile's shape (what q weights):
per (step, block) max / mean and the share of tokens under 0.1 x mean.

The bench's --quick capture; the bench's own path (`run_codec_bench`). Writes
docs/bench/q_weighting_jitter.json.

Usage: python scripts/q_weighting_jitter.py [--out docs/bench/q_weighting_jitter.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from sakura.codec_bench import model_templates, run_codec_bench

CENTRES = (5, 15, 50)
RATIOS = tuple(sorted({round(c * f, 2) for c in CENTRES for f in (0.9, 1.0, 1.1)}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/bench/q_weighting_jitter.json")
    args = ap.parse_args()
    t0 = time.time()
    templates = model_templates(quick=True)
    imp = templates[0].cache.importance.double()  # [steps, blocks, tokens]
    norm = imp / imp.mean(-1, keepdim=True).clamp_min(1e-30)
    shape = {"max_over_mean_median": round(float(norm.amax(-1).median()), 3),
             "max_over_mean_max": round(float(norm.amax(-1).max()), 3),
             "share_below_0_1_mean": round(float((norm < 0.1).double().mean()), 4),
             "share_below_1e-3_mean": round(float((norm < 1e-3).double().mean()), 4)}
    res = run_codec_bench(templates, {"svd": {}, "sakura": {"q_candidates": None}}, ratios=RATIOS,  # type: ignore[arg-type]
                          log=lambda s: print(s, flush=True))
    out: dict = {"probe": "q_weighting_jitter", "ratios": [str(r) for r in RATIOS],
                 "importance": shape, "psnr_db": res["psnr_db"], "kv_db": res["kv_db"],
                 "spread": {}}
    for c in CENTRES:
        keys = [str(round(c * f, 2)) for f in (0.9, 1.0, 1.1)]
        gaps = [res["psnr_db"]["sakura"][k] - res["psnr_db"]["svd"][k] for k in keys]
        out["spread"][str(c)] = {
            "svd_range_db": round(max(res["psnr_db"]["svd"][k] for k in keys)
                                  - min(res["psnr_db"]["svd"][k] for k in keys), 3),
            "sakura_range_db": round(max(res["psnr_db"]["sakura"][k] for k in keys)
                                     - min(res["psnr_db"]["sakura"][k] for k in keys), 3),
            "gap_sakura_minus_svd_db": [round(g, 3) for g in gaps],
            "gap_mean_db": round(statistics.mean(gaps), 3)}
    out["seconds"] = round(time.time() - t0, 1)
    out["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({"importance": shape, "spread": out["spread"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
