"""The device's two shard loops behind one interface: :class:`Runner`.

:class:`~edge.runtime.EdgeRuntime` does what every edit does whichever loop runs it (the
manifest and its cache, the allocator, the rate memory, the startup allowance, the result)
and hands the loop itself to a runner chosen once, at construction:

* :class:`PythonRunner`: the reference pipeline (:mod:`edge.pipeline`: aiohttp receive,
  a reconstruct thread, the DiT in torch or a compiled backend of :mod:`edge.backends`);
* :class:`NativeRunner`: the C++ loop (:mod:`edge.native_runtime`, ``sakura_native``:
  libcurl receive, native decoders, ExecuTorch graphs).

A runner makes the loop's own bookkeeping objects (the bandwidth monitor and execution
progress are Python classes here and their C++ twins there, tested against the same unit
tests), calibrates execution, runs ``local`` and a streamed edit, and returns per-shard
records with the same fields (``ShardRecord``), so nothing above this module asks which
runtime it is on. A new loop (say, an on-phone binary driven over a socket) is one more
class with these methods, registered in :data:`RUNNERS`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import torch
from sakura.codec.pack import Manifest, decode_config
from sakura.edge.allocator import to_native
from sakura.edge.backends.base import weights_sha256
from sakura.edge.bundle import DeviceBundles
from sakura.edge.calibration import ExecProfile
from sakura.edge.client import (
    PackClient,
    RequestRecord,
    Transfer,
    prefix_extensions,
    prefix_fallbacks,
)
from sakura.edge.deadlines import local_wait_s
from sakura.edge.errors import EdgeError, NativeUnavailable
from sakura.edge.monitor import BandwidthMonitor, ExecutionProgress
from sakura.edge.native_runtime import (
    NativeEngine,
    decode_kind,
    rope_table,
    stream_shards,
    stream_spec,
)
from sakura.edge.native_status import native_module
from sakura.edge.netloop import NetLoop
from sakura.edge.options import EditOptions
from sakura.edge.pipeline import Pipeline

if TYPE_CHECKING:  # (the runtime imports this module)
    from sakura.dit.adapters.engine import Prepared
    from sakura.dit.editing import Template
    from sakura.edge.native_runtime import NativeEngine
    from sakura.edge.runtime import EdgeRuntime


@dataclass
class StreamJob:
    """Everything one streamed edit has settled before its shard loop starts."""

    net: NetLoop
    client: PackClient
    template_id: str
    codec: str
    manifest_dict: dict[str, Any]
    manifest: Manifest
    prep: Prepared
    req: Any
    allocator: Any
    monitor: Any
    progress: Callable[[], Any]  # makes the execution progress: call it as the loop starts
    origin: float
    opts: EditOptions
    log: list[RequestRecord]
    derived: dict[str, Any]
    exec_s: list[float] = field(default_factory=list)  # predicted per-shard execution
    local_step_s: float | None = None  # one full-token step, measured (ExecProfile)

    def describe(self, shard: int, config: int) -> dict[str, Any]:
        return dict(self.manifest.shard(shard).config(config).params)


class Runner(Protocol):
    """One shard loop (see the module docstring)."""

    name: str

    def check(self, opts: EditOptions) -> None:
        """Raise :class:`EdgeError` for options this loop cannot honour."""

    def monitor(self, k: int, prior: float | None) -> Any:
        """A bandwidth monitor of this loop (``BandwidthMonitor``'s interface)."""

    def progress(self, exec_s: list[float], origin: float, allowance_s: float,
                 now: float) -> Any:
        """Execution progress of this loop (``ExecutionProgress.with_allowance``)."""

    def profile(self, device: EdgeRuntime, server: str, template_id: str, prep: Prepared,
                req: Any, codec: str, token: str | None, opts: EditOptions) -> ExecProfile:
        """The calibrated execution time of every block (graphs loaded: before the clock)."""

    def warm(self, device: EdgeRuntime, job_derived: dict[str, Any],
             manifest_dict: dict[str, Any], manifest: Manifest, url: str) -> None:
        """What the loop derives from a manifest before its first request."""

    def prepare_local(self, device: EdgeRuntime, template: Template, req: Any,
                      precision: str = "fp32") -> None:
        """Compile / load what ``local`` runs (before the clock)."""

    def local(self, device: EdgeRuntime, template: Template, prep: Prepared,
              req: Any, precision: str = "fp32") -> torch.Tensor:
        """The whole model on the device, no cache (``precision``: the edit's
        ``EditOptions.precision``, which :meth:`check` accepted)."""

    def stream(self, device: EdgeRuntime, job: StreamJob
               ) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        """The streamed edit: (image, per-shard records as dicts)."""


class PythonRunner:
    """The reference pipeline (:mod:`edge.pipeline`) on torch or a compiled backend."""

    name = "python"

    def check(self, opts: EditOptions) -> None:
        if opts.reconstruct != "cpu":
            raise EdgeError("reconstruct opencl is a stage of the native runtime "
                            "(--runtime native)")
        if opts.precision != "fp32":
            # the int8 shard graphs run in the native runner only (edge.backends.int8)
            raise EdgeError(f"precision {opts.precision} runs on the native runtime "
                            "(--runtime native); the Python runtime executes fp32")

    def monitor(self, k: int, prior: float | None) -> BandwidthMonitor:
        return BandwidthMonitor(k, prior)

    def progress(self, exec_s: list[float], origin: float, allowance_s: float,
                 now: float) -> ExecutionProgress:
        return ExecutionProgress.with_allowance(exec_s, origin, allowance_s, now=now)

    @staticmethod
    def computes_late_steps(device: EdgeRuntime) -> bool:
        """Whether this device's loop has the local fallback: the torch engine's
        ``cached_edit`` does (``StepLate``), a compiled backend's or an adapter's not."""
        return device.backend.is_torch and device.engine.computes_late_steps

    def profile(self, device: EdgeRuntime, server: str, template_id: str, prep: Prepared,
                req: Any, codec: str, token: str | None, opts: EditOptions) -> ExecProfile:
        profile = device.profile(template_id, prep, req)
        if (opts.local_fallback and profile.local_step_s is None
                and self.computes_late_steps(device)):
            # the local fallback's step, timed once per layout (as the native runner's)
            began = time.perf_counter()
            device.engine.local_edit(prep, req)
            profile.local_step_s = (time.perf_counter() - began) / max(1, prep.template.steps)
        return profile

    def warm(self, device: EdgeRuntime, job_derived: dict[str, Any],
             manifest_dict: dict[str, Any], manifest: Manifest, url: str) -> None:
        return None

    def prepare_local(self, device: EdgeRuntime, template: Template, req: Any,
                      precision: str = "fp32") -> None:
        return None

    def local(self, device: EdgeRuntime, template: Template, prep: Prepared,
              req: Any, precision: str = "fp32") -> torch.Tensor:
        return device.engine.local_edit(prep, req)

    def stream(self, device: EdgeRuntime, job: StreamJob
               ) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        manifest, opts = job.manifest, job.opts
        if opts.http_version != "1.1" or opts.pack_origin:
            raise EdgeError("the python runtime speaks HTTP/1.1 to the server only "
                            "(http_version 2 and pack_origin are the native runtime's)")
        layout = manifest.layout()
        codec_impl = manifest.make_codec()

        async def fetch(shard: int, config: int, transfer: Transfer):
            return await job.client.fetch_config(job.template_id, job.codec, shard, config,
                                                 manifest=job.manifest_dict,
                                                 transfer=transfer)

        def fallbacks(shard: int, config: int) -> list[tuple[int, int]]:
            # the policy's configurations of this shard that are prefixes of its choice
            # (memoised with what else was derived from this manifest)
            accepted = getattr(job.allocator, "fallbacks", None)
            candidates = tuple(accepted(shard)) if accepted is not None else ()
            key = ("fallbacks", shard, config, candidates)
            if key not in job.derived:
                job.derived[key] = prefix_fallbacks(job.manifest_dict, shard, config,
                                                    candidates)
            return job.derived[key]

        async def fetch_more(shard: int, base: int, config: int, transfer: Transfer):
            return await job.client.fetch_extension(job.template_id, job.codec, shard, base,
                                                    config, manifest=job.manifest_dict,
                                                    transfer=transfer)

        def extensions(shard: int, config: int) -> list[tuple[int, int]]:
            # the policy's configurations of this shard that begin with this one's bytes
            accepted = getattr(job.allocator, "fallbacks", None)
            candidates = tuple(accepted(shard)) if accepted is not None else ()
            key = ("extensions", shard, config, candidates)
            if key not in job.derived:
                job.derived[key] = prefix_extensions(job.manifest_dict, shard, config,
                                                     candidates)
            return job.derived[key]

        def decode(shard: int, config: int, data: bytes) -> list[torch.Tensor]:
            return decode_config(manifest, shard, config, data, codec_impl)

        def allocate(shard: int, window, rate: float, stale=None) -> int:
            return job.allocator.choose(shard, window.window_s, rate, stale)

        def config_bytes(shard: int, config: int) -> int:
            return int(manifest.shard(shard).config(config).bytes)

        shard_blocks = [layout.blocks_of(i) for i in range(layout.num_shards)]
        backend = device.backend
        geo = job.prep.geometry
        local_s = (local_wait_s(job.local_step_s, job.exec_s, job.prep.template.steps,
                                len(geo.masked) + len(geo.unmasked), len(geo.masked))
                   if opts.local_fallback and self.computes_late_steps(device) else None)
        pipe = Pipeline(shard_blocks, fetch=fetch, decode=decode, allocate=allocate,
                        monitor=job.monitor, progress=job.progress(), origin=job.origin,
                        max_ahead=opts.max_ahead, max_ready=opts.max_ready,
                        describe=job.describe, config_bytes=config_bytes,
                        max_inflight=opts.max_inflight, lookahead_rtts=opts.lookahead_rtts,
                        max_ahead_cap=opts.max_ahead_cap, fallbacks=fallbacks,
                        local_step_s=local_s, stale_max_age=opts.stale_max_age,
                        extensions=extensions if opts.refine else None,
                        fetch_more=fetch_more,
                        skippable=job.allocator.skippable if opts.stale_plan else None,
                        plan_local=(opts.stale_plan_local
                                    and device.engine.recomputes_late_steps(job.prep)))
        pipe.start(job.net)
        try:
            prep = job.prep
            image = (device.engine.edit(prep, pipe.provider, job.req) if backend.is_torch
                     else backend.edit(device.model, prep.template, prep.geometry,
                                       pipe.provider, job.req, layout.blocks_per_shard))
        except BaseException:
            pipe.close()
            raise
        pipe.finish()
        return image, [r.to_dict() for r in pipe.records]


class NativeRunner:
    """The C++ shard loop (``sakura_native``) of the shipped MMDiT."""

    name = "native"

    def __init__(self, compiled_dir: Any = None) -> None:
        self._compiled_dir = compiled_dir
        self._engine: NativeEngine | None = None
        self._engines: dict[str, NativeEngine] = {}  # other precisions than fp32
        # the templates' device bundles (edge.bundle): graphs exported in the cloud,
        # downloaded once and cached beside the compiled graphs
        self.bundles = (DeviceBundles(Path(compiled_dir) / "bundles") if compiled_dir
                        else DeviceBundles())

    def engine(self, device: EdgeRuntime, precision: str = "fp32") -> NativeEngine:
        """The native engine (compiled graphs of the shipped MMDiT) whose shard graphs have
        ``precision`` (an edit's ``EditOptions.precision``; the ``local`` policy and the
        shard tables are fp32's), created on first use."""
        if self._engine is None:
            if not device.default_model:
                raise NativeUnavailable(f"{device.engine.name} runs on the Python runtime "
                                        "(--runtime python); the native runtime runs the "
                                        "shipped MMDiT")
            kw = {"cache_dir": self._compiled_dir} if self._compiled_dir else {}
            self._engine = NativeEngine(device.model, device.weights_sha256
                                        or weights_sha256(device.model), **kw)
        if precision == "fp32":
            return self._engine
        # EditOptions.precision "int8": the block groups' int8 graphs (edge.backends.int8),
        # the same bundled chains (the int8 sets have their own digests)
        other = self._engines.get(precision)
        if other is None:
            kw = {"cache_dir": self._compiled_dir} if self._compiled_dir else {}
            other = NativeEngine(device.model, self._engine.weights_sha256,
                                 precision=precision, **kw)
            other._bundled = self._engine._bundled
            self._engines[precision] = other
        return other

    def check(self, opts: EditOptions) -> None:
        return None

    def monitor(self, k: int, prior: float | None) -> Any:
        return native_module().BandwidthMonitor(k, prior)

    def progress(self, exec_s: list[float], origin: float, allowance_s: float,
                 now: float) -> Any:
        return native_module().ExecutionProgress.with_allowance(exec_s, origin, allowance_s,
                                                                now=now)

    def profile(self, device: EdgeRuntime, server: str, template_id: str, prep: Prepared,
                req: Any, codec: str, token: str | None, opts: EditOptions) -> ExecProfile:
        """Compiled graphs loaded and execution calibrated for this template's shard
        layout, before the edit's clock starts. The layout (blocks per shard) comes from
        the cached manifest, or from a manifest fetched outside the device's cache (so
        that the timed edit fetches it exactly as the Python runtime does)."""

        native = self.engine(device, opts.precision)
        cached = device.manifests.get((template_id, codec))
        if cached is not None:
            doc = cached.data
            # parsed once per ETag, as the edit's own check is (the schema's validation
            # of the demo pack's manifest takes 26 ms, more than a local step)
            bps = int(device._derived_manifest(device._derived_of(template_id, codec,
                                                                  cached.etag),
                                               doc, prep).geometry["blocks_per_shard"])
        else:
            async def get() -> dict[str, Any]:
                async with PackClient(server, token=token, retry=opts.retry) as c:
                    return await c.manifest(template_id, codec)

            with NetLoop() as net:
                doc = net.run(get())
            bps = int(device.check_manifest(doc, prep).geometry["blocks_per_shard"])
        # the template's device bundle when its catalog entry has one (else the graphs are
        # exported here, and it says so once)
        self.bundles.ensure(native, server, template_id, token, opts.retry,
                            entry=device.entries.get((server, template_id)))
        uncond = getattr(req, "txt_uncond", None) is not None
        key = (f"{template_id}|runtime=native|bps={bps}|steps={prep.template.steps}"
               f"|cfg={uncond}|weights={native.weights_sha256[:12]}")
        native.prepare(prep.template, prep.geometry, req, bps)
        if opts.local_fallback:  # local's graphs and the recompute step's, for the steps
            native.prepare_full(prep.template, req)  # computed on the device
            native.prepare_recompute(prep.template, prep.geometry, req)
        if key not in device.profiles:
            device.profiles[key] = ExecProfile(
                native.calibrate(prep.template, prep.geometry, req, bps))
        profile = device.profiles[key]
        if opts.local_fallback and profile.local_step_s is None:
            # the local fallback's step, timed once per layout instead of estimated from
            # the cached step (50 ms estimated against 30 ms measured on the demo's
            # template; both sit at the 50 ms stall floor there, so the wait is unchanged
            # on it, and shorter only where a full step is slower than the floor)
            began = time.perf_counter()
            native.full_edit(prep.template, req)
            profile.local_step_s = (time.perf_counter() - began) / max(1, prep.template.steps)
        return profile

    def warm(self, device: EdgeRuntime, job_derived: dict[str, Any],
             manifest_dict: dict[str, Any], manifest: Manifest, url: str) -> None:
        self._derived_stream(device, job_derived, manifest_dict, manifest, url)

    def _derived_stream(self, device: EdgeRuntime, derived: dict[str, Any],
                        manifest_dict: dict[str, Any], manifest: Manifest,
                        url: str) -> tuple[Any, Any]:
        """The native stream's shard table for the pack at ``url`` and the keys' RoPE
        table, from ``derived`` (the runtime's memo per manifest ETag) or made and kept
        there."""
        if ("shards", url) not in derived:
            derived[("shards", url)] = self.engine(device).native.StreamTable(
                stream_shards(manifest_dict, url))
        if "rope" not in derived:
            geometry = manifest_dict["geometry"]
            derived["rope"] = rope_table(manifest.make_codec(), int(geometry["tokens"]),
                                         int(geometry["channels"]))
        return derived[("shards", url)], derived["rope"]

    def prepare_local(self, device: EdgeRuntime, template: Template, req: Any,
                      precision: str = "fp32") -> None:
        self.engine(device, precision).prepare_full(template, req)

    def local(self, device: EdgeRuntime, template: Template, prep: Prepared,
              req: Any, precision: str = "fp32") -> torch.Tensor:
        return self.engine(device, precision).full_edit(template, req)

    def stream(self, device: EdgeRuntime, job: StreamJob
               ) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        native = self.engine(device, job.opts.precision)
        manifest, opts, client = job.manifest, job.opts, job.client
        codec_impl = manifest.make_codec()
        where = client.pack_location(job.template_id, job.codec, job.manifest_dict)

        def decode(shard: int, config: int, data: bytes) -> Any:
            tensors = decode_config(manifest, shard, config, data, codec_impl)
            return torch.stack(tensors).to(torch.float32).numpy()

        geometry = job.manifest_dict["geometry"]
        retry = opts.retry
        http = native.native.HttpOptions(
            connect_timeout_s=retry.connect_timeout_s, read_timeout_s=retry.read_timeout_s,
            window_s=retry.window_s, max_attempts=retry.max_attempts,
            backoff_s=retry.backoff_s, backoff_max_s=retry.backoff_max_s,
            max_refetch=retry.max_refetch, jitter=retry.jitter, on_wait=opts.on_wait,
            max_connections=opts.max_inflight,
            # HTTP/2: one connection carries every request (opened early when warm); a
            # hedge opens its own (native/src/sakura/http.hpp)
            warm_connections=(0 if not opts.warm_connections
                              else 1 if opts.http_version == "2"
                              else opts.max_inflight - 1),
            http_version=opts.http_version, warm_hedges=opts.warm_connections,
            headers=[f"{k}: {v}" for k, v in where.headers.items()],
            display_url=client.base_url)
        pack_url = where.url
        if opts.pack_origin:  # the same path on another listener (h2c: EditOptions)
            base = urlsplit(opts.pack_origin)
            pack_url = urlunsplit(urlsplit(pack_url)._replace(scheme=base.scheme,
                                                              netloc=base.netloc))
        shards, rope = self._derived_stream(device, job.derived, job.manifest_dict,
                                            manifest, pack_url)
        stream = stream_spec(
            shards, geometry, http=http,
            origin=job.origin, max_ahead=opts.max_ahead, max_ready=opts.max_ready,
            max_inflight=opts.max_inflight, lookahead_rtts=opts.lookahead_rtts,
            max_ahead_cap=opts.max_ahead_cap, reconstruct=opts.reconstruct,
            kind=decode_kind(codec_impl), decode=decode, rope=rope,
            pipeline_cpus=opts.pipeline_cpus, refine=opts.refine,
            intq_group=getattr(codec_impl, "group", 32),
            stale_plan_age=opts.stale_max_age if opts.stale_plan else 0,
            plan_local=opts.stale_plan_local)
        prep = job.prep
        local = (native.local_steps(prep.template, prep.geometry, job.req, job.exec_s,
                                    measured_step_s=job.local_step_s,
                                    stale_max_age=opts.stale_max_age)
                 if opts.local_fallback else None)
        image, records, requests = native.streamed_edit(
            prep.template, prep.geometry, job.req, stream,
            to_native(job.allocator, native.native), job.monitor, job.progress,
            int(geometry["blocks_per_shard"]), local=local)
        for r in requests:
            headers = dict(h.split(": ", 1) for h in r["headers"] if ": " in h)
            job.log.append(RequestRecord(r["method"], r["url"], headers, r["time"]))
        # the typed records (sakura_native.ShardRecord) as the timeline's dicts, with the
        # configuration's description the Python runtime's records carry (params)
        timeline = []
        for r in records:
            d = r.to_dict()
            d["params"] = job.describe(r.shard, r.config) if r.config is not None else {}
            timeline.append(d)
        return image, timeline


# the registry of shard loops, by the runtime name the CLI and EdgeRuntime take
RUNNERS: dict[str, type] = {"python": PythonRunner, "native": NativeRunner}


def make_runner(name: str, compiled_dir: Any = None) -> Runner:
    """The runner called ``name`` (an :class:`EdgeError` names the known ones)."""
    if name not in RUNNERS:
        raise EdgeError(f"unknown runtime {name!r} (known: {', '.join(RUNNERS)})")
    return NativeRunner(compiled_dir) if name == "native" else PythonRunner()
