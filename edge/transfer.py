"""One body on its way in: units verified as they arrive, fallbacks, restarts.

Units are verified as they arrive (as the native receiver's ``advance_verify`` does), into a
:class:`Transfer` the caller may pass and watch while the body streams in: it holds the
buffer, the verified prefix (whole units only) and the ``fallbacks`` of the body, the
configurations of the same shard whose bytes are its first units (same range start, shorter,
units a prefix: :func:`~edge.body_spec.prefix_fallbacks`; every configuration of a shard is
a prefix of one byte stream). The rules of that deadline-true receive (the client's range
fetch, ``edge/client.py``, applies them):

* a unit that fails its checksum stops the body at once; when a fallback verified before
  it, the fetch returns that configuration's bytes (``Fetched.config``) with ``damage``
  naming the unit and its pack offsets (``"unit U of shard J (pack bytes A..B) fails its
  checksum"``); with none, the body is fetched again from scratch, at most
  ``RetryPolicy.max_refetch`` times, then :class:`IntegrityError` says that not even the
  smallest configuration verifies, and why;
* :meth:`Transfer.restart` (the reader's stall watchdog or deadline) ends the attempt in
  flight and re-requests the remaining range at once on a fresh connection (``Range`` +
  ``If-Range``; counted in ``hedges``, not as a failure);
* :meth:`Transfer.prefix` is the longest verified fallback, which the reader may run on
  (truncation at a deadline) after cancelling the fetch.

:class:`Fetched` is what a fetch returns: the verified body (or a fallback's first bytes)
and how getting it went.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from sakura.edge.body_spec import BodySpec


@dataclass
class Fetched:
    """A verified body and how getting it went (monotonic clock times)."""

    data: bytes
    start: float
    first_byte: float
    end: float
    attempts: int = 1
    resumes: int = 0
    refetches: int = 0
    config: int | None = None    # the configuration ``data`` is (None: the one requested)
    hedges: int = 0              # re-requests on a fresh connection
    damage: str | None = None    # the unit that failed its checksum (``config``: before it)


class Transfer:
    """One body on its way in, shared by the client that fills and verifies it and the
    reader that watches it (the pipeline's deadline and stall watchdog); one event loop.

    ``fallbacks``: ``(config, bytes)`` of the configurations whose bodies are this one's
    first units, longest first (:func:`prefix_fallbacks`). ``buf`` holds what arrived,
    ``verified`` how many of its bytes are whole units that passed their checksums;
    ``damage`` names the first unit that failed. Times are ``time.monotonic()``.
    """

    def __init__(self, fallbacks: list[tuple[int, int]] | tuple[tuple[int, int], ...] = ()
                 ) -> None:
        self.fallbacks = tuple((int(c), int(n)) for c, n in fallbacks)
        self.buf = bytearray()
        self.nbytes = 0
        self.units: tuple[tuple[int, str], ...] = ()
        self.base = 0               # the body's offset in the pack (for damage messages)
        self.shard: int | None = None
        self.verified = 0           # bytes of the verified units (a prefix of buf)
        self.verified_units = 0
        self.damage: str | None = None
        self.start = self.last_progress = time.monotonic()
        self.first_byte: float | None = None
        self.attempt_start: float | None = None  # None: no attempt in flight (a backoff)
        self.attempts = self.resumes = self.refetches = self.hedges = 0
        self.stalled_restarts = 0   # watchdog restarts in a row without new bytes
        self._attempt: asyncio.Task[Any] | None = None
        self._fresh = False         # restart() asked for the next attempt (fresh connection)

    def begin(self, spec: BodySpec, shard: int | None = None) -> None:
        """The body to expect: its length, units and pack offset."""
        self.nbytes, self.units, self.base, self.shard = (spec.nbytes, spec.units,
                                                          spec.offset, shard)
        self.reset()

    def reset(self) -> None:
        """The body starts over: nothing received, nothing verified."""
        self.buf.clear()
        self.verified = self.verified_units = 0
        self.damage = None

    @property
    def received(self) -> int:
        return len(self.buf)

    @property
    def complete(self) -> bool:
        """All bytes in and every unit verified."""
        return (self.damage is None and len(self.buf) == self.nbytes
                and self.verified_units == len(self.units))

    def feed(self, chunk: bytes, now: float | None = None) -> bool:
        """Append ``chunk`` and verify the units it completed; False once a unit failed
        (the rest of this body cannot be used)."""
        now = time.monotonic() if now is None else now
        if self.first_byte is None:
            self.first_byte = now
        if chunk:
            self.buf += chunk
            self.last_progress = now
            self.stalled_restarts = 0
        while self.damage is None and self.verified_units < len(self.units):
            length, sha = self.units[self.verified_units]
            if self.verified + length > len(self.buf):
                break
            unit = memoryview(self.buf)[self.verified : self.verified + length]
            try:
                ok = hashlib.sha256(unit).hexdigest() == sha
            finally:
                unit.release()
            if not ok:
                lo = self.base + self.verified
                where = f" of shard {self.shard}" if self.shard is not None else ""
                self.damage = (f"unit {self.verified_units}{where} (pack bytes "
                               f"{lo}..{lo + length}) fails its checksum")
                break
            self.verified += length
            self.verified_units += 1
        return self.damage is None

    def prefix(self) -> tuple[int, int] | None:
        """The longest fallback whose bytes all verified: ``(config, bytes)``, or None."""
        if not self.units:
            return None
        for config, length in self.fallbacks:
            if length <= self.verified:
                return config, length
        return None

    def result(self, fallback: tuple[int, int] | None = None,
               end: float | None = None) -> Fetched:
        """The body (``fallback`` None) or a fallback's first bytes, as a :class:`Fetched`."""
        end = time.monotonic() if end is None else end
        config, data = None, bytes(self.buf)
        if fallback is not None:
            config, data = fallback[0], bytes(self.buf[: fallback[1]])
        return Fetched(data, self.start, self.first_byte or end, end, self.attempts,
                       self.resumes, self.refetches, config, self.hedges, self.damage)

    def idle_s(self, now: float | None = None) -> float | None:
        """Seconds the attempt in flight has gone without new bytes (None: no attempt in
        flight, or a restart is on its way)."""
        if self.attempt_start is None or self._fresh:
            return None
        now = time.monotonic() if now is None else now
        return now - max(self.last_progress, self.attempt_start)

    def backing_off(self) -> bool:
        """Between attempts after a failed one (the client's retry backoff: the origin is
        failing, e.g. restarting), not on a restart that goes out at once."""
        return self.attempts > 0 and self._attempt is None and not self._fresh

    def restart(self) -> bool:
        """End the attempt in flight: the client re-requests the remaining range at once, on
        a fresh connection (a hedge). False: no attempt in flight to restart."""
        task = self._attempt
        if task is None or task.done() or self._fresh:
            return False
        self._fresh = True
        self.hedges += 1
        task.cancel()
        return True

    def take_fresh(self) -> bool:
        """Whether the next attempt must open a fresh connection (a restart asked for it)."""
        fresh, self._fresh = self._fresh, False
        return fresh

    async def run_attempt(self, attempt: Coroutine[Any, Any, Any]) -> bool:
        """Run one attempt (a coroutine that feeds this transfer); False when
        :meth:`restart` ended it (the caller sends the next one at once)."""
        task = asyncio.ensure_future(attempt)
        self._attempt, self.attempt_start = task, time.monotonic()
        self.attempts += 1
        try:
            await task
            return True
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if self._fresh and task.cancelled() and not (me is not None and me.cancelling()):
                return False
            raise
        finally:
            self._attempt = self.attempt_start = None
