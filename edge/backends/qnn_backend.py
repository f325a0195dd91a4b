"""The QNN HTP backend: ONNX -> QNN context binary (onnxruntime-qnn) -> ONNX Runtime QNN EP.

Each shard graph is exported with ``torch.onnx.export`` (opset 18, static shapes) and
compiled by ONNX Runtime's QNN execution provider (the ``onnxruntime-qnn`` plug-in EP) with
the HTP backend ``libQnnHtp.so`` shipped in that wheel. On x86 Linux that library runs the
HTP graph on Qualcomm's simulator; on a Snapdragon phone the same context binary runs on the
Hexagon NPU. Session options ``ep.context_enable=1`` and ``ep.context_file_path`` make the
compile write ``shard_ctx.onnx`` (an EPContext wrapper) plus ``shard_ctx_qnn.bin`` (the
context binary); later loads open the wrapper and deserialize the binary, with no
recompile. CPU fallback is disabled: a shard runs wholly on HTP or fails.
:meth:`QnnBackend.assignment` measures it anyway: a session that allows fallback records
which nodes ONNX Runtime gave to which provider (``edge.backends.delegation``).

fp16: ``enable_htp_fp16_precision=1`` runs the float graph in fp16 on the HTP and needs the
target ``soc_model``. The default, 69, is the Snapdragon 8 Elite (SM8750, Hexagon v79):
``QNN_SOC_MODEL_SM8750`` in the QAIRT SDK's ``QnnTypes.h``, the same id ExecuTorch's QNN
backend uses (``executorch/backends/qualcomm/serialization/qc_schema.py``,
``QcomChipset.SM8750 = 69  # v79``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sakura.edge.backends.base import BackendConfig, CompiledShard, ExecutionBackend
from sakura.edge.backends.delegation import QnnAssignment, qnn_assignment
from sakura.edge.backends.errors import BackendError, BackendUnavailable
from sakura.edge.backends.shard import OUTPUT_NAMES, ShardModule, input_names

from sakura.extras import install_hint

EP_NAME = "QNNExecutionProvider"
ONNX_NAME = "shard.onnx"
CTX_NAME = "shard_ctx.onnx"
SOC_SNAPDRAGON_8_ELITE = 69  # SM8750, Hexagon v79 (QnnTypes.h QNN_SOC_MODEL_SM8750)


@dataclass(frozen=True)
class QnnOptions:
    """Compile options of the HTP backend."""

    soc_model: int = SOC_SNAPDRAGON_8_ELITE
    fp16: bool = True
    performance_mode: str = "burst"
    opset: int = 18

    @classmethod
    def from_config(cls, config: BackendConfig) -> QnnOptions:
        known = {k: v for k, v in config.options.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def _qnn_module():
    try:
        import onnxruntime as ort
        import onnxruntime_qnn
    except ImportError as exc:
        raise BackendUnavailable(
            f"--backend qnn needs onnxruntime-qnn ({exc}); install it: "
            f"{install_hint('onnxruntime_qnn')}") from exc
    return ort, onnxruntime_qnn


def _ep_devices(ort, oq) -> list:
    """The QNN EP's devices, registering the plug-in library with ONNX Runtime once."""
    devices = [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]
    if not devices:
        try:
            ort.register_execution_provider_library(EP_NAME, oq.get_library_path())
        except Exception as exc:  # noqa: BLE001 - ORT raises its own Fail type
            raise BackendUnavailable(f"cannot register the QNN execution provider "
                                     f"({oq.get_library_path()}): {exc}") from exc
        devices = [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]
    if not devices:
        raise BackendUnavailable("onnxruntime-qnn registered no QNN device on this host")
    return devices[:1]


class _OrtShard(CompiledShard):
    def __init__(self, module: ShardModule, session) -> None:
        super().__init__(module.blocks, module.input_shapes)
        self._session = session
        self._names = input_names(module.blocks)

    def _run(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        feed = {n: x.numpy() for n, x in zip(self._names, inputs)}
        out = self._session.run(OUTPUT_NAMES, feed)
        return torch.from_numpy(np.asarray(out[0])), torch.from_numpy(np.asarray(out[1]))


class QnnBackend(ExecutionBackend):
    """onnxruntime-qnn HTP backend (x86 simulator here, Hexagon NPU on a Snapdragon)."""

    name = "qnn"
    explicit_rms = True

    def __init__(self, config: BackendConfig | None = None) -> None:
        super().__init__(config)
        self.options = QnnOptions.from_config(self.config)

    def htp_library(self) -> Path:
        _ort, oq = _qnn_module()
        return Path(oq.get_qnn_htp_path())

    def check_available(self) -> None:
        ort, oq = _qnn_module()
        lib = Path(oq.get_qnn_htp_path())
        if not lib.is_file():
            raise BackendUnavailable(
                f"--backend qnn needs the QNN HTP library, but {lib} is missing from the "
                "onnxruntime-qnn install (reinstall onnxruntime-qnn==2.7.0)")
        _ep_devices(ort, oq)

    def version(self) -> str:
        ort, oq = _qnn_module()
        o = self.options
        qnn = getattr(oq.build_and_package_info, "qnn_version", "?")
        return (f"ort-{ort.__version__}-ortqnn-{oq.__version__}-qnn-{qnn}-htp-soc{o.soc_model}-"
                f"{'fp16' if o.fp16 else 'fp32'}-opset{o.opset}-rms-explicit-torch-{torch.__version__}")

    def provider_options(self) -> dict[str, str]:
        o = self.options
        opts = {"backend_path": str(self.htp_library()),
                "htp_performance_mode": o.performance_mode,
                "soc_model": str(o.soc_model)}
        if o.fp16:
            opts["enable_htp_fp16_precision"] = "1"
        return opts

    def _session(self, model_path: Path, ctx_path: Path | None, fallback: bool = False):
        ort, oq = _qnn_module()
        so = ort.SessionOptions()
        so.log_severity_level = 3
        if fallback:  # only to measure what would fall back (assignment)
            so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        else:
            so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        if ctx_path is not None:
            so.add_session_config_entry("ep.context_enable", "1")
            so.add_session_config_entry("ep.context_file_path", str(ctx_path))
        so.add_provider_for_devices(_ep_devices(ort, oq), self.provider_options())
        try:
            return ort.InferenceSession(str(model_path), sess_options=so)
        except Exception as exc:  # noqa: BLE001 - ORT raises its own Fail type
            raise BackendError(f"qnn: ONNX Runtime could not build a QNN HTP session for "
                               f"{model_path.name}: {exc}") from exc

    def _compile(self, module: ShardModule, example: tuple[torch.Tensor, ...],
                 folder: Path) -> None:
        onnx_dir = folder / "onnx"
        onnx_dir.mkdir()
        onnx_path = onnx_dir / ONNX_NAME
        self.export_onnx(module, example, onnx_path)
        self._session(onnx_path, folder / CTX_NAME)
        if not (folder / CTX_NAME).is_file():
            raise BackendError("qnn: the compile wrote no context model")
        # The context binary carries the weights; the ONNX export is not needed to run.
        # Keep it for AI Hub jobs and inspection.

    def export_onnx(self, module: ShardModule, example: tuple[torch.Tensor, ...],
                    onnx_path: Path) -> Path:
        """The shard graph as ONNX (what the HTP compile and AI Hub jobs take)."""
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the exporter's pytree notices
            torch.onnx.export(module, example, str(onnx_path),
                              input_names=input_names(module.blocks),
                              output_names=OUTPUT_NAMES, opset_version=self.options.opset,
                              dynamo=True, verbose=False)
        return Path(onnx_path)

    def _load(self, folder: Path, module: ShardModule) -> CompiledShard:
        return _OrtShard(module, self._session(folder / CTX_NAME, None))

    def onnx_path(self, folder: Path) -> Path:
        return folder / "onnx" / ONNX_NAME

    def assignment(self, onnx_path: Path) -> QnnAssignment:
        """Which provider takes each node of ``onnx_path`` when CPU fallback is allowed
        (one more HTP compile; nothing is written)."""
        return qnn_assignment(self._session(Path(onnx_path), None, fallback=True))
