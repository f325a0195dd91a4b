"""``sakura replay``: every policy over real traces and many start points, resumable.

The plan (``edge.replay.plan``) lists every run; a resumed replay skips the runs already
in the results (``edge.replay.results``) once the folder's meta file agrees with this
configuration (``edge.replay.resume``). Then, for each template (one setup, then its runs):

1. packs (``edge.replay.packs``): the provider's builder (``cloud.build``) into
   ``<packs>/main`` (every codec, the second-resolution variants too) and ``<packs>/q<q>``
   (sakura packs at other q); up-to-date templates are skipped, so a rerun builds nothing;
2. one ``sakura serve`` child process per packs folder, a paced link in front of each
   (``edge.replay.links``);
3. setup (``edge.replay.template_setup``; recorded once; a resumed replay reuses it): the
   masked execution time ``T`` with the whole FP16 cache resident
   (``edge.floor.exact_and_floor``, which also gives ``exact``), ``full`` (the whole
   model, no cache), the regime factor, storage per codec;
4. runs (``edge.replay.runs``), strictly one at a time (concurrent timed edits on this
   2-core host would distort each other's timings): for each network, start point and
   policy, the link is set to the start point's trace (scaled by the factor) and the real
   edit runs through it. A timed run waits until the host's 1-minute load average is at
   most ``max_load`` (1.5, issue 33's rule: the replay alone measured 0.5 median, 1.07 at
   most, over 417 runs of ``docs/replay-kernel``), and a run that ends above it is taken
   again (:func:`_timed_run`, ``edge.replay.load_gate``); a resume retakes such records, and
   a template's setup (its ``T`` sets the regime factor of all its runs) is measured again
   the same way. So a test suite or a build started beside a long replay pauses it instead
   of skewing it.

Regime ``matched``: one factor per template scales every network's traces (see
``edge.replay.template_setup``). Regime ``profile``: see :mod:`edge.replay.profile`. The
device state a run starts from: see ``edge.replay.runs``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from sakura.edge.errors import EdgeError
from sakura.edge.replay.config import ReplayConfig, ReplayConfigError
from sakura.edge.replay.links import Links
from sakura.edge.replay.load_gate import RETAKES, load1, wait_for_quiet
from sakura.edge.replay.networks import pooled_median_bps
from sakura.edge.replay.packs import build_all, build_jobs
from sakura.edge.replay.plan import plan
from sakura.edge.replay.results import ResultsFile, failure_record
from sakura.edge.replay.resume import check_meta
from sakura.edge.replay.runs import run_matched, run_profile
from sakura.edge.replay.template_setup import TemplateState, setup_template
from sakura.traces import require_trace_dir

from sakura.errors import SakuraError

Log = Callable[[str], None]
MAX_FAILURES = 5  # consecutive failed runs that end a replay (something systematic)


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Any]:
    from tqdm import tqdm

    bar = tqdm(total=total, desc="replay", unit="run", disable=not enabled, file=sys.stderr,
               dynamic_ncols=True)
    try:
        yield bar
    finally:
        bar.close()


def _model_folder(cfg: ReplayConfig) -> Path:
    """The checkpoint folder of ``cfg.model`` (an adapter model, ``cfg`` validated), or one
    clear error."""
    from sakura.dit.adapters.registry import MODELS  # lazy: torch

    spec = MODELS[cfg.model]
    path = cfg.model_path or spec.default_path
    if path is None:
        raise ReplayConfigError(f"{cfg.source}: model {cfg.model} needs model_path")
    if not Path(path).is_dir():
        raise ReplayConfigError(f"{cfg.source}: model_path {path} is not a folder")
    return Path(path)


def _adapter_model(cfg: ReplayConfig) -> tuple[Path, str, Any]:
    """``(checkpoint folder, its fingerprint, the engine)`` of ``cfg.model``: the identity a
    resume checks and the report names is the adapter path's own checkpoint fingerprint
    (``dit.adapters.engine.checkpoint_fingerprint``), as in every manifest it builds."""
    from sakura.dit.adapters.engine import load_engine  # lazy: torch, diffusers

    path = _model_folder(cfg)
    engine = load_engine(cfg.model, path)
    return path, str(engine.weights_id), engine


def run_replay(cfg: ReplayConfig, out: str | Path, log: Log = print,
               progress: bool = True, model: Any = None) -> dict[str, Any]:
    """Run (or resume) the replay into ``out``, then the same runs of each of
    ``cfg.models`` into ``out/<name>`` (``ReplayConfig.for_model``); returns a summary with
    every model's runs counted in and their failures named ``<model>:<run>``. Every
    model's configuration is checked before the first run."""
    from sakura.dit.templates import load_catalog  # lazy: torch

    catalog = load_catalog(cfg.catalog)
    cfg.validate(catalog)
    subs = [(name, cfg.for_model(name)) for name in cfg.models]  # validated with cfg
    for _, sub in subs:
        _model_folder(sub)
    summary = _run_one(cfg, Path(out), log, progress, model, catalog)
    for name, sub in subs:
        log(f"replay: model {name} into {Path(out) / name} ({sub.runtime} runtime)")
        done = _run_one(sub, Path(out) / name, log, progress, None, catalog)
        for k in ("planned", "skipped", "ran"):
            summary[k] += done[k]
        if done.get("failed"):
            summary.setdefault("failed", []).extend(f"{name}:{k}" for k in done["failed"])
    return summary


def _run_one(cfg: ReplayConfig, out: Path, log: Log, progress: bool, model: Any,
             catalog: Any) -> dict[str, Any]:
    """One model's replay into ``out`` (``cfg`` validated)."""
    from sakura.dit.weights import DEFAULT_WEIGHTS, load_model  # lazy: torch
    from sakura.edge.bench import file_sha256  # lazy: torch

    root = cfg.trace_dir or str(require_trace_dir())
    if not Path(root).is_dir():
        raise ReplayConfigError(f"trace_dir {root} is not a folder")
    if cfg.model is not None:  # a diffusers adapter model (e.g. sakura-flux2, the second)
        weights, weights_sha, engine = _adapter_model(cfg)
        model = model if model is not None else engine
    else:
        weights = Path(cfg.weights) if cfg.weights else DEFAULT_WEIGHTS
        if not weights.exists():
            raise ReplayConfigError(f"model weights {weights} do not exist")
        weights_sha = file_sha256(weights)
    runs = plan(cfg, root)  # bad or missing traces fail here, before anything is written
    check_meta(out, cfg, weights_sha)
    results = ResultsFile(out)
    timed = cfg.regime == "matched"  # the profile regime's times are modelled
    gate = cfg.load_gate if timed else 0.0
    done = results.done(gate)
    todo = [r for r in runs if str(r.key) not in done]
    log(f"replay: {len(runs)} runs planned, {len(runs) - len(todo)} already done, "
        f"{len(todo)} to run ({cfg.regime} regime, {cfg.link} link, timed runs sequential)")
    summary: dict[str, Any] = {"planned": len(runs), "skipped": len(runs) - len(todo),
                               "ran": 0}
    failed: list[str] = []
    in_a_row = 0
    if not todo:
        return summary
    packs = Path(cfg.packs_dir) if cfg.packs_dir else out / "packs"
    build_all(build_jobs(cfg, packs, weights, runs), cfg.build_workers, log)
    variants = sorted({r.variant for r in runs}, key=lambda v: (v != "main", v))
    median = pooled_median_bps(cfg.regime_network, root)
    if model is None:
        model = load_model(weights)
    runner = run_matched if cfg.regime == "matched" else run_profile
    with Links(cfg, packs, variants, log) as links, _progress(len(todo), progress) as bar:
        state: TemplateState | None = None
        for r in todo:
            if state is None or state.tid != r.template:
                state = None  # free the previous template's images first
                needed = sorted({x.variant for x in runs if x.template == r.template},
                                key=lambda v: (v != "main", v))
                state = setup_template(cfg, r.template, r.base, needed, links, model,
                                       weights_sha, catalog, results, packs, median, log,
                                       max_load=gate)
            try:
                rec = _timed_run(runner, r, state, cfg, links, root, gate, results, log)
            except SakuraError as exc:
                # one bad run (e.g. a transfer that exhausted its retries) must not end a
                # long unattended replay; its failure is recorded (the report names it) and
                # a rerun retries it
                failed.append(str(r.key))
                in_a_row += 1
                results.append(failure_record(r.key, str(exc), load1(), time.time()))
                log(f"run {r.key} failed: {exc} (a failure record; rerun to retry)")
                if in_a_row >= MAX_FAILURES:
                    raise EdgeError(f"{in_a_row} runs failed in a row, the last: {exc}") from exc
                bar.update(1)
                continue
            in_a_row = 0
            results.append(rec)
            summary["ran"] += 1
            bar.set_postfix_str(f"{r.template} {r.key.network} {r.key.policy} "
                                f"{rec['latency_s']:.2f}s", refresh=False)
            bar.update(1)
    if failed:
        summary["failed"] = failed
    return summary


def _timed_run(runner: Callable[..., dict[str, Any]], r: Any, state: TemplateState,
               cfg: ReplayConfig, links: Links, root: str, gate: float, results: ResultsFile,
               log: Log, load: Callable[[], float] | None = None) -> dict[str, Any]:
    """One run once the host is quiet; a run that ended above ``gate`` is kept (appended,
    so nothing is lost) and taken again, at most :data:`RETAKES` times; the caller appends
    the last, which replaces the others (``ResultsFile.latest``)."""
    retakes = 0
    while True:
        before = wait_for_quiet(gate, log, load)
        rec = runner(r, state, cfg, links, root)
        rec["load1_before"] = before
        after = float(rec.get("load1") or 0.0)
        if gate <= 0 or after <= gate or retakes >= RETAKES:
            return rec
        retakes += 1
        log(f"run {r.key} ended at load average {after:.2f} > {gate:g}: taken again")
        results.append(rec)
