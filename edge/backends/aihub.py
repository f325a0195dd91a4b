"""Qualcomm AI Hub: compile and profile shard graphs on real Snapdragon devices.

``submit_shard_jobs`` uploads one shard graph (the ONNX export of a
:class:`~edge.backends.shard.ShardModule`: the model's weights and the graph, nothing
else), submits a compile job to a QNN context binary for the target device and a profile
job of the compiled model on that device. Profile jobs run with AI Hub's own generated
inputs: no request data (image, prompt, mask, seed, embeddings or anything derived from
them) is ever uploaded; the function takes no request and passes no ``inputs``.

A token comes from ``QAI_HUB_API_TOKEN`` or from qai-hub's config file
(``~/.qai_hub/client.ini``, written by ``qai-hub configure --api_token ...``; another path
via ``QAIHUB_CLIENT_INI``). Without one: :class:`AIHubError` saying how to configure it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from sakura.edge.backends.errors import AIHubError

TOKEN_ENV = "QAI_HUB_API_TOKEN"
DEFAULT_DEVICE = "Snapdragon 8 Elite QRD"


@dataclass(frozen=True)
class AIHubConfig:
    """Which device and how to compile (``options`` are qai-hub compile flags)."""

    device: str = DEFAULT_DEVICE
    compile_options: str = "--target_runtime qnn_context_binary"
    profile_options: str = ""
    name_prefix: str = "sakura-shard"


@dataclass
class AIHubJobs:
    """The submitted jobs of one shard graph."""

    compile_job: Any
    profile_job: Any
    uploaded: list[str] = field(default_factory=list)  # what left this machine

    def summary(self) -> dict[str, Any]:
        return {"compile_job": getattr(self.compile_job, "job_id", None),
                "compile_url": getattr(self.compile_job, "url", None),
                "profile_job": getattr(self.profile_job, "job_id", None),
                "profile_url": getattr(self.profile_job, "url", None),
                "uploaded": self.uploaded}


def config_path() -> Path:
    return Path(os.path.expanduser(os.environ.get("QAIHUB_CLIENT_INI",
                                                  "~/.qai_hub/client.ini")))


def has_token() -> bool:
    return bool(os.environ.get(TOKEN_ENV)) or config_path().is_file()


def client(hub: ModuleType | None = None) -> Any:
    """A ``qai_hub.Client`` with the configured token, or :class:`AIHubError`."""
    if not has_token():
        raise AIHubError(
            f"Qualcomm AI Hub is not configured: set {TOKEN_ENV} or run `qai-hub configure "
            f"--api_token TOKEN` (writes {config_path()}); get a token at "
            "https://aihub.qualcomm.com")
    if hub is None:
        try:
            import qai_hub as hub
        except ImportError as exc:
            raise AIHubError("AI Hub jobs need the qai-hub package "
                             "(`pip install qai-hub==0.56.0`)") from exc
    token = os.environ.get(TOKEN_ENV)
    try:
        if token:
            return hub.Client(config=hub.ClientConfig(api_token=token))
        return hub.Client()  # reads the config file (QAIHUB_CLIENT_INI or the default)
    except Exception as exc:  # noqa: BLE001 - qai_hub raises its own types
        raise AIHubError(f"cannot create an AI Hub client: {exc}") from exc


def submit_shard_jobs(onnx_path: Path, config: AIHubConfig | None = None,
                      hub: ModuleType | None = None) -> AIHubJobs:
    """Compile ``onnx_path`` (a shard graph) for the device and profile the result."""
    config = config or AIHubConfig()
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise AIHubError(f"no shard graph at {onnx_path} (compile it with the qnn backend "
                         "first: it keeps the ONNX export next to the context binary)")
    if hub is None:
        try:
            import qai_hub as hub
        except ImportError as exc:
            raise AIHubError("AI Hub jobs need the qai-hub package "
                             "(`pip install qai-hub==0.56.0`)") from exc
    c = client(hub)
    # an ONNX model with external weights is uploaded as its folder (graph + weights)
    model = onnx_path.parent if any(onnx_path.parent.glob("*.data")) else onnx_path
    try:
        device = hub.Device(config.device)
        compile_job = c.submit_compile_job(
            model=str(model), device=device, name=f"{config.name_prefix}-{onnx_path.stem}",
            options=config.compile_options)
        target = compile_job.get_target_model()
        if target is None:
            raise AIHubError(f"AI Hub compile job {getattr(compile_job, 'job_id', '?')} "
                             "failed; see its page for the log")
        # inputs=None: AI Hub profiles with its own random inputs, no user data
        profile_job = c.submit_inference_job(
            model=target, device=device, inputs=None, profile=True,
            name=f"{config.name_prefix}-{onnx_path.stem}-profile",
            options=config.profile_options)
    except AIHubError:
        raise
    except Exception as exc:  # noqa: BLE001 - network / API errors of qai_hub
        raise AIHubError(f"AI Hub job submission failed: {exc}") from exc
    uploaded = sorted(str(p.name) for p in ([model] if model.is_file() else model.iterdir()))
    return AIHubJobs(compile_job, profile_job, uploaded)
