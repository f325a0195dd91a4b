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
SD3's ``attn`` layers, every QwenImage layer), measured by the fused attention kernel with
extra value columns (:class:`RegionalHook`), never by materialising attention matrices. The
importance gate's probe runs every region token, cond branch only, and stops the forward
after the first probe block.

Several separate patches are run one call each (no packing: the adapters run the models'
own forward, whose text is not duplicated per patch); ``execution="joint"`` runs all active
patches of a step in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from sakura.dit.adapters.base import ModelAdapter
from sakura.dit.adapters.hook import AdapterHook
from sakura.dit.adapters.inputs import AdapterGeometry, LatentRequest, LatentTemplate
from sakura.dit.adapters.processors import Branch
from sakura.dit.adapters.registry import adapter_class, read_checkpoint
from sakura.dit.attention import CACHE, IMG, TXT, KVSegment, Layout
from sakura.dit.cache import KVProvider
from sakura.dit.regional import (
    FullResult,
    KVStore,
    PatchResult,
    ProbeDone,
    ProbeResult,
    RegionalConfig,
    RegionalState,
    fused_masses,
    run_regional,
)


class RegionalHook(AdapterHook):
    """:class:`AdapterHook` that also records the image K/V of every block and, in probe
    blocks, the attention mass of the computed image queries on groups of keys (mean over
    heads), from one extra fused-kernel call with indicator values
    (:func:`dit.regional.fused_masses`): ``columns="text"`` = one group per text
    key, ``"groups"`` = the given groups of computed image tokens. No attention matrix is
    materialised. After ``stop_after`` probe blocks the forward is cut short
    (:class:`~dit.regional.ProbeDone`) before the block's own attention output."""

    def __init__(self, probe_blocks: set[int], columns: str | None = None,
                 groups: list[torch.Tensor] | None = None, stop_after: int | None = None,
                 record: bool = True, **kw):
        super().__init__(record=record, **kw)
        self.probe_blocks = probe_blocks if columns else set()
        self.columns, self.groups, self.stop_after = columns, groups, stop_after
        self.mass_sum: torch.Tensor | None = None
        self.probed = 0
        self.keys_seen = 0

    def _indicator(self, k_segs, total: int) -> torch.Tensor:
        ind = torch.zeros(total, len(self.groups) if self.columns == "groups" else 0)
        at = 0
        for role, n in k_segs:
            if role == TXT and self.columns == "text":
                ind = torch.zeros(total, n)
                ind[torch.arange(at, at + n), torch.arange(n)] = 1.0
            elif role == IMG and self.columns == "groups":
                for i, g in enumerate(self.groups):
                    ind[at + g, i] = 1.0
            at += n
        return ind

    def attend(self, block: int, q, k, v, layout: Layout) -> torch.Tensor:
        if block not in self.probe_blocks:
            return super().attend(block, q, k, v, layout)
        self._like = q
        k, v, q_segs, k_segs, mask = self.gather(block, q, k, v, layout)
        ind = self._indicator(k_segs, k.shape[2]).to(v.device, v.dtype)
        mask = None if mask is None else mask.to(q.device)
        rows = torch.cat([torch.arange(at, at + n) for at, (r, n) in
                          zip(_starts(q_segs), q_segs) if r == IMG])
        mass = fused_masses(q, k, ind, mask)[rows.to(q.device)].float().cpu()
        self.mass_sum = mass if self.mass_sum is None else self.mass_sum + mass
        self.probed += 1
        self.keys_seen = k.shape[2]
        if self.stop_after is not None and self.probed >= self.stop_after:
            raise ProbeDone
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _starts(segs) -> list[int]:
    out, at = [], 0
    for _, n in segs:
        out.append(at)
        at += n
    return out


@dataclass
class _Out:
    velocity: torch.Tensor | None
    k: torch.Tensor | None   # [L, Bc, H, m, D]
    v: torch.Tensor | None
    mass: torch.Tensor | None  # [m image queries, columns], mean over probed blocks
    probed: int = 0
    keys: int = 0


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
        return adapter_macs(self.adapter, queries, keys, len(self.branches), self._params)

    def probe_cost(self, queries: int, keys: int, last_block: int, columns: int) -> float:
        """Modelled multiply-accumulates of a probe (one branch) stopped in cache block
        ``last_block``: every earlier block in full, then that block's q/k/v projections
        and its mass reduction (one fused attention call per head-dimension-wide chunk of
        the ``columns`` indicator columns)."""
        a = self.adapter
        inner = a.heads * a.head_dim
        per_block = self._params / a.num_blocks
        attn = 2.0 * queries * keys * inner
        chunks = -(-columns // a.head_dim)
        return (last_block * (queries * per_block + attn) + queries * 3 * inner * inner
                + chunks * attn)

    def _timestep(self, t: float) -> torch.Tensor:
        return torch.tensor(t, dtype=torch.float32) * 1000  # as the scheduler computes it

    def _call(self, step: int, t: float, x: torch.Tensor, fresh: torch.Tensor,
              context: KVStore | None, context_rows: torch.Tensor | None,
              columns: str | None = None, groups: list[torch.Tensor] | None = None,
              depth: int | None = None) -> _Out:
        a = self.adapter
        rows = self.rows[fresh]
        probe = depth is not None
        branches = self.branches[:1] if probe else self.branches
        vs, ks, vals = [], [], []
        mass, probed, keys = None, 0, 0
        for bi, br in enumerate(branches):
            extra = {b: list(segs) for b, segs in br.extra.items()}
            if context is not None and context_rows is not None and len(context_rows):
                for b in range(a.num_blocks):
                    extra.setdefault(b, []).append(KVSegment(
                        CACHE, context.k[b, bi:bi + 1][:, :, context_rows],
                        context.v[b, bi:bi + 1][:, :, context_rows]))
            hook = RegionalHook(self.probe_blocks if bi == 0 else set(),
                                columns if bi == 0 else None, groups, depth,
                                record=not probe, heads=a.heads, extra=extra,
                                provider=self.provider, step=step, key_shift=br.key_shift)
            try:
                vs.append(a.velocity(x[fresh][None].float(), rows, self.grid,
                                     self._timestep(t), br, hook))
            except ProbeDone:
                pass
            if hook.probed:
                mass, probed, keys = hook.mass_sum / hook.probed, hook.probed, hook.keys_seen
            if probe:
                if not hook.probed:
                    raise RuntimeError(f"the probe reached no probe block "
                                       f"({sorted(self.probe_blocks)})")
                return _Out(None, None, None, mass, probed, keys)
            ks.append(torch.stack([hook.keys[b][0] for b in range(a.num_blocks)]).float().cpu())
            vals.append(torch.stack([hook.values[b][0] for b in range(a.num_blocks)]).float().cpu())
        vel = (vs[0] if len(vs) == 1 else a.combine_guidance(vs[0], vs[1], self.guidance))[0]
        return _Out(vel.float().cpu(), torch.stack(ks, 1), torch.stack(vals, 1), mass, probed,
                    keys)

    def run_full(self, step: int, t: float, x: torch.Tensor, probe: bool,
                 want_kv: bool) -> FullResult:
        n = x.shape[0]
        out = self._call(step, t, x, torch.arange(n), None, None, "text" if probe else None)
        macs = 0.0
        if out.mass is not None:
            chunks = -(-out.mass.shape[1] // self.adapter.head_dim)
            macs = float(out.probed * chunks * 2 * (n + self.text_tokens) * out.keys
                         * self.adapter.heads * self.adapter.head_dim)
        return FullResult(out.velocity, KVStore(out.k, out.v) if want_kv else None,
                          text_attn=out.mass, img_keys=n + self.fixed_tokens, probe_macs=macs)

    def run_patches(self, step: int, t: float, x: torch.Tensor, patches: list[torch.Tensor],
                    context: KVStore | None, joint: bool = False,
                    measure: bool = True) -> list[PatchResult]:
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
            members = patches if joint else [unit]
            groups, off = [], 0
            for p in members:
                groups.append(torch.arange(off, off + len(p)))
                off += len(p)
            out = self._call(step, t, x, unit, context, rest, "groups" if measure else None,
                             groups)
            keys = (n if context is not None else len(unit)) + self.fixed_tokens
            macs = 0.0
            if out.mass is not None:
                chunks = -(-len(members) // self.adapter.head_dim)
                macs = float(out.probed * chunks * 2 * (len(unit) + self.text_tokens)
                             * out.keys * self.adapter.heads * self.adapter.head_dim)
            for i, (_, g) in enumerate(zip(members, groups)):
                sl = slice(int(g[0]), int(g[-1]) + 1)
                mass = float("nan")
                if out.mass is not None:
                    mass = float(out.mass[sl, i].mean())
                results.append(PatchResult(out.velocity[sl], out.k[:, :, :, sl].clone(),
                                           out.v[:, :, :, sl].clone(), mass, keys,
                                           macs / len(members)))
        return results

    def probe(self, step: int, t: float, x: torch.Tensor, patches: list[torch.Tensor],
              depth: int | None = None) -> ProbeResult:
        n = x.shape[0]
        depth = depth or len(self.probe_blocks)
        out = self._call(step, t, x, torch.arange(n), None, None, "groups", list(patches),
                         depth=depth)
        mass = torch.stack([out.mass[p, i].sum() for i, p in enumerate(patches)])
        last = sorted(self.probe_blocks)[out.probed - 1]
        macs = self.probe_cost(n + self.text_tokens, out.keys, last, len(patches))
        return ProbeResult(mass, n + self.fixed_tokens, macs)


def adapter_macs(adapter: ModelAdapter, queries: int, keys: int, branches: int = 1,
                 params: float | None = None) -> float:
    """Modelled multiply-accumulates of one forward of ``queries`` tokens over ``keys``:
    every transformer weight touched once per query, plus attention, per guidance branch."""
    if params is None:
        params = float(sum(p.numel() for m in adapter.layers() for p in m.parameters()))
    attn = 2.0 * queries * keys * adapter.heads * adapter.head_dim * adapter.num_blocks
    return branches * (queries * params + attn)


def meta_adapter(name: str, path) -> ModelAdapter:
    """The adapter of checkpoint ``path`` (model ``name``) over a weightless copy of its
    transformer (PyTorch's ``meta`` device): geometry, the pipeline's schedule and the cost
    model without reading or holding any weights (what a scheduler process needs)."""
    import diffusers

    spec, _, config, sched = read_checkpoint(name, path)
    cls = getattr(diffusers, spec.model_class)
    with torch.device("meta"):
        model = cls.from_config(config)
    return adapter_class(spec)(model, sched, name=name)


def default_probe_blocks(adapter: ModelAdapter) -> tuple[int, ...]:
    """The attention calls where text and image attend jointly (FLUX.2: the double-stream
    blocks, as the default model; SD3: the ``attn`` calls, not the image-only ``attn2``)."""
    names = adapter.block_names
    if any(n.startswith("double.") for n in names):
        return tuple(i for i, n in enumerate(names) if n.startswith("double."))
    return tuple(i for i, n in enumerate(names) if not n.endswith(".attn2"))


def regional_edit(adapter: ModelAdapter, template: LatentTemplate, geo: AdapterGeometry,
                  provider: KVProvider, req: LatentRequest, cfg: RegionalConfig | None = None,
                  salient: torch.Tensor | None = None, probe_blocks=None,
                  timer: dict | None = None) -> tuple[torch.Tensor, RegionalState]:
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
                          salient, backend.cost, cfg.patches)
    run_regional(backend, state, timer)
    return adapter.compose(template, geo, state.x), state


def regional_generate(adapter: ModelAdapter, template: LatentTemplate, req: LatentRequest,
                      cfg: RegionalConfig | None = None, salient: torch.Tensor | None = None,
                      probe_blocks=None, timer: dict | None = None
                      ) -> tuple[torch.Tensor, RegionalState]:
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
                          salient, backend.cost, cfg.patches)
    run_regional(backend, state, timer)
    return state.x, state


__all__ = ["AdapterRegional", "RegionalHook", "adapter_macs", "default_probe_blocks",
           "meta_adapter", "regional_edit", "regional_generate"]
