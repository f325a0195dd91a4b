"""QwenImage 2.1 (``QwenImage21Transformer2DModel``) adapter: block-causal prefix caching.

One single-stream sequence ``[prefix..., target image]``: the prefix is the vision-language
prompt with condition-image latents substituted at its image slots (each slot = 2x2 latent
tokens). Attention is block-causal (causal over the sequence, each image block bidirectional
within itself), so the prefix never sees the target; with ``causal_condition`` the prefix is
modulated from t = 0, so its K/V are step-independent. :meth:`QwenImage21Adapter.extract_prefix_kv`
prefills them once with the model's own block-causal processor (the stock
``QwenImage21AttnProcessor`` segment path, as the pipeline's ``kv_cache_mode="extract"``
does); every denoising step then computes only target tokens (all, or the masked ones) against
``[prefix K/V, target, template cache]`` - the target sees everything, so this is plain joint
attention for SAKURA's hooks.

The model's forward always builds the whole joint sequence, so masked (subset) execution goes
through :meth:`QwenImage21Adapter.velocity`, which runs the model's own modules (``img_in``,
``pos_embed``, ``time_text_embed``, ``modulation``, the blocks, ``norm_out``, ``proj_out``)
in the forward's order; it equals ``model.forward`` (tested).

RoPE: the target image's frame coordinate is the position reached after the prefix, i.e. it
depends on the prompt length. Template-cache keys carry the template prompt's frame; an edit
prompt of another length rotates them into its own frame (an exact RoPE shift of the frame
channels, :func:`shift_frame`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21AttnProcessor,
    QwenImage21KVCache,
    _qwenimage21_prefix_segments,
    _qwenimage21_prepare_qkv,
)
from sakura.dit.adapters.base import ModelAdapter
from sakura.dit.adapters.errors import InputError, UnsupportedError
from sakura.dit.adapters.inputs import AdapterGeometry, Conditioning, LatentTemplate
from sakura.dit.adapters.processors import Branch, Pins, RunContext, hook_attend
from sakura.dit.adapters.qwenimage import centred
from sakura.dit.attention import TXT, AttentionHook, KVSegment
from sakura.dit.rope import rope_option

TOKENS_PER_SLOT = 4
ROPE_THETA = 10000.0


class QwenImage21Processor:
    """SAKURA processor for ``QwenImage21Attention``; call signature of
    ``QwenImage21AttnProcessor``, to which it defers outside a SAKURA run (the prefill)."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, channel, block: int):
        self.channel, self.block = channel, block
        self.stock = QwenImage21AttnProcessor()

    def __call__(self, attn, hidden_states: torch.Tensor, attention_mask: Any | None = None,
                 rotary_emb: torch.Tensor | None = None, layer_cache=None,
                 kv_cache_mode: str | None = None, cache_write_slice: slice | None = None,
                 segments: list[tuple[int, int, bool]] | None = None,
                 key_valid: torch.Tensor | None = None) -> torch.Tensor:
        ctx = self.channel.active
        if ctx is None:
            return self.stock(attn, hidden_states, attention_mask, rotary_emb, layer_cache,
                              kv_cache_mode, cache_write_slice, segments, key_valid)
        q, k, v, _ = _qwenimage21_prepare_qkv(attn, hidden_states, rotary_emb, None, None, None)
        out = hook_attend(ctx.hook, self.block, q, k, v, txt=0)
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def shift_frame(keys: torch.Tensor, shift: float, heads: int, frame_dim: int,
                theta: float = ROPE_THETA) -> torch.Tensor:
    """Rotate cached keys ``[N, C]`` by ``shift`` positions on the RoPE frame axis (the first
    ``frame_dim`` channels of every head, complex pairs ``(2j, 2j+1)``)."""
    if shift == 0:
        return keys
    n, c = keys.shape
    k = keys.float().reshape(n, heads, c // heads // 2, 2).clone()
    inv = theta ** (-torch.arange(0, frame_dim, 2, dtype=torch.float64) / frame_dim)
    ang = (shift * inv).float()
    cos, sin = ang.cos(), ang.sin()
    j = frame_dim // 2
    x1, x2 = k[:, :, :j, 0].clone(), k[:, :, :j, 1].clone()
    k[:, :, :j, 0] = x1 * cos - x2 * sin
    k[:, :, :j, 1] = x1 * sin + x2 * cos
    return k.reshape(n, c).to(keys.dtype)


@dataclass
class PrefixState:
    """A prompt's prefix: per-block K/V (role ``txt``), the target tokens' RoPE table
    ``[N, D/2]`` (complex) and the target's frame coordinate."""

    segments: dict[int, list[KVSegment]]
    target_rope: torch.Tensor
    frame: int


class QwenImage21Adapter(ModelAdapter):
    """``QwenImage21Transformer2DModel`` (Qwen-Image 2.1) with block-causal prefix caching."""

    name = "qwenimage-2.1"
    supports_references = True  # condition images are part of the prefix
    supports_prefix = True

    def install(self) -> None:
        if not self.model.config.causal_condition:
            raise UnsupportedError("QwenImage 2.1 needs causal_condition=True: only then is the "
                                   "prefix step-independent (cacheable)")
        for i, blk in enumerate(self.model.transformer_blocks):
            self._stock[f"transformer_blocks.{i}.attn"] = blk.attn.processor
            blk.attn.set_processor(QwenImage21Processor(self._channel, i))

    def layers(self):
        return list(self.model.transformer_blocks)

    @property
    def block_names(self) -> list[str]:
        return [f"layer.{i}" for i in range(len(self.model.transformer_blocks))]

    @property
    def latent_channels(self) -> int:
        cfg = self.model.config
        return int(cfg.in_channels) * int(cfg.patch_size) ** 2

    def default_scheduler_config(self) -> dict[str, Any]:
        import math

        return {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True,
                "base_shift": math.log(3), "max_shift": math.log(3), "base_image_seq_len": 256,
                "max_image_seq_len": 8192, "time_shift_type": "exponential"}

    def set_timesteps(self, scheduler, steps: int, tokens: int) -> None:
        import numpy as np
        from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

        cfg = scheduler.config
        mu = calculate_shift(tokens, cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                             cfg.get("max_shift", 1.15))
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)

    # -- the joint sequence -------------------------------------------------------------------

    def _layout(self, cond: Conditioning, grid: tuple[int, int]):
        """(image_pad_mask ``[L]``, img_shapes, repeats) of ``[prefix, target]``, as forward builds it."""
        n = grid[0] * grid[1]
        if n % TOKENS_PER_SLOT:
            raise InputError(f"QwenImage 2.1 needs a token count divisible by 4, got {n}")
        t = cond.embeds.shape[1]
        slots = (cond.image_slots if cond.image_slots is not None
                 else torch.zeros(t, dtype=torch.bool)).bool().cpu()
        if slots.shape != (t,):
            raise InputError(f"image_slots {tuple(slots.shape)} does not fit {t} prompt tokens")
        need = sum(im.grid[0] * im.grid[1] for im in cond.images)
        if int(slots.sum()) * TOKENS_PER_SLOT != need:
            raise InputError(f"{int(slots.sum())} image slots x 4 != {need} condition-image tokens")
        mask = torch.cat([slots, torch.ones(n // TOKENS_PER_SLOT, dtype=torch.bool)])
        repeats = torch.where(mask, TOKENS_PER_SLOT, 1)
        pad = torch.repeat_interleave(mask, repeats)
        shapes = [(1, im.grid[0], im.grid[1]) for im in cond.images] + [(1, grid[0], grid[1])]
        return pad, shapes, repeats

    @staticmethod
    def frame_of(cond: Conditioning) -> int:
        """The target's RoPE frame coordinate: text tokens + max(h, w) of every condition image."""
        slots = cond.image_slots
        text = cond.embeds.shape[1] - (int(slots.sum()) if slots is not None else 0)
        return text + sum(max(im.grid) for im in cond.images)

    @torch.inference_mode()
    def extract_prefix_kv(self, cond: Conditioning, grid: tuple[int, int]) -> PrefixState:
        """Prefill the prompt prefix (text + condition images) once, block-causally, with the
        model's own processor; returns its per-block K/V and the target's RoPE."""
        m, dev, dt = self.model, self.device, self.dtype
        pad, shapes, repeats = self._layout(cond, grid)
        n = grid[0] * grid[1]
        rope = m.pos_embed(shapes, pad.to(dev), device=dev)
        prefix_len = pad.shape[0] - n
        segments: dict[int, list[KVSegment]] = {}
        if prefix_len:
            enc = m.txt_in(cond.embeds.to(dev, dt))
            joint = torch.cat([enc, enc.new_zeros(1, n // TOKENS_PER_SLOT, enc.shape[2])], dim=1)
            joint = joint.repeat_interleave(repeats.to(dev), dim=1)
            imgs = [im.tokens.to(dev, dt) for im in cond.images]
            target = torch.zeros(n, self.latent_channels, device=dev, dtype=dt)
            joint[:, pad.to(dev)] = m.img_in(torch.cat(imgs + [target])[None])
            image_ids, target_mask = m.build_token_metadata(pad.to(dev), shapes)
            h = joint[:, :prefix_len]
            temb = m.time_text_embed(torch.zeros(2, device=dev, dtype=dt), h)
            modulation = m.modulation(temb)
            cache = QwenImage21KVCache(len(m.transformer_blocks))
            segs = _qwenimage21_prefix_segments(image_ids, prefix_len)
            for i, block in enumerate(m.transformer_blocks):
                h = block(hidden_states=h, modulation=modulation, rotary_emb=rope[:prefix_len],
                          attention_mask=None, target_token_mask=target_mask[:prefix_len],
                          layer_cache=cache.get_layer(i), kv_cache_mode="extract",
                          cache_write_slice=slice(0, prefix_len), segments=segs, key_valid=None)
                k, v = cache.get_layer(i).get()
                segments[i] = [KVSegment(TXT, k.transpose(1, 2), v.transpose(1, 2))]
        return PrefixState(segments, rope[prefix_len:], self.frame_of(cond))

    def prepare_branch(self, cond: Conditioning, refs=None, cache_refs: bool = True,
                       embedded_guidance: float | None = None,
                       template: LatentTemplate | None = None) -> Branch:
        if refs:
            raise UnsupportedError("QwenImage 2.1 takes condition images in the prompt prefix "
                                   "(Conditioning.images), not as references")
        if template is None:
            raise InputError("QwenImage 2.1 branches need the template (grid, RoPE frame)")
        state = self.extract_prefix_kv(cond, template.grid)
        shift = state.frame - self.frame_of(template.cond)
        frame_dim = int(self.model.config.axes_dims_rope[0])
        key_shift = None
        if shift:
            def key_shift(k: torch.Tensor, s=shift) -> torch.Tensor:
                return shift_frame(k, s, self.heads, frame_dim)
        return Branch(cond=cond, extra=state.segments, key_shift=key_shift,
                      info={"rope": state.target_rope, "frame": state.frame})

    def rope_option(self, geo: AdapterGeometry, frame: int = 0) -> dict[str, Any]:
        """RoPE of the cached keys; ``frame`` = the template prompt's :meth:`frame_of`."""
        h, w = geo.grid
        hh, ww = torch.meshgrid(centred(h), centred(w), indexing="ij")
        pos = torch.stack([torch.full_like(hh, float(frame)), hh, ww], -1).reshape(-1, 3)
        return rope_option(pos[geo.unmasked], list(self.model.config.axes_dims_rope),
                           ROPE_THETA, self.heads)

    def _velocity(self, x, rows, grid, timestep, branch: Branch, hook: AttentionHook, *,
                  pins: Pins | None = None, keep=None) -> torch.Tensor:
        m, dev, dt = self.model, self.device, self.dtype
        rope = branch.info.get("rope")
        if rope is None:
            raise InputError("branch has no prefix state: use prepare_branch")
        h = m.img_in(x.to(dev, dt))
        t = (timestep / 1000).reshape(1).to(dev, dt)
        temb = m.time_text_embed(torch.cat([t, t.new_zeros(1)]), h)
        modulation = m.modulation(temb)
        target = torch.ones(h.shape[1], dtype=torch.bool, device=dev)
        rot = rope[rows.to(rope.device)]
        with self.running(RunContext(hook, rows, pins=pins, keep=keep)):
            for block in m.transformer_blocks:
                h = block(hidden_states=h, modulation=modulation, rotary_emb=rot,
                          attention_mask=None, target_token_mask=target, layer_cache=None,
                          kv_cache_mode=None, cache_write_slice=None, segments=None,
                          key_valid=None)
            out = m.proj_out(m.norm_out(h, temb, target))
        return out.float()


@torch.inference_mode()
def native_velocity(adapter: QwenImage21Adapter, x: torch.Tensor, grid: tuple[int, int],
                    timestep: torch.Tensor, cond: Conditioning) -> torch.Tensor:
    """The stock diffusers forward over the whole ``[prefix, target]`` sequence (block-causal
    prefill, no cache): the uncached reference of prefix caching. For tests and the bench."""
    m, dev, dt = adapter.model, adapter.device, adapter.dtype
    pad, shapes, _ = adapter._layout(cond, grid)
    n = grid[0] * grid[1]
    t = cond.embeds.shape[1]
    slots = (cond.image_slots if cond.image_slots is not None
             else torch.zeros(t, dtype=torch.bool)).bool()
    img_mask = torch.cat([slots, torch.ones(n // TOKENS_PER_SLOT, dtype=torch.bool)])[None]
    hidden = torch.cat([im.tokens.float() for im in cond.images] + [x[0].float()])[None]
    out = m(hidden_states=hidden.to(dev, dt), encoder_hidden_states=cond.embeds.to(dev, dt),
            timestep=(timestep / 1000).reshape(1).to(dev, dt), img_shapes=[shapes],
            img_mask=img_mask.to(dev), return_dict=False)[0]
    return out[:, -n:].float()
