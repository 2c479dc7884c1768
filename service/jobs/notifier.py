"""Wake event streams when a job has something new (records or a state change).

Lives on the event loop: ``notify`` and ``wait`` must be called from the loop's thread (the
runner and the async job-layer methods do). A missed wake-up costs latency, never data: event
streams also re-read the store every few seconds.
"""

from __future__ import annotations

import asyncio


class Notifier:
    """One :class:`asyncio.Event` per job with waiters; ``notify`` sets and replaces it."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def notify(self, job_id: str) -> None:
        event = self._events.pop(job_id, None)
        if event is not None:
            event.set()

    async def wait(self, job_id: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for news of ``job_id``; True if notified."""
        event = self._events.setdefault(job_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return False
        return True
