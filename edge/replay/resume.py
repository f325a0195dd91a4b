"""The replay folder's meta file (``replay.json``): what the results were made with, and
the refusal to resume into a folder whose results were made with other weights or other
settings that decide a run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from sakura.edge.replay.config import ReplayConfig, ReplayConfigError
from sakura.edge.replay.results import META_FILE

from sakura.atomic import write_atomic


def check_meta(out: Path, cfg: ReplayConfig, weights_sha: str) -> None:
    meta_path = out / META_FILE
    meta = {"config": cfg.to_dict(), "weights_sha256": weights_sha,
            "host": {"cpus": os.cpu_count(), "load1_at_start": os.getloadavg()[0]},
            "timed_runs": "sequential, one at a time", "started": time.time()}
    if meta_path.exists():
        try:
            old = json.loads(meta_path.read_text())
        except ValueError:
            old = {}
        if old.get("weights_sha256") not in (None, weights_sha):
            raise ReplayConfigError(
                f"{out} holds results made with other model weights "
                f"({str(old.get('weights_sha256'))[:12]}); use another --out")
        old_cfg = old.get("config", {})
        # results from before the startup allowance existed were made without one
        # ... and on the Python runtime, before the native one existed
        old_cfg = {"startup_fraction": 0.0, "runtime": "python", **old_cfg} if old_cfg else old_cfg
        for k in ("regime_x", "regime_network", "edit_seed", "prompt", "seed", "span_s",
                  "startup_fraction", "runtime", "rtt_ms", "rtt_scale", "rto_min", "loss"):
            if k in old_cfg and old_cfg[k] != meta["config"][k]:
                raise ReplayConfigError(
                    f"{out} holds results made with {k} = {old_cfg[k]!r}, this config has "
                    f"{meta['config'][k]!r}: resuming would mix them; use another --out")
        meta["resumed"] = old.get("resumed", 0) + 1
        meta["started_first"] = old.get("started_first", old.get("started"))
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(meta_path, json.dumps(meta, indent=1))
