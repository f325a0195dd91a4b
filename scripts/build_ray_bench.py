"""The ``build_ray`` key of ``sakura bench flashdiff`` alone (``cloud.render_bench.
build_ray_bench``: ``sakura build --ray`` on a local Ray of 1 then 2 CPUs against a local
build), written into docs/bench/build-ray.json (or PATH).

    nice -n 15 .venv/bin/python scripts/build_ray_bench.py [PATH]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sakura.cloud.render_bench import build_ray_bench


def main(argv: list[str]) -> int:
    path = Path(argv[0] if argv else "docs/bench/build-ray.json")
    result = {"build_ray": build_ray_bench()}
    text = json.dumps(result, indent=2)
    print(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
