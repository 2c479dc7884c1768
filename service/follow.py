"""One line that follows a job from its event stream, for people (``dlrm-vrgd jobs ...
--follow``, ``dlrm-vrgd demo``): step, loss, the last AUC (and the oracle's), GSNR, rows/s.

On a terminal it is a tqdm bar redrawn in place. Elsewhere (a log file, a pipe, a job's
``train.log``) it writes a plain line at most every ``DLRM_VRGD_PROGRESS_EVERY_S`` seconds
(default 10), and at each eval and the end, instead of carriage-return redraws, so that every
line of a log is whole. State messages ("attempt 1 ended: ...") are lines of their own.

The events come from a server: a value of the wrong type shows as ``-`` and every string is
made printable (:mod:`service.terminal`), so no answer can raise here or reach the terminal
as an escape sequence.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

from service.client import Event
from service.terminal import printable


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _fmt(value: Any, spec: str = ".4f") -> str:
    number = _num(value)
    return "-" if number is None else format(number, spec)


class FollowLine:
    """Feed it the job's events (:meth:`on_event`); :meth:`close` at the end."""

    def __init__(self, total: Any, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total = int(total) if isinstance(total, int) and total > 0 else None
        isatty = getattr(self.stream, "isatty", None)
        self.plain = not (isatty and isatty())
        try:
            self.every_s = float(os.environ.get("DLRM_VRGD_PROGRESS_EVERY_S", "10"))
        except ValueError:
            self.every_s = 10.0
        self._printed = -float("inf")
        self.step = 0
        self.loss: float | None = None
        self.rows_per_s: float | None = None
        self.auc = "AUC -"
        self.gsnr_dense: float | None = None
        self.gsnr_tables: float | None = None
        self.bar: Any = None
        if not self.plain:
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total, unit="step", file=self.stream, dynamic_ncols=True, desc="job"
            )

    def on_event(self, event: Event) -> None:
        data = event.data if isinstance(event.data, dict) else {}
        kind = data.get("kind")
        if event.event == "metrics" and kind == "train":
            step = data.get("step")
            if isinstance(step, int) and not isinstance(step, bool) and step > self.step:
                if self.bar is not None:
                    self.bar.update(step - self.step)
                self.step = step
            self.loss = _num(data.get("loss"))
            self.rows_per_s = _num(data.get("rows_per_s"))
            if _num(data.get("gsnr_ratio")) is not None:
                self.gsnr_dense = _num(data.get("gsnr_ratio"))
            self._show(last=self.total is not None and self.step >= self.total)
        elif event.event == "metrics" and kind == "eval":
            split = data.get("split") if isinstance(data.get("split"), str) else "?"
            self.auc = f"{printable(split, False)[:16]} AUC {_fmt(data.get('auc'))}"
            if _num(data.get("oracle_auc")) is not None:
                self.auc += f" (oracle {_fmt(data.get('oracle_auc'))})"
            self._show(last=True)
        elif event.event == "gsnr":
            tables = data.get("tables") if isinstance(data.get("tables"), list) else []
            ratios = [_num(t.get("ratio")) for t in tables if isinstance(t, dict)]
            known = [r for r in ratios if r is not None]
            if known:
                self.gsnr_tables = sum(known) / len(known)
        elif event.event == "state" and isinstance(data.get("message"), str):
            self._message(f"job: {printable(data['message'], False)}")

    def _status(self) -> str:
        gsnr = "GSNR -"
        if self.gsnr_dense is not None or self.gsnr_tables is not None:
            gsnr = (
                f"GSNR {_fmt(self.gsnr_dense, '.3f')} dense/{_fmt(self.gsnr_tables, '.3f')} tables"
            )
        rows = f"{self.rows_per_s / 1000:.1f}k rows/s" if self.rows_per_s else "- rows/s"
        return f"loss {_fmt(self.loss)} | {self.auc} | {gsnr} | {rows}"

    def _show(self, last: bool = False) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(self._status(), refresh=True)
            return
        now = time.monotonic()
        if last or now - self._printed >= self.every_s:
            self._printed = now
            total = self.total if self.total is not None else "-"
            self._write(f"step {self.step}/{total} {self._status()}")

    def _message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self._write(text)

    def _write(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
