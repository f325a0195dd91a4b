"""One private edit on the device, end to end, under any policy.

:class:`EdgeRuntime` holds the device's model and text encoder and the calibrated masked
execution time per (template, request shape). :meth:`EdgeRuntime.edit` runs an edit:

* ``local``: the whole model on the device (``dit.editing.full_edit``), no network;
* every other policy: fetch the pack manifest of the policy's codec, build the policy's
  allocator over the manifest's profiled configurations, then run the
  :class:`~edge.pipeline.Pipeline` (receive -> reconstruct -> execute) under
  ``dit.editing.cached_edit``.

Device state kept across edits (as a video player keeps it across sessions): the manifest
cache (revalidated by ETag on every edit; a first edit fetches the manifest and uses its
transfer as the first rate sample) and the rate memory (:mod:`edge.state`): per origin,
the last estimate with its age, decayed toward a conservative fraction of itself, the prior
of the next edit's first shards. The manifest request feeds it (a body is a rate sample, a
304 a latency), and so does every edit's final estimate.

The shard loop itself runs in a :class:`~edge.runner.Runner` (native C++ or the Python
reference pipeline), chosen once at construction; nothing here branches on which.

The prompt, reference images and seed stay in this process; the server only ever sees
template id, codec, shard index, configuration id and pack version (see
:mod:`edge.client`).

Startup allowance (``EditOptions.startup_fraction``): nothing executes before shard 0 is
in, so the first shards have no execution to hide their transfer behind. The device lets
execution start up to ``startup_fraction`` x the edit's predicted execution time after the
manifest is in (see :meth:`edge.monitor.ExecutionProgress.with_allowance`), and the
allocator spends that time on better configurations of the first shards. Execution still
starts as soon as shard 0 is reconstructed. The allowance is sized into bytes at the first shards' rate estimate: the caller's prior
(``EditOptions.initial_rate_bps``), this edit's manifest transfer, or the rate memory's
decayed prior; with none at all the first shards go at their smallest configurations, and
execution starts as soon as shard 0 is in.

Collector pauses: an edit runs with Python's cyclic garbage collector paused
(:mod:`edge.collector`, which has the measurements).

Execution-time calibration (:mod:`edge.calibration`): the first edit of a (template, request
shape) times every block of the masked computation, and the pipeline corrects the prediction
online with measured shard times.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from sakura.codec.base import load_builtin
from sakura.codec.pack import Manifest
from sakura.dit.adapters.engine import DefaultEngine, EditEngine, Prepared, load_engine
from sakura.dit.editing import EditRequest, Template
from sakura.dit.model import MMDiT
from sakura.edge.allocator import PolicyContext, get_policy, options_from_manifest
from sakura.edge.backends.base import BackendConfig
from sakura.edge.backends.executor import DeviceBackend
from sakura.edge.calibration import ExecProfile, calibrate
from sakura.edge.client import CachedManifest, PackClient, RequestRecord, RetryPolicy
from sakura.edge.collector import collector_paused
from sakura.edge.errors import EdgeError, NativeUnavailable, VersionGone
from sakura.edge.monitor import (
    startup_allowance_s,
)
from sakura.edge.native_runtime import NativeEngine, check_runtime
from sakura.edge.netem import shaped
from sakura.edge.netloop import NetLoop
from sakura.edge.options import HTTP_VERSIONS, EditOptions, policy_options
from sakura.edge.quality import received_quality
from sakura.edge.result import EditResult
from sakura.edge.runner import NativeRunner, Runner, StreamJob, make_runner
from sakura.edge.shard_records import stats_of
from sakura.edge.state import RateMemory
from sakura.edge.templates import template_from_entry
from sakura.edge.timeline import setup_phases
from sakura.traces import Trace

from sakura.atomic import write_atomic
from sakura.errors import SakuraError

# what this module's importers read from it (each defined in the module named above)
__all__ = ["HTTP_VERSIONS", "EdgeRuntime", "EditOptions", "EditResult", "ExecProfile",
           "calibrate", "collector_paused", "policy_options", "run_edit"]


class EdgeRuntime:
    """The device: a model (the shipped MMDiT or any ``dit.adapters`` engine), a text
    encoder, and calibrated execution times."""

    def __init__(self, model: MMDiT | EditEngine, encoder: Any = None,
                 state_dir: str | Path | None = None,
                 weights_sha256: str | None = None, backend: str = "torch",
                 backend_config: BackendConfig | None = None,
                 runtime: str = "python") -> None:
        # non-torch backends run the edit through compiled shard graphs (edge/backends)
        self.backend = DeviceBackend(backend, backend_config)
        # the shard loop: "native" (C++, edge.native_runtime) or "python" (edge.pipeline)
        self.runtime = check_runtime(runtime)
        if self.runtime == "native" and not self.backend.is_torch:
            raise EdgeError(f"the native runtime runs its own compiled graphs; --backend "
                            f"{backend} belongs to the Python runtime")
        self.runner: Runner = make_runner(
            self.runtime, backend_config.cache_dir if backend_config else None)
        if isinstance(model, EditEngine):
            self.engine = model
            self.model = getattr(model, "model", None)
            weights_sha256 = weights_sha256 or model.weights_id
        else:
            self.model = model
            self.engine = DefaultEngine(model, encoder, weights_sha256)
        self.weights_sha256 = weights_sha256
        self.state_dir = Path(state_dir) if state_dir else None
        self.profiles: dict[str, ExecProfile] = {}
        self.manifests: dict[tuple[str, str], CachedManifest] = {}
        # per-origin rate estimates with their age, decayed into each edit's prior
        self.rates = RateMemory()
        self._saved: dict[str, str] = {}  # manifest file -> etag already on disk
        # what an edit derives from a manifest (the parsed form, the native stream's shard
        # table), per (template, codec), for the ETag it was derived from: parsing a
        # 1000-configuration manifest costs ~50 ms, paid before the first shard request
        self._derived: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
        self._prepared: dict[str, tuple[Template, Prepared]] = {}
        # catalog entries fetched by fetch_template, per (origin, template)
        self.entries: dict[tuple[str, str], dict[str, Any]] = {}
        self._load_state()

    @property
    def default_model(self) -> bool:
        return isinstance(self.engine, DefaultEngine)

    @property
    def native(self) -> NativeEngine:
        """The native engine (compiled graphs of the shipped MMDiT), created on first use
        (the benches drive it directly for resident edits)."""
        if not isinstance(self.runner, NativeRunner):
            raise NativeUnavailable("this device runs the Python runtime (--runtime native "
                                    "for the native engine)")
        return self.runner.engine(self)

    # ------------------------------------------------------------------ device state
    def _load_state(self) -> None:
        """Calibrations, manifests and the rate prior of earlier runs (``state_dir``)."""
        if self.state_dir is None or not (self.state_dir / "state.json").exists():
            return
        try:
            doc = json.loads((self.state_dir / "state.json").read_text())
            local = doc.get("local_step_s", {})
            self.profiles = {k: ExecProfile([float(x) for x in v],
                                            float(local[k]) if k in local else None)
                             for k, v in doc.get("profiles", {}).items()}
            self.rates = RateMemory.from_json(doc.get("rates"))
            for name in doc.get("manifests", []):
                entry = json.loads((self.state_dir / "manifests" / name).read_text())
                key = (str(entry["template"]), str(entry["codec"]))
                self.manifests[key] = CachedManifest(str(entry["etag"]), entry["manifest"],
                                                     int(entry["size"]))
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            # A damaged cache is dropped, never trusted (manifests are revalidated anyway).
            self.profiles, self.manifests, self.rates = {}, {}, RateMemory()

    def save_state(self) -> None:
        if self.state_dir is None:
            return
        folder = self.state_dir / "manifests"
        folder.mkdir(parents=True, exist_ok=True)
        names = []
        for (template, codec), cached in self.manifests.items():
            name = f"{template}.{codec}.json"
            if self._saved.get(name) != cached.etag or not (folder / name).exists():
                write_atomic(folder / name, json.dumps(
                    {"template": template, "codec": codec, "etag": cached.etag,
                     "size": cached.size, "manifest": cached.data}, separators=(",", ":")))
                self._saved[name] = cached.etag
            names.append(name)
        write_atomic(self.state_dir / "state.json", json.dumps(
            {"profiles": {k: v.block_s for k, v in self.profiles.items()},
             "local_step_s": {k: v.local_step_s for k, v in self.profiles.items()
                              if v.local_step_s is not None},
             "rates": self.rates.to_json(), "manifests": names}, indent=1))

    def remembered_rate(self, server: str, now: float | None = None) -> float | None:
        """The rate memory's prior for ``server`` now (``edge.state``; None: never
        measured there)."""
        return self.rates.prior_bps(server, now)

    @property
    def encoder(self) -> Any:
        if not self.default_model:
            raise EdgeError(f"{self.engine.name} encodes prompts with its own text encoders "
                            "(use EdgeRuntime.request)")
        return self.engine.encoder

    def request(self, prompt: str, seed: int, reference: torch.Tensor | None = None,
                guidance: bool = True) -> Any:
        """The private request: prompt embeddings (and the empty prompt's), seed, refs."""
        if not self.default_model:
            refs = None if reference is None else (reference[None] if reference.dim() == 3
                                                   else reference)
            return self.engine.request(prompt, int(seed), references=refs)
        txt = self.encoder.encode([prompt])
        unc = self.encoder.encode([""]) if guidance else None
        refs = None if reference is None else (reference[None] if reference.dim() == 3
                                               else reference)
        return EditRequest(txt=txt, txt_uncond=unc, seed=int(seed), ref_images=refs)

    # ------------------------------------------------------------------ templates
    def fetch_template(self, server: str, template_id: str, token: str | None = None,
                       retry: RetryPolicy | None = None) -> Template:
        """The template as the server's catalog entry describes it (see edge.templates)."""
        async def get() -> dict[str, Any]:
            async with PackClient(server, token=token, retry=retry or RetryPolicy()) as c:
                return await c.template_entry(template_id)

        with NetLoop() as net:
            entry = net.run(get())
        # the native runner reads the entry's device bundle from here (no second request)
        self.entries[(server, template_id)] = entry
        return template_from_entry(template_id, entry)

    # ------------------------------------------------------------------ calibration
    def prepared(self, template_id: str, template: Template) -> Prepared:
        """The engine's view of ``template`` (latents and token masks of diffusers models are
        computed once per template object)."""
        hit = self._prepared.get(template_id)
        if hit is not None and hit[0] is template:
            return hit[1]
        prep = self.engine.device_prepare(template)
        self._prepared[template_id] = (template, prep)
        return prep

    def profile(self, key: str, prep: Prepared, req: Any) -> ExecProfile:
        refs = _reference_count(req)
        info = {k: v for k, v in self.engine.model_info().items()
                if k not in ("weights_sha256", "weights_fingerprint")}
        arch = hashlib.sha256(json.dumps(info, sort_keys=True, default=str).encode())
        uncond = getattr(req, "txt_uncond", getattr(req, "uncond", None)) is not None
        steps = self.engine.cache_geometry(prep)["steps"]
        full_key = f"{key}|model={arch.hexdigest()[:12]}|steps={steps}|cfg={uncond}|refs={refs}"
        if full_key not in self.profiles:
            self.profiles[full_key] = calibrate(self.engine, prep, req)
        return self.profiles[full_key]

    # ------------------------------------------------------------------ edits
    def warm(self, server: str, template_id: str, template: Template, policy: str = "sakura",
             *, token: str | None = None, options: EditOptions | None = None) -> None:
        """Do now what the first edit of ``template`` with ``policy`` would do before its
        first shard request: the manifest fetched into the device's cache (or revalidated),
        parsed and checked against the template, and what the runner derives from it (the
        native stream's shard table). An app calls it when the user opens a template, so
        that the edit starts streaming at once (the benches and the demo call it before the
        timed edits: a phone that has used the template before). The manifest's transfer
        also feeds the rate memory."""
        pol = get_policy(policy)
        opts = (options or EditOptions()).check()
        if pol.codec is None:
            return
        codec = opts.pack or pol.codec
        prep = self.prepared(template_id, template)

        async def fetch() -> tuple[Any, Any]:
            async with PackClient(server, token=token, retry=opts.retry,
                                  manifests=self.manifests if opts.cache_manifests else None
                                  ) as client:
                got = await client.manifest_fetch(template_id, codec)
                return got, client.pack_location(template_id, codec, got.data)

        with NetLoop() as net:
            got, where = net.run(fetch())
        if opts.remember_rate:
            self.rates.observe_fetch(opts.rate_origin or server, got)
        derived = self._derived_of(template_id, codec, got.etag)
        manifest = self._derived_manifest(derived, got.data, prep)
        self._derived_tables(derived, got.data)
        self.runner.warm(self, derived, got.data, manifest, where.url)
        self.save_state()

    def edit(self, server: str, template_id: str, template: Template, req: EditRequest,
             policy: str = "sakura", *, token: str | None = None,
             request_log: list[RequestRecord] | None = None,
             options: EditOptions | None = None) -> EditResult:
        """Run one edit of ``template`` (served as ``template_id`` at ``server``)."""
        with collector_paused():
            return self._edit(server, template_id, template, req, policy, token=token,
                              request_log=request_log, options=options)

    def _edit(self, server: str, template_id: str, template: Template, req: EditRequest,
              policy: str, *, token: str | None, request_log: list[RequestRecord] | None,
              options: EditOptions | None) -> EditResult:
        pol = get_policy(policy)
        opts = (options or EditOptions()).check()
        self.runner.check(opts)
        prep = self.prepared(template_id, template)
        if pol.codec is None:
            if not self.backend.is_torch:
                raise EdgeError(f"the local policy runs the whole model without a cache; it "
                                f"runs on the torch backend, not {self.backend.name}")
            if template.seed < 0:
                raise EdgeError("the local policy recomputes the template trajectory and "
                                "needs the template's seed, which its catalog entry lacks")
            # compiles/loads: before the clock
            self.runner.prepare_local(self, template, req, opts.precision)
            t0 = time.monotonic()
            image = self.runner.local(self, template, prep, req, opts.precision)
            dt = time.monotonic() - t0
            return EditResult(image=image, policy=policy, codec=None, latency_s=dt, exec_s=dt)
        codec = opts.pack or pol.codec
        # the local fallback where the options and the policy both have it, and the
        # template trajectory can be computed (its seed is known)
        opts = replace(opts, local_fallback=(opts.local_fallback and pol.local_fallback
                                             and template.seed >= 0))
        # the stale plan where the policy plans with it and late steps may run stale
        opts = replace(opts, stale_plan=(opts.stale_plan and pol.plans_stale
                                         and opts.local_fallback and opts.stale_max_age > 0))
        profile = self.runner.profile(self, server, template_id, prep, req, codec, token, opts)
        self._derive_from_cache(server, template_id, codec, prep, token, opts)
        try:
            return self._streamed_once(server, template_id, prep, req, pol.name, codec,
                                       profile, token, request_log, opts)
        except VersionGone:
            # the manifest this edit used names a pack the origin has collected: drop it
            # and run once more on the manifest the origin publishes now
            self.manifests.pop((template_id, codec), None)
        res = self._streamed_once(server, template_id, prep, req, pol.name, codec, profile,
                                  token, request_log, opts)
        res.warnings.append("the pack was republished during the edit; it ran again on the "
                            "new version")
        return res

    def _streamed_once(self, server: str, template_id: str, prep: Prepared, req: Any,
                       policy: str, codec: str, profile: ExecProfile, token: str | None,
                       request_log: list[RequestRecord] | None,
                       opts: EditOptions) -> EditResult:
        net = NetLoop()
        try:
            return self._streamed(net, server, template_id, prep, req, policy, codec,
                                  profile, token, request_log, opts)
        finally:
            net.close()

    def _streamed(self, net: NetLoop, server: str, template_id: str, prep: Prepared,
                  req: Any, policy: str, codec: str,
                  profile: ExecProfile, token: str | None,
                  request_log: list[RequestRecord] | None, opts: EditOptions) -> EditResult:
        origin = time.monotonic()
        loop_start: list[float] = []  # when the runner's shard loop started (the timeline's)
        rate_key = opts.rate_origin or server
        log = request_log if request_log is not None else []
        client = PackClient(server, token=token, request_log=log, retry=opts.retry,
                            on_wait=opts.on_wait,
                            manifests=self.manifests if opts.cache_manifests else None)
        try:
            # (inside: a stop that lands in this thread as the client opens, SIGTERM in
            # `sakura replay`, still closes it; a CI run printed "Unclosed client session")
            net.run(client.open())
            # an origin with no remembered rate and no caller's prior: the manifest's body
            # is asked for even when a copy is cached (from another origin, or a state whose
            # memory of this one was lost), since its transfer is the only rate sample before
            # the first shards are sized; a 304 moves no body, and the first shards then went
            # at the smallest configuration (the CLI's first edit against a new port of a
            # loopback server: shards 0-2 at r1b2 / r5b4 / r4b4, ~35 dB estimated, the next
            # edit all r64b8, ~63 dB)
            known = (opts.initial_rate_bps is not None
                     or self.rates.prior_bps(rate_key) is not None)
            got = net.run(client.manifest_fetch(template_id, codec, revalidate=known))
            if opts.remember_rate:
                self.rates.observe_fetch(rate_key, got)
            manifest_dict, raw_len = got.data, got.size
            derived = self._derived_of(template_id, codec, got.etag)
            manifest = self._derived_manifest(derived, manifest_dict, prep)
            warnings = [w for w in (self.model_warning(manifest_dict),
                                    get_policy(policy).missing(manifest_dict)) if w]
            layout = manifest.layout()
            exec_s = profile.shard_times(layout)
            given = opts.initial_rate_bps is not None
            prior = opts.initial_rate_bps if given else self.rates.prior_bps(rate_key)
            monitor = self.runner.monitor(opts.rate_window, prior)
            # the manifest request is the edit's first sample: a body is timed, a 304 (no
            # bytes) gives the request latency (an app-limited window: it never lowers the
            # prior), so the first shards' lead counts the round trip they will pay
            monitor.record(None, raw_len if not got.cached else 0, got.start, got.first_byte,
                           got.end)
            tables = self._derived_tables(derived, manifest_dict)
            allocator = get_policy(policy).build(PolicyContext(
                tables=tables, exec_s=exec_s, latency_s=0.0,
                budget_rate_bps=opts.budget_rate_bps or monitor.estimate_bps(),
                safety=opts.safety, options=policy_options(opts, manifest_dict)))
            if not self.backend.is_torch:  # (compiling may take a while: before the clock)
                self.backend.prepare(self.model, prep.template, prep.geometry, req,
                                     layout.blocks_per_shard)
            # the startup allowance counts from here, when the shards can start streaming;
            # it is spent at the rate estimate, which is always a current one (the caller's,
            # this edit's manifest transfer, or the rate memory's decayed prior: edge/state.py)
            allowance = startup_allowance_s(exec_s, opts.startup_fraction)
            if opts.deadline_s is not None:
                allowance = max(0.0, opts.deadline_s - (time.monotonic() - origin)
                                - sum(exec_s))
            # nothing executes before shard 0's first bytes are in: its earliest start is one
            # request latency away (as this edit's manifest request took), and the allowance counts from there, or a long round trip would leave the
            # first shards no window at all (30 ms, 6 fresh connections: 65-75 ms to the
            # first byte against a 36 ms allowance sent 10 shards at the smallest size)
            first_byte_s = max(0.0, got.first_byte - got.start)
            if opts.deadline_s is not None:
                first_byte_s = 0.0  # (the caller's deadline decides the start)
            # made by the runner right before its loop starts (its own set-up, e.g. the
            # native request tensors, would otherwise eat the allowance)
            def progress() -> Any:
                loop_start.append(time.monotonic())
                return self.runner.progress(exec_s, origin, allowance,
                                            time.monotonic() + first_byte_s)
            job = StreamJob(net=net, client=client, template_id=template_id, codec=codec,
                            manifest_dict=manifest_dict, manifest=manifest, prep=prep,
                            req=req, allocator=allocator, monitor=monitor,
                            progress=progress, origin=origin, opts=opts, log=log,
                            derived=derived, exec_s=list(exec_s),
                            local_step_s=profile.local_step_s)
            image, timeline = self.runner.stream(self, job)
            latency = time.monotonic() - origin
            if opts.remember_rate:
                self.rates.observe_edit(rate_key, monitor, timeline)
            self.save_state()
        finally:
            net.run(client.close(), timeout=10)
        result = self._result(image, policy, codec, latency, raw_len, allowance,
                              timeline, exec_s, log, warnings)
        got_q = received_quality(manifest_dict, timeline, allocator.ceiling)
        result.full_quality_byte_fraction = got_q["full_quality_byte_fraction"]
        result.psnr_estimate_db = got_q["psnr_estimate_db"]
        result.shards_below_largest = got_q["shards_below_largest"]
        result.limited_by_policy = got_q["limited_by_policy"]
        result.phases = setup_phases(origin, got, loop_start[:1], first_byte_s, allowance,
                                     latency_s=latency)
        return result

    @staticmethod
    def _result(image: torch.Tensor, policy: str, codec: str, latency: float, raw_len: int,
                allowance: float, timeline: list[dict[str, Any]], exec_s: list[float],
                log: list[RequestRecord], warnings: list[str]) -> EditResult:
        """The EditResult of a streamed edit from its per-shard records (either runtime)."""
        stats = stats_of(timeline)
        exec_total = sum((r["exec_end"] or 0) - (r["exec_start"] or 0) for r in timeline)
        warnings = list(warnings)
        for r in timeline:  # the failure contract: the edit finished, say what was damaged
            if r.get("damage"):
                warnings.append(f"damaged data from the origin: {r['damage']}; shard "
                                f"{r['shard']} ran on configuration {r['config']}, the "
                                "largest one verified before it")
        return EditResult(
            image=image, policy=policy, codec=codec, latency_s=latency, bytes=stats.bytes,
            manifest_bytes=raw_len, stalls=stats.stalls, stall_s=stats.stall_s,
            truncations=stats.truncations, hedges=stats.hedges,
            local_fallbacks=stats.local_steps, outage_fallbacks=stats.outage_fallbacks,
            stale_steps=stats.stale_steps, planned_stale=stats.planned_stale,
            planned_local=stats.planned_local,
            refinements=stats.refinements,
            startup_s=stats.startup_s, startup_allowance_s=allowance, configs=stats.configs,
            params=[r["params"] for r in timeline], timeline=timeline,
            predicted_exec_s=exec_s, exec_s=exec_total, requests=len(log),
            warnings=warnings)

    def _derived_of(self, template_id: str, codec: str, etag: str | None) -> dict[str, Any]:
        """The memo of what was derived from the manifest with ``etag`` (a fresh one for a
        new ETag, or none: an origin without ETags gets nothing memoised)."""
        key = (template_id, codec)
        held = self._derived.get(key)
        if etag and held is not None and held[0] == etag:
            return held[1]
        fresh: dict[str, Any] = {}
        if etag:
            self._derived[key] = (etag, fresh)
        return fresh

    @staticmethod
    def _derived_tables(derived: dict[str, Any], manifest_dict: dict[str, Any]) -> Any:
        """The allocator's candidate tables, once per manifest ETag (never mutated:
        policies filter into new tables); 2-5 ms and ~5k objects per edit on the demo's
        pack."""
        if "tables" not in derived:
            derived["tables"] = options_from_manifest(manifest_dict)
        return derived["tables"]

    def _derive_from_cache(self, server: str, template_id: str, codec: str, prep: Prepared,
                           token: str | None, opts: EditOptions) -> None:
        """Before the clock: what the edit's plan derives from its manifest, made from the
        device's cached copy (the revalidation's usual answer is a 304 that keeps its ETag,
        and the memo is per ETag), and the codecs imported. In a fresh ``sakura edit``
        process this work sat inside the measured latency: 0.10-0.13 s of "plan" against
        ~0.01 s in a warm process (cProfile: the codec imports 58 ms, the native shard table
        34 ms, the candidate tables 13 ms). A cached manifest that no longer fits is left to
        the edit, which revalidates it and says what is wrong."""
        load_builtin()
        cached = self.manifests.get((template_id, codec)) if opts.cache_manifests else None
        if cached is None or not cached.etag:
            return
        derived = self._derived_of(template_id, codec, cached.etag)
        try:
            manifest = self._derived_manifest(derived, cached.data, prep)
        except SakuraError:
            return
        self._derived_tables(derived, cached.data)
        where = PackClient(server, token=token).pack_location(template_id, codec, cached.data)
        self.runner.warm(self, derived, cached.data, manifest, where.url)

    def _derived_manifest(self, derived: dict[str, Any], manifest_dict: dict[str, Any],
                          prep: Prepared) -> Manifest:
        """The parsed and checked manifest, from ``derived`` or made and kept there."""
        if "manifest" not in derived:
            derived["manifest"] = self.check_manifest(manifest_dict, prep)
        return derived["manifest"]

    def check_manifest(self, d: dict[str, Any], prep: Prepared) -> Manifest:
        try:
            manifest = Manifest.from_dict(d)
        except SakuraError as exc:
            raise EdgeError(f"the server's manifest is not usable: {exc}") from exc
        g = manifest.geometry
        want = self.engine.cache_geometry(prep)
        bad = {k: (g.get(k), v) for k, v in want.items() if int(g.get(k, -1)) != v}
        if bad:
            detail = ", ".join(f"{k} {a} (pack) vs {b} (device)" for k, (a, b) in bad.items())
            raise EdgeError(f"pack {manifest.template_id}/{manifest.codec} does not fit this "
                            f"model and template: {detail}")
        return manifest

    def model_warning(self, manifest: dict[str, Any]) -> str | None:
        """A warning when the pack was built with other weights than the device's."""
        info = manifest.get("model") or {}
        built = info.get("weights_sha256") or info.get("weights_fingerprint")
        if built and self.weights_sha256 and built != self.weights_sha256:
            return (f"the {manifest.get('codec')} pack was built with weights "
                    f"{built[:12]}, this device runs {self.weights_sha256[:12]}: the cache "
                    "does not match the model (rebuild the packs with `sakura build`)")
        return None


def _reference_count(req: Any) -> int:
    refs = getattr(req, "ref_images", None)
    if refs is None:
        refs = getattr(req, "references", None) or None
    return 0 if refs is None else len(refs)


def run_edit(server: str, template_id: str, prompt: str, policy: str = "sakura",
             seed: int = 0, reference: torch.Tensor | None = None, *,
             trace: Any = None, start_s: float = 0.0, rate_mbps: float | None = None,
             weights: str | Path | None = None, model: str | None = None,
             model_path: str | Path | None = None, token: str | None = None,
             runtime: EdgeRuntime | None = None, options: EditOptions | None = None,
             compare_exact: bool = False) -> EditResult:
    """One edit with everything resolved: the model (shipped weights unless given, or the
    diffusers ``model`` at ``model_path``), the
    template from the server's catalog entry, and optionally an emulated link (a
    ``traces.Trace`` from ``start_s``, or a constant ``rate_mbps``) in front of the
    server. ``reference``: a private reference image ``[3, h, w]`` in [-1, 1].
    ``compare_exact`` also computes ``exact`` (FP16 cache, direct) and fills PSNR/SSIM."""
    if runtime is None:
        runtime = EdgeRuntime(load_engine(model, model_path, weights=weights))
    template = runtime.fetch_template(server, template_id, token)
    req = runtime.request(prompt, seed, reference)
    if rate_mbps is not None:
        trace = Trace.constant(rate_mbps * 1e6)
    if trace is not None:
        with shaped(server, trace, start_s) as (url, _link):
            result = runtime.edit(url, template_id, template, req, policy, token=token,
                                  options=replace(options or EditOptions(),
                                                  rate_origin=server))
    else:
        result = runtime.edit(server, template_id, template, req, policy, token=token,
                              options=options)
    if compare_exact:
        exact = runtime.edit(server, template_id, template, req, "fp16", token=token,
                             options=EditOptions(remember_rate=False))
        result.compare(exact.image)
    return result
