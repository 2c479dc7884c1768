"""The process group a run starts, and the one collective each step makes (issue 45, item 1).

An nccl-only group serves ``cuda`` tensors alone: every collective on a host tensor or an object
(the eval gather, the GSNR records, a barrier) raises "No backend type associated with device
type cpu" in it. No GPU here, so the CUDA config's group is checked by what it registers, and
the step's agreement by the collectives it calls.
"""

from __future__ import annotations

import signal

import pytest
import torch
import torch.distributed as dist

import dlrm_vrgd.train.distributed as distributed
from dlrm_vrgd.train import stop
from dlrm_vrgd.train.distributed import DistEnv, init_from_env
from dlrm_vrgd.train.loop import NonFiniteError, Trainer

from ..conftest import tiny_config


def started_backend(monkeypatch: pytest.MonkeyPatch, device: str) -> str:
    """The backend ``init_from_env`` starts rank 1 of 2 with, for ``run.device: device``."""
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    seen: dict[str, object] = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: seen.setdefault("device", i))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    env = init_from_env(tiny_config(f"run.device={device}", "run.nproc_per_node=2"))
    assert env == DistEnv(rank=1, world_size=2, local_rank=1)
    if device == "cuda":
        assert seen["device"] == 1
    return str(seen["backend"])


def test_a_cuda_run_starts_a_group_that_serves_host_and_device_tensors(monkeypatch) -> None:
    backend = started_backend(monkeypatch, "cuda")
    served = dist.BackendConfig(backend).get_device_backend_map()
    # nccl for the device's tensors; host tensors and objects (object collectives and barrier
    # pick cpu where the group serves it) through gloo
    assert served == {"cpu": "gloo", "cuda": "nccl"}


def test_a_cpu_run_starts_gloo(monkeypatch) -> None:
    backend = started_backend(monkeypatch, "cpu")
    assert backend == "gloo"


def test_stop_flags_sum_to_the_signal_every_rank_stops_with(monkeypatch) -> None:
    monkeypatch.setattr(stop, "_requested", [])
    assert stop.flags() == [0.0, 0.0] and stop.agreed([0.0, 0.0]) is None
    stop._requested.append(signal.SIGINT)
    assert stop.flags() == [1.0, 0.0]
    assert stop.agreed([2.0, 0.0]) == "SIGINT"  # two ranks pressed Ctrl-C
    assert stop.agreed([1.0, 1.0]) == "SIGTERM"  # a scheduler's SIGTERM outranks it
    assert stop.agreed([0.0, 1.0]) == "SIGTERM"  # another rank's request alone


class PeerRank:
    """``dist.all_reduce`` as seen by rank 0 of 2: adds what rank 1 contributes and records
    every call's tensor."""

    def __init__(self, peer: list[float]) -> None:
        self.peer, self.calls = peer, []

    def __call__(self, tensor: torch.Tensor, *args, **kwargs) -> None:
        self.calls.append((tensor.device, tensor.dtype, tuple(tensor.shape)))
        tensor.add_(torch.tensor(self.peer, dtype=tensor.dtype, device=tensor.device))


def two_rank_trainer(
    monkeypatch: pytest.MonkeyPatch, peer: list[float]
) -> tuple[Trainer, PeerRank]:
    """A one-process trainer that believes it is rank 0 of 2, rank 1 contributing ``peer`` to
    each all-reduce (the dense optimizers reduce only within a started group: none here)."""
    trainer = Trainer(tiny_config("run.steps=4"))
    trainer.env = DistEnv(rank=0, world_size=2, local_rank=0)
    fake = PeerRank(peer)
    monkeypatch.setattr(distributed.dist, "all_reduce", fake)
    monkeypatch.setattr(stop, "_requested", [])
    return trainer, fake


def test_a_step_agrees_on_loss_and_stop_in_one_collective_on_the_run_s_device(monkeypatch) -> None:
    # rank 1: loss 3.0, no broken weight, SIGTERM requested
    trainer, fake = two_rank_trainer(monkeypatch, [3.0, 0.0, 0.0, 1.0])
    alone = Trainer(tiny_config("run.steps=4"))  # the same rows and weights on one process
    local = alone.train_step()["loss"]
    record = trainer.train_step()
    assert fake.calls == [(trainer.device, torch.float64, (4,))]  # loss, broken, two signals
    assert record["loss"] == pytest.approx((local + 3.0) / 2, rel=1e-6)
    assert trainer.stop_agreed == "SIGTERM"
    fake.peer = [3.0, 0.0, 0.0, 0.0]
    trainer.train_step()
    assert len(fake.calls) == 2 and trainer.stop_agreed is None


def test_a_dense_weight_made_infinite_stops_the_next_step_naming_it(monkeypatch) -> None:
    trainer, fake = two_rank_trainer(monkeypatch, [0.0, 0.0, 0.0, 0.0])
    name, weight = next(iter(trainer.model.named_dense_parameters()))
    update = trainer.dense_opt.step

    def poisoning_step(*args, **kwargs):
        update(*args, **kwargs)
        weight.data.view(-1)[0] = float("inf")

    monkeypatch.setattr(trainer.dense_opt, "step", poisoning_step)
    trainer.train_step()  # nothing read back after the update: the step completes
    with pytest.raises(NonFiniteError, match=f"step 1: dense parameter {name} is not finite"):
        trainer.train_step()
    assert len(fake.calls) == 2


def test_another_rank_s_infinite_weight_stops_this_one_too(monkeypatch) -> None:
    trainer, _ = two_rank_trainer(monkeypatch, [0.0, 1.0, 0.0, 0.0])
    with pytest.raises(NonFiniteError, match="step 0: a dense parameter of another rank"):
        trainer.train_step()
