"""torchrec's own DLRM under DistributedModelParallel, its dense layers trained by VRGD.

    python examples/torchrec_dlrm.py                      # tiny defaults, 1 process, a CPU
    python examples/torchrec_dlrm.py --tables gsnr        # GSNR row-wise tables instead
    python examples/torchrec_dlrm.py --nproc 2            # 2 gloo ranks

The model is ``torchrec.models.dlrm.DLRM`` — not this project's — sharded by torchrec's planner
and ``DistributedModelParallel`` (table-wise, on the CPU). Nothing here is the project's trainer:

* **dense layers**: a VRGD optimizer (``dlrm_vrgd.optim.VRAdam`` by default) on the model's
  non-embedding parameters, driven by the group protocol — ``collect()`` after each
  micro-batch's backward, ``step()`` once per global step. DMP is built with
  ``init_data_parallel=False`` (no DDP): the optimizer all-reduces its own sums ``S``, ``Q``
  and ``k`` across the ranks at ``step()`` (``process_group``), so every rank's micro-batch
  stays its own gradient group.
* **tables**, chosen by ``--tables`` (the one-line swap is ``make_tables`` below):
  ``fused`` — torchrec's fused row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD inside the
  backward of every micro-batch, as torchrec trains); ``gsnr`` — the same FBGEMM shards
  wrapped by this project's ``TBELookup`` and updated once per global step by
  ``SparseRowwiseOptimizer`` with the row-wise GSNR ratio (DESIGN.md 4.3).

Prints each step's loss (the mean over the global batch) and, last, ``final loss: <x>``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbeddingBag
from torchrec.distributed.comm_ops import set_gradient_division
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import (
    HardwareConfig,
    KernelConfig,
    ParameterConstraints,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm_vrgd.embedding.fbgemm import FUSED_OPTIMIZERS, TBELookup
from dlrm_vrgd.optim import VR_OPTIMIZERS
from dlrm_vrgd.optim.sparse import SparseRowwiseOptimizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--tables",
        choices=("fused", "gsnr"),
        default="fused",
        help="fused: torchrec's fused row-wise Adagrad; gsnr: the GSNR table optimizer",
    )
    p.add_argument("--dense", choices=sorted(VR_OPTIMIZERS), default="vradam")
    p.add_argument("--nproc", type=int, default=1, help="gloo ranks on this machine")
    p.add_argument("--steps", type=int, default=60, help="global steps")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches a rank a step")
    p.add_argument("--micro-batch", type=int, default=64, help="rows a micro-batch")
    p.add_argument("--tables-n", type=int, default=4, help="embedding tables")
    p.add_argument("--rows", type=int, default=1000, help="rows a table")
    p.add_argument("--dim", type=int, default=16, help="embedding dimension")
    p.add_argument("--dense-features", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.01, help="dense learning rate")
    p.add_argument("--table-lr", type=float, default=0.05)
    p.add_argument("--gamma", type=float, default=0.3, help="GSNR lower clip (dense, tables)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data
def micro_batch(args: argparse.Namespace, step: int, group: int):  # noqa: ANN201
    """Rows of gradient group ``group`` (``rank·A + j``) in global step ``step``: dense features
    ``B x F``, one id per table (a KJT of ``T x B`` bags, Zipf-like ids) and labels ``B`` drawn
    from a fixed logistic model of both."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + group)
    b, t = args.micro_batch, args.tables_n
    dense = torch.randn(b, args.dense_features, generator=g)
    ids = (torch.rand(t, b, generator=g) ** 3 * args.rows).long()  # skewed: low ids are hot
    truth = torch.Generator().manual_seed(12345)  # the same hidden model on every call
    w_dense = torch.randn(args.dense_features, generator=truth)
    w_ids = torch.randn(t, args.rows, generator=truth)
    logit = dense @ w_dense * 0.5 + w_ids.gather(1, ids).sum(0)
    labels = (torch.rand(b, generator=g) < torch.sigmoid(logit)).float()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(t)],
        values=ids.reshape(-1),
        lengths=torch.ones(t * b, dtype=torch.int32),
    )
    return dense, kjt, labels


# ---------------------------------------------------------------------------- model
def build_model(args: argparse.Namespace, world: int) -> nn.Module:
    """torchrec's DLRM, its tables sharded table-wise by torchrec's planner and DMP."""
    torch.manual_seed(args.seed)  # the same dense layers on every rank
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows,
                           feature_names=[f"f{i}"])
        for i in range(args.tables_n)
    ]  # fmt: skip
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables, device=torch.device("meta")),
        dense_in_features=args.dense_features,
        dense_arch_layer_sizes=[32, args.dim],
        over_arch_layer_sizes=[32, 1],
    )
    # The fused kernel of the shards: the update itself with --tables fused; the kernel the GSNR
    # optimizer replays its once-a-step update through with --tables gsnr.
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": FUSED_OPTIMIZERS["rowwise_adagrad"],
            "learning_rate": args.table_lr,
            "eps": 1e-8,
        }
    )
    planner = EmbeddingShardingPlanner(
        topology=TopologyFactory.create_topology(
            TrainerConfig(world_size=world, local_world_size=world),
            HardwareConfig(),
            KernelConfig(compute_device="cpu"),
        ),
        constraints={t.name: ParameterConstraints(sharding_types=["table_wise"]) for t in tables},
        batch_size=args.micro_batch,
        storage_reservation=FixedPercentageStorageReservation(0.15),
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
        init_data_parallel=False,  # no DDP: the VRGD optimizer all-reduces its own sums
    )  # fmt: skip
    for p in dense_parameters(dmp).values():
        dist.broadcast(p.data, src=0)
    return dmp


def dense_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Everything but the tables: what the dense optimizer trains."""
    return {n: p for n, p in model.named_parameters() if "embedding_bag_collection" not in n}


# ----------------------------------------------------------------------------- tables
class FusedTables:
    """torchrec's fused optimizer: it already updated the tables in each backward."""

    def collect(self) -> None:
        pass

    def step(self) -> None:
        pass


def gsnr_tables(model: nn.Module, args: argparse.Namespace, world: int) -> SparseRowwiseOptimizer:
    """Every FBGEMM shard DMP built on this rank, as this project's :class:`TBELookup`, updated
    once per global step by the GSNR row-wise optimizer. Its owner receives the bags of every
    rank (``world`` groups a micro-batch)."""
    lookups = []
    for module in model.modules():
        if isinstance(module, ShardedEmbeddingBagCollection):
            for grouped in module._lookups:
                for kernel in grouped.modules():
                    if isinstance(kernel, BaseBatchedEmbeddingBag):
                        names = [t.name for t in kernel.config.embedding_tables]
                        lookups.append(TBELookup(kernel.emb_module, names, groups_per_call=world))
    return SparseRowwiseOptimizer(
        lookups, lr=args.table_lr, gsnr=True, gamma=args.gamma, groups_per_collect=world
    )


def make_tables(model: nn.Module, args: argparse.Namespace, world: int) -> Any:
    # ---- the one-line swap: torchrec's fused row-wise Adagrad, or the GSNR table optimizer
    return FusedTables() if args.tables == "fused" else gsnr_tables(model, args, world)


# ------------------------------------------------------------------------------ train
def train(rank: int, world: int, args: argparse.Namespace) -> float:
    # torchrec divides the tables' gradients by the world size in the all-to-all's backward
    # (DDP's averaged dense gradients); the GSNR groups must each carry their own mean-loss
    # gradient. Set before the model is sharded.
    set_gradient_division(args.tables == "fused")
    model = build_model(args, world)
    dense_opt = VR_OPTIMIZERS[args.dense](
        list(dense_parameters(model).items()), lr=args.lr, gamma=args.gamma,
        process_group=dist.group.WORLD,
    )  # fmt: skip
    tables = make_tables(model, args, world)
    loss_fn = nn.BCEWithLogitsLoss()
    a = args.micro_batches
    loss = float("nan")
    for step in range(args.steps):
        losses = []
        for j in range(a):
            dense, kjt, labels = micro_batch(args, step, rank * a + j)
            mb_loss = loss_fn(model(dense, kjt).squeeze(-1), labels)
            mb_loss.backward()
            dense_opt.collect()  # this micro-batch is one gradient group
            tables.collect()
            losses.append(mb_loss.detach())
        dense_opt.step()  # all-reduces S, Q and k across the ranks, then updates once
        tables.step()
        mean = torch.stack(losses).mean()
        dist.all_reduce(mean)
        loss = float(mean) / world
        if rank == 0:
            print(f"step {step + 1:3d}  loss {loss:.4f}", flush=True)
    return loss


def _rank(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        t0 = time.perf_counter()
        loss = train(rank, world, args)
        if rank == 0:
            print(f"tables: {args.tables}, dense: {args.dense}, ranks: {world}, "
                  f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
            print(f"final loss: {loss:.6f}", flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        try:
            loss = train(dist.get_rank(), dist.get_world_size(), args)
            if dist.get_rank() == 0:
                print(f"final loss: {loss:.6f}", flush=True)
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        if args.nproc == 1:
            _rank(0, 1, store, args)
        else:
            mp.spawn(_rank, args=(args.nproc, store, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
