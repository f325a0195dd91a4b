"""The run of `sakura demo`, as its four named steps (``sakura/demo.py`` says what they do).

``sakura/demo.py`` registers the command, checks its arguments and holds the pictures and
the trace choice; this module is what runs after that: :func:`run` (the process settings,
then the steps), :func:`_build_packs` (1, the provider's build), :func:`_device_edits` (3,
the device's edits over the regime-matched link, inside the server of step 2) and
:func:`_summary` / :func:`_comparison` (4, the table, images, plots and JSON). It is
imported only when the demo runs (``run_demo``: ``# lazy: torch``), so its imports sit at
module level, loaded in the order ``run_demo`` loaded them before (issue 30 item 5).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sakura.bundle_cli import export_for_build
from sakura.cloud.build import BuildConfig, build
from sakura.demo import _pick_trace, _psnr, _save, side_by_side
from sakura.dit.templates import device_template, load_catalog
from sakura.dit.weights import DEFAULT_WEIGHTS, load_model
from sakura.edge.bench import _pin_device, file_sha256
from sakura.edge.cli import prompt_tokens, resolve_runtime, startup_fraction_arg
from sakura.edge.client import PackClient
from sakura.edge.floor import Floor, resident_floor
from sakura.edge.netem import matched_rtt_ms, shaped
from sakura.edge.policy_packs import catalog_usable
from sakura.edge.runtime import EdgeRuntime, EditOptions
from sakura.edge.server_process import ServerProcess
from sakura.edge.timeline import plot_timeline
from sakura.errors import SakuraError
from sakura.traces.impair import DEFAULT_RTT_MS


@dataclass
class _Edits:
    """What step 3 leaves for step 4: the template, the exact reference and floor, the
    regime-matched trace and the three edits compared with exact."""

    template: Any
    tokens: dict[str, Any]
    floor: Floor
    fp16_bytes: int
    trace_name: str
    note: str | None
    factor: float
    scaled: float
    opts: EditOptions
    results: dict[str, Any]


def run(args: argparse.Namespace) -> int:
    runtime_name = resolve_runtime(args, [])
    # the device runtime's process settings (edge/README.md): one torch thread, and a short
    # GIL switch interval so the receive/reconstruct threads never hold execution up long
    # (Python runtime); the device on its own CPUs, the server and the link on another
    torch.set_num_threads(1)
    sys.setswitchinterval(5e-4)
    cpus = _pin_device()
    network_cpus = cpus[1] if cpus else None
    t_start = time.monotonic()
    out, packs = Path(args.out), Path(args.packs)
    out.mkdir(parents=True, exist_ok=True)
    specs = load_catalog()
    if args.template not in specs:
        raise SakuraError(f"unknown template {args.template!r}; shipped: {', '.join(specs)}")
    spec = specs[args.template]
    prompt = args.prompt or spec.evaluation_prompts[0]
    startup = {} if args.startup_fraction is None else {
        "startup_fraction": startup_fraction_arg(args.startup_fraction)}

    # 1) provider side: build what the demo serves
    _build_packs(args, packs)

    # 2) serve
    model = load_model()
    runtime = EdgeRuntime(model, weights_sha256=file_sha256(DEFAULT_WEIGHTS),
                          runtime=runtime_name)
    with ServerProcess(packs, cpus=network_cpus) as server:
        print(f"[2/4] sakura serve {packs} at {server.url}")
        # 3) the device: template from the server, private request stays here
        edits = _device_edits(args, runtime, runtime_name, server.url, network_cpus, prompt,
                              startup)

    # 4) summary, images, plots
    summary = _summary(args, out, prompt, edits, runtime_name, cpus)
    _comparison(out, edits, summary, runtime_name)
    summary["elapsed_s"] = time.monotonic() - t_start
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"      images: template | exact | edit (streamed) | local -> "
          f"{out}/side-by-side.png")
    return 0


def _build_packs(args: argparse.Namespace, packs: Path) -> None:
    """Step 1: ``sakura build`` of the template's ``sakura`` and ``fp16`` packs and its
    device bundle (skipped when up to date; forced when the published catalog is stale)."""
    stale = (packs / "catalog.json").exists() and not catalog_usable(packs, args.template)
    print(f"[1/4] sakura build {args.template} -> {packs}/ (skipped when up to date)")
    report = build(BuildConfig(out_dir=str(packs), templates=(args.template,),
                               codecs=("sakura", "fp16"), force=stale,
                               bundle_exporter=export_for_build), log=print)
    print(f"      built {report.built or 'nothing'}, up to date {report.skipped or 'nothing'}"
          + (f"; device bundle {report.bundles[args.template]}"
             if args.template in report.bundles else ""))


def _device_edits(args: argparse.Namespace, runtime: EdgeRuntime, runtime_name: str,
                  server_url: str, network_cpus: set[int] | None, prompt: str,
                  startup: dict[str, float]) -> _Edits:
    """Step 3, the device: the template from the server, the private request kept here,
    the exact reference and the compute floor, the trace scaled to the regime, then
    ``sakura`` and ``fp16`` over the paced link and ``local``."""
    async def entry() -> dict:
        async with PackClient(server_url) as client:
            return (await client.catalog())["templates"][args.template]

    catalog_entry = asyncio.run(entry())
    template = device_template(catalog_entry)
    tokens = prompt_tokens(runtime, prompt)
    req = runtime.request(prompt, seed=args.seed)
    if runtime_name == "native":
        print("      native runtime: compiled graphs for this template's geometry are "
              "built once and cached (first run: minutes)")
    else:
        runtime.profile(args.template, runtime.prepared(args.template, template), req)
    floor = resident_floor(runtime, server_url, args.template, template, req, repeats=2)
    exact, floor_s, fp16_manifest = floor.image, floor.seconds, floor.manifest
    fp16_bytes = int(fp16_manifest["fp16_bytes"])
    raw, trace_name, note = _pick_trace(args.trace)
    median_bps = float(raw.stats()["median_mbps"]) * 1e6
    factor = fp16_bytes * 8.0 / (10.0 * floor_s) / median_bps
    trace = raw.scaled(factor)
    scaled = median_bps * factor
    print(f"[3/4] trace {trace_name}: median {median_bps / 1e6:.1f} Mbit/s, scaled x"
          f"{factor:.3g} to {scaled / 1e6:.2f} Mbit/s (regime-matched: FP16 cache "
          f"{fp16_bytes / 1e6:.1f} MB at the median = 10 x the {floor_s:.2f} s masked "
          "execution)")
    if note:
        print(f"      note: {note}")
    rtt = matched_rtt_ms(DEFAULT_RTT_MS, floor_s,
                         float(catalog_entry.get("token_mask_ratio") or 0.0))
    print(f"      link round trip {rtt:.1f} ms: a {DEFAULT_RTT_MS:g} ms 5G round trip "
          "scaled like the rates (x the masked execution here / the phone's)")
    results = {}
    with shaped(server_url, trace, args.start, rtt_ms=rtt,
                cpus=network_cpus) as (link_url, link):
        io_cpus = (tuple(sorted(network_cpus)) if network_cpus and runtime_name == "native"
                   else None)  # receive + reconstruct beside the link: the modem and GPU
        opts = EditOptions(budget_rate_bps=scaled, initial_rate_bps=scaled,
                           pipeline_cpus=io_cpus, **startup)
        for policy in ("sakura", "fp16"):  # a phone that has used the template before
            runtime.warm(link_url, args.template, template, policy, options=opts)
        for policy in ("sakura", "fp16"):
            link.restart(args.start)
            results[policy] = runtime.edit(link_url, args.template, template, req, policy,
                                           options=opts).compare(exact)
    results["local"] = runtime.edit(server_url, args.template, template, req,
                                    "local").compare(exact)
    return _Edits(template, tokens, floor, fp16_bytes, trace_name, note, factor, scaled, opts,
                  results)


def _summary(args: argparse.Namespace, out: Path, prompt: str, edits: _Edits,
             runtime_name: str, cpus: tuple[set[int], set[int]] | None) -> dict[str, Any]:
    """Step 4, the table: one row per policy, its edit image and timeline written."""
    floor_s, opts = edits.floor.seconds, edits.opts
    print(f"[4/4] prompt {prompt!r} (never left the device); results in {out}/")
    print(f"      {'policy':8s} {'latency s':>9s} {'MB moved':>9s} {'stalls':>6s} "
          f"{'local steps':>11s} {'PSNR vs exact':>13s} {'SSIM':>6s}")
    summary: dict[str, Any] = {"template": args.template, "prompt": prompt, "seed": args.seed,
                               **edits.tokens,
                               "trace": edits.trace_name, "start_s": args.start,
                               "regime": {"mode": "regime-matched", "factor": edits.factor,
                                          "scaled_median_mbps": edits.scaled / 1e6,
                                          "masked_exec_s": floor_s,
                                          "fp16_bytes": edits.fp16_bytes,
                                          "note": edits.note},
                               "compute_bound_s": floor_s, "runtime": runtime_name,
                               "cpus": ({"device": sorted(cpus[0]),
                                         "server_and_link": sorted(cpus[1])} if cpus else None),
                               "startup_fraction": opts.startup_fraction, "policies": {}}
    for policy, res in edits.results.items():
        psnr = "inf" if res.psnr_db == float("inf") else f"{res.psnr_db:.2f} dB"
        local_steps = "all" if policy == "local" else str(res.local_fallbacks)
        print(f"      {policy:8s} {res.latency_s:9.3f} {res.bytes / 1e6:9.3f} {res.stalls:6d} "
              f"{local_steps:>11s} {psnr:>13s} {res.ssim:6.3f}")
        summary["policies"][policy] = res.summary()
        _save(res.image, out / f"edit-{policy}.png")
        if res.timeline:
            plot_timeline(res.timeline, out / f"timeline-{policy}.png",
                          f"{policy} on {args.template}, {edits.trace_name} @ {args.start:g} s",
                          phases=res.phases, latency_s=res.latency_s)
            (out / f"timeline-{policy}.json").write_text(json.dumps(res.timeline, indent=1))
    return summary


def _comparison(out: Path, edits: _Edits, summary: dict[str, Any], runtime_name: str) -> None:
    """Step 4, the comparison: sakura against local, FP16 streaming and the floor, and the
    template | exact | edit | local picture."""
    results, floor, opts, template = edits.results, edits.floor, edits.opts, edits.template
    floor_s, exact = floor.seconds, floor.image
    sk = results["sakura"]
    print(f"      sakura startup allowance {sk.startup_allowance_s * 1e3:.0f} ms "
          f"(startup_fraction {opts.startup_fraction:g}), first configurations "
          f"{' '.join(str(c) for c in sk.configs[:6])} ...")
    lat = {p: r.latency_s for p, r in results.items()}
    summary["speedup_sakura_vs"] = {p: lat[p] / lat["sakura"] for p in lat if p != "sakura"}
    summary["e2e_over_floor"] = lat["sakura"] / floor_s
    summary["exec_inflation"] = sk.exec_s / floor.shard_exec_s
    fp16 = results["fp16"]
    fp16_note = (f" ({fp16.local_fallbacks} of its {template.steps}"
                 " steps computed on the device: the link could not deliver them in time)"
                 if fp16.local_fallbacks else "")
    print(f"      sakura is {lat['local'] / lat['sakura']:.2f}x faster than local and "
          f"{lat['fp16'] / lat['sakura']:.2f}x faster than streaming the FP16 cache"
          f"{fp16_note} (floor: {floor_s:.2f} s with the whole cache resident)")
    print(f"      {runtime_name} runtime: e2e_over_floor {summary['e2e_over_floor']:.2f} "
          f"(sakura latency / floor), exec_inflation {summary['exec_inflation']:.2f} "
          f"(streamed shard execution / resident)")
    _save(template.image, out / "template.png")
    _save(exact, out / "edit-exact.png")
    sk, loc = results["sakura"], results["local"]
    side_by_side([(template.image, "template", "the provider's image"),
                  (exact, "exact", "FP16 cache (the reference)"),
                  (sk.image, "edit (streamed)", f"sakura, {_psnr(sk.psnr_db)} vs exact"),
                  (loc.image, "local", f"whole model, {_psnr(loc.psnr_db)} vs exact")],
                 out / "side-by-side.png")
