"""QwenImage (``QwenImageTransformer2DModel``, the dual-stream MMDiT of Qwen-Image and
Qwen-Image-Edit) adapter: template capture, masked cached execution, importance.

Joint attention over ``[text, image]``; 3-axis complex RoPE with centred image positions and
text positions starting after the image extent, so image positions do not depend on the
prompt. The model's forward builds the RoPE table of the whole image grid; SAKURA's processor
picks the rows of the tokens it computes. Prompts must be passed unpadded (embeddings trimmed
to the valid tokens: right padding is never attended, so trimming is exact).

No exact reference or prefix caching exists for this model: text tokens attend to the noisy
image in every layer and Edit-style condition images attend bidirectionally with the target,
so neither is step-independent (the block-causal prefix is QwenImage 2.1:
``dit.adapters.qwenimage21``).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    apply_rotary_emb_qwen,
)
from sakura.dit.adapters.base import ModelAdapter
from sakura.dit.adapters.errors import InputError
from sakura.dit.adapters.inputs import AdapterGeometry
from sakura.dit.adapters.processors import Branch, Pins, RunContext, hook_attend
from sakura.dit.attention import AttentionHook
from sakura.dit.rope import rope_option


class QwenImageProcessor:
    """SAKURA processor for QwenImage joint attention; call signature of
    ``QwenDoubleStreamAttnProcessor2_0``, to which it defers outside a SAKURA run."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, channel, block: int):
        self.channel, self.block = channel, block
        self.stock = QwenDoubleStreamAttnProcessor2_0()

    def __call__(self, attn, hidden_states: torch.FloatTensor,
                 encoder_hidden_states: torch.FloatTensor = None,
                 encoder_hidden_states_mask: torch.FloatTensor = None,
                 attention_mask: torch.FloatTensor | None = None,
                 image_rotary_emb: torch.Tensor | None = None) -> torch.FloatTensor:
        ctx = self.channel.active
        if ctx is None:
            return self.stock(attn, hidden_states, encoder_hidden_states,
                              encoder_hidden_states_mask, attention_mask, image_rotary_emb)
        if encoder_hidden_states_mask is not None and not bool(encoder_hidden_states_mask.all()):
            raise InputError("QwenImage under SAKURA takes unpadded prompts: trim the padding")
        hd = attn.inner_dim // attn.heads
        q, k, v = (f(hidden_states).unflatten(-1, (-1, hd)) for f in (attn.to_q, attn.to_k, attn.to_v))
        eq, ek, ev = (f(encoder_hidden_states).unflatten(-1, (-1, hd))
                      for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if attn.norm_added_q is not None:
            eq = attn.norm_added_q(eq)
        if attn.norm_added_k is not None:
            ek = attn.norm_added_k(ek)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_freqs = img_freqs[ctx.rows.to(img_freqs.device)]
            q = apply_rotary_emb_qwen(q, img_freqs, use_real=False)
            k = apply_rotary_emb_qwen(k, img_freqs, use_real=False)
            eq = apply_rotary_emb_qwen(eq, txt_freqs, use_real=False)
            ek = apply_rotary_emb_qwen(ek, txt_freqs, use_real=False)
        txt = eq.shape[1]
        out = hook_attend(ctx.hook, self.block, torch.cat([eq, q], 1), torch.cat([ek, k], 1),
                          torch.cat([ev, v], 1), txt)
        out = out.flatten(2, 3).to(q.dtype)
        img = attn.to_out[0](out[:, txt:].contiguous())
        if len(attn.to_out) > 1:
            img = attn.to_out[1](img)
        return img, attn.to_add_out(out[:, :txt].contiguous())


def centred(n: int) -> torch.Tensor:
    """QwenImage's ``scale_rope`` positions of one image axis: ``-(n - n//2) .. n//2 - 1``."""
    return torch.arange(-(n - n // 2), n // 2, dtype=torch.float32)


class QwenImageAdapter(ModelAdapter):
    """``QwenImageTransformer2DModel`` (Qwen-Image, Qwen-Image-Edit[-2509/-2511])."""

    name = "qwenimage"

    def install(self) -> None:
        for i, blk in enumerate(self.model.transformer_blocks):
            self._stock[f"transformer_blocks.{i}.attn"] = blk.attn.processor
            blk.attn.set_processor(QwenImageProcessor(self._channel, i))

    def layers(self):
        return list(self.model.transformer_blocks)

    @property
    def block_names(self) -> list[str]:
        return [f"layer.{i}" for i in range(len(self.model.transformer_blocks))]

    def default_scheduler_config(self) -> dict[str, Any]:
        import math

        return {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True,
                "base_shift": math.log(3), "max_shift": math.log(3), "base_image_seq_len": 256,
                "max_image_seq_len": 8192, "shift_terminal": 0.02,
                "time_shift_type": "exponential"}

    def set_timesteps(self, scheduler, steps: int, tokens: int) -> None:
        import numpy as np
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        cfg = scheduler.config
        mu = calculate_shift(tokens, cfg.get("base_image_seq_len", 256),
                             cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                             cfg.get("max_shift", 1.15))
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)

    def combine_guidance(self, v_cond, v_uncond, scale: float) -> torch.Tensor:
        comb = v_uncond + scale * (v_cond - v_uncond)
        return comb * (v_cond.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))

    def rope_option(self, geo: AdapterGeometry) -> dict[str, Any]:
        h, w = geo.grid
        hh, ww = torch.meshgrid(centred(h), centred(w), indexing="ij")
        pos = torch.stack([torch.zeros_like(hh), hh, ww], -1).reshape(-1, 3)[geo.unmasked]
        return rope_option(pos, list(self.model.config.axes_dims_rope), 10000.0, self.heads)

    def _velocity(self, x, rows, grid, timestep, branch: Branch, hook: AttentionHook, *,
                  pins: Pins | None = None, keep=None) -> torch.Tensor:
        m, dev, dt = self.model, self.device, self.dtype
        txt = branch.cond.embeds.to(dev, dt)
        n = grid[0] * grid[1]
        handles = []
        if m.config.zero_cond_t and len(rows) != n:
            rows_d = rows.to(dev)

            def subset(_mod, args, kwargs):
                if kwargs.get("modulate_index") is not None:
                    kwargs["modulate_index"] = kwargs["modulate_index"][:, rows_d]
                return args, kwargs

            handles = [b.register_forward_pre_hook(subset, with_kwargs=True)
                       for b in m.transformer_blocks]
        ctx = RunContext(hook, rows, txt=txt.shape[1], pins=pins, keep=keep)
        try:
            with self.running(ctx):
                out = m(hidden_states=x.to(dev, dt), encoder_hidden_states=txt,
                        encoder_hidden_states_mask=None,
                        timestep=(timestep / 1000).reshape(1).to(dev, dt),
                        img_shapes=[[(1, grid[0], grid[1])]], return_dict=False)[0]
        finally:
            for h in handles:
                h.remove()
        return out.float()
