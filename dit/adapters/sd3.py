"""Stable Diffusion 3 / 3.5 (``SD3Transformer2DModel``) adapter.

Token order in the diffusers joint attention is ``[image, text]`` (SAKURA reorders to
``[text, image]`` for its hooks and back). SD3.5's *dual attention* layers run a second,
image-only self-attention (``attn2``) on the same layer input: each attention call is its
own cache block, so a dual layer ``i`` contributes ``layer.i.attn`` and ``layer.i.attn2``.
The last layer is ``context_pre_only`` (its text output is dropped; its text K/V still count).

Positions are absolute (patch embedding + cropped sin-cos table, no RoPE); the model's forward
takes the spatial latent, so a masked call scatters the computed tokens into a latent grid,
keeps only their rows after the patch embedding and scatters the output rows back before the
model's own unpatchify (forward hooks on ``pos_embed`` and ``proj_out``, during the call only).

SD3.5 modulates every token with the pooled text vector. Cached tokens were computed with the
*template's* pooled vector; the fresh (text, masked) tokens use the request's, as in the real
model. The slow reference does the same: the pinned tokens are re-modulated with the
template's pooled vector at every layer, so the two agree exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.attention_processor import JointAttnProcessor2_0
from sakura.dit.adapters.base import ModelAdapter
from sakura.dit.adapters.errors import InputError
from sakura.dit.adapters.processors import Branch, Pins, RunContext, hook_attend
from sakura.dit.attention import AttentionHook


class SD3Processor:
    """SAKURA processor for SD3 ``Attention`` (joint ``attn`` and image-only ``attn2``); call
    signature of ``JointAttnProcessor2_0``, to which it defers outside a SAKURA run."""

    def __init__(self, channel, block: int, layer: int, kind: str):
        self.channel, self.block, self.layer, self.kind = channel, block, layer, kind
        self.stock = JointAttnProcessor2_0()

    def __call__(self, attn, hidden_states: torch.FloatTensor,
                 encoder_hidden_states: torch.FloatTensor = None,
                 attention_mask: torch.FloatTensor | None = None, *args, **kwargs):
        ctx = self.channel.active
        if ctx is None:
            return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask,
                              *args, **kwargs)
        pinned = ctx.scratch.get((self.layer, self.kind))
        if pinned is not None:
            hidden_states = hidden_states.clone()
            hidden_states[:, ctx.pins.rows.to(hidden_states.device)] = pinned
        b, n = hidden_states.shape[:2]
        heads = attn.heads
        q, k, v = (f(hidden_states) for f in (attn.to_q, attn.to_k, attn.to_v))
        hd = k.shape[-1] // heads
        q, k, v = (t.view(b, -1, heads, hd) for t in (q, k, v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        txt = 0
        if encoder_hidden_states is not None:
            eq, ek, ev = (f(encoder_hidden_states).view(b, -1, heads, hd)
                          for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            txt = eq.shape[1]
            q, k, v = torch.cat([q, eq], 1), torch.cat([k, ek], 1), torch.cat([v, ev], 1)
        out = hook_attend(ctx.hook, self.block, q, k, v, txt, img_first=True)
        out = out.reshape(b, -1, heads * hd).to(q.dtype)
        img, enc = out[:, :n], out[:, n:]
        img = attn.to_out[1](attn.to_out[0](img))
        if encoder_hidden_states is None:
            return img
        if not attn.context_pre_only:
            enc = attn.to_add_out(enc)
        return img, enc


class SD3Adapter(ModelAdapter):
    """``SD3Transformer2DModel`` (SD3 medium, SD3.5 medium with dual attention, SD3.5 large)."""

    name = "sd3.5"

    def install(self) -> None:
        block = 0
        self._entries: list[tuple[int, str]] = []
        for i, layer in enumerate(self.model.transformer_blocks):
            for kind in ("attn", "attn2"):
                mod = getattr(layer, kind, None)
                if mod is None:
                    continue
                self._stock[f"transformer_blocks.{i}.{kind}"] = mod.processor
                mod.set_processor(SD3Processor(self._channel, block, i, kind))
                self._entries.append((i, kind))
                block += 1

    def layers(self):
        return list(self.model.transformer_blocks)

    @property
    def block_names(self) -> list[str]:
        return [f"layer.{i}.{kind}" for i, kind in self._entries]

    def _block_params(self) -> list[float]:
        out = []
        for i, kind in self._entries:
            layer = self.model.transformer_blocks[i]
            attn2 = sum(p.numel() for p in layer.attn2.parameters()) if layer.attn2 else 0
            total = sum(p.numel() for p in layer.parameters())
            out.append(float(attn2 if kind == "attn2" else total - attn2))
        return out

    @property
    def patch(self) -> int:
        return int(self.model.config.patch_size)

    @property
    def latent_channels(self) -> int:
        return int(self.model.config.in_channels) * self.patch ** 2

    def default_scheduler_config(self) -> dict[str, Any]:
        return {"num_train_timesteps": 1000, "shift": 3.0}

    def set_timesteps(self, scheduler, steps: int, tokens: int) -> None:
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
            calculate_shift,
        )

        cfg = scheduler.config
        kw = {}
        if cfg.get("use_dynamic_shifting", False):
            kw["mu"] = calculate_shift(tokens, cfg.get("base_image_seq_len", 256),
                                       cfg.get("max_image_seq_len", 4096),
                                       cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.16))
        scheduler.set_timesteps(steps, **kw)

    # -- latent packing: token (i, j) = the p x p patch of every channel, (c, pi, pj) order --

    def pack(self, latent: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W]`` -> ``[B, (H/p)(W/p), C p p]``."""
        b, c, h, w = latent.shape
        p = self.patch
        x = latent.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // p) * (w // p), c * p * p)

    def unpack(self, tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        b = tokens.shape[0]
        p, (gh, gw) = self.patch, grid
        c = tokens.shape[-1] // (p * p)
        x = tokens.reshape(b, gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c, gh * p, gw * p)

    def on_pinned(self, layer: int, module, hidden: torch.Tensor, off: int,
                  ctx: RunContext) -> None:
        temb = ctx.scratch.get("pin_temb")
        if temb is None:
            return
        rows = ctx.pins.rows.to(hidden.device)
        normed = module.norm1(hidden[:, off + rows], emb=temb)
        ctx.scratch[(layer, "attn")] = normed[0]
        if module.use_dual_attention:
            ctx.scratch[(layer, "attn2")] = normed[5]

    def _velocity(self, x, rows, grid, timestep, branch: Branch, hook: AttentionHook, *,
                  pins: Pins | None = None, keep=None) -> torch.Tensor:
        cond = branch.cond
        if cond.pooled is None:
            raise InputError("SD3.5 needs the pooled text embedding (Conditioning.pooled)")
        m, dev, dt = self.model, self.device, self.dtype
        n = grid[0] * grid[1]
        rows_d = rows.to(dev)
        full = torch.zeros(1, n, self.latent_channels, device=dev, dtype=dt)
        full[:, rows_d] = x.to(dev, dt)
        t = timestep.reshape(1).to(dev, dt)
        ctx = RunContext(hook, rows, txt=cond.embeds.shape[1], pins=pins, keep=keep)
        if pins is not None:
            ctx.scratch["pin_temb"] = m.time_text_embed(t, pins.cond.pooled.to(dev, dt))
        handles = []
        if len(rows) != n:
            def select(_mod, _inp, out):
                return out[:, rows_d]

            def scatter(_mod, _inp, out):
                z = out.new_zeros(out.shape[0], n, out.shape[-1])
                z[:, rows_d] = out
                return z

            handles = [m.pos_embed.register_forward_hook(select),
                       m.proj_out.register_forward_hook(scatter)]
        try:
            with self.running(ctx):
                out = m(hidden_states=self.unpack(full, grid), encoder_hidden_states=cond.embeds.to(dev, dt),
                        pooled_projections=cond.pooled.to(dev, dt), timestep=t,
                        return_dict=False)[0]
        finally:
            for h in handles:
                h.remove()
        return self.pack(out)[:, rows_d].float()
