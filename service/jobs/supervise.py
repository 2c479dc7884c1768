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
arrives at once as the same signal).

The child's stdout and stderr come through a pipe and are copied to this process's stdout (the
job's ``train.log``) line by line with every secret masked (:func:`dlrm_vrgd.redact.redact`:
the values of the secrets in the job's environment, URI credentials, secret query values), so
that nothing the job prints, a tracking server's error that echoes a password included, puts a
credential in its log. This process imports nothing else beyond the standard library, so that
it starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType

#: Name of the file in the job's directory.
EXIT_FILE = "exit.json"
#: Largest exit file read (it holds one small JSON object).
_MAX_EXIT_BYTES = 4096
#: Seconds to wait, once the child ended, for the rest of its output.
DRAIN_S = 5.0
#: A line longer than this is copied in pieces (the pieces masked one by one).
MAX_HELD_BYTES = 1 << 20
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def wrap(cmd: list[str], exit_file: Path, python: str | None = None) -> list[str]:
    """``cmd`` run under this supervisor, recording its exit status in ``exit_file``."""
    return [python or sys.executable, "-m", "service.jobs.supervise", str(exit_file), "--", *cmd]


def read_exit_code(exit_file: Path) -> int | None:
    """The exit status the supervisor recorded, or None (not written, or unreadable: a link,
    anything but a regular file, over 4 KiB, not the JSON object it writes)."""
    try:
        fd = os.open(exit_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, _MAX_EXIT_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > _MAX_EXIT_BYTES or data.count(b"{") + data.count(b"[") > 8:
        return None
    try:
        code = json.loads(data).get("exit_code")
    except (ValueError, AttributeError):
        return None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def _write(exit_file: Path, code: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=exit_file.parent, prefix=f".{exit_file.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"exit_code": code}) + "\n")
    os.replace(tmp, exit_file)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def copy_masked(src: int, dst: int, hold: int = MAX_HELD_BYTES) -> None:
    """Copy ``src`` to ``dst`` until its end, whole lines at a time (a line ends at ``\\n``
    or ``\\r``: progress bars pass as they redraw) with :func:`~dlrm_vrgd.redact.redact`
    applied; a line longer than ``hold`` bytes is passed on in pieces of that size."""
    from dlrm_vrgd.redact import redact

    def masked(data: bytes) -> bytes:
        return redact(data.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")

    pending = b""
    writable = True
    while data := os.read(src, 1 << 16):
        if not writable:
            continue  # the log cannot be written (a full disk): read on, the child goes on
        pending += data
        cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
        if cut == 0 and len(pending) < hold:
            continue
        out, pending = pending[: cut or len(pending)], pending[cut or len(pending) :]
        try:
            _write_all(dst, masked(out))
        except OSError:
            writable, pending = False, b""
    if pending and writable:
        with contextlib.suppress(OSError):
            _write_all(dst, masked(pending))


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
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as err:
        print(f"could not start {cmd[0]}: {err}", file=sys.stderr)
        _write(exit_file, 127)
        return 127
    assert child.stdout is not None
    copier = threading.Thread(
        target=copy_masked, args=(child.stdout.fileno(), sys.stdout.fileno()), daemon=True
    )
    copier.start()
    try:  # a renice of this process that came after the fork: the child gets it too
        os.setpriority(os.PRIO_PROCESS, child.pid, os.getpriority(os.PRIO_PROCESS, 0))
    except OSError:
        pass
    code = child.wait()
    copier.join(DRAIN_S)  # what it printed last (a process it left may hold the pipe open)
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
