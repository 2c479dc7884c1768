"""Runner.stop() ends the runner's loop even when the cancellation is lost: on Python 3.11,
``asyncio.wait_for`` swallows a cancel that arrives just as the awaited event fires, which is
what happens when stop() follows a wake-up (e.g. right after a cancel request)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from service.jobs.notifier import Notifier
from service.jobs.runner import Runner
from service.jobs.store import Store
from service.settings import Settings


def test_stop_right_after_a_wake_up_ends_the_loop(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", poll_interval_s=5.0, gpus="none")
    settings.jobs_dir.mkdir(parents=True)
    store = Store(settings.db_path)

    async def main() -> None:
        for _ in range(3):
            runner = Runner(settings, store, Notifier())
            await runner.start()
            await asyncio.sleep(0.05)  # the loop now waits for a wake-up (or 5 s)
            runner._wake.set()  # the event fires ...
            t0 = time.monotonic()
            await asyncio.wait_for(runner.stop(), 10)  # ... as the loop is cancelled
            assert time.monotonic() - t0 < 3, "stop() waited for a second cancellation"

    try:
        asyncio.run(main())
    finally:
        store.close()
