"""SAKURA on diffusers transformers: FLUX.2 / FLUX.2-klein (Klein-KV references), SD3.5 (dual
attention), QwenImage and QwenImage 2.1 (block-causal prefix). See ``dit/adapters/README.md``.

Public API::

    from dit.adapters import load_adapter, MODELS
    adapter = load_adapter("flux2-klein-4b", "/models/FLUX.2-klein-4B")
    run = adapter.template_run(template)                    # capture -> TemplateCache
    adapter.profile_importance(template, run, requests)     # importance into the cache
    latents = adapter.cached_edit(template, run.geometry, provider, request)
"""

from dit.adapters.base import (
    AdapterGeometry,
    AdapterHook,
    AdapterRun,
    Branch,
    Conditioning,
    LatentImage,
    LatentRequest,
    LatentTemplate,
    ModelAdapter,
)
from dit.adapters.errors import (
    AdapterError,
    CheckpointMismatchError,
    InputError,
    ModelPathError,
    UnknownModelError,
    UnsupportedError,
)
from dit.adapters.registry import MODELS, ModelSpec, load_adapter

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
