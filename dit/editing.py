"""Masked editing with template-KV reuse: template run + capture, cached execution,
the slow pinned reference, and token-importance profiling.

The compute contract (``DESIGN.md``): outside the editable mask, tokens follow the
template's forward-noised trajectory ``x_t = (1 - t) x_0 + t e`` (template noise ``e``), so
their per-(step, block) K/V are computed once in the cloud (the *template run*). On the
device, every step computes only the text tokens and the masked image tokens; at block b of
step s their attention runs over ``[fresh tokens] + [cache(s, b)]``. The output is the
template outside the mask and the edited content inside.

Every run here is ``dit.sampler.denoise`` (the one denoising loop) with Euler steps over
``edit_schedule``; the per-step model step builds the attention hook below that the run
needs (capture, cached K/V, pins, importance).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from sakura.dit.attention import CACHE, AttentionHook, KVSegment, Layout, cache_mass
from sakura.dit.cache import KVProvider, StepLate, TemplateCache
from sakura.dit.model import MMDiT, TokenBatch, patchify, unpatchify
from sakura.dit.refcache import ReferenceKV, reference_tokens, text_kv_segments
from sakura.dit.sampler import EulerSteps, Trajectory, denoise, noise_like, renoise, schedule
from sakura.dit.stale import STALE_MAX_AGE, StaleReuse


@dataclass
class Template:
    """An edit template: image ``[3, H, W]`` in [-1, 1], pixel mask ``[H, W]`` (True =
    editable), the template prompt's embeddings ``[1, T, 384]``, seed and steps."""

    image: torch.Tensor
    mask: torch.Tensor
    txt: torch.Tensor
    seed: int
    steps: int = 20
    guidance: float = 3.0
    # the template prompt's text: public provider data, needed on the device only by
    # models whose cached edit depends on it (QwenImage 2.1's RoPE frame)
    prompt: str = ""
    # Edit strength in (0, 1]: the edit's ``steps`` run from t = strength to 0 and the
    # masked tokens start from the template forward-noised to that t with the edit's noise
    # (SDEdit; diffusers' inpainting ``strength``). 1 starts from pure noise. Below 1 the
    # edit keeps the region's layout (a roof stays a roof), which a small model cannot
    # invent from the surrounding context alone.
    strength: float = 1.0

    def __post_init__(self) -> None:
        check_strength(self.strength)

    @property
    def size(self) -> int:
        return int(self.image.shape[-1])


@dataclass
class EditRequest:
    """A private edit: prompt embeddings (and the empty prompt's for guidance), a seed,
    optionally reference images ``[K, 3, h, w]``. None of this ever leaves the device."""

    txt: torch.Tensor
    txt_uncond: torch.Tensor | None
    seed: int
    ref_images: torch.Tensor | None = None


def check_strength(strength: float) -> float:
    """``strength`` if it is in (0, 1], else ValueError (the catalog and the device's
    published entry go through here too)."""
    if not 0.0 < strength <= 1.0:
        raise ValueError(f"template strength must be in (0, 1], got {strength}")
    return strength


def token_mask(mask: torch.Tensor, patch: int) -> torch.Tensor:
    """Pixel mask ``[H, W]`` -> token mask ``[N]``: a token is editable if any pixel is."""
    m = F.max_pool2d(mask.float()[None, None], patch)[0, 0] > 0
    return m.flatten()


@dataclass
class Geometry:
    """Token geometry of a template at its resolution."""

    grid: int
    pos: torch.Tensor          # [N, 3]
    masked: torch.Tensor       # [M] indices of editable tokens
    unmasked: torch.Tensor     # [U] indices of cached tokens

    @classmethod
    def of(cls, model: MMDiT, template: Template) -> Geometry:
        p = model.cfg.patch_size
        grid = template.size // p
        tm = token_mask(template.mask, p)
        return cls(grid, model.image_positions(grid),
                   tm.nonzero().flatten(), (~tm).nonzero().flatten())


def template_noise(model: MMDiT, template: Template) -> torch.Tensor:
    g = template.size // model.cfg.patch_size
    return noise_like((1, g * g, model.cfg.patch_dim), template.seed)


def edit_noise(model: MMDiT, template: Template, seed: int) -> torch.Tensor:
    """Initial noise of an edit over the full grid (masked tokens are selected from it)."""
    g = template.size // model.cfg.patch_size
    return noise_like((1, g * g, model.cfg.patch_dim), seed + 1_000_003)


def edit_schedule(template: Template) -> torch.Tensor:
    """The edit's ``steps + 1`` timesteps, from ``template.strength`` to 0."""
    ts = schedule(template.steps)
    return ts if template.strength == 1.0 else ts * template.strength


def edit_start(model: MMDiT, template: Template, seed: int) -> torch.Tensor:
    """The edit's latent entering step 0 over the full grid ``[1, N, D]``: the edit noise,
    or with ``strength < 1`` the template forward-noised to ``t = strength`` with it."""
    e = edit_noise(model, template, seed)
    if template.strength == 1.0:
        return e
    x0 = patchify(template.image[None].float(), model.cfg.patch_size)
    return renoise(x0, e, template.strength)


def heads_to_channels(x: torch.Tensor) -> torch.Tensor:
    """``[H, N, D]`` -> ``[N, H*D]``."""
    h, n, d = x.shape
    return x.transpose(0, 1).reshape(n, h * d)


def channels_to_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[N, C]`` -> ``[1, H, N, C/H]``."""
    n, c = x.shape
    return x.reshape(n, heads, c // heads).transpose(0, 1)[None]


# ----------------------------------------------------------------------------- hooks


class CaptureHook(AttentionHook):
    """Records K/V of the unmasked image tokens (and optionally image hidden states)."""

    def __init__(self, mode: str, unmasked: torch.Tensor, keep_hidden: bool = False):
        super().__init__(mode)
        self.unmasked = unmasked
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.keep_hidden = keep_hidden

    def on_kv(self, block: int, k, v, layout: Layout) -> None:
        idx = layout.txt + self.unmasked
        self.keys[block] = heads_to_channels(k[0, :, idx])
        self.values[block] = heads_to_channels(v[0, :, idx])

    def before_block(self, block: int, seg):
        if self.keep_hidden:
            self.hidden[block] = seg.img[0].clone()
        return seg


class CachedHook(AttentionHook):
    """Appends the template cache of step ``step`` (from a provider) to every block."""

    def __init__(self, mode: str, provider: KVProvider, step: int, heads: int,
                 extra: dict[int, list[KVSegment]] | None = None, record_text: bool = False):
        super().__init__(mode)
        self.provider, self.step, self.heads = provider, step, heads
        self.extra = extra or {}
        self.record_text = record_text
        self.text_k: dict[int, torch.Tensor] = {}
        self.text_v: dict[int, torch.Tensor] = {}

    def on_kv(self, block: int, k, v, layout: Layout) -> None:
        if self.record_text:
            self.text_k[block] = k[:, :, : layout.txt].clone()
            self.text_v[block] = v[:, :, : layout.txt].clone()

    def extra_kv(self, block: int) -> list[KVSegment]:
        k, v = self.provider.get(self.step, block)
        segs = list(self.extra.get(block, []))
        segs.append(KVSegment(CACHE, channels_to_heads(k, self.heads),
                              channels_to_heads(v, self.heads)))
        return segs


class ImportanceHook(CachedHook):
    """Cached execution that accumulates attention mass of masked queries on cached keys."""

    needs_probs = True

    def __init__(self, *args, importance: torch.Tensor, **kw):
        super().__init__(*args, **kw)
        self.importance = importance  # [B_blocks, U] view for this step

    def on_probs(self, block: int, probs, q_segs, k_segs) -> None:
        mass = cache_mass(probs, q_segs, k_segs)
        if mass is not None:
            self.importance[block] += mass


class PinHook(AttentionHook):
    """Slow reference: unmasked image hidden states pinned to the template run's."""

    def __init__(self, mode: str, hidden: dict[int, torch.Tensor], unmasked: torch.Tensor):
        super().__init__(mode)
        self.hidden, self.unmasked = hidden, unmasked

    def before_block(self, block: int, seg):
        img = seg.img.clone()
        img[:, self.unmasked] = self.hidden[block][self.unmasked].to(img.dtype)
        seg.img = img
        return seg


# ----------------------------------------------------------------------------- runs


@dataclass
class TemplateRun:
    """The template run's outputs: the cache, plus hidden states for the slow reference."""

    cache: TemplateCache
    geometry: Geometry
    hidden: list[dict[int, torch.Tensor]] = field(default_factory=list)


@torch.inference_mode()
def template_run(model: MMDiT, template: Template, keep_hidden: bool = False) -> TemplateRun:
    """Run the whole model on the template's forward-noised trajectory; capture K/V."""
    geo = Geometry.of(model, template)
    x0 = patchify(template.image[None].float(), model.cfg.patch_size)
    e = template_noise(model, template)
    ts = edit_schedule(template)
    keys, values, hidden = [], [], []

    def capture(s: int, t: torch.Tensor, xt: torch.Tensor) -> None:
        k, v, h = _template_pass(model, template, geo, t, xt, keep_hidden)
        keys.append(k)
        values.append(v)
        if keep_hidden:
            hidden.append(h)

    denoise(x0, EulerSteps(ts), capture, pinned=Trajectory(x0, e), integrate=False)
    k, v = torch.stack(keys), torch.stack(values)
    cache = TemplateCache(keys=k, values=v, importance=torch.zeros(k.shape[:3]),
                          token_index=geo.unmasked, timesteps=ts[:-1].clone(),
                          num_heads=model.cfg.num_heads)
    return TemplateRun(cache, geo, hidden)


def _template_pass(model: MMDiT, template: Template, geo: Geometry, t: torch.Tensor,
                   xt: torch.Tensor, keep_hidden: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """One step of the template run: the whole model on the template's tokens ``xt`` at
    ``t`` with the template prompt -> (K ``[B, U, C]``, V, image hidden states per block)."""
    hook = CaptureHook(model.cfg.attention_mode, geo.unmasked, keep_hidden)
    model(TokenBatch(img=xt, img_pos=geo.pos, txt=template.txt, t=t.reshape(1)), hook)
    blocks = range(model.cfg.num_blocks)
    return (torch.stack([hook.keys[b] for b in blocks]),
            torch.stack([hook.values[b] for b in blocks]), hook.hidden)


class RecomputedKV:
    """The recompute step of the local fallback: the template's own K/V of one step,
    computed on the device exactly as the cloud's template run computes them (the template
    image, its noise and its prompt are public catalog data; nothing of the user's edit goes
    in), then a cached step on them. This is CacheGen's fallback (recompute the cache from
    its context), and it is the cached edit's own trajectory, where a step with every token
    (``local``'s) follows another one. Measured on the shipped model (``scripts/recompute_step.py``,
    ``docs/bench/recompute-step.json``): cheaper than a full step, since the template pass
    has one batch row where guidance doubles the full step's, and within float error of the
    exact edit, where full steps cost 4-15 dB."""

    def __init__(self, model: MMDiT, template: Template, geo: Geometry) -> None:
        self.model, self.template, self.geo = model, template, geo
        self.trajectory = Trajectory(patchify(template.image[None].float(), model.cfg.patch_size),
                                     template_noise(model, template))

    @staticmethod
    def possible(template: Template) -> bool:
        """The template carries its prompt embeddings (a device template has none until
        its runtime encodes the prompt)."""
        return template.txt.shape[1] > 0

    def step(self, s: int, t: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Block -> (K ``[U, C]``, V) of step ``s`` (at ``t``)."""
        k, v, _ = _template_pass(self.model, self.template, self.geo, t, self.trajectory.at(t))
        return {b: (k[b], v[b]) for b in range(k.shape[0])}


class _StepKV:
    """A provider holding one step's K/V, whatever step is asked."""

    def __init__(self, kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv = kv

    def get(self, step: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[block]


def _cfg_batch(x, pos, req: EditRequest, t, guidance):
    if req.txt_uncond is not None and guidance != 1.0:
        txt = torch.cat([req.txt, req.txt_uncond])
        x = torch.cat([x, x])
    else:
        txt = req.txt
    return TokenBatch(img=x, img_pos=pos, txt=txt, t=t.reshape(1).expand(x.shape[0]))


def _guided(v: torch.Tensor, guidance: float) -> torch.Tensor:
    if v.shape[0] == 2:
        return v[1:] + guidance * (v[:1] - v[1:])
    return v


def compose(model: MMDiT, template: Template, geo: Geometry, x_masked: torch.Tensor) -> torch.Tensor:
    """Template outside the mask, edited tokens inside -> image ``[3, H, W]``."""
    tokens = patchify(template.image[None].float(), model.cfg.patch_size).clone()
    tokens[:, geo.masked] = x_masked.to(tokens.dtype)
    img = unpatchify(tokens, model.cfg.patch_size, model.cfg.in_channels, template.size)
    return img[0].clamp(-1, 1)


def region_psnr(a: torch.Tensor, b: torch.Tensor, region: torch.Tensor | None = None) -> float:
    """PSNR (dB) of two images ``[3, H, W]`` in [-1, 1], over the pixels of ``region``
    (``[H, W]`` bool) when given; identical images count as 100 dB."""
    diff = (a.double() - b.double()) ** 2
    if region is not None:
        diff = diff[:, region]
    mse = float(diff.mean())
    return 100.0 if mse <= 1e-20 else min(100.0, 10 * math.log10(4.0 / mse))


@torch.inference_mode()
def cached_edit(model: MMDiT, template: Template, geo: Geometry, provider: KVProvider,
                req: EditRequest, *, cache_refs: bool = True, reuse_text_kv: bool = False,
                hook_factory=None, on_step=None, start_step: int = 0,
                x_start: torch.Tensor | None = None, on_latent=None,
                stale_max_age: int | None = None, recompute: bool = True) -> torch.Tensor:
    """The device path: only text + masked (+ reference) tokens are computed; the template
    cache of the unmasked tokens comes from ``provider``, step by step, block by block.

    ``cache_refs``: extract reference K/V once and reuse them (exact); False recomputes the
    reference tokens every step. ``reuse_text_kv``: compute text tokens only at step 0 and
    reuse their K/V afterwards (an approximation in joint attention). ``on_latent(s, x)``
    sees the masked latent entering step ``s``; ``start_step`` with that ``x_start`` resumes
    an edit there (output-PSNR profiling re-runs only the steps after a changed shard).
    A step whose cache is late (``StepLate``) runs on each block's last K/V if it is at most
    ``stale_max_age`` steps old (``dit.stale``; 0: never; None: the provider's
    ``stale_max_age``, else :data:`~dit.stale.STALE_MAX_AGE`), else on its K/V recomputed
    from the template (``recompute``, :class:`RecomputedKV`; needs ``template.txt``), else
    with every token.
    """
    mode, heads = model.cfg.attention_mode, model.cfg.num_heads
    if start_step and (x_start is None or reuse_text_kv):
        raise ValueError("start_step needs x_start and cannot reuse text K/V")
    x = edit_start(model, template, req.seed)[:, geo.masked] if x_start is None else x_start
    pos = geo.pos[geo.masked]
    ts = edit_schedule(template)
    has_refs = req.ref_images is not None and len(req.ref_images) > 0
    refs = ReferenceKV.extract(model, req, template.guidance) if has_refs and cache_refs else None
    ref_toks = reference_tokens(model, req.ref_images) if has_refs and not cache_refs else None
    text_kv = None
    trajectory = None  # the unmasked tokens' (for a step computed locally), made once
    # a late step reuses each block's last K/V when it is recent enough (dit/stale.py)
    if stale_max_age is None:
        stale_max_age = int(getattr(provider, "stale_max_age", STALE_MAX_AGE))
    kept = (StaleReuse(provider, model.cfg.num_blocks, stale_max_age)
            if stale_max_age > 0 and hook_factory is None else None)

    can_recompute = recompute and RecomputedKV.possible(template) and hook_factory is None
    recomputed: RecomputedKV | None = None  # made at the first late step

    def local_step(s: int, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Step ``s`` computed on the device (the provider raised StepLate): the template's
        K/V recomputed, then the cached step (:class:`RecomputedKV`); without the template's
        prompt embeddings, every token with the unmasked ones on the template trajectory
        (what ``full_edit`` computes at that step)."""
        nonlocal trajectory, recomputed
        if can_recompute:
            if recomputed is None:
                recomputed = RecomputedKV(model, template, geo)
            kv = recomputed.step(s, t)
            if kept is not None:  # later late steps may reuse these (dit/stale.py)
                kept.put(s, kv)
            return cached_step(s, t, x, _StepKV(kv))
        if trajectory is None:
            trajectory = Trajectory(patchify(template.image[None].float(), model.cfg.patch_size),
                                    template_noise(model, template))
        xf = trajectory.at(t).clone()
        xf[:, geo.masked] = x
        return model(_cfg_batch(xf, geo.pos, req, t, template.guidance))[:, geo.masked]

    def model_step(s: int, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        try:
            return cached_step(s, t, x)
        except StepLate:
            src = kept.sources(s) if kept is not None else None
            if src is None:  # (as full_edit: no reference tokens, text tokens computed)
                return local_step(s, t, x)
            began = time.perf_counter()
            v = cached_step(s, t, x, kept.kept(s))
            ran_stale = getattr(provider, "ran_stale", None)
            if ran_stale is not None:  # the streaming provider's records and wait rule
                ran_stale(s, src, time.perf_counter() - began)
            return v

    def cached_step(s: int, t: torch.Tensor, x: torch.Tensor, source=None) -> torch.Tensor:
        nonlocal text_kv
        extra: dict[int, list[KVSegment]] = {}
        for part in (refs.segments() if refs else {}, text_kv_segments(*text_kv) if text_kv else {}):
            for b, segs in part.items():
                extra.setdefault(b, []).extend(segs)
        if hook_factory:
            hook = hook_factory(s, extra)
        else:
            hook = CachedHook(mode, source or kept or provider, s, heads, extra,
                              record_text=reuse_text_kv and s == 0)
        batch = _cfg_batch(x, pos, req, t, template.guidance)
        if ref_toks is not None:
            n = batch.img.shape[0]
            batch.ref, batch.ref_pos, batch.ref_sizes = (ref_toks[0].expand(n, -1, -1),
                                                         ref_toks[1], ref_toks[2])
        batch.text_tokens = text_kv is None
        v = model(batch, hook)
        if reuse_text_kv and s == 0:
            text_kv = (hook.text_k, hook.text_v)
        return v

    x = denoise(x, EulerSteps(ts), model_step, guide=lambda v: _guided(v, template.guidance),
                start=start_step, before_step=on_latent, after_step=on_step)
    return compose(model, template, geo, x)


def exact_edits(model: MMDiT, template: Template, requests: list[EditRequest]) -> list[torch.Tensor]:
    """The template run once, then each request's cached edit on the uncompressed (fp16)
    cache: what ``exact`` (= the ``fp16`` pack) gives on the device."""
    run = template_run(model, template)
    cache = run.cache.to_fp16_exact()
    return [cached_edit(model, template, run.geometry, cache, r) for r in requests]


@torch.inference_mode()
def pinned_reference_edit(model: MMDiT, template: Template, run: TemplateRun,
                          req: EditRequest) -> torch.Tensor:
    """Slow reference: the full model on every token with unmasked hidden states pinned."""
    if not run.hidden:
        raise ValueError("template_run(..., keep_hidden=True) is needed for the reference")
    geo = run.geometry
    x0 = patchify(template.image[None].float(), model.cfg.patch_size)
    e = template_noise(model, template)

    def model_step(s: int, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        hook = PinHook(model.cfg.attention_mode, run.hidden[s], geo.unmasked)
        return model(_cfg_batch(x, geo.pos, req, t, template.guidance), hook)

    x = denoise(edit_start(model, template, req.seed), EulerSteps(edit_schedule(template)),
                model_step, guide=lambda v: _guided(v, template.guidance),
                pinned=Trajectory(x0, e, geo.unmasked))
    return compose(model, template, geo, x[:, geo.masked])


@torch.inference_mode()
def full_edit(model: MMDiT, template: Template, req: EditRequest) -> torch.Tensor:
    """`full`: no cache at all. Whole model on every token; unmasked tokens are re-noised
    to the template trajectory each step (the same masked-editing rule, computed locally)."""
    geo = Geometry.of(model, template)
    x0 = patchify(template.image[None].float(), model.cfg.patch_size)
    e = template_noise(model, template)
    x = denoise(edit_start(model, template, req.seed), EulerSteps(edit_schedule(template)),
                lambda s, t, x: model(_cfg_batch(x, geo.pos, req, t, template.guidance)),
                guide=lambda v: _guided(v, template.guidance),
                pinned=Trajectory(x0, e, geo.unmasked))
    return compose(model, template, geo, x[:, geo.masked])


@torch.inference_mode()
def profile_importance(model: MMDiT, template: Template, run: TemplateRun,
                       requests: list[EditRequest]) -> torch.Tensor:
    """Attention mass of masked queries on each cached token, ``[S, B, U]``, summed over
    heads, queries, guidance branches and profiling requests; stored into the cache."""
    cache = run.cache
    imp = torch.zeros(cache.steps, cache.blocks, cache.tokens)
    for req in requests:
        cached_edit(model, template, run.geometry, cache, req,
                    hook_factory=lambda s, extra: ImportanceHook(
                        model.cfg.attention_mode, cache, s, model.cfg.num_heads, extra,
                        importance=imp[s]))
    cache.importance = imp
    return imp
