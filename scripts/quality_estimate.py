"""Experiment: how far the PSNR a streamed edit reports (``EditResult.psnr_estimate_db``,
``edge/quality.py``: per-shard profiled output MSEs summed) is from the PSNR measured against
``exact`` (issue 29 item 5, "its error on the profiling prompts").

Native-runtime ``sakura`` edits of ``face-technologist`` (``packs/``, built by ``./scripts/demo``)
straight from a local ``sakura serve`` through the paced link at constant rates (so that the
allocator picks small, middle and large configurations), for the template's profiling prompts
(the ones its profile was fitted on) and its evaluation prompts (unseen); each edit is compared
with the ``fp16`` (exact) edit of the same request. Writes every edit and, per prompt set, the
median and 90th percentile of ``estimate - measured`` and of its absolute value.

    .venv/bin/python scripts/quality_estimate.py --json docs/bench/quality-estimate.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import time
from pathlib import Path

TEMPLATE = "face-technologist"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--packs", default="packs", type=Path)
    ap.add_argument("--rates", type=float, nargs="+", default=[20.0, 60.0, 200.0],
                    help="constant link rates, Mbit/s")
    ap.add_argument("--rtt-ms", type=float, default=1.8,
                    help="the link's round trip (the demo's time-scaled 30 ms)")
    args = ap.parse_args()

    import torch
    from sakura.dit.adapters.engine import load_engine
    from sakura.dit.templates import load_catalog
    from sakura.edge.netem import shaped
    from sakura.edge.policy_packs import catalog_entry
    from sakura.edge.runtime import EdgeRuntime, EditOptions
    from sakura.edge.server_process import ServerProcess
    from sakura.edge.templates import template_from_entry
    from sakura.traces import Trace

    torch.set_num_threads(1)
    model = load_engine(None, None)
    spec = load_catalog(None)[TEMPLATE]
    began, load_before = time.time(), os.getloadavg()
    edits = []
    with ServerProcess(args.packs) as server:
        rt = EdgeRuntime(model, runtime="native")
        entry = asyncio.run(catalog_entry(server.url, TEMPLATE))
        template = template_from_entry(TEMPLATE, entry)
        sets = {"profiling": spec.profiling_prompts, "evaluation": spec.evaluation_prompts}
        for which, prompts in sets.items():
            for i, prompt in enumerate(prompts):
                req = rt.request(prompt, 1000 + i)
                exact = rt.edit(server.url, TEMPLATE, template, req, "fp16",
                                options=EditOptions(remember_rate=False)).image
                for rate in args.rates:
                    trace = Trace.constant(rate * 1e6, 1.0)
                    with shaped(server.url, trace, 0.0, rtt_ms=args.rtt_ms) as (url, _l):
                        res = rt.edit(url, TEMPLATE, template, req, "sakura",
                                      options=EditOptions(initial_rate_bps=rate * 1e6,
                                                          rate_origin=server.url))
                    res.compare(exact)
                    est = res.psnr_estimate_db
                    edits.append({
                        "prompts": which, "prompt": i, "rate_mbps": rate,
                        "psnr_db": res.psnr_db, "psnr_estimate_db": est,
                        "error_db": (est - res.psnr_db
                                     if est is not None and math.isfinite(est)
                                     and math.isfinite(res.psnr_db) else None),
                        "full_quality_byte_fraction": res.full_quality_byte_fraction,
                        "local_fallbacks": res.local_fallbacks,
                        "truncations": res.truncations})
                    e = edits[-1]
                    print(f"{which} {i} @ {rate:g} Mbit/s: measured {res.psnr_db:.1f} dB, "
                          f"estimate {est if est is None else round(est, 1)} dB, "
                          f"{e['full_quality_byte_fraction']:.3f} of full bytes, "
                          f"local {res.local_fallbacks}")
    summary = {}
    for which in ("profiling", "evaluation"):
        errs = [e["error_db"] for e in edits if e["prompts"] == which and e["error_db"] is not None]
        if not errs:
            continue
        absolute = sorted(abs(x) for x in errs)
        summary[which] = {
            "edits": len(errs), "median_error_db": round(statistics.median(errs), 3),
            "mean_error_db": round(statistics.fmean(errs), 3),
            "median_abs_error_db": round(statistics.median(absolute), 3),
            "p90_abs_error_db": round(absolute[min(len(absolute) - 1,
                                                   int(0.9 * len(absolute)))], 3),
            "max_abs_error_db": round(absolute[-1], 3)}
    doc = {"bench": "quality-estimate", "template": TEMPLATE, "summary": summary,
           "conditions": {"rates_mbps": args.rates, "link": "paced", "link_rtt_ms": args.rtt_ms,
                          "runtime": "native", "policy": "sakura", "exact": "fp16 edit",
                          "rule": "edge/quality.py received_quality",
                          "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                          "seconds": round(time.time() - began, 1)},
           "edits": edits}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
