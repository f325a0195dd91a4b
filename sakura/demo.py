"""`sakura demo`: the main job on the embedded defaults, end to end.

1. build the default template's packs (``sakura`` and ``fp16``) with the provider's builder
   if they are missing or stale (``cloud.build``: template run, importance profiling,
   encoding, atomic publish), with the template's device bundle (``sakura.bundle_cli``:
   the graphs, text encoder and tables the device executes, published beside the packs);
2. start ``sakura serve`` on them (a separate process on 127.0.0.1);
3. the device fetches the template from the server's catalog (image, mask, steps: the
   provider's data), encodes its private prompt, and runs the edit with ``sakura`` over a
   real 5G trace (Lumos5G, from ``../shared/traces``) replayed by the paced link, regime-
   matched (FP16 cache at the trace median = 10x the masked execution time); then ``fp16``
   over the same trace window and ``local`` (whole model on the device, no network);
4. prints a side-by-side summary and writes images, timeline plots and JSON to
   ``out/demo/``.

Without ``../shared/traces`` it uses a fixed rate and says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from sakura.argtypes import nonnegative_float, prompt_text, seed
from sakura.bundle_cli import export_for_build
from sakura.dit.cli import check_file, check_template
from sakura.edge.cli import (
    prompt_tokens,
    resolve_runtime,
    runtime_arg,
    startup_fraction,
    startup_fraction_arg,
)
from sakura.errors import SakuraError
from sakura.traces import Trace, default_trace_dir, load_trace, trace_set

DEFAULT_TEMPLATE = "face-technologist"


def register(commands: Any, bench: Any) -> None:
    p = commands.add_parser("demo", help="the main job: build, serve, replay a real trace, edit",
                            description=__doc__.split("\n\n")[0])
    p.add_argument("--template", default=DEFAULT_TEMPLATE, metavar="ID",
                   help="shipped catalog template (default %(default)s)")
    p.add_argument("--prompt", type=prompt_text,
                   help="private edit prompt (default: the template's first evaluation "
                        "prompt)")
    p.add_argument("--seed", type=seed, default=100, metavar="N",
                   help="edit noise seed, 0 to 2**63 - 1 (default 100)")
    p.add_argument("--out", default="out/demo", metavar="DIR",
                   help="where images, plots and JSON go (default out/demo)")
    p.add_argument("--packs", default="packs", metavar="DIR",
                   help="published catalog directory (default packs)")
    p.add_argument("--trace", metavar="PATH",
                   help="trace file (default: a Lumos5G 5G walking trace)")
    p.add_argument("--start", type=nonnegative_float, default=20.0, metavar="S",
                   help="start offset in the trace (s; default 20)")
    p.add_argument("--startup-fraction", type=startup_fraction, metavar="F",
                   help="startup allowance of the streamed edits, a fraction of the predicted "
                        "execution time (default: the runtime's, EditOptions.startup_fraction)")
    runtime_arg(p, python_needs="")
    p.set_defaults(func=run_demo)


def _save(img, path: Path) -> None:
    from PIL import Image

    arr = ((img.permute(1, 2, 0).clamp(-1, 1) + 1) * 127.5).round().byte().numpy()
    Image.fromarray(arr).resize((arr.shape[1] * 4, arr.shape[0] * 4), Image.NEAREST).save(path)


def side_by_side(panels: list[tuple[Any, str, str]], path: Path, scale: int = 4) -> Path:
    """Images ``[3, H, W]`` in [-1, 1] side by side, each enlarged ``scale`` x (nearest)
    under its label (what it is) and over its caption (how it was made, how close it is)."""
    from PIL import Image, ImageDraw, ImageFont

    arrays = [((img.permute(1, 2, 0).clamp(-1, 1) + 1) * 127.5).round().byte().numpy()
              for img, _, _ in panels]
    h, w = arrays[0].shape[0] * scale, arrays[0].shape[1] * scale
    gap, top, bottom = 8, 30, 24
    font = ImageFont.load_default(size=17)
    small = ImageFont.load_default(size=13)
    sheet = Image.new("RGB", (len(panels) * (w + gap) + gap, top + h + bottom), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (arr, (_, label, caption)) in enumerate(zip(arrays, panels)):
        x = gap + i * (w + gap)
        tile = Image.fromarray(arr).resize((arr.shape[1] * scale, arr.shape[0] * scale),
                                           Image.NEAREST)
        sheet.paste(tile, (x, top))
        draw.text((x + w / 2, top / 2), label, fill="black", font=font, anchor="mm")
        draw.text((x + w / 2, top + h + bottom / 2), caption, fill="#444444", font=small,
                  anchor="mm")
    sheet.save(path)
    return path


def _pick_trace(path: str | None):
    if path:
        return load_trace(path), Path(path).name, None
    root = default_trace_dir()
    if root is None:
        note = ("../shared/traces not found: using a fixed 100 Mbit/s link instead of a real "
                "trace (set SAKURA_TRACES to a trace folder)")
        return Trace.constant(100e6, 1.0), "constant-100mbps", note

    files = trace_set("5g-walking")
    return load_trace(files[0]), files[0].name, None


def _psnr(db: float | None) -> str:
    if db is None:
        return "PSNR n/a"
    return "identical" if db == float("inf") else f"{db:.1f} dB"


def run_demo(args: argparse.Namespace) -> int:
    check_template(args.template)  # before anything loads
    check_file(args.trace, "--trace")
    import torch

    from sakura.cloud.build import BuildConfig, build  # lazy: CLI --help stays fast
    from sakura.dit.templates import device_template, load_catalog  # lazy: torch
    from sakura.dit.weights import DEFAULT_WEIGHTS, load_model  # lazy: torch
    from sakura.edge.bench import _pin_device, file_sha256  # lazy: torch
    from sakura.edge.client import PackClient  # lazy: aiohttp
    from sakura.edge.floor import resident_floor  # lazy: torch
    from sakura.edge.netem import matched_rtt_ms, shaped  # lazy: CLI --help stays fast
    from sakura.edge.policy_packs import catalog_usable  # lazy: torch
    from sakura.edge.runtime import EdgeRuntime, EditOptions  # lazy: torch
    from sakura.edge.server_process import ServerProcess  # lazy: CLI --help stays fast
    from sakura.edge.timeline import plot_timeline  # lazy: CLI --help stays fast
    from sakura.traces.impair import DEFAULT_RTT_MS  # lazy: CLI --help stays fast

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
    stale = (packs / "catalog.json").exists() and not catalog_usable(packs, args.template)
    print(f"[1/4] sakura build {args.template} -> {packs}/ (skipped when up to date)")
    report = build(BuildConfig(out_dir=str(packs), templates=(args.template,),
                               codecs=("sakura", "fp16"), force=stale,
                               bundle_exporter=export_for_build), log=print)
    print(f"      built {report.built or 'nothing'}, up to date {report.skipped or 'nothing'}"
          + (f"; device bundle {report.bundles[args.template]}"
             if args.template in report.bundles else ""))

    # 2) serve
    model = load_model()
    runtime = EdgeRuntime(model, weights_sha256=file_sha256(DEFAULT_WEIGHTS),
                          runtime=runtime_name)
    with ServerProcess(packs, cpus=network_cpus) as server:
        print(f"[2/4] sakura serve {packs} at {server.url}")

        # 3) the device: template from the server, private request stays here
        async def entry() -> dict:
            async with PackClient(server.url) as client:
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
        floor = resident_floor(runtime, server.url, args.template, template, req, repeats=2)
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
        with shaped(server.url, trace, args.start, rtt_ms=rtt,
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
        results["local"] = runtime.edit(server.url, args.template, template, req,
                                        "local").compare(exact)

    # 4) summary, images, plots
    print(f"[4/4] prompt {prompt!r} (never left the device); results in {out}/")
    print(f"      {'policy':8s} {'latency s':>9s} {'MB moved':>9s} {'stalls':>6s} "
          f"{'local steps':>11s} {'PSNR vs exact':>13s} {'SSIM':>6s}")
    summary: dict[str, Any] = {"template": args.template, "prompt": prompt, "seed": args.seed,
                               **tokens,
                               "trace": trace_name, "start_s": args.start,
                               "regime": {"mode": "regime-matched", "factor": factor,
                                          "scaled_median_mbps": scaled / 1e6,
                                          "masked_exec_s": floor_s, "fp16_bytes": fp16_bytes,
                                          "note": note},
                               "compute_bound_s": floor_s, "runtime": runtime_name,
                               "cpus": ({"device": sorted(cpus[0]),
                                         "server_and_link": sorted(cpus[1])} if cpus else None),
                               "startup_fraction": opts.startup_fraction, "policies": {}}
    for policy, res in results.items():
        psnr = "inf" if res.psnr_db == float("inf") else f"{res.psnr_db:.2f} dB"
        local_steps = "all" if policy == "local" else str(res.local_fallbacks)
        print(f"      {policy:8s} {res.latency_s:9.3f} {res.bytes / 1e6:9.3f} {res.stalls:6d} "
              f"{local_steps:>11s} {psnr:>13s} {res.ssim:6.3f}")
        summary["policies"][policy] = res.summary()
        _save(res.image, out / f"edit-{policy}.png")
        if res.timeline:
            plot_timeline(res.timeline, out / f"timeline-{policy}.png",
                          f"{policy} on {args.template}, {trace_name} @ {args.start:g} s",
                          phases=res.phases, latency_s=res.latency_s)
            (out / f"timeline-{policy}.json").write_text(json.dumps(res.timeline, indent=1))
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
    summary["elapsed_s"] = time.monotonic() - t_start
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"      images: template | exact | edit (streamed) | local -> "
          f"{out}/side-by-side.png")
    return 0
