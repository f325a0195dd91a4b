"""The replay configuration: a dataclass loaded from YAML over documented defaults.

The defaults live in ``configs/default.yaml`` (shipped with the package); a user's file
only names what it changes (nested ``ablation`` and ``profile`` keys merge one level
deep). Unknown keys, wrong types, unknown workloads, templates, networks or policies are a
:class:`ReplayConfigError` naming the key, never a traceback.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from sakura.edge import RUNTIMES
from sakura.edge.monitor import DEFAULT_STARTUP_FRACTION, check_startup_fraction

from sakura.errors import SakuraError

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"
REGIMES = ("matched", "profile")
#: ``--quick``: start points per cell on the headline (5G) networks, and elsewhere
QUICK_STARTS = 10
QUICK_OTHER_STARTS = 3
LINKS = ("paced", "kernel")
RTT_SCALES = ("matched", "none")


class ReplayConfigError(SakuraError):
    """A replay configuration file or value is not usable."""


@dataclass(frozen=True)
class Ablation:
    networks: tuple[str, ...] = ("5g",)
    q: tuple[float, ...] = (0.25, 1.0)
    resolutions: tuple[int, ...] = (32,)
    resolution_templates: tuple[str, ...] = ("face-technologist",)
    starts: int = 0  # start points of the ablation runs (0: the network's)


@dataclass(frozen=True)
class ProfileSpec:
    """The phone the ``profile`` regime stands for (see ``edge/replay/profile.py``)."""

    name: str = "flux2-klein-4b-sd8-elite-gen5"
    local_s: float = 13.0
    masked_s: float = 2.3
    masked_ratio: float = 0.10
    fp16_gib: float = 1.46
    request_latency_s: float = 0.02


@dataclass(frozen=True)
class ReplayConfig:
    workloads: dict[str, tuple[str, ...]]
    networks: tuple[str, ...]
    policies: tuple[str, ...]
    starts: int = 100
    network_starts: dict[str, int] = field(default_factory=dict)  # per-network override
    seed: int = 0
    span_s: float = 60.0
    prompt: int = 0
    edit_seed: int = 100
    regime: str = "matched"
    regime_x: float = 10.0
    regime_network: str = "5g"
    link: str = "paced"
    rtt_ms: float = 30.0
    # matched: the link's RTT is rtt_ms x T / the phone's masked execution time (regime
    # matching scales time as well as rates); none: rtt_ms as it is
    rtt_scale: str = "matched"
    loss: float = 0.0
    pin_cpus: bool = True
    # the device runtime of the timed edits: "native" (C++ shard loop) or "python"
    runtime: str = "native"
    startup_fraction: float = DEFAULT_STARTUP_FRACTION
    headline_networks: tuple[str, ...] = ("5g",)
    # sakura with a deadline of m x T (T: the measured masked execution time) on the
    # headline networks: its latency-quality curve, for the iso-quality/iso-latency views
    deadlines: tuple[float, ...] = (2.0, 3.0, 4.0)
    ablation: Ablation = field(default_factory=Ablation)
    packs_dir: str | None = None
    weights: str | None = None
    catalog: str | None = None
    trace_dir: str | None = None
    build_workers: int = 1
    timelines: str = "all"
    profile: ProfileSpec = field(default_factory=ProfileSpec)
    quick: bool = False
    source: str = str(DEFAULT_CONFIG)

    # ------------------------------------------------------------------ derived
    @property
    def templates(self) -> list[str]:
        """The main templates, workload by workload."""
        return [t for ts in self.workloads.values() for t in ts]

    def starts_of(self, network: str) -> int:
        """Start points per (template, network) cell of the main runs on ``network``."""
        return int(self.network_starts.get(network, self.starts))

    def quick_version(self, starts: int | None = None) -> ReplayConfig:
        """``--quick``: one template per workload, the first two networks; ``starts``
        (default :data:`QUICK_STARTS`) start points on the headline networks, at most
        :data:`QUICK_OTHER_STARTS` on the others and in the ablations (q, resolution); the
        first and last of the ``deadlines`` (sakura's operating points)."""
        n = int(starts) if starts is not None else QUICK_STARTS
        nets = self.networks[:2]
        other = {net: min(n, QUICK_OTHER_STARTS) for net in nets
                 if net not in self.headline_networks}
        return replace(
            self, quick=True,
            workloads={w: ts[:1] for w, ts in self.workloads.items()},
            networks=nets, starts=n, network_starts=other,
            deadlines=tuple(dict.fromkeys(self.deadlines[:1] + self.deadlines[-1:])),
            ablation=replace(self.ablation, networks=self.ablation.networks[:1],
                             resolution_templates=self.ablation.resolution_templates[:1],
                             starts=min(n, QUICK_OTHER_STARTS)))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["workloads"] = {w: list(ts) for w, ts in self.workloads.items()}
        d["network_starts"] = dict(self.network_starts)
        return d

    # ------------------------------------------------------------------ checks
    def validate(self, catalog: dict[str, Any] | None = None) -> ReplayConfig:
        from sakura.edge.allocator import POLICIES
        from sakura.edge.replay.networks import NETWORKS

        def bad(msg: str) -> ReplayConfigError:
            return ReplayConfigError(f"{self.source}: {msg}")

        from sakura.dit.templates import WORKLOADS

        if not self.workloads:
            raise bad("workloads is empty")
        for w, ts in self.workloads.items():
            if w not in WORKLOADS:
                raise bad(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
            if not ts:
                raise bad(f"workload {w!r} has no templates")
        if catalog is not None:
            for t in list(self.templates) + list(self.ablation.resolution_templates):
                if t not in catalog:
                    raise bad(f"unknown template {t!r}; the catalog has {', '.join(catalog)}")
            for w, ts in self.workloads.items():
                for t in ts:
                    if catalog[t].workload != w:
                        raise bad(f"template {t!r} is a {catalog[t].workload} template, "
                                  f"listed under {w!r}")
        nets = list(self.networks) + list(self.ablation.networks) + [self.regime_network]
        for n in nets + list(self.headline_networks):
            if n not in NETWORKS:
                raise bad(f"unknown network {n!r}; known: {', '.join(NETWORKS)}")
        if not self.networks:
            raise bad("networks is empty")
        for p in self.policies:
            if p not in POLICIES:
                raise bad(f"unknown policy {p!r}; known: {', '.join(POLICIES)}")
        if not self.policies:
            raise bad("policies is empty")
        if self.starts < 1:
            raise bad(f"starts must be >= 1, got {self.starts}")
        for n, k in self.network_starts.items():
            if n not in NETWORKS:
                raise bad(f"network_starts: unknown network {n!r}")
            if int(k) < 1:
                raise bad(f"network_starts.{n} must be >= 1, got {k}")
        for m in self.deadlines:
            if not 1.0 <= m <= 100.0:
                raise bad(f"deadlines are multiples of T in [1, 100], got {m}")
        if self.ablation.starts < 0:
            raise bad(f"ablation.starts must be >= 0, got {self.ablation.starts}")
        if self.regime not in REGIMES:
            raise bad(f"regime must be one of {', '.join(REGIMES)}, got {self.regime!r}")
        if self.link not in LINKS:
            raise bad(f"link must be one of {', '.join(LINKS)}, got {self.link!r}")
        if not (0 <= self.rtt_ms <= 10_000):
            raise bad(f"rtt_ms must be in [0, 10000] ms, got {self.rtt_ms}")
        if self.rtt_scale not in RTT_SCALES:
            raise bad(f"rtt_scale must be one of {', '.join(RTT_SCALES)}, got "
                      f"{self.rtt_scale!r}")
        if not (0 <= self.loss < 0.5):
            raise bad(f"loss must be a rate in [0, 0.5), got {self.loss}")
        if not self.regime_x > 0 or not self.span_s > 0:
            raise bad("regime_x and span_s must be > 0")
        if not 0 <= self.prompt < 3:
            raise bad(f"prompt must be 0, 1 or 2 (an evaluation prompt), got {self.prompt}")
        for q in self.ablation.q:
            if not 0.0 <= q <= 4.0:
                raise bad(f"ablation.q values must be in [0, 4], got {q}")
        for r in self.ablation.resolutions:
            if r not in (32, 48, 64):
                raise bad(f"ablation.resolutions must be 32, 48 or 64 (the model's), got {r}")
        try:
            check_startup_fraction(self.startup_fraction)
        except ValueError as exc:
            raise bad(str(exc)) from None
        if self.runtime not in RUNTIMES:
            raise bad(f"runtime must be one of {', '.join(RUNTIMES)}, got {self.runtime!r}")
        if self.timelines not in ("all", "first"):
            raise bad(f"timelines must be 'all' or 'first', got {self.timelines!r}")
        if self.build_workers < 1:
            raise bad("build_workers must be >= 1")
        p = self.profile
        if min(p.local_s, p.masked_s, p.masked_ratio, p.fp16_gib) <= 0 or p.request_latency_s < 0:
            raise bad("profile times, masked_ratio and fp16_gib must be > 0")
        return self


# ---------------------------------------------------------------------------- loading


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    if not path.exists():
        raise ReplayConfigError(f"replay config {path} does not exist")
    try:
        doc = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ReplayConfigError(f"replay config {path} is not valid YAML: {exc}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ReplayConfigError(f"replay config {path} must be a mapping of keys to values")
    return doc


def _tuple(value: Any, kind: type, key: str, source: str) -> tuple:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list):
        raise ReplayConfigError(f"{source}: {key} must be a list, got {value!r}")
    try:
        return tuple(kind(v) for v in value)
    except (TypeError, ValueError):
        raise ReplayConfigError(f"{source}: {key} must be a list of {kind.__name__}, "
                                f"got {value!r}") from None


def _scalar(value: Any, kind: type, key: str, source: str) -> Any:
    if value is None:
        return None
    if kind is str and not isinstance(value, str) or isinstance(value, (list, dict)):
        raise ReplayConfigError(f"{source}: {key} must be a {kind.__name__}, got {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise ReplayConfigError(f"{source}: {key} must be true or false, got {value!r}")
    if isinstance(value, bool) and kind is not bool:
        raise ReplayConfigError(f"{source}: {key} must be a {kind.__name__}, got {value!r}")
    try:
        out = kind(value)
    except (TypeError, ValueError):
        raise ReplayConfigError(f"{source}: {key} must be a {kind.__name__}, "
                                f"got {value!r}") from None
    if kind is int and float(value) != out:
        raise ReplayConfigError(f"{source}: {key} must be an integer, got {value!r}")
    return out


_SCALARS: dict[str, type] = {
    "starts": int, "seed": int, "span_s": float, "prompt": int, "edit_seed": int,
    "regime": str, "regime_x": float, "regime_network": str, "link": str,
    "rtt_ms": float, "rtt_scale": str, "loss": float, "pin_cpus": bool, "startup_fraction": float,
    "runtime": str,
    "packs_dir": str, "weights": str, "catalog": str, "trace_dir": str, "build_workers": int,
    "timelines": str,
}


def _nested(cls: type, value: Any, key: str, source: str, base: Any) -> Any:
    if value is None:
        return base
    if not isinstance(value, dict):
        raise ReplayConfigError(f"{source}: {key} must be a mapping, got {value!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ReplayConfigError(f"{source}: unknown key(s) {key}.{', '.join(unknown)}; "
                                f"known: {', '.join(known)}")
    out = {}
    for k, v in value.items():
        default = getattr(base, k)
        if isinstance(default, tuple):
            kind = type(default[0]) if default else str
            out[k] = _tuple(v, kind, f"{key}.{k}", source)
        else:
            out[k] = _scalar(v, type(default), f"{key}.{k}", source)
    return replace(base, **out)


def _from_dict(doc: dict[str, Any], source: str, base: ReplayConfig | None) -> ReplayConfig:
    known = {f.name for f in fields(ReplayConfig)} - {"quick", "source"}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ReplayConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; "
                                f"known: {', '.join(sorted(known))}")
    kw: dict[str, Any] = {}
    if "workloads" in doc:
        w = doc["workloads"]
        if not isinstance(w, dict):
            raise ReplayConfigError(f"{source}: workloads must map a workload to template ids")
        kw["workloads"] = {str(k): _tuple(v, str, f"workloads.{k}", source)
                           for k, v in w.items()}
    for key in ("networks", "policies", "headline_networks"):
        if key in doc:
            kw[key] = _tuple(doc[key], str, key, source)
    if "deadlines" in doc:
        kw["deadlines"] = _tuple(doc["deadlines"], float, "deadlines", source)
    if "network_starts" in doc:
        ns = doc["network_starts"]
        if not isinstance(ns, dict):
            raise ReplayConfigError(f"{source}: network_starts must map a network to a "
                                    f"number of start points, got {ns!r}")
        kw["network_starts"] = {str(k): _scalar(v, int, f"network_starts.{k}", source)
                                for k, v in ns.items()}
    for key, kind in _SCALARS.items():
        if key in doc:
            kw[key] = _scalar(doc[key], kind, key, source)
    if base is None:
        missing = {"workloads", "networks", "policies"} - set(kw)
        if missing:
            raise ReplayConfigError(f"{source}: missing {', '.join(sorted(missing))}")
        cfg = ReplayConfig(**{k: kw[k] for k in ("workloads", "networks", "policies")},
                           source=source)
        kw = {k: v for k, v in kw.items() if k not in ("workloads", "networks", "policies")}
    else:
        cfg = replace(base, source=source)
    cfg = replace(cfg, **kw)
    if "ablation" in doc:
        cfg = replace(cfg, ablation=_nested(Ablation, doc["ablation"], "ablation", source,
                                            cfg.ablation))
    if "profile" in doc:
        cfg = replace(cfg, profile=_nested(ProfileSpec, doc["profile"], "profile", source,
                                           cfg.profile))
    return cfg


def default_config() -> ReplayConfig:
    """The shipped defaults (``configs/default.yaml``)."""
    return _from_dict(_read_yaml(DEFAULT_CONFIG), str(DEFAULT_CONFIG), None)


def load_config(path: str | Path | None = None, *, quick: bool = False,
                **overrides: Any) -> ReplayConfig:
    """``path`` over the defaults (None: the defaults), then ``overrides`` (non-None
    values: e.g. from the command line), then ``--quick``; validated (not against the
    template catalog, see :meth:`ReplayConfig.validate`)."""
    cfg = default_config()
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ReplayConfigError(f"replay config {p} is a folder, not a YAML file")
        cfg = _from_dict(_read_yaml(p), str(p), cfg)
    extra = {k: v for k, v in overrides.items() if v is not None}
    if quick:
        # --quick sizes the run; an explicit --starts still decides its start points
        starts = extra.pop("starts", None)
        if extra:
            cfg = _from_dict(extra, cfg.source, cfg)
        return cfg.quick_version(starts).validate()
    if extra:
        cfg = _from_dict(extra, cfg.source, cfg)
    return cfg.validate()
