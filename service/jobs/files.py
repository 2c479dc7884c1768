"""A job's files: its directory layout, log tail, and safe access to run-directory artifacts.

```
DATA_DIR/jobs/<id>/
  config.yaml   the submitted config, resolved (what the trainer is started with)
  train.log     the trainer's stdout and stderr
  run/          the run directory (dlrm_vrgd.rundir): metrics.jsonl, gsnr.jsonl,
                checkpoints/, result.json; model/ (train jobs: the exported model);
                predictions.csv|parquet (score jobs)
```

Artifact names are relative paths inside ``run/``. A name with an absolute path, a ``..`` or
``.`` segment, a backslash or a control character is refused as invalid input; a name that
passes through a symlink (wherever it points), or names a hidden staging entry or anything
but a regular file, is not found. Archives (:func:`tar_stream`) leave links out likewise.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from service.errors import ArtifactNotFound, InvalidInput
from service.jobs import reading

logger = logging.getLogger(__name__)

CONFIG = "config.yaml"
LOG = "train.log"
RUN = "run"
RESULT = "result.json"
METRICS = "metrics.jsonl"
GSNR = "gsnr.jsonl"
MODEL = "model"

_BAD_CHARS = re.compile(r"[\x00-\x1f\x7f\\]")
#: Bytes read from the end of a log to find its last lines.
_TAIL_BYTES = 256 << 10


@dataclass(frozen=True)
class JobFiles:
    """Paths of one job."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def log(self) -> Path:
        return self.root / LOG

    @property
    def run_dir(self) -> Path:
        return self.root / RUN

    @property
    def model_dir(self) -> Path:
        """A train job's exported model (``dlrm-vrgd export``), its ``model`` artifact."""
        return self.run_dir / MODEL

    @property
    def result(self) -> Path:
        return self.run_dir / RESULT

    @property
    def metrics(self) -> Path:
        return self.run_dir / METRICS

    @property
    def gsnr(self) -> Path:
        return self.run_dir / GSNR


def write_config(path: Path, config: dict[str, Any]) -> None:
    """Write the config YAML atomically (a new temporary file, never one found there: a link
    planted under its name is not followed; fsync; rename over whatever ``path`` is). The
    temporary file is removed when the write fails, e.g. on a full disk."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(yaml.safe_dump(config, sort_keys=False))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_tree(path: Path) -> None:
    """Remove a job directory: renamed aside first, so a half-removed one is never seen."""
    if not path.exists():
        return
    trash = path.with_name(f".deleted-{path.name}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def read_result(files: JobFiles, strict: bool = False) -> dict[str, Any] | None:
    """The run's result.json, or None when absent. One that is a link, not a regular file,
    over 16 MiB, not a JSON object or nested too deep (:mod:`service.jobs.reading`) raises
    :class:`~service.jobs.reading.JobFileError` with ``strict``, else is logged and read as
    None."""
    try:
        data = reading.read_json(files.result, files.root)
        if data is not None and not isinstance(data, dict):
            raise reading.JobFileError(f"{RUN}/{RESULT}", "not a JSON object")
    except reading.JobFileError as err:
        if strict:
            raise
        logger.warning("job %s: %s", files.root.name, err.message)
        return None
    return data


def tail_lines(path: Path, n: int, within: Path | None = None) -> list[str]:
    """The last ``n`` lines of a log as a terminal would show them: a carriage return (progress
    bars) overwrites its line, so only each line's last segment is kept. Read as every job
    file is (:mod:`service.jobs.reading`: no link below ``within``, regular files only, its
    last 256 KiB)."""
    if n <= 0:
        return []
    data = reading.read_tail(path, _TAIL_BYTES, within)
    text = data.decode("utf-8", errors="replace")
    lines = []
    for raw in text.split("\n"):
        segments = [s for s in raw.split("\r") if s.strip()]
        lines.append(segments[-1].rstrip() if segments else "")
    while lines and not lines[-1]:
        lines.pop()
    return lines[-n:]


def check_artifact_name(name: str) -> str:
    """Validate a relative artifact path; raise :class:`InvalidInput` naming ``path``."""
    if not name or len(name) > 1024:
        raise InvalidInput("path", "artifact path must be 1..1024 characters", ("path", "path"))
    if _BAD_CHARS.search(name):
        raise InvalidInput(
            "path", "artifact path contains a control character or backslash", ("path", "path")
        )
    if name.startswith("/"):
        raise InvalidInput("path", "artifact path must be relative", ("path", "path"))
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise InvalidInput(
            "path",
            "artifact path must not contain empty, '.' or '..' segments",
            ("path", "path"),
        )
    return name


def resolve_artifact(files: JobFiles, name: str) -> Path:
    """The regular file ``name`` inside the run directory, or :class:`ArtifactNotFound`."""
    check_artifact_name(name)
    if any(p.startswith(".") for p in name.split("/")):
        raise ArtifactNotFound(f"no artifact {name!r}")
    if files.run_dir.is_symlink():
        raise ArtifactNotFound(f"no artifact {name!r}")
    root = files.run_dir.resolve()
    try:
        target = (root / name).resolve(strict=True)
    except (FileNotFoundError, NotADirectoryError, RuntimeError, OSError):
        raise ArtifactNotFound(f"no artifact {name!r}") from None
    if target != root / name or not target.is_file():  # a link on the way, or not a file
        raise ArtifactNotFound(f"no artifact {name!r}")
    return target


@dataclass(frozen=True)
class Artifact:
    path: str
    bytes: int
    modified_at: datetime


def list_artifacts(files: JobFiles) -> list[Artifact]:
    """Regular files of the run directory (hidden temporary and staging entries left out)."""
    root = files.run_dir
    if not root.is_dir():
        return []
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fname in sorted(filenames):
            if fname.startswith("."):
                continue
            full = Path(dirpath) / fname
            try:
                st = full.lstat()
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            out.append(
                Artifact(
                    path=full.relative_to(root).as_posix(),
                    bytes=st.st_size,
                    modified_at=datetime.fromtimestamp(st.st_mtime, UTC),
                )
            )
    return out


def is_regular(path: Path) -> bool:
    """True for a regular file that is not a link."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def is_real_dir(root: Path, directory: Path) -> bool:
    """True when ``directory`` is a directory inside ``root`` reached through no link (neither
    ``root`` nor any component below it is a symlink)."""
    try:
        if root.is_symlink():
            return False
        parts = directory.relative_to(root).parts
    except (OSError, ValueError):
        return False
    here = root
    for part in parts:
        here = here / part
        try:
            st = here.lstat()
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode):
            return False
    return True


def tar_stream(
    directory: Path,
    arcname: str,
    expected: dict[str, Any] | None = None,
    chunk: int = 1 << 20,
) -> Iterator[bytes]:
    """The regular files of ``directory`` (top level, sorted) as an uncompressed tar archive
    under ``arcname/``, in ``chunk``-sized pieces: memory stays bounded whatever the size.

    Links, devices, FIFOs and hidden entries are left out, and every file is opened with
    ``O_NOFOLLOW`` relative to the directory's own descriptor: a link planted (or swapped in
    while the archive is sent) is never followed out. With ``expected`` (a model manifest's
    ``files``: name -> bytes, sha256), a listed file whose bytes differ from it while being
    sent ends the archive with an error instead of its end-of-archive blocks, so a client
    never receives an altered model as a complete archive."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        with os.scandir(dir_fd) as entries:
            names = sorted(
                e.name
                for e in entries
                if not e.name.startswith(".") and e.is_file(follow_symlinks=False)
            )
        for name in names:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
            except OSError:  # replaced by a link (ELOOP) or removed since the listing
                continue
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    continue
                want = (expected or {}).get(name)
                yield from _tar_member(f, st, f"{arcname}/{name}", chunk, want)
        yield b"\0" * (2 * tarfile.BLOCKSIZE)  # end of archive
    finally:
        os.close(dir_fd)


def _tar_member(
    f: Any, st: os.stat_result, name: str, chunk: int, expected: dict[str, Any] | None
) -> Iterator[bytes]:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = st.st_size, int(st.st_mtime), 0o644
    yield info.tobuf(format=tarfile.PAX_FORMAT)
    digest = hashlib.sha256()
    sent = 0
    while sent < st.st_size and (data := f.read(min(chunk, st.st_size - sent))):
        sent += len(data)
        digest.update(data)
        yield data
    if sent != st.st_size:
        raise OSError(f"{name}: changed while being sent")
    if expected is not None and (
        sent != expected.get("bytes") or digest.hexdigest() != expected.get("sha256")
    ):
        raise OSError(f"{name}: differs from the model's manifest; the archive is cut short")
    if st.st_size % tarfile.BLOCKSIZE:
        yield b"\0" * (tarfile.BLOCKSIZE - st.st_size % tarfile.BLOCKSIZE)
