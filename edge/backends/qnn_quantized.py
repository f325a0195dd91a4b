"""Quantized QNN HTP shards: QDQ shard graphs calibrated on real shard inputs.

Real HTP deployments run integer graphs. This backend turns a shard graph into a QDQ ONNX
model with ONNX Runtime's QNN quantization tools (``onnxruntime.quantization``:
``qnn_preprocess_model``, ``get_qnn_qdq_config``, ``quantize``; MinMax calibration) and
compiles it to a QNN context binary through the same onnxruntime-qnn session as the fp16
backend (``edge.backends.qnn_backend``), so it runs on the HTP (the x86 simulator here).

Schemes: ``w8a16`` (8-bit weights, 16-bit activations: Qualcomm's usual choice for
transformers) and ``w8a8``. Unsigned asymmetric per-tensor quantization, as the QNN tools
default to. The float graph is exported at opset 21 (16-bit QuantizeLinear needs it).

Where the nodes run: the compiled context model is one EPContext node with float inputs
(the HTP quantizes the inputs and dequantizes the outputs itself). A session that *allows*
CPU fallback (``QnnBackend.assignment``) leaves those boundary QuantizeLinear /
DequantizeLinear nodes (one per graph input and output) to ONNX Runtime's CPU EP; on a phone
the app would feed quantized tensors instead (AI Hub's ``--quantize_io``).

Calibration uses real shard inputs, never random ones: :func:`capture_calibration` runs
masked edits of a template with the trained model on the torch backend and records every
shard graph's inputs (hidden states, modulation, RoPE and the template's streamed cache) at
every denoising step. The artifact key includes a digest of those inputs, so another
calibration set is another compiled graph.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sakura.dit.cache import KVProvider
from sakura.dit.editing import EditRequest, Geometry, Template
from sakura.dit.model import MMDiT
from sakura.edge.backends import create_backend
from sakura.edge.backends.base import BackendConfig, CompiledShard
from sakura.edge.backends.errors import BackendError
from sakura.edge.backends.executor import ShardExecutor, edit_geometry
from sakura.edge.backends.qnn_backend import CTX_NAME, ONNX_NAME, QnnBackend
from sakura.edge.backends.shard import ShardModule, input_names

QDQ_NAME = "shard_qdq.onnx"
Calibration = dict[tuple[int, ...], list[list[torch.Tensor]]]


@dataclass(frozen=True)
class QuantScheme:
    """Integer types of one quantization scheme (``onnxruntime.quantization.QuantType``)."""

    name: str
    activation: str  # QuantType member name
    weight: str

    def types(self):
        from onnxruntime.quantization import QuantType

        return QuantType[self.activation], QuantType[self.weight]


SCHEMES = {"w8a16": QuantScheme("w8a16", "QUInt16", "QUInt8"),
           "w8a8": QuantScheme("w8a8", "QUInt8", "QUInt8")}


class _Recorder(CompiledShard):
    """Runs a shard and keeps its inputs at every step it is asked for."""

    def __init__(self, inner: CompiledShard, sink: list, state: dict,
                 steps: set[int] | None) -> None:
        super().__init__(inner.blocks, inner.shapes)
        self.inner, self.sink, self.state, self.steps = inner, sink, state, steps

    def _run(self, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.steps is None or self.state["step"] in self.steps:
            self.sink.append([x.detach().clone() for x in inputs])
        return self.inner._run(inputs)


def capture_calibration(model: MMDiT, template: Template, geo: Geometry, provider: KVProvider,
                        requests: Sequence[EditRequest], groups: list[tuple[int, ...]],
                        steps: set[int] | None = None) -> Calibration:
    """Inputs of every shard graph at ``steps`` (default: all) of edits of ``template`` with
    ``requests`` (torch backend, the trained ``model``, the template's cache)."""
    out: Calibration = {tuple(g): [] for g in groups}
    for req in requests:
        ex = ShardExecutor(model, create_backend("torch"))
        geometry = edit_geometry(model, template, geo, req)
        state = {"step": 0}
        for blocks in groups:
            ex.use(geometry, blocks,
                   _Recorder(ex.shard(geometry, blocks), out[tuple(blocks)], state, steps))

        def on_step(s: int, state=state) -> None:
            state["step"] = s + 1

        with torch.inference_mode():
            ex.edit(template, geo, provider, req, groups, on_step=on_step)
    return out


def calibration_digest(calibration: Calibration) -> str:
    h = hashlib.sha256()
    for blocks in sorted(calibration):
        h.update(repr(blocks).encode())
        for feed in calibration[blocks]:
            for x in feed:
                h.update(x.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


class _Reader:
    """``onnxruntime.quantization.CalibrationDataReader`` over recorded shard inputs."""

    def __init__(self, names: list[str], feeds: list[list[torch.Tensor]]) -> None:
        self._it = iter([{n: x.float().numpy() for n, x in zip(names, feed)} for feed in feeds])
        self._len = len(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def __len__(self) -> int:
        return self._len


class QnnQuantizedBackend(QnnBackend):
    """The QNN HTP backend on QDQ (integer) shard graphs; needs :attr:`calibration`."""

    name = "qnn-quantized"

    def __init__(self, config: BackendConfig | None = None, scheme: str = "w8a16",
                 calibration: Calibration | None = None) -> None:
        super().__init__(config)
        if "opset" not in self.config.options:
            self.options = replace(self.options, opset=21)
        if scheme not in SCHEMES:
            raise BackendError(f"unknown quantization scheme {scheme!r} "
                               f"(known: {', '.join(SCHEMES)})")
        self.scheme = SCHEMES[scheme]
        self.calibration = calibration or {}
        self._digest = calibration_digest(self.calibration)

    def version(self) -> str:
        return f"{super().version()}-qdq-{self.scheme.name}-minmax-cal{self._digest[:16]}"

    def _compile(self, module: ShardModule, example: tuple[torch.Tensor, ...],
                 folder: Path) -> None:
        from onnxruntime.quantization import quantize
        from onnxruntime.quantization.execution_providers.qnn import (
            get_qnn_qdq_config,
            qnn_preprocess_model,
        )

        feeds = self.calibration.get(tuple(module.blocks))
        if not feeds:
            raise BackendError(f"qnn-quantized: no calibration inputs for blocks "
                               f"{module.blocks} (capture_calibration)")
        onnx_dir = folder / "onnx"
        onnx_dir.mkdir()
        float_path = self.export_onnx(module, example, onnx_dir / ONNX_NAME)
        pre = folder / "shard_pre.onnx"
        if not qnn_preprocess_model(str(float_path), str(pre), save_as_external_data=False):
            pre = float_path  # nothing to fuse
        activation, weight = self.scheme.types()
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)  # the tools' advice to pre-process (done above)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = get_qnn_qdq_config(
                    str(pre), _Reader(input_names(module.blocks), feeds),
                    activation_type=activation, weight_type=weight)
                quantize(str(pre), str(folder / QDQ_NAME), config)
        finally:
            root.setLevel(level)
        import onnx

        qdq = onnx.load(str(folder / QDQ_NAME))
        if requantize_concat_inputs(qdq):
            onnx.save(qdq, str(folder / QDQ_NAME))
        if pre != float_path:
            pre.unlink()
        self._session(folder / QDQ_NAME, folder / CTX_NAME)
        if not (folder / CTX_NAME).is_file():
            raise BackendError("qnn-quantized: the compile wrote no context model")

    def qdq_path(self, folder: Path) -> Path:
        return folder / QDQ_NAME


def requantize_concat_inputs(model: Any) -> int:
    """Give every quantized Concat inputs in its output's encoding; returns how many
    inputs got a requantize (QuantizeLinear -> DequantizeLinear) pair.

    The QDQ tools quantize each Concat input with its own scale. ONNX Runtime's CPU EP
    dequantizes, concatenates and requantizes; the QNN HTP's Concat does not requantize its
    inputs: on the simulator (QAIRT 2.51) the first Concat of the shipped model's shard
    (the text and image queries) came out at 11.7 dB SQNR against the CPU EP's result and
    the shard output at 21-26 dB instead of 42-45 dB. An explicit DQ -> Q pair into the
    output's scale / zero point before the Concat is what the HTP runs as a Convert.
    """
    import onnx

    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    init = {t.name: t for t in graph.initializer}
    added = 0
    new_nodes: list = []
    for node in list(graph.node):
        if node.op_type != "Concat":
            continue
        quants = [n for n in consumers.get(node.output[0], []) if n.op_type == "QuantizeLinear"]
        if len(quants) != 1 or len(quants[0].input) < 3:
            continue
        scale, zero = quants[0].input[1], quants[0].input[2]
        for k, x in enumerate(node.input):
            dq = producer.get(x)
            if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) < 3:
                continue
            if (dq.input[1], dq.input[2]) == (scale, zero):
                continue
            zp_in, zp_out = init.get(dq.input[2]), init.get(zero)
            if zp_in is None or zp_out is None or zp_in.data_type != zp_out.data_type:
                continue
            base = f"{node.name or node.output[0]}_in{k}"
            q_out, dq_out = f"{base}_requant", f"{base}_requant_dq"
            new_nodes.append((node, [
                onnx.helper.make_node("QuantizeLinear", [x, scale, zero], [q_out],
                                      name=f"{base}_requant_q"),
                onnx.helper.make_node("DequantizeLinear", [q_out, scale, zero], [dq_out],
                                      name=f"{base}_requant_dq")]))
            node.input[k] = dq_out
            added += 1
    for concat, nodes in new_nodes:  # keep the graph topologically sorted
        at = list(graph.node).index(concat)
        for offset, n in enumerate(nodes):
            graph.node.insert(at + offset, n)
    return added


def qdq_summary(path: Path) -> dict[str, Any]:
    """What the QDQ graph quantizes: Q/DQ node counts and the integer types used."""
    import onnx

    model = onnx.load(str(path))
    init = {t.name: t for t in model.graph.initializer}
    ops: dict[str, int] = {}
    zero_point_types: dict[str, int] = {}
    for node in model.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 2:
            zp = init.get(node.input[2])
            if zp is not None:
                name = onnx.TensorProto.DataType.Name(zp.data_type)
                zero_point_types[name] = zero_point_types.get(name, 0) + 1
    return {"quantize_linear": ops.get("QuantizeLinear", 0),
            "dequantize_linear": ops.get("DequantizeLinear", 0),
            "zero_point_types": zero_point_types,
            "nodes": sum(ops.values())}
