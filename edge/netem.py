"""Putting an emulated link (a trace or a fixed rate) between the edge and a server.

:func:`shaped` starts a :class:`traces.linkproc.PacedLinkProcess` (a TCP proxy on 127.0.0.1
in a child process, whose server -> client direction follows the trace, with a propagation
delay each way and optional loss) in front of ``server_url`` and yields the URL to use
instead, plus the link (to restart the trace between runs, read its counters, delivery log
and :meth:`~traces.linkproc.PacedLinkProcess.conditions`). The link never runs in the
device's process; ``cpus`` pins it (see :func:`traces.linkproc.split_cpus`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sakura.edge.errors import EdgeError
from sakura.edge.replay.profile import DeviceProfile
from sakura.traces import Trace, load_trace
from sakura.traces.impair import DEFAULT_RTT_MS, Impairment
from sakura.traces.linkproc import PacedLinkProcess


def upstream_of(server_url: str) -> tuple[str, int]:
    parts = urlsplit(server_url)
    if parts.scheme != "http" or not parts.hostname:
        raise EdgeError(f"an emulated link needs a plain http:// server URL, got {server_url!r}")
    return parts.hostname, parts.port or 80


@contextlib.contextmanager
def shaped(server_url: str, trace: Trace, start_s: float = 0.0, *,
           rtt_ms: float = DEFAULT_RTT_MS, loss: float = 0.0, cpus: set[int] | None = None,
           ) -> Iterator[tuple[str, PacedLinkProcess]]:
    """``with shaped(url, trace, start, rtt_ms=30, loss=0, cpus={1}) as (link_url, link):``.

    ``rtt_ms``: propagation round trip (half each way); ``loss``: packet loss rate;
    ``cpus``: CPUs the link process is pinned to (None: not pinned)."""
    host, port = upstream_of(server_url)
    imp = Impairment(rtt_ms=float(rtt_ms), loss=float(loss))
    with PacedLinkProcess(trace, upstream=(host, port), start_s=start_s, impairment=imp,
                          cpus=cpus) as link:
        path = urlsplit(server_url).path.rstrip("/")
        yield f"http://127.0.0.1:{link.port}{path}", link


def matched_rtt_ms(rtt_ms: float, masked_exec_s: float, token_mask_ratio: float,
                   profile: Any = None) -> float:
    """The round trip a regime-matched link carries: ``rtt_ms x T / T_phone``.

    Regime matching scales the trace so that the FP16 cache takes ``regime_x`` times this
    host's masked execution ``T`` at the median, as it takes on the phone: time is scaled,
    not only rates. A network round trip is scaled the same way, by ``T`` over the phone's
    masked execution at the template's token mask ratio (``profile``: an
    ``edge.replay.config.ProfileSpec``, default the paper's phone), so that a 30 ms 5G
    round trip weighs against this host's ~10 ms shards what it weighs against the
    phone's ~100 ms ones. Unscaled, every shard request would cost three shard times."""
    from sakura.edge.replay.config import ProfileSpec  # lazy: pydantic

    spec = profile if profile is not None else ProfileSpec()
    phone = DeviceProfile(**dict(vars(spec))).masked_total_s(float(token_mask_ratio))
    return float(rtt_ms) * float(masked_exec_s) / phone if phone > 0 else float(rtt_ms)


def trace_from_args(trace_path: str | None, rate_mbps: float | None, scale: float = 1.0
                    ) -> Trace | None:
    """The link of ``--trace PATH`` or ``--rate MBPS`` (None: no emulation)."""
    if trace_path and rate_mbps is not None:
        raise EdgeError("give either --trace or --rate, not both")
    if rate_mbps is not None:
        if not rate_mbps > 0:
            raise EdgeError(f"--rate must be > 0 Mbit/s, got {rate_mbps}")
        return Trace.constant(rate_mbps * 1e6 * scale, 1.0)
    if trace_path:
        if not Path(trace_path).exists():
            raise EdgeError(f"trace file {trace_path} does not exist")
        trace = load_trace(trace_path)
        return trace.scaled(scale) if scale != 1.0 else trace
    return None
