"""Developer tool: the model card's figures from the training log and the shipped weights.

    .venv/bin/python scripts/model_card_figures.py [--loss ~/.cache/sakura/train/loss.csv]

Writes docs/model/loss.png (training loss, smoothed, per resolution) and
docs/model/samples.png (held-out captions: generated top row, real bottom row).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "docs" / "model"
# From this step half of each batch draws t uniformly (TrainConfig.t_uniform): more
# low-noise samples, whose velocity loss is higher, so the curve steps up there.
T_UNIFORM_FROM = 6400


def loss_plot(csv: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = np.loadtxt(csv, delimiter=",")
    step, res, loss = rows[:, 0], rows[:, 1], rows[:, 3]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for r in sorted(set(res.astype(int))):
        sel = res == r
        k = 50
        sm = np.convolve(loss[sel], np.ones(k) / k, mode="valid")
        ax.plot(step[sel][k - 1 :], sm, label=f"{r}px")
    if step[-1] > T_UNIFORM_FROM:
        ax.axvline(T_UNIFORM_FROM, color="grey", ls=":", lw=1)
        ax.annotate("t: logit-normal -> 50% uniform", (T_UNIFORM_FROM, ax.get_ylim()[1]),
                    xytext=(4, -12), textcoords="offset points", fontsize=8, color="grey")
    ax.set_xlabel("training step (batch 32)")
    ax.set_ylabel("flow-matching loss (50-step mean)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    OUT.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT / "loss.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loss", default=str(Path.home() / ".cache/sakura/train/loss.csv"))
    ap.add_argument("--no-samples", action="store_true")
    args = ap.parse_args()
    loss_plot(Path(args.loss))
    if not args.no_samples:
        from sakura.dit.bench_model import write_grid
        from sakura.dit.data import EmojiDataset
        from sakura.dit.text import TextEncoder
        from sakura.dit.weights import load_model

        write_grid(load_model(), TextEncoder(), EmojiDataset.load(), str(OUT / "samples.png"),
                   steps=20, guidance=3.0)


if __name__ == "__main__":
    main()
