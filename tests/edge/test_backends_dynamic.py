"""Dynamic shard and step graphs: one ExecuTorch ``.pte`` for every template geometry.

The dynamic form of a shard graph (``ShardModule(..., dynamic=True)``, exported with
``ShardBounds``) computes what the static graph of each geometry computes, every compute
op of its ``.pte`` runs inside the XNNPACK delegate, and the one ``.pte`` runs at several
(M, U) through ``executorch.runtime`` with the torch modules' outputs.
"""

from __future__ import annotations

import pytest
import torch
from sakura.edge.backends.shard import (
    ShardBounds,
    ShardGeometry,
    ShardModule,
    example_inputs,
    free_shape,
)
from sakura.edge.backends.step import StepOut, step_examples

from tests.dit.common import tiny_model as tiny_model_mode
from tests.edge.helpers import check_dynamic_step_graphs, tiny_model

BLOCKS = (1, 2)  # a double-stream and a single-stream block of the tiny model
TOKENS = 64      # N: every (M, U) with M + U <= N, M, U >= 1
# (M, U): the smallest and largest masks and one between, none of them the traced example
GEOMETRIES = [(1, TOKENS - 1), (TOKENS - 1, 1), (23, 41)]
# fp32 on both sides; measured max abs error 8.3e-7 on outputs of magnitude ~4
PTE_BOUND = 1e-4


def static_inputs(model, geometry: ShardGeometry, xs: tuple[torch.Tensor, ...]):
    """The static graph's inputs for the dynamic graph's ``xs``: RoPE tables of the text
    and the image tokens, the text rows computed as the host computes them."""
    ang = model.angles(model.text_positions(geometry.txt)).float()
    return (*xs[:4], torch.cat([ang.cos(), xs[4]]), torch.cat([ang.sin(), xs[5]]), *xs[6:])


def reference(model, blocks, geometry, xs):
    with torch.no_grad():
        return ShardModule(model, blocks, geometry).eval()(*static_inputs(model, geometry, xs))


@pytest.mark.parametrize("mode", ["joint", "block_causal"])
def test_dynamic_shard_graph_is_the_same_function(mode):
    """Eager torch: the dynamic form at any (M, U) equals the static graph of (M, U)."""
    model = tiny_model_mode(mode=mode)
    t = model.cfg.text_tokens
    for blocks in [(0, 1, 2, 3), (2,)]:
        dyn = ShardModule(model, blocks, ShardGeometry(2, t, 5, 11), dynamic=True).eval()
        for m, u in [(1, 63), (40, 1), (7, 9)]:
            geometry = ShardGeometry(2, t, m, u)
            xs = example_inputs(model, blocks, geometry, seed=m + u, dynamic=True)
            want = reference(model, blocks, geometry, xs)
            with torch.no_grad():
                got = dyn(*xs)
            assert [g.shape for g in got] == [w.shape for w in want]
            err = max(float((g - w).abs().max()) for g, w in zip(got, want))
            assert err < 1e-5, (mode, blocks, m, u, err)  # measured 1.3e-6


@pytest.fixture(scope="module")
def dynamic_pte(tmp_path_factory):
    from sakura.edge.backends.executorch_backend import export_dynamic

    model = tiny_model()
    bounds = ShardBounds(batch=2, txt=model.cfg.text_tokens, tokens=TOKENS)
    example = bounds.example()
    module = ShardModule(model, BLOCKS, example, dynamic=True).eval()
    path = tmp_path_factory.mktemp("dynamic") / "shard.pte"
    delegation = export_dynamic(module, example_inputs(model, BLOCKS, example, dynamic=True),
                                bounds.dynamic_shapes(BLOCKS), path)
    return model, bounds, path, delegation


def test_every_compute_op_of_a_dynamic_shard_runs_in_the_delegate(dynamic_pte):
    from sakura.edge.backends.delegation import pte_kernel_calls

    _model, _bounds, path, info = dynamic_pte
    assert info.outside == {} and info.fraction == 1.0, info.outside
    assert info.subgraphs == 1 and info.delegated_ops > 100  # measured 392
    calls = pte_kernel_calls(path.read_bytes())
    assert calls.delegates == ("XnnpackBackend",) and calls.kernels == {}


def test_one_dynamic_pte_serves_every_geometry(dynamic_pte):
    from executorch.runtime import Runtime

    model, bounds, path, _info = dynamic_pte
    method = Runtime.get().load_program(str(path)).load_method("forward")
    # memory is planned for the upper bounds, which the method's metadata reports
    meta = method.metadata
    d, n = model.cfg.hidden_size, TOKENS - 1
    assert tuple(meta.input_tensor_meta(1).sizes()) == (2, n, d)
    assert tuple(meta.input_tensor_meta(6).sizes()) == (n, d)
    assert tuple(meta.output_tensor_meta(1).sizes()) == (2, n, d)
    for i, (m, u) in enumerate(GEOMETRIES):
        geometry = ShardGeometry(2, bounds.txt, m, u)
        assert bounds.contains(geometry) and geometry != bounds.example()
        xs = example_inputs(model, BLOCKS, geometry, seed=10 + i, dynamic=True)
        want = reference(model, BLOCKS, geometry, xs)
        got = method.execute(list(xs))
        assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want]
        err = max(float((g - w).abs().max()) for g, w in zip(got, want))
        assert err < PTE_BOUND, (m, u, err)


def test_dynamic_step_graphs(tmp_path):
    """StepIn / StepOut exported once with a dynamic M give the torch modules' outputs at
    any M, with every compute op inside the delegate."""
    check_dynamic_step_graphs(tiny_model(), TOKENS, tmp_path, PTE_BOUND)


def test_the_dynamic_step_out_is_the_guided_euler_step():
    """The one-hot row selection of StepOut is v_uncond + g (v_cond - v_uncond), bit for bit."""
    model = tiny_model()
    img, vec, x, dt, g = step_examples(model, 2, 9)["step_out"]
    out = StepOut(model, 2).eval()
    with torch.no_grad():
        v = out.velocity(img, vec)
        want = x + dt * (v[1:] + g * (v[:1] - v[1:]))
        got = out(img, vec, x, dt, g)
    assert torch.equal(got, want)


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="tokens >= 3"):
        ShardBounds(batch=2, txt=5, tokens=2)
    assert not ShardBounds(2, 5, 64).contains(ShardGeometry(2, 5, 64, 0))
    assert not ShardBounds(2, 5, 64).contains(ShardGeometry(1, 5, 10, 10))
    assert free_shape((2, 3, 4)) == [2, 3, 4]
