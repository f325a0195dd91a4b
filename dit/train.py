"""Training on captioned emoji (rectified flow, resumable): the default MMDiT, or the second
model (``arch="flux2"``: diffusers' ``Flux2Transformer2DModel`` on the same pixel patches,
:mod:`dit.flux2_pixel`), with one recipe.

Multi-resolution (32/48/64 px, all patch 4, positions normalized so they share one
coordinate frame), caption dropout for classifier-free guidance, category-only prompts,
and reference-image batches built from skin-tone siblings (target = one variant,
reference = another). Checkpoints hold model, EMA, optimizer and RNG state, so a run
killed at any point resumes where it stopped; the EMA weights are exported as the shipped
safetensors file.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from sakura.dit.data import CATEGORIES, EmojiDataset, category_prompt
from sakura.dit.errors import TrainConfigError
from sakura.dit.model import MMDiT, MMDiTConfig, TokenBatch, grid_positions, patchify
from sakura.dit.sampler import renoise
from sakura.dit.text import TextEncoder
from sakura.dit.weights import load_model, metadata, save_model
from torch import nn

_CACHE = Path.home() / ".cache" / "sakura"
#: per architecture: (checkpoint folder, exported weights). Outside the work tree by default
#: so a fresh checkout keeps resuming on this machine.
ARCH_DEFAULTS = {
    "mmdit": (str(_CACHE / "train"), "dit/weights/sakura-mmdit.safetensors"),
    "flux2": (str(_CACHE / "train-flux2"), "dit/weights/sakura-flux2"),
}


@dataclass
class TrainConfig:
    # "mmdit" (the shipped dit.model.MMDiT) or "flux2" (dit.flux2_pixel.PixelFlux2, the
    # second model: diffusers' Flux2Transformer2DModel on the same pixel patches)
    arch: str = "mmdit"
    # None: the architecture's own (ARCH_DEFAULTS), so one arch never resumes the other's run
    out_dir: str | None = None
    weights_out: str | None = None
    steps: int = 20000
    batch_size: int = 32
    lr: float = 4e-4
    warmup: int = 200
    ema_decay: float = 0.999
    resolutions: tuple[int, ...] = (32, 48, 64)
    resolution_probs: tuple[float, ...] = (0.3, 0.2, 0.5)
    ref_prob: float | None = None  # None: 0.1 (mmdit), 0 (flux2: no reference training)
    drop_text: float = 0.1
    category_only: float = 0.2
    checkpoint_every: int = 100
    export_every: int = 500
    seed: int = 0
    threads: int = 0
    bf16: bool = True  # autocast on CPU (AMX/AVX512-BF16: about 1.3x faster here)
    # Fraction of each batch with t ~ U(0, 1) instead of logit-normal. Logit-normal alone
    # almost never trains t < 0.05 (0.16% of samples) although the 20-step sampler's last
    # step runs there: at step 6000 the denoiser at t = 0.02 was only 3.4 dB better than its
    # input and samples kept a 4x4-patch grain (dit.bench_model.denoise_by_t). Steps 0-6400
    # of the shipped model used 0.
    t_uniform: float = 0.5
    # Each image is drawn with weight (skin-tone variants of its emoji) ** -variant_power.
    # Uniform draws (0) give People & Body 60% of batches (2,157 of 3,608 training images,
    # mostly skin-tone copies) and food or vehicles 3.5-6% each; 0.5 gives people 37% and
    # the other categories ~1.6x more steps. Steps 0-11000 of the shipped model used 0.
    variant_power: float = 0.5

    def __post_init__(self) -> None:
        problems = []
        if self.arch not in ARCH_DEFAULTS:
            problems.append(f"unknown arch {self.arch!r}; choose one of {sorted(ARCH_DEFAULTS)}")
        else:
            out_dir, weights_out = ARCH_DEFAULTS[self.arch]
            self.out_dir = self.out_dir or out_dir
            self.weights_out = self.weights_out or weights_out
        if self.ref_prob is None:
            self.ref_prob = 0.0 if self.arch == "flux2" else 0.1
        if self.arch == "flux2" and self.ref_prob > 0:
            problems.append("the flux2 arch trains without reference images (ref_prob 0)")
        if self.steps < 1 or self.batch_size < 1:
            problems.append(f"steps and batch size must be >= 1 (got {self.steps}, "
                            f"{self.batch_size})")
        if not 0.0 <= self.t_uniform <= 1.0:
            problems.append(f"t_uniform must be in [0, 1], got {self.t_uniform}")
        if not 0.0 <= self.variant_power <= 1.0:
            problems.append(f"variant_power must be in [0, 1], got {self.variant_power}")
        if self.lr <= 0:
            problems.append(f"lr must be > 0, got {self.lr}")
        if len(self.resolutions) != len(self.resolution_probs) or sum(self.resolution_probs) <= 0:
            problems.append("resolutions and resolution_probs need equal lengths and "
                            "positive weights")
        if problems:
            raise TrainConfigError("; ".join(problems))



class TextTable:
    """Precomputed MiniLM embeddings of every caption, category prompt and ''."""

    def __init__(self, encoder: TextEncoder, ds: EmojiDataset):
        self.captions = encoder.encode([it.caption for it in ds.items]).half()
        self.categories = encoder.encode([category_prompt(c) for c in CATEGORIES]).half()
        self.empty = encoder.encode([""]).half()
        self.cat_index = {c: i for i, c in enumerate(CATEGORIES)}


def item_weights(indices: list[int], siblings: dict[int, list[int]], power: float) -> list[float]:
    """Draw weight of each image: (number of skin-tone variants of its emoji) ** -power."""
    return [(1 + len(siblings.get(i, ()))) ** -power for i in indices]


def _resize(x: torch.Tensor, size: int) -> torch.Tensor:
    if x.shape[-1] == size:
        return x
    return F.interpolate(x, size=(size, size), mode="bilinear", antialias=True)


def make_batch(ds: EmojiDataset, text: TextTable, idx: list[int], size: int, rng: random.Random,
               cfg: TrainConfig, patch: int, span: float, siblings: dict | None = None):
    x0 = _resize(ds.images[idx].float(), size)
    txt = []
    for i in idx:
        r = rng.random()
        item = ds.items[i]
        if r < cfg.drop_text:
            txt.append(text.empty[0])
        elif r < cfg.drop_text + cfg.category_only and item.category in text.cat_index:
            txt.append(text.categories[text.cat_index[item.category]])
        else:
            txt.append(text.captions[i])
    ref = ref_pos = None
    if siblings is not None:
        ref_idx = [rng.choice(siblings[i]) for i in idx]
        ref = patchify(_resize(ds.images[ref_idx].float(), size), patch)
        ref_pos = grid_positions(size // patch, span, 1.0)
    return patchify(x0, patch), torch.stack(txt).float(), ref, ref_pos


def _restore(cfg: TrainConfig, ckpt_path: Path, model: nn.Module, ema: nn.Module,
             opt: torch.optim.Optimizer, rng: random.Random, log) -> int:
    """Resume from ``ckpt_path`` (model, EMA, optimizer, both RNGs), else warm-start from the
    exported weights (optimizer state afresh), else nothing; returns the step to go on from."""
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        # checkpoints from before the EMA warm-up held an EMA still ~10% random: restart it
        ema.load_state_dict(state["ema"] if state.get("ema_warmup") else state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        rng.setstate(state["py_rng"])
        torch.set_rng_state(state["torch_rng"])
        log(f"resumed from {ckpt_path} at step {step}")
        return step
    arch = ARCHS[cfg.arch]()
    if arch.exported(cfg.weights_out):
        # Warm start from the committed EMA weights (optimizer state starts afresh).
        shipped, meta = arch.load(cfg.weights_out)
        model.load_state_dict(shipped.state_dict())
        ema.load_state_dict(shipped.state_dict())
        step = int(meta.get("train_step", 0))
        rng.seed(cfg.seed + step)
        log(f"warm start from {cfg.weights_out} at step {step}")
        return step
    return 0


@dataclass(frozen=True)
class Arch:
    """What training needs to know of one architecture: its config as the checkpoint
    records it, a fresh model, and how its exported weights are found, read and written."""

    config: Callable[[MMDiTConfig], dict]
    new: Callable[[MMDiTConfig], nn.Module]
    exported: Callable[[str], bool]
    load: Callable[[str], tuple[nn.Module, dict[str, str]]]
    save: Callable[[nn.Module, str, dict[str, str]], None]


def _mmdit() -> Arch:
    return Arch(config=lambda c: c.to_dict(), new=MMDiT,
                exported=lambda path: Path(path).exists(),
                load=lambda path: (load_model(path), metadata(path)), save=save_model)


def _flux2() -> Arch:
    from sakura.dit import flux2_pixel as f  # lazy: diffusers, for this arch only

    return Arch(config=lambda c: {"class": "Flux2Transformer2DModel", **f.FLUX2_CONFIG},
                new=lambda c: f.PixelFlux2(),
                exported=lambda path: (Path(path) / f.WEIGHTS_FILE).is_file(),
                load=lambda path: (f.load_flux2(path), f.flux2_metadata(path)),
                save=f.save_flux2)


#: the architectures by ``TrainConfig.arch`` (built on use: flux2's imports diffusers)
ARCHS: dict[str, Callable[[], Arch]] = {"mmdit": _mmdit, "flux2": _flux2}


def _lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then a cosine decay to 10% of ``cfg.lr`` at ``cfg.steps``."""
    lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup)
    return lr * (0.5 * (1 + math.cos(math.pi * min(1.0, step / cfg.steps))) * 0.9 + 0.1)


def _ema_update(ema: nn.Module, model: nn.Module, ema_decay: float, step: int) -> None:
    """EMA with warm-up (as in common diffusion training): a plain 0.999 decay keeps
    0.999**step of the random initialisation, still 9% at step 2400."""
    decay = min(ema_decay, (1 + step) / (10 + step))
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), model.parameters()):
            pe.lerp_(pm, 1 - decay)


def _checkpoint(ckpt_path: Path, model: nn.Module, ema: nn.Module, opt: torch.optim.Optimizer,
                step: int, rng: random.Random) -> None:
    """Everything a resume needs, replaced whole (temporary file, then rename)."""
    tmp = ckpt_path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "ema": ema.state_dict(),
                "opt": opt.state_dict(), "step": step, "py_rng": rng.getstate(),
                "ema_warmup": True, "torch_rng": torch.get_rng_state()}, tmp)
    tmp.replace(ckpt_path)


def train(cfg: TrainConfig, model_cfg: MMDiTConfig | None = None, log=print,
          dataset: EmojiDataset | None = None) -> Path:
    """Train (or resume) until ``cfg.steps``; return the exported EMA weights.

    ``dataset`` defaults to the whole emoji set (fetched once with npm); tests pass a few
    images."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "checkpoint.pt"
    ds = dataset if dataset is not None else EmojiDataset.load()
    text = TextTable(TextEncoder(), ds)
    train_idx = ds.split(held_out=False)
    siblings = {i: s for i, s in ds.siblings().items() if i in set(train_idx)}
    sib_idx = list(siblings)
    # cumulative weights once: rng.choices with cum_weights is O(log n) per draw
    train_cum = list(itertools.accumulate(item_weights(train_idx, siblings, cfg.variant_power)))

    model_cfg = model_cfg or MMDiTConfig()
    torch.manual_seed(cfg.seed)  # before the model: its initialisation is part of the run
    arch = ARCHS[cfg.arch]()
    model = arch.new(model_cfg)
    ema = arch.new(model_cfg).requires_grad_(False)
    ema.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.99))
    rng = random.Random(cfg.seed)
    step = _restore(cfg, ckpt_path, model, ema, opt, rng, log)
    (out / "train_config.json").write_text(json.dumps(
        {"train": asdict(cfg), "model": arch.config(model_cfg),
         "train_items": len(train_idx)},
        indent=2))
    loss_log = (out / "loss.csv").open("a")
    p, span = model_cfg.patch_size, model_cfg.pos_span  # (PixelFlux2: the same 4x4 patches)

    from tqdm import tqdm

    if step >= cfg.steps:
        log(f"already at step {step} >= {cfg.steps}: nothing to train (raise --steps)")
    bar = tqdm(total=cfg.steps, initial=step, desc="train", dynamic_ncols=True)
    t_last = time.time()
    while step < cfg.steps:
        size = rng.choices(cfg.resolutions, cfg.resolution_probs)[0]
        use_ref = rng.random() < cfg.ref_prob
        pool = sib_idx if use_ref else train_idx
        if use_ref or cfg.variant_power == 0:  # power 0: the draws of earlier runs, unchanged
            idx = [rng.choice(pool) for _ in range(cfg.batch_size)]
        else:
            idx = rng.choices(train_idx, cum_weights=train_cum, k=cfg.batch_size)
        if use_ref:
            size = min(cfg.resolutions)  # reference batches are paid for at the low resolution
        x0, txt, ref, ref_pos = make_batch(ds, text, idx, size, rng, cfg, p, span,
                                           siblings if use_ref else None)
        b = x0.shape[0]
        t = torch.sigmoid(torch.randn(b))  # logit-normal
        t = torch.where(torch.rand(b) < cfg.t_uniform, torch.rand(b), t)
        e = torch.randn_like(x0)
        xt = renoise(x0, e, t[:, None, None])
        batch = TokenBatch(img=xt, img_pos=grid_positions(size // p, span), txt=txt, t=t,
                           ref=ref, ref_pos=ref_pos)
        lr = _lr_at(cfg, step)
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            pred = model(batch)
        loss = F.mse_loss(pred.float(), e - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        _ema_update(ema, model, cfg.ema_decay, step)
        step += 1
        loss_log.write(f"{step},{size},{int(use_ref)},{loss.item():.5f},{lr:.6g}\n")
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.4f}", res=size)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            loss_log.flush()
            _checkpoint(ckpt_path, model, ema, opt, step, rng)
        if step % cfg.export_every == 0 or step == cfg.steps:
            arch.save(ema, cfg.weights_out, {"train_step": str(step)})
            log(f"step {step}: exported EMA weights to {cfg.weights_out} "
                f"({time.time() - t_last:.0f}s since last export)")
            t_last = time.time()
    bar.close()
    loss_log.close()
    return Path(cfg.weights_out)
