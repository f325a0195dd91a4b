"""Shard and step graphs of a converted-form MMDiT: SwiGLU MLPs, LayerNorm eps 1e-6, no
biases, FLUX position ids (the options ``dit.flux2_native`` converts the trained FLUX.2
into).

Every form of ``ShardModule`` (plain, delegable, dynamic) computes what the MMDiT's own
blocks compute with the template cache appended through ``CachedHook`` (as
``dit.editing.cached_edit`` runs them), ``StepIn`` / ``StepOut`` what ``MMDiT.embed`` /
``MMDiT.head`` compute, and the delegable and dynamic graphs lower fully to XNNPACK
(ExecuTorch's delegation info) and run in ``executorch.runtime`` with the torch outputs.
The committed trained FLUX.2 (``dit/weights/sakura-flux2`` through ``dit.flux2_native``)
runs in every form too. Inputs are built the way the host builds them, from
``MMDiT.image_positions`` / ``text_positions``; a whole edit through the shard graphs
(``ShardExecutor``) equals ``cached_edit``, as ``test_backends.py`` checks it for the
shipped model.
The shipped model's graphs are checked by ``test_backends.py`` / ``test_backends_dynamic.py``.
"""

from __future__ import annotations

import pytest
import torch
from sakura.dit.attention import Layout, PlainAttention
from sakura.dit.editing import CachedHook
from sakura.dit.model import MMDiT, MMDiTConfig, Segments, TokenBatch
from sakura.edge.backends.shard import (
    ShardBounds,
    ShardGeometry,
    ShardModule,
    example_inputs,
)
from sakura.edge.backends.step import StepIn, StepOut

from tests.edge.helpers import check_dynamic_step_graphs

BATCH, TXT, GRID = 2, 5, 8          # N = 64 image tokens
GROUPS = [(0, 1), (2, 3), (1, 2), (0, 1, 2, 3)]
FORMS = {"plain": {}, "plain-sigmoid-gelu": {"sigmoid_gelu": True},
         "delegable": {"sigmoid_gelu": True, "delegable": True}, "dynamic": {"dynamic": True}}
# The plain forms are the model's own ops: equal bit for bit (measured 0.0). The delegable
# and dynamic forms: float32 summation order and a * sigmoid(a) for silu(a); measured max
# abs error 1.3e-6 on outputs up to 3.8.
BOUND = 1e-5
PTE_BOUND = 1e-4  # ExecuTorch / XNNPACK fp32, as test_backends_dynamic.py bounds it


def swiglu_model(seed: int = 0, **overrides) -> MMDiT:
    """A tiny seeded MMDiT with FLUX.2's options (and whatever ``overrides`` change)."""
    torch.manual_seed(seed)
    opts = dict(hidden_size=48, num_heads=3, double_blocks=2, single_blocks=2,
                mlp_ratio=2.0, text_dim=32, text_tokens=TXT, rope_axes=(4, 4, 4, 4),
                mlp_act="swiglu", layer_norm_eps=1e-6, bias=False, positions="flux_ids")
    model = MMDiT(MMDiTConfig(**{**opts, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.08)
            else:  # the RMS QK-norm weights (there are no biases)
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def model() -> MMDiT:
    m = swiglu_model()
    assert all(lin.bias is None for lin in (m.img_in, m.txt_in, m.final, m.final_mod))
    assert m.single_stream[0].mlp_hidden == 2 * 96
    return m


def hidden(n: int, d: int, g: torch.Generator) -> torch.Tensor:
    """Hidden states ``[B, n, d]`` whose tokens have variances from 1e-6 to 1: LayerNorm's
    eps (1e-6 vs torch's 1e-5) changes the low-variance tokens' outputs by up to ~1.0."""
    scale = 10.0 ** (-3.0 * torch.rand(BATCH, n, 1, generator=g))
    return torch.randn(BATCH, n, d, generator=g) * scale


class Cache:
    """A ``KVProvider`` of fixed K/V ``[U, C]`` per block (one step)."""

    def __init__(self, kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv = kv

    def get(self, step: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[block]


def case(model: MMDiT, masked: int, seed: int, txt: int = TXT):
    """Inputs of one shard call at a (M, U) split of the 8x8 grid, and the model's own
    positions: ``(x, masked rows' positions, kv per block)``."""
    g = torch.Generator().manual_seed(seed)
    d = model.cfg.hidden_size
    order = torch.randperm(GRID * GRID, generator=g)
    pos = model.image_positions(GRID)[order[:masked]]
    x = {"txt": hidden(txt, d, g), "img": hidden(masked, d, g),
         "vec": torch.randn(BATCH, 1, d, generator=g)}
    u = GRID * GRID - masked
    kv = {b: (torch.randn(u, d, generator=g), torch.randn(u, d, generator=g))
          for b in range(model.cfg.num_blocks)}
    return x, pos, kv


class Capture(PlainAttention):
    """Plain attention (nothing cached) keeping every block's image K and V ``[M, C]``."""

    def __init__(self, mode: str) -> None:
        super().__init__(mode)
        self.kv: dict[int, list[torch.Tensor]] = {}

    def on_kv(self, block: int, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> None:
        self.kv[block] = [t[:, :, layout.txt:].permute(0, 2, 1, 3).reshape(layout.img, -1)
                          for t in (k, v)]


def reference(model: MMDiT, blocks: tuple[int, ...], x: dict, pos: torch.Tensor,
              kv: dict | None, hook=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MMDiT's own blocks on ``[text, masked image]`` with the cache appended by the
    ``CachedHook`` (``kv=None``: ``hook``, or plain attention)."""
    cfg, txt = model.cfg, x["txt"].shape[1]
    empty = x["img"][:, :0]
    seg = Segments(x["txt"], x["img"], empty, x["vec"], x["vec"], x["vec"])
    angles = {"txt": model.angles(model.text_positions(txt)), "img": model.angles(pos),
              "ref": model.angles(torch.zeros(0, len(cfg.rope_axes)))}
    if kv is not None:
        hook = CachedHook(cfg.attention_mode, Cache(kv), 0, cfg.num_heads)
    hook = hook or PlainAttention(cfg.attention_mode)
    layout = Layout(txt=txt, img=x["img"].shape[1])
    with torch.no_grad():
        out = model.run_blocks(seg, angles, hook, layout, range(blocks[0], blocks[-1] + 1))
    return out.txt, out.img


def shard_args(model: MMDiT, blocks, x: dict, pos: torch.Tensor, kv: dict | None,
               dynamic: bool = False) -> tuple[torch.Tensor, ...]:
    """The graph's inputs as the host computes them (``ShardExecutor`` /
    ``NativeEngine.inputs``): cos / sin of the text and image rows (image rows only for
    the dynamic form), every block's cached K and V."""
    ang = model.angles(pos)
    if not dynamic:
        ang = torch.cat([model.angles(model.text_positions(x["txt"].shape[1])), ang])
    cache = [t for b in blocks for t in kv[b]] if kv is not None else []
    return (x["txt"], x["img"], x["vec"], x["vec"], ang.cos(), ang.sin(), *cache)


def max_err(got, want) -> float:
    assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want]
    return max(float((g - w).abs().max()) for g, w in zip(got, want))


@pytest.mark.parametrize("form", list(FORMS))
def test_every_shard_form_equals_the_models_blocks_with_the_cache_hook(model, form):
    for i, (m, blocks) in enumerate([(m, b) for m in (1, 23, 63) for b in GROUPS]):
        x, pos, kv = case(model, m, seed=i)
        geometry = ShardGeometry(BATCH, TXT, m, GRID * GRID - m)
        kw = FORMS[form]
        if kw.get("dynamic"):  # one graph for every (M, U): built at another geometry
            geometry = ShardBounds(BATCH, TXT, GRID * GRID).example()
        shard = ShardModule(model, blocks, geometry, **kw).eval()
        want = reference(model, blocks, x, pos, kv)
        with torch.no_grad():
            got = shard(*shard_args(model, blocks, x, pos, kv, dynamic=form == "dynamic"))
        err = max_err(got, want)
        if form.startswith("plain"):
            assert err == 0.0, (form, m, blocks, err)
        assert err < BOUND, (form, m, blocks, err)


@pytest.mark.parametrize("form", ["plain", "delegable"])
def test_shards_without_cache_and_their_emitted_kv(model, form):
    """The full edit's graphs (nothing cached) and the template pass's K/V outputs
    (``emit_kv``: every block's image K and V ``[M, C]``, as the hook sees them)."""
    n = GRID * GRID
    x, pos, _kv = case(model, n, seed=99)
    x = {k: v[:1] for k, v in x.items()}  # the template pass: batch 1
    for blocks in GROUPS:
        shard = ShardModule(model, blocks, ShardGeometry(1, TXT, n, 0), emit_kv=True,
                            **FORMS[form]).eval()
        capture = Capture(model.cfg.attention_mode)
        want = reference(model, blocks, x, pos, None, capture)
        with torch.no_grad():
            got = shard(*shard_args(model, blocks, x, pos, None))
        err = max_err(got, [*want, *(t for b in blocks for t in capture.kv[b])])
        if form == "plain":
            assert err == 0.0, (blocks, err)
        assert err < BOUND, (form, blocks, err)


def test_the_options_are_what_the_shards_compute(model):
    """The checks above fail on a graph with the shipped arithmetic: the same weights with
    LayerNorm eps 1e-5 give other outputs (and a SwiGLU's MLP is not a GELU's)."""
    other = swiglu_model(layer_norm_eps=1e-5)
    other.load_state_dict(model.state_dict())
    x, pos, kv = case(model, 23, seed=5)
    blocks = (0, 1, 2, 3)
    want = reference(model, blocks, x, pos, kv)
    geometry = ShardGeometry(BATCH, TXT, 23, GRID * GRID - 23)
    with torch.no_grad():
        got = ShardModule(other, blocks, geometry).eval()(
            *shard_args(model, blocks, x, pos, kv))
    assert max_err(got, want) > 100 * BOUND
    # the text tokens' RoPE constants of the dynamic form are FLUX's (0, 0, 0, index)
    dyn = ShardModule(model, (0,), ShardBounds(BATCH, TXT, 64).example(), dynamic=True)
    ang = model.angles(model.text_positions(TXT))
    assert float(ang[:, -2:].abs().max()) > 1.0  # the text index axis rotates
    assert torch.equal(dyn.txt_cos[:, 0, 0::2], ang.cos())
    assert torch.equal(dyn.txt_sin[:, 0, 1::2], ang.sin())
    # the dynamic form slices nothing: SwiGLU's gate and up are linears of their own
    assert {"mlp_gate", "mlp_up"} <= set(ShardModule(model, (2,), ShardBounds(
        BATCH, TXT, 64).example(), dynamic=True).parts[0])


def test_the_converted_flux2_runs_in_every_form():
    """The committed FLUX.2 weights in the MMDiT form (``dit.flux2_native``): all 8 blocks
    as one shard of every form, 16 text tokens (~5 s)."""
    from sakura.dit.flux2_native import mmdit_form
    from sakura.dit.flux2_pixel import load_flux2

    flux2 = mmdit_form(load_flux2())
    txt, blocks = flux2.cfg.text_tokens, tuple(range(flux2.cfg.num_blocks))
    for form, kw in FORMS.items():
        for i, m in enumerate((1, 23, 63)):
            x, pos, kv = case(flux2, m, seed=40 + i, txt=txt)
            geometry = ShardGeometry(BATCH, txt, m, GRID * GRID - m)
            if kw.get("dynamic"):
                geometry = ShardBounds(BATCH, txt, GRID * GRID).example()
            with torch.no_grad():
                got = ShardModule(flux2, blocks, geometry, **kw).eval()(
                    *shard_args(flux2, blocks, x, pos, kv, dynamic=form == "dynamic"))
            err = max_err(got, reference(flux2, blocks, x, pos, kv))
            if form.startswith("plain"):
                assert err == 0.0, (form, m, err)
            assert err < 5e-5, (form, m, err)  # measured 5.7e-6 on outputs up to 8.4


def test_step_graphs_equal_the_models_embed_and_head(model):
    g = torch.Generator().manual_seed(3)
    d, p, m = model.cfg.hidden_size, model.cfg.patch_dim, 13
    x = torch.randn(1, m, p, generator=g)
    t = torch.tensor([0.7])
    txt = torch.randn(1, TXT, model.cfg.text_dim, generator=g)
    with torch.no_grad():
        seg = model.embed(TokenBatch(img=x, img_pos=model.image_positions(GRID)[:m],
                                     txt=txt, t=t))
        assert torch.equal(StepIn(model, 1).eval()(x), seg.img)
        assert torch.equal(StepIn(model, 2).eval()(x), seg.img.expand(2, -1, -1))
        img = hidden(m, d, g)
        vec = torch.randn(BATCH, 1, d, generator=g)
        want = model.head(Segments(img[:, :0], img, img[:, :0], vec, vec, vec))
        out = StepOut(model, 2).eval()
        got = out.velocity(img, vec)
        assert float((got - want).abs().max()) < BOUND
        other = swiglu_model(layer_norm_eps=1e-5)
        other.load_state_dict(model.state_dict())
        assert float((StepOut(other, 2).eval().velocity(img, vec) - want).abs().max()) > 1e-3
        dt, guidance = torch.tensor([-0.05]), torch.tensor([3.0])
        step = out(img, vec, x, dt, guidance)
        assert float((step - (x + dt * (want[1:] + guidance * (want[:1] - want[1:]))))
                     .abs().max()) < BOUND


# executorch is slow-marked (44 s of exports): its two parts are in the default suite
# apart, the delegable SwiGLU shard through this backend (below) and a whole streamed edit
# through it (test_backends.py), and a whole SwiGLU edit through compiled graphs runs on
# the native runtime in test_model_roundtrip.py (sakura-flux2's config class)
@pytest.mark.parametrize("backend", ["torch", pytest.param("executorch",
                                                           marks=pytest.mark.slow)])
def test_a_whole_edit_through_shard_graphs_equals_cached_edit(model, backend, tmp_path):
    """Template run, cache, 4-step guided edit: ``ShardExecutor`` (plain graphs on the torch
    backend, delegable ``.pte`` on ExecuTorch) against ``dit.editing.cached_edit``."""
    from sakura.dit.editing import Geometry, cached_edit, template_run
    from sakura.edge.backends import create_backend
    from sakura.edge.backends.base import BackendConfig
    from sakura.edge.backends.executor import ShardExecutor, step_groups

    from tests.dit.common import tiny_request, tiny_template

    template = tiny_template(model)
    geo = Geometry.of(model, template)
    assert torch.equal(geo.pos, model.image_positions(template.size // model.cfg.patch_size))
    cache = template_run(model, template).cache.to_fp16_exact()
    req = tiny_request(model)
    with torch.inference_mode():
        exact = cached_edit(model, template, geo, cache, req)
    ex = ShardExecutor(model, create_backend(backend, BackendConfig(cache_dir=tmp_path)))
    out = ex.edit(template, geo, cache, req, step_groups(model.cfg.num_blocks, 2))
    err = float((out - exact).abs().max())
    if backend == "torch":
        assert err == 0.0  # measured 0.0
    assert err < 1e-4, (backend, err)  # executorch: measured 3.6e-7 on pixels in [-1, 1]


# ----------------------------------------------------------------------------- ExecuTorch


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return tmp_path_factory.mktemp("compiled-swiglu")


def test_the_delegable_shard_lowers_fully_to_xnnpack(model, compiled):
    """The ExecuTorch backend's static graph (as ``test_backends.py`` checks it)."""
    from sakura.edge.backends import create_backend
    from sakura.edge.backends.base import BackendConfig
    from sakura.edge.backends.delegation import pte_kernel_calls

    backend = create_backend("executorch", BackendConfig(cache_dir=compiled))
    m, blocks = 23, (1, 2)  # a double-stream and a single-stream block
    geometry = ShardGeometry(BATCH, TXT, m, GRID * GRID - m)
    x, pos, kv = case(model, m, seed=7)
    got = backend.prepare(model, blocks, geometry, "swiglu-test").run(
        *shard_args(model, blocks, x, pos, kv))
    assert max_err(got, reference(model, blocks, x, pos, kv)) < PTE_BOUND
    folder = backend.cache.lookup(backend.key(model, "swiglu-test", blocks, geometry))
    assert folder is not None
    info = backend.delegation(folder)
    assert info.outside == {} and info.fraction == 1.0, info.outside
    assert info.subgraphs == 1 and info.delegated_ops > 100
    calls = pte_kernel_calls((folder / "shard.pte").read_bytes())
    assert calls.delegates == ("XnnpackBackend",) and calls.kernels == {}


def test_dynamic_shard_and_step_graphs_lower_fully_and_run(model, tmp_path):
    """One dynamic ``.pte`` per graph (as ``test_backends_dynamic.py`` checks them): every
    compute op in the delegate, the MMDiT's outputs at several (M, U)."""
    from executorch.runtime import Runtime
    from sakura.edge.backends.delegation import pte_kernel_calls
    from sakura.edge.backends.executorch_backend import export_dynamic

    blocks = (1, 2)
    bounds = ShardBounds(BATCH, TXT, GRID * GRID)
    example = bounds.example()
    path = tmp_path / "shard.pte"
    info = export_dynamic(ShardModule(model, blocks, example, dynamic=True).eval(),
                          example_inputs(model, blocks, example, dynamic=True),
                          bounds.dynamic_shapes(blocks), path)
    assert info.outside == {} and info.fraction == 1.0, info.outside
    assert info.subgraphs == 1 and info.delegated_ops > 100
    calls = pte_kernel_calls(path.read_bytes())
    assert calls.delegates == ("XnnpackBackend",) and calls.kernels == {}
    method = Runtime.get().load_program(str(path)).load_method("forward")
    for i, m in enumerate((1, 63, 23)):
        x, pos, kv = case(model, m, seed=20 + i)
        got = method.execute(list(shard_args(model, blocks, x, pos, kv, dynamic=True)))
        err = max_err(got, reference(model, blocks, x, pos, kv))
        assert err < PTE_BOUND, (m, err)

    check_dynamic_step_graphs(model, GRID * GRID, tmp_path, PTE_BOUND)
