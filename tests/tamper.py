"""Hostile edits of a directory of model or checkpoint files, for the loaders' tests: a pickle
that runs code when unpickled, and random mutations (hypothesis) of a real directory."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st


class Payload:
    """Unpickling this runs ``touch MARKER`` (what an attacker's pickle would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def states_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(states_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(states_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def json_edits() -> st.SearchStrategy[tuple[str, Any]]:
    junk = st.one_of(st.none(), st.booleans(), st.integers(-2, 1 << 70), st.text(max_size=8),
                     st.lists(st.integers(), max_size=3), st.just({"bytes": 1}))  # fmt: skip
    return st.tuples(
        st.sampled_from(["drop", "add", "set", "whole", "file_entry", "file_name"]), junk
    )


def mutate_json(path: Path, edit: tuple[str, Any], data: st.DataObject) -> None:
    kind, junk = edit
    m = json.loads(path.read_text())
    keys = sorted(m)
    if kind == "drop":
        del m[data.draw(st.sampled_from(keys))]
    elif kind == "add":
        m[data.draw(st.text(min_size=1, max_size=6).filter(lambda k: k not in m))] = junk
    elif kind == "set":
        m[data.draw(st.sampled_from(keys))] = junk
    elif kind == "whole":
        m = junk
    elif kind == "file_entry":
        name = data.draw(st.sampled_from(sorted(m["files"])))
        field = data.draw(st.sampled_from(["bytes", "sha256", None]))
        if field is None:
            m["files"][name] = junk
        else:
            m["files"][name][field] = junk
    else:  # a listed name that points elsewhere
        name = data.draw(st.sampled_from(["../rank0.pt", "sub/rank0.pt", "rank1.pt", ""]))
        m["files"][name] = next(iter(m["files"].values()))
    path.write_text(json.dumps(m))


def mutate_bytes(path: Path, kind: str, data: st.DataObject) -> None:
    raw = path.read_bytes()
    if kind == "flip":
        at = data.draw(st.integers(0, len(raw) - 1))
        xor = data.draw(st.integers(1, 255))
        path.write_bytes(raw[:at] + bytes([raw[at] ^ xor]) + raw[at + 1 :])
    elif kind == "truncate":
        path.write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1))])
    else:
        path.write_bytes(raw + data.draw(st.binary(min_size=1, max_size=64)))


def same_json(a: bytes, b: bytes) -> bool:
    """Whether two JSON texts hold the same values *and types*: Python's ``True == 1`` and
    ``1.0 == 1`` would call a manifest edit from 1 to true "unchanged", yet a strict loader
    rightly refuses it."""
    try:
        canon = [json.dumps(json.loads(x), sort_keys=True) for x in (a, b)]
    except ValueError:
        return False
    return canon[0] == canon[1]


MUTATIONS = ["flip", "truncate", "append", "json", "remove", "add_file", "symlink", "dir",
             "payload"]  # fmt: skip


def mutate_dir(target: Path, data: st.DataObject, marker: Path) -> tuple[str, bool]:
    """Apply one random mutation to the directory ``target`` (a checkpoint or a model): its
    kind, and whether it changed anything (a manifest edit may leave equal JSON)."""
    names = sorted(os.listdir(target))
    kind = data.draw(st.sampled_from(MUTATIONS), label="mutation")
    name = data.draw(st.sampled_from(names), label="file")
    path = target / name
    raw = path.read_bytes()
    if name == "manifest.json" and kind in ("flip", "truncate", "append"):
        mutate_bytes(path, kind, data)
        return "manifest", not same_json(raw, path.read_bytes())
    if kind in ("flip", "truncate", "append"):
        mutate_bytes(path, kind, data)
    elif kind == "json":
        manifest = target / "manifest.json"
        before = manifest.read_bytes()
        mutate_json(manifest, data.draw(json_edits()), data)
        return "manifest", not same_json(manifest.read_bytes(), before)
    elif kind == "remove":
        path.unlink()
    elif kind == "add_file":
        (target / data.draw(st.sampled_from(["extra.pt", ".hidden", "rank9.pt"]))).write_bytes(b"x")
    elif kind == "symlink":  # the same bytes, through a link out of the directory
        outside = target.parent / f"outside-{name}"
        outside.write_bytes(raw)
        path.unlink()
        path.symlink_to(outside)
    elif kind == "dir":
        path.unlink()
        path.mkdir()
    else:  # a code-running pickle with a manifest that agrees with it
        victim = data.draw(st.sampled_from([n for n in names if n.endswith(".pt")]))
        state = torch.load(target / victim, weights_only=True)
        evil = {"state": state, "payload": Payload(marker)} if isinstance(state, dict) else state
        torch.save(evil, target / victim)
        manifest = json.loads((target / "manifest.json").read_text())
        manifest["files"][victim] = {"bytes": (target / victim).stat().st_size,
                                     "sha256": sha256(target / victim)}  # fmt: skip
        (target / "manifest.json").write_text(json.dumps(manifest))
    return kind, True
