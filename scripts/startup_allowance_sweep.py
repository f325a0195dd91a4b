"""Developer tool: the startup allowance (``EditOptions.startup_fraction``) on the demo's edit.

Serves ``packs/`` (run ``./scripts/demo`` first), scales the demo's trace once as the demo
does (regime-matched: the FP16 cache at the trace median = 10 x the masked execution
time), then runs the demo's ``sakura`` edit over the same trace window, ``--rounds``
rounds of every fraction, interleaved and in a rotated order (so load on the machine and
any periodic hiccup hit every fraction alike), each edit a fresh device like the demo's
(the manifest fetched, not cached). Prints per fraction the median latency, the median
latency after the manifest (latency - the manifest's fetch, which the allowance cannot
change and which is noisy), bytes, stalls, the first configurations, PSNR of
the demo prompt's image vs exact (what the demo prints) and, as
``scripts/first_shards_probe.py`` does, the edit PSNR over the mask vs exact of each
run's configurations (mean of the template's three evaluation prompts).

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python scripts/startup_allowance_sweep.py \\
        --fractions 0 0.03 0.05 0.1 0.2 --rounds 5 --json out/startup-sweep.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

import torch
from first_shards_probe import ChoiceQuality  # scripts/, beside this file
from sakura.dit.templates import device_template, load_catalog
from sakura.dit.weights import DEFAULT_WEIGHTS, load_model
from sakura.edge.bench import file_sha256
from sakura.edge.client import PackClient
from sakura.edge.floor import exact_and_floor
from sakura.edge.netem import shaped
from sakura.edge.runtime import EdgeRuntime, EditOptions
from sakura.edge.server_process import ServerProcess

from sakura.demo import DEFAULT_TEMPLATE, _pick_trace

PACKS = Path("packs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fractions", nargs="+", type=float, default=[0, 0.03, 0.05, 0.1, 0.2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--start", type=float, default=20.0, help="trace start (the demo's)")
    ap.add_argument("--json", type=Path, help="write every run here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sys.setswitchinterval(5e-4)
    tid = DEFAULT_TEMPLATE
    spec = load_catalog()[tid]
    model = load_model()
    runtime = EdgeRuntime(model, weights_sha256=file_sha256(DEFAULT_WEIGHTS))
    runs: list[dict] = []
    with ServerProcess(PACKS) as server:
        async def entry() -> dict:
            async with PackClient(server.url) as client:
                return (await client.catalog())["templates"][tid]

        template = device_template(asyncio.run(entry()))
        req = runtime.request(spec.evaluation_prompts[0], seed=100)
        runtime.profile(tid, runtime.prepared(tid, template), req)
        exact, floor_s, fp16_manifest = exact_and_floor(runtime, server.url, tid, template,
                                                        req, repeats=2)
        raw, trace_name, _ = _pick_trace(None)
        median_bps = float(raw.stats()["median_mbps"]) * 1e6
        factor = int(fp16_manifest["fp16_bytes"]) * 8.0 / (10.0 * floor_s) / median_bps
        scaled = median_bps * factor
        print(f"trace {trace_name} x{factor:.3g}: {scaled / 1e6:.1f} Mbit/s median, masked "
              f"execution {floor_s:.3f} s", flush=True)
        with shaped(server.url, raw.scaled(factor), args.start) as (url, link):
            n = len(args.fractions)
            for rnd in range(args.rounds):
                for f in args.fractions[rnd % n:] + args.fractions[:rnd % n]:
                    link.restart(args.start)
                    opts = EditOptions(budget_rate_bps=scaled, initial_rate_bps=scaled,
                                       cache_manifests=False, startup_fraction=f)
                    res = runtime.edit(url, tid, template, req, "sakura", options=opts)
                    res.compare(exact)
                    runs.append({"round": rnd, "fraction": f, "latency_s": res.latency_s,
                                 "bytes": res.bytes, "stalls": res.stalls,
                                 "stall_s": res.stall_s,
                                 "allowance_s": res.startup_allowance_s,
                                 "exec0_start_s": res.timeline[0]["exec_start"],
                                 "manifest_s": res.timeline[0]["recv_start"],
                                 "configs": res.configs, "psnr_db": res.psnr_db,
                                 "load1": os.getloadavg()[0]})
                    print(f"round {rnd} fraction {f:g}: {res.latency_s:.3f} s, "
                          f"{res.bytes / 1e6:.3f} MB, configs {res.configs[:5]}", flush=True)

    # edit PSNR over the mask of every distinct choice (as scripts/first_shards_probe.py)
    quality = ChoiceQuality(model, tid, PACKS / "templates" / tid / "sakura")
    seen: dict[tuple, float] = {}
    for r in runs:
        key = tuple(r["configs"])
        if key not in seen:
            seen[key] = quality(list(key))
        r["mask_psnr_db"] = seen[key]

    med = statistics.median
    print(f"\n{'fraction':>8s} {'allow ms':>8s} {'latency s':>9s} {'after man.':>10s} "
          f"{'MB':>6s} {'stalls':>6s} "
          f"{'PSNR dB':>7s} {'mask PSNR dB':>12s}  first configs (per round)")
    for f in args.fractions:
        rs = [r for r in runs if r["fraction"] == f]
        print(f"{f:8g} {1e3 * med(r['allowance_s'] for r in rs):8.0f} "
              f"{med(r['latency_s'] for r in rs):9.3f} "
              f"{med(r['latency_s'] - r['manifest_s'] for r in rs):10.3f} "
              f"{med(r['bytes'] for r in rs) / 1e6:6.3f} "
              f"{med(r['stalls'] for r in rs):6g} {med(r['psnr_db'] for r in rs):7.2f} "
              f"{med(r['mask_psnr_db'] for r in rs):12.2f}  "
              + " | ".join(",".join(str(c) for c in r["configs"][:4]) for r in rs))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"trace": trace_name, "factor": factor,
                                         "masked_exec_s": floor_s, "start_s": args.start,
                                         "runs": runs}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
