"""Experiment: HTTP/1.1 against HTTP/2 for the native runtime's shard transfers, nginx as the
origin (issue 28 item 3, the HTTP/2 half).

Before any edit is timed, this checks that this host's libcurl can carry pack ranges over
h2c at all: nginx (``cloud.origins.NginxOrigin`` with its ``listen PORT http2;`` listener,
prior knowledge; Debian 12's nginx-light 1.22 has no h2c upgrade) serves a pack, and the
curl command line (the same libcurl as the native receiver) asks for ``--ranges`` byte ranges
of it, once in parallel on one connection (multiplexed) and once one after another on one
kept-alive connection, over each HTTP version. libcurl before 7.89.0 fails every request
that reuses a prior-knowledge connection (curl#10634, fixed by curl#10643): then no
multiplexed transfer exists to time, the native runtime refuses ``http_version "2"`` with
one clear line, and HTTP/1.1 stays the default without latency figures for HTTP/2.

    .venv/bin/python scripts/http2.py --json docs/bench/http2.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path


def curl_ranges(url: str, version: str, n: int, size: int, parallel: bool) -> list[dict]:
    flag = "--http2-prior-knowledge" if version == "2" else "--http1.1"
    cmd = ["curl", "-s", flag, "-w", "%{http_version} %{http_code} %{size_download} "
           "%{num_connects} %{time_total} %{errormsg}\\n"]
    if parallel:
        cmd += ["--parallel"]
    for i in range(n):
        cmd += ["-r", f"{i * size}-{(i + 1) * size - 1}", url, "-o", os.devnull]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split(" ", 5)
        if len(parts) < 5 or not parts[0].replace(".", "").isdigit():
            continue
        rows.append({"http_version": parts[0], "status": int(parts[1]),
                     "bytes": int(parts[2]), "new_connections": int(parts[3]),
                     "seconds": float(parts[4]),
                     "error": parts[5].strip() if len(parts) > 5 else ""})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, type=Path)
    ap.add_argument("--ranges", type=int, default=6)
    ap.add_argument("--range-bytes", type=int, default=256 * 1024)
    args = ap.parse_args()

    from sakura.cloud.origins import NginxOrigin

    version = subprocess.run(["curl", "--version"], capture_output=True,
                             text=True).stdout.splitlines()[0]
    nginx = subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip()
    load_before = os.getloadavg()
    checks: dict = {}
    with tempfile.TemporaryDirectory() as root:
        pack = Path(root) / "templates" / "t" / "sakura" / "p.pack"
        pack.parent.mkdir(parents=True)
        pack.write_bytes(os.urandom(args.ranges * args.range_bytes))
        (Path(root) / "catalog.json").write_text("{}")
        origin = NginxOrigin(root, http2=True, access_log=True)
        with origin:
            for v, base in (("1.1", origin.url), ("2", origin.h2_url)):
                url = f"{base}/templates/t/sakura/p.pack"
                checks[v] = {mode: curl_ranges(url, v, args.ranges, args.range_bytes,
                                               mode == "parallel")
                             for mode in ("parallel", "sequential")}
            time.sleep(0.2)
            log = origin.access_log_lines()
    summary = {v: {mode: {"answered": sum(r["status"] == 206 for r in rows),
                          "failed": sum(r["status"] != 206 for r in rows),
                          "errors": sorted({r["error"] for r in rows if r["error"]})}
                   for mode, rows in modes.items()} for v, modes in checks.items()}
    h2_ok = all(s["failed"] == 0 for s in summary["2"].values())
    doc = {"bench": "http2", "origin": nginx, "client": version,
           "h2c_usable": h2_ok, "summary": summary,
           "decision": ("measure edits: h2c works here" if h2_ok else
                        "HTTP/1.1 stays the default: this libcurl answers only the first "
                        "request of an h2c prior-knowledge connection (curl#10634, fixed in "
                        "7.89.0), so HTTP/2 edits cannot be timed here and the native "
                        "runtime refuses http_version 2 with one clear line"),
           "conditions": {"ranges": args.ranges, "range_bytes": args.range_bytes,
                          "link": "loopback, no shaping", "loss": 0.0,
                          "load_avg_before": load_before, "load_avg_after": os.getloadavg()},
           "checks": checks, "nginx_access_log": log}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1))
    print(json.dumps({"h2c_usable": h2_ok, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
