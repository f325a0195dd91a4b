"""``sakura bench serve --restart-at``: the product's client rides through one restart of
``sakura serve`` (issue 29 item 7), on a small pack and a short run."""

from __future__ import annotations

import json

import pytest
from sakura.cloud.bench import BenchConfig, run_ride_through

from sakura.cli import build_parser
from sakura.errors import UsageError
from sakura.serve_ride import EdgeRideClient, make_client

SMALL = dict(shards=4, configs=3, unit_bytes=4096)


def test_the_product_client_rides_through_a_restart():
    config = BenchConfig(clients=6, duration_s=4.0, restart_at_s=1.0, **SMALL)
    result = run_ride_through(config, make_client)
    assert result["errors_after_ride_through"] == 0, result["first_error"]
    assert result["wrong_bytes"] == 0 and result["wrong_bodies"] == 0
    assert result["requests"] > 0 and result["p99_ms"] > 0
    assert result["restart"]["at_s"] >= 1.0 and result["restart"]["down_s"] > 0
    assert result["client_retries"] >= 0 and result["clients"] == 6


class Corrupting(EdgeRideClient):
    """The product's client with one byte of each body flipped after it verified it."""

    async def fetch(self, shard: int, config: int) -> bytes:
        body = bytearray(await super().fetch(shard, config))
        body[0] ^= 1
        return bytes(body)


def test_wrong_bytes_are_counted():
    config = BenchConfig(clients=2, duration_s=1.5, restart_at_s=0.5, **SMALL)
    result = run_ride_through(config, Corrupting)
    assert result["wrong_bodies"] == result["requests"] > 0
    assert result["wrong_bytes"] > 0


def test_the_command_wires_the_product_client(tmp_path, monkeypatch):
    import sakura.cloud.bench as cloud_bench

    seen = {}

    def fake(config, make):
        seen["config"], seen["client"] = config, make("http://127.0.0.1:1", "t", "sakura")
        return {"clients": 3, "requests_per_s": 1.0, "p99_ms": 1.0, "max_ms": 1.0,
                "restart": {"at_s": 1.0, "down_s": 0.5}, "errors_after_ride_through": 0,
                "wrong_bytes": 0, "first_error": ""}

    monkeypatch.setattr(cloud_bench, "run_ride_through", fake)
    out = tmp_path / "ride.json"
    args = build_parser().parse_args(["bench", "serve", "--json", str(out), "--clients", "3",
                                      "--duration", "4", "--restart-at", "2"])
    assert args.func(args) == 0
    assert seen["config"].restart_at_s == 2.0 and seen["config"].clients == 3
    assert isinstance(seen["client"], EdgeRideClient)
    assert json.loads(out.read_text())["errors_after_ride_through"] == 0
    args = build_parser().parse_args(["bench", "serve", "--json", str(out), "--duration", "4",
                                      "--restart-at", "4"])
    with pytest.raises(UsageError, match="must be less than the duration"):
        args.func(args)
