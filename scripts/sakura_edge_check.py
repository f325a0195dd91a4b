"""The shipped model through ``sakura-edge`` and through the Python runtime (issue 31 item 2).

Copies one template of the shipped catalog (``packs/``) into a scratch folder, exports its
device bundle there (graphs from the compiled-artifact cache when held; the tables with
``txt_in``), serves it with ``sakura serve`` on loopback, and runs the same edits with the
binary and with ``EdgeRuntime(runtime="native")`` (``sakura edit --runtime native``), on
fixed configurations (``sakura-fixed-config`` at a budget that takes the best common
configuration, and at one that takes the smallest; ``fp16``), prompts encoded by the same
program. Prints and writes ``{max_abs_err per configuration, latency per run, ratio}``.

    python scripts/sakura_edge_check.py [--exe native/build/sakura-edge/sakura-edge]
        [--template face-technologist] [--runs 3] [--json docs/bench/sakura-edge.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


class ProgramEncoder:
    def __init__(self, pte: Path, vocab: Path) -> None:
        self.pte, self.vocab = str(pte), str(vocab)

    def encode(self, prompts: list[str]) -> torch.Tensor:
        import sakura_native

        enc = sakura_native.TextEncoder(self.pte, self.vocab)
        return torch.stack([torch.from_numpy(np.asarray(enc.encode(p)).copy())
                            for p in prompts])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--exe", default=str(ROOT / "native/build/sakura-edge/sakura-edge"))
    ap.add_argument("--template", default="face-technologist")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from sakura.cloud.bundle import publish_bundle
    from sakura.cloud.publish import update_catalog
    from sakura.dit.templates import load_catalog
    from sakura.dit.adapters.engine import load_engine
    from sakura.edge.backends.base import BackendConfig
    from sakura.edge.backends.text_encoder import compiled_text_encoder
    from sakura.edge.bundle import export_bundle
    from sakura.edge.options import EditOptions
    from sakura.edge.runtime import EdgeRuntime
    from sakura.edge.server_process import ServerProcess

    tid = args.template
    src = json.loads((ROOT / "packs/catalog.json").read_text())
    prompt = load_catalog()[tid].evaluation_prompts[0]
    out: dict = {"template": tid, "prompt": prompt, "seed": args.seed, "configs": {}}
    with tempfile.TemporaryDirectory(prefix="sakura-edge-check-") as tmp:
        tmp = Path(tmp)
        catalog = tmp / "catalog"
        shutil.copytree(ROOT / "packs/templates" / tid, catalog / "templates" / tid)
        entry = dict(src["templates"][tid])
        entry.pop("bundle", None)
        (catalog / "catalog.json").write_text(json.dumps(
            {"version": src["version"], "templates": {tid: entry}}))
        engine = load_engine()
        model = engine.model
        spec = load_catalog()[tid]
        template = spec.to_device_template()
        req = engine.request(spec.evaluation_prompts[0], 0)
        t0 = time.perf_counter()
        made = export_bundle(model, engine.weights_id, template, req, 4, work=tmp / "work")
        out["bundle_export_s"] = round(time.perf_counter() - t0, 1)
        bundle = publish_bundle(catalog, made.files, made.doc)
        update_catalog(catalog, {tid: {"bundle": bundle}})
        program = compiled_text_encoder(16)
        enc = ProgramEncoder(program.pte, program.vocab)
        env = {**os.environ, "SAKURA_CACHE": str(tmp / "device-cache")}
        with ServerProcess(catalog) as srv:
            rt = EdgeRuntime(model, encoder=enc, runtime="native",
                             weights_sha256=engine.weights_id,
                             backend_config=BackendConfig(cache_dir=tmp / "py-compiled"))
            tpl = rt.fetch_template(srv.url, tid)
            for policy, rate in (("sakura-fixed-config", 1e12), ("sakura-fixed-config", 1.0),
                                 ("fp16", 1e12)):
                name = f"{policy}@{rate:g}"
                opts = EditOptions(local_fallback=False, budget_rate_bps=rate)
                bin_lat, py_lat, errs = [], [], []
                for _ in range(args.runs):
                    npy, tl = tmp / "o.npy", tmp / "t.json"
                    done = subprocess.run(
                        [args.exe, "edit", "--origin", srv.url, "--template", tid,
                         "--prompt", prompt, "--seed", str(args.seed), "--out",
                         str(tmp / "o.png"), "--policy", policy, "--budget-rate-bps",
                         str(rate), "--no-local-fallback", "--float-out", str(npy),
                         "--timeline", str(tl)], capture_output=True, text=True, env=env)
                    if done.returncode != 0:
                        print(done.stderr, file=sys.stderr)
                        return 1
                    bin_lat.append(json.loads(tl.read_text())["latency_s"])
                    res = rt.edit(srv.url, tid, tpl, rt.request(prompt, args.seed), policy,
                                  options=opts)
                    py_lat.append(res.latency_s)
                    errs.append(float(np.abs(np.load(npy) - res.image.numpy()).max()))
                out["configs"][name] = {
                    "max_abs_err": max(errs), "binary_latency_s": bin_lat,
                    "module_latency_s": py_lat,
                    "binary_latency_ratio_vs_module": statistics.median(bin_lat)
                    / statistics.median(py_lat)}
                print(name, json.dumps(out["configs"][name]))
    out["binary_vs_python_runtime_max_abs_err"] = max(c["max_abs_err"]
                                                      for c in out["configs"].values())
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
