"""FlashDiff regional execution on the diffusers adapters: the
:class:`dit.regional.RegionalBackend` over a :class:`~dit.adapters.base.ModelAdapter`, and
regional cached edits / generation.

The algorithm (warm-up, saliency, Otsu partition, gate, stale context, deferred K/V writes)
is ``dit.regional``'s, unchanged; this module only runs the model. A call computes a set of
region tokens (and the text) fresh through :meth:`ModelAdapter.velocity`; the rest of the
region is visible through the :class:`~dit.regional.KVStore` (each token's K/V from its last
execution, never a patch's own), the template cache of the unmasked tokens and any
reference / prefix K/V stay visible as in :meth:`ModelAdapter.cached_edit`. Guidance
branches run as separate forwards (as everywhere in the adapters); the probes (image ->
text and image -> region attention) come from the conditional branch, mean over heads and
the probe blocks (the joint text-image attention calls: FLUX.2's double-stream blocks,
SD3's ``attn`` layers, every QwenImage layer).

Several separate patches are run one call each (no packing: the adapters run the models'
own forward, whose text is not duplicated per patch); ``execution="joint"`` runs all active
patches of a step in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sakura.dit.adapters.base import (
    AdapterGeometry,
    AdapterHook,
    Branch,
    LatentRequest,
    LatentTemplate,
    ModelAdapter,
)
from sakura.dit.attention import CACHE, IMG, TXT, KVSegment, Layout
from sakura.dit.cache import KVProvider
from sakura.dit.regional import (
    FullResult,
    KVStore,
    PatchResult,
    RegionalConfig,
    RegionalState,
    run_regional,
)


class RegionalHook(AdapterHook):
    """:class:`AdapterHook` that also records the image K/V of every block and, in probe
    blocks, the mean-over-heads attention of the computed image queries."""

    def __init__(self, probe_blocks: set[int], **kw):
        super().__init__(record=True, **kw)
        self.probe_blocks = probe_blocks
        self.probs_sum: torch.Tensor | None = None
        self.probed = 0
        self.txt_cols: torch.Tensor | None = None
        self.img_cols: torch.Tensor | None = None
        self.img_rows: torch.Tensor | None = None

    def attend(self, block: int, q, k, v, layout: Layout) -> torch.Tensor:
        self.needs_probs = block in self.probe_blocks
        return super().attend(block, q, k, v, layout)

    def on_probs(self, block: int, probs, q_segs, k_segs) -> None:
        def cols(segs, role):
            out, at = [], 0
            for r, n in segs:
                if r == role:
                    out.append(torch.arange(at, at + n))
                at += n
            return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)

        self.img_rows, self.img_cols = cols(q_segs, IMG), cols(k_segs, IMG)
        self.txt_cols = cols(k_segs, TXT)
        a = probs[0].float().mean(0)[self.img_rows.to(probs.device)].cpu()
        self.probs_sum = a if self.probs_sum is None else self.probs_sum + a
        self.probed += 1


@dataclass
class _Out:
    velocity: torch.Tensor
    k: torch.Tensor          # [L, Bc, H, m, D]
    v: torch.Tensor
    text_attn: torch.Tensor | None
    img_attn: torch.Tensor | None


class AdapterRegional:
    """:class:`~dit.regional.RegionalBackend` for a diffusers adapter.

    ``rows`` ``[n]``: grid rows of the region tokens (the masked tokens of an edit, or the
    whole grid); ``branches``: the guidance branches (conditional first); ``provider``: the
    template cache (edits) or None.
    """

    def __init__(self, adapter: ModelAdapter, branches: list[Branch], guidance: float,
                 grid: tuple[int, int], rows: torch.Tensor,
                 provider: KVProvider | None = None, fixed_tokens: int = 0,
                 probe_blocks: tuple[int, ...] | None = None):
        self.adapter, self.branches, self.guidance = adapter, branches, guidance
        self.grid, self.rows = grid, rows
        self.coords = torch.stack([rows // grid[1], rows % grid[1]], dim=-1)
        self.provider, self.fixed_tokens = provider, fixed_tokens
        self.text_tokens = int(branches[0].cond.embeds.shape[1])
        self.probe_blocks = set(probe_blocks if probe_blocks is not None
                                else default_probe_blocks(adapter))
        self._params = float(sum(p.numel() for m in adapter.layers() for p in m.parameters()))

    def cost(self, queries: int, keys: int, calls: int = 1) -> float:
        """Multiply-accumulates: weights touched per query plus attention, per branch."""
        a = self.adapter
        attn = 2.0 * queries * keys * a.heads * a.head_dim * a.num_blocks
        return len(self.branches) * (queries * self._params + attn)

    def _timestep(self, t: float) -> torch.Tensor:
        return torch.tensor(t, dtype=torch.float32) * 1000  # as the scheduler computes it

    def _call(self, step: int, t: float, x: torch.Tensor, fresh: torch.Tensor,
              context: KVStore | None, context_rows: torch.Tensor | None,
              probe: bool) -> _Out:
        a = self.adapter
        rows = self.rows[fresh]
        vs, ks, vals = [], [], []
        text_attn = img_attn = None
        for bi, br in enumerate(self.branches):
            extra = {b: list(segs) for b, segs in br.extra.items()}
            if context is not None and context_rows is not None and len(context_rows):
                for b in range(a.num_blocks):
                    extra.setdefault(b, []).append(KVSegment(
                        CACHE, context.k[b, bi:bi + 1][:, :, context_rows],
                        context.v[b, bi:bi + 1][:, :, context_rows]))
            hook = RegionalHook(self.probe_blocks if (probe and bi == 0) else set(),
                                heads=a.heads, extra=extra, provider=self.provider, step=step,
                                key_shift=br.key_shift)
            vs.append(a.velocity(x[fresh][None].float(), rows, self.grid, self._timestep(t),
                                 br, hook))
            ks.append(torch.stack([hook.keys[b][0] for b in range(a.num_blocks)]).float().cpu())
            vals.append(torch.stack([hook.values[b][0] for b in range(a.num_blocks)]).float().cpu())
            if hook.probed:
                p = hook.probs_sum / hook.probed
                text_attn, img_attn = p[:, hook.txt_cols], p[:, hook.img_cols]
        vel = (vs[0] if len(vs) == 1 else a.combine_guidance(vs[0], vs[1], self.guidance))[0]
        return _Out(vel.float().cpu(), torch.stack(ks, 1), torch.stack(vals, 1), text_attn,
                    img_attn)

    def run_full(self, step: int, t: float, x: torch.Tensor, probe: bool,
                 want_kv: bool) -> FullResult:
        n = x.shape[0]
        out = self._call(step, t, x, torch.arange(n), None, None, probe)
        return FullResult(out.velocity, KVStore(out.k, out.v) if want_kv else None,
                          text_attn=out.text_attn, img_attn=out.img_attn,
                          img_keys=n + self.fixed_tokens)

    def run_patches(self, step: int, t: float, x: torch.Tensor, patches: list[torch.Tensor],
                    context: KVStore | None, joint: bool = False) -> list[PatchResult]:
        if not patches:
            return []
        n = x.shape[0]
        units = [torch.cat(patches)] if joint else list(patches)
        results: list[PatchResult] = []
        for unit in units:
            rest = None
            if context is not None:
                keep = torch.ones(n, dtype=torch.bool)
                keep[unit] = False
                rest = keep.nonzero().flatten()
            out = self._call(step, t, x, unit, context, rest, probe=True)
            keys = (n if context is not None else len(unit)) + self.fixed_tokens
            members = patches if joint else [unit]
            off = 0
            for p in members:
                m = len(p)
                sl = slice(off, off + m)
                mass = float("nan")
                if out.img_attn is not None:
                    mass = float(out.img_attn[sl, sl].sum(-1).mean())
                results.append(PatchResult(out.velocity[sl], out.k[:, :, :, sl].clone(),
                                           out.v[:, :, :, sl].clone(), mass, keys))
                off += m
        return results


def default_probe_blocks(adapter: ModelAdapter) -> tuple[int, ...]:
    """The attention calls where text and image attend jointly (FLUX.2: the double-stream
    blocks, as the default model; SD3: the ``attn`` calls, not the image-only ``attn2``)."""
    names = adapter.block_names
    if any(n.startswith("double.") for n in names):
        return tuple(i for i, n in enumerate(names) if n.startswith("double."))
    return tuple(i for i, n in enumerate(names) if not n.endswith(".attn2"))


def regional_edit(adapter: ModelAdapter, template: LatentTemplate, geo: AdapterGeometry,
                  provider: KVProvider, req: LatentRequest, cfg: RegionalConfig | None = None,
                  salient: torch.Tensor | None = None, probe_blocks=None
                  ) -> tuple[torch.Tensor, RegionalState]:
    """A cached masked edit whose masked tokens run regionally -> (latents ``[N, C]``, state).

    Equals :meth:`ModelAdapter.cached_edit` when ``cfg.warmup >= template.steps`` (and when
    every patch runs every step, ``eps = 0``)."""
    cfg = cfg or RegionalConfig()
    branches = adapter._branches(template, req, cache_refs=True)
    sched = adapter.make_scheduler(template.steps, template.tokens)
    backend = AdapterRegional(adapter, branches, template.guidance, template.grid, geo.masked,
                              provider if len(geo.unmasked) else None, len(geo.unmasked),
                              probe_blocks)
    x = adapter.edit_noise(template, req.seed)[0, geo.masked]
    state = RegionalState(cfg, backend.coords, sched.sigmas.float(), x, backend.text_tokens,
                          salient, backend.cost)
    run_regional(backend, state)
    return adapter.compose(template, geo, state.x), state


def regional_generate(adapter: ModelAdapter, template: LatentTemplate, req: LatentRequest,
                      cfg: RegionalConfig | None = None, salient: torch.Tensor | None = None,
                      probe_blocks=None) -> tuple[torch.Tensor, RegionalState]:
    """Full generation of ``template.grid`` (its latents and mask unused; its prompt sets the
    RoPE frame of QwenImage 2.1) with regional execution -> (latents ``[N, C]``, state)."""
    cfg = cfg or RegionalConfig()
    branches = adapter._branches(template, req, cache_refs=True)
    sched = adapter.make_scheduler(template.steps, template.tokens)
    rows = torch.arange(template.tokens)
    backend = AdapterRegional(adapter, branches, template.guidance, template.grid, rows,
                              probe_blocks=probe_blocks)
    x = adapter.edit_noise(template, req.seed)[0]
    state = RegionalState(cfg, backend.coords, sched.sigmas.float(), x, backend.text_tokens,
                          salient, backend.cost)
    run_regional(backend, state)
    return state.x, state


__all__ = ["AdapterRegional", "RegionalHook", "default_probe_blocks", "regional_edit",
           "regional_generate"]
