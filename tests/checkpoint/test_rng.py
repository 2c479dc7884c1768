"""The generators a checkpoint keeps (issue 45, item 5): the CPU one always, the rank's CUDA one
on a GPU (FBGEMM draws fp16 tables' stochastic rounding from it). No GPU here: the CUDA
generator is a stand-in that records what it is asked, the rest runs as is."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import dlrm_vrgd.checkpoint as ckpt
from dlrm_vrgd.checkpoint import rng
from dlrm_vrgd.checkpoint.reshard import FullState, rank_state
from dlrm_vrgd.train.loop import Trainer

from ..conftest import tiny_config

GPU = torch.device("cuda", 1)


class FakeCudaGenerator:
    """``torch.cuda.get_rng_state``/``set_rng_state`` of one device, as plain state."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.state = torch.arange(16, dtype=torch.uint8)
        self.asked: list[torch.device] = []
        monkeypatch.setattr(torch.cuda, "get_rng_state", self.get)
        monkeypatch.setattr(torch.cuda, "set_rng_state", self.set)

    def get(self, device: torch.device) -> torch.Tensor:
        self.asked.append(device)
        return self.state.clone()

    def set(self, state: torch.Tensor, device: torch.device) -> None:
        self.asked.append(device)
        self.state = state.clone()


def test_a_cpu_rank_keeps_the_cpu_generator_alone_and_draws_the_same_after_restore() -> None:
    torch.manual_seed(5)
    state = rng.capture(torch.device("cpu"))
    assert set(state) == {"torch"}
    first = torch.rand(4)
    torch.manual_seed(6)
    rng.restore(state, torch.device("cpu"))
    assert torch.equal(torch.rand(4), first)


def test_a_gpu_rank_keeps_its_own_device_s_generator_and_gets_it_back(monkeypatch) -> None:
    gen = FakeCudaGenerator(monkeypatch)
    state = rng.capture(GPU)
    assert torch.equal(state["cuda"], torch.arange(16, dtype=torch.uint8))
    gen.state = torch.zeros(16, dtype=torch.uint8)  # the run drew on
    rng.restore(state, GPU)
    assert torch.equal(gen.state, torch.arange(16, dtype=torch.uint8))
    assert gen.asked == [GPU, GPU]  # this rank's device, not the current or the first one
    assert rng.problem(state) is None


def test_a_checkpoint_without_a_cuda_generator_resumes_on_a_gpu_from_the_seed(
    monkeypatch, caplog
) -> None:
    gen = FakeCudaGenerator(monkeypatch)
    with caplog.at_level(logging.INFO, logger=rng.__name__):
        rng.restore({"torch": torch.get_rng_state()}, GPU)
    assert gen.asked == [] and "keeps no CUDA generator" in caplog.text


BAD = [
    (None, "no torch generator"),
    ({"cuda": torch.zeros(4, dtype=torch.uint8)}, "no torch generator"),
    ({"torch": [1, 2]}, "no torch generator"),
    ({"torch": torch.zeros(4)}, "rng.torch is not a uint8 vector"),
    ({"torch": torch.zeros(2, 2, dtype=torch.uint8)}, "rng.torch is not a uint8 vector"),
    ({"torch": torch.zeros(4, dtype=torch.uint8), "cuda": "abc"}, "rng.cuda is not a uint8"),
    ({"torch": torch.zeros(4, dtype=torch.uint8), "cuda": torch.zeros(3, dtype=torch.int64)},
     "rng.cuda is not a uint8"),
    ({"torch": torch.zeros(4, dtype=torch.uint8), "mps": torch.zeros(4, dtype=torch.uint8)},
     "unknown generators ['mps']"),
]  # fmt: skip


@pytest.mark.parametrize(("value", "says"), BAD)
def test_a_generator_state_of_the_wrong_kind_is_refused_before_use(value, says: str) -> None:
    assert says in (rng.problem(value) or "")


def test_a_checkpoint_with_a_forged_cuda_generator_is_refused(monkeypatch, tmp_path: Path) -> None:
    trainer = Trainer(tiny_config("run.steps=1"))
    real = trainer.state_dict

    def forged() -> dict:
        state = real()
        state["rng"]["cuda"] = torch.zeros(8, dtype=torch.float32)
        return state

    monkeypatch.setattr(trainer, "state_dict", forged)
    trainer.save_checkpoint(tmp_path)
    [written] = ckpt.list_checkpoints(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="rng.cuda is not a uint8 vector"):
        ckpt.load_rank_state(written, 0)


def test_a_resharded_rank_takes_the_cuda_generator_of_the_rank_with_its_number() -> None:
    cpu = torch.zeros(8, dtype=torch.uint8)
    per_rank = [torch.full((8,), r, dtype=torch.uint8) for r in range(2)]
    rank0 = {"rng": {"torch": cpu, "cuda": per_rank[0]}, "sparse_opt": {}}
    full = FullState(3, 2, {}, {}, rank0, per_rank)
    assert torch.equal(rank_state(full, [], False, rank=1)["rng"]["cuda"], per_rank[1])
    assert torch.equal(rank_state(full, [], False, rank=0)["rng"]["cuda"], per_rank[0])
    assert torch.equal(rank_state(full, [], False, rank=1)["rng"]["torch"], cpu)
    # a rank the writing run did not have, or one that ran on the CPU, starts from the seed
    assert "cuda" not in rank_state(full, [], False, rank=2)["rng"]
    cpu_run = FullState(3, 2, {}, {}, {"rng": {"torch": cpu}, "sparse_opt": {}}, [None, None])
    assert "cuda" not in rank_state(cpu_run, [], False, rank=1)["rng"]
