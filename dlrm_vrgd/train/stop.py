"""Stopping a run on Ctrl-C (SIGINT) or SIGTERM so that it can be resumed.

One process (``dlrm-vrgd train``): the first signal asks the run to stop after the step in
progress, which the loop checkpoints (nothing trained is lost), records ``status.json:
interrupted`` and ends; a second signal raises :class:`KeyboardInterrupt` at once, as Python's
own SIGINT handler does (no checkpoint of a step cut midway) — unless it comes within
:data:`SAME_REQUEST_S` of the first, when it is the same signal delivered twice (to the process
group and again by the process that forwards it).

Several ranks: a rank interrupted mid-collective would leave the others waiting in it (or
failing on a closed connection), so the signal only *requests* a stop; in each step the ranks
agree on it (its flags ride in the step's one all-reduce, with the loss: :func:`flags`,
:func:`agreed`) and all of them stop after the same step. A request that comes after that
collective (during the optimizer step, an eval or a checkpoint) is agreed on in the next step,
which all ranks then finish and checkpoint.
The ``dlrm-vrgd train`` launcher runs torchrun in a session of its own, so a terminal's Ctrl-C
reaches the launcher alone; it forwards the signal to the ranks (a second one kills them at
once) and exits 130 when the run says it was interrupted (:func:`launch_and_forward`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Marks the processes of one launch (torchrun and its ranks) in their environment.
LAUNCH_ENV = "DLRM_VRGD_LAUNCH"
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_requested: list[int] = []  # the signals this rank received, while cooperative


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _raise(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal_name(signum))


#: A second signal this soon after the first is the same request delivered twice: a signal to a
#: whole process group also reaches the process that forwards it (a job's supervisor, a
#: launcher), so the trainer gets it twice within milliseconds.
SAME_REQUEST_S = 2.0
_first_at: list[float] = []


def _request(signum: int, frame: Any) -> None:
    now = time.monotonic()
    if _requested:
        if now - _first_at[0] < SAME_REQUEST_S:
            return  # the same request, forwarded: still stop after this step
        raise KeyboardInterrupt(signal_name(signum))  # a second one: at once
    logger.warning(
        "%s: stopping after this step and checkpointing it (again: stop at once)",
        signal_name(signum),
    )
    _requested.append(signum)
    _first_at[:] = [now]


def install(cooperative: bool) -> None:
    """SIGINT and SIGTERM stop the run: at once (one process) or after the step all ranks
    agree on (``cooperative``, several ranks)."""
    _requested.clear()
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _request if cooperative else _raise)


def requested() -> str | None:
    """The name of the signal this process was asked to stop with, else None (one process:
    several ranks agree through :func:`flags` and :func:`agreed`)."""
    return signal_name(_requested[0]) if _requested else None


def flags() -> list[float]:
    """This rank's stop request as one flag per signal of :data:`_STOP_SIGNALS` (1.0: asked with
    it): summed over the ranks, they say which signals any rank got."""
    return [1.0 if sig in _requested else 0.0 for sig in _STOP_SIGNALS]


def agreed(summed: list[float]) -> str | None:
    """The signal all ranks stop with, from :func:`flags` summed over the ranks: the highest
    numbered one any rank got (SIGTERM before SIGINT), else None."""
    asked = [sig for sig, n in zip(_STOP_SIGNALS, summed, strict=True) if n > 0]
    return signal_name(max(asked)) if asked else None


# ----------------------------------------------------------------------------- the launcher
def _pdeathsig() -> None:  # in the child, before exec: die with the launcher, even SIGKILLed
    from dlrm_vrgd.train.distributed import die_with_parent

    die_with_parent()


def ranks_of(marker: str) -> list[int]:
    """Pids of the ranks of one launch: processes with ``LAUNCH_ENV=marker`` and torchrun's
    ``LOCAL_RANK`` in their environment (torchrun itself has no LOCAL_RANK)."""
    tag, local = f"{LAUNCH_ENV}={marker}".encode(), b"LOCAL_RANK="
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        if tag in environ and any(v.startswith(local) for v in environ):
            found.append(int(entry.name))
    return found


def launch_and_forward(cmd: list[str], env: dict[str, str], marker: str) -> int:
    """Run torchrun (``cmd``) in a session of its own and wait for it, forwarding SIGINT and
    SIGTERM to its ranks (the second signal SIGKILLs them and torchrun); torchrun's exit
    status. The ranks die with torchrun, and torchrun with this process (PR_SET_PDEATHSIG)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_pdeathsig)
    seen = []

    def forward(signum: int, frame: Any) -> None:
        seen.append(signum)
        sig = signum if len(seen) == 1 else signal.SIGKILL
        for pid in ranks_of(marker):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if len(seen) > 1:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    previous = {sig: signal.signal(sig, forward) for sig in _STOP_SIGNALS}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
