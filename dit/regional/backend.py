"""What regional execution asks of a model: :class:`RegionalBackend` (the default MMDiT
implements it in ``dit.regional_mmdit``, the diffusers adapters in
``dit.adapters.regional``), the results its calls return, and :class:`KVStore`, the
region's per-block K/V (each token's from its last execution) that patches see as their
stale context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class KVStore:
    """Per-block K/V of the region tokens, each token's from its last execution.

    ``k``/``v`` ``[L, Bc, H, n, D]`` (blocks, guidance branches, heads, tokens, head dim).
    """

    k: torch.Tensor
    v: torch.Tensor

    def write(self, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[:, :, :, idx] = k.to(self.k.dtype)
        self.v[:, :, :, idx] = v.to(self.v.dtype)

    def clone(self) -> KVStore:
        return KVStore(self.k.clone(), self.v.clone())

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass
class FullResult:
    """A whole-region step: guided velocity ``[n, C]``, the K/V of every region token, and
    (when probed) the attention mass of every image query on each text token ``[n, T]``
    (cond branch, mean over heads and probe blocks)."""

    velocity: torch.Tensor
    kv: KVStore | None = None
    text_attn: torch.Tensor | None = None
    img_keys: int = 0  # image keys each query could see (region + template cache)
    probe_macs: float = 0.0  # modelled extra compute of the saliency probe


@dataclass
class PatchResult:
    """One patch's step: velocity ``[n_p, C]``, K/V ``[L, Bc, H, n_p, D]``, and the
    mean attention mass its queries put on its own tokens (``self_mass``, with
    ``img_keys`` image keys visible; NaN when the call did not measure it)."""

    velocity: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    self_mass: float
    img_keys: int
    probe_macs: float = 0.0  # modelled extra compute of measuring self_mass


class ProbeDone(Exception):
    """Raised by a probing attention hook once it has what it needs: the rest of the
    forward is not computed."""


@dataclass
class ProbeResult:
    """A probe of every patch on the current latents: ``mass[p]`` = attention mass the
    queries of patch ``p`` put on its own tokens, summed over the patch's queries (cond
    branch, mean over heads and the probed blocks); ``img_keys`` image keys were visible;
    ``macs`` = the probe's modelled multiply-accumulates."""

    mass: torch.Tensor
    img_keys: int
    macs: float = 0.0

    def lift(self, sizes: list[int]) -> torch.Tensor:
        """Per-patch mean self mass over what uniform attention would give (1 = none)."""
        s = torch.tensor(sizes, dtype=torch.float64)
        return (self.mass.double() / s) / (s / max(1, self.img_keys))


class RegionalBackend(Protocol):
    """What regional execution needs from a model (the default MMDiT and the diffusers
    adapters implement it).

    The region is ``n`` image tokens with ``coords`` ``[n, 2]`` (row, column). Velocities
    are already guided (classifier-free guidance is the backend's business).
    """

    coords: torch.Tensor
    text_tokens: int

    def run_full(self, step: int, t: float, x: torch.Tensor, probe: bool,
                 want_kv: bool) -> FullResult:
        """All region tokens ``x [n, C]`` at timestep ``t``."""
        ...

    def run_patches(self, step: int, t: float, x: torch.Tensor, patches: list[torch.Tensor],
                    context: KVStore | None, joint: bool = False,
                    measure: bool = True) -> list[PatchResult]:
        """The given patches at timestep ``t``; ``x`` holds the whole region.

        ``joint=False``: each patch separately (its tokens + text fresh, ``context`` minus
        its own tokens visible), possibly packed into one call. ``joint=True``: the
        patches together in one call (fresh among themselves, the text computed once,
        ``context`` of the tokens that do not run). ``measure``: report ``self_mass``."""
        ...

    def probe(self, step: int, t: float, x: torch.Tensor, patches: list[torch.Tensor],
              depth: int | None = None) -> ProbeResult:
        """Self-attention importance of every patch on ``x``: every region token fresh
        (cond branch only), the forward stopped after the first ``depth`` probe blocks
        (None: every probe block)."""
        ...

    def cost(self, queries: int, keys: int) -> float:
        """Multiply-accumulates of one call with ``queries`` fresh rows and ``keys`` keys."""
        ...
