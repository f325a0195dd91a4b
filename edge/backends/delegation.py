"""Where the ops of a compiled shard graph run: inside the accelerator's delegate, or not.

A numeric test cannot tell a fully delegated shard from a partly delegated one (the
portable CPU kernels compute the same function), so the compiled artifacts are checked
structurally:

* **ExecuTorch / XNNPACK**: :func:`xnnpack_delegation` reads ExecuTorch's own delegation
  info (``executorch.devtools.backend_debug.get_delegation_info``) of the lowered program:
  the ops inside XNNPACK subgraphs and the ops left outside. ``getitem`` nodes (the tuple
  unpacking of a delegate's outputs) compute nothing and are not counted.
  :func:`pte_kernel_calls` reads the serialized ``.pte`` itself: every instruction of its
  execution plan that is not a delegate call is an operator the runtime would execute on
  its portable CPU kernels.
* **ONNX Runtime QNN EP**: :func:`qnn_assignment` builds a session that *allows* CPU
  fallback and records ONNX Runtime's graph assignment
  (``session.record_ep_graph_assignment_info``): the nodes each execution provider took.
  The product's sessions disable CPU fallback, so a shard that would fall back fails to
  compile; this measures how many nodes would have.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Not compute: unpacking a delegate's (or a multi-output op's) result tuple.
NON_COMPUTE = frozenset({"getitem"})
DELEGATION_FILE = "delegation.json"


@dataclass
class XnnpackDelegation:
    """Ops of one lowered program inside / outside the XNNPACK delegate."""

    delegated_ops: int
    subgraphs: int
    outside: dict[str, int] = field(default_factory=dict)  # op type -> count, compute only

    @property
    def outside_ops(self) -> int:
        return sum(self.outside.values())

    @property
    def fraction(self) -> float:
        total = self.delegated_ops + self.outside_ops
        return self.delegated_ops / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "outside_ops": self.outside_ops, "fraction": self.fraction}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> XnnpackDelegation:
        return cls(int(doc["delegated_ops"]), int(doc["subgraphs"]),
                   {str(k): int(v) for k, v in doc.get("outside", {}).items()})

    def write(self, folder: Path) -> None:
        (Path(folder) / DELEGATION_FILE).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def read(cls, folder: Path) -> XnnpackDelegation:
        return cls.from_dict(json.loads((Path(folder) / DELEGATION_FILE).read_text()))


def xnnpack_delegation(graph_module: Any) -> XnnpackDelegation:
    """ExecuTorch's delegation info of a lowered graph module
    (``to_edge_transform_and_lower(...).exported_program().graph_module``)."""
    from executorch.devtools.backend_debug import get_delegation_info

    info = get_delegation_info(graph_module)
    outside = {op: b.non_delegated for op, b in info.delegation_by_operator.items()
               if b.non_delegated and op not in NON_COMPUTE}
    return XnnpackDelegation(int(info.num_delegated_nodes), int(info.num_delegated_subgraphs),
                             dict(sorted(outside.items())))


@dataclass(frozen=True)
class PteCalls:
    """The instructions of a ``.pte`` program's ``forward`` plan."""

    delegates: tuple[str, ...]      # backend id of every delegate call
    kernels: dict[str, int]         # operator -> kernel calls outside any delegate


def pte_kernel_calls(pte: bytes, method: str = "forward") -> PteCalls:
    """Count the delegate and kernel calls of ``method`` in a serialized program."""
    from executorch.exir._serialize._program import deserialize_pte_binary
    from executorch.exir.schema import DelegateCall, KernelCall

    program = deserialize_pte_binary(pte).program
    plans = [p for p in program.execution_plan if p.name == method]
    if not plans:
        raise ValueError(f"the program has no method {method!r}")
    plan = plans[0]
    delegates: list[str] = []
    kernels: Counter[str] = Counter()
    for chain in plan.chains:
        for ins in chain.instructions:
            args = ins.instr_args
            if isinstance(args, DelegateCall):
                delegates.append(plan.delegates[args.delegate_index].id)
            elif isinstance(args, KernelCall):
                op = plan.operators[args.op_index]
                kernels[f"{op.name}.{op.overload}" if op.overload else op.name] += 1
    return PteCalls(tuple(delegates), dict(sorted(kernels.items())))


@dataclass
class QnnAssignment:
    """Nodes of an ONNX graph per execution provider, as ONNX Runtime assigned them."""

    nodes: dict[str, int]                   # provider -> nodes
    cpu_ops: dict[str, int] = field(default_factory=dict)  # op type -> nodes on the CPU EP
    cpu_nodes: list[str] = field(default_factory=list)     # their node names

    @property
    def cpu_fallback_nodes(self) -> int:
        return sum(n for ep, n in self.nodes.items() if ep != "QNNExecutionProvider")

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "cpu_ops": self.cpu_ops,
                "cpu_fallback_nodes": self.cpu_fallback_nodes}

    def boundary_only(self, onnx_path: Path) -> bool:
        """Whether every node off the QNN EP is a QuantizeLinear of a graph input or a
        DequantizeLinear of a graph output (the I/O conversion of a QDQ graph)."""
        import onnx

        graph = onnx.load(str(onnx_path), load_external_data=False).graph
        inputs = {i.name for i in graph.input}
        outputs = {o.name for o in graph.output}
        by_name = {n.name: n for n in graph.node}
        for name in self.cpu_nodes:
            # ONNX Runtime's graph optimizer names a duplicated node "<name>_token_<k>"
            base = re.sub(r"_token_\d+$", "", name)
            node = by_name.get(base)
            if node is None:
                # a QuantizeLinear ONNX Runtime adds at session time for a float graph
                # input that reaches quantized ops through data movement (Slice, Unsqueeze)
                if base.endswith("_q") and base[:-2] in inputs:
                    continue
                return False
            if node.op_type == "QuantizeLinear" and node.input[0] in inputs:
                continue
            if node.op_type == "DequantizeLinear" and node.output[0] in outputs:
                continue
            return False
        return True


def qnn_assignment(session: Any) -> QnnAssignment:
    """The graph assignment of an ONNX Runtime session created with
    ``session.record_ep_graph_assignment_info=1``."""
    nodes: Counter[str] = Counter()
    cpu: Counter[str] = Counter()
    names: list[str] = []
    for sub in session.get_provider_graph_assignment_info():
        for node in sub.get_nodes():
            nodes[sub.ep_name] += 1
            if sub.ep_name != "QNNExecutionProvider":
                cpu[node.op_type] += 1
                names.append(node.name)
    return QnnAssignment(dict(sorted(nodes.items())), dict(sorted(cpu.items())), names)


def onnx_compute_nodes(path: Path) -> int:
    """Nodes of an ONNX model's main graph (what a provider has to take)."""
    import onnx

    return len(onnx.load(str(path), load_external_data=False).graph.node)


def context_cpu_nodes(ctx_path: Path) -> dict[str, int]:
    """Nodes of a compiled EP-context model other than ``EPContext`` (op type -> count):
    what the product's session would run outside the QNN EP."""
    import onnx

    model = onnx.load(str(ctx_path), load_external_data=False)
    return dict(Counter(n.op_type for n in model.graph.node if n.op_type != "EPContext"))
