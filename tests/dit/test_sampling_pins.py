"""Bit-exactness of every caller of the one denoising loop (``dit.sampler.denoise``).

Issue 30 item 1 folded the eight hand-written loops of ``dit/editing.py`` and
``dit/adapters/base.py`` (and those of ``sampler.generate`` and the shard executor) into
one. The sha256 values below were computed with the *old* loops, on tiny seeded configs,
before the change; the test proves that each public entry still produces the same bytes.

Floating-point results depend on the CPU's instruction set and the torch build, so the
pins hold only on the platform they were computed on: its CPU model, the instruction-set
extensions torch's CPU kernels pick from, the torch version and the thread count
(``PLATFORM``), and two canaries (a forward of the tiny MMDiT and of a tiny diffusers
transformer) that must give the bytes they gave there; on another platform the pins are
skipped, not failed. The canaries alone were not enough: an AMD EPYC (AVX2, no AVX-512)
gave the canaries' bytes and different bytes for 17 of the 18 MMDiT entries.

The chain back to the old loops: the first pins were computed with the old loops on the
machine of 1da7186 and passed there at 06359c2; on the AMD EPYC above, 06359c2's tree and
this one (f25c253) give the same bytes for every entry of every model, and those are the
values below (re-pinned 2026-12-04; ``python tests/dit/test_sampling_pins.py`` prints them).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest
import torch
from sakura.dit.adapters.tiny import KINDS, tiny_adapter, tiny_spec
from sakura.dit.adapters.tiny import tiny_request as adapter_request
from sakura.dit.adapters.tiny import tiny_template as adapter_template
from sakura.dit.editing import (
    cached_edit,
    exact_edits,
    full_edit,
    pinned_reference_edit,
    profile_importance,
    template_run,
)
from sakura.dit.model import TokenBatch, grid_positions
from sakura.dit.sampler import generate
from sakura.edge.backends import create_backend
from sakura.edge.backends.executor import ShardExecutor, step_groups

from tests.dit.common import tiny_model, tiny_request, tiny_template


@pytest.fixture(scope="module", autouse=True)
def pinning_threads():
    """The pins and canaries were computed with 2 intra-op threads (this 2-core machine's
    default): a reduction's order, and so its bytes, follows the thread count, and earlier
    tests of a full run set it to 1 (which skipped every pin in a clean-clone CI run). Module
    scope, and ``same_platform`` asks for it, so the canaries run under it too."""
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(prev)


def sha(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def canaries() -> dict[str, str]:
    """Forwards the loop change does not touch: they tell whether this platform computes
    the bytes the pins were computed with."""
    model = tiny_model()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 16, model.cfg.patch_dim, generator=g)
    txt = torch.randn(2, model.cfg.text_tokens, model.cfg.text_dim, generator=g)
    out = {"mmdit": sha(model(TokenBatch(img=x, img_pos=grid_positions(4, model.cfg.pos_span),
                                         txt=txt, t=torch.tensor([0.7, 0.3]))))}
    a = tiny_adapter("flux2")
    spec = tiny_spec("flux2")
    tpl = adapter_template(a, spec)
    run = a.template_run(tpl)
    out["flux2"] = sha(run.cache.keys[0, 0])  # one forward's first K
    return out


def mmdit_values() -> dict[str, str]:
    out: dict[str, str] = {}
    model = tiny_model()
    tpl = tiny_template(model)
    req = tiny_request(model)
    run = template_run(model, tpl, keep_hidden=True)
    out["template_run"] = sha(run.cache.keys, run.cache.values, run.cache.timesteps,
                              run.hidden[-1][0])
    geo, cache = run.geometry, run.cache
    out["cached_edit"] = sha(cached_edit(model, tpl, geo, cache, req))
    out["cached_edit_text_kv"] = sha(cached_edit(model, tpl, geo, cache, req, reuse_text_kv=True))
    lat: dict[int, torch.Tensor] = {}
    steps: list[int] = []
    cached_edit(model, tpl, geo, cache, req, on_step=steps.append,
                on_latent=lambda s, x: lat.__setitem__(s, x.clone()))
    assert steps == list(range(tpl.steps))
    out["on_latent"] = sha(*(lat[s] for s in range(tpl.steps)))
    out["resume"] = sha(cached_edit(model, tpl, geo, cache, req, start_step=2, x_start=lat[2]))
    out["pinned_reference_edit"] = sha(pinned_reference_edit(model, tpl, run, req))
    out["full_edit"] = sha(full_edit(model, tpl, req))
    out["exact_edits"] = sha(*exact_edits(model, tpl, [req, tiny_request(model, seed=8)]))
    out["profile_importance"] = sha(profile_importance(model, tpl, run, [req]))
    weak = replace(tpl, strength=0.6)
    wrun = template_run(model, weak, keep_hidden=True)
    out["strength_template_run"] = sha(wrun.cache.keys, wrun.cache.timesteps)
    out["strength_cached_edit"] = sha(cached_edit(model, weak, wrun.geometry, wrun.cache, req))
    out["strength_full_edit"] = sha(full_edit(model, weak, req))
    out["strength_pinned"] = sha(pinned_reference_edit(model, weak, wrun, req))
    ex = ShardExecutor(model, create_backend("torch"))
    out["shard_executor"] = sha(ex.edit(weak, wrun.geometry, wrun.cache, req,
                                        step_groups(model.cfg.num_blocks, 2)))
    out["generate"] = sha(generate(model, req.txt, req.txt_uncond, 16, seed=3, steps=3))
    causal = tiny_model("block_causal")
    ctpl = tiny_template(causal)
    crun = template_run(causal, ctpl)
    rreq = tiny_request(causal, refs=2)
    out["refs_cached"] = sha(cached_edit(causal, ctpl, crun.geometry, crun.cache, rreq))
    out["refs_uncached"] = sha(cached_edit(causal, ctpl, crun.geometry, crun.cache, rreq,
                                           cache_refs=False))
    out["generate_refs"] = sha(generate(causal, rreq.txt, rreq.txt_uncond, 16, seed=3, steps=2,
                                        ref_images=rreq.ref_images[:1]))
    return out


def adapter_values(kind: str) -> dict[str, str]:
    out: dict[str, str] = {}
    a = tiny_adapter(kind)
    spec = tiny_spec(kind)
    tpl = adapter_template(a, spec)
    req = adapter_request(a, spec, prefix_image=kind == "qwenimage-2.1",
                          refs=2 if kind == "flux2" else 0)
    run = a.template_run(tpl, keep_hidden=True)
    out["template_run"] = sha(run.cache.keys, run.cache.values, run.cache.timesteps,
                              run.hidden[-1][0])
    steps: list[int] = []
    out["cached_edit"] = sha(a.cached_edit(tpl, run.geometry, run.cache, req,
                                           on_step=steps.append))
    assert steps == list(range(tpl.steps))
    if kind == "flux2":
        out["cached_edit_refs_uncached"] = sha(a.cached_edit(tpl, run.geometry, run.cache, req,
                                                             cache_refs=False))
    out["pinned_reference_edit"] = sha(a.pinned_reference_edit(tpl, run, req))
    out["full_edit"] = sha(a.full_edit(tpl, req))
    out["profile_importance"] = sha(a.profile_importance(tpl, run, [req]))
    one = replace(tpl, guidance=1.0)
    out["no_guidance"] = sha(a.cached_edit(one, run.geometry, run.cache, req))
    return out


# computed with the loops as they were before issue 30 item 1 (commit 96effd0)
# the platform the pins below were computed on (pinning_platform()), and its canaries
PLATFORM: dict[str, object] = {'cpu': 'AMD EPYC', 'isa': ['avx2', 'fma'], 'torch': '2.13.0', 'threads': 2}
CANARIES: dict[str, str] = {'mmdit': '1fce85c5fc08ec1b', 'flux2': '71bbdc854dedc733'}
PINS: dict[str, dict[str, str]] = {
    'mmdit': {
        'template_run': 'c3621e990f0e0737',
        'cached_edit': '5d2aae4f582e21c5',
        'cached_edit_text_kv': '90b9df8d38264e04',
        'on_latent': '251afd63d26b2c8e',
        'resume': '5d2aae4f582e21c5',
        'pinned_reference_edit': 'bf50bc2fa90afe61',
        'full_edit': '842c5f258286d4e3',
        'exact_edits': '9fcf3fe804417433',
        'profile_importance': 'a6a8937af358f5d8',
        'strength_template_run': '69fa241808440e2f',
        'strength_cached_edit': '9ed86f541514646e',
        'strength_full_edit': '8dfad45f0f981aa9',
        'strength_pinned': 'cb02e3e98585a360',
        'shard_executor': '9ed86f541514646e',
        'generate': '68db0a5f969760b6',
        'refs_cached': '34df207c1fc888bf',
        'refs_uncached': '9b2d5e8fb74b2aa1',
        'generate_refs': '595b43ba3dfcfa14',
    },
    'flux2': {
        'template_run': '652c1e6d6d0ef42d',
        'cached_edit': '4837e467207e1ab7',
        'cached_edit_refs_uncached': '76c180997546c473',
        'pinned_reference_edit': '8a1b323ed3b498cf',
        'full_edit': 'cefeb4ed96876a1b',
        'profile_importance': '18b92c559972cbc5',
        'no_guidance': 'c4cb7c2494659e28',
    },
    'sd3.5': {
        'template_run': '864267fc7b03ad10',
        'cached_edit': '8833f0de938564bf',
        'pinned_reference_edit': '403316853b0d52de',
        'full_edit': '2b6a3423c0141445',
        'profile_importance': '9f152e687148196b',
        'no_guidance': 'de9616b817250e98',
    },
    'qwenimage': {
        'template_run': '2d11e37039ac0e7c',
        'cached_edit': '2624769bc58d9e31',
        'pinned_reference_edit': 'd4c4d1a32fddebcc',
        'full_edit': 'bce6c23cb999c69d',
        'profile_importance': '352c003f7f606386',
        'no_guidance': '9ad4f5ee11427edd',
    },
    'qwenimage-2.1': {
        'template_run': '2c39160e492356c1',
        'cached_edit': '72e961b069a4e862',
        'pinned_reference_edit': '62dd8df2cdc457a3',
        'full_edit': '08a4a0b0d403c2eb',
        'profile_importance': 'fedc6067a3ac4ec2',
        'no_guidance': '0d44747cd1ef0efa',
    },
}


def pinning_platform() -> dict[str, object]:
    """This machine, as ``PLATFORM`` records the pinning one."""
    cpu, flags = "", set()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not cpu:
                cpu = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    isa = ("avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "avx2", "fma")
    return {"cpu": cpu, "isa": [f for f in isa if f in flags],
            "torch": torch.__version__.split("+")[0], "threads": torch.get_num_threads()}


@pytest.fixture(scope="module")
def same_platform(pinning_threads):
    here = pinning_platform()
    if here != PLATFORM:
        pytest.skip(f"not the pinning platform ({here} != {PLATFORM}): the pins do not apply "
                    "here")
    got = canaries()
    if got != CANARIES:
        pytest.skip(f"plain forwards differ from the pinning platform ({got} != {CANARIES}): "
                    "the pins do not apply here")


def test_default_model_entries_are_bit_identical(same_platform):
    assert mmdit_values() == PINS["mmdit"]


@pytest.mark.parametrize("kind", KINDS)
def test_adapter_entries_are_bit_identical(same_platform, kind):
    assert adapter_values(kind) == PINS[kind]


if __name__ == "__main__":  # print the values (how the pins above were made)
    torch.set_num_threads(2)
    print("PLATFORM =", pinning_platform())
    print("CANARIES =", canaries())
    print("PINS = {")
    print(f"    'mmdit': {mmdit_values()!r},")
    for k in KINDS:
        print(f"    {k!r}: {adapter_values(k)!r},")
    print("}")
