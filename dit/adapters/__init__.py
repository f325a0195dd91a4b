"""SAKURA on diffusers transformers: FLUX.2 / FLUX.2-klein (Klein-KV references), SD3.5 (dual
attention), QwenImage and QwenImage 2.1 (block-causal prefix). See ``dit/adapters/README.md``.

Public API::

    from dit.adapters import load_adapter, MODELS
    adapter = load_adapter("flux2-klein-4b", "/models/FLUX.2-klein-4B")
    run = adapter.template_run(template)                    # capture -> TemplateCache
    adapter.profile_importance(template, run, requests)     # importance into the cache
    latents = adapter.cached_edit(template, run.geometry, provider, request)
"""

_LAZY = {  # loaded on first use so that `sakura --help` does not import torch/diffusers
    "AdapterGeometry": "dit.adapters.base",
    "AdapterHook": "dit.adapters.base",
    "AdapterRun": "dit.adapters.base",
    "Branch": "dit.adapters.base",
    "Conditioning": "dit.adapters.base",
    "LatentImage": "dit.adapters.base",
    "LatentRequest": "dit.adapters.base",
    "LatentTemplate": "dit.adapters.base",
    "ModelAdapter": "dit.adapters.base",
    "AdapterError": "dit.adapters.errors",
    "CheckpointMismatchError": "dit.adapters.errors",
    "InputError": "dit.adapters.errors",
    "ModelPathError": "dit.adapters.errors",
    "UnknownModelError": "dit.adapters.errors",
    "UnsupportedError": "dit.adapters.errors",
    "MODELS": "dit.adapters.registry",
    "ModelSpec": "dit.adapters.registry",
    "load_adapter": "dit.adapters.registry",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dit.adapters' has no attribute {name!r}")


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
