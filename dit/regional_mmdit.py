"""Regional execution for the default MMDiT: the :class:`~dit.regional.RegionalBackend`
implementation, and regional full generation / regional cached edits.

Patch-restricted execution runs the model on a subset of image tokens. Several patches
of one step are *packed* into one call along the token axis: ``[text x P, patch_1 ...
patch_P]`` with a block-diagonal attention mask, so each patch (and its own copy of the
text tokens) sees only itself fresh, plus

* the K/V of the rest of the region as of each token's last execution (the
  :class:`~dit.regional.KVStore`, its own stale entries masked out; ``context="stale"``),
* in a cached edit, the template cache of the unmasked tokens (role ``cache``).

Packing is exactly separate execution (up to float summation order): the model mixes
tokens only in attention, and the mask removes every cross-patch pair. It saves the
per-call overhead of an eager forward, which dominates at this model size on a CPU.
Attention mass is measured only in the *probe blocks* (default: the double-stream blocks,
where text and image attend jointly), by one extra fused-kernel attention call whose
values are group indicators (:func:`fused_masses`): no attention matrix is materialised. A *probe*
(:meth:`MMDiTRegional.probe`, the importance gate's per-step signal) runs every region
token, cond branch only, and stops the forward after the first probe block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from sakura.dit.attention import AttentionHook, Layout
from sakura.dit.cache import KVProvider
from sakura.dit.editing import (
    EditRequest,
    Geometry,
    Template,
    channels_to_heads,
    compose,
    edit_schedule,
    edit_start,
)
from sakura.dit.model import MMDiT, MMDiTConfig, TokenBatch, unpatchify
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
from sakura.dit.sampler import noise_like, schedule


def guided(cond: torch.Tensor, uncond: torch.Tensor, guidance: float) -> torch.Tensor:
    """Classifier-free guidance of two branch outputs (the one rule, batched or not)."""
    return uncond + guidance * (cond - uncond)


def join_branches(cond: FullResult, uncond: FullResult, guidance: float) -> FullResult:
    """The whole-region step of two branch results (:meth:`MMDiTRegional.run_full` with
    ``branch`` 0 and 1, possibly run on two workers): the guided velocity, K/V with the
    branches stacked as a batched call stacks them, the cond branch's text mass."""
    kv = None
    if cond.kv is not None and uncond.kv is not None:
        kv = KVStore(torch.cat([cond.kv.k, uncond.kv.k], dim=1),
                     torch.cat([cond.kv.v, uncond.kv.v], dim=1))
    return FullResult(guided(cond.velocity, uncond.velocity, guidance), kv, cond.text_attn,
                      cond.img_keys, cond.probe_macs)


def mmdit_macs(cfg: MMDiTConfig, queries: int, keys: int) -> float:
    """Multiply-accumulates of the transformer blocks for one guidance branch."""
    d = cfg.hidden_size
    mlp = int(d * cfg.mlp_ratio)
    attn = 2 * queries * keys * d
    double = queries * (4 * d * d + 2 * d * mlp) + attn
    single = queries * (d * (3 * d + mlp) + (d + mlp) * d) + attn
    return float(cfg.double_blocks * double + cfg.single_blocks * single)


def mmdit_probe_macs(cfg: MMDiTConfig, img: int, txt: int, keys: int, last_block: int,
                     chunks: int = 1) -> float:
    """Multiply-accumulates of a probe forward (one branch) stopped in ``last_block``: the
    input projections, every earlier block, the last block's q/k/v projections and its
    mass reduction (``chunks`` attention calls with indicator values)."""
    d = cfg.hidden_size
    mlp = int(d * cfg.mlp_ratio)
    q = img + txt
    macs = img * cfg.patch_dim * d + txt * cfg.text_dim * d
    for b in range(last_block):
        attn = 2 * q * keys * d
        if b < cfg.double_blocks:
            macs += q * (4 * d * d + 2 * d * mlp) + attn
        else:
            macs += q * (d * (3 * d + mlp) + (d + mlp) * d) + attn
    macs += q * 3 * d * d + chunks * 2 * q * keys * d
    return float(macs)


class PackHook(AttentionHook):
    """Attention for a packed call: fixed extra K/V, the stale context, a block mask,
    K/V recording of the image tokens and, in probe blocks, the attention mass of every
    query on groups of keys (:func:`fused_masses`: one extra fused-kernel call with
    indicator values, conditional branch only; no attention matrix). ``stop_after`` probe
    blocks, the forward is cut short (:class:`ProbeDone`) before the block's own
    attention output is computed."""

    def __init__(self, fixed: Callable[[int], list[torch.Tensor]] | None,
                 context: KVStore | None, mask: torch.Tensor | None, probe_blocks: set[int],
                 indicator: torch.Tensor | None = None, stop_after: int | None = None,
                 record: bool = True):
        super().__init__("joint")
        self.fixed, self.context, self.mask = fixed, context, mask
        self.probe_blocks = probe_blocks if indicator is not None else set()
        self.indicator, self.stop_after, self.record = indicator, stop_after, record
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.mass_sum: torch.Tensor | None = None
        self.probed = 0

    def attend(self, block: int, q, k, v, layout: Layout):
        if layout.ref:
            raise ValueError("regional execution does not take reference tokens")
        t = layout.txt
        if self.record:
            self.k[block] = k[:, :, t : t + layout.img]
            self.v[block] = v[:, :, t : t + layout.img]
        b = q.shape[0]
        ks, vs = [k], [v]
        if self.fixed is not None:
            fk, fv = self.fixed(block)
            ks.append(fk.expand(b, -1, -1, -1))
            vs.append(fv.expand(b, -1, -1, -1))
        if self.context is not None:
            ks.append(self.context.k[block].expand(b, -1, -1, -1))
            vs.append(self.context.v[block].expand(b, -1, -1, -1))
        if len(ks) > 1:
            k, v = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
        if block in self.probe_blocks:
            mass = fused_masses(q, k, self.indicator.to(v.device, v.dtype), self.mask)
            self.mass_sum = mass if self.mass_sum is None else self.mass_sum + mass
            self.probed += 1
            if self.stop_after is not None and self.probed >= self.stop_after:
                raise ProbeDone
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)


@dataclass
class _Pack:
    sizes: list[int]
    txt: int
    fixed: int
    store: int


@dataclass
class _Out:
    velocity: torch.Tensor | None
    k: torch.Tensor | None
    v: torch.Tensor | None
    mass: torch.Tensor | None  # [queries, m] mean over probed blocks
    pack: _Pack
    probe_macs: float = 0.0


class MMDiTRegional:
    """:class:`~dit.regional.RegionalBackend` for :class:`~dit.model.MMDiT`.

    ``pos`` ``[n, 3]`` are the region tokens' rotary positions and ``coords`` ``[n, 2]``
    their (row, column) on the token grid; ``fixed(step)`` (cached edits) returns a
    function ``block -> (k, v)`` of the template cache, each ``[1, H, U, D]``.
    """

    def __init__(self, model: MMDiT, txt: torch.Tensor, txt_uncond: torch.Tensor | None,
                 guidance: float, pos: torch.Tensor, coords: torch.Tensor,
                 fixed: Callable[[int], Callable[[int], tuple[torch.Tensor, torch.Tensor]]] | None = None,
                 fixed_tokens: int = 0, probe_blocks: tuple[int, ...] | None = None):
        if model.cfg.attention_mode != "joint":
            raise ValueError("regional execution supports the joint attention mode only")
        self.model, self.guidance = model, guidance
        self.branches = 2 if txt_uncond is not None and guidance != 1.0 else 1
        self.txt = torch.cat([txt, txt_uncond.expand_as(txt)]) if self.branches == 2 else txt
        self.pos, self.coords = pos, coords
        self.fixed, self.fixed_tokens = fixed, fixed_tokens
        self.text_tokens = int(txt.shape[1])
        blocks = probe_blocks if probe_blocks is not None else tuple(range(model.cfg.double_blocks))
        self.probe_blocks = set(blocks)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def cost(self, queries: int, keys: int) -> float:
        return self.branches * mmdit_macs(self.model.cfg, queries, keys)

    # -- one packed call -------------------------------------------------------------

    def _mask(self, pack: _Pack, owner: torch.Tensor | None) -> torch.Tensor | None:
        p = len(pack.sizes)
        if p == 1 and owner is None:
            return None
        groups = torch.arange(p)
        gq = torch.cat([groups.repeat_interleave(pack.txt),
                        groups.repeat_interleave(torch.tensor(pack.sizes))])
        gk = torch.cat([gq, torch.full((pack.fixed,), -1)])
        fresh_or_fixed = (gk[None] == gq[:, None]) | (gk[None] == -1)
        if owner is None:
            return fresh_or_fixed
        stale = owner[None] != gq[:, None]  # a patch never sees its own stale K/V
        return torch.cat([fresh_or_fixed, stale], dim=1)

    def _indicator(self, pack: _Pack, columns: str, groups: list[torch.Tensor] | None):
        """Value columns for the fused mass reduction: ``"text"`` = one per text token
        (the call holds one copy of the text), ``"groups"`` = one per group of fresh
        image tokens (``groups`` index the call's image rows)."""
        p = len(pack.sizes)
        keys = p * pack.txt + sum(pack.sizes) + pack.fixed + pack.store
        if columns == "text":
            ind = torch.zeros(keys, pack.txt)
            ind[torch.arange(pack.txt), torch.arange(pack.txt)] = 1.0
            return ind
        ind = torch.zeros(keys, len(groups))
        for i, g in enumerate(groups):
            ind[p * pack.txt + g, i] = 1.0
        return ind

    @torch.no_grad()
    def _call(self, step: int, t: float, x: torch.Tensor, patches: list[torch.Tensor],
              context: KVStore | None, columns: str | None = None,
              groups: list[torch.Tensor] | None = None, mask_own: bool = True,
              depth: int | None = None, branch: int | None = None) -> _Out:
        """One forward of ``patches`` (packed). ``columns`` selects a fused mass
        measurement in the probe blocks (see :meth:`_indicator`); ``depth`` makes it a
        probe: cond branch only, no K/V, the forward stopped after ``depth`` probe
        blocks. ``branch`` (0 cond, 1 uncond) runs that guidance branch alone and returns
        its raw output as the velocity (:func:`guided` combines two)."""
        dev = self.device
        idx = torch.cat(patches)
        sizes = [len(p) for p in patches]
        pack = _Pack(sizes, self.text_tokens, self.fixed_tokens,
                     0 if context is None else context.k.shape[3])
        owner = None
        if context is not None and mask_own:
            owner = torch.full((pack.store,), -2, dtype=torch.long)
            for i, p in enumerate(patches):
                owner[p] = i
        mask = self._mask(pack, owner)
        fixed = self.fixed(step) if self.fixed is not None else None
        if fixed is not None and dev.type != "cpu":
            fixed_cpu = fixed

            def fixed(b, f=fixed_cpu):
                return tuple(z.to(dev) for z in f(b))
        ctx = None
        if context is not None:
            ctx = KVStore(context.k.to(dev), context.v.to(dev))
        ind = self._indicator(pack, columns, groups) if columns else None
        probe = depth is not None
        hook = PackHook(fixed, ctx, None if mask is None else mask.to(dev), self.probe_blocks,
                        ind, stop_after=depth, record=not probe)
        bc = 1 if probe or branch is not None else self.branches
        first = branch or 0
        img = x[idx].to(dev, torch.float32)[None].expand(bc, -1, -1)
        txt = self.txt[first:first + bc].to(dev).repeat(1, len(patches), 1)
        tt = torch.full((bc,), float(t), device=dev)
        batch = TokenBatch(img=img, img_pos=self.pos[idx].to(dev), txt=txt, t=tt)
        q = len(patches) * pack.txt + sum(sizes)
        keys = q + pack.fixed + pack.store
        mass = None
        if probe:
            try:
                self.model(batch, hook)
            except ProbeDone:
                pass
            else:
                raise RuntimeError(f"the probe reached no probe block ({sorted(self.probe_blocks)})")
            mass = (hook.mass_sum / hook.probed).float().cpu()
            last = sorted(self.probe_blocks)[hook.probed - 1]
            chunks = -(-ind.shape[1] // self.model.cfg.head_dim)
            macs = mmdit_probe_macs(self.model.cfg, sum(sizes), len(patches) * pack.txt, keys,
                                    last, chunks)
            return _Out(None, None, None, mass, pack, macs)
        out = self.model(batch, hook)
        vel = guided(out[:1], out[1:], self.guidance) if bc == 2 else out
        vel = vel[0].float().cpu()
        nb = self.model.cfg.num_blocks
        k = torch.stack([hook.k[b] for b in range(nb)]).float().cpu()
        v = torch.stack([hook.v[b] for b in range(nb)]).float().cpu()
        macs = 0.0
        if hook.probed:
            mass = (hook.mass_sum / hook.probed).float().cpu()
            chunks = -(-ind.shape[1] // self.model.cfg.head_dim)
            macs = float(hook.probed * chunks * 2 * q * keys * self.model.cfg.hidden_size)
        return _Out(vel, k, v, mass, pack, macs)

    # -- the backend interface -------------------------------------------------------

    def run_full(self, step: int, t: float, x: torch.Tensor, probe: bool,
                 want_kv: bool, branch: int | None = None) -> FullResult:
        """A whole-region step; ``branch`` (0 cond, 1 uncond): that guidance branch only,
        its raw output as the velocity and its K/V, the text mass only on the cond
        branch (:func:`join_branches` makes the step of two)."""
        n = x.shape[0]
        probe = probe and not branch
        out = self._call(step, t, x, [torch.arange(n)], None, "text" if probe else None,
                         branch=branch)
        res = FullResult(out.velocity, KVStore(out.k, out.v) if want_kv else None,
                         img_keys=n + self.fixed_tokens, probe_macs=out.probe_macs)
        if out.mass is not None:
            res.text_attn = out.mass[out.pack.txt:]
        return res

    def run_patches(self, step: int, t: float, x: torch.Tensor, patches: list[torch.Tensor],
                    context: KVStore | None, joint: bool = False,
                    measure: bool = True) -> list[PatchResult]:
        if not patches:
            return []
        n = x.shape[0]
        if joint:
            union = torch.cat(patches)
            ctx = None
            if context is not None:  # only the tokens that do not run come from the store
                rest = torch.ones(n, dtype=torch.bool)
                rest[union] = False
                keep = torch.nonzero(rest).flatten()
                ctx = KVStore(context.k[:, :, :, keep], context.v[:, :, :, keep])
            units, mask_own = [union], False
            keys = (n if context is not None else len(union)) + self.fixed_tokens
        else:
            units, ctx, mask_own = patches, context, True
            keys = None
        bounds, off = [], 0
        for p in patches:
            bounds.append(torch.arange(off, off + len(p)))
            off += len(p)
        out = self._call(step, t, x, units, ctx, "groups" if measure else None, bounds,
                         mask_own=mask_own)
        q0 = len(units) * out.pack.txt
        res = []
        for i, (p, rows) in enumerate(zip(patches, bounds)):
            sl = slice(int(rows[0]), int(rows[-1]) + 1)
            mass = float("nan")
            if out.mass is not None:
                mass = float(out.mass[q0 + sl.start : q0 + sl.stop, i].mean())
            k_i = keys if keys is not None else (
                len(p) + self.fixed_tokens + (n - len(p) if context is not None else 0))
            res.append(PatchResult(out.velocity[sl], out.k[:, :, :, sl].clone(),
                                   out.v[:, :, :, sl].clone(), mass, k_i,
                                   out.probe_macs / len(patches)))
        return res

    def probe(self, step: int, t: float, x: torch.Tensor, patches: list[torch.Tensor],
              depth: int | None = None) -> ProbeResult:
        n = x.shape[0]
        out = self._call(step, t, x, [torch.arange(n)], None, "groups", list(patches),
                         depth=depth or len(self.probe_blocks))
        rows = out.mass[out.pack.txt:]
        mass = torch.stack([rows[p, i].sum() for i, p in enumerate(patches)])
        return ProbeResult(mass, n + self.fixed_tokens, out.probe_macs)


# ----------------------------------------------------------------------------- entry points


def grid_coords(grid: int, index: torch.Tensor | None = None) -> torch.Tensor:
    """(row, column) of token indices of a row-major ``grid x grid`` token grid."""
    idx = torch.arange(grid * grid) if index is None else index
    return torch.stack([idx // grid, idx % grid], dim=-1)


def generation_backend(model: MMDiT, txt, txt_uncond, size: int, guidance: float,
                       probe_blocks=None) -> MMDiTRegional:
    grid = size // model.cfg.patch_size
    return MMDiTRegional(model, txt, txt_uncond, guidance,
                         model.image_positions(grid), grid_coords(grid),
                         probe_blocks=probe_blocks)


def generation_state(model: MMDiT, size: int, seed: int, steps: int, cfg: RegionalConfig,
                     backend: MMDiTRegional, salient: torch.Tensor | None = None,
                     patches: int | None = None) -> RegionalState:
    """The state of a regional generation; its latents start as ``sampler.generate``'s."""
    grid = size // model.cfg.patch_size
    x = noise_like((1, grid * grid, model.cfg.patch_dim), seed)[0]
    return RegionalState(cfg, backend.coords, schedule(steps), x, backend.text_tokens,
                         salient, backend.cost, patches)


def latents_to_image(model: MMDiT, x: torch.Tensor, size: int) -> torch.Tensor:
    return unpatchify(x[None], model.cfg.patch_size, model.cfg.in_channels, size).clamp(-1, 1)


def regional_generate(model: MMDiT, txt: torch.Tensor, txt_uncond: torch.Tensor | None,
                      size: int, seed: int, steps: int = 20, guidance: float = 3.0,
                      cfg: RegionalConfig | None = None, salient: torch.Tensor | None = None,
                      probe_blocks=None, timer: dict | None = None
                      ) -> tuple[torch.Tensor, RegionalState]:
    """Full generation with regional execution -> (image ``[1, 3, size, size]``, state).

    With ``cfg.warmup >= steps`` this is ``dit.sampler.generate`` exactly. ``timer``
    (a dict) collects the probes' wall time (``probe_s``).
    """
    cfg = cfg or RegionalConfig()
    backend = generation_backend(model, txt, txt_uncond, size, guidance, probe_blocks)
    state = run_regional(backend, generation_state(model, size, seed, steps, cfg, backend, salient),
                         timer)
    return latents_to_image(model, state.x, size), state


def edit_backend(model: MMDiT, template: Template, geo: Geometry, provider: KVProvider,
                 req: EditRequest, probe_blocks=None) -> MMDiTRegional:
    heads = model.cfg.num_heads

    def fixed(step: int):
        def get(block: int):
            k, v = provider.get(step, block)
            return channels_to_heads(k, heads), channels_to_heads(v, heads)
        return get

    unmasked = len(geo.unmasked)
    return MMDiTRegional(model, req.txt, req.txt_uncond, template.guidance,
                         geo.pos[geo.masked], grid_coords(geo.grid, geo.masked),
                         fixed=fixed if unmasked else None, fixed_tokens=unmasked,
                         probe_blocks=probe_blocks)


def regional_edit(model: MMDiT, template: Template, geo: Geometry, provider: KVProvider,
                  req: EditRequest, cfg: RegionalConfig | None = None,
                  salient: torch.Tensor | None = None, probe_blocks=None,
                  timer: dict | None = None) -> tuple[torch.Tensor, RegionalState]:
    """A cached masked edit whose masked tokens run regionally -> (image ``[3, H, W]``, state).

    The region is the masked tokens; the template cache of the unmasked tokens is appended
    to every call as in ``dit.editing.cached_edit`` (which this equals with
    ``cfg.warmup >= template.steps``). References are not supported here.
    """
    if req.ref_images is not None and len(req.ref_images):
        raise ValueError("regional_edit does not take reference images")
    cfg = cfg or RegionalConfig()
    backend = edit_backend(model, template, geo, provider, req, probe_blocks)
    x = edit_start(model, template, req.seed)[0, geo.masked]
    state = RegionalState(cfg, backend.coords, edit_schedule(template), x, backend.text_tokens,
                          salient, backend.cost)
    run_regional(backend, state, timer)
    return compose(model, template, geo, state.x[None]), state


__all__ = ["MMDiTRegional", "PackHook", "ProbeDone", "edit_backend", "generation_backend",
           "generation_state", "grid_coords", "guided", "join_branches", "latents_to_image",
           "mmdit_macs",
           "mmdit_probe_macs", "regional_edit", "regional_generate"]
