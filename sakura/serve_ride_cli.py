"""Gives ``sakura bench serve --restart-at`` the product's client (``sakura/serve_ride.py``).

``cloud/cli.py`` owns the command and its options; ``cloud`` does not import ``edge``, so
the app layer sets the client factory as a parser default. Light: nothing is imported
until the bench runs.
"""

from __future__ import annotations

from typing import Any


def _edge_client(base_url: str, template: str, codec: str) -> Any:
    from sakura.serve_ride import make_client  # lazy: aiohttp

    return make_client(base_url, template, codec)


def register(commands: Any, bench: Any) -> None:
    serve = bench.choices.get("serve")
    if serve is not None:
        serve.set_defaults(ride_client=_edge_client)
