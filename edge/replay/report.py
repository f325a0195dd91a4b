"""``sakura report``: a self-contained Markdown report (PNG figures) and headline ratios.

Everything is computed from ``runs.jsonl`` of one replay (one machine, one run), per
regime mode present. "Main" runs are the workload templates at their catalog resolution
with their own packs; the q ablation (``sakura-q*``) and the second-resolution variants
(``<id>-<res>``) are reported in their own sections only.

The parts, one module each: the numbers of a group of runs (percentiles with bootstrap
intervals, PSNR means: ``stats.py``), the headline ratios and the iso-quality /
iso-latency views (``headline.py``), the same per network family with intervals over start
points (``by_network.py``: the JSON's ``networks``), the figures (``figures.py``) and the Markdown
(``sections.py``). This module loads a results folder and writes the report and the
headline JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sakura.edge.errors import EdgeError
from sakura.edge.replay.by_network import by_network
from sakura.edge.replay.headline import headline
from sakura.edge.replay.results import META_FILE, ResultsFile
from sakura.edge.replay.sections import intro, mode_section

from sakura.atomic import write_atomic
from sakura.output import json_safe


def load(dir_: str | Path) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]],
                                    dict[str, Any]]:
    d = Path(dir_)
    if not d.is_dir():
        raise EdgeError(f"{d} is not a replay results folder")
    results = ResultsFile(d)
    if not results.path.exists():
        raise EdgeError(f"{d} has no {results.path.name}: run `sakura replay ... --out {d}`")
    meta = {}
    if (d / META_FILE).exists():
        try:
            meta = json.loads((d / META_FILE).read_text())
        except ValueError:
            meta = {}
    runs = results.runs()
    if not runs:
        raise EdgeError(f"{results.path} holds no finished runs yet")
    return runs, results.templates(), meta


def headlines(runs: list[dict[str, Any]], tmpl: dict[str, dict[str, Any]],
              meta: dict[str, Any]) -> dict[str, Any]:
    """Headline of every mode present; the top level is ``matched`` when present."""
    nets = tuple(meta.get("config", {}).get("headline_networks") or ("5g",))
    modes = sorted({r["mode"] for r in runs}, key=lambda m: (m != "matched", m))
    out: dict[str, Any] = {}
    for mode in modes:
        mr = [r for r in runs if r["mode"] == mode]
        mt = {k: v for k, v in tmpl.items() if v["mode"] == mode}
        h = headline(mr, mt, nets)
        h["networks"] = by_network(mr, mt, _trace_root(meta))
        h["mode"] = mode
        h["runs"] = len(mr)
        h["regime"] = ({"mode": "regime-matched",
                        "regime_x": meta.get("config", {}).get("regime_x"),
                        "regime_network": meta.get("config", {}).get("regime_network"),
                        "factors": {v["template"]: v["factor"] for v in mt.values()}}
                       if mode == "matched" else
                       {"mode": "device profile (modelled time)",
                        "profile": meta.get("config", {}).get("profile")})
        out[mode] = h
    top = dict(out[modes[0]])
    top["modes"] = out
    top["models"] = replay_models(meta)
    return top


def replay_models(meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``models`` key: each model the replay ran, by name, as ``dit.weights.model_card``
    describes it (class, parameters, train step, prompt accuracy and chance level from its
    card). The replay records its weights file and that file's sha256; when the file is no
    longer there, or has changed since, the entry says so and carries the sha256 only."""
    from sakura.dit.weights import DEFAULT_WEIGHTS, WeightsError, model_card  # lazy: torch

    config = meta.get("config", {})
    want = meta.get("weights_sha256")
    if config.get("model"):  # an adapter model: identified by its checkpoint fingerprint
        return {config["model"]: _adapter_card(config["model"], config.get("model_path"), want)}
    weights = config.get("weights") or DEFAULT_WEIGHTS
    try:
        card = model_card(weights)
    except WeightsError as exc:
        return {Path(weights).stem: {"weights_file_sha256": want, "source": str(exc)}}
    if want and card["weights_file_sha256"] != want:
        return {card["name"]: {"weights_file_sha256": want,
                               "source": f"the replay ran other weights than {weights} "
                                         "holds now"}}
    return {card["name"]: card}


def _adapter_card(name: str, path: str | None, want: str | None) -> dict[str, Any]:
    """The ``models`` entry of an adapter model: its folder's card where it has one (the
    second model, ``sakura-flux2``), while the folder still has the fingerprint the replay
    ran; else what is known and why."""
    from sakura.dit.adapters.engine import checkpoint_fingerprint  # lazy: torch
    from sakura.dit.adapters.registry import MODELS  # lazy: torch
    from sakura.dit.weights import WeightsError, model_card  # lazy: torch

    spec = MODELS.get(name)
    folder = path or (spec.default_path if spec else None)
    base = {"weights_fingerprint": want}
    if folder is None or not Path(folder).is_dir():
        return {**base, "source": f"the checkpoint folder of {name} is not here"}
    if want and checkpoint_fingerprint(folder) != want:
        return {**base, "source": f"the replay ran another checkpoint than {folder} holds now"}
    try:
        return {**model_card(folder), **base}
    except WeightsError as exc:
        return {**base, "source": str(exc)}


def write_report(dir_: str | Path, json_path: str | Path | None = None,
                 out_dir: str | Path | None = None) -> Path:
    """Write ``report.md`` and ``figures/`` (and the headline JSON); returns the report."""
    runs, tmpl, meta = load(dir_)
    out = Path(out_dir) if out_dir else Path(dir_)
    figs = out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    heads = {**headlines(runs, tmpl, meta), "failed_runs": failed_runs(Path(dir_))}
    folders = model_replays(Path(dir_), meta)
    subs = [(name, *load(d)) for name, d in folders]
    sub_heads = [(name, {**headlines(r, t, m), "failed_runs": failed_runs(d)})
                 for (name, r, t, m), (_, d) in zip(subs, folders)]
    heads = with_models(heads, sub_heads)
    md = ["# SAKURA replay report\n", intro(Path(dir_).name, runs, meta),
          _failures_text(heads["failed_runs"])]
    if sub_heads:
        md.append(_models_text(heads, meta))
    md += _sections(runs, tmpl, meta, heads, figs, "figures")
    for (name, r, t, m), (_, head) in zip(subs, sub_heads):
        md += [f"# Model {name}\n", intro(f"{Path(dir_).name}/{name}", r, m),
               _failures_text(head["failed_runs"])]
        md += _sections(r, t, m, head, figs / name, f"figures/{name}")
    path = out / "report.md"
    path.write_text("\n".join(md) + "\n")
    if json_path:
        jp = Path(json_path)
        write_atomic(jp, json.dumps(json_safe(heads), indent=1, allow_nan=False))
    return path


def failed_runs(dir_: Path) -> dict[str, Any]:
    """The runs of ``dir_`` that failed and were not taken again since (``failure``
    records): none of them is in any statistic of the report."""
    fails = ResultsFile(dir_).failures()
    by: dict[str, int] = {}
    for f in fails:
        by[f["policy"]] = by.get(f["policy"], 0) + 1
    return {"count": len(fails), "by_policy": by,
            "runs": [{"run": f["run_key"], "error": f["error"]} for f in fails]}


def _failures_text(failed: dict[str, Any]) -> str:
    if not failed["count"]:
        return "No run failed.\n"
    return (f"**{failed['count']} run(s) failed** and are in no statistic below (a rerun of the "
            "replay retries them): " + "; ".join(f"`{f['run']}`: {f['error']}"
                                                  for f in failed["runs"]) + "\n")


def _sections(runs: list[dict[str, Any]], tmpl: dict[str, dict[str, Any]],
              meta: dict[str, Any], heads: dict[str, Any], figs: Path, rel: str) -> list[str]:
    figs.mkdir(parents=True, exist_ok=True)
    md: list[str] = []
    for mode, head in heads["modes"].items():
        mr = [r for r in runs if r["mode"] == mode]
        mt = {k: v for k, v in tmpl.items() if v["mode"] == mode}
        md += mode_section(mode, mr, mt, meta, figs, rel, head)
    return md


def model_replays(dir_: Path, meta: dict[str, Any]) -> list[tuple[str, Path]]:
    """The replays of the configuration's ``models`` (``ReplayConfig.models``: the same
    runs of another model, in ``DIR/<name>``) that have finished runs."""
    names = meta.get("config", {}).get("models") or ()
    return [(n, dir_ / n) for n in names if ResultsFile(dir_ / n).runs()]


def with_models(top: dict[str, Any], subs: list[tuple[str, dict[str, Any]]]
                ) -> dict[str, Any]:
    """The headline with the other models' replays: ``models`` holds every model's card,
    ``per_model`` every model's headline (its own ``networks``, ratios, intervals and
    conditions; the top level stays the first model's, the shipped one). Without other
    models the headline is unchanged."""
    if not subs:
        return top

    def own(h: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in h.items() if k not in ("modes", "models", "per_model")}

    (first,) = top["models"]  # a replay folder runs one model (replay_models)
    models, per_model = dict(top["models"]), {first: own(top)}
    for name, h in subs:
        models.update(h["models"])
        per_model[name] = own(h)
    return {**top, "models": models, "per_model": per_model}


def _models_text(heads: dict[str, Any], meta: dict[str, Any]) -> str:
    """The report's paragraph on its models: which ran where, and their cards."""
    runtime = meta.get("config", {}).get("runtime", "?")
    parts = []
    for i, (name, card) in enumerate(heads["models"].items()):
        where = (f"this folder, {runtime} runtime" if i == 0 else
                 f"`{name}/`, section *Model {name}* below")
        cls = str(card.get("class", "?")).rsplit(".", 1)[-1]
        params = card.get("params")
        acc, chance = card.get("prompt_accuracy"), card.get("chance_level")
        parts.append(f"`{name}` ({cls}, "
                     + (f"{params / 1e6:.2f}M parameters" if params else "parameters ?")
                     + (f", prompt accuracy {acc:.1%} at chance {chance:.1%}"
                        if acc is not None and chance else "")
                     + f"; {where})")
    return ("Models: " + "; ".join(parts) + ". Each model's ratios compare its own "
            "policies on its own runtime; the JSON's `per_model` holds each headline.\n")


def _trace_root(meta: dict[str, Any]) -> str | None:
    """The replay's recorded trace folder when it is here, else the default one."""
    root = meta.get("config", {}).get("trace_dir")
    return root if root and Path(root).is_dir() else None
