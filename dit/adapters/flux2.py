"""FLUX.2 and FLUX.2-klein (``Flux2Transformer2DModel``) adapter, with Klein-KV references.

Token layout of the diffusers model: joint attention over ``[text, image]`` in the double-
stream blocks; the single-stream blocks run on the concatenation ``[text, image]``. With
reference images (Flux2KleinKVPipeline semantics, ``kv_cache_mode="extract"``) the image
stream is ``[reference, image]``: reference tokens are modulated with a fixed timestep (0),
attend only to the reference tokens (all references form one self-attending group) and
are seen by the text and image tokens. Their K/V therefore do not depend on the step or the
prompt: :meth:`Flux2Adapter.extract_reference_kv` computes them once (reference tokens only,
no text), and every step appends them, exactly as the pipeline's ``"cached"`` mode does.

Positions (``img_ids``/``txt_ids``, 4 axes ``(t, h, w, l)``): image ``(0, h, w, 0)``, text
``(0, 0, 0, l)``, reference ``i`` ``(10 + 10 i, h, w, 0)`` as in the pipeline. Cache blocks:
``double.i`` then ``single.j``.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_flux2 import (
    Flux2KVAttnProcessor,
    Flux2KVParallelSelfAttnProcessor,
    _get_qkv_projections,
)
from sakura.dit.adapters.base import ModelAdapter
from sakura.dit.adapters.errors import InputError
from sakura.dit.adapters.hook import AdapterHook
from sakura.dit.adapters.inputs import AdapterGeometry, Conditioning, LatentImage, LatentTemplate
from sakura.dit.adapters.processors import Branch, Pins, RunContext, hook_attend
from sakura.dit.attention import AttentionHook, KVSegment
from sakura.dit.rope import rope_option

REF_ROLE = "ref:0"  # all reference tokens form one self-attending segment (Klein KV)


def _rope(query, key, image_rotary_emb):
    from diffusers.models.embeddings import apply_rotary_emb

    if image_rotary_emb is None:
        return query, key
    return (apply_rotary_emb(query, image_rotary_emb, sequence_dim=1),
            apply_rotary_emb(key, image_rotary_emb, sequence_dim=1))


class Flux2JointProcessor:
    """SAKURA processor for ``Flux2Attention`` (double-stream blocks); call signature of
    ``Flux2KVAttnProcessor``, to which it defers outside a SAKURA run."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, channel, block: int):
        self.channel, self.block = channel, block
        self.stock = Flux2KVAttnProcessor()

    def __call__(self, attn, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: torch.Tensor | None = None,
                 kv_cache=None, kv_cache_mode: str | None = None,
                 num_ref_tokens: int = 0) -> torch.Tensor:
        ctx = self.channel.active
        if ctx is None:
            return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask,
                              image_rotary_emb, kv_cache=kv_cache, kv_cache_mode=kv_cache_mode,
                              num_ref_tokens=num_ref_tokens)
        q, k, v, eq, ek, ev = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in (q, k, v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        eq, ek, ev = (t.unflatten(-1, (-1, attn.head_dim)) for t in (eq, ek, ev))
        eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
        q, k, v = torch.cat([eq, q], 1), torch.cat([ek, k], 1), torch.cat([ev, v], 1)
        q, k = _rope(q, k, image_rotary_emb)
        txt = encoder_hidden_states.shape[1]
        out = hook_attend(ctx.hook, self.block, q, k, v, txt, ctx.ref)
        out = out.flatten(2, 3).to(q.dtype)
        enc, img = out.split_with_sizes([txt, out.shape[1] - txt], dim=1)
        return attn.to_out[1](attn.to_out[0](img)), attn.to_add_out(enc)


class Flux2SingleProcessor:
    """SAKURA processor for ``Flux2ParallelSelfAttention`` (single-stream blocks); call
    signature of ``Flux2KVParallelSelfAttnProcessor``."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, channel, block: int):
        self.channel, self.block = channel, block
        self.stock = Flux2KVParallelSelfAttnProcessor()

    def __call__(self, attn, hidden_states: torch.Tensor,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: torch.Tensor | None = None,
                 kv_cache=None, kv_cache_mode: str | None = None,
                 num_txt_tokens: int = 0, num_ref_tokens: int = 0) -> torch.Tensor:
        ctx = self.channel.active
        if ctx is None:
            return self.stock(attn, hidden_states, attention_mask, image_rotary_emb,
                              kv_cache=kv_cache, kv_cache_mode=kv_cache_mode,
                              num_txt_tokens=num_txt_tokens, num_ref_tokens=num_ref_tokens)
        proj = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = proj.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp = torch.split(proj, [local_qkv, proj.shape[-1] - local_qkv], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k = _rope(q, k, image_rotary_emb)
        out = hook_attend(ctx.hook, self.block, q, k, v, ctx.txt, ctx.ref)
        out = out.flatten(2, 3).to(q.dtype)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


def image_ids(grid: tuple[int, int], t: float = 0.0) -> torch.Tensor:
    """Position ids ``[h*w, 4]`` of a token grid (row-major), time coordinate ``t``."""
    h, w = grid
    return torch.cartesian_prod(torch.tensor([t]), torch.arange(h, dtype=torch.float32),
                                torch.arange(w, dtype=torch.float32), torch.zeros(1))


def text_ids(n: int) -> torch.Tensor:
    return torch.cartesian_prod(torch.zeros(1), torch.zeros(1), torch.zeros(1),
                                torch.arange(n, dtype=torch.float32)).reshape(n, 4)


def reference_inputs(refs: list[LatentImage]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference tokens ``[1, R, C]`` and their ids ``[R, 4]`` (t = 10 + 10 i, as the pipeline)."""
    toks = torch.cat([r.tokens.float() for r in refs])[None]
    ids = torch.cat([image_ids(r.grid, 10.0 + 10.0 * i) for i, r in enumerate(refs)])
    return toks, ids


class Flux2Adapter(ModelAdapter):
    """``Flux2Transformer2DModel`` (FLUX.2 dev, FLUX.2-klein 4B/9B and their KV variants)."""

    name = "flux2"
    supports_references = True

    def install(self) -> None:
        m = self.model
        for i, blk in enumerate(m.transformer_blocks):
            self._stock[f"transformer_blocks.{i}.attn"] = blk.attn.processor
            blk.attn.set_processor(Flux2JointProcessor(self._channel, i))
        d = len(m.transformer_blocks)
        for j, blk in enumerate(m.single_transformer_blocks):
            self._stock[f"single_transformer_blocks.{j}.attn"] = blk.attn.processor
            blk.attn.set_processor(Flux2SingleProcessor(self._channel, d + j))

    def layers(self):
        return list(self.model.transformer_blocks) + list(self.model.single_transformer_blocks)

    @property
    def block_names(self) -> list[str]:
        m = self.model
        return ([f"double.{i}" for i in range(len(m.transformer_blocks))]
                + [f"single.{j}" for j in range(len(m.single_transformer_blocks))])

    def default_scheduler_config(self) -> dict[str, Any]:
        return {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
                "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
                "max_image_seq_len": 4096, "time_shift_type": "exponential"}

    def set_timesteps(self, scheduler, steps: int, tokens: int) -> None:
        import numpy as np
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        sigmas = np.linspace(1.0, 1 / steps, steps)
        if getattr(scheduler.config, "use_flow_sigmas", False):
            scheduler.set_timesteps(steps, mu=compute_empirical_mu(tokens, steps))
            return
        scheduler.set_timesteps(sigmas=sigmas, mu=compute_empirical_mu(tokens, steps))

    def image_offset(self, layer: int, ctx: RunContext) -> int:
        double = len(self.model.transformer_blocks)
        return ctx.ref + (ctx.txt if layer >= double else 0)

    def rope_option(self, geo: AdapterGeometry) -> dict[str, Any]:
        cfg = self.model.config
        pos = image_ids(geo.grid)[geo.unmasked]
        return rope_option(pos, list(cfg.axes_dims_rope), float(cfg.rope_theta), self.heads)

    def _guidance(self, branch: Branch) -> torch.Tensor | None:
        if not self.model.config.guidance_embeds:
            return None
        g = 4.0 if branch.embedded_guidance is None else branch.embedded_guidance
        return torch.full([1], float(g), device=self.device)

    def _velocity(self, x, rows, grid, timestep, branch: Branch, hook: AttentionHook, *,
                  pins: Pins | None = None, keep=None) -> torch.Tensor:
        dev, dt = self.device, self.dtype
        txt = branch.cond.embeds.to(dev, dt)
        ids = image_ids(grid)[rows]
        hidden = x.to(dev, dt)
        kw: dict[str, Any] = {}
        ref = 0
        if branch.refs:  # recomputed every step, in the pipeline's own "extract" mode
            toks, ref_ids = reference_inputs(branch.refs)
            ref = toks.shape[1]
            hidden = torch.cat([toks.to(dev, dt), hidden], dim=1)
            ids = torch.cat([ref_ids, ids])
            kw = {"kv_cache_mode": "extract", "num_ref_tokens": ref}
        ctx = RunContext(hook, rows, txt=txt.shape[1], ref=ref, pins=pins, keep=keep)
        with self.running(ctx):
            out = self.model(hidden_states=hidden, encoder_hidden_states=txt,
                             timestep=(timestep / 1000).reshape(1).to(dev, dt),
                             img_ids=ids.to(dev), txt_ids=text_ids(txt.shape[1]).to(dev),
                             guidance=self._guidance(branch), return_dict=False, **kw)[0]
        return out.float()

    @torch.inference_mode()
    def extract_reference_kv(self, refs: list[LatentImage],
                             embedded_guidance: float | None = None) -> dict[int, list[KVSegment]]:
        """One pass over the reference tokens alone at t = 0 (the "extract" step): per-block
        K/V ``[1, H, R, D]`` of all references, as one self-attending segment."""
        if not refs:
            raise InputError("no reference images to extract")
        toks, ids = reference_inputs(refs)
        dev, dt = self.device, self.dtype
        empty = torch.zeros(1, 0, self.model.config.joint_attention_dim, device=dev, dtype=dt)
        hook = AdapterHook(heads=self.heads, record=True)
        rows = torch.arange(toks.shape[1])
        branch = Branch(Conditioning(empty), embedded_guidance=embedded_guidance)
        with self.running(RunContext(hook, rows)):
            self.model(hidden_states=toks.to(dev, dt), encoder_hidden_states=empty,
                       timestep=torch.zeros(1, device=dev, dtype=dt), img_ids=ids.to(dev),
                       txt_ids=text_ids(0).to(dev), guidance=self._guidance(branch),
                       return_dict=False)
        return {b: [KVSegment(REF_ROLE, hook.keys[b], hook.values[b])] for b in hook.keys}

    def prepare_branch(self, cond: Conditioning, refs=None, cache_refs: bool = True,
                       embedded_guidance: float | None = None,
                       template: LatentTemplate | None = None) -> Branch:
        br = Branch(cond=cond, embedded_guidance=embedded_guidance)
        if refs:
            if cache_refs:
                br.extra = self.extract_reference_kv(refs, embedded_guidance)
            else:
                br.refs = list(refs)
        return br


@torch.inference_mode()
def native_velocity(adapter: Flux2Adapter, x: torch.Tensor, grid: tuple[int, int],
                    timestep: torch.Tensor, cond: Conditioning,
                    refs: list[LatentImage] | None = None, kv_cache=None):
    """The stock diffusers path (no SAKURA run): with ``refs`` the pipeline's step-0
    ``"extract"`` call (returns ``(velocity, Flux2KVCache)``); with ``kv_cache`` its
    ``"cached"`` call; else the plain forward. For tests and the bench."""
    m, dev, dt = adapter.model, adapter.device, adapter.dtype
    txt = cond.embeds.to(dev, dt)
    hidden, ids, kw = x.to(dev, dt), image_ids(grid), {}
    if refs:
        toks, ref_ids = reference_inputs(refs)
        hidden = torch.cat([toks.to(dev, dt), hidden], dim=1)
        ids = torch.cat([ref_ids, ids])
        kw = {"kv_cache_mode": "extract", "num_ref_tokens": toks.shape[1]}
    elif kv_cache is not None:
        kw = {"kv_cache_mode": "cached", "kv_cache": kv_cache}
    out = m(hidden_states=hidden, encoder_hidden_states=txt,
            timestep=(timestep / 1000).reshape(1).to(dev, dt), img_ids=ids.to(dev),
            txt_ids=text_ids(txt.shape[1]).to(dev), guidance=None, return_dict=False, **kw)
    return (out[0].float(), out[1]) if refs else out[0].float()
