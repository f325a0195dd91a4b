"""``sakura bench dynamic``: one dynamic-shape ExecuTorch graph vs the static graphs.

For the shard graphs of one catalog template (and its ``StepIn`` / ``StepOut``):

* compile time (wall and this process's CPU seconds) of the static ``.pte`` of the
  template's geometry and of the dynamic ``.pte`` (``ShardModule(dynamic=True)`` exported
  with ``ShardBounds``: every M, U with M + U = N), and their delegation (compute ops
  outside the XNNPACK delegate, target 0);
* latency of both at the template's geometry, runs interleaved (static, dynamic, dynamic,
  static, ...) on the real inputs of a mid-edit step, median over ``repeats``, with the
  ExecuTorch threadpool at ``threads``;
* max abs error of both against the torch module (the plain shard graph) on those inputs;
* the dynamic ``.pte`` at the geometry of every catalog template of the same size: max abs
  error against the torch module of that geometry (seeded inputs) and latency.

The machine's load average is recorded at start and end: timings taken beside other jobs
are comparable within one run only.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from sakura.codec import DEFAULT_BLOCKS_PER_SHARD
from sakura.dit.editing import EditRequest, Template, template_run
from sakura.dit.model import MMDiT
from sakura.edge.backends.bench import shard_inputs
from sakura.edge.backends.executor import edit_geometry, step_groups
from sakura.edge.backends.executorch_backend import lower
from sakura.edge.backends.shard import ShardBounds, ShardGeometry, ShardModule, example_inputs
from sakura.edge.backends.step import StepIn, StepOut, step_dynamic_shapes, step_examples


def _compile(module: torch.nn.Module, example: tuple, shapes: Any, path: Path
             ) -> dict[str, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    pte, delegation = lower(module, example, shapes)
    doc = {"compile_s": time.perf_counter() - wall, "compile_cpu_s": time.process_time() - cpu,
           "pte_bytes": len(pte), "outside_delegate": delegation.outside,
           "delegate_subgraphs": delegation.subgraphs}
    path.write_bytes(pte)
    return doc


def _method(path: Path):
    from executorch.runtime import Runtime

    return Runtime.get().load_program(str(path)).load_method("forward")


def _err(got, want) -> float:
    return max(float((g - w).abs().max()) for g, w in zip(got, want))


def _interleaved(methods: dict[str, Any], inputs: dict[str, list], repeats: int
                 ) -> dict[str, float]:
    """Median seconds per run of each method; the order alternates every repeat."""
    names = list(methods)
    for n in names:  # warm-up (first-run allocations)
        methods[n].execute(inputs[n])
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            methods[n].execute(inputs[n])
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def dynamic_inputs(xs: list[torch.Tensor], txt: int) -> list[torch.Tensor]:
    """The dynamic graph's inputs for the static graph's ``xs``: the RoPE tables' image
    rows (the text rows are constants of the dynamic graph)."""
    return [*xs[:4], xs[4][txt:].contiguous(), xs[5][txt:].contiguous(), *xs[6:]]


def bench_dynamic(model: MMDiT, template: Template, req: EditRequest,
                  others: dict[str, ShardGeometry], blocks_per_shard: int = DEFAULT_BLOCKS_PER_SHARD,
                  repeats: int = 20, threads: int = 1, template_id: str = "",
                  log: Callable[[str], None] = lambda msg: None) -> dict[str, Any]:
    """Measure (see the module docstring); ``others``: geometries of other templates to run
    the dynamic graphs at. Returns the JSON document."""
    from executorch.extension.pybindings import portable_lib

    portable_lib._unsafe_reset_threadpool(threads)
    torch.set_num_threads(threads)
    load_start = os.getloadavg()
    groups = step_groups(model.cfg.num_blocks, blocks_per_shard)
    log(f"template run ({template.steps} steps)")
    run = template_run(model, template)
    geo = run.geometry
    geometry = edit_geometry(model, template, geo, req)
    bounds = ShardBounds(geometry.batch, geometry.txt, geometry.img + geometry.cached)
    step = template.steps // 2
    inputs = shard_inputs(model, template, geo, run.cache.to_fp16_exact(), req, groups, step)
    doc: dict[str, Any] = {
        "template": template_id, "geometry": geometry.to_dict(), "bounds": bounds.to_dict(),
        "traced_example": bounds.example().to_dict(), "groups": [list(g) for g in groups],
        "timed_step": step, "repeats": repeats, "threads": threads,
        "executorch_threads": portable_lib._threadpool_get_thread_count(),
        "shards": [], "steps": {}, "other_geometries": {}}
    with tempfile.TemporaryDirectory(prefix="sakura-dynamic-") as tmp:
        folder = Path(tmp)
        dynamic_methods = {}
        for blocks, xs in inputs:
            name = f"b{blocks[0]}-{blocks[-1]}"
            log(f"shard {name}: static compile")
            static = _compile(ShardModule(model, blocks, geometry, sigmoid_gelu=True,
                                          delegable=True).eval(),
                              example_inputs(model, blocks, geometry), None,
                              folder / f"{name}-static.pte")
            log(f"shard {name}: dynamic compile")
            example = bounds.example()
            dynamic = _compile(ShardModule(model, blocks, example, dynamic=True).eval(),
                               example_inputs(model, blocks, example, dynamic=True),
                               bounds.dynamic_shapes(blocks), folder / f"{name}-dynamic.pte")
            methods = {"static": _method(folder / f"{name}-static.pte"),
                       "dynamic": _method(folder / f"{name}-dynamic.pte")}
            dynamic_methods[blocks] = methods["dynamic"]
            runs = {"static": list(xs), "dynamic": dynamic_inputs(list(xs), geometry.txt)}
            with torch.no_grad():
                want = ShardModule(model, blocks, geometry).eval()(*xs)
            for key, method in methods.items():
                (static if key == "static" else dynamic)["max_abs_err"] = _err(
                    method.execute(runs[key]), want)
            log(f"shard {name}: timing")
            lat = _interleaved(methods, runs, repeats)
            static["latency_s"], dynamic["latency_s"] = lat["static"], lat["dynamic"]
            doc["shards"].append({
                "blocks": list(blocks), "static": static, "dynamic": dynamic,
                "max_abs_output": max(float(w.abs().max()) for w in want),
                "dynamic_over_static_latency": lat["dynamic"] / lat["static"],
                "dynamic_over_static_compile": dynamic["compile_s"] / static["compile_s"]})
        log("step graphs")
        ex = step_examples(model, geometry.batch, geometry.img)
        shapes = step_dynamic_shapes(bounds.tokens)
        for name, module in (("step_in", StepIn(model, geometry.batch)),
                             ("step_out", StepOut(model, geometry.batch))):
            module = module.eval()
            s = _compile(module, ex[name], None, folder / f"{name}-static.pte")
            d = _compile(module, ex[name], shapes[name], folder / f"{name}-dynamic.pte")
            methods = {"static": _method(folder / f"{name}-static.pte"),
                       "dynamic": _method(folder / f"{name}-dynamic.pte")}
            lat = _interleaved(methods, {k: list(ex[name]) for k in methods}, repeats)
            s["latency_s"], d["latency_s"] = lat["static"], lat["dynamic"]
            doc["steps"][name] = {"static": s, "dynamic": d}
        for tid, g in others.items():
            if not bounds.contains(g):
                doc["other_geometries"][tid] = {"geometry": g.to_dict(), "in_bounds": False}
                continue
            errs, lats = [], []
            for blocks, method in dynamic_methods.items():
                xs = example_inputs(model, blocks, g, seed=g.img, dynamic=True)
                ang = model.angles(model.text_positions(g.txt)).float()
                full = (*xs[:4], torch.cat([ang.cos(), xs[4]]), torch.cat([ang.sin(), xs[5]]),
                        *xs[6:])
                with torch.no_grad():
                    want = ShardModule(model, blocks, g).eval()(*full)
                errs.append(_err(method.execute(list(xs)), want))
                lats.append(_interleaved({"d": method}, {"d": list(xs)}, repeats)["d"])
            doc["other_geometries"][tid] = {"geometry": g.to_dict(), "in_bounds": True,
                                            "max_abs_err": max(errs),
                                            "shard_latency_s": lats}
    doc["load_average_start"] = list(load_start)
    doc["load_average_end"] = list(os.getloadavg())
    return doc
