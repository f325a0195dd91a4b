"""A Flux.2-style MMDiT in plain torch: the default model of SAKURA.

Double-stream blocks (separate text / image weights, joint attention) are followed by
single-stream blocks (one fused weight set over all tokens). Positions are 3-axis rotary
embeddings (segment index, row, column) with RMS QK-norm; timestep modulation is shared
across blocks of a kind, as in Flux.2. Text conditioning is a sequence of MiniLM token
embeddings that joins the joint attention (no pooled text vector, as in Flux.2).

Every attention call goes through an :class:`AttentionHook` (``dit.attention``), which is
how the editing code captures K/V, appends cached K/V of tokens that are not computed,
reuses reference/prefix K/V and measures token importance, without forking the blocks.

Token layout of one forward call: ``[text (T), image (N), reference (R)]``. Reference
tokens carry a fixed timestep (``t = 0``) and attend only to themselves (Flux.2-klein KV
semantics); in ``block_causal`` mode the text+reference prefix follows QwenImage 2.1's
block-causal rule instead (see ``dit.prefix``).

``MMDiTConfig``'s conversion options (SwiGLU MLPs, LayerNorm eps, no biases, FLUX integer
position ids) let the same modules hold other trained models of this family: the pixel
FLUX.2 (``dit.flux2_native``). At their defaults the shipped model is computed as before.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from sakura.dit.attention import AttentionHook, Layout, PlainAttention
from torch import nn


@dataclass
class MMDiTConfig:
    """Architecture of the MMDiT; the defaults are the shipped SAKURA model."""

    in_channels: int = 3
    patch_size: int = 4
    hidden_size: int = 192
    num_heads: int = 6
    double_blocks: int = 2
    single_blocks: int = 6
    mlp_ratio: float = 3.0
    text_dim: int = 384
    text_tokens: int = 16
    # Spatial positions are normalized so every resolution spans [0, pos_span) rows/cols.
    pos_span: float = 16.0
    rope_theta: float = 100.0
    rope_axes: tuple[int, int, int] = (8, 12, 12)
    # "joint" (Flux.2: references attend to themselves) or "block_causal" (QwenImage 2.1).
    attention_mode: str = "joint"
    extra: dict = field(default_factory=dict)
    # Arithmetic options of models converted into this form (``dit.flux2_native``: the
    # trained FLUX.2 transformer). The defaults are the shipped MMDiT's arithmetic, and
    # ``to_dict`` leaves a field out while it holds its default, so the shipped config (the
    # weights file's metadata, the compiled-graph cache keys) is byte-for-byte what it was.
    # "gelu_tanh": Linear(d, m) -> tanh-GELU; "swiglu" (FLUX.2): Linear(d, 2m) -> silu(a) * b.
    mlp_act: str = "gelu_tanh"
    # eps of the affine-free LayerNorms (torch's default; FLUX.2: 1e-6). RMS QK-norms: 1e-6.
    layer_norm_eps: float = 1e-5
    # Biases of img_in / txt_in / time_in / the modulations / final (FLUX.2 has none).
    bias: bool = True
    # "normalized": ``grid_positions`` (segment, row, col) spanning ``pos_span``, text at 0;
    # "flux_ids": FLUX's integer ids, image (0, row, col, 0), text (0, 0, 0, index).
    positions: str = "normalized"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_blocks(self) -> int:
        return self.double_blocks + self.single_blocks

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.patch_size**2

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rope_axes"] = list(self.rope_axes)
        for name, default in _CONVERSION_DEFAULTS.items():
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> MMDiTConfig:
        d = dict(d)
        if "rope_axes" in d:
            d["rope_axes"] = tuple(d["rope_axes"])
        return cls(**d)

    def validate(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if sum(self.rope_axes) != self.head_dim or any(a % 2 for a in self.rope_axes):
            raise ValueError("rope_axes must be even and sum to head_dim")
        if self.attention_mode not in ("joint", "block_causal"):
            raise ValueError("attention_mode must be 'joint' or 'block_causal'")
        if self.mlp_act not in ("gelu_tanh", "swiglu"):
            raise ValueError("mlp_act must be 'gelu_tanh' or 'swiglu'")
        if self.positions not in ("normalized", "flux_ids"):
            raise ValueError("positions must be 'normalized' or 'flux_ids'")
        if len(self.rope_axes) != (4 if self.positions == "flux_ids" else 3):
            raise ValueError("rope_axes needs one entry per position axis (3 normalized, "
                             "4 flux_ids)")


# The conversion options (see MMDiTConfig) at their shipped values: left out of to_dict.
_CONVERSION_DEFAULTS = {"mlp_act": "gelu_tanh", "layer_norm_eps": 1e-5, "bias": True,
                        "positions": "normalized"}


# ----------------------------------------------------------------------------- helpers


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of t in [0, 1] (scaled by 1000 as in Flux)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_angles(pos: torch.Tensor, axes: tuple[int, ...], theta: float) -> torch.Tensor:
    """Rotary angles for positions ``[T, len(axes)]`` -> ``[T, head_dim/2]``."""
    out = []
    for i, dim in enumerate(axes):
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        out.append(pos[:, i : i + 1].double() * freqs[None])
    return torch.cat(out, dim=-1).float()


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of ``x [B, H, T, D]`` by ``angles [T, D/2]``."""
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


class SwiGLU(nn.Module):
    """``silu(a) * b`` of the two halves ``[a, b]`` of the last dim (FLUX.2's MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b


def mlp_activation(cfg: MMDiTConfig) -> nn.Module:
    return SwiGLU() if cfg.mlp_act == "swiglu" else nn.GELU(approximate="tanh")


def mlp_in_width(cfg: MMDiTConfig) -> int:
    """Width of the MLP's input projection (twice the hidden width for SwiGLU)."""
    mlp = int(cfg.hidden_size * cfg.mlp_ratio)
    return 2 * mlp if cfg.mlp_act == "swiglu" else mlp


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, T, H*D] -> [B, H, T, D]`` (a view when ``x`` allows one)."""
    b, t, c = x.shape
    return x.reshape(b, t, heads, c // heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, D] -> [B, T, H*D]``."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


# ----------------------------------------------------------------------------- blocks


@dataclass
class Segments:
    """Per-call token segments with their modulation vectors (each ``[B, 1, D]``)."""

    txt: torch.Tensor  # [B, T, D]
    img: torch.Tensor  # [B, N, D]
    ref: torch.Tensor  # [B, R, D]
    vec_txt: torch.Tensor
    vec_img: torch.Tensor
    vec_ref: torch.Tensor


class DoubleStreamBlock(nn.Module):
    """Separate text and image weights, one joint attention (Flux.2 double block)."""

    def __init__(self, cfg: MMDiTConfig):
        super().__init__()
        d, mlp = cfg.hidden_size, int(cfg.hidden_size * cfg.mlp_ratio)
        self.heads, self.eps = cfg.num_heads, cfg.layer_norm_eps
        for s in ("img", "txt"):
            setattr(self, f"{s}_qkv", nn.Linear(d, 3 * d, bias=False))
            setattr(self, f"{s}_qnorm", RMSNorm(cfg.head_dim))
            setattr(self, f"{s}_knorm", RMSNorm(cfg.head_dim))
            setattr(self, f"{s}_proj", nn.Linear(d, d, bias=False))
            setattr(
                self,
                f"{s}_mlp",
                nn.Sequential(nn.Linear(d, mlp_in_width(cfg), bias=False), mlp_activation(cfg),
                              nn.Linear(mlp, d, bias=False)),
            )

    def _qkv(self, stream: str, x: torch.Tensor, mod: torch.Tensor, angles: torch.Tensor):
        shift, scale = mod[0], mod[1]
        h = modulate(F.layer_norm(x, (x.shape[-1],), eps=self.eps), shift, scale)
        q, k, v = getattr(self, f"{stream}_qkv")(h).chunk(3, dim=-1)
        q = getattr(self, f"{stream}_qnorm")(split_heads(q, self.heads))
        k = getattr(self, f"{stream}_knorm")(split_heads(k, self.heads))
        v = split_heads(v, self.heads)
        return apply_rope(q, angles), apply_rope(k, angles), v

    def _post(self, stream: str, x, attn, mod):
        x = x + mod[2] * getattr(self, f"{stream}_proj")(attn)
        h = modulate(F.layer_norm(x, (x.shape[-1],), eps=self.eps), mod[3], mod[4])
        return x + mod[5] * getattr(self, f"{stream}_mlp")(h)

    def forward(self, seg: Segments, mods: dict, angles: dict, hook: AttentionHook,
                block: int, layout: Layout) -> Segments:
        parts = []
        for name, stream in (("txt", "txt"), ("img", "img"), ("ref", "img")):
            x = getattr(seg, name)
            parts.append(self._qkv(stream, x, mods[name], angles[name]))
        q, k, v = (torch.cat([p[i] for p in parts], dim=2) for i in range(3))
        out = merge_heads(hook.attend(block, q, k, v, layout))
        t, n = layout.txt, layout.img
        outs = {"txt": out[:, :t], "img": out[:, t : t + n], "ref": out[:, t + n :]}
        new = {}
        for name, stream in (("txt", "txt"), ("img", "img"), ("ref", "img")):
            new[name] = self._post(stream, getattr(seg, name), outs[name], mods[name])
        return Segments(new["txt"], new["img"], new["ref"], seg.vec_txt, seg.vec_img, seg.vec_ref)


class SingleStreamBlock(nn.Module):
    """One fused weight set over all tokens (Flux.2 single block: parallel attn + MLP)."""

    def __init__(self, cfg: MMDiTConfig):
        super().__init__()
        d, mlp = cfg.hidden_size, int(cfg.hidden_size * cfg.mlp_ratio)
        # mlp_hidden: the MLP part of linear1's output (2 * mlp for SwiGLU)
        self.heads, self.mlp_hidden = cfg.num_heads, mlp_in_width(cfg)
        self.eps = cfg.layer_norm_eps
        self.linear1 = nn.Linear(d, 3 * d + self.mlp_hidden, bias=False)
        self.linear2 = nn.Linear(d + mlp, d, bias=False)
        self.qnorm = RMSNorm(cfg.head_dim)
        self.knorm = RMSNorm(cfg.head_dim)
        self.act = mlp_activation(cfg)

    def forward(self, seg: Segments, mods: dict, angles: dict, hook: AttentionHook,
                block: int, layout: Layout) -> Segments:
        xs = [seg.txt, seg.img, seg.ref]
        names = ("txt", "img", "ref")
        hs = [modulate(F.layer_norm(x, (x.shape[-1],), eps=self.eps), mods[n][0], mods[n][1])
              for x, n in zip(xs, names)]
        h = torch.cat(hs, dim=1)
        qkv, mlp_in = self.linear1(h).split([3 * h.shape[-1], self.mlp_hidden], dim=-1)
        q, k, v = qkv.chunk(3, dim=-1)
        ang = torch.cat([angles[n] for n in names], dim=0)
        q = apply_rope(self.qnorm(split_heads(q, self.heads)), ang)
        k = apply_rope(self.knorm(split_heads(k, self.heads)), ang)
        v = split_heads(v, self.heads)
        attn = merge_heads(hook.attend(block, q, k, v, layout))
        out = self.linear2(torch.cat([attn, self.act(mlp_in)], dim=-1))
        sizes = [x.shape[1] for x in xs]
        new = [x + mods[n][2] * o for x, n, o in zip(xs, names, out.split(sizes, dim=1))]
        return Segments(new[0], new[1], new[2], seg.vec_txt, seg.vec_img, seg.vec_ref)


# ----------------------------------------------------------------------------- model


@dataclass
class TokenBatch:
    """Inputs of one forward call, already patchified.

    ``img`` ``[B, N, patch_dim]`` are the noisy image tokens that are computed (all of them,
    or only the masked ones); ``img_pos`` ``[N, 3]`` their positions. ``ref`` ``[B, R,
    patch_dim]`` clean reference tokens (may be empty) with ``ref_pos``. ``txt`` ``[B, T,
    text_dim]`` MiniLM token embeddings, ``t`` ``[B]`` timesteps in [0, 1].
    """

    img: torch.Tensor
    img_pos: torch.Tensor
    txt: torch.Tensor
    t: torch.Tensor
    ref: torch.Tensor | None = None
    ref_pos: torch.Tensor | None = None
    ref_sizes: tuple[int, ...] = ()
    # False: text tokens are not computed (their K/V come from a hook).
    text_tokens: bool = True


class MMDiT(nn.Module):
    """The SAKURA default diffusion transformer (velocity prediction, rectified flow)."""

    def __init__(self, cfg: MMDiTConfig | None = None):
        super().__init__()
        cfg = cfg or MMDiTConfig()
        cfg.validate()
        self.cfg = cfg
        d, bias = cfg.hidden_size, cfg.bias
        self.img_in = nn.Linear(cfg.patch_dim, d, bias=bias)
        self.txt_in = nn.Linear(cfg.text_dim, d, bias=bias)
        self.time_in = nn.Sequential(nn.Linear(256, d, bias=bias), nn.SiLU(),
                                     nn.Linear(d, d, bias=bias))
        # Shared modulation (Flux.2): one projection per stream kind, used by every block.
        self.double_mod_img = nn.Linear(d, 6 * d, bias=bias)
        self.double_mod_txt = nn.Linear(d, 6 * d, bias=bias)
        self.single_mod = nn.Linear(d, 3 * d, bias=bias)
        self.final_mod = nn.Linear(d, 2 * d, bias=bias)
        self.double_stream = nn.ModuleList(DoubleStreamBlock(cfg) for _ in range(cfg.double_blocks))
        self.single_stream = nn.ModuleList(SingleStreamBlock(cfg) for _ in range(cfg.single_blocks))
        self.final = nn.Linear(d, cfg.patch_dim, bias=bias)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for lin in (self.double_mod_img, self.double_mod_txt, self.single_mod, self.final_mod,
                    self.final):
            nn.init.zeros_(lin.weight)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    # -- conditioning -------------------------------------------------------------------

    def vec(self, t: torch.Tensor, txt: torch.Tensor | None = None) -> torch.Tensor:
        """Modulation vector ``[B, 1, D]`` from the timestep only.

        As in Flux.2 there is no pooled text vector: a token's K/V at a block then depend
        only on its hidden state and t, which is what makes "pinning" the unmasked tokens'
        hidden states equal to reusing their cached K/V.
        """
        return F.silu(self.time_in(timestep_embedding(t, 256)))[:, None]

    def _mods(self, kind: str, seg: Segments) -> dict:
        out = {}
        for name in ("txt", "img", "ref"):
            v = getattr(seg, f"vec_{name}")
            if kind == "double":
                lin = self.double_mod_txt if name == "txt" else self.double_mod_img
                out[name] = lin(v).chunk(6, dim=-1)
            else:
                out[name] = self.single_mod(v).chunk(3, dim=-1)
        return out

    def angles(self, pos: torch.Tensor) -> torch.Tensor:
        return rope_angles(pos, self.cfg.rope_axes, self.cfg.rope_theta)

    def text_positions(self, n: int) -> torch.Tensor:
        if self.cfg.positions == "flux_ids":  # (0, 0, 0, index)
            pos = torch.zeros(n, 4)
            pos[:, 3] = torch.arange(n, dtype=torch.float32)
            return pos
        return torch.zeros(n, 3)

    def image_positions(self, grid: int) -> torch.Tensor:
        """Positions ``[grid*grid, len(rope_axes)]`` of a square token grid (row-major)."""
        if self.cfg.positions == "flux_ids":  # (0, row, col, 0), integers at any resolution
            rows, cols = torch.meshgrid(torch.arange(grid, dtype=torch.float32),
                                        torch.arange(grid, dtype=torch.float32), indexing="ij")
            zero = torch.zeros_like(rows)
            return torch.stack([zero, rows, cols, zero], dim=-1).reshape(-1, 4)
        return grid_positions(grid, self.cfg.pos_span)

    # -- the forward pass ---------------------------------------------------------------

    def embed(self, batch: TokenBatch, vec_txt_t: torch.Tensor | None = None) -> Segments:
        b = batch.img.shape[0]
        d = self.cfg.hidden_size
        ref = batch.ref if batch.ref is not None else batch.img.new_zeros(b, 0, self.cfg.patch_dim)
        vec = self.vec(batch.t, batch.txt)
        vec_ref = self.vec(torch.zeros_like(batch.t), batch.txt)
        if vec_txt_t is None and self.cfg.attention_mode == "block_causal":
            vec_txt = vec_ref  # the prefix is step-independent in block-causal mode
        else:
            vec_txt = vec if vec_txt_t is None else self.vec(vec_txt_t, batch.txt)
        return Segments(
            txt=self.txt_in(batch.txt) if batch.text_tokens else batch.img.new_zeros(b, 0, d),
            img=self.img_in(batch.img),
            ref=self.img_in(ref),
            vec_txt=vec_txt, vec_img=vec, vec_ref=vec_ref,
        )

    def run_blocks(self, seg: Segments, angles: dict, hook: AttentionHook,
                   layout: Layout, blocks: range | None = None) -> Segments:
        """Run transformer blocks (all, or a contiguous range) on the given segments."""
        blocks = blocks if blocks is not None else range(self.cfg.num_blocks)
        dmods = smods = None
        for b in blocks:
            seg = hook.before_block(b, seg)
            if b < self.cfg.double_blocks:
                dmods = dmods or self._mods("double", seg)
                seg = self.double_stream[b](seg, dmods, angles, hook, b, layout)
            else:
                smods = smods or self._mods("single", seg)
                seg = self.single_stream[b - self.cfg.double_blocks](seg, smods, angles, hook, b, layout)
            seg = hook.after_block(b, seg)
        return seg

    def head(self, seg: Segments) -> torch.Tensor:
        shift, scale = self.final_mod(seg.vec_img).chunk(2, dim=-1)
        norm = F.layer_norm(seg.img, (seg.img.shape[-1],), eps=self.cfg.layer_norm_eps)
        return self.final(modulate(norm, shift, scale))

    def forward(self, batch: TokenBatch, hook: AttentionHook | None = None,
                text_t: torch.Tensor | None = None) -> torch.Tensor:
        """Velocity for the computed image tokens ``[B, N, patch_dim]``."""
        hook = hook or PlainAttention(self.cfg.attention_mode)
        seg = self.embed(batch, text_t)
        ref_pos = (batch.ref_pos if batch.ref_pos is not None
                   else torch.zeros(0, len(self.cfg.rope_axes)))
        angles = {
            "txt": self.angles(self.text_positions(seg.txt.shape[1])),
            "img": self.angles(batch.img_pos),
            "ref": self.angles(ref_pos),
        }
        layout = Layout(txt=seg.txt.shape[1], img=seg.img.shape[1], ref=seg.ref.shape[1],
                        ref_sizes=tuple(batch.ref_sizes))
        seg = self.run_blocks(seg, angles, hook, layout)
        return self.head(seg)


# ----------------------------------------------------------------------------- geometry


def grid_positions(grid: int, span: float, segment: float = 0.0) -> torch.Tensor:
    """Positions ``[grid*grid, 3]`` of a square token grid, row-major, normalized to span."""
    coords = (torch.arange(grid, dtype=torch.float32) + 0.5) * (span / grid)
    hh, ww = torch.meshgrid(coords, coords, indexing="ij")
    seg = torch.full_like(hh, segment)
    return torch.stack([seg, hh, ww], dim=-1).reshape(-1, 3)


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, (H/p)*(W/p), C*p*p]``."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // p) * (w // p), c * p * p)


def unpatchify(x: torch.Tensor, p: int, c: int, size: int) -> torch.Tensor:
    b = x.shape[0]
    g = size // p
    x = x.reshape(b, g, g, c, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, size, size)
