"""Run a function on N real processes joined in a gloo process group."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(
    rank: int, fn: Callable[..., Any], world: int, store: str, out: str, args: tuple
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, tmp: Path, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned processes; returns each rank's result."""
    tmp.mkdir(parents=True, exist_ok=True)
    store = tmp / "store"
    mp.spawn(_entry, args=(fn, world, str(store), str(tmp), args), nprocs=world, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(world)]


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def rank_pids(launcher: int) -> list[int]:
    """The ranks of a ``dlrm-vrgd train`` launcher: the children of its child, torchrun."""
    return sorted(pid for child in children(launcher) for pid in children(child))


def final_state(run: Path, step: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Dense parameters (rank 0) and every table, gathered from all ranks' shards of the
    checkpoint of ``step`` in run directory ``run``."""
    ckpt = run / "checkpoints" / f"step_{step:08d}"
    states = [torch.load(p, weights_only=True) for p in sorted(ckpt.glob("rank*.pt"))]
    tables = {
        n: w
        for s in states
        for t in s["tables"]
        for n, w in zip(t["names"], t["weights"], strict=True)
    }
    return states[0]["dense"], tables
