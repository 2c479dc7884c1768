"""Shared helpers of the deployment tests: where the files are, a Dockerfile reader, and the
Compose files loaded as Compose reads them (``!reset`` / ``!override`` tags included)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = {"gpu": DOCKER / "Dockerfile.gpu", "cpu": DOCKER / "Dockerfile.cpu"}
COMPOSE = DOCKER / "docker-compose.yml"
MULTINODE = DOCKER / "docker-compose.multinode.yml"
WORKER = DOCKER / "docker-compose.worker.yml"
CPU_COMPOSE = DOCKER / "docker-compose.cpu.yml"
COMPOSE_FILES = (COMPOSE, MULTINODE, WORKER, CPU_COMPOSE)


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: keyword (upper case), its arguments, its stage index."""

    keyword: str
    args: str
    stage: int
    line: int


def instructions(path: Path) -> list[Instruction]:
    """The instructions of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[Instruction] = []
    stage = -1
    pending = ""
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = pending + line
        pending = ""
        keyword, _, args = text.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, " ".join(args.split()), stage, start))
    return out


# ----------------------------------------------------------------------------- compose
class Tagged:
    """A value carrying a Compose merge tag (``!reset`` or ``!override``)."""

    def __init__(self, tag: str, value: Any) -> None:
        self.tag = tag
        self.value = value

    def __repr__(self) -> str:
        return f"{self.tag} {self.value!r}"


class ComposeLoader(yaml.SafeLoader):
    """YAML as Compose reads it: plain YAML plus the ``!reset`` and ``!override`` tags."""


def _tagged(tag: str) -> Any:
    def construct(loader: yaml.SafeLoader, node: yaml.Node) -> Tagged:
        if isinstance(node, yaml.SequenceNode):
            value: Any = loader.construct_sequence(node, deep=True)
        elif isinstance(node, yaml.MappingNode):
            value = loader.construct_mapping(node, deep=True)
        else:
            value = loader.construct_scalar(node)  # type: ignore[arg-type]
        return Tagged(tag, value)

    return construct


ComposeLoader.add_constructor("!reset", _tagged("!reset"))
ComposeLoader.add_constructor("!override", _tagged("!override"))


def load_compose(path: Path) -> dict[str, Any]:
    data = yaml.load(path.read_text(), Loader=ComposeLoader)  # a SafeLoader subclass
    assert isinstance(data, dict)
    return data


def untag(value: Any) -> Any:
    """The document with tags replaced by their values (what the schema sees)."""
    if isinstance(value, Tagged):
        return untag(value.value)
    if isinstance(value, dict):
        return {k: untag(v) for k, v in value.items()}
    if isinstance(value, list):
        return [untag(v) for v in value]
    return value


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])((?:[^{}]|\{[^{}]*\})*))?\}")


class MissingVariable(KeyError):
    """A ``${NAME:?message}`` whose variable is unset or empty."""


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ``${NAME}``, ``${NAME:-default}``, ``${NAME-default}``, ``${NAME:?err}`` and
    ``${NAME?err}`` substitution, applied to every string of a loaded document."""
    if isinstance(value, Tagged):
        return Tagged(value.tag, interpolate(value.value, env))
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        current = env.get(name)
        unset_or_empty = current is None or (op is not None and op.startswith(":") and not current)
        if op in (":-", "-"):
            return interpolate(arg, env) if unset_or_empty else str(current)
        if op in (":?", "?"):
            if unset_or_empty:
                raise MissingVariable(f"{name}: {arg}")
            return str(current)
        return current or ""

    return _VAR.sub(sub, value.replace("$$", "\0")).replace("\0", "$")
