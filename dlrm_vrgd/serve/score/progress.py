"""How far ``dlrm-vrgd score`` is: rows, bytes of input read, rows skipped as malformed."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any


class Progress:
    """A tqdm bar on a terminal; off one (a job's log), a plain line at most every
    ``DLRM_VRGD_PROGRESS_EVERY_S`` seconds (default 10) and one at the end, each in one write,
    so that a log holds no carriage-return redraws (as the trainer's ``ProgressLine``).
    ``total``: the bytes of input to read (a day file's rows count as their bytes on disk);
    ``callback(rows, seconds, fraction read)`` after every :meth:`advance`."""

    def __init__(
        self, total: int, show: bool, callback: Callable[[int, float, float], None] | None
    ) -> None:
        from tqdm import tqdm

        self.total = max(total, 1)
        self.stream = sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.plain = show and not (isatty and isatty())
        self.every_s = float(os.environ.get("DLRM_VRGD_PROGRESS_EVERY_S", "10"))
        self.bar = tqdm(total=total, unit="B", unit_scale=True, desc="score",
                        disable=not show or self.plain)  # fmt: skip
        self.done_bytes = 0
        self.rows = 0
        self.bad_rows = 0
        self.bad_examples: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        self.callback = callback

    def advance(self, nbytes: int, rows: int) -> None:
        self.rows += rows
        self.done_bytes += nbytes
        self.bar.update(nbytes)
        seconds = time.perf_counter() - self.t0
        rate = self.rows / seconds if seconds > 0 else 0.0
        self.bar.set_postfix_str(f"{self.rows:,} rows, {rate:,.0f} rows/s", refresh=False)
        if self.plain and time.perf_counter() - self._printed >= self.every_s:
            self._line()
        if self.callback is not None:
            self.callback(self.rows, seconds, min(1.0, self.done_bytes / self.total))

    _printed = -float("inf")

    def _line(self) -> None:
        self._printed = now = time.perf_counter()
        rate = self.rows / (now - self.t0) if now > self.t0 else 0.0
        fraction = min(1.0, self.done_bytes / self.total)
        self.stream.write(f"score {fraction:.0%} {self.rows:,} rows, {rate:,.0f} rows/s\n")
        self.stream.flush()

    def close(self) -> None:
        if self.plain and self.rows:
            self._line()
        self.bar.close()
