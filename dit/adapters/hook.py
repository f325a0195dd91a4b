"""The one attention hook of the adapter algorithms (``dit.attention``'s joint visibility
rules): the template cache and extra K/V appended, the template run's K/V captured, the
attention mass on cached tokens accumulated for importance profiling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from sakura.dit.attention import CACHE, AttentionHook, KVSegment, Layout, cache_mass
from sakura.dit.cache import KVProvider
from sakura.dit.editing import channels_to_heads, heads_to_channels


class AdapterHook(AttentionHook):
    """The one hook the adapter algorithms use (joint visibility rules of ``dit.attention``).

    Appends ``extra`` segments (references / prefix) and the template cache of ``step`` from
    ``provider`` (keys mapped by ``key_shift``); records K/V of the image tokens at
    ``capture`` rows (template run) or of all computed image tokens (``record``, reference
    extraction); accumulates attention mass of image queries on cached tokens into
    ``importance [blocks, U]``. Extra K/V are cast to the computed tokens' dtype and device.
    """

    def __init__(self, *, heads: int, extra: dict[int, list[KVSegment]] | None = None,
                 provider: KVProvider | None = None, step: int = 0,
                 key_shift: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 capture: torch.Tensor | None = None, record: bool = False,
                 importance: torch.Tensor | None = None):
        super().__init__("joint")
        self.heads, self.extra, self.provider, self.step = heads, extra or {}, provider, step
        self.key_shift, self.capture, self.record = key_shift, capture, record
        self.importance = importance
        self.needs_probs = importance is not None
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._like: torch.Tensor | None = None

    def attend(self, block: int, q, k, v, layout: Layout) -> torch.Tensor:
        self._like = q
        return super().attend(block, q, k, v, layout)

    def on_kv(self, block: int, k, v, layout: Layout) -> None:
        if self.capture is not None:
            idx = layout.txt + self.capture.to(k.device)
            self.keys[block] = heads_to_channels(k[0, :, idx]).float().cpu()
            self.values[block] = heads_to_channels(v[0, :, idx]).float().cpu()
        elif self.record:
            lo, hi = layout.txt, layout.txt + layout.img
            self.keys[block] = k[:, :, lo:hi].clone()
            self.values[block] = v[:, :, lo:hi].clone()

    def extra_kv(self, block: int) -> list[KVSegment]:
        segs = list(self.extra.get(block, []))
        if self.provider is not None:
            k, v = self.provider.get(self.step, block)
            if self.key_shift is not None:
                k = self.key_shift(k)
            segs.append(KVSegment(CACHE, channels_to_heads(k, self.heads),
                                  channels_to_heads(v, self.heads)))
        like = self._like
        if like is None:
            return segs
        return [KVSegment(s.role, s.k.to(like.device, like.dtype), s.v.to(like.device, like.dtype))
                for s in segs]

    def on_probs(self, block: int, probs, q_segs, k_segs) -> None:
        mass = cache_mass(probs, q_segs, k_segs)
        if mass is not None and self.importance is not None:
            self.importance[block] += mass.cpu()
