"""Several processes: the process group, torchrec sharding of the tables, and rank helpers.

Launch: ``dlrm-vrgd train`` with ``run.nproc_per_node × run.nnodes > 1`` re-executes itself
under torchrun (:func:`torchrun_command`); each rank then joins the process group from
torchrun's environment (:func:`init_from_env`: gloo on CPU; on CUDA one group with two
backends, ``cpu:gloo,cuda:nccl``, :func:`process_group_backend`).

Where each collective runs: a tensor's device picks the backend. Device tensors (the dense
optimizers' gradient sums, torchrec's all-to-alls, the step's one agreement of loss, stop
requests and finiteness through :func:`summed`) go through nccl; host tensors and Python
objects (the eval gather, the GSNR records, :func:`rank0_decides`, :func:`barrier`, the
planner's plan) through gloo. An nccl-only group has no backend for the ``cpu`` device type,
and every one of those would raise
"No backend type associated with device type cpu".

Layout of one global step of ``G = W × A × B`` rows over ``W`` ranks:

* dense layers are replicated (identical seeds, then a broadcast from rank 0); their optimizer
  all-reduces the step's gradient sums once per step (``process_group`` of the dense
  optimizers) — torchrec's DDP wrapping is turned off;
* embedding tables are sharded by torchrec's ``DistributedModelParallel`` with the planner
  restricted to ``run.sharding`` (table-wise and column-wise run on CPU; row-wise needs a GPU,
  :func:`check_sharding`;
  data-parallel tables are refused: torchrec would train them with the dense optimizer and
  silently ignore the sparse one). The FBGEMM TBE of every shard becomes a
  :class:`~dlrm_vrgd.embedding.fbgemm.TBELookup`: its owner receives the bags of all ``W``
  ranks, rank after rank, so each micro-batch contributes ``W`` gradient groups to the shard's
  row statistics and a step ``k = W × A`` groups (DESIGN.md 4.3).
* A column-wise shard holds a slice of each row; its GSNR ratio is computed on that slice
  (per shard), which equals the whole-row ratio only when the table is not split.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from dlrm_vrgd.config import TrainConfig
from dlrm_vrgd.embedding.init import table_init

if TYPE_CHECKING:
    from dlrm_vrgd.embedding.fbgemm import TBELookup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux
    ``prctl(PR_SET_PDEATHSIG)``): a rank must not outlive torchrun (the ``dlrm-vrgd train``
    launcher execs into it), even when that is SIGKILLed and cannot stop its children."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return
    if os.getppid() != parent:  # the parent died before the prctl
        os.kill(os.getpid(), sig)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def init_from_env(cfg: TrainConfig) -> DistEnv:
    """Join the process group that torchrun set up (a no-op for a single process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return DistEnv()
    if world != cfg.run.world_size:
        raise RuntimeError(
            f"torchrun started {world} processes, the config asks for "
            f"run.nnodes x run.nproc_per_node = {cfg.run.world_size}"
        )
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if cfg.run.device == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=process_group_backend(cfg.run.device),
            timeout=datetime.timedelta(seconds=cfg.run.collective_timeout_s),
        )
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank)


def process_group_backend(device: str) -> str:
    """The process group's backend for ``run.device``: gloo on the CPU; on CUDA nccl for device
    tensors *and* gloo for host tensors and objects (see the module docstring)."""
    return "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"


#: The sharding types torchrec's ``EmbeddingBagCollectionSharder`` offers a CPU (compute
#: device ``cpu``) rank; row_wise is not among them (its planner refuses it there).
CPU_SHARDING_TYPES = ("table_wise", "column_wise", "table_column_wise")


def check_sharding(cfg: TrainConfig) -> None:
    """Refuse (``ValueError``) a CPU job of several ranks whose ``run.sharding`` leaves
    torchrec's planner no type it can use on the CPU (``row_wise`` alone), before any rank
    starts: each rank would otherwise fail in the planner with "No available sharding type"."""
    if cfg.run.device != "cpu" or cfg.run.world_size == 1:
        return
    if not set(cfg.run.sharding) & set(CPU_SHARDING_TYPES):
        raise ValueError(
            f"run.sharding {list(cfg.run.sharding)}: torchrec shards tables on the CPU "
            f"{', '.join(CPU_SHARDING_TYPES)} only (row_wise needs run.device cuda); "
            "add one of those"
        )


def torchrun_command(cfg: TrainConfig, argv: list[str]) -> list[str]:
    """The torchrun command line that runs ``python -m dlrm_vrgd.cli <argv>`` on every rank."""
    run = cfg.run
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={run.nproc_per_node}",
        f"--nnodes={run.nnodes}",
        "--max_restarts=0",
    ]
    if run.nnodes == 1 and run.rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        if run.rdzv_endpoint is None:
            raise ValueError("run.rdzv_endpoint (HOST:PORT) is required when run.nnodes > 1")
        cmd += [
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={run.rdzv_endpoint}",
            f"--rdzv_id={run.rdzv_id}",
        ]
    return cmd + ["-m", "dlrm_vrgd.cli", *argv]


# ---------------------------------------------------------------------------------- sharding
def shard_model(model: nn.Module, cfg: TrainConfig, env: DistEnv) -> nn.Module:
    """Shard the model's ``EmbeddingBagCollection`` (built on the meta device) over the ranks
    with torchrec's planner and DMP; dense modules stay as they are (no DDP)."""
    from torchrec.distributed.comm_ops import set_gradient_division
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.storage_reservations import (
        FixedPercentageStorageReservation,
    )
    from torchrec.distributed.planner.types import (
        HardwareConfig,
        KernelConfig,
        ParameterConstraints,
        TopologyFactory,
        TrainerConfig,
    )

    from dlrm_vrgd.embedding.fbgemm import FUSED_OPTIMIZERS

    check_sharding(cfg)
    # torchrec divides the pooled-embedding gradients by W in the all-to-all backward (to match
    # DDP's averaged dense gradients); our groups must each carry their own mean-loss gradient.
    set_gradient_division(False)
    sparse = cfg.optim.sparse
    device = torch.device(cfg.run.device, env.local_rank) if cfg.run.device == "cuda" else None
    device = device or torch.device("cpu")
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": FUSED_OPTIMIZERS[sparse.kernel],
            "learning_rate": sparse.lr,
            "eps": sparse.eps,
        }
    )
    ebc = model.dlrm.sparse_arch.embedding_bag_collection  # type: ignore[union-attr]
    constraints = {
        t.name: ParameterConstraints(sharding_types=list(cfg.run.sharding))
        for t in ebc.embedding_bag_configs()
    }
    topology = TopologyFactory.create_topology(
        TrainerConfig(world_size=env.world_size, local_world_size=cfg.run.nproc_per_node),
        HardwareConfig(),
        KernelConfig(compute_device=device.type),
    )
    planner = EmbeddingShardingPlanner(
        topology=topology,
        constraints=constraints,
        batch_size=cfg.run.micro_batch,
        storage_reservation=FixedPercentageStorageReservation(0.15),
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(
        model, device=device, plan=plan, sharders=[sharder], init_data_parallel=False
    )
    for name, p in dense_parameters(model):
        dist.broadcast(p.data, src=0)
        logger.debug("broadcast %s", name)
    return dmp


def dense_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters outside the embedding tables (trained by the dense optimizer)."""
    return [(n, p) for n, p in model.named_parameters() if ".sparse_arch." not in f".{n}"]


def sharded_lookups(
    model: nn.Module, env: DistEnv, seed: int, table_names: list[str]
) -> list[TBELookup]:
    """One :class:`TBELookup` per FBGEMM TBE that DMP built on this rank, its tables set to
    their :func:`table_init` values (the same numbers a single process would draw for table
    ``table_names.index(name)``)."""
    from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbeddingBag
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    from dlrm_vrgd.embedding.fbgemm import TBELookup

    lookups = []
    for module in model.modules():
        if not isinstance(module, ShardedEmbeddingBagCollection):
            continue
        for grouped in module._lookups:  # torchrec keeps them in a plain list
            for kernel in grouped.modules():
                if not isinstance(kernel, BaseBatchedEmbeddingBag):
                    continue
                tables = kernel.config.embedding_tables
                labels = [_shard_label(t) for t in tables]
                lookup = TBELookup(
                    kernel.emb_module,
                    labels,
                    weighted=kernel.config.is_weighted,
                    groups_per_call=env.world_size,
                )
                with torch.no_grad():
                    for t, w in zip(tables, lookup.table_weights(), strict=True):
                        full = table_init(
                            seed, table_names.index(t.name), t.num_embeddings, t.embedding_dim
                        )
                        r0, c0 = t.local_metadata.shard_offsets
                        w.copy_(full[r0 : r0 + t.local_rows, c0 : c0 + t.local_cols])
                lookups.append(lookup)
    return lookups


def _shard_label(table: Any) -> str:
    r0, c0 = table.local_metadata.shard_offsets
    whole = table.local_rows == table.num_embeddings and table.local_cols == table.embedding_dim
    return (
        table.name
        if whole
        else f"{table.name}[rows {r0}+{table.local_rows}, cols {c0}+{table.local_cols}]"
    )


# ------------------------------------------------------------------------------- collectives
def summed(values: torch.Tensor, env: DistEnv) -> list[float]:
    """``values``, a small vector, summed over the ranks and read back to the host: one
    collective on the tensor's own device (nccl for a CUDA tensor, gloo for a host one) and one
    read-back."""
    if env.distributed:
        dist.all_reduce(values)
    return values.tolist()


def gather_objects(obj: Any, env: DistEnv) -> list[Any]:
    if not env.distributed:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def all_gather_rows(tensor: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Concatenate equal-sized tensors from every rank, rank order."""
    if not env.distributed:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(env.world_size)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def rank0_decides(flag: bool, env: DistEnv) -> bool:
    """Rank 0's ``flag`` on every rank (for decisions from a clock, which ranks do not share)."""
    if not env.distributed:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.broadcast(t, src=0)
    return bool(t[0])


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()
