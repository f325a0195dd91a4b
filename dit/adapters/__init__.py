"""SAKURA on diffusers transformers: FLUX.2 / FLUX.2-klein (Klein-KV references), SD3.5 (dual
attention), QwenImage and QwenImage 2.1 (block-causal prefix). See ``dit/adapters/README.md``.

Public API::

    from sakura.dit.adapters import load_adapter, MODELS
    adapter = load_adapter("flux2-klein-4b", "/models/FLUX.2-klein-4B")
    run = adapter.template_run(template)                    # capture -> TemplateCache
    adapter.profile_importance(template, run, requests)     # importance into the cache
    latents = adapter.cached_edit(template, run.geometry, provider, request)
"""

_LAZY = {  # loaded on first use so that `sakura --help` does not import torch/diffusers
    "AdapterGeometry": "sakura.dit.adapters.inputs",
    "AdapterHook": "sakura.dit.adapters.hook",
    "AdapterRun": "sakura.dit.adapters.inputs",
    "Branch": "sakura.dit.adapters.processors",
    "Conditioning": "sakura.dit.adapters.inputs",
    "LatentImage": "sakura.dit.adapters.inputs",
    "LatentRequest": "sakura.dit.adapters.inputs",
    "LatentTemplate": "sakura.dit.adapters.inputs",
    "ModelAdapter": "sakura.dit.adapters.base",
    "AdapterError": "sakura.dit.adapters.errors",
    "CheckpointMismatchError": "sakura.dit.adapters.errors",
    "InputError": "sakura.dit.adapters.errors",
    "ModelPathError": "sakura.dit.adapters.errors",
    "UnknownModelError": "sakura.dit.adapters.errors",
    "UnsupportedError": "sakura.dit.adapters.errors",
    "MODELS": "sakura.dit.adapters.registry",
    "ModelSpec": "sakura.dit.adapters.registry",
    "load_adapter": "sakura.dit.adapters.registry",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sakura.dit.adapters' has no attribute {name!r}")


__all__ = [
    "MODELS",
    "AdapterError",
    "AdapterGeometry",
    "AdapterHook",
    "AdapterRun",
    "Branch",
    "CheckpointMismatchError",
    "Conditioning",
    "InputError",
    "LatentImage",
    "LatentRequest",
    "LatentTemplate",
    "ModelAdapter",
    "ModelPathError",
    "ModelSpec",
    "UnknownModelError",
    "UnsupportedError",
    "load_adapter",
]
