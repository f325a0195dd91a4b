"""Template KV caches: what the template run captures and what cached execution consumes.

A :class:`TemplateCache` holds, for every denoising step ``s`` and transformer block ``b``,
the keys and values of the *unmasked* image tokens exactly as the attention consumes them
(after QK-norm and rotary embedding), heads folded into channels, plus per-token importance
(attention mass that masked-region queries put on each cached token, summed over heads and
profiling requests).

Cached execution never touches a ``TemplateCache`` directly: it asks a :class:`KVProvider`
for ``(step, block)``. The codec and the network runtime implement providers that deliver
the cache shard by shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class KVProvider(Protocol):
    """Supplies the cached K/V of the unmasked tokens, in execution order."""

    def get(self, step: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(keys, values)`` for one block of one step, each ``[N, C]``; a streaming
        provider may raise :class:`StepLate` instead (the local fallback)."""
        ...


class StepLate(Exception):  # noqa: N818 - a signal between provider and loop, not an error
    """Raised by a provider's ``get`` when step ``step``'s cache cannot arrive before the
    device could compute that step itself with every token (as ``local`` does: the template
    image and its noise are public catalog data). A loop that can, computes the step so and
    goes on (``dit.editing.cached_edit``); its cache is never asked for again."""

    def __init__(self, step: int) -> None:
        super().__init__(f"step {step} is computed locally")
        self.step = step


class ShardSkipped(StepLate):
    """Raised by a streaming provider's ``get`` for a block whose shard the receive stage
    chose not to fetch (``edge.stale_plan``): the block runs on the K/V it last ran on, if
    they are recent enough (``dit.stale.StaleReuse.get``); else the step is late. A loop
    without stale reuse treats it as :class:`StepLate`."""

    def __init__(self, step: int, block: int) -> None:
        super().__init__(step)
        self.block = block


class StepMemo:
    """A ``KVProvider`` that asks ``inner`` for each (step, block) once and keeps the current
    step's K/V, for models that run the guidance branches one after the other (every branch
    reads the same template cache): a streaming provider sees the execution order it
    expects, each block once per step, and the device holds one step of cache at most."""

    def __init__(self, inner: KVProvider) -> None:
        self.inner = inner
        self.step = -1
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, step: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step != self.step:
            self.step, self.kv = step, {}
        if block not in self.kv:
            self.kv[block] = self.inner.get(step, block)
        return self.kv[block]


@dataclass
class TemplateCache:
    """K/V of unmasked image tokens for every (step, block) of a template run.

    Shapes: ``keys``/``values`` ``[S, B, N, C]`` (C = heads * head_dim),
    ``importance`` ``[S, B, N]`` (non-negative), ``token_index`` ``[N]`` (positions of the
    cached tokens in the image token grid, row-major), ``timesteps`` ``[S]``.
    """

    keys: torch.Tensor
    values: torch.Tensor
    importance: torch.Tensor
    token_index: torch.Tensor
    timesteps: torch.Tensor
    num_heads: int

    @property
    def steps(self) -> int:
        return int(self.keys.shape[0])

    @property
    def blocks(self) -> int:
        return int(self.keys.shape[1])

    @property
    def tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def channels(self) -> int:
        return int(self.keys.shape[3])

    def fp16_bytes(self) -> int:
        """Size of the raw cache (K and V) in FP16."""
        return 2 * self.keys.numel() * 2

    def get(self, step: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[step, block], self.values[step, block]

    def to_fp16_exact(self) -> TemplateCache:
        """The cache exactly as the ``fp16`` policy delivers it (rounded to FP16, used in FP32)."""
        return TemplateCache(
            keys=self.keys.half().float(),
            values=self.values.half().float(),
            importance=self.importance,
            token_index=self.token_index,
            timesteps=self.timesteps,
            num_heads=self.num_heads,
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "keys": self.keys,
            "values": self.values,
            "importance": self.importance,
            "token_index": self.token_index,
            "timesteps": self.timesteps,
            "num_heads": torch.tensor(self.num_heads),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> TemplateCache:
        return cls(
            keys=state["keys"],
            values=state["values"],
            importance=state["importance"],
            token_index=state["token_index"],
            timesteps=state["timesteps"],
            num_heads=int(state["num_heads"]),
        )
