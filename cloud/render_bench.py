"""``sakura bench flashdiff``: FlashDiff regional execution and the render engine, measured.

Quality (``dit.regional_bench``): on the default model's evaluation prompts, regional
execution vs full execution, uniform step reduction at equal compute and naive
independent patches (plus regional execution inside a cached edit's mask); the paper's
gate and partition against what they replace (``epsilon_sweep``, ``cap_only``,
``partition_comparison``, ``alternatives``, ``probe_overhead``).

Serving: the render engine with ``workers`` worker processes replays one seeded bursty
arrival trace of ``serve_size`` (128 px, 1,024 tokens) requests, once with every request
in ``full`` mode and once in ``regional`` mode, then again in the opposite order (the
host's speed drifts between replays; the two orders cancel a linear drift).
The arrival rate is set from a measured full-request service time to ``overload`` (3) x
full execution's capacity, so that *both* modes are overloaded: throughput then reflects
service capacity, not the arrival rate, and p90 latency reflects queueing. (At 1.5x, the
earlier setting, a regional engine 1.5x faster than full is not overloaded and its
throughput is the arrival rate's, which caps the ratio at about 1.5.) The low-load quality
mode is off in these replays, so every gated step runs at the default threshold; R comes
from the online search, whose exploration (each candidate once) is spent on untimed
warm-up requests first, as on a server that has been running. ``regional`` also reports
PSNR / SSIM of each served image against the full replay's image of the same arrival.
Then one more overloaded replay mixes priority classes (every third request ``high``,
the others ``low``): ``priority``. ``serving_64px``: the same full/regional replays at the
quality runs' 64 px (256 tokens), where a full request is ~5x cheaper than at 128 px
(``full_request_service_s`` of the two), so the engine's per-message and per-call costs (K/V shipped through pipes,
the gate's probe round trip, the engine process's own CPU on the same two cores) weigh
more against what skipping saves. Ratios come from one run on one machine.

``ray``: the engine with its workers as Ray actors on a two-node Ray cluster started on
this machine, against the process pool (``ray_bench``): throughput ratio, an actor killed
mid-batch, output equality.

``build_ray``: ``sakura build --ray`` on a local Ray of one, then two CPUs, against a
local build (``build_ray_bench``; ``scripts/build_ray_bench.py`` runs it alone).

``slo``: the share of requests meeting twice their unloaded latency under the bursty 3x
replay at the quality runs' size, the priority scheduler (every third request ``high``)
against a one-class FIFO engine (``cloud.render_slo``).

``load_sweep``: regional against full serving at 0.5, 1, 2 and 3x full's capacity, 48
requests (12 in ``--quick``) and 3 arrival seeds (2) per load, with a bootstrap ci95 over
the seeds (``cloud.render_sweep``).

``gate`` / ``gate_alternative`` / ``step_reuse_baseline``: the paper's gate's properties
and its comparisons (``dit.regional_bench.paper_study``).

``adapters``: regional execution of diffusers transformers through the same engine
(their workers load a checkpoint folder through ``dit.adapters``): seeded tiny FLUX.2 and
SD3.5 transformers (``dit.adapters.tiny``, bench size; random weights, since no real
checkpoint can be downloaded here), regional vs full requests of the same seeds, PSNR of
the latents (peak = the full result's range).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch
from sakura.cloud.render import RenderEngine
from sakura.cloud.render_api import EngineConfig, RenderRequest
from sakura.cloud.render_parallel import patch_parallel_bench, quality_mode_bench
from sakura.cloud.render_slo import classed, slo_bench
from sakura.cloud.render_sweep import load_sweep, served_images
from sakura.cloud.render_trace import bursty_arrivals, percentile, replay, request_factory
from sakura.dit.adapters.inputs import Conditioning
from sakura.dit.adapters.tiny import tiny_transformer
from sakura.dit.regional import RegionalConfig
from sakura.dit.regional_bench import (
    edit_bench,
    eps_sweep,
    eval_prompts,
    paper_study,
    quality_bench,
    references,
)
from sakura.dit.templates import load_catalog
from sakura.dit.text import TextEncoder
from sakura.dit.weights import load_model, metadata


def _config(steps: int, **kw) -> RegionalConfig:
    return RegionalConfig(warmup=max(2, steps // 5), **kw)


def serving_bench(weights: str | None, encoder, prompts: list[str], *, workers: int = 2,
                  requests: int = 8, steps: int = 20, size: int = 64,
                  cfg: RegionalConfig | None = None, overload: float = 3.0, rounds: int = 1,
                  seed: int = 0, priority: str = "warmup_first",
                  priority_requests: int = 0) -> dict:
    cfg = cfg or _config(steps)
    # quality mode off: the replays measure the gate at its threshold (a replay's tail,
    # where the engine empties, would otherwise run every patch)
    ecfg = EngineConfig(workers=workers, weights=weights, regional=cfg, priority=priority,
                        quality_eps=None)
    t0 = time.perf_counter()
    with RenderEngine(ecfg, encoder) as eng:
        startup = time.perf_counter() - t0
        base = RenderRequest(steps=steps, size=size, guidance=3.0, mode="full")
        # calibration: one full request per worker at once (also warms the workers up)
        cal = [eng.submit(replace(base, prompt=prompts[i % len(prompts)], seed=10_000 + i))
               for i in range(workers)]
        service = sum(f.result().latency_s for f in cal) / workers
        rate = overload * workers / service
        # the R search's first choices are exploration (every candidate once); a server
        # that has been running is past them, so they are spent here, untimed
        warm = [eng.submit(replace(base, mode="regional", prompt=prompts[i % len(prompts)],
                                   seed=20_000 + i))
                for i in range(len(eng.search.candidates) * eng.search.trials)]
        for f in warm:
            f.result()
        search_before = eng.search.to_dict()
        trace = bursty_arrivals(requests, rate, prompts, burst=max(2, requests // 4), seed=seed)
        order = ["full", "regional"]
        runs: dict[str, list] = {"full": [], "regional": []}
        for r in range(rounds):
            for mode in order if r % 2 == 0 else order[::-1]:
                rep = replay(eng, trace, request_factory(replace(base, mode=mode)))
                runs[mode].append(rep)
        mixed = None
        if priority_requests:
            mixed = priority_replay(eng, replace(base, mode="regional"), prompts, rate,
                                    priority_requests, seed + 1)
        metrics = eng.metrics()
    out = {"workers": workers, "requests": requests, "rounds": rounds, "steps": steps,
           "priority": priority,
           "size": size, "overload": overload, "arrival_rate_rps": rate,
           "full_request_service_s": service, "engine_startup_s": startup,
           "trace": f"bursty (seeded): bursts of ~{max(2, requests // 4)} at Poisson times",
           "search_warmup_requests": len(warm), "patch_search_before_replays": search_before,
           "engine": {k: v for k, v in metrics.items() if k != "workers"},
           "devices": sorted({w["device"] for w in metrics["workers"].values() if w["alive"]})}
    for mode, reps in runs.items():
        lat = sorted(x for rep in reps for x in rep.latencies)
        thr = sum(rep.throughput_rps for rep in reps) / len(reps)
        p90 = percentile(lat, 90)
        out[mode] = {"throughput_rps": thr, "p50_latency_s": percentile(lat, 50),
                     "p90_latency_s": p90, "p99_latency_s": percentile(lat, 99),
                     "makespan_s": sum(rep.makespan_s for rep in reps) / len(reps),
                     "skipped_fraction": sum(rep.summary()["skipped_fraction"] for rep in reps)
                     / len(reps)}
        out[mode]["quality_steps"] = sum(x.stats.get("quality_steps", 0)
                                         for rep in reps for x in rep.results)
        out[mode]["patches_chosen"] = sorted(x.stats["patches"] for rep in reps
                                             for x in rep.results if x.stats["patches"])
    out["regional"].update(_served_quality(runs["full"], runs["regional"]))
    out["throughput_ratio_vs_full"] = out["regional"]["throughput_rps"] / out["full"]["throughput_rps"]
    out["p90_latency_ratio_vs_full"] = out["regional"]["p90_latency_s"] / out["full"]["p90_latency_s"]
    if mixed is not None:
        out["priority"] = mixed
    return out


def _served_quality(full: list, regional: list) -> dict:
    """PSNR / SSIM of each served regional image against the served full image of the
    same arrival (the replays share one trace, so results pair up in trace order): the
    quality the replay's throughput was bought with."""
    acc = served_images(full, regional)
    if not acc.images:
        return {}
    d = acc.to_dict()
    return {"psnr_db_vs_full": d["psnr_db_vs_full"], "ssim_vs_full": d["ssim_vs_full"],
            "compute_fraction": d["compute_fraction"], "images_compared": acc.images}


def priority_replay(eng: RenderEngine, base: RenderRequest, prompts: list[str], rate: float,
                    requests: int, seed: int, high_every: int = 3) -> dict:
    """One overloaded bursty replay where every ``high_every``-th request is ``high`` and
    the others ``low``: latency per class."""
    trace = bursty_arrivals(requests, rate, prompts, burst=max(2, requests // 4), seed=seed)
    before = eng.metrics()
    rep = replay(eng, trace, classed(base, trace, high_every))
    after = eng.metrics()
    out: dict = {"requests": requests, "high_every": high_every, "arrival_rate_rps": rate,
                 "preemptions": after["preemptions"] - before["preemptions"],
                 "kept": after["kept"] - before["kept"]}
    for cls in ("high", "low"):
        lat = sorted(r.latency_s for r in rep.results if r.priority == cls)
        out[cls] = {"count": len(lat), "p50_latency_s": percentile(lat, 50),
                    "p90_latency_s": percentile(lat, 90)}
    out["high_p90_lower"] = out["high"]["p90_latency_s"] < out["low"]["p90_latency_s"]
    return out


def adapter_bench(kinds=("flux2", "sd3.5"), *, steps: int = 10, grid: int = 16,
                  seeds=(0, 1), workers: int = 1, cfg: RegionalConfig | None = None) -> dict:
    """Regional vs full requests of seeded tiny diffusers transformers (bench size, saved as
    checkpoint folders) through the render engine; PSNR of the latents vs full."""
    import math
    import tempfile

    names = {"flux2": "flux2", "sd3.5": "sd3"}
    cfg = cfg or replace(_config(steps), patches=4)
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="sakura-adapters-") as tmp:
        for kind in kinds:
            model = tiny_transformer(kind, "bench", seed=0)
            path = Path(tmp) / kind
            model.save_pretrained(path)
            mc = model.config
            g = torch.Generator().manual_seed(1)
            width = int(mc.joint_attention_dim)
            pooled = int(mc.get("pooled_projection_dim") or 0)
            c, u = (Conditioning(torch.randn(1, tokens, width, generator=g),
                                 torch.randn(1, pooled, generator=g) if pooled else None)
                    for tokens in (7, 3))
            ecfg = EngineConfig(workers=workers, model=names[kind], model_path=str(path),
                                regional=cfg, quality_eps=None, max_size=1024)
            with RenderEngine(ecfg) as eng:
                size = grid * eng.view.unit
                base = RenderRequest(steps=steps, size=size, guidance=2.0, cond=c, uncond=u)
                futs = [(eng.submit(replace(base, seed=s, mode="full")),
                         eng.submit(replace(base, seed=s, mode="regional"))) for s in seeds]
                pairs = [(f.result(timeout=1800), r.result(timeout=1800)) for f, r in futs]
            se = n = 0.0
            skipped, compute, psnrs = [], [], []
            for full, reg in pairs:
                peak = float(full.latents.max() - full.latents.min())
                mse = float((reg.latents - full.latents).pow(2).mean())
                psnrs.append(10 * math.log10(peak ** 2 / mse) if mse > 0 else float("inf"))
                se += mse / peak ** 2
                n += 1
                skipped.append(reg.stats["skipped_fraction"])
                compute.append(reg.stats["compute_fraction"])
            out[kind] = {"skipped_fraction": sum(skipped) / n,
                         "psnr_db_vs_full": 10 * math.log10(n / se) if se > 0 else float("inf"),
                         "compute_fraction": sum(compute) / n, "per_seed_psnr_db": psnrs,
                         "tokens": grid * grid, "steps": steps, "requests": len(seeds),
                         "model": f"tiny {kind} (dit.adapters.tiny, bench size, seeded random "
                                  "weights)"}
    return out


def ray_bench(weights: str | None, encoder, prompts: list[str], *, workers: int = 2,
              requests: int = 6, steps: int = 10, size: int = 64,
              cfg: RegionalConfig | None = None, nodes: int = 2, rounds: int = 3) -> dict:
    """The engine on Ray against the process pool on this machine.

    A Ray cluster of ``nodes`` nodes is started here as an operator would (``ray start
    --head``, then ``ray start --address`` per extra node, one CPU and a 200 MB object
    store each; ``cloud.render_ray.LocalCluster``) and the engine joins it
    (``pool="ray"``, ``ray_address``), its ``workers`` actors spread over the nodes. The
    same batch of ``requests`` regional requests (submitted at once, fixed R) runs on the
    process pool and on Ray; ``throughput_ratio_vs_process_pool`` = Ray's requests per
    second of makespan over the process pool's (the best of ``rounds`` interleaved runs
    each: the host's other load moves single runs by up to 1.6x here). Then the batch runs again on Ray with one actor
    SIGKILLed while it has work in flight: ``actor_killed_recovered`` = every request
    came back and equals the undisturbed Ray run's image. ``outputs_identical``: the Ray
    images equal the process pool's bit for bit."""
    import os as _os
    import signal

    from sakura.cloud.render_ray import LocalCluster, nodes_of  # lazy: ray

    cfg = replace(cfg or _config(steps), patches=4)
    base = RenderRequest(steps=steps, size=size, guidance=3.0, mode="regional")
    reqs = [replace(base, prompt=prompts[i % len(prompts)], seed=30_000 + i)
            for i in range(requests)]

    def batch(eng, kill: bool = False):
        t0 = time.perf_counter()
        futs = [eng.submit(r) for r in reqs]
        killed = None
        if kill:
            victim = min(eng.worker_pids())
            while victim not in eng.busy_workers() and not all(f.done() for f in futs):
                time.sleep(0.002)
            killed = eng.worker_pids().get(victim)
            if killed:
                _os.kill(killed, signal.SIGKILL)
        res = [f.result(timeout=600) for f in futs]
        return res, time.perf_counter() - t0, killed

    ecfg = EngineConfig(workers=workers, weights=weights, regional=cfg, quality_eps=None,
                        patch_search=False)
    times: dict[str, list[float]] = {"process": [], "ray": []}
    with LocalCluster(nodes=nodes) as cluster:
        rcfg = replace(ecfg, pool="ray", ray_address=cluster.address)
        with RenderEngine(ecfg, encoder) as proc, RenderEngine(rcfg, encoder) as eng:
            batch(proc)  # warm-up of both (first calls, caches)
            batch(eng)
            p_res, dt, _ = batch(proc)
            times["process"].append(dt)
            r_res, dt, _ = batch(eng)
            times["ray"].append(dt)
            for _ in range(rounds - 1):  # interleaved: Ray, process, process, Ray, ...
                for name, e in (("ray", eng), ("process", proc)):
                    times[name].append(batch(e)[1])
            placed = sorted(set(nodes_of(eng.pool).values()))
            before = eng.metrics()
            k_res, dt_kill, killed = batch(eng, kill=True)
            after = eng.metrics()
        alive = cluster.alive_nodes()
    diff = max(float((a.image - b.image).abs().max()) for a, b in zip(r_res, p_res))
    kdiff = max(float((a.image - b.image).abs().max()) for a, b in zip(k_res, r_res))
    thr = {k: requests / min(v) for k, v in times.items()}
    return {"nodes": alive, "workers": workers,
            "nodes_with_workers": len(placed),
            "throughput_ratio_vs_process_pool": thr["ray"] / thr["process"],
            "actor_killed_recovered": bool(killed) and kdiff == 0.0
            and after["worker_deaths"] == before["worker_deaths"] + 1,
            "outputs_identical": diff == 0.0,
            "max_abs_diff_vs_process_pool": diff, "max_abs_diff_killed_vs_undisturbed": kdiff,
            "requeued_after_kill": after["requeued"] - before["requeued"],
            "makespan_s": {k: v for k, v in times.items()}, "killed_run_makespan_s": dt_kill,
            "throughput_rps": thr, "requests": requests, "steps": steps, "size": size,
            "patches": 4, "torch_threads_per_worker": ecfg.threads,
            "cluster": f"{nodes} Ray nodes on this machine (ray start --head / --address), "
                       "1 CPU and a 200 MB object store each",
            "method": f"one batch submitted at once; the best of {rounds} interleaved runs "
                      "per pool; one actor SIGKILLed mid-batch in a further Ray run"}


BUILD_RAY_TEMPLATES = ("face-technologist", "face-cook", "face-student", "tryon-tuxedo")


def build_ray_bench(templates: tuple[str, ...] = BUILD_RAY_TEMPLATES, *, steps: int = 4,
                    codecs: tuple[str, ...] = ("fp16", "sakura"),
                    weights: str | None = None) -> dict:
    """``sakura build --ray`` on a local Ray of 1 CPU, then of 2 CPUs (one build task, one
    torch thread per CPU), against a local build (one torch thread).

    The shipped catalog's ``templates`` (64 px, all at ``steps`` steps, so of similar
    cost: the local build's ``seconds_per_template``), ``codecs``, no device bundle, the
    default fitted PSNR profile measured afresh in each build (its own cache folder).
    ``speedup_2_vs_1_workers`` = the 1-CPU build's wall time over the 2-CPU build's (each
    timed from the call to :func:`~sakura.cloud.build.build` on a started Ray to the last
    publish: the workers' start and model load included). ``packs_identical``: the three
    builds published the same files with the same bytes (``cloud.publish.published_files``:
    manifests without their measured ``decode_ms``). One run each, on a shared machine:
    ``load_average`` says how shared."""
    import json as _json
    import shutil
    import tempfile

    from sakura.cloud.build import BuildConfig, build  # lazy: the builder
    from sakura.cloud.publish import published_files  # lazy: the builder
    from sakura.cloud.render_ray import LOCAL, _ray, init_ray  # lazy: ray (an optional extra)
    from sakura.dit.templates import DEFAULT_CATALOG  # lazy: the builder

    quiet = lambda *_: None  # noqa: E731
    load_start = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="sakura-build-ray-") as tmp:
        root = Path(tmp)
        cat = _json.loads(DEFAULT_CATALOG.read_text())
        chosen = {}
        for tid in templates:
            entry = dict(cat["templates"][tid], steps=steps)
            for key in ("image", "mask"):
                shutil.copy(DEFAULT_CATALOG.parent / entry[key], root / entry[key])
            chosen[tid] = entry
        (root / "catalog.json").write_text(_json.dumps({"version": 1, "templates": chosen}))

        def cfg(name: str, ray: str | None) -> BuildConfig:
            return BuildConfig(catalog=str(root / "catalog.json"), out_dir=str(root / name),
                               codecs=codecs, weights=weights, psnr_cache=str(root / f"psnr-{name}"),
                               ray=ray)

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            t0 = time.perf_counter()
            local = build(cfg("local", None), log=quiet)
            local_s = time.perf_counter() - t0
        finally:
            torch.set_num_threads(threads)
        wall: dict[int, float] = {}
        busy: dict[int, float] = {}  # the templates' own seconds (task + publish), summed
        cpu: dict[int, float] = {}  # the CPU seconds their tasks got, summed
        for workers in (1, 2):
            started = init_ray(LOCAL, num_cpus=workers, object_store_bytes=200_000_000)
            try:
                t0 = time.perf_counter()
                report = build(cfg(f"ray-{workers}", LOCAL), log=quiet)
                wall[workers] = time.perf_counter() - t0
                busy[workers] = sum(report.seconds.values())
                cpu[workers] = sum(report.cpu_seconds.values())
            finally:
                if started:
                    _ray().shutdown()
            assert report.built == local.built
        want = published_files(root / "local")
        same = all(published_files(root / f"ray-{w}") == want for w in wall)
    share = {w: cpu[w] / busy[w] for w in wall}
    return {"templates": len(templates), "speedup_2_vs_1_workers": wall[1] / wall[2],
            "packs_identical": same,
            # an estimate, not a measurement: the speedup had each task of the 2-worker run
            # got the share of a core the 1-worker run's tasks got (wall-time speedup x
            # share_1 / share_2); it separates the machine's other load from the build
            "speedup_estimate_at_equal_cpu_share": wall[1] / wall[2] * share[1] / share[2],
            "wall_s": {"local_1_thread": local_s, "ray_1_worker": wall[1],
                       "ray_2_workers": wall[2]},
            # busy seconds over wall time: how many templates were being built at once
            # (2 workers on a machine with 2 free cores: ~2 and each template as fast as
            # with 1 worker; on shared cores: ~2 but each template slower)
            "concurrency": {"ray_1_worker": busy[1] / wall[1], "ray_2_workers": busy[2] / wall[2]},
            # CPU seconds over busy seconds: the share of a core each build task got (1 on
            # an idle machine with a core per worker; lower when the cores are shared)
            "cpu_share_per_task": {"local_1_thread": sum(local.cpu_seconds.values())
                                   / sum(local.seconds.values()),
                                   "ray_1_worker": share[1], "ray_2_workers": share[2]},
            "seconds_per_template": {k: round(v, 2) for k, v in local.seconds.items()},
            "template_ids": list(templates), "steps": steps, "codecs": list(codecs),
            "files": len(want), "torch_threads_per_worker": 1, "cpu_count": os.cpu_count(),
            "load_average": {"start": load_start, "end": list(os.getloadavg())},
            "method": "sakura build --ray local (cloud.build, Ray tasks of one CPU and one "
                      "torch thread each) on ray.init(address='local', num_cpus=1, then 2); "
                      "one run each, after a local build with one torch thread"}


def run_bench(quick: bool = False, weights: str | None = None, workers: int = 2,
              requests: int | None = None, serve: bool = True, serve_size: int = 128) -> dict:
    torch.manual_seed(0)
    model = load_model(weights)
    enc = TextEncoder()
    catalog = load_catalog()
    steps = 10 if quick else 20
    size = 64
    cfg = _config(steps)
    prompts = eval_prompts(catalog, 1, 2 if quick else None)
    meta = metadata(weights)
    out: dict = {
        "quick": quick, "weights": weights or "shipped", "train_step": meta.get("train_step"),
        "steps": steps, "size": size, "prompts": len(prompts),
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "load_average_start": list(os.getloadavg()),
        "regional_config": {k: (list(v) if isinstance(v, tuple) else v)
                            for k, v in asdict(cfg).items()},
        "gate_eps": cfg.threshold,
    }
    refs = references(model, enc, prompts, size, steps)
    q = quality_bench(model, enc, prompts, size, steps, cfg, refs=refs)
    fd = q["flashdiff"]
    out.update({
        "skipped_fraction": fd["skipped_fraction"],
        "compute_fraction_vs_full": fd["compute_fraction"],
        "psnr_db_vs_full": fd["psnr_db_vs_full"],
        "ssim_vs_full": fd["ssim_vs_full"],
        "wall_time_ratio_vs_full": fd["seconds"] / q["full_seconds"],
        "uniform_steps_psnr_db_vs_full": q["uniform_steps"]["psnr_db_vs_full"],
        "uniform_steps_ssim_vs_full": q["uniform_steps"]["ssim_vs_full"],
        "naive_patches_psnr_db_vs_full": q["naive_patches"]["psnr_db_vs_full"],
        "naive_patches_ssim_vs_full": q["naive_patches"]["ssim_vs_full"],
        "separate_psnr_db_vs_full": q["separate"]["psnr_db_vs_full"],
        "separate_compute_fraction_vs_full": q["separate"]["compute_fraction"],
        "quality": q,
    })
    spec = catalog["face-technologist"]
    out["edit"] = edit_bench(model, enc, spec, steps, cfg, 1 if quick else 3)
    out.update(paper_study(model, enc, refs, size, steps, cfg))
    if not quick:  # the drift gate's own sweep on more prompts (kept from earlier runs)
        out["eps_sweep"] = eps_sweep(model, enc, prompts[:4], size, steps,
                                     replace(cfg, gate="drift", partition="cuts"))
    if serve:
        replays = partial(serving_bench, weights, enc, [p for _, p, _ in prompts],
                          workers=workers, requests=requests or (8 if quick else 16),
                          steps=steps, cfg=cfg, rounds=2)
        s = replays(size=serve_size, priority_requests=9 if quick else 18)
        out["serving"] = s
        out["throughput_ratio_vs_full"] = s["throughput_ratio_vs_full"]
        out["p90_latency_ratio_vs_full"] = s["p90_latency_ratio_vs_full"]
        out["priority"] = s.pop("priority")
        if serve_size != size:  # the same replay at the quality runs' size
            out[f"serving_{size}px"] = replays(size=size)
        if not quick:  # the other priority policy, same replays as `serving`
            out["serving_fifo"] = replays(size=serve_size, priority="fifo")
        out["adapters"] = adapter_bench(steps=steps, workers=1)
        out["ray"] = ray_bench(weights, enc, [p for _, p, _ in prompts], workers=workers,
                               steps=steps, cfg=cfg)
        out["load_sweep"] = load_sweep(weights, enc, [p for _, p, _ in prompts], cfg,
                                       workers=workers, requests=12 if quick else 48,
                                       seeds=2 if quick else 3, steps=steps, size=size)
        out["patch_parallel"] = patch_parallel_bench(
            weights, enc, [p for _, p, _ in prompts], cfg, steps=steps, size=size,
            requests=4 if quick else 8)
        out["quality_mode"] = quality_mode_bench(
            weights, enc, [p for _, p, _ in prompts], cfg, steps=steps, size=size,
            requests=4 if quick else 8)
        out["slo"] = slo_bench(weights, enc, [p for _, p, _ in prompts], cfg, workers=workers,
                               requests=18 if quick else 48, steps=steps, size=size)
    out["build_ray"] = build_ray_bench(weights=weights)
    out["load_average_end"] = list(os.getloadavg())
    return out


def main(json_path: str | None, quick: bool, weights: str | None = None, workers: int = 2,
         requests: int | None = None, serve: bool = True, serve_size: int = 128) -> int:
    result = run_bench(quick=quick, weights=weights, workers=workers, requests=requests,
                       serve=serve, serve_size=serve_size)
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(text + "\n")
    return 0


__all__ = ["adapter_bench", "build_ray_bench", "main", "priority_replay", "ray_bench", "run_bench",
           "serving_bench"]
