"""Capture the packets of chosen replay runs over the kernel link (issue 28 item 9).

    python scripts/stall_capture.py --out DIR [--trace 5g_trace_50] [--template face-technologist]
                                    [--policies sakura,sakura-fixed-config] [--repeat N]
                                    [--config YAML --network NAME --start-index N]

Runs the `sakura replay --quick --link kernel` plan's runs (or, with ``--config``, that
replay config's plan over the kernel link) that match (template, network, trace name,
start index, policies) exactly as the replay runs them (same packs folder, weights,
factor, start point, round trip, rto_min, options), with ``tcpdump`` on the client side
of the veth pair, and
writes per run: the record (``runs.jsonl``), the capture (``<policy>-<n>.pcap``, headers
only) and a summary of the capture: bytes delivered per 10 ms, retransmitted segments,
the longest gap in delivery while a request was unanswered. Needs root, tcpdump (Debian
``tcpdump``) and the packs of ``--packs`` (built by the replay or ``sakura replay``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from sakura.dit.templates import load_catalog
from sakura.dit.weights import DEFAULT_WEIGHTS, load_model
from sakura.edge.bench import file_sha256
from sakura.edge.replay.config import load_config
from sakura.edge.replay.links import Links
from sakura.edge.replay.networks import pooled_median_bps
from sakura.edge.replay.plan import plan
from sakura.edge.replay.results import ResultsFile
from sakura.edge.replay.runs import run_matched
from sakura.edge.replay.template_setup import setup_template
from sakura.traces import require_trace_dir
from sakura.traces.tbf import parse_qdisc_stats

from sakura.errors import SakuraError


def link_state(link, t_run: float) -> dict[str, object]:
    """The kernel link as a failed run left it: tbf's counters now (``tc -s qdisc``), the
    rate thread's error, and the tbf settings applied in the run (seconds from its start)."""
    raw = subprocess.run(["tc", "-s", "-n", link.server_ns, "qdisc", "show", "dev",
                          link.server_dev], capture_output=True, text=True, check=False).stdout
    return {"qdisc": parse_qdisc_stats(raw), "tc": raw, "error": link.error,
            "applied": [[round(a.wall - t_run, 4), a.rate_bps, a.tbf_rate_bps, a.burst_bytes,
                         a.limit_bytes] for a in link.applied if a.wall >= t_run - 1.0]}


def summarize(pcap: Path, server_port: int) -> dict[str, object]:
    """What the capture (client side of the veth) shows, in seconds from its first packet:
    bytes the server delivered per 10 ms, the longest silences of the server (no packet of
    any kind from it: no data, no ACK, no SYN-ACK), client segments sent again (TCP
    retransmissions of requests), and SYNs against SYN-ACKs (connections the server
    never answered)."""
    text = subprocess.run(["tcpdump", "-r", str(pcap), "-tt", "-nn", "-S", "tcp"],
                          capture_output=True, text=True, check=False).stdout
    # "TIME [IFACE In|Out ]IP SRC.PORT > DST.PORT: Flags [..][, seq A:B]..." (-i any adds the
    # interface and direction)
    pat = re.compile(r"^(\d+\.\d+) (?:\S+\s+(?:In|Out)\s+)?IP \S+\.(\d+) > \S+\.(\d+): "
                     r"Flags \[([^\]]*)\](?:, seq (\d+):(\d+))?")
    t0: float | None = None
    bins: dict[int, int] = defaultdict(int)
    sent: dict[int, set[int]] = defaultdict(set)
    retx: list[float] = []
    from_server: list[float] = []
    syns = synacks = 0
    for line in text.splitlines():
        m = pat.match(line)
        if not m:
            continue
        t, sport, dport, flags, a, b = m.groups()
        t = float(t)
        t0 = t if t0 is None else t0
        t -= t0
        if int(sport) == server_port:
            from_server.append(t)
            synacks += flags == "S."
            if a is not None:
                bins[int(t * 100)] += int(b) - int(a)
        else:
            syns += flags == "S"
            if a is not None and int(b) > int(a):
                if int(a) in sent[int(sport)]:
                    retx.append(round(t, 4))
                sent[int(sport)].add(int(a))
    gaps = sorted(((y - x, x) for x, y in zip(from_server, from_server[1:])), reverse=True)[:5]
    return {"server_packets": len(from_server), "client_retransmissions_s": retx[:50],
            "syn": syns, "syn_ack": synacks,
            "server_silences_s": [(round(g, 4), round(at, 4)) for g, at in gaps],
            "delivered_bytes_per_10ms": {k: v for k, v in sorted(bins.items())}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--packs", default="runs/packs")
    ap.add_argument("--trace", default="5g_trace_50")
    ap.add_argument("--template", default="face-technologist")
    ap.add_argument("--policies", default="sakura,sakura-fixed-config")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--replay", default="runs/replay-kernel",
                    help="the replay whose template records (factor, T) the runs reuse")
    ap.add_argument("--config", default=None,
                    help="a replay config whose plan to take the runs from (default: the "
                         "shipped one, --quick), always over the kernel link")
    ap.add_argument("--network", default="5g", help="the replay's network name")
    ap.add_argument("--start-index", type=int, default=None,
                    help="only this start point (the #N of a run's key)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.config, quick=args.config is None, link="kernel",
                      packs_dir=args.packs)
    if cfg.model:
        print(f"{cfg.source}: the capture replays the shipped MMDiT's form only, not "
              f"model: {cfg.model}", file=sys.stderr)
        return 1
    root = cfg.trace_dir or str(require_trace_dir())
    policies = args.policies.split(",")
    runs = [r for r in plan(cfg, root) if r.template == args.template
            and r.key.network == args.network and args.trace in str(r.start.trace)
            and r.key.policy in policies and r.variant == "main"
            and args.start_index in (None, r.key.start_index)]
    if not runs:
        print("no such run in the plan", file=sys.stderr)
        return 1
    catalog = load_catalog(cfg.catalog)
    weights = Path(cfg.weights) if cfg.weights else DEFAULT_WEIGHTS
    model = load_model(weights)
    sha = file_sha256(weights)
    results = ResultsFile(Path(args.replay))  # its template records: the same factor
    with Links(cfg, Path(args.packs), ["main"], print) as links:
        st = setup_template(cfg, args.template, args.template, ["main"], links, model, sha,
                            catalog, results, Path(args.packs),
                            pooled_median_bps(cfg.regime_network, root), print)
        link = links.links["main"]
        port = int(links.urls["main"].rsplit(":", 1)[1])
        out = args.out / "runs.jsonl"
        for n in range(args.repeat):
            for r in runs:
                pcap = args.out / f"{r.key.policy}-{n}.pcap"
                dump = subprocess.Popen(
                    ["ip", "netns", "exec", link.client_ns, "tcpdump", "-i", "any", "-s",
                     "96", "-w", str(pcap), "tcp"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
                t_run, faults = time.monotonic(), link.faults
                try:
                    rec = run_matched(r, st, cfg, links, root)
                except SakuraError as exc:  # the intermittent failure: keep its evidence
                    rec = {"key": str(r.key), "failed": str(exc), "load1": os.getloadavg()[0],
                           "link": link_state(link, t_run)}
                finally:
                    time.sleep(0.5)
                    dump.terminate()
                    dump.wait(10)
                rec["capture"] = summarize(pcap, port)
                if link.faults > faults:  # the emulator's own (traces/tbf.py tbf_stuck)
                    rec["link_faults"], rec["link_error"] = link.faults - faults, link.error
                with out.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                c = rec["capture"]
                if "failed" in rec:
                    print(f"{r.key.policy} #{n}: FAILED {rec['failed']}; qdisc "
                          f"{rec['link']['qdisc']}")
                    continue
                print(f"{r.key.policy} #{n}: {rec['latency_s']:.2f} s, {rec['bytes']} B, "
                      f"local steps {rec['local_fallbacks']}, stalls {rec['stall_s']:.2f} s, "
                      f"link faults {rec.get('link_faults', 0)} {rec.get('link_error', '')}, "
                      f"load {rec['load1']:.1f}; capture: server silent "
                      f"{c['server_silences_s'][:2]}, {len(c['client_retransmissions_s'])} "
                      f"request retransmissions, {c['syn']} SYN / {c['syn_ack']} SYN-ACK")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SakuraError as exc:  # a bad config, a missing trace folder: one line
        print(f"stall_capture: error: {exc}", file=sys.stderr)
        sys.exit(1)
