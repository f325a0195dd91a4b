"""The network side of the runtime: an asyncio event loop in a daemon thread.

Both the Python reference pipeline (:mod:`edge.pipeline`) and the runtime's manifest and
bundle transfers run their coroutines on one :class:`NetLoop`; the executing thread hands
them over with :meth:`NetLoop.submit` / :meth:`NetLoop.run`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def wait_event(event: asyncio.Event, timeout: float | None) -> None:
    """Until ``event`` is set or ``timeout`` seconds (None: no limit) have passed.

    ``asyncio.timeout``, not ``asyncio.wait_for``: on Python 3.11 ``wait_for`` can swallow
    a cancellation that arrives as the event is set (bpo-42130), and a loop around it
    then never ends; ``NetLoop.close`` waited 10 s for the watchdog and a CI run failed
    (``test_a_decode_failure_reaches_the_executing_thread``)."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        pass


class NetLoop:
    """An asyncio event loop in a daemon thread (the network side of the runtime)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="edge-net", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def close(self) -> None:
        if self.loop.is_closed():
            return

        async def _drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(_drain(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self.loop.close()

    def __enter__(self) -> NetLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

