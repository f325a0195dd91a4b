"""What the allocator gains from output-PSNR profiles over the KV-error proxy (issue 22).

Builds one template's ``sakura`` pack three ways with ``sakura.cloud.build``: the KV-error
proxy only (``psnr_fit=0``), the default fitted profile (``codec.profile.FittedPSNR``) and,
unless ``--no-full``, every configuration measured (``profile_psnr=1``, the reference). For
a ladder of constant-rate budgets (FP16 bytes of each shard / ratio, unused bytes carried
to the next shard: the allocator's steady state) it picks every shard's configuration as
the runtime's allocator does (``edge.allocator``: Pareto options ranked by the pack's
quality, the best that fits), runs the real edit with exactly those configurations on the
template's *evaluation* prompts (never used to profile) and compares the images with the
FP16-exact edits. Writes JSON: bytes and PSNR per ratio and method, the gains over the
proxy, the fitted profile's error against the measured one, build times, load average.

    .venv/bin/python scripts/psnr_profile_gain.py --template face-technologist \
        --json docs/bench/psnr_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RATIOS = (4.0, 8.0, 16.0, 32.0, 64.0)


def _pack(out: Path, tid: str) -> tuple[Any, Any]:
    from sakura.codec.pack import Manifest, PackReader

    folder = out / "templates" / tid / "sakura"
    manifest = Manifest.load(next(folder.glob("*.manifest.json")))
    return manifest, PackReader(folder / manifest.pack_file)


def _choose(manifest_d: dict[str, Any], ratio: float, fp16: list[int]) -> list[int]:
    """Per shard, as ``AdaptiveAllocator`` under a constant rate with carry-over."""
    from sakura.edge.allocator import options_from_manifest

    out, carry = [], 0.0
    for table, full in zip(options_from_manifest(manifest_d), fp16):
        budget = full / ratio + carry
        pick = next((o for o in table.options if o.nbytes <= budget), table.smallest)
        carry = max(0.0, budget - pick.nbytes)
        out.append(pick.id)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--template", default="face-technologist")
    ap.add_argument("--weights", default=None)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--no-full", action="store_true", help="skip the every-config reference")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None,
                    help="build folder to keep (up-to-date packs and the cache of measured "
                         "PSNRs are reused by a rerun); default: a new temporary folder")
    args = ap.parse_args(argv)

    import torch
    from sakura.cloud.build import BuildConfig, build
    from sakura.codec.metrics import psnr
    from sakura.codec.pack import decode_config
    from sakura.dit.adapters.engine import load_engine
    from sakura.dit.templates import load_catalog
    from sakura.dit.weights import DEFAULT_WEIGHTS
    from sakura.edge.floor import ResidentCache

    torch.set_num_threads(args.threads)
    weights = Path(args.weights) if args.weights else DEFAULT_WEIGHTS
    tid = args.template
    load0 = os.getloadavg()
    tmp = args.work or Path(tempfile.mkdtemp(prefix="psnr-gain-"))
    tmp.mkdir(parents=True, exist_ok=True)
    methods = {"kv_error": {"psnr_fit": 0}, "fitted": {}}
    if not args.no_full:
        methods["measured"] = {"profile_psnr": 1}
    build_s: dict[str, float] = {}
    stats: dict[str, Any] = {}
    for name, kw in methods.items():
        t0 = time.perf_counter()
        build(BuildConfig(out_dir=str(tmp / name), templates=(tid,), codecs=("sakura",),
                          weights=str(weights), psnr_cache=str(tmp / "psnr-cache"), **kw),
              log=lambda m: None)
        build_s[name] = time.perf_counter() - t0
        entry = json.loads((tmp / name / "catalog.json").read_text())["templates"][tid]
        stats[name] = entry.get("psnr_profile")
        print(f"built {name} in {build_s[name]:.1f} s", file=sys.stderr, flush=True)

    engine = load_engine(None, None, weights=weights)
    spec = load_catalog()[tid]
    device = spec.to_device_template()
    prep = engine.prepare(device.image, device.mask, spec.prompt, spec.seed, spec.steps,
                          spec.guidance, device.strength)
    run = engine.template_run(prep)
    exact_cache = run.cache.to_fp16_exact()
    reqs = [engine.request(p, 100 + i) for i, p in enumerate(spec.evaluation_prompts)]
    exact = [engine.edit(prep, exact_cache, r) for r in reqs]

    packs = {name: _pack(tmp / name, tid) for name in methods}
    results: dict[str, list[dict[str, Any]]] = {}
    for name, (manifest, reader) in packs.items():
        fp16 = [manifest.shard_fp16_bytes(i) for i in range(len(manifest.shards))]
        codec = manifest.make_codec()
        rows = []
        for ratio in RATIOS:
            choice = _choose(manifest.to_dict(), ratio, fp16)
            shards = [decode_config(manifest, j, c, reader.read_config(j, c), codec)
                      for j, c in enumerate(choice)]
            provider = ResidentCache(manifest, shards)
            values = [psnr((engine.edit(prep, provider, r) + 1) / 2, (e + 1) / 2)
                      for r, e in zip(reqs, exact)]
            nbytes = sum(manifest.shard(j).config(c).bytes for j, c in enumerate(choice))
            rows.append({"ratio": ratio, "bytes": nbytes,
                         "achieved_ratio": sum(fp16) / nbytes,
                         "psnr_db": sum(values) / len(values), "psnr_db_each": values,
                         "configs": choice})
            print(f"{name:9s} ratio {ratio:5.1f}: {nbytes / 1e6:6.3f} MB, "
                  f"{rows[-1]['psnr_db']:6.2f} dB", file=sys.stderr, flush=True)
        results[name] = rows

    def gain(a: str, b: str) -> dict[str, float]:
        return {f"{r['ratio']:g}": r["psnr_db"] - s["psnr_db"]
                for r, s in zip(results[a], results[b])}

    doc: dict[str, Any] = {
        "command": "python scripts/psnr_profile_gain.py " + " ".join(argv or sys.argv[1:]),
        "template": tid, "evaluation_prompts": len(reqs), "ratios": list(RATIOS),
        "results": results, "gain_db_fitted_vs_kv": gain("fitted", "kv_error"),
        "build_s": build_s, "psnr_profile": stats,
        "load1_before": load0[0], "load1_after": os.getloadavg()[0],
        "cpus": os.cpu_count(), "threads": args.threads,
    }
    if "measured" in results:
        doc["gain_db_measured_vs_kv"] = gain("measured", "kv_error")
        doc["gain_db_fitted_vs_measured"] = gain("fitted", "measured")
        fm, mm = packs["fitted"][0], packs["measured"][0]
        errs = [abs(fc.quality["psnr_db"] - mc.quality["psnr_db"])
                for fs, ms in zip(fm.shards, mm.shards)
                for fc, mc in zip(fs.configs, ms.configs)
                if fc.quality.get("psnr_db") is not None and mc.quality.get("psnr_db")]
        doc["fit_error_db"] = {"mean_abs": sum(errs) / len(errs), "max_abs": max(errs),
                               "configs": len(errs)}
    for _, reader in packs.values():
        reader.close()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: doc[k] for k in doc if k.startswith(("gain", "fit", "build"))},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
