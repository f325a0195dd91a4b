"""`sakura bench faults`: integrity and fault tolerance on loopback, case by case.

Each case injects one fault into the real server, client or command and checks a promise
(``cloud/README.md``). The cases, one module per kind:

- ``sakura/faults_serving.py``: the server and the edge client on loopback (damaged,
  truncated and repaired packs, hostile methods, a restart mid-edit, killed builds, a bad
  catalog, HEAD, slow headers, Range limits, reproducible builds, client error messages);
- ``sakura/faults_front_door.py``: bad inputs refused by the command before anything loads;
- ``sakura/faults_native.py``: the native runtime on the shipped model;

on the harness of ``sakura/faults_harness.py``. This module is the command: the case table,
a run of every case (each in its own temporary folder) and the report.

``cases`` maps each name to ``{"ok", "detail"}``; ``wrong_bytes_accepted`` counts bodies the
client returned that differ from the published bytes; ``crashes`` counts servers that
stopped answering. Every case is also a test (``tests/cloud/test_faults.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sakura.argtypes import json_out
from sakura.errors import UsageError
from sakura.faults_front_door import case_bomb_image, case_empty_prompt, case_seed_out_of_range
from sakura.faults_harness import CaseFailed, Tally
from sakura.faults_native import (
    case_native_python_same_errors,
    case_native_truncated_total_checked,
    shared_work,
)
from sakura.faults_serving import (
    case_corrupt_pack_served,
    case_damaged_pack_reported_not_unreachable,
    case_head_routes,
    case_healthz_bad_catalog,
    case_healthz_truncated_pack,
    case_killed_build_cleanup,
    case_metrics_cardinality,
    case_range_over_response_limit_verified,
    case_repair_after_corruption,
    case_reproducible_build,
    case_restart_mid_edit,
    case_serve_refuses_bad_catalog,
    case_slow_headers,
    case_truncated_pack_message,
    case_unreachable_origin_progress,
)
from sakura.output import write_json


def register(commands: Any, bench: Any) -> None:
    b = bench.add_parser(
        "faults", help="integrity and fault tolerance of serving, case by case (loopback)",
        description="Corrupted and repaired packs, hostile methods, a server restart mid-edit, "
                    "truncated packs, killed builds, a bad catalog, HEAD, slow headers, "
                    "reproducible builds: each case checked, a JSON report.")
    json_out(b, help="write the result here (- for stdout)")
    b.add_argument("--cases", metavar="LIST", help="comma-separated case names (default all)")
    b.set_defaults(func=_main)


# a case returns its detail, or (detail, seconds to the error) where the case's own
# duration (a build, servers starting) is not the time the user waits for the error
CASES: dict[str, Callable[[Path, Tally], str | tuple[str, float]]] = {
    "repair_after_corruption": case_repair_after_corruption,
    "corrupt_pack_served": case_corrupt_pack_served,
    "metrics_cardinality": case_metrics_cardinality,
    "restart_mid_edit": case_restart_mid_edit,
    "truncated_pack_message": case_truncated_pack_message,
    "killed_build_cleanup": case_killed_build_cleanup,
    "healthz_bad_catalog": case_healthz_bad_catalog,
    "head_routes": case_head_routes,
    "slow_headers": case_slow_headers,
    "range_over_response_limit_verified": case_range_over_response_limit_verified,
    "healthz_truncated_pack": case_healthz_truncated_pack,
    "serve_refuses_bad_catalog": case_serve_refuses_bad_catalog,
    "reproducible_build": case_reproducible_build,
    "seed_out_of_range": case_seed_out_of_range,
    "bomb_image": case_bomb_image,
    "empty_prompt": case_empty_prompt,
    "damaged_pack_reported_not_unreachable": case_damaged_pack_reported_not_unreachable,
    "unreachable_origin_progress": case_unreachable_origin_progress,
    "native_truncated_total_checked": case_native_truncated_total_checked,
    "native_python_same_errors": case_native_python_same_errors,
}



def run_case(name: str, tally: Tally) -> dict[str, Any]:
    """One case in its own temporary folder: ``{"ok", "detail", "seconds"}`` (the case's
    duration), and ``seconds_to_error`` where the case measures it."""
    t0 = time.perf_counter()
    to_error = None
    with tempfile.TemporaryDirectory(prefix=f"sakura-faults-{name}-") as tmp:
        try:
            detail, ok = CASES[name](Path(tmp), tally), True
            if isinstance(detail, tuple):
                detail, to_error = detail
        except CaseFailed as exc:
            detail, ok = str(exc), False
        except Exception as exc:  # noqa: BLE001 - a case that breaks is a failed case
            detail, ok = f"{type(exc).__name__}: {exc}"[:500], False
    out = {"ok": ok, "detail": detail, "seconds": round(time.perf_counter() - t0, 2)}
    if to_error is not None:
        out["seconds_to_error"] = round(to_error, 3)
    return out


def run(names: list[str] | None = None) -> dict[str, Any]:
    import logging

    tally = Tally()
    t0 = time.perf_counter()
    load = [round(x, 2) for x in os.getloadavg()]
    server_log = logging.getLogger("sakura.cloud.server")
    level = server_log.level
    server_log.setLevel(logging.CRITICAL)  # the faults are injected: their errors are expected
    try:  # one shared work folder: the native cases' real catalog is built once per run
        with tempfile.TemporaryDirectory(prefix="sakura-faults-shared-") as shared, \
                shared_work(Path(shared)):
            cases = {name: run_case(name, tally) for name in (names or list(CASES))}
    finally:
        server_log.setLevel(level)
    return {
        "bench": "faults",
        "cases": cases,
        "ok": all(c["ok"] for c in cases.values()),
        "wrong_bytes_accepted": tally.wrong_bytes_accepted,
        "crashes": tally.crashes,
        "seconds": round(time.perf_counter() - t0, 1),
        "load_avg": {"start": load, "end": [round(x, 2) for x in os.getloadavg()]},
    }


def _main(args: argparse.Namespace) -> int:
    names = None
    if args.cases:
        names = [n.strip() for n in args.cases.split(",") if n.strip()]
        unknown = [n for n in names if n not in CASES]
        if unknown:
            raise UsageError(f"--cases: unknown {', '.join(unknown)}; known: "
                             f"{', '.join(CASES)}")
    result = run(names)
    write_json(args.json, result)
    failed = [n for n, c in result["cases"].items() if not c["ok"]]
    if failed or result["wrong_bytes_accepted"] or result["crashes"]:
        print(f"sakura bench faults: failed: {', '.join(failed) or 'totals'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run(sys.argv[1:] or None), indent=1))
