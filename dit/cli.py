"""`sakura train`, `sakura generate` and `sakura bench kv|model`: the dit package's commands."""

from __future__ import annotations

import argparse
from pathlib import Path

# Keep in step with dit.train.TrainConfig.out_dir (not imported: the CLI must start fast).
DEFAULT_TRAIN_DIR = str(Path.home() / ".cache" / "sakura" / "train")


def _train(args: argparse.Namespace) -> int:
    from sakura.dit.train import TrainConfig, train

    cfg = TrainConfig(steps=args.steps, out_dir=args.out_dir, weights_out=args.weights_out,
                      threads=args.threads, batch_size=args.batch_size,
                      t_uniform=args.t_uniform, variant_power=args.variant_power)
    train(cfg)
    return 0


def _bench_kv(args: argparse.Namespace) -> int:
    import torch
    from sakura.dit.bench_kv import main

    torch.set_num_threads(args.threads)
    return main(args.json, args.quick, args.template)


def _bench_model(args: argparse.Namespace) -> int:
    from sakura.dit.bench_model import main

    return main(args.json, args.quick, args.grid, args.weights)


def register(commands, bench) -> None:
    m = bench.add_parser("model", help="does the model generate its prompts? (classifier check)")
    m.add_argument("--json", metavar="PATH")
    m.add_argument("--quick", action="store_true")
    m.add_argument("--grid", metavar="PNG", help="also write a held-out sample grid")
    m.add_argument("--weights", help="weights file (default: shipped)")
    m.set_defaults(func=_bench_model)

    b = bench.add_parser("kv", help="KV reuse: masked vs full, reference cache, text KV, offload")
    b.add_argument("--json", metavar="PATH", help="write the result JSON here")
    b.add_argument("--quick", action="store_true", help="fewer steps and repeats (< 60 s)")
    b.add_argument("--template", default="face-technologist")
    b.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1, as the edge runtime; more threads than "
                        "free cores slow execution down many times)")
    b.set_defaults(func=_bench_kv)

    p = commands.add_parser("train", help="train the default MMDiT on the emoji data (resumable)")
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out-dir", default=DEFAULT_TRAIN_DIR, help="checkpoints and loss log")
    p.add_argument("--weights-out", default="dit/weights/sakura-mmdit.safetensors")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--t-uniform", type=float, default=0.5, metavar="FRACTION",
                   help="fraction of samples with uniform t (rest logit-normal; default 0.5)")
    p.add_argument("--variant-power", type=float, default=0.5, metavar="P",
                   help="draw each image with weight (its emoji's skin-tone variants) ** -P, so "
                        "people stop crowding out objects (0 = uniform; default 0.5)")
    p.set_defaults(func=_train)
