"""Qualcomm AI Hub: compile and profile shard graphs on real Snapdragon devices.

:func:`submit_compile` uploads one shard graph (the ONNX export of a
:class:`~edge.backends.shard.ShardModule`: the model's weights and the graph, nothing
else) and submits a compile job to a QNN context binary for the target device;
:func:`submit_profile` submits a profile job of a compiled model on the device
(``submit_inference_job(..., inputs=None, profile=True)``: AI Hub generates the inputs).
No request data (image, prompt, mask, seed, embeddings or anything derived from them) is
ever uploaded: neither function takes a request or passes ``inputs``.
:func:`submit_shard_jobs` does both for one graph. ``sakura backends aihub compile|profile``
(``edge/backends/aihub_cli.py``) is the command line.

A token comes from ``QAI_HUB_API_TOKEN`` or from qai-hub's config file
(``~/.qai_hub/client.ini``, written by ``qai-hub configure --api_token ...``; another path
via ``QAIHUB_CLIENT_INI``, as ``qai_hub.api_utils.get_config_path`` reads it). Without one:
:class:`AIHubError` saying how to configure it, before anything is exported or uploaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from sakura.edge.backends.errors import AIHubError

from sakura.extras import install_hint

TOKEN_ENV = "QAI_HUB_API_TOKEN"
CONFIG_ENV = "QAIHUB_CLIENT_INI"
DEFAULT_DEVICE = "Snapdragon 8 Elite QRD"
QAI_HUB_PIN = "qai-hub==0.56.0"


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
    profile_job: Any = None
    uploaded: list[str] = field(default_factory=list)  # what left this machine

    def summary(self) -> dict[str, Any]:
        doc = {"compile_job": job_summary(self.compile_job), "uploaded": self.uploaded}
        if self.profile_job is not None:
            doc["profile_job"] = job_summary(self.profile_job)
        return doc


def job_summary(job: Any) -> dict[str, Any]:
    """Id and page of a job (what the CLI prints and writes)."""
    return {"id": getattr(job, "job_id", None), "url": getattr(job, "url", None)}


def config_path() -> Path:
    return Path(os.path.expanduser(os.environ.get(CONFIG_ENV, "~/.qai_hub/client.ini")))


def has_token() -> bool:
    return bool(os.environ.get(TOKEN_ENV)) or config_path().is_file()


def require_token() -> None:
    """:class:`AIHubError` (one line saying how to configure AI Hub) without a token."""
    if not has_token():
        raise AIHubError(
            f"Qualcomm AI Hub is not configured: set {TOKEN_ENV} or run `qai-hub configure "
            f"--api_token TOKEN` (writes {config_path()}); get a token at "
            "https://aihub.qualcomm.com")


def load_hub(hub: ModuleType | None = None) -> ModuleType:
    if hub is not None:
        return hub
    try:
        import qai_hub
    except ImportError as exc:
        raise AIHubError(f"AI Hub jobs need the qai-hub package ({QAI_HUB_PIN}): "
                         f"{install_hint('qai_hub')}") from exc
    return qai_hub


def client(hub: ModuleType | None = None) -> Any:
    """A ``qai_hub.Client`` with the configured token, or :class:`AIHubError`."""
    require_token()
    hub = load_hub(hub)
    token = os.environ.get(TOKEN_ENV)
    try:
        if token:
            return hub.Client(config=hub.ClientConfig(api_token=token))
        # no config: the client reads qai-hub's config file (QAIHUB_CLIENT_INI or default)
        return hub.Client()
    except Exception as exc:  # noqa: BLE001 - qai_hub raises its own types
        raise AIHubError(f"cannot create an AI Hub client: {exc}") from exc


def upload_path(onnx_path: Path) -> Path:
    """What is uploaded for a shard graph: the ONNX file, or its folder when the weights
    are stored next to it as external data (``*.data``)."""
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise AIHubError(f"no shard graph at {onnx_path} (`sakura backends aihub compile "
                         "--template ID` exports one; the qnn backend keeps its ONNX export "
                         "next to the context binary)")
    return onnx_path.parent if any(onnx_path.parent.glob("*.data")) else onnx_path


def _uploaded(model: Path) -> list[str]:
    return sorted(p.name for p in ([model] if model.is_file() else model.iterdir()))


def submit_compile(onnx_path: Path, config: AIHubConfig | None = None,
                   hub: ModuleType | None = None) -> AIHubJobs:
    """Upload ``onnx_path`` (a shard graph) and compile it for the device."""
    config = config or AIHubConfig()
    model = upload_path(onnx_path)
    hub = load_hub(hub)
    c = client(hub)
    try:
        job = c.submit_compile_job(
            model=str(model), device=hub.Device(config.device),
            name=f"{config.name_prefix}-{Path(onnx_path).stem}",
            options=config.compile_options)
    except Exception as exc:  # noqa: BLE001 - network / API errors of qai_hub
        raise AIHubError(f"AI Hub compile job submission failed: {exc}") from exc
    return AIHubJobs(job, uploaded=_uploaded(model))


def target_model(compile_job: Any) -> Any:
    """The compiled model of a compile job (waits for it), or :class:`AIHubError`."""
    try:
        target = compile_job.get_target_model()
    except Exception as exc:  # noqa: BLE001
        raise AIHubError(f"AI Hub compile job {getattr(compile_job, 'job_id', '?')}: "
                         f"{exc}") from exc
    if target is None:
        raise AIHubError(f"AI Hub compile job {getattr(compile_job, 'job_id', '?')} "
                         "failed; see its page for the log")
    return target


def submit_profile(model: Any, config: AIHubConfig | None = None,
                   hub: ModuleType | None = None, name: str = "") -> Any:
    """Profile a compiled model (a ``TargetModel`` or a model id) on the device, with AI
    Hub's own generated inputs (``inputs=None``): no user data."""
    config = config or AIHubConfig()
    hub = load_hub(hub)
    c = client(hub)
    try:
        if isinstance(model, str):
            model = c.get_model(model)
        return c.submit_inference_job(
            model=model, device=hub.Device(config.device), inputs=None, profile=True,
            name=name or f"{config.name_prefix}-profile", options=config.profile_options)
    except Exception as exc:  # noqa: BLE001 - network / API errors of qai_hub
        raise AIHubError(f"AI Hub profile job submission failed: {exc}") from exc


def compiled_model_of_job(job_id: str, hub: ModuleType | None = None) -> Any:
    """The target model of compile job ``job_id`` (waits for the job)."""
    hub = load_hub(hub)
    c = client(hub)
    try:
        job = c.get_job(job_id)
    except Exception as exc:  # noqa: BLE001
        raise AIHubError(f"AI Hub has no job {job_id!r}: {exc}") from exc
    return target_model(job)


def submit_shard_jobs(onnx_path: Path, config: AIHubConfig | None = None,
                      hub: ModuleType | None = None) -> AIHubJobs:
    """Compile ``onnx_path`` (a shard graph) for the device and profile the result."""
    config = config or AIHubConfig()
    jobs = submit_compile(onnx_path, config, hub)
    jobs.profile_job = submit_profile(
        target_model(jobs.compile_job), config, hub,
        name=f"{config.name_prefix}-{Path(onnx_path).stem}-profile")
    return jobs
