"""One request's regional execution as a state machine (:class:`RegionalState`), its
statistics (:class:`RegionalStats`), and the single-process loop that drives it with a
backend (:func:`run_regional`). The cloud render engine drives the same state from its
scheduler (``cloud/render.py``): the state decides, whoever computes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from sakura.dit.regional.backend import (
    FullResult,
    KVStore,
    PatchResult,
    ProbeResult,
    RegionalBackend,
)
from sakura.dit.regional.config import RegionalConfig
from sakura.dit.regional.gate import (
    GateDecision,
    ImportanceGate,
    PaperGate,
    PatchGate,
    PeriodicGate,
)
from sakura.dit.regional.partition import Partition, make_partition


@dataclass
class RegionalStats:
    """What happened: patch-steps run/skipped, modelled compute (probes included), the
    partition, and the reuse error (the online quality signal: relative difference
    between a re-run patch's fresh velocity and the one it reused while skipped)."""

    steps: int
    warmup: int
    patches: int = 0
    focus_patches: int = 0
    patch_sizes: list[int] = field(default_factory=list)
    executed_patch_steps: int = 0
    skipped_patch_steps: int = 0
    forced_patch_steps: int = 0
    guaranteed_patch_steps: int = 0   # run only because every gated step runs one
    macs: float = 0.0
    full_macs: float = 0.0
    probe_macs: float = 0.0
    saliency_macs: float = 0.0
    probes: int = 0
    probe_steps: int = 0
    explained: float = float("nan")
    reuse_error_sum: float = 0.0
    reuse_error_weight: int = 0
    active_log: list[list[int]] = field(default_factory=list)

    @property
    def skipped_fraction(self) -> float:
        total = self.executed_patch_steps + self.skipped_patch_steps
        return self.skipped_patch_steps / total if total else 0.0

    @property
    def min_active_patches(self) -> int | None:
        """The fewest patches any gated step ran (None: no gated step)."""
        return min((len(a) for a in self.active_log), default=None)

    @property
    def forced_fraction(self) -> float:
        """Share of the gated patch-steps that ran only because of the K cap."""
        return self.forced_patch_steps / self.executed_patch_steps if self.executed_patch_steps else 0.0

    @property
    def compute_fraction(self) -> float:
        return self.macs / self.full_macs if self.full_macs else 1.0

    @property
    def probe_fraction(self) -> float:
        """Share of the modelled compute spent on saliency and gating probes."""
        return (self.probe_macs + self.saliency_macs) / self.macs if self.macs else 0.0

    @property
    def reuse_error(self) -> float:
        return self.reuse_error_sum / self.reuse_error_weight if self.reuse_error_weight else 0.0

    def to_dict(self) -> dict:
        return {"steps": self.steps, "warmup": self.warmup, "patches": self.patches,
                "focus_patches": self.focus_patches,
                "patch_sizes": self.patch_sizes, "executed_patch_steps": self.executed_patch_steps,
                "skipped_patch_steps": self.skipped_patch_steps,
                "forced_patch_steps": self.forced_patch_steps,
                "guaranteed_patch_steps": self.guaranteed_patch_steps,
                "forced_fraction": self.forced_fraction,
                "min_active_patches": self.min_active_patches,
                "skipped_fraction": self.skipped_fraction,
                "compute_fraction": self.compute_fraction, "probe_fraction": self.probe_fraction,
                "probes": self.probes, "probe_steps": self.probe_steps,
                "reuse_error": self.reuse_error,
                "explained": self.explained}


class RegionalState:
    """One request's regional execution, step by step, independent of who computes.

    The single-process sampler (:func:`run_regional`) and the cloud render engine drive
    the same state: ask :meth:`phase`, get the work done by a backend, hand back the
    results with :meth:`apply_full` / :meth:`apply_probes` / :meth:`apply_patches`.
    Results are keyed by (step, patch); applying a step twice is refused, so outputs are
    applied exactly once.

    A patch step whose gate needs probes (:meth:`probe_inputs` not empty) is decided only
    after :meth:`apply_probes` got them: the importance gate probes every step (and, at
    the first patch step, the last warm-up step's latents as every patch's reference);
    the drift gate probes the last warm-up step once (the patches' first importance).
    """

    def __init__(self, cfg: RegionalConfig, coords: torch.Tensor, timesteps: torch.Tensor,
                 x: torch.Tensor, text_tokens: int, salient: torch.Tensor | None = None,
                 cost=None, patches: int | None = None):
        self.steps = len(timesteps) - 1
        cfg.validate(self.steps)
        self.cfg, self.coords, self.ts = cfg, coords, timesteps
        self.x = x.clone()
        self.n = x.shape[0]
        self.text_tokens = text_tokens
        self.salient = salient
        self.cost = cost
        self.patch_count = patches if patches is not None else cfg.patches
        self.step = 0
        self.store: KVStore | None = None
        self.partition: Partition | None = None
        self.gate: PaperGate | PatchGate | ImportanceGate | PeriodicGate | None = None
        self.eps = cfg.threshold        # the engine may change it between steps
        self.v_last = torch.zeros_like(self.x)
        self.v_prev: torch.Tensor | None = None
        self.importance: torch.Tensor | None = None
        self.rate: torch.Tensor | None = None
        self.last_exec: torch.Tensor | None = None
        self.decisions: dict[int, GateDecision] = {}
        self.stats = RegionalStats(self.steps, min(cfg.warmup, self.steps))
        self.img_keys_full = 0
        self._x_warm: torch.Tensor | None = None  # last warm-up step's input (reference probe)
        self._probes: dict[int, dict[str, ProbeResult]] = {}

    # -- queries ----------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.step >= self.steps

    def phase(self, step: int | None = None) -> str:
        step = self.step if step is None else step
        return "full" if step < self.cfg.warmup or self.partition is None else "patches"

    def wants_probe(self, step: int) -> bool:
        """The last warm-up step is probed (it builds the partition)."""
        return step == self.cfg.warmup - 1 and step < self.steps - 1

    @property
    def measures(self) -> bool:
        """Whether patch calls measure their self mass (the drift gate's importance)."""
        return self.cfg.gate == "drift"

    @property
    def joint(self) -> bool:
        """Whether the active patches of a step run as one unit (``execution="joint"``);
        the naive baseline always runs its patches separately."""
        return self.cfg.execution == "joint" and self.cfg.context == "stale"

    def wants_kv(self, step: int) -> bool:
        return self.wants_probe(step) and self.cfg.context == "stale"

    def dt(self, step: int) -> float:
        return float(self.ts[step + 1] - self.ts[step])

    def t(self, step: int) -> float:
        return float(self.ts[step])

    # -- full steps -------------------------------------------------------------------

    def apply_full(self, step: int, res: FullResult) -> None:
        if step != self.step or self.phase(step) != "full":
            raise RuntimeError(f"full result for step {step} does not fit (at {self.step})")
        v = res.velocity.to(self.x.dtype)
        self.v_prev, self.v_last = self.v_last if step > 0 else None, v.clone()
        self._account(self.n + self.text_tokens, self.n + self.text_tokens + self._extra_keys(res))
        if self.wants_probe(step):
            self._build_partition(res)
            self._x_warm = self.x.clone()
        self.x = self.x + self.dt(step) * v
        self.step += 1

    def _extra_keys(self, res: FullResult) -> int:
        if res.img_keys:
            self.img_keys_full = res.img_keys
        return max(0, self.img_keys_full - self.n)

    def _build_partition(self, res: FullResult) -> None:
        if res.text_attn is None:
            raise RuntimeError("the last warm-up step must be probed")
        ta = res.text_attn.double()
        sal = ta[:, self.salient].sum(-1) if self.salient is not None else ta.sum(-1)
        cfg = self.cfg
        part = make_partition(cfg.partition, self.coords, sal, self.patch_count, cfg,
                              self.text_tokens)
        self.partition = part
        if cfg.gate == "paper":
            self.gate = PaperGate(part.count, self.eps, cfg.max_skips, cfg.eps_patches)
        elif cfg.gate == "importance":
            self.gate = ImportanceGate(part.count, self.eps, cfg.max_skips)
        elif cfg.gate == "periodic":
            self.gate = PeriodicGate(part.count, cfg.skip_fraction, cfg.max_skips)
        else:
            self.gate = PatchGate(part.count, self.eps, cfg.max_skips, cfg.normalize)
        self.store = res.kv
        rate = torch.ones(part.count)
        if self.v_prev is not None:
            for i, p in enumerate(part.patches):
                rate[i] = self._drift(self.v_last[p], self.v_prev[p])
        self.rate = rate
        self.importance = torch.ones(part.count, dtype=torch.float64)
        self.last_exec = torch.full((part.count,), self.step, dtype=torch.long)
        self.stats.patches = part.count
        self.stats.focus_patches = part.focus
        self.stats.patch_sizes = part.sizes()
        self.stats.explained = part.explained
        self.stats.saliency_macs += res.probe_macs
        self.stats.macs += res.probe_macs

    # -- probes -----------------------------------------------------------------------

    def probe_inputs(self, step: int) -> list[tuple[str, float, torch.Tensor, int | None]]:
        """The probes step ``step`` needs before its gate decision, not yet applied:
        ``(label, t, x, depth)``; ``label`` ``"ref"`` = the last warm-up step's latents,
        ``"now"`` = this step's."""
        if self.phase(step) != "patches" or step in self.decisions or step in self._probes:
            return []
        out = []
        gate = self.cfg.gate
        warm = self.cfg.warmup - 1
        probed = gate in ("paper", "importance")
        if step == self.cfg.warmup and gate in ("paper", "importance", "drift"):
            depth = self.cfg.probe_depth if probed else None
            out.append(("ref", self.t(warm), self._x_warm, depth))
        if probed and self.eps > 0:  # eps = 0: every patch runs, no probe
            out.append(("now", self.t(step), self.x, self.cfg.probe_depth))
        return out

    def apply_probes(self, step: int, results: dict[str, ProbeResult]) -> None:
        want = {label for label, *_ in self.probe_inputs(step)}
        if step != self.step or set(results) != want:
            raise RuntimeError(f"step {step}: probes {sorted(results)}, need {sorted(want)}")
        self.stats.probe_steps += 1
        for r in results.values():
            self.stats.probe_macs += r.macs
            self.stats.macs += r.macs
            self.stats.probes += 1
        ref = results.get("ref")
        if ref is not None:
            if isinstance(self.gate, (ImportanceGate, PaperGate)):
                self.gate.start(ref.mass)
            else:
                self.importance = ref.lift(self.partition.sizes())
            self._x_warm = None
        self._probes[step] = results

    # -- patch steps ------------------------------------------------------------------

    def decide(self, step: int) -> GateDecision:
        """The gate decision for ``step`` (computed once; later calls return it)."""
        if step in self.decisions:
            return self.decisions[step]
        if step != self.step or self.phase(step) != "patches":
            raise RuntimeError(f"no patch step {step} now (at {self.step})")
        if self.probe_inputs(step):
            raise RuntimeError(f"step {step} needs its probes first")
        self.gate.eps = self.eps if not isinstance(self.gate, PeriodicGate) else 0.0
        if isinstance(self.gate, (ImportanceGate, PaperGate)):
            now = self._probes.get(step, {}).get("now")
            d = self.gate.decide(None if now is None else now.mass)
        elif isinstance(self.gate, PeriodicGate):
            d = self.gate.decide()
        else:
            change = self.rate * (step - self.last_exec).double()
            imp = self.importance.clamp_min(0) ** self.cfg.importance_power
            d = self.gate.decide(imp, change)
        self._probes.pop(step, None)
        self.decisions[step] = d
        return d

    def apply_patches(self, step: int, results: dict[int, PatchResult]) -> None:
        if step != self.step:
            raise RuntimeError(f"patch results for step {step} do not fit (at {self.step})")
        d = self.decide(step)
        want = set(d.active_ids())
        if set(results) != want:
            raise RuntimeError(f"step {step}: results for {sorted(results)}, need {sorted(want)}")
        parts = self.partition.patches
        v = self.v_last.clone()
        for p, r in results.items():
            idx = parts[p]
            new = r.velocity.to(v.dtype)
            gap = max(1, step - int(self.last_exec[p]))
            drift = self._drift(new, self.v_last[idx])
            if gap > 1:  # it reused v_last[idx] for gap - 1 steps
                self.stats.reuse_error_sum += _rel_change(new, self.v_last[idx]) * (gap - 1)
                self.stats.reuse_error_weight += gap - 1
            self.rate[p] = drift / gap
            v[idx] = new
            if r.self_mass == r.self_mass:  # measured in this call
                self.importance[p] = r.self_mass / (len(idx) / max(1, r.img_keys))
            self.last_exec[p] = step
        if self.store is not None:  # deferred writes: order-independent
            for p in sorted(results):
                self.store.write(parts[p], results[p].k, results[p].v)
        self.v_last = v
        self._account_patches([len(parts[p]) for p in sorted(results)])
        extra = sum(r.probe_macs for r in results.values())
        self.stats.probe_macs += extra
        self.stats.macs += extra
        self.stats.executed_patch_steps += len(results)
        self.stats.skipped_patch_steps += len(parts) - len(results)
        self.stats.forced_patch_steps += int(d.forced.sum())
        if d.guaranteed is not None:
            self.stats.guaranteed_patch_steps += int(d.guaranteed.sum())
        self.stats.active_log.append(sorted(results))
        self.x = self.x + self.dt(step) * v
        self.step += 1

    def _drift(self, new: torch.Tensor, old: torch.Tensor) -> float:
        if self.cfg.change == "absolute":
            return float((new.double() - old.double()).pow(2).mean().sqrt())
        return _rel_change(new, old)

    # -- compute accounting -----------------------------------------------------------

    def _account(self, queries: int, keys: int) -> None:
        if self.cost is None:
            return
        full = self.cost(self.n + self.text_tokens,
                         self.n + self.text_tokens + max(0, self.img_keys_full - self.n))
        self.stats.full_macs += full
        self.stats.macs += self.cost(queries, keys)

    def _account_patches(self, sizes: list[int]) -> None:
        if self.cost is None:
            return
        t = self.text_tokens
        extra = max(0, self.img_keys_full - self.n)
        stale = self.cfg.context == "stale"
        if self.joint:
            q = sum(sizes) + t
            keys = q + extra + (self.n - sum(sizes) if stale else 0)
        else:
            q = sum(s + t for s in sizes)
            keys = q + extra + (self.n if stale else 0)
        self.stats.full_macs += self.cost(self.n + t, self.n + t + extra)
        self.stats.macs += self.cost(q, keys) if sizes else 0.0


def _rel_change(new: torch.Tensor, old: torch.Tensor) -> float:
    den = float(new.double().norm())
    return float((new.double() - old.double()).norm()) / max(den, 1e-12)


def run_probes(backend: RegionalBackend, state: RegionalState, step: int,
               timer: dict | None = None) -> None:
    """Run and apply the probes ``step`` needs (``timer["probe_s"]`` accumulates their
    wall time when given)."""
    import time

    inputs = state.probe_inputs(step)
    if not inputs:
        return
    t0 = time.perf_counter()
    patches = list(state.partition.patches)
    res = {label: backend.probe(step, t, x, patches, depth) for label, t, x, depth in inputs}
    if timer is not None:
        timer["probe_s"] = timer.get("probe_s", 0.0) + time.perf_counter() - t0
    state.apply_probes(step, res)


def run_regional(backend: RegionalBackend, state: RegionalState,
                 timer: dict | None = None) -> RegionalState:
    """Drive ``state`` to the end with ``backend`` in this process."""
    while not state.done:
        s = state.step
        if state.phase(s) == "full":
            res = backend.run_full(s, state.t(s), state.x, probe=state.wants_probe(s),
                                   want_kv=state.wants_kv(s))
            state.apply_full(s, res)
        else:
            run_probes(backend, state, s, timer)
            d = state.decide(s)
            ids = d.active_ids()
            outs = backend.run_patches(s, state.t(s), state.x,
                                       [state.partition.patches[p] for p in ids],
                                       state.store if state.cfg.context == "stale" else None,
                                       joint=state.joint, measure=state.measures)
            state.apply_patches(s, dict(zip(ids, outs)))
    return state
