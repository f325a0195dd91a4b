"""Stopping ``sakura replay`` while it builds its packs in parallel (``build_workers: 2``):
SIGTERM ends the builds at once, not after them. Before, the pool's ``with`` block waited
for every queued build (minutes each at the shipped size) and the exit then printed a
leaked-semaphore warning. Nothing here is timed: the stop is sent while the two build
workers are still starting, so a build that finished anyway would show as a published
catalog.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.edge.helpers import alive, children_of


def _build_workers(pid: int) -> set[int]:
    workers = set()
    for k in children_of(pid):
        try:
            cmd = Path(f"/proc/{k}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing" in cmd and b"spawn" in cmd and b"resource_tracker" not in cmd:
            workers.add(k)
    return workers


def test_sigterm_during_parallel_pack_builds_stops_them(tiny_catalog, tmp_path):
    root, tid = tiny_catalog
    packs = tmp_path / "packs"
    cfg = tmp_path / "build.yaml"
    cfg.write_text(  # two build jobs: the main packs and the q = 1 ablation's
        f"workloads: {{face-swap: [{tid}]}}\nnetworks: [5g]\npolicies: [sakura]\n"
        "starts: 1\ndeadlines: []\nmax_load: 0\nbuild_workers: 2\n"
        "ablation: {q: [1.0], resolutions: [], resolution_templates: []}\n"
        f"weights: {root / 'model.safetensors'}\ncatalog: {root / 'catalog.json'}\n"
        f"packs_dir: {packs}\n")
    proc = subprocess.Popen([sys.executable, "-m", "sakura.cli", "replay", str(cfg),
                             "--out", str(tmp_path / "out"), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        workers: set[int] = set()
        while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
            workers = _build_workers(proc.pid)
        assert len(workers) == 2, "the replay did not start its two build workers"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.decode()
    assert proc.returncode == 143, text[-2000:]
    assert text.strip().splitlines()[-1] == "sakura: terminated", text[-2000:]
    assert "leaked" not in text and "Traceback" not in text, text[-2000:]
    # the builds were cut, not waited for: no packs folder was published
    assert not any(packs.glob("*/catalog.json"))
    time.sleep(1.0)
    assert [w for w in workers if alive(w)] == []
