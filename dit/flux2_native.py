"""The trained pixel FLUX.2 transformer in the MMDiT's form: one model, two runtimes.

``dit.flux2_pixel.PixelFlux2`` (diffusers' ``Flux2Transformer2DModel``) runs only on the
Python runtime, through ``dit.adapters``; the native runtime's graphs
(``edge.backends.shard`` / ``step``) are built from ``dit.model.MMDiT`` modules. The two
architectures are the same computation up to a handful of differences, each of which is
either a weight re-arrangement or one of ``MMDiTConfig``'s conversion options:

* **MLP**: FLUX.2's is SwiGLU, ``linear_out(silu(a) * b)`` with ``[a, b] = linear_in(x)``
  (``2 * 576`` wide), the MMDiT's ``Linear -> tanh-GELU -> Linear``: ``mlp_act="swiglu"``
  (``linear_in`` is the first linear as it is; in the single block the fused
  ``to_qkv_mlp_proj`` is ``linear1`` row for row, ``[q, k, v, a, b]``, and ``to_out`` is
  ``linear2``, ``[attention, mlp]`` columns, as the MMDiT's).
* **Biases**: FLUX.2's linears have none: ``bias=False`` (the blocks' linears have none
  in either model).
* **LayerNorm eps**: 1e-6 (``Flux2...Block.norm*``, ``norm_out``) against torch's 1e-5:
  ``layer_norm_eps``. The RMS QK-norms are 1e-6 in both (checked).
* **Positions**: FLUX's integer ids over 4 axes ``(t, h, w, l)``: image ``(0, row, col,
  0)`` at every resolution, text ``(0, 0, 0, index)`` (``dit.adapters.flux2.image_ids`` /
  ``text_ids``); the MMDiT's ``grid_positions`` are normalized to ``pos_span`` over 3 axes
  with text at 0: ``positions="flux_ids"``, ``rope_axes=(8, 8, 8, 8)``, theta 100, and
  callers take the image positions from ``MMDiT.image_positions(grid)``. Both RoPEs
  rotate interleaved channel pairs ``(2j, 2j + 1)`` by ``pos * theta ** (-2i / dim)``
  (diffusers' ``apply_rotary_emb`` with ``use_real_unbind_dim=-1`` is ``apply_rope``);
  FLUX.2 takes cos/sin of the float64 angle, the MMDiT of the angle rounded to float32
  (a difference of at most ~1e-6 at positions below 16, see the measurements below).
* **Time embedding**: ``Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)`` of
  ``1000 t`` is ``timestep_embedding`` (``[cos, sin]``, the same float ops), and
  ``TimestepEmbedding`` (linear, SiLU, linear, no biases) is ``time_in``. No guidance
  embedder (``guidance_embeds=False``; a guidance-distilled checkpoint is refused).
* **Modulation**: ``Flux2Modulation`` is ``linear(silu(temb))``, chunked
  ``(shift, scale, gate)`` per set: ``MMDiT.vec`` already returns ``silu(time_in(.))`` and
  the blocks read the same chunk order, so ``double_stream_modulation_img/_txt`` and
  ``single_stream_modulation`` are ``double_mod_img/_txt`` and ``single_mod`` as they are.
  The final ``AdaLayerNormContinuous`` chunks ``(scale, shift)``, ``MMDiT.head``
  ``(shift, scale)``: ``final_mod``'s two row blocks are swapped.
* **Embedders**: ``x_embedder`` -> ``img_in``, ``context_embedder`` -> ``txt_in``,
  ``proj_out`` -> ``final``; the double block's ``to_q/k/v`` and ``add_q/k/v_proj`` are
  stacked into ``img_qkv`` / ``txt_qkv``, ``to_out.0`` / ``to_add_out`` are the ``proj``.
* **Token order**: FLUX.2 attends over ``[text, image]`` (``[text, reference, image]``
  in its KV-extract mode), the MMDiT over ``[text, image, reference]``: the same set of
  keys for every query (references only see themselves in both, at t = 0).
* **Guidance**: neither model embeds it; classifier-free guidance is two batch rows
  outside the model in both (``dit.editing._guided`` / the adapter engine).

Measured (``tests/dit/test_flux2_native.py``, float32, x86 CPU, the committed weights at
train step 3500, 32 and 64 px, t in {0.05, 0.5, 0.95}, two batch rows of 16 text tokens):
the converted model's velocity is within 2.2e-6 of PixelFlux2's (velocities up to ~5), and
0.0 with the RoPE tables computed as FLUX.2 computes them (the only residual). References
(FLUX.2-klein's KV "extract" mode) and the template pass's captured K/V agree as closely.
"""

from __future__ import annotations

import torch
from sakura.dit.flux2_pixel import CHANNELS, PIXEL_PATCH, PixelFlux2
from sakura.dit.model import MMDiT, MMDiTConfig
from torch import nn

# The MMDiT's fixed parts a FLUX.2 config must match (the time-embedding width and the
# RMS QK-norm eps are constants of dit.model).
TIME_CHANNELS = 256
RMS_EPS = 1e-6


def mmdit_config(flux2: PixelFlux2) -> MMDiTConfig:
    """The :class:`MMDiTConfig` of ``flux2``'s transformer (ValueError where no MMDiT
    computes it: a guidance embedder, other patching, other norm eps)."""
    c = flux2.transformer.config
    patch_dim = CHANNELS * PIXEL_PATCH**2
    if c.guidance_embeds:
        raise ValueError("a guidance-embedding FLUX.2 has a second conditioning input the "
                         "MMDiT has no place for")
    if c.patch_size != 1 or c.in_channels != patch_dim or (c.out_channels or
                                                           c.in_channels) != patch_dim:
        raise ValueError(f"the MMDiT form needs {patch_dim}-channel pixel-patch tokens in "
                         f"and out (patch_size 1), got {c.in_channels} -> {c.out_channels}")
    if c.timestep_guidance_channels != TIME_CHANNELS:
        raise ValueError(f"the MMDiT's time embedding is {TIME_CHANNELS} wide, got "
                         f"{c.timestep_guidance_channels}")
    if c.eps != RMS_EPS:
        raise ValueError(f"the MMDiT's QK RMSNorm eps is {RMS_EPS}, got {c.eps}")
    if len(c.axes_dims_rope) != 4:
        raise ValueError(f"FLUX ids have 4 axes, got RoPE axes {c.axes_dims_rope}")
    return MMDiTConfig(
        in_channels=CHANNELS, patch_size=PIXEL_PATCH,
        hidden_size=c.num_attention_heads * c.attention_head_dim, num_heads=c.num_attention_heads,
        double_blocks=c.num_layers, single_blocks=c.num_single_layers, mlp_ratio=c.mlp_ratio,
        text_dim=c.joint_attention_dim, rope_theta=float(c.rope_theta),
        rope_axes=tuple(int(a) for a in c.axes_dims_rope), attention_mode="joint",
        mlp_act="swiglu", layer_norm_eps=float(c.eps), bias=False, positions="flux_ids")


def _copy(dst: nn.Linear, *srcs: nn.Linear) -> None:
    """``dst.weight`` := the row-wise stack of the ``srcs``' weights (no biases anywhere)."""
    for s in srcs:
        if s.bias is not None:
            raise ValueError("a FLUX.2 linear with a bias: the MMDiT form has none")
    w = torch.cat([s.weight for s in srcs], dim=0)
    if dst.weight.shape != w.shape:
        raise ValueError(f"weight shape {tuple(w.shape)} for {tuple(dst.weight.shape)}")
    dst.weight.copy_(w)


@torch.no_grad()
def mmdit_form(flux2: PixelFlux2) -> MMDiT:
    """``flux2`` as an :class:`~dit.model.MMDiT` computing the same velocity (module
    docstring): ``forward(TokenBatch)`` with ``img_pos = model.image_positions(grid)``.
    The result is in eval mode, on the CPU, float32, and shares no tensor with ``flux2``."""
    f = flux2.transformer
    model = MMDiT(mmdit_config(flux2)).eval()
    d = model.cfg.hidden_size
    _copy(model.img_in, f.x_embedder)
    _copy(model.txt_in, f.context_embedder)
    te = f.time_guidance_embed.timestep_embedder
    _copy(model.time_in[0], te.linear_1)
    _copy(model.time_in[2], te.linear_2)
    _copy(model.double_mod_img, f.double_stream_modulation_img.linear)
    _copy(model.double_mod_txt, f.double_stream_modulation_txt.linear)
    _copy(model.single_mod, f.single_stream_modulation.linear)
    # AdaLayerNormContinuous: (scale, shift) -> MMDiT.head: (shift, scale)
    w = f.norm_out.linear.weight
    if f.norm_out.linear.bias is not None:
        raise ValueError("a FLUX.2 norm_out with a bias: the MMDiT form has none")
    model.final_mod.weight.copy_(torch.cat([w[d:], w[:d]], dim=0))
    _copy(model.final, f.proj_out)
    for blk, src in zip(model.double_stream, f.transformer_blocks, strict=True):
        a = src.attn
        _copy(blk.img_qkv, a.to_q, a.to_k, a.to_v)
        _copy(blk.txt_qkv, a.add_q_proj, a.add_k_proj, a.add_v_proj)
        _copy(blk.img_proj, a.to_out[0])
        _copy(blk.txt_proj, a.to_add_out)
        for norm, ref in ((blk.img_qnorm, a.norm_q), (blk.img_knorm, a.norm_k),
                          (blk.txt_qnorm, a.norm_added_q), (blk.txt_knorm, a.norm_added_k)):
            norm.weight.copy_(ref.weight)
        for mlp, ff in ((blk.img_mlp, src.ff), (blk.txt_mlp, src.ff_context)):
            _copy(mlp[0], ff.linear_in)
            _copy(mlp[2], ff.linear_out)
    for blk, src in zip(model.single_stream, f.single_transformer_blocks, strict=True):
        a = src.attn
        _copy(blk.linear1, a.to_qkv_mlp_proj)
        _copy(blk.linear2, a.to_out)
        blk.qnorm.weight.copy_(a.norm_q.weight)
        blk.knorm.weight.copy_(a.norm_k.weight)
    model.weights_meta = dict(getattr(flux2, "weights_meta", {}) or {})
    return model


__all__ = ["mmdit_config", "mmdit_form"]
