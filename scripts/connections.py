"""Experiment: how many requests in flight (one connection each) the native runtime needs
(issue 28 item 3, the HTTP/1.1 half).

Native-runtime edits of ``face-technologist`` through the paced link
(``edge.netem.shaped``) with ``EditOptions.max_inflight`` in ``--inflight`` (default 1, 2, 4,
6, 12), interleaved round by round so that load drifts hit every count alike, on two links:

* ``matched``: Lumos5G ``5g_trace_100_walking.txt`` regime-matched as the demo does (the
  FP16 cache takes 10 x this host's masked execution at the median) with the 30 ms round trip
  time-scaled the same way (``edge.netem.matched_rtt_ms``), at ``--windows`` starts: the
  regime the benches and the replay measure;
* ``cli``: a constant 40 Mbit/s with the 30 ms round trip as is: what ``sakura edit --rate
  40`` does on this host, where a round trip is about four shard executions.

Each edit is a fresh device given the link's rate as its prior (the count, not the rate
memory, is what varies). Per (link, count): the median PSNR against exact, latency, bytes,
stalls and local steps. Run ``./scripts/demo`` first (it builds ``packs/``).

    .venv/bin/python scripts/connections.py --json docs/bench/connections.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

TEMPLATE = "face-technologist"
TRACE = "5g_trace_100_walking.txt"
CLI_RATE_MBPS = 40.0
RTT_MS = 30.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--packs", default="packs", type=Path)
    ap.add_argument("--inflight", type=int, nargs="+", default=[1, 2, 4, 6, 12])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--windows", type=float, nargs="+", default=[20.0, 110.0, 200.0])
    args = ap.parse_args()

    import torch
    from sakura.dit.adapters.engine import load_engine
    from sakura.dit.templates import load_catalog
    from sakura.edge.floor import regime_factor, resident_floor
    from sakura.edge.netem import matched_rtt_ms, shaped
    from sakura.edge.policy_packs import catalog_entry
    from sakura.edge.runtime import EdgeRuntime, EditOptions
    from sakura.edge.server_process import ServerProcess
    from sakura.edge.templates import template_from_entry
    from sakura.traces import Trace, load_trace, trace_set

    torch.set_num_threads(1)
    model = load_engine(None, None)
    spec = load_catalog(None)[TEMPLATE]
    load_before = os.getloadavg()
    began = time.time()
    runs: list[dict] = []
    with ServerProcess(args.packs) as server:
        probe = EdgeRuntime(model, runtime="native")
        entry = asyncio.run(catalog_entry(server.url, TEMPLATE))
        template = template_from_entry(TEMPLATE, entry)
        req = probe.request(spec.evaluation_prompts[0], 100)
        floor = resident_floor(probe, server.url, TEMPLATE, template, req, repeats=3)
        raw = load_trace(next(p for p in trace_set("5g") if p.name == TRACE))
        factor = regime_factor(int(floor.manifest["fp16_bytes"]), floor.seconds,
                               float(raw.stats()["median_mbps"]) * 1e6)
        matched = raw.scaled(factor)
        matched_rtt = matched_rtt_ms(RTT_MS, floor.seconds,
                                     float(entry.get("token_mask_ratio") or 0))
        constant = Trace.constant(CLI_RATE_MBPS * 1e6, 1.0)  # as sakura edit --rate 40
        links = [("matched", matched, matched_rtt, args.windows),
                 ("cli", constant, RTT_MS, [0.0])]

        def one(link: str, trace, rtt: float, start: float, n: int) -> dict:
            rt = EdgeRuntime(model, runtime="native")
            prior = float(trace.rate_at(start))
            with shaped(server.url, trace, start, rtt_ms=rtt) as (url, _link):
                res = rt.edit(url, TEMPLATE, template, req, "sakura",
                              options=EditOptions(initial_rate_bps=prior, max_inflight=n,
                                                  rate_origin=server.url))
            res.compare(floor.image)
            return {"link": link, "inflight": n, "start_s": start, "psnr_db": res.psnr_db,
                    "latency_s": res.latency_s, "bytes": res.bytes, "stall_s": res.stall_s,
                    "local_fallbacks": res.local_fallbacks, "hedges": res.hedges,
                    "truncations": res.truncations}

        for r in range(args.rounds):
            for link, trace, rtt, starts in links:
                for start in starts:
                    for n in args.inflight:
                        runs.append(one(link, trace, rtt, start, n))
                        x = runs[-1]
                        print(f"round {r} {link} @{start:g} s, {n} in flight: "
                              f"{x['psnr_db']:.1f} dB, {x['latency_s']:.3f} s, "
                              f"{x['bytes']} B, local {x['local_fallbacks']}")
    med = statistics.median
    summary: dict = {}
    for link, _t, _rtt, _s in links:
        summary[link] = {}
        for n in args.inflight:
            xs = [x for x in runs if x["link"] == link and x["inflight"] == n]
            summary[link][str(n)] = {
                "psnr_db": round(med(x["psnr_db"] for x in xs), 3),
                "latency_s": round(med(x["latency_s"] for x in xs), 4),
                "bytes": int(med(x["bytes"] for x in xs)),
                "stall_s": round(med(x["stall_s"] for x in xs), 4),
                "local_fallbacks": med(x["local_fallbacks"] for x in xs),
                "runs": len(xs)}
    doc = {"bench": "connections", "http_version": "1.1", "template": TEMPLATE,
           "summary": summary,
           "conditions": {"matched": {"trace": TRACE, "scale": factor,
                                      "link_rtt_ms": matched_rtt, "windows": args.windows},
                          "cli": {"rate_mbps": CLI_RATE_MBPS, "link_rtt_ms": RTT_MS},
                          "masked_exec_s": floor.seconds, "rounds": args.rounds,
                          "runtime": "native", "link": "paced", "loss": 0.0,
                          "prior": "the link's rate at the start",
                          "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                          "seconds": round(time.time() - began, 1)},
           "runs": runs}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
