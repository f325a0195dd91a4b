"""Policies side by side over one replay's runs: PSNR mean and p10 (pooled), the p90 latency
(per template, then the median over templates, as the tail bench), the median, the largest
latency over ``local`` at the same start, local steps and the worst stall. Written for the
quality-floor comparison (``edge/replay/configs/floor.yaml``, docs/RESULTS.md):

    sakura replay edge/replay/configs/floor.yaml --out runs/floor-exp
    .venv/bin/python scripts/policy_tail.py runs/floor-exp/runs.jsonl \\
        --json docs/bench/quality-floor.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from sakura.edge.replay.stats import pct


def summarize(rows: list[dict]) -> dict:
    runs = [r for r in rows if r.get("kind") != "template" and r.get("psnr_exact") is not None]
    by: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by[r["policy"]].append(r)
    local = {(r["template"], r["trace"], r["start_s"]): r["latency_s"] for r in by["local"]}
    out = {}
    for policy, rs in sorted(by.items()):
        per_template: dict[str, list[float]] = defaultdict(list)
        for r in rs:
            per_template[r["template"]].append(r["latency_s"])
        psnr = [r["psnr_exact"] for r in rs]
        over = [r["latency_s"] / local[k] for r in rs
                if (k := (r["template"], r["trace"], r["start_s"])) in local]
        out[policy] = {
            "runs": len(rs),
            "psnr_mean_db": round(statistics.mean(psnr), 3),
            "psnr_p10_db": round(pct(psnr, 10), 3),
            "p90_s": round(statistics.median(pct(v, 90) for v in per_template.values()), 4),
            "p50_s": round(statistics.median(r["latency_s"] for r in rs), 4),
            "max_latency_over_local": round(max(over), 4) if over else None,
            "local_steps": sum(int(r.get("local_fallbacks") or 0) for r in rs),
            "max_stall_s": round(max(float(r.get("stall_s") or 0) for r in rs), 4),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", help="a replay's runs.jsonl")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args()
    rows = [json.loads(line) for line in Path(args.runs).read_text().splitlines() if line]
    doc = {"runs_file": args.runs, "policies": summarize(rows)}
    text = json.dumps(doc, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
