"""Issue 33 item 3: the per-shard choice of q on the OUTPUT front (codec option
``q_front="output"``) versus the weighted-KV front, through `sakura bench codec --quick`'s
own path (`run_codec_bench`: real pack, the allocator's per-ratio choice, edit PSNR over the
mask on the evaluation requests against exact). The output front is measured on the
template's profiling requests (all 3 by default, as the builder; `cloud.psnr_profile.
OutputPSNR`: one shard changed, whole-image PSNR), never on the evaluation requests.

Prints and writes docs/bench/q_output_probe.json: per setting the edit PSNR (mean and per
template), kv_db and the q chosen per shard.

Usage: python scripts/q_output_probe.py [--template ID ...] [--set NAME ...]
       [--measure-requests N] [--extra JSON] [--out PATH]
(docs/bench/q_output_probe.json: --template face-technologist --template tryon-tuxedo
 --template edit-apple-leaf, the full bench's templates at the quick geometry)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path

from sakura.codec_bench import model_templates, run_codec_bench

SETTINGS = {
    "svd": {},
    "sakura": {},                                        # the bench's default: the builder's
    "sakura@fixed": {"q_candidates": None},              # q = 0.5 everywhere (before)
    # the output front, candidates kept only if no worse than q = 0 at every ratio
    "sakura@outdom": {"q_candidates": [0.25, 0.5, 1.0], "q_front": "output", "q_dominate": True},
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/bench/q_output_probe.json")
    ap.add_argument("--set", nargs="*", default=None, help="settings to run (default: all)")
    ap.add_argument("--measure-requests", type=int, default=None,
                    help="profiling requests the output measure edits (default: all, as the builder)")
    ap.add_argument("--template", action="append", default=None,
                    help="catalog template(s) (default: the quick bench's one)")
    ap.add_argument("--extra", default=None,
                    help='JSON object of more settings, e.g. \'{"sakura@x": {"q": 1}}\'')
    args = ap.parse_args()
    settings = dict(SETTINGS)
    if args.extra:
        settings.update(json.loads(args.extra))
    if args.set:
        settings = {k: settings[k] for k in args.set}
    t0 = time.time()
    templates = model_templates(quick=True, template_ids=args.template,
                                measure_requests=args.measure_requests)
    res = run_codec_bench(templates, settings, log=lambda s: print(s, flush=True))
    chosen, out_db, per_tpl = {}, {}, {}
    for k in settings:
        recs = {t.template_id: res["per_template"][t.template_id]["codecs"][k] for t in templates}
        out_db[k] = {t: r.get("q_output_db") for t, r in recs.items()}
        chosen[k] = [q for r in recs.values() for q in (r.get("q_chosen") or [])]
        per_tpl[k] = {t: {rr: (e or {}).get("psnr_db") for rr, e in r["ratios"].items()}
                      for t, r in recs.items()}
    out = {
        "probe": "q_output",
        "source": "sakura bench codec --quick capture (6 steps)",
        "settings": {k: res["codec_options"][k] for k in settings},
        "psnr_db": res["psnr_db"], "kv_db": res["kv_db"], "bytes": res["bytes"],
        "templates": [t.template_id for t in templates], "psnr_db_per_template": per_tpl,
        "q_per_shard": chosen, "q_output_db": out_db,
        "measure_requests": args.measure_requests or "all profiling requests",
        "seconds": round(time.time() - t0, 1),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for k in settings:
        print(f"{k:24s} psnr " + "  ".join(f"{r}x {v}" for r, v in res["psnr_db"][k].items())
              + " | kv " + "  ".join(f"{v}" for v in res["kv_db"][k].values())
              + (f" | q {dict(Counter(chosen[k]))}" if chosen[k] else ""))
        if len(templates) > 1:
            for t, v in per_tpl[k].items():
                print(f"  {t:22s} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
