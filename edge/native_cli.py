"""``sakura bench native``: native (C++) vs Python reconstruction, pipeline overhead;
``sakura bench phone``: the ``sakura-edge`` executable on x86 and on arm64 under emulation.

``sakura bench native --json PATH [--pack DIR [--template ID]] [--shards N] [--threads T]``
writes the JSON described in :mod:`edge.native_bench`; ``--export DIR`` instead writes the
sampled shards for the standalone ``sakura-native run DIR`` (``native/README.md``).

``sakura bench phone --json PATH [--keys arm64,x86,text_encoder,bundle,int8]
[--bundle-record FILE]`` computes the keys named (:mod:`edge.sakura_edge_bench`) and writes
them into PATH, keeping the other keys a file already there holds (the phone bench's keys
are measured by different parts of the tree). ``--bundle-record`` takes the ``bundle`` key
from a ``sakura bench bundle`` JSON (the same function; measuring it again takes ~10
minutes here) and says so in the key.
Imports are lazy so ``sakura --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from sakura.dit.cli import check_template

from sakura import output
from sakura.argtypes import json_out, name_list, positive_int
from sakura.errors import UsageError

PHONE_KEYS = ("arm64", "x86", "text_encoder", "bundle", "int8")
DEFAULT_KEYS = ("arm64", "x86")


def register(commands: Any, bench: Any) -> None:
    p = bench.add_parser(
        "native", help="native (C++) vs Python sakura reconstruction and pipeline overhead",
        description="Decode every configuration of a sample of shards with the Python and "
                    "the native decoder (1 thread each, and native with --threads), check "
                    "they agree, and time a pipeline of no-op stages.")
    json_out(p, required=False)
    p.add_argument("--pack", metavar="DIR", help="a sakura/svd pack directory (default: a "
                   "synthetic cache at the shipped model's geometry)")
    p.add_argument("--template", metavar="ID", help="template id of the pack's manifest")
    p.add_argument("--shards", type=positive_int, default=6, metavar="N",
                   help="shards sampled (default 6)")
    p.add_argument("--configs", type=positive_int, default=8, metavar="N",
                   help="configs per shard (default 8)")
    p.add_argument("--repeats", type=positive_int, default=15, metavar="N",
                   help="timings per config (median; default 15)")
    p.add_argument("--threads", type=positive_int, default=2, metavar="N",
                   help="threads of the native multi-thread figure (default 2)")
    p.add_argument("--export", metavar="DIR",
                   help="write the sampled shards for `sakura-native run DIR` instead")
    p.set_defaults(func=_bench)

    ph = bench.add_parser(
        "phone", help="sakura-edge (one native executable) on x86 vs the Python runtime, "
                      "cross-built for arm64 under qemu vs x86; text encoder, bundle, int8",
        description="Serve one template of the shipped catalog with its device bundle on "
                    "loopback; edit it on fixed configurations with the x86 sakura-edge and "
                    "the Python runtime (x86: error, latency ratio), and with sakura-edge "
                    "cross-built for arm64 under qemu-aarch64 against the x86 binary (arm64: "
                    "PSNR, error, no interpreter); text_encoder: the C++ tokenizer and "
                    "encoder program vs torch; bundle: the device bundle's size and the "
                    "device export it saves; int8: the int8 shard graphs in the same edits "
                    "(PSNR vs fp32 and exact, exec speedup, Linear share). Emulated timings "
                    "are not reported.")
    json_out(ph)
    ph.add_argument("--keys", type=name_list, default=DEFAULT_KEYS, metavar="K[,K]",
                    help=f"keys to measure, of {','.join(PHONE_KEYS)} (default "
                         f"{','.join(DEFAULT_KEYS)}); the file's other keys are kept")
    ph.add_argument("--bundle-record", metavar="FILE",
                    help="take the bundle key from this `sakura bench bundle --json` file "
                         "(recorded as its source) instead of measuring it (~10 minutes)")
    ph.add_argument("--template", default="face-technologist", metavar="ID",
                    help="template of the shipped catalog (default face-technologist)")
    ph.add_argument("--runs", type=positive_int, default=3, metavar="N",
                    help="timed runs per configuration on x86 and for int8 (median; default 3)")
    ph.add_argument("--seed", type=positive_int, default=3, metavar="N",
                    help="edit seed (default 3)")
    ph.set_defaults(func=_bench_phone)


def _bench_phone(args: argparse.Namespace) -> int:

    unknown = [k for k in args.keys if k not in PHONE_KEYS]
    if unknown or not args.keys:
        raise UsageError(f"--keys: unknown key {', '.join(unknown) or '(none)'} "
                         f"(known: {', '.join(PHONE_KEYS)})")
    check_template(args.template)
    record = Path(args.bundle_record) if args.bundle_record else None
    if record is not None and "bundle" in args.keys:
        try:
            rec = json.loads(record.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"--bundle-record: cannot read {record}: {exc}") from exc
        if not isinstance(rec, dict) or rec.get("template") != args.template:
            raise UsageError(f"--bundle-record: {record} is not a `sakura bench bundle` "
                             f"record of template {args.template}")
    from sakura.edge.sakura_edge_bench import phone_figures  # lazy: torch

    doc: dict = {}
    if Path(args.json).is_file():  # keep the keys measured elsewhere
        try:
            doc = json.loads(Path(args.json).read_text())
        except ValueError:
            doc = {}
    doc.update(phone_figures(args.keys, args.template, runs=args.runs, seed=args.seed,
                             bundle_record=record,
                             log=lambda m: print(m, file=sys.stderr, flush=True)))
    output.write_json(args.json, doc, indent=1)
    arm, x86 = doc.get("arm64", {}), doc.get("x86", {})
    if "arm64" in args.keys:
        print(f"arm64: built {arm.get('built')}, edit_ok {arm.get('edit_ok')}, interpreter "
              f"started {arm.get('interpreter_started')}, PSNR vs x86 "
              f"{arm.get('psnr_db_vs_x86')} dB, max abs err {arm.get('max_abs_err_vs_x86')}"
              + (f" ({arm['error']})" if "error" in arm else ""))
    if "x86" in args.keys:
        print(f"x86: binary vs Python runtime max abs err "
              f"{x86.get('binary_vs_python_runtime_max_abs_err')}, latency ratio "
              f"{x86.get('binary_latency_ratio_vs_module')}")
    if "text_encoder" in args.keys:
        te = doc["text_encoder"]
        print(f"text_encoder: {te.get('prompts')} prompts, token ids identical "
              f"{te.get('token_ids_identical')}, max abs err vs torch "
              f"{te.get('max_abs_err_vs_torch')}" + (f" ({te['error']})" if "error" in te else ""))
    if "bundle" in args.keys:
        b = doc["bundle"]
        print(f"bundle: {b.get('bytes')} bytes in {b.get('files')} files, export "
              f"{b.get('export_s')} s, device export saved {b.get('device_export_s_saved')} s")
    if "int8" in args.keys:
        q = doc["int8"]
        print(f"int8: PSNR vs fp32 {q.get('edit_psnr_db_vs_fp32')} dB, vs exact "
              f"{q.get('edit_psnr_db_vs_exact')} dB, exec speedup "
              f"x{q.get('exec_speedup_vs_fp32')}, Linear share {q.get('linear_share_of_exec')}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if not (args.json or args.export):
        raise UsageError("give --json PATH (or --export DIR)")
    from sakura.edge.native_bench import (  # lazy: torch
        NativeBenchConfig,
        export_shards,
        run,
        write_json,
    )

    cfg = NativeBenchConfig(pack_dir=Path(args.pack) if args.pack else None,
                            template=args.template, shards=args.shards,
                            configs_per_shard=args.configs, repeats=args.repeats,
                            threads=args.threads)
    if args.export:
        info = export_shards(cfg, Path(args.export))
        print(f"wrote {info['shards']} shards to {info['dir']}")
        return 0
    res = run(cfg)
    write_json(res, args.json)
    pipe = res["pipeline"]
    t = args.threads
    print(f"native {res['native_gbps']:.3f} GB/s ({t} threads {res[f'native_{t}t_gbps']:.3f}) "
          f"vs python {res['python_gbps']:.3f} GB/s: speedup x{res['native_speedup']:.2f} "
          f"(min x{res['speedup_min']:.2f}); bit-equal {res['bit_equal_tensors']}/"
          f"{res['tensors']}; no-op pipeline {pipe['noop_native_us_per_shard']:.1f} us/shard "
          f"(python stages {pipe['noop_python_callables_us_per_shard']:.1f})")
    return 0
