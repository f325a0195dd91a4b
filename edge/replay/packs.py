"""The replay's packs: which folders to build (``<packs>/main`` with every codec and the
second-resolution variants, ``<packs>/q<q>`` with sakura packs at other q) and building
them with the provider's builder (``cloud.build``); up-to-date templates are skipped, so a
rerun builds nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sakura.cloud.build import BuildConfig, build
from sakura.edge.errors import EdgeError
from sakura.edge.replay.config import ReplayConfig
from sakura.edge.replay.plan import PlannedRun

from sakura.errors import SakuraError
from sakura.output import quiet_dependency_logs


@dataclass(frozen=True)
class BuildJob:
    out_dir: str
    templates: tuple[str, ...]
    weights: str
    catalog: str | None = None
    resolution: int | None = None
    codecs: tuple[str, ...] | None = None
    q: float | None = None
    model: str | None = None  # a --model (dit/adapters) instead of the MMDiT ``weights``
    model_path: str | None = None
    blocks_per_shard: int = BuildConfig.blocks_per_shard


def _run_build(job: BuildJob) -> str:
    """One build job; any failure is one :class:`SakuraError` line naming its folder (in a
    pool worker too: the parent re-raises what the worker raised)."""
    quiet_dependency_logs()  # (a spawned worker: the CLI's setting is not inherited)
    import torch

    torch.set_num_threads(1)
    kw: dict[str, Any] = {}
    if job.codecs is not None:
        kw["codecs"] = job.codecs
    if job.q is not None:
        # pinned: a builder with a model otherwise chooses q per shard among 0 / 0.25 / 0.5 /
        # 1 whatever q says (codec.lowrank.OUTPUT_Q_CHOICE), and the q<q> packs then made
        # the same choices as main's, shard for shard (found 2026-12-07: the breadth
        # replay's q = 0.25 and q = 1 runs measured the default codec three times)
        kw["codec_options"] = {"sakura": {"q": job.q, "q_candidates": None}}
    if job.model is not None:
        kw.update(model=job.model, model_path=job.model_path)
    else:
        kw["weights"] = job.weights
    try:
        build(BuildConfig(catalog=job.catalog, out_dir=job.out_dir, templates=job.templates,
                          resolution=job.resolution, blocks_per_shard=job.blocks_per_shard,
                          **kw), log=lambda m: None)
    except SakuraError:
        raise
    except Exception as exc:  # noqa: BLE001 - a build failure is the user's to see
        raise EdgeError(f"building packs into {job.out_dir} failed: {exc}") from None
    return job.out_dir


def build_jobs(cfg: ReplayConfig, packs: Path, weights: Path, runs: list[PlannedRun]
               ) -> list[BuildJob]:
    need: dict[tuple[str, int | None], set[str]] = {}
    for r in runs:
        res = None if r.template == r.base else int(r.template.rsplit("-", 1)[1])
        need.setdefault((r.variant, res), set()).add(r.base)
    jobs = []
    for (variant, res), bases in sorted(need.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        tids = tuple(sorted(bases))
        kw: dict[str, Any] = {"blocks_per_shard": cfg.blocks_per_shard}
        if cfg.model:
            kw.update(model=cfg.model, model_path=str(weights))
        if variant == "main":
            jobs.append(BuildJob(str(packs / "main"), tids, str(weights), cfg.catalog, res,
                                 **kw))
        else:
            q = float(variant[1:])
            jobs.append(BuildJob(str(packs / variant), tids, str(weights), cfg.catalog, res,
                                 codecs=("sakura",), q=q, **kw))
    return jobs


def build_all(jobs: list[BuildJob], workers: int, log: Callable[[str], None]) -> None:
    """Build (or find up to date) every packs folder; ``workers`` > 1: in parallel
    processes (builds are not timed, so parallelism cannot distort results).

    Stopping (SIGTERM, Ctrl-C) or a failed job ends the other builds at once: the pool is
    terminated, not drained (a ``ProcessPoolExecutor`` ``with`` block waited for every
    queued build, minutes each, before ``sakura replay`` could exit). A build cut short
    publishes nothing (``sakura.atomic``); finished folders stay for the next run.
    """
    log(f"packs: {len(jobs)} build job(s) (up-to-date templates are skipped) ...")
    t0 = time.monotonic()
    if workers > 1 and len(jobs) > 1:
        import multiprocessing as mp

        pool = mp.get_context("spawn").Pool(min(workers, len(jobs)))
        try:
            for _ in pool.imap_unordered(_run_build, jobs):
                pass
        except BaseException:
            pool.terminate()
            raise
        else:
            pool.close()
        finally:
            pool.join()
    else:
        for job in jobs:
            _run_build(job)
    log(f"packs ready in {time.monotonic() - t0:.1f} s")
