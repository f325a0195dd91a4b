"""The deadline rules of a shard transfer, shared by both runtimes.

Deadlines, not waits (the rules of the native ``StreamFeed``, ``native/src/sakura/edit.cpp``,
with the same constants). Every configuration of a shard is a prefix of one byte stream, so
each request carries its **fallbacks**: the allocator's ``fallbacks(j)`` whose bodies are
the first units of the chosen one (``fallbacks(shard, config)``, e.g.
:func:`~edge.body_spec.prefix_fallbacks`), longest first. The client verifies units as they
arrive into the request's :class:`~edge.transfer.Transfer`, so the verified prefix is known
at any moment. A watchdog on the network loop (waking at least every ``WATCH_CAP_S``)
enforces:

* **the deadline**: once execution has waited for shard ``j`` (counted from the later of
  the moment it began waiting and ``progress.start_not_before``) longer than its grace,
  :func:`deadline_grace_s`, the shard runs on the longest verified fallback: the transfer is
  cancelled and the record says ``truncated``, ``config`` the fallback, ``requested`` the
  choice, ``bytes`` the fallback's. With none verified yet, a transfer without new bytes for
  ``max(grace, 3 x request latency, STALL_FLOOR_S)`` is re-requested (its remaining range)
  on a fresh connection, once per wait (``hedges``);
* **the stall watchdog**: any attempt without new bytes for :func:`stall_limit_s` is
  restarted the same way;
* **damage**: a unit that fails its checksum ends the body; the shard runs on the largest
  fallback verified before it (``damage`` names the unit), else the client refetches it.

How far ahead a shard may be requested (:func:`lookahead_wait`) and how long execution
waits before it computes a step itself (:func:`local_wait_s`, :mod:`edge.local_fallback`)
are rules of the same kind, used by both runtimes.
"""

from __future__ import annotations

GRACE_FRACTION = 0.5   # a waited-for shard runs on its verified prefix after this share of
MIN_GRACE_S = 0.001    # ... its predicted execution time (at least this long)
STALL_FLOOR_S = 0.05   # the shortest silence that restarts a transfer (a hedge)
WATCH_CAP_S = 0.05     # the watchdog looks at the transfers at least this often


def lookahead_wait(ahead: int, max_ahead: int, max_ahead_cap: int, until_start_s: float,
                   horizon_s: float) -> float | None:
    """When a shard ``ahead`` shards past the executing one may be requested: 0 (now) within
    ``max_ahead``; beyond it, up to ``max_ahead_cap``, once its predicted execution start is
    ``horizon_s`` away (``lookahead_rtts`` request latencies), so that with short shards
    and long round trips the requests still go out a few round trips before they are
    needed; None (when execution advances) otherwise. Both runtimes use this rule."""
    if ahead <= max_ahead:
        return 0.0
    if ahead > max_ahead_cap or horizon_s <= 0:
        return None
    return max(0.0, until_start_s - horizon_s)


def deadline_grace_s(predicted_exec_s: float) -> float:
    """How long execution waits for a shard with a verified fallback before running on it."""
    return max(MIN_GRACE_S, GRACE_FRACTION * predicted_exec_s)


def stall_limit_s(remaining_bytes: int, rate_bps: float, latency_s: float,
                  restarts: int) -> float:
    """The silence after which the watchdog restarts an attempt: ``max(STALL_FLOOR_S, 3
    request latencies, 2 x the remaining bytes at the rate estimate)``, doubled per restart in
    a row without new bytes (so an origin slower to answer than the limit is still waited
    for, never restarted forever)."""
    limit = max(STALL_FLOOR_S, 3.0 * latency_s)
    if rate_bps > 0:
        limit = max(limit, 2.0 * max(0, remaining_bytes) * 8.0 / rate_bps)
    return limit * 2.0 ** min(max(0, restarts), 10)


def local_wait_s(measured_step_s: float | None, exec_s: list[float], steps: int,
                 tokens: int, masked: int) -> float:
    """The local fallback's wait bound, one local step: ``measured_step_s`` (a timed
    ``local`` edit over its steps, as the runners take it once per layout) or, without one,
    the cached step's time (``exec_s`` summed over the edit, per step) times the image tokens
    a full step computes over the masked ones (that estimate errs long: on the demo's
    template 0.20 s cached and 0.59 s local over 20 steps, 20% masked: 10 ms x 5 = 50 ms
    against 30 ms measured); never below the stall floor (a shard under 50 ms late is not a
    stall). Both runtimes use this rule."""
    cached_step = sum(exec_s) / max(1, steps)
    estimate = (measured_step_s if measured_step_s is not None
                else cached_step * tokens / max(1, masked))
    return max(STALL_FLOOR_S, estimate)
