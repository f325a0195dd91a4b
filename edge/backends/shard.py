"""The pure-tensor shard function: a group of consecutive transformer blocks of one step.

A shard graph takes only tensors, so it can be exported (``torch.export`` -> ExecuTorch,
``torch.onnx.export`` -> QNN) and run by any backend; its inputs and outputs (the fresh
tokens' hidden states, the step's modulation vectors, the RoPE tables, the cached K/V of
every block) and their shapes: ``edge/backends/shard_geometry.py``; the arithmetic pieces
(RoPE, norms, GELU, split linears): ``edge/backends/shard_ops.py``. This module holds
:class:`ShardModule`, the function itself, in its three forms.

The code mirrors ``dit.model.DoubleStreamBlock`` / ``SingleStreamBlock`` with the
``CachedHook`` of ``dit.editing`` (attention over ``[fresh] + [cache]``);
``tests/edge/test_backends.py`` checks that an edit through shard graphs equals
``dit.editing.cached_edit``. References and the text-KV approximation are not part of a
shard graph (they need the torch path).

The model's arithmetic options (``MMDiTConfig``: ``mlp_act``, ``layer_norm_eps``, ``bias``;
the converted FLUX.2 of ``dit.flux2_native``) are computed by every form: the layer norms
at the model's eps (``F.layer_norm``'s argument, the delegable ``ln_eps`` constant);
SwiGLU as ``silu(a) * b`` of the first linear's two halves in the plain form (the model's
own ops), as ``a * sigmoid(a) * b`` of two slices (``_chunks``) in the delegable one
(XNNPACK has no ``silu``) and, in the dynamic form, with the MLP's first linear split into
gate and up linears (``linear1`` into ``[d, d, d, m, m]``) so that nothing dynamic is
sliced; a model without biases has linears with ``bias=None``, which every form takes as
they are. At the defaults every graph has the ops it had: the compiled-artifact keys
change only through the config's digest, which holds an option only off its default.

``delegable=True`` writes the same function with only the operators XNNPACK's partitioner
lowers (ExecuTorch 1.4.1, ``executorch/backends/xnnpack/partition/config``), so that the
whole shard runs inside the delegate (tested with ExecuTorch's delegation info). What the
plain graph uses and the partitioner leaves on the portable CPU kernels, and its
replacement:

* ``layer_norm`` / ``rms_norm`` and their ``mean`` over the last dim of a 3-D tensor: the
  mean as ``mean.dim`` over the last two dims of a 4-D view (the only mean XNNPACK takes);
* ops with a Python scalar (``+ eps``, ``0.044715 * x``): the scalar as a constant tensor;
* ``chunk`` / ``split`` (``split_with_sizes``): slices;
* ``x[..., 0::2]`` of RoPE (stride-2 slices): products with constant 0/+-1 matrices, which
  are exact (one non-zero term per output) and give the same floats as the plain RoPE;
* ``scaled_dot_product_attention`` (decomposed with ``where`` / ``any`` / ``eq`` of its
  "safe" softmax) and the ``expand`` of the cache over the batch: the attention written
  with ``bmm`` and ``softmax``, the cache's scores computed with the heads as the bmm batch
  and the queries of every batch row stacked, so the cache is never expanded.

``dynamic=True`` (always delegable) writes the same function once more so that ONE compiled
graph serves every template geometry of a (model, B, T, block group): it is exported with
the masked tokens M and the cached tokens U as dynamic sizes (:class:`ShardBounds`) and
XNNPACK runs it at any M, U within the bounds. Two things stand in the static form's way:

* ``torch.export`` with a dynamic M fails ("Constraints violated (m)! ... guard
  min(80 + 16*m, 240 + 48*m) == (80 + 16*m)"): a tensor whose token size is ``T + m``
  (the ``cat`` of the text and image queries, or of the text and image rows of a single
  block) viewed with its batch and head dims merged (``q.reshape(b * h, n, d)``) gets the
  stride ``Min(h*n*d, n*d)``; torch's ``Min`` does not simplify affine sizes, so tracing
  records the contiguity check as a guard the constraint solver then cannot prove;
* ExecuTorch 1.4.1's XNNPACK partitioner takes no ``slice_copy`` with a dynamic input or
  output (``SliceCopyConfig``), no ``view_copy`` with a symbolic size or two inferred ones
  (``ViewCopyConfig``) and no ``cat`` whose inputs are one tensor twice (``CatConfig``
  counts distinct inputs), so every ``x[:, :t]`` / ``x[:, t:]`` of a ``T + M`` token axis,
  the ``cos[:t]`` of the RoPE tables and the qkv split of a ``[B, M, 3D]`` tensor would
  leave the delegate.

So in the dynamic form the text and the image tokens are never put on one token axis:
each group (text: T rows, static; image: M rows) is computed on its own (the qkv and
``linear1`` weights split into one linear per output, so nothing is sliced), only the keys
and values are concatenated (``[text, image, cache]``; the cache repeated over the batch
rows by a product with ones, exact) and each group's queries attend over them with one
softmax. Reshapes name the one dynamic size as -1, reshapes after a permute go through
``contiguous()`` (else the decomposition writes the symbolic size into the view). The RoPE
tables of the text tokens are constants of the graph (they depend on the model and T only);
the ``cos`` / ``sin`` inputs hold the M image tokens' rows. With ``block_causal`` attention
the text queries attend to the text keys only (causal), as ``dit.attention.build_mask``
says, which the group split computes without any dynamic mask.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from sakura.dit.attention import CACHE, Layout, build_mask
from sakura.dit.model import MMDiT, merge_heads, modulate, split_heads
from sakura.edge.backends.shard_geometry import (
    OUTPUT_NAMES,
    SHARD_FORMAT,
    ShardBounds,
    ShardGeometry,
    example_inputs,
    expected_shapes,
    input_names,
)
from sakura.edge.backends.shard_ops import (
    _explicit_rms_norm,
    _layer_norm,
    _mean_last,
    _rope,
    _rope_matrices,
    _sigmoid_gelu,
    _split_linear,
    _swiglu,
    free_shape,
)
from torch import nn

__all__ = [
    "OUTPUT_NAMES", "SHARD_FORMAT", "ShardBounds", "ShardGeometry", "ShardModule",
    "example_inputs", "expected_shapes", "free_shape", "input_names",
]


class ShardModule(nn.Module):
    """Blocks ``blocks`` of ``model`` as a function of tensors only (see module docstring)."""

    def __init__(self, model: MMDiT, blocks: tuple[int, ...], geometry: ShardGeometry,
                 explicit_rms: bool = False, sigmoid_gelu: bool = False,
                 delegable: bool = False, dynamic: bool = False, emit_kv: bool = False):
        super().__init__()
        # True: the template pass of the local fallback's recompute step
        # (``dit.editing.RecomputedKV``): no cache inputs, batch 1, and after the text and
        # image outputs every block's image-token K and V ``[M, C]`` (what the template run
        # captures; the device takes the cached rows)
        self.emit_kv = emit_kv
        if emit_kv and (dynamic or geometry.cached or geometry.batch != 1):
            raise ValueError("a K/V-emitting shard graph is static, batch 1, without cache")
        self._emitted: list[torch.Tensor] = []
        self.sigmoid_gelu = sigmoid_gelu
        # True: XNNPACK-lowerable operators only (module docstring); same function
        self.delegable = delegable or dynamic
        # True: the form exported with dynamic M / U (module docstring); ``geometry`` is
        # then the traced example, ``cos`` / ``sin`` hold the image tokens' rows only
        self.dynamic = dynamic
        # False: the model's own RMSNorm (bit-exact with dit); True: see _explicit_rms_norm
        self.explicit_rms = explicit_rms
        cfg = model.cfg
        # the model's arithmetic options (``MMDiTConfig``): the MLP activation (tanh-GELU,
        # or SwiGLU over the two halves of the first linear's output) and LayerNorm eps
        self.swiglu = cfg.mlp_act == "swiglu"
        self.layer_norm_eps = cfg.layer_norm_eps
        if not blocks or list(blocks) != list(range(blocks[0], blocks[0] + len(blocks))):
            raise ValueError(f"a shard is a run of consecutive blocks, got {blocks}")
        if blocks[-1] >= cfg.num_blocks:
            raise ValueError(f"block {blocks[-1]} outside the model's {cfg.num_blocks}")
        self.blocks = tuple(blocks)
        self.geometry = geometry
        self.input_shapes = expected_shapes(model, self.blocks, geometry, dynamic)
        self.heads = cfg.num_heads
        self.num_double = cfg.double_blocks
        self.double_mod_img = model.double_mod_img
        self.double_mod_txt = model.double_mod_txt
        self.single_mod = model.single_mod
        layers = [model.double_stream[b] if b < cfg.double_blocks
                  else model.single_stream[b - cfg.double_blocks] for b in blocks]
        layout = Layout(txt=geometry.txt, img=geometry.img)
        q_segs = layout.query_segments()
        mask = build_mask(cfg.attention_mode, q_segs, q_segs + [(CACHE, geometry.cached)])
        self.has_mask = mask is not None
        if dynamic:
            # the blocks' fused qkv / linear1 weights are not registered: the exported
            # program holds the split linears only
            self.parts = nn.ModuleList(self._dynamic_parts(cfg, b, blk)
                                       for b, blk in zip(self.blocks, layers))
            self._delegable_constants(cfg, None)
            self._dynamic_constants(model, geometry, mask)
            return
        self.layers = nn.ModuleList(layers)
        if mask is not None:
            self.register_buffer("mask", mask, persistent=False)
        if delegable:
            self._delegable_constants(cfg, mask)

    def _delegable_constants(self, cfg, mask: torch.Tensor | None) -> None:
        """Constant tensors of the delegable graph (scalars, RoPE matrices, mask bias)."""
        e, r = _rope_matrices(cfg.head_dim)
        consts = {"rope_e": e.t().contiguous(), "rope_r": r.t().contiguous(),
                  "one": torch.ones(1), "ln_eps": torch.full((1,), cfg.layer_norm_eps),
                  "attn_scale": torch.full((1,), cfg.head_dim ** -0.5),
                  "gelu_c": torch.full((1,), 0.044715),
                  "gelu_k": torch.full((1,), 2.0 * math.sqrt(2.0 / math.pi))}
        eps = {m.eps for m in self.modules() if hasattr(m, "eps")
               and isinstance(getattr(m, "weight", None), nn.Parameter)}
        if len(eps) > 1:
            raise ValueError(f"the delegable graph assumes one RMSNorm eps, got {eps}")
        consts["rms_eps"] = torch.full((1,), eps.pop() if eps else 1e-6)
        if mask is not None:
            consts["mask_bias"] = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        for name, value in consts.items():
            self.register_buffer(name, value, persistent=False)

    def _dynamic_parts(self, cfg, b: int, blk: nn.Module) -> nn.ModuleDict:
        """The modules of block ``b`` the dynamic graph uses (fused weights split)."""
        d, parts = cfg.hidden_size, nn.ModuleDict()
        if b < cfg.double_blocks:
            for s in ("txt", "img"):
                for name, lin in zip("qkv", _split_linear(getattr(blk, f"{s}_qkv"), [d] * 3)):
                    parts[f"{s}_{name}"] = lin
                for name in ("qnorm", "knorm", "proj"):
                    parts[f"{s}_{name}"] = getattr(blk, f"{s}_{name}")
                mlp = getattr(blk, f"{s}_mlp")
                if self.swiglu:  # gate and up as two linears: the [B, M, 2m] is not sliced
                    sizes = self._mlp_sizes(mlp[0].out_features)
                    for name, lin in zip(self._mlp_names(), _split_linear(mlp[0], sizes)):
                        parts[f"{s}_{name}"] = lin
                    parts[f"{s}_mlp_out"] = mlp[2]
                else:
                    parts[f"{s}_mlp"] = mlp
        else:
            sizes = [d, d, d, *self._mlp_sizes(blk.mlp_hidden)]
            names = ("q", "k", "v", *self._mlp_names())
            for name, lin in zip(names, _split_linear(blk.linear1, sizes)):
                parts[name] = lin
            for name in ("qnorm", "knorm", "linear2"):
                parts[name] = getattr(blk, name)
        return parts

    def _dynamic_constants(self, model: MMDiT, geometry: ShardGeometry,
                           mask: torch.Tensor | None) -> None:
        """The text tokens' RoPE tables, the batch repeat of the cache, the text mask."""
        t, hd = geometry.txt, model.cfg.head_dim
        ang = model.angles(model.text_positions(t)).float()
        for name, table in (("txt_cos", ang.cos()), ("txt_sin", ang.sin())):
            self.register_buffer(name, F.linear(table, self.rope_e).reshape(t, 1, hd),
                                 persistent=False)
        self.register_buffer("batch_ones", torch.ones(geometry.batch, 1, 1, 1),
                             persistent=False)
        # Which keys each group's queries see, from the same mask the static graph uses:
        # image queries must see every key; text queries every key or the text keys only.
        self.txt_sees_txt_only = False
        if mask is None:
            return
        txt_rows, img_rows = mask[:t], mask[t:]
        if not bool(img_rows.all()) or bool(txt_rows[:, t:].any()):
            raise ValueError(f"a dynamic shard graph needs image queries that see every key "
                             f"and text queries that see no image key "
                             f"({model.cfg.attention_mode} attention does not)")
        self.txt_sees_txt_only = True
        bias = torch.zeros(t, t).masked_fill(~txt_rows[:, :t], float("-inf"))
        self.register_buffer("txt_bias", bias, persistent=False)

    def _mlp_sizes(self, width: int) -> list[int]:
        """The MLP part (``width`` wide) of a first linear's output as the activation takes
        it: one tensor (GELU), or the SwiGLU halves ``[a, b]``."""
        return [width // 2, width // 2] if self.swiglu else [width]

    def _mlp_names(self) -> tuple[str, ...]:
        """The dynamic form's linears of those parts (``_mlp_sizes``)."""
        return ("mlp_gate", "mlp_up") if self.swiglu else ("mlp_in",)

    def _act(self, *parts: torch.Tensor) -> torch.Tensor:
        """The MLP activation of the first linear's output parts (``_mlp_sizes``)."""
        if self.swiglu:
            return _swiglu(*parts, explicit=self.delegable)
        return self._gelu(*parts)

    def _mlp(self, mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """A double block's ``Linear -> activation -> Linear``."""
        x = mlp[0](h)
        parts = self._split(x, self._mlp_sizes(x.shape[-1])) if self.swiglu else [x]
        return mlp[2](self._act(*parts))

    def _gelu(self, x: torch.Tensor) -> torch.Tensor:
        if self.delegable:  # tanh-GELU as x * sigmoid(2y), constants as tensors
            y = x + self.gelu_c * x * x * x
            return x * torch.sigmoid(self.gelu_k * y)
        return _sigmoid_gelu(x) if self.sigmoid_gelu else F.gelu(x, approximate="tanh")

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.delegable:
            return x * torch.rsqrt(_mean_last(x * x) + self.rms_eps) * norm.weight
        return _explicit_rms_norm(norm, x) if self.explicit_rms else norm(x)

    def _layer_norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.delegable:
            xc = x - _mean_last(x)
            return xc * torch.rsqrt(_mean_last(xc * xc) + self.ln_eps)
        return _layer_norm(x, self.layer_norm_eps)

    def _modulate(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor
                  ) -> torch.Tensor:
        if self.delegable:
            return x * (scale + self.one) + shift
        return modulate(x, shift, scale)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not self.delegable:
            return _rope(x, cos, sin)
        # x * cos + rot(x) * sin with rot(x1, x2) = (-x2, x1): the plain RoPE's floats
        shape = x.shape
        rot = F.linear(x.reshape(-1, shape[-1]), self.rope_r).reshape(shape)
        return x * F.linear(cos, self.rope_e) + rot * F.linear(sin, self.rope_e)

    @staticmethod
    def _chunks(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """``x.split(sizes, -1)`` as plain slices (XNNPACK has no split)."""
        out, start = [], 0
        for n in sizes:
            out.append(x[..., start:start + n])
            start += n
        return out

    def _split(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return self._chunks(x, sizes) if self.delegable else list(x.split(sizes, dim=-1))

    def _attend_delegable(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        """Attention over ``[fresh] + [cache]`` with bmm/softmax only (no expand)."""
        b, h, n, d = q.shape
        if k_cache is None:  # a graph without cache (full edits)
            s = torch.bmm((q * self.attn_scale).reshape(b * h, n, d),
                          k.reshape(b * h, n, d).transpose(1, 2))
            if self.has_mask:
                s = s + self.mask_bias
            out = torch.bmm(torch.softmax(s, dim=-1), v.reshape(b * h, n, d))
            return merge_heads(out.reshape(b, h, n, d))
        u = k_cache.shape[0]
        q = q * self.attn_scale
        kc = k_cache.reshape(u, h, d).permute(1, 0, 2)        # [H, U, d]
        vc = v_cache.reshape(u, h, d).permute(1, 0, 2)
        qf = q.reshape(b * h, n, d)
        qh = q.permute(1, 0, 2, 3).reshape(h, b * n, d)       # every batch row's queries
        s_fresh = torch.bmm(qf, k.reshape(b * h, n, d).transpose(1, 2))
        s_cache = torch.bmm(qh, kc.transpose(1, 2))           # [H, B*N, U]
        s_cache = s_cache.reshape(h, b, n, u).permute(1, 0, 2, 3).reshape(b * h, n, u)
        s = torch.cat([s_fresh, s_cache], dim=-1)
        if self.has_mask:
            s = s + self.mask_bias
        p = torch.softmax(s, dim=-1)
        out = torch.bmm(p[..., :n], v.reshape(b * h, n, d))
        pc = p[..., n:].reshape(b, h, n, u).permute(1, 0, 2, 3).reshape(h, b * n, u)
        oc = torch.bmm(pc, vc).reshape(h, b, n, d).permute(1, 0, 2, 3)
        return merge_heads(out.reshape(b, h, n, d) + oc)

    def _attend(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        if self.delegable:
            return self._attend_delegable(q, k, v, k_cache, v_cache)
        b = q.shape[0]
        if k_cache is not None:
            kc = split_heads(k_cache[None], self.heads).expand(b, -1, -1, -1)
            vc = split_heads(v_cache[None], self.heads).expand(b, -1, -1, -1)
            k = torch.cat([k, kc], dim=2)
            v = torch.cat([v, vc], dim=2)
        mask = self.mask if self.has_mask else None
        return merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))

    def _emit(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep one block's image K and V ``[1, H, M, d]`` as ``[M, H*d]`` outputs."""
        for x in (k, v):
            _, h, m, d = x.shape
            self._emitted.append(x.permute(0, 2, 1, 3).contiguous().reshape(m, h * d))

    def _double(self, blk, txt, img, mods, cos, sin, k_cache, v_cache):
        t = txt.shape[1]
        qs, ks, vs = [], [], []
        for name, x in (("txt", txt), ("img", img)):
            mod = mods[name]
            h = self._modulate(self._layer_norm(x), mod[0], mod[1])
            d = h.shape[-1]
            q, k, v = self._split(getattr(blk, f"{name}_qkv")(h), [d, d, d])
            sl = slice(0, t) if name == "txt" else slice(t, None)
            q = self._rope(self._norm(getattr(blk, f"{name}_qnorm"),
                                      split_heads(q, self.heads)), cos[sl], sin[sl])
            k = self._rope(self._norm(getattr(blk, f"{name}_knorm"),
                                      split_heads(k, self.heads)), cos[sl], sin[sl])
            qs.append(q)
            ks.append(k)
            vs.append(split_heads(v, self.heads))
        if self.emit_kv:
            self._emit(ks[1], vs[1])
        out = self._attend(torch.cat(qs, 2), torch.cat(ks, 2), torch.cat(vs, 2),
                           k_cache, v_cache)
        new = []
        for name, x, attn in (("txt", txt, out[:, :t]), ("img", img, out[:, t:])):
            mod = mods[name]
            x = x + mod[2] * getattr(blk, f"{name}_proj")(attn)
            h = self._modulate(self._layer_norm(x), mod[3], mod[4])
            new.append(x + mod[5] * self._mlp(getattr(blk, f"{name}_mlp"), h))
        return new[0], new[1]

    def _single(self, blk, txt, img, mods, cos, sin, k_cache, v_cache):
        t = txt.shape[1]
        h = torch.cat([
            self._modulate(self._layer_norm(txt), mods["txt"][0], mods["txt"][1]),
            self._modulate(self._layer_norm(img), mods["img"][0], mods["img"][1])], dim=1)
        d = h.shape[-1]
        q, k, v, *mlp_in = self._split(blk.linear1(h), [d, d, d,
                                                        *self._mlp_sizes(blk.mlp_hidden)])
        q = self._rope(self._norm(blk.qnorm, split_heads(q, self.heads)), cos, sin)
        k = self._rope(self._norm(blk.knorm, split_heads(k, self.heads)), cos, sin)
        if self.emit_kv:
            self._emit(k[:, :, t:], split_heads(v, self.heads)[:, :, t:])
        attn = self._attend(q, k, split_heads(v, self.heads), k_cache, v_cache)
        out = blk.linear2(torch.cat([attn, self._act(*mlp_in)], dim=-1))
        return txt + mods["txt"][2] * out[:, :t], img + mods["img"][2] * out[:, t:]

    # -- the dynamic form (module docstring): text and image tokens as separate groups --

    def _token_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, n, H*d] -> [B, n, H, d]`` (a view)."""
        b, n, c = x.shape
        return x.reshape(free_shape((b, n, self.heads, c // self.heads)))

    def _batch_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, n, H, d] -> [B*H, n, d]``, the bmm batch of the attention."""
        b, n, h, d = x.shape
        return x.permute(0, 2, 1, 3).contiguous().reshape(free_shape((b * h, n, d)))

    def _merge_batch_heads(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        """``[B*H, n, d] -> [B, n, H*d]``."""
        bh, n, d = x.shape
        h = bh // batch
        x = x.reshape(free_shape((batch, h, n, d))).permute(0, 2, 1, 3).contiguous()
        return x.reshape(free_shape((batch, n, h * d)))

    def _cache_heads(self, c: torch.Tensor, batch: int) -> torch.Tensor:
        """Cached K or V ``[U, H*d] -> [B*H, U, d]``, the same rows for every batch row."""
        u, dim = c.shape
        x = c.reshape(free_shape((1, u, self.heads, dim // self.heads)))
        return self._batch_heads(x * self.batch_ones if batch > 1 else x)

    def _rope_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> torch.Tensor:
        """RoPE of ``x [B, n, H, d]`` with tables ``[n, 1, d]`` (see ``_rope``)."""
        rot = F.linear(x.reshape(-1, x.shape[-1]), self.rope_r).reshape(free_shape(x.shape))
        return x * cos + rot * sin

    def _qk(self, lin, norm, h, tables) -> torch.Tensor:
        return self._batch_heads(self._rope_rows(self._norm(norm, self._token_heads(lin(h))),
                                                 *tables))

    def _attend_groups(self, q: dict, k: dict, v: dict, k_cache, v_cache) -> dict:
        """Each group's queries ``[B*H, n, d]`` over the keys ``[text, image, cache]``."""
        keys = [k["txt"], k["img"]] + ([k_cache] if k_cache is not None else [])
        values = [v["txt"], v["img"]] + ([v_cache] if v_cache is not None else [])
        keys_t = torch.cat(keys, dim=1).transpose(1, 2)
        values = torch.cat(values, dim=1)
        out = {}
        for g in ("txt", "img"):
            qs = q[g] * self.attn_scale
            if g == "txt" and self.txt_sees_txt_only:  # block_causal: causal text prefix
                s = torch.bmm(qs, k["txt"].transpose(1, 2)) + self.txt_bias
                out[g] = torch.bmm(torch.softmax(s, dim=-1), v["txt"])
            else:
                out[g] = torch.bmm(torch.softmax(torch.bmm(qs, keys_t), dim=-1), values)
        return out

    def _double_groups(self, parts, x: dict, mods: dict, tables: dict, k_cache, v_cache
                       ) -> dict:
        batch = x["txt"].shape[0]
        q, k, v = {}, {}, {}
        for g in ("txt", "img"):
            mod = mods[g]
            h = self._modulate(self._layer_norm(x[g]), mod[0], mod[1])
            q[g] = self._qk(parts[f"{g}_q"], parts[f"{g}_qnorm"], h, tables[g])
            k[g] = self._qk(parts[f"{g}_k"], parts[f"{g}_knorm"], h, tables[g])
            v[g] = self._batch_heads(self._token_heads(parts[f"{g}_v"](h)))
        attn = self._attend_groups(q, k, v, k_cache, v_cache)
        new = {}
        for g in ("txt", "img"):
            mod = mods[g]
            y = x[g] + mod[2] * parts[f"{g}_proj"](self._merge_batch_heads(attn[g], batch))
            h = self._modulate(self._layer_norm(y), mod[3], mod[4])
            if self.swiglu:
                mlp = self._act(parts[f"{g}_mlp_gate"](h), parts[f"{g}_mlp_up"](h))
                new[g] = y + mod[5] * parts[f"{g}_mlp_out"](mlp)
            else:
                mlp = parts[f"{g}_mlp"]
                new[g] = y + mod[5] * mlp[2](self._gelu(mlp[0](h)))
        return new

    def _single_groups(self, parts, x: dict, mods: dict, tables: dict, k_cache, v_cache
                       ) -> dict:
        batch = x["txt"].shape[0]
        q, k, v, mlp_in = {}, {}, {}, {}
        for g in ("txt", "img"):
            h = self._modulate(self._layer_norm(x[g]), mods[g][0], mods[g][1])
            q[g] = self._qk(parts["q"], parts["qnorm"], h, tables[g])
            k[g] = self._qk(parts["k"], parts["knorm"], h, tables[g])
            v[g] = self._batch_heads(self._token_heads(parts["v"](h)))
            mlp_in[g] = [parts[name](h) for name in self._mlp_names()]
        attn = self._attend_groups(q, k, v, k_cache, v_cache)
        return {g: x[g] + mods[g][2] * parts["linear2"](torch.cat(
                    [self._merge_batch_heads(attn[g], batch), self._act(*mlp_in[g])], dim=-1))
                for g in ("txt", "img")}

    def _forward_dynamic(self, txt, img, vec_txt, vec_img, cos, sin, kv):
        hd = self.rope_e.shape[0]
        tables = {"txt": (self.txt_cos, self.txt_sin),
                  "img": tuple(F.linear(t, self.rope_e).reshape(free_shape((t.shape[0], 1, hd)))
                               for t in (cos, sin))}
        x, batch, d = {"txt": txt, "img": img}, txt.shape[0], vec_txt.shape[-1]
        dmods = smods = None
        for i, (b, parts) in enumerate(zip(self.blocks, self.parts)):
            k_cache, v_cache = ((self._cache_heads(kv[2 * i], batch),
                                 self._cache_heads(kv[2 * i + 1], batch)) if kv
                                else (None, None))
            if b < self.num_double:
                if dmods is None:
                    dmods = {"txt": self._split(self.double_mod_txt(vec_txt), [d] * 6),
                             "img": self._split(self.double_mod_img(vec_img), [d] * 6)}
                x = self._double_groups(parts, x, dmods, tables, k_cache, v_cache)
            else:
                if smods is None:
                    smods = {"txt": self._split(self.single_mod(vec_txt), [d] * 3),
                             "img": self._split(self.single_mod(vec_img), [d] * 3)}
                x = self._single_groups(parts, x, smods, tables, k_cache, v_cache)
        return x["txt"], x["img"]

    def forward(self, txt: torch.Tensor, img: torch.Tensor, vec_txt: torch.Tensor,
                vec_img: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                *kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.dynamic:
            return self._forward_dynamic(txt, img, vec_txt, vec_img, cos, sin, kv)
        self._emitted = []
        dmods = smods = None
        for i, (b, blk) in enumerate(zip(self.blocks, self.layers)):
            # geometry.cached == 0: the whole model on every token, no cache inputs
            k_cache, v_cache = (kv[2 * i], kv[2 * i + 1]) if kv else (None, None)
            if b < self.num_double:
                if dmods is None:
                    d = vec_txt.shape[-1]
                    dmods = {"txt": self._split(self.double_mod_txt(vec_txt), [d] * 6),
                             "img": self._split(self.double_mod_img(vec_img), [d] * 6)}
                txt, img = self._double(blk, txt, img, dmods, cos, sin, k_cache, v_cache)
            else:
                if smods is None:
                    d = vec_txt.shape[-1]
                    smods = {"txt": self._split(self.single_mod(vec_txt), [d] * 3),
                             "img": self._split(self.single_mod(vec_img), [d] * 3)}
                txt, img = self._single(blk, txt, img, smods, cos, sin, k_cache, v_cache)
        if self.emit_kv:
            emitted, self._emitted = self._emitted, []
            return (txt, img, *emitted)
        return txt, img
