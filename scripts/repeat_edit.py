"""Experiment: an app's repeated edits, as a user runs them (issue 28, "Rate memory").

Pairs of ``EdgeRuntime`` edits (native runtime, the shipped model, ``face-technologist``)
30 s apart (wall clock) over the same trace window, with the device state kept and no rate
prior given, on several windows of the demo's Lumos5G trace (regime-matched like the demo: one scale factor, the 30 ms round
trip time-scaled), beside the same edits given the trace's rate at their start as the
prior. The first edit of each pair starts from a device that has never measured this
origin; the second from what the first left (the manifest is then revalidated with a 304).
PSNR is against ``exact`` (the FP16 cache resident). Writes the medians over the pairs
and every edit. Run ``./scripts/demo`` first (it builds ``packs/``).

    .venv/bin/python scripts/repeat_edit.py --json docs/bench/repeat-edit.json

This is the ``repeat_edit`` part of the ``sakura bench tail`` the issue asks for, kept as
a script until that bench exists (its kernel-link loss sweep is not built yet).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TEMPLATE = "face-technologist"
TRACE = "5g_trace_100_walking.txt"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--packs", default="packs")
    ap.add_argument("--windows", type=float, nargs="+", default=[20.0, 110.0, 200.0],
                    help="trace start of each pair's first edit (s)")
    ap.add_argument("--gap", type=float, default=30.0, help="seconds between the pair's edits")
    ap.add_argument("--port", type=int, default=18741)
    args = ap.parse_args()

    import torch
    from sakura.dit.adapters.engine import load_engine
    from sakura.edge.bench import _catalog_entry, regime_factor, resident_floor
    from sakura.edge.netem import matched_rtt_ms, shaped
    from sakura.edge.runtime import EdgeRuntime, EditOptions
    from sakura.edge.templates import template_from_entry
    from sakura.traces import load_trace, trace_set

    torch.set_num_threads(1)
    server = f"http://127.0.0.1:{args.port}"
    sakura = str(Path(sys.executable).with_name("sakura"))
    serve = subprocess.Popen([sakura, "serve", args.packs,
                              "--port", str(args.port)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        time.sleep(4)
        engine = load_engine(None, None)
        probe = EdgeRuntime(engine, runtime="native")
        entry = asyncio.run(_catalog_entry(server, TEMPLATE))
        template = template_from_entry(TEMPLATE, entry)
        prompt = "people & body: man technologist: medium-dark skin tone"
        req = probe.request(prompt, 100)
        floor = resident_floor(probe, server, TEMPLATE, template, req, repeats=3)
        trace_path = next(p for p in trace_set("5g") if p.name == TRACE)
        raw = load_trace(trace_path)
        median = float(raw.stats()["median_mbps"]) * 1e6
        factor = regime_factor(int(floor.manifest["fp16_bytes"]), floor.seconds, median)
        trace = raw.scaled(factor)
        rtt = matched_rtt_ms(30.0, floor.seconds, float(entry.get("token_mask_ratio") or 0))
        edits: list[dict] = []

        def one(rt: EdgeRuntime, start: float, prior: float | None) -> dict:
            with shaped(server, trace, start, rtt_ms=rtt) as (url, _link):
                res = rt.edit(url, TEMPLATE, template, req, "sakura",
                              options=EditOptions(initial_rate_bps=prior, rate_origin=server))
            res.compare(floor.image)
            return {"start_s": start, "prior_bps": prior, "psnr_db": res.psnr_db,
                    "latency_s": res.latency_s, "bytes": res.bytes, "stalls": res.stalls,
                    "truncations": res.truncations, "hedges": res.hedges,
                    "first_configs": res.configs[:11],
                    "first_rate_bps": res.timeline[0]["rate_bps"],
                    "max_stall_s": max((r["stall_s"] for r in res.timeline[1:]), default=0.0),
                    "timeline": res.timeline}

        pairs = []
        for w in args.windows:
            rt = EdgeRuntime(engine, runtime="native")  # a device new to this origin
            first = one(rt, w, None)
            time.sleep(args.gap)
            second = one(rt, w, None)
            priors = [one(EdgeRuntime(engine, runtime="native"), w, float(trace.rate_at(w)))]
            pair = {"window_s": w, "first": first, "second": second, "prior": priors}
            pairs.append(pair)
            edits.append(pair)
            print(json.dumps({"window": w, "first": first["psnr_db"],
                              "second": second["psnr_db"],
                              "prior": [p["psnr_db"] for p in priors]}), flush=True)
        med = statistics.median
        doc = {
            "what": __doc__.split("\n\n")[0],
            "conditions": {"link": "paced", "trace": TRACE, "scale": factor,
                           "rtt_ms": rtt, "loss": 0.0, "runtime": "native",
                           "gap_s": args.gap, "load_avg": os.getloadavg()},
            "repeat_edit": {
                "first_psnr_db": med(p["first"]["psnr_db"] for p in pairs),
                "second_psnr_db": med(p["second"]["psnr_db"] for p in pairs),
                "prior_psnr_db": med(q["psnr_db"] for p in pairs for q in p["prior"]),
                "gap_db": med(p["second"]["psnr_db"] - p["first"]["psnr_db"] for p in pairs),
                "first_minus_prior_db": med(p["first"]["psnr_db"] - p["prior"][0]["psnr_db"]
                                            for p in pairs),
                "second_minus_prior_db": med(p["second"]["psnr_db"] - p["prior"][0]["psnr_db"]
                                             for p in pairs),
                "second_first_configs": [p["second"]["first_configs"] for p in pairs],
            },
            "pairs": edits,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
        print(json.dumps(doc["repeat_edit"], indent=1))
    finally:
        serve.kill()
        serve.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
