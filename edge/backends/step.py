"""The host steps of a denoising step as graphs: what runs before and after the shard graphs.

With these, a whole masked edit is a chain of compiled graphs that C++ drives without
Python (``sakura.edge.native_runtime``):

* :class:`StepIn` ``(x [1, M, P]) -> img [B, M, D]``: the patch embedding of the latent,
  repeated over the guidance batch (``MMDiT.embed``'s image part);
* the shard graphs (``sakura.edge.backends.shard``) of the step's block groups;
* :class:`StepOut` ``(img [B, M, D], vec_img [B, 1, D], x [1, M, P], dt [1], guidance [1])
  -> x [1, M, P]``: the final layer (``MMDiT.head``), classifier-free guidance
  (``dit.editing._guided``) and the Euler update ``x + dt v``.

What does not depend on the latent is computed once per edit on the host and passed as
inputs: the text tokens after ``txt_in`` and the per-step modulation vectors ``MMDiT.vec(t)``
(functions of the prompt embeddings and of the schedule only), and the RoPE tables.
Layer norms are written as ``mean`` over the last dims of a 4-D view with constant-tensor
scalars, as in the delegable shard graph, so XNNPACK takes them; their eps is the model's
(``MMDiTConfig.layer_norm_eps``), and a model without biases (``bias=False``, the converted
FLUX.2) has ``img_in`` / ``final_mod`` / ``final`` without them, which the graphs take as
they are (``nn.Linear`` with ``bias=None``).

Both graphs export with a dynamic M as well (:func:`step_dynamic_shapes`): one compile
serves every template geometry. For that they slice nothing and reshape with the one
dynamic size as -1 (``edge.backends.shard`` says why): the batch repeat of ``StepIn`` is a
product with ones, the guidance of ``StepOut`` takes the conditional and unconditional
rows by linear maps with one-hot weights. Both are exact (one non-zero term per output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sakura.dit.model import MMDiT
from sakura.edge.backends.shard import free_shape
from torch import nn


def _layer_norm(x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``F.layer_norm`` without affine parameters, from ops XNNPACK lowers."""
    b, t, d = x.shape
    v = x.reshape(free_shape((b, t, 1, d)))
    mu = v.mean(dim=(-2, -1), keepdim=True)
    c = v - mu
    var = (c * c).mean(dim=(-2, -1), keepdim=True)
    return (c * torch.rsqrt(var + eps)).reshape(free_shape((b, t, d)))


class StepIn(nn.Module):
    """``x [1, M, P] -> img [B, M, D]``: the latent's patch embedding for every batch row."""

    def __init__(self, model: MMDiT, batch: int) -> None:
        super().__init__()
        self.img_in = model.img_in
        self.batch = batch
        # the repeat over the batch rows as h * 1 (XNNPACK takes no cat of one tensor twice)
        self.register_buffer("rows", torch.ones(batch, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.img_in(x)
        return h * self.rows if self.batch > 1 else h


class StepOut(nn.Module):
    """Final layer, guidance and the Euler update of one step (see the module docstring)."""

    def __init__(self, model: MMDiT, batch: int) -> None:
        super().__init__()
        self.final_mod = model.final_mod
        self.final = model.final
        self.batch = batch
        # the model's LayerNorm eps (``MMDiTConfig.layer_norm_eps``: 1e-5, FLUX.2's 1e-6)
        self.register_buffer("eps", torch.tensor([model.cfg.layer_norm_eps]),
                             persistent=False)
        self.register_buffer("one", torch.tensor([1.0]), persistent=False)
        # row 0 (conditional) and row 1 (unconditional) of v as one-hot linear maps
        self.register_buffer("cond", torch.tensor([[1.0, 0.0]]), persistent=False)
        self.register_buffer("uncond", torch.tensor([[0.0, 1.0]]), persistent=False)

    def velocity(self, img: torch.Tensor, vec_img: torch.Tensor) -> torch.Tensor:
        """The final layer: ``v [B, M, P]`` of every batch row."""
        mod = self.final_mod(vec_img)
        d = img.shape[-1]
        shift, scale = mod[..., :d], mod[..., d:]
        return self.final(_layer_norm(img, self.eps) * (self.one + scale) + shift)

    def forward(self, img: torch.Tensor, vec_img: torch.Tensor, x: torch.Tensor,
                dt: torch.Tensor, guidance: torch.Tensor) -> torch.Tensor:
        v = self.velocity(img, vec_img)
        if self.batch == 2:  # v_uncond + g (v_cond - v_uncond)
            b, m, p = v.shape
            rows = v.reshape(b, -1).permute(1, 0).contiguous()  # [M*P, 2]
            cond, uncond = F.linear(rows, self.cond), F.linear(rows, self.uncond)
            v = (uncond + guidance * (cond - uncond)).reshape(free_shape((1, m, p)))
        return x + dt * v


def step_dynamic_shapes(tokens: int) -> dict[str, tuple]:
    """``torch.export``'s ``dynamic_shapes`` of the two graphs for any M in ``[1, tokens]``
    (trace them with an example M of at least 2)."""
    from torch.export import Dim

    m = Dim("masked", min=1, max=tokens)
    return {"step_in": ({1: m},), "step_out": ({1: m}, {}, {1: m}, {}, {})}


def step_examples(model: MMDiT, batch: int, tokens: int) -> dict[str, tuple[torch.Tensor, ...]]:
    """Seeded example inputs of the two graphs (for export and checks)."""
    g = torch.Generator().manual_seed(0)
    d, p = model.cfg.hidden_size, model.cfg.patch_dim
    x = torch.randn(1, tokens, p, generator=g)
    return {
        "step_in": (x,),
        "step_out": (torch.randn(batch, tokens, d, generator=g),
                     torch.randn(batch, 1, d, generator=g), x,
                     torch.tensor([-0.05]), torch.tensor([3.0])),
    }
