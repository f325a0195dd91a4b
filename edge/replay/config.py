"""The replay configuration: pydantic models loaded from YAML over documented defaults.

Each setting is defined once, as a field below: its type, its default and its description
(and the environment variable that stands in when it is unset, where one exists; see
:func:`settings_table`). ``configs/default.yaml`` (shipped with the package) writes the same
defaults out with comments for a user to copy; ``tests/edge/test_replay.py`` holds the two
together. A user's file only names what it changes (nested ``ablation`` and ``profile``
keys merge one level deep). Unknown keys, wrong types, unknown workloads, templates,
networks or policies are a :class:`ReplayConfigError`: one line naming the file and the
key, never a traceback.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError
from sakura.edge import RUNTIMES
from sakura.edge.allocator import POLICIES
from sakura.edge.monitor import DEFAULT_STARTUP_FRACTION, check_startup_fraction
from sakura.edge.replay.networks import NETWORKS

from sakura.errors import SakuraError

CONFIG_DIR = Path(__file__).parent / "configs"
LOAD_ENV = "SAKURA_REPLAY_MAX_LOAD"
DEFAULT_MAX_LOAD = 1.5  # issue 33's rule; the replay alone stays under 1.1 (edge.replay.load_gate)
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"
REGIMES = ("matched", "profile")
#: ``--quick``: start points per cell on the headline (5G) networks, and elsewhere
QUICK_STARTS = 10
QUICK_OTHER_STARTS = 3
LINKS = ("paced", "kernel")
RTT_SCALES = ("matched", "none")
RTO_MINS = ("scaled", "kernel")


class ReplayConfigError(SakuraError):
    """A replay configuration file or value is not usable."""


# ---------------------------------------------------------------------------- field types
# YAML's types as the configuration takes them: a number is never a bool (nor a bool a
# number), a bool is written true or false, a list of one may be written as its item.


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a bool is not a number")
    return value


def _listify(value: Any) -> Any:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return [value]
    return value


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]
Bool = Annotated[bool, Strict()]
Strs = Annotated[tuple[str, ...], BeforeValidator(_listify)]
Ints = Annotated[tuple[Int, ...], BeforeValidator(_listify)]
Floats = Annotated[tuple[Float, ...], BeforeValidator(_listify)]


class _Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes``, validated like a loaded file."""
        return type(self).model_validate({**dict(self), **changes})


class Ablation(_Settings):
    networks: Strs = Field(("5g",), description="where the ablations and the resolution run")
    q: Floats = Field((0.25, 1.0), description="extra sakura packs, each pinned at its q (0: svd's; the default sakura chooses q per shard)")
    resolutions: Ints = Field((32,), description="second resolution(s) of "
                                                 "resolution_templates")
    resolution_templates: Strs = Field(("face-technologist",),
                                       description="templates of the resolution run")
    starts: Int = Field(0, description="start points of the ablations (0: the network's)")


class ProfileSpec(_Settings):
    """The phone the ``profile`` regime stands for (see ``edge/replay/profile.py``)."""

    name: str = Field("flux2-klein-4b-sd8-elite-gen5", description="the profiled phone")
    local_s: Float = Field(13.0, description="fully local generation (s)")
    masked_s: Float = Field(2.3, description="masked execution window at masked_ratio of "
                                             "the tokens (s)")
    masked_ratio: Float = Field(0.10, description="share of the tokens masked_s is for")
    fp16_gib: Float = Field(1.46, description="FP16 template cache at 512x512 (GiB)")
    request_latency_s: Float = Field(0.02, description="the phone's request latency (s)")


class ReplayConfig(_Settings):
    workloads: dict[str, Strs] = Field(
        {"face-swap": ("face-technologist", "face-cook", "face-student"),
         "try-on": ("tryon-tuxedo", "tryon-farmer"),
         "instruction": ("edit-car-top", "edit-apple-leaf", "edit-house-roof")},
        description="workload -> catalog template ids (dit/catalog)")
    networks: Strs = Field(("5g", "mixed", "lte", "ucc5g", "wifi"),
                           description="named networks (edge/replay/networks.py)")
    policies: Strs = Field(("local", "fp16", "intq", "cachegen", "svd", "sakura",
                            "sakura-fixed-config", "sakura-fixed-bits"),
                           description="the systems replayed side by side")
    starts: Int = Field(100, description="start points per (template, network); the same "
                                         "for every policy")
    network_starts: dict[str, Int] = Field({}, description="start points of one network "
                                                           "instead of starts")
    policy_networks: dict[str, Strs] = Field({}, description="a policy that runs on these "
                                                             "networks only (e.g. fp16: "
                                                             "[5g], the slowest reference, "
                                                             "minutes an edit on wifi)")
    seed: Int = Field(0, description="seeds the start points")
    span_s: Float = Field(60.0, description="a start point leaves at least this much trace "
                                            "after it (s)")
    prompt: Int = Field(0, description="index of the template's evaluation prompt (never "
                                       "used for the pack)")
    edit_seed: Int = Field(100, description="the private edit's noise seed")
    regime: str = Field("matched", description="matched (real compute, real HTTP, scaled "
                                               "trace) or profile (phone)")
    regime_x: Float = Field(10.0, description="matched: FP16 cache at the regime network's "
                                              "median = regime_x x T")
    regime_network: str = Field("5g", description="the network whose pooled median defines "
                                                  "the one scale factor")
    link: str = Field("paced", description="paced (proxy in its own process) or "
                                           "kernel (netns + tbf, root)")
    rtt_ms: Float = Field(30.0, description="propagation round trip of the network (ms; half "
                                            "each way), on both links")
    rtt_scale: str = Field("matched", description="matched: the link carries rtt_ms x T / "
                                                  "the phone's masked execution time; none: "
                                                  "rtt_ms unscaled")
    rto_min: str = Field("scaled", description="kernel link: scaled: the routes' minimum "
                                               "TCP retransmission timeout scaled like the "
                                               "round trip (rtt_scale); kernel: the "
                                               "kernel's 200 ms")
    loss: Float = Field(0.0, description="packet loss rate (modelled as retransmission "
                                         "cost, traces/impair.py)")
    pin_cpus: Bool = Field(True, description="2+ cores: the device on all but the last, "
                                             "server + link on the last")
    runtime: str = Field("native", description="the device runtime of the timed edits: "
                                               "native (C++ shard loop) or python")
    startup_fraction: Float = Field(DEFAULT_STARTUP_FRACTION,
                                    description="execution may start up to this fraction of "
                                                "the predicted execution time after the "
                                                "manifest (0 to 1)")
    headline_networks: Strs = Field(("5g",), description="the networks of the headline "
                                                         "numbers")
    deadlines: Floats = Field((2.0, 3.0, 4.0),
                              description="sakura-d<m>: sakura given a deadline of m x T "
                                          "(headline networks only)")
    ablation: Ablation = Field(Ablation(), description="the q and resolution ablations")
    packs_dir: str | None = Field(None, description="packs folder (default: <out>/packs, "
                                                    "built when missing)")
    weights: str | None = Field(None, description="model weights (default: the shipped "
                                                  "model)")
    model: str | None = Field(None, description="a --model of the diffusers adapters instead "
                                                "of the shipped MMDiT, e.g. sakura-flux2 (the "
                                                "second model), in the matched regime; a "
                                                "model not in the MMDiT's form needs runtime "
                                                "python")
    model_path: str | None = Field(None, description="that model's checkpoint folder "
                                                     "(default: the model's own, e.g. "
                                                     "dit/weights/sakura-flux2)")
    models: Strs = Field((), description="after the shipped MMDiT, replay each of these "
                                         "adapter models (e.g. sakura-flux2) with the same "
                                         "runs into <out>/<name> (on the python runtime "
                                         "unless it runs natively, as sakura-flux2 does); "
                                         "sakura report <out> reads them as per_model")
    catalog: str | None = Field(None, description="template catalog.json (default: the "
                                                  "shipped dit/catalog)")
    trace_dir: str | None = Field(None, description="the real-trace folder (default: "
                                                    "../shared/traces)",
                                  json_schema_extra={"env": "SAKURA_TRACES"})
    blocks_per_shard: Int = Field(4, description="the packs' transformer blocks per shard "
                                                 "(the builder's default; at most the "
                                                 "model's blocks)")
    build_workers: Int = Field(1, description="pack builds in parallel (processes); timed "
                                              "runs are always sequential")
    max_load: Float | None = Field(None, description="matched regime: a timed run (and a "
                                                     "template's setup) waits until the "
                                                     "1-minute load average is at most "
                                                     "this; one that ends above it is taken "
                                                     "again, and a resume retakes such "
                                                     "records; 0: no gate; unset: the "
                                                     "environment variable, else 1.5",
                                   json_schema_extra={"env": LOAD_ENV})
    timelines: str = Field("all", description="all or first (per-shard timelines of every "
                                              "run or start 0 only)")
    profile: ProfileSpec = Field(ProfileSpec(), description="the phone of the profile "
                                                            "regime")
    quick: bool = Field(False, description="set by --quick (not a file key)")
    source: str = Field(str(DEFAULT_CONFIG), description="the file it was read from (not a "
                                                         "file key)")

    # ------------------------------------------------------------------ derived
    @property
    def templates(self) -> list[str]:
        """The main templates, workload by workload."""
        return [t for ts in self.workloads.values() for t in ts]

    @property
    def load_gate(self) -> float:
        """``max_load``, else ``$SAKURA_REPLAY_MAX_LOAD``, else :data:`DEFAULT_MAX_LOAD`."""
        if self.max_load is not None:
            return float(self.max_load)
        text = os.environ.get(LOAD_ENV)
        if text is None:
            return DEFAULT_MAX_LOAD
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not value >= 0:
            raise ReplayConfigError(f"${LOAD_ENV} must be a load average >= 0, got {text!r}")
        return value

    def runs_on(self, policy: str, network: str) -> bool:
        """Whether the main runs of ``policy`` include ``network`` (``policy_networks``)."""
        nets = self.policy_networks.get(policy)
        return nets is None or network in nets

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
        # a policy kept to networks that --quick leaves out does not run
        only = {p: tuple(x for x in ns if x in nets) for p, ns in self.policy_networks.items()}
        return self.replace(
            quick=True,
            workloads={w: ts[:1] for w, ts in self.workloads.items()},
            networks=nets, starts=n, network_starts=other,
            policies=tuple(p for p in self.policies if only.get(p, True)),
            policy_networks={p: ns for p, ns in only.items() if ns},
            deadlines=tuple(dict.fromkeys(self.deadlines[:1] + self.deadlines[-1:])),
            ablation=self.ablation.replace(
                networks=self.ablation.networks[:1],
                resolution_templates=self.ablation.resolution_templates[:1],
                starts=min(n, QUICK_OTHER_STARTS)))

    def for_model(self, name: str) -> ReplayConfig:
        """The replay of ``models`` entry ``name``: the same runs of that model, on this
        runtime where the model runs natively (``dit.adapters.cli.runs_native``: the shipped
        model's form, as sakura-flux2), else on the python one; its packs in a folder of its
        own."""
        from sakura.dit.adapters.cli import runs_native  # lazy: torch on use

        runtime = self.runtime if runs_native(name) else "python"
        return self.replace(model=name, models=(), weights=None, runtime=runtime,
                            packs_dir=str(Path(self.packs_dir) / name) if self.packs_dir
                            else None)

    def to_dict(self) -> dict[str, Any]:
        d = self.model_dump()
        d["workloads"] = {w: list(ts) for w, ts in self.workloads.items()}
        return d

    # ------------------------------------------------------------------ checks
    def validate(self, catalog: dict[str, Any] | None = None) -> ReplayConfig:
        def bad(msg: str) -> ReplayConfigError:
            return ReplayConfigError(f"{self.source}: {msg}")

        from sakura.dit.templates import WORKLOADS  # lazy: torch

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
        for p, nets in self.policy_networks.items():
            if p not in self.policies:
                raise bad(f"policy_networks: {p!r} is not in policies")
            if not nets or any(n not in self.networks for n in nets):
                raise bad(f"policy_networks.{p} must name some of networks "
                          f"({', '.join(self.networks)}), got {list(nets)}")
        for m in self.deadlines:
            if not 1.0 <= m <= 100.0:
                raise bad(f"deadlines are multiples of T in [1, 100], got {m}")
        if self.ablation.starts < 0:
            raise bad(f"ablation.starts must be >= 0, got {self.ablation.starts}")
        if self.regime not in REGIMES:
            raise bad(f"regime must be one of {', '.join(REGIMES)}, got {self.regime!r}")
        if self.models:
            if self.model is not None:
                raise bad("models lists the models replayed after the shipped MMDiT; a "
                          "replay of one adapter model sets model instead")
            if len(set(self.models)) != len(self.models):
                raise bad(f"models lists a model twice: {', '.join(self.models)}")
            for name in self.models:  # each as its own replay checks it (model, below)
                self.for_model(name).validate(catalog)
        if self.model_path is not None and self.model is None:
            raise bad("model_path needs model (a --model name)")
        if self.model is not None:
            if self.weights is not None:
                raise bad("weights is the shipped MMDiT's; a model's checkpoint is model_path")
            from sakura.dit.adapters.cli import runs_native  # lazy: torch on use
            from sakura.dit.adapters.registry import MODELS  # lazy: torch

            if self.model not in MODELS:
                raise bad(f"unknown model {self.model!r}; choose one of "
                          f"{', '.join(sorted(MODELS))}")
            # the native runtime's graphs are the MMDiT's (and its converted forms'); the
            # profile regime computes its edits with the MMDiT's own cached_edit
            # (edge/replay/runs.py)
            if self.runtime != "python" and not runs_native(self.model):
                raise bad(f"model {self.model} runs on the python runtime: set runtime: python")
            if self.regime != "matched":
                raise bad(f"model {self.model} replays in the matched regime only")
        if self.link not in LINKS:
            raise bad(f"link must be one of {', '.join(LINKS)}, got {self.link!r}")
        if not (0 <= self.rtt_ms <= 10_000):
            raise bad(f"rtt_ms must be in [0, 10000] ms, got {self.rtt_ms}")
        if self.rtt_scale not in RTT_SCALES:
            raise bad(f"rtt_scale must be one of {', '.join(RTT_SCALES)}, got "
                      f"{self.rtt_scale!r}")
        if self.rto_min not in RTO_MINS:
            raise bad(f"rto_min must be one of {', '.join(RTO_MINS)}, got {self.rto_min!r}")
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
        if self.blocks_per_shard < 1:
            raise bad(f"blocks_per_shard must be >= 1, got {self.blocks_per_shard}")
        if self.max_load is not None and not self.max_load >= 0:
            raise bad(f"max_load must be >= 0 (0: no gate), got {self.max_load}")
        _ = self.load_gate  # a bad $SAKURA_REPLAY_MAX_LOAD fails here, before any run
        p = self.profile
        if min(p.local_s, p.masked_s, p.masked_ratio, p.fp16_gib) <= 0 or p.request_latency_s < 0:
            raise bad("profile times, masked_ratio and fp16_gib must be > 0")
        return self


#: the keys a file (or the command line) may set; ``quick`` and ``source`` are the loader's
FILE_KEYS = tuple(k for k in ReplayConfig.model_fields if k not in ("quick", "source"))
_NESTED = {"ablation": Ablation, "profile": ProfileSpec}


def settings_table() -> str:
    """The settings as a Markdown table: key, type, default, environment variable,
    description (nested keys dotted)."""
    rows = ["| key | type | default | env | description |", "|---|---|---|---|---|"]

    def add(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            if prefix == "" and name not in FILE_KEYS:
                continue
            if name in _NESTED and prefix == "":
                add(_NESTED[name], f"{name}.")
                continue
            kind = _type_name(f.annotation)
            env = (f.json_schema_extra or {}).get("env", "")
            default = f.default.model_dump() if isinstance(f.default, BaseModel) else f.default
            rows.append(f"| `{prefix}{name}` | {kind} | `{json.dumps(default)}` | "
                        f"{f'`${env}`' if env else ''} | {f.description} |")

    add(ReplayConfig, "")
    return "\n".join(rows)


def _type_name(ann: Any) -> str:
    """``int``, ``list of str``, ``map of str to list of str``, ``str or null``."""
    from typing import get_args, get_origin

    args = [a for a in get_args(ann) if not hasattr(a, "func") and not isinstance(a, Strict)]
    origin = get_origin(ann)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is tuple:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}"
    if args:  # X | None
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    return ann.__name__


# ---------------------------------------------------------------------------- loading


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    if not path.exists():
        raise ReplayConfigError(f"replay config {path} does not exist")
    try:
        doc = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ReplayConfigError(f"replay config {path} is not valid YAML: "
                                f"{' '.join(str(exc).split())}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ReplayConfigError(f"replay config {path} must be a mapping of keys to values")
    return doc


_KINDS = {"int": "int", "float": "float", "string": "str", "bool": "bool"}
_MAPS = {"workloads": "map a workload to template ids",
         "network_starts": "map a network to a number of start points",
         "policy_networks": "map a policy to a list of networks"}


def _error_line(exc: ValidationError, doc: dict[str, Any], source: str) -> ReplayConfigError:
    """The first of pydantic's errors as one line naming the file and the key."""
    errors = exc.errors()
    first = errors[0]
    loc = [str(p) for p in first["loc"]]
    if first["type"] == "extra_forbidden":
        parent = loc[:-1]
        unknown = [".".join(str(p) for p in e["loc"]) for e in errors
                   if e["type"] == "extra_forbidden" and [str(p) for p in e["loc"][:-1]] == parent]
        known = _NESTED[parent[0]].model_fields if parent else FILE_KEYS
        return ReplayConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; "
                                 f"known: {', '.join(known)}")
    # the key a user wrote, and its value: a list's element names the list
    value: Any = doc
    key: list[str] = []
    for p in first["loc"]:
        if isinstance(p, int) and isinstance(value, list):
            break
        key.append(str(p))
        value = value.get(p) if isinstance(value, dict) else None
    name = ".".join(key)
    kind = _KINDS.get(first["type"].split("_")[0])
    if name in _MAPS and len(key) == 1:
        return ReplayConfigError(f"{source}: {name} must {_MAPS[name]}, got {value!r}")
    elif len(key) < len(first["loc"]):
        what = f"a list of {kind or 'values'}, got {value!r}"
    elif first["type"] in ("tuple_type", "list_type"):
        what = f"a list, got {value!r}"
    elif first["type"] in ("model_type", "model_attributes_type", "dict_type"):
        what = f"a mapping, got {value!r}"
    elif first["type"].startswith("bool"):
        what = f"true or false, got {value!r}"
    elif first["type"] == "int_from_float":
        what = f"an integer, got {value!r}"
    elif kind is not None or first["type"] == "value_error":
        what = f"a {kind or _KINDS[_kind_of(key)]}, got {value!r}"
    else:
        return ReplayConfigError(f"{source}: {name}: {first['msg']}")
    return ReplayConfigError(f"{source}: {name} must be {what}")


def _kind_of(key: list[str]) -> str:
    """The scalar type of the field at ``key`` (``int`` or ``float``: a bool given for a
    number is a value error before pydantic sees the type)."""
    model: type[BaseModel] = _NESTED[key[0]] if len(key) > 1 else ReplayConfig
    ann = str(model.model_fields[key[-1]].annotation)
    return "float" if "float" in ann else "int"


def _from_dict(doc: dict[str, Any], source: str, base: ReplayConfig) -> ReplayConfig:
    """``doc`` (a file's keys or the command line's) over ``base``, validated."""
    unknown = sorted(set(doc) - set(FILE_KEYS))
    if unknown:
        raise ReplayConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; "
                                f"known: {', '.join(sorted(FILE_KEYS))}")
    merged: dict[str, Any] = {**dict(base), "source": source}
    for k, v in doc.items():
        if k in _NESTED:
            if v is None:
                continue
            if isinstance(v, dict):
                v = {**dict(merged[k]), **v}
        merged[k] = v
    try:
        return ReplayConfig.model_validate(merged)
    except ValidationError as exc:
        raise _error_line(exc, doc, source) from None


def default_config() -> ReplayConfig:
    """The shipped defaults (``configs/default.yaml``)."""
    return _from_dict(_read_yaml(DEFAULT_CONFIG), str(DEFAULT_CONFIG), ReplayConfig())


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
