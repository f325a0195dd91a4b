"""What a shard graph takes and gives: its shapes, input names and example inputs.

A shard graph takes only tensors, so it can be exported (``torch.export`` -> ExecuTorch,
``torch.onnx.export`` -> QNN) and run by any backend:

* ``txt [B, T, D]``, ``img [B, M, D]``: hidden states of the fresh tokens (text and masked
  image tokens) entering the shard's first block;
* ``vec_txt``, ``vec_img [B, 1, D]``: the step's modulation vectors (``MMDiT.vec(t)``); the
  shared modulation projections are part of the graph;
* ``cos``, ``sin [T + M, head_dim / 2]``: the RoPE angles of the fresh tokens, as cosine and
  sine (precomputed on the host: cos/sin of angles up to ~16 rad lose too much in fp16);
* ``k_<b>``, ``v_<b> [U, C]`` for every block ``b`` of the shard: the cached K/V of the
  unmasked template tokens, heads folded into channels, exactly as the pack delivers them.

Outputs: ``txt``, ``img`` after the shard's last block.

One graph serves every step: the step enters only through ``vec_*`` and the cache, so a
graph is compiled once per (template geometry, block group).

:class:`ShardGeometry` is the static shapes a graph is compiled for, :class:`ShardBounds` the
shapes one dynamic graph serves (``ShardModule(..., dynamic=True)``, ``edge/backends/shard.py``);
:func:`input_names`, :func:`expected_shapes` and :func:`example_inputs` spell the inputs out
in order. :data:`SHARD_FORMAT` is part of the compiled-artifact cache key.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from sakura.dit.model import MMDiT

# Bump when the graph's computation or its input/output contract changes: it is part of
# the compiled-artifact cache key.
SHARD_FORMAT = 1


@dataclass(frozen=True)
class ShardGeometry:
    """The static shapes a shard graph is compiled for."""

    batch: int   # 2 with classifier-free guidance, else 1
    txt: int     # fresh text tokens
    img: int     # fresh (masked) image tokens
    cached: int  # cached (unmasked) template tokens; 0: a graph with no cache inputs

    def describe(self) -> str:
        return f"b{self.batch}-t{self.txt}-m{self.img}-u{self.cached}"

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class ShardBounds:
    """The shapes one dynamic shard graph serves (``ShardModule(..., dynamic=True)``).

    Any split of the ``tokens`` image tokens into M masked and U cached ones with
    ``1 <= M, U <= tokens - 1`` (the edit with nothing cached, M = tokens, has no cache
    inputs and keeps its static graph). ExecuTorch plans memory for the upper bounds.
    """

    batch: int
    txt: int
    tokens: int  # N, the template's image tokens (M + U = N)

    def __post_init__(self) -> None:
        if self.batch < 1 or self.txt < 1 or self.tokens < 3:
            raise ValueError(f"bounds need batch, txt >= 1 and tokens >= 3, got {self}")

    def describe(self) -> str:
        return f"b{self.batch}-t{self.txt}-n{self.tokens}-dynamic"

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def example(self) -> ShardGeometry:
        """The geometry traced at export: sizes inside the bounds, not 0 or 1 (which torch
        would specialize on) and different from each other."""
        m = max(2, self.tokens // 5)
        u = self.tokens - m
        if u == m:
            m, u = m - 1, u + 1
        return ShardGeometry(self.batch, self.txt, m, u)

    def contains(self, geometry: ShardGeometry) -> bool:
        return (geometry.batch == self.batch and geometry.txt == self.txt
                and 1 <= geometry.img < self.tokens and 1 <= geometry.cached < self.tokens)

    def dynamic_shapes(self, blocks: tuple[int, ...]) -> tuple:
        """``torch.export``'s ``dynamic_shapes`` for the graph's inputs (same order)."""
        from torch.export import Dim

        m = Dim("masked", min=1, max=self.tokens - 1)
        u = Dim("cached", min=1, max=self.tokens - 1)
        return ({}, {1: m}, {}, {}, {0: m}, {0: m}, tuple({0: u} for _ in range(2 * len(blocks))))


def input_names(blocks: tuple[int, ...]) -> list[str]:
    names = ["txt", "img", "vec_txt", "vec_img", "cos", "sin"]
    for b in blocks:
        names += [f"k_{b}", f"v_{b}"]
    return names


OUTPUT_NAMES = ["txt_out", "img_out"]


def example_inputs(model: MMDiT, blocks: tuple[int, ...], geometry: ShardGeometry,
                   seed: int = 0, dynamic: bool = False) -> tuple[torch.Tensor, ...]:
    """Seeded random inputs of the graph's shapes (for export, checks and the bench);
    ``dynamic``: the RoPE tables of the image tokens only (``ShardModule(dynamic=True)``)."""
    g = torch.Generator().manual_seed(seed)
    d, hd = model.cfg.hidden_size, model.cfg.head_dim
    b, t, m, u = geometry.batch, geometry.txt, geometry.img, geometry.cached
    ang = torch.rand(m if dynamic else t + m, hd // 2, generator=g) * 6.0
    args = [torch.randn(b, t, d, generator=g), torch.randn(b, m, d, generator=g),
            torch.randn(b, 1, d, generator=g), torch.randn(b, 1, d, generator=g),
            ang.cos(), ang.sin()]
    for _ in blocks if u else ():  # no cache inputs when nothing is cached
        args += [torch.randn(u, d, generator=g), torch.randn(u, d, generator=g)]
    return tuple(args)


def expected_shapes(model: MMDiT, blocks: tuple[int, ...], geometry: ShardGeometry,
                    dynamic: bool = False) -> list[tuple[int, ...]]:
    d, hd = model.cfg.hidden_size, model.cfg.head_dim
    b, t, m, u = geometry.batch, geometry.txt, geometry.img, geometry.cached
    rope = (m if dynamic else t + m, hd // 2)
    shapes = [(b, t, d), (b, m, d), (b, 1, d), (b, 1, d), rope, rope]
    return shapes + [(u, d)] * (2 * len(blocks) if u else 0)
