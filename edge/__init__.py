"""SAKURA on-device runtime: fetch a template's compressed KV cache shard by shard and edit.

Modules: :mod:`edge.client` (aiohttp pack client: manifest, shard bodies, verification,
retry and resume; built from :mod:`edge.origins`, :mod:`edge.body_spec`, :mod:`edge.transfer`
and :mod:`edge.retry`), :mod:`edge.monitor` (bandwidth and execution-progress bookkeeping),
:mod:`edge.allocator` (per-shard configuration choice and the policy registry),
:mod:`edge.pipeline` (receive -> reconstruct -> execute with bounded buffers and a per-shard
timeline), :mod:`edge.runtime` (one edit end to end), :mod:`edge.bench` and
:mod:`edge.cli` (``sakura edit``, ``sakura bench edit``).
"""

# The device runtimes: "native" (the shard loop in C++, sakura.edge.native_runtime) and
# "python" (the reference pipeline, sakura.edge.pipeline).
RUNTIMES = ("native", "python")
# The shard graphs' precisions (EditOptions.precision, edge.backends.int8): "fp32", and
# "int8" (the bundle's int8 XNNPACK block-group graphs, native runtime only).
PRECISIONS = ("fp32", "int8")
