"""A job's first process: runs the job's command, records how it ended, ends the same way.

``python -m service.jobs.supervise EXIT_FILE -- CMD...`` starts ``CMD`` as its child (in its own
process group and session, which the runner created), waits for it, writes
``{"exit_code": N}`` to ``EXIT_FILE`` atomically (N < 0: killed by signal -N, the
``subprocess`` convention), then exits with the same status (re-raising the signal that killed
the child), so a parent that waits for it sees exactly what it would have seen of ``CMD``.

Why: a service restarted while a job runs re-attaches to it but is not its parent, so it
cannot wait for its exit status; it reads ``EXIT_FILE`` instead. Only a SIGKILL of this
process itself (the runner's last resort, which the runner then sees as the waiting parent)
leaves no file: the status is then unknown.

SIGTERM, SIGINT and SIGHUP sent to this process are passed on to the child (a signal sent to
the whole group reaches the child directly too; Python and torchrun handle a second one that
arrives at once as the same signal). This process does nothing else: no imports beyond the
standard library, so that it starts in milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

#: Name of the file in the job's directory.
EXIT_FILE = "exit.json"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def wrap(cmd: list[str], exit_file: Path, python: str | None = None) -> list[str]:
    """``cmd`` run under this supervisor, recording its exit status in ``exit_file``."""
    return [python or sys.executable, "-m", "service.jobs.supervise", str(exit_file), "--", *cmd]


def read_exit_code(exit_file: Path) -> int | None:
    """The exit status the supervisor recorded, or None (not written, or unreadable)."""
    try:
        code = json.loads(exit_file.read_text()).get("exit_code")
    except (OSError, ValueError, AttributeError):
        return None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def _write(exit_file: Path, code: int) -> None:
    tmp = exit_file.with_name(f".{exit_file.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"exit_code": code}) + "\n")
    os.replace(tmp, exit_file)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m service.jobs.supervise EXIT_FILE -- CMD...", file=sys.stderr)
        return 2
    exit_file, cmd = Path(argv[0]), argv[2:]
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, frame: FrameType | None) -> None:
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    # Python-level handlers (not SIG_IGN): the child starts with the default dispositions.
    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        child = subprocess.Popen(cmd)
    except OSError as err:
        print(f"could not start {cmd[0]}: {err}", file=sys.stderr)
        _write(exit_file, 127)
        return 127
    try:  # a renice of this process that came after the fork: the child gets it too
        os.setpriority(os.PRIO_PROCESS, child.pid, os.getpriority(os.PRIO_PROCESS, 0))
    except OSError:
        pass
    code = child.wait()
    try:
        _write(exit_file, code)
    except OSError as err:
        print(f"could not record the exit status in {exit_file}: {err}", file=sys.stderr)
    if code < 0:  # end as the child did: killed by the same signal
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
