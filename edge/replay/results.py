"""Append-only results of a replay: one JSON line per finished run, keyed for resume.

``<out>/runs.jsonl`` holds one record per timed run (``kind: "run"``) and one per
template setup (``kind: "template"``: the measured floor ``T``, the regime factor, the
storage per codec), each written with one ``write`` + flush + fsync after the run
finished. A run killed half-way therefore loses only itself; a torn last line (killed
during the write) is ignored on reading and overwritten by the next append. The run key
names everything that decides a run: regime mode, template, network, trace, start point,
policy (with its pack variant); a resumed replay skips every key already present.

A run that failed (e.g. a transfer that exhausted its retries) leaves a ``kind: "failure"``
record (:func:`failure_record`: its run key, the error, the load average) under a key of its
own, so a resume still retries the run, and the report names every run that has failed and
not been taken since (:meth:`ResultsFile.failures`): its statistics do not silently lose it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS_FILE = "runs.jsonl"
META_FILE = "replay.json"


@dataclass(frozen=True)
class RunKey:
    mode: str          # matched | profile
    template: str
    network: str
    trace: str
    start_s: float
    start_index: int
    policy: str        # a policy name, or sakura-q<q> for the q ablation

    def __str__(self) -> str:
        return (f"{self.mode}|{self.template}|{self.network}|{self.trace}@{self.start_s:.3f}"
                f"#{self.start_index}|{self.policy}")


def template_key(mode: str, template: str) -> str:
    return f"{mode}|{template}|template"


def failure_record(key: RunKey, error: str, load1: float, when: float) -> dict[str, Any]:
    """The record of a failed run (its key is not the run's: a resume retries the run)."""
    return {"kind": "failure", "key": f"failure|{key}", "run_key": str(key),
            "mode": key.mode, "template": key.template, "network": key.network,
            "trace": key.trace, "start_s": key.start_s, "policy": key.policy,
            "error": error, "load1": load1, "time": when}


def finite(x: float | None) -> float | str | None:
    """JSON-safe number (``inf`` -> ``"inf"``)."""
    if x is None:
        return None
    return "inf" if math.isinf(x) else float(x)


def number(x: Any) -> float | None:
    """Back from :func:`finite`."""
    if x is None:
        return None
    return math.inf if x == "inf" else float(x)


class ResultsFile:
    """The append-only JSONL file of one replay directory."""

    def __init__(self, out_dir: str | Path) -> None:
        self.dir = Path(out_dir)
        self.path = self.dir / RESULTS_FILE

    def records(self) -> Iterator[dict[str, Any]]:
        """Every complete record, in file order (a torn or foreign line is skipped)."""
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    return  # torn tail of a killed write
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(rec, dict) and "key" in rec:
                    yield rec

    def latest(self) -> dict[str, dict[str, Any]]:
        """The last record of each key: a retaken run (``edge.replay.runner``) replaces the
        one before it."""
        return {str(r["key"]): r for r in self.records()}

    def done(self, max_load: float = 0.0) -> set[str]:
        """The keys to skip on resume: with ``max_load`` > 0, not a run whose latest record
        was taken above that load average (it is taken again)."""
        return {k for k, r in self.latest().items()
                if not (max_load > 0 and r.get("kind") == "run"
                        and float(r.get("load1") or 0.0) > max_load)}

    def append(self, record: dict[str, Any]) -> None:
        """Write one record durably; a torn tail left by a killed writer is cut first."""
        self.dir.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()
        with open(self.path, "ab+") as f:
            size = f.seek(0, os.SEEK_END)
            if size:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    f.seek(0)
                    data = f.read()
                    f.truncate(data.rfind(b"\n") + 1)
            f.seek(0, os.SEEK_END)
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def runs(self) -> list[dict[str, Any]]:
        return [r for r in self.latest().values() if r.get("kind") == "run"]

    def templates(self) -> dict[str, dict[str, Any]]:
        return {k: r for k, r in self.latest().items() if r.get("kind") == "template"}

    def failures(self) -> list[dict[str, Any]]:
        """The last failure record of each run that has no run record after it (failed,
        and not taken again since), in file order."""
        last: dict[str, tuple[int, dict[str, Any]]] = {}
        ran: dict[str, int] = {}
        for i, r in enumerate(self.records()):
            if r.get("kind") == "failure":
                last[str(r.get("run_key"))] = (i, r)
            elif r.get("kind") == "run":
                ran[str(r["key"])] = i
        return [r for k, (i, r) in sorted(last.items(), key=lambda kv: kv[1][0])
                if ran.get(k, -1) < i]


def compact_timeline(timeline: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-shard stage times rounded to 0.1 ms (columns + rows, small in JSONL)."""
    cols = ["shard", "bytes", "recv_start", "recv_end", "recon_start", "recon_end",
            "exec_start", "exec_end", "stall_s"]
    rows = []
    for r in timeline:
        rows.append([r.get(c) if c in ("shard", "bytes") or r.get(c) is None
                     else round(float(r[c]), 4) for c in cols])
    return {"columns": cols, "rows": rows}


def expand_timeline(compact: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not compact:
        return []
    cols = compact["columns"]
    return [dict(zip(cols, row)) for row in compact["rows"]]
