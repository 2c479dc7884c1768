"""Reading a checkpoint: find it (newest that verifies, or the best), check its manifest and
every file's size and SHA-256, and load a rank's state as tensors only."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import torch

from dlrm_vrgd.checkpoint import rng
from dlrm_vrgd.checkpoint.layout import (
    BEST,
    MANIFEST,
    CheckpointError,
    list_checkpoints,
    step_name,
)
from dlrm_vrgd.rundir.layout import CHECKPOINTS

_MAX_WORLD = 1 << 16
_MAX_MANIFEST_BYTES = 16 << 20
_STATE_KEYS = {"step", "world_size", "dense", "tables", "dense_opt", "sparse_opt", "rng", "config"}


def best_checkpoint(run_dir: Path) -> Path:
    """The best-validation checkpoint named by ``checkpoints/best.json`` (verified by the
    caller's load); :class:`CheckpointError` when the run kept none."""
    path = Path(run_dir) / CHECKPOINTS / BEST
    try:
        record = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: missing (the run kept no best checkpoint: it needs run.eval_every and "
            "run.checkpoint_every or checkpoint_every_s, with run.keep_best_checkpoint)"
        ) from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__})") from None
    step = record.get("step") if isinstance(record, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{path}: 'step' must be a non-negative integer")
    ckpt = path.parent / step_name(step)
    if not ckpt.is_dir() or ckpt.is_symlink():
        raise CheckpointError(f"{path}: names step {step}, whose checkpoint is gone")
    return ckpt


def read_manifest(ckpt: Path) -> dict[str, Any]:
    """The manifest of ``ckpt``, checked for its exact shape, and that the directory holds only
    the files it lists (:class:`CheckpointError` otherwise)."""
    path = Path(ckpt) / MANIFEST
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise CheckpointError(f"{path}: not a regular file")
            manifest = json.loads(f.read(_MAX_MANIFEST_BYTES + 1))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (incomplete checkpoint)") from None
    except OSError as err:  # unreadable, a symlink (ELOOP)
        why = "a symlink" if err.errno == errno.ELOOP else err.strerror
        raise CheckpointError(f"{path}: cannot open ({why})") from None
    except ValueError as err:  # not UTF-8, not JSON (the message gives a position, no content)
        where = f" at line {err.lineno} column {err.colno}" if hasattr(err, "lineno") else ""
        raise CheckpointError(f"{path}: corrupt manifest: not UTF-8 JSON{where}") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"{path}: corrupt manifest: {problem}")
    extra = set(os.listdir(ckpt)) - set(manifest["files"]) - {MANIFEST}
    if extra:
        raise CheckpointError(f"{ckpt}: holds {len(extra)} file(s) its manifest does not list")
    return manifest


_MANIFEST_KEYS = {"step", "world_size", "files", "config"}
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _manifest_problem(m: Any) -> str | None:
    if not isinstance(m, dict):
        return f"a JSON {type(m).__name__}, not an object"
    if set(m) != _MANIFEST_KEYS:
        return f"keys are not exactly {sorted(_MANIFEST_KEYS)}"
    for key, kind in (("step", int), ("world_size", int), ("files", dict), ("config", dict)):
        if not isinstance(m.get(key), kind) or isinstance(m.get(key), bool):
            return f"{key!r} missing or not {'an integer' if kind is int else 'an object'}"
    if not 1 <= m["world_size"] <= _MAX_WORLD or m["step"] < 0:
        return "step or world_size out of range"
    if set(m["files"]) != {f"rank{r}.pt" for r in range(m["world_size"])}:
        return f"files are not exactly rank0.pt .. rank{m['world_size'] - 1}.pt"
    for name, meta in m["files"].items():
        if (
            not isinstance(meta, dict)
            or set(meta) != {"bytes", "sha256"}
            or not isinstance(meta["bytes"], int)
            or isinstance(meta["bytes"], bool)
            or meta["bytes"] < 0
            or not isinstance(meta["sha256"], str)
            or not _SHA256.match(meta["sha256"])
        ):
            return f"files entry {name} is not {{bytes, sha256}}"
    return None


def verify(ckpt: Path) -> dict[str, Any]:
    """Check every file of ``ckpt`` against its manifest; the manifest, or CheckpointError."""
    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt)
    for name, meta in manifest["files"].items():
        os.close(_check_file(ckpt / name, meta))
    return manifest


def newest_verified(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint of ``run_dir`` that verifies (None when there is no checkpoint),
    and the newer ones skipped with the reason; :class:`CheckpointError` when none verifies."""
    skipped: list[tuple[Path, str]] = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            verify(path)
        except CheckpointError as err:
            skipped.append((path, str(err)))
            continue
        return path, skipped
    if skipped:
        reasons = "; ".join(reason for _, reason in skipped)
        raise CheckpointError(f"{run_dir}: no checkpoint verifies: {reasons}")
    return None, skipped


def _check_file(path: Path, meta: dict[str, Any]) -> int:
    """An fd (at offset 0) of ``path``, a regular file (links are not followed) of the size and
    SHA-256 that ``meta`` lists; else CheckpointError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as err:
        why = "a symlink" if err.errno == errno.ELOOP else err.strerror
        raise CheckpointError(f"{path}: cannot open ({why})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file")
        if st.st_size != meta["bytes"]:
            raise CheckpointError(
                f"{path}: {st.st_size} bytes, manifest says {meta['bytes']} (truncated?)"
            )
        h = hashlib.sha256()
        while block := os.read(fd, 1 << 20):
            h.update(block)
        if h.hexdigest() != meta["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch (corrupt)")
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


def load_rank_state(ckpt: Path, rank: int, map_location: str | torch.device = "cpu") -> dict:
    """Verify and load one rank's state of checkpoint directory ``ckpt``.

    The file is opened once (no link followed), checked against the manifest and unpickled
    with ``weights_only=True``: tensors and plain containers only, a pickle naming any other
    object is refused (CheckpointError), and nothing in it runs."""
    ckpt = Path(ckpt)
    manifest = read_manifest(ckpt)
    name = f"rank{rank}.pt"
    meta = manifest["files"].get(name)
    path = ckpt / name
    if meta is None:
        raise CheckpointError(
            f"{ckpt}: written by {manifest['world_size']} rank(s), has no state for rank {rank}"
        )
    with os.fdopen(_check_file(path, meta), "rb") as f:
        try:
            state = torch.load(f, map_location=map_location, weights_only=True)
        except Exception as err:  # UnpicklingError, a bad zip archive, a bad storage record
            raise CheckpointError(
                f"{path}: not a tensors-only checkpoint ({type(err).__name__})"
            ) from None
    problem = _state_problem(state, manifest)
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    return state


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


def _state_problem(state: Any, manifest: dict[str, Any]) -> str | None:
    """What makes a loaded rank state unusable or disagree with its manifest (None if fine)."""
    if not isinstance(state, dict) or not _STATE_KEYS <= set(state):
        return f"not a rank state (a dict with {sorted(_STATE_KEYS)})"
    if state["step"] != manifest["step"] or state["world_size"] != manifest["world_size"]:
        return "its step or world size differs from the manifest's"
    if _canonical(state["config"]) != _canonical(manifest["config"]):
        # The manifest's copy is not hashed: it must agree, types included (1 is not true).
        return "its config differs from the manifest's"
    tables = state["tables"]
    if not isinstance(state["dense"], dict) or not isinstance(tables, list):
        return "dense is not a dict of tensors or tables not a list"
    if not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state["dense"].items()
    ):
        return "dense is not a dict of tensors"
    for t in tables:
        if (
            not isinstance(t, dict)
            or set(t) != {"names", "weights", "states"}
            or not all(isinstance(n, str) for n in t["names"])
            or not all(isinstance(w, torch.Tensor) and w.dim() == 2 for w in t["weights"])
            or not all(isinstance(s, torch.Tensor) for s in t["states"])
            or len(t["names"]) != len(t["weights"])
        ):
            return "a tables entry is not {names, weights, states}"
        for name, w, st in zip(t["names"], t["weights"], t["states"], strict=False):
            # the optimizer state of a table: none (SGD), one sum per row (row-wise Adagrad) or
            # one per weight element (full Adagrad, laid out as the weights)
            if st.numel() and tuple(st.shape) not in ((w.shape[0],), tuple(w.shape)):
                return (
                    f"table {name}: optimizer state of shape {tuple(st.shape)} for weights of "
                    f"shape {tuple(w.shape)}"
                )
    if not isinstance(state["dense_opt"], dict) or not isinstance(state["sparse_opt"], dict):
        return "an optimizer state is not a dict"
    return rng.problem(state["rng"])
